"""The runtime adapter against the fake native layer (tests/fake_native.py): struct layouts,
BUFFER_TOO_SMALL retries, token-count bookkeeping, batches and their one-at-a-time path,
errors, and the frame conversions for forwarding."""

from __future__ import annotations

import struct

import pytest

import fake_native
from fake_native import FAKE
from skippy_wire.stage import runtime as rt
from skippy_wire.stage.runtime import (
    ACTIVATION_BOUNDARY_DESC_BYTES,
    ACTIVATION_DESC_BYTES,
    MTP_DRAFT_BYTES,
    SAMPLING_CONFIG_BYTES,
    ActivationBoundaryDesc,
    ActivationDesc,
    ActivationFrame,
    ActivationFrameError,
    ActivationPartDesc,
    NativeMtpDraft,
    PartialBatchExecution,
    RuntimeSamplingConfig,
    SamplingConfigError,
    StageRuntimeError,
    Status,
    frame_from_wire,
    frontier_identity_of,
    llama_residual_identity,
)
from skippy_wire.stage.runtime import (
    DecodeFrameBatchRequest,
    IterationBatchPhase,
    IterationBatchRequest,
    StageModel,
)


@pytest.fixture(autouse=True)
def _fresh_fake():
    FAKE.reset()
    yield
    FAKE.reset()


def open_stage(layer_start=0, layer_end=None, **kwargs):
    return StageModel.open("fake:model", layer_start, layer_end, backend=fake_native, **kwargs)


def calls(op):
    return [capacity for name, capacity in FAKE.calls if name == op]


# --- C layouts ------------------------------------------------------------------------------


def test_struct_sizes():
    assert len(ActivationDesc().to_bytes()) == ACTIVATION_DESC_BYTES == 2120
    assert len(ActivationPartDesc().to_bytes()) == 128
    assert len(ActivationBoundaryDesc().to_bytes()) == ACTIVATION_BOUNDARY_DESC_BYTES == 2088
    assert len(RuntimeSamplingConfig().to_bytes()) == SAMPLING_CONFIG_BYTES == 2352
    assert len(NativeMtpDraft.pack(True, [1])) == MTP_DRAFT_BYTES == 56


def test_activation_desc_offsets():
    parts = [ActivationPartDesc() for _ in range(16)]
    parts[1] = ActivationPartDesc(
        identity=bytes(range(32)), ggml_type=30, rank=3, token_axis=-2, flags=1,
        dimensions=(5, -1, 7, 8), byte_strides=(2, 10, 20, 40), payload_offset=99, payload_bytes=123,
    )
    desc = ActivationDesc(version=2, producer_stage_index=-1, layer_start=3, layer_end=9, token_count=11,
                          sequence_count=1, part_count=2, payload_bytes=2**40, frontier_identity=b"\xab" * 32,
                          parts=parts)
    raw = desc.to_bytes()
    assert struct.unpack_from("<IiiiIIII", raw, 0) == (2, -1, 3, 9, 11, 1, 2, 0)
    assert struct.unpack_from("<Q", raw, 32) == (2**40,)
    assert raw[40:72] == b"\xab" * 32
    part = 72 + 128
    assert raw[part : part + 32] == bytes(range(32))
    assert struct.unpack_from("<IIiI", raw, part + 32) == (30, 3, -2, 1)
    assert struct.unpack_from("<4q", raw, part + 48) == (5, -1, 7, 8)
    assert struct.unpack_from("<4Q", raw, part + 80) == (2, 10, 20, 40)
    assert struct.unpack_from("<QQ", raw, part + 112) == (99, 123)
    assert ActivationDesc.from_bytes(raw) == desc


def test_empty_descriptor_is_version_0_producer_minus_1():
    raw = ActivationDesc.empty().to_bytes()
    assert struct.unpack_from("<Ii", raw, 0) == (0, -1)
    assert raw[8:] == bytes(len(raw) - 8)


def test_boundary_offsets_round_trip():
    boundary = ActivationBoundaryDesc(2, 1, b"\x11" * 32)
    boundary.parts[0] = ActivationPartDesc(ggml_type=0, rank=2, token_axis=1, dimensions=(64, -1, 0, 0))
    raw = boundary.to_bytes()
    assert struct.unpack_from("<II", raw, 0) == (2, 1)
    assert raw[8:40] == b"\x11" * 32
    assert struct.unpack_from("<4q", raw, 40 + 48) == (64, -1, 0, 0)
    assert ActivationBoundaryDesc.from_bytes(raw) == boundary


