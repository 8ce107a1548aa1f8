"""Stage processes on 127.0.0.1: start ``skippy-wire serve`` children and supervise them.

:func:`launch_pipeline` starts N stage processes (last stage first, each told its
downstream), waits for each one's "listening" event and returns a :class:`StageCluster`
(a context manager that always terminates them).  Every child also exits when its
stdin -- held open by this process -- closes, so stages never outlive their driver.

When a request through stages this process started fails, :func:`launched_cluster` finds
them by stage 0's address and :meth:`StageCluster.explain` says which stage failed and why:
one that has ended (and how), one that is stopped (SIGSTOP), else the first ERROR line a
stage logged since the request began (from its log file, or from the last lines of its
stderr kept in memory when it has none).
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import itertools
import json
import os
import queue
import re
import select
import signal
import site
import subprocess
import sys
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from ..errors import DOWNSTREAM_NO_READY, DOWNSTREAM_SETUP_UNANSWERED, SETUP_CLOSED_TEXT, PipelineError
from ..stage.models import default_model_id, kv_cache_bytes, model_shape, smollm2_path
from ..stage.native import memory_available
from ..stage.threads import oversubscription, resolved_threads
from ..wire.activation_frame import STAGE_STATE_VERSION_V17
from ..wire.constants import DEFAULT_STAGES, MAX_CTX_SIZE, named_codec_setting
from ..wire.forwarding import DEFAULT_CTX_SIZE
from .arguments import int_argument, protocol_argument, seconds_argument
from .protocol_io import driver_identity
from .tls import TlsConfig

STARTUP_TIMEOUT = 120.0
#: A stage ``launch_pipeline`` starts waits for its downstream's reply this much less than
#: the stage before it (at most; a short timeout is split evenly), and stage 0 this much
#: less than the driver: the stage next to a silent one gives up first, logs which
#: downstream it waited for and closes, so the driver hears of it before its own timeout.
REPLY_TIMEOUT_STEP_S = 2.0
#: Lines of a stage's stderr kept in memory when it has no log file, and the longest wait for
#: the reader of that stderr to take in what is there before they are looked at.
LOG_TAIL_LINES = 200
#: The "session" events (one per session a stage frees, about 2.6 KB each parsed) kept per
#: stage by default: the latest, enough for every command and benchmark that reads them
#: (the API, which reads none, keeps none).
SESSION_EVENTS_KEPT = 1024
TAIL_SETTLE_S = 0.5
#: The longest wait, when stages only report a neighbour that went away, for one that
#: ended to be reported as ended.
EXIT_SETTLE_S = 1.0
#: A stage log line (``serve``'s format): its time stamp, then the level; the time stamps of
#: the stages of one machine sort as text.
_LOG_LINE = re.compile(r"^(?P<time>\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) stage\[\d+\] (?P<level>[A-Z]+) (?P<text>.*)$")
#: What a stage logs about its connection before the cause ("connection 3 from H:P: ").
_CONNECTION_PREFIX = re.compile(r"^connection \d+ from [^ ]+: ")
#: Errors that only report a neighbour going away: the cause is elsewhere.
_RELAYED = ("closed the connection", "reset the connection", "disconnected in the middle", "stalled for more than",
            "cannot connect to downstream", DOWNSTREAM_NO_READY, DOWNSTREAM_SETUP_UNANSWERED, SETUP_CLOSED_TEXT)


def stage_reply_timeouts(reply_timeout: float, stages: int) -> list[float]:
    """Each stage's ``--reply-timeout`` when the driver waits ``reply_timeout`` for a reply:
    shorter the deeper the stage (:data:`REPLY_TIMEOUT_STEP_S`)."""
    step = min(REPLY_TIMEOUT_STEP_S, reply_timeout / (2 * stages))
    return [reply_timeout - (index + 1) * step for index in range(stages)]


def split_layers(n_layer: int, stages: int) -> list[tuple[int, int]]:
    """Split ``[0, n_layer)`` into ``stages`` contiguous ranges, sizes differing by at most 1."""
    if stages < 1:
        raise ValueError("need at least one stage")
    if stages > n_layer:
        raise ValueError(f"cannot split {n_layer} layers into {stages} stages")
    base, extra = divmod(n_layer, stages)
    ends = list(itertools.accumulate(base + (i < extra) for i in range(stages)))
    return list(zip([0, *ends[:-1]], ends))


def layer_chain_problem(ranges: list[tuple[int, int]], n_layer: int | None = None, model_name: str = "") -> str | None:
    """Why stages over ``ranges`` (in order, half-open) would not compute the model's
    ``n_layer`` layers (None: not known, the end unchecked) once each, in order; None when
    they would."""
    if not ranges:
        return "no stages"
    if ranges[0][0] != 0:
        return f"stage 0 starts at layer {ranges[0][0]}, not 0"
    for index, (start, end) in enumerate(ranges):
        if start >= end:
            return f"stage {index}: layers {start}..{end} hold no layer"
    for index, ((prev_start, prev_end), (start, end)) in enumerate(zip(ranges, ranges[1:]), 1):
        if start != prev_end:
            what = "overlaps" if start < prev_end else "leaves a gap after"
            return (f"stage {index}: layers {start}..{end} {what} stage {index - 1}'s {prev_start}..{prev_end} "
                    "(ranges are half-open and must be contiguous)")
    if n_layer is not None and ranges[-1][1] != n_layer:
        return f"the last stage ends at layer {ranges[-1][1]}, but {model_name} has {n_layer} layers"
    return None


def default_model(given: str | Path | None = None) -> Path:
    """The model file ``given`` names (a command's ``-m``), else the packaged SmolLM2-135M."""
    return Path(given) if given else Path(smollm2_path())


def stage_env() -> dict:
    """The environment of a stage child: unbuffered, running the very package the driver
    imported: a source tree run uninstalled goes on the child's path; an installed package
    is found where the driver found it, after the standard library."""
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    package_root = str(Path(__file__).resolve().parents[2])
    if package_root not in site.getsitepackages() + [site.getusersitepackages()]:
        env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    return env


#: How a stage child starts: never with the working directory on its import path (``-P``,
#: Python 3.11 on), so a ``skippy_wire/`` or ``numpy.py`` where the user stands cannot
#: replace the package the driver runs.
STAGE_COMMAND = (sys.executable, *(("-P",) if sys.version_info >= (3, 11) else ()), "-m", "skippy_wire", "serve")


_LIVE: set["StageProcess"] = set()


def _kill_live() -> None:
    for proc in list(_LIVE):
        proc.terminate()


atexit.register(_kill_live)


class StageProcess:
    """One ``skippy-wire serve`` child.  Its stdout JSON events are collected by a thread."""

    def __init__(self, index: int, layers: tuple[int, int], args: list[str], *, env=None,
                 log_path: Path | None = None, prefix: Iterable[str] = (),
                 session_events_kept: int = SESSION_EVENTS_KEPT) -> None:
        self.index = index
        self.layers = layers
        self.host = "127.0.0.1"
        self.port: int | None = None
        self.n_embd: int | None = None
        self.events: "queue.Queue[dict]" = queue.Queue()
        self.session_events: collections.deque[dict] = collections.deque(maxlen=session_events_kept)
        self._stderr = open(log_path, "wb") if log_path else subprocess.PIPE
        self.log_path = log_path
        #: Without a log file: the last lines of the stage's stderr, and how many came in all.
        self._tail: collections.deque[str] = collections.deque(maxlen=LOG_TAIL_LINES)
        self._tail_count = 0
        self.popen = subprocess.Popen(
            [*prefix, *STAGE_COMMAND, "--exit-on-stdin-eof", *args],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            start_new_session=True,
        )
        _LIVE.add(self)
        self._reader = threading.Thread(target=self._read_events, name=f"stage{index}-events", daemon=True)
        self._reader.start()
        if log_path is None:
            threading.Thread(target=self._read_stderr, name=f"stage{index}-log", daemon=True).start()

    def _read_stderr(self) -> None:
        with self.popen.stderr:
            for line in self.popen.stderr:
                self._tail.append(line.decode("utf-8", "replace").rstrip("\n"))
                self._tail_count += 1

    def _settle_tail(self) -> None:
        """Let the stderr reader take in what the stage has written (a stage logs its error
        before it closes a connection, but the reader may not have run since)."""
        deadline = time.monotonic() + TAIL_SETTLE_S
        with contextlib.suppress(OSError, ValueError):
            while time.monotonic() < deadline and select.select([self.popen.stderr], [], [], 0)[0]:
                time.sleep(0.01)
        time.sleep(0.01)  # the reader may hold a line it has read but not yet kept

    def log_mark(self) -> int:
        """Where the stage's log stands now (:meth:`errors_since`)."""
        if self.log_path is None:
            return self._tail_count
        try:
            return self.log_path.stat().st_size
        except OSError:
            return 0

    def errors_since(self, mark: int) -> list[tuple[str, str]]:
        """``(time stamp, text)`` of the ERROR lines logged after :meth:`log_mark` gave ``mark``
        (with no log file: of those still kept)."""
        if self.log_path is None:
            self._settle_tail()
            lines = list(self._tail)[-(self._tail_count - mark):] if self._tail_count > mark else []
        else:
            try:
                with open(self.log_path, "rb") as f:
                    f.seek(mark)
                    lines = f.read().decode("utf-8", "replace").splitlines()
            except OSError:
                lines = []
        found = []
        for line in lines:
            match = _LOG_LINE.match(line)
            if match and match["level"] == "ERROR":
                found.append((match["time"], match["text"]))
        return found

    def stopped(self) -> bool:
        """Whether the process is stopped (SIGSTOP, SIGTSTP; ``/proc``, Linux only)."""
        try:
            with open(f"/proc/{self.popen.pid}/stat", "rb") as f:
                state = f.read().rpartition(b")")[2].split()[0]
        except (OSError, IndexError):
            return False
        return state in (b"T", b"t")

    def _read_events(self) -> None:
        for line in self.popen.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            if event.get("event") == "session":
                self.session_events.append(event)
            else:  # the queue is read for "listening" only: the sessions' events would pile up there
                self.events.put(event)
        self.events.put({"event": "exit"})

    def wait_listening(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise PipelineError(f"stage {self.index} did not start listening within {timeout:g} s"
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
                raise PipelineError(f"stage {self.index} {_ending(code)} before listening{self._log_hint()}")

    def _log_hint(self) -> str:
        """``": "`` and the last line of the stage's log (for a traceback: the exception), so
        that the error stays one line; empty without a log."""
        if self.log_path is None:
            self._reader.join(1.0)  # the events reader ends at exit; the stderr one about then
            tail = [line for line in self._tail if line.strip()]
        elif self.log_path.exists():
            tail = self.log_path.read_text(errors="replace").strip().splitlines()
        else:
            tail = []
        return f": {tail[-1].strip()}" if tail else ""

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def terminate(self, timeout: float = 5.0) -> None:
        if self.popen.poll() is None:
            self.popen.terminate()
            if self.stopped():  # SIGTERM waits for a stopped process to be continued
                with contextlib.suppress(OSError):
                    self.popen.send_signal(signal.SIGCONT)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        for pipe in (self.popen.stdin, self.popen.stdout):
            if pipe:
                pipe.close()
        if self._stderr is not subprocess.PIPE:
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
    ctx_size: int | None = None  # every stage's context (None: not known here, e.g. -c 0's training context)

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

    def log_marks(self) -> list[int]:
        """Where every stage's log stands now (:meth:`explain`)."""
        return [stage.log_mark() for stage in self.stages]

    def explain(self, marks: list[int] | None = None) -> str | None:
        """Which stage failed and why, in words naming it, its address and layers: the first
        that has ended (how), one that is stopped, else the earliest ERROR line logged since
        ``marks`` (:meth:`log_marks`) that is not only about a neighbour going away (else the
        earliest one); None when nothing says."""
        def name(stage: StageProcess) -> str:
            return f"stage {stage.index} at {stage.address} (layers {stage.layers[0]}..{stage.layers[1]})"

        def ended() -> str | None:
            for stage in self.stages:
                code = stage.popen.poll()
                if code is not None:
                    return f"{name(stage)} {_ending(code)}"
            return None

        if reason := ended():
            return reason
        for stage in self.stages:
            if stage.stopped():
                return f"{name(stage)} is stopped (SIGSTOP or SIGTSTP; SIGCONT resumes it)"
        found = []
        for stage, mark in zip(self.stages, marks or [0] * len(self.stages)):
            for stamp, text in stage.errors_since(mark):
                text = _CONNECTION_PREFIX.sub("", text)
                text = text[:-len("; closing")] if text.endswith("; closing") else text
                found.append((any(r in text for r in _RELAYED), stamp, -stage.index, f"{name(stage)}: {text}"))
        if not found or min(found)[0]:
            # Only a neighbour going away was seen: a killed stage's sockets close before the
            # kernel reports it ended, so give that report a moment.
            deadline = time.monotonic() + EXIT_SETTLE_S
            while time.monotonic() < deadline:
                if reason := ended():
                    return reason
                time.sleep(0.01)
        return min(found)[3] if found else None

    def close(self) -> None:
        if _LAUNCHED.get(self.entry) is self:  # a later pipeline on the same address is not ours
            del _LAUNCHED[self.entry]
        # Stage 0 first: it closes its downstream connection cleanly before the next dies.
        # Every stage, even when one's termination is interrupted (Ctrl-C) or fails.
        _terminate_all(self.stages)

    def __enter__(self) -> "StageCluster":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def session_events(self, wait: float = 2.0, count: int = 1) -> list[list[dict]]:
        """Per stage, the "session" events received so far, the latest
        :data:`SESSION_EVENTS_KEPT` (waiting up to ``wait`` s for ``count`` of them from every
        stage)."""
        deadline = time.monotonic() + wait
        while time.monotonic() < deadline and any(len(s.session_events) < count for s in self.stages):
            time.sleep(0.01)
        return [list(s.session_events) for s in self.stages]


def _terminate_all(stages: list[StageProcess]) -> None:
    """Terminate ``stages`` in order, every one of them whatever ends another's termination."""
    if stages:
        try:
            stages[0].terminate()
        finally:
            _terminate_all(stages[1:])


#: The pipelines :func:`launch_pipeline` started and that still run, by stage 0's address.
_LAUNCHED: dict[tuple[str, int], StageCluster] = {}


def launched_cluster(host: str, port: int) -> StageCluster | None:
    """The running pipeline this process started whose stage 0 listens on ``host:port``."""
    return _LAUNCHED.get((host, int(port)))


def _memory_budget(model: Path, ctx_size: int) -> tuple[int, int, int] | None:
    """The model's weights (its file's size: the stages copy them out of it), one session's KV
    cache over its layers, and the memory available on this machine; None where one is not
    known (a model that cannot be read: the stages say why in their words)."""
    try:
        weights, cache = model.stat().st_size, kv_cache_bytes(model, ctx_size)
    except (OSError, ValueError):
        return None
    available = memory_available()
    return None if available is None else (weights, cache, available)


def sessions_fitting(model: Path, ctx_size: int, *, started: bool = False) -> int | None:
    """How many sessions' KV caches over the model's layers fit in the memory available now:
    beside its weights, or, once its stages have ``started``, in what they left (their weights
    and interpreters taken already); None where not known."""
    budget = _memory_budget(model, ctx_size)
    if budget is None:
        return None
    weights, cache, available = budget
    return max(0, available - (0 if started else weights)) // max(cache, 1)


def check_memory_fits(model: Path, ctx_size: int, advice: str = "give a smaller -c/--ctx-size") -> None:
    """ValueError (ending with ``advice``) when the model's weights and one session's KV cache
    over its layers, all on this machine, outgrow the memory available: each stage would
    refuse its share only once the stages before it had taken theirs (zeroing gigabytes
    first), or not at all, the machine then swapping or killing processes."""
    budget = _memory_budget(model, ctx_size)
    if budget is None or budget[0] + budget[1] <= budget[2]:
        return
    weights, cache, available = budget
    if weights > available:
        raise ValueError(f"{model.name}'s weights take {weights >> 20} MiB, more than the {available >> 20} MiB "
                         "of memory available")
    raise ValueError(f"a context of {ctx_size} positions takes {cache >> 20} MiB of KV cache a session over "
                     f"{model.name}'s layers, more than the {(available - weights) >> 20} MiB of memory available "
                     f"beside its {weights >> 20} MiB of weights; {advice}")


def _check_launch(stages, layers, ctx_size, codec, policy, protocols, extra_args, stage_args, tls, timeouts,
                  session_events_kept, on_progress) -> tuple:
    """``launch_pipeline``'s arguments, checked in the caller's words before a stage starts (a
    stage would refuse most of them only when started, quoting its command line); ``stages``,
    ``layers``, ``ctx_size``, ``session_events_kept`` and the ``timeouts`` as plain Python
    numbers (a numpy or Fraction one reached a stage's command line in its repr)."""
    if stages is not None:
        stages = int_argument("stages", stages, 1)
    for index, pair in enumerate(layers or ()):
        if not isinstance(pair, (list, tuple)) or len(pair) != 2:
            raise TypeError(f"layers[{index}] must be a (start, end) pair of layer indices, got {pair!r}")
        # a float reached a stage's command line as "15.0"
        layers[index] = tuple(int_argument(f"layers[{index}]", bound, 0) for bound in pair)
    if stages is not None and layers is not None and stages != len(layers):
        raise ValueError(f"stages is {stages}, but layers gives {len(layers)} ranges")
    if on_progress is not None and not callable(on_progress):
        raise TypeError(f"on_progress must be callable or None, not {type(on_progress).__name__}")
    ctx_size = int_argument("ctx_size", ctx_size, 0, MAX_CTX_SIZE)  # 0: the model's training context, as -c 0
    session_events_kept = int_argument("session_events_kept", session_events_kept, 0)
    for name, value in (("codec", codec), ("policy", policy)):
        if not isinstance(value, str):
            raise TypeError(f"{name} must be a name string, not {type(value).__name__}")
    named_codec_setting(codec, policy)
    for version in protocols:
        protocol_argument("protocol", version)
    for name, args in (("extra_args", extra_args), *((f"stage_args[{i}]", a) for i, a in (stage_args or {}).items())):
        if not isinstance(args, (list, tuple)) or not all(isinstance(arg, str) for arg in args):
            raise TypeError(f"{name} must be a list of serve arguments (strings), got {args!r}")
    if tls is not None and not isinstance(tls, TlsConfig):
        raise TypeError(f"tls must be a TlsConfig, not {type(tls).__name__}")
    timeouts = {name: None if value is None else seconds_argument(name, value) for name, value in timeouts.items()}
    return stages, layers, ctx_size, session_events_kept, timeouts


def launch_pipeline(model: str | Path, stages: int | None = None, *, codec: str = "raw-f32-v1", policy: str = "fixed",
                    threads: int | None = None, ctx_size: int = DEFAULT_CTX_SIZE,
                    layers: list[tuple[int, int]] | None = None, startup_timeout: float = STARTUP_TIMEOUT,
                    io_timeout: float | None = None,
                    reply_timeout: float | None = None, capture_dir: str | Path | None = None,
                    log_dir: str | Path | None = None, extra_args: Iterable[str] = (),
                    stage_args: dict[int, list[str]] | None = None,
                    on_progress: Callable[[str], None] | None = None, protocol: int = 15,
                    protocols: list[int] | None = None, tls=None,
                    session_events_kept: int = SESSION_EVENTS_KEPT) -> StageCluster:
    """Start ``stages`` stage processes on 127.0.0.1 splitting the model's layers evenly
    (default: 2), or one per range of ``layers`` (``stages``, if given too, must count them).

    ``capture_dir``: each stage with a downstream records that hop to
    ``capture_dir/hopK-messages.bin`` and ``hopK-replies.bin`` (K = its index + 1).
    ``extra_args``: more ``serve`` arguments for every stage; ``stage_args``: for one stage
    (by index), after those.  ``log_dir``: each stage's stderr goes to ``log_dir/stageK.log``
    (else its last lines are kept in memory, for :meth:`StageCluster.explain`).
    ``reply_timeout``: what the driver waits for a reply; each stage waits a little less for
    its downstream's, the deeper the less (:func:`stage_reply_timeouts`).
    ``protocol``: the state version of every stage (``protocols``: one per stage, to test
    mixed pipelines); v17 stages share one fresh run id, the plan and the model id, and
    the cluster's ``identity`` is the driver's.  ``tls`` (a :class:`~skippy_wire.net.tls.
    TlsConfig`): every stage serves and forwards over mutual TLS with it.
    ``session_events_kept``: the latest "session" events kept per stage (0: none, for a
    caller that never reads them; :meth:`StageCluster.session_events` then has none to give).
    On any failure every started process is terminated before the error propagates.
    """
    if isinstance(extra_args, Iterable) and not isinstance(extra_args, (str, bytes)):
        extra_args = list(extra_args)  # (a generator is read once)
    layers = list(layers) if layers is not None else None
    stages, layers, ctx_size, session_events_kept, timeouts = _check_launch(
        stages, layers, ctx_size, codec, policy, list(protocols) if protocols else [protocol], extra_args, stage_args,
        tls, {"startup_timeout": startup_timeout, "io_timeout": io_timeout, "reply_timeout": reply_timeout},
        session_events_kept, on_progress)
    startup_timeout, io_timeout, reply_timeout = timeouts.values()
    threads = resolved_threads(threads)  # before the model is read
    model = Path(model)
    check_memory_fits(model, ctx_size)
    try:
        n_layer, _ = model_shape(model)
    except (OSError, ValueError):
        if layers is None:  # nothing to split
            raise
        n_layer = None  # given layers: the stages say why the model cannot be read, in their words
    if layers is None:
        layers = split_layers(n_layer, stages or DEFAULT_STAGES)
    problem = layer_chain_problem([tuple(r) for r in layers], n_layer, model.name)
    if problem:  # a gap or an overlap would generate wrong tokens without a word
        raise ValueError(f"layers: {problem}")
    if protocols and len(protocols) != len(layers):
        raise ValueError(f"protocols names {len(protocols)} versions for {len(layers)} stages")
    if set(stage_args or ()) - set(range(len(layers))):
        raise ValueError(f"stage_args names stages {sorted(stage_args)}, "
                         f"but there are {len(layers)} (0..{len(layers) - 1})")
    if on_progress is not None and oversubscription(threads):
        on_progress(f"warning: -t {threads}: {oversubscription(threads)}")
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    if capture_dir:
        Path(capture_dir).mkdir(parents=True, exist_ok=True)
    procs: list[StageProcess] = []
    protocols = list(protocols) if protocols else [protocol] * len(layers)
    run_id = uuid.uuid4().hex
    plan = ",".join(f"{a}-{b}" for a, b in layers)
    identity = driver_identity(run_id, plan, default_model_id(model))
    env = stage_env()
    try:
        downstream = None
        for index in reversed(range(len(layers))):
            start, end = layers[index]
            args = ["--model", str(model), "--layer-start", str(start), "--layer-end", str(end),
                    "--stage-index", str(index), "--listen", "127.0.0.1:0",
                    "--activation-codec", codec, "--activation-codec-policy", policy,
                    "--ctx-size", str(ctx_size), "--threads", str(threads), "--protocol", str(protocols[index]),
                    *(("--run-id", run_id, "--plan", plan) if protocols[index] == STAGE_STATE_VERSION_V17 else ()),
                    *(tls.as_args() if tls else ()), *extra_args,
                    *(stage_args or {}).get(index, ())]
            if io_timeout is not None:
                args += ["--io-timeout", str(io_timeout)]
            if reply_timeout is not None:
                args += ["--reply-timeout", repr(stage_reply_timeouts(reply_timeout, len(layers))[index])]
            if downstream:
                args += ["--downstream", downstream]
                if capture_dir:
                    args += ["--capture", str(Path(capture_dir) / f"hop{index + 1}")]
            started = time.perf_counter()
            proc = StageProcess(index, (start, end), args, env=env,
                                log_path=log_dir / f"stage{index}.log" if log_dir else None,
                                session_events_kept=session_events_kept)
            procs.insert(0, proc)
            proc.wait_listening(startup_timeout)
            if on_progress:
                on_progress(f"stage {index}: layers {start}..{end} listening on {proc.address} "
                            f"({time.perf_counter() - started:.2f} s)")
            downstream = proc.address
    except BaseException:
        _terminate_all(procs)
        raise
    cluster = StageCluster(procs, model, codec, policy, threads, log_dir, protocols[0], identity, ctx_size or None)
    _LAUNCHED[cluster.entry] = cluster
    return cluster


__all__ = ["STARTUP_TIMEOUT", "REPLY_TIMEOUT_STEP_S", "LOG_TAIL_LINES", "stage_reply_timeouts", "launched_cluster",
           "split_layers", "stage_env", "default_model", "StageProcess", "StageCluster", "launch_pipeline",
           "check_memory_fits", "sessions_fitting"]
