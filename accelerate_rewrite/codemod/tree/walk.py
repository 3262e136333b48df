"""LibCST's tree read without its visitor machinery: a node's children in the order of LibCST's
walk (the fields its own ``_visit_and_replace_children`` visits, recorded once per class), past
the tokens (``TOKENS``: whitespace, comments, blank lines, operators, brackets; two nodes in three
of a script), which hold only each other and which no analysis here asks about; and the parents'
walk over them (``_walk``: parents, spans and nodes by class, in the walk's order); and LibCST's
visitors made lean (``LeanVisitor``, ``_reading``, ``read_tree``: no per-field lookups, no copies
of the nodes they pass). Used by codemod/tree/metadata.py (the parents), codemod/tree/scopes.py
(the scopes) and codemod/analysis/index.py (matchers)."""

from __future__ import annotations

import dataclasses
import re
import typing
from array import array
from contextlib import contextmanager
from typing import Callable, Iterator, Optional

import libcst as cst


class _Fields(cst.CSTVisitor):
    """Records the fields ``_visit_and_replace_children`` visits, in its order, without going
    into them."""

    def __init__(self) -> None:
        super().__init__()
        self.fields: list[str] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        return False

    def on_leave(self, original_node: cst.CSTNode) -> None:
        pass

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        if attribute not in self.fields:
            self.fields.append(attribute)

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass


#: node class -> the fields a walk visits, in its order (asked of LibCST once per class; None:
#: asked for each node of the class)
_FIELDS: dict[type, Optional[tuple[str, ...]]] = {}
#: a field value's type -> 1 a node, 2 a sequence, 0 neither
_KINDS: dict[type, int] = {tuple: 2, list: 2, type(None): 0, str: 0}


#: a field's type that holds text, never a node (``Newline.value``, ``IndentedBlock.indent``)
_TEXT = re.compile(r"(typing\.Optional\[str\]|<class 'str'>|str|Optional\[str\])")


def _fields_of(node: cst.CSTNode) -> tuple[str, ...]:
    """The fields LibCST's walk visits in ``node``, in its order; kept for the class when the
    fields it leaves out hold no node here (a class whose walk leaves out an empty field, such
    as a FormattedStringExpression's ``format_spec``, is asked again for each node)."""
    recorder = _Fields()
    node._visit_and_replace_children(recorder)  # builds one copy of the node
    out = tuple(recorder.fields)
    if all(getattr(node, f.name) is not None or _TEXT.fullmatch(str(f.type))
           for f in dataclasses.fields(node) if f.name not in out):
        _FIELDS[type(node)] = out
    else:
        _FIELDS[type(node)] = None
    return out


def node_classes(*bases: type) -> frozenset[type]:
    """LibCST's classes that are one of ``bases`` (``issubclass``), read off each class's bases:
    ``issubclass`` with LibCST's abstract classes runs their checks, 5 ms a pass over its classes
    at each start."""
    wanted = set(bases)
    return frozenset(c for c in vars(cst).values() if isinstance(c, type) and not wanted.isdisjoint(c.__mro__))


def _token_classes() -> frozenset[type]:
    """LibCST's token classes: its whitespace, comments, blank lines and operators (the modules
    ``whitespace`` and ``op``, but ``import *``), and the brackets."""
    brackets = (cst.LeftParen, cst.RightParen, cst.LeftSquareBracket, cst.RightSquareBracket,
                cst.LeftCurlyBrace, cst.RightCurlyBrace)
    return frozenset(c for c in node_classes(cst.CSTNode) if c in brackets or c is not cst.ImportStar
                     and c.__module__ in ("libcst._nodes.op", "libcst._nodes.whitespace"))


#: the nodes the walks here go past (the module's docstring)
TOKENS = _token_classes()


def _tokens_only(annotation: object) -> bool:
    """Whether a field of this annotation can hold tokens and no other node (``Sequence[LeftParen]``,
    ``Union[Comma, MaybeSentinel]``, ``BaseParenthesizableWhitespace``)."""
    origin = typing.get_origin(annotation)
    if origin is typing.Literal:
        return True
    if origin is not None:  # Union, Optional, Sequence
        return all(_tokens_only(a) for a in typing.get_args(annotation))
    if isinstance(annotation, type):
        # (a token class among its bases: ``issubclass`` with the tokens' ABCs, without their checks)
        return annotation in (type(None), str, cst.MaybeSentinel) or not TOKENS.isdisjoint(annotation.__mro__)
    return False  # a forward reference: kept


