"""Issue 60: code never seen, read as Python runs it, not as a pattern. Each shape here comes
from a script of the never-seen batch (benchmarks/real-corpus-60.tsv), written small: what a
helper returns, what its parameters are at the call, which classes are schedulers.

Every conversion checks that the output parses, that no rule was dropped, and that a second
rewrite changes nothing.
"""

from __future__ import annotations

import ast
import re
import textwrap

import pytest

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


#: pytorch-deeplab-xception's model: its parameter groups come from methods of its own
DEEPLAB_MODEL = """
class DeepLab(nn.Module):
    def __init__(self):
        super().__init__()
        self.backbone = nn.Linear(8, 8)
        self.head = nn.Linear(8, 2)

    def forward(self, x):
        return self.head(self.backbone(x))

    def get_1x_lr_params(self):
        yield from self.backbone.parameters()

    def get_10x_lr_params(self):
        yield from self.head.parameters()
"""

DEEPLAB = """
import torch
import torch.nn as nn
from tqdm import tqdm

""" + DEEPLAB_MODEL + """

class Trainer:
    def __init__(self, lr):
        self.train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)),
                                                        batch_size=4)
        model = DeepLab()
        train_params = [{'params': model.get_1x_lr_params(), 'lr': lr},
                        {'params': model.get_10x_lr_params(), 'lr': lr * 10}]
        optimizer = torch.optim.SGD(train_params, momentum=0.9)
        self.model, self.optimizer = model, optimizer

    def training(self, epoch):
        tbar = tqdm(self.train_loader)
        for i, (image,) in enumerate(tbar):
            loss = self.model(image).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


trainer = Trainer(0.01)
for epoch in range(2):
    trainer.training(epoch)
"""


def test_parameters_from_a_models_own_methods_are_that_models():
    """pytorch-deeplab-xception: ``{'params': model.get_1x_lr_params(), ...}``: what an optimizer
    takes from a method of a model are that model's parameters (no hint needed); the loop draws
    from ``tbar = tqdm(self.train_loader)``, the loader set up, and ``tbar`` is not taken for
    a second loader (``setup_dataloaders`` would raise a TypeError on the progress bar)."""
    result = convert(DEEPLAB, devices=2)
    assert "        model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    assert "self.train_loader = fabric.setup_dataloaders(" in result.output
    assert "setup_dataloaders(tbar)" not in result.output
    assert "tbar = tqdm(self.train_loader, disable=not fabric.is_global_zero)\n" in result.output


def test_an_optimizer_returned_through_a_helper_that_returns_another_helpers_result():
    """SimMIM's ``build_optimizer(config, model, logger, is_pretrain)``: ``if is_pretrain: return
    build_pretrain_optimizer(config, model, logger)`` else the fine-tuning one, each building
    the optimizer over ``model`` and returning it: set up where the script receives it, with
    the model as the script names it (``net``)."""
    result = convert("""
    import torch
    import torch.nn as nn


    def build_optimizer(config, model, is_pretrain):
        if is_pretrain:
            return build_pretrain_optimizer(config, model)
        else:
            return build_finetune_optimizer(config, model)


    def build_pretrain_optimizer(config, model):
        optimizer = None
        if config["name"] == "sgd":
            optimizer = torch.optim.SGD(model.parameters(), lr=config["lr"])
        return optimizer


    def build_finetune_optimizer(config, model):
        optimizer = torch.optim.AdamW(model.parameters(), lr=config["lr"])
        return optimizer


    def main(config):
        net = nn.Linear(8, 2)
        optimizer = build_optimizer(config, net, is_pretrain=True)
        for step in range(4):
            loss = net(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


    if __name__ == "__main__":
        main({"name": "sgd", "lr": 0.1})
    """)
    assert ("    optimizer = build_optimizer(config, net, is_pretrain=True)\n"
            "    net, optimizer = fabric.setup(net, optimizer)\n") in result.output
    assert result.output.count("fabric.setup(") == 1


def test_a_loader_returned_through_a_packages_init_is_set_up_where_the_script_receives_it(tmp_path):
    """SimMIM's ``data/__init__.py``: ``def build_loader(config, is_pretrain): if is_pretrain:
    return build_loader_simmim(config)`` (imported from ``.data_simmim``, which builds the
    DataLoader and returns it), else the fine-tuning one, which returns a tuple: called with
    ``is_pretrain=True``, the other branch is never taken, and the script's ``data_loader`` is
    the loader, set up for several devices (it used to refuse: "can't show to be a
    DataLoader")."""
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "__init__.py").write_text(
        "from .data_simmim import build_loader_simmim\nfrom .data_finetune import build_loader_finetune\n\n\n"
        "def build_loader(config, is_pretrain):\n    if is_pretrain:\n        return build_loader_simmim(config)\n"
        "    else:\n        return build_loader_finetune(config)\n")
    (tmp_path / "data" / "data_finetune.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
        "def build_loader_finetune(config):\n"
        "    dataset = TensorDataset(torch.randn(16, 8))\n"
        "    return dataset, DataLoader(dataset, config['batch_size'])\n")
    (tmp_path / "data" / "data_simmim.py").write_text(
        "import torch\nfrom torch.utils.data import DataLoader, TensorDataset\n\n\n"
        "def build_loader_simmim(config):\n"
        "    dataloader = DataLoader(TensorDataset(torch.randn(16, 8)), config['batch_size'])\n"
        "    return dataloader\n")
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
    import torch
    import torch.nn as nn
    from data import build_loader

    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    data_loader = build_loader({"batch_size": 4}, is_pretrain=True)
    for (x,) in data_loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """).lstrip())
    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script))
    assert not result.dropped, result.dropped
    assert ('data_loader = build_loader({"batch_size": 4}, is_pretrain=True)\n'
            "data_loader = fabric.setup_dataloaders(data_loader)\n") in result.output


def test_model_module_read_before_the_setup_reads_the_bare_model_once_dataparallel_goes():
    """deeplab-pytorch: ``model = nn.DataParallel(model)``, then the optimizer over
    ``get_params(model.module, key="1x")``: with DataParallel removed, ``model.module`` before
    Fabric's set-up would raise AttributeError; it becomes ``model``. After the set-up,
    ``model.module`` (Fabric's wrapper has one) stays."""
    result = convert("""
    import torch
    import torch.nn as nn


    def get_params(model, key):
        for m in model.named_modules():
            if key in m[0]:
                for p in m[1].parameters():
                    yield p


    model = nn.Sequential()
    model.add_module("1x", nn.Linear(8, 8))
    model.add_module("10x", nn.Linear(8, 2))
    model = nn.DataParallel(model)
    optimizer = torch.optim.SGD([{"params": get_params(model.module, key="1x")},
                                 {"params": get_params(model.module, key="10x"), "lr": 1.0}], lr=0.1)
    model.module[0].train()
    for step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model.module.state_dict(), "m.pt")
    """)
    assert '[{"params": get_params(model, key="1x")},\n' in result.output
    assert '{"params": get_params(model, key="10x"), "lr": 1.0}], lr=0.1)\n' \
           "model, optimizer = fabric.setup(model, optimizer)\nmodel.module[0].train()\n" in result.output
    assert "torch.save(model.module.state_dict()" in result.output


def _src_layout(tmp_path):
    """open_clip's shape: ``src/trainer_pkg/`` (a package, installed from ``src`` as
    pyproject.toml says), run as ``python -m trainer_pkg.main``; main imports the training
    function from ``trainer_pkg.train``, where ``backward(total_loss, scaler)`` runs the backward
    for ``train_one_epoch``, which main calls."""
    (tmp_path / "pyproject.toml").write_text('[tool.setuptools.packages.find]\nwhere = ["src"]\n')
    pkg = tmp_path / "src" / "trainer_pkg"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "train.py").write_text(textwrap.dedent("""
    import torch


    def backward(total_loss, scaler):
        if scaler is not None:
            scaler.scale(total_loss).backward()
        else:
            total_loss.backward()


    def train_one_epoch(model, data, optimizer, scaler):
        for (x,) in data:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            backward(loss, scaler)
            optimizer.step()
    """).lstrip())
    main = pkg / "main.py"
    main.write_text(textwrap.dedent("""
    import torch
    import torch.nn as nn
    from torch.utils.data import DataLoader, TensorDataset

    from trainer_pkg.train import train_one_epoch


    def main():
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        data = DataLoader(TensorDataset(torch.randn(16, 8)), batch_size=4)
        for epoch in range(2):
            train_one_epoch(model, data, optimizer, None)


    if __name__ == "__main__":
        main()
    """).lstrip())
    return main


