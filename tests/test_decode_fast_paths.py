"""The per-token byte paths of a decode step (wire/frame.py): the terminal stage's
PredictedToken reply and the driver's DecodeEmbd are patched templates, so they must be
byte for byte what the general writers produce; and replies read by the compiled reader
are whole, independent objects although no dataclass __init__ runs for them."""

from __future__ import annotations

import io
import random
import socket

import pytest

from skippy_wire.errors import InvalidInputError
from skippy_wire.net.driver import decode_message
from skippy_wire.net.protocol_io import LinkProtocol
from skippy_wire.net.transport import Peer
from skippy_wire.wire import frame
from skippy_wire.wire.constants import I32_MAX, I32_MIN
from skippy_wire.wire.messages import SamplingConfig
from skippy_wire.wire.replies import STATS_FIELDS, StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

TOKENS = [0, 1, -1, 42, 49151, I32_MAX, I32_MIN]


@pytest.mark.parametrize("token", TOKENS)
def test_predicted_reply_bytes_equal_the_writer(token):
    buf = io.BytesIO()
    frame.send_reply_predicted(buf, token)
    assert frame.predicted_reply_bytes(token) == buf.getvalue()


@pytest.mark.parametrize("token", [I32_MAX + 1, I32_MIN - 1])
def test_predicted_reply_bytes_refuse_what_the_writer_refuses(token):
    with pytest.raises(InvalidInputError):
        frame.predicted_reply_bytes(token)


@pytest.fixture
def peer():
    a, b = socket.socketpair()
    yield Peer(a)
    a.close()
    b.close()


@pytest.mark.parametrize("version", [15, 16, 17])
def test_decode_step_writer_equals_encoding_every_message(peer, version):
    link = LinkProtocol(version, peer, who="test")
    rng = random.Random(version)
    prompt_len, request_id, session_id = 37, 2**40 + 3, 7
    steps = frame.DecodeStepWriter(link.encode(decode_message(5, prompt_len, 0, prompt_len, request_id, session_id)))
    for step in range(200):
        token = rng.choice(TOKENS + [rng.randrange(I32_MIN, I32_MAX)])
        pos = prompt_len + step if step < 150 else rng.randrange(0, I32_MAX)
        expected = link.encode(decode_message(token, pos, step, prompt_len, request_id, session_id))
        assert steps.message(token, pos, step) == expected


def test_decode_step_writer_refuses_other_messages(peer):
    link = LinkProtocol(15, peer, who="test")
    with_sampling = decode_message(5, 10, 0, 10, 1, 1, sampling=SamplingConfig(temperature=0.5))
    two_tokens = decode_message(5, 10, 0, 10, 1, 1)
    two_tokens.tokens = [5, 6]
    two_tokens.token_count = 2
    for msg in (with_sampling, two_tokens):
        with pytest.raises(ValueError, match="one token and nothing else"):
            frame.DecodeStepWriter(link.encode(msg))


def test_read_replies_are_whole_and_independent(impl):
    stats = StageReplyStats(*range(1, len(STATS_FIELDS) + 1))
    written = frame.write_reply(StageReply(WireReplyKind.PREDICTED_TOKENS, 9, [9, 10], StageReplyWindow(4), None, stats))
    first, used = frame.read_reply_from_buffer(written, impl=impl)
    second, _ = frame.read_reply_from_buffer(written, impl=impl)
    assert used == len(written)
    assert type(first) is StageReply and type(first.stats) is StageReplyStats
    assert type(first.window) is StageReplyWindow and first.window.window_id == 4
    assert first.stats.as_tuple() == stats.as_tuple() and first == second
    first.stats.merge(StageReplyStats(kv_lookup_hits=100))  # a relay merges the Acks it owes
    first.predicted_tokens.append(11)
    assert second.stats.kv_lookup_hits == 1 and second.predicted_tokens == [9, 10]
    assert first.stats.kv_lookup_hits == 101
    assert frame.write_reply(second) == written
