"""Build the compiled parts of skippy_wire.

Extensions (each one compiled concept, see docs/development.md):
  skippy_wire.wire._codec    Cython activation-codec kernels
  skippy_wire.wire._frame    Cython stage-message framing
  skippy_wire.wire._frame_gen Cython framing of state versions 16 and 17
  skippy_wire.stage._backend  Cython binding of the C/C++ ggml stage backend (skippy_wire/stage/_stage)

The backend links ggml 0.20.2 built from source for this CPU (ggml_build.py; cached in
~/.cache/skippy_wire/ggml); SKIPPY_WIRE_GGML=wheel links the portable libggml-python wheel
instead, which is also the loud fallback when the source build is impossible.

SKIPPY_WIRE_PUREPYTHON=1 builds none of them (the pure-Python twin is then the only
implementation). SKIPPY_WIRE_BUILD_ONLY=_codec,_frame limits a development build to the
named extensions.
"""

import json
import os
import shutil
import sys
import sysconfig
from pathlib import Path

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext as _build_ext

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))  # ggml_build.py beside this file (pip's build runs setup.py from elsewhere)
import ggml_build  # noqa: E402

PKG = HERE / "skippy_wire"
STAGE = PKG / "stage"
RECORD_NAME = "_ggml_build.json"  # skippy_wire.stage._ggml.BUILD_INFO

# Portable by default: no -march=native (SIMD paths are chosen at run time by CPU feature;
# ggml itself is built for this CPU by ggml_build.py).
OPT_FLAGS = ["-O3", "-fno-strict-aliasing", "-g0"]  # (-g0: no debug info, 7 MB less in the backend)
if os.environ.get("SKIPPY_WIRE_DEBUG_BUILD"):
    OPT_FLAGS = ["-O1", "-g", "-fno-omit-frame-pointer"]
if os.environ.get("SKIPPY_WIRE_ASAN"):
    OPT_FLAGS = OPT_FLAGS + ["-fsanitize=address", "-fno-omit-frame-pointer"]
ASAN_LINK = ["-fsanitize=address"] if os.environ.get("SKIPPY_WIRE_ASAN") else []


def _libggml_root() -> Path:
    """Locate the libggml-python wheel (headers in include/, shared libraries in lib64/) with
    the package's own lookup (skippy_wire/stage/_ggml.py, as ggml_build.py loads it)."""
    try:
        return ggml_build.runtime.libggml_root()
    except ImportError:
        raise RuntimeError("the build needs the PyPI package libggml-python (pip install libggml-python)") from None


def _wire_extension(name: str, depends: list, kernels: bool) -> Extension:
    """A ``skippy_wire.wire`` extension; ``kernels``: it compiles the C kernels of
    _codec_kernels.h (AVX2/F16C variants per function with __attribute__((target)), picked
    at run time, so the default flags stay portable; -fno-math-errno lets floor() inline in
    the S8 loop, no errno is read)."""
    return Extension(
        f"skippy_wire.wire.{name}",
        sources=[f"skippy_wire/wire/{name}.pyx"],
        depends=[f"skippy_wire/wire/{d}" for d in depends],
        include_dirs=[str(PKG / "wire")] if kernels else [],
        extra_compile_args=OPT_FLAGS + (["-fno-math-errno"] if kernels and sys.platform != "win32" else []),
        extra_link_args=ASAN_LINK,
    )


def codec_extension() -> Extension:
    return _wire_extension("_codec", ["_codec_kernels.h", "_codec_kernels.pxd", "_codec.pxd",
                                      "_codec_select.pxi", "_wire_constants.pxi"], kernels=True)


def frame_extension() -> Extension:
    return _wire_extension("_frame", ["_codec.pxd", "_le_bytes.pxd", "_wire_constants.pxi", "_frame_read.pxi",
                                      "_frame_write.pxi", "_frame_reply.pxi"], kernels=False)


def frame_gen_extension() -> Extension:
    # State versions 16 and 17; the F32 parts run the codec kernels.
    return _wire_extension("_frame_gen", ["_codec_kernels.h", "_codec_kernels.pxd", "_le_bytes.pxd",
                                          "_frame_gen_check.pxi", "_frame_gen_msg.pxi", "_frame_gen_agreed.pxi"],
                           kernels=True)


def backend_extension() -> Extension:
    """The backend binding and its C++ sources; ggml is linked in by :func:`link_ggml` when
    the extension is built (not whenever setup.py is read: an sdist compiles nothing)."""
    stage_sources = sorted(str(p.relative_to(HERE)) for p in (STAGE / "_stage").glob("*.c*"))
    return Extension(
        "skippy_wire.stage._backend",
        sources=["skippy_wire/stage/_backend.pyx", *stage_sources],
        depends=sorted(str(p) for p in (STAGE / "_stage").glob("*.h")),
        include_dirs=[str(STAGE / "_stage")],
        language="c++",
        extra_compile_args=OPT_FLAGS + ["-std=c++17"],
        extra_link_args=list(ASAN_LINK),
    )


