"""A dissector for captured stage traffic (``skippy-wire inspect FILE|-``).

Input: the bytes of ONE direction of one hop, as written by ``skippy-wire run --capture
DIR`` (``DIR/hopK-messages.bin``: what the upstream side sent; ``DIR/hopK-replies.bin``:
READY then the replies) or by any other recorder (e.g. a tcpdump payload export).

Direction: a stream that starts with the READY magic (``59 44 52 53``) or with a v17 Offer
is the reply direction; otherwise a file whose name contains "replies" is; otherwise it is read as
stage messages.  ``--replies`` / ``--messages`` force it.

Version: state versions 16 and 17 (and the v17 setup packets) are detected from the bytes
and read with :mod:`skippy_wire.tools.inspect_gen`; ``--protocol`` forces one.  Every
version is rendered here, by the same functions for what the versions share (prefix, state
header with phase and flags by name, sampling block, chat metadata, tokens, replies and
their stats); only the activation differs (v15: rows in the message codec; v16/v17: a
frame shown part by part, v17 agreement-framed).

Width: the reader of a v15 stage message needs n_embd (wire-format.md 4.5).  v15 frames
carry the encoded activation byte count (offset 60), so the dissector infers n_embd per
message from that count, the codec id, token_count and the row-doubling sideband flags;
``--n-embd`` overrides the inference (and is then validated like a stage would).

Every field is printed; activations are summarised (codec, sizes, shape, min/max, first
values) unless ``--values`` asks for every value.  Exit status 0 when the whole stream
parsed (an empty one too: "0 records ... nothing to dissect", a hop that carried nothing;
and a v17 messages capture without its link's agreement, whose activations are then shown
as undecoded), 1 at the first malformed or truncated record (one line ``skippy-wire:
error: #K @OFFSET: ...``) or an unreadable file.
"""

from __future__ import annotations

import argparse
import dataclasses
import enum
import struct
import sys
from pathlib import Path
from typing import TextIO

from ..errors import DissectError, WireError
from ..wire.activation_frame import (
    PROTOCOL_VERSIONS,
    STAGE_STATE_VERSION_V15,
    STAGE_STATE_VERSION_V17,
    GgmlType,
    WireMessageKindV16,
)
from ..wire.constants import (I32_MAX, READY_BYTES, ActivationCodec, StateFlags,
                              activation_payload_multiplier_from_state_flags)
from ..wire.frame import read_reply_from_buffer, read_stage_message_from_buffer
from ..wire.messages import WireStagePhase
from ..wire.protocol import ACTIVATION_COUNT_OFFSET
from ..wire.replies import StageReply
from ..wire.setup import SETUP_MAGIC, STAGE_PROTOCOL_GENERATION
from .inspect_gen import (
    GenActivation,
    GenMessageReader,
    SetupPacket,
    detect_protocol,
    is_setup_packet,
    read_setup_packet,
    setup_label,
    starts_with_offer,
)
from .options import Parser, describe, error_line, int_between

# bit 2 is not interpreted in this version (section 2.4): shown by position, not by name
STATE_FLAG_NAMES = {int(f): "bit2" if f is StateFlags.SKIP_VERIFY_CHECKPOINT else f.name for f in StateFlags}
#: From state version 16 on only bits 0, 1, 3, 4 and 5 are defined (wire-v16-v17.md A.2);
#: the others (the v15 sidebands among them) are carried verbatim and shown as a number.
STATE_FLAG_NAMES_V16 = {int(f): f.name for f in (StateFlags.FINAL_CHUNK, StateFlags.LIGHT_CONTEXT, StateFlags.SAMPLING,
                                                 StateFlags.FULL_STATE, StateFlags.CHAT_SAMPLING_METADATA)}
