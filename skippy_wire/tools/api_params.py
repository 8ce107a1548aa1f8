"""How ``skippy-wire api`` reads a request body: the OpenAI fields it honours, checked and
gathered in :class:`Options`, and the ones it refuses with HTTP 400 naming the field
(:class:`BadRequest`), rather than ignoring what a client asked for.

The checks follow the OpenAI API where it fixes one (``stream_options`` only with
``stream``, ``tool_choice`` only with ``tools``) and llama-server where it extends it
(``seed: -1`` draws one, ``top_k``, ``min_p``, ``repeat_penalty``, ``repeat_last_n``, ``n_predict``,
``ignore_eos``; its other sampling controls pass only with the values that ask for nothing).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..net.connlog import peer_text
from ..net.service import WHOLE_HISTORY, SamplingParams
from ..stage.chat import MESSAGES
from ..stage.models import SURROGATE
from ..wire.constants import DEFAULT_SAMPLERS, MAX_STAGE_LOGIT_BIAS
from ..wire.messages import as_f32
from .llama_sampling import (LLAMA_DEFAULT_SEED, LLAMA_SAMPLING, MAX_NATIVE_TEMPERATURE, MAX_REPEAT_PENALTY, SEED_RANGE,
                             SHARED_SAMPLING)
from .http_front import MAX_BODY_BYTES
from .options import UNTIL_FULL

#: Stop strings a request may give: OpenAI's 4 on the /v1 routes; llama-server's /completion
#: sets no limit and its front-ends send a dozen or more (a chat's turn markers), so up to 64
#: there, their characters together no more than 4 of the longest.
MAX_STOP_STRINGS = 4
MAX_NATIVE_STOP_STRINGS = 64
#: Bytes of text ``/tokenize`` takes at once (tokenizing holds about 200 bytes of memory per
#: byte of text: a whole 8 MiB body would take 1.6 GiB), and ``/detokenize`` gives (an 8 MiB
#: body of long tokens would stand for 85 MiB, held until a slow client has read it).
MAX_TOKENIZE_BYTES = 1 << 20
#: Texts in one ``/tokenize`` list: each is a call to the tokenizer (~11 us of its one thread
#: however short), so a million one-letter texts would hold it four times as long as 1 MiB
#: of text in one.
MAX_TOKENIZE_TEXTS = 1 << 16
#: Generations in one request: its prompts (a completion's ``prompt`` as a batch) times
#: ``n``, the choices of each; they run side by side on the lanes idle when it starts.
MAX_PROMPTS = 64
#: Characters in one stop string at most.  Matching costs each generated token only its own
#: characters (``TextAssembler`` in ``skippy_wire.net.text`` advances an automaton per
#: stop string), but a request's memory must stay bounded: a stop string and its
#: automaton's table take up to 8 bytes a character, so 4 of these at most 2 MiB.
MAX_STOP_CHARS = 65536
# A seed is reduced modulo :data:`.llama_sampling.SEED_RANGE` (the wire carries a u32 seed, and
# llama-server reads ``seed`` as a uint32 too): -1 then asks for a random one, as
# :data:`.llama_sampling.LLAMA_DEFAULT_SEED` does.
#: OpenAI's sampling defaults (every filter off, the penalties over all the text so far),
#: those of the /v1 routes; ``/completion`` takes llama.cpp's (:data:`.llama_sampling.LLAMA_SAMPLING`).
OPENAI_SAMPLING = {"temperature": 1.0, "top_k": 0, "top_p": 1.0, "min_p": 0.0, "repeat_last_n": WHOLE_HISTORY}
#: The hottest temperature OpenAI takes (llama-server's route: :data:`.llama_sampling.MAX_NATIVE_TEMPERATURE`).
MAX_OPENAI_TEMPERATURE = 2.0
#: A logit_bias object's key that is a whole integer as C's strtol reads one (leading space, a
#: sign) is a token id, as llama-server reads it; any other key is a text whose tokens get the
#: bias.  (llama-server drops an id outside the vocabulary and reads "" as the token 0: here
#: the one is a 400, the other a text of no tokens.)
_TOKEN_ID_KEY = re.compile(r"[ \t\n\v\f\r]*[+-]?[0-9]{1,20}")
#: Fields the stages cannot honour, with the values that ask for nothing and so pass
#: (compared with their type: ``0`` is not ``false``; ``audio``, the spoken reply's voice,
#: and ``web_search_options``, a search before answering even when empty, have none).
#: ``logprobs`` is told apart below.
_HARMLESS = {"echo": (False,), "suffix": ("",), "tools": ([],), "functions": ([],), "top_logprobs": (0,),
             "modalities": (["text"],), "audio": (), "web_search_options": ()}


def _holds(test: Callable[[float], bool], value) -> bool:
    """Whether ``value`` is a number ``test`` accepts as llama.cpp reads it: an f32 (rounded,
    infinite past its range; 0.50000001 is 0.5 there)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    return test(as_f32(value))


