"""Notebooks: code cells rewritten as one program; outputs, metadata, markdown, magics and cell
boundaries kept; diffs name the cells; edits across cells refused."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.codemod.engine import rewrite
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES

nbformat = pytest.importorskip("nbformat")
from nbformat.v4 import new_code_cell, new_markdown_cell, new_notebook, new_output  # noqa: E402

SCRIPT = (FIXTURES / "module_loop" / "input.py").read_text()
HEAD, LOOP = SCRIPT.split('"""', 2)[2].split("# Training loop\n")


def _notebook(path, cells) -> None:
    nb = new_notebook(cells=cells, metadata={"kernelspec": {"name": "python3", "display_name": "Python 3",
                                                            "language": "python"}})
    nbformat.write(nb, str(path))


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner(env={"NO_COLOR": "1"})
    return lambda *args: runner.invoke(cli, [str(a) for a in args], catch_exceptions=False)


@pytest.fixture
def notebook(tmp_path):
    path = tmp_path / "train.ipynb"
    _notebook(path, [
        new_markdown_cell("# Train a regression model"),
        new_code_cell("%matplotlib inline\n!nvidia-smi -L\n" + HEAD.strip()),
        new_code_cell("%%time\nfor i in range(3):\n    pass"),
        new_code_cell("# Training loop\n" + LOOP.strip(), execution_count=4,
                      outputs=[new_output("stream", name="stdout", text="epoch 0 step 0 loss 1.0\n")]),
        new_code_cell("files = !ls\nprint(len(files))"),
    ])
    return path


def test_cells_are_rewritten_as_one_program_and_everything_else_is_kept(run, notebook):
    before = nbformat.read(str(notebook), as_version=4)
    result = run("train.ipynb", "--write")
    assert result.exit_code == 0, result.stderr
    after = nbformat.read(str(notebook), as_version=4)
    nbformat.validate(after)
    assert [c.cell_type for c in after.cells] == [c.cell_type for c in before.cells]
    assert after.metadata == before.metadata
    assert after.cells[0] == before.cells[0]  # markdown
    assert after.cells[2] == before.cells[2]  # the %%time cell is not Python: untouched
    assert after.cells[4].source == "files = !ls\nfabric.print(len(files))"  # the shell escape kept
    assert after.cells[3].outputs == before.cells[3].outputs
    assert after.cells[3].execution_count == 4
    setup, loop = after.cells[1].source, after.cells[3].source
    assert "%matplotlib inline\n!nvidia-smi -L\n" in setup
    assert "fabric = Fabric(devices=1)" in setup and "model, optimizer = fabric.setup(model, optimizer)" in setup
    assert "fabric.backward(loss)" in loop and ".to(device)" not in loop
    # the cells, joined, are what the script gives
    joined = rewrite(SCRIPT, Options()).output
    assert "fabric.backward(loss)" in joined
    # idempotent
    again = run("train.ipynb", "--check")
    assert again.exit_code == 0, again.stdout


def test_the_diff_and_the_notes_name_the_cells(run, notebook):
    result = run("train.ipynb")
    assert "--- train.ipynb (cell 2)\n+++ train.ipynb (cell 2)\n" in result.stdout
    assert "--- train.ipynb (cell 4)" in result.stdout and "(cell 3)" not in result.stdout
    assert "AR106 cell 4, line " in result.stderr
    record = json.loads(run("train.ipynb", "--format", "json").stdout)
    backward = next(c for c in record["changes"] if c["rule"] == "AR106")
    assert backward["cell"] == 4 and backward["cell_line"] >= 1


def test_an_edit_across_cells_is_refused(run, tmp_path):
    path = tmp_path / "split.ipynb"
    # a module-level step whose forward and loss are in two cells: autocast would span them
    cells = [new_code_cell("import torch\nmodel = torch.nn.Linear(4, 1)\n"
                           "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
                           "device = torch.device('cpu')\nx = torch.randn(2, 4).to(device)"),
             new_code_cell("out = model(x)"),
             new_code_cell("loss = out.sum()\nloss.backward()\noptimizer.step()")]
    _notebook(path, cells)
    before = path.read_bytes()
    result = run("split.ipynb", "--write", "--backend", "torch", "--precision", "bf16-mixed")
    assert result.exit_code == 2
    assert "would move code across cells" in result.stderr
    assert path.read_bytes() == before


def test_a_broken_notebook_is_a_clear_error(run, tmp_path):
    (tmp_path / "bad.ipynb").write_text('{"cells": [}')
    result = run("bad.ipynb")
    assert result.exit_code == 2 and "bad.ipynb: not a notebook nbformat can read" in result.stderr


def test_folders_include_notebooks_but_not_checkpoints(run, tmp_path, notebook):
    (tmp_path / ".ipynb_checkpoints").mkdir()
    shutil.copyfile(notebook, tmp_path / ".ipynb_checkpoints" / "train-checkpoint.ipynb")
    records = [json.loads(line) for line in run(".", "--format", "json").stdout.splitlines()]
    assert [r["path"] for r in records] == ["train.ipynb"]
