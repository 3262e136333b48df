"""ScriptFacts: what a training script is made of, found in one walk over the tree.

Rules read these facts; they never walk the tree for the same things again. Nodes kept here
belong to the analysed tree (``facts.module``), so rules can key their edits on them.

Objects are named by a *key*: ``(owner, path)``, where ``owner`` is the node of the scope a
name lives in (Module, FunctionDef, Lambda, ...) and ``path`` is the name, or ``(ClassDef,
"self.attr")`` for an attribute set on ``self`` in a method. Values flow between keys through
plain assignments, call arguments into the parameters of functions and classes defined in the
same file, and ``self.attr = param`` in methods: that is how a ``device`` passed into
``train(model, optimizer, loader, device)`` or kept as ``self.device`` is still known to be the
device there.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator, Optional, TypeVar

import libcst as cst
import libcst.matchers as m
from libcst.metadata import (
    GlobalScope,
    MetadataWrapper,
    PositionProvider,
    ScopeProvider,
)

# what the facts are made of (kinds.py) and the walk that finds them (collect.py),
# imported from here by the rules
if TYPE_CHECKING:
    from accelerate_rewrite.codemod.tree.layout import Layout

from accelerate_rewrite.codemod.analysis.kinds import (  # noqa: F401
    APEX_INITIALIZE,
    APEX_LOAD_STATE_DICT,
    APEX_MASTER_PARAMS,
    APEX_SCALE_LOSS,
    APEX_STATE_DICT,
    AUTOCAST,
    BCE_FUNCTIONS,
    BCE_MODULES,
    CLIP_NORM,
    CLIP_VALUE,
    DATALOADERS,
    DATA_PARALLEL,
    DEVICE,
    GRAD_SCALERS,
    HAND_DDP,
    LOADER,
    MODEL,
    MODULE,
    OPTIMIZER,
    LOSS_SCALER,
    SCALER,
    SCHEDULER,
    BackwardSite,
    Binding,
    CallSite,
    DeviceMove,
    Function,
    Key,
    Optimizer,
    Owner,
    hand_updated,
)
from accelerate_rewrite.codemod.analysis.hints import MARK_WORD, hints_of
from accelerate_rewrite.codemod.analysis.identity import Flow
from accelerate_rewrite.codemod.analysis.index import Index
from accelerate_rewrite.codemod.analysis.places import Places
from accelerate_rewrite.codemod.tree.metadata import Metadata
from accelerate_rewrite.codemod.analysis.collect import _Collector
from accelerate_rewrite.codemod.analysis.syntax import (  # noqa: F401 (the rules import them from here)
    code,
    short,
    root_of,
    unwrap_moves,
    positional_params,
    param_for,
    init_of,
    is_device_expr,
    is_literal_device,
)


T = TypeVar("T")


class ScriptFacts(Places, Index, Flow):
    def __init__(self, module: cst.Module, folder: Optional[Path] = None, *, fresh: bool = False,
                 body_parts: Optional[list[int]] = None, known: Optional[dict[int, tuple[str, int]]] = None,
                 text: Optional[str] = None, marked: Optional[bool] = None,
                 part_files: Optional[list[Path]] = None) -> None:
        """``fresh``: no node stands twice in ``module`` (it was parsed, or made of the statements
        of parsed trees), so it is analysed as it is (LibCST's ``unsafe_skip_copy``; the
        parents' walk makes sure, and a tree where a node does stand twice is copied after all);
        otherwise the analysis works on a copy, in which no node is shared (copying a tree costs
        more than parsing it). ``body_parts``: for a project, the file each top-level statement
        comes from (below); ``known``: the code of some of its statements (``layout``);
        ``text``: the text ``module`` was parsed from, which the statements' code is cut from;
        ``marked``: whether the texts of a project's analysed module hold ``accelerate-rewrite``
        anywhere (for a script, ``text`` says): where they don't, no statement has a hint."""
        #: the script's folder, where its own modules are (codemod/analysis/siblings.py); None for a
        #: source with no file
        self.folder = folder
        self._known = known
        self._text = text
        #: whether any comment may hold a hint (``hints``): the texts say, where they are known
        self.marked = marked if marked is not None else (text is None or MARK_WORD in text)
        self.wrapper = MetadataWrapper(module, unsafe_skip_copy=fresh)
        self.module = self.wrapper.module
        #: parents and scopes now (the walk below reads them), positions when first asked for
        #: (a line for a note, the lines an edit touches): codemod/tree/metadata.py; qualified
        #: names are asked of the scopes, node by node (``qualnames``)
        self._meta = Metadata(self.wrapper, self.layout)
        if self._meta.shared:  # a node twice in the tree: the analysis is of a copy
            self._known = None
            self.wrapper = MetadataWrapper(module)
            self.module = self.wrapper.module
            self._meta = Metadata(self.wrapper, self.layout)
        self._qualnames: dict[cst.CSTNode, frozenset[str]] = {}
        #: (scope, dotted name) -> the qualified names of the calls and attributes so named there
        #: (``Places._by_name_key``); emptied with the scopes
        self._qualnames_by_name: dict[tuple, frozenset[str]] = {}
        self.bindings: list[Binding] = []
        self.backward_sites: list[BackwardSite] = []
        self.device_moves: list[DeviceMove] = []
        self.calls: list[CallSite] = []  # every call with a resolved qualified name
        self.prints: list[cst.Call] = []
        self.decorators: list[cst.Decorator] = []
        self.returns: list[cst.Return] = []  # every return statement, in order
        self.attribute_calls: list[cst.Call] = []  # ``x.method(...)``, in order
        #: every outermost Name / Attribute with a qualified name (``torch.cuda.amp.autocast``)
        self.qualified_refs: list[tuple[cst.CSTNode, str]] = []
        self.frameworks: list[tuple[str, cst.CSTNode]] = []
        self.functions: dict[str, Function] = {}  # module-level functions and classes by name
        self.module_classes: set[str] = set()  # classes in the file deriving from nn.Module
        self.kinds: dict[Key, set[str]] = {}
        self._aliases: list[tuple[Key, cst.BaseExpression]] = []
        self._memo: dict[object, object] = {}
        #: (id of a scope, name) -> (that scope, what ``assignments`` says of the name there)
        self._bound: dict[tuple[int, str], tuple[object, tuple]] = {}
        #: id(``self.attr``) -> (it, its key or None): ``key_of``'s, asked again at each flow
        self._self_keys: dict[int, tuple[cst.Attribute, Optional[Key]]] = {}
        self._ready = False
        self._self_attrs: list[cst.Attribute] = []
        #: keys of loaders built in a helper that returns them (codemod/analysis/returns.py): they are
        #: set up where the helper's result is bound, which holds their own bindings
        self.returned_loaders: set[Key] = set()
        #: for a project (codemod/project/program.py): the file (0: the script) each top-level statement
        #: of the analysed module comes from; None for a script alone
        self.body_parts: Optional[list[int]] = body_parts
        #: for a project: each part's file, where its relative imports start from
        #: (codemod/analysis/sampling.py reads a class a module imports so)
        self.part_files: Optional[list[Path]] = part_files
        #: loaders taken for loaders where the script receives them from a call the analysis
        #: can't see into (codemod/analysis/returns.py): set up there, and the note says it was assumed
        self.assumed_loaders: set[Key] = set()
        #: names bound to a dict of DataLoaders (Person_reID's ``dataloaders = {x: DataLoader(...)
        #: for x in ['train', 'val']}``), read as ``dataloaders[phase]``: set up entry by entry
        self.loader_dicts: set[Key] = set()
        #: ``(owner, "dataset.train")``: attributes of objects of classes of the project that
        #: their ``__init__`` binds to DataLoaders (codemod/analysis/returns.py)
        #: (and the class of the project that builds them, when it is analysed: its own bindings
        #: of them are not set up where they are)
        self.object_attributes: dict[Key, Optional[cst.ClassDef]] = {}
        #: what a one-line hint (codemod/analysis/hints.py) made a loader or an optimizer's model
        self.hinted: set[Key] = set()
        #: (statement, wrapper call, the optimizer built in its arguments): a wrapper the script
        #: steps whose class the analysis can't see into, so the optimizer inside can't be reached
        self.opaque_optimizers: list[tuple[cst.BaseStatement, cst.Call, cst.Call]] = []
        _Collector(self).collect()
        from accelerate_rewrite.codemod.analysis.returns import assume_received_loaders, find_returned_loaders

        find_returned_loaders(self)
        assume_received_loaders(self)
        self._flow()
        self.frameworks = [(label, node) for label, node in self.frameworks if not self._unused_elsewhere(node)]
        self._ready = True  # the facts are complete: conclusions drawn from them may be kept

    def hints(self, stmt: cst.CSTNode) -> dict[str, Optional[str]]:
        """The hints on ``stmt``'s lines (codemod/analysis/hints.py), none where no text of the
        analysed code holds the word a hint starts with."""
        return hints_of(stmt) if self.marked else {}

    def memo(self, key: object, compute):
        """A conclusion drawn from these facts once and shared by several rules (e.g. the
        Fabric plan for one set of options)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    def release(self) -> None:
        """Let the scope analysis go once the rules have run (a long script: the engine then
        keeps these facts for no other rewrite). What is asked of the scopes afterwards (the
        first read of a name a result no longer defines) is asked of a new analysis: keys are
        nodes and names, never scopes, so nothing kept refers to the old one (the qualified names
        kept by scope, ``_qualnames_by_name``, are emptied with it)."""
        self._bound.clear()
        self._qualnames_by_name.clear()
        self._meta.release_scopes()

    def dispose(self) -> None:
        """Let everything go at once, the rewrite done (a long script, whose facts the engine
        keeps for no other rewrite): these facts and their metadata name each other, so
        without this the tree and its maps would wait for the cyclic collector, whose passes
        over a long script's million objects cost a second each."""
        self._meta.release_scopes()
        self._meta.clear()
        self._memo.clear()
        self.__dict__.clear()

    def layout(self) -> "Layout":
        """Each top-level statement's code and first line (codemod/tree/layout.py), made once."""
        from accelerate_rewrite.codemod.tree.layout import Layout

        return self.memo("layout", lambda: Layout(self.module, known=self._known, text=self._text))

    def _unused_elsewhere(self, node: cst.CSTNode) -> bool:
        """``node`` is in another file of the project, in a class or function there that the
        program never uses (a LightningModule that another script trains), or in an import that
        only such code reads: nothing this script runs."""
        part = self.part_of(node)
        if part == 0:
            return False

        def unused(stmt: cst.CSTNode) -> bool:
            if not isinstance(stmt, (cst.ClassDef, cst.FunctionDef)):
                return False
            fn = self.functions.get(stmt.name.value)
            return fn is not None and fn.node is stmt and not fn.calls and not fn.other_uses

        top = self._top_statement(node)
        if unused(top):
            return True
        if m.matches(top, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()])):
            imp = top.body[0]
            if isinstance(imp.names, cst.ImportStar):
                return False
            bound = {(a.asname.name.value if a.asname is not None and isinstance(a.asname.name, cst.Name)
                      else code(a.name).split(".")[0]) for a in imp.names}
            # the names the file's statements read, but in its imports and unused definitions
            read = self.memo(("names-read-in-part", part), lambda: {
                n.value for s, p in zip(self.module.body, self.body_parts or ()) if p == part and not unused(s)
                and not m.matches(s, m.SimpleStatementLine(body=[m.Import() | m.ImportFrom()]))
                for n in m.findall(s, m.Name())})
            return not bound & read
        return False

    # ---- keys and kinds ------------------------------------------------------------------
    def key_of(self, expr: cst.BaseExpression) -> Optional[Key]:
        """The key an expression names: a Name (resolved through scopes) or ``self.attr``."""
        if isinstance(expr, cst.Name):
            return self.key_for_name(expr, expr.value)
        # ``self.attr``; asked of every value of the program's flows (codemod/analysis/identity.py),
        # so read as types, not with a matcher made and matched at each call
        if type(expr) is cst.Attribute and type(expr.value) is cst.Name and expr.value.value == "self" \
                and type(expr.attr) is cst.Name:
            found = self._self_keys.get(id(expr))  # (its function is found once: up its parents)
            if found is None or found[0] is not expr:
                func = self.function(expr)
                cls = self.enclosing_class(func) if func is not None else None
                found = self._self_keys[id(expr)] = (expr, (cls, f"self.{expr.attr.value}") if cls is not None else None)
            if found[1] is not None:
                return found[1]
        elif self.object_attributes and isinstance(expr, cst.Attribute) and isinstance(expr.value, cst.Name):
            return self._object_attribute(expr)
        return None

    def _object_attribute(self, expr: cst.Attribute) -> Optional[Key]:
        """``dataset.train`` where ``dataset = Cifar(...)`` is an object of a class of the
        project whose ``__init__`` builds a DataLoader into ``self.train`` (SAM's example):
        ``(owner, "dataset.train")`` (codemod/analysis/returns.py binds it)."""
        owner = self.key_of(expr.value)
        key = (owner[0], f"{expr.value.value}.{expr.attr.value}") if owner is not None else None
        return key if key in self.object_attributes else None

    def key_for_name(self, node: cst.CSTNode, name: str) -> Optional[Key]:
        """The key that ``name`` would name if it were read where ``node`` stands."""
        scope = self.scope(node)
        if scope is None:
            return None
        assignments = scope[name]
        if not assignments:
            return None
        scope = next(iter(assignments)).scope
        owner = self.module if isinstance(scope, GlobalScope) else getattr(scope, "node", None)
        return None if owner is None else (owner, name)

    def assignments(self, name: cst.Name) -> list[tuple[cst.CSTNode, Optional[cst.BaseExpression]]]:
        """Every binding of ``name`` in its scope: (the node bound, the value of ``name = <value>``
        where the binding is that plain assignment, or its element of ``a, b = x, y``, else None:
        a loop variable, an import, ...)."""
        scope = self.scope(name)
        key = (id(scope), name.value)  # the same for every read of the name in that scope
        known = self._bound.get(key)
        if known is not None:
            return list(known[1])
        out = []
        for assignment in self.in_order(scope[name.value] if scope is not None else (),
                                        lambda a: getattr(a, "node", None)):
            target = getattr(assignment, "node", None)
            parent = self.parent(target) if isinstance(target, cst.CSTNode) else None
            assign = self.parent(parent) if isinstance(parent, cst.AssignTarget) else None
            plain = isinstance(assign, cst.Assign) and len(assign.targets) == 1 and assign.targets[0].target is target
            value = assign.value if plain else None
            element = parent if isinstance(parent, cst.Element) else None
            tup = self.parent(element) if element is not None else None
            holder = self.parent(tup) if isinstance(tup, cst.Tuple) else None
            assign = self.parent(holder) if isinstance(holder, cst.AssignTarget) else None
            if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and isinstance(assign.value, cst.Tuple) \
                    and len(assign.value.elements) == len(tup.elements) \
                    and not any(isinstance(e, cst.StarredElement) for e in (*tup.elements, *assign.value.elements)):
                index = next(i for i, e in enumerate(tup.elements) if e is element)
                value = assign.value.elements[index].value  # ``a, b = x, y``
            out.append((target, value))
        self._bound[key] = (scope, tuple(out))  # (the scope kept: its id is not reused)
        return out

    def assigned_value(self, name: cst.Name) -> Optional[cst.BaseExpression]:
        """The value of ``name = <value>`` when that is the name's one assignment in its scope."""
        bound = self.assignments(name)
        return bound[0][1] if len(bound) == 1 else None

    def kinds_of(self, expr: cst.BaseExpression) -> set[str]:
        key = self.key_of(expr)
        return self.kinds.get(key, set()) if key else set()

    def is_kind(self, expr: cst.BaseExpression, kind: str) -> bool:
        return kind in self.kinds_of(expr)

    def undefined_names(self) -> dict[str, int]:
        """Names the script reads without defining them (star imports, globals(), typos)."""
        from accelerate_rewrite.codemod.checks import undefined_in

        class Lines:  # positions are computed only when a name is undefined
            @staticmethod
            def get(node, default=None):
                return self._meta[PositionProvider].get(node, default)

        return undefined_in(self._meta[ScopeProvider], Lines)

    def first_read(self, name: str) -> Optional[int]:
        """The first line where the script reads ``name``."""
        lines = [
            self.line(access.node)
            for scope in {s for s in self._meta[ScopeProvider].values() if s is not None}
            for access in scope.accesses[name]
        ]
        return min(lines) if lines else None

    def bindings_of(self, kind: str) -> list[Binding]:
        return [b for b in self.bindings if b.kind == kind]

    @property
    def models(self) -> list[Binding]:
        """Modules built in the script whose parameters an optimizer trains."""
        return [b for b in self.bindings_of(MODULE) if MODEL in self.kinds.get(b.key, set())]

    @property
    def optimizers(self) -> list[Optimizer]:
        def compute() -> list[Optimizer]:
            return [b for b in self.bindings if isinstance(b, Optimizer)]
        return list(self.memo("optimizers", compute)) if self._ready else compute()

    def bound_as(self, key: Optional[Key], kind: str) -> list[Binding]:
        """The bindings of ``kind`` that hold the same object as ``key`` (``same_object``), in
        order: from an index by object made once, not a pass over every binding per question."""
        if key is None:
            return []

        def compute() -> dict[Key, list[Binding]]:
            index: dict[Key, list[Binding]] = {}
            for b in self.bindings_of(kind):
                index.setdefault(self._identity(b.key), []).append(b)
            return index
        return list(self.memo(("bound-as", kind), compute).get(self._identity(key), ()))

    @property
    def loaders(self) -> list[Binding]:
        return self.bindings_of(LOADER)

    @property
    def schedulers(self) -> list[Binding]:
        return self.bindings_of(SCHEDULER)

    @property
    def device_defs(self) -> list[Binding]:
        return self.bindings_of(DEVICE)

    def references_to(self, qualnames: tuple[str, ...]) -> list[tuple[cst.CSTNode, str]]:
        return [(node, q) for node, q in self.qualified_refs if q in qualnames]

    def method_calls(self, kind: str, method: str) -> list[cst.Call]:
        """``scaler.step(...)`` for kind SCALER and method "step": calls of a method on an
        object of that kind."""
        def compute() -> list[cst.Call]:
            return [call for call in self.attribute_calls
                    if call.func.attr.value == method and kind in self.kinds_of(call.func.value)]
        if not self._ready:  # the kinds are still being found
            return compute()
        return list(self.memo(("method-calls", kind, method), compute))

    def attribute_calls_of(self, method: str) -> list[tuple[int, cst.Call]]:
        """``x.<method>(...)`` calls, with their place in ``attribute_calls``: an index kept up
        with the list (the collecting walk appends to it while it asks)."""
        done, index = self._memo.get("attribute-calls-by-method", (0, {}))
        if done < len(self.attribute_calls):
            for i in range(done, len(self.attribute_calls)):
                call = self.attribute_calls[i]
                index.setdefault(call.func.attr.value, []).append((i, call))
            self._memo["attribute-calls-by-method"] = (len(self.attribute_calls), index)
        return index.get(method, [])

    def calls_named(self, *qualnames: str) -> list[cst.Call]:
        """Calls any of whose qualified names is one of these (a name bound twice, e.g. by an
        import and a fallback, has several)."""
        wanted = set(qualnames)
        return [c.call for c in self.calls if c.names & wanted]

    def calls_to(self, *qualnames: str) -> list[CallSite]:
        return [c for c in self.calls if c.qualname in qualnames]

    def references(self, key: Key) -> list[cst.CSTNode]:
        """Every Name (or ``self.attr`` Attribute) that reads the object behind ``key``."""
        owner, path = key
        if path.startswith("self."):
            return [
                n for n in self._self_attrs
                if self.key_of(n) == key and not isinstance(self.parent(n), cst.AssignTarget)
            ]
        scope = self.scope_of_owner(owner)
        if scope is None:
            return []
        out = []
        seen: set[int] = set()
        for assignment in scope.assignments[path]:
            for access in assignment.references:
                if id(access.node) not in seen:
                    seen.add(id(access.node))
                    out.append(access.node)
        return self.in_order(out)

    def in_order(self, items: Iterable[T], node_of: Callable[[T], object] = lambda item: item) -> list[T]:
        """``items`` in the order of their nodes in the source (the walk's), those with no node
        in this tree last: LibCST's scopes keep assignments and accesses in sets, whose order
        follows where they lie in memory, not in the file (a note naming "the first" of them
        would change from one run to the next)."""
        spans = getattr(self._meta, "spans", None)
        items = list(items)
        if spans is None:
            positions = self._meta[PositionProvider]

            def where(item: T) -> tuple:
                pos = positions.get(node_of(item))
                return (0, pos.start.line, pos.start.column) if pos is not None else (1, 0, 0)
        else:
            def where(item: T) -> tuple:
                span = spans.get(node_of(item))
                return (0, span[0]) if span is not None else (1, 0)
        return sorted(items, key=where)

    def scope_of_owner(self, owner: Owner):
        if isinstance(owner, cst.Module):
            return self.scope(owner)
        if isinstance(owner, (cst.FunctionDef, cst.Lambda)):
            body = owner.body
            probe = body.body[0] if isinstance(body, cst.IndentedBlock) and body.body else body
            return self.scope(probe)
        return None

    # ---- whole-script questions ----------------------------------------------------------
    def uses_autocast(self) -> list[CallSite]:
        return self.calls_to(*AUTOCAST)

    def hand_ddp(self) -> list[CallSite]:
        return [c for c in self.calls if c.qualname in HAND_DDP]

    def data_parallel(self) -> list[CallSite]:
        return self.calls_to(*DATA_PARALLEL)


def bce_calls(f: ScriptFacts) -> Iterator[cst.Call]:
    """``F.binary_cross_entropy(...)`` calls and calls of ``nn.BCELoss()`` objects: CUDA autocast
    refuses them."""
    for site in f.calls_to(*BCE_FUNCTIONS):
        yield site.call
    for binding in f.bindings:
        if binding.qualname in BCE_MODULES:
            for node in f.references(binding.key):
                parent = f.parent(node)
                if isinstance(parent, cst.Call) and parent.func is node:
                    yield parent
