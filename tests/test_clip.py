"""AR301 --clip-grad-norm: the option, and where the clip goes on each backend."""

from __future__ import annotations

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.options import OptionError, Options
from tests.goldens import FIXTURES, run


@pytest.mark.parametrize("value", ["0", "-1", "abc", "inf"])
def test_a_clip_norm_must_be_a_positive_number(value):
    with pytest.raises(OptionError, match="clip-grad-norm"):
        Options.create(clip_grad_norm=value)
    result = CliRunner().invoke(cli, [str(FIXTURES / "gan" / "input.py"), "--clip-grad-norm", value])
    assert result.exit_code == 2 and "invalid clip-grad-norm" in result.stderr


def test_small_limits_are_written_as_written():
    assert Options.create(clip_grad_norm="1e-3").clip_grad_norm == 0.001


def test_each_optimizer_clips_the_model_it_trains():
    out = run("gan", "clip-1.0").output
    assert "fabric.clip_gradients(netD, optimizerD, max_norm=1.0, error_if_nonfinite=False)" in out
    assert "fabric.clip_gradients(netG, optimizerG, max_norm=1.0, error_if_nonfinite=False)" in out


def test_an_existing_clip_keeps_its_limit_and_a_closure_is_not_clipped():
    existing = run("accelerator_api", "clip-1.0")
    assert any(n.rule == "AR301" and "already preceded by a clip" in n.message for n in existing.skips)
    closure = run("lbfgs", "clip-1.0")
    assert any(n.rule == "AR301" and "closure" in n.message for n in closure.skips)


def test_under_the_native_grad_scaler_the_clip_sees_unscaled_gradients():
    out = run("train_function", "torch-16-mixed-clip-1.0").output
    assert ("        scaler.unscale_(optimizer)\n"
            "        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
            "        scaler.step(optimizer)\n") in out
