"""llama-server's native ``POST /completion`` in process over a scripted engine: the shape
its clients read (non-streamed, streamed, a batch of prompts), and the same checks and
errors as the OpenAI routes.  tests/test_api.py runs it against the real pipeline."""

from __future__ import annotations

import json

import pytest
from starlette.testclient import TestClient
from test_http_front import FakeEngine, FakeTokenizer, _fake_api

from skippy_wire.net.service import Generation
from skippy_wire.tools import api
from skippy_wire.tools.api_params import MAX_NATIVE_STOP_STRINGS, MAX_STOP_CHARS, MAX_STOP_STRINGS
from skippy_wire.tools.llama_sampling import given_sampling
from skippy_wire.wire.constants import MAX_STAGE_LOGIT_BIAS


class ByteTokenizer(FakeTokenizer):
    def decode(self, ids, special: bool = True) -> str:
        return bytes(ids).decode("utf-8", errors="replace")


class ScriptedEngine(FakeEngine):
    """Answers every prompt with ``pieces`` (one token per byte), then ends the way
    ``stop_type`` says."""

    def __init__(self, pieces=("Hel", "lo", "\nworld"), stop_type="word", stopping_word="!") -> None:
        super().__init__()
        self.tokenizer = ByteTokenizer()
        self.pieces, self.stop_type, self.stopping_word = pieces, stop_type, stopping_word

    def generate(self, prompt, *, max_tokens, sampling, stop, on_text, cancelled, **ends) -> Generation:
        self.requests.append({"max_tokens": max_tokens, "sampling": sampling, "stop": stop, **ends})
        self.prompts.append(bytes(prompt).decode())
        for piece in self.pieces:
            on_text(piece, list(piece.encode()))
        text = "".join(self.pieces)
        return Generation(text=text, prompt_tokens=len(prompt), completion_tokens=len(text.encode()),
                          finish_reason="length" if self.stop_type == "limit" else "stop", stop_type=self.stop_type,
                          stopping_word=self.stopping_word, tokens=list(text.encode()), first_token_s=0.01,
                          elapsed_s=0.11)


def _post(client, body: dict):
    return client.post("/completion", json=body)


def test_a_completion_in_llama_servers_shape():
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine).app()) as client:
        reply = _post(client, {"prompt": "Say hi", "n_predict": 20, "temperature": 0.5, "stop": ["!"],
                               "cache_prompt": True})
    assert reply.status_code == 200
    body = reply.json()
    assert body["content"] == "Hello\nworld" and body["stop"] is True and body["tokens"] == []
    assert body["tokens_predicted"] == 11 and body["tokens_evaluated"] == len("Say hi")
    assert body["stop_type"] == "word" and body["stopping_word"] == "!"
    assert body["has_new_line"] is True and body["truncated"] is False and body["prompt"] == "Say hi"
    settings = body["generation_settings"]
    assert settings["n_predict"] == 20 and settings["temperature"] == 0.5 and settings["stop"] == ["!"]
    assert settings["samplers"] == ["penalties", "dry", "top_n_sigma", "top_k", "typ_p", "top_p", "min_p", "xtc",
                                    "temperature"]  # llama-server's default chain, as it reports it
    assert engine.requests[0]["max_tokens"] == 20 and engine.requests[0]["stop"] == ["!"]
    timings = body["timings"]
    assert timings["prompt_n"] == 6 and timings["predicted_n"] == 11
    assert abs(timings["prompt_ms"] - 10.0) < 1e-6 and abs(timings["predicted_ms"] - 100.0) < 1e-6
    assert abs(timings["predicted_per_second"] - 110.0) < 1e-6


