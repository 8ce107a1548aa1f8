"""The protocol version as a first-class choice: state versions 15, 16 and 17.

``WireProtocol(version)`` is a per-version codec object for stage messages; v15 (the
default everywhere else in the package) delegates to :mod:`skippy_wire.wire.frame`, v16
and v17 run the ``frame_gen`` kernels (compiled ``_frame_gen`` or the reference twin,
chosen like every other kernel by ``SKIPPY_WIRE_IMPL`` / ``impl=``).

* v16: ``msg.activation`` is a complete encoded :class:`ActivationFrameV16` frame; the
  reader ignores ``n_embd`` and returns the frame re-encoded with RawF32V1.
* v17: activations need the connection's :class:`ActivationAgreement`, installed by the
  setup handshake (:mod:`skippy_wire.wire.setup`); :class:`StageConnection` holds it
  (upstream ``StageMessageIo``).

Version mismatch.  The readers raise :class:`ProtocolVersionError`, an InvalidDataError
whose text is upstream's exact "unsupported stage state version" (the vectors pin it), as
every wire error's is, and whose ``detail`` ("peer sent state version X, this side speaks
state version Y"), ``received`` and ``expected`` name both versions.
"""

from __future__ import annotations

import io
import struct
from typing import Any, Optional

from .. import _impl
from ..errors import InvalidDataError, UnexpectedEofError, WireError
from . import frame as _v15
from .activation_frame import PROTOCOL_VERSIONS, STAGE_STATE_VERSION_V15, ActivationFrameV16
from .agreement import ActivationAgreement
from .constants import ActivationCodec, wire_int
from .field_checks import check_writable, flat_bytes
from .messages import StageWireMessage

#: Offsets in a stage message's 80-byte prefix: the state header's version word, and the
#: activation's byte count (word 15).
VERSION_WORD_OFFSET = 20
ACTIVATION_COUNT_OFFSET = 60
UPSTREAM_VERSION_TEXT = "unsupported stage state version"
CANNOT_REPLACE_AGREEMENT = "cannot replace an established activation agreement"

def kernels(impl: Optional[str] = None):
    """The v16/v17 kernel module of ``impl`` (default: the live implementation)."""
    return _impl.cached_kernel_module("frame_gen", impl)


class ProtocolVersionError(InvalidDataError):
    """A peer's message carries another state version than this side speaks: upstream's
    text, and a ``detail`` that names both (as :class:`~skippy_wire.errors.SetupError`'s)."""

    def __init__(self, received: Optional[int], expected: int) -> None:
        super().__init__(UPSTREAM_VERSION_TEXT)
        peer = "an unreadable state version" if received is None else f"state version {received}"
        self.detail = f"peer sent {peer}, this side speaks state version {expected}"
        self.received = received
        self.expected = expected

    def __reduce__(self):  # pickle / copy: rebuild from the two versions, keep any later attributes
        return (type(self), (self.received, self.expected), self.__dict__)


def _version_word(data, offset: int) -> Optional[int]:
    view = flat_bytes(memoryview(data))
    if len(view) < offset + VERSION_WORD_OFFSET + 4:
        return None
    return struct.unpack_from("<i", view, offset + VERSION_WORD_OFFSET)[0]


def estimated_buffer_bytes(msg: StageWireMessage) -> int:
    """v16 ``estimated_wire_bytes`` / v17 ``estimated_buffer_bytes`` (the in-memory frame)."""
    return msg.estimated_wire_bytes()


def protocol_version(version) -> int:
    """``version`` as an int, a state version this package speaks (numpy's integers are
    integers; 16.0 and True are no versions)."""
    try:
        number = wire_int(version)
    except TypeError:
        number = None
    if number not in PROTOCOL_VERSIONS:
        raise ValueError(f"unknown stage protocol version {version!r}; this package speaks {PROTOCOL_VERSIONS}")
    return number


