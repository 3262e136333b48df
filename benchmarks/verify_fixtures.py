"""Verify every runnable fixture with the verifier and print a markdown table.

    .venv/bin/python benchmarks/verify_fixtures.py [--precision bf16-mixed ...] [--steps 50]
        [--run-on cpu|cuda] [--threads N]

For each precision: verdict, loss differences (max / mean relative), gradient-norm difference,
speedup (median step time, original / rewritten, warm-up steps left out) and memory ratio
(original peak / rewritten peak: CUDA max allocated on a GPU, peak RSS on CPU), with the
machine it ran on. On a GPU this is the benchmark of docs/benchmarks.md's GPU section.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from accelerate_rewrite.codemod.engine import rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402
from accelerate_rewrite.verify.session import verify  # noqa: E402


def machine() -> str:
    cpu = "unknown CPU"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = ""
    try:
        import torch

        if torch.cuda.is_available():
            gpu = f", GPU {torch.cuda.get_device_name(0)}"
        version = f"torch {torch.__version__}"
    except ImportError:
        version = "no torch"
    return f"{cpu} ({os.cpu_count()} cores){gpu}; Python {platform.python_version()}, {version}"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", action="append", default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--run-on", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--fixture", action="append", default=None)
    args = parser.parse_args()
    precisions = args.precision or ["32-true", "bf16-mixed"]
    names = args.fixture or sorted(
        p.parent.name for p in (ROOT / "fixtures").glob("*/input.py")
        if rewrite(p.read_text(), Options()).changed
    )
    started = time.time()
    print(f"Machine: {machine()}. Steps: {args.steps}. Run on: {args.run_on or 'as the scripts choose'}.\n")
    print("| fixture | precision | verdict | loss max rel | loss mean rel | grad-norm mean rel | speedup | memory ratio |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    import tempfile

    os.chdir(tempfile.mkdtemp(prefix="verify-fixtures-"))  # the fixtures write checkpoints into the cwd
    for name in names:
        for precision in precisions:
            v = verify(ROOT / "fixtures" / name / "input.py", Options.create(precision=precision),
                       steps=args.steps, run_on=args.run_on, threads=args.threads)
            c = v.verdict.comparison

            def f(key, fmt="{:.1e}"):
                return fmt.format(c[key]) if c.get(key) is not None else "-"

            verdict = v.verdict.verdict if v.verdict.verdict == "pass" else f"{v.verdict.verdict}: {v.verdict.reason[:60]}..."
            print(f"| {name} | {precision} | {verdict} | {f('max_rel_diff')} | {f('mean_rel_diff')} | "
                  f"{f('mean_grad_norm_rel_diff')} | {f('speedup', '{:.2f}x')} | {f('memory_ratio', '{:.2f}x')} |",
                  flush=True)
    print(f"\n({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
