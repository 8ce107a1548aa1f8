"""The exhaustive verifier (``skippy-wire verify-exhaustive``): partial runs and mutants.

The full 2^32 run is CI's job (.ci/run); here the verifier runs on the interesting
neighbourhoods of the f32 space, and must catch deliberately broken kernels.
"""

from __future__ import annotations

import io
import os
import re
import signal
import subprocess
import sys
import tracemalloc
import types
from multiprocessing import queues

import numpy as np
import pytest

from skippy_wire.tools import cli, verify
from skippy_wire.tools.pool_failures import raise_what_broke_the_pool
from skippy_wire.tools.progress_bar import Progress
from skippy_wire._impl import IMPLEMENTATION, kernel_module
from skippy_wire.errors import InvalidDataError, ToolError

#: Neighbourhoods where the rules change: zero and subnormals, f16 subnormal/normal
#: boundary, 1.0, the f16 overflow tie (65520 = 0x477ff000), the bf16 overflow tie
#: (0x7f7f8000), infinity/NaN, and the same on the negative side.
EDGES = [0x00000000, 0x00800000, 0x33000000, 0x38800000, 0x3F800000, 0x477FF000, 0x47800000,
         0x7F7F8000, 0x7F800000, 0x7FC00000, 0x80000000, 0xC77FF000, 0xFF7F8000, 0xFF800000]
SPAN = 1 << 12


