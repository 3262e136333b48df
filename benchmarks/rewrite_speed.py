"""How fast accelerate-rewrite rewrites, and how fast the command starts.

    .venv/bin/python benchmarks/rewrite_speed.py              # a short report
    .venv/bin/python benchmarks/rewrite_speed.py --markdown   # a markdown section to paste
    .venv/bin/python benchmarks/rewrite_speed.py --profile    # cProfile of one pass (slow)
    .venv/bin/python benchmarks/rewrite_speed.py --real-only --torchfix /tmp/torchfix-venv/bin/torchfix
    .venv/bin/python benchmarks/rewrite_speed.py --real-profile 25   # cProfile over the real corpus

Measures, in this order:

0. **The real corpus first** (issue 49; benchmarks/real_speed.py, whose docstring says exactly
   what it runs): every script of benchmarks/real_corpus.py's corpus, in its repository's tree
   from the git mirrors (``--mirrors``; left out when they are not there, or with ``--no-real``),
   rewritten as the command does it, in CPU seconds: against one LibCST parse of the same file
   (parses) and against TorchFix on the same file (``--torchfix PATH``, its console script in a
   venv of its own), one process each, medians of ``--real-runs`` (3). About 15 minutes on a
   2-core machine with TorchFix. ``--real-only`` stops there.
1. Rewrite throughput of the engine API, ``rewrite(source, Options.create(**opts), path=...)``,
   over every ``fixtures/*/input.py`` with each option set below: one warm-up pass (every
   fixture once, the option sets taken in turn), then ``--rounds`` measured rounds of all
   fixtures x all option sets. Reported: median lines/s over the rounds, and per-rewrite
   milliseconds (the median over the rounds of each fixture and option set, then the min /
   median / max of those). Where the time goes is measured during the same rounds: parsing is
   timed on its own (``libcst.parse_module``, once per fixture and round), and the engine's
   ``ScriptFacts``, ``apply_edits`` and ``check`` are wrapped with timers
   for the measured rounds (and put back afterwards); what is left is the rules, the code
   generation of the result and the bookkeeping.
2. A synthetic large input: a module of about ``--synthetic-lines`` lines in the style of
   fixtures/train_function (many small classifiers, each with its own train()/evaluate(), all
   built and trained in one main()). It is generated here, checked to compile, and rewritten
   with the default options; the result must compile too.
3. Cold start of ``accelerate-rewrite --help``, ``accelerate-rewrite --check
   fixtures/module_loop/input.py`` and ``--pre-commit`` on the same file (nothing to fix) as subprocesses (wall clock, one untimed run first, then the
   median of ``--cold-runs`` runs), and whether either imports torch or lightning (from
   ``python -X importtime``): they must not.

4. The whole command (``--check --no-cache``: every file rewritten, none read from the cache)
   over ``--corpus`` generated training scripts, with 1 and 2 processes (``-j``): lines per
   second of the whole run.

``--goals`` runs benchmarks/speed_goals.py instead (issue 15: this tool side by side with
TorchFix over a corpus of 239 files, the size curve up to 50k lines, the cache, -j1 against -jN,
the pre-commit hook); its options follow (``--torchfix PATH``, ``--sizes``, ``--rounds``).

Exits 1 when the rewrites or either command imported torch or lightning. Only the standard
library and the package are used. With the defaults it takes about 45 s on
a 2-core machine (most of it in the measured rounds); ``--rounds 1 --synthetic-lines 0`` is a
quick check.
"""

from __future__ import annotations

import argparse
import cProfile
import datetime
import gc
import importlib.metadata
import os
import platform
import pstats
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable, Optional

import libcst

import accelerate_rewrite.codemod.engine as engine
import accelerate_rewrite.codemod.reading as reading
from accelerate_rewrite import api
from accelerate_rewrite.options import Options

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))
from corpus import n_lines, synthetic_source  # noqa: E402 (beside this file)
FIXTURES = ROOT / "fixtures"
COLD_CHECK_TARGET = "fixtures/module_loop/input.py"

#: the option sets of the fixture goldens (tests/goldens.py)
OPTION_SETS: dict[str, dict] = {
    "default": {},
    "bf16-mixed-devices-4": {"precision": "bf16-mixed", "devices": 4},
    "fsdp": {"strategy": "fsdp"},
}

