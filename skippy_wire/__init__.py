"""skippy_wire: the skippy stage wire protocol (state version 15), byte-compatible with the
Rust skippy-protocol crate, with compiled kernels and a pure-Python reference twin.

``IMPLEMENTATION`` says which kernels are live ("cython" or "python");
``SKIPPY_WIRE_IMPL=python`` forces the twin.
"""

from ._impl import IMPLEMENTATION
from .dtypes import (
    ActivationCodec,
    CodecPolicy,
    activation_frame_flags_from_state_flags,
    activation_payload_multiplier_from_state_flags,
    activation_state_flags_from_frame_flags,
)
from .errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError

# --- public re-exports of each concept module (one block per module) ---
