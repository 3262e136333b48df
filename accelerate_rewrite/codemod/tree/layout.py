"""A parsed module's text, one top-level statement at a time: each statement's code and first
line, cut from the text it was parsed from (or printed, where it can't be cut), and from these
the code of a changed module, with the unchanged statements' code reused (``Splice``: what the
checks ask of the statements a rewrite changed only); codemod/tree/positions.py has the positions of
one statement's nodes from its code and line.

LibCST's PositionProvider generates the code of the whole module with positions (a pure-Python
walk of every node) the first time any line is asked for; the rewrite asks for the lines of a
few statements (the notes, the statements the edits touch). And ``Module.code`` of the result
generates the whole module again for every attempt at the edits, where the edits change a few
statements. A top-level statement's code does not depend on what comes before it (its
generation starts with no indentation, at column 0: the statement before it ends with a
newline), so both can be done per statement; tests/test_facts.py checks the positions are
PositionProvider's own, node for node, and tests/test_layout.py that the cut and spliced code is
``Module.code``, on every fixture.
"""
from __future__ import annotations

import re
from functools import cached_property
from typing import Callable, Iterable, Mapping, Optional

import libcst as cst
from libcst._nodes.internal import CodegenState

from accelerate_rewrite.codemod.tree.pairing import Told, _pair
from accelerate_rewrite.codemod.tree.printing import PlainState, code_for, module_code
from accelerate_rewrite.codemod.tree.toplevel import KEPT_TREE_LINES, line_list, python_tree
from accelerate_rewrite.codemod.tree.toplevel import statements as python_statements

_NEWLINE = re.compile(r"\r\n?|\n")
#: what LibCST prints otherwise than the text of an ``except`` clause always has: white space
#: before a colon (``except ValueError :``, printed ``except ValueError:``)
_SPACE_COLON = re.compile(r"\s:")


def _may_print_otherwise(code: str) -> bool:
    """Whether LibCST may print this statement's code otherwise than it is (``_SPACE_COLON``)."""
    return "except" in code and _SPACE_COLON.search(code) is not None


def _lines_in(tokens: Iterable[str]) -> int:
    """Line breaks in the tokens, counted as PositionProvider counts them (token by token)."""
    return sum(len(_NEWLINE.findall(token)) for token in tokens if "\n" in token or "\r" in token)


def _same(these, those) -> bool:
    """The same nodes, one for one (a transformer that goes through the module makes a new tuple
    of its header and footer lines, of the same nodes where it changes none)."""
    return len(these) == len(those) and all(a is b for a, b in zip(these, those))


