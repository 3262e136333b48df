"""A script and the project's own modules it imports, analysed as one program.

``from engine import train_one_epoch`` in train.py, with engine.py next to it: the training loop
is in one file, the model, optimizer and loaders in the other, and a conversion is only right
if both change together (the driver creates Fabric and passes it, the loop takes it). So the
script's ``from X import ...`` statements of modules in its folder (``engine.py``,
``data/loaders.py``; never an installed package, never a relative import) are replaced, for the
analysis only, by the statements of those modules, as Python runs them at that point; the rules
see one module, record their edits on it, and the engine applies them to each file apart and
checks each file apart (codemod/engine.py).

A module is followed only when that is sound: it parses, it does not run as a script of its own
(``if __name__ == "__main__":``), it imports nothing relatively (``from . import amp`` would mean
something else in the script), the names imported from it are its own top-level definitions under
the same names (no ``as``; not names it imports itself: a vendored ``apex/__init__.py`` is not
the project's code), and the names it binds at its top level are not bound otherwise by the
script or another followed module (``import torch`` in both is the same binding). Otherwise
it stays an import the analysis can't see into, as any other, and the note says why.

Which files may change is the caller's: a file named on the command line never changes a file
outside the paths given, unless ``--follow-imports`` (``Scope``).
"""

from __future__ import annotations

import ast
import os
import symtable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import libcst as cst

from accelerate_rewrite.codemod.flow import maybe_unbound
# Scope and candidates are read with ast only: the runner reaches them without loading libcst
from accelerate_rewrite.codemod.siblings import MAX_MODULES, Scope, _file, candidates, imported_modules  # noqa: F401

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.facts import ScriptFacts


@dataclass
class Part:
    """One file of the project: the script (first) or a module it imports."""

    path: str
    source: str
    head: str  # what LibCST reads of it (codemod/preserve.py split_tail)
    tail: str
    module: cst.Module  # parsed alone
    dotted: Optional[str] = None  # the module's name; None for the script
    #: the line each top-level statement starts on, its leading lines included, and the line
    #: after the last one
    starts: list[int] = field(default_factory=list)


@dataclass
class Project:
    parts: list[Part]
    combined: cst.Module
    #: per statement of ``combined``: (index of its part, index in that part's body)
    origin: list[tuple[int, int]]
    #: modules the script imports that are not followed: (line in the script, why)
    unfollowed: list[tuple[int, str]] = field(default_factory=list)

    def locator(self, combined_starts: list[int]) -> Callable[[int], tuple[int, int]]:
        """combined line -> (part index, line in that part)."""
        import bisect

        def locate(line: int) -> tuple[int, int]:
            i = bisect.bisect_right(combined_starts, line) - 1
            if i < 0 or i >= len(self.origin):
                return 0, line
            part, index = self.origin[i]
            return part, self.parts[part].starts[index] + (line - combined_starts[i])

        return locate


def statement_starts(module: cst.Module) -> list[int]:
    """The line each top-level statement of ``module`` starts on (its leading lines included),
    then the line after the last one: from the code LibCST prints, as its positions are."""
    line = 1 + len(module.header)
    out = []
    for stmt in module.body:
        out.append(line)
        line += module.code_for_node(stmt).count("\n")
    out.append(line)
    return out


def _from_sibling(stmt: cst.CSTNode, folder: Path) -> Optional[tuple[str, Path, cst.ImportFrom]]:
    if not (isinstance(stmt, cst.SimpleStatementLine) and len(stmt.body) == 1
            and isinstance(stmt.body[0], cst.ImportFrom)):
        return None
    imp = stmt.body[0]
    if imp.relative or imp.module is None:
        return None
    dotted = cst.Module(body=[]).code_for_node(imp.module)
    file = _file(folder, dotted)
    return (dotted, file, imp) if file is not None else None


def _imports_of(code: str) -> dict[str, frozenset[str]]:
    """name -> what the import statements at the top level of ``code`` (and in its top-level
    ``if`` and ``try`` blocks) bind it to: ``torch``, ``torch.nn:functional``."""
    out: dict[str, set[str]] = {}
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return {}
    todo = list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            for a in node.names:
                name = a.asname or a.name.split(".")[0]
                out.setdefault(name, set()).add(a.name if a.asname else name)
        elif isinstance(node, ast.ImportFrom):
            for a in node.names:
                out.setdefault(a.asname or a.name, set()).add(f"{'.' * node.level}{node.module}:{a.name}")
        elif isinstance(node, (ast.If, ast.Try)):
            todo.extend(node.body + node.orelse + getattr(node, "finalbody", [])
                        + [s for h in getattr(node, "handlers", []) for s in h.body])
    return {name: frozenset(meanings) for name, meanings in out.items()}