def link_ggml(ext: Extension, record: Path, in_tree: bool = False) -> None:
    """Resolve ggml (built from source for this CPU, or the wheel's) and link ``ext``
    against it; what it links is written to ``record`` (beside the built module, read at
    run time by skippy_wire.stage._ggml.build_info()); ``in_tree``: an in-place or editable
    build, whose module stays in this checkout."""
    ggml = ggml_build.resolve(_libggml_root)
    record.parent.mkdir(parents=True, exist_ok=True)
    record.write_text(json.dumps(ggml.info(), indent=1) + "\n")
    ext.include_dirs.insert(0, str(ggml.include_dir))
    if ggml.source == "sdist":
        # ggml built here for this CPU, linked in statically; --exclude-libs keeps its symbols
        # private, so a libggml loaded by someone else in the process (llama.cpp, the wheel)
        # can neither interpose on ours nor be interposed on.
        ext.extra_objects += [str(p) for p in ggml.static_libs]
        ext.depends += [str(p) for p in ggml.static_libs]
        ext.libraries += ["pthread", "m"]
        ext.extra_link_args += ["-Wl,--exclude-libs,ALL"]
        return
    # Portable fallback: the libggml-python wheel's shared libraries, found at run time next
    # to the installed extension ($ORIGIN/../..), and for a module left in this checkout in
    # this interpreter's site-packages; never where the build found them (pip's isolated
    # build folder under /tmp, gone once built, is anyone's to make again), nor, in a wheel,
    # anywhere on this machine.  skippy_wire.stage._ggml.load_backend() preloads them otherwise.
    rpaths = ["$ORIGIN/../../libggml/lib64"]
    if in_tree:
        rpaths.append(str(Path(sysconfig.get_paths()["purelib"]) / "libggml" / "lib64"))
    ext.library_dirs.append(str(ggml.lib_dir))
    ext.libraries += ["ggml-base", "ggml-cpu"]
    ext.extra_link_args += [f"-Wl,-rpath,{r}" for r in rpaths]


EXTENSIONS = {
    "_codec": (PKG / "wire" / "_codec.pyx", codec_extension),
    "_frame": (PKG / "wire" / "_frame.pyx", frame_extension),
    "_frame_gen": (PKG / "wire" / "_frame_gen.pyx", frame_gen_extension),
    "_backend": (STAGE / "_backend.pyx", backend_extension),
}


def extensions() -> list:
    """The extensions this build compiles (SKIPPY_WIRE_PUREPYTHON, SKIPPY_WIRE_BUILD_ONLY),
    their Cython sources translated when each is built (:class:`build_ext`)."""
    if os.environ.get("SKIPPY_WIRE_PUREPYTHON"):
        print("skippy_wire: pure-Python build (no compiled extensions)", file=sys.stderr)
        return []
    only = {n.strip() for n in os.environ.get("SKIPPY_WIRE_BUILD_ONLY", "").split(",") if n.strip()}
    unknown = only - EXTENSIONS.keys()
    if unknown:
        raise SystemExit(f"SKIPPY_WIRE_BUILD_ONLY names unknown extensions: {sorted(unknown)}")
    missing = [str(src) for src, _ in EXTENSIONS.values() if not src.exists()]
    if missing:
        raise SystemExit(f"missing extension sources: {missing}")
    chosen = [make() for name, (_, make) in EXTENSIONS.items() if not only or name in only]
    import numpy

    for ext in chosen:
        ext.include_dirs.append(numpy.get_include())
        ext.define_macros.append(("NPY_NO_DEPRECATED_API", "NPY_1_7_API_VERSION"))
    return chosen


class build_ext(_build_ext):
    """Compiles each extension: Cython first, and for the backend ggml (:func:`link_ggml`)."""

    record = None  # the backend's build record, where this build wrote it
    in_tree = False  # an in-place or editable build (run() builds with inplace off, then copies)

    def run(self) -> None:
        self.in_tree = bool(self.inplace or getattr(self, "editable_mode", False))
        super().run()

    def build_extension(self, ext: Extension) -> None:
        from Cython.Build import cythonize

        if ext.name == "skippy_wire.stage._backend":
            self.record = Path(self.get_ext_fullpath(ext.name)).with_name(RECORD_NAME)
            link_ggml(ext, self.record, self.in_tree)
        print(f"skippy_wire: compiling {ext.name}", file=sys.stderr)
        ext.sources = cythonize([ext], compiler_directives={"language_level": "3", "embedsignature": True},
                                quiet=True)[0].sources
        super().build_extension(ext)

    def copy_extensions_to_source(self) -> None:
        """An in-place (editable) build: the record goes where the built modules go."""
        super().copy_extensions_to_source()
        if self.record is not None:
            shutil.copyfile(self.record, STAGE / RECORD_NAME)


setup(ext_modules=extensions(), cmdclass={"build_ext": build_ext})
