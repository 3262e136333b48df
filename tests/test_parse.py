"""codemod/tree/parse.py: a long module parsed in pieces (and a long function's or class's body in
pieces of its own) is the tree LibCST's parse of the whole text makes, node for node, and prints
the same code. Pieces of a line or two put a cut between every two statements."""

from __future__ import annotations

import libcst as cst
import libcst.matchers as m
import pytest

from accelerate_rewrite.codemod.tree import parse
from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.tree.parse import parse_module
from tests.goldens import FIXTURES, fixture_names, notes_text, run
from tests.test_layout import _sources

#: where the pieces meet: what LibCST gives a piece's end and what it gives the whole parse
PIECES = {
    "block_footers": "def f():\n    x = 1\n        # deeper\n    # the block's\n  # between\n# top\n\n"
                     "def g():\n    if x:\n        y = 2\n\n        # inner\n    # outer\n\n\nz = 3\n",
    "decorated": "import a\n\n\n# about f\n@a.b\n# between\n@a.c(\n    1)\ndef f():\n    pass\n@a.d\nclass K:\n    pass\n",
    "semicolons": "a = 1; b = 2\nc = 3; d = 4\nif a: b = 5\nx = [\n1]\ny = \\\n  2\nz = 1\n",
    "top_level_else": "if a:\n    b = 1\nelse:\n    b = 2\ntry:\n    c = 1\nexcept E:\n    pass\nd = 1\n",
    "coding_cookie": "# -*- coding: latin-1 -*-\nx = 'é'\n\ndef f():\n    return x\ny = f()\n",
    "indent_mixed": "def f():\n\treturn 1\n\n\ndef g():\n    return 2\n\n\ndef h():\n  return 3\n",
    "indent_late": "import a\nimport b\nx = 1\n\ndef f():\n\tif a:\n\t\treturn b\n",
    "newline_mixed": "import a\r\nx = 1\r\ny = 2\nz = 3\n\ndef f():\r\n    return z\r\n",
    "trailing_spaces_no_newline": "import a\nx = 1\n\n   \n   ",
    "body_comments": "def main():\n    a = 1\n\n    # c\n        # d\n\n# e\n    \n\n    b = 2\n    if a:\n        c = 3\n\n"
                     "        # inner\n  # odd\n    # outer\n    d = 4\n\t\n\n\nx = 1\n",
    "class_body": "class K:\n    \"\"\"doc\"\"\"\n\n    @staticmethod\n    # between\n    def f():\n        pass\n\n"
                  "    x = 1; y = 2\n    z = (\n1)\n    def g(self): return 1\n",
    "tab_body": "def f():\n\ta = 1\n\n\tb = 2\n\t# c\n\treturn a\n",
    "crlf_body": "def f():\r\n    a = 1\r\n\r\n    # c\r\n    return a\r\n\r\nx = f()\r\n",
    "one_line_bodies": "def f(a,\n      b): return a; b\nclass K: x = 1\nasync def g():\n    await f()\n    return 1\n",
    "strings": "s = '''\ndef not_a_cut():\n'''\nt = 1\nu = \"\"\"a\n\nb\"\"\"\n",
}


def _all():
    return _sources() + sorted(PIECES.items())


@pytest.mark.parametrize("name,source", _all(), ids=[n for n, _ in _all()])
def test_the_pieces_make_the_whole_parse(name, source):
    whole = cst.parse_module(source)  # (LibCST's own: each node checked as it is made)
    for piece_lines in (1, 2, 7, parse.PIECE_LINES):
        pieced = parse_module(source, piece_lines=piece_lines)
        assert pieced.deep_equals(whole), (name, piece_lines)
        assert pieced.code == whole.code
        assert (pieced.encoding, pieced.default_indent, pieced.default_newline, pieced.has_trailing_newline) == (
            whole.encoding, whole.default_indent, whole.default_newline, whole.has_trailing_newline)


def _parses(monkeypatch, source: str, piece_lines: int) -> int:
    calls = []
    real = cst.parse_module
    monkeypatch.setattr(parse.cst, "parse_module", lambda text: calls.append(text) or real(text))
    parse_module(source, piece_lines=piece_lines)
    monkeypatch.setattr(parse.cst, "parse_module", real)
    return len(calls)


def test_a_long_module_is_parsed_in_pieces_and_a_short_one_whole(monkeypatch):
    source = "".join(f"def f{i}():\n    return {i}\n\n\n" for i in range(40))
    assert _parses(monkeypatch, source, 40) == 4  # 160 lines in pieces of 40
    assert _parses(monkeypatch, source, 81) == 1  # under two pieces' worth


