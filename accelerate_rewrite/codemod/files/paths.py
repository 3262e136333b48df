"""Which files a run covers: the paths given, folders searched for ``*.py`` and ``*.ipynb``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

#: folders never searched (besides hidden ones, whose name starts with a dot)
SKIPPED_FOLDERS = frozenset({".venv", "__pycache__", "node_modules", "build", "dist"})


@dataclass(frozen=True)
class Target:
    """A file to rewrite, or a path given that can't be one (``error`` says why)."""

    path: Path
    error: Optional[str] = None


def _skipped(name: str) -> bool:
    return name.startswith(".") or name in SKIPPED_FOLDERS


def _ignore_files(folder: Path) -> list[tuple[Path, "object"]]:
    """The ``.gitignore`` / ``.ignore`` rules of ``folder`` itself, as (base, spec)."""
    import pathspec

    specs = []
    for name in (".gitignore", ".ignore"):
        file = folder / name
        if file.is_file():
            try:
                lines = file.read_text(encoding="utf-8", errors="replace").splitlines()
            except OSError:
                continue
            specs.append((folder.resolve(), pathspec.GitIgnoreSpec.from_lines(lines)))
    return specs


def _repository_specs(folder: Path) -> list[tuple[Path, "object"]]:
    """The ignore rules that apply to ``folder`` from its parents, up to the repository's root
    (the first folder with a ``.git``), as git reads them."""
    folder = folder.resolve()
    chain = []
    for candidate in (folder, *folder.parents):
        chain.append(candidate)
        if (candidate / ".git").exists():
            break
    else:
        chain = [folder]  # not in a repository: the folder's own files only
    return [spec for parent in reversed(chain[1:]) for spec in _ignore_files(parent)]


def ignored(path: Path, specs: list[tuple[Path, "object"]], is_dir: bool = False) -> bool:
    resolved = path.resolve()
    for base, spec in specs:
        try:
            rel = resolved.relative_to(base).as_posix()
        except ValueError:
            continue
        if spec.match_file(rel + "/" if is_dir else rel):
            return True
    return False


def _walk(folder: Path) -> Iterable[Path]:
    """``*.py`` files under ``folder``, sorted, not descending into skipped folders, virtual
    environments (a ``pyvenv.cfg``), or what ``.gitignore`` / ``.ignore`` files ignore (those of
    the folders walked and of its parents up to the repository's root; pathspec reads them as
    git does).

    The folder given is searched whatever its own name (``accelerate-rewrite .`` works);
    hidden files (editor lock files such as ``.#train.py``) are left out too.
    """
    specs_of: dict[str, list] = {}
    base = _repository_specs(folder)
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        parent = specs_of.get(os.path.dirname(root), base) if root != str(folder) else base
        specs = parent + _ignore_files(here)
        specs_of[root] = specs
        dirs[:] = sorted(d for d in dirs if not _skipped(d) and not (here / d / "pyvenv.cfg").exists()
                         and not ignored(here / d, specs, is_dir=True))
        for name in sorted(names):
            if name.endswith((".py", ".ipynb")) and not name.startswith(".") \
                    and not ignored(here / name, specs):
                yield here / name


def collect(paths: Iterable[str], force_exclude: bool = False) -> list[Target]:
    """The files to process, in the order given (each folder's files sorted), no repeats.

    A path that does not exist becomes a Target with an error, so the run goes on with the
    others and reports it. A file named explicitly is read even when a ``.gitignore`` ignores
    it, unless ``force_exclude`` (``--force-exclude``, as ruff's and black's).
    """
    out: list[Target] = []
    seen: set[str] = set()

    def add(target: Target) -> None:
        key = os.path.realpath(target.path)
        if key not in seen:
            seen.add(key)
            out.append(target)

    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            for file in _walk(path):
                add(Target(file))
        elif path.exists() and not path.is_file():
            # a FIFO, a socket, a device: reading one could block forever, or never end
            kind = ("a FIFO" if path.is_fifo() else "a socket" if path.is_socket()
                    else "a device" if path.is_block_device() or path.is_char_device() else "not a file")
            out.append(Target(path, f"{path}: {kind}, not a regular file: not read"))
        elif path.exists() or path.is_symlink():
            if force_exclude and ignored(path, _repository_specs(path.parent) + _ignore_files(path.parent.resolve())):
                continue
            add(Target(path))  # a file given by name is read whatever its suffix
        else:
            out.append(Target(path, f"{path}: no such file or folder"))
    return out
