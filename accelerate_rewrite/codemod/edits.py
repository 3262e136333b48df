"""Edits that rules ask for, keyed by nodes of the one analysed tree, applied in one pass.

Rules never transform the tree themselves: each one reads the facts and records edits
against the original nodes. The engine applies the edits of every selected rule together,
bottom-up, so that an edit on an outer node sees the result of the edits inside it.

- ``replace(node, fn)``: ``fn(updated_node) -> node``; several replacements compose in rule order.
- ``remove(stmt)``: drop a statement; comments above it that stand apart (a blank line
  between them and the statement) move to the next statement, comments right on top of it
  go with it.
- ``insert_before(stmt, *new)`` / ``insert_after(stmt, *new)``: new statements around ``stmt``.
  When ``stmt`` is removed, the first statement put in its place takes over its leading lines.
- ``move_before(stmt, target)``: take ``stmt`` (with the edits inside it applied) out of its
  place and put it right before ``target``, a statement that encloses it (out of a loop).
- ``wrap(stmts, make)``: consecutive statements of one block (with the edits inside them
  applied) become the body of the compound statement ``make(body)`` builds, e.g. a
  ``with torch.autocast(...):``; the comments above the first one go above the new statement.
- ``add_import(module, name)``: ``import module`` / ``from module import name``, unless the
  module already imports it at its top level; the new import goes right after the last import of
  the block of imports at the top of the module (after its docstring; an import-only ``try`` is
  part of the block), or into a ``from module import ...`` of that block, or after the docstring
  when there is no such block: never above an import of the script (``import comet_ml`` must come
  before torch). The statement after the new imports gets a blank line above it.
- ``remove_import_if_unused(module, name)``: that import goes (the name alone from a
  ``from module import a, name``) where the result no longer reads the name it binds.

Both are ordinary edits of the one pass over the tree, planned on the top-level statements and
a scan of the names the result reads: no recursive walk over a module's statements (LibCST's
AddImportsVisitor matches the body with a recursive sequence matcher that overflows the stack on
about 1,000 top-level statements).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import libcst as cst
import libcst.matchers as m

Replacement = Callable[[cst.CSTNode], cst.CSTNode]
Wrapper = Callable[[list[cst.BaseStatement]], cst.BaseCompoundStatement]


@dataclass
class EditSet:
    """The edits of one rule."""

    replacements: dict[int, list[Replacement]] = field(default_factory=dict)
    removals: set[int] = field(default_factory=set)
    before: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    after: dict[int, list[cst.BaseStatement]] = field(default_factory=dict)
    moves: dict[int, list[int]] = field(default_factory=dict)  # id(target) -> ids of moved statements
    imports: list[tuple[str, Optional[str], Optional[str]]] = field(default_factory=list)
    unused_imports: list[tuple[str, Optional[str]]] = field(default_factory=list)
    wraps: list[tuple[list[int], Wrapper]] = field(default_factory=list)  # ids of statements, maker
    #: removed statements whose blank lines go with them (an unused import, as LibCST's
    #: RemoveImportsVisitor dropped it); comments standing apart above them still stay
    quiet_removals: set[int] = field(default_factory=set)
    # id() keys are only meaningful while the nodes are alive: keep them referenced.
    _keep: list[cst.CSTNode] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.replacements or self.removals or self.before or self.after or self.imports
                    or self.moves or self.wraps)

    def _key(self, node: cst.CSTNode) -> int:
        self._keep.append(node)
        return id(node)

    def replace(self, node: cst.CSTNode, new: Union[cst.CSTNode, Replacement]) -> None:
        fn = new if callable(new) else (lambda _updated, _new=new: _new)
        self.replacements.setdefault(self._key(node), []).append(fn)

    def remove(self, stmt: cst.BaseStatement) -> None:
        self.removals.add(self._key(stmt))

    def insert_before(self, stmt: cst.BaseStatement, *new: cst.BaseStatement) -> None:
        self.before.setdefault(self._key(stmt), []).extend(new)

    def insert_after(self, stmt: cst.BaseStatement, *new: cst.BaseStatement) -> None:
        self.after.setdefault(self._key(stmt), []).extend(new)

    def move_before(self, stmt: cst.BaseStatement, target: cst.BaseStatement) -> None:
        self.remove(stmt)
        self.moves.setdefault(self._key(target), []).append(self._key(stmt))

    def wrap(self, stmts: Sequence[cst.BaseStatement], make: Wrapper) -> None:
        self.wraps.append(([self._key(s) for s in stmts], make))

    def add_import(self, module: str, obj: Optional[str] = None, asname: Optional[str] = None) -> None:
        self.imports.append((module, obj, asname))

    def remove_import_if_unused(self, module: str, obj: Optional[str] = None) -> None:
        self.unused_imports.append((module, obj))


def _merge(edit_sets: Sequence[EditSet]) -> EditSet:
    merged = EditSet()
    for edits in edit_sets:
        for key, fns in edits.replacements.items():
            merged.replacements.setdefault(key, []).extend(fns)
        merged.removals |= edits.removals
        merged.quiet_removals |= edits.quiet_removals
        merged._keep.extend(edits._keep)
        for key, stmts in edits.before.items():
            merged.before.setdefault(key, []).extend(stmts)
        for key, stmts in edits.after.items():
            merged.after.setdefault(key, []).extend(stmts)
        for key, moved in edits.moves.items():
            merged.moves.setdefault(key, []).extend(moved)
        merged.imports.extend(edits.imports)
        merged.unused_imports.extend(edits.unused_imports)
        merged.wraps.extend(edits.wraps)
    return merged


def _is_blank(line: cst.EmptyLine) -> bool:
    return line.comment is None


class _Apply(cst.CSTTransformer):
    def __init__(self, edits: EditSet) -> None:
        super().__init__()
        self.edits = edits
        self.moving = {key for moved in edits.moves.values() for key in moved}
        self.moved: dict[int, cst.BaseStatement] = {}  # id(original) -> updated, on its way
        self.wrap_of = {key: (keys, make) for keys, make in edits.wraps for key in keys}

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        for fn in self.edits.replacements.get(id(original_node), ()):
            updated_node = fn(updated_node)
        if isinstance(original_node, (cst.Module, cst.IndentedBlock)):
            updated_node = self._rebuild_block(original_node, updated_node)
        return updated_node

    def _rebuild_block(self, original, updated):
        body: list[cst.BaseStatement] = []
        carried: list[cst.EmptyLine] = []  # leading lines of a removed statement, still owed
        is_module = isinstance(updated, cst.Module)
        spans: dict[int, tuple[int, int]] = {}  # id(original statement) -> what it became in body
        for index, (orig_stmt, stmt) in enumerate(zip(original.body, updated.body)):
            key = id(orig_stmt)
            before = [self.moved.pop(k).with_changes(leading_lines=[])
                      for k in self.edits.moves.get(key, ()) if k in self.moved]
            before += self.edits.before.get(key, ())
            after = list(self.edits.after.get(key, ()))
            if key in self.moving:
                self.moved[key] = stmt
            if key in self.edits.removals or _emptied_if(orig_stmt, stmt):
                placed = before + after
                if key in self.edits.quiet_removals:
                    kept = _detached_lines(stmt.leading_lines)
                    if not any(not _is_blank(line) for line in kept):
                        kept = []
                    stmt = stmt.with_changes(leading_lines=kept)
                if placed:
                    own = list(placed[0].leading_lines)
                    if stmt.leading_lines and all(_is_blank(line) for line in own):
                        own = []  # the removed statement's lines (a comment on top) already space it
                    placed[0] = placed[0].with_changes(leading_lines=[*carried, *stmt.leading_lines, *own])
                    carried = []
                else:
                    carried = carried + _detached_lines(stmt.leading_lines)
                spans[key] = (len(body), len(body) + len(placed))
                body.extend(placed)
                continue
            own = list(stmt.leading_lines)
            if carried:
                own = _join_lines(carried, own)
                carried = []
            if not body and index > 0 and not is_module:
                own = _drop_leading_blanks(own)  # the block now starts here: no blank line on top
            if own != list(stmt.leading_lines):
                stmt = stmt.with_changes(leading_lines=own)
            start = len(body)
            body.extend(before)
            body.append(stmt)
            body.extend(after)
            spans[key] = (start, len(body))
        return updated.with_changes(body=self._wrap(original, body, spans))

    def _wrap(self, original, body: list[cst.BaseStatement], spans: dict[int, tuple[int, int]]):
        groups = {id(keys): (keys, make) for s in original.body
                  for keys, make in [self.wrap_of.get(id(s), (None, None))] if keys}
        # last group first, so that the spans of the earlier ones stay valid
        for keys, make in sorted(groups.values(), key=lambda g: -spans[g[0][0]][0]):
            start, end = spans[keys[0]][0], spans[keys[-1]][1]
            inner = body[start:end]
            if not inner:
                continue
            lines = inner[0].leading_lines
            inner[0] = inner[0].with_changes(leading_lines=[])
            body[start:end] = [make(inner).with_changes(leading_lines=lines)]
        return body


def _emptied_if(original: cst.BaseStatement, updated: cst.BaseStatement) -> bool:
    """An ``if`` (its ``elif``/``else`` included) or a ``try`` left with nothing to do by the
    edits goes whole: ``if use_cuda: pass / else: pass`` after the device lines went, or
    ``try: pass / except ImportError: ...`` after the apex import went (a ``try`` whose body
    can't raise never runs its handlers). At least one branch must have been emptied by the
    edits, and an ``if`` goes only when its condition does nothing but read (names,
    attributes, comparisons, ``torch.cuda.is_available()``-style queries)."""
    if isinstance(original, cst.If) and isinstance(updated, cst.If):
        return _if_emptied(original, updated) and _emptied_somewhere(original, updated)
    if isinstance(original, cst.Try) and isinstance(updated, cst.Try):
        return (updated.orelse is None and updated.finalbody is None
                and _block_empty(updated.body) and not _block_empty(original.body))
    return False


def _block_empty(block: cst.BaseSuite) -> bool:
    return isinstance(block, cst.IndentedBlock) and all(
        m.matches(stmt, m.SimpleStatementLine(body=[m.Pass() | m.Expr(m.Ellipsis())]))
        for stmt in block.body)


def _if_emptied(original: cst.If, updated: cst.If) -> bool:
    if not _block_empty(updated.body) or not _pure(updated.test):
        return False
    orelse = updated.orelse
    if orelse is None:
        return True
    if isinstance(orelse, cst.If):
        return isinstance(original.orelse, cst.If) and _if_emptied(original.orelse, orelse)
    return _block_empty(orelse.body)


def _emptied_somewhere(original: cst.If, updated: cst.If) -> bool:
    pairs: list[tuple[cst.BaseSuite, cst.BaseSuite]] = []
    o, u = original, updated
    while isinstance(o, cst.If) and isinstance(u, cst.If):
        pairs.append((o.body, u.body))
        o, u = o.orelse, u.orelse
    if isinstance(o, cst.Else) and isinstance(u, cst.Else):
        pairs.append((o.body, u.body))
    return any(not _block_empty(before) and _block_empty(after) for before, after in pairs)


#: calls an ``if`` condition may make and still go with its emptied branches: queries
_QUERIES = {"is_available", "device_count", "is_bf16_supported", "exists", "isfile", "isdir",
            "len", "isinstance", "hasattr", "getattr", "get", "getenv"}


def _pure(test: cst.BaseExpression) -> bool:
    for call in m.findall(test, m.Call()):
        func = call.func
        name = func.attr.value if isinstance(func, cst.Attribute) else getattr(func, "value", None)
        if name not in _QUERIES:
            return False
    return not m.findall(test, m.NamedExpr() | m.Await() | m.Yield())


def _detached_lines(lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    """The leading lines of a removed statement that don't describe it: everything down to
    the last blank line (the comment block right on top of the statement goes with it)."""
    lines = list(lines)
    while lines and not _is_blank(lines[-1]):
        lines.pop()
    return lines


def _drop_leading_blanks(lines: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    lines = list(lines)
    while lines and _is_blank(lines[0]):
        lines.pop(0)
    return lines


def _join_lines(carried: list[cst.EmptyLine], own: Sequence[cst.EmptyLine]) -> list[cst.EmptyLine]:
    if any(not _is_blank(line) for line in carried):
        return [*carried, *own]
    # only blank lines are owed: keep the statement's own spacing if it has some
    return list(own) if own else carried[-1:]


def apply_edits(
    module: cst.Module,
    edit_sets: Iterable[EditSet],
    touched: Optional[list[tuple[cst.CSTNode, bool]]] = None,
    *,
    imports_read: bool = False,
) -> cst.Module:
    """The module with the edits applied; ``touched`` (if given) gets every node of ``module``
    an edit is keyed on, with whether the edit removes it. With ``imports_read`` (one file of a
    project, codemod/project.py), only the imports whose names the result reads are added: the
    edits of the other files ask for theirs."""
    edit_sets = list(edit_sets)
    edits = _merge(edit_sets)
    if not edits and not edits.unused_imports:
        return module
    if imports_read and edits.imports:
        trial = _merge(edit_sets)
        trial.imports = []
        names = _Names()
        module.visit(_Apply(trial)).visit(names)
        edits.imports = [w for w in edits.imports if _bound_by(w) in names.names]
    added = _plan_imports(module, edits) if edits.imports else []
    new = module.visit(_Apply(edits))
    if edits.unused_imports and _plan_unused_imports(module, new, edits):
        new = module.visit(_Apply(edits))
    if added:
        new = _blank_line_after(new, added)
    if touched is not None:
        seen: set[int] = set()
        for node in edits._keep:
            if id(node) not in seen:
                seen.add(id(node))
                touched.append((node, id(node) in edits.removals))
    return new


# ---- imports ------------------------------------------------------------------------------------

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


def _plan_imports(module: cst.Module, edits: EditSet) -> list[cst.SimpleStatementLine]:
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


def _blank_line_after(module: cst.Module, added: Sequence[cst.CSTNode]) -> cst.Module:
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


class _Names(cst.CSTVisitor):
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


class _Imports(cst.CSTVisitor):
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


def _bound_by(wanted: tuple[str, Optional[str], Optional[str]]) -> str:
    """The name an import asked for binds: ``(module, name, asname)``."""
    module, obj, asname = wanted
    return asname or obj or module.split(".")[0]


def _binds(alias: cst.ImportAlias, is_from: bool) -> str:
    name = _alias_name(alias)
    if name is not None:
        return name
    dotted = _dotted(alias.name)
    return dotted if is_from else dotted.split(".")[0]


def _plan_unused_imports(module: cst.Module, result: cst.Module, edits: EditSet) -> bool:
    """Edits that drop the requested imports ``result`` no longer reads; whether there are any."""
    visitor = _Imports()
    module.visit(visitor)
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
    names = _Names()
    result.visit(names)
    planned = False
    for stmt, block, imp, gone in candidates:
        unused = [a for a in gone if _binds(a, isinstance(imp, cst.ImportFrom)) not in names.names]
        if not unused:
            continue
        planned = True
        drop = {_binds(a, isinstance(imp, cst.ImportFrom)) for a in unused}
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
    kept = [a for a in imp.names if _binds(a, is_from) not in drop]
    if not kept:
        return line
    if kept[-1] is not imp.names[-1]:  # the old last name's trailing comma (if any) stays with it
        kept[-1] = kept[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return line.with_changes(body=[imp.with_changes(names=kept)])
