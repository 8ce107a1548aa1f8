"""Which ggml the backend carries: the source build for this CPU (ggml_build.py), its live
CPU variant against /proc/cpuinfo, and the loud libggml-python wheel fallback."""

from __future__ import annotations

import importlib.util
import os
import runpy
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from skippy_wire.stage import _ggml
from skippy_wire.tools import backend_bench, cli

ROOT = Path(__file__).resolve().parent.parent
_spec = importlib.util.spec_from_file_location("ggml_build", ROOT / "ggml_build.py")
ggml_build = importlib.util.module_from_spec(_spec)
sys.modules["ggml_build"] = ggml_build  # its dataclass looks its module up
_spec.loader.exec_module(ggml_build)

B = _ggml.load_backend()
# live ggml-cpu feature -> the /proc/cpuinfo flags that make the source build compile it
LIVE_TO_CPU = {
    "avx": ("avx",),
    "avx2": ("avx2",),
    "bmi2": ("bmi2",),
    "f16c": ("f16c",),
    "fma": ("fma",),
    "avx_vnni": ("avx_vnni",),
    "avx512": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw"),
    "avx512_vbmi": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512vbmi"),
    "avx512_vnni": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_vnni"),
    "avx512_bf16": ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw", "avx512_bf16"),
}
WHEEL_INFO = {"source": "wheel", "reason": "forced by SKIPPY_WIRE_GGML=wheel", "cpu_flags_required": []}


def _x86() -> bool:
    return ggml_build.platform.machine().lower() in ("x86_64", "amd64")


def test_live_build_is_the_source_build():
    info = _ggml.live_build(B)
    if info["source"] != _ggml.SOURCE_BUILD:
        # Only a deliberately forced fallback is acceptable; an unforced one is the failure.
        assert ggml_build.ENV_MODE in info["reason"], f"the ggml source build was not used: {info['reason']}"
        return
    assert info["live_version"] == info["ggml_version"] == ggml_build.GGML_VERSION
    assert info["dist"] == f"{ggml_build.GGML_DIST}=={ggml_build.GGML_DIST_VERSION}"
    readelf = shutil.which("readelf")
    assert readelf, "binutils' readelf is needed to check the extension's links"
    needed = subprocess.run([readelf, "-d", B.__file__], capture_output=True, text=True, check=True).stdout
    assert "libggml" not in needed  # ggml is linked in, not the wheel's shared libraries
    assert "NEEDED" in needed


def test_live_variant_matches_cpu_flags():
    info = _ggml.live_build(B)
    live = set(info["live_features"])
    flags = _ggml.cpu_flags()
    assert "amx_int8" not in live  # AMX is never compiled in (it faults in VMs that advertise it)
    if info["source"] != _ggml.SOURCE_BUILD or not _x86():
        assert not {"avx512", "avx512_vnni"} & live  # the wheel is an AVX2 build
        return
    expected = {feat for feat, need in LIVE_TO_CPU.items() if all(f in flags for f in need)}
    assert live & set(LIVE_TO_CPU) == expected
    assert "llamafile" in live
    assert _ggml.missing_cpu_flags(info, flags) == []
    assert set(info["cpu_flags_required"]) <= flags


def test_version_and_bench_header_name_the_live_build(capsys):
    assert cli.main(["--version"]) == 0
    out = capsys.readouterr().out
    info = _ggml.live_build(B)
    assert out.startswith("skippy-wire ")
    assert f"ggml {info['live_version']}" in out and ",".join(info["live_features"]) in out
    head = backend_bench.header()
    assert _ggml.describe(B) in head and "cpu: " in head
    assert ("built from source" in out) == (info["source"] == _ggml.SOURCE_BUILD)


