"""The script's own modules, next to it (``from utils import make_loaders``, ``import data``):
read with Python's ``ast``, only far enough to see which of a function's results are DataLoaders.

A loader that a sibling module builds and returns is set up where the script binds the result,
as one built by a helper of the script itself (codemod/analysis/returns.py). Only files in the script's
folder (``utils.py``, ``data/loaders.py``, ``data/__init__.py``) are read, never an installed
package, and never changed.

Which of those modules a script imports (``candidates``, ``imported_files``) and which may change
with it (``Scope``) are here too, with ``ast`` only: the runner and the cache read them on every
run, and a run answered from the cache must not load libcst (codemod/project/program.py, the analysis of
a script with its modules, does).
"""

from __future__ import annotations

import ast
import os
import re
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from accelerate_rewrite.codemod.analysis.libraries import is_library
from accelerate_rewrite.codemod.tree.toplevel import line_list, python_tree, top_level_imports


#: which look at the disk ``_file``'s answers belong to (``look_again``)
_LOOK = [0]


def look_again() -> None:
    """Forget where the modules' files were found: the next questions look at the disk again
    (each look for a script's project's modules, each rewrite). Within one look a module's file
    is looked for once: a rewrite asks of the same few modules hundreds of times."""
    _LOOK[0] += 1


def _file(folder: Path, dotted: str) -> Optional[Path]:
    return _file_of_look(folder, dotted, _LOOK[0])


