"""Issue 29: imports run one way. ``lint-imports`` (import-linter) checks the contracts in
pyproject.toml's [tool.importlinter]: the layers (cli > runner | verify > cache > prepare | report >
settings | launch > config | api > rules > codemod > options), codemod/ importing no rule, runner,
cache or command line, the rewrite path importing neither the verifier nor torch, and no import
circle among the modules of a package. A back-arrow or a circle fails here with the contract's
name."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _lint(cwd: Path) -> subprocess.CompletedProcess:
    tool = Path(sys.executable).parent / "lint-imports"
    # CI holds the contracts: a set-up without import-linter fails here rather than skip them
    assert tool.exists(), "lint-imports is missing: pip install -c constraints.txt -e '.[verify,test]'"
    return subprocess.run([str(tool), "--no-cache"], cwd=cwd, capture_output=True, text=True, timeout=300,
                          env={"PYTHONPATH": str(cwd), "PATH": str(tool.parent)})


def test_the_import_contracts_hold():
    done = _lint(ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "4 kept, 0 broken" in done.stdout


def test_a_back_arrow_or_a_circle_breaks_a_contract(tmp_path):
    """The check is real: the engine importing the rules registry (the back-arrow issue 29
    removed) breaks the engine's contract, the layers and the circle check."""
    shutil.copytree(ROOT / "accelerate_rewrite", tmp_path / "accelerate_rewrite",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    result = tmp_path / "accelerate_rewrite" / "codemod" / "result.py"
    result.write_text(result.read_text() + "\nfrom accelerate_rewrite.rules import BY_CODE  # noqa: E402,F401\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    out = " ".join(done.stdout.split())
    assert "The engine (codemod/) knows no rule" in out and "BROKEN" in out
    assert "accelerate_rewrite.codemod.result -> accelerate_rewrite.rules" in out
