"""The server's runtime adapter (``RuntimeBackend``) over ``skippy_wire.stage.runtime`` on the
tiny generated GGUF: split stages behind TCP give the tokens of one whole stage."""

from __future__ import annotations

import logging
import threading
import time
import types

import numpy as np
import pytest

from skippy_wire.net.batching import DecodeBatcher, DecodeStep
from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.schedule import prefill_messages
from skippy_wire.stage import models
from skippy_wire.stage.runtime import ActivationDesc, StageModel
from skippy_wire.net.backend import RuntimeBackend
from skippy_wire.net.server import StageServer
from skippy_wire.tools.serve import stage_config
from skippy_wire.wire.messages import StageWireMessage

import fake_native
from fake_native import FAKE

PROMPT = [3, 1, 4, 1, 5, 9, 2, 6]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"))


def _open(tiny, start, end, index):
    return RuntimeBackend(StageModel.open(tiny, start, end, stage_index=index, lane_count=4, n_threads=1))


def _reference(tiny, max_tokens, chunk):
    model = StageModel.open(tiny, 0, None, lane_count=1, n_threads=1)
    session = model.create_session()
    token = None
    for start in range(0, len(PROMPT), chunk):
        if start + chunk >= len(PROMPT):
            token, _ = session.prefill_chunk_frame_sampled(PROMPT[start:start + chunk], None)
        else:
            session.prefill_chunk_frame(PROMPT[start:start + chunk])
    out = [token]
    while len(out) < max_tokens:
        token, _ = session.decode_step_frame_sampled(token, None)
        out.append(token)
    return out


@pytest.mark.parametrize("splits", [[(0, 4)], [(0, 2), (2, 4)], [(0, 1), (1, 3), (3, 4)]], ids=["1", "2", "3"])
@pytest.mark.parametrize("codec,policy", [("raw-f32-v1", "fixed"), ("bf16-rne-v1", "fixed"),
                                          ("raw-f32-v1", "auto-lossless-v1")])
def test_runtime_stages_match_one_stage(tiny, splits, codec, policy):
    servers = []
    try:
        downstream = None
        for index in reversed(range(len(splits))):
            start, end = splits[index]
            server = StageServer(_open(tiny, start, end, index), stage_config(index, start, end, codec, policy),
                                 downstream=downstream, io_timeout=5, reply_timeout=5)
            server.start()
            servers.insert(0, server)
            downstream = server.address
        with PipelineClient(*servers[0].address, timeout=10) as client:
            result = client.generate(PROMPT, max_tokens=10, chunk_size=3)
    finally:
        for server in servers:
            server.shutdown()
    assert result.tokens == _reference(tiny, 10, 3)
    assert len(result.tokens) == 10


@pytest.mark.parametrize("splits", [[(0, 4)], [(0, 2), (2, 4)]], ids=["1", "2"])
def test_decoding_ahead_changes_no_answer_of_the_runtime(tiny, splits):
    # The first stage computes a lone session's next step before its message arrives; the
    # native caches are trimmed back when the message asks for something else (another
    # token, a rewound position, the next turn's prompt), so every answer is the one a
    # stage gives that waits for its messages.
    from skippy_wire.net.schedule import decode_message

    def drive(ahead: bool) -> tuple[list, int]:
        servers, events = [], []
        try:
            downstream = None
            for index in reversed(range(len(splits))):
                start, end = splits[index]
                server = StageServer(_open(tiny, start, end, index),
                                     stage_config(index, start, end, "raw-f32-v1", "fixed"), downstream=downstream,
                                     io_timeout=5, reply_timeout=5, decode_ahead=ahead, events=events.append)
                server.start()
                servers.insert(0, server)
                downstream = server.address
            n = len(PROMPT)
            with PipelineClient(*servers[0].address, timeout=10) as client:
                out = client.generate(PROMPT, max_tokens=6, chunk_size=3).tokens
                for msg in prefill_messages(PROMPT, 8, 1, 2):
                    out.append(int(client.request(msg).predicted))
                for token, pos in ((out[-1], n), (out[-1] + 1, n + 1), (out[-1], n), (out[-1], n + 1)):
                    out.append(int(client.request(decode_message(token, pos, pos - n, n, 1, 2)).predicted))
                turn = next(prefill_messages([5, 3, 5], 8, 1, 2))
                turn.pos_start = n + 2
                out.append(int(client.request(turn).predicted))
        finally:
            for server in servers:
                server.shutdown()
        deadline = time.monotonic() + 5
        while not any(e["stage"] == 0 for e in events) and time.monotonic() < deadline:
            time.sleep(0.01)
        return out, sum(e.get("decoded_ahead", 0) for e in events if e["stage"] == 0)

    (on, ahead_steps), (off, none) = drive(True), drive(False)
    assert on == off
    assert on[:6] == _reference(tiny, 6, 3)
    assert ahead_steps >= 5 and none == 0


