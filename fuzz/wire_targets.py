"""Fuzz targets shared by the atheris harness (fuzz/fuzz_wire.py) and the hypothesis
properties (tests/test_fuzz_frame.py).

Each target takes the fuzzer's bytes, runs the compiled and the reference implementation
on the same input and checks:

* only ``skippy_wire.errors.WireError`` subclasses escape (anything else is a crash);
* both implementations give the same outcome: the same canonical result (messages
  compared field by field, f32 fields by bit pattern, buffers by bytes) and the same
  ``consumed``, or the same error class with the same text;
* ``consumed`` never exceeds the input.

The first two input bytes choose the target and its parameters (n_embd, expected codec,
policy, chunking); the rest is the data.  ``seed_inputs`` turns the golden vectors into
inputs in that layout.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import math
import os
import struct
import sys
from pathlib import Path

import numpy as np

from skippy_wire._impl import kernel_module
from skippy_wire.errors import UnexpectedEofError, WireError
from skippy_wire.wire.constants import ROW_DOUBLING_SIDEBANDS

#: n_embd values a frame target can pick (byte 1, low 3 bits).
N_EMBD = (4, 2, 1, 8, 0, -1, 3, 2048)
#: Expected codec for the reader: None (``read_stage_message``) or a wire id.
EXPECTED = (None, 1, 2, 3, 4, None)


class Mismatch(AssertionError):
    """A property failed; ``code`` is a short stable signature (for de-duplication)."""

    def __init__(self, code: str, detail: str) -> None:
        super().__init__(f"{code}: {detail}")
        self.code = code


def _diff_fields(a, b, path: str = "") -> list[str]:
    """Paths of the differing leaves of two canon() trees."""
    if a == b:
        return []
    if isinstance(a, tuple) and isinstance(b, tuple) and len(a) == len(b):
        out = []
        for i, (x, y) in enumerate(zip(a, b)):
            if isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str) and isinstance(y, tuple) and len(y) == 2 and x[0] == y[0]:
                out += _diff_fields(x[1], y[1], f"{path}.{x[0]}")
            else:
                out += _diff_fields(x, y, f"{path}[{i}]")
        return out
    return [path or "."]


def _sig(o) -> str:
    return "ok" if o[0] == "ok" else f"{o[1]}({o[2]!r})"


def implementations(concept: str):
    """(compiled-or-None, reference): the compiled one only if it is built."""
    ref = kernel_module(concept, "python")
    try:
        compiled = kernel_module(concept, "cython")
    except ImportError:
        compiled = None
    return compiled, ref


def canon(value):
    """A comparable form: dataclasses field by field, floats as f32 bits, buffers as bytes."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__,) + tuple((f.name, canon(getattr(value, f.name))) for f in dataclasses.fields(value))
    if isinstance(value, enum.Enum):
        return int(value.value)
    if isinstance(value, bool) or value is None or isinstance(value, (int, str)):
        return value
    if isinstance(value, float):
        bits = getattr(value, "bits", None)
        if bits is None:
            bits = struct.unpack("<I", struct.pack("<f", value))[0] if math.isfinite(value) or math.isinf(value) else ("nan",)
        return ("f32", bits)
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value)
    if isinstance(value, np.ndarray):
        return (value.dtype.str, value.shape, value.tobytes())
    if isinstance(value, (list, tuple)):
        return tuple(canon(v) for v in value)
    if hasattr(value, "_asdict"):
        return canon(tuple(value))
    if hasattr(value, "__dict__"):
        return (type(value).__name__,) + tuple((k, canon(v)) for k, v in sorted(vars(value).items()))
    return repr(value)


#: FUZZ_MODE: "differential" (compiled and reference, compared; the default), "compiled"
#: (the compiled implementation alone: no parity check, many times faster) or "reference".
MODES = ("differential", "compiled", "reference")
MODE = os.environ.get("FUZZ_MODE", "differential")
if MODE not in MODES:  # a misspelt mode ran the reference alone, under a banner saying otherwise
    sys.exit(f"fuzz: FUZZ_MODE={MODE!r} is none of {', '.join(MODES)}")


