"""Issue 48.3: no run outlives its command.

``accelerate-rewrite verify`` (and ``tune``) is started as a user would start it, on a script that
trains slowly (a sleep per step) and starts a helper process of its own; once the script's run is
on, the verifier gets SIGTERM, SIGHUP, SIGINT or, on Linux, SIGKILL. Within a few seconds no
process of the run is left: not the script, not its helper, not the verifier's watcher.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from accelerate_rewrite.verify import runner  # noqa: E402
from accelerate_rewrite.verify.runner import WATCHER_TAG, run_script  # noqa: E402

pytestmark = [
    pytest.mark.runs,
    pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads the process table in /proc"),
]

#: trains for ever (a sleep per step: slow by the sleep, not by the model) and starts a helper in
#: its own process group; both write their pids to pids.txt beside the script
SLOW = """\
import os
import subprocess
import sys
import time

import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset

helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
with open(os.path.join(os.path.dirname(os.path.abspath(__file__)), "pids.txt"), "a") as handle:
    handle.write(f"{os.getpid()}\\n{helper.pid}\\n")

device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
inputs = torch.randn(64, 4)
targets = inputs.sum(dim=1, keepdim=True)
loader = DataLoader(TensorDataset(inputs, targets), batch_size=8)
model = nn.Linear(4, 1).to(device)
criterion = nn.MSELoss()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)

model.train()
for epoch in range(1000):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        optimizer.zero_grad()
        loss = criterion(model(x), y)
        loss.backward()
        optimizer.step()
        time.sleep(0.2)
"""

#: how long a run may take to start (torch's import on a busy machine), and to be gone
START_S = 60
GONE_S = 10


def _gone(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")  # exited, waiting to be reaped


def _watchers(verifier: int) -> list[int]:
    """The watchers the verifier ``verifier`` started (runner.WATCHER), still running."""
    out = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if WATCHER_TAG.encode() in argv and str(verifier).encode() in argv and not _gone(int(entry.name)):
            out.append(int(entry.name))
    return out


def _pids(file: Path, count: int = 2) -> list[int]:
    """The first ``count`` pids written to ``file``: the run is on."""
    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline:
        lines = file.read_text().split() if file.exists() else []
        if len(lines) >= count:
            return [int(p) for p in lines[:count]]
        time.sleep(0.1)
    raise AssertionError(f"the run did not start in {START_S} s")


def _none_left(pids: list[int], verifier: int) -> None:
    deadline = time.monotonic() + GONE_S
    while time.monotonic() < deadline:
        left = [p for p in pids if not _gone(p)] + _watchers(verifier)
        if not left:
            return
        time.sleep(0.1)
    raise AssertionError(f"still running {GONE_S} s after the verifier went: {left}")


def _start(work: Path, command: str, *extra: str) -> subprocess.Popen:
    (work / "slow.py").write_text(SLOW, encoding="utf-8")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    return subprocess.Popen(
        [sys.executable, "-m", "accelerate_rewrite", command, "slow.py", "--steps", "100000", "--run-on", "cpu",
         "--threads", "1", "-q", *extra],
        cwd=work, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        start_new_session=True,  # the signal goes to the verifier alone, never to pytest
        # the signals as a terminal gives them, even where pytest runs in the background or under
        # nohup (SIG_IGN, which the verifier keeps: the caller's choice)
        preexec_fn=lambda: [signal.signal(s, signal.SIG_DFL) for s in (signal.SIGINT, signal.SIGHUP, signal.SIGTERM)],
    )


def _signalled(work: Path, process: subprocess.Popen, sig: int) -> bytes:
    """``sig`` sent to the command once its run is on; what it printed, once it and every process
    of its run are gone (killed afterwards if not, the test failing)."""
    try:
        pids = _pids(work / "pids.txt")  # the original's run: the script and its helper
        process.send_signal(sig)
        out, _ = process.communicate(timeout=30)
        _none_left(pids, process.pid)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return out


SIGNALS = [signal.SIGTERM, signal.SIGHUP, signal.SIGINT, signal.SIGKILL]


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_a_signal_to_verify_ends_its_run(tmp_path, sig):
    verifier = _start(tmp_path, "verify")
    out = _signalled(tmp_path, verifier, sig)
    # the conventional exit status: 128 + the signal's number (SIGKILL: killed by it)
    assert verifier.returncode == (-sig if sig == signal.SIGKILL else 128 + sig), out.decode(errors="replace")


def test_a_signal_to_tune_ends_its_run(tmp_path):
    tuner = _start(tmp_path, "tune", "--try", "--precision 32-true")
    out = _signalled(tmp_path, tuner, signal.SIGTERM)
    assert tuner.returncode == 128 + signal.SIGTERM, out.decode(errors="replace")


def test_an_exception_of_the_verifier_ends_its_run(tmp_path, monkeypatch):
    # an error of the verifier's own while the run is on (here: reading the process tree)
    script = tmp_path / "slow.py"
    script.write_text(SLOW, encoding="utf-8")
    pid_file = tmp_path / "pids.txt"
    real = runner._Descendants.poll

    def poll(self):
        if pid_file.exists() and len(pid_file.read_text().split()) >= 2:
            raise RuntimeError("the verifier's own error")
        real(self)

    monkeypatch.setattr(runner._Descendants, "poll", poll)
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="the verifier's own error"):
        run_script(script, label="original", cwd=tmp_path, threads=1, timeout=START_S)
    pids = [int(p) for p in pid_file.read_text().split()[:2]]
    assert all(_gone(p) for p in pids), [p for p in pids if not _gone(p)]
    assert _watchers(os.getpid()) == []
    assert time.monotonic() - start < START_S


def test_signals_are_given_back_after_a_run(tmp_path):
    # outside a run the caller's handlers are its own again
    script = tmp_path / "quick.py"
    script.write_text(textwrap.dedent("""\
        print("done")
        """), encoding="utf-8")
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT)}
    record = run_script(script, label="original", cwd=tmp_path)
    assert record.exit_code == 0
    assert {s: signal.getsignal(s) for s in before} == before
    assert _watchers(os.getpid()) == []
