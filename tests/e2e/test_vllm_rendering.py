"""The gateway's prompt is vLLM's prompt, token for token: a differential check against vLLM's own rendering.

A seeded generator makes chat, Responses and Messages requests that mix the fields that reach a chat template:
tools with and without description, parameters and strict; tool-call history whose arguments are objects,
truncated, arrays, strings or empty; content as strings and as parts, empty ones among them; system blocks and
Claude Code's billing line; reasoning; names; developer messages anywhere; reasoning effort and template variables
(null and "auto" among them); a last assistant turn continued (chat's continue_final_message, a Responses item in
progress, an Anthropic prefill: the last compared with vLLM's chat route, which the gateway asks to continue it).
Each is counted by the gateway (its translation, then the LocalCounter admission uses) and tokenized by vLLM's own
routes on a render-only vLLM (`/v1/chat/completions/render`, `/v1/responses/render`, `/v1/messages/render`: the
routes' own preprocessing, no engine), for three template families: the tiny model's
Llama-style one, ChatML in Qwen3's shape, and Mistral's (content iterated as parts). A request both sides refuse
agrees. A disagreement fails the test with the smallest request that still disagrees the same way.

A sample of them also goes through the gateway to a real vLLM for a one-token answer: its usage must check (never
a 502), equal the gateway's count, and no usage_mismatch may be recorded.
"""

from __future__ import annotations

import itertools
import json
import random
import shutil
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import AbstractContextManager, ExitStack
from pathlib import Path
from typing import Any

import httpx
import pytest

from gateway.api import anthropic_shapes, responses_shapes
from gateway.errors import InvalidRequest
from gateway.pipeline.counting import LocalCounter, Prompt
from gateway.schemas import ChatCompletionRequest, validate
from isolation.tokens import ModelTokenizer
from tests.e2e.conftest import RENDERER, VllmServer, vllm_server
from tests.integration.support import MODEL, auth, metric

SEED = 46
# Requests both sides count, per template: generated until this many are (the three APIs in turn), past those both
# refuse. The cap only ends a generator gone wrong: ~2-3% of what it draws is refused by both.
REQUESTS_PER_TEMPLATE = 2_000
MAX_GENERATED = 3 * REQUESTS_PER_TEMPLATE
ANSWERED_PER_API = 4  # through the gateway to a real vLLM (a forward pass each): the Llama template only
TEMPLATES = Path(__file__).parent / "templates"
ROUTES = {
    "chat": "/v1/chat/completions/render",
    "responses": "/v1/responses/render",
    "messages": "/v1/messages/render",
}
WORDS = (
    "Paris", "the", "weather", "naïve", "日本語", "🙂", "{", "}", '"quoted"', "<tag>", "</think>", "<think>",
    "x-anthropic-billing-header", "tool", "\\n", "ünïcödé", "a,b", "null", "[1]", "<|eot_id|>",
)  # fmt: skip
NAMES = ("get_weather", "search", "lookup_user", "f")
BILLING_WORD = "x-anthropic-billing-header"
BILLING = f"{BILLING_WORD}: cc_version=2.1; cch=9f3a;"
Body = dict[str, Any]
Outcome = int | str  # a count, or why a side refused


