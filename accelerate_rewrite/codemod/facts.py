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

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterable, Iterator, Optional, Union

import libcst as cst
import libcst.matchers as m
from libcst.metadata import (
    GlobalScope,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    QualifiedNameProvider,
    ScopeProvider,
)

Owner = cst.CSTNode
Key = tuple[Owner, str]

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
LOADER = "loader"
DEVICE = "device"
MODULE = "module"  # any nn.Module that is not trained by an optimizer (a loss, a metric, ...)
SCALER = "scaler"  # a GradScaler
GRAD_SCALERS = (
    "torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.GradScaler",
    "torch.cuda.amp.grad_scaler.GradScaler", "torch.cpu.amp.GradScaler",
    "torch.cpu.amp.grad_scaler.GradScaler",
)

_NOT_MODULES = (
    "torch.nn.functional",
    "torch.nn.utils",
    "torch.nn.init",
    "torch.nn.Parameter",
    "torch.nn.parameter",
    "torch.nn.DataParallel",
    "torch.nn.parallel",
)
_FRAMEWORKS = {
    "lightning.fabric": "Lightning Fabric",
    "lightning_fabric": "Lightning Fabric",
    "lightning.Fabric": "Lightning Fabric",
    "lightning.pytorch": "the Lightning Trainer",
    "lightning.Trainer": "the Lightning Trainer",
    "lightning.LightningModule": "the Lightning Trainer",
    "lightning.LightningDataModule": "the Lightning Trainer",
    "pytorch_lightning": "the Lightning Trainer",
    "accelerate": "Hugging Face Accelerate",
}
_FRAMEWORK_HARMLESS = ("seed_everything",)
HAND_DDP = {
    "torch.distributed.init_process_group": "init_process_group",
    "torch.nn.parallel.DistributedDataParallel": "DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel": "DistributedDataParallel",
    "torch.utils.data.distributed.DistributedSampler": "DistributedSampler",
    "torch.utils.data.DistributedSampler": "DistributedSampler",
    "torch.multiprocessing.spawn": "torch.multiprocessing.spawn",
}
DATA_PARALLEL = ("torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                 "torch.nn.parallel.data_parallel.DataParallel")
DATALOADERS = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
CLIP_NORM = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_")
CLIP_VALUE = ("torch.nn.utils.clip_grad_value_", "torch.nn.utils.clip_grad.clip_grad_value_")
APEX_INITIALIZE = ("apex.amp.initialize", "apex.amp.frontend.initialize")
APEX_SCALE_LOSS = ("apex.amp.scale_loss", "apex.amp.handle.scale_loss")
APEX_MASTER_PARAMS = ("apex.amp.master_params",)
APEX_STATE_DICT = ("apex.amp.state_dict", "apex.amp.frontend.state_dict")
APEX_LOAD_STATE_DICT = ("apex.amp.load_state_dict", "apex.amp.frontend.load_state_dict")
BCE_MODULES = ("torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss")
BCE_FUNCTIONS = ("torch.nn.functional.binary_cross_entropy",)
AUTOCAST = (
    "torch.autocast",
    "torch.amp.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
    "torch.amp.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
)


@dataclass
class Binding:
    """An object built in the script: ``path = <value>`` in the statement ``stmt``."""

    key: Key
    kind: str
    stmt: cst.BaseStatement  # the statement in its block (a SimpleStatementLine or compound)
    value: cst.BaseExpression  # the whole assigned value, e.g. ``Net().to(device)``
    call: Optional[cst.Call]  # the constructor call inside it, e.g. ``Net()``
    qualname: str

    @property
    def owner(self) -> Owner:
        return self.key[0]

    @property
    def path(self) -> str:
        return self.key[1]


@dataclass
class Optimizer(Binding):
    models: list[Key] = field(default_factory=list)  # whose parameters it takes


@dataclass
class BackwardSite:
    call: cst.Call  # ``<loss>.backward(...)``
    loss: cst.BaseExpression
    stmt: cst.BaseStatement
    function: Optional[cst.FunctionDef]  # the function it is in, if any


@dataclass
class DeviceMove:
    """``x.to(<device>)``, ``x.cuda()``, ``x.to(0)``: moves ``receiver`` to a device."""

    call: cst.Call
    receiver: cst.BaseExpression
    device_arg: Optional[cst.Arg]  # None for .cuda()
    removable: bool  # no other argument than the device and non_blocking/copy


@dataclass
class CallSite:
    call: cst.Call
    qualname: str  # the first of ``names``
    names: frozenset[str] = frozenset()  # all of them: ``amp`` bound by an import and a fallback


@dataclass
class Function:
    node: Union[cst.FunctionDef, cst.ClassDef]
    name: str
    params: list[cst.Param]
    calls: list[cst.Call] = field(default_factory=list)
    other_uses: list[cst.Name] = field(default_factory=list)  # referenced but not called


class ScriptFacts:
    def __init__(self, module: cst.Module, folder: Optional[Path] = None) -> None:
        #: the script's folder, where its own modules are (codemod/siblings.py); None for a
        #: source with no file
        self.folder = folder
        self.wrapper = MetadataWrapper(module)
        self.module = self.wrapper.module
        self._meta = self.wrapper.resolve_many(
            [PositionProvider, ParentNodeProvider, ScopeProvider, QualifiedNameProvider]
        )
        self.bindings: list[Binding] = []
        self.backward_sites: list[BackwardSite] = []
        self.device_moves: list[DeviceMove] = []
        self.calls: list[CallSite] = []  # every call with a resolved qualified name
        self.prints: list[cst.Call] = []
        self.decorators: list[cst.Decorator] = []
        self.attribute_calls: list[cst.Call] = []  # ``x.method(...)``, in order
        #: every outermost Name / Attribute with a qualified name (``torch.cuda.amp.autocast``)
        self.qualified_refs: list[tuple[cst.CSTNode, str]] = []
        self.frameworks: list[tuple[str, cst.CSTNode]] = []
        self.functions: dict[str, Function] = {}  # module-level functions and classes by name
        self.module_classes: set[str] = set()  # classes in the file deriving from nn.Module
        self.kinds: dict[Key, set[str]] = {}
        self._aliases: list[tuple[Key, cst.BaseExpression]] = []
        self._memo: dict[object, object] = {}
        self._self_attrs: list[cst.Attribute] = []
        #: keys of loaders built in a helper that returns them (codemod/returns.py): they are
        #: set up where the helper's result is bound, which holds their own bindings
        self.returned_loaders: set[Key] = set()
        _Collector(self).collect()
        from accelerate_rewrite.codemod.returns import find_returned_loaders

        find_returned_loaders(self)
        self._flow()

    def memo(self, key: object, compute):
        """A conclusion drawn from these facts once and shared by several rules (e.g. the
        Fabric plan for one set of options)."""
        if key not in self._memo:
            self._memo[key] = compute()
        return self._memo[key]

    # ---- metadata accessors -------------------------------------------------------------
    def _get(self, provider, node, default=None):
        value = self._meta[provider].get(node, default)
        if callable(value) and not isinstance(value, cst.CSTNode):  # libcst's lazy values
            value = value()
        return value

    def line(self, node: Optional[cst.CSTNode]) -> int:
        if node is None:
            return 1
        pos = self._get(PositionProvider, node)
        return pos.start.line if pos is not None else 1

    def column(self, node: cst.CSTNode) -> int:
        """The 0-based column where ``node`` starts."""
        pos = self._get(PositionProvider, node)
        return pos.start.column if pos is not None else 0

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._get(ParentNodeProvider, node)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        node = self.parent(node)
        while node is not None:
            yield node
            node = self.parent(node)

    def qualnames(self, node: cst.CSTNode) -> set[str]:
        return {q.name for q in (self._get(QualifiedNameProvider, node) or ())}

    def qualname(self, node: cst.CSTNode) -> Optional[str]:
        names = self.qualnames(node)
        return min(names) if names else None

    def scope(self, node: cst.CSTNode):
        return self._get(ScopeProvider, node)

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement:
        """The statement that holds ``node`` and stands directly in a block."""
        current = node
        for parent in self.ancestors(node):
            if isinstance(parent, (cst.Module, cst.IndentedBlock)) and isinstance(
                current, cst.BaseStatement
            ):
                return current
            current = parent
        raise ValueError("node is not inside a statement")

    def block(self, stmt: cst.BaseStatement) -> Union[cst.Module, cst.IndentedBlock]:
        parent = self.parent(stmt)
        assert isinstance(parent, (cst.Module, cst.IndentedBlock))
        return parent

    def function(self, node: cst.CSTNode) -> Optional[cst.FunctionDef]:
        for parent in self.ancestors(node):
            if isinstance(parent, cst.FunctionDef):
                return parent
        return None

    def enclosing_class(self, func: cst.FunctionDef) -> Optional[cst.ClassDef]:
        parent = self.parent(func)
        if isinstance(parent, cst.IndentedBlock):
            grand = self.parent(parent)
            if isinstance(grand, cst.ClassDef):
                return grand
        return None

    # ---- keys and kinds ------------------------------------------------------------------
    def key_of(self, expr: cst.BaseExpression) -> Optional[Key]:
        """The key an expression names: a Name (resolved through scopes) or ``self.attr``."""
        if isinstance(expr, cst.Name):
            return self.key_for_name(expr, expr.value)
        if m.matches(expr, m.Attribute(value=m.Name("self"), attr=m.Name())):
            func = self.function(expr)
            cls = self.enclosing_class(func) if func is not None else None
            if cls is not None:
                return (cls, f"self.{expr.attr.value}")
        return None

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

    def assigned_value(self, name: cst.Name) -> Optional[cst.BaseExpression]:
        """The value of ``name = <value>`` when that is the name's one assignment in its scope."""
        scope = self.scope(name)
        assignments = list(scope[name.value]) if scope is not None else []
        if len(assignments) != 1:
            return None
        target = getattr(assignments[0], "node", None)
        parent = self.parent(target) if isinstance(target, cst.CSTNode) else None
        assign = self.parent(parent) if isinstance(parent, cst.AssignTarget) else None
        if isinstance(assign, cst.Assign) and len(assign.targets) == 1 and assign.targets[0].target is target:
            return assign.value
        return None

    def kinds_of(self, expr: cst.BaseExpression) -> set[str]:
        key = self.key_of(expr)
        return self.kinds.get(key, set()) if key else set()

    def is_kind(self, expr: cst.BaseExpression, kind: str) -> bool:
        return kind in self.kinds_of(expr)

    def undefined_names(self) -> dict[str, int]:
        """Names the script reads without defining them (star imports, globals(), typos)."""
        from accelerate_rewrite.codemod.checks import undefined_in

        return undefined_in(self._meta[ScopeProvider], self._meta[PositionProvider])

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
        return [b for b in self.bindings if isinstance(b, Optimizer)]

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
        return [
            call for call in self.attribute_calls
            if call.func.attr.value == method and kind in self.kinds_of(call.func.value)
        ]

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
        for assignment in scope.assignments[path]:
            for access in assignment.references:
                if access.node not in out:
                    out.append(access.node)
        return out

    def scope_of_owner(self, owner: Owner):
        if isinstance(owner, cst.Module):
            return self.scope(owner)
        if isinstance(owner, (cst.FunctionDef, cst.Lambda)):
            body = owner.body
            probe = body.body[0] if isinstance(body, cst.IndentedBlock) and body.body else body
            return self.scope(probe)
        return None

    # ---- flow ----------------------------------------------------------------------------
    def _flow(self) -> None:
        """Keys joined by a flow (an alias, an argument into a parameter, ``self.x = param``)
        hold the same object: they share one set of kinds."""
        parent: dict[Key, Key] = {}

        def find(k: Key) -> Key:
            while parent.get(k, k) != k:
                k = parent[k]
            return k

        seen: set[Key] = set()

        def union(a: Optional[Key], b: Optional[Key]) -> None:
            if a is not None and b is not None:
                seen.update((a, b))
                parent[find(a)] = find(b)

        for target, value in self._aliases:
            union(target, self.key_of(value))
        for fn in self.functions.values():
            owner = fn.node if isinstance(fn.node, cst.FunctionDef) else init_of(fn.node)
            if owner is None:
                continue
            for call in fn.calls:
                for index, arg in enumerate(call.args):
                    param = param_for(fn.params, fn.node, arg, index)
                    if param is not None:
                        union((owner, param.name.value), self.key_of(arg.value))

        by_root: dict[Key, set[str]] = {}
        for b in self.bindings:
            by_root.setdefault(find(b.key), set()).add(b.kind)
        for opt in self.optimizers:
            for key in opt.models:
                by_root.setdefault(find(key), set()).add(MODEL)
        keys = seen | {b.key for b in self.bindings}
        for opt in self.optimizers:
            keys.update(opt.models)
        for key in keys:
            self.kinds[key] = by_root.get(find(key), set())
        self._find = find

    def same_object(self, a: Optional[Key], b: Optional[Key]) -> bool:
        return a is not None and b is not None and self._find(a) == self._find(b)

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


def code(node: cst.CSTNode) -> str:
    """The source text of a node."""
    return cst.Module([]).code_for_node(node)


def short(node: cst.CSTNode, limit: int = 48) -> str:
    """One line of code for a message: whitespace folded, long code cut."""
    text = " ".join(code(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def root_of(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``model.fc.weight`` -> ``model``; ``self.model.fc`` -> ``self.model``."""
    while isinstance(expr, cst.Attribute):
        if m.matches(expr, m.Attribute(value=m.Name("self"))):
            return expr
        expr = expr.value
    while isinstance(expr, cst.Subscript):
        expr = root_of(expr.value)
    return expr


def unwrap_moves(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``Net().to(device).train()`` -> ``Net()``: strip method calls that return the object."""
    while m.matches(
        expr,
        m.Call(func=m.Attribute(attr=m.Name("to") | m.Name("cuda") | m.Name("cpu") | m.Name("train")
                                | m.Name("float") | m.Name("half") | m.Name("bfloat16") | m.Name("double"))),
    ):
        expr = expr.func.value  # type: ignore[union-attr]
    return expr


def positional_params(node: Union[cst.FunctionDef, cst.ClassDef]) -> list[cst.Param]:
    if isinstance(node, cst.ClassDef):
        init = init_of(node)
        if init is None:
            return []
        return list(init.params.posonly_params) + list(init.params.params)[1:]
    params = list(node.params.posonly_params) + list(node.params.params)
    return params


def param_for(params: list[cst.Param], node, arg: cst.Arg, index: int) -> Optional[cst.Param]:
    if arg.star:
        return None
    if arg.keyword is not None:
        func = node if isinstance(node, cst.FunctionDef) else init_of(node)
        if func is None:
            return None
        for p in [*func.params.params, *func.params.kwonly_params, *func.params.posonly_params]:
            if p.name.value == arg.keyword.value:
                return p
        return None
    return params[index] if index < len(params) else None


def init_of(cls: cst.ClassDef) -> Optional[cst.FunctionDef]:
    if isinstance(cls.body, cst.IndentedBlock):
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                return stmt
    return None


def is_device_expr(facts: ScriptFacts, expr: cst.BaseExpression) -> bool:
    """``torch.device(...)``, ``"cuda"``, ``"cuda" if torch.cuda.is_available() else "cpu"``,
    ``torch.accelerator.current_accelerator()``, and conditionals of those."""
    if isinstance(expr, cst.IfExp):
        return is_device_expr(facts, expr.body) and is_device_expr(facts, expr.orelse)
    if isinstance(expr, cst.SimpleString):
        text = expr.evaluated_value
        return isinstance(text, str) and (
            text in ("cpu", "cuda", "mps", "xpu") or text.startswith("cuda:")
        )
    if isinstance(expr, cst.Call):
        return facts.qualname(expr) in (
            "torch.device",
            "torch.accelerator.current_accelerator",
        )
    if isinstance(expr, cst.Attribute) and expr.attr.value == "device":
        return False
    return False


def is_literal_device(facts: ScriptFacts, expr: cst.BaseExpression) -> bool:
    """A device spelled out in a ``.to(...)``: ``"cuda"``, ``0``, ``torch.device("cuda")``."""
    if isinstance(expr, cst.Integer):
        return True
    return is_device_expr(facts, expr)


class _Collector(cst.CSTVisitor):
    def __init__(self, facts: ScriptFacts) -> None:
        super().__init__()
        self.f = facts
        self._pending: list[tuple[cst.CSTNode, cst.BaseExpression, cst.BaseExpression]] = []

    def collect(self) -> None:
        f = self.f
        for stmt in f.module.body:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                params = positional_params(stmt)
                f.functions[stmt.name.value] = Function(stmt, stmt.name.value, params)
        self._find_module_classes()
        f.module.visit(self)
        for target, value, node in self._pending:
            self._assignment(target, value, node)

    def _find_module_classes(self) -> None:
        f = self.f
        changed = True
        while changed:
            changed = False
            for stmt in f.module.body:
                if isinstance(stmt, cst.ClassDef) and stmt.name.value not in f.module_classes:
                    for base in stmt.bases:
                        names = f.qualnames(base.value)
                        text = code(base.value)
                        if (
                            any(n in ("torch.nn.Module", "torch.nn.modules.module.Module") for n in names)
                            or text in f.module_classes
                        ):
                            f.module_classes.add(stmt.name.value)
                            changed = True

    # -- frameworks that already accelerate the script --
    # ``import lightning as L`` or ``import pytorch_lightning as pl`` alone says nothing (it may
    # be there for ``seed_everything``): what the script uses from them decides.
    def visit_ImportFrom(self, node: cst.ImportFrom) -> None:
        if node.module is None or node.relative:
            return
        module = code(node.module)
        if isinstance(node.names, cst.ImportStar):
            self._framework(module, node)
            return
        for alias in node.names:
            if isinstance(alias.name, cst.Name):
                self._framework(f"{module}.{alias.name.value}", node)

    def _framework(self, name: str, node: cst.CSTNode) -> None:
        if name.rsplit(".", 1)[-1] in _FRAMEWORK_HARMLESS:
            return
        for prefix, label in _FRAMEWORKS.items():
            if name == prefix or name.startswith(prefix + "."):
                self.f.frameworks.append((label, node))
                return

    def visit_Attribute(self, node: cst.Attribute) -> None:
        if m.matches(node, m.Attribute(value=m.Name("self"), attr=m.Name())):
            self.f._self_attrs.append(node)
        parent = self.f.parent(node)
        if isinstance(parent, cst.Attribute) and parent.value is node:
            return  # only the whole of ``L.fabric.Fabric`` counts, not ``L.fabric``
        for q in self.f.qualnames(node):
            self._framework(q, node)
            self.f.qualified_refs.append((node, q))

    # -- functions referenced other than by a call --
    def visit_Name(self, node: cst.Name) -> None:
        parent = self.f.parent(node)
        if not (isinstance(parent, cst.Attribute) and parent.value is node):
            for q in self.f.qualnames(node):
                if "." in q:  # an imported name, e.g. ``autocast`` from torch.cuda.amp
                    self.f.qualified_refs.append((node, q))
        fn = self.f.functions.get(node.value)
        if fn is None or fn.node.name is node:
            return
        parent = self.f.parent(node)
        if isinstance(parent, cst.Call) and parent.func is node:
            if self.f.key_of(node) == (self.f.module, node.value):
                fn.calls.append(parent)
            return
        if isinstance(parent, (cst.Attribute,)) and parent.attr is node:
            return
        if isinstance(parent, (cst.Arg,)) and parent.keyword is node:
            return
        if self.f.key_of(node) == (self.f.module, node.value):
            fn.other_uses.append(node)

    # -- assignments --
    def visit_Assign(self, node: cst.Assign) -> None:
        if len(node.targets) == 1:
            self._pending.append((node.targets[0].target, node.value, node))

    def visit_AnnAssign(self, node: cst.AnnAssign) -> None:
        if node.value is not None:
            self._pending.append((node.target, node.value, node))

    def _assignment(self, target: cst.BaseExpression, value: cst.BaseExpression, node) -> None:
        f = self.f
        if not isinstance(target, (cst.Name, cst.Attribute)):
            return
        key = f.key_of(target)
        if key is None:
            return
        core = unwrap_moves(value)
        if isinstance(core, cst.Name) or m.matches(core, m.Attribute(value=m.Name("self"))):
            f._aliases.append((key, core))
            return
        stmt = f.statement(node)
        if is_device_expr(f, value):
            call = value if isinstance(value, cst.Call) else None
            f.bindings.append(Binding(key, DEVICE, stmt, value, call, "device"))
            return
        if not isinstance(core, cst.Call):
            return
        qual = f.qualname(core) or ""
        if qual == "torch.optim.swa_utils.AveragedModel":
            f.bindings.append(Binding(key, MODULE, stmt, value, core, qual))
        elif qual.startswith("torch.optim.lr_scheduler.") or qual == "torch.optim.swa_utils.SWALR":
            f.bindings.append(Binding(key, SCHEDULER, stmt, value, core, qual))
        elif qual.startswith("torch.optim.") and not qual.startswith("torch.optim.swa_utils.") \
                and qual.rsplit(".", 1)[-1][:1].isupper():
            models = self._param_models(core)
            f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, qual, models=models))
        elif qual in GRAD_SCALERS:
            f.bindings.append(Binding(key, SCALER, stmt, value, core, qual))
        elif qual in DATALOADERS:
            f.bindings.append(Binding(key, LOADER, stmt, value, core, qual))
        elif self._is_module_ctor(core, qual):
            f.bindings.append(Binding(key, MODULE, stmt, value, core, qual or _callee_text(core)))

    def _is_module_ctor(self, call: cst.Call, qual: str) -> bool:
        if qual.startswith("torch.nn.") and not qual.startswith(_NOT_MODULES):
            return True
        if qual.startswith("torchvision.models.") or qual.startswith("timm."):
            return True
        if qual.startswith("transformers.") and qual.endswith(".from_pretrained"):
            return "Tokenizer" not in qual and "Config" not in qual and "Processor" not in qual
        return isinstance(call.func, cst.Name) and call.func.value in self.f.module_classes

    def _param_models(self, call: cst.Call) -> list[Key]:
        keys: list[Key] = []
        params = call.args[0].value if call.args else None
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "params":
                params = arg.value
        if isinstance(params, cst.Name):  # groups = [{"params": ...}, ...]; Adam(groups)
            params = self.f.assigned_value(params) or params
        if params is None:
            return keys
        for found in m.findall(
            params, m.Call(func=m.Attribute(attr=m.Name("parameters") | m.Name("named_parameters")))
        ):
            key = self.f.key_of(root_of(found.func.value))  # type: ignore[union-attr]
            if key is not None and key not in keys:
                keys.append(key)
        return keys

    def visit_Decorator(self, node: cst.Decorator) -> None:
        self.f.decorators.append(node)

    # -- calls --
    def visit_Call(self, node: cst.Call) -> None:
        f = self.f
        names = f.qualnames(node)
        qual = min(names) if names else None
        if qual:
            f.calls.append(CallSite(node, qual, frozenset(names)))
        if qual == "builtins.print":
            f.prints.append(node)
        func = node.func
        if not isinstance(func, cst.Attribute):
            return
        f.attribute_calls.append(node)
        attr = func.attr.value
        if attr == "backward" and qual not in ("torch.autograd.backward",):
            f.backward_sites.append(
                BackwardSite(node, func.value, f.statement(node), f.function(node))
            )
        elif attr == "cuda":
            f.device_moves.append(DeviceMove(node, func.value, None, _only_sync_args(node.args)))
        elif attr == "to" and node.args:
            first = node.args[0]
            device_arg = None
            if first.keyword is None and not first.star:
                device_arg = first
            for arg in node.args:
                if arg.keyword is not None and arg.keyword.value == "device":
                    device_arg = arg
            if device_arg is not None:
                rest = [a for a in node.args if a is not device_arg]
                f.device_moves.append(DeviceMove(node, func.value, device_arg, _only_sync_args(rest)))


def _only_sync_args(args: Iterable[cst.Arg]) -> bool:
    return all(a.keyword is not None and a.keyword.value in ("non_blocking", "copy") for a in args)


def _callee_text(call: cst.Call) -> str:
    return code(call.func)
