from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.ddp.hand import DESTROY
from accelerate_rewrite.codemod.ddp.places import PLACE_CALLS, strict_env_read
from accelerate_rewrite.codemod.ddp.wraps import repeated_assignment
from accelerate_rewrite.codemod.analysis.facts import code
from accelerate_rewrite.codemod.analysis.syntax import passed_at
from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.plan import NAME, FabricRule, core_except, expr, insert_at_top, short, stmt
from accelerate_rewrite.rules.fabric._plan import plan

#: the imports the hand-made set-up needed, dropped when the result no longer reads them
_IMPORTS = (
    ("torch.distributed", None),
    ("torch.distributed", "init_process_group"),
    ("torch.distributed", "destroy_process_group"),
    ("torch.distributed", "barrier"),
    ("torch.distributed", "all_reduce"),
    ("torch.distributed", "get_rank"),
    ("torch.distributed", "get_world_size"),
    ("torch.multiprocessing", None),
    ("torch.nn.parallel", "DistributedDataParallel"),
    ("torch.nn.parallel.distributed", "DistributedDataParallel"),
)


class FabricHandDDP(FabricRule):
    """Hand-made DistributedDataParallel becomes Fabric's: Fabric starts the processes.

    What it does: for scripts launched by `mp.spawn(worker, args=(...), nprocs=n)` or by
    torchrun (the place read from `RANK` / `LOCAL_RANK` / `WORLD_SIZE` or `dist.get_rank()`):
    - `dist.init_process_group(...)`, `dist.destroy_process_group()` and
      `torch.cuda.set_device(...)` go, with the `MASTER_ADDR` / `MASTER_PORT` set next to the
      group's start and the helpers (`setup(rank, world_size)`, `cleanup()`) left with nothing
      else to do, and the lines that call them;
    - `model = DDP(model, device_ids=[rank])` goes (`ddp_model = DDP(model)` becomes
      `ddp_model = model`): `fabric.setup` wraps the model in DDP itself;
      `find_unused_parameters=True` becomes `strategy="ddp_find_unused_parameters_true"`, other
      literal options `strategy=DDPStrategy(...)` (only with several processes: on one device
      a DDP strategy would swap the script's RandomSampler);
    - `mp.spawn(worker, args=(a, b), nprocs=n)` becomes `fabric = Fabric(devices=n, ...)` and
      `fabric.launch(worker, a, b)`; the worker's first parameter (the process index) becomes
      `fabric`, and the index is read back from it (`rank = fabric.local_rank`); the ImageNet
      example's `else: main_worker(args.gpu, ngpus_per_node, args)` beside the spawn becomes the
      same `fabric.launch(...)` (Fabric is created before that `if`);
    - torchrun scripts create Fabric where the process group started, with
      `devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1))` (the processes torchrun starts on
      this node; 1 under plain `python`);
    - `int(os.environ["RANK"])` / `dist.get_rank()` -> `fabric.global_rank`, `LOCAL_RANK` ->
      `fabric.local_rank`, `WORLD_SIZE` / `dist.get_world_size()` -> `fabric.world_size`
      (`int(os.environ.get("LOCAL_RANK", -1))` -> `(fabric.local_rank if fabric.world_size > 1
      else -1)`, and a `--local_rank` argument with default -1 is read back from Fabric after its
      lines: -1 still means one process wherever the script tests it); a
      function of the script that reads them (`rank, device = setup()`) and is called only
      where `fabric` exists receives it as a new first parameter;
      `dist.barrier()` -> `fabric.barrier()`, `dist.all_reduce(t)` ->
      `t = fabric.all_reduce(t, reduce_op="sum")`;
    - where the spawned worker decides from its own flags (the ImageNet example:
      `args.distributed = args.world_size > 1 or args.multiprocessing_distributed`), the flag
      its process group starts under is read back as `fabric.world_size > 1`, the group's
      `init_process_group(..., world_size=args.world_size, rank=args.rank)` becomes
      `args.world_size, args.rank = fabric.world_size, fabric.global_rank` (the statements that
      only computed them go), and the spawn index, where the script tests it against None, is
      `fabric.device.index` on CUDA and None elsewhere;
    - a library's call that starts the group and fills a namespace (timm's `device =
      utils.init_distributed_device(args)`) becomes the values it sets, from Fabric
      (`args.world_size = fabric.world_size`, ..., `device = fabric.device`);
    - the device a process computes from its rank (`f'cuda:{ddp_local_rank}'`,
      `torch.device("cuda", local_rank)`) becomes `str(fabric.device)` / `fabric.device`;
    - a loader with a `DistributedSampler` of its own keeps it: set up with Fabric when its
      `sampler.set_epoch(epoch)` counts epochs as Fabric does (once a loop, from 0), otherwise
      left as it is (already sharded), its batches moved to `fabric.device`.
    `--devices N` overrides the script's world size; a world size that counts CUDA devices with
    no test of the device around it (`torch.cuda.device_count()`, 0 on a CPU) is `max(n, 1)`.

    Why: Fabric's DDP is the same DistributedDataParallel, and with it the precision,
    strategy (FSDP, DeepSpeed) and device options of the other rules apply to the script.

    Kind: safe at 32-true: each rank trains on the batches it trained on before (tested with 2
    gloo processes, rank by rank).

    Leaves alone (and says why): custom process groups (not those a model makes of its own in
    its methods, iBOT's SyncBatchNorm over groups of ranks), RPC, pipeline or tensor parallelism,
    `DDP(..., process_group=...)` or other DDP options; a spawned function that is a parameter
    or an import; a read of the rank where `fabric` can't be reached (in a helper called before
    the model is built); `torch.distributed` calls other than these stay as they are (Fabric
    starts the process group they need with several devices).
    """

    code = "AR111"
    name = "fabric-hand-ddp"
    kind = Kind.SAFE
    requires = core_except("AR111")
    examples = (Example.from_files("AR111"),)

    @staticmethod
    def _started_by(ctx: RuleContext, p, s: cst.SimpleStatementLine, call: cst.Call, starter) -> None:
        f = ctx.facts
        ref = p.ref_at(f, s)
        small = s.body[0]
        target = code(small.targets[0].target) if isinstance(small, cst.Assign) else None
        filled = code(passed_at(call, starter.fills.index, starter.fills.keyword))
        lines = _started_by_lines(ref, filled, starter, target)
        ctx.edits.replace(s, lambda u, first=lines[0]: stmt(first).with_changes(leading_lines=u.leading_lines))
        ctx.edits.insert_after(s, *(stmt(line) for line in lines[1:]))
        ctx.change(s, f"`{short(call)}` (it starts the process group) became the values it sets, from Fabric "
                      f"(`{filled}.world_size = {ref}.world_size`, ...): Fabric starts the processes")

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        p = plan(f, o)
        d = p.ddp
        if p.refusal is not None or d is None:
            return
        for func in d.removed_functions:
            ctx.edits.remove(func)
            ctx.change(func, f"removed `{func.name.value}()`: it only started or ended the hand-made "
                             "process group, which Fabric starts")
        removed_funcs = {id(x) for x in d.removed_functions}
        wrapped = {id(w.stmt) for w in d.wraps}
        ending = _ends_the_group(f, d) if o.accelerate else set()
        sw = d.switches
        group = self._group(ctx, p) if sw.group is not None else False
        for s in d.removed:
            if any(id(a) in removed_funcs for a in f.ancestors(s)):
                continue
            if group and s is sw.group:
                continue
            ref = p.ref_at(f, s) if id(s) in ending else None
            if ref is not None and p.after_creation(f, s):
                # Accelerate leaves the process group to the script: ``end_training()`` destroys it
                # (without it gloo's threads can abort the exit: measured, accelerate 1.15)
                ctx.edits.replace(s, lambda u, r=ref: stmt(f"{r}.end_training()\n"))
                ctx.change(s, f"`{short(s)}` became `{ref}.end_training()`: it destroys the process group")
                continue
            ctx.edits.remove(s)
            ctx.change(s, f"removed `{short(s)}`: " + ("fabric.setup wraps the model in DistributedDataParallel"
                                                      if id(s) in wrapped else
                                                      "Fabric starts and ends the processes"))
        for s, call, starter in d.started_by:
            self._started_by(ctx, p, s, call, starter)
        for wrap in d.wraps:
            if wrap.rebinds:
                continue  # ``model = DDP(model)`` goes with the removals
            earlier = repeated_assignment(f, wrap.call, {id(s) for s in d.removed})
            if earlier is not None:  # ``net = ssd_net`` then ``net = DataParallel(ssd_net)``
                ctx.edits.remove(f.statement(wrap.call))
                ctx.change(wrap.call, f"removed `{short(f.statement(wrap.call))}`: fabric.setup wraps the model "
                                      f"in DistributedDataParallel, and without the wrap it would repeat "
                                      f"`{short(earlier)}` (line {f.line(earlier)})")
                continue
            ctx.edits.replace(wrap.call, lambda u: u.args[0].value)
            ctx.change(wrap.call, f"`{short(wrap.call)}` became `{code(wrap.inner)}`: fabric.setup wraps "
                                  "the model in DistributedDataParallel")
        for node, attr in d.reads:
            if group and any(f.inside(node, st) for st in sw.stores):
                continue  # it goes with the statement that computed the rank
            ref = p.ref_at(f, node)
            if ref is None or not p.after_creation(f, node):  # the plan keeps only those that work
                if f.qualname(node) in PLACE_CALLS:
                    ctx.skip(node, f"`{short(node)}` kept: `fabric` can't be reached here (it works: Fabric "
                                   "starts the process group with several devices)")
                elif strict_env_read(f, node) and not (p.ddp.spawn is not None and f.function(node) is not None
                                                       and f.function(node) is f.function(p.ddp.spawn.stmt)):
                    ctx.skip(node, f"`{short(node)}` kept: `fabric` can't be reached here; it reads the "
                                   "launcher's environment, which torchrun sets for every process (and it fails at "
                                   "start-up, KeyError, where the variable is not set)")
                else:
                    ctx.skip(node, f"`{short(node)}` kept: it reads the launcher's environment before Fabric "
                                   "exists, in the process that launches the others, as before")
                continue
            test = _is_distributed_test(f, node)
            if test is not None:  # ``int(os.environ.get("RANK", -1)) != -1``: "is this a ddp run?"
                comparison, several = test
                new = f"{ref}.world_size {'>' if several else '=='} 1"
                ctx.edits.replace(comparison, expr(new))
                ctx.change(node, f"`{short(comparison)}` (is this a distributed run?) became `{new}`: "
                                 f"under Fabric `{ref}.{attr}` is never -1")
                continue
            if attr != "world_size" and _defaults_to_minus_one(node):
                # ``int(os.environ.get("LOCAL_RANK", -1))``: -1 says "not distributed" wherever the
                # script tests it (``args.local_rank == -1``, ``not in [-1, 0]``)
                new = f"({ref}.{attr} if {ref}.world_size > 1 else -1)"
                ctx.edits.replace(node, expr(new))
                ctx.change(node, f"`{short(node)}` became `{new}`: -1 still says one process, as the "
                                 "script tests it")
                continue
            ctx.edits.replace(node, expr(f"{ref}.{attr}"))
            ctx.change(node, f"`{short(node)}` became `{ref}.{attr}`")
        for test, several in d.env_tests:
            ref = _reached(ctx, p, test, "it reads the launcher's environment where `fabric` can't be reached")
            if ref is None:
                continue
            new = f"{ref}.world_size {'>' if several else '=='} 1"
            ctx.edits.replace(test, expr(new))
            ctx.change(test, f"`{short(test)}` (did a launcher start this process?) became `{new}`: Fabric "
                             "starts the processes")
        for call in d.barriers:
            ref = _reached(ctx, p, call, "`fabric` can't be reached here (it works: Fabric starts the process "
                                         "group with several devices)")
            if ref is None:
                continue
            ctx.edits.replace(call, expr(f"{ref}.barrier()"))
            ctx.change(call, f"`{short(call)}` became `{ref}.barrier()`")
        for s, target, op in d.reductions:
            ref = _reached(ctx, p, s, "`fabric` can't be reached here")
            if ref is None:
                continue
            reduce_op = f'"{op}"' if op == "sum" else op
            new = stmt(f"{code(target)} = {ref}.all_reduce({code(target)}, reduce_op={reduce_op})\n")
            ctx.edits.replace(s, lambda u, new=new: new.with_changes(leading_lines=u.leading_lines))
            ctx.change(s, f"`{short(s)}` became `{short(new)}` (Fabric returns the reduced tensor)")
        for call in d.kept:
            ctx.skip(call, f"`{short(call)}` kept: Fabric starts the process group it needs "
                           "(with several devices)")
        for value, as_text in d.process_devices:
            ref = _reached(ctx, p, value, "`fabric` can't be reached here, and this process's device is Fabric's")
            if ref is None:
                continue
            new_device = f"str({ref}.device)" if as_text else f"{ref}.device"
            ctx.edits.replace(value, expr(new_device))
            ctx.change(value, f"`{short(value)}` became `{new_device}`: the device Fabric gives this process "
                              "(the CPU with --accelerator cpu, where a CUDA device would raise)")
        for loader in d.loaders:
            if loader.set_up:
                ctx.change(loader.loader.stmt, loader.why)
        for use in d.unwrapped_uses:
            if any(use is u for u in p.unwraps):
                continue  # read through ``accelerator.unwrap_model(model)`` (rules/fabric/_wrapped.py): the module
            earlier = repeated_assignment(f, use, {id(s) for s in d.removed})
            if earlier is not None:
                ctx.edits.remove(f.statement(use))
                ctx.change(use, f"removed `{short(f.statement(use))}`: with the DistributedDataParallel wrap gone "
                                f"it would repeat `{short(earlier)}` (line {f.line(earlier)})")
                continue
            ctx.edits.replace(use, lambda u: u.value)
            ctx.change(use, f"`{short(use)}` became `{code(use.value)}`: with the DistributedDataParallel wrap "
                            f"gone, `{code(use.value)}` is the script's own module there")
        for use in d.module_uses:
            ctx.change(use, f"`{short(use)}` keeps working: Fabric's set-up model has `.module` too "
                            "(the script's own module)")
        if d.spawn is not None:
            self._worker(ctx, p)
        else:
            self._local_rank_argument(ctx, p)
        for module, obj in _IMPORTS:
            ctx.edits.remove_import_if_unused(module, obj)

    @staticmethod
    def _local_rank_argument(ctx: RuleContext, p) -> None:
        """``parser.add_argument("--local_rank", type=int, default=-1)``, which
        torch.distributed.launch fills in: under Fabric's own launcher nothing does, so the
        script's tests of it (``args.local_rank == -1``: one process) would hold in every process.
        Right after the Fabric lines, ``args.local_rank = fabric.local_rank if fabric.world_size
        > 1 else -1``: what the launcher would have given, and -1 for one process."""
        f = ctx.facts
        for call in f.attribute_calls:
            if call.func.attr.value != "add_argument" or not call.args \
                    or not m.matches(call.args[0].value, m.SimpleString()) \
                    or call.args[0].value.evaluated_value not in ("--local_rank", "--local-rank"):
                continue
            default = next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "default"), None)
            if default is None or code(default).replace(" ", "") != "-1":
                return  # read from the environment (converted with the reads), or no -1 to keep
            parsed = [a for a in f.find(m.Assign(value=m.Call(func=m.Attribute(attr=m.Name("parse_args")))))
                      if len(a.targets) == 1 and isinstance(a.targets[0].target, cst.Name)]
            if len(parsed) != 1:
                return
            name = parsed[0].targets[0].target
            key = f.key_of(name)
            reads = [r for r in f.find(m.Attribute(value=m.Name(name.value), attr=m.Name("local_rank")))
                     if f.key_of(r.value) == key or f.same_object(f.key_of(r.value), key)]
            if not reads or f.key_for_name(p.anchor, name.value) != key or not p.after_creation(f, p.anchor) \
                    or f.line(parsed[0]) > f.line(p.anchor):
                return
            new = stmt(f"{name.value}.local_rank = {NAME}.local_rank if {NAME}.world_size > 1 else -1\n")
            ctx.edits.insert_before(p.anchor, new)
            ctx.change(p.anchor, f"`{name.value}.local_rank` (-1 by default; torch.distributed.launch filled it in) "
                                 f"is read back from Fabric: `{short(new)}`, so that -1 still means one process")
            return

    @staticmethod
    def _group(ctx: RuleContext, p) -> bool:
        """The spawned worker's ``dist.init_process_group(..., world_size=args.world_size,
        rank=args.rank)`` becomes ``args.world_size, args.rank = fabric.world_size,
        fabric.global_rank`` (codemod/ddp/switches.py): the rank the script computed from its
        own flags and the spawn index is Fabric's; the statements that only computed them go."""
        f, sw = ctx.facts, p.ddp.switches
        ref = p.ref_at(f, sw.group)
        if ref is None or not p.after_creation(f, sw.group):
            return False
        attrs = {id(sw.world): "world_size", id(sw.rank): "global_rank"}
        targets = ", ".join(code(t) for t in sw.targets)
        values = ", ".join(f"{ref}.{attrs[id(t)]}" for t in sw.targets)
        new = stmt(f"{targets} = {values}\n")
        ctx.edits.replace(sw.group, lambda u: new.with_changes(leading_lines=u.leading_lines))
        ctx.change(sw.group, f"`{short(sw.group)}` became `{targets} = {values}`: Fabric starts the process "
                             "group, and what the script gave it is Fabric's")
        for st in sw.stores:
            stored = sorted({code(t.target) for t in f.find_in(st, m.AssignTarget())})
            ctx.edits.remove(st)
            ctx.change(st, f"removed `{short(st)}`: it only computed {', '.join(f'`{s}`' for s in stored)} for "
                           "the process group; Fabric's value is assigned where the group started")
        return True

    @staticmethod
    def _worker(ctx: RuleContext, p) -> None:
        f, o = ctx.facts, ctx.options
        sp = p.ddp.spawn
        worker = sp.worker
        # ``rank: int`` becomes ``fabric``: its annotation was the index's
        ctx.edits.replace(sp.rank, lambda u: u.with_changes(name=cst.Name(NAME), annotation=None))
        ctx.change(worker, f"`{worker.name.value}` receives `{NAME}` where mp.spawn gave it the process "
                           f"index `{sp.rank.name.value}`")
        new: list[cst.BaseStatement] = []
        rank = sp.rank.name.value
        sw = p.ddp.switches
        if any(f.scope(n) is not None and n.value == rank and n is not sp.rank.name
               for n in f.find_in(worker.body, m.Name(rank))):
            # a GPU's index the script tests against None (``args.gpu is not None``): None on a
            # CPU, as the script's own call gave it there
            new.append(stmt(f"{rank} = {NAME}.device.index if {NAME}.device.type == \"cuda\" else None\n"
                            if sw.index_is_gpu else f"{rank} = {NAME}.local_rank\n"))
        if o.devices is not None and sp.world_param is not None:
            # --devices replaces the script's world size: what the worker was told must follow
            new.append(stmt(f"{sp.world_param.name.value} = {NAME}.world_size\n"))
        if sw.flag is not None:
            # the script's own "am I distributed?" (``args.distributed``, from its flags): the
            # processes are Fabric's now, and one process has no group to build a sampler on
            new.append(stmt(f"{code(sw.flag)} = {NAME}.world_size > 1\n"))
        if new:
            first = insert_at_top(ctx.edits, worker, new)
            ctx.change(first, "read back from Fabric: " + ", ".join(f"`{short(s)}`" for s in new))


