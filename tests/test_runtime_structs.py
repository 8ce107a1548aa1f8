"""The pure-Python parts of the stage adapter: the packed C struct layouts, the sampling
config (and its conversion from the wire's), the native MTP draft, error texts, and the
conversion of wire activations into backend frames."""

from __future__ import annotations

import pickle
import struct

import pytest

from skippy_wire.stage import runtime as rt
from skippy_wire.stage.runtime import (
    ACTIVATION_BOUNDARY_DESC_BYTES,
    ACTIVATION_DESC_BYTES,
    MTP_DRAFT_BYTES,
    SAMPLING_CONFIG_BYTES,
    ActivationBoundaryDesc,
    ActivationDesc,
    ActivationFrameError,
    ActivationPartDesc,
    NativeMtpDraft,
    PartialBatchExecution,
    RuntimeSamplingConfig,
    SamplingConfigError,
    StageRuntimeError,
    Status,
    frame_from_wire,
    frontier_identity_of,
    llama_residual_identity,
    mtp_draft_from_bytes,
    pack_mtp_draft,
)
from skippy_wire.wire import messages, replies


# --- C layouts ------------------------------------------------------------------------------


def test_struct_sizes():
    assert len(ActivationDesc().to_bytes()) == ACTIVATION_DESC_BYTES == 2120
    assert len(ActivationPartDesc().to_bytes()) == 128
    assert len(ActivationBoundaryDesc().to_bytes()) == ACTIVATION_BOUNDARY_DESC_BYTES == 2088
    assert len(RuntimeSamplingConfig().to_bytes()) == SAMPLING_CONFIG_BYTES == 2352
    assert len(pack_mtp_draft(True, [1])) == MTP_DRAFT_BYTES == 56


def test_activation_desc_offsets():
    parts = [ActivationPartDesc() for _ in range(16)]
    parts[1] = ActivationPartDesc(
        identity=bytes(range(32)), ggml_type=30, rank=3, token_axis=-2, flags=1,
        dimensions=(5, -1, 7, 8), byte_strides=(2, 10, 20, 40), payload_offset=99, payload_bytes=123,
    )
    desc = ActivationDesc(version=2, producer_stage_index=-1, layer_start=3, layer_end=9, token_count=11,
                          sequence_count=1, part_count=2, payload_bytes=2**40, frontier_identity=b"\xab" * 32,
                          parts=parts)
    raw = desc.to_bytes()
    assert struct.unpack_from("<IiiiIIII", raw, 0) == (2, -1, 3, 9, 11, 1, 2, 0)
    assert struct.unpack_from("<Q", raw, 32) == (2**40,)
    assert raw[40:72] == b"\xab" * 32
    part = 72 + 128
    assert raw[part : part + 32] == bytes(range(32))
    assert struct.unpack_from("<IIiI", raw, part + 32) == (30, 3, -2, 1)
    assert struct.unpack_from("<4q", raw, part + 48) == (5, -1, 7, 8)
    assert struct.unpack_from("<4Q", raw, part + 80) == (2, 10, 20, 40)
    assert struct.unpack_from("<QQ", raw, part + 112) == (99, 123)
    assert ActivationDesc.from_bytes(raw) == desc


def test_empty_descriptor_is_version_0_producer_minus_1():
    raw = ActivationDesc.empty().to_bytes()
    assert struct.unpack_from("<Ii", raw, 0) == (0, -1)
    assert raw[8:] == bytes(len(raw) - 8)


def test_boundary_offsets_round_trip():
    boundary = ActivationBoundaryDesc(2, 1, b"\x11" * 32)
    boundary.parts[0] = ActivationPartDesc(ggml_type=0, rank=2, token_axis=1, dimensions=(64, -1, 0, 0))
    raw = boundary.to_bytes()
    assert struct.unpack_from("<II", raw, 0) == (2, 1)
    assert raw[8:40] == b"\x11" * 32
    assert struct.unpack_from("<4q", raw, 40 + 48) == (64, -1, 0, 0)
    assert ActivationBoundaryDesc.from_bytes(raw) == boundary