def _where(test: Callable[[float], bool]) -> Callable[[Any, dict], bool]:
    return lambda value, body: _holds(test, value)


def _xtc_off(value, body: dict) -> bool:
    """XTC asks for nothing at a probability of 0 or below, or beside a threshold over 0.5."""
    return _holds(lambda p: p <= 0, value) or _holds(lambda t: t > 0.5, body.get("xtc_threshold"))


def _dry_off(value, body: dict) -> bool:
    """DRY asks for nothing at a multiplier of 0, or beside a window of 0 tokens (a base under 1
    does not turn it off: llama-server puts its default, 1.75, in its place)."""
    return _holds(lambda m: m == 0, value) or _holds(lambda n: n == 0, body.get("dry_penalty_last_n"))


#: llama-server's own sampling and output controls that the stages cannot honour, each with
#: the test of a value that asks for nothing (where llama.cpp's sampler skips its work:
#: src/llama-sampling.cpp; its web UI sends them all) and the name of its sampler in
#: llama-server's ``samplers``: left out there, the field asks for nothing either.
_LLAMA_OFF = {"grammar": (lambda value, body: value == "", None),
              # any schema is a grammar (``{}``: any JSON object), unless a grammar is given (checked itself)
              "json_schema": (lambda value, body: "grammar" in body, None),
              "mirostat": (_where(lambda v: v == 0), None),
              "typical_p": (_where(lambda v: v >= 1), "typ_p"),
              "tfs_z": (_where(lambda v: v >= 1), None),
              "dynatemp_range": (_where(lambda v: v <= 0), "temperature"),
              "xtc_probability": (_xtc_off, "xtc"),
              "dry_multiplier": (_dry_off, "dry"),
              "top_n_sigma": (_where(lambda v: v <= 0), "top_n_sigma"),
              "n_probs": (_where(lambda v: v <= 0), None)}
#: llama-server's sampler names (common/sampling.cpp's, read exactly) by their letters, and
#: the chain it runs when a request names none (the wire's default, named as llama-server names it).
_LLAMA_SAMPLER_LETTERS = {"d": "dry", "k": "top_k", "y": "typ_p", "p": "top_p", "s": "top_n_sigma", "m": "min_p",
                          "t": "temperature", "x": "xtc", "i": "infill", "e": "penalties"}
LLAMA_DEFAULT_SAMPLERS = tuple("typ_p" if name == "typical_p" else name for name in DEFAULT_SAMPLERS)
#: The samplers the stages run, in their fixed order.
_STAGE_SAMPLERS = ("penalties", "top_k", "top_p", "min_p", "temperature")
#: ``max_tokens`` and its other names, first given first: llama-server's (which it reads
#: before ``max_tokens``), OpenAI's newer name, OpenAI's older one.  -1 (llama.cpp's "no
#: limit") generates until the context is full.
_MAX_TOKENS_NAMES = ("n_predict", "max_completion_tokens", "max_tokens")
#: Fields only meaningful beside another one (OpenAI refuses them alone).
_NEEDS = (("tool_choice", "tools"), ("parallel_tool_calls", "tools"), ("function_call", "functions"))


#: OpenAI's error ``code`` for a field of the wrong JSON type.
INVALID_TYPE = "invalid_type"
#: OpenAI's error ``code`` for each problem a malformed ``messages`` may have (stage.chat.MESSAGE_PROBLEMS).
MESSAGES_CODES = {"missing": "missing_required_parameter", "empty": "empty_array", "type": INVALID_TYPE,
                  "value": "invalid_value"}


