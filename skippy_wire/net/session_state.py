"""What a stage server keeps for each session it serves: the runtime session, the sampling
it was configured with, its traffic counters (reported in the "session" event), the marks
along a DecodeEmbd's path, and the decode step computed ahead for it (:mod:`.server`,
:mod:`.decode_ahead`)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

#: The stretches of a DecodeEmbd's path through a stage, in order: from its last byte
#: received to the runtime call (``queue``: reading it out, waiting for the runtime and
#: the batch), the runtime call, encoding the forwarded message, sending it, waiting for
#: the downstream reply, and relaying that reply upstream (on the terminal stage: writing
#: and sending its own reply).
DECODE_STRETCHES = ("queue", "compute", "encode", "send", "downstream_wait", "relay")


class DecodeTimer:
    """perf_counter() marks along one DecodeEmbd's path (see DECODE_STRETCHES)."""

    __slots__ = ("received", "compute_start", "compute_end", "encoded", "sent", "replied", "ahead_s")

    def __init__(self, received: float) -> None:
        self.received = received
        self.compute_start = self.compute_end = self.encoded = self.sent = self.replied = 0.0
        self.ahead_s = 0.0  # a step computed ahead: its compute; compute_start/end mark its take-over

    def add_to(self, totals: dict, relayed: float) -> None:
        end = self.compute_end
        stretches = {"queue": self.compute_start - self.received, "compute": end - self.compute_start}
        if self.ahead_s:
            stretches["compute"] = self.ahead_s
        if self.sent:  # a forwarding stage
            stretches.update(encode=self.encoded - end, send=self.sent - self.encoded,
                             downstream_wait=self.replied - self.sent, relay=relayed - self.replied)
        else:
            stretches["relay"] = relayed - end
        for name, seconds in stretches.items():
            totals[name] += int(seconds * 1e6)


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
    batched_decode_steps: int = 0  # decode steps that ran in a batch with other sessions'
    decoded_ahead: int = 0  # decode steps computed before their message arrived (.decode_ahead)
    discarded_ahead: int = 0  # steps computed ahead that the next message did not ask for
    #: Where a DecodeEmbd's time goes at this stage, summed over the session (microseconds):
    #: see DECODE_STRETCHES.
    decode_path_us: dict = field(default_factory=lambda: dict.fromkeys(DECODE_STRETCHES, 0))

    def as_dict(self) -> dict:
        return dict(self.__dict__)


@dataclass
class AheadStep:
    """A decode step computed ahead (:mod:`.decode_ahead`): ``token`` at position ``pos``."""

    pos: int
    token: int
    predicted: int = -1
    frame: Any = None
    compute_s: float = 0.0
    batch_size: int = 0


@dataclass
class ServedSession:
    """One session a stage serves: its runtime session, the sampling ConfigureGeneration set,
    its counters and the decode step computed ahead for it."""

    runtime: Any
    sampling: Any = None
    chat_metadata: str | None = None
    stats: SessionStats = field(default_factory=SessionStats)
    #: The step to compute ahead once the reply is sent, then that step's result.
    next_step: AheadStep | None = None
    ahead: AheadStep | None = None
    #: time.monotonic() of its opening or the reply to its last prefill or decode: a session
    #: holds a lane only while it computes now and then (the idle timeout).
    last_compute: float = field(default_factory=time.monotonic)

    @property
    def asked_tokens(self) -> int:
        """The tokens the peer's messages put in this session: a step computed ahead, which
        no message has asked for yet, is not one of them."""
        return self.runtime.token_count if self.ahead is None else self.ahead.pos


#: How many freed session ids a connection remembers.
FREED_IDS_KEPT = 64


class FreedSessions:
    """The ids of one connection's sessions that the idle timeout freed (the latest
    :data:`FREED_IDS_KEPT`): a later message for one is refused, naming why, but a Stop or a
    ConfigureGeneration that opens the id anew (it was opened anew in silence, its sampling lost)."""

    def __init__(self) -> None:
        self._ids: dict[int, None] = {}

    def add(self, session_id: int) -> None:
        self._ids[session_id] = None
        if len(self._ids) > FREED_IDS_KEPT:
            del self._ids[next(iter(self._ids))]

    def claim(self, session_id: int) -> bool:
        """Whether ``session_id`` was freed (forgotten from now on)."""
        freed = session_id in self._ids
        self._ids.pop(session_id, None)
        return freed


__all__ = ["DECODE_STRETCHES", "DecodeTimer", "SessionStats", "AheadStep", "ServedSession", "FreedSessions",
           "FREED_IDS_KEPT"]
