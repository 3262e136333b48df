"""What a whole-repository run spends on each file, against that file's LibCST parse (issue 62:
a module with no training, read for its definitions only, should cost little more than its parse).

    .venv/bin/python benchmarks/module_cost.py --only dino --only mae --keep /tmp/wr
    .venv/bin/python benchmarks/module_cost.py --only dino ... --runs 3 --json /tmp/cost.json

The repositories and their trees are whole_repo_speed.py's (``--tsv``, ``--only``, ``--mirrors``,
``--keep`` as there). For each, a fresh process runs ``accelerate-rewrite .`` with that
benchmark's options (``--precision bf16-mixed --devices 4 --no-cache -j 1 --format json``: a
preview), the command's own function in the process, with a CPU timer (user + system of the
process) around each file's ``prepare`` (prepare.py: read, choose the rules, rewrite, encode);
then, in the same process, LibCST's parse of each file (the least of 3; the process is warm, as
it is for every file of the run but the first). A file's figure is its own ``prepare``: a module
that a script of the run follows is analysed in that script's program too, and that time is the
script's (its parse as well, when the script reads it first). The import of LibCST and of the
rules comes before the first file (the runner's choice of each script's options imports them):
it is the run's, as the start is, no file's.

Each file is put in one class, by its text and its result:

- **converts**: its rewrite changes it, or another file of its project with it;
- **scripts, unchanged**: it runs as a script (``if __name__ == "__main__":``) and is left as
  it is: an evaluation, a launcher that imports the training script (its program is analysed
  whole), a refusal;
- **definitions only**: no main block, and neither ``backward`` nor ``optim`` in it (a model, a
  dataset, a utility module, a hub file): no training for the conversion to find in it (one it
  imports may hold some: its program is then analysed as a script's);
- **other**: the rest (a module with an optimizer or a backward call that is left as it is).

The table gives each class's files, CPU-s, parse CPU-s and the ratio (their sums, and the median
of the files' ratios), and the files of "definitions only" that cost most over their parse. CI
has no mirrors: a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_corpus as rc  # noqa: E402
import real_speed as rs  # noqa: E402
import whole_repo_speed as wrs  # noqa: E402

#: run in the repository's root: argv[1] the JSON file to write, argv[2:] the command's arguments
_DRIVER = r'''
import contextlib, io, json, re, sys, time
out = sys.argv[1]
args = sys.argv[2:]
import accelerate_rewrite.prepare as prepare_module
files = []
plain = prepare_module.prepare

def timed(target, settings, scope=None):
    started = time.process_time()
    done = plain(target, settings, scope)
    result = done.result
    changed = result is not None and (result.changed or any(m.changed for m in result.members))
    files.append({"path": str(target.path), "cpu": time.process_time() - started, "changed": changed,
                  "error": done.error})
    return done

prepare_module.prepare = timed
from accelerate_rewrite.cli import main
started = time.process_time()
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(args)
    except SystemExit:
        pass
run = time.process_time() - started
import libcst
for entry in files:
    if not entry["path"].endswith(".py"):
        entry["parse"] = None
        continue
    text = open(entry["path"], encoding="utf-8", errors="replace").read()
    entry["backward"] = "backward" in text.lower()
    entry["optim"] = "optim" in text.lower()
    entry["main"] = re.search(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", text, re.MULTILINE) is not None
    entry["lines"] = text.count("\n")
    best = None
    for _ in range(3):
        t = time.process_time()
        try:
            libcst.parse_module(text)
        except Exception:
            break
        spent = time.process_time() - t
        best = spent if best is None else min(best, spent)
    entry["parse"] = best
json.dump({"run": run, "files": files}, open(out, "w"))
'''

CLASSES = ("converts", "scripts, unchanged", "definitions only", "other")


def kind(entry: dict) -> str:
    if entry["changed"]:
        return "converts"
    if entry.get("main"):
        return "scripts, unchanged"
    if not entry.get("backward") and not entry.get("optim"):
        return "definitions only"
    return "other"


def measure(root: Path, env: dict, scratch: Path) -> Optional[dict]:
    out = scratch / "cost.json"
    out.unlink(missing_ok=True)
    subprocess.run([sys.executable, "-c", _DRIVER, str(out), ".", *wrs.ARGS], cwd=root, env=env,
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    if not out.exists():
        return None
    return json.loads(out.read_text())


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tsv", action="append", type=Path, help="the corpus lists (default real_speed.py's)")
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--only", action="append", metavar="PATTERN", help="repositories whose name holds it")
    parser.add_argument("--runs", type=int, default=3, help="runs of each repository; a file's figures are "
                                                            "the medians (default 3)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the extracted trees here")
    parser.add_argument("--json", type=Path, metavar="PATH", help="dump the figures")
    args = parser.parse_args(argv)
    scratch = Path(tempfile.mkdtemp(prefix="module-cost-"))
    folder = args.keep if args.keep is not None else scratch / "trees"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    entries: list[dict] = []
    runs: dict[str, list[float]] = {}
    try:
        repos = wrs.repositories(args.tsv or list(rs.TABLES), args.mirrors, folder, args.only)
        env = rs.environment(scratch)
        rs.cpu_of([sys.executable, "-m", "accelerate_rewrite", rs.WARM_UP.name, *wrs.ARGS], rs.WARM_UP.parent, env)
        for key, root in repos:
            found = [f for f in (measure(root, env, scratch) for _ in range(args.runs)) if f is not None]
            if not found:
                rc.log(f"  {key}: no figures (the run failed)")
                continue
            runs[key] = [f["run"] for f in found]
            for i, entry in enumerate(found[0]["files"]):
                same = [f["files"][i] for f in found if len(f["files"]) > i and f["files"][i]["path"] == entry["path"]]
                entry["cpu"] = statistics.median(e["cpu"] for e in same)
                parses = [e["parse"] for e in same if e.get("parse") is not None]
                entry["parse"] = statistics.median(parses) if parses else None
                entry["repo"] = key
                entry["class"] = kind(entry)
                entries.append(entry)
            rc.log(f"  {key}: {len(found[0]['files'])} files ({time.perf_counter() - started:.0f} s)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    python = [e for e in entries if e.get("parse")]
    print("| class | files | CPU-s | parse CPU-s | CPU over parse (sums) | median of the files' |")
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name in CLASSES:
        chosen = [e for e in python if e["class"] == name]
        if not chosen:
            continue
        cpu, parse = sum(e["cpu"] for e in chosen), sum(e["parse"] for e in chosen)
        median = statistics.median(e["cpu"] / e["parse"] for e in chosen)
        print(f"| {name} | {len(chosen)} | {cpu:.2f} | {parse:.2f} | {cpu / parse:.1f}x | {median:.1f}x |")
    total = sum(statistics.median(r) for r in runs.values())
    own = sum(e["cpu"] for e in entries)
    print(f"\n{len(runs)} repositories, {len(entries)} files, medians of {args.runs} runs: the runs {total:.2f} "
          f"CPU-s (from the command's function on), the files' own {own:.2f} "
          f"({time.perf_counter() - started:.0f} s)")
    worst = sorted((e for e in python if e["class"] == "definitions only"),
                   key=lambda e: e["cpu"] - e["parse"], reverse=True)[:6]
    if worst:
        print("\nDefinitions only, the most over their parse:\n")
        print("| file | lines | CPU-s | parse | over it |")
        print("| --- | ---: | ---: | ---: | ---: |")
        for e in worst:
            print(f"| {e['repo'].split('@')[0]}/{e['path']} | {e['lines']} | {e['cpu']:.3f} | {e['parse']:.3f} | "
                  f"{e['cpu'] / e['parse']:.1f}x |")
    if args.json:
        args.json.write_text(json.dumps({"files": entries, "runs": runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
