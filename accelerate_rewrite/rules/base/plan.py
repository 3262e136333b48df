"""The Fabric conversion plan: the decisions that the Fabric rules share, made once per file.

Where ``fabric`` is created, in which functions it can be reached and under what name
(``fabric``, a ``device`` parameter that becomes ``fabric``, ``self.fabric``), which models,
optimizers and loaders are set up, which batches therefore need no ``.to(device)``, and what
becomes of every use of the device. The rules (AR101-AR111) turn these decisions into edits;
none of them decides alone, so they agree with each other by construction.

This module holds the plan (``FabricPlan``), what the rules import, and ``plan()``. The plan is
made in rules/fabric/_plan.py, with parts of its own: rules/fabric/_home.py (where Fabric is
created), rules/fabric/_setups.py (the set-ups), rules/fabric/_loaders.py (which loaders),
rules/fabric/_reach.py (where ``fabric`` is reached) and rules/fabric/_devices.py (what
becomes of the device, which loops are sharded).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import (
    Binding,
    DeviceMove,
    Key,
    Optimizer,
    ScriptFacts,
    code,  # noqa: F401 (the rules import it from here)
    short,  # noqa: F401
)
from accelerate_rewrite.codemod.ddp.hand import HandDDP
from accelerate_rewrite.codemod.rule import Rule
from accelerate_rewrite.options import Options

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


def expr(text: str) -> cst.BaseExpression:
    return cst.parse_expression(text)


def insert_at_top(edits, func: cst.FunctionDef, new: list[cst.BaseStatement]) -> cst.BaseStatement:
    """``new`` at the top of ``func``'s body, after its docstring; the first statement's leading
    lines (a comment on top of the body) go above the new ones. Returns the statement they precede."""
    body = list(func.body.body)
    first = next((s for s in body if not m.matches(
        s, m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]))), body[0])
    if first is body[0]:
        new = [new[0].with_changes(leading_lines=first.leading_lines), *new[1:]]
        edits.replace(first, lambda u: u.with_changes(leading_lines=[]))
    edits.insert_before(first, *new)
    return first


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
    #: one of several models that an optimizer trains together (``Adam(chain(G_AB.parameters(),
    #: G_BA.parameters()))``): each model is set up alone (``fabric.setup_module``), then the
    #: optimizers of them all (``fabric.setup_optimizers``), after ``after``, which the groups of
    #: those models share
    joint: bool = False


@dataclass
class LoaderGroup:
    """One ``fabric.setup_dataloaders(...)`` call, right after ``after``."""

    loaders: list[Binding]
    after: cst.BaseStatement
    ref: str
    #: evaluation loaders (codemod/analysis/loops.py): every process iterates all of them
    #: (``use_distributed_sampler=False``), so the metrics the script computes stay whole
    evaluation: bool = False
    #: --backend accelerate on several processes: loaders whose own DistributedSampler shards
    #: them already, which Accelerate's ``prepare`` would shard again (Fabric leaves such a
    #: sampler in place): set up whole (``use_distributed_sampler=False``), on their sampler
    own_sampler: bool = False
    #: --backend accelerate on several processes: set up right before this line, the loaders'
    #: first read, not where they are built (rules/fabric/_loaders.py ``_before_first_read``)
    late: Optional[int] = None


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
    #: after each evaluation loop over a sharded loader (--shard-eval, or a training loader the
    #: script also evaluates on), and each training loop whose sums are read after it, the sums
    #: it accumulates are all-reduced: (loop, fabric's name
    #: there, [(name, a Python number, "sum" or "mean")], why the loop is sharded)
    reductions: list[tuple[cst.For, str, list[tuple[str, bool, str]], str]] = field(default_factory=list)
    moves: list[MoveDecision] = field(default_factory=list)
    move_skips: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    device_uses: list[tuple[cst.CSTNode, str]] = field(default_factory=list)  # node -> new code
    device_keeps: list[tuple[cst.CSTNode, str]] = field(default_factory=list)
    removed_device_defs: list[Binding] = field(default_factory=list)
    thread_args: list[tuple[cst.Arg, str]] = field(default_factory=list)  # call args -> ref
    trivial_stmts: list[cst.BaseStatement] = field(default_factory=list)
    #: optimizers over tensors, not a model's parameters (``LBFGS([input_img])``): nothing to set up
    tensor_optimizers: list[Optimizer] = field(default_factory=list)
    #: hand-made DDP taken over (codemod/ddp/hand.py); with ``ddp.spawn`` Fabric is created where
    #: ``mp.spawn`` was, and the spawned function receives it
    ddp: Optional[HandDDP] = None
    #: id(FunctionDef or ClassDef) -> a function that gets `fabric` as a new first parameter, a
    #: class whose ``__init__`` gets it after ``self`` and keeps it in ``self.fabric`` (callers pass it)
    added_params: dict[int, Union[cst.FunctionDef, cst.ClassDef]] = field(default_factory=dict)
    #: --backend accelerate on several processes: reads of a set-up model (``model`` in
    #: ``model.state_dict()``) that go through ``unwrap_model`` (rules/fabric/_wrapped.py)
    unwraps: list[cst.CSTNode] = field(default_factory=list)
    #: --backend accelerate: reads of a prepared optimizer's own attributes (SAM's ``optimizer`` in
    #: ``optimizer.first_step()``) that go to ``optimizer.optimizer`` (rules/fabric/_wrapped.py)
    inner_reads: list[cst.CSTNode] = field(default_factory=list)

    def ref_at(self, facts: ScriptFacts, node: cst.CSTNode) -> Optional[str]:
        """How ``fabric`` is spelled where ``node`` stands, or None if it can't be reached."""
        for scope in _scopes_up(facts, node):
            if id(scope) in self.blocked:
                return None
            ref = self.refs.get(id(scope))
            if ref is not None:
                if isinstance(scope, cst.Module) and self.home is not None \
                        and facts.part_of(node) != facts.part_of(self.anchor or node):
                    return None  # a global of the script is no global of another file of the project
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
            return facts.in_order(dict.fromkeys(found))  # in block order: the source's
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


