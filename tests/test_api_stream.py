"""The API's response objects and streams as OpenAI clients read them, in process over the
fake engine of test_http_front (no model, no stage processes)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest
from starlette.requests import ClientDisconnect
from starlette.testclient import TestClient
from test_http_front import FakeEngine, _fake_api, _until, serving

from skippy_wire.errors import PipelineError
from skippy_wire.net.service import PipelineUnavailable
from skippy_wire.tools.http_front import RETRY_AFTER_S


def _events(text: str) -> list:
    """The data of each server-sent event; '[DONE]' as is."""
    assert text.endswith("data: [DONE]\n\n") or '"error"' in text, text
    out = []
    for block in text.split("\n\n"):
        if block:
            assert block.startswith("data: ") and "\n" not in block, block
            data = block[len("data: "):]
            out.append(data if data == "[DONE]" else json.loads(data))
    return out


def _http_scope(path: str, body: bytes, spec_version: str = "2.3") -> dict:
    return {"type": "http", "asgi": {"version": "3.0", "spec_version": spec_version}, "http_version": "1.1",
            "method": "POST", "scheme": "http", "path": path, "raw_path": path.encode(), "query_string": b"",
            "root_path": "", "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2),
            "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]}


@pytest.mark.parametrize("spec_version", ["2.3", "2.4"])
def test_a_stream_whose_client_left_before_its_first_chunk_gives_its_lane_back(spec_version):
    """Admitted, then gone while the response head waited to be written (2.3: uvicorn's
    send waits for a client that is not reading, and Starlette cancels it; 2.4: the send
    raises OSError): the response ended before its body iterator ever ran, so the job's own
    cleanup never ran and the lane stayed taken for good (a few such clients, and every
    request after them queued forever).  The head now waits for the generation's first
    piece, so the generation has run by then."""
    engine = FakeEngine()
    api = _fake_api(engine)
    body = json.dumps({"prompt": "A", "stream": True}).encode()
    calls = []

    async def receive():
        calls.append(1)
        if len(calls) == 1:
            return {"type": "http.request", "body": body, "more_body": False}
        if len(calls) == 2:  # the admission's disconnect check (a cancelled wait): no news yet
            await asyncio.Event().wait()
        await asyncio.sleep(0.05)
        return {"type": "http.disconnect"}  # the response's own listener: gone

    async def send(message):
        if message["type"] == "http.response.start":
            if spec_version == "2.4":
                raise OSError("connection reset")
            await asyncio.Event().wait()  # the write buffer never drains

    async def main() -> int:
        with contextlib.suppress(ClientDisconnect):  # 2.4: how Starlette reports the OSError
            await api.app()(_http_scope("/v1/completions", body, spec_version), receive, send)
        for _ in range(500):  # a generation that did start gives its lane back from its worker
            if api.admission.running == 0:
                break
            await asyncio.sleep(0.01)
        return api.admission.running

    try:
        assert asyncio.run(main()) == 0
        assert engine.prompts == ["A"]  # it ran before the head was written
    finally:
        api.close()


def _openai(client: httpx.Client) -> openai.OpenAI:
    return openai.OpenAI(base_url="http://testserver/v1", api_key="none", http_client=client, max_retries=0)


def test_include_usage_gives_every_other_chunk_a_null_usage():
    """OpenAI: with include_usage "all other chunks will also include a usage field, but
    with a null value" (a client may read chunk["usage"] unconditionally)."""
    with TestClient(_fake_api().app()) as client:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = client.post(path, json={**body, "stream": True, "stream_options": {"include_usage": True}})
            *chunks, last, done = _events(r.text)
            assert done == "[DONE]" and last["choices"] == [] and last["usage"]["completion_tokens"] == 1
            assert len(chunks) >= 2 and all("usage" in c and c["usage"] is None for c in chunks), chunks
            plain = _events(client.post(path, json={**body, "stream": True}).text)
            assert all("usage" not in c for c in plain[:-1])


def test_responses_carry_a_system_fingerprint():
    with TestClient(_fake_api().app()) as client:
        oa = _openai(client)
        chat = oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
        completion = oa.completions.create(model="m", prompt="hi")
        chunks = list(oa.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}],
                                                 stream=True))
        fingerprints = {chat.system_fingerprint, completion.system_fingerprint,
                        *(c.system_fingerprint for c in chunks)}
        assert len(fingerprints) == 1 and fingerprints.pop().startswith("skippy-wire")


class FailingEngine(FakeEngine):
    """Streams some text, then the pipeline fails."""

    def generate(self, prompt, *, on_text, **kwargs):
        on_text("partial", [1])
        raise PipelineError("stage 1 closed the connection")