#: node class -> the fields of ``_FIELDS`` that may hold a node other than a token
_INNER: dict[type, tuple[str, ...]] = {}
#: node class -> its fields that hold tokens only
_TOKEN_FIELDS: dict[type, frozenset[str]] = {}


def _inner_fields(node: cst.CSTNode) -> tuple[str, ...]:
    kind = type(node)
    order = _FIELDS.get(kind, _children)
    if order is None or order is _children:
        order = _fields_of(node)
    skip = _TOKEN_FIELDS.get(kind)
    if skip is None:
        skip = _TOKEN_FIELDS[kind] = frozenset(f.name for f in dataclasses.fields(node) if _tokens_only(f.type))
    out = tuple(name for name in order if name not in skip)
    if _FIELDS.get(kind) is not None:  # the class's fields are known once for all its nodes
        _INNER[kind] = out
    return out


def _children(node: cst.CSTNode) -> list[cst.CSTNode]:
    """The children of ``node`` but its tokens, in the order of LibCST's walk (the fields
    ``_walk`` reads)."""
    order = _INNER.get(type(node))
    if order is None:
        order = _inner_fields(node)
    out: list[cst.CSTNode] = []
    for name in order:
        value = getattr(node, name)
        kind = _KINDS.get(type(value))
        if kind is None:
            kind = _KINDS[type(value)] = 1 if isinstance(value, cst.CSTNode) else 0
        if kind == 1:
            out.append(value)
        elif kind == 2:
            out.extend(value)
    return out


def paths_to(node: cst.CSTNode, wanted: Callable[[cst.CSTNode], bool]) -> set[int]:
    """The ids of the nodes ``wanted`` says yes to in ``node``'s subtree and of every node
    above them up to ``node`` (walked as ``_walk`` walks, tokens left out): what a transformer
    that changes only such nodes rebuilds (``Along``). Empty where there is none."""
    out: set[int] = set()
    above: dict[int, cst.CSTNode] = {}
    todo = [node]
    while todo:
        current = todo.pop()
        if wanted(current):
            key = id(current)
            while key not in out:
                out.add(key)
                up = above.get(key)
                if up is None:
                    break
                key = id(up)
        for child in _children(current):
            above[id(child)] = current
            todo.append(child)
    return out


class Along:
    """A CSTTransformer mixin: with ``path`` (``paths_to``) set, only the nodes on it are gone
    into and left (the transformer's own ``visit_``/``leave_`` methods); every other node is
    kept as it is, not rebuilt. For a transformer that changes only the nodes its ``changes``
    says yes to: the same tree as going through every node."""

    path: Optional[set[int]] = None

    def changes(self, node: cst.CSTNode) -> bool:
        """Whether the transformer may change ``node`` (every node it may change, at least)."""
        raise NotImplementedError

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.path is not None and id(node) not in self.path:
            return False
        return super().on_visit(node)  # type: ignore[misc]

    def on_leave(self, original_node, updated_node):
        if self.path is not None and id(original_node) not in self.path:
            return updated_node
        return super().on_leave(original_node, updated_node)  # type: ignore[misc]

    def along(self, node: cst.CSTNode):
        """``node`` gone through along the paths to the nodes ``changes`` says yes to (``node``
        itself where there is none)."""
        self.path = paths_to(node, self.changes)
        try:
            return node.visit(self) if self.path else node  # type: ignore[arg-type]
        finally:
            self.path = None


class Spans:
    """node -> (its index in the walk's order, the index of the first node after its subtree),
    for every node but the module: the indices in a dict, the ends in an array by index (a
    tuple of two numbers a node took a sixth of a long script's analysis in memory). ``index``
    answers the starts alone, at a dict's speed."""

    __slots__ = ("index", "ends")

    def __init__(self) -> None:
        self.index: dict[cst.CSTNode, int] = {}
        self.ends = array("q")

    def get(self, node, default=None):
        at = self.index.get(node)
        return default if at is None else (at, self.ends[at])

    def __getitem__(self, node) -> tuple[int, int]:
        at = self.index[node]
        return (at, self.ends[at])

    def __len__(self) -> int:
        return len(self.index)


class SharedNode(Exception):
    """A node stands twice in the tree (``_walk``): its parent is not one node."""


