"""Activation codecs: encode, decode, size and lossless selection (wire-format.md 5-8).

This module documents the API and calls the live kernel implementation
(``skippy_wire.wire._codec`` or, under ``SKIPPY_WIRE_IMPL=python``, the pure-Python twin
``skippy_wire.wire._reference.codec``).  The compiled module is looked up on first use, so
importing this module never fails; calling it without the extension built raises
``ImportError`` (never a silent fallback to the slow twin).

Payloads read as f32 values (encode, selection, the exactness predicates) are any
C-contiguous buffer whose elements are little-endian f32 values, their bit patterns, or raw
bytes: ``bytes``, ``bytearray``, ``memoryview``, ``array.array("f")``, numpy arrays of
float32, uint32, uint8 or int8 (buffer formats ``'B'``, ``'b'``, ``'c'``, and ``'f'`` /
``'I'`` little-endian).  Any other element type (float64, int32, float16, bfloat16,
big-endian f32) is an :class:`InvalidInputError` naming its format or dtype, never a
silent reinterpretation.  Wire payloads (decode) are any C-contiguous buffer of bytes.
Either may be misaligned.  A non-contiguous buffer raises :class:`InvalidInputError`; an
object without the buffer protocol ``TypeError("a bytes-like object is required, not
'list'")``.

Arguments are checked by the kernels themselves, identically in both implementations:
codecs and dimensions accept anything with ``__index__`` (``ActivationCodec``, numpy
integers) but a bool, an unknown codec id raises "unknown stage activation codec", a
non-integer (or a bool) ``TypeError``.

Every protocol error is an :class:`~skippy_wire.errors.InvalidDataError` whose text is
the exact upstream message, raised in the upstream check order.  Payload-sized work in
the compiled implementation runs with the GIL released.
"""

from __future__ import annotations

from collections.abc import Iterable
from types import ModuleType
from typing import TYPE_CHECKING, Optional, SupportsIndex, Union, overload

import numpy as np

from .. import _impl
from ..errors import InvalidDataError, InvalidInputError
from .field_checks import bytes_like_view, flat_bytes, holds_objects
from .constants import (
    LOSSLESS_CODECS,
    NON_CONTIGUOUS_TEXT,
    OBJECT_ARRAY_TEXT,
    WIRE_SIZE_TEXT,
    ActivationCodec,
    activation_frame_flags_from_state_flags,
    activation_payload_multiplier_from_state_flags,
    activation_state_flags_from_frame_flags,
)

__all__ = [
    "activation_f32_bytes",
    "activation_frame_flags_from_state_flags",
    "activation_payload_multiplier_from_state_flags",
    "activation_shape",
    "activation_state_flags_from_frame_flags",
    "activation_wire_bytes",
    "bf16_view",
    "decode_activation",
    "encode_activation",
    "encode_f32_activation_payload",
    "f16_view",
    "is_bf16_exact",
    "is_f16_exact",
    "kernels",
    "select_and_encode_lossless",
    "select_lossless_codec",
]

if TYPE_CHECKING:
    from typing_extensions import Buffer, TypeAlias  # bytes, bytearray, memoryview, array, ...

    #: What a payload argument takes.  numpy declares ``ndarray.__buffer__`` to type checkers
    #: only for Python >= 3.12, so arrays are named explicitly.
    BufferLike: TypeAlias = Union[Buffer, np.ndarray]

#: A codec or a dimension argument takes anything with ``__index__`` (a numpy integer too).
IntLike = SupportsIndex
CodecLike = Union[ActivationCodec, IntLike]

_kernels: ModuleType | None = None


def kernels() -> ModuleType:
    """The live codec kernel module (see ``skippy_wire.IMPLEMENTATION``)."""
    global _kernels
    if _kernels is None:
        _kernels = _impl.kernel_module("codec")
    return _kernels


def activation_shape(token_count: IntLike, n_embd: IntLike, state_flags: IntLike = 0) -> tuple[int, int, int]:
    """Rows and columns of a frame (wire-format.md 5.1).

    Parameters: ``token_count`` (i32, >= 0), ``n_embd`` (i32, > 0), ``state_flags``
    (state flag word; RWKV7_V_FIRST and INKLING_MTP_EMBD sidebands double the rows).

    Returns ``(primary_rows, sideband_rows, columns)``.

    Raises :class:`InvalidDataError` "negative activation dimensions" when
    ``token_count < 0`` or ``n_embd <= 0``; :class:`InvalidInputError` when a dimension
    or ``state_flags`` does not fit in an i32.
    """
    return kernels().activation_shape(token_count, n_embd, state_flags)


