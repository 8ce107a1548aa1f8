"""``skippy-wire api`` against real stage processes on 127.0.0.1, with the official
``openai`` client for the happy paths and plain HTTP for the error paths.

Each server is a ``skippy-wire api --listen 127.0.0.1:0`` child (two stage processes
of SmolLM2 beneath it); every wait is bounded and the children are always terminated.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from process_helpers import default_sigint, thread_slices

from skippy_wire.net.driver import PipelineClient
from skippy_wire.net.schedule import prefill_messages
from skippy_wire.net.supervision import default_model, launch_pipeline
from skippy_wire.net.wakeup_slice import SHORT_SLICE_NS
from skippy_wire.stage.models import Tokenizer, write_tiny_llama_gguf
from skippy_wire.wire.messages import StageWireMessage

pytestmark = pytest.mark.slow

STARTUP_S = 120
PROMPT = "Once upon a time, in a small village by the sea, there lived"
CHAT = [{"role": "user", "content": "Name three colours."}]


def _ignore_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # as a shell's background job starts


class ApiServer:
    def __init__(self, *args: str, sigint: bool = True, listen: str = "127.0.0.1:0") -> None:
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.stop_signal = signal.SIGINT if sigint else signal.SIGTERM
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "skippy_wire", "api", "--listen", listen, "--ctx-size", "512", *args],
            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env, start_new_session=True,
            preexec_fn=default_sigint if sigint else _ignore_sigint)
        self.log: list[str] = []
        deadline = time.monotonic() + STARTUP_S
        while time.monotonic() < deadline:
            line = self.proc.stderr.readline()
            if not line:
                break
            self.log.append(line)
            m = re.search(r"API on (http://(?:[\d.]+|\[[0-9a-f:]+\]):(\d+))/v1", line)
            if m:
                self.url, self.port = m.group(1), int(m.group(2))
                break
        if not hasattr(self, "url"):
            self.close()
            raise AssertionError("api did not start:\n" + "".join(self.log))
        self.client = openai.OpenAI(base_url=self.url + "/v1", api_key="none", timeout=60, max_retries=0)

    def close(self) -> str:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, self.stop_signal)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        rest = self.proc.stderr.read()
        self.proc.stderr.close()
        if hasattr(self, "client"):
            self.client.close()
        return "".join(self.log) + rest


@pytest.fixture(scope="module")
def api():
    server = ApiServer("--max-inflight", "4", "--max-queue", "16")
    try:
        yield server
    finally:
        log = server.close()
        assert "Traceback" not in log, log


def _complete(api, **kw):
    return api.client.completions.create(model="any", prompt=kw.pop("prompt", PROMPT), **kw)


def test_models_lists_the_model(api):
    models = api.client.models.list()
    assert [m.id for m in models.data] == ["SmolLM2-135M-Instruct.Q4_1"]


def test_the_api_serves_on_ipv6_and_says_where_as_a_url():
    """`--host ::1` was refused ("IPv6 addresses are not supported").  (`::`, every interface,
    is tested without listening: tests/test_http_front.py.)"""
    server = ApiServer("--stages", "1", listen="[::1]:0")
    try:
        assert server.url == f"http://[::1]:{server.port}"
        assert httpx.get(f"http://[::1]:{server.port}/health", timeout=30).status_code == 200
    finally:
        log = server.close()
    assert "warning: listening" not in log, log  # loopback


def test_a_llama_server_command_line_names_the_model_by_its_alias():
    """`-a NAME`, `-n N` and the flags for what the API does anyway (`--jinja --metrics ...`)
    were unknown options; the alias is the model id every answer carries."""
    server = ApiServer("--stages", "1", "-a", "smol", "-n", "3", "--jinja", "--metrics", "--no-webui",
                       "-cb")
    try:
        ids = [m.id for m in server.client.models.list().data]
        # no max_tokens asked: -n's 3
        answer = server.client.completions.create(model="smol", prompt=PROMPT, extra_body={"ignore_eos": True})
        named = httpx.get(server.url + "/v1/models/smol", timeout=10).status_code
    finally:
        log = server.close()
    assert ids == ["smol"] and answer.model == "smol" and named == 200, log
    assert answer.usage.completion_tokens == 3 and answer.choices[0].finish_reason == "length", answer
    assert "(model smol, " in log, log


def test_log_disable_writes_nothing_while_the_api_serves_and_stops():
    """llama-server's `--log-disable` was an unknown option: the API writes no progress line, no
    request's failure and no uvicorn warning for a malformed request; Ctrl-C still stops it."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-m", "skippy_wire", "api", "--listen", f"127.0.0.1:{port}",
                             "--ctx-size", "512", "--stages", "1", "--log-disable"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True,
                            preexec_fn=default_sigint)
    try:
        deadline = time.monotonic() + STARTUP_S
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=5).status_code == 200:
                    break
            except httpx.TransportError:
                time.sleep(0.2)
        answer = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                            json={"prompt": PROMPT, "max_tokens": 2})
        assert answer.status_code == 200, answer.text
        with socket.create_connection(("127.0.0.1", port), timeout=10) as bad:  # uvicorn warns of it
            bad.sendall(b"NOT HTTP\r\n\r\n")
            bad.recv(4096)
    finally:
        os.killpg(proc.pid, signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        log = proc.stderr.read()
        proc.stderr.close()
    assert proc.returncode == 130 and log == "", (proc.returncode, log)


def _stat_fields(path: str) -> list[str]:
    """The fields of a /proc stat file after the command name (field 3 first)."""
    with open(path, encoding="ascii") as fh:
        return fh.read().rsplit(")", 1)[1].split()


def _policies(pid: int) -> dict[int, int]:
    """Scheduling policy (field 41 of /proc/PID/task/TID/stat) of each thread of ``pid``."""
    return {int(tid): int(_stat_fields(f"/proc/{pid}/task/{tid}/stat")[38]) for tid in os.listdir(f"/proc/{pid}/task")}


def test_the_front_end_and_drivers_yield_to_the_stages_they_started(api):
    """The API process's HTTP loop (its main thread) and the generation workers it starts run
    SCHED_BATCH, so a token's arrival never preempts a stage mid-hop; its stage processes
    keep the normal policy."""
    api.client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
    policies = _policies(api.proc.pid)
    assert policies.pop(api.proc.pid) == os.SCHED_BATCH
    assert os.SCHED_BATCH in policies.values()  # the worker that drove the completion
    stages = _children(api.proc.pid)
    assert len(stages) == 2
    # the policy the API process started with (this test's own), not SCHED_BATCH
    assert {policy for pid in stages for policy in _policies(pid).values()} == {os.sched_getscheduler(0)}


def test_every_thread_of_the_api_and_its_stages_asks_for_a_short_slice(api):
    """So that a woken connection thread is not kept waiting behind a step's compute."""
    assert thread_slices(os.getpid()) != {SHORT_SLICE_NS}  # this process did not ask
    api.client.completions.create(model="m", prompt=PROMPT, max_tokens=2, temperature=0)
    for pid in [api.proc.pid, *_children(api.proc.pid)]:
        assert thread_slices(pid) == {SHORT_SLICE_NS}, pid


def test_chat_completion_uses_the_chat_template(api):
    reply = api.client.chat.completions.create(model="any", messages=CHAT, max_tokens=24, temperature=0)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content.strip()
    assert choice.finish_reason in ("stop", "length")
    # The template adds the SmolLM system turn and the assistant header around the user turn.
    assert reply.usage.prompt_tokens > 25
    assert reply.usage.total_tokens == reply.usage.prompt_tokens + reply.usage.completion_tokens


def test_max_tokens_ends_with_length(api):
    reply = _complete(api, max_tokens=5, temperature=0)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.completion_tokens == 5


def test_streaming_chunks_add_up_to_the_whole(api):
    whole = _complete(api, max_tokens=16, temperature=0).choices[0].text
    chunks = list(_complete(api, max_tokens=16, temperature=0, stream=True))
    pieces = [c.choices[0].text for c in chunks]
    assert len([p for p in pieces if p]) >= 8  # token by token, not one lump
    assert "".join(pieces) == whole
    assert chunks[-1].choices[0].finish_reason == "length"
    assert all(c.choices[0].finish_reason is None for c in chunks[:-1])


def test_chat_streaming_has_role_then_content_then_usage(api):
    chunks = list(api.client.chat.completions.create(model="any", messages=CHAT, max_tokens=12, temperature=0,
                                                      stream=True, stream_options={"include_usage": True}))
    *content, last = chunks
    assert content[0].choices[0].delta.role == "assistant"
    whole = api.client.chat.completions.create(model="any", messages=CHAT, max_tokens=12, temperature=0)
    assert "".join(c.choices[0].delta.content or "" for c in content) == whole.choices[0].message.content
    # The usage chunk comes last, with no choices, and counts what the whole reply counts.
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None for c in content)