def test_a_script_in_a_src_layout_package_reads_its_package(tmp_path):
    """The package is found where Python finds it (``src``, from pyproject.toml's ``where``,
    and the folder above the script's own package): the training is read, not "no training
    found"; the backward's helper and its caller receive `fabric` from main."""
    from accelerate_rewrite.codemod.project.program import Scope

    main = _src_layout(tmp_path)
    result = rewrite(main.read_text(), Options.create(), path=str(main), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "model, optimizer = fabric.setup(model, optimizer)" in result.output
    train = next(m for m in result.members if m.path.endswith("train.py"))
    assert "def backward(fabric, total_loss, scaler):\n" in train.output
    assert "        fabric.backward(scaler.scale(total_loss))\n" in train.output
    assert "        backward(fabric, loss, scaler)\n" in train.output
    assert "train_one_epoch(fabric, model, data, optimizer, None)" in result.output


APEX_KWARGS = """
import torch
import torch.nn as nn
from apex import amp

model = nn.Linear(8, 2).cuda()
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
amp_args = {AMP_ARGS}
model, optimizer = amp.initialize(model, optimizer, **amp_args)
for step in range(3):
    loss = model(torch.randn(4, 8).cuda()).pow(2).mean()
    optimizer.zero_grad()
    with amp.scale_loss(loss, optimizer) as scaled_loss:
        scaled_loss.backward()
    optimizer.step()
"""


def test_apex_initialize_with_keywords_in_a_dict_reads_them():
    """``amp.initialize(model, opt, **amp_args)`` with ``amp_args = dict(opt_level="O2", ...)``:
    the dict's keywords are read as Python passes them (it used to be refused with a false
    reason: "must hand back the objects it takes", which it does)."""
    for spelling in ('dict(opt_level="O2", loss_scale="dynamic")', '{"opt_level": "O2"}'):
        source = APEX_KWARGS.replace("{AMP_ARGS}", spelling)
        fabric = convert(source)
        assert 'Fabric(devices=1, precision="16-mixed")' in fabric.output
        native = convert(source, backend="torch")
        assert "scaler.scale(loss).backward()" in native.output


def test_apex_keywords_in_a_dict_it_cant_read_need_a_precision_and_say_so():
    """``**vars(args)``-like dicts (built by a call, or changed after) are not read: the
    refusal says the opt_level is not a literal, and --precision converts it."""
    source = APEX_KWARGS.replace("{AMP_ARGS}", 'dict(opt_level="O1")\namp_args["opt_level"] = "O2"')
    result = rewrite(textwrap.dedent(source), Options.create(), path="train.py")
    assert not result.changed
    assert "opt_level is not a literal O0-O3: give --precision" in " ".join(n.message for n in result.skips)
    assert 'precision="bf16-mixed"' in convert(source, precision="bf16-mixed").output


def test_a_module_s_own_import_of_a_name_the_script_imports_too_keeps_its_meaning(tmp_path):
    """SimMIM's utils.py and main script each ``try: from apex import amp / except ImportError:
    amp = None``: the program reads utils' ``amp`` under a name of its own, and its import binds
    that name (it used to bind ``amp``, so utils' ``amp.state_dict()`` was no apex call to the
    analysis, stayed, and the conversion was dropped for reading a name no longer defined)."""
    from accelerate_rewrite.codemod.project.program import Scope

    guarded = "try:\n    from apex import amp\nexcept ImportError:\n    amp = None\n"
    (tmp_path / "utils.py").write_text("import torch\n\n" + guarded + textwrap.dedent("""


    def save_checkpoint(config, model, optimizer, path):
        save_state = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
        if config["amp"] != "O0":
            save_state["amp"] = amp.state_dict()
        torch.save(save_state, path)
    """))
    script = tmp_path / "main.py"
    script.write_text("import torch\nimport torch.nn as nn\n\n" + guarded + textwrap.dedent("""
    from utils import save_checkpoint


    def main(config):
        model = nn.Linear(8, 2).cuda()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        model, optimizer = amp.initialize(model, optimizer, opt_level=config["amp"])
        for step in range(3):
            loss = model(torch.randn(4, 8).cuda()).pow(2).mean()
            optimizer.zero_grad()
            with amp.scale_loss(loss, optimizer) as scaled_loss:
                scaled_loss.backward()
            optimizer.step()
        save_checkpoint(config, model, optimizer, "ckpt.pt")


    if __name__ == "__main__":
        main({"amp": "O1"})
    """))
    result = rewrite(script.read_text(), Options.create(precision="bf16-mixed"), path=str(script),
                     scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "fabric.backward(loss)" in result.output
    utils = next(m for m in result.members if m.path.endswith("utils.py"))
    assert '        save_state["amp"] = {}\n' in utils.output
    assert guarded in utils.output


SWA = """
import torch
import torch.nn as nn
from torch.optim import swa_utils

model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
swa_model = swa_utils.AveragedModel(model)
for epoch in range(2):
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    swa_model.update_parameters(model)
torch.save(swa_model.module.state_dict(), "swa.pt")
"""


def test_torch_s_averaged_model_takes_the_module_and_updates_from_the_set_up_model():
    """Person_reID's ``swa_utils.AveragedModel(model)`` and ``swa_model.update_parameters(model)``
    (torch's API, as data in codemod/analysis/libraries.py): the average copies the module
    (Accelerate: ``accelerator.unwrap_model(model)``; Fabric on several devices:
    ``model.module``, DDP can't be deep-copied), and ``update_parameters`` reads parameters
    only, the same under DDP (it used to stop the Accelerate conversion as code it can't see)."""
    accelerate = convert(SWA, backend="accelerate", devices=2)
    assert "swa_model = swa_utils.AveragedModel(accelerator.unwrap_model(model))\n" in accelerate.output
    assert "    swa_model.update_parameters(model)\n" in accelerate.output
    fabric = convert(SWA, devices=2)
    assert "swa_model = swa_utils.AveragedModel(model.module)\n" in fabric.output


def test_code_given_the_model_before_the_scripts_own_ddp_wrap_gets_the_module():
    """FixMatch's ``ema_model = ModelEMA(args, model, decay)`` (a class from a module the
    analysis doesn't read), then ``model = DDP(model)``: the original handed that code the
    module, and the Accelerate rewrite hands it the module again; ``ema_model.update(model)``
    after the wrap keeps getting the wrapper, as in the original."""
    result = convert("""
    import os

    import torch
    import torch.nn as nn
    from models.ema import ModelEMA

    local_rank = int(os.environ.get("LOCAL_RANK", -1))
    if local_rank != -1:
        torch.distributed.init_process_group(backend="nccl")
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    ema_model = ModelEMA(model, 0.999)
    if local_rank != -1:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        ema_model.update(model)
    """, backend="accelerate", devices=2)
    assert "ema_model = ModelEMA(accelerator.unwrap_model(model), 0.999)\n" in result.output
    assert "    ema_model.update(model)\n" in result.output


def test_names_a_package_re_exports_are_read_where_they_are_defined(tmp_path):
    """maskrcnn-benchmark's ``from maskrcnn_benchmark.solver import make_optimizer``, which
    ``solver/__init__.py`` imports ``from .build``: the program reads build.py, as Python finds
    it (it used to stop at the ``__init__``: "not defined there"); ``params += [{"params":
    [value], ...}]`` over ``model.named_parameters()`` are that model's parameters (a model
    built by a library the analysis can't see, known by its parameters)."""
    from accelerate_rewrite.codemod.project.program import Scope

    solver = tmp_path / "pkg" / "solver"
    solver.mkdir(parents=True)
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (solver / "__init__.py").write_text("from .build import make_optimizer  # noqa\n")
    (solver / "build.py").write_text(textwrap.dedent("""
    import torch


    def make_optimizer(cfg, model):
        params = []
        for key, value in model.named_parameters():
            lr = cfg["lr"] * (2 if "bias" in key else 1)
            params += [{"params": [value], "lr": lr}]
        optimizer = torch.optim.SGD(params, cfg["lr"], momentum=0.9)
        return optimizer
    """).lstrip())
    script = tmp_path / "train_net.py"
    script.write_text(textwrap.dedent("""
    import torch
    import torch.nn as nn
    from pkg.solver import make_optimizer
    from detection_models import build_detection_model


    def train(cfg):
        net = build_detection_model(cfg)
        optimizer = make_optimizer(cfg, net)
        for step in range(3):
            loss = net(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


    if __name__ == "__main__":
        train({"lr": 0.1})
    """).lstrip())
    result = rewrite(script.read_text(), Options.create(), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "    optimizer = make_optimizer(cfg, net)\n    net, optimizer = fabric.setup(net, optimizer)\n" \
        in result.output


def test_a_module_without_a_final_newline_keeps_its_own_names(tmp_path):
    """SimMIM's models/vision_transformer.py and swin_transformer.py both define ``Mlp`` (read
    under names of their own by the program), and end without a newline, so their text is
    printed from the tree: it used to keep the analysis's names (``class Mlp__models_vit``) in a
    file no rule changed. Names are read back in every statement printed."""
    from accelerate_rewrite.codemod.project.program import Scope

    models = tmp_path / "models"
    models.mkdir()
    (models / "__init__.py").write_text("")
    module = ("import torch\nimport torch.nn as nn\n\n\nclass Mlp(nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.fc = nn.Linear(8, 8)\n\n    def forward(self, x):\n"
              "        return self.fc(x)\n\n\nclass NAME(nn.Module):\n    def __init__(self):\n"
              "        super().__init__()\n        self.mlp = Mlp()\n        self.head = nn.Linear(8, 2)\n\n"
              "    def forward(self, x):\n        return self.head(self.mlp(x))\n\n\n"
              "def init_weights(model, path):\n    model.load_state_dict(torch.load(path))")  # no final newline
    (models / "vit.py").write_text(module.replace("NAME", "VisionTransformer"))
    (models / "swin.py").write_text(module.replace("NAME", "SwinTransformer"))
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
    import torch
    from models.swin import SwinTransformer
    from models.vit import VisionTransformer


    def main(kind):
        model = VisionTransformer() if kind == "vit" else SwinTransformer()
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for step in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()


    if __name__ == "__main__":
        main("vit")
    """).lstrip())
    result = rewrite(script.read_text(), Options.create(backend="accelerate", devices=2), path=str(script),
                     scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "accelerator.backward(loss)" in result.output
    assert all(not m.changed and "__models" not in m.output for m in result.members), \
        [m.path for m in result.members if m.changed]


def test_model_module_after_the_removed_ddp_wrap_is_unwrapped_once_under_accelerate():
    """SimMIM's ``model = DDP(model, ...)``, ``model_without_ddp = model.module``: under
    Accelerate on several processes the read goes through ``accelerator.unwrap_model(model)``,
    and the DDP conversion's own ``model.module`` -> ``model`` stands aside (both edits on one
    node were an internal error)."""
    result = convert("""
    import os

    import torch
    import torch.nn as nn

    torch.distributed.init_process_group(backend="nccl")
    local_rank = int(os.environ["LOCAL_RANK"])
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[local_rank])
    model_without_ddp = model.module
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    for (x,) in loader:
        loss = model(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    torch.save(model_without_ddp.state_dict(), "model.pt")
    """, backend="accelerate", devices=2)
    assert "model_without_ddp = accelerator.unwrap_model(model)\n" in result.output


def _image_classification(tmp_path):
    """pytorch_image_classification's shape: the script imports everything from the package's
    ``__init__.py``, which re-exports it from subpackages (``from .datasets import
    create_dataloader``, a package named like a library, whose ``__init__`` re-exports it from
    ``.dataloader``); one name of the statement (the config) has nothing a rule reads; the
    helper ``apply_data_parallel_wrapper`` wraps the model in DDP when a process group runs;
    each batch is split into chunks the inner loop goes over."""
    pkg = tmp_path / "pic"
    for sub in ("", "datasets", "models", "optim", "config"):
        (pkg / sub).mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text(
        "from .config import get_default_config\nfrom .datasets import create_dataloader\n"
        "from .models import apply_data_parallel_wrapper, create_model\nfrom .optim import create_optimizer\n")
    (pkg / "config" / "__init__.py").write_text("def get_default_config():\n    return {'lr': 0.1, 'chunks': 2, 'distributed': False}\n")
    (pkg / "datasets" / "__init__.py").write_text("from .dataloader import create_dataloader\n")
    (pkg / "datasets" / "dataloader.py").write_text(
        "import torch\nimport torch.distributed as dist\n\n\ndef create_dataloader(config):\n"
        "    dataset = torch.utils.data.TensorDataset(torch.randn(16, 8))\n"
        "    return torch.utils.data.DataLoader(dataset, batch_size=4)\n")
    (pkg / "models" / "__init__.py").write_text(textwrap.dedent("""
    import torch.distributed as dist
    import torch.nn as nn


    def create_model(config):
        return nn.Linear(8, 2)


    def apply_data_parallel_wrapper(config, model):
        if dist.is_available() and dist.is_initialized():
            model = nn.parallel.DistributedDataParallel(model)
        return model
    """).lstrip())
    (pkg / "optim" / "__init__.py").write_text(textwrap.dedent("""
    import torch


    def create_optimizer(config, model):
        params = [{"params": list(model.parameters()), "weight_decay": 0.0}]
        optimizer = torch.optim.SGD(params, lr=config["lr"])
        return optimizer
    """).lstrip())
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
    import torch

    from pic import (
        apply_data_parallel_wrapper,
        create_dataloader,
        create_model,
        create_optimizer,
        get_default_config,
    )


    def main():
        config = get_default_config()
        if config["distributed"]:
            torch.distributed.init_process_group(backend="nccl")
        model = create_model(config)
        optimizer = create_optimizer(config, model)
        model = apply_data_parallel_wrapper(config, model)
        train_loader = create_dataloader(config)
        for (data,) in train_loader:
            data_chunks = data.chunk(config["chunks"])
            optimizer.zero_grad()
            for data_chunk in data_chunks:
                loss = model(data_chunk).pow(2).mean() / config["chunks"]
                loss.backward()
            optimizer.step()


    if __name__ == "__main__":
        main()
    """).lstrip())
    return script


