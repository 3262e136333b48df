"""The one walk over the tree that finds what ScriptFacts holds (``_Collector``); which objects
are optimizers, and over which models, is codemod/analysis/optimizers.py (a mixin of it); what a
method or helper builds and returns, where an assignment takes its result, is
codemod/analysis/built.py (a collaborator: ``Built``); the
syntax helpers it and the rules share are codemod/analysis/syntax.py (codemod/analysis/facts.py re-exports them)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Iterable, Optional

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ParentNodeProvider

from accelerate_rewrite.codemod.edits.imports import binds
from accelerate_rewrite.codemod.analysis.kinds import (
    DATALOADERS,
    DEVICE,
    GRAD_SCALERS,
    LOADER,
    LOSS_SCALER,
    MODULE,
    OPTIMIZER,
    SCALER,
    SCHEDULER,
    _FRAMEWORK_HARMLESS,
    _FRAMEWORKS,
    _NOT_MODULES,
    BackwardSite,
    Binding,
    CallSite,
    DeviceMove,
    Function,
    Key,
    Optimizer,
)

from accelerate_rewrite.codemod.analysis.built import Built
from accelerate_rewrite.codemod.analysis.optimizers import OptimizerSearch
from accelerate_rewrite.codemod.analysis.libraries import LOSS_SCALERS, OPTIMIZER_FACTORIES, SCHEDULER_FACTORIES
from accelerate_rewrite.codemod.analysis.hints import hinted_model
from accelerate_rewrite.codemod.tree.walk import LeanVisitor
from accelerate_rewrite.codemod.analysis.syntax import (
    ITER_WRAPPERS,
    callee_text,
    code,
    is_device_expr,
    passed_at,
    positional_params,
    unwrap_iter,
    unwrap_moves,
)

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts


class _Collector(OptimizerSearch, LeanVisitor):
    def __init__(self, facts: Facts) -> None:
        super().__init__()
        self.f = facts
        self._pending: list[tuple[cst.CSTNode, cst.BaseExpression, cst.BaseExpression]] = []
        self._name_calls: list[cst.Call] = []
        self._built = Built(facts)  # what a method or helper builds (codemod/analysis/built.py)

    def collect(self) -> None:
        f = self.f
        for stmt in f.module.body:
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
                params = positional_params(stmt)
                f.functions[stmt.name.value] = Function(stmt, stmt.name.value, params)
        self._find_module_classes()
        #: the names an import binds somewhere in the script: only they may name an imported
        #: thing (``visit_Name`` asks the others' qualified names for nothing)
        self._imported = self._imported_names()
        self._walk()
        self._lifted: set[int] = set()
        self._unknown: list[tuple[Key, cst.BaseStatement, cst.BaseExpression, cst.Call]] = []
        for target, value, node in self._pending:
            self._assignment(target, value, node)
        self._stepped_unknowns()
        self._library_steps()
        self._hinted_models()
        if self._lifted:  # what a method builds and returns is bound where its result is
            f.bindings = [b for b in f.bindings if not (isinstance(b.stmt, cst.SimpleStatementLine)
                                                       and any(id(s) in self._lifted for s in b.stmt.body))]

    def _hinted_models(self) -> None:
        """``# accelerate-rewrite: model=NAME`` on an optimizer's line (codemod/analysis/hints.py): the
        model it trains, where the analysis could not tell; on the line of an object the script
        steps whose class it can't see, that object is an optimizer over it."""
        f = self.f
        bound = {b.key for b in f.bindings if isinstance(b, Optimizer)}
        for i, b in enumerate(f.bindings):
            if isinstance(b, Optimizer) and not b.models:
                key = self._hinted_model(b.stmt)
                if key is not None:
                    f.bindings[i] = replace(b, models=[key])
                    f.hinted.add(b.key)
        for key, stmt, value, core in self._unknown:
            model = self._hinted_model(stmt) if key not in bound else None
            if model is not None:
                f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, callee_text(core), models=[model],
                                            custom=True))
                f.hinted.add(key)

    def _hinted_model(self, stmt: cst.BaseStatement) -> Optional[Key]:
        return hinted_model(self.f, stmt)

    def _library_steps(self) -> None:
        """``loss_scaler(loss, optimizer, ...)`` where ``loss_scaler`` holds an object of a
        library's loss-scaler class (timm's NativeScaler), here or passed in: a backward site
        that is the library's (``BackwardSite.library``)."""
        f = self.f
        scalers = [b for b in f.bindings if b.kind == LOSS_SCALER]
        if not scalers:
            return
        find, *_ = f._joined()
        roots = {find(b.key): b.qualname for b in scalers}
        for call in self._name_calls:
            key = f.key_of(call.func)
            qual = roots.get(find(key)) if key is not None else None
            if qual is None:
                continue
            loss = passed_at(call, LOSS_SCALERS[qual].loss.index, LOSS_SCALERS[qual].loss.keyword)
            if loss is not None:
                f.backward_sites.append(BackwardSite(call, loss, f.statement(call), f.function(call), library=qual))
        f.backward_sites.sort(key=lambda s: f.line(s.call))

    def _walk(self) -> None:
        """This visitor's ``visit_<Node>`` methods called on every node in the order of LibCST's
        walk: over the parents' walk's nodes, which come in that order (codemod/tree/metadata.py),
        where there is one; the visitor has no ``leave_`` methods and goes into every node."""
        f = self.f
        if getattr(f._meta, "spans", None) is None:  # the wrapper's parents: LibCST's walk
            f.module.visit(self)
            return
        handlers: dict[type, object] = {}
        for node in f._meta[ParentNodeProvider]:  # every node but the module (no visit_Module here)
            kind = type(node)
            handler = handlers.get(kind, handlers)
            if handler is handlers:
                handler = handlers[kind] = getattr(self, f"visit_{kind.__name__}", None)
            if handler is not None:
                handler(node)

    def _imported_names(self) -> set[str]:
        """The names the script's imports bind, anywhere in it."""
        return {binds(alias, isinstance(node, cst.ImportFrom)) for node in self.f.find(m.Import() | m.ImportFrom())
                if not isinstance(node.names, cst.ImportStar) for alias in node.names}

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
        if isinstance(node.value, cst.Name) and node.value.value == "self":  # ``self.<name>``
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
        if node.value in self._imported and not (isinstance(parent, cst.Attribute) and parent.value is node):
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
        built = self._built.by_method(core, node)
        over: Optional[list[cst.Name]] = None
        if built is not None:  # ``self.model = self._build_model()``: what the method returns
            value, inner, over = built
            core = unwrap_moves(value)
            if inner is not None:
                self._lifted.add(id(inner))  # bound here, not in the method
        if m.matches(core, m.Call(func=ITER_WRAPPERS)) and isinstance(unwrap_iter(core), cst.Name):
            core = unwrap_iter(core)  # ``epoch_iterator = tqdm(train_dataloader)``: its batches are the loader's
        if isinstance(core, cst.Name) or m.matches(core, m.Attribute(value=m.Name("self"))):
            f._aliases.append((key, core))
            return
        stmt = f.statement(node)
        inner = _loader_dict(f, core)
        if inner is not None:  # ``{x: DataLoader(...) for x in ['train', 'val']}``
            f.bindings.append(Binding(key, LOADER, stmt, value, inner, f.qualname(inner) or ""))
            f.loader_dicts.add(key)
            return
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
            if over is not None:  # a model's own method builds it, or a helper over its arguments
                keys = [f.key_of(name) for name in over]
                models = [k for k in keys if k is not None] if None not in keys else []
            f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, qual, models=models))
        elif self._is_optimizer_class(core):
            f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, callee_text(core),
                                        models=self._param_models(core), custom=True))
        elif qual in GRAD_SCALERS:
            f.bindings.append(Binding(key, SCALER, stmt, value, core, qual))
        elif qual in OPTIMIZER_FACTORIES:  # ``create_optimizer_v2(model, ...)`` (codemod/analysis/libraries.py)
            given = passed_at(core, OPTIMIZER_FACTORIES[qual].model.index, OPTIMIZER_FACTORIES[qual].model.keyword)
            models = self._param_models(core) if given is None or not isinstance(given, (cst.Name, cst.Attribute)) \
                else [k for k in [f.key_of(given)] if k is not None]
            if given is not None and not models:
                models = self._param_models(cst.Call(func=core.func, args=[cst.Arg(given)]))
            f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, qual, models=models))
        elif qual in LOSS_SCALERS:
            f.bindings.append(Binding(key, LOSS_SCALER, stmt, value, core, qual))
        elif qual in SCHEDULER_FACTORIES:
            f.bindings.append(Binding(key, SCHEDULER, stmt, value, core, qual))
        elif qual in DATALOADERS:
            f.bindings.append(Binding(key, LOADER, stmt, value, core, qual))
        elif self._is_module_ctor(core, qual):
            f.bindings.append(Binding(key, MODULE, stmt, value, core, qual or callee_text(core)))
        else:  # an optimizer of a class the analysis can't see, if the script steps it (below)
            self._unknown.append((key, stmt, value, core))

    def _is_module_ctor(self, call: cst.Call, qual: str) -> bool:
        if qual.startswith("torch.nn.") and not qual.startswith(_NOT_MODULES):
            return True
        if qual.startswith("torchvision.models.") or (qual.startswith("timm.") and not qual.startswith(
                ("timm.optim", "timm.scheduler", "timm.data", "timm.loss", "timm.utils"))):
            return True
        if qual.startswith("transformers.") and qual.endswith(".from_pretrained"):
            return "Tokenizer" not in qual and "Config" not in qual and "Processor" not in qual
        return isinstance(call.func, cst.Name) and call.func.value in self.f.module_classes

    def visit_Decorator(self, node: cst.Decorator) -> None:
        self.f.decorators.append(node)

    def visit_Return(self, node: cst.Return) -> None:
        self.f.returns.append(node)

    # -- calls --
    def visit_Call(self, node: cst.Call) -> None:
        f = self.f
        names = f.qualname_set(node)
        qual = min(names) if names else None
        if qual:
            f.calls.append(CallSite(node, qual, names))
        if qual == "builtins.print":
            f.prints.append(node)
        func = node.func
        if not isinstance(func, cst.Attribute):
            if isinstance(func, cst.Name):
                self._name_calls.append(node)  # ``loss_scaler(loss, optimizer)``: _library_steps
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
            if device_arg is not None and not self._to_host(node, device_arg):
                rest = [a for a in node.args if a is not device_arg]
                f.device_moves.append(DeviceMove(node, func.value, device_arg, _only_sync_args(rest)))

    def _to_host(self, call: cst.Call, device_arg: cst.Arg) -> bool:
        """``t.to("cpu")`` read at once as host data (``.numpy()``, ``.tolist()``, ``.item()``):
        a copy back to the host, wherever the script trains, not a move to its device."""
        if code(device_arg.value).replace(" ", "") not in (
                '"cpu"', "'cpu'", 'torch.device("cpu")', "torch.device('cpu')"):
            return False
        parent = self.f.parent(call)
        return isinstance(parent, cst.Attribute) and parent.attr.value in ("numpy", "tolist", "item")



def _only_sync_args(args: Iterable[cst.Arg]) -> bool:
    return all(a.keyword is not None and a.keyword.value in ("non_blocking", "copy") for a in args)


def _loader_dict(f, value: cst.BaseExpression) -> Optional[cst.Call]:
    """The DataLoader call of ``{x: DataLoader(...) for x in ...}``, or of ``{"train":
    DataLoader(...), "val": DataLoader(...)}`` (the first), each value a DataLoader built there."""
    if isinstance(value, cst.DictComp):
        values = [value.value]
    elif isinstance(value, cst.Dict) and value.elements:
        values = [e.value if isinstance(e, cst.DictElement) else None for e in value.elements]
    else:
        return None
    if not all(isinstance(v, cst.Call) and f.qualname(v) in DATALOADERS for v in values):
        return None
    return values[0]
