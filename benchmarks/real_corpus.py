"""What accelerate-rewrite makes of real public training scripts (none of them written for it).

    .venv/bin/pip install pyflakes     # needed by this benchmark only (not a dependency of the package)
    .venv/bin/python benchmarks/real_corpus.py                          # the whole corpus: a table on stdout
    .venv/bin/python benchmarks/real_corpus.py --markdown docs/real-world.md --label "before (at abc1234)"
    .venv/bin/python benchmarks/real_corpus.py --only PyTorch-GAN --keep /tmp/real   # a subset; keep the trees
    .venv/bin/python benchmarks/real_corpus.py --at HEAD ...            # the package as committed, not the work tree

The corpus is ``../shared/real-corpus/scripts.tsv`` (its README says what it is) followed by
``benchmarks/real-corpus-more.tsv``, the scripts this project added in families the shared list
lacks, and ``benchmarks/real-corpus-46.tsv``, issue 46's research codebases, chosen before they
were measured (``--tsv``, repeatable, names other lists instead). One
line a script, tab-separated ``repo  commit  script  family``, ``#`` lines are comments. The
repositories' git mirrors are in ``--mirrors`` (default /work/.mirror), one folder
``<owner>+<name>`` each, whose git directory is ``repo/.git`` or else ``repo``. Nothing of them
enters the project: every tree is taken into a scratch folder and deleted afterwards (unless
``--keep DIR``). CI has no mirrors, so this is a benchmark, not a test.

For each script:

1. Its repository's tree at the commit: ``git archive COMMIT | tar -x`` into
   ``SCRATCH/trees/<owner+name>@<commit7>``, once per repository and commit. Mirrors omit their
   largest files (weights, data); when ``git archive`` fails on such a missing blob, the blobs
   that are there are written one by one instead (``git cat-file``) and the missing paths are
   reported (none of them is a .py file in the current corpus).
2. Two option sets, each on a fresh copy of that tree, run in the script's own folder (its
   sibling modules present), as its user would:

   - **fabric** (the headline): ``accelerate-rewrite SCRIPT --precision bf16-mixed --devices 4``
   - **torch**: ``accelerate-rewrite SCRIPT --backend torch --precision bf16-mixed``
   - **accelerate**: ``accelerate-rewrite SCRIPT --backend accelerate --precision bf16-mixed
     --devices 4`` (the headline's plan, written in Hugging Face Accelerate's API)

   each with ``--format json --no-cache -j 1``: first the preview (nothing written; its json
   records, one per file of the project the script touches, give the verdict), then the same
   with ``--write`` on the scratch copy (the rewritten files; the two runs' records must agree),
   then the same ``--write`` once more on the result (idempotence: it must change nothing).
   When a record's ``dropped`` says a rule needed ``--follow-imports`` (the rewrite would change
   a sibling module not named), the same three runs are made again with ``--follow-imports``,
   and the table gives that verdict beside the headline one (the counts are the headline's).
3. Verdict of a run: **converted** (fabric and accelerate: a record's rules hold AR101, the
   conversion; torch: AR207, native autocast, or AR213, the script's own set to the precision), **partial** (some rule changed a file, not that one),
   **refused** (nothing changed), **error** (exit status 2, a record with an error, output that
   isn't json, or a timeout). For partial and refused, the reason is the first place left alone
   by the conversion's rule (AR101; then the other AR1xx; torch: AR207, then AR2xx), else the
   first rule dropped, else the first other place left alone (AR404's opt-in hints last), cut
   to about 120 characters. Reasons are grouped with their code names (`...`) and numbers
   blanked.
4. Checks of every file the ``--write`` run changed: it parses (``ast.parse``), it has no
   undefined name that the original lacks (pyflakes' ``undefined name`` and ``local variable
   ... referenced before assignment``, compared as sets of names per file), and the second
   ``--write`` changes nothing.

Outputs: a table on stdout (progress on stderr); ``--markdown PATH`` writes (or updates) the
document: a preamble, then one section per ``--label`` (default "Latest run"): a run with a
label already in the document replaces that section and keeps the others, so that "before" and
"after" runs sit side by side. ``--json PATH`` dumps every run's records and checks.

The tool is the ``accelerate-rewrite`` console script next to this Python, i.e. the package's
work tree (editable install), whose uncommitted changes the document notes; ``--at REV`` runs
the package as committed at REV instead (``git archive REV accelerate_rewrite`` on PYTHONPATH,
``python -P -m accelerate_rewrite``), unaffected by edits during the run. About 3 minutes for the
25 scripts of the corpus on a 2-core machine; ``--keep`` leaves about 600 MB of trees.
"""

