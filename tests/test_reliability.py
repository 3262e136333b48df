"""Issue 18: never lose a byte, never change twice. The reproducers of the reliability run
(LibCST's round-trip losses, a long flat file, apex blocks under --accumulate, temporary files
left by kill -9), the byte-preservation check and idempotence as an engine property."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import libcst as cst
import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.codemod import engine as engine_module
from accelerate_rewrite.codemod import reading as reading_module
from accelerate_rewrite.codemod.edits import preserve
from accelerate_rewrite.api import RewriteError, rewrite
from accelerate_rewrite.codemod.rule import Rule, RuleContext
from accelerate_rewrite.codemod.files.source import write_atomic
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
LOOP = (FIXTURES / "module_loop" / "input.py").read_text()
APEX = (FIXTURES / "apex_o1" / "input.py").read_text()
TORCH16 = Options.create(backend="torch", precision="16-mixed")


def _twice(source: str, options: Options) -> str:
    """The result, after checking that a second run leaves it as it is."""
    result = rewrite(source, options)
    assert result.changed and not result.dropped, result.dropped
    compile(result.output, "<rewritten>", "exec")
    assert rewrite(result.output, options).output == result.output, "a second run changes it"
    return result.output


# ---- 1-3: what LibCST does not round-trip is put back ------------------------------------------

def test_libcst_itself_drops_these_bytes():
    """The reason for codemod/edits/preserve.py: if LibCST learns to keep them, the work-around can go."""
    assert cst.parse_module("s\n #\n ").code == "s\n "
    assert cst.parse_module("x = 1\r\r\r").code == "x = 1\r\r"


@pytest.mark.parametrize("tail", [
    pytest.param("s = 1\n    # keep me\n  ", id="1-comment-before-trailing-whitespace"),
    pytest.param("s = 1\n\n \n", id="2-blank-line-before-a-whitespace-line"),
])
def test_trailing_comments_and_blank_lines_are_kept(tail):
    out = _twice(LOOP + tail, TORCH16)
    assert out.endswith(tail)
    assert "torch.autocast" in out


def test_cr_only_line_endings_with_trailing_blank_lines_are_idempotent():
    source = LOOP.replace("\n", "\r") + "\r\r"
    first = _twice(source, TORCH16)
    assert first.endswith("\r\r\r") and "\n" not in first


def test_the_cli_writes_a_cr_only_file_once(tmp_path):
    path = tmp_path / "train.py"
    path.write_bytes((LOOP.replace("\n", "\r") + "\r\r").encode())
    runner = CliRunner()
    sizes = []
    for _ in range(3):
        done = runner.invoke(cli, [str(path), "--write", "--backend", "torch", "--precision", "16-mixed"])
        assert done.exit_code == 0, done.output
        sizes.append(len(path.read_bytes()))
    assert sizes[1] == sizes[2] == sizes[0], sizes


# ---- 4: what CPython reads and LibCST can't ------------------------------------------------------

@pytest.mark.parametrize("tail", ["\\\r\n", "x = 1 \\\r\n"], ids=["lone-backslash", "after-code"])
def test_a_file_ending_in_a_line_continuation(tail):
    source = LOOP + tail
    compile(source, "<input>", "exec")  # CPython accepts it
    assert _twice(source, TORCH16).endswith(tail)


def test_what_libcst_cant_read_is_not_called_a_syntax_error(monkeypatch):
    def refuse(source, folder=None):
        raise cst.ParserSyntaxError("tokenizer error: something", lines=[""], raw_line=1, raw_column=0)

    monkeypatch.setattr(reading_module, "_analyse", refuse)
    with pytest.raises(RewriteError) as exc:
        rewrite("x = 1\n", Options.create())
    assert "syntax error" not in str(exc.value)
    assert "valid Python that LibCST's parser can't read" in str(exc.value)


# ---- 5: apex blocks: refusals that are true, and no half conversion on a second run ------------

def _apex_with(extra: str) -> str:
    return APEX.replace("                scaled_loss.backward()\n",
                        f"                scaled_loss.backward()\n                {extra}\n")


@pytest.mark.parametrize("options", [
    {"accumulate": 4}, {"accumulate": 4, "backend": "torch"},
    {"backend": "torch", "precision": "16-mixed", "accumulate": 4, "freeze": ("0",)},
], ids=["fabric", "torch", "torch-16-mixed-freeze"])
def test_a_scale_loss_block_with_a_pass_is_converted_once(options):
    out = _twice(_apex_with("pass"), Options.create(**options))
    code = out.split("def main")[1]
    assert "amp.scale_loss" not in code and "from apex" not in out and "amp.initialize" not in code


def test_a_scale_loss_block_that_does_more_says_so_and_a_second_run_changes_nothing(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(_apex_with("print('scaled')"))
    runner = CliRunner()
    first = runner.invoke(cli, [str(path), "--write", "--accumulate", "4"])
    assert first.exit_code == 0, first.output
    assert "does more than its backward (`print('scaled')`)" in first.output
    assert "more than one backward" not in first.output
    once = path.read_text()
    second = runner.invoke(cli, [str(path), "--write", "--accumulate", "4"])
    assert second.exit_code == 0, second.output
    assert path.read_text() == once  # not half converted: apex stays whole, and so does the rest
    assert "(scaled_loss / min(4, len(" in once and "convert by hand" in second.output


# ---- 6: a long flat file ------------------------------------------------------------------------

def test_a_long_flat_file_gets_its_import_without_a_recursion_error():
    body = "".join(f"value_{i} = {i}\n" for i in range(1000))
    source = LOOP.replace("import torch\n", "import torch\n" + body, 1)
    out = _twice(source.replace("import torch\n", "from torch import nn\nimport torch.optim\n", 1),
                 Options.create())
    assert "from lightning.fabric import Fabric" in out


def test_a_new_import_goes_below_every_import_of_the_leading_block():
    source = LOOP.replace("import torch\n", "try:\n    import comet_ml  # must be imported before torch\n"
                                            "except ImportError:\n    comet_ml = None\nimport torch\n", 1)
    out = rewrite(source, Options.create()).output
    assert out.index("import comet_ml") < out.index("from lightning.fabric import Fabric")
    assert out.count("import torch\n") == 1


# ---- 7: unchanged is byte-identical; the byte-preservation check -------------------------------

def test_a_file_no_rule_changes_comes_back_as_it_was():
    source = "try:\n    pass\nexcept ValueError :\n    pass\n"
    assert cst.parse_module(source).code != source  # LibCST prints it otherwise
    assert rewrite(source, TORCH16).output == source


def test_lines_libcst_reprints_stay_as_they_were_outside_the_edits():
    source = LOOP + "try:\n    pass\nexcept ValueError :\n    pass\n"
    assert "except ValueError :\n" in _twice(source, TORCH16)


def test_the_byte_preservation_check_drops_a_rule_that_would_lose_a_comment(monkeypatch):
    """Without the work-around, LibCST's loss is caught: the culprit is dropped, and the message
    says what would have been lost."""
    monkeypatch.setattr(engine_module, "restore", lambda source, roundtrip, output: output)
    source = "import torch\nx = torch.ones(1)\nx = x.half()\nprint(x)\n    # keep me\n  "
    result = rewrite(source, Options.create(backend="torch", precision="16-mixed"), rules=[CastDrop()])
    assert result.output == source
    assert result.dropped and "it would lose the comment `# keep me` (line 5)" in result.dropped[0]


class CastDrop(Rule):
    """Test rule: ``x = x.half()`` goes."""

    code = "T901"
    name = "cast-drop"

    def rewrite(self, ctx: RuleContext) -> None:
        stmt = ctx.facts.module.body[2]
        ctx.edits.remove(stmt)
        ctx.change(stmt, "removed")


def test_comments_inside_the_edited_statements_may_go_but_not_around_them():
    source = "import torch\n# about x\nx = torch.ones(1)\n\n# a cast\nx = x.half()  # half\n\n# print it\nprint(x)\n"
    result = rewrite(source, Options.create(), rules=[CastDrop()])
    assert not result.dropped
    assert "# about x" in result.output and "# print it" in result.output and "# half" not in result.output
    regions = [(5, 7)]
    assert preserve.lost_trivia(source, result.output, regions) is None
    assert preserve.lost_trivia(source, result.output.replace("# print it\n", ""), regions) == \
        "it would lose the comment `# print it` (line 8)"


#: texts whose strings and comments preserve.trivia's scan must tell apart as tokenize does
TRIVIA_TEXTS = [
    "x = 1  # one\n\n# two\ny = '# no'\n",
    'doc = """\n# in a string\n\n  \n"""  # after\n\nz = 2\n',
    "s = '''a\n\nb''' ; t = \"\"\"\"\"\"\n\n",
    "u = 'it\\'s # no' + \"q\\\" # no\"  # yes\n",
    "v = 'one \\\n# still in it'\nw = 1\n",
    "f(a,\n\n  # inside brackets\n  b)\n",
    "g = rb'\\d#' + f\"{x['#']}\"\n  \n",
    "e = '\"\"\"'  # a quote in quotes\n'''a \"\"\" b'''\n",
    "h = 1",
    "h = 1  # no line break",
    "# only a comment",
    "h = 1\n   ",
    "h = 1\n\n",
    "",
]
#: texts the scan leaves to tokenize: a line continued by a backslash, a form feed
TRIVIA_UNSURE = ["x = 1 + \\\n    2  # continued\n", "a = 1\n\x0c\nb = 2\n"]