class Layout:
    """The code and first line of each top-level statement of ``module`` (one code generation,
    when first asked for). ``known``: id(statement) -> its code and the line breaks in it
    (``piece``), where another Layout knows them already (a project's files, codemod/project/program.py:
    the analysed module is made of their statements; a file read with aliases is printed with
    its own)."""

    def __init__(self, module: cst.Module, known: Optional[Mapping[int, tuple[str, int]]] = None,
                 text: Optional[str] = None) -> None:
        self.module = module
        self.known = known or {}
        #: the text ``module`` was parsed from: its statements' code is cut from it (``_cut``)
        self.text = text
        self._names: dict[int, frozenset[str]] = {}

    def __getattr__(self, name: str):  # only for what is not there yet: the pieces, made once
        if name in ("header", "statements", "heights", "footer", "joins", "code", "python_at"):
            if "statements" not in self.__dict__:
                self._build()
            if name == "code" and "code" not in self.__dict__:
                self.code = module_code(self.module)  # not its pieces joined: printed whole, when asked
            return self.__dict__[name]
        raise AttributeError(name)

    def _build(self) -> None:
        module = self.module
        state = PlainState(default_indent=module.default_indent, default_newline=module.default_newline)
        for line in module.header:
            line._codegen(state)
        self.header = "".join(state.tokens)
        line_no = 1 + _lines_in(state.tokens)
        if self.text is not None and not self.known and self._cut(state, line_no):
            return
        #: id(top-level statement) -> the index of its first statement in Python's parse of the
        #: text, where its code is cut from the text (``_cut``; ``python_body``)
        self.python_at: dict[int, int] = {}
        #: id(top-level statement) -> (its code, the line its code starts on)
        self.statements: dict[int, tuple[str, int]] = {}
        #: id(top-level statement) -> the line breaks in its code
        self.heights: dict[int, int] = {}
        for stmt in module.body:
            known = self.known.get(id(stmt))
            if known is None:
                start = len(state.tokens)
                stmt._codegen(state)
                tokens = state.tokens[start:]
                text, height = "".join(tokens), _lines_in(tokens)
            else:
                text, height = known
                state.tokens.append(text)
            self.statements[id(stmt)] = (text, line_no)
            self.heights[id(stmt)] = height
            line_no += height
        start = len(state.tokens)
        for line in module.footer:
            line._codegen(state)
        self.footer = "".join(state.tokens[start:])
        #: whether a module's code is its pieces joined (a module with no trailing newline, or
        #: with nothing in it, is printed otherwise at its end)
        self.joins = module.has_trailing_newline and bool(module.body)
        if self.joins:
            self.code = "".join(state.tokens)

    def _cut(self, state: CodegenState, line_no: int) -> bool:
        """The pieces cut from ``text`` where LibCST would print them as they are there: each
        statement starts ``len(leading_lines)`` lines above the first line of its code, which
        Python's parser gives (its first decorator's); the lines before that are the statement
        before's. LibCST does not print every text as it is (``except ValueError :`` loses its
        space: codemod/edits/preserve.py): a statement with ``except`` and white space before a
        colon in it is printed. False (and nothing kept) where the text and the tree do not agree
        so."""
        module, text = self.module, self.text
        if not (module.has_trailing_newline and module.body):
            return False
        stmts = python_statements(text)  # Python's reading of the text (codemod/tree/toplevel.py)
        if stmts is None:
            return False
        lines = line_list(text)
        header = len(module.header)
        if "".join(lines[:header]) != self.header:
            return False
        k, starts, python_at = 0, [], {}
        for node in module.body:
            python_at[id(node)] = k
            first = stmts[k] if k < len(stmts) else None
            k += len(node.body) if isinstance(node, cst.SimpleStatementLine) else 1
            if first is None or k > len(stmts):
                return False
            line = first.first
            if not (lines[line - 1].startswith("@") if first.decorated else first.column == 0):
                return False
            starts.append(line - len(node.leading_lines))
        footer = len(module.footer)
        end = len(lines) - footer  # where the footer starts, 0-based
        starts.append(end + 1)
        if k != len(stmts) or starts[0] != line_no or any(b <= a for a, b in zip(starts, starts[1:])):
            return False
        start = len(state.tokens)
        for line in module.footer:
            line._codegen(state)
        footer_code = "".join(state.tokens[start:])
        if "".join(lines[end:]) != footer_code:
            return False
        statements: dict[int, tuple[str, int]] = {}
        heights: dict[int, int] = {}
        for node, a, b in zip(module.body, starts, starts[1:]):
            code = "".join(lines[a - 1:b - 1])
            if _may_print_otherwise(code):  # as LibCST prints it, if it prints it
                # otherwise in as many lines
                printed = code_for(node, module)
                if printed != code and _lines_in([printed]) != b - a:
                    return False
                if printed != code:
                    del python_at[id(node)]  # its code is not the text's
                code = printed
            statements[id(node)] = (code, a)
            heights[id(node)] = b - a
        self.statements, self.heights, self.footer = statements, heights, footer_code
        self.python_at = python_at
        self.joins = True
        self.code = "".join([self.header, *(code for code, _ in statements.values()), footer_code])
        return True

    @cached_property
    def _text_lines(self) -> list[str]:
        """The text's lines, split once for every statement that changed."""
        return line_list(self.text)

    def python_body(self) -> Optional[list]:
        """Python's parse of the text, its top-level statements (``python_at`` indexes them), where
        the text is short enough for its tree to be kept (codemod/tree/toplevel.py's ``python_tree``,
        which the cut of the text parsed already); None otherwise."""
        if "_python_body" not in self.__dict__:
            text = self.text
            self._python_body = python_tree(text).body if text is not None and self.python_at \
                and text.count("\n") < KEPT_TREE_LINES else None
        return self._python_body

    def piece(self, stmt: cst.CSTNode) -> tuple[str, int]:
        """A top-level statement's code and the line breaks in it (what ``known`` takes)."""
        return self.statements[id(stmt)][0], self.heights[id(stmt)]

    def starts(self) -> list[int]:
        """The line each top-level statement starts on (its leading lines included), then the
        line after the last one (the line breaks of the code LibCST prints, as its positions
        count them: codemod/project/program.py maps the lines of a project's files by these)."""
        line = 1 + len(self.module.header)
        out = []
        for stmt in self.module.body:
            out.append(line)
            line += self.statements[id(stmt)][0].count("\n")
        out.append(line)
        return out

    def code_of(self, new: cst.Module) -> str:
        """``new.code``, for a module made from this one (the edits applied): the statements it
        keeps as they were are not generated again."""
        splice = self.splice(new)
        return splice.code if splice is not None else module_code(new)

    def splice(self, new: cst.Module) -> Optional["Splice"]:
        """``new`` as this module's statements, some kept and some new (``Splice``); None where
        its code is not its statements' joined (another header or footer, no final newline)
        or the statements it keeps are not in their order."""
        old = self.module
        if not (self.joins and new.has_trailing_newline and new.body and _same(new.header, old.header)
                and _same(new.footer, old.footer) and new.default_indent == old.default_indent
                and new.default_newline == old.default_newline):
            return None
        index = self._index
        pieces: list[tuple[str, Optional[int]]] = []
        last = -1
        for stmt in new.body:
            known = self.statements.get(id(stmt))
            if known is None:  # (the statement after the last one kept: what it may have been made from)
                pieces.append((self._code_of_new(new, stmt, old.body[last + 1] if last + 1 < len(old.body) else None),
                               None))
                continue
            at = index[id(stmt)]
            if at <= last:  # a statement moved, or kept twice
                return None
            last = at
            pieces.append((known[0], at))
        return Splice(self, pieces)

    def _code_of_new(self, new: cst.Module, stmt: cst.BaseStatement, old: Optional[cst.BaseStatement]) -> str:
        """``new.code_for_node(stmt)``. Where ``stmt`` is ``old`` (a statement of this module whose
        code is the text's) with inner statements kept as they were, in blocks of the same
        indentation, those are not printed again: their code is cut from the text, from the line
        their leading lines start on (Python's parser gives each statement's first line:
        codemod/tree/pairing.py) to the next statement's, or to the block's footer where the block
        ends its statement. A changed loop of a hundred lines prints its header and the
        statements on the way to what changed."""
        if old is None or type(old) is not type(stmt) or not isinstance(getattr(stmt, "body", None), cst.IndentedBlock) \
                or id(old) not in self.python_at:
            return code_for(stmt, new)
        told: dict[int, Told] = {}
        whole = self.python_body()
        at = self.python_at[id(old)]
        if whole is None or not _pair([old], whole[at:at + 1], 0, told):
            return code_for(stmt, new)
        kept: list[str] = []
        marked = self._marked(stmt, old, told, kept, self._text_lines,
                              self.statements[id(old)][1] + self.heights[id(old)])
        if not kept:
            return code_for(stmt, new)
        return _put_back(code_for(marked, new), kept, new.default_newline) or code_for(stmt, new)

    def _marked(self, stmt, old, told: dict[int, Told], kept: list[str], lines: list[str], end: Optional[int]):
        """``stmt`` with each inner statement of its body that ``old``'s body has as it is (and
        whose code the text tells) a marker line, its code appended to ``kept``; the others
        that are ``old``'s at the same place, changed, likewise inside. ``end``: the line after
        ``old``'s code, where known."""
        block, old_block = stmt.body, old.body
        if not (isinstance(block, cst.IndentedBlock) and isinstance(old_block, cst.IndentedBlock)
                and block.indent == old_block.indent):
            return stmt
        olds = old_block.body
        where = {id(s): j for j, s in enumerate(olds)}
        # where each statement's code ends: where the next one's starts, the last one's where the
        # block's footer starts if the block ends ``old`` (no ``else``, ``except``, ``finally``)
        last = getattr(old, "orelse", None) is None and not getattr(old, "handlers", None) \
            and getattr(old, "finalbody", None) is None
        ends = [_start(s, told) for s in olds[1:]] + [
            end - len(old_block.footer) if end is not None and last else None]
        body, changed = [], False
        for i, inner in enumerate(block.body):
            j = where.get(id(inner))
            code = _cut_inner(olds[j], told, lines, ends[j]) if j is not None else None
            if code is not None:
                body.append(cst.SimpleStatementLine([cst.Expr(cst.Name(_MARKER.format(len(kept))))]))
                kept.append(code)
                changed = True
                continue
            if j is None and i < len(olds) and type(olds[i]) is type(inner) and isinstance(
                    getattr(inner, "body", None), cst.IndentedBlock):
                marked = self._marked(inner, olds[i], told, kept, lines, ends[i])
                changed = changed or marked is not inner
                inner = marked
            body.append(inner)
        return stmt.with_changes(body=block.with_changes(body=body)) if changed else stmt

    @property
    def _index(self) -> dict[int, int]:
        found = self.__dict__.get("_index_")
        if found is None:
            found = self.__dict__["_index_"] = {id(stmt): i for i, stmt in enumerate(self.module.body)}
        return found

    def pieces(self) -> list[tuple[str, int]]:
        """Each top-level statement's code and the line it starts on, in order."""
        return [self.statements[id(stmt)] for stmt in self.module.body]

    def names_in(self, new: cst.Module, names_of: Callable[[cst.CSTNode], frozenset[str]]) -> set[str]:
        """The union of ``names_of(stmt)`` over the statements of ``new`` (kept for the
        statements of this module)."""
        out: set[str] = set()
        for stmt in new.body:
            key = id(stmt)
            if key in self.statements:
                found = self._names.get(key)
                if found is None:
                    found = self._names[key] = names_of(stmt)
            else:
                found = names_of(stmt)
            out |= found
        return out


