"""One skippy stage process (``skippy-wire serve``), mirroring skippy-server 0.76.1's binary
transport.

A stage owns the layer range ``[layer_start, layer_end)`` of a model and listens on TCP.
For every upstream connection it

1. connects to its downstream stage (when it has one) and waits for that stage's READY,
2. sends READY upstream (wire-format.md 11.1), so READY means "the whole chain is up",
3. then loops: read one stage message with its codec policy (4.5, 8.3), execute it on
   the runtime, and either forward the result downstream (9) and relay the downstream
   reply, or -- on the terminal stage -- reply itself (11.2).

Kinds handled (2.1): ConfigureGeneration (sampling for the session, forwarded to every
stage), PrefillEmbd / PrefillFinalEmbd, DecodeEmbd, TrimSession, Stop.  The first stage
embeds ``msg.tokens``; later stages take the decoded activation.  The terminal stage
replies PredictedToken for kinds that require a predicted reply and Ack otherwise.
Stop frees the session and is acknowledged; the connection stays open.

Sessions are keyed by ``session_id`` and belong to the connection that opened them; a
closed connection frees its sessions.  Runtime calls are serialised by one lock, so any
number of connections may be open at once.

Faults: a peer that disconnects mid-message, sends bytes that do not parse, or stalls in
the middle of a message (``--io-timeout``) gets a logged error and its connection
closed; the listener keeps accepting.  A downstream that fails or stalls closes the
upstream connection too, so the driver sees the failure instead of hanging.

Events.  The CLI prints one JSON object per line on stdout: ``{"event": "listening",
"host": ..., "port": ...}`` once the socket is bound (the driver waits for it), and
``{"event": "session", ...}`` with per-session traffic counters when a session stops.
Logs go to stderr.
"""

from __future__ import annotations

import argparse
import io
import json
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..wire.constants import READY_BYTES, ActivationCodec, CodecPolicy
from ..errors import StageError, UnexpectedEofError, WireError

log = logging.getLogger("skippy_wire.net.server")

#: Kinds the terminal stage answers with a predicted token (wire-format.md 2.1).
REQUIRES_PREDICTED_REPLY = frozenset({2, 4, 6, 8, 9, 21})

DEFAULT_IO_TIMEOUT = 30.0
DEFAULT_REPLY_TIMEOUT = 120.0

EventSink = Callable[[dict], None]


# --------------------------------------------------------------------------------------
# Runtime adapter
# --------------------------------------------------------------------------------------


class RuntimeBackend:
    """What the server needs from a stage runtime, over ``skippy_wire.stage.runtime``.

    Tests substitute an object with the same methods (a fake runtime), so the server
    logic is exercised without a model.
    """

    def __init__(self, model: Any) -> None:
        from ..stage import runtime

        self._runtime = runtime
        self.model = model
        self.n_embd = int(model.n_embd)
        self.is_source = bool(model.is_source)
        self.is_terminal = bool(model.is_terminal)
        self.layer_start = int(model.layer_start)
        self.layer_end = int(model.layer_end)
        self.stage_index = int(getattr(model, "stage_index", 0))
        self._boundary = False  # the model's input boundary, fetched on first use

    @classmethod
    def open(cls, path: str | Path, layer_start: int, layer_end: int, *, stage_index: int = 0,
             ctx_size: int = 512, n_threads: int | None = None, lane_count: int = 4) -> "RuntimeBackend":
        from ..stage import runtime

        model = runtime.StageModel.open(
            path, layer_start, layer_end, stage_index=stage_index, ctx_size=ctx_size,
            lane_count=lane_count, n_threads=n_threads,
        )
        return cls(model)

    def n_layer(self) -> int:
        return int(self.model.n_layer)

    def create_session(self) -> Any:
        return self.model.create_session()

    def free_session(self, session: Any) -> None:
        close = getattr(session, "close", None) or getattr(session, "free", None)
        if close is not None:
            close()

    def _input(self, activation: bytes, token_count: int, state_flags: int):
        if self.is_source:
            return None
        from ..wire.constants import activation_frame_flags_from_state_flags

        if self._boundary is False:
            self._boundary = self.model.input_activation_boundary()
        return self._runtime.frame_from_wire(
            activation, token_count, self.n_embd, self.stage_index - 1, 0, self.layer_start,
            activation_frame_flags_from_state_flags(state_flags), boundary=self._boundary,
        )

    def _output(self, frame):
        if self.is_terminal or frame is None:
            return None
        return self._runtime.frame_to_v1(frame)

    def prefill(self, session, tokens, activation, state_flags, *, sample: bool, sampling):
        """Run one prefill chunk; returns ``(token or -1, ActivationFrameV1 or None)``."""
        inp = self._input(activation, len(tokens), state_flags)
        if sample and self.is_terminal:
            token, frame = session.prefill_chunk_frame_sampled(tokens, sampling, input=inp)
        else:
            frame, token = session.prefill_chunk_frame(tokens, input=inp), -1
        return int(token), self._output(frame)

    def decode(self, session, token, activation, state_flags, *, sampling):
        inp = self._input(activation, 1, state_flags)
        token, frame = session.decode_step_frame_sampled(token, sampling if self.is_terminal else None, input=inp)
        return int(token), self._output(frame)

    def trim(self, session, token_count: int) -> None:
        session.trim_session(token_count)


