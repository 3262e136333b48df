from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.ddp.wraps import repeated_assignment, unmoved
from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.plan import FabricRule, core_except, code
from accelerate_rewrite.rules.fabric._plan import plan


class FabricDataParallel(FabricRule):
    """Remove `nn.DataParallel`: Fabric's strategy takes its place.

    What it does: drops `model = nn.DataParallel(model)` (and the `if torch.cuda.device_count()
    > 1:` around it when nothing else is left in it), and `net = nn.DataParallel(m)` that would
    repeat an earlier `net = m`; elsewhere `nn.DataParallel(m, ...)` becomes `m`. `model.module`
    keeps working on a model set up by Fabric; read before the set-up (the optimizer over
    `model.module.parameters()`), where the model is bare now, it becomes `model`.

    Why: DataParallel is single-process and slower than DDP; `--devices N` (and `--strategy`)
    give Fabric's DDP (or FSDP, DeepSpeed) instead. Wrapping a model twice breaks set-up.

    Kind: safe (one device trains the same; several devices train with DDP, which PyTorch
    recommends over DataParallel).
    """

    code = "AR102"
    name = "fabric-data-parallel"
    kind = Kind.SAFE
    requires = core_except("AR102")
    examples = (Example.from_files("AR102"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        if plan(f, ctx.options).refusal is not None:
            return
        for site in f.data_parallel():
            call = site.call
            if not call.args:
                continue
            inner = call.args[0].value
            s = f.statement(call)
            guard = f.parent(f.block(s))
            if isinstance(guard, cst.If) and guard.orelse is None and "device_count" in code(guard.test) \
                    and all(x is s or _is_print(x) for x in guard.body.body):
                # ``if torch.cuda.device_count() > 1: print(...); model = nn.DataParallel(model)``
                ctx.edits.remove(guard)
            elif m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()], value=m.Call())])) \
                    and unmoved(s.body[0].value) is call \
                    and code(s.body[0].targets[0].target) == code(unmoved(inner)):
                # ``model = nn.DataParallel(model)``, ``model = nn.DataParallel(model).cuda()``,
                # ``model = nn.DataParallel(model.cuda())`` (not ``model = model``)
                ctx.edits.remove(s)
            elif repeated_assignment(f, call, set()) is not None:
                # ``net = ssd_net`` before ``if args.cuda: net = nn.DataParallel(ssd_net)``
                ctx.edits.remove(s)
            else:
                ctx.edits.replace(call, lambda updated: updated.args[0].value)
            ctx.change(call, "removed nn.DataParallel: Fabric's strategy replaces it (use --devices N)")
            for read in _module_reads_before_setup(f, ctx, s):
                ctx.edits.replace(read, lambda updated: updated.value)
                ctx.change(read, f"`{code(read)}` became `{code(read.value)}`: the model is no longer wrapped "
                                 "there (Fabric's set-up model has `.module` again)")


def _is_print(statement: cst.BaseStatement) -> bool:
    return m.matches(statement, m.SimpleStatementLine(body=[m.Expr(m.Call(func=m.Name("print")))]))


def _module_reads_before_setup(f, ctx: RuleContext, stmt: cst.BaseStatement) -> list[cst.Attribute]:
    """``model.module`` read after ``model = nn.DataParallel(model)`` is gone and before Fabric
    sets the model up (deeplab's ``get_params(model.module, key="1x")`` for the optimizer, or
    ``model.module.base.freeze_bn()``): the bare model has no ``.module``; after the set-up the
    wrapper has one again. In the statement's own function (or top level); everywhere after it
    when the model is never set up."""
    if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())])])):
        return []
    target = stmt.body[0].targets[0].target
    key = f.key_of(target)
    if key is None:
        return []
    group = plan(f, ctx.options).group_of(f, key)
    start = f.end_line(stmt)
    end = f.end_line(group.after) if group is not None else None
    func = f.function(stmt)
    out = []
    for read in f.find(m.Attribute(value=m.Name(target.value), attr=m.Name("module"))):
        line = f.line(read)
        if line > start and (end is None or line <= end) and f.function(read) is func \
                and f.key_of(read.value) == key:
            out.append(read)
    return out
