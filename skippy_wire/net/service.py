"""Many generations in flight over one pipeline: the engine behind ``skippy-wire api``.

Each request in flight owns one connection to stage 0 for its lifetime.  Every stage
server serves each connection on its own thread with its own downstream connection, so
requests move through the pipeline independently: stage 0 computes request B while
stage 1 computes request A.  Idle connections are pooled and reused.

Admission (in the event loop, see :class:`Admission`): up to ``max_inflight`` requests
run; up to ``max_queue`` more wait in FIFO order; beyond that a request is refused at once
(:class:`QueueFullError`, HTTP 503).  A waiter that gives up (its client went away) leaves
the queue at once.

A request is cancelled (its client went away, or a stop string matched) between two
tokens: the engine then sends Stop for its session, which every stage relays and acts
on, so the session's lane is free on every stage before the connection is reused.  A
connection that failed is closed instead, which frees the sessions on every stage too.

After a request failed in the pipeline, the next one first probes it
(:meth:`GenerationEngine.check_ready`, bounded by :data:`READY_TIMEOUT_S`): while it does
not answer, requests fail at once with :class:`PipelineUnavailable` instead of each waiting
for a stage's timeout; once it answers they are served again.  So do requests to someone
else's stages until their entry has shown that it is stage 0.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import numbers
import random
import threading
import time
from dataclasses import dataclass, field, make_dataclass
from typing import Callable, Iterable, Optional, Sequence

from ..errors import PipelineClosed, PipelineError, PipelineMismatch, PipelineTimeout, SkippyError
from ..wire.constants import F32_SMALLEST
from ..wire.messages import SamplingConfig, SamplingFlags, StageWireMessage, as_f32
from ..wire.replies import WireReplyKind
from .driver import SESSION_END_UNANSWERED, PipelineClient, check_model_id
from .schedule import check_generation, context_room, prefill_messages
from .text import TextAssembler

log = logging.getLogger("skippy_wire.net.service")

#: Upper bound of the random seed drawn for a sampled request that names none.
_SEED_RANGE = 2**31 - 1
#: Seconds the readiness probe (:meth:`GenerationEngine.check_ready`, ``GET /health``)
#: waits for each step of its answer from the pipeline.
READY_TIMEOUT_S = 5.0


class QueueFullError(SkippyError):
    """Every lane is busy and the wait queue is full; retry later."""


class Cancelled(SkippyError):
    """The request was cancelled between two tokens."""


class ServerStopping(SkippyError):
    """The server stops: a request still waiting for a lane is refused (it never started)."""


class PipelineUnavailable(PipelineError):
    """A request failed in the pipeline and it does not answer a readiness probe since:
    nothing can be served until it is whole again (retry later)."""


#: The wire sampling fields an OpenAI-style request sets as they are (same names, and the
#: wire's defaults).
REQUEST_SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                           "repeat_penalty")
_WIRE_DEFAULTS = SamplingConfig()
#: ``penalty_last_n`` -1: the penalties look back over the session's whole token history.
WHOLE_HISTORY = _WIRE_DEFAULTS.penalty_last_n


@dataclass
class SamplingParams(make_dataclass("SamplingParamsFields", [
        *((name, type(getattr(_WIRE_DEFAULTS, name)), getattr(_WIRE_DEFAULTS, name)) for name in REQUEST_SAMPLING_FIELDS),
        ("seed", Optional[int], None), ("logit_bias", dict, field(default_factory=dict)),
        ("ignore_eos", bool, False), ("repeat_last_n", int, WHOLE_HISTORY)])):
    """OpenAI-style sampling parameters; ``temperature == 0`` is greedy, ``seed`` None is random,
    ``top_k`` at or below 0 is off (as in llama.cpp; vLLM sends -1).  ``repeat_last_n`` is
    llama.cpp's: the tokens the repeat, presence and frequency penalties look back over,
    -1 the whole history (the wire's default), 0 no penalties at all."""

    def __post_init__(self) -> None:
        for name in REQUEST_SAMPLING_FIELDS:  # compared below, or written to the wire's numbers
            value, kind = getattr(self, name), numbers.Integral if name == "top_k" else numbers.Real
            if isinstance(value, bool) or not isinstance(value, kind):
                raise TypeError(f"{name} must be {'an integer' if name == 'top_k' else 'a number'}, "
                                f"not {type(value).__name__}")
        self.top_k = max(0, self.top_k)
        # llama.cpp keeps only the best candidate at top_p 0 or min_p 1, where the wire's
        # filters apply only for 0 < p < 1 and would let every candidate through; as the wire's
        # f32 (1e-50 is 0 there, 0.99999999 is 1).
        if as_f32(self.top_p) <= 0.0 or as_f32(self.min_p) >= 1.0:
            self.top_k = 1

    def penalized(self) -> bool:
        return self.repeat_last_n != 0 and (self.repeat_penalty != 1.0 or self.presence_penalty != 0.0
                                            or self.frequency_penalty != 0.0)

    def is_greedy(self) -> bool:
        return self.temperature <= 0.0 and not self.logit_bias and not self.penalized() and not self.ignore_eos

    def ban_end_of_generation(self, eog_ids: Iterable[int]) -> None:
        """``ignore_eos`` as llama.cpp applies it: every end-of-generation token's logit
        becomes -inf (the wire's IGNORE_EOS flag masks only the model's EOS and EOT tokens)."""
        if self.ignore_eos:
            self.logit_bias = {**self.logit_bias, **{token: float("-inf") for token in eog_ids}}

    def wire(self) -> Optional[SamplingConfig]:
        """The wire's sampling block (None = greedy, the backend's argmax)."""
        if self.is_greedy():
            return None
        seed = self.seed if self.seed is not None else random.randint(1, _SEED_RANGE)
        fields = {name: getattr(self, name) for name in REQUEST_SAMPLING_FIELDS}
        fields["penalty_last_n"] = self.repeat_last_n
        if 0.0 < self.repeat_penalty < F32_SMALLEST:  # an f32 0 would read as unset (1): the nearest f32 above 0
            fields["repeat_penalty"] = F32_SMALLEST
        if self.repeat_last_n == 0:  # the wire reads a window of 0 as the whole history: no penalty sent
            fields.update(repeat_penalty=1.0, presence_penalty=0.0, frequency_penalty=0.0, penalty_last_n=WHOLE_HISTORY)
        return SamplingConfig(
            flags=int(SamplingFlags.ENABLED | (SamplingFlags.IGNORE_EOS if self.ignore_eos else 0)),
            ignore_eos=self.ignore_eos, seed=seed,
            logit_bias=sorted((int(t), float(b)) for t, b in self.logit_bias.items()), **fields)


@dataclass
class Generation:
    """What one request produced."""

    text: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0  # the tokens decoded, an end-of-generation one included
    finish_reason: str = "length"
    #: Why it ended, in llama-server's words: "eos" (an end-of-generation token), "word"
    #: (``stopping_word``, a stop string), "limit" (max_tokens, the context, a line indented
    #: less than ``min_indent`` or a new line past ``line_time_limit_s``).
    stop_type: str = "limit"
    stopping_word: str = ""
    tokens: list[int] = field(default_factory=list)  # the generated tokens (no end-of-generation one)
    first_token_s: Optional[float] = None
    elapsed_s: float = 0.0


class GenerationEngine:
    """Runs generations on pooled stage-0 connections (blocking; call from worker threads)."""

    def __init__(self, entry: tuple[str, int], tokenizer, *, ctx_size: int, timeout: float,
                 chunk_size: int, protocol: int = 15, identity=None, tls=None, poll_s: float = 0.0,
                 model_id: Optional[str] = None, verify_first_stage: bool = False) -> None:
        self.entry = entry
        check_model_id(model_id, protocol, identity)  # at once, not at every request's connection
        self.protocol, self.identity, self.tls, self.model_id = protocol, identity, tls, model_id
        self.poll_s = poll_s  # each connection's busy-poll window (PipelineClient)
        self.tokenizer = tokenizer
        self.ctx_size = ctx_size
        self.timeout = timeout
        self.chunk_size = chunk_size
        #: Process-wide figures for ``/metrics`` by name (requests, failed, cancelled, rejected,
        #: prompt_tokens, completion_tokens, sent_bytes, received_bytes); absent ones read 0.
        self.counters: collections.Counter = collections.Counter()
        self._idle: list[PipelineClient] = []
        self._busy: set[PipelineClient] = set()  # the connections generations use (close() cuts them off)
        self._lock = threading.Lock()
        self._ids = itertools.count(1)
        #: A request failed in the pipeline, and no probe or request has got through since.
        self.failing = False
        #: Someone else's stages: the entry has yet to show that it is stage 0 by taking a
        #: driver's token (:meth:`check_ready` probes it until then).
        self.first_stage_unverified = verify_first_stage
        #: close() was called: the stages stop with their user, and a generation still
        #: running then fails without the pipeline having failed.
        self.closed = False

    def _answered(self, failed: Optional[BaseException] = None) -> None:
        """The pipeline answered (``failed`` None) or a request failed in it: logged, at
        most once a request and once a recovery, so an operator sees both."""
        if failed is not None:
            if not self.closed:
                log.warning("a request failed in the pipeline: %s", failed)
            self.failing = True
        elif self.failing:
            log.warning("the pipeline answers again")
            self.failing = False

    def _take(self, timeout: Optional[float] = None) -> PipelineClient:
        """A pooled connection, else a new one (``timeout``: for its handshake; default:
        the engine's)."""
        with self._lock:
            while self._idle:
                client = self._idle.pop()
                if client.alive():
                    return client
                client.close()  # closed by the stage meanwhile (e.g. its idle timeout)
        return PipelineClient(*self.entry, timeout=self.timeout if timeout is None else timeout,
                              protocol=self.protocol, identity=self.identity, tls=self.tls, poll_s=self.poll_s,
                              ctx_size=self.ctx_size, model_id=self.model_id)

    def _give_back(self, client: PipelineClient) -> None:
        client.timeout = self.timeout
        with self._lock:
            if not self.closed:
                self._idle.append(client)
                return
        client.close()  # a generation that close() did not cut off ends after it: nothing pools it again

    def check_ready(self, timeout: float = READY_TIMEOUT_S) -> None:
        """Raise PipelineError unless every stage answers now, each wait bounded by
        ``timeout``.

        A pooled connection to stage 0 can look alive while a later stage is gone (stage 0
        notices only when it next relays), so this sends a Stop for a session no stage
        holds: every stage relays it downstream, the last acknowledges it, and the Ack
        comes back through all of them.  It opens no session, so it takes no lane.

        While :attr:`first_stage_unverified` (someone else's stages, which may start after the
        API): a stage after the first answers that Stop as stage 0 does but closes the link on
        a driver's tokens, so one token is prefilled into the session first (the Stop then
        ends it), and a close is PipelineMismatch."""
        timeout = min(timeout, self.timeout)
        client = self._take(timeout)
        client.timeout = timeout
        try:
            session = next(self._ids)
            first_stage = self.first_stage_unverified
            if first_stage:
                probe = next(prefill_messages([0, 0], 1, session, session))  # a PrefillEmbd: nothing sampled
                try:
                    client.request(probe, "a one-token prefill")
                except PipelineClosed as exc:
                    raise PipelineMismatch(f"{exc}; is it stage 0? a later stage answers a readiness probe but "
                                           "refuses a driver's tokens") from None
                except PipelineTimeout:  # its lanes are busy: a later stage refuses tokens at once
                    self.first_stage_unverified = False
                    return self.check_ready(timeout)  # the Stop alone, on a new connection (this one is closed)
            reply = client.request(StageWireMessage.stop(session, session), "a readiness Stop")
            if int(reply.kind) != WireReplyKind.ACK:
                raise PipelineError(f"stage 0 at {client.address} answered a readiness Stop with reply kind "
                                    f"{int(reply.kind)}, not Ack")
            if first_stage:
                self.first_stage_unverified = False
        except BaseException:
            client.close()  # a late answer would stay unread on it
            raise
        self._answered()
        self._give_back(client)

    def close(self) -> None:
        """Close every connection: the pooled ones, and those of generations still running, whose
        reads of a stage that stopped answering would hold them, and the process, until --timeout."""
        self.closed = True
        with self._lock:
            idle, self._idle = self._idle, []
            busy = list(self._busy)
        for client in idle + busy:
            client.close()

    def generate(self, prompt: list[int], *, max_tokens: int, sampling: SamplingParams | None,
                 stop: str | Sequence[str], on_text: Callable[[str, list[int]], None],
                 cancelled: threading.Event | None = None, min_indent: int = 0,
                 line_time_limit_s: float = 0.0) -> Generation:
        """Generate after ``prompt``; ``on_text(text, tokens)`` receives each new piece of
        text and the tokens generated since the last piece.  ``sampling`` None is greedy (as
        a PipelineClient's); ``cancelled``, once set, stops it between two tokens.  As
        llama-server's ``n_indent`` and ``t_max_predict_ms``, the text ends at a line indented
        less than ``min_indent`` (:class:`TextAssembler`), and at the first new line once the
        generation has run ``line_time_limit_s`` past its first token (above 0 each)."""
        started = time.perf_counter()
        sampling = SamplingParams(temperature=0.0) if sampling is None else sampling
        cancelled = threading.Event() if cancelled is None else cancelled
        # a caller's mistake is refused here, not as a failed request on a connection then closed
        prompt, max_tokens, _ = check_generation(prompt, max_tokens, self.chunk_size, n_vocab=self.tokenizer.n_vocab,
                                                 on_text=on_text)
        context_room(len(prompt), max_tokens, self.ctx_size)  # a prompt too long: before a connection is taken
        out = Generation(prompt_tokens=len(prompt))
        assembler = TextAssembler(self.tokenizer, stop, min_indent)
        session = next(self._ids)
        shown_tokens = 0  # assembler.tokens passed to on_text so far
        out_of_time = False  # a new line came past line_time_limit_s

        def on_token(token: int) -> None:
            nonlocal shown_tokens, out_of_time
            if out.first_token_s is None:
                out.first_token_s = time.perf_counter() - started
            if not 0 <= token < self.tokenizer.n_vocab:  # a stage's fault: the pipeline failed, not the request
                raise PipelineError(f"the pipeline predicted token {token}, outside the model's vocabulary "
                                    f"[0, {self.tokenizer.n_vocab})")
            out.completion_tokens += 1  # an end-of-generation token too, as llama-server's n_decoded
            if self.tokenizer.is_eog(token):
                return
            delta = assembler.push(token)
            if delta:
                on_text(delta, assembler.tokens[shown_tokens:])
                shown_tokens = len(assembler.tokens)
                out_of_time = (line_time_limit_s > 0 and "\n" in delta
                               and time.perf_counter() - started - out.first_token_s > line_time_limit_s)
            if assembler.stopped or out_of_time or cancelled.is_set():
                raise Cancelled("stop")

        def before_step() -> None:
            if cancelled.is_set():  # the client left while the last step ran: send no more
                raise Cancelled("stop")

        if self.failing or self.first_stage_unverified:
            self._probe_before_request()
        try:  # a new connection's READY comes within the probe's bound, or the chain is down
            client = self._take(min(self.timeout, READY_TIMEOUT_S))
            client.timeout = self.timeout
            with self._lock:
                if self.closed:  # close() has cut the others off already: this one too
                    client.close()
                    raise PipelineError("the API is stopping")
                self._busy.add(client)
        except PipelineError as exc:  # no READY from the chain: as a failure within it
            with self._lock:
                self.counters["failed"] += 1
                self.counters["requests"] += 1
            self._answered(exc)
            raise
        sent0, received0 = client.sent_bytes, client.received_bytes
        healthy = True
        try:
            result = client.generate(prompt, max_tokens=max_tokens, sampling=sampling.wire(),
                                     chunk_size=self.chunk_size, is_eog=self.tokenizer.is_eog,
                                     on_token=on_token, request_id=session, session_id=session,
                                     before_step=before_step)
            out.finish_reason = "stop" if result.stop_reason == "eog" else "length"
            if result.session_end_error is not None:  # the text is whole; the pipeline may not be
                healthy = False
                self._answered(PipelineError(f"{SESSION_END_UNANSWERED} (session {session}): "
                                             f"{result.session_end_error}"))
        except Cancelled:
            out.finish_reason = "stop"
            healthy = client.alive()  # generate() stopped the session, or closed a connection it could not
            if not healthy:
                self._answered(PipelineError(f"stage 0 at {client.address}: the cancelled session {session} "
                                             "could not be stopped"))
            if cancelled.is_set():
                with self._lock:
                    self.counters["cancelled"] += 1
                raise
        except BaseException as exc:
            healthy = False
            if isinstance(exc, PipelineError):
                self._answered(exc)
            with self._lock:
                self.counters["failed"] += 1
            raise
        finally:
            with self._lock:
                self._busy.discard(client)
                self.counters["sent_bytes"] += client.sent_bytes - sent0
                self.counters["received_bytes"] += client.received_bytes - received0
                self.counters["requests"] += 1
                self.counters["prompt_tokens"] += len(prompt)
                self.counters["completion_tokens"] += out.completion_tokens
            if healthy:
                self._give_back(client)
            else:
                client.close()
        if healthy:
            self._answered()
        tail = assembler.finish()
        if tail:
            on_text(tail, assembler.tokens[shown_tokens:])
        out.text, out.tokens = assembler.text, assembler.tokens
        if assembler.stopping_word:  # also one found only in the held-back rest, as generation ended
            out.finish_reason, out.stop_type, out.stopping_word = "stop", "word", assembler.stopping_word
        elif assembler.under_indented or out_of_time:  # llama-server's limits
            out.finish_reason, out.stop_type = "length", "limit"
        elif out.finish_reason == "stop":
            out.stop_type = "eos"
        out.elapsed_s = time.perf_counter() - started
        return out

    def _probe_before_request(self) -> None:
        """Since a request failed, or before the entry showed it is stage 0: PipelineUnavailable
        unless the pipeline answers now (a PipelineMismatch as itself: no wait mends it)."""
        try:
            self.check_ready()
        except PipelineError as exc:
            since = "since a request failed" if self.failing else "yet"
            with self._lock:
                self.counters["failed"] += 1
                self.counters["requests"] += 1
            if not self.failing:
                self._answered(exc)  # an operator reads why (once, until the pipeline answers again)
            if isinstance(exc, PipelineMismatch):
                raise
            raise PipelineUnavailable(f"{exc} (the pipeline has not answered {since}; retry later)") from None


class Admission:
    """Up to ``max_inflight`` lanes run, ``max_queue`` requests wait (FIFO), the rest are
    refused.  A request holds one lane, and may :meth:`borrow` idle ones for its other
    generations.

    Event-loop only.  :meth:`ticket` asks for a lane and :meth:`withdraw` gives the ask
    up, whether it still waits (it leaves the queue) or was just granted (the lane goes to
    the next in line): a lane is never leaked nor skipped, whatever the waiter's timing."""

    def __init__(self, max_inflight: int, max_queue: int) -> None:
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.running = 0  # lanes granted, borrowed ones included
        self.borrowed = 0
        self.stopping = False
        self._queue: collections.deque[asyncio.Future] = collections.deque()

    @property
    def waiting(self) -> int:
        return len(self._queue)

    def ticket(self) -> asyncio.Future:
        """A future done once a lane is this request's: at once when one is free, else
        in arrival order (cancelled: :meth:`refuse_waiting`); QueueFullError when too many
        already wait, ServerStopping once the server stops."""
        ticket = asyncio.get_running_loop().create_future()
        if self.stopping:
            raise ServerStopping()
        if self.running < self.max_inflight and not self._queue:
            self.running += 1
            ticket.set_result(None)
        elif len(self._queue) >= self.max_queue:
            raise QueueFullError(f"every lane is busy ({self.running} of {self.max_inflight}) and the queue is full "
                                 f"({len(self._queue)} of {self.max_queue} requests); retry later")
        else:
            self._queue.append(ticket)
        return ticket

    def refuse_waiting(self) -> int:
        """The server stops: every waiting ticket is cancelled (its request answered at
        once, not after the running ones' grace period), and so is every later ask.  How
        many were waiting."""
        self.stopping = True
        refused = len(self._queue)
        while self._queue:
            self._queue.popleft().cancel()
        return refused

    def withdraw(self, ticket: asyncio.Future) -> None:
        """Give a ticket up: out of the queue, or its lane back if it was granted."""
        if ticket.done() and not ticket.cancelled():
            self.release()
            return
        ticket.cancel()
        try:
            self._queue.remove(ticket)
        except ValueError:
            pass

    def borrow(self, wanted: int) -> int:
        """Up to ``wanted`` more lanes for a running request: only lanes idle now while no
        request waits (a borrower never queues nor delays one that does: it gives a lane back
        after its current generation once one waits).  How many were granted; each goes back
        with :meth:`give_back`."""
        granted = 0 if self._queue else max(0, min(wanted, self.max_inflight - self.running))
        self.running += granted
        self.borrowed += granted
        return granted

    def give_back(self) -> None:
        """Return a borrowed lane."""
        self.borrowed -= 1
        self.release()

    def release(self) -> None:
        """Give a granted lane back: to the next in line, if any."""
        self.running -= 1
        while self._queue and self.running < self.max_inflight:
            ticket = self._queue.popleft()
            if not ticket.done():  # one cancelled without withdraw() holds nothing
                self.running += 1
                ticket.set_result(None)
