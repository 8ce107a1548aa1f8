"""Pure-Python reference twin of the activation codec kernels (wire-format.md sections 5-8).

This is the spec in plain Python: integer bit operations on f32 bit patterns and
``struct`` for the little-endian wire, written independently of ``_codec.pyx`` so that
parity tests catch logic bugs as well as compilation bugs.  numpy is used only to
assemble the arrays that some functions return.

Conventions shared with ``skippy_wire.wire._codec`` (same names, signatures, behaviour):

* codecs are wire ids (1..4) as plain ints; ``state_flags`` is any int (only bits 6 and 8
  matter); ``token_count`` / ``n_embd`` must fit in an i32 as on the wire.
* payloads are any C-contiguous buffer, read as raw little-endian f32 bytes; one read as
  f32 values must hold f32 values, their uint32 bit patterns or raw bytes (``_byte_view``).
* errors are ``skippy_wire.errors`` classes carrying the exact upstream text, raised in
  the upstream check order.
"""

from __future__ import annotations

import array
import struct
import sys

import numpy as np

from ...errors import InvalidDataError, InvalidInputError
from .. import constants as _texts
from ..constants import (I32_MAX, I32_MIN, MAX_STAGE_ACTIVATION_BYTES, MAX_STAGE_DECODED_ACTIVATION_BYTES,
                         state_flags_word, wire_int)
from ..field_checks import flat_bytes

RAW_F32_V1 = 1
F16_RNE_V1 = 2
BF16_RNE_V1 = 3
S8_ROW_F32_RNE_V1 = 4

_USIZE_LIMIT = 1 << 64  # upstream sizes are 64-bit usize; products at or above wrap
_ROW_DOUBLING = 0x040 | 0x100  # RWKV7_V_FIRST_SIDEBAND | INKLING_MTP_EMBD_SIDEBAND (2.4)

NON_CONTIGUOUS = _texts.NON_CONTIGUOUS_TEXT
OBJECT_ARRAY = _texts.OBJECT_ARRAY_TEXT
DIMENSION_RANGE = _texts.DIMENSION_RANGE_TEXT
BITS_DTYPE_U32 = _texts.BITS_DTYPE_U32_TEXT
BITS_DTYPE_U16 = _texts.BITS_DTYPE_U16_TEXT
OUT_NON_CONTIGUOUS = _texts.OUT_NON_CONTIGUOUS_TEXT
OUT_READ_ONLY = _texts.OUT_READ_ONLY_TEXT
OUT_OBJECT_ARRAY = _texts.OUT_OBJECT_ARRAY_TEXT
OUT_OVERLAP = _texts.OUT_OVERLAP_TEXT
PAYLOAD_FORMAT = _texts.PAYLOAD_FORMAT_TEXT
NOT_BYTES_LIKE = _texts.NOT_BYTES_LIKE_TEXT

_LITTLE_HOST = sys.byteorder == "little"


# --------------------------------------------------------------------------- helpers


def _err(text: str) -> InvalidDataError:
    return InvalidDataError(text)


def _checked_mul(a: int, b: int, text: str) -> int:
    """usize ``checked_mul``: an overflowing product is an error with ``text``."""
    product = a * b
    if product >= _USIZE_LIMIT:
        raise _err(text)
    return product


def _codec_id(codec: int) -> int:
    codec = wire_int(codec)
    if codec not in (RAW_F32_V1, F16_RNE_V1, BF16_RNE_V1, S8_ROW_F32_RNE_V1):
        raise _err("unknown stage activation codec")  # 6.1: ids 0, 5, ... are invalid
    return int(codec)


def _dims(token_count: int, n_embd: int, state_flags: int) -> tuple[int, int, int]:
    token_count = wire_int(token_count)
    n_embd = wire_int(n_embd)
    state_flags = wire_int(state_flags)
    if not (I32_MIN <= token_count <= I32_MAX and I32_MIN <= n_embd <= I32_MAX):
        raise InvalidInputError(DIMENSION_RANGE)
    return int(token_count), int(n_embd), state_flags_word(state_flags)


def _memoryview(obj) -> memoryview:
    """``memoryview(obj)``; an object without the buffer protocol is a TypeError in the
    compiled twin's words."""
    try:
        return memoryview(obj)
    except TypeError:
        raise TypeError(NOT_BYTES_LIKE.format(type(obj).__name__)) from None


