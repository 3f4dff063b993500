"""The `bulkhead` command: serve, demo, sim, keys, tenants, incidents, webhooks, audit."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from functools import partial
from pathlib import Path
from typing import TypeVar

import httpx
import uvicorn
from starlette.applications import Starlette

from gateway.cli import incidents as incident_commands
from gateway.cli import preflight
from gateway.cli import tenants as tenant_commands
from gateway.cli import webhooks as webhook_commands
from gateway.server import multiprocess
from gateway.server.app import check_files, create_app
from gateway.server.edge import EdgeConfig
from gateway.server.process import configure_logging, run_lifespan
from gateway.server.serving import free_port
from gateway.settings import ListenSettings, Settings, SettingsError, TenantSettings, load_settings
from gateway.tenancy.tenants import hash_key, new_api_key
from isolation.audit import command as audit_command
from isolation.sim import FAULTS, Fault, SimConfig, create_sim_app
from isolation.sim.config import DEFAULT_BLOCK_SIZE, DEFAULT_NUM_GPU_BLOCKS, FLAVORS, fault_blocks
from isolation.sim.pools import incident_prefill_tokens
from isolation.sim.tinymodel import cached_tokenizer

EMBEDDED_MODEL = "tiny-llama"
EMBEDDED_EMBEDDER = "tiny-embed"  # the embedding model beside it, on a simulator of its own
EMBEDDED_CONTEXT = 2048
PR_SET_PDEATHSIG = 1  # <linux/prctl.h>
INTERRUPTED = 130  # the shell's code for a command ended by SIGINT
LISTEN_BACKLOG = 2048  # uvicorn's own, which it sets again when it serves the socket


def _cache_root() -> Path:
    return Path.home() / ".cache" / "bulkhead"


def _die_with_parent() -> Callable[[], None] | None:
    """For Popen's preexec_fn, on Linux: the child gets SIGTERM when this process ends, however it ends (even by
    SIGKILL, where no cleanup of ours runs). prctl is looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    prctl = ctypes.CDLL(None, use_errno=True).prctl
    parent = os.getpid()

    def arrange() -> None:
        prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))
        if os.getppid() != parent:  # the parent ended before prctl took effect
            os._exit(1)

    return arrange


@contextlib.contextmanager
def embedded_simulators(tokenizer: Path) -> Iterator[dict[str, str]]:
    """`bulkhead sim` child processes on free loopback ports, for running with no backend configured: one for the chat
    model, one for the embedding model (a backend serves one task: settings.py), started together; their URLs by
    model.

    Each lives in its own session, so that a Ctrl-C at the terminal reaches only the gateway, which drains its streams
    (served by the simulators) before it stops them; and each dies with the gateway however that ends."""
    urls: dict[str, str] = {}
    children: list[subprocess.Popen[bytes]] = []
    try:
        for model in (EMBEDDED_MODEL, EMBEDDED_EMBEDDER):
            port = free_port()
            command = [sys.executable, "-m", "gateway", "sim", "--port", str(port), "--tokenizer", str(tokenizer)]
            children.append(
                subprocess.Popen([*command, "--model", model], start_new_session=True, preexec_fn=_die_with_parent())
            )
            urls[model] = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 30
        for child, url in zip(children, urls.values(), strict=True):
            while True:
                if child.poll() is not None:
                    raise SystemExit(f"the built-in simulator exited at start (code {child.returncode})")
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise SystemExit("the built-in simulator did not become healthy within 30 s")
                time.sleep(0.1)
        yield urls
    finally:
        for child in children:
            child.terminate()
        for child in children:
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()


def with_embedded_backends(settings: Settings, urls: dict[str, str], tokenizer: Path) -> Settings:
    data = settings.model_dump()
    data["backends"] = [
        {"name": "simulator", "url": urls[EMBEDDED_MODEL]},
        {"name": "simulator-embed", "url": urls[EMBEDDED_EMBEDDER]},
    ]
    window = {"tokenizer": tokenizer, "context_window": EMBEDDED_CONTEXT}
    data["models"] = [
        {"name": EMBEDDED_MODEL, "backends": ["simulator"], **window},
        {"name": EMBEDDED_EMBEDDER, "backends": ["simulator-embed"], "task": "embed", **window},
    ]
    return Settings.model_validate(data)


