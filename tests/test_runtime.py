"""The runtime adapter on the real backend over the tiny generated GGUF, through the
recording stand-in of tests/fake_native.py (which injects only what the backend cannot
produce): BUFFER_TOO_SMALL retries, token-count bookkeeping, batches and their one-at-a-time
path, errors.  Struct layouts, sampling and frame conversions are test_runtime_structs.py."""

from __future__ import annotations

import sys

import pytest

import fake_native
from fake_native import FAKE, fields
from skippy_wire.stage import models
from skippy_wire.stage import runtime as rt
from skippy_wire.wire import forwarding
from skippy_wire.stage.runtime import (
    ActivationDesc,
    ActivationFrame,
    ActivationFrameError,
    PartialBatchExecution,
    RuntimeSamplingConfig,
    StageRuntimeError,
    Status,
    frame_from_wire,
)
from skippy_wire.stage.runtime import (
    DecodeFrameBatchRequest,
    IterationBatchPhase,
    IterationBatchRequest,
    StageModel,
)


N_EMBD, ROW = 64, 4 * 64  # the tiny model: 4 layers, n_embd 64, n_vocab 256
#: Greedy per-row outputs of [1, 10, 20, 30, 40] on the tiny model (runtime.md 6.2).
REFERENCE_ROWS = [221, 181, 221, 92, 56]
TINY = None


@pytest.fixture(autouse=True, scope="module")
def _tiny_model(tmp_path_factory):
    global TINY
    TINY = str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"))


@pytest.fixture(autouse=True)
def _fresh_fake():
    FAKE.reset()
    yield
    FAKE.reset()


def open_stage(layer_start=0, layer_end=None, **kwargs):
    kwargs.setdefault("n_threads", 1)
    return StageModel.open(TINY, layer_start, layer_end, backend=fake_native, **kwargs)


def calls(op):
    return [capacity for name, capacity in FAKE.calls if name == op]


# --- model and session ------------------------------------------------------------------------


def test_open_reports_stage_shape():
    source = open_stage(0, 2, stage_index=0)
    terminal = open_stage(2, None, stage_index=1)
    assert (source.is_source, source.is_terminal) == (True, False)
    assert (terminal.is_source, terminal.is_terminal) == (False, True)
    assert (terminal.layer_start, terminal.layer_end, terminal.n_layer) == (2, 4, 4)
    assert source.n_embd == N_EMBD and source.n_vocab == 256 and terminal.stage_index == 1
    assert source.input_activation_boundary() is None
    assert source.output_activation_boundary().raw_f32_width("output") == N_EMBD
    assert source.output_activation_boundary() == terminal.input_activation_boundary()
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


def test_open_checks_its_options_in_upstreams_order():
    # RuntimeConfig::validate: the layer range, then n_batch, then n_threads; each before native
    cases = [((2, 2), {"n_batch": 0, "n_threads": 0}, "layer_start must be less than layer_end"),
             ((0, 2), {"n_batch": 0, "n_threads": 0}, "n_batch must be greater than zero when provided"),
             ((0, 2), {"n_threads": 0}, "n_threads must be greater than zero when provided")]
    for (start, end), options, text in cases:
        with pytest.raises(StageRuntimeError) as info:
            StageModel.open("/nonexistent/model.gguf", start, end, backend=fake_native, **options)
        assert str(info.value) == text and info.value.status is None


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
    assert calls("prefill_chunk_frame") == [0, 3 * ROW]
    assert session.token_count == 3
    assert frame.desc.token_count == 3 and len(frame.payload) == frame.desc.payload_bytes == 3 * ROW
    assert (frame.desc.layer_start, frame.desc.layer_end) == (0, 2)


def test_a_large_enough_capacity_needs_no_retry():
    session = open_stage(0, 2).create_session()
    session.prefill_chunk_frame([1, 2], output_capacity=1000)
    assert calls("prefill_chunk_frame") == [1000]
    assert len(session.prefill_chunk_frame([3], output_capacity=1000).payload) == ROW


