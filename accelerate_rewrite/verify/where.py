"""Where two runs part (issue 48): the first module or parameter group whose gradient or update
differs, and how, read off the harness's records (``RunRecord.where``: per step of the first
optimizer, the gradient norm and the update size of each parameter group and of each top-level
module of the model it trains; each group's settings at the first step; the parameters with
``requires_grad`` False and those in no optimizer group). compare.py puts what this finds in a
failing verdict, where it used to give a fixed hint.

A module one run trains and the other does not (``requires_grad`` False, or in no optimizer
group, in one run only) is named first, wherever the runs part, with no other cause: what else
differs follows from it (a clip over the optimizer's parameters measures another norm, and every
module's gradient then looks scaled). Otherwise, at the first step where anything differs (the
loss, the gradient a clip measured, a module's or a group's gradient, a module's or a group's
update), in that order of cause:

- a module with a gradient in one run and none in the other: ``requires_grad`` False there, or
  its output does not reach the loss;
- the loss itself, before any parameter differs: the forward or the batch;
- the gradient norm capped at another value (both measured the same before clipping): the
  clipping threshold; clipping lost or added;
- every module's gradient scaled by one factor: the loss scaled; larger everywhere with the same
  loss and parameters: gradients left from the previous step; one module's alone: that module;
- with equal gradients, a module updated in one run only: left out of the optimizer's groups;
  a group's (or every group's) update larger or smaller: the learning rate or the optimizer's
  settings, named where ``param_groups`` show them.

Torch-free: it reads lists of floats.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from accelerate_rewrite.verify.runner import RunRecord

#: a gradient or update under this (relative to the largest of the step) counts as none
ZERO = 1e-12


@dataclass(frozen=True)
class Parting:
    """Where the runs part: ``step`` (0-based), what is named (``names``: modules, or
    ``param_groups[i]``), and the words."""

    step: int
    names: tuple[str, ...]
    text: str
    #: the figure it parts on: "g" (the modules' gradients), "u" (their updates), "gu" (the groups' updates)
    figure: str = "g"


def usable(run: RunRecord) -> Optional[dict]:
    where = run.where
    if not isinstance(where, dict) or where.get("error") or not isinstance(where.get("steps"), list):
        return None
    return where


def _num(x: Any, digits: int = 6) -> str:
    """0.00105, 1.0, 0.5, (0.9, 0.999): a setting as the user wrote it."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return repr(x) if isinstance(x, str) else str(x)
    if isinstance(x, (list, tuple)):
        return "(" + ", ".join(_num(v, digits) for v in x) + ")"
    if isinstance(x, int):
        return str(x)
    return repr(float(f"{x:.{digits}g}"))


def _pct(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), ZERO) * 100


def _differ(a: Optional[float], b: Optional[float], rtol: float) -> bool:
    if a is None or b is None:
        return (a is None) != (b is None)
    return abs(a - b) > rtol * max(abs(a), abs(b), ZERO)


def _at(values: Sequence, s: int) -> Any:
    return values[s] if s < len(values) else None


