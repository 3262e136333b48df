"""Loaders whose batches are each process's own already, so that Fabric must not shard them
again: those a library's factory builds when told the run is distributed (timm's
``create_loader(..., distributed=args.distributed)``, codemod/analysis/libraries.py), and those
whose sampler shards by rank.

Which sampler a loader draws from is read as Python evaluates the code that builds it: where a
project's helper builds the loader over a sampler that shards the data by the process's rank,
its batches are each process's own already (maskrcnn-benchmark's ``data_loader =
make_data_loader(cfg, is_train=True, is_distributed=distributed)``: a DataLoader whose
``batch_sampler`` wraps ``make_data_sampler(dataset, shuffle, is_distributed)``, which returns
the package's own ``samplers.DistributedSampler`` under ``if distributed:``).

The reading follows:

- a name to what its assignments bind, a parameter to what the call passes for it (its
  default where the call passes none);
- a call of a function of the program to its returns, less those on the side of an ``if
  <parameter>:`` that the call's literal ``True``/``False`` (or the default of a parameter not
  passed) never takes (``and``/``or`` of such tests too), and those after an ``if`` whose side
  taken returns: ``make_data_sampler(dataset, shuffle, False)`` is no distributed sampler;
- ``loaders[0]`` to what ``loaders.append(...)`` and the list's literal hold;
- a batch sampler (``torch.utils.data.BatchSampler``, or a class of the project derived from a
  torch sampler) to the sampler it is built over, its first argument;
- a class of the project, in the program or in a module it does not read (the sampler's class
  is read from its file, with ``ast``), to whether it reads the process's rank or the world size.

A sampler reached on some path is enough, as for a script's own ``RandomSampler(ds) if
args.local_rank == -1 else DistributedSampler(ds)``: the script's flag is the run's
(codemod/ddp/hand.py ties it to Fabric's processes).
"""

from __future__ import annotations

import ast
from pathlib import Path
from typing import TYPE_CHECKING, Iterator, Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.arguments import positional
from accelerate_rewrite.codemod.analysis.kinds import DATALOADERS
from accelerate_rewrite.codemod.analysis.libraries import SHARDED_LOADER_FACTORIES
from accelerate_rewrite.codemod.analysis.returns import _returns
from accelerate_rewrite.codemod.analysis.siblings import _file, import_folders, parsed_file, relative_base
from accelerate_rewrite.codemod.analysis.syntax import param_for, positional_params

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts

#: torch's own DistributedSampler
DISTRIBUTED_SAMPLERS = ("torch.utils.data.distributed.DistributedSampler", "torch.utils.data.DistributedSampler")
#: what a sampler reads when it shards the data by the process's place itself
SHARDING = ("get_world_size", "get_rank", "num_replicas")
#: keywords a loader or a batch sampler takes its sampler by
_SAMPLER_KEYWORDS = ("sampler", "batch_sampler")
_DEPTH = 8

#: a parameter -> (what the call passes for it, or its default; the parameters that expression reads)
Env = dict[str, tuple[cst.BaseExpression, "Env"]]


def rank_sharded_loader(f: "Facts", value: cst.BaseExpression) -> Optional[cst.Call]:
    """``value`` (what a loader name is bound to) is, on every path the reading finds, a
    DataLoader whose sampler or batch sampler may hold a sampler that shards the data by the
    process's rank: that sampler's call; None otherwise (also where a path ends in something
    that is no DataLoader)."""
    found = None
    loaders = list(_values(f, value, {}, 0))
    if not loaders:
        return None
    for loader, env in loaders:
        if not (isinstance(loader, cst.Call) and f.qualnames(loader) & set(DATALOADERS)):
            return None
        arg = next((a for a in loader.args if a.keyword is not None and a.keyword.value in _SAMPLER_KEYWORDS), None)
        sampler = _sharding(f, arg.value, env, 0) if arg is not None else None
        if sampler is None:
            return None
        found = found or sampler
    return found


