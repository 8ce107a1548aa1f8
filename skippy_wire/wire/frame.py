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
``SKIPPY_WIRE_IMPL``; every function here also takes ``impl="cython"|"python"``.
"""

from __future__ import annotations

import io
from typing import Any, Iterable, Optional, Sequence

from .. import _impl
from ..errors import InvalidDataError, UnexpectedEofError, WireError
from .constants import READY_BYTES, READY_MAGIC, ActivationCodec, CodecPolicy
from .messages import StageWireMessage
from .replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

#: Largest single ``read()`` a stream reader issues.
STREAM_CHUNK_BYTES = 1 << 20

_KERNELS: dict = {}


def kernels(impl: Optional[str] = None):
    """The framing kernel module of ``impl`` (default: the live implementation)."""
    impl = impl or _impl.IMPLEMENTATION
    module = _KERNELS.get(impl)
    if module is None:
        module = _KERNELS[impl] = _impl.kernel_module("frame", impl)
    return module


def reader_expectation(codec, policy) -> tuple[Optional[int], int]:
    """Map the public (codec, policy) pair of the readers onto the kernels' arguments:
    (the expected codec id or None for "any", the policy id)."""
    if codec is None:
        if policy is not None and CodecPolicy(policy) is not CodecPolicy.FIXED:
            # A policy needs its configured codec; AutoLosslessV1's is RawF32V1.
            return int(ActivationCodec.RAW_F32_V1), int(policy)
        return None, int(CodecPolicy.FIXED)
    return int(ActivationCodec(codec)), int(CodecPolicy.FIXED if policy is None else CodecPolicy(policy))


_expectation = reader_expectation  # the name the streaming decoder below uses


def _is_stream(obj: Any) -> bool:
    return hasattr(obj, "read") and not isinstance(obj, (bytes, bytearray, memoryview))


# --- writing -----------------------------------------------------------------------------
def write_stage_message(msg: StageWireMessage, *, impl: Optional[str] = None) -> bytes:
    """Serialize ``msg`` (wire-format.md 4.4).  ``msg.activation`` must already be encoded
    in ``msg.state.activation_codec``.  Raises InvalidInputError / InvalidDataError with the
    upstream texts; the exception's ``partial`` holds what upstream would have emitted."""
    return kernels(impl).write_stage_message(msg)


def write_stage_message_to(stream, msg: StageWireMessage, *, impl: Optional[str] = None) -> int:
    """Write ``msg`` to ``stream``; returns the byte count.  On error nothing is written
    (a buffer-based port may discard partial output, section 0.2)."""
    data = kernels(impl).write_stage_message(msg)
    stream.write(data)
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
    return kernels(impl).read_stage_message_from_buffer(data, n_embd, expected, pol, offset)


def read_stage_message(data_or_stream, n_embd: int, codec=None, policy=None, *, impl: Optional[str] = None):
    """Read one stage message from a bytes-like object or a binary stream (see
    :func:`read_stage_message_from_buffer` for ``codec``/``policy``)."""
    expected, pol = reader_expectation(codec, policy)
    k = kernels(impl)
    if _is_stream(data_or_stream):
        return _read_from_stream(
            data_or_stream, lambda buf: k.read_stage_message_from_buffer(buf, n_embd, expected, pol, 0)
        )
    return k.read_stage_message_from_buffer(data_or_stream, n_embd, expected, pol, 0)[0]


#: First read size of a stream reader; later reads grow with the bytes already received
#: (doubling, up to STREAM_CHUNK_BYTES), so memory follows what actually arrives.
STREAM_FIRST_CHUNK_BYTES = 64 * 1024
_ZEROS = memoryview(bytes(STREAM_CHUNK_BYTES))


def _read_exactly(stream, buf: bytearray, total: int) -> None:
    """Grow ``buf`` to ``total`` bytes from ``stream``; end of input first ->
    UnexpectedEofError.

    Bounded memory: each read asks for at most max(64 KiB, bytes received so far) and
    never more than STREAM_CHUNK_BYTES, so a hostile length costs at most about twice what
    actually arrived.  ``readinto`` is used when the stream has it (the bytes are copied
    once, straight into ``buf``)."""
    readinto = getattr(stream, "readinto", None)
    while len(buf) < total:
        want = min(total - len(buf), STREAM_CHUNK_BYTES, max(STREAM_FIRST_CHUNK_BYTES, len(buf)))
        if readinto is not None:
            start = len(buf)
            buf += _ZEROS[:want]
            try:
                with memoryview(buf) as view, view[start:] as tail:
                    got = readinto(tail)
            except (NotImplementedError, io.UnsupportedOperation):
                readinto = None  # e.g. a RawIOBase subclass implementing only read()
                got = 0
            del buf[start + (got or 0) :]
            if readinto is None:
                continue
            if not got:
                raise UnexpectedEofError()
            continue
        chunk = stream.read(want)
        if not chunk:
            raise UnexpectedEofError()
        buf += chunk