def outcome(fn, *args, limit: int | None = None):
    """("ok", result) or ("err", class, text).  Non-WireError exceptions propagate."""
    try:
        result = fn(*args)
    except WireError as exc:
        return ("err", type(exc).__name__, str(exc))
    if limit is not None and isinstance(result, tuple) and len(result) == 2 and isinstance(result[1], int):
        if not 0 < result[1] <= limit:
            raise Mismatch("consumed-out-of-range", f"consumed {result[1]} outside (0, {limit}]")
    return ("ok", result)


def _canon_outcome(o):
    return o if o[0] != "ok" else ("ok", canon(o[1]))


def _same(a, b) -> bool:
    if a[0] != b[0]:
        return False
    if a[0] != "ok":
        return a == b
    ra, rb = a[1], b[1]
    # Fast path: (message, consumed) pairs compare with the dataclasses' __eq__; a NaN in a
    # sampling field makes that False, and the canonical (bit-pattern) form decides.
    if isinstance(ra, tuple) and isinstance(rb, tuple) and len(ra) == len(rb) == 2 and ra[1] == rb[1]:
        try:
            if ra[0] == rb[0]:
                return True
        except Exception:  # noqa: BLE001 - e.g. ndarray truth value; canon() decides
            pass
    return canon(ra) == canon(rb)


def differential(compiled, ref, name: str, *args, limit: int | None = None):
    """Run ``name`` per FUZZ_MODE; in differential mode both must give the same outcome."""
    if MODE == "compiled" and compiled is not None:
        return outcome(getattr(compiled, name), *args, limit=limit)
    want = outcome(getattr(ref, name), *args, limit=limit)
    if compiled is not None and MODE == "differential":
        got = outcome(getattr(compiled, name), *args, limit=limit)
        if not _same(got, want):
            got, want = _canon_outcome(got), _canon_outcome(want)
            where = ",".join(_diff_fields(got[1], want[1])) if got[0] == want[0] == "ok" else ""
            raise Mismatch(f"parity {name}: compiled {_sig(got)} vs reference {_sig(want)} {where}",
                           f"compiled {got!r} != reference {want!r} for args {_short(args)}")
    return want


def _short(args) -> str:
    parts = []
    for a in args:
        if isinstance(a, (bytes, bytearray, memoryview)):
            b = bytes(a)
            parts.append(f"bytes[{len(b)}]={b[:200].hex()}{'...' if len(b) > 200 else ''}")
        else:
            parts.append(repr(a))
    return ", ".join(parts)


