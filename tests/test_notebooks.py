"""Notebooks: code cells rewritten as one program; outputs, metadata, markdown, magics and cell
boundaries kept; diffs name the cells; edits across cells refused."""

from __future__ import annotations

import json
import shutil
import sys

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.api import rewrite
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
    # the leading magics stay on top: Fabric's import goes below them, with the other imports
    assert setup.startswith("%matplotlib inline\n!nvidia-smi -L\nimport torch\n")
    assert "from torch.utils.data import DataLoader, TensorDataset\nfrom lightning.fabric import Fabric\n" in setup
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
    loop = LOOP.strip().splitlines()
    backward = 2 + loop.index(next(line for line in loop if "loss.backward()" in line))
    assert f"AR106 cell 4:line {backward}: " in result.stderr  # the "# Training loop" line is 1
    # a note that names more lines names them in their cells too
    prints = [2 + i for i, line in enumerate(loop) if "print(" in line]
    assert f"on cell 4:lines {', '.join(map(str, prints))}, cell 5:line 2" in result.stderr
    assert "train.ipynb:cell 2:line " in result.stderr  # a place left alone (AR404's hint)
    record = json.loads(run("train.ipynb", "--format", "json").stdout)
    change = next(c for c in record["changes"] if c["rule"] == "AR106")
    assert change["cell"] == 4 and change["cell_line"] == backward


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


# ---- IPython syntax, found by IPython's own transformers ------------------------------------------

LOOP_PERCENT = LOOP.strip().replace(
    'print(f"epoch {epoch} step {step} loss {loss.item():.4f}")',
    "msg = ('epoch %d step %d loss %.4f'\n               % (epoch, step, loss.item()))\n        print(msg)")


def test_magics_shell_escapes_and_percent_continuation_lines(run, tmp_path):
    """A ``%`` that continues an expression is Python, in a cell of plain Python and next to magics;
    magics, shell escapes (continued with a backslash too), assignments from them and help
    queries come back as they were."""
    assert "\n               % (epoch" in LOOP_PERCENT
    path = tmp_path / "magics.ipynb"
    _notebook(path, [
        new_code_cell("!pip install lightning \\\n    torchmetrics"),
        new_code_cell("%matplotlib inline\n" + HEAD.strip()),
        new_code_cell("# Training loop\n%env CUBLAS_WORKSPACE_CONFIG=:4096:8\n" + LOOP_PERCENT),
        new_code_cell("msg = ('loss %.3f'\n% loss.item())\nprint(msg)"),  # the cell: plain Python
        new_code_cell("files = !ls\nmodel?\nfor name in files:\n    !echo {name}\nprint(len(files))"),
    ])
    before = nbformat.read(str(path), as_version=4)
    result = run("magics.ipynb", "--write")
    assert result.exit_code == 0, result.stderr
    after = nbformat.read(str(path), as_version=4)
    assert after.cells[0] == before.cells[0]  # the install cell: untouched
    setup, loop, last, shell = (after.cells[i].source for i in (1, 2, 3, 4))
    assert setup.startswith("%matplotlib inline\nimport torch\n") and "fabric.setup(model, optimizer)" in setup
    assert loop.startswith("# Training loop\n%env CUBLAS_WORKSPACE_CONFIG=:4096:8\n")
    assert "msg = ('epoch %d step %d loss %.4f'\n               % (epoch, step, loss.item()))\n" \
           "        fabric.print(msg)" in loop
    assert "fabric.backward(loss)" in loop
    assert last == "msg = ('loss %.3f'\n% loss.item())\nfabric.print(msg)"
    assert shell == "files = !ls\nmodel?\nfor name in files:\n    !echo {name}\nfabric.print(len(files))"
    again = run("magics.ipynb", "--check")
    assert again.exit_code == 0, again.stdout