def _f32_format(fmt: str) -> bool:
    """Whether a buffer format holds raw bytes ('B', 'b', 'c', any byte order) or
    little-endian f32 values or bit patterns ('<f' / '<I', or 'f' / 'I' native or '='
    on a little-endian host)."""
    order, code = (fmt[0], fmt[1:]) if fmt[:1] in ("@", "=", "<", ">", "!") else ("", fmt)
    if code in ("B", "b", "c"):
        return True
    return code in ("f", "I") and (order == "<" or (_LITTLE_HOST and order in ("", "@", "=")))


def _f32_dtype(dtype: np.dtype) -> bool:
    """Whether an array's elements are raw bytes (uint8, int8) or little-endian f32 values
    or bit patterns (float32, uint32)."""
    return dtype.type in (np.uint8, np.int8) or (dtype.type in (np.float32, np.uint32)
                                                  and dtype.isnative == _LITTLE_HOST)


def _byte_view(payload, f32: bool = False) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer (one rule for both impls);
    with ``f32`` (a payload read as f32 values) its elements must be raw bytes or
    little-endian f32 values or bit patterns, else it is refused naming their format or
    dtype."""
    if isinstance(payload, np.ndarray):
        # numpy cannot export some dtypes (e.g. ml_dtypes bfloat16) through the buffer
        # protocol, so take the raw bytes through a uint8 view of the same memory.
        if payload.dtype.hasobject:
            raise InvalidInputError(OBJECT_ARRAY)  # its buffer would be the object pointers
        if not payload.flags.c_contiguous:
            raise InvalidInputError(NON_CONTIGUOUS)
        if f32 and not _f32_dtype(payload.dtype):
            raise InvalidInputError(PAYLOAD_FORMAT.format(f"dtype {payload.dtype}"))
        return memoryview(np.asarray(payload).reshape(-1).view(np.uint8))  # a masked array's data, as exported
    view = _memoryview(payload)
    if not view.c_contiguous:
        raise InvalidInputError(NON_CONTIGUOUS)
    if f32 and not _f32_format(view.format):
        raise InvalidInputError(PAYLOAD_FORMAT.format(f"format {view.format!r}"))
    return flat_bytes(view)


def _words(code: str, view, count: int) -> array.array:
    """The first ``count`` little-endian words of ``view`` (``code`` "I": u32, "H": u16),
    each its own size in memory: a tuple of Python ints took about nine times the payload."""
    words = array.array(code)
    words.frombytes(view[:count * words.itemsize])
    if sys.byteorder == "big":
        words.byteswap()
    return words


def _u32_words(view: memoryview, count: int) -> array.array:
    return _words("I", view, count)


def _le_bytes(words: array.array) -> bytes:
    """``words`` as little-endian bytes."""
    if sys.byteorder == "big":
        words = array.array(words.typecode, words)
        words.byteswap()
    return words.tobytes()


def _f32_bits(value: float) -> int:
    """Round a double once to f32 (RNE) and return its bits; overflow gives +-inf."""
    try:
        return struct.unpack("<I", struct.pack("<f", value))[0]
    except OverflowError:  # rounding overflowed the f32 range
        return 0xFF800000 if value < 0 else 0x7F800000


def _bits_f32(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def _is_non_finite(bits: int) -> bool:
    return (bits & 0x7F800000) == 0x7F800000


# --------------------------------------------------------------------------- conversions


def _f32_to_f16(bits: int) -> int:
    """f32 bits -> binary16 bits, round to nearest even (6.5)."""
    sign16 = (bits >> 16) & 0x8000
    e = (bits >> 23) & 0xFF
    m = bits & 0x7FFFFF
    if e == 0:  # +-0 and every f32 subnormal: far below half the smallest f16 subnormal
        return sign16
    if e == 0xFF:  # inf keeps its sign; NaN -> 0x7c01 | sign (payload dropped, not quieted)
        return sign16 | (0x7C00 if m == 0 else 0x7C01)
    he = e - 112  # rebias: e - 127 + 15
    if he >= 31:
        return sign16 | 0x7C00  # overflow to infinity
    if he <= 0:  # f16 subnormal range
        if he < -10:
            return sign16  # |x| < 2^-25 rounds to zero
        mm = m | 0x800000  # restore the implicit bit
        shift = 14 - he  # 14..24
        q = mm >> shift
        rem = mm & ((1 << shift) - 1)
        half = 1 << (shift - 1)
        # RNE: up when above half, or exactly half with an odd result (q may become 0x400).
        if rem > half or (rem == half and (q & 1)):
            q += 1
        return sign16 | q
    q = m >> 13
    rem = m & 0x1FFF
    #   mantissa: [ 10 kept bits q | L=bit 13 ][ R=bit 12 | sticky = bits 11..0 ]
    if rem > 0x1000 or (rem == 0x1000 and (q & 1)):
        q += 1
        if q == 0x400:  # mantissa carried into the exponent
            he += 1
            if he >= 31:
                return sign16 | 0x7C00
            return sign16 | (he << 10)
    return sign16 | (he << 10) | q


def _f16_to_f32(h: int) -> int:
    """binary16 bits -> f32 bits, exact (6.5)."""
    sign32 = (h & 0x8000) << 16
    e = (h >> 10) & 0x1F
    m = h & 0x3FF
    if e == 0:
        if m == 0:
            return sign32
        exp = -14
        while not (m & 0x400):  # normalise the subnormal
            m <<= 1
            exp -= 1
        return sign32 | ((exp + 127) << 23) | ((m & 0x3FF) << 13)
    if e == 0x1F:
        return sign32 | 0x7F800000 | (m << 13)
    return sign32 | ((e + 112) << 23) | (m << 13)


def _f32_to_bf16(bits: int) -> int:
    """f32 bits -> bfloat16 bits (6.6): add 0x7fff + lsb, keep the top half.

    For NaN the bias trick could carry a NaN into infinity or even the sign, so the
    project policy (docs/numerics.md) keeps the top 16 bits and sets the quiet bit.
    Encode never reaches that branch: non-finite input is rejected first.
    """
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x7FFFFF):
        return (bits >> 16) | 0x0040
    lsb = (bits >> 16) & 1
    return ((bits + 0x7FFF + lsb) & 0xFFFFFFFF) >> 16


def _bf16_to_f32(h: int) -> int:
    return (h & 0xFFFF) << 16


def _map_bits(bits, in_dtype, type_error: str, convert, out_dtype) -> np.ndarray:
    """``convert`` applied to every element of a ``in_dtype`` array, shape kept."""
    if not isinstance(bits, np.ndarray) or bits.dtype != in_dtype:
        raise TypeError(type_error)
    out = [convert(int(v)) for v in bits.reshape(-1).tolist()]
    return np.array(out, dtype=out_dtype).reshape(bits.shape)


def f32_bits_to_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """Raw 6.6 conversion of every element (no checks; NaN policy as ``_f32_to_bf16``)."""
    return _map_bits(bits, np.uint32, BITS_DTYPE_U32, _f32_to_bf16, np.uint16)


def f32_bits_to_f16_bits(bits: np.ndarray) -> np.ndarray:
    """Raw 6.5 conversion of every element (no checks; NaN -> 0x7c01 | sign)."""
    return _map_bits(bits, np.uint32, BITS_DTYPE_U32, _f32_to_f16, np.uint16)


def bf16_bits_to_f32_bits(bits: np.ndarray) -> np.ndarray:
    return _map_bits(bits, np.uint16, BITS_DTYPE_U16, _bf16_to_f32, np.uint32)


def f16_bits_to_f32_bits(bits: np.ndarray) -> np.ndarray:
    return _map_bits(bits, np.uint16, BITS_DTYPE_U16, _f16_to_f32, np.uint32)


# --------------------------------------------------------------------------- sizes


def activation_shape(token_count: int, n_embd: int, state_flags: int) -> tuple[int, int, int]:
    """(primary_rows, sideband_rows, columns) of a frame (5.1)."""
    token_count, n_embd, state_flags = _dims(token_count, n_embd, state_flags)
    if token_count < 0 or n_embd <= 0:
        raise _err("negative activation dimensions")
    multiplier = 2 if state_flags & _ROW_DOUBLING else 1  # never 3, GEMMA3N never doubles
    sideband = _checked_mul(token_count, multiplier - 1, "activation token count overflow")
    return token_count, sideband, n_embd


def _rows_elements(token_count: int, n_embd: int, state_flags: int) -> tuple[int, int, int]:
    primary, sideband, columns = activation_shape(token_count, n_embd, state_flags)
    rows = primary + sideband
    if rows >= _USIZE_LIMIT:
        raise _err("activation row count overflow")
    if columns == 0:
        raise _err("activation columns must be positive")
    elements = _checked_mul(rows, columns, "activation element count overflow")
    return rows, columns, elements


def activation_f32_bytes(token_count: int, n_embd: int, state_flags: int) -> int:
    """The f32 byte size of a frame (5.2 ``activation_wire_bytes_with_state_flags``)."""
    token_count, n_embd, state_flags = _dims(token_count, n_embd, state_flags)
    if token_count < 0 or n_embd < 0:  # n_embd = 0 is allowed here and gives 0
        raise _err("negative activation dimensions")
    multiplier = 2 if state_flags & _ROW_DOUBLING else 1
    tokens = _checked_mul(token_count, multiplier, "activation token count overflow")
    elements = _checked_mul(tokens, n_embd, "activation element count overflow")
    return _checked_mul(elements, 4, "activation byte count overflow")  # no maximum (5.2)


def _encoded_bytes(codec: int, rows: int, columns: int, elements: int) -> int:
    """5.3 after the shape: per-codec size, overflow, 512 MiB cap."""
    if codec == RAW_F32_V1:
        size = _checked_mul(elements, 4, "activation wire byte count overflow")
    elif codec in (F16_RNE_V1, BF16_RNE_V1):
        size = _checked_mul(elements, 2, "activation wire byte count overflow")
    else:
        row_bytes = columns + 4
        if row_bytes >= _USIZE_LIMIT:
            raise _err("S8 row byte count overflow")
        size = _checked_mul(rows, row_bytes, "activation wire byte count overflow")
    if size > MAX_STAGE_ACTIVATION_BYTES:
        raise _err("activation payload byte count exceeds maximum")
    return size


def activation_wire_bytes(codec: int, token_count: int, n_embd: int, state_flags: int) -> int:
    """Encoded payload size of a frame in ``codec`` (5.3)."""
    codec = _codec_id(codec)
    rows, columns, elements = _rows_elements(token_count, n_embd, state_flags)
    return _encoded_bytes(codec, rows, columns, elements)


def _checked_f32_input(token_count, n_embd, state_flags, view: memoryview) -> tuple[int, int, int]:
    """7.1 steps 1-4: shape, decoded size and cap, then the input length."""
    rows, columns, elements = _rows_elements(token_count, n_embd, state_flags)
    expected = _checked_mul(elements, 4, "decoded activation byte count overflow")
    if expected > MAX_STAGE_DECODED_ACTIVATION_BYTES:
        raise _err("decoded activation payload byte count exceeds maximum")
    if view.nbytes != expected:
        raise _err("F32 activation payload size mismatch")
    return rows, columns, elements


# --------------------------------------------------------------------------- encode


def _s8_encode_row(values: tuple[int, ...], out: bytearray) -> None:
    """One S8 row (6.7): f32 scale from the f64 quotient, then RNE int8 of f64 quotients."""
    max_abs = 0.0
    for bits in values:
        magnitude = _bits_f32(bits & 0x7FFFFFFF)
        if magnitude > max_abs:
            max_abs = magnitude
    if max_abs == 0.0:
        scale_bits = 0x3F800000  # an all-zero row uses scale 1.0
    else:
        scale_bits = _f32_bits(max_abs / 127.0)
        if scale_bits == 0:  # max(scale, smallest positive subnormal)
            scale_bits = 1
    scale = _bits_f32(scale_bits)
    if _is_non_finite(scale_bits) or not scale > 0.0:
        raise _err("S8 activation row scale is not finite and positive")
    out += struct.pack("<I", scale_bits)
    for bits in values:
        quotient = _bits_f32(bits) / scale
        q = round(quotient)  # Python rounds floats half to even, as round_half_to_even_i8
        q = max(-127, min(127, q))
        if _is_non_finite(_f32_bits(q * scale)):  # f32(q) * scale, rounded once
            raise _err("S8 activation value is out of range")
        out.append(q & 0xFF)


def _out_too_small(have: int, need: int) -> str:
    return f"out buffer too small: {have} bytes for an encoded size of {need} bytes"


def _address(view: memoryview) -> int:
    return np.frombuffer(view, dtype=np.uint8).__array_interface__["data"][0]


def _out_view(out, size: int, payload: memoryview) -> memoryview:
    """A flat writable byte view of ``out``, checked in the compiled module's order:
    object array, contiguity, writability, size, overlap with the payload."""
    if isinstance(out, np.ndarray):
        if out.dtype.hasobject:
            raise InvalidInputError(OUT_OBJECT_ARRAY)  # writing would clobber object pointers
        if not out.flags.c_contiguous:
            raise InvalidInputError(OUT_NON_CONTIGUOUS)
        if not out.flags.writeable:
            raise InvalidInputError(OUT_READ_ONLY)
        view = memoryview(np.asarray(out).reshape(-1).view(np.uint8))
    else:
        view = _memoryview(out)
        if not view.c_contiguous:
            raise InvalidInputError(OUT_NON_CONTIGUOUS)
        if view.readonly:
            raise InvalidInputError(OUT_READ_ONLY)
        view = flat_bytes(view)
    if view.nbytes < size:
        raise InvalidInputError(_out_too_small(view.nbytes, size))
    if size and payload.nbytes:
        o, p = _address(view), _address(payload)
        if o < p + payload.nbytes and p < o + size:
            raise InvalidInputError(OUT_OVERLAP)  # the compiled kernels re-read the payload
    return view[:size]


def _emit(encoded, size: int, out, payload: memoryview):
    """The bytes, or with ``out`` (checked where the bytes path allocates) a view of them
    written to the start of ``out``."""
    if out is None:
        return bytes(encoded)
    view = _out_view(out, size, payload)
    view[:] = encoded
    return view


def _encode_values(codec: int, rows: int, columns: int, elements: int, view: memoryview, out=None):
    """6.2 steps 3-5 on a payload whose size already matches the shape."""
    if codec == RAW_F32_V1:
        size = _encoded_bytes(codec, rows, columns, elements)
        return _emit(view, size, out, view)  # bit-exact, NaN payloads included
    words = _u32_words(view, elements)
    # ``out`` is checked where the compiled module allocates its result.  For F16/BF16
    # that is before the finiteness scan (its fused pass checks while writing); step 4
    # cannot fail for them here (elements x 2 <= the f32 size), so no upstream order moves.
    if codec != S8_ROW_F32_RNE_V1:
        size = _encoded_bytes(codec, rows, columns, elements)
        if out is not None:
            _out_view(out, size, view)
    # 6.2 step 3: the whole array is checked before any conversion.
    if any(_is_non_finite(w) for w in words):
        raise _err("activation values must be finite")
    if codec == S8_ROW_F32_RNE_V1:
        size = _encoded_bytes(codec, rows, columns, elements)  # 6.2 step 4
        if out is not None:
            _out_view(out, size, view)
    if codec == F16_RNE_V1:
        halves = array.array("H")
        for w in words:
            h = _f32_to_f16(w)
            if _is_non_finite(_f16_to_f32(h)):  # |x| >= 65520 rounds to infinity
                raise _err("F16 activation value is out of range")
            halves.append(h)
        return _emit(_le_bytes(halves), size, out, view)
    if codec == BF16_RNE_V1:
        halves = array.array("H")
        for w in words:
            h = _f32_to_bf16(w)
            if _is_non_finite(_bf16_to_f32(h)):  # magnitude bits >= 0x7f7f8000
                raise _err("BF16 activation value is out of range")
            halves.append(h)
        return _emit(_le_bytes(halves), size, out, view)
    encoded = bytearray()
    for row in range(rows):
        _s8_encode_row(words[row * columns : (row + 1) * columns], encoded)
    return _emit(encoded, size, out, view)


def encode_activation(codec: int, token_count: int, n_embd: int, payload, state_flags: int, *, out=None):
    """Encode an f32 frame (7.1, then the common procedure of 6.2); into ``out`` when given."""
    codec = _codec_id(codec)
    view = _byte_view(payload, f32=True)
    rows, columns, elements = _checked_f32_input(token_count, n_embd, state_flags, view)
    return _encode_values(codec, rows, columns, elements, view, out)


def encode_f32_activation_payload(token_count: int, n_embd: int, payload, state_flags: int) -> bytes:
    """7.2: the f32 size check of 5.2 first (n_embd = 0 passes it), then raw encode."""
    view = _byte_view(payload, f32=True)
    expected = activation_f32_bytes(token_count, n_embd, state_flags)
    if expected > MAX_STAGE_DECODED_ACTIVATION_BYTES:
        raise _err("decoded activation payload byte count exceeds maximum")
    if view.nbytes != expected:
        raise _err("F32 activation payload size mismatch")
    return encode_activation(RAW_F32_V1, token_count, n_embd, view, state_flags)


# --------------------------------------------------------------------------- decode


def decode_activation(codec: int, token_count: int, n_embd: int, wire, state_flags: int) -> np.ndarray:
    """Decode a wire payload to a 1-D float32 array (7.4 and 6.3)."""
    codec = _codec_id(codec)
    view = _byte_view(wire)
    rows, columns, elements = _rows_elements(token_count, n_embd, state_flags)
    decoded = _checked_mul(elements, 4, "decoded activation byte count overflow")
    if decoded > MAX_STAGE_DECODED_ACTIVATION_BYTES:
        raise _err("decoded activation payload byte count exceeds maximum")
    if view.nbytes != _encoded_bytes(codec, rows, columns, elements):
        raise _err("activation payload size mismatch")
    if codec == RAW_F32_V1:
        words = _u32_words(view, elements)  # no checks beyond the length (6.4)
    elif codec in (F16_RNE_V1, BF16_RNE_V1):
        widen = _f16_to_f32 if codec == F16_RNE_V1 else _bf16_to_f32
        words = array.array("I")
        for h in _words("H", view, elements):
            w = widen(h)
            if _is_non_finite(w):
                raise _err("activation payload contains non-finite value")
            words.append(w)
    else:
        words = array.array("I")
        row_bytes = columns + 4
        for row in range(rows):
            base = row * row_bytes
            (scale_bits,) = struct.unpack_from("<I", view, base)
            scale = _bits_f32(scale_bits)
            if _is_non_finite(scale_bits) or not scale > 0.0:
                raise _err("S8 activation row scale is not finite and positive")
            for q in struct.unpack_from(f"<{columns}b", view, base + 4):
                if q == -128:
                    raise _err("S8 activation payload contains reserved -128 value")
                w = _f32_bits(q * scale)  # exact product in double, rounded once to f32
                if _is_non_finite(w):
                    raise _err("activation payload contains non-finite value")
                words.append(w)
    return np.frombuffer(words, dtype=np.uint32).view(np.float32)


# --------------------------------------------------------------------------- selection


def _scan_exact(words) -> tuple[bool, bool]:
    """8.1 step 3 over f32 bit patterns: (bf16 exact, f16 exact) for the whole buffer."""
    bf16_ok = f16_ok = True
    for w in words:
        if _is_non_finite(w):  # NaN and inf are never exact
            return False, False
        if bf16_ok and (w & 0xFFFF):
            bf16_ok = False
        if f16_ok and _f16_to_f32(_f32_to_f16(w)) != w:
            f16_ok = False
        if not (bf16_ok or f16_ok):
            break
    return bf16_ok, f16_ok


def _whole_words(payload) -> array.array:
    view = _byte_view(payload, f32=True)
    if view.nbytes % 4:
        raise _err("F32 activation payload size mismatch")
    return _u32_words(view, view.nbytes // 4)


def is_bf16_exact(payload) -> bool:
    """Whether every f32 of the buffer survives a bf16 round trip bit for bit (8.1 step 3)."""
    return _scan_exact(_whole_words(payload))[0]


def is_f16_exact(payload) -> bool:
    """Whether every f32 of the buffer survives an f16 round trip bit for bit (8.1 step 3)."""
    return _scan_exact(_whole_words(payload))[1]


def _permitted_ids(permitted) -> set[int]:
    return {_codec_id(c) for c in permitted}


def select_lossless_codec(token_count: int, n_embd: int, payload, state_flags: int, permitted) -> int:
    """The smallest codec that carries the whole frame bit-exactly (7.3 and 8.1)."""
    allowed = _permitted_ids(permitted)
    view = _byte_view(payload, f32=True)
    _rows, _columns, elements = _checked_f32_input(token_count, n_embd, state_flags, view)
    if RAW_F32_V1 not in allowed:
        raise _err(_texts.NO_RAW_FALLBACK_TEXT)
    if elements == 0:
        return RAW_F32_V1  # 0 < 0 is false: an empty frame is never compact
    bf16_ok, f16_ok = _scan_exact(_u32_words(view, elements))
    if bf16_ok and BF16_RNE_V1 in allowed:
        return BF16_RNE_V1  # BF16 wins when both are exact
    if f16_ok and F16_RNE_V1 in allowed:
        return F16_RNE_V1
    return RAW_F32_V1


def select_and_encode_lossless(token_count: int, n_embd: int, payload, state_flags: int, permitted) -> tuple[int, bytes]:
    """``select_lossless_codec`` then ``encode_activation`` with the chosen codec."""
    codec = select_lossless_codec(token_count, n_embd, payload, state_flags, permitted)
    return codec, encode_activation(codec, token_count, n_embd, payload, state_flags)
