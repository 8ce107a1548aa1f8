"""``skippy-wire conformance DIR... [--impl cython|python]``: run golden-vector files.

Runs every case of every ``*.jsonl`` file found (recursively) under the given directories
(or given directly) in the format of ``shared/vectors/README.md`` — groups ``activation``,
``activation_decode``, ``select``, ``frame`` and ``malformed``, and those of state versions
16 and 17 (:mod:`.conformance_gen`) — against one implementation, codec and framing alike.
A case passes when everything it records matches: bytes, decoded f32 bit patterns,
consumed byte counts, decoded message fields, error kinds and exact texts (and, for writer
failures, the partial output).

The first failures are reported with the case id, file, note and the first difference; a
line that is no case (not UTF-8, not JSON, a JSON value other than an object) or a file
that cannot be read fails the same way, and the run goes on.  The last line is always
``conformance: N passed, M failed``; the exit status is 1 when M > 0 or no case was found,
2 for usage errors (a path that does not exist, or is neither a directory nor a regular
file).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Optional

from .. import _impl
from . import conformance_gen
from ..wire.constants import ActivationCodec
from ..errors import Mismatch, os_reason
from ..wire.frame import reader_expectation
from .options import Parser, describe, doc_summary, error_line, given_path, int_at_least, shown
from .vector_cases import (check_error, check_read, diff, hex_diff, malformed_bytes, message_from_case, message_to_case,
                           outcome, read_expectation, require_ok)

GROUPS = ("activation", "activation_decode", "select", "frame", "malformed")


def _f32_hex(values) -> list:
    return [f"{b:08x}" for b in values.view("<u4").tolist()]


# --- group runners ------------------------------------------------------------------------
def check_codec_naming(case: dict) -> None:
    """A case that names its codec both ways (``codec``, ``codec_id``, as every version's
    vectors do) must name one codec: an edited case is then noticed, whichever runs it."""
    name, codec_id = case.get("codec"), case.get("codec_id")
    known = {codec.rust_name: int(codec) for codec in ActivationCodec}
    if name in known and codec_id is not None and known[name] != codec_id:
        raise Mismatch(f"case names codec {name} with id {codec_id}")


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
        payload = bytes.fromhex(c["input_hex"])
        got = outcome(self.codec.activation_wire_bytes, codec, tc, width, flags)
        want = c["expected_wire_len"]
        if want["ok"]:
            if require_ok("expected_wire_len", got) != want["value"]:
                raise Mismatch(f"expected_wire_len: got {got[1]}, expected {want['value']}")
        else:
            check_error("expected_wire_len", got, want["error"])
        got = outcome(self.codec.encode_activation, codec, tc, width, payload, flags)
        enc = c["encode"]
        if not enc["ok"]:
            check_error("encode", got, enc["error"])
            return
        wire = bytes(require_ok("encode", got))
        if wire.hex() != enc["hex"]:
            raise Mismatch(hex_diff("encode", wire.hex(), enc["hex"]))
        dec = c["decode"]
        if dec is None:
            return
        got = outcome(self.codec.decode_activation, codec, tc, width, wire, flags)
        if not dec["ok"]:
            check_error("decode", got, dec["error"])
            return
        bits = _f32_hex(require_ok("decode", got))
        d = diff("decode.f32_bits", bits, dec["f32_bits"])
        if d:
            raise Mismatch(d)
        if (bits == c["input_f32_bits"]) != dec["bit_exact_roundtrip"]:
            raise Mismatch(f"decode.bit_exact_roundtrip: expected {dec['bit_exact_roundtrip']}")

    def case_activation_decode(self, c: dict) -> None:
        got = outcome(self.codec.decode_activation, c["codec_id"], c["token_count"], c["width"],
                       bytes.fromhex(c["wire_hex"]), c["state_flags"])
        dec = c["decode"]
        if not dec["ok"]:
            check_error("decode", got, dec["error"])
            return
        d = diff("decode.f32_bits", _f32_hex(require_ok("decode", got)), dec["f32_bits"])
        if d:
            raise Mismatch(d)

    def case_select(self, c: dict) -> None:
        args = (c["token_count"], c["width"], bytes.fromhex(c["input_hex"]), c["state_flags"],
                [int(ActivationCodec.from_rust_name(n)) for n in c["permitted"]])
        res = c["result"]
        got = outcome(self.codec.select_lossless_codec, *args)
        fused = outcome(self.codec.select_and_encode_lossless, *args)
        if not res["ok"]:
            check_error("select", got, res["error"])
            check_error("select_and_encode_lossless", fused, res["error"])
            return
        codec = int(require_ok("select", got))
        if codec != res["codec_id"]:
            raise Mismatch(f"select: got codec {codec}, expected {res['codec_id']} ({res['codec']})")
        # The fused entry point (used by forwarding) must pick the same codec and bytes.
        fused_codec, fused_wire = require_ok("select_and_encode_lossless", fused)
        if int(fused_codec) != codec:
            raise Mismatch(f"select_and_encode_lossless: codec {int(fused_codec)}, expected {codec}")
        plain = self.codec.encode_activation(codec, args[0], args[1], args[2], args[3])
        if bytes(fused_wire) != bytes(plain):
            raise Mismatch(hex_diff("select_and_encode_lossless bytes", bytes(fused_wire).hex(), bytes(plain).hex()))

    def _check_read(self, label: str, data: bytes, read: dict) -> None:
        codec, policy = read_expectation(read)
        expected, pol = reader_expectation(codec, policy)
        got = outcome(self.frame.read_stage_message_from_buffer, data, read["n_embd"], expected, pol, 0)
        check_read(label, got, read, message_to_case)

    def case_frame(self, c: dict) -> None:
        try:
            msg = message_from_case(c["message"])
        except (ValueError, KeyError) as exc:
            raise Mismatch(f"cannot build the message of the case: {exc}") from None
        w = c["write"]
        got = outcome(self.frame.write_stage_message, msg)
        if not w["ok"]:
            check_error("write", got, w["error"])
            partial = got[2].partial
            if partial is None:
                raise Mismatch("write: the error carries no partial output")
            if bytes(partial).hex() != w["partial_hex"]:
                raise Mismatch(hex_diff("write.partial_hex", bytes(partial).hex(), w["partial_hex"]))
            if c["reads"]:
                raise Mismatch("case records reads after a failed write")
            return
        data = bytes(require_ok("write", got))
        if data.hex() != w["hex"]:
            raise Mismatch(hex_diff("write.hex", data.hex(), w["hex"]))
        if len(data) != w["len"]:
            raise Mismatch(f"write.len: {len(data)}, expected {w['len']}")
        if msg.estimated_wire_bytes() != w["estimated_wire_bytes"]:
            raise Mismatch(f"write.estimated_wire_bytes: {msg.estimated_wire_bytes()}, expected {w['estimated_wire_bytes']}")
        for i, read in enumerate(c["reads"]):
            self._check_read(f"reads[{i}] {read['api']}", data, read)

    def case_malformed(self, c: dict) -> None:
        data = malformed_bytes(c)
        for i, read in enumerate(c["reads"]):
            self._check_read(f"reads[{i}] {read['api']}", data, read)


# --- the command --------------------------------------------------------------------------
def _files(paths: list[str]) -> list[tuple[Path, Optional[str]]]:
    """The vector files, each with why it cannot be read where a folder already says so: each
    path given that is not a directory, and everything named ``*.jsonl`` under each directory
    but a subdirectory (sorted; a dangling link or a device that bears the name fails as a file
    that cannot be read), symlinked folders followed, once each; a folder that cannot be listed
    is itself one that fails (it was skipped, and the run passed without its cases).  A file
    reached twice (named again, or under two folders given) runs once: its cases counted twice
    made the totals lie."""
    found: list[tuple[Path, Optional[str]]] = []
    for p in map(Path, paths):
        if not p.is_dir():
            found.append((p, None))
            continue
        under: list[tuple[Path, Optional[str]]] = []
        seen: set[str] = set()
        def unlisted(exc: OSError) -> None:
            under.append((Path(exc.filename), os_reason(exc)))

        for folder, subfolders, names in os.walk(p, onerror=unlisted, followlinks=True):
            real = os.path.realpath(folder)
            if real in seen:  # a link back up the tree
                subfolders.clear()
                continue
            seen.add(real)
            under += [(Path(folder, name), None) for name in names if name.endswith(".jsonl")]
        found += sorted(under)
    kept, ran = [], set()  # ran: the real paths of the files kept
    for path, why in found:
        real = os.path.realpath(path)
        if why is None and real in ran:
            continue
        ran.add(real)
        kept.append((path, why))
    return kept


def not_readable(path: str) -> Optional[str]:
    """Why ``path`` cannot be run (it does not exist, or it is neither a directory nor a
    regular file: a FIFO or a device would be read without end), else None."""
    p = Path(path)
    if not p.exists():
        return "no such file or directory"
    if not (p.is_dir() or p.is_file()):
        return "not a directory or a regular file"
    return None


#: The longest line read as a case: a longer one is skipped, never held whole (the vectors' longest is 265 KB).
MAX_CASE_LINE_BYTES = 64 << 20


def _lines(fh):
    """Each line of ``fh``, None for one over :data:`MAX_CASE_LINE_BYTES` (read to its end in pieces)."""
    while raw := fh.readline(MAX_CASE_LINE_BYTES + 1):
        if len(raw) <= MAX_CASE_LINE_BYTES or raw.endswith(b"\n"):
            yield raw
            continue
        while (rest := fh.readline(1 << 20)) and not rest.endswith(b"\n"):
            pass
        yield None


def _cases(path: Path):
    """``(lineno, case or None, problem)`` for each non-blank line of ``path``: a case is a
    JSON object; a line that is not (not UTF-8, not JSON, another JSON value) or a file that
    cannot be read gives a problem instead, failed and reported like a case."""
    why = not_readable(str(path))
    if why is not None:  # a FIFO would be read without end
        yield 0, None, f"cannot read it: {why}"
        return
    try:
        with open(path, "rb") as fh:
            for lineno, raw in enumerate(_lines(fh), 1):
                if raw is None:
                    yield lineno, None, f"a line over {MAX_CASE_LINE_BYTES >> 20} MiB, longer than any case"
                    continue
                try:  # a byte order mark opening the file is skipped, as topology files' is
                    line = raw.decode("utf-8-sig" if lineno == 1 else "utf-8")
                except UnicodeDecodeError as exc:
                    yield lineno, None, f"not UTF-8 (byte {exc.start + 1} of the line)"
                    continue
                if not line.strip():
                    continue
                try:
                    case = json.loads(line)
                except json.JSONDecodeError as exc:
                    yield lineno, None, f"not JSON ({exc})"
                    continue
                except RecursionError:  # Python's decoder recurses per level of nesting
                    yield lineno, None, "JSON nested too deeply to decode"
                    continue
                except ValueError:  # an integer past Python's int_max_str_digits
                    yield lineno, None, f"a JSON number too long to read (over {sys.get_int_max_str_digits()} digits)"
                    continue
                if not isinstance(case, dict):
                    yield lineno, None, f"a case is a JSON object, not {_json_kind(case)}"
                    continue
                if not isinstance(case.get("group"), str):
                    yield lineno, None, "a case names its group (a string \"group\"); this object does not"
                    continue
                yield lineno, case, None
    except OSError as exc:
        why = describe(exc)  # "PATH: reason": the FAIL line names the path already
        yield 0, None, f"cannot read it: {why.removeprefix(f'{exc.filename}: ')}"


#: The per-group line that counts the lines that are no case (not JSON, no group, unreadable files).
NOT_A_CASE = "(not a case)"


def _json_kind(value) -> str:
    if isinstance(value, bool):
        return "a boolean"
    if value is None:
        return "null"
    return {list: "an array", str: "a string"}.get(type(value), "a number")


def run(paths: list[str], impl: str, *, max_report: int = 10, out=None, verbose: bool = False,
        protocol: Optional[int] = None) -> tuple[int, int]:
    """Run every case under ``paths``; print failures and the summary; return (passed, failed)."""
    out = sys.stdout if out is None else out

    def say(text: str) -> None:
        # a lone surrogate (a JSON "\ud800" escape in an id or a note) as its escape: stdout's
        # encoder would refuse it and stop the run
        print(text.encode("utf-8", "backslashreplace").decode("utf-8"), file=out)

    runner = Runner(impl)
    passed = failed = 0
    per_group: dict[str, list[int]] = {}
    for path, why in _files(paths):
        where = shown(str(path))  # a byte of its name that is not UTF-8 as \xff, as given
        for lineno, case, problem in _cases(path) if why is None else [(0, None, f"cannot read it: {why}")]:
            if case is None:
                failed += 1
                per_group.setdefault(NOT_A_CASE, [0, 0])[1] += 1
                if failed <= max_report:
                    say(f"FAIL {where}{f':{lineno}' if lineno else ''}: {problem}")
                continue
            group = str(case.get("group"))
            tally = per_group.setdefault(group, [0, 0])
            try:
                check_codec_naming(case)
                (conformance_gen.runner_for(case, impl, protocol) or runner).run(case)
            except Mismatch as exc:
                failed += 1
                tally[1] += 1
                if failed <= max_report:
                    say(f"FAIL {case.get('id', '?')} [{group}] {where}:{lineno}")
                    say(f"     note: {case.get('note', '')}")
                    say(f"     {exc}")
                continue
            except Exception as exc:  # report a crash of the runner itself, keep going
                failed += 1
                tally[1] += 1
                if failed <= max_report:
                    # a KeyError is a case written without a field its group needs
                    why = (f"the case has no field {exc.args[0]!r}" if isinstance(exc, KeyError) and exc.args
                           else f"runner error {type(exc).__name__}: {exc}")
                    say(f"FAIL {case.get('id', '?')} [{group}] {where}:{lineno}: {why}")
                continue
            passed += 1
            tally[0] += 1
    if failed > max_report:
        say(f"... {failed - max_report} more failures not shown (--max-report)")
    if verbose or failed:
        for group, (p, f) in sorted(per_group.items()):
            say(f"  {group}: {p} passed, {f} failed")
    say(f"implementation: {impl}")
    say(f"conformance: {passed} passed, {failed} failed")
    return passed, failed


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="skippy-wire conformance", description=doc_summary(__doc__))
    parser.add_argument("paths", nargs="+", type=given_path, metavar="DIR",
                        help="directories (searched for *.jsonl) or files")
    parser.add_argument("--impl", choices=_impl.IMPLEMENTATIONS, default=None,
                        help=f"implementation to check (default: the live one, {_impl.IMPLEMENTATION})")
    parser.add_argument("--max-report", type=int_at_least(0), default=10, help="failures to print in full")
    parser.add_argument("--protocol", type=int, choices=(16, 17), default=None,
                        help="state version of the cases (default: from each case id, v15 otherwise)")
    parser.add_argument("-v", "--verbose", action="store_true", help="print per-group counts")
    return parser


def main(argv: Optional[list[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    for path in args.paths:
        why = not_readable(path)
        if why is not None:
            parser.error(f"{path}: {why}")
    impl = args.impl or _impl.IMPLEMENTATION
    try:
        passed, failed = run(args.paths, impl, max_report=args.max_report, verbose=args.verbose,
                             protocol=args.protocol)
    except ImportError as exc:
        parser.error(f"implementation {impl} is not available: {exc}")
    if not passed + failed:  # a wrong path must not pass a check that ran nothing
        print(error_line(f"no cases in {', '.join(args.paths)} (*.jsonl files of golden vectors)"), file=sys.stderr)
        return 1
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
