"""What the loops of a script do with its DataLoaders: train on them, or only evaluate.

With several processes, a loader set up by Fabric gives each process its own shard. That is
what a training loader wants; an evaluation loader that is sharded makes every process report
the metric of its shard as the whole (``test_loss /= len(test_loader.dataset)`` divides one
rank's sum by the full size). So the Fabric plan asks, for each loader, which it is:

- ``TRAIN``: some loop over it trains (a backward or an optimizer step in the loop, directly
  or in a function of the script called from it), or a training loop draws its batches one at
  a time (``next(data_iter)``, ``data_iter = iter(loader)``);
- ``EVAL``: it is iterated, never by a training loop, and under ``torch.no_grad()`` /
  ``torch.inference_mode()`` (a ``with`` around or inside the loop, or a decorator of its
  function), after a ``model.eval()`` in the same function, or its name says so (test, val);
- ``UNKNOWN``: not iterated in this file, or nothing says; treated as training (sharded). One
  not iterated in this file whose name says test/val is ``EVAL`` (sharding it could only make
  its figures one process's).

Computed once per file (``facts.memo``) and shared by the rules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.kinds import MODEL, OPTIMIZER, Binding, Key
from accelerate_rewrite.codemod.analysis.syntax import COUNTERS, code, passes_through, unwrap_iter

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts

TRAIN, EVAL, UNKNOWN = "train", "eval", "unknown"

NO_GRAD = (
    "torch.no_grad", "torch.inference_mode", "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode",
)
EVAL_WORDS = ("test", "val", "eval", "dev")

def data_source(f: Facts, source: cst.BaseExpression) -> cst.BaseExpression:
    """What a loop draws its items from, through ``enumerate``, ``tqdm`` and the script's own
    generators that yield their first argument's items (``metric_logger.log_every(loader, 10)``,
    ``syntax.passes_through``): ``loader``; also through a name bound once to such a wrapper
    (pytorch-deeplab-xception's ``tbar = tqdm(self.train_loader)``, then ``enumerate(tbar)``)."""
    through = f.memo("passes-through", lambda: passes_through(f.module, f.find_in))
    source = unwrap_iter(source, through)
    if isinstance(source, cst.Subscript) and f.key_of(source.value) in f.loader_dicts:
        return source.value  # ``dataloaders[phase]`` of a dict of loaders: the dict, set up entry by entry
    for _ in range(3):
        values = [v for _, v in f.assignments(source)] if isinstance(source, cst.Name) else []
        inner = unwrap_iter(values[0], through) if len(values) == 1 and isinstance(values[0], cst.Call) else None
        if inner is None or inner is values[0]:
            break
        source = inner
    return source


def is_counter(f: Facts, source: cst.BaseExpression) -> bool:
    """``range(epochs)``, ``enumerate(range(n))``, ``trange(n)`` (or a name bound to it once),
    ``itertools.count()``: it counts; its items are no data."""
    source = data_source(f, source)
    if isinstance(source, cst.Name):
        # each of its values counts (StyleGAN2's ``pbar = range(args.iter)``, then ``pbar =
        # tqdm(pbar, ...)`` on rank 0)
        values = [v for _, v in f.assignments(source)]
        return bool(values) and all(v is not None and (m.matches(v, m.Call(func=COUNTERS)) or m.matches(
            data_source(f, v), m.Name(source.value))) for v in values) and any(
            m.matches(v, m.Call(func=COUNTERS)) for v in values)
    return m.matches(source, m.Call(func=COUNTERS))


def batch_loop(f: Facts, node: cst.CSTNode) -> Optional[cst.For]:
    """The loop around ``node`` that draws the batches: the innermost ``for`` that doesn't count
    (``for epoch in trange(n)`` holds no batches) and doesn't go over pieces of an outer loop's
    items (pytorch_image_classification's ``for data_chunk, target_chunk in zip(data_chunks,
    target_chunks)``, with ``data_chunks, target_chunks = subdivide_batch(config, data,
    targets)`` from ``for step, (data, targets) in enumerate(train_loader)``: that outer loop)."""
    loops = [a for a in f.ancestors(node) if isinstance(a, cst.For) and not is_counter(f, a.iter)]
    for i, loop in enumerate(loops):
        outer = loops[i + 1] if i + 1 < len(loops) else None
        if outer is None or not _pieces_of(f, loop, outer):
            return loop
    return None


def _pieces_of(f: Facts, loop: cst.For, outer: cst.For) -> bool:
    """Every name ``loop`` draws from is made, in ``outer``'s body, of ``outer``'s items."""
    derived = {n.value for n in m.findall(outer.target, m.Name())}
    if not isinstance(outer.body, cst.IndentedBlock):
        return False
    for stmt in outer.body.body:
        if stmt is loop or loop in f.ancestors(stmt) or any(a is stmt for a in f.ancestors(loop)):
            break
        for assign in m.findall(stmt, m.Assign()):
            reads = {n.value for n in m.findall(assign.value, m.Name())}
            if reads & derived:
                derived |= {n.value for t in assign.targets for n in m.findall(t.target, m.Name())}
    read = [n for n in m.findall(loop.iter, m.Name()) if not _called(f, n)]
    return bool(read) and all(n.value in derived for n in read)


def _called(f: Facts, name: cst.Name) -> bool:
    parent = f.parent(name)
    return isinstance(parent, cst.Call) and parent.func is name


def for_loops(f: Facts) -> list[cst.For]:
    return f.memo("for-loops", lambda: f.find(m.For()))


def _training_functions(f: Facts) -> set[int]:
    """ids of the script's functions that run a backward or an optimizer step."""
    def compute() -> set[int]:
        out: set[int] = set()
        for node in [s.call for s in f.backward_sites] + f.method_calls(OPTIMIZER, "step"):
            func = f.function(node)
            if func is not None:
                out.add(id(func))
        return out
    return f.memo("training-functions", compute)


def is_training_loop(f: Facts, loop: cst.For) -> bool:
    """A backward or an optimizer step in the loop, or a call of a function that runs one."""
    return id(loop) in _training_loops(f)


def _training_loops(f: Facts) -> set[int]:
    """ids of the loops around a backward, an optimizer step or a call of a function that runs
    one: each such place walked up once (not once per loop asked about: quadratic in a long
    script)."""
    def compute() -> set[int]:
        training = _training_functions(f)
        places = [s.call for s in f.backward_sites] + f.method_calls(OPTIMIZER, "step")
        places += [call for fn in f.functions.values() if id(fn.node) in training for call in fn.calls]
        return {id(a) for node in places for a in f.ancestors(node)}
    return f.memo("training-loops", compute)


def _no_grad_call(f: Facts, node: cst.BaseExpression) -> bool:
    core = node.func if isinstance(node, cst.Call) else node
    return bool(f.qualnames(core) & set(NO_GRAD)) or bool(f.qualnames(node) & set(NO_GRAD))


def without_grad(f: Facts, node: cst.CSTNode) -> bool:
    """``node`` runs under ``with torch.no_grad():`` (or inference_mode) in its function, or in a
    function decorated with one."""
    for parent in f.ancestors(node):
        if isinstance(parent, cst.With) and any(_no_grad_call(f, item.item) for item in parent.items):
            return True
        if isinstance(parent, cst.FunctionDef):
            return any(_no_grad_call(f, d.decorator) for d in parent.decorators)
        if isinstance(parent, (cst.ClassDef, cst.Lambda)):
            return False
    return False


def has_eval_evidence(f: Facts, loop: cst.For) -> bool:
    """The loop runs without gradients, or after ``model.eval()`` in its function."""
    for parent in f.ancestors(loop):
        if isinstance(parent, cst.With) and any(_no_grad_call(f, item.item) for item in parent.items):
            return True
        if isinstance(parent, cst.FunctionDef):
            if any(_no_grad_call(f, d.decorator) for d in parent.decorators):
                return True
            break
    for inner in f.find_in(loop.body, m.With()):
        if any(_no_grad_call(f, item.item) for item in inner.items):
            return True
    func = f.function(loop)
    if any(call.func.attr.value == "eval" and not call.args and f.function(call) is func
           and f.line(call) <= f.line(loop) and MODEL in f.kinds_of(call.func.value)
           for call in f.attribute_calls):
        return True
    # minGPT's adder: ``eval_split(trainer, "test")``, called only under ``torch.no_grad()``
    callers = _calls_of(f, func) if func is not None else []
    return bool(callers) and all(without_grad(f, call) for call in callers)


def _calls_of(f: Facts, func: cst.FunctionDef) -> list[cst.Call]:
    """The calls of ``func`` by its name: a module-level function's, or a nested one's in the
    function (or module) that defines it; none where it is used any other way (handed on)."""
    name = func.name.value
    fn = f.functions.get(name)
    if fn is not None and fn.node is func:
        return [] if fn.other_uses else [c for c in fn.calls if isinstance(c, cst.Call)]
    # a nested function's, or one defined under ``if __name__ == "__main__":``
    outer = next((a for a in f.ancestors(func) if isinstance(a, cst.FunctionDef)), f.module)
    uses = [n for n in f.find_in(outer, m.Name(name)) if n is not func.name]
    calls = [f.parent(n) for n in uses]
    return calls if all(isinstance(c, cst.Call) and c.func is n for c, n in zip(calls, uses)) else []


def loops_over(f: Facts, key: Key) -> list[cst.For]:
    return [loop for loop in for_loops(f) if f.same_object(f.key_of(data_source(f, loop.iter)), key)]


_ITERATOR = m.Call(func=m.Name("iter") | m.Name("cycle") | m.Attribute(value=m.Name("itertools"), attr=m.Name("cycle")))


def _stepping_loop(f: Facts, node: cst.CSTNode) -> Optional[cst.CSTNode]:
    """The innermost loop around ``node`` when it trains and no ``torch.no_grad()`` lies between."""
    training = _training_loops(f)
    for parent in f.ancestors(node):
        if isinstance(parent, cst.With) and any(_no_grad_call(f, item.item) for item in parent.items):
            return None
        if isinstance(parent, (cst.For, cst.While)):
            return parent if id(parent) in training else None
        if isinstance(parent, (cst.FunctionDef, cst.ClassDef)):
            return None
    return None


def drawing_loops(f: Facts, key: Key) -> list[cst.CSTNode]:
    """The training loops that draw a loader's batches one at a time: ``data_iter =
    iter(train_loader)`` and ``x, y = next(data_iter)`` in the loop that steps (nanoGPT's, and any
    script that counts iterations rather than epochs), or ``next(iter(loader))`` /
    ``itertools.cycle(loader)`` there."""
    def compute() -> list[cst.CSTNode]:
        found: list[cst.CSTNode] = []
        through = f.memo("passes-through", lambda: passes_through(f.module, f.find_in))
        # and StyleGAN2's ``loader = sample_data(loader)``, a generator of the script's own that
        # yields the loader's batches over and over (``while True: for batch in loader: yield
        # batch``), drawn by ``next(loader)`` in the loop that steps
        wrapped = [c for c in f.find(m.Call(func=m.Name())) if c.func.value in through] if through else []
        for call in [*f.find(_ITERATOR), *wrapped]:
            if not call.args or not f.same_object(f.key_of(data_source(f, call.args[0].value)), key):
                continue
            found.append(_stepping_loop(f, call))
            assign = f.parent(call)
            if isinstance(assign, cst.Assign) and len(assign.targets) == 1 \
                    and isinstance(assign.targets[0].target, cst.Name):
                name, func = assign.targets[0].target.value, f.function(call)
                found += [_stepping_loop(f, nxt) for nxt in f.find(
                    m.Call(func=m.Name("next"), args=[m.Arg(m.Name(name)), m.ZeroOrMore()]))
                    if f.function(nxt) is func]
        return [loop for i, loop in enumerate(found) if loop is not None and loop not in found[:i]]
    return f.memo(("drawing-loops", key), compute)


def loader_role(f: Facts, loader: Binding) -> str:
    def compute() -> str:
        loops = loops_over(f, loader.key)
        if drawing_loops(f, loader.key):
            return TRAIN
        named = any(w in loader.path.lower() for w in EVAL_WORDS)
        if not loops:  # handed to code the analysis can't see: its name is all there is to go by
            return EVAL if named else UNKNOWN
        if any(is_training_loop(f, loop) for loop in loops):
            return TRAIN
        if named or all(has_eval_evidence(f, loop) for loop in loops):
            return EVAL
        return UNKNOWN
    return f.memo(("loader-role", loader.key), compute)



# ---- --shard-eval: what an evaluation loop sums, and whether it can be reduced ------------------

#: values that make a ``+=`` accumulate a Python number (reduced, then ``.item()`` again)
_NUMBER = (m.Call(func=m.Attribute(attr=m.Name("item")), args=[])
           | m.Call(func=m.Name("len") | m.Name("float") | m.Name("int"))
           | m.Call(func=m.Attribute(attr=m.Name("size")), args=[m.Arg(m.Integer())])
           | m.Subscript(value=m.Attribute(attr=m.Name("shape")))
           | m.Integer() | m.Float())
_METRIC_CALLS = ("update", "forward", "compute")


def _is_number(value: cst.BaseExpression) -> bool:
    """``loss.item() * x.size(0)``, ``len(batch)``: a Python number, not a tensor."""
    if isinstance(value, cst.BinaryOperation):
        return _is_number(value.left) and _is_number(value.right)
    if isinstance(value, cst.UnaryOperation):
        return _is_number(value.expression)
    return m.matches(value, _NUMBER)


@dataclass
class EvalSums:
    """What sharding one evaluation loader needs: the sums its loops accumulate, each to be
    all-reduced after its loop, or why it can't be sharded safely."""

    #: (loop, [(name, is_number, op)]): ``name = fabric.all_reduce(name, reduce_op=op)`` after
    #: the loop (``.item()`` again where the script summed Python numbers); op is "sum", or
    #: "mean" for a training sum read as a mean over the process's batches
    reductions: list[tuple[cst.For, list[tuple[str, bool, str]]]] = field(default_factory=list)
    problem: Optional[tuple[cst.CSTNode, str]] = None
    notes: list[tuple[cst.CSTNode, str]] = field(default_factory=list)


def eval_sums(f: Facts, loader: Binding) -> EvalSums:
    return f.memo(("eval-sums", loader.key), lambda: _eval_sums(f, loader))


def evaluations_of_training_loader(f: Facts, loader: Binding) -> tuple[list[cst.For], EvalSums]:
    """A training loader (sharded) that the script also evaluates on (``for x, y in train_loader:``
    under ``torch.no_grad()`` after the training): those loops, and their sums as --shard-eval
    reads them (all-reduced after each loop, the figures of the whole set again)."""
    loops = [loop for loop in loops_over(f, loader.key)
             if not is_training_loop(f, loop) and has_eval_evidence(f, loop)]
    return loops, (_eval_sums(f, loader, loops) if loops else EvalSums())


def shared_evaluations(f: Facts, loader: Binding) -> list[cst.For]:
    """The evaluation loops over a parameter that some call gives ``loader`` and another call
    another loader (``evaluate(model, train_loader)``, ``evaluate(model, val_loader)``): sharded
    for training, ``loader`` shows such a loop one process's share, and a sum after it can't be
    all-reduced (the other loader's is whole already)."""
    sources = ((loop, f.key_of(data_source(f, loop.iter))) for loop in for_loops(f))
    return [loop for loop, source in sources
            if not f.same_object(source, loader.key) and f.may_hold(source, loader.key)
            and not is_training_loop(f, loop) and has_eval_evidence(f, loop)]


def _eval_sums(f: Facts, loader: Binding, loops: Optional[list[cst.For]] = None) -> EvalSums:
    out = EvalSums()
    for loop in loops_over(f, loader.key) if loops is None else loops:
        func = f.function(loop)
        sums: dict[str, bool] = {}
        for node in f.find_in(loop.body, m.AugAssign() | m.Call(func=m.Attribute())):
            if f.function(node) is not func:
                continue
            if isinstance(node, cst.Call):
                method = node.func.attr.value
                if method in ("append", "extend") and isinstance(node.func.value, cst.Name):
                    out.problem = out.problem or (node, f"`{code(node.func)}(...)` collects results "
                                                        "per process, which a sum over the processes can't gather")
                elif method in _METRIC_CALLS:
                    out.notes.append((node, f"`{code(node.func)}(...)`: a torchmetrics metric syncs "
                                            "its own state across processes when it computes"))
                continue
            target = node.target
            if not isinstance(target, cst.Name):
                out.problem = out.problem or (node, f"`{code(target)} {code(node.operator).strip()}` "
                                                    "accumulates where a sum over the processes can't follow it")
                continue
            if not isinstance(node.operator, cst.AddAssign):
                out.problem = out.problem or (node, f"`{target.value}` is updated with "
                                                    f"`{code(node.operator).strip()}`, not summed")
                continue
            number = _is_number(node.value)
            sums[target.value] = sums.get(target.value, True) and number
        if out.problem is not None:
            return out
        for name in sums:
            problem = _sum_problem(f, loop, func, name)
            if problem:
                out.problem = (loop, problem)
                return out
        per_batch = _divided_by_batches(f, loop, func, loader)
        if per_batch is not None:
            out.problem = (per_batch, f"`{code(per_batch)}` divides by the number of batches, which "
                                      "becomes one process's share when the loader is sharded")
            return out
        if sums:
            out.reductions.append((loop, [(name, number, "sum") for name, number in sums.items()]))
    return out


def _sum_problem(f: Facts, loop: cst.For, func, name: str) -> Optional[str]:
    """Why the accumulator ``name`` can't simply be all-reduced after ``loop``."""
    block = func.body if func is not None else f.module
    starts = [a for a in f.find_in(block, m.Assign(targets=[m.AssignTarget(m.Name(name))]))
              if f.function(a) is func and f.line(a) < f.line(loop)]
    if not starts:
        return f"`{name}` is summed in the loop but not set before it in the same function"
    if any(f.line(a) > f.line(loop) for a in f.find_in(loop.body, m.Assign(targets=[m.AssignTarget(m.Name(name))]))):
        return f"`{name}` is reset inside the loop"
    return None


def _divided_by_batches(f: Facts, loop: cst.For, func, loader: Binding) -> Optional[cst.CSTNode]:
    """A ``len(loader)`` read after the loop (a mean over batches), if any."""
    block = func.body if func is not None else f.module
    for call in f.find_in(block, m.Call(func=m.Name("len"), args=[m.Arg(m.Name() | m.Attribute())])):
        if f.line(call) > f.line(loop) and f.function(call) is func \
                and f.same_object(f.key_of(call.args[0].value), loader.key):
            return call
    return None


# ---- training sums over a sharded loader ------------------------------------------------------

def training_sums(f: Facts, loader: Binding) -> EvalSums:
    """The sums a training loop over ``loader`` accumulates (``train_loss += loss.item()``) that
    the script reads after the loop. Sharded, each process sums its shard only: a sum read as a
    figure of the whole set (``train_loss / len(train_loader.dataset)``, ``train_loss /=
    len(...)``) is summed over the processes after the loop, one read as a mean over batches
    (``/ len(train_loader)``: every process has as many) averaged (``reductions``); one read any
    other way is one process's figure, and ``notes`` says so."""
    return f.memo(("training-sums", loader.key), lambda: _training_sums(f, loader))


def _training_sums(f: Facts, loader: Binding) -> EvalSums:
    out = EvalSums()
    for loop in loops_over(f, loader.key):
        if not is_training_loop(f, loop):
            continue
        func = f.function(loop)
        sums: dict[str, bool] = {}
        for node in f.find_in(loop.body, m.AugAssign(target=m.Name(), operator=m.AddAssign())):
            if f.function(node) is func:
                name = node.target.value
                sums[name] = sums.get(name, True) and _is_number(node.value)
        reduced = []
        for name, number in sums.items():
            reads, op = _reads_after(f, loop, func, name, loader)
            if not reads:
                continue
            if op is not None and _sum_problem(f, loop, func, name) is None:
                reduced.append((name, number, op))
            else:
                out.notes.append((reads[0], f"`{name}` sums what this process trained on, its shard of "
                                            f"`{loader.path}`: `{code(f.statement(reads[0])).strip()}` after "
                                            "the loop is one process's figure"))
        if reduced:
            out.reductions.append((loop, reduced))
    return out


def _reads_after(f: Facts, loop: cst.For, func, name: str, loader: Binding
                 ) -> tuple[list[cst.Name], Optional[str]]:
    """The reads of ``name`` after ``loop`` in its function (up to its next assignment), and the
    reduction that makes each of them the whole set's figure: "sum" where every read divides it
    by the set's size (``len(<loader>.dataset)``), "mean" where every read divides it by the
    number of batches (``len(<loader>)``: each process has as many); None otherwise."""
    block = func.body if func is not None else f.module
    end = f.end_line(loop)
    reads: list[cst.Name] = []
    ops: set[Optional[str]] = set()
    for node in f.find_in(block, m.Name(name)):
        if f.function(node) is not func or f.line(node) <= end:
            continue
        parent = f.parent(node)
        if isinstance(parent, cst.AssignTarget):
            break  # a new value from here on
        reads.append(node)
        if isinstance(parent, cst.AugAssign) and parent.target is node:
            ops.add(_divisor(f, parent.value, loader) if isinstance(parent.operator, cst.DivideAssign) else None)
            break  # ``train_loss /= len(...)``: the average from here on
        divided = isinstance(parent, cst.BinaryOperation) and parent.left is node \
            and isinstance(parent.operator, cst.Divide)
        ops.add(_divisor(f, parent.right, loader) if divided else None)
    return reads, (ops.pop() if len(ops) == 1 else None)


def _divisor(f: Facts, node: cst.BaseExpression, loader: Binding) -> Optional[str]:
    """"sum" for ``len(train_loader.dataset)`` (the whole set's size), "mean" for
    ``len(train_loader)`` (the batches of one process), None for anything else."""
    if not m.matches(node, m.Call(func=m.Name("len"), args=[m.Arg()])):
        return None
    arg = node.args[0].value
    if m.matches(arg, m.Attribute(attr=m.Name("dataset"))) and f.same_object(f.key_of(arg.value), loader.key):
        return "sum"
    return "mean" if f.same_object(f.key_of(arg), loader.key) else None
