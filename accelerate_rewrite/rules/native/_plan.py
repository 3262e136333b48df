"""The native plan (``--backend torch``): what AR207, AR208, AR210 and AR211 share, made once.

Which statements of each training step are the forward pass and the loss (they go under
``torch.autocast``; the backward and the optimizer step stay outside), which evaluation loops
get autocast too, the expression that names the script's own device type at each place, and,
for 16-mixed, where the one ``torch.amp.GradScaler`` of the run is created and how every
backward, clip and optimizer step reaches it (rules/native/_scaler.py); with apex (``rules/base/apex.py``), the precision its
opt_level means and what becomes of its calls. Either every training step can be converted, or
the plan is a refusal with the reason: a scaled backward next to an unscaled step would apply
gradients 65,536 times too large.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import (
    MODEL,
    OPTIMIZER,
    ScriptFacts,
    bce_calls,
    code,
)
from accelerate_rewrite.codemod.analysis.amp import own_amp
from accelerate_rewrite.codemod.analysis.devices import device_type_at
from accelerate_rewrite.options import MIXED_PRECISIONS, TRUE_HALF_PRECISIONS, Options
from accelerate_rewrite.rules.base.apex import apex_use
from accelerate_rewrite.rules.base.plan import short
from accelerate_rewrite.rules.native._scaler import SCALER, Scaler, Site  # noqa: F401 (SCALER: the rules import it from here)

#: the mixed precisions the native path expresses, and the autocast dtype of each
AUTOCAST_DTYPES = dict(zip(MIXED_PRECISIONS, ("torch.float16", "torch.bfloat16")))
#: the true half precisions: the model's weights cast to that dtype (AR210)
TRUE_HALF = dict(zip(TRUE_HALF_PRECISIONS, ("torch.float16", "torch.bfloat16")))

Refusal = tuple[Optional[cst.CSTNode], str]
#: autocast, the scaler and the apex migration stand or fall together: a scaled backward with
#: an unscaled step, or apex's scale_loss next to a GradScaler, would train wrong
NATIVE_CORE = ("AR207", "AR208", "AR211")


def core_except(code_: str) -> tuple[str, ...]:
    return tuple(c for c in NATIVE_CORE if c != code_)


@dataclass
class Region:
    """Consecutive statements of one block that run under ``torch.autocast``."""

    stmts: list[cst.BaseStatement]
    device_type: str  # an expression: ``device.type``, ``torch.device(device).type``, ``"cuda"``
    training: bool


@dataclass
class NativePlan:
    refusal: Optional[Refusal] = None
    precision: Optional[str] = None  # --precision, or what apex's opt_level maps to
    regions: list[Region] = field(default_factory=list)
    # 16-mixed: the GradScaler
    scaler_after: Optional[cst.BaseStatement] = None  # created right after this statement
    scaler_target: str = SCALER  # "scaler" or "self.scaler"
    scaler_device_type: str = ""
    threads: list[cst.FunctionDef] = field(default_factory=list)  # get a `scaler` parameter
    thread_calls: list[cst.Call] = field(default_factory=list)  # pass `scaler=scaler`
    backwards: list[tuple[Site, Optional[str]]] = field(default_factory=list)  # site, scaler ref
    steps: list[tuple[cst.Call, str]] = field(default_factory=list)
    updates: list[tuple[cst.BaseStatement, str]] = field(default_factory=list)  # update() after
    unscales: list[tuple[cst.BaseStatement, str, str]] = field(default_factory=list)  # clip, ref, opt
    # apex.amp
    apex_level: Optional[str] = None
    apex_inits: list[cst.BaseStatement] = field(default_factory=list)  # statements to remove
    apex_master_params: list[cst.Call] = field(default_factory=list)
    apex_states: list[tuple[cst.Call, Optional[str]]] = field(default_factory=list)  # state_dict(), ref
    apex_loads: list[tuple[cst.Call, Optional[str]]] = field(default_factory=list)

    @property
    def sites(self) -> list[Site]:
        return [site for site, _ in self.backwards]


def native_plan(facts: ScriptFacts, options: Options) -> NativePlan:
    return facts.memo(("native-plan", options), lambda: _Planner(facts, options).run())


def casts_to_true_half(facts: ScriptFacts, options: Options) -> bool:
    """Whether AR210 casts the script's models to 16-true / bf16-true."""
    from accelerate_rewrite.rules.base.half import low_precision_model_cast

    p = native_plan(facts, options)
    return (not options.fabric and p.precision in TRUE_HALF and p.refusal is None and bool(facts.models)
            and low_precision_model_cast(facts) is None)


