"""How a change runs only with `fabric` in a module other files import too (compat.py): a
statement guarded by ``if fabric is not None:`` (the old one in its ``else``), an expression
chosen by it, and whether code reads `fabric` at all."""

from __future__ import annotations

from typing import Sequence

import libcst as cst

NAME = "fabric"


def guard(test: str, new: Sequence[cst.BaseStatement], old: Sequence[cst.BaseStatement],
           leading: Sequence[cst.EmptyLine]) -> cst.If:
    """``if <test> is not None: new else: old`` (``if <test> is None: old`` without new)."""
    def block(stmts: Sequence[cst.BaseStatement]) -> cst.IndentedBlock:
        return cst.IndentedBlock(body=[s.with_changes(leading_lines=s.leading_lines) for s in stmts])

    if not new:
        return cst.If(test=cst.parse_expression(f"{test} is None"), body=block(old), leading_lines=leading)
    return cst.If(test=cst.parse_expression(f"{test} is not None"), body=block(new),
                  orelse=cst.Else(body=block(old)) if old else None, leading_lines=leading)


def chosen(test: str, new: cst.BaseExpression, old: cst.BaseExpression) -> cst.IfExp:
    """``(NEW if fabric is not None else OLD)``: the expression the conversion changed, chosen by
    `fabric` (``test``: `fabric`, or ``self.fabric``)."""
    return cst.IfExp(test=cst.parse_expression(f"{test} is not None"), body=paren(new), orelse=paren(old),
                     lpar=[cst.LeftParen()], rpar=[cst.RightParen()])


def paren(expr: cst.BaseExpression) -> cst.BaseExpression:
    if isinstance(expr, (cst.IfExp, cst.Lambda, cst.NamedExpr)) and not expr.lpar:
        return expr.with_changes(lpar=[cst.LeftParen()], rpar=[cst.RightParen()])
    return expr


def reads_fabric(node: cst.CSTNode) -> bool:
    """Whether ``node`` reads `fabric` (``fabric``, ``self.fabric``)."""
    found = []

    class _Reads(cst.CSTVisitor):
        def visit_Name(self, n: cst.Name) -> None:
            if n.value == NAME:
                found.append(n)

    node.visit(_Reads())
    return bool(found)