#: engine globals wrapped with timers during the measured rounds (their module, name) -> label
INSTRUMENTED = {
    (reading, "ScriptFacts"): "analysis (ScriptFacts)",
    (engine, "apply_edits"): "apply the edits",
    (engine, "check"): "check the result (re-parse, compile, scopes)",
}
PARSE = "parse (libcst.parse_module)"
REST = "rules, code generation, the rest"

FORBIDDEN_IMPORTS = ("torch", "lightning", "lightning_fabric", "pytorch_lightning")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---- the machine ---------------------------------------------------------------------------


def machine() -> dict[str, str]:
    cpu = "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    cores = os.cpu_count() or 0
    try:
        usable = len(os.sched_getaffinity(0))
    except AttributeError:
        usable = cores
    try:
        load = "%.2f %.2f %.2f" % os.getloadavg()
    except OSError:
        load = "n/a"
    commit = "n/a"
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                              capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                               cwd=ROOT, capture_output=True, text=True, timeout=10)
        if head.returncode == 0:
            commit = head.stdout.strip() + (" with uncommitted changes" if dirty.stdout.strip()
                                            else "")
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "cpu": cpu,
        "cores": f"{cores}" + (f" ({usable} usable)" if usable != cores else ""),
        "os": f"{platform.system()} {platform.release()}",
        "python": f"{platform.python_implementation()} {platform.python_version()}",
        "libcst": importlib.metadata.version("libcst"),
        "package": importlib.metadata.version("accelerate-rewrite"),
        "commit": commit,
        "load": load,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }


# ---- 1. throughput over the fixtures -------------------------------------------------------


class Phases:
    """Timers around engine globals; ``take()`` returns and clears the seconds per label."""

    def __init__(self) -> None:
        self.saved: dict[tuple, object] = {}
        self.current: dict[str, float] = {}
        self.missing: list[str] = []

    def _wrap(self, fn: Callable, label: str) -> Callable:
        current = self.current

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                current[label] = current.get(label, 0.0) + time.perf_counter() - start

        return timed

    def __enter__(self) -> "Phases":
        for (module, attr), label in INSTRUMENTED.items():
            fn = getattr(module, attr, None)
            if fn is None:  # the engine changed: measure what is still there
                self.missing.append(attr)
                continue
            self.saved[module, attr] = fn
            setattr(module, attr, self._wrap(fn, label))
        return self

    def __exit__(self, *exc) -> None:
        for (module, attr), fn in self.saved.items():
            setattr(module, attr, fn)

    def take(self) -> dict[str, float]:
        out = dict(self.current)
        self.current.clear()
        return out


def fixture_sources() -> list[tuple[str, str]]:
    paths = sorted(FIXTURES.glob("*/input.py"))
    if not paths:
        sys.exit(f"no fixtures found under {FIXTURES}")
    return [(p.relative_to(ROOT).as_posix(), p.read_text(encoding="utf-8")) for p in paths]


def one_rewrite(path: str, source: str, opts: dict) -> float:
    start = time.perf_counter()
    api.rewrite(source, Options.create(**opts), path=path)
    return time.perf_counter() - start


