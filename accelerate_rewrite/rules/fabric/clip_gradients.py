from __future__ import annotations

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import CLIP_NORM, CLIP_VALUE, root_of
from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.apex import apex_use
from accelerate_rewrite.rules.base.plan import FabricRule, core_except, code, expr
from accelerate_rewrite.rules.fabric._plan import plan



class FabricClipGradients(FabricRule):
    """Clip through Fabric: `clip_grad_norm_(model.parameters(), x)` becomes
    `fabric.clip_gradients(model, optimizer, max_norm=x, error_if_nonfinite=False)`.

    What it does: converts `torch.nn.utils.clip_grad_norm_` (keeping `norm_type`) and
    `clip_grad_value_` (as `clip_val=`) on the parameters of a model that Fabric sets up, with
    that model's optimizer. `error_if_nonfinite=False` keeps torch's default (Fabric's is True,
    which would stop 16-mixed training at the first overflowing step).

    Why: under 16-mixed the gradients are still scaled after `fabric.backward`: a plain
    `clip_grad_norm_` clips the wrong numbers (measured: norm 41,446 instead of 0.632). Fabric
    unscales first, and knows how to clip sharded (FSDP) gradients.

    Kind: safe.

    Leaves alone: clipping of parameters it can't trace to one set-up model and its optimizer.
    """

    code = "AR107"
    name = "fabric-clip-gradients"
    kind = Kind.SAFE
    requires = core_except("AR107")
    examples = (Example.from_files("AR107"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = plan(f, ctx.options)
        if p.refusal is not None:
            return
        for site in f.calls_to(*CLIP_NORM, *CLIP_VALUE):
            call = site.call
            positional = [a for a in call.args if a.keyword is None]
            keywords = {a.keyword.value: a for a in call.args if a.keyword is not None}
            params = positional[0].value if positional else (keywords.get("parameters") and keywords["parameters"].value)
            group, model = None, None
            if isinstance(params, cst.Call) and isinstance(params.func, cst.Attribute) \
                    and params.func.attr.value == "parameters":
                group = p.group_of(f, f.key_of(root_of(params.func.value)))
                model = code(params.func.value)
            elif isinstance(params, cst.Call) and params in apex_use(f).master_params and params.args:
                # ``amp.master_params(optimizer)``: the parameters of the model it trains
                opt_key = f.key_of(params.args[0].value)
                group = next((g for g in p.setups if any(f.same_object(o.key, opt_key) for o in g.optimizers)),
                             None)
                model = p.visible_name(f, call, group.model_key) if group is not None else None
            ref = p.ref_at(f, call)
            if group is None or model is None or ref is None or len(group.optimizers) != 1:
                ctx.skip(call, f"`{code(call.func)}(...)` left as is: can't tell which set-up model and optimizer it clips")
                continue
            if group.otherwise is not None:
                ctx.skip(call, f"`{code(call.func)}(...)` left as is: the optimizer exists only when "
                               f"`{code(group.otherwise.test)}` (fabric.clip_gradients needs it)")
                continue
            optimizer = p.visible_name(f, call, group.optimizers[0].key)
            if optimizer is None:
                ctx.skip(call, f"`{code(call.func)}(...)` left as is: the optimizer is not in reach here")
                continue
            is_norm = site.qualname in CLIP_NORM
            limit_name = "max_norm" if is_norm else "clip_value"
            limit = positional[1].value if len(positional) > 1 else keywords[limit_name].value
            parts = [model, optimizer, f"{'max_norm' if is_norm else 'clip_val'}={code(limit)}"]
            if is_norm:
                norm_type = positional[2].value if len(positional) > 2 else (keywords.get("norm_type") and keywords["norm_type"].value)
                if norm_type is not None:
                    parts.append(f"norm_type={code(norm_type)}")
                nonfinite = keywords.get("error_if_nonfinite")
                parts.append(f"error_if_nonfinite={code(nonfinite.value) if nonfinite else 'False'}")
            new = expr(f"{ref}.clip_gradients({', '.join(parts)})")
            ctx.edits.replace(call, new)
            ctx.change(call, f"`{code(call.func)}` became `{ref}.clip_gradients` (unscales first under 16-mixed)")
