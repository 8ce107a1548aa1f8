"""Stage messages, replies and their constants (wire-format.md sections 1-4, 11, 12).

Plain Python classes shared by both framing implementations (the Cython ``_frame`` and the
reference ``_reference.frame``).  Field names are the upstream (Rust) names.

Representation choices:

* f32 fields of :class:`SamplingConfig` are Python floats.  Every non-NaN f32 round-trips
  exactly through a float; a NaN read from the wire is an :class:`F32` (a float that keeps
  its exact binary32 bit pattern in ``.bits``) so that NaN payloads survive a read/write
  round trip (section 4.3: "f32 fields must round-trip bit-exactly").
* ``StageWireMessage.activation``: on write, the already *encoded* payload (any contiguous
  bytes-like object).  On read it is the payload *decoded* to little-endian f32 bytes
  (section 4.1 asymmetry): ``b""`` when there is none, else a read-only ``memoryview``
  (format ``"B"``) over an owned float32 array.  ``activation_f32()`` gives the float32 view.
* ``tokens`` / ``positions`` are read back as ``list[int]``; the writer accepts any sequence
  of ints (list, tuple, ``array('i')``, int32 ndarray).
"""

from __future__ import annotations

import array
import enum
import numbers
import reprlib
import struct
from dataclasses import dataclass, field, fields
from typing import Any, NamedTuple, Optional, Sequence, Union

import numpy as np

from ..errors import InvalidDataError
from .constants import (
    DECODED_MAX_TEXT,
    DEFAULT_DRY_SEQUENCE_BREAKERS,
    DEFAULT_SAMPLERS,
    MAX_STAGE_DECODED_ACTIVATION_BYTES,
    MAX_STAGE_DRY_SEQUENCE_BREAKERS,
    MAX_STAGE_LOGIT_BIAS,
    MAX_STAGE_SAMPLERS,
    STAGE_LOGIT_BIAS_WIRE_BYTES,
    STAGE_SAMPLING_CONFIG_BASE_BYTES,
    STAGE_STATE_VERSION,
    STAGE_WIRE_FIXED_HEADER_BYTES,
    U64_MAX,
    ActivationCodec,
    StateFlags,
    UpstreamEnum,
    activation_frame_flags_from_state_flags,
)

# --- enumerations (section 2) ------------------------------------------------------------
class WireStagePhase(enum.IntEnum):
    """The state header's ``phase`` word (section 2.2); ``WireMessageKind.expected_phase``
    gives the one a kind goes with."""

    PREFILL = 1
    DECODE = 2
    DECODE_REPLAY = 3
    DECODE_LIGHT = 4


class WireMessageKind(UpstreamEnum):
    """Stage message kinds (section 2.1); 10, 11, 12, 23 and others are unknown."""

    PREFILL_EMBD = 1
    DECODE_EMBD = 2
    STOP = 3
    PREFILL_FINAL_EMBD = 4
    DECODE_REPLAY_EMBD = 5
    DECODE_REPLAY_FINAL_EMBD = 6
    STATE_IMPORT = 7
    DECODE_READOUT = 8
    DECODE_LIGHT_CTX = 9
    STATE_EXPORT = 13
    CONFIGURE_GENERATION = 14
    PROBE_PREFILL = 15
    RESTORE_PREFILL = 16
    TRY_RESTORE_PREFILL = 17
    TRY_RESTORE_PREFILL_DECODE = 18
    TRIM_SESSION = 19
    PREDICTION_RETURN_OPEN = 20
    VERIFY_WINDOW = 21
    RETIRE_VERIFY_WINDOW = 22

    @property
    def expected_phase(self) -> WireStagePhase:
        if self in _DECODE_REPLAY_KINDS:
            return WireStagePhase.DECODE_REPLAY
        if self is WireMessageKind.DECODE_LIGHT_CTX:
            return WireStagePhase.DECODE_LIGHT
        if self in _PREFILL_PHASE_KINDS:
            return WireStagePhase.PREFILL
        return WireStagePhase.DECODE

    is_prefill = property(lambda self: self in (WireMessageKind.PREFILL_EMBD, WireMessageKind.PREFILL_FINAL_EMBD))
    is_decode_replay = property(lambda self: self in _DECODE_REPLAY_KINDS)
    is_decode_light_context = property(lambda self: self is WireMessageKind.DECODE_LIGHT_CTX)
    requires_predicted_reply = property(lambda self: self in _PREDICTED_REPLY_KINDS)
    is_session_control = property(lambda self: self is WireMessageKind.TRIM_SESSION)
    is_verify_retirement = property(lambda self: self is WireMessageKind.RETIRE_VERIFY_WINDOW)
    is_generation_control = property(lambda self: self is WireMessageKind.CONFIGURE_GENERATION)
    is_prefix_cache_control = property(lambda self: 15 <= self <= 18)
    is_activationless_prefix_cache_control = property(lambda self: 15 <= self <= 17)


