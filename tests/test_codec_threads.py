"""Threaded variant of the codec tests (ml_dtypes habit): many threads encoding,
decoding and selecting at once, with payloads above the GIL-release threshold, give
exactly the single-threaded results."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from skippy_wire._impl import IMPLEMENTATION, kernel_module
from skippy_wire.errors import InvalidDataError

COLS = 1024


def _job(seed: int, rows: int):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, COLS), dtype=np.float32)
    exact = (x.view(np.uint32) & 0xFFFF0000).view(np.float32)
    bad = x.copy()
    bad[rows - 1, COLS - 1] = np.inf
    return rows, x, exact, bad


def _work(k, rows, x, exact, bad):
    out = []
    for codec in (1, 2, 3, 4):
        wire = k.encode_activation(codec, rows, COLS, x, 0)
        out.append(wire)
        out.append(k.decode_activation(codec, rows, COLS, wire, 0).tobytes())
    out.append(k.select_and_encode_lossless(rows, COLS, exact, 0, [1, 2, 3]))
    out.append(k.select_lossless_codec(rows, COLS, x, 0, [1, 2, 3]))
    try:
        k.encode_activation(2, rows, COLS, bad, 0)
    except InvalidDataError as exc:
        out.append(str(exc))
    return out


def test_concurrent_calls_match_serial_results(codec_impl, impl):
    # 64 x 1024 f32 = 256 KiB, above the compiled GIL-release threshold; the twin is
    # slow, so it gets a thinner frame that still exercises the threads.
    rows = 64 if impl == "cython" else 2
    inputs = [_job(seed, rows) for seed in range(4)]
    serial = [_work(codec_impl, *job) for job in inputs]
    assert serial[0][-1] == "activation values must be finite"
    with ThreadPoolExecutor(max_workers=4) as pool:
        for _ in range(2):
            parallel = list(pool.map(lambda job: _work(codec_impl, *job), inputs * 2))
            assert parallel == serial * 2


@pytest.mark.skipif(IMPLEMENTATION != "cython", reason="the pure-Python twin never releases the GIL")
def test_compiled_kernels_release_the_gil_on_large_payloads():
    """While one thread is inside a long compiled call, another Python thread runs.

    A spinner thread counts in pure Python; the main thread reads the count just before
    and just after an S8 encode of a large frame.  With the GIL released the spinner
    advances during the call; with the GIL held it could not run at all.  Scheduling on
    a busy machine can delay the spinner, so any of a few calls may show it."""
    k = kernel_module("codec", "cython")
    x = np.random.default_rng(5).standard_normal((1024, 2048), dtype=np.float32)
    count = [0]
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            count[0] += 1

    spinner = threading.Thread(target=spin)
    spinner.start()
    try:
        advanced = []
        for _ in range(5):
            before = count[0]
            k.encode_activation(4, 1024, 2048, x, 0)
            advanced.append(count[0] - before)
            if advanced[-1] > 0:
                break
    finally:
        stop.set()
        spinner.join()
    assert any(a > 0 for a in advanced), advanced
