"""rewrite(source, options, rules=..., catalogue=...) -> Result: parse, analyse once, run the
rules, check, report. The rules come from the caller (accelerate_rewrite.api.rewrite passes the
registry): nothing in codemod/ imports rules/."""

from __future__ import annotations

from dataclasses import replace
from functools import partial
from typing import Callable, Mapping, Optional, Protocol, Sequence, Union

import difflib
import os
import re

# first, before LibCST: its dataclasses' methods compiled once, the matchers without the
# docstrings they would print (codemod/tree/startup.py)
import accelerate_rewrite.codemod.tree.startup  # noqa: F401

import libcst as cst

from accelerate_rewrite.codemod.checks import check
from accelerate_rewrite.codemod.edits.edit_set import apply_edits
from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.analysis.siblings import look_again
from accelerate_rewrite.codemod.tree.flow import maybe_unbound
from accelerate_rewrite.codemod.tree.layout import Splice
from accelerate_rewrite.codemod.tree.printing import module_code
from accelerate_rewrite.codemod.result import Kind, Result  # noqa: F401 (plain data: codemod/result.py)
from accelerate_rewrite.codemod.collector import GC_THRESHOLDS, fewer_collections  # noqa: F401 (benchmarks, tests read them here)
from accelerate_rewrite.codemod.claims import true_claims
from accelerate_rewrite.codemod.project.compat import Compatible, compatible
from accelerate_rewrite.codemod.project.keywords import calls_by_keyword
from accelerate_rewrite.codemod.project.names import Realias
from accelerate_rewrite.codemod.project.program import Scope, analyse
from accelerate_rewrite.codemod.project.units import Unit, relocate, units_of
from accelerate_rewrite.codemod.edits.preserve import (Region, lost_trivia, lost_trivia_spliced, removed_comments,
                                                 removed_comments_spliced, restore)
from accelerate_rewrite.codemod.reading import _analyse, _folder, _parse, _parsed, _project
from accelerate_rewrite.codemod.regions import edited_regions
from accelerate_rewrite.codemod.rule import Note, Rule, RuleContext
from accelerate_rewrite.codemod.analysis.words import SIDE_EFFECT_WORDS, TRAINING_WORDS
from accelerate_rewrite.codemod.suppress import applies_to, changed_lines, protected_lines, skip_file_line
from accelerate_rewrite.options import Options

#: what AR105 says of a device parameter threaded into `fabric`, said again of a module changed
#: compatibly (codemod/project/compat.py), where the parameter stays
_THREADED = re.compile(r"parameter `(\w+)` became `fabric` \(its callers pass it\)")


class Spelling(Protocol):
    """How the rules' result is written for another target (rules/accelerate/spelling.py)."""

    def spell(self, options: Options, source: str, code: str, program: Sequence[str] = ()
              ) -> tuple[str, Optional[str]]:
        """``code`` (a changed file, ``source`` its original) in the target's API, or why not;
        ``program``: every file of the program as the rules left it (``code`` among them)."""

    def said(self, message: str, code: str) -> str:
        """A note's ``message`` said of the target's API (``code``: the file as written)."""


#: a refusal that found no training (rules/fabric/_plan.py, rules/native/_plan.py)
_NO_TRAINING = re.compile(r"no training found \([^)]*\)")


def _rule_name(code: str, catalogue: Mapping[str, Rule]) -> str:
    rule = catalogue.get(code)
    return rule.name if rule is not None else "unknown"


def _nothing_to_do(code: str, facts: ScriptFacts, options: Options, catalogue: Mapping[str, Rule]) -> bool:
    """Whether the rule ``code``, run on these facts, would record no edit and say nothing."""
    rule = catalogue.get(code)
    if rule is None or not rule.applies(options):
        return False
    ctx = RuleContext(rule, facts, options)
    try:
        rule.rewrite(ctx)
    except Exception:
        return False
    return not ctx.edits and not ctx.edits.unused_imports and not ctx.notes


