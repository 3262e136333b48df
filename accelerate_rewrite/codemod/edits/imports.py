"""The imports edits ask for (``add_import``, ``remove_import_if_unused``), planned for the one apply
pass of codemod/edits/edit_set.py: where a new import goes at the top of the module, and which imports
the result no longer reads. Planned on the top-level statements and a scan of the names the
result reads, with no recursive walk over a module's statements."""

from __future__ import annotations

from typing import Any, Callable, Iterable, Optional, Protocol, Sequence, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.tree.walk import LeanVisitor, read_tree



class EditSet(Protocol):
    """What the import planning reads and adds to of an edit set (codemod/edits/edit_set.py's
    EditSet): a Protocol, so that this module, which EditSet's module imports, imports nothing
    back."""

    imports: list[tuple[str, Optional[str], Optional[str]]]
    unused_imports: list[tuple[str, Optional[str]]]
    replacements: dict[int, list]
    before: dict[int, list[cst.BaseStatement]]
    after: dict[int, list[cst.BaseStatement]]
    quiet_removals: set[int]

    def _key(self, node: cst.CSTNode) -> int: ...
    def replace(self, node: cst.CSTNode, new: Any) -> None: ...
    def remove(self, stmt: cst.BaseStatement) -> None: ...



def _is_import_line(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], (cst.Import, cst.ImportFrom)))


def _is_import_try(stmt: cst.CSTNode) -> bool:
    """``try: import x`` ``except ImportError: ...``: part of a script's block of imports."""
    return (isinstance(stmt, cst.Try) and isinstance(stmt.body, cst.IndentedBlock)
            and bool(stmt.body.body) and all(_is_import_line(s) for s in stmt.body.body))


def _is_docstring(stmt: cst.CSTNode) -> bool:
    return (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.Expr) and isinstance(stmt.body[0].value, cst.SimpleString))


def _dotted(node: cst.BaseExpression) -> str:
    if isinstance(node, cst.Attribute):
        return f"{_dotted(node.value)}.{node.attr.value}"
    return node.value if isinstance(node, cst.Name) else ""


def _alias_name(alias: cst.ImportAlias) -> Optional[str]:
    return alias.asname.name.value if alias.asname is not None and isinstance(alias.asname.name, cst.Name) else None


def _top_imports(module: cst.Module) -> Iterable[Union[cst.Import, cst.ImportFrom]]:
    """The imports the module runs whenever it runs: its top-level import statements, and those
    of its top-level ``try`` blocks."""
    for stmt in module.body:
        lines = stmt.body.body if isinstance(stmt, cst.Try) and isinstance(stmt.body, cst.IndentedBlock) \
            else [stmt]
        for line in lines:
            if isinstance(line, cst.SimpleStatementLine):
                for small in line.body:
                    if isinstance(small, (cst.Import, cst.ImportFrom)):
                        yield small


def _already_imported(module: cst.Module, wanted: tuple[str, Optional[str], Optional[str]]) -> bool:
    mod, obj, asname = wanted
    for imp in _top_imports(module):
        if isinstance(imp, cst.Import) and obj is None:
            for alias in imp.names:
                name = _dotted(alias.name)
                if asname is None and _alias_name(alias) is None and (name == mod or name.startswith(mod + ".")):
                    return True
                if asname is not None and name == mod and _alias_name(alias) == asname:
                    return True
        elif isinstance(imp, cst.ImportFrom) and obj is not None and not imp.relative \
                and imp.module is not None and _dotted(imp.module) == mod:
            if isinstance(imp.names, cst.ImportStar):
                return asname is None
            if any(_dotted(a.name) == obj and _alias_name(a) == asname for a in imp.names):
                return True
    return False


