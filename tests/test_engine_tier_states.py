"""Compressed prompts in the KV tiers: the state after a prompt's prefill (kept tokens, quantized groups, method
state, last logits) serves the same prompt again in a restarted engine or another replica, with the tokens that
computing it gives; other prompts, other methods, damaged or misplaced entries are computed."""

import copy
import shutil

import pytest

from test_engine_compressed import generate_with_cache, prompts
from test_engine_every_method import EVERY_METHOD, models, tokenizer  # noqa: F401 - fixtures
from test_engine_every_method import generate_with_cache as generate_own_cache
from test_engine_tiers import serve
from tiny_models import tiny_model

from kvopt.engine import LLM, SamplingParams
from kvopt.engine.kv.cache_backed import CacheBackedKV
from redis_server import RedisServer

PROMPT = prompts([150], seed=5)[0]
STATES = [
    "snapkv:ratio=0.5",
    "kivi:bits=4,residual=32",  # 4 groups quantized, 22 tokens at full precision
    "kivi:bits=2",  # residual 128: 4 groups, the rest at full precision
    "snapkv:ratio=0.75+kivi:bits=4,residual=32",
    "h2o:budget=48",  # per-token scores carried in the state
    "streamingllm:budget=40",  # its attention module kept in the state, by name
    "window:size=50",
    "knorm:ratio=0.5",
    "morphkv:budget=40",  # recent queries carried in the state
]


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def entries(folder):
    return sorted(folder.glob("*/*.kvb"), key=lambda file: file.stat().st_mtime_ns)


@pytest.mark.parametrize("spec", STATES)
def test_a_restarted_engine_serves_a_seen_compressed_prompt_from_its_state(model, tmp_path, spec):
    tiers = (f"disk:{tmp_path}:10MB",)
    cold, first = serve(model, tiers, PROMPT, kv_method=spec)
    assert first["cached"] == 0 and first["kv_tiers"]["disk"]["stores"] == 1  # one entry: the prompt's state
    warm, second = serve(model, tiers, PROMPT, kv_method=spec)
    assert warm == cold == generate_with_cache(model, spec, PROMPT, len(cold))
    assert second["cached"] == len(PROMPT) == second["prefix_cache_hits_total"]
    assert second["kv_tiers"]["disk"]["hits"] == 1 and second["kv_tiers"]["disk"]["stores"] == 0


def test_the_state_holds_what_the_method_keeps(model, tmp_path):
    """The entry of a 4-bit KIVI prompt is a fraction of the same prompt's lossless blocks (bytes really drop)."""
    sizes = {}
    for spec in ("full", "kivi:bits=4,residual=32"):
        folder = tmp_path / spec.partition(":")[0]
        serve(model, (f"disk:{folder}:10MB",), PROMPT, kv_method=spec)
        sizes[spec] = sum(file.stat().st_size for file in entries(folder))
    blocks = (len(PROMPT) - 1) // 16 * 16  # the lossless tier holds the full blocks only
    assert sizes["kivi:bits=4,residual=32"] < 0.5 * sizes["full"] * len(PROMPT) / blocks


def test_seeded_sampling_from_the_stored_logits_draws_the_same_tokens(model, tmp_path):
    spec = "snapkv:ratio=0.75+kivi:bits=4,residual=32"
    params = SamplingParams(max_tokens=8, temperature=0.9, top_p=0.95, seed=7, ignore_eos=True, logprobs=2)
    runs = []
    for _ in range(2):
        with LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=(f"disk:{tmp_path}:10MB",), kv_method=spec) as llm:
            (output,) = llm.generate([PROMPT], params, use_tqdm=False)
            llm.engine.offload.chain.flush()
        runs.append(output)
    assert runs[1].metrics.cached_tokens == len(PROMPT)
    assert runs[1].outputs[0].token_ids == runs[0].outputs[0].token_ids
    assert runs[1].outputs[0].logprobs == runs[0].outputs[0].logprobs


