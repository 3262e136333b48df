"""AR302 --accumulate N (and --keep-effective-batch): the options, the rewrite in each loop
shape, what it recognises and refuses. Training runs are in test_verify.py."""

from __future__ import annotations

import ast
import textwrap

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.api import rewrite
from accelerate_rewrite.codemod.rule import Kind
from accelerate_rewrite.options import OptionError, Options
from tests.goldens import FIXTURES, run

HEAD = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
{loader}
"""
LOADER = "loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16)"


def _rewrite(loop: str, loader: str = LOADER, **options):
    options = {"backend": "torch", "accumulate": 4, **options}
    source = HEAD.format(loader=loader) + textwrap.dedent(loop)
    result = rewrite(source, Options.create(**options))
    ast.parse(result.output)
    again = rewrite(result.output, Options.create(**options))
    assert again.output == result.output, "not idempotent"
    return result


def _notes(result, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == "AR302" and n.skipped == skipped)


@pytest.mark.parametrize("value", ["1", "0", "-2", "two"])
def test_accumulate_is_a_whole_number_of_at_least_two(value):
    with pytest.raises(OptionError, match="accumulate"):
        Options.create(accumulate=value)
    result = CliRunner().invoke(cli, [str(FIXTURES / "module_loop" / "input.py"), "--accumulate", value])
    assert result.exit_code == 2 and "invalid accumulate" in result.stderr


def test_keep_effective_batch_needs_accumulate():
    with pytest.raises(OptionError, match="--keep-effective-batch needs --accumulate"):
        Options.create(keep_effective_batch=True)


def test_a_loop_without_a_counter_gets_one_and_zero_grad_runs_at_group_starts():
    result = _rewrite("""\
        for x, y in loader:
            optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
        """)
    assert textwrap.dedent("""\
        for batch_idx, (x, y) in enumerate(loader):
            is_accumulating = (batch_idx + 1) % 4 != 0 and batch_idx + 1 != len(loader)
            if batch_idx % 4 == 0:
                optimizer.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            (loss / min(4, len(loader) - batch_idx // 4 * 4)).backward()
            if not is_accumulating:
                optimizer.step()
        """) in result.output
    assert "effective batch is 4 times larger (16 -> 64 samples)" in _notes(result, False)
    assert result.changes[0].kind is Kind.CHANGES_TRAINING


def test_enumerate_start_and_an_underscore_counter():
    one = _rewrite("""\
        for i, (x, y) in enumerate(loader, 1):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        """)
    assert "is_accumulating = i % 4 != 0 and i != len(loader)" in one.output
    assert ("    if not is_accumulating:\n        optimizer.step()\n        optimizer.zero_grad()\n"
            in one.output)
    under = _rewrite("""\
        for _, (x, y) in enumerate(loader):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        """)
    assert "for batch_idx, (x, y) in enumerate(loader):" in under.output
    assert "(torch.nn.functional.mse_loss(model(x), y) / min(4, len(loader) - batch_idx // 4 * 4)).backward()" in under.output


def test_logging_between_step_and_scheduler_keeps_running_every_batch():
    result = _rewrite("""\
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=10)
        for step, (x, y) in enumerate(loader):
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
            print(loss.item())
            scheduler.step()
            optimizer.zero_grad()
        """)
    assert ("    if not is_accumulating:\n        optimizer.step()\n    print(loss.item())\n"
            "    if not is_accumulating:\n        scheduler.step()\n        optimizer.zero_grad()\n"
            in result.output)
    assert "`scheduler.step()` now runs once per optimizer step" in _notes(result, False)


def test_a_break_is_said_out_loud():
    result = _rewrite("""\
        for step, (x, y) in enumerate(loader):
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
            if step == 10:
                break
        """)
    assert "can `break` (line" in _notes(result, False)


@pytest.mark.parametrize("loader,size,after,kind", [
    (LOADER, "16 -> 4", "batch_size=4)", Kind.APPROXIMATE),
    ("BATCH = 32\n" + LOADER.replace("=16", "=BATCH"), "32 -> 8", "batch_size=BATCH // 4)", Kind.APPROXIMATE),
])
def test_keep_effective_batch_divides_a_known_batch_size(loader, size, after, kind):
    result = _rewrite("""\
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        """, loader=loader, keep_effective_batch=True)
    assert after in result.output
    assert f"batch_size {size} keeps the effective batch" in _notes(result, False)
    assert result.changes[0].kind is kind


@pytest.mark.parametrize("loader,why", [
    (LOADER.replace("=16", "=args_batch_size()"), "can't be resolved statically"),
    (LOADER.replace("=16", "=10"), "batch_size 10 is not divisible by 4"),
    (LOADER.replace(", batch_size=16", ""), "not given in the DataLoader(...) call"),
])
def test_keep_effective_batch_does_not_guess(loader, why):
    result = _rewrite("""\
        for x, y in loader:
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        """, loader="def args_batch_size():\n    return 16\n" + loader, keep_effective_batch=True)
    assert why in _notes(result, False)
    assert result.changes[0].kind is Kind.CHANGES_TRAINING


@pytest.mark.parametrize("loop,found", [
    ("""\
        for i, (x, y) in enumerate(loader):
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
            if (i + 1) % 2 == 0:
                optimizer.step()
                optimizer.zero_grad()
        """, "runs under `if (i + 1) % 2 == 0:`"),
    ("""\
        batches = iter(loader)
        for it in range(10):
            for micro_step in range(4):
                x, y = next(batches)
                (torch.nn.functional.mse_loss(model(x), y) / 4).backward()
            optimizer.step()
            optimizer.zero_grad()
        """, "the backward runs in an inner loop"),
    ("""\
        for i, (x, y) in enumerate(loader):
            model.require_backward_grad_sync = i % 4 == 3
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        """, "`require_backward_grad_sync`"),
])
def test_a_script_that_already_accumulates_is_not_accumulated_twice(loop, found):
    result = _rewrite(loop)
    assert not result.changed
    assert "already accumulates gradients" in _notes(result, True) and found in _notes(result, True)
    assert "not accumulated twice" in _notes(result, True)


def test_loops_it_refuses_say_why():
    ranged = _rewrite("""\
        batches = iter(loader)
        for it in range(10):
            x, y = next(batches)
            torch.nn.functional.mse_loss(model(x), y).backward()
            optimizer.step()
        """)
    assert not ranged.changed and "not over a DataLoader" in _notes(ranged, True)
    assert "steps 2 optimizers" in _notes(run("gan", "accumulate-4"), True)
    assert "closure" in _notes(run("lbfgs", "accumulate-4"), True)


def test_fabric_syncs_only_at_the_boundary_unless_one_device():
    several = run("module_loop", "accumulate-4-keep-devices-2").output
    assert ("        with fabric.no_backward_sync(model, enabled=is_accumulating):\n"
            "            output = model(x)\n"
            "            loss = criterion(output, y)\n"
            "            fabric.backward(loss / min(4, len(loader) - step // 4 * 4))\n") in several
    assert "batch_size=batch_size // 4" in several
    one = rewrite((FIXTURES / "module_loop" / "input.py").read_text(),
                  Options.create(accumulate=4, devices=1)).output
    assert "no_backward_sync" not in one and "fabric.backward(loss / min(4, len(loader) - step // 4 * 4))" in one


def test_native_16_mixed_scales_the_divided_loss_and_clips_at_the_boundary():
    out = run("train_function", "torch-16-mixed-accumulate-4-clip-1.0").output
    assert "scaler.scale(loss / min(4, len(loader) - batch_idx // 4 * 4)).backward()" in out
    assert ("        if not is_accumulating:\n"
            "            scaler.unscale_(optimizer)\n"
            "            torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0)\n"
            "            scaler.step(optimizer)\n"
            "            scaler.update()\n") in out


def test_the_scripts_own_scaler_and_apex_get_the_loss_divided_inside():
    assert "fabric.backward(scaler.scale(loss / min(4, len(loader) - step // 4 * 4)))" in run("cuda_amp", "accumulate-4").output
    assert "fabric.backward(loss / min(4, len(loader) - step // 4 * 4))" in run("apex_o1", "accumulate-4").output
    torch_apex = rewrite((FIXTURES / "apex_o1" / "input.py").read_text(),
                         Options.create(backend="torch", accumulate=4)).output
    assert "scaler.scale(loss / min(4, len(loader) - step // 4 * 4)).backward()" in torch_apex


def test_a_per_step_schedule_sized_by_the_loader_is_reported():
    result = run("finetune_encoder", "torch-bf16-mixed-accumulate-4-keep")
    notes = _notes(result, False)
    assert "batch_size 32 -> 8" in notes and "`len(train_loader)` (line" in notes
    assert result.changes[[n.rule for n in result.changes].index("AR302")].kind is Kind.CHANGES_TRAINING


def test_the_last_partial_group_of_an_epoch_is_divided_by_its_own_size():
    """An epoch of one batch with --accumulate 2: its only micro-batch is a group of one, stepped
    with its whole gradient (not half of it): the weights follow the original's exactly."""
    import torch

    source = HEAD.format(loader="loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), "
                                "batch_size=16)") + textwrap.dedent("""\
        for epoch in range(3):
            for x, y in loader:
                optimizer.zero_grad()
                torch.nn.functional.mse_loss(model(x), y).backward()
                optimizer.step()
        """)
    rewritten = rewrite(source, Options.create(backend="torch", accumulate=2)).output
    assert "/ min(2, len(loader) - batch_idx // 2 * 2)).backward()" in rewritten
    weights = []
    for code in (source, rewritten):
        torch.manual_seed(0)
        scope: dict = {}
        exec(compile(code, "<train>", "exec"), scope)
        weights.append(scope["model"].weight.detach().clone())
    assert torch.equal(weights[0], weights[1])