def test_sampling_struct_offsets():
    config = RuntimeSamplingConfig(
        enabled=True, ignore_eos=True, seed=42, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
        presence_penalty=0.25, frequency_penalty=0.125, repeat_penalty=1.5, penalty_last_n=64,
        logit_bias=[(5, -1.5), (7, 2.0)], typical_p=0.75, top_nsigma=2.0, dynatemp_range=0.5,
        dynatemp_exponent=1.5, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3,
        dry_penalty_last_n=32, dry_sequence_breakers=["\n", "ab"], xtc_probability=0.25,
        xtc_threshold=0.5, mirostat_mode=2, mirostat_entropy=6.0, mirostat_learning_rate=0.2,
        samplers=["top_k", "typ_p", "temp"],
    )
    raw = config.to_bytes()
    assert struct.unpack_from("<IIIii", raw, 0) == (2, 3, 42, 40, 64)
    assert struct.unpack_from("<5f", raw, 20) == (0.5, pytest.approx(0.9), 0.25, 0.125, 1.5)
    assert struct.unpack_from("<I", raw, 40) == (2,)
    assert struct.unpack_from("<f", raw, 44) == (pytest.approx(0.05),)
    assert struct.unpack_from("<5f", raw, 48) == (0.75, 2.0, 0.5, 1.5, pytest.approx(0.8))
    assert struct.unpack_from("<fii", raw, 68) == (2.0, 3, 32)
    assert struct.unpack_from("<ffiff", raw, 80) == (0.25, 0.5, 2, 6.0, pytest.approx(0.2))
    assert struct.unpack_from("<I", raw, 100) == (3,)
    assert struct.unpack_from("<4I", raw, 104) == (4, 5, 9, 0)
    assert struct.unpack_from("<II", raw, 168) == (1, 2)
    assert raw[176:192] == b"\n" + bytes(15)
    assert raw[192:208] == b"ab" + bytes(14)
    assert raw[208:304] == bytes(96)
    assert struct.unpack_from("<ifif", raw, 304) == (5, -1.5, 7, 2.0)
    assert raw[320:] == bytes(SAMPLING_CONFIG_BYTES - 320)


def test_default_sampling_is_disabled_with_upstream_defaults():
    raw = RuntimeSamplingConfig().to_bytes()
    assert struct.unpack_from("<IIIii", raw, 0) == (2, 0, 0, 0, -1)
    assert struct.unpack_from("<I", raw, 100) == (9,)
    assert struct.unpack_from("<9I", raw, 104) == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert struct.unpack_from("<I", raw, 172) == (4,)


@pytest.mark.parametrize(
    "config, text",
    [
        (RuntimeSamplingConfig(logit_bias=[(1, 0.0)] * 257), "sampling logit_bias exceeds the native limit"),
        (RuntimeSamplingConfig(samplers=["top_k"] * 17), "sampling sampler order exceeds the native limit"),
        (RuntimeSamplingConfig(dry_sequence_breakers=["a"] * 9),
         "sampling DRY sequence breakers exceed the native count limit"),
        (RuntimeSamplingConfig(dry_sequence_breakers=["a" * 16]),
         "sampling DRY sequence breaker exceeds the native byte limit"),
        (RuntimeSamplingConfig(samplers=["greedy"]), 'sampling sampler order contains "greedy"'),
    ],
)
def test_sampling_validation_errors(config, text):
    with pytest.raises(SamplingConfigError) as info:
        config.to_bytes()
    assert str(info.value) == text
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


def test_sampling_limits_are_inclusive():
    RuntimeSamplingConfig(logit_bias=[(1, 0.5)] * 256, samplers=["top_k"] * 16,
                          dry_sequence_breakers=["x" * 15] * 8).to_bytes()


def test_sampling_from_wire_config():
    from skippy_wire.wire import messages as messages

    wire = messages.SamplingConfig(flags=3, seed=9, temperature=0.5, top_k=7, logit_bias=[(3, 1.0)])
    config = RuntimeSamplingConfig.from_wire(wire)
    assert config.enabled and config.ignore_eos
    assert (config.seed, config.temperature, config.top_k) == (9, 0.5, 7)
    assert list(config.logit_bias) == [(3, 1.0)]
    assert rt.sampling_to_bytes(wire) == config.to_bytes()
    assert not RuntimeSamplingConfig.from_wire(messages.SamplingConfig()).enabled


