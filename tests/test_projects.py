"""Issue 14.2: a project, not a file. A script and the project's own modules it imports
(``from engine import train_one_epoch``) are converted together (codemod/project/program.py): the golden
outputs of every file, the refusals and their reasons, the command line (every file shown and
written as a set, ``--check``, ``--follow-imports``), and the rewritten project run on CPU: at
32-true on one device it prints what the original prints, digit for digit; on 2 gloo processes
its evaluation equals the original's and its files are written once.
"""

from __future__ import annotations

import ast
import os
import re
import shutil
import stat
import subprocess
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.codemod.project.program import Scope
from accelerate_rewrite.options import Options
from tests import processes
from tests.goldens import (FIXTURES, OPTION_SETS, PROJECT_SETS, PROJECTS, project_names, project_notes, project_outputs,
                           project_scope, run_project)

CASES = [(name, option_set) for name in project_names() for option_set in PROJECT_SETS]
#: projects whose loop is in a module of their own: it changes with the script (the native
#: backend may change one file only); in ``sam`` the module is the optimizer, read, not changed
MODULES_CHANGE = {"engine_driver", "ddp_tutorial", "scaler_class", "research_engine", "research_amp"}


def test_there_are_project_fixtures():
    assert set(project_names()) == MODULES_CHANGE | {"sam", "gpt_repo", "dataset_object", "progress_helper"}


@pytest.mark.parametrize("name,option_set", CASES)
def test_golden_files_and_notes_of_a_project(name, option_set):
    """Each file's golden output (the files that change, and only those), the notes of every
    file; each output parses, no rule is dropped, and a second run over the outputs changes
    nothing in any file."""
    result = run_project(name, option_set)
    expected = PROJECTS / name / "expected"
    outputs = project_outputs(result)
    assert sorted(outputs) == sorted(p.name for p in (expected / option_set).glob("*.py"))
    for file, text in outputs.items():
        assert text == (expected / option_set / file).read_text(encoding="utf-8"), file
        ast.parse(text)
    assert project_notes(result) == (expected / f"{option_set}.notes").read_text(encoding="utf-8")
    assert not result.dropped, result.dropped
    if name in MODULES_CHANGE and OPTION_SETS[option_set].get("backend") != "torch":
        assert len(outputs) >= 2  # the script and the module with its loop change together
    root = PROJECTS / name
    again = rewrite(result.output, Options.create(**OPTION_SETS[option_set]), path=str(root / "train.py"),
                    scope=project_scope(name), sources={str(root / Path(m.path).name): m.output
                                                        for m in result.members})
    assert again.output == result.output
    assert {Path(m.path).name: m.output for m in again.members} == \
        {Path(m.path).name: m.output for m in result.members}


