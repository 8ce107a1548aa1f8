"""The runtime adapter over the real ggml backend (``skippy_wire.stage._backend``) and the tiny
random llama GGUF (runtime.md section 6.2): split stages agree with one stage, the
BUFFER_TOO_SMALL retry works natively, bad input is a clear exception."""

from __future__ import annotations

import dataclasses
import os
import re
import struct

import pytest

from skippy_wire.stage import _backend as backend  # noqa: F401  (a missing build is a failure, never a skip)
from skippy_wire.stage import models
from skippy_wire.wire import forwarding, messages
from skippy_wire.wire import frame as frame_mod
from skippy_wire.stage import runtime as rt  # noqa: E402
from skippy_wire.stage.runtime import (  # noqa: E402
    ActivationDesc,
    ActivationFrame,
    PartialBatchExecution,
    RuntimeSamplingConfig,
    StageRuntimeError,
    Status,
    frame_from_wire,
    frontier_identity_of,
    llama_residual_identity,
)
from skippy_wire.stage.runtime import (  # noqa: E402
    DecodeFrameBatchRequest,
    IterationBatchPhase,
    IterationBatchRequest,
    StageModel,
)

PROMPT = [1, 10, 20, 30, 40]
N_LAYER = 4
N_EMBD = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny") / "tiny-llama-f32.gguf"
    models.write_tiny_llama_gguf(path, file_type="f32")
    return str(path)


@pytest.fixture(scope="module")
def ref(tiny):
    """Greedy per-row arg-max for PROMPT from the independent numpy forward pass."""
    from numpy_llama import NumpyLlama

    return [int(t) for t in NumpyLlama(tiny).forward(PROMPT).argmax(axis=1)]


def open_stage(path, start, end, **kwargs):
    kwargs.setdefault("n_threads", 2)
    kwargs.setdefault("ctx_size", 64)
    return StageModel.open(path, start, end, **kwargs)


class Pipeline:
    """Stages ``[0, c1), [c1, c2), ..., [ck, n_layer)`` run in sequence through frames."""

    def __init__(self, path, cuts, **kwargs):
        bounds = [0, *cuts, N_LAYER]
        self.models = [open_stage(path, s, e, stage_index=i, **kwargs)
                       for i, (s, e) in enumerate(zip(bounds, bounds[1:]))]
        self.sessions = [m.create_session() for m in self.models]

    def _through(self, tokens, step):
        frame = None
        for index, (model, session) in enumerate(zip(self.models, self.sessions)):
            inp = None
            if frame is not None:
                inp = frame_from_wire(frame.payload, len(tokens), model.n_embd, index - 1,
                                      self.models[index - 1].layer_start, model.layer_start)
            token, frame = step(session, inp)
        return token

    def prefill(self, tokens, sampling=None):
        return self._through(tokens, lambda s, inp: s.prefill_chunk_frame_sampled(tokens, sampling, inp))

    def decode(self, token, sampling=None):
        return self._through([token], lambda s, inp: s.decode_step_frame_sampled(token, sampling, inp))

    def verify(self, tokens):
        return self._through(tokens, lambda s, inp: s.verify_tokens_frame(tokens, inp)[::2])

    def trim(self, n):
        for session in self.sessions:
            session.trim_session(n)


def greedy_run(pipeline, steps=4):
    tokens = [pipeline.prefill(PROMPT)]
    for _ in range(steps):
        tokens.append(pipeline.decode(tokens[-1]))
    return tokens


