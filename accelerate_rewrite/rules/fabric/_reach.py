"""Where `fabric` can be reached: the functions a `device` parameter threads it into, the
classes that keep it in `self.fabric`, the functions and classes that receive it as a new
parameter, and those that run before it exists (a mixin of the Fabric planner)."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import (
    DEVICE,
    code,
    init_of,
    param_for,
    positional_params,
)
from accelerate_rewrite.codemod.analysis.libraries import TERMINAL_WRITES, prepares
from accelerate_rewrite.rules.base.plan import NAME, names_rank, rank_guard


class Reach:
    """The planner's part that decides where `fabric` is reached (``self.f``: the facts,
    ``self.p``: the plan being made)."""

    def _stuck_threads(self) -> set[int]:
        """Functions (or classes) threaded into `fabric` whose device is still read as it was."""
        f, p = self.f, self.p
        stuck: set[int] = set()
        for node, _ in p.device_keeps:
            key = f.key_of(node)
            if key is None:
                continue
            owner = key[0]
            if isinstance(owner, cst.ClassDef) and id(owner) in p.threaded_attrs:
                stuck.add(id(init_of(owner)))
            elif id(owner) in p.threaded_params:
                stuck.add(id(owner))
        return stuck

    # -- where `fabric` can be reached --
    def _refs(self) -> None:
        f, p = self.f, self.p
        p.refs[id(p.home)] = NAME
        at_top = isinstance(p.home, cst.Module)
        if at_top:
            # a global: every function of this file that runs after its creation sees it;
            # another file of the project receives it. A function that took the device still
            # takes `fabric` in its place (below): no parameter is left that nothing reads, and
            # the function keeps working when another module imports it
            self._block_early_functions()
        changed = True
        while changed:
            changed = False
            for fn in f.functions.values():
                target = fn.node
                func = target if isinstance(target, cst.FunctionDef) else init_of(target)
                if func is None or id(func) in p.threaded_params or fn.other_uses or not fn.calls \
                        or id(func) in self.excluded or id(func) in p.blocked or id(target) in p.blocked:
                    continue
                param = self._device_param(func, fn)
                if param is None:
                    continue
                if not all(p.ref_at(f, call) and p.after_creation(f, call)
                           and self._passes_device(target, call, param) for call in fn.calls):
                    continue
                p.threaded_params[id(func)] = param
                p.refs[id(func)] = NAME
                changed = True
                if isinstance(target, cst.ClassDef):
                    attr = self._device_attr(target, param)
                    if attr is not None:
                        p.threaded_attrs[id(target)] = attr
                        for stmt_ in target.body.body:
                            if isinstance(stmt_, cst.FunctionDef) and stmt_ is not func:
                                p.refs[id(stmt_)] = f"self.{NAME}"
        self._new_params(setups=not at_top)

    def _block_early_functions(self) -> None:
        """With Fabric created at module level, a function called (or handed on) before the
        Fabric lines would meet no ``fabric`` yet: block it, and what it calls."""
        f, p = self.f, self.p
        safe: dict[str, bool] = {}

        def is_safe(name: str, seen: frozenset = frozenset()) -> bool:
            if name in safe:
                return safe[name]
            if name in seen:
                return True
            fn = f.functions[name]
            ok = True
            others = self._other_uses(fn) if isinstance(fn.node, cst.ClassDef) else fn.other_uses
            for use in [*fn.calls, *others]:
                outer = [a for a in f.ancestors(use) if isinstance(a, (cst.FunctionDef, cst.ClassDef))]
                if not outer:
                    ok = ok and f.line(use) >= f.line(p.anchor)
                else:
                    top = outer[-1].name.value
                    ok = ok and (top == name or top not in f.functions or is_safe(top, seen | {name}))
            safe[name] = ok
            return ok

        for name, fn in f.functions.items():
            if not is_safe(name):
                p.blocked.add(id(fn.node))
                if isinstance(fn.node, cst.ClassDef):
                    p.blocked.update(id(s) for s in fn.node.body.body if isinstance(s, cst.FunctionDef))

    def _device_param(self, func: cst.FunctionDef, fn) -> Optional[cst.Param]:
        f = self.f
        for param in [*func.params.params, *func.params.kwonly_params]:
            if DEVICE in f.kinds.get((func, param.name.value), set()) and param.default is None:
                if any(p.name.value == NAME for p in func.params.params):
                    return None
                return param
        return None

    def _passes_device(self, target, call: cst.CSTNode, param: cst.Param) -> bool:
        """``call`` passes ``param`` a name that holds the device (which becomes `fabric` there),
        not a literal or another expression (``probe(model, "cpu")``: that one call would hand
        a string to a function that now reads ``fabric.device``)."""
        f = self.f
        if not isinstance(call, cst.Call):
            return False
        params = positional_params(target)
        for index, arg in enumerate(call.args):
            if arg.star:
                return False
            if param_for(params, target, arg, index) is param:
                key = f.key_of(arg.value) if isinstance(arg.value, (cst.Name, cst.Attribute)) else None
                return key is not None and DEVICE in f.kinds.get(key, set())
        return False

    def _device_attr(self, cls: cst.ClassDef, param: cst.Param) -> Optional[str]:
        init = init_of(cls)
        for node in self.f.find_in(init, m.Assign(targets=[m.AssignTarget(m.Attribute(m.Name("self")))],
                                             value=m.Name(param.name.value))):
            return code(node.targets[0].target)
        return None

    def _new_params(self, setups: bool = True) -> None:
        """Functions and classes of the script that need `fabric` where it can't be reached (a
        backward in a Trainer's method, a read of the process's place in ``setup()``), and are
        called only where it can: a function receives it as a new first parameter, a class as
        a new first parameter of ``__init__``, kept in ``self.fabric`` for its methods. With
        Fabric a global (``setups=False``), this is for the project's other files, whose
        optimizers are set up where the driver receives them."""
        f, p = self.f, self.p
        backwards = [s.call for s in f.backward_sites if s.library is None]
        needs = backwards + [o.stmt for o in f.optimizers if setups and not _handed_back(f, o)] \
            + ([n for n, _ in p.ddp.reads] if p.ddp else []) + (self._side_effects() if self.o.many_devices else [])
        # a print's function and a backward's need `fabric` however deep they are: their
        # callers that can't reach it need it in turn (``validate`` builds the ProgressMeter that
        # prints; open_clip's ``backward(total_loss, scaler)`` is called by
        # ``train_one_epoch``); the other needs stay where they are (a read of the rank works
        # without `fabric`)
        passed_on = self._prints() if self.o.many_devices else []
        needs += passed_on
        passed_on = passed_on + backwards
        passing = {id(n) for n in passed_on}
        changed = True
        while changed:
            changed = False
            for node in needs:
                func = f.function(node)
                if func is None or p.ref_at(f, node) is not None:
                    continue
                # a function nested in another (MSN's ``def train_step():`` in ``main``, timm's
                # ``_backward``): the outermost one receives `fabric`, and the closure sees it
                outer = [a for a in f.ancestors(func) if isinstance(a, cst.FunctionDef)]
                if outer and f.enclosing_class(outer[-1]) is None:
                    func = outer[-1]
                cls = f.enclosing_class(func)
                target = cls if cls is not None else func
                fn = f.functions.get(target.name.value)
                others = (self._other_uses(fn) if isinstance(fn.node, cst.ClassDef) else fn.other_uses) \
                    if fn is not None else []
                if id(target) in p.added_params or fn is None or fn.node is not target or others \
                        or not fn.calls or any(id(a) in p.blocked for a in (target, func)):
                    continue
                init = init_of(cls) if cls is not None else func
                if init is None or id(init) in p.threaded_params \
                        or any(x.name.value == NAME for x in positional_params(init)):
                    continue
                if cls is not None and (f.find_in(cls, m.Attribute(value=m.Name("self"), attr=m.Name(NAME)))
                                        or not self._plain_methods(cls, needs)):
                    continue
                if not all(p.ref_at(f, c) is not None and p.after_creation(f, c) for c in fn.calls):
                    for c in fn.calls if id(node) in passing else ():
                        if p.ref_at(f, c) is None and f.function(c) is not None and id(c) not in passing:
                            needs.append(c)
                            passing.add(id(c))
                            changed = True
                    continue
                p.added_params[id(target)] = target
                p.refs[id(init)] = NAME
                if cls is not None:
                    for method in cls.body.body:
                        if isinstance(method, cst.FunctionDef) and method is not init and _plain(method):
                            p.refs[id(method)] = f"self.{NAME}"
                changed = True

    def _side_effects(self) -> list[cst.CSTNode]:
        """The calls of the script's functions that write to the terminal or prepare data on disk
        (a project helper's progress bar, ``sys.stdout.write``; a download), where such a
        function can't reach `fabric` itself: the functions that call them receive it, so that
        rules/fabric/rank_zero.py can run those calls on rank 0."""
        f = self.f
        out: list[cst.CSTNode] = []
        for call in [*(s.call for s in f.calls), *f.attribute_calls]:
            if not (f.qualnames(call) & TERMINAL_WRITES or prepares(f, call)):
                continue
            func = f.function(call)
            fn = f.functions.get(func.name.value) if isinstance(func, cst.FunctionDef) else None
            if fn is not None and fn.node is func and f.enclosing_class(func) is None and not fn.other_uses:
                out += fn.calls
        return out

    def _prints(self) -> list[cst.CSTNode]:
        """With several devices, the script's prints that would run on every process: not under a
        test of the rank, not naming it (a print of its own per process, as before). The
        function or class that holds one (the ImageNet example's ``validate``, its
        ``ProgressMeter.display``) receives `fabric` where every call of it can give it, so that
        rules/fabric/printing.py prints on rank 0."""
        f, p = self.f, self.p
        return [call for call in f.prints if rank_guard(f, call) is None and names_rank(f, p, call) is None
                and f.model_class_of(call) is None]  # a model keeps no `fabric`: it is saved and copied

    def _plain_methods(self, cls: cst.ClassDef, needs: list[cst.CSTNode]) -> bool:
        """Every method that needs `fabric` takes ``self`` first: a static or class method
        would not see ``self.fabric`` (minGPT's ``@staticmethod get_default_config()``, which
        needs none, is no matter)."""
        f = self.f
        for method in cls.body.body:
            if isinstance(method, cst.FunctionDef) and not _plain(method) \
                    and any(method in f.ancestors(node) for node in needs):
                return False
        return True


def _plain(method: cst.FunctionDef) -> bool:
    """A method that takes ``self`` first, with no decorator (not static, not a class method)."""
    params = positional_params(method)
    return not method.decorators and bool(params) and params[0].name.value == "self"


def _handed_back(f, opt) -> bool:
    """Whether the function that builds the optimizer returns it (minGPT's ``create_optimizer``:
    ``optimizer = torch.optim.AdamW(...)``, ``return optimizer``): it is set up where its caller
    receives it, so building it needs no `fabric`, and the function gets no parameter it would
    never read."""
    func = f.function(opt.stmt)
    if func is None:
        return False
    if isinstance(opt.stmt, cst.SimpleStatementLine) and isinstance(opt.stmt.body[0], cst.Return):
        return True
    returned = [r.value for r in f.find_in(func, m.Return()) if r.value is not None]
    return bool(returned) and all(isinstance(v, cst.Name) and v.value == opt.path for v in returned)
