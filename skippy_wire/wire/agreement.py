"""State version 17: activation agreements and profiles, and their JSON form
(wire-v16-v17.md B.3, B.5).

Plain data shared by both kernel implementations and the setup handshake
(:mod:`skippy_wire.wire.setup`).  The JSON form is the one inside setup packets and in the
vectors; :func:`parse_json` / the ``from_json`` constructors read it with the strictness of
upstream's serde derive (integers in range and never floats or booleans, required fields
present, duplicate fields refused, structs also accepted as arrays of their fields in
order).  Any violation raises :class:`JsonShapeError`, which the setup turns into
"decode stage setup".  Validity (B.5) is a kernel rule: ``kernels().validate_agreement``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Optional, Union

from .activation_frame import ACTIVATION_AGREEMENT_GENERATION_BYTES, STAGE_ACTIVATION_IDENTITY_BYTES
from .constants import I32_MAX, I32_MIN, U32_MAX, U64_MAX



class JsonShapeError(ValueError):
    """A JSON value does not have the shape of the expected setup type (one line)."""


class Fixed(NamedTuple):
    """``{"Fixed": n}``: the axis always has ``value`` elements."""

    value: int


class Dynamic(NamedTuple):
    """``{"Dynamic": {"min": a, "max": b}}``: the sender picks a value in [min, max] per frame."""

    min: int
    max: int


class _Tokens:
    """``"Tokens"``: the axis is the frame's token count (a singleton, :data:`TOKENS`)."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "TOKENS"

    def __reduce__(self):
        return "TOKENS"


TOKENS = _Tokens()
Dimension = Union[Fixed, Dynamic, _Tokens]


@dataclass
class ActivationPartProfile:
    identity: bytes
    ggml_type: int
    rank: int
    token_axis: int
    optional: bool
    dimensions: tuple

    def to_json(self) -> dict:
        return {"identity": list(self.identity), "ggml_type": self.ggml_type, "rank": self.rank,
                "token_axis": self.token_axis, "optional": self.optional,
                "dimensions": [dimension_to_json(d) for d in self.dimensions]}

    @classmethod
    def from_json(cls, obj: Any) -> "ActivationPartProfile":
        v = _struct(obj, _PART_FIELDS, strict=False)
        return cls(_byte_array(v["identity"], STAGE_ACTIVATION_IDENTITY_BYTES), _uint(v["ggml_type"], U32_MAX),
                   _uint(v["rank"], U32_MAX), _uint(v["token_axis"], U32_MAX), _bool(v["optional"]),
                   tuple(dimension_from_json(d) for d in _array(v["dimensions"], 4)))


@dataclass
class ActivationProfile:
    id: int
    producer_stage_index: int
    layer_start: int
    layer_end: int
    frontier_identity: bytes
    max_tokens: int
    max_sequences: int
    parts: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"id": self.id, "producer_stage_index": self.producer_stage_index, "layer_start": self.layer_start,
                "layer_end": self.layer_end, "frontier_identity": list(self.frontier_identity),
                "max_tokens": self.max_tokens, "max_sequences": self.max_sequences,
                "parts": [p.to_json() for p in self.parts]}

    @classmethod
    def from_json(cls, obj: Any) -> "ActivationProfile":
        v = _struct(obj, _PROFILE_FIELDS, strict=False)
        return cls(_uint(v["id"], U32_MAX), _int32(v["producer_stage_index"]), _int32(v["layer_start"]),
                   _int32(v["layer_end"]), _byte_array(v["frontier_identity"], STAGE_ACTIVATION_IDENTITY_BYTES),
                   _uint(v["max_tokens"], U32_MAX), _uint(v["max_sequences"], U32_MAX),
                   [ActivationPartProfile.from_json(p) for p in _array(v["parts"])])


@dataclass
class ActivationAgreement:
    """A connection's agreement: a 16-byte generation and up to 16 profiles."""

    generation: bytes
    profiles: list = field(default_factory=list)

    def to_json(self) -> dict:
        return {"generation": list(self.generation), "profiles": [p.to_json() for p in self.profiles]}

    @classmethod
    def from_json(cls, obj: Any) -> "ActivationAgreement":
        v = _struct(obj, ("generation", "profiles"), strict=False)
        return cls(generation_from_json(v["generation"]), [ActivationProfile.from_json(p) for p in _array(v["profiles"])])

    def profile(self, profile_id: int) -> Optional[ActivationProfile]:
        return next((p for p in self.profiles if p.id == profile_id), None)


_PART_FIELDS = ("identity", "ggml_type", "rank", "token_axis", "optional", "dimensions")
_PROFILE_FIELDS = ("id", "producer_stage_index", "layer_start", "layer_end", "frontier_identity", "max_tokens",
                   "max_sequences", "parts")


