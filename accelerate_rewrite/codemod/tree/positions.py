"""Positions of a parsed module's nodes, one top-level statement at a time (codemod/tree/layout.py
gives each statement's code and first line): what PositionProvider gives, from the code
generation of the statements whose nodes are asked about, and before that, the lines Python's
own parser tells (a statement's first line, and so the line of every node of a statement or
header on one line) without generating anything. tests/test_layout.py checks both against
PositionProvider, node for node, on every fixture."""

from __future__ import annotations

import ast
from typing import Callable, Mapping, Optional, Sequence

import libcst as cst
from libcst.metadata.position_provider import PositionProvider, PositionProvidingCodegenState

from accelerate_rewrite.codemod.tree.layout import Layout
from accelerate_rewrite.codemod.tree.pairing import _HEADERS, Told, _pair
from accelerate_rewrite.codemod.tree.walk import node_classes


def _classes(base: type) -> frozenset[type]:
    """LibCST's node classes that are ``base`` (a set lookup of a node's class is cheaper than
    ``isinstance`` against an abstract class)."""
    return node_classes(base)


_COMPOUND = _classes(cst.BaseCompoundStatement)
_BLOCKS = _classes(cst.BaseSuite) | {cst.Else, cst.Finally} | _classes(cst.ExceptHandler) \
    | {getattr(cst, "ExceptStarHandler", cst.ExceptHandler)}


def _line_in(chain: list, lines: dict[int, Told]) -> Optional[int]:
    """The line of ``chain[0]`` (``chain``: a node and its ancestors up to a top-level
    statement) where ``lines`` (``_pair``) tell it, or None."""
    if type(chain[0]) is cst.Param:  # a def's parameter (``_pair_params``)
        known = lines.get(id(chain[0]))
        if known is not None:
            return known[0]
    below = None
    for node in chain:
        kind = type(node)
        if kind is cst.SimpleStatementLine:
            known = lines.get(id(node))
            if known is None or not (below is None or (known[1] and any(below is s for s in node.body))):
                return None
            return known[0]
        if kind in _COMPOUND:
            known = lines.get(id(node))
            if known is None:
                return None
            if below is None:
                return known[0]
            fields = _HEADERS.get(type(node))
            if fields is None or not known[1]:
                return None
            for name in fields[1]:
                value = getattr(node, name, None)
                if value is below or (isinstance(value, (list, tuple)) and any(v is below for v in value)):
                    return known[0]
            return None
        if kind in _BLOCKS:
            return None
        below = node
    return None


