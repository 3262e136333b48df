"""Jupyter notebooks: the code cells rewritten as one program, everything else kept.

Names flow between cells (a model built in cell 2 is trained in cell 5), so the code cells
are joined into one program, in order, each followed by a marker statement
``__accelerate_rewrite_cell__(N)``.

IPython syntax is found by IPython itself (the token transformers of
``IPython.core.inputtransformer2.TransformerManager``, as black[jupyter] does): a line magic
(``%matplotlib inline``), a shell escape (``!pip install x``), an assignment from one
(``files = !ls``, ``env = %env``), a help query (``obj?``). Each is masked with a placeholder
``__accelerate_rewrite_magic__(K)`` where IPython's own transform would put its call (an
assignment keeps its target), and the original text, continuation lines included, goes back
after the rewrite. A cell that is valid Python as it is (a ``%`` that continues an expression,
``msg = ('loss %.3f'`` then ``% loss)``) is never masked, and IPython is not even imported for
it. A cell that starts with a cell magic (``%%time``, ``%%bash``) is left out of the program and
kept as is.

The leading block of the notebook (the magics, comments and blank lines before its first Python
statement, ``!pip install`` cells included) is held out of the program too, so that an import the
rewrite adds goes to the first code cell that is plain Python, below ``%matplotlib inline``
(up to a suppression comment, ``# accelerate-rewrite: skip-file``, which stays in the program).

After the rewrite the program is cut at the markers: a cell whose code changed gets its new
source, all other cells, their outputs, the metadata and the notebook's format stay. An edit
that would cross a cell boundary (a marker no longer at the top level, or out of order) or move
a magic is refused: the notebook is left alone with the reason. Errors and notes name the
place as ``train.ipynb:cell 3:line 2`` (cells numbered as Jupyter shows them, from 1).

nbformat and IPython are the ``notebooks`` extra, imported only when a notebook is processed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from accelerate_rewrite.codemod.files.diff import unified_diff

CELL = "__accelerate_rewrite_cell__"
MAGIC = "__accelerate_rewrite_magic__"
EXTRA = "pip install 'accelerate-rewrite[notebooks]'"
_MARKER = re.compile(rf"^{CELL}\((\d+)\)\r?\n?$")
_PLACEHOLDER = re.compile(rf"{MAGIC}\((\d+)\)")
_MAGIC_LINE = re.compile(rf"[ \t]*{MAGIC}\(\d+\)[ \t]*")
_AT = re.compile(r"^(?P<path>.*?):(?P<line>\d+)(?::\d+)?:")
#: compile() flags: only the syntax tree; ``await`` at the top level is valid in a notebook
_FLAGS = 0x400 | 0x2000  # ast.PyCF_ONLY_AST | ast.PyCF_ALLOW_TOP_LEVEL_AWAIT


class NotebookError(ValueError):
    """The notebook can't be read, or the rewrite can't be put back into its cells."""


class MissingExtra(NotebookError):
    """nbformat or IPython is not installed."""

    def __init__(self, missing: str) -> None:
        # no path in it: said once for a run, however many notebooks it meets
        super().__init__(f"notebooks need the notebooks extra ({missing} is not installed): {EXTRA}")


def require() -> Any:
    """nbformat, or MissingExtra; IPython is only looked for here (imported for a cell with magics)."""
    from importlib.util import find_spec

    try:
        import nbformat
    except ImportError:
        raise MissingExtra("nbformat") from None
    if find_spec("IPython") is None:
        raise MissingExtra("IPython")
    return nbformat


@dataclass
class _Cell:
    index: int  # in the notebook
    source: str
    lines: list[str]  # the masked lines, each with its line ending
    spans: list[tuple[int, int]]  # each masked line's first and last line in the cell (1-based)


@dataclass
class Program:
    nb: Any  # nbformat.NotebookNode
    text: str
    cells: list[int] = field(default_factory=list)  # notebook indices of the code cells in the program
    magics: list[str] = field(default_factory=list)  # placeholder K -> the original text
    #: program line (1-based) -> (cell number as Jupyter shows it, 1-based; line in the cell)
    lines: list[tuple[int, int]] = field(default_factory=list)
    prefix: str = ""  # the first program cell's leading magics, held out of the program
    masked: dict[int, str] = field(default_factory=dict)  # notebook index -> its part of the program

    def where(self, line: int) -> str:
        return where(self.lines, line)


def where(lines: Optional[list], line: int) -> str:
    """"cell 3:line 2" for a program line, or "line N" outside any notebook."""
    if lines is not None and 1 <= line <= len(lines):
        cell, in_cell = lines[line - 1]
        return f"cell {cell}:line {in_cell}"
    return f"line {line}"


def _source(cell: Any) -> str:
    source = cell.get("source", "")
    return "".join(source) if isinstance(source, list) else source


def _split(source: str) -> list[str]:
    """Lines as Python's tokenizer sees them (split after ``\\n`` only), each ending with one."""
    parts = source.split("\n")
    return [line + "\n" for line in parts[:-1]] + ([parts[-1] + "\n"] if parts[-1] else [])


