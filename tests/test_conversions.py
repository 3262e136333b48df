"""The Fabric conversion on small scripts, through the real rules: each style is converted as a
careful Lightning user would by hand, and each case that must be left alone is left alone
with a note that says why (never a wrong rewrite).

Every conversion here also checks that the output parses, that no rule was dropped, and that a
second rewrite with the same options changes nothing.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

from accelerate_rewrite.api import Result, rewrite
from accelerate_rewrite.options import Options


def convert(source: str, *, allow_dropped: bool = False, **options) -> Result:
    source = textwrap.dedent(source).lstrip("\n")
    opts = Options.create(**options)
    result = rewrite(source, opts, path="train.py")
    ast.parse(result.output)
    if not allow_dropped:
        assert not result.dropped, result.dropped
    again = rewrite(result.output, opts)
    assert again.output == result.output, "not idempotent"
    return result


def body(result: Result) -> str:
    """The output without the import lines, for asserts on the code itself."""
    return "\n".join(l for l in result.output.splitlines() if not l.startswith(("import ", "from ")))


def skips(result: Result, rule: str | None = None) -> list[str]:
    return [n.message for n in result.skips if rule is None or n.rule == rule]


def assert_left_alone(result: Result, rule: str, *reason_words: str) -> None:
    assert not result.changed, result.output
    messages = skips(result, rule)
    assert messages, [(n.rule, n.message) for n in result.notes]
    for word in reason_words:
        assert word in messages[0], messages[0]


def backward_calls_not_through_fabric(code: str) -> list[str]:
    return [
        ast.unparse(node) for node in ast.walk(ast.parse(code))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward"
        and not ast.unparse(node.func.value).endswith("fabric")
    ]


# ---------------------------------------------------------------------------------------
# moves to the device
# ---------------------------------------------------------------------------------------

def test_to_int_and_to_cuda_string_on_model_and_batches():
    result = convert("""
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

        model = nn.Linear(4, 1)
        model.to("cuda")
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
        for step, (x, y) in enumerate(loader):
            x = x.to(0)
            y = y.cuda(non_blocking=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    """)
    assert body(result) == textwrap.dedent("""\

        fabric = Fabric(devices=1)
        fabric.launch()

        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = fabric.setup(model, optimizer)
        loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
        loader = fabric.setup_dataloaders(loader)
        for step, (x, y) in enumerate(loader):
            loss = nn.functional.mse_loss(model(x), y)
            fabric.backward(loss)
            optimizer.step()""")
    assert "from lightning.fabric import Fabric\n" in result.output


def test_to_int_chained_on_the_model_and_on_batch_items():
    result = convert("""
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

        model = nn.Linear(4, 1).to(0)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
        for batch in loader:
            x, y = batch[0].to("cuda"), batch[1].to(0, non_blocking=True)
            half = x.to(torch.float16)
            wide = x.to(0, torch.float64)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            optimizer.step()
    """)
    out = result.output
    assert "model = nn.Linear(4, 1)\n" in out
    assert "    x, y = batch[0], batch[1]\n" in out
    assert "    half = x.to(torch.float16)\n" in out  # a dtype, not a device: untouched
    assert "    wide = x.to(fabric.device, torch.float64)\n" in out  # keeps the dtype
    assert ".to(0" not in out and '"cuda"' not in out


def test_cuda_on_a_tensor_that_is_not_a_batch_becomes_fabric_device():
    result = convert("""
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 2).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        mask = torch.ones(4).cuda()
        criterion = nn.CrossEntropyLoss(weight=torch.tensor([1.0, 2.0]).cuda())
        for step in range(3):
            x = torch.randn(2, 4)
            loss = criterion(model(x.cuda() * mask), torch.zeros(2, dtype=torch.long).cuda())
            loss.backward()
            optimizer.step()
    """)
    out = result.output
    assert "model = nn.Linear(4, 2)\n" in out
    assert "mask = torch.ones(4).to(fabric.device)\n" in out
    assert "weight=torch.tensor([1.0, 2.0]).to(fabric.device)" in out
    assert "model(x.to(fabric.device) * mask)" in out
    assert "torch.zeros(2, dtype=torch.long).to(fabric.device)" in out
    assert ".cuda()" not in out
    # Fabric exists before the first tensor it places
    assert out.index("fabric = Fabric(devices=1)") < out.index("mask = ")


def test_metric_to_device_and_tensors_created_on_the_device():
    result = convert("""
        import torch
        import torch.nn as nn
        import torchmetrics

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = nn.Linear(4, 2).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        metric = torchmetrics.Accuracy(task="multiclass", num_classes=2).to(device)
        for step in range(3):
            x = torch.randn(2, 4, device=device)
            y = torch.zeros(2, dtype=torch.long, device=device)
            out = model(x)
            loss = nn.functional.cross_entropy(out, y)
            loss.backward()
            optimizer.step()
            metric.update(out, y)
    """)
    out = result.output
    assert "metric = torchmetrics.Accuracy(task=\"multiclass\", num_classes=2).to(fabric.device)\n" in out
    assert "x = torch.randn(2, 4, device=fabric.device)\n" in out
    assert "y = torch.zeros(2, dtype=torch.long, device=fabric.device)\n" in out
    assert "model = nn.Linear(4, 2)\n" in out
    assert "device =" not in out.replace("device=fabric", "")  # the definition is gone
    assert "torch.device" not in out
    assert not result.skips


def test_device_used_where_fabric_does_not_replace_it_keeps_its_definition():
    result = convert("""
        import torch
        import torch.nn as nn

        device = "cuda" if torch.cuda.is_available() else "cpu"
        model = nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        if device == "cuda":
            torch.backends.cudnn.benchmark = True
        for step in range(3):
            x = torch.randn(2, 4).to(device)
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
    """)
    out = result.output
    assert 'device = "cuda" if torch.cuda.is_available() else "cpu"\n' in out
    assert 'if device == "cuda":\n' in out
    assert "model = nn.Linear(4, 1)\n" in out
    assert "x = torch.randn(2, 4).to(fabric.device)\n" in out
    [note] = [n for n in result.skips if n.rule == "AR105"]
    assert note.line == 7 and "its definition stays" in note.message


def test_moves_to_an_unrecognised_device_on_set_up_objects_are_removed_or_noted():
    result = convert("""
        import argparse
        import torch
        import torch.nn as nn

        parser = argparse.ArgumentParser()
        parser.add_argument("--device", default="cuda:0")
        args = parser.parse_args()

        model = nn.Linear(4, 1).to(args.device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
        for x in loader:
            x = x.to(args.device)
            loss = model(x).sum()
            loss.backward()
            optimizer.step()
    """, devices=4)
    noted = {n.line for n in result.skips}
    if result.changed:
        assert "x = x.to(args.device)" not in result.output or 13 in noted
        assert "nn.Linear(4, 1).to(args.device)" not in result.output or 9 in noted
    else:
        assert noted


def test_device_printed_and_its_type_read():
    result = convert("""
        import torch

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        print(f"using {device}")
        model = torch.nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with torch.autocast(device_type=device.type, enabled=False):
            loss = model(torch.randn(2, 4, device=device)).sum()
        loss.backward()
        optimizer.step()
    """)
    out = result.output
    assert 'fabric.print(f"using {fabric.device}")' in out
    assert "torch.autocast(device_type=fabric.device.type, enabled=False)" in out
    assert "torch.device" not in out


# ---------------------------------------------------------------------------------------
# the device threaded through functions and classes
# ---------------------------------------------------------------------------------------

def test_device_parameter_of_train_becomes_fabric():
    result = convert("""
        import torch


        def train(model, optimizer, loader, device):
            model.train()
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                noise = torch.randn(x.shape, device=device)
                loss = torch.nn.functional.mse_loss(model(x + noise), y)
                loss.backward()
                optimizer.step()
                print(loss.item())


        def main():
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            data = torch.utils.data.TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
            loader = torch.utils.data.DataLoader(data, batch_size=16)
            model = torch.nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            train(model, optimizer, loader, device=device)


        if __name__ == "__main__":
            main()
    """, precision="bf16-mixed", devices=2)
    out = result.output
    assert "def train(model, optimizer, loader, fabric):\n" in out
    assert "noise = torch.randn(x.shape, device=fabric.device)" in out
    assert "        fabric.backward(loss)\n" in out
    assert "        fabric.print(loss.item())\n" in out
    assert "train(model, optimizer, loader, fabric=fabric)" in out
    assert '    fabric = Fabric(devices=2, precision="bf16-mixed")\n    fabric.launch()\n' in out
    assert "x.to(" not in out and "device =" not in out
    assert not backward_calls_not_through_fabric(out)


def test_trainer_class_keeping_self_device():
    result = convert("""
        import torch
        import torch.nn as nn


        class Trainer:
            def __init__(self, model, optimizer, device):
                self.device = device
                self.model = model
                self.optimizer = optimizer

            def step(self, x):
                x = x.to(self.device)
                noise = torch.randn(x.shape, device=self.device)
                self.loss = self.model(x + noise).sum()
                self.loss.backward()
                self.optimizer.step()


        def main():
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            trainer = Trainer(model, optimizer, device)
            for _ in range(3):
                trainer.step(torch.randn(2, 4))


        main()
    """)
    out = result.output
    assert "    def __init__(self, model, optimizer, fabric):\n        self.fabric = fabric\n" in out
    assert "x = x.to(self.fabric.device)" in out  # not a batch from a loader: kept, placed by Fabric
    assert "noise = torch.randn(x.shape, device=self.fabric.device)" in out
    assert "self.fabric.backward(self.loss)" in out
    assert "trainer = Trainer(model, optimizer, fabric)" in out
    assert "self.device" not in out


def test_device_param_with_default_not_passed_gets_fabric_as_a_new_parameter():
    result = convert("""
        import torch
        import torch.nn as nn


        def train(model, optimizer, loader, device="cuda"):
            for x in loader:
                x = x.to(device)
                loss = model(x).sum()
                loss.backward()
                optimizer.step()


        def main():
            model = nn.Linear(4, 1).cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
            train(model, optimizer, loader)


        main()
    """)
    # the device parameter is not passed, so it can't become `fabric`: `fabric` comes as a new
    # first parameter instead (issue 14.3), and the batches of the set-up loader need no move
    assert 'def train(fabric, model, optimizer, loader, device="cuda"):' in result.output
    assert "train(fabric, model, optimizer, loader)" in result.output and ".to(device)" not in result.output


DEFAULT_DEVICE_PARAM = {
    "passed by the caller": """
        import torch
        import torch.nn as nn


        def train(model, optimizer, loader, device="cpu"):
            for x in loader:
                x = x.to(device)
                loss = model(x).sum()
                loss.backward()
                optimizer.step()


        def main():
            device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            model = nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
            train(model, optimizer, loader, device)


        main()
    """,
    "not passed": """
        import torch
        import torch.nn as nn


        def train(model, optimizer, loader, device="cuda"):
            for x in loader:
                x = x.to(device)
                loss = model(x).sum()
                loss.backward()
                optimizer.step()


        def main():
            model = nn.Linear(4, 1).cuda()
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
            train(model, optimizer, loader)


        main()
    """,
}


@pytest.mark.parametrize("case", sorted(DEFAULT_DEVICE_PARAM))
def test_device_param_with_default_under_mixed_precision(case):
    result = convert(DEFAULT_DEVICE_PARAM[case], precision="bf16-mixed")
    if result.changed:  # converted: every backward must go through Fabric
        assert not backward_calls_not_through_fabric(result.output), result.output
    else:  # or left alone, saying why
        assert skips(result)


def test_threaded_device_param_also_compared_to_a_string():
    result = convert("""
        import torch
        import torch.nn as nn


        def train(model, optimizer, loader, device):
            for x in loader:
                x = x.to(device)
                loss = model(x).sum()
                loss.backward()
                optimizer.step()
            if device == "cuda":
                torch.cuda.empty_cache()


        def main():
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = torch.utils.data.DataLoader(torch.randn(8, 4), batch_size=2)
            train(model, optimizer, loader, device)


        main()
    """, devices=4)
    if result.changed:
        assert "fabric.setup(" in result.output and not backward_calls_not_through_fabric(result.output)
    else:
        assert skips(result)


def test_trainer_class_comparing_self_device_keeps_it_defined():
    result = convert("""
        import torch
        import torch.nn as nn


        class Trainer:
            def __init__(self, model, optimizer, device):
                self.device = device
                self.model = model
                self.optimizer = optimizer

            def step(self, x):
                loss = self.model(x.to(self.device)).sum()
                loss.backward()
                self.optimizer.step()
                if self.device == "cuda":
                    torch.cuda.synchronize()


        def main():
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            trainer = Trainer(model, optimizer, device)
            trainer.step(torch.randn(2, 4))


        main()
    """)
    tree = ast.parse(result.output)
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n) == "self.device"
             and isinstance(n.ctx, ast.Load)]
    writes = [n for n in ast.walk(tree) if isinstance(n, ast.Attribute) and ast.unparse(n) == "self.device"
              and isinstance(n.ctx, ast.Store)]
    assert not reads or writes, result.output


# ---------------------------------------------------------------------------------------
# where Fabric is created
# ---------------------------------------------------------------------------------------

def test_model_built_in_if_else_gets_fabric_before_the_if():
    result = convert("""
        import argparse
        import torch
        import torch.nn as nn

        parser = argparse.ArgumentParser()
        parser.add_argument("--arch", default="small")
        args = parser.parse_args()

        if args.arch == "small":
            model = nn.Linear(4, 1)
        else:
            model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            optimizer.step()
    """, devices=2)
    out = result.output
    assert "\nfabric = Fabric(devices=2)\nfabric.launch()\n" in out  # at module level, not indented
    assert out.index("fabric.launch()") < out.index("if args.arch")


def test_model_and_optimizer_built_in_a_factory_function():
    result = convert("""
        import torch
        import torch.nn as nn


        def build(device):
            model = nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            return model, optimizer


        device = torch.device("cuda")
        model, optimizer = build(device)
        loss = model(torch.randn(2, 4, device=device)).sum()
        loss.backward()
        optimizer.step()
    """, precision="bf16-mixed")
    if result.changed:
        assert not backward_calls_not_through_fabric(result.output), result.output
    else:
        assert skips(result, "AR101")


def test_fabric_goes_after_argument_parsing_and_before_the_first_device_use():
    result = convert("""
        import argparse
        import torch

        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args()
        torch.manual_seed(0)

        device = torch.device("cuda")
        model = torch.nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        loss = model(torch.randn(2, 4, device=device)).sum()
        loss.backward()
        optimizer.step()
    """)
    assert body(result).startswith(textwrap.dedent("""\

        parser = argparse.ArgumentParser()
        parser.add_argument("--lr", type=float, default=0.1)
        args = parser.parse_args()
        torch.manual_seed(0)

        fabric = Fabric(devices=1)
        fabric.launch()
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
        model, optimizer = fabric.setup(model, optimizer)
    """))


# ---------------------------------------------------------------------------------------
# optimizers, backward, clipping
# ---------------------------------------------------------------------------------------

TWO_MODELS_ONE_OPTIMIZER = """
    import torch
    import torch.nn as nn

    enc = nn.Linear(4, 2)
    dec = nn.Linear(2, 4)
    optimizer = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=1e-3)
    for step in range(3):
        x = torch.randn(2, 4)
        loss = (dec(enc(x)) - x).pow(2).mean()
        loss.backward()
        optimizer.step()
        print(loss.item())