def _engine_driver(tmp_path: Path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(PROJECTS / "engine_driver", root, ignore=shutil.ignore_patterns("expected"))
    return root


def test_the_script_alone_does_not_change_the_module_and_says_why(tmp_path):
    root = _engine_driver(tmp_path)
    path = root / "train.py"
    result = rewrite(path.read_text(encoding="utf-8"), Options.create(), path=str(path), scope=Scope())
    assert not result.changed and not any(m.changed for m in result.members)
    assert any("it would change" in d and "engine.py, which is not among the paths given (name it too, or "
               "pass --follow-imports)" in d for d in result.dropped), result.dropped


def test_modules_not_followed_say_why(tmp_path):
    """A module that runs as a script of its own is followed without its main block (importing
    it never runs that); one imported relatively too (issue 46); a name imported under another
    name is read under its own, unless that name is the script's as well (then it is not
    followed, and the note says why)."""
    root = _engine_driver(tmp_path)
    engine = root / "engine.py"
    engine.write_text(engine.read_text() + '\n\nif __name__ == "__main__":\n    print("a demo")\n')
    (root / "helpers.py").write_text("import torch\n\n\ndef main():\n    return torch.optim\n")
    (root / "pkg").mkdir()
    (root / "pkg" / "__init__.py").write_text("from .core import fit\n\n\ndef optimize():\n    pass\n")
    path = root / "train.py"
    text = path.read_text().replace("from utils import make_loaders\n",
                                    "from utils import make_loaders\nfrom helpers import main as helper_main\n"
                                    "from pkg import optimize\n")
    path.write_text(text)
    result = rewrite(text, Options.create(), path=str(path), scope=Scope(follow=True))
    reasons = [n.message for n in result.skips if n.rule == "project"]
    assert not any("engine.py" in r or "__init__.py" in r for r in reasons), reasons
    assert any("helpers.py is not followed: `main` is imported as `helper_main`, and `main` is defined there too"
               in r for r in reasons), reasons
    engine_out = next(m.output for m in result.members if Path(m.path).name == "engine.py")
    assert "fabric.backward(loss)" in engine_out
    assert engine_out.endswith('if __name__ == "__main__":\n    print("a demo")\n')


@pytest.mark.parametrize("line", [
    'sys.path.append("..")\n',
    'sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))\n',
    "sys.path.append(str(Path(__file__).resolve().parent.parent))\n",
])
def test_a_module_the_script_puts_on_sys_path_is_followed(tmp_path, line):
    """The script in ``scripts/`` puts the project's root on ``sys.path`` before it imports
    engine.py from there: the module is found and changes with it (its path relative to the
    script in the report)."""
    root = _engine_driver(tmp_path)
    (root / "scripts").mkdir()
    text = (root / "train.py").read_text()
    path = root / "scripts" / "train.py"
    path.write_text("import os\nimport sys\nfrom pathlib import Path\n\n" + line + "\n" + text)
    (root / "train.py").unlink()
    result = rewrite(path.read_text(), Options.create(), path=str(path), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    changed = sorted(Path(m.path).name for m in result.members if m.changed)
    assert "engine.py" in changed, changed
    assert "fabric.backward(loss)" in next(m.output for m in result.members if Path(m.path).name == "engine.py")


def test_a_lightning_module_of_another_script_in_a_sibling_does_not_block(tmp_path):
    """models.py holds the plain model this script trains and a LightningModule that another
    script of the repository trains: nothing this script runs uses Lightning, so it converts; a
    sibling whose Lightning code the script does use still leaves it alone."""
    (tmp_path / "models.py").write_text(
        "import lightning as L\nimport torch\nimport torch.nn as nn\n\n\nclass Net(nn.Module):\n    def __init__(self):\n"
        "        super().__init__()\n        self.fc = nn.Linear(4, 1)\n\n    def forward(self, x):\n"
        "        return self.fc(x)\n\n\nclass LitNet(L.LightningModule):\n    def __init__(self):\n"
        "        super().__init__()\n        self.net = Net()\n\n    def configure_optimizers(self):\n"
        "        return torch.optim.SGD(self.parameters(), lr=0.1)\n")
    script = (
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nfrom models import Net\n\n\n"
        "def main():\n    model = Net()\n    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)\n"
        "    for x, y in loader:\n        loss = torch.nn.functional.mse_loss(model(x), y)\n"
        "        optimizer.zero_grad()\n        loss.backward()\n        optimizer.step()\n\n\nmain()\n")
    path = tmp_path / "train.py"
    path.write_text(script)
    result = rewrite(script, Options.create(), path=str(path), scope=Scope(follow=True))
    assert "fabric.backward(loss)" in result.output, [n.message for n in result.skips]
    assert [Path(m.path).name for m in result.members] == ["models.py"]  # read, and left as it is
    uses = script.replace("from models import Net", "from models import LitNet, Net").replace(
        "    model = Net()", "    model = LitNet().net")
    path.write_text(uses)
    again = rewrite(uses, Options.create(), path=str(path), scope=Scope(follow=True))
    assert not again.changed
    assert any("already uses the Lightning Trainer" in n.message for r in (again, *again.members) for n in r.skips)


def test_a_name_bound_in_two_files_is_not_followed(tmp_path):
    root = _engine_driver(tmp_path)
    path = root / "train.py"
    text = path.read_text().replace('\n\nif __name__ == "__main__":', '\n\ndef evaluate_all():\n    pass\n'
                                    '\n\ndef math():\n    pass\n\n\nif __name__ == "__main__":')
    result = rewrite(text, Options.create(), path=str(path), scope=Scope(follow=True))
    reasons = [n.message for n in result.skips if n.rule == "project"]
    assert any("engine.py is not followed: `math` is defined both there and in" in r for r in reasons), reasons


#: the engine/driver project's script with its modules imported whole (``import engine``,
#: ``import utils as U``) and read through them
_WHOLE = [("from engine import evaluate, train_one_epoch\n", "import engine\n"),
          ("from utils import make_loaders\n", "import utils as U\n"),
          (" train_one_epoch(model", " engine.train_one_epoch(model"), ("= evaluate(", "= engine.evaluate("),
          ("= make_loaders(", "= U.make_loaders(")]


def _whole(text: str) -> str:
    for old, new in _WHOLE:
        assert old in text, old
        text = text.replace(old, new)
    return text


@pytest.mark.parametrize("option_set", ["default", "bf16-mixed-devices-4", "torch-16-mixed"])
def test_modules_imported_whole_are_followed_as_names_imported_from_them(tmp_path, option_set):
    """``import engine`` / ``import utils as U``: the analysis reads ``engine.train_one_epoch`` as
    the function it is, the script keeps its spelling, and every file comes out as with
    ``from engine import ...`` (the goldens), idempotent."""
    root = _engine_driver(tmp_path)
    path = root / "train.py"
    path.write_text(_whole(path.read_text(encoding="utf-8")), encoding="utf-8")
    options = Options.create(**OPTION_SETS[option_set])
    result = rewrite(path.read_text(encoding="utf-8"), options, path=str(path), scope=Scope(follow=True))
    expected = PROJECTS / "engine_driver" / "expected" / option_set
    assert not result.dropped, result.dropped
    assert result.output == _whole((expected / "train.py").read_text(encoding="utf-8"))
    for member in result.members:
        golden = expected / Path(member.path).name
        assert member.output == (golden.read_text(encoding="utf-8") if golden.exists() else member.source)
    assert not [n for n in result.skips if n.rule == "project"]
    again = rewrite(result.output, options, path=str(path), scope=Scope(follow=True),
                    sources={m.path: m.output for m in result.members})
    assert again.output == result.output and all(not m.changed for m in again.members)


def test_a_module_imported_whole_and_read_otherwise_is_not_followed(tmp_path):
    """``print(engine)``, a name of the script's own beside ``engine.evaluate``: not followed,
    with the reason; the driver alone has no backward, so nothing converts, and it says where
    the training went."""
    root = _engine_driver(tmp_path)
    path = root / "train.py"
    base = _whole(path.read_text(encoding="utf-8"))
    engine = root / "engine.py"
    # (a script of its own as well: its main block never runs on import, and is no reason)
    engine.write_text(engine.read_text() + '\n\nif __name__ == "__main__":\n    print("a demo")\n')
    for extra, reason in [("print(engine)", "`engine` is read other than as `engine.name`"),
                          ("evaluate = None", "`evaluate` is both `engine.evaluate` and a name of the script")]:
        text = base.replace("    torch.save(", f"    {extra}\n    torch.save(")
        result = rewrite(text, Options.create(), path=str(path), scope=Scope(follow=True))
        reasons = [n.message for n in result.skips if n.rule == "project"]
        assert any(f"engine.py is not followed: {reason}" in r for r in reasons), reasons
        assert all(r for r in reasons), reasons  # a module with nothing to look at says nothing
        assert not result.changed
        assert any("no backward call found: `engine.train_one_epoch(model, optimizer, trai...` takes the "
                   "optimizer into code this rewrite can't see" in n.message for n in result.skips), result.skips


def _cli(*args: str, cwd: Path, input: str | None = None):
    runner = CliRunner()
    old = os.getcwd()
    os.chdir(cwd)
    try:
        return runner.invoke(cli, ["--isolated", "--no-cache", *args], input=input)
    finally:
        os.chdir(old)


def test_a_script_on_stdin_or_a_notebook_changes_no_module_and_says_why(tmp_path):
    """Only the text read comes back (stdin), only the notebook's cells change: a conversion
    that needs engine.py changed is left out, and the reason says so (not --follow-imports)."""
    import json

    root = _engine_driver(tmp_path)
    text = (root / "train.py").read_text()
    piped = _cli("-", "--stdin-filename", "train.py", "--follow-imports", cwd=root, input=text)
    assert piped.exit_code == 0 and piped.stdout == text, piped.output
    assert ("it would change engine.py, and a script read from stdin comes back alone, on stdout (give the "
            "files' paths, with --follow-imports)") in " ".join(piped.output.split())
    cell = {"cell_type": "code", "id": "c1", "metadata": {}, "execution_count": None, "outputs": [],
            "source": text.splitlines(True)}
    (root / "train.ipynb").write_text(json.dumps({"cells": [cell], "metadata": {}, "nbformat": 4,
                                                   "nbformat_minor": 5}))
    shown = _cli("train.ipynb", "--follow-imports", cwd=root)
    assert shown.exit_code == 0, shown.output
    assert "it would change engine.py, and a notebook is rewritten alone (only its cells change)" in \
        " ".join(shown.output.split())


def test_the_command_line_shows_checks_and_writes_every_file(tmp_path):
    root = _engine_driver(tmp_path)
    before = {p.name: p.read_text() for p in root.glob("*.py")}
    shown = _cli(".", cwd=root)
    assert shown.exit_code == 0, shown.output
    assert "+++ train.py" in shown.stdout and "+++ engine.py" in shown.stdout
    # a module's numbers are the script's: one program
    assert "numerics: as for train.py (the files change together, one program)" in " ".join(shown.output.split())
    checked = _cli(".", "--check", cwd=root)
    assert checked.exit_code == 1
    assert "Would rewrite: train.py" in checked.output and "Would rewrite: engine.py" in checked.output
    assert {p.name: p.read_text() for p in root.glob("*.py")} == before
    written = _cli(".", "--write", cwd=root)
    assert written.exit_code == 0, written.output
    expected = PROJECTS / "engine_driver" / "expected" / "default"
    for file in ("train.py", "engine.py"):
        assert (root / file).read_text() == (expected / file).read_text()
    for file in ("model.py", "utils.py"):
        assert (root / file).read_text() == before[file]
    assert _cli(".", "--check", cwd=root).exit_code == 0


def test_the_script_named_alone_changes_the_modules_only_it_imports(tmp_path):
    """By default the project's modules that no other file under the script's folder imports
    change with it (as mypy follows imports); --no-follow-imports keeps to the paths given."""
    root = _engine_driver(tmp_path)
    kept = _cli("train.py", "--write", "--no-follow-imports", cwd=root)
    assert kept.exit_code == 0
    assert "engine.py, which is not among the paths given" in kept.output
    assert (root / "train.py").read_text() == (PROJECTS / "engine_driver" / "train.py").read_text()
    followed = _cli("train.py", "--write", cwd=root)
    assert followed.exit_code == 0, followed.output
    assert (root / "engine.py").read_text() == \
        (PROJECTS / "engine_driver" / "expected" / "default" / "engine.py").read_text()
    assert "engine.py: rewritten (with train.py)" in followed.output


def test_a_module_another_file_imports_changes_compatibly_unless_told(tmp_path):
    """engine.py's train_one_epoch read by another file (from a subfolder through a module that
    imports it, inside a function, through the module read whole) would break it: by default it
    changes so that the other file keeps working (issue 46: `fabric` last and optional, the
    changed statements guarded, codemod/project/compat.py), and the note names the file;
    --follow-imports changes it as the conversion would. A file that reads only a name the
    rewrite leaves as it was does not hold it back."""
    cases = {
        "helpers": ({"helpers.py": "from engine import train_one_epoch\n", "tools/evaluate.py": "import helpers\n"},
                    "helpers.py"),
        "function": ({"report.py": "def main():\n    from engine import train_one_epoch\n"}, "report.py"),
        "whole": ({"report.py": "import engine as E\nprint(E)\n"}, "report.py"),
        "unchanged": ({"report.py": "import engine\nprint(engine.PRINT_FREQ)\n"}, None),
    }
    for case, (files, said_of) in cases.items():
        root = _engine_driver(tmp_path / case)
        (root / "engine.py").write_text((root / "engine.py").read_text() + "\n\nPRINT_FREQ = 2\n")
        for name, text in files.items():
            (root / name).parent.mkdir(exist_ok=True)
            (root / name).write_text(text)
        alone = _cli("train.py", "--write", cwd=root)
        assert alone.exit_code == 0, alone.output
        said = " ".join(alone.output.split())
        assert "engine.py: rewritten (with train.py)" in said, said
        engine = (root / "engine.py").read_text()
        if said_of is None:
            assert "def train_one_epoch(model, optimizer, data_loader, fabric, epoch, print_freq=2):" in engine
            continue
        assert f"changed so that {said_of} keeps working" in said, (case, said)
        assert "def train_one_epoch(model, optimizer, data_loader, device, epoch, print_freq=2, fabric=None):" \
            in engine
        assert "        if fabric is not None:\n            fabric.backward(loss)\n        else:\n" \
               "            loss.backward()\n" in engine
        assert "train_one_epoch(model, optimizer, train_loader, fabric.device, epoch, fabric=fabric)" in \
            (root / "train.py").read_text()
        compile(engine, "engine.py", "exec")
        root = _engine_driver(tmp_path / f"{case}-follow")
        for name, text in files.items():
            (root / name).parent.mkdir(exist_ok=True)
            (root / name).write_text(text)
        followed = _cli("train.py", "--write", "--follow-imports", cwd=root)
        assert followed.exit_code == 0, followed.output
        assert "def train_one_epoch(model, optimizer, data_loader, fabric, epoch, print_freq=2):" in \
            (root / "engine.py").read_text()


def test_output_and_the_hook_keep_to_the_paths_given(tmp_path):
    root = _engine_driver(tmp_path)
    engine = (root / "engine.py").read_text()
    result = _cli("train.py", "-o", "new.py", cwd=root)
    assert "engine.py, which is not among the paths given" in " ".join(result.output.split())
    assert (root / "new.py").read_text() == (root / "train.py").read_text() or not (root / "new.py").exists()
    hooked = _cli("train.py", "--pre-commit", "--select", "ALL", "--backend", "fabric", "-v", cwd=root)
    assert "engine.py, which is not among the paths given" in " ".join(hooked.output.split()), hooked.output
    assert (root / "engine.py").read_text() == engine


def test_follow_imports_from_the_configuration(tmp_path):
    root = _engine_driver(tmp_path)
    (root / "pyproject.toml").write_text("[tool.accelerate-rewrite]\nfollow-imports = true\n")
    runner = CliRunner()
    old = os.getcwd()
    os.chdir(root)
    try:
        result = runner.invoke(cli, ["--no-cache", "train.py", "--check"])
    finally:
        os.chdir(old)
    assert result.exit_code == 1
    assert "Would rewrite: engine.py" in result.output


def test_a_project_is_written_all_or_nothing(tmp_path):
    root = _engine_driver(tmp_path)
    engine = root / "engine.py"
    engine.chmod(stat.S_IRUSR | stat.S_IRGRP | stat.S_IROTH)
    try:
        result = _cli(".", "--write", cwd=root)
    finally:
        engine.chmod(0o644)
    assert result.exit_code == 2
    assert "read-only" in result.output and "none of the 2 files of the project written" in result.output
    assert (root / "train.py").read_text() == (PROJECTS / "engine_driver" / "train.py").read_text()
    assert not list(root.glob(".*.tmp"))


def test_output_to_one_file_refuses_a_project(tmp_path):
    root = _engine_driver(tmp_path)
    result = _cli("train.py", "--follow-imports", "-o", "new.py", cwd=root)
    assert result.exit_code == 2
    assert "changes engine.py too, and -o writes one file" in result.output
    assert not (root / "new.py").exists()


def test_a_module_two_scripts_import_changes_once_for_both(tmp_path):
    """Two scripts of the run import engine.py (issue 58): both convert, and engine.py changes
    once, as the conversion would (no other file imports it), written with both."""
    root = _engine_driver(tmp_path)
    shutil.copy(root / "train.py", root / "train_again.py")
    result = _cli(".", cwd=root)
    assert result.output.count("+++ engine.py") == 1, result.output
    assert "engine.py: would be rewritten (with train.py and train_again.py)" in result.output or \
        "engine.py: would be rewritten (with train_again.py and train.py)" in result.output, result.output
    assert "+++ train.py" in result.output and "+++ train_again.py" in result.output
    assert "fabric is not None" not in result.output


# ---- the rewritten project runs --------------------------------------------------------------

def _run(root: Path, args: list[str]) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    return processes.run([sys.executable, "train.py", *args], cwd=root, env=env, timeout=300)


@lru_cache(maxsize=None)
def _both(tmp: str, options: Options, args: tuple[str, ...]):
    """The original project and its rewrite, each run in its own folder."""
    base = Path(tmp) / f"run-{abs(hash((options, args)))}"
    original, rewritten = base / "original", base / "rewritten"
    for folder in (original, rewritten):
        shutil.copytree(PROJECTS / "engine_driver", folder, ignore=shutil.ignore_patterns("expected"))
    path = rewritten / "train.py"
    result = rewrite(path.read_text(encoding="utf-8"), options, path=str(path), scope=Scope(follow=True))
    assert result.changed and not result.dropped, result.dropped
    path.write_text(result.output, encoding="utf-8")
    for member in result.members:
        Path(member.path).write_text(member.output, encoding="utf-8")
    return _run(original, list(args)), _run(rewritten, list(args)), base


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> str:
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    return str(tmp_path_factory.mktemp("projects"))


@pytest.mark.runs
def test_verify_runs_the_rewritten_project(work, tmp_path):
    """`accelerate-rewrite verify train.py` on a project: the script and engine.py rewritten in
    a temporary folder (nothing written beside them), the losses and gradient norms identical at
    32-true."""
    from accelerate_rewrite.verify.session import verify

    root = _engine_driver(tmp_path)
    before = {p.name: p.read_text() for p in root.glob("*.py")}
    old = os.getcwd()
    os.chdir(root)
    try:
        v = verify(root / "train.py", Options.create(precision="32-true"), script_args=["--device", "cpu"],
                   steps=6, run_on="cpu", threads=1)
    finally:
        os.chdir(old)
    assert v.verdict.verdict == "pass", v.verdict.reason
    assert len(v.rewritten.losses) == len(v.original.losses) == 6
    assert any("engine.py" in n and "temporary folder" in n for n in v.notes), v.notes
    assert {p.name: p.read_text() for p in root.glob("*.py")} == before


@pytest.mark.runs
@pytest.mark.slow  # CI time: test_verify_runs_the_rewritten_project checks 32-true in the default set
def test_at_32_true_on_one_device_the_project_prints_what_the_original_prints(work):
    original, rewritten, _ = _both(work, Options.create(accelerator="cpu"), ("--device", "cpu"))
    assert original.returncode == 0, original.stderr[-2000:]
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    assert re.search(r"loss \d", original.stdout)
    assert rewritten.stdout == original.stdout


@pytest.mark.runs
@pytest.mark.slow  # CI time: tests/test_multi_device.py runs a whole evaluation on two processes
def test_on_two_processes_evaluation_is_whole_and_files_are_written_once(work):
    original, rewritten, base = _both(work, Options.create(devices=2, accelerator="cpu"),
                                      ("--device", "cpu", "--lr", "0"))
    assert original.returncode == 0, original.stderr[-2000:]
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    accuracy = [line for line in original.stdout.splitlines() if "accuracy" in line]
    assert accuracy and [line for line in rewritten.stdout.splitlines() if "accuracy" in line] == accuracy
    assert (base / "rewritten" / "model.pt").is_file()


def _per_rank(text: str) -> dict[str, list[tuple[str, str]]]:
    """The losses of each rank, in the order that rank printed them (the processes share the
    output: their lines may run into each other)."""
    out: dict[str, list[tuple[str, str]]] = {}
    for rank, epoch, loss in re.findall(r"\[GPU(\d)\] epoch (\d+) loss (\d+\.\d{6})", text):
        out.setdefault(rank, []).append((epoch, loss))
    return out


@pytest.mark.runs
@pytest.mark.slow  # CI time: hand-made DDP runs rank by rank in tests/test_hand_ddp.py, a project in
# test_verify_runs_the_rewritten_project
def test_hand_made_ddp_over_three_files_gives_every_rank_the_same_losses(work):
    """The DDP tutorial's mp.spawn script with its Trainer and data in files of their own: the
    original on 2 gloo processes, the rewrite with Fabric on 2 CPU devices: each rank's losses
    equal, digit for digit, and the checkpoint rank 0 writes holds the same weights."""
    import torch

    base = Path(work) / "ddp_tutorial"
    original, rewritten = base / "original", base / "rewritten"
    for folder in (original, rewritten):
        shutil.copytree(PROJECTS / "ddp_tutorial", folder, ignore=shutil.ignore_patterns("expected"))
    path = rewritten / "train.py"
    result = rewrite(path.read_text(encoding="utf-8"), Options.create(accelerator="cpu"), path=str(path),
                     scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert sorted(Path(m.path).name for m in result.members if m.changed) == ["datautils.py", "trainer.py"]
    path.write_text(result.output, encoding="utf-8")
    for member in result.members:
        Path(member.path).write_text(member.output, encoding="utf-8")
    args = ["2", "1", "--world-size", "2"]
    runs = [_run(folder, args) for folder in (original, rewritten)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    before, after = (_per_rank(run.stdout) for run in runs)
    assert sorted(before) == ["0", "1"] and before == after
    # saved each epoch (2), by rank 0 only
    assert runs[1].stdout.count("Training checkpoint saved") == runs[0].stdout.count("Training checkpoint saved") == 2
    saved = [torch.load(folder / "checkpoint.pt") for folder in (original, rewritten)]
    assert saved[0].keys() == saved[1].keys()
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


@pytest.mark.runs
@pytest.mark.slow  # CI time: its rewrite is checked by its goldens (fixtures/projects/sam)
def test_sam_steps_in_two_halves_as_before(work):
    """SAM (sam.py, the script's own optimizer class) is set up with the model; its two
    forward-backward passes go through fabric.backward, its first_step/second_step are its own:
    at 32-true every loss is the original's, digit for digit. At 16-mixed the precision is left
    out and the note says why (the GradScaler would not see those steps)."""
    result, _ = _sam_both_ways(Path(work) / "sam", Options.create(accelerator="cpu"))
    assert "fabric.setup(model, optimizer)" in result.output
    source = Path(work) / "sam" / "original" / "train.py"
    half = rewrite(source.read_text(encoding="utf-8"), Options.create(precision="16-mixed"), path=str(source),
                   scope=Scope(follow=True))
    assert any("steps by `first_step` and `second_step`, which Fabric's GradScaler does not see" in n.message
               for n in half.skips)


@pytest.mark.runs
def test_sam_steps_in_two_halves_under_accelerate_as_before(work):
    """Issue 61: under ``--backend accelerate`` SAM's ``first_step``/``second_step`` are made on
    ``optimizer.optimizer``, the SAM itself (Accelerate's prepared optimizer has no
    ``first_step``: the rewrite crashed with "'AcceleratedOptimizer' object has no attribute
    'first_step'"); ``zero_grad`` and ``param_groups`` stay the wrapper's, which answers them.
    At 32-true on one process every loss is the original's, digit for digit."""
    options = Options.create(backend="accelerate", accelerator="cpu")
    result, path = _sam_both_ways(Path(work) / "sam-accelerate", options)
    assert "model, optimizer = accelerator.prepare(model, optimizer)" in result.output
    assert "optimizer.optimizer.first_step(" in result.output and "optimizer.optimizer.second_step(" in result.output
    assert rewrite(result.output, options, path=str(path), scope=Scope(follow=True)).output == result.output


def _sam_both_ways(base: Path, options: Options):
    """fixtures/projects/sam and its rewrite, each run in its own folder under ``base``: every
    loss line the same, digit for digit. The result, and the rewritten script's path."""
    original, rewritten = base / "original", base / "rewritten"
    for folder in (original, rewritten):
        shutil.copytree(PROJECTS / "sam", folder, ignore=shutil.ignore_patterns("expected"))
    path = rewritten / "train.py"
    result = rewrite(path.read_text(encoding="utf-8"), options, path=str(path), scope=Scope(follow=True))
    assert result.changed and not result.dropped and not any(m.changed for m in result.members)
    path.write_text(result.output, encoding="utf-8")
    runs = [_run(folder, []) for folder in (original, rewritten)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    assert re.search(r"epoch 1 loss \d", runs[0].stdout)
    assert runs[1].stdout == runs[0].stdout
    return result, path


@pytest.mark.runs
@pytest.mark.slow  # CI time: two processes, each importing lightning
def test_a_loss_scaler_class_trains_every_rank_as_before(work):
    """The Swin Transformer's shape (fixtures/projects/scaler_class): a loss scaler of utils.py
    whose ``__call__`` runs backward and the step receives ``fabric``; the driver's process
    group, started under torchrun, becomes Fabric's; each rank writes its own log file (not
    rank 0's alone: the whole training runs inside that ``with``). The original under torchrun
    on 2 gloo processes, the rewrite with Fabric on 2 CPU devices: each rank's losses, gradient
    norms and log lines equal, digit for digit, and rank 0's checkpoint holds the same weights."""
    import torch

    base = Path(work) / "scaler_class"
    original, rewritten = base / "original", base / "rewritten"
    for folder in (original, rewritten):
        shutil.copytree(PROJECTS / "scaler_class", folder, ignore=shutil.ignore_patterns("expected"))
    path = rewritten / "train.py"
    result = rewrite(path.read_text(encoding="utf-8"), Options.create(devices=2, accelerator="cpu"),
                     path=str(path), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert sorted(Path(m.path).name for m in result.members if m.changed) == ["utils.py"]
    assert "with open(os.path.join(args.output, f\"log_rank{fabric.global_rank}.txt\"), \"a\") as log:\n" \
           "        main(args, log)\n" in result.output  # every rank trains, and logs
    path.write_text(result.output, encoding="utf-8")
    for member in result.members:
        Path(member.path).write_text(member.output, encoding="utf-8")
    runs = [processes.run_ranks(processes.torchrun("train.py"), original),
            processes.run_ranks([sys.executable, "train.py"], rewritten)]
    for run in runs:
        assert run.returncode == 0, run.stderr[-3000:]
    line = re.compile(r"rank (\d) epoch (\d+) step (\d+) loss (\d+\.\d{6}) norm (\d+\.\d{6})")
    before, after = (sorted(line.findall(run.stdout)) for run in runs)
    assert {rank for rank, *_ in before} == {"0", "1"} and len(before) == 16
    assert after == before
    for rank in ("0", "1"):
        logs = [(folder / "output" / f"log_rank{rank}.txt").read_text() for folder in (original, rewritten)]
        assert logs[0].count("mean loss") == 8 and logs[1] == logs[0]
    saved = [torch.load(folder / "output" / "ckpt.pth") for folder in (original, rewritten)]
    assert all(torch.equal(saved[0][k], saved[1][k]) for k in saved[0])


def test_changed_names_are_the_definitions_that_differ():
    from accelerate_rewrite.codemod.analysis.importers import changed_names

    before = "import a\n\n\ndef f():\n    pass\n\n\nclass C:\n    pass\n\n\nX = 1\n"
    assert changed_names(before, before.replace("def f():", "def f(fabric):") + "from b import c\n") == {"f"}
    assert changed_names(before, before.replace("X = 1", "X = 2")) == {"X"}
    assert changed_names(before, before + "print(X)\n") is None  # runs differently on import
    assert changed_names(before, "def (") is None
    # the lines as Python numbers them (a line separator inside a string ends no line), and
    # a change of layout alone changes no definition
    odd = 'S = "\u2028\x0c"\n\n@dec\ndef f():\n    return 1\n'
    assert changed_names(odd, odd.replace("return 1", "return 2")) == {"f"}
    assert changed_names(odd, odd.replace("@dec", "@other")) == {"f"}
    assert changed_names(odd, odd.replace("return 1", "return (1)")) == frozenset()


def test_each_file_of_a_project_is_parsed_once(tmp_path, monkeypatch):
    """The script is parsed to find its project's modules and then for its facts, and a module
    may be asked for twice (followed, and read through): one parse of each text."""
    import libcst

    from accelerate_rewrite.codemod import engine, reading

    root = _engine_driver(tmp_path)
    path = root / "train.py"
    parsed: list[str] = []
    real = libcst.parse_module
    monkeypatch.setattr(libcst, "parse_module", lambda text, *a, **k: parsed.append(text) or real(text, *a, **k))
    for text in (path.read_text(encoding="utf-8"), _whole(path.read_text(encoding="utf-8"))):
        engine._analyse.cache_clear()
        engine._parsed.cache_clear()
        reading._module_split.cache_clear()  # the modules' parses kept across rewrites
        parsed.clear()
        result = rewrite(text, Options.create(), path=str(path), scope=Scope(follow=True))
        assert result.changed and result.members
        assert len(parsed) == len(set(parsed)) >= 2
    # a module of the script's folder it imports but does not train in: the script alone
    solo = tmp_path / "solo"
    solo.mkdir()
    (solo / "helper.py").write_text("SEED = 0\n", encoding="utf-8")
    alone = "import helper\n" + (FIXTURES / "module_loop" / "input.py").read_text(encoding="utf-8")
    engine._analyse.cache_clear()
    engine._parsed.cache_clear()
    reading._module_split.cache_clear()
    parsed.clear()
    assert rewrite(alone, Options.create(), path=str(solo / "train.py"), scope=Scope(follow=True)).changed
    assert alone in parsed and len(parsed) == len(set(parsed))


def test_a_script_read_again_as_a_module_of_another_program_is_parsed_once(tmp_path, monkeypatch):
    """A script of a repository that another script's program imports (DINO's main_dino.py, which
    run_with_submitit.py imports) is parsed once for both rewrites: its own, and the other's."""
    import libcst

    from accelerate_rewrite.codemod import engine, reading

    root = _engine_driver(tmp_path)
    module = root / "engine.py"
    module.write_text(module.read_text(encoding="utf-8") + '\n\nif __name__ == "__main__":\n    print("a demo")\n',
                      encoding="utf-8")
    engine._analyse.cache_clear()
    engine._parsed.cache_clear()
    reading._module_split.cache_clear()
    parsed: list[str] = []
    real = libcst.parse_module
    monkeypatch.setattr(libcst, "parse_module", lambda text, *a, **k: parsed.append(text) or real(text, *a, **k))
    own = module.read_text(encoding="utf-8")
    rewrite(own, Options.create(), path=str(module), scope=Scope(follow=True))
    script = root / "train.py"
    result = rewrite(script.read_text(encoding="utf-8"), Options.create(), path=str(script), scope=Scope(follow=True))
    assert any(m.path.endswith("engine.py") for m in result.members)  # read as a module of train.py's program
    assert parsed.count(own) == 1


def test_the_files_importing_a_module_are_found_whatever_the_spelling(tmp_path):
    """importers.importers: a file counts where it imports the module (``import utils``, ``from
    .utils import x``, ``from . import utils``, through a package, or through another file that
    does), over one line or several; a file that only names it in a string or a comment does not
    (where no line holds both `import` and its name, the file is not parsed: its bytes only)."""
    from accelerate_rewrite.codemod.analysis.importers import importers

    (tmp_path / "pkg").mkdir()
    files = {
        "utils.py": "def helper():\n    return 1\n",
        "plain.py": "import utils\n",
        "reads.py": "from . import utils as u\n\nu.helper()\n",
        "late.py": "def f():\n    from utils import helper\n    return helper()\n",
        "pkg/__init__.py": "",
        "pkg/rel.py": "from .. import utils\n",
        "through.py": "import plain\n",
        "named.py": "# utils is a good name\nx = 'utils'\n",
        "mentioned.py": "import os  # not utils\n",  # a line with both words: parsed, and found not to
        "wrapped.py": "from . import (\n    utils,\n)\n\nutils.helper()\n",
        "continued.py": "from utils \\\n    import helper\n",
        "other.py": "import os\n",
        "uses_pkg.py": "import pkg.rel\n",
    }
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    real = lambda name: os.path.realpath(tmp_path / name)  # noqa: E731
    found = importers(tmp_path, real("utils.py"), frozenset())
    assert sorted(p.name for p in found) == ["continued.py", "late.py", "plain.py", "reads.py", "rel.py",
                                              "through.py", "uses_pkg.py", "wrapped.py"]
    direct = importers(tmp_path, real("utils.py"), frozenset(), changed=frozenset({"helper"}))
    # the others read no `helper` of it
    assert sorted(p.name for p in direct) == ["continued.py", "late.py", "reads.py", "wrapped.py"]
    assert [p.name for p in importers(tmp_path, real("pkg/__init__.py"), frozenset())] == ["uses_pkg.py"]


def _fixture_inputs():
    """Every fixture's input and its default result (where `fabric` is passed to the helpers)."""
    return sorted([*FIXTURES.glob("*/input.py"), *FIXTURES.glob("*/expected/default.py")])


def test_a_transformer_along_the_paths_gives_the_tree_it_gives_through_every_node():
    """tree/walk.py's Along: the name transformers of a project (program.py's _Dealias and
    Realias, compat.py's calls by keyword) go only along the paths to the nodes they may change,
    and give the code they give going through every node, on every fixture."""
    import builtins
    import collections

    import libcst as cst

    from accelerate_rewrite.codemod.project.compat import Taken
    from accelerate_rewrite.codemod.project.keywords import _ByKeyword
    from accelerate_rewrite.codemod.project.names import Realias, _Dealias

    checked = changed = 0
    for path in _fixture_inputs():
        module = cst.parse_module(path.read_text(encoding="utf-8"))
        names = [n.value for n in _names(module)]
        common = [n for n, _ in collections.Counter(names).most_common(3)]
        attrs = [n for n in _attributes(module) if isinstance(n.value, cst.Name)]
        called = [n.func.value for n in _calls(module) if isinstance(n.func, cst.Name)]
        # (a builtin called by name is read only: where a module is read through, its names are)
        read = [n for n in called if n in dir(builtins)]
        makers = [lambda: Realias({read[0]: "E"} if read else {}, {common[-1]: "B"}) if common else None,
                  lambda: _Dealias({attrs[0].attr.value: attrs[0].value.value}, {"A": common[0]})
                  if attrs and common else None,
                  lambda: _ByKeyword({called[0]: Taken(0)}) if called else None]
        for make in makers:
            if make() is None:
                continue
            whole = module.visit(make()).code
            along = make()
            assert along.along(module).code == whole, path
            checked += 1
            changed += whole != module.code
    assert checked > 60 and changed > 60, (checked, changed)


def _names(module):
    import libcst.matchers as m

    return m.findall(module, m.Name())


def _attributes(module):
    import libcst.matchers as m

    return m.findall(module, m.Attribute())


def _calls(module):
    import libcst.matchers as m

    return m.findall(module, m.Call())


def test_a_module_made_between_two_looks_is_found(tmp_path):
    """Where a module's file is, is looked for once a look (siblings.look_again: each look for a
    script's modules, each rewrite), and again at the next."""
    from accelerate_rewrite.codemod.analysis import siblings

    script = tmp_path / "train.py"
    script.write_text("import helpers\n")
    assert siblings.candidates(script, script.read_text(), lambda f: f.read_text()) == []
    (tmp_path / "helpers.py").write_text("x = 1\n")
    assert siblings._file(tmp_path, "helpers") is None  # within the look: its first answer
    assert siblings.candidates(script, script.read_text(), lambda f: f.read_text()) == [tmp_path / "helpers.py"]
    (tmp_path / "helpers.py").unlink()
    rewrite("import helpers\n", Options.create(), path=str(script))
    assert siblings._file(tmp_path, "helpers") is None


LOG_MODULE = '''class Log:
    """Prints a table of the epochs' figures (davda54/sam's utility/log.py)."""

    def __init__(self, every):
        self.every = every

    def step(self, epoch, loss):
        if epoch % self.every == 0:
            print(f"┃{epoch:6d} ┃{loss:10.4f} ┃")
'''

LOG_SCRIPT = '''import torch
from torch.utils.data import DataLoader, TensorDataset

from log import Log


def main():
    data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4, shuffle=True)
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    log = Log(every=1)
    for epoch in range(2):
        for x, y in data:
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        log.step(epoch, loss.item())


if __name__ == "__main__":
    main()
'''


def test_a_module_that_only_prints_prints_on_rank_zero(tmp_path):
    """Issue 57, davda54/sam's results table: ``utility/log.py`` holds no training, so it was not
    read, and on several processes its table printed once per process, unmentioned. With
    several devices a module that prints is read too: its class receives `fabric` where the
    script builds it, and prints on rank 0; on one device it is not read (nothing to change)."""
    (tmp_path / "log.py").write_text(LOG_MODULE, encoding="utf-8")
    path = tmp_path / "train.py"
    path.write_text(LOG_SCRIPT, encoding="utf-8")
    two = rewrite(LOG_SCRIPT, Options.create(devices=2), path=str(path), scope=Scope(follow=True))
    log = next(m.output for m in two.members if Path(m.path).name == "log.py")
    assert "    def __init__(self, fabric, every):\n        self.fabric = fabric\n" in log
    assert '            self.fabric.print(f"┃{epoch:6d} ┃{loss:10.4f} ┃")\n' in log
    assert "    log = Log(fabric, every=1)\n" in two.output
    one = rewrite(LOG_SCRIPT, Options.create(), path=str(path), scope=Scope(follow=True))
    assert not any(m.changed for m in one.members)


@pytest.mark.runs
@pytest.mark.slow  # (CI time: two processes that each import lightning)
def test_a_module_that_only_prints_prints_once_on_two_processes(tmp_path):
    """The same project (SAM's shape), rewritten with ``--devices 2 --accelerator cpu`` and run
    with plain python: every line of the table once, as one process printed it."""
    pytest.importorskip("lightning")
    (tmp_path / "log.py").write_text(LOG_MODULE, encoding="utf-8")
    (tmp_path / "train.py").write_text(LOG_SCRIPT, encoding="utf-8")
    done = subprocess.run([sys.executable, "-m", "accelerate_rewrite", "train.py", "--devices", "2", "--accelerator",
                           "cpu", "--write", "--no-cache"], cwd=tmp_path, capture_output=True, text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    run = processes.run_ranks([sys.executable, "train.py"], tmp_path)
    assert run.returncode == 0, run.stderr[-2000:]
    rows = [line for line in run.stdout.splitlines() if line.startswith("┃")]
    assert [row.split("┃")[1].strip() for row in rows] == ["0", "1"]


def test_a_module_read_with_aliases_is_not_parsed_again_at_each_attempt(tmp_path, monkeypatch, capsys):
    """A launcher whose program holds a script of its own that reads a module through its name
    (DINO's run_with_submitit.py, main_dino.py and its ``utils.x``): the text each attempt makes
    of that script is the code of a tree made of its own statements and the changed ones
    (Unit.home_tree), which the compatible change and the keyword calls read instead of parsing
    it. The run's output is the same as with that text parsed, and fewer texts are parsed."""
    import libcst

    from accelerate_rewrite.cli import main
    from accelerate_rewrite.codemod.project.units import Unit

    root = _engine_driver(tmp_path)
    train = root / "train.py"
    train.write_text(train.read_text(encoding="utf-8").replace(
        "from engine import evaluate, train_one_epoch\n", "import engine\n").replace(
        "        train_one_epoch(", "        engine.train_one_epoch(").replace(
        "accuracy = evaluate(", "accuracy = engine.evaluate("), encoding="utf-8")
    (root / "launch.py").write_text(
        'import argparse\n\nimport train\n\nif __name__ == "__main__":\n'
        '    args = argparse.Namespace(device="cpu", epochs=1, lr=0.1, batch_size=16, seed=0, output="m.pt")\n'
        '    train.main(args)\n', encoding="utf-8")
    real_parse, real_home = libcst.parse_module, Unit.home_tree
    trees: list[bool] = []

    def run(home) -> tuple[str, int]:
        from accelerate_rewrite.codemod import engine, reading
        from accelerate_rewrite.codemod.project import program
        from accelerate_rewrite.codemod.tree.parse import parsed_text

        for cache in (engine._analyse, engine._parsed, reading._module_split, parsed_text):
            cache.cache_clear()
        program._PROJECTS.clear()
        parsed: list[str] = []
        monkeypatch.setattr(libcst, "parse_module", lambda text, *a, **k: parsed.append(text) or real_parse(text, *a, **k))
        monkeypatch.setattr(Unit, "home_tree", home)
        with pytest.raises(SystemExit):
            main([str(root / "launch.py"), str(train), str(root / "engine.py"), "--no-cache", "-j", "1",
                  "--format", "json"])
        return capsys.readouterr().out, len(parsed)

    def home(self, new, code):
        made = real_home(self, new, code)
        trees.append(made is not None)
        return made

    with_trees, fewer = run(home)
    parsed_again, more = run(lambda self, new, code: None)
    assert trees and all(trees)
    assert with_trees == parsed_again and '"path": "launch.py"' in with_trees.replace(str(root) + "/", "")
    assert fewer < more