def test_a_step_ahead_past_the_context_is_not_an_error(tiny, caplog):
    # The last step a full context allows is answered; the step after it, computed ahead,
    # cannot run -- that is nobody's error, and the session still stops cleanly.
    ctx = len(PROMPT) + 4
    servers = []
    caplog.set_level(logging.DEBUG, logger="skippy_wire.net.server")
    try:
        downstream = None
        for index, (start, end) in reversed(list(enumerate([(0, 2), (2, 4)]))):
            backend = RuntimeBackend(StageModel.open(tiny, start, end, stage_index=index, ctx_size=ctx,
                                                     lane_count=2, n_threads=1))
            server = StageServer(backend, stage_config(index, start, end, "raw-f32-v1", "fixed"),
                                 downstream=downstream, io_timeout=5, reply_timeout=5)
            server.start()
            servers.insert(0, server)
            downstream = server.address
        with PipelineClient(*servers[0].address, timeout=10) as client:
            tokens = client.generate(PROMPT, max_tokens=5).tokens  # fills the context
            again = client.generate(PROMPT, max_tokens=5, session_id=2).tokens
    finally:
        for server in servers:
            server.shutdown()
    assert tokens == again == _reference(tiny, 5, len(PROMPT))
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert f"no decode ahead at position {ctx}" in caplog.text


@pytest.mark.parametrize("layers", [(0, 2), (0, 4)], ids=["exporting", "terminal"])
def test_a_prefill_chunk_batched_with_a_decode_step_gives_their_results_alone(tiny, layers):
    # One scheduler iteration: session A's decode step beside session B's prompt.  Each
    # gets what it gets alone, and both sessions go on from the same state.
    def sessions():
        backend = _open(tiny, *layers, 0)
        a, b = backend.create_session(), backend.create_session()
        backend.prefill(a, PROMPT, None, 0, sample=True, sampling=None)
        return backend, a, b

    def outcome(results):
        return [(token, None if frame is None else np.frombuffer(bytes(frame.payload), np.float32))
                for token, frame in results]

    def same(xs, ys):  # (the tiny model's f32 products round by the batch's shape: 1 ulp)
        return all(p == q and (f is None) == (g is None) and (f is None or np.allclose(f, g, rtol=1e-5, atol=1e-6))
                   for (p, f), (q, g) in zip(xs, ys)) and len(xs) == len(ys)

    backend, a, b = sessions()
    together = outcome(backend.iteration_batch([DecodeStep(a, 7, None, 0, None),
                                                DecodeStep(b, -1, None, 0, None, tokens=PROMPT[:5])]))
    after = outcome([backend.decode(a, 8, None, 0, sampling=None), backend.decode(b, 9, None, 0, sampling=None)])
    backend, a, b = sessions()
    alone = outcome([backend.decode(a, 7, None, 0, sampling=None),
                     backend.prefill(b, PROMPT[:5], None, 0, sample=True, sampling=None)])
    alone_after = outcome([backend.decode(a, 8, None, 0, sampling=None), backend.decode(b, 9, None, 0, sampling=None)])
    assert same(together, alone) and same(after, alone_after)
    assert (together[1][0] >= 0) == backend.is_terminal  # the prompt's first token, where sampled


