"""The program a log embeds, independent of its comments, docstrings and layout.

Two logs run the same program when their embedded sources give the same token stream once comments,
docstrings, blank lines and line breaks inside brackets are dropped, indentation is reduced to its
structure, and string literals are compared by value. Published records are split this way in practice:
the four logs of record 2025-09-23 (MuonCustomSizing) embed scripts that differ only in a docstring.

Literals that only name a run, seed it or log it (`run_id: str = "ImprovedLMHead_eval248_2"`, `SEED = 8`, a
log path, the text of a print) differ between the runs of one configuration by design, as record 2026-02-10
(ShortWindow) and Track 3 results #14 and #31 show: they count as one placeholder.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import tokenize

_DROPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
# Names whose assigned literals only name, seed or place the logs of a run (compared without the underscores
# around them and in lower case, so RUN_ID, run_id and _run_id are one name).
PER_RUN_NAMES = frozenset({"run_id", "run_name", "run_tag", "seed", "log_dir", "logdir", "log_path", "log_file", "logfile"})
PER_RUN_PLACEHOLDER = "<per-run literal>"
# Calls whose literal arguments only log: the scripts' print helpers, and the folder a run logs into.
LOGGING_CALLS = frozenset({"print", "print0", "makedirs"})
_STRUCTURE_ONLY = {tokenize.INDENT, tokenize.DEDENT, tokenize.NEWLINE}  # their text is layout

Span = tuple[tuple[int, int], tuple[int, int]]


def program_hash(sources: dict[str, str]) -> str:
    """sha256 over every embedded file's normalized form (file names included: moving code is a change)."""
    digest = hashlib.sha256()
    for name, text in sources.items():
        digest.update(name.encode() + b"\0" + _file_digest(text))
    return digest.hexdigest()


@functools.lru_cache(maxsize=4096)
def _file_digest(text: str) -> bytes:
    # Cached: the runs of one folder usually embed the same files, and tokenizing is the slow part of parsing.
    digest = hashlib.sha256()
    for token in normalized_tokens(text):
        digest.update(token.encode() + b"\0")
    return digest.digest()


def normalized_tokens(text: str) -> list[str]:
    """The Python token stream without comments, docstrings and layout; other text: its non-blank lines, stripped."""
    tokens = _python_tokens(text)
    if tokens is None:
        return [line.strip() for line in text.splitlines() if line.strip()]
    return tokens


def _python_tokens(text: str) -> list[str] | None:
    try:
        tree = ast.parse(text)
        raw = list(tokenize.generate_tokens(io.StringIO(text).readline))
    except (SyntaxError, ValueError, tokenize.TokenError):  # not Python (or cut off): compared as plain lines
        return None
    lines = text.splitlines(keepends=True)
    docstrings = [_char_span(span, lines) for span in _docstring_spans(tree)]
    per_run = _outermost([_char_span(span, lines) for span in _per_run_literal_spans(tree)])
    next_literal = 0  # tokens come in order: the per-run spans are walked once
    out: list[str] = []
    skip_newline = False
    last_literal: Span | None = None
    for token in raw:
        if token.type in _DROPPED:
            continue
        if token.type == tokenize.STRING and _inside(token, docstrings):
            skip_newline = True  # and the end of the docstring's statement, so adding one changes nothing
            continue
        if skip_newline and token.type == tokenize.NEWLINE:
            skip_newline = False
            continue
        skip_newline = False
        while next_literal < len(per_run) and per_run[next_literal][1] <= token.start:
            next_literal += 1
        literal = per_run[next_literal] if next_literal < len(per_run) and _contains(per_run[next_literal], token) else None
        if literal is not None:
            if literal != last_literal:  # one placeholder per literal (Python 3.12 splits an f-string into tokens)
                out.append(PER_RUN_PLACEHOLDER)
            last_literal = literal
            continue
        last_literal = None
        if token.type in _STRUCTURE_ONLY:
            out.append(tokenize.tok_name[token.type])
        elif token.type == tokenize.STRING:
            out.append(_string_value(token.string))
        else:
            out.append(token.string)
    return out


def _inside(token: tokenize.TokenInfo, spans: list[Span]) -> bool:
    return any(_contains(span, token) for span in spans)


def _contains(span: Span, token: tokenize.TokenInfo) -> bool:
    return span[0] <= token.start and token.end <= span[1]


def _outermost(spans: list[Span]) -> list[Span]:
    """The spans in order, each nested one (a constant inside an f-string) folded into the one holding it."""
    merged: list[Span] = []
    for start, end in sorted(spans):
        if merged and start < merged[-1][1]:
            merged[-1] = (merged[-1][0], max(end, merged[-1][1]))
        else:
            merged.append((start, end))
    return merged


def _per_run_literal_spans(tree: ast.Module) -> list[Span]:
    """The literals assigned (or passed as keyword arguments) to a name in PER_RUN_NAMES, and those passed to a
    call in LOGGING_CALLS."""
    values: list[ast.expr] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign) and any(_is_per_run(target) for target in node.targets):
            values.append(node.value)
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _is_per_run(node.target):
            values.append(node.value)
        elif isinstance(node, ast.keyword) and node.arg is not None and _per_run_name(node.arg):
            values.append(node.value)
        elif isinstance(node, ast.Call) and _called_name(node.func) in LOGGING_CALLS:
            values += [arg for arg in node.args if isinstance(arg, (ast.Constant, ast.JoinedStr))]
    # An f-string is one token: its span, not those of the constants inside it, is what the tokens are matched with.
    return [_span(literal) for value in values for literal in ast.walk(value) if isinstance(literal, (ast.Constant, ast.JoinedStr))]


def _called_name(func: ast.expr) -> str | None:
    return func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else None


def _is_per_run(target: ast.expr) -> bool:
    name = target.id if isinstance(target, ast.Name) else target.attr if isinstance(target, ast.Attribute) else None
    return name is not None and _per_run_name(name)


def _per_run_name(name: str) -> bool:
    return name.strip("_").lower() in PER_RUN_NAMES


def _span(node: ast.expr) -> Span:
    """ast's span: lines from 1, columns in UTF-8 bytes."""
    return (node.lineno, node.col_offset), (node.end_lineno or node.lineno, node.end_col_offset or 0)


def _char_span(span: Span, lines: list[str]) -> Span:
    """The span in tokenize's columns (characters), so that a literal behind non-ASCII text is still found."""
    def column(row: int, offset: int) -> int:
        line = lines[row - 1] if 0 < row <= len(lines) else ""
        return len(line.encode("utf-8")[:offset].decode("utf-8", errors="ignore"))
    (start_row, start_col), (end_row, end_col) = span
    return (start_row, column(start_row, start_col)), (end_row, column(end_row, end_col))


def _docstring_spans(tree: ast.Module) -> list[Span]:
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                spans.append(_span(first.value))
    return spans


def _string_value(literal: str) -> str:
    """'a' and "a" are the same string; f-strings and other non-literals keep their text."""
    try:
        return repr(ast.literal_eval(literal))
    except (ValueError, SyntaxError):
        return literal
