"""What a method or a helper of the script builds and returns, for the assignment of its result
(``self.model = self._build_model()``, nanoGPT's ``optimizer = model.configure_optimizers(...)``,
``optimizer = make_optimizer(model, lr)``), and the script's classes whose objects a name may
hold: codemod/analysis/collect.py's walk asks it (``Built``) where an assignment's value is a call."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.kinds import DATALOADERS, Function
from accelerate_rewrite.codemod.analysis.syntax import (code, init_of, param_for, positional_params, root_of,
                                                     unwrap_moves)

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts


def _arguments_read(fn: Function, call: cst.Call, returned: cst.BaseExpression):
    """The names passed at ``call`` for the helper's parameters whose ``.parameters()`` the
    returned value reads (``make_optimizer(model, lr)`` returning ``SGD(net.parameters(), ...)``:
    ``[model]``); None when it reads none of them (a model of the module, keyed as it is); False
    when one of them is passed as something else than a name, or can't be matched."""
    ps = fn.node.params  # type: ignore[union-attr]
    every = {p.name.value for p in [*ps.posonly_params, *ps.params, *ps.kwonly_params]}
    for star in (ps.star_arg, ps.star_kwarg):
        if isinstance(star, cst.Param):
            every.add(star.name.value)
    read = [root_of(c.func.value) for c in m.findall(  # type: ignore[union-attr]
        returned, m.Call(func=m.Attribute(attr=m.Name("parameters") | m.Name("named_parameters"))))]
    params = [r.value for r in read if isinstance(r, cst.Name) and r.value in every]
    if not params:
        return None
    passed: dict[str, cst.BaseExpression] = {}
    for i, arg in enumerate(call.args):
        param = param_for(fn.params, fn.node, arg, i)
        if param is None:
            return False
        passed[param.name.value] = arg.value
    over = [passed.get(p) for p in params]
    return over if all(isinstance(a, cst.Name) for a in over) else False


