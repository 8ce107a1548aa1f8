"""The state version of one connection: how a stage link speaks 15, 16 or 17.

A :class:`LinkProtocol` wraps one :class:`~skippy_wire.net.transport.Peer` and owns
everything that differs between the versions, so the server and the driver never branch
on the version themselves:

* opening: the connecting side waits for READY (15, 16) or runs the setup handshake as
  client (17, :func:`skippy_wire.wire.setup.client_setup`); the listening side sends READY
  or runs the handshake as server (:meth:`connect` / :meth:`accept`);
* messages: :meth:`encode` / :meth:`read_message` (v16/v17 activations arrive as the
  runtime's input frame, an ``ActivationFrame``); replies are the same in every version;
* forwarding: :meth:`forwarded` builds the message a stage sends downstream from the
  runtime's output frame (v15: the v1 frame of wire-format.md 9; v16/v17: the multipart
  frame as it is); :meth:`forward` gives its bytes (a v15 decode step's straight from the
  incoming message's bytes).

Version mismatch.  A record from the peer that does not parse is looked at once more: a
stage message whose version word (offset 20) is not ours, or a v17 setup packet reaching a
v15/v16 side, raises :class:`~skippy_wire.errors.StateVersionMismatch`; the refusing
side then sends a *version notice* (``VERSION_NOTICE_MAGIC`` + u32 version) before it
closes, and a peer of this package that finds the notice where it expected READY, a reply
or a setup packet knows the other version exactly.  A v17 listener whose peer sends no
Hello within ``HELLO_GRACE_SECONDS`` takes it for a v15/v16 peer waiting for READY and
sends the notice too.  Upstream peers just see the close.
"""

from __future__ import annotations

import dataclasses
import select
import socket
import struct
import time
from typing import Optional

from ..errors import (DOWNSTREAM_NO_READY, DOWNSTREAM_SETUP_UNANSWERED, InvalidDataError, StageError,
                      StateVersionMismatch, TlsRequired, WireError, os_reason)
from ..stage.bridge import f32_part_payload, frame_from_v16, frame_to_v1, frame_to_v16
from ..stage.activation import ActivationBoundaryDesc, ActivationDesc, ActivationFrame
from ..wire.activation_frame import PROTOCOL_VERSIONS, STAGE_STATE_VERSION_V15, STAGE_STATE_VERSION_V17
from ..wire.constants import READY_BYTES, ActivationCodec
from ..wire.forwarding import (
    ActivationFrameV1,
    ForwardedBytes,
    forwarded_decode_bytes,
    forwarded_frame_message_timed,
    forwarded_stage_message_timed,
)
from ..wire.frame import MESSAGE_SIDEBAND_COUNTS_OFFSET, RecordDecoder, recv_ready, write_stage_message
from ..wire.frame import kernels as frame_kernels
from ..wire.protocol import VERSION_WORD_OFFSET, StageConnection, protocol_version
from .tls import TLS_REQUIRED_NOTICE, drain_before_close
from .transport import UPSTREAM_CHECK_S, PeerClosedError
from ..wire.setup import (
    SETUP_MAGIC,
    PlanStage,
    SetupError,
    SetupRole,
    StagePeer,
    StageSetupConfig,
    client_setup,
    server_setup,
)

#: The version notice: these 4 bytes, then the sender's state version as u32 LE.
VERSION_NOTICE_MAGIC = b"SVER"
VERSION_NOTICE_BYTES = 8
#: How long a side waits for the notice after the peer turned out to speak another version.
NOTICE_WAIT_SECONDS = 2.0
#: A v17 listener whose peer sent no Hello within this long takes it for a v15/v16 peer
#: waiting for READY: it sends the notice and closes.
HELLO_GRACE_SECONDS = 2.0
#: poll(2) events of a peer that has closed (or shut its sending side) or reset.
_HANGUP = getattr(select, "POLLRDHUP", 0) | select.POLLHUP | select.POLLERR


def peer_gone(sock) -> bool:
    """Whether the other end of ``sock`` has closed it (or shut its sending side) or reset
    it, without reading from it."""
    poller = select.poll()
    poller.register(sock, _HANGUP)
    try:
        return bool(poller.poll(0))
    except OSError:
        return True


_PEEK_BYTES = VERSION_WORD_OFFSET + 4
_I32 = struct.Struct("<i")
_SIDEBAND_COUNTS = struct.Struct("<ii")  # a message's token id count, then its position count


def version_notice(version: int) -> bytes:
    return VERSION_NOTICE_MAGIC + struct.pack("<I", version)