def _walk(module: cst.Module):
    """The parents and spans of ``_Parents``, without LibCST's visitor machinery: its walk
    builds a new copy of every node it passes (``_visit_and_replace_children``), which a walk that
    reads the tree need not. The children of a node are those of the fields its own
    ``_visit_and_replace_children`` visits, in that order (recorded once per class), so the
    nodes come in the order of LibCST's walk, the tokens (``TOKENS``) left out; tests/test_facts.py
    checks the two give the same, in the same order, on every fixture."""
    parents: dict[cst.CSTNode, cst.CSTNode] = {}
    spans = Spans()
    index, ends = spans.index, spans.ends
    by_type: dict[type, list[cst.CSTNode]] = {}
    leave = object()
    # (node, its parent, 0) to enter a node; (node, leave, its index) once its subtree is done
    stack: list = [(module, None, 0)]
    push = stack.append
    while stack:
        node, parent, start = stack.pop()
        if parent is leave:
            ends[start] = len(parents)
            continue
        if parent is not None:
            if node in parents:
                raise SharedNode(node)
            at = len(parents)
            push((node, leave, at))
            parents[node] = parent
            index[node] = at
            ends.append(0)
            kind = type(node)
            if kind in by_type:
                by_type[kind].append(node)
            else:
                by_type[kind] = [node]
        for child in reversed(_children(node)):  # the last child first: the first is entered next
            push((child, node, 0))
    return parents, spans, by_type


#: (visitor class, node class) -> its ``visit_<Node>`` (or ``leave_<Node>``) function, or None
_VISITS: dict[tuple[type, type], Optional[Callable]] = {}
_LEAVES: dict[tuple[type, type], Optional[Callable]] = {}


class LeanVisitor(cst.CSTVisitor):
    """A CSTVisitor for visitors with no ``visit_<Node>_<field>`` methods: LibCST looks each
    of them up by name for every field of every node it walks (two ``getattr`` per field), the
    largest part of a walk that does little at each node. Its ``visit_<Node>`` and
    ``leave_<Node>`` methods are looked up once per class of visitor and of node, not by a name
    built for every node (methods set on an instance are not seen)."""

    def on_visit(self, node: cst.CSTNode) -> bool:
        key = (type(self), type(node))
        method = _VISITS.get(key, _VISITS)
        if method is _VISITS:
            method = _VISITS[key] = getattr(type(self), f"visit_{type(node).__name__}", None)
        return method is None or method(self, node) is not False

    def on_leave(self, original_node: cst.CSTNode) -> None:
        key = (type(self), type(original_node))
        method = _LEAVES.get(key, _LEAVES)
        if method is _LEAVES:
            method = _LEAVES[key] = getattr(type(self), f"leave_{type(original_node).__name__}", None)
        if method is not None:
            method(self, original_node)

    def on_visit_attribute(self, node: cst.CSTNode, attribute: str) -> None:
        pass

    def on_leave_attribute(self, original_node: cst.CSTNode, attribute: str) -> None:
        pass


@contextmanager
def _reading(*kinds: type) -> Iterator[None]:
    """While inside, ``node.visit(visitor)`` for a visitor of one of ``kinds`` goes through the
    nodes as LibCST's walk does (``on_visit``; if it says so, the children in the walk's order;
    ``on_leave``) without building a copy of each node it passes, nor the checks of what a
    transformer returns: for visitors that read the tree and have no per-field methods, here
    LibCST's own expression-context and scope visitors (a third of the scope analysis's time).
    Every other visitor, and every visit outside, goes LibCST's way."""
    original = cst.CSTNode.visit
    fast = frozenset(kinds)

    def visit(self, visitor):
        if type(visitor) not in fast:
            return original(self, visitor)
        if visitor.on_visit(self):
            for child in _children(self):
                child.visit(visitor)
        visitor.on_leave(self)
        return self

    cst.CSTNode.visit = visit  # type: ignore[method-assign]
    try:
        yield
    finally:
        cst.CSTNode.visit = original  # type: ignore[method-assign]


def read_tree(node: cst.CSTNode, make: Callable[[], cst.CSTVisitor]) -> cst.CSTVisitor:
    """A visitor ``make()`` makes, after ``node.visit`` of it the copy-free way (``_reading``):
    for a LeanVisitor that reads the tree. Should LibCST's internals change, a fresh one
    walks LibCST's way."""
    visitor = make()
    try:
        with _reading(type(visitor)):
            node.visit(visitor)
    except (AttributeError, TypeError):  # LibCST's internals moved: its own walk
        visitor = make()
        node.visit(visitor)
    return visitor
