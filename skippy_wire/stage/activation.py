"""Activation frames and descriptors of the stage adapter, their identities, and the native
MTP draft struct.

These mirror skippy-runtime 0.77.0 (``types.rs``) over the C structs of skippy-ffi
(runtime.md section 2).  Every struct has ``to_bytes()`` / ``from_bytes()`` for the
packed little-endian C layout that ``skippy_wire.stage._backend`` takes and returns:

* ``ActivationPartDesc``      128 bytes (one part of a typed multipart frontier)
* ``ActivationDesc``         2120 bytes (version 2 frame descriptor, 16 part slots)
* ``ActivationBoundaryDesc`` 2088 bytes (graph-observed boundary, no token count)
* the native MTP draft        56 bytes (``mtp_draft_from_bytes`` gives the wire's
  ``NativeMtpDraft``: one type for a draft, from the backend or off the wire)

The sampling struct is in :mod:`skippy_wire.stage.sampling`, the conversions to and from
wire messages in :mod:`skippy_wire.stage.bridge`.  Errors live in :mod:`skippy_wire.errors`
and are re-exported here: ``StageRuntimeError`` (a ``RuntimeError``) is the base of
everything the adapter raises; a failed native call carries ``.status`` and renders as
upstream does, ``"{Status:?}: {message}"`` or just ``"{Status:?}"`` when native gave no message.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from typing import NamedTuple, Optional, Sequence

from ..errors import (
    ActivationFrameError,
    PartialBatchExecution,
    SamplingConfigError,
    StageArgumentError,
    StageRuntimeError,
    Status,
    format_status_error,
)
from ..wire.activation_frame import GGML_TYPE_SIZE, FrameSpan, ActivationPartV16, GgmlType
# The runtime's C structs carry the v16 wire's frame and part fields (runtime.md section 2.3).
from ..wire.activation_frame import MAX_STAGE_ACTIVATION_DIMS as ACTIVATION_MAX_DIMS
from ..wire.activation_frame import MAX_STAGE_ACTIVATION_PARTS as ACTIVATION_MAX_PARTS
from ..wire.activation_frame import STAGE_ACTIVATION_FRAME_VERSION as ACTIVATION_FRAME_VERSION
from ..wire.activation_frame import STAGE_ACTIVATION_IDENTITY_BYTES as ACTIVATION_IDENTITY_BYTES
from ..wire.activation_frame import STAGE_ACTIVATION_PART_OPTIONAL as ACTIVATION_PART_OPTIONAL
from ..wire.constants import (  # frame (v1 descriptor) sideband flags, wire-format.md section 2.5
    ACTIVATION_FLAG_GEMMA3N_ALTUP, ACTIVATION_FLAG_INKLING_MTP_EMBD, ACTIVATION_FLAG_RWKV7_V_FIRST)
from ..wire.constants import I32_MAX, I32_MIN, U32_MAX, U64_MAX
from ..wire.replies import NativeMtpDraft

# --- constants (runtime.md section 2.3) -----------------------------------------------------

ACTIVATION_BOUNDARY_DESC_VERSION = 2
GGML_TYPE_F32, GGML_TYPE_F16, GGML_TYPE_I32, GGML_TYPE_BF16 = (
    int(t) for t in (GgmlType.F32, GgmlType.F16, GgmlType.I32, GgmlType.BF16))


NATIVE_MTP_MAX_DRAFT_TOKENS = 8
NATIVE_MTP_DRAFT_VERSION = 1

ACTIVATION_PART_DESC_BYTES = 128
ACTIVATION_DESC_BYTES = 2120
ACTIVATION_BOUNDARY_DESC_BYTES = 2088
MTP_DRAFT_BYTES = 56
SAMPLING_CONFIG_BYTES = 2352



# --- descriptors ------------------------------------------------------------------------------

_PART = struct.Struct("<32sIIiI4q4QQQ")
_DESC_HEAD = struct.Struct("<IiiiIIIIQ32s")
_BOUNDARY_HEAD = struct.Struct("<II32s")
_MTP = struct.Struct("<I?3xi8i4xq")
assert _PART.size == ACTIVATION_PART_DESC_BYTES
assert _DESC_HEAD.size + ACTIVATION_MAX_PARTS * _PART.size == ACTIVATION_DESC_BYTES
assert _BOUNDARY_HEAD.size + ACTIVATION_MAX_PARTS * _PART.size == ACTIVATION_BOUNDARY_DESC_BYTES
assert _MTP.size == MTP_DRAFT_BYTES

_ZERO_IDENTITY = bytes(ACTIVATION_IDENTITY_BYTES)


def ggml_type_bytes(ggml_type: int) -> int:
    try:
        return GGML_TYPE_SIZE[ggml_type]
    except KeyError:
        raise ActivationFrameError(f"activation transport does not support ggml type {ggml_type}") from None


def _exact_len(data: bytes, size: int, what: str) -> memoryview:
    view = memoryview(data).cast("B")
    if view.nbytes != size:
        raise ActivationFrameError(f"{what} must be {size} bytes, got {view.nbytes}")
    return view


@dataclass(repr=False)
class ActivationPartDesc(ActivationPartV16):
    """One typed part of a multipart activation frontier: the v16 wire's part header as the
    128-byte C struct, all zero by default (an unused slot)."""

    rank: int = 0
    dimensions: tuple = (0, 0, 0, 0)
    byte_strides: tuple = (0, 0, 0, 0)

    def is_optional(self) -> bool:
        return self.optional

    def __repr__(self) -> str:
        return (f"ActivationPartDesc(identity={bytes(self.identity)[:4].hex()}.., ggml_type={self.ggml_type}, "
                f"rank={self.rank}, token_axis={self.token_axis}, flags={self.flags}, "
                f"dimensions={tuple(self.dimensions)}, byte_strides={tuple(self.byte_strides)}, "
                f"payload_offset={self.payload_offset}, payload_bytes={self.payload_bytes})")

    def to_bytes(self) -> bytes:
        if len(self.identity) != ACTIVATION_IDENTITY_BYTES:
            raise ActivationFrameError(f"activation part identity must be {ACTIVATION_IDENTITY_BYTES} bytes")
        dims = tuple(self.dimensions) + (0,) * (ACTIVATION_MAX_DIMS - len(self.dimensions))
        strides = tuple(self.byte_strides) + (0,) * (ACTIVATION_MAX_DIMS - len(self.byte_strides))
        try:
            return _PART.pack(
                bytes(self.identity), self.ggml_type, self.rank, self.token_axis, self.flags,
                *dims[:ACTIVATION_MAX_DIMS], *strides[:ACTIVATION_MAX_DIMS],
                self.payload_offset, self.payload_bytes,
            )
        except struct.error as exc:
            raise ActivationFrameError(f"activation part field out of range: {exc}") from None

    @classmethod
    def from_bytes(cls, data: bytes) -> "ActivationPartDesc":
        v = _PART.unpack(_exact_len(data, _PART.size, "an activation part descriptor"))
        return cls(v[0], v[1], v[2], v[3], v[4], tuple(v[5:9]), tuple(v[9:13]), v[13], v[14])


def _default_parts() -> list:
    return [ActivationPartDesc() for _ in range(ACTIVATION_MAX_PARTS)]


_EMPTY_PART = ActivationPartDesc()  # never handed out: only compared with
_EMPTY_PART_BYTES = _EMPTY_PART.to_bytes()


def _pack_parts(parts: Sequence[ActivationPartDesc]) -> bytes:
    if len(parts) > ACTIVATION_MAX_PARTS:
        raise ActivationFrameError("activation part count exceeds maximum")
    # Most of the 16 slots are empty; their bytes are packed once (every decode step packs one).
    packed = [_EMPTY_PART_BYTES if part == _EMPTY_PART else part.to_bytes() for part in parts]
    return b"".join(packed) + _EMPTY_PART_BYTES * (ACTIVATION_MAX_PARTS - len(parts))


def _unpack_parts(view: memoryview, offset: int) -> list:
    # One C-level pass over the 16 slots: every decode step parses a descriptor.
    return [ActivationPartDesc(v[0], v[1], v[2], v[3], v[4], v[5:9], v[9:13], v[13], v[14])
            for v in _PART.iter_unpack(view[offset: offset + ACTIVATION_MAX_PARTS * _PART.size])]


def llama_residual_identity(n_embd: int) -> bytes:
    """The backend's part identity of the llama residual stream (skippy_stage.h, item 3):
    SHA-256 of ``"skippy_wire/llama/residual/<n_embd>/f32"``."""
    return hashlib.sha256(f"skippy_wire/llama/residual/{n_embd}/f32".encode()).digest()


def frontier_identity_of(parts: Sequence[ActivationPartDesc]) -> bytes:
    """The backend's frontier identity over a part list (skippy_stage.h, item 3): SHA-256 of
    ``"skippy_wire/frontier/v1" || u32 count || per part: identity, u32 ggml_type, u32 rank,
    i32 token_axis, i64 of every non-token dimension`` (all little-endian)."""
    digest = hashlib.sha256(b"skippy_wire/frontier/v1")
    digest.update(struct.pack("<I", len(parts)))
    for part in parts:
        digest.update(bytes(part.identity))
        digest.update(struct.pack("<IIi", part.ggml_type, part.rank, part.token_axis))
        for axis, dimension in enumerate(part.dimensions[: part.rank]):
            if axis != part.token_axis:
                digest.update(struct.pack("<q", dimension))
    return digest.digest()


@dataclass(repr=False)
class ActivationDesc(FrameSpan):
    """Version-2 activation frame descriptor (2120-byte C struct).

    ``parts`` holds the part slots (up to 16; ``to_bytes`` pads with zeroed slots); only
    the first ``part_count`` are meaningful, see :meth:`active_parts`.
    """

    sequence_count: int = 0
    part_count: int = 0
    payload_bytes: int = 0
    frontier_identity: bytes = _ZERO_IDENTITY
    parts: list = field(default_factory=_default_parts)

    def __repr__(self) -> str:
        shown = list(self.parts[: min(self.part_count, len(self.parts))])
        return (f"ActivationDesc(version={self.version}, producer_stage_index={self.producer_stage_index}, "
                f"layer_start={self.layer_start}, layer_end={self.layer_end}, token_count={self.token_count}, "
                f"sequence_count={self.sequence_count}, part_count={self.part_count}, "
                f"payload_bytes={self.payload_bytes}, frontier_identity={bytes(self.frontier_identity)[:4].hex()}.., "
                f"parts={shown!r})")

    @classmethod
    def empty(cls) -> "ActivationDesc":
        """The Rust ``empty_raw_activation_desc``: version 0, producer -1, all else zero."""
        return cls(version=0, producer_stage_index=-1)

    def active_parts(self) -> list:
        """Upstream ``parts()``: the first ``part_count`` slots; more than 16 is an error."""
        if self.part_count > ACTIVATION_MAX_PARTS or self.part_count > len(self.parts):
            raise ActivationFrameError("activation part count exceeds maximum")
        return list(self.parts[: self.part_count])

    def to_bytes(self) -> bytes:
        """Upstream ``as_raw``; ``reserved`` is always written as 0."""
        if len(self.frontier_identity) != ACTIVATION_IDENTITY_BYTES:
            raise ActivationFrameError(f"frontier identity must be {ACTIVATION_IDENTITY_BYTES} bytes")
        try:
            head = _DESC_HEAD.pack(
                self.version, self.producer_stage_index, self.layer_start, self.layer_end,
                self.token_count, self.sequence_count, self.part_count, 0, self.payload_bytes,
                bytes(self.frontier_identity),
            )
        except struct.error as exc:
            raise ActivationFrameError(f"activation descriptor field out of range: {exc}") from None
        return head + _pack_parts(self.parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ActivationDesc":
        view = _exact_len(data, ACTIVATION_DESC_BYTES, "an activation descriptor")
        v = _DESC_HEAD.unpack(view[: _DESC_HEAD.size])
        return cls(
            version=v[0], producer_stage_index=v[1], layer_start=v[2], layer_end=v[3],
            token_count=v[4], sequence_count=v[5], part_count=v[6], payload_bytes=v[8],
            frontier_identity=v[9], parts=_unpack_parts(view, _DESC_HEAD.size),
        )

    @classmethod
    def f32_rows(
        cls,
        n_embd: int,
        token_count: int,
        *,
        producer_stage_index: int = 0,
        layer_start: int = 0,
        layer_end: int = 0,
        identity: Optional[bytes] = None,
        frontier_identity: Optional[bytes] = None,
    ) -> "ActivationDesc":
        """A single F32 part ``[n_embd, token_count]`` (token axis 1), token-major rows.

        Identities default to the backend's llama residual identities."""
        payload_bytes = 4 * n_embd * token_count
        parts = _default_parts()
        parts[0] = ActivationPartDesc(
            identity=llama_residual_identity(n_embd) if identity is None else identity, ggml_type=GGML_TYPE_F32, rank=2, token_axis=1,
            dimensions=(n_embd, token_count, 0, 0), byte_strides=(4, 4 * n_embd, 0, 0),
            payload_offset=0, payload_bytes=payload_bytes,
        )
        if frontier_identity is None:
            frontier_identity = frontier_identity_of(parts[:1])
        return cls(
            version=ACTIVATION_FRAME_VERSION, producer_stage_index=producer_stage_index,
            layer_start=layer_start, layer_end=layer_end, token_count=token_count,
            sequence_count=1 if token_count else 0, part_count=1, payload_bytes=payload_bytes,
            frontier_identity=frontier_identity, parts=parts,
        )


