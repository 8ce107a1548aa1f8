"""Reference v17 agreements and agreement-framed activations (wire-v16-v17.md B.5-B.6).

* ``validate_agreement(agreement)``                                  B.5
* ``agreed_wire_bytes(agreement, codec, desc)``                      B.6.2 (size only)
* ``agreed_encode(agreement, codec, desc, payload) -> bytes``         B.6.2 encode
* ``agreed_reframe(agreement, desc, frame) -> bytes``                 B.6.2 ``encode_existing``
* ``agreed_decode(agreement, codec, data) -> (desc, payload)``        B.6.3
"""

from __future__ import annotations

import struct

from ...errors import InvalidDataError, InvalidInputError, UnexpectedEofError
from ..activation_frame import ActivationFrameV16, ActivationPartV16
from ..agreement import ActivationAgreement, ActivationPartProfile, ActivationProfile, Dynamic, Fixed, TOKENS
from ..constants import AGREEMENT_RANGE_TEXT, I32_MAX, I32_MIN, U32_MAX, U64_MAX, wire_int
from ..field_checks import wire_bool
from . import frame_v16 as _v16
from .frame import byte_view

MAX_PROFILES = 16
I64_MAX = 2**63 - 1
_U64 = 1 << 64
GEN = 16
_head = struct.Struct("<16sIIIH")


def _err(text: str) -> InvalidDataError:
    return InvalidDataError(text)


def _dimension_ok(d, axis: int, rank: int, token_axis: int) -> bool:
    if d is TOKENS:
        return axis == token_axis
    if isinstance(d, Fixed):
        return 0 < d.value <= I64_MAX and axis != token_axis and (axis < rank or d.value == 1)
    if isinstance(d, Dynamic):
        return 0 < d.min <= d.max <= I64_MAX and axis < rank and axis != token_axis
    return False


def _int_field(value, low: int, high: int, name: str) -> None:
    try:
        value = wire_int(value)
    except TypeError:
        value = None
    if value is None or not low <= value <= high:
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}")


def _bytes_field(value, length: int, name: str) -> None:
    try:  # a buffer (bytes(n) of an int would be zeros, bytes(list) a copy of small ints)
        ok = memoryview(value).nbytes == length
    except (TypeError, ValueError):
        ok = False
    if not ok:
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}")


def _bool_field(value, name: str) -> None:
    try:  # a bool (Python's or numpy's) or 0 / 1, as a wire boolean (field_checks.wire_bool)
        wire_bool(value)
    except TypeError:
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}") from None


def _list_field(value, name: str) -> None:
    """A list (or tuple) of profiles or parts: a dict, a set or None is none."""
    if not isinstance(value, (list, tuple)):
        raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {name}")


def _generation(agreement: ActivationAgreement) -> bytes:
    """The generation's 16 bytes: the buffer's bytes, whatever its shape or element type."""
    return bytes(memoryview(agreement.generation))


def check_agreement_fields(agreement: ActivationAgreement) -> None:
    """Every field of ``agreement`` has its setup type (B.3): a caller's object is refused
    with InvalidInputError naming the field before any rule of B.5 runs."""
    _bytes_field(agreement.generation, GEN, "generation")
    _list_field(agreement.profiles, "profiles")
    for i, p in enumerate(agreement.profiles):
        at = f"profiles[{i}]"
        if not isinstance(p, ActivationProfile):
            raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {at}")
        _int_field(p.id, 0, U32_MAX, f"{at}.id")
        for name in ("producer_stage_index", "layer_start", "layer_end"):
            _int_field(getattr(p, name), I32_MIN, I32_MAX, f"{at}.{name}")
        _bytes_field(p.frontier_identity, 32, f"{at}.frontier_identity")
        for name in ("max_tokens", "max_sequences"):
            _int_field(getattr(p, name), 0, U32_MAX, f"{at}.{name}")
        _list_field(p.parts, f"{at}.parts")
        for j, part in enumerate(p.parts):
            where = f"{at}.parts[{j}]"
            if not isinstance(part, ActivationPartProfile):
                raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {where}")
            _bytes_field(part.identity, 32, f"{where}.identity")
            for name in ("ggml_type", "rank", "token_axis"):
                _int_field(getattr(part, name), 0, U32_MAX, f"{where}.{name}")
            _bool_field(part.optional, f"{where}.optional")
            if not isinstance(part.dimensions, (tuple, list)):  # read more than once: no iterator
                raise InvalidInputError(f"{AGREEMENT_RANGE_TEXT}: {where}.dimensions")
            for k, d in enumerate(part.dimensions):
                for value in (d.value,) if isinstance(d, Fixed) else (d.min, d.max) if isinstance(d, Dynamic) else ():
                    _int_field(value, 0, U64_MAX, f"{where}.dimensions[{k}]")


