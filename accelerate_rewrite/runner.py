"""One run of the rewrite over files: read, rewrite, show or write, report, exit code.

The click layer (cli.py) only parses the command line into ``Settings`` and calls ``run``.
Diffs (and ``-o -``) go to stdout; everything else (summaries, errors, the final count)
goes to stderr, so that ``accelerate-rewrite train.py > change.patch`` keeps a clean patch.
Nothing here imports torch or lightning.
"""

from __future__ import annotations

import enum
import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Optional, Sequence

from accelerate_rewrite.codemod.diff import render_diff, unified_diff
from accelerate_rewrite.codemod.files import Target, collect
from accelerate_rewrite.options import Options

if TYPE_CHECKING:
    from rich.console import Console

    from accelerate_rewrite.codemod.engine import Result
    from accelerate_rewrite.codemod.siblings import Scope
    from accelerate_rewrite.codemod.source import SourceFile
    from accelerate_rewrite.config import Choice

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
    options: Options  # the command line's options alone (validated up front)
    diff: bool = False  # show diffs even when the mode does not by default
    quiet: bool = False
    output: Optional[str] = None  # for Mode.OUTPUT
    #: the command line's raw values (option keys, select, ignore): merged over each file's
    #: [tool.accelerate-rewrite] configuration
    cli_values: dict = field(default_factory=dict)
    #: what applies below the configuration (the pre-commit hook: the fixes, torch backend)
    defaults: dict = field(default_factory=dict)
    isolated: bool = False  # no configuration files
    output_format: str = "text"  # or "json": one record per file on stdout
    jobs: Optional[int] = None  # processes; None: as many as there are cores (default_jobs)
    #: the pre-commit hook: quiet, but each changed file gets one line with the rules that
    #: changed it, as black and ruff say what they fixed
    hook: bool = False
    force_exclude: bool = False  # .gitignore applies to files named on the command line too
    #: the project's own modules a script imports may change with it even when not given:
    #: True (``--follow-imports``), False (``--no-follow-imports``: only the paths given), None
    #: (the configuration's ``follow-imports``, else those no other file imports: ``projects``)
    follow_imports: Optional[bool] = None
    #: the folder of the rewrite cache (accelerate_rewrite/cache.py); None: no cache
    cache_dir: Optional[Path] = None

    @property
    def shows_diff(self) -> bool:
        return self.output_format == "text" and (self.mode is Mode.PREVIEW or self.diff)

    def choice_for(self, path: Path) -> "Choice":
        from accelerate_rewrite.config import choose

        return choose(path, self.cli_values, defaults=self.defaults, isolated=self.isolated)


