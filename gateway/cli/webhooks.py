"""`bulkhead webhooks ...`: the check a receiver makes of a notice (gateway/webhooks/verify.py), from the shell; and
the outbox's dead letters, through a running gateway's admin API (found as for every admin command:
gateway/cli/admin.py).

    bulkhead webhooks verify --secret-file FILE --header 'webhook-id: ...' ... < body
    bulkhead webhooks dead-letters [--limit N]
    bulkhead webhooks replay ID
    bulkhead webhooks discard ID

`verify`:

The secret is the receiver's: `whsec_...`, or the text configured as the operators' `isolation.canary.webhook_secret`
(the same key). `--secret` puts it in the process list, where every local user can read it; `--secret-file` does not.
With `--seen FILE`, the ids of notices verified are kept there (JSON: id → timestamp) and one seen within the tolerance
is a replay; ids past the tolerance are forgotten. Exit codes: 0 verified (its JSON is printed), 1 rejected (the reason
is printed), 2 the command could not run (an unreadable file, a bad secret or header).
"""

from __future__ import annotations

import argparse
import fcntl
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import orjson

from gateway.cli.admin import AdminClient, admin_options, print_json, print_table, run_admin
from gateway.webhooks import DEFAULT_TOLERANCE_S, Rejected, secret_key, verify

PROGRAM = "bulkhead webhooks verify"


class CommandError(Exception):
    """The command could not run (exit 2)."""


def _header(text: str) -> tuple[str, str]:
    name, sep, value = text.partition(":")
    if not sep or not name.strip():
        raise argparse.ArgumentTypeError(f"'{text}' is not 'NAME: VALUE'")
    return name.strip().lower(), value.strip()


def _secret(args: argparse.Namespace) -> bytes:
    text: str | None = args.secret
    if args.secret_file is not None:
        try:
            text = args.secret_file.read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CommandError(f"cannot read {args.secret_file}: {exc.strerror}") from exc
    if not text:
        raise CommandError("the secret is empty")
    try:
        return secret_key(text)
    except ValueError as exc:
        raise CommandError(str(exc)) from exc


def _body(source: str) -> bytes:
    if source == "-":
        return sys.stdin.buffer.read()
    try:
        return Path(source).read_bytes()
    except OSError as exc:
        raise CommandError(f"cannot read {source}: {exc.strerror}") from exc


def _open(path: Path) -> IO[bytes]:
    try:
        return open(path, "a+b")
    except OSError as exc:
        raise CommandError(f"cannot open {path}: {exc.strerror}") from exc


def _check(args: argparse.Namespace, seen_file: IO[bytes] | None) -> object:
    key, body, headers = _secret(args), _body(args.body), dict(args.header or [])
    now, tolerance = time.time(), args.tolerance_s
    if seen_file is None:
        return verify(key, body, headers, now=now, tolerance_s=tolerance)
    seen_file.seek(0)
    text = seen_file.read()
    try:
        seen: dict[str, float] = orjson.loads(text) if text.strip() else {}
    except orjson.JSONDecodeError as exc:
        raise CommandError(f"{args.seen} is not the JSON this command keeps there") from exc
    notice = verify(key, body, headers, now=now, tolerance_s=tolerance, seen=seen)
    seen_file.seek(0)
    seen_file.truncate()
    seen_file.write(orjson.dumps(seen))
    return notice


def run(args: argparse.Namespace) -> int:
    try:
        if args.seen is None:
            notice = _check(args, None)
        else:
            with _open(args.seen) as seen_file:
                # One verifier at a time: two receivers checking the same id at once must not both take it as new.
                fcntl.flock(seen_file, fcntl.LOCK_EX)
                notice = _check(args, seen_file)
    except Rejected as exc:
        print(f"{PROGRAM}: rejected: {exc}", file=sys.stderr)
        return 1
    except CommandError as exc:
        print(f"{PROGRAM}: {exc}", file=sys.stderr)
        return 2
    sys.stdout.write(orjson.dumps(notice, option=orjson.OPT_INDENT_2).decode() + "\n")
    return 0


def _dead_letters(answer: dict[str, Any]) -> None:
    rows = [
        [
            m["id"],
            m["target"],
            m["type"],
            m["created_at"],
            str(m["attempts"]),
            "expired" if m["expired"] else m["next_attempt_at"],
            m["last_error"] or "-",
        ]
        for m in answer["dead_letters"]
    ]
    print_table(rows, ["ID", "TARGET", "TYPE", "CREATED", "ATTEMPTS", "NEXT ATTEMPT", "LAST ERROR"])


def _admin(args: argparse.Namespace, admin: AdminClient) -> None:
    """One dead-letter command: the API call, and what it prints."""
    letters = "/webhooks/dead-letters"
    if args.webhooks_command == "dead-letters":
        answer = admin.call("GET", letters, limit=str(args.limit))
        said = None
    elif args.webhooks_command == "replay":
        answer = admin.call("POST", f"{letters}/{args.id}/replay")
        said = f"dead letter {args.id} is due now ({answer['attempts']} attempts so far)"
    else:
        answer = admin.call("DELETE", f"{letters}/{args.id}")
        said = f"dead letter {args.id} discarded"
    if args.json:
        print_json(answer)
    elif said is None:
        _dead_letters(answer)
    else:
        print(said)


def run_admin_command(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    return run_admin("webhooks", _admin, args, environ)


def add_parser(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], admin: Callable[[argparse.Namespace], int]
) -> argparse.ArgumentParser:
    """`bulkhead webhooks`; `verify` runs itself (`run`), the dead-letter commands run by `admin`. No abbreviated
    options, as in `bulkhead tenants`."""
    webhooks = commands.add_parser(
        "webhooks", help="check webhook notices as their receiver does; read, replay or discard dead letters"
    )
    verbs = webhooks.add_subparsers(dest="webhooks_command", required=True)
    common = admin_options()
    listing = verbs.add_parser(
        "dead-letters", parents=[common], allow_abbrev=False, help="notices that keep failing, oldest first"
    )
    listing.add_argument("--limit", type=int, default=100, help="at most this many (100; at most 1000)")
    listing.set_defaults(run=admin)
    for verb, what in (("replay", "send a dead letter again now"), ("discard", "forget a dead letter")):
        one = verbs.add_parser(verb, parents=[common], allow_abbrev=False, help=what)
        one.add_argument("id", metavar="ID", help="its id (its webhook-id)")
        one.set_defaults(run=admin)
    check = verbs.add_parser(
        "verify",
        allow_abbrev=False,
        help="verify a notice: its signature, its time within the tolerance, and with --seen that it is no replay",
    )
    secret = check.add_mutually_exclusive_group(required=True)
    secret.add_argument("--secret", help="whsec_... or the operators' webhook_secret text (seen in the process list)")
    secret.add_argument("--secret-file", type=Path, metavar="FILE", help="a file holding the secret")
    check.add_argument("--body", default="-", metavar="FILE", help="the notice's body as received (default -: stdin)")
    check.add_argument(
        "--header",
        action="append",
        type=_header,
        metavar="'NAME: VALUE'",
        help="a header as received (repeat): webhook-id, webhook-timestamp and webhook-signature",
    )
    check.add_argument(
        "--tolerance-s",
        type=float,
        default=DEFAULT_TOLERANCE_S,
        help="how far the notice's time may be from now (default %(default)g s)",
    )
    check.add_argument(
        "--seen", type=Path, metavar="FILE", help="ids already taken (kept in FILE): a notice seen before is a replay"
    )
    check.set_defaults(run=run)
    return webhooks
