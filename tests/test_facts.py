"""ScriptFacts: what one walk over a training script finds, on small inputs.

No torch here: the facts are read from the source text only.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import libcst as cst
import pytest

from accelerate_rewrite.codemod.analysis.facts import (
    DEVICE,
    LOADER,
    MODEL,
    MODULE,
    OPTIMIZER,
    SCHEDULER,
    ScriptFacts,
    is_device_expr,
    is_literal_device,
)


def facts_of(source: str) -> ScriptFacts:
    return ScriptFacts(cst.parse_module(textwrap.dedent(source)))


def text(node: cst.CSTNode) -> str:
    return cst.Module([]).code_for_node(node)


def owner_name(owner: cst.CSTNode) -> str:
    if isinstance(owner, cst.Module):
        return "<module>"
    return owner.name.value  # FunctionDef / ClassDef


def named(key) -> tuple[str, str]:
    """A key as (scope name, path), for readable asserts."""
    owner, path = key
    return owner_name(owner), path


def kinds(facts: ScriptFacts) -> dict[tuple[str, str], set[str]]:
    return {named(k): v for k, v in facts.kinds.items()}


def find_function(facts: ScriptFacts, name: str) -> cst.FunctionDef:
    import libcst.matchers as m

    found = m.findall(facts.module, m.FunctionDef(name=m.Name(name)))
    assert len(found) == 1, name
    return found[0]


# ---------------------------------------------------------------------------------------
# backward sites
# ---------------------------------------------------------------------------------------

BACKWARD_SHAPES = '''
import torch


class Trainer:
    def step(self, x):
        self.loss = self.model(x).sum()
        self.loss.backward()


def train(model, x):
    loss = model(x)
    loss.mean().backward(retain_graph=True)


def fit(model, optimizer, x, y):
    def closure():
        optimizer.zero_grad()
        out = torch.nn.functional.mse_loss(model(x), y)
        out.backward()
        return out
    optimizer.step(closure)


def amp(model, scaler, x):
    loss = model(x).sum()
    scaler.scale(loss).backward()


loss = torch.ones(1, requires_grad=True).sum()
loss.backward()
'''


def test_every_backward_shape_is_a_site():
    f = facts_of(BACKWARD_SHAPES)
    sites = {(text(s.loss), s.function.name.value if s.function else None) for s in f.backward_sites}
    assert sites == {
        ("self.loss", "step"),
        ("loss.mean()", "train"),
        ("out", "closure"),  # inside the LBFGS closure: the innermost function
        ("scaler.scale(loss)", "amp"),
        ("loss", None),  # module level
    }


def test_backward_site_keeps_its_arguments_and_statement():
    f = facts_of(BACKWARD_SHAPES)
    site = next(s for s in f.backward_sites if text(s.loss) == "loss.mean()")
    assert [text(a) for a in site.call.args] == ["retain_graph=True"]
    assert text(site.stmt).strip() == "loss.mean().backward(retain_graph=True)"
    assert f.line(site.call) == 13


def test_autograd_backward_is_not_a_method_site():
    f = facts_of("""
        import torch
        loss = torch.ones(1, requires_grad=True).sum()
        torch.autograd.backward(loss)
    """)
    assert f.backward_sites == []


# ---------------------------------------------------------------------------------------
# optimizers, models, schedulers, loaders
# ---------------------------------------------------------------------------------------

def test_optimizer_and_the_model_it_trains():
    f = facts_of("""
        import torch
        import torch.nn as nn

        model = nn.Linear(4, 1)
        optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1)
        loader = torch.utils.data.DataLoader(range(8), batch_size=2)
        criterion = nn.MSELoss()
    """)
    [opt] = f.optimizers
    assert opt.path == "optimizer" and opt.qualname == "torch.optim.AdamW" and opt.kind == OPTIMIZER
    assert [named(k) for k in opt.models] == [("<module>", "model")]
    assert [(b.path, b.qualname) for b in f.schedulers] == [("scheduler", "torch.optim.lr_scheduler.StepLR")]
    assert [(b.path, b.qualname) for b in f.loaders] == [("loader", "torch.utils.data.DataLoader")]
    k = kinds(f)
    assert MODEL in k[("<module>", "model")] and MODULE in k[("<module>", "model")]
    assert k[("<module>", "criterion")] == {MODULE}  # a module, but nothing trains it
    assert k[("<module>", "optimizer")] == {OPTIMIZER}
    assert k[("<module>", "scheduler")] == {SCHEDULER}
    assert k[("<module>", "loader")] == {LOADER}


def test_imported_names_resolve_to_torch():
    f = facts_of("""
        from torch.optim import SGD
        from torch.optim.lr_scheduler import CosineAnnealingLR
        from torch.utils.data import DataLoader
        from torch import nn

        net = nn.Sequential(nn.Linear(4, 4), nn.ReLU())
        opt = SGD(net.parameters(), lr=0.1)
        sched = CosineAnnealingLR(opt, T_max=10)
        dl = DataLoader([1, 2, 3])
    """)
    assert [(o.path, o.qualname) for o in f.optimizers] == [("opt", "torch.optim.SGD")]
    assert [named(k) for k in f.optimizers[0].models] == [("<module>", "net")]
    assert [b.path for b in f.schedulers] == ["sched"]
    assert [b.path for b in f.loaders] == ["dl"]


def test_optimizer_over_self_model_in_a_class():
    f = facts_of("""
        import torch

        class Trainer:
            def __init__(self, model):
                self.model = model
                self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)
    """)
    [opt] = f.optimizers
    assert named(opt.key) == ("Trainer", "self.optimizer")
    assert [named(k) for k in opt.models] == [("Trainer", "self.model")]
    # ``self.model = model``: the parameter is the same object, so a model too
    assert MODEL in kinds(f)[("__init__", "model")]


def test_param_groups_name_one_model_through_its_submodules():
    f = facts_of("""
        import torch

        model = Net()
        optimizer = torch.optim.Adam(
            [{"params": model.fc.parameters()}, {"params": model.head.parameters(), "lr": 1e-4}],
            lr=1e-3,
        )
    """)
    [opt] = f.optimizers
    assert [named(k) for k in opt.models] == [("<module>", "model")]
    assert MODEL in kinds(f)[("<module>", "model")]


def test_params_keyword_and_named_parameters():
    f = facts_of("""
        import torch

        model = Net()
        opt = torch.optim.SGD(params=[p for n, p in model.named_parameters() if "bias" not in n], lr=0.1)
    """)
    assert [named(k) for k in f.optimizers[0].models] == [("<module>", "model")]


def test_optimizer_over_two_models_names_both():
    f = facts_of("""
        import torch

        enc = torch.nn.Linear(4, 2)
        dec = torch.nn.Linear(2, 4)
        optimizer = torch.optim.Adam(list(enc.parameters()) + list(dec.parameters()), lr=1e-3)
    """)
    assert [named(k) for k in f.optimizers[0].models] == [("<module>", "enc"), ("<module>", "dec")]


def test_gan_two_optimizers_two_models():
    f = facts_of("""
        import torch

        G = Generator()
        D = Discriminator()
        opt_g = torch.optim.Adam(G.parameters(), lr=2e-4)
        opt_d = torch.optim.Adam(D.parameters(), lr=2e-4)
    """)
    assert {o.path: [named(k)[1] for k in o.models] for o in f.optimizers} == {
        "opt_g": ["G"], "opt_d": ["D"],
    }


def test_optimizer_over_untraceable_parameters_names_no_model():
    f = facts_of("""
        import torch

        params = get_params()
        optimizer = torch.optim.SGD(params, lr=0.1)
    """)
    assert f.optimizers[0].models == []


def test_not_optimizers():
    f = facts_of("""
        import torch

        policy = torch.optim.Optimizer  # the class itself, not a call
        zeroed = torch.optim.swa_utils.get_ema_multi_avg_fn()
    """)
    assert f.optimizers == []


def test_swa_utils_are_not_optimizers():
    f = facts_of("""
        import torch
        from torch.optim.swa_utils import AveragedModel, SWALR

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
        swa_model = AveragedModel(model)
        swa_scheduler = SWALR(optimizer, swa_lr=0.05)
    """)
    assert [o.path for o in f.optimizers] == ["optimizer"]
    assert OPTIMIZER not in kinds(f)[("<module>", "swa_model")]
    assert kinds(f)[("<module>", "swa_scheduler")] == {SCHEDULER}


def test_models_property_lists_trained_models():
    if not hasattr(ScriptFacts, "models"):
        pytest.skip("ScriptFacts.models was removed: nothing left to be wrong")
    f = facts_of("""
        import torch

        model = torch.nn.Linear(4, 1)
        optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    """)
    assert [b.path for b in f.models] == ["model"]


def test_module_classes_of_the_file():
    f = facts_of("""
        import torch.nn as nn

        class Base(nn.Module):
            pass

        class Net(Base):
            pass

        class Plain:
            pass

        net = Net()
        plain = Plain()
    """)
    assert f.module_classes == {"Base", "Net"}
    assert [(b.path, b.kind) for b in f.bindings] == [("net", MODULE)]


# ---------------------------------------------------------------------------------------
# devices: definitions, moves, and flow
# ---------------------------------------------------------------------------------------

DEVICE_DEFS = '''
import torch

a = torch.device("cuda" if torch.cuda.is_available() else "cpu")
b = "cuda" if torch.cuda.is_available() else "cpu"
c = torch.accelerator.current_accelerator()
d = "cuda:1"
e = torch.device("cuda", 0)
not_a_device = "cuda" if x else "gpu"
number = 0
word = "cpu only"
'''


def test_device_definitions():
    f = facts_of(DEVICE_DEFS)
    assert [b.path for b in f.device_defs] == ["a", "b", "c", "d", "e"]
    assert all(b.kind == DEVICE for b in f.device_defs)
    assert [b.path for b in f.device_defs if b.call is not None] == ["a", "c", "e"]
    for path in ("not_a_device", "number", "word"):
        assert (("<module>", path)) not in kinds(f)


def test_device_expressions():
    f = facts_of(DEVICE_DEFS)
    by_path = {t.target.value: s.value for stmt in f.module.body
               for s in stmt.body if isinstance(s, cst.Assign) for t in s.targets}
    assert is_device_expr(f, by_path["a"]) and is_device_expr(f, by_path["c"])
    assert not is_device_expr(f, by_path["number"])
    assert is_literal_device(f, by_path["number"])  # ``.to(0)``
    assert not is_literal_device(f, by_path["word"])


def test_device_moves_and_what_they_move():
    f = facts_of("""
        import torch

        model = torch.nn.Linear(4, 1).cuda()
        other = torch.nn.Linear(4, 1).to(0)
        x = batch.to(device, non_blocking=True)
        y = batch.to(device=device)
        z = batch.to(device, torch.float16)
        w = batch.cuda(non_blocking=True)
        h = batch.to(torch.float16)
    """)
    moves = {text(mv.call): (text(mv.receiver), mv.device_arg and text(mv.device_arg.value), mv.removable)
             for mv in f.device_moves}
    assert moves["torch.nn.Linear(4, 1).cuda()"] == ("torch.nn.Linear(4, 1)", None, True)
    assert moves["torch.nn.Linear(4, 1).to(0)"] == ("torch.nn.Linear(4, 1)", "0", True)
    assert moves["batch.to(device, non_blocking=True)"] == ("batch", "device", True)
    assert moves["batch.to(device=device)"] == ("batch", "device", True)
    assert moves["batch.to(device, torch.float16)"] == ("batch", "device", False)
    assert moves["batch.cuda(non_blocking=True)"] == ("batch", None, True)
    # a dtype in the first place is recorded as a candidate; rules decide it is no device
    mv = next(mv for mv in f.device_moves if text(mv.call) == "batch.to(torch.float16)")
    assert not is_literal_device(f, mv.device_arg.value)
    # a module moved as it is built is still bound to its constructor
    [model] = [b for b in f.bindings if b.path == "model"]
    assert model.kind == MODULE and model.qualname == "torch.nn.Linear"
    assert text(model.call) == "torch.nn.Linear(4, 1)" and text(model.value).endswith(".cuda()")


def test_device_alias_shares_the_kind():
    f = facts_of("""
        import torch

        device = torch.device("cuda")
        dev = device
        x = 1
    """)
    k = kinds(f)
    assert DEVICE in k[("<module>", "device")] and DEVICE in k[("<module>", "dev")]
    assert f.same_object((f.module, "device"), (f.module, "dev"))
    assert not f.same_object((f.module, "device"), (f.module, "x"))



def test_a_name_given_two_objects_holds_neither():
    """``_, _ = get_data()`` binds ``_`` to the training loader and to the validation loader:
    they stay two objects (pytorch/examples' language_translation, fixtures/data_helper: the
    validation loader was taken for the training one, sharded, and its sum all-reduced twice).
    A name given one object, twice or through itself (``x = x``), still holds it."""
    f = facts_of("""
        import torch
        from torch.utils.data import DataLoader


        def get_data():
            train_dl = DataLoader(range(8), shuffle=True)
            valid_dl = DataLoader(range(4))
            return train_dl, valid_dl


        def predict():
            _, _ = get_data()


        def main():
            train_dl, valid_dl = get_data()
            loader = train_dl
            loader = loader
            again = valid_dl
            again = valid_dl
    """)
    main, predict = find_function(f, "main"), find_function(f, "predict")
    assert not f.same_object((main, "train_dl"), (main, "valid_dl"))
    assert not f.same_object((predict, "_"), (main, "train_dl"))
    assert f.same_object((main, "loader"), (main, "train_dl"))
    assert f.same_object((main, "again"), (main, "valid_dl"))
    assert LOADER in kinds(f)[("predict", "_")]

TRAIN_FUNCTION = '''
import torch


def train(model, optimizer, loader, device):
    for x in loader:
        loss = model(x.to(device)).sum()
        loss.backward()
        optimizer.step()


def evaluate(model, loader, *, device):
    for x in loader:
        model(x.to(device))


def main():
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    model = torch.nn.Linear(4, 1).to(device)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    loader = torch.utils.data.DataLoader(range(8))
    train(model, optimizer, loader, device)
    evaluate(model, loader, device=device)
'''


def test_device_flows_into_a_function_parameter():
    f = facts_of(TRAIN_FUNCTION)
    k = kinds(f)
    assert DEVICE in k[("train", "device")]
    assert DEVICE in k[("evaluate", "device")]  # passed by keyword
    # the other arguments carry their kinds too
    assert MODEL in k[("train", "model")] and MODEL in k[("evaluate", "model")]
    assert OPTIMIZER in k[("train", "optimizer")]
    assert LOADER in k[("train", "loader")]
    train = find_function(f, "train")
    main = find_function(f, "main")
    assert f.same_object((train, "device"), (main, "device"))
    assert [len(f.functions["train"].calls), len(f.functions["evaluate"].calls)] == [1, 1]


def test_device_param_reads_are_references_of_the_key():
    f = facts_of(TRAIN_FUNCTION)
    train = find_function(f, "train")
    refs = f.references((train, "device"))
    assert [text(f.parent(f.parent(r))) for r in refs] == ["x.to(device)"]


def test_device_param_without_a_device_argument_has_no_device_kind():
    f = facts_of("""
        import torch

        def train(model, loader, device="cuda"):
            for x in loader:
                model(x.to(device))

        train(torch.nn.Linear(1, 1), [])
    """)
    assert DEVICE not in kinds(f).get(("train", "device"), set())


def test_self_device_in_a_class_whose_init_receives_the_device():
    f = facts_of("""
        import torch

        class Trainer:
            def __init__(self, model, device):
                self.device = device
                self.model = model.to(self.device)

            def step(self, x):
                return self.model(x.to(self.device))

        device = torch.device("cuda")
        trainer = Trainer(torch.nn.Linear(1, 1), device)
    """)
    k = kinds(f)
    assert DEVICE in k[("Trainer", "self.device")]
    assert DEVICE in k[("__init__", "device")]
    step = find_function(f, "step")
    cls = next(s for s in f.module.body if isinstance(s, cst.ClassDef))
    self_device = f.references((cls, "self.device"))
    assert len(self_device) == 2  # both reads; the assignment target is not a read
    assert all(DEVICE in f.kinds_of(n) for n in self_device)
    assert any(f.function(n) is step for n in self_device)


def test_self_device_built_in_init():
    f = facts_of("""
        import torch

        class Trainer:
            def __init__(self):
                self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    """)
    assert [named(b.key) for b in f.device_defs] == [("Trainer", "self.device")]


def test_class_constructed_by_keyword_flows_into_init():
    f = facts_of("""
        import torch

        class Runner:
            def __init__(self, model, device=None):
                self.device = device

        runner = Runner(model=torch.nn.Linear(1, 1), device=torch.device("cuda"))
        dev = torch.device("cpu")
        other = Runner(torch.nn.Linear(1, 1), device=dev)
    """)
    assert DEVICE in kinds(f)[("Runner", "self.device")]
    assert DEVICE in kinds(f)[("__init__", "device")]


def test_accelerator_api_and_conditional_device():
    f = facts_of("""
        import torch

        device = torch.accelerator.current_accelerator() if torch.accelerator.is_available() else torch.device("cpu")
    """)
    assert [b.path for b in f.device_defs] == ["device"]


# ---------------------------------------------------------------------------------------
# frameworks that already accelerate a script
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,label", [
    ("from lightning.fabric import Fabric\n", "Lightning Fabric"),
    ("import lightning.fabric\nfab = lightning.fabric.Fabric()\n", "Lightning Fabric"),
    ("from lightning_fabric import Fabric\n", "Lightning Fabric"),
    ("from lightning import Fabric\n", "Lightning Fabric"),
    ("import lightning as L\nfabric = L.Fabric(devices=2)\n", "Lightning Fabric"),
    ("import lightning as L\ntrainer = L.Trainer(max_epochs=1)\n", "the Lightning Trainer"),
    ("import lightning as L\nclass M(L.LightningModule):\n    pass\n", "the Lightning Trainer"),
    ("from lightning.pytorch import Trainer\n", "the Lightning Trainer"),
    ("import pytorch_lightning as pl\ntrainer = pl.Trainer()\n", "the Lightning Trainer"),
    ("from pytorch_lightning import LightningModule\n", "the Lightning Trainer"),
    ("from accelerate import Accelerator\n", "Hugging Face Accelerate"),
    ("import accelerate\naccelerator = accelerate.Accelerator()\n", "Hugging Face Accelerate"),
], ids=lambda v: v if isinstance(v, str) and "\n" not in v else None)
def test_frameworks_detected(source, label):
    f = facts_of(source)
    assert f.frameworks and f.frameworks[0][0] == label


@pytest.mark.parametrize("source", [
    "import lightning as L\nL.seed_everything(42)\n",
    "from lightning import seed_everything\nseed_everything(42)\n",
    "from lightning.pytorch import seed_everything\nseed_everything(42)\n",
    "from lightning.fabric import seed_everything\nseed_everything(42)\n",
    "from pytorch_lightning import seed_everything\nseed_everything(42)\n",
    "from lightning.fabric.utilities.seed import seed_everything\nseed_everything(42)\n",
    "import lightning as L\n",  # imported, never used: nothing to decide on
    "import accelerated_thing\nimport lightningbolt\n",  # names that only start the same
])
def test_lightning_only_for_seed_everything_does_not_count(source):
    assert facts_of(source).frameworks == []


@pytest.mark.parametrize("source", [
    "import pytorch_lightning as pl\npl.seed_everything(42)\n",
    "import lightning.pytorch as pl\npl.seed_everything(42)\n",
    "import lightning.fabric\nlightning.fabric.seed_everything(42)\n",
])
def test_module_import_used_only_for_seed_everything_does_not_count(source):
    assert facts_of(source).frameworks == []


@pytest.mark.parametrize("source", [
    "import lightning as L\nfab = L.fabric.Fabric()\n",
    "import lightning as L\ntrainer = L.pytorch.Trainer()\n",
])
def test_frameworks_detected_through_submodule_attributes(source):
    assert facts_of(source).frameworks


# ---------------------------------------------------------------------------------------
# hand-made distributed training, DataParallel, autocast
# ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("source,what", [
    ("import torch.distributed as dist\ndist.init_process_group('nccl')\n",
     "torch.distributed.init_process_group"),
    ("from torch.nn.parallel import DistributedDataParallel as DDP\nm = DDP(model)\n",
     "torch.nn.parallel.DistributedDataParallel"),
    ("import torch\nm = torch.nn.parallel.DistributedDataParallel(model)\n",
     "torch.nn.parallel.DistributedDataParallel"),
    ("from torch.utils.data.distributed import DistributedSampler\ns = DistributedSampler(ds)\n",
     "torch.utils.data.distributed.DistributedSampler"),
    ("import torch\ns = torch.utils.data.DistributedSampler(ds)\n",
     "torch.utils.data.DistributedSampler"),
    ("import torch.multiprocessing as mp\nmp.spawn(main, nprocs=2)\n", "torch.multiprocessing.spawn"),
])
def test_hand_made_ddp(source, what):
    f = facts_of(source)
    assert [c.qualname for c in f.hand_ddp()] == [what]
    assert f.data_parallel() == []


def test_importing_torch_distributed_alone_is_not_hand_made_ddp():
    assert facts_of("import torch.distributed as dist\nprint(dist.is_available())\n").hand_ddp() == []


@pytest.mark.parametrize("source", [
    "import torch.nn as nn\nm = nn.DataParallel(model)\n",
    "from torch.nn import DataParallel\nm = DataParallel(model)\n",
    "import torch\nm = torch.nn.parallel.DataParallel(model, device_ids=[0, 1])\n",
])
def test_data_parallel(source):
    f = facts_of(source)
    assert len(f.data_parallel()) == 1
    assert f.hand_ddp() == []
    assert f.bindings == []  # DataParallel(...) is a wrapper, not a new module


def test_autocast_and_grad_scaler():
    f = facts_of("""
        import torch

        scaler = torch.cuda.amp.GradScaler()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pass
    """)
    assert sorted(c.qualname for c in f.uses_autocast()) == ["torch.autocast", "torch.cuda.amp.GradScaler"]


# ---------------------------------------------------------------------------------------
# prints, functions
# ---------------------------------------------------------------------------------------

def test_prints_and_functions():
    f = facts_of("""
        def train():
            print("a")

        def helper():
            pass

        callbacks = [helper]
        train()
    """)
    assert len(f.prints) == 1
    assert [len(f.functions[n].calls) for n in ("train", "helper")] == [1, 0]
    assert [text(n) for n in f.functions["helper"].other_uses] == ["helper"]


# ---- the lean metadata (codemod/tree/metadata.py) is LibCST's own ---------------------------

FIXTURE_INPUTS = sorted((Path(__file__).resolve().parent.parent / "fixtures").glob("*/input.py"))


@pytest.mark.parametrize("path", FIXTURE_INPUTS, ids=lambda p: p.parent.name)
def test_parents_scopes_and_qualified_names_are_libcsts(path):
    """The parents, scopes, positions and qualified names ScriptFacts computes its own way are what
    LibCST's MetadataWrapper gives, node for node, on every fixture."""
    from libcst.metadata import (MetadataWrapper, ParentNodeProvider, PositionProvider, QualifiedNameProvider,
                                 ScopeProvider)

    from accelerate_rewrite.codemod.tree.walk import TOKENS

    facts = ScriptFacts(cst.parse_module(path.read_text(encoding="utf-8")), fresh=True)
    wrapper = MetadataWrapper(facts.module, unsafe_skip_copy=True)
    theirs = wrapper.resolve_many([ParentNodeProvider, ScopeProvider, QualifiedNameProvider])
    # the walks go past the tokens (whitespace, operators, brackets), which hold only tokens
    assert all(type(n) in TOKENS for n, p in theirs[ParentNodeProvider].items() if type(p) in TOKENS)
    assert {n: p for n, p in theirs[ParentNodeProvider].items() if type(n) not in TOKENS} \
        == facts._meta[ParentNodeProvider]
    assert {n for n in theirs[ScopeProvider] if type(n) not in TOKENS} == set(facts._meta[ScopeProvider])
    mine = facts._meta[ScopeProvider]
    parents = facts._meta[ParentNodeProvider]
    compared: set[int] = set()
    # the scopes are other objects (two analyses), but the same shape: same names, same accesses
    for node, scope in theirs[ScopeProvider].items():
        if type(node) in TOKENS:
            continue
        assert (scope is None) == (mine[node] is None)
        if scope is not None:
            assert type(scope) is type(mine[node])
            assert sorted(a.name for a in scope.assignments) == sorted(a.name for a in mine[node].assignments)
            if id(scope) not in compared:  # the accesses, and what they read; the reads of each assignment
                compared.add(id(scope))

                def assignments(s):  # (filled when first read: _Lazy)
                    return sorted((a.name, id(getattr(a, "node", None)),
                                   sorted(id(r.node) if r.node in parents else 0 for r in a.references))
                                  for a in s.assignments)
                assert assignments(scope) == assignments(mine[node])

                def accesses(s):  # a string annotation is parsed anew by each analysis: its names are others
                    return sorted((id(a.node) if a.node in parents else 0, a.is_annotation,
                                   sorted(id(getattr(r, "node", None)) for r in a.referents)) for a in s.accesses)
                assert accesses(scope) == accesses(mine[node])
    assert dict(MetadataWrapper(facts.module, unsafe_skip_copy=True).resolve(PositionProvider)) \
        == dict(facts._meta[PositionProvider])
    for node, names in theirs[QualifiedNameProvider].items():
        names = names() if callable(names) else names
        assert {q.name for q in names} == facts.qualnames(node)


