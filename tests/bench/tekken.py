"""A real model's tokenizer, offline: Mistral's Tekken, converted from the copy the vLLM environment holds.

Nothing can be downloaded here, and the end-to-end model is the tiny one (isolation/sim/tinymodel.py). The vLLM
environment (tests/e2e/vllm_env.py) ships mistral-common, whose package data holds Tekken vocabularies
(`tekken_240911.json`: Pixtral 12B's, 131,072 tokens, the family of Mistral NeMo's), and transformers, which
converts one into a Hugging Face `tokenizer.json` and has mistral-common write its chat template as Jinja. The
conversion runs once in that environment's python (its transformers must not meet the gateway's environment) and
is kept under the cache root, as the tiny tokenizer is; the gateway then loads it like any model's tokenizer.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from tests.e2e.vllm_env import find_python

VOCABULARY = "tekken_240911.json"
CONVERT = f"""
import pathlib, shutil, sys
import mistral_common
from mistral_common.integrations.chat_templates.chat_templates import convert_tokenizer_to_chat_template
from transformers.integrations.mistral.tokenizer import MistralConverter

dest = pathlib.Path(sys.argv[1])
source = dest / "tekken.json"  # the name transformers recognises a Tekken vocabulary by
shutil.copy(pathlib.Path(mistral_common.__file__).parent / "data" / "{VOCABULARY}", source)
MistralConverter(str(source)).converted().save(str(dest / "tokenizer.json"))
(dest / "chat_template.jinja").write_text(convert_tokenizer_to_chat_template(str(source)), encoding="utf-8")
source.unlink()
"""
# Tekken's first three ids; its chat template writes bos_token itself.
SPECIAL = {"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"}


def tekken_tokenizer(cache_root: Path) -> Path | None:
    """The converted tokenizer's directory, made on first use; None without a vLLM environment to convert it."""
    dest = cache_root / "tekken-240911-v1"
    if (dest / "tokenizer_config.json").is_file():
        return dest
    python = find_python()
    if python is None:
        return None
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tekken-", dir=cache_root))
    try:
        subprocess.run(
            [str(python), "-c", CONVERT, str(staging)],
            check=True,
            capture_output=True,
            timeout=600,
            env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PATH": "/usr/bin:/bin"},
        )
        # Written last: a directory without it is a conversion that did not finish.
        (staging / "tokenizer_config.json").write_text(json.dumps(SPECIAL), encoding="utf-8")
        staging.rename(dest)
    except (OSError, subprocess.SubprocessError) as exc:
        shutil.rmtree(staging, ignore_errors=True)
        detail = exc.stderr.decode(errors="replace")[-2000:] if isinstance(exc, subprocess.CalledProcessError) else ""
        print(f"cannot convert the Tekken tokenizer: {exc}\n{detail}", file=sys.stderr)
        if not (dest / "tokenizer_config.json").is_file():  # another process may have won the rename
            return None
    return dest
