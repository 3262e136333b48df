"""Issue 47: ``--backend accelerate`` writes the Fabric plan in Hugging Face Accelerate's API
(rules/_accelerate.py). One process so far: several are refused with the reason.

The goldens of every fixture (option set ``accelerate-bf16-mixed``) are checked by
tests/test_fixtures.py; here, what they must hold, and runs both ways.
"""

from __future__ import annotations

import ast

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options
from tests.goldens import FIXTURES, fixture_names, run

ACCELERATE = "accelerate-bf16-mixed"


def _names(code: str) -> set[str]:
    tree = ast.parse(code)
    return {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)} | {
        n.arg for n in ast.walk(tree) if isinstance(n, ast.arg)} | {
        n.attr for n in ast.walk(tree) if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name) and n.value.id == "self"}


@pytest.mark.parametrize("flags, said", [
    ({"precision": "16-true"}, "--precision 16-true has no Accelerate equivalent"),
    ({"precision": "bf16-true"}, "--precision bf16-true has no Accelerate equivalent"),
    ({"devices": 4}, "--backend accelerate writes one process so far"),
    ({"num_nodes": 2}, "--backend accelerate writes one process so far"),
    ({"strategy": "fsdp"}, "--strategy fsdp: --backend accelerate does not write Accelerate's FSDP"),
    ({"accumulate": 4}, "--accumulate: --backend accelerate does not write `accelerator.accumulate(model)` yet"),
])
def test_what_accelerate_does_not_take_yet_is_refused_with_the_reason(flags, said):
    with pytest.raises(OptionError, match=said.replace("(", r"\(").replace(")", r"\)")):
        Options.create(backend="accelerate", **flags)


def test_every_fixture_fabric_converts_on_one_process_accelerate_converts_or_says_why():
    """The same plan: where the Fabric backend converts a fixture, the Accelerate backend does,
    or refuses with a reason of its own (the hand-made DDP fixtures run several processes)."""
    converted = 0
    for name in fixture_names():
        fabric, accelerate = run(name, "default"), run(name, ACCELERATE)
        assert not accelerate.dropped, (name, accelerate.dropped)
        if "Fabric(" not in fabric.output or "Fabric(" in fabric.source:
            assert "Accelerator(" not in accelerate.output, name
            continue
        if "Accelerator(" in accelerate.output:
            converted += 1
            continue
        assert any("--backend accelerate writes one process so far" in n.message for n in accelerate.skips), name
    assert converted >= 30


def test_an_accelerate_output_has_no_fabric_left_and_is_accelerate_s_api():
    for name in fixture_names():
        result = run(name, ACCELERATE)
        if "Accelerator(" not in result.output:
            continue
        names = _names(result.output)
        assert "fabric" not in names and "Fabric" not in names, name
        assert "lightning" not in result.output.replace(result.source, ""), name
        assert "from accelerate import Accelerator\n" in result.output, name
        assert 'accelerator = Accelerator(mixed_precision="bf16")' in result.output \
            or "accelerator = Accelerator()" in result.output, name
        assert not any("fabric" in n.message for n in result.changes), (name, [n.message for n in result.changes])


def test_the_seed_s_script_in_accelerate_s_api():
    """cvpr2023 01's shape (fixtures/vit_finetune): `train(..., accelerator)`, the loaders and the
    model with its optimizer prepared where Fabric sets them up, backward and print Accelerate's,
    no launch (one process: ``python train.py`` or ``accelerate launch``)."""
    out = run("vit_finetune", ACCELERATE).output
    assert "def train(num_epochs, model, optimizer, train_loader, val_loader, accelerator):" in out
    assert "    train_loader = accelerator.prepare(train_loader)\n" in out
    assert "    val_loader, test_loader = accelerator.prepare(val_loader, test_loader)\n" in out
    assert "    model, optimizer = accelerator.prepare(model, optimizer)\n" in out
    assert "            accelerator.backward(loss)\n" in out
    assert "launch" not in out and "accelerator=accelerator" in out


