"""What a run of the rewrite says: the per-file summary (changes, numerics, how to launch,
places left alone), the diffs, the final count, the JSON records and the exit code. Diffs (and
``-o -``) go to stdout; everything else goes to stderr, so that ``accelerate-rewrite train.py >
change.patch`` keeps a clean patch."""

from __future__ import annotations

import os
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from accelerate_rewrite.options import Options
from accelerate_rewrite.settings import ERROR, OK, WOULD_CHANGE, Mode, Settings

if TYPE_CHECKING:
    from rich.console import Console

    from accelerate_rewrite.api import Result

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


def fits(console, table) -> bool:
    """Whether ``table`` shows at ``console``'s width with each row's first cell (a file, a
    candidate's options, a rule) on one line, which it then keeps unfolded. Piped, rich renders
    at 80 columns (or $COLUMNS); where it does not fit the callers print ``rows`` instead
    (issue 49), as pytest and ruff do."""
    from rich.measure import Measurement

    first = table.columns[0]
    wrap = first.no_wrap
    first.no_wrap = True  # kept where it fits: the first cells are then never folded
    # measured without the console's width, which a measurement is clamped to
    need = Measurement.get(console, console.options.update_width(1 << 16), table).minimum
    if need > console.width:
        first.no_wrap = wrap
        return False
    return True


def rows(console, header: list[str], lines: list[list[str]], title: Optional[str] = None) -> None:
    """A table as plain lines for a narrow or piped output: each row's first cell on a line of
    its own, the others under it, indented, each ``name: value`` (empty cells left out); markup
    in the cells is kept (a verdict's colour)."""
    if title:
        console.print(title, markup=False)
    for line in lines:
        console.print(line[0], markup=False)
        rest = [f"{name}: {value}" for name, value in zip(header[1:], line[1:]) if value not in ("", None)]
        if rest:
            console.print("    " + "  ".join(rest))


def one_line(message: str) -> str:
    """Notes may quote multi-line code; a summary line must stay one line."""
    return " ".join(message.split())


def plural(count: int, word: str) -> str:
    return f"{count} {word}{'' if count == 1 else 's'}"


def numerics(result: "Result", options: Options) -> str:
    """What the applied rules do to the numbers, by their kinds, in one line (Fabric's own
    rules keep the math, but the precision they set on Fabric does not)."""
    from accelerate_rewrite.codemod.result import Kind
    from accelerate_rewrite.rules.fabric._devices import NOT_IN_A_DATA_LOOP

    by_kind: dict[Kind, list[str]] = {}
    for note in result.changes:
        if note.rule == "AR101":  # the precision the written Fabric(...) sets, if any
            written = re.search(r'precision="([^"]+)"', note.message)
            if note.kind is Kind.APPROXIMATE and written:
                by_kind.setdefault(Kind.APPROXIMATE, []).insert(
                    0, f"{'Accelerate' if options.accelerate else 'Fabric'} at {written.group(1)}")
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
        # the training data is sharded only where a loader of it was set up (AR104): data made by
        # hand (a batchify of tensors) is each process's whole set
        by_hand = any(n.rule == "AR104" and n.skipped and NOT_IN_A_DATA_LOOP in n.message
                      for n in result.notes)
        if any(n.rule == "AR104" for n in result.changes) and not by_hand:
            parts.append(f"devices={options.effective_devices}: with several processes each trains on "
                         "its shard of the training data, so a step sees N times the batch (the loss "
                         "curve changes); "
                         + ("evaluation loaders are sharded, their sums all-reduced (--shard-eval)"
                            if options.shard_eval else "evaluation loaders are not sharded"))
        else:
            parts.append(f"devices={options.effective_devices}: no loader of the training data was set up "
                         "(AR104, left alone), so every process trains on the whole set it makes itself: "
                         "with the same seed, each makes the original's steps")
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
    def out_file(self):
        """stdout's file, as its console writes it (the console's own, where one is made or
        given): JSON records and ``-o -`` are written there without making a console, whose
        import (rich's) is a tenth of the start of a run."""
        return self._out.file if self._out is not None else sys.stdout

    @property
    def err(self) -> "Console":
        if self._err is None:
            self._err = make_console(stderr=True)
        return self._err

    def _flush_out(self) -> None:
        try:
            self.out_file.flush()
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
        lines: list[str] = []  # printed at once: a print each costs rich's rendering each
        p = lines.append
        p(f"[bold]{shown}[/]: {escape(status)}")
        for note in result.changes:
            p(f"  [cyan]{note.rule}[/] {at(note.line)}: {escape(one_line(note.message))}")
        if result.changes:
            p("  numerics: " + escape(numerics(result, options) if script is None else
                                      f"as for {script} (the files change together, one program)"))
        if script is None and result.changes:
            from accelerate_rewrite.launch import launches, run_lines

            if launches(result, options):  # several processes: how to start them (issue 28.2)
                written = self.settings.output if self.settings.mode is Mode.OUTPUT else None
                for line in run_lines(written if written not in (None, "-") else str(path), options):
                    p("  " + escape(line))
        if result.skips:
            p("  [yellow]left alone[/]:")
            for note in result.skips:
                p(f"    {shown}:{at(note.line, ':')}: [yellow]{note.rule}[/] {escape(one_line(note.message))}")
        if result.dropped:
            p("  [red]dropped[/]:")
            for line in result.dropped:
                p(f"    {escape(one_line(line))}")
        self.err.print("\n".join(lines))

    def final(self, tally: Tally) -> None:
        if self.silent:
            return
        self._flush_out()
        style = "bold red" if tally.errors else "bold"
        self.err.print(f"[{style}]{final_line(tally, self.settings.mode)}[/]")


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


def summary_table(tally: Tally, report: Reporter) -> None:
    """A table of the files that need a look: changed, left alone in places, or in error."""
    from rich import box
    from rich.markup import escape
    from rich.table import Table

    listed = [o for o in tally.outcomes
              if o.error or o.changed or (o.result is not None and (o.result.skips or o.result.dropped))]
    if not listed:
        return
    header = ["file", "status", "rules applied", "left alone", "dropped"]
    table = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False)
    for column in header:
        table.add_column(column, overflow="fold")
    cells = []
    for o in listed:
        r = o.result
        cells.append([str(o.path), o.status or "error",
                      ", ".join(sorted({n.rule for n in r.changes if n.rule.startswith("AR")})) if r else "",
                      str(len(r.skips)) if r and r.skips else "", str(len(r.dropped)) if r and r.dropped else ""])
        table.add_row(*(escape(c) for c in cells[-1]))
    report._flush_out()
    if fits(report.err, table):
        report.err.print(table)
    else:
        rows(report.err, header, [[c[0], *(escape(x) for x in c[1:])] for c in cells])
