"""Issue 30's last goal, a 50k-line training script rewritten in under 15 s: what step 1 of the
issue in full (the analysis and the rules on Python's ``ast``, LibCST only for the statements an
edit touches) could not avoid, measured on this machine.

    .venv/bin/python benchmarks/redesign_floor.py                # about 5 minutes on 2 cores
    .venv/bin/python benchmarks/redesign_floor.py --markdown     # a table to paste

It generates the size curve's 50k-line script (benchmarks/corpus.py ``synthetic_of_lines``, as
benchmarks/speed_goals.py does), rewrites it with the whole command (``-o``, ``--no-cache``,
the default options, as the size curve runs it: wall, CPU, peak RSS), and then times, in this
process and at the rewrite's collector thresholds, every part of a rewrite that does not
depend on how the analysis and the rules are written:

- the start-up: a Python that imports the command and LibCST (a subprocess, its CPU seconds);
- Python's parse of the input (``ast.parse``) and its symbol tables (``symtable``), which the
  redesign's analysis would start from;
- LibCST's parse of **only the statements the rewrite changed** (the innermost statement of each
  input line that ``diff`` finds changed or removed, dedented, a compound statement's header
  with ``pass`` as its body) and their code generation: the least the redesign's editing side
  parses and prints;
- the code generation of the text the rewrite added (its nodes parsed beforehand, not timed:
  in the redesign the rules build them, which is the rules' cost);
- the checks every result goes through: ``compile``, ``symtable`` of the result, and the
  tokenization of the changed and added text (the trivia check).

Their sum is a floor: what the redesign would cost before its analysis walks the tree once and
before any rule runs. For scale (not in the sum): one ``ast.walk`` of the input, and LibCST's
parse of the whole input (what the rewrite parses today; it makes the floor a figure in parses,
comparable across machines). Each
part is the median of ``--runs`` passes. Needs ``diff`` (GNU diffutils) on the PATH; only the
standard library, LibCST and the package besides.

    .venv/bin/python benchmarks/redesign_floor.py --real        # the real corpus: about a minute

``--real`` measures the same floor on the real corpus (benchmarks/real_speed.py's 63 scripts, each
in its repository's tree, rewritten in this process as real_speed's API run does: ``--precision
bf16-mixed --devices 4``, its modules free to change as with ``--follow-imports``: the most
that changes), in LibCST parses of the script, as real_speed reports the rewrite: for
the script and for each project module the rewrite reads, Python's parse and symbol tables; for
each text that changes, the changed statements' LibCST parse and code, the added text's code and
the checks. No start-up (real_speed's rewrite figure has none). The median over the scripts, and
all of them together; what is left under the 3-parse goal is the analysis's and the rules' share.
"""

from __future__ import annotations

import argparse
import ast
import gc
import io
import re
import shutil
import statistics
import subprocess
import sys
import symtable
import tempfile
import textwrap
import time
import tokenize
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import libcst as cst  # noqa: E402

from accelerate_rewrite.codemod.engine import fewer_collections  # noqa: E402

from corpus import n_lines, synthetic_of_lines  # noqa: E402
from speed_goals import console_script, log, timed  # noqa: E402

GOAL_SECONDS = 15.0


def changes(source: Path, output: Path) -> tuple[set[int], list[str]]:
    """The input's lines ``diff`` finds changed or removed, and the runs of text added."""
    out_lines = output.read_text(encoding="utf-8").splitlines(keepends=True)
    proc = subprocess.run(["diff", str(source), str(output)], capture_output=True, text=True)
    changed: set[int] = set()
    added: list[str] = []
    for line in proc.stdout.splitlines():
        found = re.fullmatch(r"(\d+)(?:,(\d+))?([acd])(\d+)(?:,(\d+))?", line)
        if not found:
            continue
        i1, i2, tag, j1, j2 = found.groups()
        if tag in "cd":
            changed.update(range(int(i1), int(i2 or i1) + 1))
        if tag in "ca":
            added.append("".join(out_lines[int(j1) - 1:int(j2 or j1)]))
    return changed, added


def touched_statements(tree: ast.Module, lines: list[str], changed: set[int]) -> list[str]:
    """The lines of the innermost statement holding each changed line, dedented; a compound
    statement stands for its header only (its body's lines belong to their own statements),
    but where its body starts on the header's line, that line is the body's statement's text."""
    innermost: dict[int, tuple[int, int, bool]] = {}
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        body = getattr(node, "body", None)
        compound = isinstance(body, list) and bool(body)
        if compound and body[0].lineno == node.lineno:
            continue  # ``if x: y`` on one line: its body's statement is the innermost one
        end = body[0].lineno - 1 if compound else node.end_lineno
        for number in range(node.lineno, end + 1):
            if number not in innermost or innermost[number][1] - innermost[number][0] > end - node.lineno:
                innermost[number] = (node.lineno, end, compound)
    texts = []
    for low, high, compound in sorted({innermost[n] for n in changed if n in innermost}):
        text = textwrap.dedent("".join(lines[low - 1:high]))
        texts.append(text + ("    pass\n" if compound else ""))
    return texts


