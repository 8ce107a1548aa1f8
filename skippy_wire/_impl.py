"""Which implementation of the kernels is live: the compiled one or the pure-Python twin.

On CPython the compiled extensions are required; ``SKIPPY_WIRE_IMPL=python`` forces the
twin (``skippy_wire.wire._reference``).  A failed import of a compiled module is an error,
never a silent fallback to the slow path.
"""

from __future__ import annotations

import importlib
import os
import platform
from types import ModuleType
from typing import Optional

IMPLEMENTATIONS = ("cython", "python")


def _choose() -> str:
    requested = os.environ.get("SKIPPY_WIRE_IMPL", "").strip().lower()
    if requested and requested not in IMPLEMENTATIONS:
        raise ImportError(f"SKIPPY_WIRE_IMPL must be one of {IMPLEMENTATIONS}, not {requested!r}")
    if requested:
        return requested
    return "cython" if platform.python_implementation() == "CPython" else "python"


IMPLEMENTATION = _choose()


def kernel_module(concept: str, implementation: str = IMPLEMENTATION) -> ModuleType:
    """Return the module implementing ``concept``: "codec", "frame" (v15 framing) or
    "frame_gen" (state versions 16 and 17: frames, agreements, messages)."""
    if implementation == "python":
        return importlib.import_module(f"skippy_wire.wire._reference.{concept}")
    if implementation == "cython":
        try:
            return importlib.import_module(f"skippy_wire.wire._{concept}")
        except ImportError as exc:
            # with the twin live already, the compiled one was asked for by name (--impl cython)
            instead = 'use the twin (impl="python", --impl python)' if IMPLEMENTATION == "python" \
                else "set SKIPPY_WIRE_IMPL=python"
            raise ImportError(
                f"the compiled module skippy_wire.wire._{concept} is not built ({exc}); "
                "install skippy_wire with its compiled modules (without SKIPPY_WIRE_PUREPYTHON; "
                f"`pip install -e .` in a source tree) or {instead}"
            ) from exc
    raise ValueError(f"unknown implementation {implementation!r}")


_LOADED: dict = {}


def cached_kernel_module(concept: str, implementation: Optional[str] = None) -> ModuleType:
    """:func:`kernel_module` looked up once per (concept, implementation); ``implementation``
    defaults to the live one."""
    if implementation is not None and not isinstance(implementation, str):  # 0, [], False read as "the live one"
        raise TypeError(f"impl must be a str or None, not {type(implementation).__name__}")
    key = (concept, IMPLEMENTATION if implementation is None else implementation)  # "": no implementation
    module = _LOADED.get(key)
    if module is None:
        module = _LOADED[key] = kernel_module(*key)
    return module
