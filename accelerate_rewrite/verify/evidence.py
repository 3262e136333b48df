"""Whether a run shows what the rewrite was asked for (codemod-free, torch-free: read off the
runs' records): the precision it ran at, a trace of the low precision in every training step,
a gradient applied at every step the original applied one. What compare.py checks before any
figure is compared: a precision that did not run is not verified, never a pass or a fail."""

from __future__ import annotations

from typing import Optional

from accelerate_rewrite.verify.runner import RunRecord

#: the low precisions, and the dtype whose tensors show them in a training step's graph
HALF = {"16-mixed": "float16", "bf16-mixed": "bfloat16", "16-true": "float16", "bf16-true": "bfloat16"}


def precision_problem(requested: Optional[str], run: RunRecord) -> Optional[str]:
    """Why the requested precision did not run, if it did not."""
    if requested is None:
        return None
    actual = run.precision
    if actual == requested:
        return None
    hints = []
    if requested == "16-mixed" and actual == "bf16-mixed" and run.device == "cpu":
        hints.append("Fabric turns 16-mixed into bf16-mixed on CPU")
    if run.traced and requested in HALF and actual == "32-true" and any(on for _, _, on in run.autocast):
        hints.append(f"an autocast ran, but no training step's loss came from a {HALF[requested]} "
                     "graph: an autocast outside the training step (e.g. in evaluation) does not count")
    hints += run.precision_notes
    if requested != "32-true" and actual == "32-true" and not hints:
        hints.append("the rewritten script does not use it (see the rewrite's notes)")
    why = f" ({'; '.join(hints)})" if hints else ""
    return (f"{requested} was asked for, but the rewritten run used {actual}{why}; parity is not "
            "reported for a precision that did not run")


def unapplied(original: RunRecord, rewritten: RunRecord, n: int) -> Optional[str]:
    """A step of the rewritten run that applies no gradient where the original's applied one: not
    a figure to skip, whatever the precision hides in the losses (a ``zero_grad()`` moved between
    the backward and the step leaves the model untrained)."""
    for i in range(min(n, len(original.grad_norms), len(rewritten.grad_norms))):
        before, after = original.grad_norms[i], rewritten.grad_norms[i]
        if not before or (i + 1) in original.no_grad_steps:
            continue
        if (i + 1) in rewritten.no_grad_steps or after == 0.0:
            what = ("no parameter had a gradient when the optimizer stepped" if after is None
                    else "every gradient was zero when the optimizer stepped")
            return (f"the rewritten script applied no gradient at step {i + 1} (the original's norm "
                    f"{before:.4g}): {what} (a zero_grad() between the backward and the step?)")
    return None


def steps_text(steps: list[int]) -> str:
    shown = ", ".join(str(s) for s in steps[:5])
    return shown + (f" and {len(steps) - 5} more" if len(steps) > 5 else "")


def evidence_problem(requested: Optional[str], original: RunRecord, rewritten: RunRecord, n: int) -> Optional[str]:
    """A mixed or half precision must leave a trace in every training step, and change the
    rounding: losses bit-identical to an fp32 original's mean it did not run."""
    if requested not in HALF:
        return None
    if rewritten.traced and rewritten.untraced_steps:
        steps = rewritten.untraced_steps
        return (f"{requested} was asked for, but the loss of step(s) {steps_text(steps)} (of {n}) came "
                f"from a graph with no {HALF[requested]} tensor: the training step ran in fp32 there "
                "(an autocast disabled or left out around the forward); parity is not reported for a "
                "precision that did not run")
    if (n >= 2 and original.precision != requested and rewritten.losses[:n] == original.losses[:n]
            and rewritten.param_dtype in (None, "float32")):
        return (f"{requested} was asked for, but the losses are bit-identical to the fp32 original's "
                f"at every one of {n} steps: {requested} changes the rounding of every step, so it did "
                "not run in training; parity is not reported for a precision that did not run")
    return None
