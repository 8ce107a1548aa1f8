"""What ``skippy-wire run`` (and ``cluster``) print about a generation: the text as it
arrives (:class:`TextStreamer`), the summary of the wire traffic and of each hop's time,
its ``--json`` form and the ``--check`` verdict."""

from __future__ import annotations

import sys
from pathlib import Path

from ..net.driver import SESSION_END_UNANSWERED, GenerationResult
from ..net.service import TextAssembler
from ..net.session_state import DECODE_STRETCHES
from ..wire.replies import StageReplyStats


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
                   model: str, codec: str, policy: str, threads: int | None, connected: str | None = None,
                   sampling: str | None = None, chat: bool = False, protocol: int = 15) -> str:
    if connected:
        lines = [f"summary: the pipeline at {connected}, {Path(model).name}, state version {protocol}"]
    else:
        lines = [f"summary: {stages} stage process{'es' if stages != 1 else ''} on 127.0.0.1, "
                 f"{Path(model).name}, state version {protocol}, codec {codec}, policy {policy}, "
                 f"{threads} thread{'s' if threads != 1 else ''} per stage"]
    if sampling is not None:
        lines.append(f"  sampling: {sampling}" + ("; prompt in the chat template" if chat else ""))
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
            ahead = (f", {s['decoded_ahead']} of {s.get('decode_tokens', 0)} decode steps computed ahead"
                     if s.get("decoded_ahead") else "")
            lines.append(f"  stage {index}: compute {s.get('compute_ms', 0.0):.1f} ms, "
                         f"{s.get('messages', 0)} messages{ahead}")
    lines += decode_path_lines(result, cluster_events)
    return "\n".join(lines)


def decode_path_lines(result: GenerationResult, cluster_events: list[list[dict]] | None) -> list[str]:
    """Where a decoded token's time goes: per stage (DECODE_STRETCHES, microseconds per
    token), the driver's own share, and the time outside compute per hop."""
    tokens = result.decode_messages
    if not tokens:
        return []
    lines = ["  decode path per token (us):"]
    compute_us = 0.0
    for index, events in enumerate(cluster_events or []):
        path = merge_session_events(events).get("decode_path_us")
        if not path:
            continue
        compute_us += path["compute"] / tokens
        lines.append(f"    stage {index}: " + ", ".join(f"{name.replace('_', ' ')} {path[name] / tokens:.0f}"
                                                         for name in DECODE_STRETCHES if path.get(name)))
    round_trip_us = result.decode_round_trip_s * 1e6 / tokens
    lines.append(f"    driver: reply to next message {result.driver_gap_s * 1e6 / tokens:.0f}, "
                 f"round trip to stage 0 {round_trip_us:.0f}")
    hops = len(cluster_events or [])
    if compute_us and hops and round_trip_us < compute_us:
        # decode ahead: a step computed before its message was sent is outside the round trip,
        # which over a few tokens (the first after a prefill most) can outweigh the hops
        lines.append(f"    outside compute: not separable over {tokens} decode step{'s' if tokens != 1 else ''} "
                     "(stage 0 computed ahead of the driver's messages)")
    elif compute_us and hops:
        lines.append(f"    outside compute: {round_trip_us - compute_us:.0f} per token over {hops} "
                     f"hop{'s' if hops != 1 else ''} = {(round_trip_us - compute_us) / hops:.0f} per hop")
    return lines


# --------------------------------------------------------------------------------------
# CLI
# --------------------------------------------------------------------------------------

#: Sampling defaults: llama.cpp's ``llama-cli`` defaults, so that the same flags give the
#: same kind of text; ``--temp 0`` is greedy (the backend's argmax, no sampling block).


def check_tokens(tokens: list[int], local: GenerationResult, codec: str, policy: str, *,
                 name: str = "pipeline") -> dict:
    """Compare the tokens of the ``name`` ("pipeline", "cluster") with one in-process stage's
    (``--check``): ``ok``, the summary's ``message`` and, when they differ, the first
    difference and the one-line ``error``."""
    if local.tokens == tokens:
        return {"ok": True, "tokens": len(tokens),
                "message": f"check: OK, {len(tokens)} tokens identical to one in-process stage "
                           f"(in-process decode {local.decode_tok_s:.1f} tok/s)"}
    first = next((i for i, (a, b) in enumerate(zip(local.tokens, tokens)) if a != b),
                 min(len(local.tokens), len(tokens)))
    lossy = policy == "fixed" and codec != "raw-f32-v1"
    return {"ok": False, "first_difference": first,
            "message": f"check: FAILED, tokens differ from position {first}: {name} {tokens[first:first + 8]} "
                       f"vs in-process {local.tokens[first:first + 8]}"
                       + (f" ({codec} is lossy, so a divergence can be expected)" if lossy else ""),
            "error": f"check failed: the {name}'s tokens differ from one in-process stage's from position {first}"}


