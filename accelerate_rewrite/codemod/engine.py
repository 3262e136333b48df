"""rewrite(source, options) -> Result: parse, analyse once, run the rules, check, report."""

from __future__ import annotations

from dataclasses import replace
from functools import lru_cache
from pathlib import Path
from typing import Optional, Sequence

import difflib
import os

import libcst as cst
from libcst.metadata import PositionProvider

from accelerate_rewrite.codemod.checks import check
from accelerate_rewrite.codemod.edits import apply_edits
from accelerate_rewrite.codemod.facts import ScriptFacts
from accelerate_rewrite.codemod.flow import maybe_unbound
from accelerate_rewrite.codemod.result import Result  # noqa: F401 (plain data: codemod/result.py)
from accelerate_rewrite.codemod.preserve import Region, lost_trivia, restore, split_tail
from accelerate_rewrite.codemod.rule import Note, Rule, RuleContext
from accelerate_rewrite.codemod.suppress import applies_to, changed_lines, protected_lines, skip_file_line
from accelerate_rewrite.options import Options


class RewriteError(Exception):
    """The file can't be rewritten at all (a syntax error, ...); the message names the file."""


def _rule_name(code: str) -> str:
    from accelerate_rewrite.rules import BY_CODE

    rule = BY_CODE.get(code)
    return rule.name if rule is not None else "unknown"


def _nothing_to_do(code: str, facts: ScriptFacts, options: Options) -> bool:
    """Whether the rule ``code``, run on these facts, would record no edit and say nothing."""
    from accelerate_rewrite.rules import BY_CODE

    rule = BY_CODE.get(code)
    if rule is None or not rule.applies(options):
        return False
    ctx = RuleContext(rule, facts, options)
    try:
        rule.rewrite(ctx)
    except Exception:
        return False
    return not ctx.edits and not ctx.edits.unused_imports and not ctx.notes


def _dependents(dropped: str, rules: Sequence[Rule], options: Options) -> set[str]:
    """``dropped`` and every rule that relies on it, directly or not."""
    out = {dropped}
    grew = True
    while grew:
        grew = False
        for rule in rules:
            if rule.code not in out and out.intersection(rule.requirements(options)):
                out.add(rule.code)
                grew = True
    return out


@lru_cache(maxsize=4)
def _analyse(source: str, folder: Optional[Path] = None) -> ScriptFacts:
    """The facts of a source, kept for the next rewrites of the same text: the facts are read,
    never changed, by the rules (the plans they draw from them are memoised per options), and
    the test suite rewrites each fixture with many sets of options."""
    return ScriptFacts(cst.parse_module(source), folder)


def _folder(path: str) -> Optional[Path]:
    """The folder of the script's own modules: none for a source with no file (``<string>``,
    stdin)."""
    if path.startswith("<") or path == "-":
        return None
    return Path(path).parent


#: set to 1 (the tests, benchmarks/fuzz.py) to make every rewrite of a file under
#: IDEMPOTENCE_MAX_LINES lines rewrite its own result too, and fail loudly if that changes it
IDEMPOTENCE_ENV = "ACCELERATE_REWRITE_CHECK_IDEMPOTENCE"
IDEMPOTENCE_MAX_LINES = 3000


def _parse(source: str, path: str, make=None):
    """The facts (or what ``make(text)`` makes of the text), and the source as ``head`` (what
    LibCST reads) + ``tail`` (trailing lines LibCST can't read, such as a last line that is a
    lone backslash, put back afterwards)."""
    if make is None:
        make = lambda text: _analyse(text, _folder(path))  # noqa: E731
    try:
        return make(source), source, ""
    except cst.ParserSyntaxError as exc:
        # Python's own parser names the place best (1-based line and column)
        try:
            compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as py_exc:
            raise RewriteError(
                f"{path}:{py_exc.lineno}:{py_exc.offset}: syntax error: {py_exc.msg}"
            ) from None
        except ValueError as py_exc:  # e.g. "source code string cannot contain null bytes"
            raise RewriteError(f"{path}: {py_exc}") from None
        for split in split_tail(source):
            try:
                return make(split[0]), split[0], split[1]
            except cst.ParserSyntaxError:
                continue
        raise RewriteError(
            f"{path}: valid Python that LibCST's parser can't read ({exc.message}); file left as is"
        ) from None