def _hint(o) -> int:
    """Distinct outcomes take distinct branches, so that libFuzzer's (Python-level)
    coverage keeps inputs that reach new error texts or message shapes of the compiled
    readers (which are not coverage-instrumented themselves)."""
    if o[0] != "ok":
        t = o[2]
        if t == 'BF16 activation value is out of range':
            return 1
        if t == 'F16 activation value is out of range':
            return 2
        if t == 'F32 activation payload size mismatch':
            return 3
        if t == 'S8 activation payload contains reserved -128 value':
            return 4
        if t == 'S8 activation row scale is not finite and positive':
            return 5
        if t == 'S8 activation value is out of range':
            return 6
        if t == 'S8 row byte count overflow':
            return 7
        if t == 'activation columns must be positive':
            return 8
        if t == 'activation payload byte count exceeds maximum':
            return 9
        if t == 'activation payload contains non-finite value':
            return 10
        if t == 'activation payload size mismatch':
            return 11
        if t == 'activation row count overflow':
            return 12
        if t == 'activation values must be finite':
            return 13
        if t == 'activationless stage message contains activation payload':
            return 14
        if t == 'chat sampling metadata is not UTF-8':
            return 15
        if t == 'chat sampling metadata is too large':
            return 16
        if t == 'chat sampling metadata length exceeds maximum':
            return 17
        if t == 'decoded activation payload byte count exceeds maximum':
            return 18
        if t == 'failed to fill whole buffer':
            return 19
        if t == 'logit bias count exceeds maximum':
            return 20
        if t == 'lossless activation selection requires RawF32 fallback':
            return 21
        if t == 'message field does not fit its wire type':
            return 22
        if t == 'n_embd does not fit in i32':
            return 23
        if t == 'native MTP draft token count exceeds maximum':
            return 24
        if t == 'negative activation dimensions':
            return 25
        if t == 'negative activation payload byte count':
            return 26
        if t == 'negative native MTP draft token count':
            return 27
        if t == 'negative predicted token count':
            return 28
        if t == 'negative wire count':
            return 29
        if t == 'position sideband count exceeds maximum':
            return 30
        if t == 'predicted token count exceeds maximum':
            return 31
        if t == 'reply field does not fit its wire type':
            return 32
        if t == 'sampling string count exceeds maximum':
            return 33
        if t == 'sampling string exceeds maximum length':
            return 34
        if t == 'sampling string is not UTF-8':
            return 35
        if t == 'stage activation codec mismatch':
            return 36
        if t == 'state import byte count exceeds maximum':
            return 37
        if t == 'state import raw byte count exceeds maximum':
            return 38
        if t == 'state import raw byte count mismatch':
            return 39
        if t == 'token sideband count exceeds maximum':
            return 40
        if t == 'too many native MTP draft tokens':
            return 41
        if t == 'too many position sideband values':
            return 42
        if t == 'too many predicted tokens':
            return 43
        if t == 'too many tokens':
            return 44
        if t == 'unknown native MTP draft reply marker':
            return 45
        if t == 'unknown stage activation codec':
            return 46
        if t == 'unknown stage message kind':
            return 47
        if t == 'unknown stage reply kind':
            return 48
        if t == 'unsupported stage state version':
            return 49
        return -1
    r = o[1]
    msg = r[0] if isinstance(r, tuple) and len(r) == 2 else None
    if msg is None or not hasattr(msg, "state"):
        return 0
    h = 0
    if msg.kind == 1:
        h += 1
    if msg.kind == 2:
        h += 2
    if msg.kind == 3:
        h += 3
    if msg.kind == 4:
        h += 4
    if msg.kind == 5:
        h += 5
    if msg.kind == 6:
        h += 6
    if msg.kind == 7:
        h += 7
    if msg.kind == 8:
        h += 8
    if msg.kind == 9:
        h += 9
    if msg.kind == 13:
        h += 13
    if msg.kind == 14:
        h += 14
    if msg.kind == 15:
        h += 15
    if msg.kind == 16:
        h += 16
    if msg.kind == 17:
        h += 17
    if msg.kind == 18:
        h += 18
    if msg.kind == 19:
        h += 19
    if msg.kind == 20:
        h += 20
    if msg.kind == 21:
        h += 21
    if msg.kind == 22:
        h += 22
    if msg.state.activation_codec == 1:
        h += 100
    if msg.state.activation_codec == 2:
        h += 200
    if msg.state.activation_codec == 3:
        h += 300
    if msg.state.activation_codec == 4:
        h += 400
    if msg.sampling is not None:
        h += 1000
        if msg.sampling.logit_bias:
            h += 2000
    if msg.chat_sampling_metadata is not None:
        h += 4000
    if msg.tokens:
        h += 8000
    if msg.positions:
        h += 16000
    if len(msg.activation):
        h += 32000
    if len(msg.raw_bytes):
        h += 64000
    if msg.state.flags & ROW_DOUBLING_SIDEBANDS:
        h += 128000
    return h


# --------------------------------------------------------------------------- targets


