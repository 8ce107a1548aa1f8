"""The ggml stage backend binding on the tiny random llama GGUF: batches, bad input and
files, threading (the GIL is released around compute), logging and memory ownership."""

from __future__ import annotations

import gc
import struct
import sys
import threading
from pathlib import Path

import gguf
import numpy as np
import pytest

from backend_helpers import (  # noqa: F401  (fixtures)
    N_EMBD,
    N_LAYER,
    N_VOCAB,
    PROMPT,
    open_model,
    ref,
    retried,
    run_decode,
    run_prefill,
    run_verify,
    status_of,
    tiny_path,
)
from skippy_wire.errors import StageRuntimeError, Status
from skippy_wire.stage import _backend as B
from skippy_wire.stage import _ggml


# ---- batches ------------------------------------------------------------------------------


def test_iteration_batch_matches_single_calls(tiny_path):
    m_a = open_model(tiny_path, layer_end=2, lane_count=2)
    m_b = open_model(tiny_path, layer_start=2, lane_count=2, stage_index=1)
    a1, a2 = m_a.create_session(), m_a.create_session()
    b1, b2 = m_b.create_session(), m_b.create_session()
    reqs = [(a1, PROMPT, None, None, None, None, True), (a2, PROMPT[:3], None, None, None, None, False)]
    with pytest.raises(StageRuntimeError) as error:
        B.iteration_batch_sampled(reqs, [0, 0], 2)
    need = error.value.required
    assert error.value.status == Status.BUFFER_TOO_SMALL and need == [5 * 256, 3 * 256] and a1.position == 0
    ra = B.iteration_batch_sampled(reqs, need, 2)
    assert (ra.sampled_request_indexes, ra.predicted_tokens) == ([], [])  # non-terminal: no samples
    assert [len(p) for p in ra.out_payloads] == ra.out_bytes == need
    reqs_b = [(b1, PROMPT, None, None, ra.out_descs[0], ra.out_payloads[0], True),
              (b2, PROMPT[:3], None, None, ra.out_descs[1], ra.out_payloads[1], False)]
    rb = B.iteration_batch_sampled(reqs_b, [0, 0], 2)
    assert rb.sampled_request_indexes == [0] and len(rb.predicted_tokens) == 1 and rb.out_payloads == [b"", b""]
    pred = rb.predicted_tokens
    single = open_model(tiny_path).create_session()
    assert pred[0] == run_prefill(single, PROMPT)[2]
    assert (a1.position, a2.position, b1.position, b2.position) == (5, 3, 5, 3)
    # decode batch on both lanes
    with pytest.raises(StageRuntimeError) as error:
        B.decode_step_frame_batch_sampled([a1, a2], [pred[0], 9], [None, None], [None, None], [None, None], [0, 0], 2)
    assert error.value.status == Status.BUFFER_TOO_SMALL and error.value.required == [256, 256]
    da = B.decode_step_frame_batch_sampled([a1, a2], [pred[0], 9], [None, None], [None, None], [None, None],
                                           error.value.required, 2)
    db = B.decode_step_frame_batch_sampled([b1, b2], [pred[0], 9], [None, None], da.out_descs, da.out_payloads,
                                           [0, 0], 2)
    assert len(db.predicted_tokens) == 2 and db.sampled_request_indexes == [0, 1]
    assert db.predicted_tokens[0] == run_decode(single, pred[0])[2]