def _started_by_lines(ref: str, filled: str, starter, target: Optional[str]) -> list[str]:
    """timm's ``device = init_distributed_device(args)`` under Fabric: ``args.world_size =
    fabric.world_size``, ..., ``device = fabric.device``."""
    lines = [f"{filled}.{attr} = {value.format(fabric=ref)}\n" for attr, value in starter.fields]
    if target is not None and starter.returns is not None:
        lines.append(f"{target} = {starter.returns.format(fabric=ref)}\n")
    return lines


def _reached(ctx: RuleContext, p, node: cst.CSTNode, why: str):
    """How `fabric` is spelled at ``node``, or None when it can't be used there (the node is
    then said to be kept, and ``why``)."""
    ref = p.ref_at(ctx.facts, node)
    if ref is None or not p.after_creation(ctx.facts, node):
        ctx.skip(node, f"`{short(node)}` kept: {why}")
        return None
    return ref


def _defaults_to_minus_one(node: cst.CSTNode) -> bool:
    """``int(os.environ.get("LOCAL_RANK", -1))``, ``os.getenv("RANK", "-1")``: a read whose
    default, -1, means the script runs without a launcher."""
    for call in m.findall(node, m.Call(func=m.Attribute(attr=m.Name("get")) | m.Attribute(attr=m.Name("getenv")))):
        if len(call.args) == 2 and code(call.args[1].value).replace(" ", "").strip("'\"") == "-1":
            return True
    return False


