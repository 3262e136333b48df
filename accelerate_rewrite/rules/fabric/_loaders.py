"""Which loaders the Fabric plan sets up (part of the plan, rules/base/plan.py): training loaders
sharded, evaluation loaders whole (or sharded with --shard-eval), and the sums a loop over a
sharded loader accumulates all-reduced after it. A mixin of the planner
(rules/fabric/_plan.py), as rules/fabric/_home.py, _reach.py and _devices.py are."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.ddp.hand import SAMPLERS
from accelerate_rewrite.codemod.analysis.facts import Binding, ScriptFacts, code
from accelerate_rewrite.codemod.analysis.loops import (
    EVAL, TRAIN, data_source, eval_sums, evaluations_of_training_loader, loader_role, shared_evaluations,
    training_sums,
)
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import FabricPlan, LoaderGroup, short


def _batch_sampler(loader: Binding) -> bool:
    """``DataLoader(dataset, batch_sampler=...)``."""
    return loader.call is not None and any(
        a.keyword is not None and a.keyword.value == "batch_sampler" for a in loader.call.args)


def sampler_of(batch_sampler: cst.Call) -> cst.BaseExpression:
    """The sampler a ``BatchSampler(sampler, ...)`` call draws from."""
    return batch_sampler.args[0].value


def distributed_batch_sampler(f: ScriptFacts, loader: Binding) -> Optional[cst.Call]:
    """``DataLoader(dataset, batch_sampler=batch_sampler_train)`` with ``batch_sampler_train =
    BatchSampler(sampler_train, ...)`` and ``sampler_train`` a DistributedSampler (on the path
    where the script runs distributed): the BatchSampler call."""
    if loader.call is None:
        return None
    arg = next((a for a in loader.call.args if a.keyword is not None and a.keyword.value == "batch_sampler"), None)
    value = arg.value if arg is not None else None
    if isinstance(value, cst.Name):
        value = f.assigned_value(value)
    if not (isinstance(value, cst.Call) and value.args and value.args[0].keyword in (None,)
            and any(n.endswith("BatchSampler") for n in f.qualnames(value))):
        return None
    return value if _may_hold_distributed(f, sampler_of(value)) else None


def _may_hold_distributed(f: ScriptFacts, sampler: cst.BaseExpression) -> bool:
    """``sampler`` is, or a name that may hold, a DistributedSampler on some path (an
    assignment of it, a branch of ``A if c else B``)."""
    values = [v for _, v in f.assignments(sampler)] if isinstance(sampler, cst.Name) else [sampler]
    while any(isinstance(v, cst.IfExp) for v in values):
        values = [b for v in values for b in ((v.body, v.orelse) if isinstance(v, cst.IfExp) else (v,))]
    return any(isinstance(v, cst.Call) and f.qualnames(v) & set(SAMPLERS) for v in values)


def _may_be_distributed(f: ScriptFacts, loader: Binding) -> bool:
    """``DataLoader(ds, sampler=train_sampler)`` where ``train_sampler`` may be a
    DistributedSampler on some path (``RandomSampler(ds) if args.local_rank == -1 else
    DistributedSampler(ds)``): the script shards it itself when it runs distributed."""
    if loader.call is None:
        return False
    arg = next((a for a in loader.call.args if a.keyword is not None and a.keyword.value == "sampler"), None)
    return arg is not None and _may_hold_distributed(f, arg.value)


class Loaders:
    """The planner's part that decides the loaders (``self.f``: the facts, ``self.o``: the
    options, ``self.p``: the plan)."""

    f: ScriptFacts
    o: Options
    p: FabricPlan

    def _evaluated_while_sharded(self, loader: Binding, ref: str, reductions: list) -> None:
        """A training loader the script also evaluates on is sharded for the training: after each
        evaluation loop over it, the sums it accumulates are all-reduced (the whole set's figures
        again, as --shard-eval does); where they can't be, the note says the figures become one
        process's."""
        f, p = self.f, self.p
        for loop in shared_evaluations(f, loader):
            p.loader_skips.append((loop, f"`{loader.path}` is sharded for training, and this evaluation loop runs "
                                         "over it too (one of the loaders its callers pass): there it sees one "
                                         "process's share, and its figures become one process's (evaluate on a "
                                         "loader of its own)"))
        loops, sums = evaluations_of_training_loader(f, loader)
        if not loops:
            return
        if sums.problem is not None:
            node, why = sums.problem
            p.loader_skips.append((node, f"`{loader.path}` is sharded for training, so the evaluation over it "
                                         f"sees one process's share: {why}; its figures become one "
                                         "process's (evaluate on a loader of its own)"))
            return
        for loop, names in sums.reductions:
            reductions.append((loop, p.ref_at(f, loop) or ref, names,
                               f"`{loader.path}` is sharded for training: each process evaluates its shard"))
        p.loader_skips.extend(sums.notes)

    def _training_sums(self, loader: Binding, ref: str, reductions: list) -> None:
        """A sum the training loop over a sharded loader accumulates, read after the loop as a
        figure of the whole set (``train_loss / len(train_loader.dataset)``): all-reduced after
        the loop, as an evaluation's; read any other way, the note says it is one process's."""
        f, p = self.f, self.p
        sums = training_sums(f, loader)
        for loop, names in sums.reductions:
            reductions.append((loop, p.ref_at(f, loop) or ref, names,
                               f"`{loader.path}` is sharded for training: each process sums its shard"))
        p.loader_skips.extend(sums.notes)

    def _after_own_methods(self, loaders: list[Binding], last: cst.BaseStatement) -> cst.BaseStatement:
        """Fabric's loader wrapper carries the loader's attributes, not its class's methods:
        pytorch-template's ``valid_data_loader = data_loader.split_validation()`` (a method of its
        DataLoader subclass) right after the loader is built runs before the set-up, which then
        goes after it; such a call after the set-up elsewhere is refused (it would raise)."""
        f, p = self.f, self.p
        body = list(f.block(last).body)
        for loader in loaders:
            if loader.key in f.loader_dicts:
                continue  # a dict of loaders set up entry by entry is still a dict (``.items()``)
            refs = f.references(loader.key)
            for ref in refs:
                parent = f.parent(ref)
                if not (isinstance(parent, cst.Attribute) and parent.value is ref
                        and isinstance(f.parent(parent), cst.Call) and f.parent(parent).func is parent
                        and parent.attr.value not in _LOADER_METHODS):
                    continue
                statement = next((a for a in [ref, *f.ancestors(ref)] if any(a is s for s in body)), None)
                at = body.index(statement) if statement is not None else -1
                between = body[body.index(last) + 1:at + 1]
                used = [r for r in refs if r is not ref and any(s is a for s in between for a in f.ancestors(r))]
                if statement is not None and at <= body.index(last):
                    continue  # before the set-up
                if statement is not None and isinstance(statement, cst.SimpleStatementLine) and not used:
                    last = statement  # (the loader is not used otherwise before: the set-up goes after it)
                else:
                    p.refusal = (parent, f"`{short(f.parent(parent))}` calls a method of `{loader.path}`'s own "
                                         "class after Fabric would set it up, and Fabric's loader carries only its "
                                         "attributes; nothing was converted (call it before, or set the loader up "
                                         "by hand)")
                    return last
        return last

    def _loaders(self) -> None:
        f, p = self.f, self.p
        groups: dict[tuple[int, bool], list[Binding]] = {}
        reductions: list[tuple[cst.For, str, list[tuple[str, bool, str]], str]] = []
        on_objects = {(cls, "self." + key[1].split(".", 1)[1]) for key, cls in f.object_attributes.items()
                      if cls is not None}
        for loader in f.loaders:
            if loader.key in f.returned_loaders or loader.key in on_objects:
                continue  # set up where the helper that returns it is called, or on the object
                # that holds it (``dataset.train``, codemod/analysis/returns.py)
            sharded = p.ddp.sharded(f, loader.key) if p.ddp is not None else None
            if sharded is not None and not sharded.set_up:
                p.loader_skips.append((loader.stmt, sharded.why))
                continue
            ref = p.ref_at(f, loader.stmt)
            if ref is None:
                if f.references(loader.key):  # (``_, _, vocab = get_data()``: nothing reads them, nothing to say)
                    p.loader_skips.append((loader.stmt, f"`{loader.path}` is built where `fabric` can't be reached"))
                continue
            role = loader_role(f, loader)
            evaluation = role == EVAL
            sharded_by = distributed_batch_sampler(f, loader)
            if sharded_by is not None:
                # DETR's ``BatchSampler(sampler_train, ...)`` over a DistributedSampler when
                # distributed: each process draws its own batches already
                p.loader_skips.append((loader.stmt, f"`{loader.path}` keeps its own `batch_sampler=`, over "
                                                    f"`{code(sampler_of(sharded_by))}`, a DistributedSampler when the "
                                                    "script runs distributed: each process draws its own batches "
                                                    "already, so it is not set up; its batches move to `fabric.device`"))
                continue
            if not evaluation and self.o.many_devices and _batch_sampler(loader):
                # measured (lightning 2.6, 2 processes): Fabric's distributed sampler replaces the
                # BatchSampler's own, and the loader then yields single samples, in order
                self.p.refusal = (loader.stmt, f"`{loader.path}` draws its batches from its own `batch_sampler=`: "
                                               "Fabric's distributed sampler would take its place and lose the "
                                               "batch size (each process would get single samples, unshuffled); "
                                               "refused for several devices (--devices 1 converts it)")
                return
            if role == TRAIN and self.o.many_devices:
                self._evaluated_while_sharded(loader, ref, reductions)
                self._training_sums(loader, ref, reductions)
            if evaluation and self.o.shard_eval and self.o.many_devices and _batch_sampler(loader):
                p.loader_skips.append((loader.stmt, f"--shard-eval: `{loader.path}` is not sharded: it draws its "
                                                    "batches from its own `batch_sampler=`, which Fabric's "
                                                    "distributed sampler would break; every process evaluates "
                                                    "all of it"))
            elif evaluation and self.o.shard_eval and self.o.many_devices:
                sums = eval_sums(f, loader)
                if sums.problem is None:
                    evaluation = False  # sharded: its sums are reduced after its loops
                    for loop, names in sums.reductions:
                        reductions.append((loop, p.ref_at(f, loop) or ref, names,
                                           "--shard-eval: each process evaluates its shard"))
                    p.loader_skips.extend(sums.notes)
                else:
                    node, why = sums.problem
                    p.loader_skips.append((node, f"--shard-eval: `{loader.path}` is not sharded: {why}; "
                                                 "every process evaluates all of it"))
            own = self.o.accelerate and self.o.many_devices and not evaluation and (
                sharded is not None or _may_be_distributed(f, loader))
            groups.setdefault((id(f.block(loader.stmt)), evaluation, own), []).append(loader)
        for (_, evaluation, own), loaders in groups.items():
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
            last = self._after_own_methods(loaders, last)
            if p.refusal is not None:
                return
            built = last
            if self.o.accelerate and self.o.many_devices and not evaluation and not own:
                last = _before_first_read(f, loaders, last)
            group = LoaderGroup(loaders, last, p.ref_at(f, loaders[-1].stmt), evaluation, own)
            if last is not built:
                group.late = f.line(next(s for s in f.block(last).body[f.block(last).body.index(last) + 1:]))
            p.loader_groups.append(group)
        set_up = {b.key for group in p.loader_groups for b in group.loaders}
        reduced: set[tuple[int, str]] = set()
        for loop, ref, names, why in reductions:  # a sum is reduced once after its loop, however many
            source = f.key_of(data_source(f, loop.iter))  # loaders lead there
            if source not in set_up and not any(f.same_object(source, key) for key in set_up):
                continue
            names = [n for n in names if (id(loop), n[0]) not in reduced]
            reduced.update((id(loop), n[0]) for n in names)
            if names:
                p.reductions.append((loop, ref, names, why))