def test_open_reports_the_stage(tiny):
    whole = open_stage(tiny, 0, None)
    assert (whole.n_layer, whole.n_embd, whole.n_vocab) == (N_LAYER, N_EMBD, 256)
    assert whole.is_source and whole.is_terminal
    first, last = open_stage(tiny, 0, 2), open_stage(tiny, 2, 4, stage_index=1)
    assert (first.is_source, first.is_terminal, last.is_source, last.is_terminal) == (True, False, False, True)
    assert first.input_activation_boundary() is None and last.output_activation_boundary() is None
    assert first.output_activation_boundary().raw_f32_width("output") == N_EMBD
    assert last.input_activation_boundary().raw_f32_width("input") == N_EMBD
    # frame_from_wire's default identities are the backend's (skippy_stage.h, item 3).
    boundary = last.input_activation_boundary()
    assert boundary.parts[0].identity == llama_residual_identity(N_EMBD)
    assert boundary.frontier_identity == frontier_identity_of(boundary.active_parts())
    assert boundary.frontier_identity == frame_from_wire(bytes(4 * N_EMBD), 1, N_EMBD, 0, 0, 2).desc.frontier_identity
    session = first.create_session()
    assert session.terminal_stage is False and session.batched_activation_exports is True


def test_whole_model_matches_the_reference_rows(tiny, ref):
    session = open_stage(tiny, 0, None).create_session()
    predicted, draft, frame = session.verify_tokens_frame(PROMPT)
    assert predicted == ref
    assert draft is None and frame.payload == b"" and session.token_count == 5


@pytest.mark.parametrize("cuts", [[1], [2], [3], [1, 3], [1, 2, 3]])
def test_split_stages_match_one_stage(tiny, ref, cuts):
    expected = greedy_run(Pipeline(tiny, []))
    assert expected[0] == ref[-1]
    assert greedy_run(Pipeline(tiny, cuts)) == expected


@pytest.mark.parametrize("cuts", [[], [2]])
def test_split_verify_matches_and_trim_replays(tiny, ref, cuts):
    whole = Pipeline(tiny, [])
    split = Pipeline(tiny, cuts)
    first = whole.prefill(PROMPT[:2])
    assert split.prefill(PROMPT[:2]) == first
    window = PROMPT[2:]
    assert split.verify(window) == whole.verify(window) == ref[2:]
    for session in split.sessions:
        assert session.token_count == 5
        session.retire_verify_checkpoint(2, 3)
    split.trim(3)
    assert split.decode(PROMPT[3]) == ref[3]
    assert split.decode(PROMPT[4]) == ref[4]


def test_prefill_in_chunks_matches_one_chunk(tiny, ref):
    session = open_stage(tiny, 0, None).create_session()
    session.prefill_chunk_frame(PROMPT[:3])
    token, _ = session.prefill_chunk_frame_sampled(PROMPT[3:], None)
    assert token == ref[-1] and session.token_count == 5
    assert session.sample_current(None) == token


def test_buffer_too_small_retry_against_the_native_backend(tiny):
    model = open_stage(tiny, 0, 2)
    session = model.create_session()
    native = session.native_session
    with pytest.raises(StageRuntimeError) as error:
        native.prefill_chunk_frame(PROMPT, capacity=0)
    assert error.value.status == Status.BUFFER_TOO_SMALL and error.value.message
    required = error.value.required
    assert required == 4 * N_EMBD * len(PROMPT)
    assert native.position == 0  # nothing executed
    frame = session.prefill_chunk_frame(PROMPT, output_capacity=1)
    assert session.token_count == 5 and native.position == 5
    assert len(frame.payload) == frame.desc.payload_bytes == required
    copy = session.copy_output_activation_frame(2)
    assert copy.payload == frame.payload[-2 * 4 * N_EMBD:]
    big = session.decode_step_frame(3, output_capacity=10_000)[1]
    assert len(big.payload) == 4 * N_EMBD


def test_bad_layer_ranges_are_clear_errors(tiny):
    with pytest.raises(StageRuntimeError, match="layer_start must be less than layer_end"):
        open_stage(tiny, 3, 3)
    with pytest.raises(StageRuntimeError) as info:
        open_stage(tiny, 0, N_LAYER + 1)
    assert info.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(StageRuntimeError) as info:
        open_stage(tiny + ".missing", 0, None)
    assert info.value.status in (Status.IO_ERROR, Status.MODEL_ERROR)


