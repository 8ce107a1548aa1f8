"""Shared by the tests of the ggml stage backend binding (test_backend*.py): the tiny
random llama GGUF fixtures, packed structs, and frame calls with the BUFFER_TOO_SMALL retry
of runtime.md §1.5 written against the binding directly."""

from __future__ import annotations

import struct

import pytest

from numpy_llama import NumpyLlama
from skippy_wire.errors import StageRuntimeError, Status
from skippy_wire.stage import _backend as B
from skippy_wire.stage import models
from skippy_wire.stage.native import retry_with_required_capacity as retried

PROMPT = [1, 10, 20, 30, 40]
N_LAYER = 4
N_EMBD = 64
N_VOCAB = 256
OK = B.STATUS_OK


def status_of(fn, *args, **kw):
    """``(status, message)`` of one binding call: ``(OK, None)`` when it returned."""
    try:
        fn(*args, **kw)
    except StageRuntimeError as error:
        return error.status, error.message
    return Status.OK, None


@pytest.fixture(scope="session")
def tiny_path(tmp_path_factory):
    return str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny-f32.gguf"))


@pytest.fixture(scope="session")
def tiny_f16_path(tmp_path_factory):
    return str(models.write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny16") / "tiny-f16.gguf", file_type="f16"))


@pytest.fixture(scope="session")
def ref(tiny_path):
    return NumpyLlama(tiny_path)


def open_model(path, **kw):
    kw.setdefault("n_threads", 2)
    return B.Model(path, **kw)


def pack_sampling(*, enabled=True, ignore_eos=False, seed=0, top_k=0, penalty_last_n=-1, temperature=1.0,
                  top_p=1.0, presence=0.0, frequency=0.0, repeat=1.0, min_p=0.0, logit_bias=(), version=2):
    """SamplingConfig v2 (runtime.md §2.4), 2352 bytes."""
    flags = (1 if enabled else 0) | (2 if ignore_eos else 0)
    head = struct.pack("<IIIiifffffIf", version, flags, seed, top_k, penalty_last_n, temperature, top_p, presence,
                       frequency, repeat, len(logit_bias), min_p)
    # typical_p .. mirostat_learning_rate at their Rust defaults, then sampler_count 0
    rest = struct.pack("<ffffffiiffiffI", 1.0, -1.0, 0.0, 1.0, 0.0, 1.75, 2, 64, 0.0, 0.1, 0, 5.0, 0.1, 0)
    buf = bytearray(2352)
    buf[: len(head)] = head
    buf[48 : 48 + len(rest)] = rest
    struct.pack_into("<I", buf, 168, 1 if ignore_eos else 0)
    for i, (tok, bias) in enumerate(logit_bias):
        struct.pack_into("<if", buf, 304 + 8 * i, tok, bias)
    return bytes(buf)


def desc_fields(desc: bytes):
    version, producer, ls, le, tokens, seqs, parts, _r, payload = struct.unpack_from("<IiiiIIIIQ", desc)
    return dict(version=version, producer=producer, layer_start=ls, layer_end=le, token_count=tokens,
                sequence_count=seqs, part_count=parts, payload_bytes=payload)


def run_prefill(session, tokens, desc=None, payload=None, sample=True, sampling=None, positions=None):
    """Prefill with the BUFFER_TOO_SMALL retry; returns (desc, payload, token)."""
    r = retried(session.prefill_chunk_frame, tokens, positions=positions, sampling=sampling, sample=sample,
                input_desc=desc, input_payload=payload)
    return r.out_desc, r.out_payload, r.predicted_token


def run_decode(session, token, desc=None, payload=None, sampling=None):
    r = retried(session.decode_step_frame_sampled, token, sampling, desc, payload)
    return r.out_desc, r.out_payload, r.predicted_token


def run_verify(session, tokens, desc=None, payload=None, sampling=None):
    r = retried(session.verify_tokens_frame_sampled, tokens, sampling, desc, payload)
    return r.out_desc, r.out_payload, r.predicted_tokens


class Pipeline:
    """Stages over contiguous layer ranges, each with one session; frames handed along."""

    def __init__(self, path, cuts, **kw):
        bounds = [0, *cuts, N_LAYER]
        self.models = [open_model(path, stage_index=i, layer_start=a, layer_end=b, **kw)
                       for i, (a, b) in enumerate(zip(bounds, bounds[1:]))]
        self.sessions = [m.create_session() for m in self.models]

    def prefill(self, tokens, sampling=None):
        d = p = None
        for s in self.sessions:
            d, p, tok = run_prefill(s, tokens, d, p, sampling=sampling)
        return tok

    def decode(self, token, sampling=None):
        d = p = None
        for s in self.sessions:
            d, p, tok = run_decode(s, token, d, p, sampling=sampling)
        return tok

    def verify(self, tokens):
        d = p = None
        for s in self.sessions:
            d, p, preds = run_verify(s, tokens, d, p)
        return preds

    def trim(self, n):
        for s in self.sessions:
            s.trim(n)


#: In :func:`rewritten_gguf`'s ``kv``: remove the key.
DROP = object()


def rewritten_gguf(src, dst, *, kv: dict | None = None, tensors: dict | None = None):
    """A copy of the GGUF ``src`` at ``dst`` with metadata ``kv`` ({key: (value, value type)}
    or {key: DROP}) and tensors ``tensors`` ({name: numpy array}) changed: a model broken
    in exactly one way."""
    import gguf
    import numpy as np

    kv, tensors = dict(kv or {}), tensors or {}
    reader = gguf.GGUFReader(src)
    writer = gguf.GGUFWriter(str(dst), reader.fields["general.architecture"].contents())
    for field in reader.fields.values():
        if field.name.startswith("GGUF.") or field.name == "general.architecture":
            continue
        change = kv.pop(field.name, None)
        if change is DROP:
            continue
        value, vtype = change or (field.contents(), field.types[0])
        writer.add_key_value(field.name, value, vtype, sub_type=field.types[-1] if len(field.types) > 1 else None)
    for key, (value, vtype) in kv.items():
        writer.add_key_value(key, value, vtype)
    for tensor in reader.tensors:
        writer.add_tensor(tensor.name, np.asarray(tensors.get(tensor.name, tensor.data)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(dst)
