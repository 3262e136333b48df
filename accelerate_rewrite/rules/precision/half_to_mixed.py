from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import MIXED_PRECISIONS, Options
from accelerate_rewrite.rules.base.plan import code, short
from accelerate_rewrite.rules.base.half import MIXED_GROUND, low_casts, strip_half

class HalfToMixed(Rule):
    """Pure half training becomes mixed precision: with `--precision 16-mixed` or `bf16-mixed`,
    the script's own `.half()` casts of the trained model and of its batches go.

    What it does: in a script that trains a model cast with `.half()` / `.to(torch.float16)`
    (or `.bfloat16()` / `.to(torch.bfloat16)`), removes that cast and the casts of tensors to
    the same dtypes inside its training loops
    (`inputs.to(device).half()` becomes `inputs.to(device)`), so that the mixed precision asked
    for (Fabric's, or AR207/AR208's autocast and GradScaler) runs on fp32 weights. A statement
    left doing nothing (`model.half()`) goes.

    Why: a mixed precision over weights that stay in half is not mixed precision (no fp32
    master weights, which is what Fabric's "-mixed" promises). Pure fp16 weights lose small updates (an fp16 weight of 1.0 can't take a step smaller
    than 0.0005), Adam's default eps=1e-8 is 0 in fp16 (NaN from the second step), and a
    GradScaler refuses fp16 gradients ("Attempting to unscale FP16 gradients"). Mixed
    precision keeps fp32 weights and runs the heavy ops in half.

    Kind: approximate (the weights become fp32: training is more precise than before; the
    original, with Adam, produced NaN).

    Stands on: an autocast in the precision asked for (Fabric's precision, AR207's, or the
    script's own set by AR213). Where none of them was made in the file (the Fabric conversion
    refused, say), the engine drops this rule and says so: the casts stay.

    Leaves alone: `.half()` outside the training loops on something other than the trained
    model, and any `.half()` after the last backward outside them (a smaller checkpoint,
    inference). To keep pure half, use `--precision 16-true` (AR206 then fixes Adam's eps).
    """

    code = "AR209"
    name = "half-to-mixed"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR209", options={"precision": "bf16-mixed"}),)

    def applies(self, options: Options) -> bool:
        return options.precision in MIXED_PRECISIONS

    def premises(self, options: Options) -> tuple[str, ...]:
        """Removing the half casts is right only where an autocast takes over: without one the
        script would train in fp32 (and a half cast left alone would make `x = x`)."""
        return (MIXED_GROUND,)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        casts = low_casts(f)
        for call in casts.training:
            statement = f.statement(call)
            if m.matches(statement, m.SimpleStatementLine(body=[m.Expr(value=m.Call())])) \
                    and statement.body[0].value is call and isinstance(strip_half(call), (cst.Name, cst.Attribute)):
                ctx.edits.remove(statement)  # ``model.half()``
            elif m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])) \
                    and statement.body[0].value is call \
                    and code(statement.body[0].targets[0].target) == code(strip_half(call)):
                ctx.edits.remove(statement)  # ``input_var = input_var.half()``: not ``x = x``
            else:
                ctx.edits.replace(call, strip_half)
            what = "the model's" if call is casts.model_cast else "a batch's"
            dtype = "bf16" if "bfloat16" in short(call) else "fp16"
            ctx.change(call, f"{what} {dtype} cast `{short(call)}` removed: {ctx.options.precision} keeps "
                             "fp32 weights and computes in half where it is safe")
