"""``skippy-wire inspect`` for state versions 16 and 17 (and the v17 setup packets).

:func:`detect_protocol` tells the version of a capture from its first bytes: a setup
packet (magic ``0x53545053``) means 17; a stage message says it in its version word
(offset 20); a reply stream that starts with READY is 15 or 16 (replies are the same in
both, so it is dissected as 15).  :func:`dissect_gen` prints every record: setup packets
(Hello, Offer, accept, ready with their JSON), stage messages with their multipart frames
part by part (v17: the agreement comes from the Offer, found in the capture itself or in
its sibling ``-replies.bin`` file), and replies.
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Optional, TextIO

from ..errors import DissectError, WireError
from ..wire.activation_frame import (
    STAGE_STATE_VERSION_V15,
    STAGE_STATE_VERSION_V17,
    GgmlType,
    kind_rust_name,
)
from ..wire.agreement import ActivationAgreement, parse_json
from ..wire.constants import READY_BYTES, ActivationCodec
from ..wire.frame import read_reply_from_buffer
from ..wire.protocol import VERSION_WORD_OFFSET, WireProtocol
from ..wire.setup import SETUP_HEADER_BYTES, SETUP_MAGIC, STAGE_PROTOCOL_GENERATION

_SETUP_NAMES_C = ("Hello", "accept")  # what the connecting side sends, in order
_SETUP_NAMES_S = ("Offer", "ready")


def is_setup_packet(data, offset: int = 0) -> bool:
    return len(data) - offset >= 8 and struct.unpack_from("<II", data, offset) == (SETUP_MAGIC,
                                                                                   STAGE_PROTOCOL_GENERATION)


def detect_protocol(data: bytes, replies: bool) -> int:
    """The state version of a capture (see the module docstring); 15 when it cannot tell."""
    if is_setup_packet(data):
        return STAGE_STATE_VERSION_V17
    if not replies and len(data) >= VERSION_WORD_OFFSET + 4:
        version = struct.unpack_from("<i", data, VERSION_WORD_OFFSET)[0]
        if version in (16, 17):
            return version
    return STAGE_STATE_VERSION_V15


def _setup_packets(data: bytes):
    """``(offset, size, body)`` of the setup packets at the start of ``data``."""
    offset = 0
    while is_setup_packet(data, offset) and len(data) - offset >= SETUP_HEADER_BYTES:
        length = struct.unpack_from("<I", data, offset + 8)[0]
        end = offset + SETUP_HEADER_BYTES + length
        if end > len(data):
            raise DissectError(f"@{offset}: setup packet of {length} bytes truncated ({len(data) - offset} bytes left)")
        yield offset, end - offset, bytes(data[offset + SETUP_HEADER_BYTES:end])
        offset = end


def find_agreement(data: bytes, name: str = "") -> Optional[ActivationAgreement]:
    """The agreement of the Offer in ``data`` or in the sibling replies capture of ``name``."""
    sources = [data]
    if "messages" in Path(name).name:
        sibling = Path(name).with_name(Path(name).name.replace("messages", "replies"))
        if sibling.exists():
            sources.append(sibling.read_bytes())
    for source in sources:
        for _, _, body in _setup_packets(source):
            try:
                value = parse_json(body)
            except ValueError:
                continue
            if isinstance(value, dict) and "agreement" in value:
                return ActivationAgreement.from_json(value["agreement"])
    return None


def _frame_lines(proto: WireProtocol, activation, all_values: bool) -> list:
    desc, payload = proto.decode_frame(ActivationCodec.RAW_F32_V1, activation)
    lines = [f"    frame v{desc.version}: producer {desc.producer_stage_index}  layers {desc.layer_start}.."
             f"{desc.layer_end}  token_count {desc.token_count}  sequence_count {desc.sequence_count}  "
             f"parts {len(desc.parts)}  payload {desc.payload_bytes} bytes  frontier {bytes(desc.frontier_identity)[:8].hex()}.."]
    for i, part in enumerate(desc.parts):
        try:
            type_name = GgmlType(part.ggml_type).name
        except ValueError:
            type_name = str(part.ggml_type)
        lines.append(f"    part {i}: {type_name}  rank {part.rank}  token_axis {part.token_axis}  flags {part.flags}  "
                     f"dims {list(part.dimensions)}  strides {list(part.byte_strides)}  offset {part.payload_offset}  "
                     f"bytes {part.payload_bytes}  identity {bytes(part.identity)[:8].hex()}..")
        if part.ggml_type == GgmlType.F32 and part.payload_bytes:
            chunk = bytes(payload[part.payload_offset:part.payload_offset + part.payload_bytes])
            values = struct.unpack(f"<{len(chunk) // 4}f", chunk)
            shown = values if all_values else values[:8]
            finite = [v for v in values if v == v and abs(v) != float("inf")]
            stats = f"min {min(finite):.6g}  max {max(finite):.6g}  " if finite else ""
            lines.append(f"      {stats}values: {' '.join(f'{v:.6g}' for v in shown)}"
                         f"{' ...' if len(shown) < len(values) else ''}")
    return lines


def describe_gen_message(proto: WireProtocol, msg, offset: int, size: int, index: int, wire_bytes: int,
                         all_values: bool) -> list:
    st = msg.state
    lines = [f"#{index} @{offset} message (state version {st.version}), {size} bytes: "
             f"{kind_rust_name(int(msg.kind))} ({int(msg.kind)})",
             f"  pos_start {msg.pos_start}  token_count {msg.token_count}  tokens {len(msg.tokens)}  "
             f"positions {len(msg.positions)}  request_id {msg.request_id}  session_id {msg.session_id}",
             f"  state: phase {int(st.phase)}  flags 0x{int(st.flags):x}  prompt_token_count {st.prompt_token_count}  "
             f"decode_step {st.decode_step}  current_token {st.current_token}  source_stage_index "
             f"{st.source_stage_index}  activation_codec {ActivationCodec(int(st.activation_codec)).identity()}",
             f"  sampling: {'none' if msg.sampling is None else 'present'}"]
    if msg.tokens:
        lines.append(f"  tokens: {list(msg.tokens)}")
    if len(msg.activation):
        what = "agreement-framed activation" if proto.version == STAGE_STATE_VERSION_V17 else "activation frame"
        lines.append(f"  activation: {what}, {wire_bytes} bytes on the wire")
        lines += _frame_lines(proto, msg.activation, all_values)
    else:
        lines.append("  activation: none")
    return lines


def dissect_gen(data: bytes, protocol: int, *, replies: bool, all_values: bool = False,
                out: Optional[TextIO] = None, name: str = "") -> int:
    """Print every record of a v16/v17 capture; returns the record count."""
    proto = WireProtocol(protocol)
    index = offset = 0
    names = _SETUP_NAMES_S if replies else _SETUP_NAMES_C
    for offset, size, body in list(_setup_packets(data)):
        label = names[index] if index < len(names) else "setup packet"
        text = body.decode("utf-8", "replace")
        print(f"#{index} @{offset} setup {label} (magic 0x{SETUP_MAGIC:08x}, generation "
              f"{STAGE_PROTOCOL_GENERATION}), {size} bytes\n  {text if len(text) < 600 else text[:600] + ' ...'}",
              file=out)
        index += 1
        offset += size
    agreement = find_agreement(data, name) if protocol == STAGE_STATE_VERSION_V17 and not replies else None
    if replies and offset == 0 and data[:4] == READY_BYTES:
        print("#0 @0 READY (magic 0x53524459, 4 bytes)", file=out)
        index, offset = 1, 4
    while offset < len(data):
        try:
            if replies:
                reply, size = read_reply_from_buffer(data, offset=offset)
                print(f"#{index} @{offset} reply, {size} bytes: {reply.kind!r}  predicted {reply.predicted}",
                      file=out)
            else:
                msg, size = proto.read_from_buffer(data, offset=offset, agreement=agreement)
                wire = struct.unpack_from("<i", data, offset + 60)[0]
                print("\n".join(describe_gen_message(proto, msg, offset, size, index, wire, all_values)), file=out)
        except (WireError, EOFError) as exc:
            kind = getattr(exc, "kind", type(exc).__name__)
            raise DissectError(f"#{index} @{offset}: {kind}: {exc} ({len(data) - offset} bytes left)") from exc
        index += 1
        offset += size
    return index


__all__ = ["detect_protocol", "is_setup_packet", "find_agreement", "describe_gen_message", "dissect_gen"]
