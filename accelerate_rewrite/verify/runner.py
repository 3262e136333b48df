"""Runs one training script as a subprocess under the harness, and reads what it recorded.

The script runs as ``PYTHON script.py args`` in its own process group (so that DDP workers go
with it), with a timeout; on a timeout or Ctrl-C the whole group is killed. Processes that leave
the group (``start_new_session=True``, a daemon's double fork) are ended too: the run's
descendants are tracked while it runs (psutil's process tree), and every process that inherited
the run's marker (``ACCELERATE_REWRITE_VERIFY_RUN`` in its environment) is found at the end,
even one whose parent is gone. Nothing of a run is left behind when ``run_script`` returns.
What every process recorded is merged: per optimizer step, the loss averaged over the ranks.

Nor when the verifier itself is stopped (issue 48): while a run is on (``ending_runs_on_signals``),
SIGTERM and SIGHUP end it as Ctrl-C does (the whole group, then what left it), and the verifier
exits with 128 + the signal's number; so does any exception of the verifier's own. Where the
verifier can't clean up (SIGKILL, the OOM killer), two things end the run without it:

- on Linux, the script's process dies with it: the boot code (boot/sitecustomize.py) of the
  process the verifier started asks the kernel for SIGKILL when its parent goes
  (``prctl(PR_SET_PDEATHSIG)``);
- everywhere, a watcher (a small Python process of the standard library alone, in a session of
  its own, ``WATCHER``) polls the verifier's pid; when its parent changes it kills the run's
  process group, and on Linux every process that carries the run's marker (``/proc/PID/environ``).
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, Optional, Sequence, Union

from accelerate_rewrite.verify.harness import CONFIG_ENV

BOOT_DIR = Path(__file__).resolve().parent / "boot"
TAIL_LINES = 15
#: set in the environment of a run to a value of its own: whatever inherits it belongs to the run
RUN_MARKER_ENV = "ACCELERATE_REWRITE_VERIFY_RUN"
#: set in the environment of a run to the verifier's pid: the process it starts asks to die with it
PARENT_ENV = "ACCELERATE_REWRITE_VERIFY_PARENT"
#: how often the run's process tree is read while it runs
POLL_S = 0.2
#: the signals that end the runs as Ctrl-C does (SIGINT raises KeyboardInterrupt, which does already)
ENDING_SIGNALS = tuple(getattr(signal, name) for name in ("SIGTERM", "SIGHUP") if hasattr(signal, name))
#: the watcher of one run: ``python -I -S -c WATCHER WATCHER_TAG <verifier pid> <run's pgid> <marker>``;
#: standard library only, so that it starts in milliseconds and needs nothing installed
WATCHER_TAG = "accelerate-rewrite-verify-watcher"
WATCHER = r"""
import os, signal, sys, time
parent, group, marker = int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
for name in ("SIGINT", "SIGHUP", "SIGTERM"):
    signal.signal(getattr(signal, name), signal.SIG_DFL)
while os.getppid() == parent:
    time.sleep(0.2)
needle = ("\0ACCELERATE_REWRITE_VERIFY_RUN=" + marker + "\0").encode()
for _ in range(2):  # again, for a process forked as the first went
    try:
        os.killpg(group, signal.SIGKILL)
    except OSError:
        pass
    try:
        pids = [int(p) for p in os.listdir("/proc") if p.isdigit() and int(p) != os.getpid()]
    except OSError:  # no /proc (macOS): the group is all there is to end
        pids = []
    for pid in pids:
        try:
            with open("/proc/%d/environ" % pid, "rb") as handle:
                if needle in b"\0" + handle.read():
                    os.kill(pid, signal.SIGKILL)
        except OSError:
            continue
    time.sleep(0.1)
