"""Jupyter notebooks: the code cells rewritten as one program, everything else kept.

Names flow between cells (a model built in cell 2 is trained in cell 5), so the code cells
are joined into one program, in order, each followed by a marker statement
``__accelerate_rewrite_cell__(N)``. IPython syntax that is not Python (``%matplotlib inline``,
``!pip install x``, ``files = !ls``) becomes a placeholder statement
``__accelerate_rewrite_magic__(K)`` with the line's indentation, and comes back as it was; a
cell that starts with a cell magic (``%%time``, ``%%bash``) is left out of the program and
kept as is. After the rewrite the program is cut at the markers: a cell whose code changed gets
its new source, all other cells, their outputs, the metadata and the notebook's format stay.
An edit that would cross a cell boundary (a marker no longer at the top level, or out of
order) is refused: the notebook is left alone with the reason.

Notebooks are read and written with nbformat, imported only when a notebook is processed.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any, Optional

from accelerate_rewrite.codemod.diff import unified_diff

CELL = "__accelerate_rewrite_cell__"
MAGIC = "__accelerate_rewrite_magic__"
_MAGIC_LINE = re.compile(r"^(?P<indent>[ \t]*)(?:[%!]|\w[\w.]*\s*=\s*[%!])")
_MARKER = re.compile(rf"^{CELL}\((\d+)\)\n?$")
_PLACEHOLDER = re.compile(rf"^(?P<indent>[ \t]*){MAGIC}\((\d+)\)$")


class NotebookError(ValueError):
    """The notebook can't be read, or the rewrite can't be put back into its cells."""


@dataclass
class Program:
    nb: Any  # nbformat.NotebookNode
    text: str
    cells: list[int] = field(default_factory=list)  # notebook indices of the code cells in the program
    magics: list[str] = field(default_factory=list)  # placeholder K -> the original line
    #: program line (1-based) -> (cell number as Jupyter shows it, 1-based; line in the cell)
    lines: list[tuple[int, int]] = field(default_factory=list)

    def where(self, line: int) -> str:
        if 1 <= line <= len(self.lines):
            cell, in_cell = self.lines[line - 1]
            return f"cell {cell}, line {in_cell}"
        return f"line {line}"


def read(text: str, path: str) -> Program:
    import nbformat

    try:
        nb = nbformat.reads(text, as_version=nbformat.NO_CONVERT)
    except Exception as exc:  # nbformat raises several kinds (JSON, validation, version)
        raise NotebookError(f"{path}: not a notebook nbformat can read ({type(exc).__name__}: {exc})") from None
    program = Program(nb, "")
    parts: list[str] = []
    for index, cell in enumerate(nb.get("cells", [])):
        if cell.get("cell_type") != "code":
            continue
        source = cell.get("source", "")
        if isinstance(source, list):
            source = "".join(source)
        if source.lstrip().startswith("%%"):
            continue  # a cell magic: not Python
        out_lines = []
        source_lines = source.split("\n")
        if source.endswith("\n"):
            source_lines.pop()
        for number, text_line in enumerate(source_lines, start=1):
            match = _MAGIC_LINE.match(text_line)
            if match and not text_line.rstrip().endswith(":"):
                program.magics.append(text_line)
                text_line = f"{match.group('indent')}{MAGIC}({len(program.magics) - 1})"
            out_lines.append(text_line)
            program.lines.append((index + 1, number))
        parts.append("".join(text_line + "\n" for text_line in out_lines))
        parts.append(f"{CELL}({index})\n")
        program.lines.append((index + 1, len(out_lines) + 1))
        program.cells.append(index)
    program.text = "".join(parts)
    return program


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
    nb = copy.deepcopy(program.nb)
    changed: dict[int, str] = {}
    for index, chunk in zip(program.cells, chunks):
        cell = nb["cells"][index]
        old = cell.get("source", "")
        if isinstance(old, list):
            old = "".join(old)
        new_lines = []
        for text_line in "".join(chunk).split("\n"):
            match = _PLACEHOLDER.match(text_line)
            new_lines.append(program.magics[int(match.group(2))] if match else text_line)
        new = "\n".join(new_lines)
        if not old.endswith("\n") and new.endswith("\n"):
            new = new[:-1]
        if new != old:
            cell["source"] = new
            changed[index] = new
    return nb, changed


def dumps(nb: Any, original: str) -> str:
    import nbformat

    text = nbformat.writes(nb, version=nbformat.NO_CONVERT)
    return text + "\n" if original.endswith("\n") and not text.endswith("\n") else text


def cell_diffs(path: str, program: Program, changed: dict[int, str]) -> str:
    """One unified diff per changed cell, its headers naming the cell as Jupyter numbers it."""
    out = []
    for index, new in sorted(changed.items()):
        old = program.nb["cells"][index].get("source", "")
        if isinstance(old, list):
            old = "".join(old)
        name = f"{path} (cell {index + 1})"
        out.append(unified_diff(name, old if old.endswith("\n") else old + "\n",
                                new if new.endswith("\n") else new + "\n"))
    return "".join(out)


def cell_line(program: Optional[Program], line: int) -> str:
    return program.where(line) if program is not None else f"line {line}"