def throughput(rounds: int) -> dict:
    files = fixture_sources()
    names = list(OPTION_SETS)
    log(f"throughput: warm-up pass over {len(files)} fixtures")
    for i, (path, source) in enumerate(files):
        one_rewrite(path, source, OPTION_SETS[names[i % len(names)]])

    times: dict[tuple[str, str], list[float]] = {}
    parse_times: dict[str, list[float]] = {path: [] for path, _ in files}
    phase_sums: dict[str, float] = {}
    round_lines_per_s: list[float] = []
    set_lines_per_s: dict[str, list[float]] = {name: [] for name in names}
    with Phases() as phases:
        for r in range(rounds):
            log(f"throughput: round {r + 1}/{rounds} ({len(files)} fixtures x {len(names)} "
                "option sets)")
            gc.collect()
            round_time = 0.0
            round_lines = 0
            for name in names:
                set_time = 0.0
                set_lines = 0
                for path, source in files:
                    phases.take()
                    elapsed = one_rewrite(path, source, OPTION_SETS[name])
                    for label, seconds in phases.take().items():
                        phase_sums[label] = phase_sums.get(label, 0.0) + seconds
                    times.setdefault((path, name), []).append(elapsed)
                    set_time += elapsed
                    set_lines += n_lines(source)
                set_lines_per_s[name].append(set_lines / set_time)
                round_time += set_time
                round_lines += set_lines
            round_lines_per_s.append(round_lines / round_time)
            for path, source in files:  # parsing alone, once per fixture and round
                start = time.perf_counter()
                libcst.parse_module(source)
                parse_times[path].append(time.perf_counter() - start)
        missing = phases.missing

    per_rewrite = {key: statistics.median(v) for key, v in times.items()}
    total = sum(sum(v) for v in times.values())
    parse_median = {path: statistics.median(v) for path, v in parse_times.items()}
    phase_sums[PARSE] = sum(parse_median[path] * rounds for path, _ in times)
    phase_sums[REST] = total - sum(phase_sums.values())
    order = [PARSE, *INSTRUMENTED.values(), REST]
    analysis = INSTRUMENTED[reading, "ScriptFacts"]
    slowest = max(per_rewrite, key=per_rewrite.get)
    ms = sorted(v * 1e3 for v in per_rewrite.values())
    return {
        "files": len(files),
        "lines": sum(n_lines(s) for _, s in files),
        "option_sets": names,
        "rounds": rounds,
        "rewrites_per_round": len(per_rewrite),
        "lines_per_s": statistics.median(round_lines_per_s),
        "lines_per_s_rounds": round_lines_per_s,
        "lines_per_s_by_set": {n: statistics.median(v) for n, v in set_lines_per_s.items()},
        "ms_min": ms[0],
        "ms_median": statistics.median(ms),
        "ms_max": ms[-1],
        "slowest": slowest,
        "phases": [(label, phase_sums[label] / total) for label in order if label in phase_sums],
        "parse_analysis_share": (phase_sums[PARSE] + phase_sums.get(analysis, 0.0)) / total,
        "missing": missing,
    }


# ---- 2. a synthetic large input ------------------------------------------------------------

def synthetic(target_lines: int, runs: int) -> Optional[dict]:
    if target_lines <= 0:
        return None
    models = 1
    while n_lines(synthetic_source(models)) < target_lines:
        models += 1
    source = synthetic_source(models)
    compile(source, "<synthetic>", "exec", dont_inherit=True)  # valid Python, or stop here
    lines = n_lines(source)
    times = []
    result = None
    with Phases() as phases:
        for r in range(runs):
            log(f"synthetic: {lines} lines, {models} models, run {r + 1}/{runs}")
            gc.collect()
            phases.take()
            start = time.perf_counter()
            result = api.rewrite(source, Options.create(), path="<synthetic>")
            times.append(time.perf_counter() - start)
        analysis = phases.take().get(INSTRUMENTED[reading, "ScriptFacts"])
    start = time.perf_counter()
    libcst.parse_module(source)
    parse = time.perf_counter() - start
    compile(result.output, "<synthetic rewritten>", "exec", dont_inherit=True)
    seconds = statistics.median(times)
    return {
        "lines": lines,
        "models": models,
        "runs": runs,
        "seconds": seconds,
        "lines_per_s": lines / seconds,
        "parse_analysis_share": None if analysis is None else (parse + analysis) / times[-1],
        "changes": len(result.changes),
        "skips": len(result.skips),
        "dropped": len(result.dropped),
    }


# ---- 3. cold start -------------------------------------------------------------------------


def console_script() -> str:
    found = shutil.which("accelerate-rewrite", path=str(Path(sys.executable).parent))
    found = found or shutil.which("accelerate-rewrite")
    if not found:
        sys.exit("the accelerate-rewrite console script is not installed next to this Python")
    return found


