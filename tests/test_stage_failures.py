"""A stage that fails in the middle of a generation: what the driver reports, and which
sessions the stages still alive free.

The wire has no error reply, so a failing stage closes its connections; the driver of
stages it started names the stage that failed and why (``StageCluster.explain``), and a
stage whose upstream leaves while it waits for its downstream gives up at once.  The slow
tests run real ``serve`` processes of the tiny model; every wait is bounded and every
process is stopped (and continued first, when stopped) also when a test fails.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from pathlib import Path
from types import SimpleNamespace

import pytest

from skippy_wire.errors import PipelineClosed, PipelineError
from skippy_wire.net.driver import PipelineClient, generate_local
from skippy_wire.net.schedule import decode_message
from skippy_wire.net.supervision import (REPLY_TIMEOUT_STEP_S, StageCluster, StageProcess, launch_pipeline,
                                         stage_env, stage_reply_timeouts)
from skippy_wire.wire.messages import StageWireMessage

from test_server import FakeBackend, chain_factory  # noqa: F401 -- the fixture
from test_server import PROMPT as FAKE_PROMPT
from test_hardening import _wait_for

PROMPT = [1, 10, 20, 30, 40, 50, 60, 70, 80]
#: Bounds of the waits (a safety net, not a measurement).
WAIT_S = 30.0


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from skippy_wire.stage.models import write_tiny_llama_gguf

    return write_tiny_llama_gguf(tmp_path_factory.mktemp("tiny") / "tiny.gguf")


def _name(cluster, index: int) -> str:
    stage = cluster.stages[index]
    return f"stage {index} at {stage.address} (layers {stage.layers[0]}..{stage.layers[1]})"


def _freed(stage, session_id: int) -> bool:
    """Whether ``stage`` reports ``session_id`` freed (its "session" event), within the bound."""
    return _wait_for(lambda: any(e.get("session_id") == session_id for e in stage.session_events), WAIT_S)


def _fail_during_decode(client, act, *, at_token: int = 3, session_id: int = 1) -> str:
    """Generate, running ``act`` once ``at_token`` tokens have come (the next step may then
    be in flight); the PipelineError's text."""
    seen: list[int] = []

    def on_token(token: int) -> None:
        seen.append(token)
        if len(seen) == at_token:
            act()

    with pytest.raises(PipelineError) as info:
        client.generate(PROMPT, max_tokens=40, chunk_size=4, on_token=on_token, session_id=session_id,
                        request_id=session_id)
    # The step in flight when ``act`` ran may still have been answered (a stage computes it
    # before the signal lands): the generation failed on that step or the next.
    assert at_token <= len(seen) <= at_token + 1, seen
    return str(info.value)


class _Stopped:
    """SIGSTOP a stage process; SIGCONT it on exit, whatever happened."""

    def __init__(self, stage) -> None:
        self.stage = stage

    def stop(self) -> None:
        os.kill(self.stage.popen.pid, signal.SIGSTOP)
        assert _wait_for(self.stage.stopped, 10)

    def __enter__(self) -> "_Stopped":
        return self

    def __exit__(self, *exc) -> None:
        if self.stage.popen.poll() is None:
            os.kill(self.stage.popen.pid, signal.SIGCONT)


# --- unit level ------------------------------------------------------------------------------


def test_deeper_stages_wait_less_than_the_ones_before_them_and_the_driver():
    assert stage_reply_timeouts(60.0, 2) == [60.0 - REPLY_TIMEOUT_STEP_S, 60.0 - 2 * REPLY_TIMEOUT_STEP_S]
    for driver, stages in ((60.0, 3), (1.0, 3), (0.1, 8)):
        waits = stage_reply_timeouts(driver, stages)
        assert all(0 < b < a < driver for a, b in zip(waits, waits[1:])), waits


