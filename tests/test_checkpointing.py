"""AR401 --checkpointing TARGET: the option, where the checkpointing goes, Hugging Face models,
what it refuses; the training runs (identical losses) are in test_verify.py."""

from __future__ import annotations

import ast
import subprocess
import sys
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options
from accelerate_rewrite.rules.techniques.checkpointing import HELPER_CODE
from tests.goldens import FIXTURES, run

LOOP = """\
optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
for x in [torch.randint(0, 10, (2, 8))]:
    optimizer.zero_grad()
    model(x).logits.sum().backward()
    optimizer.step()
"""


def _rewrite(head: str, **options):
    options = {"backend": "torch", "checkpointing": "Block", **options}
    result = rewrite(textwrap.dedent(head) + LOOP, Options.create(**options))
    ast.parse(result.output)
    assert rewrite(result.output, Options.create(**options)).output == result.output, "not idempotent"
    return result


def _notes(result, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == "AR401" and n.skipped == skipped)


@pytest.mark.parametrize("value", ["", "a b", "encoder/layers", "1x"])
def test_a_bad_target_is_an_option_error(value):
    with pytest.raises(OptionError, match="invalid checkpointing target"):
        Options.create(checkpointing=value)


def test_blocks_are_checkpointed_right_after_the_model_is_built():
    out = run("finetune_encoder", "checkpointing-Block").output
    assert out.count("def checkpoint_activations(model, target):") == 1
    assert "    model = Classifier()\n    checkpoint_activations(model, \"Block\")\n" in out
    assert out.index('checkpoint_activations(model, "Block")') < out.index("fabric.setup(model, optimizer)")
    ast.parse(HELPER_CODE)


def test_a_hugging_face_model_uses_its_own_gradient_checkpointing():
    result = _rewrite("""\
        import torch
        from transformers import AutoModelForSequenceClassification

        model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased")
        """, checkpointing="auto")
    assert ('model = AutoModelForSequenceClassification.from_pretrained("bert-base-uncased")\n'
            'model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})\n'
            "model.config.use_cache = False\n") in result.output
    assert "def checkpoint_activations" not in result.output


def test_what_it_leaves_alone():
    plain = _rewrite("import torch\n\nmodel = torch.nn.Linear(4, 1)\n", checkpointing="auto")
    assert not plain.changed and "is not a Hugging Face model" in _notes(plain, True)
    already = _rewrite("""\
        import torch
        import torch.utils.checkpoint

        model = torch.nn.Linear(4, 1)
        y = torch.utils.checkpoint.checkpoint(model, torch.randn(2, 4), use_reentrant=False)
        """)
    assert not already.changed and "already checkpoints activations" in _notes(already, True)
    fsdp = rewrite((FIXTURES / "module_loop" / "input.py").read_text(),
                   Options.create(checkpointing="Block", strategy="fsdp"))
    assert "activation_checkpointing_policy" in _notes(fsdp, True)
    assert "already uses Lightning Fabric" in _notes(run("already_fabric", "checkpointing-Block"), True)


@pytest.mark.runs
def test_a_target_that_names_nothing_fails_naming_the_module_classes(tmp_path):
    pytest.importorskip("torch")
    source = (FIXTURES / "finetune_encoder" / "input.py").read_text()
    script = tmp_path / "ckpt.py"
    script.write_text(rewrite(source, Options.create(backend="torch", checkpointing="Blok")).output)
    done = subprocess.run([sys.executable, str(script), "--epochs", "1"], capture_output=True, text=True,
                          timeout=300, cwd=tmp_path, env={"CUDA_VISIBLE_DEVICES": "", "PATH": ""})
    assert done.returncode != 0
    assert "ValueError: --checkpointing 'Blok' names no module of Classifier; its module classes include: " \
           "Block, Classifier" in done.stderr
