"""The C sampling struct of the stage adapter: skippy-runtime ``SamplingConfig`` (version 2,
2352 bytes, runtime.md section 2.4) and its packing from a runtime or a wire config.

The runtime config's fields and defaults are the wire sampling block's (``SAMPLING_FIELDS``
of :mod:`skippy_wire.wire.messages`, one definition), with the wire's ``flags`` word split
into ``enabled`` and ``ignore_eos``.
"""

from __future__ import annotations

import operator
import struct
from collections.abc import Sequence as AbcSequence
from dataclasses import make_dataclass
from typing import Any, Optional, Sequence

from ..errors import SamplingConfigError
from ..wire.constants import (DEFAULT_DRY_SEQUENCE_BREAKERS, DEFAULT_SAMPLERS, MAX_STAGE_DRY_SEQUENCE_BREAKERS,
                              MAX_STAGE_LOGIT_BIAS, MAX_STAGE_SAMPLERS)
from ..wire.messages import SAMPLING_F32_FIELDS, SAMPLING_FIELDS, SAMPLING_WIRE_ORDER, SamplingFlags
from .activation import SAMPLING_CONFIG_BYTES, U32_MAX

# --- sampling (runtime.md section 2.4) -------------------------------------------------------

# The limits and flag bits are the wire's (section 4.3); the C struct adds a breaker's size.
MAX_LOGIT_BIAS, MAX_SAMPLERS, MAX_DRY_SEQUENCE_BREAKERS = (
    MAX_STAGE_LOGIT_BIAS, MAX_STAGE_SAMPLERS, MAX_STAGE_DRY_SEQUENCE_BREAKERS)
SAMPLING_FLAG_ENABLED, SAMPLING_FLAG_IGNORE_EOS = int(SamplingFlags.ENABLED), int(SamplingFlags.IGNORE_EOS)
MAX_DRY_SEQUENCE_BREAKER_BYTES = 16
SAMPLING_CONFIG_VERSION = 2

SAMPLER_IDS = {
    "penalties": 1, "dry": 2, "top_n_sigma": 3, "top_k": 4, "typical_p": 5, "typ_p": 5,
    "top_p": 6, "min_p": 7, "xtc": 8, "temperature": 9, "temp": 9,
}

_SAMPLING_HEAD = struct.Struct("<IIIii5fIf5ff2iffiffI")
_SAMPLING_SAMPLERS = struct.Struct("<16I")
_SAMPLING_TAIL = struct.Struct("<II")
_LOGIT_BIAS = struct.Struct("<if")
assert _SAMPLING_HEAD.size == 104
assert (_SAMPLING_HEAD.size + _SAMPLING_SAMPLERS.size + _SAMPLING_TAIL.size
        + MAX_DRY_SEQUENCE_BREAKERS * MAX_DRY_SEQUENCE_BREAKER_BYTES
        + MAX_LOGIT_BIAS * _LOGIT_BIAS.size) == SAMPLING_CONFIG_BYTES


def _runtime_fields() -> list:
    """The runtime struct's fields: ``enabled``/``ignore_eos`` first, then the wire block's
    fields with the wire's defaults (lists become tuples; the wire ``flags`` word is split)."""
    out = [("enabled", bool, False), ("ignore_eos", bool, False)]
    for name, code, default in SAMPLING_FIELDS:
        if name not in ("flags", "ignore_eos"):
            out.append((name, Sequence, tuple(default)) if code in "LS" else (name, type(default), default))
    return out


