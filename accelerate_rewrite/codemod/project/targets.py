"""Which modules of the project an import statement brings in, as Python finds them: the
folders it imports from (codemod/analysis/siblings.py: the script's own, the ones it puts on
``sys.path``, the one above its own package, ``src/`` and setuptools' ``where``), packages and
their modules, relative imports in a module of the project, and the names a package's
``__init__.py`` imports from its own modules (``from .build import make_optimizer``), read where
they are defined. codemod/project/program.py follows what this finds."""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.tree.toplevel import python_tree
from accelerate_rewrite.codemod.tree.printing import code_for
from accelerate_rewrite.codemod.analysis.siblings import _file, relative_base


def _in_folders(folders: list[Path], dotted: str) -> Optional[Path]:
    return next((p for p in (_file(f, dotted) for f in folders) if p is not None), None)


@dataclass
class _Target:
    """A module of the project that one import statement of a part brings in."""

    dotted: str  # its absolute dotted name
    file: Path
    #: ``from X import a, b`` of names of its own (None: the module is read through a name)
    imp: Optional[cst.ImportFrom] = None
    #: the name the module is read through (``import engine as E``, ``from util import misc``)
    through: Optional[str] = None
    #: the package whose ``__init__.py`` the names were imported through (``_reexported``)
    via: Optional[str] = None


def _dotted(node: cst.BaseExpression) -> str:
    return code_for(node)


def _targets(stmt: cst.CSTNode, file: Optional[Path], package: str, folders: list[Path]
             ) -> Optional[list[_Target]]:
    """The project's modules an import statement brings in, or None when it imports none (an
    installed package, or something this reading does not follow). ``file`` and ``package``:
    where the statement's module is (None for the script) and its package:

    - ``from engine import train`` (names of the module's own: read bare, as the script does);
    - ``from util import misc``, ``from . import dist_util`` (a module of a package: read
      through its name, ``misc.NativeScaler`` read as ``NativeScaler``);
    - ``import engine``, ``import engine as E``, ``import util.misc as misc`` (read through
      the name it binds);
    - relative imports in a module of the project (``from .logger import create_logger`` in
      src/utils.py), never in the script (run as a script, it has no package)."""
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1):
        return None
    node = stmt.body[0]
    if isinstance(node, cst.Import):
        if len(node.names) != 1:
            return None
        alias = node.names[0]
        dotted = _dotted(alias.name)
        if alias.asname is not None:
            if not isinstance(alias.asname.name, cst.Name):
                return None
            through = alias.asname.name.value
        elif "." in dotted:
            return None  # ``import data.loaders``: read as ``data.loaders.make``, not followed
        else:
            through = dotted
        file = _in_folders(folders, dotted)
        return [_Target(dotted, file, through=through)] if file is not None else None
    if not isinstance(node, cst.ImportFrom):
        return None
    module = _dotted(node.module) if node.module is not None else ""
    if node.relative:
        if file is None:
            return None  # the script: run as a script, it has no package
        level = len(node.relative)
        base = relative_base(file, level)
        if base is None:
            return None
        bases = [base]
        prefix = package.split(".") if package else []
        prefix = prefix[: max(0, len(prefix) - (level - 1))]
        absolute = ".".join([*prefix, *([module] if module else [])])
    else:
        bases = folders
        absolute = module
    out: list[_Target] = []
    names: list[cst.ImportAlias] = []
    if isinstance(node.names, cst.ImportStar):
        file = _in_folders(bases, module) if module else None
        return [_Target(absolute, file, imp=node)] if file is not None else None
    for alias in node.names:
        name = _dotted(alias.name)
        inner = ".".join(p for p in (module, name) if p)
        sub = _in_folders(bases, inner) if "." not in name else None
        if sub is not None and (not module or _in_folders(bases, module) is None
                                or _in_folders(bases, module).name == "__init__.py"):
            # a module of a package: read through the name it is bound to
            through = alias.asname.name.value if alias.asname is not None and isinstance(alias.asname.name, cst.Name) \
                else name
            out.append(_Target(".".join(p for p in (absolute, name) if p), sub, through=through))
        else:
            names.append(alias)
    if names:
        file = _in_folders(bases, module) if module else None
        if file is None:
            if out:
                return None  # a package's own name beside its modules: not followed
            return None
        names, moved = _reexported(file, absolute, names)
        out += [_Target(dotted, sub, imp=node.with_changes(names=aliases), via=absolute)
                for dotted, sub, aliases in moved]
        if names:
            out.insert(0, _Target(absolute, file, imp=node.with_changes(names=names)))
    return out or None


def _module_file(folder: Path, dotted: str) -> Optional[Path]:
    """The file of the module ``dotted`` of the package at ``folder`` (a name of its own there,
    ``datasets`` too, which is no library's copy)."""
    base = folder.joinpath(*dotted.split("."))
    return next((c for c in (base.with_suffix(".py"), base / "__init__.py") if c.is_file()), None)


def _reexported(init: Path, package: str, names: list[cst.ImportAlias], depth: int = 0):
    """The names a package's ``__init__.py`` imports from one of its own modules (``from .build
    import make_optimizer``, maskrcnn-benchmark's ``solver``; through a subpackage's
    ``__init__.py`` in turn, pytorch_image_classification's ``from .datasets import
    create_dataloader``): Python finds them there, and so does the reading: (the names left,
    [(the module's dotted name, its file, its names)])."""
    if init.name != "__init__.py" or depth > 3:
        return names, []
    try:
        tree = python_tree(init.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return names, []
    where: dict[str, str] = {}  # name -> the package's module that defines it
    for stmt in tree.body:
        if isinstance(stmt, ast.ImportFrom) and stmt.module and (stmt.level == 1 or (
                stmt.level == 0 and stmt.module.startswith(package + "."))):
            sub = stmt.module if stmt.level == 1 else stmt.module[len(package) + 1:]
            for alias in stmt.names:
                if alias.asname is None and alias.name != "*":
                    where[alias.name] = sub
                elif alias.name == "*":  # ``from .trainer import *`` (pytorch-template): its public names
                    for name in _public_names(_module_file(init.parent, sub)):
                        where.setdefault(name, sub)
    kept, moved = [], {}
    for alias in names:
        sub = where.get(_dotted(alias.name))
        file = _module_file(init.parent, sub) if sub is not None else None
        if file is None:
            kept.append(alias)
            continue
        dotted = f"{package}.{sub}"
        left, deeper = _reexported(file, dotted, [alias], depth + 1)
        for inner, inner_file, aliases in deeper:
            moved.setdefault((inner, inner_file), []).extend(aliases)
        if left:
            moved.setdefault((dotted, file), []).extend(left)
    return kept, [(dotted, file, aliases) for (dotted, file), aliases in moved.items()]


def _public_names(file: Optional[Path]) -> list[str]:
    """What ``from module import *`` binds: its ``__all__`` when that is a literal list, else the
    functions and classes it defines at its top level whose names don't start with ``_``."""
    if file is None:
        return []
    try:
        tree = python_tree(file.read_text(encoding="utf-8"))
    except (OSError, SyntaxError, ValueError, UnicodeDecodeError):
        return []
    for stmt in tree.body:
        if isinstance(stmt, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__all__" for t in stmt.targets):
            try:
                names = ast.literal_eval(stmt.value)
            except ValueError:
                return []
            return [n for n in names if isinstance(n, str)]
    return [stmt.name for stmt in tree.body if isinstance(stmt, (ast.FunctionDef, ast.ClassDef))
            and not stmt.name.startswith("_")]
