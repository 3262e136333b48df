"""The scripts of one run as one plan (issue 58): which files of the run are scripts (entry
points that may train) and which are their modules, each script's Scope, and, once each is
prepared (prepare.py, through the cache), one text for every file that several of them change
(a module they share, a script a launcher imports), merged (codemod/project/merge.py), with the
plain change of a module where every script that imports it converts. runner.py shows and
writes what this gives. Nothing here imports torch or lightning.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Optional, Sequence

from accelerate_rewrite.codemod.files.paths import Target
from accelerate_rewrite.prepare import Prepared
from accelerate_rewrite.settings import Mode, Settings

if TYPE_CHECKING:
    from accelerate_rewrite.codemod.analysis.importers import Scope


#: a file that runs as a script of its own (``if __name__ == "__main__":``)
_MAIN = re.compile(r"""^if\s+__name__\s*==\s*['"]__main__['"]\s*:""", re.MULTILINE)


def projects(targets: Sequence[Target], settings: Settings) -> tuple[dict[Path, "Scope"], set[Path]]:
    """The scripts of the run and their projects (codemod/project/program.py): each script's Scope
    (the targets may change with it, or any module with ``--follow-imports``, or by default any
    whose changed names no other file under the script's folder reads; a module that another
    script of the run imports too changes only so that the others keep working, and the run
    merges what each script changes there: ``plan``), and the targets that a script of the run
    imports and that don't run as scripts of their own (rewritten with it, not on their own). A
    target that another imports but that runs as a script of its own (DINO's main_dino.py, which
    run_with_submitit.py imports) is a script of the run too."""
    from accelerate_rewrite.codemod.analysis.importers import Scope
    from accelerate_rewrite.codemod.analysis.siblings import candidates

    python = [t for t in targets if t.error is None and t.path.suffix == ".py"]
    if not python:
        return {}, set()
    real = {os.path.realpath(t.path): t.path for t in targets}
    writable = frozenset(real)
    texts: dict[Path, Optional[str]] = {}

    def text_of(file: Path) -> Optional[str]:
        if file not in texts:
            try:
                texts[file] = file.read_text(encoding="utf-8", errors="replace")
            except OSError:
                texts[file] = None
        return texts[file]

    imports: dict[Path, list[str]] = {}
    for target in python:
        text = text_of(target.path)
        if text is None or "import" not in text:
            continue
        files = [os.path.realpath(f) for f in candidates(target.path, text, text_of)]
        if files:
            imports[target.path] = files
    claimed = {real[f] for files in imports.values() for f in files if f in real}
    claimed = {c for c in claimed if not _MAIN.search(text_of(c) or "")}
    drivers = {path: files for path, files in imports.items() if path not in claimed}
    importers: dict[str, list[Path]] = {}
    for path, files in drivers.items():
        for f in files:
            importers.setdefault(f, []).append(path)
    scopes = {}
    # every file of the run gets its scope: a module a script imports is rewritten on its own too
    # where the script's program does not follow it (codemod/project/program.py says why)
    for path, files in imports.items():
        shared = tuple((f, " and ".join(str(p) for p in importers[f] if p != path))
                       for f in files if len(importers[f]) > 1) if path in drivers else ()
        follow = settings.follow_imports
        if follow is None:
            try:
                follow = settings.choice_for(path).follow_imports
            except Exception:  # noqa: BLE001 - a bad configuration: prepare() reports it
                follow = None
        # not told either way: a module may change with the script when no other file under its
        # folder reads what changes; never for -o (one file written) or the hook (files staged)
        auto = follow is None and settings.mode is not Mode.OUTPUT and not settings.hook
        scripts = frozenset(f for f in files if f != os.path.realpath(path) and _MAIN.search(text_of(Path(f)) or ""))
        scopes[path] = Scope(writable=writable, follow=bool(follow), shared=shared, auto=auto, scripts=scripts,
                             root=os.path.commonpath([os.path.realpath(path.parent),
                                                      *(os.path.dirname(f) for f in files)]),
                             known=frozenset({os.path.realpath(path), *files}),
                             script=os.path.realpath(path))
    return scopes, claimed


@dataclass
class Joint:
    """Files of several scripts' projects written as one (a module they share, merged)."""

    writes: dict[str, tuple[Path, bytes, bytes]] = field(default_factory=dict)  # real path -> write
    error: Optional[str] = None
    written: bool = False


