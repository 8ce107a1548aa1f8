"""What a stage admits from its peers: lanes, sessions per connection, message sizes.

* :class:`LaneGate` hands out the stage's execution lanes (one per open session) in FIFO
  order: when all are busy a new session waits at most ``wait`` seconds behind the
  sessions that asked before it, then fails with one clear line instead of the runtime's
  native "no lane" error.
* :func:`max_message_bytes` is the largest stage message this stage could ever execute,
  derived from its own model (``ctx_size``, ``n_embd``) and the wire limits: the decoders
  refuse a message declaring more from its fixed prefix, before its payload is read.
* :func:`check_runnable` refuses a parsed message no stage of the pipeline could run,
  before it changes a session.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional

from ..errors import StageError
from ..stage.bridge import sidebands_unsupported
from ..stage.native import check_sampling
from ..stage.sampling import sampling_to_bytes
from ..wire.messages import WireMessageKind
from ..wire.constants import (
    MAX_STAGE_DRY_SEQUENCE_BREAKERS,
    MAX_STAGE_LOGIT_BIAS,
    MAX_STAGE_SAMPLERS,
    MAX_STAGE_SAMPLING_STRING_BYTES,
    ROW_DOUBLING_SIDEBANDS,
    STAGE_WIRE_FIXED_HEADER_BYTES,
    activation_frame_flags_from_state_flags,
    activation_payload_multiplier_from_state_flags,
)

log = logging.getLogger("skippy_wire.net.server")

#: Sessions one upstream connection may hold at once (the driver and the api use 1).
DEFAULT_MAX_SESSIONS_PER_CONNECTION = 2
#: Seconds a new session waits for a lane when all are busy.
DEFAULT_LANE_WAIT = 10.0
#: Seconds between two looks, while a session waits for a lane, at whether its peer left.
PEER_CHECK_INTERVAL = 0.2
#: Connections a stage serves at once; more are refused at accept.
DEFAULT_MAX_CONNECTIONS = 64
#: Seconds a whole message may take to arrive after its first byte.
DEFAULT_MESSAGE_TIMEOUT = 30.0
#: Seconds a connection may sit idle between messages.
DEFAULT_IDLE_TIMEOUT = 300.0
#: Bytes of chat sampling metadata a message may carry (the wire allows 8 MiB; the
#: driver and the api send a few hundred bytes).
CHAT_METADATA_ALLOWANCE = 64 * 1024
#: An upper bound of the v16/v17 activation framing around the rows: the 68-byte frame
#: header, 16 part headers of 128 bytes, the v17 agreement header (generation, profile,
#: counts, mask, dynamic dimensions), with room to spare.
FRAME_OVERHEAD_ALLOWANCE = 8 * 1024


@dataclass(frozen=True)
class StageLimits:
    """What one stage admits (the ``serve`` options of the same names, docs/pipeline.md).
    ``max_message_bytes`` None: :func:`max_message_bytes` of the stage's model."""

    message_timeout: float = DEFAULT_MESSAGE_TIMEOUT
    max_connections: int = DEFAULT_MAX_CONNECTIONS
    max_sessions_per_connection: int = DEFAULT_MAX_SESSIONS_PER_CONNECTION
    lane_wait: float = DEFAULT_LANE_WAIT
    max_message_bytes: Optional[int] = None


def overdue_message(message_timeout: float, decoder) -> StageError:
    """A message not complete ``message_timeout`` seconds after its first byte, with how far
    its ``decoder`` got: a legitimate message over a slow link hits the limit too."""
    return StageError(f"message not complete {message_timeout:g} s after its first byte ({decoder.buffered} bytes "
                      f"received, at least {decoder.wanted} more to come; a link this slow needs a larger "
                      "--message-timeout)")


def idle_sessions(sessions: dict, idle: float, now: float) -> tuple[list[int], float]:
    """The ids of the ``sessions`` (each with ``last_compute``) that computed nothing for ``idle``
    seconds by ``now``, and the seconds until the next of the others will have (``idle`` if none)."""
    stale = [sid for sid, session in sessions.items() if session.last_compute + idle <= now]
    left = [session.last_compute for sid, session in sessions.items() if sid not in stale]
    return stale, min(left) + idle - now if left else idle


