"""Issues 15's and 30's figures, from one run: the rewrite's cost in LibCST parses, this tool side
by side with TorchFix, the size curve, the cache, -j1 against -jN, and the pre-commit hook.

    python3 -m venv /tmp/torchfix-venv && /tmp/torchfix-venv/bin/pip install torchfix==0.7.0
    .venv/bin/python benchmarks/rewrite_speed.py --goals --torchfix /tmp/torchfix-venv/bin/torchfix --markdown

(``benchmarks/rewrite_speed.py --goals`` runs this module; TorchFix lives in a virtual
environment of its own, never a dependency of the package.) Every figure is a whole command
run as a subprocess: wall clock, CPU seconds (user + system, its processes included) and peak
RSS, from ``os.wait4``.

0. **Cost in parses** (issue 30; machine-independent): in one child process, the CPU seconds
   of ``libcst.parse_module`` over a corpus's files (the faster of two passes) and of
   ``accelerate_rewrite.api.rewrite`` over them (bf16-mixed on 2 devices, the cache out of it, the
   facts' memo cleared, after one warm-up rewrite), and their ratio; Python's ``ast.parse`` for
   scale. Also the ratio to the parse of every distinct text the rewrites parsed (a script
   that imports its project's modules reads them too), and LibCST's parse under the collector's
   thresholds the rewrite runs with. Over the generated corpus below, and over the real corpus (benchmarks/real_corpus.py's
   scripts, extracted from the git mirrors in ``--mirrors`` when they are there).
1. **Side by side**: the corpus of benchmarks/corpus.py (the fixtures and generated training
   scripts: 239 files, 38k lines) checked by ``accelerate-rewrite CORPUS --check --precision
   bf16-mixed --devices 2 --no-cache`` and by ``torchfix CORPUS``, each with its default number
   of processes (the cores), taken in turn for ``--rounds`` rounds; medians, and their ratio.
2. **One process each**: the same two commands with ``-j 1`` (once each): CPU seconds side by
   side, and -j 1 against -jN.
3. **Size curve**: one generated training script of each of ``--sizes`` lines (the style of
   fixtures/train_function: many classifiers, each with its train()/evaluate()), ``--check
   --no-cache``: seconds, lines per second, peak RSS.
4. **Cache**: the corpus once more with the cache filled (median of 3), and one file
   (``fixtures/module_loop/input.py``, ``--check``) with and without it (medians).
5. **Pre-commit**: ``--pre-commit`` on a copy of fixtures/module_loop/input.py (a training script
   with nothing to fix) with a warm cache and without one, and the imports of the warm run
   (``python -X importtime``): what its time is made of.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from corpus import n_lines, synthetic_of_lines, write_corpus  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
ONE_FILE = ROOT / "fixtures" / "module_loop" / "input.py"
FULL = ["--check", "--precision", "bf16-mixed", "--devices", "2"]


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def console_script() -> str:
    found = shutil.which("accelerate-rewrite", path=str(Path(sys.executable).parent))
    if not found:
        sys.exit("the accelerate-rewrite console script is not installed next to this Python")
    return found


def timed(cmd: list[str], cwd: Optional[Path] = None) -> dict:
    """One run of ``cmd``: wall seconds, CPU seconds, peak RSS (MiB), exit status."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=cwd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - start
    proc.returncode = os.waitstatus_to_exitcode(status)
    return {"wall": wall, "cpu": usage.ru_utime + usage.ru_stime, "rss": usage.ru_maxrss / 1024,
            "exit": proc.returncode}


def median_of(runs: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in runs)


def side_by_side(tool: str, torchfix: Optional[str], corpus: Path, rounds: int) -> dict:
    ours, theirs = [], []
    for r in range(rounds):
        log(f"side by side: round {r + 1}/{rounds}: accelerate-rewrite")
        ours.append(timed([tool, str(corpus), *FULL, "--no-cache"]))
        if torchfix:
            log(f"side by side: round {r + 1}/{rounds}: torchfix")
            theirs.append(timed([torchfix, str(corpus)]))
    log("-j 1: accelerate-rewrite")
    j1 = timed([tool, str(corpus), *FULL, "--no-cache", "-j", "1"])
    theirs_j1 = None
    if torchfix:
        log("-j 1: torchfix")
        theirs_j1 = timed([torchfix, str(corpus), "-j", "1"])
    return {"ours": ours, "theirs": theirs, "j1": j1, "theirs_j1": theirs_j1}