def test_other_prompts_and_other_methods_miss(model, tmp_path):
    tiers = (f"disk:{tmp_path}:10MB",)
    serve(model, tiers, PROMPT, kv_method="snapkv:ratio=0.5")
    cases = [
        (PROMPT[:-1], "snapkv:ratio=0.5"),  # a prefix: its state is another one (the methods saw another prompt)
        (PROMPT + [7], "snapkv:ratio=0.5"),
        (PROMPT, "snapkv:ratio=0.25"),
        (PROMPT, "full"),
    ]
    for prompt, spec in cases:
        tokens, metrics = serve(model, tiers, prompt, kv_method=spec)
        assert metrics["cached"] == 0 and metrics["kv_tiers"]["disk"]["hits"] == 0, (len(prompt), spec)
        assert tokens == generate_with_cache(model, spec, prompt, len(tokens))


def test_a_method_chosen_per_request_finds_its_state(model, tmp_path):
    """A lossless engine serving a request with its own kv_method: keyed by that method, found again."""
    tiers = (f"disk:{tmp_path}:10MB",)
    params = SamplingParams(max_tokens=6, ignore_eos=True, kv_method="h2o:budget=48")
    found = []
    for _ in range(2):
        with LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=tiers) as llm:
            (output,) = llm.generate([PROMPT], params, use_tqdm=False)
        found.append((output.outputs[0].token_ids, output.metrics.cached_tokens))
    assert found[1] == (found[0][0], len(PROMPT))