def _read_from_stream(stream, parse):
    """Drive a buffer parser over a stream: read exactly the bytes it asks for, never more
    (the stream may hold the next message), and retry once they are there."""
    buf = bytearray()
    need = 4
    while True:
        _read_exactly(stream, buf, need)
        try:
            message, consumed = parse(buf)
        except UnexpectedEofError as error:
            needed = error.needed
            if needed is None or needed <= len(buf):
                raise
            need = needed
            continue
        return message


class StageMessageDecoder:
    """Incremental decoder: ``feed(chunk)`` bytes as they arrive (any split) and get the
    completed messages back.

    A state machine with a tail (STYLE, aiohttp): the undecoded tail is kept between feeds,
    the header is validated as soon as its bytes are present, so an oversized or malformed
    message fails before its payload is buffered, and ``max_message_bytes`` (default: no
    limit beyond the protocol's) rejects a message whose known size exceeds it.

    Errors: the first fatal error is kept in :attr:`error`.  Messages completed earlier in
    the same feed are returned first and the error is raised by the next ``feed``; with no
    such messages it is raised at once.  Every later ``feed`` raises it again.
    """

    def __init__(self, n_embd: int, codec=None, policy=None, *, max_message_bytes: Optional[int] = None,
                 impl: Optional[str] = None) -> None:
        self.n_embd = n_embd
        self._expected, self._policy = _expectation(codec, policy)
        self._parse = kernels(impl).read_stage_message_from_buffer
        self._buf = bytearray()
        self._pos = 0  # start of the undecoded tail in _buf
        self._need = 4  # bytes of the tail required before the next parse attempt
        self.max_message_bytes = max_message_bytes
        self.error: Optional[WireError] = None
        self._raise_next = False

    @property
    def buffered(self) -> int:
        """Bytes received but not yet part of a returned message."""
        return len(self._buf) - self._pos

    def feed(self, chunk) -> list[StageWireMessage]:
        """Take the next bytes of the stream; return the messages they complete."""
        if self.error is not None:
            raise self.error
        out: list[StageWireMessage] = []
        if not isinstance(chunk, (bytes, bytearray)):
            chunk = memoryview(chunk)
            if chunk.format != "B" or chunk.ndim != 1:
                chunk = chunk.cast("B")
        try:
            if self._pos == len(self._buf):
                # No pending tail: parse straight from the caller's chunk (no copy of whole
                # messages into the buffer) and keep only the incomplete tail.
                end = self._drain(chunk, 0, out) if len(chunk) >= self._need else 0
                self._buf = bytearray(memoryview(chunk)[end:]) if end < len(chunk) else bytearray()
                self._pos = 0
            else:
                self._buf += chunk
                self._pos = self._drain(self._buf, self._pos, out)
        except WireError as error:
            self.error = error
            # The error's traceback may still reference a view of the buffer; never resize
            # that buffer again (it is dead anyway: the decoder is failed).
            self._buf = bytearray()
            self._pos = 0
            if not out:
                raise
        else:
            self._compact()
        return out

    def _drain(self, data, pos: int, out: list) -> int:
        """Parse complete messages from ``data`` at ``pos``; return where the tail starts."""
        parse, n_embd, expected, policy = self._parse, self.n_embd, self._expected, self._policy
        end = len(data)
        while end - pos >= self._need:
            try:
                message, consumed = parse(data, n_embd, expected, policy, pos)
            except UnexpectedEofError as error:
                needed = error.needed
                if needed is None:  # not a short tail: a genuine error
                    raise
                if self.max_message_bytes is not None and needed > self.max_message_bytes:
                    raise InvalidDataError(
                        f"stage message needs at least {needed} bytes, over the decoder limit of "
                        f"{self.max_message_bytes}"
                    ) from None
                self._need = needed
                break
            out.append(message)
            pos += consumed
            self._need = 4
        return pos

    def _compact(self) -> None:
        # Drop the consumed head once it dominates the buffer (amortised O(1) per byte).
        if self._pos and (self._pos >= len(self._buf) or self._pos > 65536 and self._pos * 2 > len(self._buf)):
            del self._buf[: self._pos]
            self._pos = 0

    def close(self) -> None:
        """Declare the end of input: raises the kept error, or UnexpectedEofError when a
        partial message is buffered."""
        if self.error is not None:
            raise self.error
        if self.buffered:
            self.error = UnexpectedEofError()
            raise self.error

    def __iter__(self):
        raise TypeError("feed() the decoder; it is not an iterator")


