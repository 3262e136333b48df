"""Post-conditions on a rewritten module: it parses, and it uses no name it does not define."""

from __future__ import annotations

from typing import Callable, Optional

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, ScopeProvider


def undefined_names(module: cst.Module) -> dict[str, int]:
    """Names read somewhere without any assignment, import or builtin behind them -> first line."""
    wrapper = MetadataWrapper(module, unsafe_skip_copy=True)
    return undefined_in(wrapper.resolve(ScopeProvider), wrapper.resolve(PositionProvider))


def undefined_in(scopes, positions) -> dict[str, int]:
    out: dict[str, int] = {}
    for scope in {s for s in scopes.values() if s is not None}:
        for access in scope.accesses:
            if access.referents:
                continue
            name = access.node.value if isinstance(access.node, cst.Name) else None
            if name is None or name in out:
                continue
            pos = positions.get(access.node)
            out[name] = pos.start.line if pos is not None else 0
    return out


def check(
    original_undefined: dict[str, int],
    new_code: str,
    locate: Callable[[str], Optional[int]] = lambda name: None,
) -> list[str]:
    """Problems of ``new_code`` that the original did not have; empty when all is well.

    ``locate(name)`` gives the line of the input where a name that is no longer defined is
    read (the user's file, not the discarded result).
    """
    try:
        module = cst.parse_module(new_code)
    except cst.ParserSyntaxError as exc:
        return [f"the result does not parse ({exc.message})"]
    try:
        compile(new_code, "<rewritten>", "exec", dont_inherit=True)
    except SyntaxError as exc:
        return [f"the result does not compile ({exc.msg})"]
    problems = []
    for name, line in sorted(undefined_names(module).items(), key=lambda item: item[1]):
        if name not in original_undefined:
            where = locate(name)
            where_text = f"line {where}" if where is not None else f"line {line} of the result"
            problems.append(f"it uses `{name}` ({where_text}), which is no longer defined")
    return problems