def rank_sharded(f: "Facts", bound: list[cst.BaseStatement]) -> Optional[cst.Call]:
    """Where every binding is ``name = <value>`` and each value, read through the project's
    helpers, is a DataLoader over a sampler that shards by rank (``rank_sharded_loader``):
    that sampler's call."""
    found = None
    for stmt in bound:
        if not m.matches(stmt, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
            return None
        found = rank_sharded_loader(f, stmt.body[0].value)
        if found is None:
            return None
    return found


def sharding_factory(f: "Facts", bound: list[cst.BaseStatement]) -> Optional[str]:
    """The qualified name of the library's loader factory every binding calls, where it shards
    by rank itself (timm's ``create_loader(..., distributed=args.distributed)``), or None."""
    found = None
    for stmt in bound:
        calls = [c for c in f.find_in(stmt, m.Call()) if f.qualnames(c) & set(SHARDED_LOADER_FACTORIES)]
        if not calls:
            return None
        name = min(f.qualnames(calls[0]) & set(SHARDED_LOADER_FACTORIES))
        keyword = SHARDED_LOADER_FACTORIES[name].distributed.keyword
        # told by keyword, or by a ``**common_loader_kwargs`` dict that holds it (timm's train.py,
        # whose other ``**`` dicts need not be readable)
        told = any(a.keyword is not None and a.keyword.value == keyword for a in calls[0].args) or any(
            a.star == "**" and isinstance(a.value, cst.Name) and _dict_holds(f, a.value, keyword) for a in calls[0].args)
        if not told:
            return None  # never told: one process's loader over all the data
        found = name
    return found


def _dict_holds(f: "Facts", name: cst.Name, keyword: str) -> bool:
    """``common_loader_kwargs = dict(..., distributed=args.distributed, ...)`` (timm's train.py,
    passed as ``**common_loader_kwargs``): the dict its one assignment builds has ``keyword``."""
    value = f.assigned_value(name)
    if m.matches(value, m.Call(func=m.Name("dict"))):
        return any(a.keyword is not None and a.keyword.value == keyword for a in value.args)
    if isinstance(value, cst.Dict):
        return any(isinstance(e, cst.DictElement) and m.matches(e.key, m.SimpleString()) and
                   e.key.evaluated_value == keyword for e in value.elements)
    return False


def _sharding(f: "Facts", expr: cst.BaseExpression, env: Env, depth: int) -> Optional[cst.Call]:
    """The call of a rank-sharding sampler ``expr`` may hold, through batch samplers built over it."""
    if depth > _DEPTH:
        return None
    for value, inner in _values(f, expr, env, depth):
        if not isinstance(value, cst.Call):
            continue
        quals = f.qualnames(value)
        if quals & set(DISTRIBUTED_SAMPLERS):
            return value
        reads_rank, is_sampler = _sampler_class(f, value, quals)
        if reads_rank:
            return value
        if is_sampler or any(q.startswith("torch.utils.data") and q.endswith("BatchSampler") for q in quals):
            over = next((a.value for a in value.args if a.keyword is not None
                         and a.keyword.value in _SAMPLER_KEYWORDS), None)
            first = positional(value)
            over = over if over is not None else (first[0] if first else None)
            found = _sharding(f, over, inner, depth + 1) if over is not None else None
            if found is not None:
                return found
    return None


def _values(f: "Facts", expr: cst.BaseExpression, env: Env, depth: int) -> Iterator[tuple[cst.BaseExpression, Env]]:
    """What ``expr`` may evaluate to, each with the parameters of the function it stands in."""
    if depth > _DEPTH:
        return
    if isinstance(expr, cst.Name):
        for node, value in f.assignments(expr):
            if isinstance(node, cst.Param) and expr.value in env:
                passed, outer = env[expr.value]
                yield from _values(f, passed, outer, depth + 1)
            elif value is not None and value is not expr:
                yield from _values(f, value, env, depth + 1)
        return
    if isinstance(expr, cst.IfExp):
        known = _truth(f, expr.test, env)
        for branch, taken in ((expr.body, True), (expr.orelse, False)):
            if known is None or known == taken:
                yield from _values(f, branch, env, depth + 1)
        return
    if isinstance(expr, cst.Subscript) and isinstance(expr.value, cst.Name):
        for element in _list_elements(f, expr.value):  # ``data_loaders[0]``
            yield from _values(f, element, env, depth + 1)
        return
    if isinstance(expr, cst.Call) and isinstance(expr.func, cst.Name):
        fn = f.functions.get(expr.func.value)
        if fn is not None and isinstance(fn.node, cst.FunctionDef):
            bound = _bind(f, fn.node, expr, env)
            if bound is None:
                return
            for ret in _live_returns(f, fn.node, bound):
                if ret.value is not None:
                    yield from _values(f, ret.value, bound, depth + 1)
            return
    yield expr, env


def _bind(f: "Facts", func: cst.FunctionDef, call: cst.Call, env: Env) -> Optional[Env]:
    """The function's parameters as ``call`` binds them (the defaults of those it does not
    pass); None where a ``*args`` or ``**kwargs`` hides which is which."""
    if any(a.star for a in call.args):
        return None
    out: Env = {}
    params = positional_params(func)
    for index, arg in enumerate(call.args):
        param = param_for(params, func, arg, index)
        if param is not None:
            out[param.name.value] = (arg.value, env)
    for param in [*func.params.posonly_params, *func.params.params, *func.params.kwonly_params]:
        if param.name.value not in out and param.default is not None:
            out[param.name.value] = (param.default, {})
    return out


def _truth(f: "Facts", test: cst.BaseExpression, env: Env) -> Optional[bool]:
    """The literal truth of ``test`` (a parameter, ``not`` one) where the call fixes it."""
    if isinstance(test, cst.UnaryOperation) and isinstance(test.operator, cst.Not):
        inner = _truth(f, test.expression, env)
        return None if inner is None else not inner
    if isinstance(test, cst.BooleanOperation):  # ``if is_train or is_for_period:``
        left, right = _truth(f, test.left, env), _truth(f, test.right, env)
        decides = isinstance(test.operator, cst.Or)  # True decides an ``or``, False an ``and``
        if decides in (left, right):
            return decides
        return None if left is None or right is None else not decides
    if isinstance(test, cst.Name) and test.value in ("True", "False", "None"):
        return test.value == "True"
    if isinstance(test, cst.Name) and test.value in env:
        passed, outer = env[test.value]
        return _truth(f, passed, outer) if passed is not test else None
    return None


def _live_returns(f: "Facts", func: cst.FunctionDef, env: Env) -> list[cst.Return]:
    """The function's own returns, less those on the side of an ``if`` whose test the call fixes
    to the other side."""
    out = []
    for ret in _returns(f, func):
        dead = False
        node: cst.CSTNode = ret
        for parent in f.ancestors(ret):
            if parent is func:
                break
            if isinstance(parent, cst.If):
                known = _truth(f, parent.test, env)
                if known is not None and known != (node is parent.body):
                    dead = True
            if isinstance(parent, cst.IndentedBlock) and node in parent.body:  # after an ``if`` that returns
                before = parent.body[:parent.body.index(node)]
                dead = dead or any(isinstance(s, cst.If) and _returns_first(f, s, env) for s in before)
            node = parent
        if not dead:
            out.append(ret)
    return out


def _list_elements(f: "Facts", name: cst.Name) -> list[cst.BaseExpression]:
    """What the list ``name`` holds: its literal's elements and what ``name.append(...)`` adds."""
    key = f.key_of(name)
    if key is None:
        return []
    out: list[cst.BaseExpression] = []
    for _, value in f.assignments(name):
        if isinstance(value, cst.List):
            out += [e.value for e in value.elements if isinstance(e, cst.Element)]
        elif value is not None:
            return []  # bound to something else too: not a list the reading knows
    for call in f.attribute_calls:
        if m.matches(call.func, m.Attribute(value=m.Name(name.value), attr=m.Name("append"))) \
                and f.key_of(call.func.value) == key and len(call.args) == 1 and not call.args[0].star:
            out.append(call.args[0].value)
    return out


def _sampler_class(f: "Facts", call: cst.Call, quals: set[str]) -> tuple[bool, bool]:
    """(the class ``call`` builds reads the rank or the world size, it is a sampler: derived
    from one of torch's), for a class of the program or of a module of the project."""
    fn = f.functions.get(call.func.value) if isinstance(call.func, cst.Name) else None
    if fn is not None and isinstance(fn.node, cst.ClassDef):
        reads = any((n.value if isinstance(n, cst.Name) else n.attr.value) in SHARDING
                    for n in f.find_in(fn.node, m.Name() | m.Attribute()))
        sampler = any(q.startswith("torch.utils.data") and q.endswith("Sampler")
                      for base in fn.node.bases for q in f.qualnames(base.value))
        return reads, sampler
    file = _part_file(f, call)
    for qual in quals:
        found = _class_from(file, qual, import_folders(f.folder, None) if f.folder is not None else [])
        if found is not None:
            return found
    return False, False


def _part_file(f: "Facts", node: cst.CSTNode) -> Optional[Path]:
    files = getattr(f, "part_files", None)
    if not files:
        return None
    index = f.part_of(node)
    return files[index] if index < len(files) else None


def _class_from(file: Optional[Path], qual: str, folders: list[Path], depth: int = 0) -> Optional[tuple[bool, bool]]:
    """``qual`` (``.samplers.DistributedSampler``, relative to ``file``'s package, or absolute)
    read in its module: (reads the rank, is a sampler), or None where it is no class found."""
    level = len(qual) - len(qual.lstrip("."))
    dotted, _, name = qual[level:].rpartition(".")
    if not dotted or depth > 3:
        return None
    if level:
        base = relative_base(file, level) if file is not None else None
        where = _file(base, dotted) if base is not None else None
    else:
        where = next((p for p in (_file(folder, dotted) for folder in folders) if p is not None), None)
    tree = parsed_file(where) if where is not None else None
    if tree is None:
        return None
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return _read_class(node, tree)
        if isinstance(node, ast.ImportFrom) and any((a.asname or a.name) == name for a in node.names):
            alias = next(a for a in node.names if (a.asname or a.name) == name)
            inner = "." * node.level + ".".join(p for p in (node.module, alias.name) if p)
            return _class_from(where, inner, folders, depth + 1)
    return None


def _read_class(cls: ast.ClassDef, tree: ast.Module) -> tuple[bool, bool]:
    reads = any(isinstance(n, ast.Name) and n.id in SHARDING or isinstance(n, ast.Attribute) and n.attr in SHARDING
                or isinstance(n, ast.arg) and n.arg in SHARDING for n in ast.walk(cls))
    torch_names = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom)
                   and (n.module or "").startswith("torch.utils.data") for a in n.names if a.name.endswith("Sampler")}
    sampler = any(isinstance(b, ast.Name) and b.id in torch_names
                  or isinstance(b, ast.Attribute) and b.attr.endswith("Sampler")
                  and ast.unparse(b.value).startswith("torch.utils.data") for b in cls.bases)
    return reads, sampler


def _returns_first(f: "Facts", stmt: cst.If, env: Env) -> bool:
    """The side of ``stmt`` the call takes ends in a return (``if is_train: ... return
    loaders[0]``): what follows the ``if`` is never reached."""
    known = _truth(f, stmt.test, env)
    if known is None:
        return False
    block = stmt.body if known else stmt.orelse
    if isinstance(block, cst.If):
        return _returns_first(f, block, env)
    if isinstance(block, cst.Else):
        block = block.body
    last = block.body[-1] if isinstance(block, cst.IndentedBlock) and block.body else None
    return m.matches(last, m.SimpleStatementLine(body=[m.Return()]))