def test_sampling_from_wire_accepts_raw_f32_bits():
    class Wire:
        flags = 1
        temperature = 0x3F000000  # 0.5 as bits

    assert RuntimeSamplingConfig.from_wire(Wire()).temperature == 0.5


@pytest.mark.parametrize(
    "version, available, count, expected",
    [(1, True, 2, (11, 12)), (1, True, 12, tuple(range(11, 19))), (1, False, 2, None),
     (2, True, 2, None), (1, True, 0, None), (1, True, -1, None)],
)
def test_native_mtp_draft_from_raw_filtering(version, available, count, expected):
    raw = NativeMtpDraft.pack(available, list(range(11, 19)), 77, version=version, token_count=count)
    draft = NativeMtpDraft.from_bytes(raw)
    if expected is None:
        assert draft is None
    else:
        assert draft == NativeMtpDraft(expected, 77)


def test_status_error_text():
    assert str(StageRuntimeError.from_native(2, "session and at least one token are required")) == (
        "InvalidArgument: session and at least one token are required")
    assert str(StageRuntimeError.from_native(4, None)) == "BufferTooSmall"
    assert str(StageRuntimeError.from_native(99, "odd")) == "Status(99): odd"
    error = StageRuntimeError.from_native(7, "context full")
    assert error.status is Status.RUNTIME_ERROR and error.message == "context full"
    assert isinstance(error, RuntimeError)


# --- model and session ------------------------------------------------------------------------


def test_open_reports_stage_shape():
    source = open_stage(0, 2, stage_index=0)
    terminal = open_stage(2, None, stage_index=1)
    assert (source.is_source, source.is_terminal) == (True, False)
    assert (terminal.is_source, terminal.is_terminal) == (False, True)
    assert (terminal.layer_start, terminal.layer_end, terminal.n_layer) == (2, 4, 4)
    assert source.n_embd == 4 and source.n_vocab == 32 and terminal.stage_index == 1
    assert source.input_activation_boundary() is None
    assert source.output_activation_boundary().raw_f32_width("output") == 4
    assert terminal.output_activation_boundary() is None


def test_open_rejects_bad_layer_ranges():
    with pytest.raises(StageRuntimeError, match="layer_start must be less than layer_end"):
        open_stage(2, 2)
    with pytest.raises(StageRuntimeError) as info:
        open_stage(0, 9)
    assert info.value.status is Status.INVALID_ARGUMENT
    with pytest.raises(StageRuntimeError) as info:
        StageModel.open("/nonexistent/model.gguf", 0, None, backend=fake_native)
    assert info.value.status is Status.IO_ERROR


def test_direct_construction_is_refused():
    with pytest.raises(TypeError):
        StageModel()
    with pytest.raises(TypeError):
        rt.StageSession()


def test_lanes_are_claimed_and_released():
    model = open_stage(lane_count=1)
    first = model.create_session()
    with pytest.raises(StageRuntimeError) as info:
        model.create_session()
    assert info.value.status is Status.RUNTIME_ERROR
    first.close()
    with model.create_session() as second:
        assert second.token_count == 0


def test_prefill_retries_buffer_too_small_once_and_advances_only_on_success():
    session = open_stage(0, 2).create_session()
    frame = session.prefill_chunk_frame([1, 2, 3])
    assert calls("prefill_chunk_frame") == [0, 48]
    assert session.token_count == 3
    assert frame.desc.token_count == 3 and len(frame.payload) == frame.desc.payload_bytes == 48
    assert (frame.desc.layer_start, frame.desc.layer_end) == (0, 2)


def test_a_large_enough_capacity_needs_no_retry():
    session = open_stage(0, 2).create_session()
    session.prefill_chunk_frame([1, 2], output_capacity=1000)
    assert calls("prefill_chunk_frame") == [1000]
    assert len(session.prefill_chunk_frame([3], output_capacity=1000).payload) == 16


def test_buffer_too_small_without_a_larger_size_is_a_hard_error():
    session = open_stage(0, 2).create_session()
    FAKE.script("prefill_chunk_frame", Status.BUFFER_TOO_SMALL, "token output buffer too small", out_bytes=0)
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame([1])
    assert str(info.value) == "BufferTooSmall: token output buffer too small"
    assert session.token_count == 0