PHASES = {int(p): "".join(part.capitalize() for part in p.name.split("_")) for p in WireStagePhase}
STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                "decode_step", "current_token", "source_stage_index", "activation_codec")
# struct formats of the part element types shown by value (BF16 is widened by hand)
_PART_FORMATS = {GgmlType.F32: "f", GgmlType.F16: "e", GgmlType.I32: "i", GgmlType.BF16: "H"}
_UNDECODED = ("not decoded: an agreement-framed activation needs its link's agreement (the Offer, in the "
              "capture's setup packets or its sibling *-replies.bin file)")


def flag_word(flags: int) -> int:
    """The flags word as its 32 bits (the readers give it as an i32: bit 31 is negative)."""
    return flags & 0xFFFFFFFF


def flag_names(flags: int, version: int = STAGE_STATE_VERSION_V15) -> str:
    table = STATE_FLAG_NAMES if version == STAGE_STATE_VERSION_V15 else STATE_FLAG_NAMES_V16
    flags = flag_word(flags)
    names = [name for bit, name in table.items() if flags & bit]
    rest = flags & ~sum(table)
    if rest:
        names.append(f"0x{rest:x}")
    return "|".join(names) or "none"


def kind_name(kind) -> str:
    """``DECODE_EMBD (2)``, alike in every version (23, DISCARD_STALE_WINDOWS, from v16 on)."""
    return _fmt(WireMessageKindV16(int(kind)))


def infer_n_embd(prefix: bytes) -> int | None:
    """n_embd implied by an 80-byte message prefix, or None when it carries no activation."""
    token_count = struct.unpack_from("<i", prefix, 8)[0]
    flags, source, codec_id, count = struct.unpack_from("<i", prefix, 32)[0], *struct.unpack_from("<iii", prefix, 52)
    if source < 0 or count <= 0 or token_count <= 0:
        return None
    rows = token_count * activation_payload_multiplier_from_state_flags(flags)
    try:
        codec = ActivationCodec(codec_id)
    except ValueError:
        return None
    if codec is ActivationCodec.RAW_F32_V1:
        per_row = count / rows / 4
    elif codec in (ActivationCodec.F16_RNE_V1, ActivationCodec.BF16_RNE_V1):
        per_row = count / rows / 2
    else:
        per_row = count / rows - 4
    return int(per_row) if per_row == int(per_row) and per_row > 0 else None


def _fmt(value) -> str:
    if isinstance(value, enum.Enum):
        return f"{value.name} ({int(value.value)})" if isinstance(value.value, int) else value.name
    if isinstance(value, float):
        return repr(value)
    return repr(value) if isinstance(value, (str, bytes)) else str(value)


def _fields(obj) -> list[tuple[str, object]]:
    if dataclasses.is_dataclass(obj):
        return [(f.name, getattr(obj, f.name)) for f in dataclasses.fields(obj)]
    if hasattr(obj, "__slots__"):
        return [(name, getattr(obj, name)) for name in obj.__slots__ if not name.startswith("_")]
    return [(k, v) for k, v in vars(obj).items() if not k.startswith("_")]


def _values_line(values, limit: int | None) -> str:
    shown = values if limit is None else values[:limit]
    text = ", ".join(f"{v:.6g}" for v in shown)
    return f"[{text}{', ...' if limit is not None and len(values) > limit else ''}]"


def value_lines(values, all_values: bool, indent: str = "    ") -> list[str]:
    """min/max/mean of the finite values, the non-finite count, then the (first) values."""
    finite = [v for v in values if v == v and abs(v) != float("inf")]
    lines = []
    if finite:
        lines.append(f"{indent}min {min(finite):.6g}  max {max(finite):.6g}  "
                     f"mean {sum(finite) / len(finite):.6g}  non-finite {len(values) - len(finite)}")
    lines.append(f"{indent}values: {_values_line(values, None if all_values else 8)}")
    return lines


def describe_state(st) -> str:
    parts = []
    for name in STATE_FIELDS:
        value = getattr(st, name)
        if name == "phase":
            parts.append(f"phase {PHASES.get(int(value), '?')} ({int(value)})")
        elif name == "flags":
            parts.append(f"flags 0x{flag_word(int(value)):x} [{flag_names(int(value), int(st.version))}]")
        elif name == "activation_codec":
            codec = ActivationCodec(int(value))
            parts.append(f"activation_codec {codec.identity()} ({int(codec)})")
        else:
            parts.append(f"{name} {int(value)}")
    return "  state: " + "  ".join(parts)


