"""Reference stage-message framing: the spec in plain Python (``struct``, one field at a time).

The twin of ``skippy_wire.wire._frame``; both expose the same kernel functions:

* ``write_stage_message(msg) -> bytes``
* ``read_stage_message_from_buffer(data, n_embd, expected_codec, policy, offset=0)
  -> (msg, consumed)``
* ``write_reply(reply) -> bytes``
* ``read_reply_from_buffer(data, offset=0) -> (reply, consumed)``

Readers walk the buffer in the exact upstream order (wire-format.md 4.5 / 11.2); running
out of bytes raises :class:`UnexpectedEofError` whose ``needed`` attribute is the number of
bytes (from ``offset``) the walk needed at that point, so that a stream reader or the
incremental decoder can wait for exactly that many.  A failing writer attaches the bytes
upstream would already have emitted as ``partial`` on the exception.
"""

from __future__ import annotations

import struct
import sys

from ...errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError
from ..constants import (
    I32_MAX,
    I32_MIN,
    MAX_STAGE_ACTIVATION_BYTES,
    MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES,
    MAX_STAGE_DECODED_ACTIVATION_BYTES,
    MAX_STAGE_DRY_SEQUENCE_BREAKERS,
    MAX_STAGE_LOGIT_BIAS,
    MAX_STAGE_PREDICTED_TOKENS,
    MAX_STAGE_SAMPLERS,
    MAX_STAGE_SAMPLING_STRING_BYTES,
    MAX_STAGE_SIDEBAND_VALUES,
    MAX_STAGE_STATE_IMPORT_BYTES,
    STAGE_REPLY_STATS_COUNT,
    STAGE_STATE_VERSION,
    ActivationCodec,
    CodecPolicy,
    StateFlags,
)
from ..messages import (
    ACTIVATIONLESS_READ_KINDS,
    ACTIVATIONLESS_WRITE_KINDS,
    SAMPLING_WIRE_ORDER,
    LogitBias,
    SamplingConfig,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind,
    f32_bits,
    f32_from_bits,
)
from ..field_checks import (NOT_INT_LISTS, byte_array, check_admission, flat_bytes, out_of_range_error, wire_bool,
                            wire_f32, wire_int)
from ..replies import (
    NativeMtpDraft,
    StageReply,
    StageReplyStats,
    StageReplyWindow,
    WireReplyKind,
    reply_out_of_range_error,
)
from . import codec as _codec

_SSIZE_MAX = sys.maxsize

_i32 = struct.Struct("<i")
_u32 = struct.Struct("<I")
_i64 = struct.Struct("<q")
_u64 = struct.Struct("<Q")
_stats = struct.Struct(f"<{STAGE_REPLY_STATS_COUNT}q")

_KINDS = {k.value: k for k in WireMessageKind}
_REPLY_KINDS = {k.value: k for k in WireReplyKind}
_CODECS = {c.value: c for c in ActivationCodec}


# --- reading -----------------------------------------------------------------------------
def _eof(needed: int) -> UnexpectedEofError:
    error = UnexpectedEofError()
    error.needed = needed
    return error


class Cursor:
    """Bounds-checked little-endian reads over a byte view; never reads past ``end``."""

    __slots__ = ("buf", "pos", "start", "end")

    def __init__(self, data, offset: int) -> None:
        # The compiled twin's argument conversions: an offset beyond a C ssize_t, and a
        # buffer that is not C-contiguous (PyBUF_SIMPLE), fail as they do there.
        if not -_SSIZE_MAX - 1 <= offset <= _SSIZE_MAX:
            raise OverflowError("Python int too large to convert to C ssize_t")
        view = memoryview(data)
        if not view.c_contiguous:
            raise BufferError("memoryview: underlying buffer is not C-contiguous")
        self.buf = flat_bytes(view) if not isinstance(data, (bytes, bytearray)) else view
        self.start = self.pos = offset
        self.end = len(self.buf)
        if offset < 0 or offset > self.end:
            raise ValueError("offset outside the buffer")

    def need(self, n: int) -> None:
        # A length is checked against the bytes actually present before anything is sliced
        # or allocated from it (STYLE: check before allocation).
        if n > self.end - self.pos:
            # (no local name for the exception: a frame -> exception -> traceback cycle
            # would keep this cursor's view of the caller's bytearray exported)
            raise _eof(self.pos - self.start + n)

    def take(self, n: int) -> memoryview:
        self.need(n)
        view = self.buf[self.pos : self.pos + n]
        self.pos += n
        return view

    def _read(self, code: struct.Struct) -> int:
        self.need(code.size)
        v = code.unpack_from(self.buf, self.pos)[0]
        self.pos += code.size
        return v

    def i32(self) -> int:
        return self._read(_i32)

    def u32(self) -> int:
        return self._read(_u32)

    def i64(self) -> int:
        return self._read(_i64)

    def u64(self) -> int:
        return self._read(_u64)

    def i32_list(self, n: int) -> list:
        return list(self.unpack(f"<{n}i"))

    def unpack(self, fmt: str) -> tuple:
        size = struct.calcsize(fmt)
        self.need(size)
        values = struct.unpack_from(fmt, self.buf, self.pos)
        self.pos += size
        return values


