"""The incremental decoder (``StageMessageDecoder``) and stream readers: any split of the
input, many messages per feed, bounded buffering of hostile lengths, kept errors."""

from __future__ import annotations

import io
import struct
import traceback

import numpy as np
import pytest

from skippy_wire.wire import codec, frame
from skippy_wire.wire.protocol import StageConnection, WireProtocol
from skippy_wire.tools.vector_cases import message_to_case
from skippy_wire.wire.constants import ActivationCodec
from skippy_wire.errors import InvalidDataError, InvalidInputError, UnexpectedEofError
from skippy_wire.wire.constants import StateFlags
from skippy_wire.wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind as K
from skippy_wire.wire.replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

BF16 = ActivationCodec.BF16_RNE_V1


def messages() -> list[StageWireMessage]:
    st = StageStateHeader.new(K.DECODE_EMBD)
    st.source_stage_index, st.activation_codec = 0, BF16
    act = codec.encode_activation(BF16, 1, 4, struct.pack("<4f", 1, 2, 3, 4))
    return [
        StageWireMessage(K.DECODE_EMBD, 3, 1, st, 1, 2, SamplingConfig(seed=5), None, [9], [], act),
        StageWireMessage.configure_generation(1, 2, 7, SamplingConfig(samplers=["top_k"]), '{"a":"é"}'),
        StageWireMessage(K.STATE_IMPORT, 0, 3, StageStateHeader.new(K.STATE_IMPORT), 1, 2, raw_bytes=b"xyz"),
        StageWireMessage(K.PREFILL_EMBD, 0, 2, StageStateHeader.new(K.PREFILL_EMBD), 1, 2, tokens=[1, 2], positions=[5, 6]),
        StageWireMessage.stop(1, 2),
    ]


def stream_bytes(impl) -> tuple[bytes, list[dict]]:
    msgs = messages()
    data = b"".join(frame.write_stage_message(m, impl=impl) for m in msgs)
    want = [message_to_case(frame.read_stage_message_from_buffer(frame.write_stage_message(m), 4)[0]) for m in msgs]
    return data, want


def decode_all(decoder, chunks) -> list[dict]:
    out = []
    for chunk in chunks:
        out += [message_to_case(m) for m in decoder.feed(chunk)]
    decoder.close()
    return out


def test_one_byte_at_a_time(impl):
    data, want = stream_bytes(impl)
    decoder = frame.StageMessageDecoder(4, impl=impl)
    got, ends = [], []
    for i in range(len(data)):
        new = decoder.feed(data[i : i + 1])
        if new:
            ends.append(i + 1)
        got += [message_to_case(m) for m in new]
    decoder.close()
    assert got == want
    # each message is delivered by the feed that completes it, not later
    sizes = [len(frame.write_stage_message(m)) for m in messages()]
    assert ends == [sum(sizes[: k + 1]) for k in range(len(sizes))]


def test_every_split_point(impl):
    data, want = stream_bytes(impl)
    for split in range(len(data) + 1):
        decoder = frame.StageMessageDecoder(4, impl=impl)
        assert decode_all(decoder, [data[:split], data[split:]]) == want, split


def test_many_messages_per_feed_and_buffer_types(impl):
    data, want = stream_bytes(impl)
    for wrap in (bytes, bytearray, memoryview):
        decoder = frame.StageMessageDecoder(4, impl=impl)
        assert decode_all(decoder, [wrap(data * 50)]) == want * 50
        assert decoder.buffered == 0


def test_a_chunk_the_decoder_cannot_take_is_refused_before_it_is_counted(impl):
    data, want = stream_bytes(impl)
    strided = memoryview(bytes(2 * len(data)))[::2]  # a flat byte view that is not contiguous
    for head in (b"", data[:10]):  # with and without a pending tail
        decoder = frame.StageMessageDecoder(4, impl=impl)
        decoder.feed(head)
        with pytest.raises(InvalidInputError, match="^data must be a C-contiguous buffer$"):
            decoder.feed(strided)
        with pytest.raises(TypeError, match="^a bytes-like object is required, not 'str'$"):
            decoder.feed("text")
        assert decoder.error is None and decoder.received == decoder.buffered == len(head)
        assert decode_all(decoder, [data[len(head):]]) == want and decoder.ends[-1] == len(data)