def test_seeded_sampling_repeats_and_differs_from_greedy(api):
    kw = dict(max_tokens=24, temperature=1.2, top_k=40, top_p=0.95, seed=1234)
    first = _complete(api, extra_body={"top_k": 40}, **{k: v for k, v in kw.items() if k != "top_k"})
    again = _complete(api, extra_body={"top_k": 40}, **{k: v for k, v in kw.items() if k != "top_k"})
    assert first.choices[0].text == again.choices[0].text
    greedy = _complete(api, max_tokens=24, temperature=0).choices[0].text
    others = {_complete(api, max_tokens=24, temperature=1.2, seed=s).choices[0].text for s in (1, 2, 3)}
    assert others != {greedy} and len(others | {first.choices[0].text}) > 1


def test_top_k_at_or_below_zero_is_off_and_logit_bias_reaches_the_sampler(api):
    kw = dict(max_tokens=8, temperature=1.0, seed=7)
    assert _complete(api, extra_body={"top_k": -1}, **kw).choices[0].text == \
        _complete(api, extra_body={"top_k": 0}, **kw).choices[0].text
    greedy = _complete(api, max_tokens=1, temperature=0)
    first = Tokenizer.from_gguf(default_model()).encode(greedy.choices[0].text)[0]
    banned = _complete(api, max_tokens=1, temperature=0, logit_bias={str(first): -100})
    assert banned.choices[0].text and banned.choices[0].text != greedy.choices[0].text
    # llama-server's text key: the token(s) the text encodes to (a 400 before)
    by_text = _complete(api, max_tokens=1, temperature=0, logit_bias={greedy.choices[0].text: -100})
    assert by_text.choices[0].text == banned.choices[0].text


