"""Where a process of a hand-made distributed script is (codemod/ddp/hand.py): its reads of its
place (``int(os.environ["LOCAL_RANK"])``, ``RANK``, ``WORLD_SIZE``, ``dist.get_rank()``), which
become Fabric's ``local_rank`` / ``global_rank`` / ``world_size``, and the names that hold the
rank: those assigned from such a read, and the parameters and attributes it is passed on to
(``Trainer(model, data, optimizer, rank)`` -> ``gpu_id`` in ``__init__`` -> ``self.gpu_id``), so
that a print naming the rank stays a print on every process.
"""

from __future__ import annotations

from typing import Callable, Optional, Protocol

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts, code, init_of, param_for, short



class HandDDP(Protocol):
    """What the places of a process fill in of the hand-made DDP found (codemod/ddp/hand.py's
    HandDDP): a Protocol, so that this module, which that one imports, imports nothing back."""

    removed: list[cst.BaseStatement]
    reads: list[tuple[cst.CSTNode, str]]  # node -> fabric attribute
    env_tests: list[tuple[cst.BaseExpression, bool]]
    rank_names: dict[Optional[int], set[str]]
    env_world: bool
    process_devices: list[tuple[cst.BaseExpression, bool]]

#: what a process reads about its place, and Fabric's name for it
PLACE_CALLS = {
    "torch.distributed.get_rank": "global_rank",
    "torch.distributed.distributed_c10d.get_rank": "global_rank",
    "torch.distributed.get_world_size": "world_size",
    "torch.distributed.distributed_c10d.get_world_size": "world_size",
}
PLACE_ENV = {"RANK": "global_rank", "LOCAL_RANK": "local_rank", "WORLD_SIZE": "world_size"}
MASTER_ENV = ("MASTER_ADDR", "MASTER_PORT")


def env_key(f: ScriptFacts, node: cst.BaseExpression) -> Optional[str]:
    """``os.environ["RANK"]``, ``os.environ.get("RANK", 0)``, ``os.getenv("RANK")`` -> "RANK"."""
    key: Optional[cst.BaseExpression] = None
    if isinstance(node, cst.Subscript) and f.qualname(node.value) == "os.environ" and len(node.slice) == 1 \
            and isinstance(node.slice[0].slice, cst.Index):
        key = node.slice[0].slice.value
    elif isinstance(node, cst.Call) and node.args and (
            f.qualname(node) == "os.getenv"
            or (isinstance(node.func, cst.Attribute) and node.func.attr.value == "get"
                and f.qualname(node.func.value) == "os.environ")):
        key = node.args[0].value
    if isinstance(key, cst.SimpleString) and isinstance(key.evaluated_value, str):
        return key.evaluated_value
    return None


def strict_env_read(f: ScriptFacts, node: cst.CSTNode) -> bool:
    """``int(os.environ["LOCAL_RANK"])``: a read of the launcher's environment with no default.
    Kept where ``fabric`` can't be reached and it runs before Fabric exists (the plan checks), it
    is never silently wrong: torchrun sets RANK, LOCAL_RANK and WORLD_SIZE for every process,
    Fabric's own launcher LOCAL_RANK and WORLD_SIZE for the processes it starts, and where a
    variable is not set the read fails at start-up with a KeyError (read in lightning 2.6:
    fabric/strategies/launchers/subprocess_script.py)."""
    inner = node.args[0].value if isinstance(node, cst.Call) and len(node.args) == 1 else node
    return isinstance(inner, cst.Subscript) and env_key(f, inner) in PLACE_ENV


def places(f: ScriptFacts, d: "HandDDP", problem: Callable) -> None:
    """The reads of the process's place (``int(os.environ["LOCAL_RANK"])``, ``dist.get_rank()``)
    and the names that then hold the rank, by the function (or class) they are in."""
    removed = {id(s) for s in d.removed}
    for call in f.calls_named(*PLACE_CALLS):
        if id(f.statement(call)) not in removed:
            d.reads.append((call, PLACE_CALLS[f.qualname(call)]))
    for node in f.find(m.Subscript() | m.Call()):
        var = env_key(f, node)
        if var in MASTER_ENV or var is None or var not in PLACE_ENV and var != "LOCAL_WORLD_SIZE":
            continue
        if id(f.statement(node)) in removed:
            continue
        outer = f.parent(node)
        if isinstance(outer, cst.AssignTarget):
            continue  # ``os.environ["RANK"] = str(args.rank)``: written for a launcher, not read
        arg = outer if isinstance(outer, cst.Arg) else None
        call = f.parent(arg) if arg is not None else None
        if not (isinstance(call, cst.Call) and m.matches(call.func, m.Name("int")) and len(call.args) == 1):
            return problem(node, f"`{short(node)}` is read as text: only `int(...)` of it is "
                                      "converted")
        if var == "LOCAL_WORLD_SIZE":
            return problem(node, "LOCAL_WORLD_SIZE is read: convert it to fabric's devices by hand")
        d.reads.append((call, PLACE_ENV[var]))
        if var == "WORLD_SIZE":
            d.env_world = True
    _env_tests(f, d, removed)
    for node, attr in d.reads:
        if attr in ("global_rank", "local_rank"):
            assign = f.parent(node)
            target = assign.targets[0].target if isinstance(assign, cst.Assign) and len(assign.targets) == 1 \
                else None
            func = f.function(node)
            if isinstance(target, cst.Name):
                d.rank_names.setdefault(id(func) if func else None, set()).add(target.value)
            elif m.matches(target, m.Attribute(value=m.Name("self"))) and func is not None \
                    and f.enclosing_class(func) is not None:  # ``self.gpu_id``: in every method
                d.rank_names.setdefault(id(f.enclosing_class(func)), set()).add(code(target))
    _passed_ranks(f, d)
    _process_devices(f, d, removed)