def test_a_batch_the_runtime_would_run_request_by_request_is_refused_before_it_runs(tiny):
    # (The runtime runs such a batch one request at a time; a failure midway would leave the
    # first requests done, and the batcher's step-by-step retry would run them again.)
    backend = _open(tiny, 0, 2, 0)
    real = backend.create_session()
    splitting = types.SimpleNamespace(terminal_stage=False, batched_activation_exports=False, token_count=0)
    for run in (backend.decode_batch, backend.iteration_batch):
        with pytest.raises(ValueError, match="must run on its own"):
            run([DecodeStep(real, 1, None, 0, None), DecodeStep(splitting, 2, None, 0, None)])
    assert real.token_count == 0


class _SlowSoloDecode(RuntimeBackend):
    """The real backend, with a lone decode step made slow (50 ms): the tiny model computes in
    microseconds, so without it concurrent steps would rarely meet at a stage."""

    def decode(self, *args, **kwargs):
        time.sleep(0.05)
        return super().decode(*args, **kwargs)


def test_concurrent_sessions_batch_their_decode_steps_and_match_alone(tiny):
    # Four connections decode at once through two stages: steps that meet at a stage run
    # as one native batch, and every session still gets exactly its solo tokens.
    servers = []
    events: list[dict] = []
    try:
        downstream = None
        for index, (start, end) in reversed(list(enumerate([(0, 2), (2, 4)]))):
            backend = _SlowSoloDecode(StageModel.open(tiny, start, end, stage_index=index, lane_count=4, n_threads=1))
            server = StageServer(backend, stage_config(index, start, end, "raw-f32-v1", "fixed"),
                                 downstream=downstream, io_timeout=5, reply_timeout=10, events=events.append)
            server.start()
            servers.insert(0, server)
            downstream = server.address
        prompts = [PROMPT, PROMPT[:5], [7, 7, 8, 9], PROMPT[::-1]]
        alone = []
        for prompt in prompts:
            with PipelineClient(*servers[0].address, timeout=10) as client:
                alone.append(client.generate(prompt, max_tokens=24).tokens)
        together: list = [None] * len(prompts)
        start_line = threading.Barrier(len(prompts))

        def worker(i):
            with PipelineClient(*servers[0].address, timeout=10) as client:
                start_line.wait()
                together[i] = client.generate(prompts[i], max_tokens=24, session_id=i + 1).tokens

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        batched = sum(s.batcher.batched_steps for s in servers)
    finally:
        for server in servers:
            server.shutdown()
    assert together == alone
    assert batched > 0, "no decode step ever ran in a batch"
    assert sum(e["batched_decode_steps"] for e in events if e["event"] == "session") > 0
    # Stage 0 computed steps ahead, through the same batcher, and still every token matches.
    assert sum(e["decoded_ahead"] for e in events if e["event"] == "session" and e["stage"] == 0) > 0


def test_a_failing_batch_fails_only_its_own_session():
    # One step of a batch fails: the batch is retried one step at a time, so the other
    # steps still get their results and only the failing step's thread sees the error.
    lock = threading.Lock()
    calls = []

    def run_batch(steps):
        calls.append(len(steps))
        raise RuntimeError("context full")

    def run_one(step):
        if step.token == 13:
            raise ValueError("session 13 is full")
        return step.token * 2, None

    batcher = DecodeBatcher(run_batch, run_one, lock)
    results = _run_queued_together(batcher, lock, [DecodeStep(None, t, None, 0, None) for t in (1, 13, 3)])
    assert calls == [3]
    assert results[1] == (2, None) and results[3] == (6, None)
    assert isinstance(results[13], ValueError)