def test_the_server_s_n_caps_n_predict_and_is_reported_so():
    """As llama-server reports a request's n_predict capped by its -n; a capped generation that
    stops at its limit is not `truncated` (the context had room)."""
    engine = ScriptedEngine(stop_type="limit")
    with TestClient(_fake_api(engine, max_tokens=8).app()) as client:
        unasked = _post(client, {"prompt": "hi", "n_predict": -1})
        more = _post(client, {"prompt": "hi", "n_predict": 9})
    for reply in (unasked, more):
        body = reply.json()
        assert body["generation_settings"]["n_predict"] == 8 and body["truncated"] is False, body
    assert [r["max_tokens"] for r in engine.requests] == [8, 8]


def test_the_openai_routes_carry_llama_server_s_timings_for_one_generation():
    """llama-server's extension on /v1 (its web UI shows tokens/s from it): on the answer and
    on a stream's chunk that ends the generation; none for several generations."""
    with TestClient(_fake_api(ScriptedEngine()).app()) as client:
        chat = {"messages": [{"role": "user", "content": "Say hi"}]}
        timings = client.post("/v1/chat/completions", json=chat).json()["timings"]
        assert timings["predicted_n"] == 11 and abs(timings["predicted_per_second"] - 110.0) < 1e-6
        completion = client.post("/v1/completions", json={"prompt": "Say hi"}).json()
        assert completion["timings"]["prompt_n"] == 6 and completion["timings"]["prompt_ms"] == 10.0
        events = [json.loads(line[6:]) for line in client.post(
            "/v1/chat/completions", json={**chat, "stream": True}).text.splitlines()
            if line.startswith("data: {")]
        assert [("timings" in e, e["choices"][0]["finish_reason"]) for e in events][-2:] == [
            (False, None), (True, "stop")]
        assert "timings" not in client.post("/v1/completions", json={"prompt": ["a", "b"]}).json()


def test_return_tokens_gives_the_generated_ids():
    with TestClient(_fake_api(ScriptedEngine(stop_type="eos", stopping_word="")).app()) as client:
        body = _post(client, {"prompt": "Say hi", "return_tokens": True}).json()
    assert bytes(body["tokens"]).decode() == body["content"] and body["stop_type"] == "eos"


def _events(text: str) -> list[dict]:
    blocks = [block for block in text.split("\n\n") if block]
    assert all(block.startswith("data: ") for block in blocks), text
    return [json.loads(block[len("data: "):]) for block in blocks]


def test_a_stream_is_pieces_then_the_final_object_and_no_done():
    with TestClient(_fake_api(ScriptedEngine(stop_type="limit", stopping_word="")).app()) as client:
        reply = _post(client, {"prompt": "Say hi", "stream": True, "return_tokens": True})
    assert reply.status_code == 200 and "[DONE]" not in reply.text
    *pieces, final = _events(reply.text)
    assert [p["content"] for p in pieces] == ["Hel", "lo", "\nworld"]
    assert all(p["stop"] is False for p in pieces) and [p["tokens_predicted"] for p in pieces] == [3, 5, 11]
    assert [bytes(p["tokens"]).decode() for p in pieces] == ["Hel", "lo", "\nworld"]
    assert final["stop"] is True and final["content"] == "" and final["stop_type"] == "limit"
    assert final["tokens_predicted"] == 11