def _process_devices(f: ScriptFacts, d: "HandDDP", removed: set[int]) -> None:
    """The device a process computes from its rank: nanoGPT's ``device = f'cuda:{ddp_local_rank}'``
    under ``if ddp:``, ``torch.device("cuda", local_rank)``, the minGPT-ddp example's
    ``torch.device(f"{acc}:{rank}")`` (``acc`` the current accelerator). Under Fabric that is the device it
    gives the process (the CPU with ``--accelerator cpu``, where a CUDA device would raise).
    (the value, whether it is text: ``str(fabric.device)`` then, else ``fabric.device``)."""
    for assign in f.find(m.Assign() | m.AnnAssign()):
        targets = [t.target for t in assign.targets] if isinstance(assign, cst.Assign) else [assign.target]
        value = assign.value
        if value is None or len(targets) != 1 or not isinstance(targets[0], (cst.Name, cst.Attribute)) \
                or id(f.statement(assign)) in removed or f.find_in(value, m.Lambda()):
            continue
        device_call = isinstance(value, cst.Call) and f.qualname(value) == "torch.device"
        if "cuda" not in code(value) and not device_call:
            continue  # text that names no device: a log line, a path
        func = f.function(assign)
        cls = f.enclosing_class(func) if func is not None else None
        ranks = d.rank_names.get(id(func) if func is not None else None, set()) \
            | (d.rank_names.get(id(cls), set()) if cls is not None else set())
        reads = {n.value for n in f.find_in(value, m.Name())} | {code(a) for a in f.find_in(value, m.Attribute())}
        if not reads & ranks:
            continue
        calls = [c for c in f.find_in(value, m.Call())]
        if device_call and len(calls) == 1:  # ``torch.device(f"{acc}:{local_rank}")`` too
            d.process_devices.append((value, False))
        elif isinstance(value, (cst.FormattedString, cst.BinaryOperation)) \
                and all(m.matches(c.func, m.Name("str")) for c in calls):
            d.process_devices.append((value, True))

def _env_tests(f: ScriptFacts, d: "HandDDP", removed: set[int]) -> None:
    """``"RANK" in os.environ`` (``and "WORLD_SIZE" in os.environ``): the script's test of whether
    a launcher started it, which under Fabric is whether it runs several processes; ``not in``
    the other way round. (the test, whether it tests for several processes)."""
    def test(node: cst.CSTNode) -> Optional[bool]:
        if not (isinstance(node, cst.Comparison) and len(node.comparisons) == 1
                and isinstance(node.left, cst.SimpleString) and node.left.evaluated_value in PLACE_ENV
                and f.qualname(node.comparisons[0].comparator) == "os.environ"):
            return None
        op = node.comparisons[0].operator
        return True if isinstance(op, cst.In) else False if isinstance(op, cst.NotIn) else None

    seen: set[int] = set()
    for node in f.find(m.Comparison()):
        several = test(node)
        if several is None or id(f.statement(node)) in removed or id(node) in seen:
            continue
        whole: cst.CSTNode = node
        parent = f.parent(whole)
        while isinstance(parent, cst.BooleanOperation) and isinstance(parent.operator, cst.And) and several \
                and test(parent.left if parent.right is whole else parent.right) is True:
            seen.update({id(parent.left), id(parent.right)})
            whole, parent = parent, f.parent(parent)
        d.env_tests.append((whole, several))


def _passed_ranks(f: ScriptFacts, d: "HandDDP") -> None:
    """The rank passed on: ``Trainer(model, data, optimizer, rank)`` makes ``gpu_id`` the
    rank in ``__init__``, and ``self.gpu_id = gpu_id`` there in every method."""
    for _ in range(3):  # calls through a few levels of functions and classes
        grew = False
        for fn in f.functions.values():
            init = init_of(fn.node) if isinstance(fn.node, cst.ClassDef) else fn.node
            if init is None:
                continue
            for call in fn.calls:
                caller = f.function(call)
                ranks = d.rank_names.get(id(caller) if caller is not None else None, set())
                cls = f.enclosing_class(caller) if caller is not None else None
                ranks = ranks | (d.rank_names.get(id(cls), set()) if cls is not None else set())
                for index, arg in enumerate(call.args):
                    if code(arg.value) not in ranks:
                        continue
                    param = param_for(fn.params, fn.node, arg, index)
                    if param is None:
                        continue
                    names = d.rank_names.setdefault(id(init), set())
                    if param.name.value not in names:
                        names.add(param.name.value)
                        grew = True
                    if isinstance(fn.node, cst.ClassDef):
                        for assign in m.findall(init, m.Assign(targets=[m.AssignTarget(
                                m.Attribute(value=m.Name("self")))], value=m.Name(param.name.value))):
                            attrs = d.rank_names.setdefault(id(fn.node), set())
                            attr = code(assign.targets[0].target)
                            if attr not in attrs:
                                attrs.add(attr)
                                grew = True
        if not grew:
            return