def test_a_package_that_re_exports_from_subpackages_converts_for_several_devices(tmp_path):
    """The names are read where Python finds them (the config's stays imported, read first);
    the helper's DDP wrap goes (Fabric's set-up wraps); the loop over a batch's chunks draws
    from the loader's loop, the one set up (it used to be "batches come from `data_chunks`")."""
    from accelerate_rewrite.codemod.project.program import Scope

    script = _image_classification(tmp_path)
    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    assert "train_loader = fabric.setup_dataloaders(train_loader)" in result.output
    assert not any("assumed" in n.message for n in result.changes)  # read through the two __init__ files
    assert "fabric.backward(loss)" in result.output
    models = next(m for m in result.members if m.path.endswith("models/__init__.py"))
    assert "DistributedDataParallel" not in models.output


HINTED = {
    # an optimizer a helper builds over what the analysis can't follow, received by the caller
    "received": ("""
import torch
import torch.nn as nn
from grouping import param_groups


def build_optimizer(config, model):
    optimizer = torch.optim.SGD(
        param_groups(config),
        lr=config["lr"],
    )
    return optimizer


def main(config):
    net = nn.Linear(8, 2)
    optimizer = build_optimizer(config, net)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
    for (x,) in loader:
        loss = net(x).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


if __name__ == "__main__":
    main({"lr": 0.1})
""", {"NAME": "net"}),
    # a multi-line optimizer statement in a method, the model an attribute
    "method": ("""
import torch
import torch.nn as nn
from grouping import param_groups


class Trainer:
    def __init__(self, config):
        self.model = nn.Linear(8, 2)
        self.optimizer = torch.optim.AdamW(
            param_groups(config),
            lr=config["lr"],
        )

    def fit(self, loader):
        for (x,) in loader:
            loss = self.model(x).pow(2).mean()
            self.optimizer.zero_grad()
            loss.backward()
            self.optimizer.step()


trainer = Trainer({"lr": 0.1})
train_loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(8, 8)), batch_size=4)
trainer.fit(train_loader)
""", {"NAME": "self.model"}),
    # batches from a list the script makes of a stream, each process's own
    "stream": ("""
import torch
import torch.nn as nn
from data_lib import make_stream

model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
train_data = [x for x in make_stream(16)]
for x in train_data:
    loss = model(x).pow(2).mean()
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
""", {}),
}

