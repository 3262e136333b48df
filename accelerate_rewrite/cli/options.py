"""The command line's shared parts: the rewrite's options (``fabric_options``), a verified run's
(``run_options``: ``verify`` and ``tune``), and the one-line error."""

from __future__ import annotations

import functools
from typing import NoReturn, Sequence

import click

from accelerate_rewrite.options import (
    ACCELERATORS,
    BACKENDS,
    GROUP_BY_LENGTH,
    MATMUL_PRECISIONS,
    PRECISION_ALIASES,
    PRECISIONS,
    STRATEGIES,
    OptionError,
)

CONTEXT_SETTINGS = {"help_option_names": ["-h", "--help"], "max_content_width": 100}


def _fail(message: str, code: int = 2) -> NoReturn:
    """A one-line error on stderr, then exit (2 by default, like a usage error)."""
    from rich.markup import escape

    from accelerate_rewrite.report import make_console

    make_console(stderr=True).print(f"[bold red]error[/]: {escape(message)}")
    raise click.exceptions.Exit(code)


def _choices(values: Sequence[str]):
    """Shell completion for an option whose values are checked by Options.create."""

    def complete(ctx, param, incomplete):
        return [v for v in values if v.startswith(incomplete)]

    return complete


def fabric_options(command):
    """The rewrite's options (--precision, --backend, --devices, ...), given to the command as one
    ``option_values`` dict, keyed as Options.create and the configuration name them."""
    @functools.wraps(command)
    def with_values(*args, **kwargs):
        from accelerate_rewrite.config import OPTION_KEYS

        return command(*args, option_values={k: kwargs.pop(k) for k in OPTION_KEYS}, **kwargs)

    wrapped = with_values
    for decorator in reversed([
        click.option(
            "--precision", metavar="VALUE", shell_complete=_choices([*PRECISIONS, *PRECISION_ALIASES]),
            help="Precision (Fabric's names): " + ", ".join(PRECISIONS)
            + " (or the aliases " + ", ".join(PRECISION_ALIASES) + ").",
        ),
        click.option(
            "--backend", metavar="fabric|torch|accelerate", shell_complete=_choices(BACKENDS),
            help="How to speed the script up: fabric (Lightning Fabric, the default), torch "
                 "(plain PyTorch: torch.autocast, torch.amp.GradScaler; one process) or accelerate "
                 "(Hugging Face Accelerate, from the same plan as fabric; one node).",
        ),
        click.option(
            "--devices", metavar="N|auto|0,1",
            help="Devices per node: a count, -1 for all, auto, or device indices such as 0,1.",
        ),
        click.option(
            "--strategy", metavar="NAME", shell_complete=_choices(STRATEGIES),
            help="Fabric strategy: " + ", ".join(STRATEGIES) + ".",
        ),
        click.option("--num-nodes", metavar="N", help="Number of nodes (a whole number >= 1)."),
        click.option(
            "--accelerator", metavar="NAME", shell_complete=_choices(ACCELERATORS),
            help="Fabric accelerator: " + ", ".join(ACCELERATORS) + ".",
        ),
        click.option(
            "--clip-grad-norm", metavar="X",
            help="Clip the gradients' norm to X before every optimizer step (AR301): "
                 "fabric.clip_gradients with Fabric, unscale_ first under a GradScaler.",
        ),
        click.option(
            "--accumulate", metavar="N",
            help="Accumulate the gradients of N micro-batches per optimizer step (AR302): the loss "
                 "is divided by N; step, zero_grad and a per-step scheduler run every N batches "
                 "and at the end of each epoch.",
        ),
        click.option(
            "--keep-effective-batch", is_flag=True,
            help="With --accumulate N: divide the DataLoader's batch_size by N, so that each "
                 "optimizer step sees as many samples as before.",
        ),
        click.option(
            "--shard-eval", is_flag=True,
            help="With several devices: shard the evaluation loaders too (faster evaluation) and "
                 "fabric.all_reduce the sums and counts the evaluation loop accumulates. Default: "
                 "every process evaluates the whole set (the script's figures, unchanged).",
        ),
        click.option(
            "--freeze", metavar="PATTERN", multiple=True,
            help="Don't train the parameters PATTERN names (AR303; repeatable): a module path "
                 "(encoder.layer.0), a slice (encoder.layer[:2]) or a glob (encoder.layer.[01].*).",
        ),
        click.option(
            "--checkpointing", metavar="TARGET",
            help="Activation checkpointing (AR401): recompute the activations of the blocks TARGET "
                 "names (a class name such as Block, or a module path such as encoder.layers) in "
                 "the backward; auto: a Hugging Face model's own gradient checkpointing.",
        ),
        click.option(
            "--optimizer-8bit", is_flag=True,
            help="Adam/AdamW become bitsandbytes' 8-bit optimizers (AR402; needs bitsandbytes): "
                 "optimizer state 2 bytes a parameter instead of 8; embeddings keep 32-bit state.",
        ),
        click.option(
            "--paged-optimizer", is_flag=True,
            help="With --optimizer-8bit: the paged variants (PagedAdamW8bit), whose state pages "
                 "out to CPU memory when the GPU runs short.",
        ),
        click.option(
            "--compile", is_flag=True,
            help="torch.compile the model (AR403): before fabric.setup with Fabric, model.compile() "
                 "in place without it.",
        ),
        click.option(
            "--dynamic-padding", is_flag=True,
            help="A dataset tokenized with padding=\"max_length\" into a TensorDataset: pad each "
                 "batch to its own longest sequence instead, in the DataLoader's collate_fn (AR502).",
        ),
        click.option(
            "--group-by-length", metavar="eval|all", shell_complete=_choices(GROUP_BY_LENGTH),
            help="With --dynamic-padding: batches of similar lengths (AR503); eval: evaluation "
                 "loaders, sorted by length; all: also training loaders (transformers' "
                 "LengthGroupedSampler, shuffled).",
        ),
        click.option(
            "--matmul-precision", metavar="high|medium", shell_complete=_choices(MATMUL_PRECISIONS),
            help="For scripts that stay in fp32: add torch.set_float32_matmul_precision(...) "
                 "(TF32 matmuls on Ampere and later GPUs).",
        ),
    ]):
        wrapped = decorator(wrapped)
    return wrapped


