"""Issue 18, the verifier: nothing left behind (a child in its own session is ended with the run),
and true reports (the steps a hanging script made, an original that does not train, no second
timeout after the original's)."""

from __future__ import annotations

import math
import os
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
psutil = pytest.importorskip("psutil")

from accelerate_rewrite.verify import session  # noqa: E402
from accelerate_rewrite.verify.compare import Tolerance, compare  # noqa: E402
from accelerate_rewrite.verify.runner import RunRecord, run_script  # noqa: E402
from accelerate_rewrite.verify.session import verify  # noqa: E402
from tests.test_verify import OPTIONS, SMALL, _gone, _nothing, _script, _tiny  # noqa: E402

pytestmark = pytest.mark.runs


@pytest.fixture
def work(tmp_path, monkeypatch) -> Path:
    monkeypatch.chdir(tmp_path)
    return tmp_path


def _sleepers(marker: str) -> list[int]:
    """Processes on the machine whose command line carries ``marker``: the process table."""
    out = []
    for proc in psutil.process_iter(["pid", "cmdline"]):
        try:
            if marker in " ".join(proc.info["cmdline"] or ()) and proc.status() != psutil.STATUS_ZOMBIE:
                out.append(proc.pid)
        except psutil.Error:
            continue
    return out


# ---- 9: no process of a run is left behind -------------------------------------------------------

LEAVES_A_CHILD = """\
import os
import subprocess
import sys

child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)  # {marker}"],
                         start_new_session=True)
with open("child.txt", "w") as handle:
    handle.write(str(child.pid))
{rest}
"""


@pytest.mark.parametrize("how", ["exits", "hangs"])
def test_a_child_in_its_own_session_is_ended_with_the_run(work, how):
    marker = f"orphan-marker-{os.getpid()}-{how}"
    rest = {"exits": "", "hangs": "import time\ntime.sleep(300)\n"}[how]
    script = _script(work, "leaves.py", LEAVES_A_CHILD.format(marker=marker, rest=rest))
    record = run_script(script, label="original", timeout=3 if how == "hangs" else 60, max_steps=3)
    child = int((work / "child.txt").read_text())
    assert _gone(child), f"the child {child} outlived the run"
    assert _sleepers(marker) == []
    assert record.timed_out == (how == "hangs")