def test_iter_stage_messages_over_a_stream(impl):
    data, want = stream_bytes(impl)
    got = [message_to_case(m) for m in frame.iter_stage_messages(io.BytesIO(data * 3), 4, impl=impl)]
    assert got == want * 3
    with pytest.raises(UnexpectedEofError):
        list(frame.iter_stage_messages(io.BytesIO(data[:-1]), 4, impl=impl))
    # its bytes, as read_stage_message takes them (an AttributeError: no .read)
    for given in (data * 2, bytearray(data * 2), memoryview(data * 2)):
        assert [message_to_case(m) for m in frame.iter_stage_messages(given, 4, impl=impl)] == want * 2
    with pytest.raises(UnexpectedEofError):
        list(frame.iter_stage_messages(data[:-1], 4, impl=impl))
    with pytest.raises(TypeError, match="a bytes-like object is required, not 'list'"):
        list(frame.iter_stage_messages([1, 2], 4, impl=impl))


def test_close_with_a_partial_message_is_eof(impl):
    data, _ = stream_bytes(impl)
    decoder = frame.StageMessageDecoder(4, impl=impl)
    decoder.feed(data[:100])
    with pytest.raises(UnexpectedEofError, match="^failed to fill whole buffer$"):
        decoder.close()
    with pytest.raises(UnexpectedEofError):  # and it is kept
        decoder.feed(b"")


def test_fatal_error_is_kept_and_earlier_messages_are_delivered(impl):
    data, want = stream_bytes(impl)
    garbage = struct.pack("<i", 10) + bytes(30)  # legacy kind 10
    decoder = frame.StageMessageDecoder(4, impl=impl)
    got = decoder.feed(data + garbage + data)
    assert [message_to_case(m) for m in got] == want  # messages before the error come first
    assert isinstance(decoder.error, InvalidDataError)
    depths = []
    for _ in range(3):
        with pytest.raises(InvalidDataError, match="^unknown stage message kind$") as caught:
            decoder.feed(data)  # the error is raised by the next feed, and every later one
        depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
    for _ in range(2):
        with pytest.raises(InvalidDataError) as caught:
            decoder.close()
        depths.append(len(traceback.extract_tb(caught.value.__traceback__)))
    assert depths[1] == depths[2] and depths[3] == depths[4]  # a raise again does not lengthen its traceback


def test_ends_give_the_stream_offset_after_each_message(impl):
    data, want = stream_bytes(impl)
    sizes = [len(frame.write_stage_message(m, impl=impl)) for m in messages()]
    offsets = [sum(sizes[: k + 1]) for k in range(len(sizes))]
    decoder = frame.StageMessageDecoder(4, impl=impl)
    # three messages and a bit of the fourth, then the rest: offsets count from the first byte
    cut = offsets[2] + 7
    assert len(decoder.feed(data[:cut])) == 3
    assert decoder.ends == offsets[:3] and decoder.consumed == offsets[2] and decoder.buffered == 7
    assert len(decoder.feed(data[cut:] + data)) == 2 + len(want)
    assert decoder.ends == offsets[3:] + [len(data) + o for o in offsets]
    assert decoder.consumed == decoder.received == 2 * len(data) and decoder.buffered == 0
    assert decoder.feed(b"") == [] and decoder.ends == []


