"""AR303 --freeze PATTERN: the option, where the freeze goes, the optimizers it filters, what it
refuses; and, with torch, what the frozen training really does (on CPU)."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options, freeze_form
from accelerate_rewrite.rules.techniques.freeze import helper_code
from tests.goldens import FIXTURES, FREEZE_FORMS, run

HEAD = """\
import torch

model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
"""
LOOP = """\
for x, y in [(torch.randn(8, 4), torch.randn(8, 1))]:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
"""


def _rewrite(middle: str, head: str = HEAD, freeze=("0",), **options):
    options = {"backend": "torch", "freeze": freeze, **options}
    result = rewrite(head + textwrap.dedent(middle) + LOOP, Options.create(**options))
    ast.parse(result.output)
    assert rewrite(result.output, Options.create(**options)).output == result.output, "not idempotent"
    return result


def _notes(result, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == "AR303" and n.skipped == skipped)


@pytest.mark.parametrize("pattern,form", [
    ("embeddings", "path"), ("encoder.layer.0", "path"), ("0", "path"),
    ("encoder.layer[:2]", "slice"), ("encoder.layer[-2:]", "slice"),
    ("encoder.layer.[01].*", "glob"), ("*.bias", "glob"),
])
def test_the_three_forms(pattern, form):
    assert freeze_form(pattern) == form


@pytest.mark.parametrize("pattern", ["", "a b", "encoder/layer", "a..b", "[", "encoder.[01.*", "a.[].x"])
def test_a_malformed_pattern_is_an_option_error(pattern):
    with pytest.raises(OptionError, match="invalid freeze pattern"):
        Options.create(freeze=pattern)
    result = CliRunner().invoke(cli, [str(FIXTURES / "module_loop" / "input.py"), "--freeze", pattern])
    assert result.exit_code == 2 and "invalid freeze pattern" in result.stderr


@pytest.mark.parametrize("forms", [{"path"}, {"glob"}, {"slice"}, {"path", "slice"}, {"glob", "slice"},
                                   {"path", "glob", "slice"}])
def test_the_helper_has_the_branches_in_use_only(forms):
    code = helper_code(forms)
    ast.parse(code)
    assert ("fnmatch" in code) == ("glob" in forms)
    assert ("get_submodule" in code) == ("slice" in forms)


def test_frozen_right_after_the_model_is_built_and_the_optimizer_filtered():
    result = _rewrite("optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)\n")
    out = result.output
    assert "model = torch.nn.Sequential(" in out
    assert out.index('freeze_parameters(model, ["0"])') < out.index("optimizer = ")
    assert "torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)" in out
    assert out.count("def freeze_parameters(") == 1
    assert "import fnmatch" not in out  # no glob: no fnmatch


def test_parameter_groups_are_filtered_group_by_group():
    result = _rewrite("""\
        groups = [{"params": model[0].parameters(), "lr": 1e-2}, {"params": model[2].parameters()}]
        optimizer = torch.optim.SGD(groups, lr=1e-3, momentum=0.9)
        """)
    assert ('groups = [{"params": [p for p in model[0].parameters() if p.requires_grad], "lr": 1e-2}, '
            '{"params": [p for p in model[2].parameters() if p.requires_grad]}]') in result.output
    assert "each of its parameter groups" in _notes(result, False)


def test_a_comprehension_gets_the_condition_added():
    out = run("finetune_encoder", "freeze-forms").output
    assert ('[p for n, p in model.named_parameters() if not n.endswith(no_decay) and p.requires_grad]'
            in out)
    assert 'freeze_parameters(model, ["embeddings", "encoder.layer[:2]", "classifier.*"])' in out
    assert out.index("freeze_parameters(model, [") < out.index("fabric.setup(model, optimizer)")


def test_a_model_from_a_factory_is_frozen_where_it_is_returned():
    """The trainer_class fixture builds its model in a factory and hands it to a Trainer."""
    out = run("trainer_class", "torch-freeze-forms").output
    assert ('    model = build_model()\n'
            '    freeze_parameters(model, ["embeddings", "encoder.layer[:2]", "classifier.*"])\n') in out


def test_several_models_need_the_models_name():
    result = run("gan", "freeze-forms")
    assert not result.changes or all(n.rule != "AR303" for n in result.changes)
    assert "start the pattern with one of their names" in _notes(result, True)
    named = rewrite((FIXTURES / "gan" / "input.py").read_text(), Options.create(freeze="netD.main.0"))
    assert 'freeze_parameters(netD, ["main.0"])' in named.output


def test_what_it_leaves_alone():
    wrapped = _rewrite("optimizer = torch.optim.Adam(model.parameters())\n",
                       head="import torch\n\nmodel = torch.nn.DataParallel(torch.nn.Linear(4, 1))\n")
    assert not wrapped.changed and "wraps the model as it builds it" in _notes(wrapped, True)
    named = _rewrite("params = list(model.parameters())\noptimizer = torch.optim.Adam(params)\n")
    assert "takes `params`: its frozen parameters stay in it" in _notes(named, True)
    assert "freeze_parameters(model" in named.output
    filtered = _rewrite("optimizer = torch.optim.Adam(filter(lambda p: p.requires_grad, model.parameters()))\n")
    assert "already takes the trainable parameters only" in _notes(filtered, True)
    assert "already uses Lightning Fabric" in _notes(run("already_fabric", "freeze-forms"), True)


# ---- what the frozen training does (torch, CPU) ----------------------------------------------------

torch_runs = pytest.mark.runs


def _run(script: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=300, cwd=script.parent, env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""})


@torch_runs
@pytest.mark.parametrize("backend", ["fabric", pytest.param("torch", marks=pytest.mark.slow)])  # (CI time)
def test_frozen_parameters_do_not_move_and_the_others_do(backend, tmp_path):
    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    source = (FIXTURES / "finetune_encoder" / "input.py").read_text()
    original, frozen = tmp_path / "original.py", tmp_path / "frozen.py"
    original.write_text(source)
    frozen.write_text(rewrite(source, Options.create(backend=backend, freeze=FREEZE_FORMS)).output)
    done = _run(original, "--epochs", "0", "--output", "init.pt")
    assert done.returncode == 0, done.stderr
    done = _run(frozen, "--epochs", "1", "--output", "final.pt")
    assert done.returncode == 0, done.stderr
    init = torch.load(tmp_path / "init.pt")
    final = torch.load(tmp_path / "final.pt")
    assert init.keys() == final.keys()
    still = {k for k in init if torch.equal(init[k], final[k])}
    expected = {k for k in init if k.startswith(("embeddings.", "encoder.layer.0.", "encoder.layer.1.",
                                                 "classifier."))}
    assert still == expected, sorted(still ^ expected)


@torch_runs
def test_a_pattern_that_matches_nothing_fails_naming_it(tmp_path):
    pytest.importorskip("torch")
    source = (FIXTURES / "finetune_encoder" / "input.py").read_text()
    script = tmp_path / "frozen.py"
    script.write_text(rewrite(source, Options.create(backend="torch",
                                                     freeze=("embeddings", "encoder.layers[:2]"))).output)
    done = _run(script, "--epochs", "1")
    assert done.returncode != 0
    assert ("ValueError: --freeze 'encoder.layers[:2]' matches no parameter of Classifier; its modules "
            "include: embeddings, encoder, encoder.layer, encoder.layer.0") in done.stderr