@dataclass
class Outcome:
    path: Path
    changed: bool = False
    error: Optional[str] = None
    result: Optional["Result"] = None
    options: Optional[Options] = None
    status: str = ""
    where: Optional[list] = None  # a notebook's program line -> (cell, line in cell)


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
    from accelerate_rewrite.codemod.result import Kind

    by_kind: dict[Kind, list[str]] = {}
    for note in result.changes:
        if note.rule == "AR101":  # the precision the written Fabric(...) sets, if any
            written = re.search(r'precision="([^"]+)"', note.message)
            if note.kind is Kind.APPROXIMATE and written:
                by_kind.setdefault(Kind.APPROXIMATE, []).insert(0, f"Fabric at {written.group(1)}")
            continue
        codes = by_kind.setdefault(note.kind_with(options), [])
        if note.rule not in codes:
            codes.append(note.rule)
    parts = []
    hand_ddp = any(n.rule == "AR111" for n in result.changes)
    if hand_ddp:  # the script ran on several processes already: each keeps its shard
        if options.devices is not None:
            parts.append(f"devices={options.devices} replaces the script's own world size: with another "
                         "number of processes, each one's shard of the data changes")
    elif options.fabric and options.many_devices and any(n.rule == "AR101" for n in result.changes):
        parts.append(f"devices={options.effective_devices}: with several processes each trains on "
                     "its shard of the training data, so a step sees N times the batch (the loss "
                     "curve changes); "
                     + ("evaluation loaders are sharded, their sums all-reduced (--shard-eval)"
                        if options.shard_eval else "evaluation loaders are not sharded"))
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

    def __init__(self, settings: Settings, out: Optional["Console"] = None,
                 err: Optional["Console"] = None) -> None:
        self.settings = settings
        self._out = out
        self._err = err

    @property
    def out(self) -> "Console":
        """stdout's console, made when first used: a run that prints nothing never loads rich."""
        if self._out is None:
            self._out = make_console()
        return self._out

    @property
    def err(self) -> "Console":
        if self._err is None:
            self._err = make_console(stderr=True)
        return self._err

    def _flush_out(self) -> None:
        try:
            self.out.file.flush()
        except (AttributeError, ValueError):
            pass

    @property
    def silent(self) -> bool:
        """No summaries: -q, or --format json (the records say it all)."""
        return self.settings.quiet or self.settings.output_format == "json"

    def error(self, message: str) -> None:
        from rich.markup import escape

        said = self.__dict__.setdefault("_said", set())
        if message in said:  # a bad configuration is said once, not once per file it governs
            return
        said.add(message)
        self._flush_out()
        self.err.print(f"[bold red]error[/]: {escape(one_line(message))}")

    def would_rewrite(self, path: Path) -> None:
        from rich.markup import escape

        if self.silent:
            return
        # with the diffs on stdout, keep stdout a clean patch
        console = self.err if self.settings.shows_diff else self.out
        console.print(f"Would rewrite: {escape(str(path))}")

    def summary(self, path: Path, result: "Result", status: str, options: Options,
                where: Optional[list] = None, script: Optional[Path] = None) -> None:
        """``script``: the script a module of its project changes with (its numerics are the
        script's: the two are one program)."""
        def at(line: int, sep: str = " ") -> str:  # "line 12", or a notebook's "cell 3:line 2"
            if where is not None and 1 <= line <= len(where):
                cell, in_cell = where[line - 1]
                return f"cell {cell}:line {in_cell}"
            return f"line {line}" if sep == " " else str(line)

        if self.silent:
            if self.settings.hook and self.settings.output_format == "text" and result.changed:
                from rich.markup import escape

                counts: dict[str, int] = {}
                for note in result.changes:
                    if note.rule.startswith("AR"):  # not the engine's notes (a comment gone)
                        counts[note.rule] = counts.get(note.rule, 0) + 1
                rules = ", ".join(f"{code} x{n}" if n > 1 else code for code, n in counts.items())
                self._flush_out()
                self.err.print(f"{escape(str(path))}: {escape(rules)}", soft_wrap=True)
            return
        if not (result.changed or result.skips or result.dropped):
            return
        from rich.markup import escape  # here: a run that says nothing never loads rich

        self._flush_out()
        shown = escape(str(path))
        p = self.err.print
        p(f"[bold]{shown}[/]: {escape(status)}")
        for note in result.changes:
            p(f"  [cyan]{note.rule}[/] {at(note.line)}: {escape(one_line(note.message))}")
        if result.changes:
            p("  numerics: " + escape(numerics(result, options) if script is None else
                                      f"as for {script} (the files change together, one program)"))
        if script is None and result.changes:
            from accelerate_rewrite.launch import launches, run_lines

            if launches(result, options):  # several processes: how to start them (issue 28.2)
                for line in run_lines(str(path), options):
                    p("  " + escape(line))
        if result.skips:
            p("  [yellow]left alone[/]:")
            for note in result.skips:
                p(f"    {shown}:{at(note.line, ':')}: [yellow]{note.rule}[/] {escape(one_line(note.message))}")
        if result.dropped:
            p("  [red]dropped[/]:")
            for line in result.dropped:
                p(f"    {escape(one_line(line))}")

    def final(self, tally: Tally) -> None:
        if self.silent:
            return
        self._flush_out()
        style = "bold red" if tally.errors else "bold"
        self.err.print(f"[{style}]{final_line(tally, self.settings.mode)}[/]")