@lru_cache(maxsize=4096)
def _file_of_look(folder: Path, dotted: str, look: int) -> Optional[Path]:
    if not dotted or dotted.startswith(".") or not all(part.isidentifier() for part in dotted.split(".")):
        return None
    if is_library(dotted):
        return None  # a library's copy in the tree is not the project's code (codemod/analysis/libraries.py)
    base = folder.joinpath(*dotted.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate
    return None


@lru_cache(maxsize=64)
def _parsed(path: str, mtime_ns: int, size: int) -> Optional[ast.Module]:
    try:
        return ast.parse(Path(path).read_bytes(), filename=path)
    except (OSError, SyntaxError, ValueError):
        return None


def _module(folder: Path, dotted: str) -> Optional[ast.Module]:
    path = _file(folder, dotted)
    if path is None:
        return None
    try:
        stat = path.stat()
    except OSError:
        return None
    return _parsed(str(path), stat.st_mtime_ns, stat.st_size)


def _is_loader_call(node: ast.AST) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return name == "DataLoader"


def _own_nodes(func: ast.FunctionDef):
    """The nodes of ``func``'s body, not those of functions, classes or lambdas in it."""
    todo = list(func.body)
    while todo:
        node = todo.pop()
        yield node
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            todo.extend(ast.iter_child_nodes(node))


def loader_results(folder: Optional[Path], dotted: str, name: str) -> Optional[tuple[bool, ...]]:
    """For ``name`` defined at the top of the sibling module ``dotted``: which elements of what
    it returns are DataLoaders (built there, returned directly or by name); None when none are,
    the returns disagree, or the module is not a file next to the script."""
    if folder is None:
        return None
    module = _module(folder, dotted)
    if module is None:
        return None
    func = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if func is None:
        return None
    nodes = list(_own_nodes(func))
    built = {n.targets[0].id for n in nodes if isinstance(n, ast.Assign) and len(n.targets) == 1
             and isinstance(n.targets[0], ast.Name) and _is_loader_call(n.value)}
    rebound = {t.id for n in nodes if isinstance(n, ast.Assign) and not _is_loader_call(n.value)
               for t in n.targets if isinstance(t, ast.Name)}
    shapes = []
    for ret in (n for n in nodes if isinstance(n, ast.Return)):
        if ret.value is None:
            return None
        elements = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
        shapes.append(tuple(_is_loader_call(e) or (isinstance(e, ast.Name) and e.id in built
                                                   and e.id not in rebound) for e in elements))
    if not shapes or any(s != shapes[0] for s in shapes) or not any(shapes[0]):
        return None
    return shapes[0]


def loader_attributes(folder: Optional[Path], dotted: str, name: str) -> frozenset[str]:
    """For a class ``name`` at the top of the sibling module ``dotted``: the attributes its
    ``__init__`` binds to DataLoaders it builds there (SAM's ``Cifar``: ``self.train =
    DataLoader(...)``, ``self.test = ...``), each bound once."""
    module = _module(folder, dotted) if folder is not None else None
    cls = next((n for n in module.body if isinstance(n, ast.ClassDef) and n.name == name), None) \
        if module is not None else None
    init = next((n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"), None) \
        if cls is not None else None
    if init is None:
        return frozenset()
    bound: dict[str, list[bool]] = {}
    for node in _own_nodes(init):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                if isinstance(target, ast.Attribute) and isinstance(target.value, ast.Name) \
                        and target.value.id == "self":
                    bound.setdefault(target.attr, []).append(_is_loader_call(node.value))
    return frozenset(attr for attr, loaders in bound.items() if loaders == [True])


def sibling_defines(folder: Optional[Path], dotted: str, name: str) -> bool:
    """Whether ``name`` is a function at the top of the sibling module ``dotted``, a file next to
    the script that the analysis can read (so what it returns can be seen)."""
    module = _module(folder, dotted) if folder is not None else None
    return module is not None and any(isinstance(n, ast.FunctionDef) and n.name == name for n in module.body)


#: files that mark the root of a project (a repository, an installable package)
ROOT_MARKERS = ("setup.py", "setup.cfg", "pyproject.toml", ".git")
#: how far above the script's folder its project's root is looked for
ROOT_DEPTH = 4


@lru_cache(maxsize=256)
def project_root(folder: Path) -> Path:
    """The folder of the script's project: the nearest folder at or above ``folder`` (at most
    ``ROOT_DEPTH`` up) that holds a ``setup.py``, ``setup.cfg``, ``pyproject.toml`` or ``.git``;
    ``folder`` itself when there is none. Its packages are importable where its user works (an
    editable install, ``python -m``, PYTHONPATH): ``scripts/image_train.py`` importing
    ``improved_diffusion.train_util`` from the repository's root."""
    here = folder.resolve()
    for candidate in [here, *list(here.parents)[:ROOT_DEPTH]]:
        if any((candidate / marker).exists() for marker in ROOT_MARKERS):
            return candidate
    return here


def import_folders(folder: Path, module: Optional[ast.Module]) -> list[Path]:
    """Where the script at ``folder`` imports its project's modules from, first found first:
    its folder, the folders it puts on ``sys.path`` (``sys_path_folders``), then its project's
    root (``project_root``)."""
    out = [folder, *(sys_path_folders(folder, module) if module is not None else [])]
    root = project_root(folder)
    if all(root != f.resolve() for f in out):
        out.append(root)
    return out


def package_of(file: Path, dotted: str) -> str:
    """The package a module's relative imports start from: ``src`` for ``src.utils``
    (src/utils.py), ``src`` for ``src`` itself (src/__init__.py), "" for a top-level module."""
    if file.name == "__init__.py":
        return dotted
    return dotted.rpartition(".")[0]


def relative_base(file: Path, level: int) -> Optional[Path]:
    """The folder ``from .`` (level 1), ``from ..`` (2), ... means in the module at ``file``."""
    folder = file.parent
    return folder if level == 1 else (folder.parents[level - 2] if level - 2 < len(folder.parents) else None)


def imported_modules(folder: Optional[Path], module: ast.Module, at: Optional[Path] = None,
                     package: Optional[str] = None) -> list[tuple[str, Path]]:
    """The project's own modules that ``module`` imports at its top level (``from engine import
    train``, ``import utils``, ``from util import misc`` -- the package and its module): (dotted
    name, file), in import order, each once. Only files in the script's import folders
    (``import_folders``) are named, never an installed package; a relative import
    (``from .logger import create_logger``) only in a module of the project found so
    (``at``: its file, ``package``: its dotted package, ``package_of``)."""
    if folder is None:
        return []
    folders = import_folders(folder, module)
    out: dict[str, Path] = {}

    def add(bases: list[Path], dotted: str, shown: str) -> None:
        path = next((p for p in (_file(f, dotted) for f in bases) if p is not None), None)
        if path is not None and shown not in out:
            out[shown] = path

    for node in module.body:
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            add(folders, node.module, node.module)
            for alias in node.names:
                if alias.name != "*" and _file_in(folders, f"{node.module}.{alias.name}") is not None:
                    add(folders, f"{node.module}.{alias.name}", f"{node.module}.{alias.name}")
        elif isinstance(node, ast.ImportFrom) and node.level > 0 and at is not None and package is not None:
            base = relative_base(at, node.level)
            if base is None:
                continue
            prefix = package.split(".")[: max(0, len(package.split(".")) - (node.level - 1))] if package else []
            stem = [*prefix, *([node.module] if node.module else [])]
            if node.module:
                add([base], node.module, ".".join(stem))
            for alias in node.names:
                if alias.name != "*":
                    inner = ".".join(p for p in (node.module, alias.name) if p)
                    if _file(base, inner) is not None:
                        add([base], inner, ".".join([*stem, alias.name]))
        elif isinstance(node, ast.Import):
            for alias in node.names:
                add(folders, alias.name, alias.name)
    return list(out.items())


def _file_in(folders: list[Path], dotted: str) -> Optional[Path]:
    return next((p for p in (_file(f, dotted) for f in folders) if p is not None), None)


def sys_path_folders(folder: Path, module: ast.Module) -> list[Path]:
    """Folders the script puts on ``sys.path`` at its top level before it imports from them:
    ``sys.path.append("..")``, ``sys.path.insert(0, os.path.join(os.path.dirname(__file__),
    ".."))``, ``sys.path.append(str(Path(__file__).resolve().parent.parent))``; a relative path is
    taken from the script's folder, where its user runs it. What can't be read that way is
    left out (the import then stays one the analysis can't see into, as before)."""
    out = []
    for node in module.body:
        call = node.value if isinstance(node, ast.Expr) and isinstance(node.value, ast.Call) else None
        if call is None or not isinstance(call.func, ast.Attribute) or call.func.attr not in ("append", "insert") \
                or ast.unparse(call.func.value) != "sys.path" or not call.args:
            continue
        where = _path_of(folder, call.args[-1])
        if where is not None and where.is_dir() and where not in out and where != folder:
            out.append(where)
    return out


def _path_of(folder: Path, node: ast.expr) -> Optional[Path]:
    """The folder an expression of ``__file__``, ``os.path`` and ``pathlib`` names, or None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return (folder / node.value).resolve()
    if isinstance(node, ast.Name) and node.id == "__file__":
        return folder.resolve() / "__file__"  # the script itself: its parent is the folder
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in ("os.path.abspath", "os.path.realpath", "os.path.normpath", "str", "Path", "pathlib.Path") \
                and len(node.args) == 1:
            return _path_of(folder, node.args[0])
        if name == "os.path.dirname" and len(node.args) == 1:
            inner = _path_of(folder, node.args[0])
            return inner.parent if inner is not None else None
        if name == "os.path.join" and node.args:
            base = _path_of(folder, node.args[0])
            parts = [a.value for a in node.args[1:] if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            return (base.joinpath(*parts)).resolve() if base is not None and len(parts) == len(node.args) - 1 \
                else None
        if isinstance(node.func, ast.Attribute) and node.func.attr in ("resolve", "absolute") and not node.args:
            return _path_of(folder, node.func.value)
    if isinstance(node, ast.Attribute) and node.attr == "parent":
        inner = _path_of(folder, node.value)
        return inner.parent if inner is not None else None
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and node.value.attr == "parents" \
            and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, int):
        inner = _path_of(folder, node.value.value)
        return inner.parents[node.slice.value] if inner is not None and node.slice.value < len(inner.parents) \
            else None
    return None


def imported_files(path: Path, source: str) -> list[Path]:
    """The files of the project's own modules that the script at ``path`` imports, and those
    they import in turn (``candidates``): what its rewrite may read besides itself, so a cache of
    its result must be keyed by them too."""
    def text_of(file: Path) -> Optional[str]:
        try:
            return file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    return candidates(Path(path), source, text_of)


#: at most this many modules are analysed with one script
MAX_MODULES = 16


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


def changed_names(before: str, after: str) -> Optional[frozenset[str]]:
    """The top-level names of a module whose definitions differ between ``before`` and
    ``after`` (functions, classes, assigned names; an import added or gone changes none); None
    when another top-level statement changes, or a text does not parse."""
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
    other scripts given import too (resolved path -> their names), never changed; ``alone``: why
    none may change."""

    writable: frozenset[str] = frozenset()
    follow: bool = False
    shared: tuple[tuple[str, str], ...] = ()
    #: why no other file may change, whatever the options (a script on stdin, a notebook)
    alone: Optional[str] = None
    auto: bool = False
    root: str = ""
    known: frozenset[str] = frozenset()
    script: str = ""

    def compatible_change(self, path: str) -> bool:
        """Whether ``path`` may change compatibly where it may not change as the conversion
        would (codemod/project/compat.py): only where it would be refused for the other files of the
        repository that import it (``auto``), not where the user kept to the paths given, nor
        for a module another script given imports (converted too, it changes for that one)."""
        real = os.path.realpath(path)
        return self.alone is None and self.auto and not self.follow and real not in self.writable \
            and all(shared != real for shared, _ in self.shared)

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
        for shared, others in self.shared:
            if shared == real:
                return (f"it would change {path}, which {others} import as well: changed for one "
                        "script, it would break the other")
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


def candidates(path: Path, source: str, text_of: Callable[[Path], Optional[str]]) -> list[Path]:
    """The files of the project's own modules that the script at ``path`` imports at its top
    level (``from X import ...``, ``import X``), and those they import so, in turn (relatively
    too): Python's ``ast`` only, no analysis (``text_of(file)``: a file's text, or None)."""
    look_again()
    folder = path.parent
    seen: dict[str, Path] = {}
    todo: list[tuple[Optional[str], Optional[Path], Optional[str]]] = [(source, None, None)]
    while todo and len(seen) < MAX_MODULES:
        text, at, package = todo.pop(0)
        if text is None or "import" not in text:
            continue
        tree = top_level_imports(text)  # what imported_modules reads (codemod/tree/toplevel.py)
        if tree is None:
            continue
        for dotted, file in imported_modules(folder, tree, at, package):
            if dotted in seen or os.path.realpath(file) == os.path.realpath(path):
                continue
            seen[dotted] = file
            todo.append((text_of(file), file, package_of(file, dotted)))
    return list(seen.values())
