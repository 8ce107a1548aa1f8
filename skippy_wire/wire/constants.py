"""Every constant of the wire protocol, defined once: the limits and sizes of section 1, the
activation codecs and policies (6.1, 8.2), the flag bits (2.4-2.5), the sampling defaults
(4.3) and the error texts that several modules raise.

The compiled kernels read these values at import time (``_wire_constants.pxi``); the
pure-Python twin imports them like any module.

Numeric policy of each codec, in short (docs/numerics.md has the long form):

* ``RAW_F32_V1`` carries the f32 bit patterns unchanged (NaN payloads, infinities, -0.0,
  subnormals).
* ``F16_RNE_V1`` / ``BF16_RNE_V1`` round to nearest, ties to even, on the integer bit
  pattern.  Encoding rejects non-finite input and values that round to infinity.  The raw
  f16 conversion maps NaN to ``0x7c01 | sign`` (payload dropped, as upstream); the raw bf16
  conversion keeps a NaN's top 16 bits and sets the quiet bit (upstream's bias formula
  could carry a NaN into infinity; encode never reaches either, it rejects NaN first).
* ``S8_ROW_F32_RNE_V1`` stores each row as an f32 scale plus int8 values in [-127, 127].
"""

from __future__ import annotations

import enum
import functools
import operator
from typing import Any

from ..errors import InvalidInputError

# --- protocol constants and limits (section 1) -------------------------------------------
STAGE_STATE_VERSION = 15
READY_MAGIC = 0x53524459
READY_BYTES = READY_MAGIC.to_bytes(4, "little")  # b"YDRS"
LLAMA_TOKEN_NULL = -1
STAGE_STATE_HEADER_BYTES = 40
STAGE_WIRE_FIXED_HEADER_BYTES = 80
STAGE_SAMPLING_CONFIG_BASE_BYTES = 108
STAGE_LOGIT_BIAS_WIRE_BYTES = 8
MAX_STAGE_LOGIT_BIAS = 256
MAX_STAGE_SAMPLERS = 16
MAX_STAGE_DRY_SEQUENCE_BREAKERS = 8
MAX_STAGE_SAMPLING_STRING_BYTES = 64
MAX_STAGE_PREDICTED_TOKENS = 262_144
MAX_STAGE_SIDEBAND_VALUES = 1_048_576
MAX_STAGE_CHAT_SAMPLING_METADATA_BYTES = 8 * 1024 * 1024
#: The one 512 MiB cap: state-import bytes, encoded (wire) and decoded (f32) activations.
_MAX_PAYLOAD_BYTES = 512 * 1024 * 1024
MAX_STAGE_STATE_IMPORT_BYTES = _MAX_PAYLOAD_BYTES
MAX_STAGE_ACTIVATION_BYTES = _MAX_PAYLOAD_BYTES
MAX_STAGE_DECODED_ACTIVATION_BYTES = _MAX_PAYLOAD_BYTES
STAGE_REPLY_STATS_COUNT = 27
STAGE_REPLY_STATS_BYTES = STAGE_REPLY_STATS_COUNT * 8

I32_MIN, I32_MAX = -(2**31), 2**31 - 1
U32_MAX = 2**32 - 1
I64_MIN, I64_MAX = -(2**63), 2**63 - 1
U64_MAX = 2**64 - 1
#: The smallest positive f32 (a subnormal); a smaller positive number is 0 as an f32.
F32_SMALLEST = 2.0**-149


def wrapped_i32(value: int) -> int:
    """A u32 reinterpreted as i32, as upstream's ``value as i32`` (2^31 and above wrap negative)."""
    value &= U32_MAX
    return value - (1 << 32) if value > I32_MAX else value

# --- sampling defaults (upstream StageSamplingConfig::default, section 4.3) ---------------
DEFAULT_DRY_SEQUENCE_BREAKERS = ("\n", ":", '"', "*")
DEFAULT_SAMPLERS = ("penalties", "dry", "top_n_sigma", "top_k", "typical_p", "top_p", "min_p", "xtc", "temperature")

