"""Never lose a byte: what LibCST does not keep, put back; what a rule would lose, caught.

LibCST round-trips almost every file byte for byte, but not all: a comment or blank line after
the last statement of a file that ends in whitespace without a final newline
(``cst.parse_module("s\\n #\\n ").code == "s\\n "``), one of several trailing empty lines with
CR-only line endings, a space before the colon of ``except ValueError :``. And it can't read a
file that ends in a line continuation (a backslash on the last line), which CPython accepts.

- ``split_tail(source)``: the trailing lines a parser need not see (blank, comment-only, a lone
  backslash), for a file LibCST can't read whole; they go back after the rewrite, as they were.
- ``restore(source, roundtrip, output)``: a three-way merge by lines. The lines LibCST changed
  (``source`` against ``roundtrip``, its code of the untouched tree) are put back into
  ``output`` wherever the rules left them as LibCST printed them; inside the statements a rule
  edited, LibCST's form stands.
- ``lost_trivia(source, output, regions)``: every comment and blank line of ``source`` outside
  the edited line ranges must be in ``output``, in order (tokenized, so ``#`` in a string is no
  comment); what is missing, with its line. ``lost_trivia_spliced``: the same answer, from the
  statements a rewrite changed only (codemod/tree/layout.py's Splice), each tokenized alone.
"""

from __future__ import annotations

import bisect
from functools import lru_cache
import difflib
import io
import re
import tokenize
from difflib import SequenceMatcher
from typing import Callable, Iterable, Optional

#: a region of the input a rule edited: first and last line (1-based, inclusive)
Region = tuple[int, int]


def _lines(text: str) -> list[str]:
    return text.splitlines(keepends=True)


def split_tail(source: str) -> list[tuple[str, str]]:
    """Ways to cut ``source`` into ``(head, tail)`` for a parser that can't read its end: the
    trailing lines that are blank, comment-only or a lone backslash; and the line continuation
    that ends the last line of code (``x = 1 \\`` followed by CRLF, which CPython accepts)."""
    lines = _lines(source)
    cut = len(lines)
    while cut > 0:
        stripped = lines[cut - 1].strip()
        if stripped and not stripped.startswith("#") and stripped != "\\":
            break
        cut -= 1
    out = []
    if 0 < cut < len(lines):
        out.append(("".join(lines[:cut]), "".join(lines[cut:])))
    if cut > 0 and lines[cut - 1].rstrip("\r\n").endswith("\\"):
        head = "".join(lines[:cut - 1]) + lines[cut - 1].rstrip("\r\n")[:-1]
        out.append((head, source[len(head):]))
    return out


def restore(source: str, roundtrip: str, output: str) -> str:
    """``output`` with the lines LibCST changed in ``source`` put back where the rules did not
    touch them (see the module docstring)."""
    if roundtrip == source:
        return output
    s, c, o = _lines(source), _lines(roundtrip), _lines(output)
    c_to_o: dict[int, int] = {}
    for tag, i1, i2, j1, _ in SequenceMatcher(None, c, o, autojunk=False).get_opcodes():
        if tag == "equal":
            c_to_o.update((i1 + k, j1 + k) for k in range(i2 - i1))
    patches: list[tuple[int, int, list[str]]] = []  # (start, end) in o -> lines of s
    for tag, i1, i2, j1, j2 in SequenceMatcher(None, s, c, autojunk=False).get_opcodes():
        if tag == "equal":
            continue
        if j2 > j1:  # lines LibCST printed otherwise: only where the output kept them as printed
            span = [c_to_o.get(k) for k in range(j1, j2)]
            if None in span or span != list(range(span[0], span[0] + len(span))):
                continue
            patches.append((span[0], span[-1] + 1, s[i1:i2]))
        else:  # lines LibCST dropped: between two lines the output kept side by side
            before = c_to_o.get(j1 - 1) if j1 > 0 else -1
            after = c_to_o.get(j1) if j1 < len(c) else len(o)
            if before is None or after is None or after != before + 1:
                continue
            patches.append((after, after, s[i1:i2]))
    for start, end, lines in sorted(patches, reverse=True):
        o[start:end] = lines
    return "".join(o)


def _normalised(text: str) -> str:
    """One line ending, so that tokenize (which reads lines at ``\\n``) counts lines as LibCST
    and CPython do (``\\r`` and ``\\r\\n`` end a line too)."""
    return text.replace("\r\n", "\n").replace("\r", "\n")