def _fake_stage(index: int, errors=(), *, code=None, stopped=False):
    return SimpleNamespace(index=index, address=f"127.0.0.1:{9000 + index}", layers=(2 * index, 2 * index + 2),
                           popen=SimpleNamespace(poll=lambda: code), stopped=lambda: stopped,
                           errors_since=lambda mark: list(errors))


def _explain(*stages) -> str | None:
    return StageCluster(list(stages), Path("m.gguf"), "raw-f32-v1", "fixed", 1).explain([0] * len(stages))


def test_explain_names_the_stage_where_the_failure_began():
    relay = ("2026-01-01 00:00:00,010", "connection 1 from 127.0.0.1:40000: downstream 127.0.0.1:9001 closed the "
             "connection instead of replying (see its log); closing")
    cause = ("2026-01-01 00:00:00,010", "connection 1 from 127.0.0.1:40001: stage runtime error: RuntimeError: "
             "context full: 16 cached + 1 new tokens exceed ctx_size 16; closing")
    # The stage that reports its own failure, not the one that saw its downstream close.
    assert _explain(_fake_stage(0, [relay]), _fake_stage(1, [cause])) == (
        "stage 1 at 127.0.0.1:9001 (layers 2..4): stage runtime error: RuntimeError: context full: 16 cached + 1 "
        "new tokens exceed ctx_size 16")
    # A stage that found a protocol error first is the cause, whatever its neighbours log later.
    malformed = ("2026-01-01 00:00:00,005", "connection 2 from 127.0.0.1:40000: downstream 127.0.0.1:9001 sent a "
                 "malformed reply (InvalidData: unknown stage reply kind); closing")
    reset = ("2026-01-01 00:00:00,006", "connection 1 from 127.0.0.1:40001: peer reset the connection; closing")
    assert _explain(_fake_stage(0, [malformed]), _fake_stage(1, [reset])).startswith(
        "stage 0 at 127.0.0.1:9000 (layers 0..2): downstream 127.0.0.1:9001 sent a malformed reply")
    # A process that has ended or is stopped says more than any line.
    assert _explain(_fake_stage(0, [relay]), _fake_stage(1, code=-9)) == \
        "stage 1 at 127.0.0.1:9001 (layers 2..4) was killed by SIGKILL"
    assert _explain(_fake_stage(0, [relay]), _fake_stage(1, stopped=True)).startswith(
        "stage 1 at 127.0.0.1:9001 (layers 2..4) is stopped (SIGSTOP")
    assert _explain(_fake_stage(0), _fake_stage(1)) is None


def test_explain_waits_a_moment_for_a_killed_stage_to_be_reported_ended():
    # A SIGKILLed stage's sockets close before the kernel reports it ended: its neighbour's
    # "closed the connection" may be all there is at first.
    relay = ("2026-01-01 00:00:00,010", "connection 1 from 127.0.0.1:40000: downstream 127.0.0.1:9001 closed the "
             "connection instead of replying (see its log); closing")
    codes = iter([None] * 5)
    dying = _fake_stage(1)
    dying.popen.poll = lambda: next(codes, -9)
    assert _explain(_fake_stage(0, [relay]), dying) == "stage 1 at 127.0.0.1:9001 (layers 2..4) was killed by SIGKILL"
    # nor, when it died before a new connection reached it, its neighbour's failed connect
    # (stage 0 was named as the cause)
    for text in ("cannot connect to downstream 127.0.0.1:9001: connection refused",
                 "downstream 127.0.0.1:9001 did not send READY: connection reset by peer",
                 "stage setup with downstream 127.0.0.1:9001 failed: stage peer closed during setup"):  # v17
        codes = iter([None] * 5)
        dying.popen.poll = lambda: next(codes, -9)
        line = ("2026-01-01 00:00:00,010", f"connection 1 from 127.0.0.1:40000: {text}; closing")
        assert _explain(_fake_stage(0, [line]), dying) == \
            "stage 1 at 127.0.0.1:9001 (layers 2..4) was killed by SIGKILL"


