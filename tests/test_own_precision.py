"""Issue 59: the precision asked for is the precision the script computes in, research code
included (AR213, own-mixed-precision), and no rule applies without the change it stands on
(``Rule.premises``: AR209 stands on an autocast)."""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import sys
from pathlib import Path

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options

FIXTURE = Path(__file__).resolve().parent.parent / "fixtures" / "projects" / "research_amp"
BACKENDS = ("fabric", "torch", "accelerate")


def _notes(result, code):
    return [n.message for n in result.notes if n.rule == code]


def _script(body: str) -> str:
    return ("import torch\nimport torch.nn as nn\n\n"
            "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n"
            "model = nn.Linear(4, 2).to(device)\n"
            "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n" + body)


_LOOP = ("for x, y in [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]:\n"
         "    x, y = x.to(device), y.to(device)\n"
         "{inner}"
         "    optimizer.zero_grad()\n"
         "    scaler.scale(loss).backward()\n"
         "    scaler.step(optimizer)\n"
         "    scaler.update()\n")


def _amp_script(autocast: str, scaler: str = "scaler = torch.cuda.amp.GradScaler()\n") -> str:
    inner = f"    with {autocast}:\n        loss = nn.functional.cross_entropy(model(x), y)\n"
    return _script(scaler + _LOOP.format(inner=inner))


# ---- the forms of the script's own autocast ------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_every_backend_sets_the_script_s_own_autocast_to_bf16_and_turns_its_scaler_off(backend):
    source = _amp_script("torch.cuda.amp.autocast(enabled=True)")
    result = rewrite(source, Options.create(precision="bf16-mixed", backend=backend))
    assert "torch.cuda.amp" not in result.output and "torch.float16" not in result.output
    assert "dtype=torch.bfloat16, enabled=True)" in result.output
    assert 'scaler = torch.amp.GradScaler("cuda", enabled=False)' in result.output
    ref = {"fabric": "fabric.device.type", "accelerate": "accelerator.device.type", "torch": "device.type"}[backend]
    assert f"torch.autocast({ref}, dtype=torch.bfloat16" in result.output
    assert "Fabric(precision" not in result.output and "mixed_precision" not in result.output  # never both
    assert len(_notes(result, "AR213")) == 2
    again = rewrite(result.output, Options.create(precision="bf16-mixed", backend=backend))
    assert again.output == result.output


@pytest.mark.parametrize("autocast,expected", [
    ('torch.autocast("cuda", dtype=torch.float16)', "torch.autocast(device.type, dtype=torch.bfloat16)"),
    ('torch.amp.autocast(device_type="cuda")', "torch.amp.autocast(device_type=device.type, dtype=torch.bfloat16)"),
    ("torch.autocast(device.type, dtype=torch.bfloat16)", None),  # as asked already: left
])
def test_autocast_spellings_compute_in_bf16_on_the_run_s_device(autocast, expected):
    result = rewrite(_amp_script(autocast), Options.create(precision="bf16-mixed", backend="torch"))
    if expected is None:
        assert f"with {autocast}:" in result.output
    else:
        assert f"with {expected}:" in result.output, result.output


def test_an_autocast_kept_in_a_name_or_bound_by_partial_is_set_too():
    source = _script(
        "import functools\nfrom contextlib import suppress\nuse_amp = True\n"
        "scaler = torch.cuda.amp.GradScaler(enabled=use_amp)\n"
        "amp_autocast = torch.cuda.amp.autocast if use_amp else suppress\n"
        "eval_autocast = functools.partial(torch.autocast, device_type='cuda', dtype=torch.float16)\n"
        + _LOOP.format(inner="    with amp_autocast():\n        loss = nn.functional.cross_entropy(model(x), y)\n"))
    result = rewrite(source, Options.create(precision="bf16-mixed", backend="torch"))
    assert "amp_autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16) if use_amp " \
           "else suppress" in result.output
    assert "functools.partial(torch.autocast, device_type=device.type, dtype=torch.bfloat16)" in result.output
    assert 'torch.amp.GradScaler("cuda", enabled=False)' in result.output
    assert not [n for n in result.notes if n.rule == "AR201" and n.skipped], result.notes  # AR213's, not "by hand"


