"""The Fabric conversion plan: the decisions that the Fabric rules share, made once per file.

Where ``fabric`` is created, in which functions it can be reached and under what name
(``fabric``, a ``device`` parameter that becomes ``fabric``, ``self.fabric``), which models,
optimizers and loaders are set up, which batches therefore need no ``.to(device)``, and what
becomes of every use of the device. The rules (AR101-AR109) turn these decisions into edits;
none of them decides alone, so they agree with each other by construction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.facts import (
    CLIP_NORM,
    CLIP_VALUE,
    DEVICE,
    LOADER,
    MODEL,
    Binding,
    DeviceMove,
    Key,
    Optimizer,
    ScriptFacts,
    code,
    init_of,
    is_literal_device,
    param_for,
    positional_params,
    root_of,
)
from accelerate_rewrite.codemod.ddp import HandDDP, hand_ddp
from accelerate_rewrite.codemod.loops import EVAL, eval_sums, for_loops, loader_role, unwrap_iter
from accelerate_rewrite.codemod.rule import Rule
from accelerate_rewrite.rules._apex import apex_use
from accelerate_rewrite.rules._half import low_casts, strip_half
from accelerate_rewrite.options import FUNCTION_LAUNCH_STRATEGIES, MIXED_PRECISIONS, Options

NAME = "fabric"
#: The rules without which a Fabric conversion is wrong (a model not set up misses the precision,
#: a plain backward is refused under mixed precision, unconverted clipping clips scaled
#: gradients, apex's scale_loss left around fabric.backward, ...): each relies on all the
#: others, so if one is dropped for a file, all are.
#: Printing (AR108) and checkpoints (AR109) rely on them but are optional themselves.
FABRIC_CORE = ("AR101", "AR102", "AR103", "AR104", "AR105", "AR106", "AR107", "AR111", "AR211")


class FabricRule(Rule):
    """A rule of the Fabric conversion: it runs with ``--backend fabric`` (the default) only."""

    def applies(self, options: Options) -> bool:
        return options.fabric


def core_except(code_: str) -> tuple[str, ...]:
    return tuple(c for c in FABRIC_CORE if c != code_)


Scope = Union[cst.Module, cst.FunctionDef, cst.Lambda]


def short(node: cst.CSTNode, limit: int = 48) -> str:
    """One line of code for a message: whitespace folded, long code cut."""
    text = " ".join(code(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def expr(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def stmt(text: str) -> cst.BaseStatement:
    return cst.parse_statement(text)


@dataclass
class SetupGroup:
    """One ``fabric.setup(...)`` call: a model and the optimizers that train it."""

    model: str  # as written where the optimizers are built: "model", "self.model"
    optimizers: list[Optimizer]
    ref: str
    model_key: Key
    after: cst.BaseStatement  # the setup call goes right after this statement
    #: methods of the model's class, other than forward, that the script calls on the set-up
    #: model: with a strategy that wraps it (DDP, FSDP) Fabric raises unless they are marked
    forward_methods: list[str] = field(default_factory=list)
    #: the optimizers are built under this ``if`` only (``if args.use_optimizer:``): they are set
    #: up with the model there, and the model alone in its ``else`` (made when there is none)
    otherwise: Optional[cst.If] = None


@dataclass
class LoaderGroup:
    """One ``fabric.setup_dataloaders(...)`` call, right after ``after``."""

    loaders: list[Binding]
    after: cst.BaseStatement
    ref: str
    #: evaluation loaders (codemod/loops.py): every process iterates all of them
    #: (``use_distributed_sampler=False``), so the metrics the script computes stay whole
    evaluation: bool = False


@dataclass
class MoveDecision:
    move: DeviceMove
    action: str  # "remove" | "fabric-device"
    ref: Optional[str] = None


@dataclass
class FabricPlan:
    refusal: Optional[tuple[Optional[cst.CSTNode], str]] = None
    home: Optional[Scope] = None
    anchor: Optional[cst.BaseStatement] = None  # Fabric(...) goes right before it
    replaces_anchor: bool = False  # the anchor is a device definition that goes away
    omit_precision: Optional[tuple[cst.CSTNode, str]] = None
    precision: Optional[str] = None  # --precision, or what the script's apex opt_level maps to
    refs: dict[int, str] = field(default_factory=dict)  # id(scope node) -> "fabric" | "self.fabric"
    blocked: set[int] = field(default_factory=set)  # ids of functions that may run before Fabric exists
    threaded_params: dict[int, cst.Param] = field(default_factory=dict)  # id(FunctionDef) -> param
    threaded_attrs: dict[int, str] = field(default_factory=dict)  # id(ClassDef) -> "self.device"
    setups: list[SetupGroup] = field(default_factory=list)
    setup_skips: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    loader_groups: list["LoaderGroup"] = field(default_factory=list)
    loader_skips: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    #: --shard-eval: after each loop over a sharded evaluation loader, the sums it accumulates
    #: are all-reduced: (loop, fabric's name there, [(name, a Python number)])
    reductions: list[tuple[cst.For, str, list[tuple[str, bool]]]] = field(default_factory=list)
    moves: list[MoveDecision] = field(default_factory=list)
    move_skips: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    device_uses: list[tuple[cst.CSTNode, str]] = field(default_factory=list)  # node -> new code
    device_keeps: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    removed_device_defs: list[Binding] = field(default_factory=list)
    thread_args: list[tuple[cst.Arg, str]] = field(default_factory=list)  # call args -> ref
    trivial_stmts: list[cst.BaseStatement] = field(default_factory=list)
    #: optimizers over tensors, not a model's parameters (``LBFGS([input_img])``): nothing to set up
    tensor_optimizers: list[Optimizer] = field(default_factory=list)
    #: hand-made DDP taken over (codemod/ddp.py); with ``ddp.spawn`` Fabric is created where
    #: ``mp.spawn`` was, and the spawned function receives it
    ddp: Optional[HandDDP] = None
    #: id(FunctionDef or ClassDef) -> a function that gets `fabric` as a new first parameter, a
    #: class whose ``__init__`` gets it after ``self`` and keeps it in ``self.fabric`` (callers pass it)
    added_params: dict[int, Union[cst.FunctionDef, cst.ClassDef]] = field(default_factory=dict)

    def ref_at(self, facts: ScriptFacts, node: cst.CSTNode) -> Optional[str]:
        """How ``fabric`` is spelled where ``node`` stands, or None if it can't be reached."""
        for scope in _scopes_up(facts, node):
            if id(scope) in self.blocked:
                return None
            ref = self.refs.get(id(scope))
            if ref is not None:
                return ref
        return None

    def after_creation(self, facts: ScriptFacts, node: cst.CSTNode) -> bool:
        """In the home scope, only code after the Fabric lines can use ``fabric``."""
        if self.home is None or self.anchor is None:
            return False
        if _innermost_scope(facts, node) is not self.home:
            return True
        if self.ddp is not None and self.ddp.spawn is not None:
            return True  # the worker receives `fabric`
        return facts.line(node) >= facts.line(self.anchor)

    @property
    def setup_model_keys(self) -> list[Key]:
        return [g.model_key for g in self.setups]

    def group_of(self, facts: ScriptFacts, key: Optional[Key]) -> Optional[SetupGroup]:
        for group in self.setups:
            if facts.same_object(group.model_key, key):
                return group
        return None

    def visible_name(self, facts: ScriptFacts, node: cst.CSTNode, target: Key) -> Optional[str]:
        return visible_name(facts, node, target)


