"""A followed module's names, read with Python's ``ast`` and ``symtable``: what it binds and
imports at its top level (``_top_names``, ``_imports_of``), which of its functions and classes
the program reaches (``_needed``), whether two imports mean one object (``_same_meaning``), and
how an importer reads it: through a name (``import engine as E``, ``_reads_through``) or under
another name (``from utils import A as B``, ``_renamable``). The analysis reads those spellings
bare (``_Dealias``); each file gets its own back (``Realias``). codemod/project/program.py decides
with these which modules are followed and builds the program from them."""

from __future__ import annotations

import ast
import symtable
from functools import lru_cache
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.tree.toplevel import python_tree
from accelerate_rewrite.codemod.tree.walk import Along

def _reads_through(code: str, through: str, names: set[str]) -> tuple[set[str], Optional[str]]:
    """The names ``code`` reads as ``through.name`` (each one of ``names``), or why the module
    read through ``through`` can't be followed: ``through`` read otherwise (``print(E)``,
    ``E.x = 1``), bound again, or a name it reads so also a name of the script's own (a local
    ``train`` beside ``E.train``), or spelled other than ``E.name``."""
    attributes, bare, others = _spelled(code)
    used: set[str] = set()
    for attr, loaded, exact in attributes.get(through, ()):
        if attr not in names:
            return used, f"`{through}.{attr}` is not defined at its top level"
        if not loaded:
            return used, f"the script assigns `{through}.{attr}`"
        if not exact:  # its code is more than ``through.name``: ``E . x``, ``(E).x``, a line break
            return used, f"`{through}.{attr}` is spelled with spaces or a line break"
        used.add(attr)
    if through in bare:
        return used, f"`{through}` is read other than as `{through}.name`"
    clash = sorted(used & others)
    if clash:
        return used, f"`{clash[0]}` is both `{through}.{clash[0]}` and a name of the script"
    return used, None


@lru_cache(maxsize=16)  # (an importer is asked of each module it reads through a name, in each program)
def _spelled(code: str) -> tuple[dict[str, list[tuple[str, bool, bool]]], frozenset[str], frozenset[str]]:
    """What ``_reads_through`` reads of ``code``, in one walk: each ``base.attr`` of a bare name,
    by base, in the walk's order (the attribute, whether it is read, whether its code is
    ``base.attr`` exactly); the names read otherwise than as such a base; and every name the
    code binds or reads (its own)."""
    tree = python_tree(code)
    attributes: dict[str, list[tuple[str, bool, bool]]] = {}
    bases: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
            exact = node.end_lineno == node.lineno and (node.end_col_offset or 0) - node.col_offset \
                == len(f"{node.value.id}.{node.attr}".encode("utf-8"))  # (the columns count bytes)
            attributes.setdefault(node.value.id, []).append((node.attr, isinstance(node.ctx, ast.Load), exact))
            bases.add(id(node.value))
    bare: set[str] = set()
    others: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            if id(node) not in bases:
                bare.add(node.id)
            others.add(node.id)
        elif isinstance(node, ast.arg):
            others.add(node.arg)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            others.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            others.update(node.names)
        elif isinstance(node, ast.alias):
            others.add(node.asname or node.name.split(".")[0])
    return attributes, frozenset(bare), frozenset(others)


class _Renaming(Along, cst.CSTTransformer):
    """What the project's two name transformers share: the names that are not read as names
    (an attribute's, a keyword's, an imported name's own) are kept; each says which nodes it may
    change (``changes``: ``Along`` goes only along the paths to them)."""

    def __init__(self) -> None:
        super().__init__()
        self.kept: set[int] = set()

    def visit_Attribute(self, node: cst.Attribute) -> None:
        self.kept.add(id(node.attr))

    def visit_Arg(self, node: cst.Arg) -> None:
        if node.keyword is not None:
            self.kept.add(id(node.keyword))

    def visit_ImportAlias(self, node: cst.ImportAlias) -> None:
        self.kept.add(id(node.name))  # ``from utils import A as B``: the module's name for it


