"""Issue 46: research codebases convert as one program.

The seed's own tutorial shape first (a function that took ``device`` takes ``fabric``), then the
project read as one program (packages, relative imports, ``as``), well-known library APIs known
as data, and the one-line hints that lift a refusal. Fixtures in these shapes have goldens
(tests/test_fixtures.py, tests/test_projects.py) and run both ways at 32-true
(tests/test_verify.py, here).
"""

from __future__ import annotations

import ast
import textwrap

from tests.goldens import FIXTURES, run
from tests.test_conversions import convert


def _params(code: str, name: str) -> list[str]:
    func = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return [a.arg for a in [*func.args.args, *func.args.kwonlyargs]]


def _reads(code: str, func_name: str, name: str) -> bool:
    func = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == func_name)
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(func))


def test_a_function_that_took_the_device_takes_fabric_with_fabric_a_global():
    """The seed's 01 shape (fixtures/vit_finetune): Fabric is created at the top of
    ``if __name__ == "__main__":``, a global; ``train(..., device)`` still takes `fabric` in the
    device's place and reads it as its parameter, and the caller passes ``fabric=fabric``: no
    parameter is left that nothing reads, and ``train`` works when another module imports it."""
    result = run("vit_finetune", "bf16-mixed-devices-4")
    out = result.output
    assert _params(out, "train") == ["num_epochs", "model", "optimizer", "train_loader", "val_loader", "fabric"]
    assert "        fabric=fabric\n" in out and "device=" not in out
    assert not _reads(out, "train", "device")
    assert any(n.rule == "AR105" and "parameter `device` became `fabric`" in n.message for n in result.changes)


def test_every_parameter_the_output_keeps_is_read():
    """No dead parameter: in every function of the rewrite, each parameter the original read is
    still read (a threaded `device` became `fabric`, which is read)."""
    source = (FIXTURES / "vit_finetune" / "input.py").read_text()
    out = run("vit_finetune", "default").output
    for func in (n for n in ast.walk(ast.parse(out)) if isinstance(n, ast.FunctionDef)):
        for arg in [*func.args.args, *func.args.kwonlyargs]:
            if arg.arg in ("self",):
                continue
            assert any(isinstance(n, ast.Name) and n.id == arg.arg for n in ast.walk(func)), (func.name, arg.arg)
    assert source != out


def test_a_device_parameter_is_threaded_only_where_every_call_passes_the_device():
    """``probe(model, "cpu")`` passes a string of its own: ``probe`` keeps its ``device``
    (threaded, that call would hand a string to code that reads ``fabric.device``), and the
    device definition stays for it; ``train``, always passed the device, takes `fabric`."""
    for home in ("", "def main():\n"):
        body = """
            model = nn.Linear(4, 1)
            probe(model, "cpu")
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model.to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
            train(model, optimizer, loader, device)
            probe(model, device)
        """
        body = textwrap.indent(textwrap.dedent(body), "    " if home else "")
        result = convert(textwrap.dedent("""
            import torch
            import torch.nn as nn
            from torch.utils.data import DataLoader, TensorDataset

            def probe(model, device):
                return model(torch.zeros(1, 4, device=device))

            def train(model, optimizer, loader, device):
                for x, y in loader:
                    x, y = x.to(device), y.to(device)
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step()
        """) + home + body + ("main()\n" if home else ""))
        out = result.output
        assert _params(out, "train") == ["model", "optimizer", "loader", "fabric"]
        assert _params(out, "probe") == ["model", "device"]
        assert "train(model, optimizer, loader, fabric)" in out
        assert 'probe(model, "cpu")' in out and "probe(model, device)" in out
        assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in out


DINO_CHAIN = """
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def restore(path, optimizer=None):
    return path


def main(name):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(4, 1).to(device)
    if name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters())
    elif name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    LATER
    restore("checkpoint.pth", optimizer=optimizer)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


main("sgd")
"""


def test_an_elif_chain_the_script_reads_after_on_every_path_converts():
    """DINO's optimizer: built in an ``if``/``elif`` chain without ``else``, read by the script
    on the next statement, on every path. The set-up after the chain reads it where the script
    does: where the chain binds nothing, both fail with a NameError before any training, so it
    converts. Anything that may leave between the two (``return``, a ``raise`` in a nested
    ``if``) keeps the refusal."""
    result = convert(DINO_CHAIN.replace("    LATER\n", ""))
    assert ("        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    model, optimizer = fabric.setup(model, optimizer)\n") in result.output
    for leave in ("    if name == 'none':\n        return\n", "    if name == 'none':\n        raise SystemExit\n"):
        result = convert(DINO_CHAIN.replace("    LATER\n", leave), allow_dropped=True)
        assert not result.changed
        assert any("reads `optimizer`" in d and "some path leaves it unbound" in d for d in result.dropped)


def test_two_models_passed_to_one_class_are_two_objects():
    """DINO's ``MultiCropWrapper(student, ...)`` and ``MultiCropWrapper(teacher, ...)``: the
    class's parameter holds neither model, so the teacher, which no optimizer trains, is not
    taken for the student set up with Fabric: its move stays (as `fabric.device`)."""
    result = convert("""
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

        class Wrapper(nn.Module):
            def __init__(self, backbone, head):
                super().__init__()
                self.backbone = backbone
                self.head = head

            def forward(self, x):
                return self.head(self.backbone(x))

        def main():
            student = Wrapper(nn.Linear(4, 3), nn.Linear(3, 1))
            teacher = Wrapper(nn.Linear(4, 3), nn.Linear(3, 1))
            student = Wrapper(student, nn.Identity())
            teacher = Wrapper(teacher, nn.Identity())
            student, teacher = student.cuda(), teacher.cuda()
            for p in teacher.parameters():
                p.requires_grad = False
            optimizer = torch.optim.SGD(student.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
            for x, y in loader:
                x = x.cuda()
                loss = nn.functional.mse_loss(student(x) + teacher(x), y.cuda())
                loss.backward()
                optimizer.step()

        main()
    """)
    assert "    student, teacher = student, teacher.to(fabric.device)\n" in result.output
    assert "    student, optimizer = fabric.setup(student, optimizer)\n" in result.output


