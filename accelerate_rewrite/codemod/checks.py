"""Post-conditions on a rewritten module: it compiles, it uses no name it does not define, and
it reads no name that some path leaves unbound where the input bound it on every path
(codemod/tree/flow.py)."""

from __future__ import annotations

import __future__
import builtins
import functools
import operator
import re
import symtable
from typing import Callable, Optional, Union

import libcst as cst
from libcst.metadata import MetadataWrapper, PositionProvider, ScopeProvider

from accelerate_rewrite.codemod.tree.parse import PIECE_LINES, parse_module


class _Positions:
    """The positions of a tree's nodes, computed when a line is first asked for (a result with
    no undefined name needs none)."""

    def __init__(self, module: cst.Module) -> None:
        self.module = module
        self.found = None

    def get(self, node: cst.CSTNode, default=None):
        if self.found is None:
            from accelerate_rewrite.codemod.tree.metadata import resolve

            self.found = resolve(MetadataWrapper(self.module, unsafe_skip_copy=True), PositionProvider)
        return self.found.get(node, default)


def undefined_names(module: cst.Module) -> dict[str, int]:
    """Names read somewhere without any assignment, import or builtin behind them -> first line."""
    from accelerate_rewrite.codemod.tree.scopes import scopes

    try:
        found = scopes(module)
    except (AttributeError, TypeError, KeyError):  # LibCST's internals moved: its own way
        found = MetadataWrapper(module, unsafe_skip_copy=True).resolve(ScopeProvider)
    return undefined_in(found, _Positions(module))


def undefined_in(scopes, positions) -> dict[str, int]:
    """name -> the first line that reads it undefined (the scopes' accesses are sets, in no
    order of the file's: every read is placed)."""
    out: dict[str, int] = {}
    for scope in {s for s in scopes.values() if s is not None}:
        for access in scope.accesses:
            if access.referents:
                continue
            name = access.node.value if isinstance(access.node, cst.Name) else None
            if name is None:
                continue
            pos = positions.get(access.node)
            line = pos.start.line if pos is not None else 0
            out[name] = min(out.get(name, line), line)
    return out


def check(
    original_undefined: Union[dict[str, int], Callable[[], dict[str, int]]],
    new_code: str,
    locate: Callable[[str], Optional[int]] = lambda name: None,
    original_unbound: Optional[tuple[str, Callable[[], dict[tuple[str, str], list[int]]]]] = None,
    splice=None,
    trees: Optional[dict] = None,
    original: Optional[str] = None,
) -> list[str]:
    """Problems of ``new_code`` that the original did not have; empty when all is well.

    ``original_undefined``: the names the input reads undefined already, or what gives them
    when first needed (a result that reads a name nothing defines; LibCST's analysis of a
    long input's every read is then made only where a result needs it).
    ``locate(name)`` gives the line of the input where a name that is no longer defined is
    read (the user's file, not the discarded result). ``splice`` (codemod/tree/layout.py), where
    ``new_code`` is the input's top-level statements, some kept and some new: the flow check
    goes into the scopes of the new ones only, and compares the lines between the kept ones
    (``trees``: the statements it parsed for the module's scope, kept for the next attempt).
    ``original``: the input's text, whose names read unbound (Python's symbol tables) a result
    may read so too without LibCST's analysis of the result.
    """
    pieces = _pieces(new_code, splice) or [new_code]
    try:
        future = _compile(pieces)
    except SyntaxError as exc:
        return [f"the result does not compile ({exc.msg})"]
    problems = []
    if _no_new_unresolved(pieces, future, original):
        undefined = {}
    else:  # LibCST's scope analysis, on the result parsed again
        try:
            module = parse_module(new_code)
        except cst.ParserSyntaxError as exc:
            return [f"the result does not parse ({exc.message})"]
        undefined = undefined_names(module)
    if undefined and callable(original_undefined):
        original_undefined = original_undefined()
    for name, line in sorted(undefined.items(), key=lambda item: item[1]):
        if name not in original_undefined:
            where = locate(name)
            where_text = f"line {where}" if where is not None else f"line {line} of the result"
            problems.append(f"it uses `{name}` ({where_text}), which is no longer defined")
    if original_unbound is not None and not problems:
        problems.extend(_new_unbound_reads(original_unbound, new_code, splice,
                                           trees if trees is not None else {}))
    return problems


