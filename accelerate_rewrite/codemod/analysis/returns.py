"""Objects that a function of the script builds and returns: ``train_loader, val_loader =
make_loaders(args)`` binds two DataLoaders, although no ``DataLoader(...)`` stands there.

Run once by ScriptFacts, after the collector and before the flow of kinds, so that the names a
helper's result is unpacked into are loaders everywhere they go (into ``train(model, loader)``).
The loaders built inside the helper are kept in ``returned``: they are set up where the result
lands, not where they are built (``fabric`` is rarely in reach there).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.libraries import SHARDED_LOADER_FACTORIES
from accelerate_rewrite.codemod.analysis import kinds as F
from accelerate_rewrite.codemod.analysis.siblings import loader_attributes, loader_results, sibling_defines
from accelerate_rewrite.codemod.analysis.syntax import code, init_of

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts


def _returns(f: Facts, func: cst.FunctionDef) -> list[cst.Return]:
    """The function's own returns (not those of functions or classes defined in it), from the
    returns the analysis found (no walk of its own)."""
    return f.memo("returns-by-function", lambda: _by_function(f)).get(func, [])


def _by_function(f: Facts) -> dict[cst.FunctionDef, list[cst.Return]]:
    out: dict[cst.FunctionDef, list[cst.Return]] = {}
    for ret in f.returns:
        for parent in f.ancestors(ret):
            if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                if isinstance(parent, cst.FunctionDef):
                    out.setdefault(parent, []).append(ret)
                break
    return out


def _loader_positions(f: Facts, func: cst.FunctionDef) -> list[tuple[Optional[F.Key], ...]]:
    """For each length of what ``func`` returns (a helper may return a validation loader only
    when asked: two loaders or three): per element, the key of the loader built in it (or None
    for a DataLoader(...) returned directly, or for a non-loader); none for a length whose
    returns disagree or hold no loader."""
    shapes = []
    for ret in _returns(f, func):
        value = ret.value
        if value is None:
            return []
        elements = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
        shape = []
        for element in elements:
            if isinstance(element, cst.Call) and f.qualnames(element) & set(F.DATALOADERS):
                shape.append(("call", None))
            elif isinstance(element, cst.Name):
                key = f.key_of(element)
                inner = [b for b in f.bindings if b.kind == F.LOADER and b.key == key]
                shape.append(("name", key) if inner else (None, None))
            else:
                shape.append((None, None))
        shapes.append(shape)
    out = []
    for length in sorted({len(s) for s in shapes}):
        same = [s for s in shapes if len(s) == length]
        if any([k for k, _ in s] != [k for k, _ in same[0]] for s in same) or not any(k for k, _ in same[0]):
            continue
        out.append(tuple(key if kind == "name" else (() if kind == "call" else None) for kind, key in same[0]))
    return out


def _returned_names(f: Facts, func: cst.FunctionDef) -> Optional[list[Optional[cst.Name]]]:
    """Per element of what ``func`` returns, the name it returns there (None: not a name), when
    it has one return of a name or a tuple."""
    returns = _returns(f, func)
    if len(returns) != 1 or returns[0].value is None:
        return None
    value = returns[0].value
    elements = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
    return [e if isinstance(e, cst.Name) else None for e in elements]


def _alias_results(f: Facts, fn: "F.Function") -> None:
    """``dataset, model, optimizer = load_train_objs()``: the names the result is unpacked into
    hold what the helper's names held (the flow of kinds joins them)."""
    names = _returned_names(f, fn.node)
    if names is None or not any(names):
        return
    for call in fn.calls:
        elements = _unpacked_into(f, call)
        if elements is None or len(elements) != len(names):
            continue
        for element, name in zip(elements, names):
            key = f.key_of(element) if isinstance(element, (cst.Name, cst.Attribute)) else None
            if key is not None and name is not None:
                f._aliases.append((key, name))


def _unpacked_into(f: Facts, call: cst.Call) -> Optional[list[cst.BaseExpression]]:
    """What ``call``'s result is assigned to, element by element (``a, b = call()``: a, b;
    ``x = call()``: x), or None where it is not the value of a one-target assignment."""
    assign = f.parent(call)
    if not isinstance(assign, cst.Assign) or assign.value is not call or len(assign.targets) != 1:
        return None
    target = assign.targets[0].target
    return [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) else [target]


