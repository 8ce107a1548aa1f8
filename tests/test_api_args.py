"""``skippy-wire api``'s command line and ``/health``'s wait, in process (no stages, no
model loaded but a tiny one for ``--topology``)."""

from __future__ import annotations

import json
import threading
import time

import pytest
from starlette.testclient import TestClient

from skippy_wire.errors import PipelineError
from skippy_wire.net import supervision
from skippy_wire.stage.models import kv_cache_bytes, write_tiny_llama_gguf
from skippy_wire.tools import api as api_module
from skippy_wire.tools.api import STARTED_CTX_SIZE, Api, _check_args, build_parser, lanes_that_fit
from skippy_wire.wire.forwarding import DEFAULT_CTX_SIZE


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return write_tiny_llama_gguf(tmp_path_factory.mktemp("api-args") / "tiny.gguf")


def _topology(tmp_path, model, **top) -> str:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"model_path": str(model), **top, "stages": [
        {"endpoint": "127.0.0.1:19000", "layer_start": 0, "layer_end": 4}]}))
    return str(path)


def _ctx_size(argv: list[str]) -> int:
    return _parsed(argv).ctx_size


@pytest.mark.parametrize("argv, expected", [
    ([], STARTED_CTX_SIZE),  # the stages it starts get -c
    (["--stages", "3"], STARTED_CTX_SIZE),
    (["-c", "1024"], 1024),
    # running stages hold serve's default unless told: 2048 made requests past 512 fail at the stage
    (["--connect", "127.0.0.1:19000"], DEFAULT_CTX_SIZE),
    (["--connect", "127.0.0.1:19000", "-c", "256"], 256),
    (["--connect", "127.0.0.1:19000", "-c", "2048"], 2048),  # given, even when it is the old default
])
def test_ctx_size_follows_who_starts_the_stages(argv, expected):
    assert _ctx_size(argv) == expected


def _parsed(argv: list[str]):
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    return args


@pytest.mark.parametrize("argv, expected", [
    ([], ("127.0.0.1", 9337)),
    (["--listen", "0.0.0.0:8080"], ("0.0.0.0", 8080)),
    (["--port", "8080"], ("127.0.0.1", 8080)),  # llama-server's names, each replacing its half
    (["--host", "0.0.0.0"], ("0.0.0.0", 9337)),
    (["--host", "localhost", "--port", "0"], ("localhost", 0)),
    # an empty HOST (an unset "$HOST") as in --listen :PORT: this machine only, not every interface
    (["--host", "", "--port", "8080"], ("127.0.0.1", 8080)),
])
def test_the_address_as_listen_or_as_llama_server_s_host_and_port(argv, expected):
    assert _parsed(argv).listen_address == expected


@pytest.mark.parametrize("argv, expected", [
    (["--host", "::1"], ("::1", 9337)),  # refused: "IPv6 addresses are not supported: '::1:0'"
    (["--host", "::", "--port", "8080"], ("::", 8080)),
    (["--host", "[::1]"], ("::1", 9337)),
    (["--listen", "[::1]:8080"], ("::1", 8080)),  # as a URL writes it
    (["--listen", "[0:0::1]:0"], ("::1", 0)),
])
def test_the_api_listens_on_ipv6_as_llama_server_does(argv, expected):
    assert _parsed(argv).listen_address == expected


@pytest.mark.parametrize("argv, message", [
    (["--listen", "::1:8080"], "argument --listen: address must be HOST:PORT, an IPv6 HOST in brackets "
                               "([::1]:8080), not '::1:8080'"),
    (["--listen", "[::1]:70000"], "argument --listen: port 70000 is out of range (0-65535)"),
    (["--host", "a:b"], "argument --host: not a host name or an IPv4 or IPv6 address: 'a:b'"),
])
def test_an_ipv6_listen_address_that_does_not_read_is_a_usage_error(capsys, argv, message):
    with pytest.raises(SystemExit) as exit_:  # it failed only when bound, after the stages started
        _parsed(argv)
    assert exit_.value.code == 2 and message in capsys.readouterr().err


def test_llama_server_s_flags_for_what_the_api_does_anyway_start_it():
    """A llama-server command line (`--jinja --metrics ...`) was refused as unknown options."""
    args = _parsed(["--jinja", "--metrics", "--no-webui", "-cb", "--cont-batching", "-a", "smol"])
    assert args.llama_server_defaults and args.alias == "smol"
    assert _parsed(["--alias", "my model"]).alias == "my model" and _parsed([]).alias is None


