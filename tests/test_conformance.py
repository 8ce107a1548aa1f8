"""The ``conformance`` command: all five groups on each implementation, readable failure
reports, the final line and the exit status."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import GOLDEN

from skippy_wire.tools import conformance


def test_public_vectors_pass_on_every_implementation(impl, vectors_dir, capsys):
    assert conformance.main([str(vectors_dir), "--impl", impl, "-v"]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[-1].startswith("conformance: ") and out[-1].endswith(" passed, 0 failed")
    passed = int(out[-1].split()[1])
    assert passed >= 3257
    for group in conformance.GROUPS:
        assert any(line.strip().startswith(f"{group}: ") for line in out), group


def _read(path):
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh]


def _mutated(vectors_dir, tmp_path):
    """Four cases, each with one recorded expectation changed."""
    frame_cases = _read(vectors_dir / "frame.jsonl")
    ok = next(c for c in frame_cases if c["write"]["ok"] and c["reads"][0]["ok"])
    bad_bytes = json.loads(json.dumps(ok))
    bad_bytes["write"]["hex"] = bad_bytes["write"]["hex"][:-2] + "00"
    bad_consumed = json.loads(json.dumps(ok))
    bad_consumed["reads"][0]["consumed"] += 1
    bad_field = json.loads(json.dumps(ok))
    bad_field["reads"][2]["message"]["request_id"] += 1
    sel = _read(vectors_dir / "select.jsonl")[0]
    sel["result"] = {"ok": False, "error": {"kind": "InvalidData", "message": "nope"}}
    good = _read(vectors_dir / "malformed.jsonl")[0]
    path = tmp_path / "cases.jsonl"
    path.write_text("\n".join(json.dumps(c) for c in (bad_bytes, bad_consumed, bad_field, sel, good)) + "\n")
    return path, ok["id"]


def test_failures_are_reported_readably_and_set_the_exit_status(impl, vectors_dir, tmp_path, capsys):
    path, case_id = _mutated(vectors_dir, tmp_path)
    assert conformance.main([str(tmp_path), "--impl", impl]) == 1
    out = capsys.readouterr().out
    assert out.rstrip().splitlines()[-1] == "conformance: 1 passed, 4 failed"
    assert f"FAIL {case_id} [frame]" in out
    assert "write.hex:" in out and "first difference at byte" in out
    assert "consumed" in out and "request_id: got" in out
    assert "select: succeeded" in out and "'nope'" in out


def test_report_is_limited_but_counts_everything(vectors_dir, tmp_path, capsys):
    path, _ = _mutated(vectors_dir, tmp_path)
    assert conformance.main([str(path), "--max-report", "1"]) == 1
    out = capsys.readouterr().out
    assert out.count("FAIL ") == 1 and "3 more failures not shown" in out
    assert out.rstrip().endswith("conformance: 1 passed, 4 failed")


def test_unknown_group_and_bad_json_fail(tmp_path, capsys):
    (tmp_path / "x.jsonl").write_text('{"id": "z-1", "group": "mystery"}\nnot json\n')
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "unknown group 'mystery'" in out and "not JSON" in out
    assert out.rstrip().endswith("conformance: 0 passed, 2 failed")


def test_an_object_without_a_group_is_no_case(tmp_path, capsys):
    """It was "FAIL ? [None] ...: unknown group None", and a group "None" in the tally."""
    (tmp_path / "x.jsonl").write_text('{}\n{"id": "z-2", "group": 7}\n')
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for lineno in (1, 2):
        assert f"FAIL {tmp_path / 'x.jsonl'}:{lineno}: a case names its group (a string \"group\"); " in out
    assert "None" not in out and out.rstrip().endswith("conformance: 0 passed, 2 failed")


def test_missing_path_is_a_usage_error(tmp_path, capsys):
    """As every usage error: argparse's usage line first, then the one-line error."""
    with pytest.raises(SystemExit) as stopped:
        conformance.main([str(tmp_path / "absent")])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: skippy-wire conformance ")
    assert err.endswith(f"\nskippy-wire: error: {tmp_path / 'absent'}: no such file or directory\n")


