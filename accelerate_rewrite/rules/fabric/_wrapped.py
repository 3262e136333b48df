"""The set-up model's reads under ``--backend accelerate`` on several processes, and the set-up
optimizer's own attributes under it on any number (a mixin of the
planner, rules/fabric/_plan.py, beside rules/fabric/_setups.py): Accelerate's ``prepare``
returns the model wrapped in DistributedDataParallel, whose ``state_dict()`` keys, named
parameters and attributes are not the module's (Fabric's wrapper keeps them). Each place the
set-up model goes is judged by what the original handed over there: the module (read through
``accelerator.unwrap_model(model)``, ``p.unwraps``) or the wrapper; what can't be judged is
refused."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import Key, ScriptFacts, code
from accelerate_rewrite.codemod.analysis.libraries import (
    ACCELERATED_OPTIMIZER,
    METHOD_TAKERS,
    MODEL_READERS,
    WRAPPER_TAKERS,
)
from accelerate_rewrite.codemod.analysis.loops import without_grad
from accelerate_rewrite.codemod.analysis.syntax import passed_at, positional_params
from accelerate_rewrite.rules.base.plan import SetupGroup, short
from accelerate_rewrite.rules.fabric._setups import _keys_by_object


class WrappedReads:
    """The planner's part that judges the reads of a model Accelerate wraps (``self.f``: the
    facts, ``self.p``: the plan, ``self.refuse``; ``self._model_classes`` is rules/fabric/_setups.py's)."""

    def _only_before(self, func, home, setup_line: int, seen: frozenset = frozenset()) -> bool:
        """``func`` (a helper: Swin's ``build_optimizer(config, model)``, and the
        ``set_weight_decay(model, ...)`` it calls) is called only in the set-up's function before
        the set-up, directly or through such helpers: it reads the model as built."""
        f = self.f
        fn = f.functions.get(func.name.value) if isinstance(func, cst.FunctionDef) and func is not home else None
        if fn is None or fn.node is not func or not fn.calls or fn.other_uses or id(func) in seen:
            return False
        return all(f.function(c) is home and f.line(c) <= setup_line
                   or self._only_before(f.function(c), home, setup_line, seen | {id(func)}) for c in fn.calls)

    def _unwrapped_where_passed(self, node: cst.CSTNode, home, setup_line: int) -> bool:
        """``load_checkpoint(config, model_without_ddp, ...)`` (Swin's utils.py), a helper of the
        project that reads the model's ``load_state_dict`` where `accelerator` can't be reached:
        where the helper never runs the model (no forward inside), each call passes
        ``accelerator.unwrap_model(model)``, and the helper gets the module itself; through
        helpers that pass it on, the outermost call that reaches `accelerator` (YOLO's
        ``compute_loss(outputs, targets, model)``, whose ``build_targets`` reads
        ``model.yolo_layers``)."""
        passed = self._passed(node, home, setup_line)
        if passed is None:
            return False
        for value in passed:
            if value not in self.p.unwraps:
                self.p.unwraps.append(value)
        return True

    def _passed(self, node: cst.CSTNode, home, setup_line: int, depth: int = 0) -> Optional[list]:
        """Where ``node`` (a helper's parameter) is passed from a place that reaches `accelerator`,
        or None."""
        f, p = self.f, self.p
        helper = self._parameter_of(node) if depth <= 4 else None
        if helper is None:
            return None
        index, fn = helper
        key = f.key_of(node)
        if any(isinstance(f.parent(r), cst.Call) and f.parent(r).func is r for r in f.references(key)):
            return None  # it runs the model: unwrapped, its forward would leave DDP's
        passed = []
        for call in fn.calls:
            value = passed_at(call, index, node.value)
            if value is None or (f.function(call) is home and f.line(call) <= setup_line):
                return None
            if p.ref_at(f, call) is None:
                further = self._passed(value, home, setup_line, depth + 1)
                if further is None:
                    return None
                passed.extend(further)
                continue
            passed.append(value)
        return passed

    def _parameter_of(self, node: cst.CSTNode):
        """(its position, the function's record) where ``node`` names a positional parameter of a
        function of the script called only by name (``fn.calls``, no other use), else None."""
        f = self.f
        func = f.function(node)
        key = f.key_of(node) if isinstance(node, cst.Name) else None
        if func is None or key is None or key[0] is not func:
            return None
        index = next((i for i, prm in enumerate(positional_params(func)) if prm.name.value == node.value), None)
        fn = f.functions.get(func.name.value)
        if index is None or fn is None or fn.node is not func or not fn.calls or fn.other_uses:
            return None
        return index, fn

    def _as_built(self, node: cst.CSTNode, home, name: str) -> bool:
        """``node`` is a name of another function than the set-up's (or of the module) that
        only ever holds the model as built (UNet's ``model = UNet(...)`` in the main block, read
        as ``model.n_channels``, while ``train_model(model, ...)`` sets up its own ``model``):
        not a parameter, every binding a construction, and the set-up's function declares no
        ``global`` of it."""
        f = self.f
        if not isinstance(node, cst.Name) or home is None:
            return False
        func = f.function(node)
        if func is home or func is not None and any(
                prm.name.value == node.value for prm in (*func.params.posonly_params, *func.params.params,
                                                         *func.params.kwonly_params)):
            return False
        if any(node.value in [n.name.value for n in g.names] or name in [n.name.value for n in g.names]
               for g in f.find_in(home, m.Global() | m.Nonlocal())):
            return False

        def built(value: Optional[cst.BaseExpression]) -> bool:
            # made by a class or a library (``UNet(...)``, ``model.to(memory_format=...)``); the
            # project's own functions might hand the set-up one back
            if not isinstance(value, cst.Call):
                return False
            callee = f.functions.get(value.func.value) if isinstance(value.func, cst.Name) else None
            return callee is None or isinstance(callee.node, cst.ClassDef)

        bindings = f.assignments(node)
        return bool(bindings) and all(built(value) for _, value in bindings)

    def _runs_apart(self, call: cst.Call, name: str, home, setup_line: int, model_key: Key) -> bool:
        """``model.NAME(...)`` may run on the module itself (``accelerator.unwrap_model(model)``,
        outside DistributedDataParallel): on the model as built (in the set-up's function before
        it, or in a helper called only there: YOLO's ``load_darknet_weights``), where no gradient
        is recorded (``with torch.no_grad():``: VAE's ``model.decode(sample)``), or a method that
        only probes its parameters (word_lm's ``init_hidden``: ``next(self.parameters())
        .new_zeros(...)``)."""
        f = self.f
        func = f.function(call)
        if func is home and f.line(call) <= setup_line or self._only_before(func, home, setup_line):
            return True
        return without_grad(f, call) or _probes_only(f, name, self._model_classes(model_key))

    def _wrapped_in_original(self, node: cst.CSTNode, depth: int = 0) -> bool:
        """``node`` is, in the original on several processes, the script's own
        DistributedDataParallel: read after ``model = DDP(model, ...)`` in that function, or a
        parameter every call passes such a model (DeiT's ``train_one_epoch(model, ...)``, whose
        ``model_ema.update(model)`` got the wrapper before). Code the rewrite can't see that takes
        it there takes Accelerate's DistributedDataParallel the same."""
        f, p = self.f, self.p
        key = f.key_of(node) if isinstance(node, cst.Name) else None
        if key is None or p.ddp is None or depth > 4:
            return False
        for wrap in p.ddp.wraps:
            targets = wrap.stmt.body[0].targets if isinstance(wrap.stmt, cst.SimpleStatementLine) and isinstance(
                wrap.stmt.body[0], cst.Assign) else ()
            if any(isinstance(t.target, cst.Name) and f.key_of(t.target) == key for t in targets) \
                    and f.function(wrap.stmt) is f.function(node) and f.line(wrap.stmt) < f.line(node):
                return True
        helper = self._parameter_of(node)
        if helper is None:
            return False
        index, fn = helper
        passed = [passed_at(call, index, node.value) for call in fn.calls]
        return all(value is not None and self._wrapped_in_original(value, depth + 1) for value in passed)

    def _wrapped_later_in_original(self, node: cst.CSTNode) -> bool:
        """``node`` is, in the original, the module that the script's own DistributedDataParallel
        wraps only later in the same function (FixMatch's ``ema_model = ModelEMA(args, model,
        decay)``, then ``model = DDP(model, ...)``): code that takes it there took the module,
        and gets it again (``accelerator.unwrap_model(model)``); what it keeps of it is the
        module, as before."""
        f, p = self.f, self.p
        key = f.key_of(node) if isinstance(node, cst.Name) else None
        if key is None or p.ddp is None:
            return False
        lines = []
        for wrap in p.ddp.wraps:
            targets = wrap.stmt.body[0].targets if isinstance(wrap.stmt, cst.SimpleStatementLine) and isinstance(
                wrap.stmt.body[0], cst.Assign) else ()
            if any(isinstance(t.target, cst.Name) and f.key_of(t.target) == key for t in targets) \
                    and f.function(wrap.stmt) is f.function(node):
                lines.append(f.line(wrap.stmt))
        return bool(lines) and min(lines) > f.line(node)

    def _optimizer_reads(self, group: SetupGroup) -> None:
        """``--backend accelerate``: ``prepare`` returns each optimizer wrapped in an
        AcceleratedOptimizer, which answers an optimizer's own methods only
        (codemod/analysis/libraries.py, ``ACCELERATED_OPTIMIZER``); Fabric's wrapper keeps the
        class's. A read of anything else on the set-up optimizer (SAM's ``first_step`` and
        ``second_step``, its ``base_optimizer``) is made on ``optimizer.optimizer``, the optimizer
        itself (``p.inner_reads``; "'AcceleratedOptimizer' object has no attribute 'first_step'"
        otherwise). Its step is then the class's own, which no GradScaler sees: 16-mixed is not
        set for such an optimizer (rules/fabric/_plan.py)."""
        f, p = self.f, self.p
        home, setup_line = f.function(group.after), f.end_line(group.after)
        by_object = f.memo("keys-by-object", lambda: _keys_by_object(f))
        for opt in group.optimizers:
            if opt.inner is not None:
                continue  # a wrapper of the script's own holds it: its attributes are the wrapper's
            for key in by_object.get(f.object_of(opt.key)) or [opt.key]:
                for node in f.references(key):
                    if f.function(node) is home and f.line(node) <= setup_line:
                        continue  # the optimizer as built, before the set-up
                    parent = f.parent(node)
                    if isinstance(parent, cst.Attribute) and parent.value is node \
                            and parent.attr.value not in ACCELERATED_OPTIMIZER and node not in p.inner_reads:
                        p.inner_reads.append(node)

    def _wrapped_reads(self, group: SetupGroup) -> None:
        """``--backend accelerate`` on several processes: Accelerate's ``prepare`` returns the model
        wrapped in DistributedDataParallel, whose ``state_dict()`` keys, named parameters and
        attributes are not the module's (Fabric's wrapper keeps them). Every read of the set-up
        model other than a call, ``train()``, ``eval()``, ``parameters()`` or ``zero_grad()``
        goes through ``accelerator.unwrap_model(model)`` (``p.unwraps``); a method of its own
        that runs the model (``model.decode(z)``) would run outside DDP's forward, and passing it
        to code the analysis can't see could hand that code the wrapper: both are refused."""
        f, p = self.f, self.p
        home, setup_line = f.function(group.after), f.end_line(group.after)  # what it builds is read as built
        for name in group.forward_methods:
            where = next((call for _, call in f.attribute_calls_of(name)
                          if f.same_object(f.key_of(call.func.value), group.model_key)
                          and not self._runs_apart(call, name, home, setup_line, group.model_key)), None)
            if where is not None:
                self.refuse(where, f"`{group.model}.{name}(...)` runs the model outside DistributedDataParallel's "
                                   "forward, which Accelerate's prepared model has no way to mark (Fabric's "
                                   "mark_forward_method); --backend fabric converts it")
                return
        gone = {id(s) for s in (p.ddp.removed if p.ddp is not None else ())} | {
            id(w.stmt) for w in (p.ddp.wraps if p.ddp is not None else ())} | {
            id(f.statement(site.call)) for site in f.data_parallel()} | {  # wraps the conversion removes
            id(f.statement(site.call)) for site in f.calls if site.qualname == "apex.amp.initialize"}  # migrated
        target = f.object_of(group.model_key)
        keys = f.memo("keys-by-object", lambda: _keys_by_object(f)).get(target) or [group.model_key]
        for key in keys:
            for node in f.references(key):
                if f.function(node) is home and f.line(node) <= setup_line or id(f.statement(node)) in gone \
                        or self._only_before(f.function(node), home, setup_line):
                    continue  # the model as built, before the set-up; the script's own DDP wrap, which goes
                parent = f.parent(node)
                if isinstance(parent, cst.Call) and parent.func is node:
                    continue  # the forward
                if isinstance(parent, cst.Attribute) and parent.value is node:
                    if parent.attr.value in _WRAPPER_SAFE:
                        continue
                    if parent.attr.value == "module":  # the script's own unwrap (``ddp_model.module``)
                        if _guarded(f, parent):
                            continue  # ``model.module if hasattr(model, "module") else model``: either way
                        node = parent
                    if self._as_built(node, home, group.model):
                        continue  # a caller's own name: the set-up rebinds the one of its function only
                    if p.ref_at(f, node) is None:
                        if self._unwrapped_where_passed(node, home, setup_line):
                            continue  # the helper receives the module itself
                        self.refuse(node, f"`{short(parent)}` reads the set-up model where `accelerator` can't be "
                                          "reached, to unwrap it from Accelerate's DistributedDataParallel")
                        return
                    if node not in p.unwraps:
                        p.unwraps.append(node)
                    continue
                if isinstance(parent, cst.Arg):
                    call = f.parent(parent)
                    if isinstance(call, cst.Call) and isinstance(call.func, cst.Name) and call.func.value in f.functions:
                        continue  # the project's own code: its reads are the model's keys too
                    reader = MODEL_READERS.get(f.qualname(call) or _starred(f, call, MODEL_READERS)) \
                        if isinstance(call, cst.Call) else None
                    if reader is not None and passed_at(call, reader[0].index, reader[0].keyword) is node \
                            and p.ref_at(f, node) is not None:
                        if node not in p.unwraps:  # ``torch.save(model, f)``: the module, as the original saved
                            p.unwraps.append(node)
                        continue
                    if isinstance(call, cst.Call) and (
                            f.qualname(call) in _LOOKS_ONLY or _logged(call)
                            or f.qualname(call) == "builtins.hasattr" and len(call.args) == 2
                            and m.matches(call.args[1].value, m.SimpleString('"module"') | m.SimpleString("'module'"))):
                        continue  # ``model.module if hasattr(model, "module") else model``: the module either way
                    taker = WRAPPER_TAKERS.get(f.qualname(call)) if isinstance(call, cst.Call) else None
                    taker = taker or (_method_taker(f, call) if isinstance(call, cst.Call) else None)
                    if taker is not None and passed_at(call, taker[0].index, taker[0].keyword) is node:
                        continue  # ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``, ``swa_model.update_parameters(model)``
                    if _instance_takes_harmlessly(f, call, node):
                        continue  # SAM's ``log(model, loss, ...)``: its class's method never reads it but as the module
                    if self._wrapped_in_original(node):
                        continue  # the original hands that code its DistributedDataParallel too (timm's ModelEma)
                    if self._wrapped_later_in_original(node) and p.ref_at(f, node) is not None:
                        if node not in p.unwraps:  # FixMatch's ``ModelEMA(args, model, decay)``, before its DDP wrap
                            p.unwraps.append(node)
                        continue
                    self.refuse(node, f"`{short(call)}` is given the set-up `{short(node)}`: under Accelerate's "
                                      "processes that is DistributedDataParallel, not the module, and the rewrite "
                                      "can't see what that code reads of it; --backend fabric converts it")
                    return