def test_choose_features_follows_cpuinfo_and_never_amx():
    flags = ggml_build.cpu_flags("flags\t\t: sse4_2 avx avx2 fma f16c bmi2 avx512_vnni amx_tile amx_int8 amx_bf16\n")
    on = ggml_build.choose_features(flags, "cc", probe=False)
    assert on == ["GGML_SSE42", "GGML_AVX", "GGML_AVX2", "GGML_BMI2", "GGML_FMA", "GGML_F16C"]  # no VNNI without AVX512F
    cmake = ggml_build.cmake_flags(on)
    if _x86():
        assert "-DGGML_NATIVE=OFF" in cmake and "-DGGML_AVX512=OFF" in cmake and "-DGGML_AVX2=ON" in cmake
        assert all(f"-D{o}=OFF" in cmake for o in ggml_build.ALWAYS_OFF)
    full = ggml_build.cpu_flags("flags : avx2 avx512f avx512cd avx512vl avx512dq avx512bw avx512_bf16\n")
    assert ggml_build.choose_features(full, "cc", probe=False) == ["GGML_AVX2", "GGML_AVX512", "GGML_AVX512_BF16"]
    # the build key changes with the flags, so a different CPU never reuses a cached build
    assert ggml_build.build_key(ggml_build.cmake_flags(on), "cc") != ggml_build.build_key(cmake + ["-DX=1"], "cc")


