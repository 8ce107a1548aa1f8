"""llama.cpp's sampling conventions, shared by ``run`` (llama-cli's options) and ``api``
(llama-server's options and fields): the defaults, the seed that asks for a random one, the
largest values taken, the sampling options, and ``-n``."""

import argparse

from .options import UNTIL_FULL, float_above, float_between, int_at_least, int_between

#: Sampling seeds are u32 on the wire (wire-format.md 4.3): this many values.
SEED_RANGE = 2**32
#: The seed that asks for a random one, llama.cpp's ``LLAMA_DEFAULT_SEED`` (llama-cli's
#: ``-s 4294967295``, llama-server's ``seed``; as -1 is).
LLAMA_DEFAULT_SEED = SEED_RANGE - 1
#: The hottest temperature and the largest repeat penalty taken (``run``, llama-server's
#: routes): llama.cpp takes any, but the wire carries an f32 (1e39 became +inf), and past
#: these every token is as likely as any other, or every repeated one as good as banned.
MAX_NATIVE_TEMPERATURE = 1e6
MAX_REPEAT_PENALTY = 10.0
#: llama.cpp's sampling defaults (llama-cli's and llama-server's): ``run``'s, and those of the
#: API's llama-server route ``/completion``.
LLAMA_SAMPLING = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05, "repeat_last_n": 64}
#: ``--seed`` -1 draws a random seed (``run`` prints it in its summary, so a run can be repeated).
RANDOM_SEED = -1
#: The defaults llama.cpp and OpenAI share: the three penalties off, a random seed, EOS ends.
SHARED_SAMPLING = {"repeat_penalty": 1.0, "presence_penalty": 0.0, "frequency_penalty": 0.0, "seed": RANDOM_SEED,
                   "ignore_eos": False}
#: How ``api``'s help names a sampling option's default.
ROUTES_OWN = " (default: each route's own)"
#: The sampling options' names (their ``dest``), as the request fields name them.
SAMPLING_OPTIONS = (*LLAMA_SAMPLING, *SHARED_SAMPLING)
#: llama.cpp's ``-n -2``, "until the context is filled": what -1 does here (llama-cli's -1
#: would shift the context and go on, which the stages do not).
UNTIL_FILLED = -2
_MAX_TOKENS = int_at_least(1, special=(UNTIL_FULL, "or -2: until the context is full"))


def max_tokens(text: str) -> int:
    """``-n``: at least 1, or -1 (or llama.cpp's -2) until the context is full."""
    return UNTIL_FULL if text.strip() == str(UNTIL_FILLED) else _MAX_TOKENS(text)


max_tokens.__name__ = "int"

#: What llama-cli's ``-s`` reads (``std::stoul``): any integer an unsigned long holds, a leading
#: minus counting down from 2^64.
_SEED_TEXT = int_between(-(2**64 - 1), 2**64 - 1)


def cli_seed(text: str) -> int:
    """``-s``: the wire's u32 seed, as llama-cli keeps the low 32 bits of what it read: -2 is
    4294967294, 2^32 + 5 is 5, and -1 is :data:`LLAMA_DEFAULT_SEED` (random)."""
    return _SEED_TEXT(text) % SEED_RANGE


cli_seed.__name__ = "int"


def add_sampling_options(p: argparse.ArgumentParser, *, per_request: bool = False) -> None:
    """llama.cpp's sampling options: ``run``'s, as llama-cli takes them (llama.cpp's defaults),
    or with ``per_request`` ``api``'s, as llama-server takes them: the defaults of every
    request, on every route (one not given leaves each route its own)."""
    defaults = {**LLAMA_SAMPLING, **SHARED_SAMPLING}
    if per_request:
        p = p.add_argument_group("requests' sampling", "llama-server's sampling options: one given is every "
                                 "request's default, on every route; one not given leaves each route its own "
                                 "(OpenAI's on /v1, llama.cpp's on /completion: see /props)")

    def option(*names, default_name: str, help: str, **kwargs) -> None:
        default = None if per_request else defaults[default_name]
        p.add_argument(*names, dest=default_name, default=default, help=help + (ROUTES_OWN if per_request else ""),
                       **kwargs)

    option("-s", "--seed", default_name="seed", type=cli_seed,
           help="sampling seed, its low 32 bits as llama.cpp keeps them (-1 or 4294967295, llama.cpp's "
                "LLAMA_DEFAULT_SEED: random)")
    option("--temp", "--temperature", default_name="temperature",
           type=float_between(-MAX_NATIVE_TEMPERATURE, MAX_NATIVE_TEMPERATURE),
           help="temperature (0 or below: greedy, as llama.cpp's)")
    option("--top-k", default_name="top_k", type=int_between(-(2**31), 2**31 - 1), help="top-k (0 or below: off)")
    option("--top-p", default_name="top_p", type=float_between(0, 1), help="top-p (1: off)")
    option("--min-p", default_name="min_p", type=float_between(0, 1), help="min-p (0: off)")
    option("--repeat-penalty", default_name="repeat_penalty", type=float_above(0, MAX_REPEAT_PENALTY),
           help="repetition penalty (1: off)")
    option("--repeat-last-n", default_name="repeat_last_n", type=int_between(-1, 2**31 - 1),
           help="last tokens the repeat, presence and frequency penalties consider (-1: the whole context, "
                "0: no penalties)")
    option("--presence-penalty", default_name="presence_penalty", type=float_between(-2, 2),
           help="presence penalty (0: off)")
    option("--frequency-penalty", default_name="frequency_penalty", type=float_between(-2, 2),
           help="frequency penalty (0: off)")
    p.add_argument("--ignore-eos", action="store_true", default=None if per_request else False,
                   help="never end at an end-of-generation token (their logits become -inf), as llama.cpp's"
                        + (ROUTES_OWN if per_request else ": -n tokens are generated"))


def given_sampling(args) -> dict:
    """The sampling options ``args`` were given (``add_sampling_options(per_request=True)``)."""
    return {name: getattr(args, name) for name in SAMPLING_OPTIONS if getattr(args, name) is not None}

__all__ = ["UNTIL_FILLED", "max_tokens", "cli_seed", "SEED_RANGE", "LLAMA_DEFAULT_SEED", "MAX_NATIVE_TEMPERATURE",
           "MAX_REPEAT_PENALTY", "LLAMA_SAMPLING", "RANDOM_SEED", "SHARED_SAMPLING", "SAMPLING_OPTIONS",
           "add_sampling_options", "given_sampling"]
