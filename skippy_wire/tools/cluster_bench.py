"""``skippy-wire bench-cluster``: the namespace-host matrix of docs/benchmarks.md.

For every combination of ``--hosts`` x ``--rates`` x ``--delays`` x ``--codecs`` it runs one
``skippy-wire cluster`` generation (fresh namespaces each time, see
:mod:`skippy_wire.tools.cluster`) on a ``--prompt-tokens`` prompt prefilled in
``--chunk-size`` chunks and reports prefill tokens/s, decode tokens/s, forwarded bytes per
token per hop, the measured bulk throughput of the link, and whether the tokens equal one
in-process stage's, whose prefill and decode rates (measured once, in the same run) are the
reference of each row's ratios.  The matrix is large; take subsets.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import sys
import time
from pathlib import Path

from ..errors import NetnsError, PipelineError, ToolError, TopologyError
from ..net.netns import format_rate, parse_rate
from ..net.supervision import default_model
from ..stage.models import Tokenizer, model_shape
from ..stage.threads import default_threads
from ..wire.constants import CODEC_SHORT_NAMES, POLICY_SHORT_NAMES, CodecPolicy
from .cluster import (ClusterOptions, add_cluster_options, check_tokens, context_size, fit_error, link_rate,
                      local_reference, progress_printer, prompt_ids, require_namespace_hosts, run_cluster)
from .bench_rows import comma_list, cpu_text
from .options import (EXIT_FAILURE, EXIT_INTERRUPTED, MAX_CTX_SIZE, Parser, check_output_dir, check_output_file,
                      describe, doc_summary, error_line, file_error, int_list, milliseconds, utf8)
from .signals import exiting_on_signals

#: Row names -> (activation codec identity, policy): the codecs' short names (fixed policy)
#: and the lossless policy over raw f32.
CODECS = {name: (identity, CodecPolicy.FIXED.serde_name) for name, identity in CODEC_SHORT_NAMES.items()}
CODECS["auto-lossless"] = (CODEC_SHORT_NAMES["raw-f32"], POLICY_SHORT_NAMES["auto-lossless"])
DEFAULT_RATES = "unlimited,1gbit,100mbit,20mbit,5mbit,2mbit"
DEFAULT_DELAYS = "0,5,20"
DEFAULT_HOSTS = "2,3"
PROG = "skippy-wire bench-cluster"

COLUMNS = ("hosts", "link", "delay ms", "codec", "measured Mbit/s", "prefill tok/s", "decode tok/s",
           "prefill / 1 stage", "decode / 1 stage", "bytes/token/hop", "tokens = 1 stage")


def codec_row(name: str) -> str:
    if name not in CODECS:
        raise argparse.ArgumentTypeError(f"unknown codec {name!r} (one of {', '.join(CODECS)})")
    return name


def _ratio(rate: float, reference: float) -> float | None:
    return round(rate / reference, 2) if reference > 0 else None


def _rate(rate: float) -> float | None:
    """A rate as a cell: none where nothing was timed (no decode step with -n 1), not 0."""
    return round(rate, 1) if rate > 0 else None


def row_of(res, reference, cpu: str) -> dict:
    """One row: ``res``, a cluster run, against ``reference``, one in-process stage's run, on
    ``cpu`` (the table shows these two once, in its header and its footer)."""
    o, result = res.options, res.result
    ok = check_tokens(res, reference)["ok"]
    return {"hosts": o.hosts, "link": format_rate(parse_rate(o.rate)), "delay ms": o.delay_ms,
            "codec": next(k for k, v in CODECS.items() if v == (o.codec, o.policy)),
            "measured Mbit/s": round(res.link_bits / 1e6, 1) if res.link_bits else None,
            "prefill tok/s": _rate(result.prefill_tok_s), "decode tok/s": _rate(result.decode_tok_s),
            "prefill / 1 stage": _ratio(result.prefill_tok_s, reference.prefill_tok_s),
            "decode / 1 stage": _ratio(result.decode_tok_s, reference.decode_tok_s),
            "bytes/token/hop": round(res.bytes_per_token_per_hop), "tokens = 1 stage": "yes" if ok else "no",
            "prompt tokens": len(res.prompt), "new tokens": len(res.result.tokens), "cpu": cpu,
            "1 stage prefill tok/s": _rate(reference.prefill_tok_s),
            "1 stage decode tok/s": _rate(reference.decode_tok_s)}


def markdown(rows: list[dict]) -> str:
    def cell(v) -> str:
        if v is None:
            return "-"
        return f"{v:g}" if isinstance(v, float) else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c)) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description=doc_summary(__doc__.splitlines()[0]))
    p.add_argument("--hosts", type=int_list(1), default=DEFAULT_HOSTS, help="comma list of host counts")
    p.add_argument("--rates", type=comma_list(link_rate), default=DEFAULT_RATES, help="comma list of link rates")
    p.add_argument("--delays", type=comma_list(milliseconds), default=DEFAULT_DELAYS,
                   help="comma list of one-way ms")
    p.add_argument("--codecs", type=comma_list(codec_row), default=",".join(CODECS),
                   help="comma list of " + ", ".join(CODECS))
    p.add_argument("--prompt", type=utf8,
                   default="Once upon a time, in a small village by the sea, there lived a fisherman "
                           "who knew every wave by name and every star by heart.",
                   help="text repeated and cut to --prompt-tokens")
    p.add_argument("--json", default=None, metavar="FILE",
                   help="also write the rows as JSON; -: on stdout, the table then on stderr (default: none)")
    add_cluster_options(p, max_tokens=32, prompt_tokens=512)
    return p


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # checked now, not after the runs: a JSON file that cannot be written would lose them
    to_stdout = args.json == "-"
    if args.json == "":
        parser.error("--json: give a file name, or - for stdout")
    if args.json and not to_stdout:
        check_output_file(parser, "--json", args.json)
    check_output_dir(parser, "--log-dir", args.log_dir)
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    progress = progress_printer(args.quiet, PROG)

    hosts, rates, delays, codecs = args.hosts, args.rates, args.delays, args.codecs
    try:
        model = default_model(args.model)
        tokenizer = Tokenizer.from_gguf(model)
        n_layer, _ = model_shape(model)
    except (ValueError, OSError) as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return EXIT_FAILURE
    # -c 0: the model's training context, read once; checked now, not in the first run that needs it
    # (after the header, exit 1)
    args.ctx_size, trained = context_size(parser, args.ctx_size, model)
    problem = fit_error(max(hosts), model, n_layer, args.prompt_tokens, args.max_tokens,
                        args.ctx_size or MAX_CTX_SIZE, trained=trained)
    if problem:
        parser.error(problem)
    try:  # cluster's own rule for the prompt, before the header rather than in every run
        prompt_ids(tokenizer, args.prompt, args.prompt_tokens)
    except ValueError as exc:
        parser.error(str(exc))
    try:  # before the header and the first row's line, not as the first run fails
        require_namespace_hosts()
    except NetnsError as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return EXIT_FAILURE
    table = sys.stderr if to_stdout else sys.stdout  # stdout holds the JSON alone
    cpu = cpu_text()
    print(f"machine: {cpu}; Python {platform.python_version()}; model {model.name}; prompt "
          f"{args.prompt_tokens} tokens in {args.chunk_size}-token chunks, {args.max_tokens} new tokens; "
          f"{args.threads or default_threads()} thread(s) per stage", file=table)
    rows: list[dict] = []
    reference = None
    started = time.perf_counter()
    status = 0
    try:
        with exiting_on_signals():  # SIGTERM and SIGHUP clean up like Ctrl-C
            for n in hosts:
                # one host has no link to shape: its rows once, as they run (each rate and delay gave the same row)
                for rate in rates if n > 1 else [format_rate(None)]:
                    for delay in delays if n > 1 else [0.0]:
                        for name in codecs:
                            codec, policy = CODECS[name]
                            opts = ClusterOptions(hosts=n, rate=rate, delay_ms=delay, codec=codec, policy=policy,
                                                  max_tokens=args.max_tokens, chunk_size=args.chunk_size,
                                                  prompt=args.prompt, prompt_tokens=args.prompt_tokens,
                                                  ctx_size=args.ctx_size, threads=args.threads, model=str(model),
                                                  timeout=args.timeout, measure_seconds=args.measure_seconds,
                                                  log_dir=args.log_dir and os.path.join(
                                                      args.log_dir, f"{n}hosts-{rate}-{delay:g}ms-{name}"))
                            progress(f"{n} hosts, {rate}, {delay:g} ms, {name}")
                            res = run_cluster(opts, tokenizer=tokenizer)
                            if reference is None:
                                reference = local_reference(res, tokenizer)
                            rows.append(row_of(res, reference, cpu))
                            progress(json.dumps(rows[-1]))
    except KeyboardInterrupt:  # the rows measured so far are still printed (and written)
        print(f"[{PROG}] interrupted after {len(rows)} rows", file=sys.stderr)
        status = EXIT_INTERRUPTED
    # the rows so far, then exit 1 (an OSError too: a run's --log-dir that cannot be made, a full disk)
    except (NetnsError, TopologyError, PipelineError, ToolError, OSError) as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        status = EXIT_FAILURE
        if not rows:
            return status
    print(markdown(rows), file=table)
    if reference is not None:
        timed = (("prefill", _rate(reference.prefill_tok_s)), ("decode", _rate(reference.decode_tok_s)))
        figures = (f"{name} {rate:.1f} tok/s" for name, rate in timed if rate is not None)
        print(f"\n1 in-process stage (the ratios' reference, measured once after the first row): "
              f"{', '.join(figures) or 'nothing timed'}", file=table)
    print(f"\n{len(rows)} runs in {time.perf_counter() - started:.0f} s", file=table)
    if to_stdout:
        print(json.dumps(rows, indent=1))
    elif args.json:
        try:
            Path(args.json).write_text(json.dumps(rows, indent=1) + "\n")
        except OSError as exc:  # checked at the start; a device or a full disk can still refuse
            print(error_line(file_error(args.json, exc)), file=sys.stderr)
            return EXIT_FAILURE
    return status


__all__ = ["CODECS", "markdown", "row_of", "main"]


if __name__ == "__main__":
    sys.exit(main())
