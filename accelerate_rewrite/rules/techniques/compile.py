from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import Binding, Key, ScriptFacts
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.base.plan import short, stmt
from accelerate_rewrite.rules.fabric._plan import plan
from accelerate_rewrite.rules.techniques.freeze import _models

#: calls that take a model whole and that a compiled model does not survive unchanged
PICKLES = ("torch.save", "pickle.dump", "pickle.dumps", "torch.jit.script", "torch.jit.trace",
           "torch.onnx.export", "torch.export.export")


class Compile(Rule):
    """`--compile`: the model runs through `torch.compile` (TorchDynamo + Inductor).

    What it does:
    - with Fabric: `model = torch.compile(model)` right before the model's optimizer is built,
      so before `fabric.setup(model, optimizer)`, which takes the compiled model apart, wraps
      the original for the strategy and compiles the wrapper again (as Fabric's docs ask).
      `fabric.save` and the model's `state_dict()` keep their keys;
    - without Fabric (`--backend torch`, or a script the Fabric conversion leaves alone):
      `model.compile()`, in place, after the statements that build, move or wrap the model
      (and after AR303's freezing and AR401's checkpointing), so that its `state_dict()` keys
      don't get `torch.compile`'s `_orig_mod.` prefix.

    Why: compiled forward and backward passes fuse elementwise work and cut Python overhead:
    1.3-2x faster steps on recent GPUs for transformers, after a compile of tens of seconds
    on the first steps (and again for each new input shape).

    Kind: approximate: fused kernels may round differently from eager ones, and compiled
    dropout draws its masks from Inductor's own generator, so a model with dropout gets other
    masks (transformer_lm: first loss 3e-4 relative apart; module_loop, no dropout: equal).

    Leaves alone (and says why): a model the script already compiles, or passes whole to
    `torch.save` / `pickle` / `torch.jit` / `torch.onnx.export` / `torch.export` (a compiled
    model pickles with its compile wrapper, or not at all); without Fabric, a model that is a
    `torch.nn` class itself (`torch.nn.Sequential`: its in-place compile finds only torch's own
    code and compiles nothing); FSDP and DeepSpeed (compile by hand, as the strategy's docs say);
    scripts that already use Fabric, the Trainer or Accelerate.
    """

    code = "AR403"
    name = "compile"
    kind = Kind.APPROXIMATE
    examples = (Example.from_files("AR403", options={"compile": True}),)

    def applies(self, options: Options) -> bool:
        return options.compile

    def rewrite(self, ctx: RuleContext) -> None:
        f, o = ctx.facts, ctx.options
        already = f.calls_named("torch.compile") or [
            c for c in f.attribute_calls if c.func.attr.value == "compile" and not c.args]
        if already:
            ctx.skip(already[0], f"the script already compiles (`{short(already[0])}`)")
            return
        if o.fabric and o.strategy and o.strategy.startswith(("fsdp", "deepspeed")):
            ctx.skip(None, f"--compile with --strategy {o.strategy}: compile by hand, as the strategy's docs say")
            return
        if f.frameworks:
            label, node = f.frameworks[0]
            ctx.skip(node, f"--compile: the script uses {label}; compile the model where its docs say "
                           "(torch.compile(model) before fabric.setup / trainer.fit)")
            return
        p = plan(f, o) if o.fabric else None
        if p is not None and p.refusal is None:
            for group in p.setups:
                if self._whole(ctx, group.model_key, group.model):
                    continue
                ctx.edits.add_import("torch")
                own = _binds(group.after, group.model)
                if own is not None:  # set up right after it is built (no optimizer): compiled as it is built
                    ctx.edits.replace(own.value, lambda u: cst.Call(func=cst.parse_expression("torch.compile"),
                                                                    args=[cst.Arg(u)]))
                else:
                    ctx.edits.insert_before(group.after, stmt(f"{group.model} = torch.compile({group.model})\n"))
                ctx.change(group.after, f"`{group.model}` compiled with torch.compile before fabric.setup")
            return
        for binding in _models(f):
            if self._whole(ctx, binding.key, binding.path):
                continue
            if binding.qualname.startswith("torch.nn."):
                ctx.skip(binding.stmt, f"`{binding.path}` is a `{binding.qualname}`: its in-place compile finds "
                                       "only torch's own code and compiles nothing; and torch.compile(...) "
                                       "would rename its state_dict keys (_orig_mod.): compile it by hand")
                continue
            after = _last_setup(f, binding)
            ctx.edits.insert_after(after, stmt(f"{binding.path}.compile()\n"))
            ctx.change(after, f"`{binding.path}` compiled in place (model.compile(): its state_dict keys stay)")

    def _whole(self, ctx: RuleContext, key: Key, name: str) -> bool:
        """Whether the model is passed whole to something a compiled model doesn't survive."""
        f = ctx.facts
        for call in f.calls:
            if call.qualname not in PICKLES or not call.call.args:
                continue
            arg = call.call.args[0].value
            if f.same_object(f.key_of(arg), key):
                ctx.skip(call.call, f"`{name}` is passed whole to {call.qualname}: not compiled (a compiled "
                                    "model pickles or traces differently); save its state_dict() instead")
                return True
        return False


def _binds(statement: cst.BaseStatement, name: str) -> Optional[cst.Assign]:
    """The ``name = ...`` assignment that ``statement`` is, if it is one."""
    if m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])) \
            and cst.Module([]).code_for_node(statement.body[0].targets[0].target) == name:
        return statement.body[0]
    return None


def _last_setup(f: ScriptFacts, binding: Binding) -> cst.BaseStatement:
    """The last statement before the block's first loop that builds, moves or wraps the model
    again (``model = model.to(device)``, ``model = DDP(model)``), or the one that built it."""
    block = f.block(binding.stmt)
    body = list(block.body)
    last = binding.stmt
    for s in body[body.index(binding.stmt) + 1:]:
        if isinstance(s, (cst.For, cst.While)):
            break
        target = _rebinds(s)
        if target == binding.path:
            last = s
    return last


def _rebinds(s: cst.BaseStatement) -> Optional[str]:
    """``name`` for ``name = <a call that takes name>``."""
    if not m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
        return None
    assign = s.body[0]
    name = cst.Module([]).code_for_node(assign.targets[0].target)
    uses = {cst.Module([]).code_for_node(n) for n in m.findall(assign.value, m.Name() | m.Attribute())}
    return name if name in uses and m.findall(assign.value, m.Call()) else None