class Positions:
    """node -> its CodeRange (what PositionProvider gives), computed one top-level statement at a
    time, for the statements whose nodes are asked about; the module itself and its header and
    footer lines by PositionProvider over the whole module."""

    def __init__(self, layout: Layout, parent: Callable[[cst.CSTNode], Optional[cst.CSTNode]],
                 whole: Callable[[], Mapping[cst.CSTNode, object]]) -> None:
        self.layout = layout
        self.parent = parent
        self.whole = whole
        self.found: dict[cst.CSTNode, object] = {}
        self._done: set[int] = set()
        self._all: Optional[Mapping[cst.CSTNode, object]] = None
        #: id(top-level statement) -> its statements' lines by Python's parser (``_lines_of``)
        self._lines: dict[int, Optional[dict[int, Told]]] = {}
        #: id(statement inside a top-level one) whose positions are generated (``_generate_inner``)
        self._inner_done: set[int] = set()
        #: id(node) -> its line, told so (a rule may ask of the same nodes over and over: by
        #: id, a node's own hash is a Python call)
        self._quick: dict[int, int] = {}

    def line(self, node: cst.CSTNode) -> Optional[int]:
        """The line ``node`` starts on (``get(node).start.line``), without generating the code
        of its statement where Python's parser tells it: a statement on one line and every
        node of its small statements, a compound statement (not decorated) and the nodes of
        its header on one line (``if``, ``for``, ``while``, ``with``). Python gives the first
        line of each statement; LibCST's structure says which of its statements it is."""
        quick = self._quick.get(id(node))
        if quick is not None:
            return quick
        if node is self.layout.module:
            return 1  # (a scope's line, asked to order names: not the whole module's positions)
        found = self.found.get(node)
        if found is not None:
            return found.start.line  # type: ignore[attr-defined]
        told = self._told(node)
        if told is not None:
            quick = _line_in(*told)
            if quick is not None:
                self._quick[id(node)] = quick
                return quick
        found = self.get(node)
        return found.start.line if found is not None else None  # type: ignore[attr-defined]

    def lines(self, node: cst.CSTNode) -> Optional[tuple[int, int]]:
        """The lines ``node`` starts and ends on (``get``'s); for a statement, from Python's parser
        where it tells them (``_pair``: Python's last line of a statement is LibCST's, which
        leaves a block's trailing comments out of its statement as well)."""
        if (type(node) is cst.SimpleStatementLine or type(node) in _COMPOUND) and node not in self.found:
            told = self._told(node)
            known = told[1].get(id(node)) if told is not None else None
            if known is not None:
                return known[0], known[2]
        found = self.get(node)
        return (found.start.line, found.end.line) if found is not None else None  # type: ignore[attr-defined]

    def _told(self, node: cst.CSTNode) -> Optional[tuple[list, dict[int, Told]]]:
        """``node`` and its ancestors up to its top-level statement, and what Python's parser
        tells of that statement's statements (``_lines_of``); None where it can't tell or
        the statement's positions are there already."""
        if self._all is not None:
            return None
        chain = [node]
        module = self.layout.module
        while True:
            above = self.parent(chain[-1])
            if above is None:
                return None
            if above is module:
                break
            chain.append(above)
        top = chain[-1]
        if id(top) not in self.layout.statements or id(top) in self._done:
            return None
        lines = self._lines.get(id(top), self._lines)
        if lines is self._lines:
            lines = self._lines[id(top)] = self._lines_of(top)
        return (chain, lines) if lines is not None else None

    def _lines_of(self, top: cst.CSTNode) -> Optional[dict[int, Told]]:
        """id(statement) -> (its first line, whether it or its header is on that line alone, its
        last line), for the statements of a top-level one, by Python's parse of the file's text
        (where the statement's code is cut from it: codemod/tree/layout.py) or else of its code;
        None where the two parsers' statements do not pair up."""
        out: dict[int, Told] = {}
        at = self.layout.python_at.get(id(top))
        whole = self.layout.python_body() if at is not None else None
        if whole is not None:  # the text's parse, whose statement this is: its lines are the file's
            n = len(top.body) if type(top) is cst.SimpleStatementLine else 1
            return out if _pair([top], whole[at:at + n], 0, out) else None
        code, start = self.layout.statements[id(top)]
        try:
            body = ast.parse(code).body
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return None
        return out if _pair([top], body, start - 1, out) else None

    def get(self, node: cst.CSTNode, default=None):
        found = self.found.get(node)
        if found is not None:
            return found
        if self._all is None:
            top = self._top(node)
            if top is not None:
                if id(top) not in self._done:
                    if self._generate_inner(node):
                        found = self.found.get(node)
                        if found is not None:
                            return found
                    self._generate(top)
                return self.found.get(node, default)
            self._all = self.whole()  # the module, a header or footer line, a node of no statement here
        return self._all.get(node, default)

    def _generate_inner(self, node: cst.CSTNode) -> bool:
        """The positions of the innermost statement around ``node`` whose first line Python's
        parser tells (not its whole top-level statement: a ``main()`` of a thousand lines for
        one note), generated from that line with the indentation of the blocks around it.
        False where there is none (a decorated function, an ``elif``, ...)."""
        told = self._told(node)
        if told is None:
            return False
        chain, lines = told
        for i, above in enumerate(chain[:-1]):  # the top-level statement itself: ``_generate``
            if type(above) is not cst.SimpleStatementLine and type(above) not in _HEADERS \
                    and not (type(above) in (cst.FunctionDef, cst.ClassDef) and not above.decorators):
                continue
            known = lines.get(id(above))
            if known is None or (type(above) is cst.If and isinstance(chain[i + 1], cst.If)):
                return False  # an ``elif`` prints as an ``if`` alone
            if id(above) in self._inner_done:
                return True
            self._inner_done.add(id(above))
            module = self.layout.module
            indents = [block.indent if block.indent is not None else module.default_indent
                       for block in reversed(chain[i + 1:]) if type(block) is cst.IndentedBlock]
            self._generate(above, known[0] - len(above.leading_lines), indents)
            return True
        return False

    def _top(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        module = self.layout.module
        current: Optional[cst.CSTNode] = node
        while current is not None:
            above = self.parent(current)
            if above is module:
                return current if id(current) in self.layout.statements else None
            current = above
        return None

    def _generate(self, stmt: cst.CSTNode, line: Optional[int] = None, indents: Sequence[str] = ()) -> None:
        """The positions of ``stmt``'s nodes: a top-level statement, or (``line``: where its code
        starts, ``indents``: of the blocks it is in) one inside it."""
        if line is None:
            self._done.add(id(stmt))
            line = self.layout.statements[id(stmt)][1]
        module = self.layout.module
        provider = PositionProvider()
        provider._computed = self.found  # type: ignore[attr-defined]
        state = PositionProvidingCodegenState(default_indent=module.default_indent,
                                              default_newline=module.default_newline, provider=provider,
                                              line=line)
        state.indent_tokens.extend(indents)
        stmt._codegen(state)

    # what ``dict(positions)`` asks: the whole map
    def keys(self):
        if self._all is None:
            self._all = self.whole()
        return self._all.keys()

    def __getitem__(self, node):
        found = self.get(node)
        if found is None:
            raise KeyError(node)
        return found