# --- error texts raised by more than one module (section 10 and the API's own) -----------
UNKNOWN_CODEC_TEXT = "unknown stage activation codec"
NEGATIVE_DIMENSIONS_TEXT = "negative activation dimensions"
WIRE_OVERFLOW_TEXT = "activation wire byte count overflow"
WIRE_MAX_TEXT = "activation payload byte count exceeds maximum"
WIRE_SIZE_TEXT = "activation payload size mismatch"
DECODED_MAX_TEXT = "decoded activation payload byte count exceeds maximum"
NO_RAW_FALLBACK_TEXT = "lossless activation selection requires RawF32 fallback"
NON_CONTIGUOUS_TEXT = "payload must be a C-contiguous buffer"
OBJECT_ARRAY_TEXT = "payload must not be an array of Python objects"
#: A payload read as f32 values whose elements are typed otherwise (float64, int32, big-endian
#: f32, float16...); filled with "format 'd'" (a buffer's format) or "dtype float64" (an array's).
PAYLOAD_FORMAT_TEXT = "payload must be little-endian f32 values or raw bytes, not {}"
#: An object without the buffer protocol (a list, None): a TypeError, worded as CPython's own;
#: filled with the type's name.
NOT_BYTES_LIKE_TEXT = "a bytes-like object is required, not {!r}"
DIMENSION_RANGE_TEXT = "activation dimensions must fit in an i32"
#: State flags are upstream's i32 flag word, frame flags its u64: a wider int would lose bits.
STATE_FLAGS_RANGE_TEXT = "state flags must fit in an i32"
FRAME_FLAGS_RANGE_TEXT = "activation frame flags must fit in a u64"
BITS_DTYPE_U32_TEXT = "expected a numpy uint32 array of f32 bit patterns"
BITS_DTYPE_U16_TEXT = "expected a numpy uint16 array of 16-bit float bit patterns"
OUT_NON_CONTIGUOUS_TEXT = "out must be a C-contiguous buffer"
OUT_READ_ONLY_TEXT = "out must be a writable buffer"
OUT_OBJECT_ARRAY_TEXT = "out must not be an array of Python objects"
OUT_OVERLAP_TEXT = "out must not overlap the payload"
SEQUENCE_CHANGED_TEXT = "a token or position list changed length while the message was written"
PART_AXES_TEXT = "activation part dimensions and byte strides are 4 values each"
DESCRIPTOR_RANGE_TEXT = "activation frame descriptor field out of range"
AGREEMENT_RANGE_TEXT = "activation agreement field out of range"
ACTIVATIONLESS_PAYLOAD_TEXT = "activationless stage message contains activation payload"
SAMPLING_STRING_LENGTH_TEXT = "sampling string exceeds maximum length"


class UpstreamEnum(enum.IntEnum):
    """An enum whose member names spell upstream's: ``BF16_RNE_V1`` is the Rust variant
    ``Bf16RneV1`` and the serde string ``"bf16-rne-v1"``."""

    @functools.cached_property
    def rust_name(self) -> str:
        """The upstream enum variant name (used in error texts and the vectors' names)."""
        return "".join(part.capitalize() for part in self.name.split("_"))

    @functools.cached_property
    def serde_name(self) -> str:
        return self.name.lower().replace("_", "-")

    @classmethod
    def from_rust_name(cls, text: str):
        return cls._named(text, "rust_name")

    @classmethod
    def from_serde_name(cls, text: str):
        return cls._named(text, "serde_name")

    @classmethod
    def label(cls) -> str:
        """What a member is called in error texts: ``ActivationCodec`` -> "activation codec"."""
        return "".join(f" {c.lower()}" if c.isupper() else c for c in cls.__name__).strip()

    @classmethod
    def _named(cls, text: str, spelling: str):
        for member in cls:
            if getattr(member, spelling) == text:
                return member
        raise ValueError(f"unknown {cls.label()} {text!r}")


