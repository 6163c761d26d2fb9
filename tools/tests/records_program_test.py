"""The program hash: comments, docstrings and layout do not count; code, strings and file names do."""

from __future__ import annotations

import records_fixtures  # noqa: F401  (puts tools/ on sys.path)

from recordkit.program import normalized_tokens, program_hash

BASE = '''"""Module docstring."""
import math


class Model:
    """Class docstring."""

    def forward(self, x, scale=0.5):
        """Function docstring."""
        # a comment
        return math.tanh(x * scale) + len("abc")
'''

SAME_PROGRAM = {
    "docstrings reworded": BASE.replace("Module docstring.", "Another module docstring, longer.")
                               .replace("Function docstring.", "Says what forward does."),
    "docstrings removed": BASE.replace('"""Module docstring."""\n', "").replace('        """Function docstring."""\n', ""),
    "comments changed": BASE.replace("# a comment", "# a different comment") + "# trailing comment\n",
    "blank lines": BASE.replace("\n\n\nclass", "\nclass").replace("import math\n", "import math\n\n\n\n"),
    "line wrapped in brackets": BASE.replace("math.tanh(x * scale)", "math.tanh(\n            x * scale\n        )"),
    "other quotes": BASE.replace('len("abc")', "len('abc')"),
    "indented by two": BASE.replace("    ", "  "),
    "spaces around operators": BASE.replace("x * scale", "x*scale"),
}

OTHER_PROGRAM = {
    "a constant": BASE.replace("scale=0.5", "scale=0.6"),
    "a string that is not a docstring": BASE.replace('len("abc")', 'len("abcd")'),
    "an operator": BASE.replace("x * scale", "x / scale"),
    "a statement moved out of the function": BASE.replace("        return math.tanh", "    return math.tanh"),
}


def test_comments_docstrings_and_layout_do_not_change_the_program() -> None:
    base = program_hash({"__script__": BASE})
    for what, text in SAME_PROGRAM.items():
        assert program_hash({"__script__": text}) == base, what


def test_code_changes_change_the_program() -> None:
    base = program_hash({"__script__": BASE})
    for what, text in OTHER_PROGRAM.items():
        assert program_hash({"__script__": text}) != base, what
    assert program_hash({"kernels.py": BASE}) != base  # the same text under another file name


def test_text_that_is_not_python_is_compared_line_by_line() -> None:
    broken = BASE + "def (\n"  # a syntax error: not tokenized as Python
    assert normalized_tokens(broken)[:2] == ['"""Module docstring."""', "import math"]
    assert normalized_tokens("set x = 1  \n\n  run it\n") == ["set x = 1", "run it"]
    assert program_hash({"run.sh": "set x = 1\n\nrun it\n"}) == program_hash({"run.sh": "  set x = 1\nrun it  \n"})
    assert program_hash({"run.sh": "set x = 1\nrun it\n"}) != program_hash({"run.sh": "set x = 2\nrun it\n"})
