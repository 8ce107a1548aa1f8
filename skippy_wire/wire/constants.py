"""Activation codecs, codec policies and the activation flag bits (wire-format.md 2.4-2.5, 6.1, 8.2).

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


class ActivationCodec(enum.IntEnum):
    """Wire ids of the activation codecs (the i32 at message offset 56)."""

    RAW_F32_V1 = 1
    F16_RNE_V1 = 2
    BF16_RNE_V1 = 3
    S8_ROW_F32_RNE_V1 = 4

    @property
    def identity(self) -> str:
        """The upstream serde / identity string, e.g. ``"bf16-rne-v1"``."""
        return _CODEC_IDENTITY[self]

    @property
    def rust_name(self) -> str:
        """The upstream enum variant name, e.g. ``"Bf16RneV1"`` (used in error texts and vectors)."""
        return _CODEC_RUST_NAME[self]

    @classmethod
    def from_identity(cls, text: str) -> "ActivationCodec":
        for codec, identity in _CODEC_IDENTITY.items():
            if identity == text:
                return codec
        raise ValueError(f"unknown activation codec {text!r}")

    @classmethod
    def from_rust_name(cls, text: str) -> "ActivationCodec":
        for codec, name in _CODEC_RUST_NAME.items():
            if name == text:
                return codec
        raise ValueError(f"unknown activation codec {text!r}")

    @classmethod
    def default(cls) -> "ActivationCodec":
        """Upstream ``StageActivationCodec::default()``: bit-exact raw f32."""
        return cls.RAW_F32_V1


_CODEC_IDENTITY = {
    ActivationCodec.RAW_F32_V1: "raw-f32-v1",
    ActivationCodec.F16_RNE_V1: "f16-rne-v1",
    ActivationCodec.BF16_RNE_V1: "bf16-rne-v1",
    ActivationCodec.S8_ROW_F32_RNE_V1: "s8-row-f32-rne-v1",
}
_CODEC_RUST_NAME = {
    ActivationCodec.RAW_F32_V1: "RawF32V1",
    ActivationCodec.F16_RNE_V1: "F16RneV1",
    ActivationCodec.BF16_RNE_V1: "Bf16RneV1",
    ActivationCodec.S8_ROW_F32_RNE_V1: "S8RowF32RneV1",
}

#: Codecs a receiver admits under AUTO_LOSSLESS_V1, and the selector's default candidate list.
LOSSLESS_CODECS = (ActivationCodec.RAW_F32_V1, ActivationCodec.BF16_RNE_V1, ActivationCodec.F16_RNE_V1)


class CodecPolicy(enum.IntEnum):
    """Upstream ``StageActivationCodecPolicy`` (not on the wire; values are ours)."""

    FIXED = 0
    AUTO_LOSSLESS_V1 = 1

    @property
    def rust_name(self) -> str:
        return "Fixed" if self is CodecPolicy.FIXED else "AutoLosslessV1"

    @property
    def serde_name(self) -> str:
        """The upstream serde string: ``"fixed"`` or ``"auto-lossless-v1"``."""
        return "fixed" if self is CodecPolicy.FIXED else "auto-lossless-v1"

    @classmethod
    def from_serde_name(cls, text: str) -> "CodecPolicy":
        for policy in cls:
            if policy.serde_name == text:
                return policy
        raise ValueError(f"unknown activation codec policy {text!r}")

    def compatible(self, configured: ActivationCodec) -> bool:
        """Whether a producer may run this policy with ``configured`` as its codec."""
        return self is CodecPolicy.FIXED or configured == ActivationCodec.RAW_F32_V1

    def permits(self, configured: ActivationCodec, frame_codec: ActivationCodec) -> bool:
        """Receiver admission (wire-format.md 8.2): may a frame in ``frame_codec`` be read?"""
        if self is CodecPolicy.FIXED:
            return configured == frame_codec
        return configured == ActivationCodec.RAW_F32_V1 and frame_codec in LOSSLESS_CODECS

    def identity(self, configured: ActivationCodec) -> str:
        if self is CodecPolicy.FIXED:
            return ActivationCodec(configured).identity
        return "auto-lossless-v1"


# State flag bits that describe activation sidebands (wire-format.md 2.4).
RWKV7_V_FIRST_SIDEBAND = 0x040
GEMMA3N_ALTUP_SIDEBAND = 0x080
INKLING_MTP_EMBD_SIDEBAND = 0x100
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


def activation_state_flags_from_frame_flags(frame_flags: int) -> int:
    """Frame flag bits 0/1/2 to state flag bits 6/7/8; every other bit is dropped."""
    return sum(state for frame, state in _FRAME_TO_STATE if frame_flags & frame)


def activation_frame_flags_from_state_flags(state_flags: int) -> int:
    """State flag bits 6/7/8 to frame flag bits 0/1/2; every other bit is dropped."""
    return sum(frame for frame, state in _FRAME_TO_STATE if state_flags & state)


def activation_payload_multiplier_from_state_flags(state_flags: int) -> int:
    """2 when an RWKV7 or Inkling sideband doubles the rows (never 3), else 1."""
    return 2 if state_flags & ROW_DOUBLING_SIDEBANDS else 1
