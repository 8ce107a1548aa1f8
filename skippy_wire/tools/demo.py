"""``skippy-wire demo``: one realistic activation through every codec.

The frame is a deterministic 8 x 576 residual-stream-like tensor (the width of a small
transformer): Gaussian features with per-channel scales and a few large outlier
channels, as real hidden states have.  A copy rounded to bf16 shows what the lossless
selector does with data a bf16 model produced.
"""

from __future__ import annotations

import argparse

import ml_dtypes
import numpy as np

from ..wire import codec as api
from .._impl import IMPLEMENTATION
from ..wire.constants import ActivationCodec
from ..errors import WireError
from .options import Parser, doc_summary, int_at_least

TOKENS, N_EMBD = 8, 576
DEFAULT_SEED = 576


def residual_stream(tokens: int = TOKENS, n_embd: int = N_EMBD, seed: int = DEFAULT_SEED) -> np.ndarray:
    """A deterministic hidden-state-like f32 frame (tokens x n_embd)."""
    rng = np.random.default_rng(seed)
    channel_scale = np.exp(rng.normal(-0.5, 0.6, n_embd)).astype(np.float32)
    x = rng.standard_normal((tokens, n_embd), dtype=np.float32) * channel_scale
    outliers = rng.choice(n_embd, 3, replace=False)
    x[:, outliers] *= np.float32(40.0)  # "massive activation" channels
    x[0] *= np.float32(4.0)  # the first (BOS-like) token is larger everywhere
    return x


def _report(name: str, x: np.ndarray) -> list[str]:
    raw = x.nbytes
    lines = [f"{name}: {x.shape[0]}x{x.shape[1]} f32, {raw} bytes, max |x| = {float(np.abs(x).max()):.3g}"]
    lines.append(f"  {'codec':<18} {'bytes':>6} {'of raw':>7} {'exact':>6} {'max abs err':>12} {'max rel err':>12}")
    for codec in ActivationCodec:
        try:
            wire = api.encode_activation(codec, x.shape[0], x.shape[1], x)
        except WireError as exc:
            lines.append(f"  {codec.identity():<18} error: {exc}")
            continue
        back = api.decode_activation(codec, x.shape[0], x.shape[1], wire).reshape(x.shape)
        exact = np.array_equal(back.view(np.uint32), x.view(np.uint32))
        err = np.abs(back.astype(np.float64) - x.astype(np.float64))
        rel = float((err / np.maximum(np.abs(x), 1e-30)).max())
        lines.append(f"  {codec.identity():<18} {len(wire):>6} {len(wire) / raw:>6.0%} {'yes' if exact else 'no':>6} {err.max():>12.3g} {rel:>12.3g}")
    chosen, wire = api.select_and_encode_lossless(x.shape[0], x.shape[1], x)
    flags = f"bf16-exact={api.is_bf16_exact(x)}, f16-exact={api.is_f16_exact(x)}"
    lines.append(f"  lossless choice: {chosen.identity()} ({len(wire)} bytes; {flags})")
    return lines


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="skippy-wire demo", description=doc_summary(__doc__))
    parser.add_argument("--seed", type=int_at_least(0), default=DEFAULT_SEED, help="seed of the synthetic frame")
    return parser


def main(argv: list[str] | None = None) -> int:
    opts = build_parser().parse_args(argv)
    x = residual_stream(seed=opts.seed)
    first = _report("residual stream", x)  # before the header: kernels that do not load say so alone
    print(f"skippy_wire activation codecs (kernels: {IMPLEMENTATION})\n")
    print("\n".join(first))
    print()
    print("\n".join(_report("same, rounded to bf16", x.astype(ml_dtypes.bfloat16).astype(np.float32))))
    return 0
