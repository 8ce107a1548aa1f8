"""The commands beside ``run``: ``--help`` shows every default, numeric options are
usage errors (status 2) naming the option, runtime errors are one ``skippy-wire: error:``
line (status 1), ``serve`` ends on signals as ``run`` does.  Everything runs ``cli.main`` in
this process (``serve`` over the tiny model); nothing is measured.
"""

from __future__ import annotations

import argparse
import importlib
import json
import logging
import os
import signal
import sys
import time

import pytest

from skippy_wire.errors import PipelineError
from skippy_wire.net.supervision import StageProcess
from skippy_wire.tools import bench, cli
from skippy_wire.tools.link_options import expected_model_id
from skippy_wire.tools.options import EXIT_HANGUP, EXIT_INTERRUPTED, EXIT_TERMINATED, apply_topology
from test_cli import _main, _one_error_line, assert_usage_error, tiny_model  # noqa: F401  (a fixture)

HELPED = sorted(cli.COMMANDS)


def _parser(command: str) -> argparse.ArgumentParser:
    return importlib.import_module(cli.COMMANDS[command][0]).build_parser()


@pytest.mark.parametrize("command", HELPED)
def test_help_shows_every_default(command):
    """README: ``COMMAND --help`` shows every option's default (or says it is required)."""
    parser = _parser(command)
    formatter = parser._get_formatter()
    silent = []
    for action in parser._actions:
        if isinstance(action, argparse._HelpAction) or not action.option_strings or action.help == argparse.SUPPRESS:
            continue  # (a hidden option: llama-server's for what api refuses, with its reason)
        text = formatter._expand_help(action) if action.help else ""
        if "default" not in text and "required" not in text:
            silent.append(action.option_strings[-1])
    assert not silent, f"{command}: no default in the help of {silent}"


def test_help_has_no_double_backticks(capsys):
    """Descriptions come from docstrings; their reStructuredText markup stays out of --help."""
    marked = []
    for command in sorted(cli.COMMANDS):
        code, out, _ = _main(capsys, command, "--help")
        assert code == 0
        if "``" in out:
            marked.append(command)
    assert not marked


def test_bench_backend_describes_itself_in_full(capsys):
    _, out, _ = _main(capsys, "bench-backend", "--help")
    assert "or one stage vs two stages in one process" in " ".join(out.split())


