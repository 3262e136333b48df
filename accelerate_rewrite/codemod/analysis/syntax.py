"""What the analysis reads of a node, with no facts of its own: a node's code, the object under
``.to(device)`` calls, a function's parameters, device expressions. The bottom of codemod/'s
analysis: the collector (codemod/analysis/collect.py), the optimizer search
(codemod/analysis/optimizers.py) and the rules read these; codemod/analysis/facts.py re-exports them."""

from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Union

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.tree.printing import code_once

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts


def code(node: cst.CSTNode) -> str:
    """The source text of a node (of a name without brackets, its value: most nodes asked)."""
    if type(node) is cst.Name and not node.lpar:
        return node.value
    return code_once(node)


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
    while isinstance(expr, cst.Call) and isinstance(expr.func, cst.Attribute) and expr.func.attr.value in _MOVES:
        expr = expr.func.value
    return expr


#: methods that return the object they are called on (``unwrap_moves``)
_MOVES = frozenset({"to", "cuda", "cpu", "train", "float", "half", "bfloat16", "double"})


#: ``if __name__ == "__main__":`` (or the operands the other way round)
MAIN_GUARD = m.If(test=m.Comparison(left=m.Name("__name__"), comparisons=[
    m.ComparisonTarget(operator=m.Equal(), comparator=m.SimpleString('"__main__"') | m.SimpleString("'__main__'"))])
    | m.Comparison(left=m.SimpleString('"__main__"') | m.SimpleString("'__main__'"), comparisons=[
        m.ComparisonTarget(operator=m.Equal(), comparator=m.Name("__name__"))]))


def is_main_guard(node: Optional[cst.CSTNode]) -> bool:
    """``if __name__ == "__main__":``: the block a script runs when it is run, never on import.
    Run as a script, its body runs unconditionally (its caller checks it is at the top level)."""
    return isinstance(node, cst.If) and m.matches(node, MAIN_GUARD)


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


def passed_at(call: cst.Call, index: int, keyword: str) -> Optional[cst.BaseExpression]:
    """The expression ``call`` passes at position ``index`` or as ``keyword``, or None (also
    where a ``*args`` before it hides the position)."""
    for position, arg in enumerate(call.args):
        if arg.star:
            return None
        if (arg.keyword is None and position == index) or (arg.keyword is not None and arg.keyword.value == keyword):
            return arg.value
    return None


def init_of(cls: cst.ClassDef) -> Optional[cst.FunctionDef]:
    if isinstance(cls.body, cst.IndentedBlock):
        for stmt in cls.body.body:
            if isinstance(stmt, cst.FunctionDef) and stmt.name.value == "__init__":
                return stmt
    return None


def is_device_expr(facts: Facts, expr: cst.BaseExpression) -> bool:
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


def is_literal_device(facts: Facts, expr: cst.BaseExpression) -> bool:
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


def unwrap_iter(source: cst.BaseExpression, through: frozenset[str] = frozenset()) -> cst.BaseExpression:
    """``enumerate(tqdm(loader))`` -> ``loader``; with ``through`` (``passes_through``), the
    script's own generators that yield their first argument's items too
    (``metric_logger.log_every(loader, 10)`` -> ``loader``)."""
    while isinstance(source, cst.Call) and source.args and source.args[0].keyword is None \
            and not source.args[0].star and (m.matches(source, m.Call(func=ITER_WRAPPERS)) or (
                (source.func.value if isinstance(source.func, cst.Name) else source.func.attr.value
                 if isinstance(source.func, cst.Attribute) else None) in through)):
        source = source.args[0].value
    return source


def passes_through(module: cst.Module, findall=m.findall) -> frozenset[str]:
    """The names of the module's functions and methods (of its top-level classes) that are
    generators yielding each item of their first argument unchanged, and nothing else: a
    logger's ``def log_every(self, iterable, print_freq): ... for obj in iterable: ... yield obj``.
    A name that another function or method of the module also has is left out. ``findall``:
    ``m.findall``, or the analysis's index that answers it (``ScriptFacts.find_in``)."""
    found: dict[str, bool] = {}

    def consider(func: cst.FunctionDef, method: bool) -> None:
        params = list(func.params.params)[1 if method else 0:]
        ok = False
        if params and not func.asynchronous and not func.decorators:
            first = params[0].name.value
            yields = findall(func.body, m.Yield())
            if len(yields) == 1 and m.matches(yields[0], m.Yield(value=m.Name())):
                name = yields[0].value.value
                # ``yield obj`` a statement of the loop's own body: every item, none skipped
                loops = [loop for loop in findall(func.body, m.For(target=m.Name(name), iter=m.Name(first)))
                         if any(isinstance(st, cst.SimpleStatementLine) and any(
                             isinstance(x, cst.Expr) and x.value is yields[0] for x in st.body)
                             for st in loop.body.body)
                         and not findall(loop.body, m.Continue() | m.Break())]
                written = findall(func.body, m.AssignTarget(target=m.Name(name) | m.Name(first)))
                ok = len(loops) == 1 and not written and not any(
                    r.value is not None for r in findall(func.body, m.Return()))
        found[func.name.value] = found.get(func.name.value, True) and ok

    for stmt in module.body:
        if isinstance(stmt, cst.FunctionDef):
            consider(stmt, False)
        elif isinstance(stmt, cst.ClassDef):
            for inner in stmt.body.body:
                if isinstance(inner, cst.FunctionDef):
                    consider(inner, True)
    return frozenset(name for name, ok in found.items() if ok)
