"""Implementation policy: compiled by default on CPython, the twin on request, and an
unknown request or a missing extension is an import error, never a silent fallback."""

import os
import subprocess
import sys

import pytest

from skippy_wire import _impl

PROBE = "import skippy_wire, skippy_wire.wire.codec as c, skippy_wire.wire.frame as f; print(skippy_wire.IMPLEMENTATION, c.kernels().__name__)"


def run(env_value):
    env = {k: v for k, v in os.environ.items() if k != "SKIPPY_WIRE_IMPL"}
    if env_value is not None:
        env["SKIPPY_WIRE_IMPL"] = env_value
    return subprocess.run([sys.executable, "-c", PROBE], env=env, capture_output=True, text=True, timeout=60)


def test_default_is_compiled_on_cpython():
    out = run(None)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["cython", "skippy_wire.wire._codec"]


def test_environment_forces_the_twin():
    out = run("python")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["python", "skippy_wire.wire._reference.codec"]


def test_unknown_implementation_is_refused():
    out = run("fortran")
    assert out.returncode != 0
    assert "SKIPPY_WIRE_IMPL must be one of" in out.stderr


def test_missing_compiled_module_is_an_import_error(monkeypatch):
    monkeypatch.setitem(sys.modules, "skippy_wire.wire._frame", None)  # as if it were not built
    with pytest.raises(ImportError, match="not built"):
        _impl.kernel_module("frame", "cython")
    assert _impl.kernel_module("frame", "python").__name__ == "skippy_wire.wire._reference.frame"


def test_an_impl_that_is_no_string_is_a_type_error_and_a_missing_build_names_the_way_out(monkeypatch):
    """``impl=0`` (or [], False) read as "the live one"; with the twin live, a missing compiled
    module still said "or set SKIPPY_WIRE_IMPL=python", which was set."""
    for wrong in (0, [], False):
        with pytest.raises(TypeError, match=f"^impl must be a str or None, not {type(wrong).__name__}$"):
            _impl.cached_kernel_module("frame", wrong)
    with pytest.raises(ValueError, match="^unknown implementation ''$"):  # "" read as the live one too
        _impl.cached_kernel_module("frame", "")
    monkeypatch.setitem(sys.modules, "skippy_wire.wire._frame", None)  # as if it were not built
    monkeypatch.setattr(_impl, "IMPLEMENTATION", "python")
    with pytest.raises(ImportError, match=r'or use the twin \(impl="python", --impl python\)$'):
        _impl.kernel_module("frame", "cython")
