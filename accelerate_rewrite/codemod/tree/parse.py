"""LibCST's parse of a module, made in pieces when the module is long.

LibCST's native parser needs about nine times the memory of the tree it returns while it
parses (its tokens and its own tree, in Rust), and hands little of it back to the system: a
50,000-line script peaks at about 1 GB for a tree of about 100 MB (docs/benchmarks.md). Parsed
top-level statement by top-level statement, in pieces of about ``PIECE_LINES`` lines, the peak
is the tree and one piece's parse, and the parse takes less time too.

The pieces make the tree the whole parse makes, node for node (tests/test_parse.py compares them
on every fixture with small pieces, and on odd sources):

- a piece starts on the line of a top-level statement (its first decorator) that starts a line
  of its own, so no bracket, string or block crosses a cut;
- the blank lines and comments at the end of a piece, which LibCST gives the piece's module
  (``footer``), are the leading lines of the next piece's first statement in the whole parse;
  those indented deeper belong to the last block's footer either way;
- LibCST leaves a block's indent and a line's newline unsaid (``None``) when they are the
  module's default, which it detects from the text it is given: the pieces must all detect the
  same defaults, or the text is parsed whole.

Anything else (a piece LibCST can't read, a file Python can't parse) is parsed whole, so the
errors are LibCST's own."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator, NamedTuple, Optional

import libcst as cst

from accelerate_rewrite.codemod.tree.toplevel import Top, statements

#: about how many lines a piece of a long module has; a module shorter than twice this is
#: parsed whole
PIECE_LINES = 1000

#: the line a piece of a long function's or class's body is parsed under
_UNDER = "if 1:"


class _Piece(NamedTuple):
    """Lines ``start`` to ``end`` (0-based, end excluded); where they are one long ``def`` or
    ``class``, ``inner`` are the lines its body's pieces start at (after the first)."""

    start: int
    end: int
    inner: tuple[int, ...] = ()


def _unchecked_node(self: cst.CSTNode) -> None:
    pass


@contextmanager
def _unchecked() -> Iterator[None]:
    """LibCST's parser makes each node through its constructor, which checks it (``_validate``,
    from ``CSTNode.__post_init__``), a tenth of the parse; what the parser makes passes by
    construction (LibCST's own comment there: "avoid validating the tree when parsing a file").
    The check is left out while the parser runs, and back for every node made after it (the
    rules'). No thread of the engine makes nodes meanwhile: it runs in one."""
    checking = cst.CSTNode.__dict__.get("__post_init__")
    if checking is None:  # LibCST's internals moved: its own way
        yield
        return
    cst.CSTNode.__post_init__ = _unchecked_node  # type: ignore[method-assign]
    try:
        yield
    finally:
        cst.CSTNode.__post_init__ = checking  # type: ignore[method-assign]


def parse_module(text: str, piece_lines: int = PIECE_LINES) -> cst.Module:
    """``cst.parse_module(text)``, in pieces where ``text`` is long; its nodes are not checked
    one by one as they are made (``_unchecked``)."""
    with _unchecked():
        return _parse_module(text, piece_lines)


#: the texts ``parsed_text`` keeps the trees of (the oldest go first), and the most characters
#: of them kept together (about 50k lines: a tree takes about 200 bytes a character; the newest
#: is kept whatever its length: the rewrite of a long script asks for it twice)
KEPT_TEXTS = 64
KEPT_CHARACTERS = 2_000_000
_KEPT: dict[str, cst.Module] = {}


def parsed_text(text: str) -> cst.Module:
    """``parse_module(text)``, kept for the next reader of the same text: a tree is never changed,
    only read and rebuilt. A script is parsed to look for its project's modules and then for its
    facts, and read again as a module of another's program (codemod/reading.py); the compatible
    change and the keyword calls (codemod/project/) read a module's text at every attempt of a
    rewrite, and a repository's entry points the same modules' texts again."""
    found = _KEPT.pop(text, None)
    if found is None:
        found = parse_module(text)
    _KEPT[text] = found  # the newest last
    total = sum(map(len, _KEPT))
    while len(_KEPT) > 1 and (len(_KEPT) > KEPT_TEXTS or total > KEPT_CHARACTERS):
        oldest = next(iter(_KEPT))
        total -= len(oldest)
        del _KEPT[oldest]
    return found


parsed_text.cache_clear = _KEPT.clear  # type: ignore[attr-defined]  (as an lru_cache's)


def _parse_module(text: str, piece_lines: int) -> cst.Module:
    if text.count("\n") < 2 * piece_lines:
        return cst.parse_module(text)
    lines = text.splitlines(keepends=True)
    plan = _plan(text, lines, piece_lines)
    if plan is None:
        return cst.parse_module(text)
    try:
        return _join([_parse(lines, piece) for piece in plan])
    except (cst.ParserSyntaxError, _Whole):
        return cst.parse_module(text)


class _Whole(Exception):
    """The pieces of a text detected different defaults (or are not what the plan says): the
    text is parsed whole."""