def _valid(text: str) -> Optional[SyntaxError]:
    try:
        compile(text, "<cell>", "exec", flags=_FLAGS, dont_inherit=True)
    except SyntaxError as exc:
        return exc
    except ValueError as exc:  # null bytes
        return SyntaxError(str(exc))
    return None


def _mask(source: str, magics: list[str], path: str, number: int) -> tuple[list[str], list[tuple[int, int]]]:
    """The cell's lines with each IPython construct masked, and each masked line's span in the
    cell (a magic continued with backslashes spans several); a syntax error names its line."""
    lines = _split(source)
    spans = [(n, n) for n in range(1, len(lines) + 1)]
    if _valid(source) is None:
        return lines, spans  # plain Python: nothing to mask, IPython not needed
    try:
        from IPython.core.inputtransformer2 import TokenTransformBase, TransformerManager, make_tokens_by_line
    except ImportError:
        raise MissingExtra("IPython") from None
    manager = TransformerManager()
    try:
        for _ in range(500):  # IPython's own bound (TRANSFORM_LOOP_LIMIT)
            tokens = make_tokens_by_line(lines)
            found = [t for t in (cls.find(tokens) for cls in manager.token_transformers) if t]
            for transformer in sorted(found, key=TokenTransformBase.sortby):
                try:
                    transformed = transformer.transform(list(lines))
                except SyntaxError:
                    continue
                break
            else:
                break
            # IPython's transform puts one line in place of lines start..end: the magic's
            start, col = transformer.start_line, transformer.start_col
            end = start + len(lines) - len(transformed)
            text = "".join(lines[start:end + 1])
            body = text.rstrip("\r\n")
            magics.append(body[col:])
            lines[start:end + 1] = [f"{body[:col]}{MAGIC}({len(magics) - 1}){text[len(body):]}"]
            spans[start:end + 1] = [(spans[start][0], spans[end][1])]
    except Exception as exc:  # IPython's transformers raise several kinds on odd input
        raise NotebookError(f"{path}:cell {number}: IPython can't read the cell "
                            f"({type(exc).__name__}: {exc}); the notebook is left alone") from None
    error = _valid("".join(lines))
    if error is not None:
        at = spans[min(max(error.lineno or 1, 1), len(spans)) - 1][0] if spans else 1
        raise NotebookError(f"{path}:cell {number}:line {at}: syntax error: {error.msg}")
    return lines, spans


def read(text: str, path: str) -> Program:
    nbformat = require()
    try:
        # nbformat's reader, as ``nbformat.reads(text, NO_CONVERT)`` reads, without its validation
        # against the schema, which only logs what it finds (nothing here reads that) and first
        # compiles the schema (fastjsonschema): a quarter of a notebook's cost (docs/benchmarks.md)
        nb = nbformat.reader.reads(text)
    except Exception as exc:  # nbformat raises several kinds (JSON, validation, version)
        raise NotebookError(f"{path}: not a notebook nbformat can read ({type(exc).__name__}: {exc})") from None
    program = Program(nb, "")
    cells: list[_Cell] = []
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = _source(cell)
        if source.lstrip().startswith("%%"):
            continue  # a cell magic: its body is not Python (or runs apart)
        lines, spans = _mask(source, program.magics, path, index + 1)
        cells.append(_Cell(index, source, lines, spans))
    # the leading block (magics, comments, blank lines before the first statement) stays out
    while cells and all(_leading(line) for line in cells[0].lines):
        cells.pop(0)
    if cells:
        first = cells[0]
        cut = next(i for i, line in enumerate(first.lines) if not _leading(line))
        if cut:
            program.prefix = "".join(_split(first.source)[:first.spans[cut - 1][1]])
            first.lines, first.spans = first.lines[cut:], first.spans[cut:]
    parts: list[str] = []
    for cell in cells:
        masked = "".join(cell.lines)
        parts.append(masked)
        parts.append(f"{CELL}({cell.index})\n")
        program.masked[cell.index] = masked
        program.lines += [(cell.index + 1, first_line) for first_line, _ in cell.spans]
        program.lines.append((cell.index + 1, cell.spans[-1][1] + 1 if cell.spans else 1))
        program.cells.append(cell.index)
    program.text = "".join(parts)
    return program