def test_each_stretch_of_compute_is_reported_with_the_steps_it_ran():
    # What --trace-compute writes: one (start, end, rows) per batch, rows counting its steps.
    lock, stretches = threading.Lock(), []
    batcher = DecodeBatcher(lambda steps: [(s.token, None) for s in steps], lambda s: (s.token, None), lock,
                            on_compute=lambda *stretch: stretches.append(stretch))
    _run_queued_together(batcher, lock, [DecodeStep(None, t, None, 0, None) for t in (1, 2, 3)])
    batcher.decode(DecodeStep(None, 4, None, 0, None))
    assert [rows for _, _, rows in stretches] == [3, 1]
    assert all(start <= end for start, end, _ in stretches)


def test_a_step_arriving_while_a_lone_session_runs_queues_and_gets_its_own_result():
    """The lone session runs at once, on its own thread; a second session's step that
    arrives meanwhile waits for the runtime and then runs with its own result."""
    lock, started, threads = threading.Lock(), threading.Event(), {}

    def run_one(step):
        threads[step.token] = threading.current_thread().name
        if step.token == 1:
            started.set()
            time.sleep(0.2)
        return step.token * 10, None

    batcher = DecodeBatcher(lambda steps: [run_one(s) for s in steps], run_one, lock)
    first, second = DecodeStep(object(), 1, None, 0, None), DecodeStep(object(), 2, None, 0, None)
    lone = threading.Thread(target=batcher.decode, args=(first,), name="lone")
    lone.start()
    assert started.wait(10)
    assert lock.locked()  # the lone step holds the runtime while it runs
    assert batcher.decode(second) == (20, None)
    lone.join(10)
    assert first.result == (10, None) and first.batch_size == second.batch_size == 1
    assert threads == {1: "lone", 2: threading.current_thread().name}
    assert batcher.queued == 0


class _CountingLock:
    """A runtime lock that records the threads that took it."""

    def __init__(self):
        self._lock, self.takers = threading.Lock(), []

    def acquire(self, blocking=True, timeout=-1):
        got = self._lock.acquire(blocking, timeout)
        if got:
            self.takers.append(threading.current_thread().name)
        return got

    def release(self):
        self._lock.release()

    __enter__ = acquire

    def __exit__(self, *exc):
        self.release()


def test_a_step_run_in_another_threads_batch_returns_without_taking_the_runtime():
    # Once a batch is done its steps' threads return at once: none of them queues for the
    # runtime lock behind the next batch (on a terminal stage that queueing stood between
    # one pair's batch and the next, the GIL passing through every thread in between).
    lock, batches = _CountingLock(), []

    def run_batch(steps):
        batches.append(len(steps))
        return [(s.token * 2, None) for s in steps]

    batcher = DecodeBatcher(run_batch, lambda s: (s.token * 2, None), lock)
    results = _run_queued_together(batcher, lock, [DecodeStep(object(), t, None, 0, None) for t in (1, 2, 3)])
    assert results == {1: (2, None), 2: (4, None), 3: (6, None)} and batches == [3]
    assert lock.takers[0] == threading.current_thread().name and len(lock.takers) == 2  # the test, the runner


