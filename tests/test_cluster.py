"""kvopt on a local Ray cluster started by this module: 2 engine replicas (1 CPU, 1 torch thread each) of the tiny
model behind the KV-aware router, driven with the real ``openai`` client and compared with the single-process server.

The routing rule and the prefix index are tested alone first (no Ray); the cluster is started once for the rest.
"""

import json
import os
import socket
import time

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvopt.cluster.index import FALLBACK, NO_MATCH, PREFIX_HIT, PrefixIndex, rank
from kvopt.cluster.keys import route_keys
from kvopt.engine.block_manager import BlockManager

MODEL = "tiny"
PREFIX = list(range(1000, 1200))  # 200 token ids shared by the prefix-affinity requests


# -- the rule, without Ray -------------------------------------------------------------------------------------
def test_route_keys_are_the_block_managers_chained_hashes_and_compressed_prompts_have_one_whole_key():
    manager = BlockManager(4, 16, salt="model|full")
    prompt = list(range(50))
    keys, whole = route_keys(prompt, "full", manager.root_hash, 16)
    assert not whole and keys == manager.hashes_of(prompt, 3)  # 49 tokens may hit: 3 full blocks
    assert route_keys(prompt[:16], "full", manager.root_hash, 16)[0] == []  # the last token is always computed
    snap, whole = route_keys(prompt, "snapkv:ratio=0.5", manager.root_hash, 16)
    assert whole and len(snap) == 1 and snap[0] not in keys
    assert route_keys(prompt, "snapkv:ratio=0.50", manager.root_hash, 16)[0] == snap  # the canonical spec
    assert route_keys(prompt, "kivi:bits=4", manager.root_hash, 16)[0] != snap
    assert route_keys(prompt[:-1], "snapkv:ratio=0.5", manager.root_hash, 16)[0] != snap  # every token counts


def test_the_longest_leading_run_wins_and_imbalance_falls_back_to_the_least_loaded():
    index = PrefixIndex(routed_ttl_s=10)
    a, b, c = [bytes([i]) * 16 for i in range(3)]
    index.report("r1", 1, a + b)
    index.report("r2", 1, a + b + c)
    index.report("r3", 1, b + c)  # holds later blocks but not the first: no run
    loads = {"r1": 0, "r2": 3, "r3": 0}
    ranks, decision, run = rank([a, b, c], loads, {}, index, imbalanced_threshold=10, kv_usage_threshold=0.5)
    assert (ranks[0], decision, run) == (["r2"], PREFIX_HIT, 3)
    assert set(ranks[1]) == {"r1", "r3"}
    ranks, decision, _ = rank([a, b, c], loads | {"r2": 11}, {}, index, 10, 0.5)
    assert decision == FALLBACK and ranks[0][0] in {"r1", "r3"} and ranks[-1][-1] == "r2"
    ranks, decision, _ = rank([a, b, c], loads, {"r1": 0.0, "r2": 0.9, "r3": 0.1}, index, 10, 0.5)
    assert decision == FALLBACK and "r2" not in ranks[0]
    ranks, decision, _ = rank([b"d" * 16], loads, {}, index, 10, 0.5)
    assert decision == NO_MATCH and ranks[0][0] in {"r1", "r3"}


def test_routed_keys_count_until_they_expire_and_reports_replace_what_a_replica_holds():
    index = PrefixIndex(routed_ttl_s=5)
    a, b = b"a" * 16, b"b" * 16
    index.routed("r1", [a, b], whole_prompt=False, now=100.0)
    assert index.matched("r1", [a, b], now=104.0) == 2
    assert index.matched("r1", [a, b], now=106.0) == 0  # a report would have listed them by now
    index.report("r1", 1, a)
    assert index.matched("r1", [a, b], now=106.0) == 1
    index.report("r1", 2, b"")  # evicted
    assert index.matched("r1", [a], now=106.0) == 0
    index.routed("r1", [b], whole_prompt=True, now=100.0)
    assert index.matched("r1", [b], now=1e9) == 1  # whole-prompt keys are never reported; they stay (LRU)
    index.keep_only({"r2"})
    assert index.matched("r1", [b]) == 0


# -- the cluster --------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def engine_args(model_folder, **extra) -> dict:
    return {"model": str(model_folder), "kv_memory": "32MB", "max_num_seqs": 4, "max_model_len": 2048} | extra