#: a module-level ``global`` or ``nonlocal`` statement (an error Python tells from what comes
#: before it in the module)
_MODULE_DECLARATION = re.compile(r"^(?:global|nonlocal)\b", re.MULTILINE)

#: the compiler flags of every future feature (``from __future__ import ...``)
_FUTURE_FLAGS = functools.reduce(operator.or_, (getattr(__future__, name).compiler_flag
                                                for name in __future__.all_feature_names), 0)


def _pieces(new_code: str, splice, piece_lines: int = PIECE_LINES) -> Optional[list[str]]:
    """A long result spliced from its top-level statements (codemod/tree/layout.py) in pieces of whole
    statements, about ``piece_lines`` lines each, which Python compiles one at a time (the
    compiler's own memory for the whole of a 50k-line script is about 120 MiB); None to take it whole:
    a short one, one not spliced, and one with a ``from __future__`` import or a module-level
    ``global`` past its first piece (Python tells those apart by what comes before them)."""
    if splice is None or new_code.count("\n") < 2 * piece_lines:
        return None
    layout = splice.layout
    parts = [layout.header, *(code for code, _ in splice.pieces), layout.footer]
    pieces, current, lines = [], [], 0
    for part in parts:
        current.append(part)
        lines += part.count("\n")
        if lines >= piece_lines:
            pieces.append("".join(current))
            current, lines = [], 0
    if "".join(current):
        pieces.append("".join(current))
    if len(pieces) < 2 or "".join(pieces) != new_code \
            or any("__future__" in piece or _MODULE_DECLARATION.search(piece) for piece in pieces[1:]):
        return None
    return pieces


def _compile(pieces: list[str]) -> int:
    """Python's compile of the pieces of a module, in order, each under the future features the
    first turns on (their compiler flags, returned); a SyntaxError as the whole module's compile
    raises it."""
    flags = 0
    for i, piece in enumerate(pieces):
        code = compile(piece, "<rewritten>", "exec", flags=flags, dont_inherit=True)
        if i == 0:
            flags = code.co_flags & _FUTURE_FLAGS
    return flags


def _new_unbound_reads(original: tuple[str, Callable[[], dict[tuple[str, str], list[int]]]],
                       new_code: str, splice=None, trees: Optional[dict] = None) -> list[str]:
    """Reads of ``new_code`` at a point some path reaches without binding the name, that the
    input did not have: on a line the rewrite inserted, on a line it left as it was (a binding
    before it went), or on a line it changed whose input lines did not read the name so."""
    import bisect
    import difflib

    from accelerate_rewrite.codemod.tree.flow import maybe_unbound, unbound_in
    from accelerate_rewrite.codemod.tree.toplevel import line_list

    source, reads = original
    found = unbound_in(splice.new(), trees) if splice is not None else None
    before = None
    if found is not None:
        if not found:
            return []
        before = unbound_in(splice.old(), trees)
    whole = before is None
    if whole:  # the whole file, parsed, and compared by difflib
        found = maybe_unbound(new_code)
        if not found:
            return []
        before = reads()
    old_lines, new_lines = line_list(source), line_list(new_code)
    blocks = difflib.SequenceMatcher(None, old_lines, new_lines, autojunk=False).get_opcodes() if whole \
        else splice.blocks(old_lines, new_lines)
    blocks = [b for b in blocks if b[4] > b[3]]  # those that hold lines of the result, in order
    firsts = [b[3] for b in blocks]
    for (scope, name), lines in sorted(found.items(), key=lambda item: item[1]):
        known = set(before.get((scope, name), []))
        for line in lines:
            tag, i1, i2, j1, _ = blocks[bisect.bisect_right(firsts, line - 1) - 1]
            if tag == "equal":
                ok = i1 + (line - 1 - j1) + 1 in known
            elif tag == "replace":  # (a set-up inserted next to lines another rule changed)
                indent = _indent(new_lines[line - 1])
                ok = any(i1 < n <= i2 for n in known) or _read_later(old_lines, i1, known, indent) \
                    or any(_exhaustive_chain(source, at, indent, name)
                           or _fails_alike(source, old_lines, at, indent, name, before, scope) for at in (i1, i2))
            else:  # inserted: fine right after an input line at its indentation that read the name so
                # already (nanoGPT's `optimizer = model.configure_optimizers(...)`, then the set-up):
                # every path to it went through that read, which failed the same way there
                ok = (i1 in known and _indent(old_lines[i1 - 1]) == _indent(new_lines[line - 1])) \
                    or _read_later(old_lines, i1, known, _indent(new_lines[line - 1])) \
                    or _exhaustive_chain(source, i1, _indent(new_lines[line - 1]), name) \
                    or _fails_alike(source, old_lines, i1, _indent(new_lines[line - 1]), name, before, scope)
            if not ok:
                where = scope.replace("<module>.", "").replace("<module>", "the module")
                return [f"it reads `{name}` (line {line} of the result, in {where}) where some path "
                        "leaves it unbound"]
    return []




