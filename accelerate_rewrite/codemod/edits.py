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
- ``add_import(module, name)`` / ``remove_import_if_unused(module, name)``: through LibCST's
  AddImportsVisitor / RemoveImportsVisitor.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import libcst as cst
from libcst.codemod import CodemodContext
from libcst.codemod.visitors import AddImportsVisitor, RemoveImportsVisitor

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
                if placed:
                    placed[0] = placed[0].with_changes(
                        leading_lines=[*carried, *stmt.leading_lines, *placed[0].leading_lines]
                    )
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
    """An ``if`` without ``else`` whose whole body the edits removed goes too."""
    return (
        isinstance(original, cst.If)
        and isinstance(updated, cst.If)
        and updated.orelse is None
        and isinstance(updated.body, cst.IndentedBlock)
        and not updated.body.body
        and bool(original.body.body)
    )


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


def apply_edits(module: cst.Module, edit_sets: Iterable[EditSet]) -> cst.Module:
    edits = _merge(list(edit_sets))
    if not edits and not edits.unused_imports:
        return module
    new = module.visit(_Apply(edits))
    if edits.imports or edits.unused_imports:
        context = CodemodContext()
        for mod, obj, asname in edits.imports:
            AddImportsVisitor.add_needed_import(context, mod, obj, asname)
        for mod, obj in edits.unused_imports:
            RemoveImportsVisitor.remove_unused_import(context, mod, obj)
        if edits.imports:
            new = AddImportsVisitor(context).transform_module(new)
        if edits.unused_imports:
            new = RemoveImportsVisitor(context).transform_module(new)
    return new
