"""Serving throughput of ``skippy-wire api`` against one request and against ``run``.

    python bench/serve_bench.py [--rounds 3] [--tokens 64] [--concurrency 4] [--stages 2 | --split 15,15]
                                [--ahead on] [--poll-ms auto]

Starts the stage processes once (1 thread each) with a compute trace, then, alternating in
rounds, measures on the same stages:

- ``run``: the driver's own generation (``PipelineClient.generate``, what ``skippy-wire run``
  does) of one request;
- one streaming request over HTTP (``skippy-wire api --connect``);
- ``--concurrency`` streaming requests at once;

each greedy with ``--tokens`` new tokens.  It prints the best round of each: aggregate
tokens/s (completion tokens of all requests over the wall time from the first request sent
to the last token received, so the prompts' prefill counts), aggregate decode tokens/s (the
tokens received while every request was decoding, from the last request's first token to
the first request's last token, over that window: prefill and time to first token, printed
on their own, do not count), time to first token, and the fraction of the wall time during
which every stage computed at once (from the stages' ``--trace-compute`` files), and the CPU
each process used over the round (the API, this client and each stage, from ``/proc``).  Ratios are
against the one-request figures of the same run; the two that the goals name are also given
as the median and range of each round's own ratio, which the host's drift between rounds does
not enter.  ``--ahead off`` starts the stages with
``serve --no-decode-ahead`` (docs/pipeline.md, "Decode ahead"); ``--split`` gives each
stage's number of layers (default: an even split over ``--stages``; given both, they must
agree), and the fraction of the time each stage
computed with the concurrent requests is printed too, over the whole round and over the
decode window (the stage that computes nearly all of the window bounds the throughput).
``--poll-ms`` is given to the stages (``serve --poll-ms``; ``auto``, the default, is what
``api`` gives them without the option); the API process and the driver of ``run`` sleep,
and yield to the stages (``net.driver.yielding_to_stages``).
"""

from __future__ import annotations

import argparse
import atexit
import concurrent.futures
import http.client
import json
import os
import re
import signal
import subprocess
import sys
import shutil
import tempfile
import time
from pathlib import Path


from skippy_wire.net.driver import PipelineClient, yielding_to_stages
from skippy_wire.net.supervision import default_model, launch_pipeline
from skippy_wire.stage.models import Tokenizer, model_shape
from skippy_wire.tools.bench_rows import (cpu_text, one_of, progress, round_ratios, script_main,
                                          script_options, within_layers)
from skippy_wire.tools.options import int_at_least, int_between, int_list
from skippy_wire.tools.poll_options import poll_args, poll_window

CTX_SIZE = 1024  # every stage's context
MAX_TOKENS = CTX_SIZE - 64  # new tokens a request may ask for: each prompt is under 64 tokens
DEFAULT_STAGES = 2  # without --stages or --split
PROMPTS = [f"Once upon a time, in a small town by the sea, there lived a {job} named {name}, who"
           for name, job in (("Anna", "baker"), ("Ben", "sailor"), ("Cleo", "painter"), ("Dan", "doctor"),
                             ("Eve", "pilot"), ("Finn", "teacher"), ("Gus", "farmer"), ("Hana", "singer"))]



def stream(url: str, prompt: str, tokens: int) -> dict:
    """One streaming completion: send time, token arrival times, text.  Read with the
    standard library's HTTP client, a line at a time: the load generator shares the two CPUs
    with the stages, so it should cost them as little as it can."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    body = json.dumps({"prompt": prompt, "max_tokens": tokens, "temperature": 0, "stream": True})
    conn = http.client.HTTPConnection(host, int(port), timeout=300)
    stamps, text = [], []
    try:
        sent = time.perf_counter()
        conn.request("POST", "/v1/completions", body, {"Content-Type": "application/json"})
        response = conn.getresponse()
        if response.status != 200:
            raise SystemExit(f"HTTP {response.status}: {response.read()[:200]!r}")
        for line in iter(response.readline, b""):
            if line.startswith(b"data: {"):
                piece = json.loads(line[6:])["choices"][0]
                if piece["text"]:
                    stamps.append(time.perf_counter())
                    text.append(piece["text"])
    finally:
        conn.close()
    return {"sent": sent, "stamps": stamps, "text": "".join(text)}


def busy_intervals(path: Path, start_ns: int, end_ns: int) -> list[tuple[int, int]]:
    """The stage's compute stretches inside [start_ns, end_ns], merged."""
    spans = []
    for line in path.read_text().split("\n"):
        if line.strip():
            a, b = map(int, line.split()[:2])
            a, b = max(a, start_ns), min(b, end_ns)
            if a < b:
                spans.append((a, b))
    spans.sort()
    merged: list[list[int]] = []
    for a, b in spans:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    return [(a, b) for a, b in merged]


