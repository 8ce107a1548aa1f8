"""The stage server with a fake runtime: execution, forwarding, sessions and faults.

Stages run in-process (a listening thread each) on 127.0.0.1 with port 0; the driver side
is :class:`skippy_wire.net.driver.PipelineClient`.  Every wait is bounded.
"""

from __future__ import annotations

import logging
import re
import socket
import struct
import threading
import time
from fractions import Fraction

import numpy as np
import pytest

from skippy_wire.wire.constants import READY_BYTES, ActivationCodec, CodecPolicy
from skippy_wire.errors import PipelineError, StageRuntimeError, Status
from skippy_wire.net.driver import PipelineClient, generate_local
from skippy_wire.net.schedule import prefill_messages
from skippy_wire.net.server import StageServer
from skippy_wire.net.transport import parse_address
from skippy_wire.stage.threads import MAX_THREADS, resolved_threads
from skippy_wire.tools.serve import stage_config
from skippy_wire.wire.frame import predicted_reply_bytes, write_stage_message
from skippy_wire.wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind

N_EMBD = 8
N_LAYER = 6
VOCAB = 97


class FakeSession:
    def __init__(self) -> None:
        self.token_count = 0
        self.history: list[int] = []
        self.freed = False


class FakeBackend:
    """A deterministic stand-in for a stage runtime.

    Source: a token embeds to small multiples of 1/4 (exact in bf16 and f16).  Each owned
    layer adds ``layer + 1`` plus a quarter of the number of tokens seen before.  The
    terminal stage predicts ``(sum of the last row + len(history)) mod VOCAB``.
    """

    def __init__(self, layer_start: int, layer_end: int, stage_index: int = 0, *, scale: float = 0.25) -> None:
        self.layer_start, self.layer_end, self.stage_index = layer_start, layer_end, stage_index
        self.n_embd = N_EMBD
        self.is_source = layer_start == 0
        self.is_terminal = layer_end == N_LAYER
        self.scale = scale
        self.sessions: list[FakeSession] = []

    def create_session(self) -> FakeSession:
        session = FakeSession()
        self.sessions.append(session)
        return session

    def free_session(self, session: FakeSession) -> None:
        session.freed = True

    def trim(self, session: FakeSession, n: int) -> None:
        if not 0 <= n <= session.token_count:  # as the runtime: a trim never grows a session
            raise ValueError("cannot trim session beyond current token count")
        session.token_count = n
        del session.history[n:]

    def _run(self, session, tokens, activation):
        if self.is_source:
            rows = np.array([[(t % 16) * self.scale + j * 0.25 for j in range(N_EMBD)] for t in tokens], np.float32)
        else:
            payload = getattr(activation, "payload", activation)  # v16/v17: the runtime input frame
            rows = np.frombuffer(bytes(payload), np.float32).reshape(len(tokens), N_EMBD).copy()
        for layer in range(self.layer_start, self.layer_end):
            rows += np.float32(layer + 1 + 0.25 * session.token_count)
        session.token_count += len(tokens)
        session.history.extend(tokens)
        if self.is_terminal:
            return int(rows[-1].sum() + len(session.history)) % VOCAB, None
        from skippy_wire.wire.forwarding import ActivationDescV1, ActivationDType, ActivationFrameV1

        payload = rows.astype("<f4").tobytes()
        desc = ActivationDescV1(version=1, dtype=ActivationDType.F32, layout=1,
                                producer_stage_index=self.stage_index, layer_start=self.layer_start,
                                layer_end=self.layer_end, token_count=len(tokens), sequence_count=1,
                                payload_bytes=len(payload), flags=0)
        return -1, ActivationFrameV1(desc=desc, payload=payload)

    def prefill(self, session, tokens, activation, state_flags, *, sample, sampling):
        token, frame = self._run(session, list(tokens), activation)
        return (token if sample else -1), frame

    def decode(self, session, token, activation, state_flags, *, sampling):
        return self._run(session, [token], activation)


def _wait_freed(chain, seconds: float = 5.0) -> None:
    """Until every stage has freed every session it opened (stages free on their own threads)."""
    deadline = time.monotonic() + seconds
    while not all(s.freed for b in chain.backends for s in b.sessions) and time.monotonic() < deadline:
        time.sleep(0.01)


def fake_reference(prompt, max_tokens, chunk=4):
    """The fake model as one stage owning every layer."""
    backend = FakeBackend(0, N_LAYER)
    session = backend.create_session()
    token = None
    for start in range(0, len(prompt), chunk):
        token, _ = backend.prefill(session, prompt[start:start + chunk], b"", 0, sample=True, sampling=None)
    out = [token]
    while len(out) < max_tokens:
        token, _ = backend.decode(session, token, b"", 0, sampling=None)
        out.append(token)
    return out


class Chain:
    """In-process stage servers (threads) wired stage 0 -> ... -> terminal."""

    def __init__(self, splits, codec="raw-f32-v1", policy="fixed", *, io_timeout=5.0, reply_timeout=5.0,
                 capture=None, backends=None, decode_ahead=True, limits=None) -> None:
        self.servers: list[StageServer] = []
        self.events: list[dict] = []
        self.backends = []
        downstream = None
        for index in reversed(range(len(splits))):
            start, end = splits[index]
            backend = backends[index] if backends else FakeBackend(start, end, index)
            self.backends.insert(0, backend)
            server = StageServer(
                backend, stage_config(index, start, end, codec, policy), downstream=downstream,
                io_timeout=io_timeout, reply_timeout=reply_timeout, events=self.events.append,
                capture=f"{capture}/hop{index + 1}" if capture and downstream else None, decode_ahead=decode_ahead,
                limits=limits)
            server.start()
            self.servers.insert(0, server)
            downstream = server.address

    @property
    def entry(self):
        return self.servers[0].address

    def close(self):
        for server in self.servers:
            server.shutdown()


def closing_factory(make_one, close):
    """A fixture body: yields ``make_one`` and, after the test, ``close``s everything it made."""
    made = []

    def make(*args, **kwargs):
        made.append(make_one(*args, **kwargs))
        return made[-1]

    yield make
    for item in made:
        close(item)


@pytest.fixture
def chain_factory():
    yield from closing_factory(Chain, Chain.close)


PROMPT = [5, 9, 13, 2, 7, 11, 3]


@pytest.mark.parametrize("splits", [[(0, 6)], [(0, 3), (3, 6)], [(0, 2), (2, 4), (4, 6)]], ids=["1", "2", "3"])
@pytest.mark.parametrize("codec,policy", [("raw-f32-v1", "fixed"), ("bf16-rne-v1", "fixed"),
                                          ("f16-rne-v1", "fixed"), ("raw-f32-v1", "auto-lossless-v1")])
def test_chain_matches_one_stage(chain_factory, splits, codec, policy):
    chain = chain_factory(splits, codec, policy)
    with PipelineClient(*chain.entry, timeout=10) as client:
        result = client.generate(PROMPT, max_tokens=12, chunk_size=4)
    assert result.tokens == fake_reference(PROMPT, 12)
    assert result.prefill_messages == 2 and result.decode_messages == 11
    # Stop freed every stage's session and reported its traffic.
    deadline = time.monotonic() + 5
    while len(chain.events) < len(splits) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert sorted(e["stage"] for e in chain.events) == list(range(len(splits)))
    assert all(s.freed for b in chain.backends for s in b.sessions)
    for event in chain.events:
        if event["stage"] < len(splits) - 1:
            assert event["forwarded_messages"] == 13  # 2 prefill chunks + 11 decodes
            chosen = set(event["codec_counts"])
            assert chosen == ({"bf16-rne-v1"} if policy == "auto-lossless-v1" else {codec})


def test_stop_ends_the_session_not_the_connection(chain_factory):
    chain = chain_factory([(0, 3), (3, 6)])
    with PipelineClient(*chain.entry, timeout=10) as client:
        first = client.generate(PROMPT, max_tokens=5, chunk_size=4, session_id=1)
        second = client.generate(PROMPT, max_tokens=5, chunk_size=4, session_id=2, request_id=2)
    assert first.tokens == second.tokens == fake_reference(PROMPT, 5)
    assert [len(b.sessions) for b in chain.backends] == [2, 2]


