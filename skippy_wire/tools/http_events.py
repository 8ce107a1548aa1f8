"""Server-sent events: the stream a ``"stream": true`` request is answered with."""

from __future__ import annotations

import asyncio
import json

from starlette.responses import StreamingResponse

from .http_front import shutting_down_error, shutting_down_response


def sse(obj: dict) -> str:
    """One server-sent event carrying ``obj`` as JSON."""
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


class EventStream(StreamingResponse):
    """A job's server-sent ``events`` (an async iterator of them; ``job.abandon()`` stops
    the job and gives back what it holds; ``job.error_event()`` shapes an error in them).
    Starlette can end the response before its body iterator first runs (the client gone while
    the head waited to be written, or its send raising), and then the iterator's own cleanup
    never runs: the job is abandoned here whatever happened."""

    def __init__(self, job, events) -> None:
        super().__init__(events, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self.job = job

    async def __call__(self, scope, receive, send) -> None:
        started = False

        async def sending(message) -> None:
            nonlocal started
            await send(message)
            started = started or message["type"] == "http.response.start"

        try:
            await super().__call__(scope, receive, sending)
        except asyncio.CancelledError:  # the server stops, its graceful period over: say so
            if not started:
                await shutting_down_response()(scope, receive, send)
            else:  # mid-stream: an error event, as for a pipeline failure, and the end of the body
                event = self.job.error_event(503, shutting_down_error()).encode()
                await send({"type": "http.response.body", "body": event, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            await self.body_iterator.aclose()  # one left at a yield: its generation is cancelled now
            self.job.abandon()
