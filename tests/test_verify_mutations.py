"""Mutation tests of the verifier (issue 3): rewrites of one script with planted bugs must be
flagged, and correct rewrites must pass.

``tests/verify_cases/base.py`` is the original (a small MLP, AdamW with two parameter groups,
fp32 on CPU); next to it are three correct rewrites (``good_*.py``). Each planted bug is one edit
of a correct rewrite, made here (``BAD``), so that the bug reads at a glance. Each case is
verified with ``verify(base.py, options, against=case)``; base.py runs once. The last test
prints the summary line for the closing note.
"""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("lightning")

from accelerate_rewrite.options import Options  # noqa: E402
from accelerate_rewrite.verify import session  # noqa: E402
from accelerate_rewrite.verify.compare import APPROXIMATE, EXACT  # noqa: E402
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
}


def _case_file(case: str, folder: Path) -> Path:
    if case in GOOD:
        return CASES / f"{case}.py"
    good, old, new = BAD[case]
    source = (CASES / f"{good}.py").read_text()
    assert source.count(old) == 1, f"{case}: the edit must hit exactly one place in {good}.py"
    path = folder / f"{case}.py"
    path.write_text(source.replace(old, new))
    return path


def _precision(case: str) -> str:
    return GOOD[case] if case in GOOD else GOOD[BAD[case][0]]


@pytest.fixture(scope="module")
def verified(tmp_path_factory):
    """``verified(case)``: the case verified against base.py, once per module."""
    folder = tmp_path_factory.mktemp("verify-cases")
    originals = OriginalRuns()
    done: dict[str, Verification] = {}

    def get(case: str) -> Verification:
        if case not in done:
            precision = _precision(case)
            with pytest.MonkeyPatch.context() as mp:
                mp.chdir(folder)
                mp.setattr(session, "run_script", originals.run_script)
                v = verify(BASE, Options.create(precision=precision), against=_case_file(case, folder),
                           steps=12, threads=1, run_on="cpu")
            c = v.verdict.comparison
            print(f"\n{case} [{precision}]: {v.verdict.verdict} ({c['tolerance']['kind']}, max rel "
                  f"{c.get('max_rel_diff')}, grad norm max rel {c.get('max_grad_norm_rel_diff')}): "
                  f"{v.verdict.reason.splitlines()[0][:200]}")
            done[case] = v
        return done[case]

    return get


def test_the_cases_are_there():
    assert sorted(p.stem for p in CASES.glob("*.py")) == sorted(["base", *GOOD])


@pytest.mark.parametrize("case", list(GOOD))
def test_a_correct_rewrite_passes(case, verified):
    v = verified(case)
    assert v.verdict.verdict == "pass", v.verdict.reason
    assert v.verdict.exit_code == 0
    assert v.original.ok and v.rewritten.ok
    assert len(v.original.losses) == len(v.rewritten.losses) == 12
    kind = v.verdict.comparison["tolerance"]["kind"]
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
    else:
        # 16-mixed really ran on CPU: fp16 autocast and an enabled GradScaler (native torch,
        # so Fabric's switch to bf16 on CPU does not apply)
        assert kind == APPROXIMATE
        assert v.rewritten.precision == "16-mixed"
        assert ["cpu", "float16", True] in v.rewritten.autocast
        assert any(on for _, on in v.rewritten.grad_scaler)
        assert v.original.precision == "32-true"
        assert v.rewritten.losses != v.original.losses  # fp16 rounding: close, not identical


@pytest.mark.parametrize("case", list(BAD))
def test_a_planted_bug_is_flagged(case, verified):
    v = verified(case)
    assert v.verdict.verdict == "fail", v.verdict.reason
    assert v.verdict.exit_code == 1
    assert v.original.ok and len(v.original.losses) == 12
    reason = v.verdict.reason
    if case == "bad_amp_no_update":
        # GradScaler refuses a second step() without update()
        assert "the rewrite broke the script" in reason
        assert "update()" in reason
    elif case == "bad_setup_twice":
        assert "the rewrite broke the script" in reason
        assert "ValueError" in reason
    elif case == "bad_no_step":
        assert v.rewritten.ok and v.rewritten.losses == []
        assert "made no optimizer step" in reason
    elif case == "bad_accumulate_not_divided":
        # each step backwards two undivided micro-batch losses: their sum is twice the mean
        assert v.rewritten.ok
        assert v.rewritten.losses[0] == pytest.approx(2 * v.original.losses[0], rel=1e-5)
    else:  # bad_lr, bad_lost_group: the same first loss, then the weights part ways
        assert v.rewritten.ok
        assert v.rewritten.losses[0] == v.original.losses[0]
        assert v.rewritten.losses[1] != v.original.losses[1]
        assert "step 2" in reason


def test_mutation_summary(verified):
    caught = [case for case in BAD if verified(case).verdict.verdict == "fail"]
    passed = [case for case in GOOD if verified(case).verdict.verdict == "pass"]
    print(f"\nmutation tests: caught {len(caught)} of {len(BAD)} planted bugs, "
          f"passed {len(passed)} of {len(GOOD)} correct rewrites")
    assert len(caught) == len(BAD) and len(passed) == len(GOOD)
