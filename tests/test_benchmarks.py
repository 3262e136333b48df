"""benchmarks/redesign_floor.py (issue 30) counts what it says it counts: the statements a
rewrite changed, and a short run of the whole script. Its figures are timings, written to
docs/benchmarks.md; only what it measures is tested here, never how long anything takes."""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"

needs_diff = pytest.mark.skipif(shutil.which("diff") is None, reason="needs diff (GNU diffutils)")


@pytest.fixture()
def floor(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCHMARKS))
    import redesign_floor

    return redesign_floor


SOURCE = '''\
import torch


def train(model, loader, device):
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = model(x).sum()
        if loss > 0: print(loss)
        loss.backward()
'''

OUTPUT = '''\
import torch


def train(model, loader, fabric):
    for x, y in loader:
        loss = model(x).sum()
        if loss > 0: print(loss)
        fabric.backward(loss)
'''


@needs_diff
def test_the_changed_statements_are_the_innermost_ones(floor, tmp_path):
    source, output = tmp_path / "a.py", tmp_path / "b.py"
    source.write_text(SOURCE)
    output.write_text(OUTPUT)
    changed, added = floor.changes(source, output)
    assert changed == {4, 6, 9}
    assert added == ["def train(model, loader, fabric):\n", "        fabric.backward(loss)\n"]
    texts = floor.touched_statements(ast.parse(SOURCE), SOURCE.splitlines(keepends=True), changed)
    # a def's header stands for itself with ``pass``; a line in its body is its own statement
    assert texts == ["def train(model, loader, device):\n    pass\n",
                     "x, y = x.to(device), y.to(device)\n",
                     "loss.backward()\n"]
    assert [m.code for m in floor.parsed_runs(added)] == ["def train(model, loader, fabric):\n    pass\n",
                                                          "fabric.backward(loss)\n"]


def test_a_one_line_block_is_parsed_as_its_line(floor):
    source = "if x: y = 1\n"  # the body's statement is the innermost, and its text is its whole line
    assert floor.touched_statements(ast.parse(source), [source], {1}) == ["if x: y = 1\n"]


@needs_diff
def test_a_short_run_reports_the_floor():
    proc = subprocess.run([sys.executable, str(BENCHMARKS / "redesign_floor.py"), "--lines", "150",
                           "--runs", "1", "--markdown"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "| **the floor (all but the scale rows)** |" in proc.stdout
    assert "LibCST parses of the whole input" in proc.stdout
