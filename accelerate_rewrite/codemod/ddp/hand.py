"""Hand-made distributed training: what a script does to start and run its own processes.

Two launch styles are understood:

- **spawn**: ``mp.spawn(worker, args=(...), nprocs=n)`` starts ``n`` processes that each run
  ``worker(rank, *args)``; the worker joins the process group (``init_process_group``, in
  itself or in a helper it calls) and builds the model;
- **torchrun**: the script is started once per process by ``torchrun`` (or another launcher)
  and reads its place from the environment (``int(os.environ["LOCAL_RANK"])``, ``RANK``,
  ``WORLD_SIZE``, ``dist.get_rank()``); the function that builds the model joins the group.

For each, the facts here say which statements only serve the hand-made set-up (they go when
Fabric takes over: ``init_process_group``, ``destroy_process_group``, ``torch.cuda.set_device``,
``MASTER_ADDR``/``MASTER_PORT`` set next to the group's start, the helpers left with nothing
else), where ``DistributedDataParallel`` wraps a model (codemod/ddp/wraps.py, with the options
Fabric's strategy takes), which reads of the process's place
become ``fabric.global_rank`` / ``local_rank`` / ``world_size`` (codemod/ddp/places.py, with
the names that hold the rank), which collectives become
Fabric's, and which loaders already shard their data with a ``DistributedSampler``
(codemod/ddp/loaders.py, with when Fabric can set such a loader up).
What can't be converted is a ``problem`` (node, why): custom process groups, RPC, pipeline or
tensor parallelism, ``DDP(..., process_group=...)``, a worker the rewrite can't see.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.ddp.loaders import ShardedLoader, sharded_loaders
from accelerate_rewrite.codemod.ddp.places import MASTER_ENV, env_key, places
from accelerate_rewrite.codemod.ddp.switches import Switches, switches
from accelerate_rewrite.codemod.ddp.wraps import DDP, Wrap, module_uses, take_wrap
from accelerate_rewrite.codemod.analysis.facts import Key, ScriptFacts, code, positional_params, short
from accelerate_rewrite.codemod.analysis.libraries import PROCESS_GROUP_STARTERS, ProcessStarter
from accelerate_rewrite.codemod.analysis.syntax import passed_at
from accelerate_rewrite.codemod.analysis.sampling import DISTRIBUTED_SAMPLERS

INIT = ("torch.distributed.init_process_group", "torch.distributed.distributed_c10d.init_process_group")
DESTROY = ("torch.distributed.destroy_process_group",
           "torch.distributed.distributed_c10d.destroy_process_group")
SET_DEVICE = ("torch.cuda.set_device", "torch.accelerator.set_device_index")
SPAWN = ("torch.multiprocessing.spawn", "torch.multiprocessing.spawn.spawn")
SAMPLERS = DISTRIBUTED_SAMPLERS
BARRIER = ("torch.distributed.barrier", "torch.distributed.distributed_c10d.barrier")
ALL_REDUCE = ("torch.distributed.all_reduce", "torch.distributed.distributed_c10d.all_reduce")
#: what Fabric does not do for a script: a reason to leave the whole conversion
NOT_FABRIC = {
    "torch.distributed.new_group": "a custom process group (new_group)",
    "torch.distributed.new_subgroups": "custom process groups (new_subgroups)",
    "torch.distributed.rpc": "RPC (torch.distributed.rpc)",
    "torch.distributed.pipelining": "pipeline parallelism (torch.distributed.pipelining)",
    "torch.distributed.pipeline": "pipeline parallelism",
    "torch.distributed.tensor": "tensor parallelism (torch.distributed.tensor)",
    "torch.distributed.device_mesh": "a device mesh",
    "torch.distributed.init_device_mesh": "a device mesh",
    "torch.distributed.fsdp": "FSDP by hand",
    "torch.distributed.elastic": "torch.distributed.elastic by hand",
    # improved-diffusion's dist_util.py: mpiexec starts the processes, MPI.COMM_WORLD ranks them
    # (and the data is sharded by that rank); under Fabric's launcher each is rank 0 of 1 to MPI
    "mpi4py": "processes that MPI starts and ranks (mpi4py; under Fabric's launcher each would be "
              "MPI's rank 0 of 1, and shard its data alike)",
    "torch.distributed.launch": "torch.distributed.launch's own API",
}
#: process groups a model may make of its own (iBOT's ``PSyncBatchNorm``: a SyncBatchNorm over
#: groups of ranks), in its methods: the model is built after Fabric starts the default group,
#: which they are made from, and DDP's wrap of the model is Fabric's as it was the script's
MODEL_GROUPS = ("torch.distributed.new_group", "torch.distributed.new_subgroups")


@dataclass
class Spawn:
    """``mp.spawn(worker, args=(...), nprocs=n)``: becomes ``fabric.launch(worker, *args)``."""

    stmt: cst.SimpleStatementLine
    call: cst.Call
    worker: cst.FunctionDef
    rank: cst.Param  # the worker's first parameter: the process's index, given by spawn
    args: list[cst.BaseExpression]
    nprocs: Optional[cst.BaseExpression]
    #: the worker's parameter that receives the same expression as ``nprocs`` (its world size)
    world_param: Optional[cst.Param] = None
    #: ``worker(args.gpu, *args)`` called directly in the other branch of the ``if`` that
    #: spawns it (the ImageNet example's ``else: main_worker(args.gpu, ngpus_per_node, args)``):
    #: Fabric launches it there too
    direct: list[cst.SimpleStatementLine] = field(default_factory=list)
    #: where Fabric is created: the spawn's statement, or that ``if`` when there are direct calls
    where: Optional[cst.BaseStatement] = None
    #: ``nprocs`` may be 0 where the original ran: ``torch.cuda.device_count()`` (0 without
    #: CUDA) with no test of the device around it; ``mp.spawn`` then started nothing, or the
    #: direct call one process, where ``Fabric(devices=0)`` raises
    may_be_zero: bool = False


@dataclass
class HandDDP:
    found: bool = False
    problem: Optional[tuple[Optional[cst.CSTNode], str]] = None
    spawn: Optional[Spawn] = None
    #: the statements that start the hand-made world (the anchor for Fabric comes before them)
    starts: list[cst.BaseStatement] = field(default_factory=list)
    #: a library's call that starts the group and fills a namespace (timm's
    #: ``device = init_distributed_device(args)``): (its statement, the call, what it is), which
    #: becomes the namespace's assignments from Fabric
    started_by: list[tuple[cst.SimpleStatementLine, cst.Call, ProcessStarter]] = field(default_factory=list)
    removed: list[cst.BaseStatement] = field(default_factory=list)
    #: helpers left with nothing to do: they go, with the statements that call them
    removed_functions: list[cst.FunctionDef] = field(default_factory=list)
    wraps: list[Wrap] = field(default_factory=list)
    #: DistributedDataParallel's own options, as written (``broadcast_buffers=False``): Fabric's
    #: ``strategy=DDPStrategy(...)`` takes them (``strategy``)
    ddp_options: dict[str, str] = field(default_factory=dict)
    #: the names those options read (``args`` of ``not args.no_ddp_bb``): they must be bound
    #: where Fabric is created
    option_names: list[cst.Name] = field(default_factory=list)

    @property
    def strategy(self) -> Optional[str]:
        """The strategy Fabric needs for the script's DDP options: None for none,
        "ddp_find_unused_parameters_true" for that one alone, else ``DDPStrategy(...)`` (code)."""
        options = {k: v for k, v in self.ddp_options.items() if (k, v) != ("find_unused_parameters", "False")}
        if not options:
            return None
        if options == {"find_unused_parameters": "True"}:
            return "ddp_find_unused_parameters_true"
        return "DDPStrategy(" + ", ".join(f"{k}={v}" for k, v in options.items()) + ")"
    reads: list[tuple[cst.CSTNode, str]] = field(default_factory=list)  # node -> fabric attribute
    #: ``"RANK" in os.environ``: (the test, whether it asks for several processes)
    env_tests: list[tuple[cst.BaseExpression, bool]] = field(default_factory=list)
    barriers: list[cst.Call] = field(default_factory=list)
    reductions: list[tuple[cst.SimpleStatementLine, cst.BaseExpression, str]] = field(default_factory=list)
    kept: list[cst.Call] = field(default_factory=list)  # other torch.distributed calls
    loaders: list[ShardedLoader] = field(default_factory=list)
    module_uses: list[cst.Attribute] = field(default_factory=list)  # ``ddp_model.module``
    #: ``model.module`` right after a removed ``model = DDP(model)``: the module itself, ``model``
    unwrapped_uses: list[cst.Attribute] = field(default_factory=list)
    #: names that hold the process's rank, by the function they are in (None: module level)
    rank_names: dict[Optional[int], set[str]] = field(default_factory=dict)
    #: the world size read from the environment (torchrun style): Fabric's devices follow it
    env_world: bool = False
    #: the device a process computes from its rank (``f'cuda:{ddp_local_rank}'``): (value, as text)
    process_devices: list[tuple[cst.BaseExpression, bool]] = field(default_factory=list)
    #: what a spawned worker decides "distributed, which rank, which GPU" from (codemod/ddp/switches.py)
    switches: Switches = field(default_factory=Switches)

    def sharded(self, f: ScriptFacts, key: Optional[Key]) -> Optional[ShardedLoader]:
        return next((s for s in self.loaders if f.same_object(s.loader.key, key)), None)


def hand_ddp(f: ScriptFacts) -> HandDDP:
    return f.memo("hand-ddp", lambda: _Finder(f).run())


class _Finder:
    def __init__(self, f: ScriptFacts) -> None:
        self.f = f
        self.d = HandDDP()

    def problem(self, node: Optional[cst.CSTNode], why: str) -> HandDDP:
        if self.d.problem is None:
            self.d.problem = (node, why)
        return self.d

    def run(self) -> HandDDP:
        f, d = self.f, self.d
        calls = {name: [c.call for c in f.calls if c.qualname in quals or c.names & set(quals)]
                 for name, quals in (("init", INIT), ("spawn", SPAWN), ("ddp", DDP), ("sampler", SAMPLERS),
                                     ("destroy", DESTROY))}
        starters = [c for c in f.calls if c.qualname in PROCESS_GROUP_STARTERS]
        d.found = bool(f.hand_ddp()) or bool(starters)
        if not d.found:
            return d
        for node, qual in f.qualified_refs:
            if qual in MODEL_GROUPS and f.model_class_of(node) is not None:
                continue
            for prefix, what in NOT_FABRIC.items():
                if qual == prefix or qual.startswith(prefix + "."):
                    return self.problem(node, f"{what}: Fabric's strategies don't take it over")
        for call in calls["ddp"]:
            if any(a.keyword is not None and a.keyword.value == "process_group" for a in call.args):
                return self.problem(call, "`DistributedDataParallel(..., process_group=...)`: a custom "
                                          "process group, which Fabric's strategies don't take")
        for site in starters:
            if not self._started_by(site.call, PROCESS_GROUP_STARTERS[site.qualname]):
                return d
        if not calls["init"] and not starters:
            node = next(iter(c for cs in calls.values() for c in cs))
            return self.problem(node, "no `init_process_group` in this file: the processes are started "
                                      "somewhere the rewrite can't see")
        if len(calls["spawn"]) > 1:
            return self.problem(calls["spawn"][1], "several `mp.spawn` calls")
        if calls["spawn"] and not self._spawn(calls["spawn"][0]):
            return d
        for call in calls["init"]:
            if not self._removable(call):
                return d
        for call in [*calls["destroy"], *f.calls_named(*SET_DEVICE)]:
            if not self._removable(call):
                return d
        for call in calls["ddp"]:
            if not take_wrap(self.f, self.d, self.problem, call):
                return d
        places(self.f, self.d, self.problem)
        if d.problem:
            return d
        self._collectives()
        if d.problem:
            return d
        self._helpers()
        if d.spawn is not None:
            d.switches = switches(f, d, d.spawn.worker, d.spawn.rank)
        self.d.loaders.extend(sharded_loaders(self.f, calls["sampler"]))
        module_uses(self.f, self.d)
        return d

    # -- the launch --
    def _spawn(self, call: cst.Call) -> bool:
        f, d = self.f, self.d
        stmt = f.statement(call)
        if not _alone(stmt, call):
            return not self.problem(call, "`mp.spawn(...)` is part of a larger statement")
        if not call.args or call.args[0].keyword is not None or not isinstance(call.args[0].value, cst.Name):
            return not self.problem(call, "`mp.spawn(...)` without the spawned function as its first argument")
        name = call.args[0].value.value
        fn = f.functions.get(name)
        if fn is None or not isinstance(fn.node, cst.FunctionDef) \
                or f.key_of(call.args[0].value) != (f.module, name):
            return not self.problem(call, f"`mp.spawn({name}, ...)`: `{name}` is not a function defined at the "
                                          "top of this file (a parameter, an import)")
        worker = fn.node
        params = positional_params(worker)
        if not params or worker.params.star_arg not in (None, cst.MaybeSentinel.DEFAULT) \
                and not isinstance(worker.params.star_arg, cst.ParamStar):
            return not self.problem(worker, f"`{name}` takes its arguments in a way the rewrite can't follow")
        args: list[cst.BaseExpression] = []
        nprocs: Optional[cst.BaseExpression] = None
        for position, arg in enumerate(call.args[1:]):
            # spawn(fn, args=(), nprocs=1, join=True, ...): positional as the keywords
            key = arg.keyword.value if arg.keyword is not None else (
                ("args", "nprocs", "join")[position] if position < 3 else None)
            if key == "args" and isinstance(arg.value, cst.Tuple) \
                    and all(isinstance(e, cst.Element) and not isinstance(e, cst.StarredElement)
                            for e in arg.value.elements):
                args = [e.value for e in arg.value.elements]
            elif key == "nprocs":
                nprocs = arg.value
            elif key == "join" and m.matches(arg.value, m.Name("True")):
                continue
            else:
                return not self.problem(call, f"`mp.spawn(..., {code(arg).strip(', ')})`: only `args=(...)`, "
                                              "`nprocs=` and `join=True` are converted")
        direct = self._direct_calls(stmt, name, args)
        if len(args) + 1 > len(params) or direct is None or \
                any(use is not call.args[0].value for use in f.functions[name].other_uses):
            return not self.problem(call, f"`{name}` is used elsewhere too, or takes fewer arguments than "
                                          "spawn gives it")
        world_param = None
        if nprocs is not None:
            for index, a in enumerate(args):
                if code(a) == code(nprocs):
                    world_param = params[index + 1]
        where = f.parent(f.block(stmt)) if direct else stmt
        while direct and isinstance(f.parent(where), cst.If) and where is f.parent(where).orelse:
            where = f.parent(where)  # ``elif``: the whole ``if`` statement
        d.spawn = Spawn(stmt, call, worker, params[0], args, nprocs, world_param, direct, where,
                        nprocs is not None and _counts_devices(f, nprocs))
        d.rank_names.setdefault(id(worker), set()).add(params[0].name.value)
        return True

    def _direct_calls(self, spawned: cst.BaseStatement, name: str,
                      args: list[cst.BaseExpression]) -> Optional[list[cst.SimpleStatementLine]]:
        """The worker's direct calls, each ``worker(x, *args)`` (spawn's arguments, as written)
        alone on its line in another branch of the ``if`` whose branch spawns it; None when it
        is called any other way."""
        f = self.f
        calls = f.functions[name].calls
        if not calls:
            return []
        branch = f.block(spawned)
        owner = f.parent(branch)
        if not isinstance(owner, cst.If) or owner.body is not branch:
            return None
        out = []
        for call in calls:
            stmt = f.statement(call)
            other = f.parent(f.block(stmt))
            if not (_alone(stmt, call) and isinstance(other, cst.Else) and other is owner.orelse
                    and f.block(stmt) is other.body and len(call.args) == len(args) + 1
                    and all(a.keyword is None and not a.star for a in call.args)
                    and [code(a.value) for a in call.args[1:]] == [code(a) for a in args]):
                return None
            out.append(stmt)
        return out

    def _started_by(self, call: cst.Call, starter: ProcessStarter) -> bool:
        """``device = utils.init_distributed_device(args)`` alone on its line, the namespace a
        name or an attribute: it becomes the assignments Fabric's values make."""
        f, d = self.f, self.d
        stmt = f.statement(call)
        filled = passed_at(call, starter.fills.index, starter.fills.keyword)
        single = isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
        small = stmt.body[0] if single else None
        alone = (isinstance(small, cst.Expr) and small.value is call) or (
            isinstance(small, cst.Assign) and small.value is call and len(small.targets) == 1
            and isinstance(small.targets[0].target, (cst.Name, cst.Attribute)))
        if not alone or not isinstance(filled, (cst.Name, cst.Attribute)):
            return not self.problem(call, f"`{short(call)}` starts the process group itself and is part of a "
                                          "larger statement (or fills something other than a name); convert it "
                                          "by hand")
        d.started_by.append((stmt, call, starter))
        d.starts.append(stmt)
        return True

    # -- statements that go --
    def _removable(self, call: cst.Call) -> bool:
        f, d = self.f, self.d
        stmt = f.statement(call)
        if not _alone(stmt, call):
            return not self.problem(call, f"`{short(call)}` is part of a larger statement; convert it by hand")
        if stmt not in d.removed:
            d.removed.append(stmt)
        if f.qualname(call) in INIT:
            d.starts.append(stmt)
        return True

    def _collectives(self) -> None:
        f, d = self.f, self.d
        removed = {id(s) for s in d.removed}
        known = {id(n) for n, _ in d.reads}
        for site in f.calls:
            call, qual = site.call, site.qualname
            if id(f.statement(call)) in removed or id(call) in known or not qual.startswith("torch.distributed."):
                continue
            if qual in INIT + DESTROY + SAMPLERS or qual.startswith("torch.distributed.ReduceOp"):
                continue
            if qual in BARRIER and not call.args:
                d.barriers.append(call)
            elif qual in ALL_REDUCE:
                stmt = f.statement(call)
                target = call.args[0].value if call.args and call.args[0].keyword is None else None
                op = "sum"
                rest = call.args[1:]
                for arg in rest:
                    if arg.keyword is not None and arg.keyword.value == "op" or arg.keyword is None:
                        op = _reduce_op(f, arg.value)
                    else:
                        op = None
                if not _alone(stmt, call) or target is None \
                        or op is None or not isinstance(target, (cst.Name, cst.Attribute, cst.Subscript)):
                    d.kept.append(call)
                    continue
                d.reductions.append((stmt, target, op))
            else:
                d.kept.append(call)

    def _helpers(self) -> None:
        """A function of the script whose body only starts or ends the hand-made world
        (``def setup(rank, world_size): os.environ[...] = ...; init_process_group(...)``)
        goes, with the statements that call it; so do the names and environment variables
        that only fed ``init_process_group`` next to it."""
        f, d = self.f, self.d
        removed = {id(s) for s in d.removed}
        starts = {id(s) for s in d.starts}
        changed = True
        while changed:
            changed = False
            for block in {id(f.block(s)): f.block(s) for s in list(d.removed)}.values():
                body = list(block.body)
                near_start = any(id(s) in starts for s in body)
                for s in body:
                    if id(s) in removed or not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1:
                        continue
                    small = s.body[0]
                    if near_start and self._sets_master(small):
                        d.removed.append(s)
                        removed.add(id(s))
                        changed = True
                    elif isinstance(small, cst.Assign) and len(small.targets) == 1 \
                            and isinstance(small.targets[0].target, cst.Name) and not m.findall(
                                small.value, m.Call(func=~(m.Attribute(attr=m.Name("is_available"))))):
                        name = small.targets[0].target
                        readers = [f.statement(r) for r in f.references(f.key_of(name) or (None, ""))
                                   if r is not name] if f.key_of(name) else []
                        if readers and all(id(r) in removed for r in readers):
                            d.removed.append(s)
                            removed.add(id(s))
                            changed = True
        for block in {id(f.block(s)): f.block(s) for s in list(d.removed)}.values():
            owner = f.parent(block)
            if isinstance(owner, cst.If) and owner.orelse is None and all(id(x) in removed for x in block.body) \
                    and not m.findall(owner.test, m.Call(func=~m.Attribute(attr=m.Name("is_available")))):
                d.removed.append(owner)  # ``if torch.cuda.is_available(): torch.cuda.set_device(...)``
                removed.add(id(owner))
        for name, fn in f.functions.items():
            func = fn.node
            if not isinstance(func, cst.FunctionDef) or not isinstance(func.body, cst.IndentedBlock) \
                    or f.parent(func) is not f.module:
                continue
            body = [s for s in func.body.body if not m.matches(
                s, m.SimpleStatementLine(body=[m.Expr(m.SimpleString() | m.ConcatenatedString())]))]
            if not body or not all(id(s) in removed for s in body) or fn.other_uses:
                continue
            callers = [f.statement(c) for c in fn.calls]
            if not all(m.matches(s, m.SimpleStatementLine(body=[m.Expr(value=m.Call())])) for s in callers):
                continue
            d.removed_functions.append(func)
            for s in callers:
                if id(s) not in removed:
                    d.removed.append(s)
                    removed.add(id(s))
            # a start inside the helper starts the world where the helper is called
            d.starts.extend(s for s, inner in zip(callers, fn.calls) if any(id(x) in starts for x in body))

    def _sets_master(self, small: cst.BaseSmallStatement) -> bool:
        f = self.f
        if isinstance(small, cst.Assign) and len(small.targets) == 1:
            return env_key(f, small.targets[0].target) in MASTER_ENV
        if isinstance(small, cst.Expr) and isinstance(small.value, cst.Call):
            call = small.value
            return (isinstance(call.func, cst.Attribute) and call.func.attr.value == "setdefault"
                    and f.qualname(call.func.value) == "os.environ" and bool(call.args)
                    and isinstance(call.args[0].value, cst.SimpleString)
                    and call.args[0].value.evaluated_value in MASTER_ENV)
        return False


