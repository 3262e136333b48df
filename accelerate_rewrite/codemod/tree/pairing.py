"""LibCST's statements paired with Python's (``ast``): each statement's first and last line as
Python's parser tells them, without generating LibCST's code (codemod/tree/positions.py reads a
node's line off them; codemod/tree/layout.py cuts a kept inner statement's code from the text by
them)."""

from __future__ import annotations

from typing import Optional, Sequence

import libcst as cst


#: what Python's parser tells of a statement (``Positions._lines_of``): its first line, whether it
#: (a compound statement: its header) is on that line alone, its last line (None: not told)
Told = tuple[int, bool, Optional[int]]

#: LibCST's compound statements -> Python's, and the fields of their one-line headers
_HEADERS: dict[type, tuple[tuple[str, ...], tuple[str, ...]]] = {
    cst.If: (("If",), ("test",)),
    cst.While: (("While",), ("test",)),
    cst.For: (("For", "AsyncFor"), ("target", "iter")),
    cst.With: (("With", "AsyncWith"), ("items", "lpar", "rpar")),
}


def _pair(stmts: Sequence[cst.CSTNode], body: list, offset: int, out: dict) -> bool:
    """Pair LibCST's statements with Python's (``body``, lines less ``offset``) into ``out``
    (``Positions._lines_of``); False where they do not pair up."""
    k = 0
    for stmt in stmts:
        if isinstance(stmt, cst.SimpleStatementLine):
            n = len(stmt.body)
            if k + n > len(body):
                return False
            first, last = body[k], body[k + n - 1]
            out[id(stmt)] = (first.lineno + offset, first.lineno == last.end_lineno, last.end_lineno + offset)
            k += n
            continue
        if k >= len(body):
            return False
        node = body[k]
        k += 1
        kind = type(node).__name__
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)):
            if kind not in (("ClassDef",) if isinstance(stmt, cst.ClassDef) else ("FunctionDef", "AsyncFunctionDef")):
                return False
            if not stmt.decorators:
                out[id(stmt)] = (node.lineno + offset, False, node.end_lineno + offset)
            if isinstance(stmt, cst.FunctionDef):
                _pair_params(stmt.params, node.args, offset, out)
            pairs = [(stmt.body, node.body)]
        elif type(stmt) in _HEADERS:
            if kind not in _HEADERS[type(stmt)][0]:
                return False
            if isinstance(stmt, (cst.If, cst.While)):
                ends = [node.test.end_lineno]
            elif isinstance(stmt, cst.For):
                ends = [node.target.end_lineno, node.iter.end_lineno]
            else:
                ends = [e.end_lineno for item in node.items for e in (item.context_expr, item.optional_vars) if e]
            out[id(stmt)] = (node.lineno + offset, all(e == node.lineno for e in ends), node.end_lineno + offset)
            pairs = [(stmt.body, node.body)]
            orelse = getattr(stmt, "orelse", None)
            if isinstance(orelse, cst.If):  # elif
                if not _pair([orelse], node.orelse, offset, out):
                    return False
            elif orelse is not None:
                pairs.append((orelse.body, node.orelse))
        elif isinstance(stmt, (cst.Try, getattr(cst, "TryStar", cst.Try))):
            if kind not in ("Try", "TryStar"):
                return False
            if len(stmt.handlers) != len(node.handlers):
                return False
            pairs = [(stmt.body, node.body)] + [(h.body, a.body) for h, a in zip(stmt.handlers, node.handlers)]
            if stmt.orelse is not None:
                pairs.append((stmt.orelse.body, node.orelse))
            if stmt.finalbody is not None:
                pairs.append((stmt.finalbody.body, node.finalbody))
        elif isinstance(stmt, cst.Match):
            if kind != "Match" or len(stmt.cases) != len(node.cases):
                return False
            pairs = [(c.body, a.body) for c, a in zip(stmt.cases, node.cases)]
        else:
            return False
        for block, inner in pairs:
            if isinstance(block, cst.IndentedBlock) and not _pair(block.body, inner, offset, out):
                return False
    return k == len(body)


def _pair_params(params: cst.Parameters, args, offset: int, out: dict) -> None:
    """The first line of each parameter of a ``def`` (a note on a parameter the rewrite
    renamed): Python's ``arg`` starts at the name, as LibCST's Param does where there is no
    star, or no line break after it."""
    pairs = [(params.posonly_params, args.posonlyargs), (params.params, args.args),
             (params.kwonly_params, args.kwonlyargs)]
    for star, arg in ((params.star_arg, args.vararg), (params.star_kwarg, args.kwarg)):
        if isinstance(star, cst.Param) and arg is not None:
            pairs.append(([star], [arg]))
    for ours, theirs in pairs:
        if len(ours) != len(theirs):
            continue
        for param, arg in zip(ours, theirs):
            after = param.whitespace_after_star
            if not param.star or (type(after) is cst.SimpleWhitespace and "\n" not in after.value):
                out[id(param)] = (arg.lineno + offset, True, None)
