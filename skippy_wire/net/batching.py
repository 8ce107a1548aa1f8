"""Decode steps of several sessions at one stage, run as one multi-session batch.

Each upstream connection of a stage is served by its own thread.  When several sessions
decode at once, their DecodeEmbd messages reach a stage while it is computing another
session's step; :class:`DecodeBatcher` queues them, and one waiting thread at a time takes
the runtime and runs everything queued as ONE native batch (the weight matmuls run over all
rows together, attention per session over its own cache), then hands each thread its own
result: those threads return without taking the runtime, so only the thread that runs the
next batch stands between two batches.  A lone session pays nothing extra: its thread finds
the runtime free and runs its step alone, without queueing it.

Prefill chunks join the same queue (continuous batching): a prompt that arrives while the
stage computes runs in the next batch beside the decode steps waiting there, as one
scheduler iteration of the runtime, instead of after them.  They never wait for partners.

A failed batch is retried one step at a time, so one session's failure (its context is
full, say) fails only that session.

Batches also need steps that arrive together.  Sessions moving through a pipeline drift
apart, so a step that finds the runtime free may wait a little for partners: at most half a
step's compute, only while enough other sessions are decoding here, and only where a batch
has been measured to cost less per row than a step alone (on some CPUs it does not).  Once
a group has run together its members reach every stage together, so the wait is short.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

#: Steps run together at most (the native batch also caps the rows at its n_batch).
DEFAULT_MAX_BATCH = 16
#: The groups of sessions a pipeline keeps apart so that its stages compute at once: a lone
#: step waits for partners while more than this many sessions decode here.
PIPELINE_GROUPS = 2
#: A session counts as decoding here for this many steps' compute after its last step.
ACTIVE_WINDOW_STEPS = 8
#: The longest partner wait, as a fraction of one step's compute.
PARTNER_WAIT_FRACTION = 0.5
#: A batch pays when its cost per row is under this fraction of a step alone.
BATCH_PAYS_BELOW = 0.9
#: Weight of the newest measurement in the running step costs.
COST_SMOOTHING = 0.2


@dataclass
class DecodeStep:
    """One session's decode step -- or, with ``tokens``, a prefill chunk (sampled at the
    terminal stage when ``sample``) -- and, once run, its outcome."""

    session: Any
    token: int
    activation: Any
    state_flags: int
    sampling: Any
    tokens: Optional[Sequence[int]] = None  # a prefill chunk's tokens; None: a decode step
    sample: bool = True
    result: Optional[tuple] = None  # (predicted token, output frame)
    error: Optional[BaseException] = None
    done: bool = False
    batch_size: int = 0  # how many steps ran together with this one (for the stats)
    compute_s: float = 0.0


class DecodeBatcher:
    """Runs queued decode steps together under the stage's runtime lock.

    ``run_batch(steps) -> [(predicted, frame), ...]`` runs several steps as one batch and
    ``run_one(step) -> (predicted, frame)`` runs one; both are called with ``lock`` held.
    ``on_compute(start_ns, end_ns, rows)`` hears of every stretch of compute (monotonic
    clock) and how many steps it ran.
    """

    def __init__(self, run_batch: Callable[[Sequence[DecodeStep]], list], run_one: Callable[[DecodeStep], tuple],
                 lock: threading.Lock, max_batch: int = DEFAULT_MAX_BATCH,
                 on_compute: Optional[Callable[[int, int, int], None]] = None) -> None:
        self._on_compute = on_compute or (lambda start_ns, end_ns, rows: None)
        self._run_batch = run_batch
        self._run_one = run_one
        self._lock = lock
        self._max_batch = max_batch
        self._queue: list[DecodeStep] = []
        self._queue_lock = threading.Lock()
        self.batches = 0
        self.batched_steps = 0
        self.batched_prefills = 0  # prefill chunks that ran in a batch
        self.partner_waits = 0
        self._arrived = threading.Condition(self._queue_lock)
        self._running = False  # a thread is running (or about to run) a batch of the queue
        self._ran = threading.Condition(self._queue_lock)  # notified when that batch is done
        self._last_step: dict[int, float] = {}  # id(session) -> monotonic time of its last step
        self._row_cost: dict[bool, float] = {}  # batched? -> running compute seconds per row

    @property
    def decoding(self) -> int:
        """Sessions counted as decoding here (see ACTIVE_WINDOW_STEPS)."""
        return len(self._last_step)

    @property
    def queued(self) -> int:
        """Steps waiting for the runtime."""
        return len(self._queue)

    def decode(self, step: DecodeStep) -> tuple:
        """Run ``step`` (alone or with the steps queued beside it); its result or error."""
        with self._queue_lock:
            self._last_step[id(step.session)] = time.monotonic()
            alone = not self._queue and len(self._last_step) == 1
        # The only session decoding here, with the runtime free: nothing to batch with, so
        # it runs at once, without the queue and the hand-off (a single request's path).
        if alone and self._lock.acquire(blocking=False):
            try:
                self._run([step])
            finally:
                self._lock.release()
        else:
            with self._queue_lock:
                self._queue.append(step)
                self._arrived.notify_all()
        while not step.done:
            # Wait for this step's batch, or for the turn to run the next one.  A step that
            # ran in another thread's batch is done without queueing for the runtime lock
            # (which would put its thread between that batch and the next).
            with self._queue_lock:
                while not step.done and self._running:
                    self._ran.wait()
                if step.done:
                    break
                self._running = True
            try:
                with self._lock:
                    with self._queue_lock:
                        self._wait_for_partners()
                        batch, self._queue = self._queue[: self._max_batch], self._queue[self._max_batch:]
                    self._run(batch)
            finally:
                with self._queue_lock:
                    self._running = False
                    self._ran.notify_all()
        if step.error is not None:
            raise step.error
        return step.result

    def _run(self, batch: list[DecodeStep]) -> None:
        """Run ``batch`` (the runtime lock held) and report its compute stretch."""
        start_ns = time.monotonic_ns()
        self._execute(batch)
        self._on_compute(start_ns, time.monotonic_ns(), len(batch))

    def forget(self, session: Any) -> None:
        """A freed session no longer counts as decoding here."""
        with self._queue_lock:
            self._last_step.pop(id(session), None)

    def _wait_for_partners(self) -> None:
        """With the runtime and the queue lock held: give the sessions decoding here a short
        while to join the queue when a batch of them would pay (see the module doc)."""
        single, batched = self._row_cost.get(False), self._row_cost.get(True)
        if single is None or any(step.tokens is not None for step in self._queue):
            return
        now = time.monotonic()
        window = ACTIVE_WINDOW_STEPS * single
        for key in [k for k, last in self._last_step.items() if now - last > window]:
            del self._last_step[key]
        if batched is not None and batched >= BATCH_PAYS_BELOW * single:
            return
        want = min(self._max_batch, -(-len(self._last_step) // PIPELINE_GROUPS))
        if len(self._queue) >= want:
            return
        self.partner_waits += 1
        deadline = now + PARTNER_WAIT_FRACTION * single
        while len(self._queue) < want and self._arrived.wait(max(0.0, deadline - time.monotonic())):
            pass

    def _measured(self, rows: int, seconds: float) -> None:
        key = rows > 1
        per_row = seconds / rows
        old = self._row_cost.get(key)
        self._row_cost[key] = per_row if old is None else old + COST_SMOOTHING * (per_row - old)

    def _execute(self, batch: list[DecodeStep]) -> None:
        started = time.perf_counter()
        if len(batch) > 1:
            try:
                results = self._run_batch(batch)
            except Exception:  # noqa: BLE001 -- isolate the failing step below
                results = None
            if results is not None:
                prefills = sum(step.tokens is not None for step in batch)
                self.batches += 1
                self.batched_steps += len(batch)
                self.batched_prefills += prefills
                elapsed = time.perf_counter() - started
                if not prefills:  # the running costs are of decode rows
                    self._measured(len(batch), elapsed)
                for step, result in zip(batch, results):
                    step.result, step.batch_size, step.compute_s, step.done = result, len(batch), elapsed, True
                return
        for step in batch:
            one_started = time.perf_counter()
            try:
                step.result = self._run_one(step)
            except BaseException as exc:  # noqa: BLE001 -- re-raised in the step's own thread
                step.error = exc
            step.batch_size, step.compute_s, step.done = 1, time.perf_counter() - one_started, True
            if step.error is None and step.tokens is None:
                self._measured(1, step.compute_s)
