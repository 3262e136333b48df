from __future__ import annotations


from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import short, stmt
from accelerate_rewrite.rules.native._plan import AUTOCAST_DTYPES, TRUE_HALF, core_except, native_plan
from accelerate_rewrite.rules.base.half import MIXED_GROUND


class NativeAutocast(Rule):
    """`--backend torch` with a mixed precision: the forward pass and the loss under
    `torch.autocast(device_type=<the script's device>, dtype=...)`.

    What it does: with `--backend torch --precision bf16-mixed` (dtype `torch.bfloat16`) or
    `16-mixed` (`torch.float16`, with AR208's GradScaler), the statements of each training step
    from the first one that runs a model up to the backward go into
    `with torch.autocast(...):`; the backward and the optimizer step stay outside. Where the
    rewrite can't tell that a call runs a model (`self.model(source)` in a Trainer given its
    model), the forward is found from the loss back: the statements of the block that compute
    the loss (a `for` or `if` that adds to it too), from the first of them that calls something.
    A backward in a branch or a block of its own (`if args.amp: with amp.scale_loss(loss, opt)
    as s: s.backward() else: loss.backward()`; `with timer("grads"): loss.backward()`) takes
    the forward from the block around it, up to its loop or function, where the loss's names
    are bound; both branches share that one region. Loops that run
    a model without training (evaluation, under `torch.no_grad()` as they were) get autocast
    from their first model call to the end of the loop body. The device type is the script's
    own: `device.type` for a `torch.device`, `torch.device(device).type` for a device that may
    be a string, `self.device.type` in a class; `"cuda"` only for a script that moves to CUDA
    by name, `"cpu"` for one that never leaves the CPU; in a helper with no device in reach
    (`predict(model, loader)`), the device of the model it calls:
    `next(model.parameters()).device.type`.

    Why: autocast runs matmuls and convolutions in the low precision and keeps reductions and
    losses in fp32, with no new dependency. A hard-coded `autocast("cuda")` would silently run
    fp32 on a machine without CUDA; the script's own device runs the precision asked for.
    Backward under autocast is not recommended by PyTorch: it runs in the forward's dtypes.

    Kind: approximate (bf16-mixed on the fixtures: mean relative difference of the losses
    about 1e-3 on CPU; `accelerate-rewrite verify` measures it).

    Leaves alone (and says why): scripts that already use autocast or a GradScaler (nothing is
    wrapped twice), that use Fabric, the Trainer or Accelerate, LBFGS (low precision breaks its
    line search), a backward in the same statement as the forward pass, a training step whose
    loss is not computed in the backward's function (a `step(loss)` helper, a loss class's
    `backward(loss)` method), and places where no
    device variable is in reach. Precisions the native path can't express (64-true, transformer-engine) are refused
    with a pointer to `--backend fabric`.
    """

    code = "AR207"
    name = "native-autocast"
    kind = Kind.APPROXIMATE
    requires = core_except("AR207")
    examples = (Example.from_files("AR207", options={"backend": "torch", "precision": "bf16-mixed"}),)

    def applies(self, options: Options) -> bool:
        return not options.fabric

    def rewrite(self, ctx: RuleContext) -> None:
        p = native_plan(ctx.facts, ctx.options)
        precision = p.precision
        if precision in (None, "32-true") or precision in TRUE_HALF:
            return  # nothing to autocast (AR211 migrates apex O0; AR210 casts for true half)
        if precision not in AUTOCAST_DTYPES:
            ctx.skip(None, f"--precision {precision} has no plain-PyTorch form here: use "
                           "--backend fabric")
            return
        if p.refusal is not None:
            node, why = p.refusal
            ctx.skip(node, f"native mixed precision: {why}")
            return
        dtype = AUTOCAST_DTYPES[precision]
        for region in p.regions:
            header = stmt(f"with torch.autocast(device_type={region.device_type}, dtype={dtype}):\n    pass\n")
            ctx.edits.wrap(region.stmts, lambda body, h=header: h.with_changes(
                body=h.body.with_changes(body=body)))
            what = "forward pass and loss" if region.training else "evaluation (no scaler)"
            ctx.change(region.stmts[0], f"{what} from `{short(region.stmts[0])}` under "
                                        f"torch.autocast({region.device_type}, {dtype})")
        ctx.edits.add_import("torch")
        if p.regions:
            ctx.provide(MIXED_GROUND)