def sampling_block_bytes() -> int:
    """The largest sampling block (wire-format.md 4.3: 108 bytes of fixed fields, then
    8 per logit bias and 4 + length per DRY breaker and sampler string)."""
    string = 4 + MAX_STAGE_SAMPLING_STRING_BYTES
    return (108 + 8 * MAX_STAGE_LOGIT_BIAS + MAX_STAGE_DRY_SEQUENCE_BREAKERS * string
            + MAX_STAGE_SAMPLERS * string)


def max_message_bytes(ctx_size: int, n_embd: int) -> int:
    """The largest stage message a stage with this context and width can execute.

    The prefix, a full sampling block, the chat-metadata allowance, ``ctx_size`` tokens and
    positions, and an f32 activation of ``ctx_size`` rows of ``n_embd`` at the largest
    sideband multiplier (v15's row-doubling flags), plus the v16/v17 frame framing."""
    rows = ctx_size * activation_payload_multiplier_from_state_flags(ROW_DOUBLING_SIDEBANDS)
    return (STAGE_WIRE_FIXED_HEADER_BYTES + sampling_block_bytes() + 4 + CHAT_METADATA_ALLOWANCE
            + 2 * 4 * ctx_size + rows * n_embd * 4 + FRAME_OVERHEAD_ALLOWANCE)


#: The kinds a stage computes (the others configure, trim or stop a session): after the
#: first stage, on the activation of the one before.
COMPUTED_KINDS = (WireMessageKind.PREFILL_EMBD, WireMessageKind.PREFILL_FINAL_EMBD, WireMessageKind.DECODE_EMBD)


def check_runnable(msg, backend) -> None:
    """Refuse, before any cache changes, a DecodeEmbd of more than one token (the runtime
    decodes one a step), activation sidebands (no model here has them), a driver's message
    (tokens, no activation) at a stage that is not the first, another stage's message (an
    activation) at the first, explicit positions other than the tokens' own, and sampling
    the terminal stage's native sampler would refuse (with its reason, here, rather than
    relayed to close the pipeline with none)."""
    if msg.kind == WireMessageKind.DECODE_EMBD and msg.token_count != 1:
        raise StageError(f"a DecodeEmbd carries one token, this one {msg.token_count}")
    sidebands = activation_frame_flags_from_state_flags(msg.state.flags)
    if msg.kind in COMPUTED_KINDS and sidebands:  # stage 0 computed the step and failed forwarding it
        raise StageError(sidebands_unsupported(sidebands))
    if not backend.is_source and msg.kind in COMPUTED_KINDS and msg.state.source_stage_index < 0:
        raise StageError(f"a driver's {WireMessageKind(msg.kind).name} (tokens, no activation) reached a stage "
                         f"that starts at layer {backend.layer_start}, not the first stage: a driver connects "
                         "to stage 0")
    if backend.is_source and msg.kind in COMPUTED_KINDS and msg.state.source_stage_index >= 0:
        # the first stage embeds the tokens itself: it would drop the activation unread
        raise StageError(f"stage {msg.state.source_stage_index}'s {WireMessageKind(msg.kind).name} (an activation) "
                         "reached a first stage (layer 0 on), which embeds the driver's tokens: a stage's "
                         "downstream is the stage after it")
    if msg.kind in COMPUTED_KINDS and msg.positions and not _own_positions(msg):
        # the runtime places a message's tokens at pos_start on; other places were computed wrongly, silently
        raise StageError(f"{WireMessageKind(msg.kind).name} at position {msg.pos_start} carries "
                         f"{len(msg.positions)} explicit positions that are not its {msg.token_count} tokens' own "
                         f"({msg.pos_start} on, one each): this stage computes no other positions")
    if msg.sampling is not None:  # a ConfigureGeneration's too: every stage would relay and Ack it
        check_sampling(sampling_to_bytes(msg.sampling))


