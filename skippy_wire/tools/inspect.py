"""A dissector for captured stage traffic (``skippy-wire inspect FILE|-``).

Input: the bytes of ONE direction of one hop, as written by ``skippy-wire run --capture
DIR`` (``DIR/hopK-messages.bin``: what the upstream side sent; ``DIR/hopK-replies.bin``:
READY then the replies) or by any other recorder (e.g. a tcpdump payload export).  It is
read as a stream (:class:`CaptureInput`), only as far as the record being parsed needs,
and each record is printed once whole: memory follows the largest record, not the
capture, and a live or endless input (a FIFO, ``tail -c +1 -f``, a device) is shown as it comes.

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
error: #K @OFFSET: ...``) or an unreadable file (or stdin closed).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import enum
import io
import os
import stat
import struct
import sys
from typing import TextIO

import numpy as np

from ..errors import DissectError, InvalidDataError, UnexpectedEofError, WireError
from ..net.transport import CAPTURE_RECEIVED_SUFFIX
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
from ..wire.setup import MAX_STAGE_SETUP_MESSAGE_BYTES, SETUP_HEADER_BYTES, SETUP_MAGIC, STAGE_PROTOCOL_GENERATION
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
from .cli import stdout_error
from .options import Parser, describe, error_line, given_path, int_between

# bit 2 is not interpreted in this version (section 2.4): shown by position, not by name
STATE_FLAG_NAMES = {int(f): "bit2" if f is StateFlags.SKIP_VERIFY_CHECKPOINT else f.name for f in StateFlags}
#: From state version 16 on only bits 0, 1, 3, 4 and 5 are defined (wire-v16-v17.md A.2);
#: the others (the v15 sidebands among them) are carried verbatim and shown as a number.
STATE_FLAG_NAMES_V16 = {int(f): f.name for f in (StateFlags.FINAL_CHUNK, StateFlags.LIGHT_CONTEXT, StateFlags.SAMPLING,
                                                 StateFlags.FULL_STATE, StateFlags.CHAT_SAMPLING_METADATA)}
PHASES = {int(p): "".join(part.capitalize() for part in p.name.split("_")) for p in WireStagePhase}
STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                "decode_step", "current_token", "source_stage_index", "activation_codec")
# the element types of the parts shown by value (BF16 is widened by hand)
_PART_DTYPES = {GgmlType.F32: "<f4", GgmlType.F16: "<f2", GgmlType.I32: "<i4", GgmlType.BF16: "<u2"}
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
    shown = (values if limit is None else values[:limit]).tolist()
    text = ", ".join(f"{v:.6g}" for v in shown)
    return f"[{text}{', ...' if limit is not None and len(values) > limit else ''}]"


def value_lines(values, all_values: bool, indent: str = "    ") -> list[str]:
    """min/max/mean of the finite values, the non-finite count, then the (first) values.
    ``values``: a numpy array (an activation of up to 512 MiB is summarised without a
    Python object per value), or a sequence of numbers."""
    values = np.asarray(values)
    finite = values
    if values.dtype.kind == "f":
        mask = np.isfinite(values)
        finite = values if mask.all() else values[mask]
    lines = []
    if finite.size:
        mean = float(np.sum(finite, dtype=np.float64)) / finite.size
        lines.append(f"{indent}min {finite.min().item():.6g}  max {finite.max().item():.6g}  "
                     f"mean {mean:.6g}  non-finite {values.size - finite.size}")
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
    values = np.frombuffer(msg.activation, dtype="<f4", count=len(msg.activation) // 4)
    rows = values.size // n_embd if n_embd else 0
    return [f"  activation: {codec.identity()}, {wire_activation_bytes} bytes on the wire, decoded "
            f"{len(msg.activation)} bytes = {rows} rows x {n_embd} (n_embd)"] + value_lines(values, all_values)


def _part_values(ggml_type: int, chunk: bytes):
    dtype = _PART_DTYPES.get(ggml_type)
    if dtype is None:
        return None
    values = np.frombuffer(chunk, dtype=dtype, count=len(chunk) // np.dtype(dtype).itemsize)
    if ggml_type == GgmlType.BF16:  # the upper half of an f32
        values = (values.astype("<u4") << 16).view("<f4")
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
        if values is not None and values.size:
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


def describe_record(data: bytes, item: tuple, index: int, protocol: int, all_values: bool, *,
                    base: int = 0) -> list[str]:
    """The lines of one ``(offset, record, size, detail)`` of :class:`iter_records` whose
    bytes ``data`` holds from the stream offset ``base`` on."""
    offset, record, size, detail = item
    if record is READY:
        return ["#0 @0 READY (magic 0x53524459, 4 bytes)"]
    if isinstance(record, SetupPacket):
        return describe_setup(record, offset, size, index)
    if isinstance(record, StageReply):
        return describe_reply(record, offset, size, index)
    if protocol == STAGE_STATE_VERSION_V15:
        wire = struct.unpack_from("<i", data, offset - base + ACTIVATION_COUNT_OFFSET)[0]
        return describe_message(record, offset, size, index, v15_activation_lines(record, detail, wire, all_values))
    return describe_message(record, offset, size, index, gen_activation_lines(detail, protocol, all_values),
                            version_note=f" (state version {protocol})")


class CaptureInput:
    """A capture as the dissector reads it: from a binary stream (a file, stdin, a FIFO)
    only as far as the record it parses needs, or from bytes already in memory.  ``window``
    holds the bytes from the stream offset ``base`` on; the bytes before the record being
    read may be dropped, so memory follows the largest record (a wire reader bounds every
    length field), not the stream: an endless or live input (``tail -c +1 -f``, a device) is
    dissected as it arrives.  ``size``: the input's whole size when known (a regular file)."""

    def __init__(self, stream=None, *, data=None, size: int | None = None) -> None:
        self.window, self.base = (b"", 0) if data is None else (data, 0)
        self.eof = data is not None
        self.size = len(data) if data is not None else size
        self._read = None if stream is None else getattr(stream, "read1", None) or stream.read

    @property
    def end(self) -> int:
        """The stream offset right after the bytes read so far."""
        return self.base + len(self.window)

    def fill(self, end: int, keep: int | None = None) -> None:
        """Read until the window reaches the stream offset ``end`` or the input ends; when
        it reads, the bytes before ``keep`` (when given) are dropped first (so each byte is
        copied about once: what is left of the window then is the record not yet whole)."""
        if self.end >= end or self.eof:
            return
        if keep is not None and keep > self.base:
            self.window, self.base = self.window[keep - self.base:], keep
        pieces, have = [], self.end
        while have < end and not self.eof:
            piece = self._read(min(max(end - have, READ_BYTES), MAX_READ_BYTES))
            if not piece:
                self.eof = True
                break
            pieces.append(piece)
            have += len(piece)
        if pieces:
            self.window = bytes(self.window) + b"".join(pieces)

    def left(self, offset: int) -> str:
        """The bytes from ``offset`` to the end of the input, as the error line says them."""
        if self.eof:
            return f"{self.end - offset} bytes left"
        if self.size is not None:
            return f"{self.size - offset} bytes left"
        return f"at least {self.end - offset} bytes left"


