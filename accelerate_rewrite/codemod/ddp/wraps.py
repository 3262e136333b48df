"""Where a hand-made distributed script wraps a model in ``DistributedDataParallel``
(codemod/ddp/hand.py finds the rest): each wrap (``Wrap``: its statement goes where it rebinds the
model, else the call becomes the model), the options it sets, which Fabric's ``DDPStrategy``
takes (a conditional wrap's merged on its condition; two wraps must agree), and the reads of a
wrapped model's ``.module``."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Protocol, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts, code, short

DDP = ("torch.nn.parallel.DistributedDataParallel", "torch.nn.parallel.distributed.DistributedDataParallel")
#: DDP(...) arguments that go with the wrapper (Fabric places the model and picks the devices)
_DDP_PLACEMENT = ("device_ids", "output_device")
#: DistributedDataParallel's defaults for the options a script sets (torch 2.x,
#: torch/nn/parallel/distributed.py), to compare wraps that set them differently
DDP_DEFAULTS = {"broadcast_buffers": "True", "find_unused_parameters": "False",
                "gradient_as_bucket_view": "False", "static_graph": "False", "check_reduction": "False"}
#: records a problem (codemod/ddp/hand.py's ``_Finder.problem``); what it returns is true
Problem = Callable[[Optional[cst.CSTNode], str], object]


@dataclass
class Wrap:
    """``x = DDP(model, ...)``: the statement goes when it rebinds ``model`` itself, else the
    call becomes ``model``."""

    call: cst.Call
    stmt: cst.BaseStatement
    inner: cst.BaseExpression
    rebinds: bool
    #: both calls of a conditional wrap (``DDP(m, ...) if c else DDP(m, ...)``), else ``(call,)``
    branches: tuple[cst.Call, ...] = ()


class HandDDP(Protocol):
    """What the wraps fill in of the hand-made DDP found (codemod/ddp/hand.py's HandDDP): a
    Protocol, so that this module, which that one imports, imports nothing back."""

    removed: list[cst.BaseStatement]
    wraps: list[Wrap]
    ddp_options: dict[str, str]
    option_names: list[cst.Name]
    module_uses: list[cst.Attribute]
    unwrapped_uses: list[cst.Attribute]


def _names_read(f: ScriptFacts, node: cst.CSTNode) -> list[cst.Name]:
    """The names ``node`` reads (not attribute names, not True / False / None)."""
    return [n for n in f.find_in(node, m.Name())
            if not m.matches(n, m.Name("True") | m.Name("False") | m.Name("None"))
            and not (isinstance(f.parent(n), cst.Attribute) and f.parent(n).attr is n)]


def take_wrap(f: ScriptFacts, d: HandDDP, problem: Problem, call: cst.Call) -> bool:
    """``call`` (``DistributedDataParallel(...)``) taken as a wrap; False after a problem."""
    stmt = f.statement(call)
    if any(w.call is call or id(call) in {id(c) for c in w.branches} for w in d.wraps):
        return True  # the other branch of a conditional wrap, taken with it
    parent = f.parent(call)
    branches = [call]
    value: cst.BaseExpression = call
    test: Optional[cst.BaseExpression] = None
    if isinstance(parent, cst.IfExp) and all(isinstance(b, cst.Call) and f.qualname(b) in DDP
                                             for b in (parent.body, parent.orelse)):
        # iBOT's ``DDP(teacher, ..., broadcast_buffers=False) if 'swin' in args.arch else
        # DDP(teacher, ...)``: one wrap, its options taken on the condition
        branches, value, test = [parent.body, parent.orelse], parent, parent.test
    options = [_options(f, d, problem, b) for b in branches]
    if any(o is None for o in options):
        return False
    if len(branches) == 2:
        if code(branches[0].args[0].value) != code(branches[1].args[0].value):
            return not problem(value, f"`{short(value)}` wraps another model on each side")
        if f.find_in(test, m.Call() | m.Lambda() | m.Subscript()):
            return not problem(value, f"`{short(value)}` chooses its options by a call the rewrite "
                                           "can't carry to where Fabric is created; pass them to Fabric with "
                                           "`strategy=DDPStrategy(...)` by hand")
        merged: dict[str, str] = {}
        for key in [*options[0], *(k for k in options[1] if k not in options[0])]:
            body, orelse = (o.get(key, DDP_DEFAULTS.get(key)) for o in options)
            if body is None or orelse is None:
                return not problem(value, f"`{short(value)}`: `{key}` is given on one side only")
            merged[key] = body if body == orelse else f"{body} if {code(test)} else {orelse}"
            if body != orelse:
                d.option_names.extend(_names_read(f, test))
        options = [merged]
    if d.wraps and any(options[0].get(k, DDP_DEFAULTS.get(k)) != d.ddp_options.get(k, DDP_DEFAULTS.get(k))
                       for k in {*options[0], *d.ddp_options}):
        return not problem(call, "two models are wrapped with different options: Fabric's strategy gives "
                                      "every model the same options")
    d.ddp_options.update(options[0])
    inner = branches[0].args[0].value
    assign = stmt.body[0] if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 else None
    if not (isinstance(assign, cst.Assign) and len(assign.targets) == 1 and assign.value is value):
        return not problem(value, f"`{short(value)}` is not a plain assignment")
    # ``model = DDP(model.cuda(), ...)`` (DiT's ``DDP(model.to(device), ...)``) rebinds the model
    # too: the move is fabric.setup's, so the statement goes (not ``model = model``)
    rebinds = code(assign.targets[0].target) in (code(inner), code(unmoved(inner)))
    if len(branches) == 2 and not rebinds:
        return not problem(value, f"`{short(value)}` is not a plain assignment to `{code(inner)}`")
    d.wraps.append(Wrap(call, stmt, inner, rebinds, branches=tuple(branches)))
    if rebinds:
        d.removed.append(stmt)
    return True


def _options(f: ScriptFacts, d: HandDDP, problem: Problem, call: cst.Call) -> Optional[dict[str, str]]:
    """DistributedDataParallel's options in ``call`` that Fabric's ``DDPStrategy`` takes
    (keyword -> code), None after a problem."""
    if not call.args or call.args[0].keyword not in (None,) and call.args[0].keyword.value != "module":
        problem(call, f"`{short(call)}`: no model to unwrap")
        return None
    options: dict[str, str] = {}
    for arg in call.args[1:]:
        key = arg.keyword.value if arg.keyword is not None else None
        if key in _DDP_PLACEMENT:
            continue
        if key is not None and m.matches(arg.value, m.Name("True") | m.Name("False") | m.Integer() | m.Float()
                                         | m.SimpleString()):
            # Fabric's DDPStrategy passes its keywords on to DistributedDataParallel
            options[key] = code(arg.value)
            continue
        if key is not None and not f.find_in(arg.value, m.Call() | m.Lambda() | m.Subscript()):
            # ``broadcast_buffers=not args.no_ddp_bb`` (timm's train.py): carried where Fabric is
            # created when the names it reads are bound there already (the plan checks)
            options[key] = code(arg.value)
            d.option_names.extend(_names_read(f, arg.value))
            continue
        problem(call, f"`DistributedDataParallel(..., {code(arg).strip(', ')})`: a value the "
                           "rewrite can't carry to where Fabric is created; pass it to Fabric with "
                           "`strategy=DDPStrategy(...)` by hand")
        return None
    return options


def module_uses(f: ScriptFacts, d: HandDDP) -> None:
    """The reads of a wrapped model's ``.module`` (the module itself where its wrap goes)."""
    wrapped = {code(w.stmt.body[0].targets[0].target): w for w in d.wraps}
    for node in f.find(m.Attribute(attr=m.Name("module"))):
        wrap = wrapped.get(code(node.value))
        if wrap is None:
            continue
        if wrap.rebinds and _before_rebinding(f, wrap, node):
            d.unwrapped_uses.append(node)  # ``model_without_ddp = model.module`` under the wrap
        else:
            d.module_uses.append(node)


def _before_rebinding(f: ScriptFacts, wrap: Wrap, node: cst.Attribute) -> bool:
    """``node`` (``model.module``) is read in the block of the removed ``model = DDP(model)``,
    after it, before ``model`` is bound again: there ``model`` is the script's own module."""
    stmt = f.statement(node)
    block = f.block(wrap.stmt)
    if f.block(stmt) is not block:
        return False
    body = list(block.body)
    start, end = body.index(wrap.stmt), body.index(stmt)
    name = code(wrap.inner)
    return start < end and not any(
        m.findall(s, m.AssignTarget(target=m.Name(name))) for s in body[start + 1:end + 1])


def unmoved(node: cst.BaseExpression) -> cst.BaseExpression:
    """``model`` of ``model.cuda()``, ``model.to(device)``, ``model.cuda(gpu).to(x)`` (Fabric places
    the model)."""
    while isinstance(node, cst.Call) and isinstance(node.func, cst.Attribute) and node.func.attr.value in ("cuda", "to"):
        node = node.func.value
    return node


def wrapped_states(f: ScriptFacts) -> set:
    """The keys of the names the script binds to a model wrapped in DistributedDataParallel or
    DataParallel (``model = DDP(model, ...)``, ``model = nn.DataParallel(model).cuda()``) whose
    ``state_dict()`` it reads: the original's checkpoints hold that wrapper's keys, each
    prefixed ``module.``, which the converted model (the module itself, or Fabric's wrapper,
    whose state dict is the module's) does not have."""
    def compute() -> set:
        bound = set()
        for site in [*f.calls_to(*DDP), *f.data_parallel()]:
            stmt = f.statement(site.call)
            if isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1 \
                    and isinstance(stmt.body[0], cst.Assign):
                bound.update(f.key_of(t.target) for t in stmt.body[0].targets
                             if isinstance(t.target, (cst.Name, cst.Attribute)))
        bound.discard(None)
        return {f.key_of(call.func.value) for _, call in f.attribute_calls_of("state_dict")} & bound
    return f.memo("wrapped-states", compute)


def repeated_assignment(f: ScriptFacts, use: Union[cst.Attribute, cst.Call], removed: set[int]) -> Optional[cst.BaseStatement]:
    """DeiT's ``model_without_ddp = model`` before ``if args.distributed: model = DDP(model);
    model_without_ddp = model.module`` (``use``: the ``.module``), or SSD's ``net = ssd_net``
    before ``if args.cuda: net = DataParallel(ssd_net)`` (``use``: the wrap), the DDP tutorial's
    ``self.model = model.to(gpu_id)`` before ``self.model = DDP(model, ...)``: with the wrap
    gone (and Fabric placing the model), the second assignment would be the first again. The earlier statement, where nothing
    between them assigns either name (the removed wrap aside), else None."""
    stmt_ = f.statement(use)
    assign = stmt_.body[0] if isinstance(stmt_, cst.SimpleStatementLine) and len(stmt_.body) == 1 else None
    if not (isinstance(assign, cst.Assign) and assign.value is use and len(assign.targets) == 1):
        return None
    inner = use.value if isinstance(use, cst.Attribute) else use.args[0].value if use.args else None
    if inner is None:
        return None
    wanted = f"{code(assign.targets[0].target)} = {code(inner)}"
    names = {code(assign.targets[0].target), code(inner)}
    node: cst.CSTNode = stmt_
    while True:
        block = f.block(node)
        body = list(block.body)
        for before in reversed(body[:body.index(node)]):
            if id(before) in removed:
                continue
            if isinstance(before, cst.SimpleStatementLine) and len(before.body) == 1 \
                    and isinstance(before.body[0], cst.Assign) and len(before.body[0].targets) == 1 \
                    and f"{code(before.body[0].targets[0].target)} = {code(unmoved(before.body[0].value))}" == wanted:
                return before  # (``self.model = model.to(gpu_id)``: a module's move returns the module)
            if any(code(t.target) in names for t in f.find_in(before, m.AssignTarget())):
                return None
        owner = f.parent(block)
        if not isinstance(owner, cst.If) or owner.body is not block:
            return None
        node = owner