# --------------------------------------------------------------------------------------
# Per-session and per-connection state
# --------------------------------------------------------------------------------------


@dataclass
class SessionStats:
    """Traffic counters of one session on one stage (reported in the "session" event)."""

    messages: int = 0
    received_bytes: int = 0
    forwarded_messages: int = 0
    forwarded_bytes: dict = field(default_factory=dict)  # codec identity -> wire bytes
    activation_bytes: dict = field(default_factory=dict)  # codec identity -> payload bytes
    codec_counts: dict = field(default_factory=dict)  # codec identity -> frames
    encode_ms: float = 0.0
    compute_ms: float = 0.0
    downstream_wait_ms: float = 0.0
    prefill_tokens: int = 0
    decode_tokens: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class _Session:
    runtime: Any
    sampling: Any = None
    chat_metadata: str | None = None
    stats: SessionStats = field(default_factory=SessionStats)


class WireReader:
    """Reads whole messages or replies off a socket through the ``*_from_buffer`` parsers.

    Unparsed bytes stay in a tail for the next call (a peer may pipeline), a short parse
    asks for exactly the bytes it still needs, and every received byte is counted (and
    teed to ``capture`` when given).  ``read()`` returns None on a clean close between
    records and raises ``UnexpectedEofError`` on a close in the middle of one.
    """

    def __init__(self, sock: socket.socket, capture=None) -> None:
        self.sock = sock
        self.count = 0
        self._buf = bytearray()
        self._capture = capture
        self._chunk = bytearray(1 << 16)

    def _recv(self) -> int:
        n = self.sock.recv_into(self._chunk)
        if n:
            self.count += n
            self._buf += memoryview(self._chunk)[:n]
            if self._capture is not None:
                self._capture.write(memoryview(self._chunk)[:n])
                self._capture.flush()
        return n

    @property
    def buffered(self) -> int:
        """Bytes received but not yet consumed."""
        return len(self._buf)

    def read_exact(self, n: int) -> bytes:
        while len(self._buf) < n:
            if not self._recv():
                raise UnexpectedEofError()
        data = bytes(self._buf[:n])
        del self._buf[:n]
        return data

    def wait_readable(self, timeout: float | None) -> bool:
        """Block until at least one byte is buffered (False on a clean close)."""
        if self._buf:
            return True
        self.sock.settimeout(timeout)
        try:
            return self._recv() > 0
        except ConnectionResetError:
            return False

    def read(self, parse: Callable):
        """``parse(bytes) -> (record, consumed)`` raising UnexpectedEofError(.needed) when short."""
        need = 1
        while True:
            while len(self._buf) < need:
                if not self._recv():
                    if not self._buf:
                        return None
                    raise UnexpectedEofError()
            try:
                record, consumed = parse(bytes(self._buf))
            except UnexpectedEofError as exc:
                needed = getattr(exc, "needed", None)
                need = needed if needed and needed > len(self._buf) else len(self._buf) + 1
                continue
            del self._buf[:consumed]
            return record


