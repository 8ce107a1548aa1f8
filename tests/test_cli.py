"""The ``skippy-wire`` command: every failure is one line ``skippy-wire: error: ...`` with
exit status 2 (usage) or 1 (runtime), never a traceback; ``run`` options as llama.cpp users
know them, sampling, chat templates, ``--json``, Ctrl-C and a closed stdout.

Argument probes run ``cli.main`` in this process (no stage starts: every check comes
before any process does); the ``slow`` tests start real stage processes.
"""

from __future__ import annotations

import importlib.metadata
import io
import json
import re
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from skippy_wire.errors import PipelineClosed, PipelineError
from skippy_wire.stage.models import Tokenizer, smollm2_path, write_tiny_llama_gguf
from skippy_wire.stage.chat import ChatTemplate
from skippy_wire.tools import api, cli, cluster, cluster_bench, run, serve
from skippy_wire.tools.bench_rows import cpu_text
from skippy_wire.tools.options import EXIT_BROKEN_PIPE, EXIT_HANGUP, EXIT_INTERRUPTED, describe
from skippy_wire.tools.poll_options import AUTO_STAGE_POLL_MS, driver_poll_s, poll_args
from skippy_wire.tools.template_options import load_chat_template
from process_helpers import default_sigint

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("cli-tiny") / "tiny.gguf")


def _main(capsys, *args: str) -> tuple[int, str, str]:
    """Run the command in this process: (exit status, stdout, stderr)."""
    try:
        code = cli.main(list(args))
    except SystemExit as exc:  # argparse exits
        code = exc.code
    out, err = capsys.readouterr()
    return code, out, err


def _one_error_line(err: str) -> str:
    """The one error line of ``err``; only argparse's usage and progress lines may come with it."""
    assert "Traceback" not in err
    lines = err.splitlines()
    errors = [line for line in lines if line.startswith("skippy-wire: error: ")]
    assert len(errors) == 1, err
    others = [line for line in lines if line not in errors and not line.startswith(("usage:", " ", "[skippy-wire] "))]
    assert not others, err
    return errors[0]


# -- usage errors: refused before anything starts ----------------------------------------------


