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
from kvopt.methods.epicache import plan_conversation, route

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
    question = ids + tokenizer("User: what value has the harbour number 2?\n", add_special_tokens=False)["input_ids"]
    conversation.prepare(model, tokenizer, question[:40])
    assert not conversation.episodes  # less than a block of history: nothing to cluster yet
    conversation.prepare(model, tokenizer, question)  # the history before the question is clustered
    start = plan_conversation(question, tokenizer, 1, episodic_method(SPEC).window).question_start
    assert conversation.history == start > 64 and len(conversation.episodes) == 3 and conversation.continues(question)
    cache, episode = conversation.cache_for(model, tokenizer, question)
    assert cache.get_seq_length() == start  # the history seen, the question still to feed
    full = 2 * start * model.config.num_key_value_heads * 8 * 4 * 2  # K and V, 2 layers, head_dim 8, fp32
    assert cache.nbytes() < 0.6 * full  # half of the prompt removed (positions held beside)
    assert episode == route(conversation.space.points(model, [question[start:]])[0], conversation.centroids)
    with torch.no_grad():  # the restored episode answers like any cache: feed the question, then decode
        logits = model(torch.tensor([question[start:]]), past_key_values=cache,
                       cache_position=torch.arange(start, len(question))).logits  # fmt: skip
    assert torch.isfinite(logits).all()
    conversation.prepare(model, tokenizer, question[1:60])  # another conversation: the episodes start over
    assert not conversation.episodes and conversation.history == 0


@pytest.mark.parametrize("embedding", ["tfidf", "states"])
def test_the_episodes_round_trip_through_one_file_and_refuse_another_model_or_damage(tiny_with_tokenizer, embedding):
    model, tokenizer = tiny_with_tokenizer
    ids = history(tokenizer)
    conversation = EpisodicConversation(f"{SPEC},embedding={embedding}")
    conversation.consolidate(model, tokenizer, ids)
    assert conversation.history == len(ids) and conversation.space.kind == embedding
    data = conversation.to_bytes(model, {"tokens": ids, "messages": []})
    header, chunks = container.unpack(data, "s")
    back = EpisodicConversation.from_header(header, chunks, model, "s")
    assert (back.spec, back.history, back.episodes) == (conversation.spec, len(ids), conversation.episodes)
    assert back.continues(ids + [5]) and not back.continues(ids)  # the digest travels with the episodes
    assert torch.equal(back.centroids, conversation.centroids) and header["meta"]["tokens"] == ids
    question = tokenizer("User: what value has the river number 3?\n", add_special_tokens=False)["input_ids"]
    assert torch.equal(back.space.points(model, [question]), conversation.space.points(model, [question]))
    with pytest.raises(CacheModelMismatchError, match="another model"):
        EpisodicConversation.from_header(header, chunks, tiny_model("qwen2"), "s")
    other = "states" if embedding == "tfidf" else "tfidf"
    damaged = [{**header, "history": None}, {**header, "space": {**header["space"], "kind": "bert"}},
               {**header, "space": {"kind": other, **{k: v for k, v in header["space"].items() if k != "kind"}}},
               {**header, "centroids": [row[:-1] for row in header["centroids"]]}]  # fmt: skip
    for bad in damaged:
        with pytest.raises(CacheCorruptError, match="damaged"):
            EpisodicConversation.from_header(bad, chunks, model, "s")
    with pytest.raises(CacheCorruptError, match="format 3, this kvopt reads 2; start a new session"):
        EpisodicConversation.from_header({**header, "version": 3}, chunks, model, "s")


def test_a_format_1_session_routes_by_the_states_it_saved(tiny_with_tokenizer):
    """Format 1 (before segment spaces) saved the states' mean and no ``embedding=``: it resumes as ``states``."""
    model, tokenizer = tiny_with_tokenizer
    ids = history(tokenizer)
    conversation = EpisodicConversation(f"{SPEC},embedding=states+kivi:bits=4")
    conversation.consolidate(model, tokenizer, ids)
    header, chunks = container.unpack(conversation.to_bytes(model, {}), "s")
    old = {**{k: v for k, v in header.items() if k != "space"}, "version": 1, "mean": header["space"]["mean"],
           "spec": header["spec"].replace(",embedding=states", "")}  # fmt: skip
    back = EpisodicConversation.from_header(old, chunks, model, "s")
    assert back.spec == conversation.spec and back.space.kind == "states"
    assert torch.equal(back.space.mean, conversation.space.mean) and back.episodes == conversation.episodes


def test_a_spec_without_epicache_is_refused():
    with pytest.raises(KVOptError, match="needs epicache in its spec.*epicache:ratio=0.75"):
        EpisodicConversation("snapkv:ratio=0.5")