def _plan(text: str, lines: list[str], piece_lines: int) -> Optional[list[_Piece]]:
    """The pieces, or None where Python can't parse the text (LibCST's parse then says why),
    its lines are not the ones Python counts, or it is one piece."""
    if len(lines) != text.count("\n") + (not text.endswith("\n")):
        return None  # a lone "\r", a form feed or a line separator ends a line for splitlines
    body = statements(text)
    if body is None:
        return None
    cuts = _cuts(body, 0, piece_lines)
    pieces: list[_Piece] = []
    for (start, stmt), end in zip(cuts, [cut for cut, _ in cuts[1:]] + [len(lines)]):
        inner = _body_cuts(stmt, piece_lines) if stmt is not None else ()
        pieces.append(_Piece(start, end, inner))
    return pieces if len(pieces) > 1 or pieces[0].inner else None


def _cuts(body: tuple[Top, ...], column: int, piece_lines: int,
          start: int = 0) -> list[tuple[int, Optional[Top]]]:
    """Where the pieces of these statements start (0-based lines; the first piece at ``start``),
    each with its statement where that is a piece of its own (a long one)."""
    cuts: list[tuple[int, Optional[Top]]] = [(start, None)]
    last_end = 0
    for stmt in body:
        first = stmt.first - 1
        own = first >= last_end and stmt.column == column  # starts a line of its own
        long = own and stmt.end - first >= 2 * piece_lines
        if own and last_end and (long or cuts[-1][1] is not None or first - cuts[-1][0] >= piece_lines):
            cuts.append((first, None))
        if long:
            cuts[-1] = (cuts[-1][0], stmt)
        last_end = stmt.end
    return cuts


def _body_cuts(stmt: Top, piece_lines: int) -> tuple[int, ...]:
    """Where the pieces of a long ``def``'s or ``class``'s body start, after the first."""
    if not stmt.body:
        return ()  # not a ``def`` or ``class``, or ``def f(): ...`` on one line
    cuts = _cuts(stmt.body, stmt.body[0].column, piece_lines, stmt.first - 1)
    return tuple(start for start, _ in cuts[1:])


def _parse(lines: list[str], piece: _Piece) -> cst.Module:
    """A piece's module (a long statement's parsed body piece by body piece)."""
    if not piece.inner:
        return cst.parse_module("".join(lines[piece.start : piece.end]))
    bounds = [piece.start, *piece.inner, piece.end]
    head = cst.parse_module("".join(lines[bounds[0] : bounds[1]]))
    long = head.body[-1]
    if not isinstance(long, (cst.FunctionDef, cst.ClassDef)) or not isinstance(long.body, cst.IndentedBlock):
        raise _Whole
    blocks, modules = [long.body], [head]
    for start, end in zip(bounds[1:], bounds[2:]):
        newline = lines[start][len(lines[start].rstrip("\r\n")) :]
        module = cst.parse_module(_UNDER + newline + "".join(lines[start:end]))
        under = module.body[0]
        if not isinstance(under, cst.If) or not isinstance(under.body, cst.IndentedBlock):
            raise _Whole
        blocks.append(under.body)
        modules.append(module)
    _same_defaults(modules)
    indent = long.body.indent if long.body.indent is not None else head.default_indent
    body = _concat([block.body for block in blocks],
                   [[*block.footer, *(_under(line, indent) for line in module.footer)]
                    for block, module in zip(blocks, modules)])
    long = long.with_changes(body=long.body.with_changes(body=body, footer=blocks[-1].footer))
    return head.with_changes(
        body=[*head.body[:-1], long], footer=modules[-1].footer,
        has_trailing_newline=modules[-1].has_trailing_newline,
    )


def _under(line: cst.EmptyLine, indent: str) -> cst.EmptyLine:
    """A blank or comment line of a module's footer as LibCST reads it in a block indented by
    ``indent``: ``indent=True`` where the line starts with that indent, which its whitespace
    then leaves out (LibCST's ``parse_empty_lines``)."""
    spaces = line.whitespace.value if line.indent else None
    if spaces is None:
        return line
    if spaces.startswith(indent):
        return line.with_changes(whitespace=cst.SimpleWhitespace(spaces[len(indent) :]))
    return line.with_changes(indent=False)


def _same_defaults(modules: list[cst.Module]) -> None:
    first = modules[0]
    if any(
        module.default_indent != first.default_indent or module.default_newline != first.default_newline
        for module in modules
    ):
        raise _Whole


def _join(pieces: list[cst.Module]) -> cst.Module:
    """One module of the pieces' statements."""
    _same_defaults(pieces)
    body = _concat([piece.body for piece in pieces],
                   [[*before.footer, *after.header] for before, after in zip(pieces, pieces[1:])])
    return pieces[0].with_changes(
        body=body, footer=pieces[-1].footer, has_trailing_newline=pieces[-1].has_trailing_newline
    )


def _concat(bodies: list, between: list[list[cst.EmptyLine]]) -> list[cst.BaseStatement]:
    """The statements of the pieces' bodies in one list, the lines that came between two pieces
    (``between``, in the whole parse the next statement's) before the next piece's first."""
    out = list(bodies[0])
    for lines, body in zip(between, bodies[1:]):
        if not body:
            raise _Whole
        lead, *rest = body
        out.append(lead.with_changes(leading_lines=[*lines, *lead.leading_lines]))
        out.extend(rest)
    return out
