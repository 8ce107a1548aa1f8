"""The API's GenerationEngine when the pipeline fails: a stage 0 that never answers READY
counts as a failure like one that fails mid-request (the next request probes quickly
instead of waiting the whole timeout again), and an operator reads each failure and the
recovery in the log.  Fake stages in process (test_server's Chain), no model."""

from __future__ import annotations

import logging
import socket
import threading
import time

import pytest
from test_http_front import FakeTokenizer
from test_server import Chain, FakeBackend, fake_reference

from skippy_wire.errors import PipelineError
from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.service import GenerationEngine, PipelineUnavailable, SamplingParams
from skippy_wire.wire.constants import READY_BYTES
from skippy_wire.wire.frame import write_reply
from skippy_wire.wire.replies import StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

TIMEOUT_S = 1.0


class ByteTokenizer(FakeTokenizer):
    def decode(self, ids, special: bool = True) -> str:
        return bytes(i % 128 for i in ids).decode()


def _generate(engine: GenerationEngine):
    return engine.generate([1, 2, 3], max_tokens=2, sampling=SamplingParams(temperature=0.0), stop=[],
                           on_text=lambda text, tokens: None, cancelled=threading.Event())


def test_a_stage_0_that_never_answers_ready_is_probed_not_waited_for_again(caplog):
    silent = socket.create_server(("127.0.0.1", 0))  # accepts, never answers READY
    engine = GenerationEngine(silent.getsockname()[:2], FakeTokenizer(), ctx_size=64, timeout=TIMEOUT_S,
                              chunk_size=4)
    try:
        with caplog.at_level(logging.WARNING, logger="skippy_wire.net.service"):
            with pytest.raises(PipelineError) as first:
                _generate(engine)
            assert not isinstance(first.value, PipelineUnavailable)
            assert engine.failing and engine.counters["failed"] == 1 == engine.counters["requests"]
            assert [r.getMessage() for r in caplog.records] == [f"a request failed in the pipeline: {first.value}"]
            # the next request probes (the same silence), and is refused as unavailable
            with pytest.raises(PipelineUnavailable):
                _generate(engine)
            assert engine.counters["failed"] == 2 and len(caplog.records) == 1  # one line per state change
    finally:
        engine.close()
        silent.close()


def test_the_log_says_when_the_pipeline_answers_again(caplog):
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
    try:
        with caplog.at_level(logging.WARNING, logger="skippy_wire.net.service"):
            engine.failing = True  # as after a failed request
            started = time.monotonic()
            assert _generate(engine).completion_tokens >= 1
            assert time.monotonic() - started < TIMEOUT_S * 5
            assert not engine.failing
            assert [r.getMessage() for r in caplog.records] == ["the pipeline answers again"]
            _generate(engine)
            assert len(caplog.records) == 1  # no line while it keeps answering
    finally:
        engine.close()
        chain.close()


def test_a_new_connections_ready_is_awaited_for_the_probes_bound_not_the_whole_timeout(monkeypatch):
    # A request waited the engine's timeout (60 s by default) for a READY that a working chain
    # sends in milliseconds; the replies after it keep the whole timeout.
    from skippy_wire.net import service

    monkeypatch.setattr(service, "READY_TIMEOUT_S", 0.3)
    silent = socket.create_server(("127.0.0.1", 0))
    engine = GenerationEngine(silent.getsockname()[:2], FakeTokenizer(), ctx_size=64, timeout=30.0, chunk_size=4)
    try:
        started = time.monotonic()
        with pytest.raises(PipelineError, match="within 0.3 s"):
            _generate(engine)
        assert time.monotonic() - started < 5
    finally:
        engine.close()
        silent.close()


def test_a_generation_cut_off_by_the_engine_s_close_is_no_pipeline_failure_in_the_log(caplog):
    """At the API's shutdown the stages stop under a stream still running: its failure was
    logged as "a request failed in the pipeline: stage 0 ... exited with status 143"."""
    silent = socket.create_server(("127.0.0.1", 0))  # a stage 0 that has gone quiet
    engine = GenerationEngine(silent.getsockname()[:2], FakeTokenizer(), ctx_size=64, timeout=TIMEOUT_S,
                              chunk_size=4)
    try:
        engine.close()
        with caplog.at_level(logging.WARNING, logger="skippy_wire.net.service"):
            with pytest.raises(PipelineError):
                _generate(engine)
        assert caplog.records == [] and engine.counters["failed"] == 1
    finally:
        silent.close()


