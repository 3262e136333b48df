from __future__ import annotations

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import TRUE_HALF_PRECISIONS
from accelerate_rewrite.rules.base.plan import short
from accelerate_rewrite.rules.base.half import half_casts

BATCH_NORMS = tuple(
    f"torch.nn.{prefix}{name}" for prefix in ("", "modules.batchnorm.")
    for name in ("BatchNorm1d", "BatchNorm2d", "BatchNorm3d", "SyncBatchNorm", "LazyBatchNorm1d",
                 "LazyBatchNorm2d", "LazyBatchNorm3d")
)


class HalfBatchNorm(Rule):
    """Diagnose BatchNorm under true half precision: its running statistics kept in half.

    What it does: reports, with its line, each BatchNorm layer the script builds when the
    weights end up in half precision: with `--precision 16-true` / `bf16-true`, or when the
    script casts its model with `.half()` itself and no mixed precision is asked for (with one,
    AR209 removes the cast). Nothing is rewritten.

    Why: a BatchNorm cast to half keeps its running mean and variance in half too, and
    updates them there (momentum 0.1 into a 10-bit mantissa in fp16, 7 bits in bf16). After
    `model.eval()` the layer normalises with those statistics, so evaluation drifts from what
    training saw. apex O2 kept BatchNorm in fp32 for this reason (`keep_batchnorm_fp32`). Mixed
    precision (16-mixed, bf16-mixed) keeps BatchNorm's parameters and statistics in fp32.

    Kind: safe (it only reports).
    """

    code = "AR212"
    name = "half-batchnorm"
    kind = Kind.SAFE
    examples = (Example.from_files("AR212", options={"precision": "16-true"}),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        precision = ctx.options.precision
        if precision in TRUE_HALF_PRECISIONS:
            why = f"--precision {precision}"
        elif precision is None and half_casts(f).model_cast is not None:
            why = f"the model's `.half()` at line {f.line(half_casts(f).model_cast)}"
        else:
            return
        for site in f.calls_to(*BATCH_NORMS):
            ctx.skip(site.call, f"`{short(site.call)}` under {why}: its running mean and variance are "
                                "kept and updated in half precision, and model.eval() normalises with "
                                "them; prefer 16-mixed / bf16-mixed (BatchNorm stays fp32), or keep "
                                "this layer in fp32. Not rewritten")
