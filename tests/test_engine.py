"""The engine: checks that drop a failing rule, rules that crash or lose a prerequisite,
formatting kept byte for byte, and no torch on the rewrite path."""

from __future__ import annotations

import ast
import difflib
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import libcst as cst
import pytest

from accelerate_rewrite.api import RewriteError, rewrite
from accelerate_rewrite.codemod.rule import Rule, RuleContext
from accelerate_rewrite.options import Options

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = Options.create()


# ---------------------------------------------------------------------------------------
# tiny fake rules
# ---------------------------------------------------------------------------------------

def _assignment_to(ctx: RuleContext, name: str) -> cst.SimpleStatementLine:
    for stmt in ctx.facts.module.body:
        if isinstance(stmt, cst.SimpleStatementLine) and isinstance(stmt.body[0], cst.Assign):
            target = stmt.body[0].targets[0].target
            if isinstance(target, cst.Name) and target.value == name:
                return stmt
    raise AssertionError(f"no assignment to {name}")


class RemoveX(Rule):
    """Removes ``x = ...``: leaves ``x`` undefined where the script still reads it."""

    code = "T001"
    name = "remove-x"

    def rewrite(self, ctx: RuleContext) -> None:
        stmt = _assignment_to(ctx, "x")
        ctx.edits.remove(stmt)
        ctx.change(stmt, "removed x")


class AddMarker(Rule):
    """Adds ``marker = 1`` after ``y = ...`` (harmless)."""

    code = "T002"
    name = "add-marker"

    def rewrite(self, ctx: RuleContext) -> None:
        stmt = _assignment_to(ctx, "y")
        ctx.edits.insert_after(stmt, cst.parse_statement("marker = 1\n"))
        ctx.change(stmt, "added a marker")


class Crash(Rule):
    """A rule with a bug."""

    code = "T003"
    name = "crash"

    def rewrite(self, ctx: RuleContext) -> None:
        ctx.change(None, "about to fail")
        raise KeyError("boom")


class NeedsCrash(AddMarker):
    code = "T004"
    name = "needs-crash"
    requires = ("T003",)


class NeedsRemoveX(Rule):
    """Adds ``other = 2`` at the end; relies on T001."""

    code = "T005"
    name = "needs-remove-x"
    requires = ("T001",)

    def rewrite(self, ctx: RuleContext) -> None:
        last = ctx.facts.module.body[-1]
        ctx.edits.insert_after(last, cst.parse_statement("other = 2\n"))
        ctx.change(last, "added other")


class NeedsNeedsRemoveX(NeedsRemoveX):
    code = "T006"
    name = "needs-needs-remove-x"
    requires = ("T005",)

    def rewrite(self, ctx: RuleContext) -> None:
        first = ctx.facts.module.body[0]
        ctx.edits.insert_before(first, cst.parse_statement("third = 3\n"))


class ReturnAtModuleLevel(Rule):
    """Puts a ``return`` at module level: parses with LibCST, does not compile."""

    code = "T007"
    name = "bad-return"

    def rewrite(self, ctx: RuleContext) -> None:
        ctx.edits.insert_after(ctx.facts.module.body[-1], cst.parse_statement("return 1\n"))


class NeverApplies(AddMarker):
    code = "T008"
    name = "never"

    def applies(self, options: Options) -> bool:
        return False


SOURCE = "import os\n\nx = 1\ny = 2\nprint(x, y, os.sep)\n"


def test_fake_rules_work_alone():
    result = rewrite(SOURCE, DEFAULT, rules=[AddMarker()])
    assert result.output == "import os\n\nx = 1\ny = 2\nmarker = 1\nprint(x, y, os.sep)\n"
    assert not result.dropped
    assert [n.message for n in result.changes] == ["added a marker"]


def test_rule_leaving_a_name_undefined_is_dropped_and_nothing_changes():
    result = rewrite(SOURCE, DEFAULT, path="train.py", rules=[RemoveX()])
    assert result.output == SOURCE
    assert not result.changed
    assert result.notes == []  # the dropped rule's notes are not reported as changes
    [message] = result.dropped
    assert message.startswith("T001 remove-x: dropped for this file")
    assert "`x`" in message and "line " in message and "no longer defined" in message


def test_undefined_name_message_names_the_line_in_the_input():
    result = rewrite(SOURCE, DEFAULT, rules=[RemoveX()])
    assert "(line 5)" in result.dropped[0]


