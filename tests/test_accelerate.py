"""Issue 47: ``--backend accelerate`` writes the Fabric plan in Hugging Face Accelerate's API
(rules/accelerate/spelling.py), on one process and on several (one node).

The goldens of every fixture (option set ``accelerate-bf16-mixed``) are checked by
tests/test_fixtures.py; here, what they must hold, and runs both ways.
"""

from __future__ import annotations

import ast
import json
import re

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options
from tests.goldens import FIXTURES, fixture_names, run

ACCELERATE = "accelerate-bf16-mixed"


def _names(code: str) -> set[str]:
    tree = ast.parse(code)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name) and n.value.id == "self"}


@pytest.mark.parametrize("flags, said", [
    ({"precision": "16-true"}, "--precision 16-true has no Accelerate equivalent"),
    ({"precision": "bf16-true"}, "--precision bf16-true has no Accelerate equivalent"),
    ({"strategy": "fsdp"}, "--strategy fsdp: --backend accelerate does not write Accelerate's FSDP"),
])
def test_what_accelerate_does_not_take_yet_is_refused_with_the_reason(flags, said):
    with pytest.raises(OptionError, match=said.replace("(", r"\(").replace(")", r"\)")):
        Options.create(backend="accelerate", **flags)


#: where Accelerate's prepared optimizer can't stand in for the optimizer: its step returns None
#: (accelerate 1.15), and L-BFGS's script reads the closure's loss from it
REFUSED = {"lbfgs": "`optimizer.step(closure)`'s result is read, and the step of an optimizer Accelerate prepares"}
#: where Accelerate's prepared model on several processes (DistributedDataParallel) can't stand
#: in for the module (word_lm's ``init_hidden`` only probes the parameters, VAE's ``decode`` runs
#: under no_grad: both read the module, unwrapped): solver_class hands the set-up model to its own
#: ``print_network``, a method of the Solver, not a function the analysis reads
SEVERAL_REFUSED: dict[str, str] = {
    "solver_class": '`self.print_network(self.net, "Net")` is given the set-up `self.net`: under Accelerate\'s',
}


@pytest.mark.parametrize("fabric_set, accelerate_set", [("default", ACCELERATE),
                                                        ("bf16-mixed-devices-4", ACCELERATE + "-devices-2")])
def test_every_fixture_fabric_converts_accelerate_converts_or_says_why(fabric_set, accelerate_set):
    """The same plan: where the Fabric backend converts a fixture, the Accelerate backend does,
    or refuses with a reason of its own."""
    converted = 0
    for name in fixture_names():
        fabric, accelerate = run(name, fabric_set), run(name, accelerate_set)
        assert not accelerate.dropped, (name, accelerate.dropped)
        if "Fabric(" not in fabric.output or "Fabric(" in fabric.source:
            assert "Accelerator(" not in accelerate.output, name
            continue
        if "Accelerator(" in accelerate.output:
            converted += 1
            continue
        if name in REFUSED:
            assert any(REFUSED[name] in n.message for n in accelerate.skips), name
            continue
        assert name in SEVERAL_REFUSED and accelerate_set != ACCELERATE, name
        assert any(SEVERAL_REFUSED[name] in n.message for n in accelerate.skips), name
    assert converted >= 38


@pytest.mark.parametrize("option_set", [ACCELERATE, ACCELERATE + "-devices-2"])
def test_an_accelerate_output_has_no_fabric_left_and_is_accelerate_s_api(option_set):
    for name in fixture_names():
        result = run(name, option_set)
        if "Accelerator(" not in result.output:
            continue
        names = _names(result.output)
        assert "fabric" not in names and "Fabric" not in names, name
        assert "lightning" not in result.output.replace(result.source, ""), name
        assert "from accelerate import Accelerator\n" in result.output, name
        # bf16, or none where the script keeps its own autocast (the plan omits the precision)
        created = re.search(r"accelerator = Accelerator\((.*)\)\n", result.output)
        assert created and ('mixed_precision="bf16"' in created.group(1) or "mixed_precision" not in created.group(1)), name
        assert not any("fabric" in n.message for n in result.changes), (name, [n.message for n in result.changes])


def test_the_seed_s_script_in_accelerate_s_api():
    """cvpr2023 01's shape (fixtures/vit_finetune): `train(..., accelerator)`, the loaders and the
    model with its optimizer prepared where Fabric sets them up, backward and print Accelerate's,
    no launch (one process: ``python train.py`` or ``accelerate launch``)."""
    out = run("vit_finetune", ACCELERATE).output
    assert "def train(num_epochs, model, optimizer, train_loader, val_loader, accelerator):" in out
    assert "    train_loader = accelerator.prepare(train_loader)\n" in out
    assert "    val_loader, test_loader = accelerator.prepare(val_loader, test_loader)\n" in out
    assert "    model, optimizer = accelerator.prepare(model, optimizer)\n" in out
    assert "            accelerator.backward(loss)\n" in out
    assert "launch" not in out and "accelerator=accelerator" in out


def test_clipping_and_the_rank_checks_are_spelled_as_accelerate_s():
    source = """
import torch
import torch.nn as nn

model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)))
for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(model.state_dict(), "model.pt")
"""
    result = rewrite(source, Options.create(backend="accelerate", clip_grad_norm=1.0, accelerator="cpu"))
    out = result.output
    assert "accelerator = Accelerator(cpu=True)\n" in out
    assert "    accelerator.clip_grad_norm_(model.parameters(), 1.0)\n" in out
    # torch's save stays, written by the main process (one process: the model is the module itself)
    assert 'if accelerator.is_main_process:\n    torch.save(model.state_dict(), "model.pt")' in out