def parsed_runs(added: list[str]) -> list[cst.Module]:
    """The added text, dedented, as LibCST modules (a run that opens a block gets a ``pass``)."""
    modules = []
    for text in added:
        text = textwrap.dedent(text)
        for body in ("", "    pass\n", "        pass\n"):
            try:
                modules.append(cst.parse_module(text + body))
                break
            except cst.ParserSyntaxError:
                continue
    return modules


def floor_once(source: str, output: str, texts: list[str], added: list[cst.Module], path: str) -> dict:
    times: dict[str, float] = {}

    def clock(name, fn):
        start = time.process_time()
        value = fn()
        times[name] = time.process_time() - start
        return value

    with fewer_collections():  # the rewrite's collector thresholds
        tree = clock("Python's parse of the input (`ast.parse`)", lambda: ast.parse(source))
        clock("its symbol tables (`symtable`)", lambda: symtable.symtable(source, path, "exec"))
        modules = clock("LibCST's parse of the changed statements only",
                        lambda: [cst.parse_module(t) for t in texts])
        clock("their code", lambda: [m.code for m in modules])
        clock("the added text's code (its nodes made by the rules: not counted)", lambda: [m.code for m in added])
        clock("check: `compile` the result", lambda: compile(output, path, "exec", dont_inherit=True))
        clock("check: `symtable` of the result", lambda: symtable.symtable(output, path, "exec"))

        def tokens():
            for text in texts + [m.code for m in added]:
                for _ in tokenize.generate_tokens(io.StringIO(text).readline):
                    pass

        clock("check: tokenize the changed and added text (trivia)", tokens)
        walk = clock("scale: one `ast.walk` of the input", lambda: sum(1 for _ in ast.walk(tree)))
        clock("scale: LibCST's parse of the whole input (what the rewrite parses today)",
              lambda: cst.parse_module(source))
        gc.collect()
    times["nodes"] = walk
    return times


def text_floor(source: str, output: str, path: str, runs: int) -> float:
    """The floor of one text the rewrite reads (CPU s, the median of ``runs`` passes): its
    ``ast`` parse and symbol tables; where it changes, what floor_once counts besides."""
    if output == source:
        def once() -> float:
            start = time.process_time()
            with fewer_collections():
                ast.parse(source)
                symtable.symtable(source, path, "exec")
            return time.process_time() - start
        return statistics.median(once() for _ in range(runs))
    with tempfile.TemporaryDirectory() as tmp:
        before, after = Path(tmp) / "in.py", Path(tmp) / "out.py"
        before.write_text(source, encoding="utf-8")
        after.write_text(output, encoding="utf-8")
        changed, added_text = changes(before, after)
    texts = []
    for text in touched_statements(ast.parse(source), source.splitlines(keepends=True), changed):
        for tried in (text, "if 1:\n" + textwrap.indent(text, "    ")):  # a header less indented than its comment
            try:
                cst.parse_module(tried)
            except cst.ParserSyntaxError:
                continue
            texts.append(tried)
            break
        else:
            log(f"    a changed statement of {path} LibCST can't read alone: left out")
    added = parsed_runs(added_text)
    passes = [floor_once(source, output, texts, added, path) for _ in range(runs)]
    return statistics.median(sum(v for k, v in p.items() if k != "nodes" and not k.startswith("scale"))
                             for p in passes)


def real(runs: int, folder: Path, markdown: bool) -> None:
    """The floor on the real corpus, in LibCST parses of each script (``--real``)."""
    import os

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options

    import real_speed
    from real_corpus import DEFAULT_MIRRORS

    options = Options.create(precision="bf16-mixed", devices=4)
    rows = []
    here = os.getcwd()
    for entry, script in real_speed.trees(DEFAULT_MIRRORS, real_speed.entries(), folder):
        text = script.read_text(encoding="utf-8", errors="replace")
        os.chdir(script.parent)
        try:
            result = rewrite(text, options, path=script.name, scope=Scope(follow=True))
        except Exception as exc:  # noqa: BLE001 (a script the engine can't take: its floor is left out)
            log(f"  {entry.repo} {entry.script}: {exc!r}: left out")
            continue
        finally:
            os.chdir(here)
        parse = min(timed_parse(text) for _ in range(2))
        floor = sum(text_floor(r.source, r.output, str(script.parent / r.path), runs)
                    for r in [result, *result.members])
        rows.append((f"{entry.repo} {entry.script}", 1 + len(result.members), parse, floor))
        log(f"  {entry.repo} {entry.script}: {len(result.members)} modules, floor {floor / parse:.2f} parses")
    single = [floor / parse for _, texts, parse, floor in rows if texts == 1]
    project = [floor / parse for _, texts, parse, floor in rows if texts > 1]
    every = single + project
    together = sum(r[3] for r in rows) / sum(r[2] for r in rows)
    line = (f"{len(rows)} scripts: the floor {statistics.median(every):.2f} LibCST parses of the script "
            f"(median), {together:.2f} all together; the {len(single)} single files "
            f"{statistics.median(single):.2f}, the {len(project)} that follow project modules "
            f"{statistics.median(project):.2f} (their modules read too); median of {runs} passes")
    if markdown:
        print("| script | texts | parse (s) | floor (s) | floor (parses) |\n| --- | ---: | ---: | ---: | ---: |")
        for name, texts, parse, floor in rows:
            print(f"| {name} | {texts} | {parse:.4f} | {floor:.4f} | {floor / parse:.2f} |")
        print()
    print(line)