def test_buffer_too_small_without_a_larger_size_is_a_hard_error():
    session = open_stage(0, 2).create_session()
    FAKE.script_error("prefill_chunk_frame", Status.BUFFER_TOO_SMALL, "token output buffer too small", required=0)
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame([1])
    assert str(info.value) == "BufferTooSmall: token output buffer too small"
    assert session.token_count == 0


def test_a_native_size_that_keeps_growing_ends_the_retries():
    session = open_stage(0, 2).create_session()
    for size in range(1, rt.MAX_BUFFER_RETRIES + 2):
        FAKE.script_error("prefill_chunk_frame", Status.BUFFER_TOO_SMALL, "grow", required=size)
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame([1])
    assert str(info.value) == f"native kept reporting a larger output buffer after {rt.MAX_BUFFER_RETRIES} retries"
    assert calls("prefill_chunk_frame") == list(range(rt.MAX_BUFFER_RETRIES + 1))
    assert session.token_count == 0


def test_native_errors_leave_token_count_unchanged():
    session = open_stage(ctx_size=2).create_session()
    with pytest.raises(StageRuntimeError) as info:
        session.prefill_chunk_frame([])
    assert str(info.value) == "InvalidArgument: session and at least one token are required"
    session.prefill_chunk_frame([1, 2])
    with pytest.raises(StageRuntimeError, match="^RuntimeError: context full"):
        session.decode_step_frame(1)
    assert session.token_count == 2 and session.native_position() == 2


def test_sampled_prefill_and_decode_on_a_terminal_stage():
    session = open_stage().create_session()
    token, frame = session.prefill_chunk_frame_sampled([1, 10, 20], None)
    assert frame.payload == b"" and frame.desc.version == 0 and frame.desc.producer_stage_index == -1
    assert token == REFERENCE_ROWS[2]
    assert session.token_count == 3
    token2, _ = session.decode_step_frame(30)
    assert token2 == REFERENCE_ROWS[3] and session.token_count == 4
    assert session.sample_current(None) == token2 and session.token_count == 4


def test_intermediate_stage_predicts_minus_one():
    session = open_stage(0, 2).create_session()
    token, frame = session.prefill_chunk_frame_sampled([1, 2], RuntimeSamplingConfig(enabled=True))
    assert token == -1 and len(frame.payload) == 2 * ROW


def test_positions_variant_and_empty_positions():
    model = open_stage(0, 2, lane_count=3)
    explicit, contiguous, shifted = (model.create_session() for _ in range(3))
    rows = contiguous.prefill_chunk_frame([5, 6]).payload
    assert explicit.prefill_chunk_frame_with_positions([5, 6], [0, 1]).payload == rows
    assert (explicit.prefill_chunk_frame_with_positions([7], []).payload  # empty = contiguous
            == contiguous.prefill_chunk_frame([7]).payload)
    assert shifted.prefill_chunk_frame_with_positions([5, 6], [10, 11]).payload != rows  # RoPE sees positions


def test_input_frame_payload_mismatch_is_rejected_before_native():
    session = open_stage(2, None).create_session()
    frame = frame_from_wire(bytes(ROW), 1, N_EMBD, 0, 0, 2)
    frame.payload = bytes(ROW - 4)
    with pytest.raises(ActivationFrameError, match="activation payload length 252 does not match descriptor payload_bytes 256"):
        session.decode_step_frame(1, frame)
    assert FAKE.calls == []


def test_copy_output_activation_frame():
    session = open_stage(0, 2).create_session()
    with pytest.raises(StageRuntimeError, match="copy_output_activation_frame requires at least one token"):
        session.copy_output_activation_frame(0)
    first = session.prefill_chunk_frame([1, 2, 3])
    copy = session.copy_output_activation_frame(2)
    assert copy.payload == first.payload[ROW:] and copy.desc.token_count == 2
    assert calls("copy_output_activation_frame") == [0, 2 * ROW]
    assert session.token_count == 3