def test_dropping_one_rule_keeps_the_others():
    result = rewrite(SOURCE, DEFAULT, rules=[RemoveX(), AddMarker()])
    assert result.output == "import os\n\nx = 1\ny = 2\nmarker = 1\nprint(x, y, os.sep)\n"
    assert len(result.dropped) == 1 and result.dropped[0].startswith("T001")
    assert [n.rule for n in result.notes] == ["T002"]


def test_a_name_undefined_in_the_input_is_not_blamed_on_a_rule():
    source = "print(undefined_before)\ny = 2\n"
    result = rewrite(source, DEFAULT, rules=[AddMarker()])
    assert not result.dropped
    assert result.output == "print(undefined_before)\ny = 2\nmarker = 1\n"


@pytest.mark.parametrize("long", [False, True], ids=["short", "long"])
def test_the_inputs_undefined_names_are_found_only_where_a_result_reads_one(monkeypatch, long):
    """The names the input reads undefined already are found (LibCST's scope analysis reads
    every access) only when a result reads a name nothing defines; for a long script, whose
    analysis is let go once the rules have run, by a new analysis: a rule is still blamed for
    a name it undefines, and never for one the input read undefined already."""
    from accelerate_rewrite.codemod import checks, engine

    if long:
        monkeypatch.setattr(engine, "LONG_SCRIPT_LINES", 0)
    calls = []
    real = checks.undefined_in
    monkeypatch.setattr(checks, "undefined_in", lambda *a: calls.append(1) or real(*a))
    tag = f"# {long}\n"  # a text of its own: no facts kept from another test
    assert rewrite(tag + SOURCE, DEFAULT, rules=[AddMarker()]).output.count("marker = 1") == 1
    assert calls == []  # every name of the result resolves: the input's undefined names not asked for
    result = rewrite(tag + SOURCE, DEFAULT, rules=[RemoveX()])
    assert result.output == tag + SOURCE and "(line 6)" in result.dropped[0]
    source = tag + "print(undefined_before)\ny = 2\n"
    result = rewrite(source, DEFAULT, rules=[AddMarker()])
    assert not result.dropped and result.output == source + "marker = 1\n"
    assert calls


def test_rule_that_raises_is_dropped_with_internal_error_and_others_apply():
    result = rewrite(SOURCE, DEFAULT, rules=[Crash(), AddMarker()])
    assert "marker = 1" in result.output
    [message] = result.dropped
    assert message.startswith("T003 crash: internal error")
    assert "KeyError" in message and "boom" in message
    assert all(n.rule != "T003" for n in result.notes)  # half-done notes are not reported


def test_rule_requiring_a_crashed_rule_is_dropped_too():
    result = rewrite(SOURCE, DEFAULT, rules=[Crash(), NeedsCrash(), AddMarker()])
    assert result.output.count("marker = 1") == 1  # AddMarker's, not NeedsCrash's
    assert any(d.startswith("T003") and "internal error" in d for d in result.dropped)
    assert any(d.startswith("T004") and "it relies on T003 (crash), which did not run" in d
               for d in result.dropped)
    assert all(n.rule not in ("T003", "T004") for n in result.notes)


def test_rule_requiring_a_rule_that_does_not_apply_is_dropped():
    class NeedsNever(AddMarker):
        code = "T009"
        name = "needs-never"
        requires = ("T008",)

    result = rewrite(SOURCE, DEFAULT, rules=[NeverApplies(), NeedsNever()])
    assert result.output == SOURCE
    assert [d.split(":")[0] for d in result.dropped] == ["T009"]


def test_rules_requiring_a_rule_dropped_by_the_check_go_with_it():
    rules = [RemoveX(), NeedsRemoveX(), NeedsNeedsRemoveX(), AddMarker()]
    result = rewrite(SOURCE, DEFAULT, rules=rules)
    assert result.output == "import os\n\nx = 1\ny = 2\nmarker = 1\nprint(x, y, os.sep)\n"
    [message] = result.dropped
    assert message.startswith("T001 remove-x: dropped for this file")
    assert "T005" in message and "T006" in message and "rely on it" in message
    assert [n.rule for n in result.notes] == ["T002"]


def test_result_that_does_not_compile_is_never_returned():
    result = rewrite(SOURCE, DEFAULT, rules=[AddMarker(), ReturnAtModuleLevel()])
    assert "return 1" not in result.output and "marker = 1" in result.output
    [message] = result.dropped
    assert message.startswith("T007") and "does not compile" in message


