"""``verify`` and ``tune``: the commands that run the scripts (torch and lightning, the verify
extra, are imported by the runs, never here)."""

from __future__ import annotations

import os

import click

from accelerate_rewrite.cli.options import (
    CONTEXT_SETTINGS,
    _fail,
    _options,
    _tolerance,
    fabric_options,
    run_options,
)



#: what the status line says while each run of a verification goes on (session.py's ``on_start``)
RUN_LABELS = {"original": "running the original", "rewritten": "running the rewritten script",
              "structure": "running the rewritten script at 32-true (its structure)",
              "noise": "running the original under the rewritten run's precision (its own effect)",
              "original, joined batches": "running the original on the batches the processes drew, joined",
              "original, reseeded": "running the original on those batches again, reseeded, another thread count"}
#: the same, in tune's line (a candidate's name comes first)
TUNE_WORDS = {"original": "the original", "rewritten": "the rewrite", "structure": "its structure run (32-true)",
              "noise": "the original under the precision",
              "original, joined batches": "the original on the processes' batches joined",
              "original, reseeded": "the original on them, reseeded"}


@click.command(
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
    labels = {**RUN_LABELS, "original": f"running the original {script}"}

    def on_start(label: str) -> None:
        if status is not None:
            status.update(labels.get(label, f"running the {label}") + f" (up to {steps} steps)")

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
    except KeyboardInterrupt:  # the run going on was ended (runner.py); exit as SIGINT's convention says
        click.echo("Aborted!", err=True)
        raise click.exceptions.Exit(130) from None
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


@click.command(
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
@click.option("--backend", type=click.Choice(["fabric", "torch", "accelerate"]), default=None,
              metavar="fabric|torch|accelerate",
              help="Spell every candidate in this backend (the default set, and each --try that names none); "
                   "with torch the default set has no 32-true candidate. [default: as each candidate says, "
                   "else the configuration's]")
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
def tune_command(script, tries, against_files, backend, steps, repeat, min_speedup, run_on, timeout, rtol, mean_rtol,
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

    candidates = [tune.with_backend(tune.Candidate.parse(t), backend) for t in tries] + [
        tune.Candidate(against=Path(f)) for f in against_files]
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": ""} if run_on == "cpu" else None
    if not candidates:
        candidates = tune.default_candidates(tune.machine_for_tuning(python or sys.executable, env=env), backend)
    for candidate in candidates:  # a bad --try fails before anything runs
        try:
            options_for(candidate)
        except VerifyError as exc:
            _fail(str(exc))
    console = make_console(stderr=True)
    status = None if quiet else console.status("starting", spinner="dots")
    words = TUNE_WORDS

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
    except KeyboardInterrupt:  # the run going on was ended (runner.py); exit as SIGINT's convention says
        click.echo("Aborted!", err=True)
        raise click.exceptions.Exit(130) from None
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
