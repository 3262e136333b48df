"""AR404 dataloader-hints: reported on every run, applied only when selected by its code or
name; where workers are safe to add; and real runs on the CPU: pin_memory and num_workers keep
the losses bit for bit, persistent_workers changes the shuffle from the second epoch."""

from __future__ import annotations

import ast

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.config import choose
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES

HINTS = Options.create(backend="torch", explicit=("AR404",))
SCRIPT = '''\
import torch
from torch.utils.data import DataLoader, TensorDataset

ds = TensorDataset(torch.randn(8, 2))
top = DataLoader(ds, batch_size=4)


class Noisy(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        return torch.randn(2) + i


def main(args):
    a = DataLoader(ds, batch_size=4, pin_memory=False, num_workers=2)
    b = DataLoader(
        ds,
        batch_size=4,
    )
    c = DataLoader(ds, num_workers=args.workers)
    d = DataLoader(Noisy(), collate_fn=lambda b: b)
    e = DataLoader(Noisy(), batch_size=4, num_workers=0, persistent_workers=False)
    f = DataLoader(**settings)


if __name__ == "__main__":
    main(None)
'''


def _notes(result, skipped: bool) -> list[str]:
    return [f"{n.line}: {n.message}" for n in result.notes if n.rule == "AR404" and n.skipped == skipped]


def test_without_selection_it_only_hints():
    result = rewrite(SCRIPT, Options.create(backend="torch"))
    assert not result.changed
    hints = [n for n in _notes(result, True) if "hint:" in n]
    assert len(hints) == 6 and all("(select AR404, dataloader-hints, to apply)" in h for h in hints)


@pytest.mark.parametrize("select,explicit", [
    (("AR404",), True), (("dataloader-hints",), True), (("ALL",), False), (("AR4",), False),
    (("ALL", "ar404"), True)])
def test_only_a_selection_by_code_or_name_applies_it(select, explicit, tmp_path):
    choice = choose(tmp_path / "train.py", {"select": select}, isolated=True)
    assert ("AR404" in choice.options.explicit) is explicit


def test_selected_it_applies_where_it_is_safe():
    result = rewrite(SCRIPT, HINTS)
    out = result.output
    ast.parse(out)
    assert rewrite(out, HINTS).output == out, "not idempotent"
    assert "top = DataLoader(ds, batch_size=4, pin_memory=torch.cuda.is_available())\n" in out
    assert "a = DataLoader(ds, batch_size=4, pin_memory=False, num_workers=2, persistent_workers=True)\n" in out
    assert ("    b = DataLoader(\n        ds,\n        batch_size=4,\n        pin_memory=torch.cuda.is_available(),\n"
            "        num_workers=min(4, os.cpu_count() or 1),\n        persistent_workers=True,\n    )\n") in out
    assert "c = DataLoader(ds, num_workers=args.workers, pin_memory=torch.cuda.is_available())\n" in out
    assert "import os\n" in out
    skipped = " | ".join(_notes(result, True))
    assert "5: `DataLoader(ds, batch_size=4)`: no num_workers: worker processes re-run" in skipped
    assert "is not a literal: no persistent_workers" in skipped
    assert "`lambda b: b` is a lambda" in skipped
    assert "`Noisy.__getitem__` draws random numbers" in skipped
    assert "`**settings`" in skipped
    changes = {n.line: n for n in result.notes if n.rule == "AR404" and not n.skipped}
    assert changes[5].kind.value == "safe"  # pin_memory only
    assert changes[17].kind.value == "changes-training"  # persistent workers
    assert changes[23].kind.value == "safe"  # a lambda: no workers, pin_memory only
    assert changes[24].kind.value == "changes-training"  # workers for a dataset that draws random numbers


def test_the_pre_commit_default_selection_leaves_it_out(tmp_path):
    choice = choose(tmp_path / "train.py", {}, defaults={"select": ("fixes",), "backend": "torch"}, isolated=True)
    assert "AR404" not in {r.code for r in choice.rules}


@pytest.mark.runs
def test_training_with_workers_and_pinned_memory(tmp_path, monkeypatch):
    """train_function with the three keywords: the first epoch's batches and losses are the
    original's (workers and pinned memory keep them), the second epoch's shuffle is another
    (persistent workers), so the run is classified as changes-training, not compared."""
    pytest.importorskip("torch")
    from accelerate_rewrite.verify.session import verify

    monkeypatch.chdir(tmp_path)
    (tmp_path / "input.py").write_text((FIXTURES / "train_function" / "input.py").read_text())
    v = verify(tmp_path / "input.py", HINTS, steps=12, threads=1, run_on="cpu")
    # nothing checks the changed shuffle of the second epoch: "not compared" (exit 3), never a pass
    assert v.verdict.verdict == "not-compared", v.verdict.reason
    assert v.verdict.exit_code == 3 and "AR404" in v.verdict.reason
    assert v.verdict.comparison["tolerance"]["kind"] == "changes-training"
    assert v.rewritten.losses[:6] == v.original.losses[:6]  # 6 batches an epoch
    assert v.rewritten.losses[6:] != v.original.losses[6:]
