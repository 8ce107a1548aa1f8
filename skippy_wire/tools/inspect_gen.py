"""Reading state version 16 and 17 captures for ``skippy-wire inspect`` (the v17 setup
packets, the frames, the agreement); :mod:`skippy_wire.tools.inspect` renders every record.

:func:`detect_protocol` tells the version of a capture from its first bytes: a setup
packet (magic ``0x53545053``) means 17; a stage message says it in its version word
(offset 20); a reply stream that starts with READY is 15 or 16 (replies are the same in
both, so it is dissected as 15).  :func:`read_setup_packet` reads the setup packets a v17
capture starts with (Hello and accept, or Offer and ready).  :class:`GenMessageReader`
reads one v16/v17 stage message and its activation: the frame part by part, or (v17) the
agreement-framed activation decoded under the Offer's agreement, found in the capture
itself or in its sibling ``-replies.bin`` file.  Without that agreement (a messages capture
read from stdin, say) the message is still read and its activation is left undecoded: only
the 30-byte agreement-framed header (wire-v16-v17.md B.6.1) is given.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..errors import InvalidDataError, UnexpectedEofError
from ..net.transport import CAPTURE_RECEIVED_SUFFIX, CAPTURE_SENT_SUFFIX
from ..wire.activation_frame import (
    ACTIVATION_AGREEMENT_GENERATION_BYTES,
    ACTIVATIONLESS_KINDS_V16,
    AGREED_ACTIVATION_HEADER_BYTES,
    STAGE_STATE_VERSION_V15,
    STAGE_STATE_VERSION_V17,
    ActivationFrameV16,
)
from ..wire.agreement import ActivationAgreement, generation_from_json, parse_json
from ..wire.constants import ActivationCodec
from ..wire.protocol import ACTIVATION_COUNT_OFFSET, VERSION_WORD_OFFSET, WireProtocol
from ..wire.setup import MAX_STAGE_SETUP_MESSAGE_BYTES, SETUP_HEADER_BYTES, SETUP_MAGIC, STAGE_PROTOCOL_GENERATION

#: The reader's refusal of an activation without the agreement (wire-v16-v17.md B.7.3).
NO_AGREEMENT = "activation requires an established agreement"
_SETUP_NAMES_C = ("Hello", "accept")  # what the connecting side sends, in order
_SETUP_NAMES_S = ("Offer", "ready")
#: The setup packets each side of a link sends.
SETUP_PACKETS = len(_SETUP_NAMES_C)


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


@dataclass
class SetupPacket:
    """One v17 setup packet: its place in the handshake (``Hello``, ``accept``, ``Offer``,
    ``ready``) and its JSON body."""

    label: str
    body: bytes


def setup_label(index: int, replies: bool) -> str:
    """The name of a side's setup packet ``index``; a third is more than a link sends."""
    if index >= SETUP_PACKETS:
        raise InvalidDataError(f"setup packet #{index + 1}: a side of a link sends {SETUP_PACKETS}")
    return (_SETUP_NAMES_S if replies else _SETUP_NAMES_C)[index]


def read_setup_packet(data, offset: int) -> tuple:
    """``(size, body)`` of the setup packet at ``offset``; UnexpectedEof when it is cut short
    (its ``needed``: the packet's bytes known so far, as the wire readers say it), InvalidData
    for what a peer would refuse (a body over the limit, or no JSON)."""
    if len(data) - offset < SETUP_HEADER_BYTES:
        raise UnexpectedEofError("setup packet header truncated", needed=SETUP_HEADER_BYTES)  # bytes left: the caller
    length = struct.unpack_from("<I", data, offset + 8)[0]
    if length > MAX_STAGE_SETUP_MESSAGE_BYTES:
        raise InvalidDataError(f"stage setup message exceeds limit ({length} bytes)")
    end = offset + SETUP_HEADER_BYTES + length
    if end > len(data):
        raise UnexpectedEofError(f"setup packet of {length} bytes truncated", needed=SETUP_HEADER_BYTES + length)
    body = bytes(data[offset + SETUP_HEADER_BYTES:end])
    try:
        parse_json(body)
    except ValueError as exc:
        raise InvalidDataError(f"decode stage setup: {exc}") from None
    return end - offset, body