@pytest.mark.parametrize("option, value, said", [
    ("n_threads", 100_000, "n_threads 100000 is not in [0 (the default), 512]"),
    ("ctx_size", 2**31 - 1, "ctx_size 2147483647 is not in [1, 16777216]"),
    ("lane_count", 2000, "lane_count 2000 is not in [1, 1024]"),
    ("stage_index", -1, "stage_index -1 is negative"), ("ctx_size", 0, "ctx_size 0 is not positive"),
    ("lane_count", -1, "lane_count -1 is not positive")])
def test_an_option_out_of_the_backends_range_is_named_with_its_bounds(tiny, option, value, said):
    # the message listed every option's value, leaving the caller to guess which was refused
    with pytest.raises(StageRuntimeError) as info:
        open_stage(tiny, 0, None, **{option: value})
    assert str(info.value) == f"InvalidArgument: invalid config: {said}"
    assert info.value.status is Status.INVALID_ARGUMENT


def test_a_model_path_is_opened_as_the_file_it_names_or_refused(tiny, tmp_path):
    # a NUL cut the path short in C (the model before it opened), a name not in UTF-8 was an
    # UnicodeEncodeError, bytes were opened as "b'...'", and a FIFO's open waited for a writer
    with pytest.raises(StageRuntimeError, match="^InvalidArgument: model path contains a NUL byte$"):
        open_stage(tiny + "\0junk", 0, None)
    odd = tmp_path / os.fsdecode(b"tiny-\xff.gguf")
    odd.symlink_to(tiny)
    for name in (str(odd), os.fsencode(odd)):
        model = open_stage(name, 0, None)
        assert model.path == str(odd) and model.n_layer == N_LAYER
        model.close()
    fifo = tmp_path / "fifo.gguf"
    os.mkfifo(fifo)
    for name in (str(fifo), os.fsencode(fifo)):
        with pytest.raises(models.ModelFileError, match=f"^{fifo}: it is a FIFO, not a regular file$"):
            open_stage(name, 0, None)
    # its id and its name as text, for JSON and the v17 setup (an API answered 500 in plain text)
    assert (models.default_model_id(os.fsencode(odd)), models.path_text(odd)) == \
        ("tiny-\ufffd", str(tmp_path) + "/tiny-\ufffd.gguf")


def test_mismatched_frames_are_clear_errors(tiny):
    first = open_stage(tiny, 0, 2).create_session()
    second = open_stage(tiny, 2, None, stage_index=1).create_session()
    out = first.prefill_chunk_frame(PROMPT)
    wrong_edge = frame_from_wire(out.payload, 5, N_EMBD, 0, 0, 1)
    with pytest.raises(StageRuntimeError) as info:
        second.prefill_chunk_frame(PROMPT, wrong_edge)
    assert info.value.status is Status.INVALID_ARGUMENT
    wrong_count = frame_from_wire(out.payload[: 4 * N_EMBD * 4], 4, N_EMBD, 0, 0, 2)
    with pytest.raises(StageRuntimeError) as info:
        second.prefill_chunk_frame(PROMPT, wrong_count)
    assert info.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(StageRuntimeError) as info:
        second.prefill_chunk_frame(PROMPT)  # a downstream stage needs its activation
    assert info.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(StageRuntimeError) as info:
        first.decode_step_frame(7, out)  # the source stage takes tokens, not activations
    assert info.value.status is Status.INVALID_ARGUMENT
    for sequences in (0, 7):  # a frame carries one sequence (runtime.md 2.2); it was taken as one
        many = ActivationFrame(dataclasses.replace(out.desc, sequence_count=sequences), out.payload)
        with pytest.raises(StageRuntimeError, match=f"activation frame has {sequences} sequences, expected 1"):
            second.prefill_chunk_frame(PROMPT, many)
    broken = ActivationFrame(out.desc, out.payload[:-4])
    with pytest.raises(StageRuntimeError, match="does not match descriptor payload_bytes"):
        second.prefill_chunk_frame(PROMPT, broken)
    assert first.token_count == 5 and second.token_count == 0