def test_rules_that_do_not_apply_do_not_run():
    result = rewrite(SOURCE, DEFAULT, rules=[NeverApplies()])
    assert result.output == SOURCE and not result.dropped and not result.notes


def test_syntax_error_names_the_file_and_place():
    with pytest.raises(RewriteError, match=r"^broken\.py:2:\d+: syntax error"):
        rewrite("x = 1\ndef (:\n", DEFAULT, path="broken.py")


def test_notes_are_sorted_by_line():
    class Late(Rule):
        code = "T010"
        name = "late"

        def rewrite(self, ctx):
            ctx.skip(ctx.facts.module.body[-1], "last")
            ctx.change(ctx.facts.module.body[0], "first")

    result = rewrite(SOURCE, DEFAULT, rules=[Late()])
    assert [(n.line, n.message, n.skipped) for n in result.notes] == [(1, "first", False), (5, "last", True)]
    assert [n.message for n in result.skips] == ["last"]


# ---------------------------------------------------------------------------------------
# formatting outside the edited places, with the real rules
# ---------------------------------------------------------------------------------------

def _kept_and_lost(source: str, output: str) -> tuple[list[str], list[str]]:
    """Input lines (with their line endings) found unchanged in the output, in order, and the
    input lines that are not there."""
    a = source.splitlines(keepends=True)
    b = output.splitlines(keepends=True)
    kept, lost = [], []
    for tag, i1, i2, _, _ in difflib.SequenceMatcher(None, a, b, autojunk=False).get_opcodes():
        (kept if tag == "equal" else lost).extend(a[i1:i2])
    return kept, lost


MESSY = (
    "# -*- coding: utf-8 -*-\r\n"
    "# Entraînement: données → modèle (温度), ünïcödé ✓\r\n"
    "import torch\r\n"
    "\r\n"
    "\r\n"
    "def main():\r\n"
    "\tdevice = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\r\n"
    "\tmodel = torch.nn.Linear(4, 1).to(device)  # le modèle\r\n"
    "\toptimizer = torch.optim.SGD(model.parameters(), lr=0.1)\r\n"
    "\r\n"
    "\r\n"
    "\t# boucle — étapes\r\n"
    "\tfor step in range(3):\r\n"
    "\t\tx = torch.randn(2, 4,   device=device)\r\n"
    "\t\tloss = model(x).sum()   # perte\r\n"
    "\t\tloss.backward()\r\n"
    "\t\toptimizer.step( )  # odd spacing stays\r\n"
    "\t\tprint( 'step' , step )\r\n"
    "\r\n"
    "    \r\n"  # whitespace-only line
    "main()"  # no final newline
)


def test_formatting_outside_edits_is_byte_for_byte():
    result = rewrite(MESSY, DEFAULT)
    assert result.changed and not result.dropped
    out = result.output
    _, lost = _kept_and_lost(MESSY, out)
    # exactly the edited statements changed; every other line is there, byte for byte, in order
    assert [line.strip() for line in lost] == [
        "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')",
        "model = torch.nn.Linear(4, 1).to(device)  # le modèle",
        "x = torch.randn(2, 4,   device=device)",
        "loss.backward()",
        "print( 'step' , step )",
    ]
    assert "\tmodel = torch.nn.Linear(4, 1)  # le modèle\r\n" in out  # trailing comment kept
    assert "\t\tx = torch.randn(2, 4,   device=fabric.device)\r\n" in out  # spacing around the edit kept
    assert "\t\tfabric.backward(loss)\r\n" in out
    assert "\t\tfabric.print( 'step' , step )\r\n" in out


def test_line_endings_tabs_and_final_newline_are_kept():
    out = rewrite(MESSY, DEFAULT).output
    assert out.count("\n") == out.count("\r\n")  # no bare LF, even on inserted lines
    assert not out.endswith("\n") and out.endswith("main()")
    body = out.split("def main():\r\n", 1)[1]
    for line in body.split("\r\n"):
        if line.strip() and not line.startswith("main()"):
            assert line.startswith("\t") and not line.startswith(" "), repr(line)
    assert "\tfabric = Fabric(devices=1)\r\n\tfabric.launch()\r\n" in out
    assert "\tmodel, optimizer = fabric.setup(model, optimizer)\r\n" in out
    assert "from lightning.fabric import Fabric\r\n" in out
    ast.parse(out)


