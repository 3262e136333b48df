"""Where Fabric is created (part of the Fabric plan, rules/base/plan.py): the home scope and the
statement Fabric goes before, a little earlier for the prints just above it; and what makes
a script's training impossible to give one Fabric: a module that trains itself, processes the
script starts itself (Hogwild), training handed to code the analysis can't see. A mixin of the
planner (rules/fabric/_plan.py), as rules/fabric/_reach.py and rules/fabric/_devices.py are."""

from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.ddp.hand import HandDDP, hand_ddp
from accelerate_rewrite.codemod.analysis.facts import Optimizer, ScriptFacts, init_of, positional_params
from accelerate_rewrite.codemod.analysis.kinds import hand_updated
from accelerate_rewrite.codemod.analysis.libraries import prepares
from accelerate_rewrite.rules.base.plan import NAME, Scope, _innermost_scope, first_in_common_block, short


class Home:
    """The planner's part that decides where Fabric is created (``self.f``: the facts,
    ``self.p``: the plan, ``self.refuse``)."""

    def _own_processes(self) -> Optional[tuple[cst.CSTNode, str]]:
        """Training in processes the script starts itself, not as DDP (Hogwild:
        ``model.share_memory()``, ``mp.Process(target=train, args=(rank, args, model, ...))``):
        Fabric created in the function each of them runs would launch processes of its own from
        every one, and wrap the shared model in DDP. (node, why), or None."""
        f = self.f
        for _, call in f.attribute_calls_of("share_memory"):
            return call, (f"`{short(call)}` shares the model between processes the script starts itself "
                          "(Hogwild); Fabric's processes don't share a model, they each hold a copy and "
                          "average the gradients; nothing was converted")
        handed = [(call, next((a.value for a in call.args if a.keyword is not None and a.keyword.value == "target"),
                              None)) for call in f.calls_named(*PROCESS_STARTERS)]
        handed += [(call, call.args[0].value) for method in _POOL_METHODS for _, call in f.attribute_calls_of(method)
                   if call.args and call.args[0].keyword is None]
        for call, target in handed:
            fn = f.functions.get(target.value) if isinstance(target, cst.Name) else None
            if fn is not None and id(fn.node) in trains(f):
                return call, (f"`{short(call)}` runs `{target.value}`, which trains, in processes the script "
                              "starts itself (not DDP): each would create a Fabric of its own and launch "
                              "processes from there; nothing was converted")
        return None

    def _hidden_training(self) -> Optional[cst.Call]:
        """A call that passes an optimizer to a function the script does not define (one of a
        module that is not followed, ``engine.train_one_epoch(model, optimizer, ...)``), not
        torch's: where its backward and steps must be."""
        f = self.f
        for opt in f.optimizers:
            for ref in f.references(opt.key):
                arg = f.parent(ref)
                call = f.parent(arg) if isinstance(arg, cst.Arg) and arg.value is ref else None
                if not isinstance(call, cst.Call):
                    continue
                if isinstance(call.func, cst.Name) and call.func.value in f.functions:
                    continue
                if any(q.split(".")[0] == "torch" for q in f.qualnames(call.func)):
                    continue
                return call
        return None

    # -- where Fabric is created --
    def _find_home(self) -> bool:
        f, p = self.f, self.p
        ddp = hand_ddp(f)
        if ddp.found:
            p.ddp = ddp
        if ddp.found and ddp.spawn is not None:
            return self._spawned_home(ddp)
        if self._trains_itself():
            return False
        trained = {f.object_of(key) for opt in f.optimizers for key in opt.models}
        trained |= {f.object_of(key) for key, _ in hand_updated(f)}
        builds = [b for b in f.bindings if f.object_of(b.key) in trained]
        if not builds and not f.optimizers:
            self.refuse(hand_updated(f)[0][1], "the model whose parameters are updated by hand here is not built "
                                               "in this script")
            return False
        first = min(builds or f.optimizers, key=lambda b: f.line(b.stmt))
        home = _innermost_scope(f, first.stmt)
        extra: list[cst.BaseStatement] = []
        # a factory (``def build(device): ...; return model, optimizer``): Fabric belongs
        # where it is called
        while isinstance(home, cst.FunctionDef) and self._is_factory(home):
            call = f.functions[home.name.value].calls[0]
            extra.append(f.statement(call))
            home = _innermost_scope(f, call)
        home = self._where_the_group_starts(ddp, home, extra)
        cls = f.enclosing_class(home) if isinstance(home, cst.FunctionDef) else None
        made = f.functions.get(cls.name.value) if cls is not None else None
        if cls is not None and (home is init_of(cls) or self._run_once(home)) and made is not None \
                and made.node is cls and len(made.calls) == 1 and not self._other_uses(made) \
                and not f.repeats(made.calls[0]):
            # ``class Trainer: def __init__(self, cfg): self.model = Net() ...``, made once (or
            # its ``run()``, called once, that builds the optimizer and trains): Fabric is
            # created where the object is made, and passed in (_new_params)
            extra.append(f.statement(made.calls[0]))
            home = _innermost_scope(f, made.calls[0])
            cls = None
        if cls is not None:
            what = "the optimizer" if isinstance(first, Optimizer) else "the model"
            where = f"{cls.name.value}.{home.name.value}"
            if home is init_of(cls) and made is not None and made.node is cls and made.calls:
                how = ("more than once" if len(made.calls) > 1 else "in a loop" if f.repeats(made.calls[0])
                       else "and also used as a value")
                self.refuse(first.stmt, f"{what} is built in {where}, and `{cls.name.value}(...)` is made {how} "
                                        f"(line {f.line(made.calls[0])}): Fabric is created once, so it can't "
                                        "be created where each object is made; create it before and pass it in "
                                        "by hand")
                return False
            self.refuse(
                first.stmt,
                f"{what} is built inside a class ({where}), not in its __init__ or in an object made once; "
                "create Fabric where that object is made and pass it in",
            )
            return False
        if isinstance(home, cst.Lambda):
            self.refuse(first.stmt, "the model is built in a lambda")
            return False
        p.home = home
        interesting = [b.stmt for b in f.bindings if _innermost_scope(f, b.stmt) is home]
        interesting += [f.statement(d.call) for d in f.device_moves
                        if _innermost_scope(f, d.call) is home]
        interesting += extra
        if self.o.many_devices:  # data the script prepares on disk: Fabric first, to run it once
            interesting += self._preparing(home)
        if p.ddp is not None:  # Fabric starts the processes where the script started them
            interesting += self._ddp_statements(home)
        if isinstance(home, cst.Module):  # another file's top level runs on import, not where Fabric goes
            interesting = [s for s in interesting if f.part_of(s) == 0]
        p.anchor = first_in_common_block(f, interesting)
        if p.anchor is None:
            self.refuse(first.stmt, "could not find one place before the model, optimizer and "
                                    "loaders are built to create Fabric")
            return False
        if p.ddp is None:
            p.anchor = self._before_prints(p.anchor)
        return True

    def _preparing(self, home: Scope) -> list[cst.BaseStatement]:
        """The statements of ``home`` that fetch or unpack data (codemod/analysis/libraries.py,
        PREPARERS), or call a function of the script that does (pygcn's ``fetch(url, root)``):
        Fabric is created before them, so that rank 0 alone runs them (rules/fabric/rank_zero.py)."""
        f = self.f
        out: list[cst.BaseStatement] = []
        todo = [(c, 0) for c in [*(s.call for s in f.calls), *f.attribute_calls] if prepares(f, c)]
        while todo:
            node, depth = todo.pop()
            if _innermost_scope(f, node) is home:
                out.append(f.statement(node))
                continue
            func = f.function(node)
            fn = f.functions.get(func.name.value) if isinstance(func, cst.FunctionDef) else None
            if fn is not None and fn.node is func and depth < 3:
                todo += [(c, depth + 1) for c in fn.calls]
        return out

    def _before_prints(self, anchor: cst.BaseStatement) -> cst.BaseStatement:
        """Fabric a little earlier, so that the prints just above where it would be created
        (``print(args)``, ``print("Random Seed: ", seed)``) become ``fabric.print``: the earliest
        statement of the anchor's block that holds a print, after the arguments are parsed, when
        nothing between it and the anchor sets up the process's environment (``os.environ``,
        ``torch.cuda.set_device``, ``torch.distributed``), which Fabric must see done."""
        f = self.f
        body = list(f.block(anchor).body)
        index = body.index(anchor)
        parsed = max((i for i, s in enumerate(body[:index]) if any(
            f.statement(c) is s for c in f.attribute_calls_of("parse_args") + f.attribute_calls_of("parse_known_args")
            for c in [c[1]])), default=-1)
        printing = {id(f.statement(c)) for c in f.prints}
        chosen = index
        for i in range(index - 1, parsed, -1):
            stmt = body[i]
            if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) or self._sets_environment(stmt):
                break
            if id(stmt) in printing or any(id(inner) in printing for inner in _inner_statements(f, stmt)):
                chosen = i
        return body[chosen]

    def _sets_environment(self, stmt: cst.BaseStatement) -> bool:
        f = self.f
        names = {q for node in f.find_in(stmt, m.Name() | m.Attribute()) for q in f.qualnames(node)}
        return any(q.startswith(("os.environ", "os.putenv", "torch.cuda.set_device", "torch.distributed",
                                 "torch.set_default_device", "torch.accelerator.set_device"))
                   for q in names) or bool(f.find_in(stmt, m.Import() | m.ImportFrom()))

    def _trains_itself(self) -> bool:
        """A module whose own method builds its optimizer over ``self.parameters()`` (a layer that
        trains itself, as forward-forward scripts write them): it would be set up as ``self``
        inside its own class, which rebinds a local name only, and the forward its methods run on
        ``self`` never passes through Fabric's wrapper (no precision, no strategy): refused."""
        f = self.f
        for opt in f.optimizers:
            func = f.function(opt.stmt)
            cls = f.enclosing_class(func) if func is not None else None
            # kept on the object and stepped by its own methods (not nanoGPT's configure_optimizers,
            # which builds one over its parameters and returns it to the script)
            stepped_inside = cls is not None and opt.path.startswith("self.") and any(
                c.func.attr.value == "step" and f.key_of(c.func.value) == opt.key
                and f.function(c) is not None and f.enclosing_class(f.function(c)) is cls
                for c in f.attribute_calls)
            if stepped_inside and any(path == "self" and owner is func for owner, path in opt.models):
                self.refuse(opt.stmt, f"`{opt.path}` is built over the module's own parameters in "
                                      f"{cls.name.value}.{func.name.value}: `{cls.name.value}` trains itself, inside "
                                      "the class, so the forward it runs on `self` would bypass Fabric's wrapper "
                                      "(no precision, no strategy) wherever it were set up; nothing was converted")
                return True
        return False

    def _where_the_group_starts(self, ddp, home: Scope, extra: list[cst.BaseStatement]) -> Scope:
        """Hand-made DDP whose process group starts in an outer scope (``if __name__ ==
        "__main__": ...; init_process_group(...); ...; main(config)``, Swin's and the torchrun
        family's) that calls the function building the model once: Fabric is created where the
        group started, and the function receives it (``main(fabric, config)``)."""
        f = self.f
        if not ddp.found or not ddp.starts:
            return home
        starts = {id(_innermost_scope(f, s)) for s in ddp.starts}
        chain, current = [], home
        while isinstance(current, cst.FunctionDef) and id(current) not in starts:
            fn = f.functions.get(current.name.value)
            if fn is None or fn.node is not current or len(fn.calls) != 1 or fn.other_uses \
                    or f.repeats(fn.calls[0]):
                return home
            chain.append(f.statement(fn.calls[0]))
            current = _innermost_scope(f, fn.calls[0])
        if id(current) not in starts or current is home:
            return home
        extra[:] = [s for s in [*extra, *chain] if _innermost_scope(f, s) is current]
        return current

    def _ddp_statements(self, home: Scope) -> list[cst.BaseStatement]:
        """The statements of ``home`` that start the hand-made world or read a process's place,
        or call a function of the script that does (``rank, world_size = setup()``)."""
        f, p = self.f, self.p
        out: list[cst.BaseStatement] = []
        for node in [*p.ddp.starts, *(n for n, _ in p.ddp.reads)]:
            scope = _innermost_scope(f, node)
            if scope is home:
                out.append(f.statement(node))
            elif isinstance(scope, cst.FunctionDef) and f.functions.get(scope.name.value) is not None \
                    and f.functions[scope.name.value].node is scope:
                out += [f.statement(c) for c in f.functions[scope.name.value].calls
                        if _innermost_scope(f, c) is home]
        return out


    def _spawned_home(self, ddp: HandDDP) -> bool:
        """``mp.spawn(worker, ...)``: Fabric is created where spawn was and launches the worker,
        which receives it as its first argument; so `fabric` exists from the worker's first line."""
        f, p = self.f, self.p
        worker = ddp.spawn.worker
        builds = [b for b in f.bindings if any(f.same_object(b.key, key) for opt in f.optimizers
                                                for key in opt.models)] or list(f.optimizers)
        outside = [b for b in builds if f.function(b.stmt) is not worker
                   and not self._called_only_from(f.function(b.stmt), worker)]
        if outside:
            self.refuse(outside[0].stmt, f"hand-made distributed training: `{outside[0].path}` is built "
                                         f"outside `{worker.name.value}`, the function mp.spawn runs; "
                                         "nothing was converted")
            return False
        if any(p.name.value == NAME for p in positional_params(worker)):
            self.refuse(worker, f"`{worker.name.value}` already has a parameter named `{NAME}`")
            return False
        p.home = worker
        p.anchor = next(s for s in worker.body.body)
        return True

    def _other_uses(self, made) -> list:
        """Uses of a class other than making it, but reading its static and class methods
        (``Trainer.get_default_config()``: no object is made)."""
        f = self.f
        static = {s.name.value for s in made.node.body.body if isinstance(s, cst.FunctionDef) and any(
            m.matches(d.decorator, m.Name("staticmethod") | m.Name("classmethod")) for d in s.decorators)}
        return [u for u in made.other_uses
                if not (isinstance(f.parent(u), cst.Attribute) and f.parent(u).attr.value in static)]

    def _run_once(self, method: cst.FunctionDef) -> bool:
        """A method called once, on an object of its class (``trainer.run()``), not in a loop:
        minGPT's Trainer builds the optimizer and the loader in ``run()`` and trains there. Or
        one that only ``__init__`` calls, once (StarGAN's ``Solver.__init__`` calls
        ``self.build_model()``): a part of making the object."""
        f = self.f
        calls = [call for call, target in f._method_calls_of_objects() if target is method]
        own = [c for c in f.attribute_calls
               if m.matches(c.func, m.Attribute(value=m.Name("self"), attr=m.Name(method.name.value)))]
        # (called twice some way the analysis can't see, the second fabric.setup of the same
        # model fails loudly: "A model should be passed through setup only once")
        if not calls and len(own) == 1:
            cls = f.enclosing_class(method)
            init = init_of(cls) if cls is not None else None
            return init is not None and f.function(own[0]) is init and not f.repeats(own[0]) \
                and len(f.find(m.Attribute(attr=m.Name(method.name.value)))) == 1
        return len(calls) == 1 and not f.repeats(calls[0]) and not own

    def _called_only_from(self, func: Optional[cst.FunctionDef], worker: cst.FunctionDef) -> bool:
        """A module-level function called once, from ``worker`` (``load_train_objs()`` in the
        function mp.spawn runs): what it builds is built in each process, after the world starts."""
        f = self.f
        fn = f.functions.get(func.name.value) if func is not None else None
        return (fn is not None and fn.node is func and len(fn.calls) == 1 and not fn.other_uses
                and f.function(fn.calls[0]) is worker)

    def _is_factory(self, func: cst.FunctionDef) -> bool:
        """A module-level function that builds and returns the model, called once."""
        f = self.f
        fn = f.functions.get(func.name.value)
        if fn is None or fn.node is not func or len(fn.calls) != 1 or fn.other_uses:
            return False
        built = {b.path for b in f.bindings if b.owner is func and b.kind in ("module", "optimizer")}
        # its returns, those of functions inside it too (from the analysis's list, not a walk of it)
        for ret in (r for r in f.returns if any(a is func for a in f.ancestors(r))):
            if ret.value is not None and {n.value for n in m.findall(ret.value, m.Name())} & built:
                return True
        return False


