"""Golden outputs of the fixtures: the option sets that matter, and how to (re)write them.

    python -m tests.goldens          # rewrite every golden from the current code; then read the diff

Projects (``fixtures/projects/NAME/``: a script ``train.py`` and the modules it imports) have,
per option set of ``PROJECT_SETS``, ``expected/SET/FILE`` for each file the rewrite changes and
``expected/SET.notes`` (every file's notes, and the dropped rules).

Each fixture ``fixtures/NAME/input.py`` has, per option set, ``expected/SET.py`` (the rewritten
script) and ``expected/SET.notes`` (what the summary says: changes, places left alone, dropped
rules), so that a change in behaviour shows up as a readable diff in review.
"""

from __future__ import annotations

import contextlib
from functools import lru_cache
from pathlib import Path

from accelerate_rewrite.api import Result, rewrite
from accelerate_rewrite.options import Options

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

#: one pattern of each form: a module path, a slice, a glob (the finetune_encoder fixture has all)
FREEZE_FORMS = ("embeddings", "encoder.layer[:2]", "classifier.*")

OPTION_SETS: dict[str, dict] = {
    "default": {},
    "bf16-mixed-devices-4": {"precision": "bf16-mixed", "devices": 4},
    "fsdp": {"strategy": "fsdp"},
    "torch-bf16-mixed": {"backend": "torch", "precision": "bf16-mixed"},
    "torch-16-mixed": {"backend": "torch", "precision": "16-mixed"},
    "torch-16-true": {"backend": "torch", "precision": "16-true"},
    "clip-1.0": {"clip_grad_norm": 1.0},
    "torch-16-mixed-clip-1.0": {"backend": "torch", "precision": "16-mixed", "clip_grad_norm": 1.0},
    "accumulate-4": {"accumulate": 4},
    "accumulate-4-keep-devices-2": {"accumulate": 4, "keep_effective_batch": True, "devices": 2},
    "torch-16-mixed-accumulate-4-clip-1.0": {"backend": "torch", "precision": "16-mixed", "accumulate": 4,
                                             "clip_grad_norm": 1.0},
    "torch-bf16-mixed-accumulate-4-keep": {"backend": "torch", "precision": "bf16-mixed", "accumulate": 4,
                                           "keep_effective_batch": True},
    "freeze-forms": {"freeze": FREEZE_FORMS},
    "torch-freeze-forms": {"backend": "torch", "freeze": FREEZE_FORMS},
    "checkpointing-Block": {"checkpointing": "Block"},
    # the memory and throughput rules of issue 7, all at once: with Fabric, and with the torch
    # backend (paged optimizers, length-grouped training batches, the opt-in DataLoader hints)
    "8bit-compile-padding": {"optimizer_8bit": True, "compile": True, "dynamic_padding": True,
                             "group_by_length": "eval"},
    "torch-8bit-compile-padding-hints": {"backend": "torch", "optimizer_8bit": True, "paged_optimizer": True,
                                         "compile": True, "dynamic_padding": True, "group_by_length": "all",
                                         "explicit": ("AR404",)},
    # issue 47: the Fabric plan spelled in Hugging Face Accelerate's API (one process, and two)
    "accelerate-bf16-mixed": {"backend": "accelerate", "precision": "bf16-mixed"},
    "accelerate-bf16-mixed-devices-2": {"backend": "accelerate", "precision": "bf16-mixed", "devices": 2},
    "accelerate-accumulate-4-keep-devices-2": {"backend": "accelerate", "accumulate": 4, "keep_effective_batch": True,
                                               "devices": 2},
}


def fixture_names() -> list[str]:
    return sorted(p.parent.name for p in FIXTURES.glob("*/input.py"))


@lru_cache(maxsize=None)  # the golden, idempotence and other fixture tests share one rewrite
def run(name: str, option_set: str) -> Result:
    path = FIXTURES / name / "input.py"
    return rewrite(path.read_text(encoding="utf-8"), Options.create(**OPTION_SETS[option_set]),
                   path=f"fixtures/{name}/input.py")


def notes_text(result: Result) -> str:
    lines = [
        f"{n.line}: {n.rule} {'left alone: ' if n.skipped else ''}{n.message}" for n in result.notes
    ]
    lines += [f"dropped: {d}" for d in result.dropped]
    return "\n".join(lines) + "\n"


def write_all() -> None:
    for name in fixture_names():
        out = FIXTURES / name / "expected"
        out.mkdir(exist_ok=True)
        for option_set in OPTION_SETS:
            result = run(name, option_set)
            (out / f"{option_set}.py").write_text(result.output, encoding="utf-8")
            (out / f"{option_set}.notes").write_text(notes_text(result), encoding="utf-8")
            print(f"wrote fixtures/{name}/expected/{option_set}.py")


PROJECTS = FIXTURES / "projects"
#: the option sets a project is rewritten with (names of OPTION_SETS)
PROJECT_SETS = ("default", "bf16-mixed-devices-4", "fsdp", "torch-16-mixed", "clip-1.0", "accumulate-4")


def project_names() -> list[str]:
    return sorted(p.parent.name for p in PROJECTS.glob("*/train.py"))


