"""What a rewrite that changes training claims, checked on the runs' records: ``--freeze`` (the
parameters it names bitwise unchanged, the others moved: ``frozen_names`` is the verifier's own
reading of the patterns, not the rewrite's code) and ``--clip-grad-norm`` (no applied gradient
above the norm; the steps before it acts the original's), and the gradient a clip measured
before it clipped (``clip_problem``: clipped to the same norm, the applied gradients can't show
a change). compare.py turns these into verdicts."""

from __future__ import annotations

import fnmatch
import re
from typing import Optional, Sequence

from accelerate_rewrite.verify.runner import RunRecord


def clip_problem(original: RunRecord, rewritten: RunRecord, clip_diffs: list[tuple[int, float]],
                  allowed: float, flag: str, where: Optional[str] = None) -> Optional[str]:
    """The first step whose gradient, measured by the clip before it clipped, differs: clipped to
    the same norm, the applied gradients can't show it (issue 27.3). ``where``: where the runs
    part, as the records show it (issue 48), said instead of the likely causes."""
    i = next((i for i, d in clip_diffs if d > allowed), None)
    if i is None:
        return None
    d = dict(clip_diffs)[i]
    return (f"the gradient measured before clipping at step {i + 1} differs: norm "
            f"{rewritten.clip_norms[i]:.6g} instead of {original.clip_norms[i]:.6g} (relative {d:.2e}, "
            f"allowed {allowed:g}: {flag}); clipped to the same limit, the applied gradients look "
            "alike, but the step's gradient changed "
            + (f"(where the runs part: {where})" if where else
               "(gradients left from the previous step, a loss scaled differently)"))


def frozen_names(patterns: Sequence[str], names: Sequence[str]) -> set[str]:
    """The parameter names ``--freeze`` patterns name (a module path, a slice of a ModuleList, a
    glob): the verifier's own reading of the claim, not the rewrite's code."""
    out: set[str] = set()
    for pattern in patterns:
        slice_ = re.fullmatch(r"(.+)\[(-?\d*):(-?\d*)\]", pattern)
        if slice_:
            path, start, stop = slice_.group(1), slice_.group(2), slice_.group(3)
            indices = {int(m.group(1)) for n in names
                       for m in [re.match(re.escape(path) + r"\.(\d+)\.", n)] if m}
            size = max(indices) + 1 if indices else 0
            keep = range(size)[slice(int(start) if start else None, int(stop) if stop else None)]
            out |= {n for n in names if any(n.startswith(f"{path}.{i}.") for i in keep)}
        elif any(c in pattern for c in "*?["):
            out |= set(fnmatch.filter(names, pattern))
        else:
            out |= {n for n in names if n == pattern or n.startswith(pattern + ".")}
    return out


def _names(names: Sequence[str]) -> str:
    shown = ", ".join(sorted(names)[:4])
    return shown + (f" and {len(names) - 4} more" if len(names) > 4 else "")


def check_freeze(patterns: Sequence[str], original: RunRecord, rewritten: RunRecord) -> tuple[Optional[str], str]:
    """(the failure, or None; what was checked)."""
    before, after = rewritten.params_start, rewritten.params_end
    if not before or not after:
        return None, ""  # not recorded (a run that timed out): the claim stays unchecked
    names = list(before)
    frozen = frozen_names(patterns, names)
    if not frozen:
        return (f"--freeze {' '.join(patterns)} names none of the model's parameters "
                f"({_names(names)}): nothing was frozen"), ""
    moved = sorted(n for n in frozen if after.get(n) != before[n])
    if moved:
        return (f"--freeze {' '.join(patterns)}: {len(moved)} of the {len(frozen)} parameters it names "
                f"changed during training ({_names(moved)}): they were not frozen"), ""
    trained = set(names) - frozen
    if original.params_start and original.params_end:  # the others: those the original moved
        trained = {n for n in trained if original.params_end.get(n) != original.params_start.get(n)}
    still = sorted(n for n in trained if after.get(n) == before[n])
    if still:
        return (f"--freeze {' '.join(patterns)}: {len(still)} parameter(s) it does not name did not "
                f"change ({_names(still)}), though the original trained them: more was frozen "
                "than asked"), ""
    return None, (f"the {len(frozen)} parameters --freeze names are bitwise unchanged, the other "
                  f"{len(trained)} moved")


def check_clip(max_norm: float, original: RunRecord, rewritten: RunRecord, exact: bool) -> tuple[Optional[str], str, int]:
    """(the failure, or None; what was checked; the steps before clipping first acts). ``exact``:
    the steps before clipping acts are held to the original's losses, and the step where it
    first acts to the norm (the same data, fp32, nothing frozen)."""
    norms = [(i, g) for i, g in enumerate(rewritten.grad_norms) if g is not None]
    over = [(i, g) for i, g in norms if g > max_norm * (1 + 1e-3)]
    if over:
        i, g = over[0]
        return (f"--clip-grad-norm {max_norm:g}: the gradient applied at step {i + 1} has norm {g:.4g}, "
                f"above {max_norm:g} ({len(over)} of {len(norms)} steps): the gradients are not "
                "clipped (or clipped while still scaled)"), "", 0
    first = next((i for i, g in enumerate(original.grad_norms) if g is not None and g > max_norm), None)
    if first is None:
        first = len(original.grad_norms)
    if exact:  # before clipping first acts, the original's steps; at that step, the norm
        for i in range(min(first + 1, len(rewritten.losses), len(original.losses))):
            before, after = original.losses[i], rewritten.losses[i]
            if before is not None and after is not None and abs(after - before) > 1e-5 * max(abs(before), 1e-12):
                return (f"--clip-grad-norm {max_norm:g}: the loss of step {i + 1} differs ({after:.6g} instead "
                        f"of {before:.6g}), before clipping could act (the original's gradient norms stay "
                        f"under {max_norm:g} until step {first + 1})"), "", first
    if exact and first < len(rewritten.grad_norms) and rewritten.grad_norms[first] is not None:
        g = rewritten.grad_norms[first]
        if abs(g - max_norm) > max_norm * 1e-3:
            return (f"--clip-grad-norm {max_norm:g}: at step {first + 1}, where the original's gradient "
                    f"norm is {original.grad_norms[first]:.4g}, the rewritten run applied {g:.4g} instead "
                    f"of {max_norm:g}: it clips to another norm"), "", first
    return None, (f"no applied gradient norm above {max_norm:g} in {len(norms)} steps"), first