@pytest.mark.parametrize("path", FIXTURE_INPUTS[::4], ids=lambda p: p.parent.name)
def test_the_qualified_references_are_every_imported_name(path):
    """``qualified_refs`` holds every name's dotted qualified names, but those of names no import
    binds (the collecting walk does not ask them): a local's (``train.<locals>.x``), a
    comprehension's, a builtin's (``builtins.print``), a class attribute's."""
    import libcst.matchers as m

    facts = ScriptFacts(cst.parse_module(path.read_text(encoding="utf-8")))
    refs = {(id(n), q) for n, q in facts.qualified_refs}
    classes = {s.name.value for s in facts.module.body if isinstance(s, cst.ClassDef)}
    for name in facts.find(m.Name()):
        parent = facts.parent(name)
        if isinstance(parent, cst.Attribute) and parent.value is name:
            continue
        for q in facts.qualnames(name):
            if "." in q and (id(name), q) not in refs:
                assert "<locals>" in q or "<comprehension>" in q or q.startswith("builtins.") \
                    or q.split(".")[0] in classes, (path, q)


def test_the_stored_names_agree_with_libcsts_expression_contexts():
    """The scope analysis takes whether a name is stored to from the targets (``_Stored``) where
    a probe shows it gives LibCST's scopes (else it walks the expression contexts): with the
    LibCST of the constraints it does, and the names it marks are those LibCST marks STORE."""
    from libcst.metadata import ExpressionContext, ExpressionContextProvider, MetadataWrapper

    from accelerate_rewrite.codemod.tree.scopes import _PROBE, AGREES_ON, _libcst_version, _probe_agrees, _Stored
    from accelerate_rewrite.codemod.tree.metadata import walk

    # the probe is what the versions measured so are measured with: a LibCST of the constraints
    # that is not among them is added there once it agrees
    assert _probe_agrees()
    assert _libcst_version() in AGREES_ON
    module = cst.parse_module(_PROBE)
    contexts = MetadataWrapper(module, unsafe_skip_copy=True).resolve(ExpressionContextProvider)
    stored = _Stored(walk(module)[2]).stored
    names = [n for n in walk(module)[0] if isinstance(n, cst.Name)]
    assert {id(n) for n in names if contexts.get(n) == ExpressionContext.STORE} == stored