@pytest.mark.parametrize("args,message", [
    (["bench-backend", "--decode", "-1"], "argument --decode: must be at least 1, got -1"),
    (["bench-backend", "--repeat", "0"], "argument --repeat: must be between 1 and 1000, got 0"),
    (["bench-backend", "--prefill", "0"], "argument --prefill: must be at least 1, got 0"),
    (["bench-backend", "--threads", "0"],
     "argument -t/--threads: each value must be -1 (the default) or between 1 and 512, got 0"),
    (["bench-backend", "--threads", "2,-2"],
     "argument -t/--threads: each value must be -1 (the default) or between 1 and 512, got -2"),
    (["bench-backend", "--threads", "abc"], "argument -t/--threads: expected comma-separated integers, got 'abc'"),
    (["bench-backend", "--batch", "2,0"], "argument --batch: each value must be between 1 and 1024, got 0"),
    (["bench-backend", "--batch", "2,1,2"], "argument --batch: lists '2' twice; each value once"),
    (["bench-backend", "--threads", "1,1"], "argument -t/--threads: lists '1' twice; each value once"),
    (["bench-cluster", "--hosts", "2,3,2"], "argument --hosts: lists '2' twice; each value once"),
    (["bench-cluster", "--rates", "1gbit, 1gbit"], "argument --rates: lists '1gbit' twice; each value once"),
    (["bench-cluster", "--delays", "5,5.0"], "argument --delays: lists '5' and '5.0', the same value; each value once"),
    (["bench", "--sizes", "1x8,4x8,1x8"], "argument --sizes: lists '1x8' twice; each value once"),
    (["bench-backend", "--threads", "1, 1"], "argument -t/--threads: lists '1' twice; each value once"),
    (["bench", "--sizes", "abc"], "argument --sizes: expected comma-separated TOKENSxN_EMBD of positive integers "
                                  "(e.g. 1x4096,128x4096), got 'abc'"),
    (["bench", "--sizes", "0x8"], "argument --sizes: expected comma-separated TOKENSxN_EMBD of positive integers "
                                  "(e.g. 1x4096,128x4096), got '0x8'"),
    (["bench", "--sizes", "1x-5"], "argument --sizes: expected comma-separated TOKENSxN_EMBD of positive integers "
                                   "(e.g. 1x4096,128x4096), got '1x-5'"),
    (["bench", "--repeat", "-1"], "argument --repeat: must be between 1 and 1000, got -1"),
    (["bench", "--min-time", "-1"], "argument --min-time: must be greater than 0 and at most 1000000, got -1"),
    (["demo", "--seed", "-1"], "argument --seed: must be at least 0, got -1"),
    (["verify-exhaustive", "--workers", "-1"], "argument --workers: must be between 1 and 512, got -1"),
    (["verify-exhaustive", "--start", "xyz"], "argument --start: expected an integer, got 'xyz'"),
    (["verify-exhaustive", "--start", "0x100000000"],
     "argument --start: must be between 0 and 4294967295, got 0x100000000"),
    (["verify-exhaustive", "--samples", "-1"], "argument --samples: must be between 0 and 67108864, got -1"),
    # (30 million took 8 GB to check 1,000 patterns; more ended in numpy's "Maximum allowed dimension
    # exceeded")
    (["verify-exhaustive", "--samples", "67108865"], "argument --samples: must be between 0 and 67108864, got 67108865"),
    (["verify-exhaustive", "--start", "0xffffffff", "--limit", "2"], "--start 0xffffffff + --limit 2 go past 2^32"),
    (["inspect", "--n-embd", "-5", "x.bin"], "argument --n-embd: must be between 1 and 2147483647, got -5"),
    (["cluster", "--hosts", "0"], "argument --hosts: must be at least 1, got 0"),
    (["cluster", "--delay-ms", "-1"], "argument --delay-ms: must be between 0 and 1000000000, got -1"),
    (["cluster", "--rate", "5foo"],
     "argument --rate: rate must look like 100mbit, 20mbit, 1gbit or unlimited, not '5foo'"),
    (["serve", "-m", "m.gguf", "--layer-start", "0", "--layer-end", "2", "--protocol", "17", "--plan", "garbage"],
     "--plan: a plan is START-END,START-END,..., not 'garbage'"),
    (["serve", "-m", "m.gguf", "--layer-start", "2", "--layer-end", "4", "--stage-index", "1", "--protocol", "17",
      "--plan", "0-3,3-4"], "--plan 0-3,3-4 does not give stage 1 its layers 2-4"),
    (["serve", "-m", "m.gguf", "--layer-start", "0", "--layer-end", "2", "--protocol", "17", "--plan", "0-2,3-4"],
     "--plan 0-2,3-4: stage 1 starts at layer 3, not at layer 2 where the stage before it ends"),
    (["serve", "-m", "m.gguf", "--layer-start", "0", "--layer-end", "2", "--protocol", "17", "--plan", "1-2,2-4"],
     "--plan 1-2,2-4: stage 0 starts at layer 1, not at layer 0 where a model's layers begin"),  # no stage before
    (["serve", "-m", "m.gguf", "--layer-start", "0", "--layer-end", "2", "--protocol", "17", "--plan", "0-2,2-2"],
     "--plan 0-2,2-2: stage 1's layers 2-2 are empty"),
    # (before the model is read: a missing file would be the error, status 1)
    (["run", "--model-id", "smol", "-m", "missing.gguf", "hi"],
     "--model-id is checked only with --protocol 17 and running stages (--connect, --topology)"),
    (["api", "--protocol", "17", "--model-id", "smol", "-m", "missing.gguf"],
     "--model-id is checked only with --protocol 17 and running stages (--connect, --topology)"),
    (["cluster", "--rate", "0"], "argument --rate: rate must look like 100mbit, 20mbit, 1gbit or unlimited, not '0'"),
    (["bench-cluster", "--rates", "unlimited,0mbit"], "argument --rates: rate '0mbit' is below 8kbit"),
    # refused by tc once the namespaces were made (its tbf sizes are 32-bit)
    (["bench-cluster", "--rates", "350gbit"], "argument --rates: rate '350gbit' is above 300gbit (tc's limit; "
                                             "unlimited shapes none)"),
    (["cluster", "--rate", "1tbit"], "argument --rate: rate must look like 100mbit, 20mbit, 1gbit or unlimited, "
                                     "not '1tbit'"),
    (["cluster", "--rate", "400gbit"], "argument --rate: rate '400gbit' is above 300gbit (tc's limit; unlimited "
                                       "shapes none)"),
    (["bench-cluster", "--codecs", "f17"],
     "argument --codecs: unknown codec 'f17' (one of raw-f32, f16, bf16, s8, auto-lossless)"),
])
def test_usage_errors_name_the_option(capsys, args, message):
    assert_usage_error(capsys, args, message)


