"""Batch execution of the stage adapter (runtime.md section 1.6): one scheduler iteration,
or one decode step, for several sessions as a single native batch.

A batch runs one request at a time, by decision, when any input frame carries optional
parts or an exporting stage cannot batch exports; a failure there is a
``PartialBatchExecution``.  Native iteration samples are validated (range, duplicates,
counts).  Sessions are ``skippy_wire.stage.runtime.StageSession`` objects (this module sits
below it: it uses their ``native_session``, ``backend``, ``token_count``, ``terminal_stage``
and ``batched_activation_exports`` and their frame calls).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, List, Optional, Sequence, Tuple

from ..errors import PartialBatchExecution, StageArgumentError, StageRuntimeError, Status
from .activation import ActivationFrame, PackedFrame
from .native import (
    checked_add,
    default_backend,
    output_frame,
    raw_input,
    to_capacity,
    to_i32,
    to_positions,
    to_tokens,
    with_output_capacity,
)
from .sampling import sampling_to_bytes


class IterationBatchPhase(enum.Enum):
    """What a scheduler iteration request is; a 1-token prefill tail is still PREFILL."""

    PREFILL = "prefill"
    DECODE = "decode"
    Prefill = "prefill"  # alias: the Rust variant names
    Decode = "decode"


IterationPhase = IterationBatchPhase


@dataclass
class DecodeFrameBatchRequest:
    session: Any  # a StageSession
    token_id: int
    sampling: Any = None
    input: Optional[ActivationFrame] = None
    output_capacity: int = 0  # bytes; 0 = learn it from the first BUFFER_TOO_SMALL


@dataclass
class IterationBatchRequest:
    session: Any  # a StageSession
    token_ids: Sequence[int]
    positions: Sequence[int] = ()
    sampling: Any = None
    input: Optional[ActivationFrame] = None
    sample_last: bool = False
    phase: IterationBatchPhase = IterationBatchPhase.PREFILL


@dataclass(frozen=True)
class DecodeFrameBatchOutput:
    predicted_token: int
    output: ActivationFrame  # a PackedFrame when asked for ``packed``


@dataclass(frozen=True)
class IterationSample:
    request_index: int
    predicted_token: int


@dataclass
class IterationBatchOutput:
    request_outputs: List[ActivationFrame] = field(default_factory=list)
    samples: List[IterationSample] = field(default_factory=list)


def frame_has_optional_parts(frame: Optional[ActivationFrame]) -> bool:
    """Whether a frame carries parts the batched frontier does not concatenate."""
    return frame is not None and frame.has_optional_parts()


def exporting_stage_requires_one_request(session: Any) -> bool:
    """Recurrent/hybrid memory splits an all-output batch by sequence; terminal stages
    sample through the output-row mapping and never export, so they always batch."""
    return not session.terminal_stage and not session.batched_activation_exports


def iteration_request_requires_one_at_a_time(request: Any) -> bool:
    """Whether one (iteration or decode) request has to run outside the native batch."""
    return frame_has_optional_parts(request.input) or exporting_stage_requires_one_request(request.session)


decode_request_requires_one_at_a_time = iteration_request_requires_one_at_a_time


def iteration_request_should_emit_sample(request: IterationBatchRequest) -> bool:
    return bool(request.sample_last) and request.session.terminal_stage


def validate_serial_decode_request(request: IterationBatchRequest) -> None:
    """Checks a DECODE-phase request before it runs as a single decode step."""
    session = request.session
    positions = list(request.positions)
    framed_origin = session.token_count == 0 and request.input is not None and positions in ([], [0])
    if not (session.token_count > 0 or framed_origin):
        raise StageRuntimeError(
            "serial decode fallback requires an established session or a framed origin decode"
        )
    if len(request.token_ids) != 1:
        raise StageRuntimeError("serial decode fallback requires exactly one token")
    if not request.sample_last:
        raise StageRuntimeError("serial decode fallback requires sampling")
    if positions:
        if len(positions) != 1:
            raise StageRuntimeError("serial decode fallback accepts at most one explicit position")
        position = positions[0]
        if position < 0:
            raise StageRuntimeError("decode position is negative")
        if position != session.token_count:
            raise StageRuntimeError(
                f"serial decode position {position} does not match session position {session.token_count}"
            )


def collect_iteration_samples(request_count: int, sampled_output_count: int,
                              sampled_request_indexes: Sequence[int],
                              predicted_tokens: Sequence[int]) -> List[IterationSample]:
    """Validate the compact samples of a native iteration batch."""
    if (sampled_output_count > request_count or sampled_output_count > len(sampled_request_indexes)
            or sampled_output_count > len(predicted_tokens)):
        raise StageRuntimeError(
            f"native iteration returned {sampled_output_count} samples for {request_count} requests"
        )
    seen = [False] * request_count
    samples = []
    for request_index, predicted in list(zip(sampled_request_indexes, predicted_tokens))[:sampled_output_count]:
        if not 0 <= request_index < request_count:
            raise StageRuntimeError(
                f"native iteration sample references request {request_index}, but only "
                f"{request_count} requests were submitted"
            )
        if seen[request_index]:
            raise StageRuntimeError(f"native iteration returned duplicate sample for request {request_index}")
        seen[request_index] = True
        samples.append(IterationSample(request_index, predicted))
    return samples


def _batch_lib(sessions: Sequence[Any]) -> ModuleType:
    for session in sessions:
        if session.backend is not None:
            return session.backend
    return default_backend()


def _store_counts(sessions: Sequence[Any], deltas: Sequence[int]) -> None:
    # The native call already advanced every session: compute all new counts before
    # storing any, so an overflow cannot leave a subset updated.
    updated = [checked_add(session.token_count, delta) for session, delta in zip(sessions, deltas)]
    for session, count in zip(sessions, updated):
        session.token_count = count


def iteration_batch_sampled(requests: Sequence[IterationBatchRequest]) -> IterationBatchOutput:
    """Execute one scheduler iteration for every request as a single native batch.

    Runs one request at a time, by decision, when any request requires it (then a
    failure raises ``PartialBatchExecution``).  Native errors of the batched path are
    raised as-is and leave every ``token_count`` untouched.
    """
    requests = list(requests)
    for index, request in enumerate(requests):
        try:
            IterationBatchPhase(request.phase)
        except ValueError:  # the native batch would ignore it, the serial path fail on it
            raise StageArgumentError(f"iteration batch request {index} has an unknown phase {request.phase!r}") \
                from None
    if any(iteration_request_requires_one_at_a_time(request) for request in requests):
        return _iteration_batch_one_at_a_time(requests)
    return _iteration_batch_native(requests)


def _iteration_batch_native(requests: List[IterationBatchRequest]) -> IterationBatchOutput:
    if not requests:
        return IterationBatchOutput([], [])
    raw_sampling = [sampling_to_bytes(request.sampling) for request in requests]
    inputs = [raw_input(request.input) for request in requests]
    raw_requests = [
        (request.session.native_session, to_tokens(request.token_ids), to_positions(request.positions),
         sampling, desc, payload, bool(request.sample_last))
        for request, sampling, (desc, payload) in zip(requests, raw_sampling, inputs)
    ]
    lib = _batch_lib([request.session for request in requests])
    result = with_output_capacity(
        lambda capacities: lib.iteration_batch_sampled(raw_requests, capacities, len(requests)),
        [0] * len(requests),
    )
    samples = collect_iteration_samples(len(requests), len(result.sampled_request_indexes),
                                        result.sampled_request_indexes, result.predicted_tokens)
    _store_counts([request.session for request in requests], [len(request.token_ids) for request in requests])
    return IterationBatchOutput(_output_frames(result), samples)


def _output_frames(result: Any, packed: bool = False) -> list:
    """A batch's output frames, parsed, or with ``packed`` as ``PackedFrame``s."""
    return [PackedFrame(desc, payload[:size]) if packed else output_frame(desc, payload, size)
            for desc, payload, size in zip(result.out_descs, result.out_payloads, result.out_bytes)]


