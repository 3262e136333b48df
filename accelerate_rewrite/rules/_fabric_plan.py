"""The Fabric plan's making (see rules/_fabric.py for what it decides): what is set up with
Fabric; where Fabric is created (and what can't be given one Fabric) is rules/_fabric_home.py,
which loaders rules/_fabric_loaders.py, where `fabric` is reached rules/_fabric_reach.py, what
becomes of the device rules/_fabric_devices.py."""

from __future__ import annotations

from dataclasses import replace
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.facts import (
    CLIP_NORM,
    CLIP_VALUE,
    Key,
    Optimizer,
    ScriptFacts,
)
from accelerate_rewrite.codemod.ddp import hand_ddp
from accelerate_rewrite.codemod.ddp_places import PLACE_CALLS, strict_env_read
from accelerate_rewrite.codemod.facts_kinds import custom_steps, hand_updated
from accelerate_rewrite.codemod.hints import model_hint
from accelerate_rewrite.codemod.libraries import PROCESS_GROUP_STARTERS
from accelerate_rewrite.codemod.returns import _returns
from accelerate_rewrite.rules._apex import apex_use
from accelerate_rewrite.options import FUNCTION_LAUNCH_STRATEGIES, Options
from accelerate_rewrite.rules._fabric import (
    NAME,
    FabricPlan,
    _innermost_scope,
    code,
    SetupGroup,
    common_after,
    short,
)
from accelerate_rewrite.rules._fabric_devices import Devices
from accelerate_rewrite.rules._fabric_home import Home, trains
from accelerate_rewrite.rules._fabric_loaders import Loaders
from accelerate_rewrite.rules._fabric_reach import Reach


def make_plan(facts: ScriptFacts, options: Options) -> FabricPlan:
    return _Planner(facts, options).run()