def test_the_engine_s_close_cuts_off_a_generation_waiting_on_a_quiet_stage():
    """The API said "stopped" and then waited --timeout on the reply of a stage that had gone
    quiet: its close() closed only the pooled connections, and the read held the process."""
    listener = socket.create_server(("127.0.0.1", 0))
    read = threading.Event()

    def quiet_after_ready():  # READY, then reads the request and answers nothing
        conn, _ = listener.accept()
        with conn:
            conn.sendall(READY_BYTES)
            while conn.recv(65536):
                read.set()

    threading.Thread(target=quiet_after_ready, daemon=True).start()
    engine = GenerationEngine(listener.getsockname()[:2], FakeTokenizer(), ctx_size=64, timeout=60.0, chunk_size=4)
    failed: list = []
    generating = threading.Thread(target=lambda: failed.append(pytest.raises(PipelineError, _generate, engine)))
    try:
        generating.start()
        assert read.wait(10)  # the request is out, its reply awaited
        engine.close()
        generating.join(10)
        assert not generating.is_alive() and failed  # cut off, not waiting the 60 s out
    finally:
        engine.close()
        listener.close()


def test_a_generation_that_takes_its_connection_after_the_engine_s_close_is_cut_off_too():
    """close() cut off the connections in use when it ran: one taken just after it (its
    handshake under way) ran on, and waited out --timeout on a stage gone quiet."""
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
    real_take = engine._take
    engine._take = lambda timeout=None: (real_take(timeout), engine.close())[0]  # close() lands after the take
    try:
        with pytest.raises(PipelineError, match="the API is stopping"):
            _generate(engine)
        assert engine.counters["failed"] == 1 and engine._busy == set()
    finally:
        engine.close()
        chain.close()


def test_a_generation_running_at_the_engine_s_close_leaves_no_connection_open():
    """A connection given back after close() was pooled where nothing would close it again;
    now close() cuts the generation off, and it fails as one cut off (not logged)."""
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
    clients = []
    real_take = engine._take
    engine._take = lambda timeout=None: clients.append(real_take(timeout)) or clients[-1]
    try:
        with pytest.raises(PipelineError):
            engine.generate([1, 2, 3], max_tokens=3, sampling=SamplingParams(temperature=0.0), stop=[],
                            on_text=lambda text, tokens: engine.close(), cancelled=threading.Event())
        assert engine.closed and engine._idle == [] and not clients[0].alive()
    finally:
        engine.close()
        chain.close()


def test_a_stage_0_that_trickles_its_reply_is_bounded_by_the_timeout():
    # READY, then an Ack one byte every 0.2 s: every receive got something within the
    # timeout, so the driver waited for ever; the whole reply now has the timeout
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()
    ack = write_reply(StageReply(WireReplyKind.ACK, 0, [], StageReplyWindow(), None, StageReplyStats()))

    def trickle():
        conn, _ = listener.accept()
        with conn:
            conn.sendall(READY_BYTES)
            for byte in ack:
                if done.wait(0.2):
                    return
                try:
                    conn.sendall(bytes([byte]))
                except OSError:
                    return

    threading.Thread(target=trickle, daemon=True).start()
    try:
        started = time.monotonic()
        with PipelineClient(*listener.getsockname()[:2], timeout=TIMEOUT_S) as client:
            with pytest.raises(PipelineError, match=f"no answer to .* within {TIMEOUT_S:g} s"):
                client.generate([1, 2, 3], max_tokens=2)
        assert time.monotonic() - started < TIMEOUT_S * 4
    finally:
        done.set()
        listener.close()


class StallingOnStop(FakeBackend):
    """A terminal stage that stalls on the session's closing Stop until ``release`` is set:
    every token has been sent when the Stop goes unanswered."""

    def __init__(self, release: threading.Event) -> None:
        super().__init__(3, 6, 1)
        self.release = release

    def free_session(self, session) -> None:
        self.release.wait(10)
        super().free_session(session)


def test_a_whole_text_whose_closing_stop_goes_unanswered_is_kept(caplog):
    """The driver raised over a complete result: the API answered 502 and dropped the text
    when only the Stop after the last token got no answer (a stage stalled just then)."""
    release = threading.Event()
    chain = Chain([(0, 3), (3, 6)], backends=[FakeBackend(0, 3, 0), StallingOnStop(release)])
    try:
        with PipelineClient(*chain.entry, timeout=TIMEOUT_S) as client:
            result = client.generate([1, 2, 3], max_tokens=3, chunk_size=4)
            assert result.tokens == fake_reference([1, 2, 3], 3)
            assert "no answer to Stop" in result.session_end_error and not client.alive()
        release.set()
        release.clear()
        engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
        try:
            with caplog.at_level(logging.WARNING, logger="skippy_wire.net.service"):
                out = _generate(engine)
                assert out.completion_tokens == 2 and out.finish_reason == "length"
                assert engine.failing and not engine._idle  # the connection is not reused
                assert "the session's closing Stop got no answer (its text is complete) (session " in caplog.text
        finally:
            release.set()
            engine.close()
    finally:
        release.set()
        chain.close()