def test_clipping_and_the_rank_checks_are_spelled_as_accelerate_s():
    source = """
import torch
import torch.nn as nn

model = nn.Linear(4, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 4), torch.randn(8, 1)))
for x, y in loader:
    loss = nn.functional.mse_loss(model(x), y)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
torch.save(model.state_dict(), "model.pt")
"""
    result = rewrite(source, Options.create(backend="accelerate", clip_grad_norm=1.0, accelerator="cpu"))
    out = result.output
    assert "accelerator = Accelerator(cpu=True)\n" in out
    assert "    accelerator.clip_grad_norm_(model.parameters(), 1.0)\n" in out
    assert 'torch.save(model.state_dict(), "model.pt")' in out
    assert any("kept: with one process Accelerate's `prepare` returns the model itself" in n.message
               for n in result.skips)


def test_a_script_with_its_own_accelerator_name_is_left_as_it_was():
    source = (FIXTURES / "train_function" / "input.py").read_text(encoding="utf-8")
    source = source.replace("import torch\n", "import torch\naccelerator = 'cpu'\n", 1)
    result = rewrite(source, Options.create(backend="accelerate"))
    assert "Accelerator(" not in result.output
    assert any("a name `accelerator` of its own" in d for d in result.dropped)


def test_a_second_run_changes_nothing():
    for name in ("vit_finetune", "trainer_class", "gan"):
        first = run(name, ACCELERATE)
        again = rewrite(first.output, Options.create(backend="accelerate", precision="bf16-mixed"))
        assert again.output == first.output, name


# ---- run both ways ------------------------------------------------------------------------------

RUN = dict(steps=8, threads=1, run_on="cpu")


@pytest.fixture
def fixture_copy(tmp_path, monkeypatch):
    import shutil

    def copy(name: str):
        shutil.copy(FIXTURES / name / "input.py", tmp_path / "input.py")
        monkeypatch.chdir(tmp_path)
        return tmp_path / "input.py"

    return copy


@pytest.mark.runs
@pytest.mark.parametrize("name", ["gan", "train_function", pytest.param("trainer_class", marks=pytest.mark.slow),
                                  pytest.param("checkpointing", marks=pytest.mark.slow)])
def test_an_accelerate_rewrite_at_32_true_prints_the_original_s_numbers(name, fixture_copy):
    """``verify --backend accelerate`` at 32-true ("no" mixed precision): the losses and
    gradient norms of every step identical to the original's."""
    pytest.importorskip("accelerate")
    from accelerate_rewrite.verify.session import verify

    v = verify(fixture_copy(name), Options.create(backend="accelerate", precision="32-true"), **RUN)
    assert v.verdict.verdict == "pass", v.verdict.reason
    assert v.rewritten.losses == v.original.losses and len(v.original.losses) > 0


@pytest.mark.runs
def test_an_accelerate_rewrite_at_bf16_passes_and_a_planted_bug_fails(fixture_copy):
    """bf16 ("bf16" mixed precision) judged as Fabric's is: PASS; the same rewrite with the
    learning rate changed: FAIL."""
    pytest.importorskip("accelerate")
    from accelerate_rewrite.verify.session import verify

    path = fixture_copy("gan")
    options = Options.create(backend="accelerate", precision="bf16-mixed")
    v = verify(path, options, **RUN)
    assert v.verdict.verdict == "pass", v.verdict.reason
    good = run("gan", ACCELERATE).output
    assert "lr=2e-3" in good
    buggy = path.parent / "buggy.py"
    buggy.write_text(good.replace("lr=2e-3", "lr=2.2e-3", 1), encoding="utf-8")
    bad = verify(path, options, against=buggy, **RUN)
    assert bad.verdict.verdict == "fail", bad.verdict.reason


def test_verify_on_several_processes_is_refused_before_anything_runs(tmp_path):
    from accelerate_rewrite.verify.session import VerifyError, verify

    script = tmp_path / "train.py"
    script.write_text((FIXTURES / "gan" / "input.py").read_text(encoding="utf-8"), encoding="utf-8")
    with pytest.raises(VerifyError, match="--backend accelerate writes one process so far"):
        verify(script, Options.create(backend="accelerate"), run_devices=2)
