"""What the loops of a script do with its DataLoaders: train on them, or only evaluate.

With several processes, a loader set up by Fabric gives each process its own shard. That is
what a training loader wants; an evaluation loader that is sharded makes every process report
the metric of its shard as the whole (``test_loss /= len(test_loader.dataset)`` divides one
rank's sum by the full size). So the Fabric plan asks, for each loader, which it is:

- ``TRAIN``: some loop over it trains (a backward or an optimizer step in the loop, directly
  or in a function of the script called from it);
- ``EVAL``: it is iterated, never by a training loop, and under ``torch.no_grad()`` /
  ``torch.inference_mode()`` (a ``with`` around or inside the loop, or a decorator of its
  function), after a ``model.eval()`` in the same function, or its name says so (test, val);
- ``UNKNOWN``: not iterated in this file, or nothing says; treated as training (sharded).

Computed once per file (``facts.memo``) and shared by the rules.
"""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.facts import MODEL, OPTIMIZER, Binding, Key, ScriptFacts

TRAIN, EVAL, UNKNOWN = "train", "eval", "unknown"

NO_GRAD = (
    "torch.no_grad", "torch.inference_mode", "torch.autograd.grad_mode.no_grad",
    "torch.autograd.grad_mode.inference_mode",
)
EVAL_WORDS = ("test", "val", "eval", "dev")

_ITER_WRAPPERS = m.Name("enumerate") | m.Name("tqdm") | m.Attribute(attr=m.Name("tqdm"))


def unwrap_iter(source: cst.BaseExpression) -> cst.BaseExpression:
    """``enumerate(tqdm(loader))`` -> ``loader``."""
    while m.matches(source, m.Call(func=_ITER_WRAPPERS)) and source.args:
        source = source.args[0].value
    return source


def for_loops(f: ScriptFacts) -> list[cst.For]:
    return f.memo("for-loops", lambda: list(m.findall(f.module, m.For())))


def _training_functions(f: ScriptFacts) -> set[int]:
    """ids of the script's functions that run a backward or an optimizer step."""
    def compute() -> set[int]:
        out: set[int] = set()
        for node in [s.call for s in f.backward_sites] + f.method_calls(OPTIMIZER, "step"):
            func = f.function(node)
            if func is not None:
                out.add(id(func))
        return out
    return f.memo("training-functions", compute)


def is_training_loop(f: ScriptFacts, loop: cst.For) -> bool:
    def compute() -> bool:
        for node in [s.call for s in f.backward_sites] + f.method_calls(OPTIMIZER, "step"):
            if loop in f.ancestors(node):
                return True
        training = _training_functions(f)
        for fn in f.functions.values():
            if id(fn.node) in training and any(loop in f.ancestors(call) for call in fn.calls):
                return True
        return False
    return f.memo(("training-loop", id(loop)), compute)


def _no_grad_call(f: ScriptFacts, node: cst.BaseExpression) -> bool:
    core = node.func if isinstance(node, cst.Call) else node
    return bool(f.qualnames(core) & set(NO_GRAD)) or bool(f.qualnames(node) & set(NO_GRAD))


def has_eval_evidence(f: ScriptFacts, loop: cst.For) -> bool:
    """The loop runs without gradients, or after ``model.eval()`` in its function."""
    for parent in f.ancestors(loop):
        if isinstance(parent, cst.With) and any(_no_grad_call(f, item.item) for item in parent.items):
            return True
        if isinstance(parent, cst.FunctionDef):
            if any(_no_grad_call(f, d.decorator) for d in parent.decorators):
                return True
            break
    for inner in m.findall(loop.body, m.With()):
        if any(_no_grad_call(f, item.item) for item in inner.items):
            return True
    func = f.function(loop)
    return any(call.func.attr.value == "eval" and not call.args and f.function(call) is func
               and f.line(call) <= f.line(loop) and MODEL in f.kinds_of(call.func.value)
               for call in f.attribute_calls)


def loops_over(f: ScriptFacts, key: Key) -> list[cst.For]:
    return [loop for loop in for_loops(f) if f.same_object(f.key_of(unwrap_iter(loop.iter)), key)]


def loader_role(f: ScriptFacts, loader: Binding) -> str:
    def compute() -> str:
        loops = loops_over(f, loader.key)
        if not loops:
            return UNKNOWN
        if any(is_training_loop(f, loop) for loop in loops):
            return TRAIN
        named = any(w in loader.path.lower() for w in EVAL_WORDS)
        if named or all(has_eval_evidence(f, loop) for loop in loops):
            return EVAL
        return UNKNOWN
    return f.memo(("loader-role", loader.key), compute)