class _Runs:
    """The two runs' records, modules matched by name, groups by index."""

    def __init__(self, original: RunRecord, rewritten: RunRecord, o: dict, r: dict, rtol: float) -> None:
        self.original, self.rewritten, self.o, self.r, self.rtol = original, rewritten, o, r, rtol
        self.modules = [m for m in o.get("modules", []) if m in r.get("modules", [])]
        self.oi = {m: i for i, m in enumerate(o.get("modules", []))}
        self.ri = {m: i for i, m in enumerate(r.get("modules", []))}
        types = dict(zip(o.get("modules", []), o.get("module_types", [])))
        self.types = {m: types.get(m) for m in self.modules}
        self.groups_match = len(o.get("groups", [])) == len(r.get("groups", []))

    def label(self, module: str) -> str:
        kind = self.types.get(module)
        return f"`{module}` ({kind})" if module.rsplit(".", 1)[-1].isdigit() and kind else f"`{module}`"

    def step(self, run: str, s: int) -> Optional[dict]:
        steps = (self.o if run == "o" else self.r)["steps"]
        entry = _at(steps, s)
        return entry if isinstance(entry, dict) else None

    def module_values(self, s: int, key: str) -> Optional[dict[str, tuple]]:
        """module -> (original's, rewritten's) for ``key`` ("g": gradient, "u": update) at step s."""
        o, r = self.step("o", s), self.step("r", s)
        if o is None or r is None or key not in o or key not in r:
            return None
        return {m: (_at(o[key], self.oi[m]), _at(r[key], self.ri[m])) for m in self.modules}

    def group_values(self, s: int, key: str) -> Optional[list[tuple]]:
        o, r = self.step("o", s), self.step("r", s)
        if o is None or r is None or key not in o or key not in r or not self.groups_match:
            return None
        return list(zip(o[key], r[key]))

    def group_label(self, i: int) -> str:
        modules = self.o["groups"][i].get("modules") or []
        more = f" and {len(modules) - 3} more" if len(modules) > 3 else ""
        shown = ", ".join(self.label(m) for m in modules[:3]) + more
        return f"param_groups[{i}]" + (f" ({shown})" if shown else "")

    def frozen(self, run: str, module: str) -> bool:
        return bool((self.o if run == "o" else self.r).get("frozen", {}).get(module))

    def no_group(self, run: str, module: str) -> bool:
        return bool((self.o if run == "o" else self.r).get("no_group", {}).get(module))


# ---- what differs in the settings (tolerance-free) ------------------------------------------------

def settings_differences(o: dict, r: dict) -> list[str]:
    """'lr 0.001 in the original, 0.00105 in the rewrite', per setting that differs (by group
    where the groups differ differently); the optimizer's class and the number of groups."""
    out: list[str] = []
    if o.get("optimizer") and r.get("optimizer") and o["optimizer"] != r["optimizer"]:
        out.append(f"the optimizer is {o['optimizer']} in the original, {r['optimizer']} in the rewrite")
    og, rg = o.get("groups") or [], r.get("groups") or []
    if len(og) != len(rg):
        out.append(f"the optimizer has {len(rg)} parameter group(s) in the rewrite, {len(og)} in the original")
        return out
    per_key: dict[str, list[tuple[int, Any, Any]]] = {}
    for i, (a, b) in enumerate(zip(og, rg)):
        sa, sb = a.get("settings") or {}, b.get("settings") or {}
        for key in list(dict.fromkeys([*sa, *sb])):
            if key in ("foreach", "fused", "capturable", "differentiable", "initial_lr"):
                continue  # how the step is computed, not what it computes (initial_lr: a scheduler's copy)
            va, vb = sa.get(key), sb.get(key)
            if not _same(va, vb):
                per_key.setdefault(key, []).append((i, va, vb))
    for key, found in per_key.items():
        values = {(_num(va), _num(vb)) for _, va, vb in found}
        if len(values) == 1 and len(found) == len(og):
            va, vb = found[0][1], found[0][2]
            out.append(f"{key} {_num(va)} in the original, {_num(vb)} in the rewrite")
        else:
            out += [f"param_groups[{i}] {key} {_num(va)} in the original, {_num(vb)} in the rewrite"
                    for i, va, vb in found]
    return out


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, (int, float)) and isinstance(b, (int, float)) and not isinstance(a, bool):
        return abs(a - b) <= 1e-9 * max(abs(a), abs(b), ZERO)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _caps(run: RunRecord) -> list[float]:
    """The norms a clip capped the gradient at: the applied norm, at every step where it is below
    the norm the clip measured."""
    out = []
    for applied, measured in zip(run.grad_norms, run.clip_norms):
        if applied is not None and measured is not None and applied < measured * (1 - 1e-4):
            out.append(applied)
    return out


def _cap(caps: list[float]) -> Optional[float]:
    """The threshold, where every capped step agrees on it (to 1e-3)."""
    if not caps:
        return None
    low, high = min(caps), max(caps)
    return caps[0] if high - low <= 1e-3 * max(high, ZERO) else None


