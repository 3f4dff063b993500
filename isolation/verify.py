"""Checks on a backend's answer that do not trust its status code: does its accounting match what was sent?

A backend that silently swapped or truncated the prompt (the stale-KV incident answered an over-long prompt
from a one-token placeholder, with HTTP 200) reports a prompt_tokens that differs from the gateway's count.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class UsageProblem:
    reason: str
    # The backend's prompt count when it alone does not add up (the rest of the usage does): whether the backend read
    # another prompt or counts the one sent otherwise is for its own count of that prompt to tell.
    prompt_tokens: int | None = None


def usage_problem(
    usage: Mapping[str, Any] | None, sent_prompt_tokens: int, tolerance: int, max_completion_tokens: int | None
) -> UsageProblem | None:
    """Why this usage cannot be trusted, or None when it adds up."""
    if usage is None:
        return UsageProblem("the answer carries no usage, so what the backend processed cannot be checked")
    prompt, completion, total = usage.get("prompt_tokens"), usage.get("completion_tokens"), usage.get("total_tokens")
    if not isinstance(prompt, int):
        return UsageProblem("the answer's usage has no prompt_tokens")
    if any(isinstance(count, int) and count < 0 for count in (prompt, completion, total)):
        return UsageProblem(f"the answer's usage has a negative count: {prompt}, {completion}, {total}")
    if isinstance(completion, int) and isinstance(total, int) and total != prompt + completion:
        return UsageProblem(f"total_tokens {total} is not prompt_tokens {prompt} + completion_tokens {completion}")
    if isinstance(completion, int) and max_completion_tokens is not None and completion > max_completion_tokens:
        return UsageProblem(
            f"the backend reports {completion} completion tokens; at most {max_completion_tokens} were allowed"
        )
    if abs(prompt - sent_prompt_tokens) > tolerance:
        return UsageProblem(f"the backend reports {prompt} prompt tokens but {sent_prompt_tokens} were sent", prompt)
    return None
