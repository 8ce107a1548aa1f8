"""``skippy-wire serve``: run one stage process (a :class:`skippy_wire.net.server.StageServer`).

Events.  One JSON object per line on stdout: ``{"event": "listening", "host": ..., "port":
...}`` once the socket is bound (the driver waits for it), and ``{"event": "session", ...}``
with per-session traffic counters when a session stops.  Logs go to stderr.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading

from ..errors import StageRuntimeError, TopologyError, WireError
from ..net.server import DEFAULT_IO_TIMEOUT, DEFAULT_REPLY_TIMEOUT, RuntimeBackend, StageServer
from ..net.topology import load_topology
from ..net.transport import parse_address
from ..stage.threads import default_threads
from ..wire.constants import ActivationCodec, CodecPolicy
from ..wire.forwarding import StageConfig

log = logging.getLogger("skippy_wire.tools.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skippy-wire serve", description="Run one skippy stage process.")
    p.add_argument("--model", default=None, help="GGUF model path (required without --topology)")
    p.add_argument("--layer-start", type=int, default=None, help="required without --topology")
    p.add_argument("--layer-end", type=int, default=None, help="exclusive; required without --topology")
    p.add_argument("--topology", default=None, metavar="FILE",
                   help="topology file (docs/pipeline.md): with --stage K, it gives the model, layers, listen "
                        "address, downstream, codec, policy and threads (--model overrides its model path)")
    p.add_argument("--stage", type=int, default=None, metavar="K", help="the stage of --topology to run")
    p.add_argument("--link-delay-ms", type=float, default=0.0,
                   help="sleep this long before every send over a stage-to-stage link (emulated one-way "
                        "link delay: downstream sends, and replies upstream on stages after the first)")
    p.add_argument("--stage-index", type=int, default=None, help="default: 0 for layer_start 0, else required")
    p.add_argument("--listen", default="127.0.0.1:0", help="HOST:PORT to bind (port 0: any free port)")
    p.add_argument("--downstream", default=None, help="HOST:PORT of the next stage (omit on the last stage)")
    p.add_argument("--activation-codec", default="raw-f32-v1",
                   choices=[c.identity() for c in ActivationCodec])
    p.add_argument("--activation-codec-policy", default="fixed", choices=[policy.serde_name for policy in CodecPolicy])
    p.add_argument("--ctx-size", type=int, default=512)
    p.add_argument("--threads", type=int, default=None, help="compute threads (default: 1, see default_threads)")
    p.add_argument("--io-timeout", type=float, default=DEFAULT_IO_TIMEOUT,
                   help="seconds a peer may stall inside a message (default %(default)s)")
    p.add_argument("--idle-timeout", type=float, default=None,
                   help="seconds a connection may sit idle between messages (default: forever)")
    p.add_argument("--reply-timeout", type=float, default=DEFAULT_REPLY_TIMEOUT,
                   help="seconds to wait for the downstream reply (default %(default)s)")
    p.add_argument("--capture", default=None,
                   help="path prefix: record the downstream hop to PREFIX-messages.bin / PREFIX-replies.bin")
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="exit when stdin closes (the driver holds it open, so stages die with it)")
    p.add_argument("--log-level", default="INFO")
    return p


def _exit_on_stdin_eof() -> None:
    def watch() -> None:
        try:
            # The raw descriptor: a daemon thread blocked in the buffered reader would hold its
            # lock at interpreter shutdown and turn a clean exit into a fatal error.
            while os.read(sys.stdin.fileno(), 4096):
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


def _apply_topology(args) -> None:
    """Fill the stage options from ``--topology FILE --stage K`` (validated as a whole first)."""
    topology = load_topology(args.topology, model=args.model)
    stage = topology.stage(args.stage)
    downstream = topology.downstream(args.stage)
    args.model = str(topology.model_path)
    args.layer_start, args.layer_end, args.stage_index = stage.layer_start, stage.layer_end, stage.index
    args.listen = stage.bind_addr
    args.downstream = f"{downstream[0]}:{downstream[1]}" if downstream else None
    args.activation_codec, args.activation_codec_policy = stage.activation_codec, stage.activation_codec_policy
    args.threads = stage.threads or args.threads
    args.ctx_size = topology.ctx_size


def _print_event(event: dict) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if (args.topology is None) != (args.stage is None):
        parser.error("--topology and --stage go together")
    if args.topology is not None:
        try:
            _apply_topology(args)
        except TopologyError as exc:
            print(f"skippy-wire serve: {exc}", file=sys.stderr)
            return 2
    elif args.model is None or args.layer_start is None or args.layer_end is None:
        parser.error("--model, --layer-start and --layer-end are required without --topology")
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s stage[%(process)d] %(levelname)s %(message)s")
    if args.exit_on_stdin_eof:
        _exit_on_stdin_eof()
    stage_index = args.stage_index
    if stage_index is None:
        if args.layer_start != 0:
            print("skippy-wire serve: --stage-index is required when --layer-start > 0", file=sys.stderr)
            return 2
        stage_index = 0
    try:
        host, port = parse_address(args.listen)
        downstream = parse_address(args.downstream) if args.downstream else None
        config = stage_config(stage_index, args.layer_start, args.layer_end,
                              args.activation_codec, args.activation_codec_policy)
        threads = args.threads or default_threads()
        backend = RuntimeBackend.open(args.model, args.layer_start, args.layer_end, stage_index=stage_index,
                                      ctx_size=args.ctx_size, n_threads=threads)
        server = StageServer(backend, config, downstream=downstream, host=host, port=port,
                             io_timeout=args.io_timeout, idle_timeout=args.idle_timeout,
                             reply_timeout=args.reply_timeout, capture=args.capture, events=_print_event,
                             link_delay=args.link_delay_ms / 1000.0)
    except (OSError, ValueError, WireError, ImportError, StageRuntimeError) as exc:
        print(f"skippy-wire serve: cannot start stage {stage_index}: {exc}", file=sys.stderr)
        return 1
    bound_host, bound_port = server.address
    log.info("stage %d: layers %d..%d of %s, codec %s, policy %s, %d threads, listening on %s:%d%s",
             stage_index, args.layer_start, args.layer_end, args.model, args.activation_codec,
             args.activation_codec_policy, threads, bound_host, bound_port,
             f", downstream {downstream[0]}:{downstream[1]}" if downstream else " (terminal)")
    _print_event({"event": "listening", "host": bound_host, "port": bound_port, "stage": stage_index,
                  "layer_start": args.layer_start, "layer_end": args.layer_end, "n_embd": backend.n_embd})
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
