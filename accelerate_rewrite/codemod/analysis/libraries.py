"""Well-known libraries, as data: what the analysis knows of packages that are not the
project's own code, even where a copy of one lies in the project's tree (a vendored
``apex/``, timm's own repository).

A package named here is never followed as a module of the project (codemod/project/program.py): its
code is read as the library it is, through what is known of its API, never as the script's
own training code.
"""

from __future__ import annotations

#: top-level packages of third-party libraries: never read as the project's own code
LIBRARIES = frozenset({
    "accelerate", "apex", "bitsandbytes", "datasets", "deepspeed", "detectron2", "einops",
    "fairscale", "fairseq", "huggingface_hub", "lightning", "lightning_fabric", "mmcv", "mmdet",
    "mmengine", "mmseg", "numpy", "opacus", "pandas", "peft", "pytorch_lightning", "safetensors", "scipy",
    "sklearn", "tensorboard", "tensorboardX", "timm", "tokenizers", "torch", "torchaudio",
    "torchmetrics", "torchtext", "torchvision", "tqdm", "transformers", "wandb", "xformers",
})


def is_library(dotted: str) -> bool:
    """Whether the module ``dotted`` (``timm.optim``, ``apex.amp``) belongs to a library of
    ``LIBRARIES``."""
    return dotted.split(".", 1)[0] in LIBRARIES


# ---- what their calls do to training, as data --------------------------------------------------
#
# Each entry names the API it describes as the analysis resolves it (the qualified name of the
# import: ``from timm.utils import NativeScaler`` -> ``timm.utils.NativeScaler``; every public
# spelling of one object is listed), and cites the release its source was read from. Adding a
# library is adding entries here, not a rule.


from dataclasses import dataclass  # noqa: E402
from typing import Optional  # noqa: E402


@dataclass(frozen=True)
class Argument:
    """Where a call receives something: its position (without ``self``), or its keyword."""

    index: int
    keyword: str


@dataclass(frozen=True)
class LossScaler:
    """A class whose objects, called, run the backward of ``loss`` themselves (through a
    GradScaler of their own, or apex's), optionally unscale and clip, and step ``optimizer``:
    the call is the training step (a backward site that is the library's)."""

    loss: Argument
    optimizer: Argument
    #: the keyword that makes the call stop before the step (gradient accumulation by hand)
    update: str
    #: the keyword that clips (unscaled first), and the one that gives the parameters
    clip: str
    source: str


@dataclass(frozen=True)
class OptimizerFactory:
    """A function that builds an optimizer over the parameters of the ``model`` it is given
    (a module, or its parameters)."""

    model: Argument
    source: str


@dataclass(frozen=True)
class SchedulerFactory:
    """A function that builds a learning-rate scheduler over ``optimizer``; ``per_step``: made
    to be stepped after every optimizer step (warm-up over steps), not every epoch."""

    optimizer: Argument
    per_step: bool
    source: str


_TIMM = "timm 1.0.29 (pytorch-image-models aa4b585), timm/utils/cuda.py"
_TIMM_SCALER = LossScaler(Argument(0, "loss"), Argument(1, "optimizer"), update="need_update", clip="clip_grad",
                          source=_TIMM + ": NativeScaler.__call__ runs self._scaler.scale(loss).backward(), "
                                         "unscale_ and dispatch_clip_grad when clip_grad, step, update")
_TIMM_APEX = LossScaler(Argument(0, "loss"), Argument(1, "optimizer"), update="need_update", clip="clip_grad",
                        source=_TIMM + ": ApexScaler.__call__ runs amp.scale_loss(...).backward(), "
                                       "clips amp.master_params, optimizer.step()")

#: qualified name -> what calling its objects does
LOSS_SCALERS: dict[str, LossScaler] = {
    "timm.utils.NativeScaler": _TIMM_SCALER,
    "timm.utils.cuda.NativeScaler": _TIMM_SCALER,
    "timm.utils.ApexScaler": _TIMM_APEX,
    "timm.utils.cuda.ApexScaler": _TIMM_APEX,
}

