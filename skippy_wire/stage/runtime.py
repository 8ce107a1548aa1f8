"""Pythonic stage adapter over ``skippy_wire.stage._backend``: a port of skippy-runtime 0.77.0
frame execution (``activation.rs``; runtime.md section 1).

``_backend`` mirrors the C ABI with no policy; everything the Rust runtime decides lives
here:

* input frames are checked (payload length) before any native call;
* ``BUFFER_TOO_SMALL`` with a larger required size is retried with that capacity
  (callers pass ``output_capacity=0``), including the decode-batch quirk (section 1.5);
* ``token_count`` mirrors native ``n_past`` and moves only after a native OK; batches
  compute every new count first and store them together;
* a batch runs one request at a time, by decision, when any input frame carries optional
  parts or an exporting stage cannot batch exports; a failure there is a
  ``PartialBatchExecution`` (section 1.6);
* native iteration samples are validated (range, duplicates, counts).

Frames, descriptors, sampling and errors live in :mod:`skippy_wire.stage.activation` and are
re-exported here.
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, List, Optional, Sequence, Tuple

from . import _ggml
from .activation import *  # noqa: F401,F403  (re-exported public types)
from .activation import __all__ as _activation_all
from .activation import (
    ACTIVATION_BOUNDARY_DESC_BYTES,
    NATIVE_MTP_MAX_DRAFT_TOKENS,
    U64_MAX,
    ActivationBoundaryDesc,
    ActivationDesc,
    ActivationFrame,
    ActivationFrameError,
    NativeMtpDraft,
    PartialBatchExecution,
    StageArgumentError,
    StageRuntimeError,
    Status,
    sampling_to_bytes,
)

#: Bound on BUFFER_TOO_SMALL retries.  Upstream recurses without a bound (it converges
#: after one retry because native reports the exact size before executing anything).
MAX_BUFFER_RETRIES = 8


def _default_backend() -> ModuleType:
    return _ggml.load_backend()  # compiled extension, checked against this CPU; on first use


def _ensure_ok(status: int, message: Optional[str]) -> None:
    """Upstream ``ensure_ok``: any non-OK status becomes a ``StageRuntimeError``."""
    if status != Status.OK:
        raise StageRuntimeError.from_native(status, message)


def _checked_add(count: int, delta: int) -> int:
    updated = count + delta
    if updated > U64_MAX:
        raise StageRuntimeError("session token count overflow")
    return updated


def _raw_input(frame: Optional[ActivationFrame]) -> Tuple[Optional[bytes], Optional[bytes]]:
    """Upstream ``raw_input_frame``: ``(desc bytes, payload)`` or ``(None, None)``."""
    if frame is None:
        return None, None
    frame.validate_payload_len()
    return frame.desc.to_bytes(), bytes(frame.payload)


def _output_frame(desc: bytes, payload: bytes, out_bytes: int) -> ActivationFrame:
    return ActivationFrame(ActivationDesc.from_bytes(desc), bytes(payload[:out_bytes]))


_I32_MIN, _I32_MAX = -(2**31), 2**31 - 1


def _i32(value: Any, what: str) -> int:
    number = int(value)
    if not _I32_MIN <= number <= _I32_MAX:
        raise StageArgumentError(f"{what} {number} does not fit in i32")
    return number


def _count(value: Any, what: str) -> int:
    number = int(value)
    if not 0 <= number <= U64_MAX:
        raise StageArgumentError(f"{what} {number} is not a valid unsigned count")
    return number


def _tokens(token_ids: Sequence[int]) -> List[int]:
    return [_i32(token, "token id") for token in token_ids]


def _positions(positions: Optional[Sequence[int]]) -> Optional[List[int]]:
    return [_i32(p, "position") for p in positions] if positions is not None and len(positions) else None


# --- model ------------------------------------------------------------------------------------


class StageModel:
    """One stage of a model: the layer range ``[layer_start, layer_end)`` of a GGUF file.

    Open with :meth:`open`; direct construction is refused.
    """

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise TypeError("StageModel cannot be constructed directly; use StageModel.open()")

    @classmethod
    def open(
        cls,
        path: "str | os.PathLike[str]",
        layer_start: int,
        layer_end: Optional[int],
        *,
        stage_index: int = 0,
        ctx_size: int = 512,
        lane_count: int = 1,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        backend: Optional[ModuleType] = None,
    ) -> "StageModel":
        """Load ``[layer_start, layer_end)`` (``layer_end=None`` means through the last layer).

        ``ctx_size`` is the per-lane token capacity, ``lane_count`` the number of sessions
        the model can host at once, ``n_threads=None`` lets the backend choose.
        ``backend`` substitutes the native module (tests).  Raises ``StageRuntimeError``
        (``.status`` INVALID_ARGUMENT / IO_ERROR / MODEL_ERROR from native).
        """
        if layer_end is not None and layer_start >= layer_end:
            raise StageRuntimeError("layer_start must be less than layer_end")
        if layer_start < 0:
            raise StageRuntimeError("layer_start must not be negative")
        if n_threads is not None and n_threads <= 0:
            raise StageRuntimeError("n_threads must be greater than zero when provided")
        if n_batch <= 0:
            raise StageRuntimeError("n_batch must be greater than zero when provided")
        lib = backend or _default_backend()
        try:
            native = lib.Model(
                os.fspath(path),
                stage_index=stage_index,
                layer_start=layer_start,
                layer_end=-1 if layer_end is None else layer_end,
                ctx_size=ctx_size,
                lane_count=lane_count,
                n_threads=n_threads or 0,
                n_batch=n_batch,
            )
        except lib.NativeError as exc:
            raise StageRuntimeError.from_native(exc.status, exc.message) from exc
        model = object.__new__(cls)
        model._lib = lib
        model._native = native
        model.path = os.fspath(path)
        return model

    def _model(self) -> Any:
        if self._native is None:
            raise StageRuntimeError("stage model is closed")
        return self._native

    n_embd = property(lambda self: self._model().n_embd)
    n_layer = property(lambda self: self._model().n_layer)
    n_vocab = property(lambda self: self._model().n_vocab)
    n_ctx = property(lambda self: self._model().n_ctx)
    architecture = property(lambda self: self._model().architecture)
    layer_start = property(lambda self: self._model().layer_start)
    layer_end = property(lambda self: self._model().layer_end)
    stage_index = property(lambda self: self._model().stage_index)
    batched_activation_exports = property(lambda self: bool(self._model().batched_activation_exports))

    @property
    def is_source(self) -> bool:
        """Owns the token embeddings (``layer_start == 0``)."""
        return self.layer_start == 0

    @property
    def is_terminal(self) -> bool:
        """Owns the output head (``layer_end == n_layer``); terminal stages sample."""
        return self.layer_end == self.n_layer

    def create_session(self) -> "StageSession":
        """Claim a lane; ``RUNTIME_ERROR`` when all ``lane_count`` lanes are in use."""
        model = self._model()
        try:
            raw = model.create_session()
        except self._lib.NativeError as exc:
            raise StageRuntimeError.from_native(exc.status, exc.message) from exc
        return StageSession._from_native(
            raw, self._lib, terminal_stage=self.is_terminal,
            batched_activation_exports=self.batched_activation_exports, model=self,
        )

    def input_activation_boundary(self) -> Optional[ActivationBoundaryDesc]:
        """The activation this stage consumes (``None`` for the source stage)."""
        return self._boundary(self._model().input_activation_boundary())

    def output_activation_boundary(self) -> Optional[ActivationBoundaryDesc]:
        """The activation this stage exports (``None`` for the terminal stage)."""
        return self._boundary(self._model().output_activation_boundary())

    @staticmethod
    def _boundary(raw: Optional[bytes]) -> Optional[ActivationBoundaryDesc]:
        if raw is None:
            return None
        if len(raw) != ACTIVATION_BOUNDARY_DESC_BYTES:
            raise StageRuntimeError(f"native boundary descriptor has {len(raw)} bytes")
        return ActivationBoundaryDesc.from_bytes(raw)

    def close(self) -> None:
        """Free the native model (sessions keep it alive until they are closed too)."""
        native, self._native = self._native, None
        close = getattr(native, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "StageModel":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        if self._native is None:
            return "<StageModel closed>"
        return f"<StageModel {self.path!r} layers {self.layer_start}..{self.layer_end} of {self.n_layer}>"


# --- session ----------------------------------------------------------------------------------


class StageSession:
    """One sequence executing on a stage.

    Fields as upstream: ``token_count`` (mirror of native ``n_past``), ``terminal_stage``
    and ``batched_activation_exports``.  Obtain from :meth:`StageModel.create_session`.
    Not thread-safe: serialise calls per session.
    """

    __slots__ = ("_raw", "_lib", "_model", "token_count", "terminal_stage", "batched_activation_exports")

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise TypeError("StageSession cannot be constructed directly; use StageModel.create_session()")

    @classmethod
    def _from_native(
        cls,
        raw: Any,
        lib: Optional[ModuleType],
        *,
        token_count: int = 0,
        terminal_stage: bool,
        batched_activation_exports: bool,
        model: Optional[StageModel] = None,
    ) -> "StageSession":
        session = object.__new__(cls)
        session._raw = raw
        session._lib = lib
        session._model = model
        session.token_count = token_count
        session.terminal_stage = terminal_stage
        session.batched_activation_exports = batched_activation_exports
        return session

    # -- helpers

    def _native(self) -> Any:
        if self._raw is None:
            raise StageRuntimeError("stage session is closed")
        return self._raw

    def _advance(self, delta: int) -> None:
        self.token_count = _checked_add(self.token_count, delta)

    def _run_with_retry(self, call: Any, output_capacity: int) -> tuple:
        """Call ``call(capacity)`` and retry while native asks for a larger buffer.

        Native reports ``out_bytes`` before executing anything, so a retry is safe.  A
        BUFFER_TOO_SMALL whose required size is not larger is a hard error.
        """
        capacity = _count(output_capacity, "output capacity")
        for _ in range(MAX_BUFFER_RETRIES + 1):
            result = call(capacity)
            status, message, out_bytes = result[0], result[1], result[4]
            if status == Status.BUFFER_TOO_SMALL and out_bytes > capacity:
                capacity = out_bytes
                continue
            _ensure_ok(status, message)
            return result
        raise StageRuntimeError(f"native kept reporting a larger output buffer after {MAX_BUFFER_RETRIES} retries")

    @property
    def model(self) -> Optional[StageModel]:
        return self._model

    def native_position(self) -> int:
        """Native ``n_past`` (negative means the session has no valid position)."""
        position = self._native().position
        if position < 0:
            raise StageRuntimeError("no valid native position")
        return position

    # -- prefill

    def _prefill(self, token_ids, positions, sampling, sample, input, output_capacity):
        desc, payload = _raw_input(input)
        raw_sampling = sampling_to_bytes(sampling) if sample else None
        tokens, pos = _tokens(token_ids), _positions(positions)
        native = self._native()
        result = self._run_with_retry(
            lambda capacity: native.prefill_chunk_frame(
                tokens, positions=pos, sampling=raw_sampling, sample=sample,
                input_desc=desc, input_payload=payload, capacity=capacity,
            ),
            output_capacity,
        )
        _, _, out_desc, out_payload, out_bytes, predicted = result
        self._advance(len(tokens))
        return predicted, _output_frame(out_desc, out_payload, out_bytes)

    def prefill_chunk_frame(self, token_ids: Sequence[int], input: Optional[ActivationFrame] = None,
                            output_capacity: int = 0) -> ActivationFrame:
        """Run a prefill chunk without sampling; returns the output frame."""
        return self._prefill(token_ids, None, None, False, input, output_capacity)[1]

    def prefill_chunk_frame_with_positions(self, token_ids: Sequence[int], positions: Sequence[int],
                                           input: Optional[ActivationFrame] = None,
                                           output_capacity: int = 0) -> ActivationFrame:
        """As :meth:`prefill_chunk_frame` with explicit positions (empty = contiguous)."""
        return self._prefill(token_ids, positions, None, False, input, output_capacity)[1]

    def prefill_chunk_frame_sampled(self, token_ids: Sequence[int], sampling: Any = None,
                                    input: Optional[ActivationFrame] = None,
                                    output_capacity: int = 0) -> Tuple[int, ActivationFrame]:
        """Prefill and sample the last row (terminal); ``(-1, frame)`` on other stages."""
        return self._prefill(token_ids, None, sampling, True, input, output_capacity)

    def prefill_chunk_frame_sampled_with_positions(self, token_ids: Sequence[int], positions: Sequence[int],
                                                   sampling: Any = None, input: Optional[ActivationFrame] = None,
                                                   output_capacity: int = 0) -> Tuple[int, ActivationFrame]:
        return self._prefill(token_ids, positions, sampling, True, input, output_capacity)

    # -- decode

    def decode_step_frame(self, token_id: int, input: Optional[ActivationFrame] = None,
                          output_capacity: int = 0) -> Tuple[int, ActivationFrame]:
        """One decode step with greedy sampling (``sampling=None``)."""
        return self.decode_step_frame_sampled(token_id, None, input, output_capacity)

    def decode_step_frame_sampled(self, token_id: int, sampling: Any = None,
                                  input: Optional[ActivationFrame] = None,
                                  output_capacity: int = 0) -> Tuple[int, ActivationFrame]:
        """One decode step; returns ``(predicted token or -1, output frame)``; +1 token."""
        desc, payload = _raw_input(input)
        raw_sampling = sampling_to_bytes(sampling)
        native = self._native()
        token = _i32(token_id, "token id")
        result = self._run_with_retry(
            lambda capacity: native.decode_step_frame_sampled(
                token, sampling=raw_sampling, input_desc=desc, input_payload=payload, capacity=capacity,
            ),
            output_capacity,
        )
        _, _, out_desc, out_payload, out_bytes, predicted = result
        self._advance(1)
        return predicted, _output_frame(out_desc, out_payload, out_bytes)

    # -- verify

    def verify_tokens_frame(self, token_ids: Sequence[int], input: Optional[ActivationFrame] = None,
                            output_capacity: int = 0) -> Tuple[List[int], Optional[NativeMtpDraft], ActivationFrame]:
        return self.verify_tokens_frame_sampled(token_ids, None, input, output_capacity, 0)

    def verify_tokens_frame_sampled(self, token_ids: Sequence[int], sampling: Any = None,
                                    input: Optional[ActivationFrame] = None, output_capacity: int = 0,
                                    max_draft_tokens: int = 0) -> Tuple[List[int], Optional[NativeMtpDraft], ActivationFrame]:
        """Verify a speculative window in one forward; predicted token per row (terminal).

        Afterwards retire the checkpoint on full acceptance
        (:meth:`retire_verify_checkpoint`) or :meth:`trim_session` after a rejection.
        """
        if len(token_ids) == 0:
            raise StageRuntimeError("verify_tokens_frame requires at least one token")
        predicted, draft, desc, payload = self._verify(token_ids, sampling, input, output_capacity, max_draft_tokens)
        return predicted, draft, ActivationFrame(desc, payload)

    def verify_tokens_sampled_mtp(self, token_ids: Sequence[int], sampling: Any = None,
                                  max_draft_tokens: int = 0) -> Tuple[List[int], Optional[NativeMtpDraft]]:
        """Verify without frames; empty tokens return ``([], None)`` without a native call."""
        if len(token_ids) == 0:
            return [], None
        predicted, draft, _, _ = self._verify(token_ids, sampling, None, 0, max_draft_tokens)
        return predicted, draft

    def verify_tokens_sampled(self, token_ids: Sequence[int], sampling: Any = None) -> List[int]:
        if len(token_ids) == 0:
            return []
        return self._verify(token_ids, sampling, None, 0, 0)[0]

    def _verify(self, token_ids, sampling, input, output_capacity, max_draft_tokens):
        desc, payload = _raw_input(input)
        raw_sampling = sampling_to_bytes(sampling)
        tokens = _tokens(token_ids)
        max_draft = min(_count(max_draft_tokens, "max draft tokens"), NATIVE_MTP_MAX_DRAFT_TOKENS)
        native = self._native()
        result = self._run_with_retry(
            lambda capacity: native.verify_tokens_frame_sampled(
                tokens, sampling=raw_sampling, input_desc=desc, input_payload=payload,
                capacity=capacity, token_capacity=len(tokens), max_draft=max_draft,
            ),
            output_capacity,
        )
        _, _, out_desc, out_payload, out_bytes, predicted, draft = result
        self._advance(len(tokens))
        return (
            list(predicted)[: len(tokens)],
            NativeMtpDraft.from_bytes(draft),
            ActivationDesc.from_bytes(out_desc),
            bytes(out_payload[:out_bytes]),
        )

    # -- non-advancing operations

    def copy_output_activation_frame(self, token_count: int, output_capacity: int = 0) -> ActivationFrame:
        """Re-read the last ``token_count`` output rows; the session does not move."""
        if token_count == 0:
            raise StageRuntimeError("copy_output_activation_frame requires at least one token")
        token_count = _count(token_count, "token count")
        native = self._native()
        result = self._run_with_retry(
            lambda capacity: native.copy_output_activation_frame(token_count, capacity=capacity),
            output_capacity,
        )
        _, _, out_desc, out_payload, out_bytes = result
        return _output_frame(out_desc, out_payload, out_bytes)

    def sample_current(self, sampling: Any = None) -> int:
        """Sample the current logits again (terminal stages); the session does not move."""
        raw_sampling = sampling_to_bytes(sampling)
        status, message, token = self._native().sample_current(sampling=raw_sampling)
        _ensure_ok(status, message)
        return token

    def trim_session(self, token_count: int) -> None:
        """Truncate to ``token_count`` tokens (must not exceed the current count)."""
        token_count = _count(token_count, "token count")
        status, message = self._native().trim(token_count)
        _ensure_ok(status, message)
        self.token_count = token_count

    trim = trim_session

    def retire_verify_checkpoint(self, token_start: int, token_count: int) -> None:
        """Drop the checkpoint of a fully accepted verify window ``[start, start+count)``."""
        status, message = self._native().retire_verify_checkpoint(
            _count(token_start, "token start"), _count(token_count, "token count"))
        _ensure_ok(status, message)

    def reset(self) -> None:
        status, message = self._native().reset()
        _ensure_ok(status, message)
        self.token_count = 0

    def close(self) -> None:
        """Release the native session (and its lane)."""
        raw, self._raw = self._raw, None
        close = getattr(raw, "close", None)
        if close is not None:
            close()

    def __enter__(self) -> "StageSession":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return (f"<StageSession token_count={self.token_count} terminal_stage={self.terminal_stage} "
                f"batched_activation_exports={self.batched_activation_exports}>")


# --- batches (runtime.md section 1.6) ------------------------------------------------------


class IterationBatchPhase(enum.Enum):
    """What a scheduler iteration request is; a 1-token prefill tail is still PREFILL."""

    PREFILL = "prefill"
    DECODE = "decode"
    Prefill = "prefill"  # alias: the Rust variant names
    Decode = "decode"


IterationPhase = IterationBatchPhase


@dataclass
class DecodeFrameBatchRequest:
    session: StageSession
    token_id: int
    sampling: Any = None
    input: Optional[ActivationFrame] = None


@dataclass
class IterationBatchRequest:
    session: StageSession
    token_ids: Sequence[int]
    positions: Sequence[int] = ()
    sampling: Any = None
    input: Optional[ActivationFrame] = None
    sample_last: bool = False
    phase: IterationBatchPhase = IterationBatchPhase.PREFILL


@dataclass(frozen=True)
class DecodeFrameBatchOutput:
    predicted_token: int
    output: ActivationFrame


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


def exporting_stage_requires_one_request(session: StageSession) -> bool:
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


def _batch_lib(sessions: Sequence[StageSession]) -> ModuleType:
    for session in sessions:
        if session._lib is not None:
            return session._lib
    return _default_backend()


def _store_counts(sessions: Sequence[StageSession], deltas: Sequence[int]) -> None:
    # The native call already advanced every session: compute all new counts before
    # storing any, so an overflow cannot leave a subset updated.
    updated = [_checked_add(session.token_count, delta) for session, delta in zip(sessions, deltas)]
    for session, count in zip(sessions, updated):
        session.token_count = count


def iteration_batch_sampled(requests: Sequence[IterationBatchRequest]) -> IterationBatchOutput:
    """Execute one scheduler iteration for every request as a single native batch.

    Runs one request at a time, by decision, when any request requires it (then a
    failure raises ``PartialBatchExecution``).  Native errors of the batched path are
    raised as-is and leave every ``token_count`` untouched.
    """
    requests = list(requests)
    if any(iteration_request_requires_one_at_a_time(request) for request in requests):
        return _iteration_batch_one_at_a_time(requests)
    return _iteration_batch_native(requests, [0] * len(requests))


def _iteration_batch_native(requests: List[IterationBatchRequest], capacities: List[int]) -> IterationBatchOutput:
    if not requests:
        return IterationBatchOutput([], [])
    raw_sampling = [sampling_to_bytes(request.sampling) for request in requests]
    inputs = [_raw_input(request.input) for request in requests]
    raw_requests = [
        (request.session._raw, _tokens(request.token_ids), _positions(request.positions),
         sampling, desc, payload, bool(request.sample_last))
        for request, sampling, (desc, payload) in zip(requests, raw_sampling, inputs)
    ]
    lib = _batch_lib([request.session for request in requests])
    for _ in range(MAX_BUFFER_RETRIES + 1):
        status, message, descs, payloads, out_bytes, indexes, predicted = lib.iteration_batch_sampled(
            raw_requests, list(capacities), len(requests)
        )
        if status == Status.BUFFER_TOO_SMALL and any(
            required > capacity for required, capacity in zip(out_bytes, capacities)
        ):
            capacities = list(out_bytes)
            continue
        break
    else:
        raise StageRuntimeError(f"native kept reporting larger output buffers after {MAX_BUFFER_RETRIES} retries")
    _ensure_ok(status, message)
    samples = collect_iteration_samples(len(requests), len(indexes), indexes, predicted)
    _store_counts([request.session for request in requests], [len(request.token_ids) for request in requests])
    outputs = [_output_frame(desc, payload, size) for desc, payload, size in zip(descs, payloads, out_bytes)]
    return IterationBatchOutput(outputs, samples)


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


def decode_step_frame_batch_sampled(requests: Sequence[DecodeFrameBatchRequest]) -> List[DecodeFrameBatchOutput]:
    """Decode one token for every request as a single native batch (see
    :func:`iteration_batch_sampled` for the one-at-a-time decision)."""
    requests = list(requests)
    if any(decode_request_requires_one_at_a_time(request) for request in requests):
        return _decode_batch_one_at_a_time(requests)
    return _decode_batch_native(requests, [0] * len(requests))


def _decode_batch_native(requests: List[DecodeFrameBatchRequest], capacities: List[int]) -> List[DecodeFrameBatchOutput]:
    if not requests:
        return []
    sessions = [request.session._raw for request in requests]
    token_ids = [_i32(request.token_id, "token id") for request in requests]
    samplings = [sampling_to_bytes(request.sampling) for request in requests]
    inputs = [_raw_input(request.input) for request in requests]
    descs_in = [desc for desc, _ in inputs]
    payloads_in = [payload for _, payload in inputs]
    lib = _batch_lib([request.session for request in requests])
    for _ in range(MAX_BUFFER_RETRIES + 1):
        status, message, descs, payloads, out_bytes, predicted = lib.decode_step_frame_batch_sampled(
            sessions, token_ids, samplings, descs_in, payloads_in, list(capacities), len(requests)
        )
        if status == Status.BUFFER_TOO_SMALL:
            # Upstream quirk (section 1.5): the native message is always dropped here, so a
            # BUFFER_TOO_SMALL that is not a capacity shortfall reads just "BufferTooSmall".
            message = None
            if any(required > capacity for required, capacity in zip(out_bytes, capacities)):
                capacities = list(out_bytes)
                continue
        break
    else:
        raise StageRuntimeError(f"native kept reporting larger output buffers after {MAX_BUFFER_RETRIES} retries")
    _ensure_ok(status, message)
    _store_counts([request.session for request in requests], [1] * len(requests))
    return [
        DecodeFrameBatchOutput(token, _output_frame(desc, payload, size))
        for desc, payload, size, token in zip(descs, payloads, out_bytes, predicted)
    ]


def _decode_batch_one_at_a_time(requests: List[DecodeFrameBatchRequest]) -> List[DecodeFrameBatchOutput]:
    outputs = []
    for request_index, request in enumerate(requests):
        try:
            predicted, output = request.session.decode_step_frame_sampled(
                request.token_id, request.sampling, request.input, 0)
        except Exception as error:  # upstream wraps every failure of the serial path
            raise PartialBatchExecution(request_index, error) from error
        outputs.append(DecodeFrameBatchOutput(predicted, output))
    return outputs


__all__ = [
    *_activation_all,
    "MAX_BUFFER_RETRIES", "StageModel", "StageSession", "IterationBatchPhase", "IterationPhase",
    "DecodeFrameBatchRequest", "IterationBatchRequest", "DecodeFrameBatchOutput", "IterationSample",
    "IterationBatchOutput", "iteration_batch_sampled", "decode_step_frame_batch_sampled",
    "collect_iteration_samples", "validate_serial_decode_request", "frame_has_optional_parts",
    "exporting_stage_requires_one_request", "iteration_request_requires_one_at_a_time",
    "decode_request_requires_one_at_a_time", "iteration_request_should_emit_sample",
]

# Upstream spells these as associated functions of StageSession.
StageSession.iteration_batch_sampled = staticmethod(iteration_batch_sampled)  # type: ignore[attr-defined]
StageSession.decode_step_frame_batch_sampled = staticmethod(decode_step_frame_batch_sampled)  # type: ignore[attr-defined]