@pytest.mark.parametrize("damage", ["truncate", "flip", "another prompt's entry", "another model"])
def test_damaged_or_misplaced_states_are_dropped_and_computed(model, tmp_path, damage):
    spec = "kivi:bits=4,residual=32"
    folder = tmp_path / "tier"
    tiers = (f"disk:{folder}:10MB",)
    cold, _ = serve(model, tiers, PROMPT, kv_method=spec)
    (entry,) = entries(folder)
    data = entry.read_bytes()
    if damage == "truncate":
        entry.write_bytes(data[: len(data) // 2])
    elif damage == "flip":
        entry.write_bytes(data[:100] + bytes([data[100] ^ 1]) + data[101:])
    elif damage == "another prompt's entry":  # a valid entry under this prompt's key: refused by its tokens
        other = tmp_path / "other"
        serve(model, (f"disk:{other}:10MB",), prompts([150], seed=6)[0], kv_method=spec)
        shutil.copyfile(entries(other)[0], entry)
    model_used = tiny_model("llama", seed=1) if damage == "another model" else model
    tokens, metrics = serve(model_used, tiers, PROMPT, kv_method=spec)
    assert metrics["cached"] == 0
    assert tokens == generate_with_cache(model_used, spec, PROMPT, len(tokens))
    if damage == "another model":  # its key differs (the fingerprint salts it): simply not found
        assert metrics["kv_tiers"]["disk"]["hits"] == 0
    else:
        assert tokens == cold and metrics["kv_tiers"]["disk"]["corrupt"] == 1
        assert entries(folder)[0].read_bytes() == data  # dropped, computed, and stored anew


@pytest.mark.parametrize("spec", [spec for spec in EVERY_METHOD if spec != "full"])
def test_every_method_in_its_own_cache_serves_a_seen_prompt_from_its_saved_cache(spec, request, tmp_path):
    """A sequence with its own cache (whole-prompt passes, non-uniform codes, sparse indexes, merged pairs) keeps
    the cache after its prompt in the tiers as a session file holds it: the same prompt again skips the prompt pass
    (kvzip's reconstruction included) and gives the same tokens as computing it."""
    model, default_tokenizer = request.getfixturevalue("models")["llama"], request.getfixturevalue("tokenizer")
    tiers, prompt = (f"disk:{tmp_path}:20MB",), prompts([130], seed=3)[0]
    runs = []
    for _ in range(2):
        with LLM(copy.deepcopy(model), tokenizer=default_tokenizer, kv_memory="4MB", kv_tiers=tiers, kv_method=spec) as llm:
            if not isinstance(llm.engine._compression(spec).new_kv(), CacheBackedKV):
                pytest.skip(f"{spec} is held in the block layouts (covered above)")
            assert llm.engine.keeps_prompt_state(spec)
            (output,) = llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
            assert output.error is None
            llm.engine.offload.chain.flush()
            runs.append((output.outputs[0].token_ids, output.metrics.cached_tokens, llm.metrics()))
            assert llm.metrics()["kv_blocks_used"] == 0
    (cold, _, first), (warm, cached, second) = runs
    assert (first["kv_tiers"]["disk"]["stores"], second["kv_tiers"]["disk"]["hits"]) == (1, 1), (first, second)
    assert cached == len(prompt)
    assert warm == cold == generate_own_cache(model, default_tokenizer, spec, prompt, 6)


def test_head_wise_budgets_keep_no_state(model, tmp_path):
    assert not LLM(copy.deepcopy(model), kv_memory="2MB").engine.keeps_prompt_state("pyramidkv:ratio=0.5")
    tiers = (f"disk:{tmp_path}:10MB",)
    cold, first = serve(model, tiers, PROMPT, kv_method="pyramidkv:ratio=0.5")
    warm, second = serve(model, tiers, PROMPT, kv_method="pyramidkv:ratio=0.5")
    assert warm == cold and first["kv_tiers"]["disk"]["stores"] == 0 and second["cached"] == 0


def test_a_state_waits_for_free_blocks_and_the_pool_ends_empty(model, tmp_path):
    """Many requests for seen and unseen prompts at once in a small pool: every output equals its reference."""
    spec = "snapkv:ratio=0.75+kivi:bits=4,residual=32"
    tiers = ("cpu:4MB", f"disk:{tmp_path}:10MB")
    seen = prompts([150, 200, 120], seed=8)
    with LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=tiers, kv_method=spec) as llm:
        serve_all(llm, seen)
    batch = seen * 3 + prompts([90, 160], seed=9)
    with LLM(copy.deepcopy(model), kv_memory="600KB", kv_tiers=tiers, kv_method=spec, max_model_len=256) as llm:
        outputs = serve_all(llm, batch)
        assert llm.metrics()["kv_tiers"]["disk"]["hits"] >= 3
        assert llm.metrics()["kv_blocks_used"] == 0
    assert outputs == [generate_with_cache(model, spec, prompt, 6) for prompt in batch]


def serve_all(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    outputs = llm.generate(batch, SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    return [output.outputs[0].token_ids for output in outputs]


def test_a_replica_sharing_redis_skips_the_prefill_of_a_seen_compressed_prompt(model):
    server = RedisServer()
    try:
        spec = "kivi:bits=4,residual=32"
        cold, _ = serve(model, (server.url,), PROMPT, kv_method=spec)
        warm, metrics = serve(model, (server.url,), PROMPT, kv_method=spec)
        assert warm == cold and metrics["cached"] == len(PROMPT) and metrics["kv_tiers"]["redis"]["hits"] == 1
    finally:
        server.stop()


def test_a_state_the_codec_cannot_store_leaves_the_request_running(model, tmp_path, monkeypatch, caplog):
    """The tiers are an optimisation: a method state the codec's walker refuses is logged and counted, never a failed
    request, and the prompt is computed next time."""
    import kvopt.engine.kv.cache_backed as cache_backed
    from kvopt.errors import CacheUsageError

    def refuse(*args, **kwargs):
        raise CacheUsageError("cannot save a cache holding a Widget in its state")

    monkeypatch.setattr(cache_backed, "cache_bytes", refuse)
    spec, tiers = "rocketkv:ratio=0.5", (f"disk:{tmp_path}:10MB",)
    for _ in range(2):
        tokens, metrics = serve(model, tiers, PROMPT, kv_method=spec)
        assert tokens == generate_with_cache(model, spec, PROMPT, len(tokens))
        assert metrics["cached"] == 0 and metrics["kv_tiers"]["disk"]["stores"] == 0
        assert metrics["kv_tiers"]["disk"]["errors"] == 1
    assert "cannot keep rocketkv" in caplog.text and "Widget" in caplog.text
