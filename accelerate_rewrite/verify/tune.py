"""``accelerate-rewrite tune``: which technique speeds this script up, measured (issue 28).

The original runs once (its record reused for every candidate); each candidate is rewritten
and verified as ``verify`` does it (the same harness, tolerances and verdicts), and its median
step time after the warm-up steps and its peak memory are set beside the original's. The fastest
candidate that PASSed parity, and beats the original by ``min_speedup``, is recommended with the
command that applies it. Nothing is estimated: a candidate that crashed, failed parity or can't
run on this machine is shown with why, and never recommended.

    result = tune(Path("train.py"), default_candidates(machine), steps=30)
"""

from __future__ import annotations

import os
import platform
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Callable, Optional, Sequence

from accelerate_rewrite.verify.compare import EXIT_CODES, LABELS, PASS, Tolerance, median_time
from accelerate_rewrite.verify.environment import CUDA, Machine, Need, probe
from accelerate_rewrite.verify.runner import ending_runs_on_signals
from accelerate_rewrite.verify.session import Verification, VerifyError, load_average, verify

#: a candidate must be this much faster than the original to be recommended: step times on a
#: shared machine move by a few percent from run to run
MIN_SPEEDUP = 1.05


@dataclass(frozen=True)
class Candidate:
    """One way to run the script: option flags as typed (``--precision bf16-mixed --compile``),
    or a file of one's own (``--against``: nothing rewritten, the file run as it is)."""

    flags: tuple[str, ...] = ()
    against: Optional[Path] = None

    @property
    def label(self) -> str:
        if self.against is not None:
            return str(self.against)
        return shlex.join(self.flags) if self.flags else "(the options of the configuration)"

    @classmethod
    def parse(cls, text: str) -> "Candidate":
        return cls(tuple(shlex.split(text)))


@dataclass
class Outcome:
    candidate: Candidate
    runs: list[Verification] = field(default_factory=list)  # one per --repeat
    error: Optional[str] = None  # could not start: a bad option, nothing to rewrite

    @property
    def first(self) -> Optional[Verification]:
        return self.runs[0] if self.runs else None

    @property
    def verdict(self) -> str:
        if self.error is not None:
            return "not run"
        verdicts = {v.verdict.verdict for v in self.runs}
        return self.runs[0].verdict.verdict if len(verdicts) == 1 else "unstable"

    @property
    def label(self) -> str:
        if self.error is not None:
            return "NOT RUN"
        if self.verdict == "unstable":
            return "UNSTABLE (" + ", ".join(v.verdict.label for v in self.runs) + ")"
        return LABELS[self.verdict]

    @property
    def reason(self) -> str:
        if self.error is not None:
            return self.error
        if self.verdict == "unstable":
            return "the repeats disagree: " + "; ".join(f"{v.verdict.label}: {v.verdict.reason.splitlines()[0]}"
                                                        for v in self.runs)
        return self.runs[0].verdict.reason.splitlines()[0]

    @property
    def crashed(self) -> bool:
        return any(not v.rewritten.ok for v in self.runs)

    def step_times(self, warmup: int) -> list[float]:
        """The median step time of each repeat (seconds), after the warm-up steps."""
        out = []
        for v in self.runs:
            t = median_time(v.rewritten.step_times_s, warmup) if v.rewritten.ok else None
            if t:
                out.append(t)
        return out

    def samples_per_s(self, warmup: int) -> Optional[float]:
        """Samples a second, where a step's samples are known: every DataLoader of the run has
        one batch size, one batch a step (no --accumulate), times the processes."""
        v, times = self.first, self.step_times(warmup)
        if v is None or not times or len(v.rewritten.batch_sizes) != 1 or v.options.accumulate:
            return None
        return v.rewritten.batch_sizes[0] * v.rewritten.world_size / median(times)

    @property
    def peak_memory_bytes(self) -> Optional[int]:
        values = [v.rewritten.peak_memory_bytes for v in self.runs if v.rewritten.ok and v.rewritten.peak_memory_bytes]
        return max(values) if values else None

    @property
    def mean_rel_diff(self) -> Optional[float]:
        v = self.first
        return None if v is None else v.verdict.comparison.get("mean_rel_diff")


