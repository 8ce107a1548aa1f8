"""Bounded memory: a hostile length field never costs more than the bytes received (or a
documented bound), and stream readers read in bounded pieces, never past the message.

Three measurements:
* tracemalloc peaks (Python objects, bytearrays and numpy buffers) around each read of a
  short hostile prefix, for every reader (buffer, stream, streaming decoder, reply);
* an address-space cap (RLIMIT_AS) in a child process, which also catches a plain
  ``malloc`` in compiled code that tracemalloc cannot see;
* a stream that records every ``read(n)`` request.
"""

from __future__ import annotations

import io
import struct
import subprocess
import sys
import textwrap
import tracemalloc
from pathlib import Path

import pytest

from skippy_wire.wire import frame
from skippy_wire.errors import UnexpectedEofError, WireError

MIB = 1 << 20
#: Peak allocation allowed while failing on a short hostile input.
BOUND = 256 * 1024

# wire-format.md 4.2: kind, pos, token_count, N, P | header (10 x i32) | count, request, session
PREFIX = struct.Struct("<5i10iiQQ")
assert PREFIX.size == 80


def prefix(kind=2, token_count=1, n_tokens=0, n_positions=0, flags=0, source=0, codec=1, count=0):
    return PREFIX.pack(kind, 0, token_count, n_tokens, n_positions,
                       15, 0, 2, flags, 0, 0, -1, -1, source, codec, count, 1, 2)


N_EMBD = 1024
#: Hostile prefixes, each a valid header promising far more than follows.
HOSTILE = {
    # 131072 tokens x 1024 x 4 bytes = exactly 512 MiB of raw f32 activation (the cap).
    "activation-512MiB": prefix(token_count=131072, codec=1, count=512 * MIB),
    # the same, in bf16: 256 MiB on the wire, 512 MiB decoded.
    "activation-bf16-256MiB": prefix(token_count=131072, codec=3, count=256 * MIB),
    # chat metadata of 8 MiB (the cap), driver origin.
    "metadata-8MiB": prefix(flags=0x20, source=-1) + struct.pack("<I", 8 * MIB),
    # 1,048,576 tokens and positions (the cap each).
    "tokens-1M": prefix(token_count=0, n_tokens=1 << 20, source=-1),
    "positions-1M": prefix(token_count=0, n_positions=1 << 20, source=-1),
    # StateImport of 512 MiB raw bytes.
    "state-import-512MiB": prefix(kind=7, token_count=512 * MIB, source=-1),
    # sampling block: 256 logit biases announced, none sent.
    "logit-bias-256": prefix(flags=0x08, source=-1) + struct.pack("<IIffiffffiI", 1, 0, 1.0, 1.0, 0, 0, 0, 0, 1, -1, 256),
}
REPLIES = {
    "reply-262144-tokens": struct.pack("<iii", 3, 0, 262144),
    "reply-262144-draft": struct.pack("<iiiii", 2, 0, 0, 0, 1) + struct.pack("<i", 262144),
}


def _peak(fn) -> int:
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base = tracemalloc.get_traced_memory()[0]
        fn()
        return tracemalloc.get_traced_memory()[1] - base
    finally:
        tracemalloc.stop()


def _expect_eof(fn):
    def run():
        with pytest.raises(UnexpectedEofError):
            fn()
    return run


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_buffer_reader_allocates_nothing_for_hostile_lengths(impl, name):
    data = HOSTILE[name]
    frame.kernels(impl)  # import outside the measurement
    peak = _peak(_expect_eof(lambda: frame.read_stage_message_from_buffer(data, N_EMBD, impl=impl)))
    assert peak < BOUND, f"{name}: {peak} bytes allocated for a {len(data)}-byte input"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_stream_reader_allocates_nothing_for_hostile_lengths(impl, name):
    data = HOSTILE[name]
    frame.kernels(impl)
    peak = _peak(_expect_eof(lambda: frame.read_stage_message(io.BytesIO(data), N_EMBD, impl=impl)))
    assert peak < BOUND, f"{name}: {peak} bytes allocated for a {len(data)}-byte stream"


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_decoder_buffers_only_what_was_fed(impl, name):
    data = HOSTILE[name]
    decoder = frame.StageMessageDecoder(N_EMBD, impl=impl)

    def feed():
        for i in range(0, len(data), 7):  # odd splits
            assert decoder.feed(data[i : i + 7]) == []

    peak = _peak(feed)
    assert peak < BOUND, f"{name}: {peak} bytes allocated"
    assert decoder.buffered == len(data)
    with pytest.raises(UnexpectedEofError):
        decoder.close()


@pytest.mark.parametrize("name", sorted(REPLIES))
def test_reply_readers_allocate_nothing_for_hostile_counts(impl, name):
    data = REPLIES[name]
    frame.kernels(impl)
    for read in (lambda: frame.read_reply(data, impl=impl), lambda: frame.read_reply(io.BytesIO(data), impl=impl)):
        peak = _peak(_expect_eof(read))
        assert peak < BOUND, f"{name}: {peak} bytes allocated"