def _threshold(run: RunRecord) -> Optional[float]:
    """The max_norm the run's clip_grad_norm_ was called with, where it was the same at every step."""
    where = usable(run)
    if where is None:
        return None
    found = {e["clip_max"] for e in where["steps"] if isinstance(e, dict) and e.get("clip_max") is not None}
    return found.pop() if len(found) == 1 else None


def clip_difference(original: RunRecord, rewritten: RunRecord) -> Optional[str]:
    """'gradient norm capped at 0.5 instead of 1.0: a different clipping threshold', from the
    max_norm each run's clip was called with (or the steps where each run's clip acted);
    clipping lost or added."""
    o_clips = any(x is not None for x in original.clip_norms)
    r_clips = any(x is not None for x in rewritten.clip_norms)
    cap_o, cap_r = _threshold(original), _threshold(rewritten)
    if cap_o is None or cap_r is None:
        cap_o, cap_r = _cap(_caps(original)), _cap(_caps(rewritten))
    if o_clips and not r_clips and cap_o is not None:
        return f"gradient norm capped at {_num(cap_o, 4)} in the original, not clipped in the rewrite: clipping lost"
    if r_clips and not o_clips and cap_r is not None:
        return f"gradient norm capped at {_num(cap_r, 4)} in the rewrite, not clipped in the original: clipping added"
    if cap_o is not None and cap_r is not None and _differ(cap_o, cap_r, 1e-3):
        return (f"gradient norm capped at {_num(cap_r, 4)} instead of {_num(cap_o, 4)}: "
                "a different clipping threshold")
    if o_clips and r_clips and (cap_o is None) != (cap_r is None):
        # one run's clip acted, the other's never did: its threshold is above every norm it measured
        capped, other = (rewritten, original) if cap_r is not None else (original, rewritten)
        cap = cap_r if cap_r is not None else cap_o
        top = max(x for x in other.clip_norms if x is not None)
        run = "rewrite" if capped is rewritten else "original"
        if top > cap * (1 + 1e-3):
            return (f"gradient norm capped at {_num(cap, 4)} in the {run}, never in the "
                    f"{'original' if run == 'rewrite' else 'rewrite'} (up to {_num(top, 4)}): "
                    "a different clipping threshold")
    return None


def static_differences(original: RunRecord, rewritten: RunRecord) -> list[str]:
    """What the records show differs whatever the figures: frozen modules, modules in no group,
    the optimizer's settings, the clipping threshold. For verdicts whose figures are compared
    within a tolerance (a mixed precision), where no step-by-step difference can be trusted."""
    o, r = usable(original), usable(rewritten)
    out: list[str] = []
    if o is not None and r is not None:
        runs = _Runs(original, rewritten, o, r, 0.0)
        out += [text for _, text, _ in _held_differently(runs)]
        out += settings_differences(o, r)
    clip = clip_difference(original, rewritten)
    if clip is not None:
        out.append(clip)
    return out


def _held_differently(runs: _Runs) -> list[tuple[str, str, str]]:
    """The modules one run trains and the other does not, as the records show them whatever the
    figures: ``requires_grad`` False in one run only, or in no optimizer group of one run only
    (module, the words, the figure that shows it: "g" the gradient, "u" the update)."""
    out = []
    for m in runs.modules:
        if runs.frozen("r", m) and not runs.frozen("o", m):
            out.append((m, f"{runs.label(m)}: no gradient: requires_grad is False in the rewrite", "g"))
        elif runs.frozen("o", m) and not runs.frozen("r", m):
            out.append((m, f"{runs.label(m)}: trained in the rewrite: requires_grad is False in the original", "g"))
        elif runs.no_group("r", m) and not runs.no_group("o", m):
            out.append((m, f"{runs.label(m)}: gradient computed but no update applied: not in any optimizer "
                           "parameter group", "u"))
        elif runs.no_group("o", m) and not runs.no_group("r", m):
            out.append((m, f"{runs.label(m)}: updated in the rewrite: in no optimizer parameter group of the "
                           "original", "u"))
    return out


