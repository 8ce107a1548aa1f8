"""Values of the wrong type, on both implementations: each is one error naming the field
(the same class and text from the compiled kernels and the twin), never a silent
conversion (an int identity as 32 zero bytes, ``b"AB"`` as tokens [65, 66], ``"no"`` as
True, a float64 array read as f32 bytes)."""

from __future__ import annotations

import array
import ctypes
import math
import struct
from decimal import Decimal
from fractions import Fraction

import ml_dtypes
import numpy as np
import pytest
from conftest import IMPLS

import skippy_wire as sw
from skippy_wire._impl import kernel_module
from skippy_wire.errors import InvalidInputError
from skippy_wire.wire import codec
from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16
from skippy_wire.wire.protocol import WireProtocol

W = sw.WireMessageKind


def outcome(call):
    try:
        result = call()
    except Exception as error:  # noqa: BLE001 - the outcome is what is compared
        return type(error), str(error)
    return "ok", result


def both(call):
    """``call(impl)`` on every implementation: the one outcome they all give."""
    outcomes = [outcome(lambda: call(impl)) for impl in IMPLS]
    assert all(o == outcomes[0] for o in outcomes), outcomes
    return outcomes[0]


# --- v16 descriptors: identities -------------------------------------------------------------
def _desc(where: str, identity):
    part = ActivationPartV16.dense(bytes([1]) * 32, 0, [4, 2], 1)
    desc = ActivationFrameV16.of_parts([part], token_count=2)
    if where == "frontier":
        desc.frontier_identity = identity
    else:
        desc.parts[0].identity = identity
    return desc


FRAME_CALLS = {
    "encode_frame": lambda p, d: p.encode_frame(1, d, bytes(32)),
    "frame_wire_bytes": lambda p, d: p.frame_wire_bytes(1, d),
    "select_frame_codec": lambda p, d: p.select_frame_codec(d, bytes(32), [1, 3]),
}
BAD_IDENTITIES = [None, "x" * 32, 32, 0, [0] * 32, b"x" * 31, b"x" * 33, 32.0]


@pytest.mark.parametrize("call", sorted(FRAME_CALLS))
@pytest.mark.parametrize("where, name", [("frontier", "frontier_identity"), ("part", "parts[0].identity")])
@pytest.mark.parametrize("identity", BAD_IDENTITIES, ids=repr)
def test_an_identity_that_is_not_a_32_byte_buffer_is_named(impl, call, where, name, identity):
    with pytest.raises(InvalidInputError) as info:
        FRAME_CALLS[call](WireProtocol(16, impl=impl), _desc(where, identity))
    assert str(info.value) == f"activation frame descriptor field out of range: {name}"
    assert both(lambda i: FRAME_CALLS[call](WireProtocol(16, impl=i), _desc(where, identity))) == (
        InvalidInputError, str(info.value))


@pytest.mark.parametrize("where", ["frontier", "part"])
def test_any_32_byte_buffer_is_an_identity(impl, where):
    raw = bytes(range(32))
    want = WireProtocol(16, impl=impl).encode_frame(1, _desc(where, raw), bytes(32))
    for identity in (bytearray(raw), memoryview(raw), np.frombuffer(raw, np.uint8),
                     np.frombuffer(raw, np.float32), memoryview(bytes(x for b in raw for x in (b, 0)))[::2]):
        frame = _desc(where, identity)
        assert WireProtocol(16, impl=impl).encode_frame(1, frame, bytes(32)) == want


# --- v15 writer: fields of the wrong type ----------------------------------------------------
def _message(**changes):
    state = sw.StageStateHeader.new(W.PREFILL_EMBD)
    state.source_stage_index = 0
    msg = sw.StageWireMessage(W.PREFILL_EMBD, 0, 1, state, 1, 2, sampling=sw.SamplingConfig(),
                              tokens=[7], positions=[0], activation=bytes(16))
    for name, value in changes.items():
        owner, _, attr = name.rpartition(".")
        setattr(getattr(msg, owner) if owner else msg, attr, value)
    return msg