@lru_cache(maxsize=None)
def run_project(name: str, option_set: str) -> Result:
    """The project's script rewritten with every module of the project allowed to change (as
    ``accelerate-rewrite fixtures/projects/NAME``), from the repository's root: the paths in
    the notes are relative to it."""
    from accelerate_rewrite.codemod.project.program import Scope

    with contextlib.chdir(ROOT):
        path = f"fixtures/projects/{name}/train.py"
        return rewrite(Path(path).read_text(encoding="utf-8"), Options.create(**OPTION_SETS[option_set]),
                       path=path, scope=project_scope(name))


def project_scope(name: str):
    """As ``accelerate-rewrite fixtures/projects/NAME/train.py`` decides: the modules the script
    imports change with it, or, where another script of the project imports them too (its
    ``eval.py``), change so that it keeps working (codemod/project/compat.py)."""
    import os

    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.codemod.analysis.siblings import candidates

    folder = (PROJECTS / name).resolve()
    script = folder / "train.py"
    files = {os.path.realpath(p) for p in candidates(script, script.read_text(encoding="utf-8"),
                                                      lambda p: p.read_text(encoding="utf-8"))}
    others = [p for p in folder.glob("*.py") if p != script and os.path.realpath(p) not in files]
    if not others:
        return Scope(follow=True)
    return Scope(auto=True, root=str(folder), known=frozenset({os.path.realpath(script), *files}),
                 script=os.path.realpath(script))


def project_notes(result: Result) -> str:
    out = []
    for one in (result, *result.members):
        out += [f"{one.path}:{n.line}: {n.rule} {'left alone: ' if n.skipped else ''}{n.message}"
                for n in one.notes]
    out += [f"dropped: {d}" for d in result.dropped]
    return "\n".join(out) + "\n"


def project_trees(tmp_path: Path, name: str, options: Options, files: tuple[str, ...], shape=None):
    """fixtures/projects/NAME copied twice under ``tmp_path``, ``original`` and ``rewritten``,
    the second rewritten as ``accelerate-rewrite train.py`` does there (``files``: the files of
    the run; the others that import its modules keep working), written; ``shape(folder)`` changes
    both copies first. Returns both folders and the result (no rule dropped)."""
    import os
    import shutil

    from accelerate_rewrite.codemod.project.program import Scope

    original, rewritten = tmp_path / "original", tmp_path / "rewritten"
    for folder in (original, rewritten):
        shutil.copytree(PROJECTS / name, folder, ignore=shutil.ignore_patterns("expected"))
        if shape is not None:
            shape(folder)
    path = rewritten / "train.py"
    scope = Scope(auto=True, root=str(rewritten.resolve()), script=os.path.realpath(path),
                  known=frozenset(os.path.realpath(rewritten / f) for f in files))
    result = rewrite(path.read_text(encoding="utf-8"), options, path=str(path), scope=scope)
    assert not result.dropped, result.dropped
    path.write_text(result.output, encoding="utf-8")
    for member in result.members:
        Path(member.path).write_text(member.output, encoding="utf-8")
    return original, rewritten, result


def project_outputs(result: Result) -> dict[str, str]:
    """file name -> rewritten text, for the files that change."""
    return {Path(one.path).name: one.output for one in (result, *result.members) if one.changed}


def write_projects() -> None:
    for name in project_names():
        for option_set in PROJECT_SETS:
            result = run_project(name, option_set)
            out = PROJECTS / name / "expected" / option_set
            out.mkdir(parents=True, exist_ok=True)
            for old in out.glob("*.py"):
                old.unlink()
            for file, text in project_outputs(result).items():
                (out / file).write_text(text, encoding="utf-8")
            (out.parent / f"{option_set}.notes").write_text(project_notes(result), encoding="utf-8")
            print(f"wrote fixtures/projects/{name}/expected/{option_set}")


#: repositories converted whole (``accelerate-rewrite .``), their golden files under expected/cpu-devices-2
REPOSITORIES = FIXTURES / "repositories"
REPOSITORY_ARGS = ("--devices", "2", "--accelerator", "cpu")
REPOSITORY_SET = "cpu-devices-2"


def repository_files(name: str) -> dict[str, str]:
    """The golden files of a repository converted whole: file name -> text, those that change."""
    folder = REPOSITORIES / name / "expected" / REPOSITORY_SET
    return {p.name: p.read_text(encoding="utf-8") for p in sorted(folder.glob("*.py"))}


def write_repositories() -> None:
    """``accelerate-rewrite . --write`` over a copy of each repository fixture: the files it
    changed, as goldens."""
    import shutil
    import subprocess
    import sys
    import tempfile

    for repo in sorted(p for p in REPOSITORIES.iterdir() if p.is_dir()):
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / repo.name
            shutil.copytree(repo, work, ignore=shutil.ignore_patterns("expected", "__pycache__"))
            subprocess.run([sys.executable, "-m", "accelerate_rewrite", ".", *REPOSITORY_ARGS, "--write", "-q",
                            "--no-cache"], cwd=work, check=True)
            out = repo / "expected" / REPOSITORY_SET
            out.mkdir(parents=True, exist_ok=True)
            for old in out.glob("*.py"):
                old.unlink()
            for file in sorted(work.glob("*.py")):
                if file.read_bytes() != (repo / file.name).read_bytes():
                    (out / file.name).write_text(file.read_text(encoding="utf-8"), encoding="utf-8")
        print(f"wrote fixtures/repositories/{repo.name}/expected/{REPOSITORY_SET}")


if __name__ == "__main__":
    write_all()
    write_projects()
    write_repositories()