def _partner_run(batch_cost_per_row: float, free_two: bool = False) -> list:
    """Four sessions decode at one stage, steps of 0.4 s alone; then session 1's step finds
    the runtime free and session 2's arrives 30 ms later.  Returns the batch sizes of that
    last pair (a partner wait can last up to 0.2 s)."""
    lock = threading.Lock()
    single = 0.4

    def run_one(step):
        time.sleep(single)
        return step.token, None

    def run_batch(steps):
        time.sleep(batch_cost_per_row * single * len(steps))
        return [(s.token, None) for s in steps]

    batcher = DecodeBatcher(run_batch, run_one, lock)
    sessions = [object() for _ in range(4)]
    # Two steps run as one batch (which measures what a batch costs) ...
    _run_queued_together(batcher, lock, [DecodeStep(s, t, None, 0, None) for t, s in enumerate(sessions[2:])])
    for s in sessions[:2]:  # then single steps: all four sessions have decoded here just now
        batcher.decode(DecodeStep(s, 0, None, 0, None))
    if free_two:  # two of the four sessions end: two left, one per stage, nothing to wait for
        batcher.forget(sessions[2])
        batcher.forget(sessions[3])
    first, second = DecodeStep(sessions[0], 1, None, 0, None), DecodeStep(sessions[1], 2, None, 0, None)
    a = threading.Thread(target=batcher.decode, args=(first,))
    a.start()
    time.sleep(0.03)
    batcher.decode(second)
    a.join(10)
    return [first.batch_size, second.batch_size]


def test_a_lone_step_waits_for_a_partner_where_batches_pay():
    assert _partner_run(batch_cost_per_row=0.6) == [2, 2]


def test_no_partner_wait_where_a_batch_costs_as_much_as_its_steps():
    assert _partner_run(batch_cost_per_row=1.0) == [1, 1]


def test_freed_sessions_no_longer_count_as_decoding():
    assert _partner_run(batch_cost_per_row=0.6, free_two=True) == [1, 1]


def _run_queued_together(batcher, lock, steps) -> dict:
    """Hold the runtime while every step queues, then let them run; each token's outcome."""
    results = {}
    with lock:
        threads = [threading.Thread(target=lambda s=s: results.__setitem__(s.token, _outcome(batcher, s)))
                   for s in steps]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while batcher.queued < len(steps) and time.monotonic() < deadline:
            time.sleep(0.005)
    for t in threads:
        t.join(10)
    return results


def _outcome(batcher, step):
    try:
        return batcher.decode(step)
    except Exception as exc:  # noqa: BLE001 -- the test inspects it
        return exc


class _SlowPrefill(RuntimeBackend):
    """The real backend; each prefill chunk takes 150 ms more and is logged with its end time."""

    def __init__(self, model, log):
        super().__init__(model)
        self.log = log

    def prefill(self, *args, **kwargs):
        time.sleep(0.15)
        out = super().prefill(*args, **kwargs)
        self.log.append(time.perf_counter())
        return out


def test_prompts_arriving_while_a_stage_computes_run_together_and_keep_their_tokens(tiny):
    # Continuous batching: while stage 0 spends 150 ms on one prompt alone, the prompts and
    # steps that arrive queue and then run as one scheduler iteration; every session still
    # gets the tokens it gets alone.
    prompts = [PROMPT, PROMPT[:5], [7, 7, 8, 9]]
    servers = []
    try:
        last = StageServer(_open(tiny, 2, 4, 1), stage_config(1, 2, 4, "raw-f32-v1", "fixed"),
                           io_timeout=5, reply_timeout=10)
        last.start()
        first = StageServer(_SlowPrefill(StageModel.open(tiny, 0, 2, stage_index=0, lane_count=4, n_threads=1), []),
                            stage_config(0, 0, 2, "raw-f32-v1", "fixed"), downstream=last.address,
                            io_timeout=5, reply_timeout=10)
        first.start()
        servers = [first, last]
        alone = []
        for prompt in prompts:
            with PipelineClient(*first.address, timeout=10) as client:
                alone.append(client.generate(prompt, max_tokens=8, chunk_size=16).tokens)
        together: list = [None] * len(prompts)
        opened = threading.Barrier(len(prompts))

        def worker(i):
            with PipelineClient(*first.address, timeout=10) as client:
                # Open the session first (creating one waits for the runtime), then come
                # while the first prompt is computing.
                client.request(StageWireMessage.configure_generation(i + 1, i + 1, len(prompts[i]), None, None))
                opened.wait(10)
                time.sleep(0.03 * i)
                together[i] = client.generate(prompts[i], max_tokens=8, chunk_size=16, request_id=i + 1,
                                              session_id=i + 1).tokens

        threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(prompts))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
    finally:
        for server in servers:
            server.shutdown()
    assert together == alone
    assert first.batcher.batched_prefills >= 2