def test_no_new_tokens_evaluates_the_prompt_and_ends_the_session(chain_factory):
    """max_tokens 0 (llama-server's n_predict 0): the prefill runs, no token is kept, and
    the session is stopped on every stage as after a generation."""
    chain = chain_factory([(0, 3), (3, 6)])
    with PipelineClient(*chain.entry, timeout=10) as client:
        evaluated = client.generate(PROMPT, max_tokens=0, chunk_size=4, session_id=1)
        after = client.generate(PROMPT, max_tokens=5, chunk_size=4, session_id=2, request_id=2)
    assert evaluated.tokens == [] and evaluated.prefill_messages == 2 and evaluated.decode_messages == 0
    assert after.tokens == fake_reference(PROMPT, 5)
    _wait_freed(chain)
    assert [(len(b.sessions), b.sessions[0].freed) for b in chain.backends] == [(2, True), (2, True)]


def test_a_cancellation_stops_a_long_prompt_between_its_chunks(chain_factory):
    """A client gone during the prefill held its lane until the whole prompt was computed
    (several seconds for a long one): before_step is asked before each chunk after the first."""
    from skippy_wire.net.service import Cancelled

    chain = chain_factory([(0, 3), (3, 6)])
    asked = []

    def client_gone() -> None:
        asked.append(True)
        raise Cancelled("stop")

    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(Cancelled):
            client.generate(PROMPT, max_tokens=5, chunk_size=2, before_step=client_gone)
        client.request(StageWireMessage.stop(1, 1), "Stop")  # as the API frees a cancelled session
        after = client.generate(PROMPT, max_tokens=5, chunk_size=4, session_id=2, request_id=2)
    assert asked == [True] and after.tokens == fake_reference(PROMPT, 5)
    assert [b.sessions[0].token_count for b in chain.backends] == [2, 2]  # one chunk of 7 tokens computed


def test_auto_lossless_falls_back_to_raw_for_inexact_values(chain_factory):
    backends = [FakeBackend(0, 3, 0, scale=1.0 / 3.0), FakeBackend(3, 6, 1, scale=1.0 / 3.0)]
    chain = chain_factory([(0, 3), (3, 6)], "raw-f32-v1", "auto-lossless-v1", backends=backends)
    with PipelineClient(*chain.entry, timeout=10) as client:
        client.generate(PROMPT, max_tokens=3, chunk_size=8)
    deadline = time.monotonic() + 5
    while not chain.events and time.monotonic() < deadline:
        time.sleep(0.01)
    stage0 = next(e for e in chain.events if e["stage"] == 0)
    assert "raw-f32-v1" in stage0["codec_counts"]


def test_configure_generation_reaches_the_terminal_stage(chain_factory):
    seen = []

    class Recording(FakeBackend):
        def prefill(self, session, tokens, activation, state_flags, *, sample, sampling):
            seen.append(sampling)
            return super().prefill(session, tokens, activation, state_flags, sample=sample, sampling=sampling)

    chain = chain_factory([(0, 3), (3, 6)], backends=[FakeBackend(0, 3, 0), Recording(3, 6, 1)])
    sampling = SamplingConfig(flags=1, seed=42, top_k=40)
    with PipelineClient(*chain.entry, timeout=10) as client:
        client.generate(PROMPT, max_tokens=2, chunk_size=8, sampling=sampling)
    assert seen[-1].seed == 42 and seen[-1].top_k == 40


def _session_events(chain, count: int) -> dict:
    """The "session" event of each stage (by stage index), once ``count`` have come."""
    deadline = time.monotonic() + 5
    while len(chain.events) < count and time.monotonic() < deadline:
        time.sleep(0.01)
    return {e["stage"]: e for e in chain.events}


def test_first_stage_decodes_ahead_and_the_stages_exchange_the_same_messages(chain_factory, tmp_path):
    # Stage 0 computes each decode step while its reply travels to the driver and back; the
    # tokens and every message between the stages are those of a chain that waits for the
    # message (the replies differ only in the prefill compute times they report).
    runs = {}
    for ahead in (True, False):
        capture = tmp_path / f"ahead-{ahead}"
        capture.mkdir()
        chain = chain_factory([(0, 3), (3, 6)], capture=str(capture), decode_ahead=ahead)
        with PipelineClient(*chain.entry, timeout=10) as client:
            tokens = client.generate(PROMPT, max_tokens=12, chunk_size=4).tokens
        events = _session_events(chain, 2)
        runs[ahead] = (tokens, (capture / "hop1-messages.bin").read_bytes(), events)
    assert runs[True][:2] == runs[False][:2]
    assert runs[True][0] == fake_reference(PROMPT, 12)
    on, off = runs[True][2], runs[False][2]
    assert on[0]["decoded_ahead"] == 11  # every decode step
    assert on[0]["discarded_ahead"] == 1  # the step after the last token, dropped at Stop
    assert on[1]["decoded_ahead"] == off[0]["decoded_ahead"] == 0
    assert on[0]["decode_tokens"] == off[0]["decode_tokens"] == 11


def test_a_message_other_than_the_step_computed_ahead_finds_the_session_as_without(chain_factory):
    # Another token, a rewound position, a repeated step, a prompt continuing the session:
    # stage 0 trims the step it computed ahead and every stage answers and holds what it
    # would have without decoding ahead.
    from skippy_wire.net.schedule import decode_message, prefill_messages

    def drive(ahead: bool):
        chain = chain_factory([(0, 3), (3, 6)], decode_ahead=ahead)
        n = len(PROMPT)
        with PipelineClient(*chain.entry, timeout=10) as client:
            for msg in prefill_messages(PROMPT, 4, 1, 1):
                reply = client.request(msg)
            out = [int(reply.predicted)]

            def decode(token, pos):
                out.append(int(client.request(decode_message(token, pos, pos - n, n, 1, 1)).predicted))

            decode(out[0], n)           # the step computed ahead
            decode(out[-1] + 1, n + 1)  # another token than the predicted one
            decode(out[0], n)           # back one position
            decode(out[0], n)           # the same step again
            decode(out[-1], n + 1)      # on as predicted
            decode(out[-1], n + 2)
            more = next(prefill_messages([4, 4], 4, 1, 1))  # the next turn's prompt
            more.pos_start = n + 3
            out.append(int(client.request(more).predicted))
        _wait_freed(chain)  # the connections close after any step computed ahead
        return out, [list(b.sessions[0].history) for b in chain.backends]

    (tokens_on, held_on), (tokens_off, held_off) = drive(True), drive(False)
    assert tokens_on == tokens_off
    assert held_on[0][:-1] == held_off[0] and held_on[0][-1] == tokens_on[-1]  # one step ahead
    assert held_on[1] == held_off[1]


def test_a_one_stage_pipeline_decodes_ahead_only_for_greedy_sessions(chain_factory):
    # A terminal first stage samples the step it computes ahead, and a sampler's state
    # cannot be rolled back: sampled sessions wait for their messages.

    for sampling, ahead in ((None, 11), (SamplingConfig(flags=1, seed=42, top_k=40), 0)):
        chain = chain_factory([(0, 6)])
        with PipelineClient(*chain.entry, timeout=10) as client:
            tokens = client.generate(PROMPT, max_tokens=12, chunk_size=4, sampling=sampling).tokens
        assert tokens == fake_reference(PROMPT, 12)  # (the fake model does not sample)
        assert _session_events(chain, 1)[0]["decoded_ahead"] == ahead


# -- faults --------------------------------------------------------------------------------


def _raw_connect(address):
    sock = socket.create_connection(address, timeout=5)
    assert sock.recv(4) == b"\x59\x44\x52\x53"  # READY
    return sock


def _wait_closed(sock, timeout=5.0) -> bool:
    """True once the server closed the connection (recv returns b"")."""
    sock.settimeout(timeout)
    try:
        while True:
            data = sock.recv(4096)
            if not data:
                return True
    except (socket.timeout, TimeoutError):
        return False
    except ConnectionResetError:
        return True