"""
#: what torch's gloo backend prints as it aborts a process at exit: a worker thread ("pt_gloo_runloop")
#: frees the last collective's tensors, needs the GIL, finds the interpreter shutting down, and
#: std::terminate follows (torch 2.13, CPU; about 1 run in 10 of 2 processes, with or without
#: Fabric, with or without destroy_process_group())
GLOO_EXIT_ABORT = "terminate called without an active exception"


@dataclass
class RunRecord:
    """One run of one script, as recorded."""

    label: str
    exit_code: Optional[int] = None
    timed_out: bool = False
    error: Optional[str] = None  # why it did not finish: a traceback's tail, a timeout
    losses: list[Optional[float]] = field(default_factory=list)  # per step of the first optimizer
    grad_norms: list[Optional[float]] = field(default_factory=list)  # the gradient each step applied
    skipped_steps: list[int] = field(default_factory=list)  # steps a GradScaler skipped (1-based)
    #: per step, the gradient norm a clip measured before it clipped (None: no clip)
    clip_norms: list[Optional[float]] = field(default_factory=list)
    #: steps whose optimizer had parameters but not one gradient when it stepped (1-based)
    no_grad_steps: list[int] = field(default_factory=list)
    other_losses: list[list[Optional[float]]] = field(default_factory=list)  # further optimizers
    step_times_s: list[float] = field(default_factory=list)
    peak_memory_bytes: int = 0
    memory_kind: str = ""
    device: Optional[str] = None
    param_dtype: Optional[str] = None
    autocast: list[list] = field(default_factory=list)
    #: [device_type, dtype] of the autocast in force inside the training forwards ([None, "float32"]: none)
    forward_autocast: list[list] = field(default_factory=list)
    grad_scaler: list[list] = field(default_factory=list)
    fabric: bool = False  # lightning's Fabric was imported (it ran the precision, if one ran)
    world_size: int = 1
    backward_calls: int = 0
    stopped_after_max_steps: bool = False
    output_tail: str = ""
    #: every rank's process reached its exit hook (the script itself had finished)
    all_ranks_exited: bool = False
    #: the run's output holds torch's gloo abort at exit (``GLOO_EXIT_ABORT``)
    gloo_exit_abort: bool = False
    #: why a non-zero exit code was not taken for a failure (a process aborted after finishing)
    exit_note: Optional[str] = None
    #: per step, the half dtypes found in the autograd graph of its losses (None: not traced)
    step_half_dtypes: Optional[list[list[str]]] = None
    distributed_samplers: list[list] = field(default_factory=list)  # [num_replicas, shuffle]
    batch_sizes: list[int] = field(default_factory=list)  # of every DataLoader the run iterated
    #: parameter name -> fingerprint, before the first step and at the end (None: not tracked)
    params_start: Optional[dict[str, str]] = None
    params_end: Optional[dict[str, str]] = None
    #: where the runs part (harness ``_Where``): the first optimizer's groups and top-level modules
    where: Optional[dict] = None
    #: several processes (harness_shards.py): each rank's passes of its samplers, their batches'
    #: sample indices ({"length": len(dataset), "batches": [[i, ...], ...]}); None: not recorded
    sampled: Optional[list[list[dict]]] = None
    batch_norm_trained: bool = False  # a BatchNorm normalised a training batch (each rank its own)
    replay_problem: Optional[str] = None  # why the union's batches were not all drawn

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def traced(self) -> bool:
        """Whether the training steps' graphs were read for half dtypes."""
        return self.step_half_dtypes is not None and len(self.step_half_dtypes) > 0

    @property
    def untraced_steps(self) -> list[int]:
        """The steps (1-based) whose losses came from a graph with no half dtype in it."""
        return [i + 1 for i, found in enumerate(self.step_half_dtypes or []) if not found]

    @property
    def precision(self) -> str:
        """The precision that really ran, in Fabric's words. Where the training steps were
        traced, the evidence is theirs (an autocast in the evaluation loop does not count)."""
        dtype = self.param_dtype or "float32"
        true = {"float32": "32-true", "float64": "64-true", "float16": "16-true", "bfloat16": "bf16-true"}
        if dtype != "float32":
            return true.get(dtype, dtype)
        scaler = any(on for _, on in self.grad_scaler)
        if self.traced:
            found = {t for step in self.step_half_dtypes or [] for t in step}
            if not found:
                return "32-true"
            if "float16" in found:
                return "16-mixed" if scaler else "16-mixed (no GradScaler)"
            return "bf16-mixed"
        enabled = {(d, t) for d, t, on in self.autocast if on}
        if any(t == "float16" for _, t in enabled):
            return "16-mixed" if scaler else "16-mixed (no GradScaler)"
        if any(t == "bfloat16" for _, t in enabled):
            return "bf16-mixed"
        return "32-true"

    @property
    def computed_in(self) -> str:
        """What the training forwards computed in, read inside them: "bfloat16 (cpu autocast)",
        or the weights' dtype where no autocast was in force ("-": not read)."""
        if not self.forward_autocast:
            return "-"
        half = [f"{dtype} ({device} autocast)" for device, dtype in self.forward_autocast if device is not None]
        return ", ".join(half) if half else (self.param_dtype or "float32")

    @property
    def precision_notes(self) -> list[str]:
        """Autocast that asked for something and got nothing (autocast("cuda") without CUDA)."""
        notes = []
        enabled_devices = {d for d, _, on in self.autocast if on}
        for device, dtype, on in self.autocast:
            if not on and device not in enabled_devices:
                notes.append(f"autocast({device!r}, {dtype}) ran disabled")
        for device, on in self.grad_scaler:
            if not on:
                notes.append(f"GradScaler({device!r}) ran disabled")
        return notes

    def to_json(self) -> dict:
        from statistics import median

        return {
            "losses": self.losses,
            "grad_norms": self.grad_norms,
            "skipped_steps": self.skipped_steps,
            "no_grad_steps": self.no_grad_steps,
            "clip_norms": self.clip_norms,
            "other_optimizers_losses": self.other_losses,
            "step_times_s": self.step_times_s,
            "median_step_time_s": median(self.step_times_s) if self.step_times_s else None,
            "peak_memory_bytes": self.peak_memory_bytes,
            "memory_kind": self.memory_kind,
            "device": self.device,
            "precision": self.precision,
            "precision_notes": self.precision_notes,
            "computed_in": self.computed_in,
            "world_size": self.world_size,
            "half_dtypes_per_step": self.step_half_dtypes,
            "distributed_samplers": self.distributed_samplers,
            "exit_code": self.exit_code,
            "error": self.error,
            "exit_note": self.exit_note,
        }