def test_lf_file_gets_no_crlf_and_keeps_its_final_newline():
    source = MESSY.replace("\r\n", "\n") + "\n"
    out = rewrite(source, DEFAULT).output
    assert "\r" not in out and out.endswith("main()\n")


def test_encoding_round_trips_through_the_source_layer(tmp_path):
    """Bytes in, bytes out: a latin-1 file with its cookie, and a UTF-8 file with a BOM."""
    from accelerate_rewrite.codemod.files.source import decode

    lf = MESSY.replace("\r\n", "\n")
    body = lf.split("\n", 2)[2].replace("—", "-")  # keep to latin-1 characters
    latin = "# -*- coding: latin-1 -*-\n# café, señal, 25°C\n" + body
    cases = [
        (latin.encode("latin-1"), "# café, señal, 25°C\n".encode("latin-1")),
        (b"\xef\xbb\xbf" + MESSY.encode("utf-8"), "modèle (温度)".encode("utf-8")),
    ]
    for raw, comment in cases:
        src = decode(tmp_path / "t.py", raw)
        result = rewrite(src.text, DEFAULT)
        assert result.changed and not result.dropped
        data = src.encode(result.output)
        assert comment in data
        assert data.startswith(raw.split(b"\n", 1)[0])  # the cookie / BOM line, byte for byte


def test_comments_and_blank_lines_around_a_removed_statement():
    source = textwrap.dedent('''\
        #!/usr/bin/env python
        """Docstring."""
        import torch  # torch!

        # ---------------------------------------------------------------
        # Device selection

        # pick the GPU when there is one
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")

        model = torch.nn.Linear(4, 1)
        model.to(device)  # move it
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)


        def helper():
            # unrelated, untouched
            return 1


        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    ''')
    result = rewrite(source, DEFAULT)
    _, lost = _kept_and_lost(source, result.output)
    assert [line.strip() for line in lost] == [
        'device = torch.device("cuda" if torch.cuda.is_available() else "cpu")',
        "model.to(device)  # move it",
        "loss.backward()",
    ]
    assert "import torch  # torch!\nfrom lightning.fabric import Fabric\n" in result.output
    assert "def helper():\n    # unrelated, untouched\n    return 1\n\n\nloss" in result.output


# ---------------------------------------------------------------------------------------
# the rewrite path imports no torch or lightning
# ---------------------------------------------------------------------------------------

def test_rewrite_path_imports_no_torch_or_lightning():
    program = textwrap.dedent('''
        import sys
        import accelerate_rewrite.cli, accelerate_rewrite.rules
        from accelerate_rewrite.api import rewrite
        from accelerate_rewrite.options import Options
        from pathlib import Path
        changed = 0
        options = Options.create(precision="bf16-mixed", devices=4)
        for name in ("gan", "checkpointing", "trainer_class", "data_parallel", "torchmetrics_metrics"):
            source = Path("fixtures", name, "input.py").read_text(encoding="utf-8")
            changed += rewrite(source, options).changed
        heavy = sorted(m for m in sys.modules
                       if m.split(".")[0] in ("torch", "lightning", "lightning_fabric", "pytorch_lightning"))
        print(changed, heavy)
    ''')
    proc = subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    changed, heavy = proc.stdout.strip().split(" ", 1)
    assert int(changed) == 5
    assert heavy == "[]"


def test_a_failing_fabric_rule_takes_the_whole_conversion_with_it():
    """Half a Fabric conversion is worse than none: Fabric launched on 4 devices over a plain
    script would train 4 independent copies."""
    import libcst as _cst

    from accelerate_rewrite.rules import ALL_RULES
    from accelerate_rewrite.rules.fabric.device import FabricDevice

    class BrokenDevice(FabricDevice):
        def rewrite(self, ctx):
            super().rewrite(ctx)
            for site in ctx.facts.backward_sites:  # leaves a name undefined
                ctx.edits.replace(site.loss, _cst.Name("undefined_zzz"))

    rules = [BrokenDevice() if r.code == "AR105" else r for r in ALL_RULES]
    source = (
        "import torch\n\n"
        "model = torch.nn.Linear(4, 1)\n"
        "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "loss = model(torch.randn(2, 4)).sum()\n"
        "loss.backward()\n"
        "optimizer.step()\n"
    )
    result = rewrite(source, Options.create(devices=4), rules=rules)
    assert result.output == source
    assert any(d.startswith("AR105") and "undefined_zzz" in d for d in result.dropped)
    assert not result.notes


