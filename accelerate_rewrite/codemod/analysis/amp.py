"""The script's own mixed precision: every autocast it enters (called, a library's that returns
one (libraries.py's ``LIBRARY_AUTOCASTS``), kept in a name as
``amp_autocast = torch.cuda.amp.autocast``, or bound by ``functools.partial(torch.autocast, ...)``),
the arguments each is given by parameter, the dtype it computes in, and every GradScaler it
creates, in the script or in a class of its own (a loss scaler), and the library loss scalers
it creates (timm's NativeScaler). Read by the rules that set the precision asked for over it
(rules/precision/own_precision.py) and by the AMP API migration (rules/precision/amp_api.py)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts, code
from accelerate_rewrite.codemod.analysis.libraries import (
    LIBRARY_AUTOCAST_KEYWORDS,
    LIBRARY_AUTOCASTS,
    LOSS_SCALERS,
)

_AUTOCAST_PARAMS = ("device_type", "dtype", "enabled", "cache_enabled")
_DEVICE_AUTOCAST_PARAMS = ("enabled", "dtype", "cache_enabled")
#: autocast's spellings -> (the device type it names, or None: its first parameter; its parameters)
AUTOCASTS: dict[str, tuple[Optional[str], tuple[str, ...]]] = {
    "torch.autocast": (None, _AUTOCAST_PARAMS),
    "torch.amp.autocast": (None, _AUTOCAST_PARAMS),
    "torch.amp.autocast_mode.autocast": (None, _AUTOCAST_PARAMS),
    "torch.cuda.amp.autocast": ("cuda", _DEVICE_AUTOCAST_PARAMS),
    "torch.cuda.amp.autocast_mode.autocast": ("cuda", _DEVICE_AUTOCAST_PARAMS),
    "torch.cpu.amp.autocast": ("cpu", _DEVICE_AUTOCAST_PARAMS),
    "torch.cpu.amp.autocast_mode.autocast": ("cpu", _DEVICE_AUTOCAST_PARAMS),
}
_SCALER_PARAMS = ("device", "init_scale", "growth_factor", "backoff_factor", "growth_interval", "enabled")
_DEVICE_SCALER_PARAMS = _SCALER_PARAMS[1:]
#: GradScaler's spellings -> (the device it names, or None: its first parameter; its parameters)
SCALERS: dict[str, tuple[Optional[str], tuple[str, ...]]] = {
    "torch.amp.GradScaler": (None, _SCALER_PARAMS),
    "torch.amp.grad_scaler.GradScaler": (None, _SCALER_PARAMS),
    "torch.cuda.amp.GradScaler": ("cuda", _DEVICE_SCALER_PARAMS),
    "torch.cuda.amp.grad_scaler.GradScaler": ("cuda", _DEVICE_SCALER_PARAMS),
    "torch.cpu.amp.GradScaler": ("cpu", _DEVICE_SCALER_PARAMS),
    "torch.cpu.amp.grad_scaler.GradScaler": ("cpu", _DEVICE_SCALER_PARAMS),
}
PARTIALS = ("functools.partial",)
#: what autocast computes in where no dtype is given, by device type (torch.get_autocast_dtype)
DEFAULT_DTYPES = {"cuda": "float16", "cpu": "bfloat16", "xpu": "bfloat16", "mps": "float16"}
_DTYPES = {"torch.float16": "float16", "torch.half": "float16", "torch.bfloat16": "bfloat16"}


@dataclass
class Made:
    """An autocast or a GradScaler of the script: ``node`` is the call (``form`` "call"), the
    ``functools.partial(...)`` call that binds it ("partial"), or the reference that names it
    without calling it ("reference"); ``args``: the arguments given, by parameter name."""

    node: cst.CSTNode
    form: str
    qualname: str
    device: Optional[str]  # the device type its name says (torch.cuda.amp.*), else None
    args: dict[str, cst.BaseExpression] = field(default_factory=dict)
    starred: bool = False  # given *args or **kwargs: its arguments are not known
    #: the device type where none is given (a library's autocast: ultralytics' says "cuda")
    default_device: Optional[str] = None

    @property
    def device_literal(self) -> Optional[str]:
        """The device type, where it is a literal string (or named by the API)."""
        if self.device is not None:
            return self.device
        given = self.args.get("device_type", self.args.get("device"))
        if isinstance(given, cst.SimpleString):
            return given.evaluated_value if isinstance(given.evaluated_value, str) else None
        return self.default_device if given is None else None

    @property
    def off(self) -> bool:
        """``enabled=False``, literally: a region where autocast is switched off."""
        enabled = self.args.get("enabled")
        return isinstance(enabled, cst.Name) and enabled.value == "False"

    def dtype(self, facts: ScriptFacts) -> Optional[str]:
        """"float16" or "bfloat16": what it computes in, where that is known."""
        given = self.args.get("dtype")
        if given is None:
            device = self.device_literal
            return DEFAULT_DTYPES.get(device) if device is not None else None
        return _DTYPES.get(facts.qualname(given) or code(given))


@dataclass
class OwnAmp:
    autocasts: list[Made] = field(default_factory=list)
    scalers: list[Made] = field(default_factory=list)
    #: ``loss_scaler = NativeScaler()``: a library's loss scaler, with its GradScaler inside
    library_scalers: list[tuple[cst.Call, str]] = field(default_factory=list)

    @property
    def computing(self) -> list[Made]:
        """The autocasts that compute (not those that switch autocast off)."""
        return [a for a in self.autocasts if not a.off]


def own_amp(facts: ScriptFacts) -> OwnAmp:
    """The script's own mixed precision (made once for the facts)."""
    return facts.memo("own-amp", lambda: _find(facts))


