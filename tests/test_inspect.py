"""The capture dissector (``skippy-wire inspect``)."""

from __future__ import annotations

import io
import struct

import pytest

from skippy_wire.wire.constants import ActivationCodec
from skippy_wire.tools.inspect import DissectError, dissect, infer_n_embd, iter_records, main


def _messages():
    from skippy_wire.wire.codec import encode_activation as encode
    from skippy_wire.wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind as K

    values = struct.pack("<6f", 1.0, -2.5, 0.5, 3.0, 0.25, -1.0)
    cfg = StageWireMessage.configure_generation(7, 11, 3, SamplingConfig(flags=1, seed=42, top_k=40), '{"a": 1}')
    state = StageStateHeader.new(K.PREFILL_FINAL_EMBD)
    state.source_stage_index = 0
    state.activation_codec = ActivationCodec.BF16_RNE_V1
    prefill = StageWireMessage(K.PREFILL_FINAL_EMBD, 0, 2, state, 7, 11, None, None, [5, 6], [],
                               encode(ActivationCodec.BF16_RNE_V1, 2, 3, values, 0))
    return [cfg, prefill, StageWireMessage.stop(7, 11)]


def _stream(messages) -> bytes:
    from skippy_wire.wire.frame import write_stage_message

    return b"".join(write_stage_message(m) for m in messages)


def test_messages_are_dissected_with_every_field():
    out = io.StringIO()
    assert dissect(_stream(_messages()), out=out) == 3
    text = out.getvalue()
    assert "#0 @0 message" in text and "CONFIGURE_GENERATION (14)" in text
    assert "seed 42" in text and "top_k 40" in text and "chat_sampling_metadata (8 bytes)" in text
    assert "PREFILL_FINAL_EMBD (4)" in text and "flags 0x1 [FINAL_CHUNK]" in text
    assert "activation: bf16-rne-v1, 12 bytes on the wire, decoded 24 bytes = 2 rows x 3 (n_embd)" in text
    assert "values: [1, -2.5, 0.5, 3, 0.25, -1]" in text
    assert "tokens: [5, 6]" in text
    assert "STOP (3)" in text and "request_id 7  session_id 11" in text


def test_n_embd_is_inferred_from_the_prefix():
    data = _stream(_messages()[1:2])
    assert infer_n_embd(data[:80]) == 3
    assert infer_n_embd(_stream(_messages()[:1])[:80]) is None
    [(offset, msg, size, width)] = list(iter_records(data, replies=False))
    assert (offset, size, width) == (0, len(data), 3) and len(bytes(msg.activation)) == 24


def test_replies_are_detected_by_the_ready_magic():
    from skippy_wire.wire.frame import send_reply_ack, send_reply_predicted
    from skippy_wire.wire.replies import StageReplyStats

    buf = io.BytesIO()
    buf.write(b"\x59\x44\x52\x53")
    send_reply_ack(buf)
    stats = StageReplyStats()
    stats.observe_prefill_compute(1, 1500, 8)
    send_reply_predicted(buf, 42, stats)
    out = io.StringIO()
    assert dissect(buf.getvalue(), out=out) == 3
    text = out.getvalue()
    assert "READY" in text and "ACK (1)" in text and "PREDICTED_TOKEN (2)" in text
    assert "predicted 42" in text and "prefill_compute_us_at_slowest_rate 1500" in text
    assert "all 27 fields zero" in text


def test_truncated_stream_reports_offset():
    data = _stream(_messages())
    with pytest.raises(DissectError, match=r"#1 @\d+: UnexpectedEof"):
        dissect(data[:-90], out=io.StringIO())


def test_cli_reads_files_and_exits_1_on_garbage(tmp_path, capsys):
    good = tmp_path / "hop1-messages.bin"
    good.write_bytes(_stream(_messages()))
    assert main([str(good)]) == 0
    assert "3 records" in capsys.readouterr().out
    bad = tmp_path / "bad.bin"
    bad.write_bytes(b"\x0c\x00\x00\x00" + b"\x00" * 100)
    assert main([str(bad)]) == 1
    assert "unknown stage message kind" in capsys.readouterr().err
    assert main([str(tmp_path / "missing.bin")]) == 1


def test_capture_of_a_running_chain_can_be_inspected(tmp_path):
    from test_server import PROMPT, Chain

    from skippy_wire.net.driver import PipelineClient

    chain = Chain([(0, 3), (3, 6)], "bf16-rne-v1", "fixed", capture=str(tmp_path))
    try:
        with PipelineClient(*chain.entry, timeout=10, capture=tmp_path / "hop0") as client:
            client.generate(PROMPT, max_tokens=4, chunk_size=4)
    finally:
        chain.close()
    for name in ("hop0-messages.bin", "hop0-replies.bin", "hop1-messages.bin", "hop1-replies.bin"):
        out = io.StringIO()
        assert dissect((tmp_path / name).read_bytes(), name=name, out=out) > 0, name
    hop1 = list(iter_records((tmp_path / "hop1-messages.bin").read_bytes(), replies=False))
    kinds = [int(m.kind) for _, m, _, _ in hop1]
    assert kinds == [14, 1, 4, 2, 2, 2, 3]
    assert all(int(m.state.activation_codec) == 3 for _, m, _, _ in hop1 if int(m.kind) in (1, 2, 4))


def test_cli_reads_stdin(monkeypatch, capsys):
    import sys

    class Stdin:
        buffer = io.BytesIO(_stream(_messages()))

    monkeypatch.setattr(sys, "stdin", Stdin)
    assert main(["-", "--messages", "--values"]) == 0
    out = capsys.readouterr().out
    assert "values: [1, -2.5, 0.5, 3, 0.25, -1]" in out and "3 records" in out