def busy_fraction(trace: Path, start_ns: int, end_ns: int) -> float:
    """Fraction of [start_ns, end_ns] during which the stage computed."""
    return sum(b - a for a, b in busy_intervals(trace, start_ns, end_ns)) / max(1, end_ns - start_ns)


def all_busy_fraction(traces: list[Path], start_ns: int, end_ns: int) -> float:
    """Fraction of [start_ns, end_ns] during which every stage computed."""
    common = busy_intervals(traces[0], start_ns, end_ns)
    for trace in traces[1:]:
        other, out, i, j = busy_intervals(trace, start_ns, end_ns), [], 0, 0
        while i < len(common) and j < len(other):
            a, b = max(common[i][0], other[j][0]), min(common[i][1], other[j][1])
            if a < b:
                out.append((a, b))
            if common[i][1] < other[j][1]:
                i += 1
            else:
                j += 1
        common = out
    return sum(b - a for a, b in common) / max(1, end_ns - start_ns)


def decode_window(results: list[dict]) -> tuple[float, float]:
    """While every request was decoding: from the last request's first token to the first
    request's last token (one request: its first to its last token)."""
    return max(r["stamps"][0] for r in results), min(r["stamps"][-1] for r in results)


def decode_window_rate(results: list[dict]) -> float:
    """Tokens per second received in the :func:`decode_window` (one request: its decode rate)."""
    start, end = decode_window(results)
    if end <= start:
        return 0.0
    return sum(start < t <= end for r in results for t in r["stamps"]) / (end - start)


def cpu_seconds(pid: int) -> float:
    """User plus system CPU time of one process so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def concurrent_round(url: str, n: int, tokens: int, traces: list[Path], pids: dict[str, int]) -> dict:
    cpu0 = {name: cpu_seconds(pid) for name, pid in pids.items()}
    start_ns = time.monotonic_ns()
    t0 = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(n) as pool:
        results = list(pool.map(lambda p: stream(url, p, tokens), PROMPTS[:n]))
    if any(len(r["stamps"]) < 2 for r in results):
        raise SystemExit("a request produced fewer than 2 tokens; choose prompts the model continues")
    wall = max(r["stamps"][-1] for r in results) - t0
    end_ns = time.monotonic_ns()
    cpu = {name: (cpu_seconds(pid) - cpu0[name]) / wall for name, pid in pids.items()}
    count = sum(len(r["stamps"]) for r in results)
    single = results[0]["stamps"]
    window = [start_ns + int((stamp - t0) * 1e9) for stamp in decode_window(results)]  # on the traces' clock
    return {"agg_tok_s": count / wall, "decode_agg_tok_s": decode_window_rate(results),
            "window_busy": [busy_fraction(trace, *window) for trace in traces] if window[1] > window[0] else None,
            "ttft_s": sum(r["stamps"][0] - r["sent"] for r in results) / n,
            "stream_decode_tok_s": (len(single) - 1) / (single[-1] - single[0]),
            "all_busy": all_busy_fraction(traces, start_ns, end_ns),
            "busy": [busy_fraction(trace, start_ns, end_ns) for trace in traces], "texts": [r["text"] for r in results], "cpu": cpu}


def run_round(entry, tokenizer, tokens: int) -> dict:
    prompt = tokenizer.encode(PROMPTS[0])
    with PipelineClient(*entry) as client, yielding_to_stages():  # as the driver of `run` does
        t0 = time.perf_counter()
        result = client.generate(prompt, max_tokens=tokens, is_eog=tokenizer.is_eog)
        wall = time.perf_counter() - t0
    return {"agg_tok_s": len(result.tokens) / wall, "decode_tok_s": result.decode_tok_s}


def _split_conflict(args) -> str | None:
    if args.split and args.stages and args.stages != len(args.split):
        return f"--split {','.join(map(str, args.split))} makes {len(args.split)} stages, not --stages {args.stages}"
    return None


def whole_model_split(text: str) -> list[int]:
    """``--split``: layers per stage, adding up to the model's (a usage error else)."""
    counts = int_list(1, repeats=True)(text) if text else []
    n_layer = model_shape(default_model())[0]
    if counts and sum(counts) != n_layer:
        raise argparse.ArgumentTypeError(f"the counts must add up to the model's {n_layer} layers, not {sum(counts)}")
    return counts


