"""Decode through 1, 2 and 3 stage processes, alternating, with the per-hop breakdown.

    python bench/hop_bench.py [--tokens 96] [--rounds 3] [--stages 1,2,3]

Each round starts every pipeline (1 thread per stage, greedy, SmolLM2-135M Q4_1) and
generates ``--tokens`` tokens; the best round of each stage count is printed with its
decode tokens/s, the ratio to one stage, the stages' decode compute per token, the time
outside compute per token and per hop, and the per-stage breakdown the ``run`` summary
prints (``skippy-wire run`` shows the same block for one run).
"""

from __future__ import annotations

import os
import sys

from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.supervision import default_model, launch_pipeline
from skippy_wire.stage.models import Tokenizer
from skippy_wire.tools.bench_rows import cpu_model, script_options
from skippy_wire.tools.run import decode_path_lines, merge_session_events

PROMPT = "Once upon a time, in a small village by the sea, there lived"



def one_run(model, stages: int, prompt: list[int], tokens: int):
    with launch_pipeline(model, stages, threads=1, ctx_size=len(prompt) + tokens + 8) as cluster:
        with PipelineClient(*cluster.entry) as client:
            result = client.generate(prompt, max_tokens=tokens)
        events = cluster.session_events(wait=5.0)
    return result, events


def main(argv=None) -> int:
    args = script_options(__doc__, argv, tokens=96, rounds=3, stages="1,2,3")
    counts = [int(s) for s in args.stages.split(",")]
    model = default_model()
    prompt = Tokenizer.from_gguf(model).encode(PROMPT)
    best: dict[int, tuple] = {}
    for _ in range(args.rounds):
        for n in counts:
            result, events = one_run(model, n, prompt, args.tokens)
            if n not in best or result.decode_tok_s > best[n][0].decode_tok_s:
                best[n] = (result, events)
    base = best[counts[0]][0].decode_tok_s
    print(f"# decode through stage processes: 1 thread per stage, SmolLM2-135M Q4_1, greedy, {args.tokens} new "
          f"tokens, best of {args.rounds} alternating rounds; CPU: {cpu_model()}, {os.cpu_count()} cores")
    print("| stages | decode tok/s | ratio to 1 stage | compute per token | outside compute per token | per hop |")
    print("|---|---|---|---|---|---|")
    for n in counts:
        result, events = best[n]
        tokens = result.decode_messages
        compute = sum(merge_session_events(e).get("decode_path_us", {}).get("compute", 0) for e in events) / tokens
        round_trip = result.decode_round_trip_s * 1e6 / tokens
        print(f"| {n} | {result.decode_tok_s:.1f} | {result.decode_tok_s / base:.2f}x | {compute / 1000:.2f} ms | "
              f"{(round_trip - compute) / 1000:.3f} ms | {(round_trip - compute) / n / 1000:.3f} ms |")
    for n in counts:
        print(f"\n{n} stage(s):")
        print("\n".join(decode_path_lines(*best[n])))
    same = len({tuple(best[n][0].tokens) for n in counts}) == 1
    print(f"\nsame tokens for every stage count: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
