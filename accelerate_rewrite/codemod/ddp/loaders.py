"""The loaders a hand-made distributed script shards itself (codemod/ddp/hand.py): those whose
``sampler=`` is a DistributedSampler it builds, and whether Fabric can set them up with the
sampler kept.

Measured (lightning 2.6, ``_FabricDataLoader.__iter__``): Fabric calls ``set_epoch`` on a
loader's sampler with the number of times the loader was iterated, so a hand-built
``DistributedSampler`` kept under ``fabric.setup_dataloaders`` gives each rank the original's
batches only when the script's own ``sampler.set_epoch(epoch)`` counts the same: an epoch loop
``for epoch in range(n)`` that iterates the loader once. Any other loader keeps its hand-made
sharding and is not set up.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import DATALOADERS, Binding, ScriptFacts, code
from accelerate_rewrite.codemod.analysis.loops import data_source
from accelerate_rewrite.codemod.analysis.sampling import SHARDING


@dataclass
class ShardedLoader:
    """A loader whose ``sampler=`` is a DistributedSampler built by the script."""

    loader: Binding
    sampler: cst.BaseExpression
    set_up: bool  # Fabric sets it up and keeps the sampler: the batches stay the same
    why: str  # what the note says


def sharded_loaders(f: ScriptFacts, samplers: list[cst.Call]) -> list[ShardedLoader]:
    """The script's loaders whose ``sampler=`` is one of ``samplers`` (the DistributedSamplers it
    builds), in the order of the facts' loaders, each with whether Fabric can set it up."""
    out: list[ShardedLoader] = []
    sampler_ids = {id(c) for c in samplers}
    for loader in f.loaders:
        call = loader.call if loader.call is not None else _returned_call(f, loader)
        if call is None:
            continue
        arg = next((a for a in call.args if a.keyword is not None and a.keyword.value == "sampler"), None)
        if arg is None:
            continue
        value = arg.value
        # what it may hold: DeiT's ``sampler_train`` is a RASampler or a DistributedSampler when
        # distributed, a RandomSampler otherwise
        built = [value] if isinstance(value, cst.Call) else (
            [v for _, v in f.assignments(value)] if isinstance(value, cst.Name) else [])
        own = next((b for b in built if isinstance(b, cst.Call) and _shards_itself(f, b)), None)
        if own is not None:
            out.append(ShardedLoader(loader, value, False, (
                f"`{loader.key[1]}` keeps its own sampler, `{code(own.func)}`, which shards the data by the "
                "process's rank itself, and is not set up: Fabric would wrap it in a distributed sampler of "
                "its own and shard the data twice; its batches move to `fabric.device`")))
            continue
        if not any(isinstance(b, cst.Call) and id(b) in sampler_ids for b in built):
            continue
        out.append(_sharded(f, loader, value))
    return out


def _shards_itself(f: ScriptFacts, call: cst.Call) -> bool:
    """``RASampler(dataset, num_replicas=..., rank=...)``: an object of a class of the project
    (not a DistributedSampler, which Fabric leaves in place) that reads the world size or the
    rank, so that each process draws its own part of the data."""
    fn = f.functions.get(call.func.value) if isinstance(call.func, cst.Name) else None
    if fn is None or not isinstance(fn.node, cst.ClassDef):
        return False
    if any(code(base.value).endswith("DistributedSampler") for base in fn.node.bases):
        return False
    return any(isinstance(n, (cst.Name, cst.Attribute)) and (n.value if isinstance(n, cst.Name) else n.attr.value)
               in SHARDING for n in f.find_in(fn.node, m.Name() | m.Attribute()))


def _returned_call(f: ScriptFacts, loader: Binding) -> Optional[cst.Call]:
    """``train_data = prepare_dataloader(...)`` where the helper returns ``DataLoader(...)``."""
    value = loader.value
    if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Name)):
        return None
    fn = f.functions.get(value.func.value)
    if fn is None or not isinstance(fn.node, cst.FunctionDef):
        return None
    returned = [r.value for r in m.findall(fn.node, m.Return())]
    if len(returned) == 1 and isinstance(returned[0], cst.Call) and f.qualnames(returned[0]) & set(DATALOADERS):
        return returned[0]
    return None


def _sharded(f: ScriptFacts, loader: Binding, sampler: cst.BaseExpression) -> ShardedLoader:
    """Whether Fabric's ``set_epoch`` (the count of iterations of the loader) is the one the
    script gives its sampler, so the loader can be set up with its sampler kept."""
    name = loader.key[1]

    def is_loader(node: cst.BaseExpression) -> bool:
        return f.same_object(f.key_of(node), loader.key)

    loops = [loop for loop in f.find(m.For()) if is_loader(data_source(f, loop.iter))]
    calls = [c for c in f.attribute_calls if c.func.attr.value == "set_epoch" and (
        (isinstance(sampler, cst.Name) and code(c.func.value) == code(sampler))
        or m.matches(c.func.value, m.Attribute(attr=m.Name("sampler"))) and is_loader(c.func.value.value))]
    keep = f"`{name}` keeps its DistributedSampler"
    if not calls:
        return ShardedLoader(loader, sampler, False,
                             f"{keep} and is not set up: the script never calls `set_epoch` on it, and "
                             "Fabric would (its shuffle would change every epoch)")
    epoch_loop = next((a for a in f.ancestors(calls[0]) if isinstance(a, cst.For)), None)
    counts_from_zero = epoch_loop is not None and m.matches(
        epoch_loop.iter, m.Call(func=m.Name("range"), args=[m.Arg(keyword=None)])) and m.matches(
        calls[0].args[0].value if calls[0].args else None, epoch_loop.target)
    inside = [loop for loop in loops if epoch_loop is not None and epoch_loop in f.ancestors(loop)]
    if len(calls) == 1 and counts_from_zero and len(inside) == 1 and len(loops) == 1:
        return ShardedLoader(loader, sampler, True,
                             f"{keep} (Fabric leaves one in place); its `set_epoch({code(epoch_loop.target)})` "
                             "is the count Fabric sets, so every rank gets the original's batches")
    why = ("it is iterated more than once an epoch" if len(inside) > 1 or len(loops) > 1
           else "its epochs don't count from 0 once a loop")
    return ShardedLoader(loader, sampler, False,
                         f"{keep} and is not set up: Fabric would call `set_epoch` with the number of "
                         f"times it was iterated, and {why}, so the batches would change; its batches "
                         "move to `fabric.device`")
