"""One text of a file that several scripts of a run change (a utils module two entry points
import, a script a launcher imports): the versions each script's conversion made, merged as
version control merges branches (``merge3``, Breezy's three-way merge of lines, against the
file as read). Each script changes a module it shares only so that the others keep working
(codemod/project/compat.py): changes to different places merge; the same change made twice is
made once; two different changes of one place are a conflict, and the run then converts the
later script without changing that file (runner.py)."""

from __future__ import annotations

import ast
from typing import Optional


def merge(base: str, ours: str, theirs: str) -> Optional[str]:
    """``ours`` and ``theirs``, two versions of ``base``, as one; None where they change the same
    lines differently, or where the merge does not parse."""
    if ours == theirs or theirs == base:
        return ours
    if ours == base:
        return theirs
    import merge3

    lines = [base.splitlines(True), ours.splitlines(True), theirs.splitlines(True)]
    out: list[str] = []
    for region in merge3.Merge3(*lines).merge_regions():
        kind = region[0]
        if kind == "conflict":
            return None
        if kind == "unchanged":
            out.extend(lines[0][region[1]:region[2]])
        elif kind in ("a", "same"):
            out.extend(lines[1][region[1]:region[2]])
        elif kind == "b":
            out.extend(lines[2][region[1]:region[2]])
    text = "".join(out)
    try:
        ast.parse(text)
    except (SyntaxError, ValueError):
        return None
    return text