def test_a_double_forked_daemon_whose_parent_is_gone_is_found_by_its_marker(work):
    marker = f"daemon-marker-{os.getpid()}"
    script = _script(work, "daemon.py", f"""\
        import os
        import subprocess
        import sys

        # the middle process starts the daemon in its own session and exits at once: the
        # daemon's parent is gone before the verifier can see it in the tree
        subprocess.run([sys.executable, "-c",
            "import subprocess, sys; subprocess.Popen([sys.executable, '-c', "
            "'import time; time.sleep(300)  # {marker}'], start_new_session=True)"])
        """)
    run_script(script, label="original", timeout=60)
    deadline = time.monotonic() + 5
    while _sleepers(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert _sleepers(marker) == []


# ---- 10: true reports ----------------------------------------------------------------------------

def test_a_script_that_hangs_after_three_steps_reports_three_steps(work):
    hangs = _tiny(work, "hangs.py", extra="if step == 2:\n        import time; time.sleep(300)")
    start = time.monotonic()
    v = verify(hangs, OPTIONS, against=_nothing(work), steps=10, timeout=8, **SMALL)
    assert time.monotonic() - start < 40
    assert v.original.timed_out and len(v.original.losses) == 3
    assert v.verdict.exit_code == 2
    assert "timed out after 8 s, after 3 optimizer step(s)" in v.verdict.reason


def test_after_the_original_timed_out_the_rewritten_script_is_not_run(work, monkeypatch):
    started = []
    real = session.run_script

    def counting(script, args=(), *, label, **kwargs):
        started.append(label)
        return real(script, args, label=label, **kwargs)

    monkeypatch.setattr(session, "run_script", counting)
    hangs = _script(work, "hang.py", "import time\ntime.sleep(300)\n")
    start = time.monotonic()
    v = verify(hangs, OPTIONS, against=_tiny(work), steps=3, timeout=3, **SMALL)
    assert started == ["original"]
    assert time.monotonic() - start < 30
    assert v.verdict.exit_code == 2 and "timed out" in v.verdict.reason
    assert any("was not run: the original timed out" in n for n in v.notes)


NAN_AT_STEP_3 = """\
import torch

model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for step in range(10):
    loss = torch.nn.functional.mse_loss(model(x), y)
    if step == 2:
        loss = loss * float("nan")
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
"""


def test_an_original_whose_loss_is_nan_is_an_error_not_a_mismatch(work):
    v = verify(_script(work, "nan.py", NAN_AT_STEP_3), OPTIONS, against=_nothing(work), steps=6, **SMALL)
    assert v.verdict.verdict == "error" and v.verdict.exit_code == 2
    assert v.verdict.reason.startswith("the original itself does not train: its loss is nan at step 3")


def test_a_nan_original_beside_a_rewrite_that_trains():
    original = RunRecord(label="original", losses=[1.0, 0.5, math.nan, math.nan])
    rewritten = RunRecord(label="rewritten", losses=[1.0, 0.5, 0.4, 0.3])
    verdict = compare(original, rewritten, Tolerance())
    assert verdict.exit_code == 2
    assert verdict.reason == ("the original itself does not train: its loss is nan at step 3 (the "
                              "rewritten run's losses stay finite over its 4 steps); there is nothing "
                              "to compare the rewrite with")
    diverging = RunRecord(label="rewritten", losses=[1.0, math.inf, 0.4])
    verdict = compare(RunRecord(label="original", losses=[1.0, 0.9, 0.8]), diverging, Tolerance())
    assert verdict.exit_code == 1 and "rewritten run's loss is inf at step 2" in verdict.reason



# ---- torch's gloo abort at exit is not the script's failure --------------------------------------

#: two "ranks" (RANK/WORLD_SIZE as torchrun sets them) that each train, then die as torch 2.13's gloo
#: worker thread kills a process at exit: SIGABRT during interpreter shutdown, after the atexit hooks
#: ran; {during} aborts rank 1 in its second step instead
ABORTS = """\
import os
import subprocess
import sys

import torch


def abort(report=0):  # (a report: the launcher's lines of it, in place of the message)
    sys.stderr.write("a launcher's report of the abort\\n" * report if report
                     else "terminate called without an active exception\\n")
    sys.stderr.flush()
    os.abort()


class AbortAtExit:
    def __del__(self):  # module globals are cleared at shutdown, after the atexit hooks
        abort({report} if os.environ["RANK"] == "0" else 0)


if "RANK" not in os.environ:
    os.environ.update(RANK="0", WORLD_SIZE="2")
    child = subprocess.Popen([sys.executable, __file__], env={{**os.environ, "RANK": "1"}})
model = torch.nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
x, y = torch.randn(16, 4), torch.randn(16, 1)
for step in range(3):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    if {during} and step == 1 and os.environ["RANK"] == "1":
        abort()
if os.environ["RANK"] == "0":
    child.wait()
at_exit = AbortAtExit()
"""


def test_a_gloo_abort_after_every_process_finished_is_a_note_not_a_failure(work):
    record = run_script(_script(work, "aborts.py", ABORTS.format(during=False, report=0)), label="rewritten",
                        max_steps=10, timeout=120)
    assert record.exit_code == -6 and record.world_size == 2 and len(record.losses) == 3
    assert record.error is None
    assert record.exit_note.startswith("the rewritten run exited with code -6 after every process had "
                                       "finished the script: torch's gloo backend aborted it")


def test_a_gloo_abort_at_exit_is_found_above_a_launchers_long_report(work):
    """torchrun reports a process's abort in about 40 lines of its own (its traceback, then the
    failures' table), after the abort's message: the message is looked for in the whole output,
    not in its last lines only (a verify on 2 processes failed so under load)."""
    record = run_script(_script(work, "aborts.py", ABORTS.format(during=False, report=60)), label="rewritten",
                        max_steps=10, timeout=120)
    assert "terminate called" not in record.output_tail
    assert record.error is None
    assert record.exit_note.startswith("the rewritten run exited with code -6 after every process had ")


def test_an_abort_before_the_script_finished_stays_a_failure(work):
    record = run_script(_script(work, "aborts.py", ABORTS.format(during=True, report=0)), label="rewritten",
                        max_steps=10, timeout=120)
    assert record.exit_note is None
    assert "terminate called without an active exception" in record.error