def _prefill_bytes():
    from skippy_wire.net.schedule import prefill_messages

    return write_stage_message(next(prefill_messages(PROMPT, 16, 1, 1)))


def _still_serves(chain):
    with PipelineClient(*chain.entry, timeout=10) as client:
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)


def _logged_connection(chain_factory, caplog, splits, **kwargs):
    """A chain of ``splits`` whose server logs at INFO, and a raw connection to its entry."""
    chain = chain_factory(splits, **kwargs)
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    return chain, _raw_connect(chain.entry)


def test_peer_disconnecting_mid_message_is_logged_and_closed(chain_factory, caplog):
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 3), (3, 6)])
    sock.sendall(_prefill_bytes()[:50])
    sock.close()
    deadline = time.monotonic() + 5
    while "in the middle of a message" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "peer disconnected in the middle of a message" in caplog.text
    _still_serves(chain)


def test_the_log_names_each_links_role(chain_factory, caplog):
    # before state version 17 no role is asked: stage 0 serves the driver's tokens and control
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 3), (3, 6)])
    sock.close()
    _still_serves(chain)
    ready = [line for line in caplog.text.splitlines() if ": ready (state version 15" in line]
    assert any("TokensAndControl" in line for line in ready) and any("Activation" in line for line in ready), ready


def test_garbage_is_logged_and_closed(chain_factory, caplog):
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 6)])
    sock.sendall(struct.pack("<i", 12) + b"\xab" * 200)  # kind 12 is unknown
    assert _wait_closed(sock)
    sock.close()
    assert "malformed stage message (InvalidData: unknown stage message kind)" in caplog.text
    _still_serves(chain)


def test_an_activation_of_another_width_asks_whether_the_upstream_runs_this_model(caplog):
    """An upstream of another model sends rows of its own width: the exact upstream text
    alone ("activation payload size mismatch") read as corrupt bytes."""
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    server = StageServer(FakeBackend(3, N_LAYER, 1), stage_config(1, 3, N_LAYER, "raw-f32-v1", "fixed"))
    server.start()
    try:
        sock = _raw_connect(server.address)
        state = StageStateHeader.new(WireMessageKind.PREFILL_FINAL_EMBD)
        state.source_stage_index = 0
        wide = np.ones(2 * N_EMBD, np.float32).tobytes()  # one token of an upstream twice as wide
        sock.sendall(write_stage_message(StageWireMessage(WireMessageKind.PREFILL_FINAL_EMBD, 1, 1, state, 0, 1,
                                                          tokens=[5], activation=wide)))
        assert _wait_closed(sock)
        sock.close()
    finally:
        server.shutdown()
    assert ("malformed stage message (InvalidData: activation payload size mismatch); does the upstream run this "
            f"stage's model (n_embd {N_EMBD})?; closing") in caplog.text


def test_activation_sidebands_are_refused_before_stage_0_computes(chain_factory, caplog, monkeypatch):
    """Stage 0 computed the step, then failed to forward it ("F32 activation payload size
    mismatch"), or forwarded flags that made stage 1 close its link."""
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 3), (3, 6)])
    computed = []
    monkeypatch.setattr(FakeBackend, "_run", lambda self, *args: computed.append(args))
    msg = next(prefill_messages(PROMPT, 16, 1, 1))
    msg.state.flags |= 0x80  # state bit 7: frame flag 0x2, a sideband
    sock.sendall(write_stage_message(msg))
    assert _wait_closed(sock)
    sock.close()
    assert "activation frame flags 0x2 (sidebands) are not supported; closing" in caplog.text
    assert computed == [] and "stage runtime error" not in caplog.text and "downstream" not in caplog.text
    monkeypatch.undo()
    _still_serves(chain)


def _fails_behind_a_fake_downstream(caplog, answer, reply_timeout: float, said: str) -> None:
    """A generation through a stage whose downstream sends READY, then ``answer(conn)``: it
    fails, and the stage's log says ``said``."""
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    listener = socket.create_server(("127.0.0.1", 0))
    done = threading.Event()

    def downstream() -> None:
        conn, _ = listener.accept()
        with conn:
            conn.sendall(READY_BYTES)
            answer(conn)
            done.wait(10)

    threading.Thread(target=downstream, daemon=True).start()
    server = StageServer(FakeBackend(0, 3), stage_config(0, 0, 3, "raw-f32-v1", "fixed"),
                         downstream=listener.getsockname()[:2], reply_timeout=reply_timeout)
    server.start()
    try:
        with pytest.raises(PipelineError), PipelineClient(*server.address, timeout=5) as client:
            client.generate(PROMPT, max_tokens=3, chunk_size=16)
        deadline = time.monotonic() + 5
        while said not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.01)
        assert said in caplog.text, caplog.text
    finally:
        done.set()
        server.shutdown()
        listener.close()


def test_a_downstream_that_answers_twice_is_refused_not_relayed_a_reply_late(caplog):
    """The second reply was relayed as the answer to the next message: every token shifted by one, silently."""
    def answers_twice(conn) -> None:
        while conn.recv(65536):
            conn.sendall(predicted_reply_bytes(7) * 2)

    _fails_behind_a_fake_downstream(caplog, answers_twice, 5.0, "sent bytes nobody asked for; closing")
    assert "downstream 127.0.0.1:" in caplog.text


@pytest.mark.parametrize("begun, said", [(0, "sent no reply within 1 s"),
                                          (10, "sent 10 bytes of a reply and no more within 1 s")])
def test_a_downstream_that_stops_in_a_reply_is_not_said_silent(caplog, begun, said):
    """A downstream that sent a reply's first bytes, then nothing, was said to have sent no reply."""
    def stops_in_a_reply(conn) -> None:
        conn.recv(65536)
        conn.sendall(predicted_reply_bytes(7)[:begun])

    _fails_behind_a_fake_downstream(caplog, stops_in_a_reply, 1.0, said)


def test_pipelined_messages_are_answered_in_order_then_garbage_closes(chain_factory, caplog):
    from skippy_wire.wire.frame import StageReplyDecoder

    chain, sock = _logged_connection(chain_factory, caplog, [(0, 3), (3, 6)])
    data = write_stage_message(StageWireMessage.configure_generation(1, 1, len(PROMPT), None, None))
    data += _prefill_bytes() + write_stage_message(StageWireMessage.stop(1, 1))
    sock.sendall(data + struct.pack("<i", 12) + b"\xab" * 100)  # three messages, then garbage, at once
    decoder, replies = StageReplyDecoder(), []
    sock.settimeout(5)
    while len(replies) < 3:
        chunk = sock.recv(4096)
        assert chunk, "closed before the three replies"
        replies += decoder.feed(chunk)
    assert [int(r.kind) for r in replies] == [1, 2, 1]
    assert replies[1].predicted == fake_reference(PROMPT, 1, chunk=16)[0]
    assert _wait_closed(sock)  # the garbage closes the connection without waiting for more bytes
    sock.close()
    assert "malformed stage message (InvalidData: unknown stage message kind)" in caplog.text
    stage0 = next(e for e in chain.events if e["stage"] == 0)
    assert stage0["messages"] == 3 and stage0["received_bytes"] == len(data)


@pytest.mark.parametrize("tokens, positions, what", [(513, None, "513 token ids"), (1, 100_000, "100000 positions")])
def test_more_token_ids_than_the_context_are_refused_from_the_prefix(chain_factory, caplog, tokens, positions, what):
    """A first stage read and decoded a message of up to its byte limit in token ids (600,000
    in 2.4 MB, a ~20 MB list) that no context of 512 could run; now the 80-byte prefix says so."""
    from skippy_wire.net.schedule import prefill_messages

    chain, sock = _logged_connection(chain_factory, caplog, [(0, 6)], io_timeout=30.0)
    message = next(prefill_messages([7] * tokens, tokens, 1, 1))
    if positions:
        message.positions = list(range(positions))
    sock.sendall(write_stage_message(message)[:80])
    assert _wait_closed(sock)  # without waiting for the body the prefix announces
    sock.close()
    assert (f"malformed stage message (InvalidData: stage message carries {what}, more than the 512 of this "
            "stage's context (--ctx-size))") in caplog.text
    _still_serves(chain)