def test_bad_bytes_after_good_messages_keep_the_messages_and_the_offset(impl):
    data, want = stream_bytes(impl)
    garbage = struct.pack("<i", 10) + bytes(30)  # legacy kind 10
    for prefix in (b"", data[:5]):  # no pending tail / a tail from an earlier feed
        decoder = frame.StageMessageDecoder(4, impl=impl)
        decoder.feed(prefix)
        got = decoder.feed(data[len(prefix):] + garbage + data)
        assert [message_to_case(m) for m in got] == want
        assert decoder.consumed == len(data) and decoder.ends[-1] == len(data)
        assert decoder.received == 2 * len(data) + len(garbage)
        assert decoder.buffered == len(garbage) + len(data)  # the bad message on, nothing dropped
        with pytest.raises(InvalidDataError):
            decoder.feed(b"")
        assert decoder.consumed == len(data)


def replies():
    stats = StageReplyStats(*range(1, 28))
    return [
        StageReply(WireReplyKind.ACK, 0, [], StageReplyWindow(), None, StageReplyStats()),
        StageReply(WireReplyKind.PREDICTED_TOKEN, 42, [42], StageReplyWindow(), None, stats),
        StageReply(WireReplyKind.PREDICTED_TOKENS, 7, [7, 8, 9], StageReplyWindow(), None, StageReplyStats()),
    ]


def test_reply_decoder_under_every_split(impl):
    encoded = [frame.write_reply(r, impl=impl) for r in replies()]
    data = b"".join(encoded)
    want = [frame.read_reply(e, impl=impl) for e in encoded]
    offsets = [sum(map(len, encoded[: k + 1])) for k in range(len(encoded))]
    for split in range(len(data) + 1):
        decoder = frame.StageReplyDecoder(impl=impl)
        got, ends = [], []
        for part in (data[:split], data[split:]):
            got += decoder.feed(part)
            ends += decoder.ends
        decoder.close()
        assert got == want and ends == offsets, split
    decoder = frame.StageReplyDecoder(impl=impl)
    assert decoder.feed(data[:-1]) == want[:-1]
    with pytest.raises(UnexpectedEofError):
        decoder.close()


def test_reply_decoder_keeps_good_replies_before_a_bad_one(impl):
    good = frame.write_reply(replies()[1], impl=impl)
    decoder = frame.StageReplyDecoder(impl=impl)
    got = decoder.feed(good + struct.pack("<i", 9) + bytes(40))  # reply kind 9 does not exist
    assert [r.predicted for r in got] == [42] and decoder.consumed == len(good)
    with pytest.raises(InvalidDataError, match="^unknown stage reply kind$"):
        decoder.feed(b"")
    with pytest.raises(InvalidDataError, match="stage reply needs at least"):
        frame.StageReplyDecoder(max_message_bytes=8, impl=impl).feed(struct.pack("<3i", 3, 0, 1000))


def test_reply_stream_reads_stop_at_the_reply(impl):
    encoded = [frame.write_reply(r, impl=impl) for r in replies()]
    reader = SizeRecordingReader(b"".join(encoded) + b"next", most=3)
    for e in encoded:
        assert frame.read_reply(reader, impl=impl) == frame.read_reply(e, impl=impl)
    assert reader.inner.read() == b"next"  # never read past the last reply
    with pytest.raises(UnexpectedEofError):
        frame.read_reply(io.BytesIO(encoded[0][:-1]), impl=impl)


def test_error_without_earlier_messages_is_raised_at_once(impl):
    decoder = frame.StageMessageDecoder(4, impl=impl)
    st = StageStateHeader.new(K.DECODE_EMBD)
    st.version = 14
    bad = frame.write_stage_message(StageWireMessage(K.DECODE_EMBD, state=st))
    with pytest.raises(InvalidDataError, match="^unsupported stage state version$"):
        decoder.feed(bad[:60])  # the version is checked as soon as the header is in
    assert decoder.error is not None


def _prefix(kind, state, tsc=0, count=0, token_count=0):
    return struct.pack("<5i10iiQQ", int(kind), 0, token_count, tsc, 0, state.version, state.seq_id, state.phase,
                       state.flags, state.checkpoint_generation, state.prompt_token_count, state.decode_step,
                       state.current_token, state.source_stage_index, int(state.activation_codec), count, 1, 2)


