"""Golden outputs of the fixtures: the option sets that matter, and how to (re)write them.

    python -m tests.goldens          # rewrite every golden from the current code; then read the diff

Each fixture ``fixtures/NAME/input.py`` has, per option set, ``expected/SET.py`` (the rewritten
script) and ``expected/SET.notes`` (what the summary says: changes, places left alone, dropped
rules), so that a change in behaviour shows up as a readable diff in review.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

from accelerate_rewrite.codemod.engine import Result, rewrite
from accelerate_rewrite.options import Options

ROOT = Path(__file__).resolve().parent.parent
FIXTURES = ROOT / "fixtures"

#: one pattern of each form: a module path, a slice, a glob (the finetune_encoder fixture has all)
FREEZE_FORMS = ("embeddings", "encoder.layer[:2]", "classifier.*")

OPTION_SETS: dict[str, dict] = {
    "default": {},
    "bf16-mixed-devices-4": {"precision": "bf16-mixed", "devices": 4},
    "fsdp": {"strategy": "fsdp"},
    "torch-bf16-mixed": {"backend": "torch", "precision": "bf16-mixed"},
    "torch-16-mixed": {"backend": "torch", "precision": "16-mixed"},
    "torch-16-true": {"backend": "torch", "precision": "16-true"},
    "clip-1.0": {"clip_grad_norm": 1.0},
    "torch-16-mixed-clip-1.0": {"backend": "torch", "precision": "16-mixed", "clip_grad_norm": 1.0},
    "accumulate-4": {"accumulate": 4},
    "accumulate-4-keep-devices-2": {"accumulate": 4, "keep_effective_batch": True, "devices": 2},
    "torch-16-mixed-accumulate-4-clip-1.0": {"backend": "torch", "precision": "16-mixed", "accumulate": 4,
                                             "clip_grad_norm": 1.0},
    "torch-bf16-mixed-accumulate-4-keep": {"backend": "torch", "precision": "bf16-mixed", "accumulate": 4,
                                           "keep_effective_batch": True},
    "freeze-forms": {"freeze": FREEZE_FORMS},
    "torch-freeze-forms": {"backend": "torch", "freeze": FREEZE_FORMS},
    "checkpointing-Block": {"checkpointing": "Block"},
    # the memory and throughput rules of issue 7, all at once: with Fabric, and with the torch
    # backend (paged optimizers, length-grouped training batches, the opt-in DataLoader hints)
    "8bit-compile-padding": {"optimizer_8bit": True, "compile": True, "dynamic_padding": True,
                             "group_by_length": "eval"},
    "torch-8bit-compile-padding-hints": {"backend": "torch", "optimizer_8bit": True, "paged_optimizer": True,
                                         "compile": True, "dynamic_padding": True, "group_by_length": "all",
                                         "explicit": ("AR404",)},
}


def fixture_names() -> list[str]:
    return sorted(p.parent.name for p in FIXTURES.glob("*/input.py"))


@lru_cache(maxsize=None)  # the golden, idempotence and other fixture tests share one rewrite
def run(name: str, option_set: str) -> Result:
    path = FIXTURES / name / "input.py"
    return rewrite(path.read_text(encoding="utf-8"), Options.create(**OPTION_SETS[option_set]),
                   path=f"fixtures/{name}/input.py")


def notes_text(result: Result) -> str:
    lines = [
        f"{n.line}: {n.rule} {'left alone: ' if n.skipped else ''}{n.message}" for n in result.notes
    ]
    lines += [f"dropped: {d}" for d in result.dropped]
    return "\n".join(lines) + "\n"


def write_all() -> None:
    for name in fixture_names():
        out = FIXTURES / name / "expected"
        out.mkdir(exist_ok=True)
        for option_set in OPTION_SETS:
            result = run(name, option_set)
            (out / f"{option_set}.py").write_text(result.output, encoding="utf-8")
            (out / f"{option_set}.notes").write_text(notes_text(result), encoding="utf-8")
            print(f"wrote fixtures/{name}/expected/{option_set}.py")


if __name__ == "__main__":
    write_all()