def plan_imports(module: cst.Module, edits: EditSet) -> list[cst.SimpleStatementLine]:
    """Turn ``edits.imports`` into edits of the top-level statements; the new statements."""
    wanted = [w for w in dict.fromkeys(edits.imports) if not _already_imported(module, w)]
    if not wanted:
        return []
    body = list(module.body)
    start = 1 if body and (_is_docstring(body[0]) or m.matches(
        body[0], m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget(target=m.Name("__strict__"))])]))) else 0
    anchor: Optional[cst.BaseStatement] = body[start - 1] if start else None
    block: list[cst.BaseStatement] = []
    for stmt in body[start:]:
        if not (_is_import_line(stmt) or _is_import_try(stmt)):
            break
        block.append(stmt)
        anchor = stmt
    # a ``from module import ...`` of the block takes the names it lacks (as AddImportsVisitor did)
    froms: dict[str, cst.ImportFrom] = {}
    for stmt in block:
        imp = stmt.body[0] if _is_import_line(stmt) else None
        if isinstance(imp, cst.ImportFrom) and not imp.relative and imp.module is not None \
                and not isinstance(imp.names, cst.ImportStar):
            froms.setdefault(_dotted(imp.module), imp)
    plain = sorted({mod for mod, obj, asname in wanted if obj is None and asname is None})
    aliased = list(dict.fromkeys((mod, asname) for mod, obj, asname in wanted if obj is None and asname))
    names: dict[str, set[tuple[str, Optional[str]]]] = {}
    for mod, obj, asname in wanted:
        if obj is not None:
            names.setdefault(mod, set()).add((obj, asname))
    for mod, pairs in list(names.items()):
        target = froms.get(mod)
        if target is None:
            continue
        del names[mod]
        new_aliases = [cst.ImportAlias(name=cst.Name(obj), asname=cst.AsName(cst.Name(asname)) if asname else None)
                       for obj, asname in sorted(pairs, key=lambda p: (p[1] is not None, p))]
        edits.replace(target, lambda u, new=new_aliases: u.with_changes(names=[*new, *u.names]))
    config = module.config_for_parsing
    new = [cst.parse_statement(f"import {mod}", config=config) for mod in plain]
    new += [cst.parse_statement(f"import {mod} as {asname}", config=config) for mod, asname in aliased]
    new += [cst.parse_statement(f"from {mod} import " + ", ".join(
        obj if asname is None else f"{obj} as {asname}" for obj, asname in sorted(pairs, key=lambda p: (p[0], p[1] or ""))),
        config=config) for mod, pairs in sorted(names.items())]
    if not new:
        return []
    if anchor is not None:
        key = edits._key(anchor)
        edits.after[key] = [*new, *edits.after.get(key, ())]
    elif body:
        key = edits._key(body[0])
        edits.before[key] = [*new, *edits.before.get(key, ())]
    else:  # an empty module: nothing to anchor on, and nothing that needs an import
        return []
    return new  # type: ignore[return-value]


def blank_line_after(module: cst.Module, added: Sequence[cst.CSTNode]) -> cst.Module:
    """The statement after the new imports gets a blank line above it (as AddImportsVisitor did)."""
    body = list(module.body)
    ids = {id(s) for s in added}
    last = max((i for i, s in enumerate(body) if id(s) in ids), default=None)
    if last is None or last + 1 >= len(body):
        return module
    following = body[last + 1]
    lines = list(following.leading_lines)
    if lines and lines[0].comment is None:
        return module
    body[last + 1] = following.with_changes(leading_lines=[cst.EmptyLine(), *lines])
    return module.with_changes(body=body)


class NamesRead(LeanVisitor):
    """Every name the code reads or writes, outside import statements."""

    def __init__(self) -> None:
        super().__init__()
        self.names: set[str] = set()

    def visit_Import(self, node: cst.Import) -> bool:
        return False

    def visit_ImportFrom(self, node: cst.ImportFrom) -> bool:
        return False

    def visit_Name(self, node: cst.Name) -> None:
        self.names.add(node.value)

    def visit_Attribute(self, node: cst.Attribute) -> bool:
        node.value.visit(self)  # ``torch.amp.GradScaler`` reads ``torch``, not ``GradScaler``
        return False

    def visit_Arg(self, node: cst.Arg) -> bool:
        node.value.visit(self)  # a keyword's name is no name the code reads
        return False


