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
from pathlib import Path

from ..errors import StageRuntimeError, WireError
from ..net.server import DEFAULT_IO_TIMEOUT, DEFAULT_REPLY_TIMEOUT, RuntimeBackend, StageServer
from ..net.protocol_io import DEFAULT_RUN_ID, link_identity, parse_plan
from ..net.transport import parse_address
from ..wire.activation_frame import PROTOCOL_VERSIONS
from ..stage.threads import default_threads
from ..wire.constants import ActivationCodec, CodecPolicy
from ..wire.forwarding import StageConfig

log = logging.getLogger("skippy_wire.tools.serve")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="skippy-wire serve", description="Run one skippy stage process.")
    p.add_argument("--model", required=True, help="GGUF model path")
    p.add_argument("--layer-start", type=int, required=True)
    p.add_argument("--layer-end", type=int, required=True, help="exclusive")
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
    p.add_argument("--protocol", type=int, default=15, choices=PROTOCOL_VERSIONS,
                   help="stage state version spoken on every link (default %(default)s)")
    p.add_argument("--run-id", default=DEFAULT_RUN_ID, help="v17: the run id the setup handshake checks")
    p.add_argument("--plan", default=None, metavar="A-B,B-C,...",
                   help="v17: the layer ranges of every stage (topology id, and the upstream is checked against it)")
    p.add_argument("--model-id", default=None, help="v17: the model id (default: the model file's stem)")
    p.add_argument("--exit-on-stdin-eof", action="store_true",
                   help="exit when stdin closes (the driver holds it open, so stages die with it)")
    p.add_argument("--log-level", default="INFO")
    return p


def _exit_on_stdin_eof() -> None:
    def watch() -> None:
        try:
            while sys.stdin.buffer.read(4096):
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


def _print_event(event: dict) -> None:
    sys.stdout.write(json.dumps(event, sort_keys=True) + "\n")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
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
        config.ctx_size = args.ctx_size
        plan = parse_plan(args.plan) if args.plan else None
        identity = link_identity(config, downstream is not None, run_id=args.run_id,
                                 topology_id=args.plan or DEFAULT_RUN_ID,
                                 model_id=args.model_id or Path(args.model).stem)
        server = StageServer(backend, config, downstream=downstream, host=host, port=port,
                             io_timeout=args.io_timeout, idle_timeout=args.idle_timeout,
                             reply_timeout=args.reply_timeout, capture=args.capture, events=_print_event,
                             protocol=args.protocol, identity=identity, plan=plan)
    except (OSError, ValueError, WireError, ImportError, StageRuntimeError) as exc:
        print(f"skippy-wire serve: cannot start stage {stage_index}: {exc}", file=sys.stderr)
        return 1
    bound_host, bound_port = server.address
    log.info("stage %d: layers %d..%d of %s, state version %d, codec %s, policy %s, %d threads, listening on %s:%d%s",
             stage_index, args.layer_start, args.layer_end, args.model, args.protocol, args.activation_codec,
             args.activation_codec_policy, threads, bound_host, bound_port,
             f", downstream {downstream[0]}:{downstream[1]}" if downstream else " (terminal)")
    _print_event({"event": "listening", "host": bound_host, "port": bound_port, "stage": stage_index,
                  "layer_start": args.layer_start, "layer_end": args.layer_end, "n_embd": backend.n_embd,
                  "protocol": args.protocol})
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
