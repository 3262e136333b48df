from __future__ import annotations

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules._fabric import FabricRule, core_except, plan, stmt


class FabricDataloaders(FabricRule):
    """Set the DataLoaders up: `train_loader, val_loader = fabric.setup_dataloaders(...)`.

    What it does: after the statement that builds the last DataLoader of a group, one
    `fabric.setup_dataloaders(...)` call for the group.

    Why: Fabric then moves every batch to the device (so the `.to(device)` calls on batches
    can go) and, with several devices, gives each process its own shard through a
    DistributedSampler (and calls `set_epoch` for you).

    Kind: safe (one device sees the same batches in the same order).

    Leaves alone: loaders built where `fabric` can't be reached, or before Fabric exists in
    another block; their batches keep an explicit move to `fabric.device`.
    """

    code = "AR104"
    name = "fabric-dataloaders"
    kind = Kind.SAFE
    requires = core_except("AR104")
    examples = (Example.from_files("AR104"),)

    def rewrite(self, ctx: RuleContext) -> None:
        p = plan(ctx.facts, ctx.options)
        if p.refusal is not None:
            return
        for loaders, after, ref in p.loader_groups:
            names = ", ".join(b.path for b in loaders)
            ctx.edits.insert_after(after, stmt(f"{names} = {ref}.setup_dataloaders({names})\n"))
            ctx.change(after, f"set up `{names}` with Fabric")
        for node, why in p.loader_skips:
            ctx.skip(node, why)
