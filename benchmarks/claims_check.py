"""Every change record against the file as written, on the real corpus (issue 57).

    .venv/bin/python benchmarks/claims_check.py                     # the default lists, the work tree
    .venv/bin/python benchmarks/claims_check.py --at e882e83        # the package as committed there
    .venv/bin/python benchmarks/claims_check.py --tsv benchmarks/real-corpus-unseen.tsv

For each script of the lists (benchmarks/real_corpus.py reads the same lists and mirrors, and
takes each repository's tree at its commit into a scratch folder), and each of the option sets
of that benchmark (fabric, torch, accelerate), as a user runs it (a module other scripts import
too changes compatibly, codemod/project/compat.py): ``accelerate-rewrite SCRIPT ... --write
--format json`` on a copy of the tree, and every change note of every file it wrote is checked
against that file, apart from the engine's own check (codemod/claims.py):

- "removed `X`" and "`X` became `Y`": the input statement on the note's line (Python's ``ast``)
  must not be all there still, line for line (indentation aside), as many times as in the input,
  outside the branches that run without `fabric` (``else:`` of ``if fabric is not None:``, ``if
  fabric is None:``; Accelerate's ``accelerator`` alike);
- "`X` became `Y`": ``Y`` (down to its first parenthesis: another rule may change its
  arguments, as accumulation divides the loss) must be in the file.

Prints a table: per option set, the files written, the change notes checked and those the file
does not hold, with the first few. About as long as real_corpus.py's run of the same lists.
"""

from __future__ import annotations

import argparse
import ast
import json
import re
import shutil
import sys
import tempfile
from collections import Counter
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
from real_corpus import (DEFAULT_MIRRORS, DEFAULT_TSV, MORE_TSV, OPTION_SETS, RESEARCH_TSV,  # noqa: E402
                         Tool, extract, git_dir, log, read_tsv)

ARGS = ["--format", "json", "--no-cache", "-j", "1", "--write"]
_GUARD = re.compile(r"^(?:self\.)?(?:fabric|accelerator)$")


def without_fabric(tree: ast.Module) -> set[int]:
    """The output's lines that run without `fabric` only."""
    out: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Compare) and len(node.test.ops) == 1 \
                and isinstance(node.test.comparators[0], ast.Constant) and node.test.comparators[0].value is None \
                and _GUARD.match(ast.unparse(node.test.left)):
            block = node.orelse if isinstance(node.test.ops[0], ast.IsNot) else node.body
            for s in block:
                out.update(range(s.lineno, (s.end_lineno or s.lineno) + 1))
    return out


def statement_lines(tree: ast.Module, line: int) -> Optional[list[int]]:
    """The lines of the smallest statement on ``line`` (a compound statement's header only)."""
    best = None
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        inner = [s for name in ("body", "orelse", "handlers", "finalbody") for s in getattr(node, name, ()) or ()]
        end = min(s.lineno for s in inner) - 1 if inner else (node.end_lineno or node.lineno)
        span = (node.lineno, max(node.lineno, end))
        if span[0] <= line <= span[1] and (best is None or span[1] - span[0] < best[1] - best[0]):
            best = span
    return list(range(best[0], best[1] + 1)) if best else None


def false_claim(note: dict, source: str, output: str, src_tree: ast.Module, out_tree: ast.Module,
                off: set[int]) -> Optional[str]:
    message = note["message"]
    became = re.match(r"^`[^`]+` became ", message)
    if not (message.startswith("removed `") or became):
        return None
    lines = statement_lines(src_tree, note["line"])
    if lines:
        src = Counter(x.strip() for x in source.splitlines())
        out = Counter(x.strip() for i, x in enumerate(output.splitlines(), 1) if i not in off)
        mine = [source.splitlines()[i - 1].strip() for i in lines]
        if all(out[x] >= src[x] for x in mine if x):
            return "still there, run with fabric"
    if became:
        said = message.split(" became ", 1)[1].split(": ", 1)[0]
        heads = []
        for new in re.findall(r"`([^`]+)`", said):
            new = new[:-3] if new.endswith("...") else new
            heads.append(new[:new.index("(") + 1] if "(" in new else new)
        squeezed = re.sub(r"\s+", "", output)
        if heads and not any(re.sub(r"\s+", "", h) in squeezed for h in heads):
            return "what it became is not in the file"
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tsv", type=Path, action="append")
    parser.add_argument("--mirrors", type=Path, default=DEFAULT_MIRRORS)
    parser.add_argument("--at", metavar="REV")
    parser.add_argument("--only", action="append", metavar="PATTERN")
    parser.add_argument("--json", type=Path, metavar="PATH", help="every false claim, as json")
    args = parser.parse_args(argv)
    entries = [e for path in (args.tsv or [DEFAULT_TSV, MORE_TSV, RESEARCH_TSV]) for e in read_tsv(path)]
    if args.only:
        entries = [e for e in entries if any(p in f"{e.repo}/{e.script}" for p in args.only)]
    scratch = Path(tempfile.mkdtemp(prefix="claims-"))
    tool = Tool(args.at, scratch)
    totals = {name: Counter() for name in OPTION_SETS}
    found: list[dict] = []
    try:
        trees: dict[str, Path] = {}
        for number, entry in enumerate(entries, 1):
            if entry.key not in trees:
                trees[entry.key] = scratch / "trees" / entry.key
                extract(git_dir(args.mirrors, entry.repo), entry.commit, trees[entry.key])
            log(f"[{number}/{len(entries)}] {entry.repo} {entry.script}")
            for name, (options, _, _) in OPTION_SETS.items():
                work = scratch / "work"
                shutil.rmtree(work, ignore_errors=True)
                shutil.copytree(trees[entry.key], work, symlinks=True)
                folder = work / Path(entry.script).parent
                result = tool.run(Path(entry.script).name, folder, options + ARGS)
                for record in result["records"]:
                    if not record.get("changed"):
                        continue
                    path = folder / record["path"]
                    source = (trees[entry.key] / Path(entry.script).parent / record["path"]).read_text(
                        encoding="utf-8", errors="replace")
                    output = path.read_text(encoding="utf-8", errors="replace")
                    try:
                        src_tree, out_tree = ast.parse(source), ast.parse(output)
                    except SyntaxError:
                        continue
                    off = without_fabric(out_tree)
                    totals[name]["files"] += 1
                    for note in record.get("changes", []):
                        totals[name]["notes"] += 1
                        why = false_claim(note, source, output, src_tree, out_tree, off)
                        if why is not None:
                            totals[name]["false"] += 1
                            found.append({"set": name, "repo": entry.repo, "script": entry.script,
                                          "file": record["path"], "line": note["line"], "rule": note["rule"],
                                          "message": note["message"], "why": why})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    print(f"{len(entries)} scripts, {'the package at ' + args.at if args.at else 'the work tree'}")
    print("| option set | files written | change notes | false claims |")
    print("| --- | --- | --- | --- |")
    for name, t in totals.items():
        print(f"| {name} | {t['files']} | {t['notes']} | {t['false']} |")
    for item in found[:40]:
        print(f"- {item['set']}: {item['repo']} {item['file']}:{item['line']} {item['rule']} "
              f"{item['message'][:110]} ({item['why']})")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