def test_batch_bad_input(tiny_path):
    m = open_model(tiny_path, lane_count=2)
    s = m.create_session()
    assert status_of(B.iteration_batch_sampled, [(None, PROMPT, None, None, None, None, True)], [0], 1)[0] \
        == Status.INVALID_ARGUMENT
    st, msg = status_of(B.iteration_batch_sampled, [(s, PROMPT, None, None, None, None, True)] * 2, [0, 0], 2)
    assert st == Status.INVALID_ARGUMENT and "repeats" in msg
    st, msg = status_of(B.iteration_batch_sampled, [(s, [999], None, None, None, None, True)], [0], 1)
    assert st == Status.INVALID_ARGUMENT and s.position == 0
    assert status_of(B.decode_step_frame_batch_sampled, [None], [1], [None], [None], [None], [0], 1)[0] \
        == Status.INVALID_ARGUMENT
    assert B.iteration_batch_sampled([], [], 0).out_descs == []


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("start,end", [(-1, 2), (2, 2), (3, 1), (0, 5)])
def test_bad_layer_range(tiny_path, start, end):
    with pytest.raises(StageRuntimeError) as e:
        B.Model(tiny_path, layer_start=start, layer_end=end)
    assert e.value.status == Status.INVALID_ARGUMENT and "layer range" in e.value.message


def test_bad_model_files(tmp_path, tiny_path):
    with pytest.raises(StageRuntimeError) as e:
        B.Model(str(tmp_path / "missing.gguf"))
    assert e.value.status == Status.IO_ERROR
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(StageRuntimeError) as e:
        B.Model(str(junk))
    assert e.value.status == Status.MODEL_ERROR
    data = Path(tiny_path).read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(StageRuntimeError) as e:
        B.Model(str(cut))
    assert e.value.status == Status.MODEL_ERROR
    with pytest.raises(StageRuntimeError) as e:
        B.Model(tiny_path, ctx_size=0)
    assert e.value.status == Status.INVALID_ARGUMENT


def test_more_threads_than_ggml_can_run_is_an_invalid_argument(tiny_path):
    # ggml aborts the whole process when it cannot start a worker; 10**6 threads never start.
    for n_threads in (513, 10**6):
        with pytest.raises(StageRuntimeError) as e:
            B.Model(tiny_path, n_threads=n_threads)
        assert e.value.status == Status.INVALID_ARGUMENT and f"n_threads {n_threads}" in e.value.message


def test_a_layer_range_to_the_end_is_reported_with_its_end(tiny_path):
    with pytest.raises(StageRuntimeError) as e:
        B.Model(tiny_path, layer_start=4, layer_end=-1)
    assert e.value.message == "invalid layer range [4, 4) for a model with 4 layers"


def test_an_optional_input_part_is_named_in_the_refusal(tiny_path):
    a = open_model(tiny_path, layer_end=2)
    b = open_model(tiny_path, layer_start=2, stage_index=1)
    d, p, _ = run_prefill(a.create_session(), [1, 2])
    optional = bytearray(d)
    struct.pack_into("<I", optional, 72 + 44, 1)  # parts[0].flags = ACTIVATION_PART_OPTIONAL
    status, message = status_of(b.create_session().prefill_chunk_frame, [1, 2], input_desc=bytes(optional),
                                input_payload=p)
    assert status == Status.INVALID_ARGUMENT and message.endswith("offset 0, flags 1)")


def test_unknown_architecture(tmp_path):
    p = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(StageRuntimeError) as e:
        B.Model(str(p))
    assert e.value.status == Status.UNSUPPORTED and "mamba" in e.value.message