class _Planner(Home, Loaders, Reach, Devices):
    def __init__(self, facts: ScriptFacts, options: Options) -> None:
        self.f = facts
        self.o = options
        self.p = FabricPlan()

    def refuse(self, node: Optional[cst.CSTNode], why: str) -> FabricPlan:
        self.p.refusal = (node, why)
        return self.p

    def run(self) -> FabricPlan:
        f = self.f
        if f.frameworks:
            label, node = f.frameworks[0]
            return self.refuse(node, f"already uses {label}; left alone")
        if not f.backward_sites and not f.optimizers:
            return self.refuse(None, "no training found (no optimizer, no backward call); nothing to do")
        apex = apex_use(f)
        if apex.problem is not None:
            return self.refuse(apex.problem[0], f"NVIDIA apex.amp: {apex.problem[1]}")
        if apex.unknown_level is not None and self.o.precision is None:
            return self.refuse(apex.unknown_level, "apex's opt_level is not a literal O0-O3: give "
                                                   "--precision (O0 is 32-true, O1 and O2 "
                                                   "16-mixed, O3 16-true)")
        own = self._own_processes()
        if own is not None:
            return self.refuse(*own)
        starter = next((c for c in f.calls if c.qualname in PROCESS_GROUP_STARTERS), None)
        if starter is not None:
            return self.refuse(starter.call, f"`{short(starter.call)}` ({starter.qualname}) starts the process group "
                                             "itself, which Fabric starts: under Fabric's processes it would start "
                                             "it a second time, and fail; nothing was converted")
        ddp = hand_ddp(f)
        if ddp.found:
            if ddp.problem is not None:
                return self.refuse(ddp.problem[0], f"hand-made distributed training: {ddp.problem[1]}; "
                                                   "nothing was converted")
            if self.o.single_device and ddp.kept:
                return self.refuse(ddp.kept[0], f"hand-made distributed training: `{short(ddp.kept[0])}` "
                                                "needs the process group, which Fabric starts only with "
                                                "several devices (--devices 1 was given)")
        library = [s for s in f.backward_sites if s.library is not None]
        if library and (self.o.strategy or "").startswith(("fsdp", "deepspeed")):
            return self.refuse(library[0].call, f"`{short(library[0].call)}` ({library[0].library}) runs backward "
                                                f"itself, where --strategy {self.o.strategy} needs "
                                                "`fabric.backward(loss)`; nothing was converted (the default "
                                                "strategy, DDP, converts it)")
        if self.o.strategy in FUNCTION_LAUNCH_STRATEGIES:
            return self.refuse(
                None,
                f"--strategy {self.o.strategy} needs the training code in a function passed to "
                "fabric.launch(fn); this rewrite does not restructure scripts that way "
                "(use --strategy ddp)",
            )
        taken = [n for n in f.find(m.Name(NAME)) if f.key_of(n) is not None]
        if taken:
            return self.refuse(taken[0], f"the name `{NAME}` is already used in this script")
        if not f.optimizers and not hand_updated(f):
            if f.opaque_optimizers:
                stmt_, wrapper, inner = f.opaque_optimizers[0]
                return self.refuse(stmt_, f"`{short(inner)}` is wrapped in `{short(wrapper.func)}`, which the "
                                          "rewrite can't see into: the optimizer inside it is what Fabric must set "
                                          "up, and its steps go through the wrapper")
            return self.refuse(f.backward_sites[0].call, "no optimizer found to set up with Fabric (nor "
                                                         "parameters updated by hand)")
        if not f.backward_sites:
            hidden = self._hidden_training()
            where = (f": `{short(hidden)}` takes the optimizer into code this rewrite can't see"
                     if hidden is not None else "")
            return self.refuse(hidden if hidden is not None else f.optimizers[0].stmt,
                               f"no backward call found{where}; every backward must go through "
                               "Fabric, so nothing was converted")
        # Threading a device parameter into `fabric` is tried first; a function whose device
        # is also used in a way Fabric does not replace keeps it, and the plan is made again.
        self.excluded: set[int] = set()
        for _ in range(len(f.functions) + 1):
            self.p = FabricPlan()
            self._plan()
            if self.p.refusal is not None:
                return self.p
            stuck = self._stuck_threads()
            if not stuck:
                return self.p
            self.excluded |= stuck
        return self.refuse(None, "could not settle where `fabric` is passed")

    def _plan(self) -> None:
        p = self.p
        if not self._find_home():
            return
        if p.ddp is not None and self._options_unbound():
            return
        self._precision()
        self._refs()
        for site in self.f.backward_sites:
            if site.library is not None:
                continue  # the library's own backward: left as it is (fabric_backward.py)
            if p.ref_at(self.f, site.call) is None or not p.after_creation(self.f, site.call):
                func = self.f.function(site.call)
                where = f"in {func.name.value}()" if func is not None else "there"
                self.refuse(site.call, f"`{short(site.call)}` can't reach `fabric` {where} (no "
                                       "`device` parameter to turn into `fabric`, or one used in a "
                                       "way Fabric does not replace); every backward must go "
                                       "through Fabric, so nothing was converted")
                return
        if p.ddp is not None:
            for node, attr in p.ddp.reads:
                if p.ref_at(self.f, node) is None or not p.after_creation(self.f, node):
                    func = self.f.function(node)
                    if self.o.many_devices and func is not None and func is not p.home \
                            and self.f.qualname(node) in PLACE_CALLS:
                        continue  # ``dist.get_world_size()`` in a helper: it works, Fabric starts the group
                    if p.ddp.spawn is not None and func is not None and func is self.f.function(p.ddp.spawn.stmt) \
                            and self.f.qualname(node) not in PLACE_CALLS:
                        continue  # the launching process reads its launcher's environment, as before
                    if strict_env_read(self.f, node) and self._before_fabric(node):
                        continue  # ``int(os.environ["LOCAL_RANK"])`` before Fabric exists: right, or a KeyError
                    where = f"in {func.name.value}()" if func is not None else "there"
                    self.refuse(node, f"hand-made distributed training: `{short(node)}` {where} can't "
                                      f"become `fabric.{attr}`: `fabric` can't be reached there, or only "
                                      "later; nothing was converted")
                    return
        self._setups()
        if p.refusal:
            return
        self._loaders()
        if p.refusal:
            return
        self._devices()

    def _before_fabric(self, node: cst.CSTNode) -> bool:
        """``node`` is in a function that runs before Fabric exists (the program's top level
        calls it, directly or through others, before the statement that creates Fabric): what
        fails there fails at start-up."""
        f, p = self.f, self.p
        funcs = [a for a in f.ancestors(node) if isinstance(a, (cst.FunctionDef, cst.ClassDef))]
        if any(id(a) in p.blocked for a in funcs):
            return True
        if not funcs or p.anchor is None:
            return False
        home = [a for a in [p.home, *f.ancestors(p.home)] if isinstance(a, (cst.FunctionDef, cst.ClassDef))] \
            if isinstance(p.home, (cst.FunctionDef, cst.ClassDef)) else []
        created = self._top_lines(home[-1]) if home else [f.line(p.anchor)]
        reached = self._top_lines(funcs[-1])
        return bool(created and reached) and min(reached) < min(created)

    def _top_lines(self, func: cst.CSTNode, seen: frozenset = frozenset()) -> list[int]:
        """The lines of the program's top level that call ``func`` (a top-level function or
        class), directly or through other functions of the script."""
        f = self.f
        name = getattr(func, "name", None)
        fn = f.functions.get(name.value) if isinstance(name, cst.Name) else None
        if fn is None or fn.node is not func or id(func) in seen:
            return []
        lines: list[int] = []
        for call in fn.calls:
            outer = [a for a in f.ancestors(call) if isinstance(a, (cst.FunctionDef, cst.ClassDef))]
            lines += self._top_lines(outer[-1], seen | {id(func)}) if outer else [f.line(call)]
        return lines

    def _options_unbound(self) -> bool:
        """DistributedDataParallel's options read a name (``not args.no_ddp_bb``) that is not
        bound yet where Fabric is created, or is another there: refused, with the reason."""
        f, p = self.f, self.p
        at = (p.ddp.spawn.where or p.ddp.spawn.stmt) if p.ddp.spawn is not None else p.anchor  # (mp.spawn's)
        created = _innermost_scope(f, at) if at is not None else None
        for name in p.ddp.option_names:
            bound = f.assignments(name)
            key = f.key_of(name)
            ok = created is not None and key is not None and key[0] is created and all(
                isinstance(node, cst.Param) or f.line(node) < f.line(at) for node, _ in bound)
            if not ok:
                call = next(a for a in f.ancestors(name) if isinstance(a, cst.Call))
                self.refuse(call, f"hand-made distributed training: `DistributedDataParallel(...)` reads `{name.value}` "
                                  "in an option, which is not bound yet where Fabric is created; pass it to Fabric "
                                  "with `strategy=DDPStrategy(...)` by hand; nothing was converted")
                return True
        return False

    def _precision(self) -> None:
        f, p, o = self.f, self.p, self.o
        p.precision = o.precision or apex_use(f).precision
        if p.precision in (None, "32-true", "64-true"):
            return
        own = f.uses_autocast()
        if own:
            p.omit_precision = (
                own[0].call,
                f"precision {p.precision} not set on Fabric: the script runs its own "
                f"{own[0].qualname.rsplit('.', 1)[-1]}, and Fabric's on top would apply it twice; "
                "leave the script's mixed precision as it is, or remove it and rerun",
            )
            return
        library = [s for s in f.backward_sites if s.library is not None]
        if library:
            p.omit_precision = (
                library[0].call,
                f"precision {p.precision} not set on Fabric: `{short(library[0].call)}` ({library[0].library}) "
                "runs backward itself, where Fabric's precision would need `fabric.backward(loss)`; the "
                "script's own mixed precision (its flag for it) applies as before",
            )
            return
        lbfgs = [opt for opt in f.optimizers if opt.qualname.endswith("LBFGS")]
        if lbfgs:
            why = ("its GradScaler can't step an LBFGS closure" if p.precision == "16-mixed" else
                   "LBFGS's line search and curvature pairs go astray in low precision "
                   "(measured on fixtures/lbfgs with bf16-mixed: loss 98.9 instead of 18.7 at "
                   "step 13)")
            p.omit_precision = (lbfgs[0].stmt, f"precision {p.precision} not set: {why}; "
                                               "LBFGS stays at 32-true")
            return
        hand = hand_updated(f)
        if hand and p.precision == "16-mixed":
            p.omit_precision = (hand[0][1], f"precision 16-mixed not set: the parameters are updated by hand "
                                            f"(`for {code(hand[0][1].target)} in {short(hand[0][1].iter)}:`), "
                                            "where Fabric's GradScaler can't unscale the gradients; use bf16-mixed, "
                                            "which needs no scaler")
            return
        stepped = custom_steps(f)
        if stepped and p.precision == "16-mixed":
            opt, methods = stepped[0]
            p.omit_precision = (opt.stmt, f"precision 16-mixed not set: `{opt.path}` ({opt.qualname}) steps by "
                                          f"{' and '.join(f'`{n}`' for n in methods)}, which Fabric's "
                                          "GradScaler does not see (it would apply scaled gradients); use "
                                          "bf16-mixed, which needs no scaler")


    # -- fabric.setup(model, optimizer) --
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
        classes = [f.functions[b.call.func.value].node for b in f.bound_as(model_key, "module")
                   if b.call is not None
                   and isinstance(b.call.func, cst.Name) and b.call.func.value in f.functions]
        defined = {s.name.value for cls in classes if isinstance(cls, cst.ClassDef)
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


def plan(facts: ScriptFacts, options: Options) -> FabricPlan:
    """The plan for this file and these options: made by the first rule that asks."""
    return facts.memo(("fabric-plan", options), lambda: make_plan(facts, options))


def library_backward(site) -> str:
    """What is said of a library's loss scaler called with the loss (``BackwardSite.library``)."""
    return (f"`{short(site.call)}` ({site.library}) runs backward and the optimizer step itself, with the "
            "script's own GradScaler: left as it is (under DDP that is the backward Fabric would run)")
