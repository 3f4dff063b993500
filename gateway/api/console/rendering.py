"""The console's pages as HTML: Jinja2 templates rendered with every value escaped, and the headers every answer
carries.

No script at all, and no style but the console's own stylesheet: the Content-Security-Policy says so, so that a
name that slipped past escaping could still run nothing. The pages hold tenants' and incidents' data: no cache keeps
them, no other site frames them, and no Referer carries their URLs away.
"""

from __future__ import annotations

import re
from datetime import UTC, datetime
from importlib.resources import files
from typing import Any
from urllib.parse import parse_qsl

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from gateway.api.body import read_body
from gateway.errors import InvalidRequest

CSP = "; ".join(
    [
        "default-src 'none'",
        "style-src 'self'",
        "img-src 'self'",
        "form-action 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
    ]
)
HEADERS = {
    "content-security-policy": CSP,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    "cache-control": "no-store",
    "x-frame-options": "DENY",
    "cross-origin-opener-policy": "same-origin",
}
FORM_BYTES = 4096  # a login's token, or an action's few fields
FORM_FIELDS = 8
# Where an action may send the browser back to: a page of the console, by a path of the names its routes take.
_BACK = re.compile(r"/admin/ui(/[A-Za-z0-9._@-]+)*")


def when(value: float | str | None) -> str:
    """A time as the console shows it: UTC, to the second."""
    if value is None:
        return "—"
    if isinstance(value, str):  # already ISO 8601 (the tenants' API views)
        return value.replace("T", " ").split(".")[0].removesuffix("Z") + "Z"
    return datetime.fromtimestamp(value, UTC).strftime("%Y-%m-%d %H:%M:%SZ")


class Renderer:
    def __init__(self) -> None:
        self._env = jinja2.Environment(
            loader=jinja2.PackageLoader(__package__ or "gateway.api.console", "templates"),
            autoescape=True,
            undefined=jinja2.StrictUndefined,
            trim_blocks=True,
            lstrip_blocks=True,
        )
        self._env.filters["when"] = when
        self.stylesheet = (files(__package__ or "gateway.api.console") / "static" / "console.css").read_bytes()

    def page(self, template: str, status: int = 200, **context: Any) -> Response:
        html = self._env.get_template(template).render(**context)
        return Response(html, status_code=status, media_type="text/html", headers=HEADERS)

    def styles(self) -> Response:
        # Not secret, and the same for every session: cached for a while, unlike the pages.
        headers = {**HEADERS, "cache-control": "max-age=300"}
        return Response(self.stylesheet, media_type="text/css", headers=headers)


def redirect(to: str) -> Response:
    """See other: after a form, the browser asks for the page again (reloading it sends nothing twice)."""
    return Response(status_code=303, headers={**HEADERS, "location": to})


def back(form: dict[str, str], default: str) -> str:
    """The console page a form names to go back to, or `default`: never another site's."""
    wanted = form.get("back", "")
    return wanted if _BACK.fullmatch(wanted) else default


async def read_form(request: Request, timeout_s: float) -> dict[str, str]:
    """A small urlencoded form, each field's first value."""
    if request.headers.get("content-type", "").split(";")[0].strip() != "application/x-www-form-urlencoded":
        raise InvalidRequest("The console's forms are sent urlencoded.")
    raw = await read_body(request, FORM_BYTES, timeout_s)
    try:
        fields = parse_qsl(raw.decode(), max_num_fields=FORM_FIELDS, strict_parsing=False)
    except (UnicodeDecodeError, ValueError) as exc:
        raise InvalidRequest("The form does not parse.") from exc
    form: dict[str, str] = {}
    for name, value in fields:
        form.setdefault(name, value)
    return form