@pytest.mark.parametrize("text", TRIVIA_TEXTS + TRIVIA_UNSURE)
def test_trivia_scan_finds_what_tokenize_finds(text):
    compile(text, "<text>", "exec", dont_inherit=True)  # only what Python reads comes here
    normal = preserve._normalised(text)
    scanned = preserve._scanned(normal)
    if text in TRIVIA_UNSURE:
        assert scanned is None
    else:
        comments, blank = scanned
        assert tuple(sorted(comments + [(line, "") for line in blank])) == preserve._tokenized(normal)
    assert preserve.trivia(text) == preserve._tokenized(normal)


def test_restore_is_a_three_way_merge_by_lines():
    source = "a = 1\nb = 2 ;\nc = 3\n"
    roundtrip = "a = 1\nb = 2;\nc = 3\n"
    assert preserve.restore(source, roundtrip, "a = 10\nb = 2;\nc = 3\n") == "a = 10\nb = 2 ;\nc = 3\n"
    assert preserve.restore(source, roundtrip, "a = 1\nb = 20;\nc = 3\n") == "a = 1\nb = 20;\nc = 3\n"


# ---- idempotence as an engine property -----------------------------------------------------------

class AppendLine(Rule):
    """Test rule: adds a statement every time it runs."""

    code = "T902"
    name = "append-line"

    def rewrite(self, ctx: RuleContext) -> None:
        last = ctx.facts.module.body[-1]
        ctx.edits.insert_after(last, cst.parse_statement("y = 2\n"))
        ctx.change(last, "appended")