#: what tells comments from strings: a string (triple-quoted first, as tokenize reads them; a
#: backslash escapes the next character, a newline too), a comment, and what the scan leaves
#: to tokenize: a line continued by a backslash, a quote that starts no string
_STRING_OR_COMMENT = re.compile(
    r'''(?:"""[^"\\]*(?:(?:\\.|"(?!""))[^"\\]*)*"""'''
    r"""|'''[^'\\]*(?:(?:\\.|'(?!''))[^'\\]*)*'''"""
    r'''|"[^"\\\n]*(?:\\.[^"\\\n]*)*"|'[^'\\\n]*(?:\\.[^'\\\n]*)*')'''
    r"|(?P<comment>#[^\n]*)|(?P<unsure>\\\n|['\"])", re.S)
#: a line of whitespace alone (any, but a line break)
_BLANK_LINE = re.compile(r"^[^\S\n]*$", re.M)


def _scanned(normal: str) -> Optional[tuple[list[tuple[int, str]], set[int]]]:
    """The comments (line, text) and the blank lines of a text with one line ending, as
    tokenize finds them, read by regular expressions over its strings and comments (tokenize
    reads every token, in Python); None where the scan can't be sure: a line continued by a
    backslash, a quote that opens no string, a blank line of other whitespace than spaces and
    tabs (a form feed)."""
    comments: list[tuple[int, str]] = []
    inside: list[tuple[int, int]] = []  # lines a string spans: (its first, its last)
    line, at = 1, 0
    for found in _STRING_OR_COMMENT.finditer(normal):
        if found.lastgroup == "unsure":
            return None
        start = found.start()
        line += normal.count("\n", at, start)
        at = start
        if found.lastgroup == "comment":
            comments.append((line, found.group().rstrip()))
            continue
        spanned = found.group().count("\n")
        if spanned:
            inside.append((line, line + spanned))
            line += spanned
            at = found.end()
    blank: set[int] = set()
    line, at, k = 1, 0, 0
    for found in _BLANK_LINE.finditer(normal):
        start = found.start()
        if start == len(normal):
            break  # the empty "line" after the last line break
        if found.group().strip(" \t"):
            return None
        line += normal.count("\n", at, start)
        at = start
        while k < len(inside) and inside[k][1] < line:
            k += 1
        if k == len(inside) or not inside[k][0] < line:
            blank.add(line)
    last = normal.rpartition("\n")[2]
    if last and not last.strip().startswith("#"):  # tokenize's NEWLINE at the end of a last line
        blank.add(normal.count("\n") + 1)        # without a line break, with no text of its own
    return comments, blank


@lru_cache(maxsize=16)
def trivia(text: str) -> Optional[tuple[tuple[int, str], ...]]:
    """``(line, comment text or "")`` for every comment and blank line; None if it does not
    tokenize. Kept for the last texts asked about: a rewrite asks of its input at every attempt
    at the edits, and of its result twice."""
    normal = _normalised(text)
    scanned = _scanned(normal)
    if scanned is not None:
        comments, blank = scanned
        return tuple(sorted(comments + [(line, "") for line in blank]))
    return _tokenized(normal)


def _tokenized(normal: str) -> Optional[tuple[tuple[int, str], ...]]:
    """``trivia`` by tokenize."""
    out: list[tuple[int, str]] = []
    blank_done: set[int] = set()
    try:
        for tok in tokenize.generate_tokens(io.StringIO(normal).readline):
            if tok.type == tokenize.COMMENT:
                out.append((tok.start[0], tok.string.rstrip()))
            elif tok.type in (tokenize.NL, tokenize.NEWLINE) and not tok.line.strip() \
                    and tok.start[0] not in blank_done:
                blank_done.add(tok.start[0])
                out.append((tok.start[0], ""))
    except (tokenize.TokenError, SyntaxError, IndentationError):
        return None
    # a whitespace-only last line without a newline makes no NL token: count it as tokenize
    # would have had it ended in one
    lines = normal.split("\n")
    last = len(lines)
    if lines and lines[-1] != "" and not lines[-1].strip() and last not in blank_done:
        out.append((last, ""))
    return tuple(sorted(out))


def removed_comments(source: str, output: str) -> list[tuple[int, str]]:
    """The comments of ``source`` that ``output`` no longer has (a comment over a statement the
    rewrite removed went with it): (line in ``source``, text), by count of each text."""
    before, after = trivia(source), trivia(output)
    if before is None or after is None:
        return []
    return _gone(before, after)


