"""Each file of a project as the engine applies the edits to it (codemod/project/program.py builds the
project, codemod/engine.py applies): its tree made of the analysed module's statements, what it
read undefined or unbound already, whether it may change, and a note's lines placed in it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Optional, Union

import libcst as cst

from accelerate_rewrite.codemod.tree.flow import maybe_unbound
from accelerate_rewrite.codemod.tree.layout import Layout
from accelerate_rewrite.codemod.project.program import Project
from accelerate_rewrite.codemod.analysis.importers import Scope, changed_names

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.facts import ScriptFacts


@dataclass
class Unit:
    """One file the edits apply to: the script, or a module of its project."""

    path: str
    source: str
    head: str
    tail: str
    roundtrip: str
    view: cst.Module  # the file's tree, made of the analysed module's statements where it has them
    #: names the file read undefined already, or what gives them when first needed
    undefined: Union[dict[str, int], Callable[[], dict[str, int]]]
    #: the file's text and what it reads unbound already (flow.maybe_unbound), made when first asked for
    unbound: tuple[str, Callable[[], dict]]
    #: a line of the analysed module -> (index of the unit that holds it, line in that file)
    where: Callable[[int], tuple[int, int]]
    index: int = 0
    #: why this file may not change as it would (given its text before and after), or None
    refusal: Optional[Callable[[str, str], Optional[str]]] = None
    #: where it may not, whether it may change compatibly (codemod/project/compat.py), and the files
    #: that import what would change there
    compatible: bool = False
    users: Callable[[str, str], list[str]] = lambda before, after: []
    #: of the top-level names whose definitions differ between two texts of the file, those no
    #: other file reads (they may change as the conversion would, in a compatible change too)
    free: Callable[[str, str], frozenset[str]] = lambda before, after: frozenset()
    aliases: dict[str, str] = field(default_factory=dict)  # Part.aliases
    renames: dict[str, str] = field(default_factory=dict)  # Part.renames
    first_read: Callable[[str], Optional[int]] = lambda name: None
    #: the view's statements' code (codemod/tree/layout.py; the file's own, for a file read with
    #: aliases): the result's code reuses that of the statements the edits leave as they were
    layout: Optional[object] = None
    #: a node of the analysed tree -> its parent: the edits are applied along the paths to the
    #: nodes they are keyed on only
    parent: Optional[Callable[[cst.CSTNode], Optional[cst.CSTNode]]] = None
    #: the statements of the file and of its results parsed by the flow check, by their code
    #: (flow.unbound_in): a statement kept is parsed once for all the attempts at the edits
    trees: dict = field(default_factory=dict)
    #: the comments and blank lines of the statements the trivia checks tokenized, by their code
    #: (codemod/edits/preserve.py)
    trivia: dict = field(default_factory=dict)
    #: of a file read with aliases (whose view's statements are read without them): the layout
    #: of the file's own tree, and each view statement's own statement (by the view's id); a
    #: result is then a tree of the file's own statements and the changed ones (``home_tree``)
    home: Optional[Layout] = None
    home_of: dict[int, cst.BaseStatement] = field(default_factory=dict)

    @property
    def printed_as_read(self) -> bool:
        """Whether the view's tree prints as the file's text (and a tree made from it as the text
        made): no alias read back, no line LibCST prints otherwise put back."""
        return self.roundtrip == self.head and not (self.aliases or self.renames)

    def made_layout(self) -> Optional[Layout]:
        """The layout of the trees made for this file (``home_tree``, and a compatible change's of
        them): the view's where it prints as read, the file's own where it is read with aliases
        and prints as read; None where LibCST prints it otherwise (its texts are parsed)."""
        if self.printed_as_read:
            return self.layout
        return self.home if self.roundtrip == self.head else None

    def home_tree(self, new: cst.Module, code: str) -> Optional[cst.Module]:
        """For a file read with aliases that prints as read: the tree whose code is ``code``, the
        edits' result ``new`` (its changed statements read with the aliases again), with the
        statements the edits kept as the file's own (``home_of``); None where that tree's code
        is not ``code`` (then the text is parsed). What the compatible change and the keyword
        calls read, instead of parsing the text made at each attempt."""
        if self.home is None or self.roundtrip != self.head:
            return None
        tree = new.with_changes(body=[self.home_of.get(id(s), s) for s in new.body])
        return tree if self.home.code_of(tree) == code else None

    def local(self, line: int) -> Optional[int]:
        unit, local = self.where(line)
        return local if unit == self.index else None


def units_of(facts: "ScriptFacts", project: Project, scope: Scope) -> list[Unit]:
    """Each file of the project as the engine applies the edits to it: its tree made of the
    analysed module's statements (those the edits are keyed on) and its own others (the imports
    that were replaced by a module's statements), what it read undefined or unbound already, and
    whether it may change (``scope``)."""
    from accelerate_rewrite.codemod.checks import _all_names_resolve, undefined_names

    combined_starts = facts.layout().starts()
    where = project.locator(combined_starts)
    at: dict[tuple[int, int], int] = {o: k for k, o in enumerate(project.origin)}
    units = []
    for p, part in enumerate(project.parts):
        body = [facts.module.body[at[(p, i)]] if (p, i) in at else stmt for i, stmt in enumerate(part.module.body)]
        view = part.module.with_changes(body=body)
        own = part.layout if part.layout is not None else Layout(part.module)
        # each statement printed as the file's own (read through its aliases again, if it has any)
        known = {id(v): own.piece(o) for v, o in zip(view.body, part.module.body)}
        aliased = bool(part.aliases or part.renames)
        unit = Unit(
            path=part.path, source=part.source, head=part.head, tail=part.tail, roundtrip=own.code,
            view=view, layout=Layout(view, known=known),
            undefined=lambda m=part.module, head=part.head: {} if _all_names_resolve([head]) else undefined_names(m),
            unbound=(part.head, lambda head=part.head: maybe_unbound(head)), where=where, index=p,
            refusal=(lambda before, after, path=part.path: scope.refusal(path, changed_names(before, after)))
            if p else None, compatible=bool(p) and scope.compatible_change(part.path),
            users=lambda before, after, path=part.path: scope.users(path, changed_names(before, after)),
            free=lambda before, after, path=part.path: frozenset(
                n for n in (changed_names(before, after) or ()) if scope.refusal(path, frozenset({n})) is None),
            aliases=part.aliases, renames=part.renames,
            parent=facts.parent, home=own if aliased else None,
            home_of={id(v): o for v, o in zip(view.body, part.module.body)} if aliased else {})
        unit.first_read = lambda name, u=unit: (lambda line: u.local(line) if line is not None else None)(
            facts.first_read(name))
        units.append(unit)
    return units


def relocate(message: str, unit: Unit, units: list[Unit]) -> str:
    """A note naming lines of the analysed module (``on lines 36, 82``) names those of the
    files instead (``on lines 12, 40``; ``engine.py:9`` for another file's)."""
    def lines(match) -> str:  # a re.Match
        groups: list[tuple[int, list[int]]] = []
        for number in (int(n) for n in match.group("numbers").split(", ")):
            owner, line = unit.where(number)
            if groups and groups[-1][0] == owner:
                groups[-1][1].append(line)
            else:
                groups.append((owner, [line]))
        return ", ".join(f"{'lines' if len(ls) > 1 else 'line'} {', '.join(map(str, ls))}" if owner == unit.index
                         else ", ".join(f"{units[owner].path}:{n}" for n in ls) for owner, ls in groups)

    from accelerate_rewrite.codemod.files.notebook import LINES

    return LINES.sub(lines, message)
