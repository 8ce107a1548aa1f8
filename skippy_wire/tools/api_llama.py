"""llama-server's own ``POST /completion``: the generations of ``/v1/completions``, answered
in llama-server's native shape rather than OpenAI's, for the clients written against it.

A response is one object per prompt (a list of them for a batch of prompts): ``content``,
``stop: true``, ``tokens_predicted`` / ``tokens_evaluated``, ``stop_type`` (``eos``,
``word`` with the ``stopping_word``, or ``limit``), ``generation_settings`` and
``timings``.  With ``stream: true`` every piece of text is an event ``{"content": ...,
"stop": false}`` and each generation ends with its final object (its ``content`` empty:
the text has been streamed); no ``[DONE]`` follows.  ``return_tokens: true`` also gives
the token ids.  The stages keep no prompt cache, so ``tokens_cached`` is 0.
"""

from __future__ import annotations

from .api_job import GenerationJob
from .http_front import sse


class LlamaCompletionJob(GenerationJob):
    """A :class:`GenerationJob` answered as llama-server's ``/completion``; ``body`` is the
    request's JSON body (for ``return_tokens`` and the settings it echoes)."""

    def __init__(self, api, prompts: list[list[int]], max_tokens: list[int], options, body: dict) -> None:
        super().__init__(api, prompts, max_tokens, options, chat=False)
        self.return_tokens = body.get("return_tokens") is True
        self.predicted = [0] * len(prompts)  # tokens streamed so far, per generation

    def final_object(self, results: list):
        finals = [self._final(index, result, streamed=False) for index, result in enumerate(results)]
        return finals[0] if len(finals) == 1 else finals

    def _final(self, index: int, result, *, streamed: bool) -> dict:
        sampling = self.options.sampling
        return {
            "index": index,
            "content": "" if streamed else result.text,
            "tokens": list(result.tokens) if self.return_tokens and not streamed else [],
            "stop": True,
            "model": self.api.model_id,
            "tokens_predicted": result.completion_tokens,
            "tokens_evaluated": result.prompt_tokens,
            "generation_settings": {
                "n_predict": self.max_tokens[index], "seed": sampling.seed, "temperature": sampling.temperature,
                "top_k": sampling.top_k, "top_p": sampling.top_p, "min_p": sampling.min_p,
                "repeat_penalty": sampling.repeat_penalty, "presence_penalty": sampling.presence_penalty,
                "frequency_penalty": sampling.frequency_penalty, "ignore_eos": sampling.ignore_eos,
                "stop": self.options.stop, "stream": self.options.stream},
            "prompt": self.api.engine.tokenizer.decode(self.prompts[index]),
            "has_new_line": "\n" in result.text,
            "truncated": False,
            "stop_type": result.stop_type,
            "stopping_word": result.stopping_word,
            "tokens_cached": 0,
            "timings": _timings(result),
        }

    def _opening_events(self) -> list[str]:
        return []

    def _text_event(self, index: int, text: str, tokens: list[int]) -> str:
        self.predicted[index] += len(tokens)
        return sse({"index": index, "content": text, "tokens": tokens if self.return_tokens else [],
                    "stop": False, "tokens_predicted": self.predicted[index],
                    "tokens_evaluated": len(self.prompts[index])})

    def _end_event(self, index: int, result) -> str:
        return sse(self._final(index, result, streamed=True))

    def _closing_events(self, results: list) -> list[str]:
        return []


def _timings(result) -> dict:
    """llama-server's ``timings``: the prompt until the first token, the rest after it."""
    prompt_ms = (result.first_token_s or 0.0) * 1000.0
    predicted_ms = max(0.0, result.elapsed_s * 1000.0 - prompt_ms)
    predicted_n = result.completion_tokens

    def per(n: int, ms: float) -> tuple[float, float]:
        return (ms / n if n else 0.0), (1000.0 * n / ms if ms > 0 else 0.0)

    prompt_per_token, prompt_per_second = per(result.prompt_tokens, prompt_ms)
    predicted_per_token, predicted_per_second = per(predicted_n, predicted_ms)
    return {"cache_n": 0,
            "prompt_n": result.prompt_tokens, "prompt_ms": prompt_ms, "prompt_per_token_ms": prompt_per_token,
            "prompt_per_second": prompt_per_second,
            "predicted_n": predicted_n, "predicted_ms": predicted_ms, "predicted_per_token_ms": predicted_per_token,
            "predicted_per_second": predicted_per_second}


__all__ = ["LlamaCompletionJob"]
