"""Every vendored v16 and v17 vector (tests/golden/v16, tests/golden/v17) on both
implementations, plus checks that the runner itself rejects a wrong answer (a broken
implementation fails these tests)."""

from __future__ import annotations

import io

import pytest

from conftest import GOLDEN
from skippy_wire.errors import Mismatch
from skippy_wire.tools.conformance_gen import message_from_case, message_to_case_gen, runner_for
from skippy_wire.wire.agreement import ActivationAgreement
from skippy_wire.wire.protocol import WireProtocol
from vector_helpers import failing_cases, load_cases

VERSIONS = (16, 17)
GROUPS = {
    16: ["activation_frame.jsonl", "activation_frame_decode.jsonl", "frame.jsonl", "frame_select.jsonl",
         "malformed.jsonl", "ready.jsonl"],
    17: ["activation_frame.jsonl", "activation_frame_decode.jsonl", "agreed_activation.jsonl",
         "agreed_activation_decode.jsonl", "agreement.jsonl", "frame.jsonl", "frame_select.jsonl",
         "malformed.jsonl", "setup_client.jsonl", "setup_server.jsonl"],
}


def _files(version):
    return sorted(p.name for p in (GOLDEN / f"v{version}").glob("*.jsonl"))


def _cases(version, name):
    return load_cases(GOLDEN / f"v{version}", name)


def _agreement(version, case):
    """The case's activation agreement; only v17 negotiates one."""
    return ActivationAgreement.from_json(case["agreement"]) if version == 17 else None


def _written_with_activation(version):
    return [c for c in _cases(version, "frame.jsonl") if c["write"]["ok"] and c["message"]["activation_hex"]]


@pytest.mark.parametrize("version", VERSIONS)
def test_every_group_is_vendored(version):
    assert _files(version) == GROUPS[version]


@pytest.mark.parametrize("version,name", [(v, name) for v in VERSIONS for name in _files(v)])
def test_vectors(impl, version, name):
    cases = _cases(version, name)
    assert cases

    def run(case):
        runner = runner_for(case, impl)
        assert runner is not None and runner.version == version
        runner.run(case)

    failures = failing_cases(cases, run)
    assert not failures, "\n".join(failures[:10])


@pytest.mark.parametrize("version", VERSIONS)
def test_runner_detects_a_wrong_expectation(impl, version):
    case = _cases(version, "activation_frame.jsonl")[0]
    case["encode"]["hex"] = case["encode"]["hex"][:-2] + "ff"
    with pytest.raises(Mismatch):
        runner_for(case, impl).run(case)


@pytest.mark.parametrize("version", VERSIONS)
def test_stream_reader_stops_at_the_message_end(impl, version):
    """Reading a message from a stream consumes exactly the message."""
    protocol = WireProtocol(version, impl=impl)
    for case in _written_with_activation(version)[:20]:
        data = bytes.fromhex(case["write"]["hex"])
        stream = io.BytesIO(data + b"\x99\x98")
        msg = protocol.read(stream, agreement=_agreement(version, case))
        assert stream.read() == b"\x99\x98"
        want = case["reads"][2]  # plain read_stage_message
        assert message_to_case_gen(msg) == want["message"]


@pytest.mark.parametrize("version", VERSIONS)
def test_writer_round_trip_matches_vector(impl, version):
    case = _written_with_activation(version)[0]
    written = WireProtocol(version, impl=impl).write(message_from_case(case["message"]), _agreement(version, case))
    assert written.hex() == case["write"]["hex"]
