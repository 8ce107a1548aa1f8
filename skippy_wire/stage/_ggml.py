"""Locate the libggml-python wheel and make its shared libraries loadable.

The compiled ``skippy_wire.stage._backend`` links ``libggml-base.so.0`` and ``libggml-cpu.so.0``
from the wheel's ``lib64/`` (runtime.md §5.1).  Its rpath covers the installed layout
(``$ORIGIN/../libggml/lib64``) and the build machine's absolute path; ``preload()`` is the
fallback for anything else (an in-tree build whose venv moved): loading both libraries
with RTLD_GLOBAL lets the dynamic loader satisfy the extension's NEEDED entries by SONAME.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import os
from pathlib import Path
from types import ModuleType

_LIBS = ("libggml-base.so.0", "libggml-cpu.so.0")
_preloaded: list[ctypes.CDLL] = []


def libggml_root() -> Path:
    """Directory of the installed ``libggml`` package (``include/``, ``lib64/``)."""
    spec = importlib.util.find_spec("libggml")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("skippy_wire's ggml backend needs libggml-python: pip install libggml-python==0.20.2.post1")
    return Path(list(spec.submodule_search_locations)[0])


def preload() -> None:
    """Load the wheel's ggml libraries process-wide (idempotent)."""
    if _preloaded:
        return
    lib64 = libggml_root() / "lib64"
    for name in _LIBS:
        _preloaded.append(ctypes.CDLL(os.fspath(lib64 / name), mode=ctypes.RTLD_GLOBAL | os.RTLD_NOW))


def load_backend() -> ModuleType:
    """Import ``skippy_wire.stage._backend``, preloading ggml first if the rpath did not resolve it."""
    try:
        return importlib.import_module("skippy_wire.stage._backend")
    except ImportError as exc:
        if "libggml" not in str(exc):
            raise
    preload()
    return importlib.import_module("skippy_wire.stage._backend")
