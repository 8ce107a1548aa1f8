"""Reference v16 activation frames (wire-v16-v17.md A.3-A.6), in plain Python.

Functions (the v16/v17 kernel API, see ``frame_gen``):

* ``validate_frame(desc, payload_len=None)``            A.5, the exact check order
* ``frame_wire_bytes(codec, desc)``                     A.6.1
* ``encode_frame(codec, desc, payload) -> bytes``        A.6.2
* ``decode_frame(codec, data, version=16) -> (desc, payload)``  A.6.3 (v17: B.6.5)
* ``select_frame_codec(desc, payload, permitted) -> codec``     A.6.4
"""

from __future__ import annotations

import contextlib
import dataclasses
import struct

from ...errors import InvalidDataError, InvalidInputError, UnexpectedEofError
from ..activation_frame import ActivationFrameV16, ActivationPartV16
from ..constants import DESCRIPTOR_RANGE_TEXT, PART_AXES_TEXT, wire_int
from . import codec as _codec
from .frame import byte_view

FRAME_VERSION = 2
MAX_PARTS = 16
OPTIONAL = 1
HEADER = 68
PART = 128
MAX_BYTES = 536_870_912
_U64 = 1 << 64
ELEMENT_BYTES = {0: 4, 1: 2, 26: 4, 30: 2}
RAW, F16, BF16, S8 = 1, 2, 3, 4

_fixed = struct.Struct("<IiiiIIIQ32s")
_part = struct.Struct("<32sIIiI4q4QQQ")


def _err(text: str) -> InvalidDataError:
    return InvalidDataError(text)


def codec_id(codec) -> int:
    codec = int(wire_int(codec))
    if codec not in (RAW, F16, BF16, S8):
        raise _err("unknown stage activation codec")
    return codec


def _field(code: str, value, name: str) -> None:
    """``value`` fits the descriptor field's wire type (the compiled twin converts each one
    to its C type before any rule of A.5 is checked)."""
    try:
        struct.pack("<" + code, wire_int(value))
    except (struct.error, TypeError, OverflowError):
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: {name}") from None


def _identity(value, name: str) -> None:
    """An identity is a buffer of exactly 32 bytes (an int would make ``bytes(n)`` zeros, a
    list of ints is no buffer): anything else is refused naming the field."""
    try:
        ok = memoryview(value).nbytes == 32
    except (TypeError, ValueError, BufferError):
        ok = False
    if not ok:
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: {name}")


_FRAME_FIELDS = (("I", "version"), ("i", "producer_stage_index"), ("i", "layer_start"), ("i", "layer_end"),
                 ("I", "token_count"), ("I", "sequence_count"), ("Q", "payload_bytes"))
_PART_FIELDS = (("I", "ggml_type"), ("I", "rank"), ("i", "token_axis"), ("I", "flags"))


def _axes(part: ActivationPartV16, field: str, name: str) -> tuple:
    """A part's four dimensions or strides as a tuple; not a sequence at all -> named."""
    try:
        return tuple(getattr(part, field))
    except TypeError:
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: {name}") from None


def check_fields(desc: ActivationFrameV16) -> None:
    """Every field of ``desc`` fits its wire type, in the compiled twin's order."""
    for code, name in _FRAME_FIELDS:
        _field(code, getattr(desc, name), name)
    _identity(desc.frontier_identity, "frontier_identity")
    for i, p in enumerate(desc.parts):
        if not isinstance(p, ActivationPartV16):
            raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: parts[{i}]")
        _identity(p.identity, f"parts[{i}].identity")
        for code, name in _PART_FIELDS:
            _field(code, getattr(p, name), f"parts[{i}].{name}")
        dims, strides = (_axes(p, name, f"parts[{i}].{name}") for name in ("dimensions", "byte_strides"))
        if len(dims) != 4 or len(strides) != 4:
            raise InvalidInputError(PART_AXES_TEXT)
        for k, (dim, stride) in enumerate(zip(dims, strides)):
            _field("q", dim, f"parts[{i}].dimensions[{k}]")
            _field("Q", stride, f"parts[{i}].byte_strides[{k}]")
        _field("Q", p.payload_offset, f"parts[{i}].payload_offset")
        _field("Q", p.payload_bytes, f"parts[{i}].payload_bytes")


def _plain(desc: ActivationFrameV16) -> ActivationFrameV16:
    """``desc`` with its integers as Python ints, as the compiled twin reads them (a numpy
    uint32 ``flags`` would overflow in ``~``, an int8 dimension wrap in a product)."""
    ints = {name: wire_int(getattr(desc, name)) for _, name in _FRAME_FIELDS}
    parts = [dataclasses.replace(
        p, **{name: wire_int(getattr(p, name)) for _, name in _PART_FIELDS},
        dimensions=tuple(map(wire_int, p.dimensions)), byte_strides=tuple(map(wire_int, p.byte_strides)),
        payload_offset=wire_int(p.payload_offset), payload_bytes=wire_int(p.payload_bytes))
        for p in desc.parts]
    return dataclasses.replace(desc, **ints, parts=parts)


