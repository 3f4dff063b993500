"""Server-sent events for a streamed answer, and the response that ties the stream to its engine run.

Starlette cancels a StreamingResponse when the client disconnects (uvicorn speaks ASGI 2.3, so Starlette
listens for http.disconnect) and may leave the body generator suspended at a `yield` rather than inside it;
a `finally` in the generator alone would then run only when the generator is garbage-collected. EngineStream
therefore closes the generator and releases the run itself, so an abort is counted the moment the
exchange ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator

import orjson
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from isolation.sim.engine import Engine, Run
from isolation.sim.replies import JsonObject, Reply

_DONE = b"data: [DONE]\n\n"


def _event(chunk: JsonObject) -> bytes:
    return b"data: " + orjson.dumps(chunk) + b"\n\n"


async def stream_events(engine: Engine, reply: Reply) -> AsyncGenerator[bytes, None]:
    """One chunk per token per choice (choices interleaved, as vLLM batches them; a tool call's withheld tokens
    have none), then usage, then [DONE]."""
    run = reply.run
    for step in range(run.length):
        await engine.step(run)
        if step == 0:
            # vLLM sends the role chunks with the first output, so they too arrive after the TTFT.
            for opening in reply.opening_chunks():
                yield _event(opening)
        if step == run.length - 1:
            engine.finish(run)
        for index in range(run.n):
            chunk = reply.token_chunk(index, step)
            if chunk is not None:
                yield _event(chunk)
    if reply.sampling.include_usage:
        yield _event(reply.usage_chunk())
    yield _DONE


class EngineStream(StreamingResponse):
    """An SSE response that gives its run back to the engine however the exchange ends."""

    def __init__(self, engine: Engine, reply: Reply) -> None:
        self._events = stream_events(engine, reply)
        self._engine = engine
        self._run: Run = reply.run
        super().__init__(self._events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.release(self._run)
            await self._events.aclose()
