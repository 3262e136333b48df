"""Edits that rules ask for, keyed by nodes of the one analysed tree, applied in one pass.

Rules never transform the tree themselves: each one reads the facts and records edits
against the original nodes. The engine applies the edits of every selected rule together,
bottom-up, so that an edit on an outer node sees the result of the edits inside it, and only
along the paths from the module down to the nodes the edits are keyed on: every other subtree
stays the same object, and the result's code reuses the code of the top-level statements the
edits leave as they were (codemod/tree/layout.py).

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

Both are ordinary edits of the one pass over the tree, planned (codemod/edits/imports.py) on the
top-level statements and a scan of the names the result reads: no recursive walk over a module's
statements (LibCST's AddImportsVisitor matches the body with a recursive sequence matcher that
overflows the stack on about 1,000 top-level statements).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable, Optional, Sequence, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.edits.imports import (
    NamesRead, blank_line_after, bound_by, plan_imports, plan_unused_imports,
)
from accelerate_rewrite.codemod.tree.walk import read_tree
from accelerate_rewrite.codemod.tree.printing import code_for

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
    #: statements of the input that went whole because the edits emptied them (``_emptied_if``:
    #: a ``try`` around an import that went), found while applying
    emptied: list[cst.CSTNode] = field(default_factory=list)

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
    def __init__(self, edits: EditSet, paths: Optional[set[int]] = None,
                 swallowed: Optional[set[int]] = None) -> None:
        super().__init__()
        self.edits = edits
        #: the keys of replacements whose result the file does not hold: an edit of a node around
        #: them rebuilt it without their code, or removed it (``swallowed``, when asked for)
        self.swallowed = swallowed
        self.done: list[tuple[int, cst.CSTNode]] = []  # (key, its result), in the order made
        self.marks: dict[int, int] = {}  # key of an edited node -> len(done) when it was visited
        #: ids of the nodes on the paths from the module to the nodes the edits are keyed on:
        #: the only ones visited (None: every node); the others are kept as they are, the same
        #: objects, so the result's code reuses theirs (codemod/tree/layout.py)
        self.paths = paths
        self.moving = {key for moved in edits.moves.values() for key in moved}
        self.moved: dict[int, cst.BaseStatement] = {}  # id(original) -> updated, on its way
        self.wrap_of = {key: (keys, make) for keys, make in edits.wraps for key in keys}

    def on_visit(self, node) -> bool:  # type: ignore[override]
        if self.paths is not None and id(node) not in self.paths:
            return False
        if self.swallowed is not None and (id(node) in self.edits.replacements or id(node) in self.edits.removals):
            self.marks[id(node)] = len(self.done)
        return True

    def _swallowing(self, original_node, updated_node, replaced: bool) -> None:
        """The replacements inside ``original_node`` that its own edit dropped: its replacement
        holds none of their code (rebuilt from other text), or it is removed (not moved)."""
        start = self.marks.pop(id(original_node), None)
        if start is None:
            return
        inner = self.done[start:]
        if id(original_node) in self.edits.removals and id(original_node) not in self.moving:
            self.swallowed.update(key for key, _ in inner)
        elif replaced and inner:
            text = _squeezed(updated_node)
            self.swallowed.update(key for key, result in inner if _squeezed(result) not in text)
        if replaced:
            self.done.append((id(original_node), updated_node))

    # no per-field methods here: LibCST need not look them up for every field it walks
    def on_visit_attribute(self, node, attribute) -> None:  # type: ignore[override]
        pass

    def on_leave_attribute(self, original_node, attribute) -> None:  # type: ignore[override]
        pass

    def on_leave(self, original_node, updated_node):  # type: ignore[override]
        if self.paths is not None and id(original_node) not in self.paths:
            return updated_node  # nothing in it is edited
        fns = self.edits.replacements.get(id(original_node), ())
        for fn in fns:
            updated_node = fn(updated_node)
        if self.swallowed is not None:
            self._swallowing(original_node, updated_node, bool(fns))
        if isinstance(original_node, (cst.Module, cst.IndentedBlock)):
            updated_node = self._rebuild_block(original_node, updated_node)
        elif isinstance(original_node, cst.If) and isinstance(updated_node, cst.If):
            updated_node = _drop_emptied_else(original_node, updated_node)
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
            emptied = key not in self.edits.removals and _emptied_if(orig_stmt, stmt)
            if emptied:
                self.edits.emptied.append(orig_stmt)
            if key in self.edits.removals or emptied:
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


def _drop_emptied_else(original: cst.If, updated: cst.If) -> cst.If:
    """``if x: ... else: <everything removed>``: no ``else: pass`` left behind; the same for the
    ``elif``s that end the chain, each emptied, whose conditions only read. The ``if``'s own
    branch must still do something (an ``if`` emptied whole goes by ``_emptied_if``), and
    nothing is dropped that holds a comment."""
    o, u = original.orelse, updated.orelse
    if u is None or _block_empty(updated.body) or not _block_empty(u.body) or _block_empty(o.body) \
            or m.findall(u, m.Comment()):
        return updated
    if isinstance(u, cst.Else) or (isinstance(u, cst.If) and isinstance(o, cst.If) and _if_emptied(o, u)):
        # the tail of the chain, ``elif device.type == "cuda": pass / else: pass``, goes whole
        return updated.with_changes(orelse=None)
    return updated


def _block_empty(block: cst.BaseSuite) -> bool:
    return isinstance(block, cst.IndentedBlock) and all(
        m.matches(stmt, m.SimpleStatementLine(body=[m.Pass() | m.Expr(m.Ellipsis())]))
        for stmt in block.body)


def _if_emptied(original: cst.If, updated: cst.If) -> bool:
    if not _block_empty(updated.body) or not only_reads(updated.test):
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
            "len", "isinstance", "hasattr", "getattr", "get", "getenv", "startswith", "endswith",
            "is_initialized"}


def only_reads(test: cst.BaseExpression) -> bool:
    """``test`` does nothing but read: names, attributes, comparisons, the queries of
    ``_QUERIES`` (an emptied ``if`` may go with it; codemod/ddp/switches.py asks the same of an
    ``if`` that only computes the rank)."""
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


def _paths(module: cst.Module, edits: EditSet,
           parent: Optional[Callable[[cst.CSTNode], Optional[cst.CSTNode]]]) -> Optional[set[int]]:
    """The ids of the nodes from ``module`` down to each node an edit is keyed on; None (visit
    every node) without ``parent``, or where a keyed node is of no tree ``parent`` knows. For
    one file of a project (``module`` made of the analysed module's statements), the nodes of
    the other files lead up to the analysed module, not to a statement of ``module``."""
    if parent is None:
        return None
    top = {id(stmt) for stmt in module.body}
    out = {id(module)}
    for node in edits._keep:
        current: Optional[cst.CSTNode] = node
        while id(current) not in out:
            out.add(id(current))
            if id(current) in top:
                break
            above = parent(current)
            if above is None:
                if isinstance(current, cst.Module):
                    break  # a node of another file of the project: not in this one
                return None
            current = above
    return out


def _apply(module: cst.Module, edits: EditSet, parent, swallowed: Optional[set[int]] = None) -> cst.Module:
    return module.visit(_Apply(edits, _paths(module, edits, parent), swallowed))


def _squeezed(node: cst.CSTNode) -> str:
    """A node's code without whitespace: what a rebuilt node holds of it, however laid out."""
    if isinstance(node, cst.RemovalSentinel) or node is None:
        return ""
    return "".join(code_for(node).split())


def names_read(node: cst.CSTNode) -> frozenset[str]:
    """The names ``node`` reads or writes, outside import statements (``NamesRead``)."""
    return frozenset(read_tree(node, NamesRead).names)


def apply_edits(
    module: cst.Module,
    edit_sets: Iterable[EditSet],
    touched: Optional[list[tuple[cst.CSTNode, bool]]] = None,
    *,
    imports_read: bool = False,
    parent: Optional[Callable[[cst.CSTNode], Optional[cst.CSTNode]]] = None,
    layout=None,
    swallowed: Optional[set[int]] = None,
) -> cst.Module:
    """The module with the edits applied; ``touched`` (if given) gets every node of ``module``
    an edit is keyed on, with whether the edit removes it. With ``imports_read`` (one file of a
    project, codemod/project/program.py), only the imports whose names the result reads are added: the
    edits of the other files ask for theirs. ``parent`` (a node -> its parent in ``module``): the
    edits are applied along the paths down to the nodes they are keyed on, and the rest of the
    tree is kept as it is. ``layout`` (codemod/tree/layout.py, of ``module``): the names the statements
    the edits keep read are known from it. ``swallowed`` (if given) gets the keys of the
    replacements the result does not hold (an edit around them dropped them): what a note
    about them would claim falsely."""
    edit_sets = list(edit_sets)
    edits = _merge(edit_sets)
    if not edits and not edits.unused_imports:
        return module

    def names_of(result: cst.Module) -> set[str]:
        if layout is not None and layout.module is module:
            return layout.names_in(result, names_read)
        return set(names_read(result))

    if imports_read and edits.imports:
        trial = _merge(edit_sets)
        trial.imports = []
        names = names_of(_apply(module, trial, parent))
        edits.imports = [w for w in edits.imports if bound_by(w) in names]
    added = plan_imports(module, edits) if edits.imports else []
    new = _apply(module, edits, parent, swallowed)
    if edits.unused_imports and plan_unused_imports(module, new, edits, names_of):
        new = _apply(module, edits, parent, swallowed)
    if added:
        new = blank_line_after(new, added)
    if touched is not None:
        seen: set[int] = set()
        for node in edits._keep:
            if id(node) not in seen:
                seen.add(id(node))
                touched.append((node, id(node) in edits.removals))
        touched.extend((node, True) for node in edits.emptied if id(node) not in seen)
    return new
