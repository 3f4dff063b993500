"""How a gateway process runs beside its server: its log lines, and its lifespan alone (queue workers) until told
to stop."""

from __future__ import annotations

import asyncio
import logging
import signal
import sys

import orjson
from starlette.applications import Starlette


class _JsonLines(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        if record.name == "bulkhead.access":
            return record.getMessage()
        line = {"event": "log", "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return orjson.dumps(line).decode()


def configure_logging(level: str) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_JsonLines())
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(level)
    # httpx logs every request at INFO: a second line per proxied request, and one per health check.
    logging.getLogger("httpx").setLevel(logging.WARNING)


async def run_lifespan(app: Starlette) -> None:
    """The app's lifespan (state, background tasks, queue workers) without an HTTP listener, until SIGTERM/SIGINT."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    async with app.router.lifespan_context(app):
        await stop.wait()