@pytest.mark.parametrize("overlap", [True, False])
def test_prefill_chunks_overlap_across_stages(tiny, overlap):
    # With overlap, stage 0 acknowledges a forwarded PrefillEmbd before stage 1 has computed
    # it, so the driver's next chunk is on its way while stage 1 still works; without, every
    # Ack waits for stage 1.  The tokens are the same either way.
    stage1_done: list[float] = []
    servers = []
    try:
        last = StageServer(_SlowPrefill(StageModel.open(tiny, 2, 4, stage_index=1, lane_count=4, n_threads=1),
                                        stage1_done),
                           stage_config(1, 2, 4, "raw-f32-v1", "fixed"), io_timeout=5, reply_timeout=10)
        last.start()
        first = StageServer(_open(tiny, 0, 2, 0), stage_config(0, 0, 2, "raw-f32-v1", "fixed"),
                            downstream=last.address, io_timeout=5, reply_timeout=10, prefill_overlap=overlap)
        first.start()
        servers = [first, last]
        acks = []
        with PipelineClient(*first.address, timeout=10) as client:
            for msg in prefill_messages(PROMPT, 3, 1, 1):
                reply = client.request(msg)
                acks.append(time.perf_counter())
            assert int(reply.predicted) == _reference(tiny, 1, 3)[0]
    finally:
        for server in servers:
            server.shutdown()
    # acks[0]: the first chunk's Ack; stage1_done[0]: when stage 1 finished that chunk.
    assert (acks[0] < stage1_done[0]) == overlap


def test_decode_path_breakdown_adds_up(tiny):
    # Each stage times a DecodeEmbd's stretches; stage 0's wait for the downstream holds
    # stage 1's whole path, and the driver's round trip holds stage 0's.
    events: list[dict] = []
    servers = []
    try:
        last = StageServer(_SlowSoloDecode(StageModel.open(tiny, 2, 4, stage_index=1, lane_count=4, n_threads=1)),
                           stage_config(1, 2, 4, "raw-f32-v1", "fixed"), io_timeout=5, reply_timeout=10,
                           events=events.append)
        last.start()
        first = StageServer(_open(tiny, 0, 2, 0), stage_config(0, 0, 2, "raw-f32-v1", "fixed"),
                            downstream=last.address, io_timeout=5, reply_timeout=10, events=events.append)
        first.start()
        servers = [first, last]
        with PipelineClient(*first.address, timeout=10) as client:
            send = client._peer.send

            def send_then_stall(data):  # the driver loses its core right after the write
                send(data)
                time.sleep(0.03)

            client._peer.send = send_then_stall
            result = client.generate(PROMPT, max_tokens=6)
    finally:
        for server in servers:
            server.shutdown()
    deadline = time.monotonic() + 5
    while len(events) < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    path = {e["stage"]: e["decode_path_us"] for e in events}
    assert result.decode_messages == 5
    assert all(v >= 0 for p in path.values() for v in p.values())
    assert path[1]["compute"] >= 5 * 50_000  # the slowed decode steps
    assert path[1]["encode"] == path[1]["send"] == path[1]["downstream_wait"] == 0  # terminal
    # (A send ends when the call returns, which may be after the peer already read the bytes:
    # stage 1's queue may start inside stage 0's send, and stage 0's relay may end after the
    # driver has the reply, so the containments count stage 0's send and leave relays out.
    # Each stretch is summed in whole microseconds, hence the slack of one per stretch.)
    slack = 2 * result.decode_messages
    assert path[0]["send"] + path[0]["downstream_wait"] + slack >= path[1]["queue"] + path[1]["compute"]
    assert result.decode_round_trip_s * 1e6 >= path[0]["queue"] + path[0]["compute"] + path[0]["downstream_wait"]