def _is_distributed_test(f, node: cst.CSTNode):
    """``<rank read> != -1`` (or ``== -1``, ``> -1``, ``>= 0``, ``< 0``): the script's test of
    whether it runs distributed, by the -1 a launcher-less run reads. (the comparison, whether
    it tests for several processes), or None."""
    parent = f.parent(node)
    if not isinstance(parent, cst.Comparison) or parent.left is not node or len(parent.comparisons) != 1:
        return None
    target = parent.comparisons[0]
    value, op = code(target.comparator).replace(" ", ""), type(target.operator)
    if value == "-1" and op in (cst.NotEqual, cst.GreaterThan, cst.IsNot):
        return parent, True
    if value == "-1" and op in (cst.Equal, cst.Is):
        return parent, False
    if value == "0" and op is cst.GreaterThanEqual:
        return parent, True
    if value == "0" and op is cst.LessThan:
        return parent, False
    return None


def _ends_the_group(f, d) -> set[int]:
    """The removed statements that destroy the process group: ``dist.destroy_process_group()``,
    or a call of a removed function of the script that does (``cleanup()``)."""
    enders = {func.name.value for func in d.removed_functions
              if any(f.qualname(c) in DESTROY for c in f.find_in(func, m.Call()))}
    out: set[int] = set()
    for s in d.removed:
        for call in f.find_in(s, m.Call()):
            if f.qualname(call) in DESTROY or m.matches(call.func, m.Name()) and call.func.value in enders:
                out.add(id(s))
    return out