#: calls that only look at an object (its printed form is the wrapper's, which is no matter)
_LOOKS_ONLY = frozenset({"builtins.isinstance", "builtins.print", "builtins.str", "builtins.repr", "builtins.type",
                         "builtins.id"})
def _method_taker(f: ScriptFacts, call: cst.Call):
    """``swa_model.update_parameters(model)`` with ``swa_model = swa_utils.AveragedModel(...)``:
    the entry of METHOD_TAKERS for the method of the library's object, or None."""
    if not isinstance(call.func, cst.Attribute):
        return None
    key = f.key_of(call.func.value)
    built = {b.qualname for b in f.bindings if key is not None and b.key == key}
    methods = next((METHOD_TAKERS[q] for q in built if q in METHOD_TAKERS), {})
    return methods.get(call.func.attr.value)


def _starred(f: ScriptFacts, call: cst.CSTNode, table: dict) -> Optional[str]:
    """``ModelEmaV2(model)`` after ``from timm.utils import *`` (poolformer): the one name of
    ``table`` that a library's star import could have bound, where the program binds no such
    name itself."""
    if not (isinstance(call, cst.Call) and isinstance(call.func, cst.Name)) or f.assignments(call.func):
        return None
    stars = [code(i.module) for i in f.find(m.ImportFrom(names=m.ImportStar())) if i.module is not None]
    found = [f"{module}.{call.func.value}" for module in stars if f"{module}.{call.func.value}" in table]
    return found[0] if len(found) == 1 else None