#: run in a child process by ``parse_costs``: prints one JSON line
_COSTS = r'''
import ast, gc, json, sys, time
import libcst
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
import accelerate_rewrite.codemod.engine as engine
files = [line for line in open(sys.argv[1]).read().splitlines() if line]
sources = []
for f in files:
    try:
        sources.append((f, open(f, encoding="utf-8").read()))
    except (OSError, UnicodeDecodeError):
        pass
def cpu(fn):
    gc.collect()
    start = time.process_time()
    fn()
    return time.process_time() - start
parse = min(cpu(lambda: [libcst.parse_module(s) for _, s in sources]) for _ in range(2))
py = min(cpu(lambda: [ast.parse(s) for _, s in sources]) for _ in range(2))
def fewer():
    with engine.fewer_collections():
        return [libcst.parse_module(s) for _, s in sources]
parse_fewer = min(cpu(fewer) for _ in range(2))
options = Options.create(precision="bf16-mixed", devices=2)
rewrite(sources[0][1], options, path=sources[0][0])
engine._analyse.cache_clear(); engine._parsed.cache_clear()
read = []  # every text the rewrites parse: the scripts and the project's modules they read
real_parse = libcst.parse_module
libcst.parse_module = lambda text, *a, **k: read.append(text) or real_parse(text, *a, **k)
def every():
    for path, source in sources:
        rewrite(source, options, path=path)
        engine._analyse.cache_clear(); engine._parsed.cache_clear()
took = cpu(every)
libcst.parse_module = real_parse
texts = list(dict.fromkeys(read))
parse_all = min(cpu(lambda: [real_parse(t) for t in texts]) for _ in range(2))
print(json.dumps({"files": len(sources), "lines": sum(s.count("\n") for _, s in sources),
                  "parse": parse, "ast": py, "rewrite": took, "parse_fewer": parse_fewer,
                  "read": len(texts), "parse_all": parse_all, "parses": len(read)}))
'''


