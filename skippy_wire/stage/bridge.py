"""Conversions between wire messages and stage frames (wire-format.md section 9).

The stage layer may import the wire layer, never the reverse: a received (decoded) wire
activation becomes the v2 input frame of a stage, and a stage's output frame becomes the
v1 frame the wire forwards (state version 15).  From state version 16 on the wire carries
the runtime's multipart frame itself: :func:`frame_to_v16` / :func:`frame_from_v16` map
``ActivationDesc`` v2 field for field onto ``ActivationFrameV16``, and
:func:`boundary_profile` turns a graph-observed boundary into the v17 setup profile.
"""

from __future__ import annotations

import functools
from typing import Optional

from ..errors import ActivationFrameError
from ..wire import forwarding
from ..wire.activation_frame import ActivationFrameV16, ActivationPartV16
from ..wire.agreement import TOKENS, ActivationPartProfile, ActivationProfile, Fixed
from ..wire.constants import I32_MAX, I32_MIN, I64_MAX, wire_int
from .activation import (ACTIVATION_MAX_DIMS, ACTIVATION_MAX_PARTS, GGML_TYPE_BF16, GGML_TYPE_F16, GGML_TYPE_F32,
                         U32_MAX, ActivationBoundaryDesc, ActivationDesc, ActivationFrame, ActivationPartDesc,
                         PackedFrame, ggml_type_bytes)

#: The id of the one profile a stage admits on an activation link (ids start at 1).
STAGE_PROFILE_ID = 1


def _wire_count(value, what: str, low: int, high: int) -> int:
    # an integer, not int(): 1.5 tokens (or True) is refused, not truncated.  The range is
    # checked before any size is derived, so a refusal names the count, not a negative byte size.
    try:
        number = wire_int(value)
    except TypeError:
        raise ActivationFrameError(f"activation {what} must be an integer, not {type(value).__name__}") from None
    if number < low:
        below = "negative" if low == 0 else "not positive" if low == 1 else f"below {low}"
        raise ActivationFrameError(f"activation {what} {number} is {below}")
    if number > high:
        raise ActivationFrameError(f"activation {what} {number} exceeds {high}")
    return number


def sidebands_unsupported(frame_flags: int) -> str:
    """The refusal of an activation with sideband rows (RWKV7, Inkling): no model here has them."""
    return f"activation frame flags {frame_flags:#x} (sidebands) are not supported"