_DECODE_REPLAY_KINDS: frozenset[int] = frozenset({WireMessageKind.DECODE_REPLAY_EMBD,
                                                  WireMessageKind.DECODE_REPLAY_FINAL_EMBD})
_PREDICTED_REPLY_KINDS: frozenset[int] = frozenset({2, 8, 9, 21, 4, 6})
_PREFILL_PHASE_KINDS = frozenset({1, 4, 7, 13, 14, 15, 16, 17, 18, 19, 22})
#: Kinds never carrying activation regardless of the source (writer list, section 4.4 step 5).
ACTIVATIONLESS_WRITE_KINDS = frozenset({7, 15, 16, 17})
#: The reader's list additionally holds Stop (section 4.5 step 7).
ACTIVATIONLESS_READ_KINDS = frozenset({3, 7, 15, 16, 17})
#: Kinds that ``matches_kind`` accepts unconditionally (section 3.3).
_ALWAYS_MATCHING_KINDS = frozenset({7, 13, 19, 22, 14})
#: The kind state versions 16 and 17 add (wire-v16-v17.md A.2): phase Decode, and
#: ``matches_kind`` always true for it.
DISCARD_STALE_WINDOWS = 23


class SamplingFlags(enum.IntFlag):
    ENABLED = 1 << 0
    IGNORE_EOS = 1 << 1