def test_stalled_peer_times_out(chain_factory, caplog):
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 6)], io_timeout=0.3)
    sock.sendall(_prefill_bytes()[:30])
    assert _wait_closed(sock)
    sock.close()
    assert "stalled" in caplog.text
    _still_serves(chain)


def test_unsupported_kind_closes_the_connection(chain_factory, caplog):
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 6)])
    kind = WireMessageKind.STATE_EXPORT
    sock.sendall(write_stage_message(StageWireMessage(kind, 0, 0, StageStateHeader.new(kind), 1, 1)))
    assert _wait_closed(sock)
    sock.close()
    assert "unsupported stage message kind STATE_EXPORT" in caplog.text


def test_downstream_failure_reaches_the_driver(chain_factory):
    chain = chain_factory([(0, 3), (3, 6)])
    with PipelineClient(*chain.entry, timeout=10) as client:
        client.generate(PROMPT, max_tokens=2, chunk_size=4)
        chain.servers[1].shutdown()  # the terminal stage drops its connections
        with pytest.raises(PipelineError, match="closed the connection"):
            client.generate(PROMPT, max_tokens=2, chunk_size=4, session_id=2)


def test_downstream_stall_reaches_the_driver(chain_factory):
    class Stalling(FakeBackend):
        def decode(self, *args, **kwargs):
            time.sleep(3)
            return super().decode(*args, **kwargs)

    chain = chain_factory([(0, 3), (3, 6)], reply_timeout=0.5,
                          backends=[FakeBackend(0, 3, 0), Stalling(3, 6, 1)])
    with PipelineClient(*chain.entry, timeout=10) as client:
        started = time.monotonic()
        with pytest.raises(PipelineError, match="closed the connection"):
            client.generate(PROMPT, max_tokens=3, chunk_size=4)
        assert time.monotonic() - started < 8


def _fake_stage(behaviour):
    """A listening socket that sends READY, then ``behaviour(conn)``; returns (address, close)."""
    import threading

    listener = socket.create_server(("127.0.0.1", 0))
    conns = []

    def serve():
        conn, _ = listener.accept()
        conns.append(conn)
        conn.sendall(b"\x59\x44\x52\x53")
        behaviour(conn)

    threading.Thread(target=serve, daemon=True).start()

    def close():
        for conn in conns:
            conn.close()
        listener.close()

    return listener.getsockname()[:2], close


def test_driver_times_out_on_a_silent_stage():
    address, close = _fake_stage(lambda conn: time.sleep(5))
    try:
        with PipelineClient(*address, timeout=0.5) as client:
            started = time.monotonic()
            with pytest.raises(PipelineError, match="no answer to ConfigureGeneration within 0.5 s"):
                client.generate(PROMPT, max_tokens=2)
            assert time.monotonic() - started < 4
    finally:
        close()


@pytest.mark.parametrize("delay", [0.05, 0.3])
def test_a_client_closed_by_another_thread_ends_its_request_with_a_pipeline_error(delay):
    # an OSError (a bad file descriptor) escaped from the socket the other thread closed
    import threading

    address, close = _fake_stage(lambda conn: time.sleep(5))
    outcome = []
    try:
        client = PipelineClient(*address, timeout=4)

        def generate():
            try:
                client.generate(PROMPT, max_tokens=2)
            except BaseException as exc:  # noqa: BLE001 -- the test inspects it
                outcome.append(exc)

        worker = threading.Thread(target=generate)
        worker.start()
        time.sleep(delay)
        client.close()
        worker.join(10)
    finally:
        close()
    assert len(outcome) == 1 and isinstance(outcome[0], PipelineError), outcome
    # (a thread started late finds it closed before it sends: said as such)
    assert re.search(r"this client (was closed during ConfigureGeneration|is closed; \S+ not sent)", str(outcome[0]))


@pytest.mark.parametrize("behaviour,match", [
    (lambda conn: (conn.recv(1 << 16), conn.close()), "closed the connection during ConfigureGeneration"),
    (lambda conn: (conn.recv(1 << 16), conn.sendall(b"\x09" * 300), time.sleep(1)),
     "malformed reply .*unknown stage reply kind"),
], ids=["closed-stage", "garbage-reply"])
def test_driver_reports_a_broken_stage(behaviour, match):
    address, close = _fake_stage(behaviour)
    try:
        with PipelineClient(*address, timeout=5) as client:
            with pytest.raises(PipelineError, match=match):
                client.generate(PROMPT, max_tokens=2)
    finally:
        close()


@pytest.mark.parametrize("port, error, message", [
    (70000, ValueError, "port must be from 1 to 65535, got 70000"),  # it reached port 4464
    (-1, ValueError, "port must be from 1 to 65535, got -1"),
    (0, ValueError, "port must be from 1 to 65535, got 0"),
    (None, TypeError, "port must be an int, not NoneType"),
    (True, TypeError, "port must be an int, not bool"),
    ("9000", TypeError, "port must be an int, not str"),
    (9000.0, TypeError, "port must be an int, not float"),
])
def test_a_client_refuses_a_port_that_is_none(port, error, message):
    with pytest.raises(error) as refused:
        PipelineClient("127.0.0.1", port, timeout=1)
    assert str(refused.value) == message


def test_driver_reports_a_refused_connection():
    listener = socket.create_server(("127.0.0.1", 0))
    address = listener.getsockname()[:2]
    listener.close()
    with pytest.raises(PipelineError, match=r"^cannot connect to stage 0 at [\d.:]+: connection refused$"):
        PipelineClient(*address, timeout=2)  # in words, not Python's "[Errno 111] Connection refused"


# -- configuration -------------------------------------------------------------------------


def test_server_rejects_inconsistent_configuration():
    with pytest.raises(ValueError, match="needs --downstream"):
        StageServer(FakeBackend(0, 3), stage_config(0, 0, 3, "raw-f32-v1", "fixed"))
    with pytest.raises(ValueError, match="cannot have a downstream"):
        StageServer(FakeBackend(3, 6, 1), stage_config(1, 3, 6, "raw-f32-v1", "fixed"), downstream=("127.0.0.1", 1))
    with pytest.raises(ValueError, match="incompatible with configured codec"):
        StageServer(FakeBackend(0, 6), stage_config(0, 0, 6, "f16-rne-v1", "auto-lossless-v1"))


def test_shutdown_closes_the_listener_of_a_server_never_started():
    """An embedder that builds a StageServer and gives up before serving: the port was kept
    listening (connections queued into its backlog) until garbage collection."""
    server = StageServer(FakeBackend(0, 6), stage_config(0, 0, 6, "raw-f32-v1", "fixed"))
    server.shutdown()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(server.address, timeout=2).close()
    server.serve_forever()  # after shutdown(): returns at once


def test_stage_config_maps_identities():
    config = stage_config(1, 4, 8, "bf16-rne-v1", "fixed")
    assert config.activation_codec == ActivationCodec.BF16_RNE_V1
    assert config.activation_codec_policy == CodecPolicy.FIXED
    assert (config.stage_index, config.layer_start, config.layer_end) == (1, 4, 8)


def test_parse_address():
    assert parse_address("127.0.0.1:9000") == ("127.0.0.1", 9000)
    assert parse_address("tcp://localhost:1") == ("localhost", 1)
    with pytest.raises(ValueError):
        parse_address("nope")


