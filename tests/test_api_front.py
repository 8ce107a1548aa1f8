"""The API as browsers and OpenAI clients meet it beyond the bodies: CORS preflights,
request ids, and prompts the pipeline cannot start from, in process over the fake engine of
test_http_front (no model, no stage processes)."""

from __future__ import annotations

import openai
import pytest
from starlette.testclient import TestClient
from test_http_front import FakeEngine, FakeTokenizer, _fake_api

from skippy_wire.stage.chat import ChatTemplate
from skippy_wire.tools.api import Api

PAGE = "http://page.example:8080"
#: What OpenAI's JavaScript client sends beside the key and the body's type.
STAINLESS = "x-stainless-arch,x-stainless-lang,x-stainless-os,x-stainless-package-version,x-stainless-retry-count," \
            "x-stainless-runtime,x-stainless-runtime-version,x-stainless-timeout"


def test_a_browser_page_using_the_openai_javascript_client_passes_the_preflight():
    """The preflight named the client's X-Stainless-* headers and was refused (400
    "Disallowed CORS headers"), so the browser never sent the call."""
    asked = f"authorization,content-type,{STAINLESS}"
    preflight = {"Origin": PAGE, "Access-Control-Request-Method": "POST", "Access-Control-Request-Headers": asked}
    with TestClient(_fake_api(api_keys=["k"], cors_origins=(PAGE,)).app()) as client:
        r = client.options("/v1/chat/completions", headers=preflight)
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        allowed = {h.strip().lower() for h in r.headers["access-control-allow-headers"].split(",")}
        assert set(asked.split(",")) <= allowed
        # the call itself still needs the key, and the page may read the request id
        assert client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": PAGE}).status_code == 401
        r = client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": PAGE, "Authorization": "Bearer k"})
        assert r.status_code == 200 and r.headers["access-control-allow-origin"] == PAGE
        assert "x-request-id" in r.headers["access-control-expose-headers"].lower()


def test_every_response_carries_a_request_id_as_openai_sends_it():
    with TestClient(_fake_api(api_keys=["k"]).app()) as client:
        oa = openai.OpenAI(base_url="http://testserver/v1", api_key="k", http_client=client, max_retries=0)
        chat = oa.chat.completions.with_raw_response.create(model="m", messages=[{"role": "user", "content": "hi"}])
        assert chat.request_id and chat.request_id.startswith("req_")
        with oa.completions.with_streaming_response.create(model="m", prompt="hi", stream=True) as stream:
            assert stream.request_id.startswith("req_") and stream.request_id != chat.request_id
        # errors too, and a client's own id comes back for both sides' logs
        for path, headers in (("/v1/models", {}), ("/v1/nothing", {"Authorization": "Bearer k"})):
            r = client.get(path, headers={**headers, "X-Request-Id": "trace-42"})
            assert r.status_code in (401, 404) and r.headers["x-request-id"] == "trace-42"
        # one that is no usable id is replaced
        r = client.get("/v1/models", headers={"Authorization": "Bearer k", "X-Request-Id": "x" * 500})
        assert r.headers["x-request-id"].startswith("req_")


def test_the_refusals_before_the_routes_carry_a_request_id_too():
    """A page's refused origin, a refused preflight and a request with both body lengths
    were answered without one."""
    with TestClient(_fake_api(cors_origins=(PAGE,)).app()) as client:
        refusals = [client.post("/v1/completions", json={"prompt": "x"}, headers={"Origin": "http://other.example"}),
                    client.options("/v1/completions", headers={"Origin": "http://other.example",
                                                               "Access-Control-Request-Method": "POST"}),
                    client.post("/v1/completions", content=b"{}",
                                headers={"Content-Length": "2", "Transfer-Encoding": "chunked"})]
        for r in refusals:
            assert r.status_code in (400, 403) and r.headers["x-request-id"].startswith("req_"), r.text


class DroppingTokenizer(FakeTokenizer):
    """As the real vocabulary drops a byte it lacks (b'\\x04'), and with it a whole prompt."""

    def encode(self, text: str, add_bos=None) -> list[int]:
        return [b for b in super().encode(text) if b != 4]


@pytest.mark.parametrize("stream", [False, True])
def test_a_prompt_of_no_tokens_is_a_400_not_a_500(stream):
    """The driver refuses to start from no token (ValueError): a 500, and in a stream a
    traceback after the 200 head."""
    engine = FakeEngine()
    engine.tokenizer = DroppingTokenizer()
    with TestClient(_fake_api(engine).app(), raise_server_exceptions=False) as client:
        r = client.post("/v1/completions", json={"prompt": "\x04\x04", "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt", r.text
        assert "no tokens" in r.json()["error"]["message"]
    empty = Api(engine, model_id="m", chat_template=ChatTemplate("{% if false %}{% endif %}"), max_inflight=1)
    with TestClient(empty.app(), raise_server_exceptions=False) as client:
        r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                      "stream": stream})
        assert r.status_code == 400 and r.json()["error"]["param"] == "messages", r.text
    assert engine.prompts == []


@pytest.mark.parametrize("cap, path, body, expected", [
    (8, "/v1/completions", {"prompt": "hi"}, 8),  # none asked: the server's -n
    (8, "/v1/completions", {"prompt": "hi", "max_tokens": 4}, 4),
    (8, "/v1/completions", {"prompt": "hi", "max_tokens": 20}, 8),
    (8, "/v1/completions", {"prompt": "hi", "max_tokens": 100}, 8),  # past the context, but -n caps it first
    (100, "/v1/completions", {"prompt": "hi"}, 62),  # past the context's room: the room (no 400)
    (None, "/v1/completions", {"prompt": "hi"}, 62),
    (None, "/v1/completions", {"prompt": "hi", "max_tokens": 20}, 20),
])
def test_n_caps_every_request_s_token_budget_as_llama_server_s_does(cap, path, body, expected):
    """`api -n N` was an unknown option; llama-server caps each request's n_predict by it."""
    engine = FakeEngine(ctx_size=64)
    with TestClient(_fake_api(engine, max_tokens=cap).app(), raise_server_exceptions=False) as client:
        r = client.post(path, json=body)
        props = client.get("/props").json()["default_generation_settings"]["params"]
    assert r.status_code == 200 and engine.requests[-1]["max_tokens"] == expected, r.text
    assert props["n_predict"] == (-1 if cap is None else cap)