def session_llm(tiny_with_tokenizer):
    import kvopt

    model, tokenizer = tiny_with_tokenizer
    return kvopt.LLM(model, tokenizer=tokenizer, kv_memory="8MB", max_num_batched_tokens=512, kv_method=SPEC)


def test_the_engine_answers_a_session_turn_from_its_episode_as_generate_does(tiny_with_tokenizer):
    import kvopt

    model, tokenizer = tiny_with_tokenizer
    llm = session_llm(tiny_with_tokenizer)
    params = kvopt.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    ids = history(tokenizer)
    (first,) = llm.generate([{"session": "notes", "prompt": ids[:40]}], params, use_tqdm=False)
    assert first.error is None and not llm.engine.conversations.named["notes"].conversation.episodes
    turn = [*first.prompt_token_ids, *first.outputs[0].token_ids, *ids[40:],
            *tokenizer("User: what value has the harbour number 2?\n", add_special_tokens=False)["input_ids"]]  # fmt: skip
    (second,) = llm.generate([{"session": "notes", "prompt": turn}], params, use_tqdm=False)
    conversation = llm.engine.conversations.named["notes"].conversation
    assert second.error is None and len(conversation.episodes) == 3 and conversation.continues(turn)
    reference = EpisodicConversation(SPEC)  # the same turn through kvopt.episodes and model.generate
    reference.prepare(model, tokenizer, turn)
    cache, _ = reference.cache_for(model, tokenizer, turn)
    with torch.no_grad():
        expected = model.generate(torch.tensor([turn]), attention_mask=torch.ones(1, len(turn), dtype=torch.long),
                                  past_key_values=cache, max_new_tokens=6, do_sample=False, min_new_tokens=6)  # fmt: skip
    assert second.outputs[0].token_ids == expected[0, len(turn) :].tolist()
    assert llm.metrics()["kv_blocks_used"] == 0 and not llm.engine.conversations.named["notes"].busy


def test_session_turns_that_cannot_be_served_fail_alone(tiny_with_tokenizer):
    import kvopt
    from kvopt.engine.requests import RequestSchemaError

    llm = session_llm(tiny_with_tokenizer)
    params = kvopt.SamplingParams(max_tokens=2, temperature=0)
    ids = history(tokenizer=tiny_with_tokenizer[1])[:30]
    lossless = llm.generate([{"session": "a", "prompt": ids}], kvopt.SamplingParams(max_tokens=2, kv_method="full"),
                            use_tqdm=False)  # fmt: skip
    assert "sessions keep epicache's episodes" in lossless[0].error
    two = llm.generate([{"session": "a", "prompt": ids}], kvopt.SamplingParams(max_tokens=2, n=2, temperature=0.8), use_tqdm=False)
    assert "give n=1" in two[0].error
    busy, fine = llm.generate([{"session": "b", "prompt": ids}, {"session": "c", "prompt": ids}], params, use_tqdm=False)
    assert busy.error is None and fine.error is None
    first, second = llm.generate([{"session": "d", "prompt": ids}, {"session": "d", "prompt": ids}], params, use_tqdm=False)
    assert first.error is None and "is answering a turn" in second.error
    with pytest.raises(RequestSchemaError, match="a turn of a session is"):
        llm.generate([{"session": "", "prompt": ids}], params, use_tqdm=False)
    assert llm.metrics()["kv_blocks_used"] == 0 and not any(s.busy for s in llm.engine.conversations.named.values())


def test_the_server_takes_a_session_field_on_chat_and_completions(tiny_with_tokenizer):
    import httpx

    from kvopt.serving import ServerSettings, ThreadedServer

    llm = session_llm(tiny_with_tokenizer)
    messages = [{"role": "user", "content": "Tell me about the river."}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, "session": "talk"}
    with ThreadedServer(lambda: llm.engine, ServerSettings("tiny")) as server:
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60)
        assert reply.status_code == 200, reply.text
        assert "talk" in llm.engine.conversations.named
        text = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "The river", "max_tokens": 2,
                                                                "session": "notes"}, timeout=60)  # fmt: skip
        assert text.status_code == 200 and "notes" in llm.engine.conversations.named
        lossless = httpx.post(server.url + "/v1/chat/completions", json={**body, "kv_method": "full"}, timeout=60)
        assert lossless.status_code == 400 and "sessions keep epicache" in lossless.json()["error"]["message"]
        both = httpx.post(server.url + "/v1/chat/completions", json={**body, "documents": ["a"]}, timeout=60)
        assert both.status_code == 400 and "cannot be combined" in both.json()["error"]["message"]
    assert llm.metrics()["kv_blocks_used"] == 0


