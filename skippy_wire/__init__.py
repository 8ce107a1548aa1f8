"""skippy_wire: the skippy stage wire protocol (state version 15), byte-compatible with the
Rust skippy-protocol crate, with compiled kernels and a pure-Python reference twin.

``IMPLEMENTATION`` says which kernels are live ("cython" or "python");
``SKIPPY_WIRE_IMPL=python`` forces the twin.
"""

from ._impl import IMPLEMENTATION
from .wire.constants import (
    ActivationCodec,
    CodecPolicy,
    activation_frame_flags_from_state_flags,
    activation_payload_multiplier_from_state_flags,
    activation_state_flags_from_frame_flags,
)
from .errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError

# --- public re-exports of each concept module (one block per module) ---
from .wire.codec import (
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
from .wire.codec import activation_f32_bytes, activation_shape, activation_wire_bytes
# framing (messages, frame, forwarding)
from .wire.messages import (
    READY_MAGIC,
    STAGE_STATE_VERSION,
    F32,
    NativeMtpDraft,
    SamplingConfig,
    StageReply,
    StageReplyStats,
    StageReplyWindow,
    StageStateHeader,
    StageWireMessage,
    StateFlags,
    WireMessageKind,
    WireReplyKind,
    WireStagePhase,
)
from .wire.frame import (
    StageMessageDecoder,
    read_reply,
    read_stage_message,
    read_stage_message_from_buffer,
    recv_ready,
    send_ready,
    write_reply,
    write_stage_message,
    write_stage_message_to,
)
from .wire.forwarding import StageConfig, forwarded_stage_message, forwarded_stage_message_timed
