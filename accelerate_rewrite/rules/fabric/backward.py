from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.apex import apex_use
from accelerate_rewrite.rules.base.plan import FabricRule, core_except, expr, short
from accelerate_rewrite.rules.fabric._plan import library_backward, plan


class FabricBackward(FabricRule):
    """Every backward goes through Fabric: `loss.backward()` becomes `fabric.backward(loss)`.

    What it does: rewrites each backward site, whatever its shape: `loss.backward()`,
    `loss.mean().backward()`, `self.loss.backward()`, `scaler.scale(loss).backward()`, a
    backward inside an LBFGS closure; arguments such as `retain_graph=True` are kept.

    Why: mixed precision, FSDP and DeepSpeed refuse a plain `loss.backward()` ("The current
    strategy and precision selection requires you to call fabric.backward(loss)"); Fabric
    scales the loss and lets the strategy hook in.

    Kind: safe.

    Leaves alone: a backward where `fabric` can't be reached (a helper function with no
    `fabric` passed in), and says where; a library's loss scaler called with the loss
    (`loss_scaler(loss, optimizer, ...)`, timm's `NativeScaler`: codemod/analysis/libraries.py), which
    runs backward and the step itself with the script's own GradScaler: under DDP that is the
    backward Fabric would run (Fabric's precision is then not set, and FSDP and DeepSpeed,
    which need `fabric.backward`, are refused: rules/fabric/_plan.py).
    """

    code = "AR106"
    name = "fabric-backward"
    kind = Kind.SAFE
    requires = core_except("AR106")
    examples = (Example.from_files("AR106"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = plan(f, ctx.options)
        if p.refusal is not None:
            return
        apex_blocks = apex_use(f).blocks
        for site in f.backward_sites:
            if id(site.call) in apex_blocks:
                continue  # AR211 turns apex's scale_loss block into fabric.backward(loss)
            if site.library is not None:
                ctx.skip(site.call, library_backward(site))
                continue
            ref = p.ref_at(f, site.call)
            if ref is None or not p.after_creation(f, site.call):
                ctx.skip(site.call, f"`{short(site.call)}` left as is: `fabric` can't be reached here")
                continue
            ctx.edits.replace(site.call, lambda u, r=ref: cst.Call(
                func=expr(f"{r}.backward"),
                # ``(a - b).backward()`` -> ``fabric.backward(a - b)``: an argument needs no parens
                args=[cst.Arg(u.func.value.with_changes(lpar=[], rpar=[])), *u.args]))
            ctx.change(site.call, f"`{short(site.loss)}.backward()` became `{ref}.backward({short(site.loss)})`")