def _read_string_list(cur: Cursor, maximum: int) -> list:
    count = cur.u32()
    if count > maximum:
        raise InvalidDataError("sampling string count exceeds maximum")
    values = []
    for _ in range(count):
        length = cur.u32()
        if length > MAX_STAGE_SAMPLING_STRING_BYTES:
            raise InvalidDataError("sampling string exceeds maximum length")
        raw = cur.take(length)
        try:
            values.append(str(raw, "utf-8"))
        except UnicodeDecodeError:
            raise InvalidDataError("sampling string is not UTF-8") from None
    return values


def read_sampling(cur: Cursor) -> SamplingConfig:
    """Section 4.3, reader rules, fields in wire order."""
    values = {}
    for name, code in SAMPLING_WIRE_ORDER:
        if code == "I":
            values[name] = cur.u32()
        elif code == "i":
            values[name] = cur.i32()
        elif code == "f":
            values[name] = f32_from_bits(cur.u32())
        elif code == "L":
            count = cur.u32()
            if count > MAX_STAGE_LOGIT_BIAS:
                raise InvalidDataError("logit bias count exceeds maximum")
            cur.need(8 * count)  # entries carry no checks: wait for all of them at once
            biases = []
            for _ in range(count):
                token = cur.i32()
                biases.append(LogitBias(token, f32_from_bits(cur.u32())))
            values[name] = biases
        elif code == "S":
            limit = MAX_STAGE_DRY_SEQUENCE_BREAKERS if name == "dry_sequence_breakers" else MAX_STAGE_SAMPLERS
            values[name] = _read_string_list(cur, limit)
        else:  # ignore_eos: any non-zero u32 is true
            values[name] = cur.u32() != 0
    return SamplingConfig(**values)


def check_sideband_counts(token_count: int, token_sidebands: int, position_sidebands: int) -> None:
    """Steps 11-12: the counts before the token and position sidebands are read."""
    if token_count < 0 or token_sidebands < 0 or position_sidebands < 0:
        raise InvalidDataError("negative wire count")
    if token_sidebands > MAX_STAGE_SIDEBAND_VALUES:
        raise InvalidDataError("token sideband count exceeds maximum")
    if position_sidebands > MAX_STAGE_SIDEBAND_VALUES:
        raise InvalidDataError("position sideband count exceeds maximum")


