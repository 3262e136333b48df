"""The fixtures: golden output, it parses, idempotent, places left alone are reported."""

from __future__ import annotations

import ast
import re

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES, OPTION_SETS, fixture_names, notes_text, run

CASES = [(name, option_set) for name in fixture_names() for option_set in OPTION_SETS]

#: fixtures the Fabric conversion leaves alone on purpose, and the reason it must give
LEFT_ALONE = {
    "already_fabric": "already uses Lightning Fabric",
    "hogwild": "shares the model between processes the script starts itself (Hogwild)",
    "layer_local_training": "`Layer` trains itself",
    "nothing_to_do": "no training found",
}
#: fixtures the native (--backend torch) mixed precision leaves alone, and the reason it gives
NATIVE_LEFT_ALONE = {
    "already_autocast": "runs its own autocast: nothing is wrapped twice",
    "already_fabric": "already uses Lightning Fabric",
    "conditional_optimizer": "is built only under `if args.use_optimizer:`",
    "cuda_amp": "runs its own autocast",
    "gan_bce": "CUDA refuses for BCELoss",
    "lbfgs": "can't step an LBFGS closure",
    "manual_sgd": "no `optimizer.step()` found for a GradScaler to step (the parameters are updated by hand",
    "nothing_to_do": "no training found",
    "scheduled_optim": "no `optimizer.step()` found for a GradScaler to step",
    "timm_scaler": "runs its own autocast: nothing is wrapped twice",
}


def test_there_are_enough_fixtures():
    assert len(fixture_names()) >= 12


@pytest.mark.parametrize("name,option_set", CASES)
def test_golden_output_parses_and_is_idempotent(name, option_set):
    """The golden output and notes; the output parses, drops no rule, and a second run changes
    nothing. (One test, so that the rewrite is made once per case whatever worker runs it.)"""
    result = run(name, option_set)
    expected = FIXTURES / name / "expected"
    assert result.output == (expected / f"{option_set}.py").read_text(encoding="utf-8")
    assert notes_text(result) == (expected / f"{option_set}.notes").read_text(encoding="utf-8")
    ast.parse(result.output)
    assert not result.dropped, result.dropped
    if result.changed:  # an unchanged input is its own second run
        again = rewrite(result.output, Options.create(**OPTION_SETS[option_set]))
        assert again.output == result.output


@pytest.mark.parametrize("name", sorted(LEFT_ALONE))
def test_left_alone_with_a_reason(name):
    result = run(name, "default")
    assert not result.changed
    reasons = [n.message for n in result.skips if n.rule == "AR101"]
    assert reasons and LEFT_ALONE[name] in reasons[0]


#: converted on one device, refused on several (the reason is in its golden notes): two backward
#: passes through one forward (retain_graph=True), which DDP can't reduce
ONE_DEVICE_ONLY = {"apex_o2_two_losses"}


@pytest.mark.parametrize("name", sorted(set(fixture_names()) - set(LEFT_ALONE)))
def test_converted_fixtures_use_fabric_everywhere(name):
    """Every backward and every set-up the script needs went through Fabric."""
    result = run(name, "default" if name in ONE_DEVICE_ONLY else "bf16-mixed-devices-4")
    assert result.changed
    backward_calls = [
        node for node in ast.walk(ast.parse(result.output))
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
        and node.func.attr == "backward" and ast.unparse(node.func.value) != "fabric"
        and not ast.unparse(node.func.value).endswith(".fabric")
    ]
    assert not backward_calls, [ast.unparse(c) for c in backward_calls]
    assert "fabric.launch()" in result.output or re.search(r"fabric\.launch\((demo_basic|main_worker),", result.output)
    assert "fabric.setup(" in result.output


@pytest.mark.parametrize("name", sorted(NATIVE_LEFT_ALONE))
def test_native_left_alone_with_a_reason(name):
    result = run(name, "torch-16-mixed")
    assert not any(n.rule in ("AR207", "AR208", "AR211") for n in result.changes)
    reasons = [n.message for n in result.skips if n.rule == "AR207"]
    assert reasons and NATIVE_LEFT_ALONE[name] in reasons[0]


@pytest.mark.parametrize("name", sorted(set(fixture_names()) - set(NATIVE_LEFT_ALONE)))
def test_native_16_mixed_scales_every_backward_and_step(name):
    """--backend torch --precision 16-mixed: every backward is scaler.scale(...).backward(), every
    optimizer step is scaler.step(...) followed in its block by scaler.update(), autocast is
    there, and neither Fabric nor apex is."""
    result = run(name, "torch-16-mixed")
    assert result.changed and not result.dropped
    tree = ast.parse(result.output)
    calls = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)]
    for call in calls:
        if call.func.attr == "backward":
            assert ast.unparse(call.func.value).startswith(("scaler.scale(", "self.scaler.scale(")), \
                ast.unparse(call)
        if call.func.attr == "step" and not ast.unparse(call.func.value).endswith("scaler"):
            assert "sched" in ast.unparse(call.func.value), ast.unparse(call)
    assert "torch.autocast(device_type=" in result.output
    assert "scaler.update()" in result.output
    assert "fabric" not in result.output.lower()
    names = {ast.unparse(n) for n in ast.walk(tree) if isinstance(n, (ast.Name, ast.Attribute))}
    assert not {n for n in names if n == "amp" or n.startswith(("amp.", "apex"))}
    # never a CUDA the machine may lack: the script's device, or CUDA only when the script has it
    assert result.output.split("GradScaler(", 1)[1].split(")", 1)[0].strip() != '"cuda"'
    assert 'device_type="cuda",' not in result.output


def _cited(snippet: str, window: str) -> bool:
    """``snippet`` (``...`` where the note shortened it) in ``window``, whitespace aside."""
    parts = [re.escape(re.sub(r"\s+", "", part)) for part in snippet.split("...")]
    return re.search(".*".join(parts), window) is not None


def test_every_note_that_leaves_a_place_alone_cites_the_code_at_its_line():
    """A note is true to the code it names: the first code a "left alone" note quotes (other
    than Fabric's own API, which the rewrite writes) stands at the line it cites, in every
    golden of every fixture (a statement may span the next lines)."""
    checked = 0
    for notes in sorted(FIXTURES.glob("*/expected/*.notes")):
        source = (notes.parent.parent / "input.py").read_text(encoding="utf-8").splitlines()
        for line in notes.read_text(encoding="utf-8").splitlines():
            found = re.match(r"(\d+): (AR\d+) left alone: (.*)", line)
            if not found:
                continue
            quoted = [s for s in re.findall(r"`([^`]+)`", found[3])
                      if not re.match(r"(self\.)?(fabric|accelerator)\b|Fabric\(|Accelerator\(", s)]
            if not quoted:
                continue
            checked += 1
            at = int(found[1])
            window = re.sub(r"\s+", "", "".join(source[at - 1:at + 12]))
            assert _cited(quoted[0], window), f"{notes}: {line}"
    assert checked > 500
