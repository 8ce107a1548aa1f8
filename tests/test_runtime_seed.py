"""The unit tests of skippy-runtime 0.77.0 ``activation.rs`` (and the descriptor and sampling
tests of ``types.rs``), ported one for one.  Sessions without a native handle stand in for
the Rust ``raw: ptr::null_mut()`` sessions; the native call that has to reject them goes to
the real backend."""

from __future__ import annotations

import dataclasses

import pytest

from skippy_wire.stage import _backend as backend
from skippy_wire.stage import batch
from skippy_wire.stage import native
from skippy_wire.stage import runtime as rt
from skippy_wire.stage.runtime import (ACTIVATION_BOUNDARY_DESC_VERSION, ACTIVATION_FRAME_VERSION,
                                       ACTIVATION_PART_OPTIONAL, GGML_TYPE_F16, GGML_TYPE_F32, ActivationBoundaryDesc,
                                       ActivationDesc, ActivationFrame, ActivationPartDesc, IterationBatchPhase,
                                       IterationBatchRequest, PartialBatchExecution, RuntimeSamplingConfig,
                                       StageRuntimeError, collect_iteration_samples,
                                       iteration_request_requires_one_at_a_time, iteration_request_should_emit_sample,
                                       validate_serial_decode_request)


def activation_desc(payload_bytes: int) -> ActivationDesc:
    parts = [ActivationPartDesc() for _ in range(16)]
    parts[0] = ActivationPartDesc(
        ggml_type=GGML_TYPE_F32, rank=2, token_axis=1, dimensions=(1, 1, 0, 0),
        byte_strides=(4, 4, 0, 0), payload_bytes=payload_bytes,
    )
    return ActivationDesc(
        version=ACTIVATION_FRAME_VERSION, producer_stage_index=0, layer_start=0, layer_end=1,
        token_count=1, sequence_count=1, part_count=1, payload_bytes=payload_bytes,
        frontier_identity=bytes(32), parts=parts,
    )


def stage_session(token_count: int, terminal_stage: bool, batched_activation_exports: bool,
                  lib=backend) -> rt.StageSession:
    return rt.StageSession._from_native(
        None, lib, token_count=token_count, terminal_stage=terminal_stage,
        batched_activation_exports=batched_activation_exports,
    )


def test_raw_input_frame_rejects_payload_len_mismatch():
    frame = ActivationFrame(activation_desc(2), b"\x01")
    with pytest.raises(StageRuntimeError) as info:
        native.raw_input(frame)
    assert "activation payload length 1 does not match descriptor payload_bytes 2" in str(info.value)


def test_raw_input_frame_accepts_matching_payload_len():
    frame = ActivationFrame(activation_desc(1), b"\x01")
    desc, payload = native.raw_input(frame)
    assert ActivationDesc.from_bytes(desc).payload_bytes == 1
    assert payload == frame.payload


def test_serial_decode_accepts_explicit_phase_and_matching_position():
    request = IterationBatchRequest(
        session=stage_session(4, True, True), token_ids=[7], positions=[], sampling=None,
        input=None, sample_last=True, phase=IterationBatchPhase.DECODE,
    )
    validate_serial_decode_request(request)


@pytest.mark.parametrize("positions", [[], [0]])
def test_serial_decode_accepts_framed_origin_for_recurrent_downstream_stage(positions):
    frame = ActivationFrame(activation_desc(1), b"\x01")
    request = IterationBatchRequest(
        session=stage_session(0, True, True), token_ids=[7], positions=positions, sampling=None,
        input=frame, sample_last=True, phase=IterationBatchPhase.DECODE,
    )
    validate_serial_decode_request(request)


@pytest.mark.parametrize(
    "session_tokens, token_ids, positions, sample_last",
    [(0, [7], [], True), (4, [7, 8], [], True), (4, [7], [3], True), (4, [7], [], False)],
)
def test_serial_decode_rejects_invalid_decode_shapes(session_tokens, token_ids, positions, sample_last):
    request = IterationBatchRequest(
        session=stage_session(session_tokens, True, True), token_ids=token_ids, positions=positions,
        sampling=None, input=None, sample_last=sample_last, phase=IterationBatchPhase.DECODE,
    )
    with pytest.raises(StageRuntimeError):
        validate_serial_decode_request(request)


class _RecordingSession:
    """Stands in for a session on the one-at-a-time path: which of its steps ran, and how."""

    terminal_stage = True

    def __init__(self) -> None:
        self.calls = []

    def __getattr__(self, name):
        def step(*args):
            self.calls.append((name, args))
            return "frame"
        return step