#: a file's Layout, one for every program of a run that holds the file: id(tree) -> (the tree,
#: its text, its Layout). A repository's modules are parsed once (codemod/tree/parse.py) and each
#: entry point's program reads them again (``accelerate-rewrite .``): their statements' code, and
#: the names each statement reads (``names_in``), are then known from the first program on
_LAYOUTS: dict[int, tuple[cst.Module, str, "Layout"]] = {}
_LAYOUTS_MAX = 64


def layout_of(module: cst.Module, text: str) -> "Layout":
    """``Layout(module, text=text)``, made once per tree and text (a Layout changes nothing of
    its tree: what it makes, it makes once)."""
    found = _LAYOUTS.get(id(module))
    if found is None or found[0] is not module or found[1] != text:
        if len(_LAYOUTS) >= _LAYOUTS_MAX:
            _LAYOUTS.pop(next(iter(_LAYOUTS)))
        found = _LAYOUTS[id(module)] = (module, text, Layout(module, text=text))
    return found[2]


#: the name of a marker line ``Layout._marked`` puts where a kept inner statement's code goes
_MARKER = "__accelerate_rewrite_kept_{}__"


def _start(stmt: cst.BaseStatement, told: dict[int, Told]) -> Optional[int]:
    """The line an inner statement's code starts on (its first leading line), where told."""
    this = told.get(id(stmt))
    return this[0] - len(stmt.leading_lines) if this is not None else None