"""


def test_optimizer_over_two_models_sets_each_up_then_the_optimizer():
    # issue 26: Fabric's own answer, setup_module for each model, then setup_optimizers
    result = convert(TWO_MODELS_ONE_OPTIMIZER, precision="bf16-mixed", devices=2)
    assert ("optimizer = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=1e-3)\n"
            "enc = fabric.setup_module(enc)\ndec = fabric.setup_module(dec)\n"
            "optimizer = fabric.setup_optimizers(optimizer)\n") in result.output
    assert not backward_calls_not_through_fabric(result.output)


def test_optimizer_over_two_models_is_refused_under_deepspeed():
    result = convert(TWO_MODELS_ONE_OPTIMIZER, strategy="deepspeed", devices=2)
    assert_left_alone(result, "AR101", "optimizer `optimizer` not set up: DeepSpeed sets a model and its "
                                       "optimizer up together", "nothing was converted")
    [note] = result.skips
    assert note.line == 6


def test_swa_script_is_not_refused_for_a_fake_optimizer():
    result = convert("""
        import torch
        import torch.nn as nn
        from torch.optim.swa_utils import AveragedModel, SWALR

        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        swa_model = AveragedModel(model)
        swa_scheduler = SWALR(optimizer, swa_lr=0.05)
        for epoch in range(3):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            optimizer.step()
            swa_model.update_parameters(model)
            swa_scheduler.step()
    """)
    for message in skips(result):
        assert "swa_model" not in message and "swa_scheduler" not in message, message


def test_param_groups_of_one_model_are_set_up_together():
    result = convert("""
        import torch
        import torch.nn as nn

        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
        optimizer = torch.optim.Adam(
            [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 1e-4}],
            lr=1e-3,
        )
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        scheduler.step()
    """)
    out = result.output
    assert ")\nmodel, optimizer = fabric.setup(model, optimizer)\nscheduler = " in out


def test_gan_two_setups_and_every_backward():
    result = convert("""
        import torch
        import torch.nn as nn

        G = nn.Linear(2, 4)
        D = nn.Linear(4, 1)
        opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
        opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
        for step in range(3):
            fake = G(torch.randn(8, 2))
            d_real = D(torch.randn(8, 4)).mean()
            d_fake = D(fake.detach()).mean()
            (d_fake - d_real).backward()
            opt_d.step()
            g_loss = -D(fake).mean()
            g_loss.backward(retain_graph=True)
            opt_g.step()
    """, precision="bf16-mixed", devices=2)
    out = result.output
    assert "G, opt_g = fabric.setup(G, opt_g)" in out
    assert "D, opt_d = fabric.setup(D, opt_d)" in out
    # (the parentheses of `(d_fake - d_real).backward()` are kept: redundant, but harmless)
    assert "fabric.backward((d_fake - d_real))" in out or "fabric.backward(d_fake - d_real)" in out
    assert "fabric.backward(g_loss, retain_graph=True)" in out
    assert not backward_calls_not_through_fabric(out)


def test_lbfgs_closure_backward_and_no_low_precision():
    result = convert("""
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 1)
        optimizer = torch.optim.LBFGS(model.parameters(), lr=0.5)
        x, y = torch.randn(8, 4), torch.randn(8, 1)
        for step in range(3):
            def closure():
                optimizer.zero_grad()
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                return loss
            optimizer.step(closure)
    """, precision="bf16-mixed", devices=2)
    out = result.output
    assert "fabric = Fabric(devices=2)\n" in out  # no precision for LBFGS
    assert "        fabric.backward(loss)\n" in out
    assert any("LBFGS" in m for m in skips(result, "AR101"))


def test_grad_scaler_backward_and_own_autocast():
    result = convert("""
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = torch.amp.GradScaler()
        for step in range(3):
            with torch.autocast("cuda"):
                loss = model(torch.randn(2, 4)).sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
    """, precision="bf16-mixed")
    out = result.output
    assert "fabric = Fabric(devices=1)\n" in out  # the script's own AMP stays; no second one on top
    assert "fabric.backward(scaler.scale(loss))" in out
    assert any("runs its own autocast" in m for m in skips(result, "AR101"))
    assert "torch.autocast(fabric.device.type, dtype=torch.bfloat16)" in out  # AR213: the precision asked for
    assert 'torch.amp.GradScaler(enabled=False)' in out


def test_clip_grad_value_and_norm():
    result = convert("""
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(2, 4)).sum()
            loss.backward()
            torch.nn.utils.clip_grad_value_(model.parameters(), 0.5)
            norm = nn.utils.clip_grad_norm_(model.parameters(), max_norm=1.0, norm_type=2.0)
            optimizer.step()
    """)
    out = result.output
    assert "    fabric.clip_gradients(model, optimizer, clip_val=0.5)\n" in out
    assert ("    norm = fabric.clip_gradients(model, optimizer, max_norm=1.0, norm_type=2.0, "
            "error_if_nonfinite=False)\n") in out
    assert "utils.clip_grad" not in out


def test_clip_grad_of_something_else_is_left_with_a_note():
    result = convert("""
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        params = [p for p in model.parameters() if p.requires_grad]
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        torch.nn.utils.clip_grad_value_(params, 0.5)
        optimizer.step()
    """)
    assert "torch.nn.utils.clip_grad_value_(params, 0.5)" in result.output
    assert any("can't tell" in m for m in skips(result, "AR107"))


# ---------------------------------------------------------------------------------------
# checkpoints
# ---------------------------------------------------------------------------------------

CHECKPOINTS = """
    import torch
    import torch.nn as nn

    rank = 0
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        if rank == 0:
            torch.save(model.state_dict(), "best.pt")
        torch.save(model, "whole.pt")
        torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "epoch": epoch}, "full.pt")