def test_too_long_prompt_is_a_clear_error(tiny):
    session = open_stage(tiny, 0, None, ctx_size=8).create_session()
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame(list(range(1, 10)))
    assert info.value.status is Status.RUNTIME_ERROR
    assert session.token_count == 0
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame([1, 999])
    assert info.value.status is Status.INVALID_ARGUMENT


def test_native_rejects_null_sessions_without_serial_fallback(tiny):
    first = rt.StageSession._from_native(None, backend, terminal_stage=False, batched_activation_exports=True)
    second = rt.StageSession._from_native(None, backend, terminal_stage=False, batched_activation_exports=True)
    request = lambda s: IterationBatchRequest(s, [7], sample_last=True, phase=IterationBatchPhase.DECODE)  # noqa: E731
    with pytest.raises(StageRuntimeError) as info:
        rt.iteration_batch_sampled([request(first), request(second)])
    assert "InvalidArgument" in str(info.value)
    assert not isinstance(info.value, PartialBatchExecution)
    assert (first.token_count, second.token_count) == (0, 0)


def test_iteration_batch_matches_individual_sessions(tiny, ref):
    model = open_stage(tiny, 0, None, lane_count=3)
    a, b, c = (model.create_session() for _ in range(3))
    output = rt.iteration_batch_sampled([
        IterationBatchRequest(a, PROMPT, sample_last=True),
        IterationBatchRequest(b, PROMPT[:3], sample_last=False),
        IterationBatchRequest(c, PROMPT[:2], positions=[0, 1], sample_last=True),
    ])
    assert [(s.request_index, s.predicted_token) for s in output.samples] == [(0, ref[4]), (2, ref[1])]
    assert (a.token_count, b.token_count, c.token_count) == (5, 3, 2)
    output = rt.iteration_batch_sampled([
        IterationBatchRequest(b, PROMPT[3:4], positions=[3], sample_last=True, phase=IterationBatchPhase.DECODE),
        IterationBatchRequest(c, PROMPT[2:3], sample_last=True, phase=IterationBatchPhase.DECODE),
    ])
    assert [s.predicted_token for s in output.samples] == [ref[3], ref[2]]


def test_iteration_batch_on_an_exporting_stage_retries_buffers(tiny):
    model = open_stage(tiny, 0, 2, lane_count=2)
    a, b = model.create_session(), model.create_session()
    output = rt.iteration_batch_sampled([IterationBatchRequest(a, PROMPT), IterationBatchRequest(b, PROMPT[:2])])
    assert [len(f.payload) for f in output.request_outputs] == [5 * 4 * N_EMBD, 2 * 4 * N_EMBD]
    single = open_stage(tiny, 0, 2).create_session().prefill_chunk_frame(PROMPT)
    assert output.request_outputs[0].payload == single.payload
    assert output.samples == []


def test_decode_batch_matches_serial_decodes(tiny, ref):
    model = open_stage(tiny, 0, None, lane_count=2)
    a, b = model.create_session(), model.create_session()
    a.prefill_chunk_frame(PROMPT[:3])
    b.prefill_chunk_frame(PROMPT[:4])
    outputs = rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, PROMPT[3]),
                                                 DecodeFrameBatchRequest(b, PROMPT[4])])
    assert [o.predicted_token for o in outputs] == [ref[3], ref[4]]
    assert (a.token_count, b.token_count) == (4, 5)
    # The serial path (forced by a stage that cannot batch exports) gives the same result.
    exporting = open_stage(tiny, 0, 2, lane_count=2)
    x, y = exporting.create_session(), exporting.create_session()
    x.batched_activation_exports = False
    x.prefill_chunk_frame(PROMPT[:1])
    outputs = rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(x, PROMPT[1]),
                                                 DecodeFrameBatchRequest(y, PROMPT[0])])
    assert [o.predicted_token for o in outputs] == [-1, -1]
    assert (x.token_count, y.token_count) == (2, 1)


