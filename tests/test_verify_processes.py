"""Issue 61: a rewrite on several processes held to the original run on their batches joined
(verify/shards.py, harness_shards.py): the joining, what can't be held that way, and runs of a
small script of our own under Accelerate on 2 CPU processes, correct and with planted bugs."""

from __future__ import annotations

import pytest

from accelerate_rewrite.options import Options
from accelerate_rewrite.verify import shards
from accelerate_rewrite.verify.runner import RunRecord


def _pass(batches, length=8, steps=0):
    return {"length": length, "batch_size": 2, "count": 2, "batches": batches, "steps": steps}


def _joined(batches, length=8):
    return {"length": length, "batch_size": 2, "count": 2, "batches": batches}


def test_the_union_joins_each_step_s_batches_in_rank_order():
    rank0 = [_pass([[0, 2], [4, 6]], steps=2), _pass([[0, 1]], length=4)]
    rank1 = [_pass([[1, 3], [5, 7]], steps=2), _pass([[2, 3]], length=4)]
    assert shards.union([rank0, rank1]) == [_joined([[0, 2, 1, 3], [4, 6, 5, 7]]), _joined([[0, 1, 2, 3]], length=4)]


def test_the_union_stops_where_the_processes_part():
    # batches of different sizes: their mean losses no longer average to the joined batch's
    assert shards.union([[_pass([[0, 2], [4]])], [_pass([[1, 3], [5, 7]])]]) == [_joined([[0, 2, 1, 3]])]
    # one process made a pass the other did not (rank 0 evaluates alone): the passes stop there
    rank0 = [_pass([[0, 2]]), _pass([[0, 1]], length=4), _pass([[4, 6]])]
    rank1 = [_pass([[1, 3]]), _pass([[5, 7]])]
    assert shards.union([rank0, rank1]) == [_joined([[0, 2, 1, 3]])]
    # not batches of indices (an iterable dataset)
    assert shards.union([[_pass(None)], [_pass(None)]]) == []


def test_processes_that_drew_the_same_training_samples_are_named():
    same = [[_pass([[3, 1], [0, 2]], steps=2)], [_pass([[3, 1], [0, 2]], steps=2)]]
    why = shards.same_samples(same)
    assert why.startswith("the 2 processes drew the same samples: the first batches of training pass 1 hold 4 of")
    # an evaluation pass every process reads whole (no step made in it) is not a fault
    assert shards.same_samples([[_pass([[0, 1]], steps=0)], [_pass([[0, 1]], steps=0)]]) is None
    assert shards.same_samples([[_pass([[0, 2], [4, 6]], steps=2)], [_pass([[1, 3], [5, 7]], steps=2)]]) is None


def test_processes_that_computed_the_original_s_losses_drew_its_batches():
    # data batched by hand (word_lm's batchify): each process trains on the whole set
    original = RunRecord(label="original", losses=[2.5, 2.25, 2.0])
    same = RunRecord(label="rewritten", world_size=2, losses=[2.5, 2.25, 2.0])
    assert shards.original_steps(original, same).startswith("the 2 processes computed the original's losses, step by "
                                                            "step (3 steps)")
    assert shards.original_steps(original, RunRecord(label="r", world_size=2, losses=[2.5, 2.2, 2.0])) is None


def test_what_can_t_be_held_to_the_joined_batches_says_why():
    record = RunRecord(label="rewritten", world_size=2, sampled=[[_pass([[0]])], [_pass([[1]])]])
    assert shards.why_not(record) is None
    record.batch_norm_trained = True
    assert shards.why_not(record).startswith("a BatchNorm normalised the training batches, each process over its own")
    assert shards.why_not(RunRecord(label="rewritten", world_size=2)) == "the processes' batches were not recorded"
    # a loss summed over its batch: the original's on the joined batch is N times the average
    joined = RunRecord(label="joined", losses=[4.0])
    assert "a loss summed over its batch" in shards.summed_loss(joined, RunRecord(label="r", world_size=2,
                                                                                   losses=[2.0]))
    assert shards.summed_loss(joined, RunRecord(label="r", world_size=2, losses=[4.0])) is None


