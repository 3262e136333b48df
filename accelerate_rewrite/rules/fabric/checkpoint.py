from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import OPTIMIZER, root_of
from accelerate_rewrite.codemod.ddp.wraps import wrapped_states
from accelerate_rewrite.codemod.rule import Example, Kind, RuleContext
from accelerate_rewrite.rules.base.plan import FabricRule, FABRIC_CORE, code, expr, rank_guard, short, stmt
from accelerate_rewrite.rules.fabric._plan import plan

TORCH_SAVE = ("torch.save", "torch.serialization.save")
FABRIC, RANK_ZERO, SKIP = "fabric", "rank-zero", "skip"


def classify_save(f, p, call: cst.Call, options):
    """What becomes of a ``torch.save(obj, path)``: (FABRIC, which dict values lose their
    ``.state_dict()``), (RANK_ZERO, None) when AR110 keeps it and writes it on rank 0 only
    (a whole model, or another object), or (SKIP, why)."""
    return f.memo(("torch-save", id(call), options), lambda: _classify_save(f, p, call, options))


def _classify_save(f, p, call: cst.Call, options):
    sharded = (options.strategy or "").startswith(("fsdp", "deepspeed"))
    ref = p.ref_at(f, call)
    if ref is None or not p.after_creation(f, call):
        return SKIP, "torch.save left as is: `fabric` can't be reached here"
    if len(call.args) != 2 or any(a.keyword for a in call.args):
        return SKIP, "torch.save with extra arguments left as is"
    guard = rank_guard(f, call)
    if guard is not None:
        return SKIP, (f"torch.save inside a rank check (line {f.line(guard)}) left as is: "
                      "fabric.save must run on every rank (it waits for all of them)")
    obj = call.args[0].value
    if file_object(f, call.args[1].value):
        return RANK_ZERO, None  # fabric.save takes a path, not an open file
    if options.accelerate:
        # Accelerate has no ``fabric.save(path, state)``: torch's save stays, written by the
        # main process (its model state dicts read through ``unwrap_model``: fabric/_setups.py)
        return RANK_ZERO, None
    if sharded:
        return SKIP, (f"torch.save left as is: under {options.strategy}, fabric.save writes a "
                      "sharded checkpoint that this script's loading code could not read; "
                      "convert saving and loading together by hand")
    if isinstance(obj, cst.Dict):
        return FABRIC, [_state_object(f, p, el) for el in obj.elements]
    if _is_state_dict_of(f, p, obj):
        return FABRIC, None
    return RANK_ZERO, None


def file_object(f, node) -> bool:
    """``open(...)``, ``io.BytesIO()``, or a name bound to one (``with open(p, "wb") as fh``)."""
    return _opener(f, node) is not None


def _opener(f, node) -> Optional[cst.Call]:
    """The ``open(...)`` / ``io.BytesIO()`` call behind ``node``, if it is a file object."""
    if isinstance(node, cst.Call):
        return node if f.qualname(node) in ("builtins.open", "io.open", "io.BytesIO") else None
    if not isinstance(node, cst.Name):
        return None
    scope = f.scope(node)
    for assignment in f.in_order(scope[node.value] if scope is not None else (), lambda a: getattr(a, "node", None)):
        target = getattr(assignment, "node", None)
        parent = f.parent(target) if isinstance(target, cst.CSTNode) else None
        if isinstance(parent, cst.AsName) and isinstance(f.parent(parent), cst.WithItem):
            return _opener(f, f.parent(parent).item)
    value = f.assigned_value(node)
    return _opener(f, value) if value is not None else None


def file_path(f, node) -> Optional[str]:
    """The path a save writes or a load reads, as written: ``args.save`` for ``torch.save(model,
    fh)`` inside ``with open(args.save, "wb") as fh``, the argument itself otherwise; None for a
    buffer."""
    opener = _opener(f, node)
    if opener is None:
        return code(node)
    return code(opener.args[0].value) if opener.args and f.qualname(opener) != "io.BytesIO" else None


