"""One skippy stage (run as a process by ``skippy-wire serve``), mirroring skippy-server
0.76.1's binary transport.

A stage owns the layer range ``[layer_start, layer_end)`` of a model and listens on TCP.
For every upstream connection it

1. connects to its downstream stage (when it has one) and waits for that stage's READY,
2. sends READY upstream (wire-format.md 11.1), so READY means "the whole chain is up",
3. then loops: read one stage message with its codec policy (4.5, 8.3), execute it on
   the runtime, and either forward the result downstream (9) and relay the downstream
   reply, or -- on the terminal stage -- reply itself (11.2).

Kinds handled (2.1): ConfigureGeneration (sampling for the session, forwarded to every stage), PrefillEmbd /
PrefillFinalEmbd, DecodeEmbd, TrimSession, Stop. The first stage embeds ``msg.tokens``; later stages take the
decoded activation. The terminal stage replies PredictedToken for kinds that require a predicted reply and Ack
otherwise. Stop frees the session and is acknowledged; the connection stays open.

Sessions are keyed by ``session_id`` and belong to the connection that opened them; a closed connection
frees its sessions.  Runtime calls are serialised by one lock.  Decode ahead (:mod:`.decode_ahead`): a
first stage computes a session's next decode step while its reply makes the round trip to the driver.

Limits (:mod:`.admission`, docs/security.md): connections, sessions per connection, FIFO lanes, a
whole-message deadline, a message size this stage could execute (checked from the prefix), an idle timeout
(for sessions that stop computing too); optional mutual TLS (:mod:`.tls`). A peer that disconnects
mid-message, sends bytes that do not parse, stalls or breaks a limit gets a logged error and its connection
closed; a failing downstream closes the upstream connection too, and an upstream that leaves while its reply
is awaited downstream closes the downstream one.

Events: ``events`` gets each stopped session's counters, ``{"event": "session", ...}`` (``serve`` prints them).
"""

from __future__ import annotations

import contextlib
import io
import logging
import socket
import ssl
import threading
import time
from typing import Callable

from ..errors import StageError, StageRuntimeError, StateVersionMismatch, WireError, os_reason, with_detail
from ..stage import runtime
from ..wire.activation_frame import (DISCARD_STALE_WINDOWS, STAGE_STATE_VERSION_V15, STAGE_STATE_VERSION_V17,
                                    WireMessageKindV16)
from ..wire.constants import WIRE_SIZE_TEXT, ActivationCodec, CodecPolicy
from ..wire.frame import predicted_reply_bytes, send_reply_ack, send_reply_predicted, write_reply
from ..wire.messages import StageWireMessage, WireMessageKind as K
from ..wire.replies import StageReplyStats, WireReplyKind
from ..wire.setup import SetupError, SetupRole
from .arguments import server_arguments
from .admission import (COMPUTED_KINDS, DEFAULT_IDLE_TIMEOUT, DOWNSTREAM_SETUP_WORDS, MAX_DOWNSTREAM_SETUPS,
                        ConnectionLimit, LaneGate, SessionAdmission, StageLimits, check_position, check_runnable,
                        idle_sessions, max_message_bytes, overdue_message)
from .protocol_io import LinkProtocol, link_identity, peer_gone, rows_boundary
from .batching import DecodeBatcher, DecodeStep
from .connlog import ConnectionLog, ShedAwareLog
from .decode_ahead import DecodeAhead
from .session_state import DecodeTimer, FreedSessions, ServedSession
from .tls import (PLAIN_EXPOSED_WARNING, TLS_CLIENT_ON_PLAIN_STAGE, HandshakeTimeout, accept_tls, handshake_failure,
                  is_loopback, link_error, starts_tls_handshake)
from .transport import GivenUp, Peer, PeerClosedError, SendStalled, accept_connection, connect

log = logging.getLogger("skippy_wire.net.server")

#: Prefill kinds whose compute and edge timings a stage reports (wire-format.md 11.3).
_OBSERVED_PREFILL_KINDS = (K.PREFILL_EMBD, K.PREFILL_FINAL_EMBD)
DEFAULT_IO_TIMEOUT = 30.0
DEFAULT_REPLY_TIMEOUT = 120.0
#: A downstream that has not taken a connection within this long is reported unreachable
#: (the same wait would hold the driver, whose READY it is); sooner when the upstream leaves.
DOWNSTREAM_CONNECT_TIMEOUT = 10.0

