"""Issue 13, the rewrite side (no training here; tests/test_multi_device.py runs them): what
a conversion to several devices writes for evaluation loaders, files, checkpoints, other
methods of the model, loaders from helpers, and the device count."""

from __future__ import annotations

import textwrap

import pytest

from accelerate_rewrite.api import rewrite
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


HELPER_MODULE = """\
import torch
from torch.utils.data import DataLoader, TensorDataset


def make_loaders():
    train = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True)
    return train, DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2)


def make_arrays():
    return torch.randn(8, 4), torch.randn(8, 4)
"""


def test_loaders_from_a_module_next_to_the_script_are_set_up(tmp_path):
    """``from data import make_loaders``: data.py, next to the script, is read (never changed)
    far enough to see that make_loaders returns two DataLoaders."""
    (tmp_path / "data.py").write_text(HELPER_MODULE)
    source = textwrap.dedent(LOOPS).split("def main():")[1]
    source = "import torch\nfrom data import make_loaders\n\ndef main():" + source
    out = rewrite(source, Options.create(devices=2), path=str(tmp_path / "train.py"))
    assert "    train_loader = fabric.setup_dataloaders(train_loader)\n" in out.output
    assert "    eval_loader = fabric.setup_dataloaders(eval_loader, use_distributed_sampler=False)\n" in out.output
    assert (tmp_path / "data.py").read_text() == HELPER_MODULE
    # a helper there that returns something else: seen not to be a loader, so several devices
    # are refused
    refused = rewrite(source.replace("make_loaders", "make_arrays"), Options.create(devices=2),
                      path=str(tmp_path / "train.py"))
    assert not refused.changed
    assert any("refused for several devices" in n.message for n in refused.skips)
    # a module that is not next to the script, and a source with no file: the rewrite can't see
    # what it returns, so the training loader is set up where the script receives it, and the
    # note says it was assumed (issue 26: setup_dataloaders raises at start-up on a non-loader)
    for path in (tmp_path / "elsewhere" / "train.py", None):
        kwargs = {"path": str(path)} if path else {}
        assumed = rewrite(source, Options.create(devices=2), **kwargs)
        assert "    train_loader = fabric.setup_dataloaders(train_loader)\n" in assumed.output
        assert any("assumed `train_loader` is a DataLoader" in n.message for n in assumed.changes)


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
    # a folder made with exist_ok=True is made by every process (one may write there itself)
    assert ('    os.makedirs("out", exist_ok=True)\n    if fabric.is_global_zero:\n'
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


CLEANUPS = """
    import torch
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    try:
        from apex import amp
    except ImportError:
        raise ImportError("Please install apex from https://www.github.com/nvidia/apex")

    use_cuda = torch.cuda.is_available()
    if use_cuda:
        device = torch.device("cuda")
    elif torch.backends.mps.is_available():
        device = torch.device("mps")
    else:
        device = torch.device("cpu")


    class RNN(nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = nn.GRU(4, 8, batch_first=True)
            self.register_buffer("scale", torch.ones(8))

        def forward(self, x):
            h0 = torch.zeros(1, x.size(0), 8)
            out, _ = self.rnn(x, h0.to(x.device))
            return (out[:, -1] * torch.ones(8)).sum(-1)


    model = RNN().to(device).to(torch.bfloat16)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = amp.initialize(model, optimizer, opt_level="O1")
    loader = DataLoader(TensorDataset(torch.randn(8, 5, 4)), batch_size=2)
    for (x,) in loader:
        loss = model(x.to(device).to(torch.bfloat16)).sum()
        optimizer.zero_grad()
        with amp.scale_loss(loss, optimizer) as scaled_loss:
            scaled_loss.backward()
        optimizer.step()
"""


def test_branches_and_trys_left_empty_go_whole():
    """No ``if use_cuda: pass / else: pass`` and no ``try: pass / except ImportError:`` left
    behind once the device lines and the apex import went."""
    result = convert(CLEANUPS, precision="bf16-mixed", devices=2)
    out = result.output
    assert "pass" not in out and "try:" not in out and "ImportError" not in out
    assert "if use_cuda" not in out and "mps" not in out
    assert "use_cuda = torch.cuda.is_available()" in out  # the condition's name stays (it is the user's)
    assert not [s for s in result.skips if "x.device" in s.message and "left as is" in s.message]
    assert rewrite(out, Options.create(precision="bf16-mixed", devices=2)).output == out


def test_an_if_whose_condition_does_something_stays():
    source = CLEANUPS.replace("if use_cuda:", "if setup_cuda():").replace(
        "use_cuda = torch.cuda.is_available()", "def setup_cuda():\n        return True")
    out = convert(source, precision="bf16-mixed", devices=2).output
    assert "if setup_cuda():\n    pass\n" in out


def test_weights_cast_to_bf16_go_under_a_mixed_precision():
    """bf16-mixed keeps fp32 master weights: the script's own bf16 casts of the model and its
    batches go (AR209), and say so; at bf16-true they stay (the weights are meant to be bf16)."""
    result = convert(CLEANUPS, precision="bf16-mixed", devices=2)
    assert "bfloat16" not in result.output
    assert any(c.rule == "AR209" and "bf16 cast" in c.message for c in result.changes)
    kept = convert(CLEANUPS, precision="bf16-true", devices=2)
    assert "model = RNN().to(torch.bfloat16)" in kept.output


def test_tensors_a_forward_makes_without_a_device_are_named():
    result = convert(CLEANUPS, precision="bf16-mixed", devices=2)
    notes = [s for s in result.skips if s.rule == "AR105" and "makes its tensor on the CPU" in s.message]
    assert [(s.line, s.message.split("`")[1]) for s in notes] == [(27, "torch.zeros(1, x.size(0), 8)"),
                                                                  (29, "torch.ones(8)")]
    assert "`RNN.forward`" in notes[0].message and "x.device" in notes[0].message


def test_shard_eval_reduces_the_sums_after_the_evaluation_loop():
    out = convert(LOOPS, devices=2, shard_eval=True)
    assert "train_loader, eval_loader = fabric.setup_dataloaders(train_loader, eval_loader)\n" in out.output
    assert '    total = fabric.all_reduce(total, reduce_op="sum").item()\n' \
           '    fabric.print(total / len(eval_loader.dataset))' in out.output
    assert any("--shard-eval" in c.message and "`total`" in c.message for c in out.changes)
    # one device: nothing to shard, the option changes nothing
    assert convert(LOOPS, devices=1, shard_eval=True).output == convert(LOOPS, devices=1).output


def test_shard_eval_leaves_what_it_cannot_reduce_unsharded_and_says_why():
    appended = LOOPS.replace("total = 0.0", "outputs = []").replace(
        "total += model(x.to(device)).sum().item()", "outputs.append(model(x.to(device)))").replace(
        "print(total / len(eval_loader.dataset))", "print(sum(o.sum() for o in outputs))")
    per_batch = LOOPS.replace("len(eval_loader.dataset)", "len(eval_loader)")
    for source, why in ((appended, "`outputs.append(...)` collects results per process"),
                        (per_batch, "`len(eval_loader)` divides by the number of batches")):
        out = convert(source, devices=2, shard_eval=True)
        assert "setup_dataloaders(eval_loader, use_distributed_sampler=False)" in out.output
        assert "all_reduce" not in out.output
        [note] = [s for s in out.skips if "--shard-eval" in s.message]
        assert why in note.message and "every process evaluates all of it" in note.message


METER = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    class Meter:
        def __init__(self, prefix):
            self.prefix = prefix

        def display(self, value):
            print(self.prefix, value)

    class Net(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 1)

        def describe(self):
            print("parameters:", sum(p.numel() for p in self.parameters()))

        def forward(self, x):
            return self.fc(x)

    def validate(loader, model):
        meter = Meter("val")
        with torch.no_grad():
            for (x,) in loader:
                meter.display(model(x).sum().item())

    def main():
        device = "cuda" if torch.cuda.is_available() else "cpu"
        loader = DataLoader(TensorDataset(torch.randn(8, 4)), batch_size=2, shuffle=True)
        model = Net().to(device)
        model.describe()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for (x,) in loader:
            loss = model(x.to(device)).sum()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        validate(loader, model)

    if __name__ == "__main__":
        main()
"""


def test_a_print_reaches_fabric_through_the_functions_that_build_its_printer():
    """Issue 57: the ImageNet example's ``validate`` builds a ProgressMeter whose ``display``
    prints; on several devices each process printed every line. The class receives `fabric`
    (kept in ``self.fabric``), and so does ``validate``, which builds it, from ``main``: every
    line is rank 0's. A model keeps no `fabric` (it would be saved and copied with it): its own
    print stays, said to print on every process. On one device nothing of this is needed."""
    two = convert(METER, devices=2)
    out = two.output
    assert "    def __init__(self, fabric, prefix):\n        self.fabric = fabric\n" in out
    assert "        self.fabric.print(self.prefix, value)\n" in out
    assert "def validate(fabric, loader, model):\n    meter = Meter(fabric, \"val\")\n" in out
    assert "    validate(fabric, loader, model)\n" in out
    assert '        print("parameters:"' in out and "class Net(torch.nn.Module):\n    def __init__(self):\n" in out
    assert any("prints on every process" in n.message and n.line == 18 for n in two.skips)
    assert "def validate(loader, model):" in convert(METER).output


ADDER = """
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    if __name__ == "__main__":
        torch.manual_seed(0)
        data = TensorDataset(torch.randn(40, 4), torch.randn(40, 1))
        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
        train_loader = DataLoader(data, batch_size=4, shuffle=True)

        def eval_split(split):
            loader = DataLoader(data, batch_size=8)
            total, seen = 0.0, 0
            for x, y in loader:
                total += (model(x) - y).pow(2).sum().item()
                seen += len(x)
            print(f"{split} final score: {total:.6f} over {seen}")

        for x, y in train_loader:
            loss = (model(x) - y).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        with torch.no_grad():
            eval_split("train")
"""


def test_an_evaluation_helper_called_under_no_grad_evaluates_all_of_its_loader():
    """Issue 57, minGPT's adder: ``eval_split`` builds its own loader and is called only under
    ``torch.no_grad()`` (its loop holds no sign of evaluation itself): an evaluation, so its
    loader is not sharded, and every process scores the whole set (was: half of it, "train final
    score: 0/4750" where one device said 0/9500)."""
    out = convert(ADDER, devices=2, accelerator="cpu").output
    assert "        loader = fabric.setup_dataloaders(loader, use_distributed_sampler=False)\n" in out
    assert "    train_loader = fabric.setup_dataloaders(train_loader)\n" in out


@pytest.mark.runs
@pytest.mark.slow  # (CI time: two processes that each import lightning)
def test_an_evaluation_helper_scores_the_whole_set_on_two_processes(tmp_path):
    pytest.importorskip("lightning")
    import sys

    from tests import processes

    source = textwrap.dedent(ADDER)
    (tmp_path / "original.py").write_text(source)
    (tmp_path / "rewritten.py").write_text(convert(ADDER, devices=2, accelerator="cpu").output)
    one = processes.run([sys.executable, "original.py"], cwd=tmp_path, timeout=300)
    two = processes.run([sys.executable, "rewritten.py"], cwd=tmp_path, timeout=300)
    assert one.returncode == 0 and two.returncode == 0, two.stderr[-2000:]
    scores = [line for line in two.stdout.splitlines() if "final score" in line]
    assert scores == [line for line in one.stdout.splitlines() if "final score" in line]
    assert scores and scores[0].endswith("over 40")
