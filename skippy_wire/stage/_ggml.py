"""Which ggml the stage backend carries, and loading it safely.

``skippy_wire.stage._backend`` normally links ggml 0.20.2 built from source for the build
machine's CPU (``ggml_build.py`` beside setup.py; statically, with private symbols).  The
build records what it did in ``_ggml_build.json`` next to this file; ``build_info()`` reads
it, ``live_build()`` adds what the loaded extension itself reports (ggml version and the
instruction sets its ggml-cpu was compiled with), ``describe()`` says it in one line.

``load_backend()`` is the safe import: it refuses (ImportError, not SIGILL) a build whose
instruction sets this CPU lacks, and warns (``GgmlFallbackWarning``) when the backend
links the portable libggml-python wheel instead of the source build.

Portable fallback: the backend links ``libggml-base.so.0`` and ``libggml-cpu.so.0`` from the
wheel's ``lib64/`` (runtime.md §5.1).  Its rpath covers the installed layout
(``$ORIGIN/../../libggml/lib64``) and, for a module built in place, the interpreter's
site-packages, never where the build found them (pip's build folder under /tmp, anyone's to
make again); ``load_backend()`` preloads them for anything else (libggml in another
site-packages, a venv moved): loading both libraries with RTLD_GLOBAL lets the dynamic
loader satisfy the extension's NEEDED entries by SONAME.
"""

from __future__ import annotations

import ctypes
import importlib
import importlib.util
import json
import os
import warnings
from pathlib import Path
from types import ModuleType

_LIBS = ("libggml-base.so.0", "libggml-cpu.so.0")
_preloaded: list[ctypes.CDLL] = []
BUILD_INFO = Path(__file__).with_name("_ggml_build.json")
SOURCE_BUILD = "sdist"
WHEEL_BUILD = "wheel"
#: The build's setting that forces the wheel (``ggml_build.py`` reads it), and the reason recorded then.
MODE_ENV = "SKIPPY_WIRE_GGML"
_FORCED = f"{MODE_ENV}={WHEEL_BUILD}"
FORCED_REASON = f"forced by {_FORCED}"
FALLBACK_TEXT = (
    "skippy_wire's ggml backend links the portable libggml-python wheel (AVX2 kernels), not ggml "
    "built for this CPU: {reason}; {advice}"
)
CPU_MISMATCH_TEXT = (
    "skippy_wire's ggml was built for CPU features this machine lacks ({missing}); reinstall skippy_wire here"
)


class GgmlFallbackWarning(UserWarning):
    """The backend runs on the portable libggml-python wheel, not the source build."""


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


def build_info(path: Path = BUILD_INFO) -> dict:
    """What the build linked (``source`` is "sdist" or "wheel"; "unknown" without a record)."""
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {"source": "unknown", "features": [], "cpu_flags_required": [], "reason": "no build record"}


def cpu_flags(cpuinfo: str | None = None) -> set[str]:
    """This CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def missing_cpu_flags(info: dict, flags: set[str]) -> list[str]:
    """Instruction sets the build needs that ``flags`` lacks (none checked without flags)."""
    if not flags:
        return []
    return sorted(set(info.get("cpu_flags_required", [])) - flags)


def fallback_warning(info: dict) -> str | None:
    """The fallback warning text for ``info``, or None for the source build."""
    if info.get("source") == SOURCE_BUILD:
        return None
    reason = info.get("reason") or "unknown build"
    advice = f"reinstall without {_FORCED} to build it" if reason == FORCED_REASON else \
        "reinstall with cmake available to build it"
    return FALLBACK_TEXT.format(reason=reason, advice=advice)


def check(info: dict, flags: set[str] | None = None) -> None:
    """Refuse a build this CPU cannot run; warn loudly about the wheel fallback."""
    missing = missing_cpu_flags(info, cpu_flags() if flags is None else flags)
    if missing:
        raise ImportError(CPU_MISMATCH_TEXT.format(missing=", ".join(missing)))
    text = fallback_warning(info)
    if text:
        warnings.warn(text, GgmlFallbackWarning, stacklevel=3)


def load_backend() -> ModuleType:
    """Import ``skippy_wire.stage._backend`` after ``check()``, preloading the wheel's ggml
    first if the rpath did not resolve it (fallback build); an ImportError, and no warning,
    where the backend is not built (a pure-Python install)."""
    if importlib.util.find_spec("skippy_wire.stage._backend") is None:
        raise ModuleNotFoundError("No module named 'skippy_wire.stage._backend'", name="skippy_wire.stage._backend")
    check(build_info())
    try:
        return importlib.import_module("skippy_wire.stage._backend")
    except ImportError as exc:
        if "libggml" not in str(exc):
            raise
    preload()
    return importlib.import_module("skippy_wire.stage._backend")


def live_build(backend: ModuleType) -> dict:
    """``build_info()`` plus what the loaded extension reports: ``live_version`` and
    ``live_features`` (the instruction sets its ggml-cpu was compiled with)."""
    lib = ctypes.CDLL(backend.__file__)
    info = dict(build_info())
    for name in ("skippy_ggml_version", "skippy_ggml_cpu_features"):
        getattr(lib, name).restype = ctypes.c_char_p
    info["live_version"] = lib.skippy_ggml_version().decode()
    info["live_features"] = lib.skippy_ggml_cpu_features().decode().split(",")
    return info


def describe(backend: ModuleType) -> str:
    """One line: the ggml version, which build, and the live CPU variant."""
    info = live_build(backend)
    if info.get("source") == SOURCE_BUILD:
        origin = f"built from source ({info.get('dist')} sdist) for this CPU, static"
    else:
        origin = f"FALLBACK {info.get('source')}: {fallback_warning(info)}"
    return f"ggml {info['live_version']} {origin}; cpu variant: {','.join(info['live_features'])}"
