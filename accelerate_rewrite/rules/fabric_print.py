from __future__ import annotations

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
import libcst.matchers as m

from accelerate_rewrite.codemod.facts import code
from accelerate_rewrite.rules._fabric import FabricRule, FABRIC_CORE, expr, plan, short
from accelerate_rewrite.rules.fabric_checkpoint import rank_guard


class FabricPrint(FabricRule):
    """Print once, not once per process: `print(...)` becomes `fabric.print(...)`.

    What it does: in the code that runs after Fabric is created (the training path, and the
    functions `fabric` is passed into), `print(...)` becomes `fabric.print(...)`, with the same
    arguments.

    Why: with several devices every process runs the script; `fabric.print` prints on rank 0
    only.

    Kind: safe (prints the same on one device).

    Fabric is created before the prints just above the place it needs to be (`print(args)`,
    `print("Random Seed: ", seed)` after the arguments are parsed), so that they become
    `fabric.print` too.

    Leaves alone: prints before Fabric exists, and in functions that `fabric` does not reach;
    with several devices, each of them is listed as printing on every process
    (`sys.stdout.write` is AR110's: a write, on rank 0).
    """

    code = "AR108"
    name = "fabric-print"
    kind = Kind.SAFE
    requires = FABRIC_CORE
    examples = (Example.from_files("AR108"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = plan(f, ctx.options)
        if p.refusal is not None:
            return
        converted = []
        many = ctx.options.many_devices
        for call in f.prints:
            ref = p.ref_at(f, call)
            if ref is None or not p.after_creation(f, call):
                if many and rank_guard(f, call) is None:
                    ctx.skip(call, f"`{short(call)}` prints on every process: " + (
                        "it runs before Fabric exists" if ref is not None else "`fabric` can't be reached here"))
                continue
            if p.ddp is not None:
                func = f.function(call)
                ranks = p.ddp.rank_names.get(id(func) if func is not None else None, set())
                cls = f.enclosing_class(func) if func is not None else None
                attrs = p.ddp.rank_names.get(id(cls), set()) if cls is not None else set()
                named = sorted({n.value for n in m.findall(call, m.Name()) if n.value in ranks}
                               | {code(a) for a in m.findall(call, m.Attribute()) if code(a) in attrs})
                if named:
                    ctx.skip(call, f"`{short(call)}` prints on every process, as before: it names the "
                                   f"rank (`{named[0]}`)")
                    continue
            ctx.edits.replace(call.func, expr(f"{ref}.print"))
            converted.append(call)
        if converted:
            lines = ", ".join(str(f.line(c)) for c in converted)
            ctx.change(converted[0], f"print(...) became fabric.print(...) (rank 0 only) on lines {lines}")