def test_sampling_struct_offsets():
    config = RuntimeSamplingConfig(
        enabled=True, ignore_eos=True, seed=42, temperature=0.5, top_p=0.9, top_k=40, min_p=0.05,
        presence_penalty=0.25, frequency_penalty=0.125, repeat_penalty=1.5, penalty_last_n=64,
        logit_bias=[(5, -1.5), (7, 2.0)], typical_p=0.75, top_nsigma=2.0, dynatemp_range=0.5,
        dynatemp_exponent=1.5, dry_multiplier=0.8, dry_base=2.0, dry_allowed_length=3,
        dry_penalty_last_n=32, dry_sequence_breakers=["\n", "ab"], xtc_probability=0.25,
        xtc_threshold=0.5, mirostat_mode=2, mirostat_entropy=6.0, mirostat_learning_rate=0.2,
        samplers=["top_k", "typ_p", "temp"],
    )
    raw = config.to_bytes()
    assert struct.unpack_from("<IIIii", raw, 0) == (2, 3, 42, 40, 64)
    assert struct.unpack_from("<5f", raw, 20) == (0.5, pytest.approx(0.9), 0.25, 0.125, 1.5)
    assert struct.unpack_from("<I", raw, 40) == (2,)
    assert struct.unpack_from("<f", raw, 44) == (pytest.approx(0.05),)
    assert struct.unpack_from("<5f", raw, 48) == (0.75, 2.0, 0.5, 1.5, pytest.approx(0.8))
    assert struct.unpack_from("<fii", raw, 68) == (2.0, 3, 32)
    assert struct.unpack_from("<ffiff", raw, 80) == (0.25, 0.5, 2, 6.0, pytest.approx(0.2))
    assert struct.unpack_from("<I", raw, 100) == (3,)
    assert struct.unpack_from("<4I", raw, 104) == (4, 5, 9, 0)
    assert struct.unpack_from("<II", raw, 168) == (1, 2)
    assert raw[176:192] == b"\n" + bytes(15)
    assert raw[192:208] == b"ab" + bytes(14)
    assert raw[208:304] == bytes(96)
    assert struct.unpack_from("<ifif", raw, 304) == (5, -1.5, 7, 2.0)
    assert raw[320:] == bytes(SAMPLING_CONFIG_BYTES - 320)


def test_default_sampling_is_disabled_with_upstream_defaults():
    raw = RuntimeSamplingConfig().to_bytes()
    assert struct.unpack_from("<IIIii", raw, 0) == (2, 0, 0, 0, -1)
    assert struct.unpack_from("<I", raw, 100) == (9,)
    assert struct.unpack_from("<9I", raw, 104) == (1, 2, 3, 4, 5, 6, 7, 8, 9)
    assert struct.unpack_from("<I", raw, 172) == (4,)


@pytest.mark.parametrize(
    "config, text",
    [
        (RuntimeSamplingConfig(logit_bias=[(1, 0.0)] * 257), "sampling logit_bias exceeds the native limit"),
        (RuntimeSamplingConfig(samplers=["top_k"] * 17), "sampling sampler order exceeds the native limit"),
        (RuntimeSamplingConfig(dry_sequence_breakers=["a"] * 9),
         "sampling DRY sequence breakers exceed the native count limit"),
        (RuntimeSamplingConfig(dry_sequence_breakers=["a" * 16]),
         "sampling DRY sequence breaker exceeds the native byte limit"),
        (RuntimeSamplingConfig(samplers=["greedy"]), 'sampling sampler order contains "greedy"'),
        # a text is no list: it was read as its characters ("t" no sampler; "abc" three breakers)
        (RuntimeSamplingConfig(samplers="top_k"), "sampling samplers must be a list, not str"),
        (RuntimeSamplingConfig(dry_sequence_breakers="abc"), "sampling dry_sequence_breakers must be a list, not str"),
        (RuntimeSamplingConfig(samplers=None), "sampling samplers must be a list, not NoneType"),
        (RuntimeSamplingConfig(dry_sequence_breakers=["\n", 5]), "sampling dry_sequence_breakers must be a list of strings"),
        # a token id that is no integer: int() made 7.9 and "7" token 7, True token 1
        (RuntimeSamplingConfig(logit_bias=[(7.9, 1.0)]), "sampling logit_bias token id 7.9 is not an integer"),
        (RuntimeSamplingConfig(logit_bias=[("7", 1.0)]), "sampling logit_bias token id '7' is not an integer"),
        (RuntimeSamplingConfig(logit_bias=[(True, 1.0)]), "sampling logit_bias token id True is not an integer"),
    ],
)
def test_sampling_validation_errors(config, text):
    with pytest.raises(SamplingConfigError) as info:
        config.to_bytes()
    assert str(info.value) == text
    assert isinstance(info.value, ValueError) and isinstance(info.value, RuntimeError)


