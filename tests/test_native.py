"""--backend torch (AR207, AR208, AR210), pure half (AR209, AR206, AR212) and apex (AR211), on
small scripts: what is written, and what is left alone with which reason."""

from __future__ import annotations

import ast
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options

HEAD = """\
import torch
import torch.nn.functional as F
"""


def native(source: str, precision: str = "16-mixed", **options):
    options = Options.create(backend="torch", precision=precision, **options)
    result = rewrite(HEAD + textwrap.dedent(source), options)
    ast.parse(result.output)
    assert not result.dropped, result.dropped
    assert rewrite(result.output, options).output == result.output  # idempotent
    return result


def reasons(result, rule="AR207") -> str:
    return " ".join(n.message for n in result.skips if n.rule == rule)


LOOP = """\
device = {device}
model = torch.nn.Linear(4, 2){move}
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for x, y in [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]:
    # the forward pass
    out = model(x)
    loss = F.cross_entropy(out, y)
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize("device,move,expected", [
    ('torch.device("cuda" if torch.cuda.is_available() else "cpu")', ".to(device)", "device.type"),
    ('"cuda" if torch.cuda.is_available() else "cpu"', ".to(device)", "torch.device(device).type"),
    ('None', ".cuda()", '"cuda"'),
    ('None', "", '"cpu"'),
])
def test_the_device_type_is_the_scripts_own(device, move, expected):
    result = native(LOOP.format(device=device, move=move))
    assert f"torch.autocast(device_type={expected}, dtype=torch.float16)" in result.output
    assert f"scaler = torch.amp.GradScaler({expected})" in result.output


def test_autocast_takes_the_comments_above_the_forward_pass_and_leaves_backward_outside():
    out = native(LOOP.format(device='"cpu"', move=".to(device)"), "bf16-mixed").output
    assert "    # the forward pass\n    with torch.autocast(" in out
    block = out.split("with torch.autocast(", 1)[1]
    assert block.index("loss = F.cross_entropy") < block.index("loss.backward()")
    assert "\n    loss.backward()" in block and "GradScaler" not in out  # bf16: no scaler


def test_a_scaler_threads_into_a_function_with_defaults_as_keyword_only():
    result = native("""\
        def train(model, optimizer, x, y, device, steps=2):
            for _ in range(steps):
                loss = F.cross_entropy(model(x.to(device)), y.to(device))
                loss.backward()
                optimizer.step()

        def main():
            device = torch.device("cpu")
            model = torch.nn.Linear(4, 2).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            train(model, optimizer, torch.randn(8, 4), torch.randint(0, 2, (8,)), device)
        """)
    assert "def train(model, optimizer, x, y, device, steps=2, *, scaler):" in result.output
    assert "device, scaler=scaler)" in result.output
    assert "scaler.step(optimizer)\n        scaler.update()" in result.output


def test_an_evaluation_loop_gets_autocast_but_a_loop_calling_the_training_function_does_not():
    result = native("""\
        def train_step(model, optimizer, x, y):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()

        device = torch.device("cpu")
        model = torch.nn.Linear(4, 2).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]
        for x, y in data:
            train_step(model, optimizer, x, y)
        with torch.no_grad():
            for x, y in data:
                correct = (model(x).argmax(1) == y).sum()
                print(correct)
        """, "bf16-mixed")
    out = result.output
    assert out.count("with torch.autocast(") == 2  # train_step's forward and the evaluation
    assert "    train_step(model, optimizer, x, y)" in out
    assert "with torch.no_grad():\n    for x, y in data:\n        with torch.autocast(" in out


def test_bce_under_the_autocast_it_would_add_is_refused():
    result = native("""\
        model = torch.nn.Sequential(torch.nn.Linear(4, 1), torch.nn.Sigmoid())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        criterion = torch.nn.BCELoss()
        x, y = torch.randn(8, 4), torch.rand(8, 1)
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        """)
    assert not result.changed
    assert "unsafe to autocast" in reasons(result) and "BCEWithLogitsLoss" in reasons(result)


def test_forward_and_backward_in_one_statement_is_refused():
    result = native("""\
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,))).backward()
        optimizer.step()
        """)
    assert not result.changed and "one statement" in reasons(result)


def test_fabric_options_need_the_fabric_backend():
    with pytest.raises(OptionError, match="--devices needs --backend fabric"):
        Options.create(backend="torch", devices=2)
    with pytest.raises(OptionError, match="valid values: fabric, torch"):
        Options.create(backend="jax")


def test_native_true_half_casts_the_model_and_fixes_rmsprop_eps_given_by_position():
    result = native("""\
        model = torch.nn.Linear(4, 2)
        optimizer = torch.optim.RMSprop(model.parameters(), 0.01, 0.99, 1e-8)
        loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
        loss.backward()
        optimizer.step()
        """, "16-true")
    out = result.output
    assert "model.to(torch.float16)\nmodel.register_forward_pre_hook(" in out
    assert "RMSprop(model.parameters(), 0.01, 0.99, 1e-4)" in out
    assert "GradScaler" not in out and "autocast" not in out


def test_batchnorm_under_true_half_is_reported_not_rewritten():
    result = native("""\
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.BatchNorm1d(4))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(8, 4)).sum()
        loss.backward()
        optimizer.step()
        """, "bf16-true")
    assert "running mean and variance" in reasons(result, "AR212")
    assert "BatchNorm1d(4)" in result.output


APEX = """\
from apex import amp

