"""``skippy-wire serve``: run one stage process (a :class:`skippy_wire.net.server.StageServer`).

Events.  One JSON object per line on stdout: ``{"event": "listening", "host": ..., "port":
...}`` once the socket is bound (the driver waits for it), ``{"event": "error", "message":
...}`` when the stage cannot start (the one-line reason the driver quotes; the same line
goes to stderr), and ``{"event": "session", ...}`` with per-session traffic counters when a
session stops.  Logs go to stderr.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import logging
import os
import signal
import sys
import threading
from pathlib import Path

from ..errors import StageRuntimeError, TopologyError, WireError
from ..net.admission import (DEFAULT_IDLE_TIMEOUT, DEFAULT_LANE_WAIT, DEFAULT_MAX_CONNECTIONS,
                             DEFAULT_MAX_SESSIONS_PER_CONNECTION, DEFAULT_MESSAGE_TIMEOUT, StageLimits)
from ..net.backend import DEFAULT_LANES, RuntimeBackend
from ..net.connlog import LogBudget
from ..net.server import DEFAULT_IO_TIMEOUT, DEFAULT_REPLY_TIMEOUT, StageServer
from ..net.protocol_io import DEFAULT_RUN_ID, link_identity, parse_plan
from ..net.topology import load_topology
from ..net.transport import DiagnosticFile, names_listener, parse_address
from ..wire.activation_frame import PROTOCOL_VERSIONS
from ..stage.models import default_model_id, model_shape
from ..stage.runtime import MAX_LANES
from ..stage.threads import default_threads, oversubscription
from ..wire.constants import STAGE_WIRE_FIXED_HEADER_BYTES, ActivationCodec, CodecPolicy
from ..wire.forwarding import DEFAULT_CTX_SIZE, StageConfig
from .cli import quiet_stdout
from .options import (EXIT_FAILURE, EXIT_INTERRUPTED, MAX_CTX_SIZE, TRAINING_CONTEXT, Parser, add_codec_options,
                      add_gpu_layers_option, address, check_codec_options, describe, error_line,
                      given_path, int_at_least, int_between, milliseconds, model_file, seconds, thread_count,
                      training_context_size, utf8)
from .poll_options import add_poll_option
from .signals import exiting_on_signals
from .tls_options import add_tls_options, tls_config

log = logging.getLogger("skippy_wire.tools.serve")


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="skippy-wire serve", description="Run one skippy stage process.")
    p.add_argument("-m", "--model", default=None, type=model_file, help="GGUF model path (required without --topology)")
    p.add_argument("--layer-start", type=int_at_least(0), default=None, help="first layer (required without --topology)")
    p.add_argument("--layer-end", type=int_at_least(1), default=None, help="exclusive (required without --topology)")
    p.add_argument("--topology", default=None, type=given_path, metavar="FILE",
                   help="topology file (docs/pipeline.md): with --stage K, it gives the model, layers, stage "
                        "index, listen address, downstream, codec, policy, ctx_size and threads, over "
                        "--layer-start, --layer-end, --stage-index, --listen, --downstream, the codec options "
                        "and --ctx-size (--threads counts only where the stage has no threads; --model "
                        "overrides its model path; default: none, the options give them)")
    p.add_argument("--stage", type=int_at_least(0), default=None, metavar="K",
                   help="the stage of --topology to run (required with --topology; default: none)")
    p.add_argument("--link-delay-ms", type=milliseconds, default=0.0,
                   help="sleep this long before every send over a stage-to-stage link (emulated one-way "
                        "link delay: downstream sends, and replies upstream on stages after the first)")
    p.add_argument("--stage-index", type=int_at_least(0), default=None,
                   help="this stage's place in the pipeline: 0 (the default) for --layer-start 0; a stage that "
                        "starts at a later layer must give it, 1 or more")
    p.add_argument("--listen", default="127.0.0.1:0", type=address,
                   help="HOST:PORT to bind (port 0: any free port)")
    p.add_argument("--downstream", default=None, type=address,
                   help="HOST:PORT of the next stage (default: none, the last stage)")
    add_codec_options(p, "the forwarded activations")
    p.add_argument("-c", "--ctx-size", type=int_between(TRAINING_CONTEXT, MAX_CTX_SIZE), default=DEFAULT_CTX_SIZE,
                   help=f"context (tokens; {TRAINING_CONTEXT}: the model's training context, as in llama-server)")
    p.add_argument("-t", "--threads", type=thread_count, default=None,
                   help=f"compute threads (default: {default_threads()}; -1: the default; ggml threads spin, "
                        "see docs/pipeline.md)")
    add_gpu_layers_option(p)
    p.add_argument("--io-timeout", type=seconds(), default=DEFAULT_IO_TIMEOUT,
                   help="seconds a peer may stall inside a message or in reading a reply")
    p.add_argument("--idle-timeout", type=seconds(), default=DEFAULT_IDLE_TIMEOUT,
                   help="seconds a connection may sit idle between messages (closed, its sessions freed), or a "
                        "session may compute nothing (freed; the connection closed when all its sessions are idle)")
    add_admission_options(p)
    p.add_argument("--reply-timeout", type=seconds(), default=DEFAULT_REPLY_TIMEOUT,
                   help="seconds to wait for the downstream reply")
    p.add_argument("--capture", default=None, type=given_path, metavar="PREFIX",
                   help="path prefix: record the downstream hop to PREFIX-messages.bin / PREFIX-replies.bin "
                        "(its directory must exist; default: none)")
    p.add_argument("--protocol", type=int, default=15, choices=PROTOCOL_VERSIONS,
                   help="stage state version spoken on every link")
    p.add_argument("--run-id", default=DEFAULT_RUN_ID, help="v17: the run id the setup handshake checks")
    p.add_argument("--plan", default=None, metavar="A-B,B-C,...",
                   help="v17: the layer ranges of every stage, from layer 0 without gaps, this stage's own among "
                        "them (the upstream is checked against it; also the topology id without --topology; "
                        "default: --topology's ranges, else none)")
    p.set_defaults(topology_id=None)  # v17: a --topology file's id, else --plan's text
    p.add_argument("--model-id", default=None, type=utf8,
                   help="v17: the model id, the same on every stage (default: --topology's model_id, else the "
                        "model file's stem: give it where hosts name the model's file differently)")
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="exit when stdin closes (the driver holds it open, so stages die with it; default: off)")
    p.add_argument("--no-prefill-overlap", dest="prefill_overlap", action="store_false",
                   help="wait for the downstream's Ack of every PrefillEmbd before acknowledging it "
                        "(default: acknowledge at once, so consecutive chunks overlap across stages)")
    p.add_argument("--no-decode-ahead", dest="decode_ahead", action="store_false",
                   help="first stage: compute each decode step only when its message arrives (default: a "
                        "session's next step is computed while its reply travels to the driver and back)")
    p.add_argument("--trace-compute", default=None, type=given_path, metavar="DIR",
                   help="append one 'START_NS END_NS ROWS' line per stretch of compute (the steps it ran "
                        "together) to DIR/stageK.trace (monotonic clock; the serving benchmark measures "
                        "overlap and batch sizes with it; default: off)")
    p.add_argument("--log-level", default="INFO", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"], help="stderr log level")
    return p


def add_admission_options(p: argparse.ArgumentParser) -> None:
    """The limits of what a stage admits from its peers (docs/security.md)."""
    p.add_argument("--message-timeout", type=seconds(), default=DEFAULT_MESSAGE_TIMEOUT,
                   help="seconds a whole message may take to arrive after its first byte")
    p.add_argument("--max-connections", type=int_at_least(1), default=DEFAULT_MAX_CONNECTIONS,
                   help="connections served at once; a new one beyond them closes the one quiet longest "
                        "(no session, no message being executed), else it is refused")
    p.add_argument("--max-sessions-per-connection", type=int_at_least(1),
                   default=DEFAULT_MAX_SESSIONS_PER_CONNECTION, help="sessions one connection may hold at once")
    p.add_argument("-np", "--parallel", dest="lanes", type=int_between(1, MAX_LANES), default=DEFAULT_LANES,
                   help=f"lanes: sessions computed at once, 1 to {MAX_LANES}, each with its own KV cache (made "
                        "when it opens), as llama-server's -np")
    p.add_argument("--lane-wait", type=seconds(zero=True), default=DEFAULT_LANE_WAIT,
                   help="seconds a new session waits (first come, first served) when all lanes are busy")
    # below the smallest stage message (a Stop's fixed header), every message was refused
    p.add_argument("--max-message-bytes", type=int_at_least(STAGE_WIRE_FIXED_HEADER_BYTES), default=None,
                   help=f"largest stage message accepted, at least {STAGE_WIRE_FIXED_HEADER_BYTES} (default: derived "
                        "from --ctx-size and the model width)")
    add_tls_options(p, "the listener and the downstream connection")
    add_poll_option(p)


def _exit_on_stdin_eof() -> None:
    # os.read on the descriptor, not sys.stdin.buffer: a daemon thread blocked inside the
    # buffered reader holds its lock, and the interpreter then aborts at shutdown ("Fatal
    # Python error: _enter_buffered_busy"), turning a clean exit into status -6.
    fd = None if sys.stdin is None else sys.stdin.fileno()  # None: closed before the start (<&-), at its end

    def watch() -> None:
        try:
            while fd is not None and os.read(fd, 4096):
                pass
        finally:
            log.info("stdin closed: the parent is gone, exiting")
            os._exit(0)

    threading.Thread(target=watch, name="stdin-watch", daemon=True).start()


def stage_config(stage_index: int, layer_start: int, layer_end: int, codec: str, policy: str) -> StageConfig:
    """A forwarding StageConfig from the CLI identities (e.g. "bf16-rne-v1", "fixed")."""
    return StageConfig(stage_index=stage_index, layer_start=layer_start, layer_end=layer_end,
                       activation_codec=ActivationCodec.from_identity(codec),
                       activation_codec_policy=CodecPolicy.from_serde_name(policy))


def _apply_topology(parser: argparse.ArgumentParser, args) -> None:
    """Fill the stage options from ``--topology FILE --stage K`` (validated as a whole first,
    its values within the command line's bounds: :func:`~skippy_wire.net.topology.load_topology`)."""
    try:
        topology = load_topology(args.topology, model=args.model)
        stage = topology.stage(args.stage)
    except TopologyError as exc:
        parser.error(str(exc))
    downstream = topology.downstream(args.stage)
    args.model = str(topology.model_path)
    args.model_id = args.model_id or topology.model_id  # v17: one id where hosts name the file apart
    args.layer_start, args.layer_end, args.stage_index = stage.layer_start, stage.layer_end, stage.index
    args.listen = parse_address(stage.bind_addr)
    args.downstream = downstream
    args.activation_codec, args.activation_codec_policy = stage.activation_codec, stage.activation_codec_policy
    args.threads = stage.threads or args.threads
    args.ctx_size = topology.ctx_size
    # v17: stages from one file share its id, and its layer ranges are the plan they check
    args.topology_id = topology.topology_id
    args.plan = args.plan or ",".join(f"{s.layer_start}-{s.layer_end}" for s in topology.stages)


def _print_event(event: dict, sessions: LogBudget | None = None) -> None:
    """``event`` as a line of stdout; a "session" one within ``sessions``' budget, as log
    lines: a peer opening and stopping sessions in a loop printed some 1,800 a second on
    every stage of the chain.  The first one printed after some were not says how many."""
    if sessions is not None and event.get("event") == "session":
        held = sessions.admit(logging.INFO)
        if held is None:
            return
        if held:
            event = {**event, "session_events_dropped": held}
    try:
        sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
        sys.stdout.flush()
    except BrokenPipeError:  # the reader left (`serve | head -1`): the stage serves on without its events
        quiet_stdout()
        log.warning("stdout is closed: session events are no longer printed")


def _check_output_dir(parser: argparse.ArgumentParser, option: str, directory: str) -> None:
    """A directory the stage writes into exists and is writable before it starts: else the
    stage would start, then fail at every connection (--capture) or compute (--trace-compute)."""
    if not os.path.exists(directory):
        parser.error(f"{option}: directory {directory} does not exist")
    if not os.path.isdir(directory):
        parser.error(f"{option}: {directory} is not a directory")
    if not os.access(directory, os.W_OK | os.X_OK):
        parser.error(f"{option}: directory {directory} is not writable")


def _check_args(parser: argparse.ArgumentParser, args) -> None:
    """Every check that needs no model: usage errors (status 2) before anything starts."""
    if (args.topology is None) != (args.stage is None):
        parser.error("--topology and --stage go together")
    if args.topology is not None:
        _apply_topology(parser, args)
    elif args.model is None or args.layer_start is None or args.layer_end is None:
        parser.error("--model, --layer-start and --layer-end are required without --topology")
    else:
        check_codec_options(parser, args)  # a topology file's stages were checked as it loaded
    if args.layer_end <= args.layer_start:
        parser.error(f"--layer-end {args.layer_end} must be greater than --layer-start {args.layer_start}")
    if args.downstream is not None and args.downstream[1] == 0:
        parser.error("--downstream: port 0 names no stage (give the port the next stage listens on)")
    if args.downstream is not None and names_listener(args.downstream, args.listen):
        parser.error(f"--downstream {args.downstream[0]}:{args.downstream[1]} is this stage's own --listen address "
                     "(it would connect to itself); give the next stage's address")
    if args.stage_index is None:
        if args.layer_start != 0:
            parser.error("--stage-index is required when --layer-start > 0: give this stage's place in the pipeline "
                             "(1 for the stage after stage 0, and so on)")
        args.stage_index = 0
    elif (args.stage_index == 0) != (args.layer_start == 0):  # v17's setup then refused every link
        parser.error(f"--stage-index {args.stage_index} with --layer-start {args.layer_start}: stage 0, "
                     "and only stage 0, starts at layer 0")
    if args.plan:
        _check_plan(parser, args)
    if args.capture:
        # PREFIX-messages.bin: the directory is the text before the last slash, as written.
        _check_output_dir(parser, "--capture", os.path.dirname(args.capture) or os.curdir)
    if args.trace_compute:
        _check_output_dir(parser, "--trace-compute", args.trace_compute)
    try:
        args.tls = tls_config(args, listens=True, connects=args.downstream is not None)
    except ValueError as exc:
        parser.error(str(exc))


def _check_plan(parser: argparse.ArgumentParser, args) -> None:
    """``--plan`` (or the topology file's) must parse, follow on from layer 0 without gaps,
    and give this stage its own layers: else every upstream's setup fails against it."""
    try:
        plan = parse_plan(args.plan)
    except ValueError as exc:
        parser.error(f"--plan: {exc}")
    ends = [0] + [stage.layer_end for stage in plan]
    for stage, start in zip(plan, ends):
        if stage.layer_end <= stage.layer_start:
            parser.error(f"--plan {args.plan}: stage {stage.stage_index}'s layers {stage.layer_start}-"
                         f"{stage.layer_end} are empty")
        if stage.layer_start != start:
            where = "where the stage before it ends" if stage.stage_index else "where a model's layers begin"
            parser.error(f"--plan {args.plan}: stage {stage.stage_index} starts at layer {stage.layer_start}, "
                         f"not at layer {start} {where}")
    mine = next((stage for stage in plan if stage.stage_index == args.stage_index), None)
    if mine is None or (mine.layer_start, mine.layer_end) != (args.layer_start, args.layer_end):
        parser.error(f"--plan {args.plan} does not give stage {args.stage_index} its layers "
                     f"{args.layer_start}-{args.layer_end}")


def _cannot_start(stage_index: int, reason: str) -> int:
    """Report why the stage cannot start: an "error" event (quoted by the driver) and stderr."""
    message = f"stage {stage_index} cannot start: {reason}"
    print(error_line(message), file=sys.stderr, flush=True)  # first: the driver stops us on the event
    _print_event({"event": "error", "stage": stage_index, "message": message})
    return EXIT_FAILURE


def main(argv: list[str] | None = None) -> int:
    bound_malloc_arenas()  # before any thread allocates
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    try:  # a model that cannot be read: as when it is loaded, the stage cannot start
        n_layer, _ = model_shape(Path(args.model))
        if args.ctx_size == TRAINING_CONTEXT:
            args.ctx_size = training_context_size(parser, Path(args.model))
    except (OSError, ValueError) as exc:
        return _cannot_start(args.stage_index, describe(exc))
    if args.downstream is None and args.layer_end < n_layer:  # found before the layers load
        parser.error(f"stage {args.stage_index} ends at layer {args.layer_end} of {n_layer}, so it needs "
                     "--downstream (the next stage's HOST:PORT)")
    if args.layer_end > n_layer:
        parser.error(f"--layer-end {args.layer_end} is beyond the model's {n_layer} layers")
    if args.downstream is not None and args.layer_end == n_layer:
        parser.error(f"stage {args.stage_index} ends at the model's last layer ({n_layer}), so it is the terminal "
                     "stage and takes no --downstream")
    logging.basicConfig(level=args.log_level, stream=sys.stderr,
                        format="%(asctime)s stage[%(process)d] %(levelname)s %(message)s")
    if args.exit_on_stdin_eof:
        _exit_on_stdin_eof()
    # SIGTERM (143) and SIGHUP (129) end the stage like Ctrl-C (130).
    with exiting_on_signals():
        try:
            return _serve(args, args.stage_index)
        except KeyboardInterrupt:
            return EXIT_INTERRUPTED


#: glibc malloc arenas a stage process keeps at most (``mallopt(M_ARENA_MAX)``) unless the
#: user sets MALLOC_ARENA_MAX: freed session memory stays in the arena of the thread that
#: held it, and floods of connections (a thread each) took a stage from 112 to 800 MB
#: resident; with two arenas it stayed near 260 MB.
MALLOC_ARENAS = 2
_M_ARENA_MAX = -8  # glibc's malloc.h


def bound_malloc_arenas() -> bool:
    """Apply :data:`MALLOC_ARENAS` (glibc only); whether it was applied."""
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        return bool(ctypes.CDLL(None).mallopt(_M_ARENA_MAX, MALLOC_ARENAS))  # the C library this process runs on
    except (OSError, AttributeError):  # not glibc: its own allocator, its own policy
        return False


def _serve(args, stage_index: int) -> int:
    host, port = args.listen
    downstream = args.downstream
    tls = args.tls
    try:
        if tls is not None:
            tls.server_context()  # unreadable or mismatched files fail here, with their reason
    except OSError as exc:
        return _cannot_start(stage_index, f"TLS: {describe(exc)}")
    limits = StageLimits(message_timeout=args.message_timeout, max_connections=args.max_connections,
                         max_sessions_per_connection=args.max_sessions_per_connection, lane_wait=args.lane_wait,
                         max_message_bytes=args.max_message_bytes)
    threads = args.threads or default_threads()
    if oversubscription(threads):
        log.warning("stage %d: -t %d: %s", stage_index, threads, oversubscription(threads))
    config = stage_config(stage_index, args.layer_start, args.layer_end,
                          args.activation_codec, args.activation_codec_policy)
    try:
        backend = RuntimeBackend.open(args.model, args.layer_start, args.layer_end, stage_index=stage_index,
                                      ctx_size=args.ctx_size, n_threads=threads, lane_count=args.lanes)
    except (OSError, ValueError, OverflowError, WireError, ImportError, StageRuntimeError) as exc:
        return _cannot_start(stage_index, describe(exc))
    trace_path = os.path.join(args.trace_compute, f"stage{stage_index}.trace") if args.trace_compute else None
    try:
        trace = DiagnosticFile(trace_path, "--trace-compute", "a") if trace_path else None
    except OSError as exc:  # checked at start-up, but e.g. DIR/stageK.trace may be a directory
        return _cannot_start(stage_index, f"--trace-compute: {describe(exc)}")
    try:
        config.ctx_size = args.ctx_size
        plan = parse_plan(args.plan) if args.plan else None
        identity = link_identity(config, downstream is not None, run_id=args.run_id,
                                 topology_id=args.topology_id or args.plan or DEFAULT_RUN_ID,
                                 model_id=args.model_id or default_model_id(args.model))
        session_events = LogBudget()

        def events(event: dict) -> None:
            _print_event(event, session_events)

        server = StageServer(backend, config, downstream=downstream, host=host, port=port,
                             io_timeout=args.io_timeout, idle_timeout=args.idle_timeout,
                             reply_timeout=args.reply_timeout, capture=args.capture, events=events,
                             compute_trace=trace, protocol=args.protocol, identity=identity, plan=plan,
                             link_delay=args.link_delay_ms / 1000.0, prefill_overlap=args.prefill_overlap,
                             decode_ahead=args.decode_ahead,
                             limits=limits, tls=tls, poll_s=args.poll_ms / 1000.0)
    except OSError as exc:  # describe drops the address socket.create_server appends again
        return _cannot_start(stage_index, f"cannot listen on {host}:{port}: {describe(exc)}")
    except (ValueError, WireError, StageRuntimeError) as exc:
        return _cannot_start(stage_index, describe(exc))
    bound_host, bound_port = server.address
    log.info("stage %d: layers %d..%d of %s, state version %d, codec %s, policy %s, %d thread%s, listening on "
             "%s:%d%s", stage_index, args.layer_start, args.layer_end, args.model, args.protocol,
             args.activation_codec, args.activation_codec_policy, threads, "" if threads == 1 else "s",
             bound_host, bound_port,
             f", downstream {downstream[0]}:{downstream[1]}" if downstream else " (terminal)")
    log.info("stage %d: %d lanes, at most %d connections, %d sessions each, lane wait %g s, messages up to %d "
             "bytes within %g s, idle timeout %g s, %s", stage_index, args.lanes, limits.max_connections,
             limits.max_sessions_per_connection, limits.lane_wait, server.max_message_bytes, limits.message_timeout,
             args.idle_timeout, "mutual TLS" if tls else "plain TCP")
    _print_event({"event": "listening", "host": bound_host, "port": bound_port, "stage": stage_index,
                  "layer_start": args.layer_start, "layer_end": args.layer_end, "n_embd": backend.n_embd,
                  "protocol": args.protocol})
    try:
        server.serve_forever()
    except (KeyboardInterrupt, SystemExit) as exc:  # the stage before it logs the closed link: say why
        code = EXIT_INTERRUPTED if isinstance(exc, KeyboardInterrupt) else exc.code
        try:
            how = signal.Signals(code - 128).name
        except (TypeError, ValueError):  # not a signal's (128 + N)
            how = "exit" if code is None else f"exit {code}"
        log.info("stage %d: stopping on %s; %d session(s) open are cut off", stage_index, how,
                 server.admission.lanes.busy)
        raise
    return 0


if __name__ == "__main__":
    sys.exit(main())
