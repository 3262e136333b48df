"""Issue 6: [tool.accelerate-rewrite] configuration, --select/--ignore, suppression comments,
--format json, many files in parallel, and the pre-commit hook run by the real pre-commit."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.codemod.suppress import protected_lines
from accelerate_rewrite.config import ConfigError, choose, fixes, load, select_rules
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES

ROOT = Path(__file__).resolve().parent.parent
CUDA_AMP = FIXTURES / "cuda_amp" / "input.py"  # deprecated torch.cuda.amp, scaler in the loop, clip
CLEAN_ENV = {"FORCE_COLOR": None, "NO_COLOR": None, "TTY_COMPATIBLE": None, "TTY_INTERACTIVE": None}


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env=CLEAN_ENV)

    def invoke(*args):
        return runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)

    return invoke


def _project(tmp_path: Path, config: str, files: dict[str, Path]) -> Path:
    (tmp_path / "pyproject.toml").write_text(textwrap.dedent(config))
    for name, source in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, tmp_path / name)
    load.cache_clear()
    return tmp_path


def _rules(record: dict) -> set[str]:
    return set(record["rules"])


# ---- configuration -------------------------------------------------------------------------------

def test_the_config_sets_the_options_and_the_rules_and_flags_win(run, tmp_path):
    _project(tmp_path, """\
        [tool.accelerate-rewrite]
        backend = "torch"
        precision = "bf16-mixed"
        ignore = ["AR201"]
        """, {"scripts/train.py": FIXTURES / "module_loop" / "input.py", "amp.py": CUDA_AMP})
    records = [json.loads(line) for line in run(".", "--format", "json").stdout.splitlines()]
    by_path = {r["path"]: r for r in records}
    assert _rules(by_path["scripts/train.py"]) == {"AR207"}  # torch backend, bf16 autocast
    assert "AR201" not in _rules(by_path["amp.py"])
    flags = json.loads(run("scripts/train.py", "--format", "json", "--backend", "fabric").stdout)
    assert "AR101" in _rules(flags)  # the flag wins over the config


def test_overrides_and_exclude_by_path(run, tmp_path):
    _project(tmp_path, """\
        [tool.accelerate-rewrite]
        select = ["fixes"]
        exclude = ["vendor/*"]

        [[tool.accelerate-rewrite.overrides]]
        paths = ["legacy/*.py"]
        select = ["AR201"]
        """, {"a.py": CUDA_AMP, "legacy/b.py": CUDA_AMP, "vendor/c.py": CUDA_AMP})
    records = {r["path"]: r for r in map(json.loads, run(".", "--format", "json").stdout.splitlines())}
    assert _rules(records["a.py"]) == {"AR201", "AR202", "AR203"}
    assert _rules(records["legacy/b.py"]) == {"AR201"}
    assert records["vendor/c.py"]["status"] == "excluded by the configuration"
    assert not records["vendor/c.py"]["changed"]


def test_the_closest_configured_pyproject_applies(tmp_path):
    _project(tmp_path, '[tool.accelerate-rewrite]\nbackend = "torch"\n', {"sub/x.py": CUDA_AMP})
    (tmp_path / "sub" / "pyproject.toml").write_text('[project]\nname = "no-table-here"\n')
    assert choose(tmp_path / "sub" / "x.py", {}).options.backend == "torch"
    assert choose(tmp_path / "sub" / "x.py", {}, isolated=True).options.backend == "fabric"


@pytest.mark.parametrize("config,message", [
    ('precison = "bf16-mixed"', "unknown key 'precison'; valid keys: precision, devices"),
    ('precision = "fp8"', "invalid precision 'fp8'"),
    ('select = ["AR999"]', "select: unknown rule 'AR999'"),
    ('ignore = "nothing-like-this"', "ignore: unknown rule 'nothing-like-this'"),
    ("[[tool.accelerate-rewrite.overrides]]\nselect = ['AR201']", "needs paths ="),
    ("[[tool.accelerate-rewrite.overrides]]\npaths = ['x']\nexclude = ['y']", "unknown key 'exclude'"),
])
def test_a_bad_config_is_a_clear_error_naming_the_file_and_key(run, tmp_path, config, message):
    _project(tmp_path, "[tool.accelerate-rewrite]\n" + config + "\n", {"train.py": CUDA_AMP})
    result = run("train.py")
    assert result.exit_code == 2
    assert "pyproject.toml" in result.stderr and message in result.stderr, result.stderr
    with pytest.raises(ConfigError, match="pyproject.toml"):
        load(tmp_path / "pyproject.toml")


def test_select_and_ignore_on_the_command_line(run, tmp_path):
    shutil.copyfile(CUDA_AMP, tmp_path / "amp.py")
    record = json.loads(run("amp.py", "--format", "json", "--select", "AR2", "--ignore", "amp-scaler-once").stdout)
    assert _rules(record) == {"AR201", "AR202"}
    record = json.loads(run("amp.py", "--format", "json", "--select", "AR201,AR202").stdout)
    assert _rules(record) == {"AR201", "AR202"}
    bad = run("amp.py", "--select", "AR9")
    assert bad.exit_code == 2 and "--select: unknown rule 'AR9'" in bad.stderr


def test_selecting_the_fabric_rules_converts_a_script_without_apex(run, tmp_path):
    """``--select AR1``: AR101-AR110 rely on AR211 (apex), which has nothing to do in a script
    without apex, so the conversion goes ahead; in a script with apex the message names AR211
    and how to select it."""
    shutil.copyfile(FIXTURES / "module_loop" / "input.py", tmp_path / "plain.py")
    record = json.loads(run("plain.py", "--format", "json", "--select", "AR1").stdout)
    assert {"AR101", "AR103", "AR106"} <= _rules(record) and not record["dropped"]
    shutil.copyfile(FIXTURES / "apex_o1" / "input.py", tmp_path / "apex_script.py")
    record = json.loads(run("apex_script.py", "--format", "json", "--select", "AR1").stdout)
    assert not _rules(record)
    assert any("it relies on AR211 (apex-amp-migration), which the selection leaves out" in d
               and "--select ...,AR211" in d for d in record["dropped"])


def test_any_toml_form_of_the_table_and_one_error_per_bad_config(run, tmp_path):
    """The table is found by reading the TOML (tomllib), not by searching its text: an inline
    table applies; a bad one is said once, not once per file it governs; a non-table is an
    error."""
    (tmp_path / "sub").mkdir()
    for name in ("a.py", "b.py"):
        shutil.copyfile(CUDA_AMP, tmp_path / "sub" / name)
    pyproject = tmp_path / "pyproject.toml"
    pyproject.write_text('[tool]\n"accelerate-rewrite" = {select = ["AR201"], backend = "torch"}\n')
    record = json.loads(run("sub/a.py", "--format", "json").stdout)
    assert _rules(record) == {"AR201"}
    load.cache_clear()
    pyproject.write_text('[tool]\n"accelerate-rewrite" = {select = ["AR999"]}\n')
    bad = run("sub")
    assert bad.exit_code == 2
    assert [line for line in bad.stderr.splitlines() if line.startswith("error: ")] == [
        f"error: {pyproject}: [tool.accelerate-rewrite]: select: unknown rule 'AR999': give a code "
        "(AR201), a code prefix (AR2), a name (amp-api-migration), 'fixes' or 'ALL' "
        "(`accelerate-rewrite rules` lists them)"]
    load.cache_clear()
    pyproject.write_text("[tool]\naccelerate-rewrite = 3\n")
    assert "[tool.accelerate-rewrite] must be a table" in run("sub").stderr


def test_the_fixes_selector():
    assert select_rules(["fixes"]) == {"AR201", "AR202", "AR203", "AR211"}
    assert fixes(Options.create(backend="torch")) == {"AR201", "AR202", "AR203", "AR207", "AR208", "AR211"}
    # with Fabric, apex's migration would bring the whole conversion: it is not a fix there
    assert fixes(Options.create()) == {"AR201", "AR202", "AR203"}


# ---- suppression comments -------------------------------------------------------------------------

SCRIPT = """\
import torch

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
scaler = torch.cuda.amp.GradScaler(){mark1}
for x in [torch.randn(2, 4)]:
{mark2}    with torch.cuda.amp.autocast():
        loss = model(x).sum()
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
"""


def _suppressed(mark1: str = "", mark2: str = "", **options):
    source = SCRIPT.format(mark1=mark1, mark2=mark2)
    return rewrite(source, Options.create(backend="torch", **options))


def test_an_ignore_comment_leaves_its_line_and_drops_the_rule_that_would_change_it():
    plain = _suppressed()
    assert "torch.amp.GradScaler" in plain.output
    marked = _suppressed(mark1="  # accelerate-rewrite: ignore")
    assert "scaler = torch.cuda.amp.GradScaler()  # accelerate-rewrite: ignore" in marked.output
    assert "torch.cuda.amp.autocast()" in marked.output  # the rule is not applied to the file at all
    assert any("AR201" in d and "line 5" in d for d in marked.dropped)


def test_an_ignore_comment_with_codes_and_on_its_own_line():
    other = _suppressed(mark1="  # accelerate-rewrite: ignore[AR105]")
    assert "torch.amp.GradScaler" in other.output  # AR201 is not named: applied
    above = _suppressed(mark2="    # accelerate-rewrite: ignore[AR201]\n")
    assert "    with torch.cuda.amp.autocast():" in above.output and not above.changed


def test_protected_lines_cover_the_whole_statement():
    source = "x = f(\n    1,\n)  # accelerate-rewrite: ignore[AR201, AR105]\ny = 2\n"
    protected = protected_lines(source)
    assert set(protected) == {1, 2, 3}
    assert protected[1][0] == frozenset({"AR201", "AR105"})


def test_skip_file():
    source = "# accelerate-rewrite: skip-file\n" + SCRIPT.format(mark1="", mark2="")
    result = rewrite(source, Options.create(backend="torch"))
    assert not result.changed
    assert result.skips[0].rule == "file" and "skip-file" in result.skips[0].message


# ---- many files -------------------------------------------------------------------------------

def test_many_files_in_parallel_give_what_one_at_a_time_gives(run, tmp_path):
    # eight styles (a module-level loop, functions, a trainer class, a GAN, LBFGS, apex, amp, Fabric)
    names = ["module_loop", "train_function", "trainer_class", "gan", "lbfgs", "apex_o1", "cuda_amp",
             "already_fabric"]
    for name in names:
        shutil.copyfile(FIXTURES / name / "input.py", tmp_path / f"{name}.py")
    (tmp_path / "notes.py").write_text("print('no training here')\n")
    serial = run(".", "--format", "json", "-j", "1")
    parallel = run(".", "--format", "json", "-j", "2")
    assert serial.exit_code == parallel.exit_code == 0
    assert serial.stdout == parallel.stdout
    records = [json.loads(line) for line in parallel.stdout.splitlines()]
    assert [r["path"] for r in records] == sorted(r["path"] for r in records)
    assert {"path", "status", "changed", "rules", "changes", "left_alone", "dropped", "error"} <= set(records[0])
    assert sum(r["changed"] for r in records) == 7  # already_fabric and notes.py are left alone
    text = run("module_loop.py", "notes.py", "already_fabric.py")
    assert "rules applied" in text.stderr  # the summary table
    assert text.stderr.strip().splitlines()[-1] == "1 file would be rewritten, 2 left unchanged"


def test_a_file_without_torch_is_checked_for_syntax_only(run, tmp_path):
    (tmp_path / "util.py").write_text("def f(:\n")
    result = run("util.py", "--format", "json")
    assert result.exit_code == 2
    assert "util.py:1" in json.loads(result.stdout)["error"]


# ---- the pre-commit hook, with the real pre-commit ------------------------------------------------

def _git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.com",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@example.com",
           "PRE_COMMIT_HOME": str(repo.parent / "pre-commit-home")}
    return subprocess.run(["git", *args], cwd=repo, capture_output=True, text=True, env=env, check=check)


def test_the_pre_commit_hook_fixes_and_fails_the_commit(tmp_path):
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("pre_commit")
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    manifest = yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())
    hook = next(h for h in manifest if h["id"] == "accelerate-rewrite")
    assert hook["entry"].split()[0] == "accelerate-rewrite" and hook["language"] == "python"
    # the manifest's hook, as a local one (no virtualenv to build): its entry runs this checkout
    entry = f"{sys.executable} -m accelerate_rewrite " + " ".join(hook["entry"].split()[1:])
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump({"repos": [{"repo": "local", "hooks": [{
        "id": hook["id"], "name": hook["name"], "entry": entry, "language": "system",
        "types_or": hook["types_or"]}]}]}))
    shutil.copyfile(CUDA_AMP, repo / "train.py")
    shutil.copyfile(FIXTURES / "module_loop" / "input.py", repo / "fabric_candidate.py")
    env_python = Path(sys.executable)
    install = subprocess.run([str(env_python), "-m", "pre_commit", "install"], cwd=repo,
                             capture_output=True, text=True,
                             env={**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")})
    assert install.returncode == 0, install.stderr
    _git(repo, "add", ".")
    first = _git(repo, "commit", "-q", "-m", "add scripts", check=False)
    assert first.returncode != 0, first.stdout + first.stderr  # the hook changed a file
    assert "files were modified by this hook" in first.stdout + first.stderr
    # the hook says which file it changed and with what, as black and ruff do
    assert "train.py: AR201 x2, AR203, AR202" in first.stdout + first.stderr
    fixed = (repo / "train.py").read_text()
    assert "torch.amp.GradScaler" in fixed and "scaler.unscale_(optimizer)" in fixed
    assert "Fabric" not in fixed  # the conversion is not a fix: it runs only when configured
    assert (repo / "fabric_candidate.py").read_bytes() == (FIXTURES / "module_loop" / "input.py").read_bytes()
    _git(repo, "add", ".")
    second = _git(repo, "commit", "-q", "-m", "add scripts", check=False)
    assert second.returncode == 0, second.stdout + second.stderr
    (repo / "README.md").write_text("no python here\n")
    _git(repo, "add", "README.md")
    quiet = _git(repo, "commit", "-q", "-m", "docs", check=False)
    assert quiet.returncode == 0 and "Failed" not in quiet.stdout
    # a project that asks for the conversion gets it in the hook
    (repo / "pyproject.toml").write_text('[tool.accelerate-rewrite]\nselect = ["ALL"]\nbackend = "fabric"\n')
    _git(repo, "add", "pyproject.toml")
    third = subprocess.run([str(env_python), "-m", "pre_commit", "run", "--all-files"], cwd=repo,
                           capture_output=True, text=True,
                           env={**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")})
    assert third.returncode == 1
    assert "fabric.launch()" in (repo / "fabric_candidate.py").read_text()


def test_the_hook_as_the_readme_shows_it(tmp_path):
    """`repo:` this checkout at its HEAD commit, as a user's .pre-commit-config.yaml names the
    project: pre-commit builds the hook's own virtualenv from .pre-commit-hooks.yaml (pip, from
    PyPI) and runs it."""
    yaml = pytest.importorskip("yaml")
    pytest.importorskip("pre_commit")
    head = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "HEAD"], capture_output=True, text=True)
    if shutil.which("git") is None or head.returncode != 0:
        pytest.skip("not a git checkout")
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".pre-commit-config.yaml").write_text(yaml.safe_dump({"repos": [{
        "repo": str(ROOT), "rev": head.stdout.strip(), "hooks": [{"id": "accelerate-rewrite"}]}]}))
    shutil.copyfile(CUDA_AMP, repo / "train.py")
    _git(repo, "add", ".")
    done = subprocess.run([sys.executable, "-m", "pre_commit", "run", "--files", "train.py"], cwd=repo,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, "PRE_COMMIT_HOME": str(tmp_path / "pre-commit-home")})
    assert done.returncode == 1, done.stdout + done.stderr
    assert "files were modified by this hook" in done.stdout
    assert "torch.amp.GradScaler" in (repo / "train.py").read_text()


def test_the_notebook_hook_brings_the_notebooks_extra():
    """The main hook takes Python files only (its environment has no nbformat/IPython); the
    jupyter hook takes notebooks too and installs the extra, as black-jupyter does."""
    yaml = pytest.importorskip("yaml")
    manifest = {h["id"]: h for h in yaml.safe_load((ROOT / ".pre-commit-hooks.yaml").read_text())}
    assert manifest["accelerate-rewrite"]["types_or"] == ["python"]
    jupyter = manifest["accelerate-rewrite-jupyter"]
    assert "jupyter" in jupyter["types_or"] and jupyter["additional_dependencies"] == [".[notebooks]"]
    assert jupyter["entry"] == manifest["accelerate-rewrite"]["entry"]
