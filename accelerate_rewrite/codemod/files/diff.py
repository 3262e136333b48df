"""Unified diffs of a rewrite, and printing them: coloured on a terminal, plain otherwise.

The plain text is what ``patch -p0`` and ``git apply -p0`` read: headers ``--- path`` /
``+++ path``, each line with its own line ending (a CRLF file's lines keep their ``\\r\\n``
so the patch applies to it byte for byte), and the usual ``\\ No newline at end of file``
marker after a last line that has no newline.
"""

from __future__ import annotations

import difflib
import os
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # rich is imported only when something is printed
    from rich.console import Console

NO_NEWLINE = "\\ No newline at end of file\n"


def split_lines(text: str) -> list[str]:
    """Lines as diff and patch see them: split after each ``\\n`` only, endings kept.

    (``str.splitlines`` would also split at form feeds, ``\\x1c``, ``\\u2028``, ... which
    may sit inside a Python line and would give a patch that does not apply.)
    """
    lines = text.split("\n")
    out = [line + "\n" for line in lines[:-1]]
    if lines[-1]:
        out.append(lines[-1])
    return out


def unified_diff(
    path: str, before: str, after: str, *, context: int = 3, to_path: str | None = None
) -> str:
    """The unified diff from ``before`` to ``after``, both named ``path``; "" when equal.

    ``to_path`` names the after side differently (``explain`` shows "before" / "after").
    """
    if before == after:
        return ""
    out: list[str] = []
    for line in difflib.unified_diff(
        split_lines(before), split_lines(after), fromfile=path,
        tofile=path if to_path is None else to_path, n=context,
    ):
        if line.endswith("\n"):
            out.append(line)
        else:  # the last line of a side, without a newline
            out.append(line + "\n")
            out.append(NO_NEWLINE)
    return "".join(out)


def colour_wanted(console: "Console") -> bool:
    """Colour only on a terminal, and never with NO_COLOR set (https://no-color.org)."""
    return (
        console.is_terminal
        and not console.no_color
        and console.color_system is not None
        and os.environ.get("NO_COLOR", "") == ""
    )


def render_diff(console: "Console", text: str) -> None:
    """Print a diff: rich-highlighted on a colour terminal, else the exact plain text."""
    if not text:
        return
    if colour_wanted(console):
        from rich.syntax import Syntax

        # a carriage return would move the cursor back over the line: show LF endings
        shown = text.replace("\r\n", "\n").rstrip("\n")
        console.print(Syntax(shown, "diff", theme="ansi_dark", background_color="default",
                             word_wrap=True))
    else:
        # no rich here: it would wrap long lines and break the patch
        console.file.write(text)
        console.file.flush()