def _counts_devices(f: ScriptFacts, value: cst.BaseExpression) -> bool:
    """``torch.cuda.device_count()``, or a name assigned it, where no ``if`` around it tests the
    device (``torch.cuda.is_available()``, ``device.type == "cuda"``): 0 on a machine without CUDA."""
    values = [value] if not isinstance(value, cst.Name) else [v for _, v in f.assignments(value) if v is not None]
    for v in values:
        if not (isinstance(v, cst.Call) and isinstance(v.func, cst.Attribute) and v.func.attr.value == "device_count"):
            continue
        tests = [a.test for a in f.ancestors(v) if isinstance(a, cst.If)]
        if not any(m.findall(t, m.Attribute(attr=m.Name("is_available") | m.Name("type"))) for t in tests):
            return True
    return False


def _alone(stmt: cst.BaseStatement, call: cst.Call) -> bool:
    """``stmt`` is the call and nothing else."""
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Expr) and stmt.body[0].value is call)


def _reduce_op(f: ScriptFacts, op: cst.BaseExpression) -> Optional[str]:
    qual = f.qualname(op) or ""
    if qual.endswith("ReduceOp.SUM"):
        return "sum"
    if qual.endswith(("ReduceOp.MAX", "ReduceOp.MIN", "ReduceOp.PRODUCT")):
        return code(op)
    return None
