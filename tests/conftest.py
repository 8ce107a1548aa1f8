"""Shared fixtures: the implementation under test, hypothesis profiles, the golden vectors."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings

from skippy_wire._impl import IMPLEMENTATION, kernel_module

settings.register_profile("default", max_examples=200, deadline=None)
settings.register_profile("ci", max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.register_profile("thorough", max_examples=5000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

REPO = Path(__file__).resolve().parents[1]
#: The golden vectors of the contract, vendored from the upstream-generated set (v15 is
#: the contract's public set); SKIPPY_WIRE_VECTORS overrides the v15 location.
GOLDEN = REPO / "tests" / "golden"
VECTORS = Path(os.environ.get("SKIPPY_WIRE_VECTORS", GOLDEN / "v15"))

#: Implementations exercised by parity-style tests.  Under SKIPPY_WIRE_IMPL=python only
#: the twin is importable by policy, so the compiled one is not listed.
IMPLS = ["python"] if IMPLEMENTATION == "python" else ["cython", "python"]


@pytest.fixture(params=IMPLS)
def impl(request) -> str:
    """The name of an implementation ("cython" or "python")."""
    return request.param


@pytest.fixture
def codec_impl(impl):
    """The codec kernel module of one implementation."""
    return kernel_module("codec", impl)


@pytest.fixture
def frame_impl(impl):
    """The framing module of one implementation."""
    return kernel_module("frame", impl)


@pytest.fixture(scope="session")
def vectors_dir() -> Path:
    if not VECTORS.is_dir():
        pytest.fail(f"golden vectors not found at {VECTORS} (set SKIPPY_WIRE_VECTORS)")
    return VECTORS
