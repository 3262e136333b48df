"""Fuzz the rewrite: generated programs and mutated training scripts, several option sets.

    .venv/bin/python benchmarks/fuzz.py --programs 1000             # counts on stderr, exit 1 if any
    .venv/bin/python benchmarks/fuzz.py --programs 10000 -j 2 --json out.json --save failures/

Two sources, taken in turn (``--mutated-share`` of the programs are mutated scripts):

- **generated**: hypothesmith programs (``from_grammar()`` and ``from_node()``), each alone and
  appended to a training script (fixtures/module_loop) so that the rules have work to do;
- **mutated**: every ``fixtures/*/input.py`` with 1 to 3 structural mutations drawn by a seeded
  generator: the module wrapped in a function, a method of a class, ``with``, ``try``; ``import torch
  as T``; ``from torch import optim``; a walrus; a decorated helper; the first loop nested in
  another; a second model and optimizer with its own loop; trailing whitespace; tabs; CRLF, CR
  and no final newline; whitespace, comments and blank lines after the last statement.

Each program is rewritten with one of OPTION_SETS (in turn), and then its result again.
Counted, for programs CPython compiles (``compile()``; the others are skipped):

- crashes: anything but the tool's own clear refusal (``RewriteError``) out of ``rewrite()``;
- refused: ``RewriteError`` (LibCST can't read what CPython does), not a failure;
- invalid outputs: a result CPython does not compile;
- new undefined names: a name the result reads and no longer defines (scope analysis);
- non-idempotent: a second run changes the result;
- lost comments: a comment of the input missing from the output that was not on (or right above)
  a line of code the rewrite changed;
- changed with no rule applied: an output that differs from the input with no change reported.

Only the standard library, hypothesis/hypothesmith (the test extra) and the package are used;
torch is never imported.
"""

from __future__ import annotations

import argparse
import collections
import json
import random
import re
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Iterator, Optional

import libcst as cst

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accelerate_rewrite.codemod.checks import undefined_names  # noqa: E402
from accelerate_rewrite.api import RewriteError, rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402

FIXTURES = ROOT / "fixtures"
HEAD = (FIXTURES / "module_loop" / "input.py").read_text(encoding="utf-8")

OPTION_SETS: dict[str, dict] = {
    "default": {},
    "bf16-mixed-devices-4": {"precision": "bf16-mixed", "devices": 4},
    "torch-16-mixed": {"backend": "torch", "precision": "16-mixed"},
    "torch-bf16-mixed-accumulate-4": {"backend": "torch", "precision": "bf16-mixed", "accumulate": 4},
    "accumulate-4-clip": {"accumulate": 4, "clip_grad_norm": 1.0},
    "freeze": {"freeze": ("0", "encoder.*")},
    "torch-16-true-freeze-accumulate": {"backend": "torch", "precision": "16-true", "freeze": ("0",),
                                        "accumulate": 2},
    "checkpointing-compile-8bit": {"checkpointing": "Block", "compile": True, "optimizer_8bit": True},
    "torch-padding-hints": {"backend": "torch", "dynamic_padding": True, "group_by_length": "eval",
                            "explicit": ("AR404",)},
}
COUNTS = ("programs", "skipped (not Python)", "refused", "crashes", "invalid outputs",
          "new undefined names", "non-idempotent", "lost comments", "changed with no rule applied")
FAILURES = COUNTS[3:]


# ---- mutations -----------------------------------------------------------------------------------

def _split_header(module: cst.Module) -> tuple[list, list]:
    """(docstring and ``from __future__`` imports, the rest)."""
    body = list(module.body)
    head = []
    while body and (m_docstring(body[0]) or m_future(body[0])):
        head.append(body.pop(0))
    return head, body


def m_docstring(stmt) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Expr) \
        and isinstance(stmt.body[0].value, (cst.SimpleString, cst.ConcatenatedString))


def m_future(stmt) -> bool:
    return isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.ImportFrom) \
        and isinstance(stmt.body[0].module, cst.Name) and stmt.body[0].module.value == "__future__"


def _wrap(text: str, make: Callable[[cst.IndentedBlock], list[cst.BaseStatement]]) -> str:
    module = cst.parse_module(text)
    head, body = _split_header(module)
    if not body:
        return text
    block = cst.IndentedBlock(body=[body[0].with_changes(leading_lines=[]), *body[1:]])
    return module.with_changes(body=[*head, *make(block)]).code


def wrap_function(text: str) -> str:
    return _wrap(text, lambda b: [cst.FunctionDef(cst.Name("_fuzz_main"), cst.Parameters(), b),
                                  cst.parse_statement("_fuzz_main()\n")])


