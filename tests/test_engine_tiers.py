"""The engine with KV tiers: a restarted engine or another replica serves a seen prefix from disk or Redis,
with the same tokens; damaged entries, another model's entries, a Redis that dies or never was: computed."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from kvopt.engine import LLM, SamplingParams
from kvopt.engine.config import EngineConfigError
from redis_server import RedisServer, free_port
from test_engine_compressed import assert_pool_empty, prompts
from tiny_models import tiny_model

TESTS = Path(__file__).resolve().parent
GREEDY = SamplingParams(max_tokens=6, ignore_eos=True)
PROMPT = prompts([100])[0]  # 6 full blocks of 16 can be reused (the last token is always computed)


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


def serve(model, tiers, prompt=PROMPT, **options):
    """One request on a fresh engine (a restarted process) with ``tiers``: ``(tokens, metrics)``; tiers flushed."""
    with LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=tiers, **options) as llm:
        (output,) = llm.generate([prompt], GREEDY, use_tqdm=False)
        assert output.error is None
        llm.engine.offload.chain.flush()
        metrics = llm.metrics()
        assert_pool_empty(llm)
    return output.outputs[0].token_ids, metrics | {"cached": output.metrics.cached_tokens}


def test_a_restarted_engine_serves_a_seen_prefix_from_disk(model, tmp_path):
    tiers = (f"disk:{tmp_path}:10MB",)
    cold, first = serve(model, tiers)
    assert first["cached"] == 0 and first["kv_tiers"]["disk"]["stores"] == 6 + 0  # 6 full blocks of prompt
    warm, second = serve(model, tiers)
    assert warm == cold
    assert second["cached"] == 96 and second["kv_tiers"]["disk"]["hits"] == 6
    assert second["prefix_cache_hits_total"] == 96


def test_hits_are_promoted_into_the_cpu_tier(model, tmp_path):
    tiers = ("cpu:1MB", f"disk:{tmp_path}:10MB")
    serve(model, tiers)
    with LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=tiers) as llm:
        llm.generate([PROMPT], GREEDY, use_tqdm=False)
        llm.engine.offload.chain.flush()
        cpu, disk = llm.metrics()["kv_tiers"]["cpu"], llm.metrics()["kv_tiers"]["disk"]
    # The disk's blocks were copied up, by the prefetch or the lookup (the two may race for a block: read twice).
    assert 6 <= disk["hits"] <= 12 and cpu["stores"] >= 6


@pytest.mark.parametrize("tenth", range(10))
def test_a_damaged_entry_is_dropped_and_its_tokens_computed(model, tmp_path, tenth):
    """The first block's file truncated at each 10% of its length, or a byte flipped: never served."""
    tiers = (f"disk:{tmp_path}:10MB",)
    cold, _ = serve(model, tiers)
    files = sorted(tmp_path.glob("*/*.kvb"), key=lambda file: file.stat().st_mtime_ns)
    damaged = files[0]
    data = damaged.read_bytes()
    if tenth:
        damaged.write_bytes(data[: len(data) * tenth // 10])
    else:
        damaged.write_bytes(data[:-1] + bytes([data[-1] ^ 0xFF]))
    warm, metrics = serve(model, tiers)
    assert warm == cold
    assert metrics["kv_tiers"]["disk"]["corrupt"] == 1
    assert damaged.read_bytes() == data  # dropped, computed, and written anew when the request finished


def test_another_models_blocks_are_never_found(model, tmp_path):
    tiers = (f"disk:{tmp_path}:10MB",)
    serve(model, tiers)
    other = tiny_model("llama", seed=1)
    tokens, metrics = serve(other, tiers)
    assert metrics["cached"] == 0 and metrics["kv_tiers"]["disk"]["hits"] == 0
    reference = other.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, eos_token_id=None, pad_token_id=0)
    assert tokens == reference[0, len(PROMPT) :].tolist()


def test_size_limit_holds_under_ten_times_its_bytes(model, tmp_path):
    limit = 200_000
    with LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=(f"disk:{tmp_path}:{limit}",)) as llm:
        llm.generate(prompts([160] * 16, seed=3), GREEDY, use_tqdm=False)  # ~160 blocks of ~12 KB: 10x the limit
        llm.engine.offload.chain.flush()
        disk = llm.metrics()["kv_tiers"]["disk"]
        tier = llm.engine.offload.chain.tiers[0]
        assert disk["stores"] >= 150 and disk["evictions"] > 0
        assert tier.disk_bytes() <= limit and disk["bytes_stored"] == tier.disk_bytes()


REPLICA = """
import sys
sys.path.insert(0, {tests!r})
from kvopt.engine import LLM, SamplingParams
from tiny_models import tiny_model
from test_engine_compressed import prompts
with LLM(tiny_model("llama"), kv_memory="2MB", kv_tiers=({url!r},)) as llm:
    (out,) = llm.generate([prompts([100])[0]], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
print(out.outputs[0].token_ids)
"""


def test_a_replica_in_another_process_reuses_blocks_through_redis(model):
    server = RedisServer()
    try:
        done = subprocess.run([sys.executable, "-c", REPLICA.format(tests=str(TESTS), url=server.url)],
                              capture_output=True, text=True, timeout=300)  # fmt: skip
        assert done.returncode == 0, done.stderr[-2000:]
        theirs = eval(done.stdout.strip().splitlines()[-1])
        ours, metrics = serve(model, (server.url,))
        assert ours == theirs and metrics["cached"] == 96 and metrics["kv_tiers"]["redis"]["hits"] == 6
    finally:
        server.stop()


def test_redis_stopped_mid_run_or_never_started_only_costs_recomputation(model):
    server = RedisServer()
    url = server.url
    cold, _ = serve(model, (url + "?max=64MB",))
    server.stop()
    after, metrics = serve(model, (url,))  # the blocks are gone with the server: computed, same tokens
    assert after == cold and metrics["cached"] == 0 and metrics["kv_tiers"]["redis"]["errors"] >= 1
    nothing, metrics = serve(model, (f"redis://127.0.0.1:{free_port()}/0",))
    assert nothing == cold and metrics["kv_tiers"]["redis"]["errors"] >= 1


@pytest.mark.parametrize("spec", ["cpu", "tape:/x", "disk:/tmp/x:lots", "redis://127.0.0.1:1/0?max=big"])
def test_malformed_tier_specs_are_refused_clearly(model, spec):
    with pytest.raises(EngineConfigError, match="kv_tiers"):
        LLM(copy.deepcopy(model), kv_memory="2MB", kv_tiers=(spec,))


def test_tier_counters_reach_prometheus(model, tmp_path):
    from prometheus_client.parser import text_string_to_metric_families

    from kvopt.serving.metrics import ServerMetrics

    tiers = (f"disk:{tmp_path}:10MB",)
    serve(model, tiers)
    _, metrics = serve(model, tiers)
    text = ServerMetrics("tiny").render(metrics).decode()
    samples = {(s.name, s.labels.get("tier")): s.value for f in text_string_to_metric_families(text) for s in f.samples}
    assert samples[("kvopt:kv_tier_hits_total", "disk")] == 6
    assert samples[("kvopt:kv_tier_bytes_stored", "disk")] == metrics["kv_tiers"]["disk"]["bytes_stored"] > 0
