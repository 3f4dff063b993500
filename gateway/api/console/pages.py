"""The incident console: /admin/ui, pages rendered on the server from what the admin API reads (admin.py,
admin_incidents.py, admin_tenants.py), behind the admin token (sessions.py), with no script.

GET pages: the incidents (open first), an incident (its exposure as a timeline, its victims, recipients and notices,
its replica), the replicas, the tenants and a tenant's keys (ids and hash prefixes: a key is shown only in the answer
that makes it, which the console never asks for). POST forms: log in, log out, release or quarantine a replica; each
but the login carries the session's CSRF token, and none is accepted from another site.
"""

from __future__ import annotations

import hmac
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from redis.exceptions import RedisError
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.api.admin import AdminRoutes
from gateway.api.admin_incidents import IncidentAdminRoutes
from gateway.api.admin_tenants import TenantAdminRoutes
from gateway.api.console.rendering import Renderer, back, read_form, redirect
from gateway.api.console.sessions import COOKIE, SESSION_S, Session, Sessions
from gateway.api.console.timeline import draw
from gateway.errors import GatewayError, StoreUnavailable
from gateway.incidents.incident import Incident
from gateway.incidents.notice_status import NoticeStatus, notice_statuses
from gateway.incidents.notices import NoticeStore
from gateway.settings import Settings
from gateway.store import AdminState
from gateway.tenancy.webhooks import TenantWebhooks
from gateway.webhooks import Outbox

log = logging.getLogger("bulkhead.console")

PREFIX = "/admin/ui"
LOGIN = f"{PREFIX}/login"
INCIDENTS_LISTED = 100
EXPOSURE_READ = 10_000  # answers drawn and counted, the newest: as the exposure API's default
TENANTS_LISTED = 100
RELEASABLE = ("quarantined", "draining", "suspended", "held")

Page = Callable[[Request, Session], Awaitable[Response]]
Action = Callable[[Request, dict[str, str]], Awaitable[Response]]
Endpoint = Callable[[Request], Awaitable[Response]]


def _same_site(request: Request) -> bool:
    """Whether the browser says the form came from a page of this origin (absent: a client that does not say, which
    the CSRF token and SameSite cookie still stop)."""
    return request.headers.get("sec-fetch-site", "same-origin") == "same-origin"


def _marks(incident: Incident, notices: list[NoticeStatus]) -> list[tuple[float, str, str]]:
    marks = [(incident.opened_at, "opened", "opened: its first leak")]
    if incident.contained_at is not None:
        marks.append((incident.contained_at, "contained", "the replica left rotation"))
    if incident.closed_at is not None:
        marks.append((incident.closed_at, "closed", f"closed: {incident.close_reason}"))
    for status in notices:
        notice = status.notice
        marks.append((notice.created_at, "notice", f"notice {notice.type} to {notice.tenant}: {status.state}"))
    return marks