"""


def test_save_inside_a_rank_check_is_left_with_a_reason():
    result = convert(CHECKPOINTS)
    assert '        torch.save(model.state_dict(), "best.pt")\n' in result.output
    [note] = [n for n in result.skips if "rank check" in n.message]
    assert note.rule == "AR109" and note.line == 12 and "every rank" in note.message


def test_save_of_a_whole_model_saves_the_original_module_on_rank_zero():
    result = convert(CHECKPOINTS)
    assert '        torch.save(model.module, "whole.pt")\n' in result.output
    assert "    if fabric.is_global_zero:\n" in result.output
    assert any(n.rule == "AR110" and "model.module" in n.message for n in result.changes)
    assert not [n for n in result.skips if n.line == 13]


def test_save_of_training_state_goes_through_fabric():
    result = convert(CHECKPOINTS)
    assert ('    fabric.save("full.pt", {"model": model, "optimizer": optimizer, "epoch": epoch})\n'
            in result.output)


def test_saves_under_fsdp_are_left_for_a_human():
    result = convert(CHECKPOINTS, strategy="fsdp")
    assert "torch.save({" in result.output and "fabric.save" not in result.output
    assert any("sharded" in m for m in skips(result, "AR109"))


# ---------------------------------------------------------------------------------------
# DataParallel, hand-made DDP
# ---------------------------------------------------------------------------------------

def test_data_parallel_gives_way_to_the_strategy():
    result = convert("""
        import torch
        from torch import nn

        model = nn.Linear(4, 1)
        if torch.cuda.device_count() > 1:
            print("using", torch.cuda.device_count(), "GPUs")
            model = nn.DataParallel(model)
        model.cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4).cuda()).sum()
        loss.backward()
        optimizer.step()
    """, devices=2)
    out = result.output
    assert "DataParallel" not in out and "device_count" not in out
    assert "model.cuda()" not in out
    assert "model, optimizer = fabric.setup(model, optimizer)" in out


def test_hand_made_ddp_at_module_level_becomes_fabric():
    """torchrun style: Fabric is created where the process group started; the wrapper goes."""
    result = convert("""
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("nccl")
        rank = dist.get_rank()
        model = DDP(torch.nn.Linear(4, 1).cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4).cuda()).sum()
        loss.backward()
        optimizer.step()
        if rank == 0:
            print("done")
    """)
    out = result.output
    assert "fabric = Fabric(devices=int(os.environ.get(\"LOCAL_WORLD_SIZE\", 1)))" in out
    assert "rank = fabric.global_rank" in out and "model = torch.nn.Linear(4, 1).to(fabric.device)" in out
    assert "init_process_group" not in out and "DDP" not in out and "import torch.distributed" not in out
    assert out.index("fabric.launch()") < out.index("rank = fabric.global_rank")


HAND_DDP_HEAD = """
    import torch
    import torch.distributed as dist
    import torch.multiprocessing as mp
    from torch.nn.parallel import DistributedDataParallel as DDP