def test_native_errors_leave_token_count_unchanged():
    session = open_stage().create_session()
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame([])
    assert str(info.value) == "InvalidArgument: session and at least one token are required"
    FAKE.script("decode_step_frame_sampled", Status.RUNTIME_ERROR, "context full")
    with pytest.raises(StageRuntimeError, match="RuntimeError: context full"):
        session.decode_step_frame(1)
    assert session.token_count == 0


def test_sampled_prefill_and_decode_on_a_terminal_stage():
    session = open_stage().create_session()
    token, frame = session.prefill_chunk_frame_sampled([1, 2, 3], None)
    assert frame.payload == b"" and frame.desc.version == 0 and frame.desc.producer_stage_index == -1
    assert token == (7 * 3 + 2 + 4) % 32
    assert session.token_count == 3
    token2, _ = session.decode_step_frame(token)
    assert token2 == (7 * token + 3 + 4) % 32 and session.token_count == 4
    assert session.sample_current(None) == token2 and session.token_count == 4


def test_intermediate_stage_predicts_minus_one():
    session = open_stage(0, 2).create_session()
    token, frame = session.prefill_chunk_frame_sampled([1, 2], RuntimeSamplingConfig(enabled=True))
    assert token == -1 and len(frame.payload) == 32


def test_positions_variant_and_empty_positions():
    session = open_stage(0, 2).create_session()
    frame = session.prefill_chunk_frame_with_positions([5, 6], [10, 11])
    rows = struct.unpack("<8f", frame.payload)
    assert rows[1] == 10.0 and rows[5] == 11.0
    frame = session.prefill_chunk_frame_with_positions([7], [])
    assert struct.unpack("<4f", frame.payload)[1] == 2.0


def test_input_frame_payload_mismatch_is_rejected_before_native():
    session = open_stage(2, None).create_session()
    frame = frame_from_wire(bytes(16), 1, 4, 0, 0, 2)
    frame.payload = bytes(12)
    with pytest.raises(ActivationFrameError, match="activation payload length 12 does not match descriptor payload_bytes 16"):
        session.decode_step_frame(1, frame)
    assert FAKE.calls == []


def test_copy_output_activation_frame():
    session = open_stage(0, 2).create_session()
    with pytest.raises(StageRuntimeError, match="copy_output_activation_frame requires at least one token"):
        session.copy_output_activation_frame(0)
    first = session.prefill_chunk_frame([1, 2, 3])
    copy = session.copy_output_activation_frame(2)
    assert copy.payload == first.payload[16:] and copy.desc.token_count == 2
    assert calls("copy_output_activation_frame") == [0, 32]
    assert session.token_count == 3


def test_verify_trim_and_retire():
    session = open_stage().create_session()
    session.prefill_chunk_frame([1, 2])
    with pytest.raises(StageRuntimeError, match="verify_tokens_frame requires at least one token"):
        session.verify_tokens_frame([])
    predicted, draft, frame = session.verify_tokens_frame([3, 4, 5])
    assert predicted == [(7 * t + p + 4) % 32 for t, p in [(3, 2), (4, 3), (5, 4)]]
    assert draft is None and frame.payload == b""
    assert session.token_count == 5
    session.retire_verify_checkpoint(2, 3)
    assert session.token_count == 5
    session.verify_tokens_frame_sampled([6, 7], None, None, 0, max_draft_tokens=50)
    session.trim_session(6)
    assert session.token_count == 6 and session.native_position() == 6
    with pytest.raises(StageRuntimeError) as info:
        session.trim_session(10)
    assert info.value.status is Status.INVALID_ARGUMENT and session.token_count == 6
    assert session.verify_tokens_sampled_mtp([]) == ([], None)
    assert session.verify_tokens_sampled([]) == []
    session.reset()
    assert session.token_count == 0 and session.native_position() == 0