def test_timings_per_token_puts_the_timings_so_far_on_every_streamed_event():
    """llama-server's timings_per_token was read and ignored: no event carried timings."""
    keys = {"cache_n", "prompt_n", "prompt_ms", "prompt_per_token_ms", "prompt_per_second", "predicted_n",
            "predicted_ms", "predicted_per_token_ms", "predicted_per_second"}
    with TestClient(_fake_api(ScriptedEngine()).app()) as client:
        *pieces, final = _events(_post(client, {"prompt": "Say hi", "stream": True, "timings_per_token": True}).text)
        assert [set(p["timings"]) for p in pieces] == [keys] * 3 and final["timings"]["predicted_n"] == 11
        assert [(p["timings"]["prompt_n"], p["timings"]["predicted_n"]) for p in pieces] == [(6, 3), (6, 5), (6, 11)]
        elapsed = [p["timings"]["prompt_ms"] + p["timings"]["predicted_ms"] for p in pieces]
        assert elapsed == sorted(elapsed) and all(t >= 0 for t in elapsed)
        assert all("timings" not in p for p in _events(_post(client, {"prompt": "Say hi", "stream": True}).text)[:-1])
        chat = {"messages": [{"role": "user", "content": "Say hi"}], "stream": True, "timings_per_token": True}
        chunks = [json.loads(line[6:]) for line in client.post("/v1/chat/completions", json=chat).text.splitlines()
                  if line.startswith("data: {")]
        texts = [c for c in chunks if c["choices"][0]["delta"].get("content")]
        assert [c["timings"]["predicted_n"] for c in texts] == [3, 5, 11]
        reply = _post(client, {"prompt": "Say hi", "stream": True, "timings_per_token": "yes"})
        assert reply.status_code == 400 and reply.json()["error"]["message"] == "'timings_per_token' must be a boolean"


def test_a_batch_of_prompts_gives_a_list_in_order():
    with TestClient(_fake_api(ScriptedEngine(), max_inflight=2).app()) as client:
        body = _post(client, {"prompt": ["one", "three"]}).json()
    assert isinstance(body, list) and [b["index"] for b in body] == [0, 1]
    assert [b["tokens_evaluated"] for b in body] == [3, 5]


def test_n_cmpl_asks_for_that_many_completions_of_each_prompt():
    """llama-server's n_cmpl (n its fallback) was read and ignored: one completion came back."""
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine, max_inflight=2).app()) as client:
        body = _post(client, {"prompt": ["one", "three"], "n_cmpl": 2}).json()
        assert [(b["index"], b["tokens_evaluated"]) for b in body] == [(0, 3), (1, 3), (2, 5), (3, 5)]
        assert len(_post(client, {"prompt": "one", "n": 3}).json()) == 3
        reply = _post(client, {"prompt": "one", "n_cmpl": 0})
        assert reply.status_code == 400 and "n_cmpl" in reply.json()["error"]["message"]
    assert sorted(engine.prompts) == ["one"] * 5 + ["three"] * 2


def test_bad_requests_get_llama_servers_error_objects():
    # the checks of the OpenAI routes, answered as llama-server answers: the status as the code
    with TestClient(_fake_api(ScriptedEngine()).app()) as client:
        for body, param in (({"prompt": "hi", "n_predict": "ten"}, "n_predict"), ({"prompt": ""}, "prompt"),
                            ({"prompt": "hi", "n_probs": 5}, "n_probs")):
            reply = _post(client, body)
            error = reply.json()["error"]
            assert reply.status_code == 400 and set(error) == {"code", "message", "type"}, reply.text
            assert error["code"] == 400 and error["type"] == "invalid_request_error" and param in error["message"]
        long = _post(client, {"prompt": "x" * 100}).json()["error"]
        assert (long["code"], long["type"]) == (400, "exceed_context_size_error") and "context" in long["message"]
        # a prompt that leaves no room for a token: llama-server's words and the two numbers
        # its clients read to shorten their history
        full = _post(client, {"prompt": [65] * 64, "n_predict": 4})
        assert full.status_code == 400 and full.json() == {"error": {
            "code": 400, "type": "exceed_context_size_error", "n_prompt_tokens": 64, "n_ctx": 64,
            "message": "request (64 tokens) exceeds the available context size (64 tokens), try increasing it"}}
        assert _post(client, {"prompt": [65] * 63, "n_predict": 4}).status_code == 200
        mixed = _post(client, {"prompt": [65] * 62 + ["abc"]}).json()["error"]  # 63 pieces, 65 tokens
        assert (mixed["n_prompt_tokens"], mixed["n_ctx"]) == (65, 64), mixed
        # as many pieces as the context: refused untokenized, with no count rather than a wrong one
        untokenized = _post(client, {"prompt": [65] * 63 + ["abc"]}).json()["error"]
        assert untokenized["type"] == "exceed_context_size_error" and "n_prompt_tokens" not in untokenized
        openai = client.post("/v1/completions", json={"prompt": [65] * 64}).json()["error"]
        assert set(openai) == {"message", "type", "param", "code"} and openai["code"] == "context_length_exceeded"
        assert client.post("/v1/completions", json={"prompt": ""}).json()["error"]["param"] == "prompt"  # OpenAI's
        assert client.get("/completion").status_code == 405


