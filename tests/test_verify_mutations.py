"""Mutation tests of the verifier (issues 3 and 17): rewrites with planted bugs must be flagged
(any verdict but pass), and correct rewrites must pass.

Two suites:

- ``tests/verify_cases/base.py`` is the original (a small MLP, AdamW with two parameter groups,
  fp32 on CPU); next to it are three correct rewrites (``good_*.py``). Each planted bug is one edit
  of a correct rewrite, made here (``BAD``), so that the bug reads at a glance, verified with the
  options it claims (``OPTIONS``). The default run (CI) holds one correct rewrite (good_fabric)
  and one mutant of each kind that a run shows quickly (no step, a lost scaler update, an
  undivided loss, another lr, autocast disabled in the training step, a precision the machine
  can't run); the ``slow`` set holds the rest (the other correct rewrites, freeze, 2 processes
  held to the original on their batches joined,
  ddp on one device, fsdp, a lost parameter group, zero_grad moved, a model set up twice) and
  the summary.
- the planted-bug suite over the fixtures (``slow``): generic mutations of the 32-true Fabric
  rewrite of six fixtures, and their correct rewrites verified 3 times each (with the dropout CNN
  at bf16-mixed): the detection and false-alarm rates in docs/verifier.md come from it.

Each case is verified with ``verify(original, options, against=case)``; base.py runs once per
option set that changes its run.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from accelerate_rewrite.options import Options  # noqa: E402
from accelerate_rewrite.verify import session  # noqa: E402
from accelerate_rewrite.verify.compare import APPROXIMATE, CHANGES_TRAINING, EXACT, EXIT_CODES  # noqa: E402
from accelerate_rewrite.verify.session import Verification, verify  # noqa: E402
from tests.verify_support import OriginalRuns  # noqa: E402

pytestmark = pytest.mark.runs

CASES = Path(__file__).resolve().parent / "verify_cases"
BASE = CASES / "base.py"

#: case -> the precision it is verified at
GOOD = {
    "good_fabric": "32-true",
    "good_accumulate": "32-true",
    "good_amp16": "16-mixed",  # native torch fp16 autocast + GradScaler: it really runs on CPU
}
FREEZE_BODY = ("    model = MLP()\n", "    model = MLP()\n    model.body.requires_grad_(False)\n")
#: correct rewrites made by an edit of a file (freeze), verified with their own options
GOOD_EDITED = {
    "good_freeze": ("good_fabric", *FREEZE_BODY),
    # issue 61: on 2 processes, held to the original on their batches joined (verify/shards.py)
    "good_two_processes": ("good_fabric", "", ""),
}
#: planted bug -> (the correct rewrite it is planted in, the text replaced, its replacement)
BAD = {
    "bad_amp_no_update": ("good_amp16", "            scaler.update()\n", ""),
    "bad_accumulate_not_divided": ("good_accumulate", "(loss / ACCUMULATE).backward()", "loss.backward()"),
    "bad_no_step": ("good_fabric", "            optimizer.step()\n", ""),
    "bad_lr": ("good_fabric", "lr=3e-3,", "lr=3.3e-3,"),
    "bad_lost_group": ("good_fabric", ', {"params": model.head.parameters(), "lr": 1e-2}]', "]"),
    "bad_setup_twice": ("good_fabric", "    model, optimizer = fabric.setup(model, optimizer)\n",
                        "    model = fabric.setup_module(model)\n"
                        "    model, optimizer = fabric.setup(model, optimizer)\n"),
    # issue 17: a mixed precision that did not run in the training step
    "bad_autocast_disabled": ("good_amp16", 'torch.autocast("cpu", dtype=torch.float16)',
                              'torch.autocast("cpu", dtype=torch.float16, enabled=False)'),
    # issue 27.2: zero_grad() moved between the backward and the step: no gradient is applied
    # (under a GradScaler it fails loudly: "No inf checks were recorded for this optimizer")
    "bad_zero_grad_moved": ("good_fabric", "            fabric.backward(loss)\n            optimizer.step()\n"
                            "            optimizer.zero_grad()\n",
                            "            fabric.backward(loss)\n            optimizer.zero_grad()\n"
                            "            optimizer.step()\n"),
    # --freeze body: a rewrite that forgot to freeze, and one that froze the head too
    "bad_freeze_forgotten": ("good_fabric", "    model = MLP()\n", "    model = MLP()\n"),
    "bad_freeze_too_much": ("good_fabric", "    model = MLP()\n", "    model = MLP()\n"
                            "    model.body.requires_grad_(False)\n    model.head.bias.requires_grad_(False)\n"),
    # --devices 2: an lr x10 on two processes fails against the original on their batches joined
    "bad_two_processes_lr": ("good_fabric", "lr=3e-3,", "lr=3e-2,"),
    # --devices 2: the loader left out of Fabric's sampler: each process trains on the whole set
    "bad_two_processes_unsharded": ("good_fabric", "fabric.setup_dataloaders(loader)",
                                    "fabric.setup_dataloaders(loader, use_distributed_sampler=False)"),
    # ddp on one device: the DistributedSampler reorders the data
    "bad_ddp_one_device": ("good_fabric", 'Fabric(accelerator="cpu", devices=1,',
                           'Fabric(accelerator="cpu", strategy="ddp", devices=1,'),
    # what this machine can't run: never "the rewrite broke the script"
    "bad_te_on_cpu": ("good_fabric", "", ""),
    "bad_fsdp_on_cpu": ("good_fabric", "", ""),
}
#: the options each case is verified with (beyond its precision), and the verify arguments
OPTIONS = {
    "good_freeze": {"freeze": ("body",)},
    "bad_freeze_forgotten": {"freeze": ("body",)},
    "bad_freeze_too_much": {"freeze": ("body",)},
    "good_two_processes": {"devices": 2},
    "bad_two_processes_lr": {"devices": 2},
    "bad_two_processes_unsharded": {"devices": 2},
    "bad_ddp_one_device": {"strategy": "ddp", "devices": 1},
    "bad_te_on_cpu": {"precision": "transformer-engine"},
    "bad_fsdp_on_cpu": {"strategy": "fsdp"},
}
ARGS = {
    "good_two_processes": {"run_devices": 2},
    "bad_two_processes_lr": {"run_devices": 2},
    "bad_two_processes_unsharded": {"run_devices": 2},
    "bad_fsdp_on_cpu": {"run_on": None},  # as the machine is: no CUDA, so nothing runs
}
#: the verdict each planted bug gets (fail where not said)
EXPECTED = {
    "bad_autocast_disabled": "not-verified",
    "bad_ddp_one_device": "data-order-changed",
    "bad_te_on_cpu": "not-verified",
    "bad_fsdp_on_cpu": "not-verified",
}
#: kinds another default case already shows, and the runs that take long (lightning's ddp
#: start-up, two processes, a second original run for the parameter fingerprints)
SLOW = {"bad_lost_group", "good_freeze", "bad_freeze_forgotten", "bad_freeze_too_much",
        "bad_two_processes_lr", "bad_two_processes_unsharded", "bad_ddp_one_device", "bad_fsdp_on_cpu",
        "good_two_processes",
        # the correct rewrites whose planted bugs run in the default set (good_fabric passes
        # there), a second bug of the step's order, and a second wrapped model (CI time)
        "good_amp16", "good_accumulate", "bad_zero_grad_moved", "bad_setup_twice"}


def _case_file(case: str, folder: Path) -> Path:
    if case in GOOD:
        return CASES / f"{case}.py"
    good, old, new = GOOD_EDITED.get(case) or BAD[case]
    source = (CASES / f"{good}.py").read_text()
    assert source.count(old) == 1 or old == "", f"{case}: the edit must hit exactly one place in {good}.py"
    path = folder / f"{case}.py"
    path.write_text(source.replace(old, new) if old else source)
    return path


def _precision(case: str) -> str:
    if case in GOOD:
        return GOOD[case]
    return GOOD[(GOOD_EDITED.get(case) or BAD[case])[0]]


def _options(case: str) -> Options:
    options = {"precision": _precision(case), **OPTIONS.get(case, {})}
    if options["precision"] == "16-mixed":  # the cases are native torch (GradScaler("cpu"))
        options["backend"] = "torch"
    return Options.create(**options)


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """``verified(case)``: the case verified against base.py, once per module."""
    folder = tmp_path_factory.mktemp("verify-cases")
    originals = OriginalRuns()
    done: dict[str, Verification] = {}

    def get(case: str) -> Verification:
        if case not in done:
            options = _options(case)
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(folder)
                mp.setattr(session, "run_script", originals.run_script)
                v = verify(BASE, options, against=_case_file(case, folder),
                           steps=12, threads=1, **{"run_on": "cpu", **ARGS.get(case, {})})
            c = v.verdict.comparison
            print(f"\n{case} [{options.precision}]: {v.verdict.verdict} ({c['tolerance']['kind']}, max rel "
                  f"{c.get('max_rel_diff')}, grad norm max rel {c.get('max_grad_norm_rel_diff')}): "
                  f"{v.verdict.reason.splitlines()[0][:200]}")
            done[case] = v
        return done[case]

    return get


def _slow(cases):
    return [pytest.param(c, marks=pytest.mark.slow) if c in SLOW else c for c in cases]


def test_the_cases_are_there():
    assert sorted(p.stem for p in CASES.glob("*.py")) == sorted(["base", *GOOD])


@pytest.mark.parametrize("case", _slow([*GOOD, *GOOD_EDITED]))
def test_a_correct_rewrite_passes(case, verified):
    v = verified(case)
    assert v.verdict.verdict == "pass", v.verdict.reason
    assert v.verdict.exit_code == 0
    assert v.original.ok and v.rewritten.ok
    kind = v.verdict.comparison["tolerance"]["kind"]
    if case == "good_two_processes":
        # each process's 4 batches of 16 an epoch: 8 steps, each the original's on their 32 samples
        assert v.rewritten.world_size == 2 and len(v.rewritten.losses) == 8
        assert v.joined is not None and len(v.joined.losses) == 8
        assert kind == EXACT and v.verdict.comparison["max_rel_diff"] <= 1e-5
        assert v.verdict.reason.startswith("held to the original on the 2 processes' batches, joined step by step: "
                                           "identical within 1e-05")
        return
    assert len(v.original.losses) == len(v.rewritten.losses) == 12
    if case == "good_fabric":
        assert kind == EXACT
        assert v.verdict.comparison["max_rel_diff"] == 0
        assert v.rewritten.losses == v.original.losses
    elif case == "good_accumulate":
        # two backward calls per step, each loss / 2: the harness sums the losses backwarded
        # since the previous step, which gives the mean over the 16 samples: the original's loss
        assert kind == EXACT
        assert v.rewritten.backward_calls == 2 * v.original.backward_calls
        assert v.verdict.comparison["max_rel_diff"] <= 1e-5
        assert v.rewritten.losses == pytest.approx(v.original.losses, rel=1e-5)
    elif case == "good_freeze":
        # --freeze body: checked against its claim (a pass, exit 0, though the curves differ)
        assert kind == CHANGES_TRAINING
        assert v.verdict.reason.startswith("checked against what the rewrite claims: the 4 parameters "
                                           "--freeze names are bitwise unchanged, the other 2 moved")
        assert v.rewritten.losses[0] == v.original.losses[0] and v.rewritten.losses != v.original.losses
    else:
        # 16-mixed really ran on CPU: fp16 autocast and an enabled GradScaler (native torch,
        # so Fabric's switch to bf16 on CPU does not apply); every training step's graph holds
        # float16 tensors
        assert kind == APPROXIMATE
        assert v.rewritten.precision == "16-mixed"
        assert ["cpu", "float16", True] in v.rewritten.autocast
        assert any(on for _, on in v.rewritten.grad_scaler)
        assert v.rewritten.step_half_dtypes == [["float16"]] * 12
        assert v.original.precision == "32-true"
        assert v.rewritten.losses != v.original.losses  # fp16 rounding: close, not identical


@pytest.mark.parametrize("case", _slow(BAD))
def test_a_planted_bug_is_flagged(case, verified):
    v = verified(case)
    expected = EXPECTED.get(case, "fail")
    assert v.verdict.verdict == expected, v.verdict.reason
    assert v.verdict.exit_code == EXIT_CODES[expected] != 0
    reason = v.verdict.reason
    assert "broke" not in reason or expected == "fail"
    if case in ("bad_te_on_cpu", "bad_fsdp_on_cpu"):  # nothing ran
        assert v.original.losses == v.rewritten.losses == []
        assert reason.startswith("needs CUDA for --")
        return
    assert v.original.ok and len(v.original.losses) == 12
    if case == "bad_amp_no_update":
        # GradScaler refuses a second step() without update()
        assert reason.startswith("the rewrite broke the script: RuntimeError")
        assert "update()" in reason
    elif case == "bad_setup_twice":
        assert reason.startswith("the rewrite broke the script: ValueError")
    elif case == "bad_no_step":
        assert v.rewritten.ok and v.rewritten.losses == []
        assert "made no optimizer step" in reason
    elif case == "bad_accumulate_not_divided":
        # each step backwards two undivided micro-batch losses: their sum is twice the mean
        assert v.rewritten.ok
        assert v.rewritten.losses[0] == pytest.approx(2 * v.original.losses[0], rel=1e-5)
    elif case == "bad_autocast_disabled":
        # the GradScaler ran, autocast did not: no training step's graph holds a float16 tensor
        assert v.rewritten.step_half_dtypes == [[]] * 12
        assert "16-mixed was asked for" in reason
    elif case == "bad_zero_grad_moved":
        # the model never trains; said at the first step, whatever the losses show
        assert "the rewritten script applied no gradient at step 1" in reason, reason
        assert v.rewritten.no_grad_steps == list(range(1, 13))
    elif case == "bad_freeze_forgotten":
        assert "4 of the 4 parameters it names changed during training" in reason
    elif case == "bad_freeze_too_much":
        assert "1 parameter(s) it does not name did not change (head.bias)" in reason
        assert "more was frozen than asked" in reason
    elif case == "bad_two_processes_lr":
        assert v.rewritten.world_size == 2 and reason.startswith("held to the original on the 2 processes' batches")
        assert "step 2" in reason  # the same first step, then the weights part ways
    elif case == "bad_two_processes_unsharded":
        assert v.rewritten.world_size == 2 and reason.startswith("the 2 processes drew the same samples")
    elif case == "bad_ddp_one_device":
        assert v.rewritten.world_size == 1 and v.rewritten.distributed_samplers == [[1, True]]
    else:  # bad_lr, bad_lost_group: the same first loss, then the weights part ways
        assert v.rewritten.ok
        assert v.rewritten.losses[0] == v.original.losses[0]
        assert v.rewritten.losses[1] != v.original.losses[1]
        if case == "bad_lost_group":
            # the head's parameters are out of the optimizer: the gradient it applies at the
            # first step already has a smaller norm, before any loss can differ
            assert "the gradient applied at step 1 differs" in reason
        else:
            assert "step 2" in reason


def _summary(verified, cases) -> None:
    bad = [c for c in cases if c in BAD]
    good = [c for c in cases if c not in BAD]
    caught = [c for c in bad if verified(c).verdict.verdict != "pass"]
    passed = [c for c in good if verified(c).verdict.verdict == "pass"]
    print(f"\nmutation tests: flagged {len(caught)} of {len(bad)} planted bugs, "
          f"passed {len(passed)} of {len(good)} correct rewrites")
    assert len(caught) == len(bad) and len(passed) == len(good)


@pytest.mark.slow  # (the default set's cases each assert on their own)
def test_mutation_summary(verified):
    _summary(verified, [*GOOD, *GOOD_EDITED, *BAD])