_PAIR_VIEW = memoryview(b"\x05\x02")
MESSAGE_MISTAKES = [
    ({"tokens": b"AB"}, "tokens must be a sequence of ints, not bytes"),
    ({"tokens": bytearray(b"AB")}, "tokens must be a sequence of ints, not bytearray"),
    ({"positions": b""}, "positions must be a sequence of ints, not bytes"),
    ({"positions": (p for p in [0])}, "positions must be a sequence of ints, not generator"),
    ({"tokens": iter([7])}, "tokens must be a sequence of ints, not list_iterator"),
    ({"tokens": [7, True]}, "tokens value True does not fit its wire type"),
    ({"sampling.ignore_eos": "no"}, "sampling.ignore_eos value 'no' is not a bool"),
    ({"sampling.ignore_eos": None}, "sampling.ignore_eos value None is not a bool"),
    ({"sampling.ignore_eos": 2}, "sampling.ignore_eos value 2 is not a bool"),
    ({"sampling.ignore_eos": 1.0}, "sampling.ignore_eos value 1.0 is not a bool"),
    ({"kind": True}, "kind value True does not fit its wire type"),
    ({"pos_start": False}, "pos_start value False does not fit its wire type"),
    ({"token_count": True}, "token_count value True does not fit its wire type"),
    ({"state.source_stage_index": True}, "state.source_stage_index value True does not fit its wire type"),
    ({"state.flags": True}, "state.flags value True does not fit its wire type"),
    ({"state.seq_id": True}, "state.seq_id value True does not fit its wire type"),
    ({"request_id": True}, "request_id value True does not fit its wire type"),
    ({"sampling.seed": True}, "sampling.seed value True does not fit its wire type"),
    ({"sampling.top_k": False}, "sampling.top_k value False does not fit its wire type"),
    ({"sampling.temperature": True}, "sampling.temperature value True is not a number"),
    ({"sampling.min_p": np.False_}, "sampling.min_p value np.False_ is not a number"),
    ({"sampling.logit_bias": [(True, 1.0)]}, "sampling.logit_bias token_id value True does not fit its wire type"),
    ({"sampling.logit_bias": [(1, True)]}, "sampling.logit_bias bias True is not a number"),
    # raw bytes are no ints: memoryview(b"AB") was tokens [65, 66], b"\x05\x02" the pair (5, 2.0)
    ({"tokens": memoryview(b"AB")}, "tokens must be a sequence of ints, not memoryview"),
    ({"positions": memoryview(b"\x00")}, "positions must be a sequence of ints, not memoryview"),
    ({"sampling.logit_bias": [b"\x05\x02"]}, "sampling.logit_bias entry b'\\x05\\x02' is not a (token_id, bias) pair"),
    ({"sampling.logit_bias": [(1, 2.0), bytearray(b"\x05\x02")]},
     "sampling.logit_bias entry bytearray(b'\\x05\\x02') is not a (token_id, bias) pair"),
    ({"sampling.logit_bias": [_PAIR_VIEW]}, f"sampling.logit_bias entry {_PAIR_VIEW!r} is not a (token_id, bias) pair"),
    ({"sampling.logit_bias": ["ab"]}, "sampling.logit_bias entry 'ab' is not a (token_id, bias) pair"),
]


@pytest.mark.parametrize("changes, text", MESSAGE_MISTAKES, ids=[t for _, t in MESSAGE_MISTAKES])
def test_a_message_field_of_the_wrong_type_is_named(impl, changes, text):
    with pytest.raises(InvalidInputError) as info:
        sw.write_stage_message(_message(**changes), impl=impl)
    assert str(info.value) == text
    assert both(lambda i: sw.write_stage_message(_message(**changes), impl=i)) == (InvalidInputError, text)


#: The v16/v17 writers need a frame for source_stage_index >= 0.
V16_MISTAKES = [(c, t) for c, t in MESSAGE_MISTAKES if "state.source_stage_index" not in c]


@pytest.mark.parametrize("version", [16, 17])
@pytest.mark.parametrize("changes, text", V16_MISTAKES, ids=[t for _, t in V16_MISTAKES])
def test_the_v16_and_v17_writers_name_them_too(impl, version, changes, text):
    msg = _message(**changes)
    msg.state.version = version
    msg.state.source_stage_index = -1  # activationless: no frame needed
    msg.activation = b""
    with pytest.raises(InvalidInputError) as info:
        WireProtocol(version, impl=impl).write(msg)
    assert str(info.value) == text