def _dependents(dropped: str, rules: Sequence[Rule], options: Options,
                contexts: Optional[Mapping[str, RuleContext]] = None) -> set[str]:
    """``dropped`` and every rule that relies on it, directly or not: by ``requires``, and (given
    the rules' ``contexts``) by a premise that only the rules dropped gave."""
    out = {dropped}
    grew = True
    while grew:
        grew = False
        for rule in rules:
            if rule.code not in out and out.intersection(rule.requirements(options)):
                out.add(rule.code)
                grew = True
        if contexts is not None:
            left = [r for r in rules if r.code not in out]
            for code in _groundless(left, contexts, options):
                out.add(code)
                grew = True
    return out


def _groundless(rules: Sequence[Rule], contexts: Mapping[str, RuleContext], options: Options) -> dict[str, str]:
    """The rules among ``rules`` with a premise (``Rule.premises``) that none of ``rules`` gives
    the file: code -> the ground missing. A rule that changes nothing stands on nothing (what it
    says of the places it left alone stays)."""
    given = {g for r in rules if r.code in contexts for g in contexts[r.code].provided}
    out: dict[str, str] = {}
    for rule in rules:
        ctx = contexts.get(rule.code)
        if ctx is None or not ctx.edits:
            continue
        missing = [g for g in rule.premises(options) if g not in given]
        if missing:
            out[rule.code] = missing[0]
    return out


#: a script this long is not kept for another rewrite (``_analyse``), and its scope analysis
#: goes once the rules have run: the checks of its results use that memory (docs/benchmarks.md)
LONG_SCRIPT_LINES = 10_000


#: set to 1 (the tests, benchmarks/fuzz.py) to make every rewrite of a file under
#: IDEMPOTENCE_MAX_LINES lines rewrite its own result too, and fail loudly if that changes it
IDEMPOTENCE_ENV = "ACCELERATE_REWRITE_CHECK_IDEMPOTENCE"
IDEMPOTENCE_MAX_LINES = 3000


def _for_script(facts: ScriptFacts, options: Options) -> Options:
    """The options as this file reads them: a script that starts its own processes (hand-made
    DDP) keeps its world size when ``--devices`` is not given, so its conversion is one for
    several devices."""
    if options.fabric and options.devices is None and not options.script_world:
        from accelerate_rewrite.codemod.ddp.hand import hand_ddp

        ddp = hand_ddp(facts)
        if ddp.found and ddp.problem is None:
            return replace(options, script_world=True)
    return options


def rewrite(
    source: str,
    options: Options,
    *,
    path: str = "<string>",
    rules: Sequence[Rule],
    catalogue: Mapping[str, Rule],
    check_idempotence: Optional[bool] = None,
    scope: Optional[Scope] = None,
    sources: Optional[dict[str, str]] = None,
    spelling: Optional[Spelling] = None,
) -> Result:
    """The rewrite of the script ``source`` (its file ``path``) with ``rules``; ``catalogue``:
    every rule by code, for the prerequisites a selection leaves out (codemod/ knows no rule of
    its own: accelerate_rewrite.api.rewrite passes the registry in). The project's own modules it
    imports are analysed with it (codemod/project/program.py); ``scope`` says which of them may change
    (by default none: a conversion that needs them to is left out, and says so), and their
    results are ``result.members``. ``sources``: the text of some of them (by path), instead of
    what is on disk. ``spelling``: how each changed file's text is written for another target
    than the rules' own (rules/accelerate/spelling.py: Fabric's API as Accelerate's)."""
    scope = scope if scope is not None else Scope()
    look_again()  # the project's files as they are now
    with fewer_collections():
        result = _rewrite(source, options, path=path, rules=rules, catalogue=catalogue, scope=scope, sources=sources,
                          spelling=spelling)
    if check_idempotence is None:
        check_idempotence = os.environ.get(IDEMPOTENCE_ENV, "") == "1"
    changed = result.changed or any(m.changed for m in result.members)
    if check_idempotence and changed and source.count("\n") < IDEMPOTENCE_MAX_LINES:
        outputs = {**(sources or {}), **{m.path: m.output for m in result.members}}
        again = _rewrite(result.output, options, path=path, rules=rules, catalogue=catalogue, scope=scope,
                         sources=outputs, spelling=spelling)
        pairs = [(path, result.output, again.output)] + [
            (m.path, m.output, n.output) for m in result.members for n in again.members if n.path == m.path]
        for where, first, second in pairs:
            if second != first:
                diff = "".join(difflib.unified_diff(first.splitlines(True), second.splitlines(True),
                                                    "first run", "second run"))
                raise AssertionError(f"{where}: a second run changes the result:\n{diff}")
    return result


