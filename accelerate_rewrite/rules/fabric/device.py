from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.codemod.analysis.facts import init_of
from accelerate_rewrite.rules.base.plan import FabricRule, core_except, NAME, code, expr, insert_at_top, short, stmt
from accelerate_rewrite.rules.fabric._plan import plan


class FabricDevice(FabricRule):
    """Let Fabric place things: no more `.to(device)` on models and batches.

    What it does: removes `.to(device)` / `.cuda()` / `.to(0)` on models that Fabric sets up
    and on batches from loaders it sets up (a statement left doing nothing, such as
    `x, y = x.to(device), y.to(device)` or `model.to(device)`, goes whole); other moves and
    uses of the device (`torch.zeros(..., device=device)`, a metric's `.to(device)`) become
    `fabric.device`. A `device` parameter threaded through functions (`train(model, loader,
    device)`, a Trainer keeping `self.device`) becomes `fabric` (`self.fabric`), and the call
    sites pass `fabric`. A function or class of the script that needs `fabric` where it can't
    be reached (a backward or an optimizer in `Trainer`'s methods, a read of the rank in
    `setup()`) and is called only where it can, receives it as a new first parameter (a class:
    after `self` in `__init__`, kept in `self.fabric`). The device definition goes once
    nothing uses it.

    Why: Fabric decides the device of every process; a hard-coded `cuda` or `cuda:0` is wrong
    on the second GPU, and moves that Fabric already does are noise.

    Kind: safe.

    Leaves alone (and says why): uses of the device that are not a placement (comparisons
    with a string, `torch.autocast(device)`, ...): the device definition then stays for them;
    tensors a model's methods make without a device (`torch.zeros(...)` in `forward`): they
    were on the CPU in the original too, and the note says how to make them follow the model.
    """

    code = "AR105"
    name = "fabric-device"
    kind = Kind.SAFE
    requires = core_except("AR105")
    examples = (Example.from_files("AR105"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f, e = ctx.facts, ctx.edits
        p = plan(f, ctx.options)
        if p.refusal is not None:
            return
        trivial = {id(s) for s in p.trivial_stmts}
        for s in p.trivial_stmts:
            e.remove(s)
            ctx.change(s, f"removed `{short(s.body[0])}`: Fabric places it")
        for d in p.moves:
            call = d.move.call
            if d.action == "remove":
                e.replace(call, lambda u: u.func.value)
                if id(f.statement(call)) not in trivial:
                    ctx.change(call, f"removed `.{call.func.attr.value}(...)` on `{short(d.move.receiver)}`: Fabric places it")
            elif d.move.device_arg is None:  # .cuda() on something Fabric does not set up
                e.replace(call, lambda u, r=d.ref: u.with_changes(
                    func=u.func.with_changes(attr=cst.Name("to")),
                    args=[cst.Arg(expr(f"{r}.device")), *[a for a in u.args if a.keyword is not None]],
                ))
                ctx.change(call, f"`.cuda()` on `{short(d.move.receiver)}` became `.to({d.ref}.device)`")
            else:
                e.replace(d.move.device_arg.value, expr(f"{d.ref}.device"))
        for node, new in p.device_uses:
            e.replace(node, expr(new))
        for arg, ref in p.thread_args:
            e.replace(arg, lambda u, r=ref: u.with_changes(
                value=expr(r), keyword=cst.Name(NAME) if u.keyword is not None else None))
        for func_id, param in p.threaded_params.items():
            e.replace(param, lambda u: u.with_changes(name=cst.Name(NAME), annotation=None))
            ctx.change(param, f"parameter `{param.name.value}` became `{NAME}` (its callers pass it)")
        for target in p.added_params.values():
            _add_parameter(ctx, p, target)
        for cls_id, attr in p.threaded_attrs.items():
            for node in _attr_assignments(f, cls_id, attr):
                e.replace(node, lambda u: u.with_changes(
                    targets=[cst.AssignTarget(expr(f"self.{NAME}"))], value=cst.Name(NAME)))
                ctx.change(node, f"`{attr}` became `self.{NAME}`")
        for b in p.removed_device_defs:
            e.remove(b.stmt)
            ctx.change(b.stmt, f"removed `{b.path} = ...`: Fabric chooses the device")
        for call, flag in _flags_feeding(f, [b.value for b in p.removed_device_defs]):
            ctx.skip(call, f"the command-line flag `{flag}` no longer chooses the device (the line that "
                           "read it for that is gone): Fabric does; to run on the CPU, give "
                           "Fabric(accelerator=\"cpu\") or set LT_ACCELERATOR=cpu")
        reported: set[str] = set()
        for node, why in p.device_keeps:
            if why not in reported:
                reported.add(why)
                ctx.skip(node, why)
        for node, why in p.move_skips:
            ctx.skip(node, why)
        for call, where in _deviceless_tensors(f):
            ctx.skip(call, f"`{short(call)}` in `{where}` makes its tensor on the CPU whatever device "
                           "Fabric gives the model (as it did in the original): pass "
                           "`device=` of an input (`x.device`) for it to follow the model")


def _add_parameter(ctx: RuleContext, p, target) -> None:
    """`fabric` as a new first parameter of a function (after ``self`` in a class's
    ``__init__``, which keeps it in ``self.fabric``), passed by every call."""
    f, e = ctx.facts, ctx.edits
    fabric = cst.Param(cst.Name(NAME))
    if isinstance(target, cst.ClassDef):
        init = init_of(target)
        e.replace(init.params, lambda u: u.with_changes(params=[u.params[0], fabric, *u.params[1:]]))
        insert_at_top(e, init, [stmt(f"self.{NAME} = {NAME}\n")])
        what = f"`{target.name.value}(...)` receives `{NAME}` (its callers pass it) and keeps it in `self.{NAME}`"
    else:
        e.replace(target.params, lambda u: u.with_changes(params=[fabric, *u.params]))
        what = f"`{target.name.value}` receives `{NAME}` as its first parameter (its callers pass it)"
    for call in f.functions[target.name.value].calls:
        ref = p.ref_at(f, call)
        e.replace(call, lambda u, r=ref: u.with_changes(args=[cst.Arg(expr(r)), *u.args]))
    ctx.change(target, what)


#: torch functions that make a tensor on the default (CPU) device unless given ``device=``
FACTORIES = {f"torch.{name}" for name in (
    "zeros", "ones", "empty", "full", "rand", "randn", "randint", "randperm", "arange",
    "linspace", "eye", "tensor")}


def _deviceless_tensors(f):
    """``torch.zeros(...)`` and the like, without ``device=`` and not moved after, in the
    methods (``__init__`` aside: a buffer moves with the model) of the script's nn.Module
    classes: on a GPU they stay on the CPU while the model does not."""
    out = []
    for site in f.calls:
        if site.qualname not in FACTORIES or any(
                a.keyword is not None and a.keyword.value == "device" for a in site.call.args):
            continue
        func = f.function(site.call)
        cls = f.enclosing_class(func) if func is not None else None
        if cls is None or cls.name.value not in f.module_classes or func.name.value == "__init__":
            continue
        parent = f.parent(site.call)
        if isinstance(parent, cst.Attribute) and parent.attr.value in ("to", "cuda", "type_as"):
            continue
        out.append((site.call, f"{cls.name.value}.{func.name.value}"))
    return out


def _flags_feeding(f, values):
    """``parser.add_argument("--no-cuda", ...)`` calls whose value fed the removed device
    definitions: ``args.no_cuda`` read there, or in the value of a name read there
    (``use_cuda = not args.no_cuda and ...``)."""
    import libcst.matchers as m
    from libcst.metadata.scope_provider import ImportAssignment

    attrs: set[str] = set()
    seen: set[int] = set()
    todo = list(values)
    while todo:
        value = todo.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        for node in f.find_in(value, m.Attribute(value=m.Name()) | m.Name()):
            if isinstance(node, cst.Attribute):
                scope = f.scope(node.value)
                imported = scope is not None and any(
                    isinstance(a, ImportAssignment) for a in scope[node.value.value])
                if not imported:  # ``args.no_cuda``, not ``torch.cuda``
                    attrs.add(node.attr.value)
            else:
                assigned = f.assigned_value(node)
                if assigned is not None:
                    todo.append(assigned)
    from accelerate_rewrite.codemod.analysis.flags import flags

    return [(flag.call, flag.flag) for dest, flag in flags(f).items() if dest in attrs]


def _attr_assignments(facts, cls_id: int, attr: str):
    import libcst.matchers as m

    for cls in facts.find(m.ClassDef()):
        if id(cls) == cls_id:
            for node in facts.find_in(cls, m.Assign(targets=[m.AssignTarget(m.Attribute(m.Name("self")))])):
                if code(node.targets[0].target) == attr and isinstance(node.value, cst.Name):
                    yield node
