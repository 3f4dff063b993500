"""How the inference surfaces read a request before it runs: its tenant, by the key it presents, and its body, read
and bounded as its API's (bounds.py); and, with tracing on, where its trace starts."""

from __future__ import annotations

from functools import partial

from starlette.requests import Request
from starlette.routing import Route

from gateway.accesslog import RequestRecord
from gateway.api.body import BodyReader
from gateway.api.bounds import Shape
from gateway.pipeline.inference import Submission
from gateway.settings import TenantSettings
from gateway.tenancy.tenants import TenantDirectory
from gateway.tracing import Tracing
from gateway.upstream.routing import SESSION_HEADER, session_id

TRACEPARENT = "traceparent"


class Intake:
    def __init__(self, *, tenants: TenantDirectory, bodies: BodyReader, tracing: Tracing | None = None) -> None:
        self._tenants = tenants
        self._bodies = bodies
        self._tracing = tracing

    async def tenant(self, request: Request, authorization: str | None = None) -> TenantSettings:
        """The tenant whose key is `authorization`, else the request's Authorization header."""
        return await self._tenants.authenticate(authorization or request.headers.get("authorization"))

    async def submission(
        self, request: Request, record: RequestRecord, shape: Shape, *, authorization: str | None = None
    ) -> Submission:
        """The tenant (as `tenant` finds it), its session and its body, read as a body of `shape` (its API's lists,
        each capped)."""
        if self._tracing is not None:
            # The route's template (/v1/…/{model}), not the path: a span's name must not carry the request's values.
            route = request.scope["route"]
            assert isinstance(route, Route)
            record.trace = self._tracing.request(
                request.method, route.path, record.started, request.headers.get(TRACEPARENT)
            )
        tenant = await self.tenant(request, authorization)
        record.tenant = tenant.id
        session = session_id(request.headers.get(SESSION_HEADER))
        payload = await self._bodies.read(request, shape, record.route)
        return Submission(tenant, payload, session, gone=partial(disconnected, request))


async def disconnected(request: Request) -> None:
    """Return once the client has gone (the body is read by then, so the next message is the disconnect)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass
