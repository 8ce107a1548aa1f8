"""``skippy-wire conformance DIR... [--impl cython|python]``: run golden-vector files.

Runs every case of every ``*.jsonl`` file found (recursively) under the given directories
(or given directly) in the format of ``shared/vectors/README.md`` — groups ``activation``,
``activation_decode``, ``select``, ``frame`` and ``malformed`` — against one
implementation, codec and framing alike.  A case passes when everything it records
matches: bytes, decoded f32 bit patterns, consumed byte counts, decoded message fields,
error kinds and exact texts (and, for writer failures, the partial output).

The first failures are reported with the case id, file, note and the first difference;
the last line is always ``conformance: N passed, M failed``; the exit status is 1 when
M > 0 (2 for usage errors).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .. import _impl
from . import conformance_gen
from ..wire.constants import ActivationCodec, CodecPolicy
from ..errors import Mismatch, WireError
from ..wire.messages import (
    SAMPLING_WIRE_ORDER,
    SamplingConfig,
    StageStateHeader,
    StageWireMessage,
    WireMessageKind,
    f32_bits,
    f32_from_bits,
)
from ..wire.frame import reader_expectation
from .options import EXIT_USAGE, Parser, error_line, int_at_least

GROUPS = ("activation", "activation_decode", "select", "frame", "malformed")


# --- vector <-> message conversion (shared with the tests) -------------------------------
def _hex_bits(value: float) -> str:
    return f"{f32_bits(value):08x}"


def sampling_from_case(d: Optional[dict]) -> Optional[SamplingConfig]:
    if d is None:
        return None
    values: dict[str, Any] = {}
    for name, code in SAMPLING_WIRE_ORDER:
        if code == "f":
            values[name] = f32_from_bits(int(d[name + "_bits"], 16))
        elif code == "L":
            values[name] = [(int(t), f32_from_bits(int(b, 16))) for t, b in d[name]]
        elif code == "S":
            values[name] = list(d[name])
        else:
            values[name] = d[name]
    return SamplingConfig(**values)


def sampling_to_case(s: Optional[SamplingConfig]) -> Optional[dict]:
    if s is None:
        return None
    out: dict[str, Any] = {}
    for name, code in SAMPLING_WIRE_ORDER:
        value = getattr(s, name)
        if code == "f":
            out[name + "_bits"] = _hex_bits(value)
        elif code == "L":
            out[name] = [[int(t), _hex_bits(b)] for t, b in value]
        elif code == "S":
            out[name] = list(value)
        elif code == "B":
            out[name] = bool(value)
        else:
            out[name] = int(value)
    return out


_STATE_FIELDS = ("version", "seq_id", "phase", "flags", "checkpoint_generation", "prompt_token_count",
                 "decode_step", "current_token", "source_stage_index")


def message_from_case(d: dict) -> StageWireMessage:
    """The message a ``frame`` case hands to the writer."""
    st = d["state"]
    codec_id = st["activation_codec_id"]
    codec = ActivationCodec(codec_id) if codec_id in ActivationCodec._value2member_map_ else codec_id
    state = StageStateHeader(*(st[f] for f in _STATE_FIELDS), codec)
    meta = d["chat_sampling_metadata"]
    kind = d["kind"]
    try:
        kind = WireMessageKind(kind)
    except ValueError:
        pass
    return StageWireMessage(
        kind=kind,
        pos_start=d["pos_start"],
        token_count=d["token_count"],
        state=state,
        request_id=d["request_id"],
        session_id=d["session_id"],
        sampling=sampling_from_case(d["sampling"]),
        chat_sampling_metadata=None if meta is None else bytes.fromhex(meta["hex"]).decode("utf-8"),
        tokens=list(d["tokens"]),
        positions=list(d["positions"]),
        activation=bytes.fromhex(d["activation_hex"]),
        raw_bytes=bytes.fromhex(d["raw_bytes_hex"]),
    )


def message_to_case(m: StageWireMessage) -> dict:
    """A decoded message in the vectors' JSON shape (``activation_hex`` = decoded f32)."""
    st = m.state
    state = {f: int(getattr(st, f)) for f in _STATE_FIELDS}
    codec = ActivationCodec(st.activation_codec)
    state["activation_codec"] = codec.rust_name
    state["activation_codec_id"] = int(codec)  # a reader only returns known codecs
    meta = m.chat_sampling_metadata
    return {
        "kind": int(m.kind),
        "kind_name": WireMessageKind(m.kind).rust_name,
        "pos_start": m.pos_start,
        "token_count": m.token_count,
        "state": state,
        "request_id": m.request_id,
        "session_id": m.session_id,
        "sampling": sampling_to_case(m.sampling),
        "chat_sampling_metadata": None if meta is None else {"utf8": meta, "hex": meta.encode("utf-8").hex()},
        "tokens": [int(t) for t in m.tokens],
        "positions": [int(p) for p in m.positions],
        "activation_hex": bytes(m.activation).hex(),
        "raw_bytes_hex": bytes(m.raw_bytes).hex(),
    }


