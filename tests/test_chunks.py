"""Chunk caching with selective recompute (kvopt.chunks): exactness, a token-by-token reference, tiers, bad input."""

import pytest
import torch
from transformers import DynamicCache

import kvopt
from kvopt.chunks import Chunk, ChunkError, ChunkStore, blend
from kvopt.models.forward import cache_kwargs
from kvopt.tiers import DiskTier, RedisTier, TierChain
from redis_server import RedisServer
from tiny_models import VOCAB, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def models():
    """A tiny llama on kvopt's attention, and the same weights left on HF's own (for the slow references)."""
    blended, reference = tiny_model("llama"), tiny_model("llama")
    kvopt.prepare(blended)
    return blended, reference


@pytest.fixture(scope="module")
def model(models):
    return models[0]


@pytest.fixture(scope="module")
def reference(models):
    return models[1]


def tokens(count: int, seed: int) -> list[int]:
    return torch.randint(3, VOCAB, (count,), generator=torch.Generator().manual_seed(seed)).tolist()


def rag_prompt(kind: str = "plain") -> list:
    """``plain``: chunks computed from position 0 after new text; ``preamble``: a system text opening the prompt and
    documents computed after it (the first one exact there); ``early``: a chunk placed before its preamble's end."""
    head = tuple(tokens(8, 12))
    first, second = tuple(tokens(20, 2)), tuple(tokens(17, 3))
    return {
        "plain": [tokens(5, 1), Chunk(first), Chunk(second), tokens(6, 4)],
        "preamble": [Chunk(head), Chunk(first, head), Chunk(second, head), tokens(6, 4)],
        "early": [tokens(3, 1), Chunk(first, head), tokens(6, 4)],
    }[kind]


def flat(pieces) -> list[int]:
    return [t for piece in pieces for t in (piece.tokens if isinstance(piece, Chunk) else piece)]


def last_logits(model, ids, cache) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids[:, -1:], **cache_kwargs(model, cache)).logits[0, -1]


def test_blend_ratio_one_is_a_full_prefill_token_for_token(model):
    pieces = rag_prompt()
    ids = torch.tensor([flat(pieces)])
    full = model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False)
    blended = blend(model, pieces, ChunkStore(model), blend_ratio=1.0)
    out = model.generate(blended.input_ids, **cache_kwargs(model, blended.cache), max_new_tokens=12, min_new_tokens=12,
                         do_sample=False)  # fmt: skip
    assert torch.equal(out, full)
    assert blended.recomputed == blended.chunk_tokens == 37


