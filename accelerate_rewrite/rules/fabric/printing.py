from __future__ import annotations

from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
import libcst as cst

from accelerate_rewrite.rules.base.plan import FabricRule, FABRIC_CORE, expr, names_rank, rank_guard, short
from accelerate_rewrite.rules.fabric._plan import plan


#: progress bars: each process would draw its own
_PROGRESS_BARS = ("tqdm.tqdm", "tqdm.auto.tqdm", "tqdm.notebook.tqdm", "tqdm.std.tqdm", "tqdm.trange",
                  "tqdm.auto.trange")


class FabricPrint(FabricRule):
    """Print once, not once per process: `print(...)` becomes `fabric.print(...)`.

    What it does: in the code that runs after Fabric is created (the training path, and the
    functions `fabric` is passed into), `print(...)` becomes `fabric.print(...)`, with the same
    arguments.

    With several devices, a `tqdm(...)` progress bar gets `disable=not fabric.is_global_zero`,
    so that rank 0 alone draws it.

    Why: with several devices every process runs the script; `fabric.print` prints on rank 0
    only.

    Kind: safe (prints the same on one device).

    Fabric is created before the prints just above the place it needs to be (`print(args)`,
    `print("Random Seed: ", seed)` after the arguments are parsed), so that they become
    `fabric.print` too.

    With several devices, a function or class of the script (or of a project module that
    prints) whose print would run on every process receives `fabric` where every call of it can
    give it, and so do the functions between (`validate(fabric, ...)` that builds
    `ProgressMeter(fabric, ...)`, whose `display` prints `self.fabric.print(...)`).

    Leaves alone: prints before Fabric exists, in functions that `fabric` does not reach, and in
    the methods of a model (an `nn.Module` keeps no `fabric`: it would be saved and copied with
    it); with several devices, each of them is listed as printing on every process, with the
    reason, and so is `exec(...)` of code the rewrite can't read (`sys.stdout.write` is AR110's:
    a write, on rank 0).
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
                    model = f.model_class_of(call)
                    ctx.skip(call, f"`{short(call)}` prints on every process: " + (
                        "it runs before Fabric exists" if ref is not None or _before_launch(f, p, call) else
                        f"it is in a method of the model `{model.name.value}`, which keeps no `fabric` (it would be saved "
                        "and copied with it)" if model is not None else "`fabric` can't be reached here"))
                continue
            named = names_rank(f, p, call)
            if named is not None:
                ctx.skip(call, f"`{short(call)}` prints on every process, as before: it names the "
                               f"rank (`{named}`)")
                continue
            ctx.edits.replace(call.func, expr(f"{ref}.print"))
            converted.append(call)
        if many:  # a progress bar in every process: rank 0's alone
            for call in f.calls_named(*_PROGRESS_BARS):
                ref = p.ref_at(f, call)
                if any(a.keyword is not None and a.keyword.value == "disable" for a in call.args):
                    continue
                if ref is None or not p.after_creation(f, call):
                    ctx.skip(call, f"`{short(call)}` draws its progress bar on every process: " + (
                        "it runs before Fabric exists" if ref is not None else "`fabric` can't be reached here"))
                    continue
                ctx.edits.replace(call, lambda u, r=ref: _with_disable(u, r))
                ctx.change(call, f"`{short(call)}` draws its progress bar on rank 0 only "
                                 f"(`disable=not {ref}.is_global_zero`)")
        if many:  # code the rewrite can't read runs on every process, its prints too
            for call in f.calls_named("exec", "builtins.exec"):
                ctx.skip(call, f"`{short(call)}` runs code the rewrite can't read on every process: what it "
                               "prints (nanoGPT's configurator.py: \"Overriding: ...\") prints once per process")
        if converted:
            lines = ", ".join(str(f.line(c)) for c in converted)
            ctx.change(converted[0], f"print(...) became fabric.print(...) (rank 0 only) on lines {lines}")


def _before_launch(f, p, node) -> bool:
    """``node`` runs before the Fabric lines that launch a spawned worker, in their function (the
    ImageNet example's ``print(f"Using device: {device}")`` in ``main``)."""
    spawn = p.ddp.spawn if p.ddp is not None else None
    where = spawn.where if spawn is not None else None
    return where is not None and f.function(node) is f.function(where) and f.line(node) < f.line(where)


def _with_disable(call: cst.Call, ref: str) -> cst.Call:
    """``tqdm(loader, desc=...)`` -> ``tqdm(loader, desc=..., disable=not fabric.is_global_zero)``,
    the arguments' own layout kept (a trailing comma, one argument a line)."""
    args = list(call.args)
    no_space = cst.SimpleWhitespace("")
    new = cst.Arg(expr(f"not {ref}.is_global_zero"), keyword=cst.Name("disable"),
                  equal=cst.AssignEqual(whitespace_before=no_space, whitespace_after=no_space))
    last = args[-1] if args else None
    if last is not None and isinstance(last.comma, cst.Comma) \
            and isinstance(last.comma.whitespace_after, cst.ParenthesizedWhitespace):
        # one argument a line: the new one on a line of its own, the closing line kept
        item = args[-2].comma.whitespace_after if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) \
            else call.whitespace_before_args
        args[-1] = last.with_changes(comma=last.comma.with_changes(whitespace_after=item))
        new = new.with_changes(comma=last.comma)
    elif last is not None and last.comma is cst.MaybeSentinel.DEFAULT:
        args[-1] = last.with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return call.with_changes(args=[*args, new])
