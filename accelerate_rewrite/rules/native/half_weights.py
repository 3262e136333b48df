from __future__ import annotations

from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import short, stmt
from accelerate_rewrite.rules.base.half import low_precision_model_cast
from accelerate_rewrite.rules.native._plan import TRUE_HALF, native_plan


class NativeHalfWeights(Rule):
    """`--backend torch` with `16-true` or `bf16-true`: the model's weights in that dtype, its
    float inputs cast on the way in and its outputs back to fp32, as Fabric's true half does.

    What it does: right after each trained model is built, `model.to(torch.float16)` (or
    `torch.bfloat16`), a forward pre-hook that casts the model's floating-point inputs to that
    dtype (integer inputs such as token ids are left alone), and a forward hook that hands
    floating-point outputs (a tensor, or a tuple of them) back as fp32, so that the loss is
    computed in fp32. No GradScaler:
    there are no fp32 weights to unscale into. With 16-true, AR206 gives Adam an `eps` that fp16
    can hold.

    Why: half the weight, gradient and optimizer-state memory of fp32, and the fastest compute,
    for models that tolerate it; bf16-true keeps fp32's range. Casting the model alone would
    fail at the first fp32 batch ("expected scalar type Half"); the hooks do what Fabric's
    precision plugin does, without Fabric.

    Kind: approximate (pure half loses small updates: bf16-true on the fixtures differs from fp32
    by 2e-2 to 5e-2 at worst; fp16 with Adam needs the eps fix).

    Leaves alone (and says why): a model the script already casts to half itself (pure half
    is what it asked for), a model built outside the script's own code (a factory function, a
    parameter), everything native mixed precision leaves alone (AR207). Outputs in a dict
    (Hugging Face's ModelOutput) stay in half.
    """

    code = "AR210"
    name = "native-half-weights"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR210", options={"backend": "torch", "precision": "bf16-true"}),)

    def applies(self, options: Options) -> bool:
        return not options.fabric

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = native_plan(f, ctx.options)
        if p.precision not in TRUE_HALF:  # --precision, or apex O3
            return
        if p.refusal is not None:
            node, why = p.refusal
            ctx.skip(node, f"native {p.precision}: {why}")
            return
        dtype = TRUE_HALF[p.precision]
        cast = low_precision_model_cast(f)
        if cast is not None:
            ctx.skip(cast, f"`{short(cast)}`: the script already trains in half precision; left as it is")
            return
        if not f.models:
            ctx.skip(None, f"native {p.precision}: no model built in this script to cast (a model "
                           "from a factory function, or passed in): cast it by hand, or use "
                           "--backend fabric")
            return
        for model in f.models:
            name = model.path
            ctx.edits.insert_after(
                model.stmt,
                stmt(f"{name}.to({dtype})\n"),
                stmt(f"{name}.register_forward_pre_hook(lambda module, args: tuple(a.to({dtype}) if "
                     "torch.is_tensor(a) and a.is_floating_point() else a for a in args))\n"),
                stmt(f"{name}.register_forward_hook(lambda module, args, out: tuple(o.float() if "
                     "torch.is_tensor(o) and o.is_floating_point() else o for o in out) if type(out) is "
                     "tuple else out.float() if torch.is_tensor(out) and out.is_floating_point() else out)\n"),
            )
            ctx.change(model.stmt, f"`{name}` in {dtype} ({p.precision}): float inputs cast to it, "
                                   "float outputs back to fp32; no fp32 master weights")
        ctx.edits.add_import("torch")
