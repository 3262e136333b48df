"""Python's own reading of a text's top-level statements: one ``ast`` parse a text, of which
little is kept. A long script's parse in Python objects takes about twice the memory of its
LibCST tree, and four places asked for it (the look for the project's modules, twice, the cut
of the text into statements, the pieces of LibCST's parse): they now share one. No LibCST
here: codemod/siblings.py reads it on the hook's path."""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import NamedTuple, Optional


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
    the pieces of codemod/parse.py, codemod/layout.py's cut of the text and codemod/siblings.py's look for the
    project's modules. The parse itself is not kept: a long script's parse in Python objects
    takes about twice the memory of its LibCST tree."""
    try:
        body = ast.parse(text).body
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return None
    tops = tuple(_top(stmt, deep=True) for stmt in body)
    return _Read(tops, ast.Module([s for s in body if isinstance(s, (ast.Import, ast.ImportFrom, ast.Expr))], []))


def statements(text: str) -> Optional[tuple[Top, ...]]:
    """The top-level statements of ``text`` as Python reads them (None where it can't)."""
    read = _read(text)
    return read.tops if read is not None else None


def top_level_imports(text: str) -> Optional[ast.Module]:
    """Python's parse of ``text`` with only its top-level imports and expression statements
    (``sys.path.append(...)``) in its body, in order (None where it can't parse it): what
    codemod/siblings.py reads of a module."""
    read = _read(text)
    return read.imports if read is not None else None


def _top(stmt: ast.stmt, deep: bool = False) -> Top:
    decorators = getattr(stmt, "decorator_list", None)
    body = ()
    if deep and isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) \
            and stmt.body[0].lineno != stmt.lineno:
        body = tuple(_top(inner) for inner in stmt.body)
    return Top(decorators[0].lineno if decorators else stmt.lineno, stmt.col_offset, bool(decorators),
               stmt.end_lineno or stmt.lineno, body)
