"""The backend's multi-row Q4_1 product kernel (skippy_wire/stage/_stage/matmul.cpp): bit for
bit ggml_mul_mat, used by the stage graphs, and switched off by SKIPPY_WIRE_MATMUL=ggml."""

from __future__ import annotations

import ctypes
import os

import pytest

from skippy_wire.net.driver import generate_local
from skippy_wire.stage import _ggml, models
from skippy_wire.tools import backend_bench

B = _ggml.load_backend()


def _check():
    fn = ctypes.CDLL(B.__file__).skippy_q4_1_product_check
    fn.restype = ctypes.c_int64
    fn.argtypes = [ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint32, ctypes.c_int]
    return fn


def _kernel_runs_here() -> bool:
    """The kernel replaces ggml's AVX2 dot product, so it runs only where ggml has that one."""
    live = set(_ggml.live_build(B)["live_features"])
    return {"avx2", "fma"} <= live


# (k, weight rows, activation rows, seed, threads): every remainder of the 4-row groups, a
# row count that two threads split unevenly, SmolLM2's shapes and a prefill-sized chunk
SHAPES = [(576, 192, n, n, 1) for n in range(1, 10)] + [
    (576, 1537, 3, 11, 2), (1536, 576, 64, 12, 2), (64, 33, 5, 13, 2), (576, 4096, 2, 14, 1)]


@pytest.mark.parametrize("k,rows,n,seed,threads", SHAPES)
def test_kernel_equals_ggml_mul_mat_bit_for_bit(k, rows, n, seed, threads):
    differ = _check()(k, rows, n, seed, threads)
    if not _kernel_runs_here():
        assert differ == -1  # nothing to compare: every product is ggml's own
        return
    assert differ == 0


def test_check_rejects_shapes_the_kernel_does_not_take():
    assert _check()(500, 10, 1, 1, 1) in (-4, -1)  # k not a multiple of the 32-value block


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
    assert backend_bench.main(["--matmul", "--prefill", "16", "--batch", "2", "--repeat", "1"]) == 0
    out = capsys.readouterr().out
    rows = {line.split("|")[0].strip(): [c.strip() for c in line.split("|")[1:]]
            for line in out.splitlines() if "tok/s" in line.split("|")[0] or "rows/s" in line.split("|")[0]}
    assert set(rows) == {"prefill-16 tok/s", "decode batch 2 rows/s"}
    for kernel, ggml, ratio in rows.values():  # no timing claim: the ratio is kernel / ggml
        assert float(ratio.rstrip("x")) == pytest.approx(float(kernel) / float(ggml), abs=0.011)
    assert backend_bench.MATMUL_ENV not in os.environ  # the switch is undone