@dataclass(frozen=True)
class LibraryAutocast:
    """A function that returns ``torch.autocast`` for the device type it is given (or
    ``device_type``, its default): ``params``, its parameters in order, named as torch.autocast
    names them (``enabled``, ``device_type``, ``dtype``)."""

    params: tuple[str, ...]
    device_type: str
    source: str


_ULTRALYTICS = LibraryAutocast(("enabled", "device_type"), "cuda",
                               "ultralytics 8.3 (ultralytics/ultralytics), ultralytics/utils/torch_utils.py: "
                               "autocast(enabled, device=\"cuda\") returns torch.amp.autocast(device, enabled=enabled)")
#: qualified name -> the autocast it returns (YOLOv5 imports ultralytics' as smart_amp_autocast)
LIBRARY_AUTOCASTS: dict[str, LibraryAutocast] = {
    "ultralytics.utils.torch_utils.autocast": _ULTRALYTICS,
}
#: a library autocast's parameter -> torch.autocast's name for it
LIBRARY_AUTOCAST_KEYWORDS = {"device": "device_type"}

_TIMM_OPTIM = "timm 1.0.29 (pytorch-image-models aa4b585), timm/optim/_optim_factory.py"
#: qualified name -> where the model goes
OPTIMIZER_FACTORIES: dict[str, OptimizerFactory] = {
    **{f"timm.optim{path}.create_optimizer_v2": OptimizerFactory(
        Argument(0, "model_or_params"), _TIMM_OPTIM + ": create_optimizer_v2(model_or_params, opt, lr, ...)")
       for path in ("", "._optim_factory", ".optim_factory")},
    **{f"timm.optim{path}.create_optimizer": OptimizerFactory(
        Argument(1, "model"), _TIMM_OPTIM + ": create_optimizer(args, model, filter_bias_and_bn) calls "
                                            "create_optimizer_v2(model, **optimizer_kwargs(args))")
       for path in ("", "._optim_factory", ".optim_factory")},
}

@dataclass(frozen=True)
class ParamGroups:
    """A function that returns parameter groups (a list of dicts of ``params``) over the
    parameters of the ``model`` it is given: an optimizer built over its result trains it."""

    model: Argument
    source: str


_TIMM_GROUPS = "timm 1.0.29 (pytorch-image-models aa4b585), timm/optim/_param_groups.py"
#: qualified name -> where the model goes
PARAM_GROUPS: dict[str, ParamGroups] = {
    **{f"timm.optim{path}.{name}": ParamGroups(Argument(0, "model"), _TIMM_GROUPS + f": {name}(model, ...) "
                                                                     "-> [{'params': ...}, ...] over model.named_parameters()")
       for path in ("", "._param_groups", ".optim_factory")
       for name in ("param_groups_weight_decay", "param_groups_layer_decay")},
    # timm 0.3-0.6 named the first one add_weight_decay (MAE, BEiT and ConvNeXt call it so)
    "timm.optim.optim_factory.add_weight_decay": ParamGroups(
        Argument(0, "model"), "timm 0.4.12, timm/optim/optim_factory.py: add_weight_decay(model, weight_decay, "
                              "skip_list) -> [{'params': no_decay, ...}, {'params': decay, ...}]"),
}

@dataclass(frozen=True)
class ShardedLoaderFactory:
    """A function that builds a loader which shards the data by the process's rank itself when
    told the run is distributed (``distributed=``), with a sampler of its own (and may wrap it
    in a prefetcher that moves the batches, which is no DataLoader): its batches are each
    process's own, so the loader is not set up with Fabric."""

    distributed: Argument
    source: str


_TIMM_LOADER = ("timm 1.0.29 (pytorch-image-models aa4b585), timm/data/loader.py: create_loader(dataset, ..., "
                "distributed=False, ..., use_prefetcher=True, device=...) builds its own DistributedSampler "
                "(or RepeatAugSampler, OrderedDistributedSampler) when distributed, and a PrefetchLoader")