def read_expectation(read: dict) -> tuple[Optional[int], Optional[int]]:
    """(codec, policy) arguments of :func:`skippy_wire.wire.frame.read_stage_message` for one
    recorded read (``api`` = the upstream reader that produced it)."""
    api = read["api"]
    if api == "read_stage_message":
        return None, None
    if api == "read_stage_message_for_codec":
        return int(ActivationCodec.from_rust_name(read["expected_codec"])), None
    if api == "read_stage_message_for_codec_policy":
        policy = CodecPolicy.AUTO_LOSSLESS_V1 if read["policy"] == "AutoLosslessV1" else CodecPolicy.FIXED
        return int(ActivationCodec.from_rust_name(read["configured_codec"])), int(policy)
    raise Mismatch(f"unknown reader api {api!r}")


# --- comparison helpers -------------------------------------------------------------------
def _short(value: Any, limit: int = 160) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _hex_diff(label: str, got: str, want: str) -> str:
    if len(got) != len(want):
        head = f"{label}: {len(got) // 2} bytes, expected {len(want) // 2}"
    else:
        head = f"{label}: {len(got) // 2} bytes"
    for i in range(0, min(len(got), len(want)), 2):
        if got[i : i + 2] != want[i : i + 2]:
            return f"{head}; first difference at byte {i // 2}: got {got[i:i + 16]}.. expected {want[i:i + 16]}.."
    return f"{head}; one is a prefix of the other (common {min(len(got), len(want)) // 2} bytes)"


def _diff(path: str, got: Any, want: Any) -> Optional[str]:
    """The first differing field between two JSON-shaped values, readably."""
    if isinstance(want, dict) and isinstance(got, dict):
        for key in want:
            if key not in got:
                return f"{path}.{key}: missing"
            d = _diff(f"{path}.{key}", got[key], want[key])
            if d:
                return d
        extra = set(got) - set(want)
        return f"{path}: unexpected fields {sorted(extra)}" if extra else None
    if isinstance(want, list) and isinstance(got, list):
        if len(got) != len(want):
            return f"{path}: {len(got)} items, expected {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = _diff(f"{path}[{i}]", g, w)
            if d:
                return d
        return None
    if got != want or type(got) is bool and type(want) is not bool:
        if isinstance(got, str) and isinstance(want, str) and path.endswith("_hex"):
            return _hex_diff(path, got, want)
        return f"{path}: got {_short(got)}, expected {_short(want)}"
    return None


def _outcome(fn: Callable, *args) -> tuple:
    try:
        return ("ok", fn(*args))
    except WireError as exc:
        return ("err", {"kind": exc.kind, "message": str(exc)}, exc)
    except Exception as exc:  # a crash is a failure to report, not a runner crash
        return ("crash", f"{type(exc).__name__}: {exc}", exc)


def _check_error(label: str, got: tuple, want: dict) -> None:
    if got[0] == "ok":
        raise Mismatch(f"{label}: succeeded ({_short(got[1], 80)}), expected {want['kind']} {want['message']!r}")
    if got[0] == "crash":
        raise Mismatch(f"{label}: raised {got[1]}, expected {want['kind']} {want['message']!r}")
    if got[1] != want:
        raise Mismatch(f"{label}: {got[1]['kind']} {got[1]['message']!r}, expected {want['kind']} {want['message']!r}")


def _require_ok(label: str, got: tuple) -> Any:
    if got[0] != "ok":
        what = got[1] if got[0] == "crash" else f"{got[1]['kind']} {got[1]['message']!r}"
        raise Mismatch(f"{label}: failed with {what}, expected success")
    return got[1]


def _f32_hex(values) -> list:
    return [f"{b:08x}" for b in values.view("<u4").tolist()]