# ---- the first step where they part ---------------------------------------------------------------

def parting(original: RunRecord, rewritten: RunRecord, rtol: float, n: Optional[int] = None) -> Optional[Parting]:
    """Where the runs part, compared within ``rtol`` (exact runs: the same computation in both).
    None where the records can't say (not recorded, or nothing differs in them)."""
    o, r = usable(original), usable(rewritten)
    if o is None or r is None:
        return None
    runs = _Runs(original, rewritten, o, r, rtol)
    n = min(len(original.losses), len(rewritten.losses)) if n is None else n
    models_o, models_r = o.get("models"), r.get("models")
    if models_o and models_r and models_o != models_r:  # the steps compared are another model's
        return Parting(0, (), f"the first optimizer to step trains {', '.join(models_r)} in the rewrite, "
                              f"{', '.join(models_o)} in the original: an optimizer's step lost, added or moved "
                              "(the steps compared are those of the first optimizer to step)")
    # a module one run trains and the other does not is the cause wherever the runs part: what
    # else differs there follows from it (a clip over the optimizer's parameters measures another
    # norm, every module's gradient then looks scaled), and no other cause is offered
    held = _held_differently(runs)
    updates_seen = True  # every update before this step was measured, and agreed
    for s in range(n):
        found = _at_step(runs, s, updates_seen)
        if found is not None and held and not any(found.text.startswith(text) for _, text, _ in held):
            more = f"; also {', '.join(runs.label(m) for m, _, _ in held[1:4])}" if len(held) > 1 else ""
            return Parting(s, tuple(m for m, _, _ in held), f"{held[0][1]}{more} (the runs part at step {s + 1}, "
                                                             "and what differs there follows from it)", held[0][2])
        if found is not None:
            return found
        if runs.module_values(s, "u") is None and runs.group_values(s, "gu") is None:
            updates_seen = False
    return None


