"""One-line hints: what the analysis can't prove, said by the user on the line it is about.

::

    training_data, validation_data = prepare_dataloaders(opt, device)  # accelerate-rewrite: loader
    optimizer = build_optimizer(groups, cfg)  # accelerate-rewrite: model=net

Written as ruff's and mypy's pragmas are (``# noqa: E501``, ``# type: ignore[code]``): a
comment ``# accelerate-rewrite: HINT`` at the end of the statement's line (any line of a
statement that spans several), or on a line of its own just above it; several hints separated
by commas. A refusal that a hint lifts names the hint and the line (docs/conversions.md):

- ``loader``: the names the statement binds hold DataLoaders (built where the analysis can't
  see: a helper of a package, a function that returns something it can't read). They are set
  up with Fabric where they are bound, as the script receives them; ``fabric.setup_dataloaders``
  raises a TypeError at start-up if one is not a DataLoader, so a wrong hint fails loudly.
- ``per-process``: the batches of what the statement binds are each process's own already
  (a script that shards them itself, a stream each process reads apart), or meant to be the same
  on every process: a training loop over them is not refused for several devices, and they are
  not set up (their moves to the device stay).
- ``model=NAME``: the optimizer the statement binds trains the model ``NAME`` (its parameters
  come through a helper or a structure the analysis can't follow). The model is set up with it.

Unknown hints are said, with the known ones (``unknown``).
"""

from __future__ import annotations

import re
from typing import TYPE_CHECKING, Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.tree.printing import code_for

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.kinds import Key
    from accelerate_rewrite.codemod.analysis.view import Facts

MARK = re.compile(r"#\s*accelerate-rewrite:\s*(.*)$")
#: a text without it has no hint (nor suppression) anywhere
MARK_WORD = "accelerate-rewrite"
#: the hints, and whether each takes a value
KNOWN = {"loader": False, "per-process": False, "model": True}
#: what suppress.py reads from the same kind of comment
_SUPPRESSIONS = ("ignore", "skip-file")


def _comments(stmt: cst.CSTNode) -> list[str]:
    out = [line.comment.value for line in getattr(stmt, "leading_lines", ()) if line.comment is not None]
    if isinstance(stmt, cst.SimpleStatementLine):
        out += [c.value for c in m.findall(stmt, m.Comment())]
    elif isinstance(getattr(stmt, "body", None), cst.IndentedBlock) and stmt.body.header.comment is not None:
        out.append(stmt.body.header.comment.value)
    return out


def hints_of(stmt: cst.CSTNode) -> dict[str, Optional[str]]:
    """The hints on ``stmt``'s lines: name -> its value (None for a hint without one)."""
    out: dict[str, Optional[str]] = {}
    if isinstance(stmt, cst.SimpleStatementLine) and MARK_WORD not in code_for(stmt):
        # no comment of the line can hold a hint: its code, every comment in it, is a third of
        # the time of looking for the comments (matchers' findall)
        return out
    for comment in _comments(stmt):
        match = MARK.match(comment)
        if match is None:
            continue
        for item in match.group(1).split(","):
            name, _, value = item.strip().partition("=")
            name = name.strip()
            if name and not name.startswith(_SUPPRESSIONS):
                out[name] = value.strip() or None
    return out


def unknown(stmt: cst.CSTNode) -> list[str]:
    """The hints on ``stmt`` this version does not know, or written without the value they need."""
    return [name for name, value in hints_of(stmt).items()
            if name not in KNOWN or KNOWN[name] != (value is not None)]


def hinted_model(f: "Facts", stmt: cst.BaseStatement) -> Optional["Key"]:
    """The model ``# accelerate-rewrite: model=NAME`` on ``stmt`` names, as NAME is bound there
    (``model=self.model`` in a method: the class's attribute); None without one."""
    name = f.hints(stmt).get("model")
    if not name:
        return None
    node = next(iter(m.findall(stmt, m.Name())), stmt)
    if "." not in name:
        return f.key_for_name(node, name)
    owner, _, attr = name.partition(".")
    if owner != "self" or not attr.isidentifier():
        return None
    func = f.function(node)
    cls = f.enclosing_class(func) if func is not None else None
    return (cls, name) if cls is not None else None


def loader_hint(lines: list[int]) -> str:
    """What a refusal says to lift an unproven loader (bound on ``lines``)."""
    lines = sorted(set(lines))
    where = f"line {lines[0]}" if len(lines) == 1 else "lines " + ", ".join(map(str, lines))
    return (f"if it is a DataLoader, add `# accelerate-rewrite: loader` at the end of {where}, where it is "
            "bound; if its batches are each process's own already, `# accelerate-rewrite: per-process`")


def model_hint(line: int) -> str:
    """What a refusal says to lift an optimizer whose model is unproven."""
    return (f"add `# accelerate-rewrite: model=NAME` at the end of line {line}, NAME being the model it "
            "trains")