def test_a_rewrite_runs_the_garbage_collector_less_often_and_puts_its_thresholds_back():
    """engine.fewer_collections: the collector's thresholds are raised during a rewrite (never
    lowered: a caller's higher ones stay) and are what they were afterwards, even on an error."""
    import gc

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod import engine
    from accelerate_rewrite.options import Options

    before = gc.get_threshold()
    seen = []
    real = engine._rewrite

    def spy(*args, **kwargs):
        seen.append(gc.get_threshold())
        return real(*args, **kwargs)
    try:
        engine._rewrite = spy
        rewrite("import torch\n", Options.create())
        gc.set_threshold(1_000_000, 5, 5)
        rewrite("import torch\n", Options.create())
        assert gc.get_threshold() == (1_000_000, 5, 5)
        engine._rewrite = lambda *a, **k: 1 / 0
        with pytest.raises(ZeroDivisionError):
            rewrite("import torch\n", Options.create())
        assert gc.get_threshold() == (1_000_000, 5, 5)
    finally:
        engine._rewrite = real
        gc.set_threshold(*before)
    assert seen[0] == tuple(max(a, b) for a, b in zip(before, engine.GC_THRESHOLDS))
    assert seen[1] == (1_000_000, 50, 100)


def test_the_command_line_keeps_the_rewrite_thresholds_to_its_end():
    """cli.main, a process of its own: the collector's thresholds are the rewrite's from its
    start on (never lowered), so that a rewrite's end goes through no tree again."""
    import gc

    from accelerate_rewrite.cli import main
    from accelerate_rewrite.codemod import engine

    gc.set_threshold(700, 10, 200)
    with pytest.raises(SystemExit):
        main(["--version"])
    assert gc.get_threshold() == (engine.GC_THRESHOLDS[0], engine.GC_THRESHOLDS[1], 200)


#: a model and its criterion's own parameters trained by one optimizer, built again while the
#: training runs (awd-lstm-lm's shape), both made by a helper: the refusal names one of them
_JOINT_REBUILT = '''import torch
import torch.nn as nn


class Loss(nn.Module):
    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(1))

    def forward(self, out, y):
        return ((out - y) ** 2).mean() * self.scale


def make():
    return nn.Linear(4, 1), Loss()


model, criterion = make()
params = list(model.parameters()) + list(criterion.parameters())
optimizer = torch.optim.SGD(params, lr=0.1)


def train():
    x, y = torch.randn(8, 4), torch.randn(8, 1)
    loss = criterion(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()


for epoch in range(3):
    train()
    if epoch == 1:
        optimizer = torch.optim.ASGD(params, lr=0.1)
'''


def test_a_rewrite_does_not_depend_on_where_objects_lie_in_memory(tmp_path):
    """LibCST's scopes keep assignments and accesses in sets, and the plan keeps some keys in
    sets: in an order of memory addresses, which changes from one process to the next. The
    rewrite (its output, its notes) does not: the same in processes that allocate differently."""
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text(_JOINT_REBUILT, encoding="utf-8")
    probe = ("import sys, json\njunk = [object() for _ in range(int(sys.argv[2]))]\n"
             "from accelerate_rewrite.api import rewrite\nfrom accelerate_rewrite.options import Options\n"
             "r = rewrite(open(sys.argv[1]).read(), Options.create(), path=sys.argv[1])\n"
             "print(json.dumps([r.output, r.dropped, [n.message for n in r.notes]]))\n")
    seen = {subprocess.run([sys.executable, "-c", probe, str(script), str(n)], capture_output=True, text=True,
                           check=True).stdout for n in (0, 1000, 2000, 3000, 4000)}
    assert len(seen) == 1
    assert "trains `criterion` before it could be set up" in seen.pop()


def test_a_names_assignments_and_references_come_in_the_files_order():
    """``assignments`` and ``references`` (from LibCST's sets) in the order of the source."""
    import libcst as cst

    from accelerate_rewrite.codemod.analysis.facts import ScriptFacts

    source = "".join(f"x = {i}\nprint(x, x)\n" for i in range(12))
    facts = ScriptFacts(cst.parse_module(source), fresh=True)
    name = facts.module.body[0].body[0].targets[0].target
    lines = [facts.line(target) for target, _ in facts.assignments(name)]
    assert lines == sorted(lines) and len(lines) == 12
    reads = [(facts.line(n), facts.column(n)) for n in facts.references(facts.key_of(name))]
    assert reads == sorted(reads) and len(reads) == 24


