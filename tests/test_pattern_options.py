"""Every pattern option is checked before any file is read: ``--freeze``, ``--checkpointing``, the
configuration's ``exclude`` globs and its overrides' ``paths``; a bad one is one line of error
that names it (and, from a configuration, the file), and nothing is written."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.options import OptionError, normalize_glob

SCRIPT = "import torch\nmodel = torch.nn.Linear(2, 1)\nprint(model)\n"


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "a.py").write_text(SCRIPT)
    runner = CliRunner(env={"NO_COLOR": "1"})
    return lambda *args: runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)


def _errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error: ")]


@pytest.mark.parametrize("args,says", [
    (["--freeze", "["], "invalid freeze pattern '['"),
    (["--freeze", "encoder.[01.*"], "invalid freeze pattern 'encoder.[01.*'"),
    (["--checkpointing", "["], "invalid checkpointing target '['"),
    (["--checkpointing", "Block*"], "invalid checkpointing target 'Block*'"),
    (["--checkpointing", ""], "invalid checkpointing target ''"),
])
def test_a_bad_pattern_flag_is_one_line_before_any_file_is_read(run, tmp_path, args, says):
    result = run("a.py", "--write", *args)
    assert result.exit_code == 2
    assert _errors(result) == [next(line for line in result.stderr.splitlines() if says in line)]
    assert (tmp_path / "a.py").read_text() == SCRIPT
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("toml,says", [
    ('exclude = ["[abc"]', "[tool.accelerate-rewrite]: invalid exclude glob '[abc'"),
    ('exclude = ["vendor/*", ""]', "[tool.accelerate-rewrite]: invalid exclude glob ''"),
    ('exclude = "a[!]x"', "invalid exclude glob 'a[!]x'"),
    ('freeze = ["["]', "[tool.accelerate-rewrite]: invalid freeze pattern '['"),
    ('checkpointing = "a b"', "[tool.accelerate-rewrite]: invalid checkpointing target 'a b'"),
    ('[[tool.accelerate-rewrite.overrides]]\npaths = ["legacy/[ab.py"]\nprecision = "bf16"',
     "[[tool.accelerate-rewrite.overrides]] #1: invalid paths glob 'legacy/[ab.py'"),
    ('[[tool.accelerate-rewrite.overrides]]\npaths = ["legacy/*"]\nfreeze = "x.["',
     "[[tool.accelerate-rewrite.overrides]] #1: invalid freeze pattern 'x.['"),
])
def test_a_bad_pattern_in_the_configuration_is_one_line_naming_the_file(run, tmp_path, toml, says):
    (tmp_path / "b.py").write_text(SCRIPT)
    (tmp_path / "pyproject.toml").write_text(f"[tool.accelerate-rewrite]\n{toml}\n")
    result = run(".", "--write")
    assert result.exit_code == 2
    errors = _errors(result)
    assert len(errors) == 1, result.stderr  # said once, not once per file it governs
    assert "pyproject.toml: " in errors[0] and says in errors[0]
    assert (tmp_path / "a.py").read_text() == SCRIPT == (tmp_path / "b.py").read_text()


@pytest.mark.parametrize("glob", ["vendor/*", "notebooks/scratch/*", "data/[ab]*.py", "a[]]b", "x[!a]",
                                  "literal]bracket", "**/*.py"])
def test_good_globs_pass(glob):
    assert normalize_glob(glob, "exclude") == glob


@pytest.mark.parametrize("glob", ["", "  ", "[", "a[b", "a[!]b", "a[]b", "ok/*/[x"])
def test_bad_globs_are_refused(glob):
    with pytest.raises(OptionError, match="invalid exclude glob"):
        normalize_glob(glob, "exclude")


def test_a_good_exclude_still_excludes(run, tmp_path):
    (tmp_path / "vendor").mkdir()
    (tmp_path / "vendor" / "[v].py").write_text(SCRIPT)
    (tmp_path / "pyproject.toml").write_text('[tool.accelerate-rewrite]\nexclude = ["vendor/[[]v].py"]\n')
    result = run("vendor/[v].py", "--format", "json")
    assert result.exit_code == 0, result.stderr
    assert json.loads(result.stdout)["status"] == "excluded by the configuration"
