"""The backend's weight product kernels (skippy_wire/stage/_stage/matmul.cpp) for Q4_1 and
Q8_0 matrices: bit for bit ggml_mul_mat (its vec_dot for one row, and for Q8_0 with more
rows its tinyBLAS kernel), used by the stage graphs, switched off by SKIPPY_WIRE_MATMUL=ggml."""

from __future__ import annotations

import ctypes
import os

import pytest

from skippy_wire.net.driver import generate_local
from skippy_wire.stage import _ggml, models
from skippy_wire.tools import backend_bench

B = _ggml.load_backend()


Q4_1, Q8_0, Q4_0 = 3, 8, 2  # ggml type ids


def _check(type_id, k, rows, n, seed, threads):
    fn = ctypes.CDLL(B.__file__).skippy_weight_product_check
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int]
    return fn(type_id, k, rows, n, seed, threads)


def _kernel_runs_here() -> bool:
    """The kernel replaces ggml's AVX2 dot product, so it runs only where ggml has that one."""
    live = set(_ggml.live_build(B)["live_features"])
    return {"avx2", "fma"} <= live


def _vnni_runs_here() -> bool:
    """The VNNI kernels need AVX-512 with VNNI (without it a forced one runs the AVX2 kernel)."""
    return {"avx512", "avx512_vnni"} <= set(_ggml.live_build(B)["live_features"])


# (type, k, weight rows, activation rows, seed, threads): Q4_1 for every remainder of the
# 4-row groups, a row count that two threads split unevenly, SmolLM2's shapes and a
# prefill-sized chunk; Q8_0 (SmolLM2's head) likewise.  Each runs with the kernels this CPU
# chooses and with each family forced (SKIPPY_WIRE_MATMUL; a family the CPU lacks falls back
# to one it has): the AVX2 rows, the 256-bit VNNI rows, and the 512-bit pairs (odd counts
# with a self-paired row).
KERNELS = ["", "avx2", "vnni-rows", "vnni-pairs"]
SHAPES = [(t, 576, 192, n, n, 1) for t in (Q4_1, Q8_0) for n in range(1, 10)] + [
    (Q4_1, 576, 1537, 3, 11, 2), (Q4_1, 1536, 576, 64, 12, 2), (Q4_1, 64, 33, 5, 13, 2), (Q4_1, 576, 4096, 2, 14, 1),
    (Q8_0, 576, 4096, 1, 15, 1), (Q8_0, 576, 1001, 4, 16, 2), (Q8_0, 64, 7, 3, 17, 1), (Q8_0, 576, 300, 64, 18, 2)]


@pytest.mark.parametrize("kernels", KERNELS)
@pytest.mark.parametrize("type_id,k,rows,n,seed,threads", SHAPES)
def test_kernel_equals_ggml_mul_mat_bit_for_bit(monkeypatch, kernels, type_id, k, rows, n, seed, threads):
    if kernels.startswith("vnni") and _kernel_runs_here() and not _vnni_runs_here():
        pytest.skip("this CPU has no AVX-512 VNNI: the forced kernel would be the AVX2 one, tested as such")
    monkeypatch.setenv("SKIPPY_WIRE_MATMUL", kernels)
    differ = _check(type_id, k, rows, n, seed, threads)
    if not _kernel_runs_here():
        assert differ == -1  # nothing to compare: every product is ggml's own
        return
    assert differ == 0


def test_kernel_leaves_other_products_to_ggml():
    assert _check(Q4_0, 576, 64, 1, 1, 1) == -1
    assert _check(Q4_1, 500, 10, 1, 1, 1) == -4  # k not a whole number of 32-value blocks


def test_generation_is_the_same_with_ggml_mul_mat(monkeypatch):
    """Greedy tokens through the kernel (prefill chunks of 5, 5, 1 rows and decode steps)
    equal those with every product through ggml_mul_mat."""
    path = str(models.smollm2_path())
    prompt = models.Tokenizer.from_gguf(path).encode("The capital of France is a city")
    assert len(prompt) == 7
    kernel = generate_local(path, prompt, max_tokens=12, chunk_size=5, threads=2).tokens
    monkeypatch.setenv(backend_bench.MATMUL_ENV, "ggml")
    reference = generate_local(path, prompt, max_tokens=12, chunk_size=5, threads=2).tokens
    assert kernel == reference and len(kernel) == 12


def test_bench_backend_matmul_table_is_consistent(capsys):
    assert backend_bench.main(["--matmul", "--prefill", "16", "--decode", "8", "--batch", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    assert "prefill-16 and 8 batched decode steps" in out  # --decode was taken and ignored (16 steps)
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in out.splitlines() if "tok/s" in line.split("|")[0] or "rows/s" in line.split("|")[0]}
    assert set(rows) == {"prefill-16 tok/s", "decode batch 2 rows/s"}
    for kernel, ggml, ratio in rows.values():  # no timing claim: the ratio is kernel / ggml
        assert float(ratio.rstrip("x")) == pytest.approx(float(kernel) / float(ggml), abs=0.011)
    assert backend_bench.MATMUL_ENV not in os.environ  # the switch is undone


def test_bench_backend_refuses_a_comparison_that_compares_nothing(tmp_path, capsys, monkeypatch):
    """--matmul on F32 weights printed a kernel / ggml ratio of ggml against itself; --stages
    on a one-layer model failed after its header ("invalid layer range [0, 0)")."""
    f32 = models.write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    monkeypatch.setattr(models, "TINY_N_LAYER", 1)
    one_layer = models.write_tiny_llama_gguf(tmp_path / "one.gguf")
    for args, why in ((["-m", str(f32), "--matmul"], f"{f32} has no such weights"),
                      (["-m", str(one_layer), "--stages"],
                       f"--stages splits the model in two; {one_layer} has 1 layer")):
        with pytest.raises(SystemExit) as info:
            backend_bench.main([*args, "--repeat", "1"])
        captured = capsys.readouterr()
        assert info.value.code == 2 and captured.err.rstrip().endswith(why) and not captured.out, captured
