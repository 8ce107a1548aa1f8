"""State version 16 framing rows for ``skippy-wire bench`` (a ``ROW_PRODUCERS`` module).

The round trip is write + read (the read decodes the activation) of a 1 x 4096 BF16
DecodeEmbd message with a sampling block, as in :mod:`skippy_wire.tools.frame_bench`:
v15 with its flat activation, v16 with a one-part frame and with a three-part frame
(F32 4096 + BF16 64 + I32 1 per token).  The goal of the issue: the one-part v16 round
trip runs at >= 0.9x the v15 rate measured in the same run (the two timed alternately).

``python -m skippy_wire.tools.bench_gen`` prints the rows on their own.
"""

from __future__ import annotations

import argparse
import sys
from typing import Iterable, Union

import numpy as np

from .. import _impl
from ..wire.activation_frame import ActivationFrameV16, ActivationPartV16, GgmlType
from ..wire.constants import ActivationCodec
from ..wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind
from ..wire.protocol import WireProtocol
from .bench_rows import Ratio, Row, add_timing_options, cpu_text, paired_seconds
from .cli import guarded
from .options import Parser, doc_summary

V16_GOAL_RATIO = 0.9
N_EMBD = 4096
BF16 = ActivationCodec.BF16_RNE_V1


def _message(activation: bytes, version: int) -> StageWireMessage:
    state = StageStateHeader.new(WireMessageKind.DECODE_EMBD)
    state.version = version
    state.source_stage_index, state.activation_codec = 1, BF16
    state.prompt_token_count, state.decode_step, state.current_token = 17, 3, 11
    sampling = SamplingConfig(flags=1, seed=42, temperature=0.8, top_p=0.9, top_k=40)
    return StageWireMessage(WireMessageKind.DECODE_EMBD, 20, 1, state, 7, 11, sampling, None, [11], [], activation)


def frames(impl: str) -> dict:
    """``{"v15": msg, "v16 1 part": msg, "v16 3 parts": msg}``: the benchmark messages."""
    rng = np.random.default_rng(16)
    values = rng.standard_normal(N_EMBD).astype("<f4")
    codec = _impl.kernel_module("codec", impl)
    v15 = _message(codec.encode_activation(int(BF16), 1, N_EMBD, values.tobytes(), 0), 15)
    p16 = WireProtocol(16, impl=impl)
    one = ActivationFrameV16.of_parts([ActivationPartV16.dense(b"\x01" * 32, GgmlType.F32, (N_EMBD, 1), 1)],
                                      token_count=1, producer_stage_index=1)
    three = ActivationFrameV16.of_parts([
        ActivationPartV16.dense(b"\x01" * 32, GgmlType.F32, (N_EMBD, 1), 1),
        ActivationPartV16.dense(b"\x02" * 32, GgmlType.BF16, (64, 1), 1),
        ActivationPartV16.dense(b"\x03" * 32, GgmlType.I32, (1,), 0, optional=True),
    ], token_count=1, producer_stage_index=1)
    extra = rng.integers(0, 1 << 14, 64, dtype="<u2").tobytes() + np.int32(5).tobytes()
    return {
        "v15": (WireProtocol(15, impl=impl), v15),
        "v16 1 part": (p16, _message(p16.encode_frame(BF16, one, values.tobytes()), 16)),
        "v16 3 parts": (p16, _message(p16.encode_frame(BF16, three, values.tobytes() + extra), 16)),
    }


def _round_trip(protocol: WireProtocol, msg: StageWireMessage):
    def run() -> None:
        protocol.read_from_buffer(protocol.write(msg), N_EMBD, BF16)
    return run


def frame_gen_rows(opts: argparse.Namespace) -> Iterable[Union[Row, Ratio]]:
    impl = getattr(opts, "impl", None) or _impl.IMPLEMENTATION
    repeat = getattr(opts, "repeat", 5)
    min_time = getattr(opts, "min_time", 0.2)
    cases = frames(impl)
    base = _round_trip(*cases["v15"])
    nbytes = 4 * N_EMBD
    reference = None  # v15 as timed beside the v16 1-part round trip: the goal's, and the table's row
    for label in ("v16 1 part", "v16 3 parts"):
        ours, theirs = paired_seconds(_round_trip(*cases[label]), base, repeat, min_time)
        yield Row(f"round trip {label} (bf16)", "1x4096", impl, ours, nbytes)
        if label == "v16 1 part":
            reference = theirs
            yield Ratio("v16 1-part BF16 round trip vs v15 @1x4096", theirs / ours, V16_GOAL_RATIO,
                        f"{1 / ours:,.0f}/s vs {1 / theirs:,.0f}/s")
    yield Row("round trip v15 (bf16)", "1x4096", impl, reference, nbytes)


ROW_PRODUCERS = [frame_gen_rows]


def main(argv=None) -> int:
    parser = Parser(prog="python -m skippy_wire.tools.bench_gen", description=doc_summary(__doc__))
    parser.add_argument("--impl", choices=_impl.IMPLEMENTATIONS, default=None,
                        help="kernels measured (default: the live ones)")
    add_timing_options(parser, 0.2)
    opts = parser.parse_args(argv)
    print(f"machine: {cpu_text()}; kernels {opts.impl or _impl.IMPLEMENTATION}")
    for item in frame_gen_rows(opts):
        if isinstance(item, Row):
            print(f"{item.op:28s} {item.size:8s} {item.impl:7s} {1 / item.seconds:12,.0f}/s")
        else:  # status 0 whatever the goal, as `skippy-wire bench`
            print(f"goal {item.goal}: {item.ratio:.2f}x (target {item.target}x) {'met' if item.met else 'NOT MET'}"
                  f" {item.detail}")
    return 0


if __name__ == "__main__":
    sys.exit(guarded(main))