class _Imports(LeanVisitor):
    """The import statements of a module, with the block that holds each."""

    def __init__(self) -> None:
        super().__init__()
        self.found: list[tuple[cst.SimpleStatementLine, cst.CSTNode]] = []
        self._blocks: list[cst.CSTNode] = []

    def visit_Module(self, node: cst.Module) -> None:
        self._blocks.append(node)

    def visit_IndentedBlock(self, node: cst.IndentedBlock) -> None:
        self._blocks.append(node)

    def leave_IndentedBlock(self, original_node: cst.IndentedBlock) -> None:
        self._blocks.pop()

    def visit_SimpleStatementLine(self, node: cst.SimpleStatementLine) -> bool:
        if _is_import_line(node):
            self.found.append((node, self._blocks[-1]))
        return False

    def visit_SimpleStatementSuite(self, node: cst.SimpleStatementSuite) -> bool:
        return False  # ``if x: import y`` on one line: left as it is


def bound_by(wanted: tuple[str, Optional[str], Optional[str]]) -> str:
    """The name an import asked for binds: ``(module, name, asname)``."""
    module, obj, asname = wanted
    return asname or obj or module.split(".")[0]


def binds(alias: cst.ImportAlias, is_from: bool) -> str:
    """The name an import's alias binds (``import a.b``: ``a``; ``from a import b as c``: ``c``)."""
    name = _alias_name(alias)
    if name is not None:
        return name
    dotted = _dotted(alias.name)
    return dotted if is_from else dotted.split(".")[0]


def plan_unused_imports(module: cst.Module, result: cst.Module, edits: EditSet,
                        names_of: Optional[Callable[[cst.Module], set[str]]] = None) -> bool:
    """Edits that drop the requested imports ``result`` no longer reads; whether there are any.
    ``names_of(result)``: the names it reads (``NamesRead``'s, by default its walk)."""
    visitor = read_tree(module, _Imports)
    wanted = set(edits.unused_imports)
    candidates = []
    for stmt, block in visitor.found:
        imp = stmt.body[0]
        if isinstance(imp, cst.Import):
            gone = [a for a in imp.names if (_dotted(a.name), None) in wanted]
        elif not imp.relative and imp.module is not None and not isinstance(imp.names, cst.ImportStar):
            gone = [a for a in imp.names if (_dotted(imp.module), _dotted(a.name)) in wanted]
        else:
            gone = []
        if gone:
            candidates.append((stmt, block, imp, gone))
    if not candidates:
        return False
    if names_of is not None:
        read = names_of(result)
    else:
        read = read_tree(result, NamesRead).names
    planned = False
    for stmt, block, imp, gone in candidates:
        unused = [a for a in gone if binds(a, isinstance(imp, cst.ImportFrom)) not in read]
        if not unused:
            continue
        planned = True
        drop = {binds(a, isinstance(imp, cst.ImportFrom)) for a in unused}
        if len(unused) < len(imp.names) or id(imp) in edits.replacements:  # keeps names, or gets some
            edits.replace(stmt, lambda u, drop=drop: _without_aliases(u, drop))
        elif isinstance(block, cst.IndentedBlock) and len(block.body) == 1:
            edits.replace(stmt, lambda u: u.with_changes(body=[cst.Pass()]))  # a block can't be empty
        else:
            edits.remove(stmt)
            edits.quiet_removals.add(id(stmt))
    return planned


def _without_aliases(line: cst.SimpleStatementLine, drop: set[str]) -> cst.SimpleStatementLine:
    imp = line.body[0]
    if not isinstance(imp, (cst.Import, cst.ImportFrom)) or isinstance(imp.names, cst.ImportStar):
        return line
    is_from = isinstance(imp, cst.ImportFrom)
    kept = [a for a in imp.names if binds(a, is_from) not in drop]
    if not kept:
        return line
    if kept[-1] is not imp.names[-1]:  # the old last name's trailing comma (if any) stays with it
        kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return line.with_changes(body=[imp.with_changes(names=kept)])
