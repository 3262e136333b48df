"""Issue 28.1, ``accelerate-rewrite tune``: the candidates for the machine, the ranking, the
recommendation (the fastest that PASSed, never a crashed, failed or unavailable one), the JSON
and the plot. Runs on the CPU; no step time is asserted, only the order the measured ones give.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.options import Options
from accelerate_rewrite.verify import environment, tune
from accelerate_rewrite.verify.compare import Tolerance, Verdict
from accelerate_rewrite.verify.environment import Machine
from accelerate_rewrite.verify.runner import RunRecord
from accelerate_rewrite.verify.session import Verification
from tests.goldens import FIXTURES


def test_the_default_candidates_follow_the_machine():
    cpu = [c.label for c in tune.default_candidates(Machine(0, {}))]
    assert cpu == ["--precision 32-true", "--precision bf16-mixed", "--precision bf16-mixed --compile"]
    gpu = [c.label for c in tune.default_candidates(Machine(1, {"bitsandbytes": True}, cuda_bf16=True))]
    assert gpu == ["--precision 32-true", "--precision 32-true --matmul-precision high", "--precision 16-mixed",
                   "--precision bf16-mixed", "--precision bf16-mixed --compile",
                   "--precision bf16-mixed --optimizer-8bit"]
    old_gpu = [c.label for c in tune.default_candidates(Machine(1, {"bitsandbytes": False}))]
    assert "--precision bf16-mixed" not in old_gpu and not any("8bit" in c for c in old_gpu)


def _verification(verdict: str, step_s: float, ok: bool = True, memory: int = 200) -> Verification:
    original = RunRecord("original", exit_code=0, losses=[1.0] * 10, step_times_s=[0.1] * 10,
                         peak_memory_bytes=100 * 2**20)
    rewritten = RunRecord("rewritten", exit_code=0 if ok else 1, error=None if ok else "Traceback\nRuntimeError: x",
                          losses=[1.0] * 10, step_times_s=[step_s] * 10, peak_memory_bytes=memory * 2**20)
    return Verification(Path("train.py"), Options.create(), Verdict(verdict, f"{verdict} because", {"mean_rel_diff": 0.0}),
                        original, rewritten)


def _result(outcomes) -> tune.TuneResult:
    return tune.TuneResult(Path("train.py"), outcomes, original_step_s=0.1, original_memory_bytes=100 * 2**20,
                           memory_kind="peak RSS", warmup=1, min_speedup=1.05)


def test_the_fastest_candidate_that_passed_is_recommended_never_a_failed_or_crashed_one():
    fastest_failed = tune.Outcome(tune.Candidate.parse("--precision bf16-mixed --compile"), [_verification("fail", 0.02)])
    crashed = tune.Outcome(tune.Candidate.parse("--precision 16-mixed"), [_verification("fail", 0.01, ok=False)])
    passed = tune.Outcome(tune.Candidate.parse("--precision bf16-mixed"), [_verification("pass", 0.05)])
    slow = tune.Outcome(tune.Candidate(against=Path("slow.py")), [_verification("pass", 0.4)])
    unavailable = tune.Outcome(tune.Candidate.parse("--strategy fsdp"), [_verification("not-verified", 0.0)])
    bad = tune.Outcome(tune.Candidate.parse("--precision 99"), error="invalid precision '99'")
    result = _result([slow, crashed, unavailable, fastest_failed, bad, passed])
    assert [o.candidate.label for o in result.ranked()] == [
        "--precision bf16-mixed --compile", "--precision bf16-mixed", "slow.py", "--precision 16-mixed",
        "--strategy fsdp", "--precision 99"]
    assert result.recommended() is passed
    assert result.speedup(passed) == pytest.approx(2.0) and result.memory_x(passed) == pytest.approx(2.0)
    assert result.command(passed) == "accelerate-rewrite train.py --precision bf16-mixed --write"
    assert result.command(slow) == "cp slow.py train.py"
    data = result.to_json()
    assert data["recommended"] == {"candidate": "--precision bf16-mixed",
                                   "command": "accelerate-rewrite train.py --precision bf16-mixed --write"}
    assert [c["verdict"] for c in data["candidates"]] == ["fail", "pass", "pass", "fail", "not-verified", "not run"]
    assert data["candidates"][-1]["reason"] == "invalid precision '99'"
    # nothing beats the original by 1.05x: said, nothing recommended
    assert _result([slow]).recommended() is None
    # repeats that disagree are never recommended
    flaky = tune.Outcome(tune.Candidate.parse("--compile"), [_verification("pass", 0.02), _verification("fail", 0.02)])
    assert flaky.verdict == "unstable" and _result([flaky]).recommended() is None


def test_the_table_says_what_each_candidate_did(tmp_path):
    from rich.console import Console

    passed = tune.Outcome(tune.Candidate.parse("--precision bf16-mixed"), [_verification("pass", 0.05)])
    slow = tune.Outcome(tune.Candidate(against=Path("slow.py")), [_verification("pass", 0.4)])
    console = Console(record=True, width=200)
    tune.render(console, _result([slow, passed]))
    text = console.export_text()
    assert re.search(r"original\s+│\s+100\.0 ms\s+│\s+-\s+│\s+1\.00x", text), text
    assert "Recommended: --precision bf16-mixed (2.00x the original's speed, verified): accelerate-rewrite " \
           "train.py --precision bf16-mixed --write" in " ".join(text.split())
    console = Console(record=True, width=200)
    tune.render(console, _result([slow]))
    assert "No recommendation: no candidate that passed beats the original by 1.05x" in console.export_text()



def _planted(source: str, after: str, line: str) -> str:
    out, n = re.subn(rf"^(\s*){re.escape(after)}\n", lambda m: f"{m.group(0)}{m.group(1)}{line}\n", source,
                     count=1, flags=re.M)
    assert n == 1
    return out


@pytest.mark.runs
@pytest.mark.slow  # CI time: a minute on 2 cores; the ranking and the table are checked without runs above
def test_tune_ranks_measured_candidates_and_shows_the_failed_and_the_unavailable(tmp_path, monkeypatch):
    """The issue's case on a runnable fixture, in-process: an option set, a planted slow file
    (the 32-true rewrite sleeping 50 ms a step), a crashing one, fsdp (needs CUDA) and 8-bit
    optimizers on a machine without bitsandbytes: the slow one is the last of those timed and
    not recommended; the crash, fsdp and 8-bit are shown as such; the JSON and the plot."""
    pytest.importorskip("torch")
    pytest.importorskip("lightning")
    pytest.importorskip("matplotlib")
    from accelerate_rewrite.api import rewrite

    shutil.copy(FIXTURES / "module_loop" / "input.py", tmp_path / "train.py")
    good = rewrite((tmp_path / "train.py").read_text(), Options.create(precision="32-true")).output
    (tmp_path / "slow.py").write_text("import time\n" + _planted(good, "optimizer.step()", "time.sleep(0.05)"))
    (tmp_path / "crash.py").write_text(_planted(good, "optimizer.step()", 'raise RuntimeError("planted crash")'))
    real_probe = environment.probe

    def no_bitsandbytes(python, wanted, env=None, cwd=None):
        machine = real_probe(python, [n for n in wanted if n.what != "bitsandbytes"], env=env, cwd=cwd)
        machine.modules.update({n.what: False for n in wanted if n.what == "bitsandbytes"})
        return machine

    monkeypatch.setattr(environment, "probe", no_bitsandbytes)
    monkeypatch.chdir(tmp_path)
    args = ["tune", "train.py", "--try", "--precision 32-true",
            "--try", "--strategy fsdp", "--try", "--optimizer-8bit", "--against", "slow.py", "--against", "crash.py",
            "--steps", "6", "--threads", "1", "-q"]
    text = CliRunner().invoke(cli, [*args, "--plot", "tune.png"], env={"COLUMNS": "250"})
    assert text.exit_code == 0, text.output
    out = " ".join(text.output.split())
    rows = [line for line in text.output.splitlines() if "│" in line]
    names = [line.split("│")[1].strip() for line in rows]
    assert names[0] == "original", text.output
    timed = [n for n in names[1:] if n in ("--precision 32-true", "slow.py")]
    assert timed[-1] == "slow.py", names
    assert "crash.py: FAIL: the rewrite broke the script: RuntimeError: planted crash" in out
    assert "--strategy fsdp: NOT VERIFIED: needs CUDA" in out
    assert "--optimizer-8bit: NOT VERIFIED: needs bitsandbytes" in out
    assert ("Recommended: --precision" in out) != ("No recommendation" in out)
    assert "Recommended: slow.py" not in out and "Recommended: crash.py" not in out
    assert (tmp_path / "tune.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    # JSON, on a second fixture
    shutil.copy(FIXTURES / "train_function" / "input.py", tmp_path / "other.py")
    done = CliRunner().invoke(cli, ["tune", "other.py", "--try", "--precision 32-true", "--steps", "6",
                                    "--threads", "1", "-q", "--format", "json"])
    assert done.exit_code == 0, done.output
    data = json.loads(done.output)
    assert data["original"]["step_time_s"] > 0 and data["original"]["peak_memory_bytes"] > 0
    [one] = data["candidates"]
    assert one["verdict"] == "pass" and one["speedup"] > 0 and one["mean_rel_diff"] == 0.0, one
    assert one["precision"] == "32-true"
    # train_function's one DataLoader: a step's samples are known
    assert one["samples_per_s"] > 0 and data["original"]["samples_per_s"] > 0


def test_a_bad_try_fails_before_anything_runs(tmp_path):
    (tmp_path / "train.py").write_text("print('never run')\n")
    done = CliRunner().invoke(cli, ["tune", str(tmp_path / "train.py"), "--try", "--precision 99"])
    assert done.exit_code == 2
    assert "--try '--precision 99'" in done.output and "precision" in done.output
    assert "never run" not in done.output