def test_serve_cli_reports_bad_arguments(capsys):
    from skippy_wire.tools.serve import main

    with pytest.raises(SystemExit) as exit_:  # argparse's usage error, after its usage block
        main(["--model", "/nonexistent.gguf", "--layer-start", "2", "--layer-end", "4"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and "--stage-index is required" in err


def test_runtime_error_closes_the_connection_and_is_reported(chain_factory, caplog):
    class Full(FakeBackend):
        def decode(self, *args, **kwargs):
            raise StageRuntimeError("context full", Status.RUNTIME_ERROR)

    chain = chain_factory([(0, 3), (3, 6)], backends=[FakeBackend(0, 3, 0), Full(3, 6, 1)])
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(PipelineError, match="closed the connection during DECODE_EMBD"):
            client.generate(PROMPT, max_tokens=3, chunk_size=4)
    assert "stage runtime error: RuntimeError: context full" in caplog.text
    assert all(s.freed for b in chain.backends for s in b.sessions)
    _raw_connect(chain.entry).close()  # the listener is still up: a new connection gets READY


def test_trim_session_reaches_every_stage(chain_factory):
    from skippy_wire.net.schedule import prefill_messages

    chain = chain_factory([(0, 3), (3, 6)])
    kind = WireMessageKind.TRIM_SESSION
    with PipelineClient(*chain.entry, timeout=10) as client:
        for msg in prefill_messages(PROMPT, 16, 1, 5):
            client.request(msg)
        reply = client.request(StageWireMessage(kind, 3, 0, StageStateHeader.new(kind), 1, 5))
        assert int(reply.kind) == 1
        assert [b.sessions[0].token_count for b in chain.backends] == [3, 3]
        client.request(StageWireMessage.stop(1, 5))


def test_a_trim_to_nothing_of_a_session_never_opened_takes_no_lane(chain_factory):
    chain = chain_factory([(0, 3), (3, 6)])
    kind = WireMessageKind.TRIM_SESSION
    with PipelineClient(*chain.entry, timeout=10) as client:
        for session_id in (1, 2, 3):  # more than a connection may hold open
            reply = client.request(StageWireMessage(kind, 0, 0, StageStateHeader.new(kind), session_id, 5))
            assert int(reply.kind) == 1
        assert [b.sessions for b in chain.backends] == [[], []]
        assert client.generate(PROMPT, max_tokens=4, chunk_size=4).tokens == fake_reference(PROMPT, 4)


@pytest.mark.parametrize("position", [-5, 3])
def test_a_trim_past_what_a_session_holds_is_refused_before_it_takes_a_lane(chain_factory, caplog, position):
    chain = chain_factory([(0, 3), (3, 6)])
    kind = WireMessageKind.TRIM_SESSION
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(PipelineError, match="closed the connection"):
            client.request(StageWireMessage(kind, position, 0, StageStateHeader.new(kind), 1, 5))
    assert f"TRIM_SESSION to position {position}, but session 5 holds 0 tokens" in caplog.text
    assert [b.sessions for b in chain.backends] == [[], []]  # no session opened for it
    with PipelineClient(*chain.entry, timeout=10) as client:  # nor for a held one's trim past its end
        for msg in prefill_messages(PROMPT, 16, 1, 5):
            client.request(msg)
        with pytest.raises(PipelineError, match="closed the connection"):
            client.request(StageWireMessage(kind, len(PROMPT) + 1, 0, StageStateHeader.new(kind), 1, 5))
    assert f"TRIM_SESSION to position {len(PROMPT) + 1}, but session 5 holds {len(PROMPT)} tokens" in caplog.text


def test_a_trim_past_what_a_session_holds_is_refused_with_a_step_computed_ahead(chain_factory, caplog):
    # A one-stage pipeline computes a greedy session's next step ahead: that step is not one the
    # peer asked for, so a trim to just past the prompt is past what the session holds.
    chain = chain_factory([(0, 6)])
    kind = WireMessageKind.TRIM_SESSION
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        for msg in prefill_messages(PROMPT, 16, 1, 5):
            client.request(msg)
        with pytest.raises(PipelineError, match="closed the connection"):
            client.request(StageWireMessage(kind, len(PROMPT) + 1, 0, StageStateHeader.new(kind), 1, 5))
    assert f"TRIM_SESSION to position {len(PROMPT) + 1}, but session 5 holds {len(PROMPT)} tokens" in caplog.text


def test_a_session_whose_peer_left_while_waiting_for_a_lane_gives_its_place_up(chain_factory, caplog):
    from skippy_wire.net.admission import PEER_CHECK_INTERVAL, StageLimits

    class OneLane(FakeBackend):
        lane_count = 1

    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    chain = chain_factory([(0, 6)], backends=[OneLane(0, 6)], limits=StageLimits(lane_wait=60))
    server = chain.servers[0]
    with PipelineClient(*chain.entry, timeout=10) as holder:
        holder.request(StageWireMessage.configure_generation(1, 1, 4, None, None))  # the one lane
        leavers = [_raw_connect(chain.entry) for _ in range(3)]
        for index, sock in enumerate(leavers):  # each asks for a session, then goes
            sock.sendall(write_stage_message(StageWireMessage.configure_generation(2, 2, 4, None, None)))
        deadline = time.monotonic() + 5
        while len(server.admission.lanes._queue) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(server.admission.lanes._queue) == 3
        for sock in leavers:
            sock.close()
        left = time.monotonic()
        while server.admission.lanes._queue and time.monotonic() - left < 10 * PEER_CHECK_INTERVAL:
            time.sleep(0.01)
        assert not server.admission.lanes._queue  # long before the 60 s lane wait
        assert caplog.text.count("the peer left while its session waited for a lane") == 3
        assert server.admission.lanes.busy == 1
    assert not chain.backends[0].sessions[1:]  # the leavers never opened a session


@pytest.mark.parametrize("queued", [False, True], ids=["one_at_a_time", "queued_ahead"])
def test_sessions_that_compute_nothing_lose_their_lanes_whatever_else_their_peer_sends(chain_factory, caplog,
                                                                                       queued):
    """Two sessions opened by ConfigureGeneration, kept alive by Stops of sessions never
    opened (no lane, no compute), held every lane past the idle timeout: other users were
    refused for as long as the peer liked, and Stops queued ahead kept the check waiting."""
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    chain = chain_factory([(0, 3), (3, 6)])
    server = chain.servers[0]
    server.idle_timeout = 0.6
    with PipelineClient(*chain.entry, timeout=10) as holder:
        for session_id in (1, 2):
            holder.request(StageWireMessage.configure_generation(session_id, session_id, 4, None, None))
        assert server.admission.lanes.busy == 2
        stop = holder._link.encode(StageWireMessage.stop(9, 9))
        if queued:
            holder.send_bytes(stop * 8, "Stop")
        started = time.monotonic()
        with pytest.raises(PipelineError):
            while time.monotonic() - started < 5:  # the connection is never quiet
                if queued:  # eight always on their way
                    holder.receive("Stop")
                    holder.send_bytes(stop, "Stop")
                else:
                    holder.request(StageWireMessage.stop(9, 9))
                    time.sleep(0.1)
        assert 0.5 < time.monotonic() - started < 4  # the idle timeout, not the loop's end
    deadline = time.monotonic() + 5
    while server.admission.lanes.busy and time.monotonic() < deadline:
        time.sleep(0.01)
    assert server.admission.lanes.busy == 0
    # opened a moment apart, the two may be found idle together or one after the other
    assert re.search(r"its sessions \((1, )?2\) computed nothing for more than 0.6 s \(--idle-timeout\); closing",
                     caplog.text)
    _wait_freed(chain)  # the next stage frees its sessions when it reads the link's close
    assert [b.sessions[0].freed for b in chain.backends] == [True, True]


def test_a_session_that_keeps_computing_outlives_the_idle_timeout(chain_factory, caplog):
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    chain = chain_factory([(0, 3), (3, 6)])
    chain.servers[0].idle_timeout = 0.6

    def slowly(token: int) -> None:
        time.sleep(0.25)

    with PipelineClient(*chain.entry, timeout=10) as client:
        result = client.generate(PROMPT, max_tokens=8, chunk_size=4, on_token=slowly)  # about 2 s
    assert result.tokens == fake_reference(PROMPT, 8)
    assert "computed nothing" not in caplog.text


def test_a_session_that_computes_nothing_is_freed_while_its_sibling_computes(chain_factory, caplog):
    """One cheap step per idle timeout on session 1 kept session 2's lane and cache held for
    good: the check looked at the connection's latest compute, not each session's.  Freed, on
    every stage (stage 1's own idle timeout is the default 300 s: a Stop frees it there), and a
    later message for it is refused naming why (it opened a new session, its sampling lost)."""
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    chain = chain_factory([(0, 3), (3, 6)])
    chain.servers[0].idle_timeout = 0.6
    lanes_seen = []

    def slowly(token: int) -> None:
        lanes_seen.append([server.admission.lanes.busy for server in chain.servers])
        time.sleep(0.25)

    with PipelineClient(*chain.entry, timeout=10) as client:
        client.request(StageWireMessage.configure_generation(2, 2, 4, SamplingConfig(flags=1), None))  # then idle
        result = client.generate(PROMPT, max_tokens=8, chunk_size=4, on_token=slowly)  # about 2 s
        assert result.tokens == fake_reference(PROMPT, 8)  # the computing session is untouched
        assert "session 2 computed nothing for more than 0.6 s (--idle-timeout); freed" in caplog.text
        assert lanes_seen[0] == [2, 2] and lanes_seen[-1] == [1, 1]  # session 2's lanes came back meanwhile
        with pytest.raises(PipelineError):
            client.request(next(prefill_messages(PROMPT[:4], 4, 2, 2)))
    assert ("PREFILL_FINAL_EMBD for session 2, which was freed: it computed nothing for more than 0.6 s "
            "(--idle-timeout); closing") in caplog.text
    assert not caplog.text.split("session 2 computed nothing")[1].split("\n")[0].endswith("closing")


def test_a_freed_sessions_stop_leaves_the_owed_prefill_acks_to_the_next_reply(chain_factory):
    # the Stop was relayed as a request: it read the Acks stage 1 still owed for an overlapped
    # prefill chunk of session 1, and their stats were lost with the Stop's reply
    chain = chain_factory([(0, 3), (3, 6)])
    chain.servers[0].idle_timeout = 0.6

    def observations(idle_sibling: bool) -> int:
        with PipelineClient(*chain.entry, timeout=10) as client:
            if idle_sibling:
                client.request(StageWireMessage.configure_generation(2, 2, 4, None, None))
                time.sleep(0.5)
            for index, msg in enumerate(prefill_messages(PROMPT * 3, 4, 1, 1)):
                reply = client.request(msg)
                if index == 0:
                    time.sleep(0.3)  # session 2 is freed while stage 1 owes this chunk's Ack
            return reply.stats.prefill_compute_observation_count

    alone = observations(idle_sibling=False)
    assert alone > 1 and observations(idle_sibling=True) == alone


def test_concurrent_connections_each_get_their_own_chain(chain_factory):
    import threading

    chain = chain_factory([(0, 2), (2, 4), (4, 6)])
    results, errors = {}, []

    def run(session_id):
        try:
            with PipelineClient(*chain.entry, timeout=20) as client:
                results[session_id] = client.generate(PROMPT, max_tokens=20, chunk_size=3,
                                                      session_id=session_id).tokens
        except Exception as exc:  # noqa: BLE001 -- reported by the assertion below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(i,)) for i in (1, 2, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    expected = fake_reference(PROMPT, 20, chunk=3)
    assert results == {1: expected, 2: expected, 3: expected}


def test_decode_position_is_authoritative_and_prefill_must_be_contiguous(chain_factory, caplog):
    from skippy_wire.net.schedule import decode_message, prefill_messages

    chain = chain_factory([(0, 3), (3, 6)], decode_ahead=False)  # (decode ahead: the test below)
    with PipelineClient(*chain.entry, timeout=10) as client:
        for msg in prefill_messages(PROMPT, 16, 1, 1):
            first = client.request(msg).predicted
        a = client.request(decode_message(first, len(PROMPT), 0, len(PROMPT), 1, 1)).predicted
        # Decode the same position again: the stages rewind to it and agree with themselves.
        again = client.request(decode_message(first, len(PROMPT), 0, len(PROMPT), 1, 1)).predicted
        assert again == a
        assert [b.sessions[0].token_count for b in chain.backends] == [len(PROMPT) + 1] * 2
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        gap = next(prefill_messages(PROMPT, 16, 1, 1))
        gap.pos_start = 3
        with pytest.raises(PipelineError, match="closed the connection"):
            client.request(gap)
    assert "PREFILL_FINAL_EMBD at position 3, but session 1 holds 0 tokens" in caplog.text


def test_a_decode_step_of_several_tokens_is_refused_before_it_is_computed(chain_factory, caplog):
    from skippy_wire.net.schedule import decode_message, prefill_messages

    chain = chain_factory([(0, 3), (3, 6)], decode_ahead=False)
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        for msg in prefill_messages(PROMPT, 16, 1, 1):
            first = client.request(msg).predicted
        two = decode_message(first, len(PROMPT), 0, len(PROMPT), 1, 1)
        two.token_count, two.tokens = 2, [first, first]
        with pytest.raises(PipelineError, match="closed the connection"):
            client.request(two)
        assert [b.sessions[0].token_count for b in chain.backends] == [len(PROMPT)] * 2  # no cache changed
    assert "a DecodeEmbd carries one token, this one 2" in caplog.text


def test_explicit_positions_other_than_the_tokens_own_are_refused(chain_factory, caplog):
    """A positions list the runtime would not follow (it places tokens at pos_start on) is
    refused before any cache changes; the tokens' own positions are accepted as if absent."""
    from skippy_wire.net.schedule import prefill_messages

    chain = chain_factory([(0, 3), (3, 6)], decode_ahead=False)
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        plain = client.request(next(prefill_messages(PROMPT[:3], 16, 1, 1))).predicted
    for positions in ([0, 1, 2], [0, 1000000, 2], [0, 1], [2, 1, 0]):
        msg = next(prefill_messages(PROMPT[:3], 16, 1, 1))
        msg.positions = positions
        created = [len(b.sessions) for b in chain.backends]
        with PipelineClient(*chain.entry, timeout=10) as client:
            if positions == [0, 1, 2]:
                assert client.request(msg).predicted == plain
                continue
            with pytest.raises(PipelineError, match="closed the connection"):
                client.request(msg)
        assert f"carries {len(positions)} explicit positions that are not its 3 tokens' own (0 on" in caplog.text
        assert [len(b.sessions) for b in chain.backends] == created  # refused before a session was opened
        caplog.clear()


def test_a_message_whose_token_ids_miss_its_count_is_refused_by_every_stage(chain_factory, caplog):
    from skippy_wire.net.schedule import prefill_messages

    chain = chain_factory([(0, 3), (3, 6)])
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    # stage 0 reads the ids; a later stage gets rows of activation and the ids beside them
    for server, activation in ((chain.servers[0], b""), (chain.servers[1], bytes(3 * N_EMBD * 4))):
        msg = next(prefill_messages(PROMPT[:3], 16, 1, 1))
        msg.tokens, msg.activation = [], activation
        msg.state.source_stage_index = 0 if activation else -1  # (-1: the driver's, carrying none)
        with PipelineClient(*server.address, timeout=10) as client:
            with pytest.raises(PipelineError, match="closed the connection"):
                client.request(msg)
        assert caplog.text.count("message counts 3 tokens but carries 0 token ids") == 1
        caplog.clear()
    assert [len(b.sessions) for b in chain.backends] == [1, 1] and all(b.sessions[0].token_count == 0
                                                                         for b in chain.backends)


def test_sampling_the_terminal_would_refuse_is_refused_by_the_first_stage_with_its_reason(chain_factory, caplog):
    chain = chain_factory([(0, 3), (3, 6)])
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(PipelineError, match="closed the connection"):
            client.generate(PROMPT, max_tokens=2, chunk_size=8,
                            sampling=SamplingConfig(flags=1, dry_sequence_breakers=["x" * 64]))
    assert "stage runtime error: sampling DRY sequence breaker exceeds the native byte limit" in caplog.text
    assert not chain.backends[1].sessions  # the terminal stage never saw the session


@pytest.mark.parametrize("field", ["temperature", "top_p", "min_p", "repeat_penalty"])
def test_a_nan_in_the_sampling_is_refused_by_the_first_stage_before_it_is_acknowledged(chain_factory, caplog, field):
    """ConfigureGeneration with a NaN temperature was relayed and acknowledged by every stage;
    the pipeline failed only at the first prefill, on the terminal stage."""
    chain = chain_factory([(0, 3), (3, 6)])
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    configure = StageWireMessage.configure_generation(1, 1, 4, SamplingConfig(flags=1, **{field: float("nan")}))
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(PipelineError, match="closed the connection"):
            client.request(configure)
    assert f"stage runtime error: InvalidArgument: sampling {field} is NaN; closing" in caplog.text
    assert not chain.backends[1].sessions  # the next stage never saw the session


def test_a_stage_polls_only_while_one_session_decodes_there():
    """Polling readers (``poll_s``) would take the GIL and the cores from the batches of
    several sessions, so a stage polls only while at most one session decodes there."""
    from skippy_wire.net.batching import DecodeStep

    backend = FakeBackend(0, N_LAYER)
    server = StageServer(backend, stage_config(0, 0, N_LAYER, "raw-f32-v1", "fixed"), poll_s=0.05)
    try:
        first, second = backend.create_session(), backend.create_session()
        assert server._poll_window() == 0.05
        server.batcher.decode(DecodeStep(first, 3, None, 0, None))
        assert server._poll_window() == 0.05
        server.batcher.decode(DecodeStep(second, 4, None, 0, None))
        assert server._poll_window() == 0.0
        server.batcher.forget(second)
        assert server._poll_window() == 0.05
    finally:
        server.shutdown()
        server._listener.close()


def test_peer_that_never_reads_its_replies_times_out(chain_factory, caplog):
    """The replies' sends wait at most --io-timeout, not the idle timeout (300 s here)."""

    chain = chain_factory([(0, 6)], io_timeout=0.3)
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(chain.entry)
    assert sock.recv(4) == b"\x59\x44\x52\x53"
    # Whole messages in small bursts, each read at once while the server waits between
    # messages (the idle timeout's wait), each answered by an ACK that nobody reads.
    stops = write_stage_message(StageWireMessage.stop(1, 999)) * 32
    sock.setblocking(False)
    closed = False
    deadline = time.monotonic() + 20
    while not closed and time.monotonic() < deadline:
        try:
            sent = sock.send(stops)
            if sent < len(stops):
                break  # the server no longer reads: it is blocked sending
            time.sleep(0.002)
        except BlockingIOError:
            break
        except (BrokenPipeError, ConnectionResetError):
            closed = True
    while "closing" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.05)
    sock.close()
    # told apart from a peer that stops sending inside a message ("peer stalled for ...")
    assert "peer read nothing of what was sent to it for more than 0.3 s; closing" in caplog.text
    _still_serves(chain)


def test_peer_resetting_mid_message_is_named(chain_factory, caplog):
    chain, sock = _logged_connection(chain_factory, caplog, [(0, 6)])
    sock.sendall(_prefill_bytes()[:50])
    time.sleep(0.1)  # the first bytes are read before the reset
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()  # RST
    deadline = time.monotonic() + 5
    while "reset" not in caplog.text and time.monotonic() < deadline:
        time.sleep(0.01)
    assert "peer reset the connection in the middle of a message; closing" in caplog.text
    _still_serves(chain)


def _open_idle(address, count: int) -> list:
    """``count`` connections that send nothing (closed by the caller)."""
    return [socket.create_connection(address, timeout=5) for _ in range(count)]


def test_idle_connections_at_the_limit_make_room_for_a_user(chain_factory, caplog):
    """A new connection at --max-connections closes the one quiet longest instead of being
    refused, so idle peers cannot lock users out until their idle timeout."""
    from skippy_wire.net.admission import StageLimits

    chain = chain_factory([(0, 6)], limits=StageLimits(max_connections=4))
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    idle = _open_idle(chain.entry, 12)
    try:
        time.sleep(0.2)
        _still_serves(chain)
        assert sum(not _wait_closed(sock, 0.5) for sock in idle) <= 4
        assert _wait_closed(idle[0], 0.5)  # the oldest went first
        assert "to make room" in caplog.text
        # each shed connection's own line says the stage closed it (it read "closed by peer",
        # or an ERROR for one shed in its setup or mid-message)
        ours = {f"127.0.0.1:{sock.getsockname()[1]}:" for sock in idle}  # (other tests' servers log too)

        def lines_of_ours() -> list:
            return [r for r in caplog.records if any(port in r.getMessage() for port in ours)]

        deadline = time.monotonic() + 5
        while sum("to make room" in r.getMessage() for r in lines_of_ours()) < 8 and time.monotonic() < deadline:
            time.sleep(0.01)
        ends = [r for r in lines_of_ours() if "closed by this stage to make room (max-connections)" in r.getMessage()]
        assert len(ends) >= 8 and {r.levelno for r in ends} == {logging.INFO}
        assert not [r for r in lines_of_ours() if r.levelno >= logging.ERROR or "closed by peer" in r.getMessage()]
    finally:
        for sock in idle:
            sock.close()


def test_a_session_is_never_shed_and_a_shed_downstream_link_is_reopened(chain_factory, caplog):
    from skippy_wire.net.admission import StageLimits
    from skippy_wire.net.schedule import decode_message, prefill_messages

    chain = chain_factory([(0, 3), (3, 6)], limits=StageLimits(max_connections=3))
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as busy, PipelineClient(*chain.entry, timeout=10) as later:
        for msg in prefill_messages(PROMPT, 16, 1, 1):
            first = busy.request(msg).predicted  # holds a session on both stages
        # Idle connections straight to stage 1 shed its quiet links from stage 0 (later's),
        # never the one holding busy's session.
        idle = _open_idle(chain.servers[1].address, 6)
        try:
            time.sleep(0.2)
            assert busy.request(decode_message(first, len(PROMPT), 0, len(PROMPT), 1, 1)).predicted \
                == fake_reference(PROMPT, 2, chunk=16)[1]
            assert later.generate(PROMPT, max_tokens=3, chunk_size=4).tokens == fake_reference(PROMPT, 3)
        finally:
            for sock in idle:
                sock.close()
    assert "downstream had closed the idle link; reconnected" in caplog.text


def test_a_downstream_that_writes_unasked_is_named_so_when_its_link_is_reopened(caplog):
    """Bytes a downstream sent between messages were logged as "downstream had closed the idle
    link": the link is reopened either way, but the line must say what the peer did."""
    fake = socket.create_server(("127.0.0.1", 0))
    accepted = []

    def answer() -> None:  # READY, then a byte nobody asked for, on every link
        while True:
            try:
                conn, _ = fake.accept()
            except OSError:
                return
            accepted.append(conn)
            conn.sendall(READY_BYTES + b"x")

    answering = threading.Thread(target=answer, daemon=True)
    answering.start()
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    server = StageServer(FakeBackend(0, 3, 0), stage_config(0, 0, 3, "raw-f32-v1", "fixed"),
                         downstream=fake.getsockname(), io_timeout=5.0, reply_timeout=1.0)
    server.start()
    try:
        with PipelineClient(*server.address, timeout=5) as client, pytest.raises(PipelineError):
            client.request(next(prefill_messages(PROMPT, 16, 1, 1)))
    finally:
        server.shutdown()
        fake.shutdown(socket.SHUT_RDWR)  # wakes its accept() (close() alone does not)
        fake.close()
        answering.join(5)
        for conn in accepted:
            conn.close()
    assert not answering.is_alive()
    lines = [r for r in caplog.records if "reconnected" in r.getMessage()]
    assert lines and "downstream sent bytes nobody asked for; reconnected" in lines[0].getMessage()
    assert lines[0].levelno == logging.WARNING and "had closed the idle link" not in caplog.text


@pytest.mark.parametrize("mistake", ["max_tokens", "token", "chunk_size"])
def test_a_generation_refused_for_a_bad_argument_leaves_the_client_usable(chain_factory, mistake):
    """max_tokens="4" failed after the prefill, a token out of range after ConfigureGeneration:
    the stages kept the session, and the next generation of that session id was refused."""
    chain = chain_factory([(0, 3), (3, 6)])
    bad = {"max_tokens": {"max_tokens": "4"}, "token": {"prompt": [5, 2**40]}, "chunk_size": {"chunk_size": 0}}
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises((TypeError, ValueError)):
            client.generate(**{"prompt": PROMPT, "max_tokens": 4, "chunk_size": 4, **bad[mistake]})
        assert client.generate(PROMPT, max_tokens=4, chunk_size=4).tokens == fake_reference(PROMPT, 4)
    assert all(s.freed for b in chain.backends for s in b.sessions)


def test_an_interrupted_generation_closes_the_client_and_its_calls_say_so(chain_factory):
    """Ctrl-C in a generation left the client open with a reply unread: the next request read
    it as its own ("expected Ack, got reply kind 2").  A closed client raised a bare OSError."""
    chain = chain_factory([(0, 3), (3, 6)])

    def interrupt(token: int) -> None:
        raise KeyboardInterrupt

    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(KeyboardInterrupt):
            client.generate(PROMPT, max_tokens=6, chunk_size=4, on_token=interrupt)
        assert not client.alive()
        with pytest.raises(PipelineError, match=r"this client is closed; ConfigureGeneration not sent$"):
            client.generate(PROMPT, max_tokens=4, chunk_size=4)
    with PipelineClient(*chain.entry, timeout=10) as client:
        assert client.generate(PROMPT, max_tokens=4, chunk_size=4).tokens == fake_reference(PROMPT, 4)


def test_a_client_refuses_a_second_thread_while_one_request_runs(chain_factory):
    """Two threads on one client had their replies crossed ("expected Ack, got reply kind 2")."""
    chain = chain_factory([(0, 3), (3, 6)])
    inside, go_on = threading.Event(), threading.Event()

    def wait_once(token: int) -> None:
        inside.set()
        assert go_on.wait(10)

    with PipelineClient(*chain.entry, timeout=10) as client:
        first = threading.Thread(target=lambda: results.append(
            client.generate(PROMPT, max_tokens=3, chunk_size=4, on_token=wait_once)))
        results: list = []
        first.start()
        assert inside.wait(10)
        with pytest.raises(PipelineError, match="this client is carrying another thread's request"):
            client.generate(PROMPT, max_tokens=3, chunk_size=4, session_id=2)
        with pytest.raises(PipelineError, match="another thread's request"):
            client.request(StageWireMessage.stop(9, 9))
        go_on.set()
        first.join(10)
        assert results[0].tokens == fake_reference(PROMPT, 3)
        assert client.generate(PROMPT, max_tokens=3, chunk_size=4, session_id=2).tokens == fake_reference(PROMPT, 3)


@pytest.mark.parametrize("kwargs, error", [
    ({"max_tokens": -1}, "max_tokens must be at least 0, got -1"),  # the CLI's -1 ("until full") is no count here
    ({"max_tokens": 2.0}, "max_tokens must be an int, not float"),
    ({"chunk_size": 0}, "chunk_size must be at least 1, got 0"),
    ({"prompt": []}, "the prompt must have at least one token"),
    ({"prompt": np.array(5)}, "prompt must be a sequence of token ids, not ndarray"),  # "iteration over a 0-d array"
])
def test_both_generators_refuse_the_same_arguments_before_running(chain_factory, kwargs, error):
    """generate(max_tokens=-5) returned no tokens, generate_local's empty prompt was a TypeError."""
    chain = chain_factory([(0, 6)])
    args = {"prompt": PROMPT, "max_tokens": 2, "chunk_size": 4, **kwargs}
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises((TypeError, ValueError), match=f"^{re.escape(error)}$"):
            client.generate(**args)
    with pytest.raises((TypeError, ValueError), match=f"^{re.escape(error)}$"):
        generate_local("no-such-model.gguf", **args)  # refused before the model is opened


@pytest.mark.parametrize("kwargs, error, message", [
    ({"session_id": "1"}, TypeError, "session_id must be an int, not str"),  # the wire encoder's ValueError
    ({"request_id": -1}, ValueError, "request_id must be from 0 to 18446744073709551615, got -1"),
    ({"sampling": "greedy"}, TypeError, "sampling must be a SamplingConfig or None, not str"),
])
def test_a_generation_s_ids_and_sampling_are_checked_in_the_callers_words(chain_factory, kwargs, error, message):
    chain = chain_factory([(0, 6)])
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(error) as refused:
            client.generate(PROMPT, max_tokens=2, **kwargs)
        assert str(refused.value) == message
        assert client.generate(PROMPT, max_tokens=2, session_id=np.uint64(7)).tokens \
            == client.generate(PROMPT, max_tokens=2, session_id=7).tokens


@pytest.mark.parametrize("timeout", [0, -1, float("nan"), float("inf"), 1e12])
def test_a_client_timeout_must_be_seconds_above_zero(chain_factory, timeout):
    """0 said "operation now in progress", -1 a bare "Timeout value out of range"; inf and
    1e12 an OverflowError ("timestamp out of range for platform time_t") from the connect."""
    chain = chain_factory([(0, 6)])
    with pytest.raises(ValueError, match="^timeout must be a number of seconds above 0 and at most 1000000, got "):
        PipelineClient(*chain.entry, timeout=timeout)


@pytest.mark.parametrize("threads", [0, -3, 513])
def test_a_thread_count_an_embedder_gives_is_checked(threads):
    with pytest.raises(ValueError, match=f"threads must be between 1 and {MAX_THREADS}"):
        resolved_threads(threads)
    assert resolved_threads(None) >= 1 and resolved_threads(3) == 3
    assert resolved_threads(np.int64(2)) == 2 and type(resolved_threads(np.int64(2))) is int  # was a ValueError
    for wrong in (1.5, "2", True):
        with pytest.raises(TypeError, match="threads must be an int or None, not "):
            resolved_threads(wrong)


@pytest.mark.parametrize("kwargs, error, text", [
    ({"protocol": 18}, ValueError, "protocol must be one of 15, 16, 17, got 18"),
    ({"io_timeout": -1}, ValueError, "io_timeout must be a number of seconds above 0"),
    ({"reply_timeout": 0}, ValueError, "reply_timeout must be a number of seconds above 0"),
    ({"idle_timeout": float("nan")}, ValueError, "idle_timeout must be a number of seconds above 0"),
    ({"poll_s": "x"}, TypeError, "poll_s must be a number of seconds, not str"),
    ({"link_delay": -0.5}, ValueError, "link_delay must be a number of seconds from 0"),
    ({"port": 70000}, ValueError, "port must be from 0 to 65535, got 70000"),
    ({"port": True}, TypeError, "port must be an int, not bool"),
    ({"host": None}, TypeError, "host must be a host name or address (a str), not NoneType"),
])
def test_a_stage_server_checks_its_arguments_before_it_binds(kwargs, error, text):
    """protocol=18, io_timeout=-1 or poll_s="x" were taken, and every connection then failed with a
    traceback in the log (port=70000 gave a raw OverflowError from bind)."""
    with pytest.raises(error, match=f"^{re.escape(text)}"):
        StageServer(FakeBackend(3, N_LAYER, 1), stage_config(1, 3, N_LAYER, "raw-f32-v1", "fixed"), **kwargs)


def test_a_stage_server_serves_with_the_numbers_its_check_takes(chain_factory):
    """A numpy float timeout passed the check and then failed every connection in settimeout()."""
    chain = chain_factory([(0, 3), (3, N_LAYER)], io_timeout=np.float32(5), reply_timeout=Fraction(5))
    assert all(type(server.io_timeout) is float and type(server.reply_timeout) is float for server in chain.servers)
    with PipelineClient(*chain.entry, timeout=10) as client:
        assert client.generate(PROMPT, max_tokens=4, chunk_size=4).tokens == fake_reference(PROMPT, 4)
    server = StageServer(FakeBackend(0, N_LAYER), stage_config(0, 0, N_LAYER, "raw-f32-v1", "fixed"), host="")
    assert server.address[0] == "0.0.0.0"  # "" binds every interface, as Python's own servers take it
    server.shutdown()
