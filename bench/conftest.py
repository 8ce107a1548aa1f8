"""pytest-benchmark fixtures for the codec benchmarks (orjson bench/ layout).

Run with ``.venv/bin/python -m pytest bench/ --benchmark-group-by=group``; bench/ is
outside the default testpaths.  ``SKIPPY_BENCH_CPU=N`` pins the process to CPU N so
that runs compare (left unpinned by default: on a shared machine a pinned CPU may be
the busy one).
"""

from __future__ import annotations

import os

import ml_dtypes
import numpy as np
import pytest

from skippy_wire._impl import IMPLEMENTATION

#: (token_count, n_embd) frames; the reference twin only runs the first (it is slow).
SIZES = [(1, 4096), (128, 4096), (2048, 4096)]
REFERENCE_SIZES = [(1, 4096)]


def pytest_configure(config):
    cpu = os.environ.get("SKIPPY_BENCH_CPU")
    if cpu is not None and hasattr(os, "sched_setaffinity"):
        allowed = sorted(os.sched_getaffinity(0))
        if not cpu.isdigit() or int(cpu) not in allowed:
            raise pytest.UsageError(f"SKIPPY_BENCH_CPU={cpu}: not a CPU this process may run on ({allowed})")
        os.sched_setaffinity(0, {int(cpu)})


def pytest_generate_tests(metafunc):
    """Parametrise ``impl`` x ``size``: our live kernels everywhere, the twin on small
    frames only, and the oracle (numpy / ml_dtypes) where a test asks for it."""
    if "impl" in metafunc.fixturenames and "size" in metafunc.fixturenames:
        impls = ["oracle", IMPLEMENTATION] + (["python"] if IMPLEMENTATION == "cython" else [])
        cases = [(i, s) for i in impls for s in SIZES if i != "python" or s in REFERENCE_SIZES]
        metafunc.parametrize(("impl", "size"), cases, ids=[f"{i}-{s[0]}x{s[1]}" for i, s in cases])


class Payloads:
    """Inputs for one frame size, built once, outside the timed callables."""

    def __init__(self, size):
        self.tokens, self.n_embd = size
        rng = np.random.default_rng(0)
        self.f32 = rng.standard_normal(size, dtype=np.float32)
        self.bf16_exact = self.f32.astype(ml_dtypes.bfloat16).astype(np.float32)
        self.bf16 = self.f32.astype(ml_dtypes.bfloat16)
        self.f16 = self.f32.astype(np.float16)
        self.nbytes = self.f32.nbytes


_CACHE: dict = {}


@pytest.fixture
def payloads(size) -> Payloads:
    if size not in _CACHE:
        _CACHE[size] = Payloads(size)
    return _CACHE[size]
