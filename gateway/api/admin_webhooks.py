"""/admin/webhooks: the webhook outbox's dead letters (gateway/webhooks), for operators to read, replay or discard.

A dead letter is shown with its body (operators may read what their tenants are told) and never its target's
secret, which the outbox does not hold. Replay makes it due now, its attempts kept; it leaves the list when it is
delivered. An id that is no dead letter is 404.
"""

from __future__ import annotations

from typing import Any

import orjson
from starlette.requests import Request
from starlette.responses import Response

from gateway.errors import InvalidRequest, NotFound
from gateway.webhooks import Deliveries, Message, iso_time

MAX_PAGE = 1000


def dead_letter_view(message: Message) -> dict[str, Any]:
    return {
        "id": message.id,
        "target": message.target,
        "type": message.type,
        "created_at": iso_time(message.created),
        "attempts": message.attempts,
        "last_error": message.last_error,
        "next_attempt_at": None if message.expired else iso_time(message.next_at),
        "expired": message.expired,
        "body": orjson.loads(message.body),
    }


def _json(value: object) -> Response:
    return Response(orjson.dumps(value), media_type="application/json")


def _not_found(message_id: str) -> NotFound:
    return NotFound(f"No dead letter with id '{message_id[:100]}'.")


class WebhookAdminRoutes:
    def __init__(self, *, deliveries: Deliveries) -> None:
        self._deliveries = deliveries

    async def list_dead_letters(self, request: Request) -> Response:
        limit = request.query_params.get("limit", "100")
        if not limit.isdigit() or not 1 <= int(limit) <= MAX_PAGE:
            raise InvalidRequest(f"limit must be an integer from 1 to {MAX_PAGE}.", param="limit")
        found = await self._deliveries.outbox.dead_letters(int(limit))
        return _json({"dead_letters": [dead_letter_view(m) for m in found]})

    async def replay_dead_letter(self, request: Request) -> Response:
        message_id = request.path_params["id"]
        replayed = await self._deliveries.replay(message_id)
        if replayed is None:
            raise _not_found(message_id)
        return _json(dead_letter_view(replayed))

    async def discard_dead_letter(self, request: Request) -> Response:
        message_id = request.path_params["id"]
        if not await self._deliveries.discard(message_id):
            raise _not_found(message_id)
        return _json({"id": message_id, "deleted": True})