@dataclass
class ActivationBoundaryDesc:
    """Graph-observed activation boundary of a split edge (2088-byte C struct)."""

    version: int = ACTIVATION_BOUNDARY_DESC_VERSION
    part_count: int = 0
    frontier_identity: bytes = _ZERO_IDENTITY
    parts: list = field(default_factory=_default_parts)

    def active_parts(self) -> list:
        """Upstream ``parts()``: version must be 2 and 1 <= part_count <= 16."""
        if self.version != ACTIVATION_BOUNDARY_DESC_VERSION:
            raise ActivationFrameError(f"unsupported activation boundary descriptor version {self.version}")
        if self.part_count == 0 or self.part_count > ACTIVATION_MAX_PARTS:
            raise ActivationFrameError("activation boundary part count is invalid")
        return list(self.parts[: self.part_count])

    def raw_f32_width(self, edge: str = "activation") -> int:
        """Width of the primary token-indexed F32 part (product of its non-token dims)."""
        parts = self.active_parts()
        primary = parts[0]
        if primary.ggml_type != GGML_TYPE_F32 or primary.token_axis < 0:
            raise ActivationFrameError(f"{edge} primary activation part is not token-indexed F32")
        rank, axis = primary.rank, primary.token_axis
        if rank == 0 or rank > ACTIVATION_MAX_DIMS or axis >= rank:
            raise ActivationFrameError(f"{edge} primary activation part has an invalid rank or token axis")
        elements = 1
        for index, dimension in enumerate(primary.dimensions[:rank]):
            if index == axis:
                continue
            if dimension < 0:
                raise ActivationFrameError(f"{edge} primary activation dimension is dynamic")
            elements *= dimension
            if elements > U64_MAX:
                raise ActivationFrameError("activation element count overflow")
        if elements > I32_MAX:
            raise ActivationFrameError(f"graph-observed {edge} activation width exceeds i32")
        return elements

    def payload_bytes_hint(self, edge: str, token_count: int) -> Optional[int]:
        """Payload size of ``token_count`` tokens; ``None`` while a non-token dim is dynamic."""
        total = 0
        for part in self.active_parts():
            if part.token_axis < 0 or part.token_axis >= part.rank or part.rank == 0 or part.rank > 4:
                raise ActivationFrameError(f"{edge} activation part has an invalid token axis")
            elements = 1
            for index, dimension in enumerate(part.dimensions[: part.rank]):
                if index == part.token_axis:
                    dimension = token_count
                elif dimension < 0:
                    return None
                elements *= dimension
                if elements > U64_MAX:
                    raise ActivationFrameError("activation element count overflow")
            total += elements * ggml_type_bytes(part.ggml_type)
            if total > U64_MAX:
                raise ActivationFrameError("activation payload bytes overflow")
        return total

    def payload_bytes(self, edge: str, token_count: int) -> int:
        hint = self.payload_bytes_hint(edge, token_count)
        if hint is None:
            raise ActivationFrameError(f"{edge} activation part has an unresolved dynamic dimension")
        return hint

    def to_bytes(self) -> bytes:
        head = _BOUNDARY_HEAD.pack(self.version, self.part_count, bytes(self.frontier_identity))
        return head + _pack_parts(self.parts)

    @classmethod
    def from_bytes(cls, data: bytes) -> "ActivationBoundaryDesc":
        view = _exact_len(data, ACTIVATION_BOUNDARY_DESC_BYTES, "an activation boundary descriptor")
        version, count, frontier = _BOUNDARY_HEAD.unpack(view[: _BOUNDARY_HEAD.size])
        return cls(version, count, frontier, _unpack_parts(view, _BOUNDARY_HEAD.size))


