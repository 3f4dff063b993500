"""Server-sent events for a streamed answer, and the response that ties the stream to its engine run.

Starlette cancels a StreamingResponse when the client disconnects (uvicorn speaks ASGI 2.3, so Starlette
listens for http.disconnect) and may leave the body generator suspended at a `yield` rather than inside it;
a `finally` in the generator alone would then run only when the generator is garbage-collected. EngineStream
therefore closes the generator and releases the run itself, so an abort is counted the moment the
exchange ends.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, Callable

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from isolation.sim.engine import Engine, Run
from isolation.sim.replies import Reply


async def stream_events(
    engine: Engine, reply: Reply, first_token: Callable[[], None] | None = None
) -> AsyncGenerator[bytes, None]:
    """The reply's head events at once, then its events for each token as the engine produces it, then its
    closing events; each API's reply decides what those are (replies.py, responses.py, messages.py).
    `first_token` is called when the first token is produced (the simulator's timings, timings.py)."""
    run = reply.run
    for event in reply.head_events():
        yield event
    for step in range(run.length):
        await engine.step(run)
        if step == 0 and first_token is not None:
            first_token()
        if step == run.length - 1:
            engine.finish(run)
        for event in reply.token_events(step):
            yield event
    for event in reply.closing_events():
        yield event


class EngineStream(StreamingResponse):
    """An SSE response that gives its run back to the engine however the exchange ends."""

    def __init__(self, engine: Engine, reply: Reply, first_token: Callable[[], None] | None = None) -> None:
        self._events = stream_events(engine, reply, first_token)
        self._engine = engine
        self._run: Run = reply.run
        super().__init__(self._events, media_type="text/event-stream")

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self._engine.release(self._run)
            await self._events.aclose()