def test_bad_frames_leave_the_session_unchanged(tiny_path):
    a = open_model(tiny_path, layer_end=2).create_session()
    b = open_model(tiny_path, layer_start=2).create_session()
    c = open_model(tiny_path, layer_start=3).create_session()
    d, p, _ = run_prefill(a, PROMPT)

    def status(session, tokens, desc, payload):
        return status_of(session.prefill_chunk_frame, tokens, sample=True, input_desc=desc, input_payload=payload)

    assert status(b, PROMPT, None, None)[0] == Status.INVALID_ARGUMENT  # needs a frame
    assert status(c, PROMPT, d, p)[0] == Status.INVALID_ARGUMENT  # frame ends at 2, stage starts at 3
    st, msg = status(b, PROMPT[:4], d, p)
    assert st == Status.INVALID_ARGUMENT and "tokens" in msg  # token count mismatch
    st, msg = status(b, PROMPT, d, p[:-4])
    assert st == Status.INVALID_ARGUMENT and "does not match descriptor payload_bytes" in msg
    bad = bytearray(d)
    bad[40] ^= 1  # frontier identity
    assert status(b, PROMPT, bytes(bad), p)[0] == Status.INVALID_ARGUMENT
    bad = bytearray(d)
    struct.pack_into("<q", bad, 120, 32)  # width
    assert status(b, PROMPT, bytes(bad), p)[0] == Status.INVALID_ARGUMENT
    st, msg = status(a, PROMPT, d, p)
    assert st == Status.INVALID_ARGUMENT and "token input" in msg  # source takes tokens only
    assert status(a, [N_VOCAB], None, None)[0] == Status.INVALID_ARGUMENT
    assert status(a, [], None, None)[0] == Status.INVALID_ARGUMENT
    assert status_of(a.prefill_chunk_frame, PROMPT, positions=[0, 1], capacity=10**6)[0] == Status.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        b.prefill_chunk_frame(PROMPT, input_desc=d[:100], input_payload=p)
    assert (a.position, b.position, c.position) == (5, 0, 0)
    assert status(b, PROMPT, d, p)[0] == Status.OK


def test_context_full_is_a_clear_error(tiny_path):
    s = open_model(tiny_path, ctx_size=8).create_session()
    st, msg = status_of(s.prefill_chunk_frame, list(range(3, 12)), sample=True)
    assert st == Status.RUNTIME_ERROR and "context full" in msg and s.position == 0
    run_prefill(s, list(range(3, 11)))
    assert status_of(s.decode_step_frame_sampled, 5)[0] == Status.RUNTIME_ERROR and s.position == 8


def ran_while_inside(call, attempts=20):
    """Whether another Python thread ever ran while ``call()`` was inside native code.

    The switch interval is raised far above the call's length, so the calling thread never
    hands the GIL over on its own: a waiting thread can run before ``call()`` returns only
    if the call releases the GIL.  The watcher is woken right before the call and records
    whether the call was still in progress when it first got the GIL; holding the GIL makes
    that impossible on every attempt, releasing it makes it certain on an idle machine and
    likely on each of several attempts on a loaded one.
    """
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)
    try:
        for _ in range(attempts):
            inside, go, seen = [False], threading.Event(), []
            watcher = threading.Thread(target=lambda: (go.wait(), seen.append(inside[0])))
            watcher.start()
            inside[0] = True
            go.set()
            call()
            inside[0] = False
            watcher.join()
            if seen == [True]:
                return True
        return False
    finally:
        sys.setswitchinterval(interval)


def test_ran_while_inside_tells_a_held_gil_from_a_released_one():
    assert not ran_while_inside(lambda: sum(range(3_000_000)), attempts=3)  # C loop, GIL held
    assert ran_while_inside(lambda: threading.Event().wait(0.02))  # blocks with the GIL released


def test_compute_releases_the_gil(tiny_path):
    long_prompt = [(7 * i + 3) % N_VOCAB for i in range(200)]
    session = open_model(tiny_path, n_threads=1, ctx_size=256).create_session()

    def verify():
        session.reset()
        session.verify_tokens_frame_sampled(long_prompt)

    assert ran_while_inside(verify)
    batch = open_model(tiny_path, n_threads=1, ctx_size=256, lane_count=2)
    pair = [batch.create_session(), batch.create_session()]

    def iteration():
        for s in pair:
            s.reset()
        B.iteration_batch_sampled([(s, long_prompt, None, None, None, None, True) for s in pair], [0, 0], 2)

    assert ran_while_inside(iteration)


