"""A stand-in for NVIDIA apex, for running the apex fixtures on a CPU in the tests: apex.amp is
gone from current apex and never ran without CUDA. It does what amp does when there is no GPU to
cast for: nothing (fp32, no loss scaling), with amp's API."""

from . import amp  # noqa: F401