@pytest.mark.parametrize("hostile,text,stop", [
    ("metadata", "chat sampling metadata length exceeds maximum", 84),
    ("tokens", "token sideband count exceeds maximum", 80),
    ("state_import", "state import byte count exceeds maximum", 80),
    ("activation", "activation payload byte count exceeds maximum", 64),  # checked before the ids (4.5 step 5)
])
def test_hostile_lengths_fail_before_their_payload_is_buffered(impl, hostile, text, stop):
    st = StageStateHeader.new(K.PREFILL_EMBD)
    if hostile == "metadata":
        st.flags = int(StateFlags.CHAT_SAMPLING_METADATA)
        head = _prefix(K.CONFIGURE_GENERATION, st) + struct.pack("<I", 0xFFFFFFFF)
    elif hostile == "tokens":
        head = _prefix(K.PREFILL_EMBD, st, tsc=2**31 - 1)
    elif hostile == "state_import":
        head = _prefix(K.STATE_IMPORT, st, token_count=2**31 - 1)
    else:
        st.source_stage_index = 0
        head = _prefix(K.PREFILL_EMBD, st, count=2**31 - 1)
    decoder = frame.StageMessageDecoder(4, impl=impl)
    fed = 0
    with pytest.raises(InvalidDataError) as info:
        for i in range(len(head)):  # byte by byte: fails on the byte that completes the field
            fed += 1
            decoder.feed(head[i : i + 1])
    assert str(info.value) == text and fed == stop
    # the same through a stream reader: it stops right after the offending header
    stream = io.BytesIO(head + bytes(1000))
    with pytest.raises(InvalidDataError):
        frame.read_stage_message(stream, 4, impl=impl)
    assert stream.tell() == stop


def test_decoder_limit_rejects_a_large_but_legal_message_early(impl):
    st = StageStateHeader.new(K.PREFILL_EMBD)
    st.source_stage_index = 0
    n = 100_000
    head = _prefix(K.PREFILL_EMBD, st, count=4 * n, token_count=1)
    decoder = frame.StageMessageDecoder(n, max_message_bytes=4096, impl=impl)
    with pytest.raises(InvalidDataError, match="over the decoder limit of 4096"):
        decoder.feed(head)
    assert decoder.consumed == 0 and decoder.buffered == len(head)  # only the header arrived
    # without the limit, the decoder waits for the payload
    decoder = frame.StageMessageDecoder(n, impl=impl)
    assert decoder.feed(head) == [] and decoder.buffered == len(head)


def test_decoder_limit_holds_however_the_stream_is_split(impl):
    # a message whole in one chunk, or completed by its last chunk, is refused from its declared
    # size too, with the same text (one chunk was parsed whole first: "stage message is N bytes")
    data = frame.write_stage_message(messages()[-1], impl=impl)
    limit = len(data) - 1
    for split in (len(data), 10, len(data) - 5):
        decoder = frame.StageMessageDecoder(4, max_message_bytes=limit, impl=impl)
        with pytest.raises(InvalidDataError, match=f"^stage message needs at least {len(data)} bytes, over the "
                                                   f"decoder limit of {limit}$"):
            for chunk in (data[:split], data[split:]):
                decoder.feed(chunk)
    assert len(frame.StageMessageDecoder(4, max_message_bytes=len(data), impl=impl).feed(data)) == 1
    reply = frame.write_reply(replies()[-1], impl=impl)
    with pytest.raises(InvalidDataError, match="over the decoder limit of 10$"):
        frame.StageReplyDecoder(max_message_bytes=10, impl=impl).feed(reply)
    with pytest.raises(InvalidInputError, match="max_message_bytes must be >= 0, not -1"):
        frame.StageMessageDecoder(4, max_message_bytes=-1, impl=impl)