def test_one_token_prefill_tail_is_explicitly_not_decode():
    # One token samples nothing here, which a decode step refuses: its phase makes it a
    # prefill chunk at its own position.
    session = _RecordingSession()
    request = IterationBatchRequest(
        session=session, token_ids=[7], positions=[4], sampling=None,
        input=None, sample_last=False, phase=IterationBatchPhase.PREFILL,
    )
    assert batch._execute_one_iteration_request(request) == (-1, "frame")
    assert session.calls == [("prefill_chunk_frame_with_positions", ([7], [4], None, 0))]
    with pytest.raises(StageRuntimeError):
        validate_serial_decode_request(dataclasses.replace(request, session=stage_session(4, True, True),
                                                           positions=[], phase=IterationBatchPhase.DECODE))


def test_serial_iteration_omits_samples_for_intermediate_stages():
    request = IterationBatchRequest(
        session=stage_session(4, False, True), token_ids=[7], positions=[], sampling=None,
        input=None, sample_last=True, phase=IterationBatchPhase.DECODE,
    )
    assert not iteration_request_should_emit_sample(request)


def test_sparse_iteration_samples_preserve_explicit_request_indexes():
    samples = collect_iteration_samples(3, 2, [0, 2, 0], [41, 99, 0])
    assert samples[0].request_index == 0
    assert samples[0].predicted_token == 41
    assert samples[1].request_index == 2
    assert samples[1].predicted_token == 99


def test_iteration_samples_reject_duplicate_or_out_of_range_indexes():
    with pytest.raises(StageRuntimeError):
        collect_iteration_samples(3, 2, [1, 1], [41, 99])
    with pytest.raises(StageRuntimeError):
        collect_iteration_samples(3, 1, [3], [41])
    with pytest.raises(StageRuntimeError):
        collect_iteration_samples(3, 4, [0, 1, 2, 0], [1, 2, 3, 4])


def batch_session(terminal_stage: bool, batched_activation_exports: bool, lib=backend):
    return stage_session(0, terminal_stage, batched_activation_exports, lib)


def decode_request(session, input=None):
    return IterationBatchRequest(
        session=session, token_ids=[7], positions=[], sampling=None, input=input,
        sample_last=True, phase=IterationBatchPhase.DECODE,
    )


def check_native_invalid_argument_without_serial_fallback(lib):
    first, second = batch_session(False, True, lib), batch_session(False, True, lib)
    with pytest.raises(StageRuntimeError) as info:
        rt.StageSession.iteration_batch_sampled([decode_request(first), decode_request(second)])
    assert "InvalidArgument" in str(info.value)
    assert not isinstance(info.value, PartialBatchExecution)
    assert first.token_count == 0
    assert second.token_count == 0


def test_native_invalid_argument_is_returned_without_serial_fallback():
    check_native_invalid_argument_without_serial_fallback(backend)


def test_exporting_stages_that_cannot_batch_exports_run_one_at_a_time():
    dense = batch_session(False, True)
    assert not iteration_request_requires_one_at_a_time(decode_request(dense)), (
        "an exporting attention stage with a unified split still batches"
    )
    recurrent = batch_session(False, False)
    assert iteration_request_requires_one_at_a_time(decode_request(recurrent)), (
        "recurrent and hybrid memory splits an all-output batch by sequence"
    )


def test_terminal_stages_batch_regardless_of_memory_splits():
    terminal = batch_session(True, False)
    assert not iteration_request_requires_one_at_a_time(decode_request(terminal)), (
        "a terminal stage samples through llama's output-row translation, never exports"
    )


def test_optional_activation_parts_always_run_one_at_a_time():
    dense = batch_session(False, True)
    desc = activation_desc(1)
    desc.parts[0].flags = ACTIVATION_PART_OPTIONAL
    frame = ActivationFrame(desc, b"\x01")
    assert iteration_request_requires_one_at_a_time(decode_request(dense, frame))


def test_partial_batch_execution_reports_the_requests_that_already_ran():
    cause = StageRuntimeError("native failed")
    error = PartialBatchExecution(2, cause)
    assert isinstance(error, StageRuntimeError) and isinstance(error, RuntimeError)
    assert error.executed == 2
    assert str(error.error) == "native failed"
    assert error.__cause__ is cause
    assert "executed 2 request(s)" in str(error)
    assert str(error) == "batch executed 2 request(s) before failing: native failed"


# --- types.rs: activation_boundary_descriptor_tests -----------------------------------------


def f32_boundary(elements_per_token: int) -> ActivationBoundaryDesc:
    parts = [ActivationPartDesc() for _ in range(16)]
    parts[0] = ActivationPartDesc(
        identity=bytes([1]) * 32, ggml_type=GGML_TYPE_F32, rank=2, token_axis=1,
        dimensions=(elements_per_token, -1, 0, 0), byte_strides=(4, elements_per_token * 4, 0, 0),
    )
    return ActivationBoundaryDesc(ACTIVATION_BOUNDARY_DESC_VERSION, 1, bytes([2]) * 32, parts)


