"""Every vendored v16 vector (tests/golden/v16) on both implementations, plus checks that
the runner itself rejects a wrong answer (a broken implementation fails these tests)."""

from __future__ import annotations

import io
import json

import pytest

from conftest import GOLDEN
from skippy_wire.errors import Mismatch
from skippy_wire.tools.conformance_gen import message_from_case, message_to_case_gen, runner_for
from skippy_wire.wire.protocol import WireProtocol

V16 = GOLDEN / "v16"
FILES = sorted(p.name for p in V16.glob("*.jsonl"))


def _cases(name):
    with open(V16 / name, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def test_every_group_is_vendored():
    assert FILES == ["activation_frame.jsonl", "activation_frame_decode.jsonl", "frame.jsonl", "frame_select.jsonl",
                     "malformed.jsonl", "ready.jsonl"]


@pytest.mark.parametrize("name", FILES)
def test_vectors(impl, name):
    cases = _cases(name)
    assert cases
    failures = []
    for case in cases:
        runner = runner_for(case, impl)
        assert runner is not None and runner.version == 16
        try:
            runner.run(case)
        except Mismatch as exc:
            failures.append(f"{case['id']}: {exc}")
    assert not failures, "\n".join(failures[:10])


def test_runner_detects_a_wrong_expectation(impl):
    case = _cases("activation_frame.jsonl")[0]
    case["encode"]["hex"] = case["encode"]["hex"][:-2] + "ff"
    with pytest.raises(Mismatch):
        runner_for(case, impl).run(case)


def test_stream_reader_stops_at_the_message_end(impl):
    """Reading a v16 message from a stream consumes exactly the message."""
    ok = [c for c in _cases("frame.jsonl") if c["write"]["ok"] and c["message"]["activation_hex"]]
    protocol = WireProtocol(16, impl=impl)
    for case in ok[:20]:
        data = bytes.fromhex(case["write"]["hex"])
        stream = io.BytesIO(data + b"\x99\x98")
        msg = protocol.read(stream)
        assert stream.read() == b"\x99\x98"
        want = case["reads"][2]  # plain read_stage_message
        assert message_to_case_gen(msg) == want["message"]


def test_writer_round_trip_matches_vector(impl):
    case = next(c for c in _cases("frame.jsonl") if c["write"]["ok"] and c["message"]["activation_hex"])
    assert WireProtocol(16, impl=impl).write(message_from_case(case["message"])).hex() == case["write"]["hex"]