def activation_f32_bytes(token_count: IntLike, n_embd: IntLike, state_flags: IntLike = 0) -> int:
    """Byte size of a frame as f32 (wire-format.md 5.2; upstream
    ``activation_wire_bytes_with_state_flags``).  ``n_embd = 0`` is allowed and gives 0;
    there is no maximum check.

    Raises :class:`InvalidDataError` "negative activation dimensions" (a negative
    dimension) or an overflow text.
    """
    return kernels().activation_f32_bytes(token_count, n_embd, state_flags)


def activation_wire_bytes(codec: CodecLike, token_count: IntLike, n_embd: IntLike, state_flags: IntLike = 0) -> int:
    """Encoded payload size of a frame in ``codec`` (wire-format.md 5.3).

    Raises :class:`InvalidDataError`: "unknown stage activation codec", "negative
    activation dimensions", "activation wire byte count overflow", "activation payload
    byte count exceeds maximum" (over 512 MiB).
    """
    return kernels().activation_wire_bytes(
        codec, token_count, n_embd, state_flags
    )


@overload
def encode_activation(codec: CodecLike, token_count: IntLike, n_embd: IntLike, payload: BufferLike,
                      state_flags: IntLike = 0, *, out: None = None) -> bytes: ...
@overload
def encode_activation(codec: CodecLike, token_count: IntLike, n_embd: IntLike, payload: BufferLike,
                      state_flags: IntLike = 0, *, out: BufferLike) -> memoryview: ...
def encode_activation(
    codec: CodecLike,
    token_count: IntLike,
    n_embd: IntLike,
    payload: BufferLike,
    state_flags: IntLike = 0,
    *,
    out: Optional[BufferLike] = None,
) -> bytes | memoryview:
    """Encode an f32 activation frame for the wire (wire-format.md 7.1 and 6.2).

    Parameters:
        codec: the activation codec (``ActivationCodec`` or wire id 1..4).
        token_count, n_embd: the frame shape (i32; ``n_embd`` > 0).
        payload: C-contiguous buffer holding ``rows * n_embd`` little-endian f32 values,
            primary rows first, then the sideband rows (f32 values or raw bytes, see the
            module docstring).
        state_flags: the state flag word (default 0).
        out: optional writable C-contiguous buffer (``bytearray``, writable
            ``memoryview``, numpy array of any dtype; its byte length counts) of at least
            :func:`activation_wire_bytes` bytes, not overlapping ``payload``.  Reusing one
            avoids allocating (and page-faulting) a new result per call.

    Returns the encoded bytes; with ``out``, a flat unsigned-byte ``memoryview`` of
    exactly the encoded bytes, written at the start of ``out`` (the rest is untouched).

    Raises :class:`InvalidDataError` with the upstream text, in upstream order:
    "negative activation dimensions", "decoded activation byte count overflow",
    "decoded activation payload byte count exceeds maximum", "F32 activation payload
    size mismatch", "activation values must be finite" (F16/BF16/S8), "F16 activation
    value is out of range" (|x| >= 65520), "BF16 activation value is out of range",
    "S8 activation value is out of range"; :class:`InvalidInputError` for a
    non-contiguous payload or one whose elements are not f32 or raw bytes.

    ``out`` is checked where the result would otherwise be allocated: after the size
    checks (and, for S8, the finiteness scan), before anything is written.  It raises
    :class:`InvalidInputError` "out must be a C-contiguous buffer", "out must be a
    writable buffer", "out buffer too small: H bytes for an encoded size of N bytes",
    "out must not overlap the payload" or "out must not be an array of Python objects".
    A value error found while converting (F16/BF16 range or non-finite, S8 range) may
    leave ``out`` partially written.
    """
    return kernels().encode_activation(
        codec, token_count, n_embd, payload, state_flags, out=out
    )


def encode_f32_activation_payload(token_count: IntLike, n_embd: IntLike, payload: BufferLike,
                                  state_flags: IntLike = 0) -> bytes:
    """Raw f32 encode with the f32 size checks first (wire-format.md 7.2).

    Returns the payload bytes unchanged.  Raises as :func:`encode_activation`; a zero
    ``n_embd`` passes the size check and then fails with "negative activation dimensions".
    """
    return kernels().encode_f32_activation_payload(
        token_count, n_embd, payload, state_flags
    )


