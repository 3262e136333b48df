"""What a rule is, and how it speaks: the Rule base class, Kind, notes and examples."""

from __future__ import annotations

import inspect
from pathlib import Path
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Optional

# first, before LibCST: its dataclasses' methods compiled once, the matchers without the
# docstrings they would print (codemod/tree/startup.py)
import accelerate_rewrite.codemod.tree.startup  # noqa: F401

import libcst as cst

from accelerate_rewrite.codemod.edits.edit_set import EditSet
from accelerate_rewrite.codemod.result import Kind, Note  # noqa: F401 (their home is codemod/result.py)
from accelerate_rewrite.options import Options

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.facts import ScriptFacts


EXAMPLES_DIR = Path(__file__).resolve().parent.parent / "rules" / "examples"


@dataclass(frozen=True)
class Example:
    """A before/after pair: the docs print it, a test runs it."""

    before: str
    after: str
    options: dict = field(default_factory=dict)

    @classmethod
    def from_files(cls, name: str, options: Optional[dict] = None) -> "Example":
        """``rules/examples/NAME.before.txt`` and ``NAME.after.txt``: whole training scripts,
        kept as text so that no .py file of the rewrite path holds an ``import torch`` line."""
        before = (EXAMPLES_DIR / f"{name}.before.txt").read_text(encoding="utf-8")
        after = (EXAMPLES_DIR / f"{name}.after.txt").read_text(encoding="utf-8")
        return cls(before, after, dict(options or {}))


class RuleContext:
    """What a rule gets: the facts, the options, its own edit set, and a way to speak."""

    def __init__(self, rule: "Rule", facts: "ScriptFacts", options: Options) -> None:
        self.rule = rule
        self.facts = facts
        self.options = options
        self.edits = EditSet()
        self.notes: list[Note] = []
        #: id(note) -> id of the node a change note is about: the engine checks the claim there
        self.about: dict[int, int] = {}
        #: what this rule's edits give the file, that another rule's change stands on
        #: (``Rule.premises``): the engine drops a rule none of whose grounds was given
        self.provided: set[str] = set()

    def provide(self, ground: str) -> None:
        """Record that this rule's edits (or the script as it is, read by this rule) give the
        file ``ground``: e.g. an autocast that computes in the precision asked for."""
        self.provided.add(ground)

    def change(self, node: Optional[cst.CSTNode], message: str, kind: Optional[Kind] = None) -> None:
        kind = kind if kind is not None else self.rule.kind_for(self.options)  # read by Note.kind_with
        note = Note(self.rule.code, self.facts.line(node), message, kind=kind)
        self.notes.append(note)
        if node is not None:
            self.about[id(note)] = id(node)

    def skip(self, node: Optional[cst.CSTNode], message: str) -> None:
        self.notes.append(Note(self.rule.code, self.facts.line(node), message, skipped=True))


class Rule:
    """A rule: the class docstring is its documentation (``accelerate-rewrite explain``)."""

    code: ClassVar[str]
    name: ClassVar[str]
    kind: ClassVar[Kind] = Kind.SAFE
    #: codes of rules whose edits this one relies on: if one of them is dropped, so is this.
    requires: ClassVar[tuple[str, ...]] = ()
    #: a migration off a deprecated API or a fix of a bug, that needs no option: the rules the
    #: pre-commit hook applies by default (selector "fixes")
    fix: ClassVar[bool] = False
    #: applied only when selected by its own code or name (``--select AR404``); on other runs it
    #: only reports what it would do (``Options.explicit`` holds the rules selected so)
    opt_in: ClassVar[bool] = False
    #: words (lower case) that make a file worth analysing for this rule even when it has no
    #: training words (backward, optim, amp, ...): the runner's fast path skips the others
    words: ClassVar[tuple[str, ...]] = ()
    examples: ClassVar[tuple[Example, ...]] = ()

    @classmethod
    def summary(cls) -> str:
        """The docstring's first paragraph, on one line."""
        return " ".join((inspect.getdoc(cls) or "").strip().split("\n\n")[0].split())

    @classmethod
    def documentation(cls) -> str:
        return inspect.getdoc(cls) or ""

    def kind_for(self, options: Options) -> Kind:
        """The kind of what the rule did with these options (by default, ``kind``)."""
        return self.kind

    def requirements(self, options: Options) -> tuple[str, ...]:
        """The rules this one relies on with these options (by default, ``requires``)."""
        return self.requires

    def premises(self, options: Options) -> tuple[str, ...]:
        """What this rule's change stands on, with these options: grounds that another rule
        gives the file (``RuleContext.provide``). Where no rule that stays gives one of them, the
        engine drops this rule, with the reason; and where the rule that gave it is dropped, this
        one goes with it. (``requires`` names rules; a premise names what a rule must have done.)"""
        return ()

    def applies(self, options: Options) -> bool:
        """Whether the rule runs at all with these options."""
        return True

    def rewrite(self, ctx: RuleContext) -> None:
        """Read ``ctx.facts``, record edits in ``ctx.edits`` and notes with ctx.change/skip."""
        raise NotImplementedError
