"""Issue 25: never a wrong or hollow conversion.

What end-to-end runs of real scripts showed, each as a small script in its shape: a set-up that
no forward runs through (a layer that trains itself; a model set up where nobody reads it), Fabric
created in a loop, processes the script starts itself (Hogwild), a checkpoint read back before
rank 0 finished writing it or with Fabric's patch in it, prints left per process, a summary that
contradicts the file, and notes that don't say what the code does. The 2-process runs of the
fixtures in these shapes (word_lm, autoencoder_sums) are in tests/test_multi_device.py.
"""

from __future__ import annotations

import re
from textwrap import dedent

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from accelerate_rewrite.report import numerics
from tests.goldens import FIXTURES, run
from tests.test_conversions import assert_left_alone, body, convert, skips

HEAD = """
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 2)

    def forward(self, x):
        return self.fc(x)

"""


# ---- 1. hollow set-ups ---------------------------------------------------------------------------

def test_a_layer_that_trains_itself_is_refused_at_every_precision():
    for options in ({}, {"precision": "bf16-mixed"}, {"precision": "bf16-mixed", "devices": 4}):
        result = run("layer_local_training", "default") if not options else rewrite(
            (FIXTURES / "layer_local_training" / "input.py").read_text(), Options.create(**options))
        assert not result.changed
        reason = next(n.message for n in result.skips if n.rule == "AR101")
        assert "`Layer` trains itself" in reason and "bypass Fabric's wrapper" in reason, reason


def test_fabric_is_never_created_in_a_loop_that_makes_the_objects():
    result = convert(HEAD + dedent("""
        class Member:
            def __init__(self, device):
                self.model = Net().to(device)
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

            def fit(self, x, y):
                self.optimizer.zero_grad()
                loss = F.cross_entropy(self.model(x), y)
                loss.backward()
                self.optimizer.step()


        device = torch.device("cuda")
        members = []
        for i in range(3):
            members.append(Member(device))
        for member in members:
            member.fit(torch.randn(4, 8, device=device), torch.randint(0, 2, (4,), device=device))
    """), precision="bf16-mixed")
    assert_left_alone(result, "AR101", "Member.__init__", "`Member(...)` is made in a loop")


def test_a_set_up_that_no_forward_runs_through_is_refused():
    # the forward runs before the optimizer exists: a set-up after it would bind a model that
    # nothing reads again, and the run would print fp32 numbers under a bf16-mixed summary
    result = convert(HEAD + dedent("""
        device = torch.device("cuda")
        model = Net().to(device)
        x = torch.randn(4, 8, device=device)
        out = model(x)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = out.pow(2).mean()
        loss.backward()
        optimizer.step()
    """), precision="bf16-mixed")
    assert_left_alone(result, "AR101", "`model` would be set up after line", "nothing reads it afterwards")


def test_a_model_read_only_in_functions_defined_before_its_set_up_is_not_hollow():
    result = convert(HEAD + dedent("""
        def train(x):
            optimizer.zero_grad()
            loss = model(x).pow(2).mean()
            loss.backward()
            optimizer.step()


        device = torch.device("cuda")
        model = Net().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(3):
            train(torch.randn(4, 8, device=device))
    """))
    assert "model, optimizer = fabric.setup(model, optimizer)" in result.output


# ---- 5. processes the script starts itself -------------------------------------------------------

def test_hogwild_is_refused_with_or_without_share_memory():
    source = (FIXTURES / "hogwild" / "input.py").read_text()
    result = rewrite(source, Options.create(devices=4))
    assert not result.changed and "shares the model between processes" in skips(result, "AR101")[0]
    result = rewrite(source.replace("    model.share_memory()", "    pass"), Options.create(devices=4))
    assert not result.changed
    assert "`mp.Process(target=train, args=(rank, args, mo...` runs `train`, which trains, in processes " \
           "the script starts itself (not DDP)" in skips(result, "AR101")[0]


def test_a_pool_that_only_prepares_data_is_no_reason_to_refuse():
    result = convert(HEAD + dedent("""
        from multiprocessing import Pool


        def featurize(row):
            return [float(v) for v in row]


        if __name__ == "__main__":
            with Pool(2) as pool:
                rows = pool.map(featurize, [[1, 2, 3, 4, 5, 6, 7, 8]] * 16)
            x = torch.tensor(rows)
            device = torch.device("cuda")
            model = Net().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = model(x.to(device)).pow(2).mean()
            loss.backward()
            optimizer.step()
    """), devices=2)
    assert "fabric.setup(model, optimizer)" in result.output


# ---- 2. checkpoints ------------------------------------------------------------------------------