def _before_first_read(f: ScriptFacts, loaders: list[Binding], last: cst.BaseStatement) -> cst.BaseStatement:
    """The statement of ``last``'s block right before the first one after it that reads one of
    ``loaders`` (their names, or the object an attribute loader hangs on), or ``last``.

    Measured (accelerate 1.15, ``prepare_data_loader``): on several processes, preparing a
    loader whose sampler has no generator of its own (``shuffle=True``) draws the generator's
    seed from torch's global one, where the original's sampler draws it when its first epoch
    starts. Prepared where the loader was built (before the model, say) that draw shifts the
    stream, and the model's initial weights are not the original's; prepared right before its
    first read, the model is built as before, and the seed is the draw the original's first
    epoch makes."""
    body = list(f.block(last).body)
    if not any(s is last for s in body):
        return last
    names = {b.path.split(".")[0] for b in loaders}
    start = next(i for i, s in enumerate(body) if s is last)
    for i in range(start + 1, len(body)):
        if any(n.value in names for n in f.find_in(body[i], m.Name())):
            return body[i - 1]
    return last


#: what a set-up loader still answers: the DataLoader's iteration and length, and what Python
#: gives every object
_LOADER_METHODS = frozenset({"__iter__", "__len__", "__getattribute__", "__setattr__"})
