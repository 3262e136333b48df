"""The Fabric plan's making (see rules/base/plan.py for what it decides): the order of its
parts, the precision, and what hand-made DDP leaves to settle; what is set up with Fabric is
rules/fabric/_setups.py, where Fabric is created (and what can't be given one Fabric) is rules/fabric/_home.py,
which loaders rules/fabric/_loaders.py, where `fabric` is reached rules/fabric/_reach.py, what
becomes of the device rules/fabric/_devices.py."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.amp import own_amp
from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.ddp.hand import hand_ddp
from accelerate_rewrite.codemod.ddp.places import PLACE_CALLS, strict_env_read
from accelerate_rewrite.codemod.analysis.kinds import custom_steps, hand_updated
from accelerate_rewrite.codemod.analysis.libraries import TAKES_OVER
from accelerate_rewrite.rules.base.apex import apex_use
from accelerate_rewrite.options import FUNCTION_LAUNCH_STRATEGIES, Options
from accelerate_rewrite.rules.base.plan import (
    NAME,
    FabricPlan,
    _innermost_scope,
    code,
    short,
)
from accelerate_rewrite.rules.fabric._devices import Devices
from accelerate_rewrite.rules.fabric._home import Home
from accelerate_rewrite.rules.fabric._loaders import Loaders
from accelerate_rewrite.rules.fabric._reach import Reach
from accelerate_rewrite.rules.fabric._setups import Setups
from accelerate_rewrite.rules.fabric._wrapped import WrappedReads


def make_plan(facts: ScriptFacts, options: Options) -> FabricPlan:
    return _Planner(facts, options).run()


class _Planner(Home, Loaders, Reach, Devices, Setups, WrappedReads):
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
        taker = next(((node, q) for node, q in f.qualified_refs if q in TAKES_OVER), None)
        if taker is not None:  # (codemod/analysis/libraries.py: what the library does, and where it was read)
            node, qualname = taker
            return self.refuse(node, f"`{short(node)}` ({qualname}) {TAKES_OVER[qualname].what}; nothing was converted")
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
            for started, call, _ in p.ddp.started_by:
                if p.ref_at(self.f, started) is None or not p.after_creation(self.f, started):
                    self.refuse(call, f"`{short(call)}` starts the process group itself, where `fabric` can't be "
                                      "reached to take its place: under Fabric's processes it would start it a "
                                      "second time, and fail; nothing was converted")
                    return
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
            autocasts = own_amp(f).computing
            site = autocasts[0].node if autocasts else own[0].call
            what = "autocast" if autocasts else own[0].qualname.rsplit('.', 1)[-1]
            p.omit_precision = (
                site,
                f"precision {p.precision} not set on Fabric: the script runs its own {what}, and Fabric's "
                "on top would apply it twice; " + ("AR213 (own-mixed-precision) sets the script's own to it"
                                                   if autocasts else "leave the script's mixed precision as it "
                                                   "is, or remove it and rerun"),
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
def plan(facts: ScriptFacts, options: Options) -> FabricPlan:
    """The plan for this file and these options: made by the first rule that asks."""
    return facts.memo(("fabric-plan", options), lambda: make_plan(facts, options))


def library_backward(site) -> str:
    """What is said of a library's loss scaler called with the loss (``BackwardSite.library``)."""
    return (f"`{short(site.call)}` ({site.library}) runs backward and the optimizer step itself, with the "
            "script's own GradScaler: left as it is (under DDP that is the backward Fabric would run)")
