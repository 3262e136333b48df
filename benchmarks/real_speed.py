"""The rewrite's speed on real code (issue 49): the real corpus's scripts, each rewritten as its
user would, beside one LibCST parse of it and beside TorchFix on the same file.

    python3 -m venv /tmp/torchfix-venv && /tmp/torchfix-venv/bin/pip install torchfix==0.7.0
    .venv/bin/python benchmarks/rewrite_speed.py --real-only --torchfix /tmp/torchfix-venv/bin/torchfix --markdown
    .venv/bin/python benchmarks/rewrite_speed.py --real-profile 25     # where the time goes (cProfile)

(benchmarks/rewrite_speed.py runs this first; ``--real-only`` runs nothing else.) The corpus is
benchmarks/real_corpus.py's: ``../shared/real-corpus/scripts.tsv``, ``benchmarks/real-corpus-more.tsv``
and ``benchmarks/real-corpus-46.tsv``, each script's repository tree taken at its commit from the
git mirrors (real_corpus.extract) into a scratch folder. For each script, in its own folder (its
project's modules beside it, followed as the command follows them), ``--real-runs`` times (3),
each measurement a fresh process, taken in turn; CPU seconds (user + system); the medians:

- **rewrite**: in a fresh process of this Python, after the imports and one warm-up run of the
  command on fixtures/module_loop/input.py, the command's own function
  (``accelerate_rewrite.cli.main``) called with ``SCRIPT --precision bf16-mixed --devices 4
  --no-cache``: what the command does for the file (its options and configuration, the project
  followed, the rewrite with every check, the diff printed), without the interpreter's start-up.
- **parse**: in the same process, before that, ``libcst.parse_module`` of the script's text
  (the faster of two; CPython's default collector thresholds). **parses** = rewrite / parse.
- **TorchFix**: in a fresh process of TorchFix's own venv, after its imports and one warm-up run
  on the same fixture, TorchFix's command function (``torchfix.__main__.main``, argv ``torchfix
  SCRIPT``: with one file LibCST's codemod runner works in that process).
- **whole commands** (the start-up included): ``accelerate-rewrite SCRIPT --precision bf16-mixed
  --devices 4 --no-cache`` and ``torchfix SCRIPT`` as subprocesses (``os.wait4``).
- **API**: in a fresh process, ``accelerate_rewrite.api.rewrite(text, options, path=SCRIPT)``
  alone (the project followed, none of it writable, so no scan for the files that import its
  modules), after a warm-up rewrite of the fixture.
- **their parses**: the rewrite over one parse of every text the engine parsed as input (the
  script and the project's modules it follows), taken in the same process as the rewrite.

Every child runs with Python's bytecode written and read (``environment``), as a pip install
has it; both tools run once untimed first, to write it.

One process each: no ``-j``, no pool. Reported per script, then the median of the scripts'
parses, the parses of all of them together (total rewrite / total parse), and TorchFix's total
CPU seconds over this tool's (in-process, and as whole commands).
"""

from __future__ import annotations

import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
sys.path.insert(0, str(HERE))

from real_corpus import DEFAULT_MIRRORS, DEFAULT_TSV, MORE_TSV, RESEARCH_TSV, Entry, extract, git_dir, read_tsv  # noqa: E402

#: the headline's options, as real_corpus.py's "fabric" set
ARGS = ["--precision", "bf16-mixed", "--devices", "4", "--no-cache"]
WARM_UP = ROOT / "fixtures" / "module_loop" / "input.py"
TABLES = (DEFAULT_TSV, MORE_TSV, RESEARCH_TSV)


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