@pytest.mark.parametrize("option, says", [
    ("--slots", "--slots is not supported: the stages keep no slots to list, save or restore (/slots answers 501)"),
    ("--embeddings", "--embeddings is not supported: the stages compute next tokens only (/v1/embeddings answers "
                     "501)"),
    ("--rerank", "--rerank is not supported: the stages compute next tokens only (/v1/rerank answers 501)")])
def test_llama_server_s_flags_for_what_the_api_does_not_serve_say_so(capsys, option, says):
    # --slots was "unrecognized arguments", as a typo would be
    with pytest.raises(SystemExit) as exit_:
        _parsed(["--metrics", option])
    assert exit_.value.code == 2 and capsys.readouterr().err.endswith(f"skippy-wire: error: {says}\n")


@pytest.mark.parametrize("argv, expected", [([], -1), (["-n", "16"], 16), (["--n-predict", "-2"], -1),
                                             (["--predict", "-1"], -1)])
def test_llama_server_s_n_is_the_most_tokens_a_request_generates(argv, expected):
    assert _parsed(argv).max_tokens == expected


@pytest.mark.parametrize("alias", ["", "  ", "a\nb"])
def test_a_blank_or_unprintable_alias_is_a_usage_error(capsys, alias):
    with pytest.raises(SystemExit) as exit_:
        _parsed(["--alias", alias])
    assert exit_.value.code == 2 and "argument -a/--alias: a model alias is printable text" in capsys.readouterr().err


def test_listen_with_host_or_port_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as exit_:
        _parsed(["--listen", "127.0.0.1:9000", "--port", "8080"])
    assert exit_.value.code == 2
    assert "give the address once: --listen HOST:PORT, or llama-server's --host and --port" in capsys.readouterr().err


def test_llama_server_s_parallel_is_max_inflight():
    assert _parsed(["-np", "2"]).max_inflight == 2 and _parsed(["--parallel", "3"]).max_inflight == 3


@pytest.mark.parametrize("top, given, expected", [
    ({"ctx_size": 1024}, [], 1024),
    ({}, [], DEFAULT_CTX_SIZE),  # a file without ctx_size: its stages hold serve's default
    ({"ctx_size": 1024}, ["-c", "256"], 256),
    ({"ctx_size": 4096}, ["-c", str(STARTED_CTX_SIZE)], STARTED_CTX_SIZE),
])
def test_a_topology_gives_its_ctx_size_unless_c_asks_for_less(tmp_path, tiny_model, top, given, expected):
    assert _ctx_size(["--topology", _topology(tmp_path, tiny_model, **top), *given]) == expected


def test_c_over_a_topology_default_ctx_size_is_a_usage_error(tmp_path, tiny_model, capsys):
    with pytest.raises(SystemExit) as stopped:
        _ctx_size(["--topology", _topology(tmp_path, tiny_model), "-c", "1024"])
    assert stopped.value.code == 2
    assert capsys.readouterr().err.splitlines()[-1].endswith(
        f"--ctx-size 1024 is more than the {DEFAULT_CTX_SIZE} tokens of {tmp_path / 't.json'}'s stages")


