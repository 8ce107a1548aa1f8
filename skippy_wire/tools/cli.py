"""The ``skippy-wire`` command (also ``python -m skippy_wire``).

Each subcommand lives in the module of its concept and exposes ``main(argv) -> int``;
this file only dispatches, importing the module on demand so that one command never
pays for another's imports.
"""

from __future__ import annotations

import importlib
import sys

COMMANDS = {
    "run": ("skippy_wire.tools.run", "generate text through a pipeline of stage processes (the main job)"),
    "serve": ("skippy_wire.tools.serve", "run one stage process"),
    "cluster": ("skippy_wire.tools.cluster", "run a pipeline over network-namespace hosts with shaped links (root)"),
    "bench-cluster": ("skippy_wire.tools.cluster_bench", "prefill/decode over namespace hosts per link rate, delay, codec"),
    "api": ("skippy_wire.tools.api", "serve an OpenAI-compatible HTTP API from a pipeline of stage processes"),
    "inspect": ("skippy_wire.tools.inspect", "dissect a byte stream of stage messages and replies"),
    "conformance": ("skippy_wire.tools.conformance", "run golden-vector files (*.jsonl) against an implementation"),
    "bench": ("skippy_wire.tools.bench", "measure codec and framing throughput against reference encoders"),
    "bench-backend": ("skippy_wire.tools.backend_bench", "stage backend prefill/decode side by side with llama.cpp"),
    "verify-exhaustive": ("skippy_wire.tools.verify", "check every f32 bit pattern through the compiled encoders"),
    "demo": ("skippy_wire.tools.demo", "encode a realistic activation through every codec"),
}
VERSION_MODULE = "skippy_wire.tools.backend_bench"


def usage() -> str:
    width = max(map(len, COMMANDS))
    lines = ["usage: skippy-wire COMMAND [ARGS...]", "", "commands:"]
    lines += [f"  {name.ljust(width)}  {help_}" for name, (_, help_) in COMMANDS.items()]
    lines.append("\nWith no command, `run` is used.  --version: the package and the live ggml build.")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if args and args[0] in ("-h", "--help", "help"):
        print(usage())
        return 0
    if args[:1] == ["--version"]:
        print(importlib.import_module(VERSION_MODULE).version_line())
        return 0
    # `skippy-wire "a prompt"` and `skippy-wire --max-tokens 8` both mean `run`.
    command = args.pop(0) if args and args[0] in COMMANDS else "run"
    module = importlib.import_module(COMMANDS[command][0])
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
