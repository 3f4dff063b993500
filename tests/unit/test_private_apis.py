"""The uvicorn, Starlette and redis-py internals the gateway builds on, named so that an upgrade that drops one fails
here with what to re-check, not as an AttributeError on the first request.

pyproject.toml bounds the three packages above by the newest release checked; raise a bound only after this passes on
the new release and the code that uses each name has been read against it.
"""

from __future__ import annotations

import importlib
import inspect

import pytest
import redis
import starlette
import uvicorn

# (module, attribute path, who needs it and why)
PRIVATE = [
    ("uvicorn._types", "ASGI3Application", "gateway/server/edge.py types the apps it answers with"),
    ("uvicorn.protocols.http.flow_control", "service_unavailable", "EdgeProtocol tells uvicorn's 503 apart"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol", "EdgeProtocol subclasses it"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol._start_asgi_task", "EdgeProtocol answers drains"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_response_complete", "EdgeProtocol flushes"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_message_begin", "EdgeProtocol's deadline"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_headers_complete", "EdgeProtocol's deadline"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.on_message_complete", "EdgeProtocol lingers"),
    ("uvicorn.protocols.http.httptools_impl", "HttpToolsProtocol.shutdown", "EdgeProtocol drains"),
    ("uvicorn.protocols.http.httptools_impl", "RequestResponseCycle", "EdgeProtocol reads its request's state"),
    ("uvicorn.server", "ServerState", "EdgeProtocol's constructor"),
    ("uvicorn.server", "Server.startup", "the CLI prints its banner once the server serves"),
    ("uvicorn.supervisors.multiprocess", "Multiprocess.terminate_all", "serve --workers closes its socket first"),
    ("starlette.responses", "StreamingResponse.listen_for_disconnect", "RelayResponse watches the client"),
    ("starlette.responses", "StreamingResponse.stream_response", "RelayResponse renders its own events"),
    ("starlette.responses", "Response.init_headers", "RelayResponse sets its headers without Starlette's init"),
    ("redis.asyncio.cluster", "PipelineCommand", "isolation/replication.py: a write and its WAIT on one connection"),
    ("redis.asyncio.cluster", "ClusterNode.execute_pipeline", "isolation/replication.py: ... of the key's primary"),
    ("redis.asyncio.cluster", "NodesManager.get_node_from_slot", "isolation/replication.py: which primary that is"),
]


@pytest.mark.parametrize(("module", "path", "why"), PRIVATE, ids=[f"{m}.{p}" for m, p, _ in PRIVATE])
def test_an_internal_the_gateway_uses_is_still_there(module: str, path: str, why: str) -> None:
    versions = f"uvicorn {uvicorn.__version__}, starlette {starlette.__version__}, redis {redis.__version__}"
    target: object = importlib.import_module(module)
    for name in path.split("."):
        assert hasattr(target, name), f"{module}.{path} is gone in {versions}: {why}; re-check that code"
        target = getattr(target, name)


def test_the_request_cycle_still_has_the_state_the_edge_reads() -> None:
    from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

    source = inspect.getsource(RequestResponseCycle.__init__)
    for field in ("more_body", "keep_alive", "response_complete"):
        assert f"self.{field}" in source, (
            f"uvicorn {uvicorn.__version__}'s RequestResponseCycle has no {field}: gateway/server/edge.py reads it"
        )


def test_the_protocol_still_keeps_its_cycle_transport_and_loop() -> None:
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

    source = inspect.getsource(HttpToolsProtocol)
    for field in ("self.cycle", "self.transport", "self.loop"):
        assert field in source, f"uvicorn {uvicorn.__version__}'s HttpToolsProtocol lost {field}: EdgeProtocol uses it"


def test_the_server_still_says_when_it_has_started() -> None:
    assert "self.started = True" in inspect.getsource(uvicorn.Server.startup), (
        f"uvicorn {uvicorn.__version__}'s Server.startup no longer sets started: the CLI's banner waits on it"
    )
