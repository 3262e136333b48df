"""codemod/tree/layout.py: the code and positions of a module one top-level statement at a time are
LibCST's own (``Module.code``, PositionProvider), and the code of a module the edits made from it,
spliced, is that module's ``code``."""

from __future__ import annotations

from pathlib import Path

import libcst as cst
import pytest
from libcst._nodes.base import CSTCodegenError
from libcst.metadata import MetadataWrapper, PositionProvider

from accelerate_rewrite.codemod.analysis.facts import ScriptFacts
from accelerate_rewrite.codemod.tree.layout import Layout

ROOT = Path(__file__).resolve().parent.parent
FIXTURE_INPUTS = sorted((ROOT / "fixtures").glob("*/input.py"))

ODD = {
    "crlf": "import torch\r\n\r\n# a comment\r\ndef f(x):\r\n    return x\r\n\r\ny = f(1)\r\n",
    "lone_cr": "import torch\rx = 1\r\rdef f():\r    return 2\r",
    "mixed": "x = 1\r\ny = '''a\rb\nc'''\n\ndef g():\n    pass\r\n",
    "no_newline_at_end": "import torch\nx = torch.ones(1)",
    "header_and_footer": "#!/usr/bin/env python\n# -*- coding: utf-8 -*-\n\n\"\"\"doc\"\"\"\nx = 1\n\n# the end\n\n",
    "decorators": "import functools\n\n\n# above\n@functools.lru_cache()\n\n# between\n@functools.wraps(print)\n\ndef f():\n    return 1\n",
    "block_footer": "def f():\n    x = 1\n    # indented, after the block\n\n# at the top level\ny = 2\n",
    "semicolons_and_continuations": "a = 1; b = 2\nc = (a +\n     b)\nd = a \\\n    + b\nif a: b = 3\n",
    "tabs": "def f():\n\tif True:\n\t\treturn 1\n\treturn 2\n",
    "except_space": "try:\n    x = 1\nexcept ValueError :\n    pass\ntry:\n    y = {1 : 2}\nexcept(KeyError):\n    pass\n",
    "form_feed": "x = 1\n\x0c\ndef f():\n    return x\n",
    "only_comments": "# nothing\n\n# else\n",
    "empty": "",
    "async": "import asyncio\n\nasync def main():\n    async with x as y:\n        async for z in y:\n            await z\n",
    "compound_ends": "if a:\n    b = 1\nelif c:\n    d = (1,\n         2)\n    # trailing\nelse:\n    pass\n"
                     "for x in y:\n    pass\nelse:\n    z = 1\n\n    # after the else\nwhile a:\n    break\n"
                     "try:\n    a()\nexcept E:\n    b()\nelse:\n    c()\nfinally:\n    d()\n"
                     "@dec\nclass K:\n    def m(self):\n        return \"\"\"a\nb\"\"\"\n    # end of m\n"
                     "with (open(a) as f,\n      open(b) as g):\n    pass\nx = [1,\n     2]; y = 3\n",
    "parameters": "def f(a,\n      *\n      args, b=1, **kw): pass\ndef g(*, c,\n  d): pass\nclass A:\n"
                  "    def h(self, /, x, *a, y, **k) -> int:\n        lambda q, r: q\n",
}


