"""Every error answer of the API as an error object in the shape of its route's API, whoever
answered it: OpenAI's objects, llama-server's on its own routes (:func:`for_route`), the
middleware that reshapes what libraries answer (:class:`ErrorObjects`), and
:func:`thread_refused`, a thread the machine would not start."""

from __future__ import annotations

import json
import logging
from typing import Optional

from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ..errors import thread_start_failed

#: Seconds a client is told to wait before retrying a refused (503) request.
RETRY_AFTER_S = 1
#: Headers of an answer after which the connection closes (the rest of a body left unread
#: would otherwise be read and dropped for as long as the peer sends it).
CLOSE = {"Connection": "close"}

#: llama-server's routes for what it serves only when started so (embeddings, reranking,
#: slots) or for a model that can (infill), each answered as llama-server answers without
#: it: 501, saying what it does not support (its first sentence; its hint, a flag to start it
#: with, names none that ``api`` takes).  The stages compute next tokens alone and keep no
#: slots.  Path -> (methods, what).
NOT_SERVED = {"/slots": (["GET"], "slots endpoint"), "/slots/{id_slot}": (["POST"], "slots endpoint"),
              **{path: (["POST"], "embeddings") for path in ("/embedding", "/embeddings", "/v1/embeddings")},
              **{path: (["POST"], "reranking") for path in ("/rerank", "/reranking", "/v1/rerank", "/v1/reranking")},
              "/infill": (["POST"], "infill")}
#: llama-server's own routes (and ``/slots/ID``): their errors in its shape (:class:`ErrorObjects`).
LLAMA_PATHS = frozenset({"/completion", "/tokenize", "/detokenize", "/apply-template", "/props", "/metrics",
                         *(path for path in NOT_SERVED if not path.startswith("/v1/") and "{" not in path)})


def error_object(message: str, *, type_: str = "invalid_request_error", param: Optional[str] = None,
                 code: Optional[str] = None) -> dict:
    """An OpenAI error object (also what a stream sends once its head has gone)."""
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def error_response(status: int, message: str, *, type_: str = "invalid_request_error",
                   param: Optional[str] = None, code: Optional[str] = None, headers=None,
                   fields: Optional[dict] = None) -> JSONResponse:
    """An OpenAI error object as a response; ``fields``: members beside its four (llama-server's)."""
    body = error_object(message, type_=type_, param=param, code=code)
    body["error"].update(fields or {})
    return JSONResponse(body, status_code=status, headers=headers)


def not_served(what: str):
    """The endpoint of a :data:`NOT_SERVED` route."""
    async def endpoint(request):
        return error_response(501, f"This server does not support {what}.", type_="not_supported_error")
    return endpoint


def llama_route(path: str) -> bool:
    return path in LLAMA_PATHS or path.startswith("/slots/")


def llama_error(status: int, answer: dict) -> dict:
    """OpenAI's error object ``answer`` in llama-server's shape, ``{"error": {"code": STATUS,
    "message", "type"}}`` (its ``code`` is the HTTP status; a prompt too long for the context
    is its ``exceed_context_size_error``, a 503 its ``unavailable_error``), with the members
    the error carries beside OpenAI's four; a stream's error event has it too."""
    error = answer["error"]
    kind = "exceed_context_size_error" if error.get("code") == "context_length_exceeded" else \
        "unavailable_error" if status == 503 else error.get("type")
    extra = {k: v for k, v in error.items() if k not in ("message", "type", "param", "code")}
    return {**answer, "error": {"code": status, "message": error.get("message"), "type": kind, **extra}}


def for_route(status: int, answer: dict, path: Optional[str]) -> dict:
    """OpenAI's error object ``answer`` in the shape of the route at ``path`` (None: not known)."""
    return llama_error(status, answer) if path is not None and llama_route(path) else answer


def _error_object_bytes(status: int, body: bytes, llama: bool) -> Optional[bytes]:
    """An error answer's body with an error object in it, OpenAI's or :func:`llama_error`'s;
    None where the body is one already.  A body that holds no error object (a library's
    plain-text refusal) becomes the message of one."""
    try:
        answer = json.loads(body)
    except ValueError:
        answer = None
    if not (isinstance(answer, dict) and isinstance(answer.get("error"), dict)):
        answer = error_object(body.decode("utf-8", "replace").strip() or f"HTTP {status}")
    elif not llama:
        return None
    return JSONResponse(llama_error(status, answer) if llama else answer).body


class ErrorObjects:
    """ASGI middleware: every error answer is an error object in the shape of its route's API,
    whoever answered it (the route, a middleware such as the API key's or CORS', the router's
    405): llama-server's on :data:`LLAMA_PATHS`, OpenAI's elsewhere."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":  # (HEAD too: its Content-Length is GET's, the server drops the body)
            await self.app(scope, receive, send)
            return
        held: Optional[dict] = None  # an error's response start, until its body is whole
        body = bytearray()

        async def sending(message) -> None:
            nonlocal held
            if message["type"] == "http.response.start" and message["status"] >= 400:
                held = message
                return
            if held is None or message["type"] != "http.response.body":
                await send(message)
                return
            body.extend(message.get("body", b""))
            if message.get("more_body", False):
                return
            shaped = _error_object_bytes(held["status"], bytes(body), llama_route(scope["path"]))
            if shaped is None:
                await send(held)
                await send({"type": "http.response.body", "body": bytes(body)})
                return
            headers = [(k, v) for k, v in held.get("headers", [])
                       if k.lower() not in (b"content-length", b"content-type")]
            await send({**held, "headers": [*headers, (b"content-type", b"application/json"),
                                            (b"content-length", str(len(shaped)).encode())]})
            await send({"type": "http.response.body", "body": shaped})

        await self.app(scope, receive, sending)


async def thread_refused(request: Request, exc: Exception) -> Response:
    """A request whose thread (the tokenizer's, a probe's) the machine would not start (``ulimit
    -u``, ``-v``): a 503 in the error object's shape, to be retried, not a text 500 and a traceback."""
    if not thread_start_failed(exc):
        raise exc
    logging.getLogger("uvicorn.error").error("%s: cannot start a thread (a process or memory limit); answered 503",
                                             request.url.path)
    return error_response(503, "the server cannot start a thread now (a process or memory limit); retry later",
                          type_="server_error", code="unavailable", headers={"Retry-After": str(RETRY_AFTER_S)})


__all__ = ["RETRY_AFTER_S", "CLOSE", "NOT_SERVED", "LLAMA_PATHS", "error_object", "error_response", "not_served",
           "llama_route", "llama_error", "for_route", "ErrorObjects", "thread_refused"]
