from __future__ import annotations


from accelerate_rewrite.codemod.analysis.facts import CLIP_NORM, CLIP_VALUE, SCALER
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules.base.plan import code, short, stmt



class UnscaleBeforeClip(Rule):
    """Clip the true gradients: `scaler.unscale_(optimizer)` before clipping under a GradScaler.

    What it does: where a script with a GradScaler clips (`clip_grad_norm_` /
    `clip_grad_value_`) between `scaler.scale(loss).backward()` and `scaler.step(optimizer)`
    without unscaling first, it inserts `scaler.unscale_(optimizer)` right before the clip (the
    optimizer is the one that `scaler.step` steps next).

    Why: after `scaler.scale(loss).backward()` the gradients are multiplied by the scale
    (65,536 at the start): clipping them to `max_norm=1.0` clips the scaled numbers, so almost
    every step is cut to nearly nothing. PyTorch's AMP recipe unscales first; `scaler.step` then
    knows and does not unscale twice.

    Kind: changes-training (a fix: with the scaler disabled nothing changes; with it enabled
    the clip limits the gradients the script meant to limit, so training differs from the
    broken original: on an H100, fixtures/cuda_amp's applied gradient norms grew about 37,000
    times, from the clipped scaled values to the real ones).

    Leaves alone (and says why): a clip with no `scaler.step(...)` after it in the same block,
    and a clip that an `unscale_` already precedes.
    """

    code = "AR202"
    fix = True
    name = "amp-unscale-before-clip"
    kind = Kind.CHANGES_TRAINING
    examples = (Example.from_files("AR202"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        steps = f.method_calls(SCALER, "step")
        if not steps:
            return
        unscales = f.method_calls(SCALER, "unscale_")
        for site in f.calls_to(*CLIP_NORM, *CLIP_VALUE):
            clip_stmt = f.statement(site.call)
            block = f.block(clip_stmt)
            body = list(block.body)
            index = body.index(clip_stmt)
            later = [c for c in steps if f.statement(c) in body[index + 1:]]
            optimizer = code(later[0].args[0].value) if later and later[0].args else None
            last_backward = max((f.line(b.call) for b in f.backward_sites if f.line(b.call) < f.line(site.call)),
                                default=0)
            if any(f.line(u) < f.line(site.call) and f.function(u) is f.function(site.call)
                   and u.args and optimizer in (None, code(u.args[0].value)) and f.line(u) > last_backward
                   for u in unscales):
                continue  # unscaled already (``if grad_clip: scaler.unscale_(optimizer)`` above it)
            if optimizer is None:
                ctx.skip(site.call, "clipping under a GradScaler with no scaler.step(...) after it in "
                                    "the same block: unscale_ it by hand before clipping")
                continue
            scaler = code(later[0].func.value)
            ctx.edits.insert_before(clip_stmt, stmt(f"{scaler}.unscale_({optimizer})\n"))
            ctx.change(site.call, f"`{scaler}.unscale_({optimizer})` before `{short(site.call.func)}`: "
                                  "it clipped the scaled gradients")
