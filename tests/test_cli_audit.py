"""What a user audit of the command line found, each pinned: output directories refused
before anything starts (and nothing left behind), the summary on stderr, a failed
``--check`` as one error line, llama.cpp's special values (``-c 0``, ``"threads": -1``) and
names (``--predict``, ``bench-backend -m``), whole option names only, NaN named as such, a
busy port without Python's tuple, ``context_full``.  Everything runs ``cli.main`` in this
process; no stage process starts.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from skippy_wire.errors import NetnsError, PipelineError
from skippy_wire.net.backend import RuntimeBackend
from skippy_wire.net.driver import GenerationResult
from skippy_wire.tools import api, cluster, cluster_bench, run, serve
from skippy_wire.tools.options import EXIT_BROKEN_PIPE, EXIT_INTERRUPTED, Parser, check_output_dir, describe, utf8
from process_helpers import default_sigint
from test_cli import (_main, _one_error_line, assert_usage_error, fake_client, fake_cluster_runs,  # noqa: F401
                      tiny_model)  # (fixtures)


# -- P2, P5: output directories ------------------------------------------------------------------


@pytest.mark.parametrize("command", [["cluster", "-n", "2", "--measure-seconds", "0"], ["bench-cluster"],
                                     ["run", "hi"], ["api"]])
def test_a_log_dir_that_cannot_be_a_directory_is_a_usage_error_naming_it(capsys, monkeypatch, tmp_path, command):
    """cluster said "/etc/passwd: file exists" (status 1) and left /tmp/skippy-wire-cluster-* behind."""
    from skippy_wire.tools import cluster_bench

    def started(*args, **kwargs):
        raise AssertionError("started although --log-dir cannot be a directory")

    # were the option accepted: fail at once instead of making namespaces or starting stages
    monkeypatch.setattr(cluster, "netns_unavailable", started)
    monkeypatch.setattr(cluster_bench, "run_cluster", started)
    monkeypatch.setattr("skippy_wire.tools.run.launch_pipeline", started)
    monkeypatch.setattr(api, "_serve", started)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a_file = tmp_path / "file"
    a_file.write_text("")
    assert_usage_error(capsys, [*command, "--log-dir", str(a_file)], f"--log-dir {a_file}: not a directory")
    assert_usage_error(capsys, [*command, "--log-dir", f"{a_file}/x"],
                       f"--log-dir {a_file}/x: cannot create the directory: {a_file} is not a directory")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


@pytest.mark.parametrize("value, reason", [("{file}/sub", "{file} is not a directory"),
                                           ("{file}/sub/deeper", "{file} is not a directory"),
                                           ("/proc/self/nope", "no such file or directory")])
def test_a_capture_directory_that_cannot_be_made_is_a_usage_error(capsys, tmp_path, value, reason):
    """Was status 1, "no such file or directory" without the option."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    value, reason = value.format(file=a_file), reason.format(file=a_file)
    assert_usage_error(capsys, ["run", "--capture", value, "hi"],
                       f"--capture {value}: cannot create the directory: {reason}")


def test_the_directory_check_leaves_nothing_behind(tmp_path):
    check_output_dir(Parser(), "--capture", str(tmp_path / "a" / "b" / "c"))  # possible: accepted
    check_output_dir(Parser(), "--capture", str(tmp_path))  # exists
    assert list(tmp_path.iterdir()) == []


class _FailingChain:
    """A NetnsChain whose namespaces cannot be made."""

    run_id = "test"

    def __init__(self, *args, **kwargs) -> None:
        pass

    def create(self):
        raise NetnsError("no namespaces here")

    def close(self) -> list[str]:
        return []



@pytest.mark.parametrize("argv, message", [
    # the repeated prompt was made first: 8.5 GB and rising, silent, deaf to SIGTERM
    (["cluster", "--prompt-tokens", "20000000"], "20000000 prompt tokens + 16 new tokens exceed --ctx-size 16777216"),
    (["cluster", "--prompt-tokens", "600", "-c", "512"], "600 prompt tokens + 16 new tokens exceed --ctx-size 512"),
    (["bench-cluster", "--prompt-tokens", "20000000"],
     "20000000 prompt tokens + 32 new tokens exceed --ctx-size 16777216"),
    # an empty text was padded with spaces to --prompt-tokens
    (["cluster", "--prompt-tokens", "8", "-n", "2", ""], "the prompt must have at least one token"),
    (["bench-cluster", "--prompt", ""], "the prompt must have at least one token"),
    # without --prompt-tokens an empty prompt went on to make the namespaces and start the stages
    (["cluster", "-n", "2", ""], "the prompt must have at least one token"),
    # a non-UTF-8 prompt was said as "text holds a lone surrogate U+DCE9 at index 3", after the hosts were made
    (["cluster", "-n", "2", os.fsdecode(b"caf\xe9")], "argument prompt: not valid UTF-8"),
    (["bench-cluster", "--prompt", os.fsdecode(b"caf\xe9")], "argument --prompt: not valid UTF-8"),
])
def test_a_cluster_prompt_is_sized_before_it_is_made(capsys, monkeypatch, tiny_model, argv, message):
    from skippy_wire.tools import cluster_bench

    def started(*args, **kwargs):
        raise AssertionError("went on to make namespace hosts")

    monkeypatch.setattr(cluster, "netns_unavailable", started)
    monkeypatch.setattr(cluster_bench, "run_cluster", started)
    assert_usage_error(capsys, [*argv, "-m", str(tiny_model)], message)

def test_run_cluster_leaves_no_temporary_directory_on_failure(monkeypatch, tmp_path, tiny_model):
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster, "NetnsChain", _FailingChain)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    a_file = tmp_path / "file"
    a_file.write_text("")
    with pytest.raises(OSError):  # a --log-dir that cannot be made: the temporary directory was made first
        cluster.run_cluster(cluster.ClusterOptions(hosts=2, model=str(tiny_model), log_dir=str(a_file)))
    with pytest.raises(NetnsError):
        cluster.run_cluster(cluster.ClusterOptions(hosts=2, model=str(tiny_model)))
    logs = tmp_path / "logs"
    with pytest.raises(NetnsError):
        cluster.run_cluster(cluster.ClusterOptions(hosts=2, model=str(tiny_model), log_dir=str(logs)))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "logs"]  # --log-dir is kept, nothing else


