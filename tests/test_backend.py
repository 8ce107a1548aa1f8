"""The ggml stage backend (skippy_wire.stage._backend over skippy_wire/stage/_stage) on the tiny
random llama GGUF (runtime.md §6.2): numerics against the independent numpy forward pass,
split stages against one stage, the BUFFER_TOO_SMALL protocol, session state and sampling.
Batches, bad input and threading are test_backend_batch.py."""

from __future__ import annotations

import array
import hashlib
import struct

import numpy as np
import pytest

from backend_helpers import (  # noqa: F401  (fixtures)
    N_EMBD,
    N_LAYER,
    N_VOCAB,
    OK,
    PROMPT,
    Pipeline,
    desc_fields,
    open_model,
    pack_sampling,
    ref,
    run_decode,
    run_prefill,
    run_verify,
    status_of,
    tiny_f16_path,
    tiny_path,
)
from numpy_llama import NumpyLlama
from skippy_wire.errors import StageRuntimeError, Status
from skippy_wire.stage import _backend as B


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
    raw = s.copy_logits()
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
        raw = s.copy_logits()
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
    with pytest.raises(StageRuntimeError) as error:
        s.prefill_chunk_frame(PROMPT)
    need = error.value.required
    assert error.value.status == Status.BUFFER_TOO_SMALL and need == 5 * N_EMBD * 4 and "capacity" in error.value.message
    assert str(error.value).startswith("BufferTooSmall: ") and s.position == 0
    with pytest.raises(StageRuntimeError) as error:
        s.prefill_chunk_frame(PROMPT, capacity=need - 1)
    assert error.value.status == Status.BUFFER_TOO_SMALL and error.value.required == need and s.position == 0
    r = s.prefill_chunk_frame(PROMPT, capacity=need + 100)
    assert r.out_bytes == need and len(r.out_payload) == need and s.position == 5
    assert r.predicted_token == -1 and desc_fields(r.out_desc)["token_count"] == 5
    assert status_of(s.copy_output_activation_frame, 5)[0] == Status.BUFFER_TOO_SMALL


def test_a_capacity_past_the_largest_buffer_is_an_invalid_argument(tiny_path):
    """2**63 bytes read as a negative size: a SystemError from the interpreter."""
    s = open_model(tiny_path, layer_end=2).create_session()
    for call in (lambda: s.prefill_chunk_frame(PROMPT, capacity=2**63),
                 lambda: s.prefill_chunk_frame(PROMPT, capacity=2**63 - 1),  # (a raw OverflowError there)
                 lambda: s.copy_output_activation_frame(1, capacity=2**64 - 1)):
        with pytest.raises(StageRuntimeError, match="output capacity [0-9]+ exceeds the largest buffer") as error:
            call()
        assert error.value.status == Status.INVALID_ARGUMENT
    assert s.position == 0


def test_verify_token_capacity_too_small_changes_nothing(tiny_path):
    s = open_model(tiny_path).create_session()
    assert status_of(s.verify_tokens_frame_sampled, PROMPT, token_capacity=2)[0] == Status.BUFFER_TOO_SMALL
    assert s.position == 0


def test_copy_output_activation_frame(tiny_path):
    s = open_model(tiny_path, layer_end=3).create_session()
    d, p, _ = run_prefill(s, PROMPT)
    r = s.copy_output_activation_frame(2, capacity=2 * N_EMBD * 4)
    assert r.out_payload == p[-2 * N_EMBD * 4 :] and desc_fields(r.out_desc)["token_count"] == 2
    assert s.position == 5
    assert status_of(s.copy_output_activation_frame, 6, capacity=10**6)[0] == Status.INVALID_ARGUMENT
    assert status_of(s.copy_output_activation_frame, 0, capacity=10**6)[0] == Status.INVALID_ARGUMENT
    t = open_model(tiny_path).create_session()
    run_prefill(t, PROMPT)
    assert status_of(t.copy_output_activation_frame, 1, capacity=10**6)[0] == Status.UNSUPPORTED