def test_sampling_limits_are_inclusive():
    # every list at its limit, each entry whole in the struct (a breaker of 15 bytes and its NUL)
    raw = RuntimeSamplingConfig(logit_bias=[(1, 0.5)] * 255 + [(9, -2.0)], samplers=["top_k"] * 15 + ["temp"],
                                dry_sequence_breakers=["x" * 14 + str(i) for i in range(8)]).to_bytes()
    assert len(raw) == SAMPLING_CONFIG_BYTES
    assert struct.unpack_from("<I", raw, 40) == (256,) and struct.unpack_from("<I", raw, 100) == (16,)
    assert struct.unpack_from("<16I", raw, 104) == (4,) * 15 + (9,)
    assert struct.unpack_from("<I", raw, 172) == (8,)
    assert [raw[176 + 16 * i:192 + 16 * i] for i in range(8)] == [b"x" * 14 + str(i).encode() + b"\0"
                                                                  for i in range(8)]
    assert struct.unpack_from("<if", raw, 304) == (1, 0.5) and struct.unpack_from("<if", raw, 304 + 8 * 255) == (9, -2.0)


def test_sampling_from_wire_config():

    wire = messages.SamplingConfig(flags=3, seed=9, temperature=0.5, top_k=7, logit_bias=[(3, 1.0)])
    config = RuntimeSamplingConfig.from_wire(wire)
    assert config.enabled and config.ignore_eos
    assert (config.seed, config.temperature, config.top_k) == (9, 0.5, 7)
    assert list(config.logit_bias) == [(3, 1.0)]
    assert rt.sampling_to_bytes(wire) == config.to_bytes()
    assert not RuntimeSamplingConfig.from_wire(messages.SamplingConfig()).enabled


def test_sampling_from_wire_accepts_raw_f32_bits():
    class Wire:
        flags = 1
        temperature = 0x3F000000  # 0.5 as bits

    assert RuntimeSamplingConfig.from_wire(Wire()).temperature == 0.5


@pytest.mark.parametrize(
    "version, available, count, expected",
    [(1, True, 2, (11, 12)), (1, True, 12, tuple(range(11, 19))), (1, False, 2, None),
     (2, True, 2, None), (1, True, 0, None), (1, True, -1, None)],
)
def test_native_mtp_draft_from_raw_filtering(version, available, count, expected):
    raw = pack_mtp_draft(available, list(range(11, 19)), 77, version=version, token_count=count)
    draft = mtp_draft_from_bytes(raw)
    if expected is None:
        assert draft is None
    else:
        assert draft == NativeMtpDraft(list(expected), 77)
        assert draft is None or type(draft) is replies.NativeMtpDraft  # one draft type, the wire's


def test_status_error_text():
    assert str(StageRuntimeError.from_native(2, "session and at least one token are required")) == (
        "InvalidArgument: session and at least one token are required")
    assert str(StageRuntimeError.from_native(4, None)) == "BufferTooSmall"
    assert str(StageRuntimeError.from_native(99, "odd")) == "Status(99): odd"
    error = StageRuntimeError.from_native(7, "context full")
    assert error.status is Status.RUNTIME_ERROR and error.message == "context full"
    assert isinstance(error, RuntimeError)


# --- frame conversions ------------------------------------------------------------------------


def test_frame_from_wire_builds_the_backend_frame():
    payload = struct.pack("<8f", *range(8))
    frame = frame_from_wire(payload, 2, 4, 0, 0, 3)
    desc = frame.desc
    assert (desc.version, desc.producer_stage_index, desc.layer_start, desc.layer_end) == (2, 0, 0, 3)
    assert (desc.token_count, desc.sequence_count, desc.part_count, desc.payload_bytes) == (2, 1, 1, 32)
    part = desc.parts[0]
    assert (part.ggml_type, part.rank, part.token_axis) == (0, 2, 1)
    assert part.dimensions == (4, 2, 0, 0) and part.byte_strides == (4, 16, 0, 0)
    assert part.identity == llama_residual_identity(4)
    assert desc.frontier_identity == frontier_identity_of(desc.parts[:1])
    frame.validate_payload_len()
    with pytest.raises(ActivationFrameError):
        frame_from_wire(payload, 3, 4, 0, 0, 3)
    with pytest.raises(ActivationFrameError, match="sidebands"):
        frame_from_wire(payload, 2, 4, 0, 0, 3, flags=1)


def test_frame_from_wire_copies_boundary_identities():
    boundary = ActivationBoundaryDesc(2, 1, b"\x22" * 32)
    boundary.parts[0] = ActivationPartDesc(identity=b"\x33" * 32, rank=2, token_axis=1, dimensions=(4, -1, 0, 0))
    frame = frame_from_wire(bytes(16), 1, 4, 0, 0, 1, boundary=boundary)
    assert frame.desc.parts[0].identity == b"\x33" * 32 and frame.desc.frontier_identity == b"\x22" * 32


