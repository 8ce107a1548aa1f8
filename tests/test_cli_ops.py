"""What an operator meets beside ``run``: llama.cpp's short options and ``--version`` on every
command, inputs refused before any work starts (``bench --sizes`` over the wire's limit,
``bench-backend`` beyond the backend's context, ``cluster --hosts`` over the layer count,
``bench-cluster --json`` that cannot be written), a broken model as a runtime failure, a
listen host that does not resolve named as such, an out-of-memory one line, and the worker
processes of ``verify-exhaustive`` stopped with it on SIGTERM.
"""

from __future__ import annotations

import argparse
import errno
import json
import os
import signal
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context
from pathlib import Path

import pytest

from skippy_wire.errors import PipelineError
from skippy_wire.net.connlog import LOG_BURST, LOG_RATE
from skippy_wire.net.driver import PipelineClient
from skippy_wire.tools import api, backend_bench, bench, cli, cluster, run, serve
from skippy_wire.tools.bench_rows import Row
from skippy_wire.tools.options import check_output_file
from skippy_wire.tools.signals import end_workers
from skippy_wire.wire.messages import StageWireMessage
from process_helpers import default_sigint
from test_cli import _main, _one_error_line, assert_usage_error, tiny_model  # noqa: F401  (a fixture)

REPO = Path(__file__).resolve().parents[1]


GPU_LAYERS_WARNING = ("[skippy-wire] warning: no usable GPU found, --gpu-layers option will be ignored "
                      "(skippy-wire computes on the CPU)\n")


@pytest.mark.parametrize("module, words", [(run, ["-ngl", "99", "hello"]), (api, ["--gpu-layers", "all"]),
                                           (serve, ["--n-gpu-layers", "-1"])])
def test_gpu_layers_are_taken_and_ignored_with_llama_cpps_warning(capsys, module, words):
    """llama.cpp's ``-ngl 99`` on a build without a GPU: its warning, and the rest of the line
    read as without it (``run -ngl 99 hello`` refused ``-ngl hello``, 99 taken as the prompt)."""
    plain = vars(module.build_parser().parse_args(words[2:]))
    with_it = vars(module.build_parser().parse_args(words))
    assert with_it == plain
    assert capsys.readouterr().err == GPU_LAYERS_WARNING


def test_gpu_layers_take_llama_cpps_values_only(capsys):
    assert_usage_error(capsys, ["run", "-ngl", "many"], "argument -ngl/--gpu-layers/--n-gpu-layers: expected an "
                                                        "integer from -1, auto or all, got 'many'")


@pytest.mark.parametrize("command", ["run", "serve", "inspect", "bench-backend"])
def test_version_after_a_command_prints_the_version(capsys, command):
    """llama-cli takes ``--version`` anywhere; argparse refused it after a command."""
    code, out, err = _main(capsys, command, "--version")
    assert (code, err) == (0, "")
    assert out.startswith("skippy-wire ") and out == cli.version_text() + "\n"


def test_serve_and_cluster_take_llama_cpps_short_options():
    args = serve.build_parser().parse_args(["-m", "m.gguf", "-c", "64", "-t", "2", "--layer-start", "0",
                                            "--layer-end", "1"])
    assert (args.model, args.ctx_size, args.threads) == ("m.gguf", 64, 2)
    args = cluster.build_parser().parse_args(["-m", "m.gguf", "-n", "3", "-c", "64", "-t", "2"])
    assert (args.model, args.max_tokens, args.ctx_size, args.threads) == ("m.gguf", 3, 64, 2)
    for name in ("--predict", "--n-predict"):  # run's other names for -n
        assert cluster.build_parser().parse_args([name, "5"]).max_tokens == 5


@pytest.mark.parametrize("args,message", [
    (["bench", "--sizes", "1x64,99999999x99999999"],
     "argument --sizes: 99999999x99999999 is 39999999200000004 bytes of f32, over the wire's limit of 536870912 "
     "per activation"),
    (["bench-backend", "--prefill", "16777216"],
     "--prefill 16777216 + --decode 64 exceed the backend's context of 16777216 tokens"),
])
def test_sizes_beyond_the_limits_are_usage_errors(capsys, args, message):
    """Else numpy's MemoryError traceback (bench), the backend's refusal after the header."""
    assert_usage_error(capsys, args, message)