def _at_step(runs: _Runs, s: int, updates_seen: bool) -> Optional[Parting]:
    original, rewritten, rtol = runs.original, runs.rewritten, runs.rtol
    step = s + 1
    lo, lr = _at(original.losses, s), _at(rewritten.losses, s)
    loss_differs = _differ(lo, lr, rtol)
    go, gr = _at(original.grad_norms, s), _at(rewritten.grad_norms, s)
    co, cr = _at(original.clip_norms, s), _at(rewritten.clip_norms, s)
    grads = runs.module_values(s, "g") or {}
    updates = runs.module_values(s, "u") or {}
    group_grads = runs.group_values(s, "gg") or []
    group_updates = runs.group_values(s, "gu") or []
    grad_diff = [m for m, (a, b) in grads.items() if _differ(a, b, rtol)]
    update_diff = [m for m, (a, b) in updates.items() if _differ(a, b, rtol)]
    group_update_diff = [i for i, (a, b) in enumerate(group_updates) if _differ(a, b, rtol)]
    anything = (loss_differs or _differ(go, gr, rtol) or _differ(co, cr, rtol) or grad_diff or update_diff
                or group_update_diff or any(_differ(a, b, rtol) for a, b in group_grads))
    if not anything:
        return None

    def part(names, text, figure="g") -> Parting:
        return Parting(s, tuple(names), text, figure)

    # a module with a gradient in one run only
    for m in grad_diff:
        a, b = grads[m]
        if b is None:
            if runs.frozen("r", m) and not runs.frozen("o", m):
                return part([m], f"{runs.label(m)}: no gradient: requires_grad is False in the rewrite "
                                 f"(step {step}: the original's gradient norm {a:.4g})")
            return part([m], f"{runs.label(m)}: no gradient in the rewrite at step {step} (the original's norm "
                             f"{a:.4g}): its output does not reach the loss there (a .detach(), or the module "
                             "not called)")
        if a is None:
            if runs.frozen("o", m) and not runs.frozen("r", m):
                return part([m], f"{runs.label(m)}: a gradient in the rewrite (norm {b:.4g} at step {step}), none "
                                 "in the original: requires_grad is False in the original, not in the rewrite")
            return part([m], f"{runs.label(m)}: a gradient in the rewrite (norm {b:.4g} at step {step}), none in "
                             "the original: its output reaches the loss in the rewrite only")

    # the modules' gradients before a clip scaled them (each run's by the factor its clip applied)
    limits = tuple((runs.step(run, s) or {}).get("clip_max") for run in ("o", "r"))
    pre, clipped = _unclipped(grads, (go, gr), (co, cr), limits)
    pre_diff = [m for m, (a, b) in pre.items() if _differ(a, b, rtol)]

    # the loss, with the same parameters (every update before agreed): scaled, or the forward or the batch
    if loss_differs and (s == 0 or updates_seen):
        ratios = [b / a for a, b in pre.values() if a and b]
        k = ratios[0] if ratios else None
        if (lo and lr is not None and k is not None and len(ratios) == len(pre) == len(pre_diff) > 0
                and max(ratios) <= min(ratios) * (1 + 1e-3) and not _differ(lr / lo, k, 1e-3)):
            measured = " (measured before clipping)" if clipped else ""
            return part([], f"every module: the gradient is {k:.4g}x the original's at step {step}{measured}, as "
                            f"is the loss ({lr:.6g} instead of {lo:.6g}): a loss scaled by {k:.4g} (e.g. not "
                            "divided under accumulation, or summed instead of averaged)")
        return part([], f"the forward or the loss: the loss differs at step {step} before any parameter does "
                        f"({lr:.6g} instead of {lo:.6g}): the batch, the forward or the loss differs (another "
                        "seed or data order, dropout, train/eval mode, a changed layer, a loss term changed)")

    # clipping: the same gradient measured, another applied (every module's scaled alike; without
    # the modules' records, the total)
    applied_differs = bool(grad_diff) if grads else _differ(go, gr, rtol)
    if co is not None and cr is not None and not _differ(co, cr, rtol) and applied_differs:
        clip = clip_difference(original, rewritten)
        if clip is None:
            clip = (f"gradient norm {gr:.4g} applied instead of {go:.4g} at step {step}, from the same "
                    f"{co:.4g} measured before clipping: a different clipping threshold")
        return part([], clip)
    if (co is None) != (cr is None) and applied_differs:
        clip = clip_difference(original, rewritten)
        if clip is not None:
            return part([], clip)

    # gradients (or, clipped, the gradients measured before clipping)
    if grad_diff or pre_diff or _differ(co, cr, rtol) or (not grads and _differ(go, gr, rtol)):
        text = _gradients(runs, s, pre, pre_diff, (lo, lr), (go, gr), (co, cr), updates_seen, clipped)
        return part(pre_diff if len(pre_diff) < len(pre) else [], text)

    # updates, from equal gradients
    for m in update_diff:
        a, b = updates[m]
        ga, gb = grads.get(m, (None, None))
        if a is not None and b is not None and b <= ZERO < a and gb is not None:
            if runs.no_group("r", m):
                return part([m], f"{runs.label(m)}: gradient computed but no update applied: not in any optimizer "
                                 f"parameter group (step {step}: the original's update {a:.4g}, its gradient "
                                 f"norm {gb:.4g} in both)", "u")
            return part([m], f"{runs.label(m)}: gradient computed but no update applied at step {step} (the "
                             f"original's update {a:.4g}), although its parameters are in an optimizer group "
                             "(a learning rate of 0?)", "u")
        if a is not None and b is not None and a <= ZERO < b and runs.no_group("o", m):
            return part([m], f"{runs.label(m)}: updated in the rewrite (update {b:.4g} at step {step}), not in the "
                             "original: in no optimizer parameter group of the original's", "u")
    settings = settings_differences(runs.o, runs.r)
    if group_update_diff or update_diff:
        names = ([runs.group_label(i) for i in group_update_diff] if group_update_diff else update_diff[:1])
        return part(names, _updates(runs, s, group_updates, group_update_diff, updates, update_diff, settings),
                    "gu" if group_update_diff else "u")
    # something differs that no module or group shows (a group's gradient over tensors of no module)
    return None


