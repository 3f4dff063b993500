"""Every error the gateway answers with, and the one place they become OpenAI-style JSON.

GatewayError                       status, type, code, param, message
├── InvalidRequest        400      invalid_request_error (bad JSON, wrong types, bad values)
│   └── ContextLengthExceeded 400  invalid_request_error / context_length_exceeded
├── RequestTimeout        408      invalid_request_error / request_timeout (the body came too slowly; closes)
├── BodyTooLarge          413      invalid_request_error / request_too_large
├── AuthenticationFailed  401      authentication_error / invalid_api_key
├── ModelNotAllowed       403      permission_error / model_not_allowed
├── TenantDisabled        403      permission_error / tenant_disabled (the key is good, its tenant is switched off)
├── VerdictsExceeded      403      permission_error / verdicts_exceeded (too many withheld verdicts on a model today)
├── ModelNotFound         404      not_found_error / model_not_found
├── NotFound              404      not_found_error / not_found (unknown route)
├── MethodNotAllowed      405      invalid_request_error / method_not_allowed
├── Conflict              409      invalid_request_error / conflict (an id that exists, a config-managed tenant)
├── RateLimited           429      rate_limit_error (Retry-After and x-ratelimit-* headers)
│   ├── ConcurrencyLimited         concurrency_limit_exceeded: too many in flight on this instance
│   ├── RateLimitExceeded          rate_limit_exceeded: requests or tokens per minute
│   ├── TooManyQueued              too_many_queued_requests: the tenant's async requests queued or running
│   └── CapacityExceeded           capacity_exceeded: the model's replicas are saturated and its queue can't wait
├── ClientGone            499      the client went away before its request was forwarded (logged, never sent)
├── EdgeUnavailable       503      api_error, answered by the HTTP edge before the app (edge.py; closes)
│   ├── ShuttingDown               shutting_down: the request arrived while this instance drains on SIGTERM
│   └── TooManyConnections         too_many_connections: past edge.max_connections
└── UpstreamError                  api_error: the backend could not give a usable answer
    ├── RateLimitUnavailable 503   the rate-limit store is down and the policy is fail_closed
    ├── QueueUnavailable    503    the async queue's store is down: nothing was accepted
    ├── DirectoryUnavailable 503   the tenant directory's store cannot answer (or too many unknown keys at once)
    ├── StoreUnavailable    503    an operators' store cannot answer (incidents, the ledger, notices, webhooks)
    ├── BackendUnavailable  503    no healthy backend for the model
    │   └── CapacityUnknown 503    no limit known for the model: nothing is forwarded blind
    ├── BackendUnreachable  502    connect refused / reset / DNS
    ├── BackendTimeout      504    connect, read or pool timeout
    ├── BackendBadResponse  502    the backend answered, but not with something we can pass on
    └── AnswerWithheld      502    the answer could not be shown safe (isolation check failed)
"""

from __future__ import annotations

import orjson
from starlette.responses import Response


class GatewayError(Exception):
    status = 500
    type = "api_error"
    code = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.headers: dict[str, str] = {}
        if code is not None:
            self.code = code

    def body(self) -> dict[str, dict[str, str | None]]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class InvalidRequest(GatewayError):
    status = 400
    type = "invalid_request_error"
    code = "invalid_request"


class ContextLengthExceeded(InvalidRequest):
    code = "context_length_exceeded"


class RequestTimeout(GatewayError):
    status = 408
    type = "invalid_request_error"
    code = "request_timeout"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # The rest of the body may still be on its way: the connection cannot carry another request.
        self.headers["connection"] = "close"


class BodyTooLarge(GatewayError):
    status = 413
    type = "invalid_request_error"
    code = "request_too_large"


class AuthenticationFailed(GatewayError):
    status = 401
    type = "authentication_error"
    code = "invalid_api_key"


class ModelNotAllowed(GatewayError):
    status = 403
    type = "permission_error"
    code = "model_not_allowed"


class TenantDisabled(GatewayError):
    status = 403
    type = "permission_error"
    code = "tenant_disabled"


class VerdictsExceeded(GatewayError):
    status = 403
    type = "permission_error"
    code = "verdicts_exceeded"


class ModelNotFound(GatewayError):
    status = 404
    type = "not_found_error"
    code = "model_not_found"


class NotFound(GatewayError):
    status = 404
    type = "not_found_error"
    code = "not_found"


class MethodNotAllowed(GatewayError):
    status = 405
    type = "invalid_request_error"
    code = "method_not_allowed"


class Conflict(GatewayError):
    status = 409
    type = "invalid_request_error"
    code = "conflict"


class RateLimited(GatewayError):
    status = 429
    type = "rate_limit_error"
    code = "rate_limited"


class ConcurrencyLimited(RateLimited):
    code = "concurrency_limit_exceeded"


class RateLimitExceeded(RateLimited):
    code = "rate_limit_exceeded"


class TooManyQueued(RateLimited):
    code = "too_many_queued_requests"


class CapacityExceeded(RateLimited):
    code = "capacity_exceeded"


class ClientGone(GatewayError):
    status = 499
    type = "invalid_request_error"
    code = "client_disconnected"


class EdgeUnavailable(GatewayError):
    status = 503
    type = "api_error"
    code = "unavailable"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        # The connection ends with the answer (it is one too many, or its server is going); any instance may take
        # the retry at once.
        self.headers.update({"connection": "close", "retry-after": "1"})


class ShuttingDown(EdgeUnavailable):
    code = "shutting_down"


class TooManyConnections(EdgeUnavailable):
    code = "too_many_connections"


class UpstreamError(GatewayError):
    status = 502
    type = "api_error"
    code = "backend_error"

    def __init__(self, message: str, *, before_sending: bool = False) -> None:
        super().__init__(message)
        # Nothing reached the backend (connect refused or timed out): safe to try another replica.
        self.before_sending = before_sending


class RateLimitUnavailable(UpstreamError):
    status = 503
    code = "rate_limit_unavailable"


class QueueUnavailable(UpstreamError):
    status = 503
    code = "queue_unavailable"


class ConversationsUnavailable(UpstreamError):
    status = 503
    code = "conversations_unavailable"


class DirectoryUnavailable(UpstreamError):
    status = 503
    code = "directory_unavailable"


class StoreUnavailable(UpstreamError):
    status = 503
    code = "store_unavailable"

    @classmethod
    def of(cls, exc: Exception) -> StoreUnavailable:
        return cls(f"A store this request needs cannot be reached ({type(exc).__name__}); retry.")


class BackendUnavailable(UpstreamError):
    status = 503
    code = "backend_unavailable"


class CapacityUnknown(BackendUnavailable):
    code = "capacity_unknown"


class BackendUnreachable(UpstreamError):
    status = 502
    code = "backend_unreachable"


class BackendTimeout(UpstreamError):
    status = 504
    code = "backend_timeout"


class BackendBadResponse(UpstreamError):
    status = 502
    code = "backend_bad_response"

    def __init__(self, message: str, *, quoted: str = "") -> None:
        super().__init__(message)
        self.quoted = quoted  # the backend's own words (its error body): scanned for leaks, never relayed


class AnswerWithheld(UpstreamError):
    status = 502
    code = "answer_withheld"


def error_response(error: GatewayError, headers: dict[str, str] | None = None) -> Response:
    return Response(
        orjson.dumps(error.body()),
        status_code=error.status,
        media_type="application/json",
        headers={**error.headers, **(headers or {})},
    )
