"""A call's arguments as Python passes them: the keywords of ``**options`` where ``options`` is a
dict the script builds once, as a literal (``amp_args = dict(opt_level="O1")``, ``{"opt_level":
"O1"}``) and never changes; the positions ``*args`` hides. Where a ``**`` can't be read, the
answer says so (None), so that a refusal names that, and not something else."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import libcst as cst
import libcst.matchers as m

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts

#: methods that change a dict in place: a ``**`` of a dict the script changes is not read
_CHANGES = ("update", "setdefault", "pop", "popitem", "clear", "__setitem__")


def positional(call: cst.Call) -> list[cst.BaseExpression]:
    """The values passed by position, before any ``*args`` (after one, positions are unknown)."""
    out = []
    for arg in call.args:
        if arg.star:
            break
        if arg.keyword is None:
            out.append(arg.value)
    return out


def keywords(f: "Facts", call: cst.Call) -> Optional[dict[str, cst.BaseExpression]]:
    """Every keyword ``call`` passes, those of its ``**`` dicts included; None when a ``**``
    is of a dict the analysis can't read."""
    out: dict[str, cst.BaseExpression] = {}
    for arg in call.args:
        if arg.star == "**":
            entries = _entries(f, arg.value)
            if entries is None:
                return None
            out.update(entries)
        elif arg.keyword is not None:
            out[arg.keyword.value] = arg.value
    return out


def _entries(f: "Facts", value: cst.BaseExpression) -> Optional[dict[str, cst.BaseExpression]]:
    if isinstance(value, cst.Name):
        if _changed(f, value):
            return None
        value = f.assigned_value(value)
    if isinstance(value, cst.Dict):
        out = {}
        for element in value.elements:
            if not isinstance(element, cst.DictElement) or not isinstance(element.key, cst.SimpleString):
                return None
            out[element.key.evaluated_value] = element.value
        return out
    if m.matches(value, m.Call(func=m.Name("dict"))) and all(a.keyword is not None and not a.star
                                                               for a in value.args):
        return {a.keyword.value: a.value for a in value.args}
    return None


def _changed(f: "Facts", name: cst.Name) -> bool:
    """``name`` is changed in place somewhere in its scope (``name["k"] = v``, ``name.update(...)``)."""
    key = f.key_of(name)
    if key is None:
        return True
    for ref in f.find(m.Name(name.value)):
        if f.key_of(ref) != key:
            continue
        parent = f.parent(ref)
        if isinstance(parent, cst.Subscript) and parent.value is ref:
            target = f.parent(parent)
            if isinstance(target, (cst.AssignTarget, cst.Del)) or (
                    isinstance(target, cst.AugAssign) and target.target is parent):
                return True
        if isinstance(parent, cst.Attribute) and parent.value is ref and parent.attr.value in _CHANGES:
            return True
    return False