from __future__ import annotations

import argparse
import ast
import datetime
import importlib.metadata
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_TSV = ROOT.parent / "shared" / "real-corpus" / "scripts.tsv"
#: the scripts this project added, in families the shared list lacks (read after it)
MORE_TSV = ROOT / "benchmarks" / "real-corpus-more.tsv"
#: issue 46's research codebases, chosen before they were measured (read last)
RESEARCH_TSV = ROOT / "benchmarks" / "real-corpus-46.tsv"
DEFAULT_MIRRORS = Path("/work/.mirror")
TIMEOUT_S = 300
REASON_CHARS = 120

#: option set -> (the arguments after SCRIPT, the rule whose change means "converted",
#: the prefix of the rules that stand for the conversion's reasons)
OPTION_SETS: dict[str, tuple[list[str], str, str]] = {
    "fabric": (["--precision", "bf16-mixed", "--devices", "4"], "AR101", "AR1"),
    "torch": (["--backend", "torch", "--precision", "bf16-mixed"], "AR207|AR213", "AR2"),
    "accelerate": (["--backend", "accelerate", "--precision", "bf16-mixed", "--devices", "4"], "AR101", "AR1"),
}
#: each option set's column, in the document and on stdout
HEADINGS = {"fabric": "fabric (headline)", "torch": "torch backend", "accelerate": "accelerate backend"}
PLAIN_HEADINGS = {"fabric": "fabric (headline)", "torch": "torch", "accelerate": "accelerate"}
COMMON = ["--format", "json", "--no-cache", "-j", "1"]
FOLLOW = "--follow-imports"

try:
    import pyflakes.checker
    import pyflakes.messages
except ImportError:  # pragma: no cover - said at start-up
    pyflakes = None


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# --------------------------------------------------------------------------- the corpus


@dataclass
class Entry:
    repo: str
    commit: str
    script: str
    family: str

    @property
    def key(self) -> str:
        return f"{self.repo.replace('/', '+')}@{self.commit[:7]}"


def read_tsv(path: Path) -> list[Entry]:
    entries = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip() or line.startswith("#"):
            continue
        cells = line.split("\t")
        if len(cells) < 3:
            sys.exit(f"{path}:{number}: expected repo, commit, script, family (tab-separated)")
        entries.append(Entry(cells[0].strip(), cells[1].strip(), cells[2].strip(),
                             cells[3].strip() if len(cells) > 3 else ""))
    return entries


def git_dir(mirrors: Path, repo: str) -> Path:
    base = mirrors / repo.replace("/", "+") / "repo"
    return base / ".git" if (base / ".git").is_dir() else base


def extract(gitdir: Path, commit: str, dest: Path) -> list[str]:
    """The tree at ``commit`` into ``dest``; returns the paths whose blobs the mirror lacks."""
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", f"--git-dir={gitdir}", "archive", commit], capture_output=True)
    if archive.returncode == 0:
        subprocess.run(["tar", "-x", "-C", str(dest)], input=archive.stdout, check=True)
        return []
    # A mirror without its largest blobs: write the blobs it has, one by one.
    shutil.rmtree(dest)
    dest.mkdir(parents=True)
    listing = subprocess.run(["git", f"--git-dir={gitdir}", "ls-tree", "-r", "-z", commit],
                             capture_output=True, check=True).stdout.decode("utf-8", "surrogateescape")
    missing = []
    with subprocess.Popen(["git", f"--git-dir={gitdir}", "cat-file", "--batch"],
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE) as cat:
        for item in filter(None, listing.split("\0")):
            meta, path = item.split("\t", 1)
            mode, kind, oid = meta.split()
            if kind != "blob":  # submodules: git archive leaves them out too
                continue
            cat.stdin.write(oid.encode() + b"\n")
            cat.stdin.flush()
            header = cat.stdout.readline().split()
            if len(header) < 3 or header[1] == b"missing":
                missing.append(path)
                continue
            data = cat.stdout.read(int(header[2]))
            cat.stdout.read(1)  # the newline after the contents
            target = dest / path
            target.parent.mkdir(parents=True, exist_ok=True)
            if mode == "120000":
                target.symlink_to(data.decode("utf-8", "surrogateescape"))
            else:
                target.write_bytes(data)
                if mode == "100755":
                    target.chmod(0o755)
        cat.stdin.close()
    return missing