@pytest.mark.parametrize("token_count, n_embd, text", [
    (-1, 4, "activation token count -1 is negative"),
    (-4, 64, "activation token count -4 is negative"),
    (-1, -4, "activation token count -1 is negative"),  # 16 bytes would "match" -1 x -4
    (2**32, 4, "activation token count 4294967296 exceeds 4294967295"),  # the descriptor's u32
    (1.0, 4, "activation token count must be an integer, not float"),
    ("1", 4, "activation token count must be an integer, not str"),
    (1, 0, "activation row width n_embd 0 is not positive"),
    (1, -4, "activation row width n_embd -4 is not positive"),
    (0, 2**62, "activation row width n_embd 4611686018427387904 exceeds 2305843009213693951"),
])
def test_frame_from_wire_refuses_impossible_counts_by_name(token_count, n_embd, text):
    # The count is refused as such, before any byte size is derived from it (a negative count
    # used to read "... does not match -1 tokens x 4 f32 (-16 bytes)").
    for build in (frame_from_wire, rt.packed_frame_from_wire):
        with pytest.raises(ActivationFrameError) as error:
            build(bytes(16), token_count, n_embd, 0, 0, 3)
        assert str(error.value) == text and error.value.status is None
        assert "\n" not in str(error.value) and "bytes" not in str(error.value)
    # the other refusals read as before
    with pytest.raises(ActivationFrameError, match=r"^activation payload length 16 does not match 2 tokens x 4 f32 "
                                                   r"\(32 bytes\)$"):
        frame_from_wire(bytes(16), 2, 4, 0, 0, 3)
    with pytest.raises(ActivationFrameError, match=r"^activation frame flags 0x1 \(sidebands\) are not supported$"):
        frame_from_wire(bytes(16), -1, 4, 0, 0, 3, flags=1)
    # numpy-style integers are counts like any other
    assert frame_from_wire(bytes(16), IndexOnly(1), IndexOnly(4), 0, 0, 3).desc.token_count == 1


class IndexOnly:
    """An integer by ``__index__`` only (as numpy's are)."""

    def __init__(self, value):
        self.value = value

    def __index__(self):
        return self.value



def test_errors_pickle_with_their_fields():
    error = pickle.loads(pickle.dumps(StageRuntimeError.from_native(2, "bad")))
    assert (error.status, error.message, str(error)) == (Status.INVALID_ARGUMENT, "bad", "InvalidArgument: bad")
    partial = pickle.loads(pickle.dumps(PartialBatchExecution(3, StageRuntimeError("boom"))))
    assert partial.executed == 3 and str(partial) == "batch executed 3 request(s) before failing: boom"
    assert isinstance(pickle.loads(pickle.dumps(SamplingConfigError("x"))), SamplingConfigError)


def test_sampler_defaults_are_the_wires():
    config = RuntimeSamplingConfig()
    assert config.samplers == messages.DEFAULT_SAMPLERS
    assert config.dry_sequence_breakers == messages.DEFAULT_DRY_SEQUENCE_BREAKERS
    wire = messages.SamplingConfig()
    for name, value in vars(config).items():
        if name != "enabled":
            expected = getattr(wire, name)
            assert value == (tuple(expected) if isinstance(expected, list) else expected), name


def test_v16_bridge_carries_every_field_both_ways():
    # The runtime's descriptors are the wire's (ActivationPartDesc is an ActivationPartV16,
    # ActivationDesc shares FrameSpan with ActivationFrameV16): a frame crosses a v16 link and
    # comes back byte for byte, optional bit and axes at or above the rank included.
    from skippy_wire.stage.bridge import frame_from_v16, frame_to_v16
    from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16, FrameSpan

    desc = ActivationDesc.f32_rows(4, 3, producer_stage_index=1, layer_start=2, layer_end=5)
    desc.parts[1] = ActivationPartDesc(identity=b"\x07" * 32, ggml_type=1, rank=1, token_axis=0, flags=1,
                                       dimensions=(3, 9, 8, 7), byte_strides=(2, 6, 5, 4),
                                       payload_offset=48, payload_bytes=6)
    desc.part_count, desc.payload_bytes = 2, 54
    frame = rt.ActivationFrame(desc, bytes(range(54)))
    wire_desc, payload = frame_to_v16(frame)
    assert type(wire_desc) is ActivationFrameV16 and isinstance(desc, FrameSpan)
    assert [type(p) for p in wire_desc.parts] == [ActivationPartV16, ActivationPartV16]
    assert wire_desc.parts[1].optional and wire_desc.parts[1].dimensions == (3, 9, 8, 7)
    back = frame_from_v16(wire_desc, payload)
    assert back.desc.to_bytes() == desc.to_bytes() and back.payload == frame.payload
    assert back.desc.active_parts()[1].is_optional()
    assert back.desc.parts[2] == ActivationPartDesc() and not any(ActivationPartDesc().to_bytes())