def test_a_session_busy_in_another_thread_refuses_calls_and_is_freed_when_free(tiny_path):
    """Sessions are not shared (docs/runtime.md, "Threads"): a call overlapping another thread's call on
    the same session raced on its native state (two prefills both at position 0, the
    history vector grown from two threads), and a close() freed the session under the
    running call.  Now the overlapping call is refused and the close waits for the call."""
    prompt = [(7 * i + 3) % N_VOCAB for i in range(200)]
    model = open_model(tiny_path, n_threads=1, ctx_size=256)
    want = run_verify(model.create_session(), prompt)[2]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(60.0)  # the watcher runs before the call returns only if the call releases the GIL
    try:
        for _ in range(20):
            session = model.create_session()
            inside, go, seen = [False], threading.Event(), []

            def watch():
                go.wait()
                if not inside[0]:
                    return
                for call in (lambda: session.position, lambda: session.trim(0),
                             lambda: B.iteration_batch_sampled([(session, [1], None, None, None, None, True)], [0], 1)):
                    seen.append("refused" if _refused(call) else "ran")
                session.close()
                seen.append("closed")

            watcher = threading.Thread(target=watch)
            watcher.start()
            inside[0] = True
            go.set()
            got = session.verify_tokens_frame_sampled(prompt).predicted_tokens
            inside[0] = False
            watcher.join()
            if seen:
                break
            session.close()
        else:
            pytest.fail("the watcher never ran while the call was inside native code")
    finally:
        sys.setswitchinterval(interval)
    assert seen == ["refused", "refused", "refused", "closed"] and got == want
    with pytest.raises(ValueError, match="^Session is closed$"):
        session.position


def _refused(call) -> bool:
    try:
        call()
    except StageRuntimeError as exc:
        return str(exc) == B.SESSION_BUSY
    return False


