"""Conformance runners for state versions 16 and 17 (tests/golden/v16, tests/golden/v17).

The version of a case is taken from its id (``v16-...`` / ``v17-...``, as the READMEs of
the vector folders say); ``protocol=`` (``--protocol``) forces one.  :func:`runner_for`
gives the runner of a case, or None for a v15 case (run by ``conformance.Runner``).
"""

from __future__ import annotations

import re
from typing import Any, Callable, Optional

from ..wire.constants import READY_BYTES
from ..errors import Mismatch, WireError
from ..wire.activation_frame import ActivationFrameV16, ActivationPartV16, kind_rust_name
from ..wire.agreement import ActivationAgreement
from ..wire.constants import ActivationCodec
from ..wire.frame import recv_ready
from ..wire.protocol import StageConnection, estimated_buffer_bytes, kernels, read_arguments
from ..wire.constants import CodecPolicy
from ..wire.messages import (SAMPLING_WIRE_ORDER, SamplingConfig, StageStateHeader, StageWireMessage, f32_bits,
                             f32_from_bits)
from . import conformance_setup

_VERSION_ID = re.compile(r"^v(1[67])-")


def case_version(case: dict, protocol: Optional[int] = None) -> Optional[int]:
    if protocol is not None:
        return protocol
    m = _VERSION_ID.match(str(case.get("id", "")))
    return int(m.group(1)) if m else None


# --- JSON <-> objects --------------------------------------------------------------------
def desc_from_case(d: dict) -> ActivationFrameV16:
    parts = [ActivationPartV16(bytes.fromhex(p["identity"]), p["ggml_type"], p["rank"], p["token_axis"], p["flags"],
                               tuple(p["dimensions"]), tuple(p["byte_strides"]), p["payload_offset"], p["payload_bytes"])
             for p in d["parts"]]
    return ActivationFrameV16(d["version"], d["producer_stage_index"], d["layer_start"], d["layer_end"],
                              d["token_count"], d["sequence_count"], d["payload_bytes"],
                              bytes.fromhex(d["frontier_identity"]), parts)


_GGML_NAMES = {0: "F32", 1: "F16", 26: "I32", 30: "BF16"}


def desc_to_case(desc: ActivationFrameV16) -> dict:
    return {
        "version": desc.version, "producer_stage_index": desc.producer_stage_index, "layer_start": desc.layer_start,
        "layer_end": desc.layer_end, "token_count": desc.token_count, "sequence_count": desc.sequence_count,
        "payload_bytes": desc.payload_bytes, "frontier_identity": bytes(desc.frontier_identity).hex(),
        "parts": [{"identity": bytes(p.identity).hex(), "ggml_type": p.ggml_type,
                   "ggml_type_name": _GGML_NAMES.get(p.ggml_type), "rank": p.rank, "token_axis": p.token_axis,
                   "flags": p.flags, "dimensions": list(p.dimensions), "byte_strides": list(p.byte_strides),
                   "payload_offset": p.payload_offset, "payload_bytes": p.payload_bytes} for p in desc.parts],
    }


_STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                 "decode_step", "current_token", "source_stage_index")


def _sampling_from_case(d: Optional[dict]) -> Optional[SamplingConfig]:
    if d is None:
        return None
    values: dict = {}
    for name, code in SAMPLING_WIRE_ORDER:
        if code == "f":
            values[name] = f32_from_bits(int(d[name + "_bits"], 16))
        elif code == "L":
            values[name] = [(int(t), f32_from_bits(int(b, 16))) for t, b in d[name]]
        else:
            values[name] = list(d[name]) if code == "S" else d[name]
    return SamplingConfig(**values)


def _sampling_to_case(s: Optional[SamplingConfig]) -> Optional[dict]:
    if s is None:
        return None
    out: dict = {}
    for name, code in SAMPLING_WIRE_ORDER:
        value = getattr(s, name)
        if code == "f":
            out[name + "_bits"] = f"{f32_bits(value):08x}"
        elif code == "L":
            out[name] = [[int(t), f"{f32_bits(b):08x}"] for t, b in value]
        else:
            out[name] = list(value) if code == "S" else bool(value) if code == "B" else int(value)
    return out