def check_position(msg, runtime, backend, lock) -> None:
    """``msg.pos_start`` against the token count of the session's ``runtime``.  A decode position is
    authoritative (wire-format.md 12): one behind the session (a rejected draft) trims the session back
    to it (under the runtime ``lock``).  A prefill chunk must start exactly where the session ends.
    Anything else is a driver error."""
    have = getattr(runtime, "token_count", None)
    if have is None or msg.pos_start == have:
        return
    if msg.kind == WireMessageKind.DECODE_EMBD and 0 <= msg.pos_start < have:
        with lock:
            backend.trim(runtime, msg.pos_start)
        return
    raise StageError(f"{WireMessageKind(msg.kind).name} at position {msg.pos_start}, but session {msg.session_id} "
                     f"holds {have} tokens")


def _own_positions(msg) -> bool:
    """Whether ``msg``'s explicit positions are the ones its tokens take anyway."""
    return len(msg.positions) == msg.token_count and all(
        position == msg.pos_start + i for i, position in enumerate(msg.positions))


class LaneGate:
    """``lanes`` execution lanes, granted first come, first served.

    :meth:`acquire` takes a lane or waits (FIFO) up to ``wait`` seconds, then raises
    ``StageError("all N lanes are busy; gave up after S s")``; :meth:`release` returns one.
    ``lanes=None`` grants every request at once (a backend that reports no lane count).
    ``busy`` and ``waiter`` word the errors of a gate of something else than lanes."""

    def __init__(self, lanes: int | None, wait: float, busy: str = "lanes are busy",
                 waiter: str = "its session waited for a lane") -> None:
        self.lanes, self.wait, self.busy_text, self.waiter = lanes, wait, busy, waiter
        self.busy = 0
        self._cond = threading.Condition()
        self._queue: collections.deque = collections.deque()

    def acquire(self, gone: Callable[[], bool] | None = None) -> None:
        """``gone()``, asked every :data:`PEER_CHECK_INTERVAL` s of a wait, says whether the
        waiting session's peer has left: it then gives its place up at once (a flood of
        connections that ask and leave would otherwise keep the queue full until ``wait``)."""
        with self._cond:
            if self.lanes is None or (not self._queue and self.busy < self.lanes):
                self.busy += 1
                return
            ticket = object()
            self._queue.append(ticket)
            deadline = time.monotonic() + self.wait
            try:
                while self._queue[0] is not ticket or self.busy >= self.lanes:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StageError(f"all {self.lanes} {self.busy_text}"
                                         + (f"; gave up after {self.wait:g} s" if self.wait > 0 else ""))
                    if gone is not None and gone():
                        raise StageError(f"the peer left while {self.waiter}")
                    self._cond.wait(left if gone is None else min(left, PEER_CHECK_INTERVAL))
                self.busy += 1
            finally:
                self._queue.remove(ticket)
                self._cond.notify_all()  # the next in line may now be at the head

    def release(self) -> None:
        with self._cond:
            self.busy -= 1
            self._cond.notify_all()

    @contextlib.contextmanager
    def held(self, gone: Callable[[], bool] | None = None) -> Iterator[None]:
        """Inside: a lane taken (:meth:`acquire`), given back on leaving."""
        self.acquire(gone)
        try:
            yield
        finally:
            self.release()


#: Connections a stage sets up at once (each connecting to its downstream and waiting for its
#: READY; a setup takes milliseconds): one more is refused at once.  Downstreams that lead
#: back to the stage (A -> B -> A) set up connections without end, each the last one's
#: downstream: the refusal ends the chain, which then comes apart link by link (waiting
#: instead, each place freed went to the next link, and the chain lived on), and its error
#: names the loop.
MAX_DOWNSTREAM_SETUPS = 32
#: How a full setup gate words its errors (:class:`LaneGate`).
DOWNSTREAM_SETUP_WORDS = ("connections are waiting for their downstream's READY (downstreams that lead back to "
                          "this stage, A -> B -> A, make them without end)",
                          "its connection waited to set up its downstream")