#: qualified name -> where it is told the run is distributed
SHARDED_LOADER_FACTORIES: dict[str, ShardedLoaderFactory] = {
    **{f"timm.data{path}.create_loader": ShardedLoaderFactory(Argument(-1, "distributed"), _TIMM_LOADER)
       for path in ("", ".loader")},
    **{f"timm.data{path}.create_naflex_loader": ShardedLoaderFactory(
        Argument(-1, "distributed"), "timm 1.0.29, timm/data/naflex_loader.py: create_naflex_loader(..., "
                                     "distributed=False, ...) shards with its own sampler when distributed")
       for path in ("", ".naflex_loader")},
}

@dataclass(frozen=True)
class ProcessStarter:
    """A library's function that starts the process group itself (a second start, after
    Fabric's, raises) and writes what it found into a namespace: under Fabric its call becomes
    those assignments, read from Fabric (``{fabric}`` stands for how `fabric` is spelled there)."""

    fills: Argument  # the namespace it writes into
    fields: tuple[tuple[str, str], ...]  # attribute -> its value under Fabric
    returns: Optional[str]  # what the call returns, under Fabric
    read_in: str


#: qualified name -> the library's function that starts the process group
PROCESS_GROUP_STARTERS: dict[str, ProcessStarter] = {
    **{f"timm.utils{path}.init_distributed_device": ProcessStarter(
        Argument(0, "args"),
        (("distributed", "{fabric}.world_size > 1"), ("world_size", "{fabric}.world_size"),
         ("rank", "{fabric}.global_rank"), ("local_rank", "{fabric}.local_rank"),
         ("device", "str({fabric}.device)")),
        "{fabric}.device",
        "timm 1.0.29, timm/utils/distributed.py: init_distributed_device(args) calls "
        "torch.distributed.init_process_group when the environment says several processes, sets "
        "args.distributed, world_size, rank, local_rank and args.device, and returns the device")
       for path in ("", ".distributed")},
}

@dataclass(frozen=True)
class TakesOver:
    """A library that takes the model, the optimizer and the loader over itself, in a way a
    conversion under it would break without a sound."""

    what: str  # what it does, and what a conversion under it would become (said in the refusal)
    read_in: str  # the release and the code it was read in


_OPACUS = TakesOver(
    "makes the model, optimizer and loader private itself (differential privacy: per-sample "
    "gradients, Poisson sampling, noise at each step); over Fabric's set-up each process would add "
    "its own noise to its own copy of the model, and the privacy accounting would be one process's",
    "opacus 1.5.4, opacus/privacy_engine.py: make_private(module, optimizer, data_loader, ...) wraps "
    "each for differential privacy (per-sample gradients, Poisson sampling, noise added at each step, "
    "the privacy accountant), and runs distributed only when handed a DistributedDataParallel module "
    "itself (`isinstance(module, (DPDDP, DDP, FSDPModule))`)")

#: qualified name -> what the library does
TAKES_OVER: dict[str, TakesOver] = {f"opacus{path}.PrivacyEngine": _OPACUS for path in ("", ".privacy_engine")}

_HF = "transformers 5.23.0, transformers/optimization.py"
#: qualified name -> the optimizer it schedules
SCHEDULER_FACTORIES: dict[str, SchedulerFactory] = {
    **{f"transformers{path}.{name}": SchedulerFactory(
        Argument(0, "optimizer"), True, _HF + f": {name}(optimizer, num_warmup_steps, ...) -> LambdaLR, "
                                              "stepped per optimizer step")
       for path in ("", ".optimization")
       for name in ("get_linear_schedule_with_warmup", "get_cosine_schedule_with_warmup",
                    "get_cosine_with_hard_restarts_schedule_with_warmup", "get_polynomial_decay_schedule_with_warmup",
                    "get_constant_schedule_with_warmup", "get_constant_schedule", "get_inverse_sqrt_schedule")},
    **{f"transformers{path}.get_scheduler": SchedulerFactory(
        Argument(1, "optimizer"), True, _HF + ": get_scheduler(name, optimizer, num_warmup_steps, ...)")
       for path in ("", ".optimization")},
}

