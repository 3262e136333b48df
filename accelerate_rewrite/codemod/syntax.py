"""What the analysis reads of a node, with no facts of its own: a node's code, the object under
``.to(device)`` calls, a function's parameters, device expressions. The bottom of codemod/'s
analysis: the collector (codemod/facts_collect.py), the optimizer search
(codemod/facts_optimizers.py) and the rules read these; codemod/facts.py re-exports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import libcst as cst
import libcst.matchers as m

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.facts import ScriptFacts


def code(node: cst.CSTNode) -> str:
    """The source text of a node."""
    return cst.Module([]).code_for_node(node)


def short(node: cst.CSTNode, limit: int = 48) -> str:
    """One line of code for a message: whitespace folded, long code cut; a statement's own
    leading comments and blank lines are not its code."""
    if isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) and node.leading_lines:
        node = node.with_changes(leading_lines=[])
    text = " ".join(code(node).split())
    return text if len(text) <= limit else text[: limit - 3] + "..."


def root_of(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``model.fc.weight`` -> ``model``; ``self.model.fc`` -> ``self.model``."""
    while isinstance(expr, cst.Attribute):
        if m.matches(expr, m.Attribute(value=m.Name("self"))):
            return expr
        expr = expr.value
    while isinstance(expr, cst.Subscript):
        expr = root_of(expr.value)
    return expr


def unwrap_moves(expr: cst.BaseExpression) -> cst.BaseExpression:
    """``Net().to(device).train()`` -> ``Net()``: strip method calls that return the object."""
    while m.matches(
        expr,
        m.Call(func=m.Attribute(attr=m.Name("to") | m.Name("cuda") | m.Name("cpu") | m.Name("train")
                                | m.Name("float") | m.Name("half") | m.Name("bfloat16") | m.Name("double"))),
    ):
        expr = expr.func.value  # type: ignore[union-attr]
    return expr


def positional_params(node: Union[cst.FunctionDef, cst.ClassDef]) -> list[cst.Param]:
    if isinstance(node, cst.ClassDef):
        init = init_of(node)
        if init is None:
            return []
        return list(init.params.posonly_params) + list(init.params.params)[1:]
    params = list(node.params.posonly_params) + list(node.params.params)
    return params


def param_for(params: list[cst.Param], node, arg: cst.Arg, index: int) -> Optional[cst.Param]:
    if arg.star:
        return None
    if arg.keyword is not None:
        func = node if isinstance(node, cst.FunctionDef) else init_of(node)
        if func is None:
            return None
        for p in [*func.params.params, *func.params.kwonly_params, *func.params.posonly_params]:
            if p.name.value == arg.keyword.value:
                return p
        return None
    return params[index] if index < len(params) else None


def init_of(cls: cst.ClassDef) -> Optional[cst.FunctionDef]:
    if isinstance(cls.body, cst.IndentedBlock):
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                return stmt
    return None


def is_device_expr(facts: "ScriptFacts", expr: cst.BaseExpression) -> bool:
    """``torch.device(...)``, ``"cuda"``, ``"cuda" if torch.cuda.is_available() else "cpu"``,
    ``torch.accelerator.current_accelerator()``, and conditionals of those."""
    if isinstance(expr, cst.IfExp):
        return is_device_expr(facts, expr.body) and is_device_expr(facts, expr.orelse)
    if isinstance(expr, cst.SimpleString):
        text = expr.evaluated_value
        return isinstance(text, str) and (
            text in ("cpu", "cuda", "mps", "xpu") or text.startswith("cuda:")
        )
    if isinstance(expr, cst.Call):
        return facts.qualname(expr) in (
            "torch.device",
            "torch.accelerator.current_accelerator",
        )
    if isinstance(expr, cst.Attribute) and expr.attr.value == "device":
        return False
    return False


def is_literal_device(facts: "ScriptFacts", expr: cst.BaseExpression) -> bool:
    """A device spelled out in a ``.to(...)``: ``"cuda"``, ``0``, ``torch.device("cuda")``."""
    if isinstance(expr, cst.Integer):
        return True
    return is_device_expr(facts, expr)


def callee_text(call: cst.Call) -> str:
    return code(call.func)


#: calls that wrap an iterable and yield its items (with an index, a progress bar)
ITER_WRAPPERS = m.Name("enumerate") | m.Name("tqdm") | m.Attribute(attr=m.Name("tqdm"))
#: calls that count (epochs, steps): never a source of data
COUNTERS = m.Name("range") | m.Name("trange") | m.Attribute(attr=m.Name("trange")) | m.Attribute(attr=m.Name("count"))


def unwrap_iter(source: cst.BaseExpression) -> cst.BaseExpression:
    """``enumerate(tqdm(loader))`` -> ``loader``."""
    while m.matches(source, m.Call(func=ITER_WRAPPERS)) and source.args:
        source = source.args[0].value
    return source
