from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import AUTOCAST, ScriptFacts, bce_calls
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules.base.plan import short

class AmpBceLoss(Rule):
    """Diagnose `BCELoss` / `binary_cross_entropy` computed under autocast.

    What it does: reports, with its line, each `F.binary_cross_entropy(...)` call, and each call
    of an `nn.BCELoss()` object, that runs under autocast: inside a `with torch.autocast(...)`
    block, or, when the rewrite is asked for a mixed precision, inside a model's `forward` (the
    part Fabric autocasts). It does not rewrite them: the fix (`BCEWithLogitsLoss` /
    `binary_cross_entropy_with_logits` on the logits, without the sigmoid before it) changes
    the model's last step, which is the script author's call.

    Why: CUDA autocast refuses them ("torch.nn.functional.binary_cross_entropy and
    torch.nn.BCELoss are unsafe to autocast"): the script stops at its first step on a GPU. CPU
    autocast runs them in fp32, so a CPU test will not show it.

    Kind: safe (it only reports).
    """

    code = "AR205"
    name = "amp-bce-loss"
    kind = Kind.SAFE
    examples = (Example.from_files("AR205"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        mixed = (ctx.options.precision or "").endswith("-mixed")
        for call in bce_calls(f):
            where = _under_autocast(f, call, in_forward=mixed)
            if where:
                ctx.skip(call, f"`{short(call)}` runs {where}: CUDA autocast refuses BCELoss "
                               "(\"unsafe to autocast\"); use BCEWithLogitsLoss / "
                               "binary_cross_entropy_with_logits on the logits (drop the sigmoid "
                               "before it). Not rewritten: it changes the model's last step")


def _under_autocast(f: ScriptFacts, call: cst.Call, *, in_forward: bool) -> str:
    for parent in f.ancestors(call):
        if isinstance(parent, cst.With) and any(
            isinstance(item.item, cst.Call) and f.qualname(item.item) in AUTOCAST for item in parent.items
        ):
            return f"under the autocast of line {f.line(parent)}"
        if isinstance(parent, cst.FunctionDef):
            cls = f.enclosing_class(parent)
            if in_forward and parent.name.value == "forward" and cls is not None \
                    and cls.name.value in f.module_classes:
                return f"in {cls.name.value}.forward, which the mixed precision autocasts"
            return ""
    return ""
