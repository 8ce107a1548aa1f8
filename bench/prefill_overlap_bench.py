"""Prefill across stages with and without overlap, alternating in one run.

    python bench/prefill_overlap_bench.py [--stages 2] [--tokens 512] [--chunk 64] [--rounds 3]

Starts the stage processes twice (1 thread each; once with the default overlap, once with
``serve --no-prefill-overlap``), warms each up with a short prompt, then in each round
prefills the same ``--tokens``-token prompt in ``--chunk``-token chunks on both, and prints
the best prefill tokens/s of each, their ratio (of the best rounds, and the median and
range of each round's own ratio), and whether the first generated tokens agree.  Overlap
needs a next stage and a next chunk: with one stage, or one chunk, both rows measure the
same path (the output says so).
"""

from __future__ import annotations

import contextlib
import sys

from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.supervision import default_model, launch_pipeline
from skippy_wire.stage.models import Tokenizer
from skippy_wire.tools.bench_rows import cpu_text, progress, round_ratios, script_main, script_options, within_layers
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


def prefill(cluster, prompt: list[int], chunk: int) -> tuple[float, list[int]]:
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
    tokens, ratios = {}, []
    with contextlib.ExitStack() as stack:
        clusters = {overlap: stack.enter_context(launch_pipeline(
            model, args.stages, threads=1, ctx_size=len(prompt) + 64,
            extra_args=[] if overlap else ["--no-prefill-overlap"])) for overlap in (True, False)}
        for cluster in clusters.values():
            prefill(cluster, prompt[:2 * args.chunk], args.chunk)  # warm-up: page in the weights, first-call paths
        for round_index in range(args.rounds):
            rates = {}
            for overlap, cluster in clusters.items():
                progress(f"round {round_index + 1}/{args.rounds}: {'with' if overlap else 'without'} overlap")
                rates[overlap], tokens[overlap] = prefill(cluster, prompt, args.chunk)
                best[overlap] = max(best[overlap], rates[overlap])
            ratios.append(rates[True] / rates[False])
        progress()
    print(f"# prefill overlap: {args.stages} stage processes x 1 thread, SmolLM2-135M Q4_1, {len(prompt)}-token "
          f"prompt in {args.chunk}-token chunks, best of {args.rounds} alternating rounds on running stages; "
          f"CPU: {cpu_text()}")
    if args.stages == 1 or args.chunk >= len(prompt):
        print(f"# overlap cannot apply ({'one stage' if args.stages == 1 else 'one chunk'}): both rows measure the "
              "same path, their ratio is the noise")
    print(f"| with overlap | {best[True]:.1f} tok/s |")
    print(f"| without | {best[False]:.1f} tok/s |")
    print(f"| ratio | {best[True] / best[False]:.2f}x |")
    print(f"| ratio within a round | {round_ratios(ratios)} |")
    same = tokens[True] == tokens[False]
    print(f"same tokens with and without overlap: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(script_main(main))
