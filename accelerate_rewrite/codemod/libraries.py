"""Well-known libraries, as data: what the analysis knows of packages that are not the
project's own code, even where a copy of one lies in the project's tree (a vendored
``apex/``, timm's own repository).

A package named here is never followed as a module of the project (codemod/project.py): its
code is read as the library it is, through what is known of its API, never as the script's
own training code.
"""

from __future__ import annotations

#: top-level packages of third-party libraries: never read as the project's own code
LIBRARIES = frozenset({
    "accelerate", "apex", "bitsandbytes", "datasets", "deepspeed", "detectron2", "einops",
    "fairscale", "fairseq", "huggingface_hub", "lightning", "lightning_fabric", "mmcv", "mmdet",
    "mmengine", "mmseg", "numpy", "pandas", "peft", "pytorch_lightning", "safetensors", "scipy",
    "sklearn", "tensorboard", "tensorboardX", "timm", "tokenizers", "torch", "torchaudio",
    "torchmetrics", "torchtext", "torchvision", "tqdm", "transformers", "wandb", "xformers",
})


def is_library(dotted: str) -> bool:
    """Whether the module ``dotted`` (``timm.optim``, ``apex.amp``) belongs to a library of
    ``LIBRARIES``."""
    return dotted.split(".", 1)[0] in LIBRARIES