def test_a_script_with_its_own_accelerator_name_is_left_as_it_was():
    source = (FIXTURES / "train_function" / "input.py").read_text(encoding="utf-8")
    source = source.replace("import torch\n", "import torch\naccelerator = 'cpu'\n", 1)
    result = rewrite(source, Options.create(backend="accelerate"))
    assert "Accelerator(" not in result.output
    assert any("a name `accelerator` of its own" in d for d in result.dropped)


def test_a_second_run_changes_nothing():
    for name in ("vit_finetune", "trainer_class", "gan"):
        first = run(name, ACCELERATE)
        again = rewrite(first.output, Options.create(backend="accelerate", precision="bf16-mixed"))
        assert again.output == first.output, name


# ---- run both ways ------------------------------------------------------------------------------

RUN = dict(steps=8, threads=1, run_on="cpu")


@pytest.fixture
def fixture_copy(tmp_path, monkeypatch):
    import shutil

    def copy(name: str):
        shutil.copy(FIXTURES / name / "input.py", tmp_path / "input.py")
        monkeypatch.chdir(tmp_path)
        return tmp_path / "input.py"

    return copy


def _runnable() -> list:
    """Every fixture tests/test_verify.py runs both ways that the Accelerate backend converts:
    gan and train_function in the default run (CI), the others in the ``slow`` set."""
    from tests.test_verify import RUNNABLE

    converted = [n for n in RUNNABLE if "Accelerator(" in run(n, ACCELERATE).output]
    return [n if n in ("gan", "train_function") else pytest.param(n, marks=pytest.mark.slow) for n in converted]


@pytest.mark.runs
@pytest.mark.parametrize("name", _runnable())
def test_an_accelerate_rewrite_at_32_true_prints_the_original_s_numbers(name, fixture_copy):
    """``verify --backend accelerate`` at 32-true ("no" mixed precision): the losses and
    gradient norms of every step identical to the original's."""
    import shutil

    pytest.importorskip("accelerate")
    from accelerate_rewrite.verify.session import verify
    from tests.goldens import ROOT

    path = fixture_copy(name)
    for stub in ("apex", "timm"):  # stand-ins, as tests/test_verify.py gives them
        if name.startswith(stub):
            shutil.copytree(ROOT / "tests" / "stubs" / stub, path.parent / stub)
    v = verify(path, Options.create(backend="accelerate", precision="32-true"), **RUN)
    assert v.verdict.verdict == "pass", v.verdict.reason
    assert v.rewritten.losses == v.original.losses and len(v.original.losses) > 0


@pytest.mark.runs
def test_an_accelerate_rewrite_at_bf16_passes_and_a_planted_bug_fails(fixture_copy):
    """bf16 ("bf16" mixed precision) judged as Fabric's is: PASS; the same rewrite with the
    learning rate changed: FAIL."""
    pytest.importorskip("accelerate")
    from accelerate_rewrite.verify.session import verify

    path = fixture_copy("gan")
    options = Options.create(backend="accelerate", precision="bf16-mixed")
    v = verify(path, options, **RUN)
    assert v.verdict.verdict == "pass", v.verdict.reason
    good = run("gan", ACCELERATE).output
    assert "lr=2e-3" in good
    buggy = path.parent / "buggy.py"
    buggy.write_text(good.replace("lr=2e-3", "lr=2.2e-3", 1), encoding="utf-8")
    bad = verify(path, options, against=buggy, **RUN)
    assert bad.verdict.verdict == "fail", bad.verdict.reason


def test_several_processes_keep_what_the_module_gives_and_each_sampler_shards_once():
    """On several processes a read of the set-up model other than its forward goes through
    ``unwrap_model`` (a checkpoint of the module's state dict, as the original's reader loads
    it; the script's own ``ddp_model.module``), written by the main process; a loader with its
    own DistributedSampler is not sharded again; evaluation loaders stay whole; the group ends
    with ``end_training()``; the summary says how to launch."""
    spawn = run("ddp_spawn", ACCELERATE + "-devices-2").output
    assert 'torch.save(accelerator.unwrap_model(ddp_model).state_dict(), "ddp_toy.pt")' in spawn
    assert "    accelerator.unwrap_model(ddp_model).load_state_dict(state)\n" in spawn
    assert ("    loader = prepare_data_loader(loader, accelerator.device, num_processes=1, process_index=0, "
            "put_on_device=True)\n") in spawn
    assert 'map_location="cpu" if accelerator.device.type == "cpu" else accelerator.device' in spawn
    trainer = run("ddp_trainer", ACCELERATE + "-devices-2").output
    assert "    accelerator.end_training()\n" in trainer
    style = run("imagenet_style", ACCELERATE + "-devices-2").output
    assert "prepare_data_loader(val_loader, accelerator.device, num_processes=1" in style
    assert "accelerator.unwrap_model(model).state_dict()" in style
    from accelerate_rewrite.launch import run_lines
    [line] = run_lines("train.py", Options.create(backend="accelerate", devices=4))
    assert line.startswith("run it: accelerate launch --multi_gpu --num_processes 4 train.py")


@pytest.mark.runs
@pytest.mark.parametrize("name", ["mnist_style", pytest.param("trainer_given_loaders", marks=pytest.mark.slow)])
def test_verify_on_two_processes_passes_them_against_the_original_on_their_batches_joined(name, tmp_path):
    """Issue 61: ``verify --backend accelerate --run-devices 2`` (it was refused) starts the
    rewrite's 2 processes with torchrun, each with the harness, on the CPU (ACCELERATE_USE_CPU,
    as ``Accelerator(cpu=True)``), each process on its share of the data; the original runs again
    on the batches the 2 processes drew, joined step by step, and the processes' averaged losses
    and gradients PASS against it: a plain loop with dropout (within 3x of what a reseed of the
    original changes) and a Trainer class given its loaders (exactly)."""
    from accelerate_rewrite.verify.compare import PASS
    from accelerate_rewrite.verify.session import verify

    pytest.importorskip("accelerate")
    script = tmp_path / "train.py"
    script.write_text((FIXTURES / name / "input.py").read_text(encoding="utf-8"), encoding="utf-8")
    done = verify(script, Options.create(backend="accelerate", devices=2), run_devices=2, run_on="cpu", steps=4,
                  threads=1)
    assert done.verdict.verdict == PASS, done.verdict.reason
    assert done.rewritten.world_size == 2 and done.original.world_size == done.joined.world_size == 1
    assert done.verdict.reason.startswith("held to the original on the 2 processes' batches, joined step by step")
    assert "the rewritten script ran on 2 processes, started by torchrun" in done.notes
    if name == "mnist_style":  # dropout: each process draws its own masks
        assert "a reseed after step 1's own effect" in done.verdict.reason