def test_limits_just_above_caps_fail_before_reading(impl):
    """N + 1 of each cap is an InvalidData error raised from the prefix alone."""
    cases = {
        "activation payload byte count exceeds maximum": prefix(token_count=131072, count=512 * MIB + 1),
        "chat sampling metadata length exceeds maximum": prefix(flags=0x20, source=-1) + struct.pack("<I", 8 * MIB + 1),
        "token sideband count exceeds maximum": prefix(token_count=0, n_tokens=(1 << 20) + 1, source=-1),
        "position sideband count exceeds maximum": prefix(token_count=0, n_positions=(1 << 20) + 1, source=-1),
        "state import byte count exceeds maximum": prefix(kind=7, token_count=512 * MIB + 1, source=-1),
    }
    for text, data in cases.items():
        peak = 0
        with pytest.raises(WireError) as info:
            peak = _peak(lambda: frame.read_stage_message_from_buffer(data, N_EMBD, impl=impl))
        assert str(info.value) == text
        assert peak < BOUND


# --------------------------------------------------------------------------- read sizes


class RecordingStream(io.RawIOBase):
    """A readable stream that records each requested size and hands out at most
    ``max_chunk`` bytes per call (like a socket)."""

    def __init__(self, data: bytes, max_chunk: int | None = None) -> None:
        self.data, self.pos, self.max_chunk = data, 0, max_chunk
        self.requests: list[int] = []

    def readable(self) -> bool:
        return True

    def read(self, n: int = -1) -> bytes:
        self.requests.append(n)
        assert n is not None and n >= 0, "unbounded read()"
        if self.max_chunk is not None:
            n = min(n, self.max_chunk)
        out = self.data[self.pos : self.pos + n]
        self.pos += len(out)
        return out


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_stream_reads_are_bounded(impl, name):
    stream = RecordingStream(HOSTILE[name])
    with pytest.raises(UnexpectedEofError):
        frame.read_stage_message(stream, N_EMBD, impl=impl)
    assert max(stream.requests) <= frame.STREAM_CHUNK_BYTES
    assert sum(r for r in stream.requests) <= len(HOSTILE[name]) + 2 * frame.STREAM_CHUNK_BYTES


def _raw_message(tokens: int, n_embd: int) -> bytes:
    from skippy_wire.wire.messages import StageStateHeader, StageWireMessage, WireMessageKind

    state = StageStateHeader.new(WireMessageKind.PREFILL_EMBD)
    state.source_stage_index = 0
    activation = bytes(range(256)) * (tokens * n_embd * 4 // 256)
    msg = StageWireMessage(WireMessageKind.PREFILL_EMBD, 0, tokens, state, 5, 6, tokens=list(range(tokens)),
                           activation=activation)
    return frame.write_stage_message(msg, impl="python")


@pytest.mark.parametrize("max_chunk", [None, 1000, 65536])
def test_stream_reader_stops_at_message_end(impl, max_chunk):
    """A 3 MiB message is read in bounded pieces and the next message is left unread."""
    first = _raw_message(768, 1024)  # 768 x 1024 x 4 = 3 MiB activation
    second = _raw_message(1, 1024)
    stream = RecordingStream(first + second, max_chunk)
    msg = frame.read_stage_message(stream, 1024, impl=impl)
    assert msg.token_count == 768
    assert stream.pos == len(first), "read past the first message"
    assert max(stream.requests) <= frame.STREAM_CHUNK_BYTES
    again = frame.read_stage_message(stream, 1024, impl=impl)
    assert again.token_count == 1 and stream.pos == len(first) + len(second)


def test_stream_reply_reader_stops_at_reply_end(impl):
    from skippy_wire.wire.replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

    reply = StageReply(WireReplyKind.PREDICTED_TOKENS, 1, list(range(1, 5000)), StageReplyWindow(), None, StageReplyStats())
    data = frame.write_reply(reply, impl="python")
    stream = RecordingStream(data + b"\x01\x00\x00\x00", 333)
    assert frame.read_reply(stream, impl=impl).predicted_tokens == list(range(1, 5000))
    assert stream.pos == len(data)
    assert max(stream.requests) <= frame.STREAM_CHUNK_BYTES


# --------------------------------------------------------------------------- address space


CHILD = textwrap.dedent(
    """
    import io, resource, sys
    sys.path.insert(0, {tests!r})
    import test_limits as t
    from skippy_wire.wire import frame as frame
    from skippy_wire.errors import UnexpectedEofError
    impl = sys.argv[1]
    frame.kernels(impl)
    t._peak(lambda: None)  # warm tracemalloc-free paths
    with open("/proc/self/status") as f:
        vm = next(int(l.split()[1]) * 1024 for l in f if l.startswith("VmSize:"))
    cap = vm + 64 * 1024 * 1024
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    for name, data in sorted(t.HOSTILE.items()):
        for read in (lambda: frame.read_stage_message_from_buffer(data, t.N_EMBD, impl=impl),
                     lambda: frame.read_stage_message(io.BytesIO(data), t.N_EMBD, impl=impl),
                     lambda: frame.StageMessageDecoder(t.N_EMBD, impl=impl).feed(data) and None or
                             frame.StageMessageDecoder(t.N_EMBD, impl=impl).close()):
            try:
                read()
            except UnexpectedEofError:
                pass
    for name, data in sorted(t.REPLIES.items()):
        try:
            frame.read_reply(data, impl=impl)
        except UnexpectedEofError:
            pass
    print("bounded", impl)
    """
)


def test_hostile_lengths_under_address_space_cap(impl):
    """No reader maps more than 64 MiB beyond the process's size for any hostile prefix
    (this catches a plain malloc in compiled code, which tracemalloc does not see)."""
    tests = str(Path(__file__).resolve().parent)
    proc = subprocess.run([sys.executable, "-c", CHILD.format(tests=tests), impl], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == f"bounded {impl}"
