"""`bulkhead audit`: its arguments, and running it from the command line."""

from __future__ import annotations

import argparse
import asyncio
import sys
from pathlib import Path

import httpx
import orjson
from rich.console import Console

from isolation.audit.config import AuditConfig, parse_stages
from isolation.audit.render import ProgressBars, print_report
from isolation.audit.report import Report
from isolation.audit.runner import run_audit

# A few connections are all an audit needs (its burst is four streams); more would only add load.
CLIENT_LIMITS = httpx.Limits(max_connections=8, max_keepalive_connections=8)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--endpoint", required=True, help="base URL of an OpenAI-compatible server or gateway")
    parser.add_argument("--model", required=True, help="the model name as the endpoint serves it")
    parser.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="KEY",
        help="API key; give it twice to audit across two tenants (A, then B). Never printed or written. Visible to "
        "every local user in the process list: prefer --key-file",
    )
    parser.add_argument(
        "--key-file",
        type=Path,
        metavar="PATH",
        help="a file with the API key, or two keys on two lines (A, then B); instead of --key",
    )
    parser.add_argument("--limit", type=int, help="context window in tokens (default: the endpoint's max_model_len)")
    parser.add_argument(
        "--stage",
        action="append",
        default=[],
        metavar="ROLE=URL",
        help="an engine behind a disaggregated router, ROLE prefill or decode (repeatable): its KV cache is read "
        "from vLLM's /metrics or SGLang's /get_server_info, and prompts the window admits but the smallest prefill "
        "stage cannot hold are probed; a stage that does not say its capacity stops the audit",
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the full report here as JSON")
    parser.add_argument("--max-requests", type=int, default=300, help="most requests in all, every route (300)")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds for the whole audit (600)")
    parser.add_argument("--rate", type=float, default=2.0, help="requests per second, in bursts of 4 at most (2)")
    parser.add_argument("--rounds", type=int, default=3, help="canary rounds (3); interleaving runs rounds - 1")
    parser.add_argument("--seed", type=int, help="seed for the probes' order and prompts, to replay a run")


def keys_from(args: argparse.Namespace) -> tuple[str, ...]:
    """The keys given with --key, or read from --key-file (one a line; blank lines and # comments skipped)."""
    if args.key_file is None:
        return tuple(args.key)
    if args.key:
        raise ValueError("give the keys with --key or with --key-file, not both")
    try:
        lines = args.key_file.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise ValueError(f"cannot read {args.key_file}: {exc.strerror}") from exc
    keys = tuple(line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#"))
    if not keys:
        raise ValueError(f"{args.key_file} holds no key")
    return keys


def config_from(args: argparse.Namespace) -> AuditConfig:
    return AuditConfig(
        endpoint=args.endpoint,
        model=args.model,
        keys=keys_from(args),
        limit=args.limit,
        max_requests=args.max_requests,
        timeout_s=args.timeout,
        rate=args.rate,
        rounds=args.rounds,
        seed=args.seed,
        stages=parse_stages(args.stage),
    )


async def audit(config: AuditConfig, progress: ProgressBars) -> Report:
    async with httpx.AsyncClient(limits=CLIENT_LIMITS, follow_redirects=False) as client:
        with progress:
            return await run_audit(config, client, progress)


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from(args)
    except ValueError as exc:
        print(f"bulkhead audit: {exc}", file=sys.stderr)
        return 2
    # Progress goes to stderr, the report to stdout, so `> report.txt` keeps only the report.
    report = asyncio.run(audit(config, ProgressBars(Console(stderr=True))))
    # No highlighting: rich would colour numbers and paths inside the endpoint's own text.
    console = Console(highlight=False)
    if not console.is_terminal:
        console.width = 120  # rich's 80 columns for a pipe would fold every finding into a narrow column
    print_report(report, console)
    if args.json is not None:
        args.json.write_bytes(orjson.dumps(report.to_json(), option=orjson.OPT_INDENT_2) + b"\n")
    return report.exit_code