@dataclass
class Prepared:
    """A file read and rewritten (the part of the work that runs in worker processes)."""

    target: Target
    error: Optional[str] = None
    result: Optional["Result"] = None
    source: Optional["SourceFile"] = None
    data: Optional[bytes] = None  # the bytes to write, when there is something to write
    options: Optional[Options] = None
    excluded: bool = False
    diff: Optional[str] = None  # a notebook's: per changed cell
    where: Optional[list] = None  # a notebook's: program line -> (cell, line in cell)
    #: the project's modules rewritten with the script (``result.members``, in order): each
    #: one's file as read and the bytes to write (None: nothing to write)
    members: list[tuple["SourceFile", Optional[bytes]]] = field(default_factory=list)


#: a file that contains none of these (case aside) is only checked for syntax, with Python's own
#: parser, not analysed: every rule needs a training step, an optimizer, AMP or a half cast
TRAINING_WORDS = ("backward", "optim", "amp", "autocast", "gradscaler", "half", "float16", "init_process_group")


def needs_analysis(text: str, options: Options, rules: Sequence = ()) -> bool:
    """Whether a rule could change the file, or say something of it: a training script, or
    one with a word a chosen rule looks for (AR204, with --matmul-precision, applies to any
    script that uses torch; AR501 to tokenizers; AR404 to DataLoaders)."""
    lowered = text.lower()
    words = TRAINING_WORDS + (("torch",) if options.matmul_precision else ())
    words += tuple(w for rule in rules for w in rule.words)
    return any(word in lowered for word in words)


def rewrite_text(text: str, path: Path, choice: "Choice", scope: Optional["Scope"] = None) -> "Result":
    """The rewrite of one script's text, or, when no chosen rule could change it or say
    anything of it (nor of the project's modules it imports), only a check of its syntax with
    Python's own parser (no analysis). ``scope``: which of those modules may change with it."""
    from accelerate_rewrite.codemod.engine import Result, RewriteError, rewrite

    if needs_analysis(text, choice.options, choice.rules) or (
            scope is not None and any(needs_analysis(t, choice.options, choice.rules)
                                      for t in _member_texts(path, text))):
        return rewrite(text, choice.options, path=str(path), rules=choice.rules, scope=scope)
    try:
        compile(text, str(path), "exec", dont_inherit=True, flags=0x400)  # ast only
    except SyntaxError as exc:
        raise RewriteError(f"{path}:{exc.lineno}:{exc.offset}: syntax error: {exc.msg}") from None
    return Result(path=str(path), source=text, output=text)


def _member_texts(path: Path, text: str) -> list[str]:
    from accelerate_rewrite.codemod.siblings import candidates

    def text_of(file: Path) -> Optional[str]:
        try:
            return file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    return [t for t in map(text_of, candidates(path, text, text_of)) if t is not None]


def prepare(target: Target, settings: Settings, scope: Optional["Scope"] = None) -> Prepared:
    """Read, choose the options and rules, rewrite, encode; every failure becomes an error
    message naming the file. ``scope``: the project's modules that may change with it."""
    from accelerate_rewrite.codemod.engine import RewriteError
    from accelerate_rewrite.codemod.source import SourceError, read_source
    from accelerate_rewrite.config import ConfigError

    path = target.path
    out = Prepared(target)
    if target.error is not None:
        out.error = target.error
        return out
    try:
        choice = settings.choice_for(path)
        out.options = choice.options
        if choice.excluded:
            out.excluded = True
            return out
        source = read_source(path)
        out.source = source
        if path.suffix == ".ipynb":
            return _prepare_notebook(out, source, choice, settings)
        result = rewrite_text(source.text, path, choice, scope)
        out.result = result
        if settings.mode is Mode.OUTPUT or (settings.mode is Mode.WRITE and result.changed):
            out.data = _encode(path, source, result.output)
        for member in result.members:
            file = read_source(Path(member.path))
            if file.text != member.source:
                raise SourceError(f"{member.path}: changed on disk while {path} was rewritten; nothing written")
            if member.changed and settings.mode is Mode.OUTPUT:
                raise SourceError(f"{path}: its rewrite changes {member.path} too, and -o writes one file: "
                                  "use --write, or --diff to see both")
            out.members.append((file, _encode(Path(member.path), file, member.output)
                                if settings.mode is Mode.WRITE and member.changed else None))
    except (SourceError, RewriteError, ConfigError) as exc:
        out.error = str(exc)
    except Exception as exc:  # a bug in the engine must not stop the other files
        out.error = f"{path}: internal error ({type(exc).__name__}: {exc}); file left as is"
    return out