#: the headers of blocks that run on some paths only
_BRANCHES = ("if ", "if(", "elif", "else", "for ", "while ", "except", "finally", "def ", "class ", "async ",
             "match ", "case ", "lambda")
#: a statement after which the lines that follow it in its block don't run
_LEAVES = ("return", "raise", "break", "continue", "sys.exit(", "exit(", "quit(")


def _read_later(old_lines: list[str], after: int, known: set[int], indent: int) -> bool:
    """Every path from an inserted line (after input line ``after``, at ``indent``) runs on to
    an input line that read the name so already (``known``) in the same block: nothing between
    dedents below ``indent`` or leaves the block (dino's optimizer built in an ``if``/``elif``
    chain without ``else``, the set-up after the chain, the input's own read of it a few lines
    on: where the chain binds nothing, both fail there, loudly, before training starts). Any
    ``return``, ``raise``, ``break``, ``continue`` or exit between, however deep, may leave."""
    later = sorted(n for n in known if n > after)
    if not later:
        return False
    enclosing, at = None, 0  # the read's statement in the inserted line's block, and its line
    for number in range(after + 1, later[0] + 1):
        text = old_lines[number - 1]
        if text.strip() and not text.lstrip().startswith("#") and _indent(text) == indent:
            enclosing, at = text.strip(), number
    if enclosing is None or (enclosing.startswith(_BRANCHES) and not (
            at == later[0] and enclosing.startswith(("if ", "if(", "for ", "while ", "with ")))):
        # read in a block that may not run (``for``, ``if``): not on every path; a header's own
        # read (``for module in modules_ori:``) always runs
        return False
    for number in range(after + 1, later[0] + 1):
        text = old_lines[number - 1]
        if not text.strip() or text.lstrip().startswith("#"):
            continue
        if _indent(text) < indent:
            return False
        if text.strip().startswith(_LEAVES) and number < later[0]:
            return False  # (in a nested block too: ``if ...: return``)
    return True