class WireProtocol:
    """Stage-message framing of one state version (15, 16 or 17)."""

    def __init__(self, version: int = STAGE_STATE_VERSION_V15, *, impl: Optional[str] = None) -> None:
        self.version = protocol_version(version)
        self.impl = impl
        self._k = None if version == STAGE_STATE_VERSION_V15 else kernels(impl)

    def __repr__(self) -> str:
        return f"WireProtocol({self.version})"

    # --- messages ------------------------------------------------------------------------
    def write(self, msg: StageWireMessage, agreement: Optional[ActivationAgreement] = None) -> bytes:
        """Serialize ``msg``; v17 activations need ``agreement`` (else InvalidInputError);
        ``msg`` not a StageWireMessage is a TypeError, whatever the version."""
        if not isinstance(msg, StageWireMessage):
            raise TypeError(f"write_stage_message expects a StageWireMessage, not {type(msg).__name__}")
        if self._k is None:
            return _v15.write_stage_message(msg, impl=self.impl)
        check_writable(msg, self.version)
        return self._k.write_stage_message(self.version, msg, agreement)

    def read_from_buffer(self, data, n_embd: int = 0, codec=None, policy=None, *, offset: int = 0,
                         agreement: Optional[ActivationAgreement] = None) -> tuple:
        """One message from a bytes-like object -> ``(message, consumed)``.  ``n_embd`` is
        used by v15 only.  A message of another state version -> ProtocolVersionError."""
        return self.buffer_reader(n_embd, codec, policy, lambda: agreement)(_v15.readable(data),
                                                                           _v15.check_offset(offset))

    def buffer_reader(self, n_embd: int = 0, codec=None, policy=None, agreement=lambda: None):
        """:meth:`read_from_buffer` with its arguments bound once, as ``parse(data, offset)``
        (a stream decoder parses every message with it: the kernel is called directly).
        ``agreement()`` gives the v17 agreement at each call (a link establishes it after
        its decoder is made)."""
        expected, pol = _v15.reader_expectation(codec, policy)
        n_embd = _v15._check_int(n_embd, "n_embd")
        version = self.version
        if self._k is None:
            v15_kernel = _v15.kernels(self.impl).read_stage_message_from_buffer

            def read(data, offset):
                return v15_kernel(data, n_embd, expected, pol, offset)
        else:
            kernel = self._k.read_stage_message_from_buffer

            def read(data, offset):
                return kernel(version, data, expected, pol, offset, agreement())

        def parse(data, offset: int = 0) -> tuple:
            try:
                return read(data, offset)
            except InvalidDataError as error:
                if type(error) is InvalidDataError and error.message == UPSTREAM_VERSION_TEXT:
                    raise ProtocolVersionError(_version_word(data, offset), version) from None
                raise

        return parse

    def read(self, data_or_stream, n_embd: int = 0, codec=None, policy=None, *,
             agreement: Optional[ActivationAgreement] = None) -> StageWireMessage:
        """One message from a bytes-like object or a binary stream (``read(n)`` /
        ``readinto``); a stream is never read past the message."""
        if not hasattr(data_or_stream, "read") or isinstance(data_or_stream, (bytes, bytearray, memoryview)):
            return self.read_from_buffer(data_or_stream, n_embd, codec, policy, agreement=agreement)[0]
        stream = data_or_stream
        buf = bytearray()
        need = 4
        while True:
            _fill(stream, buf, need)
            try:
                return self.read_from_buffer(buf, n_embd, codec, policy, agreement=agreement)[0]
            except UnexpectedEofError as error:
                if error.needed is None or error.needed <= len(buf):
                    raise
                need = error.needed

    def message_wire_bytes(self, msg: StageWireMessage, agreement: Optional[ActivationAgreement] = None) -> int:
        """The size of ``msg`` on the wire (v17: under ``agreement``, B.7.4)."""
        if self.version == 17:  # exact: a message its writer refuses is refused alike
            check_writable(msg, self.version)
            return self._k.message_wire_bytes(msg, agreement)
        return msg.estimated_wire_bytes()

    # --- frames (v16 and v17) ------------------------------------------------------------
    def _frames(self):
        if self._k is None:
            raise ValueError("state version 15 has no activation frames (use skippy_wire.wire.codec)")
        return self._k

    def encode_frame(self, codec, desc: ActivationFrameV16, payload) -> bytes:
        return self._frames().encode_frame(codec, desc, payload)

    def decode_frame(self, codec, data) -> tuple:
        """-> ``(desc, logical payload bytes)``."""
        return self._frames().decode_frame(codec, data, self.version)

    def frame_wire_bytes(self, codec, desc: ActivationFrameV16) -> int:
        return self._frames().frame_wire_bytes(codec, desc)

    def select_frame_codec(self, desc: ActivationFrameV16, payload, permitted) -> ActivationCodec:
        return ActivationCodec(self._frames().select_frame_codec(desc, payload, permitted))


