"""A fake of the pinned ``skippy_wire.stage._backend`` contract, for testing the runtime adapter.

It follows the native rules that the adapter relies on (runtime.md sections 1.5 and 5.4):
arguments and the input frame are validated first, the required output size is computed
and BUFFER_TOO_SMALL returned *before* anything executes, ``n_past`` moves only on OK.

The "model" is arithmetic, so split and whole stages agree: a source stage turns token
``t`` at position ``p`` into the row ``[t, p, layers, 0, ...]`` (F32, ``n_embd`` wide);
every stage adds its layer count to ``row[2]``; a terminal stage predicts
``(7 * t + p + layers) % n_vocab`` from the last row (every row for verify).

Scripting and counters:

* ``FAKE.script(op, status, message=None, out_bytes=None)`` makes the next call of ``op``
  (a method name, or ``"iteration_batch"`` / ``"decode_batch"``) return that status
  without executing; ``out_bytes`` (int or list) is reported as the required size.
* ``FAKE.calls`` records ``(op, capacity)`` for every call (capacity list for batches).
* ``FakeModel.batched_activation_exports`` may be set per instance.
"""

from __future__ import annotations

import struct
import sys
from collections import deque
from pathlib import Path

from skippy_wire.stage.activation import (
    ActivationBoundaryDesc,
    ActivationDesc,
    ActivationPartDesc,
    GGML_TYPE_F32,
    NativeMtpDraft,
    frontier_identity_of,
    llama_residual_identity,
)

STATUS_OK = 0
STATUS_ERROR = 1
STATUS_INVALID_ARGUMENT = 2
STATUS_UNSUPPORTED = 3
STATUS_BUFFER_TOO_SMALL = 4
STATUS_IO_ERROR = 5
STATUS_MODEL_ERROR = 6
STATUS_RUNTIME_ERROR = 7

ACTIVATION_DESC_BYTES = 2120
ACTIVATION_BOUNDARY_DESC_BYTES = 2088
SAMPLING_CONFIG_BYTES = 2352
MTP_DRAFT_BYTES = 56

EMPTY_DESC = ActivationDesc.empty().to_bytes()
NO_DRAFT = NativeMtpDraft.pack(False)


def abi_version():
    return (0, 1, 0)


def abi_features():
    return 0


class NativeError(Exception):
    def __init__(self, status, message):
        super().__init__(f"{status}: {message}")
        self.status = status
        self.message = message


class _Control:
    def __init__(self):
        self.reset()

    def reset(self):
        self.scripted = deque()
        self.calls = []

    def script(self, op, status, message=None, out_bytes=None):
        self.scripted.append((op, status, message, out_bytes))

    def take(self, op):
        for entry in list(self.scripted):
            if entry[0] == op:
                self.scripted.remove(entry)
                return entry
        return None


FAKE = _Control()


class _Failure(Exception):
    def __init__(self, status, message):
        self.status, self.message = status, message


class FakeModel:
    n_layer = 4
    n_embd = 4
    n_vocab = 32
    architecture = "fake"

    def __init__(self, path, *, stage_index=0, layer_start=0, layer_end=-1, ctx_size=512,
                 lane_count=1, n_threads=0, n_batch=512):
        if not str(path).startswith("fake:") and not Path(path).exists():
            raise NativeError(STATUS_IO_ERROR, f"failed to open {path}")
        if layer_end == -1:
            layer_end = self.n_layer
        if not 0 <= layer_start < layer_end <= self.n_layer:
            raise NativeError(STATUS_INVALID_ARGUMENT, f"invalid layer range {layer_start}..{layer_end}")
        self.stage_index, self.layer_start, self.layer_end = stage_index, layer_start, layer_end
        self.n_ctx = ctx_size * lane_count
        self.ctx_size, self.lane_count = ctx_size, lane_count
        self.is_source = layer_start == 0
        self.is_terminal = layer_end == self.n_layer
        self.batched_activation_exports = True
        self.lanes_in_use = 0

    def create_session(self):
        if self.lanes_in_use >= self.lane_count:
            raise NativeError(STATUS_RUNTIME_ERROR, "no skippy execution lane is available")
        self.lanes_in_use += 1
        return FakeSession(self)

    def _boundary(self):
        desc = ActivationDesc.f32_rows(self.n_embd, 0)
        desc.parts[0].dimensions = (self.n_embd, -1, 0, 0)
        desc.parts[0].byte_strides = (4, 4 * self.n_embd, 0, 0)
        return ActivationBoundaryDesc(2, 1, desc.frontier_identity, desc.parts).to_bytes()

    def input_activation_boundary(self):
        return None if self.is_source else self._boundary()

    def output_activation_boundary(self):
        return None if self.is_terminal else self._boundary()