def parse_version_notice(data: bytes) -> Optional[int]:
    """The version of a notice, or None when ``data`` does not start with one."""
    if len(data) >= VERSION_NOTICE_BYTES and data[:4] == VERSION_NOTICE_MAGIC:
        return struct.unpack_from("<I", data, 4)[0]
    return None


def peer_version_of(head: bytes) -> Optional[int]:
    """The state version of the first bytes a peer sent: a stage message's version word, 17
    for a setup packet, the notice's version; None when it cannot tell."""
    notice = parse_version_notice(head)
    if notice is not None:
        return notice
    if len(head) >= 4 and struct.unpack_from("<I", head, 0)[0] == SETUP_MAGIC:
        return STAGE_STATE_VERSION_V17
    if len(head) >= _PEEK_BYTES:
        return struct.unpack_from("<i", head, VERSION_WORD_OFFSET)[0]
    return None


DEFAULT_RUN_ID = "skippy-wire"


def stage_id(index: int) -> str:
    """The stage id of stage ``index`` in setup packets ("stage0", "stage1", ...)."""
    return f"stage{index}"


def link_identity(config, has_downstream: bool, *, run_id: str = DEFAULT_RUN_ID, topology_id: str = DEFAULT_RUN_ID,
                  model_id: str = DEFAULT_RUN_ID) -> StageSetupConfig:
    """The v17 identity of a stage (forwarding ``StageConfig``): neighbours by index."""
    index = config.stage_index
    return StageSetupConfig(run_id, topology_id, model_id, stage_id(index), index, config.layer_start,
                            config.layer_end, StagePeer(stage_id(index - 1), index - 1) if index > 0 else None,
                            StagePeer(stage_id(index + 1), index + 1) if has_downstream else None)


def driver_identity(run_id: str = DEFAULT_RUN_ID, topology_id: str = DEFAULT_RUN_ID,
                    model_id: str = DEFAULT_RUN_ID) -> StageSetupConfig:
    """The driver's identity on its TokensAndControl link: it precedes stage 0 (layers 0..0)."""
    return StageSetupConfig(run_id, topology_id, model_id, "driver", 0, 0, 0, None, StagePeer(stage_id(0), 0))


def parse_plan(text: str) -> list:
    """``"0-15,15-30"`` -> the ``PlanStage`` list (stage ids by index)."""
    plan = []
    for index, item in enumerate(p for p in text.split(",") if p.strip()):
        start, sep, end = item.strip().partition("-")
        if not sep or not start.isdigit() or not end.isdigit():
            raise ValueError(f"a plan is START-END,START-END,..., not {text!r}")
        plan.append(PlanStage(stage_id(index), index, int(start), int(end)))
    return plan


def rows_boundary(n_embd: int) -> ActivationBoundaryDesc:
    """The boundary of a plain ``[n_embd, tokens]`` F32 edge (backends that report none)."""
    desc = ActivationDesc.f32_rows(n_embd, 1)
    part = desc.parts[0]
    part.dimensions = (n_embd, -1, 0, 0)
    part.payload_bytes = 0
    return ActivationBoundaryDesc(part_count=1, frontier_identity=desc.frontier_identity, parts=desc.parts)


def _readable(sock: socket.socket, timeout: float) -> bool:
    return bool(select.select([sock], [], [], timeout)[0])