def _exhaustive_chain(source: str, after: int, indent: int, name: str) -> bool:
    """The inserted line follows an ``if``/``elif`` chain without ``else`` that binds ``name``
    in every branch and tests one command-line flag against each of the choices argparse
    allows it (MoCo v3's ``if args.optimizer == 'lars': ... elif args.optimizer == 'adamw':
    ...`` with ``choices=['lars', 'adamw']``): some branch always runs."""
    import ast

    from accelerate_rewrite.codemod.tree.toplevel import python_tree

    try:
        tree = python_tree(source)  # (the input's tree, shared: read only)
    except (SyntaxError, ValueError):
        return False
    chain = _chain_before(tree, source, after, indent)
    tested: set[str] = set()
    flag = None
    node = chain
    while isinstance(node, ast.If):
        test = node.test
        if not (isinstance(test, ast.Compare) and len(test.ops) == 1 and isinstance(test.ops[0], ast.Eq)
                and isinstance(test.left, ast.Attribute) and isinstance(test.comparators[0], ast.Constant)
                and isinstance(test.comparators[0].value, str)):
            return False
        if flag not in (None, test.left.attr) or not any(
                isinstance(t, ast.Name) and t.id == name for s in node.body for t in ast.walk(s)
                if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)):
            return False
        flag = test.left.attr
        tested.add(test.comparators[0].value)
        if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
            node = node.orelse[0]
        elif node.orelse:
            return False
        else:
            node = None
    if flag is None:
        return False
    for call in ast.walk(tree):
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute)
                and call.func.attr == "add_argument"):
            continue
        names = [a.value for a in call.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
        dest = next((k.value.value for k in call.keywords if k.arg == "dest" and isinstance(k.value, ast.Constant)),
                    None)
        dests = {dest} if dest else {n.lstrip("-").replace("-", "_") for n in names if n.startswith("--")} \
            or {n for n in names}
        if flag not in dests:
            continue
        choices = next((k.value for k in call.keywords if k.arg == "choices"), None)
        if isinstance(choices, (ast.List, ast.Tuple, ast.Set)) and choices.elts and all(
                isinstance(e, ast.Constant) for e in choices.elts):
            return {e.value for e in choices.elts} <= tested
    return False


def _chain_before(tree, source: str, after: int, indent: int):
    """The ``if`` statement (an ``if``/``elif`` chain) that ends at line ``after`` (blank and
    comment lines aside), at ``indent``, or None."""
    import ast

    lines = source.splitlines()

    def blank(number: int) -> bool:
        text = lines[number - 1].strip() if number <= len(lines) else ""
        return not text or text.startswith("#")

    return next((n for n in ast.walk(tree) if isinstance(n, ast.If) and n.col_offset == indent
                 and n.end_lineno is not None and n.end_lineno <= after
                 and all(blank(k) for k in range(n.end_lineno + 1, after + 1))), None)


def _fails_alike(source: str, old_lines: list[str], after: int, indent: int, name: str,
                 reads: dict, scope: str) -> bool:
    """The inserted line comes after an ``if``/``elif`` chain without ``else`` whose every branch
    binds ``name`` and other names, one of which the input reads on every path after the chain
    (semseg's ``model``, ``modules_ori`` and ``modules_new``, built for one ``args.arch`` or
    another, and ``for module in modules_ori:`` right after it): where no branch runs, the input
    fails at that read, loudly, before training starts, as the rewrite would."""
    import ast

    from accelerate_rewrite.codemod.tree.toplevel import python_tree

    try:
        tree = python_tree(source)  # (the input's tree, shared: read only)
    except (SyntaxError, ValueError):
        return False
    # the last ``if`` at this indentation before the inserted line, in its block
    lines = source.splitlines()
    candidates = [n for n in ast.walk(tree) if isinstance(n, ast.If) and n.col_offset == indent
                  and n.end_lineno is not None and n.end_lineno <= after and all(
                      not lines[k - 1].strip() or lines[k - 1].lstrip().startswith("#")
                      or _indent(lines[k - 1]) >= indent for k in range(n.end_lineno + 1, after + 1))]
    for node in sorted(candidates, key=lambda n: -n.lineno):  # the chains whose branches all bind it
        end = node.end_lineno
        common: Optional[set[str]] = None
        while isinstance(node, ast.If):
            bound = {t.id for st in node.body for t in ast.walk(st)
                     if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store)}
            common = bound if common is None else common & bound
            if len(node.orelse) == 1 and isinstance(node.orelse[0], ast.If):
                node = node.orelse[0]
            elif node.orelse and _complains(node.orelse):
                # ``else: print("Unknown optimizer. Please choose between (adam, sgd).")``
                # (PyTorch-YOLOv3's): that path is the script's own error, which it goes on from
                # to fail at its first use of the name
                if common and name in common:
                    return True
                common = None
                break
            elif node.orelse:
                common = None  # with an ``else``, some branch always runs: not this case
                break
            else:
                node = None
        if common and name in common and any(
                _read_later(old_lines, end, set(reads.get((scope, other), [])), indent) for other in sorted(common)):
            return True
    return False