def test_trim_retire_reset_and_sample_current(tiny_path):
    s = open_model(tiny_path).create_session()
    assert status_of(s.sample_current)[0] == Status.INVALID_ARGUMENT  # no logits yet
    _, _, first = run_prefill(s, PROMPT)
    assert s.sample_current() == first
    _, _, preds = run_verify(s, [first, 3, 4])
    assert s.position == 8
    assert s.retire_verify_checkpoint(5, 3) is None
    assert status_of(s.retire_verify_checkpoint, 6, 3)[0] == Status.INVALID_ARGUMENT and s.position == 8
    assert status_of(s.trim, 9) == (Status.INVALID_ARGUMENT, "cannot trim session beyond current token count")
    assert s.trim(6) is None and s.position == 6
    _, _, again = run_decode(s, 3)
    assert again == preds[1]  # re-decoding the trimmed token reproduces verify's row
    assert s.reset() is None and s.position == 0
    _, _, tok = run_prefill(s, PROMPT)
    assert tok == first


def test_mtp_draft_is_never_available(tiny_path):
    s = open_model(tiny_path).create_session()
    draft = s.verify_tokens_frame_sampled(PROMPT, max_draft=4).mtp_draft
    assert len(draft) == 56
    version, available, count = struct.unpack_from("<I?3xi", draft)
    assert (version, available, count) == (1, False, 0)


def test_lanes_limit_sessions(tiny_path):
    m = open_model(tiny_path, lane_count=2)
    a, b = m.create_session(), m.create_session()
    with pytest.raises(StageRuntimeError) as e:
        m.create_session()
    assert e.value.status == Status.RUNTIME_ERROR and "lane" in e.value.message
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
    # greedy with filters set is still the first maximum: a tie goes to the lower id
    assert first_token(pack_sampling(top_k=40, top_p=0.5, min_p=0.1, temperature=0.0)) == greedy
    tie = [(77, 1e9), (50, 1e9)]  # 1e9 + any logit rounds to 1e9 in float
    assert first_token(pack_sampling(logit_bias=tie, temperature=0.0)) == 50
    assert first_token(pack_sampling(logit_bias=tie, top_k=2, temperature=0.0)) == 50
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
    logits = np.frombuffer(s.copy_logits(), dtype=np.float32).astype(np.float64)
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
        assert s.sample_current(cfg) == expect(**kw), kw
    assert expect(presence=1e6) not in counts
    assert status_of(s.sample_current, pack_sampling(version=1))[0] == Status.INVALID_ARGUMENT
    with pytest.raises(ValueError):
        s.sample_current(b"\0" * 10)


def test_ignore_eos(tiny_path):
    s = open_model(tiny_path).create_session()
    run_prefill(s, PROMPT)
    assert s.sample_current(pack_sampling(logit_bias=[(2, 1e6)], temperature=0.0)) == 2
    assert s.sample_current(pack_sampling(logit_bias=[(2, 1e6)], temperature=0.0, ignore_eos=True)) != 2