def test_imports_go_below_the_leading_magics_to_the_first_python_cell(run, tmp_path):
    path = tmp_path / "imports.ipynb"
    _notebook(path, [
        new_code_cell("!pip install lightning"),
        new_code_cell("%matplotlib inline\n%config InlineBackend.figure_format = 'retina'\n\nSEED = 0"),
        new_code_cell(HEAD.strip()),
        new_code_cell(LOOP.strip()),
    ])
    result = run("imports.ipynb", "--write")
    assert result.exit_code == 0, result.stderr
    cells = [c.source for c in nbformat.read(str(path), as_version=4).cells]
    assert cells[0] == "!pip install lightning"
    assert cells[1] == ("%matplotlib inline\n%config InlineBackend.figure_format = 'retina'\n\n"
                        "from lightning.fabric import Fabric\n\nSEED = 0")
    assert "import Fabric" not in cells[2] and "fabric = Fabric(devices=1)" in cells[2]


@pytest.mark.parametrize("cell,says", [
    ("x = 1\nmsg = ('loss %.3f'\nprint(msg)", "bad.ipynb:cell 3:line 2: syntax error: '(' was never closed"),
    ("%matplotlib inline\n!ls \\\n  -l\ndef f(:\n    pass",  # after a magic of two lines
     "bad.ipynb:cell 3:line 4: syntax error: invalid syntax"),
])
def test_a_syntax_error_names_the_cell_and_its_line(run, tmp_path, cell, says):
    path = tmp_path / "bad.ipynb"
    _notebook(path, [new_markdown_cell("# title"), new_code_cell("import torch"), new_code_cell(cell)])
    before = path.read_bytes()
    result = run("bad.ipynb", "--write")
    assert result.exit_code == 2
    assert [line for line in result.stderr.splitlines() if line.startswith("error: ")] == [f"error: {says}"]
    assert path.read_bytes() == before


def test_masking_and_putting_back(monkeypatch):
    """The program the engine sees, its line map, and the way back (no rewrite engine)."""
    from accelerate_rewrite.codemod.files import notebook

    nb = new_notebook(cells=[
        new_code_cell(""),
        new_code_cell("# set-up\n!pip install a \\\n  b\n%load_ext autoreload"),
        new_code_cell("%autoreload 2\n\nx = 1\ny = %time f()\nz = ('%d'\n  % x)\nx?"),
        new_code_cell("%%time\nx = 2"),
        new_code_cell("print(x)"),
    ])
    text = nbformat.writes(nb)
    program = notebook.read(text, "n.ipynb")
    assert program.cells == [2, 4]  # cells 1 and 2: the leading block; cell 4: a cell magic
    assert program.prefix == "%autoreload 2\n\n"
    magic = notebook.MAGIC
    assert program.text == (f"x = 1\ny = {magic}(3)\nz = ('%d'\n  % x)\n{magic}(4)\n"
                            f"{notebook.CELL}(2)\nprint(x)\n{notebook.CELL}(4)\n")
    assert program.magics == ["!pip install a \\\n  b", "%load_ext autoreload", "%autoreload 2", "%time f()", "x?"]
    assert [program.where(n) for n in (1, 2, 6, 7)] == \
        ["cell 3:line 3", "cell 3:line 4", "cell 3:line 8", "cell 5:line 1"]  # line 6: cell 3's marker
    assert notebook.locate("n.ipynb:7:1: syntax error: x", program, "n.ipynb") == \
        "n.ipynb:cell 5:line 1: syntax error: x"
    assert notebook.relocate("on lines 1, 2, 7 (line 3 of the result)", program) == \
        "on cell 3:lines 3, 4, cell 5:line 1 (line 3 of the result)"
    # unchanged: nothing changes; an edit comes back with the magics as they were
    assert notebook.write_back(program, program.text, "n.ipynb")[1] == {}
    nb2, changed = notebook.write_back(program, program.text.replace("print(x)", "fabric.print(x)")
                                       .replace("x = 1", "x = 10"), "n.ipynb")
    assert changed == {2: "%autoreload 2\n\nx = 10\ny = %time f()\nz = ('%d'\n  % x)\nx?",
                       4: "fabric.print(x)"}
    assert [c.source for c in nb2.cells][:2] == ["", "# set-up\n!pip install a \\\n  b\n%load_ext autoreload"]
    # a rewrite that dropped a magic is refused
    with pytest.raises(notebook.NotebookError, match="move or drop an IPython magic"):
        notebook.write_back(program, program.text.replace(f"{magic}(4)\n", ""), "n.ipynb")


# ---- the notebooks extra -------------------------------------------------------------------------

