from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import expr, short, stmt
from accelerate_rewrite.rules.native._plan import SCALER, core_except, native_plan


class NativeGradScaler(Rule):
    """`--backend torch --precision 16-mixed`: one `torch.amp.GradScaler` for the run, in the
    order PyTorch's AMP recipe gives.

    What it does: creates `scaler = torch.amp.GradScaler(<the script's device type>)` once, right
    after the optimizers are built (`self.scaler` after `self.optimizer = ...` in a trainer
    class; passed as `scaler=scaler` into a `train(...)` function that steps the optimizer); then
    `loss.backward()` becomes `scaler.scale(loss).backward()`, a clip between backward and step
    gets `scaler.unscale_(optimizer)` before it, `optimizer.step()` becomes
    `scaler.step(optimizer)`, and `scaler.update()` follows the last step of each iteration
    (a GAN's two optimizers share one scaler and one update).

    Why: fp16 gradients underflow to zero without loss scaling; the scaler multiplies the loss,
    unscales the gradients before the step, skips steps whose gradients overflowed and adapts
    its scale over the run (so one scaler per run, not per epoch). Clipping must see the
    unscaled gradients.

    Kind: approximate (fp16 autocast; the steps the scaler skips at the start are not taken).

    Leaves alone (and says why): everything AR207 leaves alone, and scripts where the scaler
    can't be placed once for every step: an optimizer step with a closure (LBFGS), a clip with no
    step after it in its block, training code that the scaler would have to be passed through
    more than one function to reach. Either every backward and step goes through the scaler
    or none does.
    """

    code = "AR208"
    name = "native-grad-scaler"
    kind = Kind.APPROXIMATE
    requires = core_except("AR208")
    examples = (Example.from_files("AR208", options={"backend": "torch", "precision": "16-mixed"}),)

    def applies(self, options: Options) -> bool:
        return not options.fabric

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = native_plan(f, ctx.options)
        if p.refusal is not None or p.scaler_after is None:
            return  # AR207 says why, or no scaler is needed
        target = p.scaler_target
        ctx.edits.insert_after(p.scaler_after, stmt(
            f"{target} = torch.amp.GradScaler({p.scaler_device_type})\n"))
        ctx.change(p.scaler_after, f"one `{target} = torch.amp.GradScaler({p.scaler_device_type})` "
                                   "for the run")
        for func in p.threads:
            ctx.edits.replace(func.params, _add_param)
            ctx.change(func, f"{func.name.value}() takes the GradScaler as `{SCALER}`")
        for call in p.thread_calls:
            ctx.edits.replace(call, lambda u: u.with_changes(args=_append(
                u.args, cst.Arg(cst.Name(SCALER), keyword=cst.Name(SCALER), equal=_EQUAL))))
        for site, ref in p.backwards:
            if site.apex or ref is None:
                continue  # AR211 rewrites apex's scale_loss blocks
            ctx.edits.replace(site.call, lambda u, r=ref: u.with_changes(func=u.func.with_changes(
                value=cst.Call(expr(f"{r}.scale"), [cst.Arg(u.func.value.with_changes(lpar=[], rpar=[]))]))))
            ctx.change(site.call, f"`{short(site.loss)}.backward()` became "
                                  f"`{ref}.scale({short(site.loss)}).backward()`")
        for clip, ref, optimizer in p.unscales:
            ctx.edits.insert_before(clip, stmt(f"{ref}.unscale_({optimizer})\n"))
            ctx.change(clip, f"`{ref}.unscale_({optimizer})` before clipping: the gradients are scaled")
        for call, ref in p.steps:
            ctx.edits.replace(call, lambda u, r=ref: cst.Call(expr(f"{r}.step"), [cst.Arg(u.func.value)]))
            ctx.change(call, f"`{short(call)}` became `{ref}.step({short(call.func.value)})`")
        for after, ref in p.updates:
            ctx.edits.insert_after(after, stmt(f"{ref}.update()\n"))
        ctx.edits.add_import("torch")


_EQUAL = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))


def _append(items, new):
    """``items`` (Args or Params) with ``new`` at the end, in the list's own comma style."""
    items = list(items)
    if not items:
        return [new]
    last = items[-1]
    if isinstance(last.comma, cst.Comma):  # a trailing comma: the new item takes it over
        between = items[-2].comma if len(items) > 1 and isinstance(items[-2].comma, cst.Comma) \
            else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
        return [*items[:-1], last.with_changes(comma=between), new.with_changes(comma=last.comma)]
    return [*items[:-1], last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))), new]


def _add_param(params: cst.Parameters) -> cst.Parameters:
    """``scaler`` after the last positional parameter, or keyword-only when defaults or
    ``*args`` come before it."""
    new = cst.Param(cst.Name(SCALER))
    plain = params.star_arg is cst.MaybeSentinel.DEFAULT and not params.kwonly_params \
        and params.star_kwarg is None and not any(p.default is not None for p in params.params)
    if plain:
        return params.with_changes(params=_append(params.params, new))
    star = params.star_arg if params.star_arg is not cst.MaybeSentinel.DEFAULT else cst.ParamStar()
    return params.with_changes(star_arg=star, kwonly_params=_append(params.kwonly_params, new))
