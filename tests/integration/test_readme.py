"""README runs as printed: its Python snippets against `bulkhead serve` on embedded defaults, with only the address
and the key a reader would change; `bulkhead demo` prints the sample README shows; the snippets' imports come with
the extra README installs."""

from __future__ import annotations

import ast
import importlib.metadata
import json
import os
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from tests.integration.support import shows_marker

REPO = Path(__file__).resolve().parents[2]
README = REPO / "README.md"
# What README's snippets say where a reader puts their own: the banner's address and its demo key.
PRINTED_URL = "http://127.0.0.1:8080"
PRINTED_KEY = "bk-..."
# A reader pastes the snippets in order into one Python session: each runs in the namespace the earlier ones left,
# and what it prints is reported on a line of its own.
SESSION = """\
import contextlib, io, json, sys
namespace = {"__name__": "__main__"}
for block in json.load(sys.stdin):
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(compile(block, "README.md", "exec"), namespace)
    print(json.dumps(printed.getvalue()), flush=True)
"""


def python_blocks() -> list[str]:
    return re.findall(r"^```python\n(.*?)^```", README.read_text(encoding="utf-8"), re.DOTALL | re.MULTILINE)


def demo_sample() -> str:
    [sample] = re.findall(r"^```\n(Bulkhead demo:.*?)^```", README.read_text(encoding="utf-8"), re.DOTALL | re.M)
    return str(sample)


def masked(text: str) -> str:
    """What differs from run to run: keys, ports and timings."""
    text = re.sub(r"\bbk-\S+", "bk-KEY", text)
    text = re.sub(r"\b127\.0\.0\.1:\d+", "127.0.0.1:PORT", text)
    return re.sub(r"\b\d+(\.\d+)? ?(ms|s)\b", "TIME", text)


def test_every_python_snippet_runs_as_printed(served: tuple[subprocess.Popen[str], list[str]]) -> None:
    _, banner = served
    text = "\n".join(banner)
    address = re.search(r"listening on (http://127\.0\.0\.1:\d+)", text)
    key = re.search(r"API key \(shown once, valid for this run\): (bk-\S+)", text)
    assert address and key, text
    blocks = python_blocks()
    assert len(blocks) >= 4, "README's OpenAI, Responses, embeddings and Anthropic snippets"
    assert all(PRINTED_KEY in block for block in blocks if "api_key=" in block)
    followed = [block.replace(PRINTED_URL, address.group(1)).replace(PRINTED_KEY, key.group(1)) for block in blocks]
    session = subprocess.run(
        [sys.executable, "-c", SESSION], input=json.dumps(followed), capture_output=True, text=True, timeout=120
    )
    outputs = [json.loads(line) for line in session.stdout.splitlines()]
    failed = len(outputs)
    assert session.returncode == 0, f"README's Python snippet {failed + 1} fails:\n{blocks[failed]}\n{session.stderr}"
    assert all(output.strip() for output in outputs), outputs
    embeddings = next(n for n, block in enumerate(blocks) if "embeddings.create" in block)
    count, tokens = outputs[embeddings].split()
    assert count == "2" and int(tokens) > 2


def test_the_snippets_imports_come_with_the_clients_extra() -> None:
    extras = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))["project"]["optional-dependencies"]
    clients = {re.split(r"[<>=\[ ]", requirement)[0] for requirement in extras["clients"]}
    imported = {
        name.split(".")[0]
        for block in python_blocks()
        for node in ast.walk(ast.parse(block))
        for name in (
            [node.module or ""] if isinstance(node, ast.ImportFrom) else [a.name for a in getattr(node, "names", [])]
        )
        if isinstance(node, ast.Import | ast.ImportFrom)
    }
    distributions = importlib.metadata.packages_distributions()
    for module in imported - sys.stdlib_module_names:
        assert clients & set(distributions.get(module, [])), f"README imports {module}, not in the clients extra"
    assert "pip install -e '.[clients]'" in README.read_text(encoding="utf-8")


def test_the_demo_prints_the_sample_readme_shows(tmp_path: Path) -> None:
    """As a reader runs it: `bulkhead demo` with no options, its tokenizer built on first use."""
    result = subprocess.run(
        [sys.executable, "-m", "gateway", "demo"],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "alice's text in bob's answer: YES" in out, "the engine must really leak for the demo to mean anything"
    assert out.count("CAUGHT") == 5 and "MISSED" not in out
    assert "set by the KV cache of prefill stage 'prefill-0'" in out, "the disaggregated layer, caught at admission"
    assert not shows_marker(out)
    assert masked(out) == masked(demo_sample())