def test_bench_quick_gives_way_to_options_given():
    opts = bench.parse_options(["--quick", "--sizes", "1x64"])
    assert (opts.sizes, opts.repeat, opts.threads) == (((1, 64),), bench.QUICK["repeat"], False)
    opts = bench.parse_options(["--repeat", "2"])
    assert (opts.sizes, opts.repeat, opts.min_time, opts.threads) == (bench.SIZES, 2, bench.MIN_TIME, True)


def test_bench_backend_reports_a_bad_model_before_any_table(capsys, tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    for model, reason in ((tmp_path / "missing.gguf", "no such file or directory"), (empty, "the file is empty")):
        code, out, err = _main(capsys, "bench-backend", "--model", str(model))
        assert code == 1 and out == ""
        assert _one_error_line(err) == f"skippy-wire: error: {model}: {reason}"


def test_inspect_errors_are_one_error_line(capsys, tmp_path):
    code, out, err = _main(capsys, "inspect", str(tmp_path))
    assert code == 1 and out == ""
    assert _one_error_line(err) == f"skippy-wire: error: {tmp_path}: is a directory"
    garbage = tmp_path / "garbage.bin"
    garbage.write_bytes(b"\x0c\x00\x00\x00" + b"\x00" * 100)
    code, _, err = _main(capsys, "inspect", str(garbage))
    assert code == 1
    assert _one_error_line(err).startswith("skippy-wire: error: #0 @0: InvalidData: unknown stage message kind")


def test_inspect_says_an_empty_capture_has_nothing(capsys, tmp_path, monkeypatch):
    import io
    import sys

    empty = tmp_path / "hop1-messages.bin"
    empty.write_bytes(b"")
    assert _main(capsys, "inspect", str(empty)) == (0, f"0 records, 0 bytes: {empty} is empty, nothing to "
                                                       "dissect\n", "")

    class Stdin:
        buffer = io.BytesIO(b"")

    monkeypatch.setattr(sys, "stdin", Stdin)
    assert _main(capsys, "inspect", "-") == (0, "0 records, 0 bytes: stdin is empty, nothing to dissect\n", "")


def test_an_import_error_is_one_line(capsys, monkeypatch):
    """A compiled module not built, an optional package missing: one line, status 1."""
    def main(argv):
        raise ImportError("the compiled module skippy_wire.wire._codec is not built")

    monkeypatch.setattr("skippy_wire.tools.demo.main", main)
    code, _, err = _main(capsys, "demo")
    assert code == 1
    assert err == "skippy-wire: error: the compiled module skippy_wire.wire._codec is not built\n"


# -- serve and its supervisor ----------------------------------------------------------------


def test_a_stage_start_up_traceback_is_quoted_as_one_line(tmp_path):
    """A stage that dies with a traceback before listening: the driver quotes its last line."""
    from skippy_wire.errors import PipelineError
    from skippy_wire.net.supervision import StageProcess

    crash = ("import sys; sys.stderr.write('Traceback (most recent call last):\\n  File \"x\", line 1\\n'"
             " 'OverflowError: value too large to convert to int\\n'); sys.exit(1)")
    proc = StageProcess(1, (0, 1), [], log_path=tmp_path / "stage1.log", prefix=[sys.executable, "-c", crash])
    try:
        with pytest.raises(PipelineError) as error:
            proc.wait_listening(30)
    finally:
        proc.terminate()
    assert str(error.value) == ("stage 1 exited with status 1 before listening: "
                                "OverflowError: value too large to convert to int")


def test_a_topology_context_out_of_bounds_is_a_usage_error(capsys, tmp_path, tiny_model):
    topology = tmp_path / "t.json"
    topology.write_text(json.dumps({"model_path": str(tiny_model), "ctx_size": 99999999999, "stages": [
        {"endpoint": "127.0.0.1:19000", "layer_start": 0, "layer_end": 4}]}))
    code, out, err = _main(capsys, "serve", "--topology", str(topology), "--stage", "0")
    assert code == 2
    assert _one_error_line(err) == \
        f"skippy-wire: error: {topology}: ctx_size 99999999999 is not between 0 and 16777216"


def test_threads_minus_one_is_the_default_everywhere_as_in_llama_cpp():
    """``serve``, ``api`` and ``cluster`` refused ``-t -1``, which ``run`` took."""
    for command, required in (("run", []), ("api", []), ("cluster", []), ("bench-cluster", []),
                              ("serve", ["-m", "m.gguf", "--layer-start", "0", "--layer-end", "1"])):
        assert _parser(command).parse_args(["-t", "-1", *required]).threads is None, command
        assert _parser(command).parse_args(["-t", "3", *required]).threads == 3, command


def test_bench_backend_takes_threads_minus_one_as_a_stage_s_default():
    """``bench-backend -t -1`` said "each value must be between 1 and 512, got -1"; in its list
    -1 is the count a stage takes by default (``run -t -1``), resolved at parse time."""
    from skippy_wire.stage.threads import default_threads

    parser = _parser("bench-backend")
    assert parser.parse_args(["-t", "-1"]).threads == [default_threads()]
    assert parser.parse_args(["-t", "512,-1"]).threads == [512, default_threads()]
    # argparse before Python 3.13 took a list starting with a negative number for an option
    assert parser.parse_args(["-t", "-1,512"]).threads == [default_threads(), 512]
    assert parser.parse_args(["--threads=-1,512"]).threads == [default_threads(), 512]
    for repeated in ("-1,-1", f"{default_threads()},-1"):  # the same count resolved: one row twice
        with pytest.raises(SystemExit):
            parser.parse_args(["-t", repeated])
    assert parser.parse_args(["-t", "512"]).threads == [512]
    assert parser.parse_args([]).threads is None  # the mode's own default list


def test_bench_backend_refuses_a_batch_over_the_backends_lanes_before_starting(capsys):
    """It loaded the model and failed with the backend's InvalidArgument, status 1."""
    from skippy_wire.stage.runtime import MAX_LANES

    parser = _parser("bench-backend")
    assert parser.parse_args(["--batch", f"1,{MAX_LANES}"]).batch == [1, MAX_LANES]
    with pytest.raises(SystemExit) as exited:
        parser.parse_args(["--batch", f"{MAX_LANES + 1}"])
    assert exited.value.code == 2
    assert f"each value must be between 1 and {MAX_LANES}, got {MAX_LANES + 1}" in capsys.readouterr().err


@pytest.mark.parametrize("command", ["run", "api"])
def test_a_driver_s_context_may_be_less_than_its_topology_s_not_more(capsys, tmp_path, tiny_model, command):
    """``-c`` was silently replaced by the file's ctx_size."""
    topology = tmp_path / "t.json"
    topology.write_text(json.dumps({"model_path": str(tiny_model), "ctx_size": 1024, "stages": [
        {"endpoint": "127.0.0.1:19000", "layer_start": 0, "layer_end": 4}]}))
    parser = _parser(command)
    for given, expected in (([], 1024), (["-c", "256"], 256), (["-c", "512"], 512)):  # run's default, given
        args = parser.parse_args(["--topology", str(topology), *given])
        assert apply_topology(parser, args) == ("127.0.0.1", 19000) and args.ctx_size == expected
    small = tmp_path / "small.json"  # -c 512 given is more than its stages hold, whatever run's default
    small.write_text(topology.read_text().replace("1024", "256"))
    for path, asked, held in ((topology, 4096, 1024), (small, 512, 256)):
        with pytest.raises(SystemExit) as stopped:
            apply_topology(parser, parser.parse_args(["--topology", str(path), "-c", str(asked)]))
        assert stopped.value.code == 2
        assert _one_error_line(capsys.readouterr().err) == \
            f"skippy-wire: error: --ctx-size {asked} is more than the {held} tokens of {path}'s stages"


@pytest.mark.parametrize("command", ["run", "api"])
def test_a_v17_driver_of_a_topology_expects_its_model_id_as_serve_takes_it(tmp_path, tiny_model, command):
    """serve --topology takes the file's model_id: the driver expected the model file's stem."""
    stages = [{"endpoint": "127.0.0.1:19000", "layer_start": 0, "layer_end": 4}]
    named, unnamed = tmp_path / "named.json", tmp_path / "unnamed.json"
    named.write_text(json.dumps({"model_path": str(tiny_model), "model_id": "custom-id", "stages": stages}))
    unnamed.write_text(json.dumps({"model_path": str(tiny_model), "stages": stages}))
    parser = _parser(command)
    for path, given, expected in ((named, [], "custom-id"), (named, ["--model-id", "x"], "x"),
                                  (unnamed, [], tiny_model.stem)):
        args = parser.parse_args(["--topology", str(path), "--protocol", "17", *given])
        running = apply_topology(parser, args)
        assert expected_model_id(parser, args, running=bool(running)) == expected
    args = parser.parse_args(["--topology", str(named)])
    assert expected_model_id(parser, args, running=bool(apply_topology(parser, args))) is None  # v15: no setup


@pytest.mark.parametrize("signum,status", [(signal.SIGINT, EXIT_INTERRUPTED), (signal.SIGTERM, EXIT_TERMINATED),
                                           (signal.SIGHUP, EXIT_HANGUP)])
def test_serve_ends_like_run_on_ctrl_c_sigterm_and_sighup(capsys, caplog, monkeypatch, tiny_model, signum, status):
    """Once listening, the stage gets the signal; a stage that ignores it is stopped with
    Ctrl-C after 5 s (the test's own handlers keep pytest alive).  It says why it stops: it
    logged nothing, and the stage before it wrote "(see its log)" of the closed link."""
    import threading

    from skippy_wire.tools import serve

    done = threading.Event()

    def signal_then_interrupt():
        time.sleep(0.5)  # inside serve_forever, which closes the listener on the way out
        os.kill(os.getpid(), signum)
        if not done.wait(5):
            os.kill(os.getpid(), signal.SIGINT)

    def event(record, sessions=None):
        print(json.dumps(record))
        if record["event"] == "listening":
            threading.Thread(target=signal_then_interrupt, daemon=True).start()

    monkeypatch.setattr(serve, "_print_event", event)
    caplog.set_level(logging.INFO, logger=serve.log.name)
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGHUP)}
    # Ctrl-C as a terminal delivers it, also where this runs as a background job (SIGINT ignored)
    previous[signal.SIGINT] = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        code, out, _ = _main(capsys, "serve", "--model", str(tiny_model), "--layer-start", "0", "--layer-end", "4")
    finally:
        done.set()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    assert code == status
    assert json.loads(out.splitlines()[0])["event"] == "listening"
    assert f"stage 0: stopping on {signal.Signals(signum).name}; 0 session(s) open are cut off" in caplog.messages