def test_top_p_0_is_greedy_and_ignore_eos_runs_to_max_tokens(api):
    question = [{"role": "user", "content": "What is 2+2?"}]
    greedy = api.client.chat.completions.create(model="any", messages=question, max_tokens=48, temperature=0)
    assert greedy.choices[0].finish_reason == "stop"  # a short answer, then the end of the turn
    sampled = [api.client.chat.completions.create(model="any", messages=question, max_tokens=48, temperature=1.5,
                                                  seed=seed, top_p=0).choices[0].message.content for seed in (1, 2)]
    assert sampled == [greedy.choices[0].message.content] * 2
    n = greedy.usage.completion_tokens + 8
    endless = api.client.chat.completions.create(model="any", messages=question, max_tokens=n, temperature=0,
                                                 extra_body={"ignore_eos": True})
    assert endless.choices[0].finish_reason == "length" and endless.usage.completion_tokens == n
    assert endless.choices[0].message.content.startswith(greedy.choices[0].message.content)


def test_stop_string_cuts_the_text(api):
    whole = _complete(api, max_tokens=24, temperature=0).choices[0].text
    words = whole.split()
    assert len(words) >= 4, whole
    stop = " " + words[3]
    cut = _complete(api, max_tokens=24, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == whole[: whole.index(stop)]
    streamed = "".join(c.choices[0].text for c in _complete(api, max_tokens=24, temperature=0, stop=stop,
                                                             stream=True))
    assert streamed == cut.choices[0].text


def test_llama_servers_completion_route_tells_why_it_stopped(api):
    # llama-server's native /completion: the same text as /v1/completions, in its own shape
    whole = _complete(api, max_tokens=16, temperature=0)
    native = _post(api, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                        "return_tokens": True}).json()
    assert native["content"] == whole.choices[0].text and native["stop"] is True
    assert native["stop_type"] == "limit" and native["tokens_predicted"] == 16 == len(native["tokens"])
    assert native["tokens_evaluated"] == whole.usage.prompt_tokens == native["timings"]["prompt_n"]
    tokenizer = Tokenizer.from_gguf(default_model())
    assert tokenizer.decode(native["tokens"]) == native["content"]
    stop = " " + native["content"].split()[3]
    cut = _post(api, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0, "stop": [stop]}).json()
    assert (cut["stop_type"], cut["stopping_word"]) == ("word", stop)
    assert cut["content"] == native["content"][:native["content"].index(stop)]
    chat = _post(api, "/apply-template", {"messages": [{"role": "user", "content": "What is 2+2?"}]}).json()
    ended = _post(api, "/completion", {"prompt": chat["prompt"], "n_predict": 48, "temperature": 0,
                                       "return_tokens": True}).json()
    assert ended["stop_type"] == "eos" and ended["tokens_predicted"] < 48
    # the end-of-generation token was decoded too: llama-server counts it (n_decoded), as usage does
    assert ended["tokens_predicted"] == len(ended["tokens"]) + 1 == ended["timings"]["predicted_n"]
    streamed = httpx.post(api.url + "/completion", json={"prompt": PROMPT, "n_predict": 16, "temperature": 0,
                                                          "stream": True}, timeout=60)
    events = [json.loads(block[len("data: "):]) for block in streamed.text.split("\n\n") if block]
    assert "".join(e["content"] for e in events) == native["content"] and "[DONE]" not in streamed.text
    assert events[-1]["stop"] is True and events[-1]["tokens_predicted"] == 16
    # n_predict 0 evaluates the prompt and generates nothing (it was a 400); the session ends
    evaluated = _post(api, "/completion", {"prompt": PROMPT, "n_predict": 0}).json()
    assert (evaluated["content"], evaluated["tokens_predicted"], evaluated["stop_type"]) == ("", 0, "limit")
    assert evaluated["tokens_evaluated"] == native["tokens_evaluated"] and evaluated["timings"]["prompt_ms"] > 0
    again = _post(api, "/completion", {"prompt": PROMPT, "n_predict": 16, "temperature": 0}).json()
    assert again["content"] == native["content"]