#: "add `# accelerate-rewrite: HINT` at the end of line N" (or "lines N, M")
_HINT = re.compile(r"add `# accelerate-rewrite: ([^`]+)` at the end of lines? (\d+(?:, \d+)*)")
_PER_PROCESS = re.compile(r"`# accelerate-rewrite: per-process`")


@pytest.mark.parametrize("name", sorted(HINTED))
def test_every_hint_a_refusal_names_works_where_it_says(name):
    """Issue 60: a refusal that names a hint names a line where the hint is read, and a NAME
    in scope there: the hint added as the message says (NAME the model, for a script whose
    data is its own per process the other hint it offers), and the script converts."""
    source, names = HINTED[name]
    options = Options.create(devices=2)
    refused = rewrite(source, options, path="train.py")
    assert not refused.changed
    message = " ".join(n.message for n in refused.skips if n.rule == "AR101")
    found = _HINT.search(message)
    assert found is not None, message
    hint, lines = found.group(1), [int(n) for n in found.group(2).split(", ")]
    if _PER_PROCESS.search(message) and not names:
        hint = "per-process"
    for placeholder, value in names.items():
        hint = hint.replace(placeholder, value)
    text = source.splitlines()
    for line in lines:
        text[line - 1] += f"  # accelerate-rewrite: {hint}"
    result = convert("\n".join(text) + "\n", devices=2)
    assert "fabric.backward(loss)" in result.output, [n.message for n in result.skips]