def _iteration_batch_one_at_a_time(requests: List[IterationBatchRequest]) -> IterationBatchOutput:
    outputs, samples = [], []
    for request_index, request in enumerate(requests):
        try:
            predicted, output = _execute_one_iteration_request(request)
        except Exception as error:  # upstream wraps every failure of the serial path
            raise PartialBatchExecution(request_index, error) from error
        if iteration_request_should_emit_sample(request):
            samples.append(IterationSample(request_index, predicted))
        outputs.append(output)
    return IterationBatchOutput(outputs, samples)


def _execute_one_iteration_request(request: IterationBatchRequest) -> Tuple[int, ActivationFrame]:
    session = request.session
    if IterationBatchPhase(request.phase) is IterationBatchPhase.DECODE:
        validate_serial_decode_request(request)
        return session.decode_step_frame_sampled(request.token_ids[0], request.sampling, request.input, 0)
    if request.sample_last:
        if request.positions:
            return session.prefill_chunk_frame_sampled_with_positions(
                request.token_ids, request.positions, request.sampling, request.input, 0)
        return session.prefill_chunk_frame_sampled(request.token_ids, request.sampling, request.input, 0)
    if request.positions:
        output = session.prefill_chunk_frame_with_positions(request.token_ids, request.positions, request.input, 0)
    else:
        output = session.prefill_chunk_frame(request.token_ids, request.input, 0)
    return -1, output


