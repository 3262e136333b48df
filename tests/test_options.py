"""Options mirror Fabric's accepted values without importing it."""

from __future__ import annotations

import typing

import pytest

from accelerate_rewrite.options import (
    ACCELERATORS,
    PRECISION_ALIASES,
    PRECISIONS,
    STRATEGIES,
    OptionError,
    Options,
)


def test_precision_aliases_normalise():
    assert Options.create(precision="bf16").precision == "bf16-mixed"
    assert Options.create(precision="16").precision == "16-mixed"
    assert Options.create(precision="32").precision == "32-true"


@pytest.mark.parametrize(
    "field,value,listed",
    [
        ("precision", "fp8", "bf16-mixed"),
        ("strategy", "horovod", "fsdp"),
        ("devices", "zero", "auto"),
        ("devices", "0", "auto"),
        ("num_nodes", "0", ">= 1"),
        ("accelerator", "npu", "cuda"),
        ("matmul_precision", "low", "high"),
    ],
)
def test_wrong_values_get_one_line_listing_the_valid_ones(field, value, listed):
    with pytest.raises(OptionError) as info:
        Options.create(**{field: value})
    message = str(info.value)
    assert "\n" not in message and value in message and listed in message


def test_fabric_kwargs_leave_defaults_out():
    options = Options.create(precision="32-true", devices="auto", strategy="auto", num_nodes=1)
    assert options.fabric_kwargs() == {}
    options = Options.create(precision="bf16-mixed", devices="4", strategy="fsdp")
    assert options.fabric_kwargs() == {"strategy": "fsdp", "devices": 4, "precision": "bf16-mixed"}
    assert Options.create(devices="0,1").fabric_kwargs() == {"devices": "0,1"}


def test_values_match_lightning():
    pytest.importorskip("lightning")
    from lightning.fabric.accelerators import ACCELERATOR_REGISTRY
    from lightning.fabric.plugins.precision.precision import _PRECISION_INPUT
    from lightning.fabric.strategies import STRATEGY_REGISTRY

    literal_sets = [set(typing.get_args(arg)) for arg in typing.get_args(_PRECISION_INPUT)]
    strings = {v for values in literal_sets for v in values if isinstance(v, str)}
    assert strings == set(PRECISIONS) | set(PRECISION_ALIASES)
    assert set(STRATEGY_REGISTRY.available_strategies()) | {"auto"} == set(STRATEGIES)
    assert set(ACCELERATOR_REGISTRY.available_accelerators()) | {"auto", "gpu"} == set(ACCELERATORS)
