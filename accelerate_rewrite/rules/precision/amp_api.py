from __future__ import annotations

from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules.base.plan import code, expr
from accelerate_rewrite.rules.precision.own_precision import own_precision_plan

#: old API -> (new API, device type, the old signature's positional parameters)
MIGRATIONS = {
    "torch.cuda.amp.autocast": ("autocast", "cuda", ("enabled", "dtype", "cache_enabled")),
    "torch.cuda.amp.autocast_mode.autocast": ("autocast", "cuda", ("enabled", "dtype", "cache_enabled")),
    "torch.cpu.amp.autocast": ("autocast", "cpu", ("enabled", "dtype", "cache_enabled")),
    "torch.cpu.amp.autocast_mode.autocast": ("autocast", "cpu", ("enabled", "dtype", "cache_enabled")),
    "torch.cuda.amp.GradScaler": ("GradScaler", "cuda", ("init_scale", "growth_factor", "backoff_factor",
                                                         "growth_interval", "enabled")),
    "torch.cuda.amp.grad_scaler.GradScaler": ("GradScaler", "cuda", ("init_scale", "growth_factor",
                                                                     "backoff_factor", "growth_interval",
                                                                     "enabled")),
    "torch.cpu.amp.GradScaler": ("GradScaler", "cpu", ("init_scale", "growth_factor", "backoff_factor",
                                                       "growth_interval", "enabled")),
    "torch.cpu.amp.grad_scaler.GradScaler": ("GradScaler", "cpu", ("init_scale", "growth_factor",
                                                                   "backoff_factor", "growth_interval",
                                                                   "enabled")),
    "torch.cuda.amp.custom_fwd": ("custom_fwd", "cuda", ("fwd",)),
    "torch.cuda.amp.custom_bwd": ("custom_bwd", "cuda", ("bwd",)),
}
#: imports that may be left unused by the migration
OLD_IMPORTS = (
    ("torch.cuda.amp", "autocast"), ("torch.cuda.amp", "GradScaler"), ("torch.cuda.amp", "custom_fwd"),
    ("torch.cuda.amp", "custom_bwd"), ("torch.cpu.amp", "autocast"), ("torch.cpu.amp", "GradScaler"),
    ("torch.cuda", "amp"), ("torch.cpu", "amp"),
)


class AmpApiMigration(Rule):
    """Move off the deprecated AMP API: `torch.cuda.amp.*` / `torch.cpu.amp.*` become `torch.amp.*`
    with the device type.

    What it does: `torch.cuda.amp.autocast(...)` becomes `torch.amp.autocast("cuda", ...)`,
    `torch.cuda.amp.GradScaler(...)` becomes `torch.amp.GradScaler("cuda", ...)`, the
    `torch.cpu.amp` forms take `"cpu"`, and `@torch.cuda.amp.custom_fwd` /
    `custom_bwd` become `@torch.amp.custom_fwd(device_type="cuda")` / `custom_bwd(...)`.
    Arguments are kept (`enabled=`, `dtype=`, `init_scale=`, `cast_inputs=`); positional ones
    become keywords, because the new signatures put the device first. Whatever the import style
    (`from torch.cuda.amp import autocast`, `from torch.cuda import amp`), the result uses
    `torch.amp`, and old imports left unused are removed.

    Why: torch 2.4 deprecated these (every call warns: "`torch.cuda.amp.autocast(args...)` is
    deprecated. Please use `torch.amp.autocast('cuda', args...)` instead."); `torch.amp` is the
    API that keeps working, and it names the device, which the later AMP rules rely on.

    Kind: safe (the same autocast and scaler: the default dtypes are the same).

    Leaves to AR213 (own-mixed-precision) the autocasts and GradScalers it sets to the mixed
    precision asked for: it writes them in `torch.amp` too.

    Leaves alone (and says why): calls with `*args` / `**kwargs`, and references that are not
    called (`ctx = torch.cuda.amp.autocast if amp else nullcontext`).
    """

    code = "AR201"
    fix = True
    name = "amp-api-migration"
    kind = Kind.SAFE
    examples = (Example.from_files("AR201"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f, e = ctx.facts, ctx.edits
        changed = False
        decorated = {id(d.decorator) for d in f.decorators}
        own = own_precision_plan(f, ctx.options)
        taken = own.taken if own is not None else set()  # AR213 writes these in the precision asked for
        for site in f.calls:
            migration = MIGRATIONS.get(site.qualname)
            if migration is None or id(site.call) in taken:
                continue
            call = site.call
            if any(a.star for a in call.args):
                ctx.skip(call, f"`{code(call.func)}(...)` with *args/**kwargs left as is: move it to "
                               f"torch.amp.{migration[0]} by hand")
                continue
            new = _migrated_call(call, *migration)
            e.replace(call, new)
            ctx.change(call, f"`{code(call.func)}(...)` became `torch.amp.{migration[0]}` with device "
                             f"type \"{migration[1]}\" (the old API is deprecated)")
            changed = True
        for decorator in f.decorators:
            target = decorator.decorator
            if isinstance(target, cst.Call):
                continue  # a call: done above
            migration = MIGRATIONS.get(f.qualname(target) or "")
            if migration is None:
                continue
            name, device, _ = migration
            e.replace(target, expr(f'torch.amp.{name}(device_type="{device}")'))
            ctx.change(decorator, f"`@{code(target)}` became `@torch.amp.{name}(device_type=\"{device}\")`")
            changed = True
        for site in _uncalled_references(f, decorated):
            if id(site) in taken or id(f.parent(f.parent(site))) in taken:
                continue
            ctx.skip(site, f"`{code(site)}` is used without being called: move it to torch.amp by hand")
        if changed:
            e.add_import("torch")
            for module, obj in OLD_IMPORTS:
                e.remove_import_if_unused(module, obj)


def _migrated_call(call: cst.Call, name: str, device: str, positional: tuple) -> cst.Call:
    args: list[cst.Arg] = []
    kept: list[str] = []
    for index, arg in enumerate(call.args):
        if arg.keyword is None and name in ("autocast", "GradScaler") and index < len(positional):
            kept.append(f"{positional[index]}={code(arg.value)}")
        else:
            kept.append(code(arg.value) if arg.keyword is None else f"{arg.keyword.value}={code(arg.value)}")
    if name in ("autocast", "GradScaler"):
        text = f'torch.amp.{name}("{device}"' + "".join(f", {k}" for k in kept) + ")"
    else:  # custom_fwd / custom_bwd: the device type is keyword-only
        text = f"torch.amp.{name}(" + "".join(f"{k}, " for k in kept) + f'device_type="{device}")'
    return expr(text)


def _uncalled_references(facts, decorated: set[int]) -> list[cst.CSTNode]:
    """``torch.cuda.amp.autocast`` used as a value (not called, not a decorator)."""
    out: list[cst.CSTNode] = []
    called = {id(site.call.func) for site in facts.calls}
    for node, qualname in facts.references_to(tuple(MIGRATIONS)):
        if id(node) in called or id(node) in decorated:
            continue
        parent: Optional[cst.CSTNode] = facts.parent(node)
        if isinstance(parent, (cst.ImportAlias, cst.Attribute)) or parent is None:
            continue
        out.append(node)
    return out