# ---- several processes: 2 gloo processes on CPU, started by torchrun ----------------------------

TWO = Options.create(backend="accelerate", devices=2, accelerator="cpu")


def _two_ways(name: str, tmp_path, original_start: list, args: list, runs: int = 1):
    """The original (``original_start``: its own launch) and the Accelerate rewrite under
    torchrun on 2 processes, each in its own folder, ``runs`` times there."""
    import sys

    from tests import processes

    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    result = rewrite(source, TWO, path=f"fixtures/{name}/input.py")
    assert "Accelerator(" in result.output and not result.dropped, (result.dropped, result.skips)
    for folder, text in (("original", source), ("rewritten", result.output)):
        (tmp_path / folder).mkdir(exist_ok=True)
        (tmp_path / folder / "input.py").write_text(text, encoding="utf-8")
    out = []
    for _ in range(runs):
        original = processes.run_ranks([*(original_start or [sys.executable, "input.py"]), *args], tmp_path / "original")
        rewritten = processes.run_ranks([*processes.torchrun("input.py"), *args], tmp_path / "rewritten")
        assert original.returncode == 0, original.stderr[-2000:]
        assert rewritten.returncode == 0, rewritten.stderr[-2000:]
        out.append((original, rewritten))
    return out


@pytest.mark.slow  # (a second of its kind: out of CI's 15 minutes)
@pytest.mark.runs
def test_a_train_function_with_evaluation_on_two_processes(tmp_path):
    """imagenet_style (train and validate functions, best-model checkpoints): with ``--lr 0`` the
    weights stay the start's, so the evaluation lines of the rewrite on 2 processes equal the
    original's on one, each printed once (the evaluation loader whole on every process); the
    checkpoint (written by the main process, the module's state dict) loads with the original
    script's own ``--resume``."""
    import re
    import shutil
    import sys

    from tests import processes

    pytest.importorskip("accelerate")
    [(original, rewritten)] = _two_ways("imagenet_style", tmp_path, [], ["--lr", "0"])
    pattern = re.compile(r"^ \* Acc@1 .*$", re.M)
    assert pattern.findall(original.stdout) and pattern.findall(rewritten.stdout) == pattern.findall(original.stdout)
    folder = tmp_path / "rewritten" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.pth.tar", "model_best.pth.tar"]
    resume = tmp_path / "resume"
    resume.mkdir()
    shutil.copy(FIXTURES / "imagenet_style" / "input.py", resume / "input.py")
    again = processes.run_ranks([sys.executable, "input.py", "--resume", str(folder / "model_best.pth.tar"),
                                 "--epochs", "3"], resume)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "=> loaded checkpoint" in again.stdout


@pytest.mark.runs
@pytest.mark.slow  # CI time: the printed line's mnist_style run below checks the same evaluation line
def test_a_shuffled_loader_built_before_the_model_keeps_the_model_s_initial_weights(tmp_path):
    """Issue 61, mnist_style (the loaders built before the model, the training one shuffled):
    on several processes Accelerate's ``prepare`` of a shuffled loader draws a seed from torch's
    generator; prepared where it was built, that draw came before the model's initialisation,
    and the frozen model's evaluation on 2 processes differed from the original's on one. The
    rewrite prepares it right before its first read, after the model is built: with ``--lr 0``
    every evaluation line is the original's."""
    import re

    pytest.importorskip("accelerate")
    source = (FIXTURES / "mnist_style" / "input.py").read_text(encoding="utf-8")
    result = rewrite(source, TWO, path="fixtures/mnist_style/input.py")
    lines = result.output.splitlines()
    assert lines.index("    train_loader = accelerator.prepare(train_loader)") > lines.index(
        "    model, optimizer = accelerator.prepare(model, optimizer)")
    assert any("right before line" in n.message and "draws its seed" in n.message for n in result.changes)
    [(original, rewritten)] = _two_ways("mnist_style", tmp_path, [], ["--lr", "0", "--epochs", "1"])
    pattern = re.compile(r"^Test set: Average loss: .*$", re.M)
    assert pattern.findall(original.stdout) and pattern.findall(rewritten.stdout) == pattern.findall(original.stdout)


