from __future__ import annotations

import ast
from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import MIXED_PRECISIONS
from accelerate_rewrite.rules.base.plan import code
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.native._plan import casts_to_true_half, native_plan
from accelerate_rewrite.rules.base.half import half_casts

#: optimizers that divide by ``sqrt(state) + eps``: (default eps, eps's position among the arguments)
EPS_OPTIMIZERS = {
    **{f"torch.optim.{name}": (1e-8, 3) for name in ("Adam", "AdamW", "Adamax", "NAdam", "RAdam", "RMSprop")},
    "torch.optim.adam.Adam": (1e-8, 3), "torch.optim.adamw.AdamW": (1e-8, 3),
    "torch.optim.Adadelta": (1e-6, 3), "torch.optim.Adagrad": (1e-10, 5),
}
SAFE_EPS, SAFE_EPS_TEXT = 1e-4, "1e-4"  # measured: fixes the NaN; fp16's smallest normal is 6.1e-5


class HalfAdamEps(Rule):
    """Pure fp16 weights with Adam (or RMSprop, Adagrad, Adadelta): an `eps` that fp16 can hold
    (`eps=1e-4`), not the default 1e-8.

    What it does: with `--precision 16-true` (pure half: Fabric, or AR210 with `--backend
    torch`, casts the model to fp16), every optimizer that divides by `sqrt(state) + eps`
    (Adam, AdamW, Adamax, NAdam, RAdam, RMSprop, Adagrad, Adadelta) whose `eps` (a keyword or
    in its place among the arguments) is the default or smaller than 1e-4 gets `eps=1e-4`, and
    the summary says so. Without that option, a script
    that already trains a `.half()` model with such an optimizer is reported (with the line):
    it NaNs; rerun with `--precision 16-true` (keeps pure half, fixes eps) or a mixed precision.

    Why: fp16 rounds 1e-8 to 0, so Adam divides by `sqrt(v) + 0`: the loss is NaN from the
    second step (measured on fixtures/pure_half: 0.6987, then nan). eps=1e-4 trains (finite).
    RMSprop did the same on an H100 (fixtures/checkpointing at 16-true: NaN at step 2). bf16
    holds 1e-8, so bf16-true needs no fix.

    Kind: approximate (Adam's eps changes; the training it replaces produced NaN).

    Leaves alone (and says why): an `eps` given as an expression it can't evaluate, and
    optimizers built from `*args` / `**kwargs`.
    """

    code = "AR206"
    name = "half-adam-eps"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR206", options={"precision": "16-true"}),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        if ctx.options.precision in MIXED_PRECISIONS:
            return  # AR209 turns pure half into the mixed precision asked for
        half_site = half_casts(f).model_cast
        # fix eps where the weights really end up in fp16: the script's own .half(), Fabric's
        # 16-true, or AR210's cast
        o = ctx.options
        converted = plan(f, o) if o.fabric else native_plan(f, o)  # the precision: apex O3 is 16-true
        fix = converted.precision == "16-true" and (
            half_site is not None or (converted.refusal is None if o.fabric else casts_to_true_half(f, o)))
        if not fix and half_site is None:
            return
        for opt in f.optimizers:
            if opt.qualname not in EPS_OPTIMIZERS or opt.call is None:
                continue
            default, position = EPS_OPTIMIZERS[opt.qualname]
            positional = [a for a in opt.call.args if a.keyword is None and not a.star]
            eps_arg = next((a for a in opt.call.args if a.keyword is not None and a.keyword.value == "eps"),
                           positional[position] if len(positional) > position else None)
            if eps_arg is None and any(a.star for a in opt.call.args):
                ctx.skip(opt.call, "an optimizer built from *args/**kwargs: make sure its eps is >= 1e-4 "
                                   "under fp16")
                continue
            value = _number(eps_arg.value) if eps_arg is not None else default
            if value is not None and value >= SAFE_EPS:
                continue
            name = opt.qualname.rsplit(".", 1)[-1]
            if not fix:
                ctx.skip(opt.call, f"{name} with eps={value:g} trains fp16 weights (`.half()` at line "
                                   f"{f.line(half_site)}): fp16 rounds eps to 0 and the loss turns NaN; "
                                   "rerun with --precision 16-true (keeps pure half, sets eps=1e-4) or "
                                   "--precision 16-mixed")
                continue
            if eps_arg is not None and value is None:
                ctx.skip(eps_arg, f"{name}'s eps={code(eps_arg.value)} left as is: make sure fp16 can "
                                  "hold it (>= 1e-4)")
                continue
            if eps_arg is not None:
                ctx.edits.replace(eps_arg.value, cst.Float(SAFE_EPS_TEXT))
            else:
                ctx.edits.replace(opt.call, _add_eps)
            ctx.change(opt.call, f"warning: {name} eps {value:g} -> {SAFE_EPS_TEXT}: under 16-true, fp16 "
                                 f"rounds {value:g} to 0 (or to a subnormal) and the loss turns NaN")


def _add_eps(call: cst.Call) -> cst.Call:
    eps = cst.Arg(cst.Float(SAFE_EPS_TEXT), keyword=cst.Name("eps"),
                  equal=cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace("")))
    if not call.args:
        return call.with_changes(args=[eps])
    last = call.args[-1]
    trailing = last.comma if isinstance(last.comma, cst.Comma) else cst.MaybeSentinel.DEFAULT
    return call.with_changes(args=[*call.args[:-1], last.with_changes(comma=cst.Comma(
        whitespace_after=cst.SimpleWhitespace(" "))), eps.with_changes(comma=trailing)])


def _number(node: cst.BaseExpression) -> Optional[float]:
    try:
        value = ast.literal_eval(code(node))
    except (ValueError, SyntaxError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
