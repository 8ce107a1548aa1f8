"""Build ggml from source for the CPU this runs on (used by setup.py; docs/backend.md §build).

The source is the PyPI source distribution of ``libggml-python`` (pinned below): it carries the
ggml tree (``ggml/``) the prebuilt wheel is compiled from, so the API is exactly the wheel's.
Only ``ggml-base`` and ``ggml-cpu`` are built, as static position-independent archives that
``skippy_wire.stage._backend`` links in (their symbols stay private to the extension).

CPU features: GGML_NATIVE is off; each x86 feature the CPU advertises in /proc/cpuinfo is
turned on explicitly, and the risky ones (AVX-512 family, AVX-VNNI) only after a tiny probe
program using them ran here.  AMX stays off (it faults in some VMs that advertise it).

The build is cached under ``$SKIPPY_WIRE_GGML_CACHE`` (default ``~/.cache/skippy_wire/ggml``)
in a folder keyed by the ggml version, the compiler and the CMake flags, so reinstalls
(``pip install -e .``) reuse it.  ``SKIPPY_WIRE_GGML=wheel`` forces the portable fallback
(link the prebuilt libggml-python wheel); the fallback is also taken, with a loud warning,
when the source build is impossible here.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import platform
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass, field
from pathlib import Path

def _load_runtime_module():
    """skippy_wire/stage/_ggml.py by path (stdlib only; the package itself is not importable
    while it is being built): the run-time side of the build record shares its helpers."""
    path = Path(__file__).resolve().parent / "skippy_wire" / "stage" / "_ggml.py"
    spec = importlib.util.spec_from_file_location("skippy_wire_ggml_runtime", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


runtime = _load_runtime_module()
cpu_flags = runtime.cpu_flags

GGML_DIST = "libggml-python"
GGML_DIST_VERSION = "0.20.2.post1"
GGML_VERSION = "0.20.2"
GGML_SDIST_SHA256 = "e47ff53506342959ffb3ce15380b82828fea10ec5f208f9ef6915895f1a7a176"
GGML_SDIST_NAME = f"libggml_python-{GGML_DIST_VERSION}"

ENV_MODE = runtime.MODE_ENV  # "source" (default) or "wheel" (force the portable fallback)
ENV_CACHE = "SKIPPY_WIRE_GGML_CACHE"
MODE_SOURCE = "source"
MODE_WHEEL = runtime.WHEEL_BUILD
FALLBACK_WARNING = (
    "skippy_wire WARNING: ggml from the prebuilt libggml-python wheel (portable AVX2 build, "
    "slower on this CPU): {reason}"
)

# ggml option -> /proc/cpuinfo flags that must all be present.
X86_FEATURES = {
    "GGML_SSE42": ("sse4_2",),
    "GGML_AVX": ("avx",),
    "GGML_AVX2": ("avx2",),
    "GGML_BMI2": ("bmi2",),
    "GGML_FMA": ("fma",),
    "GGML_F16C": ("f16c",),
    "GGML_AVX_VNNI": ("avx_vnni",),
    "GGML_AVX512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "GGML_AVX512_VBMI": ("avx512vbmi",),
    "GGML_AVX512_VNNI": ("avx512_vnni",),
    "GGML_AVX512_BF16": ("avx512_bf16",),
}
# Options that need GGML_AVX512 as well.
NEEDS_AVX512 = ("GGML_AVX512_VBMI", "GGML_AVX512_VNNI", "GGML_AVX512_BF16")
ALWAYS_OFF = ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")
# A probe (compiler flags, C body) per risky option: it must run here before the option is on.
PROBES = {
    "GGML_AVX_VNNI": (
        ["-mavxvnni"],
        "__m256i a = _mm256_set1_epi8(v); a = _mm256_dpbusd_avx_epi32(a, a, a); return _mm256_extract_epi32(a, 0) == 7;",
    ),
    "GGML_AVX512": (
        ["-mavx512f", "-mavx512cd", "-mavx512vl", "-mavx512dq", "-mavx512bw"],
        "__m512i a = _mm512_set1_epi8(v); a = _mm512_add_epi8(a, a); return _mm512_reduce_add_epi32(_mm512_and_epi32(a, a)) == 7;",
    ),
    "GGML_AVX512_VBMI": (
        ["-mavx512f", "-mavx512bw", "-mavx512vbmi"],
        "__m512i a = _mm512_set1_epi8(v); a = _mm512_permutexvar_epi8(a, a); return _mm512_reduce_add_epi32(a) == 7;",
    ),
    "GGML_AVX512_VNNI": (
        ["-mavx512f", "-mavx512vnni"],
        "__m512i a = _mm512_set1_epi8(v); a = _mm512_dpbusd_epi32(a, a, a); return _mm512_reduce_add_epi32(a) == 7;",
    ),
    "GGML_AVX512_BF16": (
        ["-mavx512f", "-mavx512bf16"],
        "__m512 a = _mm512_set1_ps((float)v); __m256bh b = _mm512_cvtneps_pbh(a); "
        "return _mm512_reduce_add_ps(_mm512_dpbf16_ps(a, (__m512bh)_mm512_castsi256_si512((__m256i)b), "
        "(__m512bh)_mm512_castsi256_si512((__m256i)b))) == 7.0f;",
    ),
}
TARGETS = ("ggml-base", "ggml-cpu")
LIBS = ("libggml-cpu.a", "libggml-base.a")  # link order: cpu needs base


class GgmlBuildError(RuntimeError):
    """The source build of ggml is impossible here (the caller falls back to the wheel)."""


@dataclass
class GgmlBuild:
    """What setup.py links and what skippy_wire.stage._ggml reports at run time."""

    source: str  # runtime.SOURCE_BUILD ("sdist") or runtime.WHEEL_BUILD ("wheel")
    include_dir: Path
    static_libs: list[Path] = field(default_factory=list)  # sdist: archives to link in
    lib_dir: Path | None = None  # wheel: shared libraries
    features: list[str] = field(default_factory=list)  # ggml CPU options compiled on
    cmake_flags: list[str] = field(default_factory=list)
    key: str = ""
    reason: str = ""  # why the fallback was taken

    def info(self) -> dict:
        return {
            "source": self.source,
            "dist": f"{GGML_DIST}=={GGML_DIST_VERSION}",
            "ggml_version": GGML_VERSION,
            "features": self.features,
            "cpu_flags_required": sorted({f for o in self.features for f in X86_FEATURES.get(o, ())}),
            "cmake_flags": self.cmake_flags,
            "key": self.key,
            "cache_dir": str(self.include_dir.parent) if self.static_libs else "",
            "reason": self.reason,
        }


def log(msg: str) -> None:
    print(f"skippy_wire: {msg}", file=sys.stderr, flush=True)


def cache_root() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "skippy_wire" / "ggml"


def _probe(cc: str, option: str, workdir: Path) -> bool:
    flags, body = PROBES[option]
    src = workdir / f"probe_{option}.c"
    exe = workdir / f"probe_{option}"
    src.write_text(
        "#include <immintrin.h>\n#include <stdlib.h>\n"
        "int main(int argc, char **argv) { (void)argv; volatile char v = (char)argc; "
        f"{body} }}\n"
    )
    try:
        subprocess.run([cc, "-O1", *flags, str(src), "-o", str(exe)], check=True, capture_output=True, timeout=60)
        run = subprocess.run([str(exe)], capture_output=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return False
    return run.returncode >= 0  # a signal (SIGILL) is a negative code; the result value is irrelevant


def choose_features(flags: set[str], cc: str, probe: bool = True) -> list[str]:
    """The ggml x86 CPU options to turn on for this CPU (probed where risky)."""
    on = [opt for opt, need in X86_FEATURES.items() if all(f in flags for f in need)]
    if "GGML_AVX512" not in on:
        on = [o for o in on if o not in NEEDS_AVX512]
    if probe:
        with tempfile.TemporaryDirectory(prefix="skippy_ggml_probe_") as tmp:
            ok = {o: _probe(cc, o, Path(tmp)) for o in on if o in PROBES}
        for o, good in ok.items():
            if not good:
                log(f"{o} advertised by the CPU but its probe failed to run: left off")
        on = [o for o in on if ok.get(o, True)]
        if "GGML_AVX512" not in on:
            on = [o for o in on if o not in NEEDS_AVX512]
    return on


def cmake_flags(features: list[str]) -> list[str]:
    base = [
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DCMAKE_POSITION_INDEPENDENT_CODE=ON",
        "-DGGML_OPENMP=OFF",
        "-DGGML_LLAMAFILE=ON",
        "-DGGML_CCACHE=OFF",
        "-DGGML_BUILD_TESTS=OFF",
        "-DGGML_BUILD_EXAMPLES=OFF",
        "-DGGML_BACKEND_DL=OFF",
    ]
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return base + ["-DGGML_NATIVE=ON"]
    opts = [f"-D{o}={'ON' if o in features else 'OFF'}" for o in X86_FEATURES]
    return base + ["-DGGML_NATIVE=OFF", *opts, *(f"-D{o}=OFF" for o in ALWAYS_OFF)]


def _compiler_id(cc: str) -> str:
    try:
        return subprocess.run([cc, "--version"], capture_output=True, text=True, timeout=30).stdout.splitlines()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return cc


def build_key(flags: list[str], cc: str) -> str:
    digest = hashlib.sha256(json.dumps([GGML_DIST_VERSION, flags, _compiler_id(cc)]).encode()).hexdigest()
    return f"ggml-{GGML_VERSION}-{digest[:12]}"


def fetch_source(root: Path) -> Path:
    """The ggml tree of the pinned libggml-python sdist, downloaded once with pip and unpacked."""
    src = root / "src" / GGML_SDIST_NAME / "ggml"
    if (src / "CMakeLists.txt").exists():
        return src
    sdist_dir = root / "sdist"
    sdist = sdist_dir / f"{GGML_SDIST_NAME}.tar.gz"
    if not sdist.exists():
        sdist_dir.mkdir(parents=True, exist_ok=True)
        log(f"downloading the {GGML_DIST}=={GGML_DIST_VERSION} source distribution (ggml {GGML_VERSION})")
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", GGML_DIST,
               f"{GGML_DIST}=={GGML_DIST_VERSION}", "-d", str(sdist_dir)]
        try:
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=600)
        except (OSError, subprocess.SubprocessError) as exc:
            detail = getattr(exc, "stderr", "") or str(exc)
            raise GgmlBuildError(f"pip download of the {GGML_DIST} sdist failed: {detail.strip()[-300:]}") from exc
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    if digest != GGML_SDIST_SHA256:
        sdist.unlink()
        raise GgmlBuildError(f"{sdist.name} sha256 {digest} is not the pinned {GGML_SDIST_SHA256}")
    tmp = Path(tempfile.mkdtemp(prefix="unpack-", dir=root))
    try:
        with tarfile.open(sdist) as tar:
            members = [m for m in tar.getmembers() if m.name.startswith(f"{GGML_SDIST_NAME}/ggml/")]
            try:
                tar.extractall(tmp, members=members, filter="data")
            except TypeError:  # Python without extraction filters (< 3.10.12)
                tar.extractall(tmp, members=members)
        (root / "src" / GGML_SDIST_NAME).mkdir(parents=True, exist_ok=True)
        shutil.rmtree(src, ignore_errors=True)
        os.replace(tmp / GGML_SDIST_NAME / "ggml", src)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return src


def build_from_source() -> GgmlBuild:
    if shutil.which("cmake") is None:
        raise GgmlBuildError("cmake not found (pip install cmake)")
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or "cc"
    x86 = platform.machine().lower() in ("x86_64", "amd64")
    features = choose_features(cpu_flags(), cc) if x86 else []
    flags = cmake_flags(features)
    root = cache_root()
    key = build_key(flags, cc)
    out = root / key
    done = out / "build.json"
    libs = [out / "lib" / name for name in LIBS]
    result = GgmlBuild(runtime.SOURCE_BUILD, out / "include", libs, features=features, cmake_flags=flags, key=key)
    if done.exists() and all(p.exists() for p in libs) and (out / "include" / "ggml.h").exists():
        log(f"ggml {GGML_VERSION} source build cached: {out}")
        return result
    src = fetch_source(root)
    build = out / "build"
    gen = ["-G", "Ninja"] if shutil.which("ninja") else []
    jobs = str(max(1, os.cpu_count() or 1))
    log(f"building ggml {GGML_VERSION} ({', '.join(TARGETS)}) from source with {' '.join(flags)}")
    try:
        subprocess.run(["cmake", "-S", str(src), "-B", str(build), *gen, *flags], check=True,
                       capture_output=True, text=True)
        subprocess.run(["cmake", "--build", str(build), "--target", *TARGETS, "-j", jobs], check=True,
                       capture_output=True, text=True)
    except (OSError, subprocess.CalledProcessError) as exc:
        detail = (getattr(exc, "stdout", "") or "") + (getattr(exc, "stderr", "") or "") or str(exc)
        raise GgmlBuildError(f"the ggml source build failed: {detail.strip()[-500:]}") from exc
    (out / "lib").mkdir(parents=True, exist_ok=True)
    for name in LIBS:
        found = sorted(build.rglob(name))
        if not found:
            raise GgmlBuildError(f"the ggml source build made no {name}")
        shutil.copy2(found[0], out / "lib" / name)
    shutil.rmtree(out / "include", ignore_errors=True)
    shutil.copytree(src / "include", out / "include")
    done.write_text(json.dumps(result.info(), indent=1))
    shutil.rmtree(build, ignore_errors=True)
    return result


def wheel_build(wheel_root: Path, reason: str) -> GgmlBuild:
    log(FALLBACK_WARNING.format(reason=reason))
    return GgmlBuild(runtime.WHEEL_BUILD, wheel_root / "include", lib_dir=wheel_root / "lib64", reason=reason)


def resolve(wheel_root) -> GgmlBuild:
    """The ggml to link: the cached or fresh source build, else (loudly) the wheel.

    ``wheel_root`` is a callable returning the libggml-python wheel's folder.
    """
    mode = os.environ.get(ENV_MODE, MODE_SOURCE).strip().lower()
    if mode not in (MODE_SOURCE, MODE_WHEEL):
        raise SystemExit(f"{ENV_MODE} must be {MODE_SOURCE!r} or {MODE_WHEEL!r}, not {mode!r}")
    if mode == MODE_WHEEL:
        return wheel_build(wheel_root(), runtime.FORCED_REASON)
    if sys.platform != "linux":
        return wheel_build(wheel_root(), f"the source build supports Linux only (this is {sys.platform})")
    try:
        return build_from_source()
    except GgmlBuildError as exc:
        return wheel_build(wheel_root(), str(exc))


if __name__ == "__main__":  # python ggml_build.py: build (or reuse) ggml and print what was chosen
    print(json.dumps(build_from_source().info(), indent=1))
