"""Replies (wire-format.md 11.2) and their statistics (11.3): the upstream reply tests of
binary/mod.rs (14.1 items 2-9) on every implementation, plus reader limits."""

from __future__ import annotations

import io
import struct

import numpy as np
import pytest

from skippy_wire.wire import frame
from skippy_wire.errors import InvalidDataError, InvalidInputError, UnexpectedEofError
from skippy_wire.wire.replies import (
    NativeMtpDraft,
    StageReply,
    StageReplyStats,
    StageReplyWindow,
    WireReplyKind,
)


def sent(impl, fn, *args) -> bytes:
    buf = io.BytesIO()
    fn(buf, *args, impl=impl)
    return buf.getvalue()


def recv(impl, data: bytes) -> StageReply:
    stream = io.BytesIO(data + b"tail")
    reply = frame.read_reply(stream, impl=impl)
    assert stream.read() == b"tail"  # exactly one reply consumed
    again, consumed = frame.read_reply_from_buffer(data, impl=impl)
    assert again == reply and consumed == len(data)
    return reply


def test_reply_round_trips_and_golden_bytes(impl):
    data = sent(impl, frame.send_reply_predicted, 42)
    assert len(data) == 240
    assert data.hex().startswith("020000002a000000010000002a0000000000000000000000") and data[24:] == bytes(216)
    reply = recv(impl, data)
    assert (reply.kind, reply.predicted, reply.predicted_tokens, reply.native_mtp_draft) == (
        WireReplyKind.PREDICTED_TOKEN, 42, [42], None)
    ack = sent(impl, frame.send_reply_ack)
    assert len(ack) == 236 and recv(impl, ack) == StageReply()


def test_reply_round_trips_typed_native_mtp_draft(impl):
    reply = StageReply(WireReplyKind.PREDICTED_TOKEN, 42, [42], StageReplyWindow(), NativeMtpDraft([43, 44], 12345))
    data = frame.write_reply(reply, impl=impl)
    assert len(data) == 240 + 4 + 8 + 8
    assert recv(impl, data) == reply


def test_predicted_token_reply_preserves_sideband_tokens(impl):
    reply = recv(impl, sent(impl, frame.send_reply_predicted_with_tokens_and_stats, 42, [42, 43, 123]))
    assert (reply.kind, reply.predicted, reply.predicted_tokens) == (WireReplyKind.PREDICTED_TOKEN, 42, [42, 43, 123])


def test_reply_stats_preserve_prefill_edge_transport(impl):
    stats = StageReplyStats()
    stats.observe_prefill_edge_transport(2, 12000, 3000, 1048576)
    stats.observe_prefill_edge_transport(1, 4000, 40000, 524288)
    stats.observe_prefill_compute(2, 18000, 128)
    stats.observe_prefill_compute(1, 42000, 128)
    stats.observe_prefill_compute(3, 25000, 64)
    got = recv(impl, sent(impl, frame.send_reply_predicted_with_stats, 42, stats)).stats
    assert (got.prefill_edge_write_us_max, got.prefill_edge_wait_us_max, got.prefill_edge_total_us_max) == (12000, 40000, 44000)
    assert (got.prefill_edge_stage_index, got.prefill_edge_activation_bytes_max, got.prefill_edge_observation_count) == (1, 524288, 2)
    assert (got.prefill_compute_us_at_slowest_rate, got.prefill_compute_stage_index,
            got.prefill_compute_token_count_at_slowest_rate, got.prefill_compute_observation_count) == (42000, 1, 128, 3)
    assert got == stats


def test_prefill_compute_calibration_ignores_short_tail_overhead():
    stats = StageReplyStats()
    stats.observe_prefill_compute(1, 48000, 128)
    stats.observe_prefill_compute(1, 30000, 9)
    assert (stats.prefill_compute_us_at_slowest_rate, stats.prefill_compute_stage_index,
            stats.prefill_compute_token_count_at_slowest_rate, stats.prefill_compute_observation_count) == (48000, 1, 128, 2)


def test_stats_observe_clamps_and_ignores_non_positive_compute():
    stats = StageReplyStats()
    stats.observe_prefill_edge_transport(3, -5, -7, 2**70)
    assert (stats.prefill_edge_write_us_max, stats.prefill_edge_total_us_max, stats.prefill_edge_observation_count) == (0, 0, 1)
    stats.observe_prefill_compute(4, 0, 10)  # zero compute never wins
    stats.observe_prefill_compute(5, 100, 0)  # token count clamps to 1
    assert (stats.prefill_compute_us_at_slowest_rate, stats.prefill_compute_token_count_at_slowest_rate) == (100, 1)
    stats.observe_prefill_compute(6, 150, 1)  # same chunk size, slower rate wins
    assert stats.prefill_compute_stage_index == 6 and stats.prefill_compute_observation_count == 3


def test_stats_merge_and_is_empty():
    a, b = StageReplyStats(), StageReplyStats()
    assert a.is_empty()
    a.kv_lookup_hits, a.kv_hit_stage_mask, a.verify_window_max_tokens = 2, 0b01, 4
    b.kv_lookup_hits, b.kv_hit_stage_mask, b.verify_window_max_tokens = 3, 0b10, 3
    b.observe_prefill_edge_transport(7, 10, 20, 99)
    b.observe_prefill_compute(8, 500, 64)
    a.observe_prefill_compute(9, 100, 32)
    a.merge(b)
    assert (a.kv_lookup_hits, a.kv_hit_stage_mask, a.verify_window_max_tokens) == (5, 0b11, 4)
    assert (a.prefill_edge_total_us_max, a.prefill_edge_stage_index, a.prefill_edge_observation_count) == (30, 7, 1)
    assert (a.prefill_compute_stage_index, a.prefill_compute_observation_count) == (8, 2)  # larger chunk wins
    assert not a.is_empty()
    c = StageReplyStats(prefill_edge_write_us_max=5)  # maxima alone do not make stats non-empty
    assert c.is_empty()
    a.kv_lookup_hits = 2**63 - 1
    a.merge(a)  # saturating i64 sums
    assert a.kv_lookup_hits == 2**63 - 1