#: Every read of a stream asks for at least this much (fewer calls for small records) and
#: at most :data:`MAX_READ_BYTES` (a large record is read as its bytes arrive).
READ_BYTES = 64 * 1024
MAX_READ_BYTES = 1 << 20
#: What the dissector reads before it tells the direction and the version: a stage
#: message's version word (offset 20) and the length of a setup packet.
PROBE_BYTES = 24
#: The smallest record read at once: a setup packet's header (READY is shorter, and alone).
MIN_RECORD_BYTES = SETUP_HEADER_BYTES


def dissect(data: bytes, *, replies: bool | None = None, n_embd: int | None = None, all_values: bool = False,
            out: TextIO | None = None, name: str = "", protocol: int | None = None) -> int:
    """Print every record of ``data`` to ``out`` (default stdout); returns the number of
    records, raises :class:`DissectError` at the first malformed or truncated one.
    ``protocol`` (15, 16, 17) forces the state version, else it is detected."""
    return dissect_input(CaptureInput(data=data), replies=replies, n_embd=n_embd, all_values=all_values, out=out,
                         name=name, protocol=protocol)


def dissect_input(src: CaptureInput, *, replies: bool | None = None, n_embd: int | None = None,
                  all_values: bool = False, out: TextIO | None = None, name: str = "",
                  protocol: int | None = None) -> int:
    """:func:`dissect` over a :class:`CaptureInput`, printing each record as it is read."""
    out = out or sys.stdout
    src.fill(PROBE_BYTES)
    if is_setup_packet(src.window):  # the first packet whole: is it the Offer?
        length = struct.unpack_from("<I", src.window, 8)[0] if len(src.window) >= SETUP_HEADER_BYTES else 0
        src.fill(SETUP_HEADER_BYTES + min(length, MAX_STAGE_SETUP_MESSAGE_BYTES))
    if replies is None:
        replies = (src.window[:4] == READY_BYTES or starts_with_offer(src.window)
                   or name.endswith(CAPTURE_RECEIVED_SUFFIX))
    if protocol is None:
        protocol = detect_protocol(src.window, replies)
    index = 0
    records = iter_records(src.window, replies=replies, n_embd=n_embd, protocol=protocol, name=name)
    while True:
        offset, needed = records.offset, None
        records.view(src.window, src.base)
        try:
            item = next(records, None)
            if item is None:
                break
            lines = describe_record(src.window, item, index, protocol, all_values, base=src.base)
        except UnexpectedEofError as exc:
            needed = exc.needed
            if src.eof or needed is None or offset + needed <= src.end:
                raise _dissect_error(exc, index, offset, src) from exc
        except (WireError, EOFError) as exc:
            raise _dissect_error(exc, index, offset, src) from exc
        if needed is None:
            print("\n".join(lines), file=out)
            index += 1
            needed = MIN_RECORD_BYTES
        if src.end < records.offset + needed and not src.eof:
            out.flush()  # a live input: what is known is shown before the read waits
        src.fill(records.offset + needed, keep=records.offset if records.may_drop else None)
    return index


