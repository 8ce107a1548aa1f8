"""Threaded variant of the codec tests (ml_dtypes habit): many threads encoding,
decoding and selecting at once, with payloads above the GIL-release threshold, give
exactly the single-threaded results."""

from __future__ import annotations

import sys
import threading
import time
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


def _spinner_stamps_inside_calls(call, tries: int = 5, *, ready=lambda: True, before=lambda: None) -> list[int]:
    """How many stamps a spinner thread takes strictly inside each of up to ``tries`` calls
    of ``call`` (``before()`` ahead of each), stopping at the first with any; the spinner
    stamps only while ``ready()``.

    The spinner records ``time.perf_counter_ns()`` and yields the GIL with ``sleep(0)``
    after every look; this thread takes t_start and t_end right around the call.  The
    switch interval is raised to an hour for the duration, so the interpreter never forces
    a GIL hand-over: the spinner can only run while this thread waits, which is inside the
    call if and only if the call releases the GIL (a forced switch at the eval breaker
    right after the call returns, which would put stamps in the window without any
    release, cannot happen)."""
    stamps: list[int] = []
    stop = threading.Event()

    def spin():
        while not stop.is_set():
            if ready():
                stamps.append(time.perf_counter_ns())
            time.sleep(0)

    interval = sys.getswitchinterval()
    sys.setswitchinterval(3600.0)
    spinner = threading.Thread(target=spin)
    spinner.start()
    inside = []
    try:
        for _ in range(tries):
            before()
            t_start = time.perf_counter_ns()
            call()
            t_end = time.perf_counter_ns()
            inside.append(sum(1 for t in list(stamps) if t_start < t < t_end))
            if inside[-1]:
                break
    finally:
        stop.set()
        spinner.join()
        sys.setswitchinterval(interval)
    return inside


#: The largest payload of these tests: an S8 encode of a 1024 x 2048 frame.
_LARGE = np.random.default_rng(5).standard_normal((1024, 2048), dtype=np.float32)


@pytest.mark.skipif(IMPLEMENTATION != "cython", reason="the pure-Python twin never releases the GIL")
def test_compiled_kernels_release_the_gil_on_large_payloads():
    """Another Python thread runs while this one is inside a large compiled call.

    The check fails when the GIL is held: ``test_gil_check_fails_when_the_gil_is_held``
    runs it with the release threshold raised beyond the payload and sees no stamp."""
    k = kernel_module("codec", "cython")
    inside = _spinner_stamps_inside_calls(lambda: k.encode_activation(4, 1024, 2048, _LARGE, 0))
    assert any(inside), inside


@pytest.mark.skipif(IMPLEMENTATION != "cython", reason="the pure-Python twin never releases the GIL")
def test_gil_check_fails_when_the_gil_is_held():
    """The control of the test above: a build that keeps the GIL (here, the same kernels
    with the release threshold above every payload) gets no stamp inside any call."""
    k = kernel_module("codec", "cython")
    previous = k._set_nogil_threshold(1 << 62)
    try:
        inside = _spinner_stamps_inside_calls(lambda: k.encode_activation(4, 1024, 2048, _LARGE, 0), tries=3)
    finally:
        k._set_nogil_threshold(previous)
    assert inside == [0, 0, 0]


@pytest.mark.skipif(IMPLEMENTATION != "cython", reason="the pure-Python twin never releases the GIL")
@pytest.mark.parametrize("codec", [2, 3])  # F16, BF16
def test_the_error_walk_of_a_large_half_precision_encode_releases_the_gil_too(codec):
    """An F16/BF16 encode whose last value overflows converts every value (with the GIL
    released), then walks the payload twice more to name the error: those walks kept the
    GIL (about 50 ms a 64 MB payload during which no other thread ran).

    The conversion writes ``out`` to its last value; a spinner thread stamps only once it
    sees that value written.  With the switch interval at an hour the spinner runs inside
    the call only where the call releases the GIL, so a stamp before the call returns was
    taken during the error walks.  Held there, none is."""
    k = kernel_module("codec", "cython")
    x = np.random.default_rng(7).standard_normal((4096, 2048), dtype=np.float32)
    x[-1, -1] = np.finfo(np.float32).max  # rounds to infinity in both formats
    out = bytearray(x.size * 2)
    view = memoryview(out)

    def unwritten() -> None:
        view[-2:] = b"\xab\xab"

    def encode() -> None:
        with pytest.raises(InvalidDataError, match="infinity|range"):
            k.encode_activation(codec, 4096, 2048, x, 0, out=out)

    inside = _spinner_stamps_inside_calls(encode, ready=lambda: view[-2:] != b"\xab\xab", before=unwritten)
    assert any(inside), inside


@pytest.mark.skipif(IMPLEMENTATION != "cython", reason="the pure-Python twin never releases the GIL")
@pytest.mark.parametrize("codec, code", [(2, 0x7C00), (3, 0x7F80)])  # F16, BF16: +infinity
def test_an_input_changed_during_a_half_precision_encode_never_returns_an_infinity(codec, code):
    """The conversion pass saw a value out of range and wrote its infinity; another thread
    then wrote a finite value there before the error walks, which re-read the input, found
    nothing and returned the infinity on the wire (a frame every reader refuses).

    The spinner writes the value back to finite once the conversion has written the last
    word (the GIL is released through the walks that follow); with the switch interval at
    an hour it runs only while the encode has released the GIL."""
    k = kernel_module("codec", "cython")
    x = np.random.default_rng(7).standard_normal((4096, 2048), dtype=np.float32)
    x[-1, -1] = np.finfo(np.float32).max  # rounds to infinity in both formats
    out = bytearray(x.size * 2)
    view = memoryview(out)
    view[-2:] = b"\xab\xab"

    def unwrite_once_converted() -> None:
        while view[-2:] == b"\xab\xab":
            time.sleep(0)
        x[-1, -1] = 1.0

    interval = sys.getswitchinterval()
    sys.setswitchinterval(3600.0)
    writer = threading.Thread(target=unwrite_once_converted)
    writer.start()
    try:
        with pytest.raises(InvalidDataError, match="out of range"):
            k.encode_activation(codec, 4096, 2048, x, 0, out=out)
    finally:
        sys.setswitchinterval(interval)
        writer.join()
    assert x[-1, -1] == 1.0 and int.from_bytes(view[-2:], "little") == code  # the race happened as meant
