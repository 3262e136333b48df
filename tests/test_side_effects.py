"""Issue 48: what a conversion must keep on N processes and in the text: side effects that
would run twice, and comments the rules never touched (fixtures/apex_dcgan)."""

from __future__ import annotations

import io
import tokenize
from collections import Counter

from accelerate_rewrite.api import rewrite
from accelerate_rewrite.options import Options
from tests.goldens import FIXTURES


def _comments(code: str) -> Counter:
    return Counter(t.string for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type == tokenize.COMMENT)


def test_the_apex_dcgan_example_migrates_with_every_comment_kept():
    """NVIDIA apex's examples/dcgan/main_amp.py, reduced: the ``try: from apex import amp``
    guard goes whole once its import does (its blank line with it), which the comment check
    counted as a blank line lost outside the edits, and blamed on ``# folder dataset``: the
    migration was dropped for a comment it never touched."""
    source = (FIXTURES / "apex_dcgan" / "input.py").read_text(encoding="utf-8")
    for options in (Options.create(backend="torch", precision="16-mixed"), Options.create()):
        result = rewrite(source, options, path="fixtures/apex_dcgan/input.py")
        assert not result.dropped, result.dropped
        assert "with amp.scale_loss" not in result.output and "from apex" not in result.output
        assert _comments(result.output) == _comments(source)


def test_a_lost_blank_line_is_named_as_such_not_as_a_later_comment():
    from accelerate_rewrite.codemod.preserve import lost_trivia

    source = "import a\n\nimport b\n# one\nx = 1\n\n# two\ny = 2\n"
    output = "import a\nimport b\n# one\nx = 1\n\n# two\ny = 2\n"
    assert lost_trivia(source, output, []) == "it would lose the blank line 2"