def _leading(line: str) -> bool:
    """A line of the leading block: blank, a comment (not a suppression comment, which the
    program must keep: ``# accelerate-rewrite: skip-file``), or a whole-line magic."""
    stripped = line.strip()
    if stripped.startswith("#"):
        return "accelerate-rewrite:" not in stripped
    return not stripped or _MAGIC_LINE.fullmatch(line.rstrip("\r\n")) is not None


def write_back(program: Program, output: str, path: str) -> tuple[Any, dict[int, str]]:
    """The notebook with the rewritten cells; the new sources by notebook index (changed only)."""
    import copy

    chunks: list[list[str]] = [[]]
    seen: list[int] = []
    for text_line in output.splitlines(keepends=True):
        match = _MARKER.match(text_line)
        if match:
            seen.append(int(match.group(1)))
            chunks.append([])
        else:
            chunks[-1].append(text_line)
    if seen != program.cells or "".join(chunks[-1]).strip():
        raise NotebookError(f"{path}: a rewrite would move code across cells; the notebook is left alone "
                            "(rewrite it as a script, or merge the cells the training loop spans)")
    texts = ["".join(chunk) for chunk in chunks[:-1]]
    for index, text in zip(program.cells, texts):
        if [int(k) for k in _PLACEHOLDER.findall(text)] != \
                [int(k) for k in _PLACEHOLDER.findall(program.masked[index])]:
            raise NotebookError(f"{path}: a rewrite would move or drop an IPython magic; the notebook "
                                "is left alone (rewrite it as a script)")
    nb = copy.deepcopy(program.nb)
    changed: dict[int, str] = {}
    for position, (index, text) in enumerate(zip(program.cells, texts)):
        if text == program.masked[index]:
            continue
        cell = nb["cells"][index]
        old = _source(cell)
        new = _PLACEHOLDER.sub(lambda m: program.magics[int(m.group(1))], text)
        if position == 0:
            new = program.prefix + new
        if not old.endswith("\n") and new.endswith("\n"):
            new = new[:-2] if new.endswith("\r\n") else new[:-1]
        if new == old:
            continue
        if _PLACEHOLDER.search(program.masked[index]) or (position == 0 and program.prefix):
            # as black does: the magics put back must be read by IPython as they were
            before: list[str] = []
            after: list[str] = []
            _mask(old, before, path, index + 1)
            try:
                _mask(new, after, path, index + 1)
            except NotebookError:
                after = []
            if after != before:
                raise NotebookError(f"{path}:cell {index + 1}: a rewrite would put an IPython magic where "
                                    "IPython reads it otherwise; the notebook is left alone (rewrite it as a script)")
        cell["source"] = new
        changed[index] = new
    return nb, changed


def locate(message: str, program: Program, path: str) -> str:
    """An error that names a line of the joined program (``train.ipynb:12:5: ...``), with the
    cell and the line in it instead (``train.ipynb:cell 3:line 2: ...``)."""
    match = _AT.match(message)
    if match is None or match.group("path") != path:
        return message
    return f"{path}:{program.where(int(match.group('line')))}:{message[match.end():]}"


#: line numbers in a note: "line 12", "lines 36, 82", "line(s) 80" (not those "of the result");
#: codemod/engine.py reads a project's notes with it too
LINES = re.compile(r"\b(?P<word>line(?:s|\(s\))?) (?P<numbers>\d+(?:, \d+)*)\b(?! of the result)")


def relocate(message: str, program: Program) -> str:
    """A note that names lines of the joined program (``on lines 50, 52``), with the cells and
    the lines in them instead (``on cell 5:lines 18, 20``); lines "of the result" stay."""
    def cells(match: re.Match) -> str:
        groups: list[tuple[int, list[int]]] = []
        for number in (int(n) for n in match.group("numbers").split(", ")):
            if not 1 <= number <= len(program.lines):
                return match.group(0)
            cell, line = program.lines[number - 1]
            if groups and groups[-1][0] == cell:
                groups[-1][1].append(line)
            else:
                groups.append((cell, [line]))
        return ", ".join(f"cell {cell}:{'lines' if len(lines) > 1 else 'line'} {', '.join(map(str, lines))}"
                         for cell, lines in groups)

    return LINES.sub(cells, message)


def dumps(nb: Any, original: str) -> str:
    nbformat = require()
    text = nbformat.writes(nb, version=nbformat.NO_CONVERT)
    return text + "\n" if original.endswith("\n") and not text.endswith("\n") else text


def cell_diffs(path: str, program: Program, changed: dict[int, str]) -> str:
    """One unified diff per changed cell, its headers naming the cell as Jupyter numbers it."""
    out = []
    for index, new in sorted(changed.items()):
        old = _source(program.nb["cells"][index])
        name = f"{path} (cell {index + 1})"
        out.append(unified_diff(name, old if old.endswith("\n") else old + "\n",
                                new if new.endswith("\n") else new + "\n"))
    return "".join(out)
