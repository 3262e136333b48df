"""The engine's start, made shorter, in three ways, on this module's import (the two ways into the
engine, codemod/engine.py and codemod/rule.py, import it before anything imports LibCST):

- **The code of the methods ``dataclasses`` writes is compiled once** (``CompiledOnce``). Each
  of LibCST's nodes and matchers is a dataclass, and for each class ``dataclasses`` writes its
  ``__init__``, ``__repr__``, ``__eq__``, ``__setattr__`` ... as text and hands it to ``exec``:
  about 1,700 texts compiled at every start, half of LibCST's import (docs/benchmarks.md). During
  ``import libcst`` and ``import libcst.matchers`` here, the ``exec`` that ``dataclasses`` calls
  compiles each text that it has not met before and keeps the code; the codes are kept on disk
  beside this module's bytecode (``CACHE``: ``importlib.util.cache_from_source``, so where
  ``PYTHONPYCACHEPREFIX`` puts bytecode, and never written under ``PYTHONDONTWRITEBYTECODE``,
  as Python does with its own), and the next process runs them without compiling. A code is
  keyed by its whole text and compiled as ``exec`` compiles it (file ``<string>``, no
  ``__future__`` flags): the methods are the same, only not compiled again. A file this Python
  can't read (another version's, cut short) is as none.
- **``libcst.matchers``' annotations are not evaluated** (``MatchersLoader``): its module is
  compiled as with ``from __future__ import annotations`` (PEP 563), its code kept as the
  methods' are (keyed by the file's path, modification time and size, as Python keys its own
  bytecode). Each of its 174 classes annotates its fields with nested ``Union[...]`` of
  matcher types, and evaluating them (typing hashing each nested union) is a third of its import.
  Nothing reads them: ``m.matches`` reads the fields' values, ``dataclasses`` takes a string
  annotation as it takes any, and the walks here read the annotations of LibCST's nodes
  (libcst._nodes, evaluated as ever), never of its matchers.
- **``libcst.matchers`` without the docstrings ``dataclasses`` writes** for its classes that have
  none (``_NoSignatures``). Each of those classes (174 in LibCST 1.9) gets ``Name(value:
  Union[str, ...] = ...)`` as its ``__doc__``: ``inspect.signature`` of the class, printed,
  every annotation of it rendered, 50-130 ms of every start. Here such a class's ``__doc__`` is
  its name alone, as ``dataclasses`` writes it where no signature can be taken; nothing reads
  it, and the classes are otherwise LibCST's own.

All are undone once the imports are done (``dataclasses`` gets its own ``exec`` and ``inspect``
back, the import system its finders), and where ``dataclasses``' internals moved, LibCST is
imported as it is. The cache's answer (cache.py) imports neither LibCST nor the rules.
"""

from __future__ import annotations

import __future__
import builtins
import marshal
import os
import sys
from importlib.machinery import PathFinder, SourceFileLoader
from typing import Optional

#: the file the codes are kept in (None where this Python keeps no bytecode)
CACHE: Optional[str]
try:
    from importlib.util import MAGIC_NUMBER, cache_from_source

    CACHE = cache_from_source(os.path.join(os.path.dirname(os.path.abspath(__file__)), "dataclass_methods.py"))
except (ImportError, NotImplementedError, ValueError):  # no cache tag: no bytecode kept
    CACHE, MAGIC_NUMBER = None, b""

#: more codes than this in the file: it is written again with this start's alone
MAX_CODES = 20_000