def _encode(path: Path, source: "SourceFile", text: str) -> bytes:
    from accelerate_rewrite.codemod.source import SourceError

    try:
        return source.encode(text)
    except UnicodeEncodeError as exc:
        raise SourceError(
            f"{path}: the result can't be encoded as {source.encoding} ({exc.reason}); not written"
        ) from None


def _prepare_notebook(out: Prepared, source: "SourceFile", choice: "Choice", settings: Settings) -> Prepared:
    """A notebook: its code cells rewritten as one program and put back (codemod/notebook.py)."""
    out.result, out.diff, out.where = rewrite_notebook(source.text, str(out.target.path), choice)
    if settings.mode is Mode.OUTPUT or (settings.mode is Mode.WRITE and out.result.changed):
        out.data = source.encode(out.result.output)
    return out


def rewrite_notebook(text: str, path: str, choice: "Choice") -> tuple["Result", str, list]:
    """A notebook's rewrite (its ``output``: the notebook's new text), its diff (per changed
    cell), and its program line -> (cell, line in the cell)."""
    from dataclasses import replace

    from accelerate_rewrite.codemod import notebook
    from accelerate_rewrite.codemod.engine import RewriteError, rewrite
    from accelerate_rewrite.codemod.siblings import Scope

    try:
        program = notebook.read(text, path)
        try:
            result = rewrite(program.text, choice.options, path=path, rules=choice.rules,
                             scope=Scope(alone="a notebook is rewritten alone (only its cells change)"))
        except RewriteError as exc:  # a place in the joined cells: the cell and its line
            raise RewriteError(notebook.locate(str(exc), program, path)) from None
        nb, changed = notebook.write_back(program, result.output, path) if result.changed else (program.nb, {})
    except notebook.NotebookError as exc:
        raise RewriteError(str(exc)) from None
    # "on lines 50, 52" of the joined cells: "on cell 5:lines 18, 20"
    result.notes = [replace(n, message=notebook.relocate(n.message, program)) for n in result.notes]
    result.dropped = [notebook.relocate(line, program) for line in result.dropped]
    result.source, result.output = text, notebook.dumps(nb, text) if changed else text
    return result, notebook.cell_diffs(path, program, changed), program.lines


def finish(prepared: Prepared, settings: Settings, report: Reporter) -> list[Outcome]:
    """Show, write and report one prepared file, and the project's modules rewritten with it
    (written with it as one: all or none)."""
    from accelerate_rewrite.codemod.source import SourceError, write_atomic, write_atomic_set

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
        if settings.mode is Mode.WRITE and writes:
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
            report.summary(member.path, member.result, member.status + f" (with {path})",
                           outcome.options or settings.options, script=path)
    return [outcome, *members]


def exit_code(tally: Tally, mode: Mode) -> int:
    if tally.errors:
        return ERROR
    if mode is Mode.CHECK and tally.changed:
        return WOULD_CHANGE
    return OK


def record(outcome: Outcome) -> dict:
    """The ``--format json`` record of one file."""
    result = outcome.result
    notes = result.notes if result is not None else []
    options = outcome.options

    def cell(line: int) -> dict:
        where = outcome.where
        return {"cell": where[line - 1][0], "cell_line": where[line - 1][1]} \
            if where is not None and 1 <= line <= len(where) else {}
    return {
        "path": str(outcome.path),
        "status": outcome.status or ("error" if outcome.error else ""),
        "changed": outcome.changed,
        "rules": sorted({n.rule for n in notes if not n.skipped and n.rule.startswith("AR")}),
        "changes": [{"rule": n.rule, "line": n.line, **cell(n.line), "message": n.message,
                     "kind": n.kind_with(options).value if options is not None and n.rule.startswith("AR")
                     else None} for n in notes if not n.skipped],
        "left_alone": [{"rule": n.rule, "line": n.line, **cell(n.line), "message": n.message}
                       for n in notes if n.skipped],
        "dropped": list(result.dropped) if result is not None else [],
        "error": outcome.error,
    }