def _regions(facts: ScriptFacts, touched: Sequence[tuple[cst.CSTNode, bool]]) -> list[Region]:
    """The lines of the input the edits may change: each edited statement with its leading
    lines (and, for a removed one, the leading lines of the statement after it, whose spacing
    the removal adjusts; an ``if`` whose whole body goes goes too)."""
    out: list[Region] = []
    removed = {id(node) for node, gone in touched if gone}
    todo = list(touched)
    while todo:
        node, gone = todo.pop()
        if isinstance(node, cst.Module):
            return [(1, 1 << 30)]
        try:
            stmt = node if isinstance(node, cst.BaseStatement) and isinstance(
                facts.parent(node), (cst.Module, cst.IndentedBlock)) else facts.statement(node)
        except (ValueError, KeyError):
            if isinstance(node, cst.IndentedBlock) and facts.parent(node) is not None:
                todo.append((facts.parent(node), False))
            continue
        pos = facts._get(PositionProvider, stmt)
        if pos is None:
            continue
        start = pos.start.line - len(getattr(stmt, "leading_lines", ()))
        if isinstance(stmt, (cst.FunctionDef, cst.ClassDef)) and stmt.decorators:
            first = facts._get(PositionProvider, stmt.decorators[0])
            if first is not None:
                start = min(start, first.start.line - len(stmt.leading_lines))
        end = pos.end.line
        block = facts.parent(stmt)
        if gone and isinstance(block, (cst.Module, cst.IndentedBlock)):
            body = list(block.body)
            index = next((i for i, s in enumerate(body) if s is stmt), None)
            if index is not None and index + 1 < len(body):
                following = facts._get(PositionProvider, body[index + 1])
                if following is not None:
                    end = max(end, following.start.line - 1)
            owner = facts.parent(block) if isinstance(block, cst.IndentedBlock) else None
            if isinstance(owner, cst.If) and owner.orelse is None and id(owner) not in removed \
                    and all(id(s) in removed for s in body):
                removed.add(id(owner))
                todo.append((owner, True))
        out.append((max(1, start), end))
    return out


def _for_script(facts: ScriptFacts, options: Options) -> Options:
    """The options as this file reads them: a script that starts its own processes (hand-made
    DDP) keeps its world size when ``--devices`` is not given, so its conversion is one for
    several devices."""
    if options.fabric and options.devices is None and not options.script_world:
        from accelerate_rewrite.codemod.ddp import hand_ddp

        ddp = hand_ddp(facts)
        if ddp.found and ddp.problem is None:
            return replace(options, script_world=True)
    return options


def rewrite(
    source: str,
    options: Options,
    *,
    path: str = "<string>",
    rules: Optional[Sequence[Rule]] = None,
    check_idempotence: Optional[bool] = None,
) -> Result:
    result = _rewrite(source, options, path=path, rules=rules)
    if check_idempotence is None:
        check_idempotence = os.environ.get(IDEMPOTENCE_ENV, "") == "1"
    if check_idempotence and result.changed and source.count("\n") < IDEMPOTENCE_MAX_LINES:
        again = _rewrite(result.output, options, path=path, rules=rules).output
        if again != result.output:
            diff = "".join(difflib.unified_diff(result.output.splitlines(True), again.splitlines(True),
                                                "first run", "second run"))
            raise AssertionError(f"{path}: a second run changes the result:\n{diff}")
    return result


