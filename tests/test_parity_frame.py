"""The compiled framing (``_frame``) and the reference twin agree on random input: the same
bytes, the same decoded message and consumed count, or the same error class and text
(and, for short input, the same ``needed``; for failed writes, the same partial output).

Random bytes only ever raise WireError subclasses, never anything else."""

from __future__ import annotations

import struct

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from skippy_wire._impl import kernel_module
from skippy_wire.tools.vector_cases import message_to_case
from skippy_wire.wire.constants import ActivationCodec
from skippy_wire.errors import InvalidInputError, WireError
from skippy_wire.wire.messages import F32, SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind
from skippy_wire.wire.replies import NativeMtpDraft, StageReply, StageReplyStats, StageReplyWindow, WireReplyKind

CY = kernel_module("frame", "cython")
PY = kernel_module("frame", "python")
CODEC = kernel_module("codec", "python")

i32 = st.integers(-(2**31), 2**31 - 1)
small_i32 = st.one_of(st.integers(-3, 8), i32)
u64 = st.integers(0, 2**64 - 1)
f32_values = st.one_of(
    st.floats(width=32, allow_nan=False),
    st.integers(0, 2**32 - 1).map(F32),  # arbitrary bit patterns, NaNs included
)
texts = st.text(st.characters(exclude_categories=("Cs",)), max_size=20)


def outcome(fn, *args):
    try:
        result = fn(*args)
    except WireError as exc:
        return ("err", type(exc), str(exc), getattr(exc, "needed", None), getattr(exc, "partial", None))
    if isinstance(result, tuple) and isinstance(result[0], StageWireMessage):
        return ("ok", message_to_case(result[0]), result[1])
    if isinstance(result, tuple) and isinstance(result[0], StageReply):
        return ("ok", result[0], result[1])
    return ("ok", bytes(result))


def read_both(data: bytes, n_embd: int, expected, policy: int):
    a = outcome(CY.read_stage_message_from_buffer, data, n_embd, expected, policy, 0)
    b = outcome(PY.read_stage_message_from_buffer, data, n_embd, expected, policy, 0)
    assert a == b, (data.hex(), n_embd, expected, policy)
    return a


expectations = st.sampled_from([(None, 0), (1, 0), (2, 0), (3, 0), (4, 0), (1, 1)])
n_embds = st.one_of(st.sampled_from([1, 2, 4, 0, -1]), st.integers(-5, 64))


@given(data=st.binary(max_size=400), n_embd=n_embds, exp=expectations)
def test_random_bytes_into_the_reader(data, n_embd, exp):
    read_both(data, n_embd, *exp)


@given(data=st.binary(max_size=64), offset=st.integers(0, 64))
def test_random_bytes_at_an_offset(data, offset):
    assume(offset <= len(data))
    a = outcome(CY.read_stage_message_from_buffer, bytearray(data), 2, None, 0, offset)
    b = outcome(PY.read_stage_message_from_buffer, memoryview(data), 2, None, 0, offset)
    assert a == b


@st.composite
def samplings(draw):
    if draw(st.booleans()):
        return None
    return SamplingConfig(
        flags=draw(st.integers(0, 3)), seed=draw(st.integers(0, 2**32 - 1)), temperature=draw(f32_values),
        top_p=draw(f32_values), top_k=draw(small_i32), penalty_last_n=draw(small_i32),
        logit_bias=draw(st.lists(st.tuples(i32, f32_values), max_size=4)),
        dry_base=draw(f32_values), dry_sequence_breakers=draw(st.lists(texts, max_size=10)),
        samplers=draw(st.lists(st.sampled_from(["top_k", "temperature", "x" * 64, "é" * 33, ""]), max_size=18)),
        ignore_eos=draw(st.booleans()),
    )


