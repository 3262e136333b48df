"""What LibCST's metadata says of a tree, computed lean: parents, scopes, positions.

``MetadataWrapper.resolve_many`` runs each provider's own walk over the tree and then, for the
providers it batches (parents, expression contexts, scopes), one more walk of its batched visitor
per level of dependencies, which calls nothing here: every provider does its work in
``visit_Module``. Over the fixtures that is half the time of the analysis. So the parents come
from one walk of our own (codemod/facts_walk.py: the nodes in the order of LibCST's walk, without
the copy of every node a LibCST visitor makes), and the scopes from LibCST's own ScopeProvider run
directly (scopes, the expression contexts read off the targets: ``_Stored``; what the wrapper
would run, without its extra walks and per-field lookups; the results are the same maps, which
tests/test_facts.py checks).
Positions are computed when first asked for, one top-level statement at a time
(codemod/layout.py). Should LibCST's internals change, the wrapper's way is taken.

These walks go past LibCST's tokens (facts_walk.TOKENS: whitespace, comments, blank lines,
operators, brackets), at which neither LibCST's scope analysis nor any visitor read here does
anything: the parents, spans and scopes name every node but the tokens.
"""

from __future__ import annotations

import functools
import gc
from contextlib import contextmanager
from collections.abc import MutableSet
from typing import TYPE_CHECKING, Any, Callable, Iterator, Mapping, Optional