#: calls that take a model wrapped in DistributedDataParallel as they take the module: they walk
#: its submodules, or wrap it whole (--backend accelerate on several processes passes the
#: prepared model as it is): qualified name -> (where the model goes, the release read)
WRAPPER_TAKERS: dict[str, tuple[Argument, str]] = {
    **{f"torch.nn{path}.SyncBatchNorm.convert_sync_batchnorm": (
        Argument(0, "module"), "torch 2.13, torch/nn/modules/batchnorm.py: convert_sync_batchnorm(module) replaces "
                               "each BatchNorm among the children, keeping its parameters and buffers, and returns "
                               "the module it was given when that is no BatchNorm")
       for path in ("", ".modules.batchnorm")},
    **{f"apex.parallel{path}.DistributedDataParallel": (
        Argument(0, "module"), "apex 0.1 (24.04), apex/parallel/distributed.py: DistributedDataParallel(module) "
                               "broadcasts the parameters and averages the gradients after backward: over "
                               "DistributedDataParallel's own averages it gives the same numbers, twice reduced "
                               "(the branch a script takes with its own --apex-amp flag, as under Fabric's wrapper)")
       for path in ("", ".distributed")},
    "torch.compile": (Argument(0, "model"), "torch 2.13, torch/__init__.py: compile(model) wraps the module it is "
                                            "given (DistributedDataParallel included: its compiled forward keeps "
                                            "DDP's reduction)"),
}

#: methods of a library's objects that take a model wrapped in DistributedDataParallel as they
#: take the module: the class's qualified name -> method -> (where the model goes, the release read)
METHOD_TAKERS: dict[str, dict[str, tuple[Argument, str]]] = {
    "torch.optim.swa_utils.AveragedModel": {
        "update_parameters": (Argument(0, "model"), "torch 2.13, torch/optim/swa_utils.py: "
                                                    "update_parameters(model) reads model.parameters() (and "
                                                    "buffers with use_buffers=True), the module's under DDP")},
}

#: what Accelerate's prepared optimizer answers itself (accelerate 1.15, accelerate/optimizer.py:
#: AcceleratedOptimizer's own methods and properties, and the attributes its ``__init__`` sets;
#: ``param_groups``, ``state`` and ``defaults`` read the optimizer's): any other attribute of a
#: prepared optimizer, a method of the optimizer's own class (SAM's ``first_step``) or a hook of
#: torch's Optimizer (which would hang on the wrapper, whose step is not the one that runs),
#: is read on its ``optimizer``, the optimizer itself
ACCELERATED_OPTIMIZER = frozenset({
    "state", "param_groups", "defaults", "add_param_group", "load_state_dict", "state_dict", "zero_grad",
    "train", "eval", "step", "step_was_skipped", "optimizer", "scaler", "accelerator_state", "gradient_state",
    "device_placement",
})

#: calls that copy the model they are given (a deepcopy): on several processes Fabric's wrapper
#: holds DistributedDataParallel, which can't be copied ("cannot pickle '_thread.lock' object",
#: measured with lightning 2.6 on 2 gloo processes), so the Fabric backend hands them the module
#: (``model.module``): qualified name -> where the model goes
COPIERS: dict[str, Argument] = {
    "copy.deepcopy": Argument(0, "x"), "copy.copy": Argument(0, "x"),
    "torch.optim.swa_utils.AveragedModel": Argument(0, "model"),
    **{f"timm.utils{path}.{name}": Argument(0, "model")
       for path in ("", ".model_ema") for name in ("ModelEma", "ModelEmaV2", "ModelEmaV3")},
}

