"""The one error type the records tool raises for bad input; the CLI prints it as a single line."""

from __future__ import annotations

from collections.abc import Sequence


class RecordsError(Exception):
    """A user-facing problem: the message names the file or value and says what to do.

    The message stays one short line (under 200 characters where the paths allow); `detail` holds the
    long form (every file, every differing setting), which the CLI prints only with --verbose.
    """

    def __init__(self, message: str, detail: Sequence[str] = ()) -> None:
        super().__init__(message)
        self.detail = list(detail)
