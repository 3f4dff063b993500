"""The bodies of vLLM's other routes of an embedding model: /pooling, /v1/score and /v1/rerank, strict as schemas.py's.

Each is a list of inputs to embed, each admitted like an embeddings input (`inputs`: each text and where it is in the
request, which errors name). Refused, with their reasons: truncation (the gateway counts what is sent, whole), vLLM's
chat-template fields of scoring (a cross-encoder's; an embedding model scores with none), multimodal inputs.
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

from pydantic import Field, model_validator

from gateway.schemas import (
    MAX_EMBEDDING_INPUTS,
    UNCOUNTABLE,
    AnyRequest,
    EmbeddingRequest,
    ModelName,
    ShortText,
    _refuse_known,
    _Strict,
)

ScoreText = Annotated[str, Field(min_length=1)]
ScoreTexts = ScoreText | Annotated[list[ScoreText], Field(min_length=1, max_length=MAX_EMBEDDING_INPUTS)]
# What scoring takes that changes what the engine embeds: not counted, so not accepted.
SCORING_REFUSED = {
    "max_tokens_per_query": UNCOUNTABLE,
    "max_tokens_per_doc": UNCOUNTABLE,
    "padding": UNCOUNTABLE,
    "instruction": UNCOUNTABLE,
    "chat_template_kwargs": UNCOUNTABLE,
}
# The two sides a score request may name, as vLLM reads them (its four request shapes).
SCORE_SIDES = (("queries", "documents"), ("queries", "items"), ("data_1", "data_2"), ("text_1", "text_2"))


class PoolingRequest(EmbeddingRequest):
    """vLLM's /pooling for an embedding model: an embeddings request whose vectors come back under `data`."""

    task: Literal["embed"] | None = None


class _Scoring(_Strict):
    stream: ClassVar[bool] = False
    n: ClassVar[int] = 1
    stop: ClassVar[None] = None

    model: ModelName
    user: ShortText | None = None
    cache_salt: Annotated[str, Field(max_length=1024)] | None = None
    use_activation: bool | None = None

    @model_validator(mode="before")
    @classmethod
    def _refused(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for name in data.keys() & SCORING_REFUSED.keys():
            raise ValueError(f"'{name}' is not accepted: {SCORING_REFUSED[name]}")
        # `documents` is a field here, not a chat request's refused one.
        _refuse_known({name: value for name, value in data.items() if name not in cls.model_fields})
        return data

    def sides(self) -> tuple[tuple[str, str | list[str]], tuple[str, str | list[str]]]:
        """Each side's field and its text or texts."""
        raise NotImplementedError

    @property
    def inputs(self) -> list[tuple[str, str | list[int]]]:
        """Every text and where it is, first side then second, in the order the engine embeds them."""
        return [
            (name if isinstance(texts, str) else f"{name}[{index}]", text)
            for name, texts in self.sides()
            for index, text in enumerate(_listed(texts))
        ]


class ScoreRequest(_Scoring):
    """vLLM's /v1/score: one score per pair, a lone first text against each second one (1:N) or pair by pair (N:N)."""

    queries: ScoreTexts | None = None
    documents: ScoreTexts | None = None
    items: ScoreTexts | None = None
    data_1: ScoreTexts | None = None
    data_2: ScoreTexts | None = None
    text_1: ScoreTexts | None = None
    text_2: ScoreTexts | None = None

    @model_validator(mode="after")
    def _one_pair(self) -> ScoreRequest:
        given = {name for pair in SCORE_SIDES for name in pair if getattr(self, name) is not None}
        if given not in [set(pair) for pair in SCORE_SIDES]:
            raise ValueError(
                "a score request takes queries and documents (or items), data_1 and data_2, or text_1 and text_2"
            )
        (_, first), (_, second) = self.sides()
        if len(_listed(first)) > 1 and len(_listed(first)) != len(_listed(second)):
            raise ValueError(
                f"{len(_listed(first))} first texts for {len(_listed(second))} second ones: 1:1, 1:N or N:N"
            )
        return self

    def sides(self) -> tuple[tuple[str, str | list[str]], tuple[str, str | list[str]]]:
        one, other = next(pair for pair in SCORE_SIDES if all(getattr(self, name) is not None for name in pair))
        return (one, getattr(self, one)), (other, getattr(self, other))

    @property
    def pairs(self) -> int:
        """How many scores an answer holds."""
        return len(_listed(self.sides()[1][1]))


class RerankRequest(_Scoring):
    """vLLM's /v1/rerank: the documents scored against the query, best first, the `top_n` best (0: all)."""

    query: ScoreText
    documents: ScoreTexts
    top_n: Annotated[int, Field(ge=0)] = 0

    def sides(self) -> tuple[tuple[str, str | list[str]], tuple[str, str | list[str]]]:
        return ("query", self.query), ("documents", self.documents)

    @property
    def texts(self) -> list[str]:
        """The documents, by index."""
        return _listed(self.documents)

    @property
    def ranked(self) -> int:
        """How many results an answer holds."""
        return min(self.top_n or len(self.texts), len(self.texts))


def _listed(texts: str | list[str]) -> list[str]:
    return [texts] if isinstance(texts, str) else texts


InputsRequest = EmbeddingRequest | ScoreRequest | RerankRequest  # PoolingRequest is an EmbeddingRequest
INPUTS_REQUESTS = (EmbeddingRequest, ScoreRequest, RerankRequest)
PipelineRequest = AnyRequest | ScoreRequest | RerankRequest  # a request any route takes
