"""Issue 13: on 2 devices (2 gloo processes on CPU) a converted script computes what it
computed on one.

For fixtures in the shapes of real repositories, the rewrite with ``--devices 2 --accelerator
cpu`` is run as 2 processes with ``--lr 0`` (so that the weights stay those of the start, and a
1-process run of the original has the same weights), and:

- it runs and ends cleanly;
- its evaluation lines (the figures over the whole evaluation set) equal the original's, line
  for line, and each is printed once (rank 0): evaluation loaders are not sharded;
- the files it writes are written once (rank 0), and a checkpoint it wrote loads back with the
  original script's own ``--resume`` code.

The default run (CI) runs imagenet_style this way, and mnist_style with ``--shard-eval``; the
other evaluated fixtures, and every other runnable fixture (each must run and end cleanly), run
on 2 processes in the ``slow`` set (``pytest -m slow tests/test_multi_device.py``).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import textwrap
import sys
from functools import lru_cache
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from accelerate_rewrite.api import rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402
from tests import processes  # noqa: E402
from tests.goldens import FIXTURES, fixture_names  # noqa: E402
from tests.verify_support import slow_unless  # noqa: E402

pytestmark = pytest.mark.runs

TWO = Options.create(devices=2, accelerator="cpu")
#: fixture -> (arguments that keep the weights at their start, the evaluation lines' pattern)
EVALUATED = {
    # the whole-set training figure (`train_loss / len(train_loader.dataset)`, summed over the
    # processes) and the test set's; its progress bar (sys.stdout.write) is rank 0's alone
    "autoencoder_sums": (["--lr", "0"], r"^====> "),
    # a helper returns both loaders; a prediction mode throws them away (``_, _ = get_data()``)
    "data_helper": (["--lr", "0"], r"^epoch \d+ val loss "),
    "imagenet_style": (["--lr", "0"], r"^ \* Acc@1 "),
    "mnist_style": (["--lr", "0"], r"^Test set: "),
    "rnn_classifier": (["--lr", "0"], r"^Test Accuracy "),
    "vae": (["--lr", "0"], r"^====> Test set loss"),
    # every figure it prints (each process trains on all of the token stream: no DataLoader);
    # the best model, saved whole by rank 0, is read back by the script's own torch.load on
    # every rank, after a barrier
    "word_lm": (["--lr", "0"], r"^\| "),
}


def _run(script: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    env.pop("LT_DEVICES", None)
    return processes.run([sys.executable, str(script), *args], cwd=cwd, env=env, timeout=300)


@lru_cache(maxsize=None)
def _both(name: str, tmp: str, options: Options = TWO) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess, Path]:
    """The original (1 process) and the 2-device rewrite, each in its own folder."""
    args = EVALUATED.get(name, ([], ""))[0]
    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    result = rewrite(source, options, path=f"fixtures/{name}/input.py")
    assert result.changed and not result.dropped, result.dropped
    root = Path(tmp) / (name if options is TWO else f"{name}-shard-eval")
    (root / "original").mkdir(parents=True)
    (root / "rewritten").mkdir()
    (root / "original" / "input.py").write_text(source, encoding="utf-8")
    (root / "rewritten" / "input.py").write_text(result.output, encoding="utf-8")
    if name.startswith("timm"):  # a stand-in for timm (tests/stubs/timm)
        for folder in ("original", "rewritten"):
            shutil.copytree(FIXTURES.parent / "tests" / "stubs" / "timm", root / folder / "timm")
    original = _run(root / "original" / "input.py", args, root / "original")
    rewritten = _run(root / "rewritten" / "input.py", args, root / "rewritten")
    return original, rewritten, root


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> str:
    return str(tmp_path_factory.mktemp("two-devices"))


def _lines(text: str, pattern: str) -> list[str]:
    return [line for line in text.splitlines() if re.search(pattern, line)]


#: the fixtures run on two processes in the default run (CI): imagenet_style (its evaluation, the
#: files it writes, its checkpoint read back), and mnist_style with --shard-eval; the others
#: are in the ``slow`` set (two processes that each import lightning: 25-50 s a fixture on 2 cores)
DEFAULT = {"imagenet_style"}


@pytest.mark.parametrize("name", slow_unless(sorted(EVALUATED), DEFAULT))
def test_evaluation_on_two_processes_equals_the_original(name, work):
    original, rewritten, _ = _both(name, work)
    assert original.returncode == 0, original.stderr[-2000:]
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    assert "Starting with 2 processes" in rewritten.stderr + rewritten.stdout
    pattern = EVALUATED[name][1]
    expected = _lines(original.stdout, pattern)
    assert expected, original.stdout
    # whole-set figures, printed once (rank 0): not one shard's sum divided by the full size
    assert _lines(rewritten.stdout, pattern) == expected


@pytest.mark.parametrize("name", slow_unless(["autoencoder_sums", "word_lm"], DEFAULT))
def test_every_line_is_printed_once_with_the_original_s_figures(name, work):
    """Issue 25: what the script prints before Fabric used to exist (`print(args)`, the seed) and
    after it, its training figures and its test figures: each line once, as the original printed
    it; a progress bar of the script's own (sys.stdout.write) is rank 0's, its own shard's batches."""
    original, rewritten, _ = _both(name, work)
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]

    def split(text: str) -> tuple[list[str], list[str]]:
        lines = text.splitlines()
        return [x for x in lines if not x.startswith(" [")], [x for x in lines if x.startswith(" [")]
    (lines, bars), (expected, original_bars) = split(rewritten.stdout), split(original.stdout)
    assert lines == expected
    assert len(bars) == len(original_bars) // 2


