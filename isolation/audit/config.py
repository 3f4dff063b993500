"""What one audit run is asked to do, and the two identities it speaks as."""

from __future__ import annotations

import secrets
from dataclasses import dataclass, field
from typing import Literal, get_args

import httpx

from isolation.markers import CanaryKey, make_marker

MARKERS_PER_IDENTITY = 8
Role = Literal["prefill", "decode"]
ROLES: tuple[Role, ...] = get_args(Role)


@dataclass(frozen=True)
class Identity:
    """One side of the two-tenant probes.

    `key` is sent as a Bearer token and never written anywhere else. With fewer than two keys the two identities
    share the endpoint's credentials and differ by `user` and `cache_salt`, which is how a raw engine tells
    requests apart; with two keys the endpoint (a gateway) is expected to separate them itself.
    """

    name: str
    key: str | None = field(repr=False)
    user: str
    cache_salt: str | None
    markers: tuple[str, ...] = field(repr=False)

    def headers(self) -> dict[str, str]:
        return {"authorization": f"Bearer {self.key}"} if self.key else {}


def make_identities(keys: tuple[str, ...]) -> tuple[Identity, Identity]:
    """Identities A and B with fresh random canary markers of the gateway's form.

    The markers come from a secret made for this run only, so no earlier run, tenant or gateway can have
    planted them: seeing one in the wrong answer can only mean this run's requests were mixed up.
    """
    if len(keys) > 2:
        raise ValueError("at most two keys: one for identity A, one for identity B")
    run = secrets.token_hex(4)
    canary_key = CanaryKey(key_id="audit", secret=secrets.token_bytes(32))
    salted = len(keys) < 2
    identities = []
    for index, name in enumerate(("A", "B")):
        key = keys[index] if index < len(keys) else (keys[0] if keys else None)
        markers = tuple(make_marker(canary_key, f"{name}-{n}", epoch=0) for n in range(MARKERS_PER_IDENTITY))
        identities.append(
            Identity(
                name=name,
                key=key,
                user=f"bulkhead-audit-{run}-{name.lower()}",
                cache_salt=f"bulkhead-audit-{run}-{name.lower()}" if salted else None,
                markers=markers,
            )
        )
    return identities[0], identities[1]


@dataclass(frozen=True)
class Stage:
    """One engine behind the router, as `--stage ROLE=URL` names it; `name` is ROLE-N, N counting from 0."""

    role: Role
    name: str
    url: str  # the server root: /metrics and /get_server_info live there


def _root(url: str) -> str:
    url = url.rstrip("/")
    return url[: -len("/v1")] if url.endswith("/v1") else url


def parse_stages(specs: tuple[str, ...] | list[str]) -> tuple[Stage, ...]:
    """`ROLE=URL` for each --stage, checked; each role's stages are numbered in the order given."""
    stages = []
    counts = dict.fromkeys(ROLES, 0)
    for spec in specs:
        role, sep, url = spec.partition("=")
        role = role.strip().lower()
        if not sep or role not in ROLES:
            raise ValueError(f"--stage takes ROLE=URL with ROLE prefill or decode, got {spec!r}")
        try:
            parsed = httpx.URL(url.strip())
        except httpx.InvalidURL as exc:
            raise ValueError(f"--stage {spec!r}: not a URL: {exc}") from exc
        if parsed.scheme not in ("http", "https") or not parsed.host:
            raise ValueError(f"--stage {spec!r}: the URL must be http:// or https://")
        checked: Role = "prefill" if role == "prefill" else "decode"
        stages.append(Stage(checked, f"{checked}-{counts[checked]}", _root(url.strip())))
        counts[checked] += 1
    return tuple(stages)


@dataclass(frozen=True)
class AuditConfig:
    """The command line, checked. Defaults are low enough to point at production."""

    endpoint: str
    model: str
    keys: tuple[str, ...] = field(default=(), repr=False)
    limit: int | None = None
    max_requests: int = 300
    timeout_s: float = 600.0  # the whole audit, not one request
    rate: float = 2.0  # requests per second, all routes together
    rounds: int = 3  # canary rounds; interleaving uses max(1, rounds - 1)
    answer_tokens: int = 64  # max_tokens of the canary and interleaving probes: room for a stale page to show
    seed: int | None = None
    stages: tuple[Stage, ...] = ()  # the engines behind a router (--stage ROLE=URL): parse_stages

    def __post_init__(self) -> None:
        try:
            url = httpx.URL(self.endpoint)
        except httpx.InvalidURL as exc:
            raise ValueError(f"--endpoint is not a URL: {exc}") from exc
        if url.scheme not in ("http", "https") or not url.host:
            raise ValueError(f"--endpoint must be an http:// or https:// URL, got {self.endpoint!r}")
        if not self.model:
            raise ValueError("--model must not be empty")
        if len(self.keys) > 2:
            raise ValueError("give --key at most twice (identity A, then identity B)")
        if self.limit is not None and self.limit < 8:
            raise ValueError(f"--limit must be at least 8 tokens, got {self.limit}")
        for name in ("max_requests", "rounds", "answer_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        for name in ("timeout_s", "rate"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")

    @property
    def base_url(self) -> str:
        """The server root: /tokenize and /metrics live there, not under /v1, so a pasted `.../v1` is cut."""
        return _root(self.endpoint)