class _RuntimeSamplingMethods:
    @classmethod
    def greedy(cls) -> Any:
        return cls()

    @classmethod
    def from_wire(cls, wire: Any) -> Any:
        """Convert a wire-level ``skippy_wire.wire.messages.SamplingConfig`` (section 4.3).

        ``enabled`` is the ENABLED flag bit; ``ignore_eos`` is the wire's ``ignore_eos``
        field or the IGNORE_EOS flag bit.  f32 fields may be floats or raw u32 bits.
        """
        flags = int(getattr(wire, "flags", 0))
        values = {}
        for name in SAMPLING_F32_FIELDS:
            if hasattr(wire, name):
                values[name] = _wire_f32(getattr(wire, name))
        for name in _WIRE_INT_FIELDS:
            if hasattr(wire, name):
                values[name] = int(getattr(wire, name))
        if hasattr(wire, "logit_bias"):
            values["logit_bias"] = tuple(_wire_bias(entry) for entry in wire.logit_bias)
        for name in ("dry_sequence_breakers", "samplers"):
            if hasattr(wire, name):
                values[name] = tuple(getattr(wire, name))
        return cls(
            enabled=bool(flags & SAMPLING_FLAG_ENABLED),
            ignore_eos=bool(getattr(wire, "ignore_eos", False)) or bool(flags & SAMPLING_FLAG_IGNORE_EOS),
            **values,
        )

    def to_bytes(self) -> bytes:
        """Upstream ``as_raw``: the version-2 C struct, with the upstream validation errors."""
        _check_lists(self)
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise SamplingConfigError("sampling logit_bias exceeds the native limit")
        if len(self.samplers) > MAX_SAMPLERS:
            raise SamplingConfigError("sampling sampler order exceeds the native limit")
        if len(self.dry_sequence_breakers) > MAX_DRY_SEQUENCE_BREAKERS:
            raise SamplingConfigError("sampling DRY sequence breakers exceed the native count limit")
        breakers = [str(value).encode("utf-8") for value in self.dry_sequence_breakers]
        if any(len(value) >= MAX_DRY_SEQUENCE_BREAKER_BYTES for value in breakers):
            raise SamplingConfigError("sampling DRY sequence breaker exceeds the native byte limit")
        sampler_ids = []
        for name in self.samplers:
            if name not in SAMPLER_IDS:
                raise SamplingConfigError(f"sampling sampler order contains {_rust_debug_str(name)}")
            sampler_ids.append(SAMPLER_IDS[name])
        sampler_ids += [0] * (MAX_SAMPLERS - len(sampler_ids))
        flags = (SAMPLING_FLAG_ENABLED if self.enabled else 0) | (SAMPLING_FLAG_IGNORE_EOS if self.ignore_eos else 0)
        try:
            head = _SAMPLING_HEAD.pack(
                SAMPLING_CONFIG_VERSION, flags, self.seed, self.top_k, self.penalty_last_n,
                self.temperature, self.top_p, self.presence_penalty, self.frequency_penalty,
                self.repeat_penalty, len(self.logit_bias), self.min_p, self.typical_p,
                self.top_nsigma, self.dynatemp_range, self.dynatemp_exponent,
                self.dry_multiplier, self.dry_base, self.dry_allowed_length,
                self.dry_penalty_last_n, self.xtc_probability, self.xtc_threshold,
                self.mirostat_mode, self.mirostat_entropy, self.mirostat_learning_rate,
                len(self.samplers),
            )
            biases = b"".join(_LOGIT_BIAS.pack(_token_id(token), bias) for token, bias in self.logit_bias)
        except SamplingConfigError:
            raise
        except (struct.error, OverflowError, TypeError, ValueError) as exc:
            raise SamplingConfigError(f"sampling value cannot be encoded: {exc}") from None
        biases += bytes(_LOGIT_BIAS.size * (MAX_LOGIT_BIAS - len(self.logit_bias)))
        breaker_block = b"".join(value.ljust(MAX_DRY_SEQUENCE_BREAKER_BYTES, b"\0") for value in breakers)
        breaker_block += bytes(MAX_DRY_SEQUENCE_BREAKER_BYTES * (MAX_DRY_SEQUENCE_BREAKERS - len(breakers)))
        return (
            head
            + _SAMPLING_SAMPLERS.pack(*sampler_ids)
            + _SAMPLING_TAIL.pack(1 if self.ignore_eos else 0, len(breakers))
            + breaker_block
            + biases
        )


