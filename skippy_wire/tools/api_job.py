"""One admitted request of ``skippy-wire api``: its generations on a worker thread, answered
as one OpenAI response object or streamed as server-sent events.

A completion request may carry several prompts (``prompt`` as a list of them, as OpenAI
takes a batch), and any request ``n`` choices of each, each a choice of its own ``index``
(prompt by prompt, ``n`` for each).  The generations run side by side on the lanes that are
idle when the request starts (its own, and those it borrows while no other request waits:
:meth:`.Admission.borrow`), each lane taking the next generation when it is done; a borrowed
lane goes back instead once another request waits, so a large batch cannot keep them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time
import uuid
from typing import Any, Callable, Optional

from starlette.requests import Request

from ..errors import PipelineError
from ..net.service import Generation
from .api_params import Options
from .error_shapes import error_object
from .http_events import sse
from .llama_sampling import SEED_RANGE

#: Seconds between checks that the client of a waiting request (queued, or generating
#: without a stream) is still connected.
DISCONNECT_POLL_S = 0.25


class GenerationJob:
    """One admitted request: ``prompts`` (one for chat) with each one's ``max_tokens``; runs
    on ``api``'s workers and gives its lane back to ``api.admission`` when done."""

    def __init__(self, api, prompts: list[list[int]], max_tokens: list[int], options: Options, chat: bool) -> None:
        self.api, self.prompts, self.max_tokens, self.options, self.chat = api, prompts, max_tokens, options, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.cancel = threading.Event()
        # when each generation began, and what of it a stream has shown (timings_per_token)
        self.began = [0.0] * len(prompts)
        self.shown = [Generation(prompt_tokens=len(prompt)) for prompt in prompts]

    def _start(self, on_text: Callable[[int, str, list[int]], None],
               on_done: Callable[[int, Any], None]) -> asyncio.Future:
        """Run the generations on workers (``on_text(index, text, tokens)`` as text comes,
        ``on_done(index, result)`` as each ends): one per lane, the request's own and those
        it could borrow; each lane is given back when its worker is done (after a cancelled
        session was stopped on every stage), whatever the client does.  The future gives
        every result in order, or the first failure."""
        engine, o = self.api.engine, self.options
        count = len(self.prompts)
        results: list = [None] * count
        indices, take, failed = iter(range(count)), threading.Lock(), threading.Event()

        def generate_some(borrowed: bool) -> None:
            while True:
                if borrowed and self.api.admission.waiting:  # the lane goes back to a request in line
                    return
                with take:  # the next generation not yet taken, none after a failure
                    index = None if failed.is_set() else next(indices, None)
                if index is None:
                    return
                self.began[index] = time.perf_counter()
                try:
                    results[index] = engine.generate(
                        self.prompts[index], max_tokens=self.max_tokens[index], sampling=self._sampling(index),
                        stop=o.stop, on_text=lambda text, tokens, i=index: on_text(i, text, tokens),
                        cancelled=self.cancel, min_indent=o.n_indent, line_time_limit_s=o.t_max_predict_ms / 1000)
                except BaseException:
                    failed.set()
                    raise
                on_done(index, results[index])

        loop = asyncio.get_running_loop()
        borrowed = self.api.admission.borrow(count - 1)
        lanes = [loop.run_in_executor(self.api.workers, generate_some, lane > 0) for lane in range(1 + borrowed)]
        for lane, give_back in zip(lanes, [self.api.admission.release] + [self.api.admission.give_back] * borrowed):
            lane.add_done_callback(lambda future, give_back=give_back: self._lane_done(future, give_back))

        async def all_results() -> list:
            await asyncio.wait(lanes)  # which, unlike gather, never cancels a lane still generating
            for lane in lanes:
                lane.result()  # the first failure, if any
            return results

        every = asyncio.ensure_future(all_results())
        every.add_done_callback(lambda task: task.cancelled() or task.exception())  # read: a gone client's Cancelled
        return every

    def _sampling(self, index: int):
        """The sampling of choice ``index``: a request's seed seeds its first choice of each
        prompt, the next seed the second, and so on (one seed, ``n`` different samples).  Past
        2^32 - 1 the seeds go on from 1: seed 0 draws as 2^32 - 1 does (the backend's)."""
        sampling, choice = self.options.sampling, index % self.options.n
        if choice == 0 or sampling.seed is None:  # no seed: each generation draws its own
            return sampling
        return dataclasses.replace(sampling, seed=(sampling.seed + choice - 1) % (SEED_RANGE - 1) + 1)

    @staticmethod
    def _lane_done(future: asyncio.Future, give_back: Callable[[], None]) -> None:
        give_back()
        if not future.cancelled():
            future.exception()  # retrieved: a cancelled stream's error is nobody's to report

    async def run(self, request: Request) -> list:
        """Every prompt's result, in order; a client that leaves cancels the generation."""
        future = self._start(lambda index, text, tokens: None, lambda index, result: None)
        try:
            while True:
                done, _ = await asyncio.wait({future}, timeout=DISCONNECT_POLL_S)
                if done:
                    return future.result()
                if await request.is_disconnected():
                    self.cancel.set()
        finally:
            self.cancel.set()  # no effect once done; else (awaiting cancelled) the generation stops

    def _usage(self, results: list) -> dict:
        """Every generation's completion tokens, and each prompt's tokens once however many
        choices it has (as OpenAI counts them)."""
        prompt = sum(r.prompt_tokens for r in results[::self.options.n])
        completion = sum(r.completion_tokens for r in results)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        envelope = {"id": self.id, "object": kind, "created": self.created, "model": self.api.model_id,
                    "system_fingerprint": self.api.fingerprint, "choices": choices}
        if chunk and self.options.include_usage:
            envelope["usage"] = None  # OpenAI: every chunk but the last then has a null usage
        return envelope

    def final_object(self, results: list) -> dict:
        if self.chat:
            choices = [{"index": i, "message": {"role": "assistant", "content": r.text, "refusal": None},
                        "logprobs": None,
                        "finish_reason": r.finish_reason} for i, r in enumerate(results)]
        else:
            choices = [{"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason}
                       for i, r in enumerate(results)]
        answer = {**self._envelope(choices, chunk=False), "usage": self._usage(results)}
        if len(results) == 1:  # llama-server's extension, which its web UI reads tokens/s from
            answer["timings"] = llama_timings(results[0])
        return answer

    def _chunk(self, index: int, text: Optional[str], finish_reason: Optional[str], *, first: bool = False,
               timings: Optional[dict] = None) -> str:
        if self.chat:
            delta: dict[str, Any] = {"role": "assistant", "refusal": None} if first else {}
            if text is not None:
                delta["content"] = text
            choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        envelope = self._envelope([choice], chunk=True)
        return sse(envelope if timings is None else {**envelope, "timings": timings})

    # -- the events of a stream, in order: the opening ones, one per piece of text and one
    # -- as each generation ends, the closing ones

    def _opening_events(self) -> list[str]:
        return [self._chunk(index, "", None, first=True) for index in range(len(self.prompts))] if self.chat else []

    def _text_event(self, index: int, text: str, tokens: list[int]) -> str:
        return self._chunk(index, text, None, timings=self._show(index, tokens))

    def _show(self, index: int, tokens: list[int]) -> Optional[dict]:
        """Counts ``tokens`` as streamed by generation ``index``; its ``timings`` so far when the
        request asked for them (llama-server's ``timings_per_token``; its first text stands for
        its first token)."""
        shown, now = self.shown[index], time.perf_counter() - self.began[index]
        if shown.first_token_s is None:
            shown.first_token_s = now
        shown.completion_tokens, shown.elapsed_s = shown.completion_tokens + len(tokens), now
        return llama_timings(shown) if self.options.timings_per_token else None

    def _end_event(self, index: int, result) -> str:
        return self._chunk(index, None if self.chat else "", result.finish_reason,
                           timings=llama_timings(result) if len(self.prompts) == 1 else None)

    def _closing_events(self, results: list) -> list[str]:
        usage = [sse({**self._envelope([], chunk=True), "usage": self._usage(results)})] \
            if self.options.include_usage else []
        return usage + ["data: [DONE]\n\n"]

    async def opened(self, request: Request):
        """The stream's events, once its generations have given their first piece: a request
        that fails before then (the pipeline down, say) is answered with an error status, as
        OpenAI and llama-server answer it, not a 200 whose body is an error.  Raises that
        failure, or Cancelled when the client left meanwhile."""
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()  # (index, text, tokens) or (index, result), then None
        future = self._start(lambda *piece: loop.call_soon_threadsafe(pieces.put_nowait, piece),
                             lambda *ended: loop.call_soon_threadsafe(pieces.put_nowait, ended))
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, None))
        first = asyncio.ensure_future(pieces.get())
        try:
            while not (await asyncio.wait({first}, timeout=DISCONNECT_POLL_S))[0]:
                if await request.is_disconnected():
                    self.cancel.set()  # the generation ends, Cancelled
            if first.result() is None:
                future.result()  # its failure, raised before any event
        except BaseException:
            first.cancel()  # (the server stopping while it waited)
            self.cancel.set()
            raise
        return self._events(first.result(), pieces, future)

    async def _events(self, piece, pieces: asyncio.Queue, future: asyncio.Future):
        try:
            for event in self._opening_events():
                yield event
            while piece is not None:
                yield self._text_event(*piece) if len(piece) == 3 else self._end_event(*piece)
                piece = await pieces.get()
            try:
                results = future.result()
            except PipelineError as exc:  # after the first piece: the stream says so as its last event
                yield self.error_event(502, error_object(f"the pipeline failed: {exc}", type_="server_error"))
                return
            for event in self._closing_events(results):
                yield event
        finally:
            # A client that went away cancels the generation between two tokens.
            self.cancel.set()

    def error_event(self, status: int, answer: dict) -> str:
        """An error in the stream, as the error object of an answer with ``status`` (its route's shape)."""
        return sse(answer)

    def abandon(self) -> None:
        """The response has ended: a generation still running stops at its next token (its
        lane goes back from its worker)."""
        self.cancel.set()


def llama_timings(result) -> dict:
    """llama-server's ``timings`` of one generation: the prompt until the first token, the
    rest after it (all of it without a token: ``n_predict: 0``)."""
    prompt_ms = (result.elapsed_s if result.first_token_s is None else result.first_token_s) * 1000.0
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


__all__ = ["DISCONNECT_POLL_S", "GenerationJob", "llama_timings"]