def test_bench_cluster_json_file_is_checked_before_the_runs(capsys, tmp_path):
    for target, why in ((tmp_path, "is a directory"), (tmp_path / "missing" / "rows.json", "no such file or directory")):
        assert_usage_error(capsys, ["bench-cluster", "--json", str(target)], f"--json {target}: {why}")
    assert_usage_error(capsys, ["bench-cluster", "--json", "/proc/self/rows.json"],  # root may not write there
                       "--json /proc/self/rows.json: no such file or directory")
    # a file that can be written passes, and the check leaves none behind (nor touches one there)
    parser = argparse.ArgumentParser()
    check_output_file(parser, "--json", str(tmp_path / "new.json"))
    kept = tmp_path / "kept.json"
    kept.write_text("old rows\n")
    check_output_file(parser, "--json", str(kept))
    assert not (tmp_path / "new.json").exists() and kept.read_text() == "old rows\n"


@pytest.mark.parametrize("unbuffered", [False, True])
@pytest.mark.parametrize("words", [["--version"], ["demo"], ["demo", "--help"], ["help", "inspect"]])
def test_a_stdout_that_cannot_be_written_is_named_in_one_line(words, unbuffered):
    """``> /dev/full``: "no space left on device" named no file (buffered, the exit's flush
    then failed again: Python's "Exception ignored" lines and status 120).  A command's help
    exited 0 with nothing written (argparse drops its write's error)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"} | ({"PYTHONUNBUFFERED": "1"}
                                                                               if unbuffered else {})
    with open("/dev/full", "w") as full:
        done = subprocess.run([sys.executable, "-m", "skippy_wire", *words], stdout=full, stderr=subprocess.PIPE,
                              env=env, text=True, timeout=60)
    assert done.returncode == 1
    assert done.stderr == "skippy-wire: error: cannot write to stdout: no space left on device\n"


def test_a_stderr_that_cannot_be_written_drops_the_diagnostics_not_the_work():
    """``2>/dev/full``: a progress line's failed write stopped `run` before it generated (status
    1, nothing on stdout), and a usage error's status 2 became 1."""
    code = ("import sys; from skippy_wire.tools.cli import guarded\n"
            "sys.exit(guarded(lambda: print('progress', file=sys.stderr, flush=True) or print('the text') or 0))")
    for argv, status, out in (([sys.executable, "-c", code], 0, "the text\n"),
                              ([sys.executable, "-m", "skippy_wire", "demo", "--seed", "x"], 2, "")):
        with open("/dev/full", "w") as full:
            done = subprocess.run(argv, stdout=subprocess.PIPE, stderr=full, text=True, timeout=60)
        assert (done.returncode, done.stdout) == (status, out), done


def test_a_ctrl_c_while_a_class_is_made_is_the_quiet_exit_130(capsys):
    """A Ctrl-C while an import made a dataclass reached the command as Python 3.11's
    "RuntimeError: Error calling __set_name__": a traceback and status 1."""
    class Interrupted:
        def __set_name__(self, owner, name):
            raise KeyboardInterrupt

    def run():
        type("Made", (), {"field": Interrupted()})  # what a class statement does

    assert cli.guarded(run) == 130
    assert capsys.readouterr() == ("", "")


def test_an_error_elsewhere_is_not_put_on_stdout(capsys):
    def run():
        raise ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")

    assert cli.guarded(run) == 1
    assert capsys.readouterr().err == "skippy-wire: error: connection reset by peer\n"


def test_out_of_memory_is_one_line(capsys, monkeypatch):
    def main(argv):
        raise MemoryError("Unable to allocate 35.5 PiB for an array")

    monkeypatch.setattr("skippy_wire.tools.demo.main", main)
    code, out, err = _main(capsys, "demo")
    assert (code, out) == (1, "")
    assert err == "skippy-wire: error: out of memory: Unable to allocate 35.5 PiB for an array\n"


def test_bench_backend_prompts_fit_a_small_vocabulary(capsys, tiny_model):
    """The measured prompts used ids 100..1099: the tiny model (256 tokens) was refused."""
    code, out, err = _main(capsys, "bench-backend", "--model", str(tiny_model), "--prefill", "24", "--decode", "2",
                           "--repeat", "1", "--threads", "1")
    assert code == 0, err
    assert out.splitlines()[-1].split()[0] == "1"  # the row of 1 thread
    assert backend_bench.prompt_tokens(3, 49152) == [105, 122, 139]  # real vocabularies: the same ids


