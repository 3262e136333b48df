from __future__ import annotations

import ast
from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules._fabric import code, plan
from accelerate_rewrite.rules._native import casts_to_true_half
from accelerate_rewrite.rules._half import half_casts

ADAM_FAMILY = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.Adamax", "torch.optim.NAdam",
               "torch.optim.RAdam", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW")
SAFE_EPS, SAFE_EPS_TEXT = 1e-4, "1e-4"  # measured: fixes the NaN; fp16's smallest normal is 6.1e-5


class HalfAdamEps(Rule):
    """Pure fp16 weights with Adam: an `eps` that fp16 can hold (`eps=1e-4`), not the default 1e-8.

    What it does: with `--precision 16-true` (pure half: Fabric casts the model to fp16), every
    Adam-family optimizer (Adam, AdamW, Adamax, NAdam, RAdam) whose `eps` is the default or
    smaller than 1e-4 gets `eps=1e-4`, and the summary says so. Without that option, a script
    that already trains a `.half()` model with such an optimizer is reported (with the line):
    it NaNs; rerun with `--precision 16-true` (keeps pure half, fixes eps) or a mixed precision.

    Why: fp16 rounds 1e-8 to 0, so Adam divides by `sqrt(v) + 0`: the loss is NaN from the
    second step (measured on fixtures/pure_half: 0.6987, then nan). eps=1e-4 trains (finite).
    bf16 holds 1e-8, so bf16-true needs no fix.

    Kind: approximate (Adam's eps changes; the training it replaces produced NaN).

    Leaves alone (and says why): an `eps` given as an expression it can't evaluate.
    """

    code = "AR206"
    name = "half-adam-eps"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR206", options={"precision": "16-true"}),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        if ctx.options.precision in ("16-mixed", "bf16-mixed"):
            return  # AR209 turns pure half into the mixed precision asked for
        half_site = half_casts(f).model_cast
        # fix eps where the weights really end up in fp16: the script's own .half(), Fabric's
        # 16-true, or AR210's cast
        fix = ctx.options.precision == "16-true" and (
            half_site is not None or (plan(f, ctx.options).refusal is None if ctx.options.fabric
                                      else casts_to_true_half(f, ctx.options)))
        if not fix and half_site is None:
            return
        for opt in f.optimizers:
            if opt.qualname not in ADAM_FAMILY or opt.call is None:
                continue
            eps_arg = next((a for a in opt.call.args if a.keyword is not None and a.keyword.value == "eps"), None)
            value = _number(eps_arg.value) if eps_arg is not None else 1e-8
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
                                 "rounds 1e-8 to 0 and the loss turns NaN from the second step")


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
