"""Pure half training (``model.half()``, ``.to(torch.float16)``): where its casts are, shared by
AR206 (Adam's eps under fp16) and AR209 (pure half becomes mixed precision)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst
import libcst.matchers as m

from accelerate_rewrite.codemod.analysis.facts import MODEL, ScriptFacts, unwrap_moves
from accelerate_rewrite.codemod.analysis.index import matching

#: what a mixed precision stands on (``Rule.premises``): given by AR101 (Fabric's precision),
#: AR207 (the torch backend's autocast) and AR213 (the script's own autocast, in that precision)
MIXED_GROUND = ("an autocast that computes in the mixed precision asked for (Fabric's precision, AR207's "
                "torch.autocast, or the script's own autocast set to it by AR213)")


def _cast(*dtypes: str):
    """``x.half()`` / ``x.to(torch.float16)`` (any other argument around it), for these dtypes."""
    names = m.OneOf(*(m.Name(d) for d in dtypes))
    methods = m.OneOf(*(m.Name(d) for d in dtypes if d in ("half", "bfloat16")))
    return (m.Call(func=m.Attribute(attr=methods))
            | m.Call(func=m.Attribute(attr=m.Name("to")),
                     args=[m.ZeroOrMore(), m.Arg(value=m.Attribute(attr=names)), m.ZeroOrMore()]))


_LOW = m.Attribute(attr=m.Name("float16") | m.Name("half") | m.Name("bfloat16"))
HALF = _cast("float16", "half")
#: a cast to fp16 or bf16: what a script (or AR210) does to train in true half precision
LOW_CAST = _cast("float16", "half", "bfloat16")


def low_precision_model_cast(f: ScriptFacts) -> Optional[cst.Call]:
    """The first fp16/bf16 cast of a trained model, if the script has one."""
    return next((c for c in matching(f.attribute_calls, LOW_CAST) if _casts_model(f, c)), None)


@dataclass
class HalfCasts:
    """The fp16 casts that make a script train in pure half: the trained model's, and those of
    the tensors inside its training loops. Casts elsewhere (a smaller checkpoint, inference)
    are not among them."""

    model_cast: Optional[cst.Call] = None  # the first cast of a trained model: the script trains in fp16
    training: list[cst.Call] = field(default_factory=list)  # every cast to strip for mixed precision


def half_casts(f: ScriptFacts) -> HalfCasts:
    return f.memo("half-casts", lambda: _find(f, HALF))


def low_casts(f: ScriptFacts) -> HalfCasts:
    """As ``half_casts``, with bf16 casts too (``model.bfloat16()``, ``.to(torch.bfloat16)``)."""
    return f.memo("low-casts", lambda: _find(f, LOW_CAST))


def _casts_model(f: ScriptFacts, call: cst.Call) -> bool:
    statement = f.statement(call)
    if m.matches(statement, m.SimpleStatementLine(body=[m.Assign(targets=[m.AssignTarget()])])):
        key = f.key_of(statement.body[0].targets[0].target)  # model = Net().half()
    else:
        key = f.key_of(unwrap_moves(call))  # model.half()
    return key is not None and MODEL in f.kinds.get(key, set())


def _find(f: ScriptFacts, cast) -> HalfCasts:
    out = HalfCasts()
    if not f.backward_sites:
        return out
    casts = matching(f.attribute_calls, cast)
    if not casts:  # (the lines below are asked only of a script that casts)
        return out
    loops = {id(a) for s in f.backward_sites for a in f.ancestors(s.call) if isinstance(a, (cst.For, cst.While))}
    last_backward = max(f.line(s.call) for s in f.backward_sites)
    for call in casts:
        in_training = any(id(a) in loops for a in f.ancestors(call))
        if f.line(call) > last_backward and not in_training:
            continue  # after training: a smaller checkpoint, or inference
        if _casts_model(f, call):
            out.model_cast = out.model_cast or call
            out.training.append(call)
        elif in_training:
            out.training.append(call)
    if out.model_cast is None:
        out.training = []
    return out


def strip_half(call: cst.Call) -> cst.BaseExpression:
    """``x.half()`` -> ``x``; ``x.to(torch.float16)`` -> ``x``; ``x.to(d, torch.float16)`` -> ``x.to(d)``
    (and the same for bf16)."""
    if call.func.attr.value in ("half", "bfloat16"):  # type: ignore[union-attr]
        return call.func.value  # type: ignore[union-attr]
    rest = [a for a in call.args if not m.matches(a.value, _LOW)]
    if not rest:
        return call.func.value  # type: ignore[union-attr]
    rest[-1] = rest[-1].with_changes(comma=cst.MaybeSentinel.DEFAULT)
    return call.with_changes(args=rest)
