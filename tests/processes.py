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

import subprocess

from accelerate_rewrite.verify.runner import GLOO_EXIT_ABORT

ATTEMPTS = 3


def run(cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run(cmd, capture_output=True, text=True, **kwargs)``, again on gloo's exit abort."""
    for _ in range(ATTEMPTS):
        done = subprocess.run(cmd, capture_output=True, text=True, **kwargs)
        if done.returncode == 0 or GLOO_EXIT_ABORT not in done.stderr + done.stdout:
            break
    return done