def test_the_engine_imports_libcst_matchers_without_printing_their_signatures():
    """codemod/tree/startup.py: the engine's first import of libcst.matchers leaves the classes
    that have no docstring with their names as one (not ``inspect.signature`` printed: 50-130 ms
    of every start), gives ``dataclasses`` its ``inspect`` back, and the matchers match as ever."""
    for way_in in ("accelerate_rewrite.api", "accelerate_rewrite.rules"):  # the engine, the rule registry
        _matchers_imported_by(way_in)
    # the cache's answer imports neither (tests/test_cache.py): the engine's package does not either
    done = subprocess.run([sys.executable, "-c", "import sys, accelerate_rewrite.codemod.files.paths\n"
                           "assert 'libcst' not in sys.modules"], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr


def test_the_code_of_libcsts_dataclass_methods_is_compiled_once_and_kept_as_bytecode_is(tmp_path):
    """codemod/tree/startup.py: the first start compiles the methods dataclasses writes for
    LibCST's nodes and matchers, and libcst.matchers with its annotations unread, and keeps
    their code where Python keeps bytecode (PYTHONPYCACHEPREFIX); the next start compiles none of
    them and its classes are the same; a file it can't read is as none; under
    PYTHONDONTWRITEBYTECODE nothing is written."""
    probe = (
        "import dataclasses, json, sys\n"
        "import accelerate_rewrite.api\n"
        "import libcst as cst, libcst.matchers as m\n"
        "from accelerate_rewrite.codemod.tree import startup\n"
        "assert 'exec' not in vars(dataclasses)\n"
        "node = cst.Name('x')\n"
        "assert node == node and repr(cst.Name('x')).startswith('Name(') and m.matches(node, m.Name('x'))\n"
        "assert isinstance(m.Name.__annotations__['value'], str)  # the matchers' annotations unread\n"
        "assert not isinstance(cst.Name.__annotations__['value'], str)  # the nodes' as ever\n"
        "assert not any(type(f).__name__ == '_MatchersFinder' for f in sys.meta_path)\n"
        "try:\n"
        "    node.value = 'y'\n"
        "except dataclasses.FrozenInstanceError:\n"
        "    pass\n"
        "else:\n"
        "    raise AssertionError('not frozen')\n"
        "print(json.dumps([startup.compiled_here, startup.CACHE]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONDONTWRITEBYTECODE"}
    env["PYTHONPYCACHEPREFIX"] = str(tmp_path / "pycache")

    def start(**more) -> tuple[int, str]:
        done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, env={**env, **more})
        assert done.returncode == 0, done.stderr
        return tuple(json.loads(done.stdout))

    first, cache = start()
    assert first > 500 and cache.startswith(str(tmp_path / "pycache")) and os.path.exists(cache)
    assert start() == (0, cache)  # every method's code read back: nothing compiled
    with open(cache, "wb") as file:
        file.write(b"not this Python's")
    assert start()[0] == first  # as none, and written again
    assert start()[0] == 0
    os.unlink(cache)
    assert start(PYTHONDONTWRITEBYTECODE="1")[0] == first and not os.path.exists(cache)


def _matchers_imported_by(way_in: str) -> None:
    probe = (
        "import dataclasses, inspect\n"
        f"import {way_in}\n"
        "import libcst as cst, libcst.matchers as m\n"
        "assert dataclasses.inspect is inspect and 'exec' not in vars(dataclasses)\n"
        "assert m.Name.__doc__ == 'Name' and m.Call.__doc__ == 'Call', (m.Name.__doc__, m.Call.__doc__)\n"
        "assert cst.Name.__doc__.strip().startswith('A simple variable name')\n"
        "call = cst.parse_expression('torch.cuda.amp.autocast(enabled=True)')\n"
        "assert m.matches(call, m.Call(func=m.Attribute(attr=m.Name('autocast')), args=[m.Arg(keyword=m.Name('enabled'))]))\n"
        "assert not m.matches(call, m.Call(func=m.Name('autocast')))\n"
        "@dataclasses.dataclass\n"
        "class Later:\n"
        "    x: int = 1\n"
        "assert Later.__doc__ == 'Later(x: int = 1)'\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
