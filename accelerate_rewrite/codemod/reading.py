"""What a rewrite reads (codemod/engine.py's first step): the script parsed and analysed, kept for
the next rewrite of the same text (``_analyse``, ``_parsed``), its syntax errors said with Python's
own place (``RewriteError``), a last line LibCST can't read set apart (``_parse``), and the
project's own modules it imports read and built into one program with it (``_project``,
codemod/project/program.py)."""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import Optional

import libcst as cst

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.analysis.words import TRAINING_WORDS
from accelerate_rewrite.codemod.edits.preserve import split_tail
from accelerate_rewrite.codemod.project.program import Project, Scope, build, candidates
from accelerate_rewrite.codemod.tree.parse import parsed_text


class RewriteError(Exception):
    """The file can't be rewritten at all (a syntax error, ...); the message names the file."""


@lru_cache(maxsize=4)
def _analyse(source: str, folder: Optional[Path] = None) -> ScriptFacts:
    """The facts of a source, kept for the next rewrites of the same text: the facts are read,
    never changed, by the rules (the plans they draw from them are memoised per options), and
    the test suite rewrites each fixture with many sets of options."""
    return ScriptFacts(_parsed(source), folder, fresh=True, text=source)  # no copy of a new tree


#: LibCST's parse of a text (in pieces where it is long), kept for the next parse of the same
#: text (codemod/tree/parse.py's ``parsed_text``, which the compatible change reads too): the script
#: is parsed to look for its project's modules and then for its facts, a project may read a
#: module twice, and a script of a repository is read again as a module of another's program
#: (DINO's main_dino.py in run_with_submitit.py's; a tree is never changed, only read and rebuilt)
_parsed = parsed_text


def _folder(path: str) -> Optional[Path]:
    """The folder of the script's own modules: none for a source with no file (``<string>``,
    stdin)."""
    if path.startswith("<") or path == "-":
        return None
    return Path(path).parent


def _parse(source: str, path: str, make=None):
    """The facts (or what ``make(text)`` makes of the text), and the source as ``head`` (what
    LibCST reads) + ``tail`` (trailing lines LibCST can't read, such as a last line that is a
    lone backslash, put back afterwards)."""
    if make is None:
        make = lambda text: _analyse(text, _folder(path))  # noqa: E731
    try:
        return make(source), source, ""
    except cst.ParserSyntaxError as exc:
        # Python's own parser names the place best (1-based line and column)
        try:
            compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as py_exc:
            raise RewriteError(
                f"{path}:{py_exc.lineno}:{py_exc.offset}: syntax error: {py_exc.msg}"
            ) from None
        except ValueError as py_exc:  # e.g. "source code string cannot contain null bytes"
            raise RewriteError(f"{path}: {py_exc}") from None
        for split in split_tail(source):
            try:
                return make(split[0]), split[0], split[1]
            except cst.ParserSyntaxError:
                continue
        raise RewriteError(
            f"{path}: valid Python that LibCST's parser can't read ({exc.message}); file left as is"
        ) from None


def _module_read(text: str) -> Optional[tuple[str, str, str, cst.Module]]:
    """A module of the project, parsed: (text, head, tail, tree), or None where it can't be
    read. The entry points of a repository (``accelerate-rewrite .``) share their modules: the
    tree is ``parsed_text``'s, kept (and bounded) there, and what the text splits into is kept
    here (a text LibCST can't read whole is not tried again)."""
    split = _module_split(text)
    if split is None:
        return None
    head, tail = split
    return text, head, tail, parsed_text(head)


@lru_cache(maxsize=64)
def _module_split(text: str) -> Optional[tuple[str, str]]:
    """(head, tail) of a module's text (``_parse``), or None where it can't be read."""
    try:
        _, head, tail = _parse(text, "<module>", make=parsed_text)
    except RewriteError:
        return None
    return head, tail


def _project(source: str, path: str, scope: Scope, sources: Optional[dict[str, str]],
             words: tuple[str, ...] = TRAINING_WORDS) -> Optional[Project]:
    """The script with the project's modules it imports (codemod/project/program.py), or None.
    ``words``: a module that mentions none of them is not followed (nothing a rule reads)."""
    folder = _folder(path)
    if folder is None or "import" not in source:
        return None
    overrides = {os.path.realpath(k): v for k, v in (sources or {}).items()}

    texts: dict[str, Optional[str]] = {}  # each file read once

    def text_of(file: Path) -> Optional[str]:
        real = os.path.realpath(file)
        if real in overrides:
            return overrides[real]
        if real not in texts:
            from accelerate_rewrite.codemod.files.source import SourceError, read_source

            try:
                texts[real] = read_source(file).text
            except (SourceError, OSError):
                texts[real] = None
        return texts[real]

    if not candidates(Path(path), source, text_of):
        return None

    done: dict[Path, object] = {}

    def read(file: Path):
        if file not in done:
            done[file] = _read(file)
        return done[file]

    def _read(file: Path):
        text = text_of(file)
        return None if text is None else _module_read(text)

    module, head, _ = _parse(source, path, make=_parsed)
    return build(path, head, module, source, read, words=words, peek=text_of)