# -- P3, P4, P11c: what run prints where ----------------------------------------------------------


def test_the_summary_goes_to_stderr_and_stdout_holds_the_text_alone(capsys, tiny_model, fake_client):
    fake_client(" world")
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "--protocol",
                           "16", "hello")
    assert code == 0, err
    assert out == "hello world\n"  # `skippy-wire run ... > out.txt`
    assert "summary: the pipeline at 127.0.0.1:9, tiny.gguf, state version 16" in err and "decode:" in err


def _differing(monkeypatch, tokens):
    def generate_local(model, prompt, **kwargs):
        return GenerationResult(prompt_tokens=list(prompt), tokens=list(tokens), prefill_s=0.01, decode_s=0.01)

    monkeypatch.setattr("skippy_wire.tools.run.generate_local", generate_local)


@pytest.mark.parametrize("json_out", [False, True])
def test_a_failed_check_is_one_error_line(capsys, monkeypatch, tiny_model, fake_client, json_out):
    """It exited 1 with nothing on stderr under --quiet (the verdict was a stdout line)."""
    fake_client(" world")
    _differing(monkeypatch, [1, 2, 3])
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "--check",
                           *(["--json"] if json_out else []), "hello")
    assert code == 1
    line = "skippy-wire: error: check failed: the pipeline's tokens differ from one in-process stage's from position 0"
    assert err.splitlines()[-1] == line and "Traceback" not in err
    if json_out:
        assert err == line + "\n"
        assert json.loads(out)["check"]["ok"] is False
    else:
        assert out == "hello world\n" and "check: FAILED, tokens differ from position 0" in err


def test_a_run_that_fills_the_context_says_so(capsys, tiny_model, fake_client):
    fake_client(" w")
    for limit, reason in ((["-n", "-1", "-c", "8"], "context_full"), (["-n", "2", "-c", "64"], "max_tokens")):
        code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "--json",
                               *limit, "hello")
        assert code == 0, err
        assert json.loads(out)["summary"]["stop_reason"] == reason


def test_cluster_and_run_say_exceed_alike(monkeypatch, tiny_model):
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    with pytest.raises(cluster.TopologyError, match=r"^\d+ prompt tokens \+ 16 new tokens exceed --ctx-size 4$"):
        cluster.run_cluster(cluster.ClusterOptions(hosts=1, model=str(tiny_model), ctx_size=4))


# -- P6, P8: -c 0 everywhere, a topology's missing model --------------------------------------------


def test_serve_and_api_take_c_0_as_the_training_context(capsys, monkeypatch, tiny_model):
    """`serve -c 0` and `api -c 0` were refused; the tiny model records 256."""
    seen = []
    monkeypatch.setattr(serve, "_serve", lambda args, stage_index: seen.append(args.ctx_size) or 0)
    monkeypatch.setattr(api, "_serve", lambda parser, args: seen.append(args.ctx_size) or 0)
    assert _main(capsys, "serve", "-m", str(tiny_model), "--layer-start", "0", "--layer-end", "4", "-c", "0")[0] == 0
    for where in ([], ["--connect", "127.0.0.1:9"]):
        assert _main(capsys, "api", "-m", str(tiny_model), "-c", "0", *where)[0] == 0
    assert seen == [256, 256, 256]
    assert_usage_error(capsys, ["api", "-c", "5"],
                       "argument -c/--ctx-size: must be 0 (the model's training context) or between 16 and 16777216, "
                       "got 5")


def test_cluster_takes_c_0_as_the_training_context(capsys, monkeypatch, tiny_model):
    """`cluster -c 0` was refused ("must be between 1 and 16777216, got 0"); as `run -c 0` it is
    the model's training context (the tiny model's 256), checked against prompt + new tokens."""
    assert cluster.build_parser().parse_args(["-c", "0"]).ctx_size == 0
    assert cluster.context_size(None, 0, tiny_model) == (256, True)
    assert cluster.context_size(None, 64, tiny_model) == (64, False)
    assert cluster.context_size(None, None, tiny_model) == (None, False)  # prompt + new tokens
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    checked = []
    fit_error = cluster.fit_error
    monkeypatch.setattr(cluster, "fit_error", lambda *a, **k: checked.append((a[-1], k)) or fit_error(*a, **k))

    def no_namespaces(*args, **kwargs):
        raise NetnsError("no namespaces in this test")

    monkeypatch.setattr(cluster, "NetnsChain", no_namespaces)
    code, out, err = _main(capsys, "cluster", "-m", str(tiny_model), "-c", "0", "-n", "4", "hello")
    assert (code, out) == (1, "") and _one_error_line(err) == "skippy-wire: error: no namespaces in this test"
    assert checked == [(256, {"trained": True})]
    assert_usage_error(capsys, ["cluster", "-m", str(tiny_model), "-c", "0", "-n", "300", "hello"],
                       "6 prompt tokens + 300 new tokens exceed --ctx-size 256 (the model's training context)")
    monkeypatch.setattr("skippy_wire.tools.options.training_context", lambda model: None)
    assert_usage_error(capsys, ["cluster", "-m", str(tiny_model), "-c", "0", "hello"],
                       "-c 0: tiny.gguf does not record its training context; give -c/--ctx-size")
    assert_usage_error(capsys, ["cluster", "-c", "-1"], "argument -c/--ctx-size: must be between 0 and 16777216, "
                                                        "got -1")


def test_cluster_warns_of_a_context_beyond_the_training_one_as_run_does(capsys, monkeypatch, tiny_model):
    # without -c the context is prompt + new tokens: --prompt-tokens 100000 on SmolLM2 went 12x past its 8192
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)

    def no_namespaces(*args, **kwargs):
        raise NetnsError("no namespaces in this test")

    monkeypatch.setattr(cluster, "NetnsChain", no_namespaces)
    warning = "[skippy-wire] n_ctx ({}) > n_ctx_train (256) -- possible training context overflow\n"
    for args, ctx, said in ((["--prompt-tokens", "300"], 304, True), (["-c", "257"], 257, True),
                            (["--prompt-tokens", "252"], 256, False)):
        code, _, err = _main(capsys, "cluster", "-m", str(tiny_model), "-n", "4", *args, "hello")
        assert code == 1 and err.endswith("skippy-wire: error: no namespaces in this test\n"), err
        assert (warning.format(ctx) in err) is said, err


