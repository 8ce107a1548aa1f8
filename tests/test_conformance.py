"""The ``conformance`` command: all five groups on each implementation, readable failure
reports, the final line and the exit status."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

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
