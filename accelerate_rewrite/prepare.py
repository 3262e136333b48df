"""Preparing one file: read it, choose what applies (configuration, options, rules), rewrite it
(or its notebook's cells, or its project), and encode the bytes to write. Workers of ``-j`` run
this; the cache answers it for a file unchanged since a run with the same settings."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional, Sequence

from accelerate_rewrite.codemod.files.paths import Target
from accelerate_rewrite.codemod.analysis.words import TRAINING_WORDS
from accelerate_rewrite.options import Options
from accelerate_rewrite.settings import Mode, Settings

if TYPE_CHECKING:
    from accelerate_rewrite.api import Result
    from accelerate_rewrite.codemod.analysis.importers import Scope
    from accelerate_rewrite.codemod.files.source import SourceFile
    from accelerate_rewrite.config import Choice

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
    #: set by the run's plan (runner.py): a member's real path -> the other scripts of the run it
    #: changes with (its versions merged), and the files written as one with other scripts'
    also: dict = field(default_factory=dict)
    joint: Optional[object] = None


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
    from accelerate_rewrite.api import Result, RewriteError, rewrite

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
    from accelerate_rewrite.codemod.analysis.siblings import candidates

    def text_of(file: Path) -> Optional[str]:
        try:
            return file.read_text(encoding="utf-8", errors="replace")
        except OSError:
            return None

    return [t for t in map(text_of, candidates(path, text, text_of)) if t is not None]


def prepare(target: Target, settings: Settings, scope: Optional["Scope"] = None) -> Prepared:
    """Read, choose the options and rules, rewrite, encode; every failure becomes an error
    message naming the file. ``scope``: the project's modules that may change with it."""
    from accelerate_rewrite.api import RewriteError
    from accelerate_rewrite.codemod.files.source import SourceError, read_source
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
    from accelerate_rewrite.codemod.files.source import SourceError

    try:
        return source.encode(text)
    except UnicodeEncodeError as exc:
        raise SourceError(
            f"{path}: the result can't be encoded as {source.encoding} ({exc.reason}); not written"
        ) from None


def _prepare_notebook(out: Prepared, source: "SourceFile", choice: "Choice", settings: Settings) -> Prepared:
    """A notebook: its code cells rewritten as one program and put back (codemod/files/notebook.py)."""
    out.result, out.diff, out.where = rewrite_notebook(source.text, str(out.target.path), choice)
    if settings.mode is Mode.OUTPUT or (settings.mode is Mode.WRITE and out.result.changed):
        out.data = source.encode(out.result.output)
    return out


def rewrite_notebook(text: str, path: str, choice: "Choice") -> tuple["Result", str, list]:
    """A notebook's rewrite (its ``output``: the notebook's new text), its diff (per changed
    cell), and its program line -> (cell, line in the cell)."""
    from dataclasses import replace

    from accelerate_rewrite.codemod.files import notebook
    from accelerate_rewrite.api import RewriteError, rewrite
    from accelerate_rewrite.codemod.analysis.importers import Scope

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