@pytest.mark.parametrize("version", [15, 16, 17])
def test_the_message_constructors_make_a_header_a_writer_of_their_version_reads_back(impl, version):
    """``StageWireMessage.stop()`` and ``configure_generation()`` made a state version 15 header
    only, which a v16 or v17 writer writes as given and its own reader then refuses."""
    protocol = WireProtocol(version, impl=impl)
    for msg in (sw.StageWireMessage.stop(1, 2, version=version),
                sw.StageWireMessage.configure_generation(1, 2, 4, version=version)):
        read, _ = protocol.read_from_buffer(protocol.write(msg))
        assert (read.kind, read.state.version, read.session_id) == (msg.kind, version, 2)


@pytest.mark.parametrize("value, word", [(True, 1), (False, 0), (1, 1), (0, 0), (np.True_, 1), (np.False_, 0)])
def test_ignore_eos_takes_a_bool_or_0_and_1(impl, value, word):
    data = sw.write_stage_message(_message(**{"sampling.ignore_eos": value}), impl=impl)
    assert struct.unpack_from("<I", data, 80 + sw.SamplingConfig().wire_bytes() - 4)[0] == word
    assert both(lambda i: sw.write_stage_message(_message(**{"sampling.ignore_eos": value}), impl=i))[1] == data


@pytest.mark.parametrize("value, bits", [(1e300, 0x7F800000), (-1e39, 0xFF800000), (math.inf, 0x7F800000),
                                         (float("nan"), 0x7FC00000), (np.float32(0.5), 0x3F000000), (2, 0x40000000),
                                         (Decimal("-1e39"), 0xFF800000), (Fraction(10**50, 3), 0x7F800000)])
def test_an_f32_field_takes_any_real_number(impl, value, bits):
    """A finite value beyond f32::MAX rounds to infinity (IEEE, as upstream's ``as f32``)."""
    data = sw.write_stage_message(_message(**{"sampling.temperature": value}), impl=impl)
    assert struct.unpack_from("<I", data, 80 + 8)[0] == bits
    assert both(lambda i: sw.write_stage_message(_message(**{"sampling.temperature": value}), impl=i))[1] == data


def test_integer_likes_are_still_integers(impl):
    msg = _message(kind=W.PREFILL_EMBD, tokens=np.array([7, 8], np.int32), positions=array.array("i", [0, 1]),
                   request_id=np.uint64(1), **{"state.seq_id": np.int16(3)})
    data = sw.write_stage_message(msg, impl=impl)
    assert sw.read_stage_message(data, 4, impl=impl).tokens == [7, 8]


@pytest.mark.parametrize("changes, text", [
    ({"pos_start": 10**5000}, "pos_start value <an int of 16610 bits> does not fit its wire type"),
    ({"sampling.temperature": list(range(10**6))},
     "sampling.temperature value [0, 1, 2, 3, 4, 5, ...] is not a number"),
    ({"tokens": [1, "x" * 10**6]}, f"tokens value '{'x' * 37}...{'x' * 38}' does not fit its wire type"),
    ({"sampling.top_p": bytes(10**6)},
     "sampling.top_p value <1000000 bytes: b'" + "\\x00" * 16 + "'...> is not a number"),
])
def test_an_error_shows_a_huge_value_cut_short(changes, text):
    """The text held the whole value (7.9 MB for a million-item list), and an int past
    Python's printable digits lost the field's name."""
    assert both(lambda i: sw.write_stage_message(_message(**changes), impl=i)) == (InvalidInputError, text)


REPLY_MISTAKES = [
    (dict(predicted=True), "predicted value True does not fit its wire type"),
    (dict(predicted_tokens=b"AB"), "predicted_tokens must be a sequence of ints, not bytes"),
    (dict(predicted_tokens=(t for t in [1])), "predicted_tokens must be a sequence of ints, not generator"),
    (dict(predicted_tokens=[1, False]), "predicted_tokens value False does not fit its wire type"),
    (dict(window=sw.StageReplyWindow(True)), "window.window_id value True does not fit its wire type"),
    (dict(native_mtp_draft=sw.NativeMtpDraft(b"\x01")),
     "native_mtp_draft.token_ids must be a sequence of ints, not bytes"),
]