def _unclipped(grads: dict, norms: tuple, clips: tuple, limits: tuple) -> tuple[dict, bool]:
    """The modules' gradient norms before clipping (module -> (original's, rewritten's)): a clip
    scales every gradient by one factor, the norm it measured over its max_norm (without the
    max_norm recorded: over the norm the optimizer applied); and whether either run's clip acted."""
    factors = []
    for applied, measured, limit in zip(norms, clips, limits):
        cap = limit if limit else applied
        acted = cap and measured and measured > cap * (1 + 1e-6)
        factors.append(measured / cap if acted else 1.0)
    fo, fr = factors
    scale = (lambda x, f: None if x is None else x * f)
    return {m: (scale(a, fo), scale(b, fr)) for m, (a, b) in grads.items()}, fo != 1.0 or fr != 1.0


def _gradients(runs: _Runs, s: int, grads: dict, grad_diff: list, losses, norms, clips,
               updates_seen: bool, clipped: bool = False) -> str:
    """``grads``: the modules' gradient norms before clipping."""
    step = s + 1
    (lo, lr), (go, gr), (co, cr) = losses, norms, clips
    if not grads or not grad_diff:  # no module recorded, or none differs: the totals (before clipping, if clipped)
        measured = co is not None and cr is not None
        a, b = (co, cr) if measured else (go, gr)
        what = "the gradient measured before clipping" if measured else "the gradient"
        return (f"every module: {what} is {b / max(a, ZERO):.4g}x the original's at step {step} (norm {b:.6g} "
                f"instead of {a:.6g}){_scaled_why(lo, lr, a, b, runs.rtol, s, updates_seen)}")
    if clipped and co is not None and cr is not None:
        go, gr = co, cr  # the totals before clipping
    before = " before clipping" if clipped else ""
    if grad_diff and len(grad_diff) == len(grads):
        ratios = [b / a for a, b in grads.values() if a and b]
        if ratios and max(ratios) <= min(ratios) * (1 + 1e-3):
            k = ratios[0]
            return (f"every module: the gradient{before} is {k:.4g}x the original's at step {step} (total norm "
                    f"{gr:.6g} instead of {go:.6g}){_scaled_why(lo, lr, 1.0, k, runs.rtol, s, updates_seen)}")
        same_loss = not _differ(lo, lr, runs.rtol)
        larger = all(b > a for a, b in grads.values() if a is not None and b is not None)
        if same_loss and s > 0 and updates_seen and ratios:
            # the same loss of the same parameters backwarded: gradients that differ were not all its own
            how = (f"larger, by {min(ratios) - 1:.1%} to {max(ratios) - 1:.1%}," if larger
                   else f"different ({min(ratios):.3g}x to {max(ratios):.3g}x the original's)")
            return (f"every module: the gradient{before} is {how} at step {step} with the same loss and "
                    f"parameters (total norm {gr:.6g} instead of {go:.6g}): gradients left from the previous step "
                    "(a zero_grad() lost or moved)")
        pcts = [_pct(b, a) for a, b in grads.values() if a is not None and b is not None]
        spread = f" by {min(pcts):.1f}% to {max(pcts):.1f}%" if pcts else ""
        return (f"every module: the gradient{before} differs at step {step}{spread} (total norm {gr:.6g} instead of "
                f"{go:.6g}), not by one factor" + (", with the same loss" if same_loss else ""))
    m = grad_diff[0]
    a, b = grads[m]
    others = len(grads) - len(grad_diff)
    return (f"{runs.label(m)}: the gradient{before} differs by {_pct(b, a):.1f}% at step {step} (norm {b:.6g} "
            f"instead of {a:.6g}), while {others} other module(s)' agree: the backward through it differs (a hook, a "
            ".detach() in a branch, a gradient changed by hand)"
            + (f"; also {', '.join(runs.label(x) for x in grad_diff[1:4])}" if len(grad_diff) > 1 else ""))


