"""Stage-message framing: writers, readers, the streaming decoder, replies and READY.

Byte layout of a stage message (state version 15; all integers little-endian, no padding,
no length prefix; docs/wire-format.md has the full tables):

 1. i32 kind, i32 pos_start, i32 token_count, i32 token count N, i32 position count P
 2. 40-byte state header: 9 x i32 (version=15, seq_id, phase, flags, checkpoint_generation,
    prompt_token_count, decode_step, current_token, source_stage_index), i32 codec id
 3. i32 activation wire byte count A, u64 request_id, u64 session_id      (80 bytes so far)
 4. sampling block                      iff flags & SAMPLING (0x08)
 5. u32 length + UTF-8 chat metadata    iff flags & CHAT_SAMPLING_METADATA (0x20)
 6. body: Stop -> nothing; StateImport -> token_count raw bytes;
    otherwise N x i32 tokens, P x i32 positions, A activation bytes (encoded).

Readers return the activation *decoded* to little-endian f32 bytes (a read-only memoryview;
see :mod:`skippy_wire.wire.messages`).  Stream arguments are objects with ``read(n)`` /
``write(b)``; stream readers never read past the message and read large parts in pieces of
at most :data:`STREAM_CHUNK_BYTES`, so a hostile length costs at most what was received.

The kernels (``_frame`` compiled, ``_reference.frame`` twin) are chosen by
``SKIPPY_WIRE_IMPL``; every function here that reads or writes messages and replies also
takes ``impl="cython"|"python"`` (``send_ready`` and ``recv_ready`` run no kernel).
"""

from __future__ import annotations

import struct
import sys
from typing import Any, Generic, Iterator, Optional, Sequence, TypeVar

from .. import _impl
from ..errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError
from .constants import (I32_MAX, I32_MIN, READY_BYTES, READY_MAGIC, STAGE_WIRE_FIXED_HEADER_BYTES,
                        ActivationCodec, CodecPolicy, wire_int)
from .field_checks import (byte_array, bytes_like_view, check_known_kind, check_writable, first_out_of_range,
                           flat_bytes, int_list)
from .messages import StageWireMessage
from .replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

#: Largest single ``read()`` a stream reader issues.
STREAM_CHUNK_BYTES = 1 << 20

def kernels(impl: Optional[str] = None):
    """The framing kernel module of ``impl`` (default: the live implementation)."""
    return _impl.cached_kernel_module("frame", impl)


def reader_expectation(codec, policy) -> tuple[Optional[int], int]:
    """Map the public (codec, policy) pair of the readers onto the kernels' arguments:
    (the expected codec id or None for "any", the policy id).  An unknown one is an
    InvalidDataError, as the codec functions say of an unknown codec id, and one that is no
    integer a TypeError naming the argument (``codec``, ``policy``), as for ``n_embd``."""
    policy = None if policy is None else _known(CodecPolicy, policy, "policy", "codec policy")
    if codec is None:
        if policy is not None and policy is not CodecPolicy.FIXED:
            # A policy needs its configured codec; AutoLosslessV1's is RawF32V1.
            return int(ActivationCodec.RAW_F32_V1), int(policy)
        return None, int(CodecPolicy.FIXED)
    return int(_known(ActivationCodec, codec, "codec", "codec")), int(CodecPolicy.FIXED if policy is None else policy)


def _known(kind, value, argument: str, what: str):
    value = _check_int(value, argument)  # an enum member or an int (the enum alone took 3.0)
    try:
        return kind(value)
    except ValueError:  # the enum's own "9 is not a valid ActivationCodec"
        raise InvalidDataError(f"unknown stage activation {what}") from None


def readable(data):
    """``data`` for a reader kernel: a C-contiguous bytes-like object (a TypeError, else an
    InvalidInputError, worded the same whichever implementation reads it)."""
    if isinstance(data, (bytes, bytearray)):
        return data
    array = byte_array(data, "data must be a C-contiguous buffer")
    if array is not None:
        return array
    if not bytes_like_view(data).c_contiguous:
        raise InvalidInputError("data must be a C-contiguous buffer")
    return data


def _is_stream(obj: Any) -> bool:
    return hasattr(obj, "read") and not isinstance(obj, (bytes, bytearray, memoryview))