def test_bench_cluster_runs_c_0_in_the_training_context(capsys, monkeypatch, tiny_model):
    seen = []
    fake_cluster_runs(monkeypatch, lambda opts: seen.append((opts.ctx_size, opts.threads)))
    code, out, err = _main(capsys, "bench-cluster", "--hosts", "2", "--rates", "unlimited", "--delays", "0",
                           "--codecs", "raw-f32", "-m", str(tiny_model), "--quiet", "--prompt-tokens", "16", "-n", "4",
                           "-c", "0", "-t", "-1")
    assert code == 0, err
    assert seen == [(256, None)] and "1 thread(s) per stage" in out


def test_serve_c_0_with_a_missing_model_cannot_start(capsys, tmp_path):
    missing = tmp_path / "missing.gguf"
    code, out, err = _main(capsys, "serve", "-m", str(missing), "--layer-start", "0", "--layer-end", "4", "-c", "0")
    assert code == 1
    assert _one_error_line(err) == f"skippy-wire: error: stage 0 cannot start: {missing}: no such file or directory"
    assert json.loads(out)["event"] == "error"


@pytest.mark.parametrize("command", [["run", "-n", "1", "hi"], ["api"], ["bench-backend"]])
def test_a_model_that_is_no_regular_file_is_named_and_never_waited_for(capsys, tmp_path, command):
    # a FIFO's open() waited for a writer for ever; /dev/null said "invalid argument" (mmap)
    fifo = tmp_path / "model.gguf"
    os.mkfifo(fifo)
    for path, kind in ((fifo, "a FIFO"), ("/dev/null", "a character device")):
        code, out, err = _main(capsys, command[0], "-m", str(path), *command[1:])
        assert (code, out) == (1, "")
        assert _one_error_line(err) == f"skippy-wire: error: {path}: it is {kind}, not a regular file"


@pytest.mark.parametrize("command", [["run", "hi"], ["api"], ["serve", "--stage", "0"]])
def test_a_topology_s_missing_model_is_reported_as_a_missing_model_is(capsys, tmp_path, command):
    """Was status 2, "tv.json: cannot read the model: [Errno 2] No such file or directory: ..."."""
    missing = tmp_path / "missing.gguf"
    topology = tmp_path / "tv.json"
    topology.write_text(json.dumps({"model_path": str(missing), "stages": [
        {"endpoint": "127.0.0.1:19000", "layer_start": 0, "layer_end": 4, "threads": -1}]}))
    code, out, err = _main(capsys, command[0], "--topology", str(topology), *command[1:])
    assert (code, out) == (1, "")
    assert _one_error_line(err) == f"skippy-wire: error: {missing}: no such file or directory"
    code, _, err = _main(capsys, "run", "-m", str(missing), "hi")  # the same as -m
    assert code == 1 and _one_error_line(err) == f"skippy-wire: error: {missing}: no such file or directory"


# -- P9, P10: options that were silently taken ------------------------------------------------------


@pytest.mark.parametrize("args, message", [
    (["run", "--raw", "-sys", "SYS", "hi"],
     "-sys/--system-prompt goes into the chat template, which --raw (-no-cnv) leaves out"),
    (["run", "--chec", "hi"], "unrecognized arguments: --chec; did you mean '--check'?"),
    (["run", "--temperatur=0"], "unrecognized arguments: --temperatur=0; did you mean '--temperature'?"),
    (["cluster", "--measure", "0"], "unrecognized arguments: --measure; did you mean '--measure-seconds'?"),
    (["serve", "--zzz"], "unrecognized arguments: --zzz"),
    (["--verison"], "unrecognized arguments: --verison; did you mean '--version'?"),  # every command takes it
    (["api", "--verison"], "unrecognized arguments: --verison; did you mean '--version'?"),
    # llama.cpp options this CLI lacks are refused, never split into a short option and a
    # value (`-ngl 99` was `-n gl`, `-nkvo` would be `-n kvo`; `-hf` was `-h -f`: help and exit 0)
    (["run", "-nkvo"], "unrecognized arguments: -nkvo"),
    (["run", "-hf", "x", "-p", "hi"], "unrecognized arguments: -hf"),
    (["-hf", "x", "-p", "hi"], "unrecognized arguments: -hf"),
    (["api", "-cx"], "unrecognized arguments: -cx"),  # not -c x
    (["run", "-t2", "hi"], "unrecognized arguments: -t2"),
    (["run", "-sy"], "unrecognized arguments: -sy; did you mean '-sys'?"),
    # the word after an unknown option went to PROMPT: "-b hi" named the prompt as -b's value
    (["run", "-b", "512", "--raw", "hi"], "unrecognized arguments: -b"),
    (["run", "--batch-size", "512", "hi"], "unrecognized arguments: --batch-size; did you mean '--chunk-size'?"),
    (["servr"], "unknown command 'servr'; did you mean 'serve'?"),
    (["verify"], "unknown command 'verify'; did you mean 'verify-exhaustive'?"),
])
def test_options_are_matched_whole_and_conflicts_found_whatever_the_value(capsys, args, message):
    assert_usage_error(capsys, args, message)


def test_an_option_s_value_may_begin_with_a_dash_as_in_llama_cpp():
    # argparse took "-hello" for an option: "argument -p/--prompt: expected one argument"
    from skippy_wire.tools import run

    parser = run.build_parser()
    args = parser.parse_args(["-p", "-hello", "-sys", "-be-brief", "-n", "-1"])
    assert (args.prompt_option, args.system_prompt, args.max_tokens) == ("-hello", "-be-brief", -1)
    with pytest.raises(SystemExit):  # one of the command's own options is still no value
        parser.parse_args(["-p", "--json"])
    assert parser.parse_args(["--", "-p"]).prompt == "-p"  # after --, a positional as before


def test_the_bench_scripts_match_options_whole_too():
    from skippy_wire.tools.bench_rows import script_options

    assert script_options("doc", ["--rounds", "2"], rounds=3).rounds == 2
    with pytest.raises(SystemExit):
        script_options("doc", ["--round", "2"], rounds=3)


BENCH_DIR = Path(__file__).resolve().parent.parent / "bench"


