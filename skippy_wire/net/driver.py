"""The pipeline driver: generate text through running stages, or through one in-process stage.

* :class:`PipelineClient` holds the one persistent TCP connection to stage 0 and runs a
  generation (the schedule below).  Every request has a timeout; a stage that closes,
  stalls or answers garbage turns into a :class:`PipelineError` with the reason.
* :func:`generate_local` runs the same schedule on one in-process stage owning every
  layer: the reference the multi-process result must match (``run --check``).

Stage processes are started by :mod:`skippy_wire.net.supervision`; a generation's messages
are built by :mod:`skippy_wire.net.schedule`; the ``run`` command is :mod:`skippy_wire.tools.run`.

Message schedule (mirrors skippy-server's driver side, wire-format.md 2.1 and 12):
ConfigureGeneration(request, session, prompt_token_count, sampling) -> Ack;
PrefillEmbd(pos_start = chunk start, tokens = chunk) -> Ack for every chunk but the
last; PrefillFinalEmbd(last chunk) -> PredictedToken (first generated token); then
DecodeEmbd(pos_start = position, tokens = [previous token], current_token, decode_step)
-> PredictedToken until max_tokens or an end-of-generation token; Stop -> Ack.
"""

from __future__ import annotations

import contextlib
import os
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from ..errors import (PipelineClosed, PipelineError, PipelineMismatch, PipelineTimeout, SetupClosed, SetupTimeout,
                      StateVersionMismatch, TlsRequired, WireError, os_reason, with_detail)
from ..stage.interrupt import interruptible_compute
from ..stage.models import model_shape
from ..stage.runtime import StageModel
from ..stage.threads import resolved_threads
from ..wire.activation_frame import STAGE_STATE_VERSION_V15, STAGE_STATE_VERSION_V17
from ..wire.constants import MAX_CTX_SIZE, U64_MAX
from ..wire.forwarding import DEFAULT_CTX_SIZE
from ..wire.frame import DecodeStepWriter
from ..wire.messages import SamplingConfig, StageWireMessage, TokenIds, WireMessageKind
from ..wire.replies import WireReplyKind
from ..wire.setup import SetupError, SetupRole, StageSetupConfig
from .protocol_io import LinkProtocol
from .schedule import check_generation, context_room, decode_message, prefill_messages
from .arguments import instance_argument, int_argument, protocol_argument, seconds_argument
from .supervision import StageCluster, launched_cluster
from .topology import driven_topology
from .tls import TlsConfig, handshake_failure, refuses_certificate, tls_failure
from .transport import Peer, PeerClosedError, SendStalled, connect

#: What is said of a generation whose every token came but whose closing Stop got no answer.
SESSION_END_UNANSWERED = "the session's closing Stop got no answer (its text is complete)"
DEFAULT_MAX_TOKENS = 64
DEFAULT_CHUNK = 128
DEFAULT_TIMEOUT = 60.0
#: A generation's stop reason where the stages' context ended it, as llama.cpp's tools say.
STOP_CONTEXT_FULL = "context_full"


@contextlib.contextmanager
def yielding_to_stages():
    """Run the calling thread, and the threads it starts meanwhile, under ``SCHED_BATCH``
    (the previous policy back on exit): a driver woken by a token then waits for a free CPU
    instead of preempting the stage process that woke it in the middle of relaying that
    token and starting the next step (on two CPUs, stage 0's relay of a reply took 284 us
    with the driver preempting it and 103 us without: docs/benchmarks.md, "Thirteenth
    session").  Enter it after starting the stage processes: a child inherits the policy.
    Where the platform lacks or refuses the policy nothing changes."""
    batch = getattr(os, "SCHED_BATCH", None)
    previous = None
    if batch is not None:
        try:
            previous = os.sched_getscheduler(0), os.sched_getparam(0)
            os.sched_setscheduler(0, batch, os.sched_param(0))
        except OSError:
            previous = None
    try:
        yield
    finally:
        if previous is not None:
            with contextlib.suppress(OSError):
                os.sched_setscheduler(0, *previous)