@pytest.mark.parametrize("option,value,message", [
    ("--capture", "{tmp}/missing/cap", "--capture: directory {tmp}/missing does not exist"),
    ("--capture", "{tmp}/file/cap", "--capture: {tmp}/file is not a directory"),
    ("--trace-compute", "{tmp}/missing", "--trace-compute: directory {tmp}/missing does not exist"),
    ("--trace-compute", "{tmp}/file", "--trace-compute: {tmp}/file is not a directory"),
])
def test_serve_checks_its_output_directories_before_starting(capsys, tmp_path, option, value, message):
    """Else the stage starts, then fails every connection (--capture) or is misreported as a
    listen failure (--trace-compute).  The model need not exist: nothing is loaded."""
    (tmp_path / "file").write_text("")
    assert_usage_error(capsys, ["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1",
                                option, value.format(tmp=tmp_path)], message.format(tmp=tmp_path))


@pytest.mark.parametrize("listen,downstream", [
    ("127.0.0.1:9000", "127.0.0.1:9000"), ("127.0.0.1:9000", "localhost:9000"), ("127.0.0.1:9000", "0.0.0.0:9000"),
    ("0.0.0.0:9000", "127.0.0.1:9000"),
])
def test_serve_refuses_a_downstream_that_is_its_own_listener(capsys, listen, downstream):
    """Such a stage opened a connection to itself for every one it accepted (tens of
    thousands a minute, until killed)."""
    assert_usage_error(capsys, ["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1",
                                "--listen", listen, "--downstream", downstream],
                       f"--downstream {downstream} is this stage's own --listen address (it would connect to "
                       "itself); give the next stage's address")
    assert_usage_error(capsys, ["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1",
                                "--downstream", "127.0.0.1:0"],
                       "--downstream: port 0 names no stage (give the port the next stage listens on)")


