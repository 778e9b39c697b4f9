"""``/metrics`` in Prometheus' text format, named as vLLM's (``vllm:x`` -> ``kvopt:x``) where the meaning is the same.

Two sources:

- the engine's snapshot (:meth:`LLMEngine.metrics`), read on the engine thread at each scrape and
  exported by a custom collector: KV-pool gauges, queue lengths, and the engine's counters
  (prefix-cache queries and hits in tokens, preemptions, prompt and generation tokens, finished
  requests by reason);
- latency histograms the server observes per request, as a client sees them (from the HTTP
  request's admission to each output reaching the event loop), with vLLM's bucket bounds.

Every series carries vLLM's ``model_name`` label.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

from kvopt.engine.metrics import E2E_BUCKETS, ITL_BUCKETS, TTFT_BUCKETS
from kvopt.serving.engine_client import RequestStream

PREFIX = "kvopt:"
#: Engine snapshot key -> help text, exported as gauges.
GAUGES = {
    "kv_cache_usage_perc": "Fraction of KV-cache blocks in use (1 = full).",
    "kv_bytes_held": "Bytes of KV cache held by requests (blocks in use).",
    "kv_bytes_saved_by_compression": "Bytes the requests' KV methods saved compared with a full-precision cache.",
    "kv_memory_waste_perc": "Fraction of allocated token slots of running requests that hold no token yet.",
    "num_requests_running": "Requests in the engine's running queue.",
    "num_requests_waiting": "Requests waiting for the engine to start them.",
    "num_requests_swapped": "Requests whose KV blocks are swapped out to host memory.",
    "step_itl_target_seconds": "The inter-token latency each step is sized for while sequences decode (0: none).",
    "step_prefill_budget_tokens": "Prompt tokens the latest step's budget left a prompt, once its decodes were in.",
}
#: Engine snapshot key (with ``_total``) -> help text, exported as counters.
COUNTERS = {
    "prefix_cache_queries": "Prompt tokens looked up in the prefix cache.",
    "prefix_cache_hits": "Prompt tokens found in the prefix cache (not recomputed).",
    "num_preemptions": "Sequences preempted (recomputed or swapped out) for lack of KV blocks.",
    "prompt_tokens": "Prompt tokens prefilled.",
    "generation_tokens": "Tokens generated.",
    "spec_decode_num_drafts": "Sequence steps that verified drafted tokens (speculative decoding).",
    "spec_decode_num_draft_tokens": "Tokens drafted for verification (speculative decoding).",
    "spec_decode_num_accepted_tokens": "Drafted tokens the model accepted (speculative decoding).",
    "step_target_missed": "Steps that decoded and ran past the inter-token latency target.",
}
#: Engine snapshot key -> help text, exported as histograms (the snapshot's cumulative buckets, sum and count).
HISTOGRAMS = {
    "step_time_predicted_over_measured": "A step's time as the step-time model predicted it over its measured time.",
}


class EngineCollector:
    """Exports the engine snapshots taken for the current scrape (nothing before the engine is loaded): one engine's,
    or several engines' with a ``replica`` label (the cluster's ingress, :mod:`kvopt.cluster`)."""

    def __init__(self, model_name: str) -> None:
        self.model_name = model_name
        #: Snapshot per replica name ({"": snapshot} for a single engine, exported without a ``replica`` label).
        self.snapshots: dict[str, dict] = {}

    def collect(self):
        if not self.snapshots:
            return
        names = ["model_name"] if "" in self.snapshots else ["model_name", "replica"]
        rows = [([self.model_name, replica][: len(names)], snapshot) for replica, snapshot in sorted(self.snapshots.items())]
        for key, doc in GAUGES.items():
            family = GaugeMetricFamily(PREFIX + key, doc, labels=names)
            for labels, snapshot in rows:
                family.add_metric(labels, snapshot[key])
            yield family
        for key, doc in COUNTERS.items():
            family = CounterMetricFamily(PREFIX + key, doc, labels=names)
            for labels, snapshot in rows:
                family.add_metric(labels, snapshot[f"{key}_total"])
            yield family
        for key, doc in HISTOGRAMS.items():
            family = HistogramMetricFamily(PREFIX + key, doc, labels=names)
            for labels, snapshot in rows:
                histogram = snapshot[key]
                buckets = [("+Inf" if bound == float("inf") else str(bound), count)
                           for bound, count in histogram["buckets"].items()]  # fmt: skip
                family.add_metric(labels, buckets, histogram["sum"])
            yield family
        finished = CounterMetricFamily(PREFIX + "request_success", "Requests finished, by finish reason "
                                       "(stop, length, abort, error).", labels=[*names, "finished_reason"])  # fmt: skip
        for labels, snapshot in rows:
            for reason, count in sorted(snapshot["request_success_total"].items()):
                finished.add_metric([*labels, reason], count)
        yield finished
        yield from _tier_families(rows, names)


#: Per-tier statistic -> (help text, counter?), exported as ``kvopt:kv_tier_<stat>`` with a ``tier`` label.
TIER_STATS = {
    "hits": ("KV entries (blocks, or compressed prompts' states) found in the tier.", True),
    "misses": ("KV entries looked up and not found in the tier.", True),
    "stores": ("KV entries written to the tier.", True),
    "evictions": ("KV entries the tier removed to stay within its size limit.", True),
    "corrupt": ("KV entries found damaged, from another model or for other tokens in the tier, dropped (never served).", True),
    "errors": ("Failed tier operations (disk full, Redis down): the engine computed instead.", True),
    "bytes_stored": ("Bytes the tier holds (Redis: the server's used_memory).", False),
    "mean_load_seconds": ("Mean time to read a hit from the tier.", False),
}


def _tier_families(rows: list[tuple[list[str], dict]], names: list[str]):
    if not any(snapshot["kv_tiers"] for _, snapshot in rows):
        return
    for stat, (doc, counter) in TIER_STATS.items():
        kind = CounterMetricFamily if counter else GaugeMetricFamily
        family = kind(f"{PREFIX}kv_tier_{stat}", doc, labels=[*names, "tier"])
        for labels, snapshot in rows:
            for tier, stats in snapshot["kv_tiers"].items():
                family.add_metric([*labels, tier], stats[stat])
        yield family


class ServerMetrics:
    """The server's registry (one per app, so several servers can share a process, as in the tests)."""

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry()
        self.engine = EngineCollector(model_name)
        self.registry.register(self.engine)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]):
            return Histogram(PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry).labels(model_name)

        self.ttft = histogram("time_to_first_token_seconds", "Time from a request's admission to its first token.",
                              TTFT_BUCKETS)  # fmt: skip
        self.itl = histogram("inter_token_latency_seconds", "Time between a request's successive outputs.", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Time from a request's admission to its last token.",
                             E2E_BUCKETS)  # fmt: skip

    def observe(self, stream: RequestStream) -> None:
        """Record a finished request's latencies (aborted and failed requests are not observed)."""
        times = stream.delivered
        if not stream.finished or not times:
            return
        self.ttft.observe(times[0] - stream.arrival)
        for before, after in zip(times, times[1:]):
            self.itl.observe(after - before)
        self.e2e.observe(times[-1] - stream.arrival)

    def render(self, snapshot: dict | None) -> bytes:
        return self.render_replicas({} if snapshot is None else {"": snapshot})

    def render_replicas(self, snapshots: dict[str, dict]) -> bytes:
        """Every replica's engine series, labelled ``replica`` (``{"": snapshot}``: one engine, no such label)."""
        self.engine.snapshots = snapshots
        return generate_latest(self.registry)
