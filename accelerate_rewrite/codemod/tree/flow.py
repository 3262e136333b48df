"""Names that may be unbound where they are read: a flow-sensitive check of a result.

LibCST's scope analysis (``checks.undefined_names``) says whether a name is bound anywhere in
its scope; it does not say whether it is bound on every path to a read. A rewrite that sets up
``optimizer`` after an ``if args.use_optimizer: optimizer = ...`` reads a name that is unbound
when the flag is off. This module walks each scope's statements in order (Python's ``ast``:
cheap) and keeps the set of names bound on every path so far:

- an ``if`` leaves bound what both branches bind (a branch that returns, raises, breaks or
  continues does not count); a loop's body may not run, so what it binds is not bound after it
  (its ``else`` runs with what was bound before);
- a ``try`` body may stop at any statement: its handlers see what was bound before it, and
  after the ``try`` is bound what the body (with its ``else``) and every handler bind;
- ``del`` unbinds; ``global`` / ``nonlocal`` names and names of other scopes are not followed
  (a read in a nested function happens when it is called, not where it stands).

The engine (checks.py) compares the result with its input, line by line along their diff (the
statements the rewrite kept, and difflib between them: ``unbound_in`` reads the module as its
top-level statements, each parsed alone, and goes into the functions of the changed ones): a
read on a line the rewrite inserted, on a line it kept whose read is no longer bound on every
path, or on a changed line whose input did not read the name so, is a problem (a script's own
``while True: ... break`` patterns stay the script's). The analysis does not correlate conditions: two ``if
args.flag:`` blocks are independent paths to it, so a new read under the same flag as the
binding is reported too, and the rule that adds it is dropped: a refusal, never a wrong rewrite.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from typing import Iterable, NamedTuple, Optional

from accelerate_rewrite.codemod.tree.toplevel import python_tree

#: the set of every name: what is "bound" after a statement that never falls through
_ALL = frozenset({"*"})


def _meet(a: frozenset, b: frozenset) -> frozenset:
    if a is _ALL:
        return b
    if b is _ALL:
        return a
    return a & b


def _targets(node: ast.AST) -> Iterable[str]:
    """Names a target (or an import, a def) binds."""
    if isinstance(node, ast.Name):
        yield node.id
    elif isinstance(node, (ast.Tuple, ast.List)):
        for element in node.elts:
            yield from _targets(element)
    elif isinstance(node, ast.Starred):
        yield from _targets(node.value)


_DEFS = (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)
_OWN_SCOPES = (ast.Lambda, ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)


class _Scope:
    def __init__(self, path: str, body: list[ast.stmt], params: Iterable[str] = (), offset: int = 0,
                 offsets: Optional[dict[int, int]] = None, names: Optional[frozenset] = None) -> None:
        self.path = path
        self.unbound: list[tuple[str, str, int]] = []  # (scope, name, line), one per read
        self.nested: list[_Scope] = []
        self._names = names
        self.body = body
        self.start = frozenset(params)
        #: what to add to the lines of the nodes (a module given as its statements, each
        #: parsed alone: ``unbound_in``); ``offsets``: id(top-level statement) -> its offset
        self.offset = offset
        self.offsets = offsets
        #: the top-level statement a scope stands in (id), for a module run by ``unbound_in``
        self.origin = 0

    def _nest(self, path: str, body: list[ast.stmt], params: Iterable[str] = ()) -> None:
        scope = _Scope(path, body, params, self.offset)
        scope.origin = self.origin
        self.nested.append(scope)

    @staticmethod
    def _own(body: list[ast.stmt]) -> Iterable[ast.AST]:
        """The nodes of a scope's body, not of the functions, classes, lambdas and
        comprehensions in it (of which a def or class binds its name here, and its
        decorators, defaults and bases are read here)."""
        todo: list[ast.AST] = list(body)
        while todo:
            node = todo.pop()
            yield node
            if isinstance(node, _DEFS):
                todo.extend(node.decorator_list)
                if not isinstance(node, ast.ClassDef):
                    todo.extend(node.args.defaults + [d for d in node.args.kw_defaults if d])
                else:
                    todo.extend(node.bases)
                continue
            for child in ast.iter_child_nodes(node):
                if not isinstance(child, _OWN_SCOPES):
                    todo.append(child)

    @property
    def locals(self) -> frozenset:
        """The names the scope binds (asked when the scope is run: the rewrite runs the scopes of
        the functions it changed, and makes one for every function)."""
        if self._names is None:
            self._names = self._locals(self.body)
        return self._names

    def _locals(self, body: list[ast.stmt]) -> frozenset:
        """The names the scope binds, less those it declares ``global`` or ``nonlocal``."""
        out, declared = self._binds(body)
        return frozenset(out - declared)

    @classmethod
    def _binds(cls, body: list[ast.stmt]) -> tuple[set[str], set[str]]:
        """The names the statements bind in their scope, and those they declare ``global`` or
        ``nonlocal``."""
        out: set[str] = set()
        declared: set[str] = set()
        for node in cls._own(body):
            if isinstance(node, ast.Name):
                if isinstance(node.ctx, (ast.Store, ast.Del)):
                    out.add(node.id)
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                out.add(node.name)
            elif isinstance(node, (ast.Import, ast.ImportFrom)):
                out.update((a.asname or a.name).split(".")[0] for a in node.names if a.name != "*")
            elif isinstance(node, ast.ExceptHandler) and node.name:
                out.add(node.name)
            elif isinstance(node, ast.NamedExpr):
                out.update(_targets(node.target))
            elif isinstance(node, (ast.Global, ast.Nonlocal)):
                declared.update(node.names)
        return out, declared

    # ---- reads ----------------------------------------------------------------------------
    def _read(self, node: Optional[ast.AST], bound: frozenset) -> frozenset:
        """Record the reads in an expression; return ``bound`` plus what a walrus in it binds."""
        if node is None:
            return bound
        walrus: set[str] = set()
        todo = [node]
        while todo:
            current = todo.pop()
            if isinstance(current, ast.Name) and isinstance(current.ctx, ast.Load):
                if current.id in self.locals and bound is not _ALL and current.id not in bound \
                        and current.id not in walrus:
                    self.unbound.append((self.path, current.id, current.lineno + self.offset))
            elif isinstance(current, ast.NamedExpr):
                todo.append(current.value)
                walrus.update(_targets(current.target))
                continue
            elif isinstance(current, ast.Lambda):
                self._nest(f"{self.path}.<lambda>", [ast.Return(current.body)], _params(current.args))
                todo.extend(current.args.defaults)
                continue
            elif isinstance(current, (ast.ListComp, ast.SetComp, ast.DictComp, ast.GeneratorExp)):
                todo.append(current.generators[0].iter)  # evaluated here; the rest in its own scope
                continue
            todo.extend(ast.iter_child_nodes(current))
        return bound if bound is _ALL or not walrus else bound | walrus

    # ---- statements -----------------------------------------------------------------------
    def run(self) -> "_Scope":
        if self.offsets is None:
            self._block(self.body, self.start)
            return self
        bound = self.start
        for stmt in self.body:  # _block's, with each statement's own offset
            if bound is _ALL:
                break
            self.offset, self.origin = self.offsets[id(stmt)], id(stmt)
            bound = self._stmt(stmt, bound)
        return self

    def _block(self, body: list[ast.stmt], bound: frozenset) -> frozenset:
        for stmt in body:
            if bound is _ALL:
                break  # unreachable code: not checked
            bound = self._stmt(stmt, bound)
        return bound

    def _stmt(self, s: ast.stmt, bound: frozenset) -> frozenset:
        if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for node in s.decorator_list:
                bound = self._read(node, bound)
            if isinstance(s, ast.ClassDef):
                for node in s.bases + [k.value for k in s.keywords]:
                    bound = self._read(node, bound)
                self._nest(f"{self.path}.{s.name}", s.body)
            else:
                for node in s.args.defaults + [d for d in s.args.kw_defaults if d]:
                    bound = self._read(node, bound)
                self._nest(f"{self.path}.{s.name}", s.body, _params(s.args))
            return bound | {s.name}
        if isinstance(s, (ast.Assign, ast.AnnAssign)):
            bound = self._read(s.value, bound)
            targets = s.targets if isinstance(s, ast.Assign) else ([s.target] if s.value is not None else [])
            for target in targets:
                bound = self._store(target, bound)
            return bound
        if isinstance(s, ast.AugAssign):
            bound = self._read(s.value, bound)
            bound = self._read(_as_load(s.target), bound)
            return self._store(s.target, bound)
        if isinstance(s, (ast.Import, ast.ImportFrom)):
            return bound | {(a.asname or a.name).split(".")[0] for a in s.names if a.name != "*"}
        if isinstance(s, (ast.Return, ast.Raise)):
            for node in ast.iter_child_nodes(s):
                self._read(node, bound)
            return _ALL
        if isinstance(s, (ast.Break, ast.Continue)):
            return _ALL
        if isinstance(s, ast.If):
            bound = self._read(s.test, bound)
            return _meet(self._block(s.body, bound), self._block(s.orelse, bound))
        if isinstance(s, (ast.For, ast.AsyncFor)):
            bound = self._read(s.iter, bound)
            self._block(s.body, self._store(s.target, bound))
            return self._block(s.orelse, bound)
        if isinstance(s, ast.While):
            bound = self._read(s.test, bound)
            self._block(s.body, bound)
            if isinstance(s.test, ast.Constant) and s.test.value and not s.orelse:
                return bound  # ``while True:``: left by a break, with what was bound before it
            return self._block(s.orelse, bound)
        if isinstance(s, (ast.With, ast.AsyncWith)):
            for item in s.items:
                bound = self._read(item.context_expr, bound)
                if item.optional_vars is not None:
                    bound = self._store(item.optional_vars, bound)
            return self._block(s.body, bound)
        if isinstance(s, (ast.Try, getattr(ast, "TryStar", ast.Try))):
            after_body = self._block(s.orelse, self._block(s.body, bound))
            out = after_body
            for handler in s.handlers:
                inner = self._read(handler.type, bound)
                if handler.name:
                    inner = inner | {handler.name}
                out = _meet(out, self._block(handler.body, inner))
            if s.finalbody:
                final = self._block(s.finalbody, bound)
                if final is _ALL:
                    return _ALL
                out = out if out is _ALL else out | (final - bound)
            return out
        if isinstance(s, ast.Delete):
            for target in s.targets:
                self._read(_as_load(target), bound)
            return bound if bound is _ALL else bound - set(_targets(_as_store(s)))
        if isinstance(s, getattr(ast, "Match", ())):
            bound = self._read(s.subject, bound)
            out: Optional[frozenset] = None
            for case in s.cases:
                names = {n.name for n in ast.walk(case.pattern) if isinstance(n, (ast.MatchAs, ast.MatchStar)) and n.name}
                inner = self._read(case.guard, bound | names)
                after = self._block(case.body, inner)
                out = after if out is None else _meet(out, after)
            return bound if out is None else _meet(out, bound)
        for node in ast.iter_child_nodes(s):  # Expr, Assert, Global, Pass, ...
            bound = self._read(node, bound)
        return bound

    def _store(self, target: ast.AST, bound: frozenset) -> frozenset:
        if isinstance(target, (ast.Attribute, ast.Subscript)):
            return self._read(_as_load(target), bound)
        if isinstance(target, (ast.Tuple, ast.List)):
            for element in target.elts:
                bound = self._store(element, bound)
            return bound
        if isinstance(target, ast.Starred):
            return self._store(target.value, bound)
        return bound if bound is _ALL else bound | set(_targets(target))


def _params(args: ast.arguments) -> list[str]:
    every = args.posonlyargs + args.args + args.kwonlyargs
    names = [a.arg for a in every]
    names += [a.arg for a in (args.vararg, args.kwarg) if a is not None]
    return names


def _as_load(node: ast.AST) -> ast.AST:
    """A target read as a value (``x += 1`` reads ``x``; ``a.b = 1`` reads ``a``)."""
    if isinstance(node, ast.Name):
        return ast.Name(node.id, ast.Load(), lineno=node.lineno, col_offset=node.col_offset)
    if isinstance(node, ast.Attribute):
        return node.value
    if isinstance(node, ast.Subscript):
        return ast.Tuple([node.value, node.slice], ast.Load())
    return node


def _as_store(node: ast.Delete) -> ast.AST:
    return ast.Tuple(node.targets, ast.Store())


@lru_cache(maxsize=16)
def maybe_unbound(source: str) -> dict[tuple[str, str], list[int]]:
    """(scope, name) -> the lines where a name of that scope is read at a point that some path
    reaches without binding it (one per read). Empty for a source that does not parse. Made
    once per text (a module's input is asked at every attempt of its program, and in every
    program of a run that holds it): a mapping to read, never to change."""
    try:
        tree = python_tree(source)
    except (SyntaxError, ValueError):
        return {}
    return _reads([_Scope("<module>", tree.body)])


def _reads(todo: list[_Scope], wanted: Optional[set[int]] = None) -> dict[tuple[str, str], list[int]]:
    """What ``maybe_unbound`` gives, from the scopes in ``todo`` and those nested in them (in
    the module's, only those of the top-level statements in ``wanted``, if given)."""
    out: dict[tuple[str, str], list[int]] = {}
    while todo:
        scope = todo.pop().run()
        for path, name, line in scope.unbound:
            out.setdefault((path, name), []).append(line)
        if wanted is not None and scope.offsets is not None:
            todo.extend(s for s in scope.nested if s.origin in wanted)
        else:
            todo.extend(scope.nested)
    return {key: sorted(lines) for key, lines in out.items()}


class Parsed(NamedTuple):
    """A top-level statement's code parsed alone (``unbound_in``): its statements, the names
    they bind in the module's scope and declare ``global`` there (``_Scope._binds``), and
    whether its functions and classes keep their bodies (``_shallow``)."""
    stmts: list[ast.stmt]
    binds: frozenset
    declared: frozenset
    whole: bool = True


def _shallow(stmts: list[ast.stmt]) -> None:
    """The bodies of the functions and classes the module's scope defines, let go: a statement
    the rewrite kept is read for the module's scope only (its names, its decorators, defaults
    and bases), never inside, and a long script's kept functions are most of its parse."""
    for node in _Scope._own(stmts):
        if isinstance(node, _DEFS):
            node.body = []


#: what ``unbound_in`` keeps of the statements it parsed for the module's scope: their code ->
#: them (None: no parse)
Trees = dict[str, Optional[Parsed]]


def unbound_in(pieces: Iterable[tuple[str, int, bool]], trees: Trees) -> Optional[dict[tuple[str, str], list[int]]]:
    """``maybe_unbound`` of a module given as the code of its top-level statements (each with
    the lines before it that are its own: codemod/tree/layout.py), as ``(code, the line it starts
    on, deep)``, in order: the module's scope whole, and the scopes inside a statement only
    where ``deep`` (a function's scope depends on its own code alone, so the rewrite asks only
    of those it changed). Each statement's code is parsed alone. A statement read for the
    module's scope only (one the rewrite kept) is parsed once (``trees``, by its code: for the
    input and not again for the result, nor in the next attempt), its functions' bodies let go
    (``_shallow``); one read deep (one it changed) is parsed each time and let go once read: a
    long script's changed functions, the input's and the result's, were most of its memory at
    this point. None if a statement does not parse alone."""
    body: list[ast.stmt] = []
    offsets: dict[int, int] = {}
    wanted: set[int] = set()
    binds: set[str] = set()
    declared: set[str] = set()
    for code, start, deep in pieces:
        parsed = trees.get(code, _UNPARSED)
        if parsed is _UNPARSED or (deep and parsed is not None and not parsed.whole):
            try:
                stmts = ast.parse(code).body
            except (SyntaxError, ValueError):
                parsed = None
            else:
                own, said = _Scope._binds(stmts)
                if not deep:
                    _shallow(stmts)
                parsed = Parsed(stmts, frozenset(own), frozenset(said), deep)
            if parsed is None or not deep:
                trees[code] = parsed
        if parsed is None:
            return None
        for stmt in parsed.stmts:
            offsets[id(stmt)] = start - 1
            if deep:
                wanted.add(id(stmt))
        body.extend(parsed.stmts)
        binds |= parsed.binds
        declared |= parsed.declared
    return _reads([_Scope("<module>", body, offsets=offsets, names=frozenset(binds - declared))], wanted)


_UNPARSED = Parsed([], frozenset(), frozenset())

