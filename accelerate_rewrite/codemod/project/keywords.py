"""The calls of the functions a compatible module changed (codemod/project/compat.py), as the
converted files spell them: `fabric` moves from the place the conversion gave it to the keyword
the compatible function takes last (``train(fabric, net)`` -> ``train(net, fabric=fabric)``), a
threaded ``device`` given back ``fabric.device``."""

from __future__ import annotations

import re
from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.analysis.syntax import code
from accelerate_rewrite.codemod.project.compat import NAME, Taken
from accelerate_rewrite.codemod.tree.parse import parsed_text
from accelerate_rewrite.codemod.tree.printing import module_code
from accelerate_rewrite.codemod.tree.walk import Along


def _called(call: cst.Call) -> Optional[str]:
    """The name a call calls: ``f`` of ``f(...)`` and of ``obj.f(...)``."""
    func = call.func
    return func.attr.value if type(func) is cst.Attribute else func.value if type(func) is cst.Name else None


class _ByKeyword(Along, cst.CSTTransformer):
    """``init_distributed_mode(fabric, args)`` -> ``init_distributed_mode(args, fabric=fabric)``;
    ``create_d_vae(path, size, fabric)``, where `fabric` took ``device``'s place ->
    ``create_d_vae(path, size, fabric.device, fabric=fabric)``."""

    def __init__(self, calls: dict[str, Taken]) -> None:
        super().__init__()
        self.calls = calls
        self.changed = False

    def changes(self, node: cst.CSTNode) -> bool:
        """A call of one of the functions (``Along``: only the paths to them are gone through)."""
        return type(node) is cst.Call and _called(node) in self.calls

    def leave_Call(self, original: cst.Call, updated: cst.Call) -> cst.BaseExpression:
        name = _called(updated)
        taken = self.calls.get(name) if name is not None else None
        if taken is None:
            return updated
        args = list(updated.args)
        at = next((i for i, a in enumerate(args) if a.keyword is not None and a.keyword.value == NAME), None)
        if at is None and taken.index < len(args) and args[taken.index].keyword is None \
                and not args[taken.index].star and not any(a.star for a in args[:taken.index]):
            at = taken.index
        if at is None or code(args[at].value) not in (NAME, f"self.{NAME}"):
            return updated
        ref = code(args[at].value)
        if taken.instead is not None:  # the parameter it took the place of gets the device
            device = cst.parse_expression(f"{ref}.device")
            moved = args[at]
            args[at] = moved.with_changes(value=device, keyword=cst.Name(taken.instead) if moved.keyword else None)
            keyword = moved.with_changes(keyword=cst.Name(NAME), value=cst.parse_expression(ref), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
        else:
            keyword = args.pop(at).with_changes(keyword=cst.Name(NAME), equal=cst.AssignEqual(
                whitespace_before=cst.SimpleWhitespace(""), whitespace_after=cst.SimpleWhitespace("")))
        if not args:
            keyword = keyword.with_changes(comma=cst.MaybeSentinel.DEFAULT)
        elif isinstance(args[-1].comma, cst.Comma):
            # a trailing comma (``amp=apex.amp,`` and ``)`` on a line of its own): the new
            # argument goes on a line of its own too, before the ``)``
            between = args[-2].comma if len(args) > 1 and isinstance(args[-2].comma, cst.Comma) \
                else cst.Comma(whitespace_after=cst.SimpleWhitespace(" "))
            keyword = keyword.with_changes(comma=args[-1].comma)
            args[-1] = args[-1].with_changes(comma=between)
        else:
            args[-1] = args[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
            keyword = keyword.with_changes(comma=cst.MaybeSentinel.DEFAULT)
        self.changed = True
        return updated.with_changes(args=[*args, keyword])


def calls_by_keyword(text: str, calls: dict[str, Taken], tree: Optional[cst.Module] = None, layout=None) -> str:
    """``text`` with every call of the functions and classes of ``calls`` that passes `fabric`
    at that index passing it by keyword instead (they take it last, optional). ``tree``: the
    tree ``text`` is the code of, where the caller has it (else the text is parsed); ``layout``
    (codemod/tree/layout.py), where it knows the code of some of the tree's statements: those
    that name no such function are kept as they are, not gone through."""
    named = re.compile(r"\b(?:%s)\b" % "|".join(map(re.escape, calls))) if calls else None
    if named is None or NAME not in text or not named.search(text):
        return text  # (no such call can be there: the text is not parsed)
    try:
        module = tree if tree is not None else parsed_text(text)
    except cst.ParserSyntaxError:
        return text
    visitor = _ByKeyword(calls)
    known = layout.statements if layout is not None and tree is not None else {}
    body = []
    for stmt in module.body:
        code_of = known.get(id(stmt))
        # a statement whose code names none is kept; the others are gone through along the
        # paths to such calls only
        body.append(stmt if code_of is not None and not named.search(code_of[0]) else visitor.along(stmt))
    if not visitor.changed:
        return text
    new = module.with_changes(body=body)
    return layout.code_of(new) if known else module_code(new)

