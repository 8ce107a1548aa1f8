"""Framing throughput rows for ``skippy-wire bench`` (issue #3, framing part).

``rows()`` measures the compiled framing against the pure-Python twin and returns one dict
per operation::

    {"op", "size", "unit", "ours", "reference", "ratio", "goal", "met"}

``ours``/``reference`` are operations per second (best of several rounds, timed alternately);
``ratio`` = ours / reference; ``goal`` states the target and ``met`` whether it holds
(``None`` for informational rows).  The headline row is the write + read round trip of a
1 x 4096 BF16 DecodeEmbd message with a sampling block: goal >= 150,000/s and >= 10x the
twin.
"""

from __future__ import annotations

from typing import Callable, Optional

import numpy as np

from .. import _impl
from ..wire.constants import ActivationCodec
from ..wire.frame import StageMessageDecoder
from ..wire.messages import SamplingConfig, StageStateHeader, StageWireMessage, WireMessageKind
from .bench_rows import Ratio, Row, add_timing_options, cpu_text, paired_seconds
from .cli import guarded
from .options import Parser, doc_summary

ROUND_TRIP_GOAL_OPS = 150_000
ROUND_TRIP_GOAL_RATIO = 10.0
N_EMBD = 4096
#: What the goal against the twin measures when the twin is the live implementation.
TWIN_ITSELF = "the live kernels are the twin: it is timed against itself"


def decode_message(n_embd: int = N_EMBD) -> StageWireMessage:
    """The benchmark message: DecodeEmbd, one token, BF16 activation, a sampling block."""
    codec = _impl.kernel_module("codec", "python")  # any implementation gives the same bytes
    values = np.random.default_rng(15).standard_normal(n_embd).astype("<f4")
    state = StageStateHeader.new(WireMessageKind.DECODE_EMBD)
    state.source_stage_index, state.activation_codec = 1, ActivationCodec.BF16_RNE_V1
    state.prompt_token_count, state.decode_step, state.current_token = 17, 3, 11
    sampling = SamplingConfig(flags=1, seed=42, temperature=0.8, top_p=0.9, top_k=40)
    wire = codec.encode_activation(int(ActivationCodec.BF16_RNE_V1), 1, n_embd, values.tobytes(), 0)
    return StageWireMessage(WireMessageKind.DECODE_EMBD, 20, 1, state, 7, 11, sampling, None, [11], [], wire)


def _ops(impl: str, msg: StageWireMessage, n_embd: int) -> dict[str, Callable[[], object]]:
    k = _impl.kernel_module("frame", impl)
    write, read = k.write_stage_message, k.read_stage_message_from_buffer
    data = write(msg)
    codec = int(msg.state.activation_codec)
    stream = data * 64

    def decoder_feed():
        dec = StageMessageDecoder(n_embd, codec, impl=impl)
        got = dec.feed(stream)
        assert len(got) == 64
        return got

    return {
        "write+read round trip": lambda: read(write(msg), n_embd, codec, 0, 0),
        "write": lambda: write(msg),
        "read": lambda: read(data, n_embd, codec, 0, 0),
        "streaming decoder, 64 msgs/feed (per msg)": decoder_feed,
    }


def rows(repeat: int = 5, min_time: float = 0.05, n_embd: int = N_EMBD, impl: Optional[str] = None) -> list[dict]:
    """Measure every framing operation on ``impl`` (default: the live one, as every other row
    of ``skippy-wire bench``) and on the twin, the two timed alternately (best of ``repeat``
    rounds of about ``min_time`` s)."""
    impl = impl or _impl.IMPLEMENTATION
    msg = decode_message(n_embd)
    size = f"1x{n_embd} bf16 DecodeEmbd + sampling ({len(_impl.kernel_module('frame', impl).write_stage_message(msg))} B)"
    ours_ops, ref_ops = _ops(impl, msg, n_embd), _ops("python", msg, n_embd)
    out = []
    for op, fn in ours_ops.items():
        per_call = 64 if op.startswith("streaming") else 1
        ours_s, ref_s = paired_seconds(fn, ref_ops[op], repeat, min_time)
        ours, ref = per_call / ours_s, per_call / ref_s
        ratio = ours / ref
        if op == "write+read round trip":
            goal = f">= {ROUND_TRIP_GOAL_OPS:,}/s and >= {ROUND_TRIP_GOAL_RATIO:g}x reference"
            met = ours >= ROUND_TRIP_GOAL_OPS and ratio >= ROUND_TRIP_GOAL_RATIO
        else:
            goal, met = "", None
        out.append({"op": f"frame {op}", "size": size, "unit": "ops/s", "ours": ours, "ours_ops_s": ours,
                    "reference": ref, "ratio": ratio, "goal": goal, "met": met, "impl": impl})
    return out


def main(argv: Optional[list[str]] = None) -> int:
    """Print the rows (``python -m skippy_wire.tools.frame_bench``); status 0 whatever the
    goal, as ``skippy-wire bench``."""
    parser = Parser(prog="python -m skippy_wire.tools.frame_bench", description=doc_summary(__doc__))
    add_timing_options(parser, 0.05)
    opts = parser.parse_args(argv)
    print(f"machine: {cpu_text()}; kernels {_impl.IMPLEMENTATION}"
          + (f"; {TWIN_ITSELF}" if _impl.IMPLEMENTATION == "python" else ""))
    for row in rows(opts.repeat, opts.min_time):
        met = "" if row["met"] is None else ("  met" if row["met"] else "  NOT MET")
        print(f"{row['op']:<48} {row['ours']:>12,.0f}/s  ref {row['reference']:>10,.0f}/s  "
              f"x{row['ratio']:>7.1f}  {row['goal']}{met}")
    return 0


if __name__ == "__main__":
    raise SystemExit(guarded(main))


def frame_rows(opts=None):
    """Producer for ``skippy-wire bench`` (see ``skippy_wire.tools.bench.ROW_PRODUCERS``): the
    rows above as ``bench.Row`` (time per operation; GB/s of the message's f32 activation, as
    every row of the table) plus the two issue #3 goals as ``bench.Ratio``.  The message is
    the one the goals name (one 1 x 4096 token), whatever the codec rows' ``--sizes``."""
    for row in rows(repeat=getattr(opts, "repeat", 5), min_time=getattr(opts, "min_time", 0.05)):
        nbytes = 4 * N_EMBD
        yield Row(row["op"], f"1x{N_EMBD}", f"skippy_wire ({row['impl']})", 1.0 / row["ours"], nbytes)
        yield Row(row["op"], f"1x{N_EMBD}", "reference twin (python)", 1.0 / row["reference"], nbytes)
        if row["met"] is not None:
            itself = TWIN_ITSELF if row["impl"] == "python" else ""
            yield Ratio(f"{row['op']} vs reference twin @1x{N_EMBD}", row["ratio"], ROUND_TRIP_GOAL_RATIO, itself)
            yield Ratio(f"{row['op']} messages/s vs {ROUND_TRIP_GOAL_OPS:,}/s @1x{N_EMBD}", row["ours"] / ROUND_TRIP_GOAL_OPS, 1.0,
                        f"{row['ours']:,.0f}/s")


#: Picked up by ``skippy_wire.tools.bench`` (``python -m skippy_wire bench``).
ROW_PRODUCERS = [frame_rows]
