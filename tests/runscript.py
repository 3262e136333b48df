"""Test helper: run a script under the loss-recording harness in a subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path


def run_script(path: Path, cwd: Path, args=(), timeout=120) -> dict:
    """Run ``path`` (with ``args``) in ``cwd`` under accelerate_rewrite.verify.harness.

    Returns the harness's JSON record (losses, optimizer_steps, ...). Raises
    AssertionError, with the script's stdout and stderr, if it exits non-zero
    or times out.
    """
    env = dict(os.environ, ACCELERATE_REWRITE_THREADS="1", PYTHONHASHSEED="0")
    with tempfile.TemporaryDirectory(prefix="harness-") as tmp:
        out = Path(tmp) / "record.json"
        cmd = [
            sys.executable, "-m", "accelerate_rewrite.verify.harness",
            "--out", str(out), str(Path(path).resolve()), "--", *map(str, args),
        ]
        try:
            proc = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            stdout, stderr = (_text(exc.stdout), _text(exc.stderr))
            raise AssertionError(
                f"{path} timed out after {timeout}s\n--- stdout ---\n{stdout}\n--- stderr ---\n{stderr}"
            ) from None
        if proc.returncode != 0:
            raise AssertionError(
                f"{path} exited with {proc.returncode}\n"
                f"--- stdout ---\n{proc.stdout}\n--- stderr ---\n{proc.stderr}"
            )
        return json.loads(out.read_text())


def _text(output) -> str:
    # TimeoutExpired carries bytes even when the run was in text mode.
    if isinstance(output, bytes):
        return output.decode(errors="replace")
    return output or ""
