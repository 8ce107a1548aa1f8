"""The stage server's adapter over a stage runtime (:mod:`skippy_wire.stage.runtime`).

``RuntimeBackend`` is all the server needs from a model: sessions, prefill, decode (alone or
as a multi-session batch), trim, and the activation boundaries; tests substitute objects
with the same methods.  Frames come in as the wire delivered them (a v1 activation of state
version 15, or the runtime's own frame for 16/17) and go out as the runtime's frame (the
link converts it for its version).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..stage import runtime
from ..stage.activation import ActivationDesc, ActivationFrame
from ..wire.constants import activation_frame_flags_from_state_flags
from ..wire.forwarding import DEFAULT_CTX_SIZE

#: Sessions a stage holds at once (its lanes).
DEFAULT_LANES = 4
#: Distinct output descriptors kept parsed (decode steps share one; prefill chunks add a few).
MAX_KEPT_DESCS = 8


def _check_one_graph(requests) -> None:
    """Refuse, before anything runs, a batch the runtime would run one request at a time:
    a failure midway would leave the earlier requests done, and the batcher, which then
    retries every step on its own, would run them twice."""
    if any(runtime.iteration_request_requires_one_at_a_time(request) for request in requests):
        raise ValueError("a request of this batch must run on its own")


class RuntimeBackend:
    """What the server needs from a stage runtime, over ``skippy_wire.stage.runtime``.

    Tests substitute an object with the same methods (a fake runtime), so the server
    logic is exercised without a model.
    """

    def __init__(self, model: Any, lane_count: int | None = None) -> None:
        self.model = model
        self.lane_count = lane_count  # None: not known (the runtime refuses past its lanes)
        self.n_embd = int(model.n_embd)
        self.is_source = bool(model.is_source)
        self.is_terminal = bool(model.is_terminal)
        self.layer_start = int(model.layer_start)
        self.layer_end = int(model.layer_end)
        self.stage_index = int(getattr(model, "stage_index", 0))
        self._boundary = False  # the model's input boundary, fetched on first use
        self._descs: dict[bytes, Any] = {}  # output descriptor bytes -> the parsed descriptor

    @classmethod
    def open(cls, path: str | Path, layer_start: int, layer_end: int, *, stage_index: int = 0,
             ctx_size: int = DEFAULT_CTX_SIZE, n_threads: int | None = None,
             lane_count: int = DEFAULT_LANES) -> "RuntimeBackend":
        model = runtime.StageModel.open(
            path, layer_start, layer_end, stage_index=stage_index, ctx_size=ctx_size,
            lane_count=lane_count, n_threads=n_threads,
        )
        return cls(model, lane_count)

    def n_layer(self) -> int:
        return int(self.model.n_layer)

    def create_session(self) -> Any:
        return self.model.create_session()

    def free_session(self, session: Any) -> None:
        close = getattr(session, "close", None) or getattr(session, "free", None)
        if close is not None:
            close()

    def _input(self, activation, token_count: int, state_flags: int):
        if self.is_source:
            return None
        if isinstance(activation, ActivationFrame):  # state versions 16/17: the frame as sent
            return activation
        if self._boundary is False:
            self._boundary = self.model.input_activation_boundary()
        return runtime.packed_frame_from_wire(
            activation, token_count, self.n_embd, self.stage_index - 1, 0, self.layer_start,
            activation_frame_flags_from_state_flags(state_flags), boundary=self._boundary,
        )

    def _output(self, frame):
        """The runtime's output frame as it is (the link converts it for its version)."""
        if self.is_terminal or frame is None:
            return None
        return frame

    def _capacity(self, token_count: int) -> int:
        """The output buffer a call needs (f32 rows), so the runtime does not first answer
        BUFFER_TOO_SMALL and run again; the terminal stage exports nothing."""
        return 0 if self.is_terminal else 4 * self.n_embd * token_count

    def input_boundary(self):
        return self.model.input_activation_boundary()

    def output_boundary(self):
        return self.model.output_activation_boundary()

    def prefill(self, session, tokens, activation, state_flags, *, sample: bool, sampling):
        """Run one prefill chunk; returns ``(token or -1, ActivationFrame or None)``."""
        inp = self._input(activation, len(tokens), state_flags)
        if sample and self.is_terminal:
            token, frame = session.prefill_chunk_frame_sampled(tokens, sampling, input=inp)
        else:
            frame, token = session.prefill_chunk_frame(tokens, input=inp, output_capacity=self._capacity(len(tokens))), -1
        return int(token), self._output(frame)

    def decode(self, session, token, activation, state_flags, *, sampling):
        inp = self._input(activation, 1, state_flags)
        token, packed = session.decode_step_frame_raw(token, sampling if self.is_terminal else None,
                                                      input=inp, output_capacity=self._capacity(1))
        return int(token), self._decode_output(packed)

    def _decode_output(self, packed):
        """A decode step's output frame (a ``PackedFrame``): None on the terminal stage (its
        frame is empty), else the frame with its descriptor parsed once per distinct
        descriptor (a decode step's is the same every token): parsing its sixteen part slots
        cost each step 30-120 us.  The frames share it; nothing downstream changes a frame's
        descriptor."""
        if self.is_terminal:
            return None
        parsed = self._descs.get(packed.desc)
        if parsed is None:
            if len(self._descs) >= MAX_KEPT_DESCS:
                self._descs.clear()
            parsed = self._descs[packed.desc] = ActivationDesc.from_bytes(packed.desc)
        return ActivationFrame(parsed, packed.payload)

    def decode_batch(self, steps) -> list:
        """Several sessions' decode steps as one native batch (:mod:`.batching`)."""
        requests = [runtime.DecodeFrameBatchRequest(step.session, step.token,
                                                    step.sampling if self.is_terminal else None,
                                                    self._input(step.activation, 1, step.state_flags),
                                                    self._capacity(1))
                    for step in steps]
        _check_one_graph(requests)
        return [(int(out.predicted_token), self._decode_output(out.output))
                for out in runtime.decode_step_frame_batch_sampled(requests, packed=True)]

    def iteration_batch(self, steps) -> list:
        """Prefill chunks and decode steps (``DecodeStep``s with or without ``tokens``) of
        several sessions as one native batch, one scheduler iteration of the runtime;
        ``[(predicted token or -1, frame), ...]`` in order."""
        requests = []
        for step in steps:
            prefill = step.tokens is not None
            tokens = list(step.tokens) if prefill else [step.token]
            sample = self.is_terminal and step.sample
            requests.append(runtime.IterationBatchRequest(
                step.session, tokens, (), step.sampling if sample else None,
                self._input(step.activation, len(tokens), step.state_flags), sample_last=sample,
                phase=runtime.IterationBatchPhase.PREFILL if prefill else runtime.IterationBatchPhase.DECODE))
        _check_one_graph(requests)
        out = runtime.iteration_batch_sampled(requests)
        predicted = {sample.request_index: sample.predicted_token for sample in out.samples}
        return [(int(predicted.get(i, -1)), self._output(frame)) for i, frame in enumerate(out.request_outputs)]

    def trim(self, session, token_count: int) -> None:
        session.trim_session(token_count)