def _arguments(call: cst.Call, params: tuple[str, ...], skip: int = 0, renamed: Optional[dict] = None
               ) -> tuple[dict, bool]:
    args: dict[str, cst.BaseExpression] = {}
    starred = False
    position = 0
    for arg in call.args[skip:]:
        if arg.star:
            starred = True
        elif arg.keyword is not None:
            args[(renamed or {}).get(arg.keyword.value, arg.keyword.value)] = arg.value
        else:
            if position < len(params):
                args[params[position]] = arg.value
            position += 1
    return args, starred


def _find(f: ScriptFacts) -> OwnAmp:
    out = OwnAmp()
    called = set()
    for site in f.calls:
        for table, into in ((AUTOCASTS, out.autocasts), (SCALERS, out.scalers)):
            spec = table.get(site.qualname)
            if spec is None:
                continue
            device, params = spec
            args, starred = _arguments(site.call, params)
            into.append(Made(site.call, "call", site.qualname, device, args, starred))
            called.add(id(site.call.func))
        if site.qualname in LOSS_SCALERS:
            out.library_scalers.append((site.call, site.qualname))
        library = LIBRARY_AUTOCASTS.get(site.qualname)
        if library is not None:
            args, starred = _arguments(site.call, library.params, renamed=LIBRARY_AUTOCAST_KEYWORDS)
            out.autocasts.append(Made(site.call, "call", site.qualname, None, args, starred,
                                      default_device=library.device_type))
            called.add(id(site.call.func))
    decorated = {id(d.decorator) for d in f.decorators}
    for node, qualname in f.qualified_refs:
        spec = AUTOCASTS.get(qualname)
        if spec is None or id(node) in called or id(node) in decorated:
            continue
        parent = f.parent(node)
        if parent is None or isinstance(parent, (cst.ImportAlias, cst.Attribute, cst.ImportFrom)):
            continue
        device, params = spec
        if isinstance(parent, cst.Arg) and parent.value is node:
            call = f.parent(parent)
            if isinstance(call, cst.Call) and call.args and call.args[0] is parent \
                    and f.qualname(call.func) in PARTIALS:
                args, starred = _arguments(call, params, skip=1)
                out.autocasts.append(Made(call, "partial", qualname, device, args, starred))
                continue
        out.autocasts.append(Made(node, "reference", qualname, device))
    out.autocasts = f.in_order(out.autocasts, lambda made: made.node)
    return out