def test_the_sets_filled_when_first_read_behave_as_libcsts_sets():
    """An access's assignments and an assignment's accesses (``_Lazy``): filled once, when first
    read, by what LibCST would have run; set algebra on them gives plain sets; emptied without
    being filled (``_unlink``)."""
    from accelerate_rewrite.codemod.tree.scopes import _Lazy

    filled = []

    def fill(into, *items):
        filled.append(items)
        into[0] |= set(items)

    box = [None]
    lazy = box[0] = _Lazy(fill, box, 1, 2)
    assert filled == []
    assert 1 in lazy and len(lazy) == 2 and sorted(lazy) == [1, 2] and filled == [(1, 2)]
    assert type(lazy | {3}) is set and lazy | {3} == {1, 2, 3} and lazy - {1} == {2}
    lazy.add(4)
    lazy.discard(1)
    assert set(lazy) == {2, 4} and filled == [(1, 2)]
    unread = _Lazy(fill, box, 5)
    unread.clear()
    assert len(unread) == 0 and filled == [(1, 2)]


def test_a_module_not_just_parsed_is_analysed_on_a_copy():
    module = cst.parse_module("import torch\nx = torch.ones(1)\n")
    assert ScriptFacts(module).module is not module
    assert ScriptFacts(module, fresh=True).module is module


