"""Stage processes on 127.0.0.1: start ``skippy-wire serve`` children and supervise them.

:func:`launch_pipeline` starts N stage processes (last stage first, each told its
downstream), waits for each one's "listening" event and returns a :class:`StageCluster`
(a context manager that always terminates them).  Every child also exits when its
stdin -- held open by this process -- closes, so stages never outlive their driver.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..errors import PipelineError
from ..stage.models import model_shape, smollm2_path
from ..stage.threads import default_threads
from .protocol_io import driver_identity

STARTUP_TIMEOUT = 120.0


def split_layers(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """Split ``[0, n_layer)`` into ``stages`` contiguous ranges, sizes differing by at most 1."""
    if stages < 1:
        raise ValueError("need at least one stage")
    if stages > n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {stages} stages")
    base, extra = divmod(n_layer, stages)
    ranges, start = [], 0
    for i in range(stages):
        end = start + base + (1 if i < extra else 0)
        ranges.append((start, end))
        start = end
    return ranges


def default_model() -> Path:
    return Path(smollm2_path())


def stage_env() -> dict:
    """The environment of a stage child: unbuffered, running the very package the driver
    imported (installed or not)."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


_LIVE: set["StageProcess"] = set()


def _kill_live() -> None:
    for proc in list(_LIVE):
        proc.terminate()


atexit.register(_kill_live)


