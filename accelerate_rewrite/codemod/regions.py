"""The lines of the input the edits may change (codemod/engine.py asks, for the checks that the
comments and blank lines elsewhere stay: codemod/edits/preserve.py): each edited statement with its
leading lines, and around a removed one the spacing the removal adjusts."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import libcst as cst
from libcst.metadata import PositionProvider

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.edits.preserve import Region


def edited_regions(facts: ScriptFacts, touched: Sequence[tuple[cst.CSTNode, bool]]) -> list[Region]:
    """The lines of the input the edits may change: each edited statement with its leading
    lines (and, for a removed one, the leading lines of the statement after it, whose spacing
    the removal adjusts; an ``if`` whose whole body goes goes too)."""
    out: list[Region] = []
    removed = {id(node) for node, gone in touched if gone}
    todo = list(touched)
    while todo:
        node, gone = todo.pop()
        if isinstance(node, cst.Module):
            return [(1, 1 << 30)]
        try:
            stmt = node if isinstance(node, cst.BaseStatement) and isinstance(
                facts.parent(node), (cst.Module, cst.IndentedBlock)) else facts.statement(node)
        except (ValueError, KeyError):
            if isinstance(node, cst.IndentedBlock) and facts.parent(node) is not None:
                todo.append((facts.parent(node), False))
            continue
        lines = facts.lines(stmt)
        if lines is None:
            continue
        start = lines[0] - len(getattr(stmt, "leading_lines", ()))
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.decorators:
            first = facts._get(PositionProvider, stmt.decorators[0])
            if first is not None:
                start = min(start, first.start.line - len(stmt.leading_lines))
        end = lines[1]
        block = facts.parent(stmt)
        if gone and isinstance(block, (cst.Module, cst.IndentedBlock)):
            body = list(block.body)
            index = next((i for i, s in enumerate(body) if s is stmt), None)
            if index is not None and index + 1 < len(body):
                following = facts.lines(body[index + 1])
                if following is not None:
                    end = max(end, following[0] - 1)
            owner = facts.parent(block) if isinstance(block, cst.IndentedBlock) else None
            chain = _if_chain(facts, owner) if isinstance(owner, (cst.If, cst.Else)) else None
            if chain is not None and id(chain[0]) not in removed \
                    and all(id(s) in removed for branch in chain[1] for s in branch.body):
                removed.add(id(chain[0]))
                todo.append((chain[0], True))
        out.append((max(1, start), end))
    return out


def _if_chain(facts: ScriptFacts, node: Union[cst.If, cst.Else]) -> tuple[cst.If, list[cst.BaseSuite]]:
    """The outermost ``if`` of the if/elif/else chain ``node`` is a branch of, and the blocks of
    all its branches."""
    top = node
    while isinstance(facts.parent(top), cst.If) and facts.parent(top).orelse is top:
        top = facts.parent(top)
    branches: list[cst.BaseSuite] = []
    current: Optional[cst.CSTNode] = top
    while isinstance(current, cst.If):
        branches.append(current.body)
        current = current.orelse
    if isinstance(current, cst.Else):
        branches.append(current.body)
    return top, branches