#: the fixture files the comparisons with LibCST's own walks read: a third of them in the default
#: run (CI time: 1-2 minutes over all of them on 2 cores), all in the ``slow`` set
SAMPLED = pytest.mark.parametrize("every", [3, pytest.param(1, marks=pytest.mark.slow)], ids=["a-third", "all"])


@SAMPLED
def test_find_gives_what_matchers_find_in_the_same_order(every):
    """``ScriptFacts.find`` (an index of the tree's nodes by type) answers as ``m.findall`` over
    the whole module, node for node, on every fixture."""
    import libcst.matchers as m

    from tests.goldens import FIXTURES

    questions = [m.For(), m.For() | m.While(), m.Name("fabric"), m.Call(),
                 m.Call(func=m.Name("len"), args=[m.Arg()]), m.ClassDef(), m.Attribute(attr=m.Name("module")),
                 m.Subscript() | m.Call(), m.Name(), m.Return(),
                 # the index's quick test (``_necessary``): text, nested node matchers, and fields it
                 # does not test (OneOf, a predicate, a sequence, a metadata matcher)
                 m.Call(func=m.Attribute(value=m.Name(), attr=m.Name("backward"))),
                 m.Call(func=m.Attribute(attr=m.Name("step") | m.Name("zero_grad"))),
                 m.Call(func=m.Attribute(attr=m.Name(value=m.MatchIfTrue(lambda v: v.startswith("to"))))),
                 m.Call(func=m.Name("print"), args=[m.ZeroOrMore()]), m.Assign(value=m.Call(func=m.Attribute())),
                 m.FunctionDef(name=m.Name("train")), m.SimpleString(), m.Integer(value="0"),
                 # OneOf: of node matchers (tested), and with a wildcard among them (not)
                 m.Call(func=m.Name("iter") | m.Attribute(value=m.Name("itertools"), attr=m.Name("cycle"))),
                 m.Call(func=m.Attribute(attr=m.Name("to")), args=[m.ZeroOrMore(), m.Arg(
                     value=m.Attribute(attr=m.Name("float16") | m.Name("bfloat16"))), m.ZeroOrMore()])
                 | m.Call(func=m.Attribute(attr=m.Name("half"))),
                 m.Call(func=m.Name("print") | m.DoNotCare()),
                 # tokens (the walks go past them): LibCST's walk answers
                 m.Comma(), m.SimpleWhitespace() | m.Comment(), m.LeftParen()]
    files = sorted(FIXTURES.glob("*/input.py")) + sorted(FIXTURES.glob("projects/*/*.py"))
    assert len(files) > 20
    for path in files[::every]:
        facts = ScriptFacts(cst.parse_module(path.read_text(encoding="utf-8")))
        for question in questions:
            found, expected = facts.find(question), list(m.findall(facts.module, question))
            assert len(found) == len(expected) and all(a is b for a, b in zip(found, expected)), (path, question)


