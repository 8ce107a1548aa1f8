"""llama-server's own ``POST /completion``: the generations of ``/v1/completions``, answered
in llama-server's native shape rather than OpenAI's, for the clients written against it.

A response is one object per prompt (a list of them for a batch of prompts): ``content``,
``stop: true``, ``tokens_predicted`` / ``tokens_evaluated``, ``stop_type`` (``eos``,
``word`` with the ``stopping_word``, or ``limit``), ``generation_settings`` and
``timings``; ``response_fields`` picks some of them (``"timings/prompt_n"`` reaches
inside).  With ``stream: true`` every piece of text is an event ``{"content": ...,
"tokens": [...], "stop": false}`` and each generation ends with its final object (its
``content`` empty: the text has been streamed); no ``[DONE]`` follows.  ``return_tokens:
true`` gives the final object the token ids too.  The stages keep no prompt cache, so
``tokens_cached`` is 0, and no slots: ``id_slot`` is -1 ("any", as a request names it).
"""

from __future__ import annotations

from .api_job import GenerationJob, llama_timings
from ..net.service import WHOLE_HISTORY
from .api_params import BadRequest, Options
from .error_shapes import llama_error
from .llama_sampling import LLAMA_DEFAULT_SEED
from .options import UNTIL_FULL
from .http_events import sse

#: The ``id_slot`` of every answer: the stages hold sessions, not llama-server's slots, and
#: -1 is what a request gives for "any slot".
ANY_SLOT = -1


class LlamaCompletionJob(GenerationJob):
    """A :class:`GenerationJob` answered as llama-server's ``/completion``; ``body`` is the
    request's JSON body (for ``return_tokens`` and ``response_fields``)."""

    def __init__(self, api, prompts: list[list[int]], max_tokens: list[int], options, body: dict) -> None:
        super().__init__(api, prompts, max_tokens, options, chat=False)
        self.return_tokens = body.get("return_tokens") is True
        fields = body.get("response_fields")
        self.response_fields = fields if isinstance(fields, list) and all(isinstance(f, str) for f in fields) \
            else None

    def error_event(self, status: int, answer: dict) -> str:
        return sse(llama_error(status, answer))  # llama-server's shape, as its answers' errors

    def final_object(self, results: list):
        finals = [self._picked(self._final(index, result, streamed=False)) for index, result in enumerate(results)]
        return finals[0] if len(finals) == 1 else finals

    def _picked(self, final: dict) -> dict:
        """``response_fields``, as llama-server reads them: each a key, or a path of keys
        joined by "/", named as given; a path that leads nowhere is left out."""
        if not self.response_fields:  # none, or an empty list: the whole object, as llama-server
            return final
        picked = {}
        for path in self.response_fields:
            value = final
            for key in path.split("/"):
                value = value.get(key, _MISSING) if isinstance(value, dict) else _MISSING
            if value is not _MISSING:
                picked[path] = value
        return picked

    def _final(self, index: int, result, *, streamed: bool) -> dict:
        return {
            "index": index,
            "content": "" if streamed else result.text,
            "tokens": list(result.tokens) if self.return_tokens and not streamed else [],
            "id_slot": ANY_SLOT,
            "stop": True,
            "model": self.api.model_id,
            "tokens_predicted": result.completion_tokens,
            "tokens_evaluated": result.prompt_tokens,
            "generation_settings": generation_settings(self.options, self.api.engine.ctx_size),
            "prompt": self.api.engine.tokenizer.decode(self.prompts[index]),
            "has_new_line": "\n" in result.text,
            "truncated": self._ran_out_of_context(index, result),
            "stop_type": result.stop_type,
            "stopping_word": result.stopping_word,
            "tokens_cached": 0,
            "timings": llama_timings(result),
        }

    def _ran_out_of_context(self, index: int, result) -> bool:
        """llama-server's ``truncated``: the generation stopped at the context's end, before
        ``n_predict`` (its limit was the context's room, not the one asked for, and it was
        reached: not an ``n_indent`` or ``t_max_predict_ms`` end)."""
        asked, room = self.options.max_tokens, self.max_tokens[index]
        return result.stop_type == "limit" and (asked is None or asked > room) and result.completion_tokens >= room

    def _opening_events(self) -> list[str]:
        return []

    def _text_event(self, index: int, text: str, tokens: list[int]) -> str:
        timings = self._show(index, tokens)
        return sse({"index": index, "content": text, "tokens": tokens, "stop": False, "id_slot": ANY_SLOT,
                    "tokens_predicted": self.shown[index].completion_tokens,
                    "tokens_evaluated": len(self.prompts[index]), **({"timings": timings} if timings else {})})

    def _end_event(self, index: int, result) -> str:
        return sse(self._picked(self._final(index, result, streamed=True)))

    def _closing_events(self, results: list) -> list[str]:
        return []


_MISSING = object()


def generation_settings(options: Options, ctx: int) -> dict:
    """A request's settings as llama-server reports them (its ``generation_settings``; a
    body's defaults are /props' ``default_generation_settings.params``), under a context of
    ``ctx`` tokens."""
    sampling = options.sampling
    return {"n_predict": UNTIL_FULL if options.max_tokens is None else options.max_tokens,
            "seed": LLAMA_DEFAULT_SEED if sampling.seed is None else sampling.seed,
            # temperature, top_k, top_p, min_p, repeat_last_n as asked, as llama-server reports them
            # (what runs may differ: a sampler left out, top_p 0 as top_k 1, a negative temperature as 0)
            **options.asked,
            # llama-server reads a window of -1 as its context's size, and reports that
            **({"repeat_last_n": ctx} if options.asked.get("repeat_last_n") == WHOLE_HISTORY else {}),
            "repeat_penalty": sampling.repeat_penalty, "presence_penalty": sampling.presence_penalty,
            "frequency_penalty": sampling.frequency_penalty,
            "ignore_eos": sampling.ignore_eos, "stop": options.stop, "stream": options.stream,
            "samplers": list(options.samplers)}


def check_llama_context(prompt_tokens: int, ctx: int) -> None:
    """llama-server's refusal of a prompt that leaves the context no room for a token, in its
    words, its error object carrying ``n_prompt_tokens`` and ``n_ctx`` (clients read them to
    shorten their history)."""
    if prompt_tokens >= ctx:
        raise BadRequest(f"request ({prompt_tokens} tokens) exceeds the available context size ({ctx} tokens), "
                         "try increasing it", "prompt", "context_length_exceeded",
                         fields={"n_prompt_tokens": prompt_tokens, "n_ctx": ctx})


def llama_piece(data: bytes) -> str | list[int]:
    """A token's piece as llama-server's ``/tokenize`` gives it: its text, or the byte values
    of one that is part of a character."""
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return list(data)


__all__ = ["LlamaCompletionJob", "check_llama_context", "generation_settings",
           "llama_piece"]
