"""Issue 59: the precision asked for, in the scripts that run their own mixed precision. A static
check of the rewritten files, script by script and backend by backend.

    .venv/bin/pip install pyflakes     # needed by the benchmarks only (real_corpus.py imports it)
    .venv/bin/python benchmarks/own_precision.py                          # a table on stdout
    .venv/bin/python benchmarks/own_precision.py --markdown docs/real-world.md --label "own precision (at abc1234)"
    .venv/bin/python benchmarks/own_precision.py --only mae --keep /tmp/own

The scripts are those of benchmarks/real_corpus.py's lists and benchmarks/real-corpus-unseen.tsv
(``--tsv`` as there), each at its commit, from the git mirrors (``--mirrors``), in a scratch
copy of its tree. A script is one **with its own mixed precision** where its repository's Python
names autocast or a GradScaler and either a file of the tool's records for it (the script and
the project's modules it reads) creates a GradScaler or enters an autocast that computes, as it
was before the rewrite (the check below, on the original), or the records say the script runs
its own autocast or GradScaler (an AR213 note, or AR101's / AR207's "runs its own autocast" or
"GradScaler"): the same scripts whatever version of the tool runs. Each such script is
rewritten with ``--precision bf16-mixed --write --format json --no-cache -j 1`` by each backend
(fabric and accelerate with ``--devices 4``; ``--follow-imports`` again where the run says a
rule needed it), and every file of its records (the script and the project's modules it reads)
is read, as written, for:

- **the autocasts that compute** (``torch.autocast``, ``torch.amp.autocast``,
  ``torch.cuda.amp.autocast``, ``torch.cpu.amp.autocast`` called, bound by
  ``functools.partial``, or named uncalled): each in **bf16** (``dtype=torch.bfloat16`` given)
  or **fp16** (any other: the float16 default of CUDA's autocast, ``dtype=torch.float16``, a
  dtype the check can't read); one switched off (``enabled=False``) does not compute. A script
  **computes in bf16** where it has at least one autocast in bf16 and none in fp16; where one is
  left in fp16 the table gives the tool's reason (AR213's note).
- **a GradScaler left on** (created without ``enabled=False``): bf16 needs none (a library's
  loss scaler, timm's NativeScaler, keeps its own: said, not counted).
- **half casts removed without an autocast**: a file whose ``.half()`` / ``.to(torch.float16)``
  casts the rewrite removed, in a run where no autocast computes in bf16 and no precision was
  set (Fabric's ``precision="bf16-mixed"``, Accelerate's ``mixed_precision="bf16"``): must be 0.

CI has no mirrors: this is a benchmark, not a test.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import re
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_corpus as rc  # noqa: E402

UNSEEN_TSV = rc.ROOT / "benchmarks" / "real-corpus-unseen.tsv"
BACKENDS = {"fabric": ["--precision", "bf16-mixed", "--devices", "4"],
            "torch": ["--backend", "torch", "--precision", "bf16-mixed"],
            "accelerate": ["--backend", "accelerate", "--precision", "bf16-mixed", "--devices", "4"]}
AUTOCASTS = ("torch.autocast", "torch.amp.autocast", "torch.cuda.amp.autocast", "torch.cpu.amp.autocast",
             "torch.amp.autocast_mode.autocast", "torch.cuda.amp.autocast_mode.autocast")
SCALERS = ("torch.amp.GradScaler", "torch.cuda.amp.GradScaler", "torch.cpu.amp.GradScaler")
OWN = re.compile(r"runs its own (?:autocast|GradScaler)")
HALF = re.compile(r"\.half\(\)|\.to\(\s*(?:dtype\s*=\s*)?torch\.(?:float16|half)\s*\)")
PRECISION_SET = re.compile(r"precision=\"bf16-mixed\"|mixed_precision=\"bf16\"")


# --------------------------------------------------------------------------- the static check


def _names(tree: ast.AST) -> dict[str, str]:
    """Local name -> the dotted name it was imported as (``from torch.cuda.amp import autocast``)."""
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module:
            for alias in node.names:
                out[alias.asname or alias.name] = f"{node.module}.{alias.name}"
        elif isinstance(node, ast.Import):
            for alias in node.names:
                local = alias.asname or alias.name.split(".")[0]
                out[local] = alias.name if alias.asname else local
    return out


def _dotted(node: ast.AST, names: dict[str, str]) -> Optional[str]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    head = names.get(node.id, node.id)
    return ".".join([head, *reversed(parts)])


def _dtype(call: ast.Call, skip: int = 0) -> str:
    """"bf16", "fp16" or "off" for an autocast called (or bound by partial) with these arguments."""
    keywords = {k.arg: k.value for k in call.keywords if k.arg}
    enabled = keywords.get("enabled")
    if isinstance(enabled, ast.Constant) and enabled.value is False:
        return "off"
    dtype = keywords.get("dtype")
    if dtype is None and len(call.args) > skip + 1:
        dtype = call.args[skip + 1]
    text = ast.unparse(dtype) if dtype is not None else ""
    return "bf16" if text.endswith("bfloat16") else "fp16"


def autocasts(source: str) -> list[tuple[int, str, str]]:
    """(line, "bf16"/"fp16"/"off", code) for each autocast of the file, and ("scaler on") for
    each GradScaler created without ``enabled=False``."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    names = _names(tree)
    out = []
    called = set()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        name = _dotted(node.func, names) or ""
        if name in AUTOCASTS:
            called.add(id(node.func))
            # torch.cuda.amp.autocast(enabled, dtype, ...): its dtype is second; torch.autocast's too
            out.append((node.lineno, _dtype(node), ast.unparse(node)[:80]))
        elif name in SCALERS:
            enabled = {k.arg: k.value for k in node.keywords}.get("enabled")
            if not (isinstance(enabled, ast.Constant) and enabled.value is False):
                out.append((node.lineno, "scaler on", ast.unparse(node)[:80]))
        elif name.endswith("partial") and node.args and (_dotted(node.args[0], names) or "") in AUTOCASTS:
            called.add(id(node.args[0]))
            out.append((node.lineno, _dtype(node, skip=1), ast.unparse(node)[:80]))
    for node in ast.walk(tree):
        if isinstance(node, (ast.Attribute, ast.Name)) and id(node) not in called \
                and isinstance(getattr(node, "ctx", None), ast.Load) and (_dotted(node, names) or "") in AUTOCASTS:
            out.append((node.lineno, "fp16", ast.unparse(node)[:80]))  # named, uncalled: CUDA's float16
    # an Attribute inside a called one is visited too (``torch.cuda.amp`` of ``torch.cuda.amp.autocast``):
    # only whole names count, which _dotted gives for the outermost node alone
    return sorted(set(out))


