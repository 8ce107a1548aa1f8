"""Conformance runners for state versions 16 and 17 (tests/golden/v16, tests/golden/v17).

The version of a case is taken from its id (``v16-...`` / ``v17-...``, as the READMEs of
the vector folders say); ``protocol=`` (``--protocol``) forces one.  :func:`runner_for`
gives the runner of a case, or None for a v15 case (run by ``conformance.Runner``).
"""

from __future__ import annotations

import re
from typing import Callable, Optional

from ..wire.constants import READY_BYTES
from ..errors import Mismatch
from ..wire.activation_frame import ActivationFrameV16, ActivationPartV16, kind_rust_name
from ..wire.agreement import ActivationAgreement
from ..wire.constants import ActivationCodec
from ..wire.frame import reader_expectation, recv_ready
from ..wire.protocol import StageConnection, estimated_buffer_bytes, kernels
from ..wire.messages import StageWireMessage
from . import conformance_setup, vector_cases
from .vector_cases import (check_error, check_read, diff, hex_diff, malformed_bytes, outcome, read_expectation,
                           require_ok)

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


def message_from_case(d: dict) -> StageWireMessage:
    """The message a v16/v17 ``frame`` case hands to the writer (kinds kept as ints)."""
    return vector_cases.message_from_case(d, kind=d["kind"])


def message_to_case_gen(m: StageWireMessage) -> dict:
    """A decoded v16/v17 message in the vectors' shape (kind 23 included)."""
    return vector_cases.message_to_case(m, kind_name=kind_rust_name(m.kind))


# --- comparison ----------------------------------------------------------------------------
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
        if wire.hex() != enc["hex"]:
            raise Mismatch(hex_diff("encode", wire.hex(), enc["hex"]))
        if len(wire) != enc["len"]:
            raise Mismatch(f"encode.len: got {len(wire)}, expected {enc['len']}")
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
        if c["op"] not in ("send_ready", "recv_ready"):  # a misspelt one ran as recv_ready
            raise Mismatch(f"unknown op {c['op']!r} (send_ready or recv_ready)")
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
        expected, pol = reader_expectation(*read_expectation(read))
        agreement = self._agreement(c, read.get("context", "agreement"))
        got = outcome(self.k.read_stage_message_from_buffer, self.version, data, expected, pol, 0, agreement)
        check_read(label, got, read, message_to_case_gen)

    def _check_write(self, label: str, got: tuple, w: dict) -> Optional[bytes]:
        if not w["ok"]:
            check_error(label, got, w["error"])
            partial = got[2].partial
            if partial is None or bytes(partial).hex() != w["partial_hex"]:
                raise Mismatch(f"{label}.partial_hex: got {None if partial is None else bytes(partial).hex()[:80]}")
            return None
        data = bytes(require_ok(label, got))
        if data.hex() != w["hex"]:
            raise Mismatch(hex_diff(f"{label}.hex", data.hex(), w["hex"]))
        if len(data) != w["len"]:
            raise Mismatch(f"{label}.len: {len(data)}, expected {w['len']}")
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
        data = malformed_bytes(c)
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