def _write_to(stream, data: bytes) -> None:
    """``stream.write(data)``; a TypeError, before anything is written, when ``stream`` has no
    ``write`` (``None``, a plain socket: wrap one in ``socket.makefile("wb")``)."""
    write = getattr(stream, "write", None)
    if not callable(write):
        raise TypeError(f"stream must be a binary stream with a write method, not {type(stream).__name__}")
    write(data)


def _check_type(value: Any, cls: type, what: str) -> None:
    """A clear one-line TypeError for the commonest mistake (``None``, a dict, raw bytes
    where a message or reply object belongs)."""
    if not isinstance(value, cls):
        raise TypeError(f"{what} expects a {cls.__name__}, not {type(value).__name__}")


def _check_int(value: Any, name: str) -> int:
    """``value`` as an int (anything with ``__index__`` but a bool); else a TypeError naming
    ``name``."""
    try:
        return wire_int(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, not {type(value).__name__}") from None


def check_offset(value: Any) -> int:
    """A buffer offset for a reader kernel: an int, and one past what a C index holds is
    passed as -1, so the kernel names it "outside the buffer" as any other (an OverflowError
    converting it would name neither)."""
    offset = _check_int(value, "offset")
    return offset if abs(offset) <= sys.maxsize else -1


# --- writing -----------------------------------------------------------------------------
def write_stage_message(msg: StageWireMessage, *, impl: Optional[str] = None) -> bytes:
    """Serialize ``msg`` (wire-format.md 4.4).  ``msg.activation`` must already be encoded
    in ``msg.state.activation_codec``.  Raises InvalidInputError / InvalidDataError with the
    upstream texts; the exception's ``partial`` holds what upstream would have emitted.  A
    value the wire cannot carry (a field of the wrong type or range) is an
    InvalidInputError naming the field; ``msg`` not a StageWireMessage is a TypeError."""
    _check_type(msg, StageWireMessage, "write_stage_message")
    check_writable(msg)
    return kernels(impl).write_stage_message(msg)


def write_stage_message_to(stream, msg: StageWireMessage, *, impl: Optional[str] = None) -> int:
    """Write ``msg`` to ``stream``; returns the byte count.  On error nothing is written
    (a buffer-based port may discard partial output, section 0.2)."""
    data = write_stage_message(msg, impl=impl)
    _write_to(stream, data)
    return len(data)


# --- reading -----------------------------------------------------------------------------
def read_stage_message_from_buffer(
    data, n_embd: int, codec=None, policy=None, *, offset: int = 0, impl: Optional[str] = None
) -> tuple[StageWireMessage, int]:
    """Read one message from a bytes-like object; returns ``(message, consumed)``.

    ``codec=None`` accepts every codec (upstream ``read_stage_message``); a codec with
    ``policy=None`` requires exactly that codec (``read_stage_message_for_codec``);
    ``policy=AUTO_LOSSLESS_V1`` admits per ``policy.permits(codec, wire_codec)``.
    Trailing bytes are ignored (``consumed`` says where the message ended).
    """
    expected, pol = reader_expectation(codec, policy)
    return kernels(impl).read_stage_message_from_buffer(
        readable(data), _check_int(n_embd, "n_embd"), expected, pol, check_offset(offset))


def read_stage_message(data_or_stream, n_embd: int, codec=None, policy=None, *,
                       impl: Optional[str] = None) -> StageWireMessage:
    """Read one stage message from a bytes-like object or a binary stream (see
    :func:`read_stage_message_from_buffer` for ``codec``/``policy``)."""
    expected, pol = reader_expectation(codec, policy)
    n_embd = _check_int(n_embd, "n_embd")
    k = kernels(impl)
    if _is_stream(data_or_stream):
        return StageMessageDecoder(n_embd, codec, policy, impl=impl).read_from(data_or_stream)
    return k.read_stage_message_from_buffer(readable(data_or_stream), n_embd, expected, pol, 0)[0]


#: First read size of a stream reader; later reads grow with the bytes already received
#: (doubling, up to STREAM_CHUNK_BYTES), so memory follows what actually arrives.
STREAM_FIRST_CHUNK_BYTES = 64 * 1024
#: Bytes a decoder waits for before its first parse attempt of a record (the leading i32).
_FIRST_NEED = 4


def _read_some(stream, want: int):
    """One read of at most ``want`` (> 0) bytes; end of input -> UnexpectedEofError."""
    chunk = stream.read(want)
    if not chunk:
        raise UnexpectedEofError()
    return chunk


def _read_exactly(stream, buf: bytearray, total: int) -> None:
    """Grow ``buf`` to ``total`` bytes from ``stream`` (the 4-byte READY handshake); end of
    input first -> UnexpectedEofError.  Records are read with a decoder's ``read_from``."""
    while len(buf) < total:
        buf += _read_some(stream, total - len(buf))


_Record = TypeVar("_Record")


class _IncrementalDecoder(Generic[_Record]):
    """The machinery of :class:`StageMessageDecoder` and :class:`StageReplyDecoder`.

    ``feed(chunk)`` takes the next bytes of a stream (any split) and returns the records
    they complete, in order.  A state machine with a tail (STYLE, aiohttp): the undecoded
    tail is kept between feeds, and a record is parsed only once the tail holds the bytes
    its last attempt said it needs, so a record costs O(its size) whatever the split.

    Stream offsets (0 = the first byte ever fed):

    * :attr:`consumed` -- the offset right after the last returned record;
    * :attr:`ends` -- the offset right after each record the last successful ``feed``
      returned (so ``ends[i] - ends[i-1]`` is the wire size of record ``i``);
    * :attr:`received` -- every byte fed; :attr:`buffered` = ``received - consumed``.

    Errors: the first fatal error is kept in :attr:`error`.  Records completed earlier in
    the same feed are returned first (``consumed`` then says exactly where the bad record
    starts) and the error is raised by the next ``feed``; with no such records it is raised
    at once.  Every later ``feed`` raises it again.  A failed decoder holds no bytes.

    A decoder is one stream's state and takes no lock: feed it from one thread at a time
    (one decoder per connection; decoders of different streams run in parallel).
    """

    #: The record's name in the decoder-limit error text.
    _what = "record"

    def __init__(self, parse, max_message_bytes: Optional[int]) -> None:
        self._parse = parse  # parse(data, offset) -> (record, used); short -> UnexpectedEofError(needed)
        self._buf = bytearray()
        self._pos = 0  # start of the undecoded tail in _buf
        self._need = _FIRST_NEED  # bytes of the tail required before the next parse attempt
        if max_message_bytes is not None:
            max_message_bytes = _check_int(max_message_bytes, "max_message_bytes")
            if max_message_bytes < 0:
                raise InvalidInputError(f"max_message_bytes must be >= 0, not {max_message_bytes}")
        self.max_message_bytes = max_message_bytes
        self.error: Optional[WireError] = None
        self.received = 0
        self.consumed = 0
        self.ends: list[int] = []

    def __repr__(self) -> str:
        failed = f", error={self.error!r}" if self.error is not None else ""
        return (f"<{type(self).__name__} received={self.received} consumed={self.consumed} "
                f"buffered={self.buffered}{failed}>")

    @property
    def buffered(self) -> int:
        """Bytes received but not part of a returned record (a count of the stream: a failed
        decoder counts the bytes from the bad record on, and holds none of them)."""
        return self.received - self.consumed

    @property
    def wanted(self) -> int:
        """Bytes to feed before the next parse attempt can complete a record (at least 1).
        Feeding no more than this never completes more than one record."""
        return max(1, self._need - self.buffered)

    def feed(self, chunk) -> list[_Record]:
        """Take the next bytes of the stream; return the records they complete."""
        if self.error is not None:
            raise self.error.with_traceback(None)  # a fresh traceback each time, not a longer one
        out: list[_Record] = []
        self.ends = []
        if not isinstance(chunk, (bytes, bytearray)):
            # refused before anything is counted: a strided view cannot be parsed or kept
            chunk = flat_bytes(memoryview(readable(chunk)))
        self.received += len(chunk)
        try:
            if self._pos == len(self._buf):
                # No pending tail: parse straight from the caller's chunk (no copy of whole
                # records into the buffer) and keep only the incomplete tail.
                end = self._drain(chunk, 0, out) if len(chunk) >= self._need else 0
                self._buf = bytearray(memoryview(chunk)[end:]) if end < len(chunk) else bytearray()
                self._pos = 0
            else:
                self._buf += chunk
                self._pos = self._drain(self._buf, self._pos, out)
        except WireError as error:
            # Kept and raised again by every later feed: without the frames that failed (and
            # the short-tail error it replaced), which hold views of the caller's buffer, so
            # the caller may reuse or resize that buffer; this frame's view goes too.
            self.error = error.with_traceback(None)
            error.__context__ = None
            chunk = None
            self._buf = bytearray()
            self._pos = 0
            if not out:
                raise self.error
        else:
            self._compact()
        return out

    def _drain(self, data, pos: int, out: list) -> int:
        """Parse complete records from ``data`` at ``pos``; return where the tail starts."""
        parse, limit = self._parse, self.max_message_bytes
        end = len(data)
        while end - pos >= self._need:
            try:
                if limit is not None and end - pos > limit:
                    # parse no further than the limit: a larger record is refused from the size
                    # its prefix declares, before its payload is read, however the stream was split
                    with memoryview(data)[pos:pos + limit] as window:
                        record, used = parse(window, 0)
                else:
                    record, used = parse(data, pos)
            except UnexpectedEofError as error:
                needed = error.needed
                if needed is None:  # not a short tail: a genuine error
                    raise
                if limit is not None and needed > limit:
                    raise InvalidDataError(f"{self._what} needs at least {needed} bytes, over the decoder limit of "
                                           f"{limit}") from None
                self._need = needed
                break
            out.append(record)
            pos += used
            self.consumed += used
            self.ends.append(self.consumed)
            self._need = _FIRST_NEED
        return pos

    def _compact(self) -> None:
        # Drop the consumed head once it dominates the buffer (amortised O(1) per byte).
        if self._pos and (self._pos >= len(self._buf) or self._pos > 65536 and self._pos * 2 > len(self._buf)):
            del self._buf[: self._pos]
            self._pos = 0

    def close(self) -> None:
        """Declare the end of input: raises the kept error, or UnexpectedEofError when a
        partial record is buffered."""
        if self.error is not None:
            raise self.error.with_traceback(None)
        if self.buffered:
            self.error = UnexpectedEofError()
            raise self.error

    def read_from(self, stream) -> _Record:
        """Read exactly one record from a binary ``stream`` (``read(n)``) and return it.

        Asks only for the bytes the record still needs, never past its end (the stream may
        hold the next record); each read is at most max(STREAM_FIRST_CHUNK_BYTES, bytes
        buffered) and never over STREAM_CHUNK_BYTES, so a hostile length costs at most about
        twice what actually arrived.  End of input first -> UnexpectedEofError.
        """
        while True:
            want = min(self.wanted, STREAM_CHUNK_BYTES, max(STREAM_FIRST_CHUNK_BYTES, self.buffered))
            records = self.feed(_read_some(stream, want))
            if records:
                return records[0]

    def __iter__(self):
        raise TypeError("feed() the decoder; it is not an iterator")


class StageMessageDecoder(_IncrementalDecoder[StageWireMessage]):
    """Incremental stage-message decoder: ``feed(chunk)`` bytes as they arrive (any split)
    and get the completed messages back; ``consumed`` / ``ends`` say where they ended.

    ``codec`` / ``policy`` as for :func:`read_stage_message_from_buffer`.  The header is
    validated as soon as its bytes are present, so an oversized or malformed message fails
    before its payload is buffered, and ``max_message_bytes`` (default: no limit beyond the
    protocol's) rejects a message whose known size exceeds it.  Offsets and errors: see
    :class:`_IncrementalDecoder` (``ends``, ``consumed``, ``buffered``, ``error``).
    """

    _what = "stage message"

    def __init__(self, n_embd: int, codec=None, policy=None, *, max_message_bytes: Optional[int] = None,
                 impl: Optional[str] = None) -> None:
        self.n_embd = n_embd = _check_int(n_embd, "n_embd")
        expected, pol = reader_expectation(codec, policy)
        parse = kernels(impl).read_stage_message_from_buffer
        super().__init__(lambda data, pos: parse(data, n_embd, expected, pol, pos), max_message_bytes)


class StageReplyDecoder(_IncrementalDecoder[StageReply]):
    """Incremental stage-reply decoder (wire-format.md 11.2): the same ``feed`` / ``close``
    / ``read_from`` interface and offsets as :class:`StageMessageDecoder`, parsing with
    :func:`read_reply_from_buffer`."""

    _what = "stage reply"

    def __init__(self, *, max_message_bytes: Optional[int] = None, impl: Optional[str] = None) -> None:
        super().__init__(kernels(impl).read_reply_from_buffer, max_message_bytes)


class RecordDecoder(_IncrementalDecoder[Any]):
    """An incremental decoder over any ``parse(data, offset) -> (record, used)`` that raises
    ``UnexpectedEofError(needed)`` on a short tail (e.g. a v16/v17
    :meth:`skippy_wire.wire.protocol.WireProtocol.read_from_buffer`); the same interface
    as :class:`StageMessageDecoder`."""

    def __init__(self, parse, what: str = "stage message", *, max_message_bytes: Optional[int] = None) -> None:
        self._what = what
        super().__init__(parse, max_message_bytes)


def iter_stage_messages(stream, n_embd: int, codec=None, policy=None, *,
                        impl: Optional[str] = None) -> Iterator[StageWireMessage]:
    """Yield messages from ``stream`` (or a bytes-like object, as :func:`read_stage_message`
    takes one) until a clean end of input (EOF between messages)."""
    decoder = StageMessageDecoder(n_embd, codec, policy, impl=impl)
    if _is_stream(stream):
        read = getattr(stream, "read1", None) or stream.read
        while chunk := read(STREAM_CHUNK_BYTES):
            yield from decoder.feed(chunk)
    else:  # bytes-like: the whole input (an AttributeError on .read)
        yield from decoder.feed(stream)
    decoder.close()


# --- READY handshake (section 11.1) ------------------------------------------------------
READY = READY_BYTES


def send_ready(stream) -> None:
    """Write the 4-byte READY magic (``READY_MAGIC``, bytes ``59 44 52 53``) to ``stream``."""
    _write_to(stream, READY_BYTES)


def recv_ready(stream_or_data) -> None:
    """Read the 4-byte READY magic; anything else -> "stage ready magic mismatch"."""
    buf: bytes | bytearray
    if _is_stream(stream_or_data):
        buf = bytearray()
        _read_exactly(stream_or_data, buf, 4)
    else:
        buf = bytes(flat_bytes(memoryview(readable(stream_or_data)))[:4])  # bytes, whatever the item size
        if len(buf) < 4:
            raise UnexpectedEofError()
    if int.from_bytes(buf, "little", signed=True) != READY_MAGIC:
        raise InvalidDataError("stage ready magic mismatch")


# --- replies (section 11.2) --------------------------------------------------------------
_REPLY_KINDS = frozenset(WireReplyKind)  # the same in every state version


def write_reply(reply: StageReply, *, impl: Optional[str] = None) -> bytes:
    """Serialize a reply (``send_reply_message``).  A value the wire cannot carry is an
    InvalidInputError naming the field; ``reply`` not a StageReply is a TypeError."""
    _check_type(reply, StageReply, "write_reply")
    check_known_kind(reply.kind, _REPLY_KINDS, "stage reply")
    return kernels(impl).write_reply(reply)


def send_reply_message(stream, reply: StageReply, *, impl: Optional[str] = None) -> None:
    """Write ``reply`` to ``stream`` (upstream ``send_reply_message``); on error nothing is
    written."""
    _write_to(stream, write_reply(reply, impl=impl))


def read_reply_from_buffer(data, *, offset: int = 0, impl: Optional[str] = None) -> tuple[StageReply, int]:
    """Read one reply at ``offset`` of a bytes-like object; returns ``(reply, consumed)``
    (trailing bytes are ignored).  A short buffer is UnexpectedEofError."""
    return kernels(impl).read_reply_from_buffer(readable(data), check_offset(offset))


def read_reply(data_or_stream, *, impl: Optional[str] = None) -> StageReply:
    """Read one reply from a bytes-like object or a stream (upstream ``recv_reply``)."""
    k = kernels(impl)
    if _is_stream(data_or_stream):
        return StageReplyDecoder(impl=impl).read_from(data_or_stream)
    return k.read_reply_from_buffer(readable(data_or_stream), 0)[0]


recv_reply = read_reply


def _stats(stats: Optional[StageReplyStats]) -> StageReplyStats:
    return StageReplyStats() if stats is None else stats


def send_reply_ack(stream, stats: Optional[StageReplyStats] = None, *, impl: Optional[str] = None) -> None:
    """Write an Ack reply with ``stats`` (default: all zero).  Also ``send_reply_ack_with_stats``."""
    send_reply_message(stream, StageReply(WireReplyKind.ACK, 0, [], StageReplyWindow(), None, _stats(stats)), impl=impl)


send_reply_ack_with_stats = send_reply_ack


def send_reply_predicted(stream, predicted: int, stats: Optional[StageReplyStats] = None, *,
                         impl: Optional[str] = None) -> None:
    """Write a PredictedToken reply carrying ``predicted`` (also as its one token), window 0.
    Also ``send_reply_predicted_with_stats``."""
    send_reply_message(
        stream, StageReply(WireReplyKind.PREDICTED_TOKEN, predicted, [predicted], StageReplyWindow(), None, _stats(stats)),
        impl=impl)


send_reply_predicted_with_stats = send_reply_predicted


def send_reply_predicted_with_tokens_and_stats(
    stream, predicted: int, tokens: Sequence[int], stats: Optional[StageReplyStats] = None, *, impl: Optional[str] = None
) -> None:
    """Write a PredictedToken reply: ``predicted`` plus the token list ``tokens``, window 0."""
    send_reply_predicted_with_tokens_window_and_stats(stream, predicted, tokens, StageReplyWindow(), stats, impl=impl)


def send_reply_predicted_with_tokens_window_and_stats(
    stream, predicted: int, tokens: Sequence[int], window: StageReplyWindow, stats: Optional[StageReplyStats] = None,
    *, impl: Optional[str] = None
) -> None:
    """Write a PredictedToken reply: ``predicted``, the token list ``tokens`` and ``window``."""
    tokens = int_list("predicted_tokens", tokens)  # what write_reply takes as one, or its error
    send_reply_message(stream, StageReply(WireReplyKind.PREDICTED_TOKEN, predicted, tokens, window, None,
                                          _stats(stats)), impl=impl)


def send_reply_predicted_tokens_with_stats(stream, tokens: Sequence[int], stats: Optional[StageReplyStats] = None, *,
                                           impl: Optional[str] = None) -> None:
    """Write a PredictedTokens reply: ``tokens`` (``predicted`` = the first, or 0), window 0."""
    send_reply_predicted_tokens_with_window_and_stats(stream, tokens, StageReplyWindow(), stats, impl=impl)


def send_reply_predicted_tokens_with_window_and_stats(
    stream, tokens: Sequence[int], window: StageReplyWindow, stats: Optional[StageReplyStats] = None, *,
    impl: Optional[str] = None
) -> None:
    """Write a PredictedTokens reply: ``tokens`` (``predicted`` = the first, or 0) and ``window``."""
    tokens = int_list("predicted_tokens", tokens)  # what write_reply takes as one, or its error
    first = tokens[0] if tokens else 0
    try:
        fits = I32_MIN <= wire_int(first) <= I32_MAX
    except TypeError:
        fits = False
    predicted = first if fits else 0  # (else the writer names it, as one of ``tokens``)
    send_reply_message(stream, StageReply(WireReplyKind.PREDICTED_TOKENS, predicted, tokens, window, None, _stats(stats)),
                       impl=impl)


# --- the per-token fast paths of a decode step ---------------------------------------------
# One reply and one DecodeEmbd cross every hop for every generated token, right after the
# stage's compute has streamed its weights through the caches; building them from a template
# touches a few cache lines where the reply and message objects touch hundreds.

#: Offsets of fields in a stage message's fixed prefix (section 4.2; the same in state
#: versions 15, 16 and 17; the state header starts at 20).
MESSAGE_POS_START_OFFSET = 4
MESSAGE_SIDEBAND_COUNTS_OFFSET = 12  # the token count, then the position count
MESSAGE_FLAGS_OFFSET = 32
MESSAGE_DECODE_STEP_OFFSET = 44  # decode_step, then current_token
MESSAGE_SOURCE_STAGE_OFFSET = 52  # source_stage_index, the codec id, the activation byte count
_I32 = struct.Struct("<i")
_PAIR = struct.Struct("<ii")

#: kind, predicted, token count 1, the token: the head of ``send_reply_predicted(p)``.
_PREDICTED_HEAD = struct.Struct("<iiii")
#: The rest with zero stats: window 0, no MTP draft, 27 zero statistics.
_PREDICTED_TAIL = bytes(8 + 8 * len(StageReplyStats.FIELDS))


def predicted_reply_bytes(predicted: int) -> bytes:
    """The bytes of ``send_reply_predicted(predicted)`` with all-zero statistics (a decode
    step's reply: stages observe prefill only), without building a reply object."""
    try:
        if predicted.__class__ is not bool:  # a bool packs as an int; write_reply refuses it
            return _PREDICTED_HEAD.pack(WireReplyKind.PREDICTED_TOKEN, predicted, 1, predicted) + _PREDICTED_TAIL
    except struct.error:
        pass
    return write_reply(StageReply(WireReplyKind.PREDICTED_TOKEN, predicted, [predicted]))  # raises the wire's error


class DecodeStepWriter:
    """The DecodeEmbd messages of one generation as bytes, patched into the first one's
    encoding: from step to step only ``pos_start``, ``decode_step``, ``current_token`` and the
    one token change (section 4.2; the prefix is the same in state versions 15, 16 and 17).

    ``first`` is an encoded DecodeEmbd with one token and no sampling block, chat metadata,
    positions or activation (what a driver sends); anything else is refused.
    """

    def __init__(self, first: bytes) -> None:
        if (len(first) != STAGE_WIRE_FIXED_HEADER_BYTES + 4
                or _PAIR.unpack_from(first, MESSAGE_SIDEBAND_COUNTS_OFFSET) != (1, 0)):
            raise ValueError("a DecodeStepWriter needs a DecodeEmbd with one token and nothing else")
        self._buf = bytearray(first)

    def message(self, token: int, pos: int, step: int) -> bytes:
        """The step's message: the bytes the link's encoder gives the DecodeEmbd with these fields."""
        buf = self._buf
        try:
            _I32.pack_into(buf, MESSAGE_POS_START_OFFSET, pos)
            _PAIR.pack_into(buf, MESSAGE_DECODE_STEP_OFFSET, step, token)
            _I32.pack_into(buf, STAGE_WIRE_FIXED_HEADER_BYTES, token)  # the token sideband follows the prefix
        except struct.error:  # named as the writer names it
            raise first_out_of_range([("pos_start", pos, I32_MIN, I32_MAX), ("state.decode_step", step, I32_MIN, I32_MAX),
                                      ("tokens", token, I32_MIN, I32_MAX)], "message") from None
        return bytes(buf)


__all__ = [
    "STREAM_CHUNK_BYTES", "READY", "kernels", "predicted_reply_bytes", "DecodeStepWriter",
    "MESSAGE_POS_START_OFFSET", "MESSAGE_SIDEBAND_COUNTS_OFFSET", "MESSAGE_FLAGS_OFFSET", "MESSAGE_DECODE_STEP_OFFSET",
    "MESSAGE_SOURCE_STAGE_OFFSET",
    "write_stage_message", "write_stage_message_to", "read_stage_message", "read_stage_message_from_buffer",
    "StageMessageDecoder", "StageReplyDecoder", "RecordDecoder", "iter_stage_messages", "send_ready", "recv_ready",
    "write_reply", "send_reply_message", "read_reply", "read_reply_from_buffer", "recv_reply",
    "send_reply_ack", "send_reply_ack_with_stats", "send_reply_predicted", "send_reply_predicted_with_stats",
    "send_reply_predicted_with_tokens_and_stats", "send_reply_predicted_with_tokens_window_and_stats",
    "send_reply_predicted_tokens_with_stats", "send_reply_predicted_tokens_with_window_and_stats",
    "reader_expectation",
]