# --------------------------------------------------------------------------- the runs


def run(tool: rc.Tool, entry: rc.Entry, pristine: Path, work: Path, args: list[str]) -> dict:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine, work, symlinks=True)
    script = Path(entry.script)
    cwd, pristine_cwd = work / script.parent, pristine / script.parent
    done = tool.run(script.name, cwd, args + rc.COMMON + ["--write"])
    if any(rc.FOLLOW in d for r in done["records"] for d in r.get("dropped") or []):
        shutil.rmtree(work)
        shutil.copytree(pristine, work, symlinks=True)
        done = tool.run(script.name, cwd, args + rc.COMMON + ["--write", rc.FOLLOW])
    notes = [(r["path"], n) for r in done["records"] for n in [*(r.get("changes") or []), *(r.get("left_alone") or [])]]
    own = any(n.get("rule") == "AR213" or OWN.search(n.get("message") or "") for _, n in notes)
    result = {"own": own, "error": rc.error_text(done), "files": {}, "half_removed": [], "precision_set": False,
              "reason": "", "converted": any("AR101" in (r.get("rules") or []) or "AR207" in (r.get("rules") or [])
                                             for r in done["records"] if r.get("changed"))}
    for record in done["records"]:
        path = record["path"]
        after = (cwd / path).read_text(encoding="utf-8", errors="replace") if (cwd / path).is_file() else ""
        before = (pristine_cwd / path).read_text(encoding="utf-8", errors="replace") \
            if (pristine_cwd / path).is_file() else after
        result["files"][path] = autocasts(after)
        result["own"] |= any(k in ("fp16", "bf16") or k == "scaler on" for _, k, _ in autocasts(before))
        result["precision_set"] |= bool(PRECISION_SET.search(after))
        if len(HALF.findall(after)) < len(HALF.findall(before)):
            result["half_removed"].append(path)
    skips = [n.get("message", "") for _, n in notes if n.get("rule") == "AR213" and n in
             [x for r in done["records"] for x in r.get("left_alone") or []]]
    dropped = [d for r in done["records"] for d in r.get("dropped") or [] if d.startswith("AR213")]
    result["reason"] = rc.shorten((skips or dropped or [""])[0])
    return result