#: names of the objects a script keeps its settings on: ``args.device`` is a choice made
#: elsewhere, ``x.device`` (an input's, a parameter's) follows a tensor


def names_rank(facts: ScriptFacts, p: "FabricPlan", node: cst.CSTNode) -> Optional[str]:
    """The code in ``node`` that names the process's rank (a name that holds it, ``self.rank``,
    a read such as ``dist.get_rank()`` that becomes ``fabric.global_rank``), or None: a print or
    a file of its own per process."""
    if p.ddp is None:
        return None
    # ``args.rank``, ``local_rank``: the script's own names for its place
    def asked(n: cst.CSTNode) -> Optional[cst.CSTNode]:
        """``n`` itself, or the call ``n()`` that asks for the rank (``get_rank()``,
        ``utils.get_rank()``); None when ``n`` is called with arguments."""
        parent = facts.parent(n)
        if isinstance(parent, cst.Call) and parent.func is n:
            return None if parent.args else parent
        return n

    worded = {code(asked(n)) for n in facts.find_in(node, m.Name() | m.Attribute())
              if (n.value if isinstance(n, cst.Name) else n.attr.value).lower().endswith("rank")
              and not (isinstance(facts.parent(n), cst.Attribute) and facts.parent(n).attr is n)
              and asked(n) is not None}
    func = facts.function(node)
    ranks = p.ddp.rank_names.get(id(func) if func is not None else None, set())
    cls = facts.enclosing_class(func) if func is not None else None
    attrs = p.ddp.rank_names.get(id(cls), set()) if cls is not None else set()
    inside = {id(n) for n in facts.find_in(node, m.Call() | m.Subscript() | m.Attribute())}
    named = sorted({n.value for n in facts.find_in(node, m.Name()) if n.value in ranks}
                   | {code(a) for a in facts.find_in(node, m.Attribute()) if code(a) in attrs}
                   | {code(n) for n, attr in p.ddp.reads if id(n) in inside and attr in ("global_rank", "local_rank")}
                   | worded)
    return named[0] if named else None


_RANK_WORDS = ("rank", "is_main", "main_process", "master", "global_zero")


def _tests_rank(test: cst.BaseExpression) -> bool:
    """``test`` holds only on some ranks: it names a rank, and an ``or`` does so on both sides
    (``not args.multiprocessing_distributed or args.rank % ngpus_per_node == 0`` holds on every
    process of a run without the flag)."""
    if isinstance(test, cst.BooleanOperation) and isinstance(test.operator, cst.Or):
        return _tests_rank(test.left) and _tests_rank(test.right)
    return any(w in code(test).lower() for w in _RANK_WORDS)


def rank_guard(f, node):
    """The ``if`` around ``node`` (within its function) that tests a rank, if any."""
    for parent in f.ancestors(node):
        if isinstance(parent, (cst.If, cst.IfExp)) and _tests_rank(parent.test):
            return parent
        if isinstance(parent, cst.FunctionDef):
            return None
    return None