def message_from_case(d: dict) -> StageWireMessage:
    """The message a v16/v17 ``frame`` case hands to the writer (kinds and codecs kept as ints)."""
    st = d["state"]
    codec_id = st["activation_codec_id"]
    codec = ActivationCodec(codec_id) if codec_id in ActivationCodec._value2member_map_ else codec_id
    meta = d["chat_sampling_metadata"]
    return StageWireMessage(
        d["kind"], d["pos_start"], d["token_count"], StageStateHeader(*(st[f] for f in _STATE_FIELDS), codec),
        d["request_id"], d["session_id"], _sampling_from_case(d["sampling"]),
        None if meta is None else bytes.fromhex(meta["hex"]).decode("utf-8"), list(d["tokens"]),
        list(d["positions"]), bytes.fromhex(d["activation_hex"]), bytes.fromhex(d["raw_bytes_hex"]))


def message_to_case_gen(m: StageWireMessage) -> dict:
    """A decoded v16/v17 message in the vectors' shape (kind 23 included)."""
    st = m.state
    state = {f: int(getattr(st, f)) for f in _STATE_FIELDS}
    codec = ActivationCodec(st.activation_codec)
    state["activation_codec"] = codec.rust_name
    state["activation_codec_id"] = int(codec)
    meta = m.chat_sampling_metadata
    return {
        "kind": int(m.kind), "kind_name": kind_rust_name(m.kind), "pos_start": m.pos_start,
        "token_count": m.token_count, "state": state, "request_id": m.request_id, "session_id": m.session_id,
        "sampling": _sampling_to_case(m.sampling),
        "chat_sampling_metadata": None if meta is None else {"utf8": meta, "hex": meta.encode("utf-8").hex()},
        "tokens": [int(t) for t in m.tokens], "positions": [int(p) for p in m.positions],
        "activation_hex": bytes(m.activation).hex(), "raw_bytes_hex": bytes(m.raw_bytes).hex(),
    }


def read_expectation(read: dict) -> tuple:
    """(codec, policy) of one recorded read (``api`` = the upstream reader)."""
    api = read["api"]
    if api == "read_stage_message":
        return None, None
    if api == "read_stage_message_for_codec":
        return int(ActivationCodec.from_rust_name(read["expected_codec"])), None
    if api == "read_stage_message_for_codec_policy":
        policy = CodecPolicy.AUTO_LOSSLESS_V1 if read["policy"] == "AutoLosslessV1" else CodecPolicy.FIXED
        return int(ActivationCodec.from_rust_name(read["configured_codec"])), int(policy)
    raise Mismatch(f"unknown reader api {api!r}")


# --- comparison ----------------------------------------------------------------------------
def outcome(fn: Callable, *args) -> tuple:
    try:
        return ("ok", fn(*args))
    except WireError as exc:
        return ("err", {"kind": exc.kind, "message": str(exc)}, exc)
    except Exception as exc:
        return ("crash", f"{type(exc).__name__}: {exc}", exc)


def check_error(label: str, got: tuple, want: dict) -> None:
    want = {"kind": want["kind"], "message": want["message"]}
    if got[0] == "ok":
        raise Mismatch(f"{label}: succeeded, expected {want['kind']} {want['message']!r}")
    if got[0] == "crash":
        raise Mismatch(f"{label}: raised {got[1]}, expected {want['kind']} {want['message']!r}")
    if got[1] != want:
        raise Mismatch(f"{label}: {got[1]['kind']} {got[1]['message']!r}, expected {want['kind']} {want['message']!r}")


def require_ok(label: str, got: tuple) -> Any:
    if got[0] != "ok":
        what = got[1] if got[0] == "crash" else f"{got[1]['kind']} {got[1]['message']!r}"
        raise Mismatch(f"{label}: failed with {what}, expected success")
    return got[1]


def diff(path: str, got: Any, want: Any) -> Optional[str]:
    if isinstance(want, dict) and isinstance(got, dict):
        for key in want:
            if key not in got:
                return f"{path}.{key}: missing"
            d = diff(f"{path}.{key}", got[key], want[key])
            if d:
                return d
        return None
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return f"{path}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = diff(f"{path}[{i}]", g, w)
            if d:
                return d
        return None
    if got != want:
        g, w = repr(got), repr(want)
        return f"{path}: got {g[:120]}, expected {w[:120]}"
    return None


def _expect_value(label: str, got: tuple, want: dict, key: str = "value") -> None:
    if want["ok"]:
        value = require_ok(label, got)
        if value != want[key]:
            raise Mismatch(f"{label}: got {value}, expected {want[key]}")
    else:
        check_error(label, got, want["error"])


