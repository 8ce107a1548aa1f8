"""State versions 16 and 17: the compiled kernels and the reference twin fail a caller's
malformed descriptors and agreements alike (the same class and text), and never crash on
Python objects shorter than the four axes the wire carries."""

from __future__ import annotations

import copy
import dataclasses
import json
from pathlib import Path

import pytest

from skippy_wire.errors import InvalidDataError, InvalidInputError
from skippy_wire.tools.conformance_gen import desc_from_case
from skippy_wire.wire.agreement import ActivationAgreement
from skippy_wire.wire.protocol import kernels

GOLDEN = Path(__file__).parent / "golden"
IMPLS = ("cython", "python")


def _first(version: int, name: str) -> dict:
    return json.loads((GOLDEN / f"v{version}" / f"{name}.jsonl").read_text().splitlines()[0])


def _failure(fn):
    try:
        fn()
    except (InvalidDataError, InvalidInputError) as exc:
        return type(exc), str(exc)
    return None


def _each_writer(kernel, desc, payload):
    return [_failure(lambda: kernel.encode_frame(1, desc, payload)), _failure(lambda: kernel.frame_wire_bytes(1, desc)),
            _failure(lambda: kernel.validate_frame(desc, len(payload)))]


@pytest.mark.parametrize("dims, strides", [((4, 1), (4, 16, 16, 16)), ((4, 1, 1, 1), (4, 16)), ((), ())])
def test_a_part_with_fewer_than_four_axes_is_an_input_error(dims, strides):
    # the compiled twin read past the end of the tuple (a segfault); the twin raised struct.error
    case = _first(16, "activation_frame")
    desc = desc_from_case(case["desc"])
    desc.parts[0] = desc.parts[0]._replace(dimensions=dims, byte_strides=strides) \
        if hasattr(desc.parts[0], "_replace") else dataclasses.replace(desc.parts[0], dimensions=dims,
                                                                        byte_strides=strides)
    payload = bytes.fromhex(case["payload_hex"])
    want = (InvalidInputError, "activation part dimensions and byte strides are 4 values each")
    for impl in IMPLS:
        assert _each_writer(kernels(impl), desc, payload) == [want] * 3, impl


@pytest.mark.parametrize("path, value, name", [
    ("producer_stage_index", 2**31, "producer_stage_index"),
    ("token_count", -1, "token_count"),
    ("payload_bytes", -1, "payload_bytes"),
    ("parts.0.ggml_type", -1, "parts[0].ggml_type"),
    ("parts.0.flags", 2**32, "parts[0].flags"),
    ("parts.0.token_axis", 2**31, "parts[0].token_axis"),
    ("parts.0.dimensions.1", 2**63, "parts[0].dimensions[1]"),
    ("parts.0.byte_strides.0", -1, "parts[0].byte_strides[0]"),
    ("parts.0.payload_offset", 1.5, "parts[0].payload_offset"),
    ("token_count", True, "token_count"),  # a bool is no wire integer: True was a count of 1
    ("parts.0.rank", True, "parts[0].rank"),
])
def test_a_field_beyond_its_wire_type_is_named_alike(path, value, name):
    case = _first(16, "activation_frame")
    fields = copy.deepcopy(case["desc"])
    *parents, last = path.split(".")
    target = fields
    for key in parents:
        target = target[int(key)] if key.isdigit() else target[key]
    target[int(last) if last.isdigit() else last] = value
    desc, payload = desc_from_case(fields), bytes.fromhex(case["payload_hex"])
    want = (InvalidInputError, f"activation frame descriptor field out of range: {name}")
    for impl in IMPLS:
        assert _each_writer(kernels(impl), desc, payload) == [want] * 3, impl


def test_an_agreement_part_with_fewer_than_four_dimensions_is_refused():
    # the compiled twin read past the end (a segfault); the twin accepted it
    agreement = ActivationAgreement.from_json(_first(17, "agreement")["agreement"])
    part = agreement.profiles[0].parts[0]
    for dims in (part.dimensions[:3], part.dimensions[:2], ()):
        part.dimensions = dims
        for impl in IMPLS:
            assert _failure(lambda: kernels(impl).validate_agreement(agreement)) == \
                (InvalidDataError, "invalid admitted activation dimension"), (impl, len(dims))


def test_a_float_is_not_an_integer_field():
    # the compiled twin truncated 1.5 into a u64 field (and then blamed the layout)
    case = _first(16, "activation_frame")
    for field in ("version", "payload_bytes"):
        fields = {**copy.deepcopy(case["desc"]), field: float(case["desc"][field])}
        desc, payload = desc_from_case(fields), bytes.fromhex(case["payload_hex"])
        want = (InvalidInputError, f"activation frame descriptor field out of range: {field}")
        for impl in IMPLS:
            assert _each_writer(kernels(impl), desc, payload) == [want] * 3, (impl, field)


@pytest.mark.parametrize("field, value", [("kind", 1.0), ("token_count", None), ("pos_start", 2.0),
                                          ("state.activation_codec", None), ("kind", True), ("token_count", True),
                                          ("state.activation_codec", True)])
@pytest.mark.parametrize("version", [16, 17])
def test_a_message_field_of_the_wrong_type_is_named_alike(version, field, value):
    from skippy_wire.tools.vector_cases import message_from_case
    from skippy_wire.wire.protocol import WireProtocol

    lines = (GOLDEN / f"v{version}" / "frame.jsonl").read_text().splitlines()
    case = next(c for c in map(json.loads, lines) if c["write"]["ok"] and c["message"]["activation_hex"])
    agreement = ActivationAgreement.from_json(case["agreement"]) if version == 17 else None
    outcomes = []
    for impl in IMPLS:
        msg = message_from_case(case["message"], kind=case["message"]["kind"])
        owner, _, name = field.rpartition(".")
        setattr(msg.state if owner else msg, name, value)
        outcomes.append(_failure(lambda: WireProtocol(version, impl=impl).write(msg, agreement)))
    assert outcomes[0] == outcomes[1] == (InvalidInputError, f"{field} value {value!r} does not fit its wire type")


@pytest.mark.parametrize("version", [16, 17])
def test_a_bool_is_no_frame_codec(version):
    # as a message's fields: True was RawF32V1 to every frame function
    from skippy_wire.wire.protocol import WireProtocol

    case = _first(16, "activation_frame")
    desc, payload = desc_from_case(case["desc"]), bytes.fromhex(case["payload_hex"])
    for impl in IMPLS:
        wire = WireProtocol(version, impl=impl)
        for call in (lambda: wire.encode_frame(True, desc, payload), lambda: wire.frame_wire_bytes(True, desc),
                     lambda: wire.select_frame_codec(desc, payload, [True, 3])):
            with pytest.raises(TypeError, match="a bool is not a wire integer"):
                call()