@pytest.mark.parametrize("args,message", [
    (["run", "--stages", "0"], "argument --stages: must be at least 1, got 0"),
    (["run", "--stages", "-1"], "argument --stages: must be at least 1, got -1"),
    (["run", "--chunk-size", "0"], "argument --chunk-size: must be at least 1, got 0"),
    (["run", "--chunk-size", "-1"], "argument --chunk-size: must be at least 1, got -1"),
    (["run", "--max-tokens", "0"],
     "argument -n/--max-tokens/--predict/--n-predict: must be -1 (or -2: until the context is full) or at least 1, "
     "got 0"),
    (["run", "-n", "-5"],
     "argument -n/--max-tokens/--predict/--n-predict: must be -1 (or -2: until the context is full) or at least 1, "
     "got -5"),
    (["run", "--threads", "0"], "argument -t/--threads: must be -1 (the default) or between 1 and 512, got 0"),
    (["run", "-t", "99999999999"],
     "argument -t/--threads: must be -1 (the default) or between 1 and 512, got 99999999999"),
    (["run", "--ctx-size", "-1"], "argument -c/--ctx-size: must be between 0 and 16777216, got -1"),
    (["run", "-c", "99999999999", "hi", "-n", "2"],
     "argument -c/--ctx-size: must be between 0 and 16777216, got 99999999999"),
    (["run", "--timeout", "0"], "argument --timeout: must be greater than 0 and at most 1000000, got 0"),
    # 1e10 s passed, then failed every connection (time_t) or the run with a traceback
    (["run", "--timeout", "1e10"], "argument --timeout: must be greater than 0 and at most 1000000, got 1e10"),
    (["api", "--timeout", "1e10"], "argument --timeout: must be greater than 0 and at most 1000000, got 1e10"),
    (["serve", "--reply-timeout", "1e12"],
     "argument --reply-timeout: must be greater than 0 and at most 1000000, got 1e12"),
    (["serve", "--lane-wait", "1e308"], "argument --lane-wait: must be between 0 and 1000000, got 1e308"),
    # accepted before: 100000 worker processes, a billion rounds, a delay past any timeout
    (["verify-exhaustive", "--workers", "100000"], "argument --workers: must be between 1 and 512, got 100000"),
    # a chunk of 2^30 patterns asked 8 GiB of each worker at once
    (["verify-exhaustive", "--chunk", "0x40000000"],
     "argument --chunk: must be between 1 and 67108864, got 0x40000000"),
    (["bench", "--repeat", "100000000000"], "argument --repeat: must be between 1 and 1000, got 100000000000"),
    (["bench", "--min-time", "1e9"], "argument --min-time: must be greater than 0 and at most 1000000, got 1e9"),
    (["bench-backend", "--repeat", "1001"], "argument --repeat: must be between 1 and 1000, got 1001"),
    (["cluster", "--delay-ms", "1e12"], "argument --delay-ms: must be between 0 and 1000000000, got 1e12"),
    (["bench-cluster", "--delays", "0,1e12"], "argument --delays: each value must be between 0 and 1000000000, got 1e12"),
    # the rows were written, and lost, only once the whole matrix had run (minutes)
    (["bench-cluster", "--json", "/proc/self/nonexistent-dir/rows.json"],
     "--json /proc/self/nonexistent-dir/rows.json: no such file or directory"),
    (["bench-cluster", "--json", ""], "--json: give a file name, or - for stdout"),
    (["bench-cluster", "--json", "/"], "--json /: is a directory"),
    # a two-stage comparison was asked for and a batch table printed
    (["bench-backend", "--stages", "--batch", "2"], "--stages compares one stage with two; it does not go with --batch"),
    (["bench-backend", "--stages", "--matmul"], "--stages compares one stage with two; it does not go with --matmul"),
    (["run", "--temp", "-1e7"], "argument --temp/--temperature: must be between -1e+06 and 1e+06, got -1e7"),
    (["run", "--temp", "inf"], "argument --temp/--temperature: must be between -1e+06 and 1e+06, got inf"),
    (["run", "--temp", "1e39"], "argument --temp/--temperature: must be between -1e+06 and 1e+06, got 1e39"),
    (["run", "--repeat-penalty", "1e39"], "argument --repeat-penalty: must be greater than 0 and at most 10, got 1e39"),
    (["run", "--timeout", "inf"], "argument --timeout: must be finite, got inf"),
    (["run", "--top-p", "1.5"], "argument --top-p: must be between 0 and 1, got 1.5"),
    (["run", "--min-p", "nan"], "argument --min-p: must be a number, got nan"),
    (["run", "--top-k", "few"], "argument --top-k: expected an integer, got 'few'"),
    (["run", "--seed", str(2**64)], f"argument -s/--seed: must be between {1 - 2**64} and {2**64 - 1}, got {2**64}"),
    (["run", "--repeat-penalty", "0"], "argument --repeat-penalty: must be greater than 0 and at most 10, got 0"),
    (["run", "--repeat-last-n", "-2"], "argument --repeat-last-n: must be between -1 and 2147483647, got -2"),
    (["run", "--poll-ms", "-1"], "argument --poll-ms: must be between 0 and 1000, got -1"),
    (["api", "--poll-ms", "-1"], "argument --poll-ms: must be between 0 and 1000, got -1"),
    (["run", "--poll-ms", "often"], "argument --poll-ms: expected auto or a number, got 'often'"),
    *(([command, "-m", ""], "argument -m/--model: an empty path names no model file")  # ran the packaged model
      for command in ("run", "api", "serve", "cluster", "bench-backend", "bench-cluster")),
    # "$VAR" with VAR unset: plain TCP instead of mutual TLS, stages of its own instead of the topology's
    *(([*command, option.split("/")[0], ""], f"argument {option}: an empty path names no file or directory")
      for command, option in ((["serve"], "--tls-cert"), (["run"], "--tls-key"), (["api"], "--tls-ca"),
                              (["run"], "--topology"), (["api"], "--topology"), (["serve"], "--topology"),
                              (["run"], "--capture"), (["serve"], "--capture"), (["serve"], "--trace-compute"),
                              (["run"], "--log-dir"), (["api"], "--log-dir"), (["cluster"], "--log-dir"),
                              (["run"], "-f/--file"))),
    (["conformance", ""], "argument DIR: an empty path names no file or directory"),
    (["api", "--api-key-file", ""], "argument --api-key-file: an empty path names no file or directory"),
    # a host nothing can resolve or bind: status 1 after the model had loaded (a topology refused it)
    (["run", "--connect", "bad host:9000", "hi"],
     "argument --connect: host 'bad host' is not an IPv4 address or a host name (letters, digits, '-', '_', dots)"),
    (["serve", "--listen", "999.1.1.1:9000"], "argument --listen: host '999.1.1.1' is not a valid IPv4 address "
                                               "(four numbers of 0-255, or a shorter form the C library reads)"),
    (["inspect", ""], "argument file: an empty path names no file or directory"),
    (["run", "--interactive-first", "hi"], "--interactive-first is not supported: run generates once, as "
                                           "llama-cli's -cnv -st; for a conversation, serve it with `api`"),
    (["run", "-i", "hi"], "-i is not supported: run generates once, as llama-cli's -cnv -st; for a conversation, "
                          "serve it with `api`"),
    (["run", "-cnv", "--raw", "hi"], "-cnv/-st ask for the chat template, which --raw (-no-cnv) leaves out"),
    (["run", "-no-cnv", "-sys", "x", "hi"],
     "-sys/--system-prompt goes into the chat template, which --raw (-no-cnv) leaves out"),
    (["serve", "--poll-ms", "auto"], "argument --poll-ms: expected a number, got 'auto'"),
    # a wider window kept an idle stage's CPU busy for as long after a request
    (["api", "--poll-ms", "100000"], "argument --poll-ms: must be between 0 and 1000, got 100000"),
    (["serve", "--poll-ms", "1001"], "argument --poll-ms: must be between 0 and 1000, got 1001"),
    (["api", "--api-key", ""], "argument --api-key: the API key is empty"),
    (["api", "--api-key-file", "/nonexistent/key"],
     "argument --api-key-file: /nonexistent/key: no such file or directory"),
    (["run", "--stages", "two"], "argument --stages: expected an integer, got 'two'"),
    (["run", "--connect", "nonsense"], "argument --connect: address must be HOST:PORT, not 'nonsense'"),
    (["run", ""], "the prompt is empty"),
    (["run", "-p", ""], "the prompt is empty"),
    (["run", "a", "-p", "b"], "give the prompt once: as an argument, with -p/--prompt or with -f/--file"),
    (["run", "a", "-f", "/nonexistent"], "give the prompt once: as an argument, with -p/--prompt or with -f/--file"),
    (["run", "-f", "/nonexistent"], "-f/--file: /nonexistent: no such file or directory"),
    (["run", "--topology", "t.json", "--connect", "127.0.0.1:9"],
     "argument --connect: not allowed with argument --topology"),
    (["run", "--tls-cert", "/nonexistent/cert.pem", "--tls-key", "k.pem", "--tls-ca", "ca.pem", "hi"],
     "--tls-cert: /nonexistent/cert.pem: no such file or directory"),
    (["run", "\udcff"], "argument prompt: not valid UTF-8"),  # what argv b"\xff" decodes to
    (["run", "--activation-codec", "bf16-rne-v1", "--activation-codec-policy", "auto-lossless-v1"],
     "auto-lossless-v1 requires --activation-codec raw-f32-v1"),
    (["run", "--activation-codec", "bf16", "--activation-codec-policy", "auto-lossless"],  # the short names
     "auto-lossless-v1 requires --activation-codec raw-f32-v1"),
    (["serve", "-m", "m.gguf", "--layer-start", "0", "--layer-end", "1", "--activation-codec", "bf16",
      "--activation-codec-policy", "auto-lossless"], "auto-lossless-v1 requires --activation-codec raw-f32-v1"),
    (["run", "--activation-codec", "bf17"], "argument --activation-codec: invalid choice: 'bf17' (choose from "
     "'raw-f32-v1', 'f16-rne-v1', 'bf16-rne-v1', 's8-row-f32-rne-v1'; or the short names 'raw-f32', 'f16', "
     "'bf16', 's8')"),
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1", "--listen", "127.0.0.1:99999"],
     "argument --listen: port 99999 is out of range (0-65535)"),
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1", "--threads", "0"],
     "argument -t/--threads: must be -1 (the default) or between 1 and 512, got 0"),
    # (10 was taken, and every message refused: "needs at least 60 bytes, over the decoder limit of 10")
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1", "--max-message-bytes", "79"],
     "argument --max-message-bytes: must be at least 80, got 79"),
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "30", "--threads", "99999999999"],
     "argument -t/--threads: must be -1 (the default) or between 1 and 512, got 99999999999"),
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "30", "--ctx-size", "99999999999"],
     "argument -c/--ctx-size: must be between 0 and 16777216, got 99999999999"),
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1", "--io-timeout", "-1"],
     "argument --io-timeout: must be greater than 0 and at most 1000000, got -1"),
    (["serve", "--model", "m.gguf", "--layer-start", "3", "--layer-end", "2", "--stage-index", "1"],
     "--layer-end 2 must be greater than --layer-start 3"),
    (["serve", "--model", "m.gguf", "--layer-start", "2", "--layer-end", "4"],
     "--stage-index is required when --layer-start > 0: give this stage's place in the pipeline (1 for the stage "
     "after stage 0, and so on)"),
    # accepted, then every v17 link failed its setup on "admitted upstream relationship mismatch"
    (["serve", "--model", "m.gguf", "--layer-start", "15", "--layer-end", "30", "--stage-index", "0"],
     "--stage-index 0 with --layer-start 15: stage 0, and only stage 0, starts at layer 0"),
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "15", "--stage-index", "1"],
     "--stage-index 1 with --layer-start 0: stage 0, and only stage 0, starts at layer 0"),
    (["api", "--max-inflight", "0"], "argument --max-inflight/-np/--parallel: must be between 1 and 64, got 0"),
    (["api", "--listen", "127.0.0.1:70000"], "argument --listen: port 70000 is out of range (0-65535)"),
    (["conformance", "/nonexistent"], "/nonexistent: no such file or directory"),
    (["servr"], "unknown command 'servr'; did you mean 'serve'?"),
    (["inpsect", "x.bin"], "unknown command 'inpsect'; did you mean 'inspect'?"),
    # `help X` for no command X was the general usage and status 0
    (["help", "conformanc"], "unknown command 'conformanc'; did you mean 'conformance'?"),
    (["help", "nosuch"], "unknown command 'nosuch'; the commands: run, serve, cluster, bench-cluster, api, "
                         "inspect, conformance, bench, bench-backend, verify-exhaustive, demo"),
])
def test_usage_errors_are_one_line_with_status_2(capsys, args, message):
    assert_usage_error(capsys, args, message)


def test_a_mistyped_command_comes_after_the_usage_line_as_argparse_errors_do(capsys):
    code, out, err = _main(capsys, "servr")
    assert code == 2 and out == ""
    assert err.splitlines()[0].startswith("usage: skippy-wire ")


def assert_usage_error(capsys, args, message: str) -> None:
    """``skippy-wire ARGS`` exits 2 with ``message`` as its one error line, nothing on stdout."""
    code, out, err = _main(capsys, *args)
    assert code == 2
    assert out == ""
    assert _one_error_line(err) == f"skippy-wire: error: {message}"


def test_codec_options_take_the_short_names():
    for short, identity in {"raw-f32": "raw-f32-v1", "f16": "f16-rne-v1", "bf16": "bf16-rne-v1",
                            "s8": "s8-row-f32-rne-v1"}.items():
        args = run.build_parser().parse_args(["--activation-codec", short])
        assert args.activation_codec == identity
        assert run.build_parser().parse_args(["--activation-codec", identity]).activation_codec == identity
    assert run.build_parser().parse_args(["--activation-codec-policy", "auto-lossless"]).activation_codec_policy \
        == "auto-lossless-v1"