def test_a_stage_gives_up_on_its_downstream_once_its_upstream_has_left(chain_factory, caplog):
    # The driver stops waiting long before the stage's reply timeout: stage 0 notices that
    # its upstream has gone, closes its downstream link and frees the session then, not
    # when the stalled stage answers or its own reply timeout ends.
    release = threading.Event()

    class Stalling(FakeBackend):
        def prefill(self, *args, **kwargs):
            release.wait(WAIT_S)
            return super().prefill(*args, **kwargs)

    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    chain = chain_factory([(0, 3), (3, 6)], reply_timeout=120.0, backends=[FakeBackend(0, 3, 0), Stalling(3, 6, 1)])
    try:
        with PipelineClient(*chain.entry, timeout=0.5) as client:
            with pytest.raises(PipelineError, match="no answer to PREFILL"):
                client.generate(FAKE_PROMPT, max_tokens=3, chunk_size=8)
        assert _wait_for(lambda: any(e["stage"] == 0 for e in chain.events), 10)
        assert chain.backends[0].sessions[0].freed
        assert "upstream closed the connection while waiting for downstream" in caplog.text
    finally:
        release.set()


# --- stage processes -------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("stages,victim", [(2, 1), (3, 1), (3, 2)], ids=["last-of-2", "middle-of-3", "last-of-3"])
def test_a_killed_stage_is_named_and_the_others_free_the_session(tiny_model, stages, victim):
    with launch_pipeline(tiny_model, stages, threads=1, startup_timeout=60, reply_timeout=WAIT_S) as cluster:
        with PipelineClient(*cluster.entry, timeout=WAIT_S) as client:
            def kill() -> None:
                cluster.stages[victim].popen.send_signal(signal.SIGKILL)
                cluster.stages[victim].popen.wait(10)

            error = _fail_during_decode(client, kill)
        assert error.startswith(f"{_name(cluster, victim)} was killed by SIGKILL; stage 0 at "), error
        assert "closed the connection during DECODE_EMBD (session 1)" in error and "\n" not in error
        for stage in cluster.stages:
            if stage.index != victim:
                assert _freed(stage, 1), f"stage {stage.index} still holds the session"


@pytest.mark.slow
@pytest.mark.parametrize("stages,victim", [(2, 1), (3, 1), (3, 2), (2, 0)],
                         ids=["last-of-2", "middle-of-3", "last-of-3", "first-of-2"])
def test_a_stopped_stage_is_named_and_the_pipeline_serves_once_it_continues(tiny_model, stages, victim):
    timeout = 6.0
    with launch_pipeline(tiny_model, stages, threads=1, startup_timeout=60, reply_timeout=timeout) as cluster:
        with _Stopped(cluster.stages[victim]) as stopped:
            with PipelineClient(*cluster.entry, timeout=timeout) as client:
                error = _fail_during_decode(client, stopped.stop)
        assert error.startswith(f"{_name(cluster, victim)} is stopped (SIGSTOP or SIGTSTP; SIGCONT resumes it); "
                                "stage 0 at "), error
        if victim > 0:  # the stage before the silent one gave up first, and closed
            assert "closed the connection during DECODE_EMBD (session 1)" in error, error
        else:
            assert f"no answer to DECODE_EMBD (session 1) within {timeout:g} s" in error, error
        for stage in cluster.stages:  # continued, the stopped one frees it too
            assert _freed(stage, 1), f"stage {stage.index} still holds the session"
        with PipelineClient(*cluster.entry, timeout=WAIT_S) as client:
            again = client.generate(PROMPT, max_tokens=6, chunk_size=4, session_id=2, request_id=2)
        assert again.tokens == generate_local(tiny_model, PROMPT, max_tokens=6, chunk_size=4, threads=1).tokens


