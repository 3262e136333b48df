"""What --accumulate, --freeze and --checkpointing buy: peak memory and time per optimizer step.

    .venv/bin/python benchmarks/accumulate_freeze.py [--steps 30] [--run-on cpu|cuda]
        [--batch-size 64] [--accumulate 4] [-- TRANSFORMER_LM ARGS]

Runs fixtures/transformer_lm (sizes from the arguments after ``--``) under the verifier's
instrumentation (runner.run_script: one optimizer step is one step, whatever the micro-batches)
in these configurations, each for --steps optimizer steps:

- the original at --batch-size B;
- `--accumulate N` (AR302) at batch B / N: the same samples per optimizer step;
- the same with `--precision bf16-mixed`;
- `--freeze tok --freeze pos --freeze 'blocks.layers[:L/2]'` (AR303) at batch B: the embeddings
  and the lower half of the blocks frozen;
- `--checkpointing blocks.layers` (AR401) at batch B: every transformer block recomputes its
  activations in the backward.

and prints a markdown table: peak memory (CUDA max allocated on a GPU, peak RSS on CPU), median
time per optimizer step (warm-up steps left out), first and last loss, with the machine.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path
from statistics import median

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accelerate_rewrite.api import rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402
from accelerate_rewrite.verify.runner import run_script  # noqa: E402
from benchmarks.verify_fixtures import _mib, machine  # noqa: E402

FIXTURE = ROOT / "fixtures" / "transformer_lm" / "input.py"


def _arg(args: list[str], name: str, default: int) -> int:
    return int(args[args.index(name) + 1]) if name in args else default


def measure(source: str, configs: list, script_args: list[str], batch: int, steps: int, env: dict,
            samples_flag: str = "--samples") -> list[str]:
    """Rewrite ``source`` with each configuration's options, run it for ``steps`` optimizer
    steps under the verifier's instrumentation, and return one markdown table row each."""
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for label, options, size in configs:
            script = Path(folder) / "t.py"
            text = source if not options else rewrite(source, Options.create(**options)).output
            script.write_text(text, encoding="utf-8")
            args = [*script_args, "--batch-size", str(size)]
            if samples_flag:
                args += [samples_flag, str(batch * (steps + 5))]
            print(f"running {label} (batch {size})", file=sys.stderr)
            record = run_script(script, args, label=label, max_steps=steps, cwd=Path(folder), env=env)
            if not record.ok:
                rows.append(f"| {label} | {size} | failed: {str(record.error)[-200:]} | | | | |")
                continue
            warm = max(1, len(record.step_times_s) // 10)
            step = median(record.step_times_s[warm:]) if len(record.step_times_s) > warm else None
            losses = [x for x in record.losses if x is not None]
            rows.append(f"| {label} | {size} x {batch // size} | {record.precision} | {_mib(record.peak_memory_bytes)} | "
                        f"{'-' if step is None else f'{step * 1000:.1f} ms'} | "
                        f"{losses[0]:.4f} | {losses[-1]:.4f} |")
    return rows


HEADER = ("| configuration | batch x micro-batches | precision used | peak memory | time / optimizer step "
          "| first loss | last loss |\n|---|---|---|---|---|---|---|")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--run-on", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--accumulate", type=int, default=4)
    parser.add_argument("script_args", nargs="*")
    ns = parser.parse_args()
    n, batch = ns.accumulate, ns.batch_size
    layers = _arg(ns.script_args, "--layers", 2)
    source = FIXTURE.read_text(encoding="utf-8")
    freeze = ("tok", "pos", f"blocks.layers[:{max(1, layers // 2)}]")
    configs = [
        ("original", {}, batch),
        (f"--accumulate {n}", {"backend": "torch", "accumulate": n}, batch // n),
        (f"--accumulate {n} --precision bf16-mixed", {"backend": "torch", "accumulate": n,
                                                      "precision": "bf16-mixed"}, batch // n),
        ("--freeze " + " --freeze ".join(freeze), {"backend": "torch", "freeze": freeze}, batch),
        ("--checkpointing blocks.layers", {"backend": "torch", "checkpointing": "blocks.layers"}, batch),
    ]
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if ns.run_on == "cpu" else {})}
    rows = measure(source, configs, ns.script_args, batch, ns.steps, env)
    print(f"\n{machine()}; transformer_lm {' '.join(ns.script_args)}; {ns.steps} optimizer steps\n")
    print(HEADER)
    print("\n".join(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