_CHUNK = 1 << 20


def _fill(stream, buf: bytearray, total: int) -> None:
    """Grow ``buf`` to ``total`` bytes; each read asks for at most max(64 KiB, received)
    (capped at 1 MiB), so a hostile length costs at most about twice what arrived."""
    while len(buf) < total:
        want = min(total - len(buf), _CHUNK, max(64 * 1024, len(buf)))
        chunk = stream.read(want)
        if not chunk:
            raise UnexpectedEofError()
        buf += chunk


class SocketStream(io.RawIOBase):
    """``read(n)`` / ``write(b)`` over a socket (``recv`` / ``sendall``)."""

    def __init__(self, sock) -> None:
        super().__init__()
        self.sock = sock

    def readable(self) -> bool:
        return True

    def writable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        return self.sock.recv_into(b)

    def write(self, b) -> int:
        self.sock.sendall(b)
        return len(b)


def as_stream(obj: Any):
    """A socket becomes a :class:`SocketStream`; a stream is returned unchanged."""
    if hasattr(obj, "recv") and hasattr(obj, "sendall"):
        return SocketStream(obj)
    return obj


class StageConnection:
    """One connection speaking one protocol version (upstream ``StageMessageIo``): the
    stream, and for v17 the agreement installed by the setup handshake."""

    def __init__(self, stream, protocol: int = STAGE_STATE_VERSION_V15, *, impl: Optional[str] = None) -> None:
        self.stream = as_stream(stream)
        self.protocol = WireProtocol(protocol, impl=impl)
        self._agreement: Optional[ActivationAgreement] = None

    @property
    def agreement(self) -> Optional[ActivationAgreement]:
        return self._agreement

    def establish(self, agreement: ActivationAgreement) -> None:
        """Install the agreement (validated first); a second one is refused."""
        if self._agreement is not None:
            raise InvalidDataError(CANNOT_REPLACE_AGREEMENT)
        kernels(self.protocol.impl).validate_agreement(agreement)
        self._agreement = agreement

    def write_message(self, msg: StageWireMessage) -> int:
        data = self.protocol.write(msg, self._agreement)
        self.stream.write(data)
        flush = getattr(self.stream, "flush", None)
        if flush is not None:
            flush()
        return len(data)

    def read_message(self, n_embd: int = 0, codec=None, policy=None) -> StageWireMessage:
        return self.protocol.read(self.stream, n_embd, codec, policy, agreement=self._agreement)

    def wire_bytes(self, msg: StageWireMessage) -> int:
        return self.protocol.message_wire_bytes(msg, self._agreement)


def write_stage_message(msg: StageWireMessage, *, protocol: int = STAGE_STATE_VERSION_V15,
                        agreement: Optional[ActivationAgreement] = None, impl: Optional[str] = None) -> bytes:
    """:func:`skippy_wire.wire.frame.write_stage_message` with the version as a choice."""
    return WireProtocol(protocol, impl=impl).write(msg, agreement)


def read_stage_message(data_or_stream, n_embd: int = 0, codec=None, policy=None, *,
                       protocol: int = STAGE_STATE_VERSION_V15, agreement: Optional[ActivationAgreement] = None,
                       impl: Optional[str] = None) -> StageWireMessage:
    return WireProtocol(protocol, impl=impl).read(data_or_stream, n_embd, codec, policy, agreement=agreement)


__all__ = [
    "WireProtocol", "StageConnection", "SocketStream", "ProtocolVersionError", "as_stream", "kernels",
    "protocol_version",
    "estimated_buffer_bytes", "write_stage_message", "read_stage_message", "WireError",
]
