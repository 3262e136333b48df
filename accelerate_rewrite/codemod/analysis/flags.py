"""The script's command-line flags: ``parser.add_argument("--opt-level", default="O1")``, by the
attribute the parsed arguments give them (``args.opt_level``). Read once per file; rules ask
which flag feeds a value (AR105: a ``--no-cuda`` that no longer chooses the device) and what a
flag's literal default is (AR211: an apex opt_level from the command line)."""

from __future__ import annotations

from dataclasses import dataclass

import libcst as cst

from accelerate_rewrite.codemod.analysis.view import Facts


@dataclass(frozen=True)
class Flag:
    call: cst.Call  # the add_argument(...) call
    flag: str  # "--opt-level" (the first long option, else the first given)
    default: object = None  # the literal default, if it is a string, number or bool literal


def flags(f: Facts) -> dict[str, Flag]:
    """dest (``opt_level``) -> its flag."""
    return f.memo("argparse-flags", lambda: _find(f))


def _find(f: Facts) -> dict[str, Flag]:
    out: dict[str, Flag] = {}
    for call in f.attribute_calls:
        if call.func.attr.value != "add_argument" or not call.args:
            continue
        names = [a.value.evaluated_value for a in call.args
                 if a.keyword is None and isinstance(a.value, cst.SimpleString)]
        names = [x for x in names if isinstance(x, str)]
        keywords = {a.keyword.value: a.value for a in call.args if a.keyword is not None}
        dest = keywords.get("dest")
        longs = [x for x in names if x.startswith("--")]
        name = (dest.evaluated_value if isinstance(dest, cst.SimpleString)
                else longs[0][2:] if longs else names[0].lstrip("-") if names else None)
        if not name:
            continue
        default = keywords.get("default")
        value = default.evaluated_value if isinstance(default, (cst.SimpleString, cst.Integer, cst.Float)) \
            else None
        out.setdefault(name.replace("-", "_"), Flag(call, (longs or names)[0], value))
    return out
