"""Put first on PYTHONPATH by the verifier: starts the recording harness in every Python
process of a verified run (the script, and the processes Fabric launches for DDP).

The harness is loaded from its file (it needs only the standard library until torch is
imported), so the run's Python does not need accelerate_rewrite installed. A sitecustomize of
the environment's own, which this one shadows, is run afterwards.
"""

import importlib.machinery
import importlib.util
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name, path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _die_with_the_verifier():
    """Linux: the process the verifier started (its parent's pid is ACCELERATE_REWRITE_VERIFY_PARENT)
    gets SIGKILL from the kernel when the verifier dies, even of SIGKILL (PR_SET_PDEATHSIG). The
    processes it starts in turn don't ask: the signal would come when the *thread* that started
    them ends, which a script's own thread pool may do at any time; the verifier's watcher (see
    runner.py) kills the run's process group instead."""
    parent = os.environ.get("ACCELERATE_REWRITE_VERIFY_PARENT", "")
    if not sys.platform.startswith("linux") or not parent.isdigit() or os.getppid() != int(parent):
        return
    try:
        import ctypes
        import signal

        if ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL), 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
            return
    except (OSError, AttributeError, ImportError):
        return
    if os.getppid() != int(parent):  # the verifier died before the line above
        os._exit(128 + 9)


_die_with_the_verifier()

if os.environ.get("ACCELERATE_REWRITE_VERIFY"):
    _load("accelerate_rewrite_verify_harness", os.path.join(os.path.dirname(_HERE), "harness.py")).boot()

_others = [p for p in sys.path if os.path.abspath(p or ".") != _HERE]
_spec = importlib.machinery.PathFinder.find_spec("sitecustomize", _others)
if _spec is not None and _spec.origin and os.path.dirname(os.path.abspath(_spec.origin)) != _HERE:
    _load("_accelerate_rewrite_next_sitecustomize", _spec.origin)