class GenRunner:
    """Runs v16/v17 cases against one implementation."""

    def __init__(self, impl: str, version: int) -> None:
        self.impl = impl
        self.version = version
        self.k = kernels(impl)

    def run(self, case: dict) -> None:
        group = str(case.get("group"))
        if group.startswith("setup_"):
            conformance_setup.run_case(case, self.impl)
            return
        handler = getattr(self, "case_" + group, None)
        if handler is None:
            raise Mismatch(f"unknown group {group!r} for state version {self.version}")
        handler(case)

    # frames -----------------------------------------------------------------------------
    def _check_decoded(self, label: str, got: tuple, dec: dict, desc_in=None, payload_in=None) -> None:
        if not dec["ok"]:
            check_error(label, got, dec["error"])
            return
        desc, payload = require_ok(label, got)
        if "desc" in dec:
            d = diff(f"{label}.desc", desc_to_case(desc), dec["desc"])
            if d:
                raise Mismatch(d)
        elif desc_in is not None and desc != desc_in:
            raise Mismatch(f"{label}: the descriptor did not round-trip")
        if bytes(payload).hex() != dec["payload_hex"]:
            raise Mismatch(f"{label}.payload_hex differs")
        if "desc_roundtrip" in dec and desc_in is not None and (desc == desc_in) != dec["desc_roundtrip"]:
            raise Mismatch(f"{label}.desc_roundtrip: expected {dec['desc_roundtrip']}")
        if "bit_exact_roundtrip" in dec and (bytes(payload) == payload_in) != dec["bit_exact_roundtrip"]:
            raise Mismatch(f"{label}.bit_exact_roundtrip: expected {dec['bit_exact_roundtrip']}")

    def case_activation_frame(self, c: dict) -> None:
        desc, payload = desc_from_case(c["desc"]), bytes.fromhex(c["payload_hex"])
        _expect_value("expected_wire_len", outcome(self.k.frame_wire_bytes, c["codec_id"], desc), c["expected_wire_len"])
        got = outcome(self.k.encode_frame, c["codec_id"], desc, payload)
        self._encoded(c, got, lambda wire: outcome(self.k.decode_frame, c["codec_id"], wire, self.version),
                      desc, payload)

    def _encoded(self, c: dict, got: tuple, decode: Callable, desc, payload) -> None:
        enc = c["encode"]
        if not enc["ok"]:
            check_error("encode", got, enc["error"])
            return
        wire = bytes(require_ok("encode", got))
        if wire.hex() != enc["hex"] or len(wire) != enc["len"]:
            raise Mismatch(f"encode: {len(wire)} bytes differ from the expected {enc['len']}")
        if c["decode"] is not None:
            self._check_decoded("decode", decode(wire), c["decode"], desc, payload)

    def case_activation_frame_decode(self, c: dict) -> None:
        got = outcome(self.k.decode_frame, c["codec_id"], bytes.fromhex(c["wire_hex"]), self.version)
        self._check_decoded("decode", got, c["decode"])

    def case_frame_select(self, c: dict) -> None:
        permitted = [int(_codec_id(n)) for n in c["permitted"]]
        got = outcome(self.k.select_frame_codec, desc_from_case(c["desc"]), bytes.fromhex(c["payload_hex"]), permitted)
        _expect_value("select", got, c["result"], "codec_id")

    def case_ready(self, c: dict) -> None:
        if c["op"] == "send_ready":
            if READY_BYTES.hex() != c["result"]["hex"]:
                raise Mismatch("send_ready bytes differ")
            return
        got = outcome(lambda data: (recv_ready(data), 4)[1], bytes.fromhex(c["input_hex"]))
        _expect_value("recv_ready", got, c["result"], "consumed")

    # agreements -------------------------------------------------------------------------
    def case_agreement(self, c: dict) -> None:
        agreement = ActivationAgreement.from_json(c["agreement"])
        got = outcome(self.k.validate_agreement, agreement)
        _ok_or_error("validate", got, c["validate"])
        conn = StageConnection(None, 17, impl=self.impl)
        _ok_or_error("establish", outcome(conn.establish, agreement), c["establish"])
        if c["establish_again"] is not None:
            _ok_or_error("establish_again", outcome(conn.establish, agreement), c["establish_again"])

    def case_agreed_activation(self, c: dict) -> None:
        agreement = ActivationAgreement.from_json(c["agreement"])
        desc, payload = desc_from_case(c["desc"]), bytes.fromhex(c["payload_hex"])
        _expect_value("expected_wire_len", outcome(self.k.agreed_wire_bytes, agreement, c["codec_id"], desc),
                      c["expected_wire_len"])
        got = outcome(self.k.agreed_encode, agreement, c["codec_id"], desc, payload)
        self._encoded(c, got, lambda wire: outcome(self.k.agreed_decode, agreement, c["codec_id"], wire),
                      desc, payload)

    def case_agreed_activation_decode(self, c: dict) -> None:
        agreement = ActivationAgreement.from_json(c["agreement"])
        got = outcome(self.k.agreed_decode, agreement, c["codec_id"], bytes.fromhex(c["wire_hex"]))
        self._check_decoded("decode", got, c["decode"])

    # messages ---------------------------------------------------------------------------
    def _agreement(self, c: dict, context: Optional[str]):
        if self.version != 17 or context in (None, "none"):
            return None
        return ActivationAgreement.from_json(c[context])

    def _check_read(self, label: str, c: dict, data: bytes, read: dict) -> None:
        expected, pol = read_arguments(*read_expectation(read))
        agreement = self._agreement(c, read.get("context", "agreement"))
        got = outcome(self.k.read_stage_message_from_buffer, self.version, data, expected, pol, 0, agreement)
        if not read["ok"]:
            check_error(label, got, read["error"])
            return
        message, consumed = require_ok(label, got)
        if consumed != read["consumed"]:
            raise Mismatch(f"{label}: consumed {consumed} bytes, expected {read['consumed']}")
        d = diff(f"{label}.message", message_to_case_gen(message), read["message"])
        if d:
            raise Mismatch(d)

    def _check_write(self, label: str, got: tuple, w: dict) -> Optional[bytes]:
        if not w["ok"]:
            check_error(label, got, w["error"])
            partial = got[2].partial
            if partial is None or bytes(partial).hex() != w["partial_hex"]:
                raise Mismatch(f"{label}.partial_hex: got {None if partial is None else bytes(partial).hex()[:80]}")
            return None
        data = bytes(require_ok(label, got))
        if data.hex() != w["hex"]:
            raise Mismatch(f"{label}.hex: {len(data)} bytes differ from the expected {w['len']}")
        return data

    def case_frame(self, c: dict) -> None:
        msg = message_from_case(c["message"])
        agreement = self._agreement(c, "agreement")
        w = c["write"]
        data = self._check_write("write", outcome(self.k.write_stage_message, self.version, msg, agreement), w)
        if self.version == 17:
            self._check_write("write_without_agreement",
                              outcome(self.k.write_stage_message, 17, msg, None), c["write_without_agreement"])
        if data is None:
            return
        if self.version == 16:
            if estimated_buffer_bytes(msg) != w["estimated_wire_bytes"]:
                raise Mismatch(f"write.estimated_wire_bytes: {estimated_buffer_bytes(msg)}")
        else:
            if estimated_buffer_bytes(msg) != w["estimated_buffer_bytes"]:
                raise Mismatch(f"write.estimated_buffer_bytes: {estimated_buffer_bytes(msg)}")
            _expect_value("write.wire_bytes", outcome(self.k.message_wire_bytes, msg, agreement), w["wire_bytes"])
        for i, read in enumerate(c["reads"]):
            self._check_read(f"reads[{i}] {read['api']}", c, data, read)

    def case_malformed(self, c: dict) -> None:
        data = bytes.fromhex(c["bytes_hex"])
        for i, read in enumerate(c["reads"]):
            self._check_read(f"reads[{i}] {read['api']}", c, data, read)


def _ok_or_error(label: str, got: tuple, want: dict) -> None:
    if want["ok"]:
        require_ok(label, got)
    else:
        check_error(label, got, want["error"])


def _codec_id(name: str) -> int:
    return int(ActivationCodec.from_rust_name(name))


_RUNNERS: dict = {}


def runner_for(case: dict, impl: str, protocol: Optional[int] = None) -> Optional[GenRunner]:
    """The runner of a v16/v17 case (cached per implementation and version), else None."""
    version = case_version(case, protocol)
    if version not in (16, 17):
        return None
    key = (impl, version)
    if key not in _RUNNERS:
        _RUNNERS[key] = GenRunner(impl, version)
    return _RUNNERS[key]
