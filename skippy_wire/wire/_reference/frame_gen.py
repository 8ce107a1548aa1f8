"""Reference stage messages of state versions 16 and 17 (wire-v16-v17.md A.7, B.7).

The twin of ``skippy_wire.wire._frame_gen``; both expose the v16/v17 kernel API:

* frames: ``validate_frame``, ``frame_wire_bytes``, ``encode_frame``, ``decode_frame``,
  ``select_frame_codec`` (``frame_v16``);
* agreements: ``validate_agreement``, ``agreed_wire_bytes``, ``agreed_encode``,
  ``agreed_reframe``, ``agreed_decode`` (``frame_v17``);
* messages: ``write_stage_message(version, msg, agreement=None) -> bytes`` and
  ``read_stage_message_from_buffer(version, data, expected_codec, policy, offset=0,
  agreement=None) -> (msg, consumed)``.

A reader's short input raises UnexpectedEofError whose ``needed`` is the byte count (from
``offset``) the walk needed at that point; a failing writer attaches ``partial``.  The
activation of a message is a complete v16 frame in memory: handed to the writer encoded
in the header codec, returned by the reader re-encoded with RawF32V1.
"""

from __future__ import annotations

import dataclasses
import struct

from ...errors import InvalidDataError, InvalidInputError, WireError
from ..activation_frame import ActivationFrameV16
from ..constants import ActivationCodec, CodecPolicy, wire_int
from ..constants import MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES, MAX_STAGE_SIDEBAND_VALUES, MAX_STAGE_STATE_IMPORT_BYTES
from ..messages import StageStateHeader, StageWireMessage
from ..field_checks import check_admission, out_of_range_error
from . import frame as _v15
from .frame import Cursor, byte_view, check_sideband_counts, read_sampling
from .frame_v16 import (
    HEADER,
    MAX_BYTES,
    PART,
    RAW,
    codec_id,
    decode_frame,
    desc_bytes,
    encode_frame,
    frame_wire_bytes,
    read_desc,
    select_frame_codec,
    validate_frame as _validate_frame,
    wire_bytes_of,
)
from .frame_v17 import agreed_decode, agreed_encode, agreed_reframe, agreed_wire_bytes, validate_agreement

KNOWN_KINDS = frozenset(list(range(1, 10)) + list(range(13, 24)))
ACTIVATIONLESS = frozenset({3, 7, 15, 16, 17})
F_SAMPLING, F_CHAT = 0x08, 0x20
VERSIONS = (16, 17)


def _stage_checks(desc: ActivationFrameV16, token_count: int, source: int) -> None:
    """A.7.3, writer and reader."""
    if token_count < 0 or desc.token_count != token_count:
        raise InvalidDataError("activation frame token count does not match stage message")
    if desc.producer_stage_index != source:
        raise InvalidDataError("activation frame producer does not match stage message")


def validate_frame(desc: ActivationFrameV16, payload_len=None) -> None:
    """A.5 as the kernel entry point: nothing is returned, as from the compiled twin."""
    _validate_frame(desc, payload_len)


def raw_frame(desc: ActivationFrameV16, payload: bytes) -> bytes:
    """A frame re-encoded with RawF32V1: the descriptor, then the logical payload (A.6.1's
    size limit applies: a BF16 frame under it can double past it)."""
    wire_bytes_of(RAW, desc)
    return desc_bytes(desc) + bytes(payload)


def read_stage_message_from_buffer(version: int, data, expected_codec=None, policy: int = 0, offset: int = 0,
                                   agreement=None):
    if version not in VERSIONS:
        raise ValueError(f"state version {version} is not 16 or 17")
    check_admission(expected_codec, policy)
    cur = Cursor(data, offset)
    kind, = cur.unpack("<i")
    if kind not in KNOWN_KINDS:
        raise InvalidDataError("unknown stage message kind")
    cur.need(56)
    pos_start, token_count, n_tokens, n_positions = cur.unpack("<4i")
    fields = cur.unpack("<9i")
    codec_raw, = cur.unpack("<i")
    if codec_raw not in (1, 2, 3, 4):
        raise InvalidDataError("unknown stage activation codec")
    codec = ActivationCodec(codec_raw)
    state = StageStateHeader(*fields, codec)
    if state.version != version:
        raise InvalidDataError("unsupported stage state version")
    count, = cur.unpack("<i")
    if count < 0:
        raise InvalidDataError("negative activation payload byte count")
    if count > MAX_BYTES:
        raise InvalidDataError("activation payload byte count exceeds maximum")
    cur.need(16)
    request_id, session_id = cur.unpack("<QQ")
    flags = state.flags
    if kind in ACTIVATIONLESS or state.source_stage_index < 0:
        if count != 0:
            raise InvalidDataError("activationless stage message contains activation payload")
    elif expected_codec is not None and not CodecPolicy(policy).permits(ActivationCodec(expected_codec), codec):
        raise InvalidDataError("stage activation codec mismatch")
    sampling = read_sampling(cur) if flags & F_SAMPLING else None
    metadata = None
    if flags & F_CHAT:
        length, = cur.unpack("<I")
        if length > MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES:
            raise InvalidDataError("chat sampling metadata length exceeds maximum")
        try:
            metadata = str(cur.take(length), "utf-8")
        except UnicodeDecodeError:
            raise InvalidDataError("chat sampling metadata is not UTF-8") from None
    msg = StageWireMessage(kind, pos_start, token_count, state, request_id, session_id, sampling, metadata)
    if kind == 3:
        return msg, cur.pos - cur.start
    check_sideband_counts(token_count, n_tokens, n_positions)
    if kind == 7:
        if token_count > MAX_STAGE_STATE_IMPORT_BYTES:
            raise InvalidDataError("state import byte count exceeds maximum")
        msg.raw_bytes = bytes(cur.take(token_count))
        return msg, cur.pos - cur.start
    cur.need(4 * n_tokens + 4 * n_positions + count)
    msg.tokens = list(cur.unpack(f"<{n_tokens}i"))
    msg.positions = list(cur.unpack(f"<{n_positions}i"))
    if count:
        wire = cur.take(count)
        if version == 16:
            desc, payload = decode_frame(int(codec), wire, 16)
        else:
            if agreement is None:
                raise InvalidDataError("activation requires an established agreement")
            desc, payload = agreed_decode(agreement, int(codec), wire)
        _stage_checks(desc, token_count, state.source_stage_index)
        msg.activation = raw_frame(desc, payload)
    return msg, cur.pos - cur.start


