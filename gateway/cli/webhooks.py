"""`bulkhead webhooks verify`: the check a receiver makes of a notice (gateway/webhooks/verify.py), from the shell.

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
from pathlib import Path
from typing import IO

import orjson

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


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    """`bulkhead webhooks`; it runs itself (`run`). No abbreviated options, as in `bulkhead tenants`."""
    webhooks = commands.add_parser("webhooks", help="check webhook notices as their receiver does")
    verbs = webhooks.add_subparsers(dest="webhooks_command", required=True)
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
