"""NVIDIA apex.amp in a script: what AR211 migrates, found once and shared by both backends'
plans (the Fabric plan and the native one)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.syntax import short
from accelerate_rewrite.codemod.analysis.arguments import keywords, positional
from accelerate_rewrite.codemod.analysis.facts import (
    APEX_INITIALIZE,
    APEX_LOAD_STATE_DICT,
    APEX_MASTER_PARAMS,
    APEX_SCALE_LOSS,
    APEX_STATE_DICT,
    ScriptFacts,
    code,
)

#: apex.amp's optimization levels and the precision each one becomes
APEX_LEVELS = {"O0": "32-true", "O1": "16-mixed", "O2": "16-mixed", "O3": "16-true"}


@dataclass
class ApexUse:
    problem: Optional[tuple[cst.CSTNode, str]] = None  # apex used in a way AR211 does not migrate
    level: Optional[str] = None  # "O1", ...
    unknown_level: Optional[cst.Call] = None  # an opt_level that is not a literal
    #: the command-line flag whose literal default gave the opt_level (``--opt-level``)
    level_flag: Optional[str] = None
    inits: list[cst.BaseStatement] = field(default_factory=list)  # ``model, opt = amp.initialize(...)``
    #: id(the backward call in a scale_loss block) -> (the ``with`` statement, the loss it scales)
    blocks: dict[int, tuple[cst.With, cst.BaseExpression]] = field(default_factory=dict)
    master_params: list[cst.Call] = field(default_factory=list)
    states: list[cst.Call] = field(default_factory=list)  # ``amp.state_dict()``
    loads: list[cst.Call] = field(default_factory=list)  # ``amp.load_state_dict(...)``

    @property
    def present(self) -> bool:
        return bool(self.inits or self.blocks or self.problem or self.master_params or self.states
                    or self.loads)

    @property
    def precision(self) -> Optional[str]:
        return APEX_LEVELS.get(self.level) if self.level else None


def apex_use(f: ScriptFacts) -> ApexUse:
    return f.memo("apex-use", lambda: _find(f))


def _find(f: ScriptFacts) -> ApexUse:
    out = ApexUse()
    levels: dict[str, cst.Call] = {}
    for call in f.calls_named(*APEX_INITIALIZE):
        # (``**amp_args`` read as Python passes it: codemod/analysis/arguments.py)
        passed = keywords(f, call)
        level_arg = passed.get("opt_level") if passed is not None else None
        level = None if passed is None else "O1" if level_arg is None else getattr(level_arg, "evaluated_value", None)
        if level is None and level_arg is not None:
            out.level_flag, level = _flag_default(f, level_arg)
        if level in APEX_LEVELS:
            levels[level] = call
        else:
            out.unknown_level = call
        statement = f.statement(call)
        assign = statement.body[0] if isinstance(statement, cst.SimpleStatementLine) else None
        # apex's signature: initialize(models, optimizers=None, ...), either form
        given = positional(call) + [(passed or {})[k] for k in ("models", "optimizers") if k in (passed or {})]
        if not isinstance(assign, cst.Assign) or len(assign.targets) != 1 or assign.value is not call \
                or _flat(assign.targets[0].target) != [n for g in given for n in _flat(g)]:
            out.problem = (call, f"`{short(call)}` must hand back the objects it takes, as "
                                 "`model, optimizer = amp.initialize(model, optimizer, ...)`")
            return out
        out.inits.append(statement)
    if len(levels) > 1:
        out.problem = (list(levels.values())[1], f"apex is initialised at {' and '.join(levels)}: "
                                                 "give --precision")
        return out
    out.level = next(iter(levels), None)
    withs = {}
    for call in f.calls_named(*APEX_SCALE_LOSS):
        node = f.parent(f.parent(call))
        if not (isinstance(node, cst.With) and node.items[0].item is call and node.items[0].asname
                and isinstance(node.items[0].asname.name, cst.Name) and call.args):
            out.problem = (call, f"`{short(call)}` outside `with ... as scaled_loss:`: convert by hand")
            return out
        withs[id(node)] = (node, call, node.items[0].asname.name.value)
    counts: dict[int, int] = {}
    for site in f.backward_sites:
        found = next((withs[id(a)] for a in f.ancestors(site.call) if id(a) in withs), None)
        if found is not None:
            counts[id(found[0])] = counts.get(id(found[0]), 0) + 1
    for site in f.backward_sites:
        found = next((withs[id(a)] for a in f.ancestors(site.call) if id(a) in withs), None)
        if found is None:
            continue
        node, call, name = found
        statement = f.statement(site.call)
        if not m.matches(site.loss, m.Name(name)):
            # e.g. ``(scaled_loss / 4).backward()``: converting the block would drop the division
            out.problem = (site.call, f"`{short(site.call)}` inside `with {short(call)} as {name}:` "
                                      f"is not `{name}.backward()`: convert by hand")
            return out
        if counts[id(node)] > 1:
            out.problem = (node, "an apex `scale_loss` block that does more than one backward: "
                                 "convert by hand")
            return out
        if len(node.items) != 1:
            out.problem = (node, f"`with {short(call)}` opens other contexts too: convert by hand")
            return out
        others = [s for s in node.body.body if s is not statement and not _is_pass(s)]
        if not any(s is statement for s in node.body.body):
            out.problem = (node, f"the backward in `with {short(call)}` is nested in another "
                                 "statement of the block: convert by hand")
            return out
        if others:
            out.problem = (others[0], f"an apex `scale_loss` block that does more than its backward "
                                      f"(`{short(others[0])}`): convert by hand")
            return out
        out.blocks[id(site.call)] = (node, call.args[0].value)
    out.master_params = f.calls_named(*APEX_MASTER_PARAMS)
    out.states = f.calls_named(*APEX_STATE_DICT)
    out.loads = f.calls_named(*APEX_LOAD_STATE_DICT)
    for call in out.loads:
        if not m.matches(f.statement(call), m.SimpleStatementLine(body=[m.Expr(value=m.Call())])):
            out.problem = (call, f"`{short(call)}` is used as a value: convert by hand")
    return out


def _is_pass(stmt: cst.BaseStatement) -> bool:
    """A statement that does nothing: ``pass`` (or ``...``), which a converted block can drop."""
    return m.matches(stmt, m.SimpleStatementLine(body=[m.AtLeastN(m.Pass() | m.Expr(m.Ellipsis()), n=1)]))


def _flat(node: cst.BaseExpression) -> list[str]:
    """``model, [opt_a, opt_b]`` -> ["model", "opt_a", "opt_b"]."""
    if isinstance(node, (cst.Tuple, cst.List)):
        return [n for e in node.elements for n in _flat(e.value)]
    return [code(node)]



def _flag_default(f: ScriptFacts, value: cst.BaseExpression) -> tuple[Optional[str], Optional[str]]:
    """``opt_level=args.opt_level``: the flag (``--opt-level``) and its literal default, where
    an ``add_argument`` of the script declares one."""
    from accelerate_rewrite.codemod.analysis.flags import flags

    found = flags(f).get(value.attr.value) if isinstance(value, cst.Attribute) else None
    if found is None or not isinstance(found.default, str):
        return None, None
    return found.flag, found.default
