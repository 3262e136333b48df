from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.libraries import COPIERS
from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.codemod.analysis.syntax import passed_at, positional_params
from accelerate_rewrite.rules.base.plan import FabricRule, code, core_except, expr, short, stmt
from accelerate_rewrite.rules.fabric._plan import plan


class FabricSetup(FabricRule):
    """Set each model up with its optimizers: `model, optimizer = fabric.setup(model, optimizer)`.

    What it does: after the statement that builds a model's optimizer(s), adds one
    `fabric.setup(model, *optimizers)` call per model (a GAN gets two). With `--strategy
    fsdp`, the model is set up before its optimizer is built (`fabric.setup_module`, then
    `fabric.setup_optimizers`), as FSDP prefers.

    Methods of the model's class other than `forward` that the script calls on the model
    (`model.decode(z)`, `model.sample(n)`) are marked: `model.mark_forward_method("decode")`
    right after the setup (with DDP or FSDP, Fabric raises on an unmarked one that runs the
    model's layers).

    Why: set-up moves the model to the device, wraps it for the strategy (DDP, FSDP, ...) and
    the precision (autocast in forward), and wraps the optimizer so that steps go through them.

    Kind: safe (keeps the math at 32-true).

    Leaves alone: an optimizer whose parameters come from several models, or from something it
    can't trace to a model; then nothing of the Fabric conversion is applied (a model that is
    not set up would silently miss the precision and the strategy). An optimizer over tensors
    (`optim.LBFGS([input_img])`, style transfer) has nothing to set up: at 32-true on one device
    the rest converts (backward, device) and the note says so; otherwise nothing is converted.
    An optimizer class of the script's own (or of a module of its project) deriving from
    `torch.optim.Optimizer`, such as SAM with its `first_step` / `second_step`, is set up like
    any other; its own steps don't go through Fabric's GradScaler, so 16-mixed is left out (the
    note says why: use bf16-mixed).
    """

    code = "AR103"
    name = "fabric-setup"
    kind = Kind.SAFE
    requires = core_except("AR103")
    examples = (Example.from_files("AR103", options={"strategy": "fsdp"}),)

    def rewrite(self, ctx: RuleContext) -> None:
        p = plan(ctx.facts, ctx.options)
        if p.refusal is not None:
            return
        fsdp = (ctx.options.strategy or "").startswith("fsdp")
        for opt in p.tensor_optimizers:
            ctx.skip(opt.stmt, f"`{opt.path}` optimizes tensors (`{short(opt.call.args[0].value)}`), not a "
                               "model's parameters: nothing to set up (Fabric takes the backward and the device)")
        joint: dict[int, list] = {}  # id(after) -> the joint groups set up there
        for group in p.setups:
            if group.joint:
                joint.setdefault(id(group.after), []).append(group)
                continue
            opts = [o.set_up_as for o in group.optimizers]
            ref = group.ref
            # (Accelerate marks none: on several processes such a call reads the module, unwrapped)
            marks = [] if ctx.options.accelerate else [stmt(f'{group.model}.mark_forward_method("{name}")\n')
                                                       for name in group.forward_methods]
            if marks:
                listed = ", ".join(f"`{n}`" for n in group.forward_methods)
                ctx.change(group.after, f"marked {listed} of `{group.model}` as forward methods: the script "
                                        "calls them on the set-up model, and with DDP or FSDP Fabric only "
                                        "lets marked methods run the wrapped module")
            if fsdp and len(group.optimizers) == 1 and group.after is group.optimizers[0].stmt:
                opt = group.optimizers[0]
                ctx.edits.insert_before(opt.stmt, stmt(f"{group.model} = {ref}.setup_module({group.model})\n"),
                                        *marks)
                ctx.edits.insert_after(opt.stmt, stmt(f"{opt.path} = {ref}.setup_optimizers({opt.path})\n"))
                ctx.change(opt.stmt, f"set `{group.model}` up before its optimizer is built (FSDP), then `{opt.path}`")
                continue
            names = ", ".join([group.model, *opts])
            ctx.edits.insert_after(group.after, stmt(f"{names} = {ref}.setup({names})\n"), *marks)
            ctx.change(group.after, f"set up `{names}` with Fabric")
            if group.otherwise is not None:
                alone = stmt(f"{group.model} = {ref}.setup({group.model})\n")
                guard = group.otherwise
                if guard.orelse is None:
                    ctx.edits.replace(guard, lambda u, a=alone, ms=marks: u.with_changes(
                        orelse=cst.Else(body=cst.IndentedBlock(body=[a, *ms]))))
                else:
                    ctx.edits.insert_after(guard.orelse.body.body[-1], alone, *marks)
                ctx.change(guard, f"`{', '.join(opts)}` is built only under `if {short(guard.test)}:`: set up "
                                  f"with `{group.model}` there, `{group.model}` alone otherwise")
        for groups in joint.values():
            self._joint(ctx, groups)
        if ctx.options.many_devices and not ctx.options.accelerate:
            self._copied(ctx, p)
        # --backend accelerate on several processes (rules/fabric/_wrapped.py); in the file's order (the
        # places are found through sets: two on one line came in either order)
        for node in sorted(p.unwraps, key=lambda n: (ctx.facts.line(n), ctx.facts.column(n))):
            ref = p.ref_at(ctx.facts, node)
            # ``ddp_model.module``, the script's own unwrap: the module, as Accelerate unwraps it
            ctx.edits.replace(node, lambda u, r=ref: expr(f"{r}.unwrap_model({code(u.value if m.matches(u, m.Attribute(attr=m.Name('module'))) else u)})"))
            ctx.change(node, f"`{short(node)}` read through `{ref}.unwrap_model(...)`: Accelerate's prepared "
                             "model is DistributedDataParallel on several processes")
        for node in sorted(p.inner_reads, key=lambda n: (ctx.facts.line(n), ctx.facts.column(n))):
            ctx.edits.replace(node, lambda u: cst.Attribute(value=u, attr=cst.Name("optimizer")))
            ctx.change(node, f"`{short(ctx.facts.parent(node))}` read on `{code(node)}.optimizer`, the optimizer "
                             "itself: the one Accelerate prepares answers an optimizer's own methods only")

    @staticmethod
    def _copied(ctx: RuleContext, p) -> None:
        """``copy.deepcopy(model)`` (an EMA's copy) of a set-up model on several processes: the
        copy of ``model.module``, the module itself, as the original copied it; Fabric's wrapper
        holds DistributedDataParallel there, which can't be copied (codemod/analysis/libraries.py)."""
        f = ctx.facts
        for site in f.calls:
            where = COPIERS.get(site.qualname)
            value = passed_at(site.call, where.index, where.keyword) if where is not None else None
            group = p.group_of(f, f.key_of(value)) if value is not None else None
            if group is None or not isinstance(value, (cst.Name, cst.Attribute)):
                continue
            func, home = f.function(site.call), f.function(group.after)
            params = positional_params(func) if isinstance(func, cst.FunctionDef) else []
            after = f.line(site.call) > f.end_line(group.after) if func is home else (
                isinstance(value, cst.Name) and any(prm.name.value == value.value for prm in params))
            if not after:
                continue
            ctx.edits.replace(value, lambda u: cst.Attribute(value=u, attr=cst.Name("module")))
            ctx.change(site.call, f"`{short(site.call)}` copies `{short(value)}.module`, the module: Fabric's "
                                  "wrapper holds DistributedDataParallel on several processes, which can't be copied")

    @staticmethod
    def _joint(ctx: RuleContext, groups) -> None:
        """Models an optimizer trains together: each model set up alone, then the optimizers."""
        ref, after = groups[0].ref, groups[0].after
        lines = []
        for group in groups:
            lines.append(stmt(f"{group.model} = {ref}.setup_module({group.model})\n"))
            lines += [stmt(f'{group.model}.mark_forward_method("{name}")\n') for name in group.forward_methods]
        opts = list(dict.fromkeys(o.set_up_as for g in groups for o in g.optimizers))
        names = ", ".join(opts)
        lines.append(stmt(f"{names} = {ref}.setup_optimizers({names})\n"))
        ctx.edits.insert_after(after, *lines)
        models = ", ".join(f"`{g.model}`" for g in groups)
        ctx.change(after, f"set up {models} with Fabric one by one (setup_module), then `{names}` "
                          "(setup_optimizers): an optimizer trains several of them")
