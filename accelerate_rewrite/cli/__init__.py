"""The command line: a thin click layer over accelerate_rewrite.runner.

    accelerate-rewrite PATH... [options]   the rewrite (the default command)
    accelerate-rewrite rules               the rules, one line each
    accelerate-rewrite explain CODE        a rule's documentation and example
    accelerate-rewrite verify SCRIPT       run the original and the rewrite, compare (cli/verify.py)
    accelerate-rewrite tune SCRIPT         which technique speeds the script up (cli/verify.py)

A first argument that is not a command name runs the rewrite, so a file that happens to be
called ``rules`` is reached with ``accelerate-rewrite ./rules`` or ``accelerate-rewrite
rewrite rules``. Heavy imports (libcst, rich, the rules) happen inside the commands: ``--help``
stays fast, and torch / lightning are never imported.
"""

from __future__ import annotations

import os
from typing import Optional, Sequence

import click

from accelerate_rewrite.cli.options import CONTEXT_SETTINGS, _fail, _options, fabric_options
from accelerate_rewrite.cli.verify import tune_command, verify_command

DEFAULT_COMMAND = "rewrite"


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
    """Rewrite plain PyTorch training scripts into faster ones: Lightning Fabric, Hugging Face
    Accelerate with --backend accelerate, or native mixed precision with --backend torch.

    PATH is a file or a folder (searched for *.py and *.ipynb, leaving out hidden folders,
    .venv, __pycache__, node_modules, build and dist); notebooks need the notebooks extra
    (pip install 'accelerate-rewrite[notebooks]'). By default the diff of each file that would
    change is printed and nothing is written; a summary of what each rule changed, and of
    every place left alone with the reason, follows on stderr.

    Exit status: 0 done; 1 with --check when a file would change; 2 on any error (the other
    files are still processed).
    """


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
                   "file that runs it on --num-nodes nodes with --devices processes each (Fabric: srun, a "
                   "task per device; --backend accelerate: a task per node running accelerate launch). "
                   "One input file.")
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
    accelerate, Hugging Face Accelerate's; with --backend torch, plain PyTorch with native mixed
    precision).

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
    from accelerate_rewrite.codemod.files.source import write_atomic
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
    from accelerate_rewrite.report import fits, make_console

    rows = [(rule.code, rule.name, rule.kind.value, rule.summary()) for rule in ALL_RULES]
    hint = ("Run `accelerate-rewrite explain CODE` for a rule's documentation, its example and the "
            "rules it relies on.")
    console = make_console()
    colours = {"safe": "green", "approximate": "yellow", "changes-training": "red"}
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    table.add_column("Code", style="bold cyan", no_wrap=True)
    table.add_column("Name", no_wrap=True)
    table.add_column("Kind", no_wrap=True)
    table.add_column("What it does", min_width=20)
    for code, name, kind, what in rows:
        table.add_row(code, name, f"[{colours.get(kind, 'default')}]{kind}[/]", escape(what))
    if not console.is_terminal or not fits(console, table):
        # piped or narrow: plain aligned text, one rule per line (code, name, kind), for grep
        header = ("CODE", "NAME", "KIND", "WHAT IT DOES")
        widths = [max(len(r[i]) for r in [header, *rows]) for i in range(3)]
        for row in [header, *rows]:
            console.file.write("  ".join(c.ljust(w) for c, w in zip(row, widths)))
            console.file.write("  " + row[3] + "\n")
        console.file.write("\n" + hint + "\n")
        return
    console.print(table, soft_wrap=False)
    console.print(hint, markup=False)


@cli.command("explain", context_settings=CONTEXT_SETTINGS)
@click.argument("code", metavar="CODE")
def explain_command(code: str) -> None:
    """Show a rule's documentation and its before/after example(s): its section of docs/rules.md.
    CODE: AR106 or a name."""
    from accelerate_rewrite.codemod.files.diff import colour_wanted
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


cli.add_command(verify_command)
cli.add_command(tune_command)


def main(argv: Optional[Sequence[str]] = None) -> None:
    """The command line: exits (SystemExit) with the command's status. A command is a process
    of its own: the cyclic garbage collector keeps the rewrite's thresholds to its end
    (codemod/collector.py), so that the trees a rewrite made are not gone through once more
    when it is done (a pass over every object still alive, a twentieth of a project's rewrite:
    docs/benchmarks.md)."""
    from accelerate_rewrite.codemod.collector import collect_less

    collect_less()
    # click's standalone mode exits with the command's code, and handles a closed pipe
    cli.main(args=list(argv) if argv is not None else None, prog_name="accelerate-rewrite")


def console() -> None:
    """The console script (``accelerate-rewrite``) and ``python -m accelerate_rewrite``: ``main``,
    then the process ends as ``sys.exit`` would (its output flushed, the ``atexit`` functions
    run) without the interpreter's teardown, which frees every object still alive one at a
    time: the trees the caches keep, three seconds after a 50k-line script's rewrite
    (docs/benchmarks.md)."""
    import atexit
    import sys

    try:
        main()
        code = 0
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            code = exc.code or 0
        else:  # ``sys.exit("message")``: the message, and status 1
            print(exc.code, file=sys.stderr)
            code = 1
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe: nothing more can reach it
            code = code or 1
    os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    console()
