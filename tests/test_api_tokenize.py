"""llama-server's /tokenize, /detokenize and /apply-template on SmolLM2's own tokenizer and
chat template (no stages: these routes generate nothing)."""

from __future__ import annotations

import pytest
from starlette.testclient import TestClient
from test_http_front import FakeEngine

from skippy_wire.stage.chat import ChatTemplate
from skippy_wire.stage.models import Tokenizer, smollm2_path, write_tiny_llama_gguf
from skippy_wire.tools.api import Api
from skippy_wire.tools.api_params import MAX_TOKENIZE_BYTES


@pytest.fixture(scope="module")
def client():
    engine = FakeEngine()
    engine.tokenizer = Tokenizer.from_gguf(smollm2_path())
    api = Api(engine, model_id="m", chat_template=ChatTemplate.from_gguf(smollm2_path(), engine.tokenizer),
              max_inflight=1)
    with TestClient(api.app()) as client:
        client.tokenizer, client.app_state_api = engine.tokenizer, api
        yield client
    api.close()


def test_tokenize_gives_the_tokenizer_s_ids_and_detokenize_the_text_back(client):
    text = "Hello, wörld! <|im_end|>"
    r = client.post("/tokenize", json={"content": text})
    assert r.status_code == 200 and r.json() == {"tokens": client.tokenizer.encode(text, add_bos=False)}
    tokens = r.json()["tokens"]
    assert client.tokenizer.tokens[tokens[-1]] == "<|im_end|>"  # parse_special by default, as llama-server
    literal = client.post("/tokenize", json={"content": text, "parse_special": False}).json()["tokens"]
    assert len(literal) > len(tokens)  # spelled out character by character
    assert client.post("/detokenize", json={"tokens": tokens}).json() == {"content": text}
    assert client.post("/detokenize", json={"tokens": literal}).json() == {"content": text}
    pieces = client.post("/tokenize", json={"content": "Hi you", "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hi you"
    assert [p["id"] for p in pieces] == client.tokenizer.encode("Hi you", add_bos=False)
    # a piece that is part of a character: its byte values, as llama-server gives them
    pieces = client.post("/tokenize", json={"content": "a 😀<|im_start|>", "with_pieces": True}).json()["tokens"]
    raw = b"".join(bytes(p["piece"]) if isinstance(p["piece"], list) else p["piece"].encode() for p in pieces)
    assert raw == "a 😀<|im_start|>".encode() and any(isinstance(p["piece"], list) for p in pieces)


def test_tokenize_takes_texts_and_token_ids_mixed_as_llama_server(client):
    # llama-server's tokenize_mixed: ids as given, each text tokenized in place (a 400 here before)
    hi, there = (client.tokenizer.encode(t, add_bos=False) for t in ("Hi", " there"))
    assert client.post("/tokenize", json={"content": [6004, " there", 17]}).json() == {"tokens": [6004, *there, 17]}
    assert client.post("/tokenize", json={"content": ["Hi", " there"]}).json() == {"tokens": hi + there}
    pieces = client.post("/tokenize", json={"content": [*hi, " there"], "with_pieces": True}).json()["tokens"]
    assert "".join(p["piece"] for p in pieces) == "Hi there"
    for content in ([client.tokenizer.n_vocab, "x"], [-1], ["x", True], ["x", 1.5], [["x"]]):
        r = client.post("/tokenize", json={"content": content})
        assert r.status_code == 400 and "'content'" in r.json()["error"]["message"], (content, r.text)


def test_a_thread_the_machine_will_not_start_is_a_503_to_retry(client, monkeypatch):
    # ulimit -u / -v: the tokenizer's thread failed to start: a text 500 and a traceback in the log
    class NoThreads:
        def submit(self, *args, **kwargs):
            raise RuntimeError("can't start new thread")

    monkeypatch.setattr(client.app_state_api, "_tokenizing", NoThreads())
    r = client.post("/tokenize", json={"content": "hi"})
    assert r.status_code == 503 and r.headers["retry-after"] == "1", r.text
    assert r.json()["error"]["code"] == 503 and "cannot start a thread" in r.json()["error"]["message"]  # its shape


def test_add_special_adds_bos_only_where_the_model_asks_for_it(client, tmp_path):
    # As llama.cpp: SmolLM2's GGUF says add_bos_token false, the tiny model's says true.
    hi = client.tokenizer.encode("Hi", add_bos=False)
    assert client.post("/tokenize", json={"content": "Hi", "add_special": True}).json() == {"tokens": hi}
    engine = FakeEngine()
    engine.tokenizer = Tokenizer.from_gguf(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    api = Api(engine, model_id="m", chat_template=None, max_inflight=1)
    with TestClient(api.app()) as tiny:
        plain = tiny.post("/tokenize", json={"content": "Hi"}).json()["tokens"]
        special = tiny.post("/tokenize", json={"content": "Hi", "add_special": True}).json()["tokens"]
        mixed = [tiny.post("/tokenize", json={"content": content, "add_special": True}).json()["tokens"]
                 for content in (["Hi", "Hi"], [5, "Hi"])]
    api.close()
    assert special == [engine.tokenizer.bos_id] + plain
    # a list: BOS only before a text that opens it, as llama-server's tokenize_mixed
    assert mixed[0] == special + plain and mixed[1] == [5] + plain


def test_an_empty_prompt_is_the_bos_alone_where_the_model_adds_one(client, tmp_path):
    # llama.cpp's rule: a model that adds a BOS starts from it (OpenAI's "a new document");
    # SmolLM2 adds none, and nothing is no prompt to start from
    for route in ("/v1/completions", "/completion"):
        empty = client.post(route, json={"prompt": ""})
        assert empty.status_code == 400 and "encodes to no tokens" in empty.json()["error"]["message"], empty.text
    engine = FakeEngine()
    engine.tokenizer = Tokenizer.from_gguf(write_tiny_llama_gguf(tmp_path / "tiny.gguf"))
    api = Api(engine, model_id="m", chat_template=None, max_inflight=1)
    with TestClient(api.app()) as tiny:
        answers = [tiny.post(route, json={"prompt": "", "max_tokens": 2}) for route in ("/v1/completions", "/completion")]
    api.close()
    assert [a.status_code for a in answers] == [200, 200] and engine.prompts == [chr(engine.tokenizer.bos_id)] * 2


def test_tokenize_and_detokenize_refuse_bad_fields_with_llama_server_errors(client):
    """These are llama-server's routes: its error object (code = the status), as /completion's."""
    for path, body, param in (("/tokenize", {"content": 5}, "content"),
                              ("/tokenize", {"content": "x", "with_pieces": "yes"}, "with_pieces"),
                              ("/detokenize", {"tokens": "1 2"}, "tokens"),
                              ("/detokenize", {"tokens": [1, True]}, "tokens"),
                              ("/detokenize", {"tokens": [client.tokenizer.n_vocab]}, "tokens"),
                              ("/apply-template", {"messages": [{"role": "robot", "content": "x"}]}, "")):
        r = client.post(path, json=body)
        error = r.json()["error"]
        assert r.status_code == 400 and error["code"] == 400 and error["type"] == "invalid_request_error", r.text
        assert "param" not in error and param in error["message"], (path, body, r.text)
    not_object = client.post("/tokenize", content=b"[1]")
    assert not_object.status_code == 400 and not_object.json()["error"]["code"] == 400
    big = client.post("/tokenize", json={"content": "x" * (MAX_TOKENIZE_BYTES + 1)})  # its memory: bounded
    assert big.status_code == 400 and "/tokenize takes at most" in big.json()["error"]["message"], big.text
    lone = client.post("/tokenize", content=b'{"content": "Hi \\ud800"}')  # an unpaired surrogate
    assert lone.status_code == 400 and "content" in lone.json()["error"]["message"], lone.text


def test_tokenize_without_content_and_detokenize_without_tokens_answer_empty(client):
    # as llama-server: an absent field is no text / no tokens
    assert client.post("/tokenize", json={}).json() == {"tokens": []}
    assert client.post("/detokenize", json={}).json() == {"content": ""}


def test_detokenize_gives_at_most_as_much_text_as_tokenize_takes(client):
    """Its answer is bounded by the text its tokens stand for, not by their count: 8 MiB of
    ids of a 64-byte token stood for an 85 MiB answer, held until its client read it."""
    tokenizer = client.tokenizer
    longest = max(range(tokenizer.n_vocab), key=lambda i: len(tokenizer.token_bytes(i)))
    size = len(tokenizer.token_bytes(longest))
    fits = MAX_TOKENIZE_BYTES // size
    r = client.post("/detokenize", json={"tokens": [longest] * fits})
    assert r.status_code == 200 and len(r.json()["content"].encode()) == fits * size
    over = client.post("/detokenize", json={"tokens": [longest] * (fits + 1)})
    assert over.status_code == 400, over.text
    assert over.json()["error"]["message"] == (f"'tokens' stand for {(fits + 1) * size} bytes of text; /detokenize "
                                               f"gives at most {MAX_TOKENIZE_BYTES} (detokenize a long list in parts)")
    assert tokenizer.text_bytes([longest, 0]) == size + len(tokenizer.token_bytes(0))


def test_apply_template_renders_as_the_chat_route_does(client):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    r = client.post("/apply-template", json={"messages": messages})
    assert r.status_code == 200
    assert r.json() == {"prompt": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                  "<|im_start|>assistant\n"}
    bad = client.post("/apply-template", json={"messages": [{"role": "robot", "content": "x"}]})
    assert bad.status_code == 400 and "messages" in bad.json()["error"]["message"]


def test_apply_template_and_chat_take_llama_server_s_rendering_fields(client):
    messages = [{"role": "user", "content": "Hi"}]
    r = client.post("/apply-template", json={"messages": messages, "add_generation_prompt": False})
    assert r.status_code == 200 and r.json() == {"prompt": "<|im_start|>system\nYou are a helpful AI assistant "
                                                           "named SmolLM, trained by Hugging Face<|im_end|>\n"
                                                           "<|im_start|>user\nHi<|im_end|>\n"}
    # chat_template_kwargs: more names the template sees, on /apply-template and the chat route alike
    engine = FakeEngine(ctx_size=256)
    template = ChatTemplate("{{ greeting | default('none') }}|{% for m in messages %}{{ m['content'] }}{% endfor %}"
                            "{% if add_generation_prompt %}>{% endif %}")
    api = Api(engine, model_id="m", chat_template=template, max_inflight=1)
    with TestClient(api.app()) as own:
        body = {"messages": messages, "chat_template_kwargs": {"greeting": "hello"}}
        assert own.post("/apply-template", json=body).json() == {"prompt": "hello|Hi>"}
        assert own.post("/v1/chat/completions", json={**body, "add_generation_prompt": False}).status_code == 200
        assert engine.prompts == ["hello|Hi"]
        assert own.post("/apply-template", json={"messages": messages, "chat_template_kwargs": None}).json() == \
            {"prompt": "none|Hi>"}
        # set last, as llama-server sets them: they may replace the renderer's own names but the conversation,
        # and names that are keywords of the renderer's own call are no 500
        assert own.post("/apply-template", json={"messages": messages, "chat_template_kwargs": {
            "add_generation_prompt": False, "continue_final_message": 1, "self": 2}}).json() == {"prompt": "none|Hi"}
        for kwargs, says in (([1], "'chat_template_kwargs' must be an object"),
                             ({"messages": []}, "'chat_template_kwargs' may not set 'messages'")):
            for path in ("/apply-template", "/v1/chat/completions"):
                bad = own.post(path, json={"messages": messages, "chat_template_kwargs": kwargs})
                assert bad.status_code == 400 and bad.json()["error"]["message"] == says, bad.text
        bad = own.post("/apply-template", json={"messages": messages, "add_generation_prompt": "no"})
        assert bad.status_code == 400 and bad.json()["error"]["message"] == "'add_generation_prompt' must be a boolean"
    api.close()
    with pytest.raises(ValueError, match="may not replace the conversation, 'messages'"):
        template.render(messages, extra={"messages": []})


def test_detokenize_refuses_more_ids_than_tokenize_makes_before_it_queues(client, monkeypatch):
    """4 million ids of a token that stands for no text held the one tokenizer thread 8-17 s
    each (every prompt waited behind them); their count is checked on arrival."""
    monkeypatch.setattr(client.tokenizer, "text_bytes", lambda ids: pytest.fail("counted on the tokenizer thread"))
    r = client.post("/detokenize", json={"tokens": [0] * (MAX_TOKENIZE_BYTES + 1)})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["message"] == (f"'tokens' holds {MAX_TOKENIZE_BYTES + 1} token ids; /detokenize takes at "
                                            f"most {MAX_TOKENIZE_BYTES} (detokenize a long list in parts)")


def test_tokenize_s_answer_is_bounded_as_a_request_body_is(client):
    """The pieces of 1 MiB of control characters took 29 MB, held while a client did not read
    them (a dozen such clients took the api from 139 to 590 MB)."""
    text = "\x01" * MAX_TOKENIZE_BYTES
    assert len(client.post("/tokenize", json={"content": text}).json()["tokens"]) == MAX_TOKENIZE_BYTES
    r = client.post("/tokenize", json={"content": text, "with_pieces": True})
    assert r.status_code == 400, r.text[:200]
    message = r.json()["error"]["message"]
    assert message.startswith("the answer would take ") and message.endswith(f" bytes, more than {8 << 20}: ask for "
                                                                            "less at once"), message