def read_stage_message_from_buffer(data, n_embd: int, expected_codec=None, policy: int = 0, offset: int = 0):
    """Parse one stage message starting at ``offset``; returns ``(message, consumed)``.

    ``expected_codec`` None accepts every codec (``read_stage_message``); otherwise the wire
    codec must satisfy ``policy.permits(expected_codec, wire_codec)`` (section 8.3).
    """
    if not (I32_MIN <= n_embd <= I32_MAX):
        raise InvalidInputError("n_embd does not fit in i32")
    check_admission(expected_codec, policy)
    cur = Cursor(data, offset)
    # 1. kind
    kind = _KINDS.get(cur.i32())
    if kind is None:
        raise InvalidDataError("unknown stage message kind")
    # 2. counts, validated later (steps 11-12).  Nothing is checked between here and the
    # codec id, so the walk waits for those 56 bytes at once (this only shapes ``needed``).
    cur.need(56)
    pos_start = cur.i32()
    token_count = cur.i32()
    token_sideband_count = cur.i32()
    position_sideband_count = cur.i32()
    # 3. the state header; the codec id is parsed before the version is checked (3.1)
    fields = [cur.i32() for _ in range(9)]
    codec = _CODECS.get(cur.i32())
    if codec is None:
        raise InvalidDataError("unknown stage activation codec")
    state = StageStateHeader(*fields, codec)
    # 4.
    if state.version != STAGE_STATE_VERSION:
        raise InvalidDataError("unsupported stage state version")
    # 5.
    wire_count = cur.i32()
    if wire_count < 0:
        raise InvalidDataError("negative activation payload byte count")
    if wire_count > MAX_STAGE_ACTIVATION_BYTES:
        raise InvalidDataError("activation payload byte count exceeds maximum")
    # 6.
    cur.need(16)
    request_id = cur.u64()
    session_id = cur.u64()
    # 7. activation admission, before any variable-length part is read
    flags = state.flags
    expected_bytes = 0
    has_activation = not (kind in ACTIVATIONLESS_READ_KINDS or state.source_stage_index < 0)
    if not has_activation:
        if wire_count != 0:
            raise InvalidDataError("activationless stage message contains activation payload")
    else:
        if expected_codec is not None and not CodecPolicy(policy).permits(ActivationCodec(expected_codec), codec):
            raise InvalidDataError("stage activation codec mismatch")
        expected_bytes = _codec.activation_wire_bytes(int(codec), token_count, n_embd, flags)
        if wire_count != expected_bytes:
            raise InvalidDataError("activation payload size mismatch")
        if _codec.activation_f32_bytes(token_count, n_embd, flags) > MAX_STAGE_DECODED_ACTIVATION_BYTES:
            raise InvalidDataError("decoded activation payload byte count exceeds maximum")
    # 8.
    sampling = read_sampling(cur) if flags & StateFlags.SAMPLING else None
    # 9.
    metadata = None
    if flags & StateFlags.CHAT_SAMPLING_METADATA:
        length = cur.u32()
        if length > MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES:
            raise InvalidDataError("chat sampling metadata length exceeds maximum")
        raw = cur.take(length)
        try:
            metadata = str(raw, "utf-8")
        except UnicodeDecodeError:
            raise InvalidDataError("chat sampling metadata is not UTF-8") from None
    message = StageWireMessage(kind, pos_start, token_count, state, request_id, session_id, sampling, metadata)
    # 10. Stop ends after the metadata; its counts are neither validated nor consumed.
    if kind is WireMessageKind.STOP:
        return message, cur.pos - cur.start
    # 11.-12.
    check_sideband_counts(token_count, token_sideband_count, position_sideband_count)
    # 13. StateImport: token_count raw bytes; the token/position values are not on the wire.
    if kind is WireMessageKind.STATE_IMPORT:
        if token_count > MAX_STAGE_STATE_IMPORT_BYTES:
            raise InvalidDataError("state import byte count exceeds maximum")
        message.raw_bytes = bytes(cur.take(token_count))
        return message, cur.pos - cur.start
    # Nothing between here and the end can fail except a short read, so wait for the whole
    # body at once (a stream reader then needs one more read, not three).
    cur.need(4 * token_sideband_count + 4 * position_sideband_count + expected_bytes)
    # 14.
    message.tokens = cur.i32_list(token_sideband_count)
    message.positions = cur.i32_list(position_sideband_count)
    # 15. decode to little-endian f32 (the one copy of the payload)
    if expected_bytes:
        values = _codec.decode_activation(int(codec), token_count, n_embd, cur.take(expected_bytes), flags)
        message.activation = _readonly_bytes_view(values)
    return message, cur.pos - cur.start


def _readonly_bytes_view(values):
    values.flags.writeable = False
    return memoryview(values).cast("B")


# --- writing -----------------------------------------------------------------------------
def _write(write, value, out_of_range) -> bytes:
    """``write(out, value)`` into a new buffer: a wire error carries the partial output."""
    out = bytearray()
    try:
        write(out, value)
    except WireError as error:
        error.partial = bytes(out)
        raise error
    except (struct.error, OverflowError, TypeError, ValueError, AttributeError):
        # A value the wire cannot represent; no partial output is defined for it.
        raise out_of_range(value) from None
    return bytes(out)


