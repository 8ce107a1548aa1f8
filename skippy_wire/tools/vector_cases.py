"""The golden vectors' JSON shape, shared by the conformance runners of every state version
(:mod:`.conformance` for v15, :mod:`.conformance_gen` for v16/v17) and by the tests:
vector <-> message conversion, and the comparison helpers that turn a difference into a
:class:`~skippy_wire.errors.Mismatch` with a readable first difference."""

from __future__ import annotations

from typing import Any, Callable, Optional

from ..errors import Mismatch, WireError
from ..wire.constants import ActivationCodec, CodecPolicy
from ..wire.messages import (SAMPLING_WIRE_ORDER, SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind,
                             f32_bits, f32_from_bits)

STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                "decode_step", "current_token", "source_stage_index")


# --- vector <-> message conversion -------------------------------------------------------
def _hex_bits(value: float) -> str:
    return f"{f32_bits(value):08x}"


def sampling_from_case(d: Optional[dict]) -> Optional[SamplingConfig]:
    if d is None:
        return None
    values: dict[str, Any] = {}
    for name, code in SAMPLING_WIRE_ORDER:
        if code == "f":
            values[name] = f32_from_bits(int(d[name + "_bits"], 16))
        elif code == "L":
            values[name] = [(int(t), f32_from_bits(int(b, 16))) for t, b in d[name]]
        elif code == "S":
            values[name] = list(d[name])
        else:
            values[name] = d[name]
    return SamplingConfig(**values)


def sampling_to_case(s: Optional[SamplingConfig]) -> Optional[dict]:
    if s is None:
        return None
    out: dict[str, Any] = {}
    for name, code in SAMPLING_WIRE_ORDER:
        value = getattr(s, name)
        if code == "f":
            out[name + "_bits"] = _hex_bits(value)
        elif code == "L":
            out[name] = [[int(t), _hex_bits(b)] for t, b in value]
        elif code == "S":
            out[name] = list(value)
        elif code == "B":
            out[name] = bool(value)
        else:
            out[name] = int(value)
    return out


def message_from_case(d: dict, kind: Any = None) -> StageWireMessage:
    """The message a ``frame`` case hands to the writer; ``kind`` defaults to the case's
    kind as a :class:`WireMessageKind` where it is one (else the bare int)."""
    st = d["state"]
    codec_id = st["activation_codec_id"]
    codec = ActivationCodec(codec_id) if codec_id in ActivationCodec._value2member_map_ else codec_id
    state = StageStateHeader(*(st[f] for f in STATE_FIELDS), codec)
    meta = d["chat_sampling_metadata"]
    if kind is None:
        kind = d["kind"]
        try:
            kind = WireMessageKind(kind)
        except ValueError:
            pass
    return StageWireMessage(
        kind=kind,
        pos_start=d["pos_start"],
        token_count=d["token_count"],
        state=state,
        request_id=d["request_id"],
        session_id=d["session_id"],
        sampling=sampling_from_case(d["sampling"]),
        chat_sampling_metadata=None if meta is None else bytes.fromhex(meta["hex"]).decode("utf-8"),
        tokens=list(d["tokens"]),
        positions=list(d["positions"]),
        activation=bytes.fromhex(d["activation_hex"]),
        raw_bytes=bytes.fromhex(d["raw_bytes_hex"]),
    )


def message_to_case(m: StageWireMessage, kind_name: Optional[str] = None) -> dict:
    """A decoded message in the vectors' JSON shape (``activation_hex`` = decoded f32);
    ``kind_name`` defaults to the :class:`WireMessageKind` name of the message's kind."""
    st = m.state
    state = {f: int(getattr(st, f)) for f in STATE_FIELDS}
    codec = ActivationCodec(st.activation_codec)
    state["activation_codec"] = codec.rust_name
    state["activation_codec_id"] = int(codec)  # a reader only returns known codecs
    meta = m.chat_sampling_metadata
    return {
        "kind": int(m.kind),
        "kind_name": WireMessageKind(m.kind).rust_name if kind_name is None else kind_name,
        "pos_start": m.pos_start,
        "token_count": m.token_count,
        "state": state,
        "request_id": m.request_id,
        "session_id": m.session_id,
        "sampling": sampling_to_case(m.sampling),
        "chat_sampling_metadata": None if meta is None else {"utf8": meta, "hex": meta.encode("utf-8").hex()},
        "tokens": [int(t) for t in m.tokens],
        "positions": [int(p) for p in m.positions],
        "activation_hex": bytes(m.activation).hex(),
        "raw_bytes_hex": bytes(m.raw_bytes).hex(),
    }