def visible_name(facts: ScriptFacts, node: cst.CSTNode, target: Key) -> Optional[str]:
    """How the object behind ``target`` is named where ``node`` stands, if it is."""
    scopes = list(_scopes_up(facts, node))
    func = facts.function(node)
    cls = facts.enclosing_class(func) if func is not None else None
    for key in facts.kinds:
        if not facts.same_object(key, target):
            continue
        owner, path = key
        if path.startswith("self.") and owner is cls:
            return path
        if any(owner is s for s in scopes):
            return path
    return None


def _scopes_up(facts: ScriptFacts, node: cst.CSTNode):
    for parent in [node, *facts.ancestors(node)]:
        if isinstance(parent, (cst.FunctionDef, cst.Lambda, cst.Module)):
            yield parent


def _innermost_scope(facts: ScriptFacts, node: cst.CSTNode) -> Scope:
    return next(iter(_scopes_up(facts, node)))


def plan(facts: ScriptFacts, options: Options) -> FabricPlan:
    """The plan for this file and these options: made by the first rule that asks."""
    return facts.memo(("fabric-plan", options), lambda: _Planner(facts, options).run())


class _Planner:
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
        taken = [n for n in m.findall(f.module, m.Name(NAME)) if f.key_of(n) is not None]
        if taken:
            return self.refuse(taken[0], f"the name `{NAME}` is already used in this script")
        if not f.optimizers:
            return self.refuse(f.backward_sites[0].call, "no optimizer found to set up with Fabric")
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

    def _stuck_threads(self) -> set[int]:
        """Functions (or classes) threaded into `fabric` whose device is still read as it was."""
        f, p = self.f, self.p
        stuck: set[int] = set()
        for node, _ in p.device_keeps:
            key = f.key_of(node)
            if key is None:
                continue
            owner = key[0]
            if isinstance(owner, cst.ClassDef) and id(owner) in p.threaded_attrs:
                stuck.add(id(init_of(owner)))
            elif id(owner) in p.threaded_params:
                stuck.add(id(owner))
        return stuck

    # -- where Fabric is created --
    def _find_home(self) -> bool:
        f, p = self.f, self.p
        ddp = hand_ddp(f)
        if ddp.found:
            p.ddp = ddp
        if ddp.found and ddp.spawn is not None:
            return self._spawned_home(ddp)
        builds = [
            b for b in f.bindings
            if any(f.same_object(b.key, key) for opt in f.optimizers for key in opt.models)
        ]
        first = min(builds or f.optimizers, key=lambda b: f.line(b.stmt))
        home = _innermost_scope(f, first.stmt)
        extra: list[cst.BaseStatement] = []
        # a factory (``def build(device): ...; return model, optimizer``): Fabric belongs
        # where it is called
        while isinstance(home, cst.FunctionDef) and self._is_factory(home):
            call = f.functions[home.name.value].calls[0]
            extra.append(f.statement(call))
            home = _innermost_scope(f, call)
        if isinstance(home, cst.FunctionDef) and f.enclosing_class(home) is not None:
            self.refuse(
                first.stmt,
                f"the model is built inside a class ({f.enclosing_class(home).name.value}."
                f"{home.name.value}); create Fabric where that object is made and pass it in "
                "(not automated yet)",
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
        return True

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

    def _new_params(self) -> None:
        """Functions and classes of the script that need `fabric` where it can't be reached (a
        backward in a Trainer's method, a read of the process's place in ``setup()``), and are
        called only where it can: a function receives it as a new first parameter, a class as
        a new first parameter of ``__init__``, kept in ``self.fabric`` for its methods."""
        f, p = self.f, self.p
        needs = [s.call for s in f.backward_sites] + [o.stmt for o in f.optimizers] \
            + ([n for n, _ in p.ddp.reads] if p.ddp else [])
        changed = True
        while changed:
            changed = False
            for node in needs:
                func = f.function(node)
                if func is None or p.ref_at(f, node) is not None:
                    continue
                cls = f.enclosing_class(func)
                target = cls if cls is not None else func
                fn = f.functions.get(target.name.value)
                if id(target) in p.added_params or fn is None or fn.node is not target or fn.other_uses \
                        or not fn.calls or any(id(a) in p.blocked for a in (target, func)):
                    continue
                init = init_of(cls) if cls is not None else func
                if init is None or id(init) in p.threaded_params \
                        or any(x.name.value == NAME for x in positional_params(init)):
                    continue
                if cls is not None and (m.findall(cls, m.Attribute(value=m.Name("self"), attr=m.Name(NAME)))
                                        or not self._plain_methods(cls)):
                    continue
                if not all(p.ref_at(f, c) is not None and p.after_creation(f, c) for c in fn.calls):
                    continue
                p.added_params[id(target)] = target
                p.refs[id(init)] = NAME
                if cls is not None:
                    for method in cls.body.body:
                        if isinstance(method, cst.FunctionDef) and method is not init:
                            p.refs[id(method)] = f"self.{NAME}"
                changed = True

    @staticmethod
    def _plain_methods(cls: cst.ClassDef) -> bool:
        """Every method takes ``self`` first: no static or class methods that would not see it."""
        for method in cls.body.body:
            if isinstance(method, cst.FunctionDef):
                params = positional_params(method)
                if method.decorators or not params or params[0].name.value != "self":
                    return False
        return True

    def _spawned_home(self, ddp: HandDDP) -> bool:
        """``mp.spawn(worker, ...)``: Fabric is created where spawn was and launches the worker,
        which receives it as its first argument; so `fabric` exists from the worker's first line."""
        f, p = self.f, self.p
        worker = ddp.spawn.worker
        builds = [b for b in f.bindings if any(f.same_object(b.key, key) for opt in f.optimizers
                                                for key in opt.models)] or list(f.optimizers)
        outside = [b for b in builds if f.function(b.stmt) is not worker]
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

    def _is_factory(self, func: cst.FunctionDef) -> bool:
        """A module-level function that builds and returns the model, called once."""
        f = self.f
        fn = f.functions.get(func.name.value)
        if fn is None or fn.node is not func or len(fn.calls) != 1 or fn.other_uses:
            return False
        built = {b.path for b in f.bindings if b.owner is func and b.kind in ("module", "optimizer")}
        for ret in m.findall(func, m.Return()):
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

    # -- where `fabric` can be reached --
    def _refs(self) -> None:
        f, p = self.f, self.p
        p.refs[id(p.home)] = NAME
        if isinstance(p.home, cst.Module):
            self._block_early_functions()
            return  # a global: every function that runs after its creation sees it
        changed = True
        while changed:
            changed = False
            for fn in f.functions.values():
                target = fn.node
                func = target if isinstance(target, cst.FunctionDef) else init_of(target)
                if func is None or id(func) in p.threaded_params or fn.other_uses or not fn.calls \
                        or id(func) in self.excluded:
                    continue
                param = self._device_param(func, fn)
                if param is None:
                    continue
                if not all(p.ref_at(f, call) and p.after_creation(f, call) for call in fn.calls):
                    continue
                p.threaded_params[id(func)] = param
                p.refs[id(func)] = NAME
                changed = True
                if isinstance(target, cst.ClassDef):
                    attr = self._device_attr(target, param)
                    if attr is not None:
                        p.threaded_attrs[id(target)] = attr
                        for stmt_ in target.body.body:
                            if isinstance(stmt_, cst.FunctionDef) and stmt_ is not func:
                                p.refs[id(stmt_)] = f"self.{NAME}"
        self._new_params()

    def _block_early_functions(self) -> None:
        """With Fabric created at module level, a function called (or handed on) before the
        Fabric lines would meet no ``fabric`` yet: block it, and what it calls."""
        f, p = self.f, self.p
        safe: dict[str, bool] = {}

        def is_safe(name: str, seen: frozenset = frozenset()) -> bool:
            if name in safe:
                return safe[name]
            if name in seen:
                return True
            fn = f.functions[name]
            ok = True
            for use in [*fn.calls, *fn.other_uses]:
                outer = [a for a in f.ancestors(use) if isinstance(a, (cst.FunctionDef, cst.ClassDef))]
                if not outer:
                    ok = ok and f.line(use) >= f.line(p.anchor)
                else:
                    top = outer[-1].name.value
                    ok = ok and (top == name or top not in f.functions or is_safe(top, seen | {name}))
            safe[name] = ok
            return ok

        for name, fn in f.functions.items():
            if not is_safe(name):
                p.blocked.add(id(fn.node))
                if isinstance(fn.node, cst.ClassDef):
                    p.blocked.update(id(s) for s in fn.node.body.body if isinstance(s, cst.FunctionDef))

    def _device_param(self, func: cst.FunctionDef, fn) -> Optional[cst.Param]:
        f = self.f
        for param in [*func.params.params, *func.params.kwonly_params]:
            if DEVICE in f.kinds.get((func, param.name.value), set()) and param.default is None:
                if any(p.name.value == NAME for p in func.params.params):
                    return None
                return param
        return None

    def _device_attr(self, cls: cst.ClassDef, param: cst.Param) -> Optional[str]:
        f = self.f
        init = init_of(cls)
        for node in m.findall(init, m.Assign(targets=[m.AssignTarget(m.Attribute(m.Name("self")))],
                                             value=m.Name(param.name.value))):
            return code(node.targets[0].target)
        return None

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
            built = [b.stmt for b in f.models if f.same_object(b.key, model_key)
                     and f.function(b.stmt) is f.function(opts[0].stmt)]
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
                                       self._forward_methods(model_key), otherwise=guard))
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

    def _forward_methods(self, model_key: Key) -> list[str]:
        """``model.decode(z)``, ``model.sample(n)``: methods defined in the model's class in this
        file, other than ``forward``, called on the model."""
        f = self.f
        classes = [f.functions[b.call.func.value].node for b in f.bindings_of("module")
                   if f.same_object(b.key, model_key) and b.call is not None
                   and isinstance(b.call.func, cst.Name) and b.call.func.value in f.functions]
        defined = {s.name.value for cls in classes if isinstance(cls, cst.ClassDef)
                   for s in cls.body.body if isinstance(s, cst.FunctionDef)}
        out: list[str] = []
        for call in f.attribute_calls:
            name = call.func.attr.value
            if name in defined and name != "forward" and not name.startswith("__") and name not in out \
                    and f.same_object(f.key_of(call.func.value), model_key):
                out.append(name)
        return out

    # -- fabric.setup_dataloaders(...) --
    def _loaders(self) -> None:
        f, p = self.f, self.p
        groups: dict[tuple[int, bool], list[Binding]] = {}
        reductions: list[tuple[cst.For, str, list[tuple[str, bool]]]] = []
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
            evaluation = loader_role(f, loader) == EVAL
            if evaluation and self.o.shard_eval and self.o.many_devices:
                sums = eval_sums(f, loader)
                if sums.problem is None:
                    evaluation = False  # sharded: its sums are reduced after its loops
                    for loop, names in sums.reductions:
                        reductions.append((loop, p.ref_at(f, loop) or ref, names))
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
        p.reductions = [(loop, ref, names) for loop, ref, names in reductions
                        if f.key_of(unwrap_iter(loop.iter)) in set_up or any(
                            f.same_object(f.key_of(unwrap_iter(loop.iter)), key) for key in set_up)]

    # -- devices: moves, uses, threading --
    def _set_up(self, key: Optional[Key], kind: str) -> bool:
        f = self.f
        if key is None or kind not in f.kinds.get(key, set()):
            return False
        if kind == MODEL:
            return any(f.same_object(key, k) for k in self.p.setup_model_keys)
        return any(f.same_object(key, b.key) for group in self.p.loader_groups for b in group.loaders)

    def _batch_moves(self) -> set[int]:
        """ids of device moves whose receiver is a batch from a loader that Fabric set up."""
        f = self.f
        out: set[int] = set()
        for loop in for_loops(f):
            source = unwrap_iter(loop.iter)
            if not self._set_up(f.key_of(source), LOADER):
                continue
            names = {n.value for n in m.findall(loop.target, m.Name())}
            for node in loop.body.body:  # names unpacked from a batch are batches too
                if m.matches(node, m.SimpleStatementLine(body=[m.Assign()])):
                    assign = node.body[0]
                    roots = {root_of(e).value for e in m.findall(assign.value, m.Name())
                             if isinstance(root_of(e), cst.Name)}
                    if roots and roots <= names and not m.findall(assign.value, m.Call()):
                        for t in assign.targets:
                            names |= {n.value for n in m.findall(t.target, m.Name())}
            for move in f.device_moves:
                root = root_of(move.receiver)
                if isinstance(root, cst.Name) and root.value in names and loop in f.ancestors(move.call):
                    out.add(id(move.call))
        return out

    def _unsharded_loops(self) -> None:
        """Training loops over something that is not a loader Fabric sets up: with several
        devices every process would then train on every batch (N times the work, no speed-up),
        so the conversion to several devices is refused; on one device it is said."""
        f, p, o = self.f, self.p, self.o
        if o.many_devices:
            for site in f.backward_sites:
                kept = next((a for a in site.call.args if a.keyword is not None
                             and a.keyword.value == "retain_graph" and code(a.value) != "False"), None)
                loop = next((a for a in f.ancestors(site.call) if isinstance(a, (cst.For, cst.While))), None)
                # another backward after it in the same loop: through the same forward
                again = loop is not None and any(
                    other is not site and f.line(other.call) > f.line(site.call)
                    and loop in f.ancestors(other.call) for other in f.backward_sites)
                if kept is not None and again:
                    # DDP reduces the gradients when a forward's backward ends: a second backward
                    # through the same forward fails ("Expected to mark a variable ready only once")
                    self.refuse(site.call, f"`{short(site.call)}` keeps the graph for another backward "
                                           "through the same forward: DistributedDataParallel reduces "
                                           "once per forward and fails on the second; refused for several "
                                           "devices (--devices 1 converts it; or add the losses and call "
                                           "backward once)")
                    return
        seen: set[int] = set()
        for site in f.backward_sites:
            loop = next((a for a in f.ancestors(site.call) if isinstance(a, cst.For)
                         and not _is_counter(a.iter)), None)
            key = id(loop) if loop is not None else id(site.stmt)
            if key in seen:
                continue
            seen.add(key)
            if loop is None and self._called_from_data_loop(site.function):
                continue  # ``self._run_batch(source, targets)`` in a loop over a sharded loader
            if loop is None:
                if o.many_devices:  # synthetic data, a benchmark: nothing to shard, but say so
                    p.loader_skips.append((site.call, f"`{short(site.call)}` is not in a loop over data: with "
                                                      f"devices={o.effective_devices} every process trains on "
                                                      "whatever it makes itself (the same data, if it is "
                                                      "seeded alike)"))
                continue
            source = unwrap_iter(loop.iter)
            if self._set_up(f.key_of(source), LOADER):
                continue
            if p.ddp is not None and p.ddp.sharded(f, f.key_of(source)) is not None:
                continue  # sharded by its own DistributedSampler
            if o.many_devices:
                self.refuse(loop, f"batches come from `{short(source)}`, which the rewrite can't show to be "
                                  f"a DataLoader it sets up: with devices={o.effective_devices} every process "
                                  "would train on all of them; refused for several devices (--devices 1 "
                                  "converts it; or build the loader where the rewrite can see it)")
                return
            p.loader_skips.append((loop, f"batches come from `{short(source)}`, not from a "
                                         "DataLoader built in this script: they keep their "
                                         "explicit move, and with several devices every "
                                         "process would see all of them (set the loader up "
                                         "with fabric.setup_dataloaders by hand)"))

    def _called_from_data_loop(self, func: Optional[cst.FunctionDef]) -> bool:
        """``func`` (a function of the script, or a method called on ``self``) is called only in
        loops over loaders that are set up or sharded by their own DistributedSampler."""
        f, p = self.f, self.p
        if func is None:
            return False
        fn = f.functions.get(func.name.value)
        if fn is not None and fn.node is func:
            calls = list(fn.calls)
        elif f.enclosing_class(func) is not None:
            calls = [c for c in f.attribute_calls if m.matches(
                c.func, m.Attribute(value=m.Name("self"), attr=m.Name(func.name.value)))]
        else:
            return False
        for call in calls:
            loop = next((a for a in f.ancestors(call) if isinstance(a, cst.For)), None)
            key = f.key_of(unwrap_iter(loop.iter)) if loop is not None else None
            if key is None or not (self._set_up(key, LOADER) or (p.ddp is not None and p.ddp.sharded(f, key))):
                return False
        return bool(calls)

    def _devices(self) -> None:
        f, p = self.f, self.p
        self._unsharded_loops()
        if p.refusal is not None:
            return
        batches = self._batch_moves()
        handled: set[int] = set()  # ids of device Name/Attribute nodes taken care of
        for move in f.device_moves:
            device_node = move.device_arg.value if move.device_arg is not None else None
            is_device_name = device_node is not None and (
                DEVICE in f.kinds_of(device_node)
            )
            literal = move.device_arg is None or is_literal_device(f, device_node)
            if p.ddp is not None and isinstance(device_node, cst.Name):  # ``.to(rank)``: its GPU
                func = f.function(move.call)
                literal = literal or device_node.value in p.ddp.rank_names.get(
                    id(func) if func is not None else None, set())
            # a device the script gets from elsewhere: ``args.device``, ``cfg.device``
            foreign = (not is_device_name and not literal and "device" in code(device_node).lower()
                       and not _follows_a_tensor(device_node))
            if not is_device_name and not literal and not foreign:
                continue  # ``.to(torch.float16)``, ``.to(other_tensor)``: not a move to a device
            ref = p.ref_at(f, move.call)
            is_model = self._set_up(self._moved_key(move), MODEL)
            placed_by_fabric = is_model or id(move.call) in batches
            if foreign and not (move.removable and placed_by_fabric):
                p.move_skips.append((move.call, f"`.to({short(device_node)})` left as is: Fabric "
                                                "does not manage that device; with several devices "
                                                "every process would use it (use fabric.device)"))
                continue
            if move.removable and placed_by_fabric:
                p.moves.append(MoveDecision(move, "remove"))
                if device_node is not None:
                    handled.add(id(device_node))
            elif ref is not None and p.after_creation(f, move.call):
                p.moves.append(MoveDecision(move, "fabric-device", ref))
                if device_node is not None:
                    handled.add(id(device_node))
            else:
                p.move_skips.append((move.call, "`fabric` can't be reached here; the move is kept"))
        self._trivial_statements()
        self._device_names(handled)

    def _moved_key(self, move: DeviceMove) -> Optional[Key]:
        """The object a move moves: ``model`` in ``model.to(d)`` and in ``model = Net().to(d)``."""
        f = self.f
        if isinstance(move.receiver, (cst.Name, cst.Attribute)):
            return f.key_of(move.receiver)
        parent = f.parent(move.call)
        while isinstance(parent, cst.Call) or (isinstance(parent, cst.Attribute) and parent.attr.value != "parameters"):
            parent = f.parent(parent)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            return f.key_of(parent.targets[0].target)
        return None

    def _trivial_statements(self) -> None:
        """Statements that are left doing nothing once their moves are gone: ``model.to(device)``,
        ``x, y = x.to(device), y.to(device)``, ``if use_cuda: model = model.cuda()``."""
        f, p = self.f, self.p
        removed = {id(d.move.call) for d in p.moves if d.action == "remove"}
        if self.o.precision in MIXED_PRECISIONS:  # AR209 removes pure half's casts
            removed |= {id(c) for c in low_casts(f).training if strip_half(c) is c.func.value}
        statements = {id(f.statement(d.move.call)): f.statement(d.move.call)
                      for d in p.moves if d.action == "remove"}
        for s in statements.values():
            if not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1:
                continue
            stripped = s.body[0].visit(_StripMoves(removed))
            if isinstance(stripped, cst.Expr) and not m.findall(stripped, m.Call()):
                p.trivial_stmts.append(s)
            elif isinstance(stripped, cst.Assign) and len(stripped.targets) == 1 and (
                code(stripped.targets[0].target) == code(stripped.value)
            ):
                p.trivial_stmts.append(s)

    def _device_names(self, handled: set[int]) -> None:
        f, p = self.f, self.p
        device_keys = [k for k, kinds in f.kinds.items() if DEVICE in kinds]
        for key in device_keys:
            for node in f.references(key):
                if id(node) in handled:
                    continue
                new = self._device_use(node)
                if new is None:
                    p.device_keeps.append((node, f"`{short(node)}` is still used here as it was "
                                                 f"(`{short(f.statement(node))}`); its definition stays"))
                elif new != "":
                    p.device_uses.append((node, new))
        kept_keys = {f.key_of(n) for n, _ in p.device_keeps}
        for b in f.device_defs:
            if b.key in kept_keys or any(f.key_of(n) == b.key for n, _ in p.device_keeps):
                continue
            s = b.stmt
            if m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())])])):
                p.removed_device_defs.append(b)
        if p.anchor is not None and any(b.stmt is p.anchor for b in p.removed_device_defs):
            p.replaces_anchor = True

    def _device_use(self, node: cst.CSTNode) -> Optional[str]:
        """What a read of the device becomes: new code, "" when handled elsewhere, None: kept."""
        f, p = self.f, self.p
        parent = f.parent(node)
        ref = p.ref_at(f, node)
        if ref is None or not p.after_creation(f, node):
            return None
        if isinstance(parent, cst.Arg) and parent.value is node:
            call = f.parent(parent)
            target = _called_function(f, call)
            if target is not None:
                func = target if isinstance(target, cst.FunctionDef) else init_of(target)
                param = p.threaded_params.get(id(func)) if func is not None else None
                if param is not None and _arg_param(f, target, call, parent) is param:
                    p.thread_args.append((parent, ref))
                    return ""
            if parent.keyword is not None and parent.keyword.value in ("device", "map_location"):
                return f"{ref}.device"
            if parent.keyword is None and f.qualname(call) == "builtins.print":
                return f"{ref}.device"
            return None
        if isinstance(parent, cst.Assign) and parent.value is node:
            # ``self.device = device`` in a threaded __init__
            target = parent.targets[0].target
            cls_key = f.key_of(target) if isinstance(target, cst.Attribute) else None
            if cls_key is not None and p.threaded_attrs.get(id(cls_key[0])) == code(target):
                return ""
            return None
        if isinstance(parent, cst.Attribute) and parent.value is node and parent.attr.value in ("type", "index"):
            return f"{ref}.device"
        if isinstance(parent, cst.FormattedStringExpression):
            return f"{ref}.device"
        return None


