"""Pythonic stage adapter over ``skippy_wire.stage._backend``: a port of skippy-runtime 0.77.0
frame execution (``activation.rs``; runtime.md section 1).

``_backend`` mirrors the C ABI with no policy; everything the Rust runtime decides lives
here:

* input frames are checked (payload length) before any native call;
* ``BUFFER_TOO_SMALL`` with a larger required size is retried with that capacity
  (callers pass ``output_capacity=0``), including the decode-batch quirk (section 1.5);
* ``token_count`` mirrors native ``n_past`` and moves only after a native OK; batches
  compute every new count first and store them together;
* batches (section 1.6) are :mod:`skippy_wire.stage.batch`.

Frames and descriptors (:mod:`~skippy_wire.stage.activation`), the sampling struct
(:mod:`~skippy_wire.stage.sampling`), the wire conversions (:mod:`~skippy_wire.stage.bridge`),
batch execution (:mod:`~skippy_wire.stage.batch`) and the errors are re-exported here; how
the backend is called (argument conversion, the BUFFER_TOO_SMALL retry) is
:mod:`~skippy_wire.stage.native`.
"""

from __future__ import annotations

import os
from types import ModuleType
from typing import Any, List, Optional, Tuple

from ..errors import StageRuntimeError as StageRuntimeError  # re-exported, named so for type checkers
from ..wire.forwarding import DEFAULT_CTX_SIZE
from ..wire.messages import TokenIds
from .activation import *  # noqa: F401,F403  (re-exported public types)
from .activation import __all__ as _activation_all
from .activation import (
    ACTIVATION_BOUNDARY_DESC_BYTES,
    NATIVE_MTP_MAX_DRAFT_TOKENS,
    ActivationBoundaryDesc,
    ActivationFrame,
    NativeMtpDraft,
    PackedFrame,
    mtp_draft_from_bytes,
)
from .models import refuse_special_file
from .bridge import *  # noqa: F401,F403  (re-exported wire conversions)
from .bridge import __all__ as _bridge_all
from .batch import *  # noqa: F401,F403  (re-exported batch execution)
from .batch import __all__ as _batch_all
from .batch import decode_step_frame_batch_sampled, iteration_batch_sampled
from .native import (
    MAX_BUFFER_RETRIES,
    checked_add,
    default_backend,
    output_frame,
    raw_input,
    to_capacity,
    to_count,
    to_i32,
    to_positions,
    to_tokens,
    with_output_capacity,
)
from .sampling import *  # noqa: F401,F403  (re-exported sampling config)
from .sampling import __all__ as _sampling_all
from .sampling import sampling_to_bytes


#: The most sessions one StageModel hosts (``lane_count``), as the backend checks it.
MAX_LANES = 1024


# --- model ------------------------------------------------------------------------------------


class _NativeHandle:
    """A Python owner of one native object: a context manager whose exit calls ``close()``."""

    __slots__ = ()

    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def _close_native(native: Any) -> None:
    close = getattr(native, "close", None)
    if close is not None:
        close()


class StageModel(_NativeHandle):
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
        ctx_size: int = DEFAULT_CTX_SIZE,
        lane_count: int = 1,
        n_threads: Optional[int] = None,
        n_batch: int = 512,
        backend: Optional[ModuleType] = None,
    ) -> "StageModel":
        """Load ``[layer_start, layer_end)`` (``layer_end=None`` means through the last layer).

        ``ctx_size`` is the per-lane token capacity, ``lane_count`` the number of sessions
        the model can host at once, ``n_threads=None`` lets the backend choose.
        ``backend`` substitutes the native module (tests).  An option that is not an i32
        integer is a ``StageArgumentError``.  Raises ``StageRuntimeError``
        (``.status`` INVALID_ARGUMENT / IO_ERROR / MODEL_ERROR from native).
        """
        stage_index, layer_start = to_i32(stage_index, "stage_index"), to_i32(layer_start, "layer_start")
        ctx_size, lane_count = to_i32(ctx_size, "ctx_size"), to_i32(lane_count, "lane_count")
        n_batch = to_i32(n_batch, "n_batch")
        layer_end = None if layer_end is None else to_i32(layer_end, "layer_end")
        n_threads = None if n_threads is None else to_i32(n_threads, "n_threads")
        if layer_end is not None and layer_start >= layer_end:
            raise StageRuntimeError("layer_start must be less than layer_end")
        if layer_start < 0:
            raise StageRuntimeError("layer_start must not be negative")
        if n_batch <= 0:  # upstream's RuntimeConfig::validate order: the range, n_batch, n_threads
            raise StageRuntimeError("n_batch must be greater than zero when provided")
        if n_threads is not None and n_threads <= 0:
            raise StageRuntimeError("n_threads must be greater than zero when provided")
        refuse_special_file(path)  # before native opens it (a FIFO's open would wait for a writer)
        lib = backend or default_backend()
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
        model = object.__new__(cls)
        model._lib = lib
        model._native = native
        model.path = os.fsdecode(path)
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
        raw = self._model().create_session()
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
        _close_native(native)

    def __repr__(self) -> str:
        if self._native is None:
            return "<StageModel closed>"
        return f"<StageModel {self.path!r} layers {self.layer_start}..{self.layer_end} of {self.n_layer}>"