def iter_stage_messages(stream, n_embd: int, codec=None, policy=None, *, impl: Optional[str] = None):
    """Yield messages from ``stream`` until a clean end of input (EOF between messages)."""
    decoder = StageMessageDecoder(n_embd, codec, policy, impl=impl)
    while True:
        chunk = stream.read(STREAM_CHUNK_BYTES) if not hasattr(stream, "read1") else stream.read1(STREAM_CHUNK_BYTES)
        if not chunk:
            decoder.close()
            return
        yield from decoder.feed(chunk)


# --- READY handshake (section 11.1) ------------------------------------------------------
READY = READY_BYTES


def send_ready(stream) -> None:
    stream.write(READY_BYTES)


def recv_ready(stream_or_data) -> None:
    """Read the 4-byte READY magic; anything else -> "stage ready magic mismatch"."""
    if _is_stream(stream_or_data):
        buf = bytearray()
        _read_exactly(stream_or_data, buf, 4)
    else:
        buf = bytes(memoryview(stream_or_data)[:4])
        if len(buf) < 4:
            raise UnexpectedEofError()
    if int.from_bytes(buf, "little", signed=True) != READY_MAGIC:
        raise InvalidDataError("stage ready magic mismatch")


# --- replies (section 11.2) --------------------------------------------------------------
def write_reply(reply: StageReply, *, impl: Optional[str] = None) -> bytes:
    """Serialize a reply (``send_reply_message``)."""
    return kernels(impl).write_reply(reply)


def send_reply_message(stream, reply: StageReply, *, impl: Optional[str] = None) -> None:
    stream.write(kernels(impl).write_reply(reply))


def read_reply_from_buffer(data, *, offset: int = 0, impl: Optional[str] = None) -> tuple[StageReply, int]:
    return kernels(impl).read_reply_from_buffer(data, offset)


def read_reply(data_or_stream, *, impl: Optional[str] = None) -> StageReply:
    """Read one reply from a bytes-like object or a stream (upstream ``recv_reply``)."""
    k = kernels(impl)
    if _is_stream(data_or_stream):
        return _read_from_stream(data_or_stream, lambda buf: k.read_reply_from_buffer(buf, 0))
    return k.read_reply_from_buffer(data_or_stream, 0)[0]


recv_reply = read_reply


def _stats(stats: Optional[StageReplyStats]) -> StageReplyStats:
    return StageReplyStats() if stats is None else stats


def send_reply_ack(stream, stats: Optional[StageReplyStats] = None) -> None:
    send_reply_message(stream, StageReply(WireReplyKind.ACK, 0, [], StageReplyWindow(), None, _stats(stats)))


send_reply_ack_with_stats = send_reply_ack


def send_reply_predicted(stream, predicted: int, stats: Optional[StageReplyStats] = None) -> None:
    send_reply_message(
        stream, StageReply(WireReplyKind.PREDICTED_TOKEN, predicted, [predicted], StageReplyWindow(), None, _stats(stats))
    )


send_reply_predicted_with_stats = send_reply_predicted


def send_reply_predicted_with_tokens_and_stats(
    stream, predicted: int, tokens: Sequence[int], stats: Optional[StageReplyStats] = None
) -> None:
    send_reply_predicted_with_tokens_window_and_stats(stream, predicted, tokens, StageReplyWindow(), stats)


def send_reply_predicted_with_tokens_window_and_stats(
    stream, predicted: int, tokens: Sequence[int], window: StageReplyWindow, stats: Optional[StageReplyStats] = None
) -> None:
    send_reply_message(stream, StageReply(WireReplyKind.PREDICTED_TOKEN, predicted, list(tokens), window, None, _stats(stats)))


def send_reply_predicted_tokens_with_stats(stream, tokens: Sequence[int], stats: Optional[StageReplyStats] = None) -> None:
    send_reply_predicted_tokens_with_window_and_stats(stream, tokens, StageReplyWindow(), stats)


def send_reply_predicted_tokens_with_window_and_stats(
    stream, tokens: Sequence[int], window: StageReplyWindow, stats: Optional[StageReplyStats] = None
) -> None:
    tokens = list(tokens)
    predicted = tokens[0] if tokens else 0
    send_reply_message(stream, StageReply(WireReplyKind.PREDICTED_TOKENS, predicted, tokens, window, None, _stats(stats)))


__all__ = [
    "STREAM_CHUNK_BYTES", "READY", "kernels",
    "write_stage_message", "write_stage_message_to", "read_stage_message", "read_stage_message_from_buffer",
    "StageMessageDecoder", "iter_stage_messages", "send_ready", "recv_ready",
    "write_reply", "send_reply_message", "read_reply", "read_reply_from_buffer", "recv_reply",
    "send_reply_ack", "send_reply_ack_with_stats", "send_reply_predicted", "send_reply_predicted_with_stats",
    "send_reply_predicted_with_tokens_and_stats", "send_reply_predicted_with_tokens_window_and_stats",
    "send_reply_predicted_tokens_with_stats", "send_reply_predicted_tokens_with_window_and_stats",
    "reader_expectation",
]
