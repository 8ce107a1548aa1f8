"""How the API reads a request's generation options (no server: ``parse_options`` alone)."""

from __future__ import annotations

import struct

import pytest

from skippy_wire.tools import api_params
from skippy_wire.tools.api_params import (MAX_TOKENIZE_BYTES, MAX_TOKENIZE_TEXTS, BadRequest, add_text_biases,
                                          check_text, check_text_fits, check_tokenize_size, parse_options,
                                          suppress_end_of_generation)
from skippy_wire.wire.constants import MAX_STAGE_LOGIT_BIAS


def test_null_fields_mean_their_defaults():
    # Clients that serialise every field send null for those they leave unset.
    nulls = {name: None for name in ("n", "best_of", "stream", "stream_options", "max_completion_tokens",
                                     "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias",
                                     "presence_penalty", "frequency_penalty", "repeat_penalty",
                                     "response_format", "logprobs", "tools")}
    assert parse_options({**nulls, "max_tokens": 7}) == parse_options({"max_tokens": 7})
    options = parse_options({**nulls, "max_tokens": 7})
    assert options.max_tokens == 7 and options.stream is False and options.stop == []


def test_a_response_format_that_is_no_object_is_named():
    with pytest.raises(BadRequest, match="^'response_format' must be an object$"):
        parse_options({"response_format": "text"})


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_options({"max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3


def test_llama_server_names_for_the_token_budget():
    assert parse_options({"n_predict": 5}).max_tokens == 5
    # llama-server reads n_predict before max_tokens
    assert parse_options({"max_tokens": 3, "n_predict": 5}).max_tokens == 5
    assert parse_options({"max_completion_tokens": 3, "n_predict": 5}).max_tokens == 5
    for name in ("max_tokens", "max_completion_tokens", "n_predict"):
        assert parse_options({name: -1}).max_tokens is None  # llama.cpp's -1: until the context is full
        with pytest.raises(BadRequest) as err:
            parse_options({name: 0})
        assert err.value.param == name
        with pytest.raises(BadRequest):
            parse_options({name: -2})


def test_top_p_0_and_min_p_1_keep_only_the_best_token():
    # the wire applies both filters only for 0 < p < 1; llama.cpp keeps the best candidate
    # as f32, as both read them: 1e-50 is 0 there and 0.99999999 is 1 (they turned the filter off)
    for body in ({"top_p": 0}, {"min_p": 1}, {"top_p": 0.0, "top_k": 40}, {"top_p": 1e-50}, {"min_p": 0.99999999}):
        assert parse_options({"temperature": 1, **body}).sampling.wire().top_k == 1
    assert parse_options({"temperature": 1, "top_p": 0.5, "min_p": 0.5}).sampling.wire().top_k == 0


@pytest.mark.parametrize("field", ["temperature", "top_p", "top_k", "min_p", "presence_penalty", "frequency_penalty",
                                   "repeat_penalty"])
def test_an_embedder_s_sampling_field_of_another_type_is_a_type_error(field):
    # struct.error from top_p's f32 reading, a comparison's TypeError, or None taken until the wire
    from skippy_wire.net.service import SamplingParams

    for value in ("0.9", None, True) + ((1.5,) if field == "top_k" else ()):
        with pytest.raises(TypeError, match=f"^{field} must be an? (number|integer), not "):
            SamplingParams(**{field: value})


def test_ignore_eos_bans_every_end_of_generation_token():
    sampling = parse_options({"ignore_eos": True, "temperature": 0}).sampling
    assert not sampling.is_greedy()  # the ban travels in the sampling block
    suppress_end_of_generation(sampling, (0, 2))
    wire = sampling.wire()
    assert wire.ignore_eos and wire.flags == 3
    assert [tuple(b) for b in wire.logit_bias] == [(0, float("-inf")), (2, float("-inf"))]
    full = {"ignore_eos": True, "logit_bias": {str(t): 1 for t in range(10, 10 + MAX_STAGE_LOGIT_BIAS - 1)}}
    with pytest.raises(BadRequest) as err:
        suppress_end_of_generation(parse_options(full).sampling, (0, 2))
    assert err.value.param == "logit_bias"
    with pytest.raises(BadRequest):
        parse_options({"ignore_eos": "yes"})



def test_the_penalties_window_is_llama_servers_repeat_last_n():
    # /completion looks back 64 tokens as llama-server does; the /v1 routes over the whole
    # text so far, as OpenAI's penalties do; repeat_last_n 0 turns the penalties off
    native = parse_options({"repeat_penalty": 1.3}, native=True).sampling.wire()
    assert native.penalty_last_n == 64 and native.repeat_penalty == pytest.approx(1.3)
    assert parse_options({"presence_penalty": 1, "temperature": 1}).sampling.wire().penalty_last_n == -1
    given = parse_options({"frequency_penalty": 1, "repeat_last_n": 16, "temperature": 1}).sampling.wire()
    assert given.penalty_last_n == 16 and given.frequency_penalty == 1
    off = parse_options({"repeat_penalty": 1.3, "presence_penalty": 1, "repeat_last_n": 0}, native=True).sampling
    assert off.wire() is not None and off.is_greedy() is False  # llama.cpp's temperature 0.8 still samples
    assert (off.wire().repeat_penalty, off.wire().presence_penalty, off.wire().penalty_last_n) == (1.0, 0.0, -1)
    greedy = parse_options({"repeat_penalty": 1.3, "repeat_last_n": 0, "temperature": 0}).sampling
    assert greedy.is_greedy() and greedy.wire() is None
    for bad in (-2, 1.5, "64", True):
        with pytest.raises(BadRequest) as err:
            parse_options({"repeat_last_n": bad})
        assert err.value.param == "repeat_last_n"

def test_a_whole_float_is_taken_for_an_integer_field_on_llama_server_s_route():
    # clients that build every number as a float send 40.0; OpenAI's routes refuse it, as
    # OpenAI does (below), and 1.5 stays refused everywhere
    body = {"max_tokens": 2.0, "seed": 7.0, "top_k": 40.0, "n": 2.0, "repeat_last_n": 16.0}
    options = parse_options(body, native=True)
    assert (options.max_tokens, options.sampling.seed, options.sampling.top_k, options.n) == (2, 7, 40, 2)
    assert type(options.max_tokens) is int and type(options.sampling.seed) is int
    assert options.sampling.repeat_last_n == 16
    for name in body:
        with pytest.raises(BadRequest) as err:
            parse_options({name: body[name]})
        assert err.value.param == name
    for bad in ({"max_tokens": float("inf")}, {"seed": 2.0 ** 80}, {"n": 2.5}):
        with pytest.raises(BadRequest):
            parse_options(bad, native=True)


@pytest.mark.parametrize("body, param", [
    ({"n": 0}, "n"),
    ({"n": 65}, "n"),
    ({"best_of": 3}, "best_of"),  # ranking needs log probabilities
    ({"n": 2, "best_of": 3}, "best_of"),
    ({"stream": "yes"}, "stream"),
    ({"max_completion_tokens": 0}, "max_completion_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": True}, "seed"),
])
def test_given_values_are_still_checked(body, param):
    with pytest.raises(BadRequest) as err:
        parse_options(body)
    assert err.value.param == param


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": "auto"}, "tool_choice"),
    ({"tool_choice": "none", "tools": []}, "tool_choice"),
    ({"parallel_tool_calls": False}, "parallel_tool_calls"),
    ({"function_call": "auto"}, "function_call"),
    ({"logit_bias": {"5": "3"}}, "logit_bias"),
    ({"logit_bias": {"5": True}}, "logit_bias"),
    ({"logit_bias": [[5]]}, "logit_bias"),
    ({"logit_bias": [[True, 1]]}, "logit_bias"),
    ({"logit_bias": [[1.5, 1]]}, "logit_bias"),
    ({"logit_bias": {"-5": 1}}, "logit_bias"),  # a number, but no token id (no text either)
    ({"logit_bias": {"12345678901": 1}}, "logit_bias"),
    ({"logit_bias": [[-5, 1]]}, "logit_bias"),
    ({"logit_bias": {"Hello": 101}}, "logit_bias"),
    ({"logit_bias": ""}, "logit_bias"),
    ({"logit_bias": 0}, "logit_bias"),
    ({"n": True}, "n"),
    ({"n": 1.0}, "n"),
    ({"best_of": 1.0}, "best_of"),
    ({"model": 7}, "model"),
    ({"user": 7}, "user"),
    ({"user": {"id": "u1"}}, "user"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"logprobs": 0}, "logprobs"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
    ({"grammar": "root ::= \"a\""}, "grammar"),
    ({"json_schema": {"type": "object"}}, "json_schema"),
    ({"mirostat": 2}, "mirostat"),
    ({"typical_p": 0.5}, "typical_p"),
    ({"xtc_probability": 0.5}, "xtc_probability"),
    ({"dry_multiplier": 0.8}, "dry_multiplier"),
    ({"n_probs": 3}, "n_probs"),
    ({"n_indent": "4"}, "n_indent"),
    ({"t_max_predict_ms": 1.5}, "t_max_predict_ms"),
    ({"n_indent": 2**31}, "n_indent"),  # llama-server's an int32
    # an audio reply (OpenAI's gpt-4o-audio): text alone would silently drop what was asked
    ({"modalities": ["text", "audio"], "audio": {"voice": "alloy", "format": "wav"}}, "modalities"),
    ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
    ({"modalities": "text"}, "modalities"),
    ({"web_search_options": {}}, "web_search_options"),  # asks for a web search, whatever it holds
])
def test_what_the_stages_cannot_honour_or_a_wrong_type_is_refused(body, param):
    with pytest.raises(BadRequest) as err:
        parse_options(body)
    assert err.value.param == param


