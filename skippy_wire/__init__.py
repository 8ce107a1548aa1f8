"""skippy_wire: the skippy stage wire protocol (state version 15), byte-compatible with the
Rust skippy-protocol crate, with compiled kernels and a pure-Python reference twin.

``IMPLEMENTATION`` says which kernels are live ("cython" or "python");
``SKIPPY_WIRE_IMPL=python`` forces the twin.
"""

from ._impl import IMPLEMENTATION
from .errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError

# --- public re-exports of each concept module (one block per module) ---
from .wire.constants import (
    READY_MAGIC,
    STAGE_STATE_VERSION,
    ActivationCodec,
    CodecPolicy,
    StateFlags,
    activation_frame_flags_from_state_flags,
    activation_payload_multiplier_from_state_flags,
    activation_state_flags_from_frame_flags,
)
from .wire.codec import (
    activation_f32_bytes,
    activation_shape,
    activation_wire_bytes,
    bf16_view,
    decode_activation,
    encode_activation,
    encode_f32_activation_payload,
    f16_view,
    is_bf16_exact,
    is_f16_exact,
    select_and_encode_lossless,
    select_lossless_codec,
)
from .wire.messages import (
    F32,
    LogitBias,
    RequestEpoch,
    SamplingConfig,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind,
    WireStagePhase,
)
from .wire.replies import NativeMtpDraft, StageReply, StageReplyStats, StageReplyWindow, WireReplyKind
from .wire.frame import (
    StageMessageDecoder,
    StageReplyDecoder,
    iter_stage_messages,
    read_reply,
    read_reply_from_buffer,
    read_stage_message,
    read_stage_message_from_buffer,
    recv_ready,
    recv_reply,
    send_ready,
    send_reply_ack,
    send_reply_ack_with_stats,
    send_reply_message,
    send_reply_predicted,
    send_reply_predicted_tokens_with_stats,
    send_reply_predicted_tokens_with_window_and_stats,
    send_reply_predicted_with_stats,
    send_reply_predicted_with_tokens_and_stats,
    send_reply_predicted_with_tokens_window_and_stats,
    write_reply,
    write_stage_message,
    write_stage_message_to,
)
from .wire.forwarding import StageConfig, forwarded_stage_message, forwarded_stage_message_timed
