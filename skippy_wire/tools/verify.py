"""``skippy-wire verify-exhaustive``: every f32 bit pattern through the live encoders.

All 2^32 f32 bit patterns are split into chunks (2^22 patterns by default) and spread over
worker processes (one per core by default).  For each chunk, with ``x`` the patterns:

Raw conversions (``f32_bits_to_bf16_bits`` / ``f32_bits_to_f16_bits``), every element:
  * bf16: bit-identical to ``ml_dtypes.bfloat16`` for every finite ``x`` (values that round past
    the largest bf16 become +-inf in both), and to the spec's own formula ``((x + 0x7fff + lsb)
    mod 2^32) >> 16`` for every non-NaN ``x`` (wire-format.md 6.6).  NaN is compared by class (a
    NaN of the same sign): the oracle gives 0x7fc0 for every NaN, the project keeps the top bits
    quietened, and encode never reaches it (non-finite input is rejected first).
  * f16: bit-identical to numpy's ``float16`` cast for every non-NaN ``x`` (infinities and
    overflow included); NaN -> ``0x7c01 | sign`` (wire-format.md 6.5).

Checked encoder (``encode_activation``) and decoder (``decode_activation``):
  * the upstream error rule is computed independently (BF16: finite and ``|bits| >= 0x7f7f8000``;
    F16: finite and ``|x| >= 65520``; non-finite -> "activation values must be finite") and
    cross-checked against the oracles (the rule holds exactly where they overflow to infinity);
  * the finite in-range subset of the chunk is encoded in ONE call: it must succeed and be
    bit-identical to the oracle, element by element; a wrong error is located by bisection and
    reported with its value; the result is decoded back and compared with the oracle's widening;
  * error elements: every boundary of the error set inside the chunk (both sides), the first and
    last error element and a seeded random sample are encoded alone and must raise
    ``InvalidDataError`` with the exact text; the whole chunk must raise the text of the first
    rule that applies (finiteness is checked over the whole array first).

Exactness predicates (``is_bf16_exact`` / ``is_f16_exact``) against their definition,
``decode(encode(x)) == x`` bit for bit, computed with the oracles: the exact subset of the chunk
in one call must be True, the whole chunk ``all(exact)``; non-exact elements at every boundary,
the first/last and a random sample, each alone and appended to the exact subset, must be False.

(A call per error or non-exact pattern, ~4e9, would take hours; the raw conversions, which the
checked kernels share, are compared on every element, the checked calls on every success.)

Once per run: all 65,536 patterns of each 16-bit format through the raw widening
(``bf16_bits_to_f32_bits`` / ``f16_bits_to_f32_bits``) and ``decode_activation``.

Prints the mismatch count and the first mismatches in hex; exits 1 on any.  A stop signal
ends the workers first (130, 143, 129).
"""

from __future__ import annotations

import argparse
import collections
import itertools
import sys
import time
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context

import ml_dtypes
import numpy as np

from .. import _impl
from .._impl import kernel_module
from ..errors import InvalidDataError, ToolError
from ..stage.threads import available_cpus
from ..wire.constants import ActivationCodec
from .options import MAX_THREADS, Parser, doc_summary, int_at_least, int_between
from .pool_failures import raise_what_broke_the_pool, thread_failures_kept
from .progress_bar import Progress
from .signals import end_workers, exiting_on_signals, ignore_stop_signals, signals_deferred, stop_signals_blocked

TOTAL = 1 << 32
DEFAULT_CHUNK = 1 << 22
#: The most patterns a chunk holds: each worker's chunk takes 8 bytes a pattern or more at
#: once (512 MiB here), and a larger one saves nothing but memory a machine may not have.
MAX_CHUNK = 1 << 26
#: Mismatches kept per chunk (the count is always exact).
KEEP = 16
#: Error / non-exact elements checked one by one per chunk, on top of the boundaries.
SAMPLES = 8
#: Seconds between looks at a stop signal while chunks are out (the workers are ended first).
STOP_CHECK_S = 0.2

CODEC_F16 = int(ActivationCodec.F16_RNE_V1)
CODEC_BF16 = int(ActivationCodec.BF16_RNE_V1)