@pytest.fixture(scope="module")
def ray_cluster():
    ray = pytest.importorskip("ray")
    from ray import serve

    # Serve kills a proxy not ready in 5 s; on a loaded 2-core machine (the suite runs a worker per core) it can take
    # longer, so the started processes inherit roomier limits.
    for name in ("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "RAY_SERVE_PROXY_HEALTH_CHECK_TIMEOUT_S"):
        os.environ.setdefault(name, "120")
    ray.init(num_cpus=4, include_dashboard=False, log_to_driver=False)  # 2 replicas, then 2 Ray Data actors
    port = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


def deploy(url: str, model_folder, name: str = "kvopt", stats_period_s: float = 0.3, **extra) -> str:
    from ray import serve

    from kvopt.cluster import ClusterSpec, build
    from kvopt.serving import ServerSettings

    args = engine_args(model_folder, **extra)
    app = build(args, ServerSettings(MODEL, max_waiting=4), ClusterSpec(replicas=2, stats_period_s=stats_period_s),
                args["max_num_seqs"])  # fmt: skip
    serve.run(app, name=name, route_prefix="/")
    return url


@pytest.fixture(scope="module")
def redis_server():
    from redis_server import RedisServer

    server = RedisServer()
    yield server
    server.stop()


@pytest.fixture(scope="module")
def cluster(ray_cluster, model_folder, redis_server):
    """The application, deployed once: its replicas share a Redis tier, which the prefix-affinity test shows unused
    (its hits come from the chosen replica's own pool) and the replica-kill test uses."""
    from ray import serve

    yield deploy(ray_cluster, model_folder, kv_tiers=(redis_server.url + "?max=64MB",), itl_target_ms="auto")
    serve.delete("kvopt")


@pytest.fixture(scope="module")
def single(model_folder):
    """The single-process server on the same model and settings, for reference."""
    from kvopt.engine import LLM
    from kvopt.serving import ServerSettings, ThreadedServer

    with ThreadedServer(lambda: LLM(**engine_args(model_folder)).engine, ServerSettings(MODEL, max_waiting=4)) as server:
        yield server.wait_ready()


def client(url: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=url + "/v1", api_key="-", max_retries=0, timeout=120)


def replica_counters(url: str, name: str = "kvopt:request_success_total") -> dict[str, float]:
    """A counter per replica (summed over its other labels), as the ingress's /metrics shows it."""
    counts: dict[str, float] = {}
    for family in text_string_to_metric_families(httpx.get(url + "/metrics", timeout=30).text):
        for sample in family.samples:
            if sample.name == name and "replica" in sample.labels:
                counts[sample.labels["replica"]] = counts.get(sample.labels["replica"], 0) + sample.value
    return counts


def metric(url: str, name: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return sum(s.value for f in text_string_to_metric_families(text) for s in f.samples if s.name == name)


def wait_until(check, timeout: float = 30.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while not (result := check()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)
    return result


def settled(read, pause: float = 1.5):
    """``read()`` once two reads ``pause`` seconds apart agree (the replicas report every 0.3 s)."""
    previous = read()
    while True:
        time.sleep(pause)
        if (current := read()) == previous:
            return current
        previous = current


def test_completions_and_chat_plain_and_streamed_equal_the_single_process_server(cluster, single):
    calls = {
        "completion": lambda c, **kw: c.completions.create(model=MODEL, prompt="The capital of France is",
                                                           max_tokens=12, temperature=0, **kw),
        "chat": lambda c, **kw: c.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                                          max_tokens=12, temperature=0, **kw),
    }  # fmt: skip
    for kind, call in calls.items():
        results = []
        for url in (cluster, single.url):
            plain = call(client(url))
            chunks = list(call(client(url), stream=True, stream_options={"include_usage": True}))
            text = plain.choices[0].text if kind == "completion" else plain.choices[0].message.content
            streamed = "".join((c.choices[0].text if kind == "completion" else c.choices[0].delta.content or "")
                               for c in chunks if c.choices)  # fmt: skip
            results.append((text, streamed, plain.usage.completion_tokens, chunks[-1].usage.completion_tokens))
        assert results[0] == results[1], kind
        assert results[0][0] == results[0][1] and results[0][2] == 12


def test_requests_sharing_a_200_token_prefix_land_on_one_replica_and_hit_its_prefix_cache(cluster):
    wait_until(lambda: len(replica_counters(cluster, "kvopt:kv_cache_usage_perc")) == 2, what="both replicas' reports")
    before = settled(lambda: replica_counters(cluster))  # the earlier tests' requests all counted
    hits = metric(cluster, "kvopt:router_prefix_hits_total")
    tier_hits = sum(replica_counters(cluster, "kvopt:kv_tier_hits_total").values())
    cached = []
    for question in range(6):
        body = client(cluster).completions.create(model=MODEL, prompt=PREFIX + [2000 + question, 7, 8], max_tokens=4,
                                                  temperature=0)  # fmt: skip
        cached.append(body.usage.prompt_tokens_details.cached_tokens)
    assert cached[0] == 0 and all(count == 12 * 16 for count in cached[1:])  # 12 full blocks of the 200 tokens
    assert metric(cluster, "kvopt:router_prefix_hits_total") - hits == 5

    def moved():
        after, live = replica_counters(cluster), replica_counters(cluster, "kvopt:kv_cache_usage_perc")
        return sorted(after.get(r, 0) - before.get(r, 0) for r in live) == [0, 6]

    wait_until(moved, what="the replicas' reports to show all six requests on one replica")
    assert sum(replica_counters(cluster, "kvopt:kv_tier_hits_total").values()) == tier_hits  # the pool's own blocks


def test_requests_past_every_replicas_room_get_429_with_retry_after_not_a_hang(cluster):
    import asyncio

    room = 2 * (4 + 4)  # replicas x (--max-num-seqs + --max-waiting)
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 400, "ignore_eos": True}

    async def main():
        async with httpx.AsyncClient(base_url=cluster, timeout=300) as http:
            return await asyncio.gather(*[http.post("/v1/completions", json=body) for _ in range(2 * room)])

    responses = asyncio.run(main())  # all arrive long before the first can finish its 400 tokens
    refused = [response for response in responses if response.status_code == 429]
    served = [response for response in responses if response.status_code == 200]
    # The ingress admits every replica's room and refuses the rest; Serve's queue holds the admitted burst while its
    # router assigns it (a queue of --max-waiting refused requests the replicas had room for: 5 of 32 served).
    others = [(response.status_code, response.text[:300]) for response in responses if response.status_code not in (200, 429)]
    assert (len(served), len(refused)) == (room, room) and not others, others
    assert all(r.headers["retry-after"] == "1" and r.json()["error"]["code"] == "queue_full" for r in refused)
    assert "cluster is full" in refused[0].json()["error"]["message"]
    assert all(r.json()["usage"]["completion_tokens"] == 400 for r in served)


def test_each_replica_sizes_its_steps_for_the_target_it_measured(cluster):
    """``--itl-target-ms auto`` (serve's default) is derived by each replica from the decode step it timed at
    start-up and kept by its own scheduler: the burst above decoded on both, and each reports its own target and
    prompt budget."""
    targets = settled(lambda: replica_counters(cluster, "kvopt:step_itl_target_seconds"))
    budgets = replica_counters(cluster, "kvopt:step_prefill_budget_tokens")
    assert len(targets) == 2 and all(target > 0 for target in targets.values()), targets
    assert budgets.keys() == targets.keys() and all(budget > 0 for budget in budgets.values()), budgets


def test_bad_cluster_settings_fail_with_one_line_and_exit_2(ray_cluster, monkeypatch, capsys):
    import sys

    from kvopt.cli.main import main
    from kvopt.cluster import ClusterConfigError, ClusterSpec, connect

    with pytest.raises(ClusterConfigError, match="need 64 CPUs .* the cluster has 4; lower --replicas"):
        connect(None, ClusterSpec(replicas=64))  # the module's cluster has 4 CPUs
    for args, problem in [(["--replicas", "0"], "--replicas 0: give at least 1"),
                          (["--ray-address", f"127.0.0.1:{free_port()}"], "does not answer"),
                          (["--min-replicas", "3", "--max-replicas", "2"], "give 1 <= min <= max")]:  # fmt: skip
        monkeypatch.setattr(sys, "argv", ["kvopt", "serve", *args])
        with pytest.raises(SystemExit) as exit_info:
            main()
        err = capsys.readouterr().err
        assert exit_info.value.code == 2 and problem in err and len(err.strip().splitlines()) == 1, err


def test_a_replica_killed_mid_stream_ends_its_stream_with_an_error_the_survivor_finds_the_prefix_in_redis(
    cluster, redis_server
):  # fmt: skip
    import ray

    wait_until(lambda: redis_server.client().dbsize() >= 12, what="the prefix's blocks in Redis")
    # the replica whose prefix cache the shared-prefix requests hit (the most requests served is not it: the burst
    # test's requests can land more on the other replica)
    hits_by_replica = replica_counters(cluster, "kvopt:prefix_cache_hits_total")
    holder = max((count, replica) for replica, count in hits_by_replica.items())[1]
    survivor = next(replica for replica in replica_counters(cluster, "kvopt:kv_cache_usage_perc") if replica != holder)
    actor = next(a for a in ray.util.list_named_actors(all_namespaces=True) if a["name"].endswith(f"#{holder}"))
    idle = lambda: list(replica_counters(cluster, "kvopt:num_requests_running").values()) == [0.0, 0.0]  # noqa: E731
    wait_until(idle, what="both replicas idle in their reports (a stale load would route past the prefix)")
    hits = metric(cluster, "kvopt:router_prefix_hits_total")
    body = {"model": MODEL, "prompt": PREFIX + [3000], "max_tokens": 1500, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", cluster + "/v1/completions", json=body, timeout=120) as response:
        lines = response.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert "choices" in first
        ray.kill(ray.get_actor(actor["name"], namespace=actor["namespace"]), no_restart=True)
        events = [line.removeprefix("data: ") for line in lines if line.startswith("data: ")]
    assert metric(cluster, "kvopt:router_prefix_hits_total") - hits == 1  # the stream ran on the holder
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])["error"]
    assert error["type"] == "server_error" and "retry the request" in error["message"]

    reused = client(cluster).completions.create(model=MODEL, prompt=PREFIX + [4000, 5], max_tokens=4, temperature=0)
    assert reused.usage.prompt_tokens_details.cached_tokens == 12 * 16  # from Redis: the holder is gone
    wait_until(lambda: replica_counters(cluster, "kvopt:kv_tier_hits_total").get(survivor, 0) >= 12,
               what="the survivor's Redis hits")  # fmt: skip
    live = lambda: set(replica_counters(cluster, "kvopt:kv_cache_usage_perc"))  # noqa: E731
    wait_until(lambda: len(live()) == 2 and holder not in live(), timeout=300, what="Serve to restart the dead replica")