def test_llama_servers_ends_of_a_text_are_read_on_every_route():
    # honoured by the engine (test_text_stops); off at 0 or below, as there
    assert (parse_options({}).n_indent, parse_options({}).t_max_predict_ms) == (0, 0)
    for chat, native in ((False, False), (True, False), (False, True)):
        options = parse_options({"n_indent": 4, "t_max_predict_ms": 250}, chat=chat, native=native)
        assert (options.n_indent, options.t_max_predict_ms) == (4, 250)
    assert parse_options({"n_indent": 2.0, "t_max_predict_ms": 5.0}, native=True).n_indent == 2


def test_a_user_id_is_a_string():
    assert parse_options({"user": "user-1234"}) == parse_options({"user": None}) == parse_options({})
    for chat in (False, True):
        with pytest.raises(BadRequest, match="^'user' must be a string$"):
            parse_options({"user": 42}, chat=chat)


def test_what_asks_for_nothing_passes():
    # an empty suffix (nothing after the completion) and a chat's logprobs: false
    assert parse_options({"suffix": "", "echo": False, "top_logprobs": 0, "modalities": ["text"]}).max_tokens is None
    assert parse_options({"logprobs": False}, chat=True).stream is False
    with pytest.raises(BadRequest):
        parse_options({"logprobs": True}, chat=True)
    # what the client asked for is named, not the option that refines it (it named top_logprobs)
    for chat, logprobs in ((True, True), (False, 2)):
        with pytest.raises(BadRequest, match="^'logprobs' is not supported$"):
            parse_options({"logprobs": logprobs, "top_logprobs": 2}, chat=chat)
    assert parse_options({"stream": True, "stream_options": {"include_usage": None}}).include_usage is False
    # llama-server's web UI sends its sampling controls at their defaults
    web_ui = {"grammar": "", "mirostat": 0, "typical_p": 1, "tfs_z": 1.0, "dynatemp_range": 0, "xtc_probability": 0,
              "dry_multiplier": 0, "top_n_sigma": -1, "n_probs": 0, "samplers": "edkypmxt", "cache_prompt": True,
              "n_indent": 0, "t_max_predict_ms": -1}
    assert parse_options(web_ui).max_tokens is None