def test_a_chunk_opening_the_prompt_is_reused_exactly(model, reference):
    chunk, question = tokens(24, 5), tokens(7, 6)
    blended = blend(model, [Chunk(tuple(chunk)), question], ChunkStore(model), blend_ratio=0.0)
    ids = torch.tensor([chunk + question])
    with torch.no_grad():
        expected = reference(ids).logits[0, -1]
    assert blended.recomputed == 0
    torch.testing.assert_close(last_logits(model, blended.input_ids, blended.cache), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize(("strategy", "ratio"), [("cacheblend", 0.0), ("cacheblend", 0.15), ("epic", 0.0)])
def test_a_prompt_with_nothing_to_recompute_needs_no_forward_and_is_exact(model, reference, strategy, ratio):
    # A leading chunk (exact as stored) and a one-token question: nothing before the last token is recomputed.
    chunk, question = tokens(24, 5), tokens(1, 6)
    blended = blend(model, [Chunk(tuple(chunk)), question], ChunkStore(model), blend_ratio=ratio, strategy=strategy)
    with torch.no_grad():
        expected = reference(torch.tensor([chunk + question])).logits[0, -1]
    assert blended.recomputed == 0 and blended.cache.get_seq_length() == 24
    torch.testing.assert_close(last_logits(model, blended.input_ids, blended.cache), expected, atol=1e-5, rtol=0)


def test_a_chunk_opening_the_prompt_is_never_recomputed_nor_counted_in_the_share(model, reference):
    head, document, question = tokens(30, 9), tokens(20, 10), tokens(4, 11)
    pieces = [Chunk(tuple(head)), Chunk(tuple(document)), question]
    blended = blend(model, pieces, ChunkStore(model), blend_ratio=0.5)
    assert (blended.chunk_tokens, blended.recomputed) == (50, 10)  # half of the document's 20, none of the head's
    full = blend(model, pieces, ChunkStore(model), blend_ratio=1.0)
    with torch.no_grad():
        expected = reference(torch.tensor([head + document + question])).logits[0, -1]
    torch.testing.assert_close(last_logits(model, full.input_ids, full.cache), expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("start", [1, 37, 300])
def test_reuse_at_another_position_equals_computing_the_chunk_there(model, reference, start):
    chunk, question = tokens(24, 7), tokens(5, 8)
    store = ChunkStore(model)
    kv = store.get(Chunk(tuple(chunk)))
    there = DynamicCache()
    with torch.no_grad():
        reference(torch.tensor([chunk]), position_ids=torch.arange(start, start + 24)[None], **cache_kwargs(reference, there))
    moved = DynamicCache()
    for layer in range(len(kv.keys)):
        keys = store.shifted_keys(kv, layer, start)
        torch.testing.assert_close(keys, there.layers[layer].keys, atol=1e-5, rtol=0)
        moved.update(keys, kv.values[layer], layer)
    positions = torch.arange(start + 24, start + 29)[None]
    with torch.no_grad():
        expected = reference(torch.tensor([chunk + question]), position_ids=torch.arange(start, start + 29)[None])
        got = reference(torch.tensor([question]), position_ids=positions, **cache_kwargs(reference, moved))
    torch.testing.assert_close(got.logits[0, -1], expected.logits[0, -1], atol=1e-5, rtol=0)


def slow_blend(reference, pieces, ratio: float, strategy: str, epic_tokens: int = 16, check: int = 1):
    """Token by token: each recomputed token runs through the whole model over the KV of every earlier token
    (HF's DynamicCache); layers up to the check layer hold a full prefill's KV (CacheBlend) and the chunks'
    other tokens their KV computed alone at their prompt positions. Returns per-layer (keys, values)."""
    ids = flat(pieces)
    width = len(ids) - 1
    layers = reference.config.num_hidden_layers
    full = DynamicCache()
    with torch.no_grad():
        reference(torch.tensor([ids[:width]]), **cache_kwargs(reference, full))
    reused_k = [full.layers[i].keys.clone() for i in range(layers)]
    reused_v = [full.layers[i].values.clone() for i in range(layers)]
    fresh = torch.ones(width, dtype=torch.bool)
    moved = torch.zeros(width, dtype=torch.bool)  # chunk tokens that saw other text than their preamble
    sinks = torch.zeros(width, dtype=torch.bool)  # each moved chunk's first epic_tokens
    start = 0
    for piece in pieces:
        size = len(piece.tokens if isinstance(piece, Chunk) else piece)
        if isinstance(piece, Chunk):
            # The chunk after its preamble, placed so that the chunk's own tokens sit at start..start+size-1.
            before = len(piece.preamble)
            alone = DynamicCache()
            with torch.no_grad():
                reference(torch.tensor([[*piece.preamble, *piece.tokens]]),
                          position_ids=torch.arange(start - before, start + size)[None], **cache_kwargs(reference, alone))  # fmt: skip
            end = min(start + size, width)
            for i in range(layers):
                reused_k[i][:, :, start:end] = alone.layers[i].keys[:, :, before : before + end - start]
                reused_v[i][:, :, start:end] = alone.layers[i].values[:, :, before : before + end - start]
            fresh[start:end] = False
            if tuple(ids[:start]) != piece.preamble:
                moved[start:end] = True
                sinks[start : min(start + epic_tokens, width)] = True
        start += size
    chosen = fresh | sinks if strategy == "epic" else fresh.clone()
    fixed = 0
    if strategy == "cacheblend" and ratio > 0:
        fixed = check + 1
        deviation = (full.layers[check].values - reused_v[check]).square().sum(dim=(0, 1, 3))
        deviation[~moved] = -float("inf")
        count = round(ratio * int(moved.sum()))
        chosen[deviation.topk(count).indices] = True
    keys = [full.layers[i].keys.clone() if i < fixed else reused_k[i].clone() for i in range(layers)]
    values = [full.layers[i].values.clone() if i < fixed else reused_v[i].clone() for i in range(layers)]
    for t in range(width):
        if not chosen[t]:
            continue
        prefix = DynamicCache()
        for i in range(layers):
            prefix.update(keys[i][:, :, :t], values[i][:, :, :t], i)
        with torch.no_grad():
            reference(torch.tensor([[ids[t]]]), position_ids=torch.tensor([[t]]), **cache_kwargs(reference, prefix))
        for i in range(fixed, layers):
            keys[i][:, :, t] = prefix.layers[i].keys[:, :, t]
            values[i][:, :, t] = prefix.layers[i].values[:, :, t]
    return keys, values, int((chosen & ~fresh).sum())


@pytest.mark.parametrize("kind", ["plain", "preamble", "early"])
@pytest.mark.parametrize(("strategy", "ratio"), [("cacheblend", 0.0), ("cacheblend", 0.15), ("cacheblend", 0.5),
                                                 ("epic", 0.0)])  # fmt: skip
def test_blending_equals_the_token_by_token_reference(model, reference, strategy, ratio, kind):
    pieces = rag_prompt(kind)
    blended = blend(model, pieces, ChunkStore(model), blend_ratio=ratio, strategy=strategy, epic_tokens=4)
    keys, values, recomputed = slow_blend(reference, pieces, ratio, strategy, epic_tokens=4)
    for layer, (k, v) in zip(blended.cache.layers, zip(keys, values)):
        torch.testing.assert_close(layer.store.keys, k, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.store.values, v, atol=1e-5, rtol=0)
    assert blended.recomputed == recomputed
    # plain: 4 of each chunk (epic) or a share of both; preamble: only the second document moved (17 tokens)
    expected = {"plain": {0.0: 8 if strategy == "epic" else 0, 0.15: 6, 0.5: 18},
                "preamble": {0.0: 4 if strategy == "epic" else 0, 0.15: 3, 0.5: 8},
                "early": {0.0: 4 if strategy == "epic" else 0, 0.15: 3, 0.5: 10}}[kind][ratio]  # fmt: skip
    assert recomputed == expected


def test_the_check_layer_is_where_the_tokens_are_chosen(model, reference):
    pieces = rag_prompt("preamble")
    blended = blend(model, pieces, ChunkStore(model), blend_ratio=0.5, check_layer=0)
    keys, values, recomputed = slow_blend(reference, pieces, 0.5, "cacheblend", check=0)
    for layer, (k, v) in zip(blended.cache.layers, zip(keys, values)):
        torch.testing.assert_close(layer.store.keys, k, atol=1e-5, rtol=0)
        torch.testing.assert_close(layer.store.values, v, atol=1e-5, rtol=0)
    assert blended.recomputed == recomputed == 8


def test_a_document_right_after_its_preamble_is_reused_exactly(model, reference):
    head, document, question = tuple(tokens(12, 13)), tuple(tokens(25, 14)), tokens(6, 15)
    store = ChunkStore(model)
    blended = blend(model, [Chunk(head), Chunk(document, head), question], store, blend_ratio=0.0)
    with torch.no_grad():
        expected = reference(torch.tensor([[*head, *document, *question]])).logits[0, -1]
    assert blended.recomputed == 0 and blended.chunk_tokens == 37
    torch.testing.assert_close(last_logits(model, blended.input_ids, blended.cache), expected, atol=1e-5, rtol=0)
    assert store.stats.stores == 2 and store.stats.hits == 1  # the document was computed on the preamble's stored KV
    assert store.get(Chunk(document, head)).start == 12 and store.get(Chunk(document)).start == 0


def test_the_blended_cache_holds_a_full_prefill_s_bytes_and_a_compressed_method_drops_them(model):
    pieces = rag_prompt()
    full = blend(model, pieces, ChunkStore(model), blend_ratio=0.15)
    reference = kvopt.cache("full", model)
    reference.prefill(model, torch.tensor([flat(pieces)[:-1]]))
    assert full.cache.nbytes() == reference.nbytes()
    compressed = blend(model, pieces, ChunkStore(model, method="snapkv:ratio=0.5,window=4"), blend_ratio=0.15)
    assert compressed.cache.spec == "snapkv:ratio=0.5,window=4"
    assert compressed.cache.nbytes() < 0.65 * full.cache.nbytes()
    out = model.generate(compressed.input_ids, **cache_kwargs(model, compressed.cache), max_new_tokens=4, do_sample=False)
    assert out.shape[1] == compressed.input_ids.shape[1] + 4


def test_chunk_keys_never_collide_across_models_methods_preambles_or_tokens(model):
    ids = tuple(tokens(10, 9))
    chunk = Chunk(ids)
    other_model = tiny_model("llama", seed=1)
    kvopt.prepare(other_model)
    store = ChunkStore(model)
    keys = {
        store.key(chunk), ChunkStore(model, method="kivi:bits=4").key(chunk), ChunkStore(other_model).key(chunk),
        store.key(Chunk(ids[:-1])), store.key(Chunk(ids + (5,))), store.key(Chunk(ids, (7,))),
        store.key(Chunk(ids[1:], ids[:1])),  # the same ids in a row, split elsewhere between preamble and chunk
    }  # fmt: skip
    assert len(keys) == 7
    assert store.key(chunk) == ChunkStore(model).key(Chunk(ids))


def test_a_chunk_stored_by_one_store_is_found_by_another_through_disk_and_redis(model, tmp_path):
    server = RedisServer()
    chunk = Chunk(tuple(tokens(30, 10)), preamble=tuple(tokens(6, 16)))
    try:
        writer = ChunkStore(model, tiers=TierChain([DiskTier(tmp_path, 1 << 24), RedisTier(server.url)]))
        stored = writer.get(chunk)
        writer.flush()
        for tier in (DiskTier(tmp_path, 1 << 24), RedisTier(server.url)):
            reader = ChunkStore(model, tiers=TierChain([tier]))
            found = reader.get(chunk)
            assert tier.stats.hits == 1 and reader.stats.stores == 0 and found.start == 6
            assert all(torch.equal(a, b) for a, b in zip(found.keys + found.values, stored.keys + stored.values))
            reader.tiers.close()
        writer.tiers.close()
    finally:
        server.stop()


def test_a_damaged_stored_chunk_is_dropped_and_recomputed(model, tmp_path):
    chunk = Chunk(tuple(tokens(30, 11)))
    writer = ChunkStore(model, tiers=TierChain([DiskTier(tmp_path, 1 << 24)]))
    stored = writer.get(chunk)
    writer.flush()
    (entry,) = tmp_path.glob("*/*.kvb")
    data = bytearray(entry.read_bytes())
    data[len(data) // 2] ^= 0xFF
    entry.write_bytes(bytes(data))
    reader = ChunkStore(model, tiers=TierChain([DiskTier(tmp_path, 1 << 24)]))
    found = reader.get(chunk)
    assert reader.stats.corrupt == 1 and reader.stats.stores == 1
    assert all(torch.equal(a, b) for a, b in zip(found.keys, stored.keys))
    reader.flush()
    assert ChunkStore(model, tiers=TierChain([DiskTier(tmp_path, 1 << 24)])).get(chunk) is not None


def test_bad_input_gets_one_line(model):
    store = ChunkStore(model)
    cases = {
        "outside [0, 1]": lambda: blend(model, rag_prompt(), store, blend_ratio=1.5),
        "blend_ratio=-0.1": lambda: blend(model, rag_prompt(), store, blend_ratio=-0.1),
        "has no tokens": lambda: Chunk(()),
        "over the model's 512 positions": lambda: blend(model, [Chunk(tuple(tokens(300, 1))), tokens(300, 2)], store),
        "cannot serve fastkv": lambda: ChunkStore(model, method="fastkv:ratio=0.5"),
        "cannot serve surprisal": lambda: ChunkStore(model, method="surprisal:ratio=0.5"),
        "unknown blend strategy": lambda: blend(model, rag_prompt(), store, strategy="lego"),
        "check_layer=2 leaves no later layer": lambda: blend(model, rag_prompt(), store, check_layer=2),
        "end the prompt with new text": lambda: blend(model, [tokens(3, 1), Chunk(tuple(tokens(9, 3)))],
                                                      ChunkStore(model, method="kivi:bits=4")),
    }  # fmt: skip
    for words, call in cases.items():
        with pytest.raises(ChunkError, match=words.replace("[", r"\[").replace("(", r"\(")) as error:
            call()
        assert "\n" not in str(error.value)
    sliding = tiny_model("mistral")
    kvopt.prepare(sliding)
    with pytest.raises(ChunkError, match="sliding-window layers"):
        ChunkStore(sliding)


@pytest.fixture(scope="module")
def tokenizer():
    from kvopt.models import load_tokenizer

    return load_tokenizer()


@pytest.mark.parametrize("task", ["retrieval", "retrieval_2hop"])
def test_the_retrieval_task_is_seeded_holds_its_answer_and_reuses_passages_elsewhere(tokenizer, task):
    from kvopt.eval.tasks import TASKS, build_sample, format_prompt, score
    from kvopt.eval.tasks.retrieval import passage

    samples = [build_sample(task, tokenizer, 1024, index=index) for index in range(8)]
    assert build_sample(task, tokenizer, 1024, index=3) == samples[3]
    assert build_sample(task, tokenizer, 1024, index=3, seed=1) != samples[3]
    places: dict[int, set[int]] = {}
    for sample in samples:
        documents, indices = sample.metadata["passages"], sample.metadata["pool_indices"]
        assert len(documents) == 4 and sample.context == "\n\n".join(documents)
        (answer,) = sample.answers
        holder = sample.metadata["needed"][-1]
        assert answer in documents[indices.index(holder)] and answer not in sample.question
        if task == "retrieval_2hop":
            link = documents[indices.index(sample.metadata["needed"][0])]
            assert "archive replaced the" in link and answer not in link
        assert len(sum(format_prompt(tokenizer, sample), [])) <= 1024 - sample.max_new_tokens
        assert score(sample, f"It is {answer}.") == 1.0 and score(sample, "It is 1234567.") == 0.0
        for position, index in enumerate(indices):
            assert documents[position] == passage(index, TASKS[task].passage_words(1024))
            places.setdefault(index, set()).add(position)
    assert any(len(seen) > 1 for seen in places.values())  # a passage comes back at another position


def assert_pool_empty(llm) -> None:
    assert llm.metrics()["kv_blocks_used"] == 0
    assert all(block.ref_count == 0 for block in llm.engine.block_manager.blocks)


def chunk_llm(tiny_with_tokenizer, **options):
    model, tokenizer = tiny_with_tokenizer
    options = {"kv_memory": "8MB", "max_num_batched_tokens": 512, "enable_chunk_caching": True, **options}
    return kvopt.LLM(model, tokenizer=tokenizer, **options)


DOCS = ("The river rises in the northern hills and runs south past the old mill.",
        "Every autumn the village holds a fair where bakers sell bread and honey.")  # fmt: skip


def test_the_engine_serves_chunked_prompts_and_blend_one_equals_the_plain_prompt(tiny_with_tokenizer):
    params = kvopt.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = chunk_llm(tiny_with_tokenizer, blend_ratio=1.0)
    tokenizer = llm.tokenizer
    question = "Where does the river rise?"
    ids = [t for text in (*DOCS, question) for t in tokenizer(text, add_special_tokens=False).input_ids]
    chunked, plain = llm.generate([{"chunks": list(DOCS), "prompt": question}, ids], params, use_tqdm=False)
    assert chunked.outputs[0].token_ids == plain.outputs[0].token_ids
    assert list(chunked.prompt_token_ids) == ids
    again = llm.generate([{"chunks": [DOCS[1], DOCS[0]], "prompt": ids[:5]}], params, use_tqdm=False)
    assert len(again[0].outputs[0].token_ids) == 8
    assert llm.engine._chunk_stores["full"].stats.hits == 2  # both documents found again, in the other order
    assert_pool_empty(llm)


def test_engine_documents_are_computed_after_the_preamble(tiny_with_tokenizer):
    params = kvopt.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
    llm = chunk_llm(tiny_with_tokenizer, blend_ratio=0.0)
    tokenizer = llm.tokenizer
    preamble, question = "You answer from the documents.", "Where does the river rise?"
    document, asked = (tokenizer(text, add_special_tokens=False).input_ids for text in (DOCS[0], question))
    head = tokenizer(preamble).input_ids  # the preamble opens the prompt: with the special tokens the tokenizer adds
    ids = head + document + asked
    # The only document follows its preamble: reused exactly, so even plain concatenation is the plain prompt.
    chunked, plain = llm.generate([{"preamble": preamble, "chunks": [DOCS[0]], "prompt": question}, ids], params,
                                  use_tqdm=False)  # fmt: skip
    assert list(chunked.prompt_token_ids) == ids
    assert chunked.outputs[0].token_ids == plain.outputs[0].token_ids
    store = llm.engine._chunk_stores["full"]
    assert store.get(Chunk(tuple(document), tuple(head))).start == len(head)
    assert store.stats.stores == 2  # the preamble, the document after it
    llm.generate([{"preamble": preamble, "chunks": list(reversed(DOCS)), "prompt": question}], params, use_tqdm=False)
    assert store.stats.stores == 3  # only the new document; the first one is found again at its new position
    with pytest.raises(kvopt.engine.requests.RequestSchemaError, match="preamble"):
        llm.generate([{"preamble": preamble, "chunks": [DOCS[0]], "prompt": question, "extra": 1}], params)
    assert_pool_empty(llm)


def test_engine_chunks_go_through_the_kv_tiers_to_another_engine(tiny_with_tokenizer, tmp_path):
    params = kvopt.SamplingParams(max_tokens=4, temperature=0)
    first = chunk_llm(tiny_with_tokenizer, kv_tiers=(f"disk:{tmp_path}:64MB",))
    expected = first.generate([{"chunks": list(DOCS), "prompt": "Why?"}], params, use_tqdm=False)
    first.close()
    second = chunk_llm(tiny_with_tokenizer, kv_tiers=(f"disk:{tmp_path}:64MB",))
    got = second.generate([{"chunks": list(DOCS), "prompt": "Why?"}], params, use_tqdm=False)
    store = second.engine._chunk_stores["full"]
    assert store.stats.stores == 0 and store.stats.misses == 2  # found on disk, none computed
    assert got[0].outputs[0].token_ids == expected[0].outputs[0].token_ids
    assert_pool_empty(second)


def test_the_chunk_memory_bounds_what_the_engine_keeps(tiny_with_tokenizer):
    params = kvopt.SamplingParams(max_tokens=2, temperature=0)
    prompts = [{"chunks": [document], "prompt": "Why?"} for document in (DOCS[0], DOCS[1], DOCS[0])]
    roomy, tight = chunk_llm(tiny_with_tokenizer), chunk_llm(tiny_with_tokenizer, chunk_memory="1KB")
    for llm in (roomy, tight):
        llm.generate(prompts, params, use_tqdm=False)
    assert roomy.engine._chunk_stores["full"].stats.hits == 1  # the first document again
    store = tight.engine._chunk_stores["full"]
    assert store.stats.hits == 0 and store.stats.stores == 3 and store.stats.bytes_stored == 0  # none fits in 1 KB
    assert_pool_empty(tight)


def test_engine_chunk_requests_refuse_bad_input_alone(tiny_with_tokenizer):
    from kvopt.engine.config import EngineConfigError
    from kvopt.engine.requests import RequestSchemaError

    llm = chunk_llm(tiny_with_tokenizer)
    params = kvopt.SamplingParams(max_tokens=2, temperature=0)
    long_document = [5] * 2100
    failed, fine = llm.generate([{"chunks": [long_document], "prompt": "Why?"}, {"chunks": [DOCS[0]], "prompt": "Why?"}],
                                params, use_tqdm=False)  # fmt: skip
    assert "context" in failed.error and fine.error is None
    wrong = llm.generate([{"chunks": [DOCS[0]], "prompt": "Why?"}], kvopt.SamplingParams(max_tokens=2, kv_method="fastkv:ratio=0.5"),
                         use_tqdm=False)  # fmt: skip
    assert "cannot serve fastkv" in wrong[0].error
    with pytest.raises(RequestSchemaError, match="chunks"):
        llm.generate([{"chunks": [], "prompt": "Why?"}], params, use_tqdm=False)
    (empty,) = llm.generate([{"chunks": [DOCS[0], ""], "prompt": "Why?"}], params, use_tqdm=False)
    assert "has no tokens" in empty.error
    assert_pool_empty(llm)
    with pytest.raises(EngineConfigError, match="outside"):
        chunk_llm(tiny_with_tokenizer, blend_ratio=2.0)
    with pytest.raises(EngineConfigError, match="chunk_memory"):
        chunk_llm(tiny_with_tokenizer, chunk_memory="lots")
    with pytest.raises(EngineConfigError, match=r"check_layer=1 .* choose 0\.\.0"):
        chunk_llm(tiny_with_tokenizer, blend_check_layer=1)
    with pytest.raises(kvopt.engine.llm_engine.RequestError, match="enable_chunk_caching"):
        chunk_llm(tiny_with_tokenizer, enable_chunk_caching=False).generate([{"chunks": [DOCS[0]], "prompt": "x"}])


def test_the_server_places_documents_before_the_last_user_message(tiny_with_tokenizer):
    import httpx

    from kvopt.serving import ServerSettings, ThreadedServer

    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Where does it rise?"}]
    body = {"model": "tiny", "messages": messages, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
    llm = chunk_llm(tiny_with_tokenizer, blend_ratio=1.0)
    tokenizer = llm.tokenizer
    rendered = llm.apply_chat_template([messages[0], {"role": "user", "content": "\x00" + messages[1]["content"]}])
    head, tail = rendered.split("\x00")
    ids = [t for text in (head, *(f"{doc}\n\n" for doc in DOCS), tail)
           for t in tokenizer(text, add_special_tokens=False).input_ids]  # fmt: skip
    with ThreadedServer(lambda: llm.engine, ServerSettings("tiny")) as server:
        server.wait_ready()
        reply = httpx.post(server.url + "/v1/chat/completions", json={**body, "documents": list(DOCS)}, timeout=60).json()
        plain = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6,
                                                                 "temperature": 0, "ignore_eos": True}, timeout=60).json()  # fmt: skip
        assert reply["usage"]["prompt_tokens"] == len(ids)
        assert reply["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        refused = httpx.post(server.url + "/v1/chat/completions", json={**body, "documents": []}, timeout=60)
        assert refused.status_code == 400 and "documents" in refused.json()["error"]["message"]
        again = httpx.post(server.url + "/v1/chat/completions", json={**body, "documents": [DOCS[1]]}, timeout=60)
        assert again.status_code == 200
        stats = llm.engine._chunk_stores["full"].stats
        # The chat's head, then both documents computed on its stored KV (2 hits); then the head and one again.
        assert (stats.stores, stats.hits) == (3, 4)
        # A later turn: the documents keep their preamble (the text before the first user message), so they are
        # found again; the earlier turns are new text between the preamble and the documents.
        turns = [*messages, {"role": "assistant", "content": "In the hills."}, {"role": "user", "content": "And then?"}]
        rendered = llm.apply_chat_template([messages[0], {"role": "user", "content": "\x00" + messages[1]["content"]},
                                            turns[2], {"role": "user", "content": "\x01" + turns[3]["content"]}])  # fmt: skip
        head, rest = rendered.split("\x00")
        history, tail = rest.split("\x01")
        ids = [t for text in (head, history, *(f"{doc}\n\n" for doc in DOCS), tail)
               for t in tokenizer(text, add_special_tokens=False).input_ids]  # fmt: skip
        later = httpx.post(server.url + "/v1/chat/completions",
                           json={**body, "messages": turns, "documents": list(DOCS)}, timeout=60).json()  # fmt: skip
        plain = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": ids, "max_tokens": 6,
                                                                 "temperature": 0, "ignore_eos": True}, timeout=60).json()  # fmt: skip
        assert later["usage"]["prompt_tokens"] == len(ids)
        assert later["choices"][0]["message"]["content"] == plain["choices"][0]["text"]
        assert (stats.stores, stats.hits) == (3, 7)
    assert_pool_empty(llm)