def test_top_k_at_or_below_zero_is_off_as_in_llama_cpp():
    for value in ("-1", "0"):
        assert run.sampling_params(run.build_parser().parse_args(["--top-k", value])).top_k == 0
    assert run.sampling_params(run.build_parser().parse_args(["--top-k", "7"])).top_k == 7


def test_seed_4294967295_is_random_as_in_llama_cli():
    # llama.cpp's LLAMA_DEFAULT_SEED (and the API's seed of that value): it ran as seed 0 did.
    def seed(value):
        return run.sampling_params(run.build_parser().parse_args(["-s", value])).seed

    assert seed("-1") is None and seed("4294967295") is None
    assert seed("0") == 0 and seed("4294967294") == 4294967294
    # llama-cli keeps the low 32 bits of what std::stoul read (-2 was refused here, and 2^32)
    assert seed("-2") == 4294967294 and seed(str(2**32 + 5)) == 5 and seed(str(2**32 - 1 + 2**32)) is None


def test_the_penalties_look_back_64_tokens_as_in_llama_cli():
    def wire(*args):
        return run.sampling_params(run.build_parser().parse_args(list(args))).wire()

    assert wire("--repeat-penalty", "1.2").penalty_last_n == 64
    assert wire("--presence-penalty", "1", "--repeat-last-n", "-1").penalty_last_n == -1  # the whole context
    off = wire("--repeat-penalty", "1.2", "--repeat-last-n", "0", "--temp", "0")
    assert off is None  # no penalty left: greedy, as --temp 0 alone is


def test_a_file_where_a_directory_is_needed_is_refused(capsys, tmp_path):
    a_file = tmp_path / "file"
    a_file.write_text("x")
    for option in ("--capture", "--log-dir"):
        code, out, err = _main(capsys, "run", option, str(a_file), "hi")
        assert code == 2 and out == ""
        assert _one_error_line(err) == f"skippy-wire: error: {option} {a_file}: not a directory"


def test_more_stages_than_layers_and_a_full_context_are_refused_before_starting(capsys, tiny_model):
    code, _, err = _main(capsys, "run", "--model", str(tiny_model), "--stages", "5", "hi")
    assert code == 2
    assert _one_error_line(err) == "skippy-wire: error: --stages 5: tiny.gguf has only 4 layers"
    # The tiny model has no chat template: "hello" is 5 byte tokens + BOS.
    code, _, err = _main(capsys, "run", "--model", str(tiny_model), "--ctx-size", "16", "-n", "11", "hello")
    assert code == 2
    assert _one_error_line(err) == "skippy-wire: error: 6 prompt tokens + 11 new tokens exceed --ctx-size 16"


def test_a_model_without_a_tokenizer_is_named_once(capsys, monkeypatch, tiny_model):
    """The GGUF reader's errors name the file: the run's line did too, twice."""
    for reason, line in ((f"{tiny_model} has no tokenizer.ggml.model",
                          f"cannot load the tokenizer: {tiny_model} has no tokenizer.ggml.model"),
                         ("unsupported vocabulary 'rwkv'",
                          "cannot load the tokenizer of tiny.gguf: unsupported vocabulary 'rwkv'")):
        def refuse(path, reason=reason):
            raise ValueError(reason)

        monkeypatch.setattr(Tokenizer, "from_gguf", refuse)
        code, out, err = _main(capsys, "run", "--model", str(tiny_model), "hi")
        assert code == 1 and out == ""
        assert _one_error_line(err) == f"skippy-wire: error: {line}"


def test_a_missing_model_is_a_runtime_error(capsys, tmp_path):
    missing = tmp_path / "missing.gguf"
    code, out, err = _main(capsys, "run", "--model", str(missing), "hi")
    assert code == 1 and out == ""
    assert _one_error_line(err) == f"skippy-wire: error: {missing}: no such file or directory"


def test_an_empty_model_file_is_named(capsys, tmp_path):
    empty = tmp_path / "empty.gguf"
    empty.write_bytes(b"")
    code, out, err = _main(capsys, "run", "-m", str(empty), "hi")
    assert code == 1 and out == ""
    assert _one_error_line(err) == f"skippy-wire: error: {empty}: the file is empty"


class _FakeClient:
    """A ``PipelineClient`` for ``run --connect``: records ``generate``'s ``max_tokens``,
    streams ``tokens`` through ``on_token``, then calls ``then`` (to raise or signal)."""

    max_tokens: list[int] = []
    session_end_error = None  # what the closing Stop's failure said, if it failed

    def __init__(self, tokens, then=None) -> None:
        self.tokens, self.then = tokens, then

    def __call__(self, *args, **kwargs) -> "_FakeClient":
        self.kwargs = kwargs
        return self

    def __enter__(self) -> "_FakeClient":
        return self

    def __exit__(self, *exc) -> None:
        pass

    def generate(self, prompt, *, max_tokens, on_token, **kwargs):
        from skippy_wire.net.driver import GenerationResult

        self.max_tokens.append(max_tokens)
        for token in self.tokens:
            on_token(token)
        if self.then:
            self.then()
        return GenerationResult(prompt_tokens=list(prompt), tokens=list(self.tokens), prefill_s=0.01, decode_s=0.01,
                                session_end_error=self.session_end_error)


@pytest.fixture
def fake_client(monkeypatch, tiny_model):
    """``run --connect`` against a fake stage 0 (no process): returns a function that
    installs one ``_FakeClient`` streaming the tokens of ``text``."""
    tokens = Tokenizer.from_gguf(tiny_model).encode

    def install(text: str = " world", then=None) -> _FakeClient:
        client = _FakeClient(tokens(text)[1:], then)  # without BOS
        _FakeClient.max_tokens = []
        monkeypatch.setattr("skippy_wire.tools.run.PipelineClient", client)
        return client

    return install


def test_connect_json_reports_null_for_what_the_driver_cannot_know(capsys, tiny_model, fake_client):
    fake_client()
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                           "hello")  # the stages' codec and threads cannot be given: they are not the driver's
    assert code == 0, err
    summary = json.loads(out)["summary"]
    assert summary["connected"] == "127.0.0.1:9"
    assert [summary[k] for k in ("stages", "codec", "policy", "threads")] == [None, None, None, None]


def test_json_names_a_model_file_whose_name_is_not_utf8_as_it_was_given(capsys, tiny_model, fake_client, tmp_path):
    # its raw byte made the JSON invalid (RFC 8259: UTF-8), or the write failed after the generation
    fake_client()
    odd = Path(os.fsdecode(bytes(tmp_path) + b"/x\xff.gguf"))
    odd.symlink_to(tiny_model)
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(odd), "--json", "--quiet", "hi")
    assert code == 0, err
    assert json.loads(out.encode("utf-8"))["summary"]["model"].endswith("x\\xff.gguf")


def test_v17_connect_checks_the_stages_model_id_as_given_or_the_file_s_stem(capsys, tiny_model, fake_client):
    client = fake_client()
    for extra, model_id in (([], None), (["--protocol", "17"], tiny_model.stem),
                            (["--protocol", "17", "--model-id", "smol"], "smol")):
        code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", *extra, "hi")
        assert code == 0, err
        assert client.kwargs["model_id"] == model_id and client.kwargs["protocol"] == (17 if extra else 15)


def test_a_link_closed_on_the_first_tokens_says_what_a_later_stage_at_connect_would_do(capsys, tiny_model, fake_client):
    def closed(on_first_tokens: bool):
        def close():
            exc = PipelineClosed("stage 0 at 127.0.0.1:9 closed the connection during PREFILL_FINAL_EMBD (session 1)")
            exc.on_first_tokens = on_first_tokens
            raise exc
        return close

    for text, hinted in (("", True), ("", False), (" world", False)):
        fake_client(text, then=closed(hinted))
        code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "hi")
        assert code == 1
        assert _one_error_line(err).endswith(
            "; if 127.0.0.1:9 is not stage 0, that is why: a later stage refuses a driver's tokens") == hinted