def test_a_whole_model_saved_by_rank_zero_is_read_after_a_barrier_and_without_fabric_s_patch():
    output = run("word_lm", "bf16-mixed-devices-4").output
    assert re.search(r'\n# Load the best saved model\.\nfabric\.barrier\(\)\nwith open\(args\.save, "rb"\) as f:',
                     output)
    assert ('                    vars(model.module).pop("forward", None)  # Fabric\'s patched forward would '
            'not load\n                    torch.save(model.module, f)\n') in output
    assert 'model.mark_forward_method("init_hidden")' in output


BEST_AND_RESUME = HEAD + """
parser = argparse.ArgumentParser()
parser.add_argument("--resume", default="")
args = parser.parse_args()
device = torch.device("cuda")
model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
if args.resume:
    model = torch.load(args.resume)  # read before anything is written: no barrier
loader = DataLoader(TensorDataset(torch.randn(16, 8), torch.randint(0, 2, (16,))), batch_size=4)
for x, y in loader:
    x, y = x.to(device), y.to(device)
    optimizer.zero_grad()
    loss = F.cross_entropy(model(x), y)
    loss.backward()
    optimizer.step()
torch.save(model, "best.pt")
if RANK_CHECK:
    best = torch.load("best.pt")
"""


def test_a_barrier_only_where_every_process_reads_what_rank_zero_wrote():
    result = convert(BEST_AND_RESUME.replace("RANK_CHECK", "True"), devices=2)
    out = body(result)
    assert out.count("fabric.barrier()") == 1
    assert "    fabric.barrier()\n    best = torch.load(\"best.pt\")" in out or \
           "fabric.barrier()\n    best = fabric.load(\"best.pt\")" in out, out
    # read on rank 0 alone: a barrier there would wait for processes that never come
    result = convert(BEST_AND_RESUME.replace("RANK_CHECK", "fabric_rank == 0").replace(
        "args = parser.parse_args()", "args = parser.parse_args()\nfabric_rank = 0"), devices=2)
    assert "fabric.barrier()" not in result.output


# ---- 4. prints -----------------------------------------------------------------------------------

DCGAN_HEAD = HEAD + """
parser = argparse.ArgumentParser()
parser.add_argument("--manualSeed", type=int, default=None)
opt = parser.parse_args()
print(opt)
ENVIRONMENT
print("Random Seed: ", opt.manualSeed)
torch.manual_seed(opt.manualSeed or 0)

device = torch.device("cuda")
model = Net().to(device)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
loss.backward()
optimizer.step()
"""


def test_fabric_is_created_before_the_prints_just_above_it():
    result = convert(DCGAN_HEAD.replace("ENVIRONMENT", ""), devices=2)
    assert "opt = parser.parse_args()\nfabric = Fabric(devices=2)\nfabric.launch()\nfabric.print(opt)\n" \
           in result.output
    assert 'fabric.print("Random Seed: ", opt.manualSeed)' in result.output
    assert not [m for m in skips(result, "AR108")]


def test_fabric_stays_after_what_sets_up_the_process_s_environment():
    result = convert("import os\n" + DCGAN_HEAD.replace(
        "ENVIRONMENT", 'os.environ["CUDA_VISIBLE_DEVICES"] = "0"'), devices=2)
    assert 'os.environ["CUDA_VISIBLE_DEVICES"] = "0"\nfabric = Fabric(devices=2)\nfabric.launch()\n' \
           'fabric.print("Random Seed: ", opt.manualSeed)' in result.output
    assert "\nprint(opt)\n" in result.output
    assert "`print(opt)` prints on every process: it runs before Fabric exists" in skips(result, "AR108")


def test_every_print_left_per_process_is_listed_with_several_devices_only():
    source = HEAD + dedent("""
        class Logger:
            def log(self, text):
                print("log:", text)


        def main():
            device = torch.device("cuda")
            model = Net().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            logger = Logger()
            loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
            loss.backward()
            optimizer.step()
            logger.log(f"loss {loss.item():.4f}")
            print("done")


        main()
    """)
    many = convert(source, devices=2)
    assert 'fabric.print("done")' in many.output
    assert skips(many, "AR108") == ["`print(\"log:\", text)` prints on every process: `fabric` can't be reached here"]
    assert not skips(convert(source), "AR108")


# ---- 6. the summary says what the file does ------------------------------------------------------

def test_the_numerics_line_states_the_precision_the_file_sets():
    options = Options.create(precision="bf16-mixed")
    lbfgs = rewrite((FIXTURES / "lbfgs" / "input.py").read_text(), options)
    assert 'precision="bf16-mixed"' not in lbfgs.output
    assert numerics(lbfgs, options) == "unchanged: the rewrite keeps the math"
    mnist = rewrite((FIXTURES / "mnist_style" / "input.py").read_text(), options)
    assert numerics(mnist, options).startswith("approximate (Fabric at bf16-mixed)")
    # apex's opt_level sets the precision without --precision
    apex = rewrite((FIXTURES / "apex_o1" / "input.py").read_text(), Options.create())
    assert 'precision="16-mixed"' in apex.output
    assert "approximate (Fabric at 16-mixed" in numerics(apex, Options.create())


