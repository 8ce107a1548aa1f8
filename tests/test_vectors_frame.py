"""Golden vectors of the framing groups (tests/golden/v15: frame, malformed) on every
implementation, through the buffer reader, the stream reader and the streaming decoder."""

from __future__ import annotations

import io

import pytest

from skippy_wire.wire import frame
from skippy_wire.tools.conformance import Runner
from skippy_wire.tools.vector_cases import message_from_case, message_to_case, read_expectation
from skippy_wire.errors import WireError
from vector_helpers import failing_cases, group_fixture, load_cases as _load, outcome as _outcome

frame_cases = group_fixture("frame", "frame_cases")
malformed_cases = group_fixture("malformed", "malformed_cases")


def test_vector_files_are_present(frame_cases, malformed_cases):
    assert len(frame_cases) >= 380 and len(malformed_cases) >= 1500
    # the groups exercise what the README promises: failed writes, failed reads, all kinds
    assert any(not c["write"]["ok"] for c in frame_cases)
    assert any(not r["ok"] for c in frame_cases for r in c["reads"])
    assert len({c["message"]["kind"] for c in frame_cases}) == 19


@pytest.mark.parametrize("group", ["frame", "malformed"])
def test_golden_vectors(impl, vectors_dir, group):
    """Every public case: written bytes/len/estimate or error+partial output, and each
    recorded read (consumed count, decoded fields, or error kind and text)."""
    failures = failing_cases(_load(vectors_dir, group), Runner(impl).run, with_note=True)
    assert not failures, f"{len(failures)} failing cases:\n" + "\n".join(failures[:20])


def _readable(case):
    """(data, read) pairs of a frame or malformed case."""
    if case["group"] == "frame":
        if not case["write"]["ok"]:
            return []
        data = bytes.fromhex(case["write"]["hex"])
    else:
        data = bytes.fromhex(case["bytes_hex"])
    return [(data, read) for read in case["reads"]]


def test_stream_reader_matches_buffer_reader(impl, frame_cases, malformed_cases):
    """Reading from a binary stream gives the same message or error as the buffer reader,
    and leaves the stream exactly after the message (the next message stays unread)."""
    for case in frame_cases + malformed_cases:
        for data, read in _readable(case):
            codec, policy = read_expectation(read)
            # a successful read must leave the following bytes unread
            stream = io.BytesIO(data + b"NEXT" if read["ok"] else data)
            got = _outcome(frame.read_stage_message, stream, read["n_embd"], codec, policy, impl=impl)
            if read["ok"]:
                assert got[0] == "ok", (case["id"], got)
                assert message_to_case(got[1]) == read["message"], case["id"]
                assert stream.tell() == read["consumed"], case["id"]
            else:
                assert got[0] == "err" and got[2] == read["error"]["message"], (case["id"], got)
                assert got[1] == read["error"]["kind"], case["id"]


def test_streaming_decoder_matches_buffer_reader(impl, frame_cases):
    """Each written frame fed to the incremental decoder in 7-byte chunks, twice in a
    row, yields the recorded message twice (errors: the recorded error)."""
    for case in frame_cases:
        for data, read in _readable(case):
            codec, policy = read_expectation(read)
            if read["ok"] and read["consumed"] != len(data):
                continue  # trailing bytes (Stop with payload) would start a bogus second message
            decoder = frame.StageMessageDecoder(read["n_embd"], codec, policy, impl=impl)
            stream = data + data
            got, error = [], None
            try:
                for i in range(0, len(stream), 7):
                    got += decoder.feed(stream[i : i + 7])
                decoder.close()
            except WireError as exc:
                error = exc
            if read["ok"]:
                assert error is None, (case["id"], error)
                assert [message_to_case(m) for m in got] == [read["message"]] * 2, case["id"]
            else:
                assert got == [] and str(error) == read["error"]["message"], (case["id"], error)


def test_written_messages_round_trip_through_public_api(impl, frame_cases):
    """write_stage_message_to + read back: the public stream API agrees with the vectors."""
    for case in frame_cases:
        if not case["write"]["ok"]:
            continue
        msg = message_from_case(case["message"])
        out = io.BytesIO()
        assert frame.write_stage_message_to(out, msg, impl=impl) == case["write"]["len"]
        assert out.getvalue().hex() == case["write"]["hex"], case["id"]