def plan(prepared: list[Prepared], scopes: dict[Path, "Scope"], settings: Settings,
         again: Callable[[Target, "Scope"], Prepared]) -> list[Prepared]:
    """The scripts of the run as one: a file that several of them change (a module they share, a
    script a launcher imports) gets one text, their versions merged (codemod/project/merge.py);
    where two change one place differently, the later script is converted again without that
    file (``again``), and says why. Scripts that share a changed file are written as one."""
    from dataclasses import replace

    from accelerate_rewrite.codemod.analysis.importers import Scope
    from accelerate_rewrite.codemod.project.merge import merge

    def versions() -> dict[str, list[tuple[int, int]]]:
        """Real path -> (script's index, member's index or -1 for the script itself), the file's
        own script first."""
        out: dict[str, list[tuple[int, int]]] = {}
        for i, p in enumerate(prepared):
            result = p.result
            if result is None or p.error is not None:
                continue
            if result.changed:
                out.setdefault(os.path.realpath(p.target.path), []).append((i, -1))
            for k, m in enumerate(result.members):
                if m.changed:
                    out.setdefault(os.path.realpath(m.path), []).append((i, k))
        return {f: sorted(v, key=lambda x: (x[1] != -1, x[0])) for f, v in out.items() if len(v) > 1}

    def result_of(i: int, k: int):
        return prepared[i].result if k == -1 else prepared[i].result.members[k]

    _plainly(prepared, scopes, versions, result_of, again)
    for _ in range(4 * len(prepared)):
        merged: dict[str, str] = {}
        conflict = None
        for file, holders in versions().items():
            first = result_of(*holders[0])
            text = first.output
            for i, k in holders[1:]:
                other = result_of(i, k)
                joined = merge(first.source, text, other.output) if other.source == first.source else None
                if joined is None:
                    conflict = (i, file, prepared[holders[0][0]].target.path)
                    break
                text = joined
            if conflict is not None:
                break
            merged[file] = text
        if conflict is None:
            break
        i, file, owner = conflict
        target = prepared[i].target
        scope = scopes.get(target.path) or Scope()
        scope = replace(scope, frozen=scope.frozen + (
            (file, f"which {owner}'s conversion changes in the same place otherwise"),))
        scopes[target.path] = scope
        prepared[i] = again(target, scope)
    else:  # pragma: no cover - each conflict freezes a file more: it ends
        return prepared

    # a script of the run that another one's program holds as a module (DINO's main_dino.py in
    # run_with_submitit.py's) is said once, as its own: the other's notes of it are of its reading
    scripts = {os.path.realpath(p.target.path) for p in prepared}
    for i, p in enumerate(prepared):
        if p.result is None or p.error is not None:
            continue
        for k, m in enumerate(p.result.members):
            if os.path.realpath(m.path) in scripts and not m.changed and m.notes:
                p.result.members[k] = replace(m, notes=[])
    joints: list[tuple[set[int], Joint]] = []
    for file, holders in versions().items():
        text = merged[file]
        (i0, k0), rest = holders[0], holders[1:]
        first = result_of(i0, k0)
        notes = list(first.notes)  # each at its line of the file as read: the same in every version
        for i, k in rest:
            other = result_of(i, k)
            notes += other.notes
            if k >= 0:  # said and written once, with the first
                prepared[i].result.members[k] = replace(other, output=other.source, notes=[])
                prepared[i].members[k] = (prepared[i].members[k][0], None)
        first.output = text
        first.notes = sorted(dict.fromkeys(_one_compat_note(notes)), key=lambda n: (n.line, n.rule))
        also = [prepared[i].target.path for i, _ in rest if i != i0]
        prepared[i0].also[os.path.realpath(file)] = also
        if settings.mode is Mode.WRITE:
            if k0 == -1:
                prepared[i0].data = prepared[i0].source.encode(text)
            else:
                source = prepared[i0].members[k0][0]
                prepared[i0].members[k0] = (source, source.encode(text))
        group = {i0, *(i for i, _ in rest)}
        for other_group, joint in joints:
            if other_group & group:
                other_group |= group
                break
        else:
            joints.append((group, Joint()))
    for group, joint in joints:
        for i in sorted(group):
            p = prepared[i]
            p.joint = joint
            if p.data is not None:
                joint.writes[os.path.realpath(p.target.path)] = (p.target.path, p.data, p.source.raw)
            for m, (f, d) in zip(p.result.members, p.members):
                if d is not None:
                    joint.writes[os.path.realpath(m.path)] = (Path(m.path), d, f.raw)
    return prepared


_COMPAT = re.compile(r"changed so that (?P<users>.+?) keeps? working: (?:(?P<names>`.+?`) takes? `fabric` as a "
                     r"last, optional parameter \(`fabric=None`\); )?each statement")