@SAMPLED
def test_find_in_a_node_gives_what_matchers_find_under_it(every):
    """``ScriptFacts.find_in(node, ...)`` (the same index, cut to the node's subtree) answers as
    ``m.findall(node, ...)``, node for node, for every function, class, loop, block and call of
    every fixture."""
    import libcst.matchers as m

    from tests.goldens import FIXTURES

    questions = [m.For(), m.For() | m.While(), m.Yield(), m.Call(), m.Name(), m.Return(),
                 m.AssignTarget(target=m.Name()), m.Continue() | m.Break(), m.IndentedBlock()]
    files = sorted(FIXTURES.glob("*/input.py")) + sorted(FIXTURES.glob("projects/*/*.py"))
    for path in files[::every]:
        facts = ScriptFacts(cst.parse_module(path.read_text(encoding="utf-8")), fresh=True)
        roots = facts.find(m.FunctionDef() | m.ClassDef() | m.For() | m.IndentedBlock() | m.Call() | m.If())
        for root in roots[::3]:
            for question in questions:
                found, expected = facts.find_in(root, question), list(m.findall(root, question))
                assert len(found) == len(expected) and all(a is b for a, b in zip(found, expected)), \
                    (path, type(root).__name__, question)


@SAMPLED
def test_the_parents_walk_visits_the_nodes_in_libcsts_order(every):
    """The parents' walk of codemod/tree/metadata.py (no copy of each node, the fields LibCST's
    walk visits recorded per class) gives the parents and spans LibCST's own walk gives, in the
    same order, and the nodes of each class in that order, on every fixture (the inputs and the goldens) and on odd sources: f-strings with
    and without a format spec (a class whose walk leaves an empty field out), star imports."""
    from accelerate_rewrite.codemod.tree.metadata import _Parents
    from accelerate_rewrite.codemod.tree.walk import TOKENS, _walk
    from tests.goldens import FIXTURES
    from tests.test_layout import ODD

    files = sorted(FIXTURES.glob("**/*.py"))
    assert len(files) > 100
    sources = [p.read_text(encoding="utf-8") for p in files[::every]] + list(ODD.values()) + [
        'x = f"{a}"\ny = f"{b:>{width}.{p}f} {c!r:10} {d=}"\nfrom os import *\nfrom . import (a, b)\n']
    for source in sources:
        module = cst.parse_module(source)
        parents, spans, by_type = _walk(module)
        visitor = _Parents()
        module.visit(visitor)
        # the same walk, the tokens left out (they hold only tokens)
        assert all(type(n) in TOKENS for n, p in visitor.parents.items() if type(p) in TOKENS)
        kept = [n for n in visitor.parents if type(n) not in TOKENS]
        assert list(parents.items()) == [(n, visitor.parents[n]) for n in kept]
        before = [0]  # before[i]: how many of the walk's first i nodes are kept
        for n in visitor.parents:
            before.append(before[-1] + (type(n) not in TOKENS))
        assert len(spans) == len(kept)
        assert {n: spans[n] for n in kept} == {n: (before[visitor.spans[n][0]], before[visitor.spans[n][1]]) for n in kept}
        assert by_type == {t: [n for n in parents if type(n) is t] for t in map(type, parents)}