@st.composite
def stage_messages(draw):
    kind = draw(st.sampled_from(list(WireMessageKind)))
    state = StageStateHeader.new(kind)
    state.source_stage_index = draw(st.sampled_from([-1, 0, 3]))
    state.flags = draw(st.sampled_from([0, 0x40, 0x80, 0x100, 0x140, 0x28, 0x11, -1]))
    state.activation_codec = draw(st.sampled_from(list(ActivationCodec)))
    state.seq_id, state.decode_step = draw(small_i32), draw(small_i32)
    token_count = draw(st.integers(0, 3))
    width = draw(st.integers(1, 4))
    activation = b""
    if draw(st.booleans()):
        values = draw(st.lists(st.floats(-100, 100, width=32), min_size=token_count * width * 2,
                               max_size=token_count * width * 2))
        payload = struct.pack(f"<{len(values)}f", *values)
        try:
            activation = CODEC.encode_activation(int(state.activation_codec), token_count, width,
                                                 payload[: len(payload) // (1 if state.flags & 0x140 else 2)], state.flags)
        except WireError:
            activation = payload
    if draw(st.booleans()):
        activation = draw(st.binary(max_size=12))
    raw = b""
    if kind == WireMessageKind.STATE_IMPORT:
        raw = draw(st.binary(max_size=6))
        token_count = draw(st.sampled_from([len(raw), len(raw) + 1]))
    msg = StageWireMessage(
        kind, draw(small_i32), token_count, state, draw(u64), draw(u64), draw(samplings()),
        draw(st.one_of(st.none(), texts)), draw(st.lists(i32, max_size=4)), draw(st.lists(i32, max_size=3)),
        activation, raw,
    )
    return msg, width


@settings(suppress_health_check=[HealthCheck.too_slow])
@given(case=stage_messages())
def test_random_messages_write_and_read_alike(case):
    msg, width = case
    written = outcome(CY.write_stage_message, msg)
    assert written == outcome(PY.write_stage_message, msg)
    if written[0] == "ok":
        data = written[1]
        assert len(data) == msg.estimated_wire_bytes()
        for exp in ((None, 0), (int(msg.state.activation_codec), 0), (1, 1)):
            read_both(data, width, *exp)
            read_both(data + b"\x00" * 3, width, *exp)


@given(case=stage_messages(), edits=st.lists(st.tuples(st.integers(0, 400), st.integers(0, 255)), min_size=1, max_size=4),
       cut=st.integers(0, 500), word=st.sampled_from([-1, 0, 1, 2**31 - 1, -(2**31), 1048577, 536870913]))
def test_mutated_valid_frames_read_alike(case, edits, cut, word):
    msg, width = case
    try:
        data = bytearray(PY.write_stage_message(msg))
    except WireError:
        return
    for pos, value in edits:
        if pos < len(data):
            data[pos] ^= value
    read_both(bytes(data), width, None, 0)
    read_both(bytes(data[:cut]), width, int(msg.state.activation_codec), 0)
    slot = (edits[0][0] % 20) * 4  # one of the twenty prefix words overwritten
    if slot + 4 <= len(data):
        data[slot : slot + 4] = struct.pack("<i", word)
        read_both(bytes(data), width, 1, 1)


@st.composite
def replies(draw):
    draft = None
    if draw(st.booleans()):
        draft = NativeMtpDraft(draw(st.lists(i32, max_size=4)), draw(st.integers(-(2**63), 2**63 - 1)))
    stats = StageReplyStats(*draw(st.lists(st.integers(-(2**63), 2**63 - 1), min_size=27, max_size=27)))
    return StageReply(draw(st.sampled_from(list(WireReplyKind))), draw(i32), draw(st.lists(i32, max_size=5)),
                      StageReplyWindow(draw(i32)), draft, stats)


@given(reply=replies(), cut=st.integers(0, 300), flip=st.integers(0, 299))
def test_replies_alike(reply, cut, flip):
    data = outcome(CY.write_reply, reply)
    assert data == outcome(PY.write_reply, reply) and data[0] == "ok"
    raw = bytearray(data[1])
    assert outcome(CY.read_reply_from_buffer, bytes(raw), 0) == ("ok", reply, len(raw))
    assert outcome(PY.read_reply_from_buffer, bytes(raw[:cut]), 0) == outcome(CY.read_reply_from_buffer, bytes(raw[:cut]), 0)
    if flip < len(raw):
        raw[flip] ^= 0xFF
        assert outcome(PY.read_reply_from_buffer, bytes(raw), 0) == outcome(CY.read_reply_from_buffer, bytes(raw), 0)


@given(data=st.binary(max_size=300))
def test_random_bytes_into_the_reply_reader(data):
    assert outcome(PY.read_reply_from_buffer, data, 0) == outcome(CY.read_reply_from_buffer, data, 0)


unrepresentable = st.one_of(st.integers(), st.floats(), st.text(max_size=3), st.none(), st.just(b"x"),
                            st.just(2**40), st.just(-1), st.just(2**64))
MESSAGE_FIELDS = ["kind", "pos_start", "token_count", "request_id", "session_id", "tokens", "positions",
                  "activation", "chat_sampling_metadata", "state.version", "state.flags", "state.source_stage_index",
                  "state.activation_codec", "sampling.seed", "sampling.top_k", "sampling.temperature",
                  "sampling.samplers", "sampling.logit_bias", "sampling.ignore_eos"]
# Each makes the write fail with a WireError at its own step, so a bad value in a later
# step must not be reported first (and one in an earlier step must be).
EARLIER_FAILURES = [None, "too many tokens", "too many positions", "activationless payload", "long sampler"]


def _message_with(field: str, value, failure):
    kind = WireMessageKind.DECODE_EMBD
    msg = StageWireMessage(kind, 0, 1, StageStateHeader.new(kind), sampling=SamplingConfig())
    msg.state.source_stage_index = 0
    msg.activation = bytes(4)
    if failure == "too many tokens":
        msg.tokens = [0] * (2**20 + 1)
    elif failure == "too many positions":
        msg.positions = [0] * (2**20 + 1)
    elif failure == "activationless payload":
        msg.state.source_stage_index = -1
    elif failure == "long sampler":
        msg.sampling.samplers = ["x" * 65]
    owner, _, name = field.rpartition(".")
    target = getattr(msg, owner) if owner else msg
    if name in ("tokens", "positions", "samplers"):
        value = [value]
    elif name == "logit_bias":
        value = [(value, 0.5)]
    setattr(target, name, value)
    return msg


@settings(max_examples=300)
@given(value=unrepresentable, field=st.sampled_from(MESSAGE_FIELDS), failure=st.sampled_from(EARLIER_FAILURES))
def test_unrepresentable_values_fail_alike(value, field, failure):
    """A value the wire cannot represent: the same error (class, text, partial bytes) from
    both implementations, in the same step order relative to the protocol checks."""
    msg = _message_with(field, value, failure)
    assert outcome(CY.write_stage_message, msg) == outcome(PY.write_stage_message, msg)


REPLY_FIELDS = ["kind", "predicted", "predicted_tokens", "window.window_id", "native_mtp_draft.token_ids",
                "native_mtp_draft.proposal_compute_us", "stats.kv_lookup_hits", "stats.prefill_compute_observation_count"]


@settings(max_examples=200)
@given(value=unrepresentable, field=st.sampled_from(REPLY_FIELDS), too_many=st.sampled_from([None, "tokens", "draft"]))
def test_unrepresentable_reply_values_fail_alike(value, field, too_many):
    reply = StageReply(WireReplyKind.PREDICTED_TOKENS, 1, [1], StageReplyWindow(3), NativeMtpDraft([2], 5),
                       StageReplyStats())
    if too_many == "tokens":
        reply.predicted_tokens = [0] * (2**18 + 1)
    elif too_many == "draft":
        reply.native_mtp_draft.token_ids = [0] * (2**18 + 1)
    owner, _, name = field.rpartition(".")
    target = getattr(reply, owner) if owner else reply
    setattr(target, name, [value] if name in ("predicted_tokens", "token_ids") else value)
    assert outcome(CY.write_reply, reply) == outcome(PY.write_reply, reply)


def _failure(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except Exception as exc:  # noqa: BLE001 -- the class is what is compared
        return type(exc)
    return None


def test_arguments_of_the_wrong_kind_fail_alike_in_both_twins():
    """Not wire bytes but a caller's mistakes: an offset no C ssize_t holds, a strided view,
    text where bytes belong fail with the same class in both implementations."""
    gen_cy, gen_py = kernel_module("frame_gen", "cython"), kernel_module("frame_gen", "python")
    message = bytes(160)
    cases = [
        (lambda m: m.read_stage_message_from_buffer, (message, 64), {"offset": 2**70}),
        (lambda m: m.read_stage_message_from_buffer, (memoryview(message * 2)[::2], 64), {}),
        (lambda m: m.read_stage_message_from_buffer, ("x" * 160, 64), {}),
    ]
    for pick, args, kwargs in cases:
        cy, py = _failure(pick(CY), *args, **kwargs), _failure(pick(PY), *args, **kwargs)
        assert cy is not None and cy == py, (args[1:], kwargs, cy, py)
    for data in ("x" * 300, None, memoryview(bytes(600))[::2]):
        cy, py = _failure(gen_cy.decode_frame, 1, data, 16), _failure(gen_py.decode_frame, 1, data, 16)
        assert cy is not None and cy == py, (type(data), cy, py)


@pytest.mark.parametrize("version", [15, 16, 17])
@pytest.mark.parametrize("field", ["samplers", "dry_sequence_breakers"])
def test_a_kernel_writes_a_string_list_given_as_an_iterator_as_its_twin_does(version, field):
    """The compiled writer measured the list before writing it: an iterator was used up by
    the measure, and its strings silently written as none (the public writers refuse one
    before any kernel runs; a kernel's own caller has only the twins' agreement)."""
    def write(impl, values):
        sampling = SamplingConfig()
        setattr(sampling, field, values)
        msg = StageWireMessage(WireMessageKind.STOP, sampling=sampling, state=StageStateHeader(version=version))
        if version == 15:
            return kernel_module("frame", impl).write_stage_message(msg)
        return kernel_module("frame_gen", impl).write_stage_message(version, msg, None)

    for impl in ("cython", "python"):
        assert write(impl, iter(["top_k", "min_p"])) == write(impl, ["top_k", "min_p"]), impl
        with pytest.raises(InvalidInputError, match=f"^sampling.{field} must be a list of strings, not list_iterator$"):
            write(impl, iter([1]))


def test_unknown_admission_arguments_fail_alike_in_both_twins():
    """A kernel reader's expected codec and policy are checked, alike, before any byte: the
    compiled readers took an unknown policy for AutoLosslessV1 (admitting a message the
    reference refused) and an unknown codec for a mismatch on the wire."""
    import json

    from conftest import GOLDEN

    gen = {impl: kernel_module("frame_gen", impl) for impl in ("cython", "python")}
    with (GOLDEN / "v16" / "frame.jsonl").open(encoding="utf-8") as cases:
        first = json.loads(cases.readline())
    v16 = bytes.fromhex(first["write"]["hex"])  # an F16 activation from stage 0
    assert first["message"]["state"]["activation_codec_id"] == 2
    v15 = CY.write_stage_message(StageWireMessage(
        WireMessageKind.PREFILL_EMBD, token_count=1, activation=bytes(8),
        state=StageStateHeader(source_stage_index=0, activation_codec=ActivationCodec.F16_RNE_V1)))
    readers = {"cython": (lambda *a: CY.read_stage_message_from_buffer(v15, 4, *a),
                          lambda *a: gen["cython"].read_stage_message_from_buffer(16, v16, *a)),
               "python": (lambda *a: PY.read_stage_message_from_buffer(v15, 4, *a),
                          lambda *a: gen["python"].read_stage_message_from_buffer(16, v16, *a))}
    for expected, policy, text in ((1, 2, "2 is not a valid CodecPolicy"), (2, -1, "-1 is not a valid CodecPolicy"),
                                   (0, 0, "0 is not a valid ActivationCodec"),
                                   (5, 1, "5 is not a valid ActivationCodec")):
        for impl, pair in readers.items():
            for read in pair:
                with pytest.raises(ValueError) as error:
                    read(expected, policy, 0)
                assert str(error.value) == text and not isinstance(error.value, WireError), (impl, expected, policy)
    for impl, pair in readers.items():  # the known ids still admit as before
        for read in pair:
            assert read(ActivationCodec.F16_RNE_V1, 0, 0)[1] > 0 and read(1, 1, 0)[1] > 0, impl


def test_a_token_list_changed_by_its_own_items_writes_alike():
    """Converting an item may run code (``__index__``) that empties the list being written:
    the compiled writer indexed it unchecked (a segfault); both now write the snapshot."""
    written = []
    for twin in (CY, PY):
        tokens: list = []

        class Shrinking:
            def __index__(self) -> int:
                tokens.clear()
                return 1

        tokens += [Shrinking(), *range(1000)]
        msg = StageWireMessage(WireMessageKind.PREFILL_EMBD, token_count=1, tokens=tokens,
                               state=StageStateHeader(source_stage_index=-1))
        written.append(outcome(twin.write_stage_message, msg))
    assert written[0] == written[1] and written[0][0] == "ok"


def test_an_integer_beyond_f32_is_infinity_in_both_twins():
    # as a float beyond f32::MAX rounds (IEEE RNE); the twin refused an int that large
    for value in (2**128, 10**400, -(2**200)):
        msg = StageWireMessage(WireMessageKind.CONFIGURE_GENERATION,
                               state=StageStateHeader(source_stage_index=-1), sampling=SamplingConfig(top_p=value))
        cy, py = outcome(CY.write_stage_message, msg), outcome(PY.write_stage_message, msg)
        assert cy == py and cy[0] == "ok", value
        assert struct.pack("<f", float("inf") if value > 0 else float("-inf")) in cy[1]


def test_numpy_arrays_as_payloads_and_buffers_are_bytes_alike_or_refused_alike():
    """An array of Python objects exported its objects' addresses as the activation (both
    twins wrote them); an ml_dtypes bfloat16 array (what ``bf16_view`` gives) was written by
    the compiled twin and refused by the reference, whose memoryview() cannot take it."""
    import ml_dtypes
    import numpy as np

    from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16, GgmlType
    from skippy_wire.wire.frame import read_stage_message_from_buffer

    objects = np.array([object(), object()], dtype=object)
    bf16 = np.ones(4, dtype=ml_dtypes.bfloat16)

    def header(activation, codec=0):
        return StageWireMessage(WireMessageKind.PREFILL_EMBD, token_count=1, activation=activation,
                                state=StageStateHeader(source_stage_index=0, activation_codec=codec))

    refused = ("err", InvalidInputError, "activation must be a C-contiguous bytes-like object", None, None)
    for twin in (CY, PY):
        assert outcome(twin.write_stage_message, header(objects))[:3] == refused[:3]
        state_import = StageWireMessage(WireMessageKind.STATE_IMPORT, token_count=16, raw_bytes=objects)
        assert outcome(twin.write_stage_message, state_import)[2] == \
            "raw_bytes must be a C-contiguous bytes-like object"
        assert outcome(twin.write_stage_message, header(bf16, 3)) == outcome(CY.write_stage_message,
                                                                             header(bf16.view(np.uint8), 3))
    wire = CY.write_stage_message(header(bf16, 3))
    for impl in ("cython", "python"):
        as_bf16 = np.frombuffer(wire, np.uint8).view(ml_dtypes.bfloat16)
        read = read_stage_message_from_buffer(as_bf16, 4, impl=impl)
        assert message_to_case(read[0]) == message_to_case(read_stage_message_from_buffer(wire, 4, impl=impl)[0])
        with pytest.raises(InvalidInputError, match="^data must be a C-contiguous buffer$"):
            read_stage_message_from_buffer(np.frombuffer(wire, np.uint8).astype(object), 4, impl=impl)
    desc = ActivationFrameV16.of_parts([ActivationPartV16.dense(b"\x01" * 32, GgmlType.F32, (4, 1), 1)],
                                       token_count=1)
    values = np.arange(4, dtype=np.float32)
    gen_cy, gen_py = kernel_module("frame_gen", "cython"), kernel_module("frame_gen", "python")
    frame = gen_cy.encode_frame(1, desc, values)
    for gen in (gen_cy, gen_py):
        assert gen.encode_frame(1, desc, values.view(ml_dtypes.bfloat16)) == frame
        assert _failure(gen.encode_frame, 1, desc, np.array([object()] * 4, dtype=object)) == InvalidInputError
        as_bf16 = np.frombuffer(frame, np.uint8).view(ml_dtypes.bfloat16)
        assert bytes(gen.decode_frame(1, as_bf16, 16)[1]) == values.tobytes()
        assert _failure(gen.decode_frame, 1, np.frombuffer(frame, np.uint8).astype(object), 16) == InvalidInputError