def test_token_vector_reply_round_trips(impl):
    reply = recv(impl, sent(impl, frame.send_reply_predicted_tokens_with_stats, [1, 2, 3]))
    assert (reply.kind, reply.predicted, reply.predicted_tokens) == (WireReplyKind.PREDICTED_TOKENS, 1, [1, 2, 3])
    empty = recv(impl, sent(impl, frame.send_reply_predicted_tokens_with_stats, []))
    assert (empty.predicted, empty.predicted_tokens) == (0, [])


@pytest.mark.parametrize("first", [2**40, -(2**31) - 1, True, "7"])
def test_a_token_vector_reply_names_a_first_token_it_cannot_carry_as_one_of_its_tokens(impl, first):
    # (its ``predicted`` field is the first token, a field the caller never passed)
    for send in (frame.send_reply_predicted_tokens_with_stats, frame.send_reply_predicted_tokens_with_window_and_stats):
        extra = (StageReplyWindow(),) if send is frame.send_reply_predicted_tokens_with_window_and_stats else ()
        with pytest.raises(InvalidInputError, match=r"^predicted_tokens value .* does not fit its wire type$"):
            send(io.BytesIO(), [first, 2], *extra, impl=impl)
    reply = recv(impl, sent(impl, frame.send_reply_predicted_tokens_with_stats, [np.int32(7), 3]))
    assert (reply.predicted, reply.predicted_tokens) == (7, [7, 3])


def test_reply_window_metadata_round_trips(impl):
    reply = recv(impl, sent(impl, frame.send_reply_predicted_tokens_with_window_and_stats, [1, 2, 3], StageReplyWindow(42)))
    assert (reply.kind, reply.predicted_tokens, reply.window.window_id) == (WireReplyKind.PREDICTED_TOKENS, [1, 2, 3], 42)
    reply = recv(impl, sent(impl, frame.send_reply_predicted_with_tokens_window_and_stats, 5, [5, 6], StageReplyWindow(9)))
    assert (reply.kind, reply.predicted, reply.window.window_id) == (WireReplyKind.PREDICTED_TOKEN, 5, 9)


@pytest.mark.parametrize("data,text", [
    (struct.pack("<3i", 3, 1, 262145), "predicted token count exceeds maximum"),
    (struct.pack("<3i", 3, 1, -1), "negative predicted token count"),
    (struct.pack("<3i", 4, 1, 0), "unknown stage reply kind"),
    (struct.pack("<3i", 0, 1, 0), "unknown stage reply kind"),
    (struct.pack("<5i", 1, 0, 0, 0, 2), "unknown native MTP draft reply marker"),
    (struct.pack("<6i", 1, 0, 0, 0, 1, -1), "negative native MTP draft token count"),
    (struct.pack("<6i", 1, 0, 0, 0, 1, 262145), "native MTP draft token count exceeds maximum"),
])
def test_reply_reader_rejects_bad_counts_and_markers(impl, data, text):
    with pytest.raises(InvalidDataError) as info:
        frame.read_reply(data, impl=impl)
    assert str(info.value) == text
    with pytest.raises(InvalidDataError):
        frame.read_reply(io.BytesIO(data), impl=impl)


def test_reply_reader_at_limit_waits_for_tokens(impl):
    with pytest.raises(UnexpectedEofError) as info:
        frame.read_reply(struct.pack("<3i", 3, 1, 262144), impl=impl)
    assert info.value.needed == 12 + 4 * 262144


def test_truncated_replies_are_eof_at_every_offset(impl):
    data = frame.write_reply(StageReply(WireReplyKind.PREDICTED_TOKEN, 1, [1, 2], StageReplyWindow(3),
                                        NativeMtpDraft([4], 5), StageReplyStats(kv_lookup_hits=-6)), impl=impl)
    for cut in range(len(data)):
        with pytest.raises(UnexpectedEofError):
            frame.read_reply(data[:cut], impl=impl)
    assert frame.read_reply(data, impl=impl).stats.kv_lookup_hits == -6


def test_reply_writers_reject_too_many_tokens(impl):
    reply = StageReply(WireReplyKind.PREDICTED_TOKENS, 0, [0] * 262145)
    with pytest.raises(InvalidInputError, match="^too many predicted tokens$") as info:
        frame.write_reply(reply, impl=impl)
    assert info.value.partial == b""  # checked before anything is written
    reply = StageReply(WireReplyKind.PREDICTED_TOKEN, 0, [], StageReplyWindow(7), NativeMtpDraft([0] * 262145, 0))
    with pytest.raises(InvalidInputError, match="^too many native MTP draft tokens$") as info:
        frame.write_reply(reply, impl=impl)
    assert info.value.partial == struct.pack("<4i", 2, 0, 0, 7)  # header and window were written


def test_reply_stats_out_of_i64_range_is_invalid_input(impl):
    with pytest.raises(InvalidInputError, match="stats.kv_lookup_misses"):
        frame.write_reply(StageReply(stats=StageReplyStats(kv_lookup_misses=2**63)), impl=impl)