def test_a_capture_on_a_full_disk_is_said_once_and_the_text_whole(tmp_path, tiny_model):
    for suffix in ("messages", "replies"):
        os.symlink("/dev/full", tmp_path / f"hop0-{suffix}.bin")  # every write fails with ENOSPC
    args = ["-m", str(tiny_model), "-c", "64", "-n", "4", "--temp", "0", "--raw", "--quiet", "hello"]
    captured = subprocess.run([sys.executable, "-m", "skippy_wire", "run", "--stages", "1", "--capture", str(tmp_path),
                               *args], capture_output=True, text=True, timeout=120)
    plain = subprocess.run([sys.executable, "-m", "skippy_wire", "run", "--stages", "1", *args],
                           capture_output=True, text=True, timeout=120)
    assert captured.returncode == 0 and captured.stdout == plain.stdout, captured.stderr
    assert f"[skippy-wire] --capture: cannot write {tmp_path}/hop0-messages.bin (no space left on device); " \
           "nothing more is written to it\n" in captured.stderr
    assert "Traceback" not in captured.stderr


def test_a_text_whose_closing_stop_went_unanswered_is_printed_with_a_warning(capsys, tiny_model, fake_client):
    client = fake_client(" world")
    client.session_end_error = "stage 0 at 127.0.0.1:9: no answer to Stop (session 1) within 60 s"
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                           "hello")
    assert code == 0, err  # the text is whole
    doc = json.loads(out)
    assert doc["text"] == " world" and doc["summary"]["session_end_error"] == client.session_end_error
    assert err == ("[skippy-wire] warning: the session's closing Stop got no answer (its text is complete): "
                   f"{client.session_end_error}\n")


def test_llama_cli_special_values_fill_the_training_context(capsys, tiny_model, fake_client):
    """-n -1: until the context is full; -c 0: the model's training context (256 tokens)."""
    fake_client()
    code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                         "-c", "0", "-n", "-1", "hello")
    assert code == 0, err
    assert _FakeClient.max_tokens == [256 - 6]  # "hello": BOS + 5 byte tokens
    # llama-cli's -n -2, "until the context is filled", was refused
    code, _, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                         "-c", "0", "-n", "-2", "hello")
    assert code == 0, err
    assert _FakeClient.max_tokens == [256 - 6] * 2
    code, _, err = _main(capsys, "run", "-m", str(tiny_model), "-c", "6", "-n", "-1", "hello")
    assert code == 2
    assert _one_error_line(err) == "skippy-wire: error: 6 prompt tokens leave no room for new tokens in --ctx-size 6"
    code, _, err = _main(capsys, "run", "-m", str(tiny_model), "-c", "0", "-n", "300", "hello")
    assert _one_error_line(err) == ("skippy-wire: error: 6 prompt tokens + 300 new tokens exceed --ctx-size 256 "
                                    "(the model's training context)")


def test_the_prompt_can_come_from_a_file(capsys, tmp_path, tiny_model, fake_client):
    fake_client()
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("hello\nthere\n")
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                           "-f", str(prompt))
    assert code == 0, err
    assert json.loads(out)["prompt"] == "hello\nthere"  # one trailing newline dropped, as llama-cli does
    prompt.write_bytes(b"\xff")
    code, _, err = _main(capsys, "run", "-f", str(prompt))
    assert code == 2 and _one_error_line(err) == f"skippy-wire: error: -f/--file: {prompt}: not valid UTF-8"


def test_escapes_in_the_prompt_are_read_as_llama_cli_reads_them(capsys, tmp_path, tiny_model, fake_client):
    """llama-cli's -e is on by default: `-p "a\\nb"` is two lines (the backslash was sent)."""
    fake_client()
    typed = "line\\none\\t\\x41\\xc3\\xa9 \\q \\\\n"
    for extra, expected in (([], "line\none\tA\u00e9 \\q \\n"), (["--no-escape"], typed)):
        code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                               "-p", typed, *extra)
        assert code == 0, err
        assert json.loads(out)["prompt"] == expected
    code, _, err = _main(capsys, "run", "-p", "\\xff")
    assert code == 2 and _one_error_line(err) == \
        "skippy-wire: error: the prompt's \\x escapes make no UTF-8 (--no-escape sends them as typed)"


def test_the_prompt_file_can_be_stdin_and_is_read_within_a_bound(capsys, monkeypatch, tiny_model, fake_client):
    fake_client()
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO("hi\nyou\n".encode())))
    code, out, err = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--json", "--quiet",
                           "-f", "-")
    assert code == 0, err
    assert json.loads(out)["prompt"] == "hi\nyou"
    monkeypatch.setattr(sys, "stdin", None)
    code, _, err = _main(capsys, "run", "-f", "-")
    assert code == 2 and _one_error_line(err) == "skippy-wire: error: -f/--file: stdin is closed"
    code, _, err = _main(capsys, "run", "-f", "/dev/zero")  # read without end before
    assert code == 2 and _one_error_line(err) == "skippy-wire: error: -f/--file: /dev/zero: longer than 8 MiB"


def test_ctrl_c_mid_generation_ends_the_partial_line(capsys, tiny_model, fake_client):
    def interrupt():
        raise KeyboardInterrupt

    fake_client(" world", then=interrupt)
    code, out, _ = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "hello")
    assert code == EXIT_INTERRUPTED
    assert out == "hello world\n"


def test_sighup_cleans_up_like_ctrl_c(capsys, monkeypatch, tmp_path, tiny_model, fake_client):
    """SIGHUP (a closed terminal) exits 129 after the cleanup: the temporary log directory is gone."""
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    seen = []
    previous = signal.signal(signal.SIGHUP, lambda *_: seen.append("not handled by run"))  # old code: would die
    try:
        fake_client(" world", then=lambda: (os.kill(os.getpid(), signal.SIGHUP), time.sleep(0.5)))
        code, out, _ = _main(capsys, "run", "--connect", "127.0.0.1:9", "-m", str(tiny_model), "--quiet", "hello")
    finally:
        signal.signal(signal.SIGHUP, previous)
    assert (code, seen) == (EXIT_HANGUP, [])
    assert out.endswith("\n")
    assert not list(tmp_path.glob("skippy-wire-logs-*"))


def test_progress_says_one_stage_process_and_t_minus_1_is_the_default(capsys, monkeypatch, tiny_model):
    started = []

    def launch(model, stages, **kwargs):
        started.append(kwargs["threads"])
        raise PipelineError("stage 0 cannot start: stop here")

    monkeypatch.setattr("skippy_wire.tools.run.launch_pipeline", launch)
    code, _, err = _main(capsys, "run", "-m", str(tiny_model), "--stages", "1", "-t", "-1", "hello")
    assert code == 1 and started == [None]
    assert "; 1 stage process;" in err


def test_top_level_handler_turns_escaping_errors_into_one_line(capsys, monkeypatch):
    def fail(error):
        def main(argv):
            raise error
        return main

    monkeypatch.setattr("skippy_wire.tools.demo.main", fail(PipelineError("stage 1 is gone\n  (see its log)")))
    code, _, err = _main(capsys, "demo")
    assert code == 1 and err == "skippy-wire: error: stage 1 is gone (see its log)\n"
    monkeypatch.setattr("skippy_wire.tools.demo.main", fail(ValueError("bad value")))
    code, _, err = _main(capsys, "demo")
    assert code == 1 and err == "skippy-wire: error: bad value\n"
    monkeypatch.setattr("skippy_wire.tools.demo.main", fail(KeyboardInterrupt()))
    assert _main(capsys, "demo") == (EXIT_INTERRUPTED, "", "")


