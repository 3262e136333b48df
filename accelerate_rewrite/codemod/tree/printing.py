"""A node's code, LibCST's own code generation without a context manager made for each node
(``code_for``, ``module_code``).

LibCST's ``CodegenState.record_syntactic_position`` is a generator-made context manager that
records nothing (the position providers' states record there); every node's code generation
enters one, about a third of printing a module (dino's utils.py: 26 ms, 18 without). ``PlainState`` is LibCST's state with one shared
context that does nothing instead: the same tokens, in the same order (tests/test_layout.py
compares ``code_for`` with ``Module.code_for_node`` on every fixture). The rewrite prints a
module's changed statements at every attempt, and a repository's programs print their shared
modules' statements again (docs/benchmarks.md, issue 62).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import libcst as cst
from libcst._nodes.internal import CodegenState

_NOTHING = nullcontext()


class PlainState(CodegenState):
    """LibCST's CodegenState whose positions (which it records none of) cost no context
    manager per node."""

    def record_syntactic_position(self, node, *, start_node=None, end_node=None):  # noqa: ARG002
        return _NOTHING


_EMPTY = cst.Module(body=[])


def code_for(node: cst.CSTNode, module: Optional[cst.Module] = None) -> str:
    """``module.code_for_node(node)`` (by default an empty module's: four spaces, ``\\n``)."""
    module = module if module is not None else _EMPTY
    state = PlainState(default_indent=module.default_indent, default_newline=module.default_newline)
    node._codegen(state)
    return "".join(state.tokens)


#: each node's code, printed once: id -> (the node, kept alive so that its id is not reused, its
#: code). The trees of a repository's modules are parsed once and shared by the programs of every
#: script that follows them: the analysis asks each program for the code of the same nodes
#: (codemod/analysis/syntax.py ``code``), and a merge compares the same statements' code many
#: times (codemod/project/compat.py)
_CODES: dict[int, tuple[cst.CSTNode, str]] = {}
_CODES_MAX = 50_000


def code_once(node: cst.CSTNode) -> str:
    """``code_for(node)``, printed once per node (LibCST's nodes never change)."""
    found = _CODES.get(id(node))
    if found is None or found[0] is not node:
        if len(_CODES) >= _CODES_MAX:
            _CODES.clear()
        found = _CODES[id(node)] = (node, code_for(node))
    return found[1]


def module_code(module: cst.Module) -> str:
    """``module.code``."""
    return code_for(module, module)
