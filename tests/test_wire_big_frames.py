"""Frame size limits that only buffers of hundreds of MiB reach (slow).

The v16/v17 readers return an activation re-encoded with RawF32V1 (wire-v16-v17.md
A.7.4 step 4, B.7.3), and that encode keeps A.6.1's 512 MiB frame limit: a BF16 frame of
256 MiB decodes to a RawF32V1 frame over it, which upstream refuses.  Both twins used to
return the 512 MiB frame.

Lossless selection (A.6.4) sizes the frame of every codec that passes the lossless test, and
an error there propagates, as upstream's does: the twins used to skip a codec whose frame
size failed.
"""

from __future__ import annotations

import pytest

from conftest import IMPLS
from skippy_wire.errors import InvalidDataError
from skippy_wire.wire import _codec as compiled_codec
from skippy_wire.wire._reference import frame_v16 as reference_frame
from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16
from skippy_wire.wire.messages import StageStateHeader, StageWireMessage
from skippy_wire.wire.protocol import kernels

RAW, BF16, S8 = 1, 3, 4
COLUMNS = 2**26  # x 2 tokens x 4 bytes: exactly 512 MiB decoded, the most a frame may hold


@pytest.fixture(autouse=True)
def compiled_part_codec(monkeypatch):
    """The reference twin's frame code over the compiled part codec: what is tested here is
    the frame logic, and the reference codec takes minutes on these sizes (the codecs' own
    agreement is tested elsewhere)."""
    monkeypatch.setattr(reference_frame, "_codec", compiled_codec)


def _message(columns: int) -> bytes:
    k = kernels("cython")  # the same bytes as the reference twin's, in a fraction of the time
    payload_bytes = 8 * columns
    part = ActivationPartV16(b"\x01" * 32, 0, 2, 1, 0, (columns, 2, 1, 1),
                             (4, 4 * columns, payload_bytes, payload_bytes), 0, payload_bytes)
    desc = ActivationFrameV16(2, 0, 0, 4, 2, 1, payload_bytes, b"\x03" * 32, [part])
    state = StageStateHeader.new(2, 16)
    state.source_stage_index, state.activation_codec = 0, BF16
    message = StageWireMessage(2, 0, 2, state, 1, 1, None, None)
    message.activation = k.encode_frame(BF16, desc, bytes(payload_bytes))
    return k.write_stage_message(16, message, None)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_a_bf16_frame_that_doubles_past_512_mib_is_refused(impl):
    data = _message(COLUMNS)
    with pytest.raises(InvalidDataError, match="^activation frame wire byte count exceeds maximum$"):
        kernels(impl).read_stage_message_from_buffer(16, data, None, 0, 0, None)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_one_under_the_limit_is_read(impl):
    # 512 columns fewer: the RawF32V1 frame is 4 KiB under the limit with its 196-byte header
    message, _ = kernels(impl).read_stage_message_from_buffer(16, _message(COLUMNS - 512), None, 0, 0, None)
    assert len(message.activation) == 68 + 128 + 8 * (COLUMNS - 512)


@pytest.mark.slow
@pytest.mark.parametrize("impl", IMPLS)
def test_selection_propagates_a_lossless_codecs_frame_size_error(impl):
    # two 1-wide F32 parts of zeros: S8 is lossless but 5 wire bytes per 4, so its frame
    # (540 MB) exceeds the limit that RawF32V1's (432 MB) keeps
    tokens = 54_000_000
    parts = [ActivationPartV16(bytes([i + 1]) * 32, 0, 2, 1, 0, (1, tokens, 1, 1),
                               (4, 4, 4 * tokens, 4 * tokens), 4 * tokens * i, 4 * tokens) for i in range(2)]
    desc = ActivationFrameV16(2, 0, 0, 4, tokens, 1, 8 * tokens, b"\x03" * 32, parts)
    payload = bytes(8 * tokens)
    with pytest.raises(InvalidDataError, match="^activation frame wire byte count exceeds maximum$"):
        kernels(impl).select_frame_codec(desc, payload, [RAW, S8])
    assert kernels(impl).select_frame_codec(desc, payload, [RAW, BF16]) == BF16  # BF16 still fits
