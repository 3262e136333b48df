"""AR202 (unscale before clipping) and AR203 (one GradScaler per run), on their own."""

from __future__ import annotations

import ast
import textwrap

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.precision.amp_scaler_once import ScalerOnce
from accelerate_rewrite.rules.precision.amp_unscale_before_clip import UnscaleBeforeClip

RULES = [UnscaleBeforeClip(), ScalerOnce()]


def fix(source: str):
    result = rewrite(textwrap.dedent(source), Options(), rules=RULES)
    ast.parse(result.output)
    assert rewrite(result.output, Options(), rules=RULES).output == result.output
    return result


def test_an_existing_unscale_is_not_added_twice():
    result = fix("""\
        import torch
        scaler = torch.amp.GradScaler()
        for x in range(3):
            scaler.scale(loss).backward()
            scaler.unscale_(optimizer)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            scaler.step(optimizer)
            scaler.update()
    """)
    assert not result.changed


def test_clip_without_a_scaler_step_after_it_is_left_with_a_reason():
    result = fix("""\
        import torch
        scaler = torch.amp.GradScaler()
        def step():
            scaler.scale(loss).backward()
            torch.nn.utils.clip_grad_value_(params, 0.5)
        def finish():
            scaler.step(optimizer)
    """)
    assert not result.changed
    assert result.skips and "no scaler.step" in result.skips[0].message


def test_a_script_without_grad_scaler_is_not_touched():
    result = fix("""\
        import torch
        for x in range(3):
            loss.backward()
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            optimizer.step()
    """)
    assert not result.changed and not result.notes


def test_scaler_using_the_loop_variable_stays_with_a_reason():
    result = fix("""\
        import torch
        for epoch in range(3):
            scaler = torch.amp.GradScaler(init_scale=2.0 ** (16 - epoch))
            scaler.scale(loss).backward()
    """)
    assert not result.changed
    assert "`epoch`" in result.skips[0].message


def test_scaler_in_nested_loops_goes_before_the_outermost():
    result = fix("""\
        import torch
        def train():
            for epoch in range(3):
                for x in loader:
                    scaler = torch.amp.GradScaler()  # made per batch
                    scaler.scale(loss).backward()
    """)
    lines = result.output.splitlines()
    assert lines[2].strip() == "scaler = torch.amp.GradScaler()  # made per batch"
    assert lines[3].strip().startswith("for epoch")
