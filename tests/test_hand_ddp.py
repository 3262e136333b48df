"""Issue 14.1: hand-made DDP becomes Fabric's, and every rank trains as it did.

The originals start their own 2 gloo processes (``fixtures/ddp_spawn`` with ``mp.spawn``,
``fixtures/ddp_torchrun`` under ``python -m torch.distributed.run --nproc_per_node 2``); the
rewrites with ``--devices 2 --accelerator cpu`` are started with plain ``python`` (Fabric
starts the second process). Each rank prints its own losses: they must be the original's,
rank by rank, digit for digit (32-true), and so must what rank 0 prints at the end (an
all-reduced figure) and the files it writes.

The default set runs ``fixtures/imagenet_ddp`` (the ImageNet example's family: ``main_worker``
spawned with --multiprocessing-distributed or called directly, here in each process torchrun
starts with --dist-url env://; both the original and the rewrite are started by torchrun, as
the script reads torchrun's WORLD_SIZE itself); tests/test_real_code.py runs the classic
``--local_rank`` script on two processes, and tests/test_projects.py the tutorial's mp.spawn
script split over three files, rank by rank. The ``slow`` set (CI time: two processes that each
import lightning) runs ``fixtures/init_distributed_mode`` (DETR's and DeiT's family: a helper
that reads RANK, WORLD_SIZE and LOCAL_RANK and joins the group, ``model_without_ddp``),
``fixtures/local_rank_finetune`` (a BERT-era fine-tuning script: ``--local_rank`` defaulting to
LOCAL_RANK, -1 for one process; the rewrite is started with plain python), ddp_spawn and the
torchrun fixtures (``fixtures/ddp_torchrun``, ``fixtures/hand_ddp`` whose set-up helper receives ``fabric``,
``fixtures/ddp_trainer`` and its resume from a snapshot), and the torchrun fixture's rewrite
without ``--devices`` (``devices`` from torchrun's ``LOCAL_WORLD_SIZE``) under torchrun itself.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from accelerate_rewrite.api import rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402
from tests import processes  # noqa: E402
from tests.goldens import FIXTURES  # noqa: E402

pytestmark = pytest.mark.runs

TWO = Options.create(devices=2, accelerator="cpu")
LOSS = re.compile(r"(?:(?:rank |GPU)(\d+)\]? )?epoch (\d+) step (\d+) loss ([0-9.]+)")
#: what rank 0 prints at the end, from figures reduced over the processes
SUMMARY = {"ddp_spawn": r"mean last loss over 2 processes: [0-9.]+",
           "ddp_torchrun": r"train accuracy [0-9.]+ over 2 processes",
           "hand_ddp": r"saved ddp_model.pt",
           "ddp_trainer": r"Epoch 2 \| Training snapshot saved at snapshot.pt",
           "imagenet_ddp": r"\[rank \d\] \* Acc@1 [0-9.]+ over 48 images",
           "local_rank_finetune": r"eval acc [0-9.]+ after \d+ steps",
           "init_distributed_mode": r"training done: 2 epochs on 2 processes"}
WRITES = {"ddp_spawn": "ddp_toy.pt", "ddp_torchrun": "torchrun_net.pt", "hand_ddp": "ddp_model.pt",
          "ddp_trainer": "snapshot.pt", "imagenet_ddp": "checkpoint.pth.tar",
          "local_rank_finetune": "output/pytorch_model.bin", "init_distributed_mode": "checkpoint.pth"}
#: command-line arguments: the Trainer fixture's epochs and how often it saves
ARGS = {"ddp_trainer": ["4", "2"], "imagenet_ddp": ["--dist-url", "env://"]}
#: rewrites started by torchrun too: the ImageNet example reads torchrun's WORLD_SIZE itself
#: (--dist-url env://) before it launches its worker
TORCHRUN_BOTH = {"imagenet_ddp"}


_run = processes.run_ranks
_torchrun = processes.torchrun


def _losses(text: str) -> list[tuple[str, ...]]:
    return sorted(LOSS.findall(text))


def _both(name: str, tmp_path: Path, options: Options = TWO, runs: int = 1):
    """The original and its rewrite, each in its own folder, run ``runs`` times there."""
    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    result = rewrite(source, options, path=f"fixtures/{name}/input.py")
    assert result.changed and not result.dropped, result.dropped
    assert any(n.rule == "AR111" for n in result.changes)
    for folder, text in (("original", source), ("rewritten", result.output)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "input.py").write_text(text, encoding="utf-8")
    start = [sys.executable, "input.py"] if name == "ddp_spawn" else _torchrun("input.py")
    out = []
    for _ in range(runs):
        original = _run(start + ARGS.get(name, []), tmp_path / "original")
        rewritten = _run((_torchrun("input.py") if name in TORCHRUN_BOTH else [sys.executable, "input.py"])
                         + ARGS.get(name, []), tmp_path / "rewritten")
        assert original.returncode == 0, original.stderr[-2000:]
        assert rewritten.returncode == 0, rewritten.stderr[-2000:]
        out.append((original, rewritten))
    return out


@pytest.mark.parametrize("name", [pytest.param("ddp_spawn", marks=pytest.mark.slow),
                                  # the tutorial's Trainer class (self.gpu_id), torchrun
                                  pytest.param("ddp_trainer", marks=pytest.mark.slow),
                                  # torchrun, a loader iterated twice an epoch
                                  pytest.param("ddp_torchrun", marks=pytest.mark.slow),
                                  # torchrun with a set-up helper that returns the rank; it
                                  # prints on rank 0 only
                                  pytest.param("hand_ddp", marks=pytest.mark.slow),
                                  # the ImageNet example: main_worker spawned or called, here
                                  # called in each process torchrun starts (--dist-url env://)
                                  "imagenet_ddp",
                                  # a BERT-era fine-tuning script: --local_rank (from LOCAL_RANK),
                                  # -1 for one process, the barrier around the model's making
                                  pytest.param("local_rank_finetune", marks=pytest.mark.slow),
                                  # the init_distributed_mode(args) family (DETR, DeiT): RANK and
                                  # WORLD_SIZE read in a helper that joins the group, DDP only when
                                  # distributed, model_without_ddp = model.module
                                  pytest.param("init_distributed_mode", marks=pytest.mark.slow)])
def test_every_rank_trains_as_before(name, tmp_path):
    [(original, rewritten)] = _both(name, tmp_path)
    expected = _losses(original.stdout)
    assert {rank for rank, *_ in expected} == ({""} if name == "hand_ddp" else {"0", "1"}), original.stdout
    assert len(expected) >= 8
    assert _losses(rewritten.stdout) == expected
    summary = re.findall(SUMMARY[name], original.stdout)
    # (lines of several ranks come in any order)
    assert summary and sorted(re.findall(SUMMARY[name], rewritten.stdout)) == sorted(summary)
    assert (tmp_path / "rewritten" / WRITES[name]).exists()


@pytest.mark.slow
def test_torchrun_script_keeps_running_under_torchrun(tmp_path):
    """Without --devices the rewrite takes its devices from torchrun's LOCAL_WORLD_SIZE."""
    name = "ddp_torchrun"
    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    result = rewrite(source, Options.create(), path=f"fixtures/{name}/input.py")
    assert 'devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1))' in result.output
    for folder, text in (("original", source), ("rewritten", result.output)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "input.py").write_text(text, encoding="utf-8")
    original = _run(_torchrun("input.py"), tmp_path / "original")
    rewritten = _run(_torchrun("input.py"), tmp_path / "rewritten")
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    assert _losses(rewritten.stdout) == _losses(original.stdout)


