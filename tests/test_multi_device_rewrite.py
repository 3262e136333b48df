"""Issue 13, the rewrite side (no training here; tests/test_multi_device.py runs them): what
a conversion to several devices writes for evaluation loaders, files, checkpoints, other
methods of the model, loaders from helpers, and the device count."""

from __future__ import annotations

import textwrap

from accelerate_rewrite.codemod.engine import rewrite
from accelerate_rewrite.options import Options

LOOPS = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    def make_loaders():
        train = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True)
        held_out = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)
        return train, held_out

    def main():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        train_loader, eval_loader = make_loaders()
        model = torch.nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in train_loader:
            loss = model(x.to(device)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.eval()
        total = 0.0
        for (x,) in eval_loader:
            total += model(x.to(device)).sum().item()
        print(total / len(eval_loader.dataset))
"""


def convert(source: str, **options):
    return rewrite(textwrap.dedent(source), Options.create(**options), path="train.py")


def test_without_devices_one_device_is_written_and_with_a_strategy_auto():
    assert "fabric = Fabric(devices=1)\n" in convert(LOOPS).output
    assert 'fabric = Fabric(strategy="ddp")\n' in convert(LOOPS, strategy="ddp").output


def test_loaders_from_a_helper_are_set_up_and_evaluation_is_not_sharded():
    out = convert(LOOPS, devices=2).output
    assert "    train_loader = fabric.setup_dataloaders(train_loader)\n" in out
    assert "    eval_loader = fabric.setup_dataloaders(eval_loader, use_distributed_sampler=False)\n" in out
    assert "train = DataLoader(" in out  # the helper itself is unchanged


def test_data_that_is_not_a_set_up_loader_refuses_several_devices_only():
    source = LOOPS.replace("train_loader, eval_loader = make_loaders()",
                           "train_loader, eval_loader = make_loaders(), None")
    two = convert(source, devices=2)
    assert not two.changed
    assert any("refused for several devices" in n.message for n in two.skips)
    assert "fabric.backward(loss)" in convert(source, devices=1).output


def test_side_effects_go_to_rank_zero_and_downloads_go_first():
    out = convert("""
        import os
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        class Data(TensorDataset):
            def __init__(self, root, download=False):
                super().__init__(torch.randn(8, 4))

        def main():
            device = "cuda" if torch.cuda.is_available() else "cpu"
            data = Data("data", download=True)
            loader = DataLoader(data, batch_size=2)
            model = torch.nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            for (x,) in loader:
                loss = model(x.to(device)).sum()
                loss.backward()
                optimizer.step()
            os.makedirs("out", exist_ok=True)
            torch.save(model, "out/model.pt")
            with open("out/done.txt", "w") as fh:
                fh.write("done")
    """, devices=2).output
    assert '    with fabric.rank_zero_first():\n        data = Data("data", download=True)\n' in out
    assert ('    if fabric.is_global_zero:\n        os.makedirs("out", exist_ok=True)\n'
            '        torch.save(model.module, "out/model.pt")\n        with open("out/done.txt", "w") as fh:\n'
            in out)


def test_torch_load_of_an_open_file_is_left_with_the_reason():
    result = convert("""
        import torch
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        with open("ckpt.pt", "rb") as fh:
            model.load_state_dict(torch.load(fh))
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
    """)
    assert "torch.load(fh)" in result.output
    assert any("takes a path" in n.message for n in result.skips)


def test_other_methods_of_the_model_are_marked_as_forward_methods():
    out = convert("""
        import torch
        class AE(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.dec = torch.nn.Linear(2, 4)
            def decode(self, z):
                return self.dec(z)
            def forward(self, x):
                return self.decode(x[:, :2])
        model = AE()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4)).sum()
        loss.backward()
        optimizer.step()
        sample = model.decode(torch.randn(1, 2))
    """).output
    assert 'model, optimizer = fabric.setup(model, optimizer)\nmodel.mark_forward_method("decode")\n' in out


def test_a_flag_that_no_longer_chooses_the_device_is_named():
    result = convert("""
        import argparse
        import torch
        parser = argparse.ArgumentParser()
        parser.add_argument("--no-cuda", action="store_true")
        parser.add_argument("--cuda-graphs", action="store_true")
        args = parser.parse_args()
        use_cuda = not args.no_cuda and torch.cuda.is_available()
        device = torch.device("cuda" if use_cuda else "cpu")
        model = torch.nn.Linear(4, 1).to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(2, 4, device=device)).sum()
        loss.backward()
        optimizer.step()
    """)
    notes = [n for n in result.skips if "command-line flag" in n.message]
    assert [(n.line, n.rule) for n in notes] == [(5, "AR105")]
    assert "`--no-cuda`" in notes[0].message
