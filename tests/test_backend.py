"""The ggml stage backend (skippy_wire.stage._backend over skippy_wire/_stage) on the tiny random
llama GGUF (runtime.md §6.2): numerics against the independent numpy forward pass, split
stages against one stage, the BUFFER_TOO_SMALL protocol, session state, sampling, batches
and bad input."""

from __future__ import annotations

import array
import hashlib
import struct
import threading
from pathlib import Path

import numpy as np
import pytest

from numpy_llama import NumpyLlama
from skippy_wire.stage import _backend as B
from skippy_wire.stage import models

PROMPT = [1, 10, 20, 30, 40]
N_LAYER = 4
N_EMBD = 64
N_VOCAB = 256
OK = B.STATUS_OK


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"))


@pytest.fixture(scope="session")
def tiny_f16_path(tmp_path_factory):
    return str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny16") / "tiny-f16.gguf", file_type="f16"))


@pytest.fixture(scope="session")
def ref(tiny_path):
    return NumpyLlama(tiny_path)


def open_model(path, **kw):
    kw.setdefault("n_threads", 2)
    return B.Model(path, **kw)


def pack_sampling(*, enabled=True, ignore_eos=False, seed=0, top_k=0, penalty_last_n=-1, temperature=1.0,
                  top_p=1.0, presence=0.0, frequency=0.0, repeat=1.0, min_p=0.0, logit_bias=(), version=2):
    """SamplingConfig v2 (runtime.md §2.4), 2352 bytes."""
    flags = (1 if enabled else 0) | (2 if ignore_eos else 0)
    head = struct.pack("<IIIiifffffIf", version, flags, seed, top_k, penalty_last_n, temperature, top_p, presence,
                       frequency, repeat, len(logit_bias), min_p)
    # typical_p .. mirostat_learning_rate at their Rust defaults, then sampler_count 0
    rest = struct.pack("<ffffffiiffiffI", 1.0, -1.0, 0.0, 1.0, 0.0, 1.75, 2, 64, 0.0, 0.1, 0, 5.0, 0.1, 0)
    buf = bytearray(2352)
    buf[: len(head)] = head
    buf[48 : 48 + len(rest)] = rest
    struct.pack_into("<I", buf, 168, 1 if ignore_eos else 0)
    for i, (tok, bias) in enumerate(logit_bias):
        struct.pack_into("<if", buf, 304 + 8 * i, tok, bias)
    return bytes(buf)


def desc_fields(desc: bytes):
    version, producer, ls, le, tokens, seqs, parts, _r, payload = struct.unpack_from("<IiiiIIIIQ", desc)
    return dict(version=version, producer=producer, layer_start=ls, layer_end=le, token_count=tokens,
                sequence_count=seqs, part_count=parts, payload_bytes=payload)


def run_prefill(session, tokens, desc=None, payload=None, sample=True, sampling=None, positions=None):
    """Prefill with the BUFFER_TOO_SMALL retry of runtime.md §1.5; returns (desc, payload, token)."""
    st, msg, d, p, nbytes, tok = session.prefill_chunk_frame(tokens, positions=positions, sampling=sampling,
                                                             sample=sample, input_desc=desc, input_payload=payload)
    if st == B.STATUS_BUFFER_TOO_SMALL:
        st, msg, d, p, nbytes, tok = session.prefill_chunk_frame(tokens, positions=positions, sampling=sampling,
                                                                 sample=sample, input_desc=desc,
                                                                 input_payload=payload, capacity=nbytes)
    assert st == OK, msg
    return d, p, tok


def run_decode(session, token, desc=None, payload=None, sampling=None):
    st, msg, d, p, nbytes, tok = session.decode_step_frame_sampled(token, sampling, desc, payload)
    if st == B.STATUS_BUFFER_TOO_SMALL:
        st, msg, d, p, nbytes, tok = session.decode_step_frame_sampled(token, sampling, desc, payload, nbytes)
    assert st == OK, msg
    return d, p, tok


