"""Both twins of the v16/v17 kernels check a caller's arguments in one order.

The compiled twin converts the descriptor (A.5 steps 1-2, then the field types) before it
asks for the payload buffer, and the codec id before anything else.  The reference twin used
to ask for the buffer first in ``encode_frame``, ``select_frame_codec`` and ``agreed_encode``,
and to validate the agreement before the codec id in ``agreed_wire_bytes``; the compiled
``validate_frame`` took a negative payload length for "no payload".  Now both give the same
error for the same call.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from conftest import IMPLS
from skippy_wire.errors import InvalidDataError, InvalidInputError, UnexpectedEofError, WireError
from skippy_wire.tools.conformance_gen import desc_from_case, message_from_case
from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16
from skippy_wire.wire.agreement import ActivationAgreement
from skippy_wire.wire.messages import SamplingConfig
from skippy_wire.wire.protocol import WireProtocol, kernels

GOLDEN = Path(__file__).parent / "golden" / "v17"


def _first(name: str, ok_key: str) -> dict:
    for line in (GOLDEN / name).read_text().splitlines():
        case = json.loads(line)
        if case[ok_key]["ok"]:
            return case
    raise AssertionError(f"no successful case in {name}")


CASE = _first("agreed_activation.jsonl", "encode")
AGREEMENT = ActivationAgreement.from_json(CASE["agreement"])
DESC = desc_from_case(CASE["desc"])
PAYLOAD = bytes.fromhex(CASE["payload_hex"])
CODEC = CASE["codec_id"]


def _desc(**fields):
    desc = copy.deepcopy(DESC)
    for name, value in fields.items():
        setattr(desc, name, value)
    return desc


BAD_VERSION = _desc(version=3)
NO_PARTS = _desc(parts=[])
BAD_FIELD = _desc(token_count=-1)
ZERO_GENERATION = ActivationAgreement(bytes(16), AGREEMENT.profiles)


def _outcome(fn):
    try:
        result = fn()
    except WireError as exc:
        return type(exc), str(exc)
    return "ok", result


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("desc, expected", [
    (BAD_VERSION, (InvalidDataError, "unsupported activation frame version")),
    (NO_PARTS, (InvalidDataError, "activation frame part count is invalid")),
    (BAD_FIELD, (InvalidInputError, "activation frame descriptor field out of range: token_count")),
])
def test_descriptor_before_payload_buffer(impl, desc, expected):
    k = kernels(impl)
    not_a_buffer = 123
    assert _outcome(lambda: k.encode_frame(CODEC, desc, not_a_buffer)) == expected
    assert _outcome(lambda: k.select_frame_codec(desc, not_a_buffer, [1])) == expected
    assert _outcome(lambda: k.agreed_encode(AGREEMENT, CODEC, desc, not_a_buffer)) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_payload_buffer_after_a_valid_descriptor(impl):
    k = kernels(impl)
    expected = (InvalidInputError, "activation must be a C-contiguous bytes-like object")
    assert _outcome(lambda: k.encode_frame(CODEC, DESC, 123)) == expected
    assert _outcome(lambda: k.agreed_encode(AGREEMENT, CODEC, DESC, 123)) == expected


@pytest.mark.parametrize("impl", IMPLS)
def test_codec_id_before_the_agreement(impl):
    k = kernels(impl)
    expected = (InvalidDataError, "unknown stage activation codec")
    assert _outcome(lambda: k.agreed_wire_bytes(ZERO_GENERATION, 9, DESC)) == expected
    assert _outcome(lambda: k.agreed_encode(ZERO_GENERATION, 9, DESC, PAYLOAD)) == expected
    assert _outcome(lambda: k.agreed_decode(ZERO_GENERATION, 9, b"")) == expected


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("length", [-1, -(2**70), 2**64, 2**70, DESC.payload_bytes + 1])
def test_impossible_payload_length_mismatches(impl, length):
    assert _outcome(lambda: kernels(impl).validate_frame(DESC, length)) == \
        (InvalidDataError, "activation payload byte count mismatch")


@pytest.mark.parametrize("impl", IMPLS)
def test_payload_length_checks_keep_their_step(impl):
    k = kernels(impl)
    assert _outcome(lambda: k.validate_frame(DESC, DESC.payload_bytes)) == ("ok", None)
    assert _outcome(lambda: k.validate_frame(DESC, None)) == ("ok", None)
    # steps 1-3 still come before the payload length (step 4)
    assert _outcome(lambda: k.validate_frame(BAD_VERSION, -1)) == \
        (InvalidDataError, "unsupported activation frame version")
    assert _outcome(lambda: k.validate_frame(_desc(payload_bytes=2**40), -1)) == \
        (InvalidDataError, "decoded activation payload byte count exceeds maximum")


def test_axes_given_as_iterators_are_read_once_by_both_twins():
    # the compiled twin reads each part's axes once; the reference read them twice and found
    # an iterator empty the second time (IndexError)
    def desc():
        part = ActivationPartV16(b"\x01" * 32, 0, 2, 1, 0, iter((4, 1, 1, 1)), iter((4, 16, 16, 16)), 0, 16)
        return ActivationFrameV16(2, 0, 0, 4, 1, 1, 16, b"\x03" * 32, [part])

    encoded = {bytes(kernels(impl).encode_frame(1, desc(), bytes(16))) for impl in IMPLS}
    assert len(encoded) == 1 and len(encoded.pop()) == 68 + 128 + 16
    assert {kernels(impl).frame_wire_bytes(2, desc()) for impl in IMPLS} == {68 + 128 + 8}


def _golden_message_case() -> dict:
    return next(c for c in map(json.loads, (GOLDEN / "frame.jsonl").read_text().splitlines())
                if c["write"]["ok"] and c["message"]["activation_hex"])


@pytest.mark.parametrize("edit, text", [
    (lambda m: setattr(m, "state", None), "state must be a StageStateHeader, not NoneType"),
    (lambda m: setattr(m.state, "activation_codec", "x"), "state.activation_codec value 'x' does not fit its wire type"),
    (lambda m: setattr(m, "sampling", SamplingConfig(dry_sequence_breakers=(s for s in ["a"]))),
     "sampling.dry_sequence_breakers must be a list of strings, not generator"),
    # the size was given (or "unknown stage activation codec") where the writer refuses
    (lambda m: setattr(m.state, "activation_codec", 9), "state.activation_codec value 9 is no stage activation codec"),
    (lambda m: setattr(m, "kind", 99), "kind value 99 is no state version 17 stage message kind"),
])
def test_the_size_of_a_message_names_a_wrong_field_as_the_writer_does(edit, text):
    # message_wire_bytes skipped the writer's checks: AttributeError, TypeError, or a
    # generator used up by one twin and not the other
    case = _golden_message_case()
    agreement = ActivationAgreement.from_json(case["agreement"])
    for impl in IMPLS:
        for call in ("write", "message_wire_bytes"):
            msg = message_from_case(case["message"])
            edit(msg)
            with pytest.raises(InvalidInputError) as err:
                getattr(WireProtocol(17, impl=impl), call)(msg, agreement)
            assert str(err.value) == text, (impl, call)


def test_the_size_of_a_message_reads_only_its_frame_s_descriptor():
    # B.7.4 as upstream computes it: the descriptor is read (its EOF and part-count errors
    # come before a missing agreement), the payload never decoded
    case = _golden_message_case()
    agreement = ActivationAgreement.from_json(case["agreement"])
    for impl in IMPLS:
        protocol = WireProtocol(17, impl=impl)
        msg = message_from_case(case["message"])
        size = protocol.message_wire_bytes(msg, agreement)
        assert size == len(protocol.write(msg, agreement))
        head = 68 + 128 * int.from_bytes(bytes(msg.activation)[24:28], "little")
        msg.activation = bytes(msg.activation)[:head] + b"\xff" * (len(msg.activation) - head)  # NaN payload
        assert protocol.message_wire_bytes(msg, agreement) == size
        msg.activation = bytes(msg.activation)[:40]
        with pytest.raises(UnexpectedEofError):
            protocol.message_wire_bytes(msg, None)
