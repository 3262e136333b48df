"""A module that other files of the repository import too, changed so that they keep working.

DINO's utils.py starts the process group in ``init_distributed_mode(args)``, and its
eval_knn.py, eval_linear.py and the others call it as well; MAE's util/misc.py holds the
loss-scaler class that main_finetune.py and main_linprobe.py use too. Converted for one
script, such a module would change what the others call (``init_distributed_mode(fabric,
args)``): so it changes *compatibly* instead (``compatible``):

- a function or class that receives `fabric` takes it as a last, optional parameter,
  ``fabric=None`` (a class keeps it in ``self.fabric``), and the converted script passes it
  by keyword (``fabric=fabric``, keywords.py's ``calls_by_keyword``);
- each statement the conversion changes to read `fabric` runs only with `fabric`, the
  statement it was runs without it::

      if fabric is not None:
          fabric.backward(loss)
      else:
          loss.backward()

  (``self.fabric`` in a class's methods); a statement that starts or wraps the processes
  Fabric starts (``init_process_group``, ``DistributedDataParallel``) or sets their device
  (``torch.cuda.set_device``), which the conversion removes, runs without `fabric` only; a
  compound statement whose header is unchanged is changed inside (its body, its ``else``, an
  ``elif``);
- a statement the conversion changed in one expression keeps the rest, that expression chosen
  by `fabric`: ``(fabric.print if fabric is not None else print)(log_msg.format(...))``;
- an ``if`` whose test the conversion changed keeps its blocks: its test is chosen by `fabric`
  (``fabric.world_size > 1 if fabric is not None else "RANK" in os.environ``), and what changed
  inside is guarded as above: no block is written twice;
- a change that reads no `fabric` (a move Fabric makes anyway, ``torch.cuda.amp`` ->
  ``torch.amp``) can't be told from one the other files would notice: the old code stays;
  but in a definition no other file reads (``free``: AR213's ``GradScaler(enabled=False)`` in
  the loss-scaler class only the converted script uses) it is made, as a second run would;
- a ``device`` parameter threaded into `fabric` stays, `fabric` comes last and optional, and the
  converted callers pass ``fabric.device`` in its place (``Taken.instead``);
- imports it no longer reads stay: the old code still reads them.

Called without `fabric`, every function runs its code as it was. What this can't give (a
parameter that changes otherwise, a process group started where no `fabric` comes, another
top-level statement changed) is None: the engine then leaves the change out, as before, and
says which files import it.
"""

from __future__ import annotations

import contextvars
import difflib
import re
from dataclasses import dataclass, field
from typing import Optional, Sequence

import libcst as cst

from accelerate_rewrite.codemod.project.guards import NAME, chosen, guard, reads_fabric
from accelerate_rewrite.codemod.tree.parse import parsed_text
from accelerate_rewrite.codemod.tree.printing import code_for, code_once, module_code

#: whether the definition being merged is one no other file reads (``compatible``'s ``free``)
_FREE: contextvars.ContextVar[bool] = contextvars.ContextVar("free", default=False)


@dataclass(frozen=True)
class Taken:
    """How a function or class of the module takes `fabric` now: at ``index`` among its
    positional parameters in the conversion, last and optional in the compatible module;
    ``instead``: the parameter `fabric` took the place of (a ``device`` threaded into it), which
    the compatible module keeps, its callers passing it ``fabric.device``."""

    index: int
    instead: Optional[str] = None


@dataclass
class Compatible:
    """The compatible text of a module, and the functions and classes (by name, in that
    module) whose calls now pass `fabric` by keyword (``Taken``)."""

    code: str
    keyword_calls: dict[str, Taken] = field(default_factory=dict)
    #: the tree ``code`` is printed from
    tree: Optional[cst.Module] = None
    #: the functions and classes changed so, for the note
    changed: list[str] = field(default_factory=list)


#: a statement's code without its leading lines, printed once (``_bare_code``): id -> (the
#: statement, kept alive so that its id is not reused, its code)
_BARE: dict[object, tuple[cst.CSTNode, str]] = {}
_BARE_MAX = 20_000


def _stmt_code(node: cst.CSTNode) -> str:
    """Its code (printed once per node: a merge compares the same statements' code many times,
    and each entry point of a repository merges the same shared module's statements again)."""
    return code_once(node)


