"""The operators' view of incidents and their blast radius, under /admin (admin.py checks the token).

GET /admin/incidents, GET /admin/incidents/{id}, GET /admin/incidents/{id}/exposure, POST
/admin/incidents/{id}/close, and GET /admin/exposure?replica=&since=&until= for a window an operator names.
Times are epoch seconds, or ISO 8601 with a zone in the query.
"""

from __future__ import annotations

import math
import time
from datetime import datetime

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import InvalidRequest, NotFound
from gateway.incidents.exposure import Exposure, Window, slack_s
from gateway.incidents.incident import Incident, IncidentStore
from gateway.incidents.ledger import MAX_TIME_S, LedgerWriter
from gateway.incidents.tracking import Tracker
from gateway.settings import Settings
from gateway.upstream.backends import ReplicaPool

MAX_ANSWERS = 100_000  # per report: a larger window is cut (`truncated`) and can be read in parts by time


def _json(value: object) -> Response:
    return Response(orjson.dumps(value), media_type="application/json")


def _int(request: Request, name: str, default: int, most: int) -> int:
    value = request.query_params.get(name, str(default))
    if not value.isdigit() or not 1 <= int(value) <= most:
        raise InvalidRequest(f"{name} must be an integer from 1 to {most}.", param=name)
    return int(value)


def _time(request: Request, name: str, default: float | None = None) -> float:
    value = request.query_params.get(name)
    if value is None:
        if default is None:
            raise InvalidRequest(f"{name} is required (epoch seconds or ISO 8601 with a zone).", param=name)
        return default
    try:
        when = float(value)
    except ValueError:
        try:
            parsed = datetime.fromisoformat(value)
        except ValueError:
            parsed = None
        if parsed is None or parsed.tzinfo is None:
            raise InvalidRequest(f"{name} must be epoch seconds or ISO 8601 with a zone.", param=name) from None
        when = parsed.timestamp()
    if not math.isfinite(when) or not 0 <= when <= MAX_TIME_S:
        raise InvalidRequest(f"{name} must be a time after 1970 and before {MAX_TIME_S:.0f}.", param=name)
    return when


class IncidentAdminRoutes:
    def __init__(
        self,
        *,
        settings: Settings,
        incidents: IncidentStore,
        ledger: LedgerWriter,
        pool: ReplicaPool,
        tracker: Tracker,
    ) -> None:
        self._settings = settings
        self._incidents = incidents
        self._ledger = ledger
        self._pool = pool
        self._tracker = tracker

    async def incident(self, incident_id: str) -> Incident:
        """The incident of this id, or NotFound."""
        incident = await self._incidents.get(incident_id)
        if incident is None:
            raise NotFound(f"No incident '{incident_id}' (incidents expire with isolation.ledger.retention_s).")
        return incident

    async def recent(self, limit: int) -> list[Incident]:
        return await self._incidents.recent(limit)

    async def _incident(self, request: Request) -> Incident:
        return await self.incident(request.path_params["id"])

    async def list_incidents(self, request: Request) -> Response:
        recent = await self.recent(_int(request, "limit", 100, 10_000))
        return _json({"incidents": [incident.view() for incident in recent]})

    async def show_incident(self, request: Request) -> Response:
        return _json((await self._incident(request)).view())

    async def read(self, window: Window, incident: Incident | None, limit: int) -> Exposure:
        """What the window's replica served in it, at most `limit` answers."""
        # This instance's last answers first; other instances' reach the store within a flush interval.
        await self._ledger.flush()
        return await Exposure.read(self._ledger.ledger, window, incident, limit)

    async def exposure(self, incident: Incident, limit: int) -> Exposure:
        """What the incident's replica served in its exposure window, as of now."""
        return await self.read(Window.of(incident, time.time(), slack_s(self._settings)), incident, limit)

    async def incident_exposure(self, request: Request) -> Response:
        incident = await self._incident(request)
        return _json((await self.exposure(incident, _int(request, "limit", 10_000, MAX_ANSWERS))).view())

    async def replica_exposure(self, request: Request) -> Response:
        replica = request.query_params.get("replica", "")
        if replica not in self._pool.replicas:
            raise InvalidRequest(f"replica must name a configured replica, not '{replica[:64]}'.", param="replica")
        now = time.time()
        since = _time(request, "since")
        until = _time(request, "until", now)
        if until < since:
            raise InvalidRequest("until must not be before since.", param="until")
        window = Window(replica, since, until, "where the operator said", "where the operator said")
        return _json((await self.read(window, None, _int(request, "limit", 10_000, MAX_ANSWERS))).view())

    async def close_incident(self, request: Request) -> Response:
        incident = await self._incident(request)
        if incident.open:
            await self._tracker.closed(incident.replica, "closed by an operator", incident.id)
            incident = await self._incident(request)
        return _json(incident.view())