def test_the_first_node_inside_is_the_scans():
    """``first_inside`` (bisection over the walk's spans) gives what a scan of every call gives,
    for every function, loop and ``if`` of every fixture."""
    import libcst.matchers as m

    from tests.goldens import FIXTURES

    for path in sorted(FIXTURES.glob("*/input.py")):
        facts = ScriptFacts(cst.parse_module(path.read_text(encoding="utf-8")))
        calls = facts.find(m.Call())
        for outer in facts.find(m.FunctionDef() | m.For() | m.If()):
            scan = next((i for i, c in enumerate(calls) if facts.inside(c, outer)), None)
            assert facts.first_inside(calls, lambda c: c, outer, "calls") == scan, path


@pytest.mark.parametrize("source", [
    # typing named: ScopeVisitor's own look at each call and subscript
    "from typing import cast, TypeVar, List\nimport typing as t\nT = TypeVar('T', 'Model')\n"
    "class Model: pass\ndef f(x: 'List[Model]') -> None:\n    y = cast('Model', x)\n    z = t.cast(List['Model'], y)\n"
    "    w: t.Optional['Model'] = None\n    return y.g(z, w)\n",
    # no typing named: the looks skipped (they can't find it); string annotations still read
    "class Model: pass\ndef f(x: 'Model', loss) -> 'Model':\n    loss = x(1)\n    loss.backward()\n"
    "    loss = x(2)\n    loss.backward()\n    return cast('Model', x)[0]\n",
])
def test_the_scopes_type_hints_are_libcsts(source):
    """The scope analysis skips ScopeVisitor's look for ``typing.cast``, ``TypeVar``,
    ``NewType`` at every call (and ``typing.*`` at every subscript) where no name in the tree is
    ``typing`` (``_typing_named``): every access, with its annotation and type-hint flags and
    what it reads, is still LibCST's."""
    from libcst.metadata import MetadataWrapper, ScopeProvider

    from accelerate_rewrite.codemod.tree.metadata import walk
    from accelerate_rewrite.codemod.tree.scopes import _typing_named, scopes

    module = cst.parse_module(source)
    by_type = walk(module)[2]
    assert _typing_named(by_type) == ("typing" in source)
    mine = scopes(module, by_type)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(ScopeProvider)

    def shape(computed):
        every = {id(s): s for s in computed.values() if s is not None}
        return sorted((type(s).__name__, sorted(
            (a.node.value if isinstance(a.node, cst.Name) else type(a.node).__name__, a.is_annotation,
             a.is_type_hint, sorted(type(r).__name__ + r.name for r in a.referents)) for a in s.accesses))
            for s in every.values())
    assert shape(mine) == shape(theirs)