def test_the_command_line_starts_without_the_heavy_imports():
    """Imports before ``main`` runs are outside its Ctrl-C handling and delay every
    ``--help``: ml_dtypes alone took ~1.5 s; the commands import what they need."""
    probe = "import sys, skippy_wire.tools.cli; print(sorted(m for m in sys.modules if m.split('.')[0] in ('ml_dtypes', 'uvicorn', 'jinja2', 'gguf') or m.startswith('skippy_wire.stage')))"
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_mistyped_commands_and_prompts():
    assert cli.mistyped_command("servr") == "serve"
    assert cli.mistyped_command("rn") == "run"
    assert cli.mistyped_command("verify") == "verify-exhaustive"
    for prompt in ("hello", "Paris", "What is it?", "server's", "-n", ""):
        assert cli.mistyped_command(prompt) is None, prompt


def test_describe_gives_one_line():
    assert describe(FileNotFoundError(2, "No such file or directory", "/x")) == "/x: no such file or directory"
    assert describe(ValueError("two\nlines")) == "two lines"
    assert describe(RuntimeError()) == "RuntimeError"


def test_version_and_help(capsys):
    code, out, _ = _main(capsys, "--version")
    assert code == 0
    assert out.startswith(f"skippy-wire {importlib.metadata.version('skippy_wire')}; ggml ")
    assert out == cli.version_text() + "\n" and out.count("\n") == 1
    code, out, _ = _main(capsys, "run", "--help")
    assert code == 0
    out = " ".join(out.split())  # help text wraps with the terminal width
    for shown in ("(default: 0.8)", "(default: 40)", "(default: 0.95)", "(default: 0.05)", "(default: 1.0)",
                  "(default: -1)", "(default: 64)", "(default: 2)", "(default: 128)", "(default: 512)",
                  "(default: raw-f32-v1)", "(default: fixed)", "(default: 1;", "(default: off)"):
        assert shown in out, shown
    for option in ("-m MODEL", "-p PROMPT", "-n MAX_TOKENS", "-t THREADS", "-s SEED", "--temp", "--top-k",
                   "--top-p", "--min-p", "--repeat-penalty", "--repeat-last-n", "--presence-penalty", "--frequency-penalty",
                   "--raw", "--json", "-sys"):
        assert option in out, option
    code, out, _ = _main(capsys, "serve", "--help")
    out = " ".join(out.split())
    # A flag says what its absence means in its own words, not "(default: True)".
    assert "(default: True)" not in out and "(default: False)" not in out
    assert "--no-decode-ahead first stage: compute each decode step only when its message arrives" in out
    # git's `help COMMAND` (it printed the list of commands); `help` alone still does
    assert _main(capsys, "help", "serve")[1] == _main(capsys, "serve", "--help")[1]
    assert _main(capsys, "help")[1] == cli.usage() + "\n"
    for asked in ("-h", "--help", "help"):  # help about `help` (it was "unknown command '--help'")
        assert _main(capsys, "help", asked)[:2] == (0, cli.usage() + "\n")


# -- real processes ----------------------------------------------------------------------------


def _cli(*args, timeout=240, **kwargs):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    kwargs.setdefault("stdout", subprocess.PIPE)
    kwargs.setdefault("stderr", subprocess.PIPE)
    return subprocess.run([sys.executable, "-m", "skippy_wire", *args], text=True, timeout=timeout, cwd=REPO,
                          env=env, **kwargs)


def _pids_of(marker: str) -> list[int]:
    """Processes whose command line names ``marker`` (a unique model path), zombies excluded."""
    found = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
    alive = []
    for pid in map(int, found):
        try:
            if Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
                alive.append(pid)
        except OSError:
            pass
    return alive


def test_serve_on_a_busy_port_says_so(tiny_model):
    import socket

    with socket.create_server(("127.0.0.1", 0)) as busy:
        port = busy.getsockname()[1]
        proc = _cli("serve", "--model", str(tiny_model), "--layer-start", "0", "--layer-end", "4",
                    "--listen", f"127.0.0.1:{port}", timeout=60)
    assert proc.returncode == 1
    assert _one_error_line(proc.stderr) == \
        f"skippy-wire: error: stage 0 cannot start: cannot listen on 127.0.0.1:{port}: address already in use"
    event = json.loads(proc.stdout)
    assert event["event"] == "error" and "address already in use" in event["message"]


@pytest.mark.slow
def test_a_truncated_model_names_the_cause(tiny_model, tmp_path):
    truncated = tmp_path / "truncated.gguf"
    data = tiny_model.read_bytes()
    truncated.write_bytes(data[: len(data) // 2])
    proc = _cli("run", "--model", str(truncated), "--quiet", "hi", timeout=120)
    assert proc.returncode == 1, proc.stderr
    line = _one_error_line(proc.stderr)
    assert line.startswith("skippy-wire: error: stage 1 cannot start: ModelError: GGUF is truncated in tensor "), line
    assert "status -6" not in line and "Fatal Python error" not in proc.stderr
    assert not _pids_of(str(truncated))


@pytest.mark.slow
def test_a_closed_stdout_ends_quietly(tiny_model, tmp_path):
    """`skippy-wire run | head -c 0` and `skippy-wire demo | head`: no traceback, no stage left."""
    model = tmp_path / "closed-stdout.gguf"
    model.write_bytes(tiny_model.read_bytes())
    for args in (["run", "--model", str(model), "--quiet", "hello"], ["demo"]):
        read, write = os.pipe()
        os.close(read)  # every write to stdout fails with EPIPE
        try:
            proc = _cli(*args, stdout=write, timeout=120)
        finally:
            os.close(write)
        assert proc.returncode == EXIT_BROKEN_PIPE, proc.stderr
        assert proc.stderr == ""
    assert not _pids_of(str(model))


def test_polling_stages_and_driver_give_the_one_stage_tokens(capsys, tiny_model):
    """--poll-ms reaches the started stages (their ``serve`` accepts it) and the driver."""
    code, out, err = _main(capsys, "run", "--model", str(tiny_model), "--stages", "2", "--poll-ms", "0.5", "--json",
                           "--quiet", "--temp", "0", "--check", "-n", "8", "hello")
    assert code == 0, err
    assert json.loads(out)["check"]["ok"]


@pytest.mark.slow
def test_ctrl_c_during_run_exits_130_and_stops_the_stages(tmp_path):
    model = tmp_path / "ctrl-c.gguf"
    model.symlink_to(smollm2_path())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "skippy_wire", "run", "--model", str(model), "--raw",
                             "--temp", "0", "-n", "400", "Once upon a time"],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO, env=env,
                            start_new_session=True, preexec_fn=default_sigint)
    try:
        progress = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            line = proc.stderr.readline()
            progress.append(line)
            if not line or "generating:" in line:
                break
        assert "generating:" in progress[-1], "".join(progress)
        stages = [pid for pid in _pids_of(str(model)) if pid != proc.pid]
        assert len(stages) == 2
        proc.stdout.read(20)  # text is streaming
        os.killpg(proc.pid, signal.SIGINT)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
    assert proc.returncode == EXIT_INTERRUPTED, err
    assert err == ""
    deadline = time.monotonic() + 10
    while _pids_of(str(model)) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not _pids_of(str(model)), "stage processes outlived Ctrl-C"


# -- sampling, chat template and --json against one running SmolLM2 pipeline -------------------


@pytest.fixture(scope="module")
def smollm2_pipeline():
    from skippy_wire.net.supervision import launch_pipeline

    with launch_pipeline(smollm2_path(), 2, threads=1, startup_timeout=120) as cluster:
        yield "%s:%d" % cluster.entry


def _run_json(capsys, address: str, *args: str) -> dict:
    code, out, err = _main(capsys, "run", "--connect", address, "--json", "--quiet", "-n", "12", *args)
    assert code == 0, err
    assert out.endswith("\n") and out.count("\n") == 1, out  # one JSON object and nothing else
    return json.loads(out)