def with_demo_tenant(settings: Settings, key: str) -> Settings:
    demo = TenantSettings(id="demo", key_hashes=[hash_key(key)])
    return settings.model_copy(update={"tenants": [demo]})


def _settings(args: argparse.Namespace) -> Settings | None:
    """The settings, with logging set up by them; None (after saying why) when they are bad."""
    try:
        settings = load_settings(args.config, os.environ)
    except SettingsError as exc:
        print(f"bulkhead: bad settings: {exc}", file=sys.stderr)
        return None
    configure_logging(settings.log_level)
    return settings


def _listen_at(settings: Settings, host: str | None, port: int | None) -> Settings:
    """The settings with `--host`/`--port` in place of listen.host/listen.port where given."""
    listen = ListenSettings(host=host or settings.listen.host, port=settings.listen.port if port is None else port)
    return settings.model_copy(update={"listen": listen})


def _bind(settings: Settings, count: int) -> socket.socket:
    """The listening socket, bound and listening before the banner (with several processes, uvicorn's supervisor
    hands it to each): a connection made as soon as the banner is out waits in its backlog for a process to take it,
    never refused; ListenError or SettingsError when the start cannot work."""
    sock = preflight.listening_socket(settings.listen.host, settings.listen.port)
    sock.listen(LISTEN_BACKLOG)
    if count > 1:
        try:
            check_files(settings)  # one process checks them in create_app, before its banner
        except SettingsError:
            sock.close()
            raise
    return sock


def _serve(args: argparse.Namespace) -> int:
    # Until the server takes the signal over: SIGTERM ends the start as Ctrl-C does, through the cleanups.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    settings = _settings(args)
    if settings is None:
        return 2
    settings = _listen_at(settings, args.host, args.port)
    count = multiprocess.process_count(args.workers or settings.workers)
    refusal = multiprocess.refusal(settings, count, "serve") or (
        None if args.allow_example_secrets else preflight.refusal(settings)
    )
    if refusal is not None:
        print(refusal, file=sys.stderr)
        return 2
    try:
        sock = _bind(settings, count)
    except preflight.ListenError as exc:
        print(f"bulkhead: {exc}", file=sys.stderr)
        return 2
    except SettingsError as exc:
        print(f"bulkhead: bad settings: {exc}", file=sys.stderr)
        return 2
    with contextlib.ExitStack() as stack:
        stack.callback(sock.close)
        settings = _listen_at(settings, None, sock.getsockname()[1])  # port 0: the one the system chose
        if not settings.backends:
            tokenizer = cached_tokenizer(_cache_root())
            urls = stack.enter_context(embedded_simulators(tokenizer))
            settings = with_embedded_backends(settings, urls, tokenizer)
        demo_key = None
        # With an admin token, tenants are made at runtime (and a demo id could clash with one in Redis).
        if not settings.tenants and settings.admin_token is None:
            demo_key = new_api_key()
            settings = with_demo_tenant(settings, demo_key)
        if count > 1:
            _print_banner(settings, demo_key, count)
            multiprocess.serve(settings, count, sock)
            return 0
        try:
            app = create_app(settings)  # loads the tokenizers: a bad directory stops the start here
        except SettingsError as exc:
            print(f"bulkhead: bad settings: {exc}", file=sys.stderr)
            return 2
        return _run(app, settings, sock, partial(_print_banner, settings, demo_key, count))