#: --shard-eval: the evaluation sets of these divide by 2 (no padding), and their evaluation
#: draws no random numbers (the VAE's does: its shards draw other noise than the whole set)
SHARDED = ["imagenet_style", "mnist_style"]


@pytest.mark.parametrize("name", slow_unless(SHARDED, {"mnist_style"}))
def test_sharded_evaluation_sums_over_the_processes(name, work):
    """--shard-eval: each process evaluates half the set, and the sums all-reduced after the loop
    give the figures of the whole set, as the original printed them."""
    original, rewritten, root = _both(name, work, Options.create(devices=2, accelerator="cpu", shard_eval=True))
    assert 'all_reduce(correct, reduce_op="sum").item()' in (root / "rewritten" / "input.py").read_text()
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    pattern = EVALUATED[name][1]
    expected = _lines(original.stdout, pattern)
    assert expected and _lines(rewritten.stdout, pattern) == expected


def test_files_are_written_once_and_the_checkpoint_loads_with_the_original_code(work):
    _, rewritten, root = _both("imagenet_style", work)
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    folder = root / "rewritten" / "checkpoints"
    assert sorted(p.name for p in folder.iterdir()) == ["checkpoint.pth.tar", "model_best.pth.tar"]
    resume = root / "resume"
    resume.mkdir()
    shutil.copy(FIXTURES / "imagenet_style" / "input.py", resume / "input.py")
    again = _run(resume / "input.py", ["--resume", str(folder / "model_best.pth.tar"), "--epochs", "3"], resume)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "=> loaded checkpoint" in again.stdout


@pytest.mark.slow  # (CI time)
def test_the_model_s_other_methods_run_on_two_processes(work):
    _, rewritten, root = _both("vae", work)
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]  # model.decode: marked as forward
    assert sorted(p.name for p in (root / "rewritten" / "results").iterdir()) == ["sample_1.pt", "sample_2.pt"]


def _runnable() -> list[str]:
    out = []
    for name in fixture_names():
        if name in EVALUATED or name in ("pure_half", "hf_finetune", "accumulates_already", "ddp_spawn",
                                         "ddp_torchrun", "ddp_trainer", "hand_ddp",
                                         "imagenet_ddp", "local_rank_finetune", "init_distributed_mode",  # test_hand_ddp.py
                                         "own_download"):  # its download needs a URL: tests/test_side_effects.py
            continue
        result = rewrite((FIXTURES / name / "input.py").read_text(encoding="utf-8"), TWO)
        if any(n.rule == "AR101" for n in result.changes):
            out.append(name)
    return out


#: the fixtures (besides EVALUATED) that convert to 2 devices: a list, so that collecting the
#: tests (once per xdist worker) rewrites nothing; the test below keeps it current
RUNNABLE = ["accelerator_api", "already_autocast", "apex_dcgan", "apex_o1", "checkpointing", "conditional_optimizer",
            "cuda_amp", "cyclegan_chain", "data_parallel", "finetune_encoder", "gan", "gan_bce", "lbfgs",
            "manual_sgd", "module_loop", "param_groups", "research_reads", "sample_data", "scheduled_optim", "solver_class", "text_classification",
            "timm_scaler",
            "torchmetrics_metrics", "train_function", "trainer_class", "trainer_given_loaders", "trainer_run", "transformer_lm",
            "vit_finetune"]