def describe_message(msg, offset: int, size: int, index: int, activation: list[str], *,
                     version_note: str = "") -> list[str]:
    """Every field of a stage message, any version; ``activation`` renders its activation."""
    lines = [f"#{index} @{offset} message{version_note}, {size} bytes: {kind_name(msg.kind)}",
             f"  pos_start {msg.pos_start}  token_count {msg.token_count}  tokens {len(msg.tokens)}  "
             f"positions {len(msg.positions)}  request_id {msg.request_id}  session_id {msg.session_id}",
             describe_state(msg.state)]
    if msg.sampling is not None:
        lines.append("  sampling: " + "  ".join(f"{k} {_fmt(v)}" for k, v in _fields(msg.sampling)))
    else:
        lines.append("  sampling: none")
    if msg.chat_sampling_metadata is not None:
        lines.append(f"  chat_sampling_metadata ({len(msg.chat_sampling_metadata.encode())} bytes): "
                     f"{msg.chat_sampling_metadata!r}")
    if msg.tokens:
        lines.append(f"  tokens: {list(msg.tokens)}")
    if msg.positions:
        lines.append(f"  positions: {list(msg.positions)}")
    if getattr(msg, "raw_bytes", b""):
        lines.append(f"  raw_bytes: {len(msg.raw_bytes)} bytes: {bytes(msg.raw_bytes[:32]).hex(' ')}"
                     f"{' ...' if len(msg.raw_bytes) > 32 else ''}")
    return lines + (activation or ["  activation: none"])


def v15_activation_lines(msg, n_embd: int | None, wire_activation_bytes: int, all_values: bool) -> list[str]:
    if not msg.activation:
        return []
    codec = ActivationCodec(int(msg.state.activation_codec))
    n = len(msg.activation) // 4
    values = struct.unpack(f"<{n}f", bytes(msg.activation))
    rows = n // n_embd if n_embd else 0
    return [f"  activation: {codec.identity()}, {wire_activation_bytes} bytes on the wire, decoded "
            f"{len(msg.activation)} bytes = {rows} rows x {n_embd} (n_embd)"] + value_lines(values, all_values)


def _part_values(ggml_type: int, chunk: bytes):
    fmt = _PART_FORMATS.get(ggml_type)
    if fmt is None:
        return None
    values = struct.unpack(f"<{len(chunk) // struct.calcsize(fmt)}{fmt}", chunk)
    if ggml_type == GgmlType.BF16:
        values = struct.unpack(f"<{len(values)}f", struct.pack(f"<{len(values)}I", *(v << 16 for v in values)))
    return values


def gen_activation_lines(act: GenActivation | None, version: int, all_values: bool) -> list[str]:
    """A v16 frame or a v17 agreement-framed activation: header, then the frame part by part."""
    if act is None:
        return []
    what = "agreement-framed activation" if version == STAGE_STATE_VERSION_V17 else "activation frame"
    lines = [f"  activation: {what} ({act.codec.identity()}), {act.wire_bytes} bytes on the wire"]
    if act.agreed is not None:
        a = act.agreed
        lines.append(f"    agreed: generation {a.generation.hex()}  profile {a.profile_id}  token_count "
                     f"{a.token_count}  sequence_count {a.sequence_count}  presence 0b{a.presence_mask:b}")
    desc = act.frame
    if desc is None:
        return lines + [f"    {_UNDECODED}"]
    lines.append(f"    frame v{desc.version}: producer {desc.producer_stage_index}  layers {desc.layer_start}.."
                 f"{desc.layer_end}  token_count {desc.token_count}  sequence_count {desc.sequence_count}  "
                 f"parts {len(desc.parts)}  payload {desc.payload_bytes} bytes  frontier "
                 f"{bytes(desc.frontier_identity)[:8].hex()}..")
    for i, part in enumerate(desc.parts):
        try:
            type_name = GgmlType(part.ggml_type).name
        except ValueError:
            type_name = str(part.ggml_type)
        lines.append(f"    part {i}: {type_name}  rank {part.rank}  token_axis {part.token_axis}  flags {part.flags}"
                     f"{' (OPTIONAL)' if part.optional else ''}  dims {list(part.dimensions)}  strides "
                     f"{list(part.byte_strides)}  offset {part.payload_offset}  bytes {part.payload_bytes}  "
                     f"identity {bytes(part.identity)[:8].hex()}..")
        values = _part_values(part.ggml_type, act.payload[part.payload_offset:part.payload_offset + part.payload_bytes])
        if values:
            lines += value_lines(values, all_values, "      ")
    return lines


