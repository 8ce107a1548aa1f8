"""Decode ahead: a first stage computes a session's next decode step before it is asked.

The first stage knows the next decode step before the driver asks for it: the token is the
one in the reply it has just passed upstream, at the next position.  So it computes that
step right after sending the reply (batched with the other sessions' steps that meet it,
like any decode step), while the reply travels to the driver and the driver's next
DecodeEmbd travels back; when that message arrives and asks for exactly this step (same
session, token and position), its result is forwarded at once.  Anything else first
trims the session back, so the bytes on the wire never change.  A terminal first stage (a
one-stage pipeline) does the same for greedy sessions only, since a sampler's state cannot
be rolled back.

The steps computed ahead are counted in the session's ``decoded_ahead`` and
``discarded_ahead`` (:class:`.session_state.SessionStats`).
"""

from __future__ import annotations

import logging

from ..wire.messages import WireMessageKind as K
from .batching import DecodeStep
from .session_state import AheadStep, ServedSession

log = logging.getLogger("skippy_wire.net.server")


class DecodeAhead:
    """The steps a first stage computes ahead, over its ``backend``, decode ``batcher`` and
    runtime ``lock`` (the server's)."""

    def __init__(self, backend, batcher, lock) -> None:
        self.backend, self.batcher, self.lock = backend, batcher, lock

    def plan(self, msg, session: ServedSession, token: int) -> None:
        """``msg`` (a DecodeEmbd or a prompt's last chunk) is answered with ``token``: that
        token's decode step, at the next position, is the one to compute ahead."""
        if msg.kind in (K.DECODE_EMBD, K.PREFILL_FINAL_EMBD):
            session.next_step = AheadStep(msg.pos_start + msg.token_count, token)

    def compute(self, session: ServedSession) -> None:
        """Run ``session.next_step`` now, batched with the steps of other sessions that
        meet it here like any decode step."""
        step, session.next_step = session.next_step, None
        if getattr(session.runtime, "token_count", None) != step.pos:
            return
        decode = DecodeStep(session.runtime, step.token, None, 0, None)
        try:
            step.predicted, step.frame = self.batcher.decode(decode)
        except Exception as exc:  # noqa: BLE001 -- e.g. a full context; a step nobody asked for
            # must not fail the connection: a message that asks for it gets its own error.
            log.debug("no decode ahead at position %d: %s", step.pos, exc)
            return
        step.compute_s, step.batch_size = decode.compute_s, decode.batch_size
        session.ahead = step

    def claim(self, msg, session: ServedSession) -> AheadStep | None:
        """The step computed ahead if ``msg`` asks for exactly it; otherwise the session is
        trimmed back to where it was before that step, and None."""
        ahead, session.ahead = session.ahead, None
        if (msg.kind == K.DECODE_EMBD and msg.pos_start == ahead.pos and msg.token_count == 1
                and list(msg.tokens) == [ahead.token]
                and (not self.backend.is_terminal or (msg.sampling is None and session.sampling is None))):
            return ahead
        session.stats.discarded_ahead += 1
        session.stats.compute_ms += ahead.compute_s * 1000.0
        with self.lock:
            self.backend.trim(session.runtime, ahead.pos)
        return None


__all__ = ["DecodeAhead"]