def test_the_list_of_converted_fixtures_is_current():
    assert _runnable() == RUNNABLE


@pytest.mark.slow
@pytest.mark.parametrize("name", RUNNABLE)
def test_every_converted_fixture_runs_on_two_processes(name, work):
    _, rewritten, _ = _both(name, work)
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]


_DRAWN_AND_EVALUATED = """\
import argparse

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float, default=1e-3)
    args = parser.parse_args()
    torch.manual_seed(0)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    data = TensorDataset(torch.randn(64, 8), torch.randint(0, 2, (64,)))
    train_loader = DataLoader(data, batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 2)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr)
    data_iter = iter(train_loader)
    for it in range(12):
        try:
            x, y = next(data_iter)
        except StopIteration:
            data_iter = iter(train_loader)
            x, y = next(data_iter)
        x, y = x.to(device), y.to(device)
        loss = F.cross_entropy(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.eval()
    correct = 0
    with torch.no_grad():
        for x, y in train_loader:
            x, y = x.to(device), y.to(device)
            correct += (model(x).argmax(1) == y).sum().item()
    print(f"train accuracy {correct}/{len(train_loader.dataset)}")


if __name__ == "__main__":
    main()
"""


def _drawn_and_evaluated() -> str:
    """A training loop that draws its batches one at a time (``data_iter = iter(train_loader)``,
    ``next(data_iter)``) trains on the loader: with 2 devices it is sharded (before, the
    evaluation loop over the same loader made it an evaluation loader, left whole, and every
    process trained on all the data). The evaluation over it then sees one shard per process:
    its sum is all-reduced after the loop."""
    result = rewrite(_DRAWN_AND_EVALUATED, TWO, path="train.py")
    out = result.output
    assert result.changed and not result.dropped, result.dropped
    assert "    train_loader = fabric.setup_dataloaders(train_loader)\n" in out
    assert '        correct = fabric.all_reduce(correct, reduce_op="sum").item()\n' in out
    assert not [n for n in result.notes if "not in a loop over data" in n.message]
    assert any("`train_loader` is sharded for training: each process evaluates its shard" in n.message
               for n in result.notes)
    return out


def test_a_loader_drawn_by_next_is_sharded_and_its_evaluation_sums_are_reduced():
    _drawn_and_evaluated()


