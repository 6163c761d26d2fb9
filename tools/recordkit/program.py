"""The program a log embeds, independent of its comments, docstrings and layout.

Two logs run the same program when their embedded sources give the same token stream once comments,
docstrings, blank lines and line breaks inside brackets are dropped, indentation is reduced to its
structure, and string literals are compared by value. Published records are split this way in practice:
the four logs of record 2025-09-23 (MuonCustomSizing) embed scripts that differ only in a docstring.
"""

from __future__ import annotations

import ast
import functools
import hashlib
import io
import tokenize

_DROPPED = {tokenize.COMMENT, tokenize.NL, tokenize.ENCODING, tokenize.ENDMARKER}
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
    docstrings = _docstring_spans(tree)
    out: list[str] = []
    skip_newline = False
    for token in raw:
        if token.type in _DROPPED:
            continue
        if token.type == tokenize.STRING and any(start <= token.start and token.end <= end for start, end in docstrings):
            skip_newline = True  # and the end of the docstring's statement, so adding one changes nothing
            continue
        if skip_newline and token.type == tokenize.NEWLINE:
            skip_newline = False
            continue
        skip_newline = False
        if token.type in _STRUCTURE_ONLY:
            out.append(tokenize.tok_name[token.type])
        elif token.type == tokenize.STRING:
            out.append(_string_value(token.string))
        else:
            out.append(token.string)
    return out


def _docstring_spans(tree: ast.Module) -> list[Span]:
    spans = []
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                value = first.value
                spans.append(((value.lineno, value.col_offset), (value.end_lineno or value.lineno, value.end_col_offset or 0)))
    return spans


def _string_value(literal: str) -> str:
    """'a' and "a" are the same string; f-strings and other non-literals keep their text."""
    try:
        return repr(ast.literal_eval(literal))
    except (ValueError, SyntaxError):
        return literal
