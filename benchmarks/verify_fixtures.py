"""Verify every runnable fixture with the verifier and print a markdown table.

    .venv/bin/python benchmarks/verify_fixtures.py [--precision bf16-mixed ...] [--steps 50]
        [--backend fabric|torch ...] [--run-on cpu|cuda] [--threads N] [--fixture NAME ...]
        [-- SCRIPT ARGS]

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

from accelerate_rewrite.api import rewrite  # noqa: E402
from accelerate_rewrite.options import Options  # noqa: E402
from accelerate_rewrite.verify.session import VerifyError, verify  # noqa: E402


#: fixtures that download weights from the hub: rewritten in the tests, never run here
DOWNLOADS = {"hf_finetune"}

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


def _mib(value) -> str:
    return "-" if not value else f"{value / 2**20:.0f} MiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", action="append", default=None)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--run-on", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--fixture", action="append", default=None)
    parser.add_argument("--backend", action="append", default=None, choices=["fabric", "torch"])
    parser.add_argument("script_args", nargs="*", help="passed to every script (after --)")
    args = parser.parse_args()
    precisions = args.precision or ["32-true", "bf16-mixed"]
    backends = args.backend or ["fabric"]
    # the apex fixtures run with a stand-in for apex.amp, which is gone from current apex
    os.environ["PYTHONPATH"] = os.pathsep.join(
        filter(None, [str(ROOT / "tests" / "stubs"), os.environ.get("PYTHONPATH")]))
    names = args.fixture or sorted(
        p.parent.name for p in (ROOT / "fixtures").glob("*/input.py")
        if p.parent.name not in DOWNLOADS and rewrite(p.read_text(), Options()).changed
    )
    started = time.time()
    print(f"Machine: {machine()}. Steps: {args.steps}. Run on: {args.run_on or 'as the scripts choose'}.\n")
    print("| fixture | backend | precision | verdict | loss max rel | loss mean rel | grad-norm mean rel "
          "| speedup | memory ratio | peak memory (original, rewritten) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    import tempfile

    os.chdir(tempfile.mkdtemp(prefix="verify-fixtures-"))  # the fixtures write checkpoints into the cwd
    for name in names:
        for backend in backends:
            for precision in precisions:
                options = Options.create(precision=precision, backend=backend)
                try:
                    v = verify(ROOT / "fixtures" / name / "input.py", options, steps=args.steps,
                               run_on=args.run_on, threads=args.threads, script_args=args.script_args)
                except VerifyError as exc:  # e.g. the rewrite changes nothing at these options
                    why = str(exc).split(": ", 1)[-1].replace("|", "/")
                    print(f"| {name} | {backend} | {precision} | not verified: {why[:110]}... "
                          "| - | - | - | - | - | - |", flush=True)
                    continue
                c = v.verdict.comparison

                def f(key, fmt="{:.1e}"):
                    return fmt.format(c[key]) if c.get(key) is not None else "-"

                verdict = v.verdict.verdict if v.verdict.verdict == "pass" else \
                    f"{v.verdict.verdict}: {v.verdict.reason[:60]}..."
                peaks = f"{_mib(v.original.peak_memory_bytes)}, {_mib(v.rewritten.peak_memory_bytes)}"
                print(f"| {name} | {backend} | {precision} | {verdict} | {f('max_rel_diff')} | "
                      f"{f('mean_rel_diff')} | {f('mean_grad_norm_rel_diff')} | {f('speedup', '{:.2f}x')} | "
                      f"{f('memory_ratio', '{:.2f}x')} | {peaks} |", flush=True)
    print(f"\n({time.time() - started:.0f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
