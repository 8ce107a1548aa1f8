"""Property fuzzing of the readers: random bytes and mutated golden frames never crash,
raise only ``WireError`` subclasses, and the compiled and reference readers agree on every
input (same message and ``consumed``, or the same error class and exact text).

The same targets drive the atheris harness (fuzz/fuzz_wire.py, fuzz/wire_targets.py).
Budget: the ``HYPOTHESIS_PROFILE`` profiles of conftest.py.
"""

from __future__ import annotations

import io
import json
import struct
import sys
from functools import lru_cache
from pathlib import Path

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from skippy_wire.wire import frame
from skippy_wire.errors import UnexpectedEofError, WireError

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import wire_targets  # noqa: E402

from conftest import IMPLS, VECTORS  # noqa: E402


@lru_cache(maxsize=None)
def targets() -> wire_targets.Targets:
    t = wire_targets.Targets()
    if "cython" not in IMPLS:
        t.codec_c = t.frame_c = None  # SKIPPY_WIRE_IMPL=python: the twin alone
    elif t.frame_c is None or t.codec_c is None:
        pytest.fail("the compiled extensions are not built (set SKIPPY_WIRE_IMPL=python to skip them)")
    return t


@lru_cache(maxsize=None)
def golden_frames() -> tuple:
    """(bytes, n_embd, codec id) of every frame the upstream writer produced."""
    out = []
    # A missing vector file is an error (FileNotFoundError), never an empty corpus.
    for line in (VECTORS / "frame.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["write"]["ok"]:
            out.append((bytes.fromhex(case["write"]["hex"]), case["n_embd"], case["message"]["state"]["activation_codec_id"]))
    for line in (VECTORS / "malformed.jsonl").read_text().splitlines():
        case = json.loads(line)
        out.append((bytes.fromhex(case["bytes_hex"]), case["n_embd"], None))
    return tuple(out)


N_EMBD = st.sampled_from(wire_targets.N_EMBD) | st.integers(-3, 16)
EXPECTED = st.sampled_from(wire_targets.EXPECTED)
INTERESTING_I32 = [-1, 0, 1, 2**31 - 1, -(2**31), 1048576, 1048577, 536870912, 536870913, 8388608, 8388609, 256, 257, 15]


def read_both(data, n_embd, expected=None, policy=0):
    t = targets()
    return wire_targets.differential(t.frame_c, t.frame_r, "read_stage_message_from_buffer", data, n_embd, expected,
                                     policy if expected is not None else 0, limit=len(data))


@given(st.binary(max_size=400), N_EMBD, EXPECTED, st.integers(0, 1))
def test_random_bytes_stage_reader(data, n_embd, expected, policy):
    read_both(data, n_embd, expected, policy)


@given(st.binary(max_size=40).map(lambda b: struct.pack("<5i", 2, 0, 1, 0, 0) + struct.pack("<i", 15) + b), N_EMBD)
def test_random_bytes_after_a_plausible_start(data, n_embd):
    read_both(data, n_embd)


@given(st.binary(max_size=600))
def test_random_bytes_reply_reader(data):
    t = targets()
    wire_targets.differential(t.frame_c, t.frame_r, "read_reply_from_buffer", data, limit=len(data))


@given(st.binary(max_size=8))
def test_random_bytes_recv_ready(data):
    try:
        frame.recv_ready(data)
    except WireError:
        return
    assert data[:4] == b"YDRS"


@st.composite
def mutated_frame(draw):
    frames = golden_frames()
    assume(frames)
    data, n_embd, codec = draw(st.sampled_from(frames))
    data = bytearray(data)
    for _ in range(draw(st.integers(1, 4))):
        op = draw(st.sampled_from(["flip", "i32", "truncate", "insert", "delete", "append"]))
        if op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif op == "i32" and len(data) >= 4:
            i = draw(st.integers(0, min(len(data), 400) // 4 - 1)) * 4
            data[i : i + 4] = struct.pack("<i", draw(st.sampled_from(INTERESTING_I32)))
        elif op == "truncate":
            del data[draw(st.integers(0, len(data))) :]
        elif op == "insert":
            i = draw(st.integers(0, len(data)))
            data[i:i] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete" and data:
            i = draw(st.integers(0, len(data) - 1))
            del data[i : i + draw(st.integers(1, 8))]
        else:
            data += draw(st.binary(min_size=1, max_size=8))
    return bytes(data), draw(st.sampled_from([n_embd, n_embd, 1, 4])), draw(st.sampled_from([None, codec]))


@given(mutated_frame(), st.integers(0, 1))
def test_mutated_golden_frames(case, policy):
    data, n_embd, expected = case
    read_both(data, n_embd, expected, policy)


@given(mutated_frame())
def test_mutated_frames_round_trip_through_the_writer(case):
    data, n_embd, _ = case
    sel = wire_targets.N_EMBD.index(n_embd) if n_embd in wire_targets.N_EMBD else None
    assume(sel is not None)
    targets().frame_roundtrip(sel, data)


@given(st.lists(st.sampled_from(range(64)), min_size=1, max_size=3), st.lists(st.integers(1, 97), min_size=1, max_size=20), st.sampled_from(IMPLS))
def test_decoder_any_split_equals_buffer_reads(picks, splits, impl):
    """Several valid frames fed in arbitrary pieces give the buffer reader's messages."""
    frames = [f for f in golden_frames() if f[2] is not None]
    assume(frames)
    chosen = [frames[p % len(frames)] for p in picks]
    n_embd = chosen[0][1]
    chosen = [c for c in chosen if c[1] == n_embd]
    stream = b"".join(c[0] for c in chosen)
    expected, pos = [], 0
    error = None
    while pos < len(stream):
        try:
            msg, used = frame.read_stage_message_from_buffer(stream, n_embd, offset=pos, impl=impl)
        except WireError as exc:
            error = exc
            break
        expected.append(wire_targets.canon(msg))
        pos += used
    decoder = frame.StageMessageDecoder(n_embd, impl=impl)
    got, i, k = [], 0, 0
    raised = None
    try:
        while i < len(stream):
            step = splits[k % len(splits)]
            got += [wire_targets.canon(m) for m in decoder.feed(stream[i : i + step])]
            i, k = i + step, k + 1
        decoder.close()
    except WireError as exc:
        raised = exc
    assert got == expected[: len(got)]
    if error is None:
        assert raised is None and got == expected
    else:
        # A reader error (e.g. "activationless ... payload" or a Stop with trailing body
        # bytes that then parse as garbage) is kept and raised, with the same class/text.
        assert raised is not None and (type(raised), str(raised)) == (type(error), str(error))


@given(st.binary(max_size=300), N_EMBD, st.sampled_from(IMPLS))
def test_stream_reader_agrees_with_buffer_reader(data, n_embd, impl):
    try:
        want = ("ok", wire_targets.canon(frame.read_stage_message(data, n_embd, impl=impl)))
    except WireError as exc:
        want = ("err", type(exc).__name__, str(exc))
    try:
        got = ("ok", wire_targets.canon(frame.read_stage_message(io.BytesIO(data), n_embd, impl=impl)))
    except WireError as exc:
        got = ("err", type(exc).__name__, str(exc))
    assert got == want


def _reads(data: bytes, n_embd: int, impl: str) -> bool:
    try:
        frame.read_stage_message_from_buffer(data, n_embd, impl=impl)
    except WireError:
        return False
    return True


@pytest.mark.parametrize("case", range(0, 10))
def test_truncations_raise_eof_with_consistent_needed(case, impl):
    """Every prefix of a valid frame is UnexpectedEof, and ``needed`` (when given) points
    past the bytes present."""
    frames = [f for f in golden_frames() if f[2] is not None and _reads(f[0], f[1], impl)]
    assert frames, "no readable golden frames: are the vectors in place?"
    data, n_embd, codec = frames[(case * 37) % len(frames)]
    _, used = frame.read_stage_message_from_buffer(data, n_embd, impl=impl)
    for cut in range(used):
        with pytest.raises(UnexpectedEofError) as info:
            frame.read_stage_message_from_buffer(data[:cut], n_embd, impl=impl)
        wire_targets.assert_no_unexpected_eof_needed(info.value, cut)


# --------------------------------------------------------------------------- regressions
# Inputs found by fuzz/fuzz_wire.py, kept as plain tests.


@pytest.mark.parametrize("flags", [0x1A345C40, 0x200, 0x004, -(2**31), -1 & ~0x28])
def test_writer_carries_unknown_state_flag_bits(impl, flags):
    """wire-format.md 2.4: bits other than SAMPLING/CHAT_SAMPLING_METADATA are carried
    through untouched (fuzz_wire finding "roundtrip changed .state.flags")."""
    from skippy_wire.wire.messages import StageWireMessage

    msg = StageWireMessage.stop(7, 9)
    msg.state.flags = flags
    data = frame.write_stage_message(msg, impl=impl)
    assert struct.unpack_from("<i", data, 32)[0] == flags & ~0x28
    again = frame.read_stage_message(data, 4, impl=impl)
    assert again.state.flags == flags & ~0x28


def test_stream_reader_survives_a_retry(impl):
    """The stream reader re-parses after each short read; the buffer it grows must not
    still be exported by the failed parse (BufferError: Existing exports of data)."""
    from skippy_wire.wire.messages import StageWireMessage

    data = frame.write_stage_message(StageWireMessage.stop(1, 2), impl="python")
    assert frame.read_stage_message(io.BytesIO(data), 4, impl=impl).request_id == 1
    decoder = frame.StageMessageDecoder(4, impl=impl)
    assert decoder.feed(data[:10]) == []
    assert [m.session_id for m in decoder.feed(data[10:])] == [2]


@pytest.mark.parametrize("fault", ["unknown kind", "over the limit"])
@pytest.mark.parametrize("as_view", [False, True])
def test_a_failed_decoder_leaves_the_callers_buffer_resizable(impl, fault, as_view):
    """A caller that reuses one bytearray for what it receives clears it after a decode
    error; the error the decoder keeps (and raises again) must hold no view of it."""
    from skippy_wire.wire.messages import StageWireMessage

    buf = bytearray(frame.write_stage_message(StageWireMessage.stop(1, 2), impl="python"))
    if fault == "unknown kind":
        buf[0:4] = (999).to_bytes(4, "little")
    decoder = frame.StageMessageDecoder(4, impl=impl, max_message_bytes=8 if fault == "over the limit" else None)
    with pytest.raises(WireError) as first:
        decoder.feed(memoryview(buf) if as_view else buf)
    buf.clear()  # BufferError while a view of it is alive
    buf += b"\0" * 64
    with pytest.raises(WireError) as again:
        decoder.feed(b"\0")
    assert str(again.value) == str(first.value)


@pytest.mark.parametrize("mode", ["bogus", "Compiled"])
def test_a_misspelt_fuzz_mode_is_refused(mode):
    """It ran the reference alone under a banner that said "compiled vs reference"."""
    import os
    import subprocess

    done = subprocess.run([sys.executable, "-c", "import wire_targets"], cwd=Path(wire_targets.__file__).parent,
                          env={**os.environ, "FUZZ_MODE": mode}, capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == f"fuzz: FUZZ_MODE={mode!r} is none of differential, compiled, reference\n"


def test_the_harness_corpus_is_seeded_from_the_vendored_vectors(monkeypatch):
    """The seeds came from ../shared/vectors/public: without it beside the checkout every
    frame and malformed vector was skipped in silence (8 seeds, no frame among them)."""
    monkeypatch.delenv("SKIPPY_WIRE_VECTORS", raising=False)
    assert wire_targets.vectors_dir() == Path(__file__).resolve().parent / "golden" / "v15"
    frame_seeds = [s for s in wire_targets.seed_inputs() if s[0] == wire_targets.Targets.TARGETS.index(
        wire_targets.Targets.frame_read)]
    cases = (wire_targets.vectors_dir() / "frame.jsonl").read_text().splitlines()
    assert len(frame_seeds) >= len(cases) // 2