model = torch.nn.Linear(4, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
model, optimizer = amp.initialize(model, optimizer, opt_level={level})
loss = F.cross_entropy(model(torch.randn(8, 4)), torch.randint(0, 2, (8,)))
with amp.scale_loss(loss, optimizer) as scaled_loss:
    scaled_loss.backward()
optimizer.step()
"""


@pytest.mark.parametrize("level,precision", [('"O0"', None), ('"O1"', "16-mixed"), ('"O3"', "16-true")])
def test_apex_levels_become_precisions(level, precision):
    result = native(APEX.format(level=level), precision=None)
    assert "amp" not in result.output.replace("torch.amp", "")
    if precision == "16-mixed":
        assert "scaler.scale(loss).backward()" in result.output
    else:
        assert "\nloss.backward()" in result.output
    if precision == "16-true":
        assert "model.to(torch.float16)" in result.output


def test_apex_opt_level_from_a_variable_needs_a_precision():
    source = APEX.format(level="args.opt_level").replace("from apex import amp", "from apex import amp\nargs = None")
    for backend in ("torch", "fabric"):
        left = rewrite(HEAD + source, Options.create(backend=backend))
        assert not left.changed
        assert any("give --precision" in n.message for n in left.skips)
    given = rewrite(HEAD + source, Options.create(backend="torch", precision="bf16-mixed"))
    assert "torch.autocast(" in given.output and "amp.initialize" not in given.output


def test_apex_keyword_form_and_an_opt_level_from_a_flag_with_a_default():
    """``amp.initialize(models=..., optimizers=..., opt_level=args.opt_level)`` with
    ``add_argument("--opt-level", default="O1")``: converted at O1, and the note says the flag
    no longer changes the precision."""
    source = APEX.format(level="args.opt_level").replace(
        "amp.initialize(model, optimizer,", "amp.initialize(models=model, optimizers=optimizer,").replace(
        "from apex import amp", "import argparse\nfrom apex import amp\nparser = argparse.ArgumentParser()\n"
        "parser.add_argument('--opt-level', default='O1')\nargs = parser.parse_args()")
    for backend, written in (("torch", "scaler.scale(loss).backward()"), ("fabric", 'precision="16-mixed"')):
        result = rewrite(HEAD + source, Options.create(backend=backend))
        assert written in result.output and "amp.initialize" not in result.output
        [note] = [n for n in result.changes if n.rule == "AR211" and "amp.initialize" in n.message]
        assert "O1, the default of `--opt-level`" in note.message and "no longer changes" in note.message


def test_the_summary_says_what_happens_to_the_numbers(tmp_path):
    from click.testing import CliRunner

    from accelerate_rewrite.cli import cli

    script = tmp_path / "train.py"
    script.write_text(HEAD + LOOP.format(device='"cpu"', move=".to(device)"))
    runner = CliRunner()
    native_run = runner.invoke(cli, [str(script), "--backend", "torch", "--precision", "bf16-mixed"])
    assert "numerics: approximate (AR207)" in native_run.stderr
    fabric_run = runner.invoke(cli, [str(script)])
    assert "numerics: unchanged: the rewrite keeps the math" in fabric_run.stderr


def test_half_after_training_for_a_smaller_checkpoint_is_left_alone():
    source = HEAD + textwrap.dedent("""\
        model = torch.nn.Linear(4, 2).half()
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for x in torch.randn(3, 8, 4):
            loss = model(x.half()).float().pow(2).mean()
            loss.backward()
            optimizer.step()
        model.half()
        torch.save(model.state_dict(), "small.pt")
        """)
    result = rewrite(source, Options.create(backend="torch", precision="bf16-mixed"))
    removed = [n for n in result.changes if n.rule == "AR209"]
    assert [n.line for n in removed] == [3, 6]  # the model's cast before training, the batch's
    assert 'model.half()\ntorch.save(model.state_dict(), "small.pt")' in result.output


def test_the_forward_is_found_from_the_loss_back():
    """Issue 14.6: a model the rewrite can't tell is one (held on a Trainer, built elsewhere)
    still has its forward found: the statements that compute the loss, from the first call."""
    result = native("""
    class Trainer:
        def __init__(self, net, opt, device):
            self.net, self.opt = net, opt
            self.device = device

        def step(self, x, y):
            self.opt.zero_grad()
            out = self.net(x.to(self.device))
            loss = F.mse_loss(out, y.to(self.device))
            loss.backward()
            self.opt.step()


    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = torch.nn.Linear(4, 1)
    trainer = Trainer(model, torch.optim.SGD(model.parameters(), lr=0.1), device)
    """, precision="bf16-mixed")
    assert "dtype=torch.bfloat16):\n            out = self.net(x.to(self.device))\n" \
           "            loss = F.mse_loss(" in result.output
    assert "self.opt.zero_grad()\n        with torch.autocast" in result.output


def test_a_loss_that_comes_from_elsewhere_is_still_refused():
    result = native("""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)

    def step(loss):
        loss.backward()
        optimizer.step()
    """, precision="bf16-mixed")
    assert not result.changed
    assert "neither a model of the script nor a call that computes the loss" in reasons(result)


@pytest.mark.runs
def test_an_inference_helper_with_no_device_in_reach_autocasts_on_its_models_device(tmp_path):
    """Issue 14.6: ``predict(model, loader)`` has no device variable in reach; its region runs on
    the device of the parameters of the model it calls. The rewrite runs, and predicts as the
    original does within bf16's tolerance."""
    import subprocess
    import sys

    source = HEAD + textwrap.dedent("""\
    torch.manual_seed(0)


    @torch.no_grad()
    def predict(model, batches):
        model.eval()
        outputs = []
        for x, _ in batches:
            x = x.to(next(model.parameters()).device)
            logits = model(x)
            outputs.append(logits.argmax(dim=1).cpu())
        return torch.cat(outputs)


    def main():
        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        batches = [(torch.randn(16, 8), torch.randint(0, 2, (16,))) for _ in range(4)]
        model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2)).to(device)
        optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
        for x, y in batches:
            x, y = x.to(device), y.to(device)
            loss = F.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        print(predict(model, batches).float().mean().item())


    main()
    """)
    options = Options.create(backend="torch", precision="bf16-mixed")
    result = rewrite(source, options)
    assert not result.dropped and not reasons(result), (result.dropped, reasons(result))
    assert ("        with torch.autocast(device_type=next(model.parameters()).device.type, dtype=torch.bfloat16):\n"
            "            logits = model(x)\n") in result.output
    assert rewrite(result.output, options).output == result.output
    printed = []
    for name, text in (("original.py", source), ("rewritten.py", result.output)):
        (tmp_path / name).write_text(text, encoding="utf-8")
        run = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        printed.append(float(run.stdout.split()[-1]))
    assert abs(printed[0] - printed[1]) <= 0.125  # at most 8 of 64 predictions differ under bf16


