"""Which other files of a repository read a module the rewrite would change, and so whether it
may change (``Scope``): the files under the script's project root that import it (``importers``,
Python's ``ast`` of each file whose text may import it), the names they read of it
(``_names_used``), and the top-level names a change touches (``changed_names``). Read with ``ast``
only, as codemod/analysis/siblings.py is: the runner makes a ``Scope`` on every run."""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Optional

from accelerate_rewrite.codemod.analysis.siblings import _file, _parsed, import_folders
from accelerate_rewrite.codemod.tree.toplevel import line_list, python_tree


#: at most this many Python files are read to tell which others import a module (``importers``)
MAX_SCANNED = 2000
#: folders never read for importers: caches, environments, build output
_NOT_SCANNED = frozenset({"__pycache__", "site-packages", "node_modules", "venv", "env", "build", "dist"})


def _bases(folder: Path, folders: list[Path], level: int) -> list[Path]:
    """Where ``from ... import`` of this ``level`` looks: the script's import folders (level 0),
    its own folder (``from . import``), a parent (``from .. import``)."""
    if level == 0:
        return folders
    if level == 1:
        return [folder]
    return [folder.parents[level - 2]] if level - 2 < len(folder.parents) else []


@lru_cache(maxsize=4096)
def _imports_of(path: str, mtime_ns: int, size: int, root: str) -> frozenset[str]:
    """The resolved files of the project's modules that the file at ``path`` imports anywhere in
    it (in functions too, relatively too, ``from pkg import module``, the packages on the way),
    from its folder or from ``root`` (``python -m tools.evaluate`` run there)."""
    tree = _parsed(path, mtime_ns, size)
    if tree is None:
        return frozenset()
    folder = Path(path).parent
    folders = [*import_folders(folder, tree), Path(root)]
    out: set[str] = set()

    def add(bases: list[Path], dotted: str) -> None:
        parts = dotted.split(".")
        for i in range(1, len(parts) + 1):
            for base in bases:
                found = _file(base, ".".join(parts[:i]))
                if found is not None:
                    out.add(os.path.realpath(found))
                    break

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(folders, alias.name)
        elif isinstance(node, ast.ImportFrom):
            bases = _bases(folder, folders, node.level)
            for alias in node.names:
                dotted = ".".join(p for p in (node.module, alias.name) if p and p != "*")
                if dotted:
                    add(bases, dotted)
    return frozenset(out)


@lru_cache(maxsize=4096)
def _names_used(path: str, mtime_ns: int, size: int, root: str, target: str) -> Optional[frozenset[str]]:
    """The top-level names of the module ``target`` (resolved) that the file at ``path`` reads:
    ``from utils import a, b`` -> a, b; ``import utils`` (or ``as u``, or ``from pkg import
    utils``) -> the attributes read of it; None for all of them (``from utils import *``, the
    module read otherwise than for an attribute, ``import pkg.utils`` read through ``pkg``)."""
    tree = _parsed(path, mtime_ns, size)
    if tree is None:
        return None
    folder = Path(path).parent
    folders = [*import_folders(folder, tree), Path(root)]

    def resolves(bases: list[Path], dotted: str) -> bool:
        return any((found := _file(base, dotted)) is not None and os.path.realpath(found) == target
                   for base in bases)

    names: set[str] = set()
    aliases: set[str] = set()
    # one walk: the imports, and the names and attributes read (for the aliases below)
    imports: list[ast.AST] = []
    read_names: list[ast.Name] = []
    attributes: list[ast.Attribute] = []
    for node in ast.walk(tree):
        kind = type(node)
        if kind is ast.Name:
            read_names.append(node)
        elif kind is ast.Attribute:
            attributes.append(node)
        elif kind is ast.Import or kind is ast.ImportFrom:
            imports.append(node)
    for node in imports:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if resolves(folders, alias.name):
                    if alias.asname is None and "." in alias.name:
                        return None
                    aliases.add(alias.asname or alias.name)
        elif isinstance(node, ast.ImportFrom):
            bases = _bases(folder, folders, node.level)
            whole = bool(node.module) and resolves(bases, node.module)
            for alias in node.names:
                if whole:
                    if alias.name == "*":
                        return None
                    names.add(alias.name)
                elif resolves(bases, ".".join(p for p in (node.module, alias.name) if p)):
                    aliases.add(alias.asname or alias.name)
    if aliases:
        read = {id(n.value) for n in attributes if isinstance(n.value, ast.Name) and n.value.id in aliases}
        for n in read_names:
            if n.id in aliases and id(n) not in read and not isinstance(n.ctx, ast.Store):
                return None
        names.update(n.attr for n in attributes if id(n.value) in read)
    return frozenset(names)


