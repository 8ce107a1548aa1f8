"""TCP transport of the stage wire: connections, addresses, and reading records off a socket.

Every record that arrives on a socket -- a stage message on a stage's upstream connection,
a reply on a downstream or driver connection -- is parsed by the wire's incremental
decoders (:class:`skippy_wire.wire.frame.StageMessageDecoder` /
:class:`~skippy_wire.wire.frame.StageReplyDecoder`): :class:`SocketReader` receives into one
reused buffer and feeds each chunk, so no attempt copies what is already buffered.  A peer
may pipeline: records completed by one chunk are queued and returned one at a time.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import re
import select
import socket
import ssl
import threading
import time
from typing import Callable

from ..errors import UnexpectedEofError, os_reason
from ..wire.frame import StageReplyDecoder, recv_ready
from .tls import connect_tls

#: Size of the buffer a reader receives into.
RECV_CHUNK_BYTES = 1 << 16
#: How many of a connection's first bytes a reader keeps (:attr:`SocketReader.head`).
HEAD_BYTES = 64
#: Waits longer than this are not decode steps: a polling reader just sleeps through them.
MAX_POLLED_WAIT = 1.0
#: Seconds a listener pauses after a failed accept (descriptors run out: some may free up).
ACCEPT_RETRY_S = 0.1
#: While a stage waits on its downstream (its connect, READY, a reply), it looks this often
#: whether its upstream has gone (a driver that gave up, a connection shed): then it gives
#: up too, its thread ends, and the session is freed at once on it and on the stages after
#: it, rather than when the wait's own timeout ends.
UPSTREAM_CHECK_S = 1.0
#: The ends of a capture's two file names: what one end sent, what it received.
CAPTURE_SENT_SUFFIX, CAPTURE_RECEIVED_SUFFIX = "-messages.bin", "-replies.bin"

log = logging.getLogger("skippy_wire.net.transport")


class DiagnosticFile:
    """A file a diagnostic option writes as the work goes on (``--capture``'s copies of a
    connection's bytes, ``--trace-compute``'s lines), flushed at every write.  A write that
    fails (a full disk) is logged once, naming the option and the file, and nothing more is
    written to it: a diagnostic must not fail the requests it watches."""

    def __init__(self, path: str, option: str, mode: str = "wb") -> None:
        self.path, self.option = path, option
        self._file = open(path, mode)
        self._lock = threading.Lock()  # a compute trace is one file for every connection's thread

    def write(self, data) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.write(data)
                    self._file.flush()
                except OSError as exc:
                    self._stop(exc)

    def close(self) -> None:
        with self._lock:
            if self._file is not None:
                try:
                    self._file.close()
                    self._file = None
                except OSError as exc:
                    self._stop(exc)

    def _stop(self, exc: OSError) -> None:
        log.error("%s: cannot write %s (%s); nothing more is written to it", self.option, self.path, os_reason(exc))
        file, self._file = self._file, None
        try:
            file.close()  # its unwritten buffer fails again: dropped with it
        except OSError:
            pass


def connect(host: str, port: int, timeout: float, tls=None,
            abandoned: Callable[[], bool] | None = None) -> socket.socket:
    """Open a TCP connection with TCP_NODELAY set; ``tls`` (a client ``ssl.SSLContext``):
    mutual TLS over it (:mod:`.tls`), the handshake done within ``timeout``.  ``abandoned``
    is asked every :data:`UPSTREAM_CHECK_S` while the connection is being made (a host that
    drops the packets answers nothing): True ends the attempt, ``ConnectionAbortedError``."""
    sock = socket.create_connection((host, port), timeout=timeout) if abandoned is None \
        else _connect_unless(host, port, timeout, abandoned)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    if tls is not None:
        try:
            return connect_tls(sock, tls, host)
        except BaseException:
            sock.close()
            raise
    return sock


class GivenUp(ConnectionAbortedError):
    """A connect or a wait given up because the connection it was for has gone (not the
    socket's own ECONNABORTED, a ConnectionAbortedError too)."""

    def __init__(self) -> None:
        super().__init__("given up: the connection it was for has gone")


class _Abandoned(Exception):
    """A connect given up (not an OSError: it must not move on to the host's next address)."""


def _connect_unless(host: str, port: int, timeout: float, abandoned: Callable[[], bool]) -> socket.socket:
    """``socket.create_connection`` (every address ``host`` names in turn, each within
    ``timeout``; the first failure raised when all fail), asking ``abandoned`` between waits
    of :data:`UPSTREAM_CHECK_S`."""
    errors: list[OSError] = []
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, 0, socket.SOCK_STREAM):
        try:
            sock = socket.socket(family, kind, proto)
        except OSError as exc:  # a family this kernel lacks (IPv6 switched off): the next address
            errors.append(exc)
            continue
        try:
            _connect_watched(sock, address, timeout, abandoned)
            return sock
        except OSError as exc:  # refused, unreachable, timed out: the next address
            sock.close()
            errors.append(exc)
        except _Abandoned:
            sock.close()
            raise GivenUp() from None
        except BaseException:
            sock.close()
            raise
    raise errors[0] if errors else OSError(f"{host} names no address")


