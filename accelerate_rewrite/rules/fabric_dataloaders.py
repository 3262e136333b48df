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

    Evaluation loaders (iterated only by loops that don't train: under `torch.no_grad()` or
    `torch.inference_mode()`, after `model.eval()`, or named test/val) are set up with
    `use_distributed_sampler=False`: with several devices every process evaluates the whole
    set, so `test_loss /= len(test_loader.dataset)`, a best-accuracy test and the printed
    figures equal those of one device (rank 0 prints). Sharding them would make each process
    divide the sum of its shard by the full size (and a DistributedSampler pads the set with
    repeated samples to a multiple of the process count). The cost: evaluation is not faster
    on N devices.

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
        for group in p.loader_groups:
            names = ", ".join(b.path for b in group.loaders)
            extra = ", use_distributed_sampler=False" if group.evaluation else ""
            ctx.edits.insert_after(group.after, stmt(f"{names} = {group.ref}.setup_dataloaders({names}{extra})\n"))
            if group.evaluation:
                ctx.change(group.after, f"set up `{names}` with Fabric for evaluation: not sharded, so with "
                                        "several devices every process evaluates all of it and the metrics "
                                        "the script computes stay those of the whole set")
            else:
                ctx.change(group.after, f"set up `{names}` with Fabric")
        for node, why in p.loader_skips:
            ctx.skip(node, why)
