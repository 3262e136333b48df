"""Objects that a function of the script builds and returns: ``train_loader, val_loader =
make_loaders(args)`` binds two DataLoaders, although no ``DataLoader(...)`` stands there.

Run once by ScriptFacts, after the collector and before the flow of kinds, so that the names a
helper's result is unpacked into are loaders everywhere they go (into ``train(model, loader)``).
The loaders built inside the helper are kept in ``returned``: they are set up where the result
lands, not where they are built (``fabric`` is rarely in reach there).
"""

from __future__ import annotations

from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod import facts as F
from accelerate_rewrite.codemod.siblings import loader_results


def _returns(f: "F.ScriptFacts", func: cst.FunctionDef) -> list[cst.Return]:
    """The function's own returns (not those of functions or classes defined in it), from the
    returns the analysis found (no walk of its own)."""
    return f.memo("returns-by-function", lambda: _by_function(f)).get(func, [])


def _by_function(f: "F.ScriptFacts") -> dict[cst.FunctionDef, list[cst.Return]]:
    out: dict[cst.FunctionDef, list[cst.Return]] = {}
    for ret in f.returns:
        for parent in f.ancestors(ret):
            if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                if isinstance(parent, cst.FunctionDef):
                    out.setdefault(parent, []).append(ret)
                break
    return out


def _loader_positions(f: "F.ScriptFacts", func: cst.FunctionDef) -> Optional[tuple[Optional[F.Key], ...]]:
    """For each element of what ``func`` returns: the key of the loader built in it (or None
    for a DataLoader(...) returned directly, or for a non-loader); None when no element is a
    loader or the returns disagree."""
    shapes = []
    for ret in _returns(f, func):
        value = ret.value
        if value is None:
            return None
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
    if not shapes or any(len(s) != len(shapes[0]) or [k for k, _ in s] != [k for k, _ in shapes[0]]
                         for s in shapes):
        return None
    if not any(kind for kind, _ in shapes[0]):
        return None
    return tuple(key if kind == "name" else (() if kind == "call" else None) for kind, key in shapes[0])


def _returned_names(f: "F.ScriptFacts", func: cst.FunctionDef) -> Optional[list[Optional[cst.Name]]]:
    """Per element of what ``func`` returns, the name it returns there (None: not a name), when
    it has one return of a name or a tuple."""
    returns = _returns(f, func)
    if len(returns) != 1 or returns[0].value is None:
        return None
    value = returns[0].value
    elements = [e.value for e in value.elements] if isinstance(value, cst.Tuple) else [value]
    return [e if isinstance(e, cst.Name) else None for e in elements]


def _alias_results(f: "F.ScriptFacts", fn: "F.Function") -> None:
    """``dataset, model, optimizer = load_train_objs()``: the names the result is unpacked into
    hold what the helper's names held (the flow of kinds joins them)."""
    names = _returned_names(f, fn.node)
    if names is None or not any(names):
        return
    for call in fn.calls:
        assign = f.parent(call)
        if not isinstance(assign, cst.Assign) or assign.value is not call or len(assign.targets) != 1:
            continue
        target = assign.targets[0].target
        elements = [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) \
            else [target]
        if len(elements) != len(names):
            continue
        for element, name in zip(elements, names):
            key = f.key_of(element) if isinstance(element, (cst.Name, cst.Attribute)) else None
            if key is not None and name is not None:
                f._aliases.append((key, name))


def find_returned_loaders(f: "F.ScriptFacts") -> None:
    for fn in f.functions.values():
        if not isinstance(fn.node, cst.FunctionDef) or not fn.calls:
            continue
        _alias_results(f, fn)
        positions = _loader_positions(f, fn.node)
        if positions is None:
            continue
        for call in fn.calls:
            _bind_results(f, call, positions, f"{fn.name}()")
    if f.folder is None:
        return
    found: dict[str, Optional[tuple[bool, ...]]] = {}
    for site in f.calls:  # ``from utils import make_loaders``: a module next to the script
        module, _, name = site.qualname.rpartition(".")
        if not module or site.qualname.startswith(".") or "<" in site.qualname:
            continue
        if site.qualname not in found:
            found[site.qualname] = loader_results(f.folder, module, name)
        shape = found[site.qualname]
        if shape is not None:
            _bind_results(f, site.call, tuple(() if is_loader else None for is_loader in shape),
                          f"{site.qualname}()")


def _bind_results(f: "F.ScriptFacts", call: cst.Call, positions, label: str) -> None:
    """The names ``call``'s result is unpacked into, at the positions that are loaders, become
    loaders bound there (``positions``: per element, the key of the loader built inside the
    helper, ``()`` for one built elsewhere, None for a non-loader)."""
    assign = f.parent(call)
    if not isinstance(assign, cst.Assign) or assign.value is not call or len(assign.targets) != 1:
        return
    target = assign.targets[0].target
    elements = [e.value for e in target.elements] if isinstance(target, (cst.Tuple, cst.List)) \
        else [target]
    if len(elements) != len(positions):
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
