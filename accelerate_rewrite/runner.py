"""One run of the rewrite over files: read, rewrite, show or write, report, exit code.

The click layer (cli.py) only parses the command line into ``Settings`` and calls ``run``.
Diffs (and ``-o -``) go to stdout; everything else (summaries, errors, the final count)
goes to stderr, so that ``accelerate-rewrite train.py > change.patch`` keeps a clean patch.
Nothing here imports torch or lightning.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from accelerate_rewrite.codemod.diff import render_diff, unified_diff
from accelerate_rewrite.codemod.files import Target, collect
from accelerate_rewrite.options import Options

if TYPE_CHECKING:
    from rich.console import Console

    from accelerate_rewrite.codemod.engine import Result

#: exit codes
OK, WOULD_CHANGE, ERROR = 0, 1, 2


class Mode(enum.Enum):
    PREVIEW = "preview"  # show the diff, write nothing
    WRITE = "write"  # rewrite in place
    OUTPUT = "output"  # write the result to another file (or "-": stdout)
    CHECK = "check"  # write nothing; exit 1 when a file would change


@dataclass(frozen=True)
class Settings:
    mode: Mode
    options: Options
    diff: bool = False  # show diffs even when the mode does not by default
    quiet: bool = False
    output: Optional[str] = None  # for Mode.OUTPUT

    @property
    def shows_diff(self) -> bool:
        return self.mode is Mode.PREVIEW or self.diff


@dataclass
class Outcome:
    path: Path
    changed: bool = False
    error: Optional[str] = None


@dataclass
class Tally:
    outcomes: list[Outcome] = field(default_factory=list)

    @property
    def changed(self) -> int:
        return sum(1 for o in self.outcomes if o.error is None and o.changed)

    @property
    def unchanged(self) -> int:
        return sum(1 for o in self.outcomes if o.error is None and not o.changed)

    @property
    def errors(self) -> int:
        return sum(1 for o in self.outcomes if o.error is not None)


def make_console(*, stderr: bool = False) -> "Console":
    """A rich console that emits no ANSI codes when not on a terminal or with NO_COLOR.

    (Rich alone honours NO_COLOR for colours only: bold and underline would stay.) Lines are
    never wrapped by rich, so paths and messages stay whole when piped or grepped.
    """
    from rich.console import Console

    kwargs: dict = {"stderr": stderr, "highlight": False, "soft_wrap": True}
    if os.environ.get("NO_COLOR", "") != "":
        kwargs["color_system"] = None
    return Console(**kwargs)


def one_line(message: str) -> str:
    """Notes may quote multi-line code; a summary line must stay one line."""
    return " ".join(message.split())


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def numerics(result: "Result", options: Options) -> str:
    """What the applied rules do to the numbers, by their kinds, in one line (Fabric's own
    rules keep the math, but the precision they set on Fabric does not)."""
    from accelerate_rewrite.codemod.rule import Kind

    by_kind: dict[Kind, list[str]] = {}
    for note in result.changes:
        codes = by_kind.setdefault(note.kind_with(options), [])
        if note.rule not in codes:
            codes.append(note.rule)
    if options.mixed_or_low_precision and any(n.rule == "AR101" for n in result.changes):
        by_kind.setdefault(Kind.APPROXIMATE, []).insert(0, f"Fabric at {options.precision}")
    parts = []
    if Kind.CHANGES_TRAINING in by_kind:
        parts.append(f"changes training on purpose ({', '.join(by_kind[Kind.CHANGES_TRAINING])}): "
                     "the rewritten script is not expected to match the original step for step")
    if Kind.APPROXIMATE in by_kind:
        parts.append(f"approximate ({', '.join(by_kind[Kind.APPROXIMATE])}): the numbers change "
                     "within the precision's tolerance; `accelerate-rewrite verify` measures it")
    return "; ".join(parts) or "unchanged: the rewrite keeps the math"


def final_line(tally: Tally, mode: Mode) -> str:
    """ruff-style: "2 files would be rewritten, 1 left unchanged, 1 error"."""
    parts: list[str] = []
    verb = "rewritten" if mode in (Mode.WRITE, Mode.OUTPUT) else "would be rewritten"
    if tally.changed:
        parts.append(f"{plural(tally.changed, 'file')} {verb}")
    if tally.unchanged:
        parts.append(
            f"{tally.unchanged} left unchanged" if parts
            else f"{plural(tally.unchanged, 'file')} left unchanged"
        )
    if tally.errors:
        parts.append(plural(tally.errors, "error"))
    return ", ".join(parts) if parts else "No Python files found"


class Reporter:
    """Everything the user sees, besides the diff text itself."""

    def __init__(self, settings: Settings, out: "Console", err: "Console") -> None:
        self.settings = settings
        self.out = out
        self.err = err

    def _flush_out(self) -> None:
        try:
            self.out.file.flush()
        except (AttributeError, ValueError):
            pass

    def error(self, message: str) -> None:
        from rich.markup import escape

        self._flush_out()
        self.err.print(f"[bold red]error[/]: {escape(one_line(message))}")

    def would_rewrite(self, path: Path) -> None:
        from rich.markup import escape

        if self.settings.quiet:
            return
        # with the diffs on stdout, keep stdout a clean patch
        console = self.err if self.settings.shows_diff else self.out
        console.print(f"Would rewrite: {escape(str(path))}")

    def summary(self, path: Path, result: "Result", status: str) -> None:
        from rich.markup import escape

        if self.settings.quiet:
            return
        if not (result.changed or result.skips or result.dropped):
            return
        self._flush_out()
        shown = escape(str(path))
        p = self.err.print
        p(f"[bold]{shown}[/]: {escape(status)}")
        for note in result.changes:
            p(f"  [cyan]{note.rule}[/] line {note.line}: {escape(one_line(note.message))}")
        if result.changes:
            p(f"  numerics: {escape(numerics(result, self.settings.options))}")
        if result.skips:
            p("  [yellow]left alone[/]:")
            for note in result.skips:
                p(f"    {shown}:{note.line}: [yellow]{note.rule}[/] {escape(one_line(note.message))}")
        if result.dropped:
            p("  [red]dropped[/]:")
            for line in result.dropped:
                p(f"    {escape(one_line(line))}")

    def final(self, tally: Tally) -> None:
        if self.settings.quiet:
            return
        self._flush_out()
        style = "bold red" if tally.errors else "bold"
        self.err.print(f"[{style}]{final_line(tally, self.settings.mode)}[/]")


def process(target: Target, settings: Settings, report: Reporter) -> Outcome:
    """Rewrite one file; every failure becomes an error message naming the file."""
    from accelerate_rewrite.codemod.engine import RewriteError, rewrite
    from accelerate_rewrite.codemod.source import SourceError, read_source, write_atomic

    path = target.path
    outcome = Outcome(path)
    if target.error is not None:
        outcome.error = target.error
        report.error(outcome.error)
        return outcome
    try:
        source = read_source(path)
        result = rewrite(source.text, settings.options, path=str(path))
        outcome.changed = result.changed
        data = None
        if settings.mode is Mode.OUTPUT or (settings.mode is Mode.WRITE and result.changed):
            try:
                data = source.encode(result.output)
            except UnicodeEncodeError as exc:
                raise SourceError(
                    f"{path}: the result can't be encoded as {source.encoding} ({exc.reason}); "
                    "not written"
                ) from None
    except (SourceError, RewriteError) as exc:
        outcome.error = str(exc)
    except Exception as exc:  # a bug in the engine must not stop the other files
        outcome.error = f"{path}: internal error ({type(exc).__name__}: {exc}); file left as is"
    if outcome.error is not None:
        report.error(outcome.error)
        return outcome

    if settings.shows_diff and result.changed:
        render_diff(report.out, unified_diff(str(path), result.source, result.output))

    status = "would be rewritten" if result.changed else "left unchanged"
    try:
        if settings.mode is Mode.WRITE and data is not None:
            write_atomic(path, data, expected=source.raw)
            status = "rewritten"
        elif settings.mode is Mode.OUTPUT:
            assert data is not None and settings.output is not None
            if settings.output == "-":
                report._flush_out()
                report.out.file.write(result.output)
                report.out.file.flush()
            else:
                out = Path(settings.output)
                same = os.path.realpath(out) == os.path.realpath(path)
                write_atomic(out, data, expected=source.raw if same else None)
            where = "stdout" if settings.output == "-" else settings.output
            status = f"{'rewritten' if result.changed else 'unchanged'}, written to {where}"
    except SourceError as exc:
        outcome.error = str(exc)
        report.error(outcome.error)
        return outcome

    if settings.mode is Mode.CHECK:
        if result.changed:
            report.would_rewrite(path)
    else:
        report.summary(path, result, status)
    return outcome


def exit_code(tally: Tally, mode: Mode) -> int:
    if tally.errors:
        return ERROR
    if mode is Mode.CHECK and tally.changed:
        return WOULD_CHANGE
    return OK


def run(
    paths: Sequence[str],
    settings: Settings,
    *,
    out: Optional["Console"] = None,
    err: Optional["Console"] = None,
) -> int:
    """Process every file under ``paths``; return the exit code (2 error, 1 check, 0)."""
    report = Reporter(
        settings,
        out if out is not None else make_console(),
        err if err is not None else make_console(stderr=True),
    )
    tally = Tally()
    for target in collect(paths):
        tally.outcomes.append(process(target, settings, report))
    report.final(tally)
    return exit_code(tally, settings.mode)

