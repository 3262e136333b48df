"""A per-user cache of rewrite results, as black and ruff keep one: a file whose bytes, options,
rules, configuration, own imported modules and tool are those of an earlier run gets that run's
result back without being parsed or analysed (and without libcst or the rules being imported).

Where: ``--cache-dir`` or ``ACCELERATE_REWRITE_CACHE_DIR``, else the platform's user cache
folder, as platformdirs' ``user_cache_dir`` names it (without the dependency):
``$XDG_CACHE_HOME/accelerate-rewrite`` (``~/.cache/accelerate-rewrite``) on Linux,
``~/Library/Caches/accelerate-rewrite`` on macOS, ``%LOCALAPPDATA%\\accelerate-rewrite\\Cache``
on Windows. ``--no-cache`` or ``ACCELERATE_REWRITE_NO_CACHE=1`` turns it off. Deleting the folder
clears it.

The key (sha256) covers the entry format; the tool (every file of this package by size and
modification time, libcst's version, Python's); the file's path; its bytes; the values its
options and rules are resolved from (the defaults, its configuration with the overrides that
match it, the command line's), which decide the resolved options and the selected rules; and
the bytes of the project's own modules it imports (``codemod.siblings.imported_files``: the
rewrite reads them).

An entry (``<key[:2]>/<key>.json``) is a sha256 line and a JSON record of the whole result: the
new text when the file changes, every note with its kind resolved, the rules dropped, and the
resolved options, so that a cached run prints the same diff, notes and exit code as an uncached
one. An entry that can't be read, whose checksum or key differs, or whose fields have other types
is a miss, never trusted. Entries are written to a temporary file renamed over the entry; a cache
folder that can't be written is skipped without a word. Errors (a syntax error, an unreadable
file) are not stored, nor notebooks: they are rewritten every run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.files.paths import Target
    from accelerate_rewrite.codemod.analysis.importers import Scope
    from accelerate_rewrite.codemod.result import Result
    from accelerate_rewrite.options import Options
    from accelerate_rewrite.prepare import Prepared
    from accelerate_rewrite.settings import Settings

ENV_DIR = "ACCELERATE_REWRITE_CACHE_DIR"
ENV_OFF = "ACCELERATE_REWRITE_NO_CACHE"
#: the layout of an entry: a change of it makes every older entry a miss
FORMAT = "1"
PACKAGE = Path(__file__).resolve().parent


def default_dir() -> Path:
    """The platform's user cache folder for this tool (platformdirs' ``user_cache_dir``)."""
    if sys.platform == "win32":
        base = os.environ.get("LOCALAPPDATA") or str(Path.home() / "AppData" / "Local")
        return Path(base) / "accelerate-rewrite" / "Cache"
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Caches" / "accelerate-rewrite"
    base = os.environ.get("XDG_CACHE_HOME", "")
    return (Path(base) if os.path.isabs(base) else Path.home() / ".cache") / "accelerate-rewrite"


def chosen_dir(no_cache: bool, cache_dir: Optional[str]) -> Optional[Path]:
    """The cache folder the command line chose (``--cache-dir``, by default the platform's);
    None with ``--no-cache``."""
    if no_cache:
        return None
    return Path(os.path.expanduser(cache_dir)) if cache_dir else default_dir()


@lru_cache(maxsize=None)
def tool_fingerprint() -> str:
    """This package's files (size and modification time: a new version, or an edit of a
    development install, is another tool), libcst's version and Python's."""
    digest = hashlib.sha256(f"{FORMAT}\n{sys.version}\n".encode())
    for root, dirs, files in os.walk(PACKAGE):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__")
        for name in sorted(files):
            if name.endswith((".py", ".txt")):
                path = os.path.join(root, name)
                try:
                    st = os.stat(path)
                except OSError:
                    continue
                digest.update(f"{os.path.relpath(path, PACKAGE)} {st.st_size} {st.st_mtime_ns}\n".encode())
    import importlib.util

    try:  # libcst's version file, found without importing libcst (a hit must not)
        spec = importlib.util.find_spec("libcst")
        origin = Path(spec.origin).parent / "_version.py" if spec and spec.origin else None
        digest.update(origin.read_bytes() if origin is not None else b"no libcst")
    except (ImportError, OSError, ValueError):
        digest.update(b"libcst unknown")
    return digest.hexdigest()


def _siblings(path: Path, text: str) -> list[Path]:
    """The project's own modules the script imports (``codemod.siblings.imported_files``), read
    with Python's parser only when the text names a module or package of its folder, or of its
    project's root, at all."""
    from accelerate_rewrite.codemod.analysis.siblings import project_root

    folder = path.parent
    stems: set[str] = set()
    for where in {folder if str(folder) else Path("."), project_root(folder if str(folder) else Path("."))}:
        try:
            names = os.listdir(where)
        except OSError:
            continue
        stems |= {name[:-3] if name.endswith(".py") else name for name in names
                  if name.endswith(".py") or "." not in name}
    stems.discard(path.stem)
    if not any(stem.isidentifier() and stem in text for stem in stems):
        return []
    from accelerate_rewrite.codemod.analysis.siblings import imported_files

    return imported_files(path, text)