def test_cluster_with_a_broken_model_is_a_runtime_failure(capsys, tmp_path):
    text = tmp_path / "text.gguf"
    text.write_text("hello\n")
    code, out, err = _main(capsys, "cluster", "-m", str(text))
    assert (code, out) == (1, "")
    assert _one_error_line(err) == f"skippy-wire: error: {text} is not a GGUF file"


def test_cluster_refuses_more_hosts_than_layers_before_making_any(monkeypatch, tiny_model):
    class NoChain:
        def __init__(self, *args, **kwargs):
            raise AssertionError("namespaces made for a split that cannot be")

    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster, "NetnsChain", NoChain)
    with pytest.raises(cluster.TopologyError, match=r"^--hosts 9: tiny.gguf has only 4 layers$"):
        cluster.run_cluster(cluster.ClusterOptions(hosts=9, model=str(tiny_model)))


def test_serve_names_a_listen_host_that_does_not_resolve(capsys, monkeypatch, tiny_model):
    import socket

    def no_such_host(*args, **kwargs):  # what socket.create_server raises for it
        raise socket.gaierror(socket.EAI_NONAME, "Name or service not known (while attempting to bind on "
                                                 "address ('nosuchhost.invalid', 19000))")

    monkeypatch.setattr(serve, "StageServer", no_such_host)
    code, _, err = _main(capsys, "serve", "-m", str(tiny_model), "--layer-start", "0", "--layer-end", "4",
                         "--listen", "nosuchhost.invalid:19000")
    assert code == 1
    assert _one_error_line(err) == ("skippy-wire: error: stage 0 cannot start: cannot listen on "
                                    "nosuchhost.invalid:19000: name or service not known")


