"""The script's own device where a node stands, as an expression of its type (``device.type``,
``torch.device(args.device).type``, ``"cuda"``): what an autocast needs there. Read by the native
plan (rules/native/_plan.py) and by the precision of the script's own autocast (rules/precision/own_precision.py)."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import DEVICE, MODEL, ScriptFacts, code

#: calls whose result is a torch.device (its ``.type`` is the device type)
DEVICE_CALLS = ("torch.device", "torch.accelerator.current_accelerator")


def _bound_in_its_file(f: ScriptFacts, node: cst.CSTNode, key) -> bool:
    """Whether a global ``key`` visible at ``node`` is bound in the file ``node`` comes from: in a
    project's program, the script's globals are no globals of its modules."""
    owner, path = key
    if not isinstance(owner, cst.Module) or f.body_parts is None:
        return True
    scope = f.scope_of_owner(owner)
    if scope is None:
        return False
    part = f.part_of(node)
    return any(f.part_of(a.node) == part for a in scope[path.split(".")[0]] if getattr(a, "node", None) is not None)


def _visible(f: ScriptFacts, node: cst.CSTNode, kind: str) -> list[tuple]:
    """The keys of objects of ``kind`` that code at ``node`` reads by their path: ``self.<attr>``
    in a method of their class, a name in scope (bound in the same file), with their paths."""
    func = f.function(node)
    cls = f.enclosing_class(func) if func is not None else None
    visible = []
    for key, kinds in f.kinds.items():
        if kind not in kinds:
            continue
        owner, path = key
        if path.startswith("self."):
            if owner is cls and cls is not None:
                visible.append((key, path))
        elif f.key_for_name(node, path) == key and _bound_in_its_file(f, node, key):
            visible.append((key, path))
    return visible


def device_type_at(f: ScriptFacts, node: cst.CSTNode) -> Optional[str]:
    """An expression for the type of the script's device where ``node`` stands, or None."""
    visible = _visible(f, node, DEVICE)
    if visible:
        visible.sort(key=lambda kp: (kp[1].rsplit(".", 1)[-1] != "device", kp[1]))
        key, name = visible[0]
        values = [b.value for b in f.device_defs if f.same_object(b.key, key)]
        if values and all(isinstance(v, cst.Call) and f.qualname(v) in DEVICE_CALLS for v in values):
            return f"{name}.type"
        return f"torch.device({name}).type"
    for mv in f.device_moves:  # ``rank, device = setup()``: the name the script moves to
        arg = mv.device_arg.value if mv.device_arg is not None else None
        if isinstance(arg, cst.Name) and f.key_of(arg) is not None \
                and f.key_for_name(node, arg.value) == f.key_of(arg):
            return f"torch.device({arg.value}).type"
        # ``t.to(args.device)``: an attribute of a name seen here too (``args``, a parameter), bound
        # before it (not ``labels.to(pred1.device)``, whose ``pred1`` comes later); or of
        # ``self.args`` in a method of the same class
        if m.matches(arg, m.Attribute(value=m.Name(), attr=m.Name("device"))) \
                and f.key_of(arg.value) is not None and f.key_for_name(node, arg.value.value) == f.key_of(arg.value) \
                and all(isinstance(bound, cst.Param) or f.line(bound) < f.line(node)
                        for bound, _ in f.assignments(arg.value)):
            return f"torch.device({code(arg)}).type"
        if m.matches(arg, m.Attribute(value=m.Attribute(value=m.Name("self"), attr=m.Name()), attr=m.Name("device"))) \
                and f.function(node) is not None and f.function(mv.call) is not None \
                and f.enclosing_class(f.function(node)) is not None \
                and f.enclosing_class(f.function(node)) is f.enclosing_class(f.function(mv.call)):
            return f"torch.device({code(arg)}).type"
    flag = cuda_flag(f, node)
    if flag is not None:
        return f'"cuda" if {flag} else "cpu"'  # ``if cuda: model.cuda()``: CUDA only when there is one
    if any(mv.device_arg is None or "cuda" in code(mv.device_arg.value) for mv in f.device_moves):
        return '"cuda"'  # ``.cuda()`` / ``.to("cuda")``: the script needs CUDA anyway
    if not f.device_moves and not f.device_defs:
        return '"cpu"'  # a script that never leaves the CPU
    return None


def cuda_flag(f: ScriptFacts, node: cst.CSTNode) -> Optional[str]:
    """``cuda = torch.cuda.is_available()`` (PyTorch-GAN's), visible at ``node``, when every
    ``.cuda()`` of the script is under ``if cuda:``: the flag's name."""
    moves = [mv for mv in f.device_moves if mv.device_arg is None]
    if not moves:
        return None
    tests = {id(mv.call): [a.test for a in f.ancestors(mv.call) if isinstance(a, cst.If)] for mv in moves}
    for name in {t.value for ts in tests.values() for t in ts if isinstance(t, cst.Name)}:
        key = f.key_for_name(node, name)
        value = f.assigned_value(next(t for ts in tests.values() for t in ts
                                      if isinstance(t, cst.Name) and t.value == name))
        if key is None or value is None or not any(
                f.qualname(c) == "torch.cuda.is_available" for c in m.findall(value, m.Call())):
            continue
        if all(any(isinstance(t, cst.Name) and t.value == name and f.key_of(t) == key for t in ts)
               for ts in tests.values()):
            return name
    return None


def model_device_type_at(f: ScriptFacts, node: cst.CSTNode) -> Optional[str]:
    """Where no device is in reach (a helper given only the model): the type of the device of the
    parameters of a model visible at ``node`` (``next(model.parameters()).device.type``), which is
    where its forward runs."""
    visible = sorted(path for _, path in _visible(f, node, MODEL) if path.startswith("self.") or "." not in path)
    return f"next({visible[0]}.parameters()).device.type" if visible else None