# --------------------------------------------------------------------------- the tool


class Tool:
    def __init__(self, at: Optional[str], scratch: Path):
        self.env = dict(os.environ)
        self.env.pop("ACCELERATE_REWRITE_NO_CACHE", None)
        if at:
            package = scratch / "package"
            package.mkdir()
            archive = subprocess.run(["git", "-C", str(ROOT), "archive", at, "accelerate_rewrite"],
                                     capture_output=True, check=True)
            subprocess.run(["tar", "-x", "-C", str(package)], input=archive.stdout, check=True)
            self.cmd = [sys.executable, "-P", "-m", "accelerate_rewrite"]
            self.env["PYTHONPATH"] = str(package)
        else:
            found = shutil.which("accelerate-rewrite", path=str(Path(sys.executable).parent))
            if not found:
                sys.exit("the accelerate-rewrite console script is not installed next to this Python")
            self.cmd = [found]
        self.env["ACCELERATE_REWRITE_CACHE_DIR"] = str(scratch / "cache")  # unused with --no-cache

    def version(self) -> str:
        out = subprocess.run(self.cmd + ["--version"], capture_output=True, text=True, env=self.env)
        return out.stdout.strip()

    def run(self, script: str, cwd: Path, args: list[str]) -> dict:
        started = time.perf_counter()
        try:
            done = subprocess.run(self.cmd + [script] + args, cwd=cwd, capture_output=True, text=True,
                                  env=self.env, timeout=TIMEOUT_S)
        except subprocess.TimeoutExpired:
            return {"rc": None, "records": [], "stderr": f"timed out after {TIMEOUT_S} s",
                    "seconds": time.perf_counter() - started, "bad_json": None}
        records, bad = parse_records(done.stdout)
        return {"rc": done.returncode, "records": records, "stderr": done.stderr,
                "seconds": time.perf_counter() - started, "bad_json": bad}


