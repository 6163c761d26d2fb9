"""The one error type the records tool raises for bad input; the CLI prints it as a single line."""


class RecordsError(Exception):
    """A user-facing problem: the message names the file or value and says what to do."""
