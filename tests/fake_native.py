"""A recording, scriptable stand-in for ``skippy_wire.stage._backend``, for the runtime tests.

Every call goes to the real backend (on the tiny generated GGUF); this module only records
the calls and injects what the real backend cannot produce:

* a BUFFER_TOO_SMALL that does not ask for a larger buffer (native reports exact sizes, so
  a real one always does), and the native message a batch call returns with it;
* a native result with malformed samples (duplicate or out-of-range request indexes);
* a backend that consumes optional activation parts (the llama backend rejects any part
  flag), so the one-at-a-time path can run on a terminal stage.

``FAKE.calls`` records ``(op, capacity)`` per call (a capacity list for the batches
``"iteration_batch"`` / ``"decode_batch"``); ``FAKE.script_error(op, status, message,
required)`` makes the next ``op`` raise that native error without running;
``FAKE.script_result(op, edit)`` passes the next result of ``op`` through ``edit``;
``FAKE.accept_optional_parts = True`` clears the optional flag of input parts.
"""

from __future__ import annotations

import struct
import sys
from collections import deque
from types import SimpleNamespace

from skippy_wire.errors import StageRuntimeError
from skippy_wire.stage import _backend as REAL

STATUS_OK = REAL.STATUS_OK
# activation desc: the part array starts at byte 72; a part's flags are at offset 44 in it
_PART0_FLAGS = 72 + 44


class _Control:
    def __init__(self):
        self.reset()

    def reset(self):
        self.scripted = deque()
        self.calls = []
        self.accept_optional_parts = False

    def script_error(self, op, status, message=None, required=None):
        self.scripted.append((op, StageRuntimeError.from_native(status, message, required), None))

    def script_result(self, op, edit):
        self.scripted.append((op, None, edit))

    def run(self, op, capacity, call):
        self.calls.append((op, capacity))
        for entry in list(self.scripted):
            if entry[0] == op:
                self.scripted.remove(entry)
                _, error, edit = entry
                if error is not None:
                    raise error
                return edit(call())
        return call()

    def input_desc(self, desc):
        if desc is None or not self.accept_optional_parts:
            return desc
        raw = bytearray(desc)
        flags = struct.unpack_from("<I", raw, _PART0_FLAGS)[0]
        struct.pack_into("<I", raw, _PART0_FLAGS, flags & ~1)
        return bytes(raw)


FAKE = _Control()


def fields(result, **changes):
    """A copy of a binding result with some fields replaced (for ``script_result``)."""
    names = [n for n in dir(result) if not n.startswith("_")]
    return SimpleNamespace(**{**{n: getattr(result, n) for n in names}, **changes})


class Model:
    def __init__(self, path, **kwargs):
        self.real = REAL.Model(path, **kwargs)

    def __getattr__(self, name):
        return getattr(self.real, name)

    def create_session(self):
        return Session(self.real.create_session())


class Session:
    def __init__(self, real):
        self.real = real

    def __getattr__(self, name):
        return getattr(self.real, name)

    def prefill_chunk_frame(self, tokens, positions=None, sampling=None, sample=False, input_desc=None,
                            input_payload=None, capacity=0):
        return FAKE.run("prefill_chunk_frame", capacity, lambda: self.real.prefill_chunk_frame(
            tokens, positions, sampling, sample, FAKE.input_desc(input_desc), input_payload, capacity))

    def decode_step_frame_sampled(self, token, sampling=None, input_desc=None, input_payload=None, capacity=0):
        return FAKE.run("decode_step_frame_sampled", capacity, lambda: self.real.decode_step_frame_sampled(
            token, sampling, FAKE.input_desc(input_desc), input_payload, capacity))

    def verify_tokens_frame_sampled(self, tokens, sampling=None, input_desc=None, input_payload=None, capacity=0,
                                    token_capacity=None, max_draft=0):
        return FAKE.run("verify_tokens_frame_sampled", capacity, lambda: self.real.verify_tokens_frame_sampled(
            tokens, sampling, FAKE.input_desc(input_desc), input_payload, capacity, token_capacity, max_draft))

    def copy_output_activation_frame(self, token_count, capacity=0):
        return FAKE.run("copy_output_activation_frame", capacity,
                        lambda: self.real.copy_output_activation_frame(token_count, capacity))


def _real(session):
    return session.real if isinstance(session, Session) else session


def iteration_batch_sampled(requests, capacities, sampled_capacity):
    real = [(_real(s), tokens, positions, sampling, FAKE.input_desc(desc), payload, sample_last)
            for s, tokens, positions, sampling, desc, payload, sample_last in requests]
    return FAKE.run("iteration_batch", list(capacities),
                    lambda: REAL.iteration_batch_sampled(real, capacities, sampled_capacity))


def decode_step_frame_batch_sampled(sessions, token_ids, samplings, input_descs, input_payloads, capacities,
                                    predicted_capacity):
    real, descs = [_real(s) for s in sessions], [FAKE.input_desc(d) for d in input_descs]
    return FAKE.run("decode_batch", list(capacities), lambda: REAL.decode_step_frame_batch_sampled(
        real, token_ids, samplings, descs, input_payloads, capacities, predicted_capacity))


def module():
    """This module, to pass as ``StageModel.open(..., backend=...)``."""
    return sys.modules[__name__]