def find_returned_loaders(f: Facts) -> None:
    for fn in f.functions.values():
        if isinstance(fn.node, cst.ClassDef) and fn.calls:  # loaders its ``__init__`` builds into attributes
            attributes = _loader_attributes(f, fn.node)
            for call in fn.calls:
                _bind_attributes(f, call, attributes, f"{fn.name}()", fn.node)
        if not isinstance(fn.node, cst.FunctionDef) or not fn.calls:
            continue
        _alias_results(f, fn)
        for positions in _loader_positions(f, fn.node):
            for call in fn.calls:
                _bind_results(f, call, positions, f"{fn.name}()")
    if f.folder is None:
        return
    found: dict[tuple, Optional[tuple[bool, ...]]] = {}
    for site in f.calls:  # ``from utils import make_loaders``: a module next to the script
        module, _, name = site.qualname.rpartition(".")
        if not module or site.qualname.startswith(".") or "<" in site.qualname:
            continue
        literals = _literal_bools(site.call)
        if (site.qualname, literals) not in found:
            found[(site.qualname, literals)] = loader_results(f.folder, module, name, literals=literals)
        shape = found[(site.qualname, literals)]
        if shape is not None:
            _bind_results(f, site.call, tuple(() if is_loader else None for is_loader in shape),
                          f"{site.qualname}()")
        else:
            _bind_attributes(f, site.call, loader_attributes(f.folder, module, name), f"{site.qualname}()")


def _literal_bools(call: cst.Call) -> tuple:
    """The True/False literals a call passes: ((position or keyword, value), ...)."""
    out = []
    for index, arg in enumerate(call.args):
        if arg.star:
            break
        if m.matches(arg.value, m.Name("True") | m.Name("False")):
            out.append((arg.keyword.value if arg.keyword is not None else index, arg.value.value == "True"))
    return tuple(out)


def _loader_attributes(f: Facts, cls: cst.ClassDef) -> frozenset[str]:
    """The attributes a class of the project that holds data (no backward, no optimizer in it)
    binds, once, to a DataLoader in its ``__init__``."""
    init = init_of(cls)
    if init is None or any(cls in f.ancestors(site.call) for site in f.backward_sites) or any(
            cls in f.ancestors(b.stmt) for b in f.bindings if b.kind == F.OPTIMIZER):
        return frozenset()  # a Trainer: its loaders are set up where it holds them
    counts: dict[str, int] = {}
    for b in f.bindings:
        if b.key[0] is cls and b.key[1].startswith("self."):
            counts[b.key[1]] = counts.get(b.key[1], 0) + (1 if b.kind == F.LOADER and init in f.ancestors(b.stmt)
                                                          else 100)
    return frozenset(name[len("self."):] for name, n in counts.items() if n == 1)


def _bind_attributes(f: Facts, call: cst.Call, attributes: frozenset[str], label: str,
                     cls: Optional[cst.ClassDef] = None) -> None:
    """``dataset = Cifar(...)`` of a class of a module next to the script whose ``__init__``
    builds DataLoaders into attributes (``self.train``): ``dataset.train`` is a loader, bound
    where the object is (set up there: ``dataset.train = fabric.setup_dataloaders(...)``)."""
    assign = f.parent(call)
    if not attributes or not (isinstance(assign, cst.Assign) and assign.value is call and len(assign.targets) == 1
                              and isinstance(assign.targets[0].target, cst.Name)):
        return
    name = assign.targets[0].target
    key = f.key_of(name)
    if key is None or len(f.assignments(name)) != 1:
        return
    stmt = f.statement(call)
    for attribute in sorted(attributes):
        attr_key = (key[0], f"{name.value}.{attribute}")
        f.object_attributes[attr_key] = cls
        f.bindings.append(F.Binding(attr_key, F.LOADER, stmt, call, None, f"{label}.{attribute}"))


def _bind_results(f: Facts, call: cst.Call, positions, label: str) -> None:
    """The names ``call``'s result is unpacked into, at the positions that are loaders, become
    loaders bound there (``positions``: per element, the key of the loader built inside the
    helper, ``()`` for one built elsewhere, None for a non-loader)."""
    elements = _unpacked_into(f, call)
    if elements is None or len(elements) != len(positions):
        return
    stmt = f.statement(call)
    for element, inner in zip(elements, positions):
        if inner is None or not isinstance(element, (cst.Name, cst.Attribute)):
            continue
        key = f.key_of(element)
        if key is None:
            continue
        f.bindings.append(F.Binding(key, F.LOADER, stmt, call, None, label))
        if inner:
            f.returned_loaders.add(inner)


#: calls whose results a training loop may draw batches from that are surely not DataLoaders
#: (tqdm's progress bars wrap one: ``tbar = tqdm(self.train_loader)``)
_NOT_LOADERS = ("builtins.", "torchtext.", "torch.utils.data.Dataset", "numpy.", "itertools.", "tqdm.")