def dimension_to_json(d: Dimension) -> Any:
    if isinstance(d, Fixed):
        return {"Fixed": d.value}
    if isinstance(d, Dynamic):
        return {"Dynamic": {"min": d.min, "max": d.max}}
    return "Tokens"


def dimension_from_json(obj: Any) -> Dimension:
    """An externally tagged enum: ``"Tokens"``, ``{"Tokens": null}``, ``{"Fixed": n}``,
    ``{"Dynamic": {"min": a, "max": b}}`` (or ``[a, b]``)."""
    if isinstance(obj, str):
        if obj == "Tokens":
            return TOKENS
        raise JsonShapeError(f"invalid dimension variant {obj!r}")
    if not isinstance(obj, dict) or len(obj) != 1 or getattr(obj, "duplicates", ()):
        raise JsonShapeError("a dimension is one of \"Tokens\", {\"Fixed\":n}, {\"Dynamic\":{...}}")
    (tag, value), = obj.items()
    if tag == "Tokens" and value is None:
        return TOKENS
    if tag == "Fixed":
        return Fixed(_uint(value, U64_MAX))
    if tag == "Dynamic":
        v = _struct(value, ("min", "max"), strict=False)
        return Dynamic(_uint(v["min"], U64_MAX), _uint(v["max"], U64_MAX))
    raise JsonShapeError(f"invalid dimension variant {tag!r}")


def generation_to_json(generation: bytes) -> list:
    return list(generation)


def generation_from_json(obj: Any) -> bytes:
    return _byte_array(obj, ACTIVATION_AGREEMENT_GENERATION_BYTES)


# --- serde-like JSON -------------------------------------------------------------------------
def _no_constant(name: str):
    raise JsonShapeError(f"{name} is not JSON")


class _Object(dict):
    """A JSON object; ``duplicates`` holds its repeated keys.  A repeated key is an error only
    where a struct reads it (or an enum is tagged by it): serde skips ignored fields unseen."""

    duplicates: frozenset = frozenset()


def _pairs(pairs: list) -> dict:
    out = _Object()
    seen = set()
    for key, value in pairs:
        if key in out:
            seen.add(key)
        out[key] = value
    if seen:
        out.duplicates = frozenset(seen)
    return out


#: Characters of an integer literal read as an integer: u64's 20 digits, or a sign and i64's 19.
_INT_DIGITS = 20


def _int_literal(text: str):
    # serde_json reads `-0` as the float -0.0, which no integer field accepts, and a number past
    # u64 as an f64 (an ignored one it only scans): a float too, not int() of thousands of
    # digits, which Python refuses outright
    if text == "-0":
        return -0.0
    return int(text) if len(text) <= _INT_DIGITS else float(text)


#: Arrays and objects nested deeper than this are checked, then read as null: no field
#: that a setup type reads nests nearly as deep, and serde_json skips an ignored value
#: however deep it nests, where Python's parser recurses (and stops near 1,000 levels).
_READ_DEPTH = 128

# One JSON token after optional whitespace (RFC 8259): a string, a number, a literal or a
# structural character.
_TOKEN = re.compile(r'[ \t\n\r]*(?:(?P<value>"(?:[^"\\\x00-\x1f]|\\["\\/bfnrt]|\\u[0-9a-fA-F]{4})*"'
                    r'|-?(?:0|[1-9][0-9]*)(?:\.[0-9]+)?(?:[eE][+-]?[0-9]+)?|true|false|null)|(?P<mark>[][{},:]))')


def parse_json(body: bytes) -> Any:
    """Parse a packet body as strict JSON (UTF-8, no NaN/Infinity, nothing but whitespace
    after the value); repeated keys are kept aside for the fields that read them to refuse
    (:class:`_Object`), and a lone surrogate escape for the strings read to refuse
    (:func:`_text`): serde_json skips an ignored value without looking at either."""
    try:
        text = bytes(body).decode("utf-8")
        try:
            value = _loads(text)
        except RecursionError:
            value = _loads(_shallow(text))
    except JsonShapeError:
        raise
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise JsonShapeError(str(exc).splitlines()[0] if str(exc) else type(exc).__name__) from None
    return value


def _loads(text: str) -> Any:
    return json.loads(text, object_pairs_hook=_pairs, parse_constant=_no_constant, parse_int=_int_literal)