def test_truncated_says_whether_a_generation_ran_out_of_context_before_n_predict():
    # llama-server sets it with stop_type "limit" when the context is full; it was always false
    with TestClient(_fake_api(ScriptedEngine(stop_type="limit")).app()) as client:
        for n_predict, truncated in ((10, True), (-1, True), (None, True), (4, False), (3, False)):
            body = {"prompt": [65] * 60, **({} if n_predict is None else {"n_predict": n_predict})}
            assert _post(client, body).json()["truncated"] is truncated, n_predict  # 4 tokens of room
    with TestClient(_fake_api(ScriptedEngine(stop_type="eos")).app()) as client:
        assert _post(client, {"prompt": [65] * 60, "n_predict": 10}).json()["truncated"] is False


def test_llama_servers_ends_of_a_text_reach_the_engine_on_every_route_and_are_no_truncation():
    engine = ScriptedEngine(pieces=("x",), stop_type="limit")  # n_indent ended it: 1 token of 4 of room
    with TestClient(_fake_api(engine).app()) as client:
        body = _post(client, {"prompt": [65] * 60, "n_indent": 4, "t_max_predict_ms": 250}).json()
        assert body["stop_type"] == "limit" and body["truncated"] is False, body
        assert client.post("/v1/completions", json={"prompt": "hi", "n_indent": 2}).status_code == 200
        chat = {"messages": [{"role": "user", "content": "hi"}], "n_indent": -1, "t_max_predict_ms": 1000}
        assert client.post("/v1/chat/completions", json=chat).status_code == 200
    assert [(r["min_indent"], r["line_time_limit_s"]) for r in engine.requests] == [(4, 0.25), (2, 0.0), (-1, 1.0)]


def test_llama_servers_defaults_and_limits_on_its_own_route():
    # its sampling defaults (llama-cli's), any temperature (a negative one greedy), and an
    # n_predict past the context's end that runs to it: OpenAI's routes keep OpenAI's rules
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine).app()) as client:
        body = _post(client, {"prompt": "Say hi"}).json()
        assert (body["generation_settings"]["seed"], body["generation_settings"]["n_predict"]) == (4294967295, -1)
        assert _post(client, {"prompt": "Say hi", "temperature": -1}).status_code == 200
        assert _post(client, {"prompt": "Say hi", "temperature": 3, "n_predict": 1000}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "Say hi", "temperature": 3}).status_code == 400
        assert client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 1000}).status_code == 400
        client.post("/v1/completions", json={"prompt": "Say hi"})
        # n_predict 0 evaluates the prompt only, as llama-server's; OpenAI's max_tokens 0 is refused
        assert _post(client, {"prompt": "Say hi", "n_predict": 0}).json()["generation_settings"]["n_predict"] == 0
        assert client.post("/v1/completions", json={"prompt": "Say hi", "max_tokens": 0}).status_code == 400
    defaults, cold, hot, openai_default, evaluate_only = (r["sampling"] for r in engine.requests)
    assert (defaults.temperature, defaults.top_k, defaults.top_p, defaults.min_p) == (0.8, 40, 0.95, 0.05)
    assert cold.temperature == 0.0 and hot.temperature == 3
    assert [r["max_tokens"] for r in engine.requests] == [58, 58, 58, 58, 0]  # the rest of the 64-token context
    assert (openai_default.temperature, openai_default.top_k, openai_default.top_p) == (1.0, 0, 1.0)