def test_a_pipeline_failure_mid_stream_reaches_the_openai_client_as_an_error():
    # The head (200) has gone: the failure is an error event, and no [DONE] follows.
    with TestClient(_fake_api(FailingEngine()).app()) as client:
        raw = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        events = _events(raw.text)
        assert raw.status_code == 200 and "[DONE]" not in events
        assert events[0]["choices"][0]["text"] == "partial"
        assert events[-1]["error"]["type"] == "server_error" and "stage 1" in events[-1]["error"]["message"]
        stream = _openai(client).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}],
                                                         stream=True)
        with pytest.raises(openai.APIError, match="the pipeline failed: stage 1 closed the connection"):
            list(stream)
        # without a stream: 502
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"
        # llama-server's /completion: its error shape in the stream too (it was OpenAI's: a
        # llama.cpp client reads error.code as the status, and found null)
        raw = client.post("/completion", json={"prompt": "hi", "stream": True})
        events = _events(raw.text)
        assert events[0]["content"] == "partial"
        assert events[-1] == {"error": {"code": 502, "message": "the pipeline failed: stage 1 closed the connection",
                                        "type": "server_error"}}
        assert client.post("/completion", json={"prompt": "hi"}).json() == events[-1]


class DownEngine(FakeEngine):
    """A request failed before, and the pipeline has not answered its probe since."""

    def generate(self, prompt, **kwargs):
        raise PipelineUnavailable("stage 1 at 127.0.0.1:1 was killed by SIGKILL")


def test_a_pipeline_known_to_be_down_is_a_503_with_retry_after():
    with TestClient(_fake_api(DownEngine()).app()) as client:
        r = client.post("/v1/completions", json={"prompt": "hi"})
        assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S)
        assert r.json()["error"]["type"] == "server_error" and "SIGKILL" in r.json()["error"]["message"]


class FailsAtOnceEngine(FakeEngine):
    """The pipeline fails before the first piece of text."""

    def generate(self, prompt, **kwargs):
        raise PipelineError("stage 1 closed the connection")


def test_a_stream_that_fails_before_its_first_piece_gets_an_error_status_not_a_200():
    """As OpenAI and llama-server answer it: the head waits for the first piece, so a client
    that judges a request by its status sees the failure (it got 200 and an error event)."""
    with TestClient(_fake_api(DownEngine()).app()) as client:
        for path, body in (("/v1/completions", {"prompt": "hi"}),
                           ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})):
            r = client.post(path, json={**body, "stream": True})
            assert r.status_code == 503 and r.headers["retry-after"] == str(RETRY_AFTER_S), r.text
            assert "SIGKILL" in r.json()["error"]["message"]
        native = client.post("/completion", json={"prompt": "hi", "stream": True})
        assert native.status_code == 503 and native.json()["error"]["type"] == "unavailable_error", native.text
    with TestClient(_fake_api(FailsAtOnceEngine()).app()) as client:
        r = client.post("/v1/completions", json={"prompt": "hi", "stream": True})
        assert r.status_code == 502 and "stage 1 closed the connection" in r.json()["error"]["message"], r.text
        with pytest.raises(openai.InternalServerError, match="stage 1 closed the connection"):
            _openai(client).completions.create(model="m", prompt="hi", stream=True)


class PartialEngine(FakeEngine):
    """Sends a first piece of text, then waits for ``gate`` as FakeEngine does."""

    def generate(self, prompt, *, on_text, **kwargs):
        on_text("partial", [1])
        return super().generate(prompt, on_text=on_text, **kwargs)


def test_requests_cut_off_by_the_shutdown_get_an_answer_and_log_no_traceback(caplog):
    """uvicorn cancels what outlives its graceful stop; the cancelled request used to log
    "Exception in ASGI application" with a traceback and send a text/plain 500 (a stream:
    a body cut mid-chunk)."""
    engine, servers = PartialEngine(), []
    engine.gate.clear()  # both generations run until the server stops
    api = _fake_api(engine, max_inflight=3)
    try:
        with serving(api.app(), servers, timeout_graceful_shutdown=0.5) as url, ThreadPoolExecutor(3) as pool:
            plain = pool.submit(httpx.post, url + "/v1/completions", json={"prompt": "A"}, timeout=30)
            client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
            chunks = pool.submit(lambda: list(client.chat.completions.create(
                model="m", stream=True, messages=[{"role": "user", "content": "B"}])))
            native = pool.submit(httpx.post, url + "/completion", json={"prompt": "C", "stream": True}, timeout=30)
            _until(lambda: len(engine.prompts) == 3, "the three requests generate")
            servers[0].should_exit = True
            r = plain.result(30)
            assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
            with pytest.raises(openai.APIError, match="shutting down"):
                chunks.result(30)
            client.close()
            # llama-server's route: its error shape in the stream (code: the status)
            assert _events(native.result(30).text)[-1] == {"error": {
                "code": 503, "message": "the server is shutting down; retry later", "type": "unavailable_error"}}
    finally:
        engine.gate.set()
        api.close()
    logged = [rec for rec in caplog.records if rec.exc_info or "Exception in ASGI" in rec.getMessage()]
    assert not logged, logged