def test_eight_concurrent_requests_match_their_solo_texts(api):
    prompts = [f"{PROMPT} {name}" for name in ("Anna", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana")]
    alone = [_complete(api, prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        together = list(pool.map(lambda p: _complete(api, prompt=p, max_tokens=12, temperature=0).choices[0].text,
                                 prompts))
    assert together == alone


def test_a_batch_of_prompts_gives_one_choice_each_as_they_give_alone(api):
    prompts = [f"{PROMPT} Anna", [1, 2, 3, 4], f"{PROMPT} Ben"]  # strings or token ids, as OpenAI takes
    alone = [_complete(api, prompt=p, max_tokens=8, temperature=0) for p in prompts]
    batch = _complete(api, prompt=prompts, max_tokens=8, temperature=0)
    assert [c.index for c in batch.choices] == [0, 1, 2]
    assert [c.text for c in batch.choices] == [a.choices[0].text for a in alone]
    assert batch.usage.prompt_tokens == sum(a.usage.prompt_tokens for a in alone)
    assert batch.usage.completion_tokens == sum(a.usage.completion_tokens for a in alone)
    texts = ["", "", ""]
    for chunk in _complete(api, prompt=prompts, max_tokens=8, temperature=0, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == [c.text for c in batch.choices]


def test_n_sampled_choices_repeat_with_their_seed(api):
    reply = _complete(api, max_tokens=12, temperature=1.0, seed=11, n=3)
    texts = [c.text for c in reply.choices]
    assert [c.index for c in reply.choices] == [0, 1, 2] and reply.usage.completion_tokens > 3
    assert len(set(texts)) > 1  # one seed, the next ones for the other choices: different samples
    assert texts[0] == _complete(api, max_tokens=12, temperature=1.0, seed=11).choices[0].text
    assert [c.text for c in _complete(api, max_tokens=12, temperature=1.0, seed=11, n=3).choices] == texts


def test_n_choices_near_the_last_seed_differ(api):
    # -2 is 4294967294: its choices sampled with 4294967295 and 0, which the backend draws alike
    texts = [c.text for c in _complete(api, max_tokens=12, temperature=1.0, seed=-2, n=3).choices]
    assert texts[1] != texts[2]
    assert texts[2] == _complete(api, max_tokens=12, temperature=1.0, seed=1).choices[0].text  # on from 1


def test_disconnect_mid_stream_frees_the_sessions(api):
    # Four lanes per stage: leave more streams than that mid-way; if their sessions were
    # not freed on every stage, the four concurrent requests after them would find no lane.
    for _ in range(5):
        with httpx.stream("POST", api.url + "/v1/completions", timeout=30,
                          json={"prompt": PROMPT, "max_tokens": 200, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        texts = list(pool.map(lambda i: _complete(api, max_tokens=4, temperature=0).choices[0].text, range(4)))
    assert len(set(texts)) == 1 and texts[0]
    metrics = httpx.get(api.url + "/metrics").text
    assert re.search(r"^skippy_requests_cancelled_total [1-9]", metrics, re.M), metrics
    # llama-server's names for the token counters, the same figures as ours
    for ours, theirs in (("skippy_prompt_tokens_total", "llamacpp:prompt_tokens_total"),
                         ("skippy_completion_tokens_total", "llamacpp:tokens_predicted_total")):
        counts = [re.search(rf"^{re.escape(name)} (\d+)$", metrics, re.M) for name in (ours, theirs)]
        assert counts[0] and counts[1] and int(counts[0][1]) == int(counts[1][1]) > 0, metrics


def _post(api, path, body, **kw):
    return httpx.post(api.url + path, timeout=30, **({"content": body} if isinstance(body, (str, bytes)) else
                                                    {"json": body}), **kw)


@pytest.mark.parametrize("path, body, param", [
    ("/v1/completions", "{not json", None),
    ("/v1/completions", {"prompt": PROMPT, "temperature": 5}, "temperature"),
    ("/v1/completions", {"prompt": PROMPT, "top_p": "high"}, "top_p"),
    ("/v1/completions", {"prompt": PROMPT, "max_tokens": 0}, "max_tokens"),
    ("/v1/completions", {"prompt": PROMPT, "n": 0}, "n"),
    ("/v1/completions", {"prompt": 42}, "prompt"),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ("/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]}, "messages[0].role"),
    ("/v1/chat/completions", {"messages": "hi"}, "messages"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                              "response_format": {"type": "json_object"}}, "response_format"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {"49152": 5}}, "logit_bias"),
    ("/v1/completions", {"prompt": PROMPT, "logit_bias": {str(t): 1 for t in range(257)}}, "logit_bias"),
    # an unpaired surrogate reached the tokenizer (TypeError: 500)
    ("/v1/completions", '{"prompt": "Hi \\ud800"}', "prompt"),
    ("/v1/chat/completions", '{"messages": [{"role": "user", "content": "Hi \\ud800"}]}', "messages"),
    # a byte the vocabulary lacks encodes to nothing: the driver refused the empty prompt (500)
    ("/v1/completions", {"prompt": "\x04\x04", "max_tokens": 2}, "prompt"),
    ("/v1/completions", {"prompt": PROMPT, "stop": ["a" * 100_000], "max_tokens": 2}, "stop"),
])
def test_bad_requests_get_openai_errors(api, path, body, param):
    r = _post(api, path, body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error" and err["message"] and err["param"] == param


def test_an_oversized_body_gets_413_and_the_server_serves_on(api):
    from skippy_wire.tools.http_front import MAX_BODY_BYTES

    big = b'{"prompt": "' + b"a" * MAX_BODY_BYTES + b'"}'
    declared = _post(api, "/v1/completions", big)
    chunked = httpx.post(api.url + "/v1/completions", timeout=30,
                         content=(big[i:i + 65536] for i in range(0, len(big), 65536)))
    for r in (declared, chunked):
        assert r.status_code == 413, r.text
        assert r.json()["error"]["type"] == "invalid_request_error"
    assert _complete(api, max_tokens=2, temperature=0).choices[0].text


def test_prompt_longer_than_the_context(api):
    r = _post(api, "/v1/completions", {"prompt": "word " * 600, "max_tokens": 4})
    assert r.status_code == 400
    assert r.json()["error"]["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError):
        _complete(api, prompt="word " * 300, max_tokens=400)


def test_unknown_route_and_health(api):
    r = httpx.get(api.url + "/v1/nothing")
    assert r.status_code == 404 and r.json()["error"]["message"] == "Invalid URL (GET /v1/nothing)"
    assert httpx.get(api.url + "/health").json() == {"status": "ok"}
    text = httpx.get(api.url + "/metrics").text
    assert re.search(r"^skippy_completion_tokens_total [1-9]\d*$", text, re.M)
    assert "# TYPE skippy_queue_depth gauge" in text


def test_full_queue_gets_503_with_retry_after():
    server = ApiServer("--max-inflight", "1", "--max-queue", "0", "--max-connections", "8")
    try:
        with httpx.stream("POST", server.url + "/v1/completions", timeout=60,
                          json={"prompt": PROMPT, "max_tokens": 64, "temperature": 0, "stream": True}) as r:
            lines = r.iter_lines()
            assert json.loads(next(lines)[len("data: "):])["choices"]
            busy = httpx.post(server.url + "/v1/completions", timeout=30,
                              json={"prompt": PROMPT, "max_tokens": 4})
            assert busy.status_code == 503
            assert busy.headers["retry-after"] == "1"
            assert busy.json()["error"]["code"] == "queue_full"
            assert busy.json()["error"]["message"] == ("every lane is busy (1 of 1) and the queue is full "
                                                       "(0 of 0 requests); retry later")
        # The lane is free again once the server has seen the stream go (it cancels the
        # request at its next step, then frees the session on every stage).
        deadline = time.monotonic() + 20
        while (status := httpx.post(server.url + "/v1/completions", timeout=60,
                                    json={"prompt": PROMPT, "max_tokens": 4}).status_code) == 503 \
                and time.monotonic() < deadline:
            time.sleep(0.1)
        assert status == 200
        # Idle connections up to --max-connections do not lock the next client out: the
        # connection quiet longest is closed for it.
        host, port = server.url.removeprefix("http://").split(":")
        idle = [socket.create_connection((host, int(port)), timeout=10) for _ in range(8)]
        try:
            time.sleep(0.5)
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            assert idle[0].recv(1) == b""
        finally:
            for sock in idle:
                sock.close()
    finally:
        log = server.close()
    assert "Traceback" not in log, log


def test_polling_stages_and_connections_serve_the_same_texts(api):
    """--poll-ms reaches the stages it starts (their ``serve`` accepts it) and its own
    connections; two requests at once still get their greedy texts."""
    prompts = [f"{PROMPT} {name}" for name in ("Anna", "Ben")]
    expected = [_complete(api, prompt=p, max_tokens=12, temperature=0).choices[0].text for p in prompts]
    server = ApiServer("--poll-ms", "0.5")
    try:
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            texts = list(pool.map(lambda p: _complete(server, prompt=p, max_tokens=12, temperature=0).choices[0].text,
                                  prompts))
    finally:
        log = server.close()
    assert "Traceback" not in log, log
    assert texts == expected


def test_api_key_guards_every_route_but_health_and_models_retrieve():
    """In process (no stages needed: the routes checked never reach the engine)."""
    from starlette.testclient import TestClient

    from skippy_wire.tools.api import Api

    class IdleEngine:
        def check_ready(self) -> None:
            pass

    app = Api(IdleEngine(), model_id="smol", chat_template=None, max_inflight=1, api_keys=["s3cret"]).app()
    with TestClient(app) as client:
        assert client.get("/health").status_code == 200
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"}):
            r = client.get("/v1/models", headers=headers)
            assert r.status_code == 401 and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize", "/apply-template"):
            assert client.post(path, json={"prompt": "x"}).status_code == 401, path
        ok = {"Authorization": "Bearer s3cret"}
        assert client.get("/v1/models", headers=ok).json()["data"][0]["id"] == "smol"
        assert client.get("/v1/models/smol", headers=ok).json()["id"] == "smol"
        missing = client.get("/v1/models/gpt-4", headers=ok)
        assert missing.status_code == 404 and missing.json()["error"]["code"] == "model_not_found"


def _children(pid: int) -> list[int]:
    """The processes whose parent (field 4) is ``pid``."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            if int(_stat_fields(f"/proc/{entry}/stat")[1]) == pid:
                found.append(int(entry))
        except (OSError, IndexError, ValueError):  # the process ended meanwhile
            pass
    return found


def test_a_request_that_fails_in_the_pipeline_is_logged_by_the_api():
    # --connect to a port nobody listens on: served anyway (the stages may start later, their
    # requests a 503 to retry until then), and an operator reads why a request failed, not only
    # a counter in /metrics.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ApiServer("--connect", f"127.0.0.1:{port}")
    try:
        r = _post(server, "/v1/completions", {"prompt": "Hi", "max_tokens": 2})
        assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    finally:
        log = server.close()
    assert "Traceback" not in log, log
    assert re.search(rf"^\[skippy-wire\] a request failed in the pipeline: cannot connect to stage 0 at "
                     rf"127\.0\.0\.1:{port}: ", log, re.M), log


def test_a_stage_that_dies_stops_the_api_with_one_line():
    """Nothing can be served once a stage it started is gone: the command exits 1 with the
    reason (for a supervisor to restart it) instead of answering 502 forever."""
    server = ApiServer()
    try:
        stages = _children(server.proc.pid)
        assert len(stages) == 2, stages
        os.kill(max(stages), signal.SIGKILL)  # the stage started last
        assert server.proc.wait(30) == 1
    finally:
        log = server.close()
    assert "Traceback" not in log, log
    assert re.search(r"^skippy-wire: error: stage \d \(layers \d+\.\.\d+\) was killed by SIGKILL; the API stopped$",
                     log, re.M), log


@pytest.mark.parametrize("signum,status", [(signal.SIGTERM, 143), (signal.SIGHUP, 129), (signal.SIGINT, 130)])
def test_sigterm_and_sighup_stop_the_stages_and_exit_like_run(signum, status):
    """uvicorn stops gracefully on SIGTERM and used to return 0 from the command; a closed
    terminal (SIGHUP) killed it without stopping its stage processes."""
    server = ApiServer("--stages", "2")
    try:
        stages = _children(server.proc.pid)
        assert len(stages) == 2, stages
        server.proc.send_signal(signum)
        try:
            code = server.proc.wait(30)
        except subprocess.TimeoutExpired:  # its log, below, says where it stopped
            code = "still running 30 s after the signal"
        deadline = time.monotonic() + 10
        while any(os.path.exists(f"/proc/{pid}") for pid in stages) and time.monotonic() < deadline:
            time.sleep(0.1)
        alive = [pid for pid in stages if os.path.exists(f"/proc/{pid}")]
    finally:
        log = server.close()
    assert code == status and not alive and "Traceback" not in log, (code, alive, log)
    assert log.endswith("[skippy-wire] stopped\n"), log  # as Ctrl-C says it (SIGTERM and SIGHUP said nothing)


def test_a_sigint_ignored_when_the_api_starts_stays_ignored():
    """A script's background job starts with SIGINT ignored, so that a Ctrl-C meant for the
    program in the foreground leaves it running, as it leaves `run` and `serve`; uvicorn
    handled SIGINT whatever it was, and the api stopped."""
    server = ApiServer("--stages", "2", sigint=False)
    try:
        server.proc.send_signal(signal.SIGINT)
        time.sleep(1.0)  # a stop closes the listener at once
        assert httpx.get(server.url + "/health", timeout=10).status_code == 200
        server.proc.send_signal(signal.SIGTERM)
        code = server.proc.wait(30)
    finally:
        log = server.close()
    assert code == 143 and "Traceback" not in log, (code, log)


def test_api_connect_to_a_stage_that_requires_tls_it_lacks_is_a_start_up_error(tmp_path):
    """It served 503s "until the stages answer", which a stage that refuses plain TCP never does."""
    import threading

    from skippy_wire.net.tls import TLS_REQUIRED_NOTICE
    from skippy_wire.stage.models import write_tiny_llama_gguf

    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    stage = socket.create_server(("127.0.0.1", 0))  # says what a mutual-TLS stage says to a plain peer

    def answer() -> None:
        while True:
            try:
                conn, _ = stage.accept()
            except OSError:
                return
            with conn:
                conn.sendall(TLS_REQUIRED_NOTICE)

    threading.Thread(target=answer, daemon=True).start()
    try:
        done = subprocess.run([sys.executable, "-m", "skippy_wire", "api", "--listen", "127.0.0.1:0", "--model",
                               str(model), "--ctx-size", "64", "--connect", "127.0.0.1:%d" % stage.getsockname()[1]],
                              capture_output=True, text=True, timeout=60)
    finally:
        stage.shutdown(socket.SHUT_RDWR)  # wakes answer()'s accept() (close() alone does not)
        stage.close()
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "until the stages answer" not in done.stderr
    assert re.search(r"^skippy-wire: error: stage 0 at \S+ requires mutual TLS", done.stderr, re.M), done.stderr


@pytest.mark.parametrize("protocol", ["15", "16", "17"])
def test_an_api_connected_to_a_later_stage_says_so_at_start(tmp_path, protocol):
    """--connect to stage 1: it answers the readiness Stop as stage 0 would, so the API served
    (healthy) and every request was a 502; a one-token prompt finds it out at start."""
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with launch_pipeline(model, 2, ctx_size=64, protocol=int(protocol)) as cluster:
        later = cluster.stages[1]
        done = subprocess.run([sys.executable, "-m", "skippy_wire", "api", "--listen", "127.0.0.1:0", "--model",
                               str(model), "--ctx-size", "64", "--protocol", protocol,
                               "--connect", f"{later.host}:{later.port}"], capture_output=True, text=True, timeout=60)
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr and "until the stages answer" not in done.stderr
    assert re.search(r"^skippy-wire: error: stage 0 at \S+ closed the connection during a one-token prefill .*; is it "
                     r"stage 0\? a later stage answers a readiness probe but refuses a driver's tokens$",
                     done.stderr, re.M), done.stderr


def test_an_api_connected_to_a_stage_0_with_every_lane_busy_waits_for_it(tmp_path):
    """The start-up probe takes a lane: a stage 0 whose lanes are all held (another API on the
    same stages) answers it late, which is no mismatch to exit on (a later stage refuses a
    driver's tokens at once) but a stage 0 to wait for: healthy, its requests wait for a lane
    (each was a 503 while the probe found no lane within its 5 s)."""
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with launch_pipeline(model, 2, ctx_size=64, extra_args=["-np", "1"]) as cluster, \
            PipelineClient(*cluster.entry, timeout=30) as holder:
        holder.request(next(prefill_messages([1, 2, 3], 4, 7, 7)))  # holds the one lane
        server = ApiServer("--connect", "%s:%d" % cluster.entry, "-m", str(model), "-c", "64", "-np", "1")
        try:
            assert httpx.get(server.url + "/health", timeout=30).status_code == 200
            release = threading.Timer(2.0, lambda: holder.request(StageWireMessage.stop(7, 7)))
            release.start()
            answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 2},
                                timeout=60)
            release.join()
        finally:
            log = server.close()
    assert answer.status_code == 200, answer.text
    assert "is it stage 0?" not in log, log


def test_an_api_whose_connect_starts_later_as_a_later_stage_says_so(tmp_path):
    """A later stage that starts after the API answers the readiness Stop as stage 0 would: /health
    said 200 and every request was a 502 "closed the connection"; the entry is checked until it took a token."""
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = ApiServer("--connect", f"127.0.0.1:{port}", "-m", str(model))
    stage = subprocess.Popen([sys.executable, "-m", "skippy_wire", "serve", "-m", str(model), "--ctx-size", "512",
                              "--layer-start", "2", "--layer-end", "4", "--stage-index", "1",
                              "--listen", f"127.0.0.1:{port}"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    mismatch = "is it stage 0? a later stage answers a readiness probe but refuses a driver's tokens"
    try:
        deadline = time.monotonic() + 60
        while mismatch not in (health := httpx.get(server.url + "/health", timeout=30)).text:
            assert health.status_code == 503, health.text
            assert time.monotonic() < deadline and stage.poll() is None, "the stage never answered"
            time.sleep(0.2)
        assert health.status_code == 503
        answer = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=60)
        assert answer.status_code == 502 and mismatch in answer.json()["error"]["message"], answer.text
    finally:
        stage.terminate()
        stage.wait(30)
        log = server.close()
    assert "Traceback" not in log, log


def test_a_topology_api_starts_before_its_stages_and_serves_once_they_answer(tmp_path):
    """With someone else's stages the API waits for them (/health 503) instead of exiting 1,
    so a supervisor may start it first; it takes the topology's model and stage 0."""
    from skippy_wire.stage.models import write_tiny_llama_gguf

    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf")
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    topology = tmp_path / "one.json"
    topology.write_text(json.dumps({"model_path": str(model), "ctx_size": 512, "stages": [
        {"endpoint": f"127.0.0.1:{port}", "layer_start": 0, "layer_end": 4}]}))
    server = ApiServer("--topology", str(topology))
    stage = None
    try:
        assert httpx.get(server.url + "/health", timeout=30).status_code == 503
        early = httpx.post(server.url + "/v1/completions", json={"prompt": "Hello", "max_tokens": 4}, timeout=30)
        assert early.status_code == 503 and early.headers["retry-after"] == "1", early.text  # as its start line says
        stage = subprocess.Popen([sys.executable, "-m", "skippy_wire", "serve", "--topology", str(topology),
                                  "--stage", "0"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 60
        while httpx.get(server.url + "/health", timeout=30).status_code != 200:
            assert time.monotonic() < deadline and stage.poll() is None, "the stage never answered"
            time.sleep(0.2)
        reply = _complete(server, prompt="Hello", max_tokens=4, temperature=0)
        assert reply.usage.completion_tokens >= 1 and reply.model
    finally:
        if stage is not None:
            stage.terminate()
            stage.wait(30)
        log = server.close()
    assert "Traceback" not in log, log
    assert "until the stages answer" in log, log


def test_a_chat_template_that_does_not_compile_is_named_to_a_chat_client(tmp_path):
    """A chat request was told the model "has no chat template" where the start-up line said it
    had one that does not compile."""
    model = write_tiny_llama_gguf(tmp_path / "tiny.gguf", chat_template="{% for %}")
    server = ApiServer("-m", str(model), "--stages", "1")
    try:
        chat = httpx.post(server.url + "/v1/chat/completions", json={"messages": CHAT, "max_tokens": 2}, timeout=60)
        text = httpx.post(server.url + "/v1/completions", json={"prompt": "Hi", "max_tokens": 2}, timeout=60)
    finally:
        log = server.close()
    assert chat.status_code == 400 and text.status_code == 200, (chat.text, text.text)
    message = chat.json()["error"]["message"]
    assert message.startswith("model tiny cannot chat: the chat template does not compile: "), message
    assert message.endswith("; use /v1/completions") and "has no chat template" not in message
    assert "the chat template does not compile" in log and "Traceback" not in log
