"""What one loopback hop costs on this machine when the receiver has been idle.

    python bench/wake_bench.py [--size 2314] [--gaps 0,0.2,1,5,12] [--count 400] [--compute-steps 80]

A child process answers every SIZE-byte message (a SmolLM2 decode activation with its
frame is 2,314 bytes) with 64 bytes over TCP on 127.0.0.1.  Before each message the parent
busy-waits GAP ms, as a stage computes while its neighbour sleeps in ``recv``; the figure is
the round trip from the send to the answer (median and 90th percentile), and its ratio to
the back-to-back round trip of the same run.  A pipeline hop pays this wake-up once for the
message and once for the reply: it is the floor under the per-hop cost of
``bench/hop_bench.py`` (on a virtual machine an idle vCPU halts, and waking it costs more
than the bytes).  The same round trip is also timed with both ends polling the socket
(non-blocking receives in a loop) instead of sleeping in ``recv``: what is left is what the
kernel and the host charge for the bytes after the caches went cold.

A second table times one decode step of a stage holding SmolLM2's first 15 layers (1
thread) back to back, after each GAP of sleep (the core idles, as a pipeline stage's does
while its neighbours compute) and after each GAP of busy-waiting: the compute a stage does
right after idling is what a split pipeline pays beyond one stage's.

A third table does the same for one small step of a stage's Python path: encoding a decode
step's activation (576 f32 values) for the wire, under a microsecond back to back.  What
it costs after a gap is what every stretch of the per-hop breakdown pays on this host.
"""

from __future__ import annotations

import argparse
import math
import os
import socket
import statistics
import sys
import time

import numpy as np

from skippy_wire import ActivationCodec, encode_activation
from skippy_wire.net.backend import RuntimeBackend
from skippy_wire.net.supervision import default_model
from skippy_wire.tools.bench_rows import comma_list, cpu_text, script_main
from skippy_wire.tools.options import float_between, int_at_least, int_between

ANSWER_BYTES = 64
MAX_SIZE = 64 << 20  # a message (a prefill chunk's activation is a few MB)
MAX_GAP_MS = 1000.0  # idle before each message (a decode step's wait is tens of ms)
N_EMBD = 576  # SmolLM2-135M's activation width
MAX_COMPUTE_STEPS = 8000  # decode steps in one session: within SmolLM2's 8192-token training context


def _recv_exactly(sock: socket.socket, buf: bytearray) -> None:
    """Fill ``buf``; on a non-blocking socket, by polling (never sleeping)."""
    view, got = memoryview(buf), 0
    while got < len(buf):
        try:
            n = sock.recv_into(view[got:])
        except BlockingIOError:
            continue
        if not n:
            raise ConnectionError("peer closed")
        got += n


def _send_all(sock: socket.socket, data: bytes) -> None:
    """Send ``data``; on a non-blocking socket, by polling (a message larger than the socket's
    buffer: a prefill chunk's)."""
    view, sent = memoryview(data), 0
    while sent < len(view):
        try:
            sent += sock.send(view[sent:])
        except BlockingIOError:
            continue


def _answer(port: int, size: int, count: int, poll: bool) -> None:
    sock = socket.create_connection(("127.0.0.1", port))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setblocking(not poll)
    buf = bytearray(size)
    for _ in range(count):
        _recv_exactly(sock, buf)
        _send_all(sock, b"a" * ANSWER_BYTES)


def round_trips(size: int, gap_s: float, count: int, poll: bool = False) -> list[float]:
    """Seconds of each round trip after ``gap_s`` of busy-waiting; ``poll``: both ends poll."""
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        pid = os.fork()
        if pid == 0:
            try:
                _answer(port, size, count, poll)
            finally:
                os._exit(0)
        conn, _ = server.accept()
    try:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn.setblocking(not poll)
        data, answer, times = b"m" * size, bytearray(ANSWER_BYTES), []
        for _ in range(count):
            until = time.perf_counter() + gap_s
            while time.perf_counter() < until:  # compute here while the peer sleeps
                pass
            started = time.perf_counter()
            _send_all(conn, data)
            _recv_exactly(conn, answer)
            times.append(time.perf_counter() - started)
        return times
    finally:
        conn.close()
        os.waitpid(pid, 0)


def percentile_90(ordered: list[float]) -> float:
    """The 90th percentile of sorted values, by nearest rank (the 9th of 10, not the largest)."""
    return ordered[math.ceil(0.9 * len(ordered)) - 1]


