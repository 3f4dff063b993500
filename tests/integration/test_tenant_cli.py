"""`bulkhead tenants ...`, the other admin commands and `bulkhead audit --key-file` as a user runs them: real processes
against a real gateway. The gateway and its admin token come from flags, the environment or the settings file; the
token never from the command line."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from gateway.tenancy.tenants import hash_key
from tests.integration.conftest import GatewayFactory
from tests.integration.support import ALICE_KEY, MODEL, address, auth, chat_body
from tests.integration.tenant_support import ADMIN_TOKEN, new_id
from tests.redis_server import free_port


def bulkhead(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    environment = {k: v for k, v in os.environ.items() if not k.startswith("BULKHEAD_")}
    return subprocess.run(
        [sys.executable, "-m", "gateway", *args],
        capture_output=True,
        text=True,
        timeout=120,
        env={**environment, **(env or {})},
    )


@pytest.fixture
def gateway(make_gateway: GatewayFactory, sim_url: str) -> str:
    return make_gateway({"sim": sim_url}, admin_token=ADMIN_TOKEN)


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "admin-token"
    path.write_text(ADMIN_TOKEN + "\n")
    path.chmod(0o600)
    return path


def served(gateway: str, key: str) -> int:
    body = chat_body(max_tokens=2)
    return httpx.post(f"{gateway}/v1/chat/completions", json=body, headers=auth(key), timeout=10).status_code


def new_key(output: str) -> str:
    found = re.search(r"\(shown once; store it now\): (bk-\S+)", output)
    assert found, output
    return found.group(1)


def test_a_tenant_and_its_keys_are_managed_from_the_command_line(gateway: str, token_file: Path) -> None:
    def tenants(*args: str) -> subprocess.CompletedProcess[str]:
        result = bulkhead("tenants", *args, "--url", gateway, "--admin-token-file", str(token_file))
        assert result.returncode == 0, result.stderr
        return result

    tenant_id = new_id()
    created = json.loads(tenants("create", tenant_id, "--model", MODEL, "--limit", "max_output_tokens=8").stdout)
    assert created["id"] == tenant_id and created["models"] == [MODEL] and created["limits"]["max_output_tokens"] == 8
    listing = tenants("list").stdout
    assert re.search(rf"^{tenant_id}\s+api\s+yes\s+{MODEL}\s+max_output_tokens=8$", listing, re.M), listing
    assert re.search(r"^alice\s+config\s+yes\s+\*\s+-$", listing, re.M), listing
    assert json.loads(tenants("show", tenant_id).stdout)["enabled"] is True

    made = tenants("keys", "create", tenant_id, "--label", "ci")
    key = new_key(made.stdout)
    key_id = re.search(r"key id: (key-[0-9a-f]+)", made.stdout)
    assert key_id and served(gateway, key) == 200
    keys = tenants("keys", "list", tenant_id).stdout
    assert key_id.group(1) in keys and hash_key(key)[:19] in keys and key not in keys and "ci" in keys

    rotated = tenants("keys", "rotate", tenant_id, key_id.group(1), "--overlap-s", "0")
    successor = new_key(rotated.stdout)
    assert "previous key" in rotated.stdout
    assert served(gateway, key) == 401 and served(gateway, successor) == 200

    assert json.loads(tenants("disable", tenant_id).stdout)["enabled"] is False
    assert served(gateway, successor) == 403
    tenants("enable", tenant_id)
    assert served(gateway, successor) == 200
    successor_id = json.loads(tenants("keys", "list", tenant_id, "--json").stdout)[-1]["key_id"]
    assert "revoked" in tenants("keys", "revoke", tenant_id, successor_id).stdout
    assert served(gateway, successor) == 401
    assert "deleted" in tenants("delete", tenant_id).stdout


def test_the_admin_token_comes_from_a_file_or_the_environment_only(gateway: str, token_file: Path) -> None:
    refused = bulkhead("tenants", "list", "--url", gateway, "--admin-token", ADMIN_TOKEN)
    assert refused.returncode == 2 and "unrecognized arguments: --admin-token" in refused.stderr
    missing = bulkhead("tenants", "list", "--url", gateway)
    assert (
        missing.returncode == 2 and "--admin-token-file" in missing.stderr and "BULKHEAD_ADMIN_TOKEN" in missing.stderr
    )
    from_environment = bulkhead("tenants", "show", "alice", "--url", gateway, env={"BULKHEAD_ADMIN_TOKEN": ADMIN_TOKEN})
    assert from_environment.returncode == 0 and json.loads(from_environment.stdout)["source"] == "config"
    wrong = bulkhead("tenants", "list", "--url", gateway, env={"BULKHEAD_ADMIN_TOKEN": "not-the-admin-token"})
    assert wrong.returncode == 1 and "HTTP 401" in wrong.stderr
    unknown = bulkhead("tenants", "show", "nobody-here", "--url", gateway, "--admin-token-file", str(token_file))
    assert unknown.returncode == 1 and "HTTP 404 not_found: No tenant 'nobody-here'." in unknown.stderr
    unreachable = bulkhead("tenants", "list", "--url", "http://127.0.0.1:9", "--admin-token-file", str(token_file))
    assert unreachable.returncode == 2 and "cannot reach" in unreachable.stderr
    # (argparse repeats the arguments it refuses, the token among them: the user's own, on their own terminal.)
    for result in (missing, from_environment, wrong, unknown, unreachable):
        assert ADMIN_TOKEN not in result.stdout + result.stderr


# One command of each over the admin API, and what its success prints.
ADMIN_COMMANDS = [
    (("tenants", "show", "alice"), '"source": "config"'),
    (("incidents", "list"), "ID  REPLICA  STATE"),
    (("webhooks", "dead-letters"), "ID  TARGET  TYPE"),
]
DEAD = f"http://127.0.0.1:{free_port()}"  # no gateway there


def admin_config(tmp_path: Path, **settings: object) -> Path:
    path = tmp_path / "bulkhead.yaml"
    path.write_text(json.dumps(settings))  # JSON is YAML
    return path


def test_each_admin_command_finds_the_gateway_and_token_in_the_environment(gateway: str) -> None:
    for command, printed in ADMIN_COMMANDS:
        result = bulkhead(*command, env={"BULKHEAD_ADMIN_URL": gateway, "BULKHEAD_ADMIN_TOKEN": ADMIN_TOKEN})
        assert result.returncode == 0, result.stderr
        assert printed in result.stdout


def test_the_admin_commands_find_them_in_the_settings_file(gateway: str, tmp_path: Path) -> None:
    (command, printed), (other, other_printed) = ADMIN_COMMANDS[:2]
    by_url = admin_config(tmp_path, admin_url=gateway, admin_token=ADMIN_TOKEN)
    result = bulkhead(*command, "--config", str(by_url))
    assert result.returncode == 0, result.stderr
    assert printed in result.stdout
    # Without admin_url: where the file says the gateway listens.
    host, port = address(gateway)
    by_listen = admin_config(tmp_path, listen={"host": "0.0.0.0", "port": port}, admin_token=ADMIN_TOKEN)
    result = bulkhead(*other, "--config", str(by_listen))
    assert result.returncode == 0 and host == "127.0.0.1", result.stderr
    assert other_printed in result.stdout


def test_flags_override_the_environment_which_overrides_the_file(
    gateway: str, token_file: Path, tmp_path: Path
) -> None:
    wrong = "not-the-admin-token-at-all"
    shown = ("tenants", "show", "alice", "--config", str(admin_config(tmp_path, admin_url=DEAD, admin_token=wrong)))
    refused = bulkhead(*shown, "--url", gateway)
    assert refused.returncode == 1 and "HTTP 401" in refused.stderr, "--url over the file's; the file's token"
    assert bulkhead(*shown, "--url", gateway, "--admin-token-file", str(token_file)).returncode == 0
    environment = {"BULKHEAD_ADMIN_URL": gateway, "BULKHEAD_ADMIN_TOKEN": ADMIN_TOKEN}
    assert bulkhead(*shown, env=environment).returncode == 0, "the variables over the file"
    flags = ("--url", gateway, "--admin-token-file", str(token_file))
    flagged = bulkhead(*shown, *flags, env={"BULKHEAD_ADMIN_URL": DEAD, "BULKHEAD_ADMIN_TOKEN": wrong})
    assert flagged.returncode == 0, "the flags over the variables"
    assert wrong not in refused.stdout + refused.stderr


def test_without_a_token_anywhere_each_source_is_named_and_a_bad_file_is_said(gateway: str, tmp_path: Path) -> None:
    missing = bulkhead("incidents", "list", "--url", gateway)
    assert missing.returncode == 2
    for source in ("--admin-token-file", "BULKHEAD_ADMIN_TOKEN", "admin_token in --config"):
        assert source in missing.stderr
    bad = bulkhead("webhooks", "dead-letters", "--config", str(admin_config(tmp_path, admin_url="gateway:8080")))
    assert bad.returncode == 2
    assert "bulkhead webhooks: bad settings: " in bad.stderr and "admin_url: must start with http://" in bad.stderr


def test_a_dead_letter_not_there_is_refused_by_the_gateway(gateway: str, token_file: Path) -> None:
    result = bulkhead("webhooks", "replay", "msg_nope", "--url", gateway, "--admin-token-file", str(token_file))
    assert result.returncode == 1 and "HTTP 404 not_found: No dead letter with id 'msg_nope'." in result.stderr


def test_audit_reads_its_keys_from_a_file(gateway: str, tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("# identity A\nbk-not-a-key-of-this-gateway\n")
    report = tmp_path / "report.json"
    audit = ("audit", "--endpoint", gateway, "--model", MODEL, "--max-requests", "4", "--json", str(report))
    refused = bulkhead(*audit, "--key-file", str(keys))
    assert refused.returncode == 2
    # The key in the file is the one that was sent (and refused).
    assert "refused identity A's key: HTTP 401" in json.loads(report.read_text())["error"]
    keys.write_text(f"{ALICE_KEY}\n")
    accepted = bulkhead(*audit, "--key-file", str(keys))
    assert "refused" not in (json.loads(report.read_text())["error"] or "")
    assert ALICE_KEY not in accepted.stdout + accepted.stderr + report.read_text()
    both = bulkhead(*audit, "--key-file", str(keys), "--key", ALICE_KEY)
    assert both.returncode == 2 and "not both" in both.stderr
    keys.write_text("\n# nothing\n")
    empty = bulkhead(*audit, "--key-file", str(keys))
    assert empty.returncode == 2 and "holds no key" in empty.stderr
