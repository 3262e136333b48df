"""Issue 17, the verifier's verdicts: cheap checks (no training run, no subprocess that imports
torch). The runs that back them are in tests/test_verify.py and tests/test_verify_mutations.py.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

from accelerate_rewrite.verify import session


def test_two_rewritten_files_of_one_script_never_collide(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("print('original')\n")
    with session._rewritten_file(script, "print('first')\n") as first:
        with session._rewritten_file(script, "print('second')\n") as second:
            assert first != second
            assert first.parent == second.parent == tmp_path  # beside the original: imports work
            assert first.read_text() == "print('first')\n"
            assert second.read_text() == "print('second')\n"
        assert not second.exists() and first.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["train.py"]


def test_many_verifications_at_once_each_get_their_own_file(tmp_path):
    script = tmp_path / "train.py"
    script.write_text("")
    seen: list[tuple[Path, str]] = []
    barrier = threading.Barrier(8)

    def one(index: int) -> None:
        with session._rewritten_file(script, f"# run {index}\n") as path:
            barrier.wait(timeout=10)  # all files exist at once
            seen.append((path, path.read_text()))

    threads = [threading.Thread(target=one, args=(i,)) for i in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({path for path, _ in seen}) == 8
    assert sorted(text for _, text in seen) == sorted(f"# run {i}\n" for i in range(8))
    assert os.listdir(tmp_path) == ["train.py"]


def test_a_folder_that_cant_be_written_gets_a_temporary_one(tmp_path, monkeypatch):
    script = tmp_path / "train.py"
    script.write_text("")
    real = session.tempfile.mkstemp

    def read_only(*args, dir=None, **kwargs):
        if Path(dir) == tmp_path:
            raise PermissionError(13, "Permission denied", str(dir))
        return real(*args, dir=dir, **kwargs)

    monkeypatch.setattr(session.tempfile, "mkstemp", read_only)
    with session._rewritten_file(script, "x = 1\n") as path:
        assert path.parent != tmp_path and path.read_text() == "x = 1\n"
        folder = path.parent
    assert not folder.exists()


# ---- verdicts from records (compare) ---------------------------------------------------------------

from accelerate_rewrite.options import Options  # noqa: E402
from accelerate_rewrite.verify import environment  # noqa: E402
from accelerate_rewrite.verify.compare import (  # noqa: E402
    APPROXIMATE,
    CHANGES_TRAINING,
    DATA_ORDER,
    EXACT,
    EXIT_CODES,
    FAIL,
    NOT_COMPARED,
    NOT_VERIFIED,
    PASS,
    Claims,
    Tolerance,
    compare,
)
from accelerate_rewrite.verify.claims import frozen_names  # noqa: E402
from accelerate_rewrite.verify.runner import RunRecord  # noqa: E402

LOSSES = [2.0, 1.8, 1.6, 1.5, 1.4, 1.3]
NORMS = [1.0, 0.9, 0.8, 0.7, 0.6, 0.5]


def _run(label="original", losses=LOSSES, norms=NORMS, **kwargs) -> RunRecord:
    return RunRecord(label, exit_code=0, losses=list(losses), grad_norms=list(norms),
                     step_times_s=[0.1] * len(losses), peak_memory_bytes=100 * 2**20, device="cpu", **kwargs)


def test_every_verdict_has_its_own_documented_exit_code():
    assert EXIT_CODES == {"pass": 0, "fail": 1, "error": 2, "not-verified": 2, "not-compared": 3,
                          "data-order-changed": 4}
    from click.testing import CliRunner

    from accelerate_rewrite.cli import cli

    text = " ".join(CliRunner().invoke(cli, ["verify", "--help"], terminal_width=200).output.split())
    for words in ("0 PASS", "1 FAIL", "2 ERROR", "2 NOT VERIFIED", "3 NOT COMPARED", "4 DATA ORDER CHANGED (distributed sampler)"):
        assert words in text, words
    readme = " ".join((Path(__file__).resolve().parent.parent / "README.md").read_text().split())
    for words in ("0 PASS", "1 FAIL", "2 ERROR", "2 NOT VERIFIED", "3 NOT COMPARED", "4 DATA ORDER CHANGED (distributed sampler)"):
        assert words in readme, words


def test_a_crash_of_the_rewritten_script_is_named_first():
    # the case: a script that updates its weights by hand makes no optimizer step; its
    # rewrite crashes with a NameError: the crash is the verdict, not "the original made no step"
    original = RunRecord("original", exit_code=0)
    crash = ("Traceback (most recent call last):\n  File \"train.py (rewritten)\", line 9, in <module>\n"
             "    fabric.backward(los)\nNameError: name 'los' is not defined")
    rewritten = RunRecord("rewritten", exit_code=1, error=crash)
    v = compare(original, rewritten, Tolerance())
    assert v.verdict == FAIL and v.exit_code == 1
    first = v.reason.splitlines()[0]
    assert first.startswith("the rewrite broke the script: NameError: name 'los' is not defined")
    assert "made no optimizer step" in first
    assert v.reason.rstrip().endswith("NameError: name 'los' is not defined")


@pytest.mark.parametrize("last, needs", [
    ("ValueError: FSDP is only available on GPU", "CUDA"),
    ("ModuleNotFoundError: No module named 'transformer_engine'", "transformer_engine"),
    ("ModuleNotFoundError: No module named 'bitsandbytes'", "bitsandbytes"),
    ("RuntimeError: Found no NVIDIA driver on your system.", "CUDA"),
    # torch's words on a CPU without bfloat16 instructions, for an LSTM under bf16 autocast
    ("RuntimeError: could not create a primitive descriptor for the LSTM forward propagation primitive. "
     "Run workload with environment variable ONEDNN_VERBOSE=all to get additional diagnostic information.",
     "a CPU kernel for this layer at this precision"),
])
def test_a_machine_that_cant_run_it_is_not_verified_never_broke(last, needs):
    rewritten = RunRecord("rewritten", exit_code=1, error=f"Traceback (most recent call last):\n{last}")
    v = compare(_run(), rewritten, Tolerance())
    assert v.verdict == NOT_VERIFIED and v.exit_code == 2
    assert v.reason.startswith(f"needs {needs}")
    assert "broke" not in v.reason


def test_bit_identical_losses_under_mixed_precision_are_not_a_pass():
    # an autocast entered, and nothing in the training steps traced (a record without the trace):
    # the losses alone show that bf16 changed no rounding
    said_bf16 = _run("rewritten", autocast=[["cpu", "bfloat16", True]])
    assert said_bf16.precision == "bf16-mixed"
    v = compare(_run(), said_bf16, Tolerance(kind=APPROXIMATE), requested_precision="bf16-mixed")
    assert v.verdict == NOT_VERIFIED and v.exit_code == 2
    assert "bit-identical" in v.reason


def test_no_half_dtype_in_a_training_step_is_not_verified_whatever_autocast_ran_elsewhere():
    close = [x * 1.001 for x in LOSSES]
    # the case: autocast disabled in the training step, enabled in the evaluation loop
    evaluation_only = _run("rewritten", close, autocast=[["cpu", "bfloat16", False], ["cpu", "bfloat16", True]],
                           step_half_dtypes=[[] for _ in LOSSES])
    v = compare(_run(), evaluation_only, Tolerance(kind=APPROXIMATE), requested_precision="bf16-mixed")
    assert v.verdict == NOT_VERIFIED, v.reason
    assert evaluation_only.precision == "32-true"
    assert "outside the training step" in v.reason
    # some steps with, some without: those are named
    partly = _run("rewritten", close, step_half_dtypes=[["bfloat16"]] * 4 + [[], []])
    v = compare(_run(), partly, Tolerance(kind=APPROXIMATE), requested_precision="bf16-mixed")
    assert v.verdict == NOT_VERIFIED and "step(s) 5, 6 (of 6)" in v.reason
    # every step traced: within tolerance, a pass
    traced = _run("rewritten", close, step_half_dtypes=[["bfloat16"]] * 6)
    v = compare(_run(), traced, Tolerance(kind=APPROXIMATE), requested_precision="bf16-mixed")
    assert v.verdict == PASS and traced.precision == "bf16-mixed", v.reason


def test_a_change_of_training_that_nothing_checks_is_not_compared():
    claims = Claims(unchecked=("--accumulate 4 without --keep-effective-batch",))
    other = _run("rewritten", [2.0, 1.5, 1.2])
    v = compare(_run(), other, Tolerance(kind=CHANGES_TRAINING), claims=claims)
    assert v.verdict == NOT_COMPARED and v.exit_code == 3
    assert v.reason.startswith("the rewrite changes training on purpose") and "--accumulate 4" in v.reason
    # the same curves: parity was measured, whatever the rewrite might have changed
    v = compare(_run(), _run("rewritten"), Tolerance(kind=CHANGES_TRAINING), claims=claims)
    assert v.verdict == PASS
    # more processes: never a pass by the curves (each process sees a share of the data)
    two = _run("rewritten", [2.0, 1.7, 1.5], world_size=2)
    v = compare(_run(), two, Tolerance(kind=CHANGES_TRAINING), claims=Claims(unchecked=("2 processes",)))
    assert v.verdict == NOT_COMPARED and "2 processes" in v.reason




def _frozen_run(label, moved_names):
    names = ["embeddings.weight", "encoder.layer.0.w", "encoder.layer.1.w", "encoder.layer.2.w", "head.w"]
    return _run(label, LOSSES if label == "original" else [2.0, 1.85, 1.7, 1.6, 1.5, 1.45],
                params_start={n: "a" for n in names},
                params_end={n: ("b" if n in moved_names else "a") for n in names})


def test_frozen_names_read_the_three_forms():
    names = ["embeddings.weight", "encoder.layer.0.w", "encoder.layer.1.w", "encoder.layer.2.w", "head.w"]
    assert frozen_names(["embeddings"], names) == {"embeddings.weight"}
    assert frozen_names(["encoder.layer[:2]"], names) == {"encoder.layer.0.w", "encoder.layer.1.w"}
    assert frozen_names(["encoder.layer[-1:]"], names) == {"encoder.layer.2.w"}
    assert frozen_names(["*.w"], names) == set(names) - {"embeddings.weight"}


def test_freeze_is_checked_against_its_claim():
    everything = {"embeddings.weight", "encoder.layer.0.w", "encoder.layer.1.w", "encoder.layer.2.w", "head.w"}
    original = _frozen_run("original", everything)
    claims = Claims(freeze=("embeddings", "encoder.layer[:2]"))
    tol = Tolerance(kind=CHANGES_TRAINING)
    good = _frozen_run("rewritten", {"encoder.layer.2.w", "head.w"})
    v = compare(original, good, tol, claims=claims)
    assert v.verdict == PASS and v.exit_code == 0, v.reason
    assert "the 3 parameters --freeze names are bitwise unchanged, the other 2 moved" in v.reason
    forgot = _frozen_run("rewritten", everything)  # the rewrite forgot to freeze
    v = compare(original, forgot, tol, claims=claims)
    assert v.verdict == FAIL and "were not frozen" in v.reason
    too_much = _frozen_run("rewritten", {"head.w"})
    v = compare(original, too_much, tol, claims=claims)
    assert v.verdict == FAIL and "encoder.layer.2.w" in v.reason and "more was frozen" in v.reason


def test_clipping_is_checked_against_its_claim():
    original = _run(norms=[0.02, 0.3, 0.2, 0.1, 0.1, 0.1])
    tol, claims = Tolerance(kind=CHANGES_TRAINING), Claims(clip_grad_norm=0.05)
    clipped = _run("rewritten", [2.0, 1.8, 1.7, 1.6, 1.55, 1.5], [0.02, 0.05, 0.05, 0.05, 0.05, 0.05])
    v = compare(original, clipped, tol, claims=claims)
    assert v.verdict == PASS, v.reason
    not_clipped = _run("rewritten", [2.0, 1.8, 1.7, 1.6, 1.55, 1.5], [0.02, 0.3, 0.05, 0.05, 0.05, 0.05])
    v = compare(original, not_clipped, tol, claims=claims)
    assert v.verdict == FAIL and "step 2" in v.reason
    other_norm = _run("rewritten", [2.0, 1.8, 1.7, 1.6, 1.55, 1.5], [0.02, 0.025, 0.025, 0.025, 0.025, 0.025])
    v = compare(original, other_norm, tol, claims=claims)
    assert v.verdict == FAIL and "clips to another norm" in v.reason
    first_differs = _run("rewritten", [2.1, 1.8, 1.7, 1.6, 1.55, 1.5], [0.02, 0.05, 0.05, 0.05, 0.05, 0.05])
    v = compare(original, first_differs, tol, claims=claims)
    assert v.verdict == FAIL and "before clipping could act" in v.reason


def test_a_distributed_sampler_on_one_process_is_a_data_order_change():
    shuffled = _run("rewritten", [2.1, 1.7, 1.65, 1.45, 1.42, 1.28], distributed_samplers=[[1, True]])
    v = compare(_run(), shuffled, Tolerance())
    assert v.verdict == DATA_ORDER and v.exit_code == 4
    assert v.label == "DATA ORDER CHANGED (distributed sampler)"
    assert v.reason.startswith("the rewritten run draws its batches through a DistributedSampler")
    # the same order (a sequential sampler): the curves agree, and that is a pass
    same = _run("rewritten", distributed_samplers=[[1, False]])
    assert compare(_run(), same, Tolerance()).verdict == PASS


# ---- the machine: not verified before anything runs ---------------------------------------------

@pytest.mark.parametrize("options, run_on, needs", [
    ({"strategy": "fsdp"}, None, ["CUDA"]),
    ({"strategy": "deepspeed"}, None, ["deepspeed", "CUDA"]),
    ({"precision": "transformer-engine"}, "cpu", ["CUDA", "transformer_engine"]),
    ({"precision": "16-mixed"}, "cpu", ["CUDA"]),
    ({"precision": "16-mixed"}, None, ["CUDA"]),
    ({"optimizer_8bit": True}, "cpu", ["bitsandbytes"]),
    ({"accelerator": "cuda", "devices": 2}, None, ["CUDA"]),
])
def test_what_the_options_need_from_the_machine(options, run_on, needs):
    wanted = environment.needs(Options.create(**options), run_on, None)
    lacking = environment.missing(wanted, environment.Machine(0, {}))
    assert sorted({n.what for n in lacking}) == sorted(needs)


def test_what_runs_here_needs_nothing():
    for options, run_on in [({}, "cpu"), ({"precision": "bf16-mixed"}, "cpu"), ({"strategy": "fsdp"}, "cpu"),
                            ({"backend": "torch", "precision": "16-mixed"}, None), ({"devices": 2}, "cpu")]:
        assert environment.needs(Options.create(**options), run_on, None) == [], options
    # --against: the file's own backend decides how 16-mixed runs (native fp16 runs on the CPU)
    assert environment.needs(Options.create(precision="16-mixed"), "cpu", None, against=True) == []


@pytest.mark.parametrize("options, words", [
    ({"strategy": "fsdp"}, ["needs CUDA for --strategy fsdp", "this machine has no CUDA device",
                            "NVIDIA GPU", "--run-on cpu"]),
    ({"precision": "transformer-engine"}, ["transformer_engine", "pip install transformer-engine"]),
    ({"optimizer_8bit": True}, ["bitsandbytes", "pip install bitsandbytes"]),
])
def test_not_verified_before_running_names_what_is_missing_and_what_would_verify_it(options, words, tmp_path,
                                                                                     monkeypatch):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("import torch\n")

    def no_run(*args, **kwargs):
        raise AssertionError("nothing may run on a machine that can't run the options")

    monkeypatch.setattr(session, "run_script", no_run)
    monkeypatch.setattr(environment, "probe", lambda python, wanted, env=None, cwd=None: environment.Machine(0, {}))
    v = session.verify(script, Options.create(**options), against=script, steps=3)
    assert v.verdict.verdict == NOT_VERIFIED and v.verdict.exit_code == 2
    assert v.verdict.reason.startswith("needs ")
    assert "broke" not in v.verdict.reason
    for word in words:
        assert word in v.verdict.reason, word


def test_the_probe_asks_the_runs_python(tmp_path):
    import sys

    wanted = [environment.Need("json", "a test"), environment.Need("no_such_module_here", "a test")]
    machine = environment.probe(sys.executable, wanted)
    assert machine.modules == {"json": True, "no_such_module_here": False}


def test_against_classifies_by_every_option():
    kind = session.tolerance_kind
    assert kind(Options.create(freeze="embeddings"), [], 1) == CHANGES_TRAINING
    assert kind(Options.create(clip_grad_norm=1.0), [], 1) == CHANGES_TRAINING
    assert kind(Options.create(accumulate=4), [], 1) == CHANGES_TRAINING
    assert kind(Options.create(accumulate=4, keep_effective_batch=True), [], 1) == APPROXIMATE
    assert kind(Options.create(optimizer_8bit=True), [], 1) == APPROXIMATE
    assert kind(Options.create(precision="32-true"), [], 1) == EXACT
    assert kind(Options.create(precision="32-true"), [], 2) == CHANGES_TRAINING
    claims = session.claims_for(Options.create(freeze=("embeddings",), clip_grad_norm=0.5, precision="bf16-mixed"),
                                [], 1)
    assert claims.freeze == ("embeddings",) and claims.clip_grad_norm == 0.5 and claims.basis == APPROXIMATE


# ---- the report --------------------------------------------------------------------------------

def test_memory_is_said_in_words_and_a_busy_machine_is_warned_about():
    from accelerate_rewrite.verify import report

    original, rewritten = _run(), _run("rewritten")
    rewritten.peak_memory_bytes = int(1.24 * original.peak_memory_bytes)
    verdict = compare(original, rewritten, Tolerance())
    assert report.memory_text(verdict.comparison["rewritten_memory_x"]) == \
        "rewritten uses 1.24x the memory of the original"
    v = session.Verification(Path("train.py"), Options.create(), verdict, original, rewritten)
    verdict.comparison.update(load_average=1.0, cores=2)
    assert report.warnings(v) == []
    verdict.comparison.update(load_average=3.5, cores=2)
    assert "load average 3.5 on 2 cores" in report.warnings(v)[0]


def test_the_plot_has_a_gradient_norm_panel_and_marks_the_failing_figure(tmp_path):
    pytest.importorskip("matplotlib")
    from accelerate_rewrite.verify import report

    original, rewritten = _run(), _run("rewritten", norms=[n * 1.5 for n in NORMS])
    verdict = compare(original, rewritten, Tolerance())
    assert verdict.verdict == FAIL
    v = session.Verification(Path("train.py"), Options.create(), verdict, original, rewritten)
    assert report.failing_figure(v) == "gradient norm"
    report.write_plot(tmp_path / "out.png", v)
    assert (tmp_path / "out.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    lossy = compare(original, _run("rewritten", [x * 1.1 for x in LOSSES]), Tolerance())
    assert report.failing_figure(session.Verification(Path("t.py"), Options.create(), lossy, original,
                                                      rewritten)) == "loss"


def test_a_claim_check_on_other_data_does_not_hold_the_first_step_to_the_original():
    # --freeze on 2 processes: each rank's first batch is another; the frozen parameters are
    # still checked, the first loss is not, and the processes leave the run not compared
    names = ["embeddings.weight", "head.w"]
    original = _run(params_start={n: "a" for n in names}, params_end={n: "b" for n in names})
    rewritten = _run("rewritten", [2.2, 1.9, 1.7], world_size=2, params_start={n: "a" for n in names},
                     params_end={"embeddings.weight": "a", "head.w": "b"})
    v = compare(original, rewritten, Tolerance(kind=CHANGES_TRAINING),
                claims=Claims(freeze=("embeddings",), unchecked=("2 processes, each with its share of the data",)))
    assert v.verdict == NOT_COMPARED, v.reason
    assert "checked: the 1 parameters --freeze names are bitwise unchanged, the other 1 moved" in v.reason


def test_a_step_that_applies_no_gradient_fails_whatever_the_precision_hides():
    """Issue 27.2: a zero_grad() moved between the backward and the step leaves no gradient at
    step time; the losses of a slowly moving bf16 run stay within tolerance, and the gradient
    figure used to be skipped. It is a finding now, at the first such step; a GradScaler's
    skipped step is not one."""
    approximate = Tolerance(kind=APPROXIMATE, mean_rel=2e-2, last_rel=5e-2)
    nudged = [x * 1.001 for x in LOSSES]
    untrained = _run("rewritten", nudged, [None] * len(LOSSES), no_grad_steps=list(range(1, len(LOSSES) + 1)))
    verdict = compare(_run(), untrained, approximate)
    assert verdict.verdict == FAIL
    assert verdict.reason.startswith("the rewritten script applied no gradient at step 1 (the original's norm 1)")
    zeroed = compare(_run(), _run("rewritten", nudged, [0.0] * len(LOSSES)), approximate)
    assert zeroed.verdict == FAIL and "every gradient was zero" in zeroed.reason
    skipped = _run("rewritten", nudged, [None] + NORMS[1:], skipped_steps=[1])
    assert compare(_run(), skipped, approximate).verdict == PASS
    lbfgs = compare(_run(norms=[None] + NORMS[1:], no_grad_steps=[1]),
                    _run("rewritten", nudged, [None] + NORMS[1:], no_grad_steps=[1]), approximate)
    assert lbfgs.verdict == PASS


def test_gradients_measured_before_clipping_are_compared():
    """Issue 27.3: both runs clip to 1.0, so the applied norms agree; the norm each clip measured
    first shows a changed gradient (zero_grad() removed: gradients pile up), exactly at 32-true
    and on average under a mixed precision."""
    clipped = [1.0] * len(LOSSES)
    measured = [3.0, 2.5, 2.0, 1.8, 1.6, 1.5]
    piled = [3.0, 5.4, 7.1, 8.8, 10.2, 11.5]
    original = _run(norms=clipped, clip_norms=measured)
    exact = compare(original, _run("rewritten", norms=clipped, clip_norms=piled), Tolerance(kind=EXACT))
    assert exact.verdict == FAIL
    assert exact.reason.startswith("the gradient measured before clipping at step 2 differs: norm 5.4 "
                                   "instead of 2.5"), exact.reason
    nudged = [x * 1.001 for x in LOSSES]
    approximate = compare(original, _run("rewritten", nudged, clipped, clip_norms=piled), Tolerance(kind=APPROXIMATE))
    assert approximate.verdict == FAIL and "before clipping at step 2" in approximate.reason
    same = compare(original, _run("rewritten", norms=clipped, clip_norms=measured), Tolerance(kind=EXACT))
    assert same.verdict == PASS and "and before clipping" in same.reason


def test_a_verdict_that_compared_nothing_shows_no_limits():
    """Issue 27.4: NOT COMPARED shows the figures side by side, without an "(allowed ...)"
    beside figures nothing held to it; a PASS shows its limits."""
    from rich.console import Console

    from accelerate_rewrite.verify.report import render
    from accelerate_rewrite.verify.session import Verification

    original, rewritten = _run(), _run("rewritten", [x * 1.5 for x in LOSSES])
    changed = compare(original, rewritten, Tolerance(kind=CHANGES_TRAINING), claims=Claims(basis=EXACT))
    passed = compare(original, _run("rewritten"), Tolerance(kind=EXACT))
    shown = {}
    for name, verdict in (("changed", changed), ("passed", passed)):
        console = Console(record=True, width=160)
        render(console, Verification(Path("train.py"), Options.create(), verdict, original,
                                     _run("rewritten") if name == "passed" else rewritten))
        shown[name] = console.export_text()
    assert changed.verdict == "not-compared" and "(allowed" not in shown["changed"], shown["changed"]
    assert "(allowed 1e-05)" in shown["passed"]


def _bf16(losses, norms=NORMS, **kwargs) -> RunRecord:
    return _run("rewritten", losses, norms, step_half_dtypes=[["bfloat16"]] * len(losses), **kwargs)


def test_mixed_precision_is_held_to_its_own_effect_on_the_script():
    """Issue 27.1: the precision run is compared against a noise floor measured for this script
    (the original under the precision), not a fixed 2e-2: a rewrite within a small multiple of it
    passes and says so; one that differs by 10 times bf16's own effect fails, though it is within
    the fixed 2e-2; a tiny floor still allows the least (NOISE_MINIMUM); a figure the user set is
    kept."""
    from accelerate_rewrite.verify.compare import NOISE_MINIMUM, measured, noise_floor

    noise = noise_floor(_run(), _run("original under bf16-mixed", [x * 1.002 for x in LOSSES],
                                     [x * 1.01 for x in NORMS]))
    assert noise["mean_rel"] == pytest.approx(2e-3) and noise["grad_rel"] == pytest.approx(1e-2)
    approximate = Tolerance(kind=APPROXIMATE)
    close = compare(_run(), _bf16([x * 1.003 for x in LOSSES], [x * 1.012 for x in NORMS]), approximate,
                    requested_precision="bf16-mixed", noise=noise)
    assert close.verdict == PASS, close.reason
    assert close.reason.startswith("within 1.5x of bf16-mixed's own effect on this script (mean relative "
                                   "difference of the losses 3.00e-03 against 2.00e-03 for the original under "
                                   "bf16-mixed autocast"), close.reason
    assert close.comparison["tolerance"]["mean_rel"] == pytest.approx(6e-3)
    far = compare(_run(), _bf16([x * 1.015 for x in LOSSES], [x * 1.01 for x in NORMS]), approximate,
                  requested_precision="bf16-mixed", noise=noise)
    assert far.verdict == FAIL
    assert far.reason.startswith("the losses differ by 1.50e-02 on average (max 1.50e-02), over the 0.006 "
                                 "allowed (3x the 2.00e-03 that bf16-mixed alone makes to the original: "
                                 "--noise-multiple, --mean-rtol)"), far.reason
    # without the noise run, the fixed tolerance: the same rewrite passes
    assert compare(_run(), _bf16([x * 1.015 for x in LOSSES]), approximate,
                   requested_precision="bf16-mixed").verdict == PASS
    # the user's own --mean-rtol and --last-rtol stay
    assert compare(_run(), _bf16([x * 1.015 for x in LOSSES], [x * 1.01 for x in NORMS]),
                   Tolerance(kind=APPROXIMATE, mean_rel=2e-2, last_rel=3e-2, fixed=("mean_rel", "last_rel")),
                   requested_precision="bf16-mixed", noise=noise).verdict == PASS
    tiny = {"mean_rel": 1e-5, "last_rel": 0.0, "grad_rel": 1e-5}
    floor = measured(approximate, tiny)
    assert (floor.mean_rel, floor.last_rel, floor.grad_rel) == tuple(NOISE_MINIMUM[k] for k in ("mean_rel", "last_rel", "grad_rel"))
    least = compare(_run(), _bf16([x * 1.004 for x in LOSSES]), approximate, requested_precision="bf16-mixed",
                    noise={**tiny, "label": "original under bf16-mixed", "steps": 6})
    assert least.verdict == FAIL and "allowed at least for bf16-mixed" in least.reason, least.reason


def test_a_precision_that_did_not_run_and_curves_apart_are_both_said():
    """Issue 27.4: "bf16-mixed did not run" must not hide that the curves also differ by more
    than the precision could explain."""
    fp32 = _run("rewritten", [x * 1.3 for x in LOSSES])
    v = compare(_run(), fp32, Tolerance(kind=APPROXIMATE), requested_precision="bf16-mixed")
    assert v.verdict == NOT_VERIFIED
    assert v.reason.startswith("bf16-mixed was asked for, but the rewritten run used 32-true")
    assert "; and the curves differ beyond what the precision could explain: the losses differ by 3.00e-01" in v.reason
    near = compare(_run(), _run("rewritten", [x * 1.001 for x in LOSSES]), Tolerance(kind=APPROXIMATE),
                   requested_precision="bf16-mixed")
    assert near.verdict == NOT_VERIFIED and "curves differ" not in near.reason


def test_curves_that_part_where_the_grad_scaler_skipped_steps_are_not_compared():
    """A loss that is a sum overflows fp16 at the GradScaler's starting scale: it skips steps
    while the scale settles, and the curves part there by design (autoencoder_sums at 16-mixed
    with the torch backend). The steps before the first skip are compared; a scaler that never
    settles fails."""
    approximate = Tolerance(kind=APPROXIMATE)
    apart = [LOSSES[0] * 1.001, LOSSES[1] * 1.001] + [x * 1.3 for x in LOSSES[2:]]
    settled = _run("rewritten", apart, [None, None, 1.3, 1.2, 1.1, 1.0], skipped_steps=[1, 2],
                   grad_scaler=[["cpu", True]])
    v = compare(_run(), settled, approximate)
    assert v.verdict == NOT_COMPARED and v.exit_code == 3, v.reason
    assert v.reason.startswith("the rewritten run's GradScaler skipped step(s) 1, 2 of 6 (fp16 gradients "
                               "overflowed while its loss scale settled"), v.reason
    never = _run("rewritten", apart, [None, None, None, None, None, None], skipped_steps=[1, 2, 3, 4, 5, 6])
    assert compare(_run(), never, approximate).reason.startswith("the GradScaler skipped every step from step 1")
    early = _run("rewritten", [x * 1.3 for x in LOSSES], [None, None, 1.3, 1.2, 1.1, 1.0], skipped_steps=[2, 3])
    v = compare(_run(), early, approximate)
    assert v.verdict == FAIL and v.reason.startswith("before the GradScaler's first skipped step (2), the loss "
                                                     "of step 1 already differs"), v.reason
    # a skip the curves survive is no finding: parity as usual
    assert compare(_run(), _run("rewritten", norms=[None] + NORMS[1:], skipped_steps=[1]), approximate).verdict == PASS