@dataclass
class ActivationFrame:
    """A descriptor and its payload; invariant ``len(payload) == desc.payload_bytes``."""

    desc: ActivationDesc
    payload: bytes = b""

    def __repr__(self) -> str:
        return f"ActivationFrame(desc={self.desc!r}, payload=<{memoryview(self.payload).nbytes} bytes>)"

    def validate_payload_len(self) -> None:
        """Checked before every native call that takes this frame as input (section 1.4)."""
        length = memoryview(self.payload).nbytes
        if self.desc.payload_bytes != length:
            raise ActivationFrameError(
                f"activation payload length {length} does not match descriptor payload_bytes "
                f"{self.desc.payload_bytes}"
            )

    @property
    def token_count(self) -> int:
        return self.desc.token_count

    def has_optional_parts(self) -> bool:
        """Whether any part is optional; an invalid part list counts as optional."""
        try:
            return any(part.is_optional() for part in self.desc.active_parts())
        except ActivationFrameError:
            return True


class PackedFrame(NamedTuple):
    """A frame in the runtime's C layout: the descriptor's bytes and the payload.  A decode
    step's input takes this form (one required F32 part, as
    :func:`skippy_wire.stage.bridge.packed_frame_from_wire` packs it), so its descriptor is
    packed once per shape rather than built and packed for every token; so does the output
    of ``decode_step_frame_raw``, whose descriptor is not parsed.  Its maker vouches for
    that one required part (:meth:`has_optional_parts` does not look); the backend still
    checks its sizes."""

    desc: bytes
    payload: bytes

    def has_optional_parts(self) -> bool:
        return False


