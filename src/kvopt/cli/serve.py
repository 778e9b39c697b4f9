"""``kvopt serve``: the OpenAI-compatible HTTP API on the serving engine (vLLM's ``vllm serve``).

It listens at once and loads the model in the background (``/health`` answers 503 until it is
ready); a model or setting that cannot be used stops it with one line and exit code 2.
"""

from __future__ import annotations

from typing import Annotated, Optional

import typer

from kvopt.cli.options import (
    DeviceOption, DtypeOption, EngineSpeculateOption, ItlTargetOption, LongPrefillTokenThresholdOption,
    MaxNumBatchedTokensOption, MaxNumPartialPrefillsOption, ModelOption, SpeculateMaxBatchOption, WeightsOption,
    itl_target,
)
from kvopt.errors import KVOptError


def serve(
    model: ModelOption = None,
    kv_method: Annotated[str, typer.Option(help="KV method spec for the engine (requests may name their own kv_method)")] = "full",
    kv_memory: Annotated[str, typer.Option(help="KV pool size: 1GB, 512MiB, or a fraction of free memory (0.5)")] = "1GB",
    host: Annotated[str, typer.Option(help="address to listen on (0.0.0.0 for every interface)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=0, max=65535, help="TCP port")] = 8000,
    api_key: Annotated[Optional[str], typer.Option(envvar="KVOPT_API_KEY", help="require 'Authorization: Bearer KEY' on /v1/* and /tokenize")] = None,
    served_model_name: Annotated[Optional[str], typer.Option(help="the name clients pass as model; default: --model as given")] = None,
    block_size: Annotated[int, typer.Option(min=1, help="tokens per KV block")] = 16,
    max_num_seqs: Annotated[int, typer.Option(min=1, help="sequences decoded together at most")] = 64,
    max_model_len: Annotated[Optional[int], typer.Option(min=2, help="longest prompt + output; default: the model's")] = None,
    max_num_batched_tokens: MaxNumBatchedTokensOption = 4096,
    long_prefill_token_threshold: LongPrefillTokenThresholdOption = None,
    max_num_partial_prefills: MaxNumPartialPrefillsOption = None,
    itl_target_ms: ItlTargetOption = "auto",
    prefix_caching: Annotated[bool, typer.Option("--prefix-caching/--no-prefix-caching")] = True,
    dtype: DtypeOption = None,
    weights: WeightsOption = None,
    device: DeviceOption = "auto",
    max_prompt_tokens: Annotated[Optional[int], typer.Option(min=1, help="longest prompt accepted (400 beyond); default: the context")] = None,
    max_output_tokens: Annotated[Optional[int], typer.Option(min=1, help="largest max_tokens accepted (400 beyond); default: the context")] = None,
    max_waiting: Annotated[int, typer.Option(min=0, help="requests that may wait beyond --max-num-seqs running ones (429 beyond)")] = 256,
    max_body_bytes: Annotated[int, typer.Option(min=1, help="largest request body (413 beyond)")] = 4 * 2**20,
    request_timeout: Annotated[float, typer.Option(min=0.001, help="seconds a request may take (408 beyond)")] = 600.0,
    shutdown_timeout: Annotated[float, typer.Option(min=0, help="seconds open requests may take to finish after SIGTERM (then: 503)")] = 30.0,
    access_log: Annotated[bool, typer.Option("--access-log/--no-access-log", help="log every request")] = True,
    threads: Annotated[Optional[int], typer.Option(min=1, help="torch CPU threads; default: torch's (on a machine "
                                                   "other busy processes share, fewer avoids spinning threads)")] = None,
    kv_tier: Annotated[Optional[list[str]], typer.Option(help="a KV tier beyond the pool, fastest first, repeatable: "
                                                         "cpu:4GB, disk:PATH:20GB, redis://HOST:PORT/0?max=1GB")] = None,
    kv_tier_encoding: Annotated[str, typer.Option(help="codec of tier entries: raw, int8, int4 or cachegen")] = "raw",
    speculate: EngineSpeculateOption = None,
    speculate_max_batch: SpeculateMaxBatchOption = None,
    chunk_caching: Annotated[bool, typer.Option("--chunk-caching/--no-chunk-caching", help="reuse the KV of the "
                                                "\"documents\" a chat request names wherever they appear (CacheBlend)")] = False,
    chunk_memory: Annotated[str, typer.Option(help="with --chunk-caching: the documents' KV kept in memory "
                                              "(least recently used first out; more in --kv-tier)")] = "256MB",
    blend_ratio: Annotated[float, typer.Option(help="with --chunk-caching: the share of the documents' tokens "
                                               "recomputed (0 = plain concatenation, 1 = full prefill)")] = 0.15,
    blend_strategy: Annotated[str, typer.Option(help="with --chunk-caching: cacheblend (recompute the tokens that "
                                                "deviate most) or epic (each document's first tokens)")] = "cacheblend",
    blend_check_layer: Annotated[Optional[int], typer.Option(min=0, help="with --chunk-caching: the layer where "
                                                             "CacheBlend chooses its tokens; deeper chooses better and "
                                                             "computes every token up to it; default 1")] = None,
    session_memory: Annotated[str, typer.Option(help="host memory for the episodes of requests' named \"session\"s "
                                                "(epicache); least recently used idle ones go first")] = "1GB",
    replicas: Annotated[Optional[int], typer.Option(help="engine replicas on Ray Serve behind a KV-aware router "
                                                    "(pip install kvopt[cluster]); each takes --threads CPUs (default 1)")] = None,
    ray_address: Annotated[Optional[str], typer.Option(help="join a running Ray cluster: auto, or the head's HOST:PORT; "
                                                       "default: start a local one")] = None,
    min_replicas: Annotated[Optional[int], typer.Option(help="autoscale the replicas with load, from this many")] = None,
    max_replicas: Annotated[Optional[int], typer.Option(help="autoscale the replicas with load, up to this many")] = None,
) -> None:
    """Serve /v1/completions, /v1/chat/completions, /v1/models, /tokenize, /health and /metrics over HTTP."""
    import torch

    from kvopt.chunks.blend import check_settings
    from kvopt.engine import EngineConfig
    from kvopt.engine.config import parse_memory
    from kvopt.engine.offload import tier_spec
    from kvopt.engine.requests import DEFAULT_MODEL_NAME
    from kvopt.methods import parse
    from kvopt.models.cpu_features import check_model_dtype
    from kvopt.models.device import resolve_device
    from kvopt.models.int8_linear import check_weights
    from kvopt.serving import ServerSettings
    from kvopt.serving import serve as run

    parse(kv_method)  # a malformed spec or setting fails before the port is taken
    check_model_dtype(dtype)
    check_weights(weights, dtype, resolve_device(device))
    steps = dict(max_num_batched_tokens=max_num_batched_tokens, long_prefill_token_threshold=long_prefill_token_threshold,
                 max_num_partial_prefills=max_num_partial_prefills, itl_target_ms=itl_target(itl_target_ms))  # fmt: skip
    EngineConfig(kv_method, block_size, kv_memory, prefix_caching, max_num_seqs=max_num_seqs,
                 max_model_len=max_model_len, speculate=speculate, speculate_max_batch=speculate_max_batch,
                 session_memory=session_memory, **steps)  # fmt: skip
    parse_memory(chunk_memory, torch.device("cpu"), "chunk_memory")
    check_settings(blend_ratio, blend_strategy, check_layer=blend_check_layer)  # the model's depth is checked at load
    if not chunk_caching and (blend_ratio, blend_strategy, blend_check_layer) != (0.15, "cacheblend", None):
        raise KVOptError("--blend-ratio, --blend-strategy and --blend-check-layer set how documents are reused: "
                         "add --chunk-caching")  # fmt: skip
    tiers = tuple(kv_tier or ())
    for spec in tiers:  # a malformed tier fails before the port is taken (it is opened with the engine)
        tier_spec(spec)

    engine_args = dict(model=model, kv_method=kv_method, kv_memory=kv_memory, block_size=block_size, dtype=dtype,
                       weights=weights, device=device, enable_prefix_caching=prefix_caching, max_num_seqs=max_num_seqs,
                       max_model_len=max_model_len, kv_tiers=tiers, kv_tier_encoding=kv_tier_encoding,
                       speculate=speculate, speculate_max_batch=speculate_max_batch, session_memory=session_memory,
                       enable_chunk_caching=chunk_caching, chunk_memory=chunk_memory, blend_ratio=blend_ratio,
                       blend_strategy=blend_strategy, blend_check_layer=blend_check_layer, **steps)  # fmt: skip

    def load():
        from kvopt.engine import LLM

        if threads is not None:
            torch.set_num_threads(threads)
        return LLM(**engine_args).engine

    settings = ServerSettings(
        served_model_name or model or DEFAULT_MODEL_NAME, api_key, max_prompt_tokens, max_output_tokens,
        max_waiting, max_body_bytes, request_timeout, shutdown_timeout,
    )  # fmt: skip
    if (replicas, ray_address, min_replicas, max_replicas) != (None,) * 4:
        from kvopt.cluster import ClusterSpec, serve_cluster

        gpus = 1.0 if device.startswith("cuda") else 0.0
        count = replicas if replicas is not None else min_replicas or 1
        spec = ClusterSpec(count, threads or 1, gpus, min_replicas, max_replicas)
        serve_cluster(engine_args, settings, spec, max_num_seqs, host, port, ray_address)
        return
    run(load, settings, host, port, access_log)