def describe_setup(packet: SetupPacket, offset: int, size: int, index: int) -> list[str]:
    text = packet.body.decode("utf-8", "replace")
    return [f"#{index} @{offset} setup {packet.label} (magic 0x{SETUP_MAGIC:08x}, generation "
            f"{STAGE_PROTOCOL_GENERATION}), {size} bytes", f"  {text if len(text) < 600 else text[:600] + ' ...'}"]


def describe_reply(reply, offset: int, size: int, index: int) -> list[str]:
    lines = [f"#{index} @{offset} reply, {size} bytes: {_fmt(reply.kind)}"]
    extra = []
    for name, value in _fields(reply):
        if name in ("kind", "stats"):
            continue
        if dataclasses.is_dataclass(value):  # the window, an MTP draft: their fields inline
            value = "{" + ", ".join(f"{k} {_fmt(v) if not isinstance(v, list) else v}" for k, v in _fields(value)) + "}"
        elif value is None:
            value = "none"
        extra.append(f"{name} {_fmt(value) if not isinstance(value, (list, str)) else value}")
    lines.append("  " + "  ".join(extra))
    stats = getattr(reply, "stats", None)
    if stats is not None:
        items = _fields(stats)
        nonzero = [f"{k} {v}" for k, v in items if v]
        lines.append(f"  stats: {'  '.join(nonzero) if nonzero else f'all {len(items)} fields zero'}")
    return lines


def describe_record(data: bytes, item: tuple, index: int, protocol: int, all_values: bool) -> list[str]:
    """The lines of one ``(offset, record, size, detail)`` of :class:`iter_records`."""
    offset, record, size, detail = item
    if record is READY:
        return ["#0 @0 READY (magic 0x53524459, 4 bytes)"]
    if isinstance(record, SetupPacket):
        return describe_setup(record, offset, size, index)
    if isinstance(record, StageReply):
        return describe_reply(record, offset, size, index)
    if protocol == STAGE_STATE_VERSION_V15:
        wire = struct.unpack_from("<i", data, offset + ACTIVATION_COUNT_OFFSET)[0]
        return describe_message(record, offset, size, index, v15_activation_lines(record, detail, wire, all_values))
    return describe_message(record, offset, size, index, gen_activation_lines(detail, protocol, all_values),
                            version_note=f" (state version {protocol})")