def test_an_autocast_switched_off_stays_and_kwargs_leave_everything_alone():
    off = rewrite(_amp_script("torch.cuda.amp.autocast(enabled=True)").replace(
        "        loss = nn", "        with torch.autocast('cuda', enabled=False):\n            pass\n        loss = nn"),
        Options.create(precision="bf16-mixed", backend="torch"))
    assert "with torch.autocast('cuda', enabled=False):" in off.output
    starred = rewrite(_amp_script("torch.cuda.amp.autocast(**amp_args)").replace("scaler =", "amp_args = {}\nscaler ="),
                      Options.create(precision="bf16-mixed", backend="torch"))
    assert "torch.cuda.amp.GradScaler()" in starred.output or "torch.amp.GradScaler(\"cuda\")" in starred.output
    assert any("*args/**kwargs" in m for m in _notes(starred, "AR213"))


def test_16_mixed_over_an_fp16_autocast_changes_nothing_and_32_true_says_it_stays():
    source = _amp_script("torch.cuda.amp.autocast()")
    fp16 = rewrite(source, Options.create(precision="16-mixed", backend="torch"))
    assert "computes in float16 already" in " ".join(_notes(fp16, "AR213"))
    assert "enabled=False" not in fp16.output
    fp32 = rewrite(source, Options.create(precision="32-true", backend="torch"))
    assert "stays: --precision 32-true" in " ".join(_notes(fp32, "AR213"))


def test_a_library_loss_scaler_keeps_its_scaler_and_says_so():
    source = (FIXTURE.parent.parent / "timm_scaler" / "input.py").read_text()
    result = rewrite(source, Options.create(precision="bf16-mixed"))
    said = " ".join(_notes(result, "AR213"))
    assert "NativeScaler" in said and "same power of two" in said, said


def test_no_device_in_reach_leaves_the_script_s_mixed_precision_whole(tmp_path):
    """A helper enters autocast around a tensor it is given, in a module of the project with no
    device, no model and no `fabric` in reach: no autocast changes, and no scaler is turned off under one
    left in fp16."""
    from accelerate_rewrite.codemod.project.program import Scope

    (tmp_path / "models.py").write_text(
        "import torch\n\n\ndef mixed(x):\n    with torch.cuda.amp.autocast():\n        return torch.tanh(x) * 2\n")
    source = _amp_script("torch.cuda.amp.autocast()").replace("import torch.nn as nn\n", "import torch.nn as nn\n"
                                                              "from models import mixed\n")
    source = source.replace("    with torch.cuda.amp.autocast():\n        loss = nn.functional.cross_entropy(model(x), y)",
                            "    loss = nn.functional.cross_entropy(mixed(model(x)), y)")
    path = tmp_path / "train.py"
    path.write_text(source)
    scope = Scope(auto=True, root=str(tmp_path), script=str(path),
                  known=frozenset(str(tmp_path / f) for f in ("train.py", "models.py")))
    result = rewrite(source, Options.create(precision="bf16-mixed"), path=str(path), scope=scope)
    models = next(m for m in result.members if m.path.endswith("models.py"))
    assert "fabric.setup" in result.output  # the conversion itself went through
    assert "enabled=False" not in result.output and "bfloat16" not in models.output + result.output
    assert any("can't tell which device" in m for m in _notes(result, "AR213") + _notes(models, "AR213"))


# ---- premises: a rule's change stands on another's --------------------------------------------------

_HALF = ("import torch\nimport torch.nn as nn\n\n"
         "model = nn.Linear(4, 2).cuda().half()\n"
         "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
         "for x, y in [(torch.randn(8, 4), torch.randint(0, 2, (8,)))]:\n"
         "    x = x.cuda().half()\n"
         "{inner}"
         "    loss = nn.functional.cross_entropy(model(x).float(), y.cuda())\n"
         "    optimizer.zero_grad()\n"
         "    loss.backward()\n"
         "    optimizer.step()\n")


@pytest.mark.parametrize("backend,provider", [("fabric", "AR101"), ("accelerate", "AR101"), ("torch", "AR207")])
def test_half_casts_go_where_an_autocast_takes_over(backend, provider):
    result = rewrite(_HALF.format(inner=""), Options.create(precision="bf16-mixed", backend=backend))
    assert ".half()" not in result.output, result.output
    assert _notes(result, "AR209") and _notes(result, provider)
    assert not [d for d in result.dropped if d.startswith("AR209")]


