"""What becomes of every use of the device, and which training loops are sharded: moves that
Fabric makes (removed), other moves and uses (`fabric.device`), device names threaded into
`fabric`, loops whose data no set-up loader gives (a mixin of the Fabric planner)."""

from __future__ import annotations

import re
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import (
    DEVICE,
    LOADER,
    MODEL,
    DeviceMove,
    Key,
    ScriptFacts,
    code,
    init_of,
    is_literal_device,
    param_for,
    positional_params,
    root_of,
    unwrap_moves,
)
from accelerate_rewrite.codemod.analysis.hints import loader_hint
from accelerate_rewrite.codemod.analysis.loops import batch_loop, data_source, drawing_loops, for_loops
from accelerate_rewrite.codemod.analysis.sampling import rank_sharded, sharding_factory
from accelerate_rewrite.rules.fabric._loaders import distributed_batch_sampler
from accelerate_rewrite.rules.base.half import low_casts, strip_half
from accelerate_rewrite.options import MIXED_PRECISIONS
from accelerate_rewrite.rules.base.plan import MoveDecision, short

#: what AR104 says of a backward whose batches no loop over a loader gives (report.py reads it:
#: on several processes, such data is each process's whole set)
NOT_IN_A_DATA_LOOP = "is not in a loop over data"


_SETTINGS = re.compile(r"\b(args|cfg|config|conf|opt|opts|options|hparams|hp|params|flags|settings)\b", re.I)