@pytest.mark.parametrize("body", [
    {"typical_p": 1.5}, {"top_n_sigma": 0}, {"top_n_sigma": -2.5}, {"dynatemp_range": -1}, {"n_probs": -1},
    {"xtc_probability": 0.5, "xtc_threshold": 0.6}, {"xtc_probability": -1},
    {"dry_multiplier": 0.8, "dry_penalty_last_n": 0},
    # as llama.cpp reads them, f32s: 1.0 and 0 there
    {"typical_p": 0.99999999999}, {"top_n_sigma": 1e-50}, {"top_n_sigma": -1e300}, {"tfs_z": 2.0},
    {"json_schema": {}, "grammar": ""},  # a grammar given replaces the schema
    # a sampler llama-server's samplers leave out runs nowhere there, whatever its field says
    {"typical_p": 0.5, "samplers": ["top_k", "temperature"]}, {"xtc_probability": 0.5, "samplers": "kt"},
    {"dry_multiplier": 0.8, "samplers": "ekpmt"}, {"top_n_sigma": 2, "samplers": []},
    {"dynatemp_range": 0.5, "samplers": ["top_k"]},
])
def test_what_llama_cpp_reads_as_off_passes(body):
    """llama.cpp's samplers skip their work at these values (typical_p 1.5 was a 400 where 1 passed)."""
    assert parse_options(body).sampling == parse_options({k: v for k, v in body.items()
                                                          if k == "samplers"}).sampling