def _options(values: dict):
    """The command line's options alone, validated up front (a bad flag fails before any file)."""
    from accelerate_rewrite.options import Options

    try:
        return Options.create(**values)
    except OptionError as exc:
        _fail(str(exc))


def run_options(command):
    """The options of a verified run that ``verify`` and ``tune`` share: where it runs, for how
    long, the tolerances, the speed figure's warm-up, threads, the Python."""
    for decorator in reversed([
        click.option("--run-on", type=click.Choice(["auto", "cpu", "cuda"]), default="auto", show_default=True,
                     help="Where both runs go: auto (as the scripts choose), or force cpu (CUDA hidden; "
                          "Fabric's accelerator set to cpu) or cuda."),
        click.option("--timeout", type=click.FloatRange(min=1), default=600, show_default=True,
                     help="Seconds each run may take; then its whole process group is killed."),
        click.option("--rtol", type=float, default=1e-5, show_default=True,
                     help="Rewrites that keep the math: largest relative difference of any step."),
        click.option("--mean-rtol", type=float,
                     help="Mixed precision: largest mean relative difference of the losses [default: "
                          "--noise-multiple times the original's own under the precision, else 2e-2]."),
        click.option("--last-rtol", type=float,
                     help="Mixed precision: largest relative difference of the mean of the last 10% of steps "
                          "[default: measured, as --mean-rtol, else 3e-2]."),
        click.option("--grad-rtol", type=float,
                     help="Mixed precision: largest mean relative difference of the gradient norms "
                          "[default: measured, as --mean-rtol, else 1e-1]."),
        click.option("--noise-multiple", type=click.FloatRange(min=1), default=3.0, show_default=True,
                     help="16-mixed and bf16-mixed: how many times the difference the precision alone makes "
                          "to the original (run once more under it) the rewritten run may differ."),
        click.option("--warmup-steps", type=click.IntRange(min=0), metavar="N",
                     help="Steps left out of the speed figure [default: 10% of the steps, at least 1]."),
        click.option("--threads", type=click.IntRange(min=1), metavar="N",
                     help="torch.set_num_threads(N) in both runs."),
        click.option("--python", "python", metavar="PATH",
                     help="The Python to run the scripts with [default: this one]."),
    ]):
        command = decorator(command)
    return command


def _tolerance(rtol, mean_rtol, last_rtol, grad_rtol, noise_multiple, warmup_steps):
    """The verifier's tolerances: the approximate ones the user set are kept as set, the others
    are measured where a noise run can be made (``compare.measured``)."""
    from accelerate_rewrite.verify.compare import Tolerance

    given = {"mean_rel": mean_rtol, "last_rel": last_rtol, "grad_rel": grad_rtol}
    given = {k: v for k, v in given.items() if v is not None}
    return Tolerance(max_rel=rtol, warmup_steps=warmup_steps, noise_multiple=noise_multiple,
                     fixed=tuple(given), **given)