@pytest.mark.slow
def test_json_is_one_object_with_text_and_summary(capsys, smollm2_pipeline):
    doc = _run_json(capsys, smollm2_pipeline, "--temp", "0", "--check", "What is the capital of France?")
    assert set(doc) == {"text", "prompt", "summary", "check"}
    assert doc["prompt"] == "What is the capital of France?"
    assert doc["text"] and doc["check"]["ok"]
    summary = doc["summary"]
    assert summary["sampling"] is None and summary["chat_template"] is True and summary["protocol"] == 15
    assert summary["connected"] == smollm2_pipeline
    assert 1 <= summary["completion_tokens"] <= 12 and summary["stop_reason"] in ("eog", "max_tokens")
    assert summary["session_end_error"] is None  # the closing Stop was answered


@pytest.mark.slow
def test_chat_template_is_applied_by_default_and_raw_is_not(capsys, smollm2_pipeline):
    prompt = "What is the capital of France?"
    tokenizer = Tokenizer.from_gguf(smollm2_path())
    rendered = ChatTemplate.from_gguf(smollm2_path(), tokenizer).render([{"role": "user", "content": prompt}])
    chat = _run_json(capsys, smollm2_pipeline, "--temp", "0", prompt)
    raw = _run_json(capsys, smollm2_pipeline, "--temp", "0", "--raw", prompt)
    assert chat["summary"]["prompt_tokens"] == len(tokenizer.encode(rendered))
    assert raw["summary"]["prompt_tokens"] == len(tokenizer.encode(prompt))
    assert chat["summary"]["chat_template"] and not raw["summary"]["chat_template"]
    # llama-cli's completion mode is --raw, its one chat turn run's default
    for flags, like in ((["-no-cnv"], raw), (["-cnv", "-st"], chat)):
        run_ = _run_json(capsys, smollm2_pipeline, "--temp", "0", *flags, prompt)
        assert (run_["text"], run_["summary"]["prompt_tokens"], run_["summary"]["chat_template"]) == \
            (like["text"], like["summary"]["prompt_tokens"], like["summary"]["chat_template"]), flags
    # A system prompt replaces the template's default one; this small model then answers.
    answer = _run_json(capsys, smollm2_pipeline, "--temp", "0", "-sys", "You are a helpful assistant.", prompt)
    assert answer["text"].startswith("The capital of France is Paris")


@pytest.mark.slow
def test_a_seed_repeats_and_sampling_differs_from_greedy(capsys, smollm2_pipeline):
    prompt = ["--raw", "Once upon a time, in a small village by the sea, there lived"]
    first = _run_json(capsys, smollm2_pipeline, "-s", "7", "--temp", "0.9", "--check", *prompt)
    again = _run_json(capsys, smollm2_pipeline, "-s", "7", "--temp", "0.9", *prompt)
    assert first["text"] == again["text"] and first["summary"]["tokens"] == again["summary"]["tokens"]
    assert first["summary"]["sampling"]["seed"] == 7 and first["summary"]["sampling"]["temperature"] == 0.9
    assert first["check"]["ok"], first["check"]  # the in-process stage samples the same tokens
    greedy = _run_json(capsys, smollm2_pipeline, "--temp", "0", *prompt)["summary"]["tokens"]
    sampled = [_run_json(capsys, smollm2_pipeline, "-s", str(seed), "--temp", "0.9", *prompt)["summary"]["tokens"]
               for seed in (1, 2, 3)]
    assert any(tokens != greedy for tokens in sampled)


def test_an_empty_system_prompt_keeps_the_template_s_own_as_in_llama_cli():
    # llama-cli adds a system message only when -sys is not empty; an empty one replaced SmolLM2's default
    model, parser = Path(smollm2_path()), run.build_parser()
    tokenizer = Tokenizer.from_gguf(model)

    def prompt(*flags: str) -> str:
        return run._prompt_text(parser, parser.parse_args([*flags, "hi"]), model, tokenizer, print)[0]

    assert prompt("-sys", "") == prompt() != prompt("-sys", "Be brief.")
    assert "Be brief." in prompt("-sys", "Be brief.")


def test_a_bos_the_chat_template_writes_is_not_doubled_where_the_tokenizer_adds_one(tmp_path):
    # llama.cpp drops the template's: the model saw two BOS tokens (a Llama-3 style GGUF)
    model = write_tiny_llama_gguf(tmp_path / "bos.gguf", chat_template="{{ bos_token }}{% for m in messages %}"
                                  "{{ m['content'] }}{% endfor %}")
    parser, tokenizer = run.build_parser(), Tokenizer.from_gguf(model)
    text, chat = run._prompt_text(parser, parser.parse_args(["hi"]), model, tokenizer, print)
    assert chat and text == "hi" and tokenizer.encode(text).count(tokenizer.bos_id) == 1


def test_a_chat_template_given_on_the_command_line_replaces_the_model_s(tmp_path, capsys):
    """llama-cli's and llama-server's --chat-template / --chat-template-file were unrecognized."""
    model, tokenizer = Path(smollm2_path()), Tokenizer.from_gguf(smollm2_path())
    source = "{% for m in messages %}<{{ m['role'] }}:{{ m['content'] }}>{% endfor %}"
    (tmp_path / "t.jinja").write_text(source, encoding="utf-8")
    (empty := tmp_path / "empty.jinja").write_text(" \n", encoding="utf-8")
    for command in (run, api):
        parser = command.build_parser()
        for flags in (["--chat-template", source], ["--chat-template-file", str(tmp_path / "t.jinja")]):
            args = parser.parse_args([*flags] if command is api else [*flags, "hi"])
            template = load_chat_template(parser, args, model, tokenizer)
            assert template.render([{"role": "user", "content": "hi"}]) == "<user:hi>"
    parser = run.build_parser()
    assert run._prompt_text(parser, parser.parse_args(["--chat-template", source, "hi"]), model, tokenizer,
                            print)[0] == "<user:hi>"
    for flags, said in ((["--chat-template", "chatml"], "is no Jinja template"),
                        (["--chat-template-file", str(tmp_path / "none.jinja")], "none.jinja"),
                        (["--chat-template", source, "--chat-template-file", str(tmp_path / "t.jinja")],
                         "not allowed with argument"),
                        (["--chat-template", "{% if %}"],
                         "--chat-template/--chat-template-file: the chat template does not compile"),
                        (["--chat-template-file", str(empty)], "empty.jinja: the file holds no template"),
                        (["--chat-template-file", "/dev/zero"], "/dev/zero: longer than 1 MiB"),  # read on for ever
                        (["--raw", "--chat-template", source], "--raw")):
        with pytest.raises(SystemExit) as exc:
            args = parser.parse_args([*flags, "hi"])
            run._prompt_text(parser, args, model, tokenizer, print) if not args.raw else run._check_args(parser, args)
        assert exc.value.code == 2 and said in capsys.readouterr().err, flags


def test_a_temperature_at_or_below_zero_is_greedy_as_in_llama_cli():
    # --temp -1 was refused ("must be between 0 and 1e+06")
    for temp in ("-1", "-0.5", "0"):
        assert run.sampling_params(run.build_parser().parse_args(["--temp", temp])).wire() is None, temp
    assert run.sampling_params(run.build_parser().parse_args(["--temp", "0.7"])).wire().temperature == \
        pytest.approx(0.7)


def test_llama_cli_s_completion_mode_is_raw_and_its_chat_turn_run_s_own():
    # -no-cnv was taken and ignored: the prompt still went through the chat template
    parser = run.build_parser()
    assert parser.parse_args(["-no-cnv"]).raw and parser.parse_args(["--no-conversation"]).raw
    for flags in (["-cnv"], ["-st"], ["--conversation", "--single-turn"], []):
        assert not parser.parse_args(flags).raw


def test_started_stages_poll_by_default_only_with_a_cpu_each():
    cpus = len(os.sched_getaffinity(0))
    assert poll_args(None, cpus) == ["--poll-ms", repr(AUTO_STAGE_POLL_MS)]
    assert poll_args(None, cpus + 1) == []
    assert poll_args(0.0, 1) == [] and poll_args(2.0, cpus + 1) == ["--poll-ms", "2.0"]
    assert driver_poll_s(None) == 0.0 and driver_poll_s(3.0) == 0.003
    # "auto", the documented default, may be written out where stages are started; serve has none
    for command in (run, api):
        parser = command.build_parser()
        assert parser.parse_args(["--poll-ms", "auto"]).poll_ms is None
        assert parser.parse_args(["--poll-ms", "2.5"]).poll_ms == 2.5
    with pytest.raises(SystemExit):
        serve.build_parser().parse_args(["--poll-ms", "auto"])