_TORCH = "torch 2.13, torch/serialization.py; Python 3.11, copy.py"
#: calls that take a model only to read it (pickle it, copy it): given the module itself they
#: do what they did before a wrapper came around it (--backend accelerate on several
#: processes passes ``accelerator.unwrap_model(model)``): qualified name -> (where the model
#: goes, the release read)
MODEL_READERS: dict[str, tuple[Argument, str]] = {
    "torch.save": (Argument(0, "obj"), _TORCH + ": save(obj, f) pickles obj"),
    "torch.serialization.save": (Argument(0, "obj"), _TORCH + ": save(obj, f) pickles obj"),
    "copy.deepcopy": (Argument(0, "x"), _TORCH + ": deepcopy(x) copies x"),
    "copy.copy": (Argument(0, "x"), _TORCH + ": copy(x) copies x"),
    "torch.optim.swa_utils.AveragedModel": (
        Argument(0, "model"), "torch 2.13, torch/optim/swa_utils.py: AveragedModel(model, ...) deep-copies model "
                              "into its .module (update_parameters(model) reads only model.parameters(), "
                              "which DistributedDataParallel gives as the module's)"),
    **{f"torch.onnx{path}.export": (Argument(0, "model"), "torch 2.13, torch/onnx/__init__.py: export(model, args, "
                                                          "f, ...) traces the module's forward")
       for path in ("", ".utils")},
    **{f"timm.models{path}.{name}": (Argument(0, "model"), "timm 0.4.12 to 1.0.29, timm/models/helpers.py: "
                                                           f"{name}(model, checkpoint_path, ...) strips `module.` "
                                                           "from the checkpoint's keys and runs "
                                                           "model.load_state_dict")
       for path in ("", ".helpers", "._helpers") for name in ("resume_checkpoint", "load_checkpoint")},
    **{f"timm.utils{path}.{name}": (Argument(0, "model"), f"timm 0.4.12 to 1.0.29, timm/utils/model_ema.py: {name}("
                                                          "model, ...) keeps a deepcopy of the model")
       for path in ("", ".model_ema") for name in ("ModelEma", "ModelEmaV2", "ModelEmaV3")},
    **{f"timm.utils{path}.model_parameters": (Argument(0, "model"), "timm 0.4.12 to 1.0.29, timm/utils/model.py: "
                                                                   "model_parameters(model, exclude_head) lists "
                                                                   "model.parameters()")
       for path in ("", ".model")},
}


#: calls that write to the terminal themselves (a progress bar's); print is rules/fabric/printing.py's
TERMINAL_WRITES = frozenset({"sys.stdout.write", "sys.stderr.write"})

#: calls that prepare data on disk before training (fetch it, unpack it): every process then
#: reads what they wrote, so on several processes they run on rank 0 while the others wait
#: (rules/fabric/rank_zero.py); Python 3.11's urllib and shutil, torch 2.13's hub, torchvision
#: 0.28's datasets/utils.py, wget 3.2, gdown 5
PREPARERS = frozenset({
    "urllib.request.urlretrieve", "shutil.unpack_archive", "torch.hub.download_url_to_file",
    "torchvision.datasets.utils.download_url", "torchvision.datasets.utils.download_and_extract_archive",
    "torchvision.datasets.utils.extract_archive", "wget.download", "gdown.download",
})
#: methods that unpack an archive, whatever their receiver (tarfile's and zipfile's ``extractall``)
PREPARER_METHODS = frozenset({"extractall"})


def prepares(f, call) -> bool:
    """``call`` is a hand-written download or unpacking (``urlretrieve(url, path)``,
    ``tar.extractall(root)``); ``f``: the script's facts (its qualified names)."""
    import libcst as cst

    return bool(f.qualnames(call) & PREPARERS) or (
        isinstance(call.func, cst.Attribute) and call.func.attr.value in PREPARER_METHODS)