def test_the_api_starts_no_more_lanes_than_sessions_fit_in_memory(tiny_model, monkeypatch):
    """Four lanes of sessions whose KV caches together outgrow the memory available: each
    request past those that fit failed (502) on the stage that ran out; now they queue."""
    cache = kv_cache_bytes(tiny_model, 1024)
    left = [2 * cache + cache // 2]  # what the started stages left (their weights taken)
    monkeypatch.setattr(supervision, "memory_available", lambda: left[0])
    said: list[str] = []
    assert lanes_that_fit(tiny_model, 1024, 4, said.append) == 2
    assert said == ["warning: --max-inflight 4: the memory left holds the KV caches of 2 session(s) of -c 1024; "
                    "2 generate at once, the others queue"]
    assert lanes_that_fit(tiny_model, 1024, 2, said.append) == 2 and len(said) == 1  # they fit: nothing said
    left[0] = cache // 2  # less than one: one lane, its stage refusing what does not fit
    assert lanes_that_fit(tiny_model, 1024, 4, said.append) == 1
    assert said[-1] == ("warning: --max-inflight 4: the memory left holds the KV caches of 0 session(s) of -c 1024; "
                        "1 generate at once, the others queue")
    monkeypatch.setattr(supervision, "memory_available", lambda: None)  # not known: as asked
    assert lanes_that_fit(tiny_model, 1024, 4, said.append) == 4 and len(said) == 2


def test_help_names_each_ctx_size_default():
    text = " ".join(build_parser().format_help().split())
    assert (f"default: {STARTED_CTX_SIZE} starting stages, the stages' {DEFAULT_CTX_SIZE} with --connect; "
            f"--topology: its ctx_size, else {DEFAULT_CTX_SIZE})") in text


def _refused(argv: list[str], capsys) -> str:
    """The one error line of ``api ARGV``'s argument checks, which must exit 2."""
    with pytest.raises(SystemExit) as stopped:
        _ctx_size(argv)
    assert stopped.value.code == 2
    return capsys.readouterr().err.splitlines()[-1]


@pytest.mark.parametrize("given, name", [
    (["-t", "4"], "-t/--threads"), (["--threads", "-1"], "-t/--threads"),  # -1: the default, given
    (["--activation-codec", "bf16"], "--activation-codec"), (["--activation-codec", "raw-f32"], "--activation-codec"),
    (["--activation-codec-policy", "fixed"], "--activation-codec-policy"), (["--log-dir", "LOGS"], "--log-dir"),
])
def test_options_for_the_stages_it_starts_are_refused_with_running_stages(tmp_path, tiny_model, capsys, given, name):
    """`api --connect ... --activation-codec bf16 -t 4 --log-dir X` served and ignored them."""
    given = [str(tmp_path / "logs") if value == "LOGS" else value for value in given]
    for where in (["--connect", "127.0.0.1:19000"], ["--topology", _topology(tmp_path, tiny_model)]):
        assert _refused([*where, *given], capsys) == (
            f"skippy-wire: error: argument {name}: not allowed with argument {where[0]}: it configures the stage "
            f"processes this command starts, and with {where[0]} it starts none")
    assert not (tmp_path / "logs").exists()
    parser = build_parser()
    args = parser.parse_args(given)  # starting the stages: taken
    _check_args(parser, args)


def test_the_driver_s_own_options_are_taken_with_running_stages(tiny_model):
    """-m (the tokenizer, the model id), -c, --timeout, --poll-ms, --protocol, --chunk-size and
    --max-inflight are the driver's: not refused."""
    parser = build_parser()
    args = parser.parse_args(["--connect", "127.0.0.1:19000", "-m", str(tiny_model), "-c", "256", "--timeout", "5",
                              "--poll-ms", "1", "--protocol", "16", "--chunk-size", "8", "--max-inflight", "2"])
    _check_args(parser, args)
    assert (args.model, args.ctx_size, args.timeout, args.poll_ms, args.protocol) == (str(tiny_model), 256, 5, 1, 16)


class _SlowProbe:
    """An engine whose readiness probe takes ``delay`` s, then fails with ``reason`` (or,
    without one, waits until ``release`` is set)."""

    def __init__(self, delay: float, reason: str | None) -> None:
        self.delay, self.reason, self.release = delay, reason, threading.Event()

    def check_ready(self) -> None:
        time.sleep(self.delay)
        if self.reason is None:
            self.release.wait(30)
        raise PipelineError(self.reason or "released")

    def close(self) -> None:
        self.release.set()


def _health(engine, monkeypatch, ready_timeout: float, **patch) -> dict:
    monkeypatch.setattr(api_module, "READY_TIMEOUT_S", ready_timeout)
    for name, value in patch.items():
        monkeypatch.setattr(api_module, name, value)
    api = Api(engine, model_id="m", chat_template=None, max_inflight=1)
    try:
        with TestClient(api.app()) as client:
            r = client.get("/health")
        assert r.status_code == 503
        assert r.headers["Retry-After"] == "1"  # as every other 503 of the API (docs/pipeline.md)
        return r.json()
    finally:
        api.close()


def test_health_reports_the_probe_s_own_reason_when_it_fails_at_its_timeout(monkeypatch):
    """A probe fails a little after its own timeout (the time to raise and report): /health
    waited exactly that timeout, so it said only "did not answer" instead of the reason."""
    reason = "stage 1 at 127.0.0.1:19001 did not reply within 0.2 s"
    engine = _SlowProbe(0.2 + 0.05, reason)  # past READY_TIMEOUT_S, well inside the margin
    assert _health(engine, monkeypatch, 0.2) == {"status": "unavailable", "error": {
        "code": 503, "message": reason, "type": "unavailable_error"}}  # llama-server's error object


def test_health_still_answers_when_the_probe_outlasts_its_margin(monkeypatch):
    engine = _SlowProbe(0, None)  # never answers until released
    assert _health(engine, monkeypatch, 0.1, HEALTH_MARGIN_S=0.1) == {
        "status": "unavailable", "error": {"code": 503, "message": "the pipeline did not answer within 0.2 s",
                                           "type": "unavailable_error"}}