def _is_state_dict_of(f, p, node) -> bool:
    if not m.matches(node, m.Call(func=m.Attribute(attr=m.Name("state_dict")), args=[])):
        return False
    key = f.key_of(root_of(node.func.value))
    return p.group_of(f, key) is not None and root_of(node.func.value) is node.func.value


def _state_object(f, p, element) -> bool:
    """Whether ``"model": model.state_dict()`` becomes ``"model": model``: for set-up models
    and optimizers."""
    if not isinstance(element, cst.DictElement):
        return False
    value = element.value
    if m.matches(value, m.Call(func=m.Attribute(attr=m.Name("state_dict")), args=[])):
        return _is_state_dict_of(f, p, value) or OPTIMIZER in f.kinds_of(value.func.value)
    return False


class FabricCheckpoint(FabricRule):
    """Save and load through Fabric: `torch.save` / `torch.load` of training state become
    `fabric.save` / `fabric.load`.

    What it does: `torch.save({"model": model.state_dict(), "optimizer":
    optimizer.state_dict(), "epoch": epoch}, path)` becomes `fabric.save(path, {"model": model,
    "optimizer": optimizer, "epoch": epoch})` (Fabric stores the same state dicts under the
    same keys, so the file's format does not change); `torch.save(model.state_dict(), path)`
    becomes `fabric.save(path, model.state_dict())`; `torch.load(path, map_location=...)`
    becomes `fabric.load(path)` (the state is loaded on the CPU, as `load_state_dict` expects).

    Checkpoints the original wrote keep loading: where it saved the state dict of a model it
    wrapped in DistributedDataParallel or DataParallel (keys prefixed `module.`), the
    converted model's `model.load_state_dict(checkpoint["state_dict"])` is preceded by
    `consume_prefix_in_state_dict_if_present(checkpoint["state_dict"], "module.")` (torch's
    own; a state without the prefix stays as it is), with Fabric and with Accelerate.

    Why: with several processes every rank would write the same file at once; Fabric writes
    once, and saves sharded (FSDP, DeepSpeed) models correctly when it is given the objects.

    Kind: safe.

    Leaves alone (and says why): saves inside a rank check (`fabric.save` has a barrier: it
    must run on every rank, or the run hangs); loads from an open file (`fabric.load` takes a
    path); `torch.save(model)` of a whole model, of other objects or into an open file, which
    AR110 writes on rank 0 (saving the original module, not Fabric's wrapper); every save
    and load under FSDP or DeepSpeed (Fabric writes sharded checkpoints there, which the
    script's own loading code could not read: convert both together by hand); loads with other
    arguments than the path, `map_location` and `weights_only`.
    """

    code = "AR109"
    name = "fabric-checkpoint"
    kind = Kind.SAFE
    requires = FABRIC_CORE
    examples = (Example.from_files("AR109"),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        p = plan(f, ctx.options)
        if p.refusal is not None:
            return
        self._prefixed_loads(ctx, p)
        if ctx.options.accelerate:
            # --backend accelerate (rules/accelerate/spelling.py): torch's save and load stay, a save
            # written by the main process (AR110), a model's state dict read unwrapped
            for site in f.calls_to(*TORCH_SAVE):
                action, detail = classify_save(f, p, site.call, ctx.options)
                if action == SKIP:
                    ctx.skip(site.call, detail)
            for site in f.calls_to("torch.load", "torch.serialization.load"):
                ctx.skip(site.call, f"`{code(site.call.func)}` kept: Accelerate loads no state with modules in it; "
                                    "a model's state dict is loaded into the module itself (`unwrap_model` on "
                                    "several processes)")
            return
        sharded = (ctx.options.strategy or "").startswith(("fsdp", "deepspeed"))
        for site in f.calls_to(*TORCH_SAVE):
            call = site.call
            action, detail = classify_save(f, p, call, ctx.options)
            if action == RANK_ZERO:
                continue  # AR110 writes it on rank 0
            if action == SKIP:
                ctx.skip(call, detail)
                continue
            ref = p.ref_at(f, call)
            # built from the updated call: edits inside it (AR211's `amp.state_dict()`) are kept
            ctx.edits.replace(call, lambda u, r=ref, w=detail: expr(
                f"{r}.save({code(u.args[1].value)}, {code(_unwrapped(u.args[0].value, w))})"))
            ctx.change(call, f"torch.save became {ref}.save (written once, by rank 0)")
        for site in f.calls_to("torch.load", "torch.serialization.load"):
            call = site.call
            ref = p.ref_at(f, call)
            extra = [a for a in call.args[1:] if a.keyword is None or a.keyword.value not in ("map_location", "weights_only")]
            if sharded:
                ctx.skip(call, f"torch.load left as is: under {ctx.options.strategy}, checkpoints are "
                               "sharded; convert saving and loading together by hand")
                continue
            if ref is None or not p.after_creation(f, call) or not call.args or extra:
                ctx.skip(call, "torch.load left as is: " + ("extra arguments" if extra else "`fabric` can't be reached here"))
                continue
            if file_object(f, call.args[0].value):
                ctx.skip(call, "torch.load left as is: it reads an open file, and fabric.load takes a path")
                continue
            keep = [code(a) for a in call.args[1:] if a.keyword is not None and a.keyword.value == "weights_only"]
            ctx.edits.replace(call, lambda u, r=ref, k=keep: expr(
                f"{r}.load({', '.join([code(u.args[0].value), *k])})"))
            ctx.change(call, f"torch.load became {ref}.load (loads on the CPU, Fabric places the state)")

    @staticmethod
    def _prefixed_loads(ctx: RuleContext, p) -> None:
        """``model.load_state_dict(checkpoint["state_dict"])`` where the original saved the
        model wrapped in DistributedDataParallel or DataParallel: the checkpoints on disk hold
        ``module.``-prefixed keys, which the converted model has not. Before the load,
        ``consume_prefix_in_state_dict_if_present(checkpoint["state_dict"], "module.")`` (torch's
        own, in place; a checkpoint without the prefix is left as it is)."""
        f = ctx.facts
        wrapped = wrapped_states(f)
        if not wrapped:
            return
        for _, call in f.attribute_calls_of("load_state_dict"):
            receiver = call.func.value
            if f.key_of(receiver) not in wrapped or p.group_of(f, f.key_of(receiver)) is None or not call.args:
                continue
            state = call.args[0].value
            statement = f.statement(call)
            if not _repeatable(state) or call.args[0].keyword is not None \
                    or not isinstance(statement, cst.SimpleStatementLine):
                ctx.skip(call, f"`{short(call)}`: the original saved the model wrapped in DistributedDataParallel "
                               "or DataParallel, so its checkpoints hold keys prefixed `module.`, which this load "
                               "would not find; strip them first (torch.nn.modules.utils."
                               "consume_prefix_in_state_dict_if_present)")
                continue
            new = stmt(f'consume_prefix_in_state_dict_if_present({code(state)}, "module.")\n')
            ctx.edits.insert_before(statement, new)
            ctx.edits.add_import("torch.nn.modules.utils", "consume_prefix_in_state_dict_if_present")
            ctx.change(call, f"`{code(state)}` loses the `module.` its keys have in a checkpoint the original "
                             "wrote (it saved the model wrapped in DistributedDataParallel or DataParallel): "
                             "those checkpoints load into the converted model")


def _repeatable(node: cst.BaseExpression) -> bool:
    """``checkpoint["state_dict"]``, ``state``, ``ckpt.model``: read twice, the same object."""
    if isinstance(node, cst.Name):
        return True
    if isinstance(node, cst.Attribute):
        return _repeatable(node.value)
    if isinstance(node, cst.Subscript) and len(node.slice) == 1 and isinstance(node.slice[0].slice, cst.Index):
        index = node.slice[0].slice.value
        return isinstance(index, (cst.SimpleString, cst.Integer, cst.Name)) and _repeatable(node.value)
    return False


def _unwrapped(state: cst.BaseExpression, unwrap) -> cst.BaseExpression:
    if unwrap is None or not isinstance(state, cst.Dict):
        return state
    return state.with_changes(elements=[
        el.with_changes(value=el.value.func.value) if flag and isinstance(el.value, cst.Call) else el
        for el, flag in zip(state.elements, unwrap)])
