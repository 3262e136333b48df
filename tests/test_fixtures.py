"""The fixtures: golden output, it parses, idempotent, places left alone are reported."""

from __future__ import annotations

import ast

import pytest

from accelerate_rewrite.codemod.engine import rewrite
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES, OPTION_SETS, fixture_names, notes_text, run

CASES = [(name, option_set) for name in fixture_names() for option_set in OPTION_SETS]

#: fixtures the Fabric conversion leaves alone on purpose, and the reason it must give
LEFT_ALONE = {
    "already_fabric": "already uses Lightning Fabric",
    "hand_ddp": "hand-made distributed training",
    "nothing_to_do": "no training found",
}


def test_there_are_enough_fixtures():
    assert len(fixture_names()) >= 12


@pytest.mark.parametrize("name,option_set", CASES)
def test_golden_output(name, option_set):
    result = run(name, option_set)
    expected = FIXTURES / name / "expected"
    assert result.output == (expected / f"{option_set}.py").read_text(encoding="utf-8")
    assert notes_text(result) == (expected / f"{option_set}.notes").read_text(encoding="utf-8")


@pytest.mark.parametrize("name,option_set", CASES)
def test_output_parses_and_is_idempotent(name, option_set):
    result = run(name, option_set)
    ast.parse(result.output)
    assert not result.dropped, result.dropped
    again = rewrite(result.output, Options.create(**OPTION_SETS[option_set]))
    assert again.output == result.output


@pytest.mark.parametrize("name", sorted(LEFT_ALONE))
def test_left_alone_with_a_reason(name):
    result = run(name, "default")
    assert not result.changed
    reasons = [n.message for n in result.skips if n.rule == "AR101"]
    assert reasons and LEFT_ALONE[name] in reasons[0]


@pytest.mark.parametrize("name", sorted(set(fixture_names()) - set(LEFT_ALONE)))
def test_converted_fixtures_use_fabric_everywhere(name):
    """Every backward and every set-up the script needs went through Fabric."""
    result = run(name, "bf16-mixed-devices-4")
    assert result.changed
    backward_calls = [
        node for node in ast.walk(ast.parse(result.output))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward" and ast.unparse(node.func.value) != "fabric"
        and not ast.unparse(node.func.value).endswith(".fabric")
    ]
    assert not backward_calls, [ast.unparse(c) for c in backward_calls]
    assert "fabric.launch()" in result.output
    assert "fabric.setup(" in result.output
