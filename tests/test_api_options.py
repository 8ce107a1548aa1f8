"""How the API reads a request's generation options (no server: ``parse_options`` alone)."""

from __future__ import annotations

import pytest

from skippy_wire.tools.api_params import BadRequest, parse_options


def test_null_fields_mean_their_defaults():
    # Clients that serialise every field send null for those they leave unset.
    nulls = {name: None for name in ("n", "best_of", "stream", "stream_options", "max_completion_tokens",
                                     "temperature", "top_p", "top_k", "min_p", "seed", "stop", "logit_bias",
                                     "presence_penalty", "frequency_penalty", "repeat_penalty",
                                     "response_format", "logprobs", "tools")}
    assert parse_options({**nulls, "max_tokens": 7}) == parse_options({"max_tokens": 7})
    options = parse_options({**nulls, "max_tokens": 7})
    assert options.max_tokens == 7 and options.stream is False and options.stop == []


def test_max_completion_tokens_wins_over_max_tokens():
    assert parse_options({"max_completion_tokens": 3, "max_tokens": 9}).max_tokens == 3


@pytest.mark.parametrize("body, param", [
    ({"n": 2}, "n"),
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
    ({"logit_bias": []}, "logit_bias"),
    ({"logit_bias": ""}, "logit_bias"),
    ({"logit_bias": 0}, "logit_bias"),
    ({"n": True}, "n"),
    ({"n": 1.0}, "n"),
    ({"best_of": 1.0}, "best_of"),
    ({"model": 7}, "model"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
    ({"stream": False, "stream_options": {}}, "stream_options"),
    ({"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
    ({"max_completion_tokens": 1.5}, "max_completion_tokens"),
    ({"logprobs": 0}, "logprobs"),
    ({"repeat_penalty": 0}, "repeat_penalty"),
])
def test_what_the_stages_cannot_honour_or_a_wrong_type_is_refused(body, param):
    with pytest.raises(BadRequest) as err:
        parse_options(body)
    assert err.value.param == param


def test_what_asks_for_nothing_passes():
    # an empty suffix (nothing after the completion) and a chat's logprobs: false
    assert parse_options({"suffix": "", "echo": False, "top_logprobs": 0}).max_tokens is None
    assert parse_options({"logprobs": False}, chat=True).stream is False
    with pytest.raises(BadRequest):
        parse_options({"logprobs": True}, chat=True)
    assert parse_options({"stream": True, "stream_options": {"include_usage": None}}).include_usage is False


def test_seed_minus_one_draws_one_and_others_are_reduced_to_32_bits():
    # as llama-server, which reads the seed as a uint32 where -1 is LLAMA_DEFAULT_SEED
    assert parse_options({"seed": -1}).sampling.seed is None
    assert parse_options({"seed": 2**32 - 1}).sampling.seed is None
    assert parse_options({"seed": 2**32 + 5}).sampling.seed == 5
    assert parse_options({"seed": -2}).sampling.seed == 2**32 - 2