Model = FakeModel


def _rows(payload, n_embd):
    values = struct.unpack(f"<{len(payload) // 4}f", payload)
    return [list(values[i : i + n_embd]) for i in range(0, len(values), n_embd)]


class FakeSession:
    def __init__(self, model):
        self.model = model
        self.n_past = 0
        self.closed = False
        self.last_rows = []
        self.last_logit_row = None
        self.checkpoint = None

    @property
    def position(self):
        return self.n_past

    def close(self):
        if not self.closed:
            self.closed = True
            self.model.lanes_in_use -= 1

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    # -- shared execution

    def _validate(self, tokens, positions, sampling, input_desc, input_payload):
        model = self.model
        if not tokens:
            raise _Failure(STATUS_INVALID_ARGUMENT, "session and at least one token are required")
        if any(not 0 <= t < model.n_vocab for t in tokens):
            raise _Failure(STATUS_INVALID_ARGUMENT, "token id out of range")
        if positions is not None and len(positions) != len(tokens):
            raise _Failure(STATUS_INVALID_ARGUMENT, "position count does not match token count")
        if sampling is not None and len(sampling) != SAMPLING_CONFIG_BYTES:
            raise _Failure(STATUS_INVALID_ARGUMENT, "sampling config has the wrong size")
        if model.is_source:
            if input_payload:
                raise _Failure(STATUS_INVALID_ARGUMENT, "this stage expects token input, not activation input")
            return None
        if input_desc is None:
            raise _Failure(STATUS_INVALID_ARGUMENT, "this stage expects activation input")
        desc = ActivationDesc.from_bytes(input_desc)
        if desc.layer_end != model.layer_start:
            raise _Failure(STATUS_INVALID_ARGUMENT,
                           f"input frame ends at layer {desc.layer_end}, stage starts at {model.layer_start}")
        if (desc.version != 2 or desc.part_count != 1
                or desc.parts[0].identity != llama_residual_identity(model.n_embd)
                or desc.frontier_identity != frontier_identity_of(desc.parts[:1])):
            raise _Failure(STATUS_INVALID_ARGUMENT, "input frame does not match this stage's activation boundary")
        if desc.token_count != len(tokens):
            raise _Failure(STATUS_INVALID_ARGUMENT, "input frame token count does not match")
        if len(input_payload or b"") != desc.payload_bytes or desc.payload_bytes != 4 * model.n_embd * len(tokens):
            raise _Failure(STATUS_INVALID_ARGUMENT, "input frame payload size does not match")
        return _rows(input_payload, model.n_embd)

    def _required(self, n):
        return 0 if self.model.is_terminal else 4 * self.model.n_embd * n

    def _execute(self, tokens, positions, rows):
        model = self.model
        if self.n_past + len(tokens) > model.ctx_size:
            raise _Failure(STATUS_RUNTIME_ERROR, "context full")
        if rows is None:
            pos = positions or [self.n_past + i for i in range(len(tokens))]
            rows = [[float(t), float(p), 0.0] + [0.0] * (model.n_embd - 3) for t, p in zip(tokens, pos)]
        layers = model.layer_end - model.layer_start
        rows = [[r[0], r[1], r[2] + layers] + r[3:] for r in rows]
        self.n_past += len(tokens)
        self.last_rows = rows
        self.checkpoint = None
        if model.is_terminal:
            self.last_logit_row = rows[-1]
            return EMPTY_DESC, b"", rows
        desc = ActivationDesc.f32_rows(
            model.n_embd, len(rows), producer_stage_index=model.stage_index,
            layer_start=model.layer_start, layer_end=model.layer_end,
        )
        payload = struct.pack(f"<{len(rows) * model.n_embd}f", *[v for r in rows for v in r])
        return desc.to_bytes(), payload, rows

    def _predict(self, row):
        if not self.model.is_terminal:
            return -1
        return int(7 * row[0] + row[1] + row[2]) % self.model.n_vocab

    def _scripted(self, op, capacity):
        FAKE.calls.append((op, capacity))
        entry = FAKE.take(op)
        if entry is None:
            return None
        _, status, message, out_bytes = entry
        return status, message, out_bytes or 0

    # -- contract

    def prefill_chunk_frame(self, tokens, positions=None, sampling=None, sample=False,
                            input_desc=None, input_payload=None, capacity=0):
        op = "prefill_chunk_frame"
        scripted = self._scripted(op, capacity)
        if scripted:
            return scripted[0], scripted[1], EMPTY_DESC, b"", scripted[2], -1
        try:
            rows = self._validate(tokens, positions, sampling, input_desc, input_payload)
            required = self._required(len(tokens))
            if capacity < required:
                return STATUS_BUFFER_TOO_SMALL, "output buffer too small", EMPTY_DESC, b"", required, -1
            desc, payload, out_rows = self._execute(tokens, positions, rows)
        except _Failure as failure:
            return failure.status, failure.message, EMPTY_DESC, b"", 0, -1
        predicted = self._predict(out_rows[-1]) if sample else -1
        return STATUS_OK, None, desc, payload, len(payload), predicted

    def decode_step_frame_sampled(self, token, sampling=None, input_desc=None, input_payload=None, capacity=0):
        op = "decode_step_frame_sampled"
        scripted = self._scripted(op, capacity)
        if scripted:
            return scripted[0], scripted[1], EMPTY_DESC, b"", scripted[2], -1
        try:
            rows = self._validate([token], None, sampling, input_desc, input_payload)
            required = self._required(1)
            if capacity < required:
                return STATUS_BUFFER_TOO_SMALL, "output buffer too small", EMPTY_DESC, b"", required, -1
            desc, payload, out_rows = self._execute([token], None, rows)
        except _Failure as failure:
            return failure.status, failure.message, EMPTY_DESC, b"", 0, -1
        return STATUS_OK, None, desc, payload, len(payload), self._predict(out_rows[-1])

    def verify_tokens_frame_sampled(self, tokens, sampling=None, input_desc=None, input_payload=None,
                                    capacity=0, token_capacity=None, max_draft=0):
        op = "verify_tokens_frame_sampled"
        scripted = self._scripted(op, capacity)
        if scripted:
            return scripted[0], scripted[1], EMPTY_DESC, b"", scripted[2], [], NO_DRAFT
        try:
            rows = self._validate(tokens, None, sampling, input_desc, input_payload)
            required = self._required(len(tokens))
            if capacity < required:
                return STATUS_BUFFER_TOO_SMALL, "output buffer too small", EMPTY_DESC, b"", required, [], NO_DRAFT
            if token_capacity is not None and token_capacity < len(tokens):
                return STATUS_BUFFER_TOO_SMALL, "token buffer too small", EMPTY_DESC, b"", 0, [], NO_DRAFT
            start = self.n_past
            desc, payload, out_rows = self._execute(tokens, None, rows)
            self.checkpoint = (start, len(tokens))
        except _Failure as failure:
            return failure.status, failure.message, EMPTY_DESC, b"", 0, [], NO_DRAFT
        predicted = [self._predict(row) for row in out_rows] if self.model.is_terminal else []
        return STATUS_OK, None, desc, payload, len(payload), predicted, NO_DRAFT

    def copy_output_activation_frame(self, token_count, capacity=0):
        op = "copy_output_activation_frame"
        scripted = self._scripted(op, capacity)
        if scripted:
            return scripted[0], scripted[1], EMPTY_DESC, b"", scripted[2]
        model = self.model
        if model.is_terminal or not self.last_rows or token_count > len(self.last_rows):
            return STATUS_INVALID_ARGUMENT, "no output activation rows to copy", EMPTY_DESC, b"", 0
        required = 4 * model.n_embd * token_count
        if capacity < required:
            return STATUS_BUFFER_TOO_SMALL, "output buffer too small", EMPTY_DESC, b"", required
        rows = self.last_rows[-token_count:]
        desc = ActivationDesc.f32_rows(model.n_embd, token_count, producer_stage_index=model.stage_index,
                                       layer_start=model.layer_start, layer_end=model.layer_end)
        payload = struct.pack(f"<{token_count * model.n_embd}f", *[v for r in rows for v in r])
        return STATUS_OK, None, desc.to_bytes(), payload, len(payload)

    def sample_current(self, sampling=None):
        scripted = self._scripted("sample_current", 0)
        if scripted:
            return scripted[0], scripted[1], -1
        if not self.model.is_terminal or self.last_logit_row is None:
            return STATUS_INVALID_ARGUMENT, "no logits to sample", -1
        return STATUS_OK, None, self._predict(self.last_logit_row)

    def trim(self, token_count):
        scripted = self._scripted("trim", 0)
        if scripted:
            return scripted[0], scripted[1]
        if token_count > self.n_past:
            return STATUS_INVALID_ARGUMENT, "cannot trim session beyond current token count"
        self.n_past = token_count
        self.checkpoint = None
        return STATUS_OK, None

    def retire_verify_checkpoint(self, token_start, token_count):
        scripted = self._scripted("retire_verify_checkpoint", 0)
        if scripted:
            return scripted[0], scripted[1]
        if self.checkpoint != (token_start, token_count):
            return STATUS_INVALID_ARGUMENT, "verify checkpoint does not match"
        self.checkpoint = None
        return STATUS_OK, None

    def reset(self):
        self.n_past = 0
        self.last_rows = []
        self.last_logit_row = None
        self.checkpoint = None
        return STATUS_OK, None


