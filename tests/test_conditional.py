"""Issue 14.4: an optimizer built only under ``if args.use_optimizer:`` (a plain SGD update by
hand otherwise), a model built in an if/else: the rewrite sets the model up with the optimizer
on one path and alone on the other, keeps torch's clipping where the optimizer is not certain,
and trains as the original did on both paths (32-true: the same losses, digit for digit)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from accelerate_rewrite.codemod.engine import rewrite  # noqa: E402
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
