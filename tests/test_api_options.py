"""How the API reads a request's generation options (no server: ``parse_options`` alone)."""

from __future__ import annotations

import pytest

from skippy_wire.tools.api import BadRequest, parse_options


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
    ({"max_completion_tokens": 0}, "max_tokens"),
    ({"temperature": float("nan")}, "temperature"),
    ({"top_k": 1.5}, "top_k"),
    ({"seed": True}, "seed"),
])
def test_given_values_are_still_checked(body, param):
    with pytest.raises(BadRequest) as err:
        parse_options(body)
    assert err.value.param == param
