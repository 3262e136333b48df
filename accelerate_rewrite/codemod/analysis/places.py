"""Where a node of the analysed tree stands: its lines, parent and ancestors, scope and
qualified names, statement, block, function, class, and the file of a project it comes from.
Mixed into ScriptFacts (codemod/analysis/facts.py), which gives ``module``, ``memo``, ``body_parts``,
``_meta`` (codemod/tree/metadata.py), ``_qualnames`` and ``_qualnames_by_name``."""

from __future__ import annotations

from typing import Iterator, Optional, Union

import libcst as cst
from libcst.helpers import get_full_name_for_node
from libcst.metadata import ParentNodeProvider, PositionProvider, ScopeProvider

#: the sets of qualified names ``qualnames`` has given, each kept once (shared by every script)
_ANSWERS: dict[frozenset[str], frozenset[str]] = {}


class Places:
    def _get(self, provider, node, default=None):
        value = self._meta[provider].get(node, default)
        if value is not None and callable(value):  # libcst's lazy values (a node is not callable)
            value = value()
        return value

    def line(self, node: Optional[cst.CSTNode]) -> int:
        if node is None:
            return 1
        positions = self._meta[PositionProvider]
        if hasattr(positions, "line"):  # codemod/tree/layout.py: a statement's line without its positions
            found = positions.line(node)
            return found if found is not None else 1
        pos = self._get(PositionProvider, node)
        return pos.start.line if pos is not None else 1

    def lines(self, node: cst.CSTNode) -> Optional[tuple[int, int]]:
        """The lines ``node`` starts and ends on, or None where it has no position."""
        positions = self._meta[PositionProvider]
        if hasattr(positions, "lines"):  # codemod/tree/layout.py: a statement on one line without its positions
            return positions.lines(node)
        pos = self._get(PositionProvider, node)
        return (pos.start.line, pos.end.line) if pos is not None else None

    def end_line(self, node: Optional[cst.CSTNode]) -> int:
        """The line where ``node`` ends."""
        found = self.lines(node) if node is not None else None
        return found[1] if found is not None else 1

    def column(self, node: cst.CSTNode) -> int:
        """The 0-based column where ``node`` starts."""
        pos = self._get(PositionProvider, node)
        return pos.start.column if pos is not None else 0

    def parent(self, node: cst.CSTNode) -> Optional[cst.CSTNode]:
        return self._meta[ParentNodeProvider].get(node)

    def ancestors(self, node: cst.CSTNode) -> Iterator[cst.CSTNode]:
        node = self.parent(node)
        while node is not None:
            yield node
            node = self.parent(node)

    def qualnames(self, node: cst.CSTNode) -> set[str]:
        return set(self.qualname_set(node))

    def qualname_set(self, node: cst.CSTNode) -> frozenset[str]:
        """``qualnames``, the set shared (not to be changed)."""
        names = self._qualnames.get(node)
        if names is None:  # as LibCST's QualifiedNameProvider has it, for this node only
            scope = self.scope(node)
            key = self._by_name_key(node, scope) if scope is not None else None
            names = self._qualnames_by_name.get(key) if key is not None else None
            if names is None:
                names = frozenset(q.name for q in scope.get_qualified_names_for(node)) if scope is not None \
                    else frozenset()
                # one set for each answer (a set takes 216 bytes; most answers are none, or repeat)
                names = _ANSWERS.setdefault(names, names)
                if key is not None:
                    self._qualnames_by_name[key] = names
            self._qualnames[node] = names
        return names

    def _by_name_key(self, node: cst.CSTNode, scope) -> Optional[tuple]:
        """(scope, dotted name) where LibCST's answer for ``node`` is that of every node of that
        name in that scope, else None. LibCST answers a call or an attribute that is no read of
        its own (``_accesses_by_node``) from the bindings of the longest bound prefix of its
        dotted name in its scope, all of them, wherever the node stands; unless the node is the
        name an import binds (``_is_assignment``). Those answers are kept by name, so each
        lookup (a walk of every binding of ``loss`` for ``loss.backward()``) is made once a
        function, not once a call."""
        kind = type(node)
        if kind is not cst.Call and kind is not cst.Attribute:
            return None
        reads = getattr(scope, "_accesses_by_node", None)
        if reads is None or reads.get(node):
            return None
        if kind is cst.Attribute and type(self.parent(node)) is cst.ImportAlias:
            return None
        name = get_full_name_for_node(node)
        return (scope, name) if name is not None else None

    def qualname(self, node: cst.CSTNode) -> Optional[str]:
        names = self.qualname_set(node)
        return min(names) if names else None

    def scope(self, node: cst.CSTNode):
        return self._get(ScopeProvider, node)

    def statement(self, node: cst.CSTNode) -> cst.BaseStatement:
        """The statement that holds ``node`` and stands directly in a block."""
        current = node
        for parent in self.ancestors(node):
            if isinstance(parent, (cst.Module, cst.IndentedBlock)) and isinstance(
                current, cst.BaseStatement
            ):
                return current
            current = parent
        raise ValueError("node is not inside a statement")

    def block(self, stmt: cst.BaseStatement) -> Union[cst.Module, cst.IndentedBlock]:
        parent = self.parent(stmt)
        assert isinstance(parent, (cst.Module, cst.IndentedBlock))
        return parent

    def function(self, node: cst.CSTNode) -> Optional[cst.FunctionDef]:
        for parent in self.ancestors(node):
            if isinstance(parent, cst.FunctionDef):
                return parent
        return None

    def repeats(self, node: cst.CSTNode) -> bool:
        """``node`` runs more than once each time its function (or the module) runs: it is in a
        loop or a comprehension there."""
        for parent in self.ancestors(node):
            if isinstance(parent, (cst.For, cst.While, cst.ListComp, cst.SetComp, cst.DictComp, cst.GeneratorExp)):
                return True
            if isinstance(parent, (cst.FunctionDef, cst.ClassDef, cst.Lambda)):
                return False
        return False

    def _top_statement(self, node: cst.CSTNode) -> cst.CSTNode:
        """The statement of the module's body that holds ``node``."""
        top = node
        for parent in self.ancestors(node):
            if isinstance(parent, cst.Module):
                break
            top = parent
        return top

    def part_of(self, node: cst.CSTNode) -> int:
        """The file of the project ``node`` comes from (0: the script, or a script alone)."""
        if self.body_parts is None:
            return 0
        top = self._top_statement(node)
        index = self.memo("top-level-index", lambda: {id(s): i for i, s in enumerate(self.module.body)})
        i = index.get(id(top))
        return self.body_parts[i] if i is not None and i < len(self.body_parts) else 0

    def enclosing_class(self, func: cst.FunctionDef) -> Optional[cst.ClassDef]:
        parent = self.parent(func)
        if isinstance(parent, cst.IndentedBlock):
            grand = self.parent(parent)
            if isinstance(grand, cst.ClassDef):
                return grand
        return None

    def model_class_of(self, node: cst.CSTNode) -> Optional[cst.ClassDef]:
        """The model class whose method holds ``node``: one of the script's ``nn.Module``
        classes, or a subclass of one of torch.nn's (``nn.SyncBatchNorm``); None elsewhere."""
        func = self.function(node)
        cls = self.enclosing_class(func) if func is not None else None
        if cls is None:
            return None
        if cls.name.value in self.module_classes or any(
                q.startswith("torch.nn.") for base in cls.bases for q in self.qualnames(base.value)):
            return cls
        return None