def _over_tensors(opt: Optimizer) -> bool:
    """``LBFGS([input_img])``, ``Adam([z, w])``: a list of names or attributes, no ``parameters()``."""
    if opt.call is None or not opt.call.args or opt.call.args[0].keyword is not None:
        return False
    params = opt.call.args[0].value
    return isinstance(params, (cst.List, cst.Tuple)) and bool(params.elements) and all(
        isinstance(e, cst.Element) and isinstance(e.value, (cst.Name, cst.Attribute)) for e in params.elements)


def _is_counter(source: cst.BaseExpression) -> bool:
    """``range(epochs)``, ``enumerate(range(n))``, ``itertools.count()``: not data."""
    source = unwrap_iter(source)
    return m.matches(source, m.Call(func=m.Name("range") | m.Attribute(attr=m.Name("count"))))


class _StripMoves(cst.CSTTransformer):
    def __init__(self, removed: set[int]) -> None:
        super().__init__()
        self.removed = removed

    def on_leave(self, original, updated):  # type: ignore[override]
        if id(original) in self.removed:
            return updated.func.value
        return updated


def common_after(facts: ScriptFacts, stmts: list[cst.BaseStatement]) -> Optional[cst.BaseStatement]:
    """The statement after which all of ``stmts`` have run: in the innermost block that holds
    them all (within one function), the last statement that holds one of them."""
    found = _in_common_block(facts, stmts)
    return found[-1] if found else None