@pytest.mark.runs
@pytest.mark.parametrize("name, evaluation, trained", [
    # a plain loop: the training loader's 4 batches of 16, logged every 2, are 2 on each process
    ("mnist_style", r"^Test set: Average loss: .*$", r"^Train Epoch: .*$"),
    # a Trainer class given its loaders
    pytest.param("trainer_given_loaders", r"^test accuracy .*$", None, marks=pytest.mark.slow),  # CI time
])
def test_the_printed_line_starts_two_cpu_processes_with_the_original_s_evaluation(name, evaluation, trained,
                                                                                 tmp_path):
    """Issue 61: ``--backend accelerate --devices 2 --accelerator cpu``, written by the command
    line and started with the line its summary prints (``accelerate launch --multi_gpu
    --num_processes 2``: without ``--multi_gpu`` accelerate's simple launcher started one process
    on this CPU machine), runs 2 processes that Accelerate ranks (``Accelerator(cpu=True)``),
    each on its half of the training batches; with ``--lr 0`` the evaluation line is the
    original's on one process, printed once."""
    import shutil
    import subprocess
    import sys

    from tests import processes

    pytest.importorskip("accelerate")
    for folder in ("original", "rewritten"):
        (tmp_path / folder).mkdir()
        shutil.copy(FIXTURES / name / "input.py", tmp_path / folder / "input.py")
    done = subprocess.run([sys.executable, "-m", "accelerate_rewrite", "input.py", "--backend", "accelerate",
                           "--devices", "2", "--accelerator", "cpu", "--write", "--no-cache"],
                          cwd=tmp_path / "rewritten", capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert "accelerator = Accelerator(cpu=True)" in (tmp_path / "rewritten" / "input.py").read_text()
    [line] = [line.strip() for line in done.stderr.splitlines() if line.strip().startswith("run it:")]
    command = line[len("run it: "):line.index(" (or ")].split()
    assert command[:4] == ["accelerate", "launch", "--multi_gpu", "--num_processes"], line
    command = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port", processes.free_port(),
               *command[2:]]
    args = ["--lr", "0", "--epochs", "1"]
    original = processes.run_ranks([sys.executable, "input.py", *args], tmp_path / "original")
    rewritten = processes.run_ranks([*command, *args], tmp_path / "rewritten")
    assert original.returncode == 0, original.stderr[-2000:]
    assert rewritten.returncode == 0, rewritten.stderr[-3000:]
    found = [re.findall(evaluation, run.stdout, re.M) for run in (original, rewritten)]
    assert len(found[0]) == 1 and found[1] == found[0], (original.stdout, rewritten.stdout)
    if trained:
        lines = [re.findall(trained, run.stdout, re.M) for run in (original, rewritten)]
        assert len(lines[1]) == len(lines[0]) // 2, lines  # each process draws half of the batches


LOSS = r"(?:(?:rank |GPU)(\d+)\]? )?epoch (\d+) step (\d+) loss ([0-9.]+)"


@pytest.mark.runs
@pytest.mark.slow
def test_a_hand_made_ddp_trainer_with_snapshots_trains_every_rank_as_before(tmp_path):
    """ddp_trainer (the DDP tutorial's Trainer class, torchrun, snapshots saved from
    ``self.model.module`` and loaded before the model is wrapped): every rank's losses equal
    the original's, and the second run resumes from the snapshot the rewrite wrote."""
    import re

    from tests import processes

    pytest.importorskip("accelerate")
    runs = _two_ways("ddp_trainer", tmp_path, processes.torchrun("input.py"), ["4", "2"], runs=2)
    for original, rewritten in runs:
        expected = sorted(re.findall(LOSS, original.stdout))
        assert {rank for rank, *_ in expected} == {"0", "1"} and len(expected) >= 8
        assert sorted(re.findall(LOSS, rewritten.stdout)) == expected
    assert "Resuming training from snapshot at Epoch 2" in runs[1][1].stdout


@pytest.mark.runs
def test_a_spawned_ddp_script_trains_every_rank_as_before(tmp_path):
    """ddp_spawn (``mp.spawn``, its own DistributedSampler): the rewrite under torchrun keeps the
    sampler (Accelerate's ``prepare`` would shard again: the loader is set up whole, on it),
    and every rank's losses and the reduced summary equal the original's."""
    import re

    pytest.importorskip("accelerate")
    [(original, rewritten)] = _two_ways("ddp_spawn", tmp_path, [], ["--world-size", "2"])
    expected = sorted(re.findall(LOSS, original.stdout))
    assert {rank for rank, *_ in expected} == {"0", "1"} and len(expected) >= 8
    assert sorted(re.findall(LOSS, rewritten.stdout)) == expected
    summary = re.findall(r"mean last loss over 2 processes: [0-9.]+", original.stdout)
    assert summary and re.findall(r"mean last loss over 2 processes: [0-9.]+", rewritten.stdout) == summary


def test_a_helper_that_reads_the_model_gets_the_module_where_it_is_called():
    """Swin's shape: ``build_optimizer(model)`` reads ``model.named_parameters()`` before the
    set-up (the model as built: nothing to unwrap); ``save_checkpoint(model)`` reads
    ``state_dict()`` after it, where `accelerator` can't be reached and the model never runs:
    the call passes ``accelerator.unwrap_model(model)``. A helper that runs the model, where
    `accelerator` can't be reached, is refused."""
    source = """
import torch
import torch.nn as nn


def build_optimizer(model):
    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]
    return torch.optim.SGD(decay, lr=0.1)


def save_checkpoint(model, path):
    torch.save({"model": model.state_dict()}, path)


def main():
    model = nn.Linear(4, 1)
    optimizer = build_optimizer(model)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)))
    for x, y in loader:
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    save_checkpoint(model, "model.pt")


if __name__ == "__main__":
    main()
"""
    result = rewrite(source, TWO)
    out = result.output
    assert '    save_checkpoint(accelerator.unwrap_model(model), "model.pt")\n' in out, out
    assert '    decay = [p for n, p in model.named_parameters() if not n.endswith("bias")]\n' in out
    runs = source.replace('    torch.save({"model": model.state_dict()}, path)\n',
                          '    model(torch.zeros(1, 4))\n    torch.save({"model": model.state_dict()}, path)\n')
    refused = rewrite(runs, TWO)
    assert "Accelerator(" not in refused.output
    assert any("reads the set-up model where `accelerator` can't be reached" in n.message for n in refused.skips)


def test_the_notes_say_what_was_written():
    from accelerate_rewrite.rules.accelerate.spelling import said

    assert said("`loss.backward()` became `fabric.backward(loss)`", None) == \
        "`loss.backward()` became `accelerator.backward(loss)`"
    assert said("set up `model, optimizer` with Fabric", None) == "set up `model, optimizer` with Accelerate"
    assert said("created `fabric = Fabric(devices=1)` and launched it", "accelerator = Accelerator()") == \
        "created `accelerator = Accelerator()`"
    assert said("refused; --backend fabric converts it", None) == "refused; --backend fabric converts it"
    assert said("already uses Lightning Fabric", None) == "already uses Lightning Fabric"


