from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import Optimizer, ScriptFacts, code
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.calls import without_keywords
from accelerate_rewrite.rules.base.plan import expr, stmt
from accelerate_rewrite.rules.techniques.freeze import last_top_import

#: torch's Adam/AdamW and bitsandbytes' 8-bit forms (plain, paged); the same arguments in the
#: same places: params, lr, betas, eps, weight_decay, amsgrad
OPTIMIZERS = {
    "torch.optim.Adam": ("Adam8bit", "PagedAdam8bit"),
    "torch.optim.adam.Adam": ("Adam8bit", "PagedAdam8bit"),
    "torch.optim.AdamW": ("AdamW8bit", "PagedAdamW8bit"),
    "torch.optim.adamw.AdamW": ("AdamW8bit", "PagedAdamW8bit"),
}
#: torch keywords bitsandbytes has no place for: implementation choices that go (its own kernels
#: are fused), and behaviours that only go when they are off
IMPLEMENTATION = ("foreach", "fused")
OFF_ONLY = ("amsgrad", "maximize", "capturable", "differentiable", "decoupled_weight_decay")
ALIAS = "bnb"
IMPORT = f'''\
try:
    import bitsandbytes as {ALIAS}
except ImportError as error:  # accelerate-rewrite --optimizer-8bit
    raise ImportError("this script trains with 8-bit optimizers: pip install bitsandbytes") from error
'''
EMBEDDINGS = '''\
# Embeddings keep 32-bit optimizer state, as bitsandbytes advises for stable training.
for module in {model}.modules():
    if isinstance(module, {embedding}):
        {alias}.optim.GlobalOptimManager.get_instance().register_module_override(
            module, "weight", {{"optim_bits": 32}})
'''


class Optimizer8bit(Rule):
    """`--optimizer-8bit`: Adam and AdamW keep their state in 8 bits (bitsandbytes).

    What it does: every `torch.optim.Adam` / `AdamW` becomes `bnb.optim.Adam8bit` /
    `AdamW8bit` (with `--paged-optimizer`, `PagedAdam8bit` / `PagedAdamW8bit`), with the same
    arguments. `foreach=` / `fused=` go (bitsandbytes runs its own kernels). Right after it, the
    model's `nn.Embedding` layers are registered with bitsandbytes' `GlobalOptimManager` to keep
    32-bit state. `import bitsandbytes as bnb` goes at the top, in a `try` whose `ImportError`
    says `pip install bitsandbytes`.

    Why: Adam keeps two fp32 tensors a parameter (8 bytes); the 8-bit forms keep them
    block-wise quantized (2 bytes), which frees 6 bytes a parameter: 0.6 GB for a 100M-parameter
    model, 42 GB for 7B. Tensors under 4,096 elements stay 32-bit. Embeddings stay 32-bit
    because their rare rows are what 8-bit state gets wrong (bitsandbytes' advice).

    Kind: approximate: the optimizer's state is quantized, so the losses drift a little from
    the fp32 optimizer's. The paged forms move state to CPU memory under GPU memory pressure (on
    a CPU they fall back to the plain ones).

    Leaves alone (and says why): other optimizers (SGD, LBFGS, ...), an optimizer built from
    `*args` / `**kwargs`, `amsgrad`, `maximize`, `capturable`, `differentiable` or
    `decoupled_weight_decay` that is not literally False, FSDP and DeepSpeed (they shard the
    optimizer state themselves), and a script that already imports bitsandbytes.
    """

    code = "AR402"
    name = "optimizer-8bit"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR402", options={"optimizer_8bit": True}),)

    def applies(self, options: Options) -> bool:
        return options.optimizer_8bit

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        already = [node for node, q in f.qualified_refs if q.split(".")[0] == "bitsandbytes"]
        if already:
            ctx.skip(already[0], "the script already uses bitsandbytes: optimizers left as they are")
            return
        if o.fabric and o.strategy and o.strategy.startswith(("fsdp", "deepspeed")):
            ctx.skip(None, f"--optimizer-8bit with --strategy {o.strategy}: the strategy shards the "
                           "optimizer state itself; optimizers left as they are")
            return
        if any(a.node for a in _module_scope(f).assignments[ALIAS]):
            ctx.skip(None, f"--optimizer-8bit: the script already binds the name `{ALIAS}`")
            return
        converted, registered = 0, set()
        for opt in f.optimizers:
            if self._convert(ctx, opt, registered):
                converted += 1
        if converted:
            _add_import(ctx)

    def _convert(self, ctx: RuleContext, opt: Optimizer, registered: set) -> bool:
        f = ctx.facts
        name = opt.qualname.rsplit(".", 1)[-1]
        if opt.call is None:
            return False
        if opt.qualname not in OPTIMIZERS:
            if opt.qualname.startswith("torch.optim."):
                ctx.skip(opt.call, f"--optimizer-8bit: {name} left as it is (Adam and AdamW only)")
            return False
        if any(a.star for a in opt.call.args):
            ctx.skip(opt.call, f"{name} built from *args/**kwargs: left as it is")
            return False
        keywords = {a.keyword.value: a for a in opt.call.args if a.keyword is not None}
        positional = [a for a in opt.call.args if a.keyword is None]
        blockers = [k for k in OFF_ONLY if k in keywords and not m.matches(keywords[k].value, m.Name("False"))]
        if len(positional) > 5:
            blockers.insert(0, "amsgrad")
        if blockers:
            ctx.skip(opt.call, f"{name} with {blockers[0]}: bitsandbytes' 8-bit {name} has no such "
                               "option; left as it is")
            return False
        dropped = [k for k in (*IMPLEMENTATION, *OFF_ONLY) if k in keywords]
        new_name = OPTIMIZERS[opt.qualname][1 if ctx.options.paged_optimizer else 0]
        ctx.edits.replace(opt.call, without_keywords(opt.call, dropped).with_changes(
            func=expr(f"{ALIAS}.optim.{new_name}")))
        gone = f"; {', '.join(f'`{k}=`' for k in dropped)} dropped" if dropped else ""
        ctx.change(opt.call, f"{name} -> bitsandbytes {new_name}: optimizer state in 8 bits "
                             f"(2 bytes a parameter instead of 8){gone}")
        model = _model_of(f, opt)  # registered before the optimizer is built (and set up)
        if model is None:
            ctx.skip(opt.call, f"{new_name}: its model is not one name, so embeddings (if any) get 8-bit "
                               "state too; register them with GlobalOptimManager for 32-bit state")
        elif _may_embed(f, model) and (model, f.scope(opt.stmt)) not in registered:
            registered.add((model, f.scope(opt.stmt)))  # once a model: the override is global
            embedding = next((code(n) for n, q in f.qualified_refs if q == "torch.nn.Embedding"), None)
            if embedding is None:
                ctx.edits.add_import("torch")
                embedding = "torch.nn.Embedding"
            text = EMBEDDINGS.format(model=model, embedding=embedding, alias=ALIAS)
            # parsed after a first statement, so that the comment leads the loop
            ctx.edits.insert_before(opt.stmt, *cst.parse_module("pass\n" + text).body[1:])
        return True