def run_verify(session, tokens, desc=None, payload=None, sampling=None):
    st, msg, d, p, nbytes, preds, draft = session.verify_tokens_frame_sampled(tokens, sampling, desc, payload)
    if st == B.STATUS_BUFFER_TOO_SMALL:
        st, msg, d, p, nbytes, preds, draft = session.verify_tokens_frame_sampled(tokens, sampling, desc, payload,
                                                                                  nbytes)
    assert st == OK, msg
    return d, p, preds


class Pipeline:
    """Stages over contiguous layer ranges, each with one session; frames handed along."""

    def __init__(self, path, cuts, **kw):
        bounds = [0, *cuts, N_LAYER]
        self.models = [open_model(path, stage_index=i, layer_start=a, layer_end=b, **kw)
                       for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        self.sessions = [m.create_session() for m in self.models]

    def prefill(self, tokens, sampling=None):
        d = p = None
        for s in self.sessions:
            d, p, tok = run_prefill(s, tokens, d, p, sampling=sampling)
        return tok

    def decode(self, token, sampling=None):
        d = p = None
        for s in self.sessions:
            d, p, tok = run_decode(s, token, d, p, sampling=sampling)
        return tok

    def verify(self, tokens):
        d = p = None
        for s in self.sessions:
            d, p, preds = run_verify(s, tokens, d, p)
        return preds

    def trim(self, n):
        for s in self.sessions:
            assert s.trim(n)[0] == OK


# ---- ABI ---------------------------------------------------------------------------------


def test_abi_constants_and_struct_sizes():
    assert B.abi_version() == (0, 1, 0)
    assert (B.ACTIVATION_DESC_BYTES, B.ACTIVATION_PART_DESC_BYTES, B.ACTIVATION_BOUNDARY_DESC_BYTES) == (2120, 128, 2088)
    assert (B.SAMPLING_CONFIG_BYTES, B.MTP_DRAFT_BYTES, B.ITERATION_REQUEST_BYTES) == (2352, 56, 72)
    assert [B.STATUS_OK, B.STATUS_ERROR, B.STATUS_INVALID_ARGUMENT, B.STATUS_UNSUPPORTED, B.STATUS_BUFFER_TOO_SMALL,
            B.STATUS_IO_ERROR, B.STATUS_MODEL_ERROR, B.STATUS_RUNTIME_ERROR] == list(range(8))
    f = B.abi_features()
    for bit in (B.FEATURE_RUNTIME_SLICE, B.FEATURE_ACTIVATION_FRAME, B.FEATURE_SESSION_RESET,
                B.FEATURE_SAMPLING_CONFIG, B.FEATURE_BATCH_VERIFY_FRAME, B.FEATURE_LOGIT_BIAS,
                B.FEATURE_SESSION_TRIM, B.FEATURE_ITERATION_BATCH, B.FEATURE_ACTIVATION_BOUNDARY):
        assert f & bit
    assert not f & B.FEATURE_TOKENIZE_DETOKENIZE and not f & B.FEATURE_NATIVE_MTP_N1
    assert B.status_string(B.STATUS_BUFFER_TOO_SMALL) == "buffer_too_small"
    empty = desc_fields(B.empty_activation_desc())
    assert empty["version"] == 0 and empty["producer"] == -1 and empty["payload_bytes"] == 0


def test_model_attributes(tiny_path):
    m = open_model(tiny_path, layer_start=1, layer_end=3, stage_index=2, ctx_size=64, lane_count=3, n_batch=7)
    assert (m.n_layer, m.n_embd, m.n_vocab, m.n_ctx) == (N_LAYER, N_EMBD, N_VOCAB, 64)
    assert (m.layer_start, m.layer_end, m.stage_index, m.lane_count, m.n_batch, m.n_threads) == (1, 3, 2, 3, 7, 2)
    assert m.architecture == "llama" and not m.is_source and not m.is_terminal and m.batched_activation_exports
    full = open_model(tiny_path)
    assert full.layer_end == N_LAYER and full.is_source and full.is_terminal
    assert full.input_activation_boundary() is None and full.output_activation_boundary() is None
    assert B.Model(tiny_path, n_threads=0).n_threads >= 1  # 0 = physical cores


def test_session_cannot_be_constructed_directly():
    with pytest.raises(TypeError):
        B.Session()


# ---- numerics against numpy ---------------------------------------------------------------


@pytest.mark.parametrize("fixture,tol", [("tiny_path", 1e-3), ("tiny_f16_path", 1e-2)])  # ggml rounds F16 matmul inputs to F16
def test_logits_match_numpy_reference(request, fixture, tol):
    path = request.getfixturevalue(fixture)
    ref = NumpyLlama(path)
    want = ref.forward(PROMPT)
    s = open_model(path).create_session()
    _, _, preds = run_verify(s, PROMPT)
    st, msg, raw = s.copy_logits()
    assert st == OK, msg
    got = np.frombuffer(raw, dtype=np.float32).reshape(len(PROMPT), N_VOCAB)
    assert np.max(np.abs(got - want)) < tol
    assert preds == [int(t) for t in want.argmax(axis=1)]


@pytest.mark.parametrize("fixture", ["tiny_path", "tiny_f16_path"])
def test_tiny_model_reproduces_the_spec_reference_rows(request, fixture):
    # runtime.md 6.2: greedy per-row outputs of [1, 10, 20, 30, 40], F32 and F16 alike.
    s = open_model(request.getfixturevalue(fixture)).create_session()
    _, _, preds = run_verify(s, [1, 10, 20, 30, 40])
    assert preds == [221, 181, 221, 92, 56]


def test_exported_rows_match_numpy_residual(tiny_path, ref):
    for cut in (1, 2, 3):
        s = open_model(tiny_path, layer_end=cut).create_session()
        d, p, tok = run_prefill(s, PROMPT)
        assert tok == -1
        rows = np.frombuffer(p, dtype=np.float32).reshape(len(PROMPT), N_EMBD)
        want = ref.forward(PROMPT, layer_end=cut, head=False)
        assert np.max(np.abs(rows - want)) < 1e-4


def test_decode_with_kv_cache_matches_full_forward(tiny_path, ref):
    s = open_model(tiny_path).create_session()
    run_prefill(s, PROMPT[:2])
    for i in range(2, len(PROMPT)):
        run_decode(s, PROMPT[i])
        st, _, raw = s.copy_logits()
        got = np.frombuffer(raw, dtype=np.float32)
        want = ref.forward(PROMPT[: i + 1])[-1]
        assert np.max(np.abs(got - want)) < 1e-3
    assert s.position == len(PROMPT)


# ---- splits -------------------------------------------------------------------------------


def greedy_run(pipe: Pipeline):
    out = [pipe.prefill(PROMPT)]
    for _ in range(4):
        out.append(pipe.decode(out[-1]))
    out.append(pipe.verify([out[-1], 7, 9]))
    pipe.trim(len(PROMPT) + 2)
    out.append(pipe.decode(11))
    return out


@pytest.mark.parametrize("cuts", [[1], [2], [3], [1, 3], [1, 2, 3]], ids=str)
def test_split_stages_equal_one_stage(tiny_path, cuts):
    assert greedy_run(Pipeline(tiny_path, cuts)) == greedy_run(Pipeline(tiny_path, []))


def test_split_output_frame_and_boundaries(tiny_path):
    a = open_model(tiny_path, layer_end=2, stage_index=0)
    b = open_model(tiny_path, layer_start=2, stage_index=1)
    assert a.output_activation_boundary() == b.input_activation_boundary()
    assert len(a.output_activation_boundary()) == 2088 and a.input_activation_boundary() is None
    sa = a.create_session()
    d, p, _ = run_prefill(sa, PROMPT)
    f = desc_fields(d)
    assert f == dict(version=2, producer=0, layer_start=0, layer_end=2, token_count=5, sequence_count=1,
                     part_count=1, payload_bytes=5 * N_EMBD * 4)
    part_identity = d[72:104]
    assert part_identity == hashlib.sha256(b"skippy_wire/llama/residual/64/f32").digest()
    frontier = hashlib.sha256(b"skippy_wire/frontier/v1" + struct.pack("<I", 1) + part_identity
                              + struct.pack("<IIiq", 0, 2, 1, N_EMBD)).digest()
    assert d[40:72] == frontier
    ggml_type, rank, token_axis, flags = struct.unpack_from("<IIiI", d, 104)
    dims = struct.unpack_from("<4q", d, 120)
    strides = struct.unpack_from("<4Q", d, 152)
    assert (ggml_type, rank, token_axis, flags, dims[:2], strides[:2]) == (0, 2, 1, 0, (N_EMBD, 5), (4, 4 * N_EMBD))
    sb = b.create_session()
    d2, p2, tok = run_prefill(sb, PROMPT, d, p)
    assert desc_fields(d2)["version"] == 0 and p2 == b"" and tok >= 0  # terminal: empty frame


def test_n_batch_chunking_and_explicit_positions_agree(tiny_path):
    base = open_model(tiny_path).create_session()
    _, _, want = run_verify(base, PROMPT)
    chunked = open_model(tiny_path, n_batch=2).create_session()
    _, _, got = run_verify(chunked, PROMPT)
    assert got == want
    positioned = open_model(tiny_path).create_session()
    _, _, tok = run_prefill(positioned, PROMPT, positions=array.array("i", range(5)))
    assert tok == want[-1]


# ---- protocol and state -------------------------------------------------------------------


def test_buffer_too_small_is_reported_before_compute_without_state_change(tiny_path):
    s = open_model(tiny_path, layer_end=2).create_session()
    st, msg, d, p, need, tok = s.prefill_chunk_frame(PROMPT)
    assert st == B.STATUS_BUFFER_TOO_SMALL and need == 5 * N_EMBD * 4 and p == b"" and "capacity" in msg
    assert s.position == 0 and desc_fields(d)["version"] == 0
    st, msg, d, p, need2, tok = s.prefill_chunk_frame(PROMPT, capacity=need - 1)
    assert st == B.STATUS_BUFFER_TOO_SMALL and need2 == need and s.position == 0
    st, msg, d, p, n, tok = s.prefill_chunk_frame(PROMPT, capacity=need + 100)
    assert st == OK and n == need and len(p) == need and s.position == 5
    st, *_ = s.copy_output_activation_frame(5)
    assert st == B.STATUS_BUFFER_TOO_SMALL


def test_verify_token_capacity_too_small_changes_nothing(tiny_path):
    s = open_model(tiny_path).create_session()
    st, msg, *_ = s.verify_tokens_frame_sampled(PROMPT, token_capacity=2)
    assert st == B.STATUS_BUFFER_TOO_SMALL and s.position == 0


def test_copy_output_activation_frame(tiny_path):
    s = open_model(tiny_path, layer_end=3).create_session()
    d, p, _ = run_prefill(s, PROMPT)
    st, msg, d2, p2, n = s.copy_output_activation_frame(2, capacity=2 * N_EMBD * 4)
    assert st == OK and p2 == p[-2 * N_EMBD * 4 :] and desc_fields(d2)["token_count"] == 2
    assert s.position == 5
    assert s.copy_output_activation_frame(6, capacity=10**6)[0] == B.STATUS_INVALID_ARGUMENT
    assert s.copy_output_activation_frame(0, capacity=10**6)[0] == B.STATUS_INVALID_ARGUMENT
    t = open_model(tiny_path).create_session()
    run_prefill(t, PROMPT)
    assert t.copy_output_activation_frame(1, capacity=10**6)[0] == B.STATUS_UNSUPPORTED


def test_trim_retire_reset_and_sample_current(tiny_path):
    s = open_model(tiny_path).create_session()
    assert s.sample_current()[0] == B.STATUS_INVALID_ARGUMENT  # no logits yet
    _, _, first = run_prefill(s, PROMPT)
    assert s.sample_current() == (OK, None, first)
    _, _, preds = run_verify(s, [first, 3, 4])
    assert s.position == 8
    assert s.retire_verify_checkpoint(5, 3) == (OK, None)
    st, msg = s.retire_verify_checkpoint(6, 3)
    assert st == B.STATUS_INVALID_ARGUMENT and s.position == 8
    st, msg = s.trim(9)
    assert st == B.STATUS_INVALID_ARGUMENT and msg == "cannot trim session beyond current token count"
    assert s.trim(6) == (OK, None) and s.position == 6
    _, _, again = run_decode(s, 3)
    assert again == preds[1]  # re-decoding the trimmed token reproduces verify's row
    assert s.reset() == (OK, None) and s.position == 0
    _, _, tok = run_prefill(s, PROMPT)
    assert tok == first


def test_mtp_draft_is_never_available(tiny_path):
    s = open_model(tiny_path).create_session()
    st, _, _, _, _, preds, draft = s.verify_tokens_frame_sampled(PROMPT, max_draft=4)
    assert st == OK and len(draft) == 56
    version, available, count = struct.unpack_from("<I?3xi", draft)
    assert (version, available, count) == (1, False, 0)


def test_lanes_limit_sessions(tiny_path):
    m = open_model(tiny_path, lane_count=2)
    a, b = m.create_session(), m.create_session()
    with pytest.raises(B.NativeError) as e:
        m.create_session()
    assert e.value.status == B.STATUS_RUNTIME_ERROR and "lane" in e.value.message
    a.close()
    c = m.create_session()
    run_prefill(c, PROMPT)
    run_prefill(b, PROMPT[:3])
    assert (c.position, b.position) == (5, 3)


def test_token_buffers_of_any_int32_kind(tiny_path):
    s = open_model(tiny_path).create_session()
    want = run_verify(s, PROMPT)[2]
    for buf in (array.array("i", PROMPT), np.array(PROMPT, dtype=np.int32), np.array(PROMPT, np.int32).tobytes()):
        s.reset()
        assert run_verify(s, buf)[2] == want
    with pytest.raises(TypeError):
        s.prefill_chunk_frame(np.array(PROMPT, dtype=np.float64))


# ---- sampling -----------------------------------------------------------------------------


def test_sampling(tiny_path):
    m = open_model(tiny_path)

    def first_token(sampling):
        s = m.create_session()
        tok = run_prefill(s, PROMPT, sampling=sampling)[2]
        s.close()
        return tok

    greedy = first_token(None)
    assert first_token(pack_sampling(enabled=False, temperature=0.7)) == greedy
    assert first_token(pack_sampling(temperature=0.0)) == greedy
    assert first_token(pack_sampling(top_k=1, seed=5)) == greedy
    assert first_token(pack_sampling(logit_bias=[(77, 100.0)], temperature=0.0)) == 77
    assert first_token(pack_sampling(logit_bias=[(greedy, -1e9)], temperature=0.0)) != greedy
    # seeded draws are reproducible and actually random at a high temperature
    hot = [first_token(pack_sampling(seed=s, temperature=50.0)) for s in range(1, 9)]
    assert hot == [first_token(pack_sampling(seed=s, temperature=50.0)) for s in range(1, 9)]
    assert len(set(hot)) > 1
    # top-p / min-p close to 0 keep only the best candidate
    assert first_token(pack_sampling(top_p=1e-6, temperature=5.0, seed=3)) == greedy
    assert first_token(pack_sampling(min_p=0.999, temperature=5.0, seed=3)) == greedy
    # penalties follow llama.cpp's rule over the session history, checked against the logits
    s = m.create_session()
    hist = PROMPT + [greedy, greedy]
    run_prefill(s, hist)
    logits = np.frombuffer(s.copy_logits()[2], dtype=np.float32).astype(np.float64)
    counts = {t: hist.count(t) for t in set(hist)}

    def expect(repeat=1.0, freq=0.0, presence=0.0, last=None):
        window = hist if last is None else hist[-last:]
        l = logits.copy()
        for t in set(window):
            c = window.count(t)
            l[t] = l[t] / repeat if l[t] > 0 else l[t] * repeat
            l[t] -= c * freq + presence
        return int(np.argmax(l))

    for kw, cfg in [
        (dict(repeat=3.0), pack_sampling(repeat=3.0, temperature=0.0)),
        (dict(freq=2.0), pack_sampling(frequency=2.0, temperature=0.0)),
        (dict(presence=1e6), pack_sampling(presence=1e6, temperature=0.0, penalty_last_n=0)),
        (dict(presence=1e6, last=2), pack_sampling(presence=1e6, temperature=0.0, penalty_last_n=2)),
    ]:
        st, _, tok = s.sample_current(cfg)
        assert st == OK and tok == expect(**kw), kw
    assert expect(presence=1e6) not in counts
    st, msg, _ = s.sample_current(pack_sampling(version=1))
    assert st == B.STATUS_INVALID_ARGUMENT
    with pytest.raises(ValueError):
        s.sample_current(b"\0" * 10)


def test_ignore_eos(tiny_path):
    s = open_model(tiny_path).create_session()
    run_prefill(s, PROMPT)
    st, _, tok = s.sample_current(pack_sampling(logit_bias=[(2, 1e6)], temperature=0.0))
    assert tok == 2
    st, _, tok = s.sample_current(pack_sampling(logit_bias=[(2, 1e6)], temperature=0.0, ignore_eos=True))
    assert st == OK and tok != 2


# ---- batches ------------------------------------------------------------------------------


def test_iteration_batch_matches_single_calls(tiny_path):
    m_a = open_model(tiny_path, layer_end=2, lane_count=2)
    m_b = open_model(tiny_path, layer_start=2, lane_count=2, stage_index=1)
    a1, a2 = m_a.create_session(), m_a.create_session()
    b1, b2 = m_b.create_session(), m_b.create_session()
    reqs = [(a1, PROMPT, None, None, None, None, True), (a2, PROMPT[:3], None, None, None, None, False)]
    st, msg, descs, pays, need, idx, pred = B.iteration_batch_sampled(reqs, [0, 0], 2)
    assert st == B.STATUS_BUFFER_TOO_SMALL and need == [5 * 256, 3 * 256] and a1.position == 0
    st, msg, descs, pays, nbytes, idx, pred = B.iteration_batch_sampled(reqs, need, 2)
    assert st == OK and (idx, pred) == ([], []) and [len(p) for p in pays] == need  # non-terminal: no samples
    reqs_b = [(b1, PROMPT, None, None, descs[0], pays[0], True), (b2, PROMPT[:3], None, None, descs[1], pays[1], False)]
    st, msg, descs_b, pays_b, nbytes, idx, pred = B.iteration_batch_sampled(reqs_b, [0, 0], 2)
    assert st == OK and idx == [0] and len(pred) == 1 and pays_b == [b"", b""]
    single = open_model(tiny_path).create_session()
    assert pred[0] == run_prefill(single, PROMPT)[2]
    assert (a1.position, a2.position, b1.position, b2.position) == (5, 3, 5, 3)
    # decode batch on both lanes
    st, msg, dd, dp, need, _ = B.decode_step_frame_batch_sampled([a1, a2], [pred[0], 9], [None, None], [None, None],
                                                                 [None, None], [0, 0], 2)
    assert st == B.STATUS_BUFFER_TOO_SMALL and need == [256, 256]
    st, msg, dd, dp, _, _ = B.decode_step_frame_batch_sampled([a1, a2], [pred[0], 9], [None, None], [None, None],
                                                              [None, None], need, 2)
    assert st == OK
    st, msg, _, _, _, predicted = B.decode_step_frame_batch_sampled([b1, b2], [pred[0], 9], [None, None], dd, dp,
                                                                    [0, 0], 2)
    assert st == OK and len(predicted) == 2
    assert predicted[0] == run_decode(single, pred[0])[2]


def test_batch_bad_input(tiny_path):
    m = open_model(tiny_path, lane_count=2)
    s = m.create_session()
    st, msg, *_ = B.iteration_batch_sampled([(None, PROMPT, None, None, None, None, True)], [0], 1)
    assert st == B.STATUS_INVALID_ARGUMENT
    st, msg, *_ = B.iteration_batch_sampled([(s, PROMPT, None, None, None, None, True)] * 2, [0, 0], 2)
    assert st == B.STATUS_INVALID_ARGUMENT and "repeats" in msg
    st, msg, *_ = B.iteration_batch_sampled([(s, [999], None, None, None, None, True)], [0], 1)
    assert st == B.STATUS_INVALID_ARGUMENT and s.position == 0
    st, msg, *_ = B.decode_step_frame_batch_sampled([None], [1], [None], [None], [None], [0], 1)
    assert st == B.STATUS_INVALID_ARGUMENT
    assert B.iteration_batch_sampled([], [], 0)[0] == OK


# ---- bad input ----------------------------------------------------------------------------


@pytest.mark.parametrize("start,end", [(-1, 2), (2, 2), (3, 1), (0, 5)])
def test_bad_layer_range(tiny_path, start, end):
    with pytest.raises(B.NativeError) as e:
        B.Model(tiny_path, layer_start=start, layer_end=end)
    assert e.value.status == B.STATUS_INVALID_ARGUMENT and "layer range" in e.value.message


def test_bad_model_files(tmp_path, tiny_path):
    with pytest.raises(B.NativeError) as e:
        B.Model(str(tmp_path / "missing.gguf"))
    assert e.value.status == B.STATUS_IO_ERROR
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"not a gguf file at all" * 10)
    with pytest.raises(B.NativeError) as e:
        B.Model(str(junk))
    assert e.value.status == B.STATUS_MODEL_ERROR
    data = Path(tiny_path).read_bytes()
    cut = tmp_path / "truncated.gguf"
    cut.write_bytes(data[: len(data) - 1000])
    with pytest.raises(B.NativeError) as e:
        B.Model(str(cut))
    assert e.value.status == B.STATUS_MODEL_ERROR
    with pytest.raises(B.NativeError) as e:
        B.Model(tiny_path, ctx_size=0)
    assert e.value.status == B.STATUS_INVALID_ARGUMENT