def test_batch_on_ray_data_equals_the_single_process_batch_line_for_line(ray_cluster, model_folder, tmp_path,
                                                                         monkeypatch, capsys):  # fmt: skip
    import sys

    from kvopt.cli.main import main

    lines = [{"prompt": f"Question {i}: what number comes after {i}?", "max_tokens": 4} for i in range(199)]
    lines.insert(57, {"prompt": " hello" * 2500, "max_tokens": 4})  # longer than the context: fails alone
    source = tmp_path / "in.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    outputs = {}
    for name, extra in [("single", []), ("ray", ["--ray", "--replicas", "2"])]:
        outputs[name] = tmp_path / f"{name}.jsonl"
        argv = ["kvopt", "batch", str(source), "-o", str(outputs[name]), "--model", str(model_folder), "--kv-memory",
                "32MB", "--no-metrics", *extra]  # fmt: skip
        monkeypatch.setattr(sys, "argv", argv)
        try:
            main()
        except SystemExit as exit_info:
            pytest.fail(f"exit {exit_info.code}: {capsys.readouterr().err}")

    def comparable(path):
        results = [json.loads(line) for line in path.read_text().splitlines()]
        for result in results:
            if result["response"] is not None:
                del result["response"]["metrics"]  # timings
        return results

    single, spread = comparable(outputs["single"]), comparable(outputs["ray"])
    assert len(single) == 200 and spread == single
    assert [r["custom_id"] for r in spread] == [f"line-{i}" for i in range(1, 201)]
    assert spread[57]["response"] is None and "shorten the prompt" in spread[57]["error"]