#: what an ``else`` that only reports a value nothing handles says
_COMPLAINTS = re.compile(r"unknown|unsupported|not supported|not implemented|invalid|please choose|no such|"
                         r"unrecognized|not recognized", re.IGNORECASE)


def _complains(body: list) -> bool:
    """A block that only prints, logs or warns that a value is not one it knows, and binds
    nothing (``print("Unknown optimizer. Please choose between (adam, sgd).")``)."""
    import ast

    for stmt in body:
        if not (isinstance(stmt, ast.Expr) and isinstance(stmt.value, ast.Call)):
            return False
        func = stmt.value.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
        if name not in ("print", "warn", "warning", "error", "info", "critical", "exception"):
            return False
    texts = [n.value for stmt in body for n in ast.walk(stmt) if isinstance(n, ast.Constant) and isinstance(n.value, str)]
    return bool(body) and any(_COMPLAINTS.search(t) for t in texts)


def _indent(text: str) -> int:
    return len(text) - len(text.lstrip())


#: names a module reads without binding them: builtins and the module's own attributes
_IMPLICIT = frozenset(dir(builtins)) | {"__file__", "__name__", "__doc__", "__spec__", "__loader__",
                                        "__package__", "__builtins__", "__path__", "__annotations__",
                                        "__dict__", "__cached__"}


def _all_names_resolve(pieces: list[str], future: int = 0) -> bool:
    """Whether every name the module (given as the pieces of its text, ``_pieces``) reads is
    bound in its scope, an enclosing one, the module or the builtins, by Python's own symbol
    tables (the compiler's, in C: much cheaper than LibCST's scope analysis, which then runs
    only when this can't show it). False when unsure (``from x import *``, a name that may be
    unbound)."""
    return _unresolved(pieces, future) == frozenset()


@functools.lru_cache(maxsize=8)
def _unresolved_in(text: str) -> Optional[frozenset[str]]:
    """``_unresolved`` of a whole module's text (an input, asked again at each attempt)."""
    return _unresolved([text])


def _no_new_unresolved(pieces: list[str], future: int, original: Optional[str]) -> bool:
    """Whether the result (its pieces) reads, unbound by Python's symbol tables, only names the
    ``original`` text read so too: then the result uses no name that is no longer defined, and
    LibCST's scope analysis of it is not needed (the names a star import binds, which the
    symbol tables don't know, are unbound in both)."""
    found = _unresolved(pieces, future)
    if found is None:
        return False
    if not found:
        return True
    if original is None or original.count("\n") >= 2 * PIECE_LINES:
        return False
    before = _unresolved_in(original)
    return before is not None and found <= before


def _unresolved(pieces: list[str], future: int = 0) -> Optional[frozenset[str]]:
    """The names the module (given as the pieces of its text, ``_pieces``) reads that are not
    bound in their scope, an enclosing one, the module or the builtins, by Python's own symbol
    tables (a star import binds none there); None where a piece has no symbol table. A function's
    symbols are its piece's alone; the module's are those of every piece, and a name a piece
    reads of the module is looked for among them all. ``future``: the future features the first
    piece turns on (``_compile``), of which postponed annotations change what the others read."""
    module_names: set[str] = set()
    global_reads: set[str] = set()
    postponed = "from __future__ import annotations\n" if future & __future__.annotations.compiler_flag else ""
    for i, piece in enumerate(pieces):
        if i and postponed:
            piece = postponed + piece
        try:
            top = symtable.symtable(piece, "<rewritten>", "exec")
        except (SyntaxError, ValueError):
            return None
        module_names.update(s.get_name() for s in top.get_symbols() if s.is_assigned() or s.is_imported()
                            or s.is_namespace())
        todo = [top]
        while todo:
            table = todo.pop()
            todo.extend(table.get_children())
            for symbol in table.get_symbols():
                if not symbol.is_referenced():
                    continue
                if table is top:
                    global_read = not (symbol.is_assigned() or symbol.is_imported() or symbol.is_namespace())
                else:
                    global_read = symbol.is_global() or not (symbol.is_local() or symbol.is_free())
                if global_read:
                    global_reads.add(symbol.get_name())
    return frozenset(global_reads - module_names - _IMPLICIT)