def _write_string_list(out: bytearray, values, maximum: int) -> None:
    values = list(values)[:maximum]
    out += _u32.pack(len(values))
    for value in values:
        raw = value.encode("utf-8")
        if len(raw) > MAX_STAGE_SAMPLING_STRING_BYTES:
            # InvalidData even on the writer side (section 4.3).
            raise InvalidDataError("sampling string exceeds maximum length")
        out += _u32.pack(len(raw))
        out += raw


def _write_sampling(out: bytearray, s: SamplingConfig) -> None:
    for name, code in SAMPLING_WIRE_ORDER:
        value = getattr(s, name)
        if code == "I":
            out += _u32.pack(wire_int(value))
        elif code == "i":
            out += _i32.pack(wire_int(value))
        elif code == "f":
            out += _u32.pack(f32_bits(wire_f32(value)))
        elif code == "L":
            biases = list(value)[:MAX_STAGE_LOGIT_BIAS]  # silently truncated (4.3)
            out += _u32.pack(len(biases))
            for pair in biases:
                if isinstance(pair, NOT_INT_LISTS):  # b"\x05\x02" is no (5, 2.0)
                    raise TypeError("a logit bias pair is no text or raw bytes")
                token, bias = pair
                out += _i32.pack(wire_int(token))
                out += _u32.pack(f32_bits(wire_f32(bias)))
        elif code == "S":
            limit = MAX_STAGE_DRY_SEQUENCE_BREAKERS if name == "dry_sequence_breakers" else MAX_STAGE_SAMPLERS
            _write_string_list(out, value, limit)
        else:  # ignore_eos: a bool (or 0 / 1)
            out += _u32.pack(wire_bool(value))


def _seq_len(values) -> int:
    """The length of a list of wire integers; text and raw bytes are none (TypeError)."""
    if isinstance(values, NOT_INT_LISTS):
        raise TypeError("not a list of wire integers")
    return len(values)


def _i32s(values) -> bytes:
    """A list of wire integers as i32s (no item a bool; text and raw bytes are no such list)."""
    count = _seq_len(values)
    if any(type(v) is bool for v in values):
        raise TypeError("not a list of wire integers")
    return struct.pack(f"<{count}i", *values)


def byte_view(buf, name: str) -> memoryview:
    """A flat byte view of a C-contiguous bytes-like object (both implementations raise the
    same InvalidInputError for anything else; numpy arrays as :func:`.byte_array`)."""
    refusal = f"{name} must be a C-contiguous bytes-like object"
    array = byte_array(buf, refusal)
    if array is not None:
        return memoryview(array)
    try:
        view = memoryview(buf)
        if not view.c_contiguous:
            raise ValueError
        view = flat_bytes(view)
    except (TypeError, ValueError):
        raise InvalidInputError(refusal) from None
    return view


def write_stage_message(msg: StageWireMessage) -> bytes:
    """Serialize ``msg`` (section 4.4, steps in order)."""
    return _write(_write_message, msg, out_of_range_error)