def _checked_activation(version: int, msg: StageWireMessage, agreement) -> memoryview:
    """A.7.2 step 5 / B.7.2 step 4: the activation the message may carry (reframed for v17)."""
    kind = wire_int(msg.kind)
    state = msg.state
    activation = byte_view(msg.activation, "activation")
    if kind in ACTIVATIONLESS or state.source_stage_index < 0:
        if len(activation):
            raise InvalidInputError("activationless stage message contains activation payload")
        return activation
    if len(activation) > MAX_BYTES:
        raise InvalidInputError("activation payload byte count exceeds maximum")
    try:
        codec = wire_int(state.activation_codec)
    except TypeError:
        raise out_of_range_error(msg) from None
    codec = codec_id(codec)
    desc, _payload = decode_frame(codec, activation, version)
    _stage_checks(desc, msg.token_count, state.source_stage_index)
    if version == 16:
        return activation
    if agreement is None:
        raise InvalidInputError("activation requires an established agreement")
    return memoryview(agreed_reframe(agreement, desc, activation))


def write_stage_message(version: int, msg: StageWireMessage, agreement=None) -> bytes:
    if version not in VERSIONS:
        raise ValueError(f"state version {version} is not 16 or 17")
    try:
        prefix = struct.pack("<iii", *map(wire_int, (msg.kind, msg.pos_start, msg.token_count)))
        len(msg.tokens), len(msg.positions)  # lists (a generator is named by the checks)
        wire_int(msg.state.source_stage_index)  # compared below: a state of the wrong shape is named
    except (struct.error, OverflowError, TypeError, ValueError, AttributeError):
        raise out_of_range_error(msg) from None
    # v16 emits as it goes (20 bytes precede the activation checks); v17 emits nothing
    # before every check passed.
    emitted = b""
    if len(msg.tokens) > MAX_STAGE_SIDEBAND_VALUES:
        emitted = prefix
    elif len(msg.positions) > MAX_STAGE_SIDEBAND_VALUES:
        emitted = prefix + struct.pack("<i", len(msg.tokens))
    else:
        emitted = prefix + struct.pack("<ii", len(msg.tokens), len(msg.positions))
    try:
        if len(msg.tokens) > MAX_STAGE_SIDEBAND_VALUES:
            raise InvalidInputError("too many tokens")
        if len(msg.positions) > MAX_STAGE_SIDEBAND_VALUES:
            raise InvalidInputError("too many position sideband values")
        activation = _checked_activation(version, msg, agreement)
    except WireError as error:
        error.partial = emitted if version == 16 else b""
        raise
    if activation is not msg.activation and version == 17:
        msg = dataclasses.replace(msg, activation=activation)
    return _v15.write_stage_message(msg)


__all__ = [
    "validate_frame", "frame_wire_bytes", "encode_frame", "decode_frame", "select_frame_codec", "raw_frame",
    "validate_agreement", "agreed_wire_bytes", "agreed_encode", "agreed_reframe", "agreed_decode",
    "write_stage_message", "read_stage_message_from_buffer", "message_wire_bytes", "RAW", "HEADER", "PART",
]


def message_wire_bytes(msg: StageWireMessage, agreement) -> int:
    """B.7.4 ``wire_bytes(agreement)``: the v17 size of ``msg`` on the wire."""
    activation = byte_view(msg.activation, "activation")
    try:
        estimated = msg.estimated_wire_bytes()
        codec = wire_int(msg.state.activation_codec)
    except (AttributeError, TypeError, ValueError, OverflowError):
        raise out_of_range_error(msg) from None  # a field of the wrong type: named as the writer names it
    if not len(activation):
        return estimated
    codec = codec_id(codec)
    desc = read_desc(activation)  # the descriptor alone, as upstream reads it: the payload is not decoded
    if agreement is None:
        raise InvalidDataError("activation requires an established agreement")
    return estimated - len(activation) + agreed_wire_bytes(agreement, codec, desc)