# --- group runners ------------------------------------------------------------------------
class Runner:
    def __init__(self, impl: str) -> None:
        self.impl = impl
        self.codec = _impl.kernel_module("codec", impl)
        self.frame = _impl.kernel_module("frame", impl)

    def run(self, case: dict) -> None:
        handler = getattr(self, "case_" + str(case.get("group")), None)
        if handler is None:
            raise Mismatch(f"unknown group {case.get('group')!r}")
        handler(case)

    # activation: expected wire length, encode, and decode of what was encoded
    def case_activation(self, c: dict) -> None:
        codec, tc, width, flags = c["codec_id"], c["token_count"], c["width"], c["state_flags"]
        known = {x.rust_name: int(x) for x in ActivationCodec}
        if c.get("codec") in known and known[c["codec"]] != codec:
            raise Mismatch(f"case names codec {c['codec']} with id {codec}")
        payload = bytes.fromhex(c["input_hex"])
        got = _outcome(self.codec.activation_wire_bytes, codec, tc, width, flags)
        want = c["expected_wire_len"]
        if want["ok"]:
            if _require_ok("expected_wire_len", got) != want["value"]:
                raise Mismatch(f"expected_wire_len: got {got[1]}, expected {want['value']}")
        else:
            _check_error("expected_wire_len", got, want["error"])
        got = _outcome(self.codec.encode_activation, codec, tc, width, payload, flags)
        enc = c["encode"]
        if not enc["ok"]:
            _check_error("encode", got, enc["error"])
            return
        wire = bytes(_require_ok("encode", got))
        if wire.hex() != enc["hex"]:
            raise Mismatch(_hex_diff("encode", wire.hex(), enc["hex"]))
        dec = c["decode"]
        if dec is None:
            return
        got = _outcome(self.codec.decode_activation, codec, tc, width, wire, flags)
        if not dec["ok"]:
            _check_error("decode", got, dec["error"])
            return
        bits = _f32_hex(_require_ok("decode", got))
        d = _diff("decode.f32_bits", bits, dec["f32_bits"])
        if d:
            raise Mismatch(d)
        if (bits == c["input_f32_bits"]) != dec["bit_exact_roundtrip"]:
            raise Mismatch(f"decode.bit_exact_roundtrip: expected {dec['bit_exact_roundtrip']}")

    def case_activation_decode(self, c: dict) -> None:
        got = _outcome(self.codec.decode_activation, c["codec_id"], c["token_count"], c["width"],
                       bytes.fromhex(c["wire_hex"]), c["state_flags"])
        dec = c["decode"]
        if not dec["ok"]:
            _check_error("decode", got, dec["error"])
            return
        d = _diff("decode.f32_bits", _f32_hex(_require_ok("decode", got)), dec["f32_bits"])
        if d:
            raise Mismatch(d)

    def case_select(self, c: dict) -> None:
        args = (c["token_count"], c["width"], bytes.fromhex(c["input_hex"]), c["state_flags"],
                [int(ActivationCodec.from_rust_name(n)) for n in c["permitted"]])
        res = c["result"]
        got = _outcome(self.codec.select_lossless_codec, *args)
        fused = _outcome(self.codec.select_and_encode_lossless, *args)
        if not res["ok"]:
            _check_error("select", got, res["error"])
            _check_error("select_and_encode_lossless", fused, res["error"])
            return
        codec = int(_require_ok("select", got))
        if codec != res["codec_id"]:
            raise Mismatch(f"select: got codec {codec}, expected {res['codec_id']} ({res['codec']})")
        # The fused entry point (used by forwarding) must pick the same codec and bytes.
        fused_codec, fused_wire = _require_ok("select_and_encode_lossless", fused)
        if int(fused_codec) != codec:
            raise Mismatch(f"select_and_encode_lossless: codec {int(fused_codec)}, expected {codec}")
        plain = self.codec.encode_activation(codec, args[0], args[1], args[2], args[3])
        if bytes(fused_wire) != bytes(plain):
            raise Mismatch(_hex_diff("select_and_encode_lossless bytes", bytes(fused_wire).hex(), bytes(plain).hex()))

    def _check_read(self, label: str, data: bytes, read: dict) -> None:
        codec, policy = read_expectation(read)
        expected, pol = reader_expectation(codec, policy)
        got = _outcome(self.frame.read_stage_message_from_buffer, data, read["n_embd"], expected, pol, 0)
        if not read["ok"]:
            _check_error(label, got, read["error"])
            return
        message, consumed = _require_ok(label, got)
        if consumed != read["consumed"]:
            raise Mismatch(f"{label}: consumed {consumed} bytes, expected {read['consumed']}")
        d = _diff(f"{label}.message", message_to_case(message), read["message"])
        if d:
            raise Mismatch(d)

    def case_frame(self, c: dict) -> None:
        try:
            msg = message_from_case(c["message"])
        except (ValueError, KeyError) as exc:
            raise Mismatch(f"cannot build the message of the case: {exc}") from None
        w = c["write"]
        got = _outcome(self.frame.write_stage_message, msg)
        if not w["ok"]:
            _check_error("write", got, w["error"])
            partial = got[2].partial
            if partial is None:
                raise Mismatch("write: the error carries no partial output")
            if bytes(partial).hex() != w["partial_hex"]:
                raise Mismatch(_hex_diff("write.partial_hex", bytes(partial).hex(), w["partial_hex"]))
            if c["reads"]:
                raise Mismatch("case records reads after a failed write")
            return
        data = bytes(_require_ok("write", got))
        if data.hex() != w["hex"]:
            raise Mismatch(_hex_diff("write.hex", data.hex(), w["hex"]))
        if len(data) != w["len"]:
            raise Mismatch(f"write.len: {len(data)}, expected {w['len']}")
        if msg.estimated_wire_bytes() != w["estimated_wire_bytes"]:
            raise Mismatch(f"write.estimated_wire_bytes: {msg.estimated_wire_bytes()}, expected {w['estimated_wire_bytes']}")
        for i, read in enumerate(c["reads"]):
            self._check_read(f"reads[{i}] {read['api']}", data, read)

    def case_malformed(self, c: dict) -> None:
        data = bytes.fromhex(c["bytes_hex"])
        if len(data) != c["len"]:
            raise Mismatch(f"case bytes_hex has {len(data)} bytes, len says {c['len']}")
        for i, read in enumerate(c["reads"]):
            self._check_read(f"reads[{i}] {read['api']}", data, read)