def _summary_table(tally: Tally, report: Reporter) -> None:
    """A table of the files that need a look: changed, left alone in places, or in error."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    rows = [o for o in tally.outcomes
            if o.error or o.changed or (o.result is not None and (o.result.skips or o.result.dropped))]
    if not rows:
        return
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in ("file", "status", "rules applied", "left alone", "dropped"):
        table.add_column(column, overflow="fold")
    for o in rows:
        r = o.result
        table.add_row(escape(str(o.path)), escape(o.status or "error"),
                      ", ".join(sorted({n.rule for n in r.changes if n.rule.startswith("AR")})) if r else "",
                      str(len(r.skips)) if r and r.skips else "", str(len(r.dropped)) if r and r.dropped else "")
    report._flush_out()
    report.err.print(table)


def projects(targets: Sequence[Target], settings: Settings) -> tuple[dict[Path, "Scope"], set[Path]]:
    """Which targets are scripts whose project's modules (codemod/project.py) are among the
    targets: each script's Scope (the targets may change with it, or any module with
    ``--follow-imports``, or by default any whose changed names no other file under the
    script's folder reads; a module that two scripts given import changes with neither), and the targets that
    a script given imports (rewritten with it, not on their own)."""
    from accelerate_rewrite.codemod.siblings import Scope, candidates

    python = [t for t in targets if t.error is None and t.path.suffix == ".py"]
    if not python:
        return {}, set()
    real = {os.path.realpath(t.path): t.path for t in targets}
    writable = frozenset(real)

    def text_of(file: Path) -> Optional[str]:
        try:
            return file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    imports: dict[Path, list[str]] = {}
    for target in python:
        text = text_of(target.path)
        if text is None or "import" not in text:
            continue
        files = [os.path.realpath(f) for f in candidates(target.path, text, text_of)]
        if files:
            imports[target.path] = files
    claimed = {real[f] for files in imports.values() for f in files if f in real}
    drivers = {path: files for path, files in imports.items() if path not in claimed}
    importers: dict[str, list[Path]] = {}
    for path, files in drivers.items():
        for f in files:
            importers.setdefault(f, []).append(path)
    scopes = {}
    for path, files in drivers.items():
        shared = tuple((f, " and ".join(str(p) for p in importers[f] if p != path))
                       for f in files if len(importers[f]) > 1)
        follow = settings.follow_imports
        if follow is None:
            try:
                follow = settings.choice_for(path).follow_imports
            except Exception:  # noqa: BLE001 - a bad configuration: prepare() reports it
                follow = None
        # not told either way: a module may change with the script when no other file under its
        # folder reads what changes; never for -o (one file written) or the hook (files staged)
        auto = follow is None and settings.mode is not Mode.OUTPUT and not settings.hook
        scopes[path] = Scope(writable=writable, follow=bool(follow), shared=shared, auto=auto,
                             root=os.path.commonpath([os.path.realpath(path.parent),
                                                      *(os.path.dirname(f) for f in files)]),
                             known=frozenset({os.path.realpath(path), *files}),
                             script=os.path.realpath(path))
    return scopes, claimed


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
                report.out.file.write(json.dumps(record(outcome)) + "\n")
                report.out.file.flush()

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
        # it (not followed: codemod/project.py says why), on their own
        covered: set[str] = set()
        for prepared in prepared_of(first):
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
        _summary_table(tally, report)
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
    from accelerate_rewrite.codemod.engine import RewriteError
    from accelerate_rewrite.codemod.siblings import Scope
    from accelerate_rewrite.codemod.source import SourceError, decode
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