"""


@pytest.mark.parametrize("body,reason", [
    ("""
    def worker(rank, n):
        dist.init_process_group("gloo", rank=rank, world_size=n)
        group = dist.new_group([0])
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    mp.spawn(worker, args=(2,), nprocs=2)
    """, "custom process group (new_group)"),
    ("""
    def worker(rank, n):
        dist.init_process_group("gloo", rank=rank, world_size=n)
        model = DDP(torch.nn.Linear(4, 1), process_group=None)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    mp.spawn(worker, args=(2,), nprocs=2)
    """, "process_group="),
    ("""
    def worker(rank, n):
        dist.init_process_group("gloo", rank=rank, world_size=n)
        model = DDP(torch.nn.Linear(4, 1), broadcast_buffers=n > 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    mp.spawn(worker, args=(2,), nprocs=2)
    """, "DDPStrategy"),
    ("""
    def worker(rank, n):
        dist.init_process_group("gloo", rank=rank, world_size=n)
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    def run(fn, n):
        mp.spawn(fn, args=(n,), nprocs=n)

    run(worker, 2)
    """, "not a function defined at the top of this file"),
    ("""
    import os

    def is_main():
        return int(os.environ["RANK"]) == 0

    def log(message):
        if is_main():
            print(message)

    def main():
        dist.init_process_group("gloo")
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        log("done")

    main()
    """, "in is_main() can't become `fabric.global_rank`"),
    ("""
    from torch.utils.data import DataLoader, DistributedSampler

    model = torch.nn.Linear(4, 1)
    loader = DataLoader(list(range(8)), sampler=DistributedSampler(list(range(8))))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x in loader:
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
    """, "no `init_process_group` in this file"),
])
def test_hand_made_ddp_refused_with_a_reason(body, reason):
    result = convert(HAND_DDP_HEAD + body)
    assert_left_alone(result, "AR101", "hand-made distributed training", reason)


def test_ddp_options_go_to_fabric_s_ddp_strategy():
    # issue 26: Swin's `DistributedDataParallel(model, device_ids=[...], broadcast_buffers=False)`;
    # spawn's arguments given by position (barlowtwins' `mp.spawn(main_worker, (args,), n)`)
    result = convert(HAND_DDP_HEAD + """
    def worker(rank, n):
        dist.init_process_group("gloo", rank=rank, world_size=n)
        model = DDP(torch.nn.Linear(4, 1), device_ids=[rank], broadcast_buffers=False,
                    find_unused_parameters=True)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    mp.spawn(worker, (2,), 2)
    """)
    assert "from lightning.fabric.strategies import DDPStrategy" in result.output
    assert ("fabric = Fabric(strategy=DDPStrategy(broadcast_buffers=False, find_unused_parameters=True), devices=2)\n"
            "\nfabric.launch(worker, 2)") in result.output


def test_spawned_worker_receives_fabric_and_devices_follow_nprocs():
    result = convert(HAND_DDP_HEAD + """
    def worker(rank, world_size, lr):
        \"\"\"One process.\"\"\"
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        model = torch.nn.Linear(4, 1).to(rank)
        ddp = DDP(model, device_ids=[rank], find_unused_parameters=True)
        optimizer = torch.optim.SGD(ddp.parameters(), lr=lr)
        ddp(torch.randn(2, 4).to(rank)).sum().backward()
        optimizer.step()
        print(f"rank {rank} done")
        dist.destroy_process_group()

    if __name__ == "__main__":
        n = torch.cuda.device_count()
        mp.spawn(worker, args=(n, 0.1), nprocs=n, join=True)
    """)
    out = result.output
    # (torch.cuda.device_count() is 0 without CUDA: never Fabric(devices=0))
    assert 'fabric = Fabric(strategy="ddp_find_unused_parameters_true", devices=max(n, 1))' in out
    assert "fabric.launch(worker, n, 0.1)" in out
    assert 'def worker(fabric, world_size, lr):\n    """One process."""\n    rank = fabric.local_rank\n' in out
    assert 'print(f"rank {rank} done")' in out  # per process, as before
    assert "destroy_process_group" not in out and "mp.spawn" not in out
    # --devices replaces the world size the worker is told
    two = convert(HAND_DDP_HEAD + """
    def worker(rank, world_size):
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        model = DDP(torch.nn.Linear(4, 1))
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()

    if __name__ == "__main__":
        mp.spawn(worker, args=(8,), nprocs=8)
    """, devices=2, accelerator="cpu")
    assert "world_size = fabric.world_size" in two.output
    assert 'Fabric(accelerator="cpu", devices=2)' in two.output


# ---------------------------------------------------------------------------------------
# scripts that already use a framework, or where the name is taken
# ---------------------------------------------------------------------------------------

def test_script_that_already_uses_the_lightning_trainer():
    result = convert("""
        import torch
        import lightning as L


        class Lit(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(4, 1)

            def training_step(self, batch, batch_idx):
                loss = self.net(batch).sum()
                return loss

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.1)


        trainer = L.Trainer(max_epochs=1)
        trainer.fit(Lit(), torch.utils.data.DataLoader(torch.randn(8, 4)))
    """)
    assert_left_alone(result, "AR101", "already uses the Lightning Trainer")


def test_trainer_with_manual_backward_in_a_loop_is_left_alone():
    result = convert("""
        import torch
        from lightning.pytorch import Trainer

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        Trainer()
    """)
    assert_left_alone(result, "AR101", "already uses the Lightning Trainer")


@pytest.mark.parametrize("source", [
    "from accelerate import Accelerator\naccelerator = Accelerator()\n",
    "import lightning as L\nfabric = L.Fabric()\n",
])
def test_scripts_that_already_use_accelerate_or_fabric(source):
    training = textwrap.dedent("""
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    result = convert(source + training)
    assert_left_alone(result, "AR101", "already uses")


def test_script_using_fabric_through_L_fabric_is_left_alone():
    result = convert("""
        import lightning as L
        import torch

        fab = L.fabric.Fabric(accelerator="cpu")
        fab.launch()
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = fab.setup(model, optimizer)
        for step in range(3):
            loss = model(torch.randn(2, 4)).sum()
            fab.backward(loss)
            optimizer.step()
    """)
    assert_left_alone(result, "AR101", "already uses Lightning Fabric")


def test_lightning_imported_only_for_seed_everything_is_converted():
    result = convert("""
        import torch
        import lightning as L

        L.seed_everything(42)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    out = result.output
    assert "L.seed_everything(42)\nfabric = Fabric(devices=1)\nfabric.launch()\n" in out
    assert "fabric.backward(loss)" in out


def test_pytorch_lightning_imported_only_for_seed_everything_is_converted():
    result = convert("""
        import torch
        import pytorch_lightning as pl

        pl.seed_everything(42)
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    assert "fabric.backward(loss)" in result.output


def test_name_fabric_already_used():
    result = convert("""
        import torch

        fabric = "cotton"
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        print(fabric)
    """)
    assert_left_alone(result, "AR101", "`fabric` is already used")
    assert result.skips[0].line == 3


def test_fabric_as_an_attribute_or_keyword_is_not_a_conflict():
    result = convert("""
        import torch

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        config = dict(fabric=1)
    """)
    assert "fabric.backward(loss)" in result.output


def test_model_built_inside_a_class_method_is_refused():
    result = convert("""
        import torch
        import torch.nn as nn


        class Experiment:
            def __init__(self):
                self.model = nn.Linear(4, 1)
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

            def run(self):
                loss = self.model(torch.randn(2, 4)).sum()
                loss.backward()
                self.optimizer.step()


        Experiment().run()
        Experiment().run()
    """)
    # made twice: two models, one Fabric setup each would be two set-ups of one place
    assert_left_alone(result, "AR101", "built in Experiment.__init__", "`Experiment(...)` is made more than once")


def test_nothing_to_train_is_left_alone():
    result = convert("""
        import torch

        x = torch.randn(2, 4)
        print(x.cuda().sum())
    """)
    assert_left_alone(result, "AR101", "no training found")


# ---------------------------------------------------------------------------------------
# options
# ---------------------------------------------------------------------------------------

SIMPLE = """
    import torch

    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = model(torch.randn(2, 4)).sum()
    loss.backward()
    optimizer.step()
"""


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp_notebook", "ddp_fork"])
def test_strategies_that_need_launch_fn_are_refused(strategy):
    result = convert(SIMPLE, strategy=strategy, devices=2)
    assert_left_alone(result, "AR101", f"--strategy {strategy}", "fabric.launch(fn)")


def test_devices_1_gives_no_launch():
    out = convert(SIMPLE, devices=1).output
    assert "fabric = Fabric(devices=1)\n" in out
    assert "launch" not in out
    assert "fabric.setup(model, optimizer)" in out


def test_precision_alias_is_written_canonically():
    out = convert(SIMPLE, precision="bf16", devices=4).output
    assert 'fabric = Fabric(devices=4, precision="bf16-mixed")\nfabric.launch()\n' in out
    assert '"bf16"' not in out


def test_only_non_default_options_are_written():
    out = convert(SIMPLE, precision="32-true", strategy="auto", devices="auto", num_nodes=1,
                  accelerator="auto").output
    assert "fabric = Fabric()\n" in out
    out = convert(SIMPLE, accelerator="cuda", strategy="ddp", devices="0,1", num_nodes=2,
                  precision="16").output
    assert ('fabric = Fabric(accelerator="cuda", strategy="ddp", devices="0,1", num_nodes=2, '
            'precision="16-mixed")\n') in out


def test_fsdp_sets_the_module_up_before_its_optimizer():
    out = convert(SIMPLE, strategy="fsdp").output
    assert ("model = fabric.setup_module(model)\n"
            "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "optimizer = fabric.setup_optimizers(optimizer)\n") in out


def test_deepspeed_sets_model_and_optimizer_up_together():
    out = convert(SIMPLE, strategy="deepspeed").output
    assert "model, optimizer = fabric.setup(model, optimizer)\n" in out
    assert "setup_optimizers" not in out


STYLE_TRANSFER = """
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    cnn = torch.nn.Conv2d(3, 8, 3).to(device).eval()
    target = torch.rand(1, 8, 14, 14, device=device)


    def run(input_img, steps=3):
        input_img.requires_grad_(True)
        optimizer = torch.optim.LBFGS([input_img])
        for _ in range(steps):
            def closure():
                optimizer.zero_grad()
                loss = torch.nn.functional.mse_loss(cnn(input_img), target)
                loss.backward()
                return loss
            optimizer.step(closure)
        return input_img


    run(torch.rand(1, 3, 16, 16, device=device))
"""


def test_an_optimizer_over_a_tensor_converts_the_backward_at_32_true():
    """Issue 14.5: style transfer optimizes an image: nothing to set up, the backward goes
    through Fabric and the note says why there is no setup."""
    result = convert(STYLE_TRANSFER)
    assert "fabric.backward(loss)" in result.output and "fabric.setup(" not in result.output
    assert any("optimizes tensors (`[input_img]`)" in m for m in skips(result, "AR103"))


@pytest.mark.parametrize("options,what", [({"precision": "bf16-mixed"}, "precision bf16-mixed"),
                                          ({"devices": 2}, "devices=2")])
def test_an_optimizer_over_a_tensor_is_refused_where_fabric_could_not_apply(options, what):
    result = convert(STYLE_TRANSFER, **options)
    assert_left_alone(result, "AR101", "optimizes tensors", f"no module to apply {what} to")


def test_a_conditional_optimizer_with_clipping_is_refused_at_16_mixed():
    """Issue 14.4: torch's clipping stays where the optimizer is not certain; under 16-mixed it
    would clip scaled gradients, so nothing is converted."""
    source = (Path(__file__).resolve().parent.parent / "fixtures" / "conditional_optimizer" / "input.py").read_text(
        encoding="utf-8")
    result = rewrite(source, Options.create(precision="16-mixed"), path="train.py")
    assert not result.changed
    assert any("would clip scaled gradients" in m for m in skips(result, "AR101"))


def test_a_trainer_that_builds_its_model_in_init_receives_fabric():
    """Issue 14.3: the model, optimizer and loader built in the ``__init__`` of a class made once:
    Fabric is created where the object is made and passed in; the set-ups stay in ``__init__``."""
    result = convert("""
        import torch
        import torch.nn.functional as F
        from torch.utils.data import DataLoader, TensorDataset


        class Trainer:
            def __init__(self, lr):
                self.device = "cuda" if torch.cuda.is_available() else "cpu"
                self.model = torch.nn.Linear(8, 1).to(self.device)
                self.optimizer = torch.optim.Adam(self.model.parameters(), lr=lr)
                x = torch.randn(64, 8)
                self.loader = DataLoader(TensorDataset(x, x.sum(1, keepdim=True)), batch_size=8)

            def train_epoch(self):
                for x, y in self.loader:
                    x, y = x.to(self.device), y.to(self.device)
                    self.optimizer.zero_grad()
                    loss = F.mse_loss(self.model(x), y)
                    loss.backward()
                    self.optimizer.step()


        def main():
            trainer = Trainer(1e-2)
            trainer.train_epoch()


        main()
    """)
    out = result.output
    assert "    def __init__(self, fabric, lr):\n        self.fabric = fabric\n" in out
    assert "        self.model, self.optimizer = fabric.setup(self.model, self.optimizer)\n" in out
    assert "        self.loader = fabric.setup_dataloaders(self.loader)\n" in out
    assert "self.fabric.backward(loss)" in out and "trainer = Trainer(fabric, 1e-2)" in out
    assert out.index("fabric.launch()") < out.index("trainer = Trainer(fabric, 1e-2)")


def test_a_strategy_of_several_processes_is_launched_on_one_device_too():
    """`Fabric(strategy="ddp", devices=1)` raises at setup without `fabric.launch()`."""
    source = """
        import torch

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """
    assert "fabric.launch()" in convert(source, strategy="ddp", devices=1).output
    assert "fabric.launch()" not in convert(source, devices=1).output


_BUILT_BY_METHODS = """
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset


    class Trainer:
        def __init__(self, epochs=2, lr=1e-3):
            self.epochs = epochs
            self.lr = lr
            self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
            self.model = self._build_model()
            self.optimizer = self._make_optimizer()
            self.loader = self._build_loader()

        def _build_model(self):
            return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(self.device)

        def _make_optimizer(self):
            return torch.optim.Adam(self.model.parameters(), lr=self.lr)

        def _build_loader(self):
            data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
            return DataLoader(data, batch_size=16, shuffle=True)

        def _run_batch(self, x, y):
            loss = nn.functional.cross_entropy(self.model(x), y)
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()
            return loss.item()

        def train(self):
            for epoch in range(self.epochs):
                self.model.train()
                for x, y in self.loader:
                    x, y = x.to(self.device), y.to(self.device)
                    print(f"epoch {epoch} loss {self._run_batch(x, y):.8f}")


    def main():
        torch.manual_seed(0)
        trainer = Trainer()
        trainer.train()


    if __name__ == "__main__":
        main()
"""


@pytest.mark.runs
def test_a_trainer_whose_methods_build_the_model_optimizer_and_loader_converts_and_trains_as_before(tmp_path):
    """Issue 14.3: ``self.model = self._build_model()``, ``self.optimizer = self._make_optimizer()``,
    ``self.loader = self._build_loader()`` (each method returns what it builds, and is called
    once): they are the model, optimizer and loader, set up in ``__init__``; 32-true gives the
    same losses, digit for digit."""
    import os
    import subprocess
    import sys

    result = convert(_BUILT_BY_METHODS)
    out = result.output
    assert "        self.model, self.optimizer = fabric.setup(self.model, self.optimizer)\n" in out
    assert "        self.loader = fabric.setup_dataloaders(self.loader)\n" in out
    assert "self.fabric.backward(loss)" in out and "trainer = Trainer(fabric)" in out
    source = textwrap.dedent(_BUILT_BY_METHODS).lstrip("\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    printed = []
    for name, text in (("original.py", source), ("rewritten.py", out)):
        (tmp_path / name).write_text(text, encoding="utf-8")
        run = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        printed.append(run.stdout)
    assert printed[0].count("loss") == 8 and printed[1] == printed[0]


def test_a_builder_method_called_twice_is_not_taken_for_one_binding():
    """``self.model = self._build_model()`` and ``self.ema = self._build_model()``: the method's
    result is not one binding's; the model is still known as what the optimizer trains, and
    what the method builds goes to Fabric's device."""
    result = convert(_BUILT_BY_METHODS.replace("            self.model = self._build_model()\n",
                                               "            self.model = self._build_model()\n"
                                               "            self.ema = self._build_model()\n"))
    out = result.output
    assert "        self.model = self._build_model()\n        self.ema = self._build_model()\n" in out
    assert "        self.model, self.optimizer = fabric.setup(self.model, self.optimizer)\n" in out
    assert ".to(self.fabric.device)" in out


_CONFIGURE_OPTIMIZERS = """\
import torch
import torch.nn as nn
from torch.nn import functional as F


class GPT(nn.Module):
    def __init__(self, n=8):
        super().__init__()
        self.lin = nn.Linear(n, n)
        self.head = nn.Linear(n, 2)

    def forward(self, x, targets=None):
        logits = self.head(torch.relu(self.lin(x)))
        loss = F.cross_entropy(logits, targets) if targets is not None else None
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate):
        param_dict = {pn: p for pn, p in self.named_parameters() if p.requires_grad}
        decay_params = [p for n, p in param_dict.items() if p.dim() >= 2]
        nodecay_params = [p for n, p in param_dict.items() if p.dim() < 2]
        optim_groups = [
            {"params": decay_params, "weight_decay": weight_decay},
            {"params": nodecay_params, "weight_decay": 0.0},
        ]
        optimizer = torch.optim.AdamW(optim_groups, lr=learning_rate)
        return optimizer


def get_batch(device):
    x = torch.randn(16, 8)
    y = torch.randint(0, 2, (16,))
    return x.to(device), y.to(device)


def main():
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = GPT()
    model.to(device)
    optimizer = model.configure_optimizers(0.1, 1e-3)
    for it in range(8):
        X, Y = get_batch(device)
        logits, loss = model(X, Y)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        print(f"iter {it} loss {loss.item():.8f}")


if __name__ == "__main__":
    main()
"""


@pytest.mark.runs
def test_an_optimizer_the_models_own_method_builds_converts():
    """Issue 14.3, nanoGPT's shape: ``optimizer = model.configure_optimizers(...)``, a method of
    the model's class that builds ``torch.optim.AdamW`` over its own parameter groups and returns
    it. The optimizer is bound where the result lands, set up with the model; the method is not
    marked a forward method (it runs on the model as built)."""
    out = convert(_CONFIGURE_OPTIMIZERS).output
    assert "    optimizer = model.configure_optimizers(0.1, 1e-3)\n    model, optimizer = fabric.setup(model, optimizer)\n" \
        in out
    assert "mark_forward_method" not in out and "fabric.backward(loss)" in out


@pytest.mark.slow  # CI time: an optimizer another function builds trains both ways in the next test
def test_an_optimizer_the_models_own_method_builds_trains_as_before(tmp_path):
    """The rewrite above, at 32-true: the same losses."""
    import os
    import subprocess
    import sys

    source = _CONFIGURE_OPTIMIZERS
    out = convert(source).output
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    printed = []
    for name, text in (("original.py", source), ("rewritten.py", out)):
        (tmp_path / name).write_text(text, encoding="utf-8")
        run = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        printed.append(run.stdout)
    assert printed[0].count("loss") == 8 and printed[1] == printed[0]


_HELPER_OVER_ITS_ARGUMENT = """\
import torch
import torch.nn as nn


def make_optimizer(net, lr):
    return torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9)


def main():
    torch.manual_seed(0)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    teacher = nn.Linear(4, 1).to(device)
    model = nn.Linear(4, 1).to(device)
    optimizer = make_optimizer(model, 0.1)
    x = torch.randn(8, 4).to(device)
    for step in range(4):
        optimizer.zero_grad()
        loss = (model(x) - teacher(x).detach()).pow(2).mean()
        loss.backward()
        optimizer.step()
        print(f"step {step} loss {loss.item():.8f}")


if __name__ == "__main__":
    main()
"""


@pytest.mark.runs
def test_an_optimizer_a_helper_builds_over_its_argument_converts_and_trains_as_before(tmp_path):
    """Issue 14.3: ``optimizer = make_optimizer(model, 0.1)`` where the helper returns
    ``torch.optim.SGD(net.parameters(), ...)``: the optimizer is over the model passed at the
    call (``net`` is the helper's parameter, unbound in ``main``: before, the set-up read it and the
    flow check dropped the file). Set up with ``model``; the teacher, not trained, is moved to
    Fabric's device; 32-true: the same losses."""
    import os
    import subprocess
    import sys

    source = _HELPER_OVER_ITS_ARGUMENT
    out = convert(source).output
    assert "    optimizer = make_optimizer(model, 0.1)\n    model, optimizer = fabric.setup(model, optimizer)\n" in out
    assert "teacher = nn.Linear(4, 1).to(fabric.device)" in out
    # by keyword, the same
    by_keyword = convert(source.replace("make_optimizer(model, 0.1)", "make_optimizer(lr=0.1, net=model)")).output
    assert "model, optimizer = fabric.setup(model, optimizer)" in by_keyword
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    printed = []
    for name, text in (("original.py", source), ("rewritten.py", out)):
        (tmp_path / name).write_text(text, encoding="utf-8")
        run = subprocess.run([sys.executable, name], cwd=tmp_path, env=env, capture_output=True, text=True,
                             timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]
        printed.append(run.stdout)
    assert printed[0].count("loss") == 4 and printed[1] == printed[0]


def test_a_helper_over_an_argument_that_is_not_a_name_is_not_taken_for_the_optimizer():
    """``make_optimizer(model.body, 0.1)``: which model the optimizer trains is not a name at the
    call, so the helper's result is not bound; the script is left alone, with the reason."""
    result = convert(_HELPER_OVER_ITS_ARGUMENT.replace("make_optimizer(model, 0.1)", "make_optimizer(model.body, 0.1)"))
    assert_left_alone(result, "AR101", "no optimizer found")


_ALIASED = """
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
torch.manual_seed(0)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
model = nn.Linear(4, 1).to(device)
model_without_ddp = model
optimizer = torch.optim.SGD(model_without_ddp.parameters(), lr=0.1)
for epoch in range(2):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        print(f"loss {loss.item():.6f}")
torch.save(model_without_ddp.state_dict(), "m.pt")
"""


def test_the_set_up_rebinds_the_name_the_forward_runs_through():
    """The optimizer takes ``model_without_ddp.parameters()``, an alias of ``model``, and the
    forward runs through ``model``: ``model`` is set up (the forward under Fabric's precision
    and strategy), ``model_without_ddp`` keeps the module itself for its state_dict. Setting up
    the alias left the forward outside Fabric, silently."""
    result = convert(_ALIASED, precision="bf16-mixed")
    assert "model, optimizer = fabric.setup(model, optimizer)" in result.output
    assert "model_without_ddp.state_dict()" in result.output


@pytest.mark.slow  # CI time: two runs, one of them importing lightning
def test_the_aliased_set_up_trains_as_before(tmp_path):
    pytest.importorskip("lightning")
    import subprocess
    import sys

    source = textwrap.dedent(_ALIASED).lstrip("\n")
    result = convert(_ALIASED, accelerator="cpu")
    out = []
    for name, text in (("original.py", source), ("rewritten.py", result.output)):
        (tmp_path / name).write_text(text)
        done = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        out.append([line for line in done.stdout.splitlines() if line.startswith("loss")])
    assert out[0] and out[0] == out[1]


def test_a_loader_with_its_own_batch_sampler_is_refused_for_several_devices():
    """Measured (lightning 2.6, 2 CPU processes): Fabric's distributed sampler replaces a
    BatchSampler's own and the loader then yields single samples, unshuffled. Refused for several
    devices, with the reason; one device converts (nothing is replaced)."""
    source = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    dataset = TensorDataset(torch.randn(64, 4), torch.randn(64, 1))
    loader = DataLoader(dataset, batch_sampler=BatchSampler(RandomSampler(dataset), 8, drop_last=True))
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for x, y in loader:
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """
    refused = convert(source, devices=2)
    assert not refused.changed
    assert any("draws its batches from its own `batch_sampler=`" in s and "--devices 1 converts it" in s
               for s in skips(refused, "AR101")), skips(refused)
    one = convert(source)
    assert "loader = fabric.setup_dataloaders(loader)" in one.output


def test_a_loop_over_the_scripts_own_pass_through_generator_draws_from_the_loader():
    """DETR's ``for samples, targets in metric_logger.log_every(data_loader, 10, header):``: a
    generator of the script that yields each item of its first argument is the loader's batches;
    one that filters them is not."""
    template = """
    import torch
    import torch.nn as nn
    import torch.nn.functional as F
    from torch.utils.data import DataLoader, TensorDataset


    class MetricLogger:
        def log_every(self, iterable, print_freq, header=None):
            i = 0
            for obj in iterable:
                {yield_line}
                i += 1
            print(header, i)


    loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=8)
    model = nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    metric_logger = MetricLogger()
    for x, y in metric_logger.log_every(loader, 10, "train"):
        loss = F.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """
    through = convert(template.replace("{yield_line}", "yield obj"), devices=2)
    assert "loader = fabric.setup_dataloaders(loader)" in through.output
    filtered = convert(template.replace("{yield_line}", "if i % 2:\n                    yield obj"), devices=2)
    assert not filtered.changed
    assert any("batches come from `metric_logger.log_every(loader, 10, \"train\")`" in s
               for s in skips(filtered, "AR101")), skips(filtered)


def test_a_statement_left_trivial_by_its_moves_goes_whatever_its_tuple():
    """``x, y = x.to(device), y.to(device)`` and its parenthesised forms do nothing once their
    moves go, and go; a tuple with another call left (``y.float()``) stays, its move gone. The
    moves around a tuple's elements are stripped without a transformer (``_without_moves``),
    as the transformer would strip them."""
    result = convert("""
        import torch
        import torch.nn as nn

        device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        model = nn.Linear(4, 2).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 2))
        loader = torch.utils.data.DataLoader(data, batch_size=4)
        for x, y in loader:
            x, y = x.to(device), y.to(device)
            (x, y) = (x.to(device), y.to(device))
            x, y = (x.to(device)), y.to(device)
            x, y = x.to(device), y.float()
            loss = nn.functional.mse_loss(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """)
    loop = body(result).split("for x, y in loader:\n")[1]
    assert loop.splitlines()[0] == "    x, y = x, y.float()"
    assert ".to(" not in loop


def test_a_wrap_around_a_moved_model_goes_whole():
    """Issue 57/58's dead code: ``model = DDP(model.to(device), ...)`` (DiT's torchrun scripts) and
    ``model = nn.DataParallel(model.cuda())`` (semseg's) rebind the model as the wrap of itself,
    moved: the statement goes (fabric.setup wraps and places it), no ``model = model`` left."""
    ddp = convert("""
        import os
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        dist.init_process_group("gloo")
        local_rank = int(os.environ["LOCAL_RANK"])
        device = torch.device("cuda", local_rank)
        model = torch.nn.Linear(4, 1)
        model = DDP(model.to(device), device_ids=[local_rank])
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4, device=device)).sum()
        loss.backward()
        optimizer.step()
    """)
    assert "model = model" not in ddp.output and "DDP(" not in ddp.output
    assert any(n.message.startswith("removed `model = DDP(model.to(device)") for n in ddp.changes)
    dp = convert("""
        import torch

        model = torch.nn.Linear(4, 1)
        model = torch.nn.DataParallel(model.cuda())
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4).cuda()).sum()
        loss.backward()
        optimizer.step()
    """)
    assert "model = model" not in dp.output and "DataParallel" not in dp.output


def test_a_model_s_own_process_groups_are_no_reason_to_refuse():
    """iBOT's PSyncBatchNorm: a SyncBatchNorm over groups of ranks, its groups made by
    ``dist.new_group`` in the model's constructor, after Fabric has started the default group
    they are made from: the script converts (a group made in the training code is still
    refused: tests above)."""
    result = convert("""
        import os
        import torch
        import torch.distributed as dist
        from torch.nn.parallel import DistributedDataParallel as DDP

        class GroupNorm(torch.nn.SyncBatchNorm):
            def __init__(self, features, bunch):
                groups = [dist.new_group(list(range(i, i + bunch))) for i in range(0, dist.get_world_size(), bunch)]
                super().__init__(features, process_group=groups[dist.get_rank() // bunch])

        dist.init_process_group("gloo")
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), GroupNorm(4, 1))
        model = DDP(model)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    assert "fabric.setup(model, optimizer)" in result.output and "dist.new_group" in result.output


