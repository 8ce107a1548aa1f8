"""Forwarding: the stage message a stage sends downstream (wire-format.md section 9).

A port of ``forwarded_stage_message(_timed)`` of skippy-server 0.76.1
(``shared/seeds/skippy-server-0.76.1-forwarding.rs``): the full-range invariant for
non-first stages, the codec choice (Fixed, or per-frame lossless selection under
AutoLosslessV1), encoding with *incoming.token_count* rows, and the forwarded message
(chat sampling metadata dropped).

Errors: the seed's anyhow ``bail!`` errors and the encode error wrapped in its context are
:class:`ForwardingError`, whose ``str()`` is the upstream ``{error:#}`` rendering
("context: cause").  An error of the lossless selector propagates unchanged (upstream ``?``
without context).
"""

from __future__ import annotations

import copy
import enum
import struct
import time
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Optional

from .. import _impl
from .constants import (
    STAGE_WIRE_FIXED_HEADER_BYTES,
    ActivationCodec,
    CodecPolicy,
    LOSSLESS_CODECS,
    StateFlags,
    UpstreamEnum,
    activation_state_flags_from_frame_flags,
    wire_int,
    wrapped_i32,
)
from ..errors import ForwardingError, WireError
from .frame import MESSAGE_FLAGS_OFFSET, MESSAGE_SOURCE_STAGE_OFFSET
from .messages import StageStateHeader, StageWireMessage, WireMessageKind, f32_bits, short_repr


class ActivationDType(UpstreamEnum):
    """Runtime activation dtype of the v1 descriptor (runtime.md 2.2); ``rust_name`` is
    upstream's ``RuntimeActivationDType`` variant (its ``{:?}`` in error texts)."""

    UNKNOWN = 0
    F32 = 1
    F16 = 2
    BF16 = 3


class ActivationLayout(enum.IntEnum):
    """Row layout of a v1 descriptor's payload (runtime.md 2.2): opaque, or one row per token."""

    OPAQUE = 0
    TOKEN_MAJOR = 1


_DESC_V1 = struct.Struct("<Iiiiiii" "I" "QQ")  # 48 bytes, runtime.md 2.2
assert _DESC_V1.size == 48


@dataclass
class ActivationDescV1:
    """The 48-byte v1 activation descriptor (runtime.md 2.2)."""

    version: int = 1
    dtype: ActivationDType = ActivationDType.F32
    layout: ActivationLayout = ActivationLayout.TOKEN_MAJOR
    producer_stage_index: int = -1
    layer_start: int = 0
    layer_end: int = 0
    token_count: int = 0
    sequence_count: int = 1
    payload_bytes: int = 0
    flags: int = 0

    def to_bytes(self) -> bytes:
        return _DESC_V1.pack(
            self.version, int(self.dtype), int(self.layout), self.producer_stage_index, self.layer_start,
            self.layer_end, self.token_count, self.sequence_count, self.payload_bytes, self.flags,
        )

    @classmethod
    def from_bytes(cls, data) -> "ActivationDescV1":
        v = _DESC_V1.unpack(bytes(data))
        dtype = ActivationDType(v[1]) if v[1] in ActivationDType._value2member_map_ else v[1]
        layout = ActivationLayout(v[2]) if v[2] in ActivationLayout._value2member_map_ else v[2]
        return cls(v[0], dtype, layout, *v[3:])


@dataclass
class ActivationFrameV1:
    """Runtime output frame: descriptor plus payload (little-endian f32 rows for F32)."""

    desc: ActivationDescV1
    payload: bytes = b""

    __repr__ = short_repr

    @classmethod
    def f32(cls, values, token_count: int, flags: int = 0, **desc) -> "ActivationFrameV1":
        """An F32 frame from float values (test and tool convenience), each written as the
        message writers write a float (one beyond the f32 range is an infinity)."""
        payload = struct.pack(f"<{len(values)}I", *map(f32_bits, values))
        return cls(ActivationDescV1(dtype=ActivationDType.F32, token_count=token_count,
                                    payload_bytes=len(payload), flags=flags, **desc), payload)


#: Tokens of context a stage holds unless told otherwise (upstream StageConfig's default):
#: the one home of the 512 that ``serve``, ``run``, topology files and the runtime default to.
DEFAULT_CTX_SIZE = 512


