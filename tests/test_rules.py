"""Each rule: documented, registered once, and its own before/after examples hold."""

from __future__ import annotations

import ast

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.codemod.rule import Kind
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules import ALL_RULES, BY_CODE, find

EXAMPLES = [
    pytest.param(rule, i, example, id=f"{rule.code}-{i}")
    for rule in ALL_RULES
    for i, example in enumerate(rule.examples)
]


def test_codes_and_names_are_unique_and_in_order():
    codes = [r.code for r in ALL_RULES]
    assert codes == sorted(codes) and len(set(codes)) == len(codes)
    assert len({r.name for r in ALL_RULES}) == len(ALL_RULES)
    assert set(BY_CODE) == set(codes)


@pytest.mark.parametrize("rule", ALL_RULES, ids=lambda r: r.code)
def test_rule_is_documented(rule):
    doc = rule.documentation()
    for section in ("What it does:", "Why:", "Kind:"):
        assert section in doc, f"{rule.code} lacks '{section}'"
    assert isinstance(rule.kind, Kind)
    assert rule.summary() and "\n" not in rule.summary()
    assert rule.examples, f"{rule.code} has no example"
    assert find(rule.code) is rule and find(rule.name) is rule and find(rule.code.lower()) is rule


@pytest.mark.parametrize("rule,index,example", EXAMPLES)
def test_example_holds(rule, index, example):
    options = Options.create(**example.options)
    result = rewrite(example.before, options)
    assert result.output == example.after
    assert any(n.rule == rule.code for n in result.notes), f"{rule.code} said nothing"
    ast.parse(result.output)
    assert rewrite(result.output, options).output == result.output


def test_requirements_name_real_rules():
    for rule in ALL_RULES:
        assert set(rule.requires) <= set(BY_CODE), rule.code


def test_the_readme_is_a_front_page_that_links_every_docs_page():
    """Issue 29: README under ~300 lines, every page of docs/ linked from it; the rule catalogue
    is docs/rules.md (made from the rules: tests/test_rules_reference.py)."""
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    readme = (root / "README.md").read_text()
    assert len(readme.splitlines()) <= 300
    for page in sorted((root / "docs").glob("*.md")):
        assert f"(docs/{page.name})" in readme, page.name
    catalogue = (root / "docs" / "rules.md").read_text()
    for rule in ALL_RULES:
        assert f"| [{rule.code}](#" in catalogue and f"| {rule.name} | {rule.kind.value} |" in catalogue, rule.code
