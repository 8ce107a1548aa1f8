"""Codec throughput: our kernels (live implementation and, on small frames, the
reference twin) beside the oracles numpy float16 and ml_dtypes bfloat16.  One
benchmark group per operation; ``extra_info`` carries ``impl``, ``nbytes`` (f32 bytes
of the frame) and ``correct`` (the result matched the oracle)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from skippy_wire._impl import kernel_module


def _timed(benchmark, impl, group, oracle, ours):
    """Time one call in ``group``: the ``oracle`` call tuple ``(fn, *args)`` for impl
    "oracle", else the call tuple ``ours(codec kernels of impl)``; its result."""
    benchmark.group = group
    fn, *args = oracle if impl == "oracle" else ours(kernel_module("codec", impl))
    return benchmark(fn, *args)


def _as_bytes(out):
    """The bytes of an oracle's array, or a kernel's bytes as they are."""
    return out.tobytes() if isinstance(out, np.ndarray) else out


def _record(benchmark, impl, payloads, correct):
    benchmark.extra_info.update(impl=impl, nbytes=payloads.nbytes, correct=bool(correct))
    assert correct, f"{impl} result differs from the oracle"


#: (name, codec id, oracle dtype) of the 16-bit codecs.
HALVES = [("bf16", 3, ml_dtypes.bfloat16), ("f16", 2, np.float16)]
HALF_IDS = [h[0] for h in HALVES]


@pytest.mark.parametrize("half", HALVES, ids=HALF_IDS)
def test_encode(benchmark, impl, size, payloads, half):
    """f32 -> bf16 / f16 with the upstream finiteness and range checks (oracle: astype, no checks)."""
    name, codec, dtype = half
    p = payloads
    out = _timed(benchmark, impl, f"encode-{name}", (p.f32.astype, dtype),
                 lambda k: (k.encode_activation, codec, p.tokens, p.n_embd, p.f32, 0))
    _record(benchmark, impl, p, _as_bytes(out) == getattr(p, name).tobytes())


def test_encode_bf16_out(benchmark, impl, size, payloads):
    """As test_encode[bf16], into one reused ``out=`` buffer (no per-call allocation)."""
    benchmark.group = "encode-bf16-out"
    p = payloads
    if impl == "oracle":
        buf = np.empty(p.f32.shape, dtype=ml_dtypes.bfloat16)
        benchmark(np.copyto, buf, p.f32, casting="unsafe")
        out = buf.tobytes()
    else:
        k = kernel_module("codec", impl)
        buf = bytearray(p.f32.nbytes // 2)
        out = bytes(benchmark(k.encode_activation, 3, p.tokens, p.n_embd, p.f32, 0, out=buf))
    _record(benchmark, impl, p, out == p.bf16.tobytes())


def test_select_and_encode_bf16_exact(benchmark, impl, size, payloads):
    """Lossless selection plus the encode it picks, on bf16-exact data (a full scan)."""
    p = payloads
    out = _timed(benchmark, impl, "select-encode", (p.bf16_exact.astype, ml_dtypes.bfloat16),
                 lambda k: (k.select_and_encode_lossless, p.tokens, p.n_embd, p.bf16_exact, 0, [1, 2, 3]))
    if impl == "oracle":
        out = (3, out.tobytes())
    _record(benchmark, impl, p, out == (3, p.bf16.tobytes()))


@pytest.mark.parametrize("half", HALVES, ids=HALF_IDS)
def test_decode(benchmark, impl, size, payloads, half):
    """bf16 / f16 wire -> f32 with the non-finite check (oracle: astype(float32))."""
    name, codec, _ = half
    p = payloads
    wire = getattr(p, name)
    want = wire.astype(np.float32)
    out = _timed(benchmark, impl, f"decode-{name}", (wire.astype, np.float32),
                 lambda k: (k.decode_activation, codec, p.tokens, p.n_embd, wire.tobytes(), 0))
    _record(benchmark, impl, p, np.array_equal(out.reshape(-1), want.reshape(-1)))