def test_the_engine_checks_its_own_idempotence_in_test_mode(monkeypatch):
    with pytest.raises(AssertionError, match="a second run changes the result"):
        rewrite("x = 1\n", Options.create(), rules=[AppendLine()], check_idempotence=True)
    monkeypatch.setenv(engine_module.IDEMPOTENCE_ENV, "1")
    with pytest.raises(AssertionError):
        rewrite("x = 1\n", Options.create(), rules=[AppendLine()])
    monkeypatch.delenv(engine_module.IDEMPOTENCE_ENV)
    assert rewrite("x = 1\n", Options.create(), rules=[AppendLine()]).output == "x = 1\ny = 2\n"


@pytest.mark.parametrize("fixture", ["apex_o2_two_losses", "cuda_amp"])
@pytest.mark.parametrize("options", [
    {"accumulate": 4}, {"freeze": ("0",)}, {"backend": "torch", "precision": "16-mixed", "accumulate": 3},
    {"backend": "torch", "freeze": ("0",), "accumulate": 2, "clip_grad_norm": 1.0},
], ids=["accumulate", "freeze", "torch-16-mixed-accumulate", "torch-freeze-accumulate-clip"])
def test_apex_and_amp_scripts_are_idempotent_under_accumulate_and_freeze(fixture, options):
    source = (FIXTURES / fixture / "input.py").read_text()
    rewrite(source, Options.create(**options), check_idempotence=True)