def _one_compat_note(notes: list) -> list:
    """The notes of a module merged from several scripts' versions, with one note of its
    compatible change (codemod/engine.py words it) where each version had its own: the files it
    keeps working for, and the functions that take `fabric`, of all of them."""
    from dataclasses import replace

    said = [(n, m) for n in notes if n.rule == "project" and (m := _COMPAT.match(n.message))]
    if len(said) < 2:
        return notes
    users = list(dict.fromkeys(u for _, m in said for u in m["users"].split(", ")
                               if u != "the other files that import it"))
    names = list(dict.fromkeys(x for _, m in said if m["names"] for x in m["names"].split(", ")))
    shown = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
    message = (f"changed so that {shown or 'the other files that import it'} keep{'s' if len(users) == 1 else ''} "
               "working: " + (f"{', '.join(names)} take{'s' if len(names) == 1 else ''} `fabric` as a last, "
                              "optional parameter (`fabric=None`); " if names else "")
               + "each statement" + said[0][0].message[said[0][1].end():])
    first = said[0][0]
    return [replace(first, message=message) if n is first else n for n in notes
            if not any(n is other for other, _ in said[1:])]


def _plainly(prepared: list[Prepared], scopes: dict[Path, "Scope"], versions, result_of,
             again: Callable[[Target, "Scope"], Prepared]) -> None:
    """A module that several scripts of the run share, where every one of them that imports it
    changed it (each so that the others keep working), changes as the conversion would instead:
    no old path kept for callers that all take `fabric` now. Each of those scripts is converted
    again with it as a module of its own (``again``), and that is kept where all of them change
    it to the same text and still change what they changed; otherwise the compatible change
    stays."""
    from dataclasses import replace

    index = {p.target.path: i for i, p in enumerate(prepared)}
    importing: dict[str, set[int]] = {}
    for path, scope in scopes.items():
        if path in index:
            for file, _ in scope.shared:
                importing.setdefault(file, set()).add(index[path])
    held = versions()
    files = {f for f, users in importing.items() if f in held and users <= {i for i, _ in held[f]}}
    if not files:
        return
    touched = sorted({i for f in files for i in importing[f]})
    old = {i: (prepared[i], scopes[prepared[i].target.path]) for i in touched}
    for i in touched:
        path = prepared[i].target.path
        scope = scopes[path]
        known = frozenset().union(*(scopes[prepared[j].target.path].known for f in files
                                    if i in importing[f] for j in importing[f]))
        scopes[path] = replace(scope, shared=tuple(s for s in scope.shared if s[0] not in files),
                               known=scope.known | known)
        prepared[i] = again(prepared[i].target, scopes[path])
    now = versions()
    kept = set()
    for f in files:
        holders = now.get(f, [])
        if {i for i, _ in holders} >= importing[f] and _one_plain_text(
                f, [(prepared[i], result_of(i, k)) for i, k in holders]):
            kept.add(f)
    lost = {i for i in touched if prepared[i].error is not None or prepared[i].result is None
            or prepared[i].result.changed != old[i][0].result.changed}
    if kept == files and not lost:
        return
    for i in touched:  # back to the compatible change (kept: the next run of the plan may try again)
        prepared[i], scopes[prepared[i].target.path] = old[i]


def _one_plain_text(file: str, versions: list[tuple[Prepared, "object"]]) -> bool:
    """Whether the plain changes several scripts make of one module merge into a text that each
    of them runs as its own: where a script's version of a definition differs from the merged
    one (another script changed it, say `evaluate`'s `device` became `fabric`), neither that
    script's files nor the rest of the module name it."""
    from accelerate_rewrite.codemod.analysis.importers import changed_names
    from accelerate_rewrite.codemod.project.merge import merge

    base = versions[0][1].source
    text = versions[0][1].output
    for _, result in versions[1:]:
        text = merge(base, text, result.output) if result.source == base else None
        if text is None:
            return False
    for prepared, result in versions:
        differ = changed_names(result.output, text)
        if differ is None:
            return False
        if not differ:
            continue
        word = re.compile(r"\b(?:" + "|".join(map(re.escape, sorted(differ))) + r")\b")
        own = [prepared.result.output, *(m.output for m in prepared.result.members
                                         if os.path.realpath(m.path) != file)]
        if any(word.search(t) for t in own):
            return False
        defined = re.compile(r"^(?:def|class)\s+(\w+)", re.MULTILINE)
        if len(word.findall(text)) > len([n for n in defined.findall(text) if n in differ]):
            return False
    return True