def _reply_bytes(writer: Callable, *args) -> bytes:
    buf = io.BytesIO()
    writer(buf, *args)
    return buf.getvalue()


class StageServer:
    """A listening stage.  ``serve_forever()`` accepts connections until ``shutdown()``.

    Parameters: ``backend`` (a :class:`RuntimeBackend` or a fake with its methods), ``config``
    (:class:`skippy_wire.wire.forwarding.StageConfig`), ``downstream`` (``(host, port)`` of the next stage
    or None on the terminal stage), ``host``/``port`` to bind (port 0 picks a free one), ``io_timeout``
    (seconds a peer may stall in the middle of a message), ``idle_timeout`` (seconds a connection may sit
    between messages; None = forever), ``reply_timeout`` (seconds to wait for the downstream reply),
    ``capture`` (path prefix: record the downstream hop's bytes to ``PREFIX-messages.bin`` and
    ``PREFIX-replies.bin``), ``events`` (callable receiving event dicts), ``compute_trace`` (a text file
    receiving one ``START_NS END_NS ROWS`` line per stretch of compute), ``protocol`` (the state version
    every link speaks: 15, 16 or 17), ``identity`` (v17: the ``StageSetupConfig`` the handshake checks;
    default: from ``config``) and ``plan`` (v17: the ``PlanStage`` list an upstream sender is checked
    against), ``link_delay`` (seconds slept before each send over a stage-to-stage link: downstream, and
    upstream unless this is stage 0, whose upstream is the driver), ``prefill_overlap`` (acknowledge a
    forwarded PrefillEmbd at once instead of after the downstream's Ack, so this stage computes the next
    chunk while the downstream computes this one), ``limits`` (a :class:`.admission.StageLimits`) and
    ``tls`` (a :class:`.tls.TlsConfig`: mutual TLS on both sides), ``poll_s`` (seconds: busy-poll this long
    around a message's or reply's expected arrival instead of sleeping through the wait,
    :class:`.transport.SocketReader`, while at most one session decodes here; 0: sleep), ``decode_ahead``
    (on a first stage: compute a session's next decode step before its message arrives, see the module doc).
    """

    def __init__(self, backend, config, *, downstream: tuple[str, int] | None = None,
                 host: str = "127.0.0.1", port: int = 0, io_timeout: float = DEFAULT_IO_TIMEOUT,
                 idle_timeout: float | None = DEFAULT_IDLE_TIMEOUT, reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
                 capture: str | None = None, events: Callable[[dict], None] | None = None,
                 compute_trace=None, protocol: int = STAGE_STATE_VERSION_V15, identity=None,
                 plan=None, link_delay: float = 0.0, prefill_overlap: bool = True,
                 limits: StageLimits | None = None, tls=None, poll_s: float = 0.0, decode_ahead: bool = True) -> None:
        protocol, io_timeout, idle_timeout, reply_timeout, poll_s, link_delay = server_arguments(
            host, port, protocol, io_timeout, idle_timeout, reply_timeout, poll_s, link_delay)
        self.backend, self.poll_s, self.compute_trace, self.protocol = backend, poll_s, compute_trace, protocol
        self.identity = identity or link_identity(config, downstream is not None)
        self.plan, self.config, self.downstream = plan, config, downstream
        self.io_timeout, self.idle_timeout, self.reply_timeout = io_timeout, idle_timeout, reply_timeout
        self.capture, self.link_delay, self.prefill_overlap = capture, link_delay, prefill_overlap
        self.events = events or (lambda event: None)
        self.clog = ConnectionLog(log)  # lines about connections (peers decide how many)
        self.codec = ActivationCodec(config.activation_codec)
        self.policy = CodecPolicy(config.activation_codec_policy)
        if not self.policy.compatible(self.codec):
            raise ValueError(f"activation codec policy {self.policy.rust_name} is incompatible with "
                             f"configured codec {self.codec.rust_name}")
        if backend.is_terminal and downstream is not None:
            raise ValueError("the terminal stage (owning the last layer) cannot have a downstream")
        if not backend.is_terminal and downstream is None:
            raise ValueError(f"stage {config.stage_index} ends at layer {backend.layer_end}, not the last "
                             "layer, so it needs --downstream")
        self._runtime_lock = threading.Lock()
        self.batcher = DecodeBatcher(self._run_batch, self._run_step, self._runtime_lock,
                                     on_compute=self._trace_compute)
        self.ahead = DecodeAhead(backend, self.batcher, self._runtime_lock) \
            if decode_ahead and backend.is_source else None
        self._stop = threading.Event()
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        self._conn_seq = 0
        self._serving = False  # shutdown() closes the listener of a server never started
        self.limits = limits = limits or StageLimits()
        self.max_message_bytes = limits.max_message_bytes or max_message_bytes(config.ctx_size, backend.n_embd)
        self.connection_limit = ConnectionLimit(limits.max_connections)
        self.setups = LaneGate(MAX_DOWNSTREAM_SETUPS, 0.0, *DOWNSTREAM_SETUP_WORDS)  # no wait: see its doc
        self.admission = SessionAdmission(getattr(backend, "lane_count", None), limits.lane_wait,
                                          limits.max_sessions_per_connection)
        self._tls_server, self._tls_client = (tls.server_context(), tls.client_context()) if tls else (None, None)
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.address = self._listener.getsockname()[:2]
        if self._tls_server is None and not is_loopback(self.address[0]):
            log.warning(PLAIN_EXPOSED_WARNING, *self.address)

    # -- lifecycle ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        with self._conn_lock:
            if self._stop.is_set():  # shut down before it served: shutdown() closed the listener
                return
            self._serving = True
        self._listener.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    accepted = accept_connection(self._listener, self._stop, self.clog.error)
                except OSError:  # the listener was closed
                    break
                if accepted is None:
                    continue
                sock, addr = accepted
                with self._conn_lock:
                    if len(self._connections) >= self.connection_limit.limit:
                        self._shed(self.connection_limit.shed_quietest())
                    full = len(self._connections) >= self.connection_limit.limit
                    if not full:
                        self._conn_seq = seq = self._conn_seq + 1
                        self._connections.add(sock)
                if full:
                    self.connection_limit.refuse(sock, addr)
                    continue
                try:
                    threading.Thread(target=self._serve_connection, args=(sock, addr, seq),
                                     name=f"stage-conn-{seq}", daemon=True).start()
                except RuntimeError as exc:  # no thread to spare: this connection only
                    self.clog.error("connection %d from %s:%d: %s; closing", seq, addr[0], addr[1], exc)
                    with self._conn_lock:
                        self._connections.discard(sock)
                    sock.close()
        finally:
            self._listener.close()

    def _shed(self, sock: socket.socket | None) -> None:
        if sock is not None:  # a connection shed at the limit (called under the lock)
            self._connections.discard(sock)  # counted out now, not when its thread ends
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests, in-process pipelines)."""
        thread = threading.Thread(target=self.serve_forever, name="stage-accept", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        self._stop.set()
        with self._conn_lock:
            if not self._serving:  # else serve_forever closes it, not under its accept
                self._listener.close()
            for sock in list(self._connections):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    # -- one connection ----------------------------------------------------------------

    def _serve_connection(self, sock: socket.socket, addr, seq: int) -> None:
        name = f"connection {seq} from {addr[0]}:{addr[1]}"
        clog = ShedAwareLog(self.clog, name, lambda: self.connection_limit.was_shed(seq))
        upstream = Peer(sock)
        opened: list = []
        sessions: dict[int, ServedSession] = {}
        freed = FreedSessions()
        quiet = self.connection_limit.quiet
        quiet(seq, upstream.sock)
        try:
            if self._tls_server is not None:
                upstream = Peer(accept_tls(sock, self._tls_server, self.io_timeout))
                with self._conn_lock:  # the wrapped socket replaces the plain one (the limit, shutdown())
                    self._connections.discard(sock)
                    self._connections.add(upstream.sock)
                quiet(seq, upstream.sock)
            upstream.send_delay = self.link_delay if self.config.stage_index > 0 else 0.0
            link = LinkProtocol(self.protocol, upstream, reads="messages", n_embd=self.backend.n_embd,
                                codec=self.codec, policy=self.policy, max_message_bytes=self.max_message_bytes,
                                max_tokens=self.config.ctx_size)

            def prepare() -> None:
                if self.downstream is not None:
                    opened.append(self._open_downstream(seq, upstream.sock))

            serves = SetupRole.TOKENS_AND_CONTROL if self.backend.is_source else SetupRole.ACTIVATION
            role = link.accept(self.identity, self._profile("input"), plan=self.plan, prepare=prepare,
                               timeout=self.io_timeout, serves=serves)
            downstream = opened[0] if opened else None
            clog.info("%s: ready (state version %d, %s)", name, self.protocol, role.value)
            while not self._stop.is_set():
                upstream.reader.poll_s = self._poll_window()
                msg = self._read_message(link, clog, sessions, freed, downstream)
                if msg is None:
                    break
                timer = DecodeTimer(upstream.reader.last_time) if msg.kind == K.DECODE_EMBD else None
                if not sessions:
                    self.connection_limit.busy(seq)
                    if downstream is not None and not downstream.peer.open_between_messages():
                        # the next stage closed the idle link (its idle timeout, or shed), or wrote to it unasked
                        downstream.peer.close()
                        unasked, downstream = downstream.peer.unasked, self._open_downstream(seq, upstream.sock)
                        opened[0] = downstream
                        why = "sent bytes nobody asked for" if unasked else "had closed the idle link"
                        (clog.warning if unasked else clog.info)("%s: downstream %s; reconnected", name, why)
                reply = self._handle(msg, sessions, freed, upstream, downstream, timer)
                # A peer that stops reading its replies stalls like one that stops writing (quiet if sessionless).
                upstream.sock.settimeout(self.io_timeout)
                if not sessions:
                    quiet(seq, upstream.sock)
                upstream.send(reply)
                session = sessions.get(msg.session_id)
                if session is not None and msg.kind in COMPUTED_KINDS:
                    session.last_compute = time.monotonic()
                if timer is not None and session is not None:
                    timer.add_to(session.stats.decode_path_us, time.perf_counter())
                if session is not None and session.next_step is not None:
                    self.ahead.compute(session)
        except StateVersionMismatch as exc:
            clog.error("%s: %s; closing", name, self._diagnosis(upstream, str(exc)))
        except SetupError as exc:
            if upstream.received == 0:  # connected and left (a port check), as a v15 peer may; a silent one: v15/16
                clog.info("%s: closed by peer before its setup", name)
            else:
                failed = f"stage setup failed: {with_detail(exc)}"
                clog.error("%s: %s; closing", name, self._diagnosis(upstream, failed))
        except PeerClosedError:
            clog.error("%s: peer disconnected in the middle of a message; closing", name)
        except (ConnectionResetError, BrokenPipeError):  # a broken pipe: it left before its reply
            clog.error("%s: peer reset the connection%s; closing", name,
                            " in the middle of a message" if upstream.reader.partial else "")
        except (socket.timeout, TimeoutError) as exc:  # a TLS handshake's deadline says so itself
            stalled = f"peer stalled for more than {self.io_timeout:.1f} s"
            clog.error("%s: %s; closing", name, exc if isinstance(exc, (HandshakeTimeout, SendStalled)) else stalled)
        except WireError as exc:
            malformed = f"malformed stage message ({exc.kind}: {with_detail(exc)})"
            clog.error("%s: %s; closing", name, self._diagnosis(upstream, malformed))
        except (StageError, ConnectionError, OSError) as exc:  # a peer that sent nothing and left: its choice
            if not self._stop.is_set():  # (a TLS peer sent its handshake: refused, it is an error)
                left = upstream.received == 0 and self._tls_server is None and peer_gone(upstream.sock)
                (clog.info if left else clog.error)("%s: %s; closing", name, exc)
        except StageRuntimeError as exc:  # e.g. context full
            clog.error("%s: stage runtime error: %s; closing", name, exc)
        except Exception as exc:  # noqa: BLE001 -- a connection must never kill the server
            clog.unexpected("%s: unexpected error (%s); closing", name, exc)
        finally:
            self.connection_limit.ended(seq)
            for session_id in list(sessions):
                self._free(sessions.pop(session_id), session_id)
            for down in opened:
                down.peer.close()
            upstream.close()
            with self._conn_lock:
                self._connections.discard(sock)
                self._connections.discard(upstream.sock)

    def _diagnosis(self, upstream: Peer, text: str) -> str:
        """``text``, or the cause it hides: a TLS handshake this plain stage cannot answer, another model upstream."""
        if self._tls_server is None and starts_tls_handshake(upstream.reader.head):
            return TLS_CLIENT_ON_PLAIN_STAGE
        if text.endswith(f"{WIRE_SIZE_TEXT})"):  # most often an upstream of another model: a width of its own
            return f"{text}; does the upstream run this stage's model (n_embd {self.backend.n_embd})?"
        return text

    def _profile(self, edge: str):
        """The v17 activation profile of this stage's input or output edge."""
        b = self.backend
        if self.protocol != STAGE_STATE_VERSION_V17 or (edge == "input" and b.is_source):
            return None
        source = getattr(b, f"{edge}_boundary", None)
        boundary = (source() if source is not None else None) or rows_boundary(b.n_embd)
        if edge == "input":
            return runtime.boundary_profile(boundary, self.config.stage_index - 1, 0, b.layer_start,
                                            max_tokens=self.config.ctx_size)
        return runtime.boundary_profile(boundary, self.config.stage_index, b.layer_start, b.layer_end,
                                        max_tokens=self.config.ctx_size)

    def _open_downstream(self, seq: int, upstream: socket.socket) -> LinkProtocol:
        with self.setups.held(lambda: peer_gone(upstream)):  # a bounded number at once (a loop of downstreams)
            return self._set_up_downstream(seq, upstream)

    def _set_up_downstream(self, seq: int, upstream: socket.socket) -> LinkProtocol:
        host, port = self.downstream
        try:
            sock = connect(host, port, timeout=min(self.reply_timeout, DOWNSTREAM_CONNECT_TIMEOUT),
                           tls=self._tls_client, abandoned=lambda: self._stop.is_set() or peer_gone(upstream))
        except ssl.SSLError as exc:
            raise StageError(handshake_failure(f"downstream {host}:{port}", exc)) from None
        except GivenUp:  # its upstream left meanwhile (a port check): no failed connect
            raise StageError(f"upstream left while connecting to downstream {host}:{port}") from None
        except OSError as exc:
            raise StageError(f"cannot connect to downstream {host}:{port}: {os_reason(exc)}") from exc
        capture = f"{self.capture}-{seq}" if self.capture and seq > 1 else self.capture
        peer = Peer(sock, capture_prefix=capture)
        link = LinkProtocol(self.protocol, peer, who=f"downstream {host}:{port}", upstream=upstream)
        peer.send_delay = self.link_delay
        try:
            link.connect(SetupRole.ACTIVATION, self.identity, self._profile("output"), timeout=self.reply_timeout)
        except StageError:  # a version mismatch, TLS required, or its upstream gone meanwhile
            peer.close()
            raise
        except SetupError as exc:
            peer.close()
            raise StageError(f"stage setup with downstream {host}:{port} failed: {with_detail(exc)}") from exc
        except (WireError, OSError) as exc:
            peer.close()
            why = "it closed the connection (its log says why)" if isinstance(exc, PeerClosedError) else link_error(exc)
            raise StageError(f"downstream {host}:{port} {link.unanswered}: {why}") from exc
        return link

    def _read_message(self, link: LinkProtocol, clog: ShedAwareLog, sessions: dict, freed: FreedSessions,
                      downstream: LinkProtocol | None):
        """Read one message; None (logged) on a clean close or an idle timeout between messages (a
        pooled connection's normal end), or, an error, when all its sessions have computed nothing
        for the idle timeout, whatever else it sends or has queued (their lanes were held for nothing);
        one such session beside others that compute is freed alone (its lane and cache, on this stage and,
        by a Stop, the later ones), its id kept in ``freed``."""
        peer, idle = link.peer, self.idle_timeout
        while True:
            wait = idle
            if idle is not None and sessions:
                stale, wait = idle_sessions(sessions, idle, time.monotonic())
                if len(stale) == len(sessions):
                    clog.error("%s: its sessions (%s) computed nothing for more than %g s (--idle-timeout); "
                               "closing", clog.name, ", ".join(map(str, sessions)), idle)
                    return None
                for sid in stale:
                    clog.error("%s: session %d computed nothing for more than %g s (--idle-timeout); freed",
                               clog.name, sid, idle)
                    self._free(sessions.pop(sid), sid)
                    freed.add(sid)
                    if downstream is not None:  # the later stages free it too (its Ack read as an overlapped chunk's)
                        downstream.send_within(downstream.encode(StageWireMessage.stop(0, sid)), self.reply_timeout)
                        downstream.unread_replies += 1
            try:
                if not peer.reader.wait_readable(wait):
                    clog.info("%s: closed by peer", clog.name)
                    return None
                break
            except (socket.timeout, TimeoutError):
                if not sessions:
                    clog.info("%s: idle for more than %g s; closing", clog.name, idle)
                    return None
        peer.reader.deadline = time.monotonic() + self.limits.message_timeout
        peer.reader.stall_timeout = self.io_timeout
        try:
            return link.read_message()
        except (socket.timeout, TimeoutError):
            if time.monotonic() < peer.reader.deadline:
                raise
            raise overdue_message(self.limits.message_timeout, peer.reader.decoder) from None
        finally:
            peer.reader.deadline = None

    # -- execution -----------------------------------------------------------------------

    def _handle(self, msg, sessions: dict, freed: FreedSessions, upstream: Peer, downstream: LinkProtocol | None,
                timer: DecodeTimer | None = None) -> bytes:
        """Execute ``msg``, just read from ``upstream``, and return the reply."""
        if msg.kind == DISCARD_STALE_WINDOWS:  # read from v16 on, executed nowhere here
            raise StageError(f"unsupported stage message kind {WireMessageKindV16(msg.kind).name} ({msg.kind})")
        kind = K(msg.kind)  # the v16/v17 readers give a plain int
        check_runnable(msg, self.backend)
        session = sessions.get(msg.session_id)
        if session is None and freed.claim(msg.session_id) and kind not in (K.STOP, K.CONFIGURE_GENERATION):
            raise StageError(f"{kind.name} for session {msg.session_id}, which was freed: it computed nothing for "
                             f"more than {self.idle_timeout:g} s (--idle-timeout)")
        if kind == K.TRIM_SESSION:  # checked before a session is opened for it: a lane and a cache
            have = 0 if session is None else session.asked_tokens
            if not 0 <= msg.pos_start <= have:
                raise StageError(f"TRIM_SESSION to position {msg.pos_start}, but session {msg.session_id} "
                                 f"holds {have} tokens")
        if session is None and kind in (K.STOP, K.TRIM_SESSION):  # nothing here to stop or trim: no lane taken
            return self._relay(msg, downstream, None) if downstream else _reply_bytes(send_reply_ack)
        if session is None:
            session = sessions[msg.session_id] = self.admission.open(
                len(sessions), msg.session_id, lambda: ServedSession(self.backend.create_session()), self._runtime_lock,
                lambda: peer_gone(upstream.sock))
        session.stats.messages += 1
        session.stats.received_bytes += upstream.reader.last_size
        ahead = self.ahead.claim(msg, session) if session.ahead is not None else None
        if kind == K.STOP:
            reply = self._relay(msg, downstream, session) if downstream else _reply_bytes(send_reply_ack)
            self._free(sessions.pop(msg.session_id), msg.session_id)
            return reply
        if kind == K.CONFIGURE_GENERATION:
            session.sampling = msg.sampling
            session.chat_metadata = msg.chat_sampling_metadata
            return self._relay(msg, downstream, session) if downstream else _reply_bytes(send_reply_ack)
        if kind == K.TRIM_SESSION:
            with self._runtime_lock:
                self.backend.trim(session.runtime, msg.pos_start)
            return self._relay(msg, downstream, session) if downstream else _reply_bytes(send_reply_ack)
        if kind not in (K.PREFILL_EMBD, K.PREFILL_FINAL_EMBD, K.DECODE_EMBD):
            raise StageError(f"unsupported stage message kind {kind.name} ({int(kind)})")

        sampling = msg.sampling if msg.sampling is not None else session.sampling
        tokens = list(msg.tokens)
        if len(tokens) != msg.token_count:  # every stage's runtime takes a row per token id
            raise StageError(f"message counts {msg.token_count} tokens but carries {len(tokens)} token ids")
        if ahead is None:
            check_position(msg, session.runtime, self.backend, self._runtime_lock)
        started = time.perf_counter()
        if ahead is not None:  # computed before the message arrived
            predicted, frame = ahead.predicted, ahead.frame
            if timer is not None:
                timer.compute_start = timer.compute_end = time.perf_counter()
                timer.ahead_s = ahead.compute_s
            started -= ahead.compute_s
            session.stats.decode_tokens += 1
            session.stats.decoded_ahead += 1
            if ahead.batch_size > 1:
                session.stats.batched_decode_steps += 1
        elif kind == K.DECODE_EMBD:
            step = DecodeStep(session.runtime, tokens[0], msg.activation, msg.state.flags, sampling)
            predicted, frame = self.batcher.decode(step)
            if timer is not None:
                timer.compute_end = time.perf_counter()
                timer.compute_start = timer.compute_end - step.compute_s
            session.stats.decode_tokens += 1
            if step.batch_size > 1:
                session.stats.batched_decode_steps += 1
        else:
            step = DecodeStep(session.runtime, -1, msg.activation, msg.state.flags, sampling, tokens=tokens,
                              sample=kind.requires_predicted_reply)
            predicted, frame = self.batcher.decode(step)
            session.stats.prefill_tokens += len(tokens)
        compute_us = int((time.perf_counter() - started) * 1e6)
        session.stats.compute_ms += compute_us / 1000.0
        if self.ahead is not None and downstream is None and sampling is None:
            self.ahead.plan(msg, session, predicted)  # a greedy one-stage pipeline: the token is our own

        if downstream is None:
            if kind == K.DECODE_EMBD:  # the per-token reply, from a template (stats: prefill only)
                return predicted_reply_bytes(predicted)
            stats = self._own_stats(kind, compute_us, msg.token_count)
            if kind.requires_predicted_reply:
                return _reply_bytes(send_reply_predicted, predicted, stats)
            return _reply_bytes(send_reply_ack, stats)
        return self._forward(msg, frame, session, downstream, compute_us, timer, upstream.reader.last_raw)

    def _run_step(self, step: DecodeStep) -> tuple:
        """One decode step or prefill chunk alone (the batcher holds the runtime lock)."""
        if step.tokens is None:
            return self.backend.decode(step.session, step.token, step.activation, step.state_flags,
                                       sampling=step.sampling)
        return self.backend.prefill(step.session, step.tokens, step.activation, step.state_flags,
                                    sample=step.sample, sampling=step.sampling)

    def _run_batch(self, steps) -> list:
        """Several sessions' steps as one native batch: a decode batch, or with a prefill chunk one iteration."""
        if all(step.tokens is None for step in steps):
            return self.backend.decode_batch(steps)
        return self.backend.iteration_batch(steps)

    def _poll_window(self) -> float:
        """``poll_s`` while at most one session decodes here, else 0 (sleep): with several, the stage has other
        work while a message is out, and polling would take the GIL and cores from the batches (docs/benchmarks.md)."""
        return self.poll_s if self.batcher.decoding <= 1 else 0.0

    def _trace_compute(self, start_ns: int, end_ns: int, rows: int) -> None:
        """One stretch of compute, as ``START_NS END_NS ROWS`` (CLOCK_MONOTONIC, comparable
        across the stage processes of one machine; the steps it ran), with a trace file."""
        if self.compute_trace is not None:
            self.compute_trace.write(f"{start_ns} {end_ns} {rows}\n")

    def _own_stats(self, kind: int, compute_us: int, token_count: int):
        """Prefill compute observation of this stage (wire-format.md 11.3)."""
        stats = StageReplyStats()
        if kind in _OBSERVED_PREFILL_KINDS and hasattr(stats, "observe_prefill_compute"):
            stats.observe_prefill_compute(self.config.stage_index, compute_us, token_count)
        return stats

    def _forward(self, msg, frame, session: ServedSession, downstream: LinkProtocol, compute_us: int,
                 timer: DecodeTimer | None = None, raw: bytes | None = None) -> bytes:
        if frame is None:
            raise StageError("the runtime produced no activation frame to forward")
        try:
            forwarded = downstream.forward(self.config, msg, frame, self.backend.n_embd, raw)
        except (WireError, ValueError, StageRuntimeError) as exc:
            raise StageError(f"cannot forward {msg.kind!r}: {exc}") from exc
        data, codec = forwarded.data, forwarded.codec.identity()
        st = session.stats
        st.encode_ms += forwarded.activation_encode_ms
        st.forwarded_messages += 1
        st.forwarded_bytes[codec] = st.forwarded_bytes.get(codec, 0) + len(data)
        st.activation_bytes[codec] = st.activation_bytes.get(codec, 0) + forwarded.activation_bytes
        st.codec_counts[codec] = st.codec_counts.get(codec, 0) + 1
        if timer is not None:
            timer.encoded = time.perf_counter()
        if self.prefill_overlap and msg.kind == K.PREFILL_EMBD:
            # Overlap: send the chunk on and acknowledge it now; the downstream's Ack is read
            # (and checked) before the reply to the next message that needs one.
            downstream.send_within(data, self.reply_timeout)
            downstream.unread_replies += 1
            return _reply_bytes(send_reply_ack, self._own_stats(msg.kind, compute_us, msg.token_count))
        return self._exchange(msg, data, downstream, session, compute_us, forwarded.activation_bytes, timer)

    def _relay(self, msg, downstream: LinkProtocol, session: ServedSession | None) -> bytes:
        """Forward an activation-less control message as is and relay the reply."""
        return self._exchange(msg, downstream.encode(msg), downstream, session, None, 0)

    def _exchange(self, msg, data: bytes, downstream: LinkProtocol, session, compute_us, activation_bytes,
                  timer: DecodeTimer | None = None) -> bytes:
        started = time.perf_counter()
        downstream.send_within(data, self.reply_timeout)
        written = time.perf_counter()
        owed = downstream.read_owed_replies(self.reply_timeout, self._poll_window())
        if downstream.peer.reader.buffered:  # relayed later, it would answer the next message: every reply shifted
            raise StageError(f"downstream {self.downstream[0]}:{self.downstream[1]} sent bytes nobody asked for")
        done = time.perf_counter()
        if timer is not None:
            timer.sent, timer.replied = written, done
        if session is not None:
            session.stats.downstream_wait_ms += (done - started) * 1000.0
        reply = owed[-1]
        if self.ahead is not None and session is not None \
                and reply.kind in (WireReplyKind.PREDICTED_TOKEN, WireReplyKind.PREDICTED_TOKENS):
            self.ahead.plan(msg, session, int(reply.predicted))
        observed = compute_us is not None and msg.kind in _OBSERVED_PREFILL_KINDS
        relayed = downstream.peer.reader.last_raw
        if len(owed) == 1 and not observed and relayed is not None:
            return relayed  # unchanged: relayed as received (a reply's encoding is canonical)
        for ack in owed[:-1]:  # the Acks of overlapped prefill chunks, in order
            if ack.kind != WireReplyKind.ACK:
                raise StageError(f"downstream {self.downstream[0]}:{self.downstream[1]} answered an "
                                 f"overlapped PrefillEmbd with reply kind {int(ack.kind)}, not Ack")
            reply.stats.merge(ack.stats)
        if observed:
            stats = reply.stats
            if hasattr(stats, "observe_prefill_edge_transport"):
                stats.observe_prefill_edge_transport(self.config.stage_index, int((written - started) * 1e6),
                                                     int((done - written) * 1e6), activation_bytes)
                stats.observe_prefill_compute(self.config.stage_index, compute_us, msg.token_count)
        return write_reply(reply)

    def _free(self, session: ServedSession, session_id: int) -> None:
        self.batcher.forget(session.runtime)
        try:
            with self._runtime_lock:
                self.backend.free_session(session.runtime)
        finally:
            self.admission.release()
        self.events({"event": "session", "stage": self.config.stage_index, "session_id": session_id,
                     **session.stats.as_dict()})


__all__ = ["DEFAULT_IO_TIMEOUT", "DEFAULT_REPLY_TIMEOUT", "DOWNSTREAM_CONNECT_TIMEOUT", "StageServer"]
