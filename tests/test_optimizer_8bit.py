"""AR402 --optimizer-8bit: which optimizers change and how, what is left alone, and a real run
with bitsandbytes on the CPU (8-bit state for the big tensors, 32-bit for the embedding); the
verifier's run of transformer_lm is in test_verify.py."""

from __future__ import annotations

import ast
import runpy
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import OptionError, Options
from accelerate_rewrite.rules import BY_CODE
from tests.goldens import FIXTURES


def _rewrite(source: str, **options):
    options = {"backend": "torch", "optimizer_8bit": True, **options}
    result = rewrite(textwrap.dedent(source), Options.create(**options))
    ast.parse(result.output)
    assert rewrite(result.output, Options.create(**options)).output == result.output, "not idempotent"
    return result


def _notes(result, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == "AR402" and n.skipped == skipped)


HEAD = """\
import torch

model = torch.nn.Linear(4, 1)
"""


def test_paged_needs_8bit():
    with pytest.raises(OptionError, match="--paged-optimizer needs --optimizer-8bit"):
        Options.create(paged_optimizer=True)


def test_adam_and_adamw_keep_their_arguments():
    result = _rewrite(HEAD + """\
        a = torch.optim.Adam(model.parameters(), 1e-3, (0.9, 0.98), weight_decay=0.0, amsgrad=False)
        b = torch.optim.AdamW(
            model.parameters(),
            lr=3e-4,
            foreach=True,
        )
        """.replace("        ", ""))
    out = result.output
    assert "a = bnb.optim.Adam8bit(model.parameters(), 1e-3, (0.9, 0.98), weight_decay=0.0)\n" in out
    assert "b = bnb.optim.AdamW8bit(\n    model.parameters(),\n    lr=3e-4,\n)\n" in out
    assert out.startswith("import torch\n\ntry:\n    import bitsandbytes as bnb\nexcept ImportError as error:")
    assert "pip install bitsandbytes" in out
    assert "register_module_override" not in out  # a torch.nn.Linear holds no embedding
    assert "`amsgrad=` dropped" in _notes(result, False) and "`foreach=` dropped" in _notes(result, False)
    paged = _rewrite(HEAD + "opt = torch.optim.AdamW(model.parameters())\n", paged_optimizer=True)
    assert "opt = bnb.optim.PagedAdamW8bit(model.parameters())\n" in paged.output


def test_what_it_leaves_alone():
    result = _rewrite(HEAD + textwrap.dedent("""\
        sgd = torch.optim.SGD(model.parameters(), lr=0.1)
        ams = torch.optim.Adam(model.parameters(), 1e-3, (0.9, 0.99), 1e-8, 0, True)
        mx = torch.optim.AdamW(model.parameters(), maximize=True)
        kw = torch.optim.AdamW(**settings)
        """))
    assert not result.changed
    notes = _notes(result, True)
    assert "SGD left as it is (Adam and AdamW only)" in notes
    assert "Adam with amsgrad" in notes and "AdamW with maximize" in notes and "*args/**kwargs" in notes
    already = _rewrite("import bitsandbytes as bnb\n" + HEAD + "opt = bnb.optim.AdamW8bit(model.parameters())\n")
    assert not already.changed and "already uses bitsandbytes" in _notes(already, True)
    fsdp = rewrite((FIXTURES / "transformer_lm" / "input.py").read_text(),
                   Options.create(optimizer_8bit=True, strategy="fsdp"))
    assert "shards the optimizer state itself" in _notes(fsdp, True) and "bnb." not in fsdp.output


def test_embeddings_are_registered_once_before_the_optimizer():
    result = _rewrite("""\
        import torch
        from transformers import AutoModel

        model = AutoModel.from_pretrained("x")
        decay = torch.optim.AdamW(model.parameters(), lr=1e-4)
        other = torch.optim.AdamW(model.parameters(), lr=1e-4)
        """)
    out = result.output
    assert out.count("register_module_override(") == 1
    assert out.index("for module in model.modules():") < out.index("decay = bnb.optim.AdamW8bit(")


@pytest.mark.runs
def test_the_rewritten_example_keeps_8bit_state_and_32bit_embeddings(tmp_path):
    """bitsandbytes on the CPU, the paged form: the head's state is uint8, the embedding's float32."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("bitsandbytes")
    example = BY_CODE["AR402"].examples[0]
    script = tmp_path / "lm.py"
    options = Options.create(backend="torch", optimizer_8bit=True, paged_optimizer=True)
    script.write_text(rewrite(example.before, options).output)
    done = runpy.run_path(str(script), run_name="__main__")
    model, optimizer = done["model"], done["optimizer"]
    assert type(optimizer).__name__ == "PagedAdamW8bit"  # on a CPU it pages nothing
    assert optimizer.state[model.head.weight]["state1"].dtype == torch.uint8
    assert optimizer.state[model.embed.weight]["state1"].dtype == torch.float32
