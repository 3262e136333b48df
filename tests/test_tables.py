"""Issue 49: every table readable at any width, and piped: tune's, verify's, the summary's and
`rules`' keep each row's first cell (a candidate's options, a file, a rule) on one line at 60
and 80 columns and when not a terminal; where the table does not fit, its rows are plain lines
(accelerate_rewrite/report.py: ``fits``, ``rows``)."""

from __future__ import annotations

import io
from pathlib import Path

import pytest
from click.testing import CliRunner
from rich.console import Console

from accelerate_rewrite.cli import cli
from tests.goldens import FIXTURES

#: (width, a terminal?)
OUTPUTS = [(60, True), (80, True), (60, False), (80, False)]


def _console(width: int, terminal: bool) -> Console:
    return Console(file=io.StringIO(), width=width, force_terminal=terminal, color_system=None)


def _lines(console: Console) -> list[str]:
    return console.file.getvalue().splitlines()


@pytest.mark.parametrize("width, terminal", OUTPUTS)
def test_tune_keeps_each_candidate_s_options_on_one_line(width, terminal):
    from accelerate_rewrite.verify import tune
    from tests.test_tune import _result, _verification

    label = "--backend accelerate --precision bf16-mixed --compile"
    outcomes = [tune.Outcome(tune.Candidate.parse(label), [_verification("pass", 0.05)]),
                tune.Outcome(tune.Candidate.parse("--precision 16-mixed"), [_verification("fail", 0.2)])]
    console = _console(width, terminal)
    tune.render(console, _result(outcomes))
    lines = _lines(console)
    assert any(label in line for line in lines), "\n".join(lines)
    assert any("--precision 16-mixed" in line for line in lines)
    assert max(len(line) for line in lines if "Recommended" not in line) <= max(width, 80 if not terminal else width)


@pytest.mark.parametrize("width, terminal", OUTPUTS)
def test_verify_keeps_each_row_s_label_on_one_line(width, terminal):
    from accelerate_rewrite.options import Options
    from accelerate_rewrite.verify.compare import EXACT, Tolerance, compare
    from accelerate_rewrite.verify.report import render
    from accelerate_rewrite.verify.session import Verification
    from tests.test_verify_verdicts import _run

    original = _run()
    verdict = compare(original, _run("rewritten"), Tolerance(kind=EXACT))
    console = _console(width, terminal)
    render(console, Verification(Path("train.py"), Options.create(), verdict, original, _run("rewritten")))
    text = console.file.getvalue()
    for label in ("loss difference (relative)", "gradient norm difference", "speedup (median step)"):
        assert label in text, text


@pytest.mark.parametrize("width", [60, 80])
def test_rules_keep_each_rule_on_one_line(width):
    from accelerate_rewrite.rules import ALL_RULES

    done = CliRunner().invoke(cli, ["rules"], env={"COLUMNS": str(width)})
    assert done.exit_code == 0
    lines = done.output.splitlines()
    for rule in ALL_RULES:
        assert any(line.startswith(rule.code) and rule.name in line for line in lines), rule.code


@pytest.mark.parametrize("width", [60, 80])
def test_the_summary_keeps_each_file_on_one_line(tmp_path, width):
    names = ["a_rather_long_script_name_for_training_models.py", "another_quite_long_training_script_name.py"]
    for name, fixture in zip(names, ("module_loop", "gan")):
        (tmp_path / name).write_text((FIXTURES / fixture / "input.py").read_text(encoding="utf-8"), encoding="utf-8")
    done = CliRunner().invoke(cli, [str(tmp_path), "--no-cache"], env={"COLUMNS": str(width)})
    assert done.exit_code == 0, done.output
    lines = done.output.splitlines()
    for name in names:
        assert any(line.strip().endswith(name) and str(tmp_path) in line for line in lines), done.output