def test_idle_sessions_beyond_the_memory_go_least_recently_used_first():
    from kvopt.engine.conversations import SESSION_BYTES, Sessions

    sessions = Sessions(memory=2 * SESSION_BYTES + 100)
    for name in ("a", "b", "c"):
        session, problem = sessions.begin(name, SPEC, 1)
        assert problem is None
        session.conversation.episodes = [b"x" * 40]
        if name != "b":
            sessions.end(session)
    assert list(sessions.named) == ["b", "c"]  # 3 sessions over: "a" (idle, oldest) dropped; "b" still answering stays
    sessions.end(sessions.named["b"])
    assert list(sessions.named) == ["b", "c"]  # two fit
    big, _ = sessions.begin("d", SPEC, 1)
    big.conversation.episodes = [b"x" * 3 * SESSION_BYTES]
    sessions.end(big)
    assert list(sessions.named) == ["d"]  # the one just used stays, even alone over the memory
    for name in ("", " ", "a" * 101, "a/b"):
        assert "a session name is 1-100 letters" in sessions.begin(name, SPEC, 1)[1]
    sessions.begin("e", "epicache:ratio=0.5", 1)
    assert list(sessions.named)[-1] == "e" and sessions.begin("d", "epicache:ratio=0.5", 1)[1]  # another spec: refused
    assert list(sessions.named)[-1] == "e"  # ...and not counted as used


@pytest.mark.parametrize("mode", ["recompute", "swap"])
def test_preempted_session_turns_come_back_from_the_same_episode(tiny_with_tokenizer, mode):
    import kvopt
    from kvopt.engine.kv.paged import PagedKVPool
    from kvopt.models.info import ModelInfo

    model, tokenizer = tiny_with_tokenizer
    block = PagedKVPool.block_bytes(ModelInfo.from_config(model.config), 16, torch.float32)
    llm = kvopt.LLM(model, tokenizer=tokenizer, kv_memory=34 * block, max_model_len=512, preemption_mode=mode,
                    kv_method=SPEC)  # fmt: skip
    ids = history(tokenizer)
    asks = [f"User: what value has the {topic} number {i}?\n" for i, topic in enumerate(("river", "hill", "harbour"))]
    turns = [ids + tokenizer(ask, add_special_tokens=False)["input_ids"] for ask in asks]
    params = kvopt.SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    short = {"session": "short", "prompt": ids[:40]}  # no episodes yet: its output must not become history
    outputs = llm.generate([*({"session": f"s{i}", "prompt": turn} for i, turn in enumerate(turns)), ids[:200], short],
                           [params] * 3 + [kvopt.SamplingParams(max_tokens=120, ignore_eos=True, kv_method="full"), params],
                           use_tqdm=False)  # fmt: skip
    assert llm.metrics()["num_preemptions_total"] > 0
    assert outputs[-1].error is None and not llm.engine.conversations.named["short"].conversation.episodes
    outputs = outputs[:3]
    for index, (turn, output) in enumerate(zip(turns, outputs)):
        assert output.error is None
        assert llm.engine.conversations.named[f"s{index}"].conversation.continues(turn)  # the prompt, not its output
        reference = EpisodicConversation(SPEC)
        reference.prepare(model, tokenizer, turn)
        cache, _ = reference.cache_for(model, tokenizer, turn)
        with torch.no_grad():
            expected = model.generate(torch.tensor([turn]), attention_mask=torch.ones(1, len(turn), dtype=torch.long),
                                      past_key_values=cache, max_new_tokens=120, min_new_tokens=120, do_sample=False)  # fmt: skip
        assert output.outputs[0].token_ids == expected[0, len(turn) :].tolist()
    assert llm.metrics()["kv_blocks_used"] == 0


def test_a_recomputed_turn_clusters_and_routes_its_prompt_never_its_output(tiny_with_tokenizer):
    from types import SimpleNamespace

    from kvopt.engine.conversations import EpisodicKV
    from kvopt.methods import parse

    model, tokenizer = tiny_with_tokenizer
    llm = session_llm(tiny_with_tokenizer)
    session, _ = llm.engine.conversations.begin("x", SPEC, 1)
    kv = EpisodicKV(session, parse(SPEC), model, tokenizer, llm.engine.runner.pool)
    ids = history(tokenizer)
    seq = SimpleNamespace(token_ids=ids[:200], num_prompt_tokens=40)  # a 40-token prompt and 160 tokens of output
    kv.compute_prompt(seq, 40)
    kv.compute_prompt(seq, 200)  # recomputed after a preemption: prompt and output so far, one pass
    assert not session.conversation.episodes and kv.cache.get_seq_length() == 200


def test_a_session_turn_streams(tiny_with_tokenizer):
    import kvopt

    llm = session_llm(tiny_with_tokenizer)
    ids = history(tiny_with_tokenizer[1])[:30]
    *_, last = llm.stream({"session": "live", "prompt": ids}, kvopt.SamplingParams(max_tokens=3, temperature=0))
    assert last.finished and last.error is None and len(last.outputs[0].token_ids) == 3
    assert not llm.engine.conversations.named["live"].busy