# ---- 8: temporary files left by kill -9 --------------------------------------------------------

def _dead_pid() -> int:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    return child.pid


def test_a_write_killed_before_its_rename_leaves_a_temp_file_the_next_write_removes(tmp_path):
    path = tmp_path / "train.py"
    path.write_text(LOOP)
    stuck = (
        "import os, sys, time\n"
        "from pathlib import Path\n"
        "from accelerate_rewrite.codemod.files import source\n"
        "os.replace = lambda *args: time.sleep(120)  # killed between the write and the rename\n"
        f"source.write_atomic(Path({str(path)!r}), b'x = 1\\n')\n"
    )
    writer = subprocess.Popen([sys.executable, "-c", stuck], cwd=ROOT)
    try:
        deadline = time.monotonic() + 60
        while not list(tmp_path.glob(".train.py.accelerate-rewrite-*.tmp")) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = list(tmp_path.glob(".train.py.accelerate-rewrite-*.tmp"))
        assert len(left) == 1 and f"-{writer.pid}-" in left[0].name
    finally:
        os.kill(writer.pid, signal.SIGKILL)
        writer.wait()
    assert path.read_text() == LOOP  # the file itself was never touched
    stale_of_other = tmp_path / f".other.py.accelerate-rewrite-{_dead_pid()}-abcdefgh.tmp"
    stale_of_other.write_text("")
    live = tmp_path / f".train.py.accelerate-rewrite-{os.getpid()}-abcdefgh.tmp"  # a live writer's
    live.write_text("")
    done = CliRunner().invoke(cli, [str(path), "--write"])
    assert done.exit_code == 0, done.output
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["train.py", stale_of_other.name, live.name])
    assert "fabric.backward" in path.read_text()


def test_temp_files_of_other_names_are_never_touched(tmp_path):
    target = tmp_path / "a.py"
    target.write_text("x = 1\n")
    dead = _dead_pid()
    mine = tmp_path / f".a.py.accelerate-rewrite-{dead}-abc_1234.tmp"
    lookalikes = [tmp_path / ".a.py.12345.tmp", tmp_path / f".ab.py.accelerate-rewrite-{dead}-x.tmp",
                  tmp_path / f".a.py.accelerate-rewrite-{dead}-x.tmp.bak"]
    for p in [mine, *lookalikes]:
        p.write_text("")
    write_atomic(target, b"x = 2\n")
    assert target.read_bytes() == b"x = 2\n"
    assert not mine.exists() and all(p.exists() for p in lookalikes)


# ---- a few fuzz programs (benchmarks/fuzz.py; docs/reliability.md has the long runs) -------------

def test_a_few_fuzz_programs_break_nothing(monkeypatch):
    import importlib.util

    pytest.importorskip("hypothesmith")
    spec = importlib.util.spec_from_file_location("accelerate_rewrite_fuzz", ROOT / "benchmarks" / "fuzz.py")
    fuzz = importlib.util.module_from_spec(spec)
    monkeypatch.setitem(sys.modules, spec.name, fuzz)  # its dataclasses look their module up
    spec.loader.exec_module(fuzz)
    tally, _ = fuzz.run(4, seed=18, mutated_share=0.5, time_limit=None, progress=False)
    assert tally.counts["programs"] == 4
    assert {k: tally.counts[k] for k in fuzz.FAILURES} == dict.fromkeys(fuzz.FAILURES, 0), \
        {k: v[:1] for k, v in tally.examples.items()}