# ---- fixtures/projects/research_engine: the research codebase's shape, run ----------------------

def _research_trees(tmp_path, options, shape=None):
    """The original project and its rewrite (``accelerate-rewrite train.py`` as its user runs it:
    eval.py, another script of the repository, imports utils.py too), each in a folder;
    ``shape(folder)`` changes both copies first."""
    from tests.goldens import project_trees

    return project_trees(tmp_path, "research_engine", options, ("train.py", "engine.py", "utils.py"), shape)


def test_research_engine_trains_every_rank_as_before_and_its_other_script_still_runs(tmp_path):
    """DeiT's, MAE's and DINO's shape (fixtures/projects/research_engine): the process group
    started in utils.py, the loss scaler of utils.py running backward and the step, the loop in
    engine.py, and eval.py importing utils.py too. The original under torchrun on 2 gloo
    processes, the rewrite with Fabric on 2 CPU devices: each rank's losses and gradient norms
    equal, digit for digit, and rank 0's checkpoint holds the same weights; utils.py changes
    compatibly, so eval.py, untouched, runs on the rewritten utils.py and prints what it did."""
    import re
    import sys

    import pytest

    torch = pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from accelerate_rewrite.options import Options
    from tests import processes

    original, rewritten, result = _research_trees(tmp_path, Options.create(devices=2, accelerator="cpu"))
    utils = next(m for m in result.members if m.path.endswith("utils.py"))
    assert "def init_distributed_mode(args, fabric=None):" in utils.output
    assert "utils.init_distributed_mode(args, fabric=fabric)" in result.output
    runs = [processes.run_ranks(processes.torchrun("train.py"), original),
            processes.run_ranks([sys.executable, "train.py"], rewritten)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    line = re.compile(r"\[rank (\d)\] epoch (\d+) step (\d+) loss (\d+\.\d{6}) norm (\d+\.\d{6})")
    before, after = (sorted(line.findall(done.stdout)) for done in runs)
    assert {rank for rank, *_ in before} == {"0", "1"} and len(before) == 32
    assert after == before
    saved = [torch.load(folder / "output" / "checkpoint.pth", weights_only=False) for folder in (original, rewritten)]
    assert all(torch.equal(saved[0]["model"][k], saved[1]["model"][k]) for k in saved[0]["model"])
    evals = [processes.run([sys.executable, "eval.py"], cwd=folder, timeout=120) for folder in (original, rewritten)]
    assert evals[0].returncode == evals[1].returncode == 0, evals[1].stderr[-2000:]
    assert "logits sum" in evals[0].stdout and evals[1].stdout == evals[0].stdout


def _swin_shape(folder):
    """Swin's and iBOT's variations on the shape: the local rank read in a config module before
    the process group starts (``int(os.environ["LOCAL_RANK"])``, no default), and the wrap's
    options chosen by a flag."""
    (folder / "config.py").write_text(
        "import os\n\n\ndef update_config(args):\n    args.amp = False\n"
        "    args.local_rank = int(os.environ[\"LOCAL_RANK\"])\n\n\n"
        "def get_config(args):\n    update_config(args)\n    return args\n")
    train = folder / "train.py"
    text = train.read_text().replace("import utils\n", "import utils\nfrom config import get_config\n").replace(
        '    parser.add_argument("--seed", default=0, type=int)\n',
        '    parser.add_argument("--seed", default=0, type=int)\n    parser.add_argument("--arch", default="swin")\n'
    ).replace(
        "        model = torch.nn.parallel.DistributedDataParallel(model)\n",
        "        model = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False) if \\\n"
        "            args.arch == \"swin\" else torch.nn.parallel.DistributedDataParallel(model)\n").replace(
        "    args = get_args_parser().parse_args()\n", "    args = get_config(get_args_parser().parse_args())\n")
    train.write_text(text)


def test_a_conditional_wrap_and_a_config_s_local_rank_train_every_rank_as_before(tmp_path):
    """The research shape with Swin's config.py and iBOT's conditional wrap, both trees under
    torchrun on 2 gloo processes (the kept ``int(os.environ["LOCAL_RANK"])`` needs a launcher
    that sets it): each rank's losses and gradient norms equal, digit for digit."""
    import re

    import pytest

    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from accelerate_rewrite.options import Options
    from tests import processes

    original, rewritten, result = _research_trees(tmp_path, Options.create(devices=2, accelerator="cpu"),
                                                  shape=_swin_shape)
    assert 'strategy=DDPStrategy(broadcast_buffers=False if args.arch == "swin" else True)' in result.output
    assert 'int(os.environ["LOCAL_RANK"])' in (rewritten / "config.py").read_text()
    runs = [processes.run_ranks(processes.torchrun("train.py"), folder) for folder in (original, rewritten)]
    for done in runs:
        assert done.returncode == 0, done.stderr[-3000:]
    line = re.compile(r"\[rank (\d)\] epoch (\d+) step (\d+) loss (\d+\.\d{6}) norm (\d+\.\d{6})")
    before, after = (sorted(line.findall(done.stdout)) for done in runs)
    assert {rank for rank, *_ in before} == {"0", "1"} and len(before) == 32
    assert after == before


# ---- codemod/project/compat.py: a module other files import, changed compatibly -------------------------

def test_a_shared_function_takes_fabric_last_and_optional_and_guards_what_changed():
    from accelerate_rewrite.codemod.project.compat import Taken, compatible
    from accelerate_rewrite.codemod.project.keywords import calls_by_keyword

    old = ("import torch.distributed as dist\n\n\n"
           "def reduce(t, *rest, op=None):\n    # sum over the processes\n    dist.all_reduce(t)\n"
           "    return t / dist.get_world_size()\n")
    new = ("import torch.distributed as dist\n\n\n"
           "def reduce(fabric, t, *rest, op=None):\n    # sum over the processes\n"
           "    t = fabric.all_reduce(t, reduce_op=\"sum\")\n    return t / fabric.world_size\n")
    made = compatible(old, new)
    assert made.code == (
        "import torch.distributed as dist\n\n\n"
        "def reduce(t, *rest, op=None, fabric=None):\n    # sum over the processes\n"
        "    if fabric is not None:\n        t = fabric.all_reduce(t, reduce_op=\"sum\")\n"
        "        return t / fabric.world_size\n    else:\n        dist.all_reduce(t)\n"
        "        return t / dist.get_world_size()\n")
    assert made.keyword_calls == {"reduce": Taken(0)} and made.changed == ["reduce"]
    assert calls_by_keyword("y = utils.reduce(fabric, x, 1)\nz = reduce(fabric, x)\n", made.keyword_calls) == \
        "y = utils.reduce(x, 1, fabric=fabric)\nz = reduce(x, fabric=fabric)\n"
    namespace: dict = {}
    exec(compile(made.code.replace("import torch.distributed as dist", "class dist:\n"
                                   "    all_reduce = staticmethod(lambda t: None)\n"
                                   "    get_world_size = staticmethod(lambda: 2)"), "<compat>", "exec"), namespace)
    assert namespace["reduce"](4.0) == 2.0  # called as before: the old code runs


def test_a_change_that_reads_no_fabric_stays_out_and_one_that_can_t_keep_its_callers_is_none():
    from accelerate_rewrite.codemod.project.compat import compatible
    from accelerate_rewrite.codemod.project.keywords import calls_by_keyword

    # a change that reads no `fabric` (an API's new spelling, a move Fabric makes anyway) can't be
    # told from one the other callers would notice: the old code stays
    old = "import torch\n\n\ndef scaler():\n    return torch.cuda.amp.GradScaler()\n"
    new = "import torch\n\n\ndef scaler():\n    return torch.amp.GradScaler(\"cuda\")\n"
    assert compatible(old, new).code == old
    # ...but a process group started where no `fabric` comes to tell the two apart: none
    assert compatible("import torch.distributed as dist\n\n\ndef setup():\n    dist.init_process_group('gloo')\n",
                      "import torch.distributed as dist\n\n\ndef setup():\n    pass\n") is None
    # ``device`` threaded into `fabric`: kept, `fabric` last and optional, the converted callers
    # passing ``fabric.device`` in its place
    old = "def train(model, device):\n    model.to(device)\n    fabric_free(model)\n"
    new = "def train(model, fabric):\n    fabric.print(model)\n"
    made = compatible(old, new)
    assert made.code == ("def train(model, device, fabric=None):\n    if fabric is not None:\n"
                         "        fabric.print(model)\n    else:\n        model.to(device)\n        fabric_free(model)\n")
    assert calls_by_keyword("train(net, fabric)\ntrain(net, fabric=fabric)\n", made.keyword_calls) == \
        "train(net, fabric.device, fabric=fabric)\ntrain(net, device=fabric.device, fabric=fabric)\n"
    # a parameter that changes otherwise
    assert compatible("def f(a, b):\n    return b\n", "def f(a, c):\n    return c\n") is None
    # another top-level statement changed
    assert compatible("X = 1\n\n\ndef f():\n    pass\n", "X = 2\n\n\ndef f():\n    pass\n") is None


# ---- codemod/analysis/libraries.py: well-known library APIs, as data ------------------------------------

def test_timm_s_optimizer_factory_and_loss_scaler_are_known_as_data():
    """fixtures/timm_scaler (DeiT's shape on timm): ``create_optimizer_v2(model, ...)`` is an
    optimizer over ``model``, set up with it; ``loss_scaler(loss, optimizer, ...)`` (timm's
    NativeScaler) is the training step, run by the library: left as it is under DDP, with the
    reason; FSDP and DeepSpeed, which need ``fabric.backward``, are refused; accumulation and
    clipping say which of its arguments does it."""
    result = run("timm_scaler", "bf16-mixed-devices-4")
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    assert "        loss_scaler(loss, optimizer, clip_grad=max_norm, parameters=model.parameters())\n" in result.output
    assert any(n.rule == "AR106" and "(timm.utils.NativeScaler) runs backward and the optimizer step itself"
               in n.message for n in result.skips)
    fsdp = run("timm_scaler", "fsdp")
    assert not fsdp.changed or "fabric.setup" not in fsdp.output
    assert any("--strategy fsdp needs `fabric.backward(loss)`" in n.message for n in fsdp.skips)
    accumulate = run("timm_scaler", "accumulate-4")
    assert any(n.rule == "AR302" and "its `need_update=` argument accumulates" in n.message for n in accumulate.skips)
    clip = run("timm_scaler", "clip-1.0")
    assert any(n.rule == "AR301" and "give it `clip_grad=` (1.0)" in n.message for n in clip.skips)


def test_every_library_entry_cites_the_release_it_was_read_from():
    from accelerate_rewrite.codemod.analysis import libraries

    tables = (libraries.LOSS_SCALERS, libraries.OPTIMIZER_FACTORIES, libraries.PARAM_GROUPS,
              libraries.SCHEDULER_FACTORIES)
    entries = [e for table in tables for e in table.values()]
    assert entries and all(any(c.isdigit() for c in e.source.split(",")[0]) for e in entries)
    assert all(name.split(".")[0] in libraries.LIBRARIES for table in tables for name in table)
    # (issue 47) what only reads a model: torch's and the standard library's
    assert all(any(c.isdigit() for c in source.split(",")[0]) for _, source in libraries.MODEL_READERS.values())
    # what takes the model, optimizer and loader over (Opacus's PrivacyEngine)
    assert all(any(c.isdigit() for c in e.read_in.split(",")[0]) for e in libraries.TAKES_OVER.values())
    assert all(name.split(".")[0] in libraries.LIBRARIES for name in libraries.TAKES_OVER)


def test_a_library_s_parameter_groups_are_over_the_model_it_is_given():
    """MAE's ``optim_factory.add_weight_decay(model_without_ddp, wd)`` (timm), then
    ``AdamW(param_groups, ...)``: the optimizer trains that model."""
    result = convert("""
        import torch
        import torch.nn as nn
        import timm.optim.optim_factory as optim_factory

        def main():
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = nn.Linear(4, 1).to(device)
            param_groups = optim_factory.add_weight_decay(model, 0.05)
            optimizer = torch.optim.AdamW(param_groups, lr=1e-3)
            for step in range(3):
                x, y = torch.randn(2, 4, device=device), torch.randn(2, 1, device=device)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()

        main()
    """)
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output


def test_a_module_name_another_file_defines_too_is_read_as_its_own():
    """SwAV's ``logger = getLogger()`` in main_swav.py and in src/utils.py: the module is still
    followed (its ``logger`` read under a name of its own by the analysis, and written back as
    ``logger``), so its ``init_distributed_mode`` is seen starting the process group."""
    import os
    import tempfile
    from pathlib import Path

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options

    root = Path(tempfile.mkdtemp())
    (root / "src").mkdir()
    (root / "src" / "__init__.py").write_text("")
    (root / "src" / "utils.py").write_text(
        "import os\nfrom logging import getLogger\n\nimport torch.distributed as dist\n\nlogger = getLogger()\n\n\n"
        "def init_distributed_mode(args):\n    args.rank = int(os.environ[\"RANK\"])\n"
        "    args.world_size = int(os.environ[\"WORLD_SIZE\"])\n"
        "    dist.init_process_group(backend=\"gloo\", world_size=args.world_size, rank=args.rank)\n"
        "    logger.info(\"started\")\n")
    script = root / "main.py"
    script.write_text(DINO_CHAIN.replace("    LATER\n", "").replace(
        "import torch\n", "import argparse\nfrom logging import getLogger\n\nimport torch\n", 1).replace(
        "def main(name):\n", "logger = getLogger()\n\n\ndef main(name):\n    args = argparse.Namespace()\n"
                            "    init_distributed_mode(args)\n").replace(
        "from torch.utils.data import DataLoader, TensorDataset\n",
        "from torch.utils.data import DataLoader, TensorDataset\n\nfrom src.utils import init_distributed_mode\n"))
    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "    init_distributed_mode(fabric, args)\n" in result.output
    utils = next(m for m in result.members if m.path.endswith(os.path.join("src", "utils.py")))
    assert "logger = getLogger()\n" in utils.output and "    logger.info(\"started\")\n" in utils.output
    assert "init_process_group" not in utils.output and "__src_utils" not in utils.output


def test_an_elif_chain_over_a_flag_s_every_choice_binds_on_every_path():
    """MoCo v3's optimizer: ``if args.optimizer == 'lars': ... elif args.optimizer == 'adamw':
    ...`` with no ``else``, where argparse allows only ``choices=['lars', 'adamw']``: some branch
    always runs, so the set-up after the chain converts (with a choice the chain misses, it is
    refused as before)."""
    source = """
        import argparse
        import torch
        import torch.nn as nn
        from torch.utils.data import DataLoader, TensorDataset

        parser = argparse.ArgumentParser()
        parser.add_argument('--optimizer', default='sgd', type=str, choices=CHOICES)

        def main():
            args = parser.parse_args()
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = nn.Linear(4, 1).to(device)
            if args.optimizer == 'sgd':
                optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            elif args.optimizer == 'adamw':
                optimizer = torch.optim.AdamW(model.parameters())

            loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
            for x, y in loader:
                x, y = x.to(device), y.to(device)
                loss = nn.functional.mse_loss(model(x), y)
                loss.backward()
                optimizer.step()

        main()
    """
    result = convert(source.replace("CHOICES", "['sgd', 'adamw']"))
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    result = convert(source.replace("CHOICES", "['sgd', 'adamw', 'lamb']"), allow_dropped=True)
    assert not result.changed and any("some path leaves it unbound" in d for d in result.dropped)


# ---- codemod/analysis/hints.py: every remaining refusal one line away -----------------------------------

HINTED = """
import torch
import torch.nn as nn

from somepackage import make_batches, make_optimizer


def main():
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(4, 1).to(device)
    optimizer = make_optimizer(model_config())OPTIMIZER_HINT
    batches = Stream()LOADER_HINT
    for x, y in batches:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def model_config():
    return {}


class Stream:
    def __iter__(self):
        return iter(make_batches())


main()
"""


def _hinted(optimizer: str = "", loader: str = "", **options):
    source = HINTED.replace("OPTIMIZER_HINT", optimizer).replace("LOADER_HINT", loader)
    return convert(source, allow_dropped=True, **options)


def test_an_optimizer_s_model_is_one_hint_away():
    """``make_optimizer(model_config())`` from a package: the analysis can't tell it trains
    ``model``; the refusal names the hint and the line, and with ``model=model`` there it is set up
    with the model."""
    refused = _hinted(loader="  # accelerate-rewrite: per-process")
    assert not refused.changed
    [why] = [n.message for n in refused.skips if n.rule == "AR101"]
    assert "no optimizer found" in why
    result = _hinted(optimizer="  # accelerate-rewrite: model=model", loader="  # accelerate-rewrite: per-process")
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    assert "fabric.backward(loss)" in result.output


def test_a_loader_is_one_hint_away_and_per_process_batches_too():
    """``batches = Stream()``, an object of the script's own class, iterated by the training loop:
    refused for several devices, naming both hints and the line; ``loader`` sets it up with
    Fabric (a TypeError at start-up if it is no DataLoader), ``per-process`` keeps its batches,
    moved."""
    hint = "  # accelerate-rewrite: model=model"
    refused = _hinted(optimizer=hint, devices=2)
    [why] = [n.message for n in refused.skips if n.rule == "AR101"]
    assert "add `# accelerate-rewrite: loader` at the end of line 11, where it is bound" in why
    assert "`# accelerate-rewrite: per-process`" in why
    loader = _hinted(optimizer=hint, loader="  # accelerate-rewrite: loader", devices=2)
    assert "    batches = fabric.setup_dataloaders(batches)\n" in loader.output
    assert any("`batches` is a DataLoader, as the hint on its line says" in n.message for n in loader.changes)
    own = _hinted(optimizer=hint, loader="  # accelerate-rewrite: per-process", devices=2)
    assert "setup_dataloaders" not in own.output and "x, y = x.to(fabric.device), y.to(fabric.device)" in own.output
    assert any("each process's own, as the hint on line 11 says" in n.message for n in own.skips)


# ---- loaders where research code keeps them -----------------------------------------------------

def test_loaders_that_are_attributes_of_a_project_object_run_as_before(tmp_path):
    """SAM's example (fixtures/projects/dataset_object): ``dataset = Cifar(...)`` builds its
    DataLoaders into ``self.train`` and ``self.test``; they are set up on the object, where the
    script has it (``dataset.train = fabric.setup_dataloaders(dataset.train)``), the test set
    for evaluation. At 32-true on one device the rewrite prints what the original prints."""
    import shutil
    import sys

    import pytest

    pytest.importorskip("lightning")
    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options
    from tests import processes
    from tests.goldens import PROJECTS

    original, rewritten = tmp_path / "original", tmp_path / "rewritten"
    for folder in (original, rewritten):
        shutil.copytree(PROJECTS / "dataset_object", folder, ignore=shutil.ignore_patterns("expected"))
    path = rewritten / "train.py"
    result = rewrite(path.read_text(), Options.create(accelerator="cpu"), path=str(path), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "    dataset.train = fabric.setup_dataloaders(dataset.train)\n" in result.output
    assert "dataset.test = fabric.setup_dataloaders(dataset.test, use_distributed_sampler=False)" in result.output
    path.write_text(result.output)
    runs = [processes.run([sys.executable, "train.py"], cwd=folder, timeout=300) for folder in (original, rewritten)]
    assert runs[0].returncode == runs[1].returncode == 0, runs[1].stderr[-2000:]
    assert "test accuracy" in runs[0].stdout and runs[1].stdout == runs[0].stdout


def test_parameter_groups_over_a_model_s_submodules_in_a_loop_train_the_model():
    """semseg's ``for module in modules_ori: params_list.append(dict(params=module.parameters(),
    lr=...))`` with ``modules_ori = [model.layer0, ...]``, built for one ``args.arch`` or another
    in an ``if``/``elif`` chain without ``else``: the optimizer trains ``model``, not the loop
    variable; and where no branch runs the script fails reading ``modules_ori`` right after the
    chain, so a set-up that reads ``model`` later converts."""
    result = convert("""
        import torch
        import torch.nn as nn

        def main(arch):
            device = "cuda" if torch.cuda.is_available() else "cpu"
            if arch == "a":
                model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 1))
                modules_ori = [model[0]]
                modules_new = [model[1]]
            elif arch == "b":
                model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 1))
                modules_ori = [model[0]]
                modules_new = [model[1]]
            params_list = []
            for module in modules_ori:
                params_list.append(dict(params=module.parameters(), lr=0.01))
            for module in modules_new:
                params_list.append(dict(params=module.parameters(), lr=0.1))
            optimizer = torch.optim.SGD(params_list, lr=0.01)
            model = model.to(device)
            for step in range(3):
                x = torch.randn(2, 4, device=device)
                loss = model(x).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()

        main("a")
    """)
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    assert "module, optimizer" not in result.output


def test_a_followed_module_s_code_the_program_never_reaches_does_not_count():
    """PyTorch-YOLOv3's train.py imports two helpers of test.py, a script of its own whose
    ``run()`` loads the model with the same factory: that ``run()`` is out of the analysis, so
    the factory is called once and Fabric is created in the script's ``run()``; and an ``else``
    that only says the optimizer is unknown is the script's own error path."""
    import tempfile
    from pathlib import Path

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options

    root = Path(tempfile.mkdtemp())
    (root / "models.py").write_text(
        "import torch\nimport torch.nn as nn\n\n\ndef load_model():\n"
        "    device = torch.device(\"cuda\" if torch.cuda.is_available() else \"cpu\")\n"
        "    model = nn.Linear(4, 1).to(device)\n    return model\n")
    (root / "evaluate.py").write_text(
        "import torch\n\nfrom models import load_model\n\n\ndef _evaluate(model, x):\n"
        "    with torch.no_grad():\n        return model(x)\n\n\ndef run():\n    model = load_model()\n"
        "    print(_evaluate(model, torch.zeros(1, 4)))\n\n\nif __name__ == \"__main__\":\n    run()\n")
    script = root / "train.py"
    script.write_text(
        "import torch\nimport torch.optim as optim\n\nfrom models import load_model\nfrom evaluate import _evaluate\n\n\n"
        "def run(name=\"adam\"):\n    device = torch.device(\"cuda\" if torch.cuda.is_available() else \"cpu\")\n"
        "    model = load_model()\n    if name == \"adam\":\n        optimizer = optim.Adam(model.parameters())\n"
        "    elif name == \"sgd\":\n        optimizer = optim.SGD(model.parameters(), lr=0.1)\n    else:\n"
        "        print(\"Unknown optimizer. Please choose between (adam, sgd).\")\n"
        "    for step in range(3):\n        x = torch.randn(2, 4).to(device)\n        loss = model(x).pow(2).mean()\n"
        "        loss.backward()\n        optimizer.step()\n    print(_evaluate(model, x))\n\n\n"
        "if __name__ == \"__main__\":\n    run()\n")
    result = rewrite(script.read_text(), Options.create(), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "def run(name=\"adam\"):\n    fabric = Fabric(devices=1)\n" in result.output
    assert "        fabric.print(\"Unknown optimizer. Please choose between (adam, sgd).\")\n" \
           "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output


def test_a_trainer_package_s_trainer_receives_fabric_despite_its_static_methods(tmp_path):
    """minGPT's shape: the Trainer (its ``run()`` builds the optimizer and trains) lives in a
    module of its own, the script makes it in its main block (Fabric a global there) and reads
    its ``@staticmethod get_default_config()`` as ``Trainer.get_default_config()``: reading a
    static method makes no object, so the Trainer receives `fabric` and keeps it in
    ``self.fabric``."""
    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options

    source = (FIXTURES / "trainer_run" / "input.py").read_text()
    start, end = source.index("class Trainer:"), source.index("def batch_end_callback")
    (tmp_path / "trainer.py").write_text("from collections import defaultdict\n\nimport torch\n"
                                         "from torch.utils.data import DataLoader\n\n\n" + source[start:end].rstrip() + "\n")
    script = tmp_path / "train.py"
    script.write_text(source[:start].replace('"""Style:', "from trainer import Trainer\n\"\"\"Style:", 1)
                      + source[end:])
    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    trainer = next(m for m in result.members if m.path.endswith("trainer.py"))
    assert "self.fabric.backward(self.loss)" in trainer.output
    assert "Trainer(fabric, train_config, TinyLM(), SortDataset())" in result.output


def test_a_backward_in_a_closure_reaches_fabric_through_the_function_around_it():
    """MSN's ``def train_step(): ... loss.backward()`` inside ``main(args)``, run through a
    timer (``gpu_timer(train_step)``), with Fabric created by the caller: ``run`` receives
    `fabric`, which the closure reads."""
    result = convert("""
        import torch
        import torch.nn as nn

        def timer(closure):
            return closure()

        def run(model, optimizer, steps):
            for step in range(steps):
                x = torch.randn(2, 4)

                def train_step():
                    optimizer.zero_grad()
                    loss = model(x).pow(2).mean()
                    loss.backward()
                    optimizer.step()
                    return float(loss)

                timer(train_step)

        def main():
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model = nn.Linear(4, 1).to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            run(model, optimizer, 3)

        if __name__ == "__main__":
            main()
    """)
    assert "def run(fabric, model, optimizer, steps):" in result.output
    assert "            fabric.backward(loss)\n" in result.output
    assert "    run(fabric, model, optimizer, 3)\n" in result.output


TIMM_DDP = """
import argparse
import os

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as NativeDDP
from timm.data import create_loader

parser = argparse.ArgumentParser()
parser.add_argument("--no-ddp-bb", action="store_true", default=False)


def main():
    args = parser.parse_args()
    args.distributed = False
    if "WORLD_SIZE" in os.environ:
        args.distributed = int(os.environ["WORLD_SIZE"]) > 1
    args.local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if args.distributed:
        torch.cuda.set_device(args.local_rank)
        torch.distributed.init_process_group(backend="nccl", init_method="env://")
    model = nn.Linear(4, 1)
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if args.distributed:
        model = NativeDDP(model, device_ids=[args.local_rank], broadcast_buffers=not args.no_ddp_bb)
    loader_train = create_loader(DATASET, input_size=(4,), batch_size=2, is_training=True,
                                 distributed=args.distributed)
    for x, y in loader_train:
        x, y = x.cuda(), y.cuda()
        loss = nn.functional.mse_loss(model(x), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main()
""".replace("DATASET", "None")


def test_a_copy_of_timm_s_train_py_converts_with_its_ddp_options_and_timm_s_loader():
    """poolformer's train.py (a copy of timm's): DistributedDataParallel's option reads a flag
    (``broadcast_buffers=not args.no_ddp_bb``), carried to ``DDPStrategy`` since ``args`` is
    bound where Fabric is created; timm's ``create_loader(..., distributed=...)`` shards by the
    process's rank itself (known as data): not set up, its batches moved to ``fabric.device``."""
    result = convert(TIMM_DDP, devices=2)
    assert "fabric = Fabric(devices=2, strategy=DDPStrategy(broadcast_buffers=not args.no_ddp_bb))" in result.output
    assert "setup_dataloaders" not in result.output
    assert "        x, y = x.to(fabric.device), y.to(fabric.device)\n" in result.output
    assert any("built by `timm.data.create_loader`, which shards the data by the process's rank itself" in n.message
               for n in result.skips)


def test_timm_s_loader_told_by_a_dict_beside_another_that_changes_is_each_process_s_own():
    """timm's train.py (1.0.29): one branch builds the loader with ``create_naflex_loader(...,
    **patch_loader_kwargs, **common_loader_kwargs)``, the other ``create_loader(...,
    **common_loader_kwargs)``; ``patch_loader_kwargs`` is filled in place, but
    ``common_loader_kwargs`` holds ``distributed=``: every binding is told the run is
    distributed, and the loader is not set up. (A rewrite of the check through every ``**`` of
    the call, which gives up where one dict changes, lost timm's train.py on the corpus.)"""
    source = TIMM_DDP.replace("from timm.data import create_loader\n",
                              "from timm.data import create_loader, create_naflex_loader\n").replace(
        """    loader_train = create_loader(DATASET, input_size=(4,), batch_size=2, is_training=True,
                                 distributed=args.distributed)
""".replace("DATASET", "None"), """    common_loader_kwargs = dict(batch_size=2, distributed=args.distributed)
    if args.no_ddp_bb:
        patch_loader_kwargs = {}
        patch_loader_kwargs["patch_size"] = 4
        loader_train = create_naflex_loader(None, **patch_loader_kwargs, **common_loader_kwargs)
    else:
        loader_train = create_loader(None, input_size=(4,), is_training=True, **common_loader_kwargs)
""")
    assert "common_loader_kwargs" in source
    result = convert(source, devices=2)
    assert "fabric = Fabric(devices=2" in result.output and "setup_dataloaders" not in result.output
    assert not any("can't show to be a DataLoader" in n.message for n in result.skips)


def test_a_library_that_starts_the_process_group_itself_becomes_the_values_it_sets():
    """timm's own train.py: ``device = utils.init_distributed_device(args)`` starts the process
    group itself, which under Fabric's processes would start it a second time and fail (issue
    60): it becomes the values it sets, read from Fabric (tests/test_never_seen.py has more)."""
    source = TIMM_DDP.replace("from timm.data import create_loader\n",
                              "from timm.data import create_loader\nfrom timm import utils\n").replace(
        "    model = nn.Linear(4, 1)\n", "    device = utils.init_distributed_device(args)\n    model = nn.Linear(4, 1)\n")
    result = convert(source, devices=2)
    assert "init_distributed_device" not in result.output
    assert "    args.world_size = fabric.world_size\n" in result.output



def test_a_script_made_private_by_opacus_is_refused_with_the_reason():
    """pytorch/opacus's examples: ``privacy_engine.make_private(module=model, optimizer=...,
    data_loader=...)`` wraps all three for differential privacy. Over Fabric's set-up (its
    module not a DistributedDataParallel to Opacus) each process would add its own noise and
    step its own copy of the model, and the accounting would be one process's: refused, for
    Fabric and Accelerate alike; native autocast (another rule) is not this refusal's."""
    source = """
        import torch
        import torch.nn as nn
        from opacus import PrivacyEngine
        from torch.utils.data import DataLoader, TensorDataset

        model = nn.Linear(4, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = DataLoader(TensorDataset(torch.randn(32, 4), torch.randint(0, 2, (32,))), batch_size=8)
        privacy_engine = PrivacyEngine()
        model, optimizer, loader = privacy_engine.make_private(
            module=model, optimizer=optimizer, data_loader=loader, noise_multiplier=1.0, max_grad_norm=1.0)
        for x, y in loader:
            optimizer.zero_grad()
            nn.functional.cross_entropy(model(x), y).backward()
            optimizer.step()
    """
    for backend in ("fabric", "accelerate"):
        result = convert(source, devices=2, backend=backend)
        assert not result.changed, backend
        assert any("(opacus.PrivacyEngine) makes the model, optimizer and loader private itself" in n.message
                   and n.line == 9 for n in result.skips), [n.message for n in result.skips]

def test_a_batch_sampler_over_a_distributed_sampler_keeps_its_own_batches():
    """DETR's ``BatchSampler(sampler_train, batch_size, drop_last=True)`` with ``sampler_train``
    a DistributedSampler when distributed: each process draws its own batches already, so the
    loader is not set up (Fabric's sampler would take the BatchSampler's place) and its batches
    move to ``fabric.device``."""
    result = convert(TIMM_DDP.replace("from timm.data import create_loader\n", "").replace(
        """    loader_train = create_loader(None, input_size=(4,), batch_size=2, is_training=True,
                                 distributed=args.distributed)
""", """    dataset = torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1))
    if args.distributed:
        sampler_train = torch.utils.data.DistributedSampler(dataset)
    else:
        sampler_train = torch.utils.data.RandomSampler(dataset)
    batch_sampler_train = torch.utils.data.BatchSampler(sampler_train, 2, drop_last=True)
    loader_train = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler_train)
"""), devices=2)
    assert "setup_dataloaders(loader_train" not in result.output
    assert "        x, y = x.to(fabric.device), y.to(fabric.device)\n" in result.output
    assert any("keeps its own `batch_sampler=`, over `sampler_train`" in n.message for n in result.skips)


SWIN_MAIN = """
import torch
import torch.nn as nn

from config import get_config


def main(config):
    model = nn.Linear(4, 1)
    model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[config.LOCAL_RANK])
    for _ in range(3):
        x = torch.randn(8, 4).cuda()
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    config = get_config()
    torch.cuda.set_device(config.LOCAL_RANK)
    torch.distributed.init_process_group(backend="nccl", init_method="env://")
    main(config)
"""


def test_a_launcher_variable_read_before_fabric_exists_is_kept_when_a_missing_one_fails_loudly(tmp_path):
    """Swin's config.py: ``config.LOCAL_RANK = int(os.environ['LOCAL_RANK'])`` in another
    module, two calls below the one the driver makes before the process group starts, where
    `fabric` can't be reached. With no default it is never silently wrong
    (torchrun sets it for every process; where it is not set, a KeyError at start-up): kept, and
    said. With a default (``.get("LOCAL_RANK", 0)``) it could be silently wrong: refused as
    before."""
    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options

    script = tmp_path / "main.py"
    script.write_text(SWIN_MAIN)
    for read, converts in (('int(os.environ["LOCAL_RANK"])', True), ('int(os.environ.get("LOCAL_RANK", 0))', False)):
        (tmp_path / "config.py").write_text(
            f"import argparse\nimport os\n\n\ndef update_config(config):\n    config.LOCAL_RANK = {read}\n\n\n"
            "def get_config():\n    config = argparse.Namespace(AMP_ENABLE=True)\n    update_config(config)\n"
            "    return config\n")
        result = rewrite(SWIN_MAIN, Options.create(devices=2), path=str(script), scope=Scope(follow=True))
        if converts:
            assert "fabric = Fabric(devices=2)" in result.output and "init_process_group" not in result.output
            assert "fabric.backward(loss)" in result.output
            assert not any("fabric" in m.output for m in result.members)
            assert any("kept: `fabric` can't be reached here; it reads the launcher's environment, which torchrun "
                       "sets" in n.message for n in [*result.skips, *(s for m in result.members for s in m.skips)])
        else:
            assert "Fabric(" not in result.output
            said = [n.message for n in [*result.skips, *(s for m in result.members for s in m.skips)]]
            assert any("can't become `fabric.local_rank`" in n for n in said), said


def test_a_wrap_whose_options_depend_on_a_flag_carries_them_on_the_flag():
    """iBOT's ``model = DDP(model, ..., broadcast_buffers=False) if 'swin' in args.arch else
    DDP(model, ...)``: one wrap, its options taken on the condition (DDP's default on the side
    that does not set one); two models wrapped with different options are refused, since
    Fabric's strategy gives every model the same."""
    wrap = ("        model = NativeDDP(model, device_ids=[args.local_rank], broadcast_buffers=False) if \\\n"
            "            'swin' in args.arch else NativeDDP(model, device_ids=[args.local_rank])\n")
    source = TIMM_DDP.replace('parser.add_argument("--no-ddp-bb"', 'parser.add_argument("--arch", default="vit")\n'
                              'parser.add_argument("--no-ddp-bb"').replace(
        "        model = NativeDDP(model, device_ids=[args.local_rank], broadcast_buffers=not args.no_ddp_bb)\n", wrap)
    result = convert(source, devices=2)
    assert ("fabric = Fabric(devices=2, strategy=DDPStrategy(broadcast_buffers=False if 'swin' in args.arch "
            "else True))") in result.output
    assert "NativeDDP(model" not in result.output
    two = TIMM_DDP.replace("    model = nn.Linear(4, 1)\n", "    model = nn.Linear(4, 1)\n    head = nn.Linear(1, 1)\n"
                           ).replace("broadcast_buffers=not args.no_ddp_bb)\n", "broadcast_buffers=not args.no_ddp_bb)\n"
                                     "        head = NativeDDP(head, device_ids=[args.local_rank])\n")
    refused = convert(two, devices=2)
    assert "Fabric(" not in refused.output
    assert any("two models are wrapped with different options" in n.message for n in refused.skips), refused.skips


TRAIN_LOOP = """
import torch
import torch.nn as nn
from torch.optim import AdamW

from helpers import master_params_of


class TrainLoop:
    def __init__(self, model, data):
        self.model = model
        self.data = data
        self.master_params = master_params_of(self.model)
        self.opt = AdamW(self.master_params, lr=0.1)HINT

    def run(self):
        for x, y in self.data:
            x, y = x.to(self.device), y.to(self.device)
            loss = nn.functional.mse_loss(self.model(x), y)
            self.opt.zero_grad()
            loss.backward()
            self.opt.step()


def main():
    device = torch.device("cuda")
    data = [(torch.randn(8, 4), torch.randn(8, 1)) for _ in range(3)]
    loop = TrainLoop(nn.Linear(4, 1).to(device), data)
    loop.device = device
    loop.run()


if __name__ == "__main__":
    main()
"""


def test_a_hint_names_a_model_held_in_an_attribute():
    """improved-diffusion's ``self.opt = AdamW(self.master_params, ...)``: the optimizer's
    parameters come through an attribute the analysis can't follow; ``model=self.model`` on its
    line names the model (an attribute of the class whose method builds the optimizer)."""
    refused = convert(TRAIN_LOOP.replace("HINT", ""), allow_dropped=True)
    assert any("add `# accelerate-rewrite: model=NAME` at the end of line 13" in n.message for n in refused.skips)
    result = convert(TRAIN_LOOP.replace("HINT", "  # accelerate-rewrite: model=self.model"), allow_dropped=True)
    assert "self.model, self.opt = fabric.setup(self.model, self.opt)" in result.output, result.output


def test_processes_that_mpi_starts_are_refused_with_the_reason():
    """improved-diffusion's dist_util.py ranks its processes with mpi4py (``MPI.COMM_WORLD``) and
    shards its data by that rank: under Fabric's launcher each process is MPI's rank 0 of 1, so
    every one would read the same shard. Refused, with the reason; no hint lifts it."""
    source = TIMM_DDP.replace("from timm.data import create_loader\n",
                              "from timm.data import create_loader\nfrom mpi4py import MPI\n").replace(
        "    args.distributed = False\n", "    args.distributed = False\n    shard = MPI.COMM_WORLD.Get_rank()\n")
    result = convert(source, devices=2, allow_dropped=True)
    assert "Fabric(" not in result.output
    assert any("processes that MPI starts and ranks (mpi4py" in n.message for n in result.skips)


def test_a_model_built_in_a_method_that_only_init_calls_is_built_in_making_the_object():
    """StarGAN's Solver: ``__init__`` ends with ``self.build_model()``, which builds the model and
    its optimizer (fixtures/solver_class). That is part of making the object, made once: the
    Solver receives `fabric`, keeps it in ``self.fabric``, and ``build_model`` sets up with it.
    Called from anywhere else too, it is refused as before."""
    result = run("solver_class", "bf16-mixed-devices-4")
    out = result.output
    assert "    def __init__(self, fabric, loader, config):\n        self.fabric = fabric\n" in out
    assert "        self.net, self.optimizer = self.fabric.setup(self.net, self.optimizer)\n" in out
    assert "    solver = Solver(fabric, loader, config)\n" in out
    source = (FIXTURES / "solver_class" / "input.py").read_text()
    again = source.replace("    def update_lr(self, lr):\n", "    def reset(self):\n        self.build_model()\n\n"
                           "    def update_lr(self, lr):\n")
    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.options import Options

    twice = rewrite(again, Options.create(precision="bf16-mixed", devices=4), path="train.py")
    assert not twice.changed
    assert any("is built inside a class (Solver.build_model), not in its __init__" in n.message
               for n in twice.notes), [n.message for n in twice.notes]