def test_model_without_ddp_is_not_assigned_twice():
    """Issue 58's dead code, DeiT's shape: ``model_without_ddp = model`` then, under ``if
    args.distributed:``, the wrap and ``model_without_ddp = model.module``. With the wrap gone the
    second assignment would repeat the first: it goes, and the emptied ``if`` with it."""
    result = convert("""
        import os
        import torch
        import torch.distributed as dist

        distributed = "RANK" in os.environ
        if distributed:
            dist.init_process_group("gloo")
        model = torch.nn.Linear(4, 1)
        model_without_ddp = model
        if distributed:
            model = torch.nn.parallel.DistributedDataParallel(model)
            model_without_ddp = model.module
        optimizer = torch.optim.SGD(model_without_ddp.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    assert result.output.count("model_without_ddp = model") == 1
    assert "if distributed:\n    model" not in result.output


def test_the_process_s_device_from_the_current_accelerator_is_fabric_s():
    """pytorch/examples' minGPT-ddp: ``torch.device(f"{acc}:{rank}")`` with ``acc`` the current
    accelerator, annotated, and ``torch.accelerator.set_device_index(rank)``: the device is
    Fabric's whole (``fabric.device``; ``f"{fabric.device}:{rank}"`` would read "cuda:0:0"), and the
    index is Fabric's to set."""
    result = convert("""
        import os
        import torch
        from torch.distributed import init_process_group
        from torch.nn.parallel import DistributedDataParallel as DDP

        def main():
            acc = torch.accelerator.current_accelerator()
            rank = int(os.environ["LOCAL_RANK"])
            device: torch.device = torch.device(f"{acc}:{rank}")
            init_process_group(backend="gloo")
            torch.accelerator.set_device_index(rank)
            model = DDP(torch.nn.Linear(4, 1).to(device), device_ids=[rank])
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = model(torch.randn(2, 4, device=device)).sum()
            loss.backward()
            optimizer.step()

        main()
    """)
    out = result.output
    assert "fabric.device}:" not in out and "set_device_index" not in out
    assert "    device: torch.device = fabric.device\n" in out
