"""llama.cpp's sampling conventions, shared by ``run`` (llama-cli's options) and ``api``
(llama-server's fields): the defaults, the seed that asks for a random one, and the largest
values taken, and ``-n``."""

from .options import UNTIL_FULL, int_at_least, int_between

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

__all__ = ["UNTIL_FILLED", "max_tokens", "cli_seed", "SEED_RANGE", "LLAMA_DEFAULT_SEED", "MAX_NATIVE_TEMPERATURE",
           "MAX_REPEAT_PENALTY", "LLAMA_SAMPLING"]