def test_the_numerics_line_says_shards_only_where_a_training_loader_was_set_up():
    """word_lm batches its tensors by hand: on 2 processes no loader of the training data is set
    up (AR104 says why), and each process trains on the whole set; the line said "each trains on
    its shard of the training data" (the verifier's 2 processes computed the original's losses)."""
    options = Options.create(devices=2)
    word_lm = rewrite((FIXTURES / "word_lm" / "input.py").read_text(), options)
    assert numerics(word_lm, options).startswith("devices=2: no loader of the training data was set up (AR104, "
                                                 "left alone), so every process trains on the whole set")
    mnist = rewrite((FIXTURES / "mnist_style" / "input.py").read_text(), options)
    assert numerics(mnist, options).startswith("devices=2: with several processes each trains on its shard")


# ---- 7. notes true to the code -------------------------------------------------------------------

def test_one_note_for_one_place():
    # two moves on one line that `fabric` can't reach: one note, not the same one twice
    result = convert(HEAD + dedent("""
        class Evaluator:
            def run(self, model, x, y):
                x, y = x.cuda(), y.cuda()
                return F.cross_entropy(model(x), y).item()


        def main():
            device = torch.device("cuda")
            model = Net().to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
            loss.backward()
            optimizer.step()
            print(Evaluator().run(model, torch.randn(4, 8), torch.randint(0, 2, (4,))))


        main()
    """))
    notes = [(n.rule, n.line, n.message) for n in result.notes]
    assert len(notes) == len(set(notes))
    line = result.source.splitlines().index("        x, y = x.cuda(), y.cuda()") + 1
    assert [n.message for n in result.skips if n.line == line] == ["`fabric` can't be reached here; the move is kept"]


def test_an_emptied_else_goes_without_a_pass():
    result = convert(HEAD + dedent("""
        if torch.cuda.is_available():
            print("using CUDA")
            device = torch.device("cuda")
        else:
            device = torch.device("cpu")
        model = Net().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
        loss.backward()
        optimizer.step()
    """))
    assert "else:" not in result.output and "pass" not in result.output
    assert 'if torch.cuda.is_available():\n    fabric.print("using CUDA")\n' in result.output


def test_the_emptied_tail_of_an_elif_chain_goes_whole():
    # the ImageNet example's placement: DataParallel by architecture (a string's startswith, a
    # query) under `elif device.type == "cuda"`, `model.to(device)` in the last else
    result = convert(HEAD + dedent("""
        arch = "resnet18"
        use_accel = torch.cuda.is_available()
        device = torch.device("cuda" if use_accel else "cpu")
        model = Net()
        if not use_accel:
            print("using CPU, this will be slow")
        elif device.type == "cuda":
            if arch.startswith("alexnet") or arch.startswith("vgg"):
                model.cuda()
            else:
                model = torch.nn.DataParallel(model).cuda()
        else:
            model.to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
        loss.backward()
        optimizer.step()
    """))
    assert "pass" not in result.output and "elif" not in result.output and "else" not in result.output
    assert 'if not use_accel:\n    fabric.print("using CPU, this will be slow")\n' in result.output


def test_a_clip_unscaled_under_an_if_above_it_gets_no_note():
    # nanoGPT's: `if grad_clip != 0.0: scaler.unscale_(optimizer); clip_grad_norm_(...)`, the
    # scaler's step after the `if`
    result = convert(HEAD + dedent("""
        device = torch.device("cuda")
        model = Net().to(device)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        scaler = torch.cuda.amp.GradScaler(enabled=True)
        grad_clip = 1.0
        for _ in range(3):
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(torch.randn(4, 8, device=device)).pow(2).mean()
            scaler.scale(loss).backward()
            if grad_clip != 0.0:
                scaler.unscale_(optimizer)
                torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad(set_to_none=True)
    """), backend="torch", precision="16-mixed")
    assert not skips(result, "AR202")
    assert result.output.count("unscale_") == 1


def test_a_progress_bar_is_drawn_by_rank_zero_alone():
    source = HEAD + dedent("""
        from tqdm import tqdm

        device = torch.device("cuda")
        model = Net().to(device)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)
        for epoch in range(2):
            for (x,) in tqdm(
                loader,
                desc=f"epoch {epoch}",
            ):
                loss = model(x.to(device)).pow(2).mean()
                loss.backward()
                optimizer.step()
            for (x,) in tqdm(loader, disable=True):
                pass
    """)
    result = convert(source, devices=2)
    assert ('tqdm(\n        loader,\n        desc=f"epoch {epoch}",\n        disable=not fabric.is_global_zero,\n'
            '    ):') in result.output
    assert "tqdm(loader, disable=True)" in result.output
    assert "is_global_zero" not in convert(source).output  # one device: nothing to say