def importers(root: Path, path: str, known: frozenset[str], script: str = "",
              changed: Optional[frozenset[str]] = None) -> Optional[list[Path]]:
    """The Python files under ``root`` (its folders too, but hidden ones and environments) that
    import ``path`` (resolved), directly or through other files that do, besides ``known``
    (resolved: the script and the modules analysed with it); None when there are more than
    ``MAX_SCANNED`` files to read. What imports the ``script`` itself (resolved) is not counted:
    the script changes by design (``import main as detection`` in a launcher). With ``changed``
    (the top-level names whose definitions the rewrite changes), only the files that read one of
    them (``_names_used``) count: the others run as before."""
    files: dict[str, tuple[str, int, int]] = {}  # resolved -> (path, mtime, size)
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if not d.startswith(".") and d not in _NOT_SCANNED)
        for name in names:
            if not name.endswith(".py"):
                continue
            if len(files) >= MAX_SCANNED:
                return None
            file = os.path.join(folder, name)
            try:
                stat = os.stat(file)
            except OSError:
                continue
            files[os.path.realpath(file)] = (file, stat.st_mtime_ns, stat.st_size)

    def imports(real: str, wanted: str) -> bool:
        """Whether the file imports ``wanted`` (``_imports_of``); a file whose text can't hold
        an import statement spelling its name (``_spelled``, ``_may_import``) is not parsed."""
        file, mtime, size = files[real]
        word = _spelled(wanted)
        if word is not None and not _may_import(file, mtime, size, word):
            return False
        return wanted in _imports_of(file, mtime, size, str(root))

    if changed is not None:
        out = []
        for file, (_, mtime, size) in files.items():
            if file not in known and file not in (path, script) and imports(file, path):
                used = _names_used(file, mtime, size, str(root), path)
                if used is None or used & changed:
                    out.append(Path(file))
        return sorted(out)
    users: set[str] = {script} if script else set()
    todo = [path]
    while todo:
        wanted = todo.pop()
        for file in files:
            if file not in users and file != path and imports(file, wanted):
                users.add(file)
                todo.append(file)
    return sorted(Path(f) for f in users - known - {script})


def _spelled(path: str) -> Optional[bytes]:
    """The name every import of the module at ``path`` spells (``utils`` of utils.py, ``pkg`` of
    pkg/__init__.py: ``import pkg.utils``, ``from .utils import x``, ``from . import utils``), as
    bytes; None where it is not ASCII (a file's own encoding may spell it otherwise)."""
    p = Path(path)
    name = p.parent.name if p.name == "__init__.py" else p.stem
    return name.encode("ascii") if name.isascii() and name.isidentifier() else None


#: an import statement over several lines (``import (``, a line continued by a backslash): where
#: a file has one, a line alone can't tell what it imports
_LONG_IMPORT = re.compile(rb"\bimport\s*\(|\\\r?\n")


@lru_cache(maxsize=8192)
def _may_import(path: str, mtime_ns: int, size: int, word: bytes) -> bool:
    """Whether the file's text may import the module that ``word`` names: a line that holds
    both ``import`` and the word (``import utils``, ``from .utils import x``, ``from . import
    utils``), or, in a file with an import statement over several lines, the word anywhere.
    Python's source encodings are ASCII's supersets: the bytes spell the names as ASCII does."""
    try:
        data = Path(path).read_bytes()
    except OSError:
        return False
    if word not in data:
        return False
    if _LONG_IMPORT.search(data):
        return True
    w = re.escape(word)
    return re.search(rb"^[^\n]*(?:\bimport\b[^\n]*\b" + w + rb"\b|\b" + w + rb"\b[^\n]*\bimport\b)", data,
                     re.MULTILINE) is not None


@lru_cache(maxsize=32)
def changed_names(before: str, after: str) -> Optional[frozenset[str]]:
    """The top-level names of a module whose definitions differ between ``before`` and
    ``after`` (functions, classes, assigned names; an import added or gone changes none); None
    when another top-level statement changes, or a text does not parse. Kept for the next
    question about the same two texts: a rewrite's attempt asks it of a module three times (may
    it change, who imports what changes, which changes no other file reads)."""
    def defined(text: str) -> Optional[tuple[dict[str, list[ast.stmt]], list[ast.stmt], list[str]]]:
        try:
            tree = python_tree(text)
        except (SyntaxError, ValueError):
            return None
        lines = line_list(text)  # (as Python numbers them)
        named: dict[str, list[ast.stmt]] = {}
        other: list[ast.stmt] = []
        for node in tree.body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                named.setdefault(node.name, []).append(node)
            elif isinstance(node, (ast.Assign, ast.AnnAssign)) and all(
                    isinstance(t, ast.Name) for t in (node.targets if isinstance(node, ast.Assign) else [node.target])):
                for t in node.targets if isinstance(node, ast.Assign) else [node.target]:
                    named.setdefault(t.id, []).append(node)
            elif not isinstance(node, (ast.Import, ast.ImportFrom)):
                other.append(node)
        return named, other, lines

    def same(these: list[ast.stmt], those: list[ast.stmt], old_lines: list[str], new_lines: list[str]) -> bool:
        """The same definitions: the same lines of code (the cheap answer for most), or else
        the same trees (a change of layout alone changes none)."""
        def code(node: ast.stmt, lines: list[str]) -> str:
            first = min([node.lineno, *(d.lineno for d in getattr(node, "decorator_list", ()))])
            return "".join(lines[first - 1 : node.end_lineno or node.lineno])
        return len(these) == len(those) and (
            all(code(a, old_lines) == code(b, new_lines) for a, b in zip(these, those))
            or [ast.dump(a) for a in these] == [ast.dump(b) for b in those])

    old, new = defined(before), defined(after)
    if old is None or new is None or not same(old[1], new[1], old[2], new[2]):
        return None
    return frozenset(n for n in old[0].keys() | new[0].keys()
                     if not same(old[0].get(n, []), new[0].get(n, []), old[2], new[2]))