class _Peer:
    """One end of a TCP connection: one write per message, a :class:`WireReader` to read."""

    def __init__(self, sock: socket.socket, capture_prefix: str | None = None) -> None:
        self.sock = sock
        self._cap_out = self._cap_in = None
        if capture_prefix:
            self._cap_out = open(capture_prefix + "-messages.bin", "wb")
            self._cap_in = open(capture_prefix + "-replies.bin", "wb")
        self.reader = WireReader(sock, self._cap_in)
        self.sent = 0

    @property
    def received(self) -> int:
        return self.reader.count

    def send(self, data: bytes) -> None:
        self.sock.sendall(data)
        self.sent += len(data)
        if self._cap_out is not None:
            self._cap_out.write(data)
            self._cap_out.flush()

    def read_reply(self):
        from ..wire.frame import read_reply_from_buffer

        reply = self.reader.read(read_reply_from_buffer)
        if reply is None:
            raise UnexpectedEofError()
        return reply

    def recv_ready(self) -> None:
        from ..wire.frame import recv_ready

        recv_ready(self.reader.read_exact(4))

    def close(self) -> None:
        for f in (self._cap_out, self._cap_in):
            if f is not None:
                f.close()
        try:
            self.sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass
        self.sock.close()


def _reply_bytes(writer: Callable, *args) -> bytes:
    buf = io.BytesIO()
    writer(buf, *args)
    return buf.getvalue()


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """Open a TCP connection with TCP_NODELAY set."""
    sock = socket.create_connection((host, port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def parse_address(text: str) -> tuple[str, int]:
    """``"host:port"`` (or ``"tcp://host:port"``) to ``(host, port)``."""
    if text.startswith("tcp://"):
        text = text[len("tcp://"):]
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"address must be HOST:PORT, not {text!r}")
    return host.strip("[]") or "127.0.0.1", int(port)


# --------------------------------------------------------------------------------------
# The server
# --------------------------------------------------------------------------------------


class StageServer:
    """A listening stage.  ``serve_forever()`` accepts connections until ``shutdown()``.

    Parameters: ``backend`` (a :class:`RuntimeBackend` or a fake with its methods),
    ``config`` (:class:`skippy_wire.wire.forwarding.StageConfig`), ``downstream`` (``(host,
    port)`` of the next stage or None on the terminal stage), ``host``/``port`` to bind
    (port 0 picks a free one), ``io_timeout`` (seconds a peer may stall in the middle of
    a message), ``idle_timeout`` (seconds a connection may sit between messages; None =
    forever), ``reply_timeout`` (seconds to wait for the downstream reply), ``capture``
    (path prefix: record the downstream hop's bytes to ``PREFIX-messages.bin`` and
    ``PREFIX-replies.bin``), ``events`` (callable receiving event dicts).
    """

    def __init__(self, backend, config, *, downstream: tuple[str, int] | None = None,
                 host: str = "127.0.0.1", port: int = 0, io_timeout: float = DEFAULT_IO_TIMEOUT,
                 idle_timeout: float | None = None, reply_timeout: float = DEFAULT_REPLY_TIMEOUT,
                 capture: str | None = None, events: EventSink | None = None) -> None:
        self.backend = backend
        self.config = config
        self.downstream = downstream
        self.io_timeout = io_timeout
        self.idle_timeout = idle_timeout
        self.reply_timeout = reply_timeout
        self.capture = capture
        self.events = events or (lambda event: None)
        self.codec = ActivationCodec(config.activation_codec)
        self.policy = CodecPolicy(config.activation_codec_policy)
        if not self.policy.compatible(self.codec):
            raise ValueError(
                f"activation codec policy {self.policy.rust_name} is incompatible with "
                f"configured codec {self.codec.rust_name}")
        if backend.is_terminal and downstream is not None:
            raise ValueError("the terminal stage (owning the last layer) cannot have a downstream")
        if not backend.is_terminal and downstream is None:
            raise ValueError(
                f"stage {config.stage_index} ends at layer {backend.layer_end}, not the last "
                "layer, so it needs --downstream")
        self._runtime_lock = threading.Lock()
        self._stop = threading.Event()
        self._connections: set[socket.socket] = set()
        self._conn_lock = threading.Lock()
        self._conn_seq = 0
        self._listener = socket.create_server((host, port), reuse_port=False)
        self.address = self._listener.getsockname()[:2]

    # -- lifecycle ---------------------------------------------------------------------

    def serve_forever(self) -> None:
        self._listener.settimeout(0.2)
        try:
            while not self._stop.is_set():
                try:
                    sock, addr = self._listener.accept()
                except socket.timeout:
                    continue
                except OSError:
                    if self._stop.is_set():
                        break
                    raise
                sock.settimeout(None)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                with self._conn_lock:
                    self._conn_seq += 1
                    seq = self._conn_seq
                    self._connections.add(sock)
                threading.Thread(target=self._serve_connection, args=(sock, addr, seq),
                                 name=f"stage-conn-{seq}", daemon=True).start()
        finally:
            self._listener.close()

    def start(self) -> threading.Thread:
        """Serve on a background thread (tests, in-process pipelines)."""
        thread = threading.Thread(target=self.serve_forever, name="stage-accept", daemon=True)
        thread.start()
        return thread

    def shutdown(self) -> None:
        self._stop.set()
        with self._conn_lock:
            for sock in list(self._connections):
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    # -- one connection ----------------------------------------------------------------

    def _serve_connection(self, sock: socket.socket, addr, seq: int) -> None:
        name = f"connection {seq} from {addr[0]}:{addr[1]}"
        upstream = _Peer(sock)
        downstream: _Peer | None = None
        sessions: dict[int, _Session] = {}
        try:
            if self.downstream is not None:
                downstream = self._open_downstream(seq)
            upstream.send(READY_BYTES)
            log.info("%s: ready", name)
            while not self._stop.is_set():
                before = upstream.received - upstream.reader.buffered
                msg = self._read_message(upstream, name)
                if msg is None:
                    log.info("%s: closed by peer", name)
                    break
                size = upstream.received - upstream.reader.buffered - before
                reply = self._handle(msg, sessions, size, downstream)
                upstream.send(reply)
        except UnexpectedEofError:
            log.error("%s: peer disconnected in the middle of a message; closing", name)
        except (socket.timeout, TimeoutError):
            log.error("%s: peer stalled for more than %.1f s; closing", name, self.io_timeout)
        except WireError as exc:
            log.error("%s: malformed stage message (%s: %s); closing", name, exc.kind, exc)
        except (StageError, ConnectionError, OSError) as exc:
            if not self._stop.is_set():
                log.error("%s: %s; closing", name, exc)
        except RuntimeError as exc:  # the runtime's StageRuntimeError (e.g. context full)
            log.error("%s: stage runtime error: %s; closing", name, exc)
        except Exception as exc:  # noqa: BLE001 -- a connection must never kill the server
            log.exception("%s: unexpected error (%s); closing", name, exc)
        finally:
            for session_id in list(sessions):
                self._free(sessions.pop(session_id), session_id)
            if downstream is not None:
                downstream.close()
            upstream.close()
            with self._conn_lock:
                self._connections.discard(sock)

    def _open_downstream(self, seq: int) -> _Peer:
        host, port = self.downstream
        try:
            sock = connect(host, port, timeout=self.reply_timeout)
        except OSError as exc:
            raise StageError(f"cannot connect to downstream {host}:{port}: {exc}") from exc
        capture = f"{self.capture}-{seq}" if self.capture and seq > 1 else self.capture
        peer = _Peer(sock, capture)
        try:
            peer.sock.settimeout(self.reply_timeout)
            peer.recv_ready()
        except (WireError, OSError) as exc:
            peer.close()
            raise StageError(f"downstream {host}:{port} did not send READY: {exc}") from exc
        return peer

    def _read_message(self, peer: _Peer, name: str):
        """Read one message; None on a clean close between messages."""
        from ..wire.frame import read_stage_message_from_buffer

        try:
            if not peer.reader.wait_readable(self.idle_timeout):
                return None
        except (socket.timeout, TimeoutError):
            raise StageError(f"idle for more than {self.idle_timeout} s") from None
        peer.sock.settimeout(self.io_timeout)
        n_embd, codec, policy = self.backend.n_embd, self.codec, self.policy
        msg = peer.reader.read(lambda data: read_stage_message_from_buffer(data, n_embd, codec, policy))
        if msg is None:
            raise UnexpectedEofError()
        return msg

    # -- execution -----------------------------------------------------------------------

    def _handle(self, msg, sessions: dict, size: int, downstream: _Peer | None) -> bytes:
        from ..wire.frame import send_reply_ack, send_reply_predicted
        from ..wire.messages import WireMessageKind as K

        kind = int(msg.kind)
        session = sessions.get(msg.session_id)
        if session is not None:
            session.stats.messages += 1
            session.stats.received_bytes += size
        if kind == K.STOP:
            reply = self._relay(msg, downstream, session) if downstream else _reply_bytes(send_reply_ack)
            if session is not None:
                self._free(sessions.pop(msg.session_id), msg.session_id)
            return reply
        if session is None:
            with self._runtime_lock:
                session = _Session(self.backend.create_session())
            sessions[msg.session_id] = session
            session.stats.messages += 1
            session.stats.received_bytes += size
        if kind == K.CONFIGURE_GENERATION:
            session.sampling = msg.sampling
            session.chat_metadata = msg.chat_sampling_metadata
            return self._relay(msg, downstream, session) if downstream else _reply_bytes(send_reply_ack)
        if kind == K.TRIM_SESSION:
            with self._runtime_lock:
                self.backend.trim(session.runtime, msg.pos_start)
            return self._relay(msg, downstream, session) if downstream else _reply_bytes(send_reply_ack)
        if kind not in (K.PREFILL_EMBD, K.PREFILL_FINAL_EMBD, K.DECODE_EMBD):
            raise StageError(f"unsupported stage message kind {K(kind).name} ({kind})")

        self._check_position(msg, session)
        sampling = msg.sampling if msg.sampling is not None else session.sampling
        tokens = list(msg.tokens)
        if self.backend.is_source and len(tokens) != msg.token_count:
            raise StageError(f"first stage needs {msg.token_count} tokens, message carries {len(tokens)}")
        started = time.perf_counter()
        with self._runtime_lock:
            if kind == K.DECODE_EMBD:
                token = tokens[0] if tokens else msg.state.current_token
                predicted, frame = self.backend.decode(
                    session.runtime, token, msg.activation, msg.state.flags, sampling=sampling)
                session.stats.decode_tokens += 1
            else:
                predicted, frame = self.backend.prefill(
                    session.runtime, tokens, msg.activation, msg.state.flags,
                    sample=kind in REQUIRES_PREDICTED_REPLY, sampling=sampling)
                session.stats.prefill_tokens += len(tokens)
        compute_us = int((time.perf_counter() - started) * 1e6)
        session.stats.compute_ms += compute_us / 1000.0

        if downstream is None:
            stats = self._own_stats(kind, compute_us, msg.token_count)
            if kind in REQUIRES_PREDICTED_REPLY:
                return _reply_bytes(send_reply_predicted, predicted, stats)
            return _reply_bytes(send_reply_ack, stats)
        return self._forward(msg, frame, session, downstream, compute_us)

    def _check_position(self, msg, session: _Session) -> None:
        """``pos_start`` against the session's token count.

        A decode position is authoritative (wire-format.md 12): one behind the session
        (e.g. after a rejected draft) trims the session back to it.  A prefill chunk must
        start exactly where the session ends.  Anything else is a driver error.
        """
        have = getattr(session.runtime, "token_count", None)
        if have is None or msg.pos_start == have:
            return
        if int(msg.kind) == 2 and 0 <= msg.pos_start < have:
            with self._runtime_lock:
                self.backend.trim(session.runtime, msg.pos_start)
            return
        raise StageError(f"{msg.kind.name} at position {msg.pos_start}, but session {msg.session_id} "
                         f"holds {have} tokens")

    def _own_stats(self, kind: int, compute_us: int, token_count: int):
        """Prefill compute observation of this stage (wire-format.md 11.3)."""
        from ..wire.replies import StageReplyStats

        stats = StageReplyStats()
        if kind in (1, 4) and hasattr(stats, "observe_prefill_compute"):
            stats.observe_prefill_compute(self.config.stage_index, compute_us, token_count)
        return stats

    def _forward(self, msg, frame, session: _Session, downstream: _Peer, compute_us: int) -> bytes:
        from ..wire.forwarding import forwarded_stage_message_timed
        from ..wire.frame import write_stage_message

        if frame is None:
            raise StageError("the runtime produced no activation frame to forward")
        try:
            forwarded = forwarded_stage_message_timed(self.config, msg, frame, self.backend.n_embd)
        except (WireError, ValueError) as exc:
            raise StageError(f"cannot forward {msg.kind!r}: {exc}") from exc
        out = forwarded.message
        codec = ActivationCodec(out.state.activation_codec).identity()
        data = write_stage_message(out)
        st = session.stats
        st.encode_ms += forwarded.activation_encode_ms
        st.forwarded_messages += 1
        st.forwarded_bytes[codec] = st.forwarded_bytes.get(codec, 0) + len(data)
        st.activation_bytes[codec] = st.activation_bytes.get(codec, 0) + len(out.activation)
        st.codec_counts[codec] = st.codec_counts.get(codec, 0) + 1
        return self._exchange(msg, data, downstream, session, compute_us, len(out.activation))

    def _relay(self, msg, downstream: _Peer, session: _Session | None) -> bytes:
        """Forward an activation-less control message as is and relay the reply."""
        from ..wire.frame import write_stage_message

        return self._exchange(msg, write_stage_message(msg), downstream, session, None, 0)

    def _exchange(self, msg, data: bytes, downstream: _Peer, session, compute_us, activation_bytes) -> bytes:
        started = time.perf_counter()
        try:
            downstream.sock.settimeout(self.reply_timeout)
            downstream.send(data)
            written = time.perf_counter()
            reply = downstream.read_reply()
        except (socket.timeout, TimeoutError):
            raise StageError(
                f"downstream {self.downstream[0]}:{self.downstream[1]} sent no reply within "
                f"{self.reply_timeout} s") from None
        except (UnexpectedEofError, ConnectionError) as exc:
            raise StageError(
                f"downstream {self.downstream[0]}:{self.downstream[1]} closed the connection ({exc})") from None
        except WireError as exc:
            raise StageError(
                f"downstream {self.downstream[0]}:{self.downstream[1]} sent a malformed reply "
                f"({exc.kind}: {exc})") from None
        done = time.perf_counter()
        if session is not None:
            session.stats.downstream_wait_ms += (done - started) * 1000.0
        if compute_us is not None and int(msg.kind) in (1, 4):
            stats = reply.stats
            if hasattr(stats, "observe_prefill_edge_transport"):
                stats.observe_prefill_edge_transport(
                    self.config.stage_index, int((written - started) * 1e6),
                    int((done - written) * 1e6), activation_bytes)
                stats.observe_prefill_compute(self.config.stage_index, compute_us, msg.token_count)
        return _encode_reply(reply)

    def _free(self, session: _Session, session_id: int) -> None:
        with self._runtime_lock:
            self.backend.free_session(session.runtime)
        self.events({"event": "session", "stage": self.config.stage_index, "session_id": session_id,
                     **session.stats.as_dict()})


def _encode_reply(reply) -> bytes:
    """Serialise a StageReply (used to relay a downstream reply upstream)."""
    from ..wire import frame

    writer = getattr(frame, "write_reply", None)
    if writer is not None:
        return writer(reply)
    return _reply_bytes(frame.send_reply_message, reply)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def default_threads() -> int:
    """Compute threads per stage when not given: 1.

    ggml's CPU threads meet at a spinning barrier after every graph node, so a
    multi-threaded stage collapses as soon as the cores are oversubscribed (another stage,
    another process): on the 2 shared cores of the CI machine SmolLM2 decodes at ~60 tok/s
    with 1 thread and under 1 tok/s with 2 threads while other jobs run.  ``--threads``
    raises it on a machine with cores to spare.
    """
    return 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skippy-wire serve", description="Run one skippy stage process.")
    p.add_argument("--model", required=True, help="GGUF model path")
    p.add_argument("--layer-start", type=int, required=True)
    p.add_argument("--layer-end", type=int, required=True, help="exclusive")
    p.add_argument("--stage-index", type=int, default=None, help="default: 0 for layer_start 0, else required")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (port 0: any free port)")
    p.add_argument("--downstream", default=None, help="HOST:PORT of the next stage (omit on the last stage)")
    p.add_argument("--activation-codec", default="raw-f32-v1",
                   choices=[c.identity() for c in ActivationCodec])
    p.add_argument("--activation-codec-policy", default="fixed", choices=[policy.serde_name for policy in CodecPolicy])
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: 1, see default_threads)")
    p.add_argument("--io-timeout", type=float, default=DEFAULT_IO_TIMEOUT,
                   help="seconds a peer may stall inside a message (default %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="seconds a connection may sit idle between messages (default: forever)")
    p.add_argument("--reply-timeout", type=float, default=DEFAULT_REPLY_TIMEOUT,
                   help="seconds to wait for the downstream reply (default %(default)s)")
    p.add_argument("--capture", default=None,
                   help="path prefix: record the downstream hop to PREFIX-messages.bin / PREFIX-replies.bin")
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="exit when stdin closes (the driver holds it open, so stages die with it)")
    p.add_argument("--log-level", default="INFO")
    return p