class CompiledOnce:
    """``exec`` as ``dataclasses`` calls it, each text compiled once: the codes read from
    ``path``, those compiled here kept to be written back (``save``)."""

    def __init__(self, path: Optional[str]) -> None:
        self.path = path
        self.codes: dict[str, object] = {}
        self.used: set[str] = set()
        #: texts compiled by this process (none where the file had them all)
        self.compiled = 0
        if path is None:
            return
        try:
            with open(path, "rb") as file:
                data = file.read()
            if data[:len(MAGIC_NUMBER)] == MAGIC_NUMBER:
                codes = marshal.loads(data[len(MAGIC_NUMBER):])
                if type(codes) is dict:
                    self.codes = codes
        except (OSError, ValueError, EOFError, TypeError):
            pass  # none yet, or not this Python's: compiled here

    def code(self, key: str, make):
        """The code kept under ``key``, or ``make()``'s, kept (and counted) here."""
        code = self.codes.get(key)
        if code is None:
            code = self.codes[key] = make()
            self.compiled += 1
        self.used.add(key)
        return code

    def exec(self, source, *args, **kwargs):
        if type(source) is str:
            source = self.code(source, lambda: compile(source, "<string>", "exec", dont_inherit=True))
        return builtins.exec(source, *args, **kwargs)

    def save(self) -> None:
        """Write the codes back where some were compiled here (atomically: another process may
        be reading or writing it), unless Python writes no bytecode."""
        if not self.compiled or self.path is None or sys.dont_write_bytecode:
            return
        codes = self.codes if len(self.codes) <= MAX_CODES else {s: self.codes[s] for s in self.used}
        # a module's code kept for another version of its file (LibCST upgraded): not kept on
        codes = {key: code for key, code in codes.items() if not key.startswith(MODULE_KEY) or key in self.used}
        temporary = f"{self.path}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(temporary, "wb") as file:
                file.write(MAGIC_NUMBER + marshal.dumps(codes))
            os.replace(temporary, self.path)
        except (OSError, ValueError):  # a folder we can't write (a system install): compiled each time
            try:
                os.unlink(temporary)
            except OSError:
                pass


#: how a module's code is keyed among the methods' (no method's text starts so)
MODULE_KEY = "\0annotations unread\0"
_ANNOTATIONS = __future__.annotations.compiler_flag


class MatchersLoader(SourceFileLoader):
    """``libcst.matchers``' loader: its module compiled as with ``from __future__ import
    annotations``, its code kept in ``once`` (``CompiledOnce``), not in its own bytecode file,
    which other processes import as it is."""

    def __init__(self, fullname: str, path: str, once: CompiledOnce) -> None:
        super().__init__(fullname, path)
        self.once = once

    def get_code(self, fullname: str):
        path = self.get_filename(fullname)
        try:
            stats = self.path_stats(path)
        except OSError:
            return super().get_code(fullname)
        key = f"{MODULE_KEY}{path}\0{stats['mtime']!r}\0{stats['size']}"
        return self.once.code(key, lambda: compile(self.get_data(path), path, "exec", flags=_ANNOTATIONS,
                                                   dont_inherit=True))


class _MatchersFinder:
    """Finds ``libcst.matchers`` where Python finds it, to be loaded by ``MatchersLoader``."""

    def __init__(self, once: CompiledOnce) -> None:
        self.once = once

    def find_spec(self, name, path=None, target=None):
        if name != "libcst.matchers":
            return None
        spec = PathFinder.find_spec(name, path, target)
        if spec is None or type(spec.loader) is not SourceFileLoader or not spec.origin:
            return None  # (bytecode alone, a zip: Python's own way)
        spec.loader = MatchersLoader(name, spec.origin, self.once)
        return spec


class _NoSignatures:
    """What ``dataclasses`` reads of ``inspect`` (only ``signature``, for the docstring), giving
    none: ``dataclasses`` then writes the class's name alone."""

    @staticmethod
    def signature(obj, *args, **kwargs):
        raise TypeError("no signature: the docstring is the class's name (codemod/tree/startup.py)")


#: this process's start: how many texts it compiled (tests/test_engine.py reads it)
compiled_here = 0


def import_libcst() -> None:
    """``import libcst`` and ``import libcst.matchers``, the methods' code compiled once and the
    matchers' classes without docstrings given their names as docstrings; where they are
    imported already, nothing."""
    global compiled_here
    if "libcst.matchers" in sys.modules:
        return
    import dataclasses

    inspect = getattr(dataclasses, "inspect", None)
    if inspect is None:  # dataclasses' internals moved: imported as it is
        import libcst.matchers  # noqa: F401
        return
    once = CompiledOnce(CACHE)
    own = dataclasses.__dict__.get("exec")  # (none: it calls the builtin)
    dataclasses.exec = once.exec  # type: ignore[attr-defined]
    try:
        import libcst  # noqa: F401

        dataclasses.inspect = _NoSignatures  # type: ignore[attr-defined]
        finder = _MatchersFinder(once)
        sys.meta_path.insert(0, finder)
        try:
            import libcst.matchers  # noqa: F401
        finally:
            sys.meta_path.remove(finder)
    finally:
        dataclasses.inspect = inspect  # type: ignore[attr-defined]
        if own is None:
            del dataclasses.exec  # type: ignore[attr-defined]
        else:
            dataclasses.exec = own  # type: ignore[attr-defined]
    compiled_here = once.compiled
    once.save()


import_libcst()