def _scaled_why(lo, lr, a, b, rtol, s, updates_seen) -> str:
    """Why every gradient is scaled by one factor."""
    k = b / max(a, ZERO)
    if lo and lr is not None and not _differ(lr / lo, k, 1e-3):
        return (f", as is the loss ({lr:.6g} instead of {lo:.6g}): a loss scaled by {k:.4g} (e.g. not divided "
                "under accumulation, or summed instead of averaged)")
    if not _differ(lo, lr, rtol) and (s == 0 or updates_seen):
        return (", with the same loss and parameters: the backward is scaled, not the loss it reports (a loss "
                "not divided under accumulation, a backward called twice, a loss weight)")
    return ": a loss scaled differently, or gradients left from the previous step"


def _updates(runs: _Runs, s: int, group_updates: list, group_diff: list, updates: dict, update_diff: list,
             settings: list[str]) -> str:
    step = s + 1
    why = ": the learning rate or the optimizer's settings differ"
    lr_now = _lr_difference(runs, s)
    if settings:
        why += f" ({'; '.join(settings)})"
    elif lr_now:
        why += f" ({lr_now}: the learning-rate schedule differs)"
    else:
        why += " (param_groups show the same settings and learning rates: the optimizer's state differs)"
    if group_diff:
        pcts = [_pct(group_updates[i][1], group_updates[i][0]) for i in group_diff
                if group_updates[i][0] is not None and group_updates[i][1] is not None]
        by = (f"{pcts[0]:.1f}%" if pcts and max(pcts) - min(pcts) < 0.05 else
              f"{min(pcts):.1f}% to {max(pcts):.1f}%" if pcts else "")
        who = ("every group" if len(group_diff) == len(group_updates)
               else "; ".join(runs.group_label(i) for i in group_diff[:3]))
        return f"{who}: the update differs by {by} at step {step} with equal gradients{why}"
    # the groups' norms agree (a weight decay's term can cancel out over a group): the modules'
    pcts = {m: _pct(updates[m][1], updates[m][0]) for m in update_diff
            if updates[m][0] is not None and updates[m][1] is not None}
    m = max(pcts, key=pcts.get) if pcts else update_diff[0]
    by = f"up to {pcts[m]:.1f}% ({runs.label(m)})" if pcts else ""
    every = [g for g in (runs.o.get("groups") or [])]
    if settings and every and all(_group_setting_differs(runs, i) for i in range(len(every))):
        return f"every group: the update differs by {by} at step {step} with equal gradients{why}"
    by = by.replace(f" ({runs.label(m)})", "")
    return f"{runs.label(m)}: the update differs by {by} at step {step} with equal gradients{why}"


def _group_setting_differs(runs: _Runs, i: int) -> bool:
    a = (runs.o["groups"][i].get("settings") or {}) if runs.groups_match else {}
    b = (runs.r["groups"][i].get("settings") or {}) if runs.groups_match else {}
    return any(not _same(a.get(k), b.get(k)) for k in set(a) | set(b)
               if k not in ("foreach", "fused", "capturable", "differentiable", "initial_lr"))


def _lr_difference(runs: _Runs, s: int) -> Optional[str]:
    o, r = runs.step("o", s), runs.step("r", s)
    if o is None or r is None or not runs.groups_match:
        return None
    pairs = [(i, a, b) for i, (a, b) in enumerate(zip(o.get("lr") or [], r.get("lr") or []))
             if a is not None and b is not None and not _same(a, b)]
    if not pairs:
        return None
    i, a, b = pairs[0]
    where = "" if len(pairs) == len(o.get("lr") or []) else f"param_groups[{i}] "
    return f"{where}lr at step {s + 1} {_num(a)} in the original, {_num(b)} in the rewrite"