def test_seeded_sampling_is_reproducible(tiny, ref):
    model = open_stage(tiny, 0, None, lane_count=2)
    config = RuntimeSamplingConfig(enabled=True, seed=1234, temperature=0.8, top_k=40)
    runs = []
    for _ in range(2):
        session = model.create_session()
        token, _ = session.prefill_chunk_frame_sampled(PROMPT, config)
        tokens = [token]
        for _ in range(5):
            token, _ = session.decode_step_frame_sampled(token, config)
            tokens.append(token)
        runs.append(tokens)
        session.close()
    assert runs[0] == runs[1]
    assert all(0 <= t < 256 for t in runs[0])
    greedy = model.create_session()
    assert greedy.prefill_chunk_frame_sampled(PROMPT, RuntimeSamplingConfig(enabled=False))[0] == ref[-1]


def test_all_banned_tokens_sample_the_lowest_id_on_every_path(tiny):
    # An embedder banning every token (logit_bias -inf) gets id 0 from greedy and from the
    # stochastic chain alike, in single calls, verify and batches (the draw gave the last id).
    model = open_stage(tiny, 0, None, lane_count=2)
    banned = [(t, float("-inf")) for t in range(256)]
    for temperature in (0.0, 0.8):
        config = RuntimeSamplingConfig(enabled=True, seed=7, temperature=temperature, top_k=40, logit_bias=banned)
        a, b = model.create_session(), model.create_session()
        assert a.prefill_chunk_frame_sampled(PROMPT, config)[0] == 0
        assert a.decode_step_frame_sampled(5, config)[0] == 0
        assert a.sample_current(config) == 0
        assert a.verify_tokens_frame_sampled([6, 7], config)[0] == [0, 0]
        output = rt.iteration_batch_sampled([IterationBatchRequest(b, PROMPT, sampling=config, sample_last=True)])
        assert [s.predicted_token for s in output.samples] == [0]
        outputs = rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 8, config),
                                                      DecodeFrameBatchRequest(b, 8, config)])
        assert [o.predicted_token for o in outputs] == [0, 0]
        a.close(), b.close()


def test_wire_sampling_config_is_accepted(tiny, ref):
    session = open_stage(tiny, 0, None).create_session()
    token, _ = session.prefill_chunk_frame_sampled(PROMPT, messages.SamplingConfig())  # disabled: greedy
    assert token == ref[-1]


def test_output_frame_converts_for_forwarding(tiny):
    first = open_stage(tiny, 0, 2).create_session()
    frame = first.prefill_chunk_frame(PROMPT)
    v1 = rt.frame_to_v1(frame)
    assert v1.desc.dtype == forwarding.ActivationDType.F32
    assert v1.desc.layout == forwarding.ActivationLayout.TOKEN_MAJOR
    assert (v1.desc.token_count, v1.desc.payload_bytes, v1.desc.layer_end) == (5, 5 * 4 * N_EMBD, 2)
    values = struct.unpack(f"<{5 * N_EMBD}f", v1.payload)
    assert all(v == v for v in values)  # finite rows, no NaN
    assert ActivationDesc.from_bytes(frame.desc.to_bytes()) == frame.desc


def test_f16_model_splits_match_one_stage(tmp_path):
    path = str(models.write_tiny_llama_gguf(tmp_path / "tiny-f16.gguf", file_type="f16"))
    expected = greedy_run(Pipeline(path, []), steps=3)
    assert greedy_run(Pipeline(path, [2]), steps=3) == expected