def _instance_takes_harmlessly(f: ScriptFacts, call: cst.Call, node: cst.CSTNode) -> bool:
    """``log(model, ...)`` or ``log.step(model, ...)``, with ``log = Log(...)`` an instance of a
    class of the project: the method (``__call__``, ``step``) reads the model it receives only
    as DistributedDataParallel reads as the module (``model.training``), or hands it to another
    method of its class that does, or not at all (SAM's ``Log.__call__``)."""
    func = call.func
    holder, method = (func, "__call__") if isinstance(func, cst.Name) else (
        (func.value, func.attr.value) if isinstance(func, cst.Attribute) and isinstance(func.value, cst.Name)
        else (None, None))
    if holder is None:
        return False
    values = [v for _, v in f.assignments(holder)]
    made = {v.func.value for v in values if isinstance(v, cst.Call) and isinstance(v.func, cst.Name)}
    if len(values) != 1 or len(made) != 1:
        return False
    cls = f.functions.get(next(iter(made)))
    if cls is None or not isinstance(cls.node, cst.ClassDef):
        return False
    index = next((i for i, a in enumerate(call.args) if a.value is node and a.keyword is None), None)
    return index is not None and _harmless(f, cls.node, method, index + 1, 0)


def _harmless(f: ScriptFacts, cls: cst.ClassDef, method: str, index: int, depth: int) -> bool:
    """The parameter at ``index`` (``self`` at 0) of ``cls.method`` is read only as
    ``_WRAPPER_SAFE`` allows, or handed to another method of the class that reads it so."""
    defs = [s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == method]
    if len(defs) != 1 or depth > 4:
        return False
    params = [*defs[0].params.posonly_params, *defs[0].params.params]
    if index >= len(params):
        return False
    name = params[index].name.value
    for ref in m.findall(defs[0].body, m.Name(name)):
        parent = f.parent(ref)
        if isinstance(parent, cst.Attribute) and parent.value is ref and parent.attr.value in _WRAPPER_SAFE:
            continue
        if isinstance(parent, cst.Arg) and parent.keyword is None:
            inner = f.parent(parent)
            if isinstance(inner, cst.Call) and m.matches(inner.func, m.Attribute(value=m.Name("self"))) \
                    and _harmless(f, cls, inner.func.attr.value,
                                  [a.value for a in inner.args].index(ref) + 1, depth + 1):
                continue
        return False
    return True