def test_unknown_architecture(tmp_path):
    import gguf

    p = tmp_path / "other.gguf"
    w = gguf.GGUFWriter(str(p), "mamba")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(B.NativeError) as e:
        B.Model(str(p))
    assert e.value.status == B.STATUS_UNSUPPORTED and "mamba" in e.value.message


def test_bad_frames_leave_the_session_unchanged(tiny_path):
    a = open_model(tiny_path, layer_end=2).create_session()
    b = open_model(tiny_path, layer_start=2).create_session()
    c = open_model(tiny_path, layer_start=3).create_session()
    d, p, _ = run_prefill(a, PROMPT)

    def status(session, tokens, desc, payload):
        return session.prefill_chunk_frame(tokens, sample=True, input_desc=desc, input_payload=payload)[:2]

    assert status(b, PROMPT, None, None)[0] == B.STATUS_INVALID_ARGUMENT  # needs a frame
    assert status(c, PROMPT, d, p)[0] == B.STATUS_INVALID_ARGUMENT  # frame ends at 2, stage starts at 3
    st, msg = status(b, PROMPT[:4], d, p)
    assert st == B.STATUS_INVALID_ARGUMENT and "tokens" in msg  # token count mismatch
    st, msg = status(b, PROMPT, d, p[:-4])
    assert st == B.STATUS_INVALID_ARGUMENT and "does not match descriptor payload_bytes" in msg
    bad = bytearray(d)
    bad[40] ^= 1  # frontier identity
    assert status(b, PROMPT, bytes(bad), p)[0] == B.STATUS_INVALID_ARGUMENT
    bad = bytearray(d)
    struct.pack_into("<q", bad, 120, 32)  # width
    assert status(b, PROMPT, bytes(bad), p)[0] == B.STATUS_INVALID_ARGUMENT
    st, msg = status(a, PROMPT, d, p)
    assert st == B.STATUS_INVALID_ARGUMENT and "token input" in msg  # source takes tokens only
    assert status(a, [N_VOCAB], None, None)[0] == B.STATUS_INVALID_ARGUMENT
    assert status(a, [], None, None)[0] == B.STATUS_INVALID_ARGUMENT
    st, msg, *_ = a.prefill_chunk_frame(PROMPT, positions=[0, 1], capacity=10**6)
    assert st == B.STATUS_INVALID_ARGUMENT
    with pytest.raises(ValueError):
        b.prefill_chunk_frame(PROMPT, input_desc=d[:100], input_payload=p)
    assert (a.position, b.position, c.position) == (5, 0, 0)
    assert status(b, PROMPT, d, p)[0] == OK