#: what starts processes that run a function of the script (not DDP's spawn: codemod/ddp/hand.py)
PROCESS_STARTERS = ("torch.multiprocessing.Process", "multiprocessing.Process", "multiprocessing.context.Process",
                    "torch.multiprocessing.start_processes")
#: a pool's or an executor's methods that run a function in its processes
_POOL_METHODS = ("map", "starmap", "imap", "imap_unordered", "apply", "apply_async", "map_async", "submit")


def trains(f: ScriptFacts) -> dict[int, cst.FunctionDef]:
    """The module-level functions of the script that train: run a backward themselves, or call
    one that does (directly or not), by id. Made once per file."""
    def compute() -> dict[int, cst.FunctionDef]:
        out = {id(s.function): s.function for s in f.backward_sites if s.function is not None}
        changed = True
        while changed:
            changed = False
            for fn in f.functions.values():
                if isinstance(fn.node, cst.FunctionDef) and id(fn.node) in out:
                    for call in fn.calls:
                        caller = f.function(call)
                        if caller is not None and id(caller) not in out:
                            out[id(caller)] = caller
                            changed = True
        return out
    return f.memo("training-functions-reached", compute)


def _inner_statements(f: ScriptFacts, stmt: cst.BaseStatement) -> list[cst.BaseStatement]:
    """The statements nested in a compound one (an ``if``'s, a ``try``'s)."""
    return [s for s in f.find_in(stmt, m.SimpleStatementLine()) if s is not stmt]