def wrap_class(text: str) -> str:
    """The script as the method of a class: ``class _FuzzScript: def run(self): ...``."""
    return _wrap(text, lambda b: [
        cst.ClassDef(cst.Name("_FuzzScript"), cst.IndentedBlock([cst.FunctionDef(
            cst.Name("run"), cst.Parameters([cst.Param(cst.Name("self"))]), b)])),
        cst.parse_statement("_FuzzScript().run()\n")])


def wrap_with(text: str) -> str:
    return "import contextlib\n" + _wrap(text, lambda b: [cst.With(
        [cst.WithItem(cst.parse_expression("contextlib.nullcontext()"))], b)])


def wrap_try(text: str) -> str:
    return _wrap(text, lambda b: [cst.Try(b, handlers=[cst.ExceptHandler(
        cst.IndentedBlock([cst.parse_statement("pass\n")]), type=cst.Name("KeyboardInterrupt"))])])


def alias_torch(text: str) -> str:
    """``import torch as T`` and ``T.`` everywhere (``import torch.nn as nn`` stays an import of torch)."""
    if not re.search(r"^import torch$", text, re.M):
        return text
    out = re.sub(r"\btorch\b", "T", text)
    out = re.sub(r"^(\s*)import T\s*$", r"\1import torch as T", out, flags=re.M)
    out = re.sub(r"^(\s*)import T\.", r"\1import torch.", out, flags=re.M)
    out = re.sub(r"^(\s*)from T\b", r"\1from torch", out, flags=re.M)
    return out


def from_torch_import_optim(text: str) -> str:
    if "torch.optim." not in text or not re.search(r"^import torch$", text, re.M):
        return text
    text = re.sub(r"^import torch$", "import torch\nfrom torch import optim", text, count=1, flags=re.M)
    return re.sub(r"\btorch\.optim\.(?=[A-Z])", "optim.", text)


def add_walrus(text: str) -> str:
    return text + "\nif (_fuzz_n := 3) > 2:\n    _fuzz_m = [y for x in range(_fuzz_n) if (y := x * 2)]\n"


def add_decorated_helper(text: str) -> str:
    return text + ("\nimport functools\n\n\n@functools.lru_cache(maxsize=None)\n"
                   "def _fuzz_helper(x):  # a decorated helper\n    return x * 2\n")


def nest_first_loop(text: str) -> str:
    class Nest(cst.CSTTransformer):
        done = False

        def leave_For(self, original, updated):
            if self.done:
                return updated
            self.done = True
            return cst.For(cst.Name("_fuzz_repeat"), cst.parse_expression("range(1)"),
                           cst.IndentedBlock([updated.with_changes(leading_lines=[])]),
                           leading_lines=updated.leading_lines)

    return cst.parse_module(text).visit(Nest()).code


SECOND_MODEL = """
model_b = torch.nn.Linear(4, 1)
optimizer_b = torch.optim.SGD(model_b.parameters(), lr=0.1)
for _fuzz_step in range(2):
    loss_b = model_b(torch.randn(2, 4)).sum()  # a second model and optimizer
    loss_b.backward()
    optimizer_b.step()
    optimizer_b.zero_grad()
"""


def add_second_model(text: str) -> str:
    """Only where torch is imported at module level: after a wrap, a module-level loop would read
    a name the script never binds (a script that can't run, whose second rewrite may differ once
    a rule imports torch at the top)."""
    return text + SECOND_MODEL if re.search(r"^import torch\r?$", text, re.M) else text


def trailing_whitespace(text: str, rng: random.Random) -> str:
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if line and not line.rstrip().endswith("\\") and rng.random() < 0.3:
            lines[i] = line + rng.choice([" ", "  ", "\t", " \t "])
    return "\n".join(lines)