@dataclass
class TuneResult:
    script: Path
    outcomes: list[Outcome]
    original_step_s: Optional[float]
    original_memory_bytes: Optional[int]
    memory_kind: str
    warmup: int
    min_speedup: float
    load_average: float = 0.0
    cores: int = 1
    machine: str = ""
    original_samples_per_s: Optional[float] = None

    def speedup(self, outcome: Outcome) -> Optional[float]:
        times = outcome.step_times(self.warmup)
        if not times or not self.original_step_s:
            return None
        return self.original_step_s / median(times)

    def memory_x(self, outcome: Outcome) -> Optional[float]:
        memory = outcome.peak_memory_bytes
        if not memory or not self.original_memory_bytes:
            return None
        return memory / self.original_memory_bytes

    def ranked(self) -> list[Outcome]:
        """Fastest first; those with no step time (not run, crashed) last, in their order."""
        timed = [o for o in self.outcomes if self.speedup(o) is not None and not o.crashed]
        rest = [o for o in self.outcomes if o not in timed]
        return sorted(timed, key=lambda o: -self.speedup(o)) + rest

    def recommended(self) -> Optional[Outcome]:
        """The fastest candidate that PASSed every repeat and beats the original by min_speedup."""
        for outcome in self.ranked():
            speedup = self.speedup(outcome)
            if outcome.verdict == PASS and speedup is not None and speedup >= self.min_speedup:
                return outcome
        return None

    def command(self, outcome: Outcome) -> str:
        """The command that applies a candidate to the script."""
        if outcome.candidate.against is not None:
            return f"cp {shlex.quote(str(outcome.candidate.against))} {shlex.quote(str(self.script))}"
        return shlex.join(["accelerate-rewrite", str(self.script), *outcome.candidate.flags, "--write"])

    @property
    def busy(self) -> bool:
        return self.load_average > self.cores

    def to_json(self) -> dict:
        best = self.recommended()
        return {
            "script": str(self.script),
            "machine": self.machine,
            "original": {"step_time_s": self.original_step_s, "peak_memory_bytes": self.original_memory_bytes,
                         "memory_kind": self.memory_kind, "samples_per_s": self.original_samples_per_s},
            "warmup_steps": self.warmup,
            "min_speedup": self.min_speedup,
            "load_average": self.load_average,
            "cores": self.cores,
            "candidates": [{
                "candidate": o.candidate.label,
                "flags": list(o.candidate.flags),
                "against": None if o.candidate.against is None else str(o.candidate.against),
                "verdict": o.verdict,
                "exit_code": EXIT_CODES.get(o.verdict),
                "reason": o.reason,
                "step_time_s": median(o.step_times(self.warmup)) if o.step_times(self.warmup) else None,
                "step_times_s": o.step_times(self.warmup),  # one per repeat
                "speedup": self.speedup(o),
                "samples_per_s": o.samples_per_s(self.warmup),
                "peak_memory_bytes": o.peak_memory_bytes,
                "memory_x": self.memory_x(o),
                "mean_rel_diff": o.mean_rel_diff,
                "precision": o.first.rewritten.precision if o.first is not None and o.first.rewritten.ok else None,
            } for o in self.ranked()],
            "recommended": None if best is None else {"candidate": best.candidate.label,
                                                      "command": self.command(best)},
        }


def machine_for_tuning(python: str, env: Optional[dict] = None, cwd=None) -> Machine:
    """What the default candidates depend on, asked of the Python that will run the script."""
    return probe(python, [Need(CUDA, "tune"), Need("bitsandbytes", "tune")], env=env, cwd=cwd)


def default_candidates(machine: Machine, backend: Optional[str] = None) -> list[Candidate]:
    """The issue's default set for this machine; with ``backend``, each candidate spelled in
    it (the torch backend has no 32-true candidate: it writes nothing at 32-true)."""
    if machine.cuda_devices:
        texts = ["--precision 32-true", "--precision 32-true --matmul-precision high", "--precision 16-mixed"]
        if machine.cuda_bf16:
            texts += ["--precision bf16-mixed", "--precision bf16-mixed --compile"]
        else:
            texts += ["--precision 16-mixed --compile"]
        if machine.modules.get("bitsandbytes"):
            texts += ["--precision bf16-mixed --optimizer-8bit" if machine.cuda_bf16 else "--optimizer-8bit"]
    else:
        texts = ["--precision 32-true", "--precision bf16-mixed", "--precision bf16-mixed --compile"]
    if backend == "torch":
        texts = [t for t in texts if "32-true" not in t]
    return [with_backend(Candidate.parse(t), backend) for t in texts]