def test_serve_of_a_stage_that_is_not_the_last_without_downstream_is_a_usage_error(capsys, tiny_model):
    # (found from the GGUF header, before the layers load; the runtime said it with status 1)
    assert_usage_error(capsys, ["serve", "-m", str(tiny_model), "--layer-start", "0", "--layer-end", "2"],
                       "stage 0 ends at layer 2 of 4, so it needs --downstream (the next stage's HOST:PORT)")


def test_a_downstream_on_another_port_or_host_is_not_the_listener():
    from skippy_wire.net.transport import names_listener

    assert not names_listener(("127.0.0.1", 9001), ("127.0.0.1", 9000))
    assert not names_listener(("203.0.113.77", 9000), ("127.0.0.1", 9000))  # TEST-NET-3: no address here
    assert not names_listener(("203.0.113.77", 9000), ("0.0.0.0", 9000))
    assert not names_listener(("127.0.0.1", 0), ("127.0.0.1", 0))  # port 0 binds a port of its own
    # every spelling of the wildcard listens on this machine's addresses ("0" was missed)
    for wildcard in ("0.0.0.0", "0", "0x0", ""):
        assert names_listener(("127.0.0.1", 9000), (wildcard, 9000)), wildcard
        assert names_listener((wildcard or "0.0.0.0", 9000), ("127.0.0.1", 9000)), wildcard