def test_a_front_end_s_dozen_stop_strings_pass_on_its_own_route_only():
    """llama-server's /completion sets no limit on ``stop`` and its front-ends send a chat's
    turn markers (a dozen or more): it answered 400 "at most 4 strings" as OpenAI's routes do."""
    engine = ScriptedEngine()
    markers = [f"\n{who}:" for who in ("User", "Assistant", "System", "Human", "AI", "Bot")] * 2 + ["</s>"]
    with TestClient(_fake_api(engine).app()) as client:
        assert _post(client, {"prompt": "Say hi", "stop": markers}).status_code == 200
        assert engine.requests[-1]["stop"] == markers
        for body, message in (({"stop": ["x"] * (MAX_NATIVE_STOP_STRINGS + 1)},
                               f"at most {MAX_NATIVE_STOP_STRINGS} strings"),
                              ({"stop": ["x" * MAX_STOP_CHARS] * (MAX_STOP_STRINGS + 1)}, "characters together")):
            error = _post(client, {"prompt": "Say hi", **body}).json()["error"]
            assert error["code"] == 400 and message in error["message"], error
        openai = client.post("/v1/completions", json={"prompt": "Say hi", "stop": markers}).json()["error"]
        assert openai["param"] == "stop" and f"at most {MAX_STOP_STRINGS} strings" in openai["message"]


def test_response_fields_pick_what_the_client_reads_and_every_event_names_its_tokens():
    with TestClient(_fake_api(ScriptedEngine()).app()) as client:
        body = _post(client, {"prompt": "Say hi", "response_fields": ["content", "timings/prompt_n", "nothing/x"]})
        assert body.json() == {"content": "Hello\nworld", "timings/prompt_n": 6}
        assert _post(client, {"prompt": "Say hi", "response_fields": []}).json()["stop"] is True  # all of it
        events = _events(_post(client, {"prompt": "Say hi", "stream": True}).text)
    assert [bytes(e["tokens"]).decode() for e in events[:-1]] == ["Hel", "lo", "\nworld"]  # without return_tokens
    assert {e["id_slot"] for e in events} == {-1} and events[-1]["tokens"] == []


def test_a_prompt_of_token_ids_and_texts_is_one_prompt_as_llama_server_reads_it():
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine, max_inflight=2).app()) as client:
        assert _post(client, {"prompt": [83, "ay ", 104, "i"]}).json()["tokens_evaluated"] == 6
        # texts and token lists in a list: a batch, each element a prompt of its own
        assert [b["tokens_evaluated"] for b in _post(client, {"prompt": ["one", [116, "wo"]]}).json()] == [3, 3]
        assert client.post("/v1/completions", json={"prompt": [104, "i"]}).status_code == 200
    assert engine.prompts == ["Say hi", "one", "two", "hi"]


def test_llama_servers_list_of_logit_bias_pairs_with_false_for_never():
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine).app()) as client:
        assert _post(client, {"prompt": "hi", "logit_bias": [[15, False], [16, -100], [17, 2.5]]}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi", "logit_bias": {"15": False}}).status_code == 200
        for bad in ([[15]], [[-1, 1.0]], [[15, True]], 7):
            reply = _post(client, {"prompt": "hi", "logit_bias": bad})
            assert reply.status_code == 400 and "'logit_bias'" in reply.json()["error"]["message"], (bad, reply.text)
    pairs, banned = (r["sampling"].logit_bias for r in engine.requests)
    assert pairs == {15: float("-inf"), 16: -100.0, 17: 2.5} and banned == {15: float("-inf")}


def test_a_token_biased_twice_gets_both_biases_as_in_llama_cpp():
    # the second replaced the first ("5" and "05" name one token too)
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine).app()) as client:
        twice = [[5, 1.0], [5, 2.0], [6, False], [6, 3]]
        assert _post(client, {"prompt": "hi", "logit_bias": twice}).status_code == 200
        assert _post(client, {"prompt": "hi", "logit_bias": {"5": 1.5, "05": -0.5}}).status_code == 200
    pairs, keys = (r["sampling"].logit_bias for r in engine.requests)
    assert pairs == {5: 3.0, 6: float("-inf")} and keys == {5: 1.0}


