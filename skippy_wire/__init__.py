"""skippy_wire: the skippy stage wire protocol, byte-compatible with the Rust
skippy-protocol crate, with compiled kernels and a pure-Python reference twin.

The names here (``__all__``) are the state version 15 API (the default everywhere):
activation codecs, stage messages, framing, replies, READY and forwarding.  State versions
16 and 17 are spoken through ``skippy_wire.wire.protocol.WireProtocol(version)``
(docs/wire-format.md).  Every error about bytes, messages, model files or peers is a class
of :mod:`skippy_wire.errors` (``SkippyError``); the wire ones (``WireError``, its three
upstream kinds and ``ForwardingError``) are re-exported here.  A call's own argument of the
wrong type or value is Python's TypeError or ValueError, a file that cannot be opened an OSError.

``IMPLEMENTATION`` says which kernels are live ("cython" or "python");
``SKIPPY_WIRE_IMPL=python`` (set before the first import) forces the twin, and every
framing and forwarding function but READY's (four bytes, no kernel) also takes
``impl="cython"|"python"`` for one call.

``import skippy_wire`` itself is cheap: each public name is imported from its module on
first use (so ``import skippy_wire.errors`` or the command line pay for nothing else).
"""

import importlib
from typing import TYPE_CHECKING

# Importing the package loads nothing heavy (numpy, the compiled kernels): the command line
# must get to its Ctrl-C handling first, and ``skippy_wire.errors`` alone should stay cheap.
# Each public name is imported from its module on first use (PEP 562).
_PUBLIC: dict[str, tuple[str, ...]] = {
    "._impl": ("IMPLEMENTATION",),
    ".errors": ("ForwardingError", "InvalidDataError", "InvalidInputError", "UnexpectedEofError", "WireError"),
    ".wire.constants": ("READY_MAGIC", "STAGE_STATE_VERSION", "ActivationCodec", "CodecPolicy", "StateFlags",
        "activation_frame_flags_from_state_flags",
        "activation_payload_multiplier_from_state_flags",
        "activation_state_flags_from_frame_flags"),
    ".wire.codec": ("activation_f32_bytes", "activation_shape", "activation_wire_bytes", "bf16_view",
        "decode_activation", "encode_activation", "encode_f32_activation_payload", "f16_view",
        "is_bf16_exact", "is_f16_exact", "select_and_encode_lossless", "select_lossless_codec"),
    ".wire.messages": ("F32", "LogitBias", "RequestEpoch", "SamplingConfig", "StageStateHeader",
        "StageWireMessage", "WireMessageKind", "WireStagePhase"),
    ".wire.replies": ("NativeMtpDraft", "StageReply", "StageReplyStats", "StageReplyWindow", "WireReplyKind"),
    ".wire.frame": ("StageMessageDecoder", "StageReplyDecoder", "iter_stage_messages", "read_reply",
        "read_reply_from_buffer", "read_stage_message", "read_stage_message_from_buffer",
        "recv_ready", "recv_reply", "send_ready", "send_reply_ack", "send_reply_ack_with_stats",
        "send_reply_message", "send_reply_predicted", "send_reply_predicted_tokens_with_stats",
        "send_reply_predicted_tokens_with_window_and_stats", "send_reply_predicted_with_stats",
        "send_reply_predicted_with_tokens_and_stats",
        "send_reply_predicted_with_tokens_window_and_stats", "write_reply", "write_stage_message",
        "write_stage_message_to"),
    ".wire.forwarding": ("ActivationDType", "ActivationDescV1", "ActivationFrameV1", "ActivationLayout", "StageConfig",
        "ForwardedStageMessage", "forwarded_stage_message", "forwarded_stage_message_timed"),
}