def _sources():
    return [(p.parent.name, p.read_text(encoding="utf-8")) for p in FIXTURE_INPUTS] + sorted(ODD.items())


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_code_and_positions_are_libcsts(name, source):
    module = cst.parse_module(source)
    layout = Layout(module)
    assert layout.code == module.code
    if layout.joins:
        assert layout.header + "".join(code for code, _ in layout.statements.values()) + layout.footer == module.code
    cut = Layout(module, text=source)  # the statements' code cut from the text: LibCST's, line for line
    assert (cut.code, cut.statements, cut.heights, cut.header, cut.footer, cut.joins) == (
        layout.code, layout.statements, layout.heights, layout.header, layout.footer, layout.joins)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    facts = ScriptFacts(module, fresh=True, text=source)
    mine = facts._meta[PositionProvider]
    for node, where in theirs.items():  # the statements' nodes first, one statement at a time
        if node is not module:
            assert mine.get(node) == where, (name, type(node).__name__)
    assert mine.get(module) == theirs[module]


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_the_plain_code_generation_is_libcsts(name, source):
    """codemod/tree/printing.py: LibCST's code generation with no context manager per node gives
    ``Module.code`` and ``code_for_node``, of the module and of every node, in and out of it."""
    from accelerate_rewrite.codemod.tree.printing import code_for, module_code

    def printed(make, *args):  # the code, or the error (a node that is printed only in its parent)
        try:
            return make(*args)
        except CSTCodegenError as exc:
            return str(exc)

    module = cst.parse_module(source)
    assert module_code(module) == module.code
    empty = cst.Module(body=[])
    for node in MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider):
        assert printed(code_for, node, module) == printed(module.code_for_node, node), (name, type(node).__name__)
        assert printed(code_for, node) == printed(empty.code_for_node, node), (name, type(node).__name__)


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_the_code_of_a_changed_module_is_spliced_as_libcst_prints_it(name, source):
    module = cst.parse_module(source)
    layout = Layout(module)
    body = list(module.body)
    if body:  # one statement replaced, one removed, one added, one moved
        body[0] = cst.parse_statement("changed = 1\n")
        if len(body) > 2:
            del body[1]
            body.append(body[1])
        body.insert(1, cst.parse_statement("if changed:\n    pass\n"))
    new = module.with_changes(body=body)
    assert layout.code_of(new) == new.code
    assert layout.code_of(module) == module.code
    # a module the transformer went through: new tuples of the same header and footer lines
    again = new.with_changes(header=tuple(new.header), footer=tuple(new.footer))
    assert layout.code_of(again) == again.code


def test_the_result_of_the_edits_is_spliced_not_printed_again():
    """The engine's result reuses the input's code for the statements the edits kept: with a
    header and a footer (a transformer makes new tuples of them), only the changed statement is
    generated again."""
    from unittest import mock

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.options import Options

    source = ("#!/usr/bin/env python\n# header comment\n\nimport torch\n\nmodel = torch.nn.Linear(4, 1)\n"
              "optimizer = torch.optim.SGD(model.parameters(), lr=0.1)\n"
              "with torch.cuda.amp.autocast():\n    loss = model(torch.randn(2, 4)).sum()\n"
              "loss.backward()\noptimizer.step()\n\n# footer comment\n")
    assert cst.parse_module(source).header
    with mock.patch.object(cst.Module, "code", new_callable=mock.PropertyMock) as whole:
        whole.side_effect = AssertionError("the whole module printed again")
        result = rewrite(source, Options.create(), path="<string>")
    assert result.output != source and "Fabric" in result.output


def test_a_module_read_with_aliases_is_printed_with_the_files_own_statements():
    """A project's file read through a module (``E.train`` analysed as ``train``,
    codemod/project/program.py): each statement's code is the file's own (``known``, from the file's
    Layout), so the result reuses the file's text for the statements the edits kept, and reads
    through the module again only in those they changed (the engine's ``apply_to``)."""
    from accelerate_rewrite.codemod.project.names import Realias, _Dealias

    source = "import engine as E\n\n\nE.train(model)  # one\nloss = E.evaluate(model)\nprint(loss)\n"
    original = cst.parse_module(source)
    aliases = {"train": "E", "evaluate": "E"}
    view = original.visit(_Dealias(aliases))
    assert "\ntrain(model)" in view.code
    own = Layout(original)
    layout = Layout(view, known={id(v): own.piece(o) for v, o in zip(view.body, original.body)})
    assert layout.code == source and layout.starts() == own.starts() == [1, 2, 5, 6, 7]
    body = list(view.body)
    body[2] = cst.parse_statement("loss = evaluate(model, 2)\n")
    new = view.with_changes(body=[s if id(s) in layout.statements else s.visit(Realias(aliases)) for s in body])
    assert layout.code_of(new) == source.replace("E.evaluate(model)", "E.evaluate(model, 2)")