def _module_scope(f: ScriptFacts):
    return f.scope(f.module.body[0]) if f.module.body else None


def _model_of(f: ScriptFacts, opt: Optimizer) -> Optional[str]:
    """The one module whose ``.parameters()`` / ``.named_parameters()`` the optimizer takes,
    as the optimizer's statement spells it."""
    params = next((a.value for a in opt.call.args if a.keyword is None or a.keyword.value == "params"), None)
    if params is None:
        return None
    receivers = {code(c.func.value) for c in m.findall(params, m.Call(func=m.Attribute(
        attr=m.Name("parameters") | m.Name("named_parameters"))))}
    if len(receivers) == 1:
        return receivers.pop()
    if not receivers and isinstance(params, cst.Name):  # a list of groups kept in a name
        value = f.assigned_value(params)
        if value is not None:
            receivers = {code(c.func.value) for c in m.findall(value, m.Call(func=m.Attribute(
                attr=m.Name("parameters") | m.Name("named_parameters"))))}
            if len(receivers) == 1:
                return receivers.pop()
    return None


def _may_embed(f: ScriptFacts, model: str) -> bool:
    """Whether the model may hold embeddings: the script names nn.Embedding, or its model is
    neither a class of the script nor one of torch.nn's (a transformers model, ...)."""
    if any(q.endswith(".Embedding") for _, q in f.qualified_refs) or "Embedding" in code(f.module):
        return True
    built = [b for b in f.models if b.path == model]
    return not built or any(b.qualname not in f.module_classes and not b.qualname.startswith("torch.nn.")
                            for b in built)


def _add_import(ctx: RuleContext) -> None:
    """``try: import bitsandbytes as bnb`` after the imports at the top of the script."""
    body = list(ctx.facts.module.body)
    last_import = last_top_import(body)
    block = stmt(IMPORT).with_changes(leading_lines=[cst.EmptyLine()])
    if last_import is not None:
        ctx.edits.insert_after(last_import, block)
    else:
        ctx.edits.insert_before(body[0], block)