class ConsoleRoutes:
    def __init__(
        self,
        *,
        settings: Settings,
        admin: AdminRoutes,
        incidents: IncidentAdminRoutes,
        tenants: TenantAdminRoutes,
        notices: NoticeStore,
        tenant_webhooks: TenantWebhooks,
        outbox: Outbox,
    ) -> None:
        self._settings = settings
        self._admin = admin
        self._incidents = incidents
        self._tenants = tenants
        self._notices = notices
        self._tenant_webhooks = tenant_webhooks
        self._outbox = outbox
        token = settings.admin_token
        self._sessions = None if token is None else Sessions(token)
        self._render = Renderer()

    def _off(self) -> Response:
        message = "The admin console is off: set admin_token to enable it."
        return self._render.page("error.html", 404, csrf=None, section="", message=message)

    def _failed(self, session: Session | None, status: int, message: str) -> Response:
        csrf = None if session is None or self._sessions is None else self._sessions.csrf(session)
        return self._render.page("error.html", status, csrf=csrf, section="", message=message)

    def _page(self, handler: Page) -> Endpoint:
        """A page for a session, else the login form."""

        async def endpoint(request: Request) -> Response:
            if self._sessions is None:
                return self._off()
            session = self._sessions.read(request.cookies.get(COOKIE))
            if session is None:
                return redirect(LOGIN)
            try:
                return await handler(request, session)
            except GatewayError as error:
                return self._failed(session, error.status, error.message)
            except (RedisError, OSError) as exc:
                return self._failed(session, 503, StoreUnavailable.of(exc).message)

        return endpoint

    def _action(self, handler: Action) -> Endpoint:
        """A form that changes something: a session's, from a page of this origin, with the session's CSRF token."""

        async def endpoint(request: Request) -> Response:
            if self._sessions is None:
                return self._off()
            session = self._sessions.read(request.cookies.get(COOKIE))
            if session is None:
                return self._failed(None, 401, "Your session has ended: log in again.")
            if not _same_site(request):
                return self._failed(session, 403, "This form was sent from another site.")
            try:
                form = await read_form(request, self._settings.edge.body_timeout_s)
                if not self._sessions.csrf_matches(session, form.get("csrf", "")):
                    return self._failed(session, 403, "This form is stale or not the console's: reload the page.")
                return await handler(request, form)
            except GatewayError as error:
                return self._failed(session, error.status, error.message)
            except (RedisError, OSError) as exc:
                return self._failed(session, 503, StoreUnavailable.of(exc).message)

        return endpoint

    def _show(self, session: Session, section: str, template: str, **context: Any) -> Response:
        assert self._sessions is not None
        return self._render.page(template, csrf=self._sessions.csrf(session), section=section, **context)

    def _login(self, status: int, problem: str | None) -> Response:
        return self._render.page("login.html", status, csrf=None, section="", problem=problem, hours=SESSION_S // 3600)

    async def login_form(self, request: Request) -> Response:
        if self._sessions is None:
            return self._off()
        if self._sessions.read(request.cookies.get(COOKIE)) is not None:
            return redirect(PREFIX)
        return self._login(200, None)

    async def log_in(self, request: Request) -> Response:
        token = self._settings.admin_token
        if self._sessions is None or token is None:
            return self._off()
        if not _same_site(request):
            return self._failed(None, 403, "This form was sent from another site.")
        try:
            form = await read_form(request, self._settings.edge.body_timeout_s)
        except GatewayError as error:
            return self._failed(None, error.status, error.message)
        if not hmac.compare_digest(form.get("token", "").encode(), token.encode()):
            client = request.client.host if request.client else "?"
            log.warning("admin console: a login with a wrong token, from %s", client)
            return self._login(401, "That is not the admin token.")
        cookie, _ = self._sessions.issue()
        response = redirect(PREFIX)
        response.set_cookie(
            COOKIE, cookie, max_age=SESSION_S, path=PREFIX, httponly=True, samesite="strict",
            secure=request.url.scheme == "https",
        )  # fmt: skip
        return response

    async def log_out(self, request: Request, form: dict[str, str]) -> Response:
        response = redirect(LOGIN)
        response.delete_cookie(COOKIE, path=PREFIX, httponly=True, samesite="strict")
        return response

    async def styles(self, request: Request) -> Response:
        return self._off() if self._sessions is None else self._render.styles()

    async def list_incidents(self, request: Request, session: Session) -> Response:
        recent = await self._incidents.recent(INCIDENTS_LISTED)
        views = [i.view() for i in sorted(recent, key=lambda i: not i.open)]  # open first, each part newest first
        return self._show(session, "incidents", "incidents.html", incidents=views)

    async def show_incident(self, request: Request, session: Session) -> Response:
        incident = await self._incidents.incident(request.path_params["id"])
        exposure = await self._incidents.exposure(incident, EXPOSURE_READ)
        notices = await notice_statuses(
            incident, notices=self._notices, webhooks=self._tenant_webhooks, outbox=self._outbox,
            max_held=self._settings.webhooks.max_pending_per_target,
        )  # fmt: skip
        replica = next((r for r in self._admin.replicas() if r["name"] == incident.replica), None)
        return self._show(
            session, "incidents", "incident.html", incident=incident.view(), exposure=exposure.view(),
            timeline=draw(exposure, _marks(incident, notices)), notices=notices, replica=replica,
            releasable=RELEASABLE, here=f"{PREFIX}/incidents/{incident.id}",
        )  # fmt: skip

    async def list_replicas(self, request: Request, session: Session) -> Response:
        replicas = self._admin.replicas()
        here = f"{PREFIX}/replicas"
        return self._show(session, "replicas", "replicas.html", replicas=replicas, releasable=RELEASABLE, here=here)

    def _set_state(self, target: AdminState | None) -> Action:
        async def handler(request: Request, form: dict[str, str]) -> Response:
            await self._admin.set_state(form.get("replica", ""), target, "console")
            return redirect(back(form, f"{PREFIX}/replicas"))

        return handler

    async def list_tenants(self, request: Request, session: Session) -> Response:
        after = request.query_params.get("after", "")[:64]
        tenants, more = await self._tenants.tenant_page(after, TENANTS_LISTED)
        return self._show(session, "tenants", "tenants.html", tenants=tenants, more=more)

    async def show_tenant(self, request: Request, session: Session) -> Response:
        tenant = await self._tenants.tenant(request.path_params["tenant"])
        keys = await self._tenants.key_views(tenant.id)
        return self._show(session, "tenants", "tenant.html", tenant=tenant, keys=keys)

    def routes(self) -> list[Route]:
        page, action = self._page, self._action
        return [
            Route(LOGIN, self.login_form, methods=["GET"]),
            Route(LOGIN, self.log_in, methods=["POST"]),
            Route(f"{PREFIX}/logout", action(self.log_out), methods=["POST"]),
            Route(f"{PREFIX}/console.css", self.styles, methods=["GET"]),
            Route(PREFIX, page(self.list_incidents), methods=["GET"]),
            Route(f"{PREFIX}/incidents/{{id}}", page(self.show_incident), methods=["GET"]),
            Route(f"{PREFIX}/replicas", page(self.list_replicas), methods=["GET"]),
            Route(f"{PREFIX}/replicas/release", action(self._set_state(None)), methods=["POST"]),
            Route(f"{PREFIX}/replicas/quarantine", action(self._set_state("quarantined")), methods=["POST"]),
            Route(f"{PREFIX}/tenants", page(self.list_tenants), methods=["GET"]),
            Route(f"{PREFIX}/tenants/{{tenant}}", page(self.show_tenant), methods=["GET"]),
        ]