def verdict(result: dict) -> str:
    kinds = [k for found in result["files"].values() for _, k, _ in found]
    if result["error"]:
        return "error"
    if "fp16" in kinds:
        return "fp16 left"
    if "bf16" in kinds or result["precision_set"]:
        return "bf16"
    return "not set"  # its autocast is none this check reads (a library's), left as it was


def half_problem(result: dict) -> bool:
    kinds = [k for found in result["files"].values() for _, k, _ in found]
    return bool(result["half_removed"]) and "bf16" not in kinds and not result["precision_set"] \
        and not any("torch.autocast" in c for found in result["files"].values() for _, _, c in found)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tsv", type=Path, action="append")
    parser.add_argument("--mirrors", type=Path, default=rc.DEFAULT_MIRRORS)
    parser.add_argument("--only", action="append")
    parser.add_argument("--keep", type=Path)
    parser.add_argument("--markdown", type=Path)
    parser.add_argument("--label", default="own precision")
    parser.add_argument("--at", metavar="REV")
    args = parser.parse_args(argv)
    lists = args.tsv or [rc.DEFAULT_TSV, rc.MORE_TSV, rc.RESEARCH_TSV, UNSEEN_TSV]
    entries = [e for path in lists for e in rc.read_tsv(path)]
    if args.only:
        entries = [e for e in entries if any(p.lower() in f"{e.repo}/{e.script}".lower() for p in args.only)]
    scratch = Path(tempfile.mkdtemp(prefix="own-", dir=args.keep)) if args.keep else \
        Path(tempfile.mkdtemp(prefix="own-precision-"))
    tool = rc.Tool(args.at, scratch)
    trees: dict[str, Path] = {}
    rows = []
    started = time.perf_counter()
    try:
        for i, entry in enumerate(entries, 1):
            if entry.key not in trees:
                trees[entry.key] = scratch / "trees" / entry.key
                rc.extract(rc.git_dir(args.mirrors, entry.repo), entry.commit, trees[entry.key])
            pristine = trees[entry.key]
            if not any(re.search(r"autocast|GradScaler", p.read_text(errors="replace"))
                       for p in pristine.rglob("*.py") if p.is_file()):
                continue
            row = {"entry": entry}
            for name, opts in BACKENDS.items():
                work = scratch / "runs" / f"{i:02d}-{name}"
                row[name] = run(tool, entry, pristine, work, opts)
                if not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
                if name == "fabric" and not row[name]["own"]:
                    break  # not a script with its own mixed precision
            if row["fabric"]["own"]:
                rows.append(row)
            rc.log(f"[{i}/{len(entries)}] {entry.repo} {entry.script}: " + (
                ", ".join(f"{n} {verdict(row[n])}" for n in BACKENDS if n in row) if row["fabric"]["own"]
                else "no own mixed precision") + f" ({time.perf_counter() - started:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    text = report(rows, args, time.perf_counter() - started)
    print(text)
    if args.markdown:
        rc.update_document(args.markdown, args.label, text)
    return 0


def report(rows: list[dict], args, seconds: float) -> str:
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    lines = [f"## {args.label}", "",
             f"`python benchmarks/own_precision.py{' --at ' + args.at if args.at else ''}`, {date}, "
             f"{rc.project_state(args.at)}; {rc.machine()}; {seconds / 60:.0f} minutes.", "",
             "| script | " + " | ".join(BACKENDS) + " |", "|---|" + "---|" * len(BACKENDS)]
    for row in rows:
        e = row["entry"]
        cells = []
        for name in BACKENDS:
            r = row[name]
            v = verdict(r)
            scalers = sum(k == "scaler on" for found in r["files"].values() for _, k, _ in found)
            cell = v + (f" ({r['reason']})" if v != "bf16" and r["reason"] else "")
            cell += f"; {scalers} GradScaler on" if scalers else ""
            cell += "; **half casts removed without an autocast**" if half_problem(r) else ""
            cells.append(rc.cell(cell))
        lines.append(f"| {e.repo} `{e.script}` | " + " | ".join(cells) + " |")
    lines.append("")
    for name in BACKENDS:
        done = [row[name] for row in rows]
        bf16 = sum(verdict(r) == "bf16" for r in done)
        lines.append(f"- {name}: {bf16} of {len(done)} scripts with their own mixed precision compute in bf16; "
                     f"{sum(half_problem(r) for r in done)} with half casts removed and no autocast to take over.")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