@dataclass
class StageConfig:
    """The StageConfig fields forwarding uses (wire-format.md section 13), with upstream
    defaults for a few that servers read."""

    stage_index: int = 0
    layer_start: int = 0
    layer_end: int = 0
    activation_codec: ActivationCodec = ActivationCodec.RAW_F32_V1
    activation_codec_policy: CodecPolicy = CodecPolicy.FIXED
    stage_id: str = ""
    ctx_size: int = DEFAULT_CTX_SIZE
    lane_count: int = 4
    native_mtp_enabled: bool = True
    cache_type_k: str = "f16"
    cache_type_v: str = "f16"
    extra: dict = field(default_factory=dict)


class ForwardedStageMessage(NamedTuple):
    """The forwarded message and the time its activation took to encode (ms)."""

    message: StageWireMessage
    activation_encode_ms: float


def _dtype_name(dtype) -> str:
    try:
        return ActivationDType(dtype).rust_name
    except ValueError:
        return str(dtype)


def checked_codec_policy(config: StageConfig) -> tuple:
    """``(configured codec, policy)`` of ``config``; an incompatible pair -> ForwardingError."""
    configured = ActivationCodec(config.activation_codec)
    policy = CodecPolicy(config.activation_codec_policy)
    if not policy.compatible(configured):
        raise ForwardingError(
            f"activation codec policy {policy.rust_name} is incompatible with configured codec {configured.rust_name}"
        )
    return configured, policy


def _select_codec(config: StageConfig, incoming: StageWireMessage, output: ActivationFrameV1,
                  width: int, state_flags: int, codec_module):
    """Returns (codec, encoded bytes or None); the fused selector encodes while it selects."""
    configured, policy = checked_codec_policy(config)
    if policy is CodecPolicy.FIXED:
        return configured, None
    if output.desc.dtype != ActivationDType.F32:
        raise ForwardingError(f"unsupported activation dtype selection: {_dtype_name(output.desc.dtype)}")
    # Selector errors propagate unchanged (upstream `?` without context).
    codec, wire = codec_module.select_and_encode_lossless(
        incoming.token_count, width, output.payload, state_flags, [int(c) for c in LOSSLESS_CODECS]
    )
    return ActivationCodec(codec), wire


def _check_types(*arguments) -> None:
    """A one-line TypeError for the first ``(name, value, kind)`` whose value is no ``kind``."""
    for name, value, kind in arguments:
        if not isinstance(value, kind):
            article = "an" if kind.__name__[0] in "AEIOU" else "a"
            raise TypeError(f"{name} must be {article} {kind.__name__}, not {type(value).__name__}")


def forwarded_stage_message_timed(
    config: StageConfig,
    incoming: StageWireMessage,
    output: ActivationFrameV1,
    activation_width: int,
    *,
    impl: Optional[str] = None,
) -> ForwardedStageMessage:
    """Build the message forwarded downstream and time its activation encoding (ms)."""
    _check_types(("config", config, StageConfig), ("incoming", incoming, StageWireMessage),
                 ("output", output, ActivationFrameV1))
    _check_types(("incoming.state", incoming.state, StageStateHeader), ("output.desc", output.desc, ActivationDescV1))
    try:  # numpy's integers are integers; a bool is none
        activation_width = wire_int(activation_width)
    except TypeError:
        raise TypeError(f"activation_width must be an int, not {type(activation_width).__name__}") from None
    codec_module = _impl.cached_kernel_module("codec", impl)
    desc = output.desc
    check_full_range(config, incoming, desc.token_count)
    state = forwarded_state(config, incoming, activation_state_flags_from_frame_flags(desc.flags))
    # Steps 3-4 (under AutoLosslessV1 the fused selector also encodes, so it is timed).
    started = time.perf_counter()
    codec, wire = _select_codec(config, incoming, output, activation_width, state.flags, codec_module)
    state.activation_codec = codec
    # Step 5: encode with incoming.token_count rows; no fallback to raw on failure.  Both
    # the dtype check and the codec errors carry the upstream context.
    if wire is None:
        started = time.perf_counter()
        try:
            if desc.dtype != ActivationDType.F32:
                raise ForwardingError(f"unsupported activation dtype conversion: {_dtype_name(desc.dtype)} to f32")
            wire = codec_module.encode_activation(int(codec), incoming.token_count, activation_width,
                                                  output.payload, state.flags)
        except WireError as error:
            context = (
                f"encode f32 output activation payload; frame_dtype={_dtype_name(desc.dtype)} "
                f"incoming_tokens={incoming.token_count} output_tokens={desc.token_count} "
                f"activation_width={activation_width} payload_bytes={_byte_length(output.payload)} "
                f"frame_payload_bytes={desc.payload_bytes} state_flags={state.flags}"
            )
            raise ForwardingError(f"{context}: {error}", error) from error
    encode_ms = (time.perf_counter() - started) * 1000.0
    return ForwardedStageMessage(forwarded_message(incoming, state, wire), encode_ms)