def key_for(path: Path, raw: bytes, text: str, settings: "Settings") -> Optional[str]:
    """The key of ``path``'s result under ``settings``; None for a file its configuration
    excludes (the runner says so itself). A bad configuration raises ConfigError."""
    from accelerate_rewrite.config import raw_values

    config, values, _ = raw_values(path, settings.cli_values, defaults=settings.defaults,
                                   isolated=settings.isolated)
    if config.excluded(path):
        return None
    digest = hashlib.sha256(tool_fingerprint().encode())
    digest.update(repr((str(path), os.path.abspath(path), sorted(values.items()))).encode())
    digest.update(hashlib.sha256(raw).digest())
    for sibling in _siblings(path, text):
        try:
            content = hashlib.sha256(sibling.read_bytes()).hexdigest()
        except OSError:
            content = "unreadable"
        digest.update(f"\n{sibling} {content}".encode())
    return digest.hexdigest()


# ---- entries ---------------------------------------------------------------------------------


def _entry(folder: Path, key: str) -> Path:
    return folder / key[:2] / f"{key}.json"


def _options_record(options: "Options") -> dict:
    out = {}
    for f in dataclasses.fields(options):
        value = getattr(options, f.name)
        out[f.name] = sorted(value) if isinstance(value, frozenset) else \
            list(value) if isinstance(value, tuple) else value
    return out


def _options_from(record: dict) -> "Options":
    from accelerate_rewrite.options import Options

    fields = dataclasses.fields(Options)
    if set(record) != {f.name for f in fields}:
        raise ValueError("other option names")
    values = {}
    for f in fields:
        value = record[f.name]
        if isinstance(f.default, (tuple, frozenset)):
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ValueError(f"{f.name}: not a list of strings")
            value = type(f.default)(value)
        elif value is not None and not isinstance(value, (str, int, float)):
            raise ValueError(f"{f.name}: not a plain value")
        values[f.name] = value
    return Options(**values)


def load(folder: Path, key: str, path: Path, text: str) -> Optional[tuple["Result", "Options"]]:
    """The cached result and options of ``key`` (``path`` with ``text``), or None: no entry, or
    one that is corrupt in any way."""
    from accelerate_rewrite.codemod.result import Kind, Note, Result

    try:
        data = _entry(folder, key).read_bytes()
    except OSError:
        return None
    head, newline, body = data.partition(b"\n")
    if not newline or head != hashlib.sha256(body).hexdigest().encode():
        return None
    try:
        record = json.loads(body.decode("utf-8"))
        if record["key"] != key:
            return None
        output = record["output"]
        if output is not None and not isinstance(output, str):
            return None
        notes = []
        for rule, line, message, skipped, kind in record["notes"]:
            if not (isinstance(rule, str) and type(line) is int and isinstance(message, str)
                    and type(skipped) is bool):
                return None
            notes.append(Note(rule, line, message, skipped, None if kind is None else Kind(kind)))
        dropped = record["dropped"]
        if not isinstance(dropped, list) or not all(isinstance(d, str) for d in dropped):
            return None
        options = _options_from(record["options"])
    except (ValueError, TypeError, KeyError, AttributeError):
        return None
    result = Result(path=str(path), source=text, output=text if output is None else output,
                    notes=notes, dropped=list(dropped))
    return result, options


