"""LibCST's scope analysis of a tree, run lean: what ScopeProvider's ``visit_Module`` does, its
visitors walking without copies or per-field lookups (codemod/tree/walk.py), the expression
contexts read off the targets (``_Stored``) instead of walked for, and the sets its end fills
(each read's assignments, each assignment's reads) filled when first asked for (``_Lazy``).
A probe (``_probe_agrees``) checks these ways against LibCST's own, once a process on a LibCST
not measured so (``AGREES_ON``), and tests/test_facts.py on every fixture; should LibCST's
internals change, its own way is taken.
``_unlink`` cuts the analysis's cycles so that it is freed without the cyclic collector."""

from __future__ import annotations

import functools
from collections.abc import MutableSet
from typing import Any, Callable, Mapping, Optional

import libcst as cst
from libcst.metadata import ExpressionContextProvider, MetadataWrapper, ScopeProvider
from libcst.metadata import scope_provider
from libcst.metadata.expression_context_provider import ExpressionContext, ExpressionContextVisitor
from libcst.metadata.scope_provider import ScopeVisitor

from accelerate_rewrite.codemod.tree.walk import LeanVisitor, _children, _reading, _walk, node_classes


class _Contexts(LeanVisitor, ExpressionContextVisitor):
    pass


def _assignment_like() -> Optional[frozenset[type]]:
    """The node classes ScopeVisitor counts as assignments (``_ASSIGNMENT_LIKE_NODES``, with
    their subclasses), or None if LibCST no longer names them."""
    kinds = getattr(scope_provider, "_ASSIGNMENT_LIKE_NODES", None)
    if not isinstance(kinds, tuple):
        return None
    return node_classes(*kinds)


_ASSIGNMENT_LIKE = _assignment_like()


class _Lazy(MutableSet):
    """One of the sets LibCST's scope analysis fills at its end (``infer_accesses``): an access's
    assignments (``Access.referents``) or an assignment's accesses (``references``), filled by
    LibCST's own methods when first read instead. Each access gets every earlier assignment of
    its name in its scope, and each assignment every later access: a name bound n times and
    read n times in one scope makes about n * n entries (the generated 50,000-line script:
    about 100 MiB and a few CPU-seconds, which nothing reads). ``fill(*args)`` adds to this set
    through ``|=``."""

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

    @classmethod
    def _from_iterable(cls, items):  # ``a | b``, ``a - b`` and the like: a set, as LibCST's give
        return set(items)

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


#: the first names of the qualified names ScopeVisitor looks for at calls and subscripts (a
#: ``typing.cast``, ``typing.TypeVar``, ``typing.NewType`` call; a subscript of ``typing.*`` or
#: ``typing_extensions.*``)
_TYPING = frozenset({"typing", "typing_extensions"})


class _Scopes(LeanVisitor, ScopeVisitor):
    #: whether the sets ``infer_accesses`` makes are filled when first read (``_Lazy``)
    lazy = False
    #: whether a qualified name can start with ``typing`` (``_typing_named``): if not, the
    #: lookups of ``visit_Call`` and ``visit_Subscript`` can't find what they look for
    typing = True

    def visit_Call(self, node: cst.Call) -> Optional[bool]:
        """ScopeVisitor's ``visit_Call``, without the lookup of the call's qualified names where
        none can be one of ``typing``'s: that lookup walks every binding of the name called (of
        ``loss`` in ``loss.backward()``), so a name bound n times and called n times in one
        function cost n * n."""
        if self.typing:
            return ScopeVisitor.visit_Call(self, node)
        self._ScopeVisitor__top_level_attribute_stack.append(None)
        self._ScopeVisitor__in_type_hint_stack.append(False)
        return True

    def visit_Subscript(self, node: cst.Subscript) -> Optional[bool]:
        if self.typing:
            return ScopeVisitor.visit_Subscript(self, node)
        self._ScopeVisitor__in_type_hint_stack.append(False)
        return True

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
        LibCST's would: the probe (``_probe_agrees``) and tests/test_facts.py compare them."""
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
    if by_type is None or not lean:
        return _scopes(module, None, lazy=lean)
    return _scopes(module, _Stored(by_type), lazy=True, typing=_typing_named(by_type))


def _typing_named(by_type: dict[type, list[cst.CSTNode]]) -> bool:
    """Whether a qualified name in this tree can start with ``typing`` or ``typing_extensions``.
    Every qualified name LibCST gives is made of names in the tree: an import's module and
    names, a binding's dotted name, a scope's functions and classes (``builtins.`` aside). So
    where no ``Name`` is one of those two, none can; and a string annotation's names only read
    what the tree binds. tests/test_facts.py compares the scopes with LibCST's on every fixture."""
    return any(node.value in _TYPING for node in by_type.get(cst.Name, ()))


def _scopes(module: cst.Module, contexts: Optional[Mapping], lazy: bool = False,
            typing: bool = True) -> Mapping[cst.CSTNode, Any]:
    """``scopes``, the expression contexts given (``_Stored``), or walked for as LibCST does;
    ``lazy``: the sets ``infer_accesses`` fills, filled when first read; ``typing``: whether a
    qualified name can start with ``typing`` (``_typing_named``)."""
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
        visitor.typing = typing or not hasattr(visitor, "_ScopeVisitor__in_type_hint_stack") \
            or not hasattr(visitor, "_ScopeVisitor__top_level_attribute_stack")
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
#: (``_probe_agrees``)
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


#: the LibCST versions on which the probe agrees, as tests/test_facts.py measures it with the
#: LibCST of the constraints (and fails where that one is not here): on these the probe is not run
#: again in each process (70 ms a process, each run of the command and of the hook)
AGREES_ON = frozenset({"1.9.0"})


def _libcst_version() -> Optional[str]:
    try:
        from libcst._version import __version__
    except ImportError:  # LibCST's internals moved: the probe says
        return None
    return __version__


@functools.cache
def _lean_agrees() -> bool:
    """Whether the scopes made with ``_Stored`` and ``_Lazy`` are LibCST's own: on a LibCST
    measured so (``AGREES_ON``), yes; on another, what the probe says (``_probe_agrees``), once a
    process."""
    return _libcst_version() in AGREES_ON or _probe_agrees()


def _probe_agrees() -> bool:
    """Whether the scopes made with ``_Stored`` and ``_Lazy`` are LibCST's own on a probe that
    binds names every way ``_Stored`` knows of and reads them every way the sets of
    ``infer_accesses`` tell apart (should a later LibCST's ScopeVisitor ask the expression
    contexts otherwise, or fill its sets otherwise, LibCST's way is taken)."""
    try:
        module = cst.parse_module(_PROBE)
        by_type = _walk(module)[2]
        ours = _scopes(module, _Stored(by_type), lazy=True, typing=_typing_named(by_type))
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
