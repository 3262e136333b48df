"""The rule reference, made from each rule's docstring and examples (as ruff's rule pages are):
``docs/rules.md`` is this module's output, and ``accelerate-rewrite explain CODE`` prints a
rule's section of it. tests/test_rules_reference.py fails when docs/rules.md is out of date:

    python -m accelerate_rewrite.rules.reference          # rewrite docs/rules.md
    python -m accelerate_rewrite.rules.reference --check  # exit 1 when it is out of date
"""

from __future__ import annotations

import difflib
import sys
from pathlib import Path
from typing import Sequence

from accelerate_rewrite.codemod.rule import Rule
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules import ALL_RULES, find

DOCS = Path(__file__).resolve().parent.parent.parent / "docs" / "rules.md"


def options_text(options: dict) -> str:
    """An example's options as flags: ``--compile``, ``--freeze a --freeze b``, and the rules it
    selects by code as ``--select AR404``."""
    parts = []
    for key, value in options.items():
        flag = "--select" if key == "explicit" else f"--{key.replace('_', '-')}"
        if value is True:
            parts.append(flag)
        elif isinstance(value, (list, tuple, set, frozenset)):
            parts += [f"{flag} {item}" for item in sorted(value)]
        elif value not in (None, False):
            parts.append(f"{flag} {value}")
    return " ".join(parts)


def _diff(before: str, after: str) -> str:
    lines = list(difflib.unified_diff(before.splitlines(True), after.splitlines(True), "before", "after",
                                      n=1_000_000))
    return "".join(line if line.endswith("\n") else line + "\n" for line in lines)


def section(rule: Rule, level: int = 2) -> str:
    """A rule's documentation in Markdown: title, kind, what it relies on, its docstring, and
    each example as a diff."""
    out = [f"{'#' * level} {rule.code} {rule.name}", "", f"Kind: **{rule.kind.value}**."]
    if rule.requires:
        relied = ", ".join(f"{c} ({find(c).name})" for c in rule.requires)
        out.append(f"Relies on: {relied} (a rule it relies on that has nothing to do in a file need "
                   "not be selected).")
    grounds = rule.premises(Options.create())
    if grounds:
        out.append(f"Stands on: {'; '.join(grounds)} (where no rule made it in a file, this rule is dropped "
                   "there, with the reason).")
    out += ["", rule.documentation().strip()]
    for number, example in enumerate(rule.examples, 1):
        title = "Example" if len(rule.examples) == 1 else f"Example {number}"
        with_options = options_text(example.options)
        out += ["", f"**{title}**" + (f", with `{with_options}`" if with_options else "") + ":", ""]
        diff = _diff(example.before, example.after)
        if diff:
            out += ["```diff", diff.rstrip("\n"), "```"]
        else:
            out += ["(the rule leaves this code as it is)", "", "```python", example.before.rstrip("\n"), "```"]
    return "\n".join(out) + "\n"


def markdown(rules: Sequence[Rule] = ALL_RULES) -> str:
    """The whole of docs/rules.md."""
    out = ["# Rules", "",
           "<!-- made by `python -m accelerate_rewrite.rules.reference` from each rule's docstring and "
           "examples: edit those, not this file -->", "",
           "Every rule, with what it does, its kind (safe: keeps the math; approximate: within a known "
           "tolerance; changes-training: on purpose) and its before/after example. `accelerate-rewrite "
           "explain CODE` prints the same section; `accelerate-rewrite rules` lists them.", "",
           "| code | name | kind | what it does |", "|---|---|---|---|"]
    for rule in rules:
        anchor = f"{rule.code} {rule.name}".lower().replace(" ", "-")
        out.append(f"| [{rule.code}](#{anchor}) | {rule.name} | {rule.kind.value} | "
                   f"{rule.summary().replace('|', '/')} |")
    out.append("")
    return "\n".join(out) + "\n" + "\n".join(section(rule) for rule in rules)


def main(argv: Sequence[str] = ()) -> int:
    text = markdown()
    if "--check" in argv:
        current = DOCS.read_text(encoding="utf-8") if DOCS.exists() else ""
        if current != text:
            print(f"{DOCS} is out of date: python -m accelerate_rewrite.rules.reference", file=sys.stderr)
            return 1
        return 0
    DOCS.write_text(text, encoding="utf-8")
    print(f"wrote {DOCS}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
