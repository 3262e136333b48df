"""AR403 --compile: where the compile goes (before fabric.setup; in place after the model's last
move or wrap without Fabric), what is left alone, and real compiled runs on the CPU whose
checkpoints keep their keys; the verifier's run is in test_verify.py."""

from __future__ import annotations

import ast
import runpy
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules import BY_CODE
from tests.goldens import FIXTURES, run


def _rewrite(source: str, **options):
    options = {"backend": "torch", "compile": True, **options}
    result = rewrite(textwrap.dedent(source), Options.create(**options))
    ast.parse(result.output)
    assert rewrite(result.output, Options.create(**options)).output == result.output, "not idempotent"
    return result


def _notes(result, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == "AR403" and n.skipped == skipped)


def test_with_fabric_it_compiles_before_setup_and_after_freezing():
    out = run("finetune_encoder", "8bit-compile-padding").output
    assert out.index("model = torch.compile(model)") < out.index("fabric.setup(model, optimizer)")
    frozen = rewrite((FIXTURES / "finetune_encoder" / "input.py").read_text(),
                     Options.create(compile=True, freeze=("embeddings",), checkpointing="Block")).output
    assert frozen.index('freeze_parameters(model, ["embeddings"])') < frozen.index("torch.compile(model)")
    assert frozen.index('checkpoint_activations(model, "Block")') < frozen.index("torch.compile(model)")


def test_without_fabric_it_compiles_in_place_after_the_last_move_or_wrap():
    result = _rewrite("""\
        import torch
        from torch.nn.parallel import DistributedDataParallel as DDP
        from mylib import Net

        model = Net()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model = model.to("cuda")
        model = DDP(model)
        print("ready")
        for step in range(3):
            model(torch.randn(2, 4)).sum().backward()
            optimizer.step()
        model = Other(model)
        """)
    assert "model = DDP(model)\nmodel.compile()\nprint(\"ready\")\n" in result.output
    assert result.output.count(".compile()") == 1


def test_what_it_leaves_alone():
    seq = rewrite((FIXTURES / "module_loop" / "input.py").read_text(), Options.create(backend="torch", compile=True))
    assert not seq.changed and "is a `torch.nn.Sequential`" in _notes(seq, True)
    pickled = _rewrite("""\
        import torch
        from mylib import Net

        net = Net()
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        net(torch.randn(2, 4)).sum().backward()
        opt.step()
        torch.save(net, "net.pt")
        """)
    assert not pickled.changed and "passed whole to torch.save" in _notes(pickled, True)
    already = _rewrite("""\
        import torch
        from mylib import Net

        net = torch.compile(Net())
        opt = torch.optim.SGD(net.parameters(), lr=0.1)
        """)
    assert not already.changed and "already compiles" in _notes(already, True)
    fsdp = rewrite((FIXTURES / "transformer_lm" / "input.py").read_text(), Options.create(compile=True, strategy="fsdp"))
    assert "compile by hand" in _notes(fsdp, True) and "torch.compile" not in fsdp.output


@pytest.mark.runs
@pytest.mark.parametrize("backend", ["torch", "fabric"])
def test_the_rewritten_example_compiles_and_keeps_its_checkpoint_keys(backend, tmp_path, monkeypatch):
    torch = pytest.importorskip("torch")
    if backend == "fabric":
        pytest.importorskip("lightning")
    example = BY_CODE["AR403"].examples[0]
    script = tmp_path / "net.py"
    script.write_text(rewrite(example.before, Options.create(backend=backend, compile=True)).output)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    runpy.run_path(str(script), run_name="__main__")
    assert torch._dynamo.utils.counters["frames"]["ok"] >= 1  # something was compiled
    keys = list(torch.load(tmp_path / "net.pt"))
    assert keys[0] == "body.0.weight" and not any("_orig_mod" in k for k in keys)