def _top_names(code: str) -> tuple[set[str], set[str]]:
    """(names the module binds at its top level otherwise than by an import, names it imports)."""
    table = symtable.symtable(code, "<module>", "exec")
    own, imported = set(), set()
    for s in table.get_symbols():
        if s.is_assigned() or s.is_namespace():
            own.add(s.get_name())
        elif s.is_imported():
            imported.add(s.get_name())
    return own, imported


def _runs_as_script(module: cst.Module) -> bool:
    for stmt in module.body:
        if isinstance(stmt, cst.If) and "__main__" in cst.Module(body=[]).code_for_node(stmt.test):
            return True
    return False


def build(path: str, head: str, module: cst.Module, source: str,
          read: Callable[[Path], Optional[tuple[str, str, str, cst.Module]]],
          words: tuple[str, ...] = ()) -> Optional[Project]:
    """The script at ``path`` with the project's modules it imports, or None when it imports
    none that is followed. ``read(file)`` gives a module's (source, head, tail, module), or None
    when it can't be read or parsed. ``words``: a module that mentions none of them (as the
    runner's fast path reads files) is not worth a note when it is not followed."""
    folder = Path(path).parent
    script = Part(path=path, source=source, head=head, tail=source[len(head):], module=module)
    parts = [script]
    unfollowed: list[tuple[int, str]] = []
    try:
        own, imported = _top_names(head)
    except (SyntaxError, ValueError):
        return None
    bound: dict[str, int] = {name: 0 for name in own}  # name -> part that binds it (not by import)
    imports = {name: (0, meaning) for name, meaning in _imports_of(head).items()}
    included: dict[str, int] = {}  # dotted -> part index
    real_script = os.path.realpath(path)

    def line_of(part: Part, index: int) -> int:
        return part.starts[index] + len(getattr(part.module.body[index], "leading_lines", ()))

    script.starts = statement_starts(module)

    def expand(part_index: int) -> list[tuple[int, int]]:
        part = parts[part_index]
        out: list[tuple[int, int]] = []
        for index, stmt in enumerate(part.module.body):
            found = _from_sibling(stmt, folder)
            if found is None or os.path.realpath(found[1]) == real_script:
                out.append((part_index, index))
                continue
            dotted, file, imp = found
            if dotted in included:
                continue  # its statements are in already: the names are bound
            why = _follow(dotted, file, imp)
            if isinstance(why, str):
                if part_index == 0:
                    unfollowed.append((line_of(part, index), why))
                out.append((part_index, index))
                continue
            out.extend(expand(why))
        return out

    def _follow(dotted: str, file: Path, imp: cst.ImportFrom):
        """The index of the new part, or why the module is not followed."""
        shown = os.path.relpath(file) if not os.path.isabs(path) else str(file)
        if len(parts) > MAX_MODULES:
            return f"{shown} is not followed: more than {MAX_MODULES} modules"
        got = read(file)
        if got is None:
            return f"{shown} is not followed: it can't be read or parsed"
        text, m_head, m_tail, m_module = got
        if words and not any(w in text.lower() for w in words):
            return ""  # nothing there a rule looks at: no note
        if isinstance(imp.names, cst.ImportStar):
            return f"{shown} is not followed: `from {dotted} import *`"
        try:
            m_own, m_imported = _top_names(m_head)
        except (SyntaxError, ValueError):
            return f"{shown} is not followed: it can't be read or parsed"
        for alias in imp.names:
            name = cst.Module(body=[]).code_for_node(alias.name)
            if alias.asname is not None:
                return f"{shown} is not followed: `{name}` is imported under another name"
            if name not in m_own:  # a name it imports itself (``from apex import amp``) is not its own
                return f"{shown} is not followed: `{name}` is not defined there (imported, or not at its top level)"
        if any(m.startswith(".") for meanings in _imports_of(m_head).values() for m in meanings):
            # its relative imports (``from . import amp``) would mean something else in the script
            return f"{shown} is not followed: it imports relatively (`from . import ...`)"
        if _runs_as_script(m_module):
            return f"{shown} is not followed: it runs as a script of its own (`if __name__ == \"__main__\":`)"
        m_imports = _imports_of(m_head)
        index = len(parts)
        itself = lambda name: frozenset({f"{dotted}:{name}"})  # noqa: E731 (imported from it)
        for name in sorted(m_own | set(m_imports)):
            if name in bound:
                return f"{shown} is not followed: `{name}` is defined both there and in {parts[bound[name]].path}"
            if name not in imports or imports[name][1] == itself(name):
                continue
            if name in m_own or imports[name][1] != m_imports.get(name):
                return (f"{shown} is not followed: `{name}` is defined both there and in "
                        f"{parts[imports[name][0]].path}" if name in m_own else
                        f"{shown} is not followed: it imports `{name}` as something else than "
                        f"{parts[imports[name][0]].path} does")
        for name in m_own:
            bound[name] = index
        for name, meaning in m_imports.items():
            imports.setdefault(name, (index, meaning))
        part = Part(path=str(file) if os.path.isabs(path) else os.path.relpath(file), source=text,
                    head=m_head, tail=m_tail, module=m_module, dotted=dotted)
        part.starts = statement_starts(m_module)
        parts.append(part)
        included[dotted] = index
        return index

    origin = expand(0)
    if len(parts) == 1:
        return Project(parts, module, origin, unfollowed) if unfollowed else None
    # names the script imports from the modules followed are bound by their statements now
    body = [parts[p].module.body[i] for p, i in origin]
    combined = module.with_changes(body=body)
    return Project(parts, combined, origin, [(line, why) for line, why in unfollowed if why])