def timed_parse(text: str) -> float:
    start = time.process_time()
    cst.parse_module(text)
    return time.process_time() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lines", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--markdown", action="store_true")
    parser.add_argument("--real", action="store_true", help="the floor on the real corpus, in parses of each script")
    parser.add_argument("--trees", type=Path, default=None,
                        help="--real: where the corpus's trees are extracted (default: a scratch folder)")
    args = parser.parse_args()
    if not shutil.which("diff"):
        sys.exit("needs diff (GNU diffutils) on the PATH")
    if args.real:
        if args.trees is not None:
            real(args.runs, args.trees, args.markdown)
        else:
            with tempfile.TemporaryDirectory() as tmp:
                real(args.runs, Path(tmp), args.markdown)
        return
    tool = console_script()
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        source_path, output_path = folder / f"train_{args.lines}.py", folder / "out.py"
        source = synthetic_of_lines(args.lines)
        source_path.write_text(source, encoding="utf-8")
        log(f"the whole command on {n_lines(source)} lines")
        whole = timed([tool, str(source_path), "--no-cache", "-o", str(output_path)])
        if whole["exit"] != 0 or not output_path.exists():
            sys.exit(f"the rewrite failed: {whole}")
        log("start-up: importing the command and LibCST")
        startup = statistics.median(
            timed([sys.executable, "-c", "import accelerate_rewrite.cli, accelerate_rewrite.api, libcst"])["cpu"]
            for _ in range(args.runs))
        output = output_path.read_text(encoding="utf-8")
        changed, added_text = changes(source_path, output_path)
        lines = source.splitlines(keepends=True)
        texts = touched_statements(ast.parse(source), lines, changed)
        added = parsed_runs(added_text)
        runs = []
        for r in range(args.runs):
            log(f"the floor: pass {r + 1}/{args.runs}")
            runs.append(floor_once(source, output, texts, added, str(source_path)))
    parts = {name: statistics.median(run[name] for run in runs) for name in runs[0] if name != "nodes"}
    floor = startup + sum(v for k, v in parts.items() if not k.startswith("scale"))
    walk = parts["scale: one `ast.walk` of the input"]
    whole_parse = parts["scale: LibCST's parse of the whole input (what the rewrite parses today)"]
    left = GOAL_SECONDS - floor
    rows = [("start-up: import the command and LibCST (a subprocess)", startup), *parts.items()]
    head = (f"{n_lines(source)} lines; the whole command today: {whole['wall']:.1f} s wall, {whole['cpu']:.1f} CPU-s, "
            f"{whole['rss']:.0f} MiB; {len(changed)} input lines changed in {len(texts)} statements, "
            f"{len(added)} runs of text added; {runs[0]['nodes']} `ast` nodes; median of {args.runs} passes")
    if args.markdown:
        print(head + "\n")
        print("| part (CPU s) | seconds |\n| --- | --- |")
        for name, value in rows:
            print(f"| {name} | {value:.2f} |")
        print(f"| **the floor (all but the scale rows)** | **{floor:.2f}** |")
        print(f"\nLeft of the {GOAL_SECONDS:.0f} s goal for the analysis and every rule: {left:.2f} s, "
              f"{left / walk:.1f} bare `ast.walk`s of the input. The floor is {floor / whole_parse:.2f} LibCST parses "
              f"of the whole input; the whole command today is {whole['cpu'] / whole_parse:.2f}.")
    else:
        print(head)
        for name, value in rows:
            print(f"  {value:7.2f}  {name}")
        print(f"  {floor:7.2f}  the floor")
        print(f"left of {GOAL_SECONDS:.0f} s for the analysis and the rules: {left:.2f} s = {left / walk:.1f} ast.walks")
        print(f"in LibCST parses of the whole input: the floor {floor / whole_parse:.2f}, "
              f"the whole command {whole['cpu'] / whole_parse:.2f}")


if __name__ == "__main__":
    main()