@pytest.mark.slow
def test_a_full_context_on_the_last_stage_is_named(tiny_model):
    # The last stage has a smaller context than the driver and stage 0 believe: its decode
    # step fails when the session holds 16 tokens.
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60, ctx_size=64, reply_timeout=WAIT_S,
                         stage_args={1: ["--ctx-size", "16"]}) as cluster:
        with PipelineClient(*cluster.entry, timeout=WAIT_S) as client:
            with pytest.raises(PipelineError) as info:
                client.generate(PROMPT, max_tokens=12, chunk_size=4)
        error = str(info.value)
        assert error.startswith(f"{_name(cluster, 1)}: stage runtime error: RuntimeError: context full"), error
        assert "ctx_size 16; stage 0 at" in error and "closed the connection during DECODE_EMBD (session 1)" in error
        assert _freed(cluster.stages[0], 1)


@pytest.mark.slow
def test_a_protocol_error_is_named_and_the_stage_closes_its_downstream_link(tiny_model):
    with launch_pipeline(tiny_model, 2, threads=1, startup_timeout=60, reply_timeout=WAIT_S) as cluster:
        with PipelineClient(*cluster.entry, timeout=WAIT_S) as client:
            client.request(StageWireMessage.configure_generation(2, 2, len(PROMPT), None, None), "ConfigureGeneration")
            with pytest.raises(PipelineError) as info:  # a decode step far past the (empty) session
                client.request(decode_message(5, 99, 0, len(PROMPT), 2, 2))
        error = str(info.value)
        assert error == (f"{_name(cluster, 0)}: DECODE_EMBD at position 99, but session 2 holds 0 tokens; "
                         f"stage 0 at {cluster.stages[0].address} closed the connection during DECODE_EMBD "
                         "(session 2)")
        assert _freed(cluster.stages[1], 2)  # stage 0 closed its downstream link: stage 1 let it go


@pytest.mark.slow
def test_running_stages_free_a_session_whose_driver_gave_up(tiny_model, tmp_path):
    # Stages someone else runs (`serve`, the default reply timeout of 120 s): the driver
    # cannot say which stage is silent, but stage 0 frees the session once it has gone.
    common = ["--model", str(tiny_model), "--listen", "127.0.0.1:0", "--threads", "1"]
    last = StageProcess(1, (2, 4), [*common, "--layer-start", "2", "--layer-end", "4", "--stage-index", "1"],
                        env=stage_env(), log_path=tmp_path / "stage1.log")
    procs = [last]
    try:
        last.wait_listening(60)
        first = StageProcess(0, (0, 2), [*common, "--layer-start", "0", "--layer-end", "2", "--downstream",
                                         last.address], env=stage_env(), log_path=tmp_path / "stage0.log")
        procs.append(first)
        first.wait_listening(60)
        with _Stopped(last) as stopped:
            with PipelineClient(first.host, first.port, timeout=1.0) as client:
                stopped.stop()
                with pytest.raises(PipelineError, match=r"no answer to ConfigureGeneration within 1 s$"):
                    client.generate(PROMPT, max_tokens=4, chunk_size=4)
            assert _freed(first, 1)
            assert "upstream closed the connection while waiting for downstream" in \
                (tmp_path / "stage0.log").read_text()
    finally:
        for proc in procs:
            proc.terminate()


def test_a_driver_connected_to_a_later_stage_is_told_to_connect_to_stage_0(chain_factory, caplog):
    # That stage used to fail inside its runtime ("activation payload length 0 does not match
    # ..."), which did not say what was wrong.
    chain = chain_factory([(0, 3), (3, 6)])
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.servers[1].address, timeout=10) as client:
        with pytest.raises(PipelineError):
            client.generate(FAKE_PROMPT, max_tokens=2, chunk_size=4)
    assert _wait_for(lambda: "a driver connects to stage 0" in caplog.text, WAIT_S), caplog.text
    assert ("a driver's PREFILL_EMBD (tokens, no activation) reached a stage that starts at layer 3, "
            "not the first stage: a driver connects to stage 0") in caplog.text