@dataclass(frozen=True)
class Scope:
    """Which of the project's own files a rewrite may change besides the script itself:
    ``writable`` (resolved paths), or any with ``follow`` (``--follow-imports``), or, with
    ``auto`` (the default), any whose changed names no other file under the script's folder
    ``root`` reads (``importers``; ``known``: the script and its modules, resolved); ``shared``: files that
    other scripts of the run import too (resolved path -> their names), changed only so that those
    keep working (codemod/project/compat.py: the run merges what each script changes there, runner.py);
    ``frozen``: files the run changes otherwise (resolved path -> why), never changed with this
    script; ``alone``: why none may change."""

    writable: frozenset[str] = frozenset()
    follow: bool = False
    shared: tuple[tuple[str, str], ...] = ()
    #: why no other file may change, whatever the options (a script on stdin, a notebook)
    alone: Optional[str] = None
    auto: bool = False
    root: str = ""
    known: frozenset[str] = frozenset()
    script: str = ""
    frozen: tuple[tuple[str, str], ...] = ()
    #: the script's modules that run as scripts of their own too (``if __name__ == "__main__":``,
    #: resolved): their own code calls what the conversion would change there, so they change
    #: only so that it keeps working (YOLOv3's test.py, whose ``run()`` calls ``_evaluate``)
    scripts: frozenset[str] = frozenset()

    def compatible_change(self, path: str) -> bool:
        """Whether ``path`` may change compatibly where it may not change as the conversion
        would (codemod/project/compat.py): only where it would be refused for the other files of the
        repository that import it (``auto``), not where the user kept to the paths given; and a
        module another script of the run imports too, wherever it may change at all (each script's
        conversion changes it so, and the run merges them)."""
        real = os.path.realpath(path)
        if self.alone is not None or any(f == real for f, _ in self.frozen):
            return False
        if any(shared == real for shared, _ in self.shared) or real in self.scripts:
            return self.follow or self.auto or real in self.writable
        return self.auto and not self.follow and real not in self.writable

    def users(self, path: str, changed: Optional[frozenset[str]] = None) -> list[str]:
        """The files under the script's folder, other than the script and its modules, that read
        what changes in ``path`` (relative to it), at most a few."""
        others = importers(Path(self.root), os.path.realpath(path), self.known | self.writable, self.script,
                           changed) or []
        return [os.path.relpath(o, self.root) for o in others]

    def refusal(self, path: str, changed: Optional[frozenset[str]] = None) -> Optional[str]:
        """Why ``path`` may not change, or None. ``changed``: the top-level names whose
        definitions would change there (``changed_names``), when known."""
        if self.alone is not None:
            return f"it would change {path}, and {self.alone}"
        real = os.path.realpath(path)
        for frozen, why in self.frozen:
            if frozen == real:
                return f"it would change {path}, {why}"
        for shared, others in self.shared:
            if shared == real and (self.follow or self.auto or real in self.writable):
                return (f"it would change {path}, which {others} import{'s' if ' and ' not in others else ''} as "
                        "well, in a way that can't keep the old code for them")
        if real in self.scripts and (self.follow or self.auto or real in self.writable):
            return (f"it would change {path}, which runs as a script of its own too, in a way that can't "
                    "keep its own code working")
        if self.follow or real in self.writable:
            return None
        if not self.auto:
            return (f"it would change {path}, which is not among the paths given (name it too, or "
                    "pass --follow-imports)")
        others = importers(Path(self.root), real, self.known | self.writable, self.script, changed)
        if others == []:
            return None
        if others is None:
            return (f"it would change {path}, which is not among the paths given, and its folder "
                    f"holds more than {MAX_SCANNED} Python files to tell which others import it "
                    "(name it too, or pass --follow-imports)")
        shown = ", ".join(os.path.relpath(o, self.root) for o in others[:3]) + \
            (f" and {len(others) - 3} more" if len(others) > 3 else "")
        return (f"it would change {path}, which {shown} import{'s' if len(others) == 1 else ''} as "
                "well: changed for this script, it could break "
                f"{'it' if len(others) == 1 else 'them'} (pass --follow-imports to change it anyway)")