class Devices:
    """The planner's part that decides about devices and loops (``self.f``, ``self.p``, ``self.o``)."""

    #: (sizes of the plan's set-up lists, their models' objects, their loaders' objects)
    _set_up_objects: Optional[tuple[tuple[int, int], set, set]] = None

    # -- devices: moves, uses, threading --
    def _set_up(self, key: Optional[Key], kind: str) -> bool:
        f, p = self.f, self.p
        if key is None or kind not in f.kinds.get(key, set()):
            return False
        # the objects set up so far (the plan only appends to its lists), not asked again for
        # each of a long script's thousands of moves
        size = (len(p.setups), len(p.loader_groups))
        known = self._set_up_objects
        if known is None or known[0] != size:
            models = {f.object_of(k) for k in p.setup_model_keys if k is not None}
            loaders = {f.object_of(b.key) for group in p.loader_groups for b in group.loaders if b.key is not None}
            known = self._set_up_objects = (size, models, loaders)
        return f.object_of(key) in (known[1] if kind == MODEL else known[2])

    def _batch_moves(self) -> set[int]:
        """ids of device moves whose receiver is a batch from a loader that Fabric set up."""
        f = self.f
        out: set[int] = set()
        moves_in: dict[int, list] = {}  # a loop -> the device moves in it: each move walked up once
        for move in f.device_moves:
            for a in f.ancestors(move.call):
                if isinstance(a, cst.For):
                    moves_in.setdefault(id(a), []).append(move)

        for loop in for_loops(f):
            source = data_source(f, loop.iter)
            if not self._set_up(f.key_of(source), LOADER):
                continue
            names = {n.value for n in f.find_in(loop.target, m.Name())}
            for node in loop.body.body:  # names unpacked from a batch are batches too
                if m.matches(node, m.SimpleStatementLine(body=[m.Assign()])):
                    assign = node.body[0]
                    roots = {root_of(e).value for e in f.find_in(assign.value, m.Name())
                             if isinstance(root_of(e), cst.Name)}
                    if roots and roots <= names and not f.find_in(assign.value, m.Call()):
                        for t in assign.targets:
                            names |= {n.value for n in f.find_in(t.target, m.Name())}
            for move in moves_in.get(id(loop), ()):
                root = root_of(move.receiver)
                if isinstance(root, cst.Name) and root.value in names:
                    out.add(id(move.call))
        return out

    def _unsharded_loops(self) -> None:
        """Training loops over something that is not a loader Fabric sets up: with several
        devices every process would then train on every batch (N times the work, no speed-up),
        so the conversion to several devices is refused; on one device it is said."""
        f, p, o = self.f, self.p, self.o
        if o.many_devices:
            for site in f.backward_sites:
                kept = next((a for a in site.call.args if a.keyword is not None
                             and a.keyword.value == "retain_graph" and code(a.value) != "False"), None)
                if kept is None:
                    continue
                loop = next((a for a in f.ancestors(site.call) if isinstance(a, (cst.For, cst.While))), None)
                # another backward after it in the same loop: through the same forward
                again = loop is not None and any(
                    other is not site and f.line(other.call) > f.line(site.call)
                    and loop in f.ancestors(other.call) for other in f.backward_sites)
                if kept is not None and again:
                    # DDP reduces the gradients when a forward's backward ends: a second backward
                    # through the same forward fails ("Expected to mark a variable ready only once")
                    self.refuse(site.call, f"`{short(site.call)}` keeps the graph for another backward "
                                           "through the same forward: DistributedDataParallel reduces "
                                           "once per forward and fails on the second; refused for several "
                                           "devices (--devices 1 converts it; or add the losses and call "
                                           "backward once)")
                    return
        seen: set[int] = set()
        for site in f.backward_sites:
            loop = batch_loop(f, site.call)
            key = id(loop) if loop is not None else id(site.stmt)
            if key in seen:
                continue
            seen.add(key)
            if loop is None and self._called_from_data_loop(site.function):
                continue  # ``self._run_batch(source, targets)`` in a loop over a sharded loader
            if loop is None and self._drawn_from_set_up_loader(site.call):
                continue  # ``x, y = next(data_iter)``, ``data_iter = iter(train_loader)``
            if loop is None:
                if o.many_devices:  # synthetic data, a benchmark: nothing to shard, but say so
                    p.loader_skips.append((site.call, f"`{short(site.call)}` {NOT_IN_A_DATA_LOOP}: with "
                                                      f"devices={o.effective_devices} every process trains on "
                                                      "whatever it makes itself (the same data, if it is "
                                                      "seeded alike)"))
                continue
            source = data_source(f, loop.iter)
            if self._set_up(f.key_of(source), LOADER):
                continue
            if p.ddp is not None and p.ddp.sharded(f, f.key_of(source)) is not None:
                continue  # sharded by its own DistributedSampler
            if any(distributed_batch_sampler(f, b) is not None for b in f.bound_as(f.key_of(source), LOADER)):
                continue  # by its own BatchSampler over a DistributedSampler (DETR's)
            bound = _binding_statements(f, source)
            if bound and all("per-process" in f.hints(b) for b in bound):
                p.loader_skips.append((loop, f"batches come from `{short(source)}`, each process's own, as the hint "
                                             f"on line {f.line(bound[0])} says: not sharded, their moves kept"))
                continue
            sampler = rank_sharded(f, bound)
            if sampler is not None:
                p.loader_skips.append((loop, f"batches come from `{short(source)}`, a DataLoader over "
                                             f"`{short(sampler)}`, which shards the data by the process's rank "
                                             "when the run is distributed (codemod/analysis/sampling.py): not "
                                             "set up, their moves kept"))
                continue
            factory = sharding_factory(f, bound)
            if factory is not None:
                p.loader_skips.append((loop, f"batches come from `{short(source)}`, built by `{factory}`, which "
                                             "shards the data by the process's rank itself when told the run is "
                                             "distributed (codemod/analysis/libraries.py): not set up, their moves kept"))
                continue
            if o.many_devices:
                hint = f"; {loader_hint([f.line(b) for b in bound])}" if bound else ""
                self.refuse(loop, f"batches come from `{short(source)}`, which the rewrite can't show to be "
                                  f"a DataLoader it sets up: with devices={o.effective_devices} every process "
                                  "would train on all of them; refused for several devices (--devices 1 "
                                  f"converts it; or build the loader where the rewrite can see it{hint})")
                return
            p.loader_skips.append((loop, f"batches come from `{short(source)}`, not from a "
                                         "DataLoader built in this script: they keep their "
                                         "explicit move, and with several devices every "
                                         "process would see all of them (set the loader up "
                                         "with fabric.setup_dataloaders by hand)"))

    def _drawn_from_set_up_loader(self, call: cst.Call) -> bool:
        """The innermost loop around the backward draws its batches one at a time from a loader
        that is set up (``x, y = next(data_iter)``, ``data_iter = iter(train_loader)``)."""
        f = self.f
        loop = next((a for a in f.ancestors(call) if isinstance(a, (cst.For, cst.While))), None)
        return loop is not None and any(
            self._set_up(b.key, LOADER) and any(d is loop for d in drawing_loops(f, b.key))
            for b in f.bindings if b.kind == LOADER)

    def _called_from_data_loop(self, func: Optional[cst.FunctionDef]) -> bool:
        """``func`` (a function of the script, or a method called on ``self``) is called only in
        loops over loaders that are set up or sharded by their own DistributedSampler."""
        f, p = self.f, self.p
        if func is None:
            return False
        fn = f.functions.get(func.name.value)
        cls = f.enclosing_class(func)
        if fn is not None and fn.node is func:
            calls = list(fn.calls)
        elif cls is not None and func.name.value == "__call__":
            calls = self._calls_of_objects(cls)  # ``loss_scaler(loss, optimizer)``
        elif cls is not None:
            calls = [c for c in f.attribute_calls if m.matches(
                c.func, m.Attribute(value=m.Name("self"), attr=m.Name(func.name.value)))]
        else:
            return False
        for call in calls:
            loop = next((a for a in f.ancestors(call) if isinstance(a, cst.For)), None)
            key = f.key_of(data_source(f, loop.iter)) if loop is not None else None
            if key is None or not (self._set_up(key, LOADER) or (p.ddp is not None and p.ddp.sharded(f, key))):
                return False
        return bool(calls)

    def _calls_of_objects(self, cls: cst.ClassDef) -> list[cst.Call]:
        """``obj(...)`` where ``obj`` holds an object of ``cls`` (``obj = C()``, or a parameter
        it was passed to)."""
        f = self.f
        fn = f.functions.get(cls.name.value)
        if fn is None or fn.node is not cls:
            return []
        made = []
        for call in fn.calls:
            target = f.parent(call)
            if isinstance(target, cst.Assign) and len(target.targets) == 1 \
                    and isinstance(target.targets[0].target, cst.Name):
                made.append(f.key_of(target.targets[0].target))
        return [c for c in f.find(m.Call(func=m.Name())) if any(
            f.same_object(f.key_of(c.func), key) for key in made)]

    def _devices(self) -> None:
        f, p = self.f, self.p
        self._unsharded_loops()
        if p.refusal is not None:
            return
        batches = self._batch_moves()
        handled: set[int] = set()  # ids of device Name/Attribute nodes taken care of
        # timm's ``device = init_distributed_device(args)``: AR111 makes it ``device = fabric.device``
        fabric_devices = {f.key_of(s.body[0].targets[0].target) for s, _, _ in (p.ddp.started_by if p.ddp else ())
                          if isinstance(s.body[0], cst.Assign)} - {None}
        for move in f.device_moves:
            device_node = move.device_arg.value if move.device_arg is not None else None
            if device_node is not None and any(f.same_object(f.key_of(device_node), k) for k in fabric_devices) \
                    and not (move.removable and self._set_up(self._moved_key(move), MODEL)):
                continue  # Fabric's device already
            is_device_name = device_node is not None and (
                DEVICE in f.kinds_of(device_node)
            )
            literal = move.device_arg is None or is_literal_device(f, device_node)
            if p.ddp is not None and isinstance(device_node, cst.Name):  # ``.to(rank)``: its GPU
                func = f.function(move.call)
                literal = literal or device_node.value in p.ddp.rank_names.get(
                    id(func) if func is not None else None, set())
            # a device the script gets from elsewhere: ``args.device``, ``cfg.device``
            foreign = (not is_device_name and not literal and "device" in code(device_node).lower()
                       and not _follows_a_tensor(device_node)
                       and not _named_tensor_device(f, f.function(move.call), device_node))
            if not is_device_name and not literal and not foreign:
                continue  # ``.to(torch.float16)``, ``.to(other_tensor)``: not a move to a device
            ref = p.ref_at(f, move.call)
            is_model = self._set_up(self._moved_key(move), MODEL) and not self._built_again(move)
            placed_by_fabric = is_model or id(move.call) in batches
            if foreign and not (move.removable and placed_by_fabric):
                p.move_skips.append((move.call, f"`.to({short(device_node)})` left as is: Fabric "
                                                "does not manage that device; with several devices "
                                                "every process would use it (use fabric.device)"))
                continue
            if move.removable and placed_by_fabric:
                p.moves.append(MoveDecision(move, "remove"))
                if device_node is not None:
                    handled.add(id(device_node))
            elif ref is not None and p.after_creation(f, move.call):
                p.moves.append(MoveDecision(move, "fabric-device", ref))
                if device_node is not None:
                    handled.add(id(device_node))
            else:
                p.move_skips.append((move.call, "`fabric` can't be reached here; the move is kept"))
        self._trivial_statements()
        self._device_names(handled)

    def _built_again(self, move: DeviceMove) -> bool:
        """The move is of an object's model built again, in a method other than ``__init__`` and
        the set-up's, by an assignment above it there (JointBERT's ``load_model()``: ``self.model =
        Model.from_pretrained(...)``; ``self.model.to(self.device)``): Fabric never set that
        object up, so it is moved to ``fabric.device``, not left where it is made."""
        f, p = self.f, self.p
        key = self._moved_key(move)
        func = f.function(move.call)
        cls = f.enclosing_class(func) if func is not None else None
        if key is None or cls is None or func is init_of(cls) \
                or not m.matches(move.receiver, m.Attribute(value=m.Name("self"))):
            return False  # an object's own model, built again in a method other than __init__
        if any(f.function(g.after) is func for g in p.setups):
            return False
        text = code(move.receiver)
        for assign in m.findall(func, m.Assign()):
            if len(assign.targets) == 1 and code(assign.targets[0].target) == text \
                    and isinstance(unwrap_moves(assign.value), cst.Call) and f.line(assign) < f.line(move.call):
                return True
        return False

    def _moved_key(self, move: DeviceMove) -> Optional[Key]:
        """The object a move moves: ``model`` in ``model.to(d)`` and in ``model = Net().to(d)``."""
        f = self.f
        if isinstance(move.receiver, (cst.Name, cst.Attribute)):
            return f.key_of(move.receiver)
        parent = f.parent(move.call)
        while isinstance(parent, cst.Call) or (isinstance(parent, cst.Attribute) and parent.attr.value != "parameters"):
            parent = f.parent(parent)
        if isinstance(parent, cst.Assign) and len(parent.targets) == 1:
            return f.key_of(parent.targets[0].target)
        return None

    def _trivial_statements(self) -> None:
        """Statements that are left doing nothing once their moves are gone: ``model.to(device)``,
        ``x, y = x.to(device), y.to(device)``, ``if use_cuda: model = model.cuda()``."""
        f, p = self.f, self.p
        removed = {id(d.move.call) for d in p.moves if d.action == "remove"}
        if self.o.precision in MIXED_PRECISIONS:  # AR209 removes pure half's casts
            removed |= {id(c) for c in low_casts(f).training if strip_half(c) is c.func.value}
        statements = {id(f.statement(d.move.call)): f.statement(d.move.call)
                      for d in p.moves if d.action == "remove"}
        for s in statements.values():
            if not isinstance(s, cst.SimpleStatementLine) or len(s.body) != 1:
                continue
            stripped = self._without_moves(s.body[0], removed)
            if isinstance(stripped, cst.Expr) and not m.findall(stripped, m.Call()):
                p.trivial_stmts.append(s)
            elif isinstance(stripped, cst.Assign) and len(stripped.targets) == 1 and (
                code(stripped.targets[0].target) == code(stripped.value)
            ):
                p.trivial_stmts.append(s)

    def _without_moves(self, small: cst.BaseSmallStatement, removed: set[int]) -> cst.BaseSmallStatement:
        """``small`` with the moves in ``removed`` gone (``x.to(d)``: ``x``). Where they are all
        around its value or around the elements of its tuple (``x.cuda()``, ``model =
        model.to(device).to(d)``, ``x, y = x.to(d), y.to(d)``), those are replaced by the
        expressions they hold, as the transformer would; otherwise the statement is rebuilt by
        the transformer (for every one of a long script's thousands of moves: seconds)."""
        if isinstance(small, (cst.Expr, cst.Assign)):
            value = small.value
            parts = list(value.elements) if isinstance(value, cst.Tuple) else None
            cores, around = [], set()
            for core in [e.value for e in parts] if parts is not None else [value]:
                while isinstance(core, cst.Call) and id(core) in removed:
                    around.add(id(core))
                    core = core.func.value  # type: ignore[attr-defined]
                cores.append(core)
            if around and all(id(c) in around for c in self.f.find_in(small, m.Call()) if id(c) in removed):
                if parts is None:
                    return small.with_changes(value=cores[0])
                return small.with_changes(value=value.with_changes(
                    elements=[e.with_changes(value=c) for e, c in zip(parts, cores)]))
        return small.visit(_StripMoves(removed))

    def _device_names(self, handled: set[int]) -> None:
        f, p = self.f, self.p
        device_keys = [k for k, kinds in f.kinds.items() if DEVICE in kinds]
        for key in device_keys:
            for node in f.references(key):
                if id(node) in handled:
                    continue
                new = self._device_use(node)
                if new is None:
                    p.device_keeps.append((node, f"`{short(node)}` is still used here as it was "
                                                 f"(`{short(f.statement(node))}`); its definition stays"))
                elif new != "":
                    p.device_uses.append((node, new))
        kept_keys = {f.key_of(n) for n, _ in p.device_keeps}
        for b in f.device_defs:
            if b.key in kept_keys or any(f.key_of(n) == b.key for n, _ in p.device_keeps):
                continue
            s = b.stmt
            if m.matches(s, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(m.Name())])])):
                p.removed_device_defs.append(b)
        if p.anchor is not None and any(b.stmt is p.anchor for b in p.removed_device_defs):
            p.replaces_anchor = True

    def _device_use(self, node: cst.CSTNode) -> Optional[str]:
        """What a read of the device becomes: new code, "" when handled elsewhere, None: kept."""
        f, p = self.f, self.p
        parent = f.parent(node)
        ref = p.ref_at(f, node)
        if ref is None or not p.after_creation(f, node):
            return None
        if isinstance(parent, cst.Arg) and parent.value is node:
            call = f.parent(parent)
            target = _called_function(f, call)
            if target is not None:
                func = target if isinstance(target, cst.FunctionDef) else init_of(target)
                param = p.threaded_params.get(id(func)) if func is not None else None
                if param is not None and _arg_param(f, target, call, parent) is param:
                    p.thread_args.append((parent, ref))
                    return ""
            if parent.keyword is not None and parent.keyword.value in ("device", "map_location"):
                return f"{ref}.device"
            if parent.keyword is None and f.qualname(call) == "builtins.print":
                return f"{ref}.device"
            return None
        if isinstance(parent, cst.Assign) and parent.value is node:
            # ``self.device = device`` in a threaded __init__
            target = parent.targets[0].target
            cls_key = f.key_of(target) if isinstance(target, cst.Attribute) else None
            if cls_key is not None and p.threaded_attrs.get(id(cls_key[0])) == code(target):
                return ""
            return None
        if isinstance(parent, cst.Attribute) and parent.value is node and parent.attr.value in ("type", "index"):
            return f"{ref}.device"
        if isinstance(parent, cst.FormattedStringExpression):
            return f"{ref}.device"
        return None


