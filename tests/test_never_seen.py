"""Issue 60: code never seen, read as Python runs it, not as a pattern. Each shape here comes
from a script of the never-seen batch (benchmarks/real-corpus-60.tsv), written small: what a
helper returns, what its parameters are at the call, which classes are schedulers.

Every conversion checks that the output parses, that no rule was dropped, and that a second
rewrite changes nothing.
"""

from __future__ import annotations

import ast
import textwrap

from accelerate_rewrite.api import Result, rewrite
from accelerate_rewrite.options import Options


def convert(source: str, **options) -> Result:
    opts = Options.create(**options)
    result = rewrite(textwrap.dedent(source).lstrip("\n"), opts, path="train.py")
    ast.parse(result.output)
    assert not result.dropped, result.dropped
    assert rewrite(result.output, opts).output == result.output, "not idempotent"
    return result


HELPERS = """
import torch
import torch.nn as nn
from lib.lr_scheduler import WarmupPolyLrScheduler


def set_model():
    net = nn.Linear(8, 2)
    net.train()
    return net


def set_optimizer(model):
    if hasattr(model, "get_params"):
        params = model.get_params()
    else:
        params = [p for n, p in model.named_parameters()]
    optim = torch.optim.SGD(params, lr=0.1)
    return optim


def train():
    net = set_model()
    optim = set_optimizer(net)
    lr_schdr = WarmupPolyLrScheduler(optim, power=0.9)
    for step in range(4):
        loss = net(torch.randn(4, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        lr_schdr.step()


if __name__ == "__main__":
    train()
"""


def test_an_optimizer_a_helper_builds_over_its_parameter_is_set_up_with_the_callers_model():
    """BiSeNet's ``optim = set_optimizer(net)`` with ``def set_optimizer(model): ... return
    optim``: set up as ``net, optim`` where the script receives it (it used to name the helper's
    ``model``, unbound there, and the conversion was dropped); the scheduler built over the
    returned optimizer, of a class the analysis can't see, is not taken for a second optimizer."""
    result = convert(HELPERS)
    assert "    optim = set_optimizer(net)\n    net, optim = fabric.setup(net, optim)\n" in result.output
    assert "lr_schdr = WarmupPolyLrScheduler(optim, power=0.9)\n" in result.output


def test_a_scheduler_class_of_the_script_over_an_optimizer_from_a_package_is_not_an_optimizer():
    """A class of the script deriving (through its own classes) from torch's ``_LRScheduler``,
    built over an optimizer the analysis can't see (``build_optimizer`` from a package) and
    stepped, is a scheduler."""
    result = convert("""
    import torch
    import torch.nn as nn
    from lib.optim import build_optimizer


    class WarmupLrScheduler(torch.optim.lr_scheduler._LRScheduler):
        def get_lr(self):
            return list(self.base_lrs)


    class WarmupPolyLrScheduler(WarmupLrScheduler):
        def __init__(self, optimizer, power):
            self.power = power
            super().__init__(optimizer)


    net = nn.Linear(8, 2)
    optim = build_optimizer(net)
    lr_schdr = WarmupPolyLrScheduler(optim, power=0.9)
    for step in range(4):
        loss = net(torch.randn(4, 8)).pow(2).mean()
        optim.zero_grad()
        loss.backward()
        optim.step()
        lr_schdr.step()
    """)
    assert "net, optim = fabric.setup(net, optim)\n" in result.output


def test_fabric_is_created_in_the_script_not_at_a_modules_top_level(tmp_path):
    """Person_reID's ``ODFA.py`` (an input-gradient attack, so the program reads it) moves
    tensors at its top level (``zeros, ones = zeros.cuda(), ones.cuda()``), and the script trains
    at its own top level: the module's top level runs on import,
    so Fabric goes into the script, where ``train_model`` reads it as a global (it used to be
    placed in the module, and the backward "couldn't reach" it)."""
    from accelerate_rewrite.codemod.project.program import Scope

    (tmp_path / "attack.py").write_text(textwrap.dedent("""
    import torch
    import torch.nn as nn


    def perturb(model, img):
        inputs = img.clone().requires_grad_(True)
        loss = nn.MSELoss()(model(inputs), torch.zeros_like(model(inputs)))
        loss.backward()
        return (inputs - 0.01 * inputs.grad.sign()).detach()


    zeros, ones = torch.zeros(1), torch.ones(1)
    zeros, ones = zeros.cuda(), ones.cuda()
    """).lstrip())
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
    import torch
    import torch.nn as nn
    from attack import perturb


    def train_model(model, optimizer, num_epochs=2):
        for epoch in range(num_epochs):
            loss = model(perturb(model, torch.randn(4, 8).cuda())).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        return model


    model = nn.Linear(8, 2)
    model = model.cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = train_model(model, optimizer)
    """).lstrip())
    result = rewrite(script.read_text(), Options.create(), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "        fabric.backward(loss)\n" in result.output
    assert "    return model\n\n\nfabric = Fabric(devices=1)\nfabric.launch()\n\n\nmodel = nn.Linear(8, 2)\n" \
        in result.output
