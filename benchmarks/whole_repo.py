"""Repositories converted whole (`accelerate-rewrite .` at the repository's root), beside their
scripts converted one by one, and what the outputs hold that a reviewer would strike out.

    .venv/bin/pip install pyflakes     # needed by the benchmarks only
    .venv/bin/python benchmarks/whole_repo.py                                  # a table on stdout
    .venv/bin/python benchmarks/whole_repo.py --only dino --only mae --keep /tmp/whole
    .venv/bin/python benchmarks/whole_repo.py --markdown docs/real-world.md --label "whole (at abc1234)"

The repositories are those of benchmarks/real_corpus.py's lists (``--tsv`` as there), each at
the commit the list names, taken from the git mirrors (``--mirrors``) into a scratch folder.
For each repository and each backend (fabric: ``--precision bf16-mixed --devices 4``;
accelerate: the same with ``--backend accelerate``), with ``--format json --no-cache -j 1``:

1. **alone**: each listed script of the repository, and each other file of it that holds both
   ``__main__`` and ``.backward(`` (an entry point that trains: dino's eval_linear.py, MAE's
   main_finetune.py), run in its own folder as its user would (``accelerate-rewrite SCRIPT``),
   preview only: converted or not (AR101 among its rules).
2. **whole**: ``accelerate-rewrite .`` at the repository's root on a fresh copy, preview, then
   ``--write``, then ``--write`` again (idempotence). A listed script converts in the whole run
   when its record holds AR101. Every file the write changed is checked as real_corpus.py
   checks (it parses, no undefined name the original lacks), and read for dead code and copies:

   - **dead statements** the rewrite made (counted in the output, less the original's):
     ``x = x``; an ``if`` whose every branch is ``pass``; an assignment of a name's value
     (``a = b``, ``a = b.c``) that repeats one in force, in its block or an enclosing one, with
     nothing between that rebinds its names (``model_without_ddp = model`` twice); a parameter ``fabric`` / ``accelerator``
     that its function never reads.
   - **copied lines**: in each ``if fabric is not None: ... else: ...`` (``self.fabric``,
     ``accelerator`` alike) that the compatible change of a shared module makes, the lines of
     the two branches that are the same (kept without change, yet written twice).

With ``--alone-outputs`` each alone run that changes something is also written (on a tree of
hard links to the pristine one) and its files read for dead code and copies as the whole run's
are; ``--alone-only`` does that and no whole run.

A listed script whose alone run converts and whose whole run doesn't is a **loss**, named with
the whole run's reason. CI has no mirrors: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import shutil
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_corpus as rc  # noqa: E402

BACKENDS = {"fabric": ["--precision", "bf16-mixed", "--devices", "4"],
            "accelerate": ["--backend", "accelerate", "--precision", "bf16-mixed", "--devices", "4"]}
GUARDS = {"fabric", "self.fabric", "accelerator", "self.accelerator"}


# --------------------------------------------------------------------------- dead code and copies


def _assign_key(node: ast.stmt) -> Optional[tuple[str, frozenset[str], frozenset[str]]]:
    """An assignment's code, the names it binds and those it reads; None for other statements."""
    if not isinstance(node, (ast.Assign, ast.AnnAssign)) or getattr(node, "value", None) is None:
        return None
    value = node.value
    while isinstance(value, ast.Attribute):
        value = value.value
    if not isinstance(value, ast.Name):  # only a name's value (``model_without_ddp = model``): no call
        return None
    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
    bound = {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
    read = {n.id for n in ast.walk(node.value) if isinstance(n, ast.Name)}
    return ast.dump(node), frozenset(bound), frozenset(read)


def _binds(node: ast.stmt) -> set[str]:
    out = set()
    for n in ast.walk(node):
        if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
            out.add(n.id)
        elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(n.name)
    return out


def dead_statements(source: str) -> list[str]:
    """The dead statements of a module (see the module's docstring), as ``line: what``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    found: list[str] = []

    def block(body: list[ast.stmt], outer: dict[str, tuple[frozenset[str], frozenset[str]]]) -> None:
        # assignments in force: code -> (bound, read), dropped when something rebinds their names
        live = dict(outer)
        for stmt in body:
            key = _assign_key(stmt)
            if key is not None and key[0] in live:
                found.append(f"{stmt.lineno}: repeats an assignment in force: {ast.unparse(stmt)}")
            if isinstance(stmt, ast.Assign) and len(stmt.targets) == 1 and isinstance(stmt.targets[0], ast.Name) \
                    and isinstance(stmt.value, ast.Name) and stmt.targets[0].id == stmt.value.id:
                found.append(f"{stmt.lineno}: {ast.unparse(stmt)}")
            if isinstance(stmt, ast.If) and all(isinstance(s, ast.Pass) for s in stmt.body) and \
                    all(isinstance(s, ast.Pass) for s in stmt.orelse):
                found.append(f"{stmt.lineno}: an if whose branches are all pass")
            for child in _blocks(stmt):
                block(child, live if isinstance(stmt, (ast.If, ast.With)) else {})
            if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)):
                names = {a.arg for a in stmt.args.args + stmt.args.kwonlyargs}
                read = {n.id for n in ast.walk(stmt) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Load)}
                for unused in sorted(names & {"fabric", "accelerator"} - read):
                    found.append(f"{stmt.lineno}: parameter {unused} of {stmt.name} never read")
            rebound = _binds(stmt)
            live = {c: (b, r) for c, (b, r) in live.items() if not (b | r) & rebound}
            if key is not None and not key[1] & key[2]:
                live[key[0]] = (key[1], key[2])

    block(tree.body, {})
    return found


def _blocks(stmt: ast.stmt) -> list[list[ast.stmt]]:
    out = []
    for name in ("body", "orelse", "finalbody"):
        value = getattr(stmt, name, None)
        if isinstance(value, list) and value and isinstance(value[0], ast.stmt):
            out.append(value)
    for handler in getattr(stmt, "handlers", []) or []:
        out.append(handler.body)
    return out


def copied_lines(source: str) -> list[str]:
    """The lines written twice by a guard of ``fabric`` (see the module's docstring)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    lines = source.splitlines()
    out = []
    for node in ast.walk(tree):
        if not (isinstance(node, ast.If) and node.orelse and isinstance(node.test, ast.Compare)
                and ast.unparse(node.test.left) in GUARDS
                and isinstance(node.test.ops[0], (ast.Is, ast.IsNot))):
            continue

        def text(stmts: list[ast.stmt]) -> list[str]:
            first, last = stmts[0].lineno, max(s.end_lineno or s.lineno for s in stmts)
            return [line.strip() for line in lines[first - 1:last] if line.strip() and not line.strip().startswith("#")]

        a, b = text(node.body), text(node.orelse)
        same = difflib.SequenceMatcher(None, a, b, autojunk=False)
        for tag, i1, i2, _, _ in same.get_opcodes():
            if tag == "equal":
                out.extend(f"{node.lineno}: {line}" for line in a[i1:i2] if line not in ("else:", "pass"))
    return out


def new_items(before: list[str], after: list[str]) -> list[str]:
    """What ``after`` holds that ``before`` doesn't (compared without line numbers)."""
    strip = lambda item: item.split(": ", 1)[1]  # noqa: E731
    left = defaultdict(int)
    for item in before:
        left[strip(item)] += 1
    out = []
    for item in after:
        if left[strip(item)]:
            left[strip(item)] -= 1
        else:
            out.append(item)
    return out


# --------------------------------------------------------------------------- runs


def entry_points(pristine: Path, listed: list[str]) -> list[str]:
    """The listed scripts, then the repository's other files that train and run as scripts."""
    out = list(listed)
    for file in sorted(pristine.rglob("*.py")):
        rel = str(file.relative_to(pristine))
        if rel in out or any(part.startswith(".") for part in file.parts):
            continue
        text = file.read_text(errors="replace")
        if "__main__" in text and ".backward(" in text:
            out.append(rel)
    return out


def run_repo(tool: rc.Tool, entries: list[rc.Entry], pristine: Path, work: Path, outputs: bool = False,
             whole_too: bool = True) -> dict:
    scripts = entry_points(pristine, [e.script for e in entries])
    out: dict = {"repo": entries[0].repo, "scripts": scripts, "backends": {}}
    for backend, args in BACKENDS.items():
        full = args + rc.COMMON
        alone = {}
        alone_dead, alone_copies = [], []
        for name in scripts:
            script = Path(name)
            done = tool.run(script.name, pristine / script.parent, full)
            alone[name] = rc.verdict(done, "AR101", "AR1")
            if outputs and any(r.get("changed") for r in done["records"]):
                # the files it writes, read as the whole run's are (a tree of hard links: the
                # rewrite replaces a file it writes, it never writes into one)
                if work.exists():
                    shutil.rmtree(work)
                subprocess.run(["cp", "-al", str(pristine), str(work)], check=True)
                wrote = tool.run(script.name, work / script.parent, full + ["--write"])
                for r in wrote["records"]:
                    if r.get("changed"):
                        rel = str((script.parent / r["path"]))
                        before = (pristine / rel).read_text(errors="replace")
                        after = (work / rel).read_text(errors="replace")
                        alone_dead += [f"{name}: {rel}:{d}" for d in new_items(dead_statements(before),
                                                                               dead_statements(after))]
                        alone_copies += [f"{name}: {rel}:{c}" for c in new_items(copied_lines(before),
                                                                                 copied_lines(after))]
        if whole_too is False:
            out["backends"][backend] = {"alone": alone, "whole": dict(alone), "converted_files": [], "checks": [],
                                        "dead": alone_dead, "copied": alone_copies, "seconds": 0.0}
            continue
        if work.exists():
            shutil.rmtree(work)
        shutil.copytree(pristine, work, symlinks=True)
        started = time.perf_counter()
        preview = tool.run(".", work, full)
        seconds = time.perf_counter() - started
        by_path = {r.get("path"): r for r in preview["records"]}
        problem = rc.error_text(preview)
        whole = {}
        for name in scripts:
            record = by_path.get(name)
            if problem and record is None:
                whole[name] = ("error", problem)
            elif record is not None and record.get("error"):
                whole[name] = ("error", record["error"])
            elif record is not None and record.get("changed") and "AR101" in (record.get("rules") or []):
                whole[name] = ("converted", "")
            else:
                kind = "partial" if record is not None and record.get("changed") else "refused"
                whole[name] = (kind, rc.first_reason([record] if record else [], "AR1", "AR101"))
        converted_files = sorted(r["path"] for r in preview["records"]
                                 if r.get("changed") and "AR101" in (r.get("rules") or []))
        checks, dead, copies = [], [], []
        write = tool.run(".", work, full + ["--write"])
        if rc.error_text(write):
            checks.append(f"--write: {rc.shorten(rc.error_text(write))}")
        else:
            if rc.records_key(write["records"]) != rc.records_key(preview["records"]):
                checks.append("the --write run's records differ from the preview's")
            checks += rc.check_outputs(write, work, pristine)
            for r in write["records"]:
                if not r.get("changed"):
                    continue
                before = (pristine / r["path"]).read_text(errors="replace")
                after = (work / r["path"]).read_text(errors="replace")
                dead += [f"{r['path']}:{d}" for d in new_items(dead_statements(before), dead_statements(after))]
                copies += [f"{r['path']}:{c}" for c in new_items(copied_lines(before), copied_lines(after))]
            again = tool.run(".", work, full + ["--write"])
            for r in again["records"]:
                if r.get("changed"):
                    checks.append(f"{r['path']}: not idempotent")
        out["backends"][backend] = {"alone": alone, "whole": whole, "converted_files": converted_files,
                                    "checks": checks, "dead": dead + alone_dead, "copied": copies + alone_copies,
                                    "seconds": seconds}
    return out


def table(results: list[dict], markdown: bool) -> str:
    lines = []
    head = ["repository", "script", *(f"{b} alone / whole" for b in BACKENDS)]
    if markdown:
        lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for res in results:
        for script in res["scripts"]:
            cells = [res["repo"], script]
            for b in BACKENDS:
                bk = res["backends"][b]
                a, w = bk["alone"][script], bk["whole"][script]
                cell = f"{a[0]} / {w[0]}"
                if a[0] == "converted" and w[0] != "converted":
                    cell += f" (loss: {rc.shorten(w[1], 100)})"
                cells.append(cell)
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |" if markdown
                         else "  ".join(cells))
    return "\n".join(lines)


def totals(results: list[dict]) -> dict:
    t: dict = {}
    for b in BACKENDS:
        alone = sum(r["backends"][b]["alone"][s][0] == "converted" for r in results for s in r["scripts"])
        whole = sum(r["backends"][b]["whole"][s][0] == "converted" for r in results for s in r["scripts"])
        losses = sum(r["backends"][b]["alone"][s][0] == "converted" and r["backends"][b]["whole"][s][0] != "converted"
                     for r in results for s in r["scripts"])
        t[b] = {"scripts": sum(len(r["scripts"]) for r in results), "alone": alone, "whole": whole,
                "losses": losses,
                "files converted whole": sum(len(r["backends"][b]["converted_files"]) for r in results),
                "checks": [f"{r['repo']}: {c}" for r in results for c in r["backends"][b]["checks"]],
                "dead": [f"{r['repo']}: {d}" for r in results for d in r["backends"][b]["dead"]],
                "copied": [f"{r['repo']}: {c}" for r in results for c in r["backends"][b]["copied"]]}
    return t


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tsv", type=Path, action="append")
    parser.add_argument("--mirrors", type=Path, default=rc.DEFAULT_MIRRORS)
    parser.add_argument("--only", action="append", metavar="PATTERN")
    parser.add_argument("--keep", type=Path, metavar="DIR")
    parser.add_argument("--at", metavar="REV")
    parser.add_argument("--markdown", type=Path, metavar="PATH")
    parser.add_argument("--label", default="Whole repositories")
    parser.add_argument("--alone-outputs", action="store_true",
                        help="also write each script's alone conversion and read it for dead code and copies")
    parser.add_argument("--alone-only", action="store_true",
                        help="only the alone runs, their outputs read for dead code and copies (no whole run)")
    args = parser.parse_args(argv)
    if rc.pyflakes is None:
        sys.exit("pip install pyflakes first")
    tsvs = args.tsv or [rc.DEFAULT_TSV, rc.MORE_TSV, rc.RESEARCH_TSV]
    entries = [e for t in tsvs for e in rc.read_tsv(t)]
    if args.only:
        entries = [e for e in entries if any(p in f"{e.repo} {e.script}" for p in args.only)]
    groups: dict[tuple[str, str], list[rc.Entry]] = defaultdict(list)
    for e in entries:
        groups[(e.repo, e.commit)].append(e)
    scratch = Path(tempfile.mkdtemp(prefix="whole-repo-"))
    tool = rc.Tool(args.at, scratch)
    results = []
    try:
        for (repo, commit), group in groups.items():
            rc.log(f"{repo} ({len(group)} scripts)")
            pristine = (args.keep or scratch) / "trees" / group[0].key
            if not pristine.exists():
                rc.extract(rc.git_dir(args.mirrors, repo), commit, pristine)
            results.append(run_repo(tool, group, pristine, scratch / "work",
                                    outputs=args.alone_outputs or args.alone_only, whole_too=not args.alone_only))
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    t = totals(results)
    text = [table(results, bool(args.markdown)), ""]
    for b, v in t.items():
        text.append(f"{b}: {v['scripts']} scripts; alone {v['alone']} convert, whole {v['whole']} "
                    f"({v['losses']} lost); {v['files converted whole']} files converted in the whole runs; "
                    f"{len(v['checks'])} check problems, {len(v['dead'])} dead statements, "
                    f"{len(v['copied'])} copied lines")
        text += [f"  - check: {c}" for c in v["checks"]] + [f"  - dead: {d}" for d in v["dead"]] + \
            [f"  - copied: {c}" for c in v["copied"][:40]]
    body = "\n".join(text)
    print(body)
    if args.markdown:
        section = f"## {args.label}\n\n{rc.project_state(args.at)}, {rc.machine()}; " \
                  f"`{' '.join(['python benchmarks/whole_repo.py', *(argv or sys.argv[1:])])}`\n\n{body}\n"
        rc.update_document(args.markdown, args.label, section)
    return 0


if __name__ == "__main__":
    sys.exit(main())