def check_desc(desc: ActivationFrameV16) -> ActivationFrameV16:
    """A.5 steps 1-2, then the field types: what the compiled twin checks while converting
    ``desc``, before it looks at a payload; ``desc`` as it reads it (:func:`_plain`)."""
    try:  # a value whose comparison has no truth value (an array) is no version
        wrong_version = bool(desc.version != FRAME_VERSION)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: version") from None
    if wrong_version:
        raise _err("unsupported activation frame version")
    if not isinstance(desc.parts, (list, tuple)):  # a dict or set is no list of parts
        raise InvalidInputError(f"{DESCRIPTOR_RANGE_TEXT}: parts")
    if not 1 <= len(desc.parts) <= MAX_PARTS:
        raise _err("activation frame part count is invalid")
    desc = dataclasses.replace(desc, parts=[_axes_read_once(p) for p in desc.parts])
    check_fields(desc)
    return _plain(desc)


def _axes_read_once(part):
    """``part`` with its axes as tuples, each read once as the compiled twin reads them (an
    iterator is used up by one reading); axes that are no iterable stay for check_fields to name."""
    if not isinstance(part, ActivationPartV16):
        return part
    axes = {}
    for name in ("dimensions", "byte_strides"):
        with contextlib.suppress(TypeError):
            axes[name] = tuple(getattr(part, name))
    return dataclasses.replace(part, **axes)


def validate_frame(desc: ActivationFrameV16, payload_len=None) -> ActivationFrameV16:
    """A.5 in its order; ``desc`` as the compiled twin reads it."""
    return validate_layout(check_desc(desc), payload_len)


def validate_layout(desc: ActivationFrameV16, payload_len=None) -> ActivationFrameV16:
    """A.5 from the payload size on, for a ``desc`` that :func:`check_desc` gave."""
    if payload_len is not None:
        payload_len = wire_int(payload_len)
    if desc.payload_bytes > MAX_BYTES:
        raise _err("decoded activation payload byte count exceeds maximum")
    if payload_len is not None and payload_len != desc.payload_bytes:
        raise _err("activation payload byte count mismatch")
    offset = 0
    seen = []
    for p in desc.parts:
        if p.flags & ~OPTIONAL:
            raise _err("activation part has unsupported flags")
        if bytes(p.identity) in seen:
            raise _err("activation frame has duplicate part identities")
        seen.append(bytes(p.identity))
        if p.token_axis < 0:
            raise _err("activation part has a negative token axis")
        if not 1 <= p.rank <= 4 or p.token_axis >= p.rank:
            raise _err("activation part shape is invalid")
        if p.dimensions[p.token_axis] != desc.token_count:
            raise _err("activation part token dimension does not match frame")
        size = ELEMENT_BYTES.get(p.ggml_type)
        if size is None:
            raise _err("activation part has unsupported ggml type")
        stride, count = size, 1
        for k in range(p.rank):
            d = p.dimensions[k]
            if d <= 0:
                raise _err("activation part dimension is not positive")
            if p.byte_strides[k] != stride:
                raise _err("activation part is not densely packed")
            count *= d
            if count >= _U64:
                raise _err("activation part element count overflow")
            stride *= d
            if stride >= _U64:
                raise _err("activation part stride overflow")
        if p.payload_offset != offset or p.payload_bytes != count * size:
            raise _err("activation part payload layout is inconsistent")
        offset += p.payload_bytes
        if offset >= _U64:
            raise _err("activation payload byte count overflow")
    if offset != desc.payload_bytes:
        raise _err("activation descriptor payload size mismatch")
    return desc


