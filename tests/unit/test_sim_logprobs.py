"""Token texts as vLLM's logprobs name them, and the simulator's fake logprobs in vLLM's order."""

from __future__ import annotations

from pathlib import Path

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from isolation.sim.detokenizer import Detokenizer
from isolation.sim.generation import WordVocabulary
from isolation.sim.logprobs import Scorer, chat_logprobs, completion_logprobs, prompt_logprobs
from isolation.sim.tinymodel import BOS
from isolation.tokens import ModelTokenizer


@pytest.fixture(scope="module")
def model(tokenizer_dir: Path) -> ModelTokenizer:
    return ModelTokenizer.from_dir(tokenizer_dir)


@pytest.fixture(scope="module")
def detokenizer(model: ModelTokenizer) -> Detokenizer:
    return Detokenizer(model.tokenizer)


@pytest.fixture(scope="module")
def scorer(model: ModelTokenizer, detokenizer: Detokenizer) -> Scorer:
    return Scorer(WordVocabulary.from_tokenizer(model.tokenizer, seed=0), detokenizer)


def encode(model: ModelTokenizer, text: str) -> list[int]:
    return list(model.tokenizer.encode(text, add_special_tokens=False).ids)


@pytest.mark.parametrize("text", ["plain words, and CNRY-ABCDEFGHIJKLMNOPQRST", "héllo 🚀 wörld", "日本語のテキスト"])
def test_token_texts_join_to_the_text_with_split_characters_completed(
    model: ModelTokenizer, detokenizer: Detokenizer, text: str
) -> None:
    ids = encode(model, text)
    texts = detokenizer.token_texts(ids)
    assert "".join(texts) == text
    assert all("\ufffd" not in piece for piece in texts)
    # A character split over tokens is named by the token that completes it; the others are empty.
    assert all(
        piece == detokenizer.decode_all([token])
        for token, piece in zip(ids, texts, strict=True)
        if piece and piece.isascii()
    )


def test_token_texts_name_special_tokens_and_never_complete_a_prompts_first_token(
    model: ModelTokenizer, detokenizer: Detokenizer
) -> None:
    bos = model.tokenizer.token_to_id(BOS)
    assert detokenizer.token_texts([bos]) == [BOS]
    rocket = encode(model, "🚀")
    assert len(rocket) > 1
    # Without context vLLM leaves an unfinished character empty; a prompt's first token is shown as decoded.
    assert detokenizer.token_texts(rocket[:1]) == [""]
    assert detokenizer.token_texts(rocket[:1], context_from=1) == ["\ufffd"]


def test_candidates_put_the_sampled_token_first_then_the_ranks(scorer: Scorer, model: ModelTokenizer) -> None:
    ids = encode(model, " the answer is plain")
    scored = scorer.outputs(ids, top=5)
    assert [position.token_id for position in scored] == ids
    ranks_of_sampled = set()
    for position in scored:
        assert position.candidates is not None
        first, *others = position.candidates
        assert (first.token_id, first.text) == (position.token_id, position.text)
        ranks_of_sampled.add(first.rank)
        assert [c.rank for c in others] == sorted(set(range(1, 6)) - {first.rank})
        by_rank = sorted(position.candidates, key=lambda c: c.rank)
        assert [c.logprob for c in by_rank] == sorted((c.logprob for c in by_rank), reverse=True)
        assert all(c.logprob < 0 for c in position.candidates)
        assert len(position.candidates) == (5 if first.rank <= 5 else 6)
    assert scorer.outputs(ids, top=5) == scored  # deterministic


def test_a_sampled_token_outside_the_top_k_adds_an_entry(scorer: Scorer, model: ModelTokenizer) -> None:
    scored = scorer.outputs(encode(model, " one two three four five six seven eight nine ten"), top=1)
    sizes = {len(position.candidates or ()) for position in scored}
    assert sizes == {1, 2}  # rank 1: the sampled token alone; ranks 2-4: it, then the top 1


def test_renderers_follow_vllms_shapes(scorer: Scorer, model: ModelTokenizer) -> None:
    ids = encode(model, " alpha beta")
    scored = scorer.outputs(ids, top=2)
    chat = chat_logprobs(scored, top=2, as_ids=True)["content"]
    assert [entry["token"] for entry in chat] == [f"token_id:{i}" for i in ids]
    assert all(len(entry["top_logprobs"]) == 2 for entry in chat)
    completion = completion_logprobs(scored, top=2, as_ids=False)
    assert completion["tokens"] == [position.text for position in scored]
    assert completion["text_offset"] == [len("".join(completion["tokens"][:i])) for i in range(len(ids))]
    prompt = prompt_logprobs(scorer.prompt([model.tokenizer.token_to_id(BOS), *ids], top=1))
    assert prompt[0] is None and all(entry is not None and str(ids[i]) in entry for i, entry in enumerate(prompt[1:]))


def test_token_texts_restore_the_space_a_sentencepiece_decoder_strips() -> None:
    tokenizer = Tokenizer(models.WordLevel(vocab={"▁hello": 0, "▁world": 1, "[UNK]": 2}, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Metaspace()
    tokenizer.decoder = decoders.Metaspace()
    assert tokenizer.decode([0]) == "hello"
    assert Detokenizer(tokenizer).token_texts([0, 1]) == [" hello", " world"]