def parse_records(text: str) -> tuple[list[dict], Optional[str]]:
    decoder = json.JSONDecoder()
    records, at = [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at >= len(text):
            return records, None
        try:
            record, at = decoder.raw_decode(text, at)
        except json.JSONDecodeError:
            return records, text[at:at + 200]
        records.append(record)


# --------------------------------------------------------------------------- verdicts


def shorten(text: str, limit: int = REASON_CHARS) -> str:
    text = " ".join(text.split())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"


def first_reason(records: list[dict], prefix: str, rule: str) -> str:
    places = [(p.get("rule", ""), p.get("message", ""), r.get("path", "")) for r in records
              for p in r.get("left_alone") or []]
    for pick in (lambda code: code in rule.split("|"), lambda code: code.startswith(prefix)):
        for code, message, _ in places:
            if pick(code):
                return f"{code} {message}"
    for r in records:
        for dropped in r.get("dropped") or []:
            return f"dropped: {dropped}"
    for pick in (lambda code: code != "AR404", lambda code: True):
        for code, message, _ in places:
            if pick(code):
                return f"{code} {message}"
    return "nothing to change, no reason given"


def error_text(result: dict) -> Optional[str]:
    if result["rc"] is None:
        return result["stderr"]
    for r in result["records"]:
        if r.get("error"):
            return f"{r.get('path')}: {r['error']}"
    if result["bad_json"] is not None:
        return f"output is not json: {result['bad_json']!r}"
    if result["rc"] not in (0, 1) or not result["records"]:
        lines = [line for line in result["stderr"].splitlines() if line.strip()]
        return f"exit {result['rc']}: " + (lines[-1] if lines else "no output")
    return None


def verdict(result: dict, rule: str, prefix: str) -> tuple[str, str]:
    problem = error_text(result)
    if problem:
        return "error", " ".join(problem.split())
    records = result["records"]
    rules = {code for r in records if r.get("changed") for code in r.get("rules") or []}
    if rules & set(rule.split("|")):
        return "converted", ""
    return ("partial" if rules else "refused"), " ".join(first_reason(records, prefix, rule).split())


def group_reason(reason: str) -> str:
    reason = re.sub(r"`[^`]*`", "`…`", reason)
    reason = re.sub(r"\b(line )?\d+\b", lambda m: (m.group(1) or "") + "N", reason)
    return reason


# --------------------------------------------------------------------------- checks


def undefined_names(source: str, filename: str) -> Optional[set[str]]:
    try:
        tree = ast.parse(source, filename)
    except SyntaxError:
        return None
    checker = pyflakes.checker.Checker(tree, filename=filename)
    names = set()
    for message in checker.messages:
        if isinstance(message, pyflakes.messages.UndefinedName):
            names.add(message.message_args[0])
        elif isinstance(message, pyflakes.messages.UndefinedLocal):
            names.add(f"{message.message_args[0]} (before assignment)")
    return names


def check_outputs(write: dict, cwd: Path, pristine_cwd: Path) -> list[str]:
    """Problems of the files the --write run changed (empty: all fine)."""
    problems = []
    for record in write["records"]:
        if not record.get("changed"):
            continue
        rel = record["path"]
        out_path, orig_path = cwd / rel, pristine_cwd / rel
        try:
            output = out_path.read_text()
        except OSError as exc:
            problems.append(f"{rel}: not readable after --write ({exc})")
            continue
        try:
            ast.parse(output, rel)
        except SyntaxError as exc:
            problems.append(f"{rel}: does not parse: line {exc.lineno}: {exc.msg}")
            continue
        original = orig_path.read_text() if orig_path.exists() else ""
        before = undefined_names(original, rel)
        after = undefined_names(output, rel) or set()
        if before is None:
            problems.append(f"{rel}: the original does not parse (no undefined-name check)")
            continue
        new = sorted(after - before)
        if new:
            problems.append(f"{rel}: new undefined names: {', '.join(new)}")
    return problems


def records_key(records: list[dict]) -> list[tuple]:
    return [(r.get("path"), bool(r.get("changed")), tuple(r.get("rules") or [])) for r in records]


# --------------------------------------------------------------------------- one script, one option set


@dataclass
class Outcome:
    verdict: str
    reason: str
    checks: list[str] = field(default_factory=list)  # problems; empty and changed: all fine
    changed_files: list[str] = field(default_factory=list)
    needs_follow: bool = False
    dropped_rules: list[str] = field(default_factory=list)  # the rules that needed --follow-imports
    seconds: float = 0.0
    rules: list[str] = field(default_factory=list)
    left_alone: int = 0
    stderr_tail: str = ""
    follow: Optional["Outcome"] = None
    records: list[dict] = field(default_factory=list)


def run_case(tool: Tool, entry: Entry, pristine: Path, work: Path, args: list[str], rule: str,
             prefix: str, follow: bool) -> Outcome:
    if work.exists():
        shutil.rmtree(work)
    shutil.copytree(pristine, work, symlinks=True)
    script_rel = Path(entry.script)
    cwd, pristine_cwd = work / script_rel.parent, pristine / script_rel.parent
    full = args + COMMON + ([FOLLOW] if follow else [])
    preview = tool.run(script_rel.name, cwd, full)
    kind, reason = verdict(preview, rule, prefix)
    outcome = Outcome(kind, reason, seconds=preview["seconds"], records=preview["records"],
                      stderr_tail="\n".join(preview["stderr"].splitlines()[-15:]))
    outcome.rules = sorted({c for r in preview["records"] if r.get("changed") for c in r.get("rules") or []})
    outcome.left_alone = sum(len(r.get("left_alone") or []) for r in preview["records"])
    outcome.dropped_rules = sorted({d.split()[0] for r in preview["records"] for d in r.get("dropped") or []
                                    if FOLLOW in d})
    outcome.needs_follow = not follow and bool(outcome.dropped_rules)
    if kind == "error" or not outcome.rules:
        return outcome
    write = tool.run(script_rel.name, cwd, full + ["--write"])
    problem = error_text(write)
    if problem:
        outcome.checks.append(f"--write failed: {shorten(problem)}")
        return outcome
    if records_key(write["records"]) != records_key(preview["records"]):
        outcome.checks.append("the --write run's records differ from the preview's")
    outcome.changed_files = [r["path"] for r in write["records"] if r.get("changed")]
    outcome.checks += check_outputs(write, cwd, pristine_cwd)
    again = tool.run(script_rel.name, cwd, full + ["--write"])
    problem = error_text(again)
    if problem:
        outcome.checks.append(f"second run failed: {shorten(problem)}")
    else:
        for r in again["records"]:
            if r.get("changed"):
                changes = "; ".join(f"{c.get('rule')} line {c.get('line')}: {c.get('message')}"
                                    for c in (r.get("changes") or [])[:2])
                outcome.checks.append(shorten(f"{r['path']}: not idempotent: {changes}", 200))
    return outcome


# --------------------------------------------------------------------------- output


def checks_text(o: Outcome) -> str:
    if o.verdict == "error" or not o.rules:
        return "–"
    return "; ".join(o.checks) if o.checks else "ok"


def verdict_cell(o: Outcome, markdown: bool) -> str:
    word = f"**{o.verdict}**" if markdown else o.verdict
    text = word + (f": {shorten(o.reason)}" if o.reason else "")
    if o.verdict in ("converted", "partial"):
        text += f" ({', '.join(o.rules)})"
    if o.follow is not None:
        f = o.follow
        text += (f" — {', '.join(o.dropped_rules)} dropped: needs `--follow-imports`; with it: {f.verdict}"
                 + (f" ({', '.join(f.rules)})" if f.rules else "")
                 + (f": {shorten(f.reason)}" if f.reason and f.reason != o.reason else ""))
    return text


def cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def machine() -> str:
    cpu = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = "no GPU"
    if shutil.which("nvidia-smi"):
        probe = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True)
        if probe.returncode == 0 and probe.stdout.strip():
            gpu = probe.stdout.strip().splitlines()[0]
    return (f"{os.cpu_count()}-core {cpu or platform.machine()}, {gpu} ({platform.system()} "
            f"{platform.release().split('-')[0]}, CPython {platform.python_version()}, "
            f"libcst {importlib.metadata.version('libcst')}, pyflakes {importlib.metadata.version('pyflakes')})")


