from __future__ import annotations

from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import code
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.calls import set_keywords
from accelerate_rewrite.rules.base.plan import short
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.data._padding import padded_sets

SAMPLER = "LengthGroupedSampler"


class GroupByLength(Rule):
    """`--group-by-length eval|all` (with `--dynamic-padding`): batches of sequences of similar
    length, so that dynamic padding leaves little padding.

    What it does: for each DataLoader that AR502 pads dynamically,
    - an evaluation loader (not shuffled): `sampler=sorted(range(len(val_set)), key=lambda i:
      len(val_set[i][0]))`: the samples in order of length, then batched. With several devices,
      Fabric's `setup_dataloaders` shards that order across processes (its
      DistributedSamplerWrapper, not shuffled), so each process still gets sorted batches;
    - a training loader (`shuffle=True`), with `--group-by-length all` only: `shuffle=True`
      becomes `sampler=LengthGroupedSampler(batch_size, lengths=[...])` from transformers (the
      Trainer's `group_by_length`): a random permutation, cut into mega-batches of 50 batches,
      each sorted by length; the batches stay random, the lengths inside one batch close.

    Why: a batch is as long as its longest sequence; mixed lengths keep much padding even when
    each batch is padded on its own. Sorting the evaluation set removes most of it.

    Kind: approximate for evaluation (the same samples, in other batches: sums of per-batch
    means round differently; metrics summed over samples are the same), changes-training for
    training (another order of the samples, and batches of similar lengths).

    Leaves alone (and says why): training loaders unless `all` is asked (training wants
    shuffled batches), a loader with its own sampler, a training loader with several devices
    (each process would draw its own permutation: Fabric's `use_distributed_sampler=False` and
    sharding by hand would be needed; use `--devices 1` or `--backend torch`), a loader whose
    batch_size is not given.
    """

    code = "AR503"
    name = "group-by-length"
    kind = Kind.APPROXIMATE
    requires = ("AR502",)
    examples = (Example.from_files("AR503", options={"backend": "torch", "dynamic_padding": True,
                                                     "group_by_length": "all"}),)

    def applies(self, options: Options) -> bool:
        return options.group_by_length is not None

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        fabric = o.fabric and plan(f, o).refusal is None
        for padded in padded_sets(f):
            if padded.refusal is not None:
                continue  # AR502 says why
            first = padded.fields.index("input_ids")
            for loader in padded.loaders:
                keywords = {a.keyword.value: a for a in loader.args if a.keyword is not None}
                where = short(loader, 40)
                if "sampler" in keywords:
                    ctx.skip(loader, f"`{where}` has its own sampler: not grouped by length")
                    continue
                shuffle = keywords.get("shuffle")
                if shuffle is None or code(shuffle.value) == "False":
                    sampler = f"sorted(range(len({padded.dataset})), key=lambda i: len({padded.dataset}[i][{first}]))"
                    set_keywords(ctx, loader, {"sampler": sampler})
                    ctx.change(loader, f"`{where}`: evaluation batches in order of length")
                    continue
                if o.group_by_length != "all":
                    ctx.skip(loader, f"`{where}` is a training loader (shuffle={code(shuffle.value)}): training "
                                     "wants shuffled batches; --group-by-length all groups it too")
                    continue
                if fabric and not o.single_device:
                    ctx.skip(loader, f"`{where}`: with several devices each process would draw its own "
                                     "permutation (Fabric's use_distributed_sampler=False and sharding by hand "
                                     "would be needed): give --devices 1, or --backend torch")
                    continue
                batch_size = _batch_size(loader)
                if batch_size is None:
                    ctx.skip(loader, f"`{where}`: no batch_size to group by")
                    continue
                lengths = f"[len(item[{first}]) for item in {padded.dataset}]"
                ctx.edits.replace(shuffle, cst.Arg(
                    cst.parse_expression(f"{SAMPLER}({batch_size}, lengths={lengths})"), keyword=cst.Name("sampler"),
                    equal=shuffle.equal, comma=shuffle.comma))
                ctx.edits.add_import("transformers.trainer_pt_utils", SAMPLER)
                ctx.change(loader, f"`{where}`: shuffled mega-batches of similar lengths ({SAMPLER})",
                           kind=Kind.CHANGES_TRAINING)


def _batch_size(loader: cst.Call) -> Optional[str]:
    for i, a in enumerate(loader.args):
        if (a.keyword is not None and a.keyword.value == "batch_size") or (a.keyword is None and i == 1):
            return code(a.value)
    return None