class _StripMoves(cst.CSTTransformer):
    def __init__(self, removed: set[int]) -> None:
        super().__init__()
        self.removed = removed

    def on_leave(self, original, updated):  # type: ignore[override]
        if id(original) in self.removed:
            return updated.func.value
        return updated


def _called_function(facts: ScriptFacts, call: cst.CSTNode):
    if not isinstance(call, cst.Call) or not isinstance(call.func, cst.Name):
        return None
    fn = facts.functions.get(call.func.value)
    if fn is None or call not in fn.calls:
        return None
    return fn.node


def _arg_param(facts: ScriptFacts, target, call: cst.Call, arg: cst.Arg) -> Optional[cst.Param]:
    return param_for(positional_params(target), target, arg, list(call.args).index(arg))


def _named_tensor_device(f, func: Optional[cst.FunctionDef], node: Optional[cst.BaseExpression]) -> bool:
    """``shared_device``, bound in its function only to a tensor's device
    (``shared_device = self.param_groups[0]["params"][0].device``, SAM's)."""
    if func is None or not isinstance(node, cst.Name):
        return False
    values = [a.value for a in f.find_in(func, m.Assign(targets=[m.AssignTarget(m.Name(node.value))]))]
    return bool(values) and all(_follows_a_tensor(v) for v in values)