@pytest.mark.parametrize("changes, text", REPLY_MISTAKES, ids=[t for _, t in REPLY_MISTAKES])
def test_a_reply_field_of_the_wrong_type_is_named(impl, changes, text):
    def write(i):
        return sw.write_reply(sw.StageReply(sw.WireReplyKind.PREDICTED_TOKENS, **{"predicted": 1, **changes}), impl=i)

    with pytest.raises(InvalidInputError) as info:
        write(impl)
    assert str(info.value) == text
    assert both(write) == (InvalidInputError, text)


# --- codecs: buffers ---------------------------------------------------------------------------
F32 = np.arange(4, dtype=np.float32)
F32_CALLS = {
    "encode_activation": lambda k, p: k.encode_activation(3, 1, 4, p, 0),
    "encode_f32_activation_payload": lambda k, p: k.encode_f32_activation_payload(1, 4, p, 0),
    "select_lossless_codec": lambda k, p: k.select_lossless_codec(1, 4, p, 0, [1, 3]),
    "select_and_encode_lossless": lambda k, p: k.select_and_encode_lossless(1, 4, p, 0, [1, 3]),
    "is_bf16_exact": lambda k, p: k.is_bf16_exact(p),
    "is_f16_exact": lambda k, p: k.is_f16_exact(p),
}
ALL_CALLS = {**F32_CALLS, "decode_activation": lambda k, p: k.decode_activation(1, 1, 4, p, 0)}


@pytest.mark.parametrize("call", sorted(ALL_CALLS))
@pytest.mark.parametrize("obj, name", [([0.0] * 4, "list"), ("abcd", "str"), (None, "NoneType"), (3, "int")])
def test_an_object_without_a_buffer_is_the_same_type_error(codec_impl, call, obj, name):
    with pytest.raises(TypeError) as info:
        ALL_CALLS[call](codec_impl, obj)
    assert str(info.value) == f"a bytes-like object is required, not {name!r}"
    assert both(lambda i: ALL_CALLS[call](kernel_module("codec", i), obj)) == (
        TypeError, str(info.value))


def test_an_out_without_a_buffer_is_the_same_type_error(codec_impl):
    with pytest.raises(TypeError) as info:
        codec_impl.encode_activation(1, 1, 4, F32, 0, out=[0] * 16)
    assert str(info.value) == "a bytes-like object is required, not 'list'"


WRONG_ELEMENTS = [
    (np.arange(2, dtype=np.float64), "dtype float64"),
    (np.arange(4, dtype=np.int32), "dtype int32"),
    (np.arange(4, dtype=np.int64)[:2], "dtype int64"),
    (F32.astype(">f4"), "dtype >f4"),
    (F32.astype(">u4"), "dtype >u4"),
    (np.arange(8, dtype=np.float16), "dtype float16"),
    (np.arange(8).astype(ml_dtypes.bfloat16), "dtype bfloat16"),
    (np.zeros(16, dtype=bool), "dtype bool"),
    (memoryview(np.zeros(2)), "format 'd'"),
    (array.array("d", [0.0, 1.0]), "format 'd'"),
    (array.array("i", [0, 1, 2, 3]), "format 'i'"),
    (array.array("H", range(8)), "format 'H'"),
]


@pytest.mark.parametrize("call", sorted(F32_CALLS))
@pytest.mark.parametrize("payload, what", WRONG_ELEMENTS, ids=[w for _, w in WRONG_ELEMENTS])
def test_f32_input_of_another_element_type_is_refused_naming_it(codec_impl, call, payload, what):
    with pytest.raises(InvalidInputError) as info:
        F32_CALLS[call](codec_impl, payload)
    assert str(info.value) == f"payload must be little-endian f32 values or raw bytes, not {what}"
    assert both(lambda i: F32_CALLS[call](kernel_module("codec", i), payload)) == (
        InvalidInputError, str(info.value))


