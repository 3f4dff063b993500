"""The LiteLLM proxy the overhead benchmark compares against: its own virtual environment, outside the repository.

    python -m tests.bench.litellm_env install   # create it, or reuse a finished one; prints its python
    python -m tests.bench.litellm_env --check   # says whether it is installed (and where); exit 1 when not

`litellm[proxy]` pins its own FastAPI, pydantic, httpx, openai and uvicorn, which must not meet the gateway's
environment, so it gets a virtualenv of its own under ~/.cache (or $LITELLM_BENCH_VENV), reused across runs.
Standard library only, like tests/e2e/vllm_env.py, which this mirrors.

`proxy_command` and `PROXY_ENVIRONMENT` are how the benchmark runs it: one worker, no database, no callbacks,
nothing sent anywhere (see `proxy_config`).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

from tests.own_venv import build, ready_python

LITELLM_VERSION = "1.106.12"
LITELLM_SPEC = f"litellm[proxy]=={LITELLM_VERSION}"
VENV_VARIABLE = "LITELLM_BENCH_VENV"
CHECK = "import litellm.proxy.proxy_server; from importlib.metadata import version; print(version('litellm'))"

# Set for the proxy process: what an operator sets when nothing should leave the machine and nothing should cost
# per request beyond the proxying itself.
PROXY_ENVIRONMENT = {
    "LITELLM_LOG": "ERROR",  # no per-request info/debug logging (it also sets uvicorn's log level: no access log)
    "LITELLM_MODE": "PRODUCTION",  # no .env loading, no dev-mode extras
    # The model cost map shipped in the wheel, instead of fetching it from GitHub at start: nothing leaves the
    # machine (which has no internet anyway), and a pinned deployment does not want its prices changing under it.
    "LITELLM_LOCAL_MODEL_COST_MAP": "True",
    "LITELLM_DONT_SHOW_FEEDBACK_BOX": "True",
    "DISABLE_ADMIN_UI": "True",  # the admin UI needs a database, which this proxy has not
}


READY_FILE = "bulkhead-bench-ready"  # kept: environments made before stay reusable


def venv_dir() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or Path.home() / ".cache" / "bulkhead" / "litellm-venv")


def _stamp() -> str:
    return f"{LITELLM_SPEC}\n"


def find_python() -> Path | None:
    """The python of the finished environment, else None."""
    return ready_python(venv_dir(), _stamp(), READY_FILE)


def install() -> Path:
    """Create the environment (a minute or two) unless a finished one is there; returns its python."""
    steps = [["install", "-q", "--upgrade", "pip"], ["install", "-q", LITELLM_SPEC]]
    return build(venv_dir(), _stamp(), READY_FILE, steps, CHECK, {**os.environ, **PROXY_ENVIRONMENT})


def proxy_config(backend_url: str, master_key: str) -> dict[str, Any]:
    """The proxy's config.yaml (as a dict; JSON is valid YAML): one model in front of `backend_url`, an
    OpenAI-compatible server (the simulator speaks vLLM's API), and `master_key` as the one accepted key, so the
    proxy takes the very bytes the gateway does (`Authorization: Bearer <key>`) and checks them, as the gateway
    does. No database: the master key is checked in memory, nothing is spent-tracked or written."""
    return {
        "model_list": [
            {
                "model_name": "tiny-llama",
                "litellm_params": {"model": "hosted_vllm/tiny-llama", "api_base": f"{backend_url}/v1", "api_key": "x"},
            }
        ],
        # No callbacks (the default: nothing is logged or sent anywhere), and no message content kept for any.
        # (`telemetry` is gone from this version: its CLI flag is a documented no-op, and nothing reads it.)
        "litellm_settings": {"turn_off_message_logging": True, "request_timeout": 60},
        # The master key checked in memory: no database, so no key lookups, spend or error logs written anywhere;
        # the two disable_* say so explicitly, and no background health checks call the backend between requests.
        "general_settings": {
            "master_key": master_key,
            "disable_spend_logs": True,
            "disable_error_logs": True,
            "background_health_checks": False,
        },
        # A failed request fails the benchmark (and shows why) instead of being hidden by a retry.
        "router_settings": {"num_retries": 0},
    }


def write_config(path: Path, backend_url: str, master_key: str) -> Path:
    path.write_text(json.dumps(proxy_config(backend_url, master_key), indent=2) + "\n", encoding="utf-8")
    return path


def proxy_command(python: Path, config: Path, port: int) -> list[str]:
    """The proxy, one worker (uvicorn), on 127.0.0.1:`port`."""
    return [
        *(str(python), "-m", "litellm.proxy.proxy_cli"),
        *("--config", str(config), "--host", "127.0.0.1", "--port", str(port), "--num_workers", "1"),
    ]


def main(argv: list[str]) -> int:
    if argv == ["install"]:
        print(install())
        return 0
    if argv in (["--check"], ["install", "--check"]):
        found = find_python()
        if found is None:
            print(f"{LITELLM_SPEC}: not installed at {venv_dir()} (run: python -m tests.bench.litellm_env install)")
            return 1
        print(f"{LITELLM_SPEC}: installed, {found}")
        return 0
    print("usage: python -m tests.bench.litellm_env install|--check", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
