"""A tiny model directory built on this machine: a byte-level BPE tokenizer with a Llama-3-style chat template.

Nothing may be downloaded from a model hub here, so the simulator, the demo and the tests train their own
tokenizer on local text (Python's standard library sources). Byte-level BPE with the full byte alphabet can
encode any UTF-8 input, like the tokenizers of the models users actually run.
"""

from __future__ import annotations

import json
import shutil
import sysconfig
import tempfile
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|begin_of_text|>"
EOS = "<|end_of_text|>"
EOT = "<|eot_id|>"
HEADER_START = "<|start_header_id|>"
HEADER_END = "<|end_header_id|>"
SPECIAL_TOKENS = (BOS, EOS, HEADER_START, HEADER_END, EOT)

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% if tools %}"
    "<|start_header_id|>system<|end_header_id|>\n\nYou may call these tools:\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}<|eot_id|>"
    "{% endif %}"
    "{% for message in messages %}"
    "<|start_header_id|>{{ message['role'] }}<|end_header_id|>\n\n"
    "{% if message['content'] is string %}{{ message['content'] | trim }}{% endif %}"
    "{% if message['tool_calls'] %}{% for call in message['tool_calls'] %}"
    '{"name": "{{ call["function"]["name"] }}", "arguments": {{ call["function"]["arguments"] | tojson }}}'
    "{% endfor %}{% endif %}"
    "<|eot_id|>"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>\n\n{% endif %}"
)

_CORPUS_MODULES = ("json/decoder.py", "json/encoder.py", "textwrap.py", "string.py", "csv.py", "http/client.py")


def _corpus() -> Iterator[str]:
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    for name in _CORPUS_MODULES:
        path = stdlib / name
        if path.is_file():
            yield from path.read_text(encoding="utf-8").splitlines()


def build_tokenizer(dest: Path, vocab_size: int = 4096) -> Path:
    """Train the tokenizer and write tokenizer.json and tokenizer_config.json into dest; returns dest."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(_corpus(), trainer=trainer)
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, tokenizer.token_to_id(BOS))]
    )
    dest.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(dest / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOT,
        "pad_token": EOS,
        "model_max_length": 1_048_576,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }
    (dest / "tokenizer_config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    return dest


def cached_tokenizer(cache_root: Path) -> Path:
    """The tiny tokenizer under cache_root, built on first use; concurrent first uses each build, one wins."""
    dest = cache_root / "tiny-tokenizer-v1"
    if (dest / "tokenizer_config.json").is_file():
        return dest
    cache_root.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix="tiny-tokenizer-", dir=cache_root))
    build_tokenizer(staging)
    try:
        staging.rename(dest)
    except OSError:
        shutil.rmtree(staging, ignore_errors=True)
    return dest
