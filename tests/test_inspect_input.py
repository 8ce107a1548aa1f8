"""``skippy-wire inspect`` on the inputs a user, a script or a fuzzer hands it: a stream
read only as far as the record being parsed (an endless or live input neither exhausts
memory nor waits for its end), stdin closed, a malformed message named by its first fault,
and a large activation summarised without a Python object per value."""

from __future__ import annotations

import io
import os
import re
import struct
import subprocess
import sys
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from skippy_wire.tools.inspect import main
from skippy_wire.wire.constants import ActivationCodec
from skippy_wire.wire.frame import write_stage_message
from skippy_wire.wire.messages import StageStateHeader, StageWireMessage, WireMessageKind as K
from skippy_wire.wire.protocol import WireProtocol

from test_inspect import _messages, _stream
from test_inspect_gen_output import _stop


class _Stream(io.RawIOBase):
    """A pipe: ``data``, then ``then`` forever (bytes) or raised (an exception), at most
    ``piece`` bytes a read; reading it whole (``read()``) fails the test."""

    def __init__(self, data: bytes, then=b"", piece: int = 4096) -> None:
        self.data, self.then, self.piece, self.delivered = data, then, piece, 0

    def readable(self) -> bool:
        return True

    def read(self, n=-1):
        assert n is not None and n >= 0, "the whole input was asked for before a record was shown"
        return self.read1(n)

    def read1(self, n=-1):
        assert n is not None and n >= 0, "the whole input was asked for before a record was shown"
        n = min(n, self.piece)
        if self.delivered < len(self.data):
            chunk = self.data[self.delivered:self.delivered + n]
        elif isinstance(self.then, BaseException):
            raise self.then
        else:
            chunk = (self.then * (n // max(len(self.then), 1) + 1))[:n]
        self.delivered += len(chunk)
        return chunk


class _Stdin:
    def __init__(self, stream) -> None:
        self.buffer = stream


def test_an_endless_input_is_read_only_as_far_as_its_first_record(monkeypatch, capsys):
    """``inspect - < /dev/zero``: the first record is malformed, said at once; the input
    is not read to its (missing) end first."""
    endless = _Stream(b"", then=b"\0")
    monkeypatch.setattr(sys, "stdin", _Stdin(endless))
    assert main(["-"]) == 1
    out, err = capsys.readouterr()
    assert out == ""
    assert err.startswith("skippy-wire: error: #0 @0: InvalidData: unknown stage message kind (at least ")
    assert endless.delivered <= 1 << 20


def test_a_live_input_is_dissected_as_it_arrives(monkeypatch, capsys):
    """A capture still being written (``tail -f ... | inspect -``): every record that has
    arrived is shown before the next read waits; Ctrl-C then stops it."""
    data = _stream(_messages())
    monkeypatch.setattr(sys, "stdin", _Stdin(_Stream(data, then=KeyboardInterrupt(), piece=50)))
    try:
        main(["-"])
    except KeyboardInterrupt:
        pass
    else:
        raise AssertionError("the input's reads stopped before it ended")
    out = capsys.readouterr().out
    assert "CONFIGURE_GENERATION (14)" in out and "PREFILL_FINAL_EMBD (4)" in out
    assert f"#2 @{len(data) - 80} message, 80 bytes: STOP (3)" in out


def test_a_stream_cut_short_says_how_much_is_left(monkeypatch, capsys):
    data = _stream(_messages())
    monkeypatch.setattr(sys, "stdin", _Stdin(_Stream(data[:-30], piece=7)))
    assert main(["-"]) == 1
    out, err = capsys.readouterr()
    assert "PREFILL_FINAL_EMBD (4)" in out
    assert err == (f"skippy-wire: error: #2 @{len(data) - 80}: UnexpectedEof: failed to fill whole buffer "
                   "(50 bytes left)\n")


def test_a_file_is_read_as_a_stream_with_its_size_known(tmp_path, capsys):
    path = tmp_path / "hop1-messages.bin"
    path.write_bytes(b"\x0c\x00\x00\x00" + b"\0" * (3 << 20))
    assert main([str(path)]) == 1
    assert capsys.readouterr().err == (f"skippy-wire: error: #0 @0: InvalidData: unknown stage message kind "
                                       f"({(3 << 20) + 4} bytes left)\n")


def test_a_proc_file_whose_size_says_zero_is_read_for_what_it_holds(capsys):
    # /proc's regular files report st_size 0: "(0 bytes left)" was said of 100-odd bytes
    held = len(Path("/proc/self/cmdline").read_bytes())
    assert main(["/proc/self/cmdline"]) == 1
    left = re.fullmatch(r"skippy-wire: error: #0 @0: .*\((?:at least )?(\d+) bytes left\)\n", capsys.readouterr().err)
    assert left and int(left[1]) >= held > 0


def test_stdin_closed_is_one_line(monkeypatch, capsys):
    """``skippy-wire inspect - <&-``: Python starts with no sys.stdin."""
    monkeypatch.setattr(sys, "stdin", None)
    assert main(["-"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", "skippy-wire: error: stdin is closed: nothing to dissect\n")


def test_a_v17_message_is_refused_for_its_first_fault_not_for_its_short_activation(monkeypatch, capsys):
    """Without the link's agreement only a message the reader refuses for want of it is
    shown undecoded; one refused earlier keeps the reader's reason, whatever its count."""
    stop = bytearray(WireProtocol(17).write(_stop(17))) + b"\0" * 16
    struct.pack_into("<i", stop, 60, 16)  # an activationless kind with 16 activation bytes
    monkeypatch.setattr(sys, "stdin", _Stdin(io.BytesIO(bytes(stop))))
    assert main(["-", "--messages"]) == 1
    err = capsys.readouterr().err
    assert "#0 @0: InvalidData: activationless stage message contains activation payload" in err

    v15 = _stream(_messages()[1:2])  # a bf16 activation of 12 bytes, read as v17
    monkeypatch.setattr(sys, "stdin", _Stdin(io.BytesIO(v15)))
    assert main(["-", "--protocol", "17"]) == 1
    err = capsys.readouterr().err
    assert "#0 @0: InvalidData: unsupported stage state version" in err and "30-byte header" not in err


def test_a_large_activation_is_summarised_in_memory_of_its_size(tmp_path, capsys):
    """A 4 MiB activation: min/max/mean and the first values, without a Python float per
    value (a 512 MiB one would take gigabytes)."""
    n = 1 << 20
    state = StageStateHeader.new(K.PREFILL_EMBD)
    state.source_stage_index, state.activation_codec = 0, ActivationCodec.RAW_F32_V1
    values = np.arange(n, dtype="<f4")
    values[3] = np.nan
    msg = StageWireMessage(K.PREFILL_EMBD, 0, 4, state, 1, 1, None, None, [1, 2, 3, 4], [], values.tobytes())
    path = tmp_path / "hop1-messages.bin"
    path.write_bytes(write_stage_message(msg))
    tracemalloc.start()
    try:
        assert main([str(path)]) == 0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    out = capsys.readouterr().out
    assert f"min 0  max {n - 1:.6g}  mean {(n * (n - 1) / 2 - 3) / (n - 1):.6g}  non-finite 1" in out
    assert "values: [0, 1, 2, nan, 4, 5, 6, 7, ...]" in out and "4 rows x 262144 (n_embd)" in out
    assert peak < 4 * (4 * n), f"peak {peak} bytes for a {4 * n}-byte activation"


def test_a_closed_stdout_is_the_quiet_exit_141(tmp_path, monkeypatch, capsys):
    """``skippy-wire inspect FILE | head -1``: not an error line about the input."""
    from skippy_wire.tools.cli import main as cli_main

    path = tmp_path / "hop1-messages.bin"
    path.write_bytes(_stream(_messages()))

    class ClosedStdout(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", ClosedStdout())
    assert cli_main(["inspect", str(path)]) == 141
    assert capsys.readouterr().err == ""


@pytest.mark.parametrize("unbuffered", [False, True])
def test_a_full_stdout_is_named_not_taken_for_the_input(tmp_path, unbuffered):
    """``inspect --values FILE > /dev/full`` said "no space left on device" as if reading
    the capture had failed (its handler for the input's errors caught stdout's)."""
    path = tmp_path / "hop1-messages.bin"
    path.write_bytes(_stream(_messages()))
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | ({"PYTHONUNBUFFERED": "1"}
                                                                               if unbuffered else {})
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "skippy_wire", "inspect", "--values", str(path)], stdout=full,
                              stderr=subprocess.PIPE, env=env, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "skippy-wire: error: cannot write to stdout: no space left on device\n"


def test_a_file_name_that_is_not_utf8_is_shown_escaped(tmp_path, capsys):
    """``inspect $'\\xff.bin'`` on an empty capture: a strict stdout (a UTF-8 locale, the
    capture here) would refuse the name's undecodable byte."""
    import os

    path = tmp_path / os.fsdecode(b"hop1-\xff.bin")
    path.write_bytes(b"")
    assert main([str(path)]) == 0
    assert capsys.readouterr().out == f"0 records, 0 bytes: {tmp_path}/hop1-\\udcff.bin is empty, nothing to dissect\n"