def _write_message(out: bytearray, msg: StageWireMessage) -> None:
    kind = wire_int(msg.kind)  # integers (or __index__), never floats or bools
    # 1.
    out += struct.pack("<iii", kind, wire_int(msg.pos_start), wire_int(msg.token_count))
    # 2.-3.
    tokens = msg.tokens
    positions = msg.positions
    if _seq_len(tokens) > MAX_STAGE_SIDEBAND_VALUES:
        raise InvalidInputError("too many tokens")
    out += _i32.pack(len(tokens))
    if _seq_len(positions) > MAX_STAGE_SIDEBAND_VALUES:
        raise InvalidInputError("too many position sideband values")
    out += _i32.pack(len(positions))
    # 4. the writer owns the SAMPLING / CHAT_SAMPLING_METADATA bits
    state = msg.state
    # plain ints: inverting an IntFlag would only cover its named bits
    flags = wire_int(state.flags) & ~int(StateFlags.SAMPLING | StateFlags.CHAT_SAMPLING_METADATA)
    if msg.sampling is not None:
        flags |= int(StateFlags.SAMPLING)
    if msg.chat_sampling_metadata is not None:
        flags |= int(StateFlags.CHAT_SAMPLING_METADATA)
    # 5. activation byte count; Stop is not in the writer's activation-less list (4.6)
    activation = byte_view(msg.activation, "activation")
    if kind in ACTIVATIONLESS_WRITE_KINDS or state.source_stage_index < 0:
        if len(activation):
            raise InvalidInputError("activationless stage message contains activation payload")
        count = 0
    else:
        if len(activation) > MAX_STAGE_ACTIVATION_BYTES:
            raise InvalidInputError("activation payload byte count exceeds maximum")
        count = len(activation)
    # 6.
    out += struct.pack(
        "<10iiQQ",
        *map(wire_int, (state.version, state.seq_id, state.phase)), int(flags),
        *map(wire_int, (state.checkpoint_generation, state.prompt_token_count, state.decode_step,
                        state.current_token, state.source_stage_index, state.activation_codec)),
        count, wire_int(msg.request_id), wire_int(msg.session_id),
    )
    # 7.
    if msg.sampling is not None:
        _write_sampling(out, msg.sampling)
    # 8.
    if msg.chat_sampling_metadata is not None:
        raw = msg.chat_sampling_metadata.encode("utf-8")
        if len(raw) > MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES:
            raise InvalidInputError("chat sampling metadata is too large")
        out += _u32.pack(len(raw))
        out += raw
    # 9.
    if kind == WireMessageKind.STATE_IMPORT:
        raw = byte_view(msg.raw_bytes, "raw_bytes")
        if msg.token_count < 0 or msg.token_count != len(raw):
            raise InvalidInputError("state import raw byte count mismatch")
        if msg.token_count > MAX_STAGE_STATE_IMPORT_BYTES:
            raise InvalidInputError("state import raw byte count exceeds maximum")
        out += raw
        return
    # 10.
    out += _i32s(tokens)
    out += _i32s(positions)
    out += activation


# --- replies (section 11.2) --------------------------------------------------------------
def write_reply(reply: StageReply) -> bytes:
    return _write(_write_reply, reply, reply_out_of_range_error)


def _write_reply(out: bytearray, reply: StageReply) -> None:
    tokens = reply.predicted_tokens
    if len(tokens) > MAX_STAGE_PREDICTED_TOKENS:
        raise InvalidInputError("too many predicted tokens")
    out += struct.pack("<iii", wire_int(reply.kind), wire_int(reply.predicted), len(tokens))
    out += _i32s(tokens)
    out += _i32.pack(wire_int(reply.window.window_id))
    draft = reply.native_mtp_draft
    if draft is None:
        out += _i32.pack(0)
    else:
        if len(draft.token_ids) > MAX_STAGE_PREDICTED_TOKENS:
            raise InvalidInputError("too many native MTP draft tokens")
        out += struct.pack("<ii", 1, len(draft.token_ids))
        out += _i32s(draft.token_ids)
        out += _i64.pack(wire_int(draft.proposal_compute_us))
    out += _stats.pack(*map(wire_int, reply.stats.as_tuple()))


def _read_token_list(cur: Cursor, what: str) -> list:
    """An i32 count (at most MAX_STAGE_PREDICTED_TOKENS) and that many i32 tokens."""
    count = cur.i32()
    if count < 0:
        raise InvalidDataError(f"negative {what} count")
    if count > MAX_STAGE_PREDICTED_TOKENS:
        raise InvalidDataError(f"{what} count exceeds maximum")
    return cur.i32_list(count)


def read_reply_from_buffer(data, offset: int = 0):
    """Parse one reply at ``offset``; returns ``(reply, consumed)`` (section 11.2 order)."""
    cur = Cursor(data, offset)
    kind = _REPLY_KINDS.get(cur.i32())
    if kind is None:
        raise InvalidDataError("unknown stage reply kind")
    predicted = cur.i32()
    tokens = _read_token_list(cur, "predicted token")
    window = StageReplyWindow(cur.i32())
    marker = cur.i32()
    draft = None
    if marker == 1:
        draft = NativeMtpDraft(_read_token_list(cur, "native MTP draft token"), cur.i64())
    elif marker != 0:
        raise InvalidDataError("unknown native MTP draft reply marker")
    cur.need(_stats.size)
    stats = StageReplyStats(*_stats.unpack_from(cur.buf, cur.pos))
    cur.pos += _stats.size
    return StageReply(kind, predicted, tokens, window, draft, stats), cur.pos - cur.start