def _gone(before, after) -> list[tuple[int, str]]:
    left: dict[str, int] = {}
    for _, text in after:
        if text:
            left[text] = left.get(text, 0) + 1
    gone = []
    for line, text in before:
        if not text:
            continue
        if left.get(text, 0):
            left[text] -= 1
        else:
            gone.append((line, text))
    return gone


def _trivia_of(pieces: list[tuple[str, int]], cache: dict) -> Optional[list[tuple[int, str]]]:
    """``trivia`` of the statements ``pieces`` (code, the line it starts on: codemod/tree/layout.py),
    each tokenized alone (once: ``cache``), in the file's lines."""
    out: list[tuple[int, str]] = []
    for code, start in pieces:
        found = cache.get(code, cache)
        if found is cache:
            found = cache[code] = trivia.__wrapped__(code)
        if found is None:
            return None
        out.extend((line + start - 1, text) for line, text in found)
    return out


def _embedded(wanted: list[tuple[int, str]], texts: list[str]) -> Optional[tuple[int, str]]:
    """The first item of ``wanted`` whose text is not in ``texts`` in order, or None."""
    k = 0
    for item in wanted:
        while k < len(texts) and texts[k] != item[1]:
            k += 1
        if k == len(texts):
            return item
        k += 1
    return None


def lost_trivia_spliced(splice, regions: Iterable[Region], cache: dict, source: str, output: str) -> Optional[str]:
    """``lost_trivia(source, output, regions)`` for an output that is ``source``'s top-level
    statements, some kept and some new (``splice``: codemod/tree/layout.py): the kept ones keep
    their comments and blank lines, so only the runs between them are tokenized and compared,
    each with its own; where one falls short, the whole files are (a comment may have moved
    to another run)."""
    regions = list(regions)
    inside = _inside(regions)
    for old, new in splice.changed():
        before = _trivia_of(old, cache)
        after = _trivia_of(new, cache)
        if before is None or after is None:
            return lost_trivia(source, output, regions)
        wanted = [item for item in before if not inside(item[0])]
        if wanted and _embedded(wanted, [text for _, text in after]) is not None:
            return lost_trivia(source, output, regions)
    return None


def removed_comments_spliced(splice, cache: dict) -> Optional[list[tuple[int, str]]]:
    """``removed_comments`` of a spliced result (``lost_trivia_spliced``): the comments of the
    statements it replaced that the new ones do not have. None where a statement does not
    tokenize alone."""
    before: list[tuple[int, str]] = []
    after: list[tuple[int, str]] = []
    for old, new in splice.changed():
        these, those = _trivia_of(old, cache), _trivia_of(new, cache)
        if these is None or those is None:
            return None
        before += these
        after += those
    return _gone(before, after)


def _describe(item: tuple[int, str]) -> str:
    line, text = item
    return f"the comment `{text}` (line {line})" if text else f"the blank line {line}"


def lost_trivia(source: str, output: str, regions: Iterable[Region]) -> Optional[str]:
    """What ``output`` would lose of ``source``'s comments and blank lines outside ``regions``
    (a message), or None."""
    before = trivia(source)
    if before is None:
        return None
    inside = _inside(regions)
    wanted = [item for item in before if not inside(item[0])]
    if not wanted:
        return None
    after = trivia(output)
    if after is None:
        return None
    texts = [text for _, text in after]
    missing = _embedded(wanted, texts)
    if missing is None:
        return None
    # the first item the output really lacks (the greedy scan's first miss can be a later one:
    # a blank line lost early shifts every blank line after it)
    matcher = difflib.SequenceMatcher(None, [text for _, text in wanted], texts, autojunk=False)
    matched = {i for block in matcher.get_matching_blocks() for i in range(block.a, block.a + block.size)}
    missing = next((item for i, item in enumerate(wanted) if i not in matched), missing)
    return f"it would lose {_describe(missing)}"


def _inside(regions: Iterable[Region]) -> Callable[[int], bool]:
    """Whether a line is in one of ``regions``."""
    merged: list[list[int]] = []  # the regions as disjoint spans, in order
    for a, b in sorted(regions):
        if merged and a <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    starts = [a for a, _ in merged]

    def inside(line: int) -> bool:  # by bisection: a pass over every region per line is quadratic
        i = bisect.bisect_right(starts, line) - 1
        return i >= 0 and line <= merged[i][1]
    return inside