#: a fresh process of this Python: argv[1] JSON {"script", "cwd", "out", "args", "warm"}; writes
#: {"parse", "rewrite", "exit"} (CPU seconds) to "out"
_OURS = r'''
import gc, json, os, sys, time
job = json.loads(sys.argv[1])
import libcst
from accelerate_rewrite.cli import main
def command(path, cwd):
    os.chdir(cwd)
    try:
        main([path, *job["args"]])
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
warm = job["warm"]
command(os.path.basename(warm), os.path.dirname(warm))
with open(os.path.join(job["cwd"], job["script"]), encoding="utf-8", errors="replace") as f:
    text = f.read()
def cpu(fn):
    gc.collect()
    start = time.process_time()
    out = fn()
    return time.process_time() - start, out
parse = min(cpu(lambda: libcst.parse_module(text))[0] for _ in range(2))
import accelerate_rewrite.codemod.reading as reading
read, real_parse = [], reading.parse_module  # the texts the engine parses: the script, its project's modules
reading.parse_module = lambda source, *a, **k: read.append(source) or real_parse(source, *a, **k)
rewrite, code = cpu(lambda: command(job["script"], job["cwd"]))
reading.parse_module = real_parse
texts = list(dict.fromkeys(read))
project = min(cpu(lambda: [libcst.parse_module(t) for t in texts])[0] for _ in range(2))
with open(job["out"], "w") as f:
    json.dump({"parse": parse, "rewrite": rewrite, "exit": code, "texts": len(texts), "project_parse": project,
               "project_lines": sum(t.count("\n") for t in texts)}, f)
'''

#: a fresh process of this Python: the engine's API alone (``accelerate_rewrite.api.rewrite``, the
#: project followed, nothing of it writable: no scan for the files that import its modules);
#: writes {"api"}
_API = r'''
import gc, json, os, sys, time
job = json.loads(sys.argv[1])
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
options = Options.create(precision="bf16-mixed", devices=4)
def run(path, cwd):
    os.chdir(cwd)
    with open(path, encoding="utf-8", errors="replace") as f:
        text = f.read()
    gc.collect()
    start = time.process_time()
    try:
        rewrite(text, options, path=path)
    except Exception:
        pass
    return time.process_time() - start
warm = job["warm"]
run(os.path.basename(warm), os.path.dirname(warm))
took = run(job["script"], job["cwd"])
with open(job["out"], "w") as f:
    json.dump({"api": took}, f)
'''

#: a fresh process of TorchFix's venv: the same argv; writes {"torchfix", "exit"}
_TORCHFIX = r'''
import gc, json, os, sys, time
job = json.loads(sys.argv[1])
from torchfix.__main__ import main
def command(path, cwd):
    os.chdir(cwd)
    sys.argv = ["torchfix", path]
    try:
        main()
    except SystemExit as exc:
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return 0
warm = job["warm"]
command(os.path.basename(warm), os.path.dirname(warm))
gc.collect()
start = time.process_time()
code = command(job["script"], job["cwd"])
took = time.process_time() - start
with open(job["out"], "w") as f:
    json.dump({"torchfix": took, "exit": code}, f)
'''


def environment(scratch: Path) -> dict[str, str]:
    """The children's environment: Python's bytecode written and read (in a cache folder of the
    run's, ``PYTHONPYCACHEPREFIX``, unless one is set) as on a user's machine, where pip compiles
    what it installs: a start-up that compiles every module of LibCST and the package from
    source (``PYTHONDONTWRITEBYTECODE=1`` and a venv without bytecode) costs as much again."""
    env = dict(os.environ)
    env.pop("ACCELERATE_REWRITE_NO_CACHE", None)
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    env.setdefault("PYTHONPYCACHEPREFIX", str(scratch / "pycache"))
    return env


def cpu_of(cmd: list[str], cwd: Path, env: Optional[dict] = None) -> tuple[float, int]:
    """CPU seconds (user + system) of one subprocess, and its exit status."""
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime, proc.returncode


