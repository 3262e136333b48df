"""rewrite(source, options) -> Result: parse, analyse once, run the rules, check, report."""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Optional, Sequence

import libcst as cst

from accelerate_rewrite.codemod.checks import check
from accelerate_rewrite.codemod.edits import apply_edits
from accelerate_rewrite.codemod.facts import ScriptFacts
from accelerate_rewrite.codemod.rule import Note, Rule, RuleContext
from accelerate_rewrite.codemod.suppress import applies_to, changed_lines, protected_lines, skip_file_line
from accelerate_rewrite.options import Options


class RewriteError(Exception):
    """The file can't be rewritten at all (a syntax error, ...); the message names the file."""


@dataclass
class Result:
    path: str
    source: str
    output: str
    notes: list[Note] = field(default_factory=list)
    #: rules dropped for this file, with why (a failed check, an internal error)
    dropped: list[str] = field(default_factory=list)

    @property
    def changed(self) -> bool:
        return self.output != self.source

    @property
    def changes(self) -> list[Note]:
        return [n for n in self.notes if not n.skipped]

    @property
    def skips(self) -> list[Note]:
        return [n for n in self.notes if n.skipped]


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
def _analyse(source: str) -> ScriptFacts:
    """The facts of a source, kept for the next rewrites of the same text: the facts are read,
    never changed, by the rules (the plans they draw from them are memoised per options), and
    the test suite rewrites each fixture with many sets of options."""
    return ScriptFacts(cst.parse_module(source))


def rewrite(
    source: str,
    options: Options,
    *,
    path: str = "<string>",
    rules: Optional[Sequence[Rule]] = None,
) -> Result:
    if rules is None:
        from accelerate_rewrite.rules import ALL_RULES

        rules = ALL_RULES
    try:
        facts = _analyse(source)
    except cst.ParserSyntaxError as exc:
        # Python's own parser names the place best (1-based line and column)
        try:
            compile(source, path, "exec", dont_inherit=True)
        except SyntaxError as py_exc:
            raise RewriteError(
                f"{path}:{py_exc.lineno}:{py_exc.offset}: syntax error: {py_exc.msg}"
            ) from None
        raise RewriteError(f"{path}:{exc.raw_line}:{exc.raw_column + 1}: syntax error: {exc.message}") from None
    result = Result(path=path, source=source, output=source)
    skip_line = skip_file_line(source)
    if skip_line is not None:
        result.notes.append(Note("file", skip_line, "`# accelerate-rewrite: skip-file`: the file is "
                                                    "left alone", skipped=True))
        return result
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
    # a rule whose prerequisite did not run can't run either
    orphans = {r.code for r in active if any(req not in contexts for req in r.requirements(options))}
    gone = set().union(*(_dependents(code, active, options) for code in orphans)) if orphans else set()
    for code in sorted(gone):
        if contexts[code].edits or contexts[code].notes:  # a rule with nothing to do goes quietly
            result.dropped.append(f"{code}: not applied: a rule it relies on did not run")
    active = [r for r in active if r.code not in gone]

    protected = protected_lines(source)
    if protected:
        for rule in list(active):
            if rule.code not in {r.code for r in active}:
                continue
            edits = contexts[rule.code].edits
            if not edits:
                continue
            alone = apply_edits(facts.module, [edits]).code
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

    def attempt(selected: Sequence[Rule]) -> tuple[str, list[str]]:
        new = apply_edits(facts.module, [contexts[r.code].edits for r in selected])
        code = new.code
        return code, ([] if code == source else check(original_undefined, code, facts.first_read))

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