# --- the command --------------------------------------------------------------------------
def _files(paths: list[str]) -> list[Path]:
    found: list[Path] = []
    for p in map(Path, paths):
        if p.is_dir():
            found += sorted(p.rglob("*.jsonl"))
        elif p.is_file():
            found.append(p)
        else:
            raise FileNotFoundError(p)
    return found


def run(paths: list[str], impl: str, *, max_report: int = 10, out=None, verbose: bool = False,
        protocol: Optional[int] = None) -> tuple[int, int]:
    """Run every case under ``paths``; print failures and the summary; return (passed, failed)."""
    out = sys.stdout if out is None else out
    runner = Runner(impl)
    passed = failed = 0
    per_group: dict[str, list[int]] = {}
    for path in _files(paths):
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                try:
                    case = json.loads(line)
                except json.JSONDecodeError as exc:
                    failed += 1
                    if failed <= max_report:
                        print(f"FAIL {path}:{lineno}: not JSON ({exc})", file=out)
                    continue
                group = str(case.get("group"))
                tally = per_group.setdefault(group, [0, 0])
                try:
                    (conformance_gen.runner_for(case, impl, protocol) or runner).run(case)
                except Mismatch as exc:
                    failed += 1
                    tally[1] += 1
                    if failed <= max_report:
                        print(f"FAIL {case.get('id', '?')} [{group}] {path.name}:{lineno}", file=out)
                        print(f"     note: {case.get('note', '')}", file=out)
                        print(f"     {exc}", file=out)
                    continue
                except Exception as exc:  # report a crash of the runner itself, keep going
                    failed += 1
                    tally[1] += 1
                    if failed <= max_report:
                        print(f"FAIL {case.get('id', '?')} [{group}] {path.name}:{lineno}: "
                              f"runner error {type(exc).__name__}: {exc}", file=out)
                    continue
                passed += 1
                tally[0] += 1
    if failed > max_report:
        print(f"... {failed - max_report} more failures not shown (--max-report)", file=out)
    if verbose or failed:
        for group, (p, f) in sorted(per_group.items()):
            print(f"  {group}: {p} passed, {f} failed", file=out)
    print(f"implementation: {impl}", file=out)
    print(f"conformance: {passed} passed, {failed} failed", file=out)
    return passed, failed


def main(argv: Optional[list[str]] = None) -> int:
    parser = Parser(prog="skippy-wire conformance", description=__doc__.split("\n\n")[0])
    parser.add_argument("paths", nargs="+", metavar="DIR", help="directories (searched for *.jsonl) or files")
    parser.add_argument("--impl", choices=_impl.IMPLEMENTATIONS, default=None,
                        help=f"implementation to check (default: the live one, {_impl.IMPLEMENTATION})")
    parser.add_argument("--max-report", type=int_at_least(0), default=10,
                        help="failures to print in full (default 10)")
    parser.add_argument("--protocol", type=int, choices=(16, 17), default=None,
                        help="state version of the cases (default: from each case id, v15 otherwise)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print per-group counts")
    args = parser.parse_args(argv)
    missing = [path for path in args.paths if not Path(path).exists()]
    if missing:
        print(error_line(f"{missing[0]}: no such file or directory"), file=sys.stderr)
        return EXIT_USAGE
    try:
        _, failed = run(args.paths, args.impl or _impl.IMPLEMENTATION, max_report=args.max_report, verbose=args.verbose,
                        protocol=args.protocol)
    except ImportError as exc:
        print(error_line(f"implementation {args.impl} is not available: {exc}"), file=sys.stderr)
        return EXIT_USAGE
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