class Targets:
    """All targets, bound to the implementations under test."""

    def __init__(self) -> None:
        self.codec_c, self.codec_r = implementations("codec")
        self.frame_c, self.frame_r = implementations("frame")
        self.counts: dict = {}

    def describe(self) -> str:
        def which(compiled):
            if compiled is None or MODE == "reference":
                return "reference only"
            return "compiled only" if MODE == "compiled" else "compiled vs reference"

        return f"mode {MODE}; codec: {which(self.codec_c)}; frame: {which(self.frame_c)}"

    def run(self, data: bytes):
        if len(data) < 2:
            return None
        sel, opt, body = data[0], data[1], data[2:]
        target = self.TARGETS[sel % len(self.TARGETS)]
        key = target.__name__
        result = target(self, opt, body)
        self.counts[key] = self.counts.get(key, 0) + 1
        return result

    # --- framing
    def frame_read(self, opt: int, body: bytes):
        n_embd = N_EMBD[opt & 7]
        expected = EXPECTED[(opt >> 3) % len(EXPECTED)]
        policy = (opt >> 6) & 1 if expected is not None else 0
        out = differential(self.frame_c, self.frame_r, "read_stage_message_from_buffer", body, n_embd, expected, policy, limit=len(body))
        _hint(out)
        return out

    def reply_read(self, opt: int, body: bytes):
        out = differential(self.frame_c, self.frame_r, "read_reply_from_buffer", body, limit=len(body))
        _hint(out)
        return out

    def frame_roundtrip(self, opt: int, body: bytes):
        """A message the reader accepts, written back with its activation re-encoded as
        raw f32, reads back to the same message (both writers give the same bytes)."""
        got = self.frame_read(opt, body)
        if got[0] != "ok":
            return got
        msg = got[1][0]
        if msg.activation and int(msg.state.activation_codec) != 1:
            msg.state.activation_codec = 1
        if msg.kind == 3:  # Stop: the reader returns no body, so no activation either
            msg.state.source_stage_index = -1
        primary = self.frame_c if (MODE != "reference" and self.frame_c is not None) else self.frame_r
        try:
            wire = bytes(primary.write_stage_message(msg))
        except WireError:
            return got  # e.g. counts of a Stop that the writer re-derives; not a reader issue
        if MODE == "differential" and self.frame_c is not None:
            other = bytes(self.frame_r.write_stage_message(msg))
            if other != wire:
                raise Mismatch("parity write_stage_message", f"writers differ for {msg!r}: compiled {wire.hex()} != reference {other.hex()}")
        for impl in {primary, self.frame_r} if MODE == "differential" else {primary}:
            again = outcome(impl.read_stage_message_from_buffer, wire, N_EMBD[opt & 7], None, 0)
            if again[0] != "ok":
                raise Mismatch(f"roundtrip re-read failed {_sig(again)}", f"{msg!r} -> {wire.hex()}")
            if not again[1][0] == msg and canon(again[1][0]) != canon(msg):
                fields = ",".join(_diff_fields(canon(msg), canon(again[1][0])))
                raise Mismatch(f"roundtrip changed {fields}", f"{msg!r} -> {again!r}")
        return got

    # --- codecs
    def codec_decode(self, opt: int, body: bytes):
        codec = (opt & 3) + 1
        t = (opt >> 2) & 3
        flags = (0, 0x40, 0x80, 0x100)[(opt >> 4) & 3]
        n = (body[0] % 9) if body else 0
        out = differential(self.codec_c, self.codec_r, "decode_activation", codec, t, n, body[1:], flags)
        _hint(out)
        return out

    def codec_encode(self, opt: int, body: bytes):
        payload = body[: len(body) // 4 * 4]
        n = len(payload) // 4
        flags = 0x40 if opt & 0x80 and n % 2 == 0 else 0
        t, width = (1, n) if not flags else (1, n // 2)
        codec = (opt & 3) + 1
        if width == 0:
            t, width = 0, 1 + (opt >> 2 & 3)
        out = differential(self.codec_c, self.codec_r, "encode_activation", codec, t, width, payload, flags)
        _hint(out)
        permitted = [c for c in (1, 2, 3, 4) if opt >> (2 + c) & 1] or [1]
        differential(self.codec_c, self.codec_r, "select_lossless_codec", t, width, payload, flags, permitted)
        differential(self.codec_c, self.codec_r, "is_bf16_exact", payload)
        differential(self.codec_c, self.codec_r, "is_f16_exact", payload)
        if out[0] == "ok" and codec != 4 and width:
            wire = out[1]
            back = differential(self.codec_c, self.codec_r, "decode_activation", codec, t, width, wire, flags)
            if back[0] != "ok":
                raise Mismatch(f"decode of a fresh encode failed {_sig(back)}", f"{back!r}")
        return out

    TARGETS = (frame_read, frame_read, frame_read, frame_roundtrip, reply_read, codec_decode, codec_encode)


# --------------------------------------------------------------------------- seeds


def vectors_dir() -> Path:
    """The v15 golden vectors the corpus is seeded from: the copy vendored under tests/golden."""
    here = Path(__file__).resolve().parents[1]
    return Path(os.environ.get("SKIPPY_WIRE_VECTORS", here / "tests" / "golden" / "v15"))


def _frame_opt(n_embd: int, codec_id: int | None) -> int:
    n = N_EMBD.index(n_embd) if n_embd in N_EMBD else 0
    e = EXPECTED.index(codec_id) if codec_id in EXPECTED else 0
    return n | (e << 3)


def seed_inputs(directory: Path | None = None):
    """Fuzzer inputs (selector, option, data) built from the public golden vectors."""
    d = directory or vectors_dir()
    frame_sel = Targets.TARGETS.index(Targets.frame_read)
    round_sel = Targets.TARGETS.index(Targets.frame_roundtrip)
    out = []
    frame_path, bad_path = d / "frame.jsonl", d / "malformed.jsonl"
    if frame_path.exists():
        for line in frame_path.read_text().splitlines():
            case = json.loads(line)
            if case["write"]["ok"]:
                data = bytes.fromhex(case["write"]["hex"])
                codec = case["message"]["state"].get("activation_codec_id")
                for sel in (frame_sel, round_sel):
                    out.append(bytes([sel, _frame_opt(case["n_embd"], codec)]) + data)
    if bad_path.exists():
        for line in bad_path.read_text().splitlines():
            case = json.loads(line)
            out.append(bytes([frame_sel, _frame_opt(case["n_embd"], None)]) + bytes.fromhex(case["bytes_hex"]))
    reply_sel = Targets.TARGETS.index(Targets.reply_read)
    ack = struct.pack("<iii", 1, 0, 0) + struct.pack("<ii", 0, 0) + bytes(216)
    tok = struct.pack("<iiii", 2, 42, 1, 42) + struct.pack("<iiii", 7, 1, 2, 5) + struct.pack("<iq", 6, 99) + bytes(216)
    out += [bytes([reply_sel, 0]) + ack, bytes([reply_sel, 0]) + tok]
    enc_sel = Targets.TARGETS.index(Targets.codec_encode)
    vals = np.array([0x3F800000, 0x3F801000, 0x477FF000, 0x7F7F8000, 0x00000001, 0x80000000, 0x7FC00000, 0x3E0D1A34], "<u4")
    for opt in (0x00, 0x01, 0x02, 0x03, 0xFC, 0x83):
        out.append(bytes([enc_sel, opt]) + vals.tobytes())
    return out


def assert_no_unexpected_eof_needed(exc: UnexpectedEofError, available: int) -> None:
    needed = getattr(exc, "needed", None)
    if needed is not None and needed <= available:
        raise Mismatch("eof-needed", f"UnexpectedEof says it needs {needed} bytes but {available} were there")