def _f32_exporters():
    raw = F32.tobytes()
    yield "bytes", raw
    yield "bytearray", bytearray(raw)
    yield "memoryview-B", memoryview(raw)
    yield "memoryview-c", memoryview(raw).cast("c")
    yield "memoryview-f", memoryview(raw).cast("f")
    yield "memoryview-I", memoryview(raw).cast("I")
    yield "array-f", array.array("f", F32.tolist())
    yield "ndarray-f32", F32
    yield "ndarray-<f4", F32.astype("<f4")
    yield "ndarray-u32", F32.view(np.uint32)
    yield "ndarray-u8", F32.view(np.uint8)
    yield "ndarray-i8", F32.view(np.int8)
    yield "ctypes-f", (ctypes.c_float * 4)(*F32.tolist())
    yield "ctypes-ubyte", (ctypes.c_ubyte * 16).from_buffer_copy(raw)


@pytest.mark.parametrize("call", sorted(F32_CALLS))
def test_f32_values_bit_patterns_and_raw_bytes_are_accepted(codec_impl, call):
    want = F32_CALLS[call](codec_impl, F32.tobytes())
    for name, payload in _f32_exporters():
        assert F32_CALLS[call](codec_impl, payload) == want, name


def test_a_wire_payload_is_any_buffer_of_bytes(codec_impl):
    wire = codec_impl.encode_activation(1, 1, 4, F32, 0)
    for payload in (np.frombuffer(wire, np.float64), array.array("d", np.frombuffer(wire, np.float64).tolist()),
                    np.frombuffer(wire, np.int32), np.frombuffer(wire, ">f4")):
        assert codec_impl.decode_activation(1, 1, 4, payload, 0).tobytes() == wire
    out = np.zeros(2, np.float64)  # ``out`` takes any dtype: its bytes count
    assert bytes(codec_impl.encode_activation(1, 1, 4, F32, 0, out=out)) == wire[:16]


def _prefill(version: int):
    state = sw.StageStateHeader.new(W.PREFILL_EMBD, version)
    state.source_stage_index = -1
    return sw.StageWireMessage(W.PREFILL_EMBD, 0, 1, state, 7, 9, sw.SamplingConfig(), tokens=[7], positions=[0])


@pytest.mark.parametrize("version", [15, 16, 17])
@pytest.mark.parametrize("edit, text", [
    (lambda m: setattr(m.state, "source_stage_index", "0"), "state.source_stage_index value '0' does not fit its wire type"),
    (lambda m: setattr(m, "state", None), "state must be a StageStateHeader, not NoneType"),
    # an iterator would be used up measuring it: the compiled writer wrote an empty list
    (lambda m: setattr(m.sampling, "samplers", map(str, ["top_k"])), "sampling.samplers must be a list of strings, not map"),
    (lambda m: setattr(m.sampling, "dry_sequence_breakers", (s for s in ["\n"])),
     "sampling.dry_sequence_breakers must be a list of strings, not generator"),
    (lambda m: setattr(m.sampling, "samplers", "top_k"), "sampling.samplers must be a list of strings, not a single string"),
])
def test_every_version_names_a_state_or_string_list_of_the_wrong_shape(version, edit, text):
    def write(impl):
        msg = _prefill(version)
        edit(msg)
        return WireProtocol(version, impl=impl).write(msg)
    assert both(write) == (InvalidInputError, text)


@pytest.mark.parametrize("edit, outcome", [
    (lambda p: setattr(p, "flags", np.uint32(0)), "ok"),  # the twin overflowed in ~flags
    (lambda p: setattr(p, "dimensions", (np.int8(4), np.int8(2), 1, 1)), "ok"),
    (lambda p: setattr(p, "dimensions", None), "parts[0].dimensions"),  # compiled: blamed flags
    (lambda p: setattr(p, "byte_strides", 4), "parts[0].byte_strides"),
])
def test_descriptor_integers_of_numpy_types_and_axes_that_are_no_sequence(edit, outcome):
    def encode(impl):
        desc = ActivationFrameV16.of_parts([ActivationPartV16.dense(b"\x01" * 32, 0, [4, 2], 1)], token_count=2)
        edit(desc.parts[0])
        return WireProtocol(16, impl=impl).encode_frame(1, desc, bytes(32))
    got = both(encode)
    if outcome == "ok":
        assert got[0] == "ok"
    else:
        assert got == (InvalidInputError, f"activation frame descriptor field out of range: {outcome}")


