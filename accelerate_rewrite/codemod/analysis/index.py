"""The tree's nodes by type, in the order of a walk, made once from the parents' walk: where
``m.findall`` over the module, or over any node of it, would walk the tree with a matcher, the
facts answer from the index (a node's subtree is the run of nodes the walk visits from it to
the end of its ``on_leave``). tests/test_facts.py checks both give the same nodes in the same
order on every fixture."""

from __future__ import annotations

import dataclasses
import functools
from bisect import bisect_left, bisect_right
from typing import Callable, Iterable, Optional, Sequence

import libcst as cst
import libcst.matchers as m
from libcst.metadata import ParentNodeProvider

from accelerate_rewrite.codemod.tree.walk import TOKENS


class Index:
    """Mixed into ScriptFacts (codemod/analysis/facts.py), which gives ``module``, ``memo`` and ``_meta``."""

    def find(self, matcher: m.BaseMatcherNode) -> list[cst.CSTNode]:
        """``m.findall(self.module, matcher)``, the same nodes in the same order, from an index of
        the tree's nodes by type made once (the parents' walk visits them in that order): a
        matcher walk of the whole tree per question costs seconds in a long script."""
        return self.find_in(self.module, matcher)

    def find_in(self, node: cst.CSTNode, matcher: m.BaseMatcherNode) -> list[cst.CSTNode]:
        """``m.findall(node, matcher)`` for a node of the analysed tree, from the same index."""
        types = _node_types(matcher)
        span = self._span(node) if types is not None else None
        if span is None:
            return list(m.findall(node, matcher))
        start, end = span
        index = self._nodes_by_type()
        at = self._meta.spans.index.__getitem__  # a node's index in the walk
        runs = []
        for t in types:
            nodes = index.get(t, ())
            first = bisect_left(nodes, start, key=at)
            runs.append(nodes[first:bisect_left(nodes, end, lo=first, key=at)])
        candidates = runs[0] if len(runs) == 1 else sorted((n for run in runs for n in run), key=at)
        return matching(candidates, matcher)

    def inside(self, node: cst.CSTNode, outer: cst.CSTNode) -> bool:
        """Whether ``outer`` is one of ``node``'s ancestors (``outer in ancestors(node)``), from the
        walk's spans: a node's subtree is the run of nodes from it to the end of its span."""
        spans = getattr(self._meta, "spans", None)
        if spans is not None:
            index = spans.index
            at = index.get(node)
            if outer is self.module:
                return at is not None
            start = index.get(outer)
            if at is not None and start is not None:
                return start < at < spans.ends[start]
        return any(above is outer for above in self.ancestors(node))

    def first_inside(self, items: list, node_of: Callable[[object], cst.CSTNode], outer: cst.CSTNode,
                     key: object) -> Optional[int]:
        """The index of the first of ``items`` whose node is inside ``outer`` (``inside``), by
        bisection over their nodes' spans (sorted once, under ``key``: a rule that asks of every
        set-up which of every backward lies in it asks thousands of times in a long script)."""
        spans = getattr(self._meta, "spans", None)
        span = self._span(outer) if spans is not None and outer is not self.module else None
        if span is None:
            return next((i for i, item in enumerate(items) if self.inside(node_of(item), outer)), None)

        def compute() -> tuple[list[int], list[int]]:
            index = spans.index
            order = sorted((index[n], i) for i, n in enumerate(map(node_of, items)) if n in index)
            return [start for start, _ in order], [i for _, i in order]
        starts, indices = self.memo(("by-span", key), compute)
        lo = bisect_right(starts, span[0])
        hi = bisect_left(starts, span[1], lo=lo)
        return min(indices[lo:hi]) if hi > lo else None

    def _span(self, node: cst.CSTNode) -> Optional[tuple[int, int]]:
        """The indices (in the walk's order) of ``node`` and of the first node after its subtree."""
        spans = getattr(self._meta, "spans", None)
        if spans is None:
            return None
        if node is self.module:
            return (0, len(self._meta[ParentNodeProvider]))
        return spans.get(node) if isinstance(node, cst.CSTNode) else None

    def _nodes_by_type(self) -> dict[type, list[cst.CSTNode]]:
        """node class -> its nodes in the walk's order (made by the parents' walk)."""
        by_type = getattr(self._meta, "by_type", None)
        if by_type is not None:
            return by_type

        def compute() -> dict[type, list[cst.CSTNode]]:
            index: dict[type, list[cst.CSTNode]] = {}
            for node in self._meta[ParentNodeProvider]:  # every node but the module, in order
                index.setdefault(type(node), []).append(node)
            return index
        return self.memo("nodes-by-type", compute)


