"""Issue 29: docs/rules.md is made from each rule's docstring and examples (rules/reference.py),
and ``explain`` prints a rule's section of it. When a rule's documentation changes, this fails
until ``python -m accelerate_rewrite.rules.reference`` rewrites the page."""

from __future__ import annotations

from click.testing import CliRunner

from accelerate_rewrite.cli import cli
from accelerate_rewrite.rules import ALL_RULES
from accelerate_rewrite.rules.reference import DOCS, markdown, section


def test_docs_rules_md_is_up_to_date():
    assert DOCS.read_text(encoding="utf-8") == markdown(), (
        "docs/rules.md is out of date: python -m accelerate_rewrite.rules.reference")


def test_every_rule_has_its_section_and_a_row():
    text = DOCS.read_text(encoding="utf-8")
    for rule in ALL_RULES:
        assert f"\n## {rule.code} {rule.name}\n" in text
        assert f"| [{rule.code}](#" in text


def test_explain_prints_the_rules_section():
    for rule in ALL_RULES[:3]:
        done = CliRunner().invoke(cli, ["explain", rule.code])
        assert done.exit_code == 0 and done.output == section(rule)