@contextlib.contextmanager
def signals_absorbed() -> Iterator[None]:
    """Around uvicorn's Server.run: once shut down, uvicorn raises again the SIGINT/SIGTERM that stopped it, for the
    handler it found to end the process (a KeyboardInterrupt traceback; for SIGTERM, death by the signal before any
    cleanup of ours). The handler it finds here takes the signal and does nothing: the command returns, stops the
    built-in simulator on its way out, and exits 0."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


class _Announced(uvicorn.Server):
    """A server that says it is up (the banner) once its lifespan has started and it serves the socket: a script
    that sends as soon as it reads the banner is answered at once."""

    def __init__(self, config: uvicorn.Config, announce: Callable[[], None]) -> None:
        super().__init__(config)
        self._announce = announce

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        await super().startup(sockets)
        if self.started:
            self._announce()


def _run(app: Starlette, settings: Settings, sock: socket.socket, announce: Callable[[], None]) -> int:
    """Serve on the socket bound before the start until SIGINT/SIGTERM, announced once it serves; 2 when the lifespan
    finds the settings bad (what only it can find, with Redis: a tenant id that is also in the tenant directory; it
    logged the line)."""
    config = EdgeConfig(app, settings.edge, host=settings.listen.host, port=settings.listen.port)
    try:
        with signals_absorbed():
            _Announced(config, announce).run(sockets=[sock])
    except SystemExit:
        if app.state.bad_settings is not None:
            return 2
        raise
    return 0


def _print_banner(settings: Settings, demo_key: str | None, processes: int) -> None:
    address = f"http://{settings.listen.host}:{settings.listen.port}"
    lines = [f"bulkhead: listening on {address}" + (f" with {processes} worker processes" if processes > 1 else "")]
    for backend in settings.backends:
        lines.append(f"bulkhead: backend '{backend.name}' at {backend.url}")
    lines.append(f"bulkhead: state in {'redis' if settings.redis_url else 'memory (this process only)'}")
    if not settings.tenants and demo_key is None:
        lines.append(f"bulkhead: no tenants in the settings: make them with `bulkhead tenants create --url {address}`")
    if demo_key is not None:
        model = settings.models[0].name if settings.models else "MODEL"
        lines.append(f"bulkhead: demo tenant API key (shown once, valid for this run): {demo_key}")
        lines.append(
            f"curl -s {address}/v1/chat/completions -H 'Authorization: Bearer {demo_key}' "
            f"-H 'Content-Type: application/json' "
            f"""-d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hello!"}}]}}'"""
        )
    print("\n".join(lines), flush=True)


def _worker(args: argparse.Namespace) -> int:
    settings = _settings(args)
    if settings is None:
        return 2
    if settings.redis_url is None:
        print(
            "bulkhead worker: needs redis_url (without Redis the queue lives inside `bulkhead serve`)", file=sys.stderr
        )
        return 2
    count = multiprocess.process_count(args.workers or settings.workers)
    where = settings.redis_url.split("@")[-1]
    print(f"bulkhead worker: {count} process(es) of {args.concurrency} queue worker(s) on {where}", flush=True)
    if count > 1:
        return multiprocess.run_queue_workers(settings, count, args.concurrency)
    asyncio.run(run_lifespan(create_app(settings, workers=args.concurrency)))
    return 0


def _keys_create(args: argparse.Namespace) -> int:
    key = new_api_key()
    print(f"API key for tenant '{args.tenant}' (shown once; store it now): {key}")
    print("Add its hash to the tenant in your config:")
    print(f'  - id: {args.tenant}\n    key_hashes: ["{hash_key(key)}"]')
    return 0


def _tenants(args: argparse.Namespace) -> int:
    return tenant_commands.run(args, os.environ)


def _incidents(args: argparse.Namespace) -> int:
    return incident_commands.run(args, os.environ)


def _webhooks(args: argparse.Namespace) -> int:
    return webhook_commands.run_admin_command(args, os.environ)


def _disaggregated(args: argparse.Namespace) -> bool:
    return bool(args.disaggregated) or args.prefill_kv_tokens is not None or args.decode_kv_tokens is not None


def _fault(args: argparse.Namespace) -> Fault:
    """The --fault given, else stale-kv for a disaggregated deployment (it is the incident's replay), else none."""
    if args.fault is not None:
        fault: Fault = args.fault
        return fault
    return "stale-kv" if _disaggregated(args) else "none"


def _sized_for_fault(args: argparse.Namespace) -> bool:
    """A stale fault and no KV cache size given: the cache is made smaller than the window, or the fault never shows."""
    return (
        _fault(args) != "none" and not _disaggregated(args) and args.block_size is None and args.num_gpu_blocks is None
    )