def part_shape(p: ActivationPartV16) -> tuple:
    """(rows, columns) of an F32 part under the element codec (A.4)."""
    columns = p.dimensions[0]
    return (p.payload_bytes // 4) // columns, columns


def part_wire_bytes(codec: int, p: ActivationPartV16, capped: bool = True) -> int:
    """A.4: the wire size of one part; F32 parts as the v15 encoded size (512 MiB cap)."""
    if p.ggml_type != 0:
        return p.payload_bytes
    rows, columns = part_shape(p)
    n = p.payload_bytes // 4
    size = 4 * n if codec == RAW else 2 * n if codec in (F16, BF16) else rows * (columns + 4)
    if capped and size > MAX_BYTES:
        raise _err("activation payload byte count exceeds maximum")
    return size


def frame_wire_bytes(codec, desc: ActivationFrameV16) -> int:
    codec = codec_id(codec)
    return wire_bytes_of(codec, validate_frame(desc))


def wire_bytes_of(codec: int, desc: ActivationFrameV16) -> int:
    """A.6.1 for a validated ``desc`` (validate_frame's)."""
    total = HEADER + PART * len(desc.parts) + sum(part_wire_bytes(codec, p) for p in desc.parts)
    if total > MAX_BYTES:
        raise _err("activation frame wire byte count exceeds maximum")
    return total


def desc_bytes(desc: ActivationFrameV16) -> bytes:
    """The descriptor exactly as given (A.3.1-A.3.2)."""
    out = bytearray(_fixed.pack(desc.version, desc.producer_stage_index, desc.layer_start, desc.layer_end,
                                desc.token_count, desc.sequence_count, len(desc.parts), desc.payload_bytes,
                                bytes(desc.frontier_identity)))
    for p in desc.parts:
        out += _part.pack(bytes(p.identity), p.ggml_type, p.rank, p.token_axis, p.flags, *p.dimensions,
                          *p.byte_strides, p.payload_offset, p.payload_bytes)
    return bytes(out)


def encode_parts(codec: int, desc: ActivationFrameV16, payload: memoryview) -> bytes:
    """The payload section: each part encoded in order (A.4), first error wins."""
    out = bytearray()
    for p in desc.parts:
        piece = payload[p.payload_offset:p.payload_offset + p.payload_bytes]
        if p.ggml_type == 0:
            rows, columns = part_shape(p)
            out += _codec.encode_activation(codec, rows, columns, piece, 0)
        else:
            out += piece
    return bytes(out)


def encode_frame(codec, desc: ActivationFrameV16, payload) -> bytes:
    codec = codec_id(codec)
    desc = check_desc(desc)
    payload = byte_view(payload, "activation")
    validate_layout(desc, len(payload))
    wire_bytes_of(codec, desc)
    return desc_bytes(desc) + encode_parts(codec, desc, payload)


def _need(data: memoryview, end: int) -> None:
    if end > len(data):
        raise UnexpectedEofError()


def read_desc(data: memoryview) -> ActivationFrameV16:
    """A.6.3 steps 1-2: the header field by field; part_count is checked as soon as read."""
    _need(data, 28)
    version, producer, ls, le, tokens, seqs, count = struct.unpack_from("<IiiiIII", data, 0)
    if not 1 <= count <= MAX_PARTS:
        raise _err("activation frame part count is invalid")
    _need(data, HEADER + PART * count)
    payload_bytes, = struct.unpack_from("<Q", data, 28)
    parts = []
    for i in range(count):
        f = _part.unpack_from(data, HEADER + PART * i)
        parts.append(ActivationPartV16(f[0], f[1], f[2], f[3], f[4], f[5:9], f[9:13], f[13], f[14]))
    return ActivationFrameV16(version, producer, ls, le, tokens, seqs, payload_bytes, bytes(data[36:68]), parts)


def decode_parts(codec: int, desc: ActivationFrameV16, wire: memoryview) -> bytes:
    """Decode a payload section whose size already matches (A.4 decoding)."""
    out = bytearray()
    pos = 0
    for p in desc.parts:
        size = part_wire_bytes(codec, p, capped=False)
        piece = wire[pos:pos + size]
        pos += size
        if p.ggml_type == 0:
            rows, columns = part_shape(p)
            out += _codec.decode_activation(codec, rows, columns, piece, 0).tobytes()
        else:
            out += piece
    return bytes(out)


def decode_frame(codec, data, version: int = 16):
    codec = codec_id(codec)
    data = byte_view(data, "activation")
    desc = read_desc(data)
    desc = validate_frame(desc)
    start = HEADER + PART * len(desc.parts)
    if version == 16:
        if wire_bytes_of(codec, desc) != len(data):
            raise _err("activation frame wire byte count mismatch")
    else:  # B.6.5: only the payload section is compared (part caps kept, no frame cap)
        if sum(part_wire_bytes(codec, p) for p in desc.parts) != len(data) - start:
            raise _err("activation frame wire byte count mismatch")
    return desc, decode_parts(codec, desc, data[start:])


def _lossless(codec: int, desc: ActivationFrameV16, payload: memoryview) -> bool:
    for p in desc.parts:
        if p.ggml_type != 0:
            continue
        piece = payload[p.payload_offset:p.payload_offset + p.payload_bytes]
        rows, columns = part_shape(p)
        try:
            wire = _codec.encode_activation(codec, rows, columns, piece, 0)
            back = _codec.decode_activation(codec, rows, columns, wire, 0).tobytes()
        except InvalidDataError:
            return False
        if back != bytes(piece):
            return False
    return True


def select_frame_codec(desc: ActivationFrameV16, payload, permitted) -> int:
    desc = check_desc(desc)
    payload = byte_view(payload, "activation")
    validate_layout(desc, len(payload))
    allowed = {codec_id(c) for c in permitted}
    if RAW not in allowed:
        raise _err("lossless activation selection requires RawF32 fallback")
    best, best_size = RAW, wire_bytes_of(RAW, desc)
    for codec in (BF16, F16, S8, RAW):
        if codec not in allowed:
            continue
        try:
            size = wire_bytes_of(codec, desc)
        except InvalidDataError as err:
            if _lossless(codec, desc, payload):
                raise err  # upstream sizes every lossless codec's frame, and that error propagates
            continue
        if size < best_size and _lossless(codec, desc, payload):
            best, best_size = codec, size
    return best