class _Dealias(_Renaming):
    """``E.train`` -> ``train`` and, for ``from utils import A as B``, ``B`` -> ``A``, for the
    analysis."""

    def __init__(self, aliases: dict[str, str], renames: Optional[dict[str, str]] = None) -> None:
        super().__init__()
        self.aliases = aliases
        self.back = {file: analysis for analysis, file in (renames or {}).items()}
        self.through = set(aliases.values())

    def changes(self, node: cst.CSTNode) -> bool:
        """``E.train``, a ``B`` of ``from utils import A as B``."""
        return (type(node) is cst.Attribute and type(node.value) is cst.Name and node.value.value in self.through) \
            or (type(node) is cst.Name and node.value in self.back)

    def leave_Attribute(self, original: cst.Attribute, updated: cst.Attribute) -> cst.BaseExpression:
        if (isinstance(updated.value, cst.Name) and self.aliases.get(updated.attr.value) == updated.value.value
                and not updated.value.lpar):
            return cst.Name(updated.attr.value, lpar=updated.lpar, rpar=updated.rpar)
        return updated

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        analysis = self.back.get(updated.value)
        if analysis is None or id(original) in self.kept:
            return updated
        return updated.with_changes(value=analysis)

    def leave_ImportAlias(self, original: cst.ImportAlias, updated: cst.ImportAlias) -> cst.ImportAlias:
        """``from apex import amp`` in a module whose ``amp`` the analysis reads as
        ``amp__utils``: ``from apex import amp as amp__utils``, so that the name it binds is the
        one read there, and is still apex's."""
        if updated.asname is None and isinstance(updated.name, cst.Name) and updated.name.value in self.back:
            return updated.with_changes(asname=cst.AsName(cst.Name(self.back[updated.name.value])))
        return updated


class Realias(_Renaming):
    """``train`` -> ``E.train`` again in the file: every ``train`` read there came from ``E.train``
    (``_reads_through`` made sure the script has no name of its own so); and ``A`` -> ``B`` for
    ``from utils import A as B`` (``_renamable`` made sure ``A`` is no other name there)."""

    def __init__(self, aliases: dict[str, str], renames: Optional[dict[str, str]] = None) -> None:
        super().__init__()
        self.aliases = aliases
        self.renames = renames or {}

    def changes(self, node: cst.CSTNode) -> bool:
        """The names it reads back through a module, or renames."""
        return type(node) is cst.Name and (node.value in self.renames or node.value in self.aliases)

    def leave_ImportAlias(self, original: cst.ImportAlias, updated: cst.ImportAlias) -> cst.ImportAlias:
        """``from apex import amp as amp__utils`` (``_Dealias``) is ``from apex import amp`` again."""
        if updated.asname is not None and isinstance(updated.name, cst.Name) \
                and m.matches(updated.asname.name, m.Name(updated.name.value)):
            return updated.with_changes(asname=None)
        return updated

    def leave_Name(self, original: cst.Name, updated: cst.Name) -> cst.BaseExpression:
        if id(original) in self.kept:
            return updated
        renamed = self.renames.get(updated.value)
        if renamed is not None:
            return updated.with_changes(value=renamed)
        through = self.aliases.get(updated.value)
        if through is None:
            return updated
        return cst.Attribute(value=cst.Name(through), attr=cst.Name(updated.value), lpar=updated.lpar,
                             rpar=updated.rpar)


def _renamable(code: str, analysis: str, own: str) -> Optional[str]:
    """Why ``from X import analysis as own`` can't be read as ``analysis`` in ``code``: ``own``
    is bound there otherwise too, or ``analysis`` is a name of it already."""
    tree = python_tree(code)
    binds = 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and node.id == analysis:
            return f"`{analysis}` is a name of its own there too"
        if isinstance(node, ast.arg) and node.arg in (analysis, own):
            return f"`{node.arg}` is a parameter there too"
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)) and node.name in (analysis, own):
            return f"`{node.name}` is defined there too"
        if isinstance(node, ast.alias) and (node.asname or node.name.split(".")[0]) in (analysis, own):
            binds += 1
        if isinstance(node, ast.Name) and node.id == own and not isinstance(node.ctx, ast.Load):
            return f"`{own}` is assigned there too"
        if isinstance(node, (ast.Global, ast.Nonlocal)) and {analysis, own} & set(node.names):
            return f"`{own}` is declared global there"
    return None if binds == 1 else f"`{own}` is imported there more than once"


