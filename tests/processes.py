"""Running a script of several gloo processes in the tests.

torch 2.13's gloo backend aborts about one 2-process CPU run in ten as it exits: a worker thread
("pt_gloo_runloop") frees the last collective's tensors after the script has finished, needs the
GIL, finds the interpreter shutting down, and ``std::terminate`` kills the process (SIGABRT, and
stdout still in its buffer is lost). It happens with plain ``torch.distributed`` and no Fabric, with
or without ``destroy_process_group()`` (measured: /tmp scripts of ``init_process_group("gloo")`` and
one ``all_reduce``, 2-6 runs in 30). It is not the rewrite's doing, so a run that dies of it, and only
of it, is run again; any other failure, or the same one three times, stands.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

from accelerate_rewrite.verify.runner import GLOO_EXIT_ABORT

ATTEMPTS = 3


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, again on gloo's exit abort,
    each time from the folder ``cwd`` as it was before the first: the aborted run has written its
    files already (a log opened for appending, a snapshot a second run would resume from)."""
    cwd = kwargs.get("cwd")
    saved = None
    for attempt in range(ATTEMPTS):
        if attempt and saved is not None:
            _restore(Path(cwd), saved)
        elif cwd is not None:
            saved = Path(tempfile.mkdtemp(prefix="before-run-"))
            shutil.copytree(cwd, saved / "tree")
        done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if done.returncode == 0 or GLOO_EXIT_ABORT not in done.stderr + done.stdout:
            break
    if saved is not None:
        shutil.rmtree(saved, ignore_errors=True)
    return done


def _restore(folder: Path, saved: Path) -> None:
    """``folder`` as it was saved: what a run wrote there goes."""
    for entry in folder.iterdir():
        if entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry)
        else:
            entry.unlink()
    shutil.copytree(saved / "tree", folder, dirs_exist_ok=True)


def free_port() -> str:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return str(s.getsockname()[1])


def torchrun(script: str, nproc: int = 2) -> list[str]:
    """The command that starts ``script`` on ``nproc`` processes with torchrun, on a free port."""
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_port",
            free_port(), script]


def run_ranks(cmd: list[str], cwd: Path) -> subprocess.CompletedProcess:
    """``run`` in a clean environment for several processes: one thread each, no place inherited
    from a launcher (RANK, LOCAL_RANK, ...), a free MASTER_PORT."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "MASTER_PORT": free_port()}
    for name in ("LT_DEVICES", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        env.pop(name, None)
    return run(cmd, cwd=cwd, env=env, timeout=300)
