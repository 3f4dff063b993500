"""`bulkhead tenants ...`: tenants and their API keys, through a running gateway's admin API over HTTP.

The gateway and its admin token are found as for every admin command (gateway/cli/admin.py): flags, then
BULKHEAD_ADMIN_URL / BULKHEAD_ADMIN_TOKEN, then the settings file's. A new key is printed once, when it is made; it
is kept nowhere.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from typing import Any

from gateway.cli.admin import AdminClient, admin_options, print_json, print_table, run_admin
from gateway.settings import TenantLimits

PAGE = 1000


def _limit(text: str) -> tuple[str, int | str]:
    name, sep, value = text.partition("=")
    if not sep or not name:
        raise argparse.ArgumentTypeError(f"'{text}' is not NAME=VALUE")
    return name, int(value) if value.isdigit() else value


def _limits_text(limits: dict[str, Any]) -> str:
    """Only the limits that differ from the defaults: what the operator set."""
    defaults = TenantLimits().model_dump(mode="json")
    set_ = [f"{name}={value}" for name, value in limits.items() if value != defaults.get(name)]
    return ",".join(set_) or "-"


def _tenants_list(admin: AdminClient, args: argparse.Namespace) -> None:
    tenants: list[dict[str, Any]] = []
    after = ""
    while True:
        page = admin.call("GET", "/tenants", limit=str(PAGE), after=after)
        tenants += page["tenants"]
        if page["next"] is None:
            break
        after = page["next"]
    if args.json:
        print_json(tenants)
        return
    rows = [
        [t["id"], t["source"], "yes" if t["enabled"] else "no", ",".join(t["models"]) or "-", _limits_text(t["limits"])]
        for t in tenants
    ]
    print_table(rows, ["ID", "SOURCE", "ENABLED", "MODELS", "LIMITS"])


def _keys_list(admin: AdminClient, args: argparse.Namespace) -> None:
    keys = admin.call("GET", f"/tenants/{args.tenant}/keys")["keys"]
    if args.json:
        print_json(keys)
        return
    rows = [
        [
            k["key_id"],
            k["label"] or "-",
            k["hash_prefix"],
            k["created_at"] or "-",
            (k["expires_at"] or "never") + (" (expired)" if k["expired"] else ""),
            k["last_used_at"] or "-",
        ]
        for k in keys
    ]
    print_table(rows, ["KEY ID", "LABEL", "HASH", "CREATED", "EXPIRES", "LAST USED"])


def _new_key(answer: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print_json(answer)
        return
    print(f"API key for tenant '{answer['tenant']}' (shown once; store it now): {answer['key']}")
    print(f"key id: {answer['key_id']}" + (f", expires {answer['expires_at']}" if answer["expires_at"] else ""))
    previous = answer.get("previous")
    if previous is not None:
        print(f"the previous key {previous['key_id']} stays valid until {previous['expires_at']}")


def _webhook(answer: dict[str, Any], args: argparse.Namespace) -> None:
    if args.json:
        print_json(answer)
        return
    print(f"notices of tenant '{args.tenant}' go to {answer['url']}")
    if "secret" in answer:
        print(f"signing secret (shown once; give it to the receiver): {answer['secret']}")


def _run(args: argparse.Namespace, admin: AdminClient) -> None:
    """One tenant command: the API call, and what it prints."""
    match args.tenants_command, getattr(args, "keys_command", None):
        case "create", _:
            body: dict[str, Any] = {"id": args.tenant, "enabled": not args.disabled}
            if args.model:
                body["models"] = args.model
            if args.limit:
                body["limits"] = dict(args.limit)
            print_json(admin.call("POST", "/tenants", body))
        case "list", _:
            _tenants_list(admin, args)
        case "show", _:
            print_json(admin.call("GET", f"/tenants/{args.tenant}"))
        case ("disable" | "enable") as verb, _:
            print_json(admin.call("PATCH", f"/tenants/{args.tenant}", {"enabled": verb == "enable"}))
        case "delete", _:
            admin.call("DELETE", f"/tenants/{args.tenant}")
            print(f"tenant '{args.tenant}' and all its keys deleted")
        case "keys", "create":
            body = {k: v for k, v in (("label", args.label), ("expires_at", args.expires_at)) if v is not None}
            _new_key(admin.call("POST", f"/tenants/{args.tenant}/keys", body), args)
        case "keys", "list":
            _keys_list(admin, args)
        case "keys", "revoke":
            admin.call("DELETE", f"/tenants/{args.tenant}/keys/{args.key_id}")
            print(f"key {args.key_id} of tenant '{args.tenant}' revoked")
        case "keys", "rotate":
            body = {"overlap_s": args.overlap_s, **({"label": args.label} if args.label else {})}
            _new_key(admin.call("POST", f"/tenants/{args.tenant}/keys/{args.key_id}/rotate", body), args)
        case "webhook", "set":
            body = {"url": args.webhook_url, "rotate_secret": args.rotate_secret}
            _webhook(admin.call("PUT", f"/tenants/{args.tenant}/webhook", body), args)
        case "webhook", "show":
            _webhook(admin.call("GET", f"/tenants/{args.tenant}/webhook"), args)
        case "webhook", "delete":
            admin.call("DELETE", f"/tenants/{args.tenant}/webhook")
            print(f"the notices webhook of tenant '{args.tenant}' deleted")
        case "notices", _:
            print_json(admin.call("GET", f"/tenants/{args.tenant}/notices"))


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    return run_admin("tenants", _run, args, environ)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`bulkhead tenants`; the caller sets what runs it. No abbreviated options: `--admin-token SECRET` would be
    taken for `--admin-token-file` and the secret read as a file name."""
    common = admin_options()
    tenant = argparse.ArgumentParser(add_help=False, allow_abbrev=False, parents=[common])
    tenant.add_argument("tenant", metavar="TENANT", help="the tenant's id")

    tenants = commands.add_parser("tenants", help="manage tenants and their API keys through a gateway's admin API")
    verbs = tenants.add_subparsers(dest="tenants_command", required=True)
    create = verbs.add_parser("create", parents=[tenant], allow_abbrev=False, help="create a tenant")
    create.add_argument("--model", action="append", help='a model it may use (repeat; default "*": all)')
    create.add_argument(
        "--limit", action="append", type=_limit, metavar="NAME=VALUE", help="a limit, e.g. requests_per_minute=60"
    )
    create.add_argument("--disabled", action="store_true", help="create it disabled")
    verbs.add_parser("list", parents=[common], allow_abbrev=False, help="every tenant, configured and managed")
    verbs.add_parser("show", parents=[tenant], allow_abbrev=False, help="one tenant")
    verbs.add_parser(
        "disable",
        parents=[tenant],
        allow_abbrev=False,
        help="refuse its keys on every instance (running requests finish)",
    )
    verbs.add_parser("enable", parents=[tenant], allow_abbrev=False, help="serve its keys again")
    verbs.add_parser("delete", parents=[tenant], allow_abbrev=False, help="delete a tenant and all its keys")

    keys = verbs.add_parser("keys", help="a tenant's API keys").add_subparsers(dest="keys_command", required=True)
    key_create = keys.add_parser("create", parents=[tenant], allow_abbrev=False, help="a new key, printed once")
    key_create.add_argument("--label", help="what the key is for")
    key_create.add_argument("--expires-at", metavar="TIME", help="RFC 3339, e.g. 2027-01-01T00:00:00Z")
    keys.add_parser("list", parents=[tenant], allow_abbrev=False, help="the tenant's keys (hash prefixes, never keys)")
    revoke = keys.add_parser(
        "revoke", parents=[tenant], allow_abbrev=False, help="refuse a key on every instance, at once"
    )
    revoke.add_argument("key_id", metavar="KEY_ID")
    rotate = keys.add_parser(
        "rotate", parents=[tenant], allow_abbrev=False, help="a new key; the old one valid --overlap-s more"
    )
    rotate.add_argument("key_id", metavar="KEY_ID")
    rotate.add_argument("--overlap-s", type=float, default=0.0, help="seconds the old key stays valid (0)")
    rotate.add_argument("--label", help='the new key\'s label (default: "rotated from KEY_ID")')

    webhook = verbs.add_parser("webhook", help="where a tenant's isolation notices are POSTed").add_subparsers(
        dest="keys_command", required=True
    )
    webhook_set = webhook.add_parser(
        "set", parents=[tenant], allow_abbrev=False, help="register or move it; the secret is printed when made"
    )
    webhook_set.add_argument("webhook_url", metavar="URL", help="https, to a public address")
    webhook_set.add_argument("--rotate-secret", action="store_true", help="a new secret (the old one ends now)")
    webhook.add_parser("show", parents=[tenant], allow_abbrev=False, help="its URL (never its secret)")
    webhook.add_parser("delete", parents=[tenant], allow_abbrev=False, help="no more webhook notices")
    verbs.add_parser("notices", parents=[tenant], allow_abbrev=False, help="what incidents told the tenant")
    return tenants