@dataclass
class GenerationResult:
    """Tokens and timings of one generation."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    stop_reason: str = "max_tokens"  # or "eog", or STOP_CONTEXT_FULL
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_messages: int = 0
    decode_messages: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    reply_stats: list[Any] = field(default_factory=list)
    #: Decode: the driver's own share, from a token's reply to the next DecodeEmbd's write
    #: (building the message; on_token runs after that write), and the round trips to
    #: stage 0 (write to reply).
    driver_gap_s: float = 0.0
    decode_round_trip_s: float = 0.0
    #: Why the session's closing Stop got no Ack, when it did not (every token had come: the
    #: text stands, :data:`SESSION_END_UNANSWERED`, and the connection is closed, as a late
    #: Ack would be read as the next request's reply); else None.
    session_end_error: str | None = None

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by DecodeEmbd (the first generated token comes from prefill)."""
        return max(0, len(self.tokens) - 1)

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


def check_model_id(model_id, protocol: int, identity) -> None:
    """A driver's ``model_id``: a str, checked by the v17 setup alone, where no ``identity``
    names the model already (a TypeError, else a ValueError)."""
    if model_id is None:
        return
    if not isinstance(model_id, str):
        raise TypeError(f"model_id must be a str, not {type(model_id).__name__}")
    if protocol != STAGE_STATE_VERSION_V17 or identity is not None:
        raise ValueError("model_id is checked under protocol 17 without an identity (whose model id it has)")


