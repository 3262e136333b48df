"""The Fabric plan's making (see rules/_fabric.py for what it decides): where Fabric is
created, what is set up with it, and which loaders; where `fabric` is reached is
rules/_fabric_reach.py, what becomes of the device is rules/_fabric_devices.py."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.facts import (
    CLIP_NORM,
    CLIP_VALUE,
    Binding,
    Key,
    Optimizer,
    ScriptFacts,
    init_of,
    positional_params,
)
from accelerate_rewrite.codemod.ddp import HandDDP, hand_ddp
from accelerate_rewrite.codemod.facts_kinds import custom_steps
from accelerate_rewrite.codemod.loops import (
    EVAL, TRAIN, eval_sums, evaluations_of_training_loader, loader_role, training_sums, unwrap_iter,
)
from accelerate_rewrite.rules._apex import apex_use
from accelerate_rewrite.options import FUNCTION_LAUNCH_STRATEGIES, Options
from accelerate_rewrite.rules._fabric import (
    NAME,
    FabricPlan,
    LoaderGroup,
    Scope,
    SetupGroup,
    _innermost_scope,
    common_after,
    first_in_common_block,
    short,
)
from accelerate_rewrite.rules._fabric_devices import Devices
from accelerate_rewrite.rules._fabric_reach import Reach


def make_plan(facts: ScriptFacts, options: Options) -> FabricPlan:
    return _Planner(facts, options).run()


class _Planner(Reach, Devices):
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
        ddp = hand_ddp(f)
        if ddp.found:
            if ddp.problem is not None:
                return self.refuse(ddp.problem[0], f"hand-made distributed training: {ddp.problem[1]}; "
                                                   "nothing was converted")
            if self.o.single_device and ddp.kept:
                return self.refuse(ddp.kept[0], f"hand-made distributed training: `{short(ddp.kept[0])}` "
                                                "needs the process group, which Fabric starts only with "
                                                "several devices (--devices 1 was given)")
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
        if not f.optimizers:
            return self.refuse(f.backward_sites[0].call, "no optimizer found to set up with Fabric")
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

    def _own_processes(self) -> Optional[tuple[cst.CSTNode, str]]:
        """Training in processes the script starts itself, not as DDP (Hogwild:
        ``model.share_memory()``, ``mp.Process(target=train, args=(rank, args, model, ...))``):
        Fabric created in the function each of them runs would launch processes of its own from
        every one, and wrap the shared model in DDP. (node, why), or None."""
        f = self.f
        for _, call in f.attribute_calls_of("share_memory"):
            return call, (f"`{short(call)}` shares the model between processes the script starts itself "
                          "(Hogwild); Fabric's processes don't share a model, they each hold a copy and "
                          "average the gradients; nothing was converted")
        training = {id(s.function) for s in f.backward_sites if s.function is not None}
        training |= {id(f.function(o.stmt)) for o in f.optimizers if f.function(o.stmt) is not None}
        handed = [(call, next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "target"),
                              None)) for call in f.calls_named(*PROCESS_STARTERS)]
        handed += [(call, call.args[0].value) for method in _POOL_METHODS for _, call in f.attribute_calls_of(method)
                   if call.args and call.args[0].keyword is None]
        for call, target in handed:
            fn = f.functions.get(target.value) if isinstance(target, cst.Name) else None
            if fn is not None and isinstance(fn.node, cst.FunctionDef) and training & _reached_from(f, fn.node):
                return call, (f"`{short(call)}` runs `{target.value}`, which trains, in processes the script "
                              "starts itself (not DDP): each would create a Fabric of its own and launch "
                              "processes from there; nothing was converted")
        return None

    def _hidden_training(self) -> Optional[cst.Call]:
        """A call that passes an optimizer to a function the script does not define (one of a
        module that is not followed, ``engine.train_one_epoch(model, optimizer, ...)``), not
        torch's: where its backward and steps must be."""
        f = self.f
        for opt in f.optimizers:
            for ref in f.references(opt.key):
                arg = f.parent(ref)
                call = f.parent(arg) if isinstance(arg, cst.Arg) and arg.value is ref else None
                if not isinstance(call, cst.Call):
                    continue
                if isinstance(call.func, cst.Name) and call.func.value in f.functions:
                    continue
                if any(q.split(".")[0] == "torch" for q in f.qualnames(call.func)):
                    continue
                return call
        return None

    def _plan(self) -> None:
        p = self.p
        if not self._find_home():
            return
        self._precision()
        self._refs()
        for site in self.f.backward_sites:
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
                    where = f"in {func.name.value}()" if func is not None else "there"
                    self.refuse(node, f"hand-made distributed training: `{short(node)}` {where} can't "
                                      f"become `fabric.{attr}`: `fabric` can't be reached there, or only "
                                      "later; nothing was converted")
                    return
        self._setups()
        if p.refusal:
            return
        self._loaders()
        self._devices()


    # -- where Fabric is created --
    def _find_home(self) -> bool:
        f, p = self.f, self.p
        ddp = hand_ddp(f)
        if ddp.found:
            p.ddp = ddp
        if ddp.found and ddp.spawn is not None:
            return self._spawned_home(ddp)
        if self._trains_itself():
            return False
        trained = {f.object_of(key) for opt in f.optimizers for key in opt.models}
        builds = [b for b in f.bindings if f.object_of(b.key) in trained]
        first = min(builds or f.optimizers, key=lambda b: f.line(b.stmt))
        home = _innermost_scope(f, first.stmt)
        extra: list[cst.BaseStatement] = []
        # a factory (``def build(device): ...; return model, optimizer``): Fabric belongs
        # where it is called
        while isinstance(home, cst.FunctionDef) and self._is_factory(home):
            call = f.functions[home.name.value].calls[0]
            extra.append(f.statement(call))
            home = _innermost_scope(f, call)
        cls = f.enclosing_class(home) if isinstance(home, cst.FunctionDef) else None
        made = f.functions.get(cls.name.value) if cls is not None else None
        if cls is not None and home is init_of(cls) and made is not None and made.node is cls \
                and len(made.calls) == 1 and not made.other_uses and not f.repeats(made.calls[0]):
            # ``class Trainer: def __init__(self, cfg): self.model = Net() ...``, made once:
            # Fabric is created where the object is made, and passed in (_new_params)
            extra.append(f.statement(made.calls[0]))
            home = _innermost_scope(f, made.calls[0])
            cls = None
        if cls is not None:
            what = "the optimizer" if isinstance(first, Optimizer) else "the model"
            where = f"{cls.name.value}.{home.name.value}"
            if home is init_of(cls) and made is not None and made.node is cls and made.calls:
                how = ("more than once" if len(made.calls) > 1 else "in a loop" if f.repeats(made.calls[0])
                       else "and also used as a value")
                self.refuse(first.stmt, f"{what} is built in {where}, and `{cls.name.value}(...)` is made {how} "
                                        f"(line {f.line(made.calls[0])}): Fabric is created once, so it can't "
                                        "be created where each object is made; create it before and pass it in "
                                        "by hand")
                return False
            self.refuse(
                first.stmt,
                f"{what} is built inside a class ({where}), not in its __init__ or in an object made once; "
                "create Fabric where that object is made and pass it in",
            )
            return False
        if isinstance(home, cst.Lambda):
            self.refuse(first.stmt, "the model is built in a lambda")
            return False
        p.home = home
        interesting = [b.stmt for b in f.bindings if _innermost_scope(f, b.stmt) is home]
        interesting += [f.statement(d.call) for d in f.device_moves
                        if _innermost_scope(f, d.call) is home]
        interesting += extra
        if p.ddp is not None:  # Fabric starts the processes where the script started them
            interesting += self._ddp_statements(home)
        p.anchor = first_in_common_block(f, interesting)
        if p.anchor is None:
            self.refuse(first.stmt, "could not find one place before the model, optimizer and "
                                    "loaders are built to create Fabric")
            return False
        if p.ddp is None:
            p.anchor = self._before_prints(p.anchor)
        return True

    def _before_prints(self, anchor: cst.BaseStatement) -> cst.BaseStatement:
        """Fabric a little earlier, so that the prints just above where it would be created
        (``print(args)``, ``print("Random Seed: ", seed)``) become ``fabric.print``: the earliest
        statement of the anchor's block that holds a print, after the arguments are parsed, when
        nothing between it and the anchor sets up the process's environment (``os.environ``,
        ``torch.cuda.set_device``, ``torch.distributed``), which Fabric must see done."""
        f = self.f
        body = list(f.block(anchor).body)
        index = body.index(anchor)
        parsed = max((i for i, s in enumerate(body[:index]) if any(
            f.statement(c) is s for c in f.attribute_calls_of("parse_args") + f.attribute_calls_of("parse_known_args")
            for c in [c[1]])), default=-1)
        printing = {id(f.statement(c)) for c in f.prints}
        chosen = index
        for i in range(index - 1, parsed, -1):
            stmt = body[i]
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) or self._sets_environment(stmt):
                break
            if id(stmt) in printing or any(id(inner) in printing for inner in _inner_statements(stmt)):
                chosen = i
        return body[chosen]

    def _sets_environment(self, stmt: cst.BaseStatement) -> bool:
        f = self.f
        names = {q for node in m.findall(stmt, m.Name() | m.Attribute()) for q in f.qualnames(node)}
        return any(q.startswith(("os.environ", "os.putenv", "torch.cuda.set_device", "torch.distributed",
                                 "torch.set_default_device", "torch.accelerator.set_device"))
                   for q in names) or bool(m.findall(stmt, m.Import() | m.ImportFrom()))

    def _trains_itself(self) -> bool:
        """A module whose own method builds its optimizer over ``self.parameters()`` (a layer that
        trains itself, as forward-forward scripts write them): it would be set up as ``self``
        inside its own class, which rebinds a local name only, and the forward its methods run on
        ``self`` never passes through Fabric's wrapper (no precision, no strategy): refused."""
        f = self.f
        for opt in f.optimizers:
            func = f.function(opt.stmt)
            cls = f.enclosing_class(func) if func is not None else None
            if cls is not None and any(path == "self" and owner is func for owner, path in opt.models):
                self.refuse(opt.stmt, f"`{opt.path}` is built over the module's own parameters in "
                                      f"{cls.name.value}.{func.name.value}: `{cls.name.value}` trains itself, inside "
                                      "the class, so the forward it runs on `self` would bypass Fabric's wrapper "
                                      "(no precision, no strategy) wherever it were set up; nothing was converted")
                return True
        return False

    def _ddp_statements(self, home: Scope) -> list[cst.BaseStatement]:
        """The statements of ``home`` that start the hand-made world or read a process's place,
        or call a function of the script that does (``rank, world_size = setup()``)."""
        f, p = self.f, self.p
        out: list[cst.BaseStatement] = []
        for node in [*p.ddp.starts, *(n for n, _ in p.ddp.reads)]:
            scope = _innermost_scope(f, node)
            if scope is home:
                out.append(f.statement(node))
            elif isinstance(scope, cst.FunctionDef) and f.functions.get(scope.name.value) is not None \
                    and f.functions[scope.name.value].node is scope:
                out += [f.statement(c) for c in f.functions[scope.name.value].calls
                        if _innermost_scope(f, c) is home]
        return out


    def _spawned_home(self, ddp: HandDDP) -> bool:
        """``mp.spawn(worker, ...)``: Fabric is created where spawn was and launches the worker,
        which receives it as its first argument; so `fabric` exists from the worker's first line."""
        f, p = self.f, self.p
        worker = ddp.spawn.worker
        builds = [b for b in f.bindings if any(f.same_object(b.key, key) for opt in f.optimizers
                                                for key in opt.models)] or list(f.optimizers)
        outside = [b for b in builds if f.function(b.stmt) is not worker
                   and not self._called_only_from(f.function(b.stmt), worker)]
        if outside:
            self.refuse(outside[0].stmt, f"hand-made distributed training: `{outside[0].path}` is built "
                                         f"outside `{worker.name.value}`, the function mp.spawn runs; "
                                         "nothing was converted")
            return False
        if any(p.name.value == NAME for p in positional_params(worker)):
            self.refuse(worker, f"`{worker.name.value}` already has a parameter named `{NAME}`")
            return False
        p.home = worker
        p.anchor = next(s for s in worker.body.body)
        return True

    def _called_only_from(self, func: Optional[cst.FunctionDef], worker: cst.FunctionDef) -> bool:
        """A module-level function called once, from ``worker`` (``load_train_objs()`` in the
        function mp.spawn runs): what it builds is built in each process, after the world starts."""
        f = self.f
        fn = f.functions.get(func.name.value) if func is not None else None
        return (fn is not None and fn.node is func and len(fn.calls) == 1 and not fn.other_uses
                and f.function(fn.calls[0]) is worker)

    def _is_factory(self, func: cst.FunctionDef) -> bool:
        """A module-level function that builds and returns the model, called once."""
        f = self.f
        fn = f.functions.get(func.name.value)
        if fn is None or fn.node is not func or len(fn.calls) != 1 or fn.other_uses:
            return False
        built = {b.path for b in f.bindings if b.owner is func and b.kind in ("module", "optimizer")}
        # its returns, those of functions inside it too (from the analysis's list, not a walk of it)
        for ret in (r for r in f.returns if any(a is func for a in f.ancestors(r))):
            if ret.value is not None and {n.value for n in m.findall(ret.value, m.Name())} & built:
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
        lbfgs = [opt for opt in f.optimizers if opt.qualname.endswith("LBFGS")]
        if lbfgs:
            why = ("its GradScaler can't step an LBFGS closure" if p.precision == "16-mixed" else
                   "LBFGS's line search and curvature pairs go astray in low precision "
                   "(measured on fixtures/lbfgs with bf16-mixed: loss 98.9 instead of 18.7 at "
                   "step 13)")
            p.omit_precision = (lbfgs[0].stmt, f"precision {p.precision} not set: {why}; "
                                               "LBFGS stays at 32-true")
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
        for opt in f.optimizers:
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
            if len(opt.models) != 1:
                why = ("its parameters come from several models" if opt.models
                       else "could not tell which model's parameters it takes")
                p.setup_skips.append((opt.stmt, f"optimizer `{opt.path}` not set up: {why}"))
                continue
            by_model.setdefault(opt.models[0], []).append(opt)
        for model_key, opts in by_model.items():
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
            p.setups.append(SetupGroup(model_key[1], list(unique.values()), ref, model_key, after,
                                       self._forward_methods(model_key, after), otherwise=guard))
        for group in p.setups:
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

    # -- fabric.setup_dataloaders(...) --
    def _evaluated_while_sharded(self, loader: Binding, ref: str, reductions: list) -> None:
        """A training loader the script also evaluates on is sharded for the training: after each
        evaluation loop over it, the sums it accumulates are all-reduced (the whole set's figures
        again, as --shard-eval does); where they can't be, the note says the figures become one
        process's."""
        f, p = self.f, self.p
        loops, sums = evaluations_of_training_loader(f, loader)
        if not loops:
            return
        if sums.problem is not None:
            node, why = sums.problem
            p.loader_skips.append((node, f"`{loader.path}` is sharded for training, so the evaluation over it "
                                         f"sees one process's share: {why}; its figures become one "
                                         "process's (evaluate on a loader of its own)"))
            return
        for loop, names in sums.reductions:
            reductions.append((loop, p.ref_at(f, loop) or ref, names,
                               f"`{loader.path}` is sharded for training: each process evaluates its shard"))
        p.loader_skips.extend(sums.notes)

    def _training_sums(self, loader: Binding, ref: str, reductions: list) -> None:
        """A sum the training loop over a sharded loader accumulates, read after the loop as a
        figure of the whole set (``train_loss / len(train_loader.dataset)``): all-reduced after
        the loop, as an evaluation's; read any other way, the note says it is one process's."""
        f, p = self.f, self.p
        sums = training_sums(f, loader)
        for loop, names in sums.reductions:
            reductions.append((loop, p.ref_at(f, loop) or ref, names,
                               f"`{loader.path}` is sharded for training: each process sums its shard"))
        p.loader_skips.extend(sums.notes)

    def _loaders(self) -> None:
        f, p = self.f, self.p
        groups: dict[tuple[int, bool], list[Binding]] = {}
        reductions: list[tuple[cst.For, str, list[tuple[str, bool, str]], str]] = []
        for loader in f.loaders:
            if loader.key in f.returned_loaders:
                continue  # set up where the helper that returns it is called
            sharded = p.ddp.sharded(f, loader.key) if p.ddp is not None else None
            if sharded is not None and not sharded.set_up:
                p.loader_skips.append((loader.stmt, sharded.why))
                continue
            ref = p.ref_at(f, loader.stmt)
            if ref is None:
                p.loader_skips.append((loader.stmt, f"`{loader.path}` is built where `fabric` can't be reached"))
                continue
            role = loader_role(f, loader)
            evaluation = role == EVAL
            if role == TRAIN and self.o.many_devices:
                self._evaluated_while_sharded(loader, ref, reductions)
                self._training_sums(loader, ref, reductions)
            if evaluation and self.o.shard_eval and self.o.many_devices:
                sums = eval_sums(f, loader)
                if sums.problem is None:
                    evaluation = False  # sharded: its sums are reduced after its loops
                    for loop, names in sums.reductions:
                        reductions.append((loop, p.ref_at(f, loop) or ref, names,
                                           "--shard-eval: each process evaluates its shard"))
                    p.loader_skips.extend(sums.notes)
                else:
                    node, why = sums.problem
                    p.loader_skips.append((node, f"--shard-eval: `{loader.path}` is not sharded: {why}; "
                                                 "every process evaluates all of it"))
            groups.setdefault((id(f.block(loader.stmt)), evaluation), []).append(loader)
        for (_, evaluation), loaders in groups.items():
            loaders.sort(key=lambda b: f.line(b.stmt))
            last = loaders[-1].stmt
            block = f.block(last)
            if not p.after_creation(f, last):
                # built before Fabric: set up right after the Fabric lines when that's the same block
                if block is not f.block(p.anchor):
                    for b in loaders:
                        p.loader_skips.append((b.stmt, f"`{b.path}` is built before Fabric exists"))
                    continue
                last = p.anchor
            p.loader_groups.append(LoaderGroup(loaders, last, p.ref_at(f, loaders[-1].stmt), evaluation))
        set_up = {b.key for group in p.loader_groups for b in group.loaders}
        p.reductions = [r for r in reductions
                        if f.key_of(unwrap_iter(r[0].iter)) in set_up or any(
                            f.same_object(f.key_of(unwrap_iter(r[0].iter)), key) for key in set_up)]


#: what starts processes that run a function of the script (not DDP's spawn: codemod/ddp.py)
PROCESS_STARTERS = ("torch.multiprocessing.Process", "multiprocessing.Process", "multiprocessing.context.Process",
                    "torch.multiprocessing.start_processes")
#: a pool's or an executor's methods that run a function in its processes
_POOL_METHODS = ("map", "starmap", "imap", "imap_unordered", "apply", "apply_async", "map_async", "submit")


def _reached_from(f: ScriptFacts, func: cst.FunctionDef) -> set[int]:
    """ids of ``func`` and of the module-level functions it calls, directly or not."""
    seen: set[int] = set()
    todo = [func]
    while todo:
        current = todo.pop()
        if id(current) in seen:
            continue
        seen.add(id(current))
        for fn in f.functions.values():
            if isinstance(fn.node, cst.FunctionDef) and any(
                    current in f.ancestors(c) for c in fn.calls):
                todo.append(fn.node)
    return seen


def _inner_statements(stmt: cst.BaseStatement) -> list[cst.BaseStatement]:
    """The statements nested in a compound one (an ``if``'s, a ``try``'s)."""
    return [s for s in m.findall(stmt, m.SimpleStatementLine()) if s is not stmt]


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