def removed_in(unit: Unit, output: str, splice: Optional[Splice]) -> list[tuple[int, str]]:
    """The comments of the unit that its ``output`` no longer has (preserve.removed_comments;
    of the statements the rewrite replaced only, where the output is spliced)."""
    found = removed_comments_spliced(splice, unit.trivia) if splice is not None else None
    return found if found is not None else removed_comments(unit.source, output)


def _rewrite(
    source: str,
    options: Options,
    *,
    path: str = "<string>",
    rules: Sequence[Rule],
    catalogue: Mapping[str, Rule],
    scope: Optional[Scope] = None,
    sources: Optional[dict[str, str]] = None,
    spelling: Optional[Spelling] = None,
) -> Result:
    # on several processes, helpers whose side effects would run on each (a progress bar's
    # sys.stdout.write, a download; rules/fabric/rank_zero.py) are read too, and with
    # Accelerate every helper the set-up model is handed to (rules/fabric/_wrapped.py:
    # DistributedDataParallel is not the module there)
    # a helper that wraps the model in (Distributed)DataParallel (pytorch_image_classification's
    # ``apply_data_parallel_wrapper``) is read on several processes, where it would wrap the
    # set-up model again
    words = TRAINING_WORDS + (SIDE_EFFECT_WORDS + ("dataparallel",) if options.many_devices else ()) + (
        ("model",) if options.accelerate and options.many_devices else ())
    project = _project(source, path, scope, sources, words) if scope is not None else None
    unfollowed = project.unfollowed if project is not None else []
    several = project is not None and len(project.parts) > 1
    if several:
        key = tuple((part.path, part.source) for part in project.parts)
        facts, project = analyse(key, project, _folder(path))
    else:
        facts, head, tail = _parse(source, path)
    result = Result(path=path, source=source, output=source)
    skip_line = skip_file_line(source)
    if skip_line is not None:
        result.notes.append(Note("file", skip_line, "`# accelerate-rewrite: skip-file`: the file is "
                                                    "left alone", skipped=True))
        return result
    if several:
        units = units_of(facts, project, scope)
    else:
        layout = facts.layout()
        units = [Unit(path=path, source=source, head=head, tail=tail, roundtrip=layout.code, view=facts.module,
                       undefined=lambda: facts.memo("undefined-names", facts.undefined_names),
                       unbound=(head, lambda: facts.memo("maybe-unbound", lambda: maybe_unbound(head))),
                       where=lambda line: (0, line), first_read=facts.first_read, layout=layout,
                       parent=facts.parent)]
    options = _for_script(facts, options)
    contexts: dict[str, RuleContext] = {}
    for rule in rules:
        if not rule.applies(options):
            continue
        ctx = RuleContext(rule, facts, options)
        try:
            rule.rewrite(ctx)
        except Exception as exc:  # a bug in a rule must not cost the user their file
            result.dropped.append(
                f"{rule.code} {rule.name}: internal error ({type(exc).__name__}: {exc}); "
                "not applied to this file"
            )
            continue
        contexts[rule.code] = ctx
    active = [r for r in rules if r.code in contexts]
    # a rule whose prerequisite did not run can't run either, unless the prerequisite (left out
    # of the selection) has nothing to do in this file: AR211's apex migration, in a script
    # without apex, is no reason to leave the Fabric conversion out
    selected = {r.code for r in rules}
    missing: dict[str, str] = {}  # code of a prerequisite that did not run -> why
    vacuous: set[str] = set()  # prerequisites left out that have nothing to do here
    for rule in active:
        for req in rule.requirements(options):
            if req in contexts or req in missing or req in vacuous:
                continue
            if req not in selected and _nothing_to_do(req, facts, options, catalogue):
                vacuous.add(req)
                continue
            name = next((r.name for r in rules if r.code == req), None) or _rule_name(req, catalogue)
            missing[req] = (f"it relies on {req} ({name}), which the selection leaves out (select it "
                            f"too: --select ...,{req})" if req not in selected
                            else f"it relies on {req} ({name}), which did not run")
    orphans = {r.code for r in active if any(req in missing for req in r.requirements(options))}
    gone = set().union(*(_dependents(code, active, options) for code in orphans)) if orphans else set()
    for code in sorted(gone):
        if contexts[code].edits or contexts[code].notes:  # a rule with nothing to do goes quietly
            rule = next(r for r in active if r.code == code)
            why = next((missing[req] for req in rule.requirements(options) if req in missing),
                       "a rule it relies on did not run")
            result.dropped.append(f"{code}: not applied: {why}")
    active = [r for r in active if r.code not in gone]
    # a rule whose change stands on what no rule made here (AR209's removed ``.half()`` needs an
    # autocast to take over): dropped, with what stood on it, and the reason
    groundless = _groundless(active, contexts, options)
    while groundless:
        code, ground = next(iter(groundless.items()))
        gone = _dependents(code, active, options, contexts)
        others = sorted(gone - {code})
        result.dropped.append(f"{code}: not applied: its change stands on {ground}, which no rule made in this "
                              "file" + (f" (and with it {', '.join(others)}, which rely on it)" if others else ""))
        active = [r for r in active if r.code not in gone]
        groundless = _groundless(active, contexts, options)

    #: of the last apply_to: unit -> the tree its text was printed from (None where the text is not
    #: that tree's code): what the compatible change reads instead of parsing the text again
    #: (for a unit read with aliases, what makes that tree when first asked for: Unit.home_tree)
    made_trees: dict[int, Union[cst.Module, Callable[[], Optional[cst.Module]], None]] = {}

    def tree_of(unit: Unit) -> Optional[cst.Module]:
        """The tree the unit's last text is the code of, where there is one (else None: parsed)."""
        found = made_trees.get(unit.index)
        if callable(found):
            found = made_trees[unit.index] = found()
        return found

    #: of the last attempt: the keys of replacements an edit around them dropped (edits/edit_set.py)
    swallowed: set[int] = set()

    def apply_to(unit: Unit, edit_sets, touched=None, dropped: Optional[set[int]] = None
                 ) -> tuple[str, Optional[Splice]]:
        """The unit's text with the edits applied, and its Splice (codemod/tree/layout.py) where
        that text is the statements' code joined."""
        new = apply_edits(unit.view, edit_sets, touched, imports_read=several, parent=unit.parent,
                          layout=unit.layout, swallowed=dropped)
        if unit.aliases or unit.renames:  # ``train`` read as ``E.train`` again, in the statements the
            kept = unit.layout.statements  # edits changed (and ``A`` as the ``B`` it was imported as)
            back = Realias(unit.aliases, unit.renames)  # (along the paths to those names only)
            new = new.with_changes(body=[s if id(s) in kept else back.along(s) for s in new.body])
        splice = unit.layout.splice(new) if unit.layout is not None else None
        if splice is None and (unit.aliases or unit.renames):  # printed whole: the kept ones read back too
            back = Realias(unit.aliases, unit.renames)
            new = new.with_changes(body=[back.along(s) if id(s) in unit.layout.statements else s for s in new.body])
        code = restore(unit.head, unit.roundtrip, splice.code if splice is not None else module_code(new))
        # the tree whose code the text is, where it is (no line put back; with the aliases read
        # back, the file's own statements where the edits kept them: Unit.home_tree, when asked)
        made_trees[unit.index] = new if unit.printed_as_read else \
            partial(unit.home_tree, new, code) if unit.home is not None else None
        return code, (splice if unit.roundtrip == unit.head else None)

    for unit in units:
        protected = protected_lines(unit.source)
        if not protected:
            continue
        for rule in list(active):
            if rule.code not in {r.code for r in active}:
                continue
            edits = contexts[rule.code].edits
            if not edits:
                continue
            alone = apply_to(unit, [edits])[0] + unit.tail
            hit = next(((n, c) for n in sorted(changed_lines(unit.source, alone))
                        for c in [applies_to(protected, n, rule.code)] if c is not None), None)
            if hit is None:
                continue
            gone = _dependents(rule.code, active, options, contexts)
            others = sorted(gone - {rule.code})
            of = f" of {unit.path}" if unit.index else ""
            result.dropped.append(
                f"{rule.code} {rule.name}: not applied: it would change line {hit[0]}{of}, which "
                f"`# accelerate-rewrite: ignore` (line {hit[1]}{of}) leaves alone"
                + (f" (and with it {', '.join(others)}, which rely on it)" if others else ""))
            active = [r for r in active if r.code not in gone]
        for ctx in contexts.values():  # what the rules say about protected lines goes too
            ctx.notes = [n for n in ctx.notes if (lambda local: local is None or applies_to(
                protected, local, n.rule) is None)(unit.local(n.line))]

    splices: dict[int, Optional[Splice]] = {}  # of the last attempt: unit -> its result's Splice
    #: of the last attempt: unit -> its compatible change (codemod/project/compat.py), and the files
    #: that import what changes there
    compats: dict[int, tuple[Compatible, list[str]]] = {}
    refusals: set[str] = set()  # the problems that are a file which may not change
    #: (unit, its text, its free names) -> its compatible change: the attempts of the bisection
    #: below make the same text of a file again where the rules they add leave it alone
    compat_made: dict[tuple, Optional[Compatible]] = {}

    def made_compatible(unit: Unit, head_code: str, code: str) -> Optional[Compatible]:
        """The unit's compatible change (codemod/project/compat.py), made once per text."""
        if not unit.compatible:
            return None
        free = unit.free(unit.source, code)
        key = (unit.index, head_code, free)
        if key not in compat_made:
            # the file's tree and its layout: the view where it prints as read, else the file's own
            # (the tree made is of its statements: Unit.home_tree), else the text parsed
            layout = unit.made_layout()
            compat_made[key] = compatible(unit.head, head_code, layout.module if layout is not None else None,
                                          tree_of(unit), layout, free=free)
        return compat_made[key]

    def refused_only(chosen: Sequence[Rule]) -> list[str]:
        """The problems of ``attempt(chosen)`` that are a file which may not change, and only
        those: what the bisection below asks where every problem is one. The files that may change
        (the script) are not made, and no result is checked."""
        swallowed.clear()
        edit_sets = [contexts[r.code].edits for r in chosen]
        if not any(e or e.unused_imports for e in edit_sets):
            return []
        found = []
        for unit in units:
            if unit.refusal is None:
                continue
            head_code = apply_to(unit, edit_sets, None, swallowed)[0]
            code = head_code + unit.tail
            if code == unit.source:
                continue
            why = unit.refusal(unit.source, code)
            if why is not None and made_compatible(unit, head_code, code) is None:
                found.append(why)
        return found

    def attempt(chosen: Sequence[Rule]) -> tuple[list[str], list[str]]:
        splices.clear()
        swallowed.clear()
        edit_sets = [contexts[r.code].edits for r in chosen]
        if not any(e or e.unused_imports for e in edit_sets):
            return [u.source for u in units], []  # no rule applied: the input itself
        touched: list[tuple[cst.CSTNode, bool]] = []
        outputs, problems = [], []
        regions: Optional[list[Region]] = None
        heads: list[str] = []
        refused: dict[int, str] = {}
        compats.clear()
        for unit in units:
            head_code, splice = apply_to(unit, edit_sets, touched if unit.index == 0 else None, swallowed)
            splices[unit.index] = splice
            heads.append(head_code)
            code = head_code + unit.tail
            if code == unit.source:
                continue
            why = unit.refusal(unit.source, code) if unit.refusal is not None else None
            if why is None:
                continue
            made = made_compatible(unit, head_code, code)  # the same text again (another prefix): made once
            if made is None:
                refused[unit.index] = why
                refusals.add(why)
                continue
            # a module other files import changes so that they keep working (codemod/project/compat.py)
            compats[unit.index] = (made, unit.users(unit.source, code))
            heads[unit.index], splices[unit.index], made_trees[unit.index] = made.code, None, made.tree
        keyword_calls = {name: i for made, _ in compats.values() for name, i in made.keyword_calls.items()}
        program = tuple(heads)
        for unit in units:
            head_code = heads[unit.index]
            if keyword_calls and head_code != unit.head:
                # as the file spells them (``from utils import A as B``: ``B(fabric)``)
                spelled = {**keyword_calls, **{unit.renames[n]: i for n, i in keyword_calls.items()
                                               if n in unit.renames}}
                moved = calls_by_keyword(head_code, spelled, tree_of(unit), unit.made_layout() or unit.layout)
                if moved != head_code:
                    heads[unit.index], splices[unit.index] = moved, None
            if spelling is not None and heads[unit.index] != unit.head:
                spelled, why = spelling.spell(options, unit.source, heads[unit.index], program)
                if why is not None:
                    refused[unit.index] = why
                else:
                    heads[unit.index], splices[unit.index] = spelled, None
            outputs.append(heads[unit.index] + unit.tail)
        for unit in units:
            head_code, splice, code = heads[unit.index], splices[unit.index], outputs[unit.index]
            if code == unit.source:
                continue
            if unit.index in refused:
                problems.append(refused[unit.index])
                continue
            found = check(unit.undefined, head_code, unit.first_read, unit.unbound, splice, unit.trees, unit.head)
            if not found and unit.tail:
                try:
                    compile(code, "<rewritten>", "exec", dont_inherit=True)
                except (SyntaxError, ValueError) as exc:
                    found.append(f"the result does not compile ({exc})")
            if not found:
                if regions is None:
                    regions = edited_regions(facts, touched)
                mine = [r if r == (1, 1 << 30) else (unit.where(r[0])[1], unit.where(r[1])[1])
                        for r in regions if r == (1, 1 << 30)
                        or unit.where(r[0])[0] == unit.where(r[1])[0] == unit.index]
                lost = lost_trivia(unit.source, code, mine) if splice is None \
                    else lost_trivia_spliced(splice, mine, unit.trivia, unit.source, code)
                if lost is not None:
                    found.append(lost + " outside the statements the rules edit")
            problems.extend(f"in {unit.path}, {p}" if unit.index else p for p in found)
        return outputs, problems

    long = not several and source.count("\n") >= LONG_SCRIPT_LINES
    if long:
        # the checks of the results below don't read the scopes, and take their memory
        _analyse.cache_clear()
        facts.release()
    outputs, problems = attempt(active)
    while problems:
        # the first rule whose edits break the result (the shortest failing prefix, found by
        # bisection), dropped with what relies on it
        tried: dict[int, list[str]] = {len(active): problems}
        # where every problem is a file that may not change, the rule to drop is the first whose
        # edits change it: a shorter prefix that fails otherwise (a rule without those it relies
        # on) is not the cause, and would be named as one
        wanted = set(problems) if set(problems) <= refusals else None
        # (and then only those files are made: a spelling's refusal may stand for one there)
        cheap = wanted is not None and spelling is None
        low, high = 1, len(active)
        while low < high:
            middle = (low + high) // 2
            found = refused_only(active[:middle]) if cheap else attempt(active[:middle])[1]
            tried[middle] = found if wanted is None else [p for p in found if p in wanted]
            if tried[middle]:
                high = middle
            else:
                low = middle + 1
        culprit, problems = active[low - 1], tried.get(low) or problems
        gone = _dependents(culprit.code, active, options, contexts)
        others = sorted(gone - {culprit.code})
        result.dropped.append(
            f"{culprit.code} {culprit.name}: dropped for this {'project' if several else 'file'}: "
            + "; ".join(problems)
            + (f" (and with it {', '.join(others)}, which rely on it)" if others else "")
        )
        active = [r for r in active if r.code not in gone]
        outputs, problems = attempt(active)

    per_unit: list[list[Note]] = [[] for _ in units]
    for rule in active:
        about = contexts[rule.code].about
        for note in contexts[rule.code].notes:
            if about.get(id(note)) in swallowed:
                continue  # an edit around it dropped what this note says it became
            index, line = units[0].where(note.line)
            per_unit[index].append(replace(note, line=line, message=relocate(note.message, units[index], units))
                                   if several else note)
    for line, why in unfollowed:
        per_unit[0].append(Note("project", line, why, skipped=True))
    if unfollowed:  # "no training found" where the training may be in a module that was not read
        modules = "; ".join(f"line {line}: {why}" for line, why in unfollowed[:3])
        per_unit[0] = [replace(n, message=_NO_TRAINING.sub(
            lambda found: f"{found.group(0)} in what was read (not read: {modules})", n.message, count=1))
            if n.skipped else n for n in per_unit[0]]
    for index, (made, users) in compats.items():
        per_unit[index] = [replace(n, message=_THREADED.sub(
            r"parameter `\1` stays, and `fabric` comes last and optional (its callers pass `\1=fabric.device` "
            r"and `fabric=fabric`)", n.message.replace(
                "receives `fabric` as its first parameter (its callers pass it)",
                "receives `fabric` as a last, optional parameter (its callers pass `fabric=fabric`)")))
            for n in per_unit[index]]
        shown = ", ".join(users[:3]) + (f" and {len(users) - 3} more" if len(users) > 3 else "")
        taking = [n for n in made.changed if n in made.keyword_calls]
        per_unit[index].append(Note(
            "project", 1,
            f"changed so that {shown or 'the other files that import it'} keep{'s' if len(users) == 1 else ''} "
            "working: " + (f"{', '.join(f'`{n}`' for n in taking)} take{'s' if len(taking) == 1 else ''} `fabric` "
                           "as a last, optional parameter (`fabric=None`); " if taking else "")
            + "each statement the conversion changes runs only with `fabric`, the one it was without it",
            kind=Kind.SAFE))
    for unit in units:  # what the reader of the diff would otherwise find missing
        if outputs[unit.index] != unit.source:
            per_unit[unit.index] += [
                Note("comment", line, f"the comment `{text}` went with the statement it stood over, which the "
                                      "rewrite removed", kind=Kind.SAFE)
                for line, text in removed_in(unit, outputs[unit.index], splices.get(unit.index))]
    if spelling is not None:  # the notes of a file say what was written, and refusals name the backend asked for
        for unit in units:
            per_unit[unit.index] = [replace(n, message=spelling.said(n.message, outputs[unit.index]))
                                    for n in per_unit[unit.index]]
    for unit in units:  # a note claims only what the file as written holds (codemod/claims.py)
        if outputs[unit.index] != unit.source:
            per_unit[unit.index] = true_claims(per_unit[unit.index], unit.source, outputs[unit.index])
    for i, notes in enumerate(per_unit):  # one note a place: a rule may reach a line twice
        per_unit[i] = sorted(dict.fromkeys(notes), key=lambda n: (n.line, n.rule))
    result.notes = per_unit[0]
    result.output = outputs[0]
    result.members = [Result(path=u.path, source=u.source, output=outputs[u.index], notes=per_unit[u.index])
                      for u in units[1:]]
    if long:  # nothing of this script is kept: its tree and facts go now, not at a pass of the collector
        _parsed.cache_clear()
        facts.dispose()
    return result