Session = FakeSession


def iteration_batch_sampled(requests, capacities, sampled_capacity):
    n = len(requests)
    FAKE.calls.append(("iteration_batch", list(capacities)))
    entry = FAKE.take("iteration_batch")
    if entry is not None:
        _, status, message, out_bytes = entry
        out = list(out_bytes) if isinstance(out_bytes, (list, tuple)) else [out_bytes or 0] * n
        return status, message, [EMPTY_DESC] * n, [b""] * n, out, [], []
    empty = (lambda status, message, out: (status, message, [EMPTY_DESC] * n, [b""] * n, out, [], []))
    # Validate everything (and size every output) before executing anything.
    required = []
    for session, tokens, positions, sampling, desc, payload, _ in requests:
        if session is None or not tokens:
            return empty(STATUS_INVALID_ARGUMENT, "session and at least one token are required", [0] * n)
        try:
            session._validate(tokens, positions, sampling, desc, payload)
        except _Failure as failure:
            return empty(failure.status, failure.message, [0] * n)
        required.append(session._required(len(tokens)))
    if any(r > c for r, c in zip(required, capacities)):
        return empty(STATUS_BUFFER_TOO_SMALL, "output buffer too small", required)
    descs, payloads, out_bytes, indexes, predicted = [], [], [], [], []
    for index, (session, tokens, positions, sampling, desc, payload, sample_last) in enumerate(requests):
        rows = session._validate(tokens, positions, sampling, desc, payload)
        try:
            out_desc, out_payload, out_rows = session._execute(tokens, positions, rows)
        except _Failure as failure:
            return empty(failure.status, failure.message, [0] * n)
        descs.append(out_desc)
        payloads.append(out_payload)
        out_bytes.append(len(out_payload))
        if sample_last and session.model.is_terminal:
            indexes.append(index)
            predicted.append(session._predict(out_rows[-1]))
    return STATUS_OK, None, descs, payloads, out_bytes, indexes[:sampled_capacity], predicted[:sampled_capacity]