def test_forced_fallback_warns_at_build(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(ggml_build.ENV_MODE, ggml_build.MODE_WHEEL)
    build = ggml_build.resolve(lambda: tmp_path)
    assert build.source == _ggml.WHEEL_BUILD and build.lib_dir == tmp_path / "lib64" and not build.static_libs
    assert build.info()["reason"] == f"forced by {ggml_build.ENV_MODE}={ggml_build.MODE_WHEEL}"
    err = capsys.readouterr().err
    assert "WARNING" in err and "libggml-python wheel" in err and ggml_build.ENV_MODE in err
    monkeypatch.setenv(ggml_build.ENV_MODE, "fast")
    with pytest.raises(SystemExit):
        ggml_build.resolve(lambda: tmp_path)


def test_a_forced_fallback_is_not_told_to_install_cmake(monkeypatch, tmp_path):
    """A portable build asked for with SKIPPY_WIRE_GGML=wheel was told, on every command, to
    reinstall with cmake available (which changes nothing while the setting stays)."""
    monkeypatch.setenv(ggml_build.ENV_MODE, ggml_build.MODE_WHEEL)
    text = _ggml.fallback_warning(ggml_build.resolve(lambda: tmp_path).info())
    assert text.endswith(": forced by SKIPPY_WIRE_GGML=wheel; reinstall without SKIPPY_WIRE_GGML=wheel to build it")


def test_a_wheel_fallback_backend_looks_for_ggml_beside_itself_only(monkeypatch, tmp_path):
    """Its RUNPATH also named the build machine's venv and pip's isolated build folder under
    /tmp (gone once built, anyone's to make again with a libggml of their own)."""
    import setuptools

    monkeypatch.setattr(setuptools, "setup", lambda **kwargs: None)  # setup.py's functions, nothing built
    setup_py = runpy.run_path(str(ROOT / "setup.py"), run_name="setup_py_under_test")
    link_ggml = setup_py["link_ggml"]
    isolated = tmp_path / "pip-build-env" / "libggml"  # where the build finds the wheel
    monkeypatch.setitem(link_ggml.__globals__, "_libggml_root", lambda: isolated)
    monkeypatch.setenv(ggml_build.ENV_MODE, ggml_build.MODE_WHEEL)
    rpaths = {}
    for in_tree in (False, True):
        ext = setup_py["backend_extension"]()
        link_ggml(ext, tmp_path / "record.json", in_tree)
        assert ext.libraries[-2:] == ["ggml-base", "ggml-cpu"] and str(isolated / "lib64") in ext.library_dirs
        rpaths[in_tree] = [arg.removeprefix("-Wl,-rpath,") for arg in ext.extra_link_args if "rpath" in arg]
    assert rpaths[False] == ["$ORIGIN/../../libggml/lib64"]  # a wheel names no path of this machine
    # a module left in the checkout finds the wheel's libraries in this interpreter's site-packages
    purelib = setup_py["sysconfig"].get_paths()["purelib"]
    assert rpaths[True] == ["$ORIGIN/../../libggml/lib64", purelib + "/libggml/lib64"]


def test_no_backend_is_an_import_error_without_a_fallback_warning(monkeypatch):
    """A pure-Python install warned that its backend links the wheel, then had none."""
    monkeypatch.setattr(_ggml, "build_info", lambda path=None: {"source": "unknown", "reason": "no build record"})
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(_ggml.importlib.util, "find_spec",
                        lambda name, *a: None if name == "skippy_wire.stage._backend" else find_spec(name, *a))
    with warnings.catch_warnings(record=True) as said, \
            pytest.raises(ImportError, match=r"^No module named 'skippy_wire\.stage\._backend'$"):
        warnings.simplefilter("always")
        _ggml.load_backend()
    assert not said, [str(w.message) for w in said]


def test_impossible_source_build_falls_back_loudly(monkeypatch, capsys, tmp_path):
    monkeypatch.delenv(ggml_build.ENV_MODE, raising=False)
    monkeypatch.setattr(ggml_build.shutil, "which", lambda name: None)  # no cmake here
    build = ggml_build.resolve(lambda: tmp_path)
    assert build.source == _ggml.WHEEL_BUILD and "cmake not found" in build.reason
    assert "cmake not found" in capsys.readouterr().err


def test_fallback_warns_at_run_time(monkeypatch):
    with pytest.warns(_ggml.GgmlFallbackWarning, match="portable libggml-python wheel"):
        _ggml.check(WHEEL_INFO, {"avx2"})
    monkeypatch.setattr(_ggml, "build_info", lambda path=None: dict(WHEEL_INFO))
    with pytest.warns(_ggml.GgmlFallbackWarning):
        assert _ggml.load_backend() is B
    assert "WARNING: " in backend_bench.header()


def test_build_for_another_cpu_is_refused_not_crashed():
    info = {"source": "sdist", "cpu_flags_required": ["avx2", "avx512f"]}
    with pytest.raises(ImportError, match="avx512f"):
        _ggml.check(info, {"avx2", "fma"})
    _ggml.check(info, {"avx2", "avx512f"})  # no warning: the filterwarnings=error setting would raise
    _ggml.check(info, set())  # no /proc/cpuinfo: nothing to check against


def test_build_record_is_read(tmp_path):
    assert _ggml.build_info(tmp_path / "missing.json")["source"] == "unknown"
    assert _ggml.fallback_warning({"source": "unknown", "reason": "no build record"}).endswith(
        "no build record; reinstall with cmake available to build it")
    assert _ggml.fallback_warning({"source": "sdist"}) is None


def test_ggml_build_script_runs_from_its_cache():
    info = _ggml.build_info()
    if info["source"] != _ggml.SOURCE_BUILD:
        assert ggml_build.ENV_MODE in info["reason"], f"the ggml source build was not used: {info['reason']}"
        return
    env = {**os.environ, ggml_build.ENV_CACHE: str(Path(info["cache_dir"]).parent)}
    run = subprocess.run([sys.executable, str(ROOT / "ggml_build.py")], capture_output=True, text=True, timeout=120,
                         check=True, env=env)
    assert "source build cached" in run.stderr  # a reinstall on the same CPU rebuilds nothing
    assert f'"key": "{info["key"]}"' in run.stdout


def test_reading_setup_py_builds_nothing(tmp_path):
    # An sdist, `setup.py --version` and the like read setup.py: ggml is resolved (built,
    # downloaded) and the build record written only when the backend is compiled.
    record = ROOT / "skippy_wire" / "stage" / "_ggml_build.json"
    before = record.stat().st_mtime_ns if record.exists() else None
    env = {**os.environ, ggml_build.ENV_CACHE: str(tmp_path / "cache"), ggml_build.ENV_MODE: ""}
    run = subprocess.run([sys.executable, "setup.py", "--version"], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env=env)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "0.1.0"
    assert not (tmp_path / "cache").exists()
    assert (record.stat().st_mtime_ns if record.exists() else None) == before


@pytest.mark.slow
def test_bench_backend_batch_compares_batched_decode_steps(capsys):
    assert backend_bench.main(["--batch", "1,2", "--decode", "2", "--repeat", "1"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines() if line.strip().startswith("1 |")]
    assert [int(row[1]) for row in rows] == [1, 2]
    # No timing claim here (a loaded machine can make either size faster): the row of the
    # reference is 1.00x, and each row's figures agree with each other (B rows per step).
    assert rows[0][3].strip() == "1.00x" and rows[0][5].strip() == "1.00x"
    ms, step_ratio, rows_s, rows_ratio = (float(rows[1][i].strip().rstrip("x")) for i in (2, 3, 4, 5))
    assert ms > 0 and rows_s == pytest.approx(2 * 1e3 / ms, rel=0.01)
    assert rows_ratio == pytest.approx(2 / step_ratio, rel=0.02)
    with pytest.raises(SystemExit) as exc:
        backend_bench.main(["--batch", "0,2"])
    assert exc.value.code == 2