def first_in_common_block(facts: ScriptFacts, stmts: list[cst.BaseStatement]) -> Optional[cst.BaseStatement]:
    """The place before all of ``stmts``: in the innermost block that holds them all, the first
    statement that holds one of them."""
    found = _in_common_block(facts, stmts)
    return found[0] if found else None


def _in_common_block(facts: ScriptFacts, stmts: list[cst.BaseStatement]) -> list[cst.BaseStatement]:
    """The statements of the innermost block holding all of ``stmts`` that hold one of them,
    in block order; empty when they share no block within one function."""
    placements = [_placements(facts, s) for s in stmts]
    for block, _ in placements[0] if placements else ():
        found = []
        for chain in placements:
            hit = [s for b, s in chain if b is block]
            if not hit:
                break
            found.append(hit[0])
        else:
            order = list(block.body)
            return sorted(set(found), key=order.index)
    return []


def _placements(facts: ScriptFacts, s: cst.BaseStatement) -> list[tuple[cst.CSTNode, cst.BaseStatement]]:
    """(block, statement in that block) from ``s`` outwards, not leaving its function."""
    out = []
    current: Optional[cst.BaseStatement] = s
    while current is not None:
        block = facts.block(current)
        out.append((block, current))
        if isinstance(block, cst.Module):
            break
        current = None
        for parent in facts.ancestors(block):
            if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return out
            if isinstance(parent, cst.BaseStatement) and isinstance(
                facts.parent(parent), (cst.Module, cst.IndentedBlock)
            ):
                current = parent
                break
    return out


def _called_function(facts: ScriptFacts, call: cst.CSTNode):
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name):
        return None
    fn = facts.functions.get(call.func.value)
    if fn is None or call not in fn.calls:
        return None
    return fn.node


def _arg_param(facts: ScriptFacts, target, call: cst.Call, arg: cst.Arg) -> Optional[cst.Param]:
    return param_for(positional_params(target), target, arg, list(call.args).index(arg))


#: names of the objects a script keeps its settings on: ``args.device`` is a choice made
#: elsewhere, ``x.device`` (an input's, a parameter's) follows a tensor
_SETTINGS = re.compile(r"\b(args|cfg|config|conf|opt|opts|options|hparams|hp|params|flags|settings)\b", re.I)


def _follows_a_tensor(node: cst.BaseExpression) -> bool:
    """``x.device``, ``next(model.parameters()).device``: the device of a tensor or module,
    which follows wherever Fabric put it."""
    return (isinstance(node, cst.Attribute) and node.attr.value == "device"
            and not _SETTINGS.search(code(node.value)))