class ActivationCodec(UpstreamEnum):
    """Wire ids of the activation codecs (the i32 at message offset 56)."""

    RAW_F32_V1 = 1
    F16_RNE_V1 = 2
    BF16_RNE_V1 = 3
    S8_ROW_F32_RNE_V1 = 4

    def identity(self) -> str:
        """Upstream ``StageActivationCodec::identity()``: the serde string, e.g. ``"bf16-rne-v1"``."""
        return self.serde_name

    @classmethod
    def from_identity(cls, text: str) -> "ActivationCodec":
        return cls.from_serde_name(text)

    @classmethod
    def default(cls) -> "ActivationCodec":
        """Upstream ``StageActivationCodec::default()``: bit-exact raw f32."""
        return cls.RAW_F32_V1


#: Codecs a receiver admits under AUTO_LOSSLESS_V1, and the selector's default candidate list.
LOSSLESS_CODECS = (ActivationCodec.RAW_F32_V1, ActivationCodec.BF16_RNE_V1, ActivationCodec.F16_RNE_V1)


class CodecPolicy(UpstreamEnum):
    """Upstream ``StageActivationCodecPolicy`` (not on the wire; values are ours)."""

    FIXED = 0
    AUTO_LOSSLESS_V1 = 1

    @classmethod
    def label(cls) -> str:
        return "activation codec policy"

    def compatible(self, configured: ActivationCodec) -> bool:
        """Whether a producer may run this policy with ``configured`` as its codec."""
        return self is CodecPolicy.FIXED or configured == ActivationCodec.RAW_F32_V1

    def permits(self, configured: ActivationCodec, frame_codec: ActivationCodec) -> bool:
        """Receiver admission (wire-format.md 8.2): may a frame in ``frame_codec`` be read?"""
        if self is CodecPolicy.FIXED:
            return configured == frame_codec
        return configured == ActivationCodec.RAW_F32_V1 and frame_codec in LOSSLESS_CODECS

    def identity(self, configured: ActivationCodec) -> str:
        """Upstream ``identity(configured)``: Fixed -> the codec's identity, else the policy's."""
        if self is CodecPolicy.FIXED:
            return ActivationCodec(configured).identity()
        return self.serde_name


#: Short names that the command line and topology files accept beside the identities.
CODEC_SHORT_NAMES = {"raw-f32": "raw-f32-v1", "f16": "f16-rne-v1", "bf16": "bf16-rne-v1", "s8": "s8-row-f32-rne-v1"}
POLICY_SHORT_NAMES = {"auto-lossless": "auto-lossless-v1"}


def named_codec_setting(codec: str, policy: str,
                        keys: tuple[str, str] = ("codec", "policy")) -> tuple[ActivationCodec, CodecPolicy]:
    """A codec and a policy as a user names them (identities or short names), checked
    together; ``keys`` are what the caller calls the two in its errors."""
    codec_enum = ActivationCodec.from_identity(CODEC_SHORT_NAMES.get(codec, codec))
    policy_enum = CodecPolicy.from_serde_name(POLICY_SHORT_NAMES.get(policy, policy))
    if not policy_enum.compatible(codec_enum):
        raise ValueError(f"{keys[1]} {policy_enum.serde_name} requires {keys[0]} "
                         f"{ActivationCodec.RAW_F32_V1.identity()}, not {codec_enum.identity()}")
    return codec_enum, policy_enum


class StateFlags(enum.IntFlag):
    """Bits of the header ``flags`` word (section 2.4).  Unknown bits are carried untouched,
    so messages store the flag word as a plain int; these are the named bits."""

    FINAL_CHUNK = 0x001
    LIGHT_CONTEXT = 0x002
    SKIP_VERIFY_CHECKPOINT = 0x004  # older generations only; not interpreted
    SAMPLING = 0x008  # the writer owns this bit (section 4.4 step 4)
    FULL_STATE = 0x010
    CHAT_SAMPLING_METADATA = 0x020  # the writer owns this bit too
    RWKV7_V_FIRST_SIDEBAND = 0x040
    GEMMA3N_ALTUP_SIDEBAND = 0x080
    INKLING_MTP_EMBD_SIDEBAND = 0x100


