"""What the Fabric plan sets up (part of the plan, rules/_fabric.py): each trained model with its
optimizers, in which group and where (after the last statement they need), the models set up
alone, the optimizers left out and why, and the methods of a model the script calls on the
set-up one. A mixin of the planner (rules/_fabric_plan.py), as rules/_fabric_home.py,
_fabric_loaders.py, _fabric_reach.py and _fabric_devices.py are."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import (
    CLIP_NORM,
    CLIP_VALUE,
    OPTIMIZER,
    Key,
    Optimizer,
    ScriptFacts,
    code,
)
from accelerate_rewrite.codemod.analysis.kinds import hand_updated
from accelerate_rewrite.codemod.analysis.hints import model_hint
from accelerate_rewrite.codemod.analysis.libraries import MODEL_READERS, WRAPPER_TAKERS
from accelerate_rewrite.codemod.analysis.loops import without_grad
from accelerate_rewrite.codemod.analysis.returns import _returns
from accelerate_rewrite.codemod.analysis.syntax import passed_at, positional_params
from accelerate_rewrite.rules._fabric import SetupGroup, common_after, short
from accelerate_rewrite.rules._fabric_home import trains


class Setups:
    """The planner's part that decides the set-ups (``self.f``: the facts, ``self.o``: the
    options, ``self.p``: the plan)."""

    def _setups(self) -> None:
        f, p = self.f, self.p
        by_model: dict[Key, list[Optimizer]] = {}
        for opt in map(self._received, f.optimizers):
            if not opt.models and _over_tensors(opt):
                # ``optim.LBFGS([input_img])`` (style transfer): no module to set up; Fabric still
                # takes the backward and the device, but can't apply a precision or a strategy
                if self.o.many_devices or p.precision not in (None, "32-true", "64-true"):
                    what = (f"devices={self.o.effective_devices}" if self.o.many_devices
                            else f"precision {p.precision}")
                    self.refuse(opt.stmt, f"`{opt.path}` optimizes tensors (`{short(opt.call.args[0].value)}`), "
                                          f"not a model's parameters: Fabric has no module to apply {what} to; "
                                          "at 32-true on one device it converts")
                    return
                p.tensor_optimizers.append(opt)
                continue
            if not opt.models:
                p.setup_skips.append((opt.stmt, f"optimizer `{opt.path}` not set up: could not tell which "
                                                f"model's parameters it takes ({model_hint(f.line(opt.stmt))})"))
                continue
            for key in opt.models:
                by_model.setdefault(key, []).append(opt)
        joint = self._joint(by_model)
        self._hand_updated(by_model)
        for model_key, opts in by_model.items():
            if model_key in joint:
                continue
            opts.sort(key=lambda o: f.line(o.stmt))
            # in a block that holds the model's binding too: an optimizer built under an ``if``
            # the model is not in is set up after that ``if`` (where the engine's flow check then
            # sees whether every path binds it), never inside it, where the model would stay
            # not set up on the other path
            built = [b.stmt for b in f.bound_as(model_key, "module")  # a model's bindings are models
                     if f.function(b.stmt) is f.function(opts[0].stmt)]
            after = common_after(f, [o.stmt for o in opts] + built)
            ref = p.ref_at(f, after) if after is not None else None
            if after is None or ref is None or not p.after_creation(f, after):
                p.setup_skips.append(
                    (opts[-1].stmt, f"`{opts[-1].path}` is built where `fabric` can't be reached")
                )
                continue
            unique: dict[str, Optimizer] = {}
            for o in opts:  # the same optimizer built in an if/else: one setup after both
                unique.setdefault(o.path, o)
            guard = self._only_under_if(opts, built)
            if guard is not None:
                after, ref = opts[-1].stmt, p.ref_at(f, guard)
            model_key = self._trained_name(model_key, after)
            p.setups.append(SetupGroup(model_key[1], list(unique.values()), ref, model_key, after,
                                       self._forward_methods(model_key, after), otherwise=guard))
        for group in p.setups:
            trained = self._trains_before_setup(group)
            if trained is not None:
                self.refuse(trained, f"`{short(trained)}` trains `{group.model}` before it could be set up (only "
                                     f"after line {f.line(group.after)}: its optimizers are built on both sides "
                                     "of the training, one is built again while it runs); nothing was converted")
                return
            if not self._read_after_setup(group):
                self.refuse(group.after, f"`{group.model}` would be set up after line {f.line(group.after)}, but "
                                         "nothing reads it afterwards, so no forward would run through Fabric "
                                         "(its precision and strategy would not apply); nothing was converted")
                return
        guarded = [g for g in p.setups if g.otherwise is not None]
        if guarded and p.precision == "16-mixed" and (f.calls_to(*CLIP_NORM, *CLIP_VALUE)):
            g = guarded[0]
            self.refuse(g.optimizers[0].stmt, f"`{g.optimizers[0].path}` is built only under "
                                              f"`if {short(g.otherwise.test)}:`, so the clipping stays "
                                              "torch's, which under 16-mixed would clip scaled gradients; "
                                              "nothing was converted (bf16-mixed or 32-true convert it)")
            return
        if p.setup_skips:
            node, why = p.setup_skips[0]
            self.refuse(node, f"{why}; without setting every trained model up, Fabric can't apply "
                              "its precision or strategy, so nothing was converted")
            return
        if self.o.accelerate:
            for call in f.method_calls(OPTIMIZER, "step"):
                if not isinstance(f.parent(call), cst.Expr):
                    # measured, accelerate 1.15: AcceleratedOptimizer.step(closure) returns nothing
                    self.refuse(call, f"`{short(call)}`'s result is read, and the step of an optimizer Accelerate "
                                      "prepares returns None (LBFGS's closure loss is lost); --backend fabric "
                                      "converts it")
                    return
        if self.o.accelerate and self.o.many_devices:
            for group in p.setups:
                self._wrapped_reads(group)
                if p.refusal is not None:
                    return

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

    def _model_classes(self, model_key: Key) -> list[cst.ClassDef]:
        """The script's classes the model is built from (``model = Net(...)``)."""
        f = self.f
        nodes = [f.functions[b.call.func.value].node for b in f.bound_as(model_key, "module")
                 if b.call is not None and isinstance(b.call.func, cst.Name) and b.call.func.value in f.functions]
        return [n for n in nodes if isinstance(n, cst.ClassDef)]

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
        keys = _keys_by_object(f).get(target) or [group.model_key]
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
                    if taker is not None and passed_at(call, taker[0].index, taker[0].keyword) is node:
                        continue  # ``nn.SyncBatchNorm.convert_sync_batchnorm(model)``: the wrapper is as good
                    if _instance_takes_harmlessly(f, call, node):
                        continue  # SAM's ``log(model, loss, ...)``: its class's method never reads it but as the module
                    if self._wrapped_in_original(node):
                        continue  # the original hands that code its DistributedDataParallel too (timm's ModelEma)
                    self.refuse(node, f"`{short(call)}` is given the set-up `{short(node)}`: under Accelerate's "
                                      "processes that is DistributedDataParallel, not the module, and the rewrite "
                                      "can't see what that code reads of it; --backend fabric converts it")
                    return

    def _received(self, opt: Optimizer) -> Optimizer:
        """An optimizer a helper builds and returns by name (``optimizer = None; if ...: optimizer =
        optim.SGD(...); ...; return optimizer``, Swin's ``build_optimizer(config, model)``), called
        once: set up where the script receives it (``optimizer = build_optimizer(config, model)``),
        leaving the helper (and its module) alone."""
        f = self.f
        func = f.function(opt.stmt)
        fn = f.functions.get(func.name.value) if func is not None else None
        if fn is None or fn.node is not func or len(fn.calls) != 1 or fn.other_uses:
            return opt
        returns = _returns(f, func)  # (grouped by function once: a scan of every return per optimizer is quadratic)
        assign = f.parent(fn.calls[0])
        if not returns or not all(m.matches(r.value, m.Name(opt.path)) for r in returns) \
                or not (isinstance(assign, cst.Assign) and len(assign.targets) == 1
                        and isinstance(assign.targets[0].target, cst.Name)):
            return opt
        key = f.key_of(assign.targets[0].target)
        return replace(opt, key=key, stmt=f.statement(assign)) if key is not None else opt

    def _hand_updated(self, by_model: dict[Key, list[Optimizer]]) -> None:
        """A model no optimizer trains, whose parameters the script updates by hand (``p.data.add_(
        p.grad, alpha=-lr)``): set up alone (``model = fabric.setup(model)``), right after it is built."""
        f, p = self.f, self.p
        for key, loop in hand_updated(f):
            if any(f.same_object(key, k) for k in by_model) or any(f.same_object(key, g.model_key) for g in p.setups):
                continue
            built = [b for b in f.bound_as(key, "module")]
            after = common_after(f, [b.stmt for b in built]) if built else None
            ref = p.ref_at(f, after) if after is not None else None
            if after is None or ref is None or not p.after_creation(f, after):
                p.setup_skips.append((loop, f"`{short(loop.iter.func.value)}`, whose parameters are updated by hand "
                                            "here, is built where `fabric` can't be reached"))
                continue
            name = built[0].path
            p.setups.append(SetupGroup(name, [], ref, built[0].key, after, self._forward_methods(built[0].key, after)))

    def _joint(self, by_model: dict[Key, list[Optimizer]]) -> set[Key]:
        """Models that an optimizer trains together with others (a CycleGAN's generators, a model
        and its criterion's own parameters), with every optimizer of any of them: each such set
        gets ``fabric.setup_module`` for its models and ``fabric.setup_optimizers`` for its
        optimizers, after the statement that builds the last of them. Their keys."""
        f, p = self.f, self.p
        # number -> (models, optimizers), in the order the sets were last grown; and the object
        # of each model -> the number of the set that holds it
        sets: dict[int, tuple[set[Key], dict[int, Optimizer]]] = {}
        holder: dict[Key, int] = {}
        for number, (model_key, opts) in enumerate(by_model.items()):
            models = {model_key} | {k for o in opts for k in o.models}
            roots = {f.object_of(k) for k in models}
            linked = sorted({holder[r] for r in roots if r in holder})
            optimizers = {id(o): o for o in opts}
            for other in linked:
                models |= sets[other][0]
                optimizers.update(sets.pop(other)[1])
            sets[number] = (models, optimizers)
            holder.update((f.object_of(k), number) for k in models)
        out: set[Key] = set()
        for models, optimizers in sets.values():
            if len({f.object_of(k) for k in models}) < 2:
                continue
            out |= models
            opts = sorted(optimizers.values(), key=lambda o: f.line(o.stmt))
            if (self.o.strategy or "").startswith("deepspeed"):
                p.setup_skips.append((opts[0].stmt, f"optimizer `{opts[0].path}` not set up: DeepSpeed sets a model "
                                                    "and its optimizer up together, and this one trains several "
                                                    "models"))
                continue
            built = [b.stmt for key in models for b in f.bound_as(key, "module")
                     if f.function(b.stmt) is f.function(opts[0].stmt)]
            after = common_after(f, [o.stmt for o in opts] + built)
            ref = p.ref_at(f, after) if after is not None else None
            if after is None or ref is None or not p.after_creation(f, after):
                p.setup_skips.append((opts[-1].stmt, f"`{opts[-1].path}` is built where `fabric` can't be reached"))
                continue
            firsts: dict[Key, Key] = {}  # one key of each model, as the optimizers name it
            # (the keys are a set, in an order of memory: ties go by name and owner)
            for key in sorted(models, key=lambda k: (min((f.line(b.stmt) for b in f.bound_as(k, "module")),
                                                         default=0), k[1], f.line(k[0]))):
                firsts.setdefault(f.object_of(key), key)
            for key in firsts.values():
                unique: dict[str, Optimizer] = {}  # the same optimizer built in an if/else: once
                for o in opts:
                    if any(f.same_object(key, k) for k in o.models):
                        unique.setdefault(o.path, o)
                p.setups.append(SetupGroup(key[1], list(unique.values()), ref, key, after,
                                           self._forward_methods(key, after), joint=True))
        return out

    def _read_after_setup(self, group: SetupGroup) -> bool:
        """Whether what the set-up binds is read once it has run: in another function (a
        ``train(model, ...)`` defined above, a method reading ``self.model``), later in the same
        one, or in a loop around the set-up. ``self`` never is: it would rebind a local name."""
        f = self.f
        if group.model == "self":
            return False
        func, end = f.function(group.after), f.end_line(group.after)
        loops = [a for a in f.ancestors(group.after) if isinstance(a, (cst.For, cst.While))]
        for key in f.memo("keys-by-object", lambda: _keys_by_object(f)).get(f.object_of(group.model_key), ()):
            for ref in f.references(key):
                if f.function(ref) is not func or f.line(ref) > end \
                        or any(loop in f.ancestors(ref) for loop in loops):
                    return True
        return False

    def _trained_name(self, model_key: Key, after: cst.BaseStatement) -> Key:
        """Which name the set-up rebinds, of those that hold the model where it goes
        (``model_without_ddp = model``, the optimizer over ``model_without_ddp.parameters()``):
        the one the script reads afterwards other than for an attribute (``model(x)``,
        ``train(model, ...)``), so the forward runs through Fabric; one read only for attributes
        (``model_without_ddp.state_dict()``) keeps the script's own module, as it did. When that
        is not one name, the optimizer's."""
        f = self.f
        func, end = f.function(after), f.end_line(after)
        used = []
        for key in f.memo("keys-by-object", lambda: _keys_by_object(f)).get(f.object_of(model_key), ()):
            if key[0] is not model_key[0] or key[1].startswith("self.") != model_key[1].startswith("self."):
                continue
            later = [ref for ref in f.references(key) if f.function(ref) is not func or f.line(ref) > end]
            if any(not (isinstance(f.parent(ref), cst.Attribute) and f.parent(ref).value is ref) for ref in later):
                used.append(key)
        return used[0] if len(used) == 1 else model_key

    def _trains_before_setup(self, group: SetupGroup) -> Optional[cst.CSTNode]:
        """A backward, or a call of a function of the script that runs one, inside the statement
        the set-up would follow: the training runs before the set-up (an optimizer built again
        in the training loop puts the set-up after the loop)."""
        f = self.f
        sites = f.backward_sites
        first = f.memo("backward-by-statement", lambda: {
            id(s.stmt): i for i, s in reversed(list(enumerate(sites)))}).get(id(group.after))
        inside = f.first_inside(sites, lambda s: s.call, group.after, "backward-sites")
        found = [i for i in (first, inside) if i is not None]
        if found:
            return sites[min(found)].call
        training = trains(f)
        calls = f.memo("training-calls", lambda: [call for fn in f.functions.values() if id(fn.node) in training
                                                  for call in fn.calls])
        at = f.first_inside(calls, lambda c: c, group.after, "training-calls")
        return calls[at] if at is not None else None

    def _only_under_if(self, opts: list[Optimizer], built: list[cst.BaseStatement]) -> Optional[cst.If]:
        """``if args.use_optimizer: optimizer = ...`` (and no optimizer in its ``else``), the model
        built before that ``if``: the ``if``, where the setup goes into both branches."""
        f = self.f
        guard = f.parent(f.block(opts[0].stmt))
        if not isinstance(guard, cst.If) or isinstance(f.parent(guard), cst.If) \
                or any(f.block(o.stmt) is not guard.body for o in opts) \
                or isinstance(guard.orelse, cst.If) or not built \
                or any(f.line(b) >= f.line(guard) or guard in f.ancestors(b) for b in built) \
                or (guard.orelse is not None and m.findall(guard.orelse, m.Name(opts[0].path.split(".")[0]))):
            return None
        if self.p.ref_at(f, guard) is None or not self.p.after_creation(f, guard):
            return None
        return guard

    def _forward_methods(self, model_key: Key, setup: cst.BaseStatement) -> list[str]:
        """``model.decode(z)``, ``model.sample(n)``: methods defined in the model's class in this
        file, other than ``forward``, called on the model once it is set up (not those called
        before, in the function that sets it up: ``model.configure_optimizers(...)``)."""
        f = self.f
        home, setup_line = f.function(setup), f.line(setup)
        defined = {s.name.value for cls in self._model_classes(model_key)
                   for s in cls.body.body if isinstance(s, cst.FunctionDef)}
        found: dict[str, int] = {}  # name -> the first call's place among the attribute calls
        for name in defined:
            if name == "forward" or name.startswith("__"):
                continue
            for i, call in f.attribute_calls_of(name):
                if f.function(call) is home and f.line(call) <= setup_line:
                    continue  # on the model as built, before the set-up
                if f.same_object(f.key_of(call.func.value), model_key):
                    found[name] = i
                    break
        return sorted(found, key=found.get)


#: calls that only look at an object (its printed form is the wrapper's, which is no matter)
_LOOKS_ONLY = frozenset({"builtins.isinstance", "builtins.print", "builtins.str", "builtins.repr", "builtins.type",
                         "builtins.id"})
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


def _keys_by_object(f: ScriptFacts) -> dict[Key, list[Key]]:
    """Every key the analysis knows, by the object it holds (``object_of``)."""
    out: dict[Key, list[Key]] = {}
    for key in f.kinds:
        out.setdefault(f.object_of(key), []).append(key)
    return out


def _over_tensors(opt: Optimizer) -> bool:
    """``LBFGS([input_img])``, ``Adam([z, w])``: a list of names or attributes, no ``parameters()``."""
    if opt.call is None or not opt.call.args or opt.call.args[0].keyword is not None:
        return False
    params = opt.call.args[0].value
    return isinstance(params, (cst.List, cst.Tuple)) and bool(params.elements) and all(
        isinstance(e, cst.Element) and isinstance(e.value, (cst.Name, cst.Attribute)) for e in params.elements)