def test_a_backward_in_a_branch_has_its_forward_found_in_the_block_around_it():
    """Issue 60: ``if args.amp: with amp.scale_loss(loss, opt) as s: s.backward() else:
    loss.backward()`` (FixMatch, TransFG, SimMIM): the forward is before the ``if``, by where
    ``loss`` is bound; a loss summed in a ``for`` over the outputs of a model the rewrite can't
    tell is one (deeplab) is read by data flow too. Both backwards share one region."""
    result = native("""
    import argparse
    from apex import amp
    from nets import build

    parser = argparse.ArgumentParser()
    parser.add_argument("--amp", action="store_true")
    args = parser.parse_args()
    device = torch.device("cpu")
    net = build().to(device)
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    if args.amp:
        net, optimizer = amp.initialize(net, optimizer, opt_level="O1")
    for x, y in [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]:
        logits = net(x.to(device))
        loss = 0
        for part in logits.split(2):
            loss += F.cross_entropy(part, y[: part.shape[0]])
        if args.amp:
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
        else:
            loss.backward()
        optimizer.step()
    """)
    assert result.output.count("torch.autocast") == 1
    assert ("    with torch.autocast(device_type=device.type, dtype=torch.float16):\n"
            "        logits = net(x.to(device))\n        loss = 0\n        for part in logits.split(2):\n"
            "            loss += F.cross_entropy(part, y[: part.shape[0]])\n    if args.amp:\n"
            "        scaler.scale(loss).backward()\n    else:\n        scaler.scale(loss).backward()\n"
            "    scaler.step(optimizer)\n") in result.output


def test_a_backward_in_a_sibling_block_takes_the_forward_of_the_block_before():
    """Issue 60: ``with timer("fprop"): <forward>`` then ``with timer("grads"): (loss /
    k).backward()``: the forward's block goes under autocast, the backward's stays out."""
    result = native("""
    import contextlib

    timer = contextlib.nullcontext
    device = torch.device("cpu")
    model = torch.nn.Linear(4, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]:
        with timer("fprop"):
            loss = F.cross_entropy(model(x), y)
        with timer("grads"):
            (loss / 2).backward()
        optimizer.step()
    """, precision="bf16-mixed")
    assert ("    with torch.autocast(device_type=device.type, dtype=torch.bfloat16):\n"
            "        with timer(\"fprop\"):\n            loss = F.cross_entropy(model(x), y)\n"
            "    with timer(\"grads\"):\n        (loss / 2).backward()\n") in result.output


def test_a_forward_outside_the_loop_of_its_backward_is_not_taken():
    """A loop is a boundary: a forward computed once and a backward run in a loop are not one
    step (the refusal stands)."""
    result = native("""
    from nets import build

    net = build()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = F.mse_loss(net(torch.randn(8, 4)), torch.zeros(8, 2))
    for _ in range(2):
        loss.backward(retain_graph=True)
        optimizer.step()
    """, precision="bf16-mixed")
    assert not result.changed
    assert "no forward pass found" in reasons(result)