class _Planner(Scaler):
    def __init__(self, facts: ScriptFacts, options: Options) -> None:
        self.f = facts
        self.o = options
        self.p = NativePlan()
        self.steps = facts.method_calls(OPTIMIZER, "step")
        self.backward_calls = {id(s.call) for s in facts.backward_sites}
        # statements that hold a backward or an optimizer step: a forward pass does not cross them
        self.boundaries: set[int] = set()
        for call in [*(s.call for s in facts.backward_sites), *self.steps]:
            self.boundaries.update(id(a) for a in facts.ancestors(call))
        # functions of the file that run a model (``loss = compute_loss(batch)``) or train
        self.model_funcs: set[str] = set()
        self.model_funcs = {name for name, fn in facts.functions.items() if self._calls_model(fn.node)}
        self.training_funcs = {
            name for name, fn in facts.functions.items()
            if any(fn.node in facts.ancestors(s.call) for s in facts.backward_sites)
        }

    def refuse(self, node: Optional[cst.CSTNode], why: str) -> NativePlan:
        self.p = NativePlan(refusal=(node, why), precision=self.p.precision)
        return self.p

    def run(self) -> NativePlan:
        f, o = self.f, self.o
        self.p.precision = o.precision
        if not self._apex():
            return self.p
        precision = self.p.precision
        if precision in (None, "32-true") and not self.p.apex_inits:
            return self.p
        if f.frameworks:
            label, node = f.frameworks[0]
            return self.refuse(node, f"already uses {label}; left alone")
        own = f.uses_autocast()
        if own:
            autocasts = own_amp(f).computing
            if autocasts:
                return self.refuse(autocasts[0].node, "the script runs its own autocast: nothing is wrapped twice "
                                                      "(AR213, own-mixed-precision, sets the script's own to the "
                                                      "precision asked for)")
            return self.refuse(own[0].call, f"the script runs its own "
                               f"{own[0].qualname.rsplit('.', 1)[-1]}: nothing is wrapped twice")
        if not f.backward_sites:
            return self.refuse(None, "no training found (no backward call); nothing to do")
        library = [s for s in f.backward_sites if s.library is not None]
        if library:
            return self.refuse(library[0].call, f"`{short(library[0].call)}` ({library[0].library}) runs its "
                                                "own GradScaler: nothing is wrapped twice")
        lbfgs = [opt for opt in f.optimizers if opt.qualname.endswith("LBFGS")]
        if lbfgs:
            why = ("a GradScaler can't step an LBFGS closure" if precision == "16-mixed" else
                   "LBFGS's line search goes astray in low precision (measured on fixtures/lbfgs "
                   "with bf16-mixed: loss 98.9 instead of 18.7 at step 13)")
            return self.refuse(lbfgs[0].stmt, f"{why}; LBFGS stays at 32-true")
        sites = self._sites()
        if precision not in AUTOCAST_DTYPES:
            self.p.backwards = [(site, None) for site in sites]
            return self.p  # no autocast, no scaler: only apex goes
        for site in sites:
            stmts = self._training_region(site)
            if isinstance(stmts, str):
                return self.refuse(site.call, f"`{short(site.call)}`: {stmts}, so no step was "
                                              "put under autocast")
            if stmts and any(r.stmts[0] is stmts[0] for r in self.p.regions):
                continue  # ``if amp: <scaled backward> else: loss.backward()``: one forward pass
            if stmts and not self._add_region(stmts, training=True):
                return self.p
        self._eval_regions()
        if not self._no_bce_under_autocast():
            return self.p
        if self.p.refusal is None and precision == "16-mixed":
            self._scaler(sites)
        else:
            self.p.backwards = [(site, None) for site in sites]
        self._apex_state()
        return self.p

    # -- apex.amp --
    def _apex(self) -> bool:
        """apex's initialize calls: the precision they mean, the statements that go."""
        p, a = self.p, apex_use(self.f)
        if a.problem is not None:
            self.refuse(*a.problem)
            return False
        if a.unknown_level is not None and p.precision is None:
            self.refuse(a.unknown_level, "apex's opt_level is not a literal O0-O3: give --precision "
                                         "(O0 is 32-true, O1 and O2 16-mixed, O3 16-true)")
            return False
        p.apex_level, p.apex_inits = a.level, list(a.inits)
        p.precision = p.precision or a.precision
        if a.present and p.precision not in (*AUTOCAST_DTYPES, *TRUE_HALF, "32-true", None):
            self.refuse(a.inits[0] if a.inits else None, f"--precision {p.precision} has no "
                                                         "plain-PyTorch form here")
            return False
        return True

    def _sites(self) -> list[Site]:
        blocks = apex_use(self.f).blocks
        sites = []
        for site in self.f.backward_sites:
            if id(site.call) in blocks:  # apex's ``with amp.scale_loss(loss, ...) as s: s.backward()``
                block, loss = blocks[id(site.call)]
                sites.append(Site(site.call, loss, block, apex=True))
            else:
                sites.append(Site(site.call, site.loss, site.stmt))
        return sites

    def _apex_state(self) -> None:
        f, p = self.f, self.p
        if p.refusal is not None:
            return
        a = apex_use(f)
        p.apex_master_params = list(a.master_params)
        scaler = p.precision == "16-mixed"
        p.apex_states = [(call, self._scaler_ref(call) if scaler else None) for call in a.states]
        p.apex_loads = [(call, self._scaler_ref(call) if scaler else None) for call in a.loads]

    # -- what runs a model --
    def _is_model(self, node: cst.CSTNode) -> bool:
        return isinstance(node, (cst.Name, cst.Attribute)) and MODEL in self.f.kinds_of(node)

    def _calls_model(self, node: cst.CSTNode) -> bool:
        for call in m.findall(node, m.Call()):
            if self._is_model(call.func) or any(self._is_model(a.value) for a in call.args):
                return True
            if isinstance(call.func, cst.Name) and call.func.value in self.model_funcs:
                return True
        return False

    def _training_region(self, site: Site):
        """The statements that compute the loss the backward takes, from the first that runs a
        model: in the backward's own block, or, where the backward sits in a branch or a ``with``
        (``if args.amp: with amp.scale_loss(loss, opt) as s: s.backward()``, ``with
        timer("grads"): loss.backward()``), in the block around it, by where the loss's names
        are bound; a str says why there are none."""
        f = self.f
        if self._calls_model(site.stmt):
            return "the forward pass and the backward are one statement (split them)"
        stmt, needed = site.stmt, {n.value for n in m.findall(site.loss, m.Name())}
        while True:
            body = list(f.block(stmt).body)
            index = body.index(stmt)
            start = index
            while start > 0 and id(body[start - 1]) not in self.boundaries:
                start -= 1
            candidates = body[start:index]
            first = next((i for i, s in enumerate(candidates) if self._calls_model(s)), None)
            if first is not None:
                return self._uses_of_forward(candidates[first:])
            if start > 0 and self._backward_not_step(body[start - 1]):
                return []  # a second loss of the same forward pass (apex's num_losses, retain_graph)
            traced = self._computing_the_loss(needed, candidates)
            if traced:
                return traced
            for s in reversed(candidates):  # what the loss is computed from, above this block
                bound = _bound(s)
                if bound & needed:
                    needed = (needed - bound) | {n.value for n in m.findall(s, m.Name())}
            outer = self._statement_around(stmt)
            if outer is None or not needed:
                return ("no forward pass found before it, in its block or the `if`/`with` blocks around it up "
                        "to its loop or function: neither a model of the script nor a call that computes the loss")
            stmt = outer

    def _statement_around(self, stmt: cst.BaseStatement) -> Optional[cst.BaseStatement]:
        """The ``if``/``with``/``try`` statement whose block holds ``stmt``; None at a loop, a
        function, a class or the module (a forward outside a loop is not this step's)."""
        f = self.f
        for node in f.ancestors(stmt):
            parent = f.parent(node)
            if isinstance(node, cst.BaseStatement) and isinstance(parent, (cst.Module, cst.IndentedBlock)):
                return node if isinstance(node, (cst.If, cst.With, cst.Try)) else None
        return None

    @staticmethod
    def _computing_the_loss(needed: set[str], candidates: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """The forward found from the loss back (``output = self.model(source)``; ``loss =
        F.mse_loss(output, targets)``, where the rewrite can't tell ``self.model`` is a model):
        the statements of the block that compute the loss's names (``for`` and ``if`` statements
        too, by the names bound anywhere in them), from the first of them that calls something,
        through the last. Empty when the loss is not computed there by a call."""
        needed = set(needed)
        used: list[int] = []
        for i in range(len(candidates) - 1, -1, -1):
            s = candidates[i]
            bound = _bound(s)
            if bound & needed:
                used.append(i)
                needed |= {n.value for n in m.findall(s, m.Name())} - bound
        calls = [i for i in used if m.findall(candidates[i], m.Call())]
        if not calls:
            return []
        return candidates[min(calls):max(used) + 1]

    def _no_bce_under_autocast(self) -> bool:
        f = self.f
        wrapped = {id(s) for r in self.p.regions for s in r.stmts}
        for call in bce_calls(f):
            func = f.function(call)
            cls = f.enclosing_class(func) if func is not None else None
            in_forward = func is not None and func.name.value == "forward" and cls is not None \
                and cls.name.value in f.module_classes
            if in_forward or any(id(a) in wrapped for a in f.ancestors(call)):
                self.refuse(call, f"`{short(call)}` would run under autocast, which CUDA refuses for "
                                  "BCELoss (\"unsafe to autocast\"): use BCEWithLogitsLoss / "
                                  "binary_cross_entropy_with_logits on the logits (drop the sigmoid) "
                                  "and rerun, or use --backend fabric (it autocasts only the "
                                  "model's forward)")
                return False
        return True

    def _backward_not_step(self, statement: cst.BaseStatement) -> bool:
        calls = {id(c) for c in m.findall(statement, m.Call())}
        return bool(calls & self.backward_calls) and not any(id(c) in calls for c in self.steps)

    def _eval_regions(self) -> None:
        """Loops that run a model and do not train: from the first statement of the body that
        runs a model to the end of the body, under autocast (and still under no_grad)."""
        f = self.f
        wrapped = {id(s) for r in self.p.regions for s in r.stmts}
        for loop in f.find(m.For() | m.While()):
            if not isinstance(loop.body, cst.IndentedBlock) or self._trains(loop):
                continue
            if any(id(a) in wrapped for a in f.ancestors(loop)):
                continue
            body = list(loop.body.body)
            first = next((i for i, s in enumerate(body) if self._calls_model(s)), None)
            if first is None:
                continue
            stmts = self._uses_of_forward(body[first:])
            if any(id(a) in wrapped for s in stmts for a in m.findall(s, m.For() | m.While())):
                continue
            if not self._add_region(stmts, training=False):
                return
            wrapped.update(id(s) for s in stmts)
            wrapped.update(id(a) for s in stmts for a in m.findall(s, m.For() | m.While()))

    def _uses_of_forward(self, stmts: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
        """``stmts[0]`` runs a model: it and the statements after it up to the last one that runs
        a model or reads what such a statement (or one of these) assigned."""
        assigned: set[str] = set()
        end = 0
        for i, s in enumerate(stmts):
            reads = {n.value for n in m.findall(s, m.Name())}
            if i == 0 or self._calls_model(s) or reads & assigned:
                end = i
                for target in m.findall(s, m.AssignTarget() | m.AugAssign() | m.AnnAssign()):
                    assigned |= {n.value for n in m.findall(target.target, m.Name())}
        return stmts[: end + 1]

    def _trains(self, node: cst.CSTNode) -> bool:
        f = self.f
        if any(id(c) in self.backward_calls for c in m.findall(node, m.Call())):
            return True
        for call in m.findall(node, m.Call()):
            if isinstance(call.func, cst.Name) and call.func.value in self.training_funcs:
                return True
        return any(OPTIMIZER in f.kinds_of(n) for n in m.findall(node, m.Name() | m.Attribute()))

    def _add_region(self, stmts: list[cst.BaseStatement], training: bool) -> bool:
        device_type = self.device_type(stmts[0]) or self._device_of_model(stmts[0])
        if device_type is None:
            self.refuse(stmts[0], "can't tell which device the script runs on here (no device "
                                  "variable in reach, no model called by name): autocast needs the "
                                  "device type")
            return False
        self.p.regions.append(Region(stmts, device_type, training))
        return True

    def _device_of_model(self, stmt: cst.BaseStatement) -> Optional[str]:
        """Where no device is in reach (an inference helper given only the model): the type of
        the device of the parameters of the model ``stmt`` calls, which is where its forward runs
        (``next(model.parameters()).device.type``)."""
        for call in m.findall(stmt, m.Call()):
            func = call.func
            if self._is_model(func) and (isinstance(func, cst.Name) or m.matches(
                    func, m.Attribute(value=m.Name("self"), attr=m.Name()))):
                return f"next({code(func)}.parameters()).device.type"
        return None

    # -- the script's own device (codemod/analysis/devices.py) --
    def device_type(self, node: cst.CSTNode) -> Optional[str]:
        """An expression for the type of the script's device where ``node`` stands."""
        return device_type_at(self.f, node)


def _bound(stmt: cst.BaseStatement) -> set[str]:
    """The names a statement binds anywhere in it: assignments, ``for`` targets, ``with ... as``."""
    targets = [t.target for t in m.findall(stmt, m.AssignTarget() | m.AugAssign() | m.AnnAssign() | m.For())]
    targets += [item.asname.name for item in m.findall(stmt, m.WithItem()) if item.asname is not None]
    return {n.value for target in targets for n in m.findall(target, m.Name())}
