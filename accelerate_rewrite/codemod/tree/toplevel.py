"""Python's own reading of a text's top-level statements: one ``ast`` parse a text. A long
script's parse in Python objects takes about twice the memory of its LibCST tree, and four
places asked for it (the look for the project's modules, twice, the cut of the text into
statements, the pieces of LibCST's parse): they share one, of which little is kept; a short
text's tree is kept for the project's other looks and the lines of its statements
(``python_tree``). No LibCST here: codemod/analysis/siblings.py reads it on the hook's path."""

from __future__ import annotations

import ast
import gc
import re
from array import array
from functools import lru_cache
from typing import NamedTuple, Optional


_LINE = re.compile(r"[^\r\n]*(?:\r\n?|\n)|[^\r\n]+$")


def line_list(text: str) -> list[str]:
    """The lines of ``text``, ends kept, cut where CPython and LibCST end a line (``\\r\\n``,
    ``\\r``, ``\\n``; not at a form feed or the other breaks ``str.splitlines`` knows)."""
    return _LINE.findall(text)


class Top(NamedTuple):
    """A statement of a block as Python's parser reads it: its first line (its first
    decorator's; 1-based), its column, whether it is decorated, its last line, and, for a
    ``def`` or ``class`` whose body starts on a line below, that body's statements."""

    first: int
    column: int
    decorated: bool
    end: int
    body: tuple["Top", ...] = ()


class _Read(NamedTuple):
    tops: tuple[Top, ...]
    imports: ast.Module


@lru_cache(maxsize=32)
def _read(text: str) -> Optional[_Read]:
    """What is kept of Python's parse of ``text`` (None where it can't parse it): one parse for
    the pieces of codemod/tree/parse.py, codemod/tree/layout.py's cut of the text and codemod/analysis/siblings.py's
    look for the project's modules; a short text's parse is ``python_tree``'s, shared with the
    project's other looks. A long one's is let go before the statements are made: its nodes fill
    memory that small objects made while it is alive would keep from going back (a long
    script's parse takes about twice the memory of its LibCST tree)."""
    enabled = gc.isenabled()
    gc.disable()  # a parse makes a node every few characters, in no cycle: the collector's
    try:          # passes over them while they live (half a second at 50k lines) find nothing
        try:
            tree = python_tree(text)  # a short text's tree is the one the project's looks read
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        count, numbers = len(tree.body), array("q")  # the statements as numbers: no object each
        _numbers(tree.body, numbers, deep=True)
        imports = ast.Module([s for s in tree.body if isinstance(s, (ast.Import, ast.ImportFrom, ast.Expr))], [])
        del tree
    finally:
        if enabled:
            gc.enable()
    return _Read(_tops(numbers, 0, count)[0], imports)


def _numbers(body: list[ast.stmt], out: array, deep: bool = False) -> None:
    """Each statement's ``Top`` as numbers: first line, column, decorated, last line, how many
    statements its body has here, then theirs (for a ``def`` or ``class`` at the top level
    whose body starts on a line below)."""
    for stmt in body:
        decorators = getattr(stmt, "decorator_list", None)
        inner = stmt.body if deep and isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
            and stmt.body[0].lineno != stmt.lineno else []
        out.extend((decorators[0].lineno if decorators else stmt.lineno, stmt.col_offset, bool(decorators),
                    stmt.end_lineno or stmt.lineno, len(inner)))
        _numbers(inner, out)


def _tops(numbers: array, at: int, count: int) -> tuple[tuple[Top, ...], int]:
    """``count`` statements that ``_numbers`` wrote from ``at`` on, and where they end."""
    out = []
    for _ in range(count):
        first, column, decorated, last, inner = numbers[at : at + 5]
        body, at = _tops(numbers, at + 5, inner)
        out.append(Top(first, column, bool(decorated), last, body))
    return tuple(out), at


#: a text this long is parsed again where asked again (``python_tree``): its tree is not kept
KEPT_TREE_LINES = 5_000


def python_tree(text: str) -> ast.Module:
    """``ast.parse(text)`` (its errors too), the tree shared by every caller asking for the same
    text (the project's look at a module: its imports, its names, what it reads; the changed
    names of a result, asked at every attempt): a tree to read, never to change. A long text's
    tree is not kept."""
    if text.count("\n") >= KEPT_TREE_LINES:
        return ast.parse(text)
    return _python_tree(text)


@lru_cache(maxsize=32)  # (its nodes are objects the collector goes through while they are kept)
def _python_tree(text: str) -> ast.Module:
    return ast.parse(text)


def statements(text: str) -> Optional[tuple[Top, ...]]:
    """The top-level statements of ``text`` as Python reads them (None where it can't)."""
    read = _read(text)
    return read.tops if read is not None else None


def top_level_imports(text: str) -> Optional[ast.Module]:
    """Python's parse of ``text`` with only its top-level imports and expression statements
    (``sys.path.append(...)``) in its body, in order (None where it can't parse it): what
    codemod/analysis/siblings.py reads of a module."""
    read = _read(text)
    return read.imports if read is not None else None
