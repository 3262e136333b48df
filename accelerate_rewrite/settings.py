"""What one run of the rewrite is asked to do: the mode (preview, write, -o, check) and the
settings the click layer (cli/) parses the command line into."""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Optional

from accelerate_rewrite.options import Options

if TYPE_CHECKING:
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
