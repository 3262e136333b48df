"""Compare two runs: tolerances set by what the rewrite does, and the verdict.

- keeps the math (32-true Fabric, API migrations): every step's loss, and the norm of the
  gradient it applies, within 1e-5 relative (CPU);
- approximate (mixed or low precision): the mean relative difference of the losses under 2e-2,
  the mean loss of the last 10 % of the steps within 3 % of the original's, and the mean
  relative difference of the gradient norms under 1e-1 (adjustable: --mean-rtol, --last-rtol,
  --grad-rtol). Gradients have their own, looser tolerance because mixed precision perturbs
  them more than the losses it feeds: every gradient element goes through the low-precision
  backward (bf16 keeps 8 bits of mantissa: a relative error of 2**-8 = 3.9e-3 per rounding,
  which accumulates over the layers), while a loss is a mean over many elements whose rounding
  errors cancel. A correct bf16 rewrite of a small CNN with dropout differs by ~2e-2 in the
  gradient norms with losses within 3e-3; the bugs this figure is there to catch (a loss not
  divided under accumulation, a gradient scaled twice, clipping lost) change it by 50 % or more;
- changes training (freezing, a larger effective batch, more processes): shown side by side,
  no pass/fail on the curves; a crash, a NaN or an inf still fails.

Parity is never reported for a precision that did not run.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from statistics import median
from typing import Optional

from accelerate_rewrite.verify.runner import RunRecord

EXACT, APPROXIMATE, CHANGES_TRAINING = "exact", "approximate", "changes-training"
PASS, FAIL, ERROR = "pass", "fail", "error"
EXIT_CODES = {PASS: 0, FAIL: 1, ERROR: 2}


@dataclass(frozen=True)
class Tolerance:
    kind: str = EXACT
    max_rel: float = 1e-5  # exact: every step
    mean_rel: float = 2e-2  # approximate: the mean over the steps
    last_rel: float = 3e-2  # approximate: the mean of the last 10 % of the steps
    grad_rel: float = 1e-1  # approximate: the mean over the steps of the gradient norms
    warmup_steps: Optional[int] = None  # steps left out of the timing (default: 10 %, at least 1)


@dataclass
class Verdict:
    verdict: str
    reason: str
    comparison: dict

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]


def rel_diffs(before: list, after: list) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for b, a in zip(before, after) if a is not None and b is not None]


def _median_time(times: list[float], warmup: int) -> Optional[float]:
    kept = times[warmup:] if len(times) > warmup else times[-1:]
    return median(kept) if kept else None


def _precision_problem(requested: Optional[str], run: RunRecord) -> Optional[str]:
    """Why the requested precision did not run, if it did not."""
    if requested is None:
        return None
    actual = run.precision
    if actual == requested:
        return None
    hints = []
    if requested == "16-mixed" and actual == "bf16-mixed" and run.device == "cpu":
        hints.append("Fabric turns 16-mixed into bf16-mixed on CPU")
    hints += run.precision_notes
    if requested != "32-true" and actual == "32-true" and not hints:
        hints.append("the rewritten script does not use it (see the rewrite's notes)")
    why = f" ({'; '.join(hints)})" if hints else ""
    return (f"{requested} was asked for, but the rewritten run used {actual}{why}; parity is not "
            "reported for a precision that did not run")


def compare(
    original: RunRecord,
    rewritten: RunRecord,
    tolerance: Tolerance,
    *,
    requested_precision: Optional[str] = None,
) -> Verdict:
    comparison: dict = {"tolerance": asdict(tolerance)}

    def verdict(kind: str, reason: str) -> Verdict:
        return Verdict(kind, reason, comparison)

    if not original.ok:
        return verdict(ERROR, f"the original script itself failed: {original.error}")
    if not original.losses:
        return verdict(ERROR, "the original script made no optimizer step with a backward "
                              "before it ended: nothing to compare (does it call loss.backward() "
                              "and optimizer.step()?)")
    if all(x is None for x in original.losses):
        return verdict(ERROR, "the original script steps its optimizer without calling backward "
                              "(gradients from torch.autograd.grad?): the verifier records losses "
                              "at backward, so there is nothing to compare")
    bad = [i for i, x in enumerate(original.losses) if x is not None and not math.isfinite(x)]
    if bad:
        finite = rewritten.ok and rewritten.losses and all(
            x is not None and math.isfinite(x) for x in rewritten.losses)
        after = (f" (the rewritten run's losses stay finite over its {len(rewritten.losses)} steps)"
                 if finite else "")
        return verdict(ERROR, f"the original itself does not train: its loss is {original.losses[bad[0]]} "
                              f"at step {bad[0] + 1}{after}; there is nothing to compare the rewrite with")
    if not rewritten.ok:
        return verdict(FAIL, f"the rewrite broke the script: it failed where the original ran: "
                             f"{rewritten.error}")
    if not rewritten.losses:
        return verdict(FAIL, "the rewritten script made no optimizer step (the original made "
                             f"{len(original.losses)})")
    problem = _precision_problem(requested_precision, rewritten)
    if problem is not None:
        return verdict(ERROR, problem)

    n = min(len(original.losses), len(rewritten.losses))
    diffs = rel_diffs(original.losses[:n], rewritten.losses[:n])
    grad_diffs = rel_diffs(original.grad_norms[:n], rewritten.grad_norms[:n])
    warmup = tolerance.warmup_steps if tolerance.warmup_steps is not None else max(1, n // 10)
    t_before = _median_time(original.step_times_s, warmup)
    t_after = _median_time(rewritten.step_times_s, warmup)
    comparison.update(
        steps=n,
        max_rel_diff=max(diffs) if diffs else None,
        mean_rel_diff=sum(diffs) / len(diffs) if diffs else None,
        speedup=(t_before / t_after) if t_before and t_after else None,
        memory_ratio=(original.peak_memory_bytes / rewritten.peak_memory_bytes)
        if rewritten.peak_memory_bytes else None,
        max_grad_norm_rel_diff=max(grad_diffs) if grad_diffs else None,
        mean_grad_norm_rel_diff=sum(grad_diffs) / len(grad_diffs) if grad_diffs else None,
        warmup_steps=warmup,
    )
    missing = [i for i in range(n) if original.losses[i] is not None and rewritten.losses[i] is None]
    if missing:
        return verdict(FAIL, f"the rewritten script's step {missing[0] + 1} came with no backward call "
                             "(the original's did)")
    bad = [i for i, x in enumerate(rewritten.losses) if x is not None and not math.isfinite(x)]
    if bad:
        return verdict(FAIL, f"the {rewritten.label} run's loss is {rewritten.losses[bad[0]]} at step "
                             f"{bad[0] + 1}")
    if tolerance.kind == CHANGES_TRAINING:
        processes = (f"; the rewritten run used {rewritten.world_size} processes, each with its "
                     f"share of the data ({len(rewritten.losses)} steps against {len(original.losses)})"
                     if rewritten.world_size > original.world_size else "")
        return verdict(PASS, "this rewrite changes training on purpose (a larger effective batch, "
                             "frozen layers, clipping, a fixed GradScaler, more processes): the "
                             "curves are shown side by side, not compared; both ran without error, "
                             f"NaN or inf{processes}")
    if len(rewritten.losses) < len(original.losses):
        return verdict(FAIL, f"the rewritten script stopped after {len(rewritten.losses)} steps, "
                             f"the original ran {len(original.losses)}")
    if tolerance.kind == EXACT:
        first = next((i for i, d in enumerate(diffs) if d > tolerance.max_rel), None)
        if first is not None:
            return verdict(FAIL, f"the losses differ from step {first + 1} on: "
                                 f"{rewritten.losses[first]:.6g} instead of {original.losses[first]:.6g} "
                                 f"(relative {diffs[first]:.2e}, allowed {tolerance.max_rel:g} for a "
                                 "rewrite that keeps the math)")
        first = next((i for i, d in enumerate(grad_diffs) if d > tolerance.max_rel), None)
        if first is not None:
            return verdict(FAIL, f"the losses agree, but the gradient applied at step {first + 1} "
                                 f"differs: norm {rewritten.grad_norms[first]:.6g} instead of "
                                 f"{original.grad_norms[first]:.6g} (relative {grad_diffs[first]:.2e}); "
                                 "a loss scaled differently (e.g. not divided under accumulation) "
                                 "changes the gradient while Adam's steps, and so the losses, hide it")
        return verdict(PASS, f"identical within {tolerance.max_rel:g} relative at every one of "
                             f"{n} steps (losses and gradient norms)")
    tail = max(1, n // 10)
    last_before = sum(original.losses[n - tail:n]) / tail
    last_after = sum(rewritten.losses[n - tail:n]) / tail
    last_rel = abs(last_after - last_before) / max(abs(last_before), 1e-12)
    comparison["last_rel_diff"] = last_rel
    mean_rel = comparison["mean_rel_diff"]
    mean_grad = comparison["mean_grad_norm_rel_diff"]
    if mean_grad is not None and mean_grad > tolerance.grad_rel:
        return verdict(FAIL, f"the gradients the steps apply differ by {mean_grad:.2e} on average "
                             f"(norms), over the {tolerance.grad_rel:g} allowed for "
                             f"{rewritten.precision} (--grad-rtol)")
    if mean_rel > tolerance.mean_rel:
        return verdict(FAIL, f"the losses differ by {mean_rel:.2e} on average, over the "
                             f"{tolerance.mean_rel:g} allowed for {rewritten.precision} (--mean-rtol)")
    if last_rel > tolerance.last_rel:
        return verdict(FAIL, f"the last {tail} step(s) differ by {last_rel:.2%} on average, over the "
                             f"{tolerance.last_rel:.0%} allowed (--last-rtol)")
    grads = (f", gradient norms {mean_grad:.2e} (allowed {tolerance.grad_rel:g})"
             if mean_grad is not None else "")
    return verdict(PASS, f"{rewritten.precision} within tolerance: mean relative difference "
                         f"{mean_rel:.2e} (allowed {tolerance.mean_rel:g}), last {tail} step(s) "
                         f"{last_rel:.2%} (allowed {tolerance.last_rel:.0%}){grads}")