def sim_config(args: argparse.Namespace) -> SimConfig:
    """`bulkhead sim`'s settings; with a stale fault and no KV cache size given, a cache of half the window.
    Disaggregated, the prefill pool is --prefill-kv-tokens, else --num-gpu-blocks × --block-size, else the
    incident's share of the window (681,280 of 1,048,576); the decode pool --decode-kv-tokens, else twice the
    window (SimConfig's default)."""
    block_size = DEFAULT_BLOCK_SIZE if args.block_size is None else args.block_size
    blocks = args.num_gpu_blocks
    if blocks is None:
        blocks = fault_blocks(args.max_model_len, block_size) if _sized_for_fault(args) else DEFAULT_NUM_GPU_BLOCKS
    prefill = args.prefill_kv_tokens
    if _disaggregated(args) and prefill is None:
        given = args.num_gpu_blocks is not None
        prefill = blocks * block_size if given else incident_prefill_tokens(args.max_model_len, block_size)
    return SimConfig(
        tokenizer_dir=args.tokenizer or cached_tokenizer(_cache_root()),
        model=args.model,
        max_model_len=args.max_model_len,
        block_size=block_size,
        num_gpu_blocks=blocks,
        ttft_ms=args.ttft_ms,
        tokens_per_s=args.tokens_per_s,
        output_tokens=args.output_tokens,
        seed=args.seed,
        fault=_fault(args),
        max_num_seqs=args.max_num_seqs,
        batch_slowdown=args.batch_slowdown,
        api_key=args.api_key,
        engine=args.engine,
        prefill_kv_tokens=prefill,
        decode_kv_tokens=args.decode_kv_tokens,
    )


def _say_kv_cache(config: SimConfig, sized: bool) -> None:
    kv, window = config.kv_cache_size_tokens, config.max_model_len
    if config.disaggregated:
        prefill = config.prefill_blocks * config.block_size
        reach = ""
        if config.fault != "none" and prefill < window:
            reach = f": prompts between the prefill pool's {prefill:,} tokens and the window reach it"
        print(
            f"bulkhead sim: disaggregated: the router advertises the {window:,}-token window only (no KV cache); "
            f"each pool's KV cache is read from its stage's URL; fault {config.fault}{reach}",
            flush=True,
        )
    if config.fault_unreachable:
        what = "every KV pool" if config.disaggregated else f"the KV cache ({kv} tokens)"
        print(
            f"bulkhead sim: warning: --fault {config.fault} cannot trigger: {what} is not smaller "
            f"than the window (--max-model-len {window}), so the window refuses every prompt the fault acts on; "
            + ("give smaller --prefill-kv-tokens" if config.disaggregated else "give fewer --num-gpu-blocks"),
            file=sys.stderr,
            flush=True,
        )
    elif sized:
        print(
            f"bulkhead sim: --fault {config.fault}: KV cache of {kv} tokens ({config.num_gpu_blocks} blocks of "
            f"{config.block_size}), half the {window}-token window, so prompts between the two reach the fault "
            "(--num-gpu-blocks and --block-size set it)",
            flush=True,
        )


