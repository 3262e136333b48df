"""What the verifier shows: a rich table, the JSON record, and a plot of both loss curves."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from accelerate_rewrite.verify.session import Verification

STYLE = {"pass": "bold green", "fail": "bold red", "error": "bold yellow", "not-verified": "bold yellow",
         "not-compared": "bold cyan", "data-order-changed": "bold cyan"}


def _loss(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.6g}"


def _ratio(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def memory_text(x: Optional[float]) -> str:
    """``rewritten uses 1.24x the memory of the original``: which way the ratio goes, in words."""
    return "-" if x is None else f"rewritten uses {x:.2f}x the memory of the original"


def warnings(v: Verification) -> list[str]:
    """What makes the figures less trustworthy: a machine busier than its cores."""
    load = v.verdict.comparison.get("load_average")
    cores = v.verdict.comparison.get("cores")
    if load is not None and cores and load > cores:
        return [f"the machine was busy (load average {load:.1f} on {cores} cores): the speed figures "
                "are unreliable; verify on a quiet machine, or with --threads 1 for both runs"]
    return []


def _memory(run) -> str:
    if not run.peak_memory_bytes:
        return "-"
    return f"{run.peak_memory_bytes / 2**20:,.0f} MiB ({run.memory_kind})"


def render(console, v: Verification) -> None:
    from rich.markup import escape
    from rich.table import Table

    o, r, c = v.original, v.rewritten, v.verdict.comparison
    title = f"{v.script}" + (f" vs {v.against}" if v.against else " (rewritten)")
    table = Table(title=escape(title), title_justify="left", show_lines=False)
    table.add_column("")
    table.add_column("original", justify="right")
    table.add_column("rewritten", justify="right")
    def ran(run) -> bool:
        return not (run.error or "").startswith("not run")

    table.add_row("steps run", *(str(len(run.losses)) if ran(run) else "not run" for run in (o, r)))
    table.add_row("loss at start", _loss(o.losses[0] if o.losses else None),
                  _loss(r.losses[0] if r.losses else None))
    table.add_row("loss at end", _loss(o.losses[-1] if o.losses else None),
                  _loss(r.losses[-1] if r.losses else None))
    if v.joined is not None and v.joined.losses:  # what the processes' steps were compared with
        table.add_row("loss at start (joined)", _loss(v.joined.losses[0]), "")
        table.add_row("loss at end (joined)", _loss(v.joined.losses[-1]), "")
    table.add_row("device", f"{o.device or '-'} x{o.world_size}", f"{r.device or '-'} x{r.world_size}")
    table.add_row("precision used", *(run.precision if ran(run) else "-" for run in (o, r)))
    table.add_row("forward computed in", *(run.computed_in if ran(run) else "-" for run in (o, r)))
    table.add_row("peak memory", _memory(o), _memory(r))
    table.add_section()
    tol, basis = c["tolerance"], c.get("basis", c["tolerance"]["kind"])

    # a verdict that compared nothing shows the figures, but no limit beside them (issue 27.4)
    compared = v.verdict.verdict not in ("not-compared", "data-order-changed", "not-verified")

    def allowed(value: float, limit: Optional[float]) -> str:
        return f"{value:.2e}" + ("" if limit is None or not compared else f" (allowed {limit:g})")

    exact = basis == "exact"
    if c.get("max_rel_diff") is not None:
        table.add_row("loss difference (relative)", "max", allowed(c["max_rel_diff"], tol["max_rel"] if exact else None))
        table.add_row("", "mean", allowed(c["mean_rel_diff"], None if exact else tol["mean_rel"]))
    if c.get("last_rel_diff") is not None:
        table.add_row("", "last 10% of steps", allowed(c["last_rel_diff"], tol["last_rel"]))
    if c.get("max_grad_norm_rel_diff") is not None:
        table.add_row("gradient norm difference", "max",
                      allowed(c["max_grad_norm_rel_diff"], tol["max_rel"] if exact else None))
        table.add_row("", "mean", allowed(c["mean_grad_norm_rel_diff"], None if exact else tol["grad_rel"]))
    if c.get("max_clip_norm_rel_diff") is not None:  # measured by the clip, before it clipped
        table.add_row("gradient norm before clipping", "max",
                      allowed(c["max_clip_norm_rel_diff"], tol["max_rel"] if exact else None))
        table.add_row("", "mean", allowed(c["mean_clip_norm_rel_diff"], None if exact else tol["grad_rel"]))
    noise = c.get("noise")
    if noise:  # the original under the precision: what the allowed figures above are a multiple of
        grads = f", gradient norms {noise['grad_rel']:.2e}" if noise.get("grad_rel") is not None else ""
        table.add_row(f"{noise['label']} (its own effect)", "mean", f"losses {noise['mean_rel']:.2e}{grads}")
    table.add_row("speedup (median step)", "", _ratio(c.get("speedup")))
    table.add_row("memory", "", memory_text(c.get("rewritten_memory_x")))
    table.add_row("tolerance", "", c["tolerance"]["kind"])
    from accelerate_rewrite.report import fits

    if fits(console, table):
        console.print(table)
    else:  # piped or narrow: a row a line, its cells two spaces apart (issue 49)
        console.print(title, markup=False)
        label = ""
        for row in zip(*(column.cells for column in table.columns)):
            label = row[0] or label
            console.print("  ".join(str(cell) for cell in (label if row[0] else "  ", *row[1:]) if cell != ""),
                          markup=False)
    for note in v.notes:
        console.print(f"[dim]note: {escape(note)}[/]")
    for warning in warnings(v):
        console.print(f"[yellow]warning:[/] {escape(warning)}")
    verdict = v.verdict.verdict
    console.print(f"[{STYLE[verdict]}]{v.verdict.label}[/]: {escape(v.verdict.reason)}")


def write_json(path: Path, v: Verification) -> None:
    path.write_text(json.dumps(v.to_json(), indent=2) + "\n", encoding="utf-8")


def failing_figure(v: Verification) -> Optional[str]:
    """Which figure the verdict turned on: "loss", "gradient norm", or None."""
    if v.verdict.verdict != "fail":
        return None
    reason = v.verdict.reason
    if "gradient" in reason.split(":")[0] or reason.startswith("the gradients") or "gradient applied" in reason:
        return "gradient norm"
    if "loss" in reason.splitlines()[0] or "steps) differ" in reason:
        return "loss"
    return None


#: the most modules or groups drawn in the plot's "where the runs part" panel
WHERE_CURVES = 6
_FIGURES = {"g": ("g", "gradient norm"), "u": ("u", "update size"), "gu": ("gu", "update size")}


def where_curves(v: Verification) -> Optional[dict]:
    """The per-module (or per-group) curves where the runs part (issue 48), for the plot: the
    modules or groups the verdict names first, then the others, up to WHERE_CURVES; the figure
    they part on (gradient norm or update size), each run's value per step; the step where they
    part (1-based). Against the structure run where that is what failed (the rewrite at
    32-true: compared exactly); else the rewritten run, compared within the verdict's tolerance.
    None where a run recorded nothing of the kind."""
    from accelerate_rewrite.verify.where import parting, usable

    c = v.verdict.comparison
    tol = c.get("tolerance") or {}
    structure_failed = v.structure is not None and (c.get("structure") or {}).get("verdict") == "fail"
    other = v.structure if structure_failed else v.rewritten
    o, r = usable(v.reference), usable(other)
    if o is None or r is None:
        return None
    exact = structure_failed or c.get("basis", tol.get("kind")) == "exact"
    part = parting(v.reference, other, tol.get("max_rel", 1e-5) if exact else tol.get("grad_rel", 1e-1))
    key, ylabel = _FIGURES[part.figure if part is not None else "g"]
    if key == "gu":
        names = [f"param_groups[{i}]" for i in range(min(len(o.get("groups", [])), len(r.get("groups", []))))]
        index_o = index_r = {name: i for i, name in enumerate(names)}
    else:
        names = [m for m in o.get("modules", []) if m in r.get("modules", [])]
        index_o = {m: i for i, m in enumerate(o.get("modules", []))}
        index_r = {m: i for i, m in enumerate(r.get("modules", []))}
    named = [n for n in names if part is not None and any(n == x or x.startswith(n + " ") for x in part.names)]
    chosen = (named + [n for n in names if n not in named])[:WHERE_CURVES]

    def values(where: dict, index: dict, name: str) -> list[float]:
        out = []
        for entry in where["steps"]:
            value = None
            if isinstance(entry, dict) and key in entry and index[name] < len(entry[key]):
                value = entry[key][index[name]]
            out.append(float("nan") if value is None else value)
        return out

    curves = [(name, values(o, index_o, name), values(r, index_r, name)) for name in chosen]
    title = f"where the runs part: {part.text}" if part is not None else f"per module: {ylabel}"
    return {"title": title, "step": part.step + 1 if part is not None else None, "ylabel": ylabel,
            "curves": curves, "named": named, "rewritten": other.label}


def write_plot(path: Path, v: Verification) -> None:
    """Both loss curves, both gradient-norm curves, the per-module (or per-group) curves where the
    runs part (``where_curves``), and the relative difference of the losses and gradient norms
    per step (needs matplotlib); the figure the verdict failed on is marked in red in its title."""
    import textwrap

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from accelerate_rewrite.verify.compare import rel_diffs

    o, r = v.reference.losses, v.rewritten.losses
    go, gr = v.reference.grad_norms, v.rewritten.grad_norms
    failed = failing_figure(v)
    where = where_curves(v)
    if where is not None and where["curves"]:
        fig, (top, middle, modules, bottom) = plt.subplots(
            4, 1, figsize=(8, 11), sharex=True, gridspec_kw={"height_ratios": [2, 2, 2.4, 1]})
        for k, (name, before, after) in enumerate(where["curves"]):
            color = f"C{k % 10}"
            width = 2.5 if name in where["named"] else 1.2
            modules.plot(range(1, len(before) + 1), before, color=color, linewidth=width, label=f"{name}")
            modules.plot(range(1, len(after) + 1), after, color=color, linewidth=width, linestyle="--")
        if where["step"] is not None:
            modules.axvline(where["step"], color="tab:red", linestyle=":", linewidth=1)
        modules.set_ylim(bottom=0)  # linear: an update of 0 (a module left out of the optimizer) shows
        modules.set_ylabel(f"{where['ylabel']}\n(solid: original, dashed: {where['rewritten']})", fontsize=8)
        modules.set_title("\n".join(textwrap.wrap(where["title"], 95)[:3]), fontsize=8,
                          color="tab:red" if where["step"] is not None else "black")
        modules.legend(fontsize=7, ncol=3)
    else:
        fig, (top, middle, bottom) = plt.subplots(3, 1, figsize=(8, 8), sharex=True,
                                                  gridspec_kw={"height_ratios": [2, 2, 1]})

    def steps(values):
        return range(1, len(values) + 1)

    top.plot(steps(o), o, label=v.reference.label, linewidth=2)
    top.plot(steps(r), r, label="rewritten", linestyle="--")
    top.set_ylabel("loss")
    top.set_title(f"{v.script.name}: {v.verdict.label} ({v.rewritten.precision})"
                  + (" - failed on the loss" if failed == "loss" else ""),
                  color="tab:red" if failed == "loss" else "black")
    top.legend()
    middle.plot(steps(go), [g if g is not None else float("nan") for g in go], label=v.reference.label, linewidth=2)
    middle.plot(steps(gr), [g if g is not None else float("nan") for g in gr], label="rewritten", linestyle="--")
    middle.set_ylabel("gradient norm")
    middle.set_title("gradient norm applied per step" + (" - failed here" if failed == "gradient norm" else ""),
                     color="tab:red" if failed == "gradient norm" else "black")
    diffs = rel_diffs(o, r)
    grad_diffs = rel_diffs(go, gr)
    bottom.plot(steps(diffs), [max(d, 1e-12) for d in diffs], color="tab:red", label="loss")
    if grad_diffs:
        bottom.plot(steps(grad_diffs), [max(d, 1e-12) for d in grad_diffs], color="tab:purple",
                    linestyle=":", label="gradient norm")
    bottom.set_yscale("log")
    bottom.set_ylabel("relative difference")
    bottom.set_xlabel("optimizer step")
    bottom.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