def test_half_casts_stay_where_the_conversion_was_refused_and_no_autocast_takes_over():
    """The Fabric conversion refused (a process group started by a backend layer of the script's
    own): AR209 is dropped with the reason, the `.half()` casts stay (issue 59's dalle case)."""
    refused = _HALF.format(inner="").replace(
        "optimizer = torch", "import torch.distributed as dist\ndist.init_process_group('gloo')\noptimizer = torch")
    result = rewrite(refused, Options.create(precision="bf16-mixed"))
    assert "model = nn.Linear(4, 2).cuda().half()" in result.output
    assert "x = x.cuda().half()" in result.output
    dropped = [d for d in result.dropped if d.startswith("AR209")]
    assert dropped and "stands on an autocast" in dropped[0], result.dropped


def test_half_casts_go_where_the_script_s_own_autocast_takes_over_and_stay_where_it_can_t():
    own = _HALF.format(inner="    with torch.cuda.amp.autocast():\n        pass\n").replace(
        "import torch.nn as nn\n", "import torch.nn as nn\nimport torch.distributed as dist\n"
                                   "dist.init_process_group('gloo')\n")
    result = rewrite(own, Options.create(precision="bf16-mixed"))  # Fabric refused, AR213 sets the autocast
    assert "bfloat16" in result.output and ".half()" not in result.output, result.output


def test_a_dropped_provider_takes_the_rules_that_stand_on_it():
    from accelerate_rewrite.codemod.engine import _dependents
    from accelerate_rewrite.codemod.rule import RuleContext
    from accelerate_rewrite.rules import BY_CODE
    from accelerate_rewrite.rules.base.half import MIXED_GROUND

    rules = [BY_CODE["AR101"], BY_CODE["AR207"], BY_CODE["AR209"]]
    options = Options.create(precision="bf16-mixed")
    contexts = {}
    for rule in rules:
        ctx = RuleContext(rule, None, options)
        ctx.edits.add_import("torch")  # a change of its own
        contexts[rule.code] = ctx
    contexts["AR101"].provide(MIXED_GROUND)
    assert "AR209" in _dependents("AR101", rules, options, contexts)
    contexts["AR207"].provide(MIXED_GROUND)  # another rule still gives it
    assert "AR209" not in _dependents("AR101", rules, options, contexts)


# ---- the research shape, run: fixtures/projects/research_amp ----------------------------------------

_RECORD = '''import atexit, json, os
import torch
seen = []
def _hook(module, args):
    if torch.is_grad_enabled() and module.training:
        entry = [torch.is_autocast_enabled("cpu"), str(torch.get_autocast_dtype("cpu"))]
        if entry not in seen:
            seen.append(entry)
torch.nn.modules.module.register_module_forward_pre_hook(_hook)
atexit.register(lambda: json.dump(seen, open(os.environ["FORWARD_RECORD"], "w")))
'''


def _trees(tmp_path, options):
    from tests.goldens import project_trees

    return project_trees(tmp_path, "research_amp", options, ("train.py", "engine.py", "utils.py"))[:2]


