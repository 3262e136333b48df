"""The options a rewrite runs with, and their validation.

The valid values mirror Lightning Fabric 2.6 (``Fabric(accelerator=, strategy=, devices=,
num_nodes=, precision=)``) without importing it: the rewrite path must start fast. A test
checks these lists against Lightning's own registries.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Union

#: Fabric's precision values, in the order its docs list them.
PRECISIONS = (
    "32-true",
    "16-mixed",
    "bf16-mixed",
    "16-true",
    "bf16-true",
    "64-true",
    "transformer-engine",
    "transformer-engine-float16",
)
#: The mixed precisions (fp32 weights, half compute) and the true half ones (half weights).
MIXED_PRECISIONS = ("16-mixed", "bf16-mixed")
TRUE_HALF_PRECISIONS = ("16-true", "bf16-true")
#: The aliases Fabric also accepts, and the canonical value each one means.
PRECISION_ALIASES = {"32": "32-true", "16": "16-mixed", "bf16": "bf16-mixed", "64": "64-true"}

#: Strategy names in Fabric's registry, plus "auto".
STRATEGIES = (
    "auto",
    "ddp",
    "ddp_find_unused_parameters_true",
    "ddp_spawn",
    "ddp_fork",
    "ddp_notebook",
    "dp",
    "fsdp",
    "fsdp_cpu_offload",
    "deepspeed",
    "deepspeed_stage_1",
    "deepspeed_stage_1_offload",
    "deepspeed_stage_2",
    "deepspeed_stage_2_offload",
    "deepspeed_stage_3",
    "deepspeed_stage_3_offload",
    "deepspeed_stage_3_offload_nvme",
    "xla",
    "xla_fsdp",
    "single_xla",
    "single_tpu",
)
#: Strategies whose launcher has to be given the training function: ``fabric.launch(fn)``.
FUNCTION_LAUNCH_STRATEGIES = frozenset({"ddp_spawn", "ddp_fork", "ddp_notebook", "xla", "xla_fsdp"})

ACCELERATORS = ("auto", "cpu", "cuda", "gpu", "mps", "tpu")

#: How the rewrite speeds a script up: with Lightning Fabric, or with plain PyTorch (torch.autocast,
#: torch.amp.GradScaler, a cast of the model) and no new dependency, or with Hugging Face
#: Accelerate (the Fabric plan, spelled in Accelerate's API: rules/accelerate/spelling.py).
BACKENDS = ("fabric", "torch", "accelerate")
#: ``--precision`` -> ``Accelerator(mixed_precision=...)`` (accelerate 1.x); the others have no
#: Accelerate equivalent
ACCELERATE_PRECISIONS = {"32-true": "no", "16-mixed": "fp16", "bf16-mixed": "bf16",
                         "transformer-engine": "fp8"}  # fp8: Accelerate picks its FP8 backend (TransformerEngine where installed)
#: Options that only Fabric can carry out (processes, strategies, accelerators).
FABRIC_ONLY = ("devices", "strategy", "num_nodes", "accelerator")

#: ``--group-by-length``: evaluation loaders only (training wants shuffled batches), or all
GROUP_BY_LENGTH = ("eval", "all")

#: ``torch.set_float32_matmul_precision`` values
MATMUL_PRECISIONS = ("highest", "high", "medium")

#: Fabric's own defaults: arguments equal to these are not written into ``Fabric(...)``.
FABRIC_DEFAULTS = {
    "accelerator": "auto",
    "strategy": "auto",
    "devices": "auto",
    "num_nodes": 1,
    "precision": "32-true",
}

Devices = Union[int, str]


class OptionError(ValueError):
    """A wrong option value; the message is one line that lists the valid values."""


def normalize_precision(value: str) -> str:
    value = str(value).strip()
    if value in PRECISIONS:
        return value
    if value in PRECISION_ALIASES:
        return PRECISION_ALIASES[value]
    valid = ", ".join(PRECISIONS) + " (aliases: " + ", ".join(PRECISION_ALIASES) + ")"
    raise OptionError(f"invalid precision {value!r}; valid values: {valid}")


def _one_of(name: str, value: str, valid: tuple[str, ...]) -> str:
    value = str(value).strip()
    if value not in valid:
        raise OptionError(f"invalid {name} {value!r}; valid values: {', '.join(valid)}")
    return value


def normalize_strategy(value: str) -> str:
    return _one_of("strategy", value, STRATEGIES)


def normalize_accelerator(value: str) -> str:
    return _one_of("accelerator", value, ACCELERATORS)


def normalize_devices(value: Union[str, int]) -> Devices:
    """Fabric's forms: "auto", a count (int >= 1, or -1 for all), or device indices "0,1"."""
    text = str(value).strip()
    if text == "auto":
        return "auto"
    try:
        count = int(text)
    except ValueError:
        parts = [p.strip() for p in text.split(",") if p.strip()]
        if len(parts) > 1 and all(p.isdigit() for p in parts):
            return ",".join(parts)
        raise OptionError(
            f"invalid devices {value!r}; valid values: auto, a count such as 4, -1 for all, "
            "or device indices such as 0,1"
        ) from None
    if count == -1 or count >= 1:
        return count
    raise OptionError(
        f"invalid devices {value!r}; valid values: auto, a count such as 4, -1 for all, "
        "or device indices such as 0,1"
    )


