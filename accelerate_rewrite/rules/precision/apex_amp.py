from __future__ import annotations

from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import CLIP_NORM, CLIP_VALUE
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.apex import apex_use
from accelerate_rewrite.rules.base.plan import FABRIC_CORE, expr, short
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.native._plan import NATIVE_CORE, native_plan


class ApexAmpMigration(Rule):
    """NVIDIA apex.amp becomes Lightning Fabric's precision, or native `torch.amp` with
    `--backend torch`.

    What it does: `model, optimizer = amp.initialize(model, optimizer, opt_level=...)` goes, and
    its opt_level becomes the precision (unless `--precision` is given): O0 32-true, O1 and O2
    16-mixed, O3 16-true (with AR206's Adam eps). With Fabric (the default) that is
    `Fabric(precision=...)`, and `with amp.scale_loss(loss, optimizer) as scaled:
    scaled.backward()` becomes `fabric.backward(loss)`; clipping `amp.master_params(optimizer)`
    becomes `fabric.clip_gradients(model, optimizer, ...)` (AR107); `amp.state_dict()` becomes
    `{}` and `amp.load_state_dict(...)` goes (Fabric's precision keeps its own loss scale). With
    `--backend torch` the precision is AR207's autocast and AR208's one GradScaler (or AR210's
    half weights), the `scale_loss` block becomes `scaler.scale(loss).backward()`
    (`loss.backward()` without a scaler; `num_losses` and `loss_id` go: one scaler serves every
    loss), `amp.master_params(optimizer)` becomes the optimizer's own parameters (AR208
    unscales before the clip), and `amp.state_dict()` / `amp.load_state_dict(...)` become the
    scaler's. Either way apex imports left unused go, and `import apex` used as `apex.amp.*` is
    handled the same way.

    Why: apex.amp is removed from current apex (deprecated since PyTorch 1.6 brought
    torch.cuda.amp): scripts that use it fail where apex is installed new. Native AMP does what
    O1 did. O2 kept fp16 weights with fp32 master copies; 16-mixed keeps the weights in fp32
    (they are the master copy) and autocasts the compute, so O2 scripts train at least as
    precisely as before, with 2 more bytes a parameter of weight memory.

    Kind: approximate (autocast's cast lists are not apex's; the loss scale starts at 65,536
    and adapts as apex's dynamic scale did); safe with `--precision 32-true`, where apex only
    goes (the verifier then requires identical losses).

    The call may name its arguments (`amp.initialize(models=model, optimizers=optimizer)`), and
    its opt_level may come from the command line (`opt_level=args.opt_level`) where the
    script's `add_argument` gives a literal default: that default is used, and the note says
    the flag no longer changes the precision.

    Leaves alone (and says why): an opt_level that is neither a literal nor a flag with a
    literal default (give `--precision`);
    `amp.initialize` whose result is bound to other names; a `scale_loss` block that does more
    than one backward; `amp.load_state_dict(...)` used as a value; everything the Fabric
    conversion (AR101) or native mixed precision (AR207) leaves alone.
    """

    code = "AR211"
    fix = True
    name = "apex-amp-migration"
    kind = Kind.APPROXIMATE
    requires = tuple(c for c in (*FABRIC_CORE, *NATIVE_CORE) if c != "AR211")  # one backend's

    def kind_for(self, options: Options) -> Kind:
        """With `--precision 32-true` the migration keeps the math: apex goes, nothing is cast."""
        return Kind.SAFE if options.precision == "32-true" else self.kind

    def requirements(self, options: Options) -> tuple[str, ...]:
        """The conversion of the backend in use: its edits around apex's are AR211's partners."""
        return tuple(c for c in (FABRIC_CORE if options.fabric else NATIVE_CORE) if c != "AR211")
    examples = (Example.from_files("AR211.fabric"), Example.from_files("AR211", options={"backend": "torch"}))

    def applies(self, options: Options) -> bool:
        return True  # both backends

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        a = apex_use(f)
        if not a.present:
            return
        fabric = ctx.options.fabric
        p = plan(f, ctx.options) if fabric else native_plan(f, ctx.options)
        if p.refusal is not None:
            node, why = p.refusal
            ctx.skip(node, f"apex.amp left as it is: {why}")
            return
        target = f"Fabric at {p.precision or '32-true'}" if fabric else f"{p.precision} with torch.amp"
        for s in a.inits:
            ctx.edits.remove(s)
            level = f" ({a.level})" if a.level else ""
            if a.level_flag:
                level = (f" ({a.level}, the default of `{a.level_flag}`: the command line no longer "
                         "changes the precision; --precision does)")
            note = ("; O2's fp32 master weights are the model's own weights now (fp32), the "
                    "compute is autocast") if a.level == "O2" and p.precision == "16-mixed" else ""
            ctx.change(s, f"apex `amp.initialize`{level} removed: the script runs {target}{note}")
        if fabric:
            self._to_fabric(ctx, a, p)
        else:
            self._to_torch_amp(ctx, p)
        ctx.edits.remove_import_if_unused("apex", "amp")
        ctx.edits.remove_import_if_unused("apex")
        ctx.edits.remove_import_if_unused("apex.amp")

    def _to_fabric(self, ctx: RuleContext, a, p) -> None:
        f = ctx.facts
        calls = {id(s.call): s.call for s in f.backward_sites}
        for call_id, (block, loss) in a.blocks.items():
            ref = p.ref_at(f, block)
            args = [cst.Arg(loss.with_changes(lpar=[], rpar=[])), *calls[call_id].args]
            new = cst.Expr(cst.Call(expr(f"{ref}.backward"), args))

            def to_fabric(u: cst.With, r=ref, c=calls[call_id]) -> cst.SimpleStatementLine:
                # from the updated block: a loss divided by AR302 stays divided
                updated_loss = u.items[0].item.args[0].value.with_changes(lpar=[], rpar=[])
                call = cst.Call(expr(f"{r}.backward"), [cst.Arg(updated_loss), *c.args])
                return cst.SimpleStatementLine([cst.Expr(call)], leading_lines=u.leading_lines)
            ctx.edits.replace(block, to_fabric)
            ctx.change(block, f"apex `scale_loss` block became `{short(new)}`")
        clipped = {id(c.call.args[0].value) for c in f.calls_to(*CLIP_NORM, *CLIP_VALUE) if c.call.args}
        for call in a.master_params:
            if id(call) not in clipped:  # in a clip, AR107 makes it fabric.clip_gradients(model, ...)
                self._optimizer_params(ctx, call)
        for call in a.states:
            ctx.edits.replace(call, expr("{}"))
            ctx.change(call, "`amp.state_dict()` became `{}`: Fabric's precision keeps its own loss "
                             "scale, which this checkpoint no longer carries")
        for call in a.loads:
            ctx.edits.remove(f.statement(call))
            ctx.change(call, "`amp.load_state_dict(...)` removed: Fabric's precision keeps its own "
                             "loss scale")

    @staticmethod
    def _scaled_backward(call: cst.Call, loss: cst.BaseExpression, ref: Optional[str]) -> cst.Expr:
        """``scaler.scale(loss).backward(...)`` (``loss.backward(...)`` without a scaler)."""
        if ref:
            head = cst.Call(expr(f"{ref}.scale"), [cst.Arg(loss.with_changes(lpar=[], rpar=[]))])
        elif isinstance(loss, (cst.Name, cst.Attribute, cst.Call, cst.Subscript)) or loss.lpar:
            head = loss
        else:
            head = loss.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
        return cst.Expr(call.with_changes(func=call.func.with_changes(value=head)))

    def _to_torch_amp(self, ctx: RuleContext, p) -> None:
        f = ctx.facts
        for site, ref in p.backwards:
            if not site.apex:
                continue
            new = self._scaled_backward(site.call, site.loss, ref)

            def to_torch(u: cst.With, r=ref, c=site.call) -> cst.SimpleStatementLine:
                # from the updated block: a loss divided by AR302 stays divided
                line = self._scaled_backward(c, u.items[0].item.args[0].value, r)
                return cst.SimpleStatementLine([line], leading_lines=u.leading_lines)
            ctx.edits.replace(site.stmt, to_torch)
            ctx.change(site.stmt, f"apex `scale_loss` block became `{short(new)}`")
        for call in p.apex_master_params:
            self._optimizer_params(ctx, call)
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

    @staticmethod
    def _optimizer_params(ctx: RuleContext, call: cst.Call) -> None:
        if not call.args:
            return
        opt = short(call.args[0].value, 200)
        ctx.edits.replace(call, expr(f'(p for group in {opt}.param_groups for p in group["params"])'))
        ctx.change(call, "`amp.master_params(...)` became the optimizer's own parameters")