def _byte_length(payload) -> int:
    """A payload's size in bytes (a numpy array's, not its element count), as far as it has one."""
    try:
        return memoryview(payload).nbytes
    except TypeError:
        return len(payload)


def check_full_range(config: StageConfig, incoming: StageWireMessage, produced_tokens: int) -> None:
    """Section 9 step 1: a stage with a downstream consumer must run the full incoming range
    unless it owns layer 0; a short frame would make the next stage attend over a prefix
    it never received."""
    if config.layer_start != 0 and produced_tokens != incoming.token_count:
        raise ForwardingError(
            f"stage {config.stage_index} (layers {config.layer_start}..{config.layer_end}) produced "
            f"{produced_tokens} activation tokens for {incoming.token_count} incoming tokens; "
            "non-first stages must execute the full range"
        )


def forwarded_state(config: StageConfig, incoming: StageWireMessage, extra_flags: int = 0):
    """Step 2: the u32 stage index reinterpreted as i32; incoming flag bits kept."""
    source = wrapped_i32(config.stage_index)
    state = copy.copy(incoming.state)  # a flat dataclass of ints: cheaper than replace()
    state.source_stage_index, state.flags = source, incoming.state.flags | extra_flags
    return state


def forwarded_message(incoming: StageWireMessage, state, activation) -> StageWireMessage:
    """Step 6: the forwarded message; chat metadata is not forwarded (the writer then
    clears its flag bit)."""
    return StageWireMessage(
        kind=incoming.kind,
        pos_start=incoming.pos_start,
        token_count=incoming.token_count,
        state=state,
        request_id=incoming.request_id,
        session_id=incoming.session_id,
        sampling=None if incoming.sampling is None else replace(
            incoming.sampling,
            logit_bias=list(incoming.sampling.logit_bias),
            dry_sequence_breakers=list(incoming.sampling.dry_sequence_breakers),
            samplers=list(incoming.sampling.samplers),
        ),
        chat_sampling_metadata=None,
        tokens=list(incoming.tokens),
        positions=list(incoming.positions),
        activation=activation,
        raw_bytes=b"",
    )


def forwarded_frame_message_timed(config: StageConfig, incoming: StageWireMessage, desc, payload,
                                  protocol) -> ForwardedStageMessage:
    """State versions 16 and 17: forward the runtime's multipart frame as it is.

    ``desc`` / ``payload`` are the frame (:class:`~.activation_frame.ActivationFrameV16` and
    its logical payload), ``protocol`` the link's :class:`~.protocol.WireProtocol`.  Under
    Fixed the configured codec encodes it; under AutoLosslessV1 the frame selector picks
    among the lossless codecs (A.6.4; S8 is never offered).  The message's activation is
    the encoded frame (v17: the writer turns it into agreement framing)."""
    check_full_range(config, incoming, desc.token_count)
    state = forwarded_state(config, incoming)
    configured, policy = checked_codec_policy(config)
    started = time.perf_counter()
    codec = configured
    if policy is not CodecPolicy.FIXED:
        codec = protocol.select_frame_codec(desc, payload, [int(c) for c in LOSSLESS_CODECS])
    state.activation_codec = codec
    wire = protocol.encode_frame(codec, desc, payload)
    encode_ms = (time.perf_counter() - started) * 1000.0
    return ForwardedStageMessage(forwarded_message(incoming, state, wire), encode_ms)