# ---- the files the edits apply to ----------------------------------------------------------

@dataclass
class Unit:
    """One file the edits apply to: the script, or a module of its project."""

    path: str
    source: str
    head: str
    tail: str
    roundtrip: str
    view: cst.Module  # the file's tree, made of the analysed module's statements where it has them
    undefined: dict[str, int]  # names the file read undefined already
    unbound: tuple[str, dict]
    #: a line of the analysed module -> (index of the unit that holds it, line in that file)
    where: Callable[[int], tuple[int, int]]
    index: int = 0
    refusal: Optional[str] = None  # why this file may not change
    first_read: Callable[[str], Optional[int]] = lambda name: None

    def local(self, line: int) -> Optional[int]:
        unit, local = self.where(line)
        return local if unit == self.index else None


def units_of(facts: "ScriptFacts", project: Project, scope: Scope) -> list[Unit]:
    """Each file of the project as the engine applies the edits to it: its tree made of the
    analysed module's statements (those the edits are keyed on) and its own others (the imports
    that were replaced by a module's statements), what it read undefined or unbound already, and
    whether it may change (``scope``)."""
    from accelerate_rewrite.codemod.checks import _all_names_resolve, undefined_names

    combined_starts = statement_starts(facts.module)
    where = project.locator(combined_starts)
    at: dict[tuple[int, int], int] = {o: k for k, o in enumerate(project.origin)}
    units = []
    for p, part in enumerate(project.parts):
        body = [facts.module.body[at[(p, i)]] if (p, i) in at else stmt for i, stmt in enumerate(part.module.body)]
        unit = Unit(
            path=part.path, source=part.source, head=part.head, tail=part.tail, roundtrip=part.module.code,
            view=part.module.with_changes(body=body),
            undefined={} if _all_names_resolve(part.head) else undefined_names(part.module),
            unbound=(part.head, maybe_unbound(part.head)), where=where, index=p,
            refusal=scope.refusal(part.path) if p else None)
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

    from accelerate_rewrite.codemod.notebook import LINES

    return LINES.sub(lines, message)


_PROJECTS: dict[tuple, tuple["ScriptFacts", Project]] = {}


def analyse(key: tuple, project: Project, folder: Optional[Path]) -> tuple[ScriptFacts, Project]:
    """The facts of a project's analysed module, kept for the next rewrites of the same files
    (as ``_analyse`` keeps a script's): the tests rewrite each project with many options."""
    from accelerate_rewrite.codemod.facts import ScriptFacts

    if key not in _PROJECTS:
        if len(_PROJECTS) >= 4:
            _PROJECTS.pop(next(iter(_PROJECTS)))
        _PROJECTS[key] = (ScriptFacts(project.combined, folder), project)
    return _PROJECTS[key]