def validate_agreement(agreement: ActivationAgreement) -> None:
    check_agreement_fields(agreement)
    if not any(_generation(agreement)) or len(agreement.profiles) > MAX_PROFILES:
        raise _err("invalid activation agreement")
    ids = set()
    for p in agreement.profiles:
        profile_id = wire_int(p.id)  # a 0-d array is an index but no set member
        if profile_id == 0 or profile_id in ids:
            raise _err("duplicate or zero activation profile ID")
        ids.add(profile_id)
        if (p.producer_stage_index < 0 or p.layer_start < 0 or p.layer_end < p.layer_start or p.max_tokens == 0
                or p.max_sequences == 0 or not 1 <= len(p.parts) <= _v16.MAX_PARTS):
            raise _err("invalid activation profile")
        seen = []
        for part in p.parts:
            if wire_int(part.ggml_type) not in _v16.ELEMENT_BYTES:
                raise _err("activation part has unsupported ggml type")
            if not 1 <= part.rank <= 4 or part.token_axis >= part.rank or bytes(part.identity) in seen:
                raise _err("invalid activation part profile")
            seen.append(bytes(part.identity))
            if len(part.dimensions) != 4:
                raise _err("invalid admitted activation dimension")
            for axis, d in enumerate(part.dimensions):
                if not _dimension_ok(d, axis, part.rank, part.token_axis):
                    raise _err("invalid admitted activation dimension")


def _match(profile, desc: ActivationFrameV16):
    """B.6.2: (mask, dynamic values) when ``desc`` matches ``profile``, else None."""
    if (desc.producer_stage_index != profile.producer_stage_index or desc.layer_start != profile.layer_start
            or desc.layer_end != profile.layer_end or bytes(desc.frontier_identity) != bytes(profile.frontier_identity)):
        return None
    cursor, mask, dynamic = 0, 0, []
    for i, pp in enumerate(profile.parts):
        fp = desc.parts[cursor] if cursor < len(desc.parts) else None
        if fp is not None and bytes(fp.identity) == bytes(pp.identity):
            if (fp.ggml_type != pp.ggml_type or fp.rank != pp.rank or fp.token_axis != pp.token_axis
                    or fp.flags != (_v16.OPTIONAL if pp.optional else 0)):
                return None
            for k in range(pp.rank):
                d, v = pp.dimensions[k], fp.dimensions[k]
                if d is TOKENS:
                    if v != desc.token_count:
                        return None
                elif isinstance(d, Fixed):
                    if v != d.value:
                        return None
                elif not d.min <= v <= d.max:
                    return None
                else:
                    dynamic.append(v)
            mask |= 1 << i
            cursor += 1
        elif not pp.optional:
            return None
    if cursor != len(desc.parts):
        return None
    if not (1 <= desc.token_count <= profile.max_tokens and 1 <= desc.sequence_count <= profile.max_sequences):
        return None
    if mask == 0:
        return None
    return mask, dynamic


def _first_match(agreement: ActivationAgreement, desc: ActivationFrameV16):
    for profile in agreement.profiles:
        m = _match(profile, desc)
        if m is not None:
            return profile, m[0], m[1]
    raise _err("activation does not match an admitted profile")


def _header(agreement, profile, desc, mask: int, dynamic: list) -> bytes:
    return _head.pack(_generation(agreement), profile.id, desc.token_count, desc.sequence_count, mask) + b"".join(
        struct.pack("<Q", v) for v in dynamic)


def agreed_wire_bytes(agreement: ActivationAgreement, codec, desc: ActivationFrameV16) -> int:
    codec = _v16.codec_id(codec)  # a caller's codec first, as the compiled twin converts it
    validate_agreement(agreement)
    desc = _v16.validate_frame(desc)
    size = _v16.wire_bytes_of(codec, desc)
    _profile, _mask, dynamic = _first_match(agreement, desc)
    return 30 + 8 * len(dynamic) + (size - _v16.HEADER - _v16.PART * len(desc.parts))


