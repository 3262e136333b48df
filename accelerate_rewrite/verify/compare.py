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
- changes training (freezing, clipping, a larger effective batch, more processes): checked
  against what it claims where the verifier can (--freeze: the frozen parameters bitwise
  unchanged, the others moved, the first loss the original's; --clip-grad-norm: no applied
  gradient above the norm, the steps before clipping first acts the original's); what can't
  be checked that way is "not compared" (exit 3) unless the curves agree anyway.

Verdicts, each with its own meaning and exit code (``EXIT_CODES``): pass (0) only for measured
parity or a checked claim; fail (1): a mismatch, or the rewritten script crashed where the
original ran; error (2): the original itself failed or timed out; not verified (2): this
machine can't run what the options need, the precision asked for left no trace in the training
steps, or a strategy was substituted; not compared (3); data order changed (4): a
DistributedSampler in the rewritten run draws the batches in another order.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, replace
from statistics import median
from typing import Optional

from accelerate_rewrite.verify.claims import check_clip, check_freeze, clip_problem
from accelerate_rewrite.verify.environment import machine_failure
from accelerate_rewrite.verify.evidence import evidence_problem, precision_problem, steps_text, unapplied
from accelerate_rewrite.verify.runner import RunRecord
from accelerate_rewrite.verify.where import parting, static_differences

EXACT, APPROXIMATE, CHANGES_TRAINING = "exact", "approximate", "changes-training"
PASS, FAIL, ERROR = "pass", "fail", "error"
NOT_VERIFIED, NOT_COMPARED, DATA_ORDER = "not-verified", "not-compared", "data-order-changed"
EXIT_CODES = {PASS: 0, FAIL: 1, ERROR: 2, NOT_VERIFIED: 2, NOT_COMPARED: 3, DATA_ORDER: 4}
LABELS = {PASS: "PASS", FAIL: "FAIL", ERROR: "ERROR", NOT_VERIFIED: "NOT VERIFIED",
          NOT_COMPARED: "NOT COMPARED", DATA_ORDER: "DATA ORDER CHANGED (distributed sampler)"}


@dataclass(frozen=True)
class Tolerance:
    kind: str = EXACT
    max_rel: float = 1e-5  # exact: every step
    mean_rel: float = 2e-2  # approximate: the mean over the steps
    last_rel: float = 3e-2  # approximate: the mean of the last 10 % of the steps
    grad_rel: float = 1e-1  # approximate: the mean over the steps of the gradient norms
    warmup_steps: Optional[int] = None  # steps left out of the timing (default: 10 %, at least 1)
    #: with a noise run (the original under the precision, issue 27.1): the approximate figures
    #: may be this many times the precision's own effect on the script (``measured``)
    noise_multiple: float = 3.0
    #: the approximate tolerances the user set (--mean-rtol, --last-rtol, --grad-rtol): kept
    fixed: tuple[str, ...] = ()


#: the least a measured tolerance allows: a precision whose own effect on a script is tiny still
#: rounds (bf16 keeps 8 bits: one rounding is 3.9e-3 relative), and two runs of it differ by
#: about as much as one differs from fp32
NOISE_MINIMUM = {"mean_rel": 2e-3, "last_rel": 3e-3, "grad_rel": 1e-2}


@dataclass(frozen=True)
class Claims:
    """What a rewrite that changes training says it does, for the checks that can hold it to it.

    ``basis``: how the steps compare where they should agree (exact, or approximate under a
    mixed precision); ``unchecked``: the changes no check covers (each said in words)."""

    basis: str = EXACT
    freeze: tuple[str, ...] = ()
    clip_grad_norm: Optional[float] = None
    unchecked: tuple[str, ...] = ()


@dataclass
class Verdict:
    verdict: str
    reason: str
    comparison: dict

    @property
    def exit_code(self) -> int:
        return EXIT_CODES[self.verdict]

    @property
    def label(self) -> str:
        return LABELS[self.verdict]


def rel_diffs(before: list, after: list) -> list[float]:
    return [abs(a - b) / max(abs(b), 1e-12) for b, a in zip(before, after) if a is not None and b is not None]


def noise_floor(original: RunRecord, noise: RunRecord) -> Optional[dict]:
    """The difference the precision alone makes to this script: the original run once more with
    its modules' forwards under the precision (harness ``autocast_forward``), against the original.
    None where that run failed or made no step."""
    if not original.ok or not noise.ok or not noise.losses or not original.losses:
        return None
    n = min(len(original.losses), len(noise.losses))
    diffs = rel_diffs(original.losses[:n], noise.losses[:n])
    grads = rel_diffs(original.grad_norms[:n], noise.grad_norms[:n])
    if not diffs:
        return None
    tail = max(1, n // 10)
    last = [x for x in original.losses[n - tail:n] if x is not None]
    last_noise = [x for x in noise.losses[n - tail:n] if x is not None]
    last_rel = None
    if last and len(last) == len(last_noise):
        before, after = sum(last) / len(last), sum(last_noise) / len(last_noise)
        last_rel = abs(after - before) / max(abs(before), 1e-12)
    return {"label": noise.label, "steps": n, "mean_rel": sum(diffs) / len(diffs), "max_rel": max(diffs),
            "last_rel": last_rel, "grad_rel": sum(grads) / len(grads) if grads else None}


def measured(tolerance: Tolerance, noise: dict) -> Tolerance:
    """The approximate tolerances a noise floor sets: ``noise_multiple`` times the precision's
    own effect, at least ``NOISE_MINIMUM``; those the user set stay. The last steps' mean is one
    figure, not a mean over steps, so it may differ by as much as a step does."""
    own = {"mean_rel": noise.get("mean_rel"), "grad_rel": noise.get("grad_rel"),
           "last_rel": max(noise.get("last_rel") or 0.0, noise.get("mean_rel") or 0.0)}
    changes = {k: max(tolerance.noise_multiple * v, NOISE_MINIMUM[k]) for k, v in own.items()
               if v is not None and k not in tolerance.fixed}
    return replace(tolerance, **changes)


def median_time(times: list[float], warmup: int) -> Optional[float]:
    kept = times[warmup:] if len(times) > warmup else times[-1:]
    return median(kept) if kept else None


def last_line(error: Optional[str]) -> str:
    lines = [line.strip() for line in (error or "").splitlines() if line.strip()]
    return lines[-1] if lines else ""


def _step_diffs(before: list[Optional[float]], after: list[Optional[float]]) -> list[tuple[int, float]]:
    """(step index, relative difference) of the steps where both runs have the figure."""
    return [(i, abs(a - b) / max(abs(b), 1e-12)) for i, (b, a) in enumerate(zip(before, after))
            if a is not None and b is not None]


def _exact_problem(original: RunRecord, rewritten: RunRecord, diffs, grad_diffs,
                   tolerance: Tolerance, clip_diffs: list[tuple[int, float]] = ()) -> Optional[str]:
    """The first step where the losses or the applied gradients part ways (whichever is first:
    a lost zero_grad changes the gradient of step 2 and the loss only from step 3), or the
    gradients measured before clipping. Where the records show it (issue 48), the first module
    or parameter group whose gradient or update differs, and how (``where.parting``)."""
    first = next((i for i, d in enumerate(diffs) if d > tolerance.max_rel), None)
    first_grad = next((i for i, d in enumerate(grad_diffs) if d > tolerance.max_rel), None)
    first_clip = next((i for i, d in clip_diffs if d > tolerance.max_rel), None)
    if first is None and first_grad is None and first_clip is None:
        return None
    part = parting(original, rewritten, tolerance.max_rel, min(len(original.losses), len(rewritten.losses)))
    where = f"; where the runs part: {part.text}" if part is not None else ""
    if first_clip is not None and all(x is None or first_clip < x for x in (first, first_grad)):
        return clip_problem(original, rewritten, clip_diffs, tolerance.max_rel, "--rtol",
                            where=part.text if part is not None else None)
    if first_grad is not None and (first is None or first_grad < first):
        losses = ("the losses agree" if first is None else
                  f"the losses agree until step {first}")
        hint = where or ("; a loss scaled differently (e.g. not divided under accumulation), or gradients left "
                         "from the previous step, change the gradient while the losses follow only a step "
                         "later, or not at all under Adam")
        return (f"{losses}, but the gradient applied at step {first_grad + 1} "
                f"differs: norm {rewritten.grad_norms[first_grad]:.6g} instead of "
                f"{original.grad_norms[first_grad]:.6g} (relative {grad_diffs[first_grad]:.2e}, allowed "
                f"{tolerance.max_rel:g}: --rtol){hint}")
    return (f"the losses differ from step {first + 1} on: "
            f"{rewritten.losses[first]:.6g} instead of {original.losses[first]:.6g} "
            f"(relative {diffs[first]:.2e}, allowed {tolerance.max_rel:g} for a "
            f"rewrite that keeps the math: --rtol){where}")


def _noise_words(noise: dict, precision: Optional[str]) -> tuple[str, str]:
    """(what the noise run's effect is called, that run in words): a precision's own by default,
    the several processes' probe where it says (verify/shards.py)."""
    return noise.get("effect") or str(precision), noise.get("run") or f"the original under {precision} autocast"


def _allowed(tolerance: Tolerance, key: str, flag: str, precision: Optional[str],
             noise: Optional[dict]) -> str:
    """Where an approximate tolerance comes from, in words."""
    value = getattr(tolerance, key)
    if noise is None or key in tolerance.fixed:
        return f"the {value:g} allowed for {precision} ({flag})"
    own = max(noise.get(key) or 0.0, noise.get("mean_rel") or 0.0) if key == "last_rel" else noise.get(key) or 0.0
    effect, run = _noise_words(noise, precision)
    if value <= NOISE_MINIMUM[key] and tolerance.noise_multiple * own < NOISE_MINIMUM[key]:
        return f"the {value:.2g} allowed at least for {effect} ({run} differs by {own:.2e}; {flag})"
    return (f"the {value:.2g} allowed ({tolerance.noise_multiple:g}x the {own:.2e} that {effect} "
            f"alone makes to the original: --noise-multiple, {flag})")


def _approximate_problem(original: RunRecord, rewritten: RunRecord, comparison: dict, tolerance: Tolerance,
                         n: int, clip_diffs: list[tuple[int, float]] = (),
                         noise: Optional[dict] = None) -> tuple[Optional[str], str]:
    """(why the approximate comparison fails, or None; what it measured)."""
    tail = max(1, n // 10)
    last_before = sum(original.losses[n - tail:n]) / tail
    last_after = sum(rewritten.losses[n - tail:n]) / tail
    last_rel = abs(last_after - last_before) / max(abs(last_before), 1e-12)
    comparison["last_rel_diff"] = last_rel
    mean_rel = comparison["mean_rel_diff"]
    mean_grad = comparison["mean_grad_norm_rel_diff"]
    precision = rewritten.precision

    def allowed(key: str, flag: str) -> str:
        return _allowed(tolerance, key, flag, precision, noise)

    mean_clip = comparison.get("mean_clip_norm_rel_diff")
    if mean_clip is not None and mean_clip > tolerance.grad_rel:
        return clip_problem(original, rewritten, [(i, d) for i, d in clip_diffs if d > tolerance.grad_rel],
                             tolerance.grad_rel, f"--grad-rtol; {mean_clip:.2e} on average over the steps"), ""
    if mean_grad is not None and mean_grad > tolerance.grad_rel:
        return (f"the gradients the steps apply differ by {mean_grad:.2e} on average (norms; max "
                f"{comparison['max_grad_norm_rel_diff']:.2e}), over {allowed('grad_rel', '--grad-rtol')}: "
                "a loss scaled differently or a step's gradient changed"), ""
    if mean_rel > tolerance.mean_rel:
        return (f"the losses differ by {mean_rel:.2e} on average (max {comparison['max_rel_diff']:.2e}), "
                f"over {allowed('mean_rel', '--mean-rtol')}"), ""
    if last_rel > tolerance.last_rel:
        return (f"the last {tail} step(s) differ by {last_rel:.2%} on average, over "
                f"{allowed('last_rel', '--last-rtol')}"), ""
    if noise is not None:
        own = [(mean_rel, noise.get("mean_rel")), (mean_grad, noise.get("grad_rel"))]
        ratios = [a / b for a, b in own if a is not None and b]
        grads = (f", gradient norms {mean_grad:.2e} against {noise['grad_rel']:.2e}"
                 if mean_grad is not None and noise.get("grad_rel") is not None else "")
        effect, run = _noise_words(noise, precision)
        own_effect = f"{effect}'s own effect"
        within = (f"within {max(ratios):.1f}x of {own_effect} on this script" if ratios
                  else f"within {own_effect} on this script")
        return None, (f"{within} (mean relative difference of the losses {mean_rel:.2e} against "
                      f"{noise['mean_rel']:.2e} for {run}{grads}; "
                      f"allowed {tolerance.noise_multiple:g}x, at least {NOISE_MINIMUM['mean_rel']:g})")
    grads = (f", gradient norms {mean_grad:.2e} (allowed {tolerance.grad_rel:g})"
             if mean_grad is not None else "")
    return None, (f"mean relative difference {mean_rel:.2e} (allowed {tolerance.mean_rel:g}), last {tail} "
                  f"step(s) {last_rel:.2%} (allowed {tolerance.last_rel:.0%}){grads}")


def _scaler_settling(original: RunRecord, rewritten: RunRecord, diffs: list[float], n: int,
                     tolerance: Tolerance) -> Optional[tuple[str, str]]:
    """(verdict, reason) where the curves part and the rewritten run's GradScaler skipped steps
    the fp32 original made: at 16-mixed, gradients that overflow fp16 at the starting scale
    (65536) make it skip and halve the scale until they fit. That is what 16-mixed does, not a
    bug in the rewrite, and the runs part at the first skip by design: the steps before it are
    compared, the rest is NOT COMPARED. A scaler that skips every step from some step on never
    settles: a FAIL. (A bug in the rewrite's structure fails earlier, at the structure run.)"""
    skipped = [s for s in rewritten.skipped_steps if s <= n and s not in original.skipped_steps]
    if not skipped or skipped[0] >= n:
        return None
    first = skipped[0]
    steps = f"step(s) {steps_text(skipped)} of {n}"
    if all(g is None for g in rewritten.grad_norms[first:n]):
        return FAIL, (f"the GradScaler skipped every step from step {first} on ({steps}): its loss scale "
                      "never settles (gradients that overflow fp16 at any scale, or a scale that is never "
                      "lowered), so the rewritten run does not train")
    head = diffs[:first]  # the losses up to the first skipped step came before the runs could part
    worst = max(head) if head else 0.0
    if worst > tolerance.mean_rel:
        i = next(i for i, d in enumerate(head) if d > tolerance.mean_rel)
        return FAIL, (f"before the GradScaler's first skipped step ({first}), the loss of step {i + 1} already "
                      f"differs: {rewritten.losses[i]:.6g} instead of {original.losses[i]:.6g} (relative "
                      f"{head[i]:.2e}, allowed {tolerance.mean_rel:g}: --mean-rtol)")
    return NOT_COMPARED, (f"the rewritten run's GradScaler skipped {steps} (fp16 gradients overflowed while "
                          f"its loss scale settled; the fp32 original updated at those steps), so the curves "
                          f"part there by design: the loss(es) of step(s) 1..{first}, before the first skip, "
                          f"agree within {worst:.2e} (allowed {tolerance.mean_rel:g}); both ran without error, "
                          "NaN or inf. A loss that is a sum rather than a mean (large gradients) makes the "
                          "scale settle for longer; bf16-mixed needs no scaler")


def _curves_also(original: RunRecord, rewritten: RunRecord, comparison: dict, tolerance: Tolerance, n: int,
                 clip_diffs: list[tuple[int, float]], noise: Optional[dict]) -> str:
    """'; and the curves differ ...' where a precision that did not run is reported, but the
    curves also differ by more than the precision asked for could explain (issue 27.4): a
    second finding the first must not hide."""
    if tolerance.kind == CHANGES_TRAINING or comparison.get("mean_rel_diff") is None:
        return ""
    if n == 0 or None in original.losses[:n] or None in rewritten.losses[:n]:
        return ""
    if noise is not None:
        tolerance = measured(tolerance, noise)
    why, _ = _approximate_problem(original, rewritten, dict(comparison), tolerance, n, clip_diffs, noise)
    if why is None:
        return ""
    return f"; and the curves differ beyond what the precision could explain: {why}"


def compare(
    original: RunRecord,
    rewritten: RunRecord,
    tolerance: Tolerance,
    *,
    requested_precision: Optional[str] = None,
    claims: Optional[Claims] = None,
    noise: Optional[dict] = None,  # noise_floor(): the precision's own effect on the original
) -> Verdict:
    comparison: dict = {"tolerance": asdict(tolerance)}
    claims = claims or Claims(basis=APPROXIMATE if tolerance.kind == APPROXIMATE else EXACT)

    def verdict(kind: str, reason: str) -> Verdict:
        return Verdict(kind, reason, comparison)

    if not original.ok:
        return verdict(ERROR, f"the original script itself failed: {original.error}")
    # a crash of the rewritten script comes first: whatever else the original did
    if not rewritten.ok:
        made = "" if original.losses else "; it made no optimizer step, so nothing else could be compared"
        needs = machine_failure(rewritten.error)
        if needs is not None:
            return verdict(NOT_VERIFIED, f"needs {needs}: the rewritten script stopped with "
                                         f"{last_line(rewritten.error)} (this machine can't run it; the "
                                         f"rewrite itself is not in question):\n{rewritten.error}")
        if rewritten.timed_out:
            return verdict(FAIL, f"the rewritten script {rewritten.error}, where the original ran to "
                                 f"its end{made}")
        return verdict(FAIL, f"the rewrite broke the script: {last_line(rewritten.error)} (the original "
                             f"ran without error{made}):\n{rewritten.error}")
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
    if not rewritten.losses:
        return verdict(FAIL, "the rewritten script made no optimizer step (the original made "
                             f"{len(original.losses)})")
    n = min(len(original.losses), len(rewritten.losses))
    diffs = rel_diffs(original.losses[:n], rewritten.losses[:n])
    grad_diffs = rel_diffs(original.grad_norms[:n], rewritten.grad_norms[:n])
    clip_diffs = _step_diffs(original.clip_norms[:n], rewritten.clip_norms[:n])
    warmup = tolerance.warmup_steps if tolerance.warmup_steps is not None else max(1, n // 10)
    t_before = median_time(original.step_times_s, warmup)
    t_after = median_time(rewritten.step_times_s, warmup)
    comparison.update(
        steps=n,
        max_rel_diff=max(diffs) if diffs else None,
        mean_rel_diff=sum(diffs) / len(diffs) if diffs else None,
        speedup=(t_before / t_after) if t_before and t_after else None,
        # original / rewritten (kept for existing readers); rewritten_memory_x is the clear one
        memory_ratio=(original.peak_memory_bytes / rewritten.peak_memory_bytes)
        if rewritten.peak_memory_bytes else None,
        rewritten_memory_x=(rewritten.peak_memory_bytes / original.peak_memory_bytes)
        if original.peak_memory_bytes and rewritten.peak_memory_bytes else None,
        max_grad_norm_rel_diff=max(grad_diffs) if grad_diffs else None,
        mean_grad_norm_rel_diff=sum(grad_diffs) / len(grad_diffs) if grad_diffs else None,
        max_clip_norm_rel_diff=max(d for _, d in clip_diffs) if clip_diffs else None,
        mean_clip_norm_rel_diff=sum(d for _, d in clip_diffs) / len(clip_diffs) if clip_diffs else None,
        warmup_steps=warmup,
    )
    problem = precision_problem(requested_precision, rewritten)
    if problem is not None:
        return verdict(NOT_VERIFIED, problem + _curves_also(original, rewritten, comparison, tolerance, n,
                                                            clip_diffs, noise))
    missing = [i for i in range(n) if original.losses[i] is not None and rewritten.losses[i] is None]
    if missing:
        return verdict(FAIL, f"the rewritten script's step {missing[0] + 1} came with no backward call "
                             "(the original's did)")
    bad = [i for i, x in enumerate(rewritten.losses) if x is not None and not math.isfinite(x)]
    if bad:
        return verdict(FAIL, f"the {rewritten.label} run's loss is {rewritten.losses[bad[0]]} at step "
                             f"{bad[0] + 1}")
    why = unapplied(original, rewritten, n)
    if why is not None:
        return verdict(FAIL, why)
    problem = evidence_problem(requested_precision, original, rewritten, n)
    if problem is not None:
        return verdict(NOT_VERIFIED, problem + _curves_also(original, rewritten, comparison, tolerance, n,
                                                            clip_diffs, noise))

    # how the steps compare: the tolerance's kind, or for a change of training its claims' basis
    basis = claims.basis if tolerance.kind == CHANGES_TRAINING else tolerance.kind
    comparison["basis"] = basis
    if basis == APPROXIMATE and noise is not None:
        tolerance = measured(tolerance, noise)
        comparison.update(tolerance=asdict(tolerance), noise=noise)
    else:
        noise = None

    def parity() -> tuple[Optional[str], str]:
        """(why the curves are not at parity, or None; what was measured)."""
        if len(rewritten.losses) < len(original.losses):
            return (f"the rewritten script stopped after {len(rewritten.losses)} steps, "
                    f"the original ran {len(original.losses)}"), ""
        if basis == EXACT:
            why = _exact_problem(original, rewritten, diffs, grad_diffs, tolerance, clip_diffs)
            clipped = ", and before clipping" if clip_diffs else ""
            return why, (f"identical within {tolerance.max_rel:g} relative at every one of {n} steps "
                         f"(losses and gradient norms{clipped})")
        return _approximate_problem(original, rewritten, comparison, tolerance, n, clip_diffs, noise)

    if tolerance.kind == CHANGES_TRAINING:
        checked, unchecked = [], list(claims.unchecked)
        # the same samples in the same order: the first step (and, with clipping, those before it
        # acts) can be held to the original's
        same_data = not _data_order(original, rewritten) and rewritten.world_size == original.world_size
        if claims.freeze:
            why, what = check_freeze(claims.freeze, original, rewritten)
            if why is not None:
                return verdict(FAIL, why)
            if what:
                checked.append(what)
            else:
                unchecked.append("--freeze (the parameters were not recorded)")
            first_ok = (diffs[0] <= tolerance.max_rel) if claims.basis == EXACT else diffs[0] <= tolerance.mean_rel
            if same_data and not first_ok:
                return verdict(FAIL, f"the first step's loss, before any parameter was updated, differs: "
                                     f"{rewritten.losses[0]:.6g} instead of {original.losses[0]:.6g} "
                                     f"(relative {diffs[0]:.2e}): freezing can't change the first forward")
        if claims.clip_grad_norm is not None:
            why, what, _ = check_clip(claims.clip_grad_norm, original, rewritten,
                                      exact=claims.basis == EXACT and same_data and not claims.freeze)
            if why is not None:
                return verdict(FAIL, why)
            checked.append(what)
        if not claims.freeze and claims.clip_grad_norm is None and not unchecked:
            unchecked.append("the rewrite changes training on purpose")
        if not unchecked:
            return verdict(PASS, "checked against what the rewrite claims: " + "; ".join(checked))
        why, what = parity()
        if why is None and rewritten.world_size == original.world_size:
            return verdict(PASS, f"{what}, although the rewrite may change training "
                                 f"({'; '.join(unchecked)})")
        order = _data_order(original, rewritten)
        processes = (f"; the rewritten run used {rewritten.world_size} processes, each with its "
                     f"share of the data ({len(rewritten.losses)} steps against {len(original.losses)})"
                     if rewritten.world_size > original.world_size else "")
        done = f"; checked: {'; '.join(checked)}" if checked else ""
        return verdict(NOT_COMPARED, f"the rewrite changes training on purpose "
                                     f"({'; '.join(unchecked)}){order}: the curves are shown side by side; "
                                     f"both ran without error, NaN or inf{processes}{done}")
    why, what = parity()
    if why is not None and _data_order(original, rewritten) and rewritten.world_size == 1:
        return verdict(DATA_ORDER, "the rewritten run draws its "
                                   "batches through a DistributedSampler, in another order than the "
                                   f"original's ({_data_order(original, rewritten).lstrip('; ')}), so the "
                                   "steps see other samples and are not compared one by one; both ran "
                                   f"without error, NaN or inf (first loss {rewritten.losses[0]:.6g} against "
                                   f"{original.losses[0]:.6g}). Without --strategy ddp on one device the "
                                   "order stays the script's")
    settling = _scaler_settling(original, rewritten, diffs, n, tolerance) if why and basis == APPROXIMATE else None
    if settling is not None:  # the curves part where a GradScaler skipped steps: by design
        return verdict(*settling)
    if why is not None:
        if basis == APPROXIMATE:  # within a tolerance: what the records show differs whatever the figures
            facts = static_differences(original, rewritten)
            if facts:
                why += f"; the records show: {'; '.join(facts)}"
        return verdict(FAIL, why)
    if basis == EXACT:
        return verdict(PASS, what)
    if "noise" in comparison:  # "within 1.3x of bf16-mixed's own effect on this script (...)"
        return verdict(PASS, what)
    return verdict(PASS, f"{rewritten.precision} within tolerance: {what}")


def _data_order(original: RunRecord, rewritten: RunRecord) -> str:
    """'; a DistributedSampler (...)' where the rewritten run drew through one and the original did not."""
    if not rewritten.distributed_samplers or original.distributed_samplers:
        return ""
    replicas, shuffle = rewritten.distributed_samplers[0]
    return (f"; a DistributedSampler over {replicas} replica(s), shuffle={shuffle}, orders the data")