class Built:
    """Asked by the collecting walk, once the walk has found the script's functions and calls."""

    def __init__(self, facts: Facts) -> None:
        self.f = facts
        self._method_names: Optional[frozenset[str]] = None

    def by_method(self, value: cst.BaseExpression, node: cst.CSTNode):
        """What a method returns, when it builds it and is called only here: ``self.model =
        self._build_model()`` in a class whose ``_build_model`` returns ``Net().to(...)``, or
        ``optimizer = model.configure_optimizers(...)`` where ``model = GPT(...)`` is of a class of
        the script whose method builds the optimizer (``optimizer = torch.optim.AdamW(...)``;
        ``return optimizer``), or ``optimizer = make_optimizer(model, lr)`` where the helper returns
        ``torch.optim.SGD(net.parameters(), lr=lr)``. (the value returned, the assignment in the
        method that bound it or None, the models whose parameters it is over, read at the call:
        the receiver of a model's method, the arguments a helper's ``x.parameters()`` read, or
        None), or None."""
        f = self.f
        if isinstance(value, cst.Call) and isinstance(value.func, cst.Name):  # a helper of the module
            fn = f.functions.get(value.func.value)
            if fn is None or not isinstance(fn.node, cst.FunctionDef) or fn.calls != [value] or fn.other_uses:
                return None
            from accelerate_rewrite.codemod.analysis.returns import _returns

            returns = _returns(f, fn.node)
            # ``return torch.optim.SGD(...)``; a returned name is the flow's (returns._alias_results),
            # a returned DataLoader returns.py's (it binds a loader where the result lands)
            if len(returns) == 1 and isinstance(returns[0].value, cst.Call) \
                    and isinstance(unwrap_moves(returns[0].value), cst.Call) \
                    and not f.qualnames(unwrap_moves(returns[0].value)) & set(DATALOADERS):
                over = _arguments_read(fn, value, returns[0].value)
                return (returns[0].value, None, over) if over is not False else None
            return None
        if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Attribute)
                and isinstance(value.func.value, cst.Name)):
            return None
        receiver, name = value.func.value, value.func.attr.value
        func = f.function(node)
        if receiver.value == "self":
            cls = f.enclosing_class(func) if func is not None else None
            over = None
        else:  # ``model = GPT(...)``: an object of a class of the script (in each branch that builds it:
            # nanoGPT's `model = GPT(gptconf)` from scratch, on resume, from GPT-2 weights)
            if name not in self._methods():
                return None  # no class of the script has such a method (``images.cuda()``)
            classes = self.classes_of(receiver, value)
            cls = classes.pop() if len(classes) == 1 else None
            over = [receiver]
        if cls is None:
            return None
        method = next((s for s in cls.body.body if isinstance(s, cst.FunctionDef) and s.name.value == name), None)
        if method is None or method is func:
            return None
        from accelerate_rewrite.codemod.analysis.returns import _returns

        returns = _returns(f, method)
        if len(returns) != 1 or returns[0].value is None:
            return None
        returned, inner = returns[0].value, None
        if isinstance(returned, cst.Name):  # ``optimizer = ...; return optimizer``
            returned_name = returned
            returned = f.assigned_value(returned_name)
            if returned is None:
                return None
            inner = f.parent(returned)  # the Assign
            if not isinstance(inner, cst.Assign) or f.function(inner) is not method:
                return None
        if not isinstance(unwrap_moves(returned), cst.Call):
            return None
        calls = [c for _, c in f.attribute_calls_of(name)
                 if isinstance(c.func.value, cst.Name) and c.func.value.value == receiver.value
                 and (over is not None or (f.function(c) is not None and f.enclosing_class(f.function(c)) is cls))]
        return (returned, inner, over) if calls == [value] else None

    def _methods(self) -> frozenset[str]:
        """The names of the methods of the script's classes (``classes_of`` finds no other)."""
        if self._method_names is None:
            self._method_names = frozenset(s.name.value for fn in self.f.functions.values()
                                           if isinstance(fn.node, cst.ClassDef)
                                           for s in fn.node.body.body if isinstance(s, cst.FunctionDef))
        return self._method_names

    def classes_of(self, expr: cst.BaseExpression, before: cst.CSTNode, seen: frozenset = frozenset()) -> set:
        """The classes of the script whose objects ``expr`` may hold (None for anything else),
        followed through the name's assignments above ``before`` (``model = GPT(...)`` in each
        branch), ``a, b = self.model, self.config``, ``self.model = model`` in its class, and a
        parameter of ``__init__`` to the arguments where the class is made (minGPT's
        ``Trainer(config, model, dataset)``)."""
        f = self.f
        core = unwrap_moves(expr)
        if isinstance(core, cst.Call):
            fn = f.functions.get(core.func.value) if isinstance(core.func, cst.Name) else None
            if fn is None and isinstance(core.func, cst.Attribute) and isinstance(core.func.value, cst.Name):
                fn = f.functions.get(core.func.value.value)  # ``GPT.from_pretrained(...)``
            return {fn.node if fn is not None and isinstance(fn.node, cst.ClassDef) else None}
        text = code(core)
        func = f.function(core)
        if (id(func), text) in seen or len(seen) > 8:
            return set()
        seen = seen | {(id(func), text)}
        if isinstance(core, cst.Name):
            bound = f.assignments(core)
            values = [v for t, v in bound if v is not None and not (isinstance(t, cst.CSTNode)
                                                                    and f.line(t) >= f.line(before))]
            if values and len(values) == len([t for t, _ in bound if not (isinstance(t, cst.CSTNode)
                                                                          and f.line(t) >= f.line(before))]):
                return set().union(*(self.classes_of(v, v, seen) for v in values))
            cls = f.enclosing_class(func) if func is not None else None
            param = next((p for p in positional_params(func) if p.name.value == core.value), None) \
                if func is not None and not values else None
            made = f.functions.get(cls.name.value) if cls is not None and func is init_of(cls) else None
            if param is not None and made is not None and made.node is cls and made.calls:
                index = positional_params(func).index(param) - 1  # without self
                out: set = set()
                for call in made.calls:
                    arg = next((a.value for a in call.args if a.keyword is not None
                                and a.keyword.value == core.value), None)
                    if arg is None and index < len(call.args) and call.args[index].keyword is None:
                        arg = call.args[index].value
                    out |= self.classes_of(arg, arg, seen) if arg is not None else {None}
                return out
            return {None}
        if m.matches(core, m.Attribute(value=m.Name("self"))):
            cls = f.enclosing_class(func) if func is not None else None
            if cls is None:
                return {None}
            out = set()
            for assign in m.findall(cls, m.Assign(targets=[m.AssignTarget(m.Attribute(
                    value=m.Name("self"), attr=m.Name(core.attr.value)))])):
                out |= self.classes_of(assign.value, assign.value, seen)
            return out or {None}
        return {None}