def test_a_logit_bias_text_biases_each_of_its_tokens_as_llama_server_does():
    # texts were refused (a 400), where llama-server tokenizes them (one token a byte here)
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine).app()) as client:
        assert _post(client, {"prompt": "hi", "logit_bias": [["ab", -1.5], [98, 1.0], ["7", False]]}).status_code == 200
        assert client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                         "logit_bias": {"aa": 2, "99": 1}}).status_code == 200
        too_long = {"x" * (MAX_STAGE_LOGIT_BIAS * FakeTokenizer.max_token_bytes + 1): 1}
        reply = _post(client, {"prompt": "hi", "logit_bias": too_long})
        assert reply.status_code == 400 and "'logit_bias' texts may hold at most" in reply.json()["error"]["message"]
    pairs, keys = (r["sampling"].logit_bias for r in engine.requests)
    # "b" (98) biased by the text and by its id: both; "a" met twice in "aa": twice
    assert pairs == {97: -1.5, 98: -0.5, 55: float("-inf")} and keys == {97: 4.0, 99: 1.0}


def test_generation_settings_report_the_samplers_settings_as_asked():
    """They reported what ran: top_k 1 for top_p 0, 0 for a negative temperature, the off
    values of the samplers left out, where llama-server reports what was asked."""
    engine = ScriptedEngine()
    asked = {"temperature": -1.0, "top_k": 7, "top_p": 0.0, "min_p": 0.25, "repeat_last_n": 16}
    with TestClient(_fake_api(engine).app()) as client:
        first = _post(client, {"prompt": "hi", **asked}).json()["generation_settings"]
        left_out = _post(client, {"prompt": "hi", **asked, "samplers": ["temperature"]}).json()["generation_settings"]
        # llama-server reads a window of -1 as its context's size, and reports that (it said -1)
        whole = _post(client, {"prompt": "hi", "repeat_last_n": -1}).json()["generation_settings"]
        assert whole["repeat_last_n"] == engine.ctx_size > 0
    assert {name: first[name] for name in asked} == {name: left_out[name] for name in asked} == asked
    ran, ran_left_out, ran_whole = (r["sampling"] for r in engine.requests)
    assert (ran.temperature, ran.top_k) == (0.0, 1)  # what runs is unchanged
    assert (ran_left_out.top_k, ran_left_out.min_p, ran_left_out.repeat_last_n) == (0, 0.0, 0)
    assert ran_whole.repeat_last_n == -1


def test_llama_servers_samplers_leave_out_the_samplers_they_do_not_name():
    """``samplers`` was ignored: ["temperature"] still cut the draw with top-k 40, top-p 0.95 and
    min-p 0.05, and penalised repeats."""
    engine = ScriptedEngine()
    asked = {"prompt": "hi", "temperature": 0.7, "top_k": 7, "top_p": 0.5, "min_p": 0.2, "repeat_penalty": 1.3,
             "repeat_last_n": 16}
    with TestClient(_fake_api(engine).app()) as client:
        # llama-server's "off" written as a whole float, as /completion reads integers (was a 400)
        assert _post(client, {"prompt": "hi", "mirostat": 0.0, "n_probs": 0.0}).status_code == 200
        engine.requests.clear()
        # (llama-server reads the names exactly: "top-k" is no sampler of its, and is skipped)
        for samplers in (["temperature"], "t", ["penalties", "dry", "top_k", "typ_p", "top-p", "temperature"],
                         "edkypmxt", None, []):
            assert _post(client, {**asked, "samplers": samplers}).status_code == 200, samplers
        for bad in (["temperature", "top_k"], "tk", ["top_k", "top_k"], 7, [1]):
            reply = _post(client, {**asked, "samplers": bad})
            assert reply.status_code == 400 and "'samplers'" in reply.json()["error"]["message"], (bad, reply.text)
        reported = _post(client, {"prompt": "hi", "samplers": "tyxq"}).json()["generation_settings"]["samplers"]
        assert reported == ["temperature", "typ_p", "xtc"]  # as asked, in its order; an unknown letter skipped
        engine.requests.pop()
    got = [(s.temperature, s.top_k, s.top_p, s.min_p, s.repeat_last_n)
           for s in (r["sampling"] for r in engine.requests)]
    full = (0.7, 7, 0.5, 0.2, 16)
    assert got == [(0.7, 0, 1.0, 0.0, 0)] * 2 + [(0.7, 7, 1.0, 0.0, 16)] + [full] * 2 + [(1.0, 0, 1.0, 0.0, 0)]