def _setup_bodies(data):
    offset = 0
    while is_setup_packet(data, offset):
        try:
            size, body = read_setup_packet(data, offset)
        except (UnexpectedEofError, InvalidDataError):
            return
        yield body
        offset += size


def _offered(body: bytes):
    """The ``agreement`` JSON of a setup packet body that is an Offer, else None."""
    try:
        value = parse_json(body)
    except ValueError:
        return None
    return value.get("agreement") if isinstance(value, dict) else None


def starts_with_offer(data) -> bool:
    """Whether ``data`` starts with the listener's Offer: a v17 capture of the reply direction."""
    return next((_offered(body) is not None for body in _setup_bodies(data)), False)


def find_agreement(data: bytes, name: str = "") -> Optional[ActivationAgreement]:
    """The agreement of the Offer in ``data`` or in the sibling replies capture of ``name``
    (a regular file: a pipe or device there is not read); an Offer whose agreement does not
    parse gives none, and the activations are then shown undecoded."""
    sources = [data]
    if name.endswith(CAPTURE_SENT_SUFFIX):
        sibling = Path(name[:-len(CAPTURE_SENT_SUFFIX)] + CAPTURE_RECEIVED_SUFFIX)
        try:
            if sibling.is_file():
                with open(sibling, "rb") as fh:  # its Offer is among its first two packets
                    sources.append(fh.read(SETUP_PACKETS * (SETUP_HEADER_BYTES + MAX_STAGE_SETUP_MESSAGE_BYTES)))
        except OSError:
            pass
    for source in sources:
        for body in _setup_bodies(source):
            offered = _offered(body)
            if offered is not None:
                try:
                    agreement = ActivationAgreement.from_json(offered)
                except ValueError:  # its shape is wrong (JsonShapeError)
                    return None
                accepted = _accepted_generation(data)
                # a sibling from another link (another run's file): its agreement is not this one's
                return None if accepted is not None and accepted != agreement.generation else agreement
    return None


def _accepted_generation(data) -> Optional[bytes]:
    """The generation the accept packet of a messages capture names, None without one."""
    for body in _setup_bodies(data):
        try:
            return generation_from_json(parse_json(body))
        except ValueError:  # not the accept packet (the Hello), or not a generation
            continue
    return None


@dataclass
class AgreedHeader:
    """The fixed 30 bytes of an agreement-framed activation (B.6.1); what follows them
    (dynamic dimensions, then the parts) is laid out by the profile, so by the agreement."""

    generation: bytes
    profile_id: int
    token_count: int
    sequence_count: int
    presence_mask: int

    @classmethod
    def parse(cls, data) -> Optional["AgreedHeader"]:
        if len(data) < AGREED_ACTIVATION_HEADER_BYTES:
            return None
        gen = ACTIVATION_AGREEMENT_GENERATION_BYTES
        return cls(bytes(data[:gen]), *struct.unpack_from("<IIIH", data, gen))


@dataclass
class GenActivation:
    """A v16/v17 message's activation as inspect shows it: ``wire_bytes`` on the wire, the
    decoded ``frame`` with its logical ``payload`` (None when the activation could not be
    decoded: v17 without the agreement), and for v17 the ``agreed`` header."""

    codec: ActivationCodec
    wire_bytes: int
    frame: Optional[ActivationFrameV16] = None
    payload: bytes = b""
    agreed: Optional[AgreedHeader] = None