def _exit_on_stdin_eof() -> None:
    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        finally:
            log.info("stdin closed: the parent is gone, exiting")
            os._exit(0)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def stage_config(stage_index: int, layer_start: int, layer_end: int, codec: str, policy: str):
    """A forwarding StageConfig from the CLI identities (e.g. "bf16-rne-v1", "fixed")."""
    from ..wire.forwarding import StageConfig

    return StageConfig(stage_index=stage_index, layer_start=layer_start, layer_end=layer_end,
                       activation_codec=ActivationCodec.from_identity(codec),
                       activation_codec_policy=CodecPolicy.from_serde_name(policy))


def _print_event(event: dict) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s stage[%(process)d] %(levelname)s %(message)s")
    if args.exit_on_stdin_eof:
        _exit_on_stdin_eof()
    stage_index = args.stage_index
    if stage_index is None:
        if args.layer_start != 0:
            print("skippy-wire serve: --stage-index is required when --layer-start > 0", file=sys.stderr)
            return 2
        stage_index = 0
    try:
        host, port = parse_address(args.listen)
        downstream = parse_address(args.downstream) if args.downstream else None
        config = stage_config(stage_index, args.layer_start, args.layer_end,
                              args.activation_codec, args.activation_codec_policy)
        threads = args.threads or default_threads()
        backend = RuntimeBackend.open(args.model, args.layer_start, args.layer_end, stage_index=stage_index,
                                      ctx_size=args.ctx_size, n_threads=threads)
        server = StageServer(backend, config, downstream=downstream, host=host, port=port,
                             io_timeout=args.io_timeout, idle_timeout=args.idle_timeout,
                             reply_timeout=args.reply_timeout, capture=args.capture, events=_print_event)
    except (OSError, ValueError, WireError, ImportError, RuntimeError) as exc:
        print(f"skippy-wire serve: cannot start stage {stage_index}: {exc}", file=sys.stderr)
        return 1
    bound_host, bound_port = server.address
    log.info("stage %d: layers %d..%d of %s, codec %s, policy %s, %d threads, listening on %s:%d%s",
             stage_index, args.layer_start, args.layer_end, args.model, args.activation_codec,
             args.activation_codec_policy, threads, bound_host, bound_port,
             f", downstream {downstream[0]}:{downstream[1]}" if downstream else " (terminal)")
    _print_event({"event": "listening", "host": bound_host, "port": bound_port, "stage": stage_index,
                  "layer_start": args.layer_start, "layer_end": args.layer_end, "n_embd": backend.n_embd})
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