@pytest.mark.slow
def test_the_trainer_resumes_from_its_snapshot_as_before(tmp_path):
    """The second run of the Trainer fixture resumes from the snapshot rank 0 wrote (saved
    from `self.model.module`, loaded before the model is wrapped): every rank's losses from
    there on are the original's."""
    _, (original, rewritten) = _both("ddp_trainer", tmp_path, runs=2)
    assert "Resuming training from snapshot at Epoch 2" in original.stdout
    assert "Resuming training from snapshot at Epoch 2" in rewritten.stdout
    expected = _losses(original.stdout)
    assert expected and {step[1] for step in expected} == {"2", "3"}
    assert _losses(rewritten.stdout) == expected


def _write(tmp_path: Path, folder: str, text: str) -> Path:
    (tmp_path / folder).mkdir()
    (tmp_path / folder / "input.py").write_text(text, encoding="utf-8")
    return tmp_path / folder


ACC = re.compile(r"\[rank (\d)\] \* Acc@1 ([0-9.]+) over (\d+) images")


def test_imagenet_family_started_by_fabric_shards_what_its_flags_did_not(tmp_path):
    """Issue 57: the ImageNet example's family decides distribution from its own flags
    (``args.distributed = args.world_size > 1 or args.multiprocessing_distributed``). Rewritten with
    ``--devices 2`` and run with plain ``python`` and none of those flags, Fabric starts two
    processes: each trains half the batches (the worker's ``args.distributed`` follows
    ``fabric.world_size > 1``, so its DistributedSampler shards them), each has its rank, and the
    evaluation with frozen steps (``--lr 0``) is the one process's, over the same 48 images. The
    rewrite without ``--devices`` runs on this CPU-only machine as the original did, loss for loss
    (the spawn index reads back None on a CPU, as the script's own call gave it)."""
    name = "imagenet_ddp"
    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    two = rewrite(source, TWO, path=f"fixtures/{name}/input.py")
    one = rewrite(source, Options.create(), path=f"fixtures/{name}/input.py")
    assert 'gpu = fabric.device.index if fabric.device.type == "cuda" else None' in two.output
    assert "args.distributed = fabric.world_size > 1" in two.output
    assert "args.world_size, args.rank = fabric.world_size, fabric.global_rank" in two.output
    assert "args.rank * ngpus_per_node + gpu" not in two.output
    original = _run([sys.executable, "input.py", "--lr", "0"], _write(tmp_path, "original", source))
    sharded = _run([sys.executable, "input.py", "--lr", "0"], _write(tmp_path, "two", two.output))
    alone = _run([sys.executable, "input.py"], _write(tmp_path, "one", one.output))
    again = _run([sys.executable, "input.py"], tmp_path / "original")
    for done in (original, sharded, alone, again):
        assert done.returncode == 0, done.stderr[-2000:]
    steps = _losses(original.stdout)
    assert {rank for rank, *_ in steps} == {"0"} and len(steps) == 12  # 2 epochs of 6 batches
    halves = _losses(sharded.stdout)
    assert sorted(rank for rank, *_ in halves) == ["0"] * 6 + ["1"] * 6  # 3 batches a process an epoch
    [(_, acc, seen)] = set(ACC.findall(original.stdout))
    assert {(r, a, s) for r, a, s in ACC.findall(sharded.stdout)} == {("0", acc, seen), ("1", acc, seen)}
    assert (tmp_path / "two" / "checkpoint.pth.tar").exists()
    assert _losses(alone.stdout) == _losses(again.stdout)