def test_a_long_function_is_parsed_in_pieces_of_its_body(monkeypatch):
    long = "def main():\n" + "".join(f"    x{i} = {i}\n" for i in range(100)) + "\n\nmain()\n"
    assert _parses(monkeypatch, long, 10) == 12  # main in pieces of 10 lines (11), then the call
    assert parse_module(long, piece_lines=10).deep_equals(cst.parse_module(long))


@pytest.mark.parametrize("name,statements", [("indent_mixed", 3), ("newline_mixed", 5)])
def test_pieces_that_detect_other_defaults_give_way_to_the_whole_parse(monkeypatch, name, statements):
    source = PIECES[name]
    assert _parses(monkeypatch, source, 1) == statements + 1  # a piece each, then the whole
    assert parse_module(source, piece_lines=1).deep_equals(cst.parse_module(source))


def test_the_nodes_made_after_a_parse_are_checked_again():
    checking = cst.CSTNode.__post_init__
    parse_module("x = 1\n")
    with pytest.raises(cst.ParserSyntaxError):
        parse_module("def f(:\n    pass\n")
    assert cst.CSTNode.__post_init__ is checking
    with pytest.raises(cst.CSTValidationError):
        cst.Name("not a name")


def test_what_python_or_libcst_cannot_read_is_parsed_whole_for_libcsts_error():
    bad = "x = 1\n" * 10 + "def f(:\n    pass\n"
    with pytest.raises(cst.ParserSyntaxError) as pieced:
        parse_module(bad, piece_lines=1)
    with pytest.raises(cst.ParserSyntaxError) as whole:
        cst.parse_module(bad)
    assert str(pieced.value) == str(whole.value)


# ---- a long result's checks in pieces (codemod/checks.py) ----------------------------------

def _spliced(source: str):
    from accelerate_rewrite.codemod.tree.layout import Layout

    module = cst.parse_module(source)
    return Layout(module, text=source).splice(module)


def _results():
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "fixtures"
    return [(str(p.relative_to(root)), p.read_text(encoding="utf-8"))
            for p in sorted(root.glob("*/expected/*")) if p.is_file() and not p.name.endswith(".notes")][::3] + _all()


@pytest.mark.parametrize("name,source", _results(), ids=[n for n, _ in _results()])
def test_a_result_in_pieces_compiles_and_resolves_as_the_whole(name, source):
    from accelerate_rewrite.codemod.checks import _all_names_resolve, _compile, _pieces

    splice = _spliced(source)
    for piece_lines in (1, 3):
        pieces = _pieces(source, splice, piece_lines)
        if pieces is None:
            continue
        assert "".join(pieces) == source
        future = _compile(pieces)  # every fixture's result compiles
        assert _all_names_resolve(pieces, future) == _all_names_resolve([source]), (name, piece_lines)


@pytest.mark.parametrize("source,error", [
    ("import os\n\ndef f():\n    return 1\n\nreturn 2\n", "'return' outside function"),
    ("from __future__ import annotations\nx = 1\n\ndef f(a: Undefined) -> None:\n    yield from ()\n"
     "y = 2\nawait f()\n", "'await' outside function"),
])
def test_a_result_in_pieces_fails_to_compile_as_the_whole(source, error):
    from accelerate_rewrite.codemod.checks import _compile, _pieces

    pieces = _pieces(source, _spliced(source), 1)
    assert pieces is not None and len(pieces) > 2
    with pytest.raises(SyntaxError) as whole:
        compile(source, "<rewritten>", "exec", dont_inherit=True)
    with pytest.raises(SyntaxError) as pieced:
        _compile(pieces)
    assert pieced.value.msg == whole.value.msg == error


@pytest.mark.parametrize("source", [
    "x = 1\ny = 2\nfrom __future__ import annotations\n",  # an error only after the first piece
    "x = 1\ny = 2\nglobal x\n",  # an error after an assignment before it
])
def test_a_result_whose_errors_need_what_comes_before_is_compiled_whole(source):
    from accelerate_rewrite.codemod.checks import _pieces

    assert _pieces(source, _spliced(source), 1) is None


def test_the_future_features_of_the_first_piece_hold_in_the_others():
    from accelerate_rewrite.codemod.checks import _all_names_resolve, _compile, _pieces

    source = "from __future__ import annotations\nimport os\n\n\ndef f(a: Undefined) -> None:\n    return os\n"
    pieces = _pieces(source, _spliced(source), 1)
    assert pieces is not None and len(pieces) > 1
    future = _compile(pieces)
    assert _all_names_resolve(pieces, future) == _all_names_resolve([source]) is True
    assert _all_names_resolve(pieces) is False  # the annotation read as a read, without the feature