@pytest.mark.parametrize("body, param", [
    ({"typical_p": 0.5, "samplers": ["typ_p", "temperature"]}, "typical_p"),
    ({"xtc_probability": 0.5, "xtc_threshold": 0.5}, "xtc_probability"),
    ({"dry_multiplier": -0.5, "dry_base": 1}, "dry_multiplier"),
    ({"top_n_sigma": 0.1, "samplers": "st"}, "top_n_sigma"),
    ({"dynatemp_range": 0.5}, "dynatemp_range"),
    # llama-server puts its default base (1.75) in place of one under 1: DRY runs
    ({"dry_multiplier": 0.8, "dry_base": 0.5}, "dry_multiplier"),
    ({"xtc_probability": 0.5, "xtc_threshold": 0.50000001}, "xtc_probability"),  # 0.5 as an f32: not over it
    ({"json_schema": {}}, "json_schema"),  # any JSON object
    ({"tfs_z": 0.9}, "tfs_z"),
    ({"typical_p": True}, "typical_p"),
])
def test_what_a_kept_sampler_would_run_is_refused(body, param):
    with pytest.raises(BadRequest, match=f"^'{param}' is not supported$"):
        parse_options(body)


def test_seed_minus_one_draws_one_and_others_are_reduced_to_32_bits():
    # as llama-server, which reads the seed as a uint32 where -1 is LLAMA_DEFAULT_SEED
    assert parse_options({"seed": -1}).sampling.seed is None
    assert parse_options({"seed": 2**32 - 1}).sampling.seed is None
    assert parse_options({"seed": 2**32 + 5}).sampling.seed == 5
    assert parse_options({"seed": -2}).sampling.seed == 2**32 - 2


def test_a_stop_string_is_bounded():
    """Matching a stop string costs a token only its own characters, but a request's memory
    stays bounded: 4 strings of at most 65,536 characters."""
    assert parse_options({"stop": ["a" * 65536, "b"]}).stop == ["a" * 65536, "b"]
    for stop in ("a" * 65537, ["x", "a" * 1_500_000]):
        with pytest.raises(BadRequest, match="at most 65536 characters") as err:
            parse_options({"stop": stop})
        assert err.value.param == "stop"


def test_a_text_longer_than_the_context_can_hold_is_refused_by_its_size():
    check_text_fits("é" * 50, max_token_bytes=4, ctx=25, what="'prompt'", param="prompt")  # 100 bytes: fits
    for text in ("é" * 51, "x" * 101, "x" * 10**6):
        with pytest.raises(BadRequest) as err:
            check_text_fits(text, max_token_bytes=4, ctx=25, what="'prompt'", param="prompt")
        assert err.value.code == "context_length_exceeded" and err.value.param == "prompt"
        assert f"'prompt' is {len(text.encode())} bytes of text, more than 25 tokens can hold" in str(err.value)
    with pytest.raises(BadRequest, match="'prompt' is at least 1000 bytes of text"):  # its characters tell
        check_text_fits("é" * 1000, max_token_bytes=4, ctx=25, what="'prompt'", param="prompt")