if TYPE_CHECKING:  # the same names for type checkers, re-exported as PEP 484 spells it (`X as X`)
    from ._impl import (IMPLEMENTATION as IMPLEMENTATION)
    from .errors import (ForwardingError as ForwardingError, InvalidDataError as InvalidDataError,
        InvalidInputError as InvalidInputError,
        UnexpectedEofError as UnexpectedEofError, WireError as WireError)
    from .wire.constants import (READY_MAGIC as READY_MAGIC, STAGE_STATE_VERSION as STAGE_STATE_VERSION,
        ActivationCodec as ActivationCodec, CodecPolicy as CodecPolicy, StateFlags as StateFlags,
        activation_frame_flags_from_state_flags as activation_frame_flags_from_state_flags,
        activation_payload_multiplier_from_state_flags as activation_payload_multiplier_from_state_flags,
        activation_state_flags_from_frame_flags as activation_state_flags_from_frame_flags)
    from .wire.codec import (activation_f32_bytes as activation_f32_bytes,
        activation_shape as activation_shape, activation_wire_bytes as activation_wire_bytes,
        bf16_view as bf16_view, decode_activation as decode_activation,
        encode_activation as encode_activation,
        encode_f32_activation_payload as encode_f32_activation_payload, f16_view as f16_view,
        is_bf16_exact as is_bf16_exact, is_f16_exact as is_f16_exact,
        select_and_encode_lossless as select_and_encode_lossless,
        select_lossless_codec as select_lossless_codec)
    from .wire.messages import (F32 as F32, LogitBias as LogitBias, RequestEpoch as RequestEpoch,
        SamplingConfig as SamplingConfig, StageStateHeader as StageStateHeader,
        StageWireMessage as StageWireMessage, WireMessageKind as WireMessageKind,
        WireStagePhase as WireStagePhase)
    from .wire.replies import (NativeMtpDraft as NativeMtpDraft, StageReply as StageReply,
        StageReplyStats as StageReplyStats, StageReplyWindow as StageReplyWindow,
        WireReplyKind as WireReplyKind)
    from .wire.frame import (StageMessageDecoder as StageMessageDecoder,
        StageReplyDecoder as StageReplyDecoder, iter_stage_messages as iter_stage_messages,
        read_reply as read_reply, read_reply_from_buffer as read_reply_from_buffer,
        read_stage_message as read_stage_message,
        read_stage_message_from_buffer as read_stage_message_from_buffer, recv_ready as recv_ready,
        recv_reply as recv_reply, send_ready as send_ready, send_reply_ack as send_reply_ack,
        send_reply_ack_with_stats as send_reply_ack_with_stats, send_reply_message as send_reply_message,
        send_reply_predicted as send_reply_predicted,
        send_reply_predicted_tokens_with_stats as send_reply_predicted_tokens_with_stats,
        send_reply_predicted_tokens_with_window_and_stats as send_reply_predicted_tokens_with_window_and_stats,
        send_reply_predicted_with_stats as send_reply_predicted_with_stats,
        send_reply_predicted_with_tokens_and_stats as send_reply_predicted_with_tokens_and_stats,
        send_reply_predicted_with_tokens_window_and_stats as send_reply_predicted_with_tokens_window_and_stats,
        write_reply as write_reply, write_stage_message as write_stage_message,
        write_stage_message_to as write_stage_message_to)
    from .wire.forwarding import (ActivationDType as ActivationDType, ActivationDescV1 as ActivationDescV1,
        ActivationFrameV1 as ActivationFrameV1, ActivationLayout as ActivationLayout, StageConfig as StageConfig,
        ForwardedStageMessage as ForwardedStageMessage,
        forwarded_stage_message as forwarded_stage_message,
        forwarded_stage_message_timed as forwarded_stage_message_timed)

else:  # (hidden from type checkers, which would otherwise take every misspelt name as Any)
    def __getattr__(name: str):
        for module, names in _PUBLIC.items():
            if name in names:
                value = getattr(importlib.import_module(module, __name__), name)
                globals()[name] = value  # once: later lookups do not come here
                return value
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))


#: The public API: what ``from skippy_wire import *`` gives.
__all__ = [name for names in _PUBLIC.values() for name in names]