def project_state(at: Optional[str]) -> str:
    def git(*a: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *a], capture_output=True, text=True).stdout.strip()

    if at:
        return f"{git('rev-parse', '--short', at)} (`--at {at}`: the package as committed)"
    head = git("rev-parse", "--short", "HEAD")
    dirty = git("status", "--porcelain", "--", "accelerate_rewrite")
    return head + (" + uncommitted changes in accelerate_rewrite/ (the work tree was run)" if dirty else "")


def summary(results: list[dict]) -> dict:
    out = {}
    for name in OPTION_SETS:
        outcomes = [r[name] for r in results]
        counts = Counter(o.verdict for o in outcomes)
        reasons: dict[str, list[str]] = {}
        for r in results:
            o = r[name]
            if o.verdict in ("partial", "refused", "error"):
                reasons.setdefault(shorten(f"{o.verdict}: {group_reason(o.reason)}"), []).append(
                    f"{r['entry'].repo.split('/')[1]}/{r['entry'].script}")
        follow_converted = sum(1 for o in outcomes if o.follow is not None and o.follow.verdict == "converted")
        out[name] = {"counts": counts, "reasons": reasons, "follow_converted": follow_converted,
                     "follow_needed": sum(1 for o in outcomes if o.follow is not None),
                     "problems": [(r["entry"], c) for r in results for o in [r[name], r[name].follow] if o
                                  for c in o.checks]}
    return out


