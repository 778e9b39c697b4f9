"""EpiCache across a chat's turns (kvopt.episodes): one compressed cache per episode, each holding its budget, the
question routed to the episode its embedding matches, and the state saved and resumed whole (or refused)."""

from __future__ import annotations

import pytest
import torch
from tiny_models import tiny_model

from kvopt.codec import container
from kvopt.codec.errors import CacheCorruptError, CacheModelMismatchError
from kvopt.episodes import EpisodicConversation, episodic_method
from kvopt.errors import KVOptError
from kvopt.methods.epicache import centred, plan_conversation, pooled_states, route

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = "epicache:ratio=0.5,episodes=3,utterances=1,block=64"


def history(tokenizer) -> list[int]:
    lines = [f"User: tell me about the {topic} number {i}.\nAssistant: the {topic} has the value {i * 7}."
             for i in range(4) for topic in ("river", "mountain", "harbour")]  # fmt: skip
    return tokenizer("\n".join(lines) + "\n", add_special_tokens=False)["input_ids"]


def test_each_episode_holds_its_budget_and_the_question_goes_to_the_nearest_centroid(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    ids = history(tokenizer)
    conversation = EpisodicConversation(SPEC)
    assert conversation.needs_consolidation(len(ids)) and not conversation.episodes
    conversation.consolidate(model, tokenizer, ids)
    assert conversation.history == len(ids) and len(conversation.episodes) == 3
    assert not conversation.needs_consolidation(len(ids) + 64)
    question = ids + tokenizer("User: what value has the harbour number 2?\n", add_special_tokens=False)["input_ids"]
    cache, episode = conversation.cache_for(model, tokenizer, question)
    assert cache.get_seq_length() == len(ids)  # the history seen, the question still to feed
    full = 2 * len(ids) * model.config.num_key_value_heads * 8 * 4 * 2  # K and V, 2 layers, head_dim 8, fp32
    assert cache.nbytes() < 0.6 * full  # half of the prompt removed (positions held beside)
    start = plan_conversation(question, tokenizer, 1, episodic_method(SPEC).window).question_start
    query = centred(pooled_states(model, [question[max(start, len(ids)) :]])[0], conversation.mean)
    assert episode == route(query, conversation.centroids)
    with torch.no_grad():  # the restored episode answers like any cache: feed the question, then decode
        logits = model(torch.tensor([question[len(ids):]]), past_key_values=cache,
                       cache_position=torch.arange(len(ids), len(question))).logits  # fmt: skip
    assert torch.isfinite(logits).all()


def test_the_episodes_round_trip_through_one_file_and_refuse_another_model_or_damage(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    ids = history(tokenizer)
    conversation = EpisodicConversation(SPEC)
    conversation.consolidate(model, tokenizer, ids)
    data = conversation.to_bytes(model, {"tokens": ids, "messages": []})
    header, chunks = container.unpack(data, "s")
    back = EpisodicConversation.from_header(header, chunks, model, "s")
    assert (back.spec, back.history, back.episodes) == (conversation.spec, len(ids), conversation.episodes)
    assert torch.equal(back.centroids, conversation.centroids) and header["meta"]["tokens"] == ids
    with pytest.raises(CacheModelMismatchError, match="another model"):
        EpisodicConversation.from_header(header, chunks, tiny_model("qwen2"), "s")
    with pytest.raises(CacheCorruptError, match="damaged"):
        EpisodicConversation.from_header({**header, "history": None}, chunks, model, "s")


def test_a_spec_without_epicache_is_refused():
    with pytest.raises(KVOptError, match="needs epicache in its spec.*epicache:ratio=0.75"):
        EpisodicConversation("snapkv:ratio=0.5")
