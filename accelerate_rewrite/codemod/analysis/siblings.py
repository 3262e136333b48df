"""The script's own modules, next to it (``from utils import make_loaders``, ``import data``):
read with Python's ``ast``, only far enough to see which of a function's results are DataLoaders.

A loader that a sibling module builds and returns is set up where the script binds the result,
as one built by a helper of the script itself (codemod/analysis/returns.py). Only files in the script's
folder (``utils.py``, ``data/loaders.py``, ``data/__init__.py``) are read, never an installed
package, and never changed.

Which of those modules a script imports (``candidates``, ``imported_files``) is here too, with
``ast`` only: the runner and the cache read it on every run, and a run answered from the cache
must not load libcst (codemod/project/program.py, the analysis of a script with its modules,
does). Which of them may change with it (``Scope``): codemod/analysis/importers.py.
"""

from __future__ import annotations

import ast
import os
from functools import lru_cache
from pathlib import Path
from typing import Callable, Optional

from accelerate_rewrite.codemod.analysis.libraries import is_library
from accelerate_rewrite.codemod.tree.toplevel import top_level_imports


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
    return parsed_file(path) if path is not None else None


def parsed_file(path: Path) -> Optional[ast.Module]:
    """Python's parse of the file at ``path`` (kept while it is unchanged), or None."""
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


def loader_results(folder: Optional[Path], dotted: str, name: str, depth: int = 0,
                   literals: tuple = ()) -> Optional[tuple[bool, ...]]:
    """For ``name`` defined at the top of the sibling module ``dotted``: which elements of what
    it returns are DataLoaders (built there, returned directly or by name, or what a function it
    returns the result of returns: SimMIM's ``data/__init__.py``, ``if is_pretrain: return
    build_loader_simmim(config, logger)``, imported from ``.data_simmim``); None when none are,
    the returns disagree, or the module is not a file next to the script. ``literals``: the
    True/False the call passes, by position (an int) or keyword (a str), as ``(where, value)``
    pairs: a return under ``if <that parameter>:`` on the other side is never reached
    (SimMIM's ``build_loader(config, logger, is_pretrain=True)``)."""
    if folder is None or depth > 3:
        return None
    module = _module(folder, dotted)
    if module is None:
        return None
    func = next((n for n in module.body if isinstance(n, ast.FunctionDef) and n.name == name), None)
    if func is None:  # a package's ``__init__.py`` that imports it from one of its modules
        where = _defined_at(folder, dotted, module, name)
        return loader_results(folder, *where, depth + 1, literals) if where is not None and where[0] else None
    nodes = list(_own_nodes(func))
    built = {n.targets[0].id for n in nodes if isinstance(n, ast.Assign) and len(n.targets) == 1
             and isinstance(n.targets[0], ast.Name) and _is_loader_call(n.value)}
    rebound = {t.id for n in nodes if isinstance(n, ast.Assign) and not _is_loader_call(n.value)
               for t in n.targets if isinstance(t, ast.Name)}
    shapes = []
    for ret in _live_returns(func, literals):
        if ret.value is None:
            return None
        if isinstance(ret.value, ast.Call) and isinstance(ret.value.func, ast.Name):
            where = _defined_at(folder, dotted, module, ret.value.func.id)
            passed = loader_results(folder, where[0], where[1], depth + 1) if where is not None else None
            if passed is not None:
                shapes.append(passed)
                continue
        elements = ret.value.elts if isinstance(ret.value, ast.Tuple) else [ret.value]
        shapes.append(tuple(_is_loader_call(e) or (isinstance(e, ast.Name) and e.id in built
                                                   and e.id not in rebound) for e in elements))
    if not shapes or any(s != shapes[0] for s in shapes) or not any(shapes[0]):
        return None
    return shapes[0]