def _range_code(integer: bool, *, below: bool) -> str:
    """OpenAI's error ``code`` for a number out of its field's range."""
    return f"{'integer' if integer else 'decimal'}_{'below_min' if below else 'above_max'}_value"


class BadRequest(Exception):
    """A request the endpoint refuses with HTTP 400 (``param`` names the culprit)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None,
                 fields: Optional[dict] = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code
        self.fields = fields or {}  # members the error object carries beside OpenAI's four


def check_text(body: dict) -> None:
    """Refuse a string anywhere in ``body`` (keys included) that holds an unpaired UTF-16
    surrogate: everything a request carries may become text for the tokenizer, a stop
    string or a template.  One pass of the JSON encoder finds whether there is one (a walk in
    Python took seconds over a large body, holding up the event loop); only then does a walk,
    without recursion, as deep as the body is nested, name it: the error's ``param`` is the
    top-level field."""
    try:
        json.dumps(body, ensure_ascii=False, check_circular=False).encode("utf-8")
        return
    except (UnicodeEncodeError, ValueError):  # a surrogate cannot be encoded (ValueError: walk to be sure)
        pass
    stack: list[tuple[Any, str, Optional[str]]] = [(body, "", None)]
    while stack:
        value, path, field = stack.pop()
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, item in items:
            # The message never quotes the text itself: it could not be encoded either.
            if isinstance(key, str) and SURROGATE.search(key):
                owner = f"'{path}'" if path else "the request body"
                raise BadRequest(f"a key of {owner} is not valid text: it holds an unpaired UTF-16 surrogate", field)
            if isinstance(item, (str, dict, list)):
                where = f"{path}[{key}]" if isinstance(key, int) else f"{path}.{key}" if path else key
                if isinstance(item, str):
                    if not item.isascii() and SURROGATE.search(item):
                        raise BadRequest(f"'{where}' is not valid text: it holds an unpaired UTF-16 surrogate",
                                         field or key)
                else:
                    stack.append((item, where, field or key))


def _given(body: dict, name: str, default=None):
    """The field's value, or ``default`` where it is absent or null (clients that serialise
    every field send ``null`` for those they leave unset)."""
    value = body.get(name)
    return default if value is None else value


def _flag(body: dict, name: str, default: bool, param: Optional[str] = None) -> bool:
    """``body[name]``, a boolean (``param``: how errors name it, default ``name``)."""
    value = _given(body, name, default)
    if not isinstance(value, bool):
        raise BadRequest(f"'{param or name}' must be a boolean", param or name, INVALID_TYPE)
    return value


def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False,
            above: bool = False, whole_floats: bool = False):
    """``body[name]`` checked to lie in [lo, hi] (``above``: in (lo, hi]); with
    ``whole_floats`` an ``integer`` may be written as a whole float (``2.0``, from clients
    that build every number as a float), as llama-server reads it (OpenAI refuses it)."""
    value = _given(body, name)
    if value is None:
        return default
    if integer and whole_floats and isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}", name, INVALID_TYPE)
    low_ok = lo < value if above else lo <= value
    if not low_ok or not value <= hi:
        low, high = (lo, hi) if integer else (f"{lo:g}", f"{hi:g}")
        span = f"above {low} and at most {high}" if above else f"between {low} and {high}"
        raise BadRequest(f"'{name}' must be {span}, got {peer_text(value)}", name,  # (a long one cut: it is echoed)
                         _range_code(integer, below=not low_ok))
    return value


def check_token_ids(ids, n_vocab: int, param: str) -> None:
    if any(not 0 <= t < n_vocab for t in ids):
        raise BadRequest(f"'{param}' token ids must be in [0, {n_vocab})", param)


def check_context(prompt_tokens: int, max_tokens: Optional[int], ctx: int, param: str) -> int:
    """The completion's token budget: ``max_tokens``, or (omitted) the rest of the context;
    BadRequest ``context_length_exceeded`` when the prompt and at least one completion
    token, or the prompt and ``max_tokens``, do not fit ``ctx``."""
    if max_tokens is None:
        if prompt_tokens < ctx:
            return ctx - prompt_tokens
        asked = f"at least {prompt_tokens + 1} tokens ({prompt_tokens} in the prompt, at least 1 in the completion)"
        advice = "the prompt"
    elif prompt_tokens + max_tokens <= ctx:
        return max_tokens
    else:
        asked = (f"{prompt_tokens + max_tokens} tokens ({prompt_tokens} in the prompt, {max_tokens} in the "
                 "completion)")
        advice = "the prompt or max_tokens"
    raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, you requested {asked}. "
                     f"Please reduce the length of {advice}.", param, "context_length_exceeded")


def check_text_fits(text: str, max_token_bytes: int, ctx: int, what: str, param: str) -> None:
    """Refuse (``context_length_exceeded``) a text too long for ``ctx`` tokens before it is
    tokenized: tokenizing takes some 200 bytes of memory per byte of text and holds the
    interpreter, and no token stands for more than ``max_token_bytes`` bytes
    (``Tokenizer.max_token_bytes``)."""
    size = _size_over(text, ctx * max_token_bytes)
    if size is not None:
        raise BadRequest(f"This model's maximum context length is {ctx} tokens. However, {what} is {size} bytes "
                         f"of text, more than {ctx} tokens can hold (at most {max_token_bytes} bytes each). "
                         f"Please reduce the length of {what}.", param, "context_length_exceeded")


def _size_over(text: str, limit: int) -> Optional[str]:
    """The UTF-8 size of ``text`` in words when over ``limit`` bytes, else None; a text of
    more characters than that is over without being encoded (then, unless ASCII, "at least")."""
    if len(text) > limit:
        return str(len(text)) if text.isascii() else f"at least {len(text)}"
    size = len(text.encode("utf-8", "surrogatepass"))
    return str(size) if size > limit else None


def check_tokenize_size(pieces: list) -> None:
    """``/tokenize`` takes at most :data:`MAX_TOKENIZE_BYTES` of text (its memory, above) and
    as many token ids with it."""
    texts = [p for p in pieces if isinstance(p, str)]
    for count, limit, what in ((len(pieces), MAX_TOKENIZE_BYTES, "pieces"), (len(texts), MAX_TOKENIZE_TEXTS, "texts")):
        if count > limit:
            raise BadRequest(f"'content' holds {count} {what}; /tokenize takes at most {limit} (tokenize a long list "
                             "in parts)", "content")
    size = _size_over("".join(texts), MAX_TOKENIZE_BYTES)
    if size is not None:
        raise BadRequest(f"'content' is {size} bytes; /tokenize takes at most {MAX_TOKENIZE_BYTES} (tokenize a long "
                         "text in parts)", "content")


def check_detokenize_count(body: dict) -> dict:
    """``body``, unless its ``tokens`` are more than /detokenize takes: :data:`MAX_TOKENIZE_BYTES`
    ids, what 1 MiB of text becomes at most (counted on the event loop, before it queues: 4
    million ids held the tokenizer 8-17 s)."""
    tokens = body.get("tokens")
    if isinstance(tokens, list) and len(tokens) > MAX_TOKENIZE_BYTES:
        raise BadRequest(f"'tokens' holds {len(tokens)} token ids; /detokenize takes at most {MAX_TOKENIZE_BYTES} "
                         "(detokenize a long list in parts)", "tokens")
    return body


def check_answer_size(response):
    """``response`` (a rendered answer), unless it takes more than a request body may,
    :data:`.http_front.MAX_BODY_BYTES`: a client that does not read it holds it meanwhile
    (``/tokenize``'s pieces of 1 MiB of text took 25 MB)."""
    size = len(response.body)
    if size > MAX_BODY_BYTES:
        raise BadRequest(f"the answer would take {size} bytes, more than {MAX_BODY_BYTES}: ask for less at once")
    return response


def suppress_end_of_generation(sampling: SamplingParams, eog_ids: tuple[int, ...]) -> None:
    """``ignore_eos`` as llama-server applies it (:meth:`.SamplingParams.ban_end_of_generation`),
    within the wire's logit-bias entries."""
    sampling.ban_end_of_generation(eog_ids)
    if len(sampling.logit_bias) > MAX_STAGE_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' may hold at most {MAX_STAGE_LOGIT_BIAS - len(eog_ids)} tokens beside "
                         "'ignore_eos'", "logit_bias")


