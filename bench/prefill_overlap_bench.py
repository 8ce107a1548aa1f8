"""Prefill across stages with and without overlap, alternating in one run.

    python bench/prefill_overlap_bench.py [--stages 2] [--tokens 512] [--chunk 64] [--rounds 3]

Starts the stage processes twice per round (1 thread each; once with the default overlap,
once with ``serve --no-prefill-overlap``), prefills the same ``--tokens``-token prompt in
``--chunk``-token chunks, and prints the best prefill tokens/s of each, their ratio, and
whether the first generated tokens agree.
"""

from __future__ import annotations

import os
import sys

from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.supervision import default_model, launch_pipeline
from skippy_wire.stage.models import Tokenizer
from skippy_wire.tools.bench_rows import cpu_model, script_main, script_options, within_layers
from skippy_wire.tools.options import int_at_least, int_between

#: The longest prompt measured: SmolLM2's training context.
MAX_PROMPT_TOKENS = 8192


def prompt_tokens(tokenizer, n: int) -> list[int]:
    """The first ``n`` tokens of a story (its text doubled until long enough: tokenizing
    it again after every sentence took quadratic time)."""
    words = ("the sea", "a small village", "an old lighthouse", "fishing boats", "the morning tide")
    sentences = 16
    while True:
        ids = tokenizer.encode("".join(f" Once, near {words[i % len(words)]}, story {i} began."
                                       for i in range(sentences)))
        if len(ids) >= n:
            return ids[:n]
        sentences *= 2


def prefill(model, stages: int, prompt: list[int], chunk: int, overlap: bool) -> tuple[float, list[int]]:
    extra = [] if overlap else ["--no-prefill-overlap"]
    with launch_pipeline(model, stages, threads=1, ctx_size=len(prompt) + 64, extra_args=extra) as cluster:
        with PipelineClient(*cluster.entry) as client:
            result = client.generate(prompt, max_tokens=4, chunk_size=chunk)
    return result.prefill_tok_s, result.tokens


def main(argv=None) -> int:
    args = script_options(__doc__, argv, types={"tokens": int_between(1, MAX_PROMPT_TOKENS),
                                                "stages": within_layers(int_at_least(1))},
                          stages=2, tokens=512, chunk=64, rounds=3)
    model = default_model()
    prompt = prompt_tokens(Tokenizer.from_gguf(model), args.tokens)
    best = {True: 0.0, False: 0.0}
    tokens = {}
    for _ in range(args.rounds):
        for overlap in (True, False):
            rate, tokens[overlap] = prefill(model, args.stages, prompt, args.chunk, overlap)
            best[overlap] = max(best[overlap], rate)
    print(f"# prefill overlap: {args.stages} stage processes x 1 thread, SmolLM2-135M Q4_1, {len(prompt)}-token "
          f"prompt in {args.chunk}-token chunks, best of {args.rounds}; CPU: {cpu_model()}, {os.cpu_count()} cores")
    print(f"| with overlap | {best[True]:.1f} tok/s |")
    print(f"| without | {best[False]:.1f} tok/s |")
    print(f"| ratio | {best[True] / best[False]:.2f}x |")
    same = tokens[True] == tokens[False]
    print(f"same tokens with and without overlap: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
