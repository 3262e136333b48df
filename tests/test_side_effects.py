"""Issue 48: what a conversion must keep on N processes and in the text: side effects that
would run twice, and comments the rules never touched (fixtures/apex_dcgan)."""

from __future__ import annotations

import io
import tokenize
from collections import Counter

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES


def _comments(code: str) -> Counter:
    return Counter(t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type == tokenize.COMMENT)


def test_the_apex_dcgan_example_migrates_with_every_comment_kept():
    """NVIDIA apex's examples/dcgan/main_amp.py, reduced: the ``try: from apex import amp``
    guard goes whole once its import does (its blank line with it), which the comment check
    counted as a blank line lost outside the edits, and blamed on ``# folder dataset``: the
    migration was dropped for a comment it never touched."""
    source = (FIXTURES / "apex_dcgan" / "input.py").read_text(encoding="utf-8")
    for options in (Options.create(backend="torch", precision="16-mixed"), Options.create()):
        result = rewrite(source, options, path="fixtures/apex_dcgan/input.py")
        assert not result.dropped, result.dropped
        assert "with amp.scale_loss" not in result.output and "from apex" not in result.output
        assert _comments(result.output) == _comments(source)


def test_a_lost_blank_line_is_named_as_such_not_as_a_later_comment():
    from accelerate_rewrite.codemod.edits.preserve import lost_trivia

    source = "import a\n\nimport b\n# one\nx = 1\n\n# two\ny = 2\n"
    output = "import a\nimport b\n# one\nx = 1\n\n# two\ny = 2\n"
    assert lost_trivia(source, output, []) == "it would lose the blank line 2"


# ---- side effects on N processes: run once (gloo processes on CPU, from a fresh folder) -------


def _archive(folder, rows: int = 64) -> str:
    """A cora.tgz of a numeric table (features, then a class), as file:// URL: no network."""
    import tarfile

    import numpy as np

    rng = np.random.default_rng(0)
    table = np.concatenate([rng.normal(size=(rows, 12)), rng.integers(0, 3, size=(rows, 1))], axis=1)
    (folder / "cora").mkdir(parents=True)
    np.savetxt(folder / "cora" / "cora.content", table, fmt="%.6f")
    with tarfile.open(folder / "cora.tgz", "w:gz") as tar:
        tar.add(folder / "cora", arcname="cora")
    return (folder / "cora.tgz").resolve().as_uri()


def test_a_hand_written_download_runs_on_rank_zero_then_a_barrier():
    out = rewrite((FIXTURES / "own_download" / "input.py").read_text(encoding="utf-8"),
                  Options.create(devices=2)).output
    assert ("    fabric = Fabric(devices=2)\n    fabric.launch()\n    if fabric.is_global_zero:\n"
            "        fetch(args.url, args.root)\n    fabric.barrier()\n    features, labels = load(args.root)\n") in out
    acc = rewrite((FIXTURES / "own_download" / "input.py").read_text(encoding="utf-8"),
                  Options.create(backend="accelerate", devices=2)).output
    assert "    if accelerator.is_main_process:\n        fetch(args.url, args.root)\n" \
           "    accelerator.wait_for_everyone()\n" in acc


import pytest  # noqa: E402


@pytest.mark.slow  # (a second of its kind: out of CI's 15 minutes)
@pytest.mark.runs
def test_a_script_that_downloads_its_data_runs_on_two_processes_from_a_fresh_folder_five_times(tmp_path):
    """own_download on 2 gloo processes (Fabric's launcher), each run in a folder of its own
    with no data yet: it runs, prints each epoch once, and unpacks the same files one process
    does."""
    import sys

    from tests import processes

    url = _archive(tmp_path / "server")
    source = (FIXTURES / "own_download" / "input.py").read_text(encoding="utf-8")
    rewritten = rewrite(source, Options.create(devices=2, accelerator="cpu")).output
    one = tmp_path / "one"
    one.mkdir()
    (one / "input.py").write_text(source, encoding="utf-8")
    first = processes.run_ranks([sys.executable, "input.py", "--url", url], one)
    assert first.returncode == 0, first.stderr[-2000:]
    expected = (one / "data" / "cora" / "cora.content").read_bytes()
    for k in range(5):
        run = tmp_path / f"run{k}"
        run.mkdir()
        (run / "input.py").write_text(rewritten, encoding="utf-8")
        done = processes.run_ranks([sys.executable, "input.py", "--url", url], run)
        assert done.returncode == 0, (k, done.stderr[-3000:])
        assert [line.split(" loss")[0] for line in done.stdout.splitlines() if line.startswith("epoch")] == \
            ["epoch 0", "epoch 1"], done.stdout
        assert (run / "data" / "cora" / "cora.content").read_bytes() == expected