MSG_NONFINITE = "activation values must be finite"
MSG_BF16_RANGE = "BF16 activation value is out of range"
MSG_F16_RANGE = "F16 activation value is out of range"
MSG_DECODE_NONFINITE = "activation payload contains non-finite value"

#: Smallest f32 magnitude pattern that bf16 encode rejects (rounds to infinity).
BF16_RANGE_BITS = 0x7F7F8000
#: 65520.0: the f16 tie between 65504 and 2^16, rounded (to even) to infinity.
F16_RANGE_BITS = 0x477FF000


@dataclass
class Mismatch:
    check: str
    x: int  # the input pattern (f32 bits, or the 16-bit pattern for decode checks)
    expected: str
    got: str

    def render(self) -> str:
        width = 4 if self.check.startswith("decode16") else 8
        return f"{self.check:<24} x=0x{self.x:0{width}x}  expected={self.expected}  got={self.got}"


@dataclass
class ChunkResult:
    start: int
    count: int
    mismatches: int = 0
    first: list = field(default_factory=list)
    stats: dict = field(default_factory=dict)
    by_check: dict = field(default_factory=dict)
    cpu: float = 0.0  # CPU seconds spent on this chunk

    def add(self, check: str, x: int, expected, got) -> None:
        self.mismatches += 1
        self.by_check[check] = self.by_check.get(check, 0) + 1
        if len(self.first) < KEEP:
            self.first.append(Mismatch(check, int(x), _fmt(expected), _fmt(got)))

    def add_array(self, check: str, xs: np.ndarray, expected: np.ndarray, got: np.ndarray, width: int,
                  where: np.ndarray | None = None) -> None:
        """Record every position (within ``where``) where ``expected != got``."""
        diff = expected != got
        if where is not None:
            diff &= where
        if not diff.any():
            return
        bad = np.flatnonzero(diff)
        self.mismatches += int(bad.size)
        self.by_check[check] = self.by_check.get(check, 0) + int(bad.size)
        for i in bad[: max(0, KEEP - len(self.first))]:
            self.first.append(Mismatch(check, int(xs[i]), f"0x{int(expected[i]):0{width}x}", f"0x{int(got[i]):0{width}x}"))

    def bump(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n


def _fmt(value) -> str:
    if isinstance(value, (int, np.integer)):
        return hex(int(value))
    if isinstance(value, BaseException):
        return f"{type(value).__name__}({str(value)!r})"
    return str(value)


def _buf(a: np.ndarray) -> np.ndarray:
    """A zero-copy byte view (itemsize 1, C-contiguous) of a little-endian u32 array."""
    return np.ascontiguousarray(a).astype("<u4", copy=False).view(np.uint8)


# --------------------------------------------------------------------------- the oracles


def oracle_bf16(f: np.ndarray) -> np.ndarray:
    """ml_dtypes' RNE float32 -> bfloat16 bits (float32 input only, never float64)."""
    assert f.dtype == np.float32
    return f.astype(ml_dtypes.bfloat16).view(np.uint16)


def oracle_f16(f: np.ndarray) -> np.ndarray:
    assert f.dtype == np.float32
    return f.astype(np.float16).view(np.uint16)


#: numpy's float16 cast is the oracle below 2^16 (which spans the 65520 overflow tie);
#: at and above it every finite value overflows, and the expected bits are the upstream
#: rule's +-inf.  (numpy's cast costs ~60 ns per value that overflows or underflows.)
F16_ORACLE_BELOW = 0x47800000


def oracle_f16_split(bits: np.ndarray, f: np.ndarray) -> np.ndarray:
    """numpy's f16 bits for |x| < 2^16; sign | 0x7c00 (the rule's infinity) elsewhere."""
    out = (((bits >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7C00)).astype(np.uint16)
    low = (bits & np.uint32(0x7FFFFFFF)) < np.uint32(F16_ORACLE_BELOW)
    if low.all():
        return oracle_f16(f)
    if low.any():
        out[low] = oracle_f16(f[low])
    return out


def spec_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """wire-format.md 6.6: ((bits + 0x7fff + lsb) mod 2^32) >> 16, for every pattern."""
    lsb = (bits >> np.uint32(16)) & np.uint32(1)
    return ((bits + np.uint32(0x7FFF) + lsb) >> np.uint32(16)).astype(np.uint16)


def spec_f16_nan_bits(bits: np.ndarray) -> np.ndarray:
    """wire-format.md 6.5 step 2: NaN -> 0x7c01 | sign."""
    return (((bits >> np.uint32(16)) & np.uint32(0x8000)) | np.uint32(0x7C01)).astype(np.uint16)


# --------------------------------------------------------------------------- per chunk


def _expect_error(kernel, codec: int, payload: np.ndarray, text: str):
    """Encode ``payload`` (one token row); return None when it raised exactly ``text``."""
    try:
        wire = kernel.encode_activation(codec, 1, int(payload.size), _buf(payload), 0)
    except InvalidDataError as exc:
        if type(exc) is InvalidDataError and str(exc) == text:
            return None
        return exc
    except Exception as exc:  # noqa: BLE001 - any other class is a finding
        return exc
    return f"no error (wire {bytes(wire[:8]).hex()}...)"


def _first_failing(kernel, codec: int, values: np.ndarray) -> int:
    """Bisection: the smallest i such that encoding values[: i + 1] raises."""
    lo, hi = 0, values.size - 1  # invariant: values[: hi + 1] raises
    while lo < hi:
        mid = (lo + hi) // 2
        try:
            kernel.encode_activation(codec, 1, mid + 1, values[: mid + 1].tobytes(), 0)
        except Exception:  # noqa: BLE001
            hi = mid
        else:
            lo = mid + 1
    return lo


def _first_last(mask: np.ndarray) -> tuple[int, int] | None:
    if not mask.any():
        return None
    return int(mask.argmax()), int(mask.size - 1 - mask[::-1].argmax())


def _picks(mask: np.ndarray, rng: np.random.Generator, samples: int) -> np.ndarray:
    """Indices where ``mask`` holds: every boundary of a run, first/last, random samples."""
    fl = _first_last(mask)
    if fl is None:
        return np.zeros(0, dtype=np.int64)
    edges = np.flatnonzero(mask[1:] != mask[:-1])
    # edges[k] is the last index before a change: keep the side that is in the mask.
    probe = rng.integers(0, mask.size, size=min(16 * samples, mask.size))  # memory bounded by the chunk's
    probe = probe[mask[probe]][:samples]
    if probe.size < samples:  # a sparse mask: draw from its members
        idx = np.flatnonzero(mask)
        probe = rng.choice(idx, size=min(samples, idx.size), replace=False)
    cand = np.unique(np.concatenate([edges, edges + 1, np.array(fl), probe]))
    return cand[mask[cand]]


def _check_codec(
    res: ChunkResult,
    kernel,
    name: str,
    codec: int,
    bits: np.ndarray,
    f: np.ndarray,
    finite: np.ndarray,
    oracle: np.ndarray,
    rule_range: np.ndarray,
    range_text: str,
    exact: np.ndarray,
    is_exact,
    rng: np.random.Generator,
    samples: int,
) -> None:
    oracle_inf = (oracle & np.uint16(0x7FFF)) == np.uint16(0x7C00 if codec == CODEC_F16 else 0x7F80)
    # The error rule, stated on bits, against the oracle's overflow to infinity.
    res.add_array(f"{name}-rule", bits, (finite & oracle_inf).astype(np.uint8), (finite & rule_range).astype(np.uint8), 1)
    ok = finite & ~rule_range
    err = ~ok

    # --- checked encoder: the whole in-range subset in one call, element by element.
    ok_bits = bits[ok]
    if ok_bits.size:
        try:
            wire = kernel.encode_activation(codec, 1, int(ok_bits.size), _buf(ok_bits), 0)
        except Exception as exc:  # noqa: BLE001
            i = _first_failing(kernel, codec, ok_bits)
            res.add(f"{name}-encode", ok_bits[i], "success", exc)
        else:
            got = np.frombuffer(wire, dtype="<u2")
            if got.size != ok_bits.size:
                res.add(f"{name}-encode-len", ok_bits[0], 2 * ok_bits.size, len(wire))
            else:
                res.add_array(f"{name}-encode", ok_bits, oracle[ok], got, 4)
                res.bump(f"{name}-encoded", int(ok_bits.size))
                try:
                    dec = kernel.decode_activation(codec, 1, int(ok_bits.size), wire, 0)
                except Exception as exc:  # noqa: BLE001
                    res.add(f"{name}-decode", ok_bits[0], "success", exc)
                else:
                    want = _widen_oracle(codec, oracle[ok])
                    res.add_array(f"{name}-decode", ok_bits, want, np.asarray(dec, dtype=np.float32).view(np.uint32), 8)

    # --- checked encoder: error elements alone, and the whole chunk.
    if err.any():
        for i in _picks(err, rng, samples):
            text = MSG_NONFINITE if not finite[i] else range_text
            bad = _expect_error(kernel, codec, bits[i : i + 1], text)
            res.bump(f"{name}-errors-checked")
            if bad is not None:
                res.add(f"{name}-encode-error", bits[i], repr(text), bad)
        whole_text = MSG_NONFINITE if not finite.all() else range_text
        bad = _expect_error(kernel, codec, bits, whole_text)
        if bad is not None:
            res.add(f"{name}-encode-chunk", bits[0], repr(whole_text), bad)
        # Order: an out-of-range value before a non-finite one still reports non-finite.
        rng_fl = _first_last(finite & rule_range)
        nf_fl = _first_last(~finite)
        if rng_fl and nf_fl:
            pair = np.array([bits[rng_fl[0]], bits[nf_fl[1]]], dtype=np.uint32)
            bad = _expect_error(kernel, codec, pair, MSG_NONFINITE)
            if bad is not None:
                res.add(f"{name}-encode-order", pair[0], repr(MSG_NONFINITE), bad)
        # An error element after a run of good ones is still found.
        if ok_bits.size:
            head = ok_bits[: min(ok_bits.size, 1024)]
            for i in _picks(err, rng, 2)[:4]:
                text = MSG_NONFINITE if not finite[i] else range_text
                bad = _expect_error(kernel, codec, np.concatenate([head, bits[i : i + 1]]), text)
                if bad is not None:
                    res.add(f"{name}-encode-error-tail", bits[i], repr(text), bad)

    # --- exactness predicate against decode(encode(x)) == x.
    ex_bits = bits[exact]
    if ex_bits.size:
        got = is_exact(_buf(ex_bits))
        if got is not True:
            res.add(f"{name}-exact-subset", ex_bits[0], True, got)
    got = is_exact(_buf(bits))
    if got is not bool(exact.all()):
        res.add(f"{name}-exact-chunk", bits[0], bool(exact.all()), got)
    inexact = ~exact
    tail = ex_bits[: min(ex_bits.size, 1024)]
    for i in _picks(inexact, rng, samples):
        res.bump(f"{name}-inexact-checked")
        got = is_exact(_buf(bits[i : i + 1]))
        if got is not False:
            res.add(f"{name}-exact", bits[i], False, got)
        got = is_exact(_buf(np.concatenate([tail, bits[i : i + 1]])))
        if got is not False:
            res.add(f"{name}-exact-tail", bits[i], False, got)
    res.bump(f"{name}-exact-patterns", int(ex_bits.size))


def _widen_oracle(codec: int, h: np.ndarray) -> np.ndarray:
    if codec == CODEC_BF16:
        return h.view(ml_dtypes.bfloat16).astype(np.float32).view(np.uint32)
    return h.view(np.float16).astype(np.float32).view(np.uint32)


def check_chunk(start: int, count: int, impl: str = _impl.IMPLEMENTATION, samples: int = SAMPLES,
                kernel=None) -> ChunkResult:
    """Run every check on the patterns ``start .. start + count - 1``."""
    if kernel is None:
        kernel = kernel_module("codec", impl)
    cpu0 = time.process_time()
    res = ChunkResult(start, count)
    rng = np.random.default_rng(start)
    bits = np.arange(start, start + count, dtype=np.uint64).astype(np.uint32)
    f = bits.view(np.float32)
    mag = bits & np.uint32(0x7FFFFFFF)
    finite = mag < np.uint32(0x7F800000)
    nan = mag > np.uint32(0x7F800000)

    with np.errstate(all="ignore"):
        o_bf16 = oracle_bf16(f)
        o_f16 = oracle_f16_split(bits, f)

        # --- raw conversions, every element.
        got = np.asarray(kernel.f32_bits_to_bf16_bits(bits))
        spec = spec_bf16_bits(bits)
        res.add_array("bf16-raw-spec", bits, spec, got, 4, where=~nan)
        # NaN: the project's policy (dtypes.py) keeps a NaN a NaN of the same sign, where
        # the spec's bias formula can carry a NaN into infinity or zero; compare by class.
        if nan.any():
            g = got[nan]
            want_class = ((bits[nan] >> np.uint32(16)) & np.uint32(0x8000)).astype(np.uint16) | np.uint16(1)
            got_class = (g & np.uint16(0x8000)) | ((g & np.uint16(0x7FFF)) > np.uint16(0x7F80)).astype(np.uint16)
            res.add_array("bf16-raw-nan-class", bits[nan], want_class, got_class, 4)
        res.add_array("bf16-raw-oracle", bits, o_bf16, got, 4, where=finite)
        # The spec formula and the oracle agree on every finite value (a self-check).
        res.add_array("bf16-spec-vs-oracle", bits, o_bf16, spec, 4, where=finite)

        got = np.asarray(kernel.f32_bits_to_f16_bits(bits))
        want = np.where(nan, spec_f16_nan_bits(bits), o_f16)
        res.add_array("f16-raw", bits, want, got, 4)

        # --- exactness by definition: decode(encode(x)) == x, with the oracles.
        ex_bf16 = finite & (_widen_oracle(CODEC_BF16, o_bf16) == bits)
        ex_f16 = finite & (_widen_oracle(CODEC_F16, o_f16) == bits)
        # The spec's shortcut for bf16 (low 16 bits zero) against the definition.
        res.add_array("bf16-exact-rule", bits, ex_bf16.astype(np.uint8), (finite & ((bits & np.uint32(0xFFFF)) == 0)).astype(np.uint8), 1)

        _check_codec(res, kernel, "bf16", CODEC_BF16, bits, f, finite, o_bf16, mag >= np.uint32(BF16_RANGE_BITS), MSG_BF16_RANGE, ex_bf16, kernel.is_bf16_exact, rng, samples)
        _check_codec(res, kernel, "f16", CODEC_F16, bits, f, finite, o_f16, mag >= np.uint32(F16_RANGE_BITS), MSG_F16_RANGE, ex_f16, kernel.is_f16_exact, rng, samples)
    res.bump("patterns", count)
    res.cpu = time.process_time() - cpu0
    return res


def check_decode16(impl: str = _impl.IMPLEMENTATION, kernel=None) -> ChunkResult:
    """All 65,536 patterns of each 16-bit format through the raw widening and the decoder."""
    if kernel is None:
        kernel = kernel_module("codec", impl)
    res = ChunkResult(0, 1 << 16)
    h = np.arange(1 << 16, dtype=np.uint32).astype(np.uint16)
    with np.errstate(all="ignore"):
        for name, codec, widen in (
            ("decode16-bf16", CODEC_BF16, kernel.bf16_bits_to_f32_bits),
            ("decode16-f16", CODEC_F16, kernel.f16_bits_to_f32_bits),
        ):
            oracle = _widen_oracle(codec, h)
            if codec == CODEC_BF16:
                spec = h.astype(np.uint32) << np.uint32(16)
                nan = (h & np.uint16(0x7FFF)) > np.uint16(0x7F80)
            else:
                h32 = h.astype(np.uint32)
                spec = ((h32 & np.uint32(0x8000)) << np.uint32(16)) | np.uint32(0x7F800000) | ((h32 & np.uint32(0x3FF)) << np.uint32(13))
                nan = (h & np.uint16(0x7FFF)) > np.uint16(0x7C00)
            want = np.where(nan, spec, oracle)
            got = np.asarray(widen(h))
            res.add_array(name, h, want, got, 8)
            finite = (want & np.uint32(0x7F800000)) != np.uint32(0x7F800000)
            try:
                dec = kernel.decode_activation(codec, 1, int(finite.sum()), h[finite].astype("<u2").tobytes(), 0)
            except Exception as exc:  # noqa: BLE001
                res.add(name + "-checked", 0, "success", exc)
            else:
                res.add_array(name + "-checked", h[finite], want[finite], np.asarray(dec, dtype=np.float32).view(np.uint32), 8)
            for i in np.flatnonzero(~finite):
                try:
                    kernel.decode_activation(codec, 1, 1, h[i : i + 1].astype("<u2").tobytes(), 0)
                except Exception as exc:  # noqa: BLE001
                    if type(exc).__name__ != "InvalidDataError" or str(exc) != MSG_DECODE_NONFINITE:
                        res.add(name + "-nonfinite", h[i], repr(MSG_DECODE_NONFINITE), exc)
                else:
                    res.add(name + "-nonfinite", h[i], repr(MSG_DECODE_NONFINITE), "no error")
    res.bump("patterns16", 2 << 16)
    return res


# --------------------------------------------------------------------------- driver


def _chunks(start: int, limit: int, size: int):
    pos, end = start, start + limit
    while pos < end:
        n = min(size, end - pos)
        yield pos, n
        pos += n


def _run_pool(args, workers: int, chunks: list, results: list, progress, check=check_chunk) -> list[str]:
    """Check ``chunks`` over worker processes, 2 in flight each; returns the crashed chunks (a worker that
    ends abruptly, killed or out of memory, breaks the pool: the chunks after it are said unchecked).  A stop
    signal is seen between waits (:data:`STOP_CHECK_S`), not raised inside the pool's code, whose locks it
    could leave held.  ``check``: what a worker runs on a chunk."""
    failures: list[str] = []
    done, mismatches, broken = 0, sum(r.mismatches for r in results), False
    pool, pending, todo = None, {}, iter(chunks)

    def submit(chunk) -> bool:
        """Hand ``chunk`` to the pool; False (the chunk kept for the unchecked) once it is broken."""
        nonlocal todo
        try:
            pending[pool.submit(check, chunk[0], chunk[1], args.impl, args.samples)] = chunk
            return True
        except BrokenProcessPool:  # its futures in flight say why
            todo = itertools.chain([chunk], todo)
            return False

    with signals_deferred() as stop, thread_failures_kept() as thread_failures:
        try:
            # The workers and multiprocessing's resource tracker start deaf to a stop (this
            # process ends them); spawn: no fork of a (possibly threaded) parent.
            with stop_signals_blocked():
                pool = ProcessPoolExecutor(max_workers=workers, mp_context=get_context("spawn"),
                                           initializer=ignore_stop_signals)
                for chunk in todo:
                    if not submit(chunk) or len(pending) >= 2 * workers:
                        break
            while pending and not stop:
                finished, _ = wait(pending, timeout=STOP_CHECK_S, return_when=FIRST_COMPLETED)
                if stop:
                    break
                if thread_failures:
                    raise thread_failures[0]
                for fut in finished:
                    start, n = pending.pop(fut)
                    try:
                        r = fut.result()
                    except BrokenProcessPool as exc:
                        raise_what_broke_the_pool(exc)
                        broken = True
                        failures.append(f"chunk 0x{start:08x}+{n}: not checked: a worker process ended abruptly "
                                        "(killed, or out of memory)")
                        r = ChunkResult(start, n)
                    except Exception as exc:  # noqa: BLE001 - a crashed chunk is a failure
                        failures.append(f"chunk 0x{start:08x}+{n}: {type(exc).__name__}: {exc}")
                        r = ChunkResult(start, n)
                    results.append(r)
                    done += n
                    mismatches += r.mismatches
                    if progress:
                        progress.update(done, mismatches)
                    nxt = None if broken else next(todo, None)
                    if nxt is not None:
                        broken = not submit(nxt)
            unchecked = [] if stop else list(todo)
            if unchecked:
                first, last = unchecked[0][0], unchecked[-1][0] + unchecked[-1][1] - 1
                failures.append(f"patterns 0x{first:08x}..0x{last:08x} not checked: the worker pool broke")
        except BaseException:
            if pool is not None:
                end_workers(pool)
            if not stop:  # else what a stop broke: the stop is delivered, as below
                raise
        if stop:  # leaving signals_deferred() delivers it: the command exits 130, 143 or 129
            end_workers(pool)
        else:
            pool.shutdown()
    return failures


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="skippy-wire verify-exhaustive", description=doc_summary(__doc__))
    p.add_argument("--start", type=int_between(0, TOTAL - 1, base=0), default=0,
                   help="first f32 pattern (0x prefixes allowed)")
    p.add_argument("--limit", type=int_between(1, TOTAL, base=0), default=None,
                   help="number of patterns (default: all up to 2^32)")
    p.add_argument("--chunk", type=int_between(1, MAX_CHUNK, base=0), default=DEFAULT_CHUNK,
                   help="patterns per chunk, at most 2^26 (default: 2^22)")
    p.add_argument("--workers", type=int_between(1, MAX_THREADS), default=None,
                   help="worker processes (default: one per core; 1: in this process)")
    p.add_argument("--impl", choices=_impl.IMPLEMENTATIONS, default=_impl.IMPLEMENTATION,
                   help=f"kernels under test (default: the live ones, {_impl.IMPLEMENTATION})")
    p.add_argument("--samples", type=int_between(0, MAX_CHUNK, base=0), default=SAMPLES,
                   help="error and inexact elements checked alone per chunk (at most 2^26, a chunk's most)")
    p.add_argument("--show", type=int_at_least(0), default=20, help="mismatches to print")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (default: one on stderr)")
    return p


def parse_args(argv):
    p = build_parser()
    args = p.parse_args(argv)
    args.limit = TOTAL - args.start if args.limit is None else args.limit
    if args.start + args.limit > TOTAL:
        p.error(f"--start 0x{args.start:x} + --limit {args.limit} go past 2^32")
    return args


def main(argv=None) -> int:
    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    workers = args.workers or available_cpus()
    try:
        kernel_module("codec", args.impl)  # fail here, not in every worker, if it is not built
    except ImportError as exc:
        raise ToolError(str(exc)) from None

    t0 = time.monotonic()
    results: list[ChunkResult] = [check_decode16(args.impl)]
    failures: list[str] = []
    progress = None if args.no_progress else Progress(args.limit)
    chunks = list(_chunks(args.start, args.limit, args.chunk))
    with exiting_on_signals():  # SIGTERM and SIGHUP unwind like Ctrl-C (the workers stopped first)
        try:
            if workers <= 1:
                for start, n in chunks:
                    results.append(check_chunk(start, n, args.impl, args.samples))
                    if progress:
                        progress.update(sum(r.count for r in results[1:]), sum(r.mismatches for r in results))
            else:
                failures = _run_pool(args, workers, chunks, results, progress)
        finally:
            if progress:
                progress.close()  # a bar cut short by a signal still ends its line
    mismatches = sum(r.mismatches for r in results)
    elapsed = time.monotonic() - t0

    stats, by_check = collections.Counter(), collections.Counter()
    for r in results:
        stats.update(r.stats)
        by_check.update(r.by_check)
    first = sorted((m for r in results for m in r.first), key=lambda m: (m.check.startswith("decode16"), m.x))
    end = args.start + args.limit - 1
    print(f"verify-exhaustive: impl={args.impl} patterns 0x{args.start:08x}..0x{end:08x} ({args.limit}) "
          f"in {elapsed:.1f} s with {workers} worker(s)")
    cpu, cores = sum(r.cpu for r in results), min(workers, available_cpus())  # more workers share the cores
    print(f"cpu: {cpu:.1f} s in the checks ({cpu / max(elapsed, 1e-9):.2f} cores busy on average; "
          f"about {cpu / cores:.0f} s of wall time on {cores} idle core(s))")
    print("checked: " + ", ".join(f"{k}={v}" for k, v in sorted(stats.items())))
    print(f"mismatches: {mismatches}" + ("" if not by_check else " (" + ", ".join(f"{k}={v}" for k, v in sorted(by_check.items())) + ")"))
    for m in first[: args.show]:
        print("  " + m.render())
    for line in failures:
        print("  CRASH " + line)
    return 1 if mismatches or failures else 0


if __name__ == "__main__":
    sys.exit(main())