def test_a_project_is_printed_once_and_analysed_without_a_copy(tmp_path):
    """The analysed module of a project is made of its files' statements: it is analysed as it
    is (no node stands twice in it), each file's statements are printed once for the lines and
    the splice, and a tree where a node does stand twice is copied for its analysis."""
    from unittest import mock

    from accelerate_rewrite.api import rewrite
    from accelerate_rewrite.codemod.project.program import Scope
    from accelerate_rewrite.options import Options
    from tests.test_projects import _engine_driver

    path = _engine_driver(tmp_path) / "train.py"
    with mock.patch.object(cst.Module, "deep_clone", side_effect=AssertionError("a copy")), \
            mock.patch.object(cst.Module, "code", new_callable=mock.PropertyMock) as whole:
        whole.side_effect = AssertionError("a whole file printed")
        result = rewrite(path.read_text(encoding="utf-8"), Options.create(), path=str(path), scope=Scope(follow=True))
    assert result.changed and result.members
    stmt = cst.parse_statement("x = 1\n")
    twice = cst.Module(body=[stmt, stmt])
    facts = ScriptFacts(twice, fresh=True)
    assert facts.module is not twice and facts.module.code == "x = 1\nx = 1\n"
    assert facts.parent(facts.module.body[1]) is facts.module


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_a_splice_is_the_new_module_and_its_blocks_map_the_kept_lines(name, source):
    """Layout.splice: the code of a module made from this one (statements replaced, removed,
    added) is its ``code``; its blocks cover the lines of both texts in order, and those it
    calls equal are equal (the flow check maps the result's lines to the input's by them)."""
    from accelerate_rewrite.codemod.tree.toplevel import line_list

    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        pytest.skip("LibCST can't read it")
    layout = Layout(module)
    body = []
    for i, stmt in enumerate(module.body):
        if i % 3 == 1:
            body.append(cst.parse_statement(f"replaced_{i} = {i}\n"))
        elif i % 5 != 4:
            body.append(stmt)
    body.insert(len(body) // 2, cst.parse_statement("added = 1\n"))
    new = module.with_changes(body=body)
    splice = layout.splice(new)
    if splice is None:
        assert not layout.joins
        return
    assert splice.code == new.code
    old_lines, new_lines = line_list(layout.code), line_list(new.code)
    i = j = 0
    for tag, i1, i2, j1, j2 in splice.blocks():
        assert (i1, j1) == (i, j)
        if tag == "equal":
            assert old_lines[i1:i2] == new_lines[j1:j2]
        i, j = i2, j2
    assert (i, j) == (len(old_lines), len(new_lines))
    moved = module.with_changes(body=list(reversed(module.body)))
    assert len(module.body) < 2 or layout.splice(moved) is None


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_the_trivia_of_the_statements_one_by_one_are_the_files(name, source):
    """preserve.py tokenizes a spliced result's changed statements alone: their comments and
    blank lines, put at their lines, are the whole file's; the checks by statements give the
    whole files' answers."""
    from accelerate_rewrite.codemod.edits.preserve import (_trivia_of, lost_trivia, lost_trivia_spliced,
                                                     removed_comments, removed_comments_spliced, trivia)

    try:
        module = cst.parse_module(source)
    except cst.ParserSyntaxError:
        pytest.skip("LibCST can't read it")
    layout = Layout(module)
    if not layout.joins or layout.code != source:
        return
    header = [(layout.header, 1)] if layout.header else []
    footer = [(layout.footer, len(source[:len(source) - len(layout.footer)].splitlines()) + 1)] if layout.footer else []
    assert _trivia_of(header + layout.pieces() + footer, {}) == list(trivia(source))
    # a statement with a comment over it removed, one replaced by one without comments
    body = [s for i, s in enumerate(module.body) if i % 4 != 2]
    body = [cst.parse_statement("x = 1\n") if i % 4 == 1 else s for i, s in enumerate(body)]
    new = module.with_changes(body=body)
    splice = layout.splice(new)
    if splice is None:
        return
    for regions in ([], [(1, len(source.splitlines()))], [(1, 3)]):
        assert lost_trivia_spliced(splice, regions, {}, source, new.code) == lost_trivia(source, new.code, regions)
    assert removed_comments_spliced(splice, {}) == removed_comments(source, new.code) or \
        len({t for _, t in trivia(source) if t}) < len([t for _, t in trivia(source) if t])  # a text twice


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_the_lines_python_tells_are_libcsts(name, source):
    """Positions.line: a node's line without its statement's positions where Python's parser
    tells it (``_line_in``), PositionProvider's line, for every node of every fixture it
    answers for; and ``line`` is PositionProvider's for every node."""
    from accelerate_rewrite.codemod.tree.positions import _line_in

    module = cst.parse_module(source)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    facts = ScriptFacts(module, fresh=True, text=source)
    positions = facts._meta[PositionProvider]
    told = 0
    for node, where in theirs.items():
        if node is module:
            continue
        chain = [node]
        while facts.parent(chain[-1]) is not module and facts.parent(chain[-1]) is not None:
            chain.append(facts.parent(chain[-1]))
        if facts.parent(chain[-1]) is None or id(chain[-1]) not in positions.layout.statements:
            continue  # the module's header or footer lines
        lines = positions._lines_of(chain[-1])
        found = _line_in(chain, lines) if lines is not None else None
        if found is not None:
            assert found == where.start.line, (name, type(node).__name__, [type(c).__name__ for c in chain])
            told += 1
        assert facts.line(node) == where.start.line, (name, type(node).__name__)
    assert told or len(module.body) < 2
    # a fixture's statements are told by the parse of its whole text (its tree, shared), not one by one
    assert name in ODD or positions.layout.python_body() is not None, name
    again = ScriptFacts(module, fresh=True, text=source)  # start and end, before any position is made
    for node in [n for n in theirs if isinstance(n, (cst.SimpleStatementLine, cst.BaseCompoundStatement))]:
        where = theirs[node]
        assert again.lines(node) == (where.start.line, where.end.line), (name, type(node).__name__)


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_the_positions_of_a_statement_inside_are_libcsts(name, source):
    """Positions.get generates the innermost statement around a node whose line Python's parser
    tells, from that line and with its blocks' indentation: every position it makes so is
    PositionProvider's, for each statement inside a top-level one (asked first)."""
    from accelerate_rewrite.codemod.tree.positions import Positions

    module = cst.parse_module(source)
    theirs = MetadataWrapper(module, unsafe_skip_copy=True).resolve(PositionProvider)
    facts = ScriptFacts(module, fresh=True, text=source)
    layout = facts.layout()
    inner = 0
    for node in theirs:
        if not isinstance(node, (cst.SimpleStatementLine, cst.BaseCompoundStatement)) \
                or facts.parent(node) is module:
            continue
        positions = Positions(layout, facts.parent, lambda: theirs)
        assert positions.get(node) == theirs[node], (name, type(node).__name__)
        for done, where in positions.found.items():
            assert where == theirs[done], (name, type(node).__name__, type(done).__name__)
        inner += bool(positions._inner_done)
    assert inner or name not in ("train_function", "crlf", "tabs", "async")


def _variants(stmt):
    """Copies of ``stmt`` with one inner statement (at any depth) replaced, removed, or moved
    into a new block below it; every other node kept as it is."""
    block = getattr(stmt, "body", None)
    if not isinstance(block, cst.IndentedBlock):
        return
    inner = list(block.body)
    for i, child in enumerate(inner):
        for replaced in ([cst.parse_statement("changed = 1\n")], [],
                         [cst.If(test=cst.Name("flag"), body=cst.IndentedBlock([child]))],
                         [cst.parse_statement("inserted = 2\n"), child]):
            yield stmt.with_changes(body=block.with_changes(body=[*inner[:i], *replaced, *inner[i + 1:]]))
        for changed in _variants(child):
            yield stmt.with_changes(body=block.with_changes(body=[*inner[:i], changed, *inner[i + 1:]]))


@pytest.mark.parametrize("name,source", _sources(), ids=[n for n, _ in _sources()])
def test_a_changed_statement_is_its_code_with_the_kept_inner_statements_cut_from_the_text(name, source, monkeypatch):
    """Layout._code_of_new: the code of a statement made from another with inner statements
    kept (their code cut from the text) is LibCST's code of it, whatever changed inside."""
    from accelerate_rewrite.codemod.tree import layout as layout_module

    cut = []
    real = layout_module._put_back
    monkeypatch.setattr(layout_module, "_put_back", lambda *args: cut.append(1) or real(*args))
    module = cst.parse_module(source)
    layout = Layout(module, text=source)
    for old in module.body:
        for k, new in enumerate(_variants(old)):
            if k >= 120:
                break
            assert layout._code_of_new(module, new, old) == module.code_for_node(new), (name, k)
    assert cut or name in ODD or not any(isinstance(getattr(s, "body", None), cst.IndentedBlock)
                                         and len(s.body.body) > 1 for s in module.body), name