def test_two_stage_split_matches_one_stage():
    whole = open_stage().create_session()
    first = open_stage(0, 1, stage_index=0).create_session()
    second_model = open_stage(1, None, stage_index=1)
    second = second_model.create_session()
    boundary = second_model.input_activation_boundary()
    prompt = [3, 1, 4, 1, 5]
    expected, _ = whole.prefill_chunk_frame_sampled(prompt, None)
    out = first.prefill_chunk_frame(prompt)
    wire = frame_from_wire(out.payload, 5, 4, 0, 0, 1, boundary=boundary)
    token, _ = second.prefill_chunk_frame_sampled(prompt, None, wire)
    assert token == expected
    for _ in range(3):
        expected, _ = whole.decode_step_frame(expected)
        _, out = first.decode_step_frame(token)
        token, _ = second.decode_step_frame(token, frame_from_wire(out.payload, 1, 4, 0, 0, 1))
        assert token == expected
    assert whole.token_count == first.token_count == second.token_count == 8


def test_mismatched_frame_is_a_native_invalid_argument():
    second = open_stage(2, None).create_session()
    wrong_edge = frame_from_wire(bytes(16), 1, 4, 0, 0, 1)
    with pytest.raises(StageRuntimeError) as info:
        second.decode_step_frame(1, wrong_edge)
    assert info.value.status is Status.INVALID_ARGUMENT
    assert second.token_count == 0


# --- batches ----------------------------------------------------------------------------------


def test_empty_batches_make_no_native_call():
    assert rt.iteration_batch_sampled([]) == rt.IterationBatchOutput([], [])
    assert rt.decode_step_frame_batch_sampled([]) == []
    assert FAKE.calls == []


def test_iteration_batch_native_path_retries_with_required_sizes():
    model = open_stage(0, 2, lane_count=2)
    a, b = model.create_session(), model.create_session()
    output = rt.iteration_batch_sampled([
        IterationBatchRequest(a, [1, 2, 3]),
        IterationBatchRequest(b, [4], sample_last=True),
    ])
    assert calls("iteration_batch") == [[0, 0], [48, 16]]
    assert [len(frame.payload) for frame in output.request_outputs] == [48, 16]
    assert output.samples == []
    assert (a.token_count, b.token_count) == (3, 1)


def test_iteration_batch_samples_terminal_requests_that_asked():
    model = open_stage(lane_count=3)
    a, b, c = (model.create_session() for _ in range(3))
    output = rt.iteration_batch_sampled([
        IterationBatchRequest(a, [1, 2], sample_last=True),
        IterationBatchRequest(b, [3], sample_last=False),
        IterationBatchRequest(c, [4, 5, 6], sample_last=True),
    ])
    assert [s.request_index for s in output.samples] == [0, 2]
    assert output.samples[1].predicted_token == (7 * 6 + 2 + 4) % 32
    assert (a.token_count, b.token_count, c.token_count) == (2, 1, 3)


def test_iteration_batch_native_error_is_raised_as_is():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    FAKE.script("iteration_batch", Status.RUNTIME_ERROR, "compute failed")
    with pytest.raises(StageRuntimeError) as info:
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2])])
    assert str(info.value) == "RuntimeError: compute failed"
    assert not isinstance(info.value, PartialBatchExecution)
    assert (a.token_count, b.token_count) == (0, 0)


def test_iteration_batch_bad_samples_are_rejected():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    original = fake_native.iteration_batch_sampled

    def duplicate(requests, capacities, sampled_capacity):
        result = list(original(requests, capacities, sampled_capacity))
        result[5], result[6] = [1, 1], [5, 6]
        return tuple(result)

    fake_native.iteration_batch_sampled = duplicate
    try:
        with pytest.raises(StageRuntimeError, match="native iteration returned duplicate sample for request 1"):
            rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2])])
    finally:
        fake_native.iteration_batch_sampled = original


def test_iteration_batch_token_counts_move_together():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    a.token_count = 2**64 - 1  # the Rust checked_add overflow: nothing may be stored
    with pytest.raises(StageRuntimeError, match="session token count overflow"):
        rt.iteration_batch_sampled([IterationBatchRequest(b, [1]), IterationBatchRequest(a, [2])])
    assert b.token_count == 0


def test_serial_iteration_path_for_stages_that_cannot_batch_exports():
    model = open_stage(0, 2, lane_count=2)
    a, b = model.create_session(), model.create_session()
    a.batched_activation_exports = False
    a.prefill_chunk_frame([1, 2])
    output = rt.iteration_batch_sampled([
        IterationBatchRequest(a, [3], positions=[2], sample_last=True, phase=IterationBatchPhase.DECODE),
        IterationBatchRequest(b, [4, 5], positions=[0, 1]),
    ])
    assert "iteration_batch" not in [name for name, _ in FAKE.calls]
    assert [len(f.payload) for f in output.request_outputs] == [16, 32]
    assert output.samples == []  # intermediate stages never emit samples
    assert (a.token_count, b.token_count) == (3, 2)