def normalize_matmul_precision(value: str) -> str:
    return _one_of("matmul-precision", value, MATMUL_PRECISIONS)


def normalize_backend(value: str) -> str:
    return _one_of("backend", value, BACKENDS)


def _accelerate_options(precision, devices, strategy, accelerator) -> None:
    """What ``--backend accelerate`` writes so far: DDP (Accelerate's default), Accelerate's
    mixed precisions. The rest is refused with the reason."""
    if precision is not None and normalize_precision(precision) not in ACCELERATE_PRECISIONS:
        raise OptionError(f"--precision {normalize_precision(precision)} has no Accelerate equivalent (it takes "
                          + ", ".join(ACCELERATE_PRECISIONS) + "); use --backend fabric")
    if strategy is not None and normalize_strategy(strategy) not in ("auto", "ddp"):
        raise OptionError(f"--strategy {normalize_strategy(strategy)}: --backend accelerate does not write "
                          "Accelerate's FSDP or DeepSpeed plugins yet; use --backend fabric")
    if accelerator is not None and normalize_accelerator(accelerator) not in ("auto", "cpu", "cuda", "gpu"):
        raise OptionError(f"--accelerator {normalize_accelerator(accelerator)}: --backend accelerate takes "
                          "auto, cpu, cuda or gpu")


def normalize_clip_grad_norm(value: Union[str, float]) -> float:
    try:
        number = float(str(value).strip())
    except ValueError:
        number = 0.0
    if not number > 0 or number == float("inf"):
        raise OptionError(f"invalid clip-grad-norm {value!r}; valid values: a number > 0, such as 1.0")
    return number


def normalize_accumulate(value: Union[str, int]) -> int:
    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if count < 2:
        raise OptionError(f"invalid accumulate {value!r}; valid values: a whole number >= 2 "
                          "(the micro-batches per optimizer step)")
    return count


#: ``--freeze`` forms: a module path (``encoder.layer.0``), a slice of a ModuleList or Sequential
#: (``encoder.layer[:2]``, ``encoder.layer[-2:]``), or a glob over parameter names
#: (``encoder.layer.[01].*``).
_PATH = r"[A-Za-z0-9_]+(\.[A-Za-z0-9_]+)*"
_SLICE = _PATH + r"\[-?[0-9]*:-?[0-9]*\]"
_GLOB = r"[A-Za-z0-9_.*?\[\]!-]+"


def freeze_form(pattern: str) -> str:
    """"path", "slice" or "glob": which form a (valid) ``--freeze`` pattern has."""
    import re

    if re.fullmatch(_PATH, pattern):
        return "path"
    if re.fullmatch(_SLICE, pattern):
        return "slice"
    return "glob"


def normalize_freeze(value: str) -> str:
    import re

    text = str(value).strip()
    # a glob's character classes must close: fnmatch reads an unclosed ``[`` as a literal
    # character, so ``--freeze '['`` would silently freeze nothing
    classes_close = re.fullmatch(r"(?:[^\[\]]|\[!?[^\[\]]+\])*", text) is not None
    if not (re.fullmatch(_PATH, text) or re.fullmatch(_SLICE, text)
            or (re.fullmatch(_GLOB, text) and any(c in text for c in "*?[") and classes_close)):
        raise OptionError(
            f"invalid freeze pattern {value!r}; valid forms: a module path (embeddings, "
            "encoder.layer.0), a slice of a ModuleList (encoder.layer[:2]), or a glob over "
            "parameter names (encoder.layer.[01].*)")
    return text