def test_every_run_a_verification_starts_has_words_in_the_command_line_s_status():
    """``verify --run-devices 2`` crashed on the status line of the runs on the joined batches
    (a KeyError): each ``on_start("...")`` of the session has its words in verify's and tune's."""
    import inspect
    import re

    from accelerate_rewrite.cli.verify import RUN_LABELS, TUNE_WORDS
    from accelerate_rewrite.verify import session

    started = set(re.findall(r'on_start\("([^"]+)"\)', inspect.getsource(session)))
    assert {"original", "rewritten", "original, joined batches", "original, reseeded"} <= started
    assert started <= RUN_LABELS.keys() and started <= TUNE_WORDS.keys()


SCRIPT = '''\
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset


def main():
    torch.manual_seed(0)
    data = TensorDataset(torch.randn(96, 10), torch.randint(0, 3, (96,)))
    loader = DataLoader(data, batch_size=8, shuffle=True)
    model = nn.Sequential(nn.Linear(10, 32), nn.ReLU(), nn.Linear(32, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=3 * len(loader))
    for epoch in range(3):
        for x, y in loader:
            optimizer.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            optimizer.step()
            scheduler.step()
        print(f"epoch {epoch} loss {loss.item():.4f}")


if __name__ == "__main__":
    main()
'''
TWO = Options.create(backend="accelerate", devices=2, accelerator="cpu")
#: planted bugs in the Accelerate rewrite: (the text replaced, its replacement, the verdict, its start)
PLANTED = {
    "correct": ("", "", "pass", "held to the original on the 2 processes' batches, joined step by step: "
                                "identical within 1e-05 relative at every one of 12 steps"),
    "loss doubled": ("accelerator.backward(loss)", "accelerator.backward(loss * 2)", "fail",
                     "held to the original on the 2 processes' batches, joined step by step: the losses differ "
                     "from step 1 on"),
    "loader not prepared": ("    loader = accelerator.prepare(loader)\n", "", "fail",
                            "the 2 processes drew the same samples"),
    "batch norm": ("nn.ReLU(), nn.Linear(32, 3)", "nn.BatchNorm1d(32), nn.ReLU(), nn.Linear(32, 3)",
                   "not-compared", "the rewrite changes training on purpose (2 processes"),
}


@pytest.mark.runs
#: CI runs the correct rewrite (15-25 s a case on 2 cores); ``-m slow`` the planted bugs
@pytest.mark.parametrize("case", ["correct", *(pytest.param(case, marks=pytest.mark.slow)
                                              for case in ("loss doubled", "loader not prepared", "batch norm"))])
def test_an_accelerate_rewrite_on_two_processes_against_the_original_on_their_batches(case, tmp_path, monkeypatch):
    """The rewrite (``--backend accelerate --devices 2 --accelerator cpu``) of a plain loop with a
    shuffled loader and a schedule sized by ``len(loader)``, on 2 processes: the correct one
    passes exactly (the same samples each step, the averaged gradient is the joined batch's, and
    the original's ``len(loader)`` is each process's, as the rewrite's schedule reads it); a doubled loss fails at step 1; a loader left
    out of ``prepare`` (each process trains on the whole set) fails, said so; a BatchNorm (each
    process normalises over its own batch) is not compared, with the reason in the notes."""
    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.verify.session import verify

    pytest.importorskip("accelerate")
    monkeypatch.chdir(tmp_path)
    old, new, verdict, start = PLANTED[case]
    source = SCRIPT.replace(old, new) if case == "batch norm" else SCRIPT
    (tmp_path / "train.py").write_text(source, encoding="utf-8")
    output = rewrite(source, TWO, path="train.py").output
    assert old in output or case == "batch norm"
    (tmp_path / "rewritten.py").write_text(output.replace(old, new) if case != "batch norm" else output,
                                           encoding="utf-8")
    done = verify(tmp_path / "train.py", TWO, against=tmp_path / "rewritten.py", run_devices=2, run_on="cpu",
                  steps=12, threads=1)
    assert done.verdict.verdict == verdict, done.verdict.reason
    assert done.verdict.reason.startswith(start), done.verdict.reason
    if case == "correct":
        assert done.joined.losses == pytest.approx(done.rewritten.losses, rel=1e-5)
    if case == "loss doubled":
        assert "the gradient is 2x the original's at step 1" in done.verdict.reason
    if case == "batch norm":
        assert any("not held to the original on their batches joined: a BatchNorm" in n for n in done.notes)
