"""Ctrl-C during a long native computation (``skippy_wire.stage.interrupt``): the command
stops at the computation's next graph node, not when the call returns, and the session is
left as it was."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from skippy_wire.errors import StageRuntimeError
from skippy_wire.stage import _backend as B
from skippy_wire.stage.batch import IterationBatchRequest, iteration_batch_sampled
from skippy_wire.stage.interrupt import interruptible_compute
from skippy_wire.stage.native import retry_with_required_capacity
from skippy_wire.stage.runtime import StageModel

from process_helpers import default_sigint
from test_backend_smollm2 import smollm2  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[1]
#: A prompt SmolLM2 takes seconds to prefill on one thread (about 2 s per 512 tokens here).
LONG = 2048
SIGNAL_AFTER_S = 1.0


@pytest.fixture(autouse=True)
def ctrl_c_raises():
    """Ctrl-C as a terminal's command meets it: a runner started in the background (``cmd &``)
    ignores SIGINT, and Python then installs no KeyboardInterrupt handler."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def _timed_signal(signum: int, delay: float) -> threading.Timer:
    timer = threading.Timer(delay, os.kill, (os.getpid(), signum))
    timer.start()
    return timer


def test_ctrl_c_stops_a_long_prefill_at_once_and_leaves_the_session_as_it_was(smollm2):
    model = B.Model(smollm2, n_threads=1, ctx_size=LONG + 64)
    session = model.create_session()
    prompt = [(7 * i) % 1000 + 10 for i in range(LONG)]
    with interruptible_compute():
        timer = _timed_signal(signal.SIGINT, SIGNAL_AFTER_S)
        started = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            retry_with_required_capacity(session.prefill_chunk_frame, prompt)
        stopped = time.monotonic() - started
        timer.join()
    # The whole prefill takes several times the signal's delay: it stopped well before its end.
    assert stopped < SIGNAL_AFTER_S + 1.0, stopped
    assert session.position == 0
    # Once the context has ended, the backend computes again (the flag is cleared).
    assert retry_with_required_capacity(session.prefill_chunk_frame, prompt[:8]) is not None
    assert session.position == 8


def test_without_a_pending_signal_an_interrupted_call_says_so(smollm2):
    model = B.Model(smollm2, n_threads=1, ctx_size=64)
    session = model.create_session()
    B.set_interrupted(True)
    try:
        with pytest.raises(StageRuntimeError, match="computation interrupted"):
            retry_with_required_capacity(session.prefill_chunk_frame, [10, 11, 12])
    finally:
        B.set_interrupted(False)
    assert session.position == 0


def test_a_batch_past_n_batch_interrupted_midway_moves_no_session(smollm2):
    """Rows past n_batch run request by request: the first request's session advanced in the
    backend while the adapter's token_count stayed, and every later call ran one past it."""
    model = StageModel.open(smollm2, 0, None, n_threads=1, lane_count=2, ctx_size=LONG + 64, n_batch=256)
    quick, long_ = model.create_session(), model.create_session()
    requests = [IterationBatchRequest(quick, [10, 11, 12, 13]),
                IterationBatchRequest(long_, [(7 * i) % 1000 + 10 for i in range(LONG)])]
    # the 4-token request takes milliseconds, the long one seconds: the flag lands in the long one
    timer = threading.Timer(SIGNAL_AFTER_S, B.set_interrupted, (True,))
    timer.start()
    try:
        with pytest.raises(StageRuntimeError, match="request 1: computation interrupted"):
            iteration_batch_sampled(requests)
    finally:
        timer.join()
        B.set_interrupted(False)
    for session in (quick, long_):
        assert session.token_count == session.native_position() == 0
    retry_with_required_capacity(quick.prefill_chunk_frame, [10, 11, 12, 13])
    assert quick.token_count == quick.native_position() == 4


def test_a_ctrl_c_caught_inside_the_block_leaves_the_backend_computing(smollm2):
    """The flag the watcher set stayed set: every later computation in the block failed."""
    model = B.Model(smollm2, n_threads=1, ctx_size=64)
    session = model.create_session()
    with interruptible_compute():
        with pytest.raises(KeyboardInterrupt):
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(1.0)  # Python code: the handler raises here
        time.sleep(0.2)  # the watcher has seen the signal by now
        outcomes = []
        for _ in range(3):
            try:
                outcomes.append(retry_with_required_capacity(session.prefill_chunk_frame, [10]) is not None)
            except StageRuntimeError as exc:  # the flag meant for a computation that never ran
                assert "computation interrupted" in str(exc)
                outcomes.append(False)
    assert outcomes[1:] == [True, True], outcomes  # one at most is stopped by it


def test_the_wake_up_descriptor_set_before_is_kept_and_fed():
    """An event loop's wake-up descriptor gets every signal's byte inside the block, and is
    the process's again after it."""
    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)
    outer = signal.set_wakeup_fd(write_end)
    try:
        with interruptible_compute():
            assert signal.set_wakeup_fd(signal.set_wakeup_fd(-1)) != write_end  # the block's own
            with pytest.raises(KeyboardInterrupt):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(1.0)
            time.sleep(0.2)
        assert signal.set_wakeup_fd(write_end) == write_end
        assert os.read(read_end, 16) == bytes([signal.SIGINT])
    finally:
        signal.set_wakeup_fd(outer)
        os.close(read_end)
        os.close(write_end)


def test_bench_backend_exits_130_promptly_on_ctrl_c():
    """bench-backend --prefill 2048 went on for the whole prefill after a Ctrl-C."""
    proc = subprocess.Popen([sys.executable, "-m", "skippy_wire", "bench-backend", "-t", "1", "--repeat", "1",
                             "--decode", "4", "--prefill", str(LONG)], cwd=REPO, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, preexec_fn=default_sigint)
    try:
        for line in proc.stdout:  # the table's header: the prefill starts now
            if line.startswith("threads |"):
                break
        time.sleep(SIGNAL_AFTER_S)
        proc.send_signal(signal.SIGINT)
        signalled = time.monotonic()
        _, err = proc.communicate(timeout=60)
        stopped = time.monotonic() - signalled
    finally:
        proc.kill()
    assert proc.returncode == 130, err
    assert stopped < 2.0, stopped
    assert "Traceback" not in err
