"""The rules, in the order they run. Each module holds one rule; its docstring is its doc."""

from __future__ import annotations

from accelerate_rewrite.codemod.rule import Rule
from accelerate_rewrite.rules.techniques.accumulate import Accumulate
from accelerate_rewrite.rules.precision.amp_api import AmpApiMigration
from accelerate_rewrite.rules.techniques.checkpointing import ActivationCheckpointing
from accelerate_rewrite.rules.precision.apex_amp import ApexAmpMigration
from accelerate_rewrite.rules.techniques.clip_grad_norm import ClipGradNorm
from accelerate_rewrite.rules.techniques.compile import Compile
from accelerate_rewrite.rules.data.dataloader_hints import DataLoaderHints
from accelerate_rewrite.rules.data.dynamic_padding import DynamicPadding
from accelerate_rewrite.rules.precision.amp_bce_loss import AmpBceLoss
from accelerate_rewrite.rules.precision.amp_scaler_once import ScalerOnce
from accelerate_rewrite.rules.precision.amp_unscale_before_clip import UnscaleBeforeClip
from accelerate_rewrite.rules.fabric.backward import FabricBackward
from accelerate_rewrite.rules.fabric.checkpoint import FabricCheckpoint
from accelerate_rewrite.rules.fabric.clip_gradients import FabricClipGradients
from accelerate_rewrite.rules.fabric.data_parallel import FabricDataParallel
from accelerate_rewrite.rules.fabric.ddp import FabricHandDDP
from accelerate_rewrite.rules.fabric.dataloaders import FabricDataloaders
from accelerate_rewrite.rules.fabric.device import FabricDevice
from accelerate_rewrite.rules.fabric.launch import FabricLaunch
from accelerate_rewrite.rules.fabric.printing import FabricPrint
from accelerate_rewrite.rules.fabric.rank_zero import FabricRankZero
from accelerate_rewrite.rules.fabric.setup import FabricSetup
from accelerate_rewrite.rules.techniques.freeze import Freeze
from accelerate_rewrite.rules.data.group_by_length import GroupByLength
from accelerate_rewrite.rules.data.fast_tokenizer import FastTokenizer
from accelerate_rewrite.rules.precision.float32_matmul_precision import Float32MatmulPrecision
from accelerate_rewrite.rules.precision.half_adam_eps import HalfAdamEps
from accelerate_rewrite.rules.precision.half_batchnorm import HalfBatchNorm
from accelerate_rewrite.rules.precision.half_to_mixed import HalfToMixed
from accelerate_rewrite.rules.native.autocast import NativeAutocast
from accelerate_rewrite.rules.native.grad_scaler import NativeGradScaler
from accelerate_rewrite.rules.native.half_weights import NativeHalfWeights
from accelerate_rewrite.rules.techniques.optimizer_8bit import Optimizer8bit
from accelerate_rewrite.rules.precision.own_precision import OwnPrecision

ALL_RULES: tuple[Rule, ...] = (
    FabricLaunch(),
    FabricDataParallel(),
    FabricSetup(),
    FabricDataloaders(),
    FabricDevice(),
    FabricBackward(),
    FabricClipGradients(),
    FabricPrint(),
    FabricCheckpoint(),
    FabricRankZero(),
    FabricHandDDP(),
    AmpApiMigration(),
    UnscaleBeforeClip(),
    ScalerOnce(),
    Float32MatmulPrecision(),
    AmpBceLoss(),
    HalfAdamEps(),
    NativeAutocast(),
    NativeGradScaler(),
    HalfToMixed(),
    NativeHalfWeights(),
    ApexAmpMigration(),
    HalfBatchNorm(),
    OwnPrecision(),
    ClipGradNorm(),
    Accumulate(),
    Freeze(),
    ActivationCheckpointing(),
    Optimizer8bit(),
    Compile(),
    DataLoaderHints(),
    FastTokenizer(),
    DynamicPadding(),
    GroupByLength(),
)
BY_CODE = {rule.code: rule for rule in ALL_RULES}


def find(code_or_name: str) -> Rule | None:
    key = code_or_name.strip()
    for rule in ALL_RULES:
        if key.upper() == rule.code or key.lower() == rule.name:
            return rule
    return None
