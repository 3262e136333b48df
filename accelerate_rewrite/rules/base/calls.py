"""Edits of a call's keyword arguments that several rules make (AR402, AR404, AR502, AR503)."""

from __future__ import annotations

from typing import Sequence

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import code
from accelerate_rewrite.codemod.rule import RuleContext

#: a call longer than this once the keywords are in gets one argument a line (as black would)
MAX_WIDTH = 99


def without_keywords(call: cst.Call, names: Sequence[str]) -> cst.Call:
    """The call without the keyword arguments ``names``; the last argument left keeps the
    call's own ending (no trailing comma, or one)."""
    args = [a for a in call.args if a.keyword is None or a.keyword.value not in names]
    if args and args[-1] is not call.args[-1]:
        args[-1] = args[-1].with_changes(comma=call.args[-1].comma)
    return call.with_changes(args=args)


def set_keywords(ctx: RuleContext, call: cst.Call, new: dict[str, str]) -> None:
    """Set keyword arguments of a call (``name -> code``): replaced where given, added after the
    last argument otherwise; a one-line call that would grow past MAX_WIDTH gets one argument
    a line. Other rules' edits of the same call compose with it."""
    added_width = sum(len(f", {k}={v}") for k, v in new.items())
    explode = "\n" not in code(call) and ctx.facts.column(call) + len(code(call)) + added_width > MAX_WIDTH
    ctx.edits.replace(call, lambda updated: _with_keywords(updated, dict(new), explode))


def _with_keywords(call: cst.Call, new: dict[str, str], explode: bool) -> cst.Call:
    """The call with ``new`` keywords set: a ``num_workers=0`` replaced, the others added after
    the last argument; one argument a line when the call has them so, or when ``explode``."""
    args = list(call.args)
    for i, a in enumerate(args):
        if a.keyword is not None and a.keyword.value in new:
            args[i] = a.with_changes(value=cst.parse_expression(new.pop(a.keyword.value)))
    equal = cst.AssignEqual(cst.SimpleWhitespace(""), cst.SimpleWhitespace(""))
    args += [cst.Arg(cst.parse_expression(v), keyword=cst.Name(k), equal=equal) for k, v in new.items()]
    if explode:
        def line(indent: str) -> cst.ParenthesizedWhitespace:
            return cst.ParenthesizedWhitespace(last_line=cst.SimpleWhitespace(indent), indent=True)
        args = [a.with_changes(comma=cst.Comma(whitespace_after=line("" if i == len(args) - 1 else "    ")))
                for i, a in enumerate(args)]
        return call.with_changes(args=args, whitespace_before_args=line("    "))
    if len(args) == len(call.args):
        return call.with_changes(args=args)
    last = call.args[-1]
    multiline = isinstance(last.comma, cst.Comma) and isinstance(last.comma.whitespace_after,
                                                                  cst.ParenthesizedWhitespace)
    between = call.args[-2].comma if multiline and len(call.args) >= 2 else cst.Comma(
        whitespace_after=cst.SimpleWhitespace(" "))
    n = len(call.args)
    args = [a.with_changes(comma=between) if i >= n - 1 and i < len(args) - 1 else a for i, a in enumerate(args)]
    args[-1] = args[-1].with_changes(comma=last.comma)
    return call.with_changes(args=args)