def test_a_plain_python_notebook_needs_no_ipython_import(monkeypatch, run, notebook, tmp_path):
    """IPython is imported for a cell with IPython syntax only."""
    plain = tmp_path / "plain.ipynb"
    _notebook(plain, [new_code_cell(HEAD.strip()), new_code_cell(LOOP.strip())])
    monkeypatch.setitem(sys.modules, "IPython.core.inputtransformer2", None)  # an import would fail
    result = run("plain.ipynb")
    assert result.exit_code == 0, result.stderr
    assert "--- plain.ipynb (cell 1)" in result.stdout
    result = run("train.ipynb")  # it has magics
    assert result.exit_code == 2
    assert "error: notebooks need the notebooks extra (IPython is not installed): " \
           "pip install 'accelerate-rewrite[notebooks]'" in result.stderr


@pytest.mark.parametrize("missing", ["nbformat", "IPython"])
def test_without_the_extra_a_notebook_is_a_one_line_error_naming_it(monkeypatch, run, notebook, tmp_path,
                                                                    missing):
    shutil.copyfile(notebook, tmp_path / "other.ipynb")
    (tmp_path / "train.py").write_text(SCRIPT)
    monkeypatch.setitem(sys.modules, missing, None)  # as if not installed: import and find_spec fail
    result = run("train.ipynb", "other.ipynb", "train.py")
    assert result.exit_code == 2
    errors = [line for line in result.stderr.splitlines() if line.startswith("error: ")]
    assert errors == [f"error: notebooks need the notebooks extra ({missing} is not installed): "
                      "pip install 'accelerate-rewrite[notebooks]'"]  # said once
    assert "--- train.py" in result.stdout  # the script is still rewritten
    assert result.stderr.strip().splitlines()[-1] == "1 file would be rewritten, 2 errors"


def test_scripts_never_import_nbformat_or_ipython(monkeypatch, run, tmp_path):
    for name in ("nbformat", "IPython", "IPython.core.inputtransformer2"):
        monkeypatch.setitem(sys.modules, name, None)
    (tmp_path / "train.py").write_text(SCRIPT)
    result = run("train.py", "--check")
    assert result.exit_code == 1 and "error" not in result.stderr


def test_a_notebook_on_stdin(notebook, tmp_path, monkeypatch):
    """``accelerate-rewrite - --stdin-filename train.ipynb``: the notebook's new text on stdout (the
    cells' diffs with --diff), the notes by cell on stderr, as for the file."""
    monkeypatch.chdir(tmp_path)
    text = notebook.read_text()
    runner = CliRunner(env={"NO_COLOR": "1"})
    result = runner.invoke(cli, ["-", "--stdin-filename", "train.ipynb"], input=text, catch_exceptions=False)
    assert result.exit_code == 0, result.stderr
    assert "AR106 cell 4:line " in result.stderr
    out = nbformat.reads(result.stdout, as_version=4)
    assert out.cells[1].source.startswith("%matplotlib inline\n") and "fabric.backward(loss)" in out.cells[3].source
    diff = runner.invoke(cli, ["-", "--stdin-filename", "train.ipynb", "--diff"], input=text,
                         catch_exceptions=False)
    assert diff.stdout.startswith("--- train.ipynb (cell 2)\n+++ train.ipynb (cell 2)\n")


def test_a_magic_put_back_where_ipython_reads_it_otherwise_is_refused():
    from accelerate_rewrite.codemod.files import notebook

    program = notebook.read(nbformat.writes(new_notebook(cells=[new_code_cell("x = 1\n%time f()")])), "n.ipynb")
    moved = program.text.replace(f"{notebook.MAGIC}(0)", f"y = ({notebook.MAGIC}(0))")
    with pytest.raises(notebook.NotebookError, match="cell 1: a rewrite would put an IPython magic"):
        notebook.write_back(program, moved, "n.ipynb")


def test_a_suppression_comment_among_the_leading_magics_still_counts(run, tmp_path):
    path = tmp_path / "skip.ipynb"
    _notebook(path, [new_code_cell("%matplotlib inline\n# accelerate-rewrite: skip-file\n!nvidia-smi"),
                     new_code_cell(HEAD.strip()), new_code_cell(LOOP.strip())])
    result = run("skip.ipynb", "--check")
    assert result.exit_code == 0 and "1 file left unchanged" in result.stderr