def _cut_inner(stmt: cst.BaseStatement, told: dict[int, Told], lines: list[str], end: Optional[int]) -> Optional[str]:
    """The code of the inner statement ``stmt`` as the text has it: from the first of its
    leading lines to ``end`` (the line after it). None where the lines are not told, or LibCST
    may print the text otherwise (``_may_print_otherwise``)."""
    start = _start(stmt, told)
    if start is None or end is None or not 1 <= start < end <= len(lines) + 1:
        return None
    code = "".join(lines[start - 1:end - 1])
    return None if _may_print_otherwise(code) else code


def _put_back(printed: str, kept: list[str], newline: str) -> Optional[str]:
    """``printed`` with each marker line (its indentation, its name, its line break) replaced
    by the code it stands for; None where a marker is not alone on its line, once."""
    for k, code in enumerate(kept):
        name = _MARKER.format(k)
        at = printed.find(name)
        if at < 0 or printed.find(name, at + 1) >= 0:
            return None
        start = max(printed.rfind("\n", 0, at), printed.rfind("\r", 0, at)) + 1
        end = at + len(name) + len(newline)
        if printed[start:at].strip(" \t") or printed[at + len(name):end] != newline:
            return None
        printed = printed[:start] + code + printed[end:]
    return printed


class Splice:
    """A module made from a Layout's (the edits applied) as the code of its top-level
    statements: ``pieces``, each with the index of the statement of the Layout's module it
    keeps as it was, or None for a statement the edits made. What the checks of a result ask
    of the statements the rewrite changed only (codemod/checks.py)."""

    def __init__(self, layout: Layout, pieces: list[tuple[str, Optional[int]]]) -> None:
        self.layout = layout
        self.pieces = pieces

    @property
    def code(self) -> str:
        layout = self.layout
        return "".join([layout.header, *(code for code, _ in self.pieces), layout.footer])

    def old(self) -> list[tuple[str, int, bool]]:
        """The input's statements as ``flow.unbound_in`` takes them: deep where not kept."""
        kept = {at for _, at in self.pieces if at is not None}
        return [(code, line, i not in kept) for i, (code, line) in enumerate(self.layout.pieces())]

    def new(self) -> list[tuple[str, int, bool]]:
        """The result's statements so: deep where new."""
        line = 1 + _lines_in([self.layout.header])
        out = []
        for code, at in self.pieces:
            out.append((code, line, at is None))
            line += _lines_in([code])
        return out

    def changed(self) -> list[tuple[list[tuple[str, int]], list[tuple[str, int]]]]:
        """The runs of statements between those kept, as ``(input's, result's)``, each
        statement as its code and the line it starts on."""
        old = self.layout.pieces()
        out = []
        i, line = 0, 1 + _lines_in([self.layout.header])
        new: list[tuple[str, int]] = []
        for code, at in self.pieces:
            if at is not None:
                if i < at or new:
                    out.append((old[i:at], new))
                i, new = at + 1, []
            else:
                new.append((code, line))
            line += _lines_in([code])
        if i < len(old) or new:
            out.append((old[i:], new))
        return out

    def blocks(self, old_lines: Optional[list[str]] = None,
               new_lines: Optional[list[str]] = None) -> list[tuple[str, int, int, int, int]]:
        """The opcodes of the input's lines against the result's (difflib's, 0-based, ends
        excluded; lines as ``line_list`` cuts them, or as given), the statements kept ``equal``
        and the lines between them compared by difflib (a rewrite changes a few statements:
        the file is not compared whole)."""
        from difflib import SequenceMatcher

        old_lines = old_lines if old_lines is not None else line_list(self.layout.code)
        new_lines = new_lines if new_lines is not None else line_list(self.code)
        old = self.layout.pieces()
        header = _lines_in([self.layout.header])
        out: list[tuple[str, int, int, int, int]] = []

        def equal(i: int, j: int, n: int) -> None:
            if n <= 0:
                return
            if out and out[-1][0] == "equal" and out[-1][2] == i and out[-1][4] == j:
                tag, i1, _, j1, _ = out.pop()
                out.append((tag, i1, i + n, j1, j + n))
            else:
                out.append(("equal", i, i + n, j, j + n))

        def region(i1: int, i2: int, j1: int, j2: int) -> None:
            if i1 == i2 and j1 == j2:
                return
            if i1 == i2 or j1 == j2:
                out.append(("insert" if i1 == i2 else "delete", i1, i2, j1, j2))
                return
            matcher = SequenceMatcher(None, old_lines[i1:i2], new_lines[j1:j2], autojunk=False)
            for tag, a1, a2, b1, b2 in matcher.get_opcodes():
                if tag == "equal":
                    equal(i1 + a1, j1 + b1, a2 - a1)
                else:
                    out.append((tag, i1 + a1, i1 + a2, j1 + b1, j1 + b2))

        equal(0, 0, header)
        starts = [line - 1 for _, line in old] + [len(old_lines) - _lines_in([self.layout.footer])]
        i = j = from_j = header  # the next line of the input, of the result; where the new ones began
        for code, at in self.pieces:
            height = _lines_in([code])
            if at is not None:  # the input's lines from i to this statement were replaced by the new ones
                region(i, starts[at], from_j, j)
                equal(starts[at], j, height)
                i, from_j = starts[at] + height, j + height
            j += height
        region(i, starts[-1], from_j, j)
        equal(starts[-1], j, len(old_lines) - starts[-1])
        return out