def parse_costs(files: list[Path], folder: Path, label: str) -> Optional[dict]:
    """The rewrite's CPU seconds over ``files`` in LibCST parses of them (one child process)."""
    if not files:
        return None
    listing = folder / f"{label}.txt"
    listing.write_text("\n".join(str(f) for f in files), encoding="utf-8")
    log(f"cost in parses: {label} ({len(files)} files)")
    proc = subprocess.run([sys.executable, "-c", _COSTS, str(listing)], capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        log(proc.stderr[-2000:])
        return None
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["label"] = label
    return out


def real_files(mirrors: Path, folder: Path) -> list[Path]:
    """The real corpus's scripts (benchmarks/real_corpus.py), extracted from the mirrors there are."""
    from real_corpus import extract, git_dir, read_tsv

    tables = [ROOT.parent / "shared" / "real-corpus" / "scripts.tsv", ROOT / "benchmarks" / "real-corpus-more.tsv"]
    out: list[Path] = []
    for entry in [e for t in tables if t.exists() for e in read_tsv(t)]:
        gitdir = git_dir(mirrors, entry.repo)
        dest = folder / entry.key
        if not gitdir.exists():
            continue
        if not dest.exists():
            try:
                extract(gitdir, entry.commit, dest)
            except (subprocess.CalledProcessError, OSError):
                continue
        script = dest / entry.script
        if script.exists() and script not in out:
            out.append(script)
    return out


def size_curve(tool: str, sizes: list[int], folder: Path) -> list[dict]:
    out = []
    for target in sizes:
        text = synthetic_of_lines(target)
        path = folder / f"train_{target}.py"
        path.write_text(text, encoding="utf-8")
        lines = n_lines(text)
        log(f"size curve: {lines} lines")
        run = timed([tool, str(path), "--check", "--no-cache"])
        out.append({"lines": lines, **run})
    return out


def cache_runs(tool: str, corpus: Path, cache: Path, rounds: int) -> dict:
    log("cache: filling it over the corpus")
    fill = timed([tool, str(corpus), *FULL, "--cache-dir", str(cache)])
    warm = [timed([tool, str(corpus), *FULL, "--cache-dir", str(cache)]) for _ in range(3)]
    log("cache: one file")
    args = [tool, str(ONE_FILE), "--check", "--cache-dir", str(cache)]
    timed(args)
    one_warm = [timed(args) for _ in range(rounds)]
    one_cold = [timed([tool, str(ONE_FILE), "--check", "--no-cache"]) for _ in range(3)]
    return {"fill": fill, "warm": warm, "one_warm": one_warm, "one_cold": one_cold}


def pre_commit(tool: str, folder: Path, cache: Path, rounds: int) -> dict:
    script = folder / "train.py"
    shutil.copyfile(ONE_FILE, script)
    args = [tool, "--pre-commit", "train.py", "--cache-dir", str(cache)]
    timed(args, cwd=folder)
    warm = [timed(args, cwd=folder) for _ in range(rounds)]
    cold = [timed([tool, "--pre-commit", "train.py", "--no-cache"], cwd=folder) for _ in range(3)]
    assert script.read_bytes() == ONE_FILE.read_bytes(), "the hook changed a script it has nothing to fix in"
    proc = subprocess.run([sys.executable, "-X", "importtime", tool, *args[1:]], cwd=folder,
                          capture_output=True, text=True)
    pattern = re.compile(r"^import time:\s+(\d+) \|\s+(\d+) \|( *)(\S+)")
    by_package: dict[str, int] = {}
    for line in proc.stderr.splitlines():
        found = pattern.match(line)
        if found:
            package = found.group(4).split(".")[0]
            by_package[package] = by_package.get(package, 0) + int(found.group(1))
    top = sorted(by_package.items(), key=lambda item: -item[1])
    return {"warm": warm, "cold": cold, "imports_ms": sum(by_package.values()) / 1e3,
            "top": [(name, us / 1e3) for name, us in top[:6]],
            "libcst": "libcst" in by_package, "rich": "rich" in by_package}


def run(torchfix: Optional[str], sizes: list[int], rounds: int, generated: int = 208,
        mirrors: Optional[Path] = None) -> dict:
    tool = console_script()
    with tempfile.TemporaryDirectory(prefix="speed-goals-") as tmp:
        folder = Path(tmp)
        corpus = folder / "corpus"
        files, lines = write_corpus(corpus, generated)
        log(f"corpus: {files} files, {lines} lines")
        out: dict = {"files": files, "lines": lines, "cores": len(os.sched_getaffinity(0))}
        real = real_files(mirrors, folder / "real") if mirrors is not None and mirrors.is_dir() else []
        out["costs"] = [c for c in (parse_costs(sorted(corpus.glob("*.py")), folder, "generated corpus"),
                                    parse_costs(real, folder, "real corpus")) if c is not None]
        out["side"] = side_by_side(tool, torchfix, corpus, rounds)
        out["cache"] = cache_runs(tool, corpus, folder / "cache", 10)
        hook = folder / "hook"
        hook.mkdir()
        out["pre_commit"] = pre_commit(tool, hook, folder / "cache", 10)
        sizes_folder = folder / "sizes"
        sizes_folder.mkdir()
        out["sizes"] = size_curve(tool, sizes, sizes_folder)
    if torchfix:
        version = subprocess.run([torchfix, "--version"], capture_output=True, text=True)
        out["torchfix"] = (version.stdout or version.stderr).strip()
    return out


def markdown(g: dict) -> str:
    s = g["side"]
    ours_wall, ours_cpu = median_of(s["ours"], "wall"), median_of(s["ours"], "cpu")
    lines = [
        f"Corpus: {g['files']} files, {g['lines']} lines (benchmarks/corpus.py: the fixtures and "
        "generated training scripts of eight shapes); each command run as a subprocess.",
        "",
        "| command | wall (median) | CPU s (median) | lines/s (wall) | peak RSS | runs |",
        "| --- | --- | --- | --- | --- | --- |",
        f"| `accelerate-rewrite CORPUS --check --precision bf16-mixed --devices 2 --no-cache` (-j {g['cores']}) "
        f"| {ours_wall:.1f} s | {ours_cpu:.1f} | {g['lines'] / ours_wall:.0f} | "
        f"{max(r['rss'] for r in s['ours']):.0f} MiB | {len(s['ours'])} |",
    ]
    if s["theirs"]:
        tf_wall, tf_cpu = median_of(s["theirs"], "wall"), median_of(s["theirs"], "cpu")
        lines.append(f"| `torchfix CORPUS` ({g.get('torchfix', 'TorchFix')}, -j {g['cores']}) | {tf_wall:.1f} s | "
                     f"{tf_cpu:.1f} | {g['lines'] / tf_wall:.0f} | "
                     f"{max(r['rss'] for r in s['theirs']):.0f} MiB | {len(s['theirs'])} |")
    j1 = s["j1"]
    lines.append(f"| the same rewrite, `-j 1` | {j1['wall']:.1f} s | {j1['cpu']:.1f} | "
                 f"{g['lines'] / j1['wall']:.0f} | {j1['rss']:.0f} MiB | 1 |")
    t1 = s.get("theirs_j1")
    if t1:
        lines.append(f"| `torchfix CORPUS -j 1` | {t1['wall']:.1f} s | {t1['cpu']:.1f} | "
                     f"{g['lines'] / t1['wall']:.0f} | {t1['rss']:.0f} MiB | 1 |")
    lines.append("")
    if s["theirs"]:
        lines.append(f"**Ratio** (TorchFix / this tool): **{tf_wall / ours_wall:.2f}x** wall, "
                     f"**{tf_cpu / ours_cpu:.2f}x** CPU"
                     + (f"; one process each: **{t1['cpu'] / j1['cpu']:.2f}x** CPU" if t1 else "")
                     + f". -j {g['cores']} against -j 1: {j1['wall'] / ours_wall:.2f}x faster.")
    if g.get("costs"):
        lines += ["", "Cost in parses (one process: `libcst.parse_module` of the files, then "
                  "`accelerate_rewrite.api.rewrite` of them at bf16-mixed on 2 devices; CPU seconds):", "",
                  "| files | lines | LibCST parse | `ast.parse` | rewrite | rewrite / parse | texts the rewrites "
                  "parse (distinct; parse calls) | their parse | rewrite / their parse |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for c in g["costs"]:
            lines.append(f"| {c['label']}: {c['files']} | {c['lines']} | {c['parse']:.2f} s | {c['ast']:.2f} s | "
                         f"{c['rewrite']:.2f} s | **{c['rewrite'] / c['parse']:.1f}** | {c['read']} ({c['parses']}) | "
                         f"{c['parse_all']:.2f} s | **{c['rewrite'] / c['parse_all']:.1f}** |")
        lines += ["", "LibCST's parse with the collector's thresholds the rewrite runs under "
                  "(engine.fewer_collections): " + ", ".join(f"{c['label']} {c['parse_fewer']:.2f} s "
                                                             f"({c['parse_fewer'] / c['parse']:.2f}x)" for c in g["costs"])
                  + "; the ratios above count parses at CPython's default thresholds."]
    lines += ["", "Size curve (one generated training script, `--check --no-cache`, one process):", "",
              "| lines | seconds | lines/s | CPU s | peak RSS | KB a line |", "| --- | --- | --- | --- | --- | --- |"]
    for r in g["sizes"]:
        lines.append(f"| {r['lines']} | {r['wall']:.1f} | {r['lines'] / r['wall']:.0f} | {r['cpu']:.1f} | "
                     f"{r['rss']:.0f} MiB | {r['rss'] * 1024 / r['lines']:.0f} |")
    if len(g["sizes"]) > 1:
        small, big = g["sizes"][0], g["sizes"][-1]
        lines += ["", f"Per-line CPU cost at {big['lines']} lines: **{(big['cpu'] / big['lines']) / (small['cpu'] / small['lines']):.2f}x** "
                  f"that at {small['lines']} (the smaller one carries the start-up)."]
    c, p = g["cache"], g["pre_commit"]
    lines += ["", "Cache and pre-commit (medians):", "", "| command | wall | CPU s | runs |", "| --- | --- | --- | --- |",
              f"| the corpus, cache being filled | {c['fill']['wall']:.1f} s | {c['fill']['cpu']:.1f} | 1 |",
              f"| the corpus, every file in the cache | **{median_of(c['warm'], 'wall'):.2f} s** | "
              f"{median_of(c['warm'], 'cpu'):.2f} | {len(c['warm'])} |",
              f"| `--check fixtures/module_loop/input.py`, no cache | {median_of(c['one_cold'], 'wall') * 1e3:.0f} ms | "
              f"{median_of(c['one_cold'], 'cpu'):.2f} | {len(c['one_cold'])} |",
              f"| the same, from the cache | **{median_of(c['one_warm'], 'wall') * 1e3:.0f} ms** | "
              f"{median_of(c['one_warm'], 'cpu'):.2f} | {len(c['one_warm'])} |",
              f"| `--pre-commit train.py` (module_loop: nothing to fix), no cache | "
              f"{median_of(p['cold'], 'wall') * 1e3:.0f} ms | {median_of(p['cold'], 'cpu'):.2f} | {len(p['cold'])} |",
              f"| the same, from the cache | **{median_of(p['warm'], 'wall') * 1e3:.0f} ms** | "
              f"{median_of(p['warm'], 'cpu'):.2f} | {len(p['warm'])} |",
              "",
              f"The cached pre-commit run's imports (`python -X importtime`, which slows them): "
              f"{p['imports_ms']:.0f} ms in all; " + ", ".join(f"`{n}` {ms:.0f} ms" for n, ms in p["top"])
              + f"; libcst imported: {'yes' if p['libcst'] else 'no'}, rich: {'yes' if p['rich'] else 'no'}."]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchfix", metavar="PATH", help="TorchFix's console script (its own venv)")
    parser.add_argument("--sizes", default="1000,5000,20000,50000",
                        help="lines of the size curve's scripts (default 1000,5000,20000,50000)")
    parser.add_argument("--rounds", type=int, default=2, help="side-by-side rounds (default 2)")
    parser.add_argument("--generated", type=int, default=208, help="generated scripts in the corpus (default 208)")
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"),
                        help="git mirrors of the real corpus's repositories (default /work/.mirror)")
    parser.add_argument("--markdown", action="store_true", help="(the only output: markdown tables)")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    goals = run(args.torchfix, [int(s) for s in args.sizes.split(",") if s], args.rounds, args.generated,
                args.mirrors)
    print(markdown(goals))
    print(f"\n(the whole run took {time.perf_counter() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
