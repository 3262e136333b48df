"""Several processes held to the original (issue 61): the original run on the batches the
processes drew together.

Under DDP (Fabric's, Accelerate's) each of N processes computes its loss on its own batch of B
samples, and the gradients are averaged over the processes: with a loss that is a mean over its
batch, a step is the step the original makes on the N x B samples of the processes' batches
together. So the rewritten run records each process's batches (their sample indices:
harness_shards.py), and the original runs once more with its loaders drawing, pass by pass,
those batches joined (rank 0's, then rank 1's...), and ``len(loader)`` saying each process's
count of batches, as it said to each process (a schedule sized by it: its steps are the
processes'). Its losses and gradients are what the processes' averaged ones must be.

What else differs is what the processes draw at random: each process runs the script's own
seed, so its dropout masks and augmentations are not those the original draws for the joined
batch. The original runs a third time on the same batches with everything seeded again after
the first step, and another thread count (which sums in another order, as the processes' averaged
gradients do): how far that moves it is the tolerance's floor (``noise_multiple`` times it, as
for a precision's own effect). Where it moves no step by more than ``ORDER_ONLY`` the steps draw
nothing at random, and the rewrite is held to the tolerance its options set, its exact figure
widened to ``ORDER_MULTIPLE`` times the move, at most ``ORDER_ONLY`` (a chaotic run grows a
difference of summation order).

Not compared, with the reason: a BatchNorm in training (each process normalises over its own
batch; SyncBatchNorm would not), passes the processes did not all make alike (one process
evaluating alone), batches that are not lists of indices (an iterable dataset), and a first
step whose loss is N times the processes' (a loss summed over its batch: the averaged gradient
is 1/N of the original's, a change of training).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

from accelerate_rewrite.verify.runner import RunRecord

#: the recorded batches of a pass, per process: the steps asked for times the micro-batches of
#: a step, and what a loader's workers fetch ahead
AHEAD = 64
#: the seed of the run with other random draws
RESEED = 1_000_003
#: between ``noise_multiple`` and this many times it, what a reseed changes: not compared (each
#: process's draws, from the same seed, are correlated as no reseed of the original makes them)
GREY = 10 / 3
REPLAY_LABEL = "original on the {n} processes' batches"
RESEED_LABEL = "original on the {n} processes' batches, reseeded, another thread count"
#: a probe that moved no step by more than this changed the summation order, not what was drawn
ORDER_ONLY = 1e-3
#: how far the exact figure widens for another summation order: a chaotic run grows such a
#: difference by orders of magnitude from one order to the next (measured: scheduled_optim's
#: probe moved step 12 by 5.3e-6, the 2 processes by 5.7e-5); a planted lr x1.1 moves step 2 by 1e-2
ORDER_MULTIPLE = 100.0


def other_threads(threads: Optional[int]) -> int:
    """The thread count of the probe: another than the runs', so that it sums in another order."""
    return 2 if (threads or os.cpu_count() or 1) <= 1 else 1


def batches_to_record(steps: int, accumulate: Optional[int]) -> int:
    return steps * max(1, accumulate or 1) + AHEAD


def union(sampled: list[list[dict]]) -> list[dict]:
    """Pass by pass, the batches the processes drew together: batch k of a pass is every rank's
    batch k, joined in rank order. A pass counts while every process made it over a dataset of
    the same length; its batches while every process's has the same size (their mean losses
    then average to the joined batch's); the passes stop at the first that differs."""
    passes: list[dict] = []
    for entries in zip(*sampled):
        if any(e["batches"] is None for e in entries) or len({e["length"] for e in entries}) > 1:
            break
        batches = []
        for parts in zip(*(e["batches"] for e in entries)):
            if len({len(p) for p in parts}) > 1:
                break
            batches.append([i for part in parts for i in part])
        counts = {e.get("count") for e in entries}
        passes.append({"length": entries[0]["length"], "batch_size": entries[0].get("batch_size"),
                       "count": counts.pop() if len(counts) == 1 else None, "batches": batches})
    return passes


def why_not(rewritten: RunRecord) -> Optional[str]:
    """Why the processes can't be held to the original on their joined batches (None: they can)."""
    if rewritten.batch_norm_trained:
        return ("a BatchNorm normalised the training batches, each process over its own batch, not over the "
                "processes' batches together (SyncBatchNorm would)")
    if not rewritten.sampled:
        return "the processes' batches were not recorded"
    passes = union(rewritten.sampled)
    if not passes or not any(p["batches"] for p in passes):
        return ("the processes' loaders drew no batches of sample indices that they all drew alike "
                "(an iterable dataset, or loaders of their own)")
    return None


def same_samples(sampled: list[list[dict]]) -> Optional[str]:
    """Where the processes drew the same samples in a pass they trained on (the first batches of
    each hold mostly the same indices): the data is not shared between them."""
    for number, entries in enumerate(zip(*sampled), 1):
        if not entries[0].get("steps") or any(not e["batches"] for e in entries):
            continue
        drawn = [{i for batch in e["batches"][:3] for i in batch} for e in entries]
        shared = set.intersection(*drawn)
        if shared and 2 * len(shared) >= min(len(d) for d in drawn):
            return (f"the {len(entries)} processes drew the same samples: the first batches of training pass "
                    f"{number} hold {len(shared)} of their {min(len(d) for d in drawn)} samples in every "
                    "process, so the data is not shared between them and each trains on the whole set "
                    "(a training loader left out of the set-up, or one each process builds alike)")
    return None