class ForwardedBytes(NamedTuple):
    """A forwarded message as the bytes to send, with what a stage counts of it."""

    data: bytes
    codec: ActivationCodec
    activation_bytes: int
    activation_encode_ms: float


_MESSAGE_HEAD = struct.Struct("<iiiii")  # kind, pos_start, token_count, token and position counts
_I32 = struct.Struct("<i")
_SOURCE_CODEC_COUNT = struct.Struct("<iii")
#: Bits the writer sets from the message's sampling block and chat metadata (section 4.4).
_WRITER_OWNED_FLAGS = int(StateFlags.SAMPLING | StateFlags.CHAT_SAMPLING_METADATA)


def forwarded_decode_bytes(config: StageConfig, incoming_raw, output_f32, produced_tokens: int,
                           activation_width: int, *, impl: Optional[str] = None) -> Optional[ForwardedBytes]:
    """Section 9 for a DecodeEmbd of state version 15, done on the incoming message's own
    bytes: the bytes of ``write_stage_message(forwarded_stage_message(...))`` without
    building a message.

    ``incoming_raw`` is the whole incoming message as received, ``output_f32`` the runtime's
    single F32 output part (what its v1 frame carries, v1 frame flags 0) with
    ``produced_tokens`` rows.  The forwarded message is the incoming one with the source
    stage, the codec and the activation replaced: the prefix, tokens and positions are
    copied, which is exact when no sampling block or chat metadata is present (the writer
    rewrites those).  Returns None when that does not hold, or the policy is not Fixed, or
    the shapes disagree, or the encoder refuses the values: the caller then takes
    :func:`forwarded_stage_message_timed`, which raises the upstream error where there is one.
    """
    if len(incoming_raw) < STAGE_WIRE_FIXED_HEADER_BYTES:
        return None
    kind, _, token_count, n_tokens, n_positions = _MESSAGE_HEAD.unpack_from(incoming_raw, 0)
    flags = _I32.unpack_from(incoming_raw, MESSAGE_FLAGS_OFFSET)[0]
    source = wrapped_i32(config.stage_index)
    head = STAGE_WIRE_FIXED_HEADER_BYTES + 4 * (n_tokens + n_positions)
    policy = CodecPolicy(config.activation_codec_policy)
    if (kind != WireMessageKind.DECODE_EMBD or flags & _WRITER_OWNED_FLAGS or n_tokens < 0 or n_positions < 0
            or head > len(incoming_raw) or policy is not CodecPolicy.FIXED or source < 0
            or produced_tokens != token_count or len(output_f32) != 4 * activation_width * token_count):
        return None
    codec = ActivationCodec(config.activation_codec)
    started = time.perf_counter()
    try:
        wire = _impl.cached_kernel_module("codec", impl).encode_activation(
            int(codec), token_count, activation_width, output_f32, flags)
    except WireError:
        return None
    encode_ms = (time.perf_counter() - started) * 1000.0
    out = bytearray(memoryview(incoming_raw)[:head])
    _SOURCE_CODEC_COUNT.pack_into(out, MESSAGE_SOURCE_STAGE_OFFSET, source, int(codec), len(wire))
    out += wire
    return ForwardedBytes(bytes(out), codec, len(wire), encode_ms)


def forwarded_stage_message(
    config: StageConfig,
    incoming: StageWireMessage,
    output: ActivationFrameV1,
    activation_width: int,
    *,
    impl: Optional[str] = None,
) -> StageWireMessage:
    """The message a stage forwards downstream (section 9)."""
    return forwarded_stage_message_timed(config, incoming, output, activation_width, impl=impl).message


__all__ = [
    "ForwardingError", "ActivationDType", "ActivationLayout", "ActivationDescV1", "ActivationFrameV1",
    "DEFAULT_CTX_SIZE", "StageConfig", "ForwardedStageMessage", "ForwardedBytes", "forwarded_decode_bytes",
    "forwarded_stage_message",
    "forwarded_stage_message_timed",
    "forwarded_frame_message_timed", "checked_codec_policy", "check_full_range", "forwarded_state", "forwarded_message",
]