# The state flag bits that describe activation sidebands, as plain ints.
RWKV7_V_FIRST_SIDEBAND = int(StateFlags.RWKV7_V_FIRST_SIDEBAND)
GEMMA3N_ALTUP_SIDEBAND = int(StateFlags.GEMMA3N_ALTUP_SIDEBAND)
INKLING_MTP_EMBD_SIDEBAND = int(StateFlags.INKLING_MTP_EMBD_SIDEBAND)
#: Sidebands that double the activation rows (GEMMA3N_ALTUP never does).
ROW_DOUBLING_SIDEBANDS = RWKV7_V_FIRST_SIDEBAND | INKLING_MTP_EMBD_SIDEBAND

# Runtime activation frame flags (u64, wire-format.md 2.5).
ACTIVATION_FLAG_RWKV7_V_FIRST = 1 << 0
ACTIVATION_FLAG_GEMMA3N_ALTUP = 1 << 1
ACTIVATION_FLAG_INKLING_MTP_EMBD = 1 << 2

_FRAME_TO_STATE = (
    (ACTIVATION_FLAG_RWKV7_V_FIRST, RWKV7_V_FIRST_SIDEBAND),
    (ACTIVATION_FLAG_GEMMA3N_ALTUP, GEMMA3N_ALTUP_SIDEBAND),
    (ACTIVATION_FLAG_INKLING_MTP_EMBD, INKLING_MTP_EMBD_SIDEBAND),
)


def wire_int(value: Any) -> int:
    """A wire integer's value: an int or an integer-like (``__index__``: IntEnum, numpy
    ints), never a bool or a float (TypeError)."""
    if isinstance(value, bool):
        raise TypeError(f"a bool is not a wire integer: {value!r}")
    return operator.index(value)


def state_flags_word(state_flags: int) -> int:
    """``state_flags`` as an int of upstream's i32 flag word; else InvalidInputError."""
    value = wire_int(state_flags)
    if not I32_MIN <= value <= I32_MAX:
        raise InvalidInputError(STATE_FLAGS_RANGE_TEXT)
    return value


def activation_state_flags_from_frame_flags(frame_flags: int) -> int:
    """Frame flag bits 0/1/2 to state flag bits 6/7/8; every other bit is dropped."""
    frame_flags = wire_int(frame_flags)
    if not 0 <= frame_flags <= U64_MAX:
        raise InvalidInputError(FRAME_FLAGS_RANGE_TEXT)
    return sum(state for frame, state in _FRAME_TO_STATE if frame_flags & frame)


def activation_frame_flags_from_state_flags(state_flags: int) -> int:
    """State flag bits 6/7/8 to frame flag bits 0/1/2; every other bit is dropped."""
    state_flags = state_flags_word(state_flags)
    return sum(frame for frame, state in _FRAME_TO_STATE if state_flags & state)


def activation_payload_multiplier_from_state_flags(state_flags: int) -> int:
    """2 when an RWKV7 or Inkling sideband doubles the rows (never 3), else 1."""
    return 2 if state_flags_word(state_flags) & ROW_DOUBLING_SIDEBANDS else 1

#: The largest context (tokens per session) a stage takes: the backend refuses more
#: (``skippy_stage_init``, stage/_stage/abi.cpp).
MAX_CTX_SIZE = 1 << 24
#: The longest wait an option or argument may set (about 11.6 days): socket waits become
#: poll(2)'s int milliseconds and timer deadlines time_t values, and 1e10 s failed every connection.
MAX_WAIT_S = 1_000_000
#: The stages a pipeline is split into when nobody says (``launch_pipeline``; ``run`` and
#: ``api`` without ``--stages``, ``--connect`` or ``--topology``).
DEFAULT_STAGES = 2