def _check_lists(config: Any) -> None:
    """The list fields are lists (upstream's ``Vec``s): a text would be read as its
    characters (``samplers="top_k"`` as seven sampler names, breakers ``"abc"`` as three),
    and the names and breakers are texts."""
    for name in ("logit_bias", "samplers", "dry_sequence_breakers"):
        value = getattr(config, name)
        if isinstance(value, (str, bytes, bytearray, memoryview)) or not isinstance(value, AbcSequence):
            raise SamplingConfigError(f"sampling {name} must be a list, not {type(value).__name__}")
        if name != "logit_bias" and not all(isinstance(item, str) for item in value):
            raise SamplingConfigError(f"sampling {name} must be a list of strings")


RuntimeSamplingConfig = make_dataclass(
    "RuntimeSamplingConfig",
    _runtime_fields(),
    bases=(_RuntimeSamplingMethods,),
    namespace={"__doc__": """skippy-runtime ``SamplingConfig`` (defaults as upstream; ``enabled=False`` is greedy).

    ``logit_bias`` is a sequence of ``(token_id, bias)``; DRY and XTC fields are flat.
    """, "__module__": __name__},
)

_WIRE_INT_FIELDS = tuple(name for name, code in SAMPLING_WIRE_ORDER if code in "iI" and name != "flags")


def _wire_f32(value: Any) -> float:
    # The wire module may keep f32 fields as raw u32 bits (to round-trip NaN payloads).
    if isinstance(value, int) and not isinstance(value, bool):
        return struct.unpack("<f", struct.pack("<I", value & U32_MAX))[0]
    return float(value)


def _wire_bias(entry: Any) -> tuple:
    if isinstance(entry, tuple) or isinstance(entry, list):
        token, bias = entry
    else:
        token, bias = entry.token_id, entry.bias
    return _token_id(token), _wire_f32(bias)


def _token_id(token: Any) -> int:
    """A logit bias's token id: an integer (``int()`` made 7.9 and "7" token 7, True token 1)."""
    try:
        if not isinstance(token, bool):
            return operator.index(token)
    except TypeError:
        pass
    raise SamplingConfigError(f"sampling logit_bias token id {token!r} is not an integer")


_RUST_ESCAPES = {"\0": "\\0", "\t": "\\t", "\r": "\\r", "\n": "\\n", "\\": "\\\\", '"': '\\"'}


def _rust_debug_str(value: str) -> str:
    """``value`` as Rust's ``{:?}`` writes a ``&str``: quoted, its own escapes, and any other
    character Unicode calls Other or Separator (bar the space; what Rust's ``is_printable``
    and Python's ``isprintable`` both leave out) as ``\\u{hex}``."""
    return '"' + "".join(_RUST_ESCAPES.get(c) or (c if c.isprintable() else f"\\u{{{ord(c):x}}}")
                         for c in value) + '"'


def sampling_to_bytes(sampling: Any) -> Optional[bytes]:
    """Encode ``None`` (greedy), a ``RuntimeSamplingConfig`` or a wire ``SamplingConfig``."""
    if sampling is None:
        return None
    if isinstance(sampling, RuntimeSamplingConfig):
        return sampling.to_bytes()
    if isinstance(sampling, (bytes, bytearray, memoryview)):
        raw = bytes(sampling)
        if len(raw) != SAMPLING_CONFIG_BYTES:
            raise SamplingConfigError(f"a packed sampling config must be {SAMPLING_CONFIG_BYTES} bytes, got {len(raw)}")
        return raw
    if hasattr(sampling, "flags"):
        return RuntimeSamplingConfig.from_wire(sampling).to_bytes()
    raise SamplingConfigError(f"unsupported sampling config type {type(sampling).__name__}")


__all__ = [
    "DEFAULT_DRY_SEQUENCE_BREAKERS", "DEFAULT_SAMPLERS", "MAX_DRY_SEQUENCE_BREAKER_BYTES",
    "MAX_DRY_SEQUENCE_BREAKERS", "MAX_LOGIT_BIAS", "MAX_SAMPLERS", "SAMPLER_IDS",
    "SAMPLING_CONFIG_VERSION", "SAMPLING_FLAG_ENABLED", "SAMPLING_FLAG_IGNORE_EOS",
    "RuntimeSamplingConfig", "sampling_to_bytes",
]