class SizeRecordingReader(io.RawIOBase):
    """A stream recording the size asked for by each read; with ``most``, returning at
    most that many bytes per read (``most=3``: a trickling socket)."""

    def __init__(self, data, most=None):
        self.inner = io.BytesIO(data)
        self.most = most
        self.sizes = []

    def read(self, n=-1):
        self.sizes.append(n)
        return self.inner.read(n if self.most is None else min(n, self.most))


def test_stream_reader_handles_short_reads_and_bounds_each_read(impl):
    data, want = stream_bytes(impl)
    reader = SizeRecordingReader(data, most=3)
    got = [message_to_case(frame.read_stage_message(reader, 4, impl=impl)) for _ in want]
    assert got == want and reader.inner.read() == b""
    big = StageWireMessage(K.STATE_IMPORT, 0, 3 << 20, StageStateHeader.new(K.STATE_IMPORT), raw_bytes=bytes(3 << 20))
    reader = SizeRecordingReader(frame.write_stage_message(big, impl=impl))
    assert frame.read_stage_message(reader, 4, impl=impl).raw_bytes == bytes(3 << 20)
    assert max(reader.sizes) <= frame.STREAM_CHUNK_BYTES


def test_stream_reader_never_allocates_from_an_unchecked_length(impl):
    """A StateImport header claiming 512 MiB followed by 10 bytes: the reader asks for at
    most one chunk at a time and fails at EOF having buffered only what arrived."""
    st = StageStateHeader.new(K.STATE_IMPORT)
    reader = SizeRecordingReader(_prefix(K.STATE_IMPORT, st, token_count=512 << 20) + bytes(10))
    with pytest.raises(UnexpectedEofError):
        frame.read_stage_message(reader, 4, impl=impl)
    assert max(reader.sizes) <= frame.STREAM_CHUNK_BYTES


from hypothesis import HealthCheck, given, settings, strategies as st  # noqa: E402

from skippy_wire.errors import WireError  # noqa: E402


def sequential(impl, data: bytes, n_embd: int):
    """Reference behaviour: read messages back to back from the whole buffer."""
    out, pos = [], 0
    while pos < len(data):
        try:
            msg, used = frame.read_stage_message_from_buffer(data, n_embd, offset=pos, impl=impl)
        except WireError as exc:
            return out, (type(exc), str(exc))
        out.append(message_to_case(msg))
        pos += used
    return out, None


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture])  # `impl` is a plain name
@given(picks=st.lists(st.integers(0, 4), max_size=6), noise=st.binary(max_size=40),
       cuts=st.lists(st.integers(0, 2000), max_size=8), n_embd=st.sampled_from([4, 2, 0]))
def test_decoder_agrees_with_sequential_reads_under_any_split(impl, picks, noise, cuts, n_embd):
    pool = messages()
    data = b"".join(frame.write_stage_message(pool[i], impl=impl) for i in picks) + noise
    want, want_error = sequential(impl, data, n_embd)
    decoder = frame.StageMessageDecoder(n_embd, impl=impl)
    got, error = [], None
    bounds = sorted({0, len(data), *[c % (len(data) + 1) for c in cuts]})
    try:
        for a, b in zip(bounds, bounds[1:]):
            got += [message_to_case(m) for m in decoder.feed(data[a:b])]
        decoder.close()
    except WireError as exc:
        error = (type(exc), str(exc))
    assert got == want
    assert error == want_error


def test_both_incremental_decoders_are_in_the_public_api():
    import skippy_wire as sw
    from skippy_wire.wire import frame

    assert sw.StageMessageDecoder is frame.StageMessageDecoder and sw.StageReplyDecoder is frame.StageReplyDecoder