# --- session ----------------------------------------------------------------------------------


class StageSession(_NativeHandle):
    """One sequence executing on a stage.

    Fields as upstream: ``token_count`` (mirror of native ``n_past``), ``terminal_stage``
    and ``batched_activation_exports``.  Obtain from :meth:`StageModel.create_session`.
    Not shared between threads: a call overlapping another thread's call on this session
    raises StageRuntimeError (docs/runtime.md, "Threads").
    """

    __slots__ = ("_raw", "_lib", "_model", "token_count", "terminal_stage", "batched_activation_exports")

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        raise TypeError("StageSession cannot be constructed directly; use StageModel.create_session()")

    @classmethod
    def _from_native(cls, raw: Any, lib: Optional[ModuleType], *, token_count: int = 0, terminal_stage: bool,
                     batched_activation_exports: bool, model: Optional[StageModel] = None) -> "StageSession":
        session = object.__new__(cls)
        session._raw, session._lib, session._model = raw, lib, model
        session.token_count, session.terminal_stage = token_count, terminal_stage
        session.batched_activation_exports = batched_activation_exports
        return session

    # -- helpers

    def _native(self) -> Any:
        if self._raw is None:
            raise StageRuntimeError("stage session is closed")
        return self._raw

    def _advance(self, delta: int) -> None:
        self.token_count = checked_add(self.token_count, delta)

    def _with_capacity(self, call: Any, output_capacity: int) -> Any:
        """``call(capacity)`` with the BUFFER_TOO_SMALL retry (``native.with_output_capacity``)."""
        return with_output_capacity(call, to_capacity(output_capacity))

    @property
    def native_session(self) -> Any:
        """The backend's session handle (``None`` once closed)."""
        return self._raw

    @property
    def backend(self) -> Optional[ModuleType]:
        """The backend module this session runs on."""
        return self._lib

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
        desc, payload = raw_input(input)
        raw_sampling = sampling_to_bytes(sampling) if sample else None
        tokens, pos = to_tokens(token_ids), to_positions(positions)
        native = self._native()
        result = self._with_capacity(
            lambda capacity: native.prefill_chunk_frame(
                tokens, positions=pos, sampling=raw_sampling, sample=sample,
                input_desc=desc, input_payload=payload, capacity=capacity,
            ),
            output_capacity,
        )
        self._advance(len(tokens))
        return result.predicted_token, output_frame(result.out_desc, result.out_payload, result.out_bytes)

    def prefill_chunk_frame(self, token_ids: TokenIds, input: Optional[ActivationFrame] = None,
                            output_capacity: int = 0) -> ActivationFrame:
        """Run a prefill chunk without sampling; returns the output frame."""
        return self._prefill(token_ids, None, None, False, input, output_capacity)[1]

    def prefill_chunk_frame_with_positions(self, token_ids: TokenIds, positions: TokenIds,
                                           input: Optional[ActivationFrame] = None,
                                           output_capacity: int = 0) -> ActivationFrame:
        """As :meth:`prefill_chunk_frame` with explicit positions (empty = contiguous)."""
        return self._prefill(token_ids, positions, None, False, input, output_capacity)[1]

    def prefill_chunk_frame_sampled(self, token_ids: TokenIds, sampling: Any = None,
                                    input: Optional[ActivationFrame] = None,
                                    output_capacity: int = 0) -> Tuple[int, ActivationFrame]:
        """Prefill and sample the last row (terminal); ``(-1, frame)`` on other stages."""
        return self._prefill(token_ids, None, sampling, True, input, output_capacity)

    def prefill_chunk_frame_sampled_with_positions(self, token_ids: TokenIds, positions: TokenIds,
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
        predicted, (desc, payload) = self.decode_step_frame_raw(token_id, sampling, input, output_capacity)
        return predicted, output_frame(desc, payload, len(payload))

    def decode_step_frame_raw(self, token_id: int, sampling: Any = None,
                              input: Optional[ActivationFrame] = None,
                              output_capacity: int = 0) -> Tuple[int, PackedFrame]:
        """:meth:`decode_step_frame_sampled` with the output frame left in the runtime's C
        layout (upstream ``decode_step_frame_raw``): its descriptor is not parsed, which
        costs a decode step tens of microseconds, for a caller that does not read it (a
        terminal stage's output frame is empty)."""
        desc, payload = raw_input(input)
        raw_sampling = sampling_to_bytes(sampling)
        native = self._native()
        token = to_i32(token_id, "token id")
        result = self._with_capacity(
            lambda capacity: native.decode_step_frame_sampled(
                token, sampling=raw_sampling, input_desc=desc, input_payload=payload, capacity=capacity,
            ),
            output_capacity,
        )
        self._advance(1)
        return result.predicted_token, PackedFrame(result.out_desc, result.out_payload)

    # -- verify

    def verify_tokens_frame(self, token_ids: TokenIds, input: Optional[ActivationFrame] = None,
                            output_capacity: int = 0) -> Tuple[List[int], Optional[NativeMtpDraft], ActivationFrame]:
        return self.verify_tokens_frame_sampled(token_ids, None, input, output_capacity, 0)

    def verify_tokens_frame_sampled(self, token_ids: TokenIds, sampling: Any = None,
                                    input: Optional[ActivationFrame] = None, output_capacity: int = 0,
                                    max_draft_tokens: int = 0) -> Tuple[List[int], Optional[NativeMtpDraft], ActivationFrame]:
        """Verify a speculative window in one forward; predicted token per row (terminal).

        Afterwards retire the checkpoint on full acceptance
        (:meth:`retire_verify_checkpoint`) or :meth:`trim_session` after a rejection.
        """
        if len(token_ids) == 0:
            raise StageRuntimeError("verify_tokens_frame requires at least one token")
        return self._verify(token_ids, sampling, input, output_capacity, max_draft_tokens)

    def verify_tokens_sampled_mtp(self, token_ids: TokenIds, sampling: Any = None,
                                  max_draft_tokens: int = 0) -> Tuple[List[int], Optional[NativeMtpDraft]]:
        """Verify without frames; empty tokens return ``([], None)`` without a native call."""
        if len(token_ids) == 0:
            return [], None
        predicted, draft, _ = self._verify(token_ids, sampling, None, 0, max_draft_tokens)
        return predicted, draft

    def verify_tokens_sampled(self, token_ids: TokenIds, sampling: Any = None) -> List[int]:
        if len(token_ids) == 0:
            return []
        return self._verify(token_ids, sampling, None, 0, 0)[0]

    def _verify(self, token_ids, sampling, input, output_capacity, max_draft_tokens):
        desc, payload = raw_input(input)
        raw_sampling = sampling_to_bytes(sampling)
        tokens = to_tokens(token_ids)
        max_draft = min(to_count(max_draft_tokens, "max draft tokens"), NATIVE_MTP_MAX_DRAFT_TOKENS)
        native = self._native()
        result = self._with_capacity(
            lambda capacity: native.verify_tokens_frame_sampled(
                tokens, sampling=raw_sampling, input_desc=desc, input_payload=payload,
                capacity=capacity, token_capacity=len(tokens), max_draft=max_draft,
            ),
            output_capacity,
        )
        self._advance(len(tokens))
        return (
            list(result.predicted_tokens)[: len(tokens)],
            mtp_draft_from_bytes(result.mtp_draft),
            output_frame(result.out_desc, result.out_payload, result.out_bytes),
        )

    # -- non-advancing operations

    def copy_output_activation_frame(self, token_count: int, output_capacity: int = 0) -> ActivationFrame:
        """Re-read the last ``token_count`` output rows; the session does not move."""
        if token_count == 0:
            raise StageRuntimeError("copy_output_activation_frame requires at least one token")
        token_count = to_count(token_count, "token count")
        native = self._native()
        result = self._with_capacity(
            lambda capacity: native.copy_output_activation_frame(token_count, capacity=capacity),
            output_capacity,
        )
        return output_frame(result.out_desc, result.out_payload, result.out_bytes)

    def sample_current(self, sampling: Any = None) -> int:
        """Sample the current logits again (terminal stages); the session does not move."""
        raw_sampling = sampling_to_bytes(sampling)
        return self._native().sample_current(sampling=raw_sampling)

    def trim_session(self, token_count: int) -> None:
        """Truncate to ``token_count`` tokens (must not exceed the current count)."""
        token_count = to_count(token_count, "token count")
        self._native().trim(token_count)
        self.token_count = token_count

    trim = trim_session

    def retire_verify_checkpoint(self, token_start: int, token_count: int) -> None:
        """Drop the checkpoint of a fully accepted verify window ``[start, start+count)``."""
        self._native().retire_verify_checkpoint(to_count(token_start, "token start"),
                                                to_count(token_count, "token count"))

    def reset(self) -> None:
        self._native().reset()
        self.token_count = 0

    def close(self) -> None:
        """Release the native session (and its lane; during another thread's call on it, once
        that call returns)."""
        raw, self._raw = self._raw, None
        _close_native(raw)

    def __repr__(self) -> str:
        return (f"<StageSession token_count={self.token_count} terminal_stage={self.terminal_stage} "
                f"batched_activation_exports={self.batched_activation_exports}>")


__all__ = [
    *_activation_all, *_sampling_all, *_bridge_all, *_batch_all, "MAX_BUFFER_RETRIES", "MAX_LANES", "StageModel",
    "StageSession",
]

# Upstream spells these as associated functions of StageSession.
StageSession.iteration_batch_sampled = staticmethod(iteration_batch_sampled)  # type: ignore[attr-defined]
StageSession.decode_step_frame_batch_sampled = staticmethod(decode_step_frame_batch_sampled)  # type: ignore[attr-defined]
