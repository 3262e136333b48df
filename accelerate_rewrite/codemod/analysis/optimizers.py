"""Which objects a script builds are optimizers, and over which models' parameters: a mixin of
the collector (codemod/analysis/collect.py). The reader's rule: an object built from some models'
parameters (directly, through comprehensions, ``filter``, ``chain``, ``+``, groups, appends, a
helper given the model) that the script steps is those models' optimizer, whatever its class."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.kinds import MODULE, OPTIMIZER, Key, Optimizer
from accelerate_rewrite.codemod.analysis.libraries import PARAM_GROUPS
from accelerate_rewrite.codemod.analysis.returns import _returned_names
from accelerate_rewrite.codemod.analysis.syntax import callee_text, init_of, param_for, passed_at, root_of

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts


class OptimizerSearch:
    """The collector's part that finds optimizers (``self.f``: the facts being collected;
    ``self._unknown``: objects of classes the analysis can't see, bound by the walk)."""

    f: Facts

    def _stepped_unknowns(self) -> None:
        """The reader's rule: an object built from some models' parameters (directly, through
        comprehensions, ``filter``, ``chain``, ``+``, groups, or a call given the model) whose
        ``.step()`` the script calls, directly or through a method of its own
        (``step_and_update_lr``), is those models' optimizer, whatever its class:
        ``getattr(optim, args.optim)(model.parameters(), lr=lr)``, transformers' ``AdamW``,
        ``SAM(...)`` or ``create_optimizer(args, model)`` from a package. One that wraps an
        optimizer built in its arguments (``ScheduledOptim(optim.Adam(...), ...)``) is set up
        through the attribute that holds it, when its class is the script's own."""
        f = self.f
        if not self._unknown:
            return
        find, *_ = f._joined()  # the flows so far: ``train(model, optimizer)`` steps main's optimizer
        stepped = set()
        for call in f.attribute_calls:
            method = call.func.attr.value
            key = f.key_of(call.func.value)
            if "step" in method and method != "step_size" and key is not None:
                stepped.add(find(key))
        optimizers = {find(b.key) for b in f.bindings if isinstance(b, Optimizer)}
        for key, stmt, value, core in self._unknown:
            given = [f.key_of(a.value) for a in core.args]
            if find(key) not in stepped or any(k is not None and find(k) in optimizers for k in given) \
                    or self._returned_optimizer(given):
                continue  # a scheduler, or a wrapper around an optimizer the script names (or a helper returns)
            inner_call = next((c for c in m.findall(core, m.Call()) if c is not core and self._torch_optimizer(c)),
                              None)
            if inner_call is not None:
                attr = self._holding_attribute(core, inner_call)
                if attr is None:
                    f.opaque_optimizers.append((stmt, core, inner_call))
                    continue
                f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, callee_text(core),
                                            models=self._param_models(inner_call), inner=attr))
                continue
            models = self._param_models(core) or self._models_given(core) \
                or self._params_anywhere(core, lambda k: find(k) in stepped)
            if models:
                f.bindings.append(Optimizer(key, OPTIMIZER, stmt, value, core, callee_text(core),
                                            models=models, custom=True))

    def _torch_optimizer(self, call: cst.Call) -> bool:
        qual = self.f.qualname(call) or ""
        return qual.startswith("torch.optim.") and not qual.startswith(("torch.optim.lr_scheduler.",
                                                                        "torch.optim.swa_utils.")) \
            and qual.rsplit(".", 1)[-1][:1].isupper()

    def _holding_attribute(self, wrapper: cst.Call, inner: cst.Call) -> Optional[str]:
        """``ScheduledOptim(optim.Adam(...), ...)`` with ``class ScheduledOptim: def __init__(self,
        optimizer, ...): self._optimizer = optimizer``: "_optimizer"."""
        f = self.f
        fn = f.functions.get(wrapper.func.value) if isinstance(wrapper.func, cst.Name) else None
        init = init_of(fn.node) if fn is not None and isinstance(fn.node, cst.ClassDef) else None
        arg = next((a for a in wrapper.args if a.value is inner), None)
        if init is None or arg is None:
            return None
        param = param_for(fn.params, fn.node, arg, wrapper.args.index(arg))
        if param is None:
            return None
        for assign in m.findall(init.body, m.Assign(targets=[m.AssignTarget(m.Attribute(value=m.Name("self")))],
                                                    value=m.Name(param.name.value))):
            return assign.targets[0].target.attr.value
        return None

    def _models_given(self, call: cst.Call) -> list[Key]:
        """``create_optimizer(args, model)``: the arguments that are modules built before."""
        f = self.f
        modules = {b.key for b in f.bindings if b.kind == MODULE}
        keys = [f.key_of(a.value) for a in call.args if isinstance(a.value, (cst.Name, cst.Attribute))]
        return [k for k in keys if k is not None and k in modules]

    def _is_optimizer_class(self, call: cst.Call) -> bool:
        """``SAM(model.parameters(), ...)``: a class of the script (or of a module of its project,
        codemod/project/program.py) deriving from torch.optim.Optimizer."""
        if not isinstance(call.func, cst.Name):
            return False
        fn = self.f.functions.get(call.func.value)
        if fn is None or not isinstance(fn.node, cst.ClassDef):
            return False
        return any(self.f.qualname(base.value) in ("torch.optim.Optimizer", "torch.optim.optimizer.Optimizer")
                   for base in fn.node.bases)

    def _returned_optimizer(self, keys: list[Optional[Key]]) -> bool:
        """One of ``keys`` holds what a helper of the script returns, which is an optimizer it
        builds (``optim = set_optimizer(net)``; ``return optim``): the flow joins the two names
        only after this search (codemod/analysis/returns.py)."""
        f = self.f
        wanted = {k for k in keys if k is not None}
        raw = {b.key for b in f.bindings if isinstance(b, Optimizer)}
        if not wanted:
            return False
        for target, value, _node in self._pending:
            if not (isinstance(value, cst.Call) and isinstance(value.func, cst.Name)
                    and isinstance(target, cst.Name) and f.key_of(target) in wanted):
                continue
            fn = f.functions.get(value.func.value)
            if fn is None or not isinstance(fn.node, cst.FunctionDef):
                continue
            names = _returned_names(f, fn.node) or []
            if len(names) == 1 and names[0] is not None and (fn.node, names[0].value) in raw:
                return True
        return False

    def _params_anywhere(self, call: cst.Call, stepped) -> list[Key]:
        """A factory the analysis can't see that takes the parameters at another place
        (pytorch-template's ``config.init_obj('optimizer', torch.optim, trainable_params)``,
        with ``trainable_params = filter(lambda p: p.requires_grad, model.parameters())``):
        the models whose parameters one of its arguments is made of. An argument that holds
        an object the script steps (``config.init_obj('lr_scheduler', ..., optimizer)``) is an
        optimizer, not parameters: that call builds its scheduler."""
        for arg in call.args[1:]:
            if arg.keyword is None and not arg.star and not any(
                    (lambda k: k is not None and stepped(k))(self.f.key_of(n))
                    for n in self.f.find_in(arg.value, m.Name())):
                keys = self._param_models(cst.Call(func=call.func, args=[cst.Arg(arg.value)]))
                if keys:
                    return keys
        return []

    def _param_models(self, call: cst.Call) -> list[Key]:
        keys: list[Key] = []
        params = call.args[0].value if call.args and call.args[0].keyword is None else None
        for arg in call.args:
            if arg.keyword is not None and arg.keyword.value == "params":
                params = arg.value
        if params is None:
            return keys
        optimizers = self._optimizer_keys()
        # the names it is made of, followed to their values: ``groups = [{"params": [p for n, p in
        # param_optimizer if ...]}, ...]`` with ``param_optimizer = list(model.named_parameters())``
        todo, seen = [params], set()
        while todo and len(seen) < 32:
            expr = todo.pop(0)
            if id(expr) in seen:
                continue
            seen.add(id(expr))
            for found in self.f.find_in(
                expr, m.Call(func=m.Attribute(attr=m.Name("parameters") | m.Name("named_parameters")))
            ):
                for root in self._over_items(root_of(found.func.value)):  # type: ignore[union-attr]
                    key = self.f.key_of(root)
                    if key is not None and key not in keys:
                        keys.append(key)
            for key in self._given_to_helpers(expr):  # ``set_weight_decay(model, skip)``
                if key not in keys:
                    keys.append(key)
            for key in self._model_methods(expr):  # ``model.get_1x_lr_params()``
                if key not in keys:
                    keys.append(key)
            names = [expr] if isinstance(expr, cst.Name) else self.f.find_in(expr, m.Name())
            for name in names:
                if self.f.key_of(name) in optimizers:
                    continue  # a scheduler over an optimizer is not over its parameters
                todo.extend(self._sources(name))
        return keys

    def _model_methods(self, expr: cst.BaseExpression) -> list[Key]:
        """The models whose own methods give the parameters (pytorch-deeplab-xception's
        ``{'params': model.get_1x_lr_params(), 'lr': args.lr}``): what an optimizer takes as
        parameters, from a method of a model, are that model's."""
        f = self.f
        modules = {b.key for b in f.bindings if b.kind == MODULE}
        keys = []
        for call in f.find_in(expr, m.Call(func=m.Attribute(value=m.Name() | m.Attribute()))):
            key = f.key_of(call.func.value)  # type: ignore[union-attr]
            if key is not None and key in modules and key not in keys:
                keys.append(key)
        return keys

    def _over_items(self, root: cst.BaseExpression) -> list[cst.BaseExpression]:
        """``module`` of ``for module in modules_ori: groups.append(dict(params=module.parameters()))``
        with ``modules_ori = [model.layer0, model.layer1]`` (semseg's): the roots of the items the
        loop goes over (``model``), not the loop variable; else ``[root]``."""
        f = self.f
        if not isinstance(root, cst.Name):
            return [root]
        bound = f.assignments(root)
        loops = [f.parent(node) for node, _ in bound]
        if not bound or not all(isinstance(loop, cst.For) and loop.target is node
                                for loop, (node, _) in zip(loops, bound)):
            return [root]  # (each binding the target of a loop, the two of semseg's included)
        out: list[cst.BaseExpression] = []
        for loop in loops:
            items = loop.iter
            values = [v for _, v in f.assignments(items)] if isinstance(items, cst.Name) else [items]
            for value in values:
                if not isinstance(value, (cst.List, cst.Tuple)) or not value.elements:
                    return [root]
                out += [root_of(e.value) for e in value.elements if isinstance(e, cst.Element)]
        return out or [root]

    def _optimizer_keys(self) -> set[Key]:
        """The keys of the optimizers bound so far (the walk appends to ``bindings`` while it
        asks: a set kept up with the list, not made anew for each optimizer of a long script)."""
        bindings = self.f.bindings
        known = getattr(self, "_optimizers_seen", None)
        if known is None or known[0] is not bindings or known[1] > len(bindings):
            known = (bindings, 0, set())
        keys = known[2]
        keys.update(b.key for b in bindings[known[1]:] if isinstance(b, Optimizer))
        self._optimizers_seen = (bindings, len(bindings), keys)
        return keys

    def _given_to_helpers(self, expr: cst.BaseExpression) -> list[Key]:
        """The models passed to a helper of the script that reads their parameters
        (``set_weight_decay(model, ...)`` whose body loops over ``model.named_parameters()``):
        the keys of the arguments, as the call passes them."""
        f = self.f
        out: list[Key] = []
        for call in f.find_in(expr, m.Call()):  # a library's, known as data (codemod/analysis/libraries.py)
            known = next((PARAM_GROUPS[n] for n in f.qualnames(call) if n in PARAM_GROUPS), None)
            given = passed_at(call, known.model.index, known.model.keyword) if known is not None else None
            key = f.key_of(given) if isinstance(given, (cst.Name, cst.Attribute)) else None
            if key is not None and key not in out:
                out.append(key)
        for call in f.find_in(expr, m.Call(func=m.Name())):
            fn = f.functions.get(call.func.value)
            if fn is None or not isinstance(fn.node, cst.FunctionDef):
                continue
            # (deeplab's ``get_params(model.module, key)``: ``for m in model.named_modules(): ...
            # for p in m[1].parameters(): yield p``)
            read = {root_of(c.func.value).value for c in f.find_in(fn.node.body, m.Call(
                func=m.Attribute(attr=m.Name("parameters") | m.Name("named_parameters") | m.Name("modules")
                                 | m.Name("named_modules") | m.Name("children") | m.Name("named_children"))))
                if isinstance(root_of(c.func.value), cst.Name)}
            for index, arg in enumerate(call.args):
                param = param_for(fn.params, fn.node, arg, index)
                value = arg.value
                while m.matches(value, m.Attribute(attr=m.Name("module"))):  # DataParallel's module
                    value = value.value  # type: ignore[attr-defined]
                if param is not None and param.name.value in read and isinstance(value, (cst.Name, cst.Attribute)):
                    key = f.key_of(value)
                    if key is not None:
                        out.append(key)
        return out

    def _sources(self, name: cst.Name) -> list[cst.BaseExpression]:
        """What a name's value is made of: its assignments' values, what is appended to it
        (``param_weights.append(param)``), and for a loop variable the loop's iterable (``for
        param in model.parameters():``)."""
        f = self.f
        bound = f.assignments(name)
        out: list[cst.BaseExpression] = [value for _, value in bound if value is not None]  # each branch's
        key = f.key_of(name)
        if key is None:
            return out
        grown = sorted(f.attribute_calls_of("append") + f.attribute_calls_of("extend"), key=lambda pair: pair[0])
        for _, call in grown:
            if call.args and isinstance(call.func.value, cst.Name) and f.key_of(call.func.value) == key:
                out.append(call.args[0].value)
        # ``params += [{"params": [value], "lr": lr}]`` (maskrcnn-benchmark's make_optimizer)
        out += f.memo("augmented-names", lambda: _augmented(f)).get(key, [])
        for target, value in bound:
            for parent in (f.ancestors(target) if value is None and isinstance(target, cst.CSTNode) else ()):
                if isinstance(parent, (cst.For, cst.CompFor)):
                    if any(t is target for t in f.find_in(parent.target, m.Name())):
                        out.append(parent.iter)
                    break
                if isinstance(parent, cst.BaseStatement):
                    break
        return out


def _augmented(f: "Facts") -> dict[Key, list[cst.BaseExpression]]:
    """The values added to each name by ``name += value``, by the name's key."""
    out: dict[Key, list[cst.BaseExpression]] = {}
    for node in f.find(m.AugAssign(target=m.Name())):
        key = f.key_of(node.target)
        if key is not None:
            out.setdefault(key, []).append(node.value)
    return out