# --- native MTP draft (runtime.md section 2.5) ----------------------------------------------


def mtp_draft_from_bytes(data: bytes) -> Optional[NativeMtpDraft]:
    """Upstream ``NativeMtpDraft::from_raw`` over the 56-byte C struct: ``None`` unless
    available, version 1 and count > 0."""
    version, available, count, *rest = _MTP.unpack(_exact_len(data, MTP_DRAFT_BYTES, "an MTP draft"))
    token_ids, compute_us = rest[:NATIVE_MTP_MAX_DRAFT_TOKENS], rest[NATIVE_MTP_MAX_DRAFT_TOKENS]
    if not available or version != NATIVE_MTP_DRAFT_VERSION or count <= 0:
        return None
    return NativeMtpDraft(list(token_ids[: min(count, NATIVE_MTP_MAX_DRAFT_TOKENS)]), compute_us)


def pack_mtp_draft(available: bool, token_ids: Sequence[int] = (), proposal_compute_us: int = 0,
                   version: int = NATIVE_MTP_DRAFT_VERSION, token_count: Optional[int] = None) -> bytes:
    """The raw 56-byte C struct (for tests)."""
    ids = list(token_ids)[:NATIVE_MTP_MAX_DRAFT_TOKENS]
    ids += [0] * (NATIVE_MTP_MAX_DRAFT_TOKENS - len(ids))
    count = len(token_ids) if token_count is None else token_count
    return _MTP.pack(version, available, count, *ids, proposal_compute_us)


