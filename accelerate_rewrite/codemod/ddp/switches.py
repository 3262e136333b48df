"""The spawned worker's own distribution switches (codemod/ddp/hand.py's spawn family): what the
ImageNet example's ``main_worker`` computes "am I distributed, which rank, which GPU" from.

That family decides from its own flags: ``args.distributed = args.world_size > 1 or
args.multiprocessing_distributed`` in ``main``, the rank as ``args.rank * ngpus_per_node + gpu``
before ``dist.init_process_group(..., world_size=args.world_size, rank=args.rank)``, and the
spawn index as the GPU (``args.gpu = gpu``, tested ``args.gpu is not None``). Once Fabric
starts the processes (``--devices 2`` and none of those flags, as the example runs on one
GPU), the flags no longer say what runs: ``args.distributed`` stays False, so no
DistributedSampler shards the data and every process trains the whole set; ``args.rank`` stays
-1; and the index Fabric gives back is 0 on a CPU, where the script's own call gave None. What
this module finds, the rule reads back from Fabric:

- ``flag``: the test of the ``if`` the worker joins the group under, a flag of its own
  (``args.distributed``) set before the worker runs: it becomes ``fabric.world_size > 1`` at the
  worker's top (one process: no process group, so no DistributedSampler can be built);
- ``group`` with ``world`` and ``rank``: the group's start, given ``world_size=args.world_size,
  rank=args.rank`` (attributes the rest of the script reads): it becomes those assignments from
  Fabric, and ``stores``, the statements of its block before it that only computed them
  (``if args.multiprocessing_distributed: args.rank = args.rank * ngpus_per_node + gpu``), go;
- ``index_is_gpu``: the spawn index, or an attribute the worker copies it to, is tested against
  None somewhere: it stands for a GPU, and reads back as ``fabric.device.index`` on CUDA and
  None elsewhere (the CPU path stays the CPU path).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Protocol

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts, code
from accelerate_rewrite.codemod.edits.edit_set import only_reads

class Spawned(Protocol):
    """What this module reads of the hand-made DDP found (codemod/ddp/hand.py's HandDDP and its
    Spawn): a Protocol, so that this module, which that one imports, imports nothing back."""

    starts: list[cst.BaseStatement]


@dataclass
class Switches:
    flag: Optional[cst.BaseExpression] = None
    group: Optional[cst.SimpleStatementLine] = None
    world: Optional[cst.Attribute] = None
    rank: Optional[cst.Attribute] = None
    stores: list[cst.BaseStatement] = field(default_factory=list)
    index_is_gpu: bool = False

    @property
    def targets(self) -> list[cst.Attribute]:
        return [t for t in (self.world, self.rank) if t is not None]


def switches(f: ScriptFacts, d: Spawned, worker: cst.FunctionDef, index: cst.Param) -> Switches:
    s = Switches()
    params = {p.name.value for p in (*worker.params.params, *worker.params.posonly_params,
                                     *worker.params.kwonly_params)}
    inits = [st for st in d.starts if f.function(st) is worker and isinstance(st, cst.SimpleStatementLine)]
    if len(inits) == 1:
        group = inits[0]
        call = group.body[0].value
        given = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        s.world, s.rank = (v if _attribute_of(v, params) else None
                           for v in (given.get("world_size"), given.get("rank")))
        if s.targets:
            s.group = group
            s.stores = _stores(f, group, {code(t) for t in s.targets})
        owner = f.parent(f.block(group))
        if isinstance(owner, cst.If) and owner.body is f.block(group) and _attribute_of(owner.test, params) \
                and not _assigned_before(f, worker, code(owner.test), owner):
            s.flag = owner.test
    s.index_is_gpu = _tested_against_none(f, worker, index.name.value)
    return s


def _attribute_of(node: Optional[cst.CSTNode], params: set[str]) -> bool:
    """``args.rank``: an attribute of one of the worker's parameters (the script's options)."""
    return isinstance(node, cst.Attribute) and isinstance(node.value, cst.Name) and node.value.value in params


def _assigned_before(f: ScriptFacts, worker: cst.FunctionDef, target: str, where: cst.CSTNode) -> bool:
    line = f.line(where)
    return any(code(t.target) == target and f.line(t) < line
               for t in f.find_in(worker.body, m.AssignTarget()))


def _stores(f: ScriptFacts, group: cst.SimpleStatementLine, targets: set[str]) -> list[cst.BaseStatement]:
    """The statements of the group's block before it that only assign ``targets`` (or an ``if``
    of such, with a test that only reads), when nothing else there reads them: Fabric's values,
    assigned at the group's place, make them dead. Empty when anything else reads them."""
    body = list(f.block(group).body)
    before = body[:body.index(group)]
    stores = [st for st in before if _only_stores(st, targets)]
    kept = [st for st in before if st not in stores]
    if any(code(a) in targets for st in kept for a in f.find_in(st, m.Attribute())):
        return []
    return stores


def _only_stores(st: cst.BaseStatement, targets: set[str]) -> bool:
    if isinstance(st, cst.SimpleStatementLine):
        return len(st.body) == 1 and isinstance(st.body[0], cst.Assign) and len(st.body[0].targets) == 1 \
            and code(st.body[0].targets[0].target) in targets
    if isinstance(st, cst.If) and st.orelse is None and isinstance(st.body, cst.IndentedBlock):
        return only_reads(st.test) and all(_only_stores(inner, targets) for inner in st.body.body)
    return False


def _tested_against_none(f: ScriptFacts, worker: cst.FunctionDef, index: str) -> bool:
    """The spawn index (``gpu``) or an attribute the worker copies it to (``args.gpu = gpu``) is
    compared with None: ``if args.gpu is not None:``."""
    aliases = {code(t.target) for a in f.find_in(worker.body, m.Assign(value=m.Name(index)))
               for t in a.targets if isinstance(t.target, cst.Attribute)}
    for comparison in f.find(m.Comparison()):
        if len(comparison.comparisons) != 1:
            continue
        target = comparison.comparisons[0]
        if not isinstance(target.operator, (cst.Is, cst.IsNot)) or not m.matches(target.comparator, m.Name("None")):
            continue
        left = code(comparison.left)
        if left in aliases or left == index and f.function(comparison) is worker:
            return True
    return False
