"""Run a training script in this process and record the losses it trains on.

    python -m accelerate_rewrite.verify.harness --out OUT.json SCRIPT [-- ARGS...]

Every scalar tensor that backward is called on (``loss.backward()``,
``torch.autograd.backward(loss)``, ``fabric.backward(loss)``, a GradScaler's
scaled loss, ...) is recorded in call order, and every optimizer step is
counted. The JSON written to OUT.json looks like::

    {"losses": [...], "optimizer_steps": N, "backward_calls": M,
     "torch_version": "...", "error": null or "Traceback ..."}

``backward_calls`` also counts backward on non-scalar tensors (which record no
loss). The harness exits with the script's exit code (1 if it raised).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import runpy
import sys
import threading
import traceback

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook

USAGE = "%(prog)s --out OUT.json SCRIPT [-- ARGS...]"


class Recorder:
    """Wraps torch's backward entry points and counts optimizer steps."""

    def __init__(self) -> None:
        self.losses: list[float] = []
        self.backward_calls = 0
        self.optimizer_steps = 0
        # Tensor.backward calls torch.autograd.backward: record only the outermost call.
        self._inside = threading.local()

    def _record(self, tensors) -> None:
        if isinstance(tensors, torch.Tensor):
            tensors = [tensors]
        self.backward_calls += 1
        for t in tensors:
            if isinstance(t, torch.Tensor) and t.numel() == 1:
                self.losses.append(float(t.detach().float().item()))

    def _wrap(self, fn):
        @functools.wraps(fn)
        def wrapper(tensors, *args, **kwargs):
            if getattr(self._inside, "active", False):
                return fn(tensors, *args, **kwargs)
            self._record(tensors)
            self._inside.active = True
            try:
                return fn(tensors, *args, **kwargs)
            finally:
                self._inside.active = False

        return wrapper

    def install(self) -> None:
        torch.Tensor.backward = self._wrap(torch.Tensor.backward)
        torch.autograd.backward = self._wrap(torch.autograd.backward)
        register_optimizer_step_post_hook(self._on_step)

    def _on_step(self, optimizer, args, kwargs) -> None:
        self.optimizer_steps += 1


def _exit_code(exc: SystemExit) -> int:
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code
    print(exc.code, file=sys.stderr)  # SystemExit("message") behaves like python does
    return 1


def run(script: str, script_args: list[str], out: str) -> int:
    threads = os.environ.get("ACCELERATE_REWRITE_THREADS", "")
    if threads.isdigit() and int(threads) > 0:
        torch.set_num_threads(int(threads))

    recorder = Recorder()
    recorder.install()
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))

    code, error = 0, None
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = _exit_code(exc)
        if code != 0:
            error = traceback.format_exc()
    except BaseException:
        code, error = 1, traceback.format_exc()
        traceback.print_exc()

    sys.stdout.flush()
    result = {
        "losses": recorder.losses,
        "optimizer_steps": recorder.optimizer_steps,
        "backward_calls": recorder.backward_calls,
        "torch_version": torch.__version__,
        "error": error,
    }
    with open(out, "w") as f:
        json.dump(result, f, indent=1)
    return code


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args: list[str] = []
    if "--" in argv:  # everything after the first "--" belongs to the script
        cut = argv.index("--")
        argv, script_args = argv[:cut], argv[cut + 1 :]
    parser = argparse.ArgumentParser(prog="python -m accelerate_rewrite.verify.harness", usage=USAGE)
    parser.add_argument("--out", required=True, help="where to write the JSON record")
    parser.add_argument("script", help="the training script to run")
    args = parser.parse_args(argv)
    # Resolve now: the script may chdir.
    return run(args.script, script_args, os.path.abspath(args.out))


if __name__ == "__main__":
    sys.exit(main())