def test_what_only_reads_the_model_gets_the_module():
    """``torch.save(model, f)`` and ``copy.deepcopy(model)`` on several processes: given the
    module (``codemod/analysis/libraries.py`` MODEL_READERS), they save and copy what the original did."""
    source = (FIXTURES / "train_function" / "input.py").read_text(encoding="utf-8")
    last = '        print(f"epoch {epoch} val loss {val_loss:.4f} val acc {val_acc:.3f}")\n'
    assert last in source
    text = source.replace("import torch\n", "import copy\n\nimport torch\n", 1).replace(
        last, last + '    torch.save(model, "whole.pt")\n    frozen = copy.deepcopy(model)\n')
    out = rewrite(text, TWO).output
    assert 'torch.save(accelerator.unwrap_model(model), "whole.pt")' in out, out
    assert "frozen = copy.deepcopy(accelerator.unwrap_model(model))" in out


def test_a_whole_model_saved_is_the_module_on_one_process_and_on_several():
    """word_lm saves its best model whole (``torch.save(model, f)``): Fabric's output saves
    ``model.module`` (its wrapper's), Accelerate's the model itself on one process (``prepare``
    returns the module) and ``accelerator.unwrap_model(model)`` on several."""
    one = run("word_lm", ACCELERATE).output
    assert "torch.save(model, f)" in one and ".module" not in one.split("def main", 1)[-1]
    several = run("word_lm", ACCELERATE + "-devices-2").output
    assert "torch.save(accelerator.unwrap_model(model), f)" in several
    # init_hidden only probes the parameters (``next(self.parameters()).new_zeros(...)``)
    assert "hidden = accelerator.unwrap_model(model).init_hidden(args.batch_size)" in several


# ---- --accumulate: Accelerate's own accumulation ----------------------------------------------

ACCUMULATE = "accelerate-accumulate-4-keep-devices-2"


def test_accumulation_is_accelerate_s_own_where_the_fabric_backend_accumulates():
    """Every fixture the Fabric backend accumulates, the Accelerate backend accumulates with
    ``accelerator.accumulate(model)``, or as torch's where it writes no Accelerate (its plan
    refused); the step and what belongs to it under ``if accelerator.sync_gradients:``."""
    accumulated = 0
    for name in fixture_names():
        fabric, accelerate = run(name, "accumulate-4-keep-devices-2"), run(name, ACCUMULATE)
        done = [n for n in accelerate.notes if n.rule == "AR302" and not n.skipped]
        assert bool(done) == any(n.rule == "AR302" and not n.skipped for n in fabric.notes), name
        if "Accelerator(" in accelerate.output and done:
            accumulated += 1
            assert re.search(r"Accelerator\((.*, )?gradient_accumulation_steps=4\)", accelerate.output), name
            assert re.search(r"with (self\.)?accelerator\.accumulate\((self\.)?\w+\):", accelerate.output), name
            assert "is_accumulating" not in accelerate.output and "/ min(4" not in accelerate.output, name
    assert accumulated >= 15
    out = run("transformer_lm", ACCUMULATE).output
    assert ("            if accelerator.sync_gradients:\n"
            "                optimizer.zero_grad(set_to_none=True)\n"
            "            with accelerator.accumulate(model):\n"
            "                logits = model(x)\n") in out
    assert ("                accelerator.backward(loss)\n"
            "            if accelerator.sync_gradients:\n"
            "                accelerator.clip_grad_norm_(model.parameters(), 1.0)\n"
            "                optimizer.step()\n"
            "                scheduler.step()\n") in out
    notes = " ".join(n.message for n in run("transformer_lm", ACCUMULATE).notes if n.rule == "AR302")
    assert "moved from between the forward and the backward" in notes
    assert "Accelerate divides each loss by 4, the last, partial group's of an epoch too" in notes


def test_a_backward_that_is_not_accumulated_where_another_is_keeps_the_program_unaccumulated():
    """Accelerate divides every backward by gradient_accumulation_steps: a program that
    accumulates one loop and not another's backward is converted without being
    accumulated (AR302 is dropped, with the reason); one that accumulates none converts without
    accumulation, as with Fabric."""
    gan = run("gan", ACCUMULATE)
    assert "Accelerator(" in gan.output and "gradient_accumulation_steps" not in gan.output
    assert any("steps 2 optimizers" in n.message for n in gan.notes if n.rule == "AR302" and n.skipped)
    source = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn(64, 4), torch.randn(64, 1)), batch_size=16)
for x, y in loader:
    optimizer.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    optimizer.step()
for x, y in range(3):
    optimizer.zero_grad()
    model(torch.randn(2, 4)).sum().backward()
    optimizer.step()
"""
    result = rewrite(source, Options.create(backend="accelerate", accumulate=4))
    assert "Accelerator()" in result.output and "accumulate" not in result.output
    [dropped] = result.dropped
    assert dropped.startswith("AR302 accumulate: dropped") and "`accelerator.backward(model(torch.randn(2, 4)).sum())` " \
        "does not run under `accelerator.accumulate(...)`" in dropped


ACCUMULATING = """\
import torch
from torch.utils.data import DataLoader, TensorDataset

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = DataLoader(TensorDataset(torch.randn({n}, 4), torch.randn({n}, 1)), batch_size=4)
for epoch in range(2):
    for x, y in loader:
        optimizer.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()
