"""The cyclic garbage collector during a rewrite. A rewrite makes hundreds of thousands of
objects that live as long as it does (the trees, the maps over their nodes); at CPython's
default thresholds (700, 10, 10) the collector goes through the young ones every 700
allocations and through every object, the whole tree, every hundred of those: a tenth to a
fifth of a rewrite's time, and a fifth of LibCST's parse itself (docs/benchmarks.md). No LibCST
here: the command line raises the thresholds before it knows whether it will parse anything
(a cache hit parses nothing)."""

from __future__ import annotations

import gc
from contextlib import contextmanager

#: the cyclic garbage collector's thresholds during a rewrite (CPython's are 700, 10, 10)
GC_THRESHOLDS = (100_000, 50, 100)


def _raised() -> tuple[int, ...]:
    return tuple(max(a, b) for a, b in zip(gc.get_threshold(), GC_THRESHOLDS))


def collect_less() -> None:
    """The collector's thresholds raised to the rewrite's for the rest of the process (never
    lowered): what the command line does, a process of its own, so that the trees a rewrite made
    are not gone through once more when it is done (``fewer_collections`` puts them back after
    each rewrite, for a program that calls the API)."""
    gc.set_threshold(*_raised())


@contextmanager
def fewer_collections():
    """The collector run less often while inside: cycles are still collected, less often; the
    thresholds are put back afterwards (and never lowered)."""
    before = gc.get_threshold()
    gc.set_threshold(*_raised())
    try:
        yield
    finally:
        gc.set_threshold(*before)
