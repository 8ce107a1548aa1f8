"""Type stub of the compiled framing kernels (same API as ``skippy_wire.wire._reference.frame``)."""

from typing import Optional

from .messages import StageWireMessage
from .replies import StageReply

def write_stage_message(msg: StageWireMessage) -> bytes:
    """Serialize a stage message (wire-format.md 4.4). A failing check raises
    InvalidInputError / InvalidDataError with ``partial`` = the bytes upstream would have
    emitted."""

def read_stage_message_from_buffer(
    data: bytes | bytearray | memoryview,
    n_embd: int,
    expected_codec: Optional[int] = None,
    policy: int = 0,
    offset: int = 0,
) -> tuple[StageWireMessage, int]:
    """Parse one message at ``offset`` -> (message, consumed). ``expected_codec`` None
    accepts any codec; ``policy`` 0 = Fixed, 1 = AutoLosslessV1. A short buffer raises
    UnexpectedEofError with ``needed`` (bytes from ``offset``)."""

def write_reply(reply: StageReply) -> bytes:
    """Serialize a reply (wire-format.md 11.2)."""

def read_reply_from_buffer(data: bytes | bytearray | memoryview, offset: int = 0) -> tuple[StageReply, int]:
    """Parse one reply at ``offset`` -> (reply, consumed)."""
