"""The engine's start, made shorter: ``libcst.matchers`` imported without the docstrings that
``dataclasses`` writes for its classes that have none (``import_matchers``, on this module's
import: the two ways into the engine, codemod/engine.py and codemod/rule.py, import it first).

Each of those classes (174 in LibCST 1.9) gets ``Name(value: Union[str, ...] = ...)`` as its
``__doc__``: ``inspect.signature`` of the class, printed, every annotation of it rendered. That
is 50-130 ms of the start of every run that rewrites (docs/benchmarks.md; the cache's answer
imports neither LibCST nor the rules). Here such a class's ``__doc__`` is its name alone, as
``dataclasses`` writes it where no signature can be taken; nothing reads it, and the classes
are otherwise LibCST's own.
"""

from __future__ import annotations

import sys


class _NoSignatures:
    """What ``dataclasses`` reads of ``inspect`` (only ``signature``, for the docstring), giving
    none: ``dataclasses`` then writes the class's name alone."""

    @staticmethod
    def signature(obj, *args, **kwargs):
        raise TypeError("no signature: the docstring is the class's name (codemod/tree/startup.py)")


def import_matchers() -> None:
    """``import libcst.matchers``, its classes without docstrings given their names as docstrings,
    not their signatures printed; where it is imported already, nothing."""
    if "libcst.matchers" in sys.modules:
        return
    import dataclasses

    inspect = getattr(dataclasses, "inspect", None)
    if inspect is None:  # dataclasses' internals moved: imported as it is
        import libcst.matchers  # noqa: F401
        return
    dataclasses.inspect = _NoSignatures  # type: ignore[attr-defined]
    try:
        import libcst.matchers  # noqa: F401
    finally:
        dataclasses.inspect = inspect  # type: ignore[attr-defined]


import_matchers()
