from __future__ import annotations

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.plan import FabricRule, core_except, stmt
from accelerate_rewrite.rules.fabric._plan import plan


class FabricDataloaders(FabricRule):
    """Set the DataLoaders up: `train_loader, val_loader = fabric.setup_dataloaders(...)`.

    What it does: after the statement that builds the last DataLoader of a group, one
    `fabric.setup_dataloaders(...)` call for the group; a dict of DataLoaders the script draws
    from by key (`dataloaders = {x: DataLoader(...) for x in ['train', 'val']}`, then
    `dataloaders[phase]`) is set up entry by entry. Fabric's loader carries the loader's
    attributes, not its class's methods: the set-up goes after the script's calls of those
    (`valid_loader = loader.split_validation()`), and one it can't go after is refused.

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
    on N devices. With `--shard-eval` they are sharded like the training loaders, and after
    each evaluation loop the sums and counts it accumulates (`test_loss += ...`, `correct +=
    ...`, set before the loop) are summed over the processes with
    `fabric.all_reduce(x, reduce_op="sum")` (`.item()` again where the script summed Python
    numbers), so that `test_loss /= len(test_loader.dataset)` divides the whole sum. A loader
    whose loop does what can't be reduced (appends results to a list, divides by
    `len(loader)`, updates an accumulator other than by `+=`) stays unsharded, and the note
    says why; torchmetrics objects sync themselves (a note names them). The figures are exact
    when the set's size divides by the number of processes; otherwise a DistributedSampler
    pads the last shards with repeated samples, which the sums then include.

    A loader a training loop draws from one batch at a time (`data_iter = iter(train_loader)`
    and `x, y = next(data_iter)`, `next(iter(loader))`, `itertools.cycle(loader)`) is a
    training loader. A training loader the script also evaluates on (a loop over it under
    `torch.no_grad()` that does not train: a train-accuracy figure) is sharded for the training,
    so that loop's sums are all-reduced after it, as with `--shard-eval`; where they can't be,
    the note says its figures become one process's. So does the note where a function's loop
    evaluates the training loader at one call and another loader at another
    (`evaluate(model, train_loader)`, `evaluate(model, val_loader)`): a sum after it can't be
    all-reduced for one call and not the other.

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
            dicts = [b for b in group.loaders if b.key in ctx.facts.loader_dicts]
            names = ", ".join(b.path for b in group.loaders if b not in dicts)
            extra = ", use_distributed_sampler=False" if group.evaluation or group.own_sampler else ""
            lines = [f"{names} = {group.ref}.setup_dataloaders({names}{extra})\n"] if names else []
            lines += [f"{b.path} = {{key: {group.ref}.setup_dataloaders(loader{extra}) for key, loader in "
                      f"{b.path}.items()}}\n" for b in dicts]  # a dict of loaders, entry by entry
            names = ", ".join(b.path for b in group.loaders)
            ctx.edits.insert_after(group.after, *(stmt(line) for line in lines))
            if group.own_sampler:
                ctx.change(group.after, f"set up `{names}` with Accelerate on its own DistributedSampler, which "
                                        "shards it already (Accelerate's `prepare` would shard it again)")
            elif group.evaluation:
                ctx.change(group.after, f"set up `{names}` with Fabric for evaluation: not sharded, so with "
                                        "several devices every process evaluates all of it and the metrics "
                                        "the script computes stay those of the whole set")
            elif group.late is not None:
                ctx.change(group.after, f"set up `{names}` with Fabric right before line {group.late}, its first "
                                        "read: on several processes Accelerate's `prepare` of a loader that "
                                        "shuffles draws its seed from torch's random generator, here after the "
                                        "model is built, as the original's first epoch draws it")
            else:
                ctx.change(group.after, f"set up `{names}` with Fabric")
            for b in group.loaders:
                if b.key in ctx.facts.hinted:
                    ctx.change(b.stmt, f"`{b.path}` is a DataLoader, as the hint on its line says: "
                                       "fabric.setup_dataloaders raises a TypeError at start-up if it is not")
                elif b.key in ctx.facts.assumed_loaders:
                    ctx.change(b.stmt, f"assumed `{b.path}` is a DataLoader, where the script receives it from "
                                       f"`{b.qualname}`, which the rewrite can't see into: "
                                       "fabric.setup_dataloaders raises a TypeError at start-up if it is not")
        for loop, ref, names, why in p.reductions:
            lines = [f"{name} = {ref}.all_reduce({name}, reduce_op=\"{op}\"){'.item()' if number else ''}\n"
                     for name, number, op in names]
            ctx.edits.insert_after(loop, *(stmt(line) for line in lines))
            ctx.change(loop, f"{why}; "
                             + ", ".join(f"`{n}` {'summed' if op == 'sum' else 'averaged'}" for n, _, op in names)
                             + " over the processes after the "
                             "loop (exact when the set's size divides by the number of processes: "
                             "a DistributedSampler pads the last shards with repeated samples)")
        for node, why in p.loader_skips:
            ctx.skip(node, why)
