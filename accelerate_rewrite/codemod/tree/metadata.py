"""What LibCST's metadata says of a tree, computed lean: parents, scopes, positions.

``MetadataWrapper.resolve_many`` runs each provider's own walk over the tree and then, for the
providers it batches (parents, expression contexts, scopes), one more walk of its batched visitor
per level of dependencies, which calls nothing here: every provider does its work in
``visit_Module``. Over the fixtures that is half the time of the analysis. So the parents come
from one walk of our own (codemod/tree/walk.py: the nodes in the order of LibCST's walk, without
the copy of every node a LibCST visitor makes), and the scopes from LibCST's own ScopeProvider run
directly (codemod/tree/scopes.py: what the wrapper would run, without its extra walks and
per-field lookups; the results are the same maps, which tests/test_facts.py checks).
Positions are computed when first asked for, one top-level statement at a time
(codemod/tree/layout.py). Should LibCST's internals change, the wrapper's way is taken.

These walks go past LibCST's tokens (facts_walk.TOKENS: whitespace, comments, blank lines,
operators, brackets), at which neither LibCST's scope analysis nor any visitor read here does
anything: the parents, spans and scopes name every node but the tokens.
"""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING, Any, Callable, Mapping, Optional

import libcst as cst
from libcst.metadata import (
    BatchableMetadataProvider,
    MetadataWrapper,
    ParentNodeProvider,
    PositionProvider,
    ScopeProvider,
)

from accelerate_rewrite.codemod.tree.scopes import _unlink, scopes
from accelerate_rewrite.codemod.tree.walk import LeanVisitor, SharedNode, Spans, _walk

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.tree.layout import Layout


class _Parents(LeanVisitor):
    def __init__(self) -> None:
        super().__init__()
        self.stack: list[cst.CSTNode] = []
        self.parents: dict[cst.CSTNode, cst.CSTNode] = {}
        #: node -> (its index in the walk's order, the index of the first node after its subtree)
        self.spans = Spans()
        self._starts: list[int] = []

    def on_visit(self, node: cst.CSTNode) -> bool:
        if self.stack:
            at = len(self.parents)
            self._starts.append(at)
            self.parents[node] = self.stack[-1]
            self.spans.index[node] = at
            self.spans.ends.append(0)
        self.stack.append(node)
        return True

    def on_leave(self, original_node: cst.CSTNode) -> None:
        self.stack.pop()
        if self.stack:
            self.spans.ends[self._starts.pop()] = len(self.parents)


def parents(module: cst.Module) -> dict[cst.CSTNode, cst.CSTNode]:
    """node -> its parent (what ParentNodeProvider gives), in one walk."""
    return parents_and_spans(module)[0]


def parents_and_spans(module: cst.Module):
    """``parents(module)``, and node -> (its index in the walk, the index after its subtree),
    the nodes in the order of LibCST's walk (``_walk``)."""
    return walk(module)[:2]


def walk(module: cst.Module):
    """``parents_and_spans(module)``, and node class -> the nodes of that class in the walk's
    order (None if LibCST's internals moved and its own walk was taken)."""
    try:
        return _walk(module)
    except (AttributeError, TypeError):  # LibCST's internals moved: its own walk
        visitor = _Parents()
        module.visit(visitor)
        return visitor.parents, visitor.spans, None


class Metadata(dict):
    """provider -> its values for one tree: parents and scopes at once, positions one top-level
    statement at a time (codemod/tree/layout.py) when first asked for, any other provider by the
    wrapper when it is first asked for."""

    def __init__(self, wrapper: MetadataWrapper, layout: Optional[Callable[[], "Layout"]] = None) -> None:
        super().__init__()
        self.wrapper = wrapper
        self.layout = layout
        module = wrapper.module
        #: node -> its span in the parents' walk (codemod/analysis/index.py); None the wrapper's way
        self.spans = None
        #: node class -> its nodes in the walk's order (codemod/analysis/index.py), or None
        self.by_type: Optional[dict[type, list[cst.CSTNode]]] = None
        #: whether a node stands twice in the tree (ScriptFacts then analyses a copy)
        self.shared = False
        try:
            self[ParentNodeProvider], self.spans, self.by_type = walk(module)
            self[ScopeProvider] = scopes(module, self.by_type)
        except SharedNode:
            self.shared = True
        except (AttributeError, TypeError, KeyError):  # LibCST's internals moved: its own way
            self.spans = self.by_type = None
            self.update(wrapper.resolve_many([ParentNodeProvider, ScopeProvider]))

    def release_scopes(self) -> None:
        """Let the scopes go (LibCST's scope analysis: about a fifth of a long script's analysis
        in memory); asked for again, they are made again (``__missing__``). Nothing may keep a
        scope, an assignment or an access of theirs past this: their cycles are cut
        (``_unlink``)."""
        computed = self.pop(ScopeProvider, None)
        if computed is not None and not _unlink(computed):
            gc.collect()

    def __missing__(self, provider):
        if provider is ScopeProvider and self.by_type is not None:
            values = scopes(self.wrapper.module, self.by_type)
        elif provider is PositionProvider and self.layout is not None:
            from accelerate_rewrite.codemod.tree.positions import Positions

            parents = self[ParentNodeProvider]
            values = Positions(self.layout(), parents.get, lambda: resolve(self.wrapper, provider))
        else:
            values = resolve(self.wrapper, provider)
        self[provider] = values
        return values


def resolve(wrapper: MetadataWrapper, provider) -> Mapping[cst.CSTNode, Any]:
    """``wrapper.resolve(provider)``; for a provider that depends on none and is not batched
    (positions), its own walk alone: the wrapper would add a walk of its batched visitor with
    nothing to call."""
    if provider.METADATA_DEPENDENCIES or provider.gen_cache or issubclass(provider, BatchableMetadataProvider):
        return wrapper.resolve(provider)
    try:
        return provider()._gen(wrapper)
    except (AttributeError, TypeError):  # LibCST's internals moved: its own way
        return wrapper.resolve(provider)