class GenMessageReader:
    """``read(offset, data) -> (message, size, GenActivation or None)`` over a v16/v17
    capture: ``data`` is the part of the capture read so far (``offset`` in it), by default
    the ``data`` it was made with.

    The v17 agreement is looked up (:func:`find_agreement`) at the first message, in the
    bytes that read is given (they start with the capture's setup packets) and the sibling
    file.  Without one, an activation-carrying message is read with its activation count
    taken as 0 (the reader's rule for an empty activation, A.7.4) and its activation bytes
    are skipped.  A message cut short raises UnexpectedEof with ``needed``, as the readers do."""

    def __init__(self, protocol: int, data=b"", name: str = "") -> None:
        self.proto = WireProtocol(protocol)
        self.data, self.name = data, name
        self._agreement: Optional[ActivationAgreement] = None
        self.looked_up = protocol != STAGE_STATE_VERSION_V17

    def agreement_in(self, data) -> Optional[ActivationAgreement]:
        if not self.looked_up:
            self._agreement, self.looked_up = find_agreement(data, self.name), True
        return self._agreement

    @property
    def agreement(self) -> Optional[ActivationAgreement]:
        return self.agreement_in(self.data)

    def read(self, offset: int, data=None) -> tuple:
        data = self.data if data is None else data
        agreement = self.agreement_in(data)
        try:
            msg, size = self.proto.read_from_buffer(data, offset=offset, agreement=agreement)
        except InvalidDataError as error:
            # the reader refuses an activation for want of the agreement once it holds the
            # whole message, the rest of it valid (wire-v16-v17.md B.7.3)
            without = str(error) == NO_AGREEMENT and self.proto.version == STAGE_STATE_VERSION_V17
            undecoded = self._read_undecoded(data, offset) if without else None
            if undecoded is None:
                raise
            return undecoded
        count = struct.unpack_from("<i", data, offset + ACTIVATION_COUNT_OFFSET)[0]
        if not len(msg.activation):
            return msg, size, None
        desc, payload = self.proto.decode_frame(ActivationCodec.RAW_F32_V1, msg.activation)
        return msg, size, self._activation(data, msg, offset + size - count, count, desc, bytes(payload))

    def _activation(self, data, msg, start: int, count: int, desc=None, payload=b"") -> GenActivation:
        agreed = None
        if self.proto.version == STAGE_STATE_VERSION_V17:
            agreed = AgreedHeader.parse(data[start:start + min(count, AGREED_ACTIVATION_HEADER_BYTES)])
        return GenActivation(ActivationCodec(int(msg.state.activation_codec)), count, desc, payload, agreed)

    def _read_undecoded(self, data, offset: int) -> Optional[tuple]:
        """The message at ``offset`` read without its activation, or None when that is not
        why the reader refused it (an activationless kind with a count, a short capture...:
        the reader refuses an activation for want of the agreement only once it holds the
        whole message, so a short capture here means another refusal came first)."""
        if len(data) - offset < ACTIVATION_COUNT_OFFSET + 4:
            return None
        count = struct.unpack_from("<i", data, offset + ACTIVATION_COUNT_OFFSET)[0]
        if count <= 0:
            return None
        # A copy of the message's bytes with its count patched to 0, as long as the reader
        # says it needs (never the rest of the capture: that may be large).
        at, left, size = ACTIVATION_COUNT_OFFSET, len(data) - offset, None
        take = min(left, _UNDECODED_FIRST_BYTES)
        while size is None:
            buf = bytearray(data[offset:offset + take])
            struct.pack_into("<i", buf, at, 0)
            try:
                msg, size = self.proto.read_from_buffer(buf)
            except InvalidDataError:
                return None
            except UnexpectedEofError as error:
                if error.needed is None or error.needed <= take or take == left:
                    return None
                take = min(left, error.needed)
        if (int(msg.kind) in ACTIVATIONLESS_KINDS_V16 or msg.state.source_stage_index < 0
                or offset + size + count > len(data)):
            return None
        if count < AGREED_ACTIVATION_HEADER_BYTES:  # no agreement makes it whole
            raise InvalidDataError(f"agreement-framed activation of {count} bytes, shorter than its "
                                   f"{AGREED_ACTIVATION_HEADER_BYTES}-byte header")
        return msg, size + count, self._activation(data, msg, offset + size, count)


#: The bytes of a message first copied to read it without its activation (more when needed).
_UNDECODED_FIRST_BYTES = 64 * 1024


__all__ = ["detect_protocol", "is_setup_packet", "starts_with_offer", "find_agreement", "setup_label",
           "read_setup_packet", "SetupPacket", "AgreedHeader", "GenActivation", "GenMessageReader"]