def _follows_a_tensor(node: cst.BaseExpression) -> bool:
    """``x.device``, ``next(model.parameters()).device``: the device of a tensor or module,
    which follows wherever Fabric put it."""
    return (isinstance(node, cst.Attribute) and node.attr.value == "device"
            and not _SETTINGS.search(" ".join(_names_of(node.value))))


def _names_of(node: cst.BaseExpression) -> list[str]:
    """The names an expression reaches its object by (``self.param_groups[0]["params"]`` ->
    self, param_groups): not its subscripts' keys."""
    while isinstance(node, (cst.Subscript, cst.Call)):
        node = node.value if isinstance(node, cst.Subscript) else node.func
    if isinstance(node, cst.Attribute):
        return [*_names_of(node.value), node.attr.value]
    return [node.value] if isinstance(node, cst.Name) else [code(node)]


def _binding_statements(f: ScriptFacts, source, depth: int = 0) -> list[cst.BaseStatement]:
    """The statements that bind the name a loop draws its batches from (through the arguments
    of the calls of a function that receives it), where a hint would go."""
    if not isinstance(source, cst.Name) or depth > 8:
        return []
    bound = f.assignments(source)
    if bound and all(isinstance(node, cst.Name) for node, _ in bound):  # assigned (not a parameter)
        return [f.statement(node) for node, _ in bound]
    key = f.key_of(source)
    func = key[0] if key is not None else None
    out: list[cst.BaseStatement] = []
    if isinstance(func, cst.FunctionDef):  # a parameter: where the callers bind what they pass
        fn = f.functions.get(func.name.value)
        for call in (fn.calls if fn is not None and fn.node is func else []):
            for index, arg in enumerate(call.args):
                param = param_for(positional_params(func), func, arg, index)
                if param is not None and param.name.value == source.value:
                    out += _binding_statements(f, arg.value, depth + 1)
    return out