def decode_step_frame_batch_sampled(requests: Sequence[DecodeFrameBatchRequest], *,
                                    packed: bool = False) -> List[DecodeFrameBatchOutput]:
    """Decode one token for every request as a single native batch (see
    :func:`iteration_batch_sampled` for the one-at-a-time decision).  ``packed``: each
    output frame is left in the runtime's layout, a ``PackedFrame`` (as
    ``StageSession.decode_step_frame_raw`` returns it)."""
    requests = list(requests)
    if any(decode_request_requires_one_at_a_time(request) for request in requests):
        return _decode_batch_one_at_a_time(requests, packed)
    return _decode_batch_native(requests, packed)


def _decode_batch_native(requests: List[DecodeFrameBatchRequest], packed: bool) -> List[DecodeFrameBatchOutput]:
    if not requests:
        return []
    sessions = [request.session.native_session for request in requests]
    token_ids = [to_i32(request.token_id, "token id") for request in requests]
    samplings = [sampling_to_bytes(request.sampling) for request in requests]
    inputs = [raw_input(request.input) for request in requests]
    descs_in = [desc for desc, _ in inputs]
    payloads_in = [payload for _, payload in inputs]
    lib = _batch_lib([request.session for request in requests])
    try:
        result = with_output_capacity(
            lambda capacities: lib.decode_step_frame_batch_sampled(
                sessions, token_ids, samplings, descs_in, payloads_in, capacities, len(requests)),
            [to_capacity(request.output_capacity) for request in requests],
        )
    except StageRuntimeError as error:
        if error.status == Status.BUFFER_TOO_SMALL:
            # Upstream quirk (section 1.5): the native message is always dropped here, so a
            # BUFFER_TOO_SMALL that is not a capacity shortfall reads just "BufferTooSmall".
            raise StageRuntimeError.from_native(error.status, None) from None
        raise
    _store_counts([request.session for request in requests], [1] * len(requests))
    return [DecodeFrameBatchOutput(token, frame)
            for token, frame in zip(result.predicted_tokens, _output_frames(result, packed))]


def _decode_batch_one_at_a_time(requests: List[DecodeFrameBatchRequest], packed: bool) -> List[DecodeFrameBatchOutput]:
    outputs = []
    for request_index, request in enumerate(requests):
        step = request.session.decode_step_frame_raw if packed else request.session.decode_step_frame_sampled
        try:
            predicted, output = step(request.token_id, request.sampling, request.input, request.output_capacity)
        except Exception as error:  # upstream wraps every failure of the serial path
            raise PartialBatchExecution(request_index, error) from error
        outputs.append(DecodeFrameBatchOutput(predicted, output))
    return outputs


__all__ = [
    "IterationBatchPhase", "IterationPhase", "DecodeFrameBatchRequest", "IterationBatchRequest",
    "DecodeFrameBatchOutput", "IterationSample", "IterationBatchOutput", "iteration_batch_sampled",
    "decode_step_frame_batch_sampled", "collect_iteration_samples", "validate_serial_decode_request",
    "frame_has_optional_parts", "exporting_stage_requires_one_request",
    "iteration_request_requires_one_at_a_time", "decode_request_requires_one_at_a_time",
    "iteration_request_should_emit_sample",
]