def test_a_directory_without_cases_fails(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("no vectors here")
    assert conformance.main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert captured.out.rstrip().endswith("conformance: 0 passed, 0 failed")
    assert captured.err == f"skippy-wire: error: no cases in {tmp_path} (*.jsonl files of golden vectors)\n"


def test_command_line_entry_point(vectors_dir):
    result = subprocess.run(
        [sys.executable, "-m", "skippy_wire", "conformance", str(vectors_dir / "frame.jsonl"), "--impl", "python"],
        capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert result.stdout.rstrip().splitlines()[-1] == "conformance: 386 passed, 0 failed"


def test_a_line_that_is_no_case_fails_as_one_and_the_run_goes_on(vectors_dir, tmp_path, capsys):
    """A JSON value other than an object, or a line that is not UTF-8, is a failure with
    its line number, not a crash: the other cases still run and the summary comes last."""
    good = (vectors_dir / "select.jsonl").read_text().splitlines()[0]
    (tmp_path / "x.jsonl").write_bytes(b'[1, 2]\n"a"\nnull\n7\n{"id": "\xff"}\n' + good.encode() + b"\n")
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    path = tmp_path / "x.jsonl"
    for lineno, what in ((1, "an array"), (2, "a string"), (3, "null"), (4, "a number")):
        assert f"FAIL {path}:{lineno}: a case is a JSON object, not {what}\n" in out
    assert f"FAIL {path}:5: not UTF-8 (byte 9 of the line)\n" in out
    assert out.rstrip().endswith("conformance: 1 passed, 5 failed")


def test_a_setup_case_whose_scripted_peer_is_malformed_fails_as_the_case_at_once(tmp_path, capsys):
    """The scripted peer's thread printed a traceback and the side under test waited out the
    case's deadline (here 20 s; a deadline of a billion ms would have held the run for days)."""
    server, client = (_read(GOLDEN / "v17" / f"setup_{side}.jsonl")[0] for side in ("server", "client"))
    no_hello = {**server, "client_script": {k: v for k, v in server["client_script"].items() if k != "hello_hex"}}
    cases = [{**server, "client_script": None}, no_hello, {**client, "server_script": 5}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps({**c, "deadline_ms": 20_000}) + "\n" for c in cases))
    assert conformance.main([str(tmp_path)]) == 1
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "Exception in thread" not in captured.err, captured.err
    lines = [line for line in captured.out.splitlines() if line.startswith("FAIL")]
    assert [line.split(": ", 1)[1] for line in lines] == [
        "runner error TypeError: 'NoneType' object is not subscriptable", "the case has no field 'hello_hex'",
        "runner error TypeError: 'int' object is not subscriptable"]


def test_a_line_longer_than_any_case_is_skipped_unread_and_the_run_goes_on(vectors_dir, tmp_path, capsys, monkeypatch):
    # a line was read whole, however long: twice its size in memory
    monkeypatch.setattr(conformance, "MAX_CASE_LINE_BYTES", 1 << 20)
    good = (vectors_dir / "select.jsonl").read_text().splitlines()[0]
    path = tmp_path / "x.jsonl"
    path.write_text(f"{good}\n" + "[" * (3 << 20) + f"\n{good}\n" + " " * ((1 << 20) - 1) + "\n")
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {path}:2: a line over 1 MiB, longer than any case\n" in out
    assert out.rstrip().endswith("conformance: 2 passed, 1 failed")  # the one at the limit is read (blank)


def test_what_bears_the_name_of_a_vector_file_but_cannot_be_read_fails(vectors_dir, tmp_path, capsys):
    """Under a directory, a subdirectory named *.jsonl is searched, not read; a dangling link
    or a device with that name fails as a file that cannot be read (they were skipped, so a
    vector file gone missing passed unseen), and the run goes on."""
    (tmp_path / "select.jsonl").write_text((vectors_dir / "select.jsonl").read_text())
    (tmp_path / "old.jsonl").mkdir()
    (tmp_path / "gone.jsonl").symlink_to(tmp_path / "nowhere")
    (tmp_path / "zero.jsonl").symlink_to("/dev/zero")  # read without end, were it opened
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {tmp_path / 'gone.jsonl'}: cannot read it: no such file or directory\n" in out
    assert f"FAIL {tmp_path / 'zero.jsonl'}: cannot read it: not a directory or a regular file\n" in out
    assert out.rstrip().endswith(" passed, 2 failed")


def test_a_fifo_or_a_device_is_a_usage_error(tmp_path, capsys):
    """Neither a directory nor a regular file: it would be read without end (/dev/zero)."""
    import os

    fifo = tmp_path / "cases.jsonl"
    os.mkfifo(fifo)
    for path in (str(fifo), "/dev/zero"):
        with pytest.raises(SystemExit) as stopped:
            conformance.main([path])
        assert stopped.value.code == 2
        assert capsys.readouterr().err.endswith(f"\nskippy-wire: error: {path}: not a directory or a regular file\n")


def test_a_file_that_cannot_be_read_fails_and_the_run_goes_on(vectors_dir, tmp_path, capsys, monkeypatch):
    (tmp_path / "a.jsonl").write_text("{}\n")
    (tmp_path / "b.jsonl").write_text((vectors_dir / "select.jsonl").read_text())
    real_open = open

    def refusing_open(path, *args, **kwargs):
        if str(path).endswith("a.jsonl"):
            raise PermissionError(13, "Permission denied", str(path))
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(conformance, "open", refusing_open, raising=False)
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {tmp_path / 'a.jsonl'}: cannot read it: permission denied\n" in out
    assert out.rstrip().endswith(" passed, 1 failed")


def test_an_implementation_that_does_not_load_is_named(vectors_dir, capsys, monkeypatch):
    """Without --impl the live implementation is the one checked, and named if it fails."""
    def broken(impl):
        raise ImportError("the extension is not built")

    monkeypatch.setattr(conformance, "Runner", broken)
    with pytest.raises(SystemExit) as stopped:
        conformance.main([str(vectors_dir)])
    assert stopped.value.code == 2
    err = capsys.readouterr().err
    assert f"implementation {conformance._impl.IMPLEMENTATION} is not available: the extension is not built" in err


def test_text_that_is_not_utf8_is_shown_escaped(tmp_path, capsys):
    """A case id or note holding a lone surrogate (a JSON escape), or a file name with a
    byte that is not UTF-8, is printed as its escape: a strict stdout (a UTF-8 locale, the
    capture here) would refuse it and stop the run.  The name's byte as given, ``\\xff``
    (it was ``\\udcff``, Python's surrogate, which no command takes back as the name); a
    JSON escape as written."""
    import os

    path = tmp_path / os.fsdecode(b"cases-\xff.jsonl")
    path.write_text('{"id": "z-\\ud800", "group": "mystery", "note": "\\udcff"}\nnot json\n')
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL z-\\ud800 [mystery] {tmp_path}/cases-\\xff.jsonl:1\n     note: \\udcff\n" in out
    assert f"FAIL {tmp_path}/cases-\\xff.jsonl:2: not JSON" in out
    assert out.rstrip().endswith("conformance: 0 passed, 2 failed")


def test_a_byte_order_mark_opening_a_file_is_skipped(vectors_dir, tmp_path, capsys):
    """A Windows editor's BOM failed the first case as "not JSON (Unexpected UTF-8 BOM ...)"."""
    lines = (vectors_dir / "frame.jsonl").read_text().splitlines()[:2]
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + "\n".join(lines).encode() + b"\n")
    assert conformance.main([str(path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("conformance: 2 passed, 0 failed")


def test_the_per_group_counts_add_up_to_the_total(vectors_dir, tmp_path, capsys):
    """`-v` left the lines that are no case out of its per-group counts (0 failed beside a
    total of 1 failed)."""
    good = (vectors_dir / "frame.jsonl").read_text().splitlines()[0]
    path = tmp_path / "mixed.jsonl"
    path.write_text(f"{good}\nnot json\n")
    assert conformance.main([str(path), "-v"]) == 1
    out = capsys.readouterr().out
    assert "  (not a case): 0 passed, 1 failed\n" in out and "  frame: 1 passed, 0 failed\n" in out
    assert out.rstrip().endswith("conformance: 1 passed, 1 failed")


def test_json_nested_too_deeply_fails_as_a_line(tmp_path, capsys):
    """Python's JSON decoder recurses per level: a fuzzed line of 100 000 brackets is a
    failed line, not a RecursionError traceback."""
    path = tmp_path / "deep.jsonl"
    path.write_text("[" * 100_000 + "]" * 100_000 + "\n")
    assert conformance.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {path}:1: JSON nested too deeply to decode\n" in out
    assert out.rstrip().endswith("conformance: 0 passed, 1 failed")


def test_a_number_too_long_to_read_fails_as_a_line_and_the_run_goes_on(vectors_dir, tmp_path, capsys):
    """A 5000-digit number is past Python's int_max_str_digits: its ValueError ended the
    whole run with no summary, the good cases before and after it unreported."""
    good = (vectors_dir / "frame.jsonl").read_text().splitlines()[0]
    path = tmp_path / "long.jsonl"
    path.write_text(f"{good}\n{{\"group\": \"frame\", \"x\": {'1' * 5000}}}\n{good}\n")
    assert conformance.main([str(path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {path}:2: a JSON number too long to read (over 4300 digits)\n" in out
    assert out.rstrip().endswith("conformance: 2 passed, 1 failed")


def test_a_case_without_a_field_it_needs_names_the_field(vectors_dir, tmp_path, capsys):
    case = _read(vectors_dir / "frame.jsonl")[0]
    del case["write"]
    (tmp_path / "cases.jsonl").write_text(json.dumps(case) + "\n")
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {case['id']} [frame] {tmp_path / 'cases.jsonl'}:1: the case has no field 'write'\n" in out


@pytest.mark.parametrize("version", ["v16", "v17"])
def test_a_failed_case_names_its_file_by_path_and_the_first_differing_byte(version, tmp_path, capsys):
    """A v16/v17 write that differed said only "88 bytes differ from the expected 88", under
    the bare name frame.jsonl, which v15, v16 and v17 all have."""
    case = _read(GOLDEN / version / "frame.jsonl")[0]
    wire = bytearray.fromhex(case["write"]["hex"])
    wire[30] ^= 0xFF
    case["write"]["hex"] = wire.hex()
    path = tmp_path / version / "frame.jsonl"
    path.parent.mkdir()
    path.write_text(json.dumps(case) + "\n")
    assert conformance.main([str(tmp_path), "--protocol", version[1:]]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {case['id']} [frame] {path}:1\n" in out
    assert f"write.hex: {len(wire)} bytes; first difference at byte 30: got " in out


def test_a_case_whose_length_alone_is_wrong_says_so(tmp_path, capsys):
    """With the bytes equal and only the case's encode.len off, the failure read "one is a
    prefix of the other (common 200 bytes)"."""
    case = next(c for c in _read(GOLDEN / "v16" / "activation_frame.jsonl") if c["encode"]["ok"])
    case["encode"]["len"] += 1
    (tmp_path / "activation_frame.jsonl").write_text(json.dumps(case) + "\n")
    assert conformance.main([str(tmp_path), "--protocol", "16"]) == 1
    length = len(case["encode"]["hex"]) // 2
    assert f"     encode.len: got {length}, expected {length + 1}\n" in capsys.readouterr().out


@pytest.mark.parametrize("version, file", [("v15", "activation.jsonl"), ("v16", "activation_frame.jsonl"),
                                           ("v17", "activation_frame.jsonl")])
def test_a_case_naming_its_codec_two_different_ways_fails(version, file, tmp_path, capsys):
    # A case whose codec name and codec id disagree was edited: it must not pass by the id.
    case = next(c for c in _read(GOLDEN / version / file) if c.get("codec") == "F16RneV1")
    case["codec"] = "Bf16RneV1"
    (tmp_path / "cases.jsonl").write_text(json.dumps(case) + "\n")
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {case['id']} [{case['group']}] {tmp_path / 'cases.jsonl'}:1\n" in out
    assert f"     case names codec Bf16RneV1 with id {case['codec_id']}\n" in out


def test_a_folder_that_cannot_be_listed_fails_and_a_linked_one_is_run(vectors_dir, tmp_path, capsys, monkeypatch):
    """An unreadable subfolder and a symlinked one were skipped in silence (rglob), and the run
    passed without their cases; a link back up the tree is followed once."""
    good = (vectors_dir / "select.jsonl").read_text().splitlines()[0] + "\n"
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "s.jsonl").write_text(good)
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "s.jsonl").write_text(good * 2)
    root = tmp_path / "root"
    (root / "locked").mkdir(parents=True)
    (root / "locked" / "s.jsonl").write_text(good)
    (root / "linked").symlink_to(tmp_path / "elsewhere")
    (root / "up").symlink_to(root)
    (root / "a").symlink_to(tmp_path / "a")
    listed = os.scandir

    def scandir(path="."):  # (the tests run as root, whom chmod 000 does not stop)
        if os.path.basename(os.fspath(path)) == "locked":
            raise PermissionError(13, "Permission denied", os.fspath(path))
        return listed(path)

    monkeypatch.setattr(os, "scandir", scandir)
    assert conformance.main([str(root)]) == 1
    out = capsys.readouterr().out
    assert f"FAIL {root / 'locked'}: cannot read it: permission denied" in out, out
    assert out.rstrip().endswith("conformance: 3 passed, 1 failed"), out


def test_a_misspelt_choice_or_an_endless_deadline_fails_as_the_case(tmp_path, capsys):
    """A misspelt step, mode, op or policy ran as another check (echo, server_setup,
    recv_ready, Fixed) and could pass; a deadline of 1e12 ms held the run without end."""
    server = _read(GOLDEN / "v17" / "setup_server.jsonl")[0]
    ready = _read(GOLDEN / "v16" / "ready.jsonl")[0]
    frame = next(c for c in _read(GOLDEN / "v15" / "frame.jsonl") if any("policy" in r for r in c["reads"]))
    reads = [{**r, "policy": "NoSuchPolicy"} if "policy" in r else r for r in frame["reads"]]
    cases = [{**server, "client_script": {**server["client_script"], "then": "no_such_step"}},
             {**server, "mode": "no_such_mode"}, {**ready, "op": "send_raedy"}, {**frame, "reads": reads},
             {**server, "client_script": {**server["client_script"], "then": "wait"}, "deadline_ms": 1e12}]
    (tmp_path / "bad.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    assert conformance.main([str(tmp_path)]) == 1
    out = capsys.readouterr().out
    for text in ("unknown client_script.then 'no_such_step' (close, wait, raw, echo_spaced, wrong_generation, echo)",
                 "unknown mode 'no_such_mode' (server_setup, recording_setup)",
                 "unknown op 'send_raedy' (send_ready or recv_ready)",
                 "unknown activation codec policy 'NoSuchPolicy'",
                 "deadline_ms 1000000000000.0: a case waits 0 to 60000 ms"):
        assert text in out, (text, out)
    assert out.rstrip().endswith("conformance: 0 passed, 5 failed"), out


def test_a_file_given_twice_runs_once(vectors_dir, tmp_path, capsys):
    """A file named again, or reached under two folders given, counted its cases twice."""
    good = (vectors_dir / "select.jsonl").read_text().splitlines()[:2]
    (tmp_path / "s.jsonl").write_text("\n".join(good) + "\n")
    (tmp_path / "again.jsonl").symlink_to(tmp_path / "s.jsonl")
    assert conformance.main([str(tmp_path), str(tmp_path / "s.jsonl"), str(tmp_path)]) == 0
    assert capsys.readouterr().out.rstrip().endswith("conformance: 2 passed, 0 failed")


@pytest.mark.parametrize("version", ["v15", "v16", "v17"])
def test_a_malformed_case_without_reads_or_with_a_wrong_length_fails(version, tmp_path, capsys):
    """v16/v17 compared neither a malformed case's len nor a write's len, and a malformed
    case with no reads passed in every version, having checked nothing."""
    folder = GOLDEN / version
    malformed = _read(folder / "malformed.jsonl")[0]
    cases = [dict(malformed, reads=[]), dict(malformed, len=malformed["len"] + 1),
             dict(malformed, len=str(malformed["len"])), dict(malformed, reads={"a": 1})]
    if version != "v15":
        frame = next(c for c in _read(folder / "frame.jsonl") if c["write"]["ok"])
        cases.append(dict(frame, write=dict(frame["write"], len=frame["write"]["len"] - 1)))
    (tmp_path / "cases.jsonl").write_text("".join(json.dumps(c) + "\n" for c in cases))
    assert conformance.main([str(tmp_path)] + ([] if version == "v15" else ["--protocol", version[1:]])) == 1
    out = capsys.readouterr().out
    assert "     case records no reads: it checks nothing\n" in out
    assert f"     case bytes_hex has {malformed['len']} bytes, len says {malformed['len'] + 1}\n" in out
    assert f"     case len is '{malformed['len']}', not a byte count\n" in out  # it said "0 bytes, len says 0"
    assert "     case reads is {'a': 1}, not a list of recorded reads (objects)\n" in out  # a runner TypeError
    if version != "v15":
        assert f"     write.len: {frame['write']['len']}, expected {frame['write']['len'] - 1}\n" in out
    assert out.rstrip().endswith(f"conformance: 0 passed, {len(cases)} failed")
