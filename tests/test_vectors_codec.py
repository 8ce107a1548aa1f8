"""Golden vectors of the activation codecs (tests/golden/v15: activation,
activation_decode, select), run against every implementation.

Each case compares encoded bytes, decoded f32 bit patterns, the expected wire length,
and for errors the kind (exception class) and the exact upstream text.
"""

from __future__ import annotations

import pytest

from skippy_wire.wire.constants import ActivationCodec
from vector_helpers import group_fixture, load_cases as _load, outcome as _outcome

def _expected_error(entry):
    return ("err", entry["error"]["kind"], entry["error"]["message"])


def _bits(arr):
    assert arr.dtype.name == "float32" and arr.ndim == 1
    assert arr.flags.owndata or arr.base is not None  # a real array, not a buffer wrapper
    return [f"{b:08x}" for b in arr.view("<u4").tolist()]


activation_cases = group_fixture("activation", "activation_cases")
decode_cases = group_fixture("activation_decode", "decode_cases")
select_cases = group_fixture("select", "select_cases")


def test_vector_files_are_present(activation_cases, decode_cases, select_cases):
    assert len(activation_cases) >= 800 and len(decode_cases) >= 190 and len(select_cases) >= 330


def _check_activation_case(codec_impl, case):
    codec = case["codec_id"]
    assert ActivationCodec.from_rust_name(case["codec"]) == codec
    shape = (case["token_count"], case["width"], case["state_flags"])
    payload = bytes.fromhex(case["input_hex"])
    problems = []

    got = _outcome(codec_impl.activation_wire_bytes, codec, *shape)
    want = ("ok", case["expected_wire_len"]["value"]) if case["expected_wire_len"]["ok"] else _expected_error(case["expected_wire_len"])
    if got != want:
        problems.append(f"wire_len {got} != {want}")

    got = _outcome(codec_impl.encode_activation, codec, shape[0], shape[1], payload, shape[2])
    want = ("ok", bytes.fromhex(case["encode"]["hex"])) if case["encode"]["ok"] else _expected_error(case["encode"])
    if got != want:
        problems.append(f"encode {got!r:.200} != {want!r:.200}")
    elif case["decode"] is not None:
        wire = got[1]
        got_dec = _outcome(codec_impl.decode_activation, codec, shape[0], shape[1], wire, shape[2])
        if got_dec[0] == "ok":
            got_dec = ("ok", _bits(got_dec[1]))
        dec = case["decode"]
        want_dec = ("ok", dec["f32_bits"]) if dec["ok"] else _expected_error(dec)
        if got_dec != want_dec:
            problems.append(f"decode {got_dec} != {want_dec}")
        elif dec["ok"]:
            in_bits = case["input_f32_bits"]
            assert (got_dec[1] == in_bits) == dec["bit_exact_roundtrip"]
    return problems


def _check_decode_case(codec_impl, case):
    shape = (case["token_count"], case["width"], case["state_flags"])
    got = _outcome(codec_impl.decode_activation, case["codec_id"], shape[0], shape[1], bytes.fromhex(case["wire_hex"]), shape[2])
    if got[0] == "ok":
        got = ("ok", _bits(got[1]))
    dec = case["decode"]
    want = ("ok", dec["f32_bits"]) if dec["ok"] else _expected_error(dec)
    return [] if got == want else [f"decode {got} != {want}"]


def _check_select_case(codec_impl, case):
    shape = (case["token_count"], case["width"], case["state_flags"])
    permitted = [int(ActivationCodec.from_rust_name(n)) for n in case["permitted"]]
    payload = bytes.fromhex(case["input_hex"])
    res = case["result"]
    want = ("ok", res["codec_id"]) if res["ok"] else _expected_error(res)
    problems = []
    got = _outcome(codec_impl.select_lossless_codec, shape[0], shape[1], payload, shape[2], permitted)
    if got != want:
        problems.append(f"select {got} != {want}")
    # The fused entry point must agree with select-then-encode.
    got = _outcome(codec_impl.select_and_encode_lossless, shape[0], shape[1], payload, shape[2], permitted)
    if res["ok"]:
        want_pair = ("ok", (res["codec_id"], codec_impl.encode_activation(res["codec_id"], shape[0], shape[1], payload, shape[2])))
        if got != want_pair:
            problems.append(f"select_and_encode {got!r:.200} != {want_pair!r:.200}")
    elif got != want:
        problems.append(f"select_and_encode {got} != {want}")
    return problems


@pytest.mark.parametrize(
    "group,checker",
    [("activation", _check_activation_case), ("activation_decode", _check_decode_case), ("select", _check_select_case)],
)
def test_golden_vectors(codec_impl, vectors_dir, group, checker):
    """Every public case of the group, reported together with the case ids that fail."""
    failures = []
    for case in _load(vectors_dir, group):
        problems = checker(codec_impl, case)
        if problems:
            failures.append(f"{case['id']} ({case['note']}): " + "; ".join(problems))
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:30])


def test_public_api_matches_vectors(vectors_dir):
    """The validating public module gives the same answers as the kernels."""
    from skippy_wire.wire import codec as api

    for case in _load(vectors_dir, "select"):
        permitted = [ActivationCodec.from_rust_name(n) for n in case["permitted"]]
        got = _outcome(api.select_lossless_codec, case["token_count"], case["width"], bytes.fromhex(case["input_hex"]), case["state_flags"], permitted)
        res = case["result"]
        want = ("ok", ActivationCodec(res["codec_id"])) if res["ok"] else _expected_error(res)
        assert got == want, case["id"]