import libcst as cst
from libcst.metadata import (
    BatchableMetadataProvider,
    ExpressionContextProvider,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

from libcst.metadata import scope_provider
from libcst.metadata.expression_context_provider import ExpressionContext, ExpressionContextVisitor
from libcst.metadata.scope_provider import ScopeVisitor

from accelerate_rewrite.codemod.facts_walk import SharedNode, Spans, _children, _walk

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.layout import Layout


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


class _Parents(LeanVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[cst.CSTNode] = []
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        #: node -> (its index in the walk's order, the index of the first node after its subtree)
        self.spans = Spans()
        self._starts: list[int] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.stack:
            at = len(self.parents)
            self._starts.append(at)
            self.parents[node] = self.stack[-1]
            self.spans.index[node] = at
            self.spans.ends.append(0)
        self.stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()
        if self.stack:
            self.spans.ends[self._starts.pop()] = len(self.parents)


def parents(module: cst.Module) -> dict[cst.CSTNode, cst.CSTNode]:
    """node -> its parent (what ParentNodeProvider gives), in one walk."""
    return parents_and_spans(module)[0]


def parents_and_spans(module: cst.Module):
    """``parents(module)``, and node -> (its index in the walk, the index after its subtree),
    the nodes in the order of LibCST's walk (``_walk``)."""
    return walk(module)[:2]


def walk(module: cst.Module):
    """``parents_and_spans(module)``, and node class -> the nodes of that class in the walk's
    order (None if LibCST's internals moved and its own walk was taken)."""
    try:
        return _walk(module)
    except (AttributeError, TypeError):  # LibCST's internals moved: its own walk
        visitor = _Parents()
        module.visit(visitor)
        return visitor.parents, visitor.spans, None


class _Contexts(LeanVisitor, ExpressionContextVisitor):
    pass


def _assignment_like() -> Optional[frozenset[type]]:
    """The node classes ScopeVisitor counts as assignments (``_ASSIGNMENT_LIKE_NODES``, with
    their subclasses), or None if LibCST no longer names them."""
    kinds = getattr(scope_provider, "_ASSIGNMENT_LIKE_NODES", None)
    if not isinstance(kinds, tuple):
        return None
    return frozenset(c for c in vars(cst).values() if isinstance(c, type) and issubclass(c, kinds))


_ASSIGNMENT_LIKE = _assignment_like()


class _Lazy(MutableSet):
    """One of the sets LibCST's scope analysis fills at its end (``infer_accesses``): an access's
    assignments (``Access.referents``) or an assignment's accesses (``references``), filled by
    LibCST's own methods when first read instead. Each access gets every earlier assignment of
    its name in its scope, and each assignment every later access: a name bound n times and
    read n times in one scope makes about n * n entries (a 50,000-line script: 100 MB and
    3 CPU-s, most of which nothing reads). ``fill(*args)`` adds to this set through ``|=``."""

    __slots__ = ("_set", "_fill", "_args")

    def __init__(self, fill: Callable, *args: Any) -> None:
        self._set: Optional[set] = None
        self._fill: Optional[Callable] = fill
        self._args = args

    def _real(self) -> set:
        if self._set is None:
            self._set = set()
            fill, args = self._fill, self._args
            self._fill = self._args = None
            fill(*args)
        return self._set

    def __ior__(self, other):  # what LibCST's methods fill with
        self._real().update(other)
        return self

    def __contains__(self, item: object) -> bool:
        return item in self._real()

    def __iter__(self):
        return iter(self._real())

    def __len__(self) -> int:
        return len(self._real())

    def add(self, item: Any) -> None:
        self._real().add(item)

    def discard(self, item: Any) -> None:
        self._real().discard(item)

    def clear(self) -> None:
        """Empty, unread or not (``_unlink``: what the filling would name goes)."""
        self._set, self._fill, self._args = set(), None, None

    def __repr__(self) -> str:
        return f"_Lazy({self._set!r})" if self._set is not None else "_Lazy(<unread>)"


def _every_scope(computed: Mapping[cst.CSTNode, Any]) -> dict[int, Any]:
    """id -> scope, for the scopes of a scope analysis and the builtin scope, which no node names."""
    scopes = {id(scope): scope for scope in computed.values() if scope is not None}
    for scope in list(scopes.values()):
        while id(scope.parent) not in scopes:
            scope = scopes.setdefault(id(scope.parent), scope.parent)
    return scopes


class _Scopes(LeanVisitor, ScopeVisitor):
    #: whether the sets ``infer_accesses`` makes are filled when first read (``_Lazy``)
    lazy = False

    def on_leave(self, original_node: cst.CSTNode) -> None:
        """ScopeVisitor's ``on_leave``, its ``isinstance`` against a tuple of abstract classes
        (a tenth of the scope analysis) a set lookup of the node's class."""
        self.provider._computed[original_node] = self.scope
        if type(original_node) in _ASSIGNMENT_LIKE:
            self.scope._assignment_count += 1
        LeanVisitor.on_leave(self, original_node)

    def infer_accesses(self) -> None:
        """ScopeVisitor's ``infer_accesses``, step for step, but for the two calls that fill an
        access's assignments (``Access.record_assignments``) and the accesses of every assignment
        a scope's reads of a name reach (``record_accesses``): those are made when the set is
        first read (``_Lazy``), the second for every assignment of that name at once (it adds
        to those of the enclosing scopes too). The builtin scope makes an assignment for a
        builtin's name the first time a name is looked up there: those lookups are made here,
        where LibCST's calls would make them. What the analysis's sets hold when read is what
        LibCST's would: the probe (``_lean_agrees``) and tests/test_facts.py compare them."""
        deferred = getattr(self, "_ScopeVisitor__deferred_accesses", None)
        dotted = getattr(scope_provider, "_gen_dotted_names", None)
        if not self.lazy or deferred is None or dotted is None:
            return ScopeVisitor.infer_accesses(self)
        record_assignments = scope_provider.Access.record_assignments
        groups: dict[tuple[Any, str], list] = {}
        for item in deferred:
            access, attribute, annotation = item.access, item.enclosing_attribute, item.enclosing_string_annotation
            name = access.node.value
            if attribute is not None:
                for attr_name, node in dotted(attribute):
                    if attr_name in access.scope:
                        access.node = node
                        name = attr_name
                        break
            if annotation is not None:
                access.node = annotation
            scope, index = access.scope, access._index
            # the lookups of record_assignments: its own, and its parent's when every
            # assignment it finds comes later in the same scope
            found = scope._resolve_scope_for_access(name, scope)
            if found and scope.parent is not scope \
                    and not any(a.scope is not scope or a._index < index for a in found):
                scope.parent._resolve_scope_for_access(name, scope)
            group = groups.get((scope, name))
            if group is None:
                group = groups[(scope, name)] = [set(), index]
            group[0].add(access)
            group[1] = min(group[1], index)
            access._Access__assignments = _Lazy(record_assignments, access, name)
            scope.record_access(name, access)
        pending: dict[str, list[tuple[Any, set]]] = {}
        for (scope, name), (accesses, first) in groups.items():
            # the lookup of record_accesses where an assignment of this scope comes after a read
            found = scope._resolve_scope_for_access(name, scope)
            if scope.parent is not scope and any(a.scope is scope and first <= a._index for a in found):
                scope.parent._resolve_scope_for_access(name, scope.parent)
            pending.setdefault(name, []).append((scope, accesses))

        def replay(name: str) -> None:
            for scope, accesses in pending.pop(name, ()):
                for assignment in scope._resolve_scope_for_access(name, scope):
                    assignment.record_accesses(accesses)

        for scope in _every_scope(self.provider._computed).values():
            for name, assignments in scope._assignments.items():
                for assignment in assignments:
                    assignment._BaseAssignment__accesses = _Lazy(replay, name)
        self._ScopeVisitor__deferred_accesses = []


def scopes(module: cst.Module, by_type: Optional[dict[type, list[cst.CSTNode]]] = None) -> Mapping[cst.CSTNode, Any]:
    """node -> its scope (what ScopeProvider gives), LibCST's scope analysis run directly: what
    the two providers' ``visit_Module`` do, their visitors made lean (``LeanVisitor``: they have
    no per-field methods) and walking without copies (``_reading``). Given the parents' walk's
    nodes by class (``by_type``), the expression contexts are not walked for: ScopeVisitor asks
    only whether a name is stored to (``_Stored``). The sets of each access's assignments and
    each assignment's accesses are filled when first read (``_Scopes.infer_accesses``).
    Should a probe show either way answering otherwise than LibCST's (``_lean_agrees``),
    LibCST's way is taken."""
    lean = _lean_agrees()
    return _scopes(module, _Stored(by_type) if by_type is not None and lean else None, lazy=lean)


def _scopes(module: cst.Module, contexts: Optional[Mapping], lazy: bool = False) -> Mapping[cst.CSTNode, Any]:
    """``scopes``, the expression contexts given (``_Stored``), or walked for as LibCST does;
    ``lazy``: the sets ``infer_accesses`` fills, filled when first read."""
    if _ASSIGNMENT_LIKE is None:
        raise AttributeError("LibCST's ScopeVisitor changed")  # Metadata takes the wrapper's way
    with _reading(_Contexts, _Scopes, ExpressionContextVisitor):
        if contexts is None:
            walked = ExpressionContextProvider()
            walked.metadata = {}
            module.visit(_Contexts(walked, ExpressionContext.LOAD))
            contexts = walked._computed
        provider = ScopeProvider()
        provider.metadata = {ExpressionContextProvider: contexts}
        visitor = _Scopes(provider)
        visitor.lazy = lazy
        module.visit(visitor)
    visitor.infer_accesses()
    return provider._computed


#: the nodes that bind the names in one of their fields, and that field (ExpressionContextVisitor
#: visits it with the STORE context)
_TARGETS = {cst.AssignTarget: "target", cst.AnnAssign: "target", cst.AugAssign: "target",
            cst.NamedExpr: "target", cst.AsName: "name", cst.CompFor: "target", cst.For: "target",
            cst.ClassDef: "name", cst.FunctionDef: "name", cst.Param: "name"}


class _Stored:
    """What ExpressionContextProvider says of a name, as far as ScopeVisitor asks it: STORE for
    the names it marks so, LOAD for any other (ScopeVisitor's ``visit_Name``, the one place that
    asks, takes LOAD, DEL and no context alike). The names stored to are those of the targets
    (``_TARGETS``), through tuples, lists and starred elements, not into an attribute or a
    subscript (whose parts are read): found from the nodes by class, without a walk of the tree.
    tests/test_facts.py checks the scopes against LibCST's on every fixture."""

    def __init__(self, by_type: dict[type, list[cst.CSTNode]]) -> None:
        todo = [getattr(node, field) for kind, field in _TARGETS.items() for node in by_type.get(kind, ())]
        stored: set[int] = set()
        while todo:
            node = todo.pop()
            kind = type(node)
            if kind is cst.Name:
                stored.add(id(node))
            elif kind is not cst.Attribute and kind is not cst.Subscript:
                todo.extend(_children(node))
        self.stored = stored

    def get(self, node: cst.CSTNode, default: Any = None) -> ExpressionContext:
        return ExpressionContext.STORE if id(node) in self.stored else ExpressionContext.LOAD

    __getitem__ = get


#: binds and reads every way ``_Stored`` knows of, and rebinds, shadows, reads before binding
#: (``_lean_agrees``)
_PROBE = """import a.b as c
from d import e as f, g
x, (y, *z) = w = v
x.attr, x[k] = 1, 2
n += 1
m: int = 2
for i, (j, *l) in q:
    del i
with o as (r, s):
    pass
try:
    pass
except E as t:
    pass
print([u for u, uu in p if (h := u)], lambda aa, *bb, cc=dd, **ee: aa)
def ff(gg, /, hh: int = ii, *jj, kk, **ll) -> mm:
    global nn
    nn = gg
class KK(LL):
    oo = pp
    def qq(self):
        return oo, len
import os.path
def rr(len):
    print(len, x, os.path.join(x))
    x = 1
    x = x + len
    print(x)
    len = 2
    def ss():
        nonlocal x
        x = len(x)
    global tt
    tt = [x for x in tt]
    return x, tt, str
x = x + 1
del x
def uu():
    print(open)
    open = 1
def vv():
    input = 1
    print(input)
    input = 2
class WW:
    iter = 1
    def xx(self):
        print(iter)
        iter = 2
"""


@functools.cache
def _lean_agrees() -> bool:
    """Whether the scopes made with ``_Stored`` and ``_Lazy`` are LibCST's own on a probe that
    binds names every way ``_Stored`` knows of and reads them every way the sets of
    ``infer_accesses`` tell apart (once a process: should a later LibCST's ScopeVisitor ask the
    expression contexts otherwise, or fill its sets otherwise, LibCST's way is taken)."""
    try:
        module = cst.parse_module(_PROBE)
        ours = _scopes(module, _Stored(walk(module)[2]), lazy=True)
        theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(ScopeProvider)

        def shape(scope) -> tuple:
            return (sorted((a.name, id(getattr(a, "node", None)),
                            sorted(id(r.node) for r in a.references)) for a in scope.assignments),
                    sorted((id(a.node), sorted(id(getattr(r, "node", None)) for r in a.referents))
                           for a in scope.accesses))
        return shape(ours[module].parent) == shape(theirs[module].parent) and all(  # the builtins too
            shape(ours[node]) == shape(scope) for node, scope in theirs.items() if scope is not None and node in ours)
    except Exception:  # noqa: BLE001 (LibCST's internals moved: its own way)
        return False


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


class Metadata(dict):
    """provider -> its values for one tree: parents and scopes at once, positions one top-level
    statement at a time (codemod/layout.py) when first asked for, any other provider by the
    wrapper when it is first asked for."""

    def __init__(self, wrapper: MetadataWrapper, layout: Optional[Callable[[], "Layout"]] = None) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.layout = layout
        module = wrapper.module
        #: node -> its span in the parents' walk (codemod/facts_index.py); None the wrapper's way
        self.spans = None
        #: node class -> its nodes in the walk's order (codemod/facts_index.py), or None
        self.by_type: Optional[dict[type, list[cst.CSTNode]]] = None
        #: whether a node stands twice in the tree (ScriptFacts then analyses a copy)
        self.shared = False
        try:
            self[ParentNodeProvider], self.spans, self.by_type = walk(module)
            self[ScopeProvider] = scopes(module, self.by_type)
        except SharedNode:
            self.shared = True
        except (AttributeError, TypeError, KeyError):  # LibCST's internals moved: its own way
            self.spans = self.by_type = None
            self.update(wrapper.resolve_many([ParentNodeProvider, ScopeProvider]))

    def release_scopes(self) -> None:
        """Let the scopes go (LibCST's scope analysis: about a fifth of a long script's analysis
        in memory); asked for again, they are made again (``__missing__``). Nothing may keep a
        scope, an assignment or an access of theirs past this: their cycles are cut
        (``_unlink``)."""
        computed = self.pop(ScopeProvider, None)
        if computed is not None and not _unlink(computed):
            gc.collect()

    def __missing__(self, provider):
        if provider is ScopeProvider and self.by_type is not None:
            values = scopes(self.wrapper.module, self.by_type)
        elif provider is PositionProvider and self.layout is not None:
            from accelerate_rewrite.codemod.positions import Positions

            parents = self[ParentNodeProvider]
            values = Positions(self.layout(), parents.get, lambda: resolve(self.wrapper, provider))
        else:
            values = resolve(self.wrapper, provider)
        self[provider] = values
        return values


def _unlink(computed: Mapping[cst.CSTNode, Any]) -> bool:
    """Cut the cycles of LibCST's scope analysis, let go (an assignment and its accesses name each
    other; a scope, the assignments and accesses it holds; the global and builtin scopes each
    other), so that reference counting frees it at once, without the cyclic collector's pass
    over every object of the process (a second for a 50k-line script, where a few hundredths of
    the analysis are then left for the collector). Each scope is emptied: one kept past this
    fails loudly (AttributeError) rather than answer wrong. False where LibCST's scopes are not
    made as this expects (the caller collects instead)."""
    try:
        scopes = _every_scope(computed)
        for scope in scopes.values():
            for group in scope._assignments.values():
                for assignment in group:
                    assignment._BaseAssignment__accesses.clear()
            for group in scope._accesses_by_name.values():
                for access in group:
                    access._Access__assignments.clear()
    except AttributeError:
        return False
    for scope in scopes.values():
        scope.__dict__.clear()
    return True


def resolve(wrapper: MetadataWrapper, provider) -> Mapping[cst.CSTNode, Any]:
    """``wrapper.resolve(provider)``; for a provider that depends on none and is not batched
    (positions), its own walk alone: the wrapper would add a walk of its batched visitor with
    nothing to call."""
    if provider.METADATA_DEPENDENCIES or provider.gen_cache or issubclass(provider, BatchableMetadataProvider):
        return wrapper.resolve(provider)
    try:
        return provider()._gen(wrapper)
    except (AttributeError, TypeError):  # LibCST's internals moved: its own way
        return wrapper.resolve(provider)