class Draw:
    """Random request parts from one seeded generator: the same seed, the same requests."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng
        self.calls = 0

    def chance(self, p: float) -> bool:
        return self.rng.random() < p

    def text(self, empty: bool = True) -> str:
        n = self.rng.choice((0, 1, 2, 5, 12) if empty else (1, 2, 5, 12))
        words = " ".join(self.rng.choice(WORDS) for _ in range(n))
        return self.rng.choice(("", "", " ", "\n", "  \n")) + words + self.rng.choice(("", "", " ", "\n"))

    def system_text(self) -> str:
        if self.chance(0.15):
            return self.rng.choice((BILLING, f"{BILLING}\n{self.text()}"))
        return self.text()

    def parts(self, system: bool = False, kind: str = "text") -> list[dict[str, str]]:
        texts = [self.system_text() if system else self.text() for _ in range(self.rng.randint(1, 3))]
        return [{"type": kind, "text": text} for text in texts]

    def content(self, system: bool = False, kind: str = "text") -> str | list[dict[str, str]]:
        if self.chance(0.4):
            return self.parts(system, kind)
        return self.system_text() if system else self.text()

    def arguments(self) -> str:
        good = json.dumps({"city": self.text(False), "days": self.rng.randint(0, 9)})
        cut = good[: self.rng.randint(0, len(good) - 1)]
        spaced = json.dumps({"q": self.text()}, indent=2)
        return self.rng.choice((good, good, spaced, cut, "[1, 2]", '"a string"', "42", "", "null", "{}", "not json"))

    def call_id(self) -> str:
        self.calls += 1
        return f"call_{self.calls}"

    def schema(self) -> dict[str, Any]:
        city = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        return dict(self.rng.choice((city, {"type": "object"}, {})))

    def effort(self) -> str:
        return str(self.rng.choice(("none", "minimal", "low", "medium", "high")))


def chat_request(d: Draw) -> Body:
    messages: list[dict[str, Any]] = []
    if d.chance(0.5):
        messages.append({"role": d.rng.choice(("system", "developer")), "content": d.content(system=True)})
    turns = d.rng.randint(1, 3)
    for turn in range(turns):
        user: dict[str, Any] = {"role": "user", "content": d.content()}
        if d.chance(0.15):
            user["name"] = d.rng.choice(("alice", "bob"))
        messages.append(user)
        if d.chance(0.1):
            messages.append({"role": d.rng.choice(("system", "developer")), "content": d.content(system=True)})
        if turn == turns - 1:
            break
        assistant: dict[str, Any] = {"role": "assistant", "content": d.content() if d.chance(0.7) else None}
        if d.chance(0.3):
            assistant[d.rng.choice(("reasoning", "reasoning_content"))] = d.text()
        calls = [
            {
                "id": d.call_id(),
                "type": "function",
                "function": {"name": d.rng.choice(NAMES), "arguments": d.arguments()},
            }
            for _ in range(d.rng.choice((0, 0, 1, 2)))
        ]
        if calls:
            assistant["tool_calls"] = calls
        messages.append(assistant)
        for call in calls:
            said: dict[str, Any] = {"role": "tool", "tool_call_id": call["id"], "content": d.content()}
            if d.chance(0.1):
                said["name"] = d.rng.choice(NAMES)
            messages.append(said)
    body: Body = {"model": MODEL, "messages": messages}
    if d.chance(0.5):
        body["tools"] = [chat_tool(d) for _ in range(d.rng.randint(1, 3))]
    if d.chance(0.3):
        body["reasoning_effort"] = d.effort()
    if d.chance(0.3):
        variables: dict[str, Any] = {
            "enable_thinking": d.rng.choice((True, False, None)),
            "custom_instructions": d.rng.choice((d.text(), "auto", None, 3)),
        }
        body["chat_template_kwargs"] = {k: v for k, v in variables.items() if d.chance(0.7)}
    if d.chance(0.1):
        body["add_generation_prompt"] = False
    if d.chance(0.1):
        # A prefill: a last assistant message left open (continue_final_message), mostly without the generation
        # prompt (both are refused).
        messages.append({"role": "assistant", "content": d.content()})
        body["continue_final_message"] = True
        if d.chance(0.8):
            body["add_generation_prompt"] = False
    return body


def chat_tool(d: Draw) -> dict[str, Any]:
    function: dict[str, Any] = {"name": d.rng.choice(NAMES)}
    if d.chance(0.6):
        function["description"] = d.text()
    if d.chance(0.6):
        function["parameters"] = d.schema()
    if d.chance(0.3):
        function["strict"] = d.chance(0.5)
    return {"type": "function", "function": function}


def responses_request(d: Draw) -> Body:
    body: Body = {"model": MODEL}
    if d.chance(0.4):
        body["instructions"] = d.text()
    if d.chance(0.2):
        body["input"] = d.text()
    else:
        items: list[dict[str, Any]] = []
        turns = d.rng.randint(1, 3)
        for turn in range(turns):
            if d.chance(0.15):
                items.append(
                    {"role": d.rng.choice(("system", "developer")), "content": unbilled(d.content(kind="input_text"))}
                )
            user: dict[str, Any] = {"role": "user", "content": d.content(kind="input_text")}
            if d.chance(0.5):
                user["type"] = "message"
            items.append(user)
            if turn < turns - 1:
                items += answer_items(d)
        body["input"] = items
    if d.chance(0.5):
        body["tools"] = [responses_tool(d) for _ in range(d.rng.randint(1, 3))]
    if d.chance(0.3):
        body["reasoning"] = {"effort": d.effort()}
    if isinstance(body["input"], list) and d.chance(0.1):
        # A turn to continue: a last assistant message or reasoning item in progress (should_continue_final_message).
        said = [item for item in answer_items(d) if item["type"] in ("message", "reasoning")] or [
            {"type": "message", "role": "assistant", "content": d.text()}
        ]
        said[-1]["status"] = d.rng.choice(("in_progress", "incomplete"))
        body["input"] += said
    return body


def unbilled(content: str | list[dict[str, str]]) -> str | list[dict[str, str]]:
    """A system text that does not start with Claude Code's billing line. vLLM's Responses route keeps such a line
    in an input_text part (its chat route cuts it from text parts, its Messages route drops the block); the gateway
    asks the chat route, which cuts it, so the two prompts differ by the line: a known difference (docs/api.md)."""
    if isinstance(content, str):
        return _unbilled(content)
    return [{**part, "text": _unbilled(part["text"])} for part in content]


def _unbilled(text: str) -> str:
    return " " + text if text.startswith(BILLING_WORD) else text


def answer_items(d: Draw) -> list[dict[str, Any]]:
    """What a model said in one turn, as Responses items, in any order: reasoning, text, calls and their outputs."""
    said: list[dict[str, Any]] = []
    if d.chance(0.4):
        reasoning: dict[str, Any] = {"type": "reasoning", "summary": []}
        if d.chance(0.7):
            reasoning["content"] = [{"type": "reasoning_text", "text": d.text()} for _ in range(d.rng.randint(1, 2))]
        else:
            reasoning["summary"] = [{"type": "summary_text", "text": d.text()}]
        said.append(reasoning)
    if d.chance(0.7):
        text: Any = d.text()
        if d.chance(0.5):
            text = [{"type": "output_text", "text": d.text(), "annotations": []} for _ in range(d.rng.randint(1, 2))]
        said.append({"type": "message", "role": "assistant", "content": text, "status": "completed"})
    calls = [
        {"type": "function_call", "call_id": d.call_id(), "name": d.rng.choice(NAMES), "arguments": d.arguments()}
        for _ in range(d.rng.choice((0, 0, 1, 2)))
    ]
    d.rng.shuffle(said)
    said += calls
    for call in calls:
        output: Any = d.text() if d.chance(0.7) else d.parts(kind="input_text")
        said.append({"type": "function_call_output", "call_id": call["call_id"], "output": output})
    return said


def responses_tool(d: Draw) -> dict[str, Any]:
    tool: dict[str, Any] = {"type": "function", "name": d.rng.choice(NAMES)}
    if d.chance(0.6):
        tool["description"] = d.text()
    if d.chance(0.6):
        tool["parameters"] = d.schema()
    if d.chance(0.5):
        tool["strict"] = d.chance(0.5)
    return tool


def messages_request(d: Draw) -> Body:
    body: Body = {"model": MODEL, "max_tokens": 1500}  # above the thinking budget, within the window
    if d.chance(0.3):
        body["system"] = d.system_text()
    elif d.chance(0.4):
        body["system"] = [{"type": "text", "text": d.system_text()} for _ in range(d.rng.randint(1, 3))]
    turns: list[dict[str, Any]] = []
    pending: list[str] = []  # the ids of the last assistant turn's tool_use blocks
    last = d.rng.randint(0, 2)
    for turn in range(last + 1):
        blocks: list[dict[str, Any]] = [
            {"type": "tool_result", "tool_use_id": ident, "content": tool_result(d)} for ident in pending
        ]
        blocks += [{"type": "text", "text": d.text()} for _ in range(d.rng.choice((0, 1, 1, 2)) if blocks else 1)]
        d.rng.shuffle(blocks)
        turns.append({"role": "user", "content": d.text() if not pending and d.chance(0.5) else blocks})
        if turn == last:
            break  # a last assistant turn is a prefill: drawn below
        said: list[dict[str, Any]] = []
        if d.chance(0.3):
            said.append({"type": "thinking", "thinking": d.text(), "signature": "sig"})
        if d.chance(0.1):
            said.append({"type": "redacted_thinking", "data": "opaque"})
        said += [{"type": "text", "text": d.text()} for _ in range(d.rng.choice((0, 1, 1, 2)))]
        pending = [d.call_id() for _ in range(d.rng.choice((0, 0, 1, 2)))]
        said += [
            {"type": "tool_use", "id": ident, "name": d.rng.choice(NAMES), "input": {"city": d.text()}}
            for ident in pending
        ]
        turns.append({"role": "assistant", "content": said or d.text()})
    body["messages"] = turns
    if d.chance(0.15):
        # A prefill, continued: text, text after thinking, or thinking alone (nothing to continue: refused).
        thought = {"type": "thinking", "thinking": d.text(), "signature": "sig"}
        prefill = d.rng.choice(
            (d.text(), [{"type": "text", "text": d.text()}], [thought, {"type": "text", "text": d.text()}], [thought])
        )
        turns.append({"role": "assistant", "content": prefill})
    if d.chance(0.5):
        body["tools"] = [messages_tool(d) for _ in range(d.rng.randint(1, 3))]
    if d.chance(0.3):
        body["output_config"] = {"effort": d.rng.choice(("low", "medium", "high"))}
    if d.chance(0.2):
        body["thinking"] = d.rng.choice(({"type": "enabled", "budget_tokens": 1024}, {"type": "adaptive"}))
    return body


def tool_result(d: Draw) -> Any:
    return d.rng.choice((d.text(), None, [{"type": "text", "text": d.text()} for _ in range(d.rng.randint(1, 2))]))


def messages_tool(d: Draw) -> dict[str, Any]:
    tool: dict[str, Any] = {"name": d.rng.choice(NAMES), "input_schema": d.schema() or {"type": "object"}}
    if d.chance(0.6):
        tool["description"] = d.text()
    return tool


GENERATORS: dict[str, Callable[[Draw], Body]] = {
    "chat": chat_request,
    "responses": responses_request,
    "messages": messages_request,
}


def corpus(seed: int) -> Iterator[tuple[str, Body]]:
    """Requests without end, the three APIs in turn, the same for the same seed."""
    draw = Draw(random.Random(seed))
    for kind in itertools.cycle(GENERATORS):
        yield kind, GENERATORS[kind](draw)


def chat_payload(kind: str, body: Body) -> Body:
    """The chat completion the gateway sends upstream for a request of this API, as its surface translates it."""
    if kind == "responses":
        return responses_shapes.chat_payload(validate(responses_shapes.ResponsesRequest, body))
    if kind == "messages":
        return anthropic_shapes.chat_payload(validate(anthropic_shapes.MessagesRequest, body))
    return body


def gateway_count(counter: LocalCounter, kind: str, body: Body) -> Outcome:
    try:
        payload = chat_payload(kind, json.loads(json.dumps(body)))
        validate(ChatCompletionRequest, payload)
        return counter.count_now(Prompt.of_chat(payload))
    except InvalidRequest as refusal:
        return f"gateway refused: {refusal.message}"


def vllm_count(client: httpx.Client, kind: str, body: Body) -> Outcome:
    if kind == "messages" and body["messages"][-1]["role"] == "assistant":
        # A prefill. vLLM's Messages route closes the turn and opens another; Anthropic's answer goes on from it,
        # which is what the gateway asks of vLLM's chat route (continue_final_message): that route's rendering of it.
        try:
            return vllm_count(client, "chat", chat_payload(kind, json.loads(json.dumps(body))))
        except InvalidRequest as refusal:
            return f"no chat request: {refusal.message}"
    answer = client.post(ROUTES[kind], json=body)
    if answer.status_code == 200:
        return len(answer.json()["token_ids"])
    assert answer.status_code < 500, f"vLLM failed on {json.dumps(body)}: {answer.text}"
    return f"vLLM refused ({answer.status_code}): {answer.text[:300]}"


def disagreement(gateway: Outcome, engine: Outcome) -> tuple[bool, bool] | None:
    """None when both sides agree (the same count, or both refuse); else which of them counted."""
    if isinstance(gateway, int) and isinstance(engine, int):
        return None if gateway == engine else (True, True)
    if isinstance(gateway, str) and isinstance(engine, str):
        return None
    return isinstance(gateway, int), isinstance(engine, int)


def smaller(body: Body) -> Iterator[Body]:
    """Every request one step smaller: a field, a list's element, or an element's field left out."""
    for key in body:
        if key not in ("model", "max_tokens", "messages", "input"):
            yield {k: v for k, v in body.items() if k != key}
    for key in ("messages", "input", "tools", "system"):
        items = body.get(key)
        if not isinstance(items, list):
            continue
        for index, item in enumerate(items):
            if len(items) > 1:
                yield {**body, key: items[:index] + items[index + 1 :]}
            if isinstance(item, dict):
                for field in item:
                    if field not in ("role", "type"):
                        trimmed = {k: v for k, v in item.items() if k != field}
                        yield {**body, key: [*items[:index], trimmed, *items[index + 1 :]]}


def shrink(body: Body, still: Callable[[Body], bool]) -> Body:
    while True:
        body_before = body
        for candidate in smaller(body):
            if still(candidate):
                body = candidate
                break
        if body is body_before:
            return body


def model_with(model_dir: Path, destination: Path, template: Path | None) -> Path:
    """The tiny model with another chat template: the same tokenizer and weights."""
    destination.mkdir(parents=True)
    for file in model_dir.iterdir():
        (destination / file.name).symlink_to(file)
    if template is not None:
        config = json.loads((model_dir / "tokenizer_config.json").read_text())
        config["chat_template"] = template.read_text()
        (destination / "tokenizer_config.json").unlink()
        (destination / "tokenizer_config.json").write_text(json.dumps(config))
    return destination


@pytest.fixture(scope="module")
def renderers(
    vllm_python: Path, model_dir: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[dict[str, tuple[Path, VllmServer]]]:
    """A render-only vLLM per template family, started side by side; each with its model directory."""
    root = tmp_path_factory.mktemp("templates")
    dirs = {
        "llama": model_with(model_dir, root / "llama", None),
        "chatml": model_with(model_dir, root / "chatml", TEMPLATES / "chatml.jinja"),
        "mistral": model_with(model_dir, root / "mistral", TEMPLATES / "mistral.jinja"),
    }
    tools = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    with ExitStack() as stack:
        starting: dict[str, AbstractContextManager[VllmServer]] = {
            name: vllm_server(vllm_python, path, root / f"{name}-vllm", extra=tools, entry=RENDERER)
            for name, path in dirs.items()
        }
        with ThreadPoolExecutor(len(starting)) as pool:
            started = {name: pool.submit(server.__enter__) for name, server in starting.items()}
        for name, future in started.items():
            if future.exception() is None:  # one that failed to start stopped itself
                stack.push(starting[name].__exit__)
        yield {name: (dirs[name], future.result()) for name, future in started.items()}
    shutil.rmtree(root, ignore_errors=True)


@pytest.mark.parametrize("family", ["llama", "chatml", "mistral"])
def test_the_gateway_counts_every_generated_request_as_vllm_renders_it(
    renderers: dict[str, tuple[Path, VllmServer]], family: str
) -> None:
    directory, server = renderers[family]
    started = time.perf_counter()
    mismatches: list[str] = []
    counted = refused = 0
    with ThreadPoolExecutor(1) as executor, httpx.Client(base_url=server.url, timeout=60) as client:
        counter = LocalCounter(ModelTokenizer.from_dir(directory), executor, inline_chars=10**9)
        for kind, body in itertools.islice(corpus(SEED), MAX_GENERATED):
            if counted >= REQUESTS_PER_TEMPLATE:
                break
            gateway, engine = gateway_count(counter, kind, body), vllm_count(client, kind, body)
            which = disagreement(gateway, engine)
            if which is None:
                counted += isinstance(gateway, int)
                refused += isinstance(gateway, str)
                continue

            def still(candidate: Body, kind: str = kind, first: Outcome = gateway, then: Outcome = engine) -> bool:
                # The same disagreement: counts that differ, or the same side refusing for the same reason.
                smaller_gateway, smaller_engine = (
                    gateway_count(counter, kind, candidate),
                    vllm_count(client, kind, candidate),
                )
                same = disagreement(smaller_gateway, smaller_engine) == disagreement(first, then)
                return (
                    same
                    and (isinstance(first, int) or smaller_gateway == first)
                    and (isinstance(then, int) or str(smaller_engine)[:60] == then[:60])
                )

            least = shrink(body, still)
            mismatches.append(
                f"{kind}: gateway {gateway_count(counter, kind, least)!r}, vLLM {vllm_count(client, kind, least)!r}"
                f" for {json.dumps(least, ensure_ascii=False)}"
            )
            if len(mismatches) >= 5:
                break
    elapsed = time.perf_counter() - started
    print(f"\n{family}: {counted} counted, {refused} refused by both, {len(mismatches)} mismatches, {elapsed:.1f} s")
    assert not mismatches, "\n".join(mismatches)
    assert counted >= REQUESTS_PER_TEMPLATE, f"only {counted} of {MAX_GENERATED} generated requests were counted"


@pytest.fixture(scope="module")
def http() -> Iterator[httpx.Client]:
    with httpx.Client(timeout=120) as client:
        yield client


def test_a_sample_is_answered_through_the_gateway_with_the_usage_it_counted(
    gateway: str, model_dir: Path, http: httpx.Client
) -> None:
    """One-token answers from a real vLLM: what it reports is what the gateway counted, for every API."""
    with ThreadPoolExecutor(1) as executor:
        counter = LocalCounter(ModelTokenizer.from_dir(model_dir), executor, inline_chars=10**9)
        _answer_sample(gateway, counter, http)


def _answer_sample(gateway: str, counter: LocalCounter, http: httpx.Client) -> None:
    sample: dict[str, list[Body]] = {kind: [] for kind in GENERATORS}
    for kind, body in itertools.islice(corpus(SEED + 1), 60):
        # A thinking budget needs a reasoning parser, which the suite's vLLM is started without (a 400 of its own).
        budgeted = body.get("thinking", {}).get("type") == "enabled"
        if (
            len(sample[kind]) < ANSWERED_PER_API
            and not budgeted
            and isinstance(gateway_count(counter, kind, body), int)
        ):
            sample[kind].append(body)
    for kind, bodies in sample.items():
        for body in bodies:
            expected = gateway_count(counter, kind, body)
            if kind == "chat":
                answer = http.post(f"{gateway}/v1/chat/completions", json={**body, "max_tokens": 1}, headers=auth())
                usage = answer.json().get("usage", {}).get("prompt_tokens")
            elif kind == "responses":
                answer = http.post(f"{gateway}/v1/responses", json={**body, "max_output_tokens": 1}, headers=auth())
                usage = answer.json().get("usage", {}).get("input_tokens")
            else:
                answer = http.post(f"{gateway}/v1/messages", json={**body, "max_tokens": 1}, headers=auth())
                usage = answer.json().get("usage", {}).get("input_tokens")
            assert answer.status_code == 200, f"{kind} {answer.status_code} {answer.text} for {json.dumps(body)}"
            assert usage == expected, f"{kind}: usage {usage}, counted {expected}, for {json.dumps(body)}"
    assert metric(http.get(f"{gateway}/metrics").text, "bulkhead_isolation_events_total", kind="usage_mismatch") == 0
