from __future__ import annotations

from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.analysis.amp import AUTOCASTS, Made, own_amp
from accelerate_rewrite.codemod.analysis.devices import device_type_at, model_device_type_at
from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import MIXED_PRECISIONS, Options
from accelerate_rewrite.rules.base.plan import code, expr, short
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.base.half import MIXED_GROUND

#: the torch dtype each mixed precision computes in
DTYPES = {"16-mixed": "float16", "bf16-mixed": "bfloat16"}
#: the callables that take a device type first: kept as the script spells them
_DEVICE_FIRST = tuple(q for q, (device, _) in AUTOCASTS.items() if device is None)


class OwnPrecision(Rule):
    """The precision asked for, in the script's own mixed precision: with `--precision
    bf16-mixed`, the autocast the script runs computes in bfloat16 on the device the run uses,
    and its GradScaler is turned off.

    What it does: where the script runs its own autocast (research code's engine:
    `with torch.cuda.amp.autocast(enabled=args.amp):`, `torch.autocast("cuda", ...)`, a name
    that holds it, `amp_autocast = torch.cuda.amp.autocast`, `functools.partial(torch.autocast,
    ...)`, or a library's function that returns one, read as data: ultralytics' `autocast`),
    each becomes
    `torch.autocast(<the run's device type>, dtype=torch.bfloat16, ...)`, keeping its other
    arguments (its `enabled=` flag: the script's `--amp` still decides). The device type is
    `fabric.device.type` (Accelerate: `accelerator.device.type`) where the conversion reaches
    `fabric`, else the script's own device (`device.type`), or where none is in reach the device
    of a model's parameters (`next(model.parameters()).device.type`); a literal "cuda", which a
    CPU run would switch off, only where the script needs CUDA anyway (`.cuda()` moves). Every
    GradScaler the script creates, in the script or in a loss-scaler class of its own, becomes
    `torch.amp.GradScaler(..., enabled=False)`: bf16 needs no loss scaling, and a scaler turned off still answers `scale`, `unscale_`, `step`, `update`,
    `state_dict()` and `load_state_dict()` (it ignores the original's saved state, so its
    checkpoints keep loading both ways). Fabric's own precision is not set on top (AR101 says
    so), nor is AR207's autocast: one autocast, never two.

    With `--precision 16-mixed` over an autocast that computes in float16 already: nothing to
    change, and it says so. With `32-true` or a true half precision: the script's own autocast
    stays, and it says so.

    Why: most research code runs its own mixed precision (fp16 with a loss scaler, from before
    bf16 GPUs). Asking for bf16-mixed and keeping fp16 with a loss scaler (or, on a CPU, nothing
    at all: `autocast("cuda")` switches itself off there) is not what was asked.

    Kind: approximate (bfloat16 keeps fp32's range with fewer digits: losses within the
    mixed-precision tolerance, not digit for digit).

    Leaves alone (and says why): everything, where one autocast that computes can't be given the
    run's device (a helper given only tensors, with no device, model or `fabric` in reach) or is
    called with `*args` / `**kwargs`: a scaler turned off under an autocast left in fp16 would
    let gradients underflow. An autocast turned off (`enabled=False`) is left as it is. A
    library's loss scaler (timm's `NativeScaler`) keeps its GradScaler: over bf16 it scales the
    loss and unscales the gradients by the same power of two, which changes no update.
    """

    code = "AR213"
    name = "own-mixed-precision"
    kind = Kind.APPROXIMATE
    words = ("autocast", "gradscaler")
    examples = (Example.from_files("AR213", options={"precision": "bf16-mixed", "backend": "torch"}),)

    def applies(self, options: Options) -> bool:
        return options.precision is not None

    def rewrite(self, ctx: RuleContext) -> None:
        own = own_precision_plan(ctx.facts, ctx.options)
        if own is None:
            return
        for node, message in own.skips:
            ctx.skip(node, message)
        if own.grounded:
            ctx.provide(MIXED_GROUND)
        e = ctx.edits
        for made, new, message in own.changes:
            e.replace(made.node, new)
            ctx.change(made.node, message)
        if own.changes:
            e.add_import("torch")
            if any(made.form == "reference" for made, _, _ in own.changes):
                e.add_import("functools")
            for module, obj in (("torch.cuda.amp", "autocast"), ("torch.cuda.amp", "GradScaler"),
                                ("torch.cpu.amp", "autocast"), ("torch.cpu.amp", "GradScaler"),
                                ("torch.cuda", "amp"), ("torch.cpu", "amp")):
                e.remove_import_if_unused(module, obj)