def _checked_wire_payload(payload, token_count: int, n_embd: int, flags: int) -> tuple:
    """``(payload bytes, token_count, n_embd)`` of a wire activation, the counts as ints: the
    token count fits the descriptor's u32, a row holds at least one value and its byte stride
    fits the descriptor's i64 dimension / u64 stride."""
    if flags:
        raise ActivationFrameError(sidebands_unsupported(flags))
    token_count = _wire_count(token_count, "token count", 0, U32_MAX)
    n_embd = _wire_count(n_embd, "row width n_embd", 1, I64_MAX // 4)
    data = bytes(payload)
    expected = 4 * n_embd * token_count
    if len(data) != expected:
        raise ActivationFrameError(
            f"activation payload length {len(data)} does not match {token_count} tokens x "
            f"{n_embd} f32 ({expected} bytes)"
        )
    return data, token_count, n_embd


def _checked_origin(producer_stage_index, layer_start, layer_end) -> tuple:
    """The descriptor's i32 origin fields as ints, refused by name when the frame is built
    (one beyond i32 failed at its first use, in struct's words)."""
    return tuple(_wire_count(value, name, I32_MIN, I32_MAX) for name, value in (
        ("producer_stage_index", producer_stage_index), ("layer_start", layer_start), ("layer_end", layer_end)))


def _identities(boundary: Optional[ActivationBoundaryDesc]) -> tuple:
    if boundary is None:
        return None, None
    return bytes(boundary.active_parts()[0].identity), bytes(boundary.frontier_identity)


def frame_from_wire(payload: bytes, token_count: int, n_embd: int, producer_stage_index: int, layer_start: int,
                    layer_end: int, flags: int = 0, *,
                    boundary: Optional[ActivationBoundaryDesc] = None) -> ActivationFrame:
    """Build the v2 input frame for a received (decoded, F32) wire activation.

    One F32 part ``[n_embd, token_count]``, token axis 1.  ``flags`` are v1 frame flags;
    sideband planes are not supported by this backend, so non-zero flags are rejected.
    ``boundary`` (the consumer model's ``input_activation_boundary()``) supplies the part and
    frontier identities; without it they are the backend's llama residual identities.
    """
    data, token_count, n_embd = _checked_wire_payload(payload, token_count, n_embd, flags)
    producer_stage_index, layer_start, layer_end = _checked_origin(producer_stage_index, layer_start, layer_end)
    identity, frontier = _identities(boundary)
    desc = ActivationDesc.f32_rows(
        n_embd, token_count, producer_stage_index=producer_stage_index, layer_start=layer_start,
        layer_end=layer_end, identity=identity, frontier_identity=frontier,
    )
    return ActivationFrame(desc, data)


@functools.lru_cache(maxsize=256, typed=True)  # typed: 15.0 (refused) is no hit for 15's descriptor
def _packed_rows_desc(n_embd: int, token_count: int, producer_stage_index: int, layer_start: int, layer_end: int,
                      identity: Optional[bytes], frontier: Optional[bytes]) -> bytes:
    producer_stage_index, layer_start, layer_end = _checked_origin(producer_stage_index, layer_start, layer_end)
    return ActivationDesc.f32_rows(n_embd, token_count, producer_stage_index=producer_stage_index,
                                   layer_start=layer_start, layer_end=layer_end, identity=identity,
                                   frontier_identity=frontier).to_bytes()


def packed_frame_from_wire(payload: bytes, token_count: int, n_embd: int, producer_stage_index: int,
                           layer_start: int, layer_end: int, flags: int = 0, *,
                           boundary: Optional[ActivationBoundaryDesc] = None) -> PackedFrame:
    """:func:`frame_from_wire`'s frame in the runtime's C layout (the same checks and the
    same descriptor bytes), the descriptor packed once per shape."""
    data, token_count, n_embd = _checked_wire_payload(payload, token_count, n_embd, flags)
    desc = _packed_rows_desc(n_embd, token_count, producer_stage_index, layer_start, layer_end, *_identities(boundary))
    return PackedFrame(desc, data)


_V1_DTYPE_NAMES = {GGML_TYPE_F32: "F32", GGML_TYPE_F16: "F16", GGML_TYPE_BF16: "BF16"}


def frame_to_v1(frame: ActivationFrame) -> forwarding.ActivationFrameV1:
    """Convert an output frame into the v1 ``skippy_wire.wire.forwarding.ActivationFrameV1``.

    Single-part frames only (sidebands would be extra parts, which v1 expresses as flags
    this backend never produces).  The layout is TOKEN_MAJOR when the part is contiguous
    with the token axis outermost, else OPAQUE.  An empty frame (terminal output) maps to
    dtype UNKNOWN, token/sequence count 0.
    """
    frame.validate_payload_len()
    desc = frame.desc
    parts = desc.active_parts()
    if len(parts) > 1:
        raise ActivationFrameError(
            f"a v1 activation frame carries one part, this frame has {len(parts)}"
        )
    dtype = forwarding.ActivationDType.UNKNOWN
    layout = forwarding.ActivationLayout.OPAQUE
    if parts:
        part = parts[0]
        name = _V1_DTYPE_NAMES.get(part.ggml_type)
        if name is not None:
            dtype = getattr(forwarding.ActivationDType, name)
        if _is_token_major(part):
            layout = forwarding.ActivationLayout.TOKEN_MAJOR
    v1 = forwarding.ActivationDescV1(
        version=1,
        dtype=dtype,
        layout=layout,
        producer_stage_index=desc.producer_stage_index,
        layer_start=desc.layer_start,
        layer_end=desc.layer_end,
        token_count=desc.token_count,
        sequence_count=desc.sequence_count,
        payload_bytes=desc.payload_bytes,
        flags=0,
    )
    return forwarding.ActivationFrameV1(desc=v1, payload=bytes(frame.payload))


def f32_part_payload(frame: ActivationFrame) -> Optional[bytes]:
    """The payload of a frame whose one part is F32 (the frames :func:`frame_to_v1` turns
    into dtype F32 with flags 0), or None for any other frame."""
    desc = frame.desc
    if desc.part_count != 1 or desc.parts[0].ggml_type != GGML_TYPE_F32:
        return None
    return frame.payload if memoryview(frame.payload).nbytes == desc.payload_bytes else None


def _is_token_major(part: ActivationPartDesc) -> bool:
    rank = part.rank
    if rank == 0 or rank > ACTIVATION_MAX_DIMS or part.token_axis != rank - 1:
        return False
    try:
        stride = ggml_type_bytes(part.ggml_type)
    except ActivationFrameError:
        return False
    for axis in range(rank):
        if part.byte_strides[axis] != stride:
            return False
        stride *= part.dimensions[axis]
    return True


def _part_as(cls, part: ActivationPartV16) -> ActivationPartV16:
    # The runtime's C part and the wire's part header share every field (ActivationPartDesc
    # is the zero-default subclass); a copy keeps the caller's part from being aliased.
    return cls(bytes(part.identity), part.ggml_type, part.rank, part.token_axis, part.flags,
               tuple(part.dimensions), tuple(part.byte_strides), part.payload_offset, part.payload_bytes)


def frame_to_v16(frame: ActivationFrame) -> tuple:
    """The runtime's output frame as it is, as ``(ActivationFrameV16, payload)`` (every part,
    dimensions and strides verbatim; the runtime's reserved word is not part of the wire)."""
    frame.validate_payload_len()
    desc = frame.desc
    parts = [_part_as(ActivationPartV16, p) for p in desc.active_parts()]
    v16 = ActivationFrameV16(desc.version, desc.producer_stage_index, desc.layer_start, desc.layer_end,
                             desc.token_count, desc.sequence_count, desc.payload_bytes,
                             bytes(desc.frontier_identity), parts)
    return v16, frame.payload


def frame_from_v16(desc: ActivationFrameV16, payload) -> ActivationFrame:
    """A received (decoded) v16/v17 frame as the runtime's input frame, field for field."""
    parts = [_part_as(ActivationPartDesc, p) for p in desc.parts]
    if len(parts) > ACTIVATION_MAX_PARTS:
        raise ActivationFrameError("activation part count exceeds maximum")
    parts += [ActivationPartDesc() for _ in range(ACTIVATION_MAX_PARTS - len(parts))]
    v2 = ActivationDesc(desc.version, desc.producer_stage_index, desc.layer_start, desc.layer_end, desc.token_count,
                        desc.sequence_count, len(desc.parts), desc.payload_bytes, bytes(desc.frontier_identity), parts)
    return ActivationFrame(v2, bytes(payload))


def boundary_profile(boundary: ActivationBoundaryDesc, producer_stage_index: int, layer_start: int, layer_end: int,
                     *, max_tokens: int, max_sequences: int = 1) -> ActivationProfile:
    """The v17 activation profile of a split edge: the boundary's parts with the token axis
    ``Tokens``, every other axis below the rank ``Fixed`` and the axes above it ``Fixed(1)``."""
    parts = []
    for part in boundary.active_parts():
        if part.token_axis < 0 or part.token_axis >= part.rank:
            raise ActivationFrameError("activation part has an invalid token axis")
        dims = []
        for axis in range(ACTIVATION_MAX_DIMS):
            if axis == part.token_axis:
                dims.append(TOKENS)
            elif axis < part.rank:
                if part.dimensions[axis] <= 0:
                    raise ActivationFrameError("activation boundary dimension is dynamic")
                dims.append(Fixed(int(part.dimensions[axis])))
            else:
                dims.append(Fixed(1))
        parts.append(ActivationPartProfile(bytes(part.identity), int(part.ggml_type), int(part.rank),
                                           int(part.token_axis), part.is_optional(), tuple(dims)))
    return ActivationProfile(STAGE_PROFILE_ID, producer_stage_index, layer_start, layer_end,
                             bytes(boundary.frontier_identity), max_tokens, max_sequences, parts)


__all__ = ["STAGE_PROFILE_ID", "frame_from_wire", "packed_frame_from_wire", "frame_to_v1", "f32_part_payload",
           "frame_to_v16", "frame_from_v16", "boundary_profile"]