def test_a_field_holds_tokens_only_as_issubclass_says():
    """The walk's tables read a field's annotation as holding tokens only where a token class is
    among its class's bases (not ``issubclass`` with the ABCs' checks, 40 ms a process): the
    same answer as ``issubclass`` for every field of every node class of this LibCST."""
    import dataclasses
    import typing

    from accelerate_rewrite.codemod.tree.walk import TOKENS, _tokens_only

    def by_issubclass(annotation) -> bool:
        origin = typing.get_origin(annotation)
        if origin is typing.Literal:
            return True
        if origin is not None:
            return all(by_issubclass(a) for a in typing.get_args(annotation))
        if isinstance(annotation, type):
            return annotation in (type(None), str, cst.MaybeSentinel) or issubclass(annotation, tuple(TOKENS))
        return False

    fields = [f for c in vars(cst).values() if isinstance(c, type) and issubclass(c, cst.CSTNode)
              and dataclasses.is_dataclass(c) for f in dataclasses.fields(c)]
    assert len(fields) > 500
    assert [_tokens_only(f.type) for f in fields] == [by_issubclass(f.type) for f in fields]


def test_node_classes_are_issubclass_without_the_abcs_checks():
    """codemod/tree/walk.py's ``node_classes``, which the walk's, the scopes' and the positions'
    tables are made with at each start, is ``issubclass`` over LibCST's classes."""
    from libcst.metadata import scope_provider

    from accelerate_rewrite.codemod.tree.walk import node_classes

    def by_issubclass(*bases: type) -> frozenset:
        return frozenset(c for c in vars(cst).values() if isinstance(c, type) and issubclass(c, bases))

    for bases in [(cst.CSTNode,), (cst.BaseCompoundStatement,), (cst.BaseSuite,), (cst.ExceptHandler,),
                  (cst.BaseExpression, cst.BaseSmallStatement), tuple(scope_provider._ASSIGNMENT_LIKE_NODES)]:
        assert node_classes(*bases) == by_issubclass(*bases), bases
    assert len(node_classes(cst.CSTNode)) >= 200