class OwnPlan:
    def __init__(self) -> None:
        #: (the autocast or GradScaler, its new expression, what is said)
        self.changes: list[tuple[Made, cst.BaseExpression, str]] = []
        self.skips: list[tuple[Optional[cst.CSTNode], str]] = []
        #: the script's autocast computes in the precision asked for, once rewritten
        self.grounded = False

    @property
    def taken(self) -> set[int]:
        """The nodes this rule rewrites (and the autocast a partial it rewrites binds): AR201
        leaves them to it."""
        out = {id(made.node) for made, _, _ in self.changes}
        out |= {id(made.node.args[0].value) for made, _, _ in self.changes if made.form == "partial"}
        return out


def own_precision_plan(facts: ScriptFacts, options: Options) -> Optional[OwnPlan]:
    """What AR213 does to the script's own mixed precision (None: the script has none)."""
    if options.precision is None:
        return None
    return facts.memo(("own-precision", options), lambda: _plan(facts, options))


def _plan(f: ScriptFacts, o: Options) -> Optional[OwnPlan]:
    own = own_amp(f)
    computing = own.computing
    if not computing and not own.scalers:
        return None
    out = OwnPlan()
    if not computing:
        if o.precision in MIXED_PRECISIONS:  # (a GradScaler, then)
            made = own.scalers[0]
            out.skips.append((made.node, f"the script creates a GradScaler (`{short(made.node)}`) but enters no "
                                         "autocast this rule can read (a library's, or one reached through a "
                                         f"name it can't follow): its mixed precision is left as it is, not set to "
                                         f"{o.precision}"))
        return out
    first = computing[0].node
    what = f"the script's own autocast (`{short(first)}`)"
    if o.precision not in MIXED_PRECISIONS:
        out.skips.append((first, f"{what} stays: --precision {o.precision} is not set over it (to train "
                                 "without it, turn its flag off or remove it)"))
        return out
    starred = next((a for a in [*computing, *own.scalers] if a.starred), None)
    if starred is not None:
        out.skips.append((starred.node, f"`{short(starred.node)}` is given *args/**kwargs: its precision can't be "
                                        f"read, so the script's own mixed precision is left as it is, not set to "
                                        f"{o.precision}"))
        return out
    want = DTYPES[o.precision]
    dtypes = {a.dtype(f) for a in computing}
    if o.precision == "16-mixed":
        if dtypes == {"float16"}:
            out.grounded = True
            out.skips.append((first, f"{what} computes in float16 already, with its GradScaler: 16-mixed "
                                     "changes nothing"))
        else:
            out.skips.append((first, f"{what} does not compute in float16 (or its dtype can't be read), and "
                                     "16-mixed would need a GradScaler the script may not have: its mixed "
                                     "precision is left as it is"))
        return out
    devices: list[str] = []
    fabric = o.fabric and plan(f, o).refusal is None
    for made in computing:
        device = _device_type(f, o, made.node)
        if device is None:
            out.skips.append((made.node, f"can't tell which device the run uses at `{short(made.node)}` (no "
                                         "`fabric` and no device in reach): the script's own mixed precision "
                                         f"is left as it is, not set to {o.precision} (a GradScaler turned off "
                                         "under an autocast left in float16 would let gradients underflow)"))
            return out
        devices.append(device)
    out.grounded = True
    for made, device in zip(computing, devices):
        new = _autocast(f, made, device, want, fabric)
        if new is not None:
            dtype = made.dtype(f) or "its dtype"
            out.changes.append((made, new, f"`{short(made.node)}` became `{short(new)}`: the script's own autocast "
                                           f"computes in {want} (was {dtype}) on the device the run uses"))
    for made in own.scalers:
        new = _scaler(made)
        if new is not None:
            out.changes.append((made, new, f"`{short(made.node)}` became `{short(new)}`: {want} needs no loss "
                                           "scaling; turned off, it still steps the optimizer and its "
                                           "state_dict()/load_state_dict() keep working"))
    for call, qualname in own.library_scalers:
        out.skips.append((call, f"`{short(call)}` ({qualname}) keeps its own GradScaler: over {want} it scales "
                                "the loss and unscales the gradients by the same power of two, which changes "
                                "no update"))
    return out


