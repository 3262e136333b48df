"""A script and the project's own modules it imports, analysed as one program.

``from engine import train_one_epoch`` in train.py, with engine.py next to it: the training loop
is in one file, the model, optimizer and loaders in the other, and a conversion is only right
if both change together (the driver creates Fabric and passes it, the loop takes it). So the
script's ``from X import ...`` statements of modules in its folder (``engine.py``,
``data/loaders.py``, ``util/misc.py``) are replaced, for the
analysis only, by the statements of those modules, as Python runs them at that point; the rules
see one module, record their edits on it, and the engine applies them to each file apart and
checks each file apart (codemod/engine.py).

``import engine`` (or ``import engine as E``) is followed the same way, its statement replaced
by the module's; the script's ``engine.train_one_epoch`` is read by the analysis as
``train_one_epoch`` (``_Dealias``), and its file gets the spelling back (``Realias``; both
in codemod/project/names.py, with what is read of a module's names). That is
sound only when the script reads ``engine`` as ``engine.name`` alone and has no name of its own
that it reads so (``_reads_through``).

A module is followed only when that is sound: it parses, it is the project's (found where
Python finds it, codemod/project/targets.py: the script's folder and the ones it puts on
``sys.path``, the folder above its own package, the project's root, ``src/`` and setuptools'
``where``; never an installed package, nor a library that codemod/analysis/libraries.py knows,
even vendored), and the names imported from it are its own top-level definitions (a name a
package's ``__init__.py`` imports from one of its modules is read in that module; ``from X
import *`` reads all of them). Packages (``from util import misc``), relative imports inside the
project's modules (never in the script, which has no package), ``import a.b as c`` and ``from X
import A as B`` (read as ``A``, ``_Dealias``; its file keeps ``B``, ``Realias``) are followed. A
module's ``if __name__ == "__main__":`` block is left out (importing it never runs it), and so
are the definitions the program can't reach by name (``_needed``). The names a module binds at
its top level must not be bound otherwise by the script or another followed module (``import
torch`` in both is the same binding; a name the importer does not read, its own or one it
imports as something else, is renamed for the analysis only, ``_own_name``). Otherwise it stays
an import the analysis can't see into, as any other, and the
note says why.

Which files may change is the caller's: a file named on the command line never changes a file
outside the paths given, unless ``--follow-imports`` (``Scope``).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional

import libcst as cst

from accelerate_rewrite.codemod.tree.layout import Layout, layout_of
from accelerate_rewrite.codemod.tree.printing import module_code
from accelerate_rewrite.codemod.tree.toplevel import python_tree
from accelerate_rewrite.codemod.project.names import (
    _Dealias,
    _imports_of,
    _needed,
    _own_name,
    _reads_through,
    _renamable,
    _same_meaning,
    _top_names,
)
# Scope and candidates are read with ast only: the runner reaches them without loading libcst
from accelerate_rewrite.codemod.analysis.importers import Scope  # noqa: F401
from accelerate_rewrite.codemod.analysis.siblings import (  # noqa: F401
    MAX_MODULES,
    candidates,
    import_folders,
    imported_modules,
    package_of,
    sys_path_folders,
)
from accelerate_rewrite.codemod.analysis.hints import MARK_WORD
from accelerate_rewrite.codemod.analysis.syntax import is_main_guard
from accelerate_rewrite.codemod.project.targets import _Target, _dotted, _targets

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.facts import ScriptFacts


@dataclass
class Part:
    """One file of the project: the script (first) or a module it imports."""

    path: str
    source: str
    head: str  # what LibCST reads of it (codemod/edits/preserve.py split_tail)
    tail: str
    module: cst.Module  # parsed alone
    dotted: Optional[str] = None  # the module's name; None for the script
    #: the package whose ``__init__.py`` imports its names from it (``_reexported``), if any
    via: Optional[str] = None
    #: the line each top-level statement starts on, its leading lines included, and the line
    #: after the last one
    starts: list[int] = field(default_factory=list)
    #: ``import engine as E`` followed: name -> the alias it is read through (``train`` -> ``E``);
    #: the analysis reads ``E.train`` as ``train``, the file gets ``E.train`` back (``Realias``)
    aliases: dict[str, str] = field(default_factory=dict)
    #: its statements' code (codemod/tree/layout.py), printed once for every use
    layout: Optional[Layout] = None
    #: ``from utils import NativeScalerWithGradNormCount as NativeScaler`` followed: the name
    #: the analysis reads -> the file's own (``NativeScalerWithGradNormCount`` -> ``NativeScaler``)
    renames: dict[str, str] = field(default_factory=dict)
    #: the file, for a module (its relative imports start from it), and its package
    file: Optional[Path] = None
    package: str = ""
    #: a module's functions and classes the program can reach from what it imports of it
    #: (``_needed``); None: all of them
    needed: Optional[set[str]] = None


@dataclass
class Project:
    parts: list[Part]
    combined: cst.Module
    #: per statement of ``combined``: (index of its part, index in that part's body)
    origin: list[tuple[int, int]]
    #: modules the script imports that are not followed: (line in the script, why)
    unfollowed: list[tuple[int, str]] = field(default_factory=list)

    def known(self) -> dict[int, tuple[str, int]]:
        """id(statement of ``combined``) -> its code, for those that are a file's own (not read
        through an alias): ``Layout(combined, known=...)`` prints only the others."""
        out: dict[int, tuple[str, int]] = {}
        for stmt, (p, i) in zip(self.combined.body, self.origin):
            part = self.parts[p]
            if part.layout is not None and stmt is part.module.body[i]:
                out[id(stmt)] = part.layout.piece(stmt)
        return out

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


#: a module's text (``head``) -> its text without its main block: each program of a repository
#: that follows the module asks, and each statement that imports it (``accelerate-rewrite .``)
_MAINLESS: dict[str, str] = {}
_MAINLESS_MAX = 64


def _without_main(module: cst.Module, head: str) -> str:
    """A module's text as importing it runs it: without its ``if __name__ == "__main__":``
    block (what it does when run as a script of its own). ``module``: LibCST's parse of
    ``head``."""
    if not any(is_main_guard(stmt) for stmt in module.body):
        return head
    found = _MAINLESS.get(head)
    if found is None:
        if len(_MAINLESS) >= _MAINLESS_MAX:
            _MAINLESS.pop(next(iter(_MAINLESS)))
        found = _MAINLESS[head] = module_code(module.with_changes(
            body=[stmt for stmt in module.body if not is_main_guard(stmt)]))
    return found


def build(path: str, head: str, module: cst.Module, source: str,
          read: Callable[[Path], Optional[tuple[str, str, str, cst.Module]]],
          words: tuple[str, ...] = (), peek: Optional[Callable[[Path], Optional[str]]] = None) -> Optional[Project]:
    """The script at ``path`` with the project's modules it imports, or None when it imports
    none that is followed. ``read(file)`` gives a module's (source, head, tail, module), or None
    when it can't be read or parsed; ``peek(file)`` its text alone (None where it can't be read),
    what is asked first: a module the text says is not followed is not parsed. ``words``: a
    module that mentions none of them (as the runner's fast path reads files) is not worth a
    note when it is not followed."""
    if peek is None:
        peek = lambda file: (lambda got: None if got is None else got[0])(read(file))  # noqa: E731
    folder = Path(path).parent
    try:  # and the folders the script puts on sys.path (``sys.path.append("..")``), its project's root
        folders = import_folders(folder, python_tree(source))
    except (SyntaxError, ValueError):
        folders = import_folders(folder, None)
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

    script.layout = layout_of(module, head)
    script.starts = script.layout.starts()

    def expand(part_index: int) -> list[tuple[int, int]]:
        part = parts[part_index]
        out: list[tuple[int, int]] = []
        for index, stmt in enumerate(part.module.body):
            if part_index and is_main_guard(stmt):
                continue  # what the module does when run as a script: not on import
            if part_index and part.needed is not None and isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) \
                    and stmt.name.value not in part.needed:
                continue  # nothing the script runs uses it (pytorchyolo/test.py's own ``run``)
            targets = _targets(stmt, part.file, part.package, folders)
            if not targets or any(os.path.realpath(t.file) == real_script for t in targets):
                out.append((part_index, index))
                continue
            kept = False
            followed = False  # a name of the statement read where its package re-exports it from
            expanded: list[tuple[int, int]] = []
            for target in targets:
                why = _take(part, target)
                if isinstance(why, str):
                    if part_index == 0 and why:
                        unfollowed.append((line_of(part, index), why))
                    kept = True
                    if target.imp is not None and target.via is None:
                        break  # the statement's own names stay imported: its modules are not read
                    continue
                followed = followed or target.via is not None
                if isinstance(why, tuple):  # more of a module in already: its definitions the importer needs
                    more_of, names = why
                    expanded.extend((more_of, i) for i, st in enumerate(parts[more_of].module.body)
                                    if isinstance(st, (cst.FunctionDef, cst.ClassDef)) and st.name.value in names)
                elif why is not None:
                    expanded.extend(expand(why))
            if kept and followed:
                # the statement stays for the names not followed, and comes first: the followed
                # modules' statements bind theirs after it, as the analysis reads them
                out.append((part_index, index))
                out.extend(expanded)
                continue
            out.extend(expanded)
            if kept:
                out.append((part_index, index))
        return out

    def _take(part: Part, target: _Target):
        """Follow ``target`` for ``part``: the index of its new part (whose statements are to
        be expanded), None when it is in already, or why it is not followed (a str; "" for no note)."""
        read_through: dict[str, str] = {}
        renames: dict[str, str] = {}
        if target.through is not None:  # ``import engine as E``: read as ``E.train``
            why = _through(part, target.file, target.through)
            if isinstance(why, str):
                return why
            read_through = why
        else:
            for alias in target.imp.names if not isinstance(target.imp.names, cst.ImportStar) else ():
                if alias.asname is None:
                    continue
                name, own_name = _dotted(alias.name), _dotted(alias.asname.name)
                try:
                    why = _renamable(part.head, name, own_name)
                except (SyntaxError, ValueError):
                    why = "it can't be read or parsed"
                if why is not None:
                    return f"{_shown(target.file)} is not followed: `{name}` is imported as `{own_name}`, and {why}"
                renames[name] = own_name
        if target.dotted in included:
            part.aliases.update(read_through)
            part.renames.update(renames)
            other = parts[included[target.dotted]]
            if other.needed is None:
                return None  # its statements are in already: the names are bound
            wanted = set(read_through) if target.through is not None else {
                _dotted(a.name) for a in (target.imp.names if not isinstance(target.imp.names, cst.ImportStar) else ())}
            more = _needed(_without_main(other.module, other.head), wanted | other.needed)
            added = (more or set()) - other.needed
            if more is None:
                added = {st.name.value for st in other.module.body if isinstance(st, (cst.FunctionDef, cst.ClassDef))
                         and st.name.value not in other.needed}
            other.needed |= added
            return (included[target.dotted], added) if added else None
        wanted = set(read_through) if target.through is not None else {
            _dotted(a.name) for a in (target.imp.names if not isinstance(target.imp.names, cst.ImportStar) else ())}
        why = _follow(target.dotted, target.file, target.imp, wanted, target.via)
        if isinstance(why, str):
            return why
        part.aliases.update(read_through)  # only once the module is followed
        part.renames.update(renames)
        return why

    def _through(part: Part, file: Path, through: str):
        """The names ``part`` reads through ``through`` (``import engine as E``), each mapped to
        ``through``, when they are the module's own and may be read bare by the analysis; or
        why not (a str)."""
        shown = _shown(file)
        text = peek(file)
        if words and text is not None and not any(w in text.lower() for w in words):
            return ""  # nothing there a rule looks at: no note (and the module is not parsed)
        got = read(file)
        if got is None:
            return f"{shown} is not followed: it can't be read or parsed"
        try:
            m_own, _ = _top_names(_without_main(got[3], got[1]))
            used, why = _reads_through(part.head, through, m_own)
        except (SyntaxError, ValueError):
            return f"{shown} is not followed: it can't be read or parsed"
        if why is not None:
            return f"{shown} is not followed: {why}"
        taken = [name for name in used if part.aliases.get(name, through) != through]
        if taken:
            return f"{shown} is not followed: `{taken[0]}` is read through two modules"
        return {name: through for name in used}

    def _shown(file: Path) -> str:
        return os.path.relpath(file) if not os.path.isabs(path) else str(file)

    def _follow(dotted: str, file: Path, imp: Optional[cst.ImportFrom], wanted: set[str] = frozenset(),
                via: Optional[str] = None):
        """The index of the new part, or why the module is not followed. ``wanted``: the names
        the importer reads of it; a name of the module's own that another file defines too
        (``logger = getLogger()`` in both) is read under a name of its own (``_own_name``) when
        the importer does not read it."""
        shown = _shown(file)
        if len(parts) > MAX_MODULES:
            return f"{shown} is not followed: more than {MAX_MODULES} modules"
        text = peek(file)  # what the text alone says first: a module not followed is not parsed
        if words and text is not None and not any(w in text.lower() for w in words):
            return ""  # nothing there a rule looks at: no note
        got = read(file)
        if got is None:
            return f"{shown} is not followed: it can't be read or parsed"
        text, m_head, m_tail, m_module = got
        imported_code = _without_main(m_module, m_head)  # as importing it runs it
        package = package_of(file, dotted)
        try:
            m_own, m_imported = _top_names(imported_code)
        except (SyntaxError, ValueError):
            return f"{shown} is not followed: it can't be read or parsed"
        star = imp is not None and isinstance(imp.names, cst.ImportStar)  # every public name: read them all
        for alias in imp.names if imp is not None and not star else ():
            name = _dotted(alias.name)
            if name not in m_own:  # a name it imports itself (``from apex import amp``) is not its own
                return f"{shown} is not followed: `{name}` is not defined there (imported, or not at its top level)"
        m_imports = _imports_of(imported_code, package)
        index = len(parts)
        def itself(name: str) -> frozenset:  # imported from it (or through its package's __init__)
            return frozenset({f"{dotted}.{name}"}) if via is None or imports.get(name, (0, None))[1] != frozenset(
                {f"{via}.{name}"}) else frozenset({f"{via}.{name}"})
        own_names: dict[str, str] = {}  # the analysis's name -> the module's
        for name in sorted(m_own | set(m_imports)):
            if name in bound and name not in m_own and parts[bound[name]].dotted is not None \
                    and m_imports.get(name) in ({f"{parts[bound[name]].dotted}.{name}"},
                                                {f"{parts[bound[name]].via}.{name}"}):
                continue  # ``from .resample import LossAwareSampler``: the one a followed module defines
            clash = name in bound or (name in imports and imports[name][1] != itself(name) and name in m_own)
            if clash and name in m_own and name not in wanted:
                own_names[_own_name(name, dotted)] = name
                continue
            if name in bound:
                return f"{shown} is not followed: `{name}` is defined both there and in {parts[bound[name]].path}"
            if name not in imports or imports[name][1] == itself(name):
                continue
            if name not in m_own and name not in wanted and name in m_imports \
                    and not _same_meaning(imports[name][1], m_imports[name]):
                # ``import torch.multiprocessing as mp`` where the script's ``mp`` is Python's
                # (ijepa's src/train.py): read under a name of its own, as an own name clashing is
                own_names[_own_name(name, dotted)] = name
                continue
            if name in m_own or not _same_meaning(imports[name][1], m_imports.get(name, frozenset())):
                return (f"{shown} is not followed: `{name}` is defined both there and in "
                        f"{parts[imports[name][0]].path}" if name in m_own else
                        f"{shown} is not followed: it imports `{name}` as something else than "
                        f"{parts[imports[name][0]].path} does")
        renamed = set(own_names.values())
        for name in m_own:
            if name not in renamed:
                bound[name] = index
        for name in own_names:
            bound[name] = index
        for name, meaning in m_imports.items():
            imports.setdefault(name, (index, meaning))
        part = Part(path=str(file) if os.path.isabs(path) else os.path.relpath(file), source=text,
                    head=m_head, tail=m_tail, module=m_module, dotted=dotted, file=file, package=package, via=via)
        part.renames.update(own_names)
        part.needed = _needed(imported_code, wanted) if wanted else None
        part.layout = layout_of(m_module, m_head)
        part.starts = part.layout.starts()
        parts.append(part)
        included[dotted] = index
        return index

    origin = expand(0)
    if len(parts) == 1:
        unfollowed = [(line, why) for line, why in unfollowed if why]
        return Project(parts, module, origin, unfollowed) if unfollowed else None
    # names the script imports from the modules followed are bound by their statements now, and
    # those it reads through a module (``E.train``) are read bare
    # (the statements analysed only, and of those only the ones whose code spells such a name:
    # the others stay the file's own, their code known)
    dealias = [_Dealias(p.aliases, p.renames) if p.aliases or p.renames else None for p in parts]
    spelled = [set(p.aliases.values()) | set(p.renames.values()) for p in parts]
    read_as: dict[tuple[int, int], cst.BaseStatement] = {}
    for p, i in origin:
        if (p, i) not in read_as:
            stmt = parts[p].module.body[i]
            if dealias[p] is not None and any(name in parts[p].layout.piece(stmt)[0] for name in spelled[p]):
                stmt = dealias[p].along(stmt)
            read_as[p, i] = stmt
    body = [read_as[key] for key in origin]
    combined = module.with_changes(body=body)
    return Project(parts, combined, origin, [(line, why) for line, why in unfollowed if why])


_PROJECTS: dict[tuple, tuple["ScriptFacts", Project]] = {}


def analyse(key: tuple, project: Project, folder: Optional[Path]) -> tuple[ScriptFacts, Project]:
    """The facts of a project's analysed module, kept for the next rewrites of the same files
    (as ``_analyse`` keeps a script's): the tests rewrite each project with many options."""
    from accelerate_rewrite.codemod.analysis.facts import ScriptFacts

    if key not in _PROJECTS:
        if len(_PROJECTS) >= 4:
            _PROJECTS.pop(next(iter(_PROJECTS)))
        facts = ScriptFacts(project.combined, folder, fresh=True, body_parts=[part for part, _ in project.origin],
                            known=project.known(), marked=any(MARK_WORD in p.source for p in project.parts),
                            part_files=[p.file if p.file is not None else Path(p.path) for p in project.parts])
        _PROJECTS[key] = (facts, project)
    return _PROJECTS[key]
