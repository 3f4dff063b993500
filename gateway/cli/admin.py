"""What every command over a gateway's admin API shares (`bulkhead tenants`, `incidents`, `webhooks`): where the
gateway is, its admin token, the HTTP client, the printing, the exit codes.

Where and with what token, first found first: the flags (`--url`, `--admin-token-file`); the settings, as `serve`
reads them (`BULKHEAD_ADMIN_URL` and `BULKHEAD_ADMIN_TOKEN` over `--config FILE`'s `admin_url` and `admin_token`);
else the address the settings listen on (`listen`, http://127.0.0.1:8080 by default). The token is never an option:
a command line is visible to every local user. Exit codes: 0 done, 1 the gateway refused (its message is printed),
2 the command could not run (no token, bad settings, gateway unreachable).
"""

from __future__ import annotations

import argparse
import ipaddress
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import orjson

from gateway.settings import ListenSettings, SettingsError, load_settings

TOKEN_VARIABLE = "BULKHEAD_ADMIN_TOKEN"
URL_VARIABLE = "BULKHEAD_ADMIN_URL"
# What a client dials for an address that means "every interface".
WILDCARDS = {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}


class CommandError(Exception):
    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class Access:
    url: str
    token: str


def listen_url(listen: ListenSettings) -> str:
    """The URL a client on this machine reaches the gateway's listening address at."""
    if listen.port == 0:
        raise CommandError(f"the settings listen on any free port (listen.port 0): give --url or set {URL_VARIABLE}", 2)
    host = WILDCARDS.get(listen.host, listen.host)
    try:
        bracketed = f"[{host}]" if ipaddress.ip_address(host).version == 6 else host
    except ValueError:  # a name
        bracketed = host
    return f"http://{bracketed}:{listen.port}"


def _token_file(path: Path) -> str:
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as exc:
        raise CommandError(f"cannot read {path}: {exc.strerror}", 2) from exc
    if not token:
        raise CommandError(f"{path} is empty", 2)
    return token


def admin_access(args: argparse.Namespace, environ: Mapping[str, str]) -> Access:
    """The gateway's admin URL and token: the flags, else the settings, else where the settings listen."""
    try:
        settings = load_settings(args.config, environ)
    except SettingsError as exc:
        raise CommandError(f"bad settings: {exc}", 2) from exc
    url = args.url or settings.admin_url or listen_url(settings.listen)
    token = _token_file(args.admin_token_file) if args.admin_token_file is not None else settings.admin_token
    if not token:
        raise CommandError(
            f"no admin token: give --admin-token-file FILE, set {TOKEN_VARIABLE}, or admin_token in --config FILE", 2
        )
    return Access(url, token)


class AdminClient:
    def __init__(self, access: Access) -> None:
        self._client = httpx.Client(
            base_url=access.url.rstrip("/") + "/admin", headers={"authorization": f"Bearer {access.token}"}, timeout=30
        )

    def __enter__(self) -> AdminClient:
        return self

    def __exit__(self, *_: object) -> None:
        self._client.close()

    def call(self, method: str, path: str, body: object = None, **params: str) -> Any:
        try:
            response = self._client.request(method, path, json=body, params=params or None)
        except httpx.HTTPError as exc:
            raise CommandError(f"cannot reach {self._client.base_url}: {exc}", 2) from exc
        if response.status_code == 204:
            return None
        try:
            answer = orjson.loads(response.content)
        except orjson.JSONDecodeError as exc:
            raise CommandError(f"HTTP {response.status_code}, not a JSON answer: {response.text[:200]}", 1) from exc
        if response.status_code >= 400:
            error = answer.get("error", {}) if isinstance(answer, dict) else {}
            raise CommandError(f"HTTP {response.status_code} {error.get('code')}: {error.get('message')}", 1)
        return answer


def print_json(answer: object) -> None:
    print(orjson.dumps(answer, option=orjson.OPT_INDENT_2).decode())


def print_table(rows: list[list[str]], header: list[str]) -> None:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    for row in [header, *rows]:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip())


def run_admin(
    command: str, act: Callable[[argparse.Namespace, AdminClient], None], args: argparse.Namespace,
    environ: Mapping[str, str],
) -> int:  # fmt: skip
    """A command over the admin API, with its exit code."""
    try:
        with AdminClient(admin_access(args, environ)) as admin:
            act(args, admin)
    except CommandError as exc:
        print(f"bulkhead {command}: {exc}", file=sys.stderr)
        return exc.code
    return 0


def admin_options() -> argparse.ArgumentParser:
    """The options every admin command takes: the gateway, its settings, the token's file, --json."""
    common = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    common.add_argument(
        "--url",
        help=f"the gateway's base URL (default: ${URL_VARIABLE}, else admin_url or listen of the settings: "
        "http://127.0.0.1:8080)",
    )
    common.add_argument(
        "--config",
        type=Path,
        metavar="FILE",
        help="the gateway's settings file, for its admin_url (or listen) and admin_token (BULKHEAD_* variables "
        "override it, as for serve)",
    )
    common.add_argument(
        "--admin-token-file",
        type=Path,
        metavar="FILE",
        help=f"a file holding the admin token (default: ${TOKEN_VARIABLE}, else admin_token of the settings)",
    )
    common.add_argument("--json", action="store_true", help="print the admin API's JSON answer")
    return common