def _device_type(f: ScriptFacts, o: Options, node: cst.CSTNode) -> Optional[str]:
    """The run's device type at ``node``: Fabric's where the conversion reaches `fabric` (the
    script's device no longer decides then), else the script's own."""
    if o.fabric:
        p = plan(f, o)
        if p.refusal is None:
            ref = p.ref_at(f, node)
            if ref is not None and p.after_creation(f, node):
                return f"{ref}.device.type"
            return model_device_type_at(f, node)  # the script's device decides no more
    return device_type_at(f, node) or model_device_type_at(f, node)


def _keywords(made: Made, leave: tuple[str, ...]) -> list[str]:
    return [f"{k}={code(v)}" for k, v in made.args.items() if k not in leave]


def _autocast(f: ScriptFacts, made: Made, device: str, want: str, fabric: bool) -> Optional[cst.BaseExpression]:
    """The autocast ``made`` computing in ``want`` on ``device`` (``fabric``: the conversion's
    device); None where it does already."""
    given = made.args.get("device_type")
    literal = made.device_literal
    if made.dtype(f) == want and given is not None and (code(given) == device or (literal is None and not fabric)):
        return None  # ``torch.autocast(device.type, dtype=torch.bfloat16)``: as asked already
    dtype = f"dtype=torch.{want}"
    if made.form == "reference":
        return expr(f"functools.partial(torch.autocast, {device}, {dtype})")
    # a device type the script computes (not a literal, not the API's) stays its own, unless the
    # conversion places the model (``fabric.device.type``: the script's device decides no more)
    where = code(given) if given is not None and literal is None and not fabric else device
    rest = _keywords(made, ("device_type", "dtype"))
    if made.form == "partial":
        call = made.node
        func = code(call.args[0].value) if made.qualname in _DEVICE_FIRST else "torch.autocast"
        return expr(f"{code(call.func)}({func}, " + ", ".join([f"device_type={where}", dtype, *rest]) + ")")
    func = code(made.node.func) if made.qualname in _DEVICE_FIRST else "torch.autocast"
    by_keyword = any(a.keyword is not None and a.keyword.value == "device_type" for a in made.node.args)
    return expr(f"{func}(" + ", ".join([f"device_type={where}" if by_keyword else where, dtype, *rest]) + ")")


def _scaler(made: Made) -> Optional[cst.BaseExpression]:
    """The GradScaler ``made``, turned off; None where it is already."""
    if made.form != "call":
        return None
    enabled = made.args.get("enabled")
    if isinstance(enabled, cst.Name) and enabled.value == "False":
        return None
    device = made.args.get("device")
    first = code(device) if device is not None else f'"{made.device}"' if made.device is not None else None
    rest = _keywords(made, ("device", "enabled"))
    return expr("torch.amp.GradScaler(" + ", ".join([*([first] if first else []), *rest, "enabled=False"]) + ")")