@pytest.mark.parametrize("script, args, message", [
    ("hop_bench.py", ["--tokens", "1"], "argument --tokens: must be between 2 and 8000, got 1"),  # ZeroDivisionError
    ("hop_bench.py", ["--stages", "1,,2"], "argument --stages: expected comma-separated integers, got '1,,2'"),
    ("hop_bench.py", ["--ahead", "maybe"], "argument --ahead: each value must be one of on, off, got 'maybe'"),
    ("hop_bench.py", ["--poll-ms", "auto,-3"],
     "argument --poll-ms: each value must be between 0 and 1000, got -3"),
    ("hop_bench.py", ["--poll-ms", "auto,often"], "argument --poll-ms: expected auto or a number, got 'often'"),
    ("serve_bench.py", ["--rounds", "0"], "argument --rounds: must be at least 1, got 0"),  # a KeyError at the end
    ("serve_bench.py", ["--split", "16,x"], "argument --split: expected comma-separated integers, got '16,x'"),
    ("prefill_overlap_bench.py", ["--chunk", "0"], "argument --chunk: must be at least 1, got 0"),
    # past the model's training context: silence for minutes, then a context error naming -c
    ("prefill_overlap_bench.py", ["--tokens", "100000"], "argument --tokens: must be between 1 and 8192, got 100000"),
    ("hop_bench.py", ["--tokens", "99999999"], "argument --tokens: must be between 2 and 8000, got 99999999"),
    ("wake_bench.py", ["--gaps", "-1"], "argument --gaps: each value must be between 0 and 1000, got -1"),
    # accepted before: eleven days of busy-waiting a message, a MemoryError after the header
    ("wake_bench.py", ["--gaps", "0,1e9"], "argument --gaps: each value must be between 0 and 1000, got 1e9"),
    ("wake_bench.py", ["--size", "99999999999"], "argument --size: must be between 1 and 67108864, got 99999999999"),
    # eight prompts: a ninth request was counted and never sent; one token has no decode rate
    ("serve_bench.py", ["--concurrency", "9"], "argument --concurrency: must be between 2 and 8, got 9"),
    ("serve_bench.py", ["--tokens", "1"], "argument --tokens: must be between 2 and 960, got 1"),
    # one "concurrent" request was the one request again (1.00x), and --tokens past the
    # stages' context failed after the first round (HTTP 400, status 1)
    ("serve_bench.py", ["--concurrency", "1"], "argument --concurrency: must be between 2 and 8, got 1"),
    ("serve_bench.py", ["--tokens", "2000"], "argument --tokens: must be between 2 and 960, got 2000"),
    ("wake_bench.py", ["--compute-steps", "100000000"],
     "argument --compute-steps: must be between 0 and 8000, got 100000000"),
    # a repeated setting ran again and printed its row twice
    ("hop_bench.py", ["--stages", "1,2,1"], "argument --stages: lists '1' twice; each value once"),
    ("hop_bench.py", ["--poll-ms", "1,auto,1.0"], "argument --poll-ms: lists '1' and '1.0', the same value; each value once"),
    ("wake_bench.py", ["--gaps", "0,0"], "argument --gaps: lists '0' twice; each value once"),
    # a one-line error of the package, after the stages list, with exit status 1
    *((script, ["--stages", stages], "argument --stages: the model's 30 layers make at most 30 stages, got 31")
      for script, stages in (("hop_bench.py", "1,31"), ("serve_bench.py", "31"), ("prefill_overlap_bench.py", "31"))),
    ("chain_floor.py", ["--stages", "65"], "argument --stages: each value must be between 1 and 64, got 65"),
    # failed only when a stage started, about --downstream
    ("serve_bench.py", ["--split", "10,10"],
     "argument --split: the counts must add up to the model's 30 layers, not 20"),
    # --stages was silently replaced by the split's count
    ("serve_bench.py", ["--split", "10,20", "--stages", "3"], "--split 10,20 makes 2 stages, not --stages 3"),
])
def test_the_bench_scripts_refuse_values_they_cannot_use_before_starting(script, args, message):
    """Each was a traceback (some after the stages had started and warmed up); an uneven
    --split was the error line without argparse's usage block."""
    done = subprocess.run([sys.executable, str(BENCH_DIR / script), *args], capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2 and done.stderr.splitlines()[-1] == f"{script}: error: {message}", done.stderr
    assert done.stderr.startswith("usage: "), done.stderr


@pytest.mark.parametrize("command", [["-m", "skippy_wire", "demo"],
                                     [str(BENCH_DIR / "wake_bench.py"), "--count", "3", "--compute-steps", "0"],
                                     # argparse drops the error of a command's help write (it exited 0)
                                     ["-m", "skippy_wire", "run", "--help"], ["-m", "skippy_wire", "help", "serve"]])
def test_output_to_a_closed_stdout_is_the_quiet_exit_141_not_lost_silently(command):
    """Started with stdout closed (``>&-``), Python has no sys.stdout: every line vanished and
    the command exited 0 as if its results had been shown."""
    done = subprocess.run([sys.executable, *command], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                          text=True, timeout=60, preexec_fn=lambda: os.close(1))
    assert done.returncode == EXIT_BROKEN_PIPE and done.stderr == "", done


def test_a_long_help_into_a_pipe_nobody_reads_is_the_quiet_exit_141():
    # argparse dropped the failed write of a help longer than stdout's buffer: exit 0
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        done = subprocess.run([sys.executable, "-m", "skippy_wire", "run", "--help"], stdout=write_end,
                              stderr=subprocess.PIPE, text=True, timeout=60,
                              env={k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"})
    finally:
        os.close(write_end)
    assert done.returncode == EXIT_BROKEN_PIPE and done.stderr == "", done


def test_a_closed_stderr_drops_the_diagnostics_and_keeps_stdout_for_the_output():
    # Python then has no sys.stderr, and print() put the usage and the error on stdout
    done = subprocess.run([sys.executable, "-m", "skippy_wire", "run", "--stages", "0", "hi"], stdout=subprocess.PIPE,
                          stderr=subprocess.DEVNULL, text=True, timeout=60, preexec_fn=lambda: os.close(2))
    assert done.returncode == 2 and done.stdout == "", done


def test_output_is_utf8_whatever_the_locale():
    # in the C locale stdout encoded ASCII: a generated "café" failed the run ("text is not valid UTF-8")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONIOENCODING", "PYTHONUTF8", "LANG")}
    env.update(LC_ALL="C", PYTHONUTF8="0")
    code = ("import sys; from skippy_wire.tools.cli import guarded\n"
            "sys.exit(guarded(lambda: print('caf\\u00e9') or print('x\\udcff', file=sys.stderr)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60, env=env)
    assert done.returncode == 0 and done.stdout == "café\n".encode("utf-8"), done
    assert done.stderr == b"x\\udcff\n", done  # stderr's backslashreplace kept (not strict: an error)


def test_a_command_line_text_is_read_as_utf8_whatever_the_locale():
    # the C locale's argv holds "café"'s bytes as escapes: it was refused as "not valid UTF-8"
    from skippy_wire.tools.api_keys import key_list
    from skippy_wire.tools.api_options import model_alias

    assert utf8("caf\udcc3\udca9") == "café"  # as argv holds it when decoded as ASCII
    with pytest.raises(argparse.ArgumentTypeError, match="not valid UTF-8"):
        utf8(os.fsdecode(b"caf\xff"))
    # an API key so given failed every request (a 500 encoding it), an alias was refused
    assert key_list("caf\udcc3\udca9,k2") == ["café", "k2"] and model_alias("caf\udcc3\udca9") == "café"
    assert serve.build_parser().parse_args(["-m", "m.gguf", "--model-id", "caf\udcc3\udca9"]).model_id == "café"
    assert run.build_parser().parse_args(["--model-id", "caf\udcc3\udca9", "hi"]).model_id == "café"


def test_a_thread_the_machine_will_not_start_is_a_one_line_error(capsys):
    # ulimit -u / -v: Thread.start()'s RuntimeError escaped as a traceback (run, api, bench)
    from skippy_wire.tools import cli

    def refused():
        raise RuntimeError("can't start new thread")

    assert cli.guarded(refused) == 1
    assert capsys.readouterr().err == "skippy-wire: error: can't start new thread\n"
    with pytest.raises(RuntimeError, match="a bug"):  # any other RuntimeError is a bug's traceback still
        cli.guarded(lambda: (_ for _ in ()).throw(RuntimeError("a bug")))


def test_a_pool_whose_manager_thread_never_started_ends_without_a_second_error():
    # "cannot join thread before it is started" masked the first error (verify-exhaustive under ulimit -u)
    import threading
    from concurrent.futures import ProcessPoolExecutor

    from skippy_wire.tools.signals import end_workers

    pool = ProcessPoolExecutor(1)
    pool._executor_manager_thread = threading.Thread(target=lambda: None)
    end_workers(pool)


def test_a_bench_script_stopped_by_sigterm_cleans_up_before_it_exits_143():
    """serve_bench.py's API process (its own session) outlived a SIGTERM, and its temporary
    directory stayed: the scripts' finally blocks did not run."""
    code = ("import os, signal, sys, time\n"
            "from skippy_wire.tools.bench_rows import script_main\n"
            "def main():\n"
            "    try:\n"
            "        os.kill(os.getpid(), signal.SIGTERM)\n"
            "        time.sleep(30)\n"
            "    finally:\n"
            "        print('cleaned up', flush=True)\n"
            "sys.exit(script_main(main))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == 143 and done.stdout == "cleaned up\n" and done.stderr == "", done


def test_the_bench_scripts_end_as_the_commands_do():
    """A Ctrl-C and a closed stdout were tracebacks; the scripts run through cli.guarded."""
    from skippy_wire.tools.cli import guarded

    def interrupted() -> int:
        raise KeyboardInterrupt

    assert guarded(interrupted) == EXIT_INTERRUPTED
    done = subprocess.run(f"{sys.executable} {BENCH_DIR / 'wake_bench.py'} --count 3 --compute-steps 0 --gaps 0,1 "
                          "| head -c 1", shell=True, capture_output=True, text=True, timeout=60)
    assert done.stdout == "#" and done.stderr == ""


@pytest.mark.parametrize("where", [["--connect", "127.0.0.1:9"], ["--topology", "t.json"]])
def test_api_stages_conflicts_with_connect_and_topology_at_its_default_value_too(capsys, monkeypatch, where):
    """argparse saw the conflict only for a value other than the default: `--stages 2 --connect` served."""
    monkeypatch.setattr(api, "_serve", lambda parser, args: 0)  # were it accepted: no HTTP server
    assert_usage_error(capsys, ["api", "--stages", "2", *where],
                       f"argument {where[0]}: not allowed with argument --stages")
    code, _, err = _main(capsys, "api", "--connect", "127.0.0.1:9")
    assert code == 0, err


#: The options that configure only the stage processes `run` and `api` start, each with the
#: value of their default where there is one (given, it is refused all the same).
_STARTED_STAGE_OPTIONS = [(["-t", "4"], "-t/--threads"), (["--threads", "-1"], "-t/--threads"),
                          (["--activation-codec", "bf16"], "--activation-codec"),
                          (["--activation-codec", "raw-f32-v1"], "--activation-codec"),
                          (["--activation-codec-policy", "fixed"], "--activation-codec-policy"),
                          (["--log-dir", "{logs}"], "--log-dir")]


@pytest.mark.parametrize("command", [["run", "hi"], ["api"]])
@pytest.mark.parametrize("where", [["--connect", "127.0.0.1:1"], ["--topology", "t.json"]])
@pytest.mark.parametrize("option, name", _STARTED_STAGE_OPTIONS)
def test_options_for_started_stages_are_refused_with_running_ones_whatever_the_value(
        capsys, monkeypatch, tmp_path, command, where, option, name):
    """`run --connect ... --log-dir X -t 8 --activation-codec s8` ran, made no X and ignored the
    rest; `api` too, while `api --stages` with --connect was already refused."""

    def started(*args, **kwargs):
        raise AssertionError("accepted although it configures nothing")

    monkeypatch.setattr("skippy_wire.tools.run._run", started)
    monkeypatch.setattr(api, "_serve", started)
    logs = tmp_path / "logs"
    option = [value.format(logs=logs) for value in option]
    assert_usage_error(capsys, [command[0], *where, *option, *command[1:]],
                       f"argument {name}: not allowed with argument {where[0]}: it configures the stage processes "
                       f"this command starts, and with {where[0]} it starts none")
    assert not logs.exists()
    # given before --connect/--topology: the same
    assert_usage_error(capsys, [command[0], *option, *where, *command[1:]],
                       f"argument {name}: not allowed with argument {where[0]}: it configures the stage processes "
                       f"this command starts, and with {where[0]} it starts none")


@pytest.mark.parametrize("where", [["--connect", "127.0.0.1:9"], ["--topology", "t.json"]])
def test_run_stages_conflicts_with_connect_and_topology_at_its_default_value_too(capsys, where):
    """As `api --stages`: it was taken and described nothing."""
    assert_usage_error(capsys, ["run", "--stages", "2", *where, "hi"],
                       f"argument {where[0]}: not allowed with argument --stages")
    assert_usage_error(capsys, ["run", *where, "--stages", "2", "hi"],
                       f"argument --stages: not allowed with argument {where[0]}")


def test_the_first_option_for_started_stages_is_named(capsys, tmp_path):
    assert_usage_error(capsys, ["run", "--connect", "127.0.0.1:1", "--log-dir", str(tmp_path / "y"), "-t", "8",
                                "--activation-codec", "s8", "hi"],
                       "argument --log-dir: not allowed with argument --connect: it configures the stage processes "
                       "this command starts, and with --connect it starts none")
    assert list(tmp_path.iterdir()) == []
    # refused before their values are checked: the conflict, not the codec rule, is the error
    assert_usage_error(capsys, ["api", "--connect", "127.0.0.1:1", "--activation-codec", "bf16",
                                "--activation-codec-policy", "auto-lossless"],
                       "argument --activation-codec: not allowed with argument --connect: it configures the stage "
                       "processes this command starts, and with --connect it starts none")


@pytest.mark.parametrize("command", ["run", "api"])
def test_options_for_started_stages_are_taken_when_the_command_starts_them(monkeypatch, tmp_path, command):
    from skippy_wire.tools import run

    module = run if command == "run" else api
    parser = module.build_parser()
    logs = tmp_path / "logs"
    args = parser.parse_args(["--stages", "3", "-t", "4", "--activation-codec", "bf16", "--activation-codec-policy",
                              "fixed", "--log-dir", str(logs)])
    module._check_args(parser, args)
    assert (args.stages, args.threads, args.activation_codec, args.log_dir) == (3, 4, "bf16-rne-v1", str(logs))
    args = parser.parse_args([])
    module._check_args(parser, args)  # --stages: its default filled in
    assert (args.stages, args.threads, args.activation_codec, args.activation_codec_policy, args.log_dir) == (
        2, None, "raw-f32-v1", "fixed", None)


def test_run_keeps_the_driver_s_own_options_with_connect(tmp_path):
    """-m (the tokenizer), -c (the prompt's room), --capture (the driver's hop0), --timeout,
    --protocol, --poll-ms and --check are the driver's: taken with running stages."""
    from skippy_wire.tools import run

    parser = run.build_parser()
    argv = ["--connect", "127.0.0.1:1", "-m", "m.gguf", "-c", "256", "--capture", str(tmp_path / "cap"),
            "--timeout", "5", "--protocol", "16", "--poll-ms", "1", "--check", "--chunk-size", "8", "hi"]
    args = parser.parse_args(argv)
    run._check_args(parser, args)
    assert (args.model, args.ctx_size, args.timeout, args.protocol, args.poll_ms) == ("m.gguf", 256, 5, 16, 1)


def test_run_t_with_connect_sets_the_check_s_in_process_stage(capsys, monkeypatch, tiny_model, fake_client):
    """-t counts for --check's in-process stage, which `run --connect --check` does start."""
    client = fake_client(" world")
    threads = []

    def generate_local(model, prompt, **kwargs):
        threads.append(kwargs["threads"])
        return GenerationResult(prompt_tokens=list(prompt), tokens=list(client.tokens), prefill_s=0.01, decode_s=0.01)

    monkeypatch.setattr("skippy_wire.tools.run.generate_local", generate_local)
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "--check",
                           "-t", "3", "hello")
    assert code == 0, err
    assert threads == [3] and "check: OK" in err


def test_run_connect_makes_no_log_directory(capsys, monkeypatch, tmp_path, tiny_model, fake_client):
    """Running stages log where they were told: no temporary directory for the driver alone."""
    fake_client(" world")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    made = []
    mkdtemp = tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *a, **k: made.append(mkdtemp(*a, **k)) or made[-1])
    code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "hello")
    assert code == 0, err
    assert made == []


@pytest.mark.parametrize("command", ["run", "api"])
def test_help_says_which_options_running_stages_refuse(capsys, command):
    code, out, _ = _main(capsys, command, "--help")
    assert code == 0
    out = " ".join(out.split())
    assert out.count("only for the stages this command starts: not with --connect/--topology") >= 3, out
    assert "--log-dir" in out.split("--connect HOST:PORT drive")[1].split("--topology FILE")[0]
    assert "describe nothing" not in out


def test_a_system_prompt_without_a_chat_template_is_refused(capsys, tiny_model):
    assert_usage_error(capsys, ["run", "-m", str(tiny_model), "-sys", "SYS", "hi"],
                       "-sys/--system-prompt: tiny.gguf has no chat template to put it in")


def test_llama_cpp_names_predict_and_bench_backend_m(capsys, tmp_path):
    from skippy_wire.tools import backend_bench, run

    for option in ("-n", "--predict", "--n-predict", "--max-tokens"):
        assert run.build_parser().parse_args([option, "5"]).max_tokens == 5
    args = backend_bench.build_parser().parse_args(["-m", "m.gguf", "-t", "1,2"])
    assert (args.model, args.threads) == ("m.gguf", [1, 2])
    missing = tmp_path / "missing.gguf"
    code, out, err = _main(capsys, "bench-backend", "-m", str(missing))
    assert (code, out) == (1, "") and _one_error_line(err) == f"skippy-wire: error: {missing}: no such file or directory"


# -- P11: NaN, a busy port ----------------------------------------------------------------------------


@pytest.mark.parametrize("args, option", [
    (["run", "--temp", "nan"], "--temp/--temperature"), (["run", "--poll-ms", "nan"], "--poll-ms"),
    (["run", "--repeat-penalty", "NaN"], "--repeat-penalty"), (["run", "--top-p", "nan"], "--top-p"),
    (["serve", "--lane-wait", "nan"], "--lane-wait"),
])
def test_nan_is_not_a_number_out_of_range(capsys, args, option):
    """It said "must be at least 0, got nan"."""
    assert_usage_error(capsys, args, f"argument {option}: must be a number, got {args[-1]}")


def test_a_busy_api_port_is_named_without_python_s_tuple(capsys, tiny_model):
    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        code, out, err = _main(capsys, "api", "-m", str(tiny_model), "--connect", "127.0.0.1:9",
                               "--listen", f"127.0.0.1:{port}")
    assert (code, out) == (1, "")
    assert _one_error_line(err) == f"skippy-wire: error: cannot listen on 127.0.0.1:{port}: address already in use"
    assert describe(OSError(98, "Address already in use (while attempting to bind on address ('127.0.0.1', 9411))")) \
        == "address already in use"


def test_bytes_of_a_name_that_are_not_utf8_are_shown_as_given(capsys, tmp_path):
    """Python keeps them as lone surrogates: the line read "/tmp/\\udcff.gguf"."""
    missing = f"{tmp_path}/\udcff.gguf"  # what argv holds for the bytes b"\xff.gguf"
    code, out, err = _main(capsys, "run", "-m", missing, "hi")
    assert (code, out) == (1, "")
    assert _one_error_line(err) == f"skippy-wire: error: {tmp_path}/\\xff.gguf: no such file or directory"
    assert_usage_error(capsys, ["run", "--chec\udcff"], "unrecognized arguments: --chec\\xff; did you mean '--check'?")


@pytest.mark.parametrize("stdin, prompt, said", [("pipe", [], True), ("pipe", ["hello"], False),
                                                 ("/dev/null", [], False)])
def test_a_run_without_a_prompt_says_it_leaves_piped_stdin_unread(capsys, tiny_model, fake_client, stdin, prompt,
                                                                    said):
    # `echo question | skippy-wire run` answered the default prompt without a word
    fake_client(" w")
    if stdin == "pipe":
        source, sink = os.pipe()
        os.write(sink, b"What is 2+2?\n")
        os.close(sink)
    else:
        source = os.open(stdin, os.O_RDONLY)
    saved = os.dup(0)
    os.dup2(source, 0)
    try:
        code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "-n", "2", *prompt)
    finally:
        os.dup2(saved, 0)
        os.close(saved)
        os.close(source)
    assert code == 0, err
    note = "[skippy-wire] stdin is not read (no prompt given: the default one); `-f -` reads the prompt from it\n"
    assert (note in err) is said, err


@pytest.mark.parametrize("ctx, said", [("1000", True), ("256", False)])
def test_a_context_beyond_the_training_one_is_warned_about_as_llama_cpp_does(capsys, tiny_model, fake_client, ctx,
                                                                              said):
    # -c 9000 on SmolLM2 (trained at 8192) ran without a word
    fake_client(" w")
    code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "-c", ctx, "-n", "2", "hi")
    assert code == 0, err
    warning = f"[skippy-wire] n_ctx ({ctx}) > n_ctx_train (256) -- possible training context overflow\n"
    assert (warning in err) is said, err