def _rewrite(
    source: str,
    options: Options,
    *,
    path: str = "<string>",
    rules: Optional[Sequence[Rule]] = None,
) -> Result:
    if rules is None:
        from accelerate_rewrite.rules import ALL_RULES

        rules = ALL_RULES
    facts, head, tail = _parse(source, path)
    roundtrip = facts.memo("roundtrip", lambda: facts.module.code)
    result = Result(path=path, source=source, output=source)
    skip_line = skip_file_line(source)
    if skip_line is not None:
        result.notes.append(Note("file", skip_line, "`# accelerate-rewrite: skip-file`: the file is "
                                                    "left alone", skipped=True))
        return result
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
            if req not in selected and _nothing_to_do(req, facts, options):
                vacuous.add(req)
                continue
            name = next((r.name for r in rules if r.code == req), None) or _rule_name(req)
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

    protected = protected_lines(source)
    if protected:
        for rule in list(active):
            if rule.code not in {r.code for r in active}:
                continue
            edits = contexts[rule.code].edits
            if not edits:
                continue
            alone = restore(head, roundtrip, apply_edits(facts.module, [edits]).code) + tail
            hit = next(((n, c) for n in sorted(changed_lines(source, alone))
                        for c in [applies_to(protected, n, rule.code)] if c is not None), None)
            if hit is None:
                continue
            gone = _dependents(rule.code, active, options)
            others = sorted(gone - {rule.code})
            result.dropped.append(
                f"{rule.code} {rule.name}: not applied: it would change line {hit[0]}, which "
                f"`# accelerate-rewrite: ignore` (line {hit[1]}) leaves alone"
                + (f" (and with it {', '.join(others)}, which rely on it)" if others else ""))
            active = [r for r in active if r.code not in gone]
        for ctx in contexts.values():  # what the rules say about protected lines goes too
            ctx.notes = [n for n in ctx.notes if applies_to(protected, n.line, n.rule) is None]

    original_undefined = facts.undefined_names()
    original_unbound = (head, facts.memo("maybe-unbound", lambda: maybe_unbound(head)))

    def attempt(selected: Sequence[Rule]) -> tuple[str, list[str]]:
        edit_sets = [contexts[r.code].edits for r in selected]
        if not any(e or e.unused_imports for e in edit_sets):
            return source, []  # no rule applied: the input itself, whatever LibCST would print
        touched: list[tuple[cst.CSTNode, bool]] = []
        new = apply_edits(facts.module, edit_sets, touched)
        head_code = restore(head, roundtrip, new.code)
        code = head_code + tail
        if code == source:
            return code, []
        problems = check(original_undefined, head_code, facts.first_read, original_unbound)
        if not problems and tail:
            try:
                compile(code, "<rewritten>", "exec", dont_inherit=True)
            except (SyntaxError, ValueError) as exc:
                problems.append(f"the result does not compile ({exc})")
        if not problems:
            lost = lost_trivia(source, code, _regions(facts, touched))
            if lost is not None:
                problems.append(lost + " outside the statements the rules edit")
        return code, problems

    output, problems = attempt(active)
    while problems:
        # find the first rule whose edits break the result, drop it and what relies on it
        culprit: Optional[Rule] = None
        for i in range(1, len(active) + 1):
            _, problems_i = attempt(active[:i])
            if problems_i:
                culprit, problems = active[i - 1], problems_i
                break
        if culprit is None:  # only the whole set fails: drop the last rule
            culprit = active[-1]
        gone = _dependents(culprit.code, active, options)
        others = sorted(gone - {culprit.code})
        result.dropped.append(
            f"{culprit.code} {culprit.name}: dropped for this file: " + "; ".join(problems)
            + (f" (and with it {', '.join(others)}, which rely on it)" if others else "")
        )
        active = [r for r in active if r.code not in gone]
        output, problems = attempt(active)

    for rule in active:
        result.notes.extend(contexts[rule.code].notes)
    result.notes.sort(key=lambda n: (n.line, n.rule))
    result.output = output
    return result