def _connect_watched(sock: socket.socket, address, timeout: float, abandoned: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout
    sock.setblocking(False)
    code = sock.connect_ex(address)
    poller = select.poll()
    poller.register(sock, select.POLLOUT)
    while code in (errno.EINPROGRESS, errno.EAGAIN, errno.EINTR):
        left = deadline - time.monotonic()
        if left <= 0:
            raise socket.timeout("timed out")
        if abandoned():
            raise _Abandoned()
        if poller.poll(int(min(left, UPSTREAM_CHECK_S) * 1000) + 1):
            code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
    if code:
        raise OSError(code, os.strerror(code))
    sock.settimeout(timeout)


def accept_connection(listener: socket.socket, stopped, log_error) -> tuple | None:
    """``listener.accept()`` (its timeout set), the connection in blocking mode with
    TCP_NODELAY; None on the listener's timeout, or when accepting failed (e.g. out of file
    descriptors): ``log_error(fmt, *args)`` hears of it and the listener pauses
    :data:`ACCEPT_RETRY_S`, so it outlives the failure.  OSError once ``stopped`` is set."""
    try:
        sock, addr = listener.accept()
    except socket.timeout:
        return None
    except OSError as exc:
        if stopped.is_set():
            raise
        log_error("cannot accept a connection (%s); retrying", exc)
        stopped.wait(ACCEPT_RETRY_S)
        return None
    sock.settimeout(None)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock, addr


#: One label of a host name (IDNA names are checked in their ASCII form; ``_`` as resolvers allow it).
_HOST_LABEL = re.compile(r"[A-Za-z0-9_-]{1,63}\Z")
_NUMERIC_HOST = re.compile(r"[0-9.]+\Z")


class BadHost(ValueError):
    """The host of a ``HOST:PORT`` is no IPv4 address or host name (:func:`host_problem`)."""


def host_problem(host: str) -> str | None:
    """Why ``host`` (of ``HOST:PORT``) is no IPv4 address or host name, or None: a space, a
    control character or a slash would only fail where the stage listens or connects (a NUL
    with a traceback, a newline splitting the error line), a label over 63 characters with
    "text is not valid UTF-8"."""
    try:
        ascii_host = host.encode("idna").decode("ascii")
    except UnicodeError:
        return "is not a valid host name (an empty label, or one over 63 characters?)"
    name = ascii_host[:-1] if ascii_host.endswith(".") else ascii_host
    if len(name) > 253:
        return "is longer than a host name may be (253 characters)"
    if not all(_HOST_LABEL.match(label) for label in name.split(".")):
        return "is not an IPv4 address or a host name (letters, digits, '-', '_', dots)"
    if _NUMERIC_HOST.match(name):  # no host name is all digits (RFC 3696): meant as an address
        try:
            socket.inet_aton(name)  # as the C library reads it: 10.1.2 is 10.1.0.2, 127.1 127.0.0.1
        except OSError:
            return "is not a valid IPv4 address (four numbers of 0-255, or a shorter form the C library reads)"
    return None


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"tcp://host:port"``) to ``(host, port)``.  IPv6 literals
    (``[::1]:9000``) are refused: listeners and connections are IPv4 (a host name resolves
    to its IPv4 address)."""
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    if "://" in text:
        raise ValueError(f"only tcp:// may come before HOST:PORT, not {text!r}")
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, not {text!r}")
    if not port.isascii():  # int() also reads other scripts' digits ("\u0661\u0662" would be port 12)
        raise ValueError(f"the port of {text!r} must be ASCII digits")
    host = host.strip("[]")
    if ":" in host:
        raise ValueError(f"IPv6 addresses are not supported: {text!r} (use an IPv4 address or a host name)")
    problem = host_problem(host) if host else None
    if problem:
        raise BadHost(f"host {host!r} {problem}")
    return host or "127.0.0.1", int(port)


#: The hosts a listener binds to every address of this machine with (as written most often).
WILDCARD_HOSTS = frozenset({"", "0.0.0.0"})


def is_wildcard(host: str) -> bool:
    """Whether ``host`` is every address of this machine, however the C library spells
    0.0.0.0 ("0", "0x0", "0.0.0.0.")."""
    try:
        return host in WILDCARD_HOSTS or socket.inet_aton(host.rstrip(".")) == bytes(4)
    except (OSError, ValueError):  # not an address (a host name)
        return False


def ipv4_addresses(host: str) -> frozenset[str]:
    """The IPv4 addresses ``host`` names (those connect() would try); an unresolvable host
    (another site's name) as written."""
    try:
        return frozenset(info[4][0] for info in socket.getaddrinfo(host, None, socket.AF_INET, socket.SOCK_STREAM))
    except (OSError, UnicodeError):
        return frozenset([host])


def _is_local(ip: str) -> bool:
    """Whether ``ip`` is an address of this machine (one it can bind to)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            probe.bind((ip, 0))
        except OSError:
            return False
    return True


def names_listener(target: tuple[str, int], listen: tuple[str, int]) -> bool:
    """Whether connecting to ``target`` (HOST, PORT) reaches the listener bound to
    ``listen``: the same port, and a host that is the listener's address or, for a listener
    on every address, one of this machine's (0.0.0.0 as a target is this machine too).  A
    stage whose downstream is itself would open a connection to itself for every one it
    accepts."""
    (host, port), (listen_host, listen_port) = target, listen
    if port != listen_port or port == 0:
        return False
    targets = ipv4_addresses(host)
    if any(is_wildcard(t) for t in targets) or targets & ipv4_addresses(listen_host):
        return True
    return is_wildcard(listen_host) and any(_is_local(ip) for ip in targets)


class PeerClosedError(UnexpectedEofError):
    """The peer closed the connection before a whole record arrived: the UnexpectedEof of
    the socket, told apart from a record whose own contents end early (a malformed one)."""


class SocketReader:
    """Whole records off a socket through an incremental decoder.

    Every received byte is counted in :attr:`count` (and teed to ``capture`` when given).
    :meth:`read` returns the next record, None on a clean close between records, and raises
    :class:`PeerClosedError` on a close in the middle of one; a malformed record raises the
    decoder's ``WireError`` once the records before it have been read.  :attr:`last_size` is
    the wire size of the record :meth:`read` returned last (:attr:`last_raw` its bytes, when
    it arrived within one receive); :attr:`deadline` bounds a whole
    :meth:`read` (a stage's message timeout).  :attr:`poll_s` (default 0) busy-polls near a
    record's expected arrival instead of sleeping through the whole wait.
    """

    #: Busy-poll window (seconds) around a record's expected arrival; 0: sleep in ``recv``.
    poll_s: float = 0.0

    def __init__(self, sock: socket.socket, decoder, capture=None) -> None:
        self.sock = sock
        self.polled_arrivals = 0  # records whose first bytes the poll found
        self._expected_wait: float | None = None
        self._poller = None
        self.decoder = decoder
        self.count = 0
        self.head = bytearray()  # the connection's first bytes (which protocol does the peer speak?)
        self.last_size = 0
        self.last_time = 0.0  # perf_counter() when the record read last had fully arrived
        self.last_raw: bytes | None = None  # its bytes, when it arrived within one receive
        self._capture = capture
        self._chunk = bytearray(RECV_CHUNK_BYTES)
        self._view = memoryview(self._chunk)
        self._pending: collections.deque = collections.deque()  # (record, wire size, arrival)
        self.deadline: float | None = None  # monotonic time by which read() must complete
        self.stall_timeout: float | None = None  # the per-receive timeout under a deadline

    def _recv(self, limit: int = 0) -> int:
        """One ``recv_into``; feeds what arrived unless ``limit`` (raw bytes) is given."""
        n = self.sock.recv_into(self._chunk, limit)
        if n:
            if self.count < HEAD_BYTES:
                self.head += self._view[:min(n, HEAD_BYTES - self.count)]
            self.count += n
            data = self._view[:n]
            if self._capture is not None:
                self._capture.write(data)
            if not limit:
                chunk_start, start = self.decoder.received, self.decoder.consumed
                records = self.decoder.feed(data)
                arrived = time.perf_counter()
                for record, end in zip(records, self.decoder.ends):
                    # A record that came in one receive keeps its bytes (a stage forwards a
                    # decode step's message and relays replies as bytes).
                    raw = bytes(data[start - chunk_start:end - chunk_start]) if start >= chunk_start else None
                    self._pending.append((record, end - start, arrived, raw))
                    start = end
        return n

    def _receive_first(self) -> int:
        """The receive that waits for a record to begin.  With :attr:`poll_s`, the wait is
        expected to last as long as the previous one did (decode steps repeat): the reader
        sleeps until ``poll_s`` before then (not at all when the wait is shorter than
        ``poll_s``) and polls the socket, yielding the CPU between polls, until ``poll_s``
        after it.  A sleeping reader pays for its wake-up on every
        message: on a virtual machine whose idle vCPU halts, tens of microseconds."""
        if not self.poll_s:
            return self._recv()
        started = time.perf_counter()
        if self._poll_near_arrival(started):
            self.polled_arrivals += 1
        n = self._recv()
        self._expected_wait = time.perf_counter() - started
        return n

    def _poll_near_arrival(self, started: float) -> bool:
        expected, window = self._expected_wait, self.poll_s
        pending = getattr(self.sock, "pending", None)  # TLS: decrypted bytes the socket cannot show
        if expected is None or not expected < MAX_POLLED_WAIT or (pending is not None and pending()):
            return False
        if self._poller is None:
            self._poller = select.poll()
            self._poller.register(self.sock, select.POLLIN)
        timeout = self.sock.gettimeout()
        # Within the socket's timeout: the receive that follows waits up to it once more.
        until = expected + window if timeout is None else min(expected + window, timeout)
        if expected > window and self._poller.poll(int(min(until, expected - window) * 1000)):
            return False  # it came early
        until += started
        while time.perf_counter() < until:
            if self._poller.poll(0):
                return True
            os.sched_yield()
        return False

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as part of a record."""
        return self.decoder.buffered + sum(pending[1] for pending in self._pending)

    @property
    def partial(self) -> int:
        """Bytes of a record begun but not yet complete (whole records waiting are not counted)."""
        return self.decoder.buffered

    def wait_readable(self, timeout: float | None) -> bool:
        """Block until at least one byte is buffered (False on a clean close)."""
        if self._pending or self.decoder.buffered or self.decoder.error is not None:
            return True
        self.sock.settimeout(timeout)
        try:
            return self._receive_first() > 0
        except ConnectionResetError:
            return False

    def read(self):
        """The next record, or None on a clean close between records.  With
        :attr:`deadline` set (a ``time.monotonic()`` value), every receive waits at most
        until it (and at most :attr:`stall_timeout`), then ``TimeoutError``."""
        while not self._pending:
            if self.decoder.error is not None:  # kept after the records before it were queued
                raise self.decoder.error.with_traceback(None)  # a fresh traceback each time, not a longer one
            if self.deadline is not None:
                left = self.deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError("message deadline passed")
                self.sock.settimeout(left if self.stall_timeout is None else min(left, self.stall_timeout))
            if not (self._recv() if self.decoder.buffered else self._receive_first()):
                try:
                    self.decoder.close()  # raises on a partial record
                except UnexpectedEofError as exc:  # kept as the socket's close, for a read again
                    self.decoder.error = PeerClosedError(exc.message, needed=exc.needed)
                    raise self.decoder.error from None
                return None
        record, self.last_size, self.last_time, self.last_raw = self._pending.popleft()
        return record

    def read_exact(self, n: int, gone: Callable[[], bool] | None = None) -> bytes:
        """``n`` raw bytes before any record (the READY handshake), never reading past them,
        within the socket's timeout; ``gone`` is asked every :data:`UPSTREAM_CHECK_S` of
        silence whether they are still wanted (True: ``ConnectionAbortedError``)."""
        if self._pending or self.decoder.buffered:
            raise RuntimeError("read_exact() after records were buffered")
        timeout = self.sock.gettimeout()
        deadline = None if timeout is None else time.monotonic() + timeout
        out = bytearray()
        try:
            while len(out) < n:
                if gone is not None:
                    left = UPSTREAM_CHECK_S if deadline is None else deadline - time.monotonic()
                    if left <= 0:
                        raise socket.timeout("timed out")
                    self.sock.settimeout(min(left, UPSTREAM_CHECK_S))
                try:
                    got = self._recv(n - len(out))
                except socket.timeout:
                    if gone is None or (deadline is not None and time.monotonic() >= deadline):
                        raise
                    if gone():
                        raise GivenUp() from None
                    continue
                if not got:
                    raise PeerClosedError()
                out += self._view[:got]
        finally:
            self.sock.settimeout(timeout)
        return bytes(out)


class SendStalled(TimeoutError):
    """A send that waited out its socket's timeout: the other end read nothing meanwhile (a
    peer that stops reading, told apart from one that stops sending)."""


class Peer:
    """One end of a TCP connection: one write per message, a :class:`SocketReader` to read.

    ``decoder`` parses what this end receives (default: replies).  ``capture_prefix``
    records the connection's bytes: what was sent to ``PREFIX-messages.bin``, what was
    received (READY and the replies) to ``PREFIX-replies.bin``.  ``send_delay`` (seconds)
    is slept before every send: an emulated one-way link delay.
    """

    send_delay: float = 0.0

    def __init__(self, sock: socket.socket, decoder=None, capture_prefix: str | None = None) -> None:
        self.sock = sock
        self._cap_out = self._cap_in = None
        if capture_prefix:
            self._cap_out = DiagnosticFile(capture_prefix + CAPTURE_SENT_SUFFIX, "--capture")
            self._cap_in = DiagnosticFile(capture_prefix + CAPTURE_RECEIVED_SUFFIX, "--capture")
        self.reader = SocketReader(sock, decoder if decoder is not None else StageReplyDecoder(), self._cap_in)
        self.sent = 0
        self.unasked = False  # bytes arrived between messages (open_between_messages)

    @property
    def received(self) -> int:
        return self.reader.count

    def send(self, data: bytes) -> None:
        if self.send_delay:
            time.sleep(self.send_delay)
        try:
            self.sock.sendall(data)
        except (socket.timeout, TimeoutError):
            raise SendStalled(f"peer read nothing of what was sent to it for more than {self.sock.gettimeout():.1f} s"
                              ) from None
        self.sent += len(data)
        if self._cap_out is not None:
            self._cap_out.write(data)

    def open_between_messages(self) -> bool:
        """Whether the connection is still usable while nothing is owed on it: False once the
        other end closed it (the socket turned readable with EOF) or sent bytes nobody asked
        for (:attr:`unasked` then True)."""
        sock = self.sock
        try:
            if self.reader.buffered:
                self.unasked = True
                return False
            if not select.select([sock], [], [], 0)[0]:
                return True
            timeout = sock.gettimeout()
            sock.setblocking(False)
            try:  # EOF, or bytes nobody asked for: either way the link is unusable
                self.unasked = bool(sock.recv(1))
            except (ssl.SSLWantReadError, BlockingIOError):
                return True  # only TLS housekeeping (e.g. a TLS 1.3 session ticket) had arrived
            finally:
                sock.settimeout(timeout)
        except (OSError, ValueError):
            pass
        return False

    def capturing_socket(self) -> "CountingSocket":
        """The socket for a handshake run outside the reader (the v17 setup): what passes
        through it is counted and captured like the records, and its first received bytes
        are kept in the reader's ``head``."""
        return CountingSocket(self)

    def read(self):
        """The next record; a close (clean or not) -> :class:`PeerClosedError`."""
        record = self.reader.read()
        if record is None:
            raise PeerClosedError()
        return record

    def recv_ready(self) -> None:
        recv_ready(self.reader.read_exact(4))

    def close(self) -> None:
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()
        for f in (self._cap_out, self._cap_in):
            if f is not None:
                f.close()


class CountingSocket:
    """``recv`` / ``send`` / ``sendall`` / timeouts of a :class:`Peer`'s socket, teed to the
    peer's counters and capture files."""

    def __init__(self, peer: Peer) -> None:
        self.peer = peer

    def settimeout(self, timeout) -> None:
        self.peer.sock.settimeout(timeout)

    def gettimeout(self):
        return self.peer.sock.gettimeout()

    def recv(self, n: int) -> bytes:
        data = self.peer.sock.recv(n)
        if data:
            reader = self.peer.reader
            if reader.count < HEAD_BYTES:
                reader.head += data[:HEAD_BYTES - reader.count]
            reader.count += len(data)
            if self.peer._cap_in is not None:
                self.peer._cap_in.write(data)
        return data

    def _sent(self, data) -> None:
        self.peer.sent += len(data)
        if self.peer._cap_out is not None:
            self.peer._cap_out.write(data)

    def send(self, data) -> int:
        n = self.peer.sock.send(data)
        self._sent(memoryview(data)[:n])
        return n

    def sendall(self, data) -> None:
        self.peer.send(data)


__all__ = ["RECV_CHUNK_BYTES", "MAX_POLLED_WAIT", "ACCEPT_RETRY_S", "UPSTREAM_CHECK_S", "connect", "accept_connection",
           "parse_address", "is_wildcard", "GivenUp", "PeerClosedError", "SendStalled", "SocketReader", "Peer",
           "CountingSocket"]
