"""What `bulkhead serve` checks before it prints its banner: secrets published with the source, and the address.

Each check answers with one line that says what to change, so that a start that cannot work stops before anything
is printed as if it could.
"""

from __future__ import annotations

import errno
import re
import socket
from urllib.parse import urlsplit

from gateway.settings import Settings
from gateway.tenancy.tenants import hash_key

# The keys whose hashes deploy/bulkhead.example.yaml, the compose stack and the Kubernetes example overlay carry:
# anyone who has read the repository can use them.
PUBLISHED_KEYS = ("bk-example-acme-do-not-use-in-production", "bk-example-globex-do-not-use-in-production")
PUBLISHED_HASHES = {hash_key(key): key for key in PUBLISHED_KEYS}
# The placeholders of deploy/ (`example-admin-token-replace-me`, `demo-cache-salt-secret-change-me`, ...) and the
# usual spellings of the same idea.
PLACEHOLDER = re.compile(r"(replace|change)[-_ .]?me|do[-_ ]?not[-_ ]?use", re.IGNORECASE)
ALLOW_FLAG = "--allow-example-secrets"


class ListenError(Exception):
    """The address in the settings cannot be listened on; the message names the flag and setting to change."""


def _secrets(settings: Settings) -> list[tuple[str, str | None]]:
    """Every secret the settings hold, with the key it is under."""
    found: list[tuple[str, str | None]] = [
        ("admin_token", settings.admin_token),
        ("metrics_token", settings.metrics_token),
        ("cache_salt_secret", settings.cache_salt_secret),
        ("isolation.canary.webhook_secret", settings.isolation.canary.webhook_secret),
    ]
    found += [(f"isolation.canary.keys[{i}].secret", k.secret) for i, k in enumerate(settings.isolation.canary.keys)]
    found += [(f"backends[{i}].api_key", b.api_key) for i, b in enumerate(settings.backends)]
    if settings.redis_url is not None:
        found.append(("redis_url (its password)", urlsplit(settings.redis_url).password))
    if settings.isolation.ledger.postgres_url is not None:
        postgres = urlsplit(settings.isolation.ledger.postgres_url).password
        found.append(("isolation.ledger.postgres_url (its password)", postgres))
    return found


def published_secrets(settings: Settings) -> list[str]:
    """What in the settings was published with the source: example key hashes and placeholder secrets."""
    problems = []
    for index, tenant in enumerate(settings.tenants):
        for key_hash in tenant.key_hashes:
            if key_hash in PUBLISHED_HASHES:
                problems.append(
                    f"tenants[{index}].key_hashes: tenant '{tenant.id}' accepts the published example key "
                    f"{PUBLISHED_HASHES[key_hash]} (make a key of your own: bulkhead keys create --tenant {tenant.id})"
                )
    for where, value in _secrets(settings):
        if value is not None and PLACEHOLDER.search(value):
            problems.append(f"{where}: a placeholder value, published with the source (replace it with a secret)")
    return problems


def refusal(settings: Settings) -> str | None:
    """The one line that stops a start on published secrets, or None."""
    problems = published_secrets(settings)
    if not problems:
        return None
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return f"bulkhead: refusing to start with published secrets: {problems[0]}{more}; for a demo, pass {ALLOW_FLAG}"


def _how_to_change(setting: str, from_settings: bool) -> str:
    flag = f"choose another with --{setting}"
    if not from_settings:
        return flag
    return f"{flag}, or listen.{setting} in the settings (BULKHEAD_LISTEN__{setting.upper()})"


_REASONS = {
    errno.EADDRINUSE: ("address already in use: another process listens there", "port"),
    errno.EACCES: ("permission denied: ports below 1024 need privileges", "port"),
    errno.EADDRNOTAVAIL: ("not an address of this machine", "host"),
}


def listening_socket(host: str, port: int, from_settings: bool = True) -> socket.socket:
    """A socket bound to host:port, for the server to listen on (bound here, before any banner, so that a busy
    port is said plainly and no other process can take it in between); ListenError says what to change: the flag,
    and the setting too when the address can come `from_settings`."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn: a restart need not wait for TIME_WAIT
    try:
        sock.bind((host, port))
    except OSError as exc:
        sock.close()
        if isinstance(exc, socket.gaierror):
            reason, setting = f"the host does not resolve ({exc.strerror})", "host"
        else:
            reason, setting = _REASONS.get(exc.errno or 0, (exc.strerror or str(exc), "port"))
        change = _how_to_change(setting, from_settings)
        raise ListenError(f"cannot listen on {host}:{port}: {reason}; {change}") from exc
    return sock
