"""The v16/v17 readers return an activation re-encoded with RawF32V1 (wire-v16-v17.md
A.7.4 step 4, B.7.3), and that encode keeps A.6.1's 512 MiB frame limit: a BF16 frame of
256 MiB decodes to a RawF32V1 frame over it, which upstream refuses.  Both twins used to
return the 512 MiB frame.  Slow: the message itself is 256 MiB.
"""

from __future__ import annotations

import pytest

from conftest import IMPLS
from skippy_wire.errors import InvalidDataError
from skippy_wire.wire.activation_frame import ActivationFrameV16, ActivationPartV16
from skippy_wire.wire.messages import StageStateHeader, StageWireMessage
from skippy_wire.wire.protocol import kernels

BF16 = 3
COLUMNS = 2**26  # x 2 tokens x 4 bytes: exactly 512 MiB decoded, the most a frame may hold


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