def _children(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def _running(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.slow
@pytest.mark.parametrize("signum, status", [(signal.SIGTERM, 143), (signal.SIGINT, 130), (signal.SIGHUP, 129)])
@pytest.mark.parametrize("group", [False, True], ids=["command", "group"])
def test_verify_exhaustive_stops_its_workers_on_sigterm(signum, status, group):
    """SIGTERM to the command alone (``kill PID``): it killed the parent and left the workers
    checking for up to 40 minutes; now they stop and the command exits 143 (Ctrl-C 130,
    SIGHUP 129), the signal seen between the pool's waits, not raised inside them.  Sent to
    the whole group (a terminal's Ctrl-C or hang-up, ``kill -- -PGID``), it killed the workers
    too, broke the pool and ended the command with a BrokenProcessPool traceback."""
    proc = subprocess.Popen([sys.executable, "-m", "skippy_wire", "verify-exhaustive", "--workers", "2"],
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=default_sigint, start_new_session=True)
    workers: list[int] = []
    try:
        assert proc.stderr.readline().startswith("[")  # the first progress line: the workers are at it
        workers = _children(proc.pid)
        assert workers
        if group:
            os.killpg(proc.pid, signum)
        else:
            proc.send_signal(signum)
        try:  # a worker left running holds the pipes open
            out, err = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            out, err = "", "timed out"
        deadline = time.monotonic() + 10
        while any(map(_running, workers)) and time.monotonic() < deadline:
            time.sleep(0.1)
        left = [pid for pid in workers if _running(pid)]
    finally:
        for pid in [proc.pid, *workers]:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    assert not left, f"workers still running: {left}"
    assert proc.wait() == status, err
    assert "Traceback" not in err and "leaked" not in err and out == ""


@pytest.mark.parametrize("tty", [True, False])
def test_bench_shows_its_progress_on_a_terminal_only(monkeypatch, capsys, tty):
    """A full ``bench`` printed nothing until its last measurement; the progress line is
    cleared before the tables, and never reaches a log or a pipe."""
    def rows(opts):
        yield Row("encode f16", "1x64", "ours", 1e-6, 256)
        yield Row("encode f16", "1x64", "numpy", 2e-6, 256)

    monkeypatch.setattr(bench, "_all_producers", lambda: [rows])
    monkeypatch.setattr(sys.stderr, "isatty", lambda: tty)
    assert bench.main(["--quick"]) == 0
    out, err = capsys.readouterr()
    assert "encode f16" in out
    if tty:
        assert "[skippy-wire] 2 measured: encode f16 1x64 numpy" in err and "\033" not in err  # also for TERM=dumb
        last = err.split("\r")[-2]  # the clearing write covers the longest line before it
        assert err.endswith("\r") and last.strip() == "" and len(last) == len(max(err.split("\r"), key=len))
    else:
        assert err == ""


def test_bench_stopped_prints_the_rows_measured_and_exits_130(monkeypatch, capsys):
    """Ctrl-C printed nothing of what had been measured (bench-cluster prints its rows)."""
    def rows(opts):
        yield Row("encode f16", "1x64", "ours", 1e-6, 256)
        raise KeyboardInterrupt

    monkeypatch.setattr(bench, "_all_producers", lambda: [rows])
    assert bench.main(["--quick"]) == 130
    out, err = capsys.readouterr()
    assert "encode f16" in out and "1x64" in out and "goals met" not in out
    assert err.endswith("[skippy-wire bench] interrupted after 1 rows\n"), err


@pytest.mark.parametrize("args,message", [
    (["--hosts", "1,9"], "--hosts 9: tiny.gguf has only 4 layers"),
    (["--hosts", "1", "--prompt-tokens", "8", "-n", "4", "-c", "10"],
     "8 prompt tokens + 4 new tokens exceed --ctx-size 10"),
    (["--hosts", "1", "--prompt-tokens", "250", "-n", "7", "-c", "0"],  # -c 0 was refused as out of range
     "250 prompt tokens + 7 new tokens exceed --ctx-size 256 (the model's training context)"),
])
def test_bench_cluster_refuses_a_run_that_cannot_be_before_the_first(capsys, monkeypatch, tiny_model, args, message):
    """Found by the first run that needed it: after the header, exit 1 (run's --stages: 2)."""
    monkeypatch.setattr("skippy_wire.tools.cluster_bench.run_cluster", lambda *a, **k: pytest.fail("a run started"))
    assert_usage_error(capsys, ["bench-cluster", "-m", str(tiny_model), *args], message)


def test_cluster_usage_errors_come_after_the_usage_block(capsys, monkeypatch, tiny_model):
    """Found after parsing, they were the error line alone (run's and bench-cluster's have the usage)."""
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster, "NetnsChain", lambda *a, **k: pytest.fail("namespaces made"))
    code, out, err = _main(capsys, "cluster", "-m", str(tiny_model), "--hosts", "9")
    assert (code, out) == (2, "")
    assert err.startswith("usage: skippy-wire cluster ")
    assert _one_error_line(err) == "skippy-wire: error: --hosts 9: tiny.gguf has only 4 layers"


@pytest.mark.parametrize("layers,downstream,message", [
    (("0", "5"), None, "--layer-end 5 is beyond the model's 4 layers"),
    (("4", "5"), None, "--layer-end 5 is beyond the model's 4 layers"),
    (("2", "4"), "127.0.0.1:9", "stage 1 ends at the model's last layer (4), so it is the terminal stage and "
                                "takes no --downstream"),
])
def test_serve_of_a_range_the_model_does_not_fit_is_a_usage_error(capsys, tiny_model, layers, downstream, message):
    # (found from the GGUF header, before the layers load; the runtime said it with status 1)
    index = "0" if layers[0] == "0" else "1"
    argv = ["serve", "-m", str(tiny_model), "--layer-start", layers[0], "--layer-end", layers[1],
            "--stage-index", index]
    assert_usage_error(capsys, argv + (["--downstream", downstream] if downstream else []), message)


def test_serve_whose_stdout_closed_serves_on_without_its_events(tiny_model):
    """`serve | head -1`: the first session event met a closed pipe, and the connection's
    handler took the BrokenPipeError for its peer resetting: every request failed."""
    import json

    from skippy_wire.net.driver import PipelineClient

    stage = subprocess.Popen([sys.executable, "-m", "skippy_wire", "serve", "-m", str(tiny_model), "--layer-start",
                              "0", "--layer-end", "4", "--listen", "127.0.0.1:0"], cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        listening = json.loads(stage.stdout.readline())
        stage.stdout.close()  # the reader leaves after the first line
        outputs = []
        for session in (1, 2):
            with PipelineClient(listening["host"], listening["port"], timeout=30) as client:
                outputs.append(client.generate([1, 2, 3], max_tokens=3, chunk_size=4, session_id=session).tokens)
        assert outputs[0] == outputs[1] and len(outputs[0]) == 3
        assert stage.poll() is None
    finally:
        stage.terminate()
        _, err = stage.communicate(timeout=30)
    assert err.count("stdout is closed: session events are no longer printed") == 1
    assert "reset" not in err and "Traceback" not in err and "Exception ignored" not in err


def test_serve_prints_session_events_within_the_log_budget(tiny_model, tmp_path):
    """A peer opening and stopping sessions in a loop made every stage of the chain print a
    "session" event for each (some 1,800 lines a second): they keep the log lines' budget,
    LOG_BURST at once, then LOG_RATE a second, the next one printed counting those not."""
    # into files, not pipes read at the end: without the budget a full pipe would block the stage
    out_path, err_path = tmp_path / "events.jsonl", tmp_path / "stage.log"
    with open(out_path, "w") as out_file, open(err_path, "w") as err_file:
        stage = subprocess.Popen([sys.executable, "-m", "skippy_wire", "serve", "-m", str(tiny_model),
                                  "--layer-start", "0", "--layer-end", "4", "--listen", "127.0.0.1:0"], cwd=REPO,
                                 stdin=subprocess.DEVNULL, stdout=out_file, stderr=err_file)
    try:
        for _ in range(300):  # its "listening" event (bounded: 30 s)
            if out_path.read_text().endswith("\n"):
                break
            time.sleep(0.1)
        listening = json.loads(out_path.read_text().splitlines()[0])
        opened = 2 * LOG_BURST
        started = time.monotonic()
        with PipelineClient(listening["host"], listening["port"], timeout=30) as client:
            for session in range(1, opened + 1):
                client.request(StageWireMessage.configure_generation(session, session, 3, None, None))
                client.request(StageWireMessage.stop(session, session))
        elapsed = time.monotonic() - started
        time.sleep(1.5 / LOG_RATE)  # room for one more, which says how many were not printed
        with PipelineClient(listening["host"], listening["port"], timeout=30) as client:
            client.generate([1, 2, 3], max_tokens=2, chunk_size=4, session_id=opened + 1)
    finally:
        stage.terminate()
        stage.wait(30)
    out, err = out_path.read_text(), err_path.read_text()
    sessions = [json.loads(line) for line in out.splitlines() if '"session"' in line]
    assert LOG_BURST <= len(sessions) <= LOG_BURST + LOG_RATE * elapsed + 2, (len(sessions), elapsed)
    assert sessions[-1]["session_id"] == opened + 1 and sessions[-1]["decode_tokens"] >= 1
    # each printed event counts those dropped since the one before (a slow run prints some in between)
    assert sum(event.get("session_events_dropped", 0) for event in sessions) == opened - (len(sessions) - 1)
    assert sessions[-1]["session_events_dropped"] > 0
    assert "Traceback" not in err


def test_serve_started_with_stdout_closed_serves_and_says_so_once(tiny_model):
    """`serve >&-` (a daemon): Python has no stdout; the first event's write fails as on a
    closed pipe (said once, in the log), and the stage serves every session."""
    import socket

    from skippy_wire.net.driver import PipelineClient

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    stage = subprocess.Popen([sys.executable, "-m", "skippy_wire", "serve", "-m", str(tiny_model), "--layer-start",
                              "0", "--layer-end", "4", "--listen", f"127.0.0.1:{port}"], cwd=REPO,
                             stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                             preexec_fn=lambda: os.close(1))
    try:
        outputs = []
        for session in (1, 2, 3):
            for _ in range(300):  # until it listens (bounded: 30 s)
                try:
                    with PipelineClient("127.0.0.1", port, timeout=30) as client:
                        outputs.append(client.generate([1, 2, 3], max_tokens=3, chunk_size=4,
                                                       session_id=session).tokens)
                    break
                except PipelineError:
                    time.sleep(0.1)
        assert len(outputs) == 3 and outputs[0] == outputs[1] == outputs[2] and stage.poll() is None
    finally:
        stage.terminate()
        _, err = stage.communicate(timeout=30)
    assert err.count("stdout is closed: session events are no longer printed") == 1, err
    assert "Traceback" not in err and "Exception ignored" not in err


def _sleep_a_while() -> None:
    time.sleep(30)


def test_ending_a_pools_workers_joins_its_manager_thread():
    """The join meant to keep Python 3.11's exit from writing to the pool's closed wake-up
    pipe (an "Exception ignored ... Bad file descriptor" traceback after a Ctrl-C to
    verify-exhaustive's group) read the thread after shutdown() had forgotten it: it never ran."""
    pool = ProcessPoolExecutor(max_workers=1, mp_context=get_context("fork"))
    pool.submit(_sleep_a_while)
    manager = pool._executor_manager_thread
    assert manager is not None and manager.is_alive()
    end_workers(pool)
    assert not manager.is_alive()