def agreed_encode(agreement: ActivationAgreement, codec, desc: ActivationFrameV16, payload) -> bytes:
    codec = _v16.codec_id(codec)
    validate_agreement(agreement)
    desc = _v16.check_desc(desc)
    payload = byte_view(payload, "activation")
    _v16.validate_layout(desc, len(payload))
    profile, mask, dynamic = _first_match(agreement, desc)
    out = _header(agreement, profile, desc, mask, dynamic) + _v16.encode_parts(codec, desc, payload)
    if len(out) > _v16.MAX_BYTES:
        raise _err("activation frame exceeds maximum")
    return out


def agreed_reframe(agreement: ActivationAgreement, desc: ActivationFrameV16, frame) -> bytes:
    """``encode_existing``: ``frame`` is the encoded v16 frame already decoded as ``desc``;
    its payload section is copied, not re-encoded.  A ``frame`` shorter than the
    descriptor's headers is a size mismatch."""
    desc = _v16.check_desc(desc)
    view = byte_view(frame, "activation")
    validate_agreement(agreement)
    profile, mask, dynamic = _first_match(agreement, desc)
    start = _v16.HEADER + _v16.PART * len(desc.parts)
    if len(view) < start:
        raise _err("activation frame wire byte count mismatch")
    return _header(agreement, profile, desc, mask, dynamic) + bytes(view[start:])


def agreed_decode(agreement: ActivationAgreement, codec, data):
    codec = _v16.codec_id(codec)
    view = byte_view(data, "activation")
    if len(view) > _v16.MAX_BYTES:
        raise _err("activation frame exceeds maximum")
    validate_agreement(agreement)
    if len(view) < GEN:
        raise UnexpectedEofError()
    if bytes(view[:GEN]) != _generation(agreement):
        raise _err("stale activation agreement")
    if len(view) < GEN + 4:
        raise UnexpectedEofError()
    profile_id, = struct.unpack_from("<I", view, GEN)
    profile = agreement.profile(profile_id)
    if profile is None:
        raise _err("unknown activation profile")
    if len(view) < 30:
        raise UnexpectedEofError()
    tokens, seqs, mask = struct.unpack_from("<IIH", view, 20)
    if (not 1 <= tokens <= profile.max_tokens or not 1 <= seqs <= profile.max_sequences or mask == 0
            or mask >> len(profile.parts)):
        raise _err("activation counts or presence outside agreement")
    pos, total, parts = 30, 0, []
    for i, pp in enumerate(profile.parts):
        if not mask & (1 << i):
            if not pp.optional:
                raise _err("required activation part absent")
            continue
        dims, strides, stride = [], [], _v16.ELEMENT_BYTES[wire_int(pp.ggml_type)]
        for d in pp.dimensions:  # each axis's stride is checked before the next value is read
            if d is TOKENS:
                v = tokens
            elif isinstance(d, Fixed):
                v = wire_int(d.value)  # a numpy integer would wrap in the products below
            else:
                if len(view) < pos + 8:
                    raise UnexpectedEofError()
                v, = struct.unpack_from("<Q", view, pos)
                pos += 8
                if not d.min <= v <= d.max:
                    raise _err("dynamic activation dimension outside bounds")
            dims.append(v)
            strides.append(stride)
            stride *= v
            if stride >= _U64:
                raise _err("activation layout overflow")
        parts.append(ActivationPartV16(bytes(pp.identity), pp.ggml_type, pp.rank, pp.token_axis,
                                       _v16.OPTIONAL if pp.optional else 0, tuple(dims), tuple(strides), total, stride))
        total += stride
        if total >= _U64:
            raise _err("activation layout overflow")
    desc = ActivationFrameV16(_v16.FRAME_VERSION, profile.producer_stage_index, profile.layer_start,
                              profile.layer_end, tokens, seqs, total, bytes(profile.frontier_identity), parts)
    desc = _v16.validate_frame(desc)
    wire = 0
    for p in parts:  # the sum of B.6.5: each F32 part is a v15 encoded size (512 MiB cap)
        wire += _v16.part_wire_bytes(codec, p)
        if wire >= _U64:
            raise _err("activation wire size overflow")
    if wire != len(view) - pos:
        raise _err("activation frame wire byte count mismatch")
    return desc, _v16.decode_parts(codec, desc, view[pos:])
