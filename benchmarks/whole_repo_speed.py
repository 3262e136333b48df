"""Whole repositories, against TorchFix (issue 62): ``accelerate-rewrite .`` at each corpus
repository's root beside ``torchfix .`` over the same tree, CPU seconds (user + system) of each
command, one process each, paired run by run.

    python3 -m venv /tmp/torchfix-venv && /tmp/torchfix-venv/bin/pip install torchfix==0.7.0
    .venv/bin/python benchmarks/whole_repo_speed.py --torchfix /tmp/torchfix-venv/bin/torchfix
    .venv/bin/python benchmarks/whole_repo_speed.py --torchfix ... --only dino --runs 5 --keep /tmp/wr
    .venv/bin/python benchmarks/whole_repo_speed.py --torchfix ... --skip unilm --skip pytorch-image-models

The repositories are those of benchmarks/real_corpus.py's lists (``--tsv`` as there, default its
default lists), each at the commit the list names, from the git mirrors (``--mirrors``),
extracted once into a scratch folder (``--keep DIR`` keeps it for a next run). Ours:
``accelerate-rewrite . --precision bf16-mixed --devices 4 --no-cache -j 1 --format json`` (a
preview: nothing written); TorchFix: ``torchfix .``. Both tools' bytecode is written first,
untimed, as on a user's machine. Each round runs ours, then TorchFix, on every repository; the
figure of a repository is the median of its rounds, and the ratio TorchFix's over ours (how
many times cheaper ours is). CI has no mirrors: a benchmark, not a test.
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

ARGS = ["--precision", "bf16-mixed", "--devices", "4", "--no-cache", "-j", "1", "--format", "json"]


def repositories(tables: list[Path], mirrors: Path, folder: Path, only: Optional[list[str]],
                 skip: Optional[list[str]] = None) -> list[tuple[str, Path]]:
    """(repo@commit, its tree), once per repository and commit."""
    seen: dict[str, Path] = {}
    chosen = [e for t in tables if t.exists() for e in rc.read_tsv(t)]
    if only:
        chosen = [e for e in chosen if any(p.lower() in e.repo.lower() for p in only)]
    if skip:
        chosen = [e for e in chosen if not any(p.lower() in e.repo.lower() for p in skip)]
    for entry in chosen:
        key = f"{entry.repo}@{entry.commit[:7]}"
        if key in seen:
            continue
        gitdir = rc.git_dir(mirrors, entry.repo)
        dest = folder / entry.key
        if not gitdir.exists():
            rc.log(f"  no mirror of {entry.repo}: left out")
            continue
        if not dest.exists():
            try:
                rc.extract(gitdir, entry.commit, dest)
            except (subprocess.CalledProcessError, OSError) as exc:
                rc.log(f"  {key}: not extracted ({exc})")
                shutil.rmtree(dest, ignore_errors=True)
                continue
        seen[key] = dest
    return list(seen.items())


def python_files(root: Path) -> tuple[int, int]:
    """(files, lines) of the tree's Python files, as ``accelerate-rewrite .`` looks for them."""
    skip = {".venv", "__pycache__", "node_modules", "build", "dist"}
    files = [p for p in root.rglob("*.py") if not any(part.startswith(".") or part in skip
                                                       for part in p.relative_to(root).parts[:-1])]
    return len(files), sum(p.read_bytes().count(b"\n") for p in files)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--torchfix", required=True, metavar="PATH", help="the torchfix executable (0.7.0)")
    parser.add_argument("--tsv", action="append", type=Path, help="the corpus lists (default real_speed.py's: the 63)")
    parser.add_argument("--mirrors", type=Path, default=Path("/work/.mirror"))
    parser.add_argument("--only", action="append", metavar="PATTERN", help="repositories whose name holds it")
    parser.add_argument("--skip", action="append", metavar="PATTERN", help="leave out repositories whose name holds it")
    parser.add_argument("--runs", type=int, default=3, help="paired rounds (default 3)")
    parser.add_argument("--keep", type=Path, metavar="DIR", help="keep the extracted trees here")
    parser.add_argument("--json", type=Path, metavar="PATH", help="dump the figures")
    args = parser.parse_args(argv)
    tool = shutil.which("accelerate-rewrite", path=str(Path(sys.executable).parent))
    if not tool:
        sys.exit("the accelerate-rewrite console script is not installed next to this Python")
    scratch = Path(tempfile.mkdtemp(prefix="whole-speed-"))
    folder = args.keep if args.keep is not None else scratch / "trees"
    folder.mkdir(parents=True, exist_ok=True)
    started = time.perf_counter()
    try:
        repos = repositories(args.tsv or list(rs.TABLES), args.mirrors, folder, args.only, args.skip)
        env = rs.environment(scratch)
        rs.cpu_of([tool, rs.WARM_UP.name, *ARGS], rs.WARM_UP.parent, env)  # bytecode, untimed
        rs.cpu_of([args.torchfix, rs.WARM_UP.name], rs.WARM_UP.parent, env)
        times: dict[str, dict[str, list[float]]] = {key: {"ours": [], "torchfix": []} for key, _ in repos}
        for round_ in range(args.runs):
            for key, root in repos:
                times[key]["ours"].append(rs.cpu_of([tool, ".", *ARGS], root, env)[0])
                times[key]["torchfix"].append(rs.cpu_of([args.torchfix, "."], root, env)[0])
            rc.log(f"round {round_ + 1} of {args.runs} ({time.perf_counter() - started:.0f} s)")
        rows = []
        for key, root in repos:
            ours, theirs = (statistics.median(times[key][k]) for k in ("ours", "torchfix"))
            files, lines = python_files(root)
            rows.append({"repo": key, "files": files, "lines": lines, "ours": ours, "torchfix": theirs,
                         "ratio": theirs / ours if ours else None, "rounds": times[key]})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    total_ours = sum(r["ours"] for r in rows)
    total_theirs = sum(r["torchfix"] for r in rows)
    ratios = sorted(r["ratio"] for r in rows if r["ratio"])
    print("| repository | .py files | lines | ours (CPU-s) | TorchFix (CPU-s) | TorchFix / ours |")
    print("| --- | --- | --- | --- | --- | --- |")
    for r in sorted(rows, key=lambda r: r["ratio"] or 0):
        print(f"| {r['repo']} | {r['files']} | {r['lines']} | {r['ours']:.2f} | {r['torchfix']:.2f} | "
              f"{r['ratio']:.2f}x |")
    # each round's totals, paired (the box moves between rounds: both tools of a round ran together)
    paired = [sum(r["rounds"]["torchfix"][i] for r in rows) / sum(r["rounds"]["ours"][i] for r in rows)
              for i in range(args.runs)]
    print(f"\n{len(rows)} repositories, medians of {args.runs} paired rounds: ours {total_ours:.1f} CPU-s, "
          f"TorchFix {total_theirs:.1f} CPU-s: **{total_theirs / total_ours:.2f}x** together; median "
          f"{statistics.median(ratios):.2f}x, lowest {ratios[0]:.2f}x; each round's totals "
          f"{', '.join(f'{p:.2f}x' for p in paired)} ({time.perf_counter() - started:.0f} s)")
    if args.json:
        args.json.write_text(json.dumps({"rows": rows, "runs": args.runs}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