def test_a_long_scripts_scopes_are_freed_when_let_go_without_the_collector():
    """``ScriptFacts.release`` (a long script's scopes, let go once the rules have run) cuts their
    cycles (facts_scopes._unlink): every scope is freed by reference counting alone, and a
    later question is answered by a new analysis, as the first one answered it."""
    import gc
    import weakref

    facts = ScriptFacts(parse_module((FIXTURES / "trainer_class" / "input.py").read_text(encoding="utf-8")))
    names = [n for n in facts.find(m.Name()) if facts.scope(n) is not None]
    before = [facts.qualnames(n) for n in names]
    scopes = {id(facts.scope(n)): weakref.ref(facts.scope(n)) for n in names}
    assert len(scopes) > 3  # the module's, a class's, its methods'
    gc.disable()
    try:
        facts.release()
        assert all(ref() is None for ref in scopes.values())
    finally:
        gc.enable()
    facts._qualnames.clear()
    assert [facts.qualnames(n) for n in names] == before


@pytest.mark.parametrize("name", fixture_names())
def test_a_long_scripts_way_gives_the_goldens(name, monkeypatch):
    """The way the engine takes with a long script (its facts not kept, its scopes let go and cut
    before the results are made and checked: engine.LONG_SCRIPT_LINES) gives every fixture's
    golden output and notes."""
    from accelerate_rewrite.codemod import engine

    monkeypatch.setattr(engine, "LONG_SCRIPT_LINES", 0)
    for option_set in ("default", "bf16-mixed-devices-4"):
        result = run(name, option_set)
        expected = FIXTURES / name / "expected"
        assert result.output == (expected / f"{option_set}.py").read_text(encoding="utf-8")
        assert notes_text(result) == (expected / f"{option_set}.notes").read_text(encoding="utf-8")


_STARRED = "from models import *\nimport torch\n\nnet = Generator()\n\n\ndef train():\n    return net(torch.ones(1))\n"


def test_a_result_reading_only_what_the_input_read_unbound_needs_no_scope_analysis(monkeypatch):
    """A script with a star import reads names Python's symbol tables can't bind (``Generator``):
    a result that reads no other such name passes without LibCST's analysis of it (checks.py
    ``_no_new_unresolved``); one that reads a name nothing defines any more is still caught, at
    its line."""
    from accelerate_rewrite.codemod import checks

    parsed = []
    real = checks.parse_module
    monkeypatch.setattr(checks, "parse_module", lambda text: parsed.append(text) or real(text))
    kept = _STARRED.replace("torch.ones(1)", "torch.zeros(1)")
    assert checks.check({"Generator": 4}, kept, original=_STARRED) == []
    assert parsed == []
    broken = _STARRED.replace("net = Generator()\n", "model = Generator()\n")
    problems = checks.check({"Generator": 4}, broken, original=_STARRED)
    assert problems == ["it uses `net` (line 8 of the result), which is no longer defined"]
    assert parsed == [broken]  # LibCST's analysis, for the line
    # without the input's text, as before: LibCST's analysis of every such result
    assert checks.check({"Generator": 4}, kept) == []
    assert parsed[-1] == kept


def test_the_parses_kept_are_bounded_and_the_newest_is_always_kept(monkeypatch):
    """codemod/tree/parse.py's ``parsed_text``: the same tree for the same text while it is kept;
    the oldest go first past ``KEPT_TEXTS`` texts or ``KEPT_CHARACTERS`` characters, and the
    newest stays whatever its length (a long script's rewrite asks for it twice)."""
    monkeypatch.setattr(parse, "KEPT_TEXTS", 3)
    monkeypatch.setattr(parse, "KEPT_CHARACTERS", 100)
    parse.parsed_text.cache_clear()
    texts = [f"x{i} = {i}\n" for i in range(4)]
    trees = [parse.parsed_text(t) for t in texts]
    assert list(parse._KEPT) == texts[1:]  # three kept, the oldest gone
    assert parse.parsed_text(texts[3]) is trees[3] and parse.parsed_text(texts[0]) is not trees[0]
    long = "y = 1\n" * 40  # 240 characters: past the bound alone
    tree = parse.parsed_text(long)
    assert list(parse._KEPT) == [long] and parse.parsed_text(long) is tree
    parse.parsed_text.cache_clear()
    assert not parse._KEPT