@dataclass
class Options:
    max_tokens: Optional[int]
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool
    n: int = 1  # choices per prompt
    samplers: tuple = LLAMA_DEFAULT_SAMPLERS  # llama-server's ``samplers``, as asked (reported back)
    bias_texts: list = field(default_factory=list)  # ``logit_bias`` texts, [(text, bias)], to tokenize
    # temperature, top_k, top_p, min_p and repeat_last_n as asked (what runs may differ): reported back
    asked: dict = field(default_factory=dict)
    timings_per_token: bool = False  # llama-server's: each streamed event carries the timings so far
    # llama-server's ends of a text, off at 0 or below: at a line indented by fewer spaces and
    # tabs (after the first), and at a new line once this many ms have passed since the first token
    n_indent: int = 0
    t_max_predict_ms: int = 0


def _check_unsupported(body: dict, chat: bool, samplers: tuple) -> None:
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadRequest("'model' must be a string", "model", INVALID_TYPE)
    user = body.get("user")  # OpenAI's end-user id, for its abuse monitoring: read, not used
    if user is not None and not isinstance(user, str):
        raise BadRequest("'user' must be a string", "user", INVALID_TYPE)
    # best_of ranks its candidates by log probability, which no stage returns; best_of n
    # returns them all, as n does.
    if _number(body, "best_of", 1, -(2**63), 2**63, integer=True) not in (1, _given(body, "n", 1)):
        raise BadRequest("'best_of' other than 1 (or 'n') is not supported", "best_of")
    # Chat's logprobs is a boolean (false asks for nothing); a completion's is a count, and
    # 0 still asks for the sampled token's log probability, which no stage returns.
    # (first: top_logprobs beside it is refused as part of it)
    harmless = {"logprobs": (False,) if chat else (), **_HARMLESS}
    for name, values in harmless.items():
        value = body.get(name)
        if value is not None and not any(type(value) is type(h) and value == h for h in values):
            raise BadRequest(f"'{name}' is not supported", name)
    for name, (off, sampler) in _LLAMA_OFF.items():
        value = body.get(name)
        if value is not None and not off(value, body) and (sampler is None or sampler in samplers):
            raise BadRequest(f"'{name}' is not supported", name)
    for name, needs in _NEEDS:
        if body.get(name) is not None and not _given(body, needs):
            raise BadRequest(f"'{name}' is only allowed when '{needs}' are specified", name)
    response_format = body.get("response_format")
    if response_format is not None and not isinstance(response_format, dict):
        raise BadRequest("'response_format' must be an object", "response_format", INVALID_TYPE)
    if response_format is not None and response_format != {"type": "text"}:
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")