def normalize_glob(value: str, what: str) -> str:
    """A glob of paths (``exclude``, an override's ``paths``), checked as fnmatch will read it:
    not empty, and every character class closed (fnmatch reads an unclosed ``[`` as a literal
    character, so ``exclude = ["[abc"]`` would silently leave out nothing)."""
    text = str(value)
    i, n = 0, len(text)
    while i < n:
        if text[i] == "[":
            j = i + 1
            if j < n and text[j] == "!":
                j += 1
            if j < n and text[j] == "]":
                j += 1
            while j < n and text[j] != "]":
                j += 1
            if j >= n:
                break
            i = j
        i += 1
    if not text.strip() or i < n:
        raise OptionError(f"invalid {what} glob {value!r}; valid values: globs of paths relative to the "
                          "configuration's folder, whose character classes close (vendor/*, "
                          "notebooks/scratch/*, data/[ab]*.py)")
    return text


def normalize_checkpointing(value: str) -> str:
    import re

    text = str(value).strip()
    if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z0-9_]+)*", text):
        raise OptionError(f"invalid checkpointing target {value!r}; valid values: a module class name "
                          "(Block), a module path (encoder.layers), or auto (a Hugging Face model)")
    return text


def normalize_num_nodes(value: Union[str, int]) -> int:
    try:
        count = int(str(value).strip())
    except ValueError:
        count = 0
    if count < 1:
        raise OptionError(f"invalid num-nodes {value!r}; valid values: a whole number >= 1")
    return count


