from __future__ import annotations

from pathlib import Path

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.calls import set_keywords, without_keywords
from accelerate_rewrite.rules.data._padding import padded_sets
from accelerate_rewrite.rules.techniques.freeze import add_helper

HELPER = "PadToLongest"
HELPER_CODE = (Path(__file__).resolve().parent.parent / "helpers" / f"{HELPER}.txt").read_text(encoding="utf-8")
#: the tokenizer's keywords that make it pad, or return tensors (which need one length)
DROPPED = ("padding", "return_tensors")


class DynamicPadding(Rule):
    """`--dynamic-padding`: pad each batch to its own longest sequence, not every sequence to
    max_length.

    What it does: where a script tokenizes a whole dataset with `padding="max_length"` (or
    `True`, `"longest"`) into a TensorDataset that only DataLoaders read:
    - the tokenizer call loses `padding=` and `return_tensors=` (it returns lists of token ids,
      each as long as its text, still truncated to max_length);
    - `TensorDataset(enc["input_ids"], enc["attention_mask"], labels)` becomes
      `list(zip(...))`: one (input_ids, attention_mask, label) item a sample;
    - each DataLoader over it gets `collate_fn=PadToLongest(tokenizer, ("input_ids",
      "attention_mask", None))`, a small class put into the script once that pads the token
      fields of a batch with the tokenizer's own `pad` (pad id, padding side and attention mask
      as the tokenizer does them) and stacks the rest. The loop still gets the same tuple.

    Why: with texts of mixed lengths most of a max_length batch is padding, which the model
    computes for nothing (attention is quadratic in it). Published: dynamic padding with
    length-grouped batches cut a CamemBERT fine-tune from 56 to 16 minutes.

    Kind: approximate: a model that masks its padding (attention mask, masked pooling) computes
    the same values, but sums run over other lengths, so the losses agree to fp32 rounding
    (measured on fixtures/text_classification); a dropout mask is drawn for the padded shape,
    so with dropout the random draws differ.

    Leaves alone (and says why): a tokenization whose result is used as more than
    `enc["key"]` in one TensorDataset, a dataset used outside DataLoaders and `len()`, a
    DataLoader that already has a collate_fn or batch_sampler.
    """

    code = "AR502"
    name = "dynamic-padding"
    kind = Kind.APPROXIMATE
    words = ("padding",)
    examples = (Example.from_files("AR502", options={"backend": "torch", "dynamic_padding": True}),)

    def applies(self, options: Options) -> bool:
        return options.dynamic_padding

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        sets = padded_sets(f)
        if not sets:
            return
        if f.functions.get(HELPER) is not None:
            ctx.skip(f.functions[HELPER].node, f"the script already defines `{HELPER}`: nothing padded dynamically")
            return
        done = 0
        for padded in sets:
            if padded.refusal is not None:
                ctx.skip(*padded.refusal)
                continue
            call = padded.tokenize
            ctx.edits.replace(call, lambda updated: without_keywords(updated, DROPPED))
            ctx.edits.replace(padded.dataset_call, lambda updated: cst.Call(
                func=cst.Name("list"), args=[cst.Arg(cst.Call(func=cst.Name("zip"), args=updated.args))]))
            fields = "(" + ", ".join(repr(k) if k else "None" for k in padded.fields).replace("'", '"') \
                + ("," if len(padded.fields) == 1 else "") + ")"
            collate = f"{HELPER}({padded.tokenizer}, {fields})"
            for loader in padded.loaders:
                set_keywords(ctx, loader, {"collate_fn": collate})
            ctx.change(call, f"`{padded.dataset}`: tokenized without padding; its DataLoader(s) pad each "
                             f"batch to its longest sequence (`{HELPER}`)")
            done += 1
        if done:
            ctx.edits.add_import("torch")
            add_helper(ctx, cst.parse_module(HELPER_CODE).body[0])