class StageProcess:
    """One ``skippy-wire serve`` child.  Its stdout JSON events are collected by a thread."""

    def __init__(self, index: int, layers: tuple[int, int], args: list[str], *, env=None,
                 log_path: Path | None = None, prefix: Iterable[str] = ()) -> None:
        self.index = index
        self.layers = layers
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.n_embd: int | None = None
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.session_events: list[dict] = []
        self._stderr = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.log_path = log_path
        self.popen = subprocess.Popen(
            [*prefix, sys.executable, "-m", "skippy_wire", "serve", "--exit-on-stdin-eof", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            start_new_session=True,
        )
        _LIVE.add(self)
        self._reader = threading.Thread(target=self._read_events, name=f"stage{index}-events", daemon=True)
        self._reader.start()

    def _read_events(self) -> None:
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "session":
                self.session_events.append(event)
            self.events.put(event)
        self.events.put({"event": "exit"})

    def wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineError(f"stage {self.index} did not start listening within {timeout:.0f} s"
                                    f"{self._log_hint()}")
            try:
                event = self.events.get(timeout=left)
            except queue.Empty:
                continue
            if event["event"] == "listening":
                self.host, self.port, self.n_embd = event["host"], event["port"], event.get("n_embd")
                return
            if event["event"] == "error":  # the stage's own one-line reason, e.g. a truncated GGUF
                raise PipelineError(str(event.get("message") or f"stage {self.index} cannot start"))
            if event["event"] == "exit":
                code = self.popen.wait()
                raise PipelineError(f"stage {self.index} exited with status {code} before listening"
                                    f"{self._log_hint()}")

    def _log_hint(self) -> str:
        """``": "`` and the last line of the stage's log (for a traceback: the exception), so
        that the error stays one line; empty without a log."""
        if self.log_path and self.log_path.exists():
            tail = self.log_path.read_text(errors="replace").strip().splitlines()
            return f": {tail[-1].strip()}" if tail else ""
        return ""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def terminate(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe:
                pipe.close()
        if self._stderr not in (None, subprocess.DEVNULL):
            self._stderr.close()
        _LIVE.discard(self)


def _ending(code: int) -> str:
    """A child's return code in words."""
    if code >= 0:
        return f"exited with status {code}"
    try:
        return f"was killed by {signal.Signals(-code).name}"
    except ValueError:
        return f"was killed by signal {-code}"


@dataclass
class StageCluster:
    """Running stage processes (stage 0 first).  Use as a context manager."""

    stages: list[StageProcess]
    model: Path
    codec: str
    policy: str
    threads: int
    log_dir: Path | None = None
    protocol: int = 15
    identity: object = None  # the driver's v17 identity (protocol_io.driver_identity)

    @property
    def entry(self) -> tuple[str, int]:
        return self.stages[0].host, int(self.stages[0].port)

    def exited(self) -> str | None:
        """How the first stage process that has ended ended, or None while all run."""
        for stage in self.stages:
            code = stage.popen.poll()
            if code is not None:
                return f"stage {stage.index} (layers {stage.layers[0]}..{stage.layers[1]}) {_ending(code)}"
        return None

    def close(self) -> None:
        # Stage 0 first: it closes its downstream connection cleanly before the next dies.
        for stage in self.stages:
            stage.terminate()

    def __enter__(self) -> "StageCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def session_events(self, wait: float = 2.0, count: int = 1) -> list[list[dict]]:
        """Per stage, the "session" events received so far (waiting up to ``wait`` s for
        ``count`` of them from every stage)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(len(s.session_events) < count for s in self.stages):
            time.sleep(0.01)
        return [list(s.session_events) for s in self.stages]


def launch_pipeline(model: str | Path, stages: int = 2, *, codec: str = "raw-f32-v1", policy: str = "fixed",
                    threads: int | None = None, ctx_size: int = 512, layers: list[tuple[int, int]] | None = None,
                    startup_timeout: float = STARTUP_TIMEOUT, io_timeout: float | None = None,
                    reply_timeout: float | None = None, capture_dir: str | Path | None = None,
                    log_dir: str | Path | None = None, extra_args: Iterable[str] = (),
                    on_progress: Callable[[str], None] | None = None, protocol: int = 15,
                    protocols: list[int] | None = None, tls=None) -> StageCluster:
    """Start ``stages`` stage processes on 127.0.0.1 splitting the model's layers evenly.

    ``capture_dir``: each stage with a downstream records that hop to
    ``capture_dir/hopK-messages.bin`` and ``hopK-replies.bin`` (K = its index + 1).
    ``log_dir``: each stage's stderr goes to ``log_dir/stageK.log`` (else discarded).
    ``protocol``: the state version of every stage (``protocols``: one per stage, to test
    mixed pipelines); v17 stages share one fresh run id, the plan and the model id, and
    the cluster's ``identity`` is the driver's.  ``tls`` (a :class:`~skippy_wire.net.tls.
    TlsConfig`): every stage serves and forwards over mutual TLS with it.
    On any failure every started process is terminated before the error propagates.
    """
    model = Path(model)
    if layers is None:
        n_layer, _ = model_shape(model)
        layers = split_layers(n_layer, stages)
    threads = threads or default_threads()
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    if capture_dir:
        Path(capture_dir).mkdir(parents=True, exist_ok=True)
    procs: list[StageProcess] = []
    protocols = list(protocols) if protocols else [protocol] * len(layers)
    run_id = uuid.uuid4().hex
    plan = ",".join(f"{a}-{b}" for a, b in layers)
    identity = driver_identity(run_id, plan, model.stem)
    env = stage_env()
    try:
        downstream = None
        for index in reversed(range(len(layers))):
            start, end = layers[index]
            args = ["--model", str(model), "--layer-start", str(start), "--layer-end", str(end),
                    "--stage-index", str(index), "--listen", "127.0.0.1:0",
                    "--activation-codec", codec, "--activation-codec-policy", policy,
                    "--ctx-size", str(ctx_size), "--threads", str(threads), "--protocol", str(protocols[index]),
                    "--run-id", run_id, "--plan", plan, *(tls.as_args() if tls else ()), *extra_args]
            if io_timeout is not None:
                args += ["--io-timeout", str(io_timeout)]
            if reply_timeout is not None:
                args += ["--reply-timeout", str(reply_timeout)]
            if downstream:
                args += ["--downstream", downstream]
                if capture_dir:
                    args += ["--capture", str(Path(capture_dir) / f"hop{index + 1}")]
            started = time.perf_counter()
            proc = StageProcess(index, (start, end), args, env=env,
                                log_path=log_dir / f"stage{index}.log" if log_dir else None)
            procs.insert(0, proc)
            proc.wait_listening(startup_timeout)
            if on_progress:
                on_progress(f"stage {index}: layers {start}..{end} listening on {proc.address} "
                            f"({time.perf_counter() - started:.2f} s)")
            downstream = proc.address
    except BaseException:
        for proc in procs:
            proc.terminate()
        raise
    return StageCluster(procs, model, codec, policy, threads, log_dir, protocols[0], identity)


__all__ = ["STARTUP_TIMEOUT", "split_layers", "stage_env", "default_model", "StageProcess", "StageCluster", "launch_pipeline"]
