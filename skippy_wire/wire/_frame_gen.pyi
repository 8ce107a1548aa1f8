"""Type stub of the compiled framing kernels of state versions 16 and 17 (same API as
``skippy_wire.wire._reference.frame_gen``)."""

from typing import Iterable, Optional

from .activation_frame import ActivationFrameV16
from .agreement import ActivationAgreement
from .constants import ActivationCodec
from .messages import StageWireMessage

_Bytes = bytes | bytearray | memoryview
_Codec = ActivationCodec | int

def validate_frame(desc: ActivationFrameV16, payload_len: Optional[int] = None) -> None:
    """A.5: raise InvalidDataError naming the first rule ``desc`` breaks (and, given
    ``payload_len``, a payload of another size)."""

def frame_wire_bytes(codec: _Codec, desc: ActivationFrameV16) -> int:
    """The size of ``desc``'s frame on the wire under ``codec`` (descriptor included)."""

def encode_frame(codec: _Codec, desc: ActivationFrameV16, payload: _Bytes) -> bytes:
    """A v16 activation frame: the descriptor, then each part's payload under ``codec``."""

def decode_frame(codec: _Codec, data: _Bytes, version: int = 16) -> tuple[ActivationFrameV16, bytes]:
    """Parse a whole frame -> (descriptor, payload as raw values)."""

def select_frame_codec(desc: ActivationFrameV16, payload: _Bytes, permitted: Iterable[_Codec]) -> int:
    """AutoLosslessV1 over a frame: the first permitted codec exact for every part."""

def validate_agreement(agreement: ActivationAgreement) -> None:
    """B.5: raise InvalidDataError naming the first rule ``agreement`` breaks."""

def agreed_wire_bytes(agreement: ActivationAgreement, codec: _Codec, desc: ActivationFrameV16) -> int:
    """The size of ``desc``'s agreement-framed activation on the wire under ``codec``."""

def agreed_encode(agreement: ActivationAgreement, codec: _Codec, desc: ActivationFrameV16, payload: _Bytes) -> bytes:
    """B.6: an agreement-framed activation (generation, profile id, counts, dynamic
    dimensions, parts)."""

def agreed_reframe(agreement: ActivationAgreement, desc: ActivationFrameV16, frame: _Bytes) -> bytes:
    """``encode_existing``: the encoded v16 ``frame`` (already decoded as ``desc``) with
    its payload section copied under the agreement's framing."""

def agreed_decode(agreement: ActivationAgreement, codec: _Codec, data: _Bytes) -> tuple[ActivationFrameV16, bytes]:
    """Parse an agreement-framed activation -> (descriptor, payload as raw values)."""

def read_stage_message_from_buffer(
    version: int,
    data: _Bytes,
    expected_codec: Optional[int] = None,
    policy: int = 0,
    offset: int = 0,
    agreement: Optional[ActivationAgreement] = None,
) -> tuple[StageWireMessage, int]:
    """Parse one v16 or v17 message at ``offset`` -> (message, consumed); a short buffer
    raises UnexpectedEofError with ``needed``."""

def write_stage_message(version: int, msg: StageWireMessage, agreement: Optional[ActivationAgreement] = None) -> bytes:
    """Serialize a v16 or v17 stage message (v17 activations under ``agreement``)."""

def message_wire_bytes(msg: StageWireMessage, agreement: Optional[ActivationAgreement]) -> int:
    """B.7.4 ``wire_bytes(agreement)``: the v17 size of ``msg`` on the wire."""
