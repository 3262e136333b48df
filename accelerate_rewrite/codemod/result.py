"""What a rewrite says: a rule's Kind, its Notes, and the Result of one file.

Plain data with no libcst in it, so that the runner can report a result read back from the
cache (accelerate_rewrite/cache.py) without loading the engine. ``codemod.rule`` and
``codemod.engine`` re-export these names, where the rules and the engine's callers import them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

if TYPE_CHECKING:
    from accelerate_rewrite.options import Options


class Kind(str, enum.Enum):
    """How much a rule may change what the script computes."""

    SAFE = "safe"  # keeps the math
    APPROXIMATE = "approximate"  # numerics change within a known tolerance
    CHANGES_TRAINING = "changes-training"  # trains differently, on purpose


@dataclass(frozen=True)
class Note:
    """A change a rule made, or a place it left alone and why. ``line`` is 1-based."""

    rule: str
    line: int
    message: str
    skipped: bool = False
    #: what this change does to the numbers, when it is not the rule's usual kind (AR302
    #: keeping the effective batch is approximate, accumulating without it changes training)
    kind: Optional["Kind"] = None

    def kind_with(self, options: "Options") -> "Kind":
        """The kind of this change: a rule's change has it from the moment it is made
        (``RuleContext.change``: its own, or the rule's for the options); the engine's own notes
        (a comment that went with its statement) keep the math."""
        return self.kind if self.kind is not None else Kind.SAFE


@dataclass
class Result:
    path: str
    source: str
    output: str
    notes: list[Note] = field(default_factory=list)
    #: rules dropped for this file, with why (a failed check, an internal error)
    dropped: list[str] = field(default_factory=list)
    #: the project's own modules analysed with this script (codemod/project/program.py), each with its
    #: own result: they change with it, or not at all
    members: list["Result"] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.output != self.source

    @property
    def changes(self) -> list[Note]:
        return [n for n in self.notes if not n.skipped]

    @property
    def skips(self) -> list[Note]:
        return [n for n in self.notes if n.skipped]