print(" ".join(repr(float(v)) for v in torch.cat([p.detach().flatten() for p in model.parameters()])))
"""


@pytest.mark.runs
def test_accelerate_s_accumulation_steps_as_the_fabric_plan_s(tmp_path):
    """At 32-true on one process, groups of 4 in an epoch of 8 batches: the weights after two
    epochs equal, digit for digit, those of the torch backend's accumulation (each loss over its
    group's size); with 6 batches the last group of 2 is stepped with its sum over 4
    (Accelerate's own rule), so the weights differ."""
    import subprocess
    import sys

    pytest.importorskip("accelerate")
    weights = {}
    for n in (32, 24):
        source = ACCUMULATING.format(n=n)
        for backend, extra in (("torch", {}), ("accelerate", {"accelerator": "cpu"})):
            out = rewrite(source, Options.create(backend=backend, accumulate=4, **extra)).output
            assert ("accelerator.accumulate(model)" in out) == (backend == "accelerate")
            path = tmp_path / f"{backend}-{n}.py"
            path.write_text(out, encoding="utf-8")
            done = subprocess.run([sys.executable, str(path)], capture_output=True, text=True, cwd=tmp_path,
                                  timeout=300)
            assert done.returncode == 0, done.stderr[-2000:]
            weights[backend, n] = done.stdout.split()
    assert weights["torch", 32] == weights["accelerate", 32]
    assert weights["torch", 24] != weights["accelerate", 24]


# ---- what a research script does with its model around the set-up (several processes) ---------


def test_a_research_script_s_reads_of_its_model_go_to_the_module_or_the_wrapper_as_they_need():
    """research_reads: the main block's own ``model`` (built, moved, logged, its attributes read)
    is never the set-up one; an EMA copy and a method that probes the parameters read the
    module; SyncBatchNorm's conversion comes before the set-up; a decoder run under no_grad
    reads the module."""
    out = run("research_reads", ACCELERATE + "-devices-2").output
    assert "    ema = copy.deepcopy(accelerator.unwrap_model(model))\n" in out
    assert "            state = accelerator.unwrap_model(model).init_state(x.size(0))\n" in out
    assert "        sample = accelerator.unwrap_model(model).decode(" in out
    assert out.index("convert_sync_batchnorm(model)") < out.index("accelerator.prepare(model, optimizer)")
    assert '    logger.info(model)\n    print(f"width {model.width}, code {model.code}")\n' in out
    assert "mark_forward_method" not in out
    notes = " ".join(n.message for n in run("research_reads", ACCELERATE + "-devices-2").notes)
    assert "marked" not in notes


#: the analysis's patterns, each where the wrapper or the module is what the original handed over
SNIPPET = """\
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset
{imports}

class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def encode(self, x):
        return self.body(x)

    def forward(self, x):
        return self.head(self.body(x))


def main():
    model = Net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=4)
{before}
    for x, y in loader:
        loss = (model(x) - y).pow(2).mean(){extra}
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
{after}


main()
"""


def _several(imports="", before="", after="", extra=""):
    source = SNIPPET.format(imports=imports, before=before, after=after, extra=extra)
    return rewrite(source, Options.create(backend="accelerate", devices=2))


def test_what_the_original_handed_its_ddp_wrapper_gets_accelerate_s():
    """``model = DDP(model)`` in the original: code the rewrite can't see that then received the
    wrapper (an EMA's ``update``) receives Accelerate's; timm's ModelEmaV2, built before the
    wrap on the module (it keeps a deepcopy), receives the module."""
    result = _several(imports="from torch.nn.parallel import DistributedDataParallel as DDP\n"
                              "from timm.utils import ModelEmaV2\n",
                      before="    torch.distributed.init_process_group('gloo')\n    ema = ModelEmaV2(model)\n"
                             "    model = DDP(model)",
                      extra="\n        ema.update(model)")
    assert "accelerator.prepare(model, optimizer)" in result.output, result.skips
    assert "    ema = ModelEmaV2(accelerator.unwrap_model(model))\n" in result.output
    assert "        ema.update(model)\n" in result.output
    unseen = _several(imports="from ema_lib import Ema\n", before="    ema = Ema(model)")
    assert "Accelerator" not in unseen.output
    assert any("`Ema(model)` is given the set-up `model`" in n.message for n in unseen.skips)


def test_library_calls_known_to_read_the_module_get_it_and_those_that_take_the_wrapper_keep_it():
    result = _several(imports="from timm.models import resume_checkpoint\n",
                      after="    resume_checkpoint(model, 'last.pth')\n    compiled = torch.compile(model)\n"
                            "    torch.onnx.export(model, torch.randn(1, 4), 'net.onnx')")
    out = result.output
    assert "    resume_checkpoint(accelerator.unwrap_model(model), 'last.pth')\n" in out, result.skips
    assert "    compiled = torch.compile(model)\n" in out
    assert "    torch.onnx.export(accelerator.unwrap_model(model), torch.randn(1, 4), 'net.onnx')\n" in out


def test_a_method_of_the_model_that_records_gradients_outside_its_forward_is_still_refused():
    """``model.encode(x)`` in the training loop builds a graph outside DistributedDataParallel's
    forward: refused (Fabric marks it); under no_grad it reads the module."""
    refused = _several(extra=" + model.encode(x).pow(2).mean()")
    assert "Accelerator" not in refused.output
    assert any("`model.encode(...)` runs the model outside DistributedDataParallel's forward" in n.message
               for n in refused.skips)
    quiet = _several(after="    with torch.no_grad():\n        print(model.encode(torch.randn(1, 4)))")
    assert "        accelerator.print(accelerator.unwrap_model(model).encode(torch.randn(1, 4)))\n" in quiet.output


@pytest.mark.runs
def test_a_research_script_trains_on_two_processes_and_its_checkpoint_loads_as_the_original_s(tmp_path):
    """research_reads on 2 gloo processes: each loss line once, as many as the original's on
    one; the EMA's state dict has the original's keys; at one process, 32-true, every printed
    number equals the original's."""
    import sys

    from tests import processes

    pytest.importorskip("accelerate")
    [(original, rewritten)] = _two_ways("research_reads", tmp_path, [], [])
    lines = [line for line in original.stdout.splitlines() if line.startswith(("epoch", "sample"))]
    shard = [line.rsplit(" ", 2)[0] for line in rewritten.stdout.splitlines() if line.startswith(("epoch", "sample"))]
    # 4 batches of each epoch per process, a line every 4 steps, once
    assert shard == ["epoch 0 step 0", "epoch 1 step 0", "sample"], rewritten.stdout
    import torch

    keys = [sorted(torch.load(tmp_path / folder / "ema.pt", map_location="cpu")) for folder in ("original", "rewritten")]
    assert keys[0] == keys[1]
    one = rewrite((FIXTURES / "research_reads" / "input.py").read_text(encoding="utf-8"),
                  Options.create(backend="accelerate", accelerator="cpu"))
    (tmp_path / "one").mkdir()
    (tmp_path / "one" / "input.py").write_text(one.output, encoding="utf-8")
    done = processes.run_ranks([sys.executable, "input.py"], tmp_path / "one")
    assert done.returncode == 0, done.stderr[-2000:]
    assert [line for line in done.stdout.splitlines() if line.startswith(("epoch", "sample"))] == lines


def test_a_project_helper_without_training_code_is_read_where_the_model_is_handed_to_it(tmp_path, monkeypatch):
    """SAM's ``enable_running_stats(model)`` (utility/bypass_bn.py: no backward, no optimizer):
    on several processes its module is followed, and, since it never runs the model, it gets the
    module (``accelerator.unwrap_model(model)``), not DistributedDataParallel."""
    from accelerate_rewrite.codemod.project.program import Scope

    (tmp_path / "bypass_bn.py").write_text(
        "from torch.nn.modules.batchnorm import _BatchNorm\n\n\n"
        "def disable_running_stats(model):\n"
        "    def _disable(module):\n"
        "        if isinstance(module, _BatchNorm):\n"
        "            module.backup_momentum = module.momentum\n"
        "            module.momentum = 0\n\n"
        "    model.apply(_disable)\n", encoding="utf-8")
    source = SNIPPET.format(imports="from bypass_bn import disable_running_stats\n", before="", after="",
                            extra="\n        disable_running_stats(model)")
    (tmp_path / "train.py").write_text(source, encoding="utf-8")
    monkeypatch.chdir(tmp_path)
    result = rewrite(source, Options.create(backend="accelerate", devices=2), path="train.py", scope=Scope())
    assert "        disable_running_stats(accelerator.unwrap_model(model))\n" in result.output, result.skips


HELPERS = """\
class Log:
    def __call__(self, model, loss):
        if model.training:
            self._step(model, loss)

    def _step(self, model, loss):
        print(loss.item())


def targets_for(model):
    return model.head.out_features


def loss_of(out, y, model):
    return (out - y).pow(2).mean() * targets_for(model)


def save(model, path):
    module = model.module if hasattr(model, "module") else model
    torch.save(module.state_dict(), path)

"""


def test_research_patterns_that_read_the_model_where_accelerator_is_not():
    """YOLO's ``compute_loss(outputs, targets, model)`` (its ``build_targets`` reads the model's
    attributes): the module, passed where ``accelerator`` is; SAM's ``log(model, loss)``, whose
    class only reads ``model.training``: the prepared model; ViT's ``model.module if
    hasattr(model, "module") else model``: as it is; poolformer's ``ModelEmaV2(model)`` after
    ``from timm.utils import *``: the module; a multi-line optimizer's reads of the model come
    before the set-up."""
    source = SNIPPET.format(imports="from timm.utils import *\n\n" + HELPERS, before="    log = Log()",
                            after="    ema = ModelEmaV2(model)\n    save(model, 'net.pt')",
                            extra="\n        loss = loss_of(model(x), y, model)\n        log(model, loss)")
    source = source.replace("optimizer = torch.optim.SGD(model.parameters(), lr=0.1)",
                            "optimizer = torch.optim.SGD(\n        model.parameters(),\n"
                            "        lr=0.1 / model.head.out_features)")
    result = rewrite(source, Options.create(backend="accelerate", devices=2))
    out = result.output
    assert "accelerator.prepare(model, optimizer)" in out, result.skips
    assert "        loss = loss_of(model(x), y, accelerator.unwrap_model(model))\n" in out
    assert "        log(model, loss)\n" in out
    assert "    ema = ModelEmaV2(accelerator.unwrap_model(model))\n" in out
    assert '    module = model.module if hasattr(model, "module") else model\n' in out
    assert "        lr=0.1 / model.head.out_features)\n" in out


def test_several_nodes_launch_with_accelerate_launch_and_slurm_runs_it_once_per_node(tmp_path):
    """``--num-nodes 2 --devices 4``: Accelerator() takes neither (the launcher's); the summary
    says accelerate launch's multi-node line (every machine's processes counted) and torchrun's;
    ``--launcher slurm`` writes a batch file with one task per node, each an accelerate launch
    with SLURM's node rank (torchrun's on CPUs)."""
    from pathlib import Path

    from click.testing import CliRunner

    from accelerate_rewrite.cli import cli
    from accelerate_rewrite.launch import run_lines, sbatch_text

    options = Options.create(backend="accelerate", devices=4, num_nodes=2)
    result = rewrite((FIXTURES / "train_function" / "input.py").read_text(encoding="utf-8"), options)
    assert "accelerator = Accelerator()" in result.output and "num_nodes" not in result.output
    lines = run_lines("train.py", options)
    assert ("  accelerate launch --multi_gpu --num_machines 2 --num_processes 8 --machine_rank R "
            "--main_process_ip MAIN --main_process_port 29500 train.py") in lines
    assert any(line.startswith("  or torchrun --nnodes=2 --nproc-per-node=4 --node-rank=R") for line in lines)
    text = sbatch_text(Path("train.py"), options, ["--epochs", "3"])
    assert "#SBATCH --nodes=2\n#SBATCH --ntasks-per-node=1\n#SBATCH --gres=gpu:4\n" in text
    assert ("srun bash -c 'accelerate launch --multi_gpu --num_machines $SLURM_NNODES --num_processes "
            "$((4 * SLURM_NNODES)) --machine_rank $SLURM_NODEID --main_process_ip $MAIN_PROCESS_IP "
            "--main_process_port 29500 train.py --epochs 3'") in text
    cpu = sbatch_text(Path("train.py"), Options.create(backend="accelerate", devices=2, num_nodes=2,
                                                       accelerator="cpu"))
    assert "torchrun --nnodes $SLURM_NNODES --nproc-per-node=2 --node-rank $SLURM_NODEID" in cpu and "gres" not in cpu
    script = tmp_path / "train.py"
    script.write_text((FIXTURES / "train_function" / "input.py").read_text(encoding="utf-8"), encoding="utf-8")
    done = CliRunner().invoke(cli, [str(script), "--backend", "accelerate", "--devices", "4", "--num-nodes", "2",
                                    "--launcher", "slurm", "--write"])
    assert done.exit_code == 0, done.output
    assert (tmp_path / "train.sbatch").read_text(encoding="utf-8").startswith("#!/bin/bash\n# written by")


def test_transformer_engine_is_accelerate_s_fp8():
    out = rewrite((FIXTURES / "train_function" / "input.py").read_text(encoding="utf-8"),
                  Options.create(backend="accelerate", precision="transformer-engine")).output
    assert 'accelerator = Accelerator(mixed_precision="fp8")' in out


@pytest.mark.slow  # (a second of its kind: out of CI's 15 minutes)
@pytest.mark.runs
def test_tune_measures_accelerate_candidates_as_fabric_s(tmp_path, monkeypatch):
    """``tune --try "--backend accelerate ..."``: each candidate rewritten and verified as
    ``verify --backend accelerate`` does; at 32-true it PASSes and its command applies it.
    ``tune --backend accelerate`` spells every candidate in Accelerate (issue 61): two of them
    ranked, each with its verdict."""
    import shutil

    from click.testing import CliRunner

    from accelerate_rewrite.cli import cli

    pytest.importorskip("accelerate")
    shutil.copy(FIXTURES / "module_loop" / "input.py", tmp_path / "train.py")
    monkeypatch.chdir(tmp_path)
    done = CliRunner().invoke(cli, ["tune", "train.py", "--try", "--backend accelerate --precision 32-true",
                                    "--steps", "6", "--threads", "1", "-q"],
                              env={"COLUMNS": "250"})
    assert done.exit_code == 0, done.output
    out = " ".join(done.output.split())
    assert "--backend accelerate --precision 32-true" in out and "PASS" in out, done.output
    done = CliRunner().invoke(cli, ["tune", "train.py", "--backend", "accelerate", "--try", "--precision 32-true",
                                    "--try", "--precision bf16-mixed", "--steps", "6", "--threads", "1", "-q",
                                    "--format", "json"])
    assert done.exit_code == 0, done.output
    ranked = json.loads(done.output)
    labels = [row["candidate"] for row in ranked["candidates"]]
    assert sorted(labels) == ["--backend accelerate --precision 32-true", "--backend accelerate --precision bf16-mixed"]
    assert all(row["verdict"] in ("pass", "fail", "not-verified", "not-compared") for row in ranked["candidates"])


def test_tune_s_backend_spells_the_default_candidates_in_it():
    from accelerate_rewrite.verify import tune
    from accelerate_rewrite.verify.environment import Machine

    cpu = Machine(cuda_devices=0, modules={})
    assert [c.label for c in tune.default_candidates(cpu, "accelerate")] == [
        "--backend accelerate --precision 32-true", "--backend accelerate --precision bf16-mixed",
        "--backend accelerate --precision bf16-mixed --compile"]
    assert [c.label for c in tune.default_candidates(cpu, "torch")] == [
        "--backend torch --precision bf16-mixed", "--backend torch --precision bf16-mixed --compile"]
    own = tune.Candidate.parse("--backend fabric --precision 32-true")
    assert tune.with_backend(own, "accelerate") is own


@pytest.mark.runs
@pytest.mark.slow  # (CI time: tests/test_hand_ddp.py runs the Fabric rewrite of the same shape)
def test_the_imagenet_family_shards_what_its_flags_did_not_under_accelerate(tmp_path):
    """Issue 57, Accelerate's spelling: the ImageNet example's own flags leave ``args.distributed``
    False; its worker reads it back as ``accelerator.num_processes > 1``, and the group's world
    size and rank from Accelerate. Under torchrun on 2 processes (with none of the script's
    flags) each process trains half the batches, and the evaluation with ``--lr 0`` is the one
    process's, over the same 48 images."""
    import re

    pytest.importorskip("accelerate")
    [(original, rewritten)] = _two_ways("imagenet_ddp", tmp_path, [], ["--lr", "0"])
    assert "args.distributed = accelerator.num_processes > 1" in (tmp_path / "rewritten" / "input.py").read_text()
    steps = re.findall(r"\[rank (\d)\] epoch \d step \d", original.stdout)
    halves = re.findall(r"\[rank (\d)\] epoch \d step \d", rewritten.stdout)
    assert len(steps) == 12 and sorted(halves) == ["0"] * 6 + ["1"] * 6
    acc = set(re.findall(r"\* Acc@1 ([0-9.]+) over (\d+) images", original.stdout))
    assert len(acc) == 1 and set(re.findall(r"\* Acc@1 ([0-9.]+) over (\d+) images", rewritten.stdout)) == acc