__all__ = [
    "ACTIVATION_BOUNDARY_DESC_BYTES", "ACTIVATION_BOUNDARY_DESC_VERSION", "ACTIVATION_DESC_BYTES",
    "ACTIVATION_FLAG_GEMMA3N_ALTUP", "ACTIVATION_FLAG_INKLING_MTP_EMBD", "ACTIVATION_FLAG_RWKV7_V_FIRST",
    "ACTIVATION_FRAME_VERSION", "ACTIVATION_IDENTITY_BYTES", "ACTIVATION_MAX_DIMS", "ACTIVATION_MAX_PARTS",
    "ACTIVATION_PART_DESC_BYTES", "ACTIVATION_PART_OPTIONAL", "GGML_TYPE_BF16", "GGML_TYPE_F16",
    "GGML_TYPE_F32", "GGML_TYPE_I32", "I32_MAX", "I32_MIN", "MTP_DRAFT_BYTES", "NATIVE_MTP_DRAFT_VERSION", "NATIVE_MTP_MAX_DRAFT_TOKENS",
    "SAMPLING_CONFIG_BYTES", "U32_MAX", "U64_MAX",
    "ActivationBoundaryDesc", "ActivationDesc", "ActivationFrame", "ActivationFrameError",
    "ActivationPartDesc", "NativeMtpDraft", "PackedFrame", "PartialBatchExecution",
    "SamplingConfigError", "StageArgumentError", "StageRuntimeError", "Status",
    "format_status_error", "frontier_identity_of", "ggml_type_bytes", "llama_residual_identity",
    "mtp_draft_from_bytes", "pack_mtp_draft",
]
