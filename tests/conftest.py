"""Test distribution: the verifier's tests run each original training script once per worker
(tests/verify_support.py remembers it), tests/test_multi_device.py runs each fixture's
original and rewrite once (an lru_cache), and tests/test_robustness.py sums up its generated
programs in its last test; tests/test_fixtures.py rewrites each fixture with every option set,
and the analysis of its input (engine._analyse) is kept for the next option set. With ``-n auto`` (xdist) the tests of one fixture
are kept on one worker (``--dist loadgroup``, in pyproject.toml): a second worker would run the
same original again."""

from __future__ import annotations

import atexit
import inspect
import os
import re
import shutil
import sys
import tempfile

import pytest

#: the rewrite cache (accelerate_rewrite/cache.py) of this run, the pre-commit hook's subprocesses
#: included, goes to a folder of its own, never the user's; tests/test_cache.py gives each of its
#: tests its own
_CACHE = tempfile.mkdtemp(prefix="accelerate-rewrite-cache-")
os.environ["ACCELERATE_REWRITE_CACHE_DIR"] = _CACHE
atexit.register(shutil.rmtree, _CACHE, True)

#: where the environment says not to write bytecode (PYTHONDONTWRITEBYTECODE, set on this
#: project's CI machines), the Pythons of the test run write it all the same, in a tree of its
#: own inside the virtual environment (PYTHONPYCACHEPREFIX: no __pycache__ beside the fixtures
#: the tests run): with the set-up's --no-compile, every training process would otherwise compile
#: torch and lightning from source again (lightning's import: 21 s instead of 10 on 2 cores)
if os.environ.get("PYTHONDONTWRITEBYTECODE"):
    del os.environ["PYTHONDONTWRITEBYTECODE"]
    os.environ.setdefault("PYTHONPYCACHEPREFIX", os.path.join(sys.prefix, "pycache"))
    sys.pycache_prefix = os.environ["PYTHONPYCACHEPREFIX"]
    sys.dont_write_bytecode = False

#: the files whose tests share runs through a per-worker cache
_SHARED_RUNS = ("test_verify.py", "test_multi_device.py", "test_verify_mutations.py", "test_robustness.py",
                "test_fixtures.py")
#: ``fixture_script("vae")`` (test_verify.py), ``_both("vae", work)`` (test_multi_device.py)
_FIXTURE_CALL = re.compile(r'(?:fixture_script|_both)\("(\w+)"')


@pytest.hookimpl(tryfirst=True)  # before xdist's own, which reads the groups into the test ids
def pytest_collection_modifyitems(config, items):
    for item in items:
        file = item.path.name
        if file not in _SHARED_RUNS:
            continue
        if file == "test_verify_mutations.py":
            group = "mutations"  # one original (base.py) for every case
        elif file == "test_robustness.py":
            group = "robustness"  # the generated-program tests count what they did for a summary
        else:
            params = getattr(getattr(item, "callspec", None), "params", {})
            group = params.get("name")
            if group is None:
                found = _FIXTURE_CALL.findall(inspect.getsource(item.function))
                group = found[0] if found else None
        if group is not None:
            item.add_marker(pytest.mark.xdist_group(str(group) if file == "test_verify.py"
                                                    else f"{file}:{group}"))


@pytest.fixture(autouse=True)
def _collector_thresholds():
    """The command line raises the garbage collector's thresholds for the rest of its process
    (codemod/collector.py: a process of its own); a test that calls it in this one gets them put
    back afterwards."""
    import gc

    before = gc.get_threshold()
    yield
    gc.set_threshold(*before)