def test_context_full_is_a_clear_error(tiny_path):
    s = open_model(tiny_path, ctx_size=8).create_session()
    st, msg, *_ = s.prefill_chunk_frame(list(range(3, 12)), sample=True)
    assert st == B.STATUS_RUNTIME_ERROR and "context full" in msg and s.position == 0
    run_prefill(s, list(range(3, 11)))
    st, msg, *_ = s.decode_step_frame_sampled(5)
    assert st == B.STATUS_RUNTIME_ERROR and s.position == 8


def test_compute_releases_the_gil_and_threads_agree(tiny_path):
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
        with pytest.raises(B.NativeError):
            B.Model(str(junk))
    finally:
        B.set_log_callback(None)
    assert lines  # gguf's reader explains why it failed


def test_ggml_preload_helper():
    from skippy_wire.stage import _ggml as _ggml

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
        got = np.frombuffer(s.copy_logits()[2], dtype=np.float32)
        assert np.max(np.abs(got - want[i])) < 1e-3, i


def test_model_and_session_free_in_any_order(tiny_path):
    import gc

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
            return np.frombuffer(session.copy_logits()[2], dtype=np.float32)
        st, msg, d, p, n = session.copy_output_activation_frame(1, capacity=4 * N_EMBD)
        return np.frombuffer(p, dtype=np.float32)

    reqs = [(s, t, None, None, None, None, True) for s, t in zip(batch, prompts)]
    st, msg, _, pays, need, idx, pred = B.iteration_batch_sampled(reqs, [0] * 3, 3)
    if st == B.STATUS_BUFFER_TOO_SMALL:  # exporting stage: retry with the reported sizes
        st, msg, _, pays, _, idx, pred = B.iteration_batch_sampled(reqs, need, 3)
    assert st == OK, msg
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
        st, msg, _, _, _, predicted = B.decode_step_frame_batch_sampled(batch, tokens, [None] * 3, [None] * 3,
                                                                        [None] * 3, caps, 3)
        assert st == OK, msg
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
        st, msg, *_ = b.prefill_chunk_frame(PROMPT, sample=True, input_desc=bytes(bad), input_payload=payload)
        assert st in (OK, B.STATUS_INVALID_ARGUMENT), msg
        assert b.position == before + (len(PROMPT) if st == OK else 0)
        if st == OK:
            b.reset()
