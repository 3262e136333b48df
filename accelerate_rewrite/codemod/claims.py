"""What the change notes claim, checked against the file as written: a note that says a statement
was removed, or that code became other code, stands only where the file shows it.

A rule records its notes with the edits it asks for, before they are applied; what the file
finally holds can differ in two ways. An edit of an outer node may rebuild it without an inner
edit (``torch.load(path, map_location=... get_rank() ...)`` became ``fabric.load(path)``: the
``get_rank()`` in it never became ``fabric.global_rank``): the edits' application tells those
(codemod/edits/edit_set.py, ``swallowed``), and the engine drops their notes. And a module other
files import changes compatibly (codemod/project/compat.py), keeping the old statement where a
change reads no `fabric`: run with `fabric`, the file still runs what the note says is gone.

This module finds the second: per file, the input's lines are matched with the output's
(difflib, without indentation); a claim is false when the lines of the input statement it is
about are all still there, unchanged, on a path that runs with `fabric` (not in the ``else`` of
``if fabric is not None:``, nor under ``if fabric is None:``). A false claim's note goes: the
summary says what the file holds.
"""

from __future__ import annotations

import ast
import difflib
import re
from typing import Optional, Sequence

from accelerate_rewrite.codemod.result import Note
from accelerate_rewrite.codemod.tree.toplevel import python_tree

#: "removed `X`" and "`X` became `Y`", as the rules write them (``short``: maybe cut with "...")
_REMOVED = re.compile(r"^removed `")
_BECAME = re.compile(r"^`[^`]+` became `")
#: the name of the object that stands for Fabric (or Accelerate's, in its spelling)
_GUARD = re.compile(r"^(?:self\.)?(?:fabric|accelerator)$")
#: such a guard in the text: ``if fabric is not None:``, ``if self.accelerator is None:``
_GUARDED = re.compile(r"\b(?:fabric|accelerator) is (?:not )?None\b")


def true_claims(notes: Sequence[Note], source: str, output: str) -> list[Note]:
    """``notes`` without those whose claim ``output`` does not hold."""
    claims = [n for n in notes if not n.skipped and (_REMOVED.match(n.message) or _BECAME.match(n.message))]
    if not claims or source == output:
        return list(notes)
    # (compared without their indentation: a statement wrapped in a ``with``, or kept in an
    # ``else``, is the same line)
    mapped = _mapping([x.strip() for x in source.splitlines()], [x.strip() for x in output.splitlines()])
    kept = [n for n in claims if n.line in mapped]  # the others' lines changed: what they say holds
    if not kept:
        return list(notes)
    try:
        spans = _statement_spans(python_tree(source))  # (the trees the checks read: parsed once)
        without = _without_fabric(python_tree(output)) if _GUARDED.search(output) else []
    except (SyntaxError, ValueError):
        return list(notes)
    false = set()
    for note in kept:
        span = _span_at(spans, note.line)
        if span is None:
            continue
        lines = [mapped.get(line) for line in range(span[0], span[1] + 1)]
        if all(k is not None and not _inside(without, k) for k in lines):
            false.add(id(note))  # every line of it is still there, run with `fabric`
    return [n for n in notes if id(n) not in false]


def _mapping(old: list[str], new: list[str]) -> dict[int, int]:
    """1-based lines of ``old`` kept as they were -> their line in ``new``."""
    out: dict[int, int] = {}
    matcher = difflib.SequenceMatcher(None, old, new, autojunk=False)
    for tag, i1, i2, j1, _ in matcher.get_opcodes():
        if tag == "equal":
            for k in range(i2 - i1):
                out[i1 + k + 1] = j1 + k + 1
    return out


def _without_fabric(tree: ast.Module) -> list[tuple[int, int]]:
    """The line spans of the output that run without `fabric` only: the ``else`` of ``if fabric
    is not None:`` and the body of ``if fabric is None:``."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.If) or not isinstance(node.test, ast.Compare) or len(node.test.ops) != 1:
            continue
        test, op = node.test, node.test.ops[0]
        if not (isinstance(test.comparators[0], ast.Constant) and test.comparators[0].value is None
                and _GUARD.match(ast.unparse(test.left))):
            continue
        block = node.orelse if isinstance(op, ast.IsNot) else node.body if isinstance(op, ast.Is) else []
        if block:
            out.append((block[0].lineno, max(getattr(s, "end_lineno", s.lineno) or s.lineno for s in block)))
    return out


def _inside(spans: list[tuple[int, int]], line: int) -> bool:
    return any(a <= line <= b for a, b in spans)


def _statement_spans(tree: ast.Module) -> list[tuple[int, int]]:
    """Each statement's lines: a simple statement's all; a compound statement's header (down to
    the line before its first inner statement)."""
    out = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.stmt):
            continue
        inner = [s for field in ("body", "orelse", "handlers", "finalbody") for s in getattr(node, field, ()) or ()]
        if inner:
            out.append((node.lineno, max(node.lineno, min(s.lineno for s in inner) - 1)))
        else:
            out.append((node.lineno, node.end_lineno or node.lineno))
    return out


def _span_at(spans: list[tuple[int, int]], line: int) -> Optional[tuple[int, int]]:
    """The smallest statement span holding ``line``."""
    holding = [s for s in spans if s[0] <= line <= s[1]]
    return min(holding, key=lambda s: s[1] - s[0]) if holding else None
