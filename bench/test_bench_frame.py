"""Framing benchmarks (pytest-benchmark): write, read and round trip of the issue #3
message (1 x 4096 BF16 DecodeEmbd with a sampling block), and the streaming decoder, on
both implementations.  Run: ``pytest bench/test_bench_frame.py``."""

from __future__ import annotations

import pytest

from skippy_wire._impl import kernel_module
from skippy_wire.tools.vector_cases import message_to_case
from skippy_wire.wire.frame import StageMessageDecoder
from skippy_wire.tools.frame_bench import N_EMBD, decode_message

IMPLS = ["cython", "python"]
BF16 = 3


@pytest.fixture(scope="module")
def message():
    return decode_message(N_EMBD)


@pytest.fixture(params=IMPLS)
def kernels(request):
    return request.param, kernel_module("frame", request.param)


def _expected(message):
    ref = kernel_module("frame", "python")
    return message_to_case(ref.read_stage_message_from_buffer(ref.write_stage_message(message), N_EMBD, BF16, 0, 0)[0])


def _record(benchmark, correct: bool, **info) -> None:
    """``info`` and ``correct`` (the result matched the reference twin's) in the report; a
    wrong result fails the benchmark, as the codec benchmarks' do."""
    benchmark.extra_info.update(correct=correct, **info)
    assert correct, f"{info['impl']} result differs from the reference twin's"


def test_bench_write(benchmark, kernels, message):
    """Serialize the message to bytes."""
    impl, k = kernels
    benchmark.group = "frame write"
    data = benchmark(k.write_stage_message, message)
    _record(benchmark, data == kernel_module("frame", "python").write_stage_message(message), impl=impl,
            nbytes=len(data))


def test_bench_read(benchmark, kernels, message):
    """Parse and decode the message from bytes."""
    impl, k = kernels
    benchmark.group = "frame read"
    data = k.write_stage_message(message)
    got, consumed = benchmark(k.read_stage_message_from_buffer, data, N_EMBD, BF16, 0, 0)
    _record(benchmark, message_to_case(got) == _expected(message), impl=impl, nbytes=len(data))


def test_bench_round_trip(benchmark, kernels, message):
    """Write then read (issue #3 goal: >= 150,000/s and >= 10x the twin)."""
    impl, k = kernels
    benchmark.group = "frame write+read round trip"
    write, read = k.write_stage_message, k.read_stage_message_from_buffer
    got, consumed = benchmark(lambda: read(write(message), N_EMBD, BF16, 0, 0))
    _record(benchmark, message_to_case(got) == _expected(message), impl=impl, nbytes=consumed)


def test_bench_streaming_decoder(benchmark, kernels, message):
    """Feed 64 back-to-back messages in one chunk to a fresh decoder."""
    impl, k = kernels
    benchmark.group = "frame streaming decoder (64 messages)"
    stream = k.write_stage_message(message) * 64

    def run():
        return StageMessageDecoder(N_EMBD, BF16, impl=impl).feed(stream)

    got = benchmark(run)
    _record(benchmark, len(got) == 64 and message_to_case(got[-1]) == _expected(message), impl=impl,
            nbytes=len(stream), messages=len(got))
