"""A caller's v17 agreement or frame of the wrong shape fails alike in both twins.

Agreements parsed from setup JSON always have their setup types (B.3); one built in code may
not.  Before, a generation of 3 bytes made the compiled twin copy 16 bytes out of a 3-byte
object into the agreed header (an out-of-bounds read), an ``int`` generation was 16 zero
bytes to one twin and a TypeError to the other, and ids, stage indexes or dimension bounds
outside their wire types leaked OverflowError / struct.error / TypeError, or were encoded by
one twin and refused by the other.  Now every such field is an InvalidInputError naming it,
raised before any rule of B.5.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest

from skippy_wire.errors import InvalidDataError, InvalidInputError, WireError
from skippy_wire.tools.conformance_gen import desc_from_case
from skippy_wire.wire.agreement import ActivationAgreement, Dynamic, Fixed, TOKENS
from skippy_wire.wire.protocol import kernels

GOLDEN = Path(__file__).parent / "golden" / "v17"
IMPLS = ("cython", "python")
RANGE = "activation agreement field out of range"


def _case() -> dict:
    for line in (GOLDEN / "agreed_activation.jsonl").read_text().splitlines():
        case = json.loads(line)
        if case["encode"]["ok"]:
            return case
    raise AssertionError("no encodable agreed_activation case")


CASE = _case()
AGREEMENT = ActivationAgreement.from_json(CASE["agreement"])
DESC = desc_from_case(CASE["desc"])
PAYLOAD = bytes.fromhex(CASE["payload_hex"])
WIRE = bytes.fromhex(CASE["encode"]["hex"])
CODEC = CASE["codec_id"]


def _outcome(fn):
    try:
        result = fn()
    except WireError as exc:
        return type(exc), str(exc)
    return "ok", result if not isinstance(result, tuple) else (repr(result[0]), bytes(result[1]))


def _every_entry(impl: str, agreement) -> list:
    k = kernels(impl)
    return [_outcome(lambda: k.validate_agreement(agreement)),
            _outcome(lambda: k.agreed_encode(agreement, CODEC, DESC, PAYLOAD)),
            _outcome(lambda: k.agreed_wire_bytes(agreement, CODEC, DESC)),
            _outcome(lambda: k.agreed_decode(agreement, CODEC, WIRE))]


def _set(path: str, value):
    def edit(agreement):
        *parents, last = path.split(".")
        target = agreement
        for key in parents:
            target = target[int(key)] if key.isdigit() else getattr(target, key)
        setattr(target, last, value(getattr(target, last)) if callable(value) else value)
    return edit


def _dims(*dims):
    return _set("profiles.0.parts.0.dimensions", tuple(dims))


@pytest.mark.parametrize("edit, name", [
    (_set("generation", lambda g: bytes(g)[:3]), "generation"),
    (_set("generation", lambda g: bytes(g)[:15]), "generation"),
    (_set("generation", lambda g: bytes(g) + b"\x01"), "generation"),
    (_set("generation", 16), "generation"),
    (_set("generation", "x" * 16), "generation"),
    (_set("profiles.0.id", 2**32 + 1), "profiles[0].id"),
    (_set("profiles.0.id", -1), "profiles[0].id"),
    (_set("profiles.0.id", 1.0), "profiles[0].id"),
    (_set("profiles.0.id", True), "profiles[0].id"),  # a bool is no wire integer: it was profile 1
    (_set("profiles.0.max_tokens", True), "profiles[0].max_tokens"),
    (_set("profiles.0.producer_stage_index", 2**31), "profiles[0].producer_stage_index"),
    (_set("profiles.0.layer_end", 2**31), "profiles[0].layer_end"),
    (_set("profiles.0.max_tokens", None), "profiles[0].max_tokens"),
    (_set("profiles.0.max_sequences", 2**32), "profiles[0].max_sequences"),
    (_set("profiles.0.frontier_identity", b"\x03" * 31), "profiles[0].frontier_identity"),
    (_set("profiles.0.parts.0.identity", 32), "profiles[0].parts[0].identity"),
    (_set("profiles.0.parts.0.identity", [1] * 32), "profiles[0].parts[0].identity"),
    (_set("generation", list(range(16))), "generation"),
    (_set("profiles.0.parts.0.ggml_type", None), "profiles[0].parts[0].ggml_type"),
    (_set("profiles.0.parts.0.ggml_type", -1), "profiles[0].parts[0].ggml_type"),
    (_set("profiles.0.parts.0.rank", 2**32 + 2), "profiles[0].parts[0].rank"),
    (_dims(Fixed(4.0), TOKENS, Fixed(1), Fixed(1)), "profiles[0].parts[0].dimensions[0]"),
    (_dims(Fixed("4"), TOKENS, Fixed(1), Fixed(1)), "profiles[0].parts[0].dimensions[0]"),
    (_dims(Fixed(4), TOKENS, Fixed(1), Fixed(2**64)), "profiles[0].parts[0].dimensions[3]"),
    (_dims(Dynamic(1.5, 8), TOKENS, Fixed(1), Fixed(1)), "profiles[0].parts[0].dimensions[0]"),
    (_dims(Dynamic(1, "b"), TOKENS, Fixed(1), Fixed(1)), "profiles[0].parts[0].dimensions[0]"),
])
def test_a_field_beyond_its_setup_type_is_named_alike(edit, name):
    want = (InvalidInputError, f"{RANGE}: {name}")
    for impl in IMPLS:
        agreement = copy.deepcopy(AGREEMENT)
        edit(agreement)
        assert _every_entry(impl, agreement) == [want] * 4, impl


@pytest.mark.parametrize("edit, name", [
    (_set("profiles", 3), "profiles"),
    (_set("profiles", None), "profiles"),
    (_set("profiles", lambda ps: dict(enumerate(ps))), "profiles"),
    (_set("profiles", {1}), "profiles"),
    (_set("profiles", [5]), "profiles[0]"),
    (_set("profiles", lambda ps: [*ps, "profile"]), f"profiles[{len(AGREEMENT.profiles)}]"),
    (_set("profiles.0.parts", 3), "profiles[0].parts"),
    (_set("profiles.0.parts", None), "profiles[0].parts"),
    (_set("profiles.0.parts", lambda ps: dict(enumerate(ps))), "profiles[0].parts"),
    (_set("profiles.0.parts", {1}), "profiles[0].parts"),
    (_set("profiles.0.parts", ["x"]), "profiles[0].parts[0]"),
    (_set("profiles.0.parts", [None]), "profiles[0].parts[0]"),
    (_set("profiles.0.parts.0.optional", np.array([1, 0])), "profiles[0].parts[0].optional"),  # ValueError before
    (_set("profiles.0.parts.0.optional", None), "profiles[0].parts[0].optional"),
    (_set("profiles.0.parts.0.optional", "no"), "profiles[0].parts[0].optional"),
    (_set("profiles.0.parts.0.optional", 2), "profiles[0].parts[0].optional"),
    (_set("profiles.0.parts.0.optional", 0.0), "profiles[0].parts[0].optional"),
    # read more than once, so no iterator (one twin used it up, the other raised TypeError)
    (_set("profiles.0.parts.0.dimensions", iter), "profiles[0].parts[0].dimensions"),
    (_set("profiles.0.parts.0.dimensions", None), "profiles[0].parts[0].dimensions"),
])
def test_profiles_and_parts_of_the_wrong_type_are_named_alike(edit, name):
    # before: TypeError / AttributeError / ValueError, or an agreement of no profiles at all
    want = (InvalidInputError, f"{RANGE}: {name}")
    for impl in IMPLS:
        agreement = copy.deepcopy(AGREEMENT)
        edit(agreement)
        assert _every_entry(impl, agreement) == [want] * 4, impl


@pytest.mark.parametrize("optional", [False, 0, np.False_])
def test_optional_is_a_wire_boolean_as_ignore_eos_is(optional):
    # a bool (Python's or numpy's) or 0 / 1, as messages.wire_bool
    agreement = copy.deepcopy(AGREEMENT)
    agreement.profiles[0].parts[0].optional = optional
    want = _every_entry("python", copy.deepcopy(AGREEMENT))
    assert [_every_entry(impl, agreement) for impl in IMPLS] == [want, want]


def test_profiles_and_parts_may_be_tuples():
    agreement = copy.deepcopy(AGREEMENT)
    agreement.profiles = tuple(agreement.profiles)
    agreement.profiles[0].parts = tuple(agreement.profiles[0].parts)
    want = _every_entry("python", copy.deepcopy(AGREEMENT))
    assert [_every_entry(impl, agreement) for impl in IMPLS] == [want, want]


GEN = bytes(AGREEMENT.generation)


@pytest.mark.parametrize("generation", [
    np.frombuffer(GEN, np.uint8).reshape(4, 4),  # the twin: "truth value of an array is ambiguous"
    np.array(GEN, "S16"),  # 0-d: the twin could not iterate it
    np.frombuffer(GEN, np.float32),
    memoryview(bytes(b for x in GEN for b in (x, 0)))[::2],
], ids=["2-d", "0-d S16", "float32", "strided"])
def test_a_generation_is_its_buffers_bytes_whatever_its_shape(generation):
    want = _every_entry("python", copy.deepcopy(AGREEMENT))
    for impl in IMPLS:
        agreement = copy.deepcopy(AGREEMENT)
        agreement.generation = generation
        assert _every_entry(impl, agreement) == want, impl


def test_a_generation_of_negative_zeros_is_not_zero():
    # -0.0 as f32 is 00 00 00 80: 16 bytes not all zero (the twin read the floats as zero)
    minus_zero = np.array([-0.0] * 4, np.float32)
    for impl in IMPLS:
        agreement = copy.deepcopy(AGREEMENT)
        agreement.generation = minus_zero
        ok = copy.deepcopy(AGREEMENT)
        ok.generation = minus_zero.tobytes()
        wire = kernels(impl).agreed_encode(ok, CODEC, DESC, PAYLOAD)
        assert _every_entry(impl, agreement)[:3] == [("ok", None), ("ok", wire), ("ok", len(wire))], impl
        assert _outcome(lambda: kernels(impl).agreed_decode(agreement, CODEC, wire))[0] == "ok", impl
        zeros = copy.deepcopy(AGREEMENT)
        zeros.generation = np.zeros(4, np.float32)
        assert _every_entry(impl, zeros)[0] == (InvalidDataError, "invalid activation agreement"), impl


def test_the_golden_agreement_is_untouched_by_the_field_checks():
    outcomes = [_every_entry(impl, copy.deepcopy(AGREEMENT)) for impl in IMPLS]
    assert outcomes[0] == outcomes[1]
    assert outcomes[0][0] == ("ok", None) and outcomes[0][1] == ("ok", WIRE)


def test_rule_texts_of_b5_are_kept_for_well_typed_fields():
    for impl in IMPLS:
        zero = copy.deepcopy(AGREEMENT)
        zero.generation = bytes(16)
        assert _every_entry(impl, zero)[0] == (InvalidDataError, "invalid activation agreement")
        odd = copy.deepcopy(AGREEMENT)
        odd.profiles[0].parts[0].ggml_type = 2
        assert _every_entry(impl, odd)[0] == (InvalidDataError, "activation part has unsupported ggml type")
        short = copy.deepcopy(AGREEMENT)
        short.profiles[0].parts[0].dimensions = short.profiles[0].parts[0].dimensions[:3]
        assert _every_entry(impl, short)[0] == (InvalidDataError, "invalid admitted activation dimension")


@pytest.mark.parametrize("data", ["x" * 64, None, 7, [1, 2, 3], memoryview(bytes(200))[::2]])
def test_agreed_entries_refuse_a_non_buffer_alike(data):
    # the twin raised TypeError where the compiled one raised InvalidInputError
    want = (InvalidInputError, "activation must be a C-contiguous bytes-like object")
    frame = kernels("python").encode_frame(CODEC, DESC, PAYLOAD)
    for impl in IMPLS:
        k = kernels(impl)
        assert _outcome(lambda: k.agreed_decode(AGREEMENT, CODEC, data)) == want, impl
        assert _outcome(lambda: k.agreed_encode(AGREEMENT, CODEC, DESC, data)) == want, impl
        assert _outcome(lambda: k.agreed_reframe(AGREEMENT, DESC, data)) == want, impl
        assert _outcome(lambda: k.agreed_reframe(AGREEMENT, DESC, frame))[0] == "ok", impl


@pytest.mark.parametrize("cut", [0, 1, 67, 68 + 127])
def test_reframing_a_frame_shorter_than_its_headers_is_a_size_mismatch(cut):
    # the compiled twin passed a negative length to PyBytes_FromStringAndSize (SystemError)
    frame = kernels("python").encode_frame(CODEC, DESC, PAYLOAD)[:cut]
    want = (InvalidDataError, "activation frame wire byte count mismatch")
    for impl in IMPLS:
        assert _outcome(lambda: kernels(impl).agreed_reframe(AGREEMENT, DESC, frame)) == want, impl


@pytest.mark.parametrize("impl", IMPLS)
def test_client_compares_the_offered_contract_by_value_not_container(impl):
    """B.4.1 step 5 is structural equality of the values: an output profile built in code
    with a list of dimensions and a bytearray identity is the contract the peer echoes
    back (the parsed Offer has tuples and bytes); it read "peer changed the offered output
    contract"."""
    import socket
    import threading

    from skippy_wire.wire.agreement import ActivationPartProfile, ActivationProfile
    from skippy_wire.wire.setup import StagePeer, StageSetupConfig, client_setup, server_setup

    def output():
        part = ActivationPartProfile(bytearray(b"\x01" * 32), 0, 2, 1, False, [Fixed(4), TOKENS, Fixed(1), Fixed(1)])
        return ActivationProfile(1, 0, 0, 4, b"\x03" * 32, 32, 8, [part])

    sender = StageSetupConfig("r", "p", "m", "s0", 0, 0, 4, downstream=StagePeer("s1", 1))
    receiver = StageSetupConfig("r", "p", "m", "s1", 1, 4, 8, upstream=StagePeer("s0", 0))
    client_sock, server_sock = socket.socketpair()
    served: dict = {}

    def serve():
        try:
            served["result"] = server_setup(server_sock, receiver, output(), timeout=5, impl=impl)
        except Exception as exc:  # noqa: BLE001 - reported below
            served["result"] = exc
        server_sock.close()

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        agreement = client_setup(client_sock, "Activation", sender, output(), timeout=5, impl=impl)
    finally:
        client_sock.close()
        thread.join(10)
    role, installed = served["result"]
    assert agreement.generation == installed.generation
    assert agreement.profiles[0].to_json() == output().to_json()


