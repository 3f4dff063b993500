"""A tiny model directory built on this machine: a byte-level BPE tokenizer with a Llama-3-style chat template,
and (for a real vLLM) a two-layer Llama with random weights.

Nothing may be downloaded from a model hub here, so the simulator, the demo and the tests train their own
tokenizer on local text (Python's standard library sources). Byte-level BPE with the full byte alphabet can
encode any UTF-8 input, like the tokenizers of the models users actually run.

The weights are written as safetensors by hand (an 8-byte header length, a JSON header, raw little-endian
floats), so building them needs neither torch nor numpy and this package never imports either.
"""

from __future__ import annotations

import json
import random
import shutil
import struct
import sys
import sysconfig
import tempfile
from array import array
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


# The smallest Llama a CPU vLLM serves: its attention kernels need head_dim ≥ 32.
LLAMA_SHAPE = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
}
MAX_POSITIONS = 2048
_INIT_SCALE = 0.02  # the usual initializer range: logits stay small, so sampling is near uniform


def _llama_tensors(vocab: int) -> dict[str, tuple[int, ...]]:
    hidden, inner = LLAMA_SHAPE["hidden_size"], LLAMA_SHAPE["intermediate_size"]
    kv = LLAMA_SHAPE["num_key_value_heads"] * LLAMA_SHAPE["head_dim"]
    q = LLAMA_SHAPE["num_attention_heads"] * LLAMA_SHAPE["head_dim"]
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (vocab, hidden)}
    for layer in range(LLAMA_SHAPE["num_hidden_layers"]):
        prefix = f"model.layers.{layer}."
        shapes |= {
            prefix + "input_layernorm.weight": (hidden,),
            prefix + "self_attn.q_proj.weight": (q, hidden),
            prefix + "self_attn.k_proj.weight": (kv, hidden),
            prefix + "self_attn.v_proj.weight": (kv, hidden),
            prefix + "self_attn.o_proj.weight": (hidden, q),
            prefix + "post_attention_layernorm.weight": (hidden,),
            prefix + "mlp.gate_proj.weight": (inner, hidden),
            prefix + "mlp.up_proj.weight": (inner, hidden),
            prefix + "mlp.down_proj.weight": (hidden, inner),
        }
    shapes |= {"model.norm.weight": (hidden,), "lm_head.weight": (vocab, hidden)}
    return shapes


def _write_safetensors(path: Path, shapes: dict[str, tuple[int, ...]], seed: int) -> None:
    rng = random.Random(seed)
    header: dict[str, object] = {"__metadata__": {"format": "pt"}}
    blobs: list[bytes] = []
    offset = 0
    for name, shape in shapes.items():
        size = 1
        for dim in shape:
            size *= dim
        if name.endswith("norm.weight"):
            values = array("f", [1.0]) * size
        else:
            values = array("f", [(rng.random() * 2 - 1) * _INIT_SCALE for _ in range(size)])
        if sys.byteorder != "little":
            values.byteswap()
        blob = values.tobytes()
        header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        blobs.append(blob)
        offset += len(blob)
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the format aligns the data to 8 bytes
    with path.open("wb") as out:
        out.write(struct.pack("<Q", len(encoded)))
        out.write(encoded)
        for blob in blobs:
            out.write(blob)


def build_model(dest: Path, seed: int = 0) -> Path:
    """A tiny Llama that vLLM can load from dest: the tokenizer (trained here unless dest has one), config.json,
    generation_config.json and model.safetensors with random weights (~5 MB); returns dest."""
    if not (dest / "tokenizer.json").is_file():
        build_tokenizer(dest)
    tokenizer = Tokenizer.from_file(str(dest / "tokenizer.json"))
    vocab = int(tokenizer.get_vocab_size(with_added_tokens=True))
    bos, eot = tokenizer.token_to_id(BOS), tokenizer.token_to_id(EOT)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **LLAMA_SHAPE,
        "vocab_size": vocab,
        "max_position_embeddings": MAX_POSITIONS,
        "hidden_act": "silu",
        "rms_norm_eps": 1e-5,
        "rope_theta": 10000.0,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "bos_token_id": bos,
        "eos_token_id": eot,
        "torch_dtype": "bfloat16",
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2), encoding="utf-8")
    generation = {"bos_token_id": bos, "eos_token_id": eot, "do_sample": True}
    (dest / "generation_config.json").write_text(json.dumps(generation, indent=2), encoding="utf-8")
    _write_safetensors(dest / "model.safetensors", _llama_tensors(vocab), seed)
    return dest