@pytest.mark.slow
def test_smollm2_two_stage_split_predicts_paris():
    path = str(models.smollm2_path())  # raises with the install command when the model is missing
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    first = StageModel.open(path, 0, 15, n_threads=2, ctx_size=64)
    last = StageModel.open(path, 15, None, stage_index=1, n_threads=2, ctx_size=64)
    a, b = first.create_session(), last.create_session()
    out = a.prefill_chunk_frame(prompt)
    frame = frame_from_wire(out.payload, 5, first.n_embd, 0, 0, 15, boundary=last.input_activation_boundary())
    predicted, _, _ = b.verify_tokens_frame(prompt, frame)
    assert predicted == [29, 282, 260, 314, 7042]  # runtime.md section 5.3; 7042 = "ĠParis"


def test_a_kv_cache_larger_than_the_memory_available_is_refused_before_it_is_allocated():
    """It was allocated and zeroed page by page until the out-of-memory killer ended the
    process (`-c 1000000` on SmolLM2 asks 46 GB a session)."""
    from skippy_wire.wire.constants import MAX_CTX_SIZE

    with open("/proc/meminfo", encoding="ascii") as meminfo:
        available = next(int(line.split()[1]) * 1024 for line in meminfo if line.startswith("MemAvailable:"))
    per_position = 2 * 30 * 3 * 64 * 4  # SmolLM2: K and V rows of 30 layers, 3 KV heads of 64, f32
    ctx_size = 2 * available // per_position
    if ctx_size > MAX_CTX_SIZE:
        pytest.skip("this machine holds SmolLM2's KV cache at the largest context")
    model = StageModel.open(str(models.smollm2_path()), 0, None, n_threads=1, ctx_size=ctx_size)
    with pytest.raises(StageRuntimeError) as error:
        model.create_session()
    assert re.fullmatch(rf"RuntimeError: cannot allocate the KV cache: \d+ MiB for {ctx_size} positions, \d+ MiB "
                        r"of memory available", str(error.value)), str(error.value)
    with pytest.raises(StageRuntimeError, match="cannot allocate the KV cache: "):  # the lane was given back
        model.create_session()


@pytest.mark.parametrize("codec_name", ["RAW_F32_V1", "BF16_RNE_V1"])
def test_output_frame_survives_forwarding_over_the_wire(tiny, ref, codec_name):
    """Stage 0 output -> frame_to_v1 -> forwarded_stage_message -> wire bytes -> read ->
    frame_from_wire -> stage 1: the raw codec reproduces the one-stage token exactly; a
    lossy codec still runs (same shapes, valid token)."""
    from skippy_wire.wire.constants import ActivationCodec

    codec = getattr(ActivationCodec, codec_name)
    first = open_stage(tiny, 0, 2, stage_index=0)
    last = open_stage(tiny, 2, None, stage_index=1)
    a, b = first.create_session(), last.create_session()
    out = a.prefill_chunk_frame(PROMPT)
    kind = messages.WireMessageKind.PREFILL_EMBD
    incoming = messages.StageWireMessage(kind=kind, pos_start=0, token_count=len(PROMPT),
                                         state=messages.StageStateHeader.new(kind), tokens=list(PROMPT))
    config = forwarding.StageConfig(stage_index=0, layer_start=0, layer_end=2, activation_codec=codec)
    forwarded = forwarding.forwarded_stage_message(config, incoming, rt.frame_to_v1(out), first.n_embd)
    wire = frame_mod.write_stage_message(forwarded)
    received = frame_mod.read_stage_message(wire, last.n_embd, codec)
    frame = frame_from_wire(received.activation_f32_payload(), received.token_count, last.n_embd,
                            received.state.source_stage_index, 0, last.layer_start,
                            received.state.activation_frame_flags,
                            boundary=last.input_activation_boundary())
    token, _ = b.prefill_chunk_frame_sampled(list(received.tokens), None, frame)
    if codec_name == "RAW_F32_V1":
        assert frame.payload == out.payload
        assert token == ref[-1]
    else:
        assert 0 <= token < 256