@pytest.mark.slow  # (CI time: two processes that each import lightning)
def test_a_loader_drawn_by_next_trains_on_two_processes_as_the_original(tmp_path):
    """``_drawn_and_evaluated``'s rewrite, on 2 processes at ``--lr 0``: the figure printed is the
    original's."""
    out = _drawn_and_evaluated()
    for name, text in (("original", _DRAWN_AND_EVALUATED), ("rewritten", out)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.py").write_text(text, encoding="utf-8")
    original = _run(tmp_path / "original" / "train.py", ["--lr", "0"], tmp_path / "original")
    rewritten = _run(tmp_path / "rewritten" / "train.py", ["--lr", "0"], tmp_path / "rewritten")
    assert original.returncode == 0 and rewritten.returncode == 0, rewritten.stderr[-2000:]
    assert _lines(original.stdout, "^train accuracy") == _lines(rewritten.stdout, "^train accuracy")
    assert len(_lines(rewritten.stdout, "^train accuracy")) == 1


def test_an_evaluation_over_a_training_loader_that_cant_be_reduced_says_so():
    """The same script, its evaluation collecting predictions in a list (a list can't be summed
    over the processes): the loader is still sharded for training, and the note says the
    evaluation's figures become one process's. One device: nothing to say."""
    source = _DRAWN_AND_EVALUATED.replace(
        "    correct = 0\n", "    correct = 0\n    predictions = []\n").replace(
        "            correct += (model(x).argmax(1) == y).sum().item()\n",
        "            correct += (model(x).argmax(1) == y).sum().item()\n"
        "            predictions.append(model(x).argmax(1))\n")
    result = rewrite(source, TWO, path="train.py")
    assert "    train_loader = fabric.setup_dataloaders(train_loader)\n" in result.output
    assert "all_reduce" not in result.output
    assert any(n.message.startswith("`train_loader` is sharded for training, so the evaluation over it sees "
                                    "one process's share: ") and
               n.message.endswith("; its figures become one process's (evaluate on a loader of its own)")
               for n in result.notes), [n.message for n in result.notes]
    one = rewrite(source, Options.create(), path="train.py")
    assert not [n for n in one.notes if "sharded for training" in n.message]
    assert rewrite(result.output, TWO, path="train.py").output == result.output


def test_two_loaders_a_helper_returns_stay_two_where_another_call_throws_them_away():
    """``_, _, size = get_data()`` elsewhere binds ``_`` to both loaders: the validation loader
    is not the training one (before: it was sharded as the training loader, and its sum
    all-reduced twice after the loop, twice the figure on 2 processes; fixtures/data_helper
    has the shape with its evaluation in a function)."""
    source = textwrap.dedent("""\
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset


        def get_data():
            x, y = torch.randn(64, 8), torch.randn(64, 1)
            train_dl = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
            valid_dl = DataLoader(TensorDataset(x, y), batch_size=8)
            return train_dl, valid_dl, 5


        def inference():
            _, _, size = get_data()
            print(size)


        def main():
            train_dl, valid_dl, size = get_data()
            model = nn.Linear(8, 1)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            loss_fn = nn.MSELoss()
            for epoch in range(2):
                for src, tgt in train_dl:
                    optim.zero_grad()
                    loss_fn(model(src), tgt).backward()
                    optim.step()
                losses = 0
                for src, tgt in valid_dl:
                    losses += loss_fn(model(src), tgt).item()
                print(epoch, losses / len(valid_dl.dataset))


        if __name__ == "__main__":
            main()
        """)
    result = rewrite(source, TWO, path="train.py")
    assert "    train_dl = fabric.setup_dataloaders(train_dl)\n" in result.output
    assert "    valid_dl = fabric.setup_dataloaders(valid_dl, use_distributed_sampler=False)\n" in result.output
    assert "all_reduce" not in result.output and not result.dropped


def test_an_evaluation_function_given_the_training_loader_and_another_says_its_figure_becomes_one_process():
    """``evaluate(model, train_dl)`` and ``evaluate(model, valid_dl)``: the training loader is
    sharded, the other is not, so no sum after the loop can be all-reduced for both calls; the
    note says the figure over the training loader becomes one process's (before: nothing said).
    One device: nothing to say."""
    source = textwrap.dedent("""\
        import torch
        from torch import nn
        from torch.utils.data import DataLoader, TensorDataset


        def evaluate(model, loader, loss_fn):
            total = 0.0
            with torch.no_grad():
                for src, tgt in loader:
                    total += loss_fn(model(src), tgt).item() * len(src)
            return total / len(loader.dataset)


        def main():
            x, y = torch.randn(64, 8), torch.randn(64, 1)
            train_dl = DataLoader(TensorDataset(x, y), batch_size=8, shuffle=True)
            valid_dl = DataLoader(TensorDataset(x, y), batch_size=8)
            model = nn.Linear(8, 1)
            optim = torch.optim.SGD(model.parameters(), lr=0.1)
            loss_fn = nn.MSELoss()
            for epoch in range(2):
                for src, tgt in train_dl:
                    optim.zero_grad()
                    loss_fn(model(src), tgt).backward()
                    optim.step()
                print(epoch, evaluate(model, train_dl, loss_fn), evaluate(model, valid_dl, loss_fn))


        if __name__ == "__main__":
            main()
        """)
    result = rewrite(source, TWO, path="train.py")
    assert "    train_dl = fabric.setup_dataloaders(train_dl)\n" in result.output
    assert "all_reduce" not in result.output
    notes = [(n.line, n.message) for n in result.notes if "this evaluation loop runs over it too" in n.message]
    assert notes == [(9, "`train_dl` is sharded for training, and this evaluation loop runs over it too (one of the "
                         "loaders its callers pass): there it sees one process's share, and its figures become one "
                         "process's (evaluate on a loader of its own)")], [n.message for n in result.notes]
    one = rewrite(source, Options.create(), path="train.py")
    assert not [n for n in one.notes if "sharded for training" in n.message]