def read_expectation(read: dict) -> tuple[Optional[int], Optional[int]]:
    """(codec, policy) arguments of :func:`skippy_wire.wire.frame.read_stage_message` for one
    recorded read (``api`` = the upstream reader that produced it)."""
    api = read["api"]
    if api == "read_stage_message":
        return None, None
    if api == "read_stage_message_for_codec":
        return int(ActivationCodec.from_rust_name(read["expected_codec"])), None
    if api == "read_stage_message_for_codec_policy":
        policy = CodecPolicy.from_rust_name(read["policy"])  # a misspelt one ran as Fixed
        return int(ActivationCodec.from_rust_name(read["configured_codec"])), int(policy)
    raise Mismatch(f"unknown reader api {api!r}")


# --- comparison helpers -------------------------------------------------------------------
def short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def hex_diff(label: str, got: str, want: str) -> str:
    if len(got) != len(want):
        head = f"{label}: {len(got) // 2} bytes, expected {len(want) // 2}"
    else:
        head = f"{label}: {len(got) // 2} bytes"
    for i in range(0, min(len(got), len(want)), 2):
        if got[i : i + 2] != want[i : i + 2]:
            return f"{head}; first difference at byte {i // 2}: got {got[i:i + 16]}.. expected {want[i:i + 16]}.."
    return f"{head}; one is a prefix of the other (common {min(len(got), len(want)) // 2} bytes)"


def diff(path: str, got: Any, want: Any) -> Optional[str]:
    """The first differing field between two JSON-shaped values, readably."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in want:
            if key not in got:
                return f"{path}.{key}: missing"
            d = diff(f"{path}.{key}", got[key], want[key])
            if d:
                return d
        extra = set(got) - set(want)
        return f"{path}: unexpected fields {sorted(extra)}" if extra else None
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return f"{path}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = diff(f"{path}[{i}]", g, w)
            if d:
                return d
        return None
    if got != want or type(got) is bool and type(want) is not bool:
        if isinstance(got, str) and isinstance(want, str) and path.endswith("_hex"):
            return hex_diff(path, got, want)
        return f"{path}: got {short(got)}, expected {short(want)}"
    return None


def outcome(fn: Callable, *args) -> tuple:
    """``("ok", value)``, ``("err", {"kind", "message"}, exc)`` or ``("crash", text, exc)``."""
    try:
        return ("ok", fn(*args))
    except WireError as exc:
        return ("err", {"kind": exc.kind, "message": str(exc)}, exc)
    except Exception as exc:  # a crash is a failure to report, not a runner crash
        return ("crash", f"{type(exc).__name__}: {exc}", exc)


def check_error(label: str, got: tuple, want: dict) -> None:
    want = {"kind": want["kind"], "message": want["message"]}
    if got[0] == "ok":
        raise Mismatch(f"{label}: succeeded ({short(got[1], 80)}), expected {want['kind']} {want['message']!r}")
    if got[0] == "crash":
        raise Mismatch(f"{label}: raised {got[1]}, expected {want['kind']} {want['message']!r}")
    if got[1] != want:
        raise Mismatch(f"{label}: {got[1]['kind']} {got[1]['message']!r}, expected {want['kind']} {want['message']!r}")


def require_ok(label: str, got: tuple) -> Any:
    if got[0] != "ok":
        what = got[1] if got[0] == "crash" else f"{got[1]['kind']} {got[1]['message']!r}"
        raise Mismatch(f"{label}: failed with {what}, expected success")
    return got[1]


def check_read(label: str, got: tuple, read: dict, to_case: Callable[[StageWireMessage], dict]) -> None:
    """One recorded read against its outcome ``got``: the error kind and text, or the
    consumed byte count and the decoded message (``to_case(message)``)."""
    if not read["ok"]:
        check_error(label, got, read["error"])
        return
    message, consumed = require_ok(label, got)
    if consumed != read["consumed"]:
        raise Mismatch(f"{label}: consumed {consumed} bytes, expected {read['consumed']}")
    d = diff(f"{label}.message", to_case(message), read["message"])
    if d:
        raise Mismatch(d)


def malformed_bytes(case: dict) -> bytes:
    """A malformed case's bytes, checked against its own ``len``; a case with no reads checks
    nothing and fails (it passed)."""
    data = bytes.fromhex(case["bytes_hex"])
    length, reads = case["len"], case["reads"]
    if type(length) is not int:
        raise Mismatch(f"case len is {short(length)}, not a byte count")
    if len(data) != length:
        raise Mismatch(f"case bytes_hex has {len(data)} bytes, len says {length}")
    if not isinstance(reads, list) or not all(isinstance(read, dict) for read in reads):
        raise Mismatch(f"case reads is {short(reads)}, not a list of recorded reads (objects)")
    if not reads:
        raise Mismatch("case records no reads: it checks nothing")
    return data
