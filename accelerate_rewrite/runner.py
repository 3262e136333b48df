"""One run of the rewrite over files: collect them, prepare each (prepare.py, through the
cache, in a pool of workers with -j), show or write the results, report (report.py), exit code.

The click layer (cli/) only parses the command line into ``Settings`` and calls ``run``.
Nothing here imports torch or lightning.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Optional, Sequence

from accelerate_rewrite.codemod.files.diff import render_diff, unified_diff
from accelerate_rewrite.codemod.files.paths import Target, collect
from accelerate_rewrite.plan import Joint, plan, projects
from accelerate_rewrite.prepare import Prepared, rewrite_notebook, rewrite_text
from accelerate_rewrite.report import Outcome, Reporter, Tally, summary_table, exit_code, record
from accelerate_rewrite.settings import Mode, Settings

if TYPE_CHECKING:
    from rich.console import Console

def finish(prepared: Prepared, settings: Settings, report: Reporter) -> list[Outcome]:
    """Show, write and report one prepared file, and the project's modules rewritten with it
    (written with it as one: all or none)."""
    from accelerate_rewrite.codemod.files.source import SourceError, write_atomic, write_atomic_set

    path = prepared.target.path
    outcome = Outcome(path, error=prepared.error, result=prepared.result, options=prepared.options,
                      where=prepared.where)
    if outcome.error is not None:
        report.error(outcome.error)
        return [outcome]
    if prepared.excluded:
        outcome.status = "excluded by the configuration"
        return [outcome]
    result, source, data = prepared.result, prepared.source, prepared.data
    assert result is not None and source is not None
    outcome.changed = result.changed
    # the modules that change, or that a rule says something of (the others were only read)
    members = [Outcome(Path(m.path), changed=m.changed, result=m, options=prepared.options)
               for m in result.members if m.changed or m.notes]

    if settings.shows_diff and result.changed:
        diff = prepared.diff if prepared.diff is not None else unified_diff(str(path), result.source, result.output)
        render_diff(report.out, diff)
    if settings.shows_diff:
        for member in result.members:
            if member.changed:
                render_diff(report.out, unified_diff(member.path, member.source, member.output))

    status = "would be rewritten" if result.changed else "left unchanged"
    for member in members:
        member.status = "would be rewritten" if member.changed else "left unchanged"
    try:
        writes = [(Path(m.path), d, f.raw) for m, (f, d) in zip(result.members, prepared.members) if d is not None]
        joint = prepared.joint
        if settings.mode is Mode.WRITE and isinstance(joint, Joint):
            # files that other scripts of the run change too: written with theirs, as one
            if not joint.written and joint.error is None:
                try:
                    write_atomic_set(list(joint.writes.values()))
                    joint.written = True
                except SourceError as exc:
                    joint.error = str(exc)
            if joint.error is not None:
                raise SourceError(joint.error)
            status = "rewritten" if data is not None else status
            for member in members:
                member.status = "rewritten" if member.changed else member.status
        elif settings.mode is Mode.WRITE and writes:
            write_atomic_set(([(path, data, source.raw)] if data is not None else []) + writes)
            status = "rewritten" if data is not None else status
            for member in members:
                member.status = "rewritten" if member.changed else member.status
        elif settings.mode is Mode.WRITE and data is not None:
            write_atomic(path, data, expected=source.raw)
            status = "rewritten"
        elif settings.mode is Mode.OUTPUT:
            assert data is not None and settings.output is not None
            if settings.output == "-":
                report._flush_out()
                report.out_file.write(result.output)
                report.out_file.flush()
            else:
                out = Path(settings.output)
                same = os.path.realpath(out) == os.path.realpath(path)
                write_atomic(out, data, expected=source.raw if same else None)
            where = "stdout" if settings.output == "-" else settings.output
            status = f"{'rewritten' if result.changed else 'unchanged'}, written to {where}"
    except SourceError as exc:
        outcome.error = str(exc)
        report.error(outcome.error)
        for member in members:
            member.changed, member.status = False, "not written"
        return [outcome, *members]
    outcome.status = status

    if settings.mode is Mode.CHECK:
        for one in (outcome, *members):
            if one.changed:
                report.would_rewrite(one.path)
    else:
        report.summary(path, result, status, outcome.options or settings.options, prepared.where)
        for member in members:
            also = [str(p) for p in prepared.also.get(os.path.realpath(member.path), [])]
            report.summary(member.path, member.result, member.status + f" (with {' and '.join([str(path), *also])})",
                           outcome.options or settings.options, script=path)
    return [outcome, *members]


def default_jobs() -> int:
    """The cores this process may run on (its affinity, where the system says), as ruff and
    black default to."""
    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def run(
    paths: Sequence[str],
    settings: Settings,
    *,
    out: Optional["Console"] = None,
    err: Optional["Console"] = None,
) -> int:
    """Process every file under ``paths``; return the exit code (2 error, 1 check, 0).

    Files are read and rewritten in parallel (as many processes as cores, or ``jobs``), then
    shown, written and reported in the order given."""
    import json

    from accelerate_rewrite.cache import answer
    from accelerate_rewrite.cache import prepare as prepare_cached  # prepare, through the cache

    report = Reporter(settings, out, err)
    tally = Tally()
    targets = collect(paths, force_exclude=settings.force_exclude)
    jobs = settings.jobs if settings.jobs is not None else default_jobs()
    jobs = max(1, min(jobs, len(targets)))
    show_progress = (settings.output_format == "text" and not settings.quiet and len(targets) > 1
                     and report.err.is_terminal)

    def handle(prepared: Prepared) -> None:
        for outcome in finish(prepared, settings, report):
            tally.outcomes.append(outcome)
            if settings.output_format == "json":
                report.out_file.write(json.dumps(record(outcome)) + "\n")
                report.out_file.flush()

    scopes, claimed = projects(targets, settings)
    first = [t for t in targets if t.path not in claimed]

    def prepared_of(batch: list[Target]):
        """Each target's Prepared, in order: with processes, what the cache answers is answered
        here first, and only the rest goes to them."""
        known = {} if jobs == 1 else {
            i: p for i, t in enumerate(batch) if (p := answer(t, settings)) is not None}
        done = rewritten([t for i, t in enumerate(batch) if i not in known])
        for i in range(len(batch)):
            yield known[i] if i in known else next(done)

    def rewritten(batch: list[Target]):
        if jobs == 1 or len(batch) < 2:
            for target in batch:
                yield prepare_cached(target, settings, scopes.get(target.path))
            return
        from concurrent.futures import ProcessPoolExecutor

        try:
            pool = ProcessPoolExecutor(max_workers=jobs)
        except (OSError, ImportError, NotImplementedError):  # no processes here: one at a time
            for target in batch:
                yield prepare_cached(target, settings, scopes.get(target.path))
            return
        with pool:
            yield from pool.map(prepare_cached, batch, [settings] * len(batch),
                                [scopes.get(t.path) for t in batch], chunksize=max(1, len(batch) // (4 * jobs)))

    def all_prepared():
        # scripts first; then the modules a script given imports that were not rewritten with
        # it (not followed: codemod/project/program.py says why), on their own
        covered: set[str] = set()
        drivers = list(prepared_of(first))
        if len(drivers) > 1:
            drivers = plan(drivers, scopes, settings, lambda t, scope: prepare_cached(t, settings, scope))
        for prepared in drivers:
            if prepared.result is not None:
                covered.update(os.path.realpath(m.path) for m in prepared.result.members)
            yield prepared
        yield from prepared_of([t for t in targets if t.path in claimed
                                and os.path.realpath(t.path) not in covered])

    if show_progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        with Progress(TextColumn("rewriting"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      console=report.err, transient=True) as progress:
            task = progress.add_task("files", total=len(targets))
            for prepared in all_prepared():
                handle(prepared)
                progress.advance(task)
    else:
        for prepared in all_prepared():
            handle(prepared)
    if settings.output_format == "text" and not settings.quiet and len(tally.outcomes) > 1 \
            and settings.mode is not Mode.CHECK:
        summary_table(tally, report)
    report.final(tally)
    return exit_code(tally, settings.mode)


def run_stdin(
    settings: Settings,
    filename: Optional[str],
    *,
    stdin: Optional[BinaryIO] = None,
    stdout: Optional[BinaryIO] = None,
    err: Optional["Console"] = None,
) -> int:
    """``accelerate-rewrite -``: the source from stdin; the result (or with ``--diff``, the diff)
    to stdout, the summary to stderr, as black and ruff do. ``filename`` (``--stdin-filename``)
    names it for the configuration (its options, excludes) and in messages. Excluded by the
    configuration, or with nothing to change, the input goes back as it came. ``--check`` writes
    nothing but the diff, if asked, and exits 1 when the source would change."""
    from accelerate_rewrite.api import RewriteError
    from accelerate_rewrite.codemod.analysis.importers import Scope
    from accelerate_rewrite.codemod.files.source import SourceError, decode
    from accelerate_rewrite.config import ConfigError

    stdin = stdin if stdin is not None else sys.stdin.buffer
    stdout = stdout if stdout is not None else sys.stdout.buffer
    report = Reporter(settings, err=err)
    shown = Path(filename) if filename else Path("-")
    raw = stdin.read()
    try:
        choice = settings.choice_for(Path(filename) if filename else Path.cwd() / "stdin.py")
        source = decode(shown, raw)
        diff, where = None, None
        if choice.excluded:
            result = None
        elif shown.suffix == ".ipynb":
            result, diff, where = rewrite_notebook(source.text, str(shown), choice)
        else:
            result = rewrite_text(source.text, shown, choice, scope=Scope(
                alone="a script read from stdin comes back alone, on stdout (give the files' paths, with "
                      "--follow-imports)"))
    except (SourceError, RewriteError, ConfigError) as exc:
        report.error(str(exc))
        return 2
    changed = result is not None and result.changed
    if settings.diff and changed:
        stdout.write((diff if diff is not None else unified_diff(str(shown), result.source, result.output))
                     .encode("utf-8"))
    elif settings.mode is not Mode.CHECK:
        stdout.write(source.encode(result.output) if changed else raw)
    stdout.flush()
    if result is not None:
        status = ("would be rewritten" if settings.mode is Mode.CHECK else "rewritten") if changed \
            else "left unchanged"
        report.summary(shown, result, status, choice.options, where)
    return 1 if settings.mode is Mode.CHECK and changed else 0