def dissect(data: bytes, *, replies: bool | None = None, n_embd: int | None = None, all_values: bool = False,
            out: TextIO | None = None, name: str = "", protocol: int | None = None) -> int:
    """Print every record of ``data`` to ``out`` (default stdout); returns the number of
    records, raises :class:`DissectError` at the first malformed or truncated one.
    ``protocol`` (15, 16, 17) forces the state version, else it is detected."""
    out = out or sys.stdout
    if replies is None:
        replies = data[:4] == READY_BYTES or starts_with_offer(data) or "replies" in Path(name).name
    if protocol is None:
        protocol = detect_protocol(data, replies)
    index = 0
    records = iter_records(data, replies=replies, n_embd=n_embd, protocol=protocol, name=name)
    while True:
        offset = records.offset
        try:
            item = next(records, None)
            if item is None:
                break
            lines = describe_record(data, item, index, protocol, all_values)
        except (WireError, EOFError) as exc:
            kind = getattr(exc, "kind", type(exc).__name__)
            raise DissectError(f"#{index} @{offset}: {kind}: {exc} ({len(data) - offset} bytes left)") from exc
        print("\n".join(lines), file=out)
        index += 1
    return index


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="skippy-wire inspect", description="Dissect a captured byte stream of stage messages or replies.")
    p.add_argument("file", help="capture file, or - for stdin")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--replies", action="store_true",
                           help="the stream is replies: READY (v17: Offer and ready) then the replies (default: detected from the bytes and the name)")
    direction.add_argument("--messages", action="store_true",
                           help="the stream is stage messages (default: detected as for --replies)")
    p.add_argument("--n-embd", type=int_between(1, I32_MAX), default=None,
                   help="activation width (default: inferred per message)")
    p.add_argument("--values", action="store_true", help="print every activation value")
    p.add_argument("--protocol", type=int, choices=PROTOCOL_VERSIONS, default=None,
                   help="state version of the capture (default: detected from its bytes)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.file == "-":
        data, name = sys.stdin.buffer.read(), "-"
    else:
        try:
            data, name = Path(args.file).read_bytes(), args.file
        except OSError as exc:
            print(error_line(describe(exc)), file=sys.stderr)
            return 1
    if not data:
        print(f"0 records, 0 bytes: {'stdin' if name == '-' else name} is empty, nothing to dissect")
        return 0
    replies = True if args.replies else False if args.messages else None
    try:
        count = dissect(data, replies=replies, n_embd=args.n_embd, all_values=args.values, name=name,
                        protocol=args.protocol)
    except DissectError as exc:
        sys.stdout.flush()
        print(error_line(str(exc)), file=sys.stderr)
        return 1
    print(f"{count} records, {len(data)} bytes")
    return 0


READY = object()


class iter_records:
    """Iterate ``(offset, record, size, detail)`` over ``data``.  ``record`` is the
    :data:`READY` sentinel for a leading READY magic in the reply direction, a
    :class:`SetupPacket` (the v17 packets a capture starts with), a reply or a stage
    message; ``detail`` is a v15 message's n_embd, a v16/v17 message's
    :class:`GenActivation` (None without an activation), else None.  ``offset`` (the
    attribute) is where the next record starts."""

    def __init__(self, data: bytes, *, replies: bool, n_embd: int | None = None,
                 protocol: int = STAGE_STATE_VERSION_V15, name: str = "") -> None:
        self.data, self.replies, self.n_embd, self.offset = data, replies, n_embd, 0
        self.setup_count = 0
        self.in_setup = protocol != STAGE_STATE_VERSION_V15
        self.gen = None if replies or protocol == STAGE_STATE_VERSION_V15 else GenMessageReader(protocol, data, name)

    def __iter__(self):
        return self

    def __next__(self):
        data, offset = self.data, self.offset
        if offset >= len(data):
            raise StopIteration
        detail = None
        if self.in_setup and is_setup_packet(data, offset):
            size, body = read_setup_packet(data, offset)
            record = SetupPacket(setup_label(self.setup_count, self.replies), body)
            self.setup_count += 1
        elif self.replies and offset == 0 and data[:4] == READY_BYTES:
            record, size = READY, 4
        elif self.replies:
            record, size = read_reply_from_buffer(data, offset=offset)
        elif self.gen is not None:
            record, size, detail = self.gen.read(offset)
        else:
            detail = self.n_embd or (infer_n_embd(data[offset:offset + 80]) if len(data) - offset >= 80 else None)
            record, size = read_stage_message_from_buffer(data, detail or 1, offset=offset)
        self.in_setup = isinstance(record, SetupPacket)
        self.offset = offset + size
        return offset, record, size, detail


if __name__ == "__main__":
    sys.exit(main())
