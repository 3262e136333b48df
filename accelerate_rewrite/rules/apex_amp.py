from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.facts import APEX_INITIALIZE, APEX_SCALE_LOSS
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules._fabric import expr, short
from accelerate_rewrite.rules._native import core_except, native_plan


class ApexAmpMigration(Rule):
    """NVIDIA apex.amp becomes native `torch.amp` (with `--backend torch`).

    What it does: `model, optimizer = amp.initialize(model, optimizer, opt_level=...)` goes, and
    its opt_level becomes the precision (unless `--precision` is given): O0 32-true, O1 and O2
    16-mixed (AR207's autocast and AR208's one GradScaler), O3 16-true (AR210's fp16 weights,
    AR206's Adam eps). `with amp.scale_loss(loss, optimizer[, loss_id=k]) as scaled: scaled.backward()`
    becomes `scaler.scale(loss).backward()` (`loss.backward()` at 32-true; `num_losses` and
    `loss_id` go: one scaler serves every loss), `amp.master_params(optimizer)` in clipping
    becomes the optimizer's own parameters (AR208 unscales before the clip),
    `amp.state_dict()` / `amp.load_state_dict(...)` become the scaler's, and apex imports left
    unused go. `import apex` used as `apex.amp.*` is handled the same way.

    Why: apex.amp is removed from current apex (deprecated since PyTorch 1.6 brought
    torch.cuda.amp): scripts that use it fail where apex is installed new. Native AMP does what
    O1 did. O2 kept fp16 weights with fp32 master copies; 16-mixed keeps the weights in fp32
    (they are the master copy) and autocasts the compute, so O2 scripts train at least as
    precisely as before, with 2 more bytes a parameter of weight memory.

    Kind: approximate (autocast's cast lists are not apex's; the loss scale starts at 65,536
    and adapts as apex's dynamic scale did).

    Leaves alone (and says why): with `--backend fabric` (the Fabric conversion refuses apex
    scripts: migrate first, then convert); an opt_level that is not a literal (give
    `--precision`); `amp.initialize` whose result is bound to other names; a `scale_loss` block
    that does more than one backward; everything native mixed precision leaves alone (AR207).
    """

    code = "AR211"
    name = "apex-amp-migration"
    kind = Kind.APPROXIMATE
    requires = core_except("AR211")
    examples = (Example.from_files("AR211", options={"backend": "torch"}),)

    def applies(self, options: Options) -> bool:
        return not options.fabric

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = native_plan(f, ctx.options)
        if not f.calls_named(*APEX_INITIALIZE, *APEX_SCALE_LOSS):
            return
        if p.refusal is not None:
            node, why = p.refusal
            ctx.skip(node, f"apex.amp left as it is: {why}")
            return
        for s in p.apex_inits:
            ctx.edits.remove(s)
            level = f" ({p.apex_level})" if p.apex_level else ""
            note = (": O2's fp32 master weights are the model's own weights now (fp32), the "
                    "compute is autocast") if p.apex_level == "O2" else ""
            ctx.change(s, f"apex `amp.initialize`{level} removed: the script runs {p.precision} "
                          f"with torch.amp{note}")
        for site, ref in p.backwards:
            if not site.apex:
                continue
            loss = site.loss.with_changes(lpar=[], rpar=[])
            head = cst.Call(expr(f"{ref}.scale"), [cst.Arg(loss)]) if ref else site.loss
            new = cst.Expr(site.call.with_changes(func=site.call.func.with_changes(value=head)))
            ctx.edits.replace(site.stmt, lambda u, n=new: cst.SimpleStatementLine(
                [n], leading_lines=u.leading_lines))
            ctx.change(site.stmt, f"apex `scale_loss` block became `{short(new)}`")
        for call in p.apex_master_params:
            opt = call.args[0].value if call.args else None
            if opt is None:
                continue
            ctx.edits.replace(call, expr(f'(p for group in {short(opt, 200)}.param_groups for p in group["params"])'))
            ctx.change(call, "`amp.master_params(...)` became the optimizer's own parameters")
        for call, ref in p.apex_states:
            ctx.edits.replace(call, expr(f"{ref}.state_dict()" if ref else "{}"))
            ctx.change(call, f"`amp.state_dict()` became `{ref}.state_dict()`" if ref
                       else "`amp.state_dict()` became `{}`: no loss scale at this precision")
        for call, ref in p.apex_loads:
            if ref:
                ctx.edits.replace(call, lambda u, r=ref: u.with_changes(func=expr(f"{r}.load_state_dict")))
                ctx.change(call, f"`amp.load_state_dict(...)` became `{ref}.load_state_dict(...)`")
            else:
                ctx.edits.remove(f.statement(call))
                ctx.change(call, "`amp.load_state_dict(...)` removed: no loss scale at this precision")
        ctx.edits.remove_import_if_unused("apex", "amp")
        ctx.edits.remove_import_if_unused("apex")
        ctx.edits.remove_import_if_unused("apex.amp")