def heavy_imports(script: str, args: list[str]) -> tuple[list[str], float, list[tuple[str, float]]]:
    """(forbidden modules imported, all imports in ms, the three slowest packages: the self
    time of all their modules, in ms)."""
    proc = subprocess.run([sys.executable, "-X", "importtime", script, *args], cwd=ROOT,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    forbidden: list[str] = []
    by_package: dict[str, int] = {}
    total_us = 0
    pattern = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
    for line in proc.stderr.splitlines():
        match = pattern.match(line)
        if not match:
            continue
        self_us, name = int(match.group(1)), match.group(4)
        total_us += self_us
        if name.split(".")[0] in FORBIDDEN_IMPORTS:
            forbidden.append(name)
        package = name.split(".")[0]
        by_package[package] = by_package.get(package, 0) + self_us
    top = sorted(((p, us / 1e3) for p, us in by_package.items()), key=lambda item: -item[1])
    return forbidden, total_us / 1e3, top[:3]


def cold_start(runs: int) -> list[dict]:
    script = console_script()
    out = []
    # the pre-commit hook on a training script it has nothing to fix (module_loop uses no
    # deprecated AMP API): what a commit that touches one script costs
    for args in (["--help"], ["--check", COLD_CHECK_TARGET], ["--pre-commit", COLD_CHECK_TARGET]):
        label = "accelerate-rewrite " + " ".join(args)
        log(f"cold start: {label} (1 untimed + {runs} runs)")
        subprocess.run([script, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                       stderr=subprocess.DEVNULL)
        times, codes = [], set()
        for _ in range(runs):
            start = time.perf_counter()
            proc = subprocess.run([script, *args], cwd=ROOT, stdout=subprocess.DEVNULL,
                                  stderr=subprocess.DEVNULL)
            times.append(time.perf_counter() - start)
            codes.add(proc.returncode)
        forbidden, imports_ms, top = heavy_imports(script, args)
        out.append({
            "command": label,
            "runs": runs,
            "median_ms": statistics.median(times) * 1e3,
            "min_ms": min(times) * 1e3,
            "max_ms": max(times) * 1e3,
            "exit": sorted(codes),
            "forbidden": forbidden,
            "imports_ms": imports_ms,
            "top_imports": top,
        })
    return out


# ---- 4. the whole command over a corpus ---------------------------------------------------------


def corpus(files: int, runs: int = 3) -> Optional[dict]:
    """``accelerate-rewrite FOLDER --check --no-cache -j J`` over ``files`` generated training scripts (1 to
    4 classifiers each, in the style of fixtures/train_function), J = 1 and 2: the whole run
    (start-up, reading, parse, analysis, rules, diff) in lines per second, median of ``runs``."""
    import tempfile

    if files <= 0:
        return None
    script = console_script()
    out: dict = {"files": files, "runs": runs}
    with tempfile.TemporaryDirectory() as folder:
        lines = 0
        for i in range(files):
            text = synthetic_source(1 + i % 4)
            (Path(folder) / f"train_{i:03d}.py").write_text(text)
            lines += n_lines(text)
        out["lines"] = lines
        for jobs in (1, 2):
            log(f"corpus: {files} files, {lines} lines, -j {jobs} ({runs} runs)")
            times = []
            for _ in range(runs):
                start = time.perf_counter()
                proc = subprocess.run([script, folder, "--check", "--no-cache", "-j", str(jobs)], stdout=subprocess.DEVNULL,
                                      stderr=subprocess.DEVNULL)
                times.append(time.perf_counter() - start)
                if proc.returncode != 1:  # every generated script would change
                    sys.exit(f"corpus run exited {proc.returncode}")
            out[f"seconds_j{jobs}"] = statistics.median(times)
            out[f"lines_per_s_j{jobs}"] = lines / statistics.median(times)
    return out


def corpus_report(c: dict) -> str:
    return "\n".join([
        f"Whole command over {c['files']} generated training scripts ({c['lines']} lines), "
        f"`accelerate-rewrite FOLDER --check --no-cache -j J`, median of {c['runs']} runs:",
        "",
        "| processes | seconds | lines/s |",
        "| --- | --- | --- |",
        f"| 1 | {c['seconds_j1']:.1f} | **{c['lines_per_s_j1']:.0f}** |",
        f"| 2 | {c['seconds_j2']:.1f} | **{c['lines_per_s_j2']:.0f}** |",
    ])


# ---- profile (optional) --------------------------------------------------------------------


#: libcst's tree-walk frames: every visit recurses through them, so they top any cumulative list
_WALK = ("libcst/_nodes/", "libcst/_batched_visitor.py", "libcst/_visitors.py",
         "libcst/matchers/_visitors.py")


def profile(top: int) -> None:
    files = fixture_sources()
    for path, source in files:  # warm up outside the profile
        api.rewrite(source, Options.create(), path=path)
    prof = cProfile.Profile()
    prof.enable()
    for path, source in files:
        api.rewrite(source, Options.create(), path=path)
    prof.disable()
    stats = pstats.Stats(prof)
    rows = []
    for (filename, line, func), (_cc, calls, _tt, cumulative, _callers) in stats.stats.items():
        norm = filename.replace(os.sep, "/")
        for marker in ("/accelerate_rewrite/", "/libcst/"):
            if marker in norm:
                short = marker.strip("/") + "/" + norm.split(marker, 1)[1]
                rows.append((cumulative, calls, short, f"{short}:{line}({func})"))
                break
    rows.sort(reverse=True)
    total = rows[0][0] if rows else stats.total_tt  # engine.rewrite, all of the rewrites
    print(f"cProfile of {len(files)} rewrites (default options, after a warm-up pass): "
          f"{total:.2f} s in the rewrites under the profiler")
    rest = [r for r in rows if not r[2].startswith(_WALK)]
    for title, selected in (
        (f"top {top} by cumulative time, accelerate_rewrite/ and libcst/", rows),
        (f"top {top} without libcst's tree-walk frames ({', '.join(_WALK)})", rest),
    ):
        print(title + ":")
        for cumulative, calls, _short, name in selected[:top]:
            share = 100 * cumulative / total
            print(f"  {cumulative:7.2f} s {share:5.1f} % {calls:>8} calls  {name}")


# ---- reports -------------------------------------------------------------------------------


def _runs(n: int, median: bool = False) -> str:
    return "1 run" if n == 1 else (f"median of {n} runs" if median else f"{n} runs")


def text_report(m: dict, t: dict, s: Optional[dict], cold: list[dict], took: float) -> str:
    out = [
        f"machine: {m['cpu']}, {m['cores']} cores, {m['os']}, {m['python']}, "
        f"libcst {m['libcst']}, accelerate-rewrite {m['package']} ({m['commit']}), "
        f"load average at start {m['load']}, {m['date']}",
        "",
        f"rewrite throughput: {t['files']} fixtures ({t['lines']} lines) x "
        f"{len(t['option_sets'])} option sets, median of {t['rounds']} round(s) after a "
        "warm-up pass",
        f"  {t['lines_per_s']:.0f} lines/s (rounds: "
        + ", ".join(f"{v:.0f}" for v in t["lines_per_s_rounds"]) + ")",
        "  by option set: " + ", ".join(
            f"{name} {v:.0f}" for name, v in t["lines_per_s_by_set"].items()) + " lines/s",
        f"  per rewrite: min {t['ms_min']:.0f} ms, median {t['ms_median']:.0f} ms, "
        f"max {t['ms_max']:.0f} ms ({t['slowest'][0]}, {t['slowest'][1]})",
        f"  parse + analysis: {100 * t['parse_analysis_share']:.0f} % of the rewrite time",
        "  where the time goes:",
    ]
    out += [f"    {100 * share:5.1f} %  {label}" for label, share in t["phases"]]
    if t["missing"]:
        out.append("    (not instrumented, missing from the engine: " + ", ".join(t["missing"])
                   + ")")
    if s:
        out += [
            "",
            f"synthetic input: {s['lines']} lines ({s['models']} models with train/evaluate), "
            f"{_runs(s['runs'])}: {s['seconds']:.2f} s, {s['lines_per_s']:.0f} lines/s; "
            f"{s['changes']} changes, {s['skips']} left alone, {s['dropped']} rules dropped"
            + ("" if s["parse_analysis_share"] is None
               else f"; parse + analysis {100 * s['parse_analysis_share']:.0f} %"),
        ]
    out += ["", "cold start (wall clock, subprocess):"]
    for c in cold:
        out.append(
            f"  {c['command']}: median {c['median_ms']:.0f} ms (min {c['min_ms']:.0f}, "
            f"max {c['max_ms']:.0f}, {c['runs']} runs, exit {'/'.join(map(str, c['exit']))}); "
            + ("torch/lightning imported: " + ", ".join(c["forbidden"][:5]) if c["forbidden"]
               else "no torch/lightning import")
            + f"; imports {c['imports_ms']:.0f} ms under -X importtime, slowest packages: "
            + ", ".join(f"{name} {ms:.0f} ms" for name, ms in c["top_imports"])
        )
    out += ["", f"benchmark took {took:.0f} s"]
    return "\n".join(out)


def markdown_report(m: dict, t: dict, s: Optional[dict], cold: list[dict], took: float) -> str:
    out = [
        "## Rewrite speed",
        "",
        f"Measured {m['date']} at {m['commit']} (accelerate-rewrite {m['package']}); "
        f"the whole benchmark took {took:.0f} s.",
        "",
        "| machine | |",
        "| --- | --- |",
        f"| CPU | {m['cpu']} |",
        f"| cores | {m['cores']} |",
        f"| OS | {m['os']} |",
        f"| Python | {m['python']} |",
        f"| libcst | {m['libcst']} |",
        f"| load average at start (1, 5, 15 min) | {m['load']} |",
        "",
        "### Rewrite throughput",
        "",
        f"The engine API (`rewrite(source, Options.create(**opts), path=...)`) over the "
        f"{t['files']} `fixtures/*/input.py` ({t['lines']} lines) with each of the option sets "
        + ", ".join(f"`{n}`" for n in t["option_sets"])
        + f": {t['rewrites_per_round']} rewrites a round, one warm-up pass, then "
        f"{t['rounds']} measured rounds.",
        "",
        "| figure | value |",
        "| --- | --- |",
        f"| throughput, median of {t['rounds']} rounds | **{t['lines_per_s']:.0f} lines/s** "
        f"(rounds: " + ", ".join(f"{v:.0f}" for v in t["lines_per_s_rounds"]) + ") |",
    ]
    out += [f"| throughput, `{name}` only | {v:.0f} lines/s |"
            for name, v in t["lines_per_s_by_set"].items()]
    out += [
        f"| per rewrite (median over the rounds of each fixture and option set): min / median "
        f"/ max | {t['ms_min']:.0f} / **{t['ms_median']:.0f}** / {t['ms_max']:.0f} ms |",
        f"| slowest | `{t['slowest'][0]}`, `{t['slowest'][1]}` |",
        "",
        "Where the time goes, as a share of all the measured rewrite time (parsing timed "
        "alone, once per fixture and round; the engine steps timed by wrapping them during "
        "the rounds):",
        "",
        "| step | share |",
        "| --- | --- |",
    ]
    out += [f"| {label} | {100 * share:.0f} % |" for label, share in t["phases"]]
    out += [
        "",
        f"Parse + analysis (`ScriptFacts(libcst.parse_module(src))`) is "
        f"{100 * t['parse_analysis_share']:.0f} % of it; the rest is the rules, applying their "
        "edits, generating the code and checking the result.",
    ]
    if t["missing"]:
        out += ["", "Not instrumented (no longer in the engine): " + ", ".join(t["missing"])
                + "."]
    if s:
        out += [
            "",
            "### A large input",
            "",
            f"A generated module of {s['lines']} lines in the style of "
            f"`fixtures/train_function`: {s['models']} classifiers, each with its own "
            "`train()` / `evaluate()`, all built and trained in one `main()`; default options, "
            f"{_runs(s['runs'], median=True)}. "
            f"**{s['seconds']:.2f} s, {s['lines_per_s']:.0f} lines/s**"
            + ("" if s["parse_analysis_share"] is None
               else f" (parse + analysis {100 * s['parse_analysis_share']:.0f} %)")
            + f"; {s['changes']} changes, {s['skips']} places left alone, {s['dropped']} rules "
            "dropped, and the result compiles.",
        ]
    out += [
        "",
        "### Cold start",
        "",
        "The console script as a subprocess, wall clock: one untimed run, then the runs "
        "counted below. One more run of each under `python -X importtime` (which slows it "
        "down a little) checks that neither imports torch or lightning, and adds up the import "
        "time: in all, and per package (the self time of all its modules).",
        "",
        "| command | median | min – max | runs | exit status | torch / lightning imported | "
        "imports (under `-X importtime`) | slowest packages |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for c in cold:
        out.append(
            f"| `{c['command']}` | **{c['median_ms']:.0f} ms** | {c['min_ms']:.0f} – "
            f"{c['max_ms']:.0f} ms | {c['runs']} | {'/'.join(map(str, c['exit']))} | "
            + (("**yes**: " + ", ".join(f"`{n}`" for n in c["forbidden"][:5]))
               if c["forbidden"] else "no")
            + f" | {c['imports_ms']:.0f} ms | "
            + ", ".join(f"`{n}` {ms:.0f} ms" for n, ms in c["top_imports"]) + " |"
        )
    out += ["", f"(`--check` exits 1 because `{COLD_CHECK_TARGET}` would change.)"]
    return "\n".join(out)


def main(argv: Optional[list[str]] = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if "--goals" in argv:  # issue 15's figures: TorchFix side by side, sizes, cache, -j, pre-commit
        from speed_goals import main as goals

        return goals([a for a in argv if a != "--goals"])
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="print a markdown section")
    parser.add_argument("--rounds", type=int, default=3, help="measured rounds (default 3)")
    parser.add_argument("--synthetic-lines", type=int, default=2000,
                        help="size of the synthetic input, 0 to skip (default 2000)")
    parser.add_argument("--synthetic-runs", type=int, default=1,
                        help="rewrites of the synthetic input (default 1)")
    parser.add_argument("--cold-runs", type=int, default=10,
                        help="timed runs of each command for the cold start (default 10)")
    parser.add_argument("--corpus", type=int, default=40, metavar="FILES",
                        help="generated scripts for the whole-command run with 1 and 2 processes, "
                        "0 to skip (default 40)")
    parser.add_argument("--profile", nargs="?", type=int, const=15, metavar="TOP",
                        help="instead of the benchmark, profile one pass over the fixtures "
                        "with cProfile and print the TOP (15) cumulative functions")
    real_args = parser.add_argument_group("the real corpus (benchmarks/real_speed.py), measured first")
    real_args.add_argument("--torchfix", metavar="PATH",
                           help="TorchFix's console script, in a venv of its own (torchfix==0.7.0)")
    real_args.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"),
                           help="git mirrors of the real corpus's repositories (default /work/.mirror)")
    real_args.add_argument("--real-runs", type=int, default=3, help="runs of each measurement (default 3)")
    real_args.add_argument("--trees", type=Path, metavar="DIR",
                           help="extract the repositories' trees here and keep them (default: a scratch folder)")
    real_args.add_argument("--only", action="append", metavar="PATTERN",
                           help="the real scripts whose repo or path contains PATTERN (repeatable)")
    real_args.add_argument("--no-real", action="store_true", help="leave the real corpus out")
    real_args.add_argument("--real-only", action="store_true", help="measure the real corpus only")
    real_args.add_argument("--real-profile", nargs="?", type=int, const=25, metavar="TOP",
                           help="instead of the benchmark, cProfile the command over the real corpus")
    args = parser.parse_args(argv)
    if args.profile is not None:
        profile(args.profile)
        return 0
    import real_speed

    if args.real_profile is not None:
        real_speed.profile(args.real_profile, args.mirrors, args.trees, args.only)
        return 0
    if args.rounds < 1 or args.cold_runs < 1 or args.synthetic_runs < 1:
        parser.error("--rounds, --cold-runs and --synthetic-runs take a count >= 1")

    started = time.perf_counter()
    info = machine()
    real = None if args.no_real else real_speed.measure(args.torchfix, args.real_runs, args.mirrors, args.trees,
                                                        args.only)
    if real is not None or args.real_only:
        version = None
        if args.torchfix:
            done = subprocess.run([args.torchfix, "--version"], capture_output=True, text=True)
            version = "TorchFix " + (done.stdout or done.stderr).strip()
        print(("## Rewrite speed on real code\n\n" if args.markdown else "")
              + f"Measured {info['date']} at {info['commit']} (accelerate-rewrite {info['package']}) on "
              f"{info['cpu']}, {info['cores']} cores, {info['python']}, libcst {info['libcst']}; load average at "
              f"start {info['load']}.\n")
        print(real_speed.report(real, version) if real is not None else f"(no mirrors in {args.mirrors})")
        if args.real_only:
            return 0
        print()
    t = throughput(args.rounds)
    s = synthetic(args.synthetic_lines, args.synthetic_runs)
    torch_in_process = [m for m in sys.modules if m.split(".")[0] in FORBIDDEN_IMPORTS]
    cold = cold_start(args.cold_runs)
    c = corpus(args.corpus)
    took = time.perf_counter() - started
    report = markdown_report if args.markdown else text_report
    print(report(info, t, s, cold, took))
    if c is not None:
        print("\n" + corpus_report(c))
    if torch_in_process:
        print(f"\nWARNING: the rewrites imported {', '.join(sorted(torch_in_process)[:5])}")
    bad = torch_in_process or any(c["forbidden"] for c in cold)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