def _bare_code(node: cst.BaseStatement) -> str:
    """``node``'s code without its leading blank lines and comments."""
    found = _BARE.get(id(node))
    if found is None or found[0] is not node:
        if len(_BARE) >= _BARE_MAX:
            _BARE.clear()
        found = _BARE[id(node)] = (node, code_for(node.with_changes(leading_lines=())))
    return found[1]


def _param_names(params: cst.Parameters) -> list[str]:
    return [p.name.value for p in [*params.posonly_params, *params.params]]


def _with_optional_fabric(old: cst.Parameters, new: cst.Parameters) -> Optional[tuple[cst.Parameters, Taken]]:
    """``(args)`` -> ``(fabric, args)``, or ``(model, device)`` -> ``(model, fabric)``: the old
    parameters with ``fabric=None`` last, and how the conversion took it (``Taken``); None when
    they differ otherwise."""
    before, after = _param_names(old), _param_names(new)
    if NAME not in after or NAME in before:
        return None
    index = after.index(NAME)
    instead = before[index] if len(before) == len(after) else None

    def each(params: cst.Parameters, skip: Optional[str]) -> list[str]:
        return [_stmt_code(p.with_changes(comma=cst.MaybeSentinel.DEFAULT))
                for p in [*params.posonly_params, *params.params, *params.kwonly_params]
                if p.name.value not in (NAME, skip)] + [
            _stmt_code(params.star_arg.with_changes(comma=cst.MaybeSentinel.DEFAULT))
            if isinstance(params.star_arg, cst.Param) else "", _stmt_code(params.star_kwarg) if params.star_kwarg else ""]

    if instead is not None:
        if after[:index] + after[index + 1:] != before[:index] + before[index + 1:] \
                or each(old, instead) != each(new, None):
            return None
    elif after[:index] + after[index + 1:] != before or each(old, None) != each(new, None):
        return None
    taken = Taken(index, instead)
    fabric = cst.Param(cst.Name(NAME), default=cst.Name("None"),
                       equal=cst.AssignEqual(whitespace_before=cst.SimpleWhitespace(""),
                                             whitespace_after=cst.SimpleWhitespace("")))
    if isinstance(old.star_arg, cst.Param) or old.kwonly_params:
        # after ``*args`` (or the bare ``*``): a keyword-only parameter
        kwonly = list(old.kwonly_params)
        if kwonly and kwonly[-1].comma is cst.MaybeSentinel.DEFAULT:
            kwonly[-1] = kwonly[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
        return old.with_changes(kwonly_params=[*kwonly, fabric]), taken
    params = list(old.params)
    if params and params[-1].comma is cst.MaybeSentinel.DEFAULT:
        params[-1] = params[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    elif params and isinstance(params[-1].comma, cst.Comma):  # ``(a, b,)``: keep its trailing comma
        fabric = fabric.with_changes(comma=params[-1].comma)
        params[-1] = params[-1].with_changes(comma=cst.Comma(whitespace_after=cst.SimpleWhitespace(" ")))
    return old.with_changes(params=[*params, fabric]), taken


#: (a function nested in the one that changes, MSN's ``def train_step():`` in ``main``: merged
#: inside too, its guards reading the enclosing function's `fabric`)
_COMPOUND = (cst.If, cst.For, cst.While, cst.With, cst.Try, cst.FunctionDef)


def _header(node: cst.BaseStatement) -> Optional[str]:
    """A compound statement's code with its blocks emptied: equal for two statements that differ
    only inside."""
    if not isinstance(node, _COMPOUND):
        return None
    empty = cst.IndentedBlock(body=[cst.SimpleStatementLine([cst.Pass()])])
    changes: dict = {"body": empty, "leading_lines": ()}
    if isinstance(node, cst.Try):  # its handlers' and ``finally``'s blocks, emptied too
        changes["handlers"] = [h.with_changes(body=empty) for h in node.handlers]
        if node.finalbody is not None:
            changes["finalbody"] = node.finalbody.with_changes(body=empty)
    if getattr(node, "orelse", None) is not None:
        orelse = node.orelse
        changes["orelse"] = orelse.with_changes(body=empty) if isinstance(orelse, cst.Else) \
            else cst.Else(body=empty)  # an ``elif``: compared as its own statement below
    return _stmt_code(node.with_changes(**changes))


def _blocks_of(node: cst.BaseStatement) -> list[Optional[cst.BaseSuite]]:
    out = [node.body]
    orelse = getattr(node, "orelse", None)
    if isinstance(orelse, cst.Else):
        out.append(orelse.body)
    elif isinstance(orelse, cst.If):
        out.append(None)  # an ``elif``: not merged inside
    return out


class _Fail(Exception):
    pass


def _merge(old: Sequence[cst.BaseStatement], new: Sequence[cst.BaseStatement],
           test: Optional[str]) -> list[cst.BaseStatement]:
    """The statements of a block, ``old`` where the conversion kept them, guarded where it
    changed them (``_guard``); a compound statement whose header it kept is merged inside."""
    old_codes = [_bare_code(s) for s in old]
    new_codes = [_bare_code(s) for s in new]
    out: list[cst.BaseStatement] = []
    matcher = difflib.SequenceMatcher(None, old_codes, new_codes, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            out.extend(old[i1:i2])
            continue
        these, those = list(old[i1:i2]), list(new[j1:j2])
        # ``self.fabric = fabric`` as the conversion adds it: kept with or without `fabric`
        kept_new = [s for s in those if _bare_code(s).strip()
                    in (f"self.{NAME} = {NAME}",)]
        those = [s for s in those if s not in kept_new]
        out.extend(s.with_changes(leading_lines=()) for s in kept_new)
        # statements of the same header (``if args.is_slurm_job:`` changed inside) are merged
        # inside; the others, in runs, guarded
        keys = lambda stmts: [_header(s) or _bare_code(s) for s in stmts]  # noqa: E731
        inner = difflib.SequenceMatcher(None, keys(these), keys(those), autojunk=False)
        for kind, a1, a2, b1, b2 in inner.get_opcodes():
            if kind == "replace" and test is not None:
                out.extend(_by_tests(these[a1:a2], those[b1:b2], test))
                continue
            if kind == "equal":
                for a, b in zip(these[a1:a2], those[b1:b2]):
                    if _header(a) is None:
                        out.append(a)
                        continue
                    try:
                        out.append(_merge_inside(a, b, test))
                    except _Fail:  # changed where it can't be merged inside (an ``elif``'s test): whole
                        out.extend(_changed([a], [b], test))
            else:
                out.extend(_changed(these[a1:a2], those[b1:b2], test))
    return out


#: what only the old code may run: the processes Fabric starts itself, the device it gives each
#: of them (``torch.cuda.set_device``: on a CPU it raises), and the wrap it makes
_PROCESSES = re.compile(r"\b(init_process_group|destroy_process_group|DistributedDataParallel|set_device(?:_index)?)\b")


def _changed(these: list[cst.BaseStatement], those: list[cst.BaseStatement], test: Optional[str]) -> list[cst.BaseStatement]:
    """A run of statements the conversion changed, guarded by ``test`` (`fabric`, or
    ``self.fabric``): the new ones with it, the old ones without. A change that reads no
    `fabric` (a move Fabric makes anyway, an API's new spelling) can't be told from one that
    other callers would notice, so the old statements stay, unguarded; but where they start or
    wrap the processes Fabric starts (``init_process_group``, ``DistributedDataParallel``), they
    run without `fabric` only (and with no `fabric` to tell, the module can't change so)."""
    if not these and not those:
        return []
    leading = these[0].leading_lines if these else those[0].leading_lines
    if not any(reads_fabric(t) for t in those):
        if not any(_PROCESSES.search(_stmt_code(t)) for t in these):
            return those if _FREE.get() else these
        if test is None:
            raise _Fail
        those = [s for s in those if not _PROCESSES.search(_stmt_code(s))] if those else []
        return [guard(test, [s.with_changes(leading_lines=()) if i == 0 else s for i, s in enumerate(those)],
                       [s.with_changes(leading_lines=()) if i == 0 else s for i, s in enumerate(these)], leading)]
    if test is None:
        raise _Fail
    if len(these) == len(those) == 1:
        one = _one_point(these[0], those[0], test)
        if one is not None:
            return [one]
        if _passes_it_on(these[0], those[0], test):
            return [those[0].with_changes(leading_lines=these[0].leading_lines)]
    if len(those) == 1 and isinstance(those[0], cst.If) and those[0].orelse is None \
            and isinstance(those[0].body, cst.IndentedBlock) \
            and [_bare_code(x) for x in those[0].body.body] \
            == [_bare_code(x) for x in these]:
        # the old statements under a new test (``if fabric.is_global_zero:``): run where it holds,
        # or without `fabric`
        held = _stmt_code(those[0].test)
        held = held if isinstance(those[0].test, (cst.Name, cst.Attribute, cst.Call)) else f"({held})"
        return [those[0].with_changes(test=cst.parse_expression(f"{test} is None or {held}"), leading_lines=leading)]
    return [guard(test, [s.with_changes(leading_lines=()) if i == 0 else s for i, s in enumerate(those)],
                   [s.with_changes(leading_lines=()) if i == 0 else s for i, s in enumerate(these)], leading)]


def _passes_it_on(old: cst.BaseStatement, new: cst.BaseStatement, test: str) -> bool:
    """Whether the conversion changed the statement only by passing `fabric` on by keyword
    (``MetricLogger(delimiter="  ", fabric=fabric)``), to a function or class of the project that
    takes it last and optional: without `fabric` it gets None, as it did."""
    found = _differing(old, new)
    if found is None or not isinstance(found[0], cst.Call) or not isinstance(found[1], cst.Call):
        return False
    a, b = found
    if len(b.args) != len(a.args) + 1 or _stmt_code(b.func) != _stmt_code(a.func):
        return False

    def same(xs, ys) -> bool:
        return all(_stmt_code(x.with_changes(comma=cst.MaybeSentinel.DEFAULT))
                   == _stmt_code(y.with_changes(comma=cst.MaybeSentinel.DEFAULT)) for x, y in zip(xs, ys))

    first, last = b.args[0], b.args[-1]
    # ``f(fabric, ...)`` as the conversion spells it (keywords.py moves it last, by keyword), or
    # ``f(..., fabric=fabric)``
    return (first.keyword is None and not first.star and _stmt_code(first.value) == test and same(a.args, b.args[1:])) \
        or (last.keyword is not None and last.keyword.value == NAME and _stmt_code(last.value) == test
            and same(a.args, b.args[:-1]))


def _differing(old: cst.CSTNode, new: cst.CSTNode) -> Optional[tuple[cst.CSTNode, cst.CSTNode]]:
    """The one place where two trees of the same shape differ: the deepest node of ``old``, and
    ``new``'s there, whose code differs while everything around them is the same; None where
    their shapes differ."""
    if type(old) is not type(new):
        return None
    a, b = old.children, new.children
    if len(a) != len(b):
        return None
    apart = [(x, y) for x, y in zip(a, b) if _stmt_code(x) != _stmt_code(y)]
    if len(apart) != 1:
        return (old, new) if apart else None
    deeper = _differing(*apart[0])
    return deeper if deeper is not None else apart[0]


def _one_point(old: cst.BaseStatement, new: cst.BaseStatement, test: str) -> Optional[cst.BaseStatement]:
    """A statement the conversion changed in one expression only (``print(...)`` ->
    ``fabric.print(...)``, ``x.to(device)`` -> ``x.to(fabric.device)``): the old statement
    with that expression chosen by `fabric`, ``(fabric.print if fabric is not None else
    print)(...)``, so that nothing around it is written twice. None where the change is not one
    expression's, or where it is the statement's whole value (a guard reads better)."""
    if not isinstance(old, cst.SimpleStatementLine) or not isinstance(new, cst.SimpleStatementLine) \
            or len(old.body) != 1 or len(new.body) != 1:
        return None
    found = _differing(old.body[0], new.body[0])
    if found is None:
        return None
    a, b = found
    if not isinstance(a, cst.BaseExpression) or not isinstance(b, cst.BaseExpression) or not reads_fabric(b) \
            or a is getattr(old.body[0], "value", None) or _PROCESSES.search(_stmt_code(a)):
        return None
    return old.deep_replace(a, chosen(test, b, a))


def _by_tests(these: list[cst.BaseStatement], those: list[cst.BaseStatement], test: str) -> list[cst.BaseStatement]:
    """A run of statements the conversion replaced, where an ``if`` among them kept its blocks'
    shape and changed its test: that ``if`` merged inside with its test chosen by `fabric`
    (``_by_test``), the statements around it guarded as runs (``_changed``)."""
    def loose(stmt: cst.BaseStatement) -> str:
        if isinstance(stmt, cst.If):
            return "if:" + (_header(stmt.with_changes(test=cst.Name("_"))) or "")
        return _bare_code(stmt)

    out: list[cst.BaseStatement] = []
    pairs = difflib.SequenceMatcher(None, [loose(s) for s in these], [loose(s) for s in those], autojunk=False)
    for kind, a1, a2, b1, b2 in pairs.get_opcodes():
        if kind == "equal":
            for a, b in zip(these[a1:a2], those[b1:b2]):
                if _stmt_code(a) == _stmt_code(b):
                    out.append(a)
                    continue
                try:  # an ``if`` whose test changed: the test chosen by `fabric`, its blocks merged
                    out.append(_merge_inside(_by_test(a, b, test), _by_test(b, a, test, new_side=True), test))
                except _Fail:
                    out.extend(_changed([a], [b], test))
        elif a2 - a1 == b2 - b1 and all(isinstance(a, (cst.For, cst.While, cst.With)) and type(a) is type(b)
                                        for a, b in zip(these[a1:a2], those[b1:b2])):
            for a, b in zip(these[a1:a2], those[b1:b2]):
                try:  # a loop or ``with`` whose header changed in one expression: chosen by `fabric`
                    out.append(_by_header(a, b, test))
                except _Fail:
                    out.extend(_changed([a], [b], test))
        else:
            out.extend(_changed(these[a1:a2], those[b1:b2], test))
    return out


def _by_header(old: cst.BaseStatement, new: cst.BaseStatement, test: str) -> cst.BaseStatement:
    """A ``for``, ``while`` or ``with`` whose header the conversion changed in one expression
    that reads `fabric` (``with fabric.autocast():``): that expression chosen by `fabric`, the
    blocks merged inside (``_merge_inside``), so that the block is not written twice."""
    if type(old) is not type(new) or not isinstance(old, (cst.For, cst.While, cst.With)):
        raise _Fail
    empty = cst.IndentedBlock(body=[cst.SimpleStatementLine([cst.Pass()])])
    bare = {"body": empty, **({"orelse": None} if hasattr(old, "orelse") else {})}
    found = _differing(old.with_changes(**bare), new.with_changes(**bare))
    if found is None:
        raise _Fail
    a, b = found
    if not isinstance(a, cst.BaseExpression) or not isinstance(b, cst.BaseExpression) or not reads_fabric(b) \
            or _PROCESSES.search(_stmt_code(a)):
        raise _Fail
    either = chosen(test, b, a)
    return _merge_inside(old.deep_replace(a, either), new.deep_replace(b, either), test)


def _one_test_apart(old: cst.BaseStatement, new: cst.BaseStatement) -> bool:
    """Two ``if`` statements whose headers differ in their tests only (an ``elif``'s too)."""
    if not isinstance(old, cst.If) or not isinstance(new, cst.If):
        return False
    same = cst.Name("_")
    return _header(old.with_changes(test=same)) == _header(new.with_changes(test=same))


def _by_test(one: cst.If, other: cst.If, test: str, new_side: bool = False) -> cst.If:
    """``one`` with the test that the conversion's tests chose by `fabric`: ``NEW if fabric is
    not None else OLD`` (the same in both, so that their blocks merge inside); an ``elif`` of
    both, in turn."""
    old, new = (other, one) if new_side else (one, other)
    if _stmt_code(old.test) == _stmt_code(new.test):
        test_now = one.test
    else:
        test_now = chosen(test, new.test, old.test)
    out = one.with_changes(test=test_now)
    if isinstance(one.orelse, cst.If) and isinstance(other.orelse, cst.If) and _one_test_apart(one.orelse, other.orelse):
        out = out.with_changes(orelse=_by_test(one.orelse, other.orelse, test, new_side))
    return out


def _merge_inside(old: cst.BaseStatement, new: cst.BaseStatement, test: Optional[str]) -> cst.BaseStatement:
    if isinstance(old, cst.Try) and isinstance(new, cst.Try):
        return _merge_try(old, new, test)
    old_blocks, new_blocks = _blocks_of(old), _blocks_of(new)
    if len(old_blocks) != len(new_blocks):
        raise _Fail
    merged = []
    for a, b in zip(old_blocks, new_blocks):
        if a is None or b is None:
            if (a is None) != (b is None):
                raise _Fail
            if _stmt_code(old.orelse) == _stmt_code(new.orelse):
                merged.append(None)
            elif _header(old.orelse) == _header(new.orelse):
                merged.append(_merge_inside(old.orelse, new.orelse, test))  # an ``elif`` changed inside
            elif test is not None and _one_test_apart(old.orelse, new.orelse):
                # an ``elif`` whose test changed (MAE's ``elif 'RANK' in os.environ ...``): chosen by `fabric`
                merged.append(_merge_inside(_by_test(old.orelse, new.orelse, test),
                                            _by_test(new.orelse, old.orelse, test, new_side=True), test))
            else:
                raise _Fail
            continue
        if not isinstance(a, cst.IndentedBlock) or not isinstance(b, cst.IndentedBlock):
            raise _Fail
        merged.append(a.with_changes(body=_merge(a.body, b.body, test)))
    node = old.with_changes(body=merged[0])
    if len(merged) > 1 and merged[1] is not None:
        node = node.with_changes(orelse=merged[1] if isinstance(merged[1], cst.If)
                                 else old.orelse.with_changes(body=merged[1]))
    return node


def _merge_try(old: cst.Try, new: cst.Try, test: Optional[str]) -> cst.Try:
    """A ``try`` the conversion changed inside (DINO's ``load_state_dict`` attempts, whose
    handlers print): each of its blocks merged (its body, each handler's, ``else``, ``finally``)."""
    def block(a: Optional[cst.BaseSuite], b: Optional[cst.BaseSuite]) -> Optional[cst.BaseSuite]:
        if a is None or b is None:
            if (a is None) != (b is None):
                raise _Fail
            return None
        if not isinstance(a, cst.IndentedBlock) or not isinstance(b, cst.IndentedBlock):
            raise _Fail
        return a.with_changes(body=_merge(a.body, b.body, test))

    if len(old.handlers) != len(new.handlers):
        raise _Fail
    orelse = old.orelse.with_changes(body=block(old.orelse.body, new.orelse.body)) \
        if old.orelse is not None and new.orelse is not None else block(old.orelse, new.orelse)
    finalbody = old.finalbody.with_changes(body=block(old.finalbody.body, new.finalbody.body)) \
        if old.finalbody is not None and new.finalbody is not None else block(old.finalbody, new.finalbody)
    return old.with_changes(body=block(old.body, new.body),
                            handlers=[h.with_changes(body=block(h.body, g.body)) for h, g in zip(old.handlers, new.handlers)],
                            orelse=orelse, finalbody=finalbody)


def _function(old: cst.FunctionDef, new: cst.FunctionDef, test: Optional[str]) -> tuple[cst.FunctionDef, Optional[Taken]]:
    """The function as it was, with ``fabric=None`` if the conversion gave it `fabric`, and its
    changed statements guarded by ``test`` (`fabric`, or ``self.fabric`` in a class that keeps
    it; None where none comes: then only changes that can stay out, ``_changed``). How it takes
    `fabric`, or None."""
    index = None
    params = old.params
    if _stmt_code(old.params) != _stmt_code(new.params):
        found = _with_optional_fabric(old.params, new.params)
        if found is None:
            raise _Fail
        params, index = found
        test = NAME
    if _stmt_code(old.with_changes(body=cst.IndentedBlock([]), params=params)) != _stmt_code(
            new.with_changes(body=cst.IndentedBlock([]), params=params)):
        raise _Fail  # decorators, the name, the return annotation
    if not isinstance(old.body, cst.IndentedBlock) or not isinstance(new.body, cst.IndentedBlock):
        raise _Fail
    body = _merge(old.body.body, new.body.body, test)
    return old.with_changes(params=params, body=old.body.with_changes(body=body)), index


def _class(old: cst.ClassDef, new: cst.ClassDef) -> tuple[cst.ClassDef, Optional[Taken]]:
    if _stmt_code(old.with_changes(body=cst.IndentedBlock([]))) != _stmt_code(new.with_changes(
            body=cst.IndentedBlock([]))) or not isinstance(old.body, cst.IndentedBlock) \
            or not isinstance(new.body, cst.IndentedBlock):
        raise _Fail
    olds = {s.name.value: s for s in old.body.body if isinstance(s, cst.FunctionDef)}
    news = {s.name.value: s for s in new.body.body if isinstance(s, cst.FunctionDef)}
    others_old = [_stmt_code(s) for s in old.body.body if not isinstance(s, cst.FunctionDef)]
    others_new = [_stmt_code(s) for s in new.body.body if not isinstance(s, cst.FunctionDef)]
    if olds.keys() != news.keys() or others_old != others_new:
        raise _Fail
    index = None
    init_old, init_new = olds.get("__init__"), news.get("__init__")
    if init_old is not None and _stmt_code(init_old.params) != _stmt_code(init_new.params):
        found = _with_optional_fabric(init_old.params, init_new.params)
        if found is None:
            raise _Fail
        index = Taken(found[1].index - 1, found[1].instead)  # without ``self``
    test = f"self.{NAME}" if index is not None else None
    body = []
    for stmt in old.body.body:
        if isinstance(stmt, cst.FunctionDef):
            other = news[stmt.name.value]
            if _stmt_code(stmt) != _stmt_code(other):
                merged, at = _function(stmt, other, test if stmt.name.value != "__init__" else None)
                if at is not None and stmt.name.value != "__init__":
                    raise _Fail  # a method given `fabric`: its callers are not the class's
                stmt = merged
        body.append(stmt)
    return old.with_changes(body=old.body.with_changes(body=body)), index


def compatible(old_code: str, new_code: str, old: Optional[cst.Module] = None, new: Optional[cst.Module] = None,
               layout=None, free: frozenset[str] = frozenset()) -> Optional[Compatible]:
    """The text of a module that keeps working for the files that import it, with the
    conversion's changes in it (see the module's docstring), or None. ``old`` and ``new``: the
    trees the texts are the code of, where the caller has them (else the texts are parsed; a
    statement both share is the same: its code is not compared); ``layout``: ``old``'s
    (codemod/tree/layout.py), whose statements' code the result's kept statements reuse;
    ``free``: the top-level definitions no other file reads, whose changes that read no `fabric`
    (``GradScaler(enabled=False)``) are made, not kept as they were (a second run, which finds no
    other change there, would make them)."""
    try:
        old = old if old is not None else parsed_text(old_code)
        new = new if new is not None else parsed_text(new_code)
    except cst.ParserSyntaxError:
        return None
    defs = (cst.FunctionDef, cst.ClassDef)
    old_named = {s.name.value: s for s in old.body if isinstance(s, defs)}
    new_named = {s.name.value: s for s in new.body if isinstance(s, defs)}
    if old_named.keys() != new_named.keys():
        return None
    imports = (cst.Import, cst.ImportFrom)

    def plain(module: cst.Module) -> list[cst.BaseStatement]:
        return [s for s in module.body if not isinstance(s, defs)
                and not (isinstance(s, cst.SimpleStatementLine) and all(isinstance(b, imports) for b in s.body))]

    plain_old, plain_new = plain(old), plain(new)
    if len(plain_old) != len(plain_new) or any(a is not b and _bare_code(a) != _bare_code(b) for a, b in zip(plain_old, plain_new)):
        return None
    out = Compatible(code="")
    body: list[cst.BaseStatement] = []
    try:
        for stmt in old.body:
            if isinstance(stmt, defs) and stmt is not new_named[stmt.name.value] \
                    and _stmt_code(stmt) != _stmt_code(new_named[stmt.name.value]):
                other = new_named[stmt.name.value]
                if type(other) is not type(stmt):
                    return None
                token = _FREE.set(stmt.name.value in free)
                try:
                    merged, index = _function(stmt, other, None) if isinstance(stmt, cst.FunctionDef) \
                        else _class(stmt, other)
                finally:
                    _FREE.reset(token)
                if index is not None:
                    out.keyword_calls[stmt.name.value] = index
                out.changed.append(stmt.name.value)
                stmt = merged
            body.append(stmt)
    except _Fail:
        return None
    # the imports the conversion added (``from lightning.fabric import Fabric``) come in; those
    # it dropped stay (the old code reads them)
    new_imports = [s for s in new.body if isinstance(s, cst.SimpleStatementLine)
                   and all(isinstance(b, imports) for b in s.body)]
    # the old statements' code made once, not once for each import statement of the new module
    # (and not at all where each is one of them)
    old_ids = {id(o) for o in old.body}
    new_imports = [s for s in new_imports if id(s) not in old_ids]
    old_stmts = {_bare_code(o) for o in old.body} if new_imports else set()
    added = [s for s in new_imports if _bare_code(s) not in old_stmts]
    if added:
        last = max((i for i, s in enumerate(body) if isinstance(s, cst.SimpleStatementLine)
                    and all(isinstance(b, imports) for b in s.body)), default=-1)
        body[last + 1:last + 1] = added
    out.tree = old.with_changes(body=body)
    out.code = layout.code_of(out.tree) if layout is not None and layout.module is old else module_code(out.tree)
    return out