def test_a_stage_whose_downstream_is_a_first_stage_is_refused_there(chain_factory, caplog):
    # The first stage embedded the driver's tokens and dropped the activation unread: the
    # generation ended normally with another model's text.
    chain = chain_factory([(0, 3), (0, 6)], backends=[FakeBackend(0, 3, 0), FakeBackend(0, 6, 1)])
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        with pytest.raises(PipelineError):
            client.generate(FAKE_PROMPT, max_tokens=2, chunk_size=4)
    assert _wait_for(lambda: "reached a first stage" in caplog.text, WAIT_S), caplog.text
    assert ("stage 0's PREFILL_EMBD (an activation) reached a first stage (layer 0 on), which embeds the "
            "driver's tokens: a stage's downstream is the stage after it") in caplog.text


def test_a_close_is_said_to_be_on_the_first_tokens_only_where_a_later_stage_would_close(chain_factory):
    # A driver connected to a later stage: READY and the ConfigureGeneration's Ack, then a close
    # on the first prefill chunk.  A stage 0 whose downstream is gone closes before READY instead.
    chain = chain_factory([(0, 3), (3, 6)])
    with PipelineClient(*chain.servers[1].address, timeout=10) as client:
        with pytest.raises(PipelineClosed) as later:
            client.generate(FAKE_PROMPT, max_tokens=2, chunk_size=4)
    assert later.value.on_first_tokens
    chain.servers[1].shutdown()
    # (before READY, or, while stage 1's listener still takes connections, after it)
    with pytest.raises(PipelineError) as broken, PipelineClient(*chain.entry, timeout=10) as client:
        client.generate(FAKE_PROMPT, max_tokens=2, chunk_size=4)
    assert not getattr(broken.value, "on_first_tokens", False), broken.value


def test_an_idle_connection_closed_by_the_stage_is_no_error(chain_factory, caplog):
    """A pooled connection left idle (an API between requests) is closed at the idle
    timeout: an INFO line, not an ERROR that monitoring would alert on."""
    chain = chain_factory([(0, 6)])
    chain.servers[0].idle_timeout = 0.2
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    with PipelineClient(*chain.entry, timeout=10) as client:
        assert _wait_for(lambda: not client.alive(), WAIT_S)
    assert _wait_for(lambda: "idle for more than 0.2 s; closing" in caplog.text, WAIT_S), caplog.text
    idle = [r for r in caplog.records if "idle for more than" in r.getMessage()]
    assert [r.levelno for r in idle] == [logging.INFO]


@pytest.mark.parametrize("protocol, said", [
    (15, "did not send READY: it closed the connection (its log says why)"),
    (17, "did not answer the stage setup: connection reset by peer"),  # v17 has no READY: it said so too
])
def test_a_downstream_that_closes_before_ready_is_said_so_in_words(caplog, protocol, said):
    import socket
    import struct

    from skippy_wire.net.server import StageServer
    from skippy_wire.tools.serve import stage_config

    closing = socket.create_server(("127.0.0.1", 0))

    def close_each() -> None:
        while True:
            try:
                conn, _ = closing.accept()
            except OSError:
                return
            if protocol == 17:  # the Hello read, a reset (a clean close there is said as a setup refused)
                conn.settimeout(5)
                conn.recv(1)
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            conn.close()

    threading.Thread(target=close_each, daemon=True).start()
    server = StageServer(FakeBackend(0, 3, 0), stage_config(0, 0, 3, "raw-f32-v1", "fixed"),
                         downstream=closing.getsockname()[:2], reply_timeout=5.0, protocol=protocol)
    server.start()
    caplog.set_level(logging.INFO, logger="skippy_wire.net.server")
    try:
        with pytest.raises(PipelineError):
            PipelineClient(*server.address, timeout=5, protocol=protocol)
        assert _wait_for(lambda: said.split(":")[0] in caplog.text, WAIT_S), caplog.text
        assert said in caplog.text
        assert "failed to fill whole buffer" not in caplog.text
    finally:
        server.shutdown()
        closing.shutdown(socket.SHUT_RDWR)  # wakes close_each's accept() (close() alone does not)
        closing.close()
