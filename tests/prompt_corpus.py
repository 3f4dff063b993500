"""A corpus of 200+ varied prompts for proving that the gateway counts tokens exactly as the backend does.

Built from texts chosen for what tokenizers get wrong (empty, whitespace runs, emoji sequences, CJK, RTL with
bidi marks, combining marks, code, JSON, special-token look-alikes, very long), each put in several shapes:
a completion prompt, a single user turn, system + user, a multi-turn conversation, content parts, and a tool
call round trip with tool definitions.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

TEXTS: list[str] = [
    "",
    " ",
    "  \n\n\t  ",
    " " * 1000,
    "\n" * 50,
    "Hello, world!",
    "hello world hello world hello world",
    "The quick brown fox jumps over the lazy dog.",
    "I'm sure you'll see they've done it; won't they?",
    "🎉",
    "👩‍👩‍👧‍👦 family, 🏳️‍🌈 flag, 👍🏽 tone, 🇯🇵🇫🇷 flags",
    "😀😃😄😁😆😅🤣😂🙂🙃" * 20,
    "你好，世界！这是一个测试。",
    "東京は日本の首都です。ひらがな、カタカナ、漢字。",
    "안녕하세요 세계",
    "مرحبا بالعالم، هذا اختبار.",
    "שלום עולם \u200fזה מבחן\u200e mixed RTL",
    "नमस्ते दुनिया",
    "สวัสดีชาวโลก",
    "e\u0301 a\u0300 n\u0303 Z\u0351\u0352\u0353 combining",
    "Ünïcödé straße façade naïve Ωμέγα Привет мир",
    "def fib(n: int) -> int:\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "function f(x) { return x.map((y) => y * 2).filter(Boolean); }",
    "SELECT id, name FROM users WHERE created_at > NOW() - INTERVAL '7 days' ORDER BY id;",
    '#include <stdio.h>\nint main(void) { printf("%d\\n", 42); return 0; }',
    json.dumps({"user": {"id": 7, "tags": ["a", "b"], "nested": {"ok": True, "pi": 3.14159}}}),
    json.dumps([{"k": i, "v": "x" * i} for i in range(10)], indent=2),
    "# Title\n\n- item **bold** _it_\n- `code`\n\n> quote\n\n| a | b |\n|---|---|\n| 1 | 2 |",
    "https://example.com/path?q=1&r=%20x#frag and mailto:someone@example.com",
    "0 1 12 123 1234 12345 123456 3.14159 -2.5e-10 0xDEADBEEF 1_000_000",
    "<|eot_id|> <|begin_of_text|> <|start_header_id|>user<|end_header_id|> look-alikes",
    "<s></s>[INST] [/INST] <|im_start|>system<|im_end|>",
    "tab\tseparated\tvalues\nnew\tline",
    "\u200b\u200c\u200d\ufeff zero-width and BOM",
    "control \x01\x02\x07 chars",
    "a" * 3000,
    "word " * 1500,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit. " * 120,
    "混合 mixed テキスト with emoji 🚀 and code `x = 1` and RTL مرحبا",
    "\\n \\t \\\\ \\u0041 escaped-looking text",
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        },
    }
]


@dataclass(frozen=True)
class CorpusPrompt:
    name: str
    chat: dict[str, Any] | None = None  # messages (and tools) for /v1/chat/completions
    prompt: str | None = None  # for /v1/completions

    def tokenize_body(self, model: str) -> dict[str, Any]:
        if self.chat is not None:
            return {"model": model, **self.chat}
        return {"model": model, "prompt": self.prompt}


def _shapes(index: int, text: str) -> list[CorpusPrompt]:
    return [
        CorpusPrompt(f"{index}-completion", prompt=text),
        CorpusPrompt(f"{index}-user", chat={"messages": [{"role": "user", "content": text}]}),
        CorpusPrompt(
            f"{index}-system-user",
            chat={"messages": [{"role": "system", "content": text}, {"role": "user", "content": "Reply briefly."}]},
        ),
        CorpusPrompt(
            f"{index}-multi-turn",
            chat={
                "messages": [
                    {"role": "user", "content": text},
                    {"role": "assistant", "content": "Understood."},
                    {"role": "user", "content": f"And again: {text}"},
                ]
            },
        ),
        CorpusPrompt(
            f"{index}-parts-empty-middle",
            chat={"messages": [{"role": "user", "content": [{"type": "text", "text": t} for t in (text, "", "?")]}]},
        ),
        CorpusPrompt(
            f"{index}-parts",
            chat={
                "messages": [
                    {"role": "user", "content": [{"type": "text", "text": text}, {"type": "text", "text": "!"}]}
                ]
            },
        ),
        CorpusPrompt(
            f"{index}-tools",
            chat={
                "tools": TOOLS,
                "messages": [
                    {"role": "user", "content": text},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [
                            {
                                "id": f"call_{index}",
                                "type": "function",
                                "function": {"name": "get_weather", "arguments": json.dumps({"city": text[:40]})},
                            }
                        ],
                    },
                    {"role": "tool", "tool_call_id": f"call_{index}", "content": json.dumps({"temp_c": index})},
                ],
            },
        ),
    ]


CORPUS: list[CorpusPrompt] = [shape for index, text in enumerate(TEXTS) for shape in _shapes(index, text)]
assert len(CORPUS) >= 200