def test_raw_f32_boundary_accepts_exact_graph_contract():
    boundary = f32_boundary(1024)
    assert boundary.raw_f32_width("output") == 1024
    assert boundary.payload_bytes("output", 128) == 524_288


def test_raw_f32_boundary_sizes_the_full_graph_observed_width():
    boundary = f32_boundary(3072)
    assert boundary.raw_f32_width("input") == 3072
    assert boundary.payload_bytes("input", 2) == 24_576


def _mutated(change):
    boundary = f32_boundary(1024)
    change(boundary)
    return boundary


@pytest.mark.parametrize(
    "boundary, expected",
    [
        (_mutated(lambda b: setattr(b, "version", b.version + 1)), "descriptor version"),
        (_mutated(lambda b: setattr(b.parts[0], "ggml_type", GGML_TYPE_F16)), "not token-indexed F32"),
        (_mutated(lambda b: setattr(b.parts[0], "token_axis", -1)), "not token-indexed F32"),
        (_mutated(lambda b: setattr(b.parts[0], "token_axis", 2)), "invalid rank or token axis"),
        (_mutated(lambda b: setattr(b.parts[0], "rank", 0)), "invalid rank or token axis"),
        (_mutated(lambda b: setattr(b.parts[0], "rank", 5)), "invalid rank or token axis"),
        (_mutated(lambda b: setattr(b, "part_count", 0)), "part count is invalid"),
        (f32_boundary(2**31), "width exceeds i32"),
    ],
)
def test_raw_f32_boundary_rejects_each_invalid_semantic(boundary, expected):
    with pytest.raises(StageRuntimeError) as info:
        boundary.raw_f32_width("input")
    assert expected in str(info.value)


def test_payload_size_overflow_fails_closed():
    boundary = f32_boundary(1)
    boundary.parts[0].dimensions = (2**63 - 1, -1, 0, 0)
    with pytest.raises(StageRuntimeError) as info:
        boundary.payload_bytes("output", 2**32 - 1)
    assert "overflow" in str(info.value)


def test_payload_size_hint_defers_dynamic_non_token_dimensions():
    boundary = f32_boundary(1024)
    boundary.parts[0].rank = 3
    boundary.parts[0].token_axis = 2
    boundary.parts[0].dimensions = (1024, -1, -1, 0)
    assert boundary.payload_bytes_hint("output", 2) is None
    with pytest.raises(StageRuntimeError) as info:
        boundary.payload_bytes("output", 2)
    assert "unresolved dynamic dimension" in str(info.value)


# --- types.rs: sampling tests ---------------------------------------------------------------


def test_sampling_raw_accepts_exact_native_dry_breaker_payload():
    raw = RuntimeSamplingConfig(dry_sequence_breakers=["123456789012345"]).to_bytes()
    assert raw[176:192] == b"123456789012345\0"  # 15 bytes and the NUL the native struct keeps


@pytest.mark.parametrize("breaker", ["1234567890123456", "\U0001F40D" * 4])
def test_sampling_raw_rejects_dry_breakers_that_cannot_fit_native_payload(breaker):
    with pytest.raises(StageRuntimeError):
        RuntimeSamplingConfig(dry_sequence_breakers=[breaker]).to_bytes()


def test_sampling_raw_rejects_unknown_sampler_names():
    with pytest.raises(StageRuntimeError) as info:
        RuntimeSamplingConfig(samplers=["unknown"]).to_bytes()
    assert str(info.value) == 'sampling sampler order contains "unknown"'


@pytest.mark.parametrize("name, shown", [("a\x01b", '"a\\u{1}b"'), ("a\x00b", '"a\\0b"'), ("x\x7f", '"x\\u{7f}"'),
                                         ("\u200b", '"\\u{200b}"'), ('q"\\\n\t\r', '"q\\"\\\\\\n\\t\\r"'),
                                         ("é 🐍", '"é 🐍"')])
def test_an_unknown_sampler_name_is_shown_as_rusts_debug_shows_it(name, shown):
    with pytest.raises(StageRuntimeError) as info:
        RuntimeSamplingConfig(samplers=[name]).to_bytes()
    assert str(info.value) == "sampling sampler order contains " + shown


def test_dataclass_copy_of_descriptor_keeps_parts_independent():
    desc = activation_desc(1)
    copy = dataclasses.replace(desc, parts=[dataclasses.replace(p) for p in desc.parts])
    copy.parts[0].flags = ACTIVATION_PART_OPTIONAL
    assert copy.parts[0].is_optional() and not desc.parts[0].is_optional()
    # the flag reaches the native layout: the copy packs as optional, the original not
    assert ActivationDesc.from_bytes(copy.to_bytes()).parts[0].is_optional()
    assert not ActivationDesc.from_bytes(desc.to_bytes()).parts[0].is_optional()