class _Following(uvicorn.Server):
    """A stage's server: it leaves the signals to the router's, which stops it when it stops."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _serve_together(
    router: uvicorn.Server, sock: socket.socket, stages: list[tuple[uvicorn.Server, socket.socket]]
) -> None:
    """The router and its stages in one event loop, until a signal stops the router (then the stages)."""
    running = [asyncio.ensure_future(server.serve(sockets=[stage_sock])) for server, stage_sock in stages]
    try:
        await router.serve(sockets=[sock])
    finally:
        for server, _ in stages:
            server.should_exit = True
        await asyncio.gather(*running, return_exceptions=True)


def _sim(args: argparse.Namespace) -> int:
    disaggregated = _disaggregated(args)
    wanted = [(args.host, args.port)]
    if disaggregated:
        wanted += [(args.host, args.prefill_port or 0), (args.host, args.decode_port or 0)]
    with contextlib.ExitStack() as stack:
        try:
            socks = [
                stack.enter_context(preflight.listening_socket(host, port, from_settings=False))
                for host, port in wanted
            ]
            config = sim_config(args)
        except (preflight.ListenError, ValueError) as exc:
            print(f"bulkhead sim: {exc}", file=sys.stderr)
            return 2
        flavor = " (SGLang)" if config.engine == "sglang" else ""
        print(
            f"bulkhead sim: serving '{args.model}'{flavor} on http://{args.host}:{socks[0].getsockname()[1]}",
            flush=True,
        )
        _say_kv_cache(config, _sized_for_fault(args))
        app = create_sim_app(config)
        router = uvicorn.Server(uvicorn.Config(app, access_log=False, log_level="warning"))
        stages: list[tuple[uvicorn.Server, socket.socket]] = []
        for (role, stage), stage_sock in zip(app.state.stages.items(), socks[1:], strict=True):
            kv = app.state.engine.pools[role].capacity_tokens
            print(
                f"bulkhead sim: {role} stage ({kv:,}-token KV cache) on http://{args.host}:{stage_sock.getsockname()[1]}",
                flush=True,
            )
            stages.append((_Following(uvicorn.Config(stage, access_log=False, log_level="warning")), stage_sock))
        with signals_absorbed():
            if stages:
                asyncio.run(_serve_together(router, socks[0], stages))
            else:
                router.run(sockets=[socks[0]])
    return 0


def _demo(args: argparse.Namespace) -> int:
    from gateway.cli.demo import run_demo

    return run_demo(args.tokenizer or cached_tokenizer(_cache_root()))


def _audit(args: argparse.Namespace) -> int:
    return audit_command.run(args)


WORKERS_HELP = "processes, or auto (one per core); default: the settings' workers (1); more than 1 needs redis_url"


def _workers(value: str) -> int | str:
    if value == "auto":
        return value
    try:
        count = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number of processes or 'auto': {value!r}") from None
    if count < 1:
        raise argparse.ArgumentTypeError("at least 1 process")
    return count


N = TypeVar("N", int, float)


def _number(parse: Callable[[str], N], name: str, low: N, high: N | None = None) -> Callable[[str], N]:
    """An argparse type: `parse`d, then within [low, high] (NaN is within nothing)."""

    def check(value: str) -> N:
        try:
            number = parse(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"not {name}: {value!r}") from None
        if not (number >= low and (high is None or number <= high)):
            bounds = f"{low:g} or more" if high is None else f"{low:g} to {high:g}"
            raise argparse.ArgumentTypeError(f"must be {bounds}, got {value}")
        return number

    return check


_port = _number(int, "a port number", 0, 65535)
_at_least_one = _number(int, "a whole number", 1)
_not_negative = _number(float, "a number", 0.0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="bulkhead", description="Multi-tenant LLM gateway in front of vLLM.")
    commands = parser.add_subparsers(dest="command", required=True)

    serve = commands.add_parser("serve", help="run the gateway")
    serve.add_argument("--config", type=Path, help="YAML settings file (BULKHEAD_* variables override it)")
    serve.add_argument("--workers", type=_workers, help=WORKERS_HELP)
    serve.add_argument("--host", help="address to listen on (default: the settings' listen.host, 127.0.0.1)")
    serve.add_argument("--port", type=_port, help="port to listen on (default: the settings' listen.port, 8080)")
    serve.add_argument(
        preflight.ALLOW_FLAG,
        action="store_true",
        help="start even with the published example key hashes or placeholder secrets of deploy/ (demos only)",
    )
    serve.set_defaults(run=_serve)

    worker = commands.add_parser("worker", help="run queue workers for the async API (needs redis_url)")
    worker.add_argument("--config", type=Path, help="YAML settings file (BULKHEAD_* variables override it)")
    worker.add_argument("--workers", type=_workers, help=WORKERS_HELP)
    worker.add_argument("--concurrency", type=int, default=2, help="queue workers in each process (default 2)")
    worker.set_defaults(run=_worker)

    keys = commands.add_parser("keys", help="manage tenant API keys")
    key_commands = keys.add_subparsers(dest="keys_command", required=True)
    create = key_commands.add_parser("create", help="make a new API key and print its hash for the config")
    create.add_argument("--tenant", required=True)
    create.set_defaults(run=_keys_create)

    tenant_commands.add_parser(commands).set_defaults(run=_tenants)
    incident_commands.add_parser(commands).set_defaults(run=_incidents)
    webhook_commands.add_parser(commands, admin=_webhooks)  # verify sets what runs it

    demo = commands.add_parser("demo", help="replay the stale-KV incident and show what each defence catches")
    demo.add_argument("--tokenizer", type=Path, help="Hugging Face tokenizer directory (default: a built tiny one)")
    demo.set_defaults(run=_demo)

    sim = commands.add_parser("sim", help="run the vLLM-compatible engine simulator")
    sim.add_argument("--host", default="127.0.0.1")
    sim.add_argument("--port", type=_port, default=8000)
    sim.add_argument("--model", default=EMBEDDED_MODEL)
    sim.add_argument("--tokenizer", type=Path, help="Hugging Face tokenizer directory (default: a built tiny one)")
    sim.add_argument("--max-model-len", type=int, default=EMBEDDED_CONTEXT)
    # No defaults here: whether they were given decides how a fault's KV cache is sized (sim_config).
    sim.add_argument("--block-size", type=int, help=f"tokens per KV block ({DEFAULT_BLOCK_SIZE})")
    sim.add_argument(
        "--num-gpu-blocks",
        type=int,
        help=f"KV blocks ({DEFAULT_NUM_GPU_BLOCKS}; with a --fault and neither this nor --block-size: half the window)",
    )
    sim.add_argument("--ttft-ms", type=float, default=0.0, help="time to first token")
    sim.add_argument("--tokens-per-s", type=float, default=0.0, help="decode speed; 0 = as fast as possible")
    sim.add_argument("--output-tokens", type=int, default=16, help="length of an answer max_tokens does not cut")
    sim.add_argument("--seed", type=int, default=0)
    sim.add_argument(
        "--fault",
        choices=FAULTS,
        help="stale-kv: answer over-capacity prompts from stale KV blocks of earlier requests (the incident); "
        "stale-kv-logprobs / stale-kv-tool-names: the same, leaked through logprobs / a tool call's name "
        "(default: none; stale-kv with --disaggregated)",
    )
    sim.add_argument(
        "--max-num-seqs",
        type=_at_least_one,
        default=256,
        help="requests running at once, as vLLM's --max-num-seqs; the rest wait, first come first served "
        "(default %(default)s)",
    )
    sim.add_argument(
        "--batch-slowdown",
        type=_not_negative,
        default=0.0,
        help="how a full batch slows pacing: with R requests running, the TTFT and token interval are multiplied "
        "by 1 + this x (R - 1) / --max-num-seqs (default %(default)s: no slowdown)",
    )
    sim.add_argument(
        "--api-key", help="as vLLM's --api-key: /v1/* answers 401 without `Authorization: Bearer KEY` (default: none)"
    )
    sim.add_argument("--engine", choices=FLAVORS, default="vllm", help="whose server to play (default %(default)s)")
    sim.add_argument(
        "--disaggregated",
        action="store_true",
        help="a router (advertising the window only) in front of a prefill pool and a decode pool, each served on "
        "a port of its own; the incident's replay: --fault defaults to stale-kv",
    )
    sim.add_argument(
        "--prefill-kv-tokens",
        type=int,
        help="the prefill pool's KV cache, whole blocks (implies --disaggregated; default: the incident's 681,280 of "
        "1,048,576 of the window)",
    )
    sim.add_argument(
        "--decode-kv-tokens",
        type=int,
        help="the decode pool's KV cache, whole blocks (implies --disaggregated; default: twice the window)",
    )
    sim.add_argument("--prefill-port", type=_port, help="the prefill stage's port (default: a free one)")
    sim.add_argument("--decode-port", type=_port, help="the decode stage's port (default: a free one)")
    sim.set_defaults(run=_sim)

    audit = commands.add_parser("audit", help="test an OpenAI-compatible endpoint for cross-request leaks")
    audit_command.add_arguments(audit)
    audit.set_defaults(run=_audit)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        code: int = args.run(args)
    except KeyboardInterrupt:  # Ctrl-C before a server took over the signal (at start-up, in a client command)
        return INTERRUPTED
    return code
