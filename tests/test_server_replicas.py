"""Two ``kvopt serve`` replicas sharing one Redis: the second one's first request reuses what the first computed.

Real processes (one torch thread each), a real ``redis-server`` on loopback, the README's deployment
in miniature (a load balancer would spread the requests; here the test sends one to each replica).
"""

import signal
import subprocess
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families

from redis_server import RedisServer
from test_server_cli import start_server, wait_ready

PROMPT = list(range(1000, 1150))  # 150 token ids: 9 full blocks of 16 can be reused (the last token is computed)
KIVI = "kivi:bits=4,residual=32"


def complete(url: str, kv_method: str | None = None) -> dict:
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 8, "ignore_eos": True, "temperature": 0}
    if kv_method:
        body["kv_method"] = kv_method
    response = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def tier_counters(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics").text
    return {sample.name: sample.value for family in text_string_to_metric_families(text) for sample in family.samples
            if sample.labels.get("tier") == "redis"}  # fmt: skip


def wait_for_stores(url: str, count: int) -> None:
    """The first replica writes behind (a background thread): wait until its entries reached Redis."""
    deadline = time.monotonic() + 60
    while tier_counters(url).get("kvopt:kv_tier_stores_total", 0) < count:
        assert time.monotonic() < deadline, tier_counters(url)
        time.sleep(0.1)


def test_a_second_replica_reuses_the_firsts_prefix_and_compressed_prompt_through_redis(model_folder):
    server = RedisServer()
    replicas = []
    try:
        replicas = [start_server(model_folder, "--kv-tier", server.url + "?max=64MB") for _ in range(2)]
        for process, url in replicas:
            wait_ready(process, url)
        (_, first), (_, second) = replicas
        lossless, compressed = complete(first), complete(first, KIVI)
        assert lossless["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
        wait_for_stores(first, 9 + 1)  # nine full blocks, and the compressed prompt's state
        assert server.client().dbsize() == 10

        reused = complete(second)
        assert reused["usage"]["prompt_tokens_details"]["cached_tokens"] == 9 * 16
        assert reused["choices"][0]["text"] == lossless["choices"][0]["text"]
        reused_compressed = complete(second, KIVI)
        assert reused_compressed["usage"]["prompt_tokens_details"]["cached_tokens"] == len(PROMPT)
        assert reused_compressed["choices"][0]["text"] == compressed["choices"][0]["text"]
        counters = tier_counters(second)
        assert counters["kvopt:kv_tier_hits_total"] == 9 + 1 and counters["kvopt:kv_tier_corrupt_total"] == 0
    finally:
        for process, _ in replicas:
            process.send_signal(signal.SIGTERM)
        for process, _ in replicas:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(10)
        server.stop()
    assert all(process.returncode is not None for process, _ in replicas)
    assert server.process.returncode is not None