def test_rows_without_a_finite_maximum_follow_the_tie_rule(tiny_path):
    # Every logit -inf (all tokens banned): no softmax exists (exp(-inf - -inf) is NaN).  Greedy
    # takes the first maximum (llama.cpp's greedy: id 0); the stochastic chain keeps the same
    # lowest-id rule instead of falling through its draw to the last candidate (it gave 255).
    s = open_model(tiny_path).create_session()
    run_prefill(s, PROMPT)
    ninf, inf = float("-inf"), float("inf")
    configs = [dict(temperature=0.0), dict(temperature=1.0), dict(temperature=50.0, top_k=5),
               dict(temperature=0.8, top_p=0.9), dict(temperature=0.8, min_p=0.05), dict(temperature=inf),
               dict(temperature=1.0, top_k=40, top_p=0.95, min_p=0.05, repeat=1.5, frequency=0.5, presence=0.5)]

    def draws(bias, **kw):
        return [s.sample_current(pack_sampling(logit_bias=bias, seed=seed, **kw)) for seed in range(1, 9)]

    banned = [(t, ninf) for t in range(N_VOCAB)]
    for kw in configs:
        assert draws(banned, **kw) == [0] * 8, kw
        assert draws(banned, ignore_eos=True, **kw) == [0] * 8, kw
        # all but 7 and 9 banned: only they can come out, however hot
        assert set(draws([(t, ninf) for t in range(N_VOCAB) if t not in (7, 9)], **kw)) <= {7, 9}, kw
    assert set(draws([(t, ninf) for t in range(N_VOCAB) if t not in (7, 9)], temperature=1e6)) == {7, 9}
    # +inf logits take all the mass, shared equally (a NaN softmax drew unrelated tokens)
    for kw in configs:
        assert set(draws([(30, inf), (40, inf)], **kw)) <= {30, 40}, kw
    assert set(draws([(30, inf), (40, inf)], temperature=1.0)) == {30, 40}
    assert draws([(30, inf), (40, inf)], temperature=0.0) == [30] * 8  # greedy: the lower id


def test_nan_logits_are_never_chosen_over_numbers(tiny_path):
    # A NaN logit (inf - inf from a +inf and a -inf bias on one token, or from penalties)
    # ranks as -inf: it neither wins greedy from id 0 (the first-maximum scan started at a NaN
    # and kept it) nor breaks the candidate sort's order (the draws left the logits' top k).
    s = open_model(tiny_path).create_session()
    greedy = run_prefill(s, PROMPT)[2]
    logits = np.frombuffer(s.copy_logits(), dtype=np.float32)
    inf = float("inf")
    for poisoned in ([0], [0, 5, greedy], list(range(0, N_VOCAB, 2))):
        l = logits.copy()
        l[poisoned] = -np.inf
        best = int(np.argmax(l))
        top5 = set(int(t) for t in np.argsort(-l, kind="stable")[:5])
        bias = [(t, b) for t in poisoned for b in (inf, -inf)]  # NaN logits
        assert s.sample_current(pack_sampling(logit_bias=bias, temperature=0.0)) == best
        assert s.sample_current(pack_sampling(logit_bias=bias, top_k=1, seed=3)) == best
        for seed in range(1, 17):
            assert s.sample_current(pack_sampling(logit_bias=bias, top_k=5, temperature=50.0, seed=seed)) in top5
            token = s.sample_current(pack_sampling(logit_bias=bias, temperature=1.0, top_p=0.9, seed=seed))
            assert 0 <= token < N_VOCAB and token not in poisoned


def test_nan_sampling_values_are_refused(tiny_path):
    # A NaN temperature decoded greedily, a NaN top-p or min-p switched the filter off, a NaN
    # penalty or bias banned tokens: all without a word.  The samplers the chain does not run
    # (typical-p, XTC, DRY, mirostat ...) are accepted and not run, as runtime.md 2.4's are.
    s = open_model(tiny_path).create_session()
    run_prefill(s, PROMPT)
    nan = float("nan")
    names = {"presence": "presence_penalty", "frequency": "frequency_penalty", "repeat": "repeat_penalty"}
    for field in ("temperature", "top_p", "min_p", "presence", "frequency", "repeat"):
        assert status_of(s.sample_current, pack_sampling(**{field: nan})) == (
            Status.INVALID_ARGUMENT, f"sampling {names.get(field, field)} is NaN"), field
    assert status_of(s.sample_current, pack_sampling(logit_bias=[(7, nan)])) == (
        Status.INVALID_ARGUMENT, "the logit bias of token 7 is NaN")
    config = bytearray(pack_sampling(seed=1))
    struct.pack_into("<f", config, 48, 0.5)  # typical_p
    assert s.sample_current(bytes(config)) == s.sample_current(pack_sampling(seed=1))