def _around(edge: int) -> tuple[int, int]:
    start = max(0, edge - SPAN // 2)
    return start, min(SPAN, (1 << 32) - start)


@pytest.mark.parametrize("edge", EDGES, ids=[f"0x{e:08x}" for e in EDGES])
def test_kernels_clean_around_edges(impl, edge):
    result = verify.check_chunk(*_around(edge), impl=impl)
    assert result.mismatches == 0, "\n".join(m.render() for m in result.first)


def test_decode16_clean(impl):
    result = verify.check_decode16(impl)
    assert result.mismatches == 0, "\n".join(m.render() for m in result.first)
    assert result.stats["patterns16"] == 2 << 16


def test_cli_partial_run(capsys):
    impl = IMPLEMENTATION
    rc = verify.main(["--impl", impl, "--start", "0x477fe000", "--limit", "8192", "--chunk", "4096", "--workers", "1", "--no-progress"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "mismatches: 0" in out
    assert "0x477fe000..0x477fffff" in out


def test_cli_two_workers(capsys):
    rc = verify.main(["--impl", "python", "--start", "0x7f7f0000", "--limit", "0x4000", "--chunk", "0x1000", "--workers", "2"])
    captured = capsys.readouterr()
    assert rc == 0, captured.out
    assert "with 2 worker(s)" in captured.out
    assert "100.0%" in captured.err  # the progress bar reached the end, on stderr


def test_cli_rejects_bad_range():
    with pytest.raises(SystemExit):
        verify.main(["--start", "0xffffffff", "--limit", "2"])


def test_every_count_of_patterns_takes_hex_as_the_range_does():
    """--samples (at most 2^26, as --chunk) refused 0x10, which --start, --limit and --chunk take."""
    args = verify.parse_args(["--start", "0x10", "--limit", "0x20", "--chunk", "0x10", "--samples", "0x10"])
    assert (args.start, args.limit, args.chunk, args.samples) == (16, 32, 16, 16)


def test_progress_bar_plain_text():
    stream = io.StringIO()
    bar = Progress(100, stream=stream)
    bar.update(50, 0)
    bar.update(100, 3)
    bar.close()
    lines = stream.getvalue().splitlines()
    assert lines[-1].startswith("[" + "#" * 30 + "] 100.0%")
    assert lines[-1].endswith("mismatches 3")


@pytest.mark.parametrize("stderr", [None, "closed"])
def test_the_check_runs_and_reports_without_a_stderr_to_show_progress_on(capsys, monkeypatch, stderr):
    """`verify-exhaustive 2>&-` (Python's sys.stderr None) checked nothing and exited 1 in
    silence: the bar's first write failed; a closed stream failed the same way."""
    if stderr == "closed":
        stream = io.StringIO()
        stream.close()
        monkeypatch.setattr(verify.sys, "stderr", stream)
    else:
        monkeypatch.setattr(verify.sys, "stderr", None)
    rc = verify.main(["--impl", "python", "--limit", "16", "--workers", "1"])
    assert rc == 0
    assert "mismatches: 0" in capsys.readouterr().out


def test_the_wall_time_estimate_counts_the_cores_there_are_not_the_workers(capsys, monkeypatch):
    """`--workers 512` on two cores said "on 512 idle core(s)"."""
    monkeypatch.setattr(verify, "available_cpus", lambda: 1)
    assert verify.main(["--impl", "python", "--limit", "16", "--workers", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "with 2 worker(s)" in out and "on 1 idle core(s))" in out


#: The chunk whose worker :func:`_killed_at_second_chunk` kills.
SECOND_CHUNK = 0x1000


def _killed_at_second_chunk(start, count, impl, samples):
    """A worker's check that dies as the OOM killer ends a process (module level: spawn imports it)."""
    if start == SECOND_CHUNK:
        os.kill(os.getpid(), signal.SIGKILL)
    return verify.check_chunk(start, count, impl, samples)


def test_a_worker_killed_is_a_crash_and_the_rest_unchecked_not_a_traceback():
    """A worker killed mid-run broke the pool: the next submit raised BrokenProcessPool out of
    the command as a traceback."""
    args = verify.parse_args(["--limit", "0x8000", "--chunk", "0x1000", "--workers", "2"])
    chunks = list(verify._chunks(args.start, args.limit, args.chunk))
    results: list = []
    failures = verify._run_pool(args, 2, chunks, results, None, check=_killed_at_second_chunk)
    assert any(line.startswith("chunk 0x00001000+4096: not checked: a worker process ended abruptly")
               for line in failures), failures
    # every pattern is checked or said unchecked (the chunks in flight, then those after them)
    assert _accounted(failures, results) == 0x8000


def _accounted(failures: list[str], results: list) -> int:
    """Patterns checked plus those the failures say were not."""
    unchecked = 0
    for line in failures:
        if m := re.fullmatch(r"chunk 0x[0-9a-f]{8}\+(\d+): not checked: .*", line):
            unchecked += int(m[1])
        else:
            first, last = re.fullmatch(r"patterns 0x([0-9a-f]{8})..0x([0-9a-f]{8}) not checked: the worker pool broke",
                                       line).groups()
            unchecked += int(last, 16) - int(first, 16) + 1
    return sum(r.stats.get("patterns", 0) for r in results) + unchecked


def test_a_pool_broken_before_a_submit_leaves_the_rest_unchecked_not_a_traceback(monkeypatch):
    """A worker killed between a chunk's answer and the next submit: submit() raised
    BrokenProcessPool out of the command."""
    class BreaksAtTheFifthSubmit(verify.ProcessPoolExecutor):
        submitted = 0

        def submit(self, *args, **kwargs):
            BreaksAtTheFifthSubmit.submitted += 1
            if BreaksAtTheFifthSubmit.submitted == 5:
                raise verify.BrokenProcessPool("A child process terminated abruptly")
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(verify, "ProcessPoolExecutor", BreaksAtTheFifthSubmit)
    args = verify.parse_args(["--limit", "0x8000", "--chunk", "0x1000", "--workers", "2"])
    results: list = []
    failures = verify._run_pool(args, 2, list(verify._chunks(args.start, args.limit, args.chunk)), results, None)
    assert failures == ["patterns 0x00004000..0x00007fff not checked: the worker pool broke"]
    assert _accounted(failures, results) == 0x8000


def test_what_broke_the_pool_itself_is_said_from_python_3_12s_cause():
    """Python 3.12 keeps the manager thread's failure as the cause of every future's
    BrokenProcessPool (before, that thread died): it was said as a killed worker."""
    from concurrent.futures.process import _RemoteTraceback

    killed = verify.BrokenProcessPool("A child process terminated abruptly")
    assert raise_what_broke_the_pool(killed) is None
    refused = verify.BrokenProcessPool("A process in the process pool was terminated abruptly")
    refused.__cause__ = _RemoteTraceback("\n'''\nTraceback (most recent call last):\n  File \"x.py\", line 1, "
                                         "in run\nRuntimeError: can't start new thread\n'''")
    with pytest.raises(RuntimeError, match="^can't start new thread$"):
        raise_what_broke_the_pool(refused)
    refused.__cause__ = _RemoteTraceback("\n'''\nTraceback (most recent call last):\nEOFError: Ran out of input\n'''")
    with pytest.raises(ToolError, match="^the worker pool failed: EOFError: Ran out of input$"):
        raise_what_broke_the_pool(refused)


def test_a_pool_that_cannot_start_a_thread_is_one_line_not_a_hang(capsys, monkeypatch):
    """Under `ulimit -u` the pool's manager thread died starting its queue's feeder thread:
    its traceback was printed and the command waited for good on futures no one settles."""
    def refused(self):
        raise RuntimeError("can't start new thread")

    monkeypatch.setattr(queues.Queue, "_start_thread", refused)

    def waited_too_long(*_):
        raise TimeoutError("still waiting on the pool")

    previous = signal.signal(signal.SIGALRM, waited_too_long)
    signal.alarm(60)
    try:
        status = cli.main(["verify-exhaustive", "--limit", "0x4000", "--chunk", "0x1000", "--workers", "2",
                           "--no-progress"])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
    assert status == 1
    assert capsys.readouterr().err == "skippy-wire: error: can't start new thread\n"


# --------------------------------------------------------------------------- mutants


def _mutant(**overrides):
    """The reference kernels with some functions replaced."""
    ref = kernel_module("codec", "python")
    names = ("f32_bits_to_bf16_bits", "f32_bits_to_f16_bits", "bf16_bits_to_f32_bits", "f16_bits_to_f32_bits",
             "encode_activation", "decode_activation", "is_bf16_exact", "is_f16_exact")
    ns = types.SimpleNamespace(**{n: getattr(ref, n) for n in names})
    for k, v in overrides.items():
        setattr(ns, k, v)
    return ns, ref


def _checks(result) -> set[str]:
    return set(result.by_check)


def test_mutant_bf16_truncation_is_caught():
    ns, _ = _mutant(f32_bits_to_bf16_bits=lambda b: (b >> np.uint32(16)).astype(np.uint16))
    result = verify.check_chunk(0x3F800000, 1 << 16, kernel=ns)
    assert result.mismatches > 0
    assert {"bf16-raw-spec", "bf16-raw-oracle"} <= _checks(result)


def test_mutant_f16_nan_policy_is_caught():
    def conv(b):
        out = kernel_module("codec", "python").f32_bits_to_f16_bits(b)
        nan = (b & np.uint32(0x7FFFFFFF)) > np.uint32(0x7F800000)
        out[nan] = 0x7E00  # ggml's quiet NaN instead of the protocol's 0x7c01 | sign
        return out

    ns, _ = _mutant(f32_bits_to_f16_bits=conv)
    result = verify.check_chunk(0x7FC00000, 4096, kernel=ns)
    assert "f16-raw" in _checks(result)


def test_mutant_f16_range_off_by_one_is_caught():
    """An encoder that only rejects |x| >= 65536 (accepting the 65520 tie)."""
    ns, ref = _mutant()

    def encode(codec, t, n, payload, flags):
        bits = np.frombuffer(bytes(payload), dtype="<u4")
        mag = bits & np.uint32(0x7FFFFFFF)
        if codec == verify.CODEC_F16 and (mag < 0x7F800000).all() and ((mag >= 0x477FF000) & (mag < 0x47800000)).any():
            keep = np.where((mag >= 0x477FF000) & (mag < 0x47800000), np.uint32(0x477FE000) | (bits & np.uint32(0x80000000)), bits)
            return ref.encode_activation(codec, t, n, keep.astype("<u4").tobytes(), flags)
        return ref.encode_activation(codec, t, n, payload, flags)

    ns.encode_activation = encode
    result = verify.check_chunk(0x477FE000, 8192, kernel=ns)
    assert "f16-encode-error" in _checks(result)


def test_mutant_wrong_error_text_is_caught():
    ns, ref = _mutant()

    def encode(codec, t, n, payload, flags):
        try:
            return ref.encode_activation(codec, t, n, payload, flags)
        except InvalidDataError as exc:
            if str(exc) == verify.MSG_BF16_RANGE:
                raise InvalidDataError("BF16 activation value out of range") from None
            raise

    ns.encode_activation = encode
    result = verify.check_chunk(0x7F7F0000, 1 << 16, kernel=ns)
    assert "bf16-encode-error" in _checks(result)


def test_mutant_wrong_encode_result_is_located():
    """A wrong byte inside the one-call encode of the in-range subset names its input."""
    ns, ref = _mutant()

    def encode(codec, t, n, payload, flags):
        wire = bytearray(ref.encode_activation(codec, t, n, payload, flags))
        bits = np.frombuffer(bytes(payload), dtype="<u4")
        hit = np.flatnonzero(bits == 0x3F812345)
        for i in hit:
            wire[2 * i] ^= 1
        return bytes(wire)

    ns.encode_activation = encode
    result = verify.check_chunk(0x3F810000, 1 << 16, kernel=ns)
    bad = [m for m in result.first if m.check in ("bf16-encode", "f16-encode")]
    assert bad and all(m.x == 0x3F812345 for m in bad)


def test_mutant_exactness_predicate_is_caught():
    """is_f16_exact that forgets subnormals become zero (calls them exact)."""
    ns, ref = _mutant()

    def is_f16_exact(payload):
        bits = np.frombuffer(bytes(payload), dtype="<u4")
        sub = ((bits & np.uint32(0x7F800000)) == 0) & ((bits & np.uint32(0x7FFFFF)) != 0)
        return ref.is_f16_exact(bits[~sub].tobytes())

    ns.is_f16_exact = is_f16_exact
    result = verify.check_chunk(0x00000000, 4096, kernel=ns)
    assert {"f16-exact", "f16-exact-tail"} & _checks(result)


def test_mutant_missing_finiteness_check_is_caught():
    ns, ref = _mutant()

    def encode(codec, t, n, payload, flags):
        bits = np.frombuffer(bytes(payload), dtype="<u4")
        return ref.f32_bits_to_bf16_bits(bits.astype(np.uint32)).astype("<u2").tobytes()

    ns.encode_activation = encode
    result = verify.check_chunk(0x7F800000, 4096, kernel=ns)
    assert "bf16-encode-error" in _checks(result)


def test_the_samples_drawn_take_memory_by_the_chunk_not_by_their_count():
    """--samples 30000000 took 8 GB to check 1,000 patterns: 16 draws a sample were made,
    however few patterns the chunk held."""
    mask = np.zeros(1000, dtype=bool)
    mask[::7] = True
    tracemalloc.start()
    try:
        picks = verify._picks(mask, np.random.default_rng(1), 2_000_000)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert picks.tolist() == np.flatnonzero(mask).tolist()  # as many samples as members: every one
    assert peak < 16 << 20, peak  # (it drew 256 MB)


def test_the_kernels_under_test_default_to_the_live_ones():
    """With SKIPPY_WIRE_IMPL=python it checked the compiled kernels (impl=cython), and without
    them built it failed, telling the user to set the variable that was set."""
    env = {**os.environ, "SKIPPY_WIRE_IMPL": "python"}
    done = subprocess.run([sys.executable, "-m", "skippy_wire", "verify-exhaustive", "--limit", "16", "--workers", "1"],
                          capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "verify-exhaustive: impl=python patterns 0x00000000..0x0000000f (16)" in done.stdout + done.stderr