def _imports_of(code: str, package: str = "") -> dict[str, frozenset[str]]:
    """name -> what the import statements at the top level of ``code`` (and in its top-level
    ``if`` and ``try`` blocks) bind it to, one spelling for one object: ``import torch.nn as
    nn`` and ``from torch import nn`` both ``torch.nn``; a relative import from ``package``
    (``from .logger import create_logger`` in src/ -> ``src.logger.create_logger``)."""
    out: dict[str, set[str]] = {}
    try:
        tree = python_tree(code)
    except (SyntaxError, ValueError):
        return {}
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.asname or a.name.split(".")[0]
                out.setdefault(name, set()).add(a.name if a.asname else name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".") if package else []
                keep = len(parts) - (node.level - 1)
                base = (".".join([*parts[:keep], *([node.module] if node.module else [])]) if keep >= 0
                        else f"{'.' * node.level}{node.module or ''}")  # above the top: kept apart
            else:
                base = node.module or ""
            for a in node.names:
                out.setdefault(a.asname or a.name, set()).add(".".join(p for p in (base, a.name) if p))
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                        + [s for h in getattr(node, "handlers", []) for s in h.body])
    return {name: frozenset(meanings) for name, meanings in out.items()}


@lru_cache(maxsize=16)  # (a module's text is asked of where it is read through a name, and followed)
def _top_names(code: str) -> tuple[frozenset[str], frozenset[str]]:
    """(names the module binds at its top level otherwise than by an import, names it imports)."""
    table = symtable.symtable(code, "<module>", "exec")
    own, imported = set(), set()
    for s in table.get_symbols():
        if s.is_assigned() or s.is_namespace():
            own.add(s.get_name())
        elif s.is_imported():
            imported.add(s.get_name())
    return frozenset(own), frozenset(imported)


def _needed(code: str, wanted: set[str]) -> Optional[set[str]]:
    """The top-level functions and classes of a module that the names ``wanted`` of it reach,
    directly or through one another, and those its other top-level statements read: the rest is
    code the importing program never runs by name (another script's ``main`` in a module that is
    also a script), left out of the analysis (its file keeps it). None where a name is read
    otherwise than by name (``globals()``, ``getattr(module, ...)``)."""
    try:
        defs, top = _reads_of(code)
    except (SyntaxError, ValueError):
        return None
    todo = set(wanted) | top
    if "globals" in todo or "__all__" in todo:
        return None
    needed: set[str] = set()
    while todo:
        name = todo.pop()
        if name in needed or name not in defs:
            continue
        needed.add(name)
        todo |= defs[name]
    return needed


@lru_cache(maxsize=16)  # (each program that follows the module asks, with the names it wants)
def _reads_of(code: str) -> tuple[dict[str, frozenset[str]], frozenset[str]]:
    """The names each top-level function and class of ``code`` reads (the last of a name), and
    those its other top-level statements read."""
    tree = python_tree(code)
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}

    def reads(node: ast.AST) -> frozenset[str]:
        return frozenset(n.id for n in ast.walk(node) if isinstance(n, ast.Name))

    kinds = tuple(type(d) for d in defs.values())
    top = frozenset(name for n in tree.body if not isinstance(n, kinds) for name in reads(n))
    return {name: reads(node) for name, node in defs.items()}, top


def _own_name(name: str, dotted: str) -> str:
    """The name the analysis reads a module's ``name`` by, where another file of the project
    defines ``name`` too: ``logger`` of src/utils.py -> ``logger__src_utils``."""
    return f"{name}__{dotted.replace('.', '_')}"


def _same_meaning(these: frozenset[str], those: frozenset[str]) -> bool:
    """Two imports of a library's one object: the same spelling, or the same name through a
    package that re-exports it (``timm.data.Mixup`` and ``timm.data.mixup.Mixup``)."""
    if these == those:
        return True
    if len(these) != 1 or len(those) != 1:
        return False
    a, b = next(iter(these)), next(iter(those))
    (pa, _, na), (pb, _, nb) = a.rpartition("."), b.rpartition(".")
    return na == nb and bool(pa) and bool(pb) and (pa.startswith(pb + ".") or pb.startswith(pa + "."))
