"""Issue 46: research codebases convert as one program.

The seed's own tutorial shape first (a function that took ``device`` takes ``fabric``), then the
project read as one program (packages, relative imports, ``as``), well-known library APIs known
as data, and the one-line hints that lift a refusal. Fixtures in these shapes have goldens
(tests/test_fixtures.py, tests/test_projects.py) and run both ways at 32-true
(tests/test_verify.py, here).
"""

from __future__ import annotations

import ast
import textwrap

from tests.goldens import FIXTURES, run
from tests.test_conversions import convert


def _params(code: str, name: str) -> list[str]:
    func = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == name)
    return [a.arg for a in [*func.args.args, *func.args.kwonlyargs]]


def _reads(code: str, func_name: str, name: str) -> bool:
    func = next(n for n in ast.walk(ast.parse(code)) if isinstance(n, ast.FunctionDef) and n.name == func_name)
    return any(isinstance(n, ast.Name) and n.id == name for n in ast.walk(func))


def test_a_function_that_took_the_device_takes_fabric_with_fabric_a_global():
    """The seed's 01 shape (fixtures/vit_finetune): Fabric is created at the top of
    ``if __name__ == "__main__":``, a global; ``train(..., device)`` still takes `fabric` in the
    device's place and reads it as its parameter, and the caller passes ``fabric=fabric``: no
    parameter is left that nothing reads, and ``train`` works when another module imports it."""
    result = run("vit_finetune", "bf16-mixed-devices-4")
    out = result.output
    assert _params(out, "train") == ["num_epochs", "model", "optimizer", "train_loader", "val_loader", "fabric"]
    assert "        fabric=fabric\n" in out and "device=" not in out
    assert not _reads(out, "train", "device")
    assert any(n.rule == "AR105" and "parameter `device` became `fabric`" in n.message for n in result.changes)


def test_every_parameter_the_output_keeps_is_read():
    """No dead parameter: in every function of the rewrite, each parameter the original read is
    still read (a threaded `device` became `fabric`, which is read)."""
    source = (FIXTURES / "vit_finetune" / "input.py").read_text()
    out = run("vit_finetune", "default").output
    for func in (n for n in ast.walk(ast.parse(out)) if isinstance(n, ast.FunctionDef)):
        for arg in [*func.args.args, *func.args.kwonlyargs]:
            if arg.arg in ("self",):
                continue
            assert any(isinstance(n, ast.Name) and n.id == arg.arg for n in ast.walk(func)), (func.name, arg.arg)
    assert source != out


def test_a_device_parameter_is_threaded_only_where_every_call_passes_the_device():
    """``probe(model, "cpu")`` passes a string of its own: ``probe`` keeps its ``device``
    (threaded, that call would hand a string to code that reads ``fabric.device``), and the
    device definition stays for it; ``train``, always passed the device, takes `fabric`."""
    for home in ("", "def main():\n"):
        body = """
            model = nn.Linear(4, 1)
            probe(model, "cpu")
            device = "cuda" if torch.cuda.is_available() else "cpu"
            model.to(device)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
            loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
            train(model, optimizer, loader, device)
            probe(model, device)
        """
        body = textwrap.indent(textwrap.dedent(body), "    " if home else "")
        result = convert(textwrap.dedent("""
            import torch
            import torch.nn as nn
            from torch.utils.data import DataLoader, TensorDataset

            def probe(model, device):
                return model(torch.zeros(1, 4, device=device))

            def train(model, optimizer, loader, device):
                for x, y in loader:
                    x, y = x.to(device), y.to(device)
                    loss = nn.functional.mse_loss(model(x), y)
                    loss.backward()
                    optimizer.step()
        """) + home + body + ("main()\n" if home else ""))
        out = result.output
        assert _params(out, "train") == ["model", "optimizer", "loader", "fabric"]
        assert _params(out, "probe") == ["model", "device"]
        assert "train(model, optimizer, loader, fabric)" in out
        assert 'probe(model, "cpu")' in out and "probe(model, device)" in out
        assert 'device = "cuda" if torch.cuda.is_available() else "cpu"' in out


DINO_CHAIN = """
import torch
import torch.nn as nn
from torch.utils.data import DataLoader, TensorDataset


def restore(path, optimizer=None):
    return path


def main(name):
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model = nn.Linear(4, 1).to(device)
    if name == "adamw":
        optimizer = torch.optim.AdamW(model.parameters())
    elif name == "sgd":
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    LATER
    restore("checkpoint.pth", optimizer=optimizer)
    loader = DataLoader(TensorDataset(torch.randn(8, 4), torch.randn(8, 1)), batch_size=2)
    for x, y in loader:
        x, y = x.to(device), y.to(device)
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        optimizer.step()


main("sgd")
"""


def test_an_elif_chain_the_script_reads_after_on_every_path_converts():
    """DINO's optimizer: built in an ``if``/``elif`` chain without ``else``, read by the script
    on the next statement, on every path. The set-up after the chain reads it where the script
    does: where the chain binds nothing, both fail with a NameError before any training, so it
    converts. Anything that may leave between the two (``return``, a ``raise`` in a nested
    ``if``) keeps the refusal."""
    result = convert(DINO_CHAIN.replace("    LATER\n", ""))
    assert ("        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
            "    model, optimizer = fabric.setup(model, optimizer)\n") in result.output
    for leave in ("    if name == 'none':\n        return\n", "    if name == 'none':\n        raise SystemExit\n"):
        result = convert(DINO_CHAIN.replace("    LATER\n", leave), allow_dropped=True)
        assert not result.changed
        assert any("reads `optimizer`" in d and "some path leaves it unbound" in d for d in result.dropped)
