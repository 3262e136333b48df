from __future__ import annotations

from accelerate_rewrite.codemod.analysis.facts import CLIP_NORM, CLIP_VALUE, OPTIMIZER, SCALER, code
from accelerate_rewrite.codemod.analysis.kinds import stepped_by
from accelerate_rewrite.codemod.analysis.libraries import LOSS_SCALERS
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import short, stmt, visible_name
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.native._plan import native_plan


class ClipGradNorm(Rule):
    """`--clip-grad-norm X`: clip the norm of the gradients to X before every optimizer step.

    What it does: right before each `optimizer.step()` (or a script's own
    `scaler.step(optimizer)`) that is not already preceded by a clip since the last backward,
    it inserts, for the model that optimizer trains:
    - with Fabric: `fabric.clip_gradients(model, optimizer, max_norm=X,
      error_if_nonfinite=False)` (Fabric unscales first under its 16-mixed);
    - otherwise: `torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=X)`;
    - with a GradScaler (AR208's, or the script's own): `scaler.unscale_(optimizer)` first, so
      that the true gradients are clipped, not the scaled ones.
    With `--accumulate N` the clip goes with the step, under `if not is_accumulating:` (AR302):
    the accumulated gradient is clipped once, at the boundary.

    Why: clipping keeps one bad batch from throwing the weights far off, the usual guard for
    transformers and RNNs, and for low precision, where an overflow can blow a step up.

    Kind: changes-training (steps whose gradient norm is above X are scaled down; the verifier
    shows the runs side by side and records the norm each step applies).

    Leaves alone (and says why): a step already preceded by a clip (its own limit is kept:
    AR107 / AR202 / AR208 convert it), an optimizer whose parameters can't be traced to one
    model visible at the step, an optimizer step with a closure (LBFGS), and scripts that
    already use Fabric, the Trainer or Accelerate.
    """

    code = "AR301"
    name = "clip-grad-norm"
    kind = Kind.CHANGES_TRAINING
    examples = (
        Example.from_files("AR301", options={"clip_grad_norm": 1.0}),
        Example.from_files("AR301.torch", options={"backend": "torch", "precision": "16-mixed",
                                                   "clip_grad_norm": 1.0}),
    )

    def applies(self, options: Options) -> bool:
        return options.clip_grad_norm is not None

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        if f.frameworks:
            label, node = f.frameworks[0]
            ctx.skip(node, f"--clip-grad-norm: the script already uses {label}; clip with its API by hand")
            return
        limit = repr(o.clip_grad_norm)
        library = [s for s in f.backward_sites if s.library is not None]
        if library:
            clip = LOSS_SCALERS[library[0].library].clip
            ctx.skip(library[0].call, f"--clip-grad-norm: `{short(library[0].call)}` ({library[0].library}) clips "
                                      f"and steps itself: give it `{clip}=` ({limit}) by hand")
            return
        fabric = plan(f, o) if o.fabric else None
        if fabric is not None and fabric.refusal is not None:
            fabric = None  # not converted: plain torch clipping
        native = None if o.fabric else native_plan(f, o)
        native_scalers = {id(c): ref for c, ref in native.steps} if native and native.refusal is None else {}
        in_backward = {id(a) for s in f.backward_sites for a in f.ancestors(s.call)}
        # a clip's statement and those around it (``if max_norm > 0: clip_grad_norm_(...)``)
        clips = {id(a) for c in f.calls_to(*CLIP_NORM, *CLIP_VALUE) for a in f.ancestors(c.call)}
        clips |= {id(a) for c in f.attribute_calls if c.func.attr.value == "clip_gradients" for a in f.ancestors(c)}
        sites = [(c, c.func.value, native_scalers.get(id(c))) for c in f.method_calls(OPTIMIZER, "step")]
        sites += [(c, c.args[0].value, code(c.func.value)) for c in f.method_calls(SCALER, "step") if c.args]
        if not sites:
            ctx.skip(None, f"--clip-grad-norm: no optimizer step found{stepped_by(f)}")
            return
        for call, optimizer, scaler in sites:
            if call.args and scaler is None or len(call.args) > 1:
                ctx.skip(call, f"`{short(call)}` steps with a closure: not clipped")
                continue
            statement = f.statement(call)
            before = list(f.block(statement).body)
            before = before[:before.index(statement)]
            since = next((i for i in range(len(before) - 1, -1, -1) if id(before[i]) in in_backward), -1)
            if any(id(s) in clips for s in before[since + 1:]):
                ctx.skip(call, f"`{short(call)}` is already preceded by a clip: its limit is kept")
                continue
            key = f.key_of(optimizer)
            built = next((b for b in f.optimizers if f.same_object(b.key, key)), None)
            model = visible_name(f, call, built.models[0]) if built is not None and len(built.models) == 1 \
                else None
            if model is None:
                ctx.skip(call, f"`{short(call)}`: can't tell which model's gradients to clip here")
                continue
            opt = code(optimizer)
            lines = [f"{scaler}.unscale_({opt})"] if scaler else []
            ref = fabric.ref_at(f, call) if fabric is not None else None
            if ref is not None:
                lines.append(f"{ref}.clip_gradients({model}, {opt}, max_norm={limit}, error_if_nonfinite=False)")
            else:
                lines.append(f"torch.nn.utils.clip_grad_norm_({model}.parameters(), max_norm={limit})")
                ctx.edits.add_import("torch")
            ctx.edits.insert_before(statement, *(stmt(line + "\n") for line in lines))
            ctx.change(call, f"gradients clipped to norm {limit} before `{short(call)}`"
                             + (f" (unscaled by `{scaler}` first)" if scaler else ""))
