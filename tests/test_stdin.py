"""``accelerate-rewrite -``: the source on stdin, the result (or the diff) on stdout, the
summary on stderr; ``--stdin-filename`` names it for the configuration, as black and ruff do."""

from __future__ import annotations

from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES

SOURCE = (FIXTURES / "module_loop" / "input.py").read_text()
CLEAN_ENV = {"NO_COLOR": "1", "FORCE_COLOR": None, "TERM": "dumb"}


def _run(*args, data: str = SOURCE):
    return CliRunner(env=CLEAN_ENV).invoke(cli, list(args), input=data, catch_exceptions=False)


def test_the_result_goes_to_stdout_and_the_summary_to_stderr():
    result = _run("-", "--precision", "bf16-mixed")
    assert result.exit_code == 0
    assert result.stdout == rewrite(SOURCE, Options.create(precision="bf16-mixed")).output
    assert "-: rewritten" in result.stderr and "AR101" in result.stderr


def test_check_and_diff():
    check = _run("-", "--check")
    assert check.exit_code == 1 and check.stdout == ""
    diff = _run("-", "--check", "--diff")
    assert diff.exit_code == 1 and diff.stdout.startswith("--- -\n+++ -\n")
    same = _run("-", "--check", data="x = 1\n")
    assert same.exit_code == 0 and same.stdout == ""
    echoed = _run("-", data="x = 1\n")
    assert echoed.exit_code == 0 and echoed.stdout == "x = 1\n"


def test_the_stdin_filename_picks_the_configuration_and_names_the_messages(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "pyproject.toml").write_text(
        '[tool.accelerate-rewrite]\nbackend = "torch"\nselect = ["AR201"]\nexclude = ["generated/*"]\n')
    source = "import torch\nwith torch.cuda.amp.autocast():\n    pass\n"
    named = _run("-", "--stdin-filename", "scripts/train.py", data=source)
    assert named.stdout == 'import torch\nwith torch.amp.autocast("cuda"):\n    pass\n'
    assert "scripts/train.py: rewritten" in named.stderr
    excluded = _run("-", "--stdin-filename", "generated/train.py", data=source)
    assert excluded.exit_code == 0 and excluded.stdout == source
    broken = _run("-", "--stdin-filename", "scripts/train.py", data="x = (\n")
    assert broken.exit_code == 2 and "scripts/train.py:1" in broken.stderr and broken.stdout == ""


def test_what_stdin_cannot_be_combined_with():
    for args in (["-", "--write"], ["-", "-o", "out.py"], ["-", "other.py"], ["-", "--format", "json"]):
        assert _run(*args).exit_code == 2, args
    assert _run(str(FIXTURES / "module_loop" / "input.py"), "--stdin-filename", "x.py").exit_code == 2