def test_a_caller_s_bad_prompt_is_refused_without_counting_a_failure_or_closing_a_connection():
    """An empty prompt failed in the client's generate: counted as a failed request, its
    pooled connection closed, and the next request probed the pipeline as after a failure."""
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
    try:
        _generate(engine)
        pooled = list(engine._idle)
        with pytest.raises(ValueError, match="^the prompt must have at least one token$"):
            engine.generate([], max_tokens=2, sampling=SamplingParams(temperature=0.0), stop=[],
                            on_text=lambda text, tokens: None, cancelled=threading.Event())
        # a token id past the vocabulary went to stage 0, which closed the link: a pipeline failure
        outside = r"^prompt item 1 is token 256, outside the model's vocabulary \[0, 256\)$"
        with pytest.raises(ValueError, match=outside):
            engine.generate([1, 256], max_tokens=2, sampling=SamplingParams(temperature=0.0), stop=[],
                            on_text=lambda text, tokens: None, cancelled=threading.Event())
        assert engine.counters["failed"] == 0 and not engine.failing
        assert engine._idle == pooled and pooled[0].alive()
    finally:
        engine.close()
        chain.close()


def test_the_engine_s_context_bounds_its_clients_as_the_stages_would():
    """`ctx_size` was not given to the engine's PipelineClients: a generation past it ran on
    (stages holding less failed it, and the engine counted a pipeline failure)."""
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=6, timeout=TIMEOUT_S, chunk_size=4)
    try:
        out = engine.generate([1, 2, 3], max_tokens=20, sampling=SamplingParams(temperature=0.0), stop="",
                              on_text=lambda text, tokens: None, cancelled=threading.Event())
        assert out.finish_reason == "length" and len(out.tokens) == 4  # 6 - 3 + 1 (the last is not fed back)
        assert engine.counters["failed"] == 0
    finally:
        engine.close()
        chain.close()


class RecordingSampling(FakeBackend):
    """A terminal stage that records the sampling each prefill asks it for."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.seen: list = []

    def prefill(self, session, tokens, activation, state_flags, *, sample, sampling):
        self.seen.append(sampling)
        return super().prefill(session, tokens, activation, state_flags, sample=sample, sampling=sampling)


def test_an_engine_generation_without_sampling_or_cancel_event_is_greedy():
    """sampling=None and cancelled=None were AttributeErrors, counted as pipeline failures."""
    terminal = RecordingSampling(3, 6, 1)
    chain = Chain([(0, 3), (3, 6)], backends=[FakeBackend(0, 3, 0), terminal])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
    try:
        out = engine.generate([1, 2, 3], max_tokens=3, sampling=None, stop=[], on_text=lambda text, tokens: None)
        assert out.tokens == fake_reference([1, 2, 3], 3) and engine.counters["failed"] == 0
        # the fake model does not sample: what reached the terminal stage is what greedy asks for
        for asked in (SamplingParams(temperature=0.0), SamplingParams(temperature=0.8)):
            engine.generate([1, 2, 3], max_tokens=1, sampling=asked, stop=[], on_text=lambda text, tokens: None)
        none, greedy, sampled = terminal.seen  # one prefill each
        assert none == greedy != sampled
    finally:
        engine.close()
        chain.close()


def test_a_prompt_too_long_for_the_context_is_the_caller_s_mistake_not_a_failure():
    """Checked once a pooled connection was taken: a ValueError counted as a pipeline failure,
    and the connection closed."""
    chain = Chain([(0, 3), (3, 6)])
    engine = GenerationEngine(chain.entry, ByteTokenizer(), ctx_size=4, timeout=TIMEOUT_S, chunk_size=4)
    try:
        _generate(engine)  # a pooled connection
        with pytest.raises(ValueError, match="^the prompt's 5 tokens do not fit the stages' context of 4 tokens$"):
            engine.generate([1, 2, 3, 4, 5], max_tokens=1, sampling=None, stop=[], on_text=lambda text, tokens: None)
        assert engine.counters["failed"] == 0 and len(engine._idle) == 1
    finally:
        engine.close()
        chain.close()


def test_a_token_outside_the_vocabulary_is_a_failed_pipeline_not_the_tokenizer_s_error():
    """A stage that predicts one (another model's head, a bug) made the text's decoding raise
    ValueError inside the engine: a traceback in the API's log and a stream cut short."""
    chain = Chain([(0, 3), (3, 6)])  # predicts ids up to 96
    tokenizer = ByteTokenizer()
    tokenizer.n_vocab = 4
    engine = GenerationEngine(chain.entry, tokenizer, ctx_size=64, timeout=TIMEOUT_S, chunk_size=4)
    try:
        with pytest.raises(PipelineError, match=r"^the pipeline predicted token \d+, outside the model's vocabulary "
                                                r"\[0, 4\)$"):
            _generate(engine)
        assert engine.counters["failed"] == 1
    finally:
        engine.close()
        chain.close()