def _kill_group(process: subprocess.Popen) -> None:
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except (ProcessLookupError, PermissionError):
            return
        try:
            process.wait(timeout=5)
        except subprocess.TimeoutExpired:
            continue
        if sig is signal.SIGTERM:
            # the leader is gone; give the rest of the group a moment, then make sure
            time.sleep(0.2)


_raised: list[int] = []  # the signal that is ending the runs (once: a second one waits for the first)


def _on_ending_signal(signum, frame) -> None:
    if _raised:
        return
    _raised.append(signum)
    raise SystemExit(128 + signum)


@contextmanager
def ending_runs_on_signals() -> Iterator[None]:
    """While inside: SIGTERM and SIGHUP raise ``SystemExit(128 + signum)`` in the main thread,
    so that the run going on is ended as on Ctrl-C (``run_script`` ends its process group and
    what left it on any exception) and ``finally`` blocks run (the rewritten file is removed).
    A handler of the caller's own, or SIG_IGN (``nohup``), stays; nested uses are one; outside
    the main thread nothing is installed (Python allows handlers only there)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    installed = {}
    for sig in ENDING_SIGNALS:
        try:
            if signal.getsignal(sig) == signal.SIG_DFL:
                installed[sig] = signal.signal(sig, _on_ending_signal)
        except (OSError, ValueError):
            continue
    try:
        yield
    finally:
        for sig, previous in installed.items():
            signal.signal(sig, previous)
        if installed:
            _raised.clear()


@contextmanager
def _shielded() -> Iterator[None]:
    """Ending a run is not cut short: SIGINT, SIGTERM and SIGHUP are held off while it goes on
    (seconds at most: ``_kill_group`` and ``_Descendants.end`` wait 16 s in all, at worst)."""
    held = {}
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGINT, *ENDING_SIGNALS):
            try:
                previous = signal.getsignal(sig)
                if previous not in (signal.SIG_IGN, None):
                    held[sig] = signal.signal(sig, lambda signum, frame: None)
            except (OSError, ValueError):
                continue
    try:
        yield
    finally:
        for sig, previous in held.items():
            signal.signal(sig, previous)


def _start_watcher(pgid: int, marker: str) -> Optional[subprocess.Popen]:
    """The watcher of a run (``WATCHER``): it ends the run if this process dies without doing so."""
    try:
        return subprocess.Popen(
            [sys.executable, "-I", "-S", "-c", WATCHER, WATCHER_TAG, str(os.getpid()), str(pgid), marker],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            start_new_session=True,  # a kill of the verifier's own group leaves it to do its work
        )
    except OSError:
        return None


def _stop_watcher(watcher: Optional[subprocess.Popen]) -> None:
    if watcher is None:
        return
    try:
        watcher.kill()
        watcher.wait(timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        pass


def _group_alive(pgid: int) -> bool:
    try:
        os.killpg(pgid, 0)
        return True
    except (ProcessLookupError, PermissionError):
        return False


class _Descendants:
    """Every process of one run, whatever group or session it moved to (psutil; without it,
    the process group alone)."""

    def __init__(self, root: int, marker: str) -> None:
        self.marker = marker
        self.seen: dict[int, object] = {}  # pid -> psutil.Process (its start time guards pid reuse)
        try:
            import psutil
        except ImportError:  # the verify extra brings it; without it, the group is all we end
            self.psutil = None
            return
        self.psutil = psutil
        try:
            self.root = psutil.Process(root)
        except psutil.Error:
            self.root = None

    def poll(self) -> None:
        if self.psutil is None or self.root is None:
            return
        try:
            for child in self.root.children(recursive=True):
                self.seen.setdefault(child.pid, child)
        except self.psutil.Error:
            pass

    def _marked(self) -> list:
        """Processes that inherited the run's marker, even those whose parent is gone."""
        psutil, out = self.psutil, []
        me = os.getpid()
        for proc in psutil.process_iter():
            if proc.pid == me:
                continue
            try:
                if proc.environ().get(RUN_MARKER_ENV) == self.marker:
                    out.append(proc)
            except (psutil.Error, OSError):
                continue
        return out

    def alive(self) -> list:
        if self.psutil is None:
            return []
        self.poll()
        for proc in self._marked():
            self.seen.setdefault(proc.pid, proc)
        out = []
        for proc in self.seen.values():
            try:
                if proc.is_running() and proc.status() != self.psutil.STATUS_ZOMBIE:
                    out.append(proc)
            except self.psutil.Error:
                continue
        return out

    def end(self) -> None:
        """SIGTERM, a moment's grace, then SIGKILL for whatever of the run is still alive."""
        if self.psutil is None:
            return
        left = self.alive()
        for proc in left:
            try:
                proc.terminate()
            except self.psutil.Error:
                pass
        _, left = self.psutil.wait_procs(left, timeout=3)
        for proc in left:
            try:
                proc.kill()
            except self.psutil.Error:
                pass
        self.psutil.wait_procs(left, timeout=3)