def with_backend(candidate: Candidate, backend: Optional[str]) -> Candidate:
    """``candidate`` spelled in ``backend`` (``tune --backend accelerate``), unless it names a
    backend of its own or is a file of one's own."""
    if backend is None or candidate.against is not None or any(
            f == "--backend" or f.startswith("--backend=") for f in candidate.flags):
        return candidate
    return Candidate(("--backend", backend, *candidate.flags))


@ending_runs_on_signals()  # SIGTERM, SIGHUP: the run going on ends (see runner.py)
def tune(
    script: Path,
    candidates: Sequence[Candidate],
    *,
    options_for: Callable[[Candidate], tuple],  # candidate -> (Options, rules); raises VerifyError
    script_args: Sequence[str] = (),
    steps: int = 30,
    repeat: int = 1,
    run_on: Optional[str] = None,
    timeout: float = 600.0,
    python: Optional[str] = None,
    threads: Optional[int] = None,
    tolerance: Optional[Tolerance] = None,
    min_speedup: float = MIN_SPEEDUP,
    on_start: Callable[[str, str], None] = lambda candidate, run: None,
) -> TuneResult:
    tolerance = tolerance or Tolerance()
    reuse: dict = {}
    outcomes: list[Outcome] = []
    load = load_average()
    for candidate in candidates:
        outcome = Outcome(candidate)
        outcomes.append(outcome)
        try:
            options, rules = options_for(candidate)
        except VerifyError as exc:
            outcome.error = str(exc)
            continue
        for _ in range(repeat):
            try:
                outcome.runs.append(verify(
                    script, options, script_args=script_args, against=candidate.against, steps=steps,
                    run_on=run_on, timeout=timeout, python=python or sys.executable, threads=threads,
                    tolerance=tolerance, rules=rules, reuse=reuse,
                    on_start=lambda run, label=candidate.label: on_start(label, run)))
            except VerifyError as exc:
                outcome.error = str(exc)
                break
            if outcome.runs[-1].verdict.verdict == "not-verified" and not outcome.runs[-1].rewritten.losses:
                break  # the machine can't run it: once is enough
        load = max(load, load_average())
    original = next((r for k, r in reuse.items() if k.startswith("original")), None)
    n = len(original.losses) if original is not None else 0
    warmup = tolerance.warmup_steps if tolerance.warmup_steps is not None else max(1, n // 10)
    return TuneResult(
        script=script, outcomes=outcomes,
        original_step_s=median_time(original.step_times_s, warmup) if original is not None else None,
        original_memory_bytes=original.peak_memory_bytes if original is not None else None,
        memory_kind=original.memory_kind if original is not None else "",
        warmup=warmup, min_speedup=min_speedup, load_average=load, cores=os.cpu_count() or 1,
        machine=_machine_words(original, run_on),
        original_samples_per_s=_samples(original, warmup),
    )


def _samples(run, warmup: int) -> Optional[float]:
    t = median_time(run.step_times_s, warmup) if run is not None else None
    if not t or len(run.batch_sizes) != 1:
        return None
    return run.batch_sizes[0] * run.world_size / t


def _machine_words(original, run_on: Optional[str]) -> str:
    device = original.device if original is not None and original.device else (run_on or "cpu")
    return f"{platform.machine()} {os.cpu_count()} cores, {device}"


def _ms(seconds: Optional[float]) -> str:
    return "-" if seconds is None else f"{seconds * 1000:,.1f} ms"


def _rate(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _mib(value: Optional[int]) -> str:
    return "-" if not value else f"{value / 2**20:,.0f} MiB"


STYLE = {"pass": "green", "fail": "red", "error": "yellow", "not-verified": "yellow", "not-compared": "cyan",
         "data-order-changed": "cyan", "not run": "yellow", "unstable": "yellow"}


def render(console, result: TuneResult) -> None:
    from rich.markup import escape
    from rich.table import Table

    from accelerate_rewrite.report import fits, rows

    title = f"{result.script}: {len(result.outcomes)} candidate(s), median step after {result.warmup} warm-up step(s)"
    header = ["candidate", "step", "samples/s", "speed-up", "peak mem", "mem x", "verdict", "loss diff"]
    table = Table(title=escape(title), title_justify="left")
    table.add_column("candidate", ratio=1, overflow="fold")
    for name in header[1:]:
        table.add_column(name, justify="left" if name == "verdict" else "right", no_wrap=True)
    cells = [["original", _ms(result.original_step_s), _rate(result.original_samples_per_s), "1.00x",
              _mib(result.original_memory_bytes), "1.00x", "", ""]]
    for outcome in result.ranked():
        times = outcome.step_times(result.warmup)
        step = _ms(median(times)) if times else "-"
        if len(times) > 1:
            step += f" ({min(times) * 1000:,.1f}-{max(times) * 1000:,.1f})"
        speedup, memory_x = result.speedup(outcome), result.memory_x(outcome)
        diff = outcome.mean_rel_diff
        cells.append([outcome.candidate.label, step, _rate(outcome.samples_per_s(result.warmup)),
                      "-" if speedup is None else f"{speedup:.2f}x",
                      _mib(outcome.peak_memory_bytes), "-" if memory_x is None else f"{memory_x:.2f}x",
                      f"[{STYLE[outcome.verdict]}]{escape(outcome.label)}[/]",
                      "-" if diff is None else f"{diff:.2e}"])
    for cell in cells:
        table.add_row(escape(cell[0]), *cell[1:])
    if fits(console, table):
        console.print(table)
    else:  # piped, or narrow: each candidate's options on a line of their own
        rows(console, header, cells, title=title)
    for outcome in result.ranked():
        if outcome.verdict != PASS:
            console.print(f"[dim]{escape(outcome.candidate.label)}: {escape(outcome.label)}: "
                          f"{escape(outcome.reason)}[/]")
    if result.busy:
        console.print(f"[yellow]warning:[/] the machine was busy (load average {result.load_average:.1f} on "
                      f"{result.cores} cores): the step times are not trustworthy; tune on a quiet machine, "
                      "or with --threads 1")
    best = result.recommended()
    if best is None:
        passed = [o for o in result.outcomes if o.verdict == PASS]
        why = (f"no candidate that passed beats the original by {result.min_speedup:.2f}x or more" if passed
               else "no candidate passed parity")
        console.print(f"[bold]No recommendation:[/] {why}; the original stays the fastest correct choice here.")
    else:
        console.print(f"[bold green]Recommended:[/] {escape(best.candidate.label)} "
                      f"({result.speedup(best):.2f}x the original's speed, verified): "
                      f"{escape(result.command(best))}")


def write_plot(path: Path, result: TuneResult) -> None:
    """Speed-up and memory bars per candidate, the verdict marked (needs matplotlib)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    colors = {"pass": "tab:green", "fail": "tab:red", "not-compared": "tab:cyan"}
    ranked = result.ranked()
    labels = ["original"] + [o.candidate.label for o in ranked]
    speedups = [1.0] + [result.speedup(o) or 0.0 for o in ranked]
    memory = [1.0] + [result.memory_x(o) or 0.0 for o in ranked]
    bar_colors = ["tab:gray"] + [colors.get(o.verdict, "tab:orange") for o in ranked]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 1.2 + 0.5 * len(labels)), sharey=True)
    ys = range(len(labels))
    left.barh(ys, speedups, color=bar_colors)
    left.axvline(1.0, color="black", linewidth=0.8)
    left.set_yticks(list(ys), labels)
    left.invert_yaxis()
    left.set_xlabel("speed-up over the original (median step)")
    for y, o in zip(list(ys)[1:], ranked):
        left.text(max(speedups[y], 0.02), y, f" {o.label}", va="center", fontsize=8)
    right.barh(ys, memory, color=bar_colors)
    right.axvline(1.0, color="black", linewidth=0.8)
    right.set_xlabel("peak memory, x the original's")
    fig.suptitle(f"{result.script.name}: tune ({result.machine})")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