def original_steps(original: RunRecord, rewritten: RunRecord) -> Optional[str]:
    """Where the processes' averaged losses are the original's, step by step (within 1e-6, over at
    least 2 steps): each process drew the original's batches (data batched by hand, which no
    sampler shards), so the data is not shared between them."""
    n = min(len(original.losses), len(rewritten.losses))
    pairs = [(a, b) for a, b in zip(original.losses[:n], rewritten.losses[:n]) if a is not None and b is not None]
    if len(pairs) < 2 or any(abs(b - a) > 1e-6 * max(abs(a), 1e-12) for a, b in pairs):
        return None
    return (f"the {rewritten.world_size} processes computed the original's losses, step by step ({len(pairs)} "
            "steps): each drew the original's batches, so the data is not shared between them and each trains "
            "on the whole set (data batched by hand, which no sampler shards)")


def write_union(rewritten: RunRecord, folder: Path) -> Path:
    path = folder / "union.json"
    path.write_text(json.dumps(union(rewritten.sampled or [])), encoding="utf-8")
    return path


def summed_loss(replayed: RunRecord, rewritten: RunRecord, spread: float = 0.0) -> Optional[str]:
    """Where the first step's loss is N times the processes' average: a loss summed over the batch
    (within 1e-3, or 3x the ``spread`` a probe of the original measured where the steps draw at
    random, a VAE's noise: at most 0.25, far from the 1/N of a mean)."""
    n = rewritten.world_size
    first, theirs = (replayed.losses or [None])[0], (rewritten.losses or [None])[0]
    if first is None or not theirs:
        return None
    if abs(first / (theirs * n) - 1) < min(0.25, max(1e-3, 3 * spread)):
        return (f"the original's first loss on the joined batches is {n} times the processes' average "
                f"({first:.6g} against {theirs:.6g}): a loss summed over its batch, whose gradient the "
                f"processes average to 1/{n} of the original's (a change of training)")
    return None


def judge(replayed: RunRecord, other: Optional[RunRecord], rewritten: RunRecord, tolerance, claims,
          requested_precision: Optional[str]):
    """(the verdict of the processes against the original on their joined batches, or None; a
    note on why not). ``tolerance`` and ``claims`` are those of the same options on one process."""
    from dataclasses import replace

    from accelerate_rewrite.verify.compare import APPROXIMATE, CHANGES_TRAINING, EXACT, FAIL, NOT_COMPARED, PASS, \
        Verdict, compare, measured, noise_floor, rel_diffs

    n = rewritten.world_size
    if not replayed.ok or not replayed.losses:
        return None, f"the original did not run on the joined batches ({(replayed.error or 'no step').strip()[-300:]})"
    if replayed.replay_problem:
        return None, f"the original could not draw the processes' batches: {replayed.replay_problem}"
    floor = noise_floor(replayed, other) if other is not None else None
    spread = 0.0  # the most a step's loss or gradient norm moved in the probe
    if floor is not None:
        k = floor["steps"]
        spread = max([floor["max_rel"], *rel_diffs(replayed.grad_norms[:k], other.grad_norms[:k])])
    summed = summed_loss(replayed, rewritten, spread)
    if summed is not None:
        return None, summed
    # another summation order alone moves a step by ~1e-7, which a chaotic run (a warm-up to a
    # high learning rate) grows step by step; the processes sum their gradients in another order
    # than the original: the exact tolerance takes that in, measured
    orderly = floor is not None and 0 < spread <= ORDER_ONLY
    widened = ""
    if orderly and ORDER_MULTIPLE * spread > tolerance.max_rel and "max_rel" not in tolerance.fixed:
        tolerance = replace(tolerance, max_rel=min(ORDER_ONLY, float(f"{ORDER_MULTIPLE * spread:.2g}")))
        widened = (f" (allowed {tolerance.max_rel:.2g}: {ORDER_MULTIPLE:g}x, at most {ORDER_ONLY:g}, the {spread:.2g} "
                   "that another thread count, which sums in another order, and a reseed change in the original "
                   "on the same batches)")
    drawn = floor is not None and spread > ORDER_ONLY  # the steps draw at random: that is the floor
    if drawn:
        floor.update(effect="a reseed after step 1", run="the original on the same batches, reseeded after step 1")
        basis = claims.basis if tolerance.kind == CHANGES_TRAINING else tolerance.kind
        claims = replace(claims, basis=APPROXIMATE)
        if tolerance.kind == EXACT:
            tolerance = replace(tolerance, kind=APPROXIMATE)

    def held(multiple: float):
        noise = None
        wide = replace(tolerance, noise_multiple=multiple)
        if drawn and basis == EXACT:
            noise = floor
        elif drawn:  # a mixed precision already: the larger of its tolerance and the draws' own effect
            wider = measured(wide, floor)
            wide = replace(wide, **{k: max(getattr(wide, k), getattr(wider, k))
                                    for k in ("mean_rel", "last_rel", "grad_rel")})
        return compare(replayed, rewritten, wide, requested_precision=requested_precision, claims=claims, noise=noise)

    verdict = held(tolerance.noise_multiple)
    if drawn and verdict.verdict == FAIL and held(GREY * tolerance.noise_multiple).verdict == PASS:
        # each process draws its own random numbers, alike: the joined batch's are not the original's
        verdict = Verdict(NOT_COMPARED, (
            f"the curves differ by more than {tolerance.noise_multiple:g}x, and less than "
            f"{GREY * tolerance.noise_multiple:g}x, what a reseed after step 1 changes in the original "
            f"({verdict.reason}): each process draws the random numbers of its own batch (dropout masks, "
            "noise) from the same seed, which no run of the original draws alike; both ran without error, "
            "NaN or inf"), verdict.comparison)
    verdict.comparison["against"] = REPLAY_LABEL.format(n=n)
    return Verdict(verdict.verdict, f"held to the original on the {n} processes' batches, joined step by step: "
                                    f"{verdict.reason}{widened}", verdict.comparison), None
