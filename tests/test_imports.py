"""Issue 29: imports run one way. ``lint-imports`` (import-linter) checks the contracts in
pyproject.toml's [tool.importlinter]: the layers (cli > runner | verify > cache > prepare | report >
settings | launch > config | api > rules > codemod > options), codemod/ importing no rule, runner,
cache or command line, the rewrite path importing neither the verifier nor torch, and no import
circle among the modules of a package. A back-arrow or a circle fails here with the contract's
name. Issue 49: the engine's rooms (codemod/'s sub-packages) one way down, and no circle in the
whole package's import graph even counting the imports made only for type annotations."""

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
    assert "6 kept, 0 broken" in done.stdout


def _lint_with(tmp_path: Path, module: str, line: str) -> str:
    """lint-imports over a copy of the package whose ``module`` (a path under it) gains ``line``;
    it must fail: its output, on one line."""
    shutil.copytree(ROOT / "accelerate_rewrite", tmp_path / "accelerate_rewrite",
                    ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy(ROOT / "pyproject.toml", tmp_path / "pyproject.toml")
    path = tmp_path / "accelerate_rewrite" / module
    path.write_text(path.read_text() + f"\n{line}  # noqa: E402,F401\n")
    done = _lint(tmp_path)
    assert done.returncode != 0
    return " ".join(done.stdout.split())


def test_a_back_arrow_or_a_circle_breaks_a_contract(tmp_path):
    """The check is real: the engine importing the rules registry (the back-arrow issue 29
    removed) breaks the engine's contract, the layers and the circle check."""
    out = _lint_with(tmp_path, "codemod/result.py", "from accelerate_rewrite.rules import BY_CODE")
    assert "The engine (codemod/) knows no rule" in out and "BROKEN" in out
    assert "accelerate_rewrite.codemod.result -> accelerate_rewrite.rules" in out


def test_a_rule_room_importing_up_breaks_its_contract(tmp_path):
    """Issue 62: rules/ is rooms, one way down. The base every rule shares importing the Fabric
    plan breaks the rules' rooms."""
    out = _lint_with(tmp_path, "rules/base/calls.py", "from accelerate_rewrite.rules.fabric._plan import plan")
    assert "The rules' rooms" in out and "BROKEN" in out
    assert "accelerate_rewrite.rules.base.calls -> accelerate_rewrite.rules.fabric._plan" in out


def test_rules_has_at_most_twelve_entries_at_its_top():
    top = [p.name for p in (ROOT / "accelerate_rewrite" / "rules").iterdir() if p.name != "__pycache__"]
    assert len(top) <= 12, sorted(top)


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            part = []
            while True:
                w = stack.pop()
                on.discard(w)
                part.append(w)
                if w == v:
                    break
            if len(part) > 1:
                out.append(sorted(part))

    for v in list(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_circle_even_counting_imports_for_type_annotations():
    """grimp's graph with the imports under ``if TYPE_CHECKING:`` and those inside functions:
    where a helper needs its host's type it takes a Protocol (codemod/analysis/view.py,
    codemod/edits/imports.py's EditSet, codemod/ddp/places.py's HandDDP)."""
    grimp = __import__("pytest").importorskip("grimp")
    graph = grimp.build_graph("accelerate_rewrite", exclude_type_checking_imports=False, cache_dir=None)
    edges = {m: {i for i in graph.find_modules_directly_imported_by(m) if i.startswith("accelerate_rewrite")}
             for m in graph.modules}
    assert _circles(edges) == []


def test_codemod_has_at_most_twelve_files_at_its_top_level():
    top = [p.name for p in (ROOT / "accelerate_rewrite" / "codemod").glob("*.py")]
    assert len(top) <= 12, top


def test_no_module_of_the_package_is_over_600_lines():
    """Issue 62: a module that grows past ~500 lines is split by what it knows; none passes 600."""
    long = {str(p.relative_to(ROOT)): n for p in (ROOT / "accelerate_rewrite").rglob("*.py")
            if (n := len(p.read_text(encoding="utf-8").splitlines())) > 600}
    assert not long, long
