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


def _walk(folder: Path) -> Iterable[Path]:
    """``*.py`` files under ``folder``, sorted, not descending into skipped folders.

    The folder given is searched whatever its own name (``accelerate-rewrite .`` works);
    hidden files (editor lock files such as ``.#train.py``) are left out too.
    """
    for root, dirs, names in os.walk(folder):
        dirs[:] = sorted(d for d in dirs if not _skipped(d))
        for name in sorted(names):
            if name.endswith((".py", ".ipynb")) and not name.startswith("."):
                yield Path(root) / name


def collect(paths: Iterable[str]) -> list[Target]:
    """The files to process, in the order given (each folder's files sorted), no repeats.

    A path that does not exist becomes a Target with an error, so the run goes on with the
    others and reports it.
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
            add(Target(path))  # a file given by name is read whatever its suffix
        else:
            out.append(Target(path, f"{path}: no such file or folder"))
    return out
