"""Property fuzzing of the state-16/17 readers (the v15 ones: test_fuzz_frame.py).

Mutated golden messages, frames and agreement-framed activations: the compiled and the
reference kernels give the same outcome (message and ``consumed``, or the same error
class and text), only ``WireError``s escape, and an incremental decoder fed the bytes in
small pieces ends where the buffer reader ends, with the same error.
"""

from __future__ import annotations

import json
import struct
import sys
from functools import lru_cache
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from skippy_wire.errors import WireError
from skippy_wire.wire.agreement import ActivationAgreement
from skippy_wire.wire.frame import RecordDecoder
from skippy_wire.wire.protocol import kernels

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "fuzz"))
import wire_targets  # noqa: E402

from conftest import IMPLS  # noqa: E402

GOLDEN = Path(__file__).parent / "golden"
WORDS = [0, 1, 2, 3, 4, 16, 17, 255, 0x10000, 0x20000000, 0x20000001, 0x7FFFFFFF, 0x80000000, 0xFFFFFFFF]


def _lines(name: str):
    return [json.loads(line) for line in (GOLDEN / name).read_text().splitlines()]


def _agreement(case):
    return ActivationAgreement.from_json(case["agreement"]) if "agreement" in case else None


@lru_cache(maxsize=None)
def messages() -> tuple:
    out = []
    for v in (16, 17):
        for case in _lines(f"v{v}/frame.jsonl"):
            if case["write"]["ok"]:
                out.append((v, bytes.fromhex(case["write"]["hex"]), _agreement(case)))
    return tuple(out)


@lru_cache(maxsize=None)
def frames() -> tuple:
    return tuple((v, case["codec_id"], bytes.fromhex(case["wire_hex"]))
                 for v in (16, 17) for case in _lines(f"v{v}/activation_frame_decode.jsonl"))


@lru_cache(maxsize=None)
def agreed() -> tuple:
    return tuple((_agreement(case), case["codec_id"], bytes.fromhex(case["wire_hex"]))
                 for case in _lines("v17/agreed_activation_decode.jsonl"))


@st.composite
def mutated(draw, data: bytes) -> bytes:
    b = bytearray(data)
    for _ in range(draw(st.integers(0, 3))):
        op = draw(st.integers(0, 3))
        if not b:
            break
        at = draw(st.integers(0, len(b) - 1))
        if op == 0:
            b[at] = draw(st.integers(0, 255))
        elif op == 1 and at + 4 <= len(b):
            b[at:at + 4] = struct.pack("<I", draw(st.sampled_from(WORDS)))
        elif op == 2:
            del b[at:]
        else:
            b[at:at] = draw(st.binary(min_size=1, max_size=8))
    return bytes(b)


def _differential(name: str, *args, limit=None):
    compiled = kernels("cython") if "cython" in IMPLS else None
    return wire_targets.differential(compiled, kernels("python"), name, *args, limit=limit)


@st.composite
def message_inputs(draw):
    v, data, agreement = draw(st.sampled_from(messages()))
    return v, draw(mutated(data)), agreement if draw(st.booleans()) or v == 16 else None


@given(message_inputs(), st.sampled_from([None, 1, 2, 3, 4]), st.sampled_from([1, 2, 5]))
def test_mutated_messages_read_alike_whole_and_in_pieces(inputs, expected, step):
    v, data, agreement = inputs
    policy = 0
    whole = _differential("read_stage_message_from_buffer", v, data, expected, policy, 0, agreement,
                          limit=len(data))
    if whole[0] == "ok":
        data = data[:whole[1][1]]  # trailing bytes would start a second message
    for impl in IMPLS:
        kernel = kernels(impl).read_stage_message_from_buffer
        decoder = RecordDecoder(lambda buf, pos, k=kernel: k(v, buf, expected, policy, pos, agreement))
        records, error = [], None
        try:
            for at in range(0, len(data), step):
                records += decoder.feed(data[at:at + step])
        except WireError as exc:
            error = ("err", type(exc).__name__, str(exc))
        if whole[0] == "ok":
            assert error is None and len(records) == 1 and decoder.consumed == whole[1][1], (impl, error)
            assert wire_targets.canon(records[0]) == wire_targets.canon(whole[1][0]), impl
        elif whole[1] != "UnexpectedEofError" or error is not None:
            # a short message waits for more bytes; anything else fails exactly as the buffer read
            assert error == whole and not records, (impl, error, whole)


@given(st.sampled_from(frames()).flatmap(lambda f: st.tuples(st.just(f), mutated(f[2]))),
       st.sampled_from([None, 1, 2, 3, 4]))
def test_mutated_frames_decode_alike(frame, codec):
    (v, codec_id, _), data = frame
    _differential("decode_frame", codec or codec_id, data, v)


@given(st.sampled_from(agreed()).flatmap(lambda f: st.tuples(st.just(f), mutated(f[2]))))
def test_mutated_agreed_activations_decode_alike(item):
    (agreement, codec, _), data = item
    _differential("agreed_decode", agreement, codec, data)
