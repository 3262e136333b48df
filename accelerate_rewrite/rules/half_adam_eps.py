from __future__ import annotations

import ast
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.facts import MODEL, ScriptFacts, unwrap_moves
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules._fabric import code

ADAM_FAMILY = ("torch.optim.Adam", "torch.optim.AdamW", "torch.optim.Adamax", "torch.optim.NAdam",
               "torch.optim.RAdam", "torch.optim.adam.Adam", "torch.optim.adamw.AdamW")
SAFE_EPS, SAFE_EPS_TEXT = 1e-4, "1e-4"  # measured: fixes the NaN; fp16's smallest normal is 6.1e-5
HALF = m.Call(func=m.Attribute(attr=m.Name("half"))) | m.Call(
    func=m.Attribute(attr=m.Name("to")),
    args=[m.ZeroOrMore(), m.Arg(value=m.Attribute(attr=m.Name("float16") | m.Name("half"))), m.ZeroOrMore()],
)


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
        fix = ctx.options.precision == "16-true"
        half_site = None if fix else _pure_half_site(f)
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


def _pure_half_site(f: ScriptFacts) -> Optional[cst.CSTNode]:
    """A `.half()` / `.to(torch.float16)` on a model an optimizer trains, in a script that trains."""
    if not f.backward_sites:
        return None
    for call in f.attribute_calls:
        if m.matches(call, HALF):
            statement = f.statement(call)
            if m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
                key = f.key_of(statement.body[0].targets[0].target)  # model = Net().half()
            else:
                key = f.key_of(unwrap_moves(call))  # model.half()
            if key is not None and MODEL in f.kinds.get(key, set()):
                return call
    return None


def _number(node: cst.BaseExpression) -> Optional[float]:
    try:
        value = ast.literal_eval(code(node))
    except (ValueError, SyntaxError):
        return None
    return float(value) if isinstance(value, (int, float)) else None