def _node_types(matcher: object) -> Optional[Sequence[type]]:
    """The node classes ``matcher`` can match (``m.For() | m.While()``: For, While), or None."""
    if isinstance(matcher, m.OneOf):
        out: list[type] = []
        for option in matcher.options:
            types = _node_types(option)
            if types is None:
                return None
            out += [t for t in types if t not in out]
        return out
    return _node_type(type(matcher))


@functools.cache
def _node_type(kind: type) -> Optional[tuple[type, ...]]:
    """``_node_types`` of a matcher of class ``kind`` that is not a OneOf."""
    cls = getattr(cst, kind.__name__, None)
    if isinstance(cls, type) and issubclass(cls, cst.CSTNode) and cls is not cst.Module \
            and cls not in TOKENS and kind.__module__.startswith("libcst.matchers"):
        return (cls,)
    return None  # a token (the walk goes past them), or no node class: LibCST's own walk


def matching(nodes: Iterable[cst.CSTNode], matcher: m.BaseMatcherNode) -> list[cst.CSTNode]:
    """``[n for n in nodes if m.matches(n, matcher)]``, ``m.matches`` asked only of the nodes that
    pass the matcher's cheap test (``_necessary``)."""
    quick = _necessary(matcher)
    if quick is not None:
        return [n for n in nodes if quick(n) and m.matches(n, matcher)]
    return [n for n in nodes if m.matches(n, matcher)]


def _necessary(matcher: object) -> Optional[Callable[[object], bool]]:
    """A cheap test that every node ``matcher`` matches passes (``m.matches`` is then asked only
    of those that do): of a node matcher, its class, and of its fields, those given as text
    (``m.Name("step")``), as node matchers or as a ``OneOf`` of them, in depth; a field given
    any other way (a sequence, a predicate) is not tested. Of a ``OneOf`` of node matchers,
    that one of theirs passes. None for anything else."""
    if isinstance(matcher, m.OneOf):
        options = [_necessary(option) for option in matcher.options]
        if any(option is None for option in options):
            return None
        if len(options) == 2:
            first, second = options
            return lambda node: first(node) or second(node)  # type: ignore[misc]
        return lambda node: any(option(node) for option in options)  # type: ignore[misc]
    fields = _fields(type(matcher))
    if fields is None:
        return None
    name = type(matcher).__name__
    tests: list[tuple[str, Callable[[object], bool]]] = []
    for field in fields:
        wanted = getattr(matcher, field)
        if isinstance(wanted, str):
            tests.append((field, lambda value, wanted=wanted: value == wanted))
        elif isinstance(wanted, m.OneOf) or _fields(type(wanted)) is not None:
            inner = _necessary(wanted)
            if inner is not None:
                tests.append((field, inner))

    if not tests:
        return lambda node: type(node).__name__ == name
    if len(tests) == 1:  # (asked of every node of a class in a long script: no loop where one will do)
        (field, ok), = tests
        return lambda node: type(node).__name__ == name and ok(getattr(node, field))

    def test(node: object) -> bool:
        if type(node).__name__ != name:
            return False
        for field, ok in tests:
            if not ok(getattr(node, field)):
                return False
        return True
    return test


@functools.cache
def _fields(kind: type) -> Optional[tuple[str, ...]]:
    """Of a class of matchers of libcst.matchers made for one node class (``m.Call``), not a
    wildcard, the names of the fields it tests; None for any other class (asked once a class:
    a rule asks thousands of questions of the index in a long script)."""
    cls = getattr(cst, kind.__name__, None)
    if not (issubclass(kind, m.BaseMatcherNode) and kind.__module__.startswith("libcst.matchers")
            and isinstance(cls, type) and issubclass(cls, cst.CSTNode) and dataclasses.is_dataclass(kind)):
        return None
    return tuple(f.name for f in dataclasses.fields(kind) if f.name not in ("metadata", "_metadata"))