def test_verify_trim_and_retire():
    session = open_stage().create_session()
    session.prefill_chunk_frame([1, 10])
    with pytest.raises(StageRuntimeError, match="verify_tokens_frame requires at least one token"):
        session.verify_tokens_frame([])
    predicted, draft, frame = session.verify_tokens_frame([20, 30, 40])
    assert predicted == REFERENCE_ROWS[2:]
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
    wire = frame_from_wire(out.payload, 5, N_EMBD, 0, 0, 1, boundary=boundary)
    token, _ = second.prefill_chunk_frame_sampled(prompt, None, wire)
    assert token == expected
    for _ in range(3):
        expected, _ = whole.decode_step_frame(expected)
        _, out = first.decode_step_frame(token)
        token, _ = second.decode_step_frame(token, frame_from_wire(out.payload, 1, N_EMBD, 0, 0, 1))
        assert token == expected
    assert whole.token_count == first.token_count == second.token_count == 8


def test_raw_decode_step_is_the_sampled_one_with_the_frame_left_packed():
    prompt = [3, 1, 4, 1, 5]
    parsed, packed = (open_stage(0, 1, stage_index=0).create_session() for _ in range(2))
    for session in (parsed, packed):
        session.prefill_chunk_frame(prompt)
    for token in (7, 9):
        predicted, frame = parsed.decode_step_frame_sampled(token, output_capacity=ROW)
        raw_predicted, raw = packed.decode_step_frame_raw(token, output_capacity=ROW)
        assert isinstance(raw, rt.PackedFrame) and raw_predicted == predicted == -1
        assert raw.desc == frame.desc.to_bytes() and raw.payload == frame.payload and len(raw.payload) == ROW
    assert packed.token_count == parsed.token_count == len(prompt) + 2


def test_mismatched_frame_is_a_native_invalid_argument():
    second = open_stage(2, None).create_session()
    wrong_edge = frame_from_wire(bytes(ROW), 1, N_EMBD, 0, 0, 1)
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
    assert calls("iteration_batch") == [[0, 0], [3 * ROW, ROW]]
    assert [len(frame.payload) for frame in output.request_outputs] == [3 * ROW, ROW]
    assert output.samples == []
    assert (a.token_count, b.token_count) == (3, 1)


def test_iteration_batch_samples_terminal_requests_that_asked():
    model = open_stage(lane_count=3)
    a, b, c = (model.create_session() for _ in range(3))
    output = rt.iteration_batch_sampled([
        IterationBatchRequest(a, [1, 10, 20], sample_last=True),
        IterationBatchRequest(b, [3], sample_last=False),
        IterationBatchRequest(c, [1, 10, 20, 30, 40], sample_last=True),
    ])
    assert [s.request_index for s in output.samples] == [0, 2]
    assert [s.predicted_token for s in output.samples] == [REFERENCE_ROWS[2], REFERENCE_ROWS[4]]
    assert (a.token_count, b.token_count, c.token_count) == (3, 1, 5)


def test_iteration_batch_native_error_is_raised_as_is():
    model = open_stage(lane_count=2, ctx_size=2)
    a, b = model.create_session(), model.create_session()
    with pytest.raises(StageRuntimeError) as info:
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2, 3, 4])])
    assert str(info.value) == "RuntimeError: request 1: context full: 0 cached + 3 new tokens exceed ctx_size 2"
    assert not isinstance(info.value, PartialBatchExecution)
    assert (a.token_count, b.token_count) == (0, 0)


def test_iteration_batch_bad_samples_are_rejected():
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    FAKE.script_result("iteration_batch", lambda r: fields(r, sampled_request_indexes=[1, 1], predicted_tokens=[5, 6]))
    with pytest.raises(StageRuntimeError, match="native iteration returned duplicate sample for request 1"):
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2])])
    FAKE.script_result("iteration_batch", lambda r: fields(r, sampled_request_indexes=[2], predicted_tokens=[5]))
    with pytest.raises(StageRuntimeError, match="native iteration sample references request 2, but only 2"):
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2])])


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
    assert [len(f.payload) for f in output.request_outputs] == [ROW, 2 * ROW]
    assert output.samples == []  # intermediate stages never emit samples
    assert (a.token_count, b.token_count) == (3, 2)