def test_serve_names_an_unwritable_trace_file(capsys, tmp_path, tiny_model):
    (tmp_path / "stage0.trace").mkdir()  # the directory is fine, the file cannot be opened
    code, out, err = _main(capsys, "serve", "--model", str(tiny_model), "--layer-start", "0", "--layer-end", "4",
                           "--trace-compute", str(tmp_path))
    assert code == 1
    line = _one_error_line(err)
    assert line.startswith("skippy-wire: error: stage 0 cannot start: --trace-compute: ") and "listen" not in line
    assert str(tmp_path / "stage0.trace") in line


def test_serve_logs_one_thread_in_the_singular(capsys, caplog, monkeypatch, tiny_model):
    import logging

    from skippy_wire.net.server import StageServer

    serve_forever = StageServer.serve_forever

    def stopped(server):  # the start-up lines are logged by now; close the listener and return
        server.shutdown()
        serve_forever(server)

    monkeypatch.setattr(StageServer, "serve_forever", stopped)
    caplog.set_level(logging.INFO, logger="skippy_wire.tools.serve")
    code, _, _ = _main(capsys, "serve", "--model", str(tiny_model), "--layer-start", "0", "--layer-end", "4",
                       "--threads", "1")
    assert code == 0
    assert ", 1 thread, listening on " in caplog.text