@pytest.mark.parametrize("args,message", [
    (["serve", "--model", "m.gguf", "--layer-start", "0", "--layer-end", "1", "--listen", "[::1]:0"],
     "argument --listen: IPv6 addresses are not supported: '[::1]:0' (use an IPv4 address or a host name)"),
    (["run", "--connect", "::1:9000"],
     "argument --connect: IPv6 addresses are not supported: '::1:9000' (use an IPv4 address or a host name)"),
    *[([*command, "--tls-cert", "BAD", "--tls-key", "BAD", "--tls-ca", "BAD"], "--tls-cert BAD: not a PEM certificate")
      for command in (["run", "--model", "/nonexistent.gguf", "--connect", "127.0.0.1:1", "hi"],
                      ["serve", "--model", "/nonexistent.gguf", "--layer-start", "0", "--layer-end", "1"],
                      ["api", "--model", "/nonexistent.gguf"])],
])
def test_ipv6_and_tls_files_that_do_not_load_are_usage_errors(capsys, tmp_path, args, message):
    """Refused with the options: IPv6 (was "cannot listen on ::1:0: unknown error -9") and a
    --tls-cert without a certificate (was a handshake failure or serve's bare "TLS: PEM lib")."""
    bad = tmp_path / "bad.pem"
    bad.write_text("not a certificate\n")
    assert_usage_error(capsys, [str(bad) if a == "BAD" else a for a in args], message.replace("BAD", str(bad)))


@pytest.mark.parametrize("command", [["run", "hi"], ["api"]])
def test_connect_to_port_0_is_a_usage_error(capsys, command):
    """Port 0 names no running stage: it was status 1 after the model had loaded ("port must
    be a TCP port from 1 to 65535, got 0"), where `serve --downstream` refuses it at once."""
    assert_usage_error(capsys, [command[0], "--connect", "127.0.0.1:0", *command[1:]],
                       "argument --connect: port 0 names no stage (give the port the stage listens on)")


_STOPS = {"interrupted": (KeyboardInterrupt(), EXIT_INTERRUPTED, "interrupted after 1 rows"),
          "failed": (PipelineError("gone"), 1, "error: gone"),
          # an OSError (a run's --log-dir that cannot be made) lost the rows: a traceback-free error line alone
          "os error": (FileExistsError(17, "File exists", "logs/2hosts-5mbit"), 1, "logs/2hosts-5mbit: file exists")}


@pytest.mark.parametrize("stop", list(_STOPS))
def test_bench_cluster_stopped_prints_the_rows_measured_and_exits_130_or_1(capsys, monkeypatch, tiny_model, stop):
    failure, status, said = _STOPS[stop]

    def run_cluster(opts, tokenizer):  # Ctrl-C in, or a failure of, the second run (it was: exit status 0)
        if opts.rate != "unlimited":
            raise failure
        result = SimpleNamespace(prefill_tok_s=1.0, decode_tok_s=2.0, tokens=[1, 2])
        return SimpleNamespace(options=opts, link_bits=None, prompt=[1], bytes_per_token_per_hop=0, result=result)

    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster_bench, "run_cluster", run_cluster)
    reference = SimpleNamespace(prefill_tok_s=4.0, decode_tok_s=8.0, tokens=[1, 2])  # one in-process stage
    monkeypatch.setattr(cluster_bench, "local_reference", lambda res, tokenizer: reference)
    code, out, err = _main(capsys, "bench-cluster", "--hosts", "2", "--rates", "unlimited,5mbit", "--delays", "0",
                           "--codecs", "raw-f32", "--model", str(tiny_model), "--quiet")
    assert code == status, err
    assert said in err, err
    # the rates, then their ratios to the same run's one in-process stage
    assert "| 2 | unlimited | 0 | raw-f32 | - | 1 | 2 | 0.25 | 0.25 | 0 | yes |" in out and "5mbit" not in out
    assert "prefill 4.0 tok/s, decode 8.0 tok/s" in out
    # --json -: the rows as JSON on stdout, nothing else there (it wrote a file named "-")
    code, out, err = _main(capsys, "bench-cluster", "--hosts", "2", "--rates", "unlimited,5mbit", "--delays", "0",
                           "--codecs", "raw-f32", "--model", str(tiny_model), "--quiet", "--json", "-")
    rows = json.loads(out)
    assert code == status and [(row["link"], row["decode / 1 stage"]) for row in rows] == [("unlimited", 0.25)]
    # each row with what the table says once: the CPU and the reference (they were in the text alone)
    assert (rows[0]["cpu"], rows[0]["1 stage prefill tok/s"], rows[0]["1 stage decode tok/s"]) == \
        (cpu_text(), 4.0, 8.0)
    assert "| 2 | unlimited | 0 | raw-f32 |" in err and not Path("-").exists()


def test_cluster_options_that_would_shape_or_measure_nothing_are_usage_errors(capsys):
    """--hosts 1 printed "links 2mbit, delay 50 ms" with no link shaped; --rates ran
    "100mbit,0.1gbit" twice; --measure-seconds 1e-9 failed after the namespaces were made."""
    assert_usage_error(capsys, ["cluster", "--hosts", "1", "--rate", "2mbit"],
                       "--rate and --delay-ms shape the links between hosts: --hosts 1 has none")
    assert_usage_error(capsys, ["cluster", "--hosts", "1", "--delay-ms", "50"],
                       "--rate and --delay-ms shape the links between hosts: --hosts 1 has none")
    assert_usage_error(capsys, ["bench-cluster", "--rates", "unlimited,100mbit,0.1gbit"],
                       "argument --rates: lists '100mbit' and '0.1gbit', the same value; each value once")
    assert_usage_error(capsys, ["cluster", "--measure-seconds", "1e-9"],
                       "argument --measure-seconds: must be 0 (no measurement) or at least 0.05, got 1e-9")


def test_cluster_quiet_answers_to_llama_cpp_s_log_disable_as_run_s_does():
    """The docs say cluster's --quiet is "as for run"; --log-disable was an unrecognized argument."""
    for build in (cluster.build_parser, cluster_bench.build_parser):
        assert build().parse_args(["--log-disable"]).quiet is True


def test_bench_cluster_runs_one_host_once_a_codec(capsys, monkeypatch, tiny_model):
    """Each rate and delay gave one host the same row, labelled as if shaped."""
    runs = []

    def run_cluster(opts, tokenizer):
        runs.append((opts.hosts, opts.rate, opts.delay_ms))
        result = SimpleNamespace(prefill_tok_s=1.0, decode_tok_s=2.0, tokens=[1, 2])
        return SimpleNamespace(options=opts, link_bits=None, prompt=[1], bytes_per_token_per_hop=0, result=result)

    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster_bench, "run_cluster", run_cluster)
    monkeypatch.setattr(cluster_bench, "local_reference", lambda res, tokenizer: SimpleNamespace(
        prefill_tok_s=4.0, decode_tok_s=8.0, tokens=[1, 2]))
    code, out, err = _main(capsys, "bench-cluster", "--hosts", "1,2", "--rates", "unlimited,5mbit", "--delays", "0,5",
                           "--codecs", "raw-f32", "--model", str(tiny_model), "--quiet")
    assert code == 0, err
    assert runs == [(1, "unlimited", 0.0), (2, "unlimited", 0.0), (2, "unlimited", 5.0), (2, "5mbit", 0.0),
                    (2, "5mbit", 5.0)]