def test_llama_cli_s_display_and_log_flags_are_taken(capsys, tiny_model, fake_client):
    # --no-display-prompt, --log-disable, --no-warmup and --simple-io broke llama-cli command lines
    fake_client(" w")
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "-n", "2", "--raw",
                           "hello")
    assert code == 0 and out.startswith("hello") and "[skippy-wire]" in err, (out, err)
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "-n", "2", "--raw",
                           "--no-display-prompt", "--log-disable", "--no-warmup", "--simple-io", "--jinja", "hello")
    assert code == 0, err
    assert not out.startswith("hello") and " w" in out  # the continuation alone
    assert "[skippy-wire]" not in err  # --log-disable: --quiet


def test_bench_cluster_without_namespaces_says_so_before_its_header(capsys, monkeypatch, tiny_model):
    # (its header and the first row's line came first, then the error of the first run)
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: "network namespaces need root")
    code, out, err = _main(capsys, "bench-cluster", "--hosts", "2", "--rates", "unlimited", "--delays", "0",
                           "--codecs", "raw-f32", "-m", str(tiny_model))
    assert (code, out) == (1, "")
    assert err == "skippy-wire: error: cannot make namespace hosts: network namespaces need root\n"


def test_chain_floor_stopped_leaves_none_of_its_chain_processes():
    # SIGTERM (or a Ctrl-C to the script alone) left its forked stages waiting in recv for good
    script = subprocess.Popen([sys.executable, str(BENCH_DIR / "chain_floor.py"), "--stages", "2", "--tokens",
                               "100000", "--work-ms", "2"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    children: list[int] = []
    try:
        for _ in range(300):  # until its two stages run (bounded: 30 s)
            children = _children(script.pid)
            if len(children) == 2:
                break
            time.sleep(0.1)
        assert len(children) == 2, children
        script.terminate()
        assert script.wait(30) == 143
    finally:
        script.kill()
        script.wait(30)
        for _ in range(100):  # the orphans' reaping (bounded: 10 s)
            alive = [pid for pid in children if _running(pid)]
            if not alive:
                break
            time.sleep(0.1)
        for pid in alive:  # whatever the test's outcome, none is left behind
            os.kill(pid, signal.SIGKILL)
    assert not alive


def test_np_gives_a_stage_its_lanes_and_the_stages_api_starts_as_many(capsys, monkeypatch, tiny_model):
    """llama-server's -np: every stage kept 4 lanes, and `api -np` refused more than 4."""
    lanes, started = [], []

    def opened(*args, lane_count, **kwargs):
        lanes.append(lane_count)
        raise ValueError("not opened in this test")

    def launched(*args, extra_args, **kwargs):
        started.append(extra_args)
        raise PipelineError("not launched in this test")

    monkeypatch.setattr(RuntimeBackend, "open", opened)
    monkeypatch.setattr(api, "launch_pipeline", launched)
    for given in ([], ["-np", "8"], ["--parallel", "1"]):
        code, _, _ = _main(capsys, "serve", "-m", str(tiny_model), "--layer-start", "0", "--layer-end", "4", *given)
        assert code == 1
    code, _, err = _main(capsys, "api", "-m", str(tiny_model), "--port", "0", "-np", "8", "--poll-ms", "0")
    assert lanes == [4, 8, 1] and started == [["-np", "8"]] and code == 1, err
    code, _, err = _main(capsys, "api", "-np", "65")
    assert code == 2 and "argument --max-inflight/-np/--parallel: must be between 1 and 64, got 65" in err


def _bench_module(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH_DIR / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_wake_bench_polls_a_message_larger_than_the_socket_buffer_and_ranks_its_p90():
    wake = _bench_module("wake_bench")
    # both ends polling, a plain sendall on the non-blocking socket raised BlockingIOError
    # past the socket's buffer (4 MiB at most by default), within the --size accepted
    assert len(wake.round_trips(16 << 20, 0.0, 2, poll=True)) == 2
    assert wake.percentile_90([float(i) for i in range(1, 11)]) == 9.0  # was the largest of 10
    assert wake.percentile_90([float(i) for i in range(1, 21)]) == 18.0 and wake.percentile_90([5.0]) == 5.0


def _children(pid: int) -> list[int]:
    return [int(child) for child in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _running(pid: int) -> bool:
    return Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"


def test_the_c_chain_s_stages_end_with_their_driver(tmp_path):
    # Each stage holds its siblings' link ends: killed (the script's subprocess.run on SIGTERM), the
    # driver left them waiting in recv for good
    source, binary = tmp_path / "chain.c", tmp_path / "chain"
    source.write_text(_bench_module("chain_floor").C_CHAIN)
    subprocess.run(["cc", "-O2", "-o", str(binary), str(source)], check=True, timeout=120)
    driver = subprocess.Popen([str(binary), "2", "1000000", "0.002", "2304"], stdout=subprocess.DEVNULL)
    children: list[int] = []
    try:
        for _ in range(300):  # until both stages run (bounded: 30 s)
            children = _children(driver.pid)
            if len(children) == 2:
                break
            time.sleep(0.1)
        assert len(children) == 2, children
    finally:
        driver.kill()
        driver.wait(30)
    for _ in range(100):  # bounded: 10 s
        alive = [pid for pid in children if _running(pid)]
        if not alive:
            break
        time.sleep(0.1)
    for pid in alive:
        os.kill(pid, signal.SIGKILL)
    assert not alive


def test_chain_floor_without_a_working_compiler_says_so_and_measures_python(tmp_path):
    fake = tmp_path / "cc"
    fake.write_text("#!/bin/sh\necho 'chain.c:1:10: fatal error: stdio.h: No such file or directory' >&2\nexit 1\n")
    fake.chmod(0o755)
    done = subprocess.run([sys.executable, str(BENCH_DIR / "chain_floor.py"), "--stages", "1", "--tokens", "3",
                           "--work-ms", "0"], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PATH": f"{tmp_path}:{os.environ['PATH']}"})
    assert done.returncode == 0 and done.stderr == "", done.stderr
    first, *rows = done.stdout.splitlines()
    assert first.endswith(f"; {fake} failed (chain.c:1:10: fatal error: stdio.h: No such file or directory): "
                          "Python only"), first
    assert rows[-1].startswith("| all | 1 | ") and rows[-1].endswith(" | - | - |"), rows


def _fake_llama_cpp(root: Path, body: str) -> dict:
    """An installed llama-cpp-python whose package is ``body``; the environment that finds it."""
    (root / "llama_cpp").mkdir()
    (root / "llama_cpp" / "__init__.py").write_text(body)
    info = root / "llama_cpp_python-0.3.36.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: llama-cpp-python\nVersion: 0.3.36\n")
    return {**os.environ, "PYTHONPATH": f"{root}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}


def test_bench_backend_with_a_llama_cpp_that_does_not_load_measures_ours(tmp_path, tiny_model):
    # the worker's traceback, then "the llama.cpp worker exited", exit 1 and none of our figures
    env = _fake_llama_cpp(tmp_path, "raise RuntimeError('Failed to load shared library libllama.so: libgomp.so.1')\n")
    done = subprocess.run([sys.executable, "-m", "skippy_wire", "bench-backend", "-m", str(tiny_model), "--prefill",
                           "8", "--decode", "4", "--repeat", "1", "-t", "1"], capture_output=True, text=True,
                          timeout=300, env=env)
    assert done.returncode == 0 and "Traceback" not in done.stderr, done.stderr
    assert "llama.cpp: llama-cpp-python does not load (Failed to load shared library libllama.so: libgomp.so.1); " \
           "ours only\n" in done.stdout
    assert done.stdout.rstrip().splitlines()[-1].startswith("      1 | "), done.stdout  # our row


def test_a_ctrl_c_during_bench_backend_s_llama_cpp_is_quiet(tmp_path, tiny_model):
    # the worker printed its own KeyboardInterrupt traceback after the parent's quiet 130
    evaluating = tmp_path / "evaluating"
    env = _fake_llama_cpp(tmp_path, (
        "import pathlib, time\n"
        "class Llama:\n"
        "    def __init__(self, **kwargs):\n"
        "        pass\n"
        "    def reset(self):\n"
        "        pass\n"
        "    def n_vocab(self):\n"
        "        return 64\n"
        "    def eval(self, tokens):\n"
        f"        pathlib.Path({str(evaluating)!r}).touch()\n"
        "        time.sleep(60)\n"))
    bench = subprocess.Popen([sys.executable, "-m", "skippy_wire", "bench-backend", "-m", str(tiny_model),
                              "--prefill", "8", "--decode", "4", "--repeat", "1", "-t", "1"], stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
                             preexec_fn=default_sigint)  # a runner in the background ignores SIGINT
    try:
        for _ in range(600):  # until the worker sits in eval (bounded: 60 s)
            if bench.poll() is not None or evaluating.exists():
                break
            time.sleep(0.1)
        assert evaluating.exists(), bench.poll()
        os.killpg(bench.pid, signal.SIGINT)  # a terminal's Ctrl-C reaches the whole group
        out, err = bench.communicate(timeout=60)
    finally:
        if bench.poll() is None:
            os.killpg(bench.pid, signal.SIGKILL)
            bench.communicate(timeout=30)  # (its pipes closed too)
    assert bench.returncode == EXIT_INTERRUPTED, err
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err


def test_a_bench_cpu_this_process_cannot_run_on_is_one_line():
    # pytest's INTERNALERROR traceback from os.sched_setaffinity
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--co",
                           str(BENCH_DIR / "test_bench_frame.py")], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "SKIPPY_BENCH_CPU": str(os.cpu_count() + 7)})
    assert done.returncode == 4 and "INTERNALERROR" not in done.stdout + done.stderr, done
    assert f"SKIPPY_BENCH_CPU={os.cpu_count() + 7}: not a CPU this process may run on" in done.stderr, done