def _dissect_error(exc: BaseException, index: int, offset: int, src: CaptureInput) -> DissectError:
    kind = getattr(exc, "kind", type(exc).__name__)
    return DissectError(f"#{index} @{offset}: {kind}: {exc} ({src.left(offset)})")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="skippy-wire inspect", description="Dissect a captured byte stream of stage messages or replies.")
    p.add_argument("file", type=given_path, help="capture file, or - for stdin")
    direction = p.add_mutually_exclusive_group()
    direction.add_argument("--replies", action="store_true",
                           help="the stream is replies: READY (v17: Offer and ready) then the replies (default: detected from the bytes and the name)")
    direction.add_argument("--messages", action="store_true",
                           help="the stream is stage messages (default: detected as for --replies)")
    p.add_argument("--n-embd", type=int_between(1, I32_MAX), default=None,
                   help="activation width of state version 15 messages (v16/v17 frames carry their dimensions; "
                        "default: inferred per message)")
    p.add_argument("--values", action="store_true", help="print every activation value")
    p.add_argument("--protocol", type=int, choices=PROTOCOL_VERSIONS, default=None,
                   help="state version of the capture (default: detected from its bytes)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    replies = True if args.replies else False if args.messages else None
    try:
        if args.file == "-":
            if sys.stdin is None:  # started with stdin closed (<&-)
                print(error_line("stdin is closed: nothing to dissect"), file=sys.stderr)
                return 1
            return _inspect(sys.stdin.buffer, "-", replies, args)
        with open(args.file, "rb") as stream:
            return _inspect(stream, args.file, replies, args)
    except BrokenPipeError:  # stdout closed (| head): the command's quiet exit 141
        raise
    except OSError as exc:  # reading the input, unless stdout is what failed (named as such by cli)
        if exc.filename is None and stdout_error() is not None:
            raise
        sys.stdout.flush()
        what = "stdin" if args.file == "-" and exc.filename is None else None
        print(error_line(f"{what}: {describe(exc)}" if what else describe(exc)), file=sys.stderr)
        return 1


def _inspect(stream, name: str, replies: bool | None, args) -> int:
    size = None
    with contextlib.suppress(OSError, ValueError, AttributeError, io.UnsupportedOperation):
        info = os.fstat(stream.fileno())
        size = info.st_size if stat.S_ISREG(info.st_mode) and info.st_size else None  # /proc's files say 0
    src = CaptureInput(stream, size=size)
    try:
        count = dissect_input(src, replies=replies, n_embd=args.n_embd, all_values=args.values, name=name,
                              protocol=args.protocol)
    except DissectError as exc:
        sys.stdout.flush()
        print(error_line(str(exc)), file=sys.stderr)
        return 1
    if not src.end:  # a path's bytes that are not UTF-8 as escapes: stdout's encoder may refuse them
        shown = "stdin" if name == "-" else name.encode("utf-8", "backslashreplace").decode("utf-8")
        print(f"0 records, 0 bytes: {shown} is empty, nothing to dissect")
    else:
        print(f"{count} records, {src.end} bytes")
    return 0


READY = object()


class iter_records:
    """Iterate ``(offset, record, size, detail)`` over ``data``.  ``record`` is the
    :data:`READY` sentinel for a leading READY magic in the reply direction, a
    :class:`SetupPacket` (the v17 packets a capture starts with), a reply or a stage
    message; ``detail`` is a v15 message's n_embd, a v16/v17 message's
    :class:`GenActivation` (None without an activation), else None.  ``offset`` (the
    attribute) is where the next record starts.  :meth:`view` gives it the part of a
    stream read so far (:func:`dissect_input`); :attr:`may_drop`: the bytes before
    ``offset`` are no longer needed (a v17 messages capture keeps its setup packets until
    the first message has looked up the agreement in them)."""

    def __init__(self, data: bytes, *, replies: bool, n_embd: int | None = None,
                 protocol: int = STAGE_STATE_VERSION_V15, name: str = "") -> None:
        self.data, self.base, self.replies, self.n_embd, self.offset = data, 0, replies, n_embd, 0
        self.setup_count, self.protocol = 0, protocol
        self.in_setup = protocol == STAGE_STATE_VERSION_V17  # a v17 link starts with the setup handshake
        self.gen = None if replies or protocol == STAGE_STATE_VERSION_V15 else GenMessageReader(protocol, data, name)

    def view(self, data, base: int) -> None:
        """The bytes of the stream from offset ``base`` on, as far as they were read."""
        self.data, self.base = data, base

    @property
    def may_drop(self) -> bool:
        return self.gen is None or self.gen.looked_up

    def __iter__(self):
        return self

    def __next__(self):
        data, offset = self.data, self.offset - self.base
        if offset >= len(data):
            raise StopIteration
        detail = None
        if self.in_setup and is_setup_packet(data, offset):
            size, body = read_setup_packet(data, offset)
            record = SetupPacket(setup_label(self.setup_count, self.replies), body)
            self.setup_count += 1
        elif self.offset == 0 and is_setup_packet(data, offset):  # --protocol 15 or 16 on a v17 capture
            raise InvalidDataError(f"a setup packet in a state version {self.protocol} stream (only a v17 link "
                                   "starts with the setup handshake)")
        elif self.replies and self.offset == 0 and data[:4] == READY_BYTES:
            if self.protocol == STAGE_STATE_VERSION_V17:  # --protocol 17 on a v15 or v16 capture
                raise InvalidDataError("READY in a state version 17 stream (a v17 link starts with the setup "
                                       "handshake instead)")
            record, size = READY, 4
        elif self.replies:
            record, size = read_reply_from_buffer(data, offset=offset)
        elif self.gen is not None:
            record, size, detail = self.gen.read(offset, data)
        else:
            detail = self.n_embd or (infer_n_embd(data[offset:offset + 80]) if len(data) - offset >= 80 else None)
            record, size = read_stage_message_from_buffer(data, detail or 1, offset=offset)
        self.in_setup = isinstance(record, SetupPacket)
        self.offset += size
        return offset + self.base, record, size, detail


if __name__ == "__main__":
    sys.exit(main())