def _shallow(text: str) -> str:
    """``text`` with each array or object nested deeper than :data:`_READ_DEPTH` replaced by
    null, once the whole text is checked to be JSON (iteratively); JsonShapeError if not."""
    pieces, copied, open_at, stack = [], 0, 0, []
    expect, pos = "value", 0  # value, first (a value or "]"), key, first_key (a key or "}"), colon, next, end
    while True:
        m = _TOKEN.match(text, pos)
        if m is None:
            if expect != "end" or text[pos:].strip(" \t\n\r"):
                raise JsonShapeError(f"invalid JSON at character {pos}")
            return "".join(pieces) + text[copied:]
        pos, token = m.end(), m.group("value") or m.group("mark")
        if m.group("value") is not None and expect in ("value", "first"):
            expect = "next" if stack else "end"
        elif m.group("value") is not None and token[0] == '"' and expect in ("key", "first_key"):
            expect = "colon"
        elif token in "[{" and expect in ("value", "first"):
            stack.append(token)
            if len(stack) == _READ_DEPTH + 1:
                open_at = m.start("mark")
            expect = "first" if token == "[" else "first_key"
        elif token in "]}" and stack and stack[-1] == "[{"["]}".index(token)] \
                and expect in ("next", "first" if token == "]" else "first_key"):
            if len(stack) == _READ_DEPTH + 1:
                pieces += [text[copied:open_at], "null"]
                copied = pos
            stack.pop()
            expect = "next" if stack else "end"
        elif token == "," and expect == "next":
            expect = "value" if stack[-1] == "[" else "key"
        elif token == ":" and expect == "colon":
            expect = "value"
        else:
            raise JsonShapeError(f"unexpected {token!r} at character {m.start()}")


def _text(value: str) -> str:
    """``value``, a string that a struct reads (a field's value, or any key of the struct's
    object): serde_json refuses a lone surrogate escape there."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise JsonShapeError("lone surrogate in a JSON string") from None
    return value


def dumps(value: Any) -> bytes:
    """Compact serialization (no whitespace, fields in insertion order), as upstream."""
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _struct(obj: Any, names: tuple, *, strict: bool, optional: tuple = ()) -> dict:
    """The fields of a struct given as an object (unknown fields refused when ``strict``,
    ``optional`` fields may be missing and are then None) or as an array of every field."""
    if isinstance(obj, list):
        if len(obj) != len(names):
            raise JsonShapeError(f"invalid length {len(obj)}, expected struct with {len(names)} elements")
        return dict(zip(names, obj))
    if not isinstance(obj, dict):
        raise JsonShapeError(f"invalid type: {_type_name(obj)}, expected a struct")
    for key in obj:
        _text(key)
    if strict:
        for key in obj:
            if key not in names:
                raise JsonShapeError(f"unknown field `{key}`")
    for key in getattr(obj, "duplicates", ()):
        if key in names:
            raise JsonShapeError(f"duplicate field `{key}`")
    out = {}
    for name in names:
        if name in obj:
            out[name] = obj[name]
        elif name in optional:
            out[name] = None
        else:
            raise JsonShapeError(f"missing field `{name}`")
    return out


def _type_name(obj: Any) -> str:
    if obj is None:
        return "null"
    if isinstance(obj, dict):
        return "map"
    return {bool: "boolean", str: "string", list: "sequence", float: "floating point"}.get(type(obj), "integer")


def _array(obj: Any, length: Optional[int] = None) -> list:
    if not isinstance(obj, list):
        raise JsonShapeError(f"invalid type: {_type_name(obj)}, expected an array")
    if length is not None and len(obj) != length:
        raise JsonShapeError(f"invalid length {len(obj)}, expected an array of length {length}")
    return obj


def _uint(obj: Any, maximum: int) -> int:
    if type(obj) is not int or not 0 <= obj <= maximum:
        raise JsonShapeError(f"invalid value: {obj!r}, expected an integer in 0..={maximum}")
    return obj


def _int32(obj: Any) -> int:
    if type(obj) is not int or not I32_MIN <= obj <= I32_MAX:
        raise JsonShapeError(f"invalid value: {obj!r}, expected i32")
    return obj


def _bool(obj: Any) -> bool:
    if type(obj) is not bool:
        raise JsonShapeError(f"invalid type: {_type_name(obj)}, expected a boolean")
    return obj


def _string(obj: Any) -> str:
    if type(obj) is not str:
        raise JsonShapeError(f"invalid type: {_type_name(obj)}, expected a string")
    return _text(obj)


def _byte_array(obj: Any, length: int) -> bytes:
    return bytes(_uint(b, 255) for b in _array(obj, length))


# Helpers for the setup bodies (same rules, public under these names).
json_struct = _struct
json_uint = _uint
json_string = _string

__all__ = [
    "JsonShapeError", "Fixed", "Dynamic", "TOKENS", "Dimension", "ActivationPartProfile", "ActivationProfile",
    "ActivationAgreement", "dimension_to_json", "dimension_from_json", "generation_to_json", "generation_from_json",
    "parse_json", "dumps", "json_struct", "json_uint", "json_string", "U32_MAX", "U64_MAX",
]