def test_serve_topology_help_lists_what_the_file_overrides():
    topology = next(a for a in _parser("serve")._actions if "--topology" in a.option_strings)
    for name in ("ctx_size", "threads", "--listen", "--ctx-size", "--threads"):
        assert name in topology.help, name


def test_inspect_into_a_closed_stdout_exits_141(capsys, monkeypatch, tmp_path):
    """`skippy-wire inspect FILE | head` exited 0, unlike every other command (README: 141)."""
    import io

    from skippy_wire.tools.options import EXIT_BROKEN_PIPE
    from skippy_wire.wire.frame import write_stage_message
    from skippy_wire.wire.messages import StageWireMessage

    capture = tmp_path / "hop0-messages.bin"
    capture.write_bytes(write_stage_message(StageWireMessage.stop(7, 11)))

    class Closed(io.StringIO):
        def write(self, text):
            raise BrokenPipeError(32, "Broken pipe")

    monkeypatch.setattr(sys, "stdout", Closed())
    assert cli.main(["inspect", str(capture)]) == EXIT_BROKEN_PIPE
    assert capsys.readouterr().err == ""


def test_cluster_n_is_documented_as_it_is_taken(capsys):
    """docs/pipeline.md said cluster's -n is "as for run", whose -1 cluster refuses."""
    from pathlib import Path

    docs = (Path(__file__).resolve().parents[1] / "docs" / "pipeline.md").read_text()
    head = "| `-n/--max-tokens` (`--predict`, `--n-predict`), `--chunk-size` | 16, 64 |"
    row = next(line for line in docs.splitlines() if line.startswith(head))
    assert "`-n` is at least 1" in row
    assert_usage_error(capsys, ["cluster", "-n", "-1"],
                       "argument -n/--max-tokens/--predict/--n-predict: must be at least 1, got -1")


def test_bench_backend_names_llama_cpp_only_where_it_is_the_reference():
    """Every mode said "llama.cpp: not installed ...; ours only", where only side by side uses it."""
    from skippy_wire.tools import backend_bench

    assert "llama.cpp:" not in backend_bench.header()
    assert backend_bench.header(against_llama=True).splitlines()[-1].startswith("llama.cpp: ")


def test_a_stage_killed_before_listening_says_by_what(tmp_path):
    """It said "exited with status -9", a return code no exit status reads as."""
    proc = StageProcess(1, (0, 1), [], log_path=tmp_path / "stage1.log",
                        prefix=[sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"])
    try:
        with pytest.raises(PipelineError) as error:
            proc.wait_listening(30)
    finally:
        proc.terminate()
    assert str(error.value) == "stage 1 was killed by SIGKILL before listening"