class SessionAdmission:
    """The sessions of a stage: at most ``per_connection`` per connection, each on a lane
    of a :class:`LaneGate`."""

    def __init__(self, lanes: int | None, wait: float, per_connection: int) -> None:
        self.lanes = LaneGate(lanes, wait)
        self.per_connection = per_connection

    def open(self, held: int, session_id: int, create: Callable[[], Any], lock,
             gone: Callable[[], bool] | None = None):
        """``create()`` (under ``lock``) a session for a connection holding ``held``, once a
        lane is free (``gone``: see :meth:`LaneGate.acquire`)."""
        if held >= self.per_connection:
            raise StageError(f"session {session_id} refused: the connection already holds {held} sessions "
                             f"(max-sessions-per-connection {self.per_connection})")
        self.lanes.acquire(gone)
        try:
            with lock:
                return create()
        except BaseException:
            self.lanes.release()
            raise

    def release(self) -> None:
        """A session's lane back (once the session is freed)."""
        self.lanes.release()


class ConnectionLimit:
    """``limit`` connections at once.  At the limit a new connection sheds the one quiet
    longest (:meth:`quiet`: holding no session and executing no message, so idle, in its
    setup, with a message still arriving or a reply its peer does not read), else it is
    refused and closed; both are logged at most one line a second, with the running counts.
    Idle peers thus cannot lock users out until their idle timeout, and a connection serving
    a session is never shed."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.refused = 0
        self.shed_count = 0
        self._logged = 0.0
        self._quiet: dict[int, tuple[float, object]] = {}  # seq -> (since, socket)
        self._shed: set[int] = set()  # connections shed whose thread has not ended yet
        self._lock = threading.Lock()

    def quiet(self, seq: int, sock) -> None:
        """Connection ``seq`` holds no session and executes no message from now on."""
        with self._lock:
            self._quiet[seq] = (time.monotonic(), sock)

    def busy(self, seq: int) -> None:
        """Connection ``seq`` executes a message: not to be shed (if it was shed already,
        as its message completed, it stays marked so: its errors are the shedding's)."""
        with self._lock:
            self._quiet.pop(seq, None)

    def ended(self, seq: int) -> None:
        """Connection ``seq`` has ended: forgotten."""
        with self._lock:
            self._quiet.pop(seq, None)
            self._shed.discard(seq)

    def was_shed(self, seq: int) -> bool:
        """Whether connection ``seq`` was shed (until it ends)."""
        return seq in self._shed

    def shed_quietest(self):
        """The socket of the connection quiet longest, taken off the quiet ones (the caller
        closes it), or None when none is quiet."""
        with self._lock:
            if not self._quiet:
                return None
            seq = min(self._quiet, key=lambda k: self._quiet[k][0])
            since, sock = self._quiet.pop(seq)
            self._shed.add(seq)
        self.shed_count += 1
        if self._log_now():
            log.warning("closed connection %d, quiet for %.1f s, to make room: %d connections open "
                        "(max-connections; %d closed so far)", seq, time.monotonic() - since, self.limit,
                        self.shed_count)
        return sock

    def _log_now(self) -> bool:
        now = time.monotonic()
        if now - self._logged < 1.0:
            return False
        self._logged = now
        return True

    def refuse(self, sock, addr) -> None:
        sock.close()
        self.refused += 1
        if self._log_now():
            log.warning("refused connection from %s:%d: %d connections open, none quiet (max-connections; "
                        "%d refused so far)", addr[0], addr[1], self.limit, self.refused)


__all__ = ["StageLimits", "overdue_message", "SessionAdmission", "ConnectionLimit", "LaneGate",
           "MAX_DOWNSTREAM_SETUPS", "DOWNSTREAM_SETUP_WORDS",
           "DEFAULT_MAX_SESSIONS_PER_CONNECTION", "DEFAULT_LANE_WAIT", "PEER_CHECK_INTERVAL", "DEFAULT_MAX_CONNECTIONS",
           "DEFAULT_MESSAGE_TIMEOUT", "DEFAULT_IDLE_TIMEOUT", "CHAT_METADATA_ALLOWANCE", "FRAME_OVERHEAD_ALLOWANCE",
           "sampling_block_bytes", "max_message_bytes", "COMPUTED_KINDS", "check_runnable"]