class BosTokenizer(ByteTokenizer):
    """Adds BOS (token 2) where the model asks for it, as a GGUF's add_bos_token does."""

    def encode(self, text: str, add_bos=None) -> list[int]:
        return ([2] if add_bos is None else []) + super().encode(text)


def test_a_mixed_prompt_has_a_bos_only_before_a_text_that_opens_it():
    engine = ScriptedEngine()
    engine.tokenizer = BosTokenizer()
    with TestClient(_fake_api(engine).app()) as client:
        assert _post(client, {"prompt": ["S", 97, "y"]}).status_code == 200
        assert _post(client, {"prompt": [83, "ay"]}).status_code == 200
    assert [list(r) for r in map(str.encode, engine.prompts)] == [[2, 83, 97, 121], [83, 97, 121]]


def test_an_empty_text_in_a_mixed_prompt_adds_nothing():
    # as llama-server tokenizes it: the ids beside it are the prompt (alone, "" is refused)
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine).app()) as client:
        assert _post(client, {"prompt": [83, "", 97]}).status_code == 200
        assert _post(client, {"prompt": ""}).status_code == 400
        assert _post(client, {"prompt": [["", ""]]}).status_code == 400  # a batch's prompt of empty texts
    assert engine.prompts == ["Sa"]


def test_llama_servers_sampling_options_are_every_requests_defaults():
    """`api --temp 0.7 -s 42` was an unknown option: llama-server's sampling options set every
    request's defaults, on every route; a field a request gives still wins."""
    args = api.build_parser().parse_args(["--temp", "0", "-s", "-2", "--top-k", "5", "--repeat-penalty", "1.2",
                                          "--ignore-eos"])
    given = given_sampling(args)
    assert given == {"temperature": 0.0, "top_k": 5, "repeat_penalty": 1.2, "seed": 2**32 - 2, "ignore_eos": True}
    assert given_sampling(api.build_parser().parse_args([])) == {}
    engine = ScriptedEngine()
    with TestClient(_fake_api(engine, sampling=given).app()) as client:
        for path in ("/v1/completions", "/completion"):
            assert client.post(path, json={"prompt": "hi", "max_tokens": 2}).status_code == 200
        assert client.post("/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0.5,
                                                    "seed": 7, "ignore_eos": False}).status_code == 200
        props = client.get("/props").json()["default_generation_settings"]["params"]
    first, native, asked = (r["sampling"] for r in engine.requests)
    for sampling in (first, native):
        assert (sampling.temperature, sampling.top_k, sampling.repeat_penalty, sampling.seed, sampling.ignore_eos) \
            == (0.0, 5, pytest.approx(1.2), 2**32 - 2, True)
    assert first.top_p == 1.0 and native.top_p == 0.95  # not given: each route's own
    assert (asked.temperature, asked.seed, asked.ignore_eos, asked.top_k) == (0.5, 7, False, 5)
    assert (props["temperature"], props["top_k"], props["seed"], props["ignore_eos"]) == (0.0, 5, 2**32 - 2, True)