@pytest.mark.runs
def test_a_project_helper_s_progress_bar_prints_once_on_two_processes(tmp_path, monkeypatch):
    """progress_helper (kuangliu/pytorch-cifar's shape): utils.py's progress_bar writes with
    sys.stdout.write; train() and test() receive `fabric` and call it on rank 0: on 2 processes
    the test bar prints as on one process, the train bar rank 0's half of the batches, once."""
    import shutil
    import sys

    from tests import processes
    from tests.goldens import PROJECTS, project_outputs, project_scope

    monkeypatch.chdir(PROJECTS.parent.parent)
    path = "fixtures/projects/progress_helper/train.py"
    result = rewrite(open(path, encoding="utf-8").read(), Options.create(devices=2, accelerator="cpu"), path=path,
                     scope=project_scope("progress_helper"))
    outputs = project_outputs(result)
    assert "if fabric.is_global_zero:\n                progress_bar(" in outputs["train.py"]
    for folder, files in (("original", {}), ("rewritten", outputs)):
        shutil.copytree(PROJECTS / "progress_helper", tmp_path / folder, ignore=shutil.ignore_patterns("expected"))
        for name, text in files.items():
            (tmp_path / folder / name).write_text(text, encoding="utf-8")
    runs = {folder: processes.run_ranks([sys.executable, "train.py"], tmp_path / folder)
            for folder in ("original", "rewritten")}
    for done in runs.values():
        assert done.returncode == 0, done.stderr[-2000:]
    bars = {folder: [line for line in done.stdout.splitlines() if line.startswith(" [")]
            for folder, done in runs.items()}
    tests_ = {folder: [b for b in lines if "Loss" not in b] for folder, lines in bars.items()}
    trains = {folder: [b for b in lines if "Loss" in b] for folder, lines in bars.items()}
    # the accuracies are the trained model's (each process trains on its shard): the bars and counts
    shape = {folder: [(b.split(" | ")[0], b.rsplit(" ", 1)[-1]) for b in lines] for folder, lines in tests_.items()}
    assert shape["rewritten"] == shape["original"] and shape["original"]
    assert len(trains["rewritten"]) == len(trains["original"]) // 2


def test_a_helper_that_writes_and_evaluates_is_not_run_on_rank_zero_alone():
    """A function that writes to the terminal but also runs the model over a loader (an
    evaluation with its own progress line) is not put under a rank check: the other processes
    would miss its forward (DDP's collectives); its write is listed as per-process."""
    source = '''import sys
import torch
from torch.utils.data import DataLoader, TensorDataset


def evaluate(model, loader):
    correct = 0
    with torch.no_grad():
        for x, y in loader:
            correct += (model(x).argmax(1) == y).sum().item()
    sys.stdout.write("acc %d\\n" % correct)


def main():
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randint(0, 2, (16,))), batch_size=4)
    for x, y in loader:
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(model(x), y).backward()
        optimizer.step()
    val_loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randint(0, 2, (8,))), batch_size=4)
    evaluate(model, val_loader)


main()
'''
    result = rewrite(source, Options.create(devices=2))
    assert "Fabric(" in result.output and "    evaluate(model, val_loader)\n" in result.output, result.dropped
    assert any("sys.stdout.write" in n.message and "every process" in n.message for n in result.skips)