def _llama_samplers(body: dict) -> tuple:
    """The names of the samplers llama-server's ``samplers`` asks for, in its order (names
    read exactly, or a letter each; others are skipped, as there), or its default chain."""
    given = body.get("samplers")
    if given is None:
        return LLAMA_DEFAULT_SAMPLERS
    if isinstance(given, str):
        names = [_LLAMA_SAMPLER_LETTERS.get(letter) for letter in given]
    elif isinstance(given, list) and all(isinstance(name, str) for name in given):
        names = [name if name in _LLAMA_SAMPLER_LETTERS.values() else None for name in given]
    else:
        raise BadRequest("'samplers' must be a list of sampler names or a string of their letters", "samplers",
                         INVALID_TYPE)
    return tuple(name for name in names if name is not None)


def _stage_samplers(samplers: tuple) -> frozenset:
    """The stages' samplers among llama-server's ``samplers``; a 400 for an order of them
    other than theirs, which they cannot run."""
    kept = [name for name in samplers if name in _STAGE_SAMPLERS]
    if kept != sorted(set(kept), key=_STAGE_SAMPLERS.index):
        raise BadRequest(f"'samplers' may keep {', '.join(_STAGE_SAMPLERS)} only in that order, once each (the "
                         "stages' fixed order)", "samplers")
    return frozenset(kept)