def test_tokenize_takes_a_bounded_text():
    check_tokenize_size(["x" * MAX_TOKENIZE_BYTES])
    check_tokenize_size(["x" * (MAX_TOKENIZE_BYTES // 2), 7, "x" * (MAX_TOKENIZE_BYTES // 2)])
    check_tokenize_size(["a"] * MAX_TOKENIZE_TEXTS + [1] * MAX_TOKENIZE_TEXTS)
    for pieces in (["x" * (MAX_TOKENIZE_BYTES + 1)], ["é" * (MAX_TOKENIZE_BYTES // 2 + 1)],
                   ["x" * MAX_TOKENIZE_BYTES, 1, "x"], [1] * (MAX_TOKENIZE_BYTES + 1),
                   ["a"] * (MAX_TOKENIZE_TEXTS + 1)):
        with pytest.raises(BadRequest, match="/tokenize takes at most") as err:
            check_tokenize_size(pieces)
        assert err.value.param == "content"


class _CountingPattern:
    """SURROGATE, counting the strings it is asked to search."""

    def __init__(self, pattern) -> None:
        self.pattern, self.searched = pattern, 0

    def search(self, text):
        self.searched += 1
        return self.pattern.search(text)


def test_a_body_without_a_surrogate_is_cleared_without_a_walk_and_one_with_is_named(monkeypatch):
    # the walk built a path and searched every key and string: seconds over an 8 MiB body, on the event loop
    counting = _CountingPattern(api_params.SURROGATE)
    monkeypatch.setattr(api_params, "SURROGATE", counting)
    body = {"prompt": "héllo 😀", "x": [[{"k": "v"}] * 1000] * 100, "stop": ["é"]}
    check_text(body)
    assert counting.searched == 0
    body["x"][99] = [{"k": "v"}, {"deep": ["ok", "bad \ud800"]}]
    with pytest.raises(BadRequest, match=r"^'x\[99\]\[1\]\.deep\[1\]' is not valid text") as err:
        check_text(body)
    assert err.value.param == "x" and counting.searched > 0


def test_a_long_logit_bias_list_is_refused_by_its_length_before_its_pairs_are_read():
    pairs = [[1, 2]] * (MAX_STAGE_LOGIT_BIAS + 1) + ["not a pair"]
    with pytest.raises(BadRequest, match=f"may hold at most {MAX_STAGE_LOGIT_BIAS} tokens"):
        parse_options({"logit_bias": pairs})


def test_a_repeat_penalty_below_the_smallest_f32_is_not_sent_as_unset():
    """1e-46 is 0 as an f32, which the wire reads as unset: no penalty at all, where the
    smallest one was asked for; it travels as the nearest f32 above 0."""
    for penalty in (1e-46, 2.0**-150, 1e-300):
        wire = parse_options({"repeat_penalty": penalty, "temperature": 1}).sampling.wire()
        assert struct.unpack("<f", struct.pack("<f", wire.repeat_penalty))[0] == 2.0**-149, penalty
    assert parse_options({"repeat_penalty": 1e-30, "temperature": 1}).sampling.wire().repeat_penalty == 1e-30


def test_a_logit_bias_text_is_kept_to_be_tokenized_as_llama_server_does():
    # "7042" in a pair is a text llama-server tokenizes, not the token 7042 (that one was biased)
    options = parse_options({"logit_bias": [["7042", False], [7, 1], ["Hello", -2]]})
    assert options.sampling.logit_bias == {7: 1.0}
    assert options.bias_texts == [("7042", float("-inf")), ("Hello", -2.0)]
    options = parse_options({"logit_bias": {" world": 3, "5": 1, "007": 2, "": 1, "4 ": 1}})
    assert options.sampling.logit_bias == {5: 1.0, 7: 2.0} and options.bias_texts == [(" world", 3.0), ("", 1.0),
                                                                                      ("4 ", 1.0)]
    # a whole integer as strtol reads one (space before it, a sign) is a token id, as llama-server reads it
    assert parse_options({"logit_bias": {" 12": 1, "+5": 2, "-0": 3}}).sampling.logit_bias == {12: 1, 5: 2, 0: 3}


def test_a_logit_bias_texts_tokens_count_within_what_the_wire_carries():
    class OneTokenACharacter:
        max_token_bytes = 1

        def encode(self, text, add_bos, parse_special):
            assert add_bos is False and parse_special is False  # as llama-server tokenizes them
            return [ord(c) for c in text]

    body = {"logit_bias": {**{str(t): 1 for t in range(MAX_STAGE_LOGIT_BIAS - 2)}, "\x00\x00": 1, "\xfe\xff": -1}}
    options = parse_options(body)  # 254 ids, and texts of the ids 0, 254 and 255: the most there may be
    add_text_biases(options, OneTokenACharacter())
    assert len(options.sampling.logit_bias) == MAX_STAGE_LOGIT_BIAS and options.sampling.logit_bias[0] == 3.0
    ids = {str(t): 1 for t in range(MAX_STAGE_LOGIT_BIAS - 2)}
    options = parse_options({"logit_bias": {**ids, "\xfe\xff\u0100": 1}})
    with pytest.raises(BadRequest, match="its texts' tokens counted") as err:
        add_text_biases(options, OneTokenACharacter())
    assert err.value.param == "logit_bias"