@pytest.mark.parametrize("one_at_a_time", [False, True])
def test_an_unknown_iteration_phase_is_refused_before_anything_runs(one_at_a_time):
    # the native batch ignored it and the serial path failed on it inside PartialBatchExecution
    model = open_stage(0, 2, lane_count=2)
    a, b = model.create_session(), model.create_session()
    a.batched_activation_exports = b.batched_activation_exports = not one_at_a_time
    with pytest.raises(rt.StageArgumentError, match="^iteration batch request 1 has an unknown phase 'bogus'$"):
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1]), IterationBatchRequest(b, [2], phase="bogus")])
    assert (a.token_count, b.token_count) == (0, 0)


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
    desc = ActivationDesc.f32_rows(N_EMBD, 1)
    desc.parts[0].flags = 1
    frame = ActivationFrame(desc, bytes(ROW))
    with pytest.raises(PartialBatchExecution) as info:
        rt.iteration_batch_sampled([IterationBatchRequest(a, [1], sample_last=True),
                                    IterationBatchRequest(b, [2], input=frame)])
    assert info.value.executed == 1 and (a.token_count, b.token_count) == (1, 0)
    assert info.value.error.status is Status.INVALID_ARGUMENT  # a source stage takes no activation


def test_serial_path_emits_samples_only_for_terminal_sample_last():
    model = open_stage(2, None, lane_count=2)
    a, b = model.create_session(), model.create_session()
    FAKE.accept_optional_parts = True  # the llama backend rejects part flags

    def optional_frame(tokens):
        frame = frame_from_wire(bytes(ROW * tokens), tokens, N_EMBD, 0, 0, 2)
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
    assert calls("decode_batch") == [[0, 0], [ROW, ROW]]
    assert [o.predicted_token for o in outputs] == [-1, -1]
    assert [len(o.output.payload) for o in outputs] == [ROW, ROW]
    assert (a.token_count, b.token_count) == (2, 1)


@pytest.mark.parametrize("serial", [False, True], ids=["native", "one-at-a-time"])
def test_a_packed_decode_batch_is_the_parsed_one_left_in_the_runtime_layout(serial):
    outputs = {}
    for packed in (False, True):
        model = open_stage(0, 2, lane_count=2)
        a, b = model.create_session(), model.create_session()
        for session in (a, b):
            session.batched_activation_exports = not serial
            session.prefill_chunk_frame([1, 2])
        outputs[packed] = rt.decode_step_frame_batch_sampled(
            [DecodeFrameBatchRequest(a, 5, output_capacity=ROW), DecodeFrameBatchRequest(b, 6, output_capacity=ROW)],
            packed=packed)
        assert (a.token_count, b.token_count) == (3, 3)
    assert ("decode_batch" in [name for name, _ in FAKE.calls]) is not serial
    assert all(isinstance(out.output, rt.PackedFrame) for out in outputs[True])
    assert [(out.predicted_token, out.output.desc, out.output.payload) for out in outputs[True]] == \
        [(out.predicted_token, out.output.desc.to_bytes(), out.output.payload) for out in outputs[False]]
    assert len({out.output.payload for out in outputs[True]}) == 2


def _two_sessions_failing_batch(call, message):
    """Two sessions of a 2-lane stage whose next batch ``call`` fails with a
    BUFFER_TOO_SMALL that asks for no more room (``required=[0, 0]``)."""
    model = open_stage(lane_count=2)
    a, b = model.create_session(), model.create_session()
    FAKE.script_error(call, Status.BUFFER_TOO_SMALL, message, required=[0, 0])
    return a, b


def test_decode_batch_buffer_too_small_quirk_drops_the_message():
    a, b = _two_sessions_failing_batch("decode_batch", "predicted token buffer too small")
    with pytest.raises(StageRuntimeError) as info:
        rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 1), DecodeFrameBatchRequest(b, 2)])
    assert str(info.value) == "BufferTooSmall"
    assert (a.token_count, b.token_count) == (0, 0)


def test_iteration_batch_keeps_the_message_of_a_hard_buffer_too_small():
    a, b = _two_sessions_failing_batch("iteration_batch", "sample buffer too small")
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
        rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(a, 1), DecodeFrameBatchRequest(b, 999)])
    assert info.value.executed == 1
    assert info.value.error.status is Status.INVALID_ARGUMENT
    assert (a.token_count, b.token_count) == (2, 1)