def test_a_numpy_integer_dimension_is_its_value():
    # the reference twin multiplied numpy scalars, which wrap: "activation part stride
    # overflow" where 2**62 as an int is B.6.3's "activation layout overflow"
    case = next(c for c in map(json.loads, (GOLDEN / "agreed_activation_decode.jsonl").read_text().splitlines())
                if c["id"] == "v17-agd-00762")
    wire = bytes.fromhex(case["wire_hex"])
    outcomes = []
    for value in (2**62, np.int64(2**62)):
        agreement = ActivationAgreement.from_json(case["agreement"])
        part = agreement.profile(int.from_bytes(wire[16:20], "little")).parts[0]
        part.dimensions = (Fixed(value),) + tuple(part.dimensions[1:])
        outcomes += [_outcome(lambda: kernels(impl).agreed_decode(agreement, case["codec_id"], wire)) for impl in IMPLS]
    assert outcomes == [(InvalidDataError, "activation layout overflow")] * 4


@pytest.mark.parametrize("path", ["profiles.0.id", "profiles.0.parts.0.ggml_type"])
@pytest.mark.parametrize("kind", [np.int64, np.array])
def test_a_numpy_integer_id_or_type_is_its_value(path, kind):
    # an index, as the field check takes it: a 0-d array was put in a set as it was
    # ("unhashable type: 'numpy.ndarray'", from one twin or both)
    agreement = copy.deepcopy(AGREEMENT)
    _set(path, lambda value: kind(value))(agreement)
    want = _every_entry("python", copy.deepcopy(AGREEMENT))
    assert [_every_entry(impl, agreement) for impl in IMPLS] == [want, want]
