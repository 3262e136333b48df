"""Test helper for the verifier's tests: run each original script once, not once per option set.

``verify()`` runs the original and then the rewritten script. For one original (same script,
arguments, working folder, steps, threads and CUDA visibility) the original's run is the same
whatever the rewrite options are, so the tests patch ``session.run_script`` with
:meth:`OriginalRuns.run_script`: the first run of an original is real and remembered, later
ones get a copy of it (recorded with the parameters' fingerprints, which only --freeze reads).
The rewritten runs always run.

``slow_unless`` keeps one training test of each kind in the default run (CI) and marks the
others ``slow``.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from accelerate_rewrite.verify import runner


class OriginalRuns:
    def __init__(self) -> None:
        self.cache: dict[tuple, runner.RunRecord] = {}
        self.real_runs = 0

    def run_script(self, script, args=(), *, label, **kwargs) -> runner.RunRecord:
        if label != "original":
            return runner.run_script(script, args, label=label, **kwargs)
        # the parameters' fingerprints (--freeze) are recorded in every original: one record
        # serves every option set, and the freeze tests need no run of their own
        kwargs["track_params"] = True
        env = kwargs.get("env") or {}
        key = (
            str(Path(script).resolve()), tuple(args), kwargs.get("max_steps"), kwargs.get("threads"),
            str(kwargs.get("cwd")), env.get("CUDA_VISIBLE_DEVICES"), kwargs.get("python"),
            kwargs.get("timeout"), kwargs.get("seed"),
        )
        if key not in self.cache:
            self.real_runs += 1
            self.cache[key] = runner.run_script(script, args, label=label, **kwargs)
        return copy.deepcopy(self.cache[key])


def slow_unless(cases, default):
    """``cases`` (names, or tuples of parameters) with every one not in ``default`` marked
    ``slow``: the default run (CI) keeps those, ``pytest -m slow`` runs the rest. A test that
    trains a script both ways starts Pythons that import torch, and lightning with torchmetrics
    and transformers for a rewrite: 15-50 s a test on this project's 2-core box, whose CI has 15
    minutes for everything."""
    return [case if case in default else
            pytest.param(*(case if isinstance(case, tuple) else (case,)), marks=pytest.mark.slow)
            for case in cases]