def tabs(text: str) -> str:
    return "\n".join(re.sub(r"^((?:    )+)", lambda m: "\t" * (len(m.group(1)) // 4), line)
                     for line in text.split("\n"))


def ending(text: str, rng: random.Random) -> str:
    tail = rng.choice(["", "\n", "\n\n \n", "    # keep me\n  ", "\n# end\n", "  ", "\n\t\n"])
    text = text.rstrip("\n") + ("\n" if rng.random() < 0.7 else "") + tail
    kind = rng.choice(["lf", "lf", "crlf", "cr"])
    if kind == "crlf":
        text = text.replace("\n", "\r\n")
    elif kind == "cr":
        text = text.replace("\n", "\r")
    return text


STRUCTURAL = [wrap_function, wrap_class, wrap_with, wrap_try, alias_torch, from_torch_import_optim,
              add_walrus, add_decorated_helper, nest_first_loop, add_second_model]


def mutate(text: str, rng: random.Random) -> tuple[str, list[str]]:
    applied = []
    for fn in rng.sample(STRUCTURAL, rng.randint(1, 3)):
        try:
            new = fn(text)
        except cst.ParserSyntaxError:
            continue
        if new != text:
            text = new
            applied.append(fn.__name__)
    if rng.random() < 0.3:
        text = trailing_whitespace(text, rng)
        applied.append("trailing_whitespace")
    if rng.random() < 0.15:
        text = tabs(text)
        applied.append("tabs")
    if rng.random() < 0.5:
        text = ending(text, rng)
        applied.append("ending")
    return text, applied


def mutated_programs(seed: int) -> Iterator[tuple[str, str]]:
    rng = random.Random(seed)
    fixtures = sorted(FIXTURES.glob("*/input.py"))
    while True:
        path = rng.choice(fixtures)
        text, applied = mutate(path.read_text(encoding="utf-8"), rng)
        yield f"{path.parent.name} + {', '.join(applied) or 'nothing'}", text


def generated_programs(seed: int, count: int, batch: int = 100) -> Iterator[tuple[str, str]]:
    """hypothesmith programs, alone and appended to a training script (in turn), drawn in
    batches (a run cut short by ``--time-limit`` has drawn no more than it checked)."""
    import hypothesmith
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as seeded

    strategies = (hypothesmith.from_grammar(), hypothesmith.from_node())
    made = 0
    for n in range(0, count, batch):
        found: list[str] = []
        size = min(batch, count - n)
        strategy = strategies[(n // batch) % 2]

        @seeded(seed * 100_003 + n)
        @settings(max_examples=size, deadline=None, database=None, phases=[Phase.generate],
                  suppress_health_check=list(HealthCheck))
        @given(strategy)
        def collect(source):
            found.append(source)

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            collect()
        for source in found[:size]:
            yield (f"hypothesmith #{made}", source) if made % 2 == 0 else (
                f"hypothesmith #{made} in a script", HEAD + "\n" + source)
            made += 1


# ---- checks --------------------------------------------------------------------------------------

_COMMENT = re.compile(r"#.*$")


def _comments(text: str) -> Optional[list[tuple[int, str]]]:
    from accelerate_rewrite.codemod.edits.preserve import trivia

    items = trivia(text)
    return None if items is None else [(line, t) for line, t in items if t]


def lost_comments(source: str, output: str) -> list[str]:
    """Comments of ``source`` missing from ``output`` that were not on a line of code the rewrite
    changed, nor in the comment block right above one (those go with their statement)."""
    from accelerate_rewrite.codemod.suppress import changed_lines

    before = _comments(source)
    after = _comments(output)
    if before is None or after is None:
        return []
    left = collections.Counter(t for _, t in after)
    changed = changed_lines(source, output)
    lines = source.replace("\r\n", "\n").replace("\r", "\n").split("\n")

    def code_line(n: int) -> bool:
        text = lines[n - 1].strip() if 0 < n <= len(lines) else ""
        return bool(text) and not text.startswith("#")

    def attached(n: int) -> bool:  # on a changed line of code, or above one with no blank between
        while 0 < n <= len(lines):
            if code_line(n):
                return n in changed
            if not lines[n - 1].strip():
                return False
            n += 1
        return False

    missing = []
    for line, text in before:
        if left[text] > 0:
            left[text] -= 1
        elif not attached(line):
            missing.append(f"line {line}: {text}")
    return missing


@dataclass
class Tally:
    counts: collections.Counter = field(default_factory=collections.Counter)
    examples: dict[str, list[dict]] = field(default_factory=lambda: collections.defaultdict(list))

    def fail(self, kind: str, name: str, source: str, options: str, detail: str) -> None:
        self.counts[kind] += 1
        if len(self.examples[kind]) < 20:
            self.examples[kind].append({"program": name, "options": options, "detail": detail[-2000:],
                                        "source": source})


def check_one(name: str, source: str, option_set: str, tally: Tally) -> None:
    tally.counts["programs"] += 1
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            compile(source, "<input>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError):
            tally.counts["skipped (not Python)"] += 1
            return
        options = Options.create(**OPTION_SETS[option_set])
        try:
            result = rewrite(source, options, check_idempotence=False)
        except RewriteError:
            tally.counts["refused"] += 1
            return
        except RecursionError:
            tally.fail("crashes", name, source, option_set, traceback.format_exc())
            return
        except Exception:
            tally.fail("crashes", name, source, option_set, traceback.format_exc())
            return
        out = result.output
        if out != source and not result.changes:
            tally.fail("changed with no rule applied", name, source, option_set, str(result.dropped))
        if out == source:
            return
        try:
            compile(out, "<output>", "exec", dont_inherit=True)
        except (SyntaxError, ValueError) as exc:
            tally.fail("invalid outputs", name, source, option_set, f"{exc}\n{out}")
            return
        try:
            before = set(undefined_names(cst.parse_module(source)))
            new = sorted(set(undefined_names(cst.parse_module(out))) - before)
        except (cst.ParserSyntaxError, RecursionError):
            new = []  # what LibCST can't read whole (a trailing continuation): the engine checked it
        if new:
            tally.fail("new undefined names", name, source, option_set, f"{new}\n{out}")
        try:
            again = rewrite(out, options, check_idempotence=False).output
        except Exception:
            tally.fail("crashes", name, out, option_set, "second run: " + traceback.format_exc())
            return
        if again != out:
            import difflib

            diff = "".join(difflib.unified_diff(out.splitlines(True), again.splitlines(True)))
            tally.fail("non-idempotent", name, source, option_set, diff)
        lost = lost_comments(source, out)
        if lost:
            tally.fail("lost comments", name, source, option_set, "; ".join(lost[:5]))


def run(programs: int, seed: int, mutated_share: float, time_limit: Optional[float],
        progress: bool = True, label: str = "") -> tuple[Tally, float]:
    """``programs`` programs, mutated and generated ones interleaved (``mutated_share`` of them
    mutated), each with the next option set."""
    tally = Tally()
    n_mutated = round(programs * mutated_share)
    sets = list(OPTION_SETS)
    start = time.monotonic()
    mutated = mutated_programs(seed)
    generated = generated_programs(seed, programs - n_mutated)
    for i in range(programs):
        # the i-th program is mutated when that keeps the share: interleaved, not in two runs
        use_mutated = (i + 1) * n_mutated // programs > i * n_mutated // programs
        name, text = next(mutated) if use_mutated else next(generated)
        check_one(name, text, sets[i % len(sets)], tally)
        if progress and (i + 1) % 100 == 0:
            elapsed = time.monotonic() - start
            print(f"  {label}{i + 1}/{programs} programs, {elapsed:.0f} s, "
                  f"{sum(tally.counts[k] for k in FAILURES)} failures", file=sys.stderr, flush=True)
        if time_limit is not None and time.monotonic() - start > time_limit:
            break
    return tally, time.monotonic() - start


def _worker(args: tuple) -> tuple[dict, dict, float]:
    programs, seed, share, time_limit, label = args
    tally, took = run(programs, seed, share, time_limit, label=label)
    return dict(tally.counts), dict(tally.examples), took


def run_parallel(programs: int, seed: int, mutated_share: float, time_limit: Optional[float],
                 jobs: int) -> tuple[Tally, float]:
    """``jobs`` processes, each with its share of the programs and a seed of its own."""
    from concurrent.futures import ProcessPoolExecutor

    shares = [programs // jobs + (1 if k < programs % jobs else 0) for k in range(jobs)]
    tally = Tally()
    start = time.monotonic()
    with ProcessPoolExecutor(jobs) as pool:
        for counts, examples, _ in pool.map(_worker, [(n, seed * 1000 + k, mutated_share, time_limit,
                                                       f"[{k}] ") for k, n in enumerate(shares)]):
            tally.counts.update(counts)
            for kind, items in examples.items():
                tally.examples[kind].extend(items[:20 - len(tally.examples[kind])])
    return tally, time.monotonic() - start


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--programs", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mutated-share", type=float, default=0.3,
                        help="share of the programs that are mutated fixtures (default 0.3)")
    parser.add_argument("--time-limit", type=float, default=None, help="stop after this many seconds")
    parser.add_argument("-j", "--jobs", type=int, default=1, help="processes (default 1)")
    parser.add_argument("--json", type=Path, help="write the counts and failing examples here")
    parser.add_argument("--save", type=Path, help="write each failing program into this folder")
    args = parser.parse_args(argv)
    if args.jobs > 1:
        tally, took = run_parallel(args.programs, args.seed, args.mutated_share, args.time_limit, args.jobs)
    else:
        tally, took = run(args.programs, args.seed, args.mutated_share, args.time_limit)
    for key in COUNTS:
        print(f"{key:32} {tally.counts[key]}")
    print(f"{'seconds':32} {took:.0f}")
    if args.json:
        args.json.write_text(json.dumps({"counts": {k: tally.counts[k] for k in COUNTS}, "seconds": took,
                                         "examples": tally.examples}, indent=1))
    if args.save:
        args.save.mkdir(parents=True, exist_ok=True)
        for kind, examples in tally.examples.items():
            for n, example in enumerate(examples):
                stem = f"{kind.replace(' ', '-')}-{n}"
                (args.save / f"{stem}.py").write_bytes(example["source"].encode("utf-8", "surrogatepass"))
                (args.save / f"{stem}.txt").write_text(
                    f"{example['program']}\noptions: {example['options']}\n\n{example['detail']}\n")
    return 1 if any(tally.counts[k] for k in FAILURES) else 0


if __name__ == "__main__":
    raise SystemExit(main())
