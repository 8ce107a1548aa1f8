"""Decode through 1, 2 and 3 stage processes, alternating, with the per-hop breakdown.

    python bench/hop_bench.py [--tokens 96] [--rounds 3] [--stages 1,2,3] [--poll-ms auto,0] [--ahead on,off]

Starts every pipeline once (1 thread per stage, greedy, SmolLM2-135M Q4_1), warms each with
one short generation, then in each round generates ``--tokens`` tokens on every pipeline
in turn, so that the generations compared within a round run seconds apart (the host's
speed drifts over minutes; stage processes that are not generating sleep).  The best round
of each stage count is printed with its decode tokens/s, the ratio to the first count
listed (one stage by default; of the best rounds, and the median and range of each round's
own ratio, which the host's drift between rounds does not enter), the stages' decode
compute per token, the time outside
compute per token and per hop, the cores the stage processes kept busy meanwhile (their
CPU time over the generation's wall time), and the per-stage breakdown the ``run`` summary
prints (``skippy-wire run`` shows the same block for one run).  ``--poll-ms`` lists the
busy-poll windows to compare (``skippy-wire run --poll-ms``; ``auto``, the default, is
what ``run`` does without the option); each round runs every stage count with each window,
and every window's table is printed.  ``--ahead`` lists the stage settings to compare:
``on`` (the default: the first stage computes a session's next decode step before its
message arrives) and ``off`` (``serve --no-decode-ahead``).
"""

from __future__ import annotations

import contextlib
import os
import sys
import time

from skippy_wire.net.driver import PipelineClient, yielding_to_stages
from skippy_wire.net.supervision import default_model, launch_pipeline
from skippy_wire.stage.models import Tokenizer
from skippy_wire.tools.bench_rows import (comma_list, cpu_text, one_of, progress, round_ratios, script_main,
                                          script_options, within_layers)
from skippy_wire.tools.options import int_between, int_list
from skippy_wire.tools.poll_options import driver_poll_s, poll_args, poll_window
from skippy_wire.tools.run_report import decode_path_lines, merge_session_events

PROMPT = "Once upon a time, in a small village by the sea, there lived"
#: The most new tokens a generation is asked for: SmolLM2's training context, less the prompt.
MAX_NEW_TOKENS = 8000



def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    with open(f"/proc/{pid}/stat", encoding="ascii") as fh:
        fields = fh.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def start_pipeline(stack: contextlib.ExitStack, model, stages: int, ctx_size: int, poll_ms: float | None,
                   ahead: bool):
    """Stage processes that stay up for the whole benchmark."""
    return stack.enter_context(launch_pipeline(
        model, stages, threads=1, ctx_size=ctx_size,
        extra_args=poll_args(poll_ms, stages) + ([] if ahead else ["--no-decode-ahead"])))


def one_run(cluster, prompt: list[int], tokens: int, poll_ms: float | None):
    """One generation on running stages: its result, this session's events per stage and
    the cores the stages kept busy meanwhile."""
    pids = [stage.popen.pid for stage in cluster.stages]
    done = min(len(stage.session_events) for stage in cluster.stages)
    cpu_before, started = sum(map(_cpu_seconds, pids)), time.perf_counter()
    with PipelineClient(*cluster.entry, poll_s=driver_poll_s(poll_ms)) as client:
        result = client.generate(prompt, max_tokens=tokens)
    cores = (sum(map(_cpu_seconds, pids)) - cpu_before) / (time.perf_counter() - started)
    events = [stage[done:done + 1] for stage in cluster.session_events(wait=5.0, count=done + 1)]
    return result, events, cores


def _poll_text(poll_ms: float | None) -> str:
    return "auto" if poll_ms is None else f"{poll_ms:g} ms"


def main(argv=None) -> int:
    args = script_options(__doc__, argv, types={"stages": within_layers(int_list(1)),
                                                "ahead": comma_list(one_of("on", "off")),
                                                "poll-ms": comma_list(poll_window),
                                                # 2 at least: one decode step to time
                                                "tokens": int_between(2, MAX_NEW_TOKENS)},
                          tokens=96, rounds=3, stages="1,2,3", ahead="on", **{"poll-ms": "auto"})
    counts = args.stages
    settings = [(poll, ahead == "on") for ahead in args.ahead for poll in args.poll_ms]
    model = default_model()
    prompt = Tokenizer.from_gguf(model).encode(PROMPT)
    best: dict[tuple, tuple] = {}
    ratios: dict[tuple, list[float]] = {}  # (setting, stages) -> each round's ratio to the first count
    with contextlib.ExitStack() as stack:
        clusters = {(setting, n): start_pipeline(stack, model, n, len(prompt) + args.tokens + 8, *setting)
                    for setting in settings for n in counts}
        stack.enter_context(yielding_to_stages())  # as the drivers of `run` and `api` do
        for (setting, _), cluster in clusters.items():
            one_run(cluster, prompt, 8, setting[0])  # warm-up: page in the weights, first-call paths
        for round_index in range(args.rounds):
            for setting in settings:
                for n in counts:
                    progress(f"round {round_index + 1}/{args.rounds}: {n} stage(s), poll {_poll_text(setting[0])}, "
                             f"decode ahead {'on' if setting[1] else 'off'}")
                    run = one_run(clusters[setting, n], prompt, args.tokens, setting[0])
                    if (setting, n) not in best or run[0].decode_tok_s > best[setting, n][0].decode_tok_s:
                        best[setting, n] = run
                    if n == counts[0]:
                        base = run[0].decode_tok_s
                    ratios.setdefault((setting, n), []).append(run[0].decode_tok_s / base)
        progress()
    print(f"# decode through stage processes: 1 thread per stage, SmolLM2-135M Q4_1, greedy, {args.tokens} new "
          f"tokens, best of {args.rounds} alternating rounds on running stages; CPU: {cpu_text()}")
    print(f"| poll | ahead | stages | decode tok/s | ratio to {counts[0]} stage(s) | ratio within a round | "
          "compute per token "
          "| outside compute per token | per hop | stages' CPU (cores) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for setting in settings:
        poll, ahead = setting
        base = best[setting, counts[0]][0].decode_tok_s
        for n in counts:
            result, events, cores = best[setting, n]
            tokens = result.decode_messages
            compute = sum(merge_session_events(e).get("decode_path_us", {}).get("compute", 0) for e in events) / tokens
            outside = result.decode_round_trip_s * 1e6 / tokens - compute
            # a few tokens computed ahead of their messages: the round trip holds less than the compute
            shown = (f"{outside / 1000:.3f} ms | {outside / n / 1000:.3f} ms" if outside >= 0
                     else "not separable | not separable")
            print(f"| {_poll_text(poll)} | {'on' if ahead else 'off'} | {n} | {result.decode_tok_s:.1f} | "
                  f"{result.decode_tok_s / base:.2f}x | {round_ratios(ratios[setting, n])} | {compute / 1000:.2f} ms | "
                  f"{shown} | {cores:.2f} |")
    for ((poll, ahead), n), run in best.items():
        print(f"\n{n} stage(s), poll {_poll_text(poll)}, decode ahead {'on' if ahead else 'off'}:")
        print("\n".join(decode_path_lines(*run[:2])))
    same = len({tuple(run[0].tokens) for run in best.values()}) == 1
    print(f"\nsame tokens for every stage count and setting: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
