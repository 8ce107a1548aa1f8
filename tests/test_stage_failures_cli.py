"""What a user of ``skippy-wire run`` and ``skippy-wire api`` sees when a stage process the
command started is killed or stopped in the middle of a generation (SmolLM2 stages, long
generations so that the signal lands while tokens flow).

Every wait is bounded; the command and its stages are stopped (a stopped stage continued
first) also when a test fails.
"""

from __future__ import annotations

import http.client
import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from process_helpers import default_sigint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
PROMPT = "Once upon a time, in a small village by the sea, there lived"
WAIT_S = 120.0


def _command(*args: str) -> subprocess.Popen:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen([sys.executable, "-m", "skippy_wire", *args], cwd=REPO, env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                            preexec_fn=default_sigint)


def _wait_line(stream, pattern: str, seen: list[str]) -> re.Match:
    deadline = time.monotonic() + WAIT_S
    while time.monotonic() < deadline:
        line = stream.readline()
        if not line:
            break
        seen.append(line)
        match = re.search(pattern, line)
        if match:
            return match
    raise AssertionError(f"no line matching {pattern!r}:\n" + "".join(seen))


def _stage_pid(parent: int, index: int) -> int:
    """The stage process ``index`` that ``parent`` started."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rpartition(")")[2].split()[1])
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except (OSError, IndexError, ValueError):
            continue
        if ppid == parent and b"--stage-index" in argv and argv[argv.index(b"--stage-index") + 1] == str(index).encode():
            return int(entry.name)
    raise AssertionError(f"process {parent} has no stage {index}")


def _end(proc: subprocess.Popen, stage: int | None) -> tuple[str, str]:
    """Continue ``stage`` (it may be stopped), stop ``proc`` if it still runs; its output."""
    if stage is not None:
        try:
            os.kill(stage, signal.SIGCONT)
        except ProcessLookupError:
            pass
    if proc.stderr.closed:  # ended and read already
        return "", ""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
    try:
        out, err = proc.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate(timeout=30)
    return out, err


def _error_lines(err: str) -> list[str]:
    assert "Traceback" not in err, err
    return [line for line in err.splitlines() if line.startswith("skippy-wire: error:")]


@pytest.mark.parametrize("stages,victim,sig,what", [
    (2, 1, signal.SIGKILL, "was killed by SIGKILL"),
    (3, 1, signal.SIGKILL, "was killed by SIGKILL"),
    (2, 1, signal.SIGSTOP, "is stopped (SIGSTOP or SIGTSTP; SIGCONT resumes it)"),
], ids=["kill-last-of-2", "kill-middle-of-3", "stop-last-of-2"])
def test_run_names_the_stage_that_failed_in_one_line(stages, victim, sig, what):
    proc = _command("run", "--stages", str(stages), "--raw", PROMPT, "-n", "2000", "-c", "2048", "--temp", "0",
                    "--timeout", "8")
    stage = None
    try:
        seen: list[str] = []
        _wait_line(proc.stderr, r"generating:", seen)
        assert proc.stdout.read(len(PROMPT) + 8)  # the prompt, then generated text: decoding
        stage = _stage_pid(proc.pid, victim)
        os.kill(stage, sig)
        proc.wait(WAIT_S)  # the command ends by itself
        _, err = _end(proc, stage)
        assert proc.returncode == 1, err
        errors = _error_lines("".join(seen) + err)
        assert len(errors) == 1, err
        listening = {m[0]: m for m in re.findall(r"stage (\d+): layers (\d+\.\.\d+) listening on (127\.0\.0\.1:\d+)",
                                                 "".join(seen))}
        _, span, address = listening[str(victim)]
        assert errors[0].startswith(f"skippy-wire: error: request failed: stage {victim} at {address} "
                                    f"(layers {span}) {what}; stage 0 at 127.0.0.1:"), errors[0]
        assert errors[0].endswith("closed the connection during DECODE_EMBD (session 1)"), errors[0]
    finally:
        _end(proc, stage)


class _Api:
    def __init__(self, *args: str) -> None:
        self.proc = _command("api", "--listen", "127.0.0.1:0", *args)
        self.seen: list[str] = []
        try:
            match = _wait_line(self.proc.stderr, r"API on http://127\.0\.0\.1:(\d+)/v1", self.seen)
        except BaseException:
            _end(self.proc, None)
            raise
        self.port = int(match[1])
        self.conns: list[http.client.HTTPConnection] = []

    def post(self, body: dict, timeout: float = WAIT_S) -> http.client.HTTPResponse:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=timeout)
        self.conns.append(conn)
        conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
        return conn.getresponse()

    def end(self, stage: int | None) -> str:
        for conn in self.conns:
            conn.close()
        return _end(self.proc, stage)[1]


def test_api_names_a_stopped_stage_and_serves_again_once_it_continues():
    api = _Api("--stages", "2", "--ctx-size", "2048", "--timeout", "8")
    stage = None
    try:
        stage = _stage_pid(api.proc.pid, 1)
        stream = api.post({"prompt": PROMPT, "max_tokens": 1800, "temperature": 0, "stream": True})
        assert stream.status == 200
        assert stream.readline().startswith(b"data: {")  # a first piece of text: decoding
        os.kill(stage, signal.SIGSTOP)
        events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        last = json.loads(events[-1][len("data: "):])
        message = last["error"]["message"]
        assert re.match(r"the pipeline failed: stage 1 at 127\.0\.0\.1:\d+ \(layers 15\.\.30\) is stopped \(SIGSTOP "
                        r"or SIGTSTP; SIGCONT resumes it\); stage 0 at 127\.0\.0\.1:\d+ closed the connection "
                        r"during DECODE_EMBD \(session \d+\)$", message), message
        # While it is stopped, a request fails after one readiness probe, naming it.
        refused = api.post({"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        body = json.loads(refused.read())
        assert refused.status == 503 and refused.getheader("Retry-After") == "1", body
        assert "stage 1 at 127.0.0.1:" in body["error"]["message"] and "is stopped" in body["error"]["message"]
        os.kill(stage, signal.SIGCONT)
        served = api.post({"prompt": PROMPT, "max_tokens": 4, "temperature": 0})
        assert served.status == 200, served.read()
        assert json.loads(served.read())["usage"]["completion_tokens"] == 4
    finally:
        err = api.end(stage)
    assert "Traceback" not in err, err


def test_api_names_a_killed_stage_then_stops():
    api = _Api("--stages", "2", "--ctx-size", "2048")
    stage = None
    try:
        stage = _stage_pid(api.proc.pid, 1)
        stream = api.post({"prompt": PROMPT, "max_tokens": 1800, "temperature": 0, "stream": True})
        assert stream.readline().startswith(b"data: {")
        os.kill(stage, signal.SIGKILL)
        events = [line for line in stream.read().decode().splitlines() if line.startswith("data: ")]
        message = json.loads(events[-1][len("data: "):])["error"]["message"]
        assert re.match(r"the pipeline failed: stage 1 at 127\.0\.0\.1:\d+ \(layers 15\.\.30\) was killed by SIGKILL; "
                        r"stage 0 at 127\.0\.0\.1:\d+ closed the connection during DECODE_EMBD", message), message
        api.proc.wait(WAIT_S)
    finally:
        err = api.end(None)
    assert api.proc.returncode == 1
    assert _error_lines(err) == ["skippy-wire: error: stage 1 (layers 15..30) was killed by SIGKILL; the API stopped"]


def test_run_with_a_topology_names_a_stage_that_no_longer_takes_connections(tmp_path):
    from skippy_wire.net.supervision import launch_pipeline
    from skippy_wire.net.topology import build_topology
    from skippy_wire.stage.models import smollm2_path

    with launch_pipeline(smollm2_path(), 2, threads=1, ctx_size=2048) as cluster:  # someone else's stages
        stages = cluster.stages
        topology = build_topology(cluster.model, [s.layers for s in stages], [s.address for s in stages],
                                  ctx_size=2048).write(tmp_path / "two.json")
        proc = _command("run", "--topology", str(topology), "--raw", PROMPT, "-n", "2000", "--temp", "0")
        try:
            seen: list[str] = []
            _wait_line(proc.stderr, r"generating:", seen)
            assert proc.stdout.read(len(PROMPT) + 8)  # decoding
            stages[1].popen.kill()
            proc.wait(WAIT_S)
            _, err = _end(proc, None)
        finally:
            _end(proc, None)
    assert proc.returncode == 1, err
    errors = _error_lines("".join(seen) + err)
    assert errors == [f"skippy-wire: error: request failed: stage 1 at {stages[1].address} (layers 15..30) refuses "
                      f"connections (it is not running); stage 0 at {stages[0].address} closed the connection "
                      "during DECODE_EMBD (session 1)"], err