def _idle(gap_s: float, busy: bool) -> None:
    if not gap_s:  # back to back: no system call either (sleep(0) is one, and costs the step after it)
        return
    if not busy:
        time.sleep(gap_s)
        return
    until = time.perf_counter() + gap_s
    while time.perf_counter() < until:
        pass


def medians_after_idle(gaps_s: list[float], count: int, step, reset=lambda: None) -> dict:
    """Median seconds of ``step()`` after each (gap, busy) way of spending the gap, ``count``
    times each; ``reset()`` after each row."""
    medians = {}
    for gap in gaps_s:
        for busy in ((False,) if gap == 0 else (False, True)):
            times = []
            for _ in range(count):
                _idle(gap, busy)
                started = time.perf_counter()
                step()
                times.append(time.perf_counter() - started)
            reset()
            medians[gap, busy] = statistics.median(times)
    return medians


def compute_after_idle(gaps_s: list[float], steps: int) -> dict:
    """One decode step of a stage holding SmolLM2's first 15 layers, after each gap."""
    backend = RuntimeBackend.open(default_model(), 0, 15, stage_index=0, ctx_size=steps + 8, n_threads=1)
    session = backend.create_session()
    return medians_after_idle(gaps_s, steps, lambda: backend.decode(session, 100, None, 0, sampling=None),
                              reset=lambda: backend.trim(session, 0))


def call_after_idle(gaps_s: list[float], count: int) -> dict:
    """One activation encode (the forwarding stage's), after each gap."""
    values = np.linspace(-1.0, 1.0, N_EMBD, dtype=np.float32)
    return medians_after_idle(gaps_s, count,
                              lambda: encode_activation(ActivationCodec.RAW_F32_V1, 1, N_EMBD, values))


def _idle_table(title: str, medians: dict, unit: str, scale: float) -> None:
    ref = medians[0.0, False]
    print(f"\n# {title}")
    print(f"| before each | {unit} | vs back-to-back |")
    print("|---|---|---|")
    for (gap, busy), seconds in medians.items():
        how = "nothing (back to back)" if gap == 0 else f"{gap * 1000:g} ms {'busy' if busy else 'asleep'}"
        print(f"| {how} | {seconds * scale:.2f} | {seconds / ref:.2f}x |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--size", type=int_between(1, MAX_SIZE), default=2314, help="bytes per message")
    p.add_argument("--gaps", type=comma_list(float_between(0, MAX_GAP_MS)), default="0,0.2,1,5,12",
                   help="comma list of idle ms before each message (0, back to back, is always measured first)")
    p.add_argument("--count", type=int_at_least(1), default=400, help="round trips per row")
    p.add_argument("--compute-steps", type=int_between(0, MAX_COMPUTE_STEPS), default=80,
                   help="decode steps per row of the compute table (0: skip)")
    args = p.parse_args(argv)
    gaps = [0.0] + [g for g in args.gaps if g]  # the reference row first
    print(f"# loopback round trip of a {args.size}-byte message after the peer idled; "
          f"{args.count} per row; CPU: {cpu_text()}")
    print("| idle before (ms) | median us | p90 us | median vs back-to-back | both ends polling: median us | p90 us |")
    print("|---|---|---|---|---|---|")
    base = None
    for gap in gaps:
        cells = []
        for poll in (False, True):
            times = sorted(round_trips(args.size, gap / 1000.0, args.count, poll))
            cells.append((statistics.median(times), percentile_90(times)))
        (median, p90), (polled, polled_p90) = cells
        base = base or median
        print(f"| {gap:g} | {median * 1e6:.0f} | {p90 * 1e6:.0f} | {median / base:.2f}x | {polled * 1e6:.0f} | "
              f"{polled_p90 * 1e6:.0f} |", flush=True)
    idle_gaps = [g / 1000.0 for g in gaps]
    if args.compute_steps:
        _idle_table(f"one decode step of layers 0..15 (1 thread), median of {args.compute_steps}",
                    compute_after_idle(idle_gaps, args.compute_steps), "ms", 1e3)
    _idle_table(f"one raw-f32 activation encode ({N_EMBD} values), median of {args.count}",
                call_after_idle(idle_gaps, args.count), "us", 1e6)
    return 0


if __name__ == "__main__":
    sys.exit(script_main(main))