def _live_returns(func: ast.FunctionDef, literals: tuple) -> list[ast.Return]:
    """The function's own returns, less those on the side of an ``if <parameter>:`` (or ``if not
    <parameter>:``) that the call's literal True/False for that parameter never takes."""
    params = [a.arg for a in func.args.args]
    known = {}
    for where, value in literals:
        name = params[where] if isinstance(where, int) and where < len(params) else where
        if isinstance(name, str):
            known[name] = value
    out: list[ast.Return] = []

    def walk(stmts: list[ast.stmt]) -> None:
        for stmt in stmts:
            if isinstance(stmt, ast.Return):
                out.append(stmt)
            elif isinstance(stmt, ast.If):
                test, negate = stmt.test, False
                if isinstance(test, ast.UnaryOp) and isinstance(test.op, ast.Not):
                    test, negate = test.operand, True
                if isinstance(test, ast.Name) and test.id in known:
                    walk(stmt.body if known[test.id] != negate else stmt.orelse)
                else:
                    walk(stmt.body)
                    walk(stmt.orelse)
            elif isinstance(stmt, (ast.For, ast.While, ast.With, ast.Try)):
                for block in ("body", "orelse", "finalbody", "handlers"):
                    inner = getattr(stmt, block, [])
                    walk([s for h in inner for s in h.body] if block == "handlers" else inner)
            elif not isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                todo = [stmt]  # any other statement (``match``, ``async for``): every return in it
                while todo:
                    node = todo.pop()
                    if isinstance(node, ast.Return):
                        out.append(node)
                    elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
                        todo.extend(ast.iter_child_nodes(node))

    walk(func.body)
    return out


def _defined_at(folder: Path, dotted: str, module: ast.Module, name: str) -> Optional[tuple[str, str]]:
    """The module (dotted, from ``folder``) and name of the function ``name`` means at the top of
    ``module``: one of its own, or one it imports from a module of the project (``from
    .data_simmim import build_loader_simmim``, relative to its package)."""
    if any(isinstance(n, ast.FunctionDef) and n.name == name for n in module.body):
        return dotted, name
    file = _file(folder, dotted)
    package = dotted if file is not None and file.name == "__init__.py" else dotted.rpartition(".")[0]
    for node in module.body:
        if not isinstance(node, ast.ImportFrom):
            continue
        for alias in node.names:
            if (alias.asname or alias.name) != name:
                continue
            if node.level == 0:
                return (node.module, alias.name) if node.module else None
            base = package.split(".") if package else []
            base = base[:len(base) - (node.level - 1)] if node.level > 1 else base
            if node.level - 1 > len(package.split(".") if package else []):
                return None
            return ".".join([*base, *([node.module] if node.module else [])]), alias.name
    return None


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
    its folder, the folders it puts on ``sys.path`` (``sys_path_folders``), the folder above its
    own package (a script inside a package runs as ``python -m pkg.main`` from there), then its
    project's root (``project_root``) and the folders the project installs its packages from
    (``src/``, setuptools' ``where`` and ``package-dir``: ``source_folders``)."""
    out = [folder, *(sys_path_folders(folder, module) if module is not None else [])]
    top = folder.resolve()
    while (top / "__init__.py").is_file() and top.parent != top:
        top = top.parent
    root = project_root(folder)
    for extra in (top, root, *source_folders(root)):
        if all(extra != f.resolve() for f in out):
            out.append(extra)
    return out


@lru_cache(maxsize=64)
def source_folders(root: Path) -> tuple[Path, ...]:
    """The folders under the project's root its packages are installed from: what
    pyproject.toml's ``[tool.setuptools.packages.find] where`` and ``package-dir`` name, and
    ``src/`` (the src layout), where they are folders."""
    names: list[str] = []
    try:
        import tomllib

        with open(root / "pyproject.toml", "rb") as fh:
            setuptools = tomllib.load(fh).get("tool", {}).get("setuptools", {})
        found = setuptools.get("packages", {})
        if isinstance(found, dict):
            names += [w for w in found.get("find", {}).get("where", []) if isinstance(w, str)]
        names += [d for d in setuptools.get("package-dir", {}).values() if isinstance(d, str)]
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    names.append("src")
    out = []
    for name in names:
        path = (root / name).resolve()
        if name not in ("", ".") and path.is_dir() and path not in out:
            out.append(path)
    return tuple(out)


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