def test_a_world_of_cuda_devices_runs_where_there_are_none(tmp_path):
    """Issue 57: ``ngpus_per_node = torch.cuda.device_count()`` (the ImageNet example before it
    tested the device, MoCo, SimSiam) is 0 on a machine without CUDA, where the script ran its
    worker in one process: the rewrite's devices are ``max(ngpus_per_node, 1)``, never
    ``Fabric(devices=0)`` (a ValueError), and it trains as the original did there."""
    name = "imagenet_ddp"
    guarded = "ngpus_per_node = torch.cuda.device_count() if torch.cuda.is_available() else 1"
    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    assert guarded in source
    source = source.replace(guarded, "ngpus_per_node = torch.cuda.device_count()")
    result = rewrite(source, Options.create(), path="train.py")
    assert "fabric = Fabric(devices=max(ngpus_per_node, 1))" in result.output
    assert any("counts CUDA devices" in n.message for n in result.changes)
    guarded_result = rewrite(source.replace("ngpus_per_node = torch.cuda.device_count()", guarded),
                             Options.create(), path="train.py")
    assert "Fabric(devices=ngpus_per_node)" in guarded_result.output
    original = _run([sys.executable, "input.py"], _write(tmp_path, "original", source))
    rewritten = _run([sys.executable, "input.py"], _write(tmp_path, "rewritten", result.output))
    assert original.returncode == 0 and rewritten.returncode == 0, rewritten.stderr[-2000:]
    assert _losses(rewritten.stdout) == _losses(original.stdout) and _losses(original.stdout)


RESUME = """    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)
    if args.resume:
        checkpoint = torch.load(args.resume)
        model.load_state_dict(checkpoint["state_dict"])
        optimizer.load_state_dict(checkpoint["optimizer"])
        print(f"=> loaded checkpoint '{args.resume}' (epoch {checkpoint['epoch']})")
"""


def test_a_checkpoint_the_original_wrote_from_its_wrapped_model_resumes(tmp_path):
    """Issue 57: the ImageNet example saves ``model.state_dict()`` of its DistributedDataParallel
    (or DataParallel) model: keys prefixed ``module.``. People convert mid-project, with such
    checkpoints on disk; the rewrite's model is the module itself, so its ``load_state_dict``
    strips the prefix first (``consume_prefix_in_state_dict_if_present``), and a checkpoint the
    original wrote under torchrun resumes in the rewrite run with plain python."""
    name = "imagenet_ddp"
    source = (FIXTURES / name / "input.py").read_text(encoding="utf-8")
    line = "    optimizer = torch.optim.SGD(model.parameters(), args.lr, momentum=0.9, weight_decay=1e-4)\n"
    assert line in source
    source = source.replace(line, RESUME).replace(
        'parser.add_argument("--seed"', 'parser.add_argument("--resume", default="", type=str)\nparser.add_argument("--seed"')
    result = rewrite(source, Options.create(), path="train.py")
    assert '    consume_prefix_in_state_dict_if_present(checkpoint["state_dict"], "module.")\n' \
           '        model.load_state_dict(checkpoint["state_dict"])\n' in result.output
    original = _run(_torchrun("input.py") + ["--dist-url", "env://", "--epochs", "1"],
                    _write(tmp_path, "original", source))
    assert original.returncode == 0, original.stderr[-2000:]
    saved = tmp_path / "original" / "checkpoint.pth.tar"
    rewritten = _run([sys.executable, "input.py", "--resume", str(saved)], _write(tmp_path, "rewritten", result.output))
    assert rewritten.returncode == 0, rewritten.stderr[-2000:]
    assert f"=> loaded checkpoint '{saved}' (epoch 1)" in rewritten.stdout