@pytest.mark.parametrize("n_embd", [2**31, 2**63, -(2**63) - 1])
def test_an_n_embd_of_any_size_beyond_i32_is_named(n_embd):
    data = sw.write_stage_message(sw.StageWireMessage.stop(1, 1))
    assert both(lambda i: sw.read_stage_message_from_buffer(data, n_embd, impl=i)) == \
        (InvalidInputError, "n_embd does not fit in i32")


class _Tensor:
    """A value whose conversion to float fails as a multi-element tensor's does."""

    def __float__(self):
        raise RuntimeError("a Tensor with 2 elements cannot be converted to Scalar")

    def __repr__(self):
        return "tensor([1., 2.])"


def test_an_f32_value_whose_conversion_fails_is_named_whatever_it_raises():
    def write(impl):
        msg = _prefill(15)
        msg.sampling.temperature = _Tensor()
        return sw.write_stage_message(msg, impl=impl)
    assert both(write) == (InvalidInputError, "sampling.temperature value tensor([1., 2.]) is not a number")


# --- v16 descriptors: parts and version of the wrong type ------------------------------------
@pytest.mark.parametrize("edit, name", [
    (lambda d: setattr(d, "parts", {0: d.parts[0]}), "parts"),  # compiled: encoded it, the twin: AttributeError
    (lambda d: setattr(d, "parts", set(range(1))), "parts"),  # compiled: blamed payload_bytes
    (lambda d: setattr(d, "parts", None), "parts"),
    (lambda d: setattr(d, "parts", 1), "parts"),
    (lambda d: setattr(d, "parts", ["x"]), "parts[0]"),
    (lambda d: setattr(d, "parts", [d.parts[0], 7]), "parts[1]"),
    (lambda d: setattr(d, "version", np.array([16, 16])), "version"),  # ValueError (truth value of an array)
])
@pytest.mark.parametrize("call", sorted(FRAME_CALLS))
def test_descriptor_parts_or_version_of_the_wrong_type_are_named(call, edit, name):
    def run(impl):
        desc = ActivationFrameV16.of_parts([ActivationPartV16.dense(b"\x01" * 32, 0, [4, 2], 1)], token_count=2)
        edit(desc)
        return FRAME_CALLS[call](WireProtocol(16, impl=impl), desc)
    assert both(run) == (InvalidInputError, f"activation frame descriptor field out of range: {name}")


def test_descriptor_parts_may_be_a_tuple():
    def run(impl):
        desc = ActivationFrameV16.of_parts([ActivationPartV16.dense(b"\x01" * 32, 0, [4, 2], 1)], token_count=2)
        desc.parts = tuple(desc.parts)
        return WireProtocol(16, impl=impl).encode_frame(1, desc, bytes(32))
    assert both(run)[0] == "ok"


# --- v17 message_wire_bytes: the writer's error for a field of the wrong type ----------------
@pytest.mark.parametrize("edit", [
    lambda m: setattr(m, "chat_sampling_metadata", b"{}"),
    lambda m: setattr(m, "sampling", 5),
    lambda m: setattr(m, "sampling", {}),
    lambda m: setattr(m, "tokens", (t for t in [7])),
    lambda m: setattr(m, "positions", 0),
    lambda m: setattr(m.sampling, "logit_bias", 5),
])
def test_message_wire_bytes_names_a_field_as_the_writer_does(edit):
    # before: AttributeError / TypeError out of estimated_wire_bytes
    def message():
        msg = _prefill(17)
        edit(msg)
        return msg
    written = both(lambda i: WireProtocol(17, impl=i).write(message()))
    assert written[0] is InvalidInputError
    assert both(lambda i: WireProtocol(17, impl=i).message_wire_bytes(message())) == written


@pytest.mark.parametrize("view", ["bf16_view", "f16_view"])
@pytest.mark.parametrize("obj, name", [([0, 0], "list"), ("ab", "str"), (None, "NoneType")])
def test_the_wire_views_refuse_an_object_without_a_buffer_in_the_same_words(view, obj, name):
    """They said "memoryview: a bytes-like object is required, not 'list'"."""
    with pytest.raises(TypeError) as info:
        getattr(codec, view)(obj)
    assert str(info.value) == f"a bytes-like object is required, not {name!r}"