def in_process(python: str, program: str, script: Path, scratch: Path, env: dict) -> Optional[dict]:
    out = scratch / "measured.json"
    out.unlink(missing_ok=True)
    job = {"script": script.name, "cwd": str(script.parent), "out": str(out), "args": ARGS, "warm": str(WARM_UP)}
    done = subprocess.run([python, "-P", "-c", program, json.dumps(job)], cwd=script.parent, env=env,
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    if not out.exists():
        log(f"  {script}: no figure ({done.stderr.strip().splitlines()[-1:] or done.returncode})")
        return None
    return json.loads(out.read_text())


def entries(tables: tuple[Path, ...] = TABLES, only: Optional[list[str]] = None) -> list[Entry]:
    found = [e for t in tables if t.exists() for e in read_tsv(t)]
    if only:
        found = [e for e in found if any(p.lower() in f"{e.repo}/{e.script}".lower() for p in only)]
    return found


def trees(mirrors: Path, chosen: list[Entry], folder: Path) -> list[tuple[Entry, Path]]:
    """Each entry's script in its repository's tree at its commit (extracted into ``folder``
    once per repository and commit, kept there for a next run)."""
    out = []
    for entry in chosen:
        gitdir = git_dir(mirrors, entry.repo)
        dest = folder / entry.key
        if not gitdir.exists():
            log(f"  no mirror of {entry.repo}: left out")
            continue
        if not dest.exists():
            try:
                extract(gitdir, entry.commit, dest)
            except (subprocess.CalledProcessError, OSError) as exc:
                log(f"  {entry.repo}@{entry.commit[:7]}: not extracted ({exc})")
                shutil.rmtree(dest, ignore_errors=True)
                continue
        script = dest / entry.script
        if script.is_file():
            out.append((entry, script))
        else:
            log(f"  {entry.repo}@{entry.commit[:7]} has no {entry.script}: left out")
    return out


def measure(torchfix: Optional[str], runs: int = 3, mirrors: Path = DEFAULT_MIRRORS,
            keep: Optional[Path] = None, only: Optional[list[str]] = None) -> Optional[dict]:
    """The per-script figures and their summary; None when no mirror is there."""
    if not mirrors.is_dir():
        return None
    tool = shutil.which("accelerate-rewrite", path=str(Path(sys.executable).parent))
    if not tool:
        sys.exit("the accelerate-rewrite console script is not installed next to this Python")
    tf_python = str(Path(torchfix).parent / "python") if torchfix else None
    scratch = Path(tempfile.mkdtemp(prefix="real-speed-"))
    folder = keep if keep is not None else scratch / "trees"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    rows = []
    try:
        scripts = trees(mirrors, entries(only=only), folder)
        env = environment(scratch)
        # the bytecode of both tools written first (untimed)
        cpu_of([tool, WARM_UP.name, *ARGS], WARM_UP.parent, env)
        if torchfix:
            cpu_of([torchfix, WARM_UP.name], WARM_UP.parent, env)
        log(f"real corpus: {len(scripts)} scripts, {runs} runs each")
        for i, (entry, script) in enumerate(scripts, 1):
            got: dict[str, list] = defaultdict(list)
            exits: set = set()
            for _ in range(runs):  # each measurement once a round, in turn
                ours = in_process(sys.executable, _OURS, script, scratch, env)
                if ours:
                    for key in ("parse", "rewrite", "project_parse", "texts", "project_lines"):
                        got[key].append(ours[key])
                    exits.add(ours["exit"])
                api = in_process(sys.executable, _API, script, scratch, env)
                if api:
                    got["api"].append(api["api"])
                seconds, code = cpu_of([tool, script.name, *ARGS], script.parent, env)
                got["ours_cmd"].append(seconds)
                exits.add(code)
                if torchfix:
                    theirs = in_process(tf_python, _TORCHFIX, script, scratch, env)
                    if theirs:
                        got["torchfix"].append(theirs["torchfix"])
                    got["torchfix_cmd"].append(cpu_of([torchfix, script.name], script.parent, env)[0])
            if not got["rewrite"]:
                continue
            text = script.read_text(encoding="utf-8", errors="replace")
            row = {"repo": entry.repo, "script": entry.script, "lines": text.count("\n"),
                   "exit": sorted(exits, key=str), **{k: statistics.median(v) for k, v in got.items() if v}}
            row["parses"] = row["rewrite"] / row["parse"]
            row["project_parses"] = row["rewrite"] / row["project_parse"]
            rows.append(row)
            log(f"[{i}/{len(scripts)}] {entry.repo} {entry.script}: {row['lines']} lines, parse "
                f"{row['parse']:.3f} s, rewrite {row['rewrite']:.3f} s ({row['parses']:.1f} parses)"
                + (f", TorchFix {row['torchfix']:.3f} s" if "torchfix" in row else "")
                + f" ({time.perf_counter() - started:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    return {"rows": rows, "runs": runs, "summary": summarise(rows), "seconds": time.perf_counter() - started}


def summarise(rows: list[dict]) -> dict:
    if not rows:
        return {}
    total = {k: sum(r[k] for r in rows) for k in ("parse", "rewrite", "ours_cmd", "project_parse", "api")}
    out = {"scripts": len(rows), "lines": sum(r["lines"] for r in rows), **{f"total_{k}": v for k, v in total.items()},
           "parses_median": statistics.median(r["parses"] for r in rows),
           "parses_total": total["rewrite"] / total["parse"],
           "over_3": sum(1 for r in rows if r["parses"] > 3),
           "project_parses_median": statistics.median(r["project_parses"] for r in rows),
           "project_parses_total": total["rewrite"] / total["project_parse"],
           "followed": sum(1 for r in rows if r["texts"] > 1),
           "api_parses_median": statistics.median(r["api"] / r["parse"] for r in rows),
           "api_parses_total": total["api"] / total["parse"]}
    if all("torchfix" in r for r in rows):
        out["total_torchfix"] = sum(r["torchfix"] for r in rows)
        out["total_torchfix_cmd"] = sum(r["torchfix_cmd"] for r in rows)
        out["torchfix_ratio"] = out["total_torchfix"] / total["rewrite"]
        out["torchfix_ratio_cmd"] = out["total_torchfix_cmd"] / total["ours_cmd"]
        out["torchfix_ratio_median"] = statistics.median(r["torchfix"] / r["rewrite"] for r in rows)
    return out


def report(real: dict, torchfix_version: Optional[str] = None) -> str:
    """Markdown: the summary, then one row a script."""
    s, rows = real["summary"], real["rows"]
    if not rows:
        return "Real corpus: no script measured."
    lines = [
        f"Real corpus: {s['scripts']} scripts ({s['lines']:,} lines), each in its repository's tree; CPU seconds, "
        f"median of {real['runs']} runs, each a fresh process (one process each, no `-j`); {real['seconds']:.0f} s in all.",
        "",
        "| figure | value | goal |",
        "| --- | --- | --- |",
        f"| parses: rewrite / one LibCST parse of the script, median of the scripts | **{s['parses_median']:.2f}** | "
        f"at most 3: {'met' if s['parses_median'] <= 3 else 'not met'} |",
        f"| parses, all scripts together (total rewrite / total parse) | {s['parses_total']:.2f} "
        f"({s['total_rewrite']:.2f} s / {s['total_parse']:.2f} s) | |",
        f"| scripts over 3 parses | {s['over_3']} of {s['scripts']} | |",
        f"| parses of every text the rewrite parses (the script and the project's modules it follows: "
        f"{s['followed']} scripts follow some), median / all together | {s['project_parses_median']:.2f} / "
        f"{s['project_parses_total']:.2f} | |",
        f"| the engine's API alone (`api.rewrite(text, options, path=...)`: the project followed, no scope "
        f"scan), parses, median / all together | {s['api_parses_median']:.2f} / {s['api_parses_total']:.2f} | |",
    ]
    if "torchfix_ratio" in s:
        lines += [
            f"| TorchFix / this tool, total CPU, in process{f' ({torchfix_version})' if torchfix_version else ''} | "
            f"**{s['torchfix_ratio']:.2f}x** ({s['total_torchfix']:.2f} s / {s['total_rewrite']:.2f} s) | "
            f"at least 5x: {'met' if s['torchfix_ratio'] >= 5 else 'not met'} |",
            f"| the same, median of the scripts' ratios | {s['torchfix_ratio_median']:.2f}x | |",
            f"| the same, whole commands (start-up included) | {s['torchfix_ratio_cmd']:.2f}x "
            f"({s['total_torchfix_cmd']:.1f} s / {s['total_ours_cmd']:.1f} s) | |",
        ]
    else:
        lines.append(f"| whole commands, total CPU | {s['total_ours_cmd']:.1f} s | |")
    lines += ["", "| repo | script | lines | parse | rewrite | parses | texts (lines) | their parses | API | "
              "TorchFix | ×TorchFix | command | torchfix command |",
              "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        tf = r.get("torchfix")
        lines.append(f"| {r['repo']} | {r['script']} | {r['lines']} | {r['parse']:.3f} | {r['rewrite']:.3f} | "
                     f"{r['parses']:.1f} | {r['texts']:.0f} ({r['project_lines']:.0f}) | {r['project_parses']:.1f} | "
                     f"{r['api']:.3f} | {'' if tf is None else f'{tf:.3f}'} | "
                     f"{'' if tf is None else format(tf / r['rewrite'], '.1f') + 'x'} | {r['ours_cmd']:.2f} | "
                     f"{'' if tf is None else format(r['torchfix_cmd'], '.2f')} |")
    return "\n".join(lines)


def profile(top: int, mirrors: Path = DEFAULT_MIRRORS, keep: Optional[Path] = None,
            only: Optional[list[str]] = None) -> None:
    """cProfile of the command's function over every script of the corpus in this process (after
    one warm-up run; the engine's memo cleared between scripts), with the time of the parts named
    in issue 49: project following, sibling reading, the checks."""
    import cProfile
    import pstats

    import accelerate_rewrite.codemod.engine as engine
    from accelerate_rewrite.cli import main

    scratch = Path(tempfile.mkdtemp(prefix="real-profile-"))
    folder = keep if keep is not None else scratch / "trees"
    folder.mkdir(parents=True, exist_ok=True)
    here = os.getcwd()
    devnull = open(os.devnull, "w")
    saved = os.dup(1), os.dup(2)

    def command(script: Path) -> None:
        os.chdir(script.parent)
        try:
            main([script.name, *ARGS])
        except SystemExit:
            pass
        finally:
            os.chdir(here)

    try:
        scripts = trees(mirrors, entries(only=only), folder)
        os.dup2(devnull.fileno(), 1)
        os.dup2(devnull.fileno(), 2)
        try:
            command(WARM_UP)
            prof = cProfile.Profile()
            for _, script in scripts:
                engine._analyse.cache_clear()
                engine._parsed.cache_clear()
                prof.enable()
                command(script)
                prof.disable()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os.dup2(saved[0], 1)
            os.dup2(saved[1], 2)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    stats = pstats.Stats(prof)
    total = stats.total_tt
    by_name: dict[str, float] = {}
    rows = []
    for (filename, line, func), (_cc, calls, tt, cumulative, _callers) in stats.stats.items():
        norm = filename.replace(os.sep, "/")
        for marker in ("/accelerate_rewrite/", "/libcst/"):
            if marker in norm:
                short = marker.strip("/") + "/" + norm.split(marker, 1)[1]
                rows.append((cumulative, tt, calls, f"{short}:{line}({func})"))
                by_name[f"{short}:{func}"] = by_name.get(f"{short}:{func}", 0.0) + cumulative
                break
    print(f"cProfile of the command over {len(scripts)} real scripts: {total:.2f} s under the profiler")
    parts = {
        "project following (reading._project: the script's project read and parsed)":
            "accelerate_rewrite/codemod/reading.py:_project",
        "  sibling reading (analysis/siblings.py: candidates)": "accelerate_rewrite/codemod/analysis/siblings.py:candidates",
        "  the project's analysis (project/program.py: analyse)": "accelerate_rewrite/codemod/project/program.py:analyse",
        "the CLI's project scan (plan.projects)": "accelerate_rewrite/plan.py:projects",
        "the checks (checks.py: check)": "accelerate_rewrite/codemod/checks.py:check",
        "the facts (analysis/facts.py: ScriptFacts.__init__)": "accelerate_rewrite/codemod/analysis/facts.py:__init__",
        "LibCST's parse (tree/parse.py: parse_module)": "accelerate_rewrite/codemod/tree/parse.py:parse_module",
        "the edits (edits/edit_set.py: apply_edits)": "accelerate_rewrite/codemod/edits/edit_set.py:apply_edits",
        "the rewrite (engine._rewrite)": "accelerate_rewrite/codemod/engine.py:_rewrite",
    }
    print("the parts (cumulative; a recursive function counted once):")
    for label, key in parts.items():
        if key in by_name:
            print(f"  {by_name[key]:7.2f} s {100 * by_name[key] / total:5.1f} %  {label}")
    walk = ("libcst/_nodes/", "libcst/_batched_visitor.py", "libcst/_visitors.py", "libcst/matchers/_visitors.py")
    rows.sort(reverse=True)
    print(f"top {top} by cumulative time, accelerate_rewrite/ and libcst/, without libcst's tree-walk frames:")
    for cumulative, _tt, calls, name in [r for r in rows if not r[3].startswith(walk)][:top]:
        print(f"  {cumulative:7.2f} s {100 * cumulative / total:5.1f} % {calls:>8} calls  {name}")
    print(f"top {top} by own time:")
    for cumulative, tt, calls, name in sorted(rows, key=lambda r: -r[1])[:top]:
        print(f"  {tt:7.2f} s {100 * tt / total:5.1f} % {calls:>8} calls  {name}")