def _guarded(f: ScriptFacts, read: cst.Attribute) -> bool:
    """``model.module if hasattr(model, "module") else model``: the module, wrapped or not."""
    choice = f.parent(read)
    return isinstance(choice, cst.IfExp) and choice.body is read and m.matches(choice.test, m.Call(
        func=m.Name("hasattr"), args=[m.Arg(m.Name(read.value.value) if isinstance(read.value, cst.Name)
                                            else m.DoNotCare()), m.Arg(m.SimpleString())])) \
        and choice.test.args[1].value.evaluated_value == "module" and isinstance(read.value, cst.Name)


def _logged(call: cst.Call) -> bool:
    """``logger.info(model)``, ``logging.info(model)``: the model's printed form, logged."""
    func = call.func
    return isinstance(func, cst.Attribute) and func.attr.value in (
        "info", "debug", "warning", "warn", "error", "critical", "log") and "log" in code(func.value).lower()


#: what a script may read of a model wrapped in DistributedDataParallel as of the module itself
_WRAPPER_SAFE = frozenset({"train", "eval", "parameters", "zero_grad", "training", "requires_grad_", "to",
                           "cuda", "cpu"})


#: calls a method may make and still only probe the model (its device, its dtype): a tensor
#: made like a parameter records no gradient
_PROBES = frozenset({"next", "parameters", "new_zeros", "new_ones", "new_empty", "new_full", "zeros", "ones",
                     "empty", "size", "to", "range", "len", "int", "float", "tuple", "list"})


def _probes_only(f: ScriptFacts, name: str, classes: list[cst.ClassDef]) -> bool:
    """Every method ``name`` of the model's classes (of the project's, where the model's is not
    known) records no gradient: it makes only calls of ``_PROBES``, or runs under
    ``torch.no_grad()`` (ViT's ``load_from(weights)``: ``with torch.no_grad():
    self.head.weight.copy_(...)``, and the blocks' own ``load_from`` it calls there)."""
    methods = [s for cls in (classes or f.find(m.ClassDef())) for s in cls.body.body
               if isinstance(s, cst.FunctionDef) and s.name.value == name]

    def quiet(method: cst.FunctionDef) -> bool:
        return all((call.func.value if isinstance(call.func, cst.Name) else call.func.attr.value
                    if isinstance(call.func, cst.Attribute) else "") in _PROBES or without_grad(f, call)
                   for call in f.find_in(method.body, m.Call()))

    return bool(methods) and all(quiet(method) for method in methods)