def test_bench_cluster_shows_no_rate_where_nothing_was_timed(capsys, monkeypatch, tiny_model):
    """-n 1 decodes nothing: its decode rates read "0", as if measured."""
    result = SimpleNamespace(prefill_tok_s=1.0, decode_tok_s=0.0, tokens=[1])
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster_bench, "run_cluster", lambda opts, tokenizer: SimpleNamespace(
        options=opts, link_bits=None, prompt=[1], bytes_per_token_per_hop=0, result=result))
    monkeypatch.setattr(cluster_bench, "local_reference", lambda res, tokenizer: SimpleNamespace(
        prefill_tok_s=4.0, decode_tok_s=0.0, tokens=[1]))
    code, out, err = _main(capsys, "bench-cluster", "--hosts", "2", "--rates", "unlimited", "--delays", "0",
                           "--codecs", "raw-f32", "--model", str(tiny_model), "--quiet", "-n", "1", "--json", "-")
    rows = json.loads(out)
    assert code == 0 and (rows[0]["decode tok/s"], rows[0]["decode / 1 stage"], rows[0]["1 stage decode tok/s"]) \
        == (None, None, None), rows
    assert "| 2 | unlimited | 0 | raw-f32 | - | 1 | - | 0.25 | - |" in err and "prefill 4.0 tok/s\n" in err, err


def fake_cluster_runs(monkeypatch, record) -> None:
    """bench-cluster's runs as instant fakes (no namespaces), ``record(options)`` called for each;
    the first run's rates stand for the in-process reference."""
    def run_cluster(opts, tokenizer):
        record(opts)
        result = SimpleNamespace(prefill_tok_s=1.0, decode_tok_s=2.0, tokens=[1, 2])
        return SimpleNamespace(options=opts, link_bits=None, prompt=[1], bytes_per_token_per_hop=0, result=result)

    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(cluster_bench, "run_cluster", run_cluster)
    monkeypatch.setattr(cluster_bench, "local_reference", lambda res, tokenizer: res.result)


def test_bench_cluster_keeps_each_run_s_logs_apart(capsys, monkeypatch, tiny_model, tmp_path):
    # every run wrote DIR/stageK.log and DIR/topology.json: the last run's alone were left
    dirs = []
    fake_cluster_runs(monkeypatch, lambda opts: dirs.append(opts.log_dir))
    code, _, err = _main(capsys, "bench-cluster", "--hosts", "2,3", "--rates", "unlimited,5mbit", "--delays", "0",
                         "--codecs", "bf16", "--model", str(tiny_model), "--quiet", "--log-dir", str(tmp_path))
    assert code == 0, err
    assert dirs == [str(tmp_path / f"{hosts}hosts-{rate}-0ms-bf16") for hosts in (2, 3)
                    for rate in ("unlimited", "5mbit")]


def test_the_capture_hint_names_a_file_that_was_written(tmp_path):
    # With one stage, --connect or --topology only the driver's hop0 is written; the hint
    # named hop1 whatever was there.
    from skippy_wire.tools.run import capture_hint

    (tmp_path / "hop0-messages.bin").write_bytes(b"")
    assert capture_hint(tmp_path).endswith(f"inspect {tmp_path}/hop0-messages.bin`)")
    (tmp_path / "hop1-messages.bin").write_bytes(b"")
    assert capture_hint(tmp_path).endswith(f"inspect {tmp_path}/hop1-messages.bin`)")
    # a folder name's byte that is not UTF-8 as given (it was Python's surrogate, \udcff)
    odd = tmp_path / os.fsdecode(b"cap\xff")
    assert capture_hint(odd) == f"  captures in {tmp_path}/cap\\xff/ (inspect with `skippy-wire inspect " \
                                f"{tmp_path}/cap\\xff/hop0-messages.bin`)"


def test_serve_started_with_stdin_closed_exits_as_at_stdin_eof(tiny_model):
    """``--exit-on-stdin-eof`` with stdin closed (``<&-``): Python has no sys.stdin, and the
    stage died with an AttributeError traceback; a closed stdin is one at its end."""
    done = subprocess.run([sys.executable, "-m", "skippy_wire", "serve", "-m", str(tiny_model), "--layer-start", "0",
                           "--layer-end", "4", "--stage-index", "0", "--listen", "127.0.0.1:0", "--exit-on-stdin-eof"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, timeout=60,
                          preexec_fn=lambda: os.close(0))
    assert done.returncode == 0 and "stdin closed: the parent is gone, exiting" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


@pytest.mark.parametrize("content, problem", [(b"", "the file is empty"), (b"\xff\xfe\n", "text is not valid UTF-8"),
                                              (b"\n  \n# a comment\n",
                                               "it holds no key (one a line; '#' starts a comment)"),
                                              (b"key\n" + b"k" * 5000, "line 2 is over 4096 characters"),
                                              (b"k\n" * 4097, "more than 4096 lines")])
def test_an_api_key_file_that_holds_no_key_is_named(capsys, tmp_path, content, problem):
    # the file went unnamed ("--api-key-file: text is not valid UTF-8", "the API key is empty"),
    # and it was read whole (a key file named /dev/zero filled the memory)
    key = tmp_path / "key"
    key.write_bytes(content)
    assert_usage_error(capsys, ["api", "--api-key-file", str(key)], f"argument --api-key-file: {key}: {problem}")


def test_api_keys_are_read_as_llama_server_reads_them(tmp_path):
    # a key file gave its first line alone (a comment there became the key), and a second
    # --api-key replaced the first; llama-server takes every line but comments, and every key
    from skippy_wire.tools.api import _check_args, build_parser

    key = tmp_path / "key"
    for content, keys in (("# the team's keys\nalpha\n\n  beta  \r\n#gamma\n", ["alpha", "beta"]),
                          ("\ufeff# saved with a byte order mark\n  # indented\nalpha\n", ["alpha"]),
                          ("\ufeffalpha\n", ["alpha"]), ("k" * 4096, ["k" * 4096])):
        key.write_text(content)
        parser = build_parser()
        args = parser.parse_args(["--api-key-file", str(key)])
        _check_args(parser, args)
        assert args.api_keys == keys
    parser = build_parser()
    args = parser.parse_args(["--api-key", "one", "--api-key", "two, three,", "--api-key-file", str(key)])
    _check_args(parser, args)
    assert args.api_keys == ["one", "two", "three", "k" * 4096]


def test_bench_backend_refuses_a_kv_cache_outgrowing_the_memory_before_any_table(capsys, monkeypatch, tiny_model):
    # it started, then failed with the backend's "RuntimeError: cannot allocate the KV cache", naming no option
    from skippy_wire.net import supervision

    monkeypatch.setattr(supervision, "memory_available", lambda: 1 << 20)
    code, out, err = _main(capsys, "bench-backend", "-m", str(tiny_model), "-t", "1", "--prefill", "8",
                           "--decode", "100000", "--repeat", "1")
    assert code == 1 and out == "" and "usage:" not in err  # a runtime failure, as run's, api's and cluster's
    assert re.fullmatch(r"skippy-wire: error: .* MiB of memory available.*; give a smaller --prefill or --decode",
                        _one_error_line(err)), err


def test_cluster_refuses_a_context_outgrowing_the_memory_before_any_namespace(tmp_path, monkeypatch):
    """As run and api refuse it (launch_pipeline): the stages failed one by one after the
    namespaces were made, with a RuntimeError's words and no advice."""
    from skippy_wire.errors import ToolError
    from skippy_wire.net import supervision

    def no_namespaces(*_args):
        raise AssertionError("namespaces were made")

    monkeypatch.setattr(cluster, "NetnsChain", no_namespaces)
    monkeypatch.setattr(cluster, "netns_unavailable", lambda: None)
    monkeypatch.setattr(supervision, "memory_available", lambda: 64 << 20)
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    opts = cluster.ClusterOptions(model=str(model), ctx_size=1 << 24, measure_seconds=0)
    with pytest.raises(ToolError, match=r"^a context of 16777216 positions takes \d+ MiB of KV cache a session over "
                                        r"tiny\.gguf's layers, .*; give a smaller -c/--ctx-size$"):
        cluster.run_cluster(opts)