def decode_step_frame_batch_sampled(sessions, token_ids, samplings, input_descs, input_payloads,
                                    capacities, predicted_capacity):
    n = len(sessions)
    FAKE.calls.append(("decode_batch", list(capacities)))
    entry = FAKE.take("decode_batch")
    empty = (lambda status, message, out: (status, message, [EMPTY_DESC] * n, [b""] * n, out, [-1] * n))
    if entry is not None:
        _, status, message, out_bytes = entry
        out = list(out_bytes) if isinstance(out_bytes, (list, tuple)) else [out_bytes or 0] * n
        return empty(status, message, out)
    required = []
    for session, token, sampling, desc, payload in zip(sessions, token_ids, samplings, input_descs, input_payloads):
        if session is None:
            return empty(STATUS_INVALID_ARGUMENT, "every batch request needs a session", [0] * n)
        try:
            session._validate([token], None, sampling, desc, payload)
        except _Failure as failure:
            return empty(failure.status, failure.message, [0] * n)
        required.append(session._required(1))
    if any(r > c for r, c in zip(required, capacities)):
        return empty(STATUS_BUFFER_TOO_SMALL, "output buffer too small", required)
    descs, payloads, out_bytes, predicted = [], [], [], []
    for session, token, sampling, desc, payload in zip(sessions, token_ids, samplings, input_descs, input_payloads):
        rows = session._validate([token], None, sampling, desc, payload)
        out_desc, out_payload, out_rows = session._execute([token], None, rows)
        descs.append(out_desc)
        payloads.append(out_payload)
        out_bytes.append(len(out_payload))
        predicted.append(session._predict(out_rows[-1]))
    return STATUS_OK, None, descs, payloads, out_bytes, predicted[:predicted_capacity]


def module():
    """This module, to pass as ``StageModel.open(..., backend=...)``."""
    return sys.modules[__name__]
