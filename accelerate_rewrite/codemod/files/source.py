"""Source files in and out: bytes -> text (encoding, BOM) and back, atomically.

Line endings, tabs and a missing final newline need nothing here: LibCST keeps every byte
of the text it is given, so only the encoding has to round-trip.
"""

from __future__ import annotations

import io
import os
import re
import stat
import tempfile
import tokenize
from dataclasses import dataclass
from pathlib import Path


class SourceError(Exception):
    """A file that can't be read, decoded or written; the message names the file."""


@dataclass(frozen=True)
class SourceFile:
    path: Path
    raw: bytes
    text: str
    encoding: str  # as tokenize names it: "utf-8", "utf-8-sig" (with a BOM), "latin-1", ...

    def encode(self, text: str) -> bytes:
        return text.encode(self.encoding)


def decode(path: Path, raw: bytes) -> SourceFile:
    if b"\x00" in raw:
        raise SourceError(f"{path}: binary file (contains NUL bytes), not a Python script")
    try:
        encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError as exc:  # a bad coding cookie
        raise SourceError(f"{path}: {exc}") from None
    try:
        text = raw.decode(encoding)
    except (UnicodeDecodeError, LookupError) as exc:
        raise SourceError(f"{path}: cannot be decoded as {encoding} ({exc.reason})") from None
    if encoding == "utf-8-sig" and text.startswith("\ufeff"):
        text = text[1:]
    return SourceFile(path=path, raw=raw, text=text, encoding=encoding)


def read_source(path: Path) -> SourceFile:
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise SourceError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise SourceError(f"{path}: is a directory") from None
    except OSError as exc:
        raise SourceError(f"{path}: cannot be read ({exc.strerror})") from None
    return decode(path, raw)


#: the temporary files write_atomic makes: ``.NAME.accelerate-rewrite-PID-XXXXXXXX.tmp``
TEMP_MARK = ".accelerate-rewrite-"
_TEMP = re.compile(r"\.(?P<name>.+)\.accelerate-rewrite-(?P<pid>\d+)-[A-Za-z0-9_]+\.tmp")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True  # someone else's process: alive
    return True


def remove_stale_temps(target: Path) -> list[Path]:
    """Remove the temporary files an earlier run left beside ``target`` (killed between writing
    and renaming: ``kill -9``, a power cut): ours by their name, stale when the process that
    made them is gone. A run writing the same file right now keeps its own."""
    removed = []
    try:
        entries = list(target.parent.glob(f".{target.name}{TEMP_MARK}*.tmp"))
    except OSError:
        return removed
    for entry in entries:
        match = _TEMP.fullmatch(entry.name)
        if match is None or match.group("name") != target.name or _alive(int(match.group("pid"))):
            continue
        try:
            entry.unlink()
            removed.append(entry)
        except OSError:
            pass
    return removed


def _stage(path: Path, data: bytes, expected: bytes | None) -> tuple[Path, str]:
    """``path``'s target (a symlink followed) and a temporary file beside it holding ``data``,
    written through, with the file's mode: what a write renames over the file. A SourceError
    where the file changed since it was read (``expected``), is read-only, or its folder takes no
    file; an OSError where the temporary file can't be written (it is removed)."""
    target = Path(os.path.realpath(path))
    remove_stale_temps(target)
    if expected is not None:
        try:
            current = target.read_bytes()
        except OSError as exc:
            raise SourceError(f"{path}: cannot be re-read before writing ({exc.strerror})") from None
        if current != expected:
            raise SourceError(f"{path}: changed on disk since it was read; not overwritten")
    try:
        mode = stat.S_IMODE(target.stat().st_mode)
    except FileNotFoundError:
        mode = 0o644
    # a file without any write bit is read-only on purpose, even for root (whom os.access
    # lets write anything)
    if target.exists() and (not mode & 0o222 or not os.access(target, os.W_OK)):
        raise SourceError(f"{path}: is read-only; not written")
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{target.name}{TEMP_MARK}{os.getpid()}-", suffix=".tmp",
                                   dir=target.parent)
    except OSError as exc:
        raise SourceError(f"{path}: cannot write in {target.parent} ({exc.strerror}); not written") from None
    try:
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        os.chmod(tmp, mode)
    except OSError:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise
    return target, tmp


def write_atomic(path: Path, data: bytes, *, expected: bytes | None = None) -> None:
    """Write ``data`` to ``path`` through a temporary file in the same folder and a rename.

    The file's mode is kept; a symlink is followed to its target (the link stays a link).
    With ``expected``, a file whose bytes changed since they were read is not overwritten.
    The temporary file is named ``.NAME.accelerate-rewrite-PID-XXXXXXXX.tmp``, so that one left
    by a killed run is recognised, and removed by the next write of the same file.
    """
    tmp = None
    try:
        target, tmp = _stage(path, data, expected)
        os.replace(tmp, target)
    except OSError as exc:
        if tmp is not None:
            try:
                os.unlink(tmp)
            except OSError:
                pass
        raise SourceError(f"{path}: write failed ({exc.strerror}); the original is unchanged") from None


def write_atomic_set(items: list[tuple[Path, bytes, bytes]]) -> None:
    """Write several files as one: ``(path, data, expected)`` each, all or none.

    Every file is checked (unchanged since read, writable) and its new text written to a
    temporary file beside it before any is renamed over its original; a rename that fails puts
    back the originals already replaced, so that a project's files never disagree (a script
    passing ``fabric`` to a function that does not take it)."""
    staged: list[tuple[Path, Path, str, bytes]] = []  # (shown, target, temporary, original)

    def discard() -> None:
        for _, _, tmp, _ in staged:
            try:
                os.unlink(tmp)
            except OSError:
                pass

    try:
        for path, data, expected in items:
            target, tmp = _stage(path, data, expected)
            staged.append((path, target, tmp, expected))
    except SourceError as exc:
        discard()
        raise SourceError(f"{exc}; none of the {len(items)} files of the project written") from None
    except OSError as exc:
        discard()
        raise SourceError(f"write failed ({exc.strerror}); none of the {len(items)} files of the project "
                          "written") from None
    done: list[tuple[Path, Path, str, bytes]] = []
    for entry in staged:
        try:
            os.replace(entry[2], entry[1])
        except OSError as exc:
            for shown, target, _, original in done:  # put back what was replaced
                write_atomic(target, original)
            staged[:] = [e for e in staged if e not in done]
            discard()
            raise SourceError(f"{entry[0]}: write failed ({exc.strerror}); none of the {len(items)} files "
                              "of the project changed") from None
        done.append(entry)