def _logit_bias(body: dict) -> tuple[dict[int, float], list[tuple[str, float]]]:
    """OpenAI's object of token id -> bias, or llama-server's list of [token id, bias]
    pairs; a bias of ``false`` (llama-server's) bans the token.  As llama-server, a key (or
    a pair's first item) that is a text biases each of its tokens: those texts come back
    beside the ids, for :func:`add_text_biases` to tokenize."""
    bias = _given(body, "logit_bias", {})
    if isinstance(bias, (list, dict)) and len(bias) > MAX_STAGE_LOGIT_BIAS:  # the wire's sampling block carries no more
        raise BadRequest(f"'logit_bias' may hold at most {MAX_STAGE_LOGIT_BIAS} tokens", "logit_bias")
    if isinstance(bias, list):
        if not all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], (int, str))
                   and not isinstance(pair[0], bool) for pair in bias):
            raise BadRequest("'logit_bias' as a list must hold [token id or text, bias] pairs", "logit_bias")
        # (key, whether it is a token id): a text, "7042" too, is one llama-server tokenizes, not the token 7042
        entries = [((str(token), value), isinstance(token, int)) for token, value in bias]
    elif isinstance(bias, dict):
        entries = [((key, value), bool(_TOKEN_ID_KEY.fullmatch(key))) for key, value in bias.items()]
    else:
        raise BadRequest("'logit_bias' must be an object of token id -> bias", "logit_bias", INVALID_TYPE)
    ids: dict[int, float] = {}
    texts: list[tuple[str, float]] = []
    for (key, value), is_id in entries:
        if value is False:
            value = -math.inf
        elif isinstance(value, bool) or not isinstance(value, (int, float)):
            raise BadRequest("'logit_bias' must map token ids to numbers", "logit_bias")
        elif not -100 <= value <= 100:
            raise BadRequest("'logit_bias' values must be between -100 and 100", "logit_bias")
        if is_id:
            token = int(key)
            if not 0 <= token < 2**32:
                raise BadRequest("'logit_bias' keys that are numbers must be token ids", "logit_bias")
            ids[token] = ids.get(token, 0.0) + value  # a token given twice: both, as llama.cpp adds them
        else:
            texts.append((key, float(value)))
    return ids, texts


def add_text_biases(options: Options, tokenizer) -> None:
    """``options``' ``logit_bias`` texts (:func:`_logit_bias`) added to its sampling's
    biases, each on every token the text encodes to, as llama-server tokenizes them (no
    BOS, control tokens spelled out): a token met again gets the bias again.  Texts longer
    than 256 tokens could be are refused unread, as are more tokens than the wire carries."""
    most = MAX_STAGE_LOGIT_BIAS * max(1, tokenizer.max_token_bytes)
    if sum(len(text) for text, _ in options.bias_texts) > most:
        raise BadRequest(f"'logit_bias' texts may hold at most {most} characters together (more would be more than "
                         f"{MAX_STAGE_LOGIT_BIAS} tokens)", "logit_bias")
    biases = dict(options.sampling.logit_bias)
    for text, bias in options.bias_texts:
        for token in tokenizer.encode(text, add_bos=False, parse_special=False):
            biases[token] = biases.get(token, 0.0) + bias
    if len(biases) > MAX_STAGE_LOGIT_BIAS:
        raise BadRequest(f"'logit_bias' may hold at most {MAX_STAGE_LOGIT_BIAS} tokens (its texts' tokens counted)",
                         "logit_bias")
    options.sampling.logit_bias = biases


