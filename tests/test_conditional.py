"""Issue 14.4: an optimizer built only under ``if args.use_optimizer:`` (a plain SGD update by
hand otherwise), a model built in an if/else: the rewrite sets the model up with the optimizer
on one path and alone on the other, keeps torch's clipping where the optimizer is not certain,
and trains as the original did on both paths (32-true: the same losses, digit for digit). A
model built in a ``try`` and an optimizer in an ``if/elif/else`` chain convert too; a chain that
leaves the optimizer unbound on some path is refused with the reason."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from accelerate_rewrite.api import rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402
from tests.goldens import FIXTURES  # noqa: E402

pytestmark = pytest.mark.runs


@pytest.fixture(scope="module")
def scripts(tmp_path_factory):
    root = tmp_path_factory.mktemp("conditional")
    source = (FIXTURES / "conditional_optimizer" / "input.py").read_text(encoding="utf-8")
    result = rewrite(source, Options.create(), path="fixtures/conditional_optimizer/input.py")
    assert result.changed and not result.dropped
    (root / "original.py").write_text(source, encoding="utf-8")
    (root / "rewritten.py").write_text(result.output, encoding="utf-8")
    return root, result.output


def test_the_model_is_set_up_on_both_paths(scripts):
    _, output = scripts
    assert ("    model, optimizer = fabric.setup(model, optimizer)\nelse:\n    model = fabric.setup(model)\n"
            in output)
    assert "torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)" in output  # not certain: kept


@pytest.mark.parametrize("args", [pytest.param([], marks=pytest.mark.slow, id="by-hand"),
                                  pytest.param(["--use-optimizer", "--arch", "mlp"], id="optimizer")])
def test_both_paths_train_as_before(scripts, args):
    root, _ = scripts
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    runs = [subprocess.run([sys.executable, str(root / name), "--epochs", "1", *args], cwd=root, env=env,
                           capture_output=True, text=True, timeout=300) for name in ("original.py", "rewritten.py")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout.count("loss") == 8
    assert runs[1].stdout == runs[0].stdout


_BUILT_IN_A_TRY = '''import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def main(name="adam"):
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    loader = DataLoader(data, batch_size=16, shuffle=True)
    try:
        model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    except RuntimeError as exc:
        print(f"could not build the model: {exc}")
        raise
    if name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=1e-2)
    elif name == "adam":
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    else:
        raise ValueError(name)
    for epoch in range(2):
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            loss = nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
            print(f"epoch {epoch} loss {loss.item():.8f}")


if __name__ == "__main__":
    main()
'''


def _built_in_a_try():
    result = rewrite(_BUILT_IN_A_TRY, Options.create(), path="train.py")
    assert result.changed and not result.dropped, result.dropped
    assert ('    else:\n        raise ValueError(name)\n    model, optimizer = fabric.setup(model, optimizer)\n'
            in result.output)
    return result


def test_a_model_built_in_a_try_and_an_optimizer_in_an_elif_chain_convert():
    """Set-up after a ``try`` that builds the model and an ``if/elif/else`` that binds the optimizer
    on every path that goes on (the flow check proves both bound)."""
    _built_in_a_try()


@pytest.mark.slow  # CI time: test_both_paths_train_as_before runs a conditional set-up both ways
def test_a_model_built_in_a_try_and_an_optimizer_in_an_elif_chain_train_as_before(tmp_path):
    """That rewrite: the same losses at 32-true."""
    result = _built_in_a_try()
    (tmp_path / "original.py").write_text(_BUILT_IN_A_TRY, encoding="utf-8")
    (tmp_path / "rewritten.py").write_text(result.output, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    runs = [subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True,
                           timeout=300) for name in ("original.py", "rewritten.py")]
    for run in runs:
        assert run.returncode == 0, run.stderr[-2000:]
    assert runs[0].stdout.count("loss") == 8 and runs[1].stdout == runs[0].stdout


def test_an_optimizer_left_unbound_by_an_elif_chain_is_refused_with_the_reason():
    """The script's own reads of ``optimizer`` after the chain are in a loop, which may not run:
    where the chain binds nothing, the script may never fail, so a set-up there is refused
    (tests/test_research_code.py: where the script reads it on every path, it converts)."""
    source = _BUILT_IN_A_TRY.replace('    else:\n        raise ValueError(name)\n', '')
    result = rewrite(source, Options.create(), path="train.py")
    assert not result.changed
    assert any("reads `optimizer`" in d and "where some path leaves it unbound" in d for d in result.dropped), \
        result.dropped
