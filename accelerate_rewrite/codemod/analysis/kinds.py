"""What the facts of a script are made of: the kinds of objects a training script builds,
the qualified names they are known by, and the records ScriptFacts keeps of them (codemod/analysis/facts.py
re-exports all of it)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional, Union

import libcst as cst
import libcst.matchers as m

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.view import Facts

Owner = cst.CSTNode
Key = tuple[Owner, str]

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"
LOADER = "loader"
DEVICE = "device"
MODULE = "module"  # any nn.Module that is not trained by an optimizer (a loss, a metric, ...)
SCALER = "scaler"  # a GradScaler
#: an object of a library's loss-scaler class (timm's NativeScaler): called, it runs backward and
#: the step itself (codemod/analysis/libraries.py)
LOSS_SCALER = "loss scaler"
GRAD_SCALERS = (
    "torch.amp.GradScaler", "torch.amp.grad_scaler.GradScaler", "torch.cuda.amp.GradScaler",
    "torch.cuda.amp.grad_scaler.GradScaler", "torch.cpu.amp.GradScaler",
    "torch.cpu.amp.grad_scaler.GradScaler",
)

_NOT_MODULES = (
    "torch.nn.functional",
    "torch.nn.utils",
    "torch.nn.init",
    "torch.nn.Parameter",
    "torch.nn.parameter",
    "torch.nn.DataParallel",
    "torch.nn.parallel",
)
_FRAMEWORKS = {
    "lightning.fabric": "Lightning Fabric",
    "lightning_fabric": "Lightning Fabric",
    "lightning.Fabric": "Lightning Fabric",
    "lightning.pytorch": "the Lightning Trainer",
    "lightning.Trainer": "the Lightning Trainer",
    "lightning.LightningModule": "the Lightning Trainer",
    "lightning.LightningDataModule": "the Lightning Trainer",
    "pytorch_lightning": "the Lightning Trainer",
    "accelerate": "Hugging Face Accelerate",
}
_FRAMEWORK_HARMLESS = ("seed_everything",)
HAND_DDP = {
    "torch.distributed.init_process_group": "init_process_group",
    "torch.nn.parallel.DistributedDataParallel": "DistributedDataParallel",
    "torch.nn.parallel.distributed.DistributedDataParallel": "DistributedDataParallel",
    "torch.utils.data.distributed.DistributedSampler": "DistributedSampler",
    "torch.utils.data.DistributedSampler": "DistributedSampler",
    "torch.multiprocessing.spawn": "torch.multiprocessing.spawn",
}
DATA_PARALLEL = ("torch.nn.DataParallel", "torch.nn.parallel.DataParallel",
                 "torch.nn.parallel.data_parallel.DataParallel")
DATALOADERS = ("torch.utils.data.DataLoader", "torch.utils.data.dataloader.DataLoader")
CLIP_NORM = ("torch.nn.utils.clip_grad_norm_", "torch.nn.utils.clip_grad.clip_grad_norm_")
CLIP_VALUE = ("torch.nn.utils.clip_grad_value_", "torch.nn.utils.clip_grad.clip_grad_value_")
APEX_INITIALIZE = ("apex.amp.initialize", "apex.amp.frontend.initialize")
APEX_SCALE_LOSS = ("apex.amp.scale_loss", "apex.amp.handle.scale_loss")
APEX_MASTER_PARAMS = ("apex.amp.master_params",)
APEX_STATE_DICT = ("apex.amp.state_dict", "apex.amp.frontend.state_dict")
APEX_LOAD_STATE_DICT = ("apex.amp.load_state_dict", "apex.amp.frontend.load_state_dict")
BCE_MODULES = ("torch.nn.BCELoss", "torch.nn.modules.loss.BCELoss")
BCE_FUNCTIONS = ("torch.nn.functional.binary_cross_entropy",)
AUTOCAST = (
    "torch.autocast",
    "torch.amp.autocast",
    "torch.cuda.amp.autocast",
    "torch.cpu.amp.autocast",
    "torch.amp.GradScaler",
    "torch.cuda.amp.GradScaler",
    "torch.cpu.amp.GradScaler",
    "torch.amp.grad_scaler.GradScaler",
)


@dataclass
class Binding:
    """An object built in the script: ``path = <value>`` in the statement ``stmt``."""

    key: Key
    kind: str
    stmt: cst.BaseStatement  # the statement in its block (a SimpleStatementLine or compound)
    value: cst.BaseExpression  # the whole assigned value, e.g. ``Net().to(device)``
    call: Optional[cst.Call]  # the constructor call inside it, e.g. ``Net()``
    qualname: str

    @property
    def owner(self) -> Owner:
        return self.key[0]

    @property
    def path(self) -> str:
        return self.key[1]


@dataclass
class Optimizer(Binding):
    models: list[Key] = field(default_factory=list)  # whose parameters it takes
    #: a class of the script's own deriving from torch.optim.Optimizer (SAM), or one the
    #: analysis can't see into (imported from a package, ``getattr(optim, args.optim)``) that the
    #: script steps: it may step it by methods of its own (``first_step``, ``second_step``)
    custom: bool = False
    #: a wrapper of the script's own around an optimizer (``ScheduledOptim(optim.Adam(...),
    #: ...)``, whose methods step it): the attribute that holds the optimizer inside, which is
    #: what gets set up (``optimizer._optimizer``)
    inner: Optional[str] = None

    @property
    def set_up_as(self) -> str:
        """How the optimizer to set up is written: ``optimizer``, or ``optimizer._optimizer``."""
        return f"{self.path}.{self.inner}" if self.inner else self.path


@dataclass
class BackwardSite:
    call: cst.Call  # ``<loss>.backward(...)``
    loss: cst.BaseExpression
    stmt: cst.BaseStatement
    function: Optional[cst.FunctionDef]  # the function it is in, if any
    #: a call of a library's loss scaler (``loss_scaler(loss, optimizer, ...)``, timm's
    #: NativeScaler): its class's qualified name. It runs backward and steps itself
    #: (codemod/analysis/libraries.py); the rules leave it as it is, or refuse, and say so
    library: Optional[str] = None


@dataclass
class DeviceMove:
    """``x.to(<device>)``, ``x.cuda()``, ``x.to(0)``: moves ``receiver`` to a device."""

    call: cst.Call
    receiver: cst.BaseExpression
    device_arg: Optional[cst.Arg]  # None for .cuda()
    removable: bool  # no other argument than the device and non_blocking/copy


@dataclass(slots=True)
class CallSite:
    call: cst.Call
    qualname: str  # the first of ``names``
    names: frozenset[str] = frozenset()  # all of them: ``amp`` bound by an import and a fallback


@dataclass
class Function:
    node: Union[cst.FunctionDef, cst.ClassDef]
    name: str
    params: list[cst.Param]
    calls: list[cst.Call] = field(default_factory=list)
    other_uses: list[cst.Name] = field(default_factory=list)  # referenced but not called


#: an optimizer's methods that are not a step of its own
_NOT_STEPS = ("step", "zero_grad", "state_dict", "load_state_dict", "add_param_group", "register_step_pre_hook",
              "register_step_post_hook")


def custom_steps(f: Facts) -> list[tuple[Optimizer, list[str]]]:
    """Optimizers of the script's own class (SAM) that it steps by methods of their own
    (``first_step``, ``second_step``), with those methods."""
    out = []
    for opt in (o for o in f.optimizers if o.custom):
        methods = sorted({c.func.attr.value for c in f.attribute_calls
                          if c.func.attr.value not in _NOT_STEPS and f.same_object(f.key_of(c.func.value), opt.key)})
        if methods:
            out.append((opt, methods))
    return out


def stepped_by(f: Facts) -> str:
    """``: `optimizer` (SAM) steps by `first_step` and `second_step` ...``, for a rule that
    needs an ``optimizer.step()`` and found none; empty when there is no such optimizer."""
    stepped = custom_steps(f)
    if not stepped:
        return ""
    opt, methods = stepped[0]
    return (f": `{opt.path}` ({opt.qualname}) steps by {' and '.join(f'`{n}`' for n in methods)}, "
            "whose updates the rule can't place itself around")


def hand_updated(f: Facts) -> list[tuple[Key, cst.For]]:
    """Models whose parameters the script updates by hand, with no optimizer (``for p in
    model.parameters(): p.data.add_(p.grad, alpha=-lr)``, the word language model's SGD): the
    model's key and the loop. Made once per file."""
    def compute() -> list[tuple[Key, cst.For]]:
        out = []
        for loop in f.find(m.For(target=m.Name(), iter=m.Call(func=m.Attribute(attr=m.Name("parameters"))))):
            name = loop.target.value
            reads_grad = m.findall(loop.body, m.Attribute(value=m.Name(name), attr=m.Name("grad")))
            updates = m.findall(loop.body, m.Call(func=m.Attribute(
                value=m.Attribute(value=m.Name(name), attr=m.Name("data")) | m.Name(name))))
            key = f.key_of(loop.iter.func.value)
            if reads_grad and updates and key is not None:
                out.append((key, loop))
        return out
    return f.memo("hand-updated", compute)