def test_exporting_stage_sizes_its_output_so_each_step_is_one_native_call(tiny):
    """The adapter passes the output size it knows (f32 rows), so the runtime never first
    answers BUFFER_TOO_SMALL and runs the call a second time."""
    FAKE.reset()
    backend = RuntimeBackend(StageModel.open(tiny, 0, 2, stage_index=0, lane_count=4, n_threads=1,
                                             backend=fake_native))
    a, b = backend.create_session(), backend.create_session()
    for session in (a, b):
        _, frame = backend.prefill(session, PROMPT, None, 0, sample=False, sampling=None)
        assert len(frame.payload) == 4 * backend.n_embd * len(PROMPT)
    backend.decode(a, 7, None, 0, sampling=None)
    backend.decode_batch([DecodeStep(a, 8, None, 0, None), DecodeStep(b, 8, None, 0, None)])
    row = 4 * backend.n_embd
    assert [(op, cap) for op, cap in FAKE.calls if op != "decode_batch"] == \
        [("prefill_chunk_frame", row * len(PROMPT))] * 2 + [("decode_step_frame_sampled", row)]
    assert [cap for op, cap in FAKE.calls if op == "decode_batch"] == [[row, row]]
    FAKE.reset()


def test_a_terminal_decode_step_leaves_its_empty_output_frame_unparsed(tiny, monkeypatch):
    backend = _open(tiny, 0, 4, 0)
    sessions = [backend.create_session() for _ in range(3)]
    tokens = [backend.prefill(s, PROMPT, None, 0, sample=True, sampling=None)[0] for s in sessions]
    expected = _reference(tiny, 2, len(PROMPT))[1]
    # Parsing the descriptor cost every token tens of microseconds for a frame nobody reads.
    monkeypatch.setattr(ActivationDesc, "from_bytes", classmethod(lambda cls, data: pytest.fail("parsed")))
    assert backend.decode(sessions[0], tokens[0], None, 0, sampling=None) == (expected, None)
    batch = [DecodeStep(s, token, None, 0, None) for s, token in zip(sessions[1:], tokens[1:])]
    assert backend.decode_batch(batch) == [(expected, None)] * 2


def test_a_forwarding_decode_step_parses_each_output_descriptor_once(tiny, monkeypatch):
    backend, reference = _open(tiny, 0, 2, 0), _open(tiny, 0, 2, 0)
    sessions = [backend.create_session() for _ in range(3)]
    expected_session = reference.create_session()
    for b, s in [(backend, s) for s in sessions] + [(reference, expected_session)]:
        b.prefill(s, PROMPT, None, 0, sample=False, sampling=None)
    expected = [expected_session.decode_step_frame_sampled(token, output_capacity=4 * backend.n_embd)[1]
                for token in (7, 9)]
    parsed = []
    real = ActivationDesc.from_bytes.__func__
    monkeypatch.setattr(ActivationDesc, "from_bytes", classmethod(lambda cls, data: parsed.append(1) or real(cls, data)))
    frames = [backend.decode(sessions[0], token, None, 0, sampling=None)[1] for token in (7, 9)]
    assert [(f.desc, f.payload) for f in frames] == [(f.desc, f.payload) for f in expected]
    assert len(parsed) == 1 and frames[0].payload != frames[1].payload
    batch = backend.decode_batch([DecodeStep(s, 7, None, 0, None) for s in sessions[1:]])
    # Both rows decode the same token after the same prompt; a batch's float sums may
    # differ from a lone step's in the last bits on this f32 model.
    assert [f.desc for _, f in batch] == [expected[0].desc] * 2 and batch[0][1].payload == batch[1][1].payload
    assert len(parsed) == 1  # the batch's rows share the decode step's descriptor
