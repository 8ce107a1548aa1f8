"""State versions 16 and 17: the typed multipart activation frame and its constants
(wire-v16-v17.md A.2-A.3; docs/wire-format.md "State versions 16 and 17").

Plain Python data shared by both implementations of the v16/v17 kernels (the compiled
``_frame_gen`` and the reference ``_reference.frame_gen``); no rule is checked here.

* :class:`ActivationFrameV16` is the frame descriptor (68-byte fixed header on the wire),
  :class:`ActivationPartV16` one part header (128 bytes).  Field for field they are
  ``ActivationDesc`` v2 / ``ActivationPartDesc`` of skippy-runtime 0.77.0 (the stage layer
  may convert to and from them); the wire drops the runtime's reserved word and sends only
  ``part_count`` part headers.
* A frame on its own is ``(desc, payload)``: ``payload`` is the *logical* payload (every
  part's little-endian elements back to back, at its ``payload_offset``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Sequence

from .constants import UpstreamEnum
from .messages import DISCARD_STALE_WINDOWS, WireMessageKind

#: ``STAGE_STATE_VERSION`` of each protocol generation this package speaks.
STAGE_STATE_VERSION_V15 = 15
STAGE_STATE_VERSION_V16 = 16
STAGE_STATE_VERSION_V17 = 17
PROTOCOL_VERSIONS = (STAGE_STATE_VERSION_V15, STAGE_STATE_VERSION_V16, STAGE_STATE_VERSION_V17)

STAGE_ACTIVATION_FRAME_VERSION = 2
STAGE_ACTIVATION_IDENTITY_BYTES = 32
MAX_STAGE_ACTIVATION_DIMS = 4
MAX_STAGE_ACTIVATION_PARTS = 16
STAGE_ACTIVATION_PART_OPTIONAL = 1
STAGE_ACTIVATION_FRAME_HEADER_BYTES = 68
STAGE_ACTIVATION_PART_HEADER_BYTES = 128

#: Agreement generation bytes (v17 B.3) and the fixed part of an agreement-framed activation.
ACTIVATION_AGREEMENT_GENERATION_BYTES = 16
AGREED_ACTIVATION_HEADER_BYTES = 30


class GgmlType(enum.IntEnum):
    """The ggml element types a part may carry (A.2); only F32 goes through the codec."""

    F32 = 0
    F16 = 1
    I32 = 26
    BF16 = 30


#: Element size in bytes of each accepted ggml type.
GGML_TYPE_SIZE = {GgmlType.F32: 4, GgmlType.F16: 2, GgmlType.I32: 4, GgmlType.BF16: 2}

WireMessageKindV16 = UpstreamEnum(
    "WireMessageKindV16",
    {**{k.name: k.value for k in WireMessageKind}, "DISCARD_STALE_WINDOWS": DISCARD_STALE_WINDOWS},
)
#: Activationless kinds from v16 on, writer and reader alike (A.7.1): Stop joined the list.
ACTIVATIONLESS_KINDS_V16 = frozenset({3, 7, 15, 16, 17})


def kind_rust_name(kind: int) -> str:
    """The upstream variant name of a v16/v17 kind, e.g. ``"DiscardStaleWindows"``."""
    return WireMessageKindV16(kind).rust_name


def _zero_identity() -> bytes:
    return bytes(STAGE_ACTIVATION_IDENTITY_BYTES)


@dataclass
class FrameSpan:
    """Where a frame sits in the pipeline: which stage produced it, the layer range it
    leaves, and how many tokens and sequences it carries.  Shared by the v16 wire
    descriptor and the runtime's v2 ``ActivationDesc``."""

    version: int = STAGE_ACTIVATION_FRAME_VERSION
    producer_stage_index: int = 0
    layer_start: int = 0
    layer_end: int = 0
    token_count: int = 0
    sequence_count: int = 1


@dataclass
class ActivationPartV16:
    """One part header (A.3.2).  ``dimensions`` are i64 in ggml order (axis 0 fastest),
    ``byte_strides`` u64; axes at or above ``rank`` are carried verbatim."""

    identity: bytes = field(default_factory=_zero_identity)
    ggml_type: int = GgmlType.F32
    rank: int = 1
    token_axis: int = 0
    flags: int = 0
    dimensions: Sequence[int] = (1, 1, 1, 1)
    byte_strides: Sequence[int] = (4, 4, 4, 4)
    payload_offset: int = 0
    payload_bytes: int = 0

    @property
    def optional(self) -> bool:
        return bool(self.flags & STAGE_ACTIVATION_PART_OPTIONAL)

    @classmethod
    def dense(cls, identity: bytes, ggml_type: int, dims: Sequence[int], token_axis: int, *,
              payload_offset: int = 0, optional: bool = False) -> "ActivationPartV16":
        """A densely packed part of rank ``len(dims)``; trailing axes canonical (1, full size)."""
        size = GGML_TYPE_SIZE[GgmlType(ggml_type)]
        full = list(dims) + [1] * (MAX_STAGE_ACTIVATION_DIMS - len(dims))
        strides, stride = [], size
        for d in full:
            strides.append(stride)
            stride *= d
        return cls(bytes(identity), int(ggml_type), len(dims), token_axis,
                   STAGE_ACTIVATION_PART_OPTIONAL if optional else 0, tuple(full), tuple(strides),
                   payload_offset, stride)


@dataclass
class ActivationFrameV16(FrameSpan):
    """The frame descriptor (A.3.1); ``len(parts)`` is the wire's ``part_count``."""

    payload_bytes: int = 0
    frontier_identity: bytes = field(default_factory=_zero_identity)
    parts: list = field(default_factory=list)

    @classmethod
    def of_parts(cls, parts: Sequence[ActivationPartV16], *, token_count: int, producer_stage_index: int = 0,
                 layer_start: int = 0, layer_end: int = 0, sequence_count: int = 1,
                 frontier_identity: bytes = bytes(STAGE_ACTIVATION_IDENTITY_BYTES)) -> "ActivationFrameV16":
        """A descriptor whose parts are laid out back to back (offsets and total filled in)."""
        laid, offset = [], 0
        for p in parts:
            laid.append(ActivationPartV16(p.identity, p.ggml_type, p.rank, p.token_axis, p.flags,
                                          tuple(p.dimensions), tuple(p.byte_strides), offset, p.payload_bytes))
            offset += p.payload_bytes
        return cls(STAGE_ACTIVATION_FRAME_VERSION, producer_stage_index, layer_start, layer_end, token_count,
                   sequence_count, offset, bytes(frontier_identity), laid)


__all__ = [
    "STAGE_STATE_VERSION_V15", "STAGE_STATE_VERSION_V16", "STAGE_STATE_VERSION_V17", "PROTOCOL_VERSIONS",
    "STAGE_ACTIVATION_FRAME_VERSION", "STAGE_ACTIVATION_IDENTITY_BYTES", "MAX_STAGE_ACTIVATION_DIMS",
    "MAX_STAGE_ACTIVATION_PARTS", "STAGE_ACTIVATION_PART_OPTIONAL", "STAGE_ACTIVATION_FRAME_HEADER_BYTES",
    "STAGE_ACTIVATION_PART_HEADER_BYTES", "ACTIVATION_AGREEMENT_GENERATION_BYTES",
    "AGREED_ACTIVATION_HEADER_BYTES", "GgmlType", "GGML_TYPE_SIZE", "DISCARD_STALE_WINDOWS",
    "WireMessageKindV16", "ACTIVATIONLESS_KINDS_V16", "kind_rust_name", "FrameSpan", "ActivationPartV16",
    "ActivationFrameV16",
]