class PipelineClient:
    """A persistent connection to stage 0 (TCP_NODELAY; one write per message).

    ``timeout`` bounds every wait for a reply (and the connect/READY handshake);
    ``capture`` is a path prefix: the hop's bytes go to ``PREFIX-messages.bin`` (what the
    driver sent) and ``PREFIX-replies.bin`` (READY and the replies).  ``protocol`` is the
    state version spoken (15, 16 or 17); under 17 the connection starts with the setup
    handshake as TokensAndControl, ``identity`` (a ``StageSetupConfig``, e.g.
    :func:`~skippy_wire.net.protocol_io.driver_identity`) makes it check that it reached
    stage 0 of that run, and ``model_id`` alone (the stages' ``--model-id``) that it reached
    a stage of that model (:func:`check_model_id`).  A stage speaking another version -> one-line PipelineError.
    ``tls`` (a :class:`~skippy_wire.net.tls.TlsConfig`): mutual TLS on the connection.
    ``poll_s``: busy-poll this long around a reply's expected arrival (0: sleep).

    One request at a time: a call from a second thread while one runs is a PipelineError
    (their replies would cross).  A connection stage 0 closed while idle (its
    ``--idle-timeout``) is opened again by the next :meth:`generate` (which opens and stops
    its own session), unless ``capture`` is given; :meth:`request` raises instead, since the
    sessions opened on the old connection are gone.  A :meth:`generate` left by an exception
    (a callback's, a bad argument's, Ctrl-C) stops its session on every stage, so the
    connection carries the next request, or closes the connection when a reply is still
    owed; a closed client's calls are PipelineErrors.  ``ctx_size``: the stages' context
    (default: the launched stages' or the driven topology's, where known): a longer prompt
    is refused before anything is sent, and a generation ends at the context's end
    (:data:`STOP_CONTEXT_FULL`).

    The wire has no error reply: a stage that fails closes its connections, so the driver
    sees stage 0 close (or stay silent).  When this process started the stages
    (:func:`~skippy_wire.net.supervision.launch_pipeline`, or ``stages`` given), the error names the stage that
    failed and why (:meth:`~skippy_wire.net.supervision.StageCluster.explain`) before what
    the driver saw; when a topology file describes them (``--topology``:
    :func:`~skippy_wire.net.topology.drive_topology`), the first stage that no longer takes
    connections (:meth:`~skippy_wire.net.topology.Topology.unreachable_stage`).
    """

    def __init__(self, host: str, port: int, *, timeout: float = DEFAULT_TIMEOUT,
                 capture: str | Path | None = None, protocol: int = STAGE_STATE_VERSION_V15,
                 identity=None, tls=None, poll_s: float = 0.0, stages: StageCluster | None = None,
                 ctx_size: int | None = None, model_id: str | None = None) -> None:
        timeout = seconds_argument("timeout", timeout)
        if not isinstance(host, str) or not host:
            raise TypeError(f"host must be a host name or address (a str), not {host!r}")
        port = int_argument("port", port, 1, 65535)  # 70000 reached 4464
        protocol_argument("protocol", protocol)  # these two failed once connected
        poll_s = seconds_argument("poll_s", poll_s, zero=True)
        if ctx_size is not None:
            ctx_size = int_argument("ctx_size", ctx_size, 1, MAX_CTX_SIZE)
        for name, value, kind in (("identity", identity, StageSetupConfig), ("tls", tls, TlsConfig),
                                  ("stages", stages, StageCluster)):
            instance_argument(name, value, kind)
        self.address = f"{host}:{port}"
        self.timeout = timeout
        self.sent_at = 0.0  # perf_counter() when the last message started going out
        self._owed = 0  # replies to messages sent not yet read
        self._closed = False
        self._busy = threading.Lock()  # held by the thread whose request runs
        self._carrier: int | None = None  # that thread's ident
        self._link_failed = False  # a send or a wait of the request failed: what is in flight is unknown
        check_model_id(model_id, protocol, identity)
        self._endpoint, self._setup = (host, port), (capture, protocol, identity, tls, poll_s, model_id)
        self._given = stages, ctx_size
        self._look_up_stages()
        self._connect()

    def _look_up_stages(self) -> None:
        """The stages behind stage 0's address (given, or the ones this process launched there,
        or a topology file describes; :meth:`_connect` looks again by the address reached)."""
        (host, port), (stages, _) = self._endpoint, self._given
        self._stages = stages if stages is not None else launched_cluster(host, port)
        self._topology = driven_topology(host, port)
        self._marks = self._log_marks()

    @property
    def ctx_size(self) -> int | None:
        """The context every stage holds, where known (given, or the stages' this process
        launched, or the topology's it drives); None: not known here."""
        return self._given[1] or next((known.ctx_size for known in (self._stages, self._topology)
                                       if known is not None and known.ctx_size), None)

    def _connect(self) -> None:
        """The connection to stage 0 and its READY handshake (v17: the stage setup)."""
        (host, port), (capture, protocol, identity, tls, poll_s, model_id) = self._endpoint, self._setup
        try:
            sock = connect(host, port, self.timeout, tls=tls.client_context() if tls is not None else None)
        except ssl.SSLError as exc:
            kind = PipelineMismatch if refuses_certificate(exc) else PipelineError
            raise kind(handshake_failure(f"stage 0 at {self.address}", exc)) from None
        except OSError as exc:
            raise self._failed(f"cannot connect to stage 0 at {self.address}: {os_reason(exc)}") from exc
        try:
            try:
                peer = sock.getpeername()[:2]  # "localhost" reaches the stages launched on 127.0.0.1 too
            except OSError:  # reset already (stage 0 refused this side's certificate, TLS 1.3): the read says why
                peer = (host, port)
            if self._stages is None:
                self._stages = launched_cluster(*peer)
            if self._topology is None:
                self._topology = driven_topology(*peer)
            self._peer = Peer(sock, capture_prefix=str(capture) if capture else None)
        except BaseException:
            sock.close()
            raise
        self._peer.reader.poll_s = poll_s
        self._link = LinkProtocol(protocol, self._peer, who=f"stage 0 at {self.address}", me="this driver")
        try:
            self._guard(lambda: self._link.connect(SetupRole.TOKENS_AND_CONTROL, identity, None,
                                                   timeout=self.timeout, model_id=model_id),
                        "READY handshake" if protocol != 17 else "stage setup")
        except BaseException:
            self._peer.close()
            raise

    def _reopen_if_dropped(self) -> None:
        """Before a generation: a connection stage 0 closed while it was idle (its
        ``--idle-timeout``) is opened again, its byte counts carried on; not while capturing
        (a new connection would start the capture files over)."""
        capture = self._setup[0]
        if self._closed or capture or self._peer.open_between_messages():
            return
        old = self._peer
        old.close()
        self._look_up_stages()  # a pipeline started anew on the address is another one
        self._connect()
        self._peer.sent += old.sent
        self._peer.reader.count += old.reader.count

    @property
    def sent_bytes(self) -> int:
        return self._peer.sent

    @property
    def received_bytes(self) -> int:
        return self._peer.received

    def close(self) -> None:
        self._closed = True
        self._peer.close()

    def alive(self) -> bool:
        """Whether the connection is still open between requests (a stage closes an idle
        one after its idle timeout: the socket then turns readable with EOF); True while a
        request runs on it (its bytes are that request's to read)."""
        if self._closed:
            return False
        if not self._busy.acquire(blocking=False):
            return True
        try:
            return self._peer.open_between_messages()
        finally:
            self._busy.release()

    @contextlib.contextmanager
    def _one_request(self):
        if not self._busy.acquire(blocking=False):
            whose = "its own request (called from that request's callback)" \
                if self._carrier == threading.get_ident() else "another thread's request"
            raise PipelineError(f"stage 0 at {self.address}: this client is carrying {whose} "
                                "(a PipelineClient serves one request at a time)")
        self._carrier, self._link_failed = threading.get_ident(), False
        try:
            yield
        finally:
            self._carrier = None
            self._busy.release()

    def __enter__(self) -> "PipelineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _log_marks(self):
        return self._stages.log_marks() if self._stages is not None else None

    def _failed(self, seen: str, unexplained: str = "", kind: type = PipelineError) -> PipelineError:
        """The error (a ``kind``) for ``seen`` (what the driver saw), after which stage failed
        and why when the stages this process started or a topology it drives tell; else with
        ``unexplained`` added."""
        cause = self._stages.explain(self._marks) if self._stages is not None else None
        if cause is None and self._topology is not None:
            cause = self._topology.unreachable_stage()
        return kind(f"{cause}; {seen}" if cause else seen + unexplained)

    def _guard(self, fn, what: str):
        """``fn()``, a send or a wait on the link, its failure as the error that names it."""
        try:
            return self._named_failure(fn, what)
        except BaseException:
            self._link_failed = True
            raise

    def _named_failure(self, fn, what: str):
        try:
            return fn()
        except (StateVersionMismatch, TlsRequired) as exc:
            raise PipelineMismatch(str(exc)) from None
        except ssl.SSLError as exc:  # e.g. TLS 1.3: our certificate was refused after the handshake
            kind = PipelineMismatch if refuses_certificate(exc) else PipelineError
            raise kind(f"stage 0 at {self.address}: TLS failed during {what}: {tls_failure(exc)}") from None
        except SetupClosed:  # a stage further down refused the setup (stage 0 closes, saying nothing)
            raise self._failed(f"stage 0 at {self.address} closed the connection during the setup handshake",
                               " (a stage failed or refused the setup; the stages' logs say which and why)") from None
        except SetupTimeout:  # a stage slow to set up (its downstream still loading): not a refusal
            raise self._failed(f"stage 0 at {self.address}: no answer to the stage setup within {self.timeout:g} s") \
                from None
        except SetupError as exc:  # a refusal: a mismatch, which no wait mends
            raise PipelineMismatch(f"stage 0 at {self.address}: stage setup failed: {with_detail(exc)}") from None
        except SendStalled:
            raise self._failed(f"stage 0 at {self.address} read nothing of {what} for {self.timeout:g} s") from None
        except (socket.timeout, TimeoutError):
            raise self._failed(f"stage 0 at {self.address}: no answer to {what} within {self.timeout:g} s",
                               kind=PipelineTimeout) from None
        except PeerClosedError:
            raise self._failed(f"stage 0 at {self.address} closed the connection during {what}",
                               " (a stage failed; the stages' logs say which and why)", PipelineClosed) from None
        except OSError as exc:
            if self._closed:  # close() from another thread took the socket away
                raise PipelineError(f"stage 0 at {self.address}: this client was closed during {what}") from None
            if not isinstance(exc, ConnectionError):
                raise
            raise self._failed(f"stage 0 at {self.address}: connection lost during {what}: {os_reason(exc)}") from None
        except WireError as exc:
            raise self._failed(f"stage 0 at {self.address}: malformed reply to {what}: {exc}") from None

    def request(self, msg, what: str | None = None):
        """Send one message and return its reply (a ``StageReply``); :attr:`sent_at` is
        when its write began (perf_counter): a write that waits while stage 0 already runs
        counts in the round trip, so the round trip holds every stage's compute."""
        if not isinstance(msg, StageWireMessage):  # an AttributeError once sent
            raise TypeError(f"request expects a StageWireMessage, not {type(msg).__name__}")
        self._marks = self._log_marks()
        with self._one_request():
            try:
                return self._request(msg, what)
            except BaseException:
                if self._owed or self._link_failed:  # its reply would be read as the next request's
                    self.close()  # (or the next message written after half of this one)
                raise

    def _request(self, msg, what: str | None = None):
        what = self.send(msg, what)
        return self.receive(what)

    def send(self, msg, what: str | None = None) -> str:
        """Write one message (its reply is for :meth:`receive`); returns what it is called."""
        return self.send_bytes(self._link.encode(msg), what or f"{msg.kind.name} (session {msg.session_id})")

    def send_bytes(self, data: bytes, what: str) -> str:
        """Write one message already encoded for this link (:meth:`send`)."""

        def write():
            self._peer.sock.settimeout(self.timeout)
            self.sent_at = time.perf_counter()
            self._peer.send(data)

        if self._closed:
            raise PipelineError(f"stage 0 at {self.address}: this client is closed; {what} not sent")
        self._guard(write, what)
        self._owed += 1
        return what

    def receive(self, what: str):
        """The reply to the message sent last, whole within :attr:`timeout`: a stage that
        trickles its bytes is bounded as a silent one is."""
        reader = self._peer.reader
        reader.deadline = time.monotonic() + self.timeout
        try:
            reply = self._guard(self._peer.read, what)
        finally:
            reader.deadline = None
        self._owed -= 1
        return reply

    def generate(self, prompt: TokenIds, *, max_tokens: int = DEFAULT_MAX_TOKENS, sampling=None,
                 chunk_size: int = DEFAULT_CHUNK, is_eog: Callable[[int], bool] | None = None,
                 on_token: Callable[[int], None] | None = None, request_id: int = 1,
                 session_id: int = 1, before_step: Callable[[], None] | None = None) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids); 0 evaluates the
        prompt and generates none (llama-server's ``n_predict: 0``).  ``is_eog(token)`` (e.g.
        a ``Tokenizer``'s ``is_eog``) ends it at an end-of-generation token, which it keeps;
        without it only ``max_tokens`` (or ``ctx_size``) does.

        ``sampling`` (a ``messages.SamplingConfig``; None = greedy, and so is one whose flags
        lack ``SamplingFlags.ENABLED``, as the backend reads the wire block) travels once, in
        ConfigureGeneration, which every stage keeps for the session; prefill and decode
        messages carry no sampling block.  ``on_token`` runs while the stages compute the
        next token; if it raises, that step's reply is read back and the session stopped
        before the exception leaves (the connection stays usable).  ``before_step`` runs
        before each prefill chunk after the first and each decode step is sent: what it
        raises (a cancellation) leaves once the session is stopped.
        """
        prompt, max_tokens, chunk_size = check_generation(prompt, max_tokens, chunk_size, is_eog=is_eog,
                                                          on_token=on_token, before_step=before_step)
        request_id, session_id = int_argument("request_id", request_id, 0, U64_MAX), \
            int_argument("session_id", session_id, 0, U64_MAX)
        instance_argument("sampling", sampling, SamplingConfig)
        chunks = list(prefill_messages(prompt, chunk_size, request_id, session_id))
        result = GenerationResult(list(prompt))
        self._marks = self._log_marks()
        with self._one_request():
            self._reopen_if_dropped()  # (the stages reached again may be others, with another context)
            # a prompt too long is refused before anything is sent
            room = max_tokens if self.ctx_size is None else context_room(len(prompt), max_tokens, self.ctx_size)
            sent0, recv0 = self.sent_bytes, self.received_bytes
            opened = False
            try:
                self._expect(self._request(StageWireMessage.configure_generation(
                    request_id, session_id, len(prompt), sampling, None), "ConfigureGeneration"), ack=True)
                opened = True
                self._run(result, chunks, room, is_eog, on_token, before_step, request_id, session_id)
                if room < max_tokens and result.stop_reason == "max_tokens" and len(result.tokens) == room:
                    result.stop_reason = STOP_CONTEXT_FULL
                opened = False
                try:
                    self._stop_session(request_id, session_id)
                except PipelineError as exc:
                    result.session_end_error = str(exc)
                    self.close()
            except BaseException as exc:
                if isinstance(exc, PipelineClosed) and opened and not result.prefill_messages:
                    exc.on_first_tokens = True
                self._abandon(exc, request_id, session_id, opened)
                raise
            finally:
                result.sent_bytes = self.sent_bytes - sent0
                result.received_bytes = self.received_bytes - recv0
        return result

    def _run(self, result: GenerationResult, chunks: list, max_tokens: int, is_eog, on_token, before_step,
             request_id: int, session_id: int) -> None:
        """The prefill chunks and the decode steps of :meth:`generate`, into ``result``."""
        started = time.perf_counter()
        token = None
        for msg in chunks:
            if before_step and result.prefill_messages:  # a long prompt: a client gone stops it
                before_step()
            reply = self._request(msg)
            result.prefill_messages += 1
            result.reply_stats.append(reply.stats)
            token = self._expect(reply, ack=msg.kind == WireMessageKind.PREFILL_EMBD)
        result.prefill_s = time.perf_counter() - started
        if max_tokens < 1:
            token = None  # the first token the prefill sampled is not asked for
        started = replied = time.perf_counter()
        prompt, pos = result.prompt_tokens, len(result.prompt_tokens)
        steps = None  # the DecodeEmbd bytes, from the first one's encoding
        what = f"{WireMessageKind.DECODE_EMBD.name} (session {session_id})"
        while token is not None:
            result.tokens.append(token)
            eog = is_eog is not None and is_eog(token)
            last = eog or len(result.tokens) >= max_tokens
            if not last:
                if before_step:
                    before_step()
                # The stages compute the next token while on_token runs (printing, an
                # HTTP stream's event loop taking the GIL), not after it.
                step = len(result.tokens) - 1
                if steps is None:
                    steps = DecodeStepWriter(self._link.encode(decode_message(
                        token, pos, step, len(prompt), request_id, session_id)))
                self.send_bytes(steps.message(token, pos, step), what)
            if on_token:
                on_token(token)  # if it raises, generate() reads the step in flight back (_abandon)
            if eog:
                result.stop_reason = "eog"
            if last:
                break
            reply = self.receive(what)
            now = time.perf_counter()
            result.driver_gap_s += self.sent_at - replied
            result.decode_round_trip_s += now - self.sent_at
            replied = now
            result.decode_messages += 1
            token = self._expect(reply, ack=False)
            pos += 1
        result.decode_s = time.perf_counter() - started

    def _abandon(self, exc: BaseException, request_id: int, session_id: int, opened: bool) -> None:
        """After :meth:`generate` left by ``exc``: the replies still owed read back and the
        session stopped on every stage, so the connection carries the next request; closed
        instead where that fails, or after Ctrl-C (a message may be half written)."""
        if self._closed:
            return
        if not isinstance(exc, Exception) or self._link_failed:
            # Ctrl-C; or a wait for a reply failed (a timeout, a close, a malformed reply):
            # reading it again would wait as long once more, for a stage already given up on;
            # or a send did (a message may be half written).  (What a callback raises, a
            # PipelineError of its own included, leaves the link whole.)
            self.close()
            return
        try:
            while self._owed:
                self.receive("a step nobody wants any more")
            if opened:
                self._stop_session(request_id, session_id)
        except BaseException as failed:
            self.close()
            if not isinstance(failed, Exception):
                raise

    def _stop_session(self, request_id: int, session_id: int) -> None:
        """Stop, which frees the session on every stage, and its Ack."""
        self._expect(self._request(StageWireMessage.stop(request_id, session_id), "Stop"), ack=True)

    def _expect(self, reply, *, ack: bool):
        kind = int(reply.kind)
        if ack:
            if kind != WireReplyKind.ACK:
                raise PipelineError(f"stage 0 at {self.address}: expected Ack, got reply kind {kind}")
            return None
        if kind not in (WireReplyKind.PREDICTED_TOKEN, WireReplyKind.PREDICTED_TOKENS):
            raise PipelineError(f"stage 0 at {self.address}: expected a predicted token, got reply kind {kind}")
        return int(reply.predicted)


# --------------------------------------------------------------------------------------
# In-process reference
# --------------------------------------------------------------------------------------


def generate_local(model: str | Path, prompt: TokenIds, *, max_tokens: int = DEFAULT_MAX_TOKENS,
                   sampling=None, chunk_size: int = DEFAULT_CHUNK, is_eog=None, threads: int | None = None,
                   ctx_size: int = DEFAULT_CTX_SIZE) -> GenerationResult:
    """The same schedule on one in-process stage owning every layer (no sockets), its context
    of ``ctx_size`` bounding it as :class:`PipelineClient`'s ``ctx_size`` bounds a pipeline's."""
    prompt, max_tokens, chunk_size = check_generation(prompt, max_tokens, chunk_size, is_eog=is_eog)
    int_argument("ctx_size", ctx_size, 1, MAX_CTX_SIZE)  # the runtime's own words named arguments not given
    instance_argument("sampling", sampling, SamplingConfig)  # as generate() (the runtime's was a ValueError)
    threads = resolved_threads(threads)  # before the model is read
    room = context_room(len(prompt), max_tokens, ctx_size)
    # in the main thread, Ctrl-C stops a long prefill at once; the model and its session are
    # freed on the way out, also by an exception (one kept referenced held them, ~500 MB)
    with interruptible_compute(), StageModel.open(model, 0, model_shape(model)[0], stage_index=0, ctx_size=ctx_size,
                                                  n_threads=threads) as stage, \
            stage.create_session() as session:
        result = GenerationResult(list(prompt))
        started = time.perf_counter()
        token = None
        for start in range(0, len(prompt), chunk_size):
            chunk = prompt[start:start + chunk_size]
            if start + chunk_size >= len(prompt):
                token, _ = session.prefill_chunk_frame_sampled(chunk, sampling)
            else:
                session.prefill_chunk_frame(chunk)
        result.prefill_s = time.perf_counter() - started
        started = time.perf_counter()
        while max_tokens > 0:  # 0: the prompt evaluated, as PipelineClient.generate
            result.tokens.append(int(token))
            if is_eog is not None and is_eog(token):
                result.stop_reason = "eog"
                break
            if len(result.tokens) >= room:
                if room < max_tokens:
                    result.stop_reason = STOP_CONTEXT_FULL
                break
            token, _ = session.decode_step_frame_sampled(token, sampling)
        result.decode_s = time.perf_counter() - started
    return result


__all__ = ["SESSION_END_UNANSWERED", "DEFAULT_MAX_TOKENS", "DEFAULT_CHUNK", "DEFAULT_TIMEOUT", "STOP_CONTEXT_FULL",
           "GenerationResult", "PipelineClient", "check_model_id", "generate_local", "yielding_to_stages"]