def store(folder: Path, key: str, result: "Result", options: "Options") -> None:
    """Write the entry of ``key``, atomically; a folder that can't be written is skipped."""
    import tempfile

    from accelerate_rewrite.rules import BY_CODE  # loaded already: the result was just computed

    notes = []
    for n in result.notes:
        kind = n.kind if n.kind is not None or n.rule not in BY_CODE else BY_CODE[n.rule].kind_for(options)
        notes.append([n.rule, n.line, n.message, n.skipped, None if kind is None else kind.value])
    record = {"key": key, "output": result.output if result.changed else None, "notes": notes,
              "dropped": list(result.dropped), "options": _options_record(options)}
    try:
        body = json.dumps(record, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    except (TypeError, ValueError):  # a value JSON can't hold: not cached
        return
    entry = _entry(folder, key)
    try:
        if not folder.is_dir():
            folder.mkdir(parents=True, exist_ok=True)
            # as ruff and black mark theirs: backup tools skip it, git ignores it
            (folder / "CACHEDIR.TAG").write_text("Signature: 8a477f597d28d172789f06886806bc55\n"
                                                 "# accelerate-rewrite's cache\n")
            (folder / ".gitignore").write_text("*\n")
        entry.parent.mkdir(exist_ok=True)
        fd, temp = tempfile.mkstemp(dir=entry.parent, prefix=".", suffix=".tmp")
        try:
            with os.fdopen(fd, "wb") as handle:
                handle.write(hashlib.sha256(body).hexdigest().encode() + b"\n" + body)
            os.replace(temp, entry)
        except BaseException:
            try:
                os.unlink(temp)
            except OSError:
                pass
            raise
    except OSError:
        pass


# ---- the runner's prepare, through the cache ---------------------------------------------------


def _keyed(target: "Target", settings: "Settings"):
    """(the file as read, its key), or None when the cache has no say: no cache, a notebook, or
    a file the key can't be made of (unreadable, a bad configuration, excluded: prepare.prepare
    reports those)."""
    folder = settings.cache_dir
    if folder is None or target.error is not None or target.path.suffix == ".ipynb":
        return None
    from accelerate_rewrite.codemod.files.source import read_source

    try:
        source = read_source(target.path)
        key = key_for(target.path, source.raw, source.text, settings)
    except Exception:  # noqa: BLE001 - prepare.prepare says what is wrong
        return None
    return (source, key) if key is not None else None


def answer(target: "Target", settings: "Settings", keyed=False) -> Optional["Prepared"]:
    """What the cache answers for ``target``: its result as ``prepare.prepare`` would give it, or
    None (no entry, or the result has to be written, which needs the rewrite's own data).
    ``keyed``: ``_keyed``'s answer, when the caller has it."""
    from accelerate_rewrite.prepare import Prepared
    from accelerate_rewrite.settings import Mode

    if keyed is False:
        keyed = _keyed(target, settings)
    if keyed is None:
        return None
    source, key = keyed
    hit = load(settings.cache_dir, key, target.path, source.text)
    if hit is None:
        return None
    result, options = hit
    if settings.mode is Mode.OUTPUT or (settings.mode is Mode.WRITE and result.changed):
        return None
    return Prepared(target, result=result, source=source, options=options)


def prepare(target: "Target", settings: "Settings", scope: Optional["Scope"] = None) -> "Prepared":
    """``prepare.prepare`` (read, choose, rewrite, encode), answered from the cache when it can
    (``answer``), and stored in the cache otherwise. A script rewritten with the project's
    modules it imports (``result.members``, codemod/project/program.py) is not stored: its result is
    several files'. ``scope``: as ``prepare.prepare``'s."""
    from accelerate_rewrite.prepare import prepare as uncached

    keyed = _keyed(target, settings)
    known = answer(target, settings, keyed)
    if known is not None:
        return known
    prepared = uncached(target, settings, scope)
    if keyed is not None and prepared.error is None and not prepared.excluded \
            and prepared.result is not None and prepared.options is not None and prepared.diff is None \
            and prepared.source is not None and prepared.source.raw == keyed[0].raw \
            and not prepared.result.members:
        store(settings.cache_dir, keyed[1], prepared.result, prepared.options)
    return prepared
