from __future__ import annotations

from pathlib import Path

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import DATA_PARALLEL, HAND_DDP, code
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import short, stmt
from accelerate_rewrite.rules.techniques.freeze import _models, add_helper

HELPER = "checkpoint_activations"
#: the function put into the script, kept as text: no .py file of the rewrite path holds an
#: ``import torch`` line (a check of the pre-commit start-up looks for them)
HELPER_CODE = "\n\n" + (Path(__file__).resolve().parent.parent / "helpers" / f"{HELPER}.txt").read_text(encoding="utf-8")


class ActivationCheckpointing(Rule):
    """`--checkpointing TARGET`: recompute the activations of the model's blocks in the
    backward pass instead of keeping them.

    What it does: right after the model is built (before Fabric sets it up or DDP wraps it):
    - a Hugging Face model (built with `transformers`' `from_pretrained` / `from_config`):
      `model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})`
      and `model.config.use_cache = False` (the cache is useless in training and fights
      checkpointing); TARGET may be `auto`;
    - any other model: `checkpoint_activations(model, "Block")`, a small function put into the
      script once, that makes the forward of every block TARGET names (a module class name, or
      a module path such as `encoder.layers`, whose children are the blocks) run under
      `torch.utils.checkpoint.checkpoint(..., use_reentrant=False)` in training (not in
      evaluation or under `no_grad`). A TARGET that names nothing fails at run time, naming the
      model's module classes.

    Why: activations are most of a transformer's training memory; keeping only each block's
    input and recomputing the rest in the backward trades one more forward pass of each block
    for a large cut in memory, so a bigger batch or model fits. The non-reentrant implementation is
    the one that stays right when a block's inputs need no gradient (`use_reentrant=True` then
    silently drops the block's gradients).

    Kind: safe: the same math, the losses are identical (dropout's random state is replayed).

    Leaves alone (and says why): FSDP (use its activation_checkpointing_policy), a model
    wrapped in DDP/DataParallel in the statement that builds it, a model whose construction
    can't be found, `auto` for a model that is not from transformers, a script that already
    checkpoints (`torch.utils.checkpoint`, `gradient_checkpointing_enable`), and scripts that
    use Fabric, the Trainer or Accelerate.
    """

    code = "AR401"
    name = "activation-checkpointing"
    kind = Kind.SAFE
    examples = (Example.from_files("AR401", options={"checkpointing": "Block"}),)

    def applies(self, options: Options) -> bool:
        return options.checkpointing is not None

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        target = o.checkpointing
        if f.frameworks:
            label, node = f.frameworks[0]
            ctx.skip(node, f"--checkpointing: the script already uses {label}; use its own checkpointing")
            return
        if o.strategy and o.strategy.startswith("fsdp"):
            ctx.skip(None, "--checkpointing with FSDP: give the strategy an activation_checkpointing_policy "
                           "(FSDPStrategy(activation_checkpointing_policy={Block})) instead")
            return
        already = [c for c in f.calls if c.qualname.startswith("torch.utils.checkpoint")]
        already_calls = already[0].call if already else next(
            (c for c in f.attribute_calls if c.func.attr.value == "gradient_checkpointing_enable"), None)
        if already_calls is not None:
            ctx.skip(already_calls, f"the script already checkpoints activations (`{short(already_calls)}`)")
            return
        models = _models(f)
        if not models:
            ctx.skip(None, "--checkpointing: no model trained by an optimizer found")
            return
        if f.functions.get(HELPER) is not None:
            ctx.skip(f.functions[HELPER].node, f"the script already defines `{HELPER}`: nothing checkpointed")
            return
        helper_needed = False
        for binding in models:
            if any(f.qualnames(c.func) & {*HAND_DDP, *DATA_PARALLEL} for c in m.findall(binding.value, m.Call())):
                ctx.skip(binding.stmt, f"`{short(binding.value)}` wraps the model as it builds it: build "
                                       "it first, then wrap it")
                continue
            hugging_face = any(any(q.startswith("transformers.") and q.endswith((".from_pretrained", ".from_config"))
                                   for q in f.qualnames(c.func)) for c in m.findall(binding.value, m.Call()))
            name = binding.path
            if hugging_face:
                ctx.edits.insert_after(binding.stmt, stmt(
                    f'{name}.gradient_checkpointing_enable(gradient_checkpointing_kwargs={{"use_reentrant": False}})\n'),
                    stmt(f"{name}.config.use_cache = False\n"))
                ctx.change(binding.stmt, f"`{name}`: Hugging Face gradient checkpointing (non-reentrant), "
                                         "no KV cache in training")
                continue
            if target == "auto":
                ctx.skip(binding.stmt, f"--checkpointing auto: `{code(binding.value)[:40]}` is not a Hugging "
                                       "Face model: name its blocks (a class such as Block, or a module path)")
                continue
            ctx.edits.insert_after(binding.stmt, stmt(f'{HELPER}({name}, "{target}")\n'))
            ctx.change(binding.stmt, f"`{name}`: the activations of its `{target}` blocks are recomputed in "
                                     "the backward (non-reentrant checkpointing)")
            helper_needed = True
        if helper_needed:
            add_helper(ctx, cst.parse_module(HELPER_CODE).body[0])