def test_batches_accept_the_static_method_spelling():
    assert rt.StageSession.iteration_batch_sampled is rt.iteration_batch_sampled
    assert rt.IterationPhase is IterationBatchPhase
    assert IterationBatchPhase.Decode is IterationBatchPhase.DECODE


def test_frame_to_v1():
    session = open_stage(0, 2, stage_index=0).create_session()
    frame = session.prefill_chunk_frame([1, 2])
    v1 = rt.frame_to_v1(frame)
    assert isinstance(v1, forwarding.ActivationFrameV1)
    desc = v1.desc
    assert desc.version == 1
    assert desc.dtype == forwarding.ActivationDType.F32
    assert desc.layout == forwarding.ActivationLayout.TOKEN_MAJOR
    assert (desc.producer_stage_index, desc.layer_start, desc.layer_end) == (0, 0, 2)
    assert (desc.token_count, desc.sequence_count, desc.payload_bytes, desc.flags) == (2, 1, 2 * ROW, 0)
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


def test_arguments_that_are_not_integers_are_argument_errors():
    # A float is not truncated into a token id, a string is not parsed as one.
    session = open_stage().create_session()
    for call in (lambda: session.prefill_chunk_frame([1.5]),
                 lambda: session.prefill_chunk_frame(["1"]),
                 lambda: session.decode_step_frame(None),
                 lambda: session.prefill_chunk_frame_with_positions([1], [0.0]),
                 lambda: session.trim_session("0"),
                 lambda: decode_step_frame_batch_sampled_request(session, "5")):
        with pytest.raises(rt.StageArgumentError, match="must be an integer, not"):
            call()
    assert FAKE.calls == [] and session.token_count == 0


@pytest.mark.parametrize("ids", [b"\x01\x0a\x14", bytearray(b"\x01"), "abc"])
def test_bytes_or_text_are_no_token_ids(ids):
    # bytes were read one by one as ids (text bytes passed by mistake: a wrong prefill, no error)
    session = open_stage().create_session()
    refused = f"^token ids must be a sequence of ints, not {type(ids).__name__}$"
    with pytest.raises(rt.StageArgumentError, match=refused):
        session.prefill_chunk_frame(ids)
    assert FAKE.calls == [] and session.token_count == 0


def decode_step_frame_batch_sampled_request(session, token_id, **kwargs):
    return rt.decode_step_frame_batch_sampled([DecodeFrameBatchRequest(session, token_id, **kwargs)])


def test_output_capacities_beyond_a_buffer_are_argument_errors():
    session = open_stage().create_session()
    # 2**63 - 1 passed the bound the message named and failed as a raw OverflowError; True was 1
    for capacity in (2**63, 2**63 - 1, sys.maxsize - sys.getsizeof(b"") + 1):
        with pytest.raises(rt.StageArgumentError, match="exceeds the largest buffer"):
            session.prefill_chunk_frame([1], output_capacity=capacity)
    with pytest.raises(rt.StageArgumentError, match="output capacity must be an integer, not bool"):
        session.prefill_chunk_frame([1], output_capacity=True)
    # the native decode batch path checks its capacities as the single calls do
    for capacity in (-1, 2**64 - 1):
        with pytest.raises(rt.StageArgumentError, match="output capacity"):
            decode_step_frame_batch_sampled_request(session, 5, output_capacity=capacity)
    assert FAKE.calls == [] and session.token_count == 0


def test_open_options_that_are_not_i32_integers_are_argument_errors():
    for kwargs in ({"ctx_size": 2**31}, {"lane_count": 2**32}, {"n_batch": 2**40}, {"stage_index": 2**31},
                   {"n_threads": 2**31}, {"layer_start": None}, {"layer_start": "0"}, {"layer_end": 2.0}):
        layer_start, layer_end = kwargs.pop("layer_start", 0), kwargs.pop("layer_end", None)
        with pytest.raises(rt.StageArgumentError):
            open_stage(layer_start, layer_end, **kwargs)
