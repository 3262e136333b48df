"""AR201: the deprecated torch.cuda.amp / torch.cpu.amp API moves to torch.amp."""

from __future__ import annotations

import ast
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.precision.amp_api import AmpApiMigration

RULES = [AmpApiMigration()]


def migrate(source: str):
    result = rewrite(textwrap.dedent(source), Options(), rules=RULES)
    ast.parse(result.output)
    assert rewrite(result.output, Options(), rules=RULES).output == result.output
    return result


@pytest.mark.parametrize(
    "before,after",
    [
        ("import torch\nwith torch.cuda.amp.autocast():\n    pass\n",
         'import torch\nwith torch.amp.autocast("cuda"):\n    pass\n'),
        ("import torch\nwith torch.cpu.amp.autocast(dtype=torch.bfloat16):\n    pass\n",
         'import torch\nwith torch.amp.autocast("cpu", dtype=torch.bfloat16):\n    pass\n'),
        ("import torch\ns = torch.cuda.amp.GradScaler(1024.0, 2.0)\n",
         'import torch\ns = torch.amp.GradScaler("cuda", init_scale=1024.0, growth_factor=2.0)\n'),
        ("import torch\nfrom torch.cuda import amp\ns = amp.GradScaler(enabled=False)\n",
         'import torch\ns = torch.amp.GradScaler("cuda", enabled=False)\n'),
        ("from torch.cuda.amp import autocast\nwith autocast(False):\n    pass\n",
         'import torch\nwith torch.amp.autocast("cuda", enabled=False):\n    pass\n'),
    ],
)
def test_migrations(before, after):
    result = migrate(before)
    assert result.output == after
    assert [n.rule for n in result.changes] == ["AR201"]


def test_an_import_still_used_elsewhere_stays():
    result = migrate("""\
        from torch.cuda.amp import autocast

        ctx = autocast
        with autocast():
            pass
    """)
    assert "from torch.cuda.amp import autocast" in result.output
    assert 'with torch.amp.autocast("cuda"):' in result.output
    [skip] = result.skips
    assert skip.line == 3 and "without being called" in skip.message


def test_star_arguments_are_left_with_a_reason():
    result = migrate("""\
        import torch
        kwargs = {"enabled": True}
        with torch.cuda.amp.autocast(**kwargs):
            pass
    """)
    assert not result.changed
    assert "*args/**kwargs" in result.skips[0].message


def test_the_migrated_calls_run_without_deprecation_warnings():
    torch = pytest.importorskip("torch")
    import warnings

    source = (
        "import torch\n"
        "with torch.cpu.amp.autocast():\n"
        "    y = torch.nn.Linear(2, 2)(torch.randn(1, 2))\n"
        "scaler = torch.cpu.amp.GradScaler(enabled=False)\n"
    )
    with pytest.warns(FutureWarning):
        exec(compile(source, "before", "exec"), {})
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        exec(compile(migrate(source).output, "after", "exec"), {"torch": torch})