# --- reprs and error texts that stay short ----------------------------------------------
class _ShortRepr(reprlib.Repr):
    """reprlib's cut-short repr, bytes-likes included (reprlib would make their whole repr first)."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = self.maxother = 80
        self.maxlong = 60

    def repr_bytes(self, value: bytes, level: int) -> str:
        return repr(value) if len(value) <= 32 else f"<{len(value)} bytes: {bytes(value[:16])!r}...>"

    repr_bytearray = repr_bytes

    def repr_ndarray(self, value: np.ndarray, level: int) -> str:  # one line, its first items
        items = self.repr_list(value.ravel()[:self.maxlist + 1].tolist(), level)
        return f"array({items}, dtype={value.dtype}, shape={value.shape})"


_SHOWN = _ShortRepr()
#: The fields :func:`short_repr` shows as their size: a message's and a frame's payloads.
_PAYLOAD_FIELDS = frozenset({"activation", "raw_bytes", "payload"})
#: Values :func:`short_repr` cuts short (an int too: one past Python's printable digits raised);
#: others, a header, show their own repr.
_LONG_VALUES = (list, tuple, str, bytes, bytearray, np.ndarray, array.array, int)


def cut_repr(value: Any) -> str:
    """``repr(value)`` cut short for an error text or a message's repr: a field given a list of
    a million items, or an int of more digits than Python will print, is shown in one line."""
    try:
        return _SHOWN.repr(value)
    except ValueError:  # an int past sys.get_int_max_str_digits()
        return f"<an int of {value.bit_length()} bits>" if isinstance(value, int) else f"<a {type(value).__name__}>"


def short_repr(obj: Any) -> str:
    """A dataclass's repr that stays short whatever it carries: a payload as its size, token
    ids and texts cut short (:func:`cut_repr`), other fields as usual."""
    parts = []
    for f in fields(obj):
        value = getattr(obj, f.name)
        text = None
        if f.name in _PAYLOAD_FIELDS:
            try:
                text = f"<{memoryview(value).nbytes} bytes>"
            except (TypeError, ValueError):  # no buffer, or a released one: as any other value
                pass
        if text is None:
            text = cut_repr(value) if isinstance(value, _LONG_VALUES) else repr(value)
        parts.append(f"{f.name}={text}")
    return f"{type(obj).__name__}({', '.join(parts)})"


# --- exact f32 values --------------------------------------------------------------------
#: What setting or deleting an attribute of an :class:`F32` raises.
_F32_IMMUTABLE = "F32 is immutable (its bits are fixed when it is made)"


class F32(float):
    """A float that remembers an exact binary32 bit pattern (used for NaNs read off the wire,
    whose payload/signalling bit a plain float cannot carry).  Immutable, as a float is (the
    compiled reader shares one between the messages it reads from the same bytes), and equal
    to another F32 of the same bits, so a message holding a NaN equals its copy."""

    __slots__ = ("bits",)
    bits: int

    def __new__(cls, bits: int) -> "F32":
        if not isinstance(bits, numbers.Integral):
            raise TypeError(f"F32 takes a binary32 bit pattern (an int such as 0x7fc00001), not {type(bits).__name__}")
        self = float.__new__(cls, struct.unpack("<f", struct.pack("<I", bits & 0xFFFFFFFF))[0])
        object.__setattr__(self, "bits", int(bits) & 0xFFFFFFFF)
        return self

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(_F32_IMMUTABLE)

    def __delattr__(self, name: str) -> None:
        raise AttributeError(_F32_IMMUTABLE)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, F32) and float.__ne__(self, self):  # two NaNs: by their bits
            return self.bits == other.bits
        return float.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other

    def __hash__(self) -> int:
        return hash((F32, self.bits)) if float.__ne__(self, self) else float.__hash__(self)  # NaN: by its bits

    def __repr__(self) -> str:
        return f"F32(0x{self.bits:08x})"

    def __reduce__(self):
        return (F32, (self.bits,))


_pack_f = struct.Struct("<f").pack
_unpack_f = struct.Struct("<f").unpack
_pack_I = struct.Struct("<I").pack
_unpack_I = struct.Struct("<I").unpack


def f32_bits(value: float) -> int:
    """The binary32 bit pattern a value is written as (round to nearest; overflow to inf)."""
    if type(value) is F32:
        return value.bits
    try:
        return _unpack_I(_pack_f(value))[0]
    except (OverflowError, struct.error) as error:
        # |value| rounds beyond f32::MAX (a float or a Decimal: OverflowError; an int beyond
        # f32 or even f64: struct.error, as for a value of no number type): IEEE RNE gives
        # infinity, as the compiled writer's conversion through a double does
        if isinstance(error, struct.error) and not isinstance(value, numbers.Real):
            raise
        return 0xFF800000 if value < 0 else 0x7F800000


def as_f32(value: float) -> float:
    """``value`` as the f32 the wire carries it as (round to nearest, overflow to infinity)."""
    return f32_from_bits(f32_bits(value))


def f32_from_bits(bits: int) -> float:
    """A float for an f32 bit pattern; exact for every non-NaN, an :class:`F32` for NaNs."""
    if (bits & 0x7F800000) == 0x7F800000 and (bits & 0x007FFFFF):
        return F32(bits)
    return _unpack_f(_pack_I(bits))[0]


# --- state header (section 3) ------------------------------------------------------------
@dataclass
class StageStateHeader:
    """The 40-byte state header (section 3.1).  ``flags`` is the raw i32 flag word."""

    version: int = STAGE_STATE_VERSION
    seq_id: int = 0
    phase: int = WireStagePhase.PREFILL
    flags: int = 0
    checkpoint_generation: int = 0
    prompt_token_count: int = 0
    decode_step: int = -1
    current_token: int = -1
    source_stage_index: int = -1
    activation_codec: ActivationCodec = ActivationCodec.RAW_F32_V1

    __repr__ = short_repr  # a field given an int of 5,000 digits: repr raised

    @classmethod
    def new(cls, kind: int, version: int = STAGE_STATE_VERSION) -> "StageStateHeader":
        """Upstream ``StageStateHeader::new(kind)`` (section 3.2) of state ``version``: from 16
        on the same defaults but the version (wire-v16-v17.md A.1), and kind 23 known."""
        if kind == DISCARD_STALE_WINDOWS and version > STAGE_STATE_VERSION:
            return cls(version=version, phase=WireStagePhase.DECODE)
        kind = WireMessageKind(kind)
        flags = 0
        if kind in (WireMessageKind.PREFILL_FINAL_EMBD, WireMessageKind.DECODE_REPLAY_FINAL_EMBD):
            flags |= StateFlags.FINAL_CHUNK
        if kind is WireMessageKind.DECODE_LIGHT_CTX:
            flags |= StateFlags.LIGHT_CONTEXT
        return cls(version=version, phase=kind.expected_phase, flags=int(flags))

    def matches_kind(self, kind: int) -> bool:
        """Advisory phase/flag consistency check (section 3.3); the reader never calls it."""
        if kind == DISCARD_STALE_WINDOWS and self.version > STAGE_STATE_VERSION:
            return True
        kind = WireMessageKind(kind)
        if kind in _ALWAYS_MATCHING_KINDS:
            return True
        final = kind in (WireMessageKind.PREFILL_FINAL_EMBD, WireMessageKind.DECODE_REPLAY_FINAL_EMBD)
        return (
            self.phase == kind.expected_phase
            and bool(self.flags & StateFlags.FINAL_CHUNK) == final
            and bool(self.flags & StateFlags.LIGHT_CONTEXT) == (kind is WireMessageKind.DECODE_LIGHT_CTX)
        )

    @property
    def activation_frame_flags(self) -> int:
        return activation_frame_flags_from_state_flags(self.flags)


# --- sampling block (section 4.3) --------------------------------------------------------
class LogitBias(NamedTuple):
    """One ``SamplingConfig.logit_bias`` entry: an i32 token id and its f32 bias (a plain
    ``(token_id, bias)`` tuple is accepted too)."""

    token_id: int
    bias: float


def _wire(code: str, default: Any) -> Any:
    """A sampling field: its wire code ("I" u32, "i" i32, "f" f32, "L" logit bias pairs, "S"
    a string list, "B" the u32 boolean) and upstream ``Default``; lists get a fresh list per
    instance."""
    metadata = {"wire": code, "default": default}
    if code in "LS":
        return field(default_factory=lambda: list(default), metadata=metadata)
    return field(default=default, metadata=metadata)


@dataclass
class SamplingConfig:
    """Upstream ``StageSamplingConfig`` with its ``Default`` values (section 4.3), fields in
    wire order; logit_bias holds (token_id, bias) pairs."""

    flags: int = _wire("I", 0)
    seed: int = _wire("I", 0)
    temperature: float = _wire("f", 1.0)
    top_p: float = _wire("f", 1.0)
    top_k: int = _wire("i", 0)
    min_p: float = _wire("f", 0.0)
    presence_penalty: float = _wire("f", 0.0)
    frequency_penalty: float = _wire("f", 0.0)
    repeat_penalty: float = _wire("f", 1.0)
    penalty_last_n: int = _wire("i", -1)
    logit_bias: list = _wire("L", ())
    typical_p: float = _wire("f", 1.0)
    top_nsigma: float = _wire("f", -1.0)
    dynatemp_range: float = _wire("f", 0.0)
    dynatemp_exponent: float = _wire("f", 1.0)
    dry_multiplier: float = _wire("f", 0.0)
    dry_base: float = _wire("f", 1.75)
    dry_allowed_length: int = _wire("i", 2)
    dry_penalty_last_n: int = _wire("i", 64)
    dry_sequence_breakers: list = _wire("S", DEFAULT_DRY_SEQUENCE_BREAKERS)
    xtc_probability: float = _wire("f", 0.0)
    xtc_threshold: float = _wire("f", 0.1)
    mirostat_mode: int = _wire("i", 0)
    mirostat_entropy: float = _wire("f", 5.0)
    mirostat_learning_rate: float = _wire("f", 0.1)
    samplers: list = _wire("S", DEFAULT_SAMPLERS)
    ignore_eos: bool = _wire("B", False)

    __repr__ = short_repr  # 100,000 logit biases made a 13.7 MB repr

    def enabled(self) -> bool:
        return bool(self.flags & SamplingFlags.ENABLED)

    def wire_bytes(self) -> int:
        """Size of the block the writer emits (truncating lists as the writer does)."""
        n = STAGE_SAMPLING_CONFIG_BASE_BYTES + STAGE_LOGIT_BIAS_WIRE_BYTES * min(len(self.logit_bias), MAX_STAGE_LOGIT_BIAS)
        for s in self.dry_sequence_breakers[:MAX_STAGE_DRY_SEQUENCE_BREAKERS]:
            n += 4 + len(s.encode("utf-8"))
        for s in self.samplers[:MAX_STAGE_SAMPLERS]:
            n += 4 + len(s.encode("utf-8"))
        return n


#: The sampling block in wire order: (name, struct code, upstream ``Default``), read off
#: SamplingConfig's fields (the one place they are spelled).
SAMPLING_FIELDS = tuple((f.name, f.metadata["wire"], f.metadata["default"]) for f in fields(SamplingConfig))
SAMPLING_WIRE_ORDER = tuple((name, code) for name, code, _ in SAMPLING_FIELDS)
SAMPLING_F32_FIELDS = tuple(name for name, code in SAMPLING_WIRE_ORDER if code == "f")


# --- the stage message (sections 4 and 12) -----------------------------------------------
class RequestEpoch(NamedTuple):
    """Upstream ``request_epoch()``: the flow identity and its progress (section 12).  The
    flow and staleness predicates live here; the message methods of the same names ask them."""

    request_id: int
    session_id: int
    checkpoint_generation: int
    prompt_token_count: int
    decode_step: int

    def same_flow(self, other: "RequestEpoch") -> bool:
        return self.request_id == other.request_id and self.session_id == other.session_id

    def progress(self) -> tuple[int, int, int]:
        """(checkpoint_generation, prompt_token_count, decode_step), compared lexicographically."""
        return self.checkpoint_generation, self.prompt_token_count, self.decode_step

    def is_stale_for(self, current: "RequestEpoch") -> bool:
        return self.same_flow(current) and self.progress() < current.progress()


_POSITIONED_KINDS = frozenset({2, 8, 9, 21})

#: Token ids or positions as the writers and the runtime take them: a list, a tuple, an
#: ``array('i')`` or an integer ndarray.
TokenIds = Union[Sequence[int], np.ndarray]


@dataclass(eq=False)
class StageWireMessage:
    """One stage message (section 4.1).  See the module docstring for ``activation``."""

    kind: WireMessageKind
    pos_start: int = 0
    token_count: int = 0
    state: StageStateHeader = field(default_factory=StageStateHeader)
    request_id: int = 0
    session_id: int = 0
    sampling: Optional[SamplingConfig] = None
    chat_sampling_metadata: Optional[str] = None
    tokens: TokenIds = field(default_factory=list)
    positions: TokenIds = field(default_factory=list)
    activation: Any = b""
    raw_bytes: Any = b""

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, StageWireMessage):
            return NotImplemented
        return fields_equal(self, other, as_list=("tokens", "positions"), as_bytes=("activation", "raw_bytes"))

    __hash__ = None  # type: ignore[assignment]
    __repr__ = short_repr  # a 512 MiB StateImport's repr was 2 GB of text

    def __getstate__(self) -> dict:
        # pickle / deepcopy: a read message's activation is a memoryview, which cannot be
        # pickled; carry its bytes and hand back a read-only memoryview over them.
        state = dict(self.__dict__)
        views = [name for name in ("activation", "raw_bytes") if isinstance(state[name], memoryview)]
        for name in views:
            state[name] = state[name].tobytes()
        state["_memoryviews"] = views
        return state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        for name in state.pop("_memoryviews", ()):
            state[name] = memoryview(state[name])
        self.__dict__.update(state)

    # constructors (section 12)
    @classmethod
    def stop(cls, request_id: int = 0, session_id: int = 0, *, version: int = STAGE_STATE_VERSION
             ) -> "StageWireMessage":
        """``StageWireMessage::stop()`` / ``stop_with_identity(request_id, session_id)``, its
        header of state ``version`` (a writer writes the header's version as given)."""
        return cls(WireMessageKind.STOP, 0, 0, StageStateHeader.new(WireMessageKind.STOP, version), request_id,
                   session_id)

    stop_with_identity = stop

    @classmethod
    def configure_generation(
        cls,
        request_id: int,
        session_id: int,
        prompt_token_count: int,
        sampling: Optional[SamplingConfig] = None,
        chat_sampling_metadata: Optional[str] = None,
        *,
        version: int = STAGE_STATE_VERSION,
    ) -> "StageWireMessage":
        """``StageWireMessage::configure_generation(...)``, its header of state ``version``."""
        state = StageStateHeader.new(WireMessageKind.CONFIGURE_GENERATION, version)
        state.prompt_token_count = prompt_token_count
        return cls(
            WireMessageKind.CONFIGURE_GENERATION, 0, 0, state, request_id, session_id, sampling, chat_sampling_metadata
        )

    # sizes
    def estimated_wire_bytes(self) -> int:
        """80 + sampling + metadata + payload, as upstream (saturating at u64::MAX)."""
        n = STAGE_WIRE_FIXED_HEADER_BYTES
        if self.sampling is not None:
            n += self.sampling.wire_bytes()
        if self.chat_sampling_metadata is not None:
            n += 4 + len(self.chat_sampling_metadata.encode("utf-8"))
        if self.kind == WireMessageKind.STATE_IMPORT:
            n += _nbytes(self.raw_bytes)
        else:
            n += 4 * len(self.tokens) + 4 * len(self.positions) + _nbytes(self.activation)
        return min(n, U64_MAX)

    # epochs and flows (section 12)
    def request_epoch(self) -> RequestEpoch:
        s = self.state
        return RequestEpoch(self.request_id, self.session_id, s.checkpoint_generation, s.prompt_token_count, s.decode_step)

    def same_flow(self, other: "StageWireMessage") -> bool:
        return self.request_epoch().same_flow(other.request_epoch())

    def is_stale_for(self, current: "StageWireMessage") -> bool:
        return self.request_epoch().is_stale_for(current.request_epoch())

    def authoritative_session_position(self) -> Optional[int]:
        if self.kind in _POSITIONED_KINDS and self.pos_start >= 0:
            return self.pos_start
        return None

    def verify_window_id(self) -> Optional[int]:
        return self.state.seq_id if self.kind == WireMessageKind.VERIFY_WINDOW else None

    def verify_window_base_position(self) -> Optional[int]:
        return self.pos_start if self.kind == WireMessageKind.VERIFY_WINDOW else None

    def verify_window_token_count(self) -> Optional[int]:
        return self.token_count if self.kind == WireMessageKind.VERIFY_WINDOW else None

    # decoded activation access (section 12)
    def activation_f32_payload(self) -> bytes:
        """A copy of the (already decoded) f32 activation bytes; no decoding happens here."""
        if _nbytes(self.activation) > MAX_STAGE_DECODED_ACTIVATION_BYTES:
            raise InvalidDataError(DECODED_MAX_TEXT)
        return bytes(self.activation)

    def take_activation_f32_payload(self) -> bytes:
        payload = self.activation_f32_payload()
        self.activation = b""
        return payload

    def activation_f32(self):
        """The decoded activation as a little-endian float32 numpy array (a view, no copy)."""
        return np.frombuffer(self.activation, dtype="<f4")


def _nbytes(buf: Any) -> int:
    if type(buf) is bytes or type(buf) is bytearray:
        return len(buf)
    return memoryview(buf).nbytes




def fields_equal(a: Any, b: Any, *, as_list: tuple = (), as_bytes: tuple = ()) -> bool:
    """Dataclass equality field by field, with the ``as_list`` fields compared element-wise
    (a tuple or array equals the list it holds) and the ``as_bytes`` fields bytewise (a
    memoryview equals the bytes it holds)."""
    for f in fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if f.name in as_list:
            x, y = list(x), list(y)
        elif f.name in as_bytes:
            x, y = bytes(x), bytes(y)
        if x != y:
            return False
    return True


__all__ = [
    "ACTIVATIONLESS_READ_KINDS", "ACTIVATIONLESS_WRITE_KINDS", "F32", "LogitBias", "RequestEpoch",
    "SAMPLING_F32_FIELDS", "SAMPLING_FIELDS", "SAMPLING_WIRE_ORDER", "SamplingConfig", "SamplingFlags", "StageStateHeader",
    "StageWireMessage", "WireMessageKind", "WireStagePhase", "f32_bits", "f32_from_bits",
    "TokenIds", "cut_repr", "fields_equal", "short_repr",
]