def warn_if_unended(result: GenerationResult, cause: str | None = None) -> None:
    """When every token came but the closing Stop got no answer: a warning on stderr, also
    with --quiet (the text stands; the stages may need a look), ``cause`` (which stage, when
    known) before what the driver saw."""
    if result.session_end_error is not None:
        print(f"[skippy-wire] warning: {SESSION_END_UNANSWERED}: " + (f"{cause}; " if cause else "")
              + result.session_end_error, file=sys.stderr, flush=True)


def json_summary(result: GenerationResult, cluster_events: list[list[dict]] | None, *, stages: int, model: str,
                 codec: str, policy: str, threads: int, connected: str | None, sampling, chat: bool,
                 protocol: int = 15) -> dict:
    """The summary of ``--json``: the figures of :func:`format_summary` as numbers.  With
    ``connected`` the stages are someone else's: their count, codec, policy and threads are
    null, as the text summary leaves them out (the state version is the driver's own).
    ``completion_tokens`` counts the tokens decoded, an end-of-generation one included, as
    the API's ``usage`` and llama-server's ``tokens_predicted`` do."""
    mine = connected is None
    return {
        "model": Path(model).name, "connected": connected, "stages": stages if mine else None,
        "codec": codec if mine else None, "policy": policy if mine else None, "threads": threads if mine else None,
        "protocol": protocol, "chat_template": chat,
        "sampling": None if sampling is None else {
            "seed": sampling.seed, "temperature": sampling.temperature, "top_k": sampling.top_k,
            "top_p": sampling.top_p, "min_p": sampling.min_p, "repeat_penalty": sampling.repeat_penalty,
            "presence_penalty": sampling.presence_penalty, "frequency_penalty": sampling.frequency_penalty,
            "repeat_last_n": sampling.penalty_last_n},
        "prompt_tokens": len(result.prompt_tokens), "completion_tokens": len(result.tokens),
        "tokens": list(result.tokens), "stop_reason": result.stop_reason,
        "prefill_ms": result.prefill_s * 1000, "prefill_tok_s": result.prefill_tok_s,
        "decode_tokens": result.decode_tokens, "decode_ms": result.decode_s * 1000,
        "decode_tok_s": result.decode_tok_s, "sent_bytes": result.sent_bytes,
        "received_bytes": result.received_bytes, "session_end_error": result.session_end_error,
        "stage_sessions": [merge_session_events(events) for events in cluster_events or []],
    }


class TextStreamer:
    """Print a generation as it arrives: only the text that is new since the last token
    (the engine's :class:`TextAssembler`, without stop strings); end-of-generation tokens
    print nothing."""

    def __init__(self, tokenizer, out) -> None:
        self.tokenizer, self.out = tokenizer, out
        self._text = TextAssembler(tokenizer)
        self.printed = ""
        self._line_open = False  # something is on the current line of ``out``

    def _out(self, text: str) -> None:
        self.out.write(text)
        self.out.flush()
        if text:
            self._line_open = not text.endswith("\n")

    def _write(self, delta: str, end: str = "") -> None:
        self.printed += delta
        self._out(delta + end)

    def show(self, text: str) -> None:
        """Print text that is not generated (a raw prompt before its continuation)."""
        self._out(text)

    def end_line(self) -> None:
        """End a partial line (an interrupted or failed generation), so that what is printed
        next starts a line of its own; quiet when ``out`` is gone."""
        if self._line_open:
            try:
                self._out("\n")
            except (OSError, ValueError):
                pass

    def push(self, token: int) -> None:
        if not self.tokenizer.is_eog(token):
            delta = self._text.push(token)
            if delta:
                self._write(delta)

    def finish(self) -> None:
        self._write(self._text.finish(), "\n")
