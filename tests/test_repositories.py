"""Issue 58: a repository converts as one. fixtures/repositories/pretrain_finetune holds two
training scripts (pretrain.py, finetune.py) that share utils.py and engine.py, and eval.py, a
script that trains nothing and imports utils.py too. `accelerate-rewrite .` converts both
training scripts; engine.py, which only they import, changes as the conversion would (once, for
both); utils.py changes so that eval.py keeps working; the named scripts, `-j`, and the hook over
the staged files give the same files as the folder run; and the converted repository trains on 2
CPU processes digit for digit as the original under torchrun, script after script."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.goldens import REPOSITORIES, REPOSITORY_ARGS, repository_files

FIXTURE = REPOSITORIES / "pretrain_finetune"
FILES = ("pretrain.py", "finetune.py", "eval.py", "utils.py", "engine.py")


def _tree(tmp_path: Path, name: str = "repo") -> Path:
    root = tmp_path / name
    shutil.copytree(FIXTURE, root, ignore=shutil.ignore_patterns("expected", "__pycache__"))
    return root


def _tool(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "accelerate_rewrite", *args, "--no-cache"], cwd=root,
                          capture_output=True, text=True, timeout=300, env={**os.environ, "COLUMNS": "1000"})


def _texts(root: Path) -> dict[str, str]:
    return {f: (root / f).read_text(encoding="utf-8") for f in FILES}


def test_the_folder_run_converts_both_entry_points_and_their_shared_modules_once(tmp_path):
    root = _tree(tmp_path)
    done = _tool(root, ".", *REPOSITORY_ARGS, "--format", "json", "-j", "1")
    assert done.returncode == 0, done.stderr
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    records = {r["path"]: r for r in lines}
    assert "AR101" in records["pretrain.py"]["rules"] and "AR101" in records["finetune.py"]["rules"]
    assert not records["eval.py"]["changed"]
    assert [r["path"] for r in lines].count("utils.py") == 1 and [r["path"] for r in lines].count("engine.py") == 1
    assert not any(r["dropped"] for r in lines), [r["dropped"] for r in lines]
    compat = [c["message"] for c in records["utils.py"]["changes"] if c["rule"] == "project"]
    assert len(compat) == 1 and compat[0].startswith("changed so that"), compat
    written = _tool(root, ".", *REPOSITORY_ARGS, "--write", "-q")
    assert written.returncode == 0, written.stderr
    now = _texts(root)
    expected = repository_files("pretrain_finetune")
    assert sorted(expected) == ["engine.py", "finetune.py", "pretrain.py", "utils.py"]
    for name, text in expected.items():
        assert now[name] == text, name
    assert now["eval.py"] == (FIXTURE / "eval.py").read_text(encoding="utf-8")
    # engine.py: only the two converted scripts import it, so it changes as the conversion would
    assert "def train_one_epoch(model, criterion, data_loader, optimizer, fabric, epoch" in now["engine.py"]
    assert "fabric is not None" not in now["engine.py"]
    # utils.py: eval.py, which trains nothing, imports it too: it keeps the old path for eval.py
    assert "def init_distributed_mode(args, fabric=None):" in now["utils.py"]
    assert "utils.init_distributed_mode(args, fabric=fabric)" in now["pretrain.py"]
    assert "utils.init_distributed_mode(args, fabric=fabric)" in now["finetune.py"]
    again = _tool(root, ".", *REPOSITORY_ARGS, "--check")
    assert again.returncode == 0, again.stdout + again.stderr  # idempotent


def test_named_scripts_jobs_and_the_hook_give_the_folder_run_s_files(tmp_path):
    folder = _tree(tmp_path, "folder")
    assert _tool(folder, ".", *REPOSITORY_ARGS, "--write", "-q", "-j", "1").returncode == 0
    named = _tree(tmp_path, "named")
    done = _tool(named, "pretrain.py", "finetune.py", *REPOSITORY_ARGS, "--write", "-q")
    assert done.returncode == 0, done.stderr
    jobs = _tree(tmp_path, "jobs")
    assert _tool(jobs, ".", *REPOSITORY_ARGS, "--write", "-q", "-j", "2").returncode == 0
    hook = _tree(tmp_path, "hook")
    (hook / "pyproject.toml").write_text(
        '[tool.accelerate-rewrite]\nselect = ["ALL"]\nbackend = "fabric"\ndevices = 2\naccelerator = "cpu"\n')
    done = _tool(hook, "--pre-commit", *FILES)
    assert done.returncode == 0, done.stdout + done.stderr  # pre-commit itself sees the files changed
    assert _texts(folder) != _texts(_tree(tmp_path, "pristine"))
    assert _texts(named) == _texts(folder)
    assert _texts(jobs) == _texts(folder)
    assert _texts(hook) == _texts(folder)


def test_versions_of_a_module_merge_where_they_change_different_places():
    from accelerate_rewrite.codemod.project.merge import merge

    base = "import os\n\n\ndef f(x):\n    return x\n\n\ndef g(y):\n    return y\n"
    ours = base.replace("def f(x):\n    return x", "def f(x, fabric=None):\n    return fabric or x")
    theirs = base.replace("def g(y):\n    return y", "def g(y, fabric=None):\n    return fabric or y")
    both = merge(base, ours, theirs)
    assert "def f(x, fabric=None)" in both and "def g(y, fabric=None)" in both
    assert merge(base, ours, ours) == ours and merge(base, base, theirs) == theirs
    assert merge(base, ours, base.replace("return x", "return -x")) is None  # one place, two ways


@pytest.mark.parametrize("steps", [("pretrain.py", "finetune.py", "eval.py")])
def test_the_converted_repository_trains_every_rank_as_the_original(tmp_path, steps):
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from tests import processes

    original, rewritten = _tree(tmp_path, "original"), _tree(tmp_path, "rewritten")
    assert _tool(rewritten, ".", *REPOSITORY_ARGS, "--write", "-q").returncode == 0
    line = re.compile(r"\[rank (\d)\] (epoch \d+ step \d+ loss \d+\.\d{6} norm \d+\.\d{6}"
                      r"|accuracy [\d.]+ on \d+ samples|logits sum -?[\d.]+)")
    seen = []
    for folder, launch in ((original, lambda s: processes.torchrun(s)), (rewritten, lambda s: [sys.executable, s])):
        out = []
        for script in steps:
            cmd = launch(script) if script != "eval.py" else [sys.executable, script]
            done = processes.run_ranks(cmd, folder)
            assert done.returncode == 0, (folder.name, script, done.stderr[-3000:])
            out.append(sorted(line.findall(done.stdout)))
        seen.append(out)
    before, after = seen
    assert [len(x) for x in before] == [32, 36, 1]  # 2 ranks x 16 steps (and 2 evaluations each), one eval
    assert after == before


def test_a_script_a_launcher_imports_converts_as_its_own(tmp_path):
    """DINO's main_dino.py, which run_with_submitit.py imports to start it on a cluster: run as a
    script of its own, it is an entry point of the folder run and converts as when named alone;
    the launcher, which trains nothing, stays as it is."""
    root = tmp_path / "repo"
    root.mkdir()
    (root / "train.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\ndef main(epochs=2):\n"
        "    model = torch.nn.Linear(4, 2)\n    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    loader = DataLoader(TensorDataset(torch.randn(16, 4)), batch_size=4)\n    for _ in range(epochs):\n"
        "        for (x,) in loader:\n            loss = model(x).pow(2).mean()\n            opt.zero_grad()\n"
        "            loss.backward()\n            opt.step()\n\n\nif __name__ == \"__main__\":\n    main()\n")
    (root / "launcher.py").write_text(
        "import train\n\n\nclass Job:\n    def __call__(self):\n        train.main(epochs=1)\n\n\n"
        "if __name__ == \"__main__\":\n    Job()()\n")
    alone = _tool(root, "train.py", "--format", "json")
    whole = _tool(root, ".", "--format", "json", "-j", "1")
    lines = [json.loads(line) for line in whole.stdout.splitlines()]
    assert [r["path"] for r in lines].count("train.py") == 1, whole.stdout  # said once, as its own
    records = {r["path"]: r for r in lines}
    assert "AR101" in records["train.py"]["rules"], whole.stdout
    assert not records["launcher.py"]["changed"]
    assert json.loads(alone.stdout.splitlines()[0])["rules"] == records["train.py"]["rules"]


def test_the_hook_over_some_of_the_files_names_the_one_it_would_change(tmp_path):
    """Staged: the two scripts and engine.py, not utils.py, which their conversions change: each
    is left as it is, and the reason names utils.py as not among the paths given (the first rule
    whose edits change it, not a shorter prefix of the rules that fails otherwise)."""
    root = _tree(tmp_path)
    (root / "pyproject.toml").write_text(
        '[tool.accelerate-rewrite]\nselect = ["ALL"]\nbackend = "fabric"\ndevices = 2\naccelerator = "cpu"\n')
    done = _tool(root, "--pre-commit", "-v", "pretrain.py", "finetune.py", "engine.py")
    assert done.returncode == 0, done.stderr
    assert _texts(root) == _texts(_tree(tmp_path, "pristine"))
    said = done.stdout + done.stderr
    assert said.count("AR105 fabric-device: dropped for this project: it would change utils.py, which is "
                      "not among the paths given") == 2, said
    assert "no longer defined" not in said


# ---- no dead code: what the rewrite empties goes ---------------------------------------------------

_SSD = '''import torch
import torch.nn as nn


def main(args):
    ssd_net = nn.Linear(4, 2)
    net = ssd_net
    if args.cuda:
        net = torch.nn.DataParallel(ssd_net)
        torch.backends.cudnn.benchmark = True
    if args.half:
        net = net.half()
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1)
    for _ in range(2):
        x = torch.randn(8, 4)
        if args.half:
            x = x.half()
        loss = net(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
'''


def test_a_wrap_or_a_cast_the_rewrite_removes_leaves_no_statement_that_repeats_another():
    """SSD's ``net = ssd_net`` then ``if args.cuda: net = DataParallel(ssd_net)``: the wrap goes
    whole, not ``net = ssd_net`` twice; akamaster's ``if args.half: x = x.half()`` under
    bf16-mixed goes whole, not ``x = x`` (nor an ``if`` left with nothing in it)."""
    import ast
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
    from whole_repo import dead_statements

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.options import Options

    result = rewrite(_SSD, Options.create(precision="bf16-mixed"))
    assert result.changed and not result.dropped, result.dropped
    ast.parse(result.output)
    assert result.output.count("net = ssd_net") == 1, result.output
    assert "x = x\n" not in result.output and "if args.half" not in result.output, result.output
    assert "torch.backends.cudnn.benchmark = True" in result.output
    assert dead_statements(result.output) == []


def test_a_function_that_builds_and_returns_the_optimizer_gets_no_fabric_it_would_not_read():
    """minGPT-ddp's ``create_optimizer(model, config)`` returns the optimizer it builds, which is
    set up where its caller receives it: the function keeps its signature."""
    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.options import Options

    source = '''import torch


def create_optimizer(model, lr):
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
    return optimizer


def main():
    model = torch.nn.Linear(4, 2)
    optimizer = create_optimizer(model, 1e-3)
    for _ in range(2):
        loss = model(torch.randn(8, 4)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
'''
    result = rewrite(source, Options.create())
    assert "def create_optimizer(model, lr):" in result.output and "create_optimizer(model, 1e-3)" in result.output
    assert "model, optimizer = fabric.setup(model, optimizer)" in result.output


def test_a_module_that_runs_as_a_script_of_its_own_keeps_its_own_code_working(tmp_path):
    """YOLOv3's test.py: train.py imports its ``_evaluate``, and its own ``run()`` calls it too.
    Converted with train.py, it changes so that its own code keeps working (``fabric=None``), and
    ``python metrics.py`` runs as before."""
    pytest.importorskip("torch")
    root = tmp_path / "repo"
    root.mkdir()
    (root / "metrics.py").write_text(
        "import torch\n\n\n@torch.no_grad()\ndef evaluate(model, loader, device):\n    total = 0.0\n"
        "    for x, y in loader:\n        x, y = x.to(device), y.to(device)\n"
        "        total += (model(x) - y).pow(2).mean().item()\n    print(f\"eval {total:.4f}\")\n    return total\n\n\n"
        "def run():\n    model = torch.nn.Linear(4, 2)\n    data = [(torch.ones(2, 4), torch.zeros(2, 2))]\n"
        "    evaluate(model, data, \"cpu\")\n\n\nif __name__ == \"__main__\":\n    torch.manual_seed(0)\n    run()\n")
    (root / "train.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\nfrom metrics import evaluate\n\n\n"
        "def main():\n    device = torch.device(\"cuda\" if torch.cuda.is_available() else \"cpu\")\n    model = torch.nn.Linear(4, 2).to(device)\n"
        "    opt = torch.optim.SGD(model.parameters(), lr=0.1)\n"
        "    loader = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 2)), batch_size=4)\n"
        "    for x, y in loader:\n        x, y = x.to(device), y.to(device)\n"
        "        loss = (model(x) - y).pow(2).mean()\n        opt.zero_grad()\n        loss.backward()\n"
        "        opt.step()\n    evaluate(model, loader, device)\n\n\nif __name__ == \"__main__\":\n    main()\n")
    before = subprocess.run([sys.executable, "metrics.py"], cwd=root, capture_output=True, text=True, timeout=120)
    done = _tool(root, ".", *REPOSITORY_ARGS, "--write", "-q")
    assert done.returncode == 0, done.stderr
    text = (root / "metrics.py").read_text()
    assert "def evaluate(model, loader, device, fabric=None):" in text, text
    assert "Fabric(" in (root / "train.py").read_text()
    after = subprocess.run([sys.executable, "metrics.py"], cwd=root, capture_output=True, text=True, timeout=120)
    assert before.returncode == after.returncode == 0, after.stderr
    assert after.stdout == before.stdout
