"""AR501 fast tokenizers: static rewrites (transformers is not installed for the tests, and the
rewrite path never imports it)."""

from __future__ import annotations

import ast
import textwrap

import pytest

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from accelerate_rewrite.rules.data.fast_tokenizer import SLOW


def _rewrite(source: str):
    options = Options.create(backend="torch")
    result = rewrite(textwrap.dedent(source), options)
    ast.parse(result.output)
    assert rewrite(result.output, options).output == result.output, "not idempotent"
    return result


def _notes(result, skipped: bool) -> str:
    return " | ".join(n.message for n in result.notes if n.rule == "AR501" and n.skipped == skipped)


@pytest.mark.parametrize("slow", sorted(SLOW)[:5])
def test_slow_classes_become_fast_in_the_import_and_at_each_use(slow):
    result = _rewrite(f"""\
        from transformers import {slow}

        tok = {slow}.from_pretrained("x")
        other = {slow}("vocab.txt")
        """)
    assert f"from transformers import {slow}Fast\n" in result.output
    assert f"tok = {slow}Fast.from_pretrained(\"x\")" in result.output
    assert f"other = {slow}Fast(\"vocab.txt\")" in result.output
    assert f"import {slow}\n" not in result.output


def test_module_attribute_form_and_use_fast():
    result = _rewrite("""\
        import transformers
        from transformers import AutoTokenizer

        a = transformers.RobertaTokenizer.from_pretrained("roberta-base")
        b = AutoTokenizer.from_pretrained(
            "bert-base-uncased",
            use_fast=False,
        )
        c = AutoTokenizer.from_pretrained("gpt2", use_fast=True)
        """)
    assert 'a = transformers.RobertaTokenizerFast.from_pretrained("roberta-base")' in result.output
    assert 'b = AutoTokenizer.from_pretrained(\n    "bert-base-uncased",\n)' in result.output
    assert 'c = AutoTokenizer.from_pretrained("gpt2", use_fast=True)' in result.output


def test_what_it_leaves_alone():
    decided = _rewrite("""\
        from transformers import AutoTokenizer

        fast = False
        tok = AutoTokenizer.from_pretrained("x", use_fast=fast)
        """)
    assert not decided.changed and "decided at run time" in _notes(decided, True)
    sentencepiece = _rewrite("""\
        from transformers import T5Tokenizer

        tok = T5Tokenizer.from_pretrained("t5-small")
        pieces = tok.sp_model.encode("hello")
        """)
    assert not sentencepiece.changed and "slow tokenizers only" in _notes(sentencepiece, True)
    other = _rewrite("from transformers import MarianTokenizer\n\ntok = MarianTokenizer.from_pretrained('x')\n")
    assert not other.changed  # no fast counterpart


def test_a_tokenization_script_without_training_is_not_skipped_by_the_fast_path(tmp_path):
    """The runner skips files without training words; AR501 names its own ("tokenizer")."""
    from click.testing import CliRunner

    from accelerate_rewrite.cli import cli

    script = tmp_path / "prepare.py"
    script.write_text('from transformers import BertTokenizer\n\ntok = BertTokenizer.from_pretrained("x")\n')
    done = CliRunner().invoke(cli, [str(script), "--write", "--isolated"])
    assert done.exit_code == 0, done.output
    assert "BertTokenizerFast.from_pretrained" in script.read_text()