@dataclasses.dataclass(frozen=True)
class Options:
    """What the user asked for. ``None`` means "not given": Fabric's default applies."""

    precision: Optional[str] = None
    devices: Optional[Devices] = None
    strategy: Optional[str] = None
    num_nodes: Optional[int] = None
    accelerator: Optional[str] = None
    matmul_precision: Optional[str] = None  # torch.set_float32_matmul_precision, for fp32 scripts
    backend: str = "fabric"
    clip_grad_norm: Optional[float] = None  # clip the gradients' norm before every optimizer step
    accumulate: Optional[int] = None  # micro-batches per optimizer step
    keep_effective_batch: bool = False  # divide the DataLoader's batch_size by ``accumulate``
    freeze: tuple[str, ...] = ()  # patterns of parameters not to train
    checkpointing: Optional[str] = None  # blocks whose activations are recomputed in the backward
    optimizer_8bit: bool = False  # Adam/AdamW become bitsandbytes' 8-bit optimizers
    paged_optimizer: bool = False  # with optimizer_8bit: their paged variants
    compile: bool = False  # torch.compile the model
    dynamic_padding: bool = False  # pad each batch to its longest sequence, not to max_length
    group_by_length: Optional[str] = None  # "eval": sort evaluation loaders by length; "all": also train
    shard_eval: bool = False  # several devices: shard evaluation loaders, all_reduce what the loop sums
    #: rules selected by their own code or name (not by "ALL" or a prefix): opt-in rules apply
    #: their edits only then (set by config.choose from the selection, not an option of its own)
    explicit: frozenset = frozenset()
    #: the script starts its own processes (hand-made DDP, codemod/ddp/hand.py): without
    #: ``--devices`` the conversion keeps the script's world size, so it runs on several devices
    #: (set per file by the engine, not an option of its own)
    script_world: bool = False

    @classmethod
    def create(
        cls,
        *,
        precision: Optional[str] = None,
        devices: Optional[Union[str, int]] = None,
        strategy: Optional[str] = None,
        num_nodes: Optional[Union[str, int]] = None,
        accelerator: Optional[str] = None,
        matmul_precision: Optional[str] = None,
        backend: Optional[str] = None,
        clip_grad_norm: Optional[Union[str, float]] = None,
        accumulate: Optional[Union[str, int]] = None,
        keep_effective_batch: bool = False,
        freeze: Optional[Union[str, tuple[str, ...], list[str]]] = None,
        checkpointing: Optional[str] = None,
        optimizer_8bit: bool = False,
        paged_optimizer: bool = False,
        compile: bool = False,
        explicit: tuple[str, ...] = (),
        dynamic_padding: bool = False,
        group_by_length: Optional[str] = None,
        shard_eval: bool = False,
    ) -> "Options":
        """Validate and normalise raw values (from the command line or a test)."""
        backend = "fabric" if backend is None else normalize_backend(backend)
        if backend == "torch":
            given = [name for name, value in (("devices", devices), ("strategy", strategy),
                                              ("num_nodes", num_nodes), ("accelerator", accelerator))
                     if value is not None]
            if given:
                flag = "--" + given[0].replace("_", "-")
                raise OptionError(f"{flag} needs --backend fabric: the torch backend keeps the "
                                  "script's own single process and device")
        if backend == "accelerate":
            _accelerate_options(precision, devices, strategy, accelerator)
        if keep_effective_batch and accumulate is None:
            raise OptionError("--keep-effective-batch needs --accumulate N: it divides the "
                              "DataLoader's batch_size by N")
        if paged_optimizer and not optimizer_8bit:
            raise OptionError("--paged-optimizer needs --optimizer-8bit: it picks bitsandbytes' "
                              "paged 8-bit optimizers")
        if group_by_length is not None and not dynamic_padding:
            raise OptionError("--group-by-length needs --dynamic-padding: batches of similar lengths "
                              "only save work when each is padded to its own longest sequence")
        if isinstance(freeze, str):
            freeze = (freeze,)
        return cls(
            shard_eval=bool(shard_eval),
            dynamic_padding=bool(dynamic_padding),
            group_by_length=None if group_by_length is None else _one_of("group-by-length", group_by_length,
                                                                         GROUP_BY_LENGTH),
            optimizer_8bit=bool(optimizer_8bit),
            paged_optimizer=bool(paged_optimizer),
            compile=bool(compile),
            explicit=frozenset(str(code).strip().upper() for code in explicit),
            backend=backend,
            accumulate=None if accumulate is None else normalize_accumulate(accumulate),
            keep_effective_batch=bool(keep_effective_batch),
            checkpointing=None if checkpointing is None else normalize_checkpointing(checkpointing),
            freeze=tuple(dict.fromkeys(normalize_freeze(p) for p in freeze or ())),
            clip_grad_norm=None if clip_grad_norm is None else normalize_clip_grad_norm(clip_grad_norm),
            precision=None if precision is None else normalize_precision(precision),
            devices=None if devices is None else normalize_devices(devices),
            strategy=None if strategy is None else normalize_strategy(strategy),
            num_nodes=None if num_nodes is None else normalize_num_nodes(num_nodes),
            accelerator=None if accelerator is None else normalize_accelerator(accelerator),
            matmul_precision=None if matmul_precision is None
            else normalize_matmul_precision(matmul_precision),
        )

    @property
    def effective_devices(self) -> Devices:
        """The devices written into ``Fabric(...)``: those asked for; without ``--devices``,
        one (as the original ran), unless a strategy or several nodes ask for more, where
        Fabric's "auto" (every device) stays."""
        if self.devices is not None:
            return self.devices
        if self.strategy in (None, "auto") and (self.num_nodes or 1) == 1:
            return 1
        return "auto"

    @property
    def many_devices(self) -> bool:
        """The converted script may run as several processes (each one sees a shard of the
        data): anything but exactly one device on one node."""
        if self.devices is None and self.script_world:
            return True
        return not (self.effective_devices == 1 and (self.num_nodes or 1) == 1)

    def fabric_kwargs(self) -> dict[str, object]:
        """The ``Fabric(...)`` keyword arguments that differ from Fabric's defaults, in order
        (``devices`` always: see ``effective_devices``)."""
        out: dict[str, object] = {}
        for name in ("accelerator", "strategy", "devices", "num_nodes", "precision"):
            value = self.effective_devices if name == "devices" else getattr(self, name)
            if value is not None and value != FABRIC_DEFAULTS[name]:
                out[name] = value
        return out

    @property
    def fabric(self) -> bool:
        """The Fabric conversion's plan runs: the Fabric backend (the default), or Accelerate's,
        which spells the same plan in Accelerate's API."""
        return self.backend in ("fabric", "accelerate")

    @property
    def accelerate(self) -> bool:
        """The plan is written for Hugging Face Accelerate (``--backend accelerate``)."""
        return self.backend == "accelerate"

    @property
    def single_device(self) -> bool:
        """True only when the user asked for exactly one device on one node."""
        return self.devices == 1 and (self.num_nodes or 1) == 1

    @property
    def mixed_or_low_precision(self) -> bool:
        return self.precision not in (None, "32-true", "64-true")