def test_threads_on_two_models_agree(tiny_path):
    m1, m2 = open_model(tiny_path, n_threads=1), open_model(tiny_path, n_threads=1)
    want = run_verify(m1.create_session(), PROMPT)[2]
    results = {}

    def work(i, model):
        s = model.create_session()
        out = []
        for _ in range(5):
            s.reset()
            out.append(run_verify(s, PROMPT)[2])
        results[i] = out

    threads = [threading.Thread(target=work, args=(i, m)) for i, m in enumerate((m1, m2))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results[0] == results[1] == [want] * 5


def test_log_callback_receives_ggml_messages(tmp_path):
    lines = []
    B.set_log_callback(lambda level, text: lines.append(text))
    try:
        junk = tmp_path / "junk.gguf"
        junk.write_bytes(b"GGUF" + b"\xff" * 64)
        with pytest.raises(StageRuntimeError):
            B.Model(str(junk))
    finally:
        B.set_log_callback(None)
    assert lines  # gguf's reader explains why it failed


def test_ggml_preload_helper():
    root = _ggml.libggml_root()
    assert (root / "lib64" / "libggml-base.so.0").is_file() and (root / "include" / "ggml.h").is_file()
    _ggml.preload()
    _ggml.preload()  # idempotent
    assert _ggml.load_backend() is B


def test_decode_across_kv_padding_boundaries(tiny_path, ref):
    # KV views are padded to 64 cells and the graph is reused while the shape holds;
    # crossing 64 and ending at ctx_size exercises both the rebuild and the clamp.
    tokens = [(7 * i + 3) % N_VOCAB for i in range(70)]
    s = open_model(tiny_path, ctx_size=70).create_session()
    run_prefill(s, tokens[:60])
    want = ref.forward(tokens)
    for i in range(60, 70):
        run_decode(s, tokens[i])
        got = np.frombuffer(s.copy_logits(), dtype=np.float32)
        assert np.max(np.abs(got - want[i])) < 1e-3, i


def test_model_and_session_free_in_any_order(tiny_path):
    m = open_model(tiny_path, lane_count=2)
    s = m.create_session()
    m.close()  # the session keeps the native model alive
    assert run_prefill(s, PROMPT)[2] >= 0
    with pytest.raises(ValueError):
        m.create_session()
    s.close()
    for _ in range(5):  # a cycle collected as a whole
        m = open_model(tiny_path, lane_count=2)
        box = [m, m.create_session(), m.create_session()]
        box.append(box)
        del m, box
        gc.collect()


@pytest.mark.parametrize("cut", [None, 2], ids=["terminal", "exporting"])
def test_batched_graph_equals_single_sessions(tiny_path, cut):
    # Batches run as one multi-session graph; every session must see exactly what it
    # would see alone (rows, logits, positions), including different cache lengths.
    prompts = [PROMPT, PROMPT[:2], [7, 8, 9, 10, 11, 12, 13]]
    m = open_model(tiny_path, layer_end=cut or N_LAYER, lane_count=3)
    batch = [m.create_session() for _ in prompts]
    alone = [open_model(tiny_path, layer_end=cut or N_LAYER).create_session() for _ in prompts]

    def outputs(session):
        if m.is_terminal:
            return np.frombuffer(session.copy_logits(), dtype=np.float32)
        return np.frombuffer(session.copy_output_activation_frame(1, capacity=4 * N_EMBD).out_payload, dtype=np.float32)

    reqs = [(s, t, None, None, None, None, True) for s, t in zip(batch, prompts)]
    try:
        result = B.iteration_batch_sampled(reqs, [0] * 3, 3)
    except StageRuntimeError as error:  # exporting stage: retry with the reported sizes
        assert error.status == Status.BUFFER_TOO_SMALL
        result = B.iteration_batch_sampled(reqs, error.required, 3)
    pays, idx, pred = result.out_payloads, result.sampled_request_indexes, result.predicted_tokens
    singles = [run_prefill(s, t) for s, t in zip(alone, prompts)]
    for r in range(3):
        assert np.max(np.abs(outputs(batch[r]) - outputs(alone[r]))) < 1e-4
        if m.is_terminal:
            assert pred[r] == singles[r][2] and idx[r] == r
        else:
            assert np.max(np.abs(np.frombuffer(pays[r], np.float32) - np.frombuffer(singles[r][1], np.float32))) < 1e-4
    tokens = [3, 4, 5]
    for step in range(3):
        caps = [0] * 3 if m.is_terminal else [4 * N_EMBD] * 3
        B.decode_step_frame_batch_sampled(batch, tokens, [None] * 3, [None] * 3, [None] * 3, caps, 3)
        for r in range(3):
            run_decode(alone[r], tokens[r])
            assert np.max(np.abs(outputs(batch[r]) - outputs(alone[r]))) < 1e-4, (step, r)
        tokens = [t + 1 for t in tokens]
    assert [s.position for s in batch] == [len(p) + 3 for p in prompts]


def test_mutated_descriptors_never_crash(tiny_path):
    # Any byte of the descriptor's header and part may be wrong: native answers with a
    # status, and only an exactly valid frame moves the session.
    a = open_model(tiny_path, layer_end=2).create_session()
    b = open_model(tiny_path, layer_start=2).create_session()
    d, p, _ = run_prefill(a, PROMPT)
    rng = np.random.default_rng(7)
    for _ in range(300):
        bad = bytearray(d)
        for _ in range(int(rng.integers(1, 4))):
            bad[int(rng.integers(0, 72 + 128))] = int(rng.integers(0, 256))
        payload_bytes = struct.unpack_from("<Q", bad, 32)[0]
        payload = p if payload_bytes == len(p) else p[: min(len(p), payload_bytes)]
        before = b.position
        st, msg = status_of(b.prefill_chunk_frame, PROMPT, sample=True, input_desc=bytes(bad), input_payload=payload)
        assert st in (Status.OK, Status.INVALID_ARGUMENT), msg
        assert b.position == before + (len(PROMPT) if st == Status.OK else 0)
        if st == Status.OK:
            b.reset()