def _tail(text: str, lines: int = TAIL_LINES) -> str:
    return "\n".join(text.rstrip().splitlines()[-lines:])


@ending_runs_on_signals()  # SIGTERM, SIGHUP: the run ends as on Ctrl-C
def run_script(
    script: Path,
    args: Sequence[str] = (),
    *,
    label: str,
    max_steps: Optional[int] = None,
    cwd: Optional[Path] = None,
    env: Optional[dict[str, str]] = None,
    timeout: float = 600.0,
    python: str = sys.executable,
    threads: Optional[int] = None,
    seed: int = 0,
    trace_precision: Union[bool, str] = False,  # or the half dtype asked for
    track_params: bool = False,
    force_fp32: bool = False,  # every autocast and GradScaler off (the structure run)
    autocast_forward: Optional[str] = None,  # "bfloat16": the noise run (see harness.Recorder)
    launcher: Sequence[str] = (),  # ``python -m torch.distributed.run --nproc_per_node N ...``
    record_batches: Optional[int] = None,  # the sample indices of this many batches a pass, per process
    replay: Optional[Path] = None,  # the union of the processes' batches, drawn instead (harness_shards.py)
    reseed: Optional[int] = None,  # torch, random and numpy seeded again after the first step
) -> RunRecord:
    """Run ``python script args`` (or ``launcher script args``) under the harness and return
    what it recorded: each process the launcher starts loads the harness as the script's own
    processes do (their records are merged by rank; the launcher's own, which trains nothing,
    is the one of rank 0 that made no step)."""
    record = RunRecord(label=label)
    out_dir = Path(tempfile.mkdtemp(prefix="accelerate-rewrite-verify-"))
    try:
        config = {"out_dir": str(out_dir), "max_steps": max_steps, "seed": seed, "threads": threads,
                  "trace_precision": trace_precision, "track_params": track_params, "force_fp32": force_fp32,
                  "autocast_forward": autocast_forward, "record_batches": record_batches,
                  "replay": str(replay) if replay is not None else None, "reseed": reseed}
        run_env = dict(os.environ if env is None else env)
        run_env[CONFIG_ENV] = json.dumps(config)
        run_env["PYTHONPATH"] = os.pathsep.join(
            [str(BOOT_DIR), *filter(None, [run_env.get("PYTHONPATH")])]
        )
        run_env.setdefault("PYTHONHASHSEED", "0")
        marker = run_env[RUN_MARKER_ENV] = uuid.uuid4().hex
        run_env[PARENT_ENV] = str(os.getpid())
        log = out_dir / "output.log"
        with open(log, "wb") as handle:
            process = subprocess.Popen(
                [*(launcher or [python]), str(script), *args], cwd=cwd, env=run_env,
                stdin=subprocess.DEVNULL, stdout=handle, stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            watcher = family = None
            try:
                watcher = _start_watcher(process.pid, marker)
                family = _Descendants(process.pid, marker)
                try:
                    deadline = time.monotonic() + timeout
                    while True:
                        family.poll()
                        try:
                            record.exit_code = process.wait(
                                timeout=max(0.0, min(POLL_S, deadline - time.monotonic())))
                            break
                        except subprocess.TimeoutExpired:
                            if time.monotonic() >= deadline:
                                raise
                except subprocess.TimeoutExpired:
                    record.timed_out = True
                    family.poll()
                    _kill_group(process)
                    record.exit_code = process.returncode
                # DDP workers finish their own last step a moment after rank 0
                deadline = time.monotonic() + 30
                while _group_alive(process.pid) and time.monotonic() < deadline:
                    family.poll()
                    time.sleep(0.1)
                if _group_alive(process.pid):
                    _kill_group(process)
                family.end()  # what left the group: a child in its own session, a daemon
            except BaseException:  # Ctrl-C, SIGTERM, SIGHUP, an error of ours: nothing of the run stays
                with _shielded():
                    for end in (family and family.poll, lambda: _kill_group(process), family and family.end):
                        try:
                            if end is not None:
                                end()
                        except Exception:  # one step failing leaves the next to do its part
                            pass
                raise
            finally:
                _stop_watcher(watcher)
        logged = log.read_text(errors="replace")
        record.output_tail = _tail(logged, 40)
        # (anywhere in the log: torchrun's own report of the abort, 40 lines, comes after it)
        record.gloo_exit_abort = GLOO_EXIT_ABORT in logged
        _merge(record, out_dir)
        if record.timed_out:
            made = f", after {len(record.losses)} optimizer step(s)" if record.losses else \
                ", before its first optimizer step"
            record.error = f"timed out after {timeout:g} s{made}"
        elif record.exit_code != 0 and _aborted_after_finishing(record):
            record.exit_note = (f"the {label} run exited with code {record.exit_code} after every process had "
                                f"finished the script: torch's gloo backend aborted it as it shut down "
                                f"('{GLOO_EXIT_ABORT}'), which is not the script's doing")
            record.error = None
        elif record.exit_code != 0:
            record.error = _tail(record.error or record.output_tail) or f"exit code {record.exit_code}"
        else:
            record.error = None
        return record
    finally:
        shutil.rmtree(out_dir, ignore_errors=True)


def torchrun(python: str, processes: int) -> list[str]:
    """torch's launcher for ``processes`` processes on this machine, on a free port: what starts
    an Accelerate rewrite's processes (``Accelerator()`` reads their ranks from its environment)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    return [python, "-m", "torch.distributed.run", "--nproc_per_node", str(processes), "--master_port", str(port)]


def _aborted_after_finishing(record: RunRecord) -> bool:
    """A run of several processes, each of which finished the script without an error, that died
    of torch's gloo abort at exit (see ``GLOO_EXIT_ABORT``)."""
    return record.world_size > 1 and record.all_ranks_exited and record.gloo_exit_abort


def _merge(record: RunRecord, out_dir: Path) -> None:
    """One record per rank (the process that trained most), losses averaged over ranks."""
    per_rank: dict[int, dict] = {}
    for path in out_dir.glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not data.get("torch_imported"):
            continue
        best = per_rank.get(data["rank"])
        if best is None or (len(data["steps"]), data["backward_calls"]) > (len(best["steps"]), best["backward_calls"]):
            per_rank[data["rank"]] = data
    if not per_rank:
        return
    ranks = [per_rank[r] for r in sorted(per_rank)]
    main = ranks[0]
    record.world_size = len(ranks)
    record.error = main["error"]
    record.all_ranks_exited = (all(r.get("exited") and not r["error"] for r in ranks)
                               and all(r.get("world_size") == len(ranks) for r in ranks))
    steps = min(len(r["steps"]) for r in ranks)
    record.losses = [_mean([r["steps"][i]["loss"] for r in ranks]) for i in range(steps)]
    record.grad_norms = [_mean([r["steps"][i].get("grad_norm") for r in ranks]) for i in range(steps)]
    record.skipped_steps = [i + 1 for i in range(steps) if main["steps"][i].get("skipped")]
    record.clip_norms = [_mean([r["steps"][i].get("clip_norm") for r in ranks]) for i in range(steps)]
    record.no_grad_steps = [i + 1 for i in range(steps) if all(r["steps"][i].get("no_grad") for r in ranks)]
    record.step_times_s = [max(r["steps"][i]["time_s"] for r in ranks) for i in range(steps)]
    record.other_losses = main["other_optimizers"]
    record.peak_memory_bytes = max(r["peak_memory_bytes"] for r in ranks)
    record.memory_kind = main["memory_kind"]
    record.device = main["device"]
    record.param_dtype = main["param_dtype"]
    record.autocast = main["autocast"]
    record.forward_autocast = main.get("forward_autocast", [])
    record.grad_scaler = main["grad_scaler"]
    record.fabric = bool(main.get("fabric"))
    record.backward_calls = sum(r["backward_calls"] for r in ranks)
    record.stopped_after_max_steps = all(r["stopped_after_max_steps"] for r in ranks)
    if any("half" in step for step in main["steps"][:steps]):
        # a step shows a half dtype where every rank's graph had one
        per_step = [[set(r["steps"][i].get("half", ())) for r in ranks] for i in range(steps)]
        record.step_half_dtypes = [sorted(set.union(*found)) if all(found) else [] for found in per_step]
    record.distributed_samplers = main.get("distributed_samplers") or []
    record.batch_sizes = main.get("batch_sizes") or []
    record.params_start, record.params_end = main.get("params_start"), main.get("params_end")
    record.where = main.get("where")
    if all(r.get("sampled") is not None for r in ranks):
        record.sampled = [r["sampled"] for r in ranks]
    record.batch_norm_trained = any(r.get("batch_norm_trained") for r in ranks)
    record.replay_problem = main.get("replay_problem")


def _mean(values: list[Optional[float]]) -> Optional[float]:
    present = [v for v in values if v is not None]
    return sum(present) / len(present) if present else None
