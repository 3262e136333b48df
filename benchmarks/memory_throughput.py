"""What --checkpointing, --optimizer-8bit, --compile and --dynamic-padding buy: peak memory and
time per optimizer step.

    .venv/bin/python benchmarks/memory_throughput.py [--steps 30] [--run-on cpu|cuda]
        [--batch-size 64] [-- TRANSFORMER_LM ARGS]

On fixtures/transformer_lm (sizes from the arguments after ``--``), with the torch backend so
that only the rule measured changes the script: the original, `--checkpointing blocks.layers`
(AR401), `--optimizer-8bit` (AR402; needs bitsandbytes), both, and `--compile` (AR403; its
first steps compile, and are left out of the median with the other warm-up steps). On
fixtures/text_classification (reviews of 3 to 48 words, padded to --max-length): the original
and `--dynamic-padding` (AR502), alone and with `--group-by-length all` (AR503).

Prints markdown tables (peak memory: CUDA max allocated on a GPU, peak RSS on CPU; median time
per optimizer step) with the machine, for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.accumulate_freeze import HEADER, measure  # noqa: E402
from benchmarks.verify_fixtures import machine  # noqa: E402

LM = ROOT / "fixtures" / "transformer_lm" / "input.py"
TEXT = ROOT / "fixtures" / "text_classification" / "input.py"


def optimizer_state(d_model: int, layers: int, heads: int, vocab: int = 256, seq_len: int = 64) -> str:
    """The bytes of optimizer state after one step of transformer_lm's TinyGPT: torch's AdamW,
    and AR402's AdamW8bit with the embeddings registered for 32-bit state (as the rewrite does)."""
    import runpy

    import torch

    try:
        import bitsandbytes as bnb
    except ImportError:
        return "(bitsandbytes is not installed: no optimizer-state figures)"
    tiny = runpy.run_path(str(LM), run_name="benchmark")["TinyGPT"]

    def after_one_step(make) -> tuple[int, int]:
        torch.manual_seed(0)
        model = tiny(vocab, d_model, heads, layers, seq_len)
        optimizer = make(model)
        model(torch.randint(0, vocab, (2, seq_len))).float().mean().backward()
        optimizer.step()
        tensors = [t for state in optimizer.state.values() for t in state.values() if torch.is_tensor(t)]
        return sum(p.numel() for p in model.parameters()), sum(t.numel() * t.element_size() for t in tensors)

    def eight_bit(model):
        for module in model.modules():
            if isinstance(module, torch.nn.Embedding):
                bnb.optim.GlobalOptimManager.get_instance().register_module_override(
                    module, "weight", {"optim_bits": 32})
        return bnb.optim.AdamW8bit(model.parameters(), lr=1e-3)

    params, full = after_one_step(lambda model: torch.optim.AdamW(model.parameters(), lr=1e-3))
    _, small = after_one_step(eight_bit)
    return (f"TinyGPT d_model {d_model}, {layers} layers: {params / 1e6:.2f}M parameters; optimizer state "
            f"after one step: AdamW {full / 2**20:.1f} MiB, AdamW8bit {small / 2**20:.1f} MiB "
            f"({small / full:.0%})")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--run-on", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--text-batch-size", type=int, default=16)
    parser.add_argument("--max-length", type=int, default=64)
    parser.add_argument("script_args", nargs="*")
    ns = parser.parse_args()
    env = {**os.environ, **({"CUDA_VISIBLE_DEVICES": ""} if ns.run_on == "cpu" else {})}
    torch_ = {"backend": "torch"}
    lm_configs = [
        ("original", {}, ns.batch_size),
        ("--checkpointing blocks.layers", {**torch_, "checkpointing": "blocks.layers"}, ns.batch_size),
        ("--optimizer-8bit", {**torch_, "optimizer_8bit": True}, ns.batch_size),
        ("--checkpointing blocks.layers --optimizer-8bit",
         {**torch_, "checkpointing": "blocks.layers", "optimizer_8bit": True}, ns.batch_size),
        ("--compile", {**torch_, "compile": True}, ns.batch_size),
    ]
    lm_rows = measure(LM.read_text(encoding="utf-8"), lm_configs, ns.script_args, ns.batch_size, ns.steps, env)
    pad = {**torch_, "dynamic_padding": True}
    text_configs = [
        ("original", {}, ns.text_batch_size),
        ("--dynamic-padding", pad, ns.text_batch_size),
        ("--dynamic-padding --group-by-length all", {**pad, "group_by_length": "all"}, ns.text_batch_size),
    ]
    epochs = ns.steps * ns.text_batch_size // 128 + 2  # 128 training reviews
    text_args = ["--epochs", str(epochs), "--max-length", str(ns.max_length)]
    text_rows = measure(TEXT.read_text(encoding="utf-8"), text_configs, text_args, ns.text_batch_size,
                        ns.steps, env, samples_flag="")
    arg = dict(zip(ns.script_args[::2], ns.script_args[1::2]))
    state = optimizer_state(int(arg.get("--d-model", 64)), int(arg.get("--layers", 2)), int(arg.get("--heads", 4)),
                            seq_len=int(arg.get("--seq-len", 32)))
    print(f"\n{machine()}; {ns.steps} optimizer steps\n")
    print(state + "\n")
    print(f"transformer_lm {' '.join(ns.script_args)}\n")
    print(HEADER)
    print("\n".join(lm_rows))
    print(f"\ntext_classification {' '.join(text_args)}\n")
    print(HEADER)
    print("\n".join(text_rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
