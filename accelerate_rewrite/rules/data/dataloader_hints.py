from __future__ import annotations

from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import DATALOADERS, ScriptFacts, code
from accelerate_rewrite.codemod.rule import Example, Kind, Rule, RuleContext
from accelerate_rewrite.rules.base.calls import set_keywords
from accelerate_rewrite.rules.base.plan import short

PIN = "torch.cuda.is_available()"
WORKERS = "min(4, os.cpu_count() or 1)"
#: calls that draw random numbers: a dataset's ``__getitem__`` that makes them gets other numbers
#: in worker processes (each worker has its own seed)
RANDOM = ("torch.rand", "torch.randn", "torch.randint", "torch.randperm", "torch.bernoulli",
          "torch.normal", "torch.multinomial", "random.", "numpy.random.")
SPAWN = ("worker processes re-run the script's module-level code where they start by spawn or "
         "forkserver (macOS, Windows, Linux from Python 3.14)")


class DataLoaderHints(Rule):
    """DataLoaders that feed the GPU without stalling it: `pin_memory`, `num_workers`,
    `persistent_workers`. Opt-in: reported on every run, applied only when selected by its code
    or name (`--select AR404`, or `select = ["AR404"]`).

    What it does: for each `DataLoader(...)` built in the script,
    - no `pin_memory`: adds `pin_memory=torch.cuda.is_available()` (page-locked batches, whose
      copy to the GPU is faster and can overlap compute; nothing on a machine without CUDA);
    - no `num_workers`, or `num_workers=0`: `num_workers=min(4, os.cpu_count() or 1)`, so that
      batches are loaded and collated in worker processes while the GPU computes. Only where the
      loader is built in a function and the script has an `if __name__ == "__main__":` guard:
      workers started by spawn or forkserver re-run a script's module-level code;
    - workers and no `persistent_workers`: `persistent_workers=True` (workers kept from one epoch
      to the next, instead of started again for each).

    Why: with the defaults, the training process loads every batch itself, between steps, and
    the GPU waits; pinned memory makes host-to-device copies faster and asynchronous.

    Kind: safe for `pin_memory` and `num_workers`: the batches are the same (the shuffle order
    is drawn in the main process). Two changes say otherwise: `persistent_workers=True` changes
    training (the main process draws one seed less each epoch, so from the second epoch the
    shuffle order, and anything else drawn from torch's global generator, differ: the same
    training, another random draw), and so do workers for a dataset of the script whose
    `__getitem__` draws random numbers (each worker has its own seed).

    Leaves alone (and says why): a DataLoader built from `**kwargs` or with more than three
    arguments by position, workers for a loader built at module level or in a script without
    a `__main__` guard, or with a `lambda` (spawned workers can't pickle it), and a
    `num_workers` that is not a literal (then no `persistent_workers` either).
    """

    code = "AR404"
    name = "dataloader-hints"
    kind = Kind.SAFE
    opt_in = True
    words = ("dataloader",)
    examples = (Example.from_files("AR404", options={"backend": "torch", "explicit": ("AR404",)}),)

    def rewrite(self, ctx: RuleContext) -> None:
        f = ctx.facts
        apply = self.code in ctx.options.explicit
        guarded = _main_guard(f)
        random_datasets = _random_datasets(f)
        added: set[str] = set()
        for site in f.calls:
            if site.qualname not in DATALOADERS:
                continue
            call = site.call
            where = short(call, 40)
            spread = next((a for a in call.args if a.star == "**"), None)
            if spread is not None:
                ctx.skip(call, f"`{where}`: its keywords come from `**{short(spread.value, 30)}`, which the "
                               "rewrite can't see into: no hints")
                continue
            if len([a for a in call.args if a.keyword is None]) > 3:
                ctx.skip(call, f"`{where}`: num_workers may be among its positional arguments: no hints")
                continue
            keywords = {a.keyword.value: a for a in call.args if a.keyword is not None}
            new: dict[str, str] = {}
            reasons: list[str] = []
            kind: Optional[Kind] = None
            if "pin_memory" not in keywords:
                new["pin_memory"] = PIN
            workers = keywords.get("num_workers")
            literal = _int(workers.value) if workers is not None else 0
            has_workers = bool(literal)
            if workers is None or literal == 0:
                lambdas = [a for a in call.args if f.find_in(a.value, m.Lambda())]
                if f.function(call) is None or not guarded:
                    reasons.append(f"no num_workers: {SPAWN}; build and iterate the loader in a function "
                                   "called under `if __name__ == \"__main__\":` first")
                elif lambdas:
                    reasons.append(f"no num_workers: `{short(lambdas[0].value, 30)}` is a lambda, which "
                                   "workers started by spawn can't pickle")
                else:
                    new["num_workers"] = WORKERS
                    has_workers = True
                    drawn = _random_dataset(f, call, random_datasets)
                    if drawn:
                        kind = Kind.CHANGES_TRAINING
                        reasons.append(f"`{drawn}.__getitem__` draws random numbers: in workers they come "
                                       "from each worker's own seed")
            elif literal is None:
                reasons.append(f"num_workers={code(workers.value)} is not a literal: no persistent_workers")
            if has_workers and "persistent_workers" not in keywords:
                new["persistent_workers"] = "True"
                kind = Kind.CHANGES_TRAINING
            if not new:
                for reason in reasons:
                    ctx.skip(call, f"`{where}`: {reason}")
                continue
            listed = ", ".join(f"{k}={v}" for k, v in new.items())
            if not apply:
                ctx.skip(call, f"hint: `{where}` could load batches faster with {listed} (select AR404, "
                               "dataloader-hints, to apply)")
                continue
            set_keywords(ctx, call, new)
            added |= set(new)
            why = "; persistent workers draw one seed less an epoch, so later shuffles differ" \
                if "persistent_workers" in new else ""
            ctx.change(call, f"`{where}`: {listed}{why}", kind=kind)
            for reason in reasons:
                ctx.skip(call, f"`{where}`: {reason}")
        if "pin_memory" in added:
            ctx.edits.add_import("torch")
        if "num_workers" in added:
            ctx.edits.add_import("os")


def _int(node: cst.BaseExpression) -> Optional[int]:
    return int(node.value) if isinstance(node, cst.Integer) else None


def _main_guard(f: ScriptFacts) -> bool:
    return any(m.matches(s, m.If(test=m.Comparison(left=m.Name("__name__")))) for s in f.module.body)


def _random_dataset(f: ScriptFacts, call: cst.Call, random_datasets: list[str]) -> Optional[str]:
    """The class of ``random_datasets`` the loader's dataset is built from, when it is one; the
    first of them when the dataset can't be followed to its construction."""
    if not random_datasets:
        return None
    dataset = next((a.value for a in call.args if a.keyword is None or a.keyword.value == "dataset"), None)
    if isinstance(dataset, cst.Name):
        dataset = f.assigned_value(dataset) or dataset
    if isinstance(dataset, cst.Call):
        name = code(dataset.func).rsplit(".", 1)[-1]
        return name if name in random_datasets else None
    return random_datasets[0]


def _random_datasets(f: ScriptFacts) -> list[str]:
    """Classes of the script whose ``__getitem__`` draws random numbers."""
    out = []
    for fn in f.functions.values():
        if not isinstance(fn.node, cst.ClassDef):
            continue
        for item in fn.node.body.body:
            if isinstance(item, cst.FunctionDef) and item.name.value == "__getitem__":
                if any(any(q.startswith(RANDOM) for q in f.qualnames(c.func)) for c in m.findall(item, m.Call())):
                    out.append(fn.name)
    return out