def assume_received_loaders(f: Facts) -> None:
    """A training loop's batches from the result of a call the analysis can't see into
    (``train_loader, test_loader = data_generator(root, batch_size)`` from a package, a loader
    handed in from another file): Fabric's guide sets loaders up where the script receives them,
    and ``setup_dataloaders`` raises a TypeError at start-up when handed anything but a DataLoader
    (a loud failure, never a silent one), so the name the result lands in is taken for a loader,
    bound there; ``f.assumed_loaders`` says which, for the note. Only where the loop trains (a
    backward in it, or a call of a function that runs one), and never for a call known not to
    build one (builtins, torchtext, numpy, a Dataset)."""

    from accelerate_rewrite.codemod.analysis.loops import batch_loop, data_source  # loops reads facts, made after this

    loaders = {b.key for b in f.bindings if b.kind == F.LOADER}
    find, *_ = f._joined()
    roots = {find(k) for k in loaders}
    sources: list[cst.BaseExpression] = []
    for site in f.backward_sites:
        # the innermost loop that doesn't count (``for epoch in trange(n)`` holds no batches)
        loop = batch_loop(f, site.call)
        source = data_source(f, loop.iter) if loop is not None else None
        if isinstance(source, (cst.Name, cst.Attribute)) and f.key_of(source) is not None:
            sources.append(source)
    by_root: dict = {}
    for target in f.find(m.AssignTarget()):
        assign = f.parent(target)
        if not isinstance(assign, cst.Assign) or not isinstance(assign.value, cst.Call):
            continue
        elements = [e.value for e in target.target.elements] if isinstance(target.target, (cst.Tuple, cst.List)) \
            else [target.target]
        for element in elements:
            key = f.key_of(element) if isinstance(element, (cst.Name, cst.Attribute)) else None
            if key is not None:
                by_root.setdefault(find(key), []).append((key, assign))
    done: set = set()
    for root, received in by_root.items():  # ``# accelerate-rewrite: loader`` (codemod/analysis/hints.py)
        for key, assign in received:
            stmt = f.statement(assign)
            if root not in roots and "loader" in f.hints(stmt):
                f.bindings.append(F.Binding(key, F.LOADER, stmt, assign.value, None, f"{code(assign.value.func)}()"))
                f.assumed_loaders.add(key)
                f.hinted.add(key)
                done.add(root)
    for source in sources:
        root = find(f.key_of(source))
        if root in roots or root in done:
            continue
        done.add(root)
        received = by_root.get(root, [])
        if len(received) > 1:  # pytorch-template's ``self.data_loader = inf_loop(data_loader)`` beside
            # ``self.data_loader = data_loader``: a value made of the loader itself is no other loader
            received = [(key, assign) for key, assign in received if not any(
                isinstance(a.value, (cst.Name, cst.Attribute)) and f.key_of(a.value) is not None
                and find(f.key_of(a.value)) == root for a in assign.value.args)]
        if len(received) != 1:
            continue
        key, assign = received[0]
        if _not_a_loader(f, assign.value, key, assign):
            continue
        f.bindings.append(F.Binding(key, F.LOADER, f.statement(assign), assign.value, None,
                                    f"{code(assign.value.func)}()"))
        f.assumed_loaders.add(key)


def _not_a_loader(f: Facts, call: cst.Call, key, assign: cst.Assign) -> bool:
    """What the call gives is known not to be a DataLoader: a builtin, torchtext's iterators, a
    class of the script's own, or a helper of the script whose result there is one of those."""
    names = f.qualnames(call.func) | f.qualnames(call)
    if any(n.startswith(_NOT_LOADERS) for n in names) or names & set(SHARDED_LOADER_FACTORIES):
        return True  # (timm's create_loader shards by itself, and may give a prefetcher: not set up)
    # a helper of a module next to the script, read far enough to see that it returns no loader
    if any(sibling_defines(f.folder, *n.rsplit(".", 1)) for n in names if "." in n and not n.startswith(".")):
        return True
    fn = f.functions.get(call.func.value) if isinstance(call.func, cst.Name) else None
    if fn is None:
        return False
    if isinstance(fn.node, cst.ClassDef):
        return True
    target = assign.targets[0].target
    index = next((i for i, e in enumerate(target.elements) if f.key_of(e.value) == key), None) \
        if isinstance(target, (cst.Tuple, cst.List)) else None
    for ret in _returns(f, fn.node):
        value = ret.value
        if index is not None and isinstance(value, (cst.Tuple, cst.List)) and index < len(value.elements):
            value = value.elements[index].value
        if isinstance(value, cst.Name):
            value = f.assigned_value(value)
        if not isinstance(value, cst.Call) or any(
                n.startswith(_NOT_LOADERS) for n in f.qualnames(value.func) | f.qualnames(value)):
            return True  # built there, and not by a call it can't see
    return False