def decode_activation(codec: CodecLike, token_count: IntLike, n_embd: IntLike, wire: BufferLike,
                      state_flags: IntLike = 0) -> np.ndarray:
    """Decode an activation wire payload (wire-format.md 7.4 and 6.3).

    Returns a new 1-D ``float32`` array with every value, bit patterns preserved, whose
    memory nothing the caller holds shares (the compiled twin's array owns it; the reference
    twin's lies over a private ``array.array``).

    Raises :class:`InvalidDataError`: "unknown stage activation codec", "negative
    activation dimensions", "decoded activation payload byte count exceeds maximum",
    "activation payload byte count exceeds maximum", "activation payload size mismatch",
    "activation payload contains non-finite value", "S8 activation row scale is not
    finite and positive", "S8 activation payload contains reserved -128 value".
    """
    return kernels().decode_activation(
        codec, token_count, n_embd, wire, state_flags
    )


def select_lossless_codec(token_count: IntLike, n_embd: IntLike, payload: BufferLike, state_flags: IntLike = 0,
                          permitted: Iterable[CodecLike] = LOSSLESS_CODECS) -> ActivationCodec:
    """The AutoLosslessV1 selector (wire-format.md 7.3 and 8.1).

    Returns BF16 if every value (primary and sideband) is bf16-exact and BF16 is
    permitted, else F16 if every value is f16-exact and F16 is permitted, else RAW.
    An empty frame always gives RAW.  ``permitted`` order and duplicates are ignored.

    Raises :class:`InvalidDataError`: the size errors of :func:`encode_activation`, then
    "lossless activation selection requires RawF32 fallback" when RAW is not permitted.
    Non-finite values are not an error: they make the answer RAW.
    """
    return ActivationCodec(
        kernels().select_lossless_codec(
            token_count, n_embd, payload, state_flags, permitted
        )
    )


def select_and_encode_lossless(token_count: IntLike, n_embd: IntLike, payload: BufferLike, state_flags: IntLike = 0,
                               permitted: Iterable[CodecLike] = LOSSLESS_CODECS) -> tuple[ActivationCodec, bytes]:
    """:func:`select_lossless_codec` and :func:`encode_activation` in one pass over the
    payload where possible.  Returns ``(codec, encoded bytes)``; raises as the two do."""
    codec, wire = kernels().select_and_encode_lossless(
        token_count, n_embd, payload, state_flags, permitted
    )
    return ActivationCodec(codec), wire


def is_bf16_exact(payload: BufferLike) -> bool:
    """Whether every f32 of ``payload`` survives a bf16 round trip bit for bit.

    NaN and infinity are never exact; -0.0 is; an f32 subnormal is exact only when its
    low 16 bits are zero.  Raises :class:`InvalidDataError` "F32 activation payload size
    mismatch" when the byte length is not a multiple of 4.
    """
    return kernels().is_bf16_exact(payload)


def is_f16_exact(payload: BufferLike) -> bool:
    """Whether every f32 of ``payload`` survives an f16 round trip bit for bit.

    NaN and infinity are never exact, nor is any f32 subnormal or any |x| >= 65520;
    -0.0 is exact.  Raises as :func:`is_bf16_exact`.
    """
    return kernels().is_f16_exact(payload)


def _wire_bytes_view(wire: BufferLike) -> np.ndarray:
    if isinstance(wire, np.ndarray):
        if holds_objects(wire):  # its buffer holds the objects' addresses
            raise InvalidInputError(OBJECT_ARRAY_TEXT)
        if not wire.flags.c_contiguous:
            raise InvalidInputError(NON_CONTIGUOUS_TEXT)
        return wire.reshape(-1).view(np.uint8)
    view = bytes_like_view(wire)
    if not view.c_contiguous:
        raise InvalidInputError(NON_CONTIGUOUS_TEXT)
    return np.frombuffer(flat_bytes(view), dtype=np.uint8)


def _half_view(wire: BufferLike, dtype: np.dtype) -> np.ndarray:
    raw = _wire_bytes_view(wire)
    if raw.nbytes % 2:
        raise InvalidDataError(WIRE_SIZE_TEXT)
    return raw.view(dtype)


def bf16_view(wire: BufferLike) -> np.ndarray:
    """Zero-copy ``ml_dtypes.bfloat16`` view of a BF16 wire payload (no value checks).

    The view shares memory with ``wire`` (read-only for ``bytes``).  Raises
    :class:`InvalidDataError` "activation payload size mismatch" for an odd byte length,
    :class:`InvalidInputError` for a non-contiguous buffer or an array of Python objects.
    """
    import ml_dtypes  # here, not at the top: its import costs a command-line start ~1.5 s

    return _half_view(wire, np.dtype(ml_dtypes.bfloat16))  # little-endian hosts only, as numpy itself


def f16_view(wire: BufferLike) -> np.ndarray:
    """Zero-copy ``numpy.float16`` view of an F16 wire payload (no value checks).

    Raises as :func:`bf16_view`.
    """
    return _half_view(wire, np.dtype("<f2"))
