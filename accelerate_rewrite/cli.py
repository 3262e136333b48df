"""The command line: a thin click layer over accelerate_rewrite.runner.

    accelerate-rewrite PATH... [options]   the rewrite (the default command)
    accelerate-rewrite rules               the rules, one line each
    accelerate-rewrite explain CODE        a rule's documentation and example

A first argument that is not a command name runs the rewrite, so a file that happens to be
called ``rules`` is reached with ``accelerate-rewrite ./rules`` or ``accelerate-rewrite
rewrite rules``. Heavy imports (libcst, rich, the rules) happen inside the commands: ``--help``
stays fast, and torch / lightning are never imported.
"""

from __future__ import annotations

import functools
import os
from typing import NoReturn, Optional, Sequence

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

DEFAULT_COMMAND = "rewrite"
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


class DefaultGroup(click.Group):
    """A group that runs ``rewrite`` when the first argument is not one of its commands."""

    def parse_args(self, ctx: click.Context, args: list[str]) -> list[str]:
        own = set(ctx.help_option_names) | {"--version"}
        if args and args[0] not in self.commands and args[0] not in own:
            args = [DEFAULT_COMMAND, *args]
        return super().parse_args(ctx, args)

    def format_usage(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        formatter.write_usage(ctx.command_path, "[OPTIONS] PATH...")
        formatter.write_usage(ctx.command_path, "COMMAND [ARGS]...", prefix="   or: ")

    def format_options(self, ctx: click.Context, formatter: click.HelpFormatter) -> None:
        # the default command's options first, then the group's own (--version, --help)
        command = self.commands[DEFAULT_COMMAND]
        sub = click.Context(command, info_name=DEFAULT_COMMAND, parent=ctx)
        records: list[tuple[str, str]] = []
        for params, c in ((command.get_params(sub), sub), (self.get_params(ctx), ctx)):
            for param in params:
                record = param.get_help_record(c) if isinstance(param, click.Option) else None
                if record is not None and record not in records:
                    records.append(record)
        with formatter.section("Options"):
            formatter.write_dl(records)
        self.format_commands(ctx, formatter)


@click.group(
    cls=DefaultGroup,
    context_settings=CONTEXT_SETTINGS,
    invoke_without_command=False,
    no_args_is_help=True,
)
@click.version_option(package_name="accelerate-rewrite", prog_name="accelerate-rewrite")
def cli() -> None:
    """Rewrite plain PyTorch training scripts into faster ones: Lightning Fabric, or native
    mixed precision with --backend torch.

    PATH is a file or a folder (searched for *.py and *.ipynb, leaving out hidden folders,
    .venv, __pycache__, node_modules, build and dist); notebooks need the notebooks extra
    (pip install 'accelerate-rewrite[notebooks]'). By default the diff of each file that would
    change is printed and nothing is written; a summary of what each rule changed, and of
    every place left alone with the reason, follows on stderr.

    Exit status: 0 done; 1 with --check when a file would change; 2 on any error (the other
    files are still processed).
    """


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
            "--backend", metavar="fabric|torch", shell_complete=_choices(BACKENDS),
            help="How to speed the script up: fabric (Lightning Fabric, the default) or torch "
                 "(plain PyTorch: torch.autocast, torch.amp.GradScaler; one process).",
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

@cli.command(
    DEFAULT_COMMAND, context_settings=CONTEXT_SETTINGS,
    short_help="Rewrite files or folders (the default command).",
)
@click.argument("paths", nargs=-1, required=True, metavar="PATH...", type=click.Path())
@fabric_options
@click.option("--write", is_flag=True, help="Rewrite the files in place.")
@click.option(
    "-o", "--output", metavar="FILE",
    help="Write the result to FILE ('-' for stdout); one input file only.",
)
@click.option(
    "--check", is_flag=True,
    help="Write nothing; list the files that would change and exit 1 if any would.",
)
@click.option(
    "--diff", "show_diff", is_flag=True,
    help="Show the diff (the default without --write, -o or --check).",
)
@click.option("-q", "--quiet", is_flag=True, help="Print only diffs and errors.")
@click.option("--select", metavar="RULES", multiple=True,
              help="Apply only these rules: codes (AR201), prefixes (AR2), names, 'fixes' (the "
                   "migrations and bug fixes) or 'ALL'; comma-separated or repeated.")
@click.option("--ignore", metavar="RULES", multiple=True, help="Don't apply these rules (as --select).")
@click.option("--isolated", is_flag=True, help="Ignore [tool.accelerate-rewrite] in pyproject.toml files.")
@click.option("--pre-commit", "pre_commit", is_flag=True,
              help="Run as the pre-commit hook: rewrite in place, one line per changed file with "
                   "the rules that changed it (the whole summary with -v); without a `select` in "
                   "the configuration, apply the fixes only, with the torch backend.")
@click.option("-v", "--verbose", is_flag=True, help="With --pre-commit: the whole summary of each file.")
@click.option("--force-exclude", is_flag=True,
              help="Leave out files named on the command line that a .gitignore ignores, as in "
                   "folders (for pre-commit, which names every staged file).")
@click.option("--stdin-filename", metavar="PATH",
              help="With PATH '-' (the source on stdin): the file it stands for, for the "
                   "configuration (options, excludes) and in messages.")
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: one record per file on stdout (path, changed, rules, "
                                      "places left alone, errors), nothing else.")
@click.option("--follow-imports/--no-follow-imports", default=None,
              help="Whether a script's rewrite may change the project's own modules it imports "
                   "(engine.py, utils.py next to it) that are not among the PATHs given "
                   "[default: those whose changed names no other file under the script's folder "
                   "reads; never with -o or --pre-commit].")
@click.option("--launcher", type=click.Choice(["slurm"]),
              help="slurm: with --write or -o, also write SCRIPT.sbatch beside the result, a SLURM batch "
                   "file that runs it on --num-nodes nodes with --devices tasks each (srun; Fabric reads "
                   "SLURM's environment). One input file.")
@click.option("-j", "--jobs", type=click.IntRange(min=1), default=None, metavar="N",
              help="Processes to rewrite files with (the output keeps the order of the files) "
                   "[default: the number of cores].")
@click.option("--no-cache", is_flag=True, envvar="ACCELERATE_REWRITE_NO_CACHE",
              help="Rewrite every file, reading and writing no cached results "
                   "[env: ACCELERATE_REWRITE_NO_CACHE=1].")
@click.option("--cache-dir", metavar="PATH", envvar="ACCELERATE_REWRITE_CACHE_DIR",
              help="The folder of the cache of results (a file unchanged since a run with the same "
                   "options, rules, configuration and imported modules is not rewritten again) "
                   "[env: ACCELERATE_REWRITE_CACHE_DIR; default: the user cache folder, "
                   "~/.cache/accelerate-rewrite on Linux].")
def rewrite_command(
    paths: tuple[str, ...],
    option_values: dict,
    write: bool,
    output: Optional[str],
    check: bool,
    show_diff: bool,
    quiet: bool,
    select: tuple[str, ...],
    ignore: tuple[str, ...],
    isolated: bool,
    pre_commit: bool,
    verbose: bool,
    force_exclude: bool,
    stdin_filename: Optional[str],
    output_format: str,
    jobs: Optional[int],
    no_cache: bool,
    cache_dir: Optional[str],
    follow_imports: Optional[bool] = None,
    launcher: Optional[str] = None,
) -> None:
    """Rewrite PATH... (files or folders) into Lightning Fabric scripts (or, with --backend
    torch, plain PyTorch with native mixed precision).

    Without --write, -o or --check nothing is written: the diff goes to stdout (plain text
    that `git apply -p0` takes when piped), the summary to stderr.
    """
    from accelerate_rewrite.cache import chosen_dir
    from accelerate_rewrite.runner import run
    from accelerate_rewrite.settings import Mode, Settings

    options = _options(option_values)

    if check and (write or output is not None):
        _fail("--check writes nothing: it can't be combined with --write or -o/--output")
    if write and output is not None:
        _fail("--write and -o/--output can't be combined: pick in place or a new file")
    if output is not None:
        if len(paths) != 1 or os.path.isdir(paths[0]):
            _fail("-o/--output takes exactly one input file")
        if output == "-" and show_diff:
            _fail("-o - writes the result to stdout: it can't be combined with --diff")

    if check:
        mode = Mode.CHECK
    elif write:
        mode = Mode.WRITE
    elif output is not None:
        mode = Mode.OUTPUT
    else:
        mode = Mode.PREVIEW
    from accelerate_rewrite.config import FIXES, ConfigError, select_rules

    selectors = {}
    for name, raw in (("select", select), ("ignore", ignore)):
        items = tuple(part.strip() for value in raw for part in value.split(",") if part.strip())
        if items:
            try:
                select_rules(items)
            except ConfigError as exc:
                _fail(f"--{name}: {exc}")
            selectors[name] = items
    if pre_commit:
        if check or output is not None:
            _fail("--pre-commit rewrites in place: it can't be combined with --check or -o")
        mode, quiet = Mode.WRITE, not verbose
    cli_values = {**option_values, **selectors}
    defaults = {"select": (FIXES,), "backend": "torch"} if pre_commit else {}
    settings = Settings(mode=mode, options=options, diff=show_diff, quiet=quiet, output=output,
                        cli_values=cli_values, defaults=defaults, isolated=isolated,
                        output_format=output_format, jobs=jobs, hook=pre_commit,
                        force_exclude=force_exclude, cache_dir=chosen_dir(no_cache, cache_dir),
                        follow_imports=follow_imports)
    if "-" in paths:
        if len(paths) != 1:
            _fail("'-' (the source on stdin) can't be combined with other paths")
        if mode in (Mode.WRITE, Mode.OUTPUT) or output_format != "text":
            _fail("'-' writes the result to stdout: it can't be combined with --write, -o, "
                  "--pre-commit or --format json")
        from accelerate_rewrite.runner import run_stdin

        raise click.exceptions.Exit(run_stdin(settings, stdin_filename))
    if stdin_filename is not None:
        _fail("--stdin-filename goes with the path '-' (the source on stdin)")
    batch = _sbatch(launcher, paths, output, options, mode) if launcher else None
    code = run(paths, settings)
    if batch is not None and code == 0:
        _write_sbatch(*batch, write=mode in (Mode.WRITE, Mode.OUTPUT))
    raise click.exceptions.Exit(code)


def _sbatch(launcher: str, paths, output: Optional[str], options, mode):
    """(the batch file's path, its text) for --launcher slurm, checked before anything is rewritten."""
    from pathlib import Path

    from accelerate_rewrite.launch import sbatch_path, sbatch_text

    if len(paths) != 1 or os.path.isdir(paths[0]) or output == "-":
        _fail("--launcher slurm writes the batch file of one script: give one input file (and not -o -)")
    target = Path(output if output is not None else paths[0])
    try:
        return sbatch_path(target), sbatch_text(target, options)
    except ValueError as exc:
        _fail(str(exc))


def _write_sbatch(path, text: str, write: bool) -> None:
    from accelerate_rewrite.codemod.source import write_atomic
    from accelerate_rewrite.launch import SBATCH_MARK
    from accelerate_rewrite.report import make_console

    err = make_console(stderr=True)
    if not write:
        err.print(f"would write {path} (SLURM batch file; with --write or -o)", markup=False)
        return
    if path.exists():
        old = path.read_bytes()
        if old == text.encode():
            return
        lines = old.decode("utf-8", errors="replace").splitlines()
        if len(lines) < 2 or lines[1] != SBATCH_MARK:
            err.print(f"{path}: exists and was not written by accelerate-rewrite: left alone", markup=False)
            return
    write_atomic(path, text.encode())
    err.print(f"wrote {path} (sbatch {path.name} submits it)", markup=False)


@cli.command("rules", context_settings=CONTEXT_SETTINGS)
def rules_command() -> None:
    """List the rules: code, name, kind and what each does."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    from accelerate_rewrite.rules import ALL_RULES
    from accelerate_rewrite.report import make_console

    rows = [(rule.code, rule.name, rule.kind.value, rule.summary()) for rule in ALL_RULES]
    hint = ("Run `accelerate-rewrite explain CODE` for a rule's documentation, its example and the "
            "rules it relies on.")
    console = make_console()
    if not console.is_terminal:  # piped: plain aligned text, one rule per line, for grep
        header = ("CODE", "NAME", "KIND", "WHAT IT DOES")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        for row in [header, *rows]:
            console.file.write("  ".join(c.ljust(w) for c, w in zip(row, widths)))
            console.file.write("  " + row[3] + "\n")
        console.file.write("\n" + hint + "\n")
        return
    colours = {"safe": "green", "approximate": "yellow", "changes-training": "red"}
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("Code", style="bold cyan", no_wrap=True)
    table.add_column("Name", no_wrap=True)
    table.add_column("Kind", no_wrap=True)
    table.add_column("What it does")
    for code, name, kind, what in rows:
        table.add_row(code, name, f"[{colours.get(kind, 'default')}]{kind}[/]", escape(what))
    console.print(table, soft_wrap=False)
    console.print(hint, markup=False)


@cli.command("explain", context_settings=CONTEXT_SETTINGS)
@click.argument("code", metavar="CODE")
def explain_command(code: str) -> None:
    """Show a rule's documentation and its before/after example(s): its section of docs/rules.md.
    CODE: AR106 or a name."""
    from accelerate_rewrite.codemod.diff import colour_wanted
    from accelerate_rewrite.report import make_console
    from accelerate_rewrite.rules import ALL_RULES, find
    from accelerate_rewrite.rules.reference import section

    rule = find(code)
    if rule is None:
        known = ", ".join(f"{r.code} ({r.name})" for r in ALL_RULES)
        _fail(f"unknown rule {code!r}; known rules: {known}")
    console = make_console()
    text = section(rule)
    if colour_wanted(console):
        from rich.markdown import Markdown

        console.print(Markdown(text, code_theme="ansi_dark"), soft_wrap=False)
    else:  # piped: the Markdown itself
        console.file.write(text)


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


@cli.command(
    "verify", context_settings=CONTEXT_SETTINGS,
    short_help="Run the original and the rewritten script side by side, and compare.",
)
@click.argument("script", type=click.Path(dir_okay=False))
@fabric_options
@click.option("--against", type=click.Path(dir_okay=False), metavar="FILE",
              help="Compare with this already rewritten file instead of rewriting SCRIPT.")
@click.option("--steps", type=click.IntRange(min=1), default=50, show_default=True,
              help="Stop each run after this many optimizer steps.")
@click.option("--run-devices", type=click.IntRange(min=1), metavar="N",
              help="Run the rewritten script on N devices (e.g. 2 CPU processes with gloo).")
@run_options
@click.option("--json", "json_path", type=click.Path(dir_okay=False), metavar="PATH",
              help="Write the verdict and both runs' records as JSON.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), metavar="PATH.png",
              help="Plot both loss curves and the per-step relative difference (needs matplotlib).")
@click.option("-q", "--quiet", is_flag=True, help="No progress display and no table: the verdict only.")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT ARGS...]")
def verify_command(script, option_values, against, steps,
                   run_on, run_devices, timeout, rtol, mean_rtol, last_rtol, grad_rtol, noise_multiple,
                   warmup_steps, threads, python, json_path, plot_path, quiet, script_args) -> None:
    """Rewrite SCRIPT with the given options (or take --against FILE), run both with the same
    arguments and seeds, stop each after --steps optimizer steps, and compare the losses.

    Exit status: 0 PASS: parity measured (or a --freeze / --clip-grad-norm claim checked);
    1 FAIL: a mismatch, or the rewritten script crashed where the original ran; 2 ERROR: the
    original failed or timed out, or bad input; 2 NOT VERIFIED: this machine can't run what the
    options need (CUDA, transformer_engine, bitsandbytes), the precision asked for left no trace
    in the training steps, or a strategy was substituted (fsdp run as ddp on the CPU);
    3 NOT COMPARED: the rewrite changes training on purpose (more processes, --accumulate
    without --keep-effective-batch) and the curves differ; 4 DATA ORDER CHANGED (distributed
    sampler): a DistributedSampler (ddp on one device) draws the batches in another order.
    """
    import sys
    from pathlib import Path

    from rich.markup import escape

    from accelerate_rewrite.report import make_console
    from accelerate_rewrite.verify.session import VerifyError, verify

    _options(option_values)
    # the script's [tool.accelerate-rewrite] configuration applies as to a rewrite; flags win
    from accelerate_rewrite.config import ConfigError, choose

    try:
        choice = choose(Path(script), option_values)
    except ConfigError as exc:
        _fail(str(exc))
    options = choice.options
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib: pip install 'accelerate-rewrite[plot]'")
    console = make_console(stderr=True)
    status = None if quiet else console.status("starting", spinner="dots")
    labels = {"original": f"running the original {script}", "rewritten": "running the rewritten script",
              "structure": "running the rewritten script at 32-true (its structure)",
              "noise": "running the original under the rewritten run's precision (its own effect)"}

    def on_start(label: str) -> None:
        if status is not None:
            status.update(labels[label] + f" (up to {steps} steps)")

    try:
        if status is not None:
            status.start()
        try:
            result = verify(
                Path(script), options, script_args=script_args,
                against=Path(against) if against else None, steps=steps,
                run_on=None if run_on == "auto" else run_on, run_devices=run_devices,
                timeout=timeout, python=python or sys.executable, threads=threads,
                tolerance=_tolerance(rtol, mean_rtol, last_rtol, grad_rtol, noise_multiple, warmup_steps),
                on_start=on_start, rules=choice.rules,
            )
        finally:
            if status is not None:
                status.stop()
    except VerifyError as exc:
        _fail(str(exc))
    from accelerate_rewrite.verify import report

    out = make_console()
    if quiet:
        style = report.STYLE[result.verdict.verdict]
        out.print(f"[{style}]{result.verdict.label}[/]: {escape(result.verdict.reason)}")
        for warning in report.warnings(result):
            out.print(f"[yellow]warning:[/] {escape(warning)}")
    else:
        report.render(out, result)
    if json_path:
        report.write_json(Path(json_path), result)
    if plot_path:
        report.write_plot(Path(plot_path), result)
    raise click.exceptions.Exit(result.verdict.exit_code)


@click.command(context_settings={"help_option_names": []}, add_help_option=False)
@fabric_options
def _try_options(option_values: dict) -> dict:
    """Parses one --try "OPTIONS" of ``tune`` as the rewrite's own flags."""
    return option_values


@cli.command(
    "tune", context_settings=CONTEXT_SETTINGS,
    short_help="Measure which technique speeds this script up, and recommend the fastest that passes.",
)
@click.argument("script", type=click.Path(dir_okay=False))
@click.option("--try", "tries", metavar='"OPTIONS"', multiple=True,
              help='A candidate of your own, as the rewrite\'s flags in one string (repeatable): '
                   '--try "--precision bf16-mixed --checkpointing Block". Default: a set for this '
                   "machine (CPU: 32-true, bf16-mixed, bf16-mixed --compile; CUDA: also 32-true with "
                   "--matmul-precision high, 16-mixed, --optimizer-8bit where bitsandbytes is installed).")
@click.option("--against", "against_files", metavar="FILE", multiple=True, type=click.Path(dir_okay=False),
              help="A rewritten file of your own as a candidate, run as it is (repeatable).")
@click.option("--steps", type=click.IntRange(min=2), default=30, show_default=True,
              help="Stop each run after this many optimizer steps.")
@click.option("--repeat", type=click.IntRange(min=1), default=1, show_default=True, metavar="K",
              help="Run each candidate K times (the original once) and show the spread of the step times.")
@click.option("--min-speedup", type=click.FloatRange(min=1), default=1.05, show_default=True,
              help="Recommend a candidate only when it is at least this many times as fast as the original.")
@run_options
@click.option("--format", "output_format", type=click.Choice(["text", "json"]), default="text",
              show_default=True, help="json: the table and the recommendation as one JSON object on stdout.")
@click.option("--plot", "plot_path", type=click.Path(dir_okay=False), metavar="PATH.png",
              help="Speed-up and memory bars per candidate, the verdict marked (needs matplotlib).")
@click.option("-q", "--quiet", is_flag=True, help="No progress display.")
@click.argument("script_args", nargs=-1, type=click.UNPROCESSED, metavar="[-- SCRIPT ARGS...]")
def tune_command(script, tries, against_files, steps, repeat, min_speedup, run_on, timeout, rtol, mean_rtol,
                 last_rtol, grad_rtol, noise_multiple, warmup_steps, threads, python, output_format, plot_path,
                 quiet, script_args) -> None:
    """Run SCRIPT once, then each candidate rewrite of it through the verifier: its median step
    time after the warm-up, its peak memory and its parity verdict (as `verify` gives it), in a
    table sorted by speed-up; recommend the fastest candidate that PASSed, with the command that
    applies it. A candidate that crashed, failed parity or can't run here is shown with why and
    is never recommended; every figure is measured.

    Exit status: 0 the candidates ran (with or without a recommendation); 2 bad input, or the
    original itself failed.
    """
    import json
    import shlex
    import sys
    from pathlib import Path

    from accelerate_rewrite.config import ConfigError, choose
    from accelerate_rewrite.report import make_console
    from accelerate_rewrite.verify import tune
    from accelerate_rewrite.verify.session import VerifyError

    path = Path(script)
    if not path.is_file():
        _fail(f"{script}: no such file")
    if plot_path is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _fail("--plot needs matplotlib: pip install 'accelerate-rewrite[plot]'")
    for file in against_files:
        if not Path(file).is_file():
            _fail(f"--against {file}: no such file")

    def options_for(candidate: tune.Candidate):
        values: dict = {}
        if candidate.flags:
            try:
                values = _try_options.main(list(candidate.flags), standalone_mode=False)
            except click.ClickException as exc:
                raise VerifyError(f"--try {shlex.join(candidate.flags)!r}: {exc.format_message()}") from None
        try:
            choice = choose(path, values)
        except ConfigError as exc:
            where = f"--try {shlex.join(candidate.flags)!r}: " if candidate.flags else ""
            raise VerifyError(f"{where}{exc}") from None
        return choice.options, choice.rules

    candidates = [tune.Candidate.parse(t) for t in tries] + [tune.Candidate(against=Path(f)) for f in against_files]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if run_on == "cpu" else None
    if not candidates:
        candidates = tune.default_candidates(tune.machine_for_tuning(python or sys.executable, env=env))
    for candidate in candidates:  # a bad --try fails before anything runs
        try:
            options_for(candidate)
        except VerifyError as exc:
            _fail(str(exc))
    console = make_console(stderr=True)
    status = None if quiet else console.status("starting", spinner="dots")
    words = {"original": "the original", "rewritten": "the rewrite", "structure": "its structure run (32-true)",
             "noise": "the original under the precision"}

    def on_start(label: str, run: str) -> None:
        if status is not None:
            status.update(f"{label}: running {words.get(run, run)} (up to {steps} steps)")

    if status is not None:
        status.start()
    try:
        result = tune.tune(
            path, candidates, options_for=options_for, script_args=script_args, steps=steps, repeat=repeat,
            run_on=None if run_on == "auto" else run_on, timeout=timeout, python=python, threads=threads,
            tolerance=_tolerance(rtol, mean_rtol, last_rtol, grad_rtol, noise_multiple, warmup_steps),
            min_speedup=min_speedup, on_start=on_start)
    finally:
        if status is not None:
            status.stop()
    if output_format == "json":
        click.echo(json.dumps(result.to_json(), indent=2))
    else:
        tune.render(make_console(), result)
    if plot_path:
        tune.write_plot(Path(plot_path), result)
    errors = [o for o in result.outcomes if o.verdict == "error"]
    if errors and len(errors) == len([o for o in result.outcomes if o.runs]):
        raise click.exceptions.Exit(2)  # the original itself failed: nothing was measured


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The console script (``accelerate-rewrite``) and ``python -m accelerate_rewrite``."""
    # click's standalone mode exits with the command's code, and handles a closed pipe
    cli.main(args=list(argv) if argv is not None else None, prog_name="accelerate-rewrite")


if __name__ == "__main__":  # pragma: no cover
    main()