def main(argv=None) -> int:
    args = script_options(__doc__, argv, types={"ahead": one_of("on", "off"), "poll-ms": poll_window,
                                                "split": whole_model_split,
                                                # a prompt each; with one, "concurrent" was the one request again
                                                "concurrency": int_between(2, len(PROMPTS)),
                                                "tokens": int_between(2, MAX_TOKENS),  # a decode rate needs two
                                                # empty: DEFAULT_STAGES, or --split's count
                                                "stages": lambda text: text and within_layers(int_at_least(1))(text)},
                          conflicts=_split_conflict, said={"stages": f"{DEFAULT_STAGES}, or --split's count"},
                          rounds=3, tokens=64, concurrency=4, stages="", ahead="on", split="", **{"poll-ms": "auto"})
    poll_ms = args.poll_ms
    layers = None
    args.stages = args.stages or len(args.split) or DEFAULT_STAGES
    if args.split:
        counts = args.split
        layers = [(sum(counts[:i]), sum(counts[:i + 1])) for i in range(len(counts))]
    model = default_model()
    tokenizer = Tokenizer.from_gguf(model)
    trace_dir = Path(tempfile.mkdtemp(prefix="skippy-serve-bench-"))
    atexit.register(shutil.rmtree, trace_dir, True)
    with launch_pipeline(model, args.stages, threads=1, ctx_size=CTX_SIZE, layers=layers,
                         extra_args=["--trace-compute", str(trace_dir)] + poll_args(poll_ms, args.stages)
                         + ([] if args.ahead == "on" else ["--no-decode-ahead"])) as cluster:
        host, port = cluster.entry
        api = subprocess.Popen([sys.executable, "-m", "skippy_wire", "api", "--connect", f"{host}:{port}",
                                "--listen", "127.0.0.1:0", "--ctx-size", str(CTX_SIZE)],
                               stderr=subprocess.PIPE, text=True, start_new_session=True)
        try:
            url = None
            while url is None:
                line = api.stderr.readline()
                if not line:
                    raise SystemExit("the api process ended before listening")
                m = re.search(r"API on (http://[\d.]+:\d+)/v1", line)
                url = m.group(1) if m else None
            pids = {"api": api.pid, "client": os.getpid(),
                    **{f"stage {i}": stage.popen.pid for i, stage in enumerate(cluster.stages)}}
            traces = [trace_dir / f"stage{i}.trace" for i in range(args.stages)]
            stream(url, PROMPTS[0], 8)  # warm-up
            best: dict[str, dict] = {}
            stream_to_run, many_to_one = [], []  # each round's own ratios
            for round_index in range(args.rounds):
                this: dict[str, dict] = {}
                for name, fn in (("run", lambda: run_round(cluster.entry, tokenizer, args.tokens)),
                                 ("1", lambda: concurrent_round(url, 1, args.tokens, traces, pids)),
                                 (str(args.concurrency),
                                  lambda: concurrent_round(url, args.concurrency, args.tokens, traces, pids))):
                    progress(f"round {round_index + 1}/{args.rounds}: "
                             + ("run" if name == "run" else f"{name} request(s) over HTTP"))
                    r = this[name] = fn()
                    if name not in best or r["agg_tok_s"] > best[name]["agg_tok_s"]:
                        best[name] = r
                stream_to_run.append(this["1"]["stream_decode_tok_s"] / this["run"]["decode_tok_s"])
                if this[str(args.concurrency)]["decode_agg_tok_s"]:  # else no moment when all of them decoded
                    many_to_one.append(this[str(args.concurrency)]["decode_agg_tok_s"] / this["1"]["decode_agg_tok_s"])
            progress()
        finally:
            os.killpg(api.pid, signal.SIGINT)
            api.wait(30)
            api.stderr.close()
        events = [e for stage in cluster.session_events(wait=5.0) for e in stage]
    batched = sum(e.get("batched_decode_steps", 0) for e in events)
    decoded = sum(e.get("decode_tokens", 0) for e in events)
    one, many, run = best["1"], best[str(args.concurrency)], best["run"]
    print(f"# serving benchmark: {args.stages} stage processes x 1 thread (layers "
          f"{','.join(map(str, args.split)) or 'even'}, decode ahead {args.ahead}, stages poll "
          f"{'auto' if poll_ms is None else poll_ms}), "
          "SmolLM2-135M Q4_1, greedy, "
          f"{args.tokens} new tokens per request, best of {args.rounds} rounds; CPU: {cpu_text()}")
    print("| figure | value | ratio |")
    print("|---|---|---|")
    print(f"| `run` (driver alone): decode tok/s | {run['decode_tok_s']:.1f} | |")
    print(f"| 1 streaming request over HTTP: decode tok/s | {one['stream_decode_tok_s']:.1f} | "
          f"{one['stream_decode_tok_s'] / run['decode_tok_s']:.2f}x `run` |")
    print(f"| 1 request: aggregate tok/s | {one['agg_tok_s']:.1f} | 1.00x |")
    print(f"| {args.concurrency} concurrent requests: aggregate tok/s | {many['agg_tok_s']:.1f} | "
          f"{many['agg_tok_s'] / one['agg_tok_s']:.2f}x one request |")
    print(f"| 1 request: aggregate decode tok/s | {one['decode_agg_tok_s']:.1f} | 1.00x |")
    if many["decode_agg_tok_s"]:
        print(f"| {args.concurrency} concurrent requests: aggregate decode tok/s | {many['decode_agg_tok_s']:.1f} | "
              f"{many['decode_agg_tok_s'] / one['decode_agg_tok_s']:.2f}x one request |")
    else:
        print(f"| {args.concurrency} concurrent requests: aggregate decode tok/s | n/a: no moment when all decoded "
              "(raise --tokens) | |")
    print(f"| 1 streaming request over HTTP / `run`, within each round | | {round_ratios(stream_to_run)} |")
    print(f"| {args.concurrency} concurrent / 1 request, aggregate decode, within each round | | "
          f"{round_ratios(many_to_one) if many_to_one else 'n/a'} |")
    print(f"| time to first token, 1 request | {one['ttft_s'] * 1000:.0f} ms | |")
    print(f"| time to first token, {args.concurrency} requests (mean) | {many['ttft_s'] * 1000:.0f} ms | |")
    print(f"| all stages computing at once, 1 request | {one['all_busy'] * 100:.1f}% | |")
    print(f"| all stages computing at once, {args.concurrency} requests | {many['all_busy'] * 100:.1f}% | |")
    print(f"| each stage computing, {args.concurrency} requests | "
          + " / ".join(f"{b * 100:.0f}%" for b in many["busy"]) + " | |")
    print(f"| each stage computing while all {args.concurrency} decode | "
          + (" / ".join(f"{b * 100:.0f}%" for b in many["window_busy"]) if many["window_busy"] else "n/a") + " | |")
    for label, r in (("1 request", one), (f"{args.concurrency} requests", many)):
        print(f"| CPU used over the round, {label}: " + " / ".join(r["cpu"]) + " | "
              + " / ".join(f"{share * 100:.0f}%" for share in r["cpu"].values()) + " | |")
    print(f"| decode steps that ran in a multi-session batch (all rounds, all stages) | "
          f"{100 * batched / max(decoded, 1):.1f}% | |")
    same = many["texts"][0] == one["texts"][0]
    print(f"\nfirst request's text identical alone and among {args.concurrency}: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
