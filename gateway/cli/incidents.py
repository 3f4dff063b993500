"""`bulkhead incidents ...`: incidents and their blast radius, through a running gateway's admin API over HTTP.

    bulkhead incidents list
    bulkhead incidents show ID
    bulkhead incidents exposure ID [--requests]
    bulkhead incidents exposure --replica NAME --since TIME [--until TIME]
    bulkhead incidents close ID

The gateway and its admin token as for every admin command (gateway/cli/admin.py: flags, BULKHEAD_ADMIN_URL and
BULKHEAD_ADMIN_TOKEN, the settings file). `--json` prints the API's answer. Exit codes: 0 done, 1 the gateway
refused, 2 the command could not run.
"""

from __future__ import annotations

import argparse
from collections.abc import Mapping
from datetime import UTC, datetime
from typing import Any

from gateway.cli.admin import AdminClient, CommandError, admin_options, print_json, print_table, run_admin
from gateway.incidents.ledger import VERDICTS


def _when(epoch: float | None) -> str:
    if epoch is None:
        return "-"
    return datetime.fromtimestamp(epoch, UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _incident_lines(incident: dict[str, Any]) -> list[str]:
    return [
        f"incident {incident['id']}: replica {incident['replica']}, model {incident['model']}, {incident['state']}",
        f"  opened {_when(incident['opened_at'])} by request {incident['first_request']}; {incident['events']} "
        f"event(s): {', '.join(incident['kinds'])}; confirmed by the canary probe: {incident['confirmed'] or '-'}",
        f"  left rotation {_when(incident['contained_at'])}; closed {_when(incident['closed_at'])}"
        + (f" ({incident['close_reason']})" if incident["close_reason"] else ""),
        f"  victims named by events: {', '.join(incident['victims']) or '-'}; "
        f"recipients: {', '.join(incident['recipients']) or '-'}",
    ]


def _chars(count: int | None) -> str:
    return "-" if count is None else str(count)


def _exposure(report: dict[str, Any], requests: bool) -> None:
    window = report["window"]
    print(
        f"replica {report['replica']} from {_when(window['since'])} ({window['starts']}) "
        f"to {_when(window['until'])} ({window['ends']})"
    )
    if report["incident"] is not None:
        print("\n".join(_incident_lines(report["incident"])))
    counts = ", ".join(f"{report[v]} {v}" for v in VERDICTS if report[v])
    cut = " (cut at --limit: read the rest by time)" if report["truncated"] else ""
    print(
        f"{report['answers']} answer(s) in the window{cut}: {counts or 'none'}; "
        f"suspect characters delivered: {_chars(report['suspect_chars'])}"
    )
    rows = [
        [
            row["tenant"],
            str(row["answers"]),
            *(str(row[v]) for v in VERDICTS),
            str(row["with_leaks"]),
            _chars(row["suspect_chars"]),
        ]
        for row in report["recipients"]
    ]
    if rows:
        print_table(rows, ["TENANT", "ANSWERS", *(v.upper() for v in VERDICTS), "WITH LEAKS", "SUSPECT CHARS"])
    if requests:
        listed = [
            [
                r["request_id"],
                r["tenant"],
                _when(r["start"]),
                _when(r["end"]),
                r["verdict"],
                ",".join(r["events"]),
                _chars(r["suspect_chars"]),
            ]
            for row in report["recipients"]
            for r in row["requests"]
        ]
        if listed:
            print_table(listed, ["REQUEST", "TENANT", "START", "END", "VERDICT", "EVENTS", "SUSPECT CHARS"])


def _run(args: argparse.Namespace, admin: AdminClient) -> None:
    verb = args.incidents_command
    if verb == "list":
        answer = admin.call("GET", "/incidents", limit=str(args.limit))
        if args.json:
            print_json(answer)
            return
        rows = [
            [i["id"], i["replica"], i["state"], _when(i["opened_at"]), str(i["events"]), i["confirmed"] or "-"]
            for i in answer["incidents"]
        ]
        print_table(rows, ["ID", "REPLICA", "STATE", "OPENED", "EVENTS", "CONFIRMED"])
    elif verb in ("show", "close"):
        answer = admin.call("GET" if verb == "show" else "POST", f"/incidents/{args.id}{'/close' * (verb == 'close')}")
        if args.json:
            print_json(answer)
        else:
            print("\n".join(_incident_lines(answer)))
    else:
        limit = str(args.limit)
        if args.id is not None:
            answer = admin.call("GET", f"/incidents/{args.id}/exposure", limit=limit)
        elif args.replica is not None and args.since is not None:
            times = {"since": args.since, **({"until": args.until} if args.until else {})}
            answer = admin.call("GET", "/exposure", replica=args.replica, limit=limit, **times)
        else:
            raise CommandError("give an incident ID, or --replica and --since", 2)
        if args.json:
            print_json(answer)
        else:
            _exposure(answer, args.requests)


def run(args: argparse.Namespace, environ: Mapping[str, str]) -> int:
    return run_admin("incidents", _run, args, environ)


def add_parser(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> argparse.ArgumentParser:
    common = admin_options()
    incidents = commands.add_parser("incidents", help="incidents and their exposure, through a gateway's admin API")
    verbs = incidents.add_subparsers(dest="incidents_command", required=True)
    listing = verbs.add_parser("list", parents=[common], allow_abbrev=False, help="the latest incidents")
    listing.add_argument("--limit", type=int, default=100)
    for verb, what in (("show", "one incident"), ("close", "close an incident (the operator vouches for its replica)")):
        verbs.add_parser(verb, parents=[common], allow_abbrev=False, help=what).add_argument("id", metavar="ID")
    exposure = verbs.add_parser(
        "exposure", parents=[common], allow_abbrev=False, help="every answer a replica served in an incident's window"
    )
    exposure.add_argument("id", metavar="ID", nargs="?", help="the incident (or give --replica and --since)")
    exposure.add_argument("--replica", help="a replica, for a window you name")
    exposure.add_argument("--since", metavar="TIME", help="epoch seconds or ISO 8601 with a zone")
    exposure.add_argument("--until", metavar="TIME", help="epoch seconds or ISO 8601 with a zone (default: now)")
    exposure.add_argument("--limit", type=int, default=10_000, help="answers read at most (10000)")
    exposure.add_argument("--requests", action="store_true", help="list every request, not only the totals")
    return incidents