def test_serial_iteration_failure_is_a_partial_batch_execution():
    model = open_stage(0, 2, lane_count=3)
    a, b, c = (model.create_session() for _ in range(3))
    for session in (a, b, c):
        session.batched_activation_exports = False
    with pytest.raises(PartialBatchExecution) as info:
        rt.iteration_batch_sampled([
            IterationBatchRequest(a, [1, 2]),
            IterationBatchRequest(b, [3], sample_last=True, phase=IterationBatchPhase.DECODE),
            IterationBatchRequest(c, [4]),
        ])
    error = info.value
    assert error.executed == 1
    assert "serial decode fallback requires an established session" in str(error)
    assert str(error).startswith("batch executed 1 request(s) before failing: ")
    assert error.__cause__ is error.error
    assert (a.token_count, b.token_count, c.token_count) == (2, 0, 0)


def test_optional_parts_force_the_serial_path_even_on_terminal_stages():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    desc = ActivationDesc.f32_rows(4, 1)
    desc.parts[0].flags = 1
    frame = ActivationFrame(desc, bytes(16))
    with pytest.raises(PartialBatchExecution) as info:
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1], sample_last=True),
                                    IterationBatchRequest(b, [2], input=frame)])
    assert info.value.executed == 1 and (a.token_count, b.token_count) == (1, 0)
    assert info.value.error.status is Status.INVALID_ARGUMENT  # a source stage takes no activation


def test_serial_path_emits_samples_only_for_terminal_sample_last():
    model = open_stage(2, None, lane_count=2)
    a, b = model.create_session(), model.create_session()

    def optional_frame(tokens):
        frame = frame_from_wire(bytes(16 * tokens), tokens, 4, 0, 0, 2)
        frame.desc.parts[0].flags = 1
        return frame

    output = rt.iteration_batch_sampled([
        IterationBatchRequest(a, [1, 2], input=optional_frame(2), sample_last=True),
        IterationBatchRequest(b, [3], input=optional_frame(1), sample_last=False),
    ])
    assert "iteration_batch" not in [name for name, _ in FAKE.calls]
    assert [s.request_index for s in output.samples] == [0]
    assert (a.token_count, b.token_count) == (2, 1)


def test_decode_batch_native_path_and_retry():
    model = open_stage(0, 2, lane_count=2)
    a, b = model.create_session(), model.create_session()
    a.prefill_chunk_frame([1])
    outputs = rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 5), DecodeFrameBatchRequest(b, 6)])
    assert calls("decode_batch") == [[0, 0], [16, 16]]
    assert [o.predicted_token for o in outputs] == [-1, -1]
    assert [len(o.output.payload) for o in outputs] == [16, 16]
    assert (a.token_count, b.token_count) == (2, 1)


def test_decode_batch_buffer_too_small_quirk_drops_the_message():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    FAKE.script("decode_batch", Status.BUFFER_TOO_SMALL, "predicted token buffer too small", out_bytes=0)
    with pytest.raises(StageRuntimeError) as info:
        rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 1), DecodeFrameBatchRequest(b, 2)])
    assert str(info.value) == "BufferTooSmall"
    assert (a.token_count, b.token_count) == (0, 0)


def test_iteration_batch_keeps_the_message_of_a_hard_buffer_too_small():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    FAKE.script("iteration_batch", Status.BUFFER_TOO_SMALL, "sample buffer too small", out_bytes=0)
    with pytest.raises(StageRuntimeError) as info:
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2])])
    assert str(info.value) == "BufferTooSmall: sample buffer too small"


def test_decode_batch_serial_path_partial_failure():
    model = open_stage(0, 2, lane_count=2)
    a, b = model.create_session(), model.create_session()
    b.batched_activation_exports = False
    outputs = rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 1), DecodeFrameBatchRequest(b, 2)])
    assert len(outputs) == 2 and (a.token_count, b.token_count) == (1, 1)
    assert "decode_batch" not in [name for name, _ in FAKE.calls]
    with pytest.raises(PartialBatchExecution) as info:
        rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 1), DecodeFrameBatchRequest(b, 99)])
    assert info.value.executed == 1
    assert info.value.error.status is Status.INVALID_ARGUMENT
    assert (a.token_count, b.token_count) == (2, 1)