def test_a_module_that_imports_a_name_as_something_else_is_read_under_its_own(tmp_path):
    """ijepa: main.py's ``import multiprocessing as mp`` and src/train.py's ``import
    torch.multiprocessing as mp``: the module's ``mp`` is read under a name of its own, and the
    training in it is found (it used to be "not followed: it imports `mp` as something else",
    then "no training found")."""
    from accelerate_rewrite.codemod.project.program import Scope

    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "__init__.py").write_text("")
    (tmp_path / "src" / "train.py").write_text(textwrap.dedent("""
    import torch
    import torch.multiprocessing as mp
    import torch.nn as nn


    def main(args):
        mp.set_sharing_strategy("file_system")
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=args["lr"])
        for step in range(3):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """).lstrip())
    script = tmp_path / "main.py"
    script.write_text(textwrap.dedent("""
    import multiprocessing as mp

    from src.train import main as app_main

    if __name__ == "__main__":
        mp.set_start_method("spawn")
        app_main(args={"lr": 0.1})
    """).lstrip())
    result = rewrite(script.read_text(), Options.create(), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    train = next(m for m in result.members if m.path.endswith("train.py"))
    assert "fabric.backward(loss)" in train.output
    assert "import torch.multiprocessing as mp\n" in train.output and "mp__" not in train.output
    assert 'mp.set_sharing_strategy("file_system")' in train.output


TIMM_STARTER = """
import argparse

import torch
import torch.nn as nn
from timm import utils

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.1)


def train_one_epoch(model, loader, optimizer, device=torch.device("cuda")):
    for (x,) in loader:
        loss = model(x.to(device)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()


def main():
    args = parser.parse_args()
    device = utils.init_distributed_device(args)
    if args.distributed:
        print(f"Process {args.rank}, total {args.world_size}, device {args.device}.")
    model = nn.Linear(8, 2)
    model.to(device=device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    if args.distributed:
        model = torch.nn.parallel.DistributedDataParallel(model, device_ids=[device])
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    train_one_epoch(model, loader, optimizer, device=device)


if __name__ == "__main__":
    main()
"""


def test_timm_s_init_distributed_device_becomes_the_values_it_sets_from_fabric():
    """timm's ``device = utils.init_distributed_device(args)`` (library data: it starts the
    process group and fills ``args``): the values it sets, from Fabric (Accelerate: its
    names); the device it returns is Fabric's, so moves to it are not "a device Fabric does
    not manage" (it used to refuse: "starts the process group itself")."""
    fabric = convert(TIMM_STARTER, devices=2)
    assert ("    args.distributed = fabric.world_size > 1\n    args.world_size = fabric.world_size\n"
            "    args.rank = fabric.global_rank\n    args.local_rank = fabric.local_rank\n"
            "    args.device = str(fabric.device)\n    device = fabric.device\n") in fabric.output
    assert "init_distributed_device" not in fabric.output
    assert "DistributedDataParallel" not in fabric.output
    assert not any("does not manage that device" in n.message for n in fabric.skips)
    accelerate = convert(TIMM_STARTER, devices=2, backend="accelerate")
    assert "    args.rank = accelerator.process_index\n" in accelerate.output
    assert "    device = accelerator.device\n" in accelerate.output


DICT_LOADERS = """
import torch
import torch.nn as nn

datasets = {x: torch.utils.data.TensorDataset(torch.randn(16, 8), torch.randn(16, 2)) for x in ["train", "val"]}
dataloaders = {x: torch.utils.data.DataLoader(datasets[x], batch_size=4, shuffle=True) for x in ["train", "val"]}
model = nn.Linear(8, 2)
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
for epoch in range(2):
    for phase in ["train", "val"]:
        model.train(phase == "train")
        for x, y in dataloaders[phase]:
            optimizer.zero_grad()
            with torch.set_grad_enabled(phase == "train"):
                loss = nn.functional.mse_loss(model(x), y)
                if phase == "train":
                    loss.backward()
                    optimizer.step()
"""


def test_a_dict_of_loaders_is_set_up_entry_by_entry():
    """Person_reID's ``dataloaders = {x: DataLoader(image_datasets[x], ...) for x in ['train',
    'val']}`` drawn from as ``dataloaders[phase]``: each entry set up (Accelerate: prepared),
    where it used to refuse for several devices ("can't show to be a DataLoader")."""
    fabric = convert(DICT_LOADERS, devices=2)
    assert ("dataloaders = {key: fabric.setup_dataloaders(loader) for key, loader in dataloaders.items()}\n"
            in fabric.output)
    accelerate = convert(DICT_LOADERS, devices=2, backend="accelerate")
    assert "dataloaders = {key: accelerator.prepare(loader) for key, loader in dataloaders.items()}\n" \
        in accelerate.output


@pytest.mark.runs
def test_a_dict_of_loaders_set_up_trains_as_the_original(tmp_path):
    """The rewrite of the dict of loaders runs, on one process, and trains digit for digit as
    the original (32-true)."""
    import subprocess
    import sys

    source = DICT_LOADERS.replace("import torch.nn as nn\n", "import torch.nn as nn\n\ntorch.manual_seed(0)\n") \
        + "print(repr(model.weight.sum().item()))\n"
    result = convert(source)
    outputs = []
    for name, text in (("original.py", source), ("rewritten.py", result.output)):
        (tmp_path / name).write_text(text)
        run = subprocess.run([sys.executable, name], cwd=tmp_path, capture_output=True, text=True, timeout=300)
        assert run.returncode == 0, run.stderr
        outputs.append(run.stdout.strip().splitlines()[-1])
    assert outputs[0] == outputs[1]


def test_a_star_import_of_a_module_of_the_project_reads_its_names(tmp_path):
    """pytorch-deeplab-xception's ``from modeling.deeplab import *``: the module is read, and
    ``DeepLab`` is the model its methods' parameters come from (``model.get_1x_lr_params()``);
    it used to be "not followed: `from modeling.deeplab import *`", and the optimizer's model
    unknown. (Read on several devices, for its print; on one, a module with no word a rule reads
    is not read, and the refusal's hint converts it.)"""
    from accelerate_rewrite.codemod.project.program import Scope

    (tmp_path / "modeling").mkdir()
    (tmp_path / "modeling" / "__init__.py").write_text("")
    (tmp_path / "modeling" / "deeplab.py").write_text(
        "import torch.nn as nn\n\n" + DEEPLAB_MODEL + '\n\nif __name__ == "__main__":\n    print(DeepLab())\n')
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
    import torch
    from modeling.deeplab import *

    model = DeepLab()
    train_params = [{"params": model.get_1x_lr_params(), "lr": 0.01},
                    {"params": model.get_10x_lr_params(), "lr": 0.1}]
    optimizer = torch.optim.SGD(train_params, momentum=0.9)
    for step in range(3):
        loss = model(torch.randn(4, 8)).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    """).lstrip())
    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert "model, optimizer = fabric.setup(model, optimizer)" in result.output
    assert "from modeling.deeplab import *\n" in result.output


def _template(tmp_path):
    """victoresque/pytorch-template's shape: objects built from a config by name
    (``config.init_obj('optimizer', torch.optim, trainable_params)``), a Trainer of
    ``trainer/trainer.py`` (re-exported by ``from .trainer import *``) deriving from a
    BaseTrainer that keeps the optimizer (``super().__init__(model, optimizer)``), a loader whose
    class has a method the script calls (``split_validation``) and that an iteration-based run
    wraps (``self.data_loader = inf_loop(data_loader)``)."""
    for sub in ("trainer", "base"):
        (tmp_path / sub).mkdir()
    (tmp_path / "base" / "__init__.py").write_text("from .base_trainer import *\n")
    (tmp_path / "base" / "base_trainer.py").write_text(textwrap.dedent("""
    class BaseTrainer:
        def __init__(self, model, optimizer):
            self.model = model
            self.optimizer = optimizer

        def train(self, epochs):
            for epoch in range(epochs):
                self._train_epoch(epoch)
    """).lstrip())
    (tmp_path / "trainer" / "__init__.py").write_text("from .trainer import *\n")
    (tmp_path / "trainer" / "trainer.py").write_text(textwrap.dedent("""
    from itertools import repeat

    from base import BaseTrainer


    def inf_loop(data_loader):
        for loader in repeat(data_loader):
            yield from loader


    class Trainer(BaseTrainer):
        def __init__(self, model, optimizer, data_loader, len_epoch=None):
            super().__init__(model, optimizer)
            self.data_loader = data_loader
            if len_epoch is not None:
                self.data_loader = inf_loop(data_loader)

        def _train_epoch(self, epoch):
            self.model.train()
            for batch_idx, (data,) in enumerate(self.data_loader):
                self.optimizer.zero_grad()
                loss = self.model(data).pow(2).mean()
                loss.backward()
                self.optimizer.step()
    """).lstrip())
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent("""
    import torch
    import torch.nn as nn
    from parse_config import ConfigParser
    from trainer import Trainer


    def main(config):
        data_loader = config.init_obj("data_loader")
        valid_data_loader = data_loader.split_validation()
        model = nn.Linear(8, 2)
        trainable_params = filter(lambda p: p.requires_grad, model.parameters())
        optimizer = config.init_obj("optimizer", torch.optim, trainable_params)
        lr_scheduler = config.init_obj("lr_scheduler", torch.optim.lr_scheduler, optimizer)
        trainer = Trainer(model, optimizer, data_loader=data_loader)
        trainer.train(2)
        lr_scheduler.step()


    if __name__ == "__main__":
        main(ConfigParser.from_args())
    """).lstrip())
    return script


def test_a_config_driven_trainer_class_converts(tmp_path):
    """The optimizer a config builds from the model's parameters, stepped by the Trainer through
    its base class's attribute, is set up with the model (the scheduler the config builds over
    the optimizer is not taken for one); the loader is set up after the call of its own class's
    method (Fabric's wrapper carries attributes, not methods); ``inf_loop(data_loader)`` is the
    same loader."""
    from accelerate_rewrite.codemod.project.program import Scope

    script = _template(tmp_path)
    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    assert ("    valid_data_loader = data_loader.split_validation()\n"
            "    data_loader = fabric.setup_dataloaders(data_loader)\n") in result.output
    assert "    model, optimizer = fabric.setup(model, optimizer)\n" in result.output
    assert "lr_scheduler)" not in result.output.split("fabric.setup(")[1].split("\n")[0]
    trainer = next(m for m in result.members if m.path.endswith("trainer.py"))
    assert "fabric.backward(loss)" in trainer.output


def test_a_method_of_the_loaders_own_class_after_its_set_up_is_refused():
    """Where the script calls its loader's own method after the set-up could go, somewhere the
    set-up can't move past, the conversion is refused with the reason (it would raise
    AttributeError on Fabric's wrapper)."""
    result = rewrite(textwrap.dedent("""
    import torch
    import torch.nn as nn
    from data import MyLoader

    loader = MyLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for epoch in range(2):
        for (x,) in loader:
            loss = model(x).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        loader.reshuffle(epoch)
    """), Options.create(devices=2, explicit=()), path="train.py")
    assert not result.changed
    assert "calls a method of `loader`'s own class after Fabric would set it up" in " ".join(
        n.message for n in result.skips)


def test_no_training_found_names_the_modules_that_were_not_read(tmp_path):
    """Issue 60: "no training found" where the training is in a module of the project that was
    not read says which, and why (it used to say only "no training found", while the backward
    sat in a module it never read)."""
    from accelerate_rewrite.codemod.project.program import Scope

    (tmp_path / "engine.py").write_text(textwrap.dedent("""
    import torch


    def train(model, steps):
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            loss = model(torch.randn(4, 8)).pow(2).mean()
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
    """).lstrip())
    script = tmp_path / "main.py"
    script.write_text("import torch.nn as nn\n\nimport engine\n\nprint(engine)\nengine.train(nn.Linear(8, 2), 3)\n")
    result = rewrite(script.read_text(), Options.create(), path=str(script), scope=Scope(follow=True))
    message = " ".join(n.message for n in result.skips if n.rule == "AR101")
    assert "no training found (no optimizer, no backward call) in what was read (not read: line 3: " in message
    assert "engine.py is not followed" in message


def test_a_function_called_with_a_dict_of_keywords_receives_its_objects():
    """edm's shape: ``training_loop(rank=rank, **config)`` with ``config = dict(model=model,
    optimizer=optimizer, loader=loader)``: the dict's entries flow into the parameters they name
    (the loop's ``loader`` is the one set up; it used to be "can't show to be a DataLoader")."""
    result = convert("""
    import torch
    import torch.nn as nn


    def training_loop(rank, model, optimizer, loader, steps=2):
        for step in range(steps):
            for (x,) in loader:
                loss = model(x).pow(2).mean()
                optimizer.zero_grad()
                loss.backward()
                optimizer.step()


    def main():
        model = nn.Linear(8, 2)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(16, 8)), batch_size=4)
        config = dict(model=model, optimizer=optimizer, loader=loader)
        training_loop(rank=0, **config)


    if __name__ == "__main__":
        main()
    """, devices=2)
    assert "    loader = fabric.setup_dataloaders(loader)\n" in result.output
    assert "    training_loop(fabric, rank=0, **config)\n" in result.output


#: Person_reID's phases over a dict of loaders, in a timm-style script that starts its processes
#: with ``utils.init_distributed_device(args)``: every sample's index is printed where it is seen
TWO_PROCESS_SCRIPT = """
import argparse

import torch
import torch.nn as nn
from timm import utils

parser = argparse.ArgumentParser()
parser.add_argument("--lr", type=float, default=0.0)


def main():
    args = parser.parse_args()
    device = utils.init_distributed_device(args)
    torch.manual_seed(0)
    sets = {x: torch.utils.data.TensorDataset(torch.arange(16.0).unsqueeze(1).repeat(1, 8), torch.arange(16))
            for x in ["train", "val"]}
    dataloaders = {x: torch.utils.data.DataLoader(sets[x], batch_size=4) for x in ["train", "val"]}
    model = nn.Linear(8, 2).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    seen = {"train": [], "val": []}
    for phase in ["train", "val"]:
        for x, index in dataloaders[phase]:
            optimizer.zero_grad()
            with torch.set_grad_enabled(phase == "train"):
                loss = model(x.to(device)).pow(2).mean()
                if phase == "train":
                    loss.backward()
                    optimizer.step()
            seen[phase] += index.tolist()
        print(phase, "rank", args.rank, "of", args.world_size, "saw", sorted(seen[phase]))
        with open(f"seen-{args.rank}-of-{args.world_size}-{phase}.txt", "w") as out:  # (prints interleave)
            out.write(repr(sorted(seen[phase])))


if __name__ == "__main__":
    main()
"""


@pytest.mark.slow  # (a second of its kind: out of CI's 15 minutes)
@pytest.mark.runs
def test_timm_s_start_and_a_dict_of_loaders_run_on_two_processes_each_on_its_shard(tmp_path):
    """The rewrite (``--devices 2 --accelerator cpu``) runs as 2 gloo processes on CPU where the
    original ran on one: ``args.rank``/``world_size`` come from Fabric (timm's call is gone), and
    each process draws its half of each loader of the dict."""
    import os
    import shutil
    import sys

    from tests import processes
    from tests.goldens import ROOT

    result = convert(TWO_PROCESS_SCRIPT, devices=2, accelerator="cpu")
    runs = {}
    for name, text in (("original", TWO_PROCESS_SCRIPT), ("rewritten", result.output)):
        folder = tmp_path / name
        folder.mkdir()
        shutil.copytree(ROOT / "tests" / "stubs" / "timm", folder / "timm")
        (folder / "train.py").write_text(text)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        env.pop("LT_DEVICES", None)
        runs[name] = processes.run([sys.executable, "train.py"], cwd=folder, env=env, timeout=300)
        assert runs[name].returncode == 0, runs[name].stderr[-2000:]
    everything = list(range(16))
    assert [line for line in runs["original"].stdout.splitlines() if " saw " in line] == [
        f"train rank 0 of 1 saw {everything}", f"val rank 0 of 1 saw {everything}"]
    # each process of 2 saw its own half of each loader of the dict (the files it wrote: the two
    # processes' prints, one each as the original would under a launcher (AR108), interleave)
    folder = tmp_path / "rewritten"
    assert sorted(p.name for p in folder.glob("seen-*")) == [
        f"seen-{rank}-of-2-{phase}.txt" for rank in (0, 1) for phase in ("train", "val")]
    for phase in ("train", "val"):
        halves = [ast.literal_eval((folder / f"seen-{rank}-of-2-{phase}.txt").read_text()) for rank in (0, 1)]
        assert [len(h) for h in halves] == [8, 8] and sorted(halves[0] + halves[1]) == everything


def test_a_dict_of_loaders_keeps_its_dict_methods():
    """A dict of loaders set up entry by entry is a dict: ``dataloaders.keys()`` after it is no
    method of a loader's class, and the conversion goes on."""
    result = convert(DICT_LOADERS + 'print(sorted(dataloaders.keys()))\n', devices=2)
    assert "dataloaders = {key: fabric.setup_dataloaders(loader) for key, loader in dataloaders.items()}\n" \
        in result.output


#: maskrcnn-benchmark's shape: the script decides distribution by its own flag (``WORLD_SIZE``),
#: a package's helper builds the loader over a batch sampler that wraps the sampler another
#: helper picks (the package's own DistributedSampler, in a module the program does not read,
#: when distributed), keeps it in a list and returns ``data_loaders[0]``; the loop is in another
#: module of the package. Every process writes the samples' indices it saw.
RANK_SHARDED = {
    "train_net.py": """
import os

import torch
import torch.nn as nn
from detpkg.data import make_data_loader
from detpkg.engine.trainer import do_train


def train(distributed):
    torch.manual_seed(0)
    model = nn.Linear(8, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.0)
    data_loader = make_data_loader(is_train=True, is_distributed=distributed)
    do_train(model, data_loader, optimizer)


def main():
    num_gpus = int(os.environ["WORLD_SIZE"]) if "WORLD_SIZE" in os.environ else 1
    distributed = num_gpus > 1
    if distributed:
        torch.distributed.init_process_group(backend="gloo", init_method="env://")
    train(distributed)


if __name__ == "__main__":
    main()
""",
    "detpkg/__init__.py": "",
    "detpkg/data/__init__.py": "from .build import make_data_loader\n",
    "detpkg/data/build.py": """
import torch.utils.data

from . import samplers


def make_data_sampler(dataset, shuffle, distributed):
    if distributed:
        return samplers.DistributedSampler(dataset, shuffle=shuffle)
    if shuffle:
        sampler = torch.utils.data.sampler.RandomSampler(dataset)
    else:
        sampler = torch.utils.data.sampler.SequentialSampler(dataset)
    return sampler


def make_batch_data_sampler(sampler, images_per_batch, num_iters=None):
    batch_sampler = torch.utils.data.sampler.BatchSampler(sampler, images_per_batch, drop_last=False)
    if num_iters is not None:
        batch_sampler = samplers.IterationBasedBatchSampler(batch_sampler, num_iters)
    return batch_sampler


def make_data_loader(is_train=True, is_distributed=False):
    datasets = [torch.utils.data.TensorDataset(torch.arange(16.0).unsqueeze(1).repeat(1, 8), torch.arange(16))]
    data_loaders = []
    for dataset in datasets:
        sampler = make_data_sampler(dataset, False, is_distributed)
        batch_sampler = make_batch_data_sampler(sampler, 4)
        data_loader = torch.utils.data.DataLoader(dataset, num_workers=0, batch_sampler=batch_sampler)
        data_loaders.append(data_loader)
    if is_train:
        assert len(data_loaders) == 1
        return data_loaders[0]
    return data_loaders
""",
    "detpkg/data/samplers/__init__.py": (
        "from .distributed import DistributedSampler\n"
        "from .iteration_based_batch_sampler import IterationBasedBatchSampler\n"),
    "detpkg/data/samplers/distributed.py": """
import math

import torch.distributed as dist
from torch.utils.data.sampler import Sampler


class DistributedSampler(Sampler):
    def __init__(self, dataset, num_replicas=None, rank=None, shuffle=True):
        self.num_replicas = dist.get_world_size() if num_replicas is None else num_replicas
        self.rank = dist.get_rank() if rank is None else rank
        self.num_samples = int(math.ceil(len(dataset) / self.num_replicas))
        self.total_size = self.num_samples * self.num_replicas
        self.dataset = dataset

    def __iter__(self):
        indices = list(range(len(self.dataset)))
        indices += indices[: (self.total_size - len(indices))]
        return iter(indices[self.rank:self.total_size:self.num_replicas])

    def __len__(self):
        return self.num_samples
""",
    "detpkg/data/samplers/iteration_based_batch_sampler.py": """
from torch.utils.data.sampler import BatchSampler


class IterationBasedBatchSampler(BatchSampler):
    def __init__(self, batch_sampler, num_iterations):
        self.batch_sampler = batch_sampler
        self.num_iterations = num_iterations

    def __iter__(self):
        iteration = 0
        while iteration < self.num_iterations:
            for batch in self.batch_sampler:
                iteration += 1
                if iteration > self.num_iterations:
                    break
                yield batch

    def __len__(self):
        return self.num_iterations
""",
    "detpkg/engine/__init__.py": "",
    "detpkg/engine/trainer.py": """
import torch


def do_train(model, data_loader, optimizer):
    device = torch.device("cpu")
    model.train()
    seen = []
    for images, index in data_loader:
        images = images.to(device)
        loss = model(images).pow(2).mean()
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        seen += index.tolist()
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    with open(f"seen-{rank}.txt", "w") as out:  # a file each: the processes' prints interleave
        out.write(repr(sorted(seen)))
""",
}


def _rank_sharded_project(folder, **changes):
    for name, text in RANK_SHARDED.items():
        path = folder / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(changes.get(name, text).lstrip("\n"))
    return folder / "train_net.py"


def _project_rewrite(script, **options):
    from accelerate_rewrite.codemod.project.program import Scope

    result = rewrite(script.read_text(), Options.create(**options), path=str(script), scope=Scope(follow=True))
    assert not result.dropped, result.dropped
    for member in [result, *result.members]:
        ast.parse(member.output)
    return result


def test_a_loader_a_helper_builds_over_a_rank_sharded_sampler_is_each_process_s_own(tmp_path):
    """maskrcnn-benchmark's ``make_data_loader``: read through the package's helpers (the
    returns the call's ``is_train=True`` reaches, the list's ``[0]``, the batch samplers over
    the sampler, the package's own DistributedSampler read in its file, which reads the rank),
    its batches are each process's own: the conversion to several devices goes ahead without
    a hint, the loader not set up (it was "batches come from `data_loader`, which the rewrite
    can't show to be a DataLoader it sets up")."""
    script = _rank_sharded_project(tmp_path)
    result = _project_rewrite(script, devices=2)
    assert "fabric = Fabric(devices=2" in result.output
    assert "setup_dataloaders" not in result.output
    notes = [n.message for r in (result, *result.members) for n in r.skips]
    assert any("a DataLoader over `samplers.DistributedSampler(dataset, shuffle=...`, which shards the data by "
               "the process's rank" in n for n in notes), notes


@pytest.mark.parametrize("call", [
    # never told the run is distributed: ``is_distributed`` keeps its default, False
    "make_data_loader(is_train=True)",
    # told it is not: the sampler is the other branch
    "make_data_loader(is_train=True, is_distributed=False)",
])
def test_a_helper_s_loader_never_told_the_run_is_distributed_is_not_each_process_s_own(tmp_path, call):
    """The branch the call's literal (or the parameter's default) never takes is not read:
    the loader stays one process's loader over all the data, and the refusal for several
    devices stands, with its hints."""
    script = _rank_sharded_project(tmp_path, **{"train_net.py": RANK_SHARDED["train_net.py"].replace(
        "make_data_loader(is_train=True, is_distributed=distributed)", call)})
    from accelerate_rewrite.codemod.project.program import Scope

    result = rewrite(script.read_text(), Options.create(devices=2), path=str(script), scope=Scope(follow=True))
    assert "Fabric(" not in result.output
    notes = [n.message for r in (result, *result.members) for n in r.skips]
    assert any("which the rewrite can't show to be a DataLoader it sets up" in n for n in notes), notes


@pytest.mark.runs
def test_a_rank_sharded_helper_loader_runs_on_two_processes_each_on_its_shard(tmp_path):
    """The rewrite (``--devices 2 --accelerator cpu``) runs as 2 gloo processes where the
    original ran on one: the script's ``distributed`` is Fabric's now, the helper builds the
    package's DistributedSampler, and each process draws its own half."""
    import os
    import sys

    from tests import processes

    runs = {}
    for name in ("original", "rewritten"):
        folder = tmp_path / name
        script = _rank_sharded_project(folder)
        if name == "rewritten":
            result = _project_rewrite(script, devices=2, accelerator="cpu")
            for member in [result, *result.members]:
                path = folder / os.path.relpath(member.path, folder) if os.path.isabs(member.path) else \
                    folder / member.path
                path.write_text(member.output)
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
        env.pop("LT_DEVICES", None)
        runs[name] = processes.run([sys.executable, "train_net.py"], cwd=folder, env=env, timeout=300)
        assert runs[name].returncode == 0, runs[name].stderr[-2000:]
    assert sorted(p.name for p in (tmp_path / "original").glob("seen-*")) == ["seen-0.txt"]
    assert ast.literal_eval((tmp_path / "original" / "seen-0.txt").read_text()) == list(range(16))
    shards = sorted((tmp_path / "rewritten").glob("seen-*"))
    assert [p.name for p in shards] == ["seen-0.txt", "seen-1.txt"], runs["rewritten"].stdout
    halves = [ast.literal_eval(p.read_text()) for p in shards]
    assert [len(h) for h in halves] == [8, 8] and sorted(halves[0] + halves[1]) == list(range(16))