class LinkProtocol:
    """One connection (``peer``) speaking state version ``version``.

    ``reads`` is what arrives on it ("messages" on a stage's upstream link, "replies"
    elsewhere); ``codec`` / ``policy`` are the reader's admission; ``n_embd`` sizes v15
    activations; ``max_message_bytes`` caps a message from its fixed prefix (before its
    payload is read), and ``max_tokens`` its token ids and positions (a stage's context:
    no more could run, and a message of small ids is decoded to a list ~9x its bytes).
    ``who`` names the peer in mismatch errors, ``me`` this side.  ``upstream``: on a stage's
    downstream link, the socket of the upstream connection it serves, watched while a reply
    is awaited (:meth:`read_owed_replies`)."""

    def __init__(self, version: int, peer, *, reads: str = "replies", n_embd: int = 0, codec=None, policy=None,
                 who: str = "peer", me: str = "this stage", impl: Optional[str] = None,
                 max_message_bytes: Optional[int] = None, max_tokens: Optional[int] = None,
                 upstream: Optional[socket.socket] = None) -> None:
        self.version = version = protocol_version(version)
        self.peer = peer
        self.who, self.me = who, me
        self.conn = StageConnection(peer.sock, version, impl=impl)
        self.wire = self.conn.protocol
        self.codec, self.policy, self.n_embd = codec, policy, n_embd
        #: Replies the peer still owes for messages sent without waiting (overlapped prefill).
        self.unread_replies = 0
        self.max_message_bytes, self.max_tokens = max_message_bytes, max_tokens
        self.upstream = upstream
        peer.reader.decoder = self.message_decoder() if reads == "messages" else self.reply_decoder()

    @property
    def agreement(self):
        return self.conn.agreement

    @property
    def unanswered(self) -> str:
        """How a stage says its downstream never answered this link's opening."""
        return DOWNSTREAM_SETUP_UNANSWERED if self.version == STAGE_STATE_VERSION_V17 else DOWNSTREAM_NO_READY

    def mismatch(self, peer_version, peer_text: Optional[str] = None) -> StateVersionMismatch:
        return StateVersionMismatch(peer_version, self.version, peer_text=peer_text, who=self.who, me=self.me)

    def refuse(self) -> None:
        """Tell the peer our version (best effort) before the connection is closed; what the
        peer still sends is drained briefly, so the close is no reset that drops the notice."""
        sock = self.peer.sock
        try:
            sock.settimeout(1.0)
            sock.sendall(version_notice(self.version))
        except OSError:
            return
        drain_before_close(sock, NOTICE_WAIT_SECONDS)

    # --- opening ----------------------------------------------------------------------
    def connect(self, role: SetupRole = SetupRole.ACTIVATION, setup=None, output=None, *,
                timeout: Optional[float] = None, model_id: Optional[str] = None) -> None:
        """The connecting side: wait for READY (15, 16) or run the setup handshake (17;
        ``model_id``: the one the peer must report, without ``setup``)."""
        if self.version != STAGE_STATE_VERSION_V17:
            self.peer.sock.settimeout(timeout)
            try:
                head = self.peer.reader.read_exact(4, gone=self._upstream_gone)
            except ConnectionAbortedError:
                raise StageError(f"upstream closed the connection while waiting for {self.who} to send READY; "
                                 "giving up") from None
            if head == VERSION_NOTICE_MAGIC:
                raise self.mismatch(parse_version_notice(head + self.peer.reader.read_exact(4)))
            if head == TLS_REQUIRED_NOTICE:
                raise TlsRequired(self.who, self.me)
            recv_ready(head)
            return
        sock = self.peer.capturing_socket()
        try:
            agreement = client_setup(sock, role, setup, output, timeout=timeout, cancelled=self._upstream_gone,
                                     model_id=model_id)
        except SetupError:
            if self._upstream_gone():
                raise StageError(f"upstream closed the connection while waiting for {self.who} to answer the "
                                 "stage setup; giving up") from None
            if bytes(self.peer.reader.head[:4]) == TLS_REQUIRED_NOTICE:
                raise TlsRequired(self.who, self.me) from None
            got = self._notice_after_setup_error()
            if got is not None:
                raise self.mismatch(got) from None
            raise
        self.conn.establish(agreement)

    def _upstream_gone(self) -> bool:
        """Whether the :attr:`upstream` connection this downstream link is for has gone (its
        waits on the downstream end then: a stage's thread must not outlive its connection)."""
        return self.upstream is not None and peer_gone(self.upstream)

    def _notice_after_setup_error(self) -> Optional[int]:
        """After a failed handshake: did a v15/v16 peer of this package send its notice
        (right after its READY)?"""
        head = bytes(self.peer.reader.head)
        if head[:4] == READY_BYTES:
            head = head[4:]
        return parse_version_notice(head)

    def accept(self, setup=None, input_profile=None, *, plan=None, prepare=None,
               timeout: Optional[float] = None, serves: Optional[SetupRole] = None):
        """The listening side: ``prepare()`` (e.g. open the downstream link), then READY
        (15, 16) or the setup handshake (17, ``prepare`` runs before ready is sent).
        Returns the role the peer asked for (15, 16: none is asked; ``serves``, else
        ACTIVATION).  ``serves``: the one role this side takes; a v17 peer that set up
        another one (a driver's TokensAndControl on a later stage) -> StageError, once the
        handshake is over (only it tells)."""
        if self.version != STAGE_STATE_VERSION_V17:
            if prepare is not None:
                prepare()
            self.peer.send(READY_BYTES)
            return serves or SetupRole.ACTIVATION
        if not _readable(self.peer.sock, HELLO_GRACE_SECONDS):
            self.refuse()
            raise self.mismatch(None, "no setup handshake (it waits for READY, so state version 15 or 16)")
        sock = self.peer.capturing_socket()
        try:
            role, agreement = server_setup(sock, setup, input_profile, topology=plan, prepare=prepare,
                                           timeout=timeout)
        except SetupError as error:
            peer = self._version_after_setup_error(error)
            if peer is not None:
                self.refuse()
                raise self.mismatch(peer) from None
            raise
        self.conn.establish(agreement)
        if serves is not None and role is not serves:
            raise StageError(f"peer set up a {role.value} link; {self.me} takes only {serves.value} links")
        return role

    def _version_after_setup_error(self, error: SetupError) -> Optional[int]:
        """A v15/v16 peer sent a stage message instead of Hello: its version word says which
        (bytes that are no stage message, whatever they hold there, stay a failed setup)."""
        if error.message != "incompatible stage setup protocol":
            return None
        head = bytearray(self.peer.reader.head)
        deadline = time.monotonic() + NOTICE_WAIT_SECONDS  # for them all: a peer trickling bytes had 2 s each
        try:
            while len(head) < _PEEK_BYTES and (left := deadline - time.monotonic()) > 0:
                self.peer.sock.settimeout(left)
                chunk = self.peer.sock.recv(_PEEK_BYTES - len(head))
                if not chunk:
                    break
                head += chunk
        except OSError:
            pass
        peer = peer_version_of(bytes(head))
        return peer if peer in PROTOCOL_VERSIONS and peer != self.version else None

    # --- messages ---------------------------------------------------------------------
    def _checked_parse(self, parse):
        """``parse`` of the records this side reads, turning the peer's other version (a
        notice, a stage message of another version, a setup packet) into a mismatch."""
        own = self.version

        def checked(data, offset):
            if bytes(data[offset:offset + 4]) == VERSION_NOTICE_MAGIC and len(data) - offset >= VERSION_NOTICE_BYTES:
                raise self.mismatch(parse_version_notice(bytes(data[offset:offset + VERSION_NOTICE_BYTES])))
            if self.max_tokens is not None:
                self._check_sidebands(data, offset)
            try:
                return parse(data, offset)
            except WireError:
                peer = peer_version_of(bytes(data[offset:offset + _PEEK_BYTES]))
                if peer is not None and peer != own and peer in PROTOCOL_VERSIONS:
                    self.refuse()
                    raise self.mismatch(peer) from None
                raise

        return checked

    def _check_sidebands(self, data, offset: int) -> None:
        """A message of this version counting more token ids or positions than ``max_tokens``
        is refused from its prefix, before its body is read."""
        if len(data) - offset < _PEEK_BYTES or _I32.unpack_from(data, offset + VERSION_WORD_OFFSET)[0] != self.version:
            return  # not (yet) a message of ours: the parser says what it is
        tokens, positions = _SIDEBAND_COUNTS.unpack_from(data, offset + MESSAGE_SIDEBAND_COUNTS_OFFSET)
        for count, what in ((tokens, "token ids"), (positions, "positions")):
            if count > self.max_tokens:
                raise InvalidDataError(f"stage message carries {count} {what}, more than the {self.max_tokens} "
                                       "of this stage's context (--ctx-size)")

    def message_decoder(self):
        """The incremental decoder of the stage messages this side receives."""
        parse = self.wire.buffer_reader(self.n_embd, self.codec, self.policy, lambda: self.conn.agreement)
        return RecordDecoder(self._checked_parse(parse), max_message_bytes=self.max_message_bytes)

    def reply_decoder(self):
        """The incremental decoder of the replies this side receives (the same in every version)."""
        return RecordDecoder(self._checked_parse(frame_kernels().read_reply_from_buffer), "stage reply")

    def read_message(self):
        """The next message, None on a clean close; v16/v17 activations come back as the
        runtime's input frame (``ActivationFrame``)."""
        record = self.peer.reader.read()
        if record is None or self.version == STAGE_STATE_VERSION_V15 or not len(record.activation):
            return record
        desc, payload = self.wire.decode_frame(ActivationCodec.RAW_F32_V1, record.activation)
        record.activation = frame_from_v16(desc, payload)
        return record

    def send_within(self, data: bytes, timeout: float) -> None:
        """Send one message to :attr:`who`, a stage downstream; StageError (naming it) when
        it takes nothing for ``timeout`` seconds or has closed the connection."""
        try:
            self.peer.sock.settimeout(timeout)
            self.peer.send(data)
        except (socket.timeout, TimeoutError):
            raise StageError(f"{self.who} took no data for {timeout} s") from None
        except ConnectionError as exc:
            raise StageError(f"{self.who} closed the connection ({os_reason(exc)})") from None

    def read_owed_replies(self, timeout: float, poll_s: float) -> list:
        """Every reply the downstream owes (overlapped chunks' Acks first), the last one the
        reply to the message just sent; StageError (naming :attr:`who`) on silence past
        ``timeout``, a close or a malformed reply, or when the :attr:`upstream` connection
        is gone meanwhile (looked at every :data:`UPSTREAM_CHECK_S` of silence)."""
        reader = self.peer.reader
        reader.poll_s = poll_s
        reader.deadline, reader.stall_timeout = time.monotonic() + timeout, UPSTREAM_CHECK_S
        replies = []
        try:
            while len(replies) <= self.unread_replies:
                try:
                    reply = reader.read()
                except (socket.timeout, TimeoutError):
                    if time.monotonic() >= reader.deadline:
                        raise
                    if self._upstream_gone():
                        raise StageError(f"upstream closed the connection while waiting for {self.who} to reply; "
                                         "giving up") from None
                    continue
                if reply is None:
                    raise StageError(f"{self.who} closed the connection instead of replying (see its log)")
                replies.append(reply)
            self.unread_replies = 0
            return replies
        except (socket.timeout, TimeoutError):
            begun = reader.partial  # a reply begun and left unfinished is not silence
            sent = f"sent {begun} bytes of a reply and no more" if begun else "sent no reply"
            raise StageError(f"{self.who} {sent} within {timeout:g} s") from None
        except PeerClosedError:
            raise StageError(f"{self.who} closed the connection in the middle of a reply") from None
        except ConnectionError as exc:
            raise StageError(f"{self.who} reset the connection ({os_reason(exc)})") from None
        except WireError as exc:
            raise StageError(f"{self.who} sent a malformed reply ({exc.kind}: {exc})") from None
        finally:
            reader.deadline = None

    def encode(self, msg) -> bytes:
        """``msg`` in this link's version (its state header says which; set here)."""
        if msg.state.version != self.version:
            msg = dataclasses.replace(msg, state=dataclasses.replace(msg.state, version=self.version))
        if self.version == STAGE_STATE_VERSION_V15:
            return write_stage_message(msg)
        return self.wire.write(msg, self.conn.agreement)

    # --- forwarding -------------------------------------------------------------------
    def forward(self, config, incoming, frame, n_embd: int, incoming_raw: Optional[bytes] = None) -> ForwardedBytes:
        """The bytes forwarding ``frame`` downstream, with what a stage counts of them.

        ``incoming_raw``: the incoming message's own bytes.  With them a DecodeEmbd of state
        version 15 is forwarded as bytes (:func:`forwarded_decode_bytes`: the same bytes,
        without the message objects, on the path every generated token takes)."""
        if incoming_raw is not None and self.version == STAGE_STATE_VERSION_V15 and isinstance(frame, ActivationFrame):
            payload = f32_part_payload(frame)
            if payload is not None:
                fast = forwarded_decode_bytes(config, incoming_raw, payload, frame.desc.token_count, n_embd)
                if fast is not None:
                    return fast
        forwarded = self.forwarded(config, incoming, frame, n_embd)
        out = forwarded.message
        return ForwardedBytes(self.encode(out), ActivationCodec(out.state.activation_codec), len(out.activation),
                              forwarded.activation_encode_ms)

    def forwarded(self, config, incoming, frame, n_embd: int):
        """The message forwarding ``frame`` (the runtime's ``ActivationFrame``, or a v1 frame
        of a test backend) downstream, as a ``ForwardedStageMessage``."""
        if self.version == STAGE_STATE_VERSION_V15:
            v1 = frame if isinstance(frame, ActivationFrameV1) else frame_to_v1(frame)
            return forwarded_stage_message_timed(config, incoming, v1, n_embd)
        if isinstance(frame, ActivationFrameV1):
            d = frame.desc
            frame = ActivationFrame(ActivationDesc.f32_rows(
                n_embd, d.token_count, producer_stage_index=d.producer_stage_index, layer_start=d.layer_start,
                layer_end=d.layer_end), bytes(frame.payload))
        desc, payload = frame_to_v16(frame)
        return forwarded_frame_message_timed(config, incoming, desc, payload, self.wire)


__all__ = ["peer_gone", "DEFAULT_RUN_ID", "stage_id", "link_identity", "driver_identity",
           "parse_plan", "rows_boundary", "VERSION_NOTICE_MAGIC", "VERSION_NOTICE_BYTES", "version_notice",
           "parse_version_notice", "peer_version_of", "LinkProtocol", "WireError"]