def test_batches_accept_the_static_method_spelling():
    assert rt.StageSession.iteration_batch_sampled is rt.iteration_batch_sampled
    assert rt.IterationPhase is IterationBatchPhase
    assert IterationBatchPhase.Decode is IterationBatchPhase.DECODE


# --- frame conversions ------------------------------------------------------------------------


def test_frame_from_wire_builds_the_backend_frame():
    payload = struct.pack("<8f", *range(8))
    frame = frame_from_wire(payload, 2, 4, 0, 0, 3)
    desc = frame.desc
    assert (desc.version, desc.producer_stage_index, desc.layer_start, desc.layer_end) == (2, 0, 0, 3)
    assert (desc.token_count, desc.sequence_count, desc.part_count, desc.payload_bytes) == (2, 1, 1, 32)
    part = desc.parts[0]
    assert (part.ggml_type, part.rank, part.token_axis) == (0, 2, 1)
    assert part.dimensions == (4, 2, 0, 0) and part.byte_strides == (4, 16, 0, 0)
    assert part.identity == llama_residual_identity(4)
    assert desc.frontier_identity == frontier_identity_of(desc.parts[:1])
    frame.validate_payload_len()
    with pytest.raises(ActivationFrameError):
        frame_from_wire(payload, 3, 4, 0, 0, 3)
    with pytest.raises(ActivationFrameError, match="sidebands"):
        frame_from_wire(payload, 2, 4, 0, 0, 3, flags=1)


def test_frame_from_wire_copies_boundary_identities():
    boundary = ActivationBoundaryDesc(2, 1, b"\x22" * 32)
    boundary.parts[0] = ActivationPartDesc(identity=b"\x33" * 32, rank=2, token_axis=1, dimensions=(4, -1, 0, 0))
    frame = frame_from_wire(bytes(16), 1, 4, 0, 0, 1, boundary=boundary)
    assert frame.desc.parts[0].identity == b"\x33" * 32 and frame.desc.frontier_identity == b"\x22" * 32


def test_frame_to_v1():
    from skippy_wire.wire import forwarding as forwarding

    session = open_stage(0, 2, stage_index=0).create_session()
    frame = session.prefill_chunk_frame([1, 2])
    v1 = rt.frame_to_v1(frame)
    assert isinstance(v1, forwarding.ActivationFrameV1)
    desc = v1.desc
    assert desc.version == 1
    assert desc.dtype == forwarding.ActivationDType.F32
    assert desc.layout == forwarding.ActivationLayout.TOKEN_MAJOR
    assert (desc.producer_stage_index, desc.layer_start, desc.layer_end) == (0, 0, 2)
    assert (desc.token_count, desc.sequence_count, desc.payload_bytes, desc.flags) == (2, 1, 32, 0)
    assert bytes(v1.payload) == frame.payload


def test_unrepresentable_arguments_are_value_errors():
    session = open_stage().create_session()
    for call in (lambda: session.prefill_chunk_frame([2**31]),
                 lambda: session.decode_step_frame(-(2**31) - 1),
                 lambda: session.prefill_chunk_frame_with_positions([1], [2**40]),
                 lambda: session.trim_session(-1),
                 lambda: session.retire_verify_checkpoint(-1, 1),
                 lambda: session.copy_output_activation_frame(-2),
                 lambda: session.prefill_chunk_frame([1], output_capacity=-1)):
        with pytest.raises(rt.StageArgumentError) as info:
            call()
        assert isinstance(info.value, ValueError) and isinstance(info.value, StageRuntimeError)
    assert FAKE.calls == [] and session.token_count == 0


def test_errors_pickle_with_their_fields():
    import pickle

    error = pickle.loads(pickle.dumps(StageRuntimeError.from_native(2, "bad")))
    assert (error.status, error.message, str(error)) == (Status.INVALID_ARGUMENT, "bad", "InvalidArgument: bad")
    partial = pickle.loads(pickle.dumps(PartialBatchExecution(3, StageRuntimeError("boom"))))
    assert partial.executed == 3 and str(partial) == "batch executed 3 request(s) before failing: boom"
    assert isinstance(pickle.loads(pickle.dumps(SamplingConfigError("x"))), SamplingConfigError)