def command_line(name: str) -> str:
    return "accelerate-rewrite SCRIPT " + " ".join(OPTION_SETS[name][0])


def markdown_section(label: str, meta: dict, results: list[dict]) -> str:
    s = summary(results)
    n = len(results)
    lines = [f"## {label}", "",
             f"{meta['date']}, at {meta['project']}, {meta['tool']}, on the **{meta['machine']}**; "
             f"{n} scripts from {meta['repos']} repositories, {meta['seconds']:.0f} s in all "
             f"(load average {meta['load']} at the end).", "",
             "| option set | converted | partial | refused | error | needs `--follow-imports` (converted with it) |",
             "| --- | --- | --- | --- | --- | --- |"]
    for name in OPTION_SETS:
        c = s[name]["counts"]
        lines.append(f"| `{command_line(name)}` | **{c['converted']} of {n}** | {c['partial']} | {c['refused']} | "
                     f"{c['error']} | {s[name]['follow_needed']} ({s[name]['follow_converted']}) |")
    for name in OPTION_SETS:
        lines += ["", f"### Why not converted: {name} (`{command_line(name)}`)", "",
                  "Reasons grouped (`…` stands for code, N for numbers), most frequent first.", "",
                  "| count | reason | scripts |", "| --- | --- | --- |"]
        ranked = sorted(s[name]["reasons"].items(), key=lambda kv: (-len(kv[1]), kv[0]))
        for reason, scripts in ranked:
            lines.append(f"| {len(scripts)} | {cell(reason)} | {cell(', '.join(scripts))} |")
        if not ranked:
            lines.append("| 0 | (all converted) | |")
    lines += ["", "### Per script", "",
              "Checks of the files each `--write` changed: parses, no new undefined name (pyflakes), a second run "
              "changes nothing (`ok`; `–`: nothing changed).", "",
              "| repo | script | family | " + " | ".join(HEADINGS[n] for n in OPTION_SETS)
              + f" | checks ({' / '.join(OPTION_SETS)}) |",
              "| --- | --- | --- | " + " | ".join("---" for _ in OPTION_SETS) + " | --- |"]
    for r in results:
        e, outcomes = r["entry"], [r[name] for name in OPTION_SETS]
        checks = " / ".join(checks_text(o) + (f" (with --follow-imports: {checks_text(o.follow)})" if o.follow else "")
                            for o in outcomes)
        lines.append(f"| {e.repo} | {cell(e.script)} | {cell(e.family)} | "
                     + " | ".join(cell(verdict_cell(o, True)) for o in outcomes) + f" | {cell(checks)} |")
    problems = [(name, e, c) for name in OPTION_SETS for e, c in s[name]["problems"]]
    errors = [(name, r["entry"], r[name].reason) for name in OPTION_SETS for r in results
              if r[name].verdict == "error"]
    lines += ["", "### Problems found", ""]
    if not problems and not errors:
        lines.append("None: no crash, every output parses, no new undefined name, every second run changes nothing.")
    for name, e, text in errors:
        lines.append(f"- {name}, {e.repo} `{e.script}`: error: {cell(text)}")
    for name, e, text in problems:
        lines.append(f"- {name}, {e.repo} `{e.script}`: {cell(text)}")
    if meta["missing"]:
        lines += ["", "Blobs the mirrors lack (not extracted): " + "; ".join(
            f"{k}: {len(v)} ({', '.join(v[:3])}{', …' if len(v) > 3 else ''})" for k, v in meta["missing"].items())
            + "."]
    return "\n".join(lines) + "\n"