def test_reader_arguments_are_checked_alike_in_every_version(impl):
    data = frame.write_stage_message(messages()[0], impl=impl)
    for codec, policy, error, text in ((9, None, InvalidDataError, "^unknown stage activation codec$"),
                                       (None, 7, InvalidDataError, "^unknown stage activation codec policy$"),
                                       ("bf16", None, TypeError, "^codec must be an int, not str$"),
                                       (None, 1.0, TypeError, "^policy must be an int, not float$")):
        with pytest.raises(error, match=text):
            frame.read_stage_message_from_buffer(data, 4, codec, policy, impl=impl)
        with pytest.raises(error, match=text):
            WireProtocol(16, impl=impl).read_from_buffer(data, codec=codec, policy=policy)
    with pytest.raises(TypeError, match="n_embd must be an int, not float"):
        WireProtocol(15, impl=impl).read_from_buffer(data, 4.0)
    with pytest.raises(TypeError, match="n_embd must be an int, not bool"):  # True read as a width of 1
        WireProtocol(15, impl=impl).read_from_buffer(data, True)
    with pytest.raises(TypeError, match="offset must be an int, not str"):
        WireProtocol(17, impl=impl).read_from_buffer(data, offset="0")
    for version in (16, 17):
        with pytest.raises(TypeError, match="expects a StageWireMessage, not NoneType"):
            WireProtocol(version, impl=impl).write(None)
    for version in (16.0, True, np.float64(16)):
        with pytest.raises(ValueError, match="unknown stage protocol version"):
            WireProtocol(version)
    # numpy's integers are integers, as everywhere else (np.int64(16) was "unknown")
    for version in (np.int64(16), np.uint8(17), np.int32(15)):
        assert type(WireProtocol(version).version) is int and WireProtocol(version).version == version
        assert StageConnection(io.BytesIO(), version).protocol.version == version


def test_an_offset_outside_the_buffer_is_named_however_far_out(impl):
    data = frame.write_stage_message(messages()[0], impl=impl)
    ack = StageReply(WireReplyKind.ACK, 0, [], StageReplyWindow(), None, StageReplyStats())
    reply = frame.write_reply(ack, impl=impl)
    readers = (lambda offset: frame.read_stage_message_from_buffer(data, 4, offset=offset, impl=impl),
               lambda offset: frame.read_reply_from_buffer(reply, offset=offset, impl=impl),
               *(lambda offset, v=version: WireProtocol(v, impl=impl).read_from_buffer(data, offset=offset)
                 for version in (15, 16, 17)))
    for read in readers:
        for offset in (len(data) + len(reply) + 1, -1, 2**63, -2**63 - 1, 10**30):  # past a C index too
            with pytest.raises(ValueError, match="^offset outside the buffer$"):
                read(offset)


def test_a_reader_refuses_what_it_cannot_read_alike_in_both_implementations(impl):
    import numpy as np

    strided = np.zeros(400, np.uint8)[::2]
    readers = (lambda d: frame.read_stage_message_from_buffer(d, 4, impl=impl),
               lambda d: frame.read_reply_from_buffer(d, impl=impl), lambda d: frame.read_reply(d, impl=impl),
               lambda d: WireProtocol(16, impl=impl).read_from_buffer(d), lambda d: WireProtocol(17, impl=impl).read(d))
    for read in readers:
        with pytest.raises(InvalidInputError, match="^data must be a C-contiguous buffer$"):
            read(strided)
        for data, name in ((None, "NoneType"), ("abc", "str")):
            with pytest.raises(TypeError, match=f"^a bytes-like object is required, not '{name}'$"):
                read(data)


@pytest.mark.parametrize("version", [15, 16, 17])
def test_a_lone_surrogate_in_a_message_names_its_field(impl, version):
    msg = StageWireMessage(K.CONFIGURE_GENERATION, 0, 0, StageStateHeader.new(K.CONFIGURE_GENERATION), 1, 1)
    msg.sampling = SamplingConfig(flags=1, samplers=["\ud800"])
    with pytest.raises(InvalidInputError, match=r"^sampling.samplers entry '\\ud800' is not UTF-8 text"):
        WireProtocol(version, impl=impl).write(msg)
    msg.sampling, msg.chat_sampling_metadata = None, "x\udc00"
    with pytest.raises(InvalidInputError, match="^chat_sampling_metadata is not UTF-8 text"):
        WireProtocol(version, impl=impl).write(msg)
