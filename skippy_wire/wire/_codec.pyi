"""Type stub of the compiled codec kernels (skippy_wire/_codec.pyx).

The pure-Python twin ``skippy_wire.wire._reference.codec`` has the same functions with the
same signatures (all but the test and benchmark switches at the end, which are compiled
only).  Codecs are wire ids (1..4).  Payloads read as f32 values (encode, selection,
``is_*_exact``) are C-contiguous buffers of little-endian f32 values, their uint32 bit
patterns, or raw bytes (buffer formats 'B', 'b', 'c', little-endian 'f' / 'I'; numpy
float32, uint32, uint8, int8); another element type is an InvalidInputError naming its
format or dtype (``PAYLOAD_FORMAT``).  Wire payloads (``decode_activation``) and ``out``
are any C-contiguous buffer of bytes.  An object without the buffer protocol is a
TypeError (``NOT_BYTES_LIKE``: "a bytes-like object is required, not 'list'").  Errors
are ``skippy_wire.errors`` classes with the exact upstream texts.  Payload-sized work
releases the GIL from ``NOGIL_THRESHOLD`` bytes.  ``encode_activation(..., out=buf)``
writes into a caller's writable buffer instead and returns a memoryview of the encoded
bytes at its start.
"""

from collections.abc import Iterable
from typing import overload

from typing_extensions import Buffer

import numpy as np
import numpy.typing as npt

# numpy declares ndarray.__buffer__ only for Python >= 3.12: name arrays explicitly.
_BufferLike = Buffer | np.ndarray

NOGIL_THRESHOLD: int
NON_CONTIGUOUS: str
OBJECT_ARRAY: str
DIMENSION_RANGE: str
STATE_FLAGS_RANGE: str
BITS_DTYPE_U32: str
BITS_DTYPE_U16: str
OUT_NON_CONTIGUOUS: str
OUT_READ_ONLY: str
OUT_OBJECT_ARRAY: str
OUT_OVERLAP: str
PAYLOAD_FORMAT: str
NOT_BYTES_LIKE: str

def activation_shape(token_count: int, n_embd: int, state_flags: int) -> tuple[int, int, int]: ...
def activation_f32_bytes(token_count: int, n_embd: int, state_flags: int) -> int: ...
def activation_wire_bytes(codec: int, token_count: int, n_embd: int, state_flags: int) -> int: ...
@overload
def encode_activation(codec: int, token_count: int, n_embd: int, payload: _BufferLike, state_flags: int, *, out: None = None) -> bytes: ...
@overload
def encode_activation(codec: int, token_count: int, n_embd: int, payload: _BufferLike, state_flags: int, *, out: _BufferLike) -> memoryview: ...
def encode_f32_activation_payload(token_count: int, n_embd: int, payload: _BufferLike, state_flags: int) -> bytes: ...
def decode_activation(codec: int, token_count: int, n_embd: int, wire: _BufferLike, state_flags: int) -> npt.NDArray[np.float32]: ...
def select_lossless_codec(token_count: int, n_embd: int, payload: _BufferLike, state_flags: int, permitted: Iterable[int]) -> int: ...
def select_and_encode_lossless(
    token_count: int, n_embd: int, payload: _BufferLike, state_flags: int, permitted: Iterable[int]
) -> tuple[int, bytes]: ...
def is_bf16_exact(payload: _BufferLike) -> bool: ...
def is_f16_exact(payload: _BufferLike) -> bool: ...
def f32_bits_to_bf16_bits(bits: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]: ...
def f32_bits_to_f16_bits(bits: npt.NDArray[np.uint32]) -> npt.NDArray[np.uint16]: ...
def bf16_bits_to_f32_bits(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.uint32]: ...
def f16_bits_to_f32_bits(bits: npt.NDArray[np.uint16]) -> npt.NDArray[np.uint32]: ...

# Test and benchmark switches.
def _set_simd(enabled: bool) -> bool: ...
def simd_active() -> bool: ...
def _set_nogil_threshold(nbytes: int) -> int: ...
