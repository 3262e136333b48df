"""Suppression comments, honoured by every rule.

- ``# accelerate-rewrite: ignore`` at the end of a statement leaves that statement's lines as
  they are (on a line of its own: the next statement's); ``# accelerate-rewrite: ignore[AR105,
  AR302]`` does so for those rules only. A rule whose edits would change such a line is not
  applied to the file (nor the rules that rely on it), and says so: the Fabric conversion, for
  one, can't convert half a script.
- ``# accelerate-rewrite: skip-file`` (a comment line anywhere) leaves the whole file alone.
"""

from __future__ import annotations

import io
import re
import tokenize
from difflib import SequenceMatcher
from typing import Optional

MARK = re.compile(r"#\s*accelerate-rewrite:\s*(ignore|skip-file)\b(?:\[([A-Za-z0-9_,\s-]*)\])?")
SKIP_FILE = re.compile(r"^[ \t]*#\s*accelerate-rewrite:\s*skip-file\b", re.MULTILINE)

#: line (1-based) -> the codes it is protected from (None: from every rule), with the comment's line
Protected = dict[int, tuple[Optional[frozenset[str]], int]]


def skip_file_line(source: str) -> Optional[int]:
    match = SKIP_FILE.search(source)
    return source.count("\n", 0, match.start()) + 1 if match else None


def protected_lines(source: str) -> Protected:
    """Which lines the ``ignore`` comments protect."""
    if "accelerate-rewrite:" not in source:
        return {}
    out: Protected = {}
    pending: list[tuple[Optional[frozenset[str]], int]] = []  # own-line comments, for the next statement
    start: Optional[int] = None  # first line of the logical line being read
    trailing: list[tuple[Optional[frozenset[str]], int]] = []
    try:
        tokens = list(tokenize.generate_tokens(io.StringIO(source).readline))
    except (tokenize.TokenError, SyntaxError):
        return {}
    for tok in tokens:
        if tok.type == tokenize.COMMENT:
            match = MARK.match(tok.string)
            if match is None or match.group(1) != "ignore":
                continue
            codes = frozenset(c.strip().upper() for c in match.group(2).split(",") if c.strip()) \
                if match.group(2) is not None else None
            (trailing if start is not None else pending).append((codes or None, tok.start[0]))
        elif tok.type in (tokenize.NEWLINE, tokenize.ENDMARKER) and start is not None:
            for codes, line in [*pending, *trailing]:
                for number in range(start, tok.start[0] + 1):
                    _add(out, number, codes, line)
            pending, trailing, start = [], [], None
        elif tok.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
                              tokenize.COMMENT) and start is None:
            start = tok.start[0]
    return out


def _add(out: Protected, number: int, codes: Optional[frozenset[str]], line: int) -> None:
    known = out.get(number)
    if known is None:
        out[number] = (codes, line)
    elif known[0] is not None:
        out[number] = (None if codes is None else known[0] | codes, known[1])


def changed_lines(before: str, after: str) -> set[int]:
    """The lines (1-based) of ``before`` that are not in ``after`` as they were."""
    a, b = before.splitlines(keepends=True), after.splitlines(keepends=True)
    kept: set[int] = set()
    for tag, i1, i2, _, _ in SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        if tag == "equal":
            kept.update(range(i1 + 1, i2 + 1))
    return set(range(1, len(a) + 1)) - kept


def applies_to(protected: Protected, number: int, code: str) -> Optional[int]:
    """The comment's line if line ``number`` is protected from ``code``."""
    entry = protected.get(number)
    if entry is None:
        return None
    codes, line = entry
    return line if codes is None or code in codes else None