PREAMBLE = """# Real-world training scripts

What `accelerate-rewrite` makes of real public training scripts, none of them written for it:
the corpus `../shared/real-corpus/scripts.tsv` and `benchmarks/real-corpus-more.tsv` (repository, commit, script, the shape it stands
for), each script's repository tree taken at its commit into a scratch folder and the command run
in the script's own folder, as its user would. Produced by `benchmarks/real_corpus.py` (its
docstring says exactly what it runs and checks); CI has no mirrors of these repositories, so it
is a benchmark, not a test:

```sh
.venv/bin/pip install pyflakes    # the benchmark's checks only
.venv/bin/python benchmarks/real_corpus.py --markdown docs/real-world.md --label "after (at abc1234)"
```

Two option sets per script: the headline `accelerate-rewrite SCRIPT --precision bf16-mixed
--devices 4` (Lightning Fabric) and `accelerate-rewrite SCRIPT --backend torch --precision
bf16-mixed` (native autocast), each with `--format json --no-cache -j 1`. **converted**: the
conversion's rule changed the script's project (AR101 Fabric; AR207 native autocast);
**partial**: other rules changed it (e.g. AR201's AMP migration) but not the conversion;
**refused**: nothing changed, with the first reason the tool gave; **error**: the tool failed.
Every file a run changes is checked: it parses, gains no undefined name (pyflakes), and a second
run of the same command changes nothing. Each section below is one run, titled with its
`--label`; a run with the same label replaces its section. A section titled "... none of the
lists has" runs another list, `--tsv benchmarks/real-corpus-unseen.tsv`: scripts none of the
default lists has, tried as a new user would.
"""


def update_document(path: Path, label: str, section: str) -> None:
    sections: list[tuple[str, str]] = []
    if path.exists():
        current: Optional[list[str]] = None
        title = ""
        for line in path.read_text().splitlines(keepends=True):
            if line.startswith("## "):
                if current is not None:
                    sections.append((title, "".join(current)))
                title, current = line[3:].strip(), [line]
            elif current is not None:
                current.append(line)
        if current is not None:
            sections.append((title, "".join(current)))
    replaced = False
    for i, (title, _) in enumerate(sections):
        if title == label:
            sections[i] = (label, section)
            replaced = True
    if not replaced:
        sections.append((label, section))
    body = "\n".join(text.rstrip("\n") + "\n" for _, text in sections)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(PREAMBLE + "\n" + body)


def plain_table(results: list[dict]) -> str:
    rows = [("script", *(PLAIN_HEADINGS[n] for n in OPTION_SETS), "checks")]
    for r in results:
        e, outcomes = r["entry"], [r[name] for name in OPTION_SETS]
        verdicts = (o.verdict + (f" (follow-imports: {o.follow.verdict})" if o.follow else "") for o in outcomes)
        checks = " / ".join(checks_text(o) + (f" (follow-imports: {checks_text(o.follow)})" if o.follow else "")
                            for o in outcomes)
        rows.append((f"{e.repo.split('/')[1]}/{e.script}", *verdicts, checks))
    last = len(rows[0]) - 1
    widths = [max(len(row[i]) for row in rows) for i in range(last)]
    out = []
    for row in rows:
        out.append("  ".join(row[i].ljust(widths[i]) for i in range(last)) + "  " + row[last])
    n = len(results)
    s = summary(results)
    out.append("")
    for name in OPTION_SETS:
        c = s[name]["counts"]
        out.append(f"{command_line(name)}: converted {c['converted']} of {n}, partial {c['partial']}, "
                   f"refused {c['refused']}, error {c['error']}")
        for reason, scripts in sorted(s[name]["reasons"].items(), key=lambda kv: (-len(kv[1]), kv[0])):
            out.append(f"  {len(scripts):3d}  {reason}")
    return "\n".join(out)


def to_json(results: list[dict], meta: dict) -> dict:
    return {"meta": meta, "results": [
        {"entry": asdict(r["entry"]), **{name: asdict(r[name]) for name in OPTION_SETS}} for r in results]}


