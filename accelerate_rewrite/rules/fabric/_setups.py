"""What the Fabric plan sets up (part of the plan, rules/base/plan.py): each trained model with its
optimizers, in which group and where (after the last statement they need), the models set up
alone, the optimizers left out and why, and the methods of a model the script calls on the
set-up one (their reads under Accelerate: rules/fabric/_wrapped.py). A mixin of the planner (rules/fabric/_plan.py), as rules/fabric/_home.py,
_loaders.py, _reach.py and _devices.py are."""

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
)
from accelerate_rewrite.codemod.analysis.kinds import hand_updated
from accelerate_rewrite.codemod.analysis.hints import hinted_model, model_hint
from accelerate_rewrite.codemod.analysis.returns import _returns
from accelerate_rewrite.codemod.analysis.syntax import passed_at, positional_params
from accelerate_rewrite.rules.base.plan import SetupGroup, common_after, short
from accelerate_rewrite.rules.fabric._home import trains


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
        if self.o.accelerate:
            for group in p.setups:
                self._optimizer_reads(group)
        if self.o.accelerate and self.o.many_devices:
            for group in p.setups:
                self._wrapped_reads(group)
                if p.refusal is not None:
                    return

    def _model_classes(self, model_key: Key) -> list[cst.ClassDef]:
        """The script's classes the model is built from (``model = Net(...)``)."""
        f = self.f
        nodes = [f.functions[b.call.func.value].node for b in f.bound_as(model_key, "module")
                 if b.call is not None and isinstance(b.call.func, cst.Name) and b.call.func.value in f.functions]
        return [n for n in nodes if isinstance(n, cst.ClassDef)]

    def _received(self, opt: Optimizer) -> Optimizer:
        """An optimizer a helper builds and returns by name (``optimizer = None; if ...: optimizer =
        optim.SGD(...); ...; return optimizer``, Swin's ``build_optimizer(config, model)``), called
        once: set up where the script receives it (``optimizer = build_optimizer(config, model)``),
        leaving the helper (and its module) alone. Through helpers that return what another
        returns (SimMIM's ``build_optimizer``: ``if is_pretrain: return
        build_pretrain_optimizer(config, model, logger)``, every return a call), each called once;
        its models as the receiver names them."""
        f = self.f
        func, models = f.function(opt.stmt), opt.models
        returns = _returns(f, func) if func is not None else []  # (grouped by function once)
        if not returns or not all(m.matches(r.value, m.Name(opt.path)) for r in returns):
            return opt
        for _ in range(4):
            fn = f.functions.get(func.name.value) if func is not None else None
            if fn is None or fn.node is not func or len(fn.calls) != 1 or fn.other_uses:
                return opt
            call = fn.calls[0]
            models = self._models_passed(models, func, call)
            parent = f.parent(call)
            if models is None:
                return opt
            if isinstance(parent, cst.Return):  # ``return build_pretrain_optimizer(...)``
                func = f.function(parent)
                if func is None or not all(isinstance(r.value, cst.Call) for r in _returns(f, func)):
                    return opt
                continue
            if not (isinstance(parent, cst.Assign) and len(parent.targets) == 1
                    and isinstance(parent.targets[0].target, cst.Name)):
                return opt
            key = f.key_of(parent.targets[0].target)
            stmt = f.statement(parent)
            if not models:  # ``# accelerate-rewrite: model=NAME`` where the script receives it, as the refusal says
                hinted = hinted_model(f, stmt)
                models = [hinted] if hinted is not None else models
            return replace(opt, key=key, stmt=stmt, models=models) if key is not None else opt
        return opt

    def _models_passed(self, models: list[Key], func: cst.FunctionDef, call: cst.Call) -> Optional[list[Key]]:
        """The models of an optimizer a helper builds over its parameters (``def
        set_optimizer(model): ...``), as the caller names them (``set_optimizer(net)``: ``net``);
        None where a parameter's argument is not a name the analysis knows."""
        f = self.f
        params = positional_params(func)
        out = []
        for key in models:
            param = next((p for p in params if key[0] is func and p.name.value == key[1]), None)
            if param is None:
                out.append(key)
                continue
            value = passed_at(call, params.index(param), param.name.value)
            given = f.key_of(value) if isinstance(value, (cst.Name, cst.Attribute)) else None
            if given is None:
                return None
            out.append(given)
        return out

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
        (``model_without_ddp.state_dict()``, ``model_without_ddp[0].state_dict()``) keeps the script's own module, as it did. When that
        is not one name, the optimizer's."""
        f = self.f
        func, end = f.function(after), f.end_line(after)
        used = []
        for key in f.memo("keys-by-object", lambda: _keys_by_object(f)).get(f.object_of(model_key), ()):
            if key[0] is not model_key[0] or key[1].startswith("self.") != model_key[1].startswith("self."):
                continue
            later = [ref for ref in f.references(key) if f.function(ref) is not func or f.line(ref) > end]
            if any(not _for_an_attribute(f, ref) for ref in later):
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


def _for_an_attribute(f: ScriptFacts, ref: cst.CSTNode) -> bool:
    """Whether a read of a model is for an attribute (``m.state_dict()``), of the model or of one
    of its items (``m[0].state_dict()``: a Sequential's first module)."""
    parent = f.parent(ref)
    if isinstance(parent, cst.Subscript) and parent.value is ref:
        ref, parent = parent, f.parent(parent)
    return isinstance(parent, cst.Attribute) and parent.value is ref


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