def _stream(body: dict) -> tuple[bool, bool]:
    """``stream`` and ``stream_options.include_usage``."""
    stream = _flag(body, "stream", False)
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise BadRequest("'stream_options' is only allowed when 'stream' is true", "stream_options")
    if not isinstance(options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options", INVALID_TYPE)
    return stream, _flag(options, "include_usage", False, "stream_options.include_usage")


def parse_options(body: dict, *, chat: bool = False, native: bool = False, server: Optional[dict] = None) -> Options:
    """The generation options of a request body (``chat``: /v1/chat/completions; ``native``:
    llama-server's /completion, with llama.cpp's sampling defaults and its temperatures:
    any, a negative one greedy; ``server``: the sampling defaults the server was given, which
    replace the route's, as llama-server's options do); BadRequest for a field out of range,
    of the wrong type, or asking for what the stages cannot do."""
    samplers = _llama_samplers(body)
    _check_unsupported(body, chat, samplers)
    defaults = {**(LLAMA_SAMPLING if native else OPENAI_SAMPLING), **SHARED_SAMPLING, **(server or {})}
    hottest = MAX_NATIVE_TEMPERATURE if native else MAX_OPENAI_TEMPERATURE
    name = next((n for n in _MAX_TOKENS_NAMES if body.get(n) is not None), "max_tokens")

    def count(field: str, default, lo: int, hi: int):  # an integer field, as this route reads one
        return _number(body, field, default, lo, hi, integer=True, whole_floats=native)

    max_tokens = count(name, None, UNTIL_FULL, 2**31 - 1)
    if max_tokens == 0 and not native:  # llama-server's 0 evaluates the prompt and generates nothing
        raise BadRequest(f"'{name}' must be at least 1 (or -1: until the context is full), got 0", name,
                         _range_code(True, below=True))
    if max_tokens == UNTIL_FULL:
        max_tokens = None
    ignore_eos = _flag(body, "ignore_eos", defaults["ignore_eos"])
    stop, most_stops = body.get("stop"), MAX_NATIVE_STOP_STRINGS if native else MAX_STOP_STRINGS
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    else:
        strings = isinstance(stop, list) and all(isinstance(s, str) for s in stop)
        if not strings or len(stop) > most_stops:
            raise BadRequest(f"'stop' must be a string or a list of at most {most_stops} strings", "stop",
                             None if strings else INVALID_TYPE)
    if any(len(s) > MAX_STOP_CHARS for s in stop):
        raise BadRequest(f"'stop' strings may be at most {MAX_STOP_CHARS} characters long", "stop")
    if sum(map(len, stop)) > MAX_STOP_STRINGS * MAX_STOP_CHARS:
        raise BadRequest(f"'stop' strings may hold at most {MAX_STOP_STRINGS * MAX_STOP_CHARS} characters together",
                         "stop")
    seed = count("seed", defaults["seed"], -(2**63), 2**64 - 1) % SEED_RANGE
    if seed == LLAMA_DEFAULT_SEED:
        seed = None
    kept = _stage_samplers(samplers)

    asked = {"temperature": _number(body, "temperature", defaults["temperature"], -hottest if native else 0.0, hottest),
             "top_p": _number(body, "top_p", defaults["top_p"], 0.0, 1.0),
             "top_k": count("top_k", defaults["top_k"], -(2**31), 2**31 - 1),
             "min_p": _number(body, "min_p", defaults["min_p"], 0.0, 1.0),
             "repeat_last_n": count("repeat_last_n", defaults["repeat_last_n"], -1, 2**31 - 1)}

    def unless_left_out(sampler: str, value, off):  # as it runs left out: temperature 1 (the draw alone), no cut
        return value if sampler in kept else off

    bias_ids, bias_texts = _logit_bias(body)
    sampling = SamplingParams(
        temperature=unless_left_out("temperature", max(0.0, asked["temperature"]), 1.0),
        top_p=unless_left_out("top_p", asked["top_p"], 1.0),
        top_k=unless_left_out("top_k", asked["top_k"], 0),
        min_p=unless_left_out("min_p", asked["min_p"], 0.0),
        seed=seed,
        presence_penalty=_number(body, "presence_penalty", defaults["presence_penalty"], -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", defaults["frequency_penalty"], -2.0, 2.0),
        # the wire reads 0 as unset (1): a 0 asked for would silently mean no penalty
        repeat_penalty=_number(body, "repeat_penalty", defaults["repeat_penalty"], 0.0, MAX_REPEAT_PENALTY, above=True),
        # llama-server's window of the three penalties: -1 the whole context, 0 none
        repeat_last_n=unless_left_out("penalties", asked["repeat_last_n"], 0),
        logit_bias=bias_ids, ignore_eos=ignore_eos)
    stream, include_usage = _stream(body)
    # llama-server's /completion names the choices n_cmpl, and reads n when it is absent
    n = count("n_cmpl" if native and body.get("n_cmpl") is not None else "n", 1, 1, MAX_PROMPTS)
    return Options(max_tokens, sampling, stop, stream, include_usage, n, samplers, bias_texts, asked,
                   _flag(body, "timings_per_token", False), count("n_indent", 0, -(2**31), 2**31 - 1),
                   count("t_max_predict_ms", 0, -(2**63), 2**63 - 1))


def parse_template_options(body: dict) -> tuple[bool, dict]:
    """llama-server's chat rendering fields: ``add_generation_prompt`` (default true: the
    prompt ends where the assistant's answer starts) and ``chat_template_kwargs``, an object
    of more names the template sees (e.g. ``enable_thinking``), set last as llama-server sets
    them (so they may replace ``add_generation_prompt`` too)."""
    extra = _given(body, "chat_template_kwargs", {})
    if not isinstance(extra, dict):
        raise BadRequest("'chat_template_kwargs' must be an object", "chat_template_kwargs", INVALID_TYPE)
    if MESSAGES in extra:  # the request's own field, checked as such
        raise BadRequest(f"'chat_template_kwargs' may not set {MESSAGES!r}", "chat_template_kwargs")
    return _flag(body, "add_generation_prompt", True), extra


def parse_tokenize(body: dict) -> tuple[list, bool, bool, bool]:
    """llama-server's ``/tokenize`` body: ``content`` (absent: no text, as llama-server takes
    it), a text or a list of texts and token ids, as its ``tokenize_mixed`` reads it; then
    ``add_special`` (default false), ``parse_special`` (default true) and ``with_pieces``
    (default false).  A text over :data:`MAX_TOKENIZE_BYTES` is refused here, before the
    request queues for the tokenizer (behind a long prompt, say)."""
    content = _given(body, "content", "")
    pieces = [content] if isinstance(content, str) else content
    if not (isinstance(pieces, list) and all(isinstance(p, (str, int)) and not isinstance(p, bool) for p in pieces)):
        raise BadRequest("'content' must be a string or a list of texts and token ids", "content", INVALID_TYPE)
    check_tokenize_size(pieces)
    return (pieces, _flag(body, "add_special", False), _flag(body, "parse_special", True),
            _flag(body, "with_pieces", False))


def tokenize_content(tokenizer, pieces: list, add_special: bool, parse_special: bool) -> list[int]:
    """``/tokenize``'s tokens of ``pieces`` (:func:`parse_tokenize`), as llama-server's
    ``tokenize_mixed``: token ids as given (within the vocabulary), each text tokenized in place,
    ``add_special`` adding the special tokens the model asks for (BOS where it adds one) only
    before a text that opens the content."""
    check_token_ids([p for p in pieces if not isinstance(p, str)], tokenizer.n_vocab, "content")
    return [token for i, piece in enumerate(pieces) for token in (
        tokenizer.encode(piece, add_bos=None if add_special and i == 0 else False, parse_special=parse_special)
        if isinstance(piece, str) else [piece])]


def parse_detokenize(body: dict, tokenizer) -> list[int]:
    """llama-server's ``/detokenize`` body: ``tokens``, a list of token ids of ``tokenizer``'s
    vocabulary that stand for at most :data:`MAX_TOKENIZE_BYTES` of text (counted before the
    text is made)."""
    tokens = _given(body, "tokens", [])
    if not (isinstance(tokens, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in tokens)):
        raise BadRequest("'tokens' must be a list of token ids", "tokens", INVALID_TYPE)
    check_token_ids(tokens, tokenizer.n_vocab, "tokens")
    size = tokenizer.text_bytes(tokens)
    if size > MAX_TOKENIZE_BYTES:
        raise BadRequest(f"'tokens' stand for {size} bytes of text; /detokenize gives at most {MAX_TOKENIZE_BYTES} "
                         "(detokenize a long list in parts)", "tokens")
    return tokens


__all__ = ["BadRequest", "INVALID_TYPE", "MESSAGES_CODES", "Options", "parse_options", "parse_template_options",
           "parse_tokenize", "tokenize_content",
           "parse_detokenize", "check_text", "check_token_ids", "check_context",
           "check_detokenize_count", "check_answer_size",
           "suppress_end_of_generation", "add_text_biases", "UNTIL_FULL",
           "MAX_STOP_STRINGS", "MAX_NATIVE_STOP_STRINGS", "MAX_STOP_CHARS", "MAX_PROMPTS"]