# --------------------------------------------------------------------------- main


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tsv", type=Path, action="append",
                        help=f"the corpus, repeatable (default {DEFAULT_TSV}, then {MORE_TSV.relative_to(ROOT)} "
                             f"and {RESEARCH_TSV.relative_to(ROOT)})")
    parser.add_argument("--mirrors", type=Path, default=DEFAULT_MIRRORS,
                        help=f"folder of the git mirrors, <owner>+<name>/repo (default {DEFAULT_MIRRORS})")
    parser.add_argument("--only", metavar="PATTERN", action="append",
                        help="run the scripts whose repo or script path contains PATTERN (repeatable)")
    parser.add_argument("--keep", metavar="DIR", type=Path,
                        help="scratch folder to keep (trees, rewritten copies) instead of a temporary one")
    parser.add_argument("--markdown", metavar="PATH", type=Path,
                        help="write or update this document (e.g. docs/real-world.md)")
    parser.add_argument("--label", default="Latest run",
                        help="the document's section for this run (default 'Latest run'; replaces one of that title)")
    parser.add_argument("--json", metavar="PATH", type=Path, help="dump every run's records and checks")
    parser.add_argument("--at", metavar="REV", help="run the package as committed at REV, not the work tree")
    args = parser.parse_args(argv)
    if pyflakes is None:
        sys.exit("this benchmark needs pyflakes: .venv/bin/pip install pyflakes")

    entries = [entry for path in (args.tsv or [DEFAULT_TSV, MORE_TSV, RESEARCH_TSV]) for entry in read_tsv(path)]
    if args.only:
        entries = [e for e in entries if any(p.lower() in f"{e.repo}/{e.script}".lower() for p in args.only)]
    if not entries:
        sys.exit("no script matches")
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
        scratch = Path(tempfile.mkdtemp(prefix="run-", dir=args.keep))
    else:
        scratch = Path(tempfile.mkdtemp(prefix="real-corpus-"))
    started = time.perf_counter()
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    project = project_state(args.at)
    tool = Tool(args.at, scratch)
    version = tool.version()
    trees: dict[str, Path] = {}
    missing: dict[str, list[str]] = {}
    results = []
    try:
        for i, entry in enumerate(entries, 1):
            if entry.key not in trees:
                tree = scratch / "trees" / entry.key
                lacks = extract(git_dir(args.mirrors, entry.repo), entry.commit, tree)
                if lacks:
                    missing[entry.key] = lacks
                trees[entry.key] = tree
            pristine = trees[entry.key]
            if not (pristine / entry.script).is_file():
                sys.exit(f"{entry.repo}@{entry.commit[:7]} has no {entry.script}")
            result = {"entry": entry}
            slug = re.sub(r"[^A-Za-z0-9._-]+", "_", f"{i:02d}-{entry.key}-{entry.script}")
            for name, (opts, rule, prefix) in OPTION_SETS.items():
                work = scratch / "runs" / f"{slug}-{name}"
                outcome = run_case(tool, entry, pristine, work, opts, rule, prefix, follow=False)
                if outcome.needs_follow:
                    outcome.follow = run_case(tool, entry, pristine, Path(f"{work}-follow"), opts, rule,
                                              prefix, follow=True)
                if not args.keep:
                    shutil.rmtree(work, ignore_errors=True)
                    shutil.rmtree(f"{work}-follow", ignore_errors=True)
                result[name] = outcome
            results.append(result)
            log(f"[{i}/{len(entries)}] {entry.repo} {entry.script}: " + ", ".join(
                f"{name} {o.verdict}" + (f" (follow-imports: {o.follow.verdict})" if o.follow else "")
                for name, o in result.items() if name in OPTION_SETS)
                + f" ({time.perf_counter() - started:.0f} s)")
    finally:
        if not args.keep:
            shutil.rmtree(scratch, ignore_errors=True)
    seconds = time.perf_counter() - started
    meta = {"date": date, "project": project, "tool": version,
            "machine": machine(), "seconds": seconds, "repos": len(trees),
            "load": ", ".join(f"{x:.1f}" for x in os.getloadavg()), "missing": missing,
            "label": args.label}
    print(plain_table(results))
    print(f"\n({len(results)} scripts in {seconds:.0f} s; {project})")
    if args.keep:
        print(f"(scratch trees kept in {scratch})")
    if args.markdown:
        update_document(args.markdown, args.label, markdown_section(args.label, meta, results))
        log(f"wrote the section '{args.label}' of {args.markdown}")
    if args.json:
        args.json.write_text(json.dumps(to_json(results, meta), indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