def _run(folder, tmp_path, *args):
    from tests import processes

    hooks = tmp_path / "hooks"
    hooks.mkdir(exist_ok=True)
    (hooks / "sitecustomize.py").write_text(_RECORD)
    record = tmp_path / f"forward-{len(list(tmp_path.glob('forward-*')))}.json"
    env = {**os.environ, "PYTHONPATH": str(hooks), "FORWARD_RECORD": str(record), "CUDA_VISIBLE_DEVICES": "",
           "ACCELERATE_USE_CPU": "1", "OMP_NUM_THREADS": "1"}
    done = processes.run([sys.executable, "train.py", *args], cwd=folder, env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    return done, json.loads(record.read_text())


@pytest.fixture(scope="module")
def original_checkpoint(tmp_path_factory):
    """The original research_amp run once with `--amp` on the CPU: its checkpoint, and what its
    training forwards computed in."""
    pytest.importorskip("torch")
    tmp = tmp_path_factory.mktemp("original")
    folder = tmp / "original"
    shutil.copytree(FIXTURE, folder, ignore=shutil.ignore_patterns("expected"))
    _, seen = _run(folder, tmp, "--amp", "--epochs", "1")
    return folder / "output" / "checkpoint.pth", seen


@pytest.mark.runs
@pytest.mark.parametrize("backend", BACKENDS)
def test_the_research_shape_computes_in_bf16_with_each_backend_and_keeps_its_checkpoints(tmp_path, backend,
                                                                                           original_checkpoint):
    """fp16 autocast in engine.py behind `--amp`, the GradScaler in utils.py's loss-scaler class,
    the evaluation's autocast kept in a name; rewritten with --precision bf16-mixed and run on the
    CPU: every training forward runs under bfloat16 autocast (read inside it), the losses are
    finite, and the checkpoints load both ways (the original's into the rewrite, and its own)."""
    pytest.importorskip("torch")
    if backend == "fabric":
        pytest.importorskip("lightning")
    if backend == "accelerate":
        pytest.importorskip("accelerate")
    _, rewritten = _trees(tmp_path, Options.create(precision="bf16-mixed", backend=backend))
    text = "".join((rewritten / f).read_text() for f in ("train.py", "engine.py", "utils.py"))
    assert "float16" not in text.replace("bfloat16", "") and "torch.cuda.amp" not in text
    assert text.count("dtype=torch.bfloat16") == 2 and "enabled=False" in text

    checkpoint, before = original_checkpoint
    assert before == [[False, "torch.bfloat16"]]  # torch.cuda.amp.autocast switches itself off on a CPU
    done, seen = _run(rewritten, tmp_path, "--amp", "--epochs", "2", "--resume", str(checkpoint))
    assert seen == [[True, "torch.bfloat16"]], seen
    losses = [float(x) for x in re.findall(r"step \d+ loss (\S+)", done.stdout)]
    assert len(losses) == 16 and all(math.isfinite(x) for x in losses)
    assert "epoch 0" not in done.stdout  # resumed after the original's epoch 0
    done, seen = _run(rewritten, tmp_path, "--amp", "--epochs", "3", "--resume", "output/checkpoint.pth")
    assert seen == [[True, "torch.bfloat16"]] and "epoch 2 accuracy" in done.stdout
    if backend == "fabric":
        _, off = _run(rewritten, tmp_path, "--epochs", "1")  # the script's own flag still decides
        assert off == [[False, "torch.bfloat16"]]


@pytest.mark.runs
def test_verify_names_the_precision_the_research_shape_computed_in(tmp_path):
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    from accelerate_rewrite.verify.session import verify

    shutil.copytree(FIXTURE, tmp_path / "p", ignore=shutil.ignore_patterns("expected"))
    old = os.getcwd()
    os.chdir(tmp_path / "p")
    try:
        v = verify(tmp_path / "p" / "train.py", Options.create(precision="bf16-mixed"),
                   script_args=["--amp", "--epochs", "1"], steps=6, run_on="cpu", threads=1)
    finally:
        os.chdir(old)
    assert v.verdict.verdict == "pass", v.verdict.reason
    assert v.verdict.reason.startswith("structure: exact at 32-true")  # AR213's precision switched off: exact
    assert v.rewritten.precision == "bf16-mixed" and v.original.precision == "32-true"
    assert v.rewritten.computed_in == "bfloat16 (cpu autocast)"


def test_a_compatible_change_makes_the_changes_without_fabric_in_definitions_no_other_file_reads():
    """research_engine's utils.py changes compatibly (eval.py imports it): its loss-scaler class,
    which only train.py uses, gets AR213's scaler turned off in the first run, as a second run
    would make it (idempotence); `init_distributed_mode`, which eval.py reads, keeps its old code."""
    from accelerate_rewrite.codemod.project.compat import compatible

    old = ("import torch\n\n\ndef shared():\n    return torch.cuda.amp.GradScaler()\n\n\n"
           "class Mine:\n    def __init__(self):\n        self.s = torch.cuda.amp.GradScaler()\n")
    new = old.replace("torch.cuda.amp.GradScaler()", 'torch.amp.GradScaler("cuda", enabled=False)')
    kept = compatible(old, new)
    assert kept is not None and kept.code == old
    made = compatible(old, new, free=frozenset({"Mine"}))
    assert made.code == old.replace("        self.s = torch.cuda.amp.GradScaler()",
                                    '        self.s = torch.amp.GradScaler("cuda", enabled=False)')


def test_the_device_of_a_trainer_class_is_read_from_its_own_attribute_and_never_from_a_later_tensor():
    """SimCLR's trainer moves its batches with `.to(self.args.device)`; iBOT's loop moves labels
    to `pred1.device`, a tensor computed after the autocast: the device type is read from what
    is bound where the autocast stands."""
    trainer = ("import torch\nimport torch.nn as nn\n\n\nclass Trainer:\n"
               "    def __init__(self, args, model, optimizer):\n"
               "        self.args, self.model, self.optimizer = args, model, optimizer\n"
               "        self.scaler = torch.cuda.amp.GradScaler(enabled=args.fp16)\n\n"
               "    def train(self, loader):\n        for x, y in loader:\n"
               "            x, y = x.to(self.args.device), y.to(self.args.device)\n"
               "            with torch.cuda.amp.autocast(enabled=self.args.fp16):\n"
               "                loss = nn.functional.cross_entropy(self.model(x), y)\n"
               "            self.optimizer.zero_grad()\n            self.scaler.scale(loss).backward()\n"
               "            self.scaler.step(self.optimizer)\n            self.scaler.update()\n")
    result = rewrite(trainer, Options.create(precision="bf16-mixed", backend="torch"))
    assert "torch.autocast(torch.device(self.args.device).type, dtype=torch.bfloat16, enabled=self.args.fp16)" \
        in result.output, result.output
    later = _amp_script("torch.cuda.amp.autocast()").replace(
        "device = torch.device('cuda' if torch.cuda.is_available() else 'cpu')\n", "").replace(
        ".to(device)", ".cuda()").replace("x, y = x.to(device), y.to(device)", "x, y = x.cuda(), y.cuda()") + \
        "    pred = model(x)\n    y = y.to(pred.device)\n"
    result = rewrite(later, Options.create(precision="bf16-mixed", backend="torch"))
    assert 'torch.autocast("cuda", dtype=torch.bfloat16)' in result.output, result.output
    assert not result.dropped
    # a script that needs CUDA anyway keeps "cuda", and a second run changes nothing (poolformer's
    # `amp_autocast = torch.cuda.amp.autocast` became a partial with "cuda" in it)
    named = later.replace("    with torch.cuda.amp.autocast():", "    with amp_autocast():").replace(
        "for x, y in", "amp_autocast = torch.cuda.amp.autocast\nfor x, y in")
    once = rewrite(named, Options.create(precision="bf16-mixed", backend="torch"))
    assert 'amp_autocast = functools.partial(torch.autocast, "cuda", dtype=torch.bfloat16)' in once.output
    assert rewrite(once.output, Options.create(precision="bf16-mixed", backend="torch")).output == once.output


def test_a_gradscaler_without_an_autocast_it_can_read_is_left_and_said():
    source = _script("scaler = torch.cuda.amp.GradScaler()\n" + _LOOP.format(
        inner="    with library_autocast():\n        loss = nn.functional.cross_entropy(model(x), y)\n"))
    result = rewrite("from somelib import library_autocast\n" + source,
                     Options.create(precision="bf16-mixed", backend="torch"))
    assert "enabled=False" not in result.output
    assert any("enters no autocast this rule can read" in m for m in _notes(result, "AR213"))


def test_a_library_s_autocast_is_read_as_data_and_set_too():
    """YOLOv5's `smart_amp_autocast(amp)` is ultralytics' `autocast(enabled, device="cuda")`
    (codemod/analysis/libraries.py, LIBRARY_AUTOCASTS): it computes in float16 on CUDA, and
    becomes torch's autocast in bf16 on the run's device."""
    source = "from ultralytics.utils.torch_utils import autocast as smart_amp_autocast\n" + _amp_script(
        "smart_amp_autocast(True)")
    result = rewrite(source, Options.create(precision="bf16-mixed", backend="torch"))
    assert "with torch.autocast(device.type, dtype=torch.bfloat16, enabled=True):" in result.output, result.output
    fp16 = rewrite(source, Options.create(precision="16-mixed", backend="torch"))
    assert "computes in float16 already" in " ".join(_notes(fp16, "AR213"))


def test_a_refusal_names_the_backend_asked_for():
    """Issue 60: under --backend accelerate a refusal of a file that nothing changed says
    "Accelerate conversion", as the notes of the files it writes do."""
    source = (Path(__file__).resolve().parent.parent / "fixtures" / "hogwild" / "input.py").read_text()
    result = rewrite(source, Options.create(precision="bf16-mixed", backend="accelerate"))
    said = [n.message for n in result.notes if n.rule == "AR101"]
    assert said and said[0].startswith("Accelerate conversion: ") and "Fabric's" not in said[0], said
