"""The serving engine next to HF on the default model: throughput, prefix caching, capacity, latency.

    python benchmarks/serving.py                       # every step (~40 min on 2 cores)
    python benchmarks/serving.py --steps prefix        # one step; its rows replace that step's old rows
    python benchmarks/serving.py --steps speculative   # the engine with and without prompt-lookup drafts (~5 min)

Rows go to benchmarks/results/serving.jsonl (committed, so BENCHMARKS.md can be recomposed or
one step re-run on another machine); ``benchmarks/run.py`` turns them into its engine section.
All systems run in this one process, on the same prompts, one after another.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from sections import conditions_line, opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "serving.jsonl"
STEPS = ("throughput", "prefix", "capacity", "latency", "speculative")
#: How rows name the default model (rows from before the capacity step took ``--model`` name none).
DEFAULT_MODEL = "smollm2-135m"
#: The recipes the capacity step compares (kvzip's ranking and kivi do not compose: kivi quantizes during the prefill
#: that kvzip needs whole).
CAPACITY_METHODS = ("full", "kivi:bits=4", "snapkv:ratio=0.75", "snapkv:ratio=0.75+kivi:bits=4", "kvzip:ratio=0.75",
                    "kvzip:ratio=0.75+kivi:bits=4", "aquakv:bits=2", "rocketkv:budget=512", "minicache+kivi:bits=4")


def token_range(text: str) -> tuple[int, int]:
    """``LOW-HIGH`` token counts (e.g. ``100-200``), an argparse type for ``--prompt-tokens``."""
    try:
        low, high = (int(part) for part in text.split("-"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not LOW-HIGH, e.g. 100-200") from None
    if not 0 < low <= high:
        raise argparse.ArgumentTypeError(f"{text!r}: need 0 < LOW <= HIGH")
    return low, high


def real_prompts(tokenizer, count: int, low: int, high: int, seed: int = 0) -> list[list[int]]:
    """``count`` windows of local real text, each ``low``-``high`` tokens long."""
    from kvopt.local_text import real_text

    ids = tokenizer(real_text()[0], add_special_tokens=False).input_ids
    rng = random.Random(seed)
    prompts = []
    for _ in range(count):
        length = rng.randint(low, high)
        start = rng.randrange(len(ids) - length)
        prompts.append(ids[start : start + length])
    return prompts


def hf_model():
    """The default model with HF's own SDPA attention (the peers' configuration)."""
    from kvopt import load_model

    model, tokenizer = load_model()
    model.set_attn_implementation("sdpa")
    return model, tokenizer


def engine(kv_memory, **options):
    from kvopt.engine import LLM

    return LLM(kv_memory=kv_memory, **options)


def greedy(new_tokens: int):
    from kvopt.engine import SamplingParams

    return SamplingParams(max_tokens=new_tokens, ignore_eos=True)


# -- throughput -------------------------------------------------------------------------------
def throughput(args) -> list[dict]:
    model, tokenizer = hf_model()
    prompts = real_prompts(tokenizer, args.requests, 100, 1000)
    new, rows = args.new_tokens, []
    base = {"step": "throughput", "requests": len(prompts), "new_tokens": new,
            "prompt_tokens": sum(map(len, prompts))}  # fmt: skip

    llm = engine(args.kv_memory, max_num_seqs=args.max_num_seqs)
    pool_bytes = llm.engine.runner.pool.nbytes()
    # transformers' continuous batching runs first: on a CPU it sizes its buffers from the memory the
    # process has not touched yet (RSS), and the HF runs below leave several GB resident.
    peer = _generate_batch(model, prompts, new, pool_bytes, llm.engine.config.max_num_batched_tokens) \
        if args.generate_batch else None
    waste = []
    start = time.perf_counter()
    outputs = _generate_sampling_waste(llm, prompts, greedy(new), waste)
    seconds = time.perf_counter() - start
    ours = [out.outputs[0].token_ids for out in outputs]
    metrics = llm.metrics()
    rows.append(base | {"system": "kvopt.LLM", "seconds": seconds, "tok_s": len(prompts) * new / seconds,
                        "waste_steady": statistics.median(waste) if waste else None,
                        "preemptions": metrics["num_preemptions_total"], "pool_bytes": pool_bytes})  # fmt: skip
    print(rows[-1])
    del llm

    pad, eos = tokenizer.pad_token_id, model.generation_config.eos_token_id
    start = time.perf_counter()
    theirs = hf_static_batches(model, prompts, new, pad)
    seconds = time.perf_counter() - start
    rows.append(base | {"system": "HF static batches of 8", "seconds": seconds, "tok_s": len(prompts) * new / seconds,
                        **_agreement(theirs, ours, eos)})  # fmt: skip
    print(rows[-1])

    count = min(args.sequential_requests, len(prompts))
    start = time.perf_counter()
    theirs = hf_one_at_a_time(model, prompts[:count], new, pad)
    seconds = time.perf_counter() - start
    rows.append(base | {"system": "HF generate, one request at a time", "requests": count, "seconds": seconds,
                        "tok_s": count * new / seconds, **_agreement(theirs, ours, eos)})  # fmt: skip
    print(rows[-1])

    if peer is not None:
        theirs = peer.pop("tokens")
        rows.append(base | peer | {"same_as_kvopt": sum(a == b for a, b in zip(theirs, ours))})
        print(rows[-1])
    return rows


def hf_static_batches(model, prompts: list[list[int]], new: int, pad: int, size: int = 8) -> list[list[int]]:
    """HF ``generate`` on batches of ``size`` prompts in order, left-padded with ``pad``, ``new`` tokens each (greedy,
    EOS ignored): the new tokens of each prompt."""
    tokens = []
    for first in range(0, len(prompts), size):
        batch = prompts[first : first + size]
        width = max(map(len, batch))
        ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch])
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad)  # fmt: skip
        tokens.extend(out[i, width:].tolist() for i in range(len(batch)))
    return tokens


def hf_one_at_a_time(model, prompts: list[list[int]], new: int, pad: int) -> list[list[int]]:
    """HF ``generate`` on each prompt alone, ``new`` tokens each (greedy, EOS ignored)."""
    tokens = []
    for prompt in prompts:
        with torch.inference_mode():
            out = model.generate(torch.tensor([prompt]), max_new_tokens=new, min_new_tokens=new, do_sample=False,
                                 pad_token_id=pad)  # fmt: skip
        tokens.append(out[0, len(prompt) :].tolist())
    return tokens


def _agreement(theirs: list[list[int]], ours: list[list[int]], eos) -> dict:
    """Requests whose tokens equal kvopt's, and of the others those that part where kvopt chose EOS."""
    eos = set(eos) if isinstance(eos, (list, tuple)) else {eos}
    differ = [(a, b) for a, b in zip(theirs, ours) if a != b]
    at_eos = sum(b[next(k for k, (x, y) in enumerate(zip(a, b)) if x != y)] in eos for a, b in differ)
    return {"same_as_kvopt": len(theirs) - len(differ), "differ_at_eos": at_eos}


def _generate_sampling_waste(llm, prompts, params, waste: list[float]):
    """``llm.generate`` through the engine core, recording memory waste at steady state (pool half full or more)."""
    core = llm.engine
    for index, prompt in enumerate(prompts):
        core.add_request(str(index), prompt, params)
    finished = {}
    while core.has_unfinished_requests():
        for output in core.step():
            if output.finished:
                finished[output.request_id] = output
        allocated, used = core.slot_usage()
        manager = core.block_manager
        if len(core.scheduler.running) >= len(prompts) // 2 or manager.num_used_blocks >= manager.num_blocks // 2:
            waste.append(1.0 - used / allocated)
    return [finished[str(index)] for index in range(len(prompts))]


def _generate_batch(model, prompts, new: int, pool_bytes: int, step_tokens: int) -> dict:
    """transformers' continuous batching (``generate_batch``, paged attention) with kvopt's pool bytes and step budget.

    Raises when it does not produce ``new`` tokens for every request: it logs its own failures (an
    out-of-memory at start-up, say) and returns what it has, which would otherwise time as a fast run.
    """
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    from kvopt.models.info import ModelInfo

    info = ModelInfo.from_config(model.config)
    page = ContinuousBatchingConfig().page_size
    page_bytes = 2 * info.num_layers * info.num_kv_heads * info.head_dim * page * model.dtype.itemsize
    config = ContinuousBatchingConfig(num_blocks=max(1, pool_bytes // page_bytes), max_batch_tokens=step_tokens)
    generation = GenerationConfig(max_new_tokens=new, min_new_tokens=new, do_sample=False, eos_token_id=None,
                                  pad_token_id=model.config.pad_token_id or 0)  # fmt: skip
    start = time.perf_counter()
    with torch.inference_mode():
        results = model.generate_batch(inputs=prompts, generation_config=generation,
                                       continuous_batching_config=config, warmup=False)  # fmt: skip
    seconds = time.perf_counter() - start
    outputs = [list(results[key].generated_tokens) for key in sorted(results, key=lambda k: int(k.split("_")[-1]))]
    if len(outputs) != len(prompts) or any(len(out) != new for out in outputs):
        done = sum(len(out) == new for out in outputs)
        raise RuntimeError(f"transformers generate_batch finished {done} of {len(prompts)} requests (see its log above)")
    return {"system": "transformers generate_batch", "seconds": seconds, "tok_s": len(prompts) * new / seconds,
            "pool_bytes": config.num_blocks * page_bytes, "max_batch_tokens": step_tokens, "tokens": outputs}  # fmt: skip


# -- prefix caching -------------------------------------------------------------------------
def prefix(args) -> list[dict]:
    """TTFT of a 50-token question after a 2,000-token shared system prompt: cold cache vs warm."""
    from kvopt import load_model

    _, tokenizer = load_model()
    system = real_prompts(tokenizer, 1, 2000, 2000, seed=1)[0]
    questions = real_prompts(tokenizer, 2 * args.prefix_repeats, 50, 50, seed=2)
    rows = []
    for repeat in range(args.prefix_repeats):
        llm = engine(args.kv_memory)
        one = greedy(1)
        cold = llm.generate([system + questions[2 * repeat]], one, use_tqdm=False)[0]
        warm = llm.generate([system + questions[2 * repeat + 1]], one, use_tqdm=False)[0]
        rows.append({"step": "prefix", "repeat": repeat, "system_tokens": len(system), "question_tokens": 50,
                     "cold_ttft": cold.metrics.time_to_first_token, "warm_ttft": warm.metrics.time_to_first_token,
                     "warm_cached_tokens": warm.metrics.cached_tokens})  # fmt: skip
        print(rows[-1])
    return rows


# -- capacity -------------------------------------------------------------------------------
def capacity(args) -> list[dict]:
    """How many 4k-token sequences run at once in the pool (``--capacity-memory``), and the throughput they reach.

    Decode tok/s counts the steps in which every running sequence decoded one token and no prompt
    was computed; the end-to-end rate includes the prompts' prefills. ``--capacity-requests auto`` submits two
    more requests than the memory calculator says fit (at most ``--capacity-max-requests``): the count running
    at once is measured, not predicted.

    With ``--capacity-tier DIR``, each compressed request's prompt state comes from a disk tier (the engine's
    own path for a prompt seen before: a retried request, another replica, a prefill node): a warm-up pass
    computes each of ``--capacity-prompts`` distinct prompts once, alone, into the tier (resumable: what an
    earlier run stored is found again), then the measured pass submits them in turn up to the request count,
    each installing its own copy into its own blocks, with prefix caching off (lossless prompts compute every
    request: nothing is shared). A prompt computed in the pool needs its whole prompt's blocks while its pass
    runs (kvzip scores it whole); a restored one only what its methods kept.
    """
    rows = []
    specs = args.capacity_methods.split(";")
    counts = [None] * len(specs) if args.capacity_requests == "auto" else args.capacity_requests.split(",")
    tiers = (f"disk:{args.capacity_tier}:{args.capacity_tier_size}",) if args.capacity_tier else ()
    for spec, requests in zip(specs, counts, strict=True):
        llm = engine(args.capacity_memory, model=args.model, kv_method=spec, max_num_seqs=args.capacity_max_requests,
                     max_model_len=4096 + args.capacity_new, kv_tiers=tiers, enable_prefix_caching=not tiers)  # fmt: skip
        pool_bytes = llm.engine.runner.pool.nbytes()
        requests = int(requests) if requests else _fitting(llm, spec, 4096 + args.capacity_new, pool_bytes, args)
        restores = bool(tiers) and llm.engine.keeps_prompt_state(spec)
        distinct = min(requests, args.capacity_prompts) if restores else requests
        prompts = real_prompts(llm.tokenizer, distinct, 4096, 4096, seed=3)
        prefills = _warm_up(llm, prompts) if restores else []
        prompts = [prompts[index % distinct] for index in range(requests)]
        core, peak, decode_tokens, decode_seconds = llm.engine, 0, 0, 0.0
        hits = _tier_hits(core)
        for index, prompt in enumerate(prompts):
            core.add_request(str(index), prompt, greedy(args.capacity_new))
        start = time.perf_counter()
        while core.has_unfinished_requests():
            before = core.metrics()
            began = time.perf_counter()
            core.step()
            after = core.metrics()
            generated = after["generation_tokens_total"] - before["generation_tokens_total"]
            decoding_only = after["prompt_tokens_total"] == before["prompt_tokens_total"]
            if decoding_only and generated == before["num_requests_running"] and after["num_requests_running"] <= generated:
                decode_tokens += generated
                decode_seconds += time.perf_counter() - began
            peak = max(peak, after["num_requests_running"])
        seconds = time.perf_counter() - start
        metrics = core.metrics()
        restored = _tier_hits(core) - hits
        rows.append({"step": "capacity", "method": spec, "model": args.model or DEFAULT_MODEL, "pool_bytes": pool_bytes,
                     "sequence_tokens": 4096 + args.capacity_new, "concurrent": peak,
                     "requests": len(prompts), "tok_s": len(prompts) * args.capacity_new / seconds,
                     "decode_tok_s": decode_tokens / decode_seconds if decode_seconds else 0.0,
                     "preemptions": metrics["num_preemptions_total"], "conditions": args.conditions,
                     "distinct_prompts": distinct, "restored": restored,
                     "prefill_s": [round(s, 2) for s in prefills if s is not None]})  # fmt: skip
        print(rows[-1])
        llm.close()
    return rows


def _tier_hits(core) -> int:
    return sum(tier["hits"] for tier in core.metrics()["kv_tiers"].values())


def _warm_up(llm, prompts: list[list[int]]) -> list[float | None]:
    """Each prompt once, alone, into the tier: its prefill seconds, or None where an earlier run had stored it."""
    seconds = []
    for prompt in prompts:
        began = time.perf_counter()
        (output,) = llm.generate([prompt], greedy(1), use_tqdm=False)
        llm.engine.offload.chain.flush()  # stored before the next one: an interrupted warm-up loses nothing
        if output.error is not None:
            raise RuntimeError(output.error)
        seconds.append(None if output.metrics.cached_tokens else time.perf_counter() - began)
        print(f"warm-up: {len(seconds)}/{len(prompts)} {'restored' if seconds[-1] is None else f'{seconds[-1]:.1f} s'}")
    return seconds


def _fitting(llm, spec: str, tokens: int, pool_bytes: int, args) -> int:
    """Requests to submit: two more than the memory calculator says fit in ``pool_bytes``."""
    from kvopt.memory import estimate
    from kvopt.methods import parse
    from kvopt.models.info import ModelInfo

    info = ModelInfo.from_config(llm.engine.model.config)
    per_sequence = estimate(info, tokens, methods=parse(spec), dtype=llm.engine.dtype).total_bytes
    return min(args.capacity_max_requests, pool_bytes // per_sequence + 2)


# -- latency under load -------------------------------------------------------------------------
def latency(args) -> list[dict]:
    """TTFT and inter-token latency percentiles when requests arrive as a Poisson process."""
    rows = []
    for rate in (float(r) for r in args.rates.split(",")):
        llm = engine(args.kv_memory)
        prompts = real_prompts(llm.tokenizer, args.latency_requests, 100, 1000, seed=4)
        rng = random.Random(5)
        arrivals, clock = [], 0.0
        for _ in prompts:
            clock += rng.expovariate(rate)
            arrivals.append(clock)
        core, start, submitted = llm.engine, time.perf_counter(), 0
        while submitted < len(prompts) or core.has_unfinished_requests():
            now = time.perf_counter() - start
            while submitted < len(prompts) and arrivals[submitted] <= now:
                core.add_request(str(submitted), prompts[submitted], greedy(args.latency_new))
                submitted += 1
            if core.has_unfinished_requests():
                core.step()
            else:
                time.sleep(min(0.05, arrivals[submitted] - now))
        metrics = core.metrics()
        ttft, itl = metrics["time_to_first_token_seconds"], metrics["inter_token_latency_seconds"]
        rows.append({"step": "latency", "rate": rate, "requests": len(prompts), "new_tokens": args.latency_new,
                     "ttft_p50": ttft["p50"], "ttft_p99": ttft["p99"], "itl_p50": itl["p50"], "itl_p99": itl["p99"],
                     "seconds": time.perf_counter() - start})  # fmt: skip
        print(rows[-1])
    return rows


# -- speculative decoding -------------------------------------------------------------------------
SPECULATE = "prompt_lookup:k=4"
STORY_TOPICS = ("a lighthouse keeper who befriends a storm", "a robot learning to bake bread", "a lost letter",
                "two rival gardeners", "a city where it never stops raining", "an old clock that runs backwards",
                "a chess match on a train", "a cat who runs a bookshop")  # fmt: skip


def grounded_and_open_prompts(llm, count: int) -> dict[str, list[list[int]]]:
    """Chat prompts of two kinds: copying sentences out of a passage of local real text (input-grounded: what
    prompt lookup drafts from) and writing a story (open-ended: little to copy), ``count`` of each."""
    from kvopt.local_text import real_text

    text = real_text()[0]
    passages = []
    for index in range(count):  # each from a sentence's start, 2,000 characters apart
        start = text.find(". ", 2000 * index) + 2 if index else 0
        passages.append(text[start : text.find(" ", start + 1500)])
    ask = lambda content: llm.chat_prompt([{"role": "user", "content": content}])  # noqa: E731
    return {
        "extract": [ask(f"{passage}\n\nCopy the first three sentences of the text above exactly, word for word.")
                    for passage in passages],
        "chat": [ask(f"Write a short story about {topic}.") for topic in STORY_TOPICS[:count]],
    }  # fmt: skip


def _decode_run(llm, prompts: list[list[int]], new_tokens: int) -> dict:
    """Greedy outputs of ``prompts`` submitted together; decode tok/s from the first first token to the last finish."""
    before = llm.metrics()
    outputs = llm.generate(prompts, greedy(new_tokens), use_tqdm=False)
    after = llm.metrics()
    first = min(out.metrics.first_token_time for out in outputs)
    last = max(out.metrics.finished_time for out in outputs)
    decoded = sum(len(out.outputs[0].token_ids) - 1 for out in outputs)
    counted = {key: after[key] - before[key] for key in ("spec_decode_num_draft_tokens_total",
                                                           "spec_decode_num_accepted_tokens_total")}  # fmt: skip
    return {"tokens": [out.outputs[0].token_ids for out in outputs], "decode_tok_s": decoded / (last - first),
            "drafted": counted["spec_decode_num_draft_tokens_total"],
            "accepted": counted["spec_decode_num_accepted_tokens_total"]}  # fmt: skip


def speculative(args) -> list[dict]:
    """The engine's decode tok/s with and without prompt-lookup drafts, one request alone and several together,
    on an input-grounded task and an open-ended one; the two engines share the model and alternate (repeats
    interleaved, medians kept), so the ratio is fair on a busy machine."""
    from kvopt import LLM, load_model

    model, tokenizer = load_model()
    batches = [int(size) for size in args.speculative_batches.split(",")]
    # Drafting at every batch size measured (the CPU's default stops at 2 running sequences: these rows are why).
    engines = {spec: LLM(model, tokenizer=tokenizer, kv_memory=args.kv_memory, speculate=spec,
                         speculate_max_batch=max(batches)) for spec in (None, SPECULATE)}  # fmt: skip
    prompts = grounded_and_open_prompts(engines[None], max(batches))
    rows = []
    for batch in batches:
        for task, texts in prompts.items():
            runs = [{spec: _decode_run(llm, texts[:batch], args.speculative_new) for spec, llm in engines.items()}
                    for _ in range(args.speculative_repeats)]  # fmt: skip
            plain = statistics.median(run[None]["decode_tok_s"] for run in runs)
            for spec in engines:
                last = runs[-1][spec]
                rate = statistics.median(run[spec]["decode_tok_s"] for run in runs)
                rows.append({
                    "step": "speculative", "batch": batch, "task": task, "decoding": spec or "plain",
                    "new_tokens": args.speculative_new, "repeats": args.speculative_repeats,
                    "prompt_tokens": sum(len(ids) for ids in texts[:batch]) // batch, "decode_tok_s": rate,
                    "speedup": rate / plain, "drafted": last["drafted"], "accepted": last["accepted"],
                    "same_tokens_as_plain": last["tokens"] == runs[-1][None]["tokens"],
                    "threads": torch.get_num_threads(), "conditions": args.conditions,
                })  # fmt: skip
                print(rows[-1])
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--kv-memory", default="2GB", help="kvopt's pool (generate_batch gets as many bytes)")
    parser.add_argument("--requests", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--sequential-requests", type=int, default=16,
                        help="HF one-at-a-time runs this many of the requests (its rate does not depend on the count)")
    parser.add_argument("--generate-batch", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--prefix-repeats", type=int, default=3)
    parser.add_argument("--model", default=None, help="for the capacity step: a model name (default: the default model)")
    parser.add_argument("--capacity-memory", default="1GB")
    parser.add_argument("--capacity-methods", default=";".join(CAPACITY_METHODS))
    parser.add_argument("--capacity-requests", default="auto", help="requests per capacity method, or auto")
    parser.add_argument("--capacity-max-requests", type=int, default=48)
    parser.add_argument("--capacity-new", type=int, default=64)
    parser.add_argument("--capacity-tier", default=None,
                        help="a folder: compressed prompts' states computed once each into a disk tier there and restored")
    parser.add_argument("--capacity-tier-size", default="20GB")
    parser.add_argument("--capacity-prompts", type=int, default=16,
                        help="with --capacity-tier: distinct prompts, submitted in turn up to the request count")
    parser.add_argument("--rates", default="0.2,0.4,0.8")
    parser.add_argument("--latency-requests", type=int, default=24)
    parser.add_argument("--latency-new", type=int, default=64)
    parser.add_argument("--speculative-batches", default="1,8", help="requests decoded together, per run")
    parser.add_argument("--speculative-new", type=int, default=96)
    parser.add_argument("--speculative-repeats", type=int, default=3)
    parser.add_argument("--conditions", default="", help="what else ran on the machine (stated with the rows)")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    steps = args.steps.split(",")
    unknown = set(steps) - set(STEPS)
    if unknown:
        parser.error(f"unknown steps {sorted(unknown)}; choose from {','.join(STEPS)}")
    for step in steps:
        started = time.perf_counter()
        rows = globals()[step](args)
        save(step, rows, time.perf_counter() - started)


def save(step: str, rows: list[dict], seconds: float) -> None:
    """Replace ``step``'s rows in the committed JSONL (other steps' rows stay, and so do a capacity step's
    rows of methods this run did not measure)."""
    ROWS.parent.mkdir(parents=True, exist_ok=True)
    kept = [json.loads(line) for line in ROWS.read_text().splitlines()] if ROWS.exists() else []
    measured = {_measured(row) for row in rows}
    kept = [row for row in kept if (row["step"] != step or _measured(row) not in measured) and row.get("timed") != step]
    import transformers

    stamp = {"step": "timing", "timed": step, "seconds": seconds, "date": time.strftime("%Y-%m-%d"),
             "torch": torch.__version__, "transformers": transformers.__version__}  # fmt: skip
    ROWS.write_text("".join(json.dumps(row) + "\n" for row in [*kept, *rows, stamp]))


def _measured(row: dict) -> tuple:
    """What a row measured: a new run's row replaces the old one of the same method, model and pool."""
    return row.get("method"), row.get("model", DEFAULT_MODEL), row.get("pool_bytes")


if __name__ == "__main__":
    main()


# -- the BENCHMARKS.md section ------------------------------------------------------------------
def section(path: Path = ROWS) -> list[str]:
    """Markdown for the engine's rows (empty when none were measured)."""
    if not path.exists():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = {row["timed"]: row for row in rows if row["step"] == "timing"}
    minutes = ", ".join(f"{step} {row['seconds'] / 60:.1f} min" + (f" with transformers {row['transformers']}"
                        if "transformers" in row else "") for step, row in timed.items())  # fmt: skip
    dates = row_dates(path, lambda row: row["step"] == "timing")  # the other rows carry no date
    lines = ["", "## Serving engine: `kvopt.LLM` next to HF", "",
             opening("python benchmarks/serving.py", dates, path, minutes), "",
             "Default model (fp32), 2 threads, greedy, every system in one process on the same prompts of local real "
             "text.", ""]  # fmt: skip
    lines += _throughput_lines([r for r in rows if r["step"] == "throughput"])
    lines += _prefix_lines([r for r in rows if r["step"] == "prefix"])
    lines += _capacity_lines([r for r in rows if r["step"] == "capacity"])
    lines += _latency_lines([r for r in rows if r["step"] == "latency"])
    lines += _speculative_lines([r for r in rows if r["step"] == "speculative"])
    return lines


def _throughput_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    ours = next(r for r in rows if r["system"] == "kvopt.LLM")
    pools = [r["pool_bytes"] for r in rows if "pool_bytes" in r]
    lines = [
        f"### Throughput: {ours['requests']} requests of 100-1,000 tokens ({ours['prompt_tokens']:,} prompt tokens), "
        f"{ours['new_tokens']} new tokens each",
        "",
        "Output tokens per second over the whole run (prefill included). `HF generate, one request at a time` runs "
        "a subset of the requests (its rate does not depend on how many); `same outputs` counts requests whose "
        "tokens equal kvopt's. HF's runs force every token with `min_new_tokens`, which masks EOS, while kvopt's "
        "`ignore_eos` (vLLM's) keeps EOS a candidate and generates on after it: a request whose greedy choice is EOS "
        "midway continues differently from there (`differ at EOS`, when recorded, counts those). transformers' "
        "`generate_batch` runs without an EOS and gets a pool of the same bytes as kvopt's"
        + (f" ({max(pools) / 1e9:.2f} GB of fp32 KV: room for all the requests at once)" if pools else "")
        + "".join(f" and kvopt's step budget ({r['max_batch_tokens']:,} tokens)" for r in rows if "max_batch_tokens" in r)
        + ".",
        "",
        "| system | requests | wall time | output tok/s | kvopt.LLM vs this | same outputs | differ at EOS |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        ratio = "–" if row is ours else f"{ours['tok_s'] / row['tok_s']:.2f}x"
        same = "–" if "same_as_kvopt" not in row else f"{row['same_as_kvopt']}/{row['requests']}"
        lines.append(f"| {row['system']} | {row['requests']} | {row['seconds']:.0f} s | {row['tok_s']:.1f} | {ratio} "
                     f"| {same} | {row.get('differ_at_eos', '–')} |")  # fmt: skip
    if ours.get("waste_steady") is not None:
        lines += ["", f"Memory waste at steady state (token slots allocated but holding no token yet, median over "
                      f"the steps with the pool at least half full or half the requests running): "
                      f"{100 * ours['waste_steady']:.2f}%. Preemptions: {ours['preemptions']}."]  # fmt: skip
    return lines + [""]


def _prefix_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    cold = statistics.median(r["cold_ttft"] for r in rows)
    warm = statistics.median(r["warm_ttft"] for r in rows)
    return [
        f"### Prefix caching: a {rows[0]['system_tokens']:,}-token shared system prompt + a "
        f"{rows[0]['question_tokens']}-token question",
        "",
        f"Time to first token, median of {len(rows)} fresh engines: cold (empty cache) {cold:.2f} s, warm (a second "
        f"question after the first) {warm:.3f} s: **{cold / warm:.1f}x faster**; the warm request found "
        f"{rows[0]['warm_cached_tokens']:,} of its prompt tokens cached.",
        "",
    ]


def _capacity_lines(rows: list[dict]) -> list[str]:
    """One table per (model, pool) measured."""
    lines = []
    for key in sorted({(row.get("model", DEFAULT_MODEL), row["pool_bytes"]) for row in rows}):
        lines += _capacity_table([row for row in rows if (row.get("model", DEFAULT_MODEL), row["pool_bytes"]) == key])
    if lines:
        lines += ["Compressed prompts are computed in one pass and never stored whole: each layer's keys go from the "
                  "forward pass to the method, and only what it keeps is written to blocks (evicted tokens compacted, "
                  "kivi groups bit-packed, 3 groups of 32 tokens per 16-slot fp32 block). Specs the block layouts "
                  "cannot hold keep their own cache, packed into their blocks between steps; their prompt pass "
                  "holds the whole prompt (kvzip scores it whole before it evicts), so it needs a full sequence's "
                  "blocks while it runs: a pool of ~1.3 full 4k sequences admits one such prompt at a time "
                  "(which caps kvzip at 2 running there), a larger pool one more per quarter sequence it frees. "
                  "A count marked ≥ is every request submitted (`--capacity-max-requests`): the pool held them "
                  "all. Requests marked *restored* (`--capacity-tier`) installed their prompt's compressed state "
                  "from a disk tier, as a retried request or another replica does: a warm-up pass computed each "
                  "of that many distinct 4k prompts once, alone, and the measured pass submitted them in turn "
                  "(each request holds its own copy; prefix caching off), so no prompt pass ran in the pool and "
                  "their end-to-end rate excludes prefill (the warm-up's prefill seconds are in the rows). "
                  "End-to-end rates include the 4k-token prefills, which dominate them.", ""]  # fmt: skip
    return lines


def _capacity_table(rows: list[dict]) -> list[str]:
    order = {method: index for index, method in enumerate(CAPACITY_METHODS)}
    rows = sorted(rows, key=lambda row: order.get(row["method"], len(order)))
    full = next((r for r in rows if r["method"] == "full"), None)
    model = rows[0].get("model", DEFAULT_MODEL)
    lines = [
        f"### Capacity: concurrent {rows[0]['sequence_tokens']:,}-token sequences in a "
        f"{rows[0]['pool_bytes'] / 1e6:.0f} MB pool ({model})",
        "",
        "| KV method | requests | most sequences running at once | vs full | decode tok/s | vs full | "
        "end-to-end output tok/s | preemptions | kept of `full`'s answers (accuracy grid, query-agnostic) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    kept = _kept_by_spec(model)
    for row in rows:
        # Every submitted request running at once: the pool held them all, so the count is a floor.
        floor = "≥ " if row["concurrent"] == row["requests"] and row is not full else ""
        ratio = f"{floor}{row['concurrent'] / full['concurrent']:.1f}x" if full else "–"
        speed = f"{row['decode_tok_s'] / full['decode_tok_s']:.1f}x" if full and full.get("decode_tok_s") else "–"
        requests = f"{row['requests']} ({row['distinct_prompts']} prompts, restored)" if row.get("restored") else row["requests"]
        lines.append(f"| `{row['method']}` | {requests} | {floor}{row['concurrent']} | {ratio} | "
                     f"{row.get('decode_tok_s', 0):.1f} | {speed} | {row['tok_s']:.2f} | {row['preemptions']} | "
                     f"{kept.get(_canonical(row['method']), '–')} |")  # fmt: skip
    return lines + conditions_line(rows) + [""]


#: Accuracy rows per model: the grid's, the 2-bit grid's and the capacity recipes' own (outputs of the engine equal
#: generate's with the same cache, so the grid's answers are the engine's). The last come from
#: ``kvopt eval --task passkey,niah,niah_multivalue --lengths 4096 --depths 8 --samples 3 --methods "full,<recipes>"
#: --out benchmarks/results/capacity`` (resumable).
ACCURACY_ROWS = {
    DEFAULT_MODEL: ("eval.jsonl", "twobit/eval.jsonl", "capacity/eval.jsonl"),
    "qwen2.5-coder-0.5b": ("qwen2.5-coder-0.5b/eval.jsonl",),
}


def _canonical(spec: str) -> str:
    from kvopt.methods import canonical_spec

    return canonical_spec(spec)


def _kept_by_spec(model: str) -> dict[str, str]:
    """``kept% [interval] of n`` per canonical spec, query-agnostic, against ``full`` on the same prompts."""
    from kvopt.eval.report import retention
    from kvopt.eval.rows import load_rows

    rows = [row for name in ACCURACY_ROWS.get(model, ()) for row in load_rows(ROWS.parent / name)
            if row.get("mode") == "query_agnostic" and row.get("family", "kvopt") == "kvopt"]  # fmt: skip
    by_spec: dict[str, list[dict]] = {}
    for row in rows:
        try:
            by_spec.setdefault(_canonical(row["method"]), []).append(row)
        except ValueError:
            continue  # a peer's spec (kvpress, quanto), not ours
    reference = by_spec.get("full", [])
    found = {spec: retention(spec_rows, reference) for spec, spec_rows in by_spec.items() if spec != "full"}
    return {spec: result.cell() for spec, result in found.items() if result is not None}


def _latency_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    lines = [
        f"### Latency under Poisson arrivals ({rows[0]['requests']} requests of 100-1,000 tokens, "
        f"{rows[0]['new_tokens']} new tokens each)",
        "",
        "| arrival rate | TTFT p50 | TTFT p99 | inter-token p50 | inter-token p99 |",
        "|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(f"| {row['rate']} req/s | {row['ttft_p50']:.2f} s | {row['ttft_p99']:.2f} s | "
                     f"{1000 * row['itl_p50']:.0f} ms | {1000 * row['itl_p99']:.0f} ms |")  # fmt: skip
    return lines + [""]


def _speculative_lines(rows: list[dict]) -> list[str]:
    if not rows:
        return []
    first = rows[0]
    differ = [f"{r['task']} x{r['batch']}" for r in rows if not r["same_tokens_as_plain"]]
    conditions = f", {first['conditions']}" if first.get("conditions") else ""
    lines = [
        f"### Speculative decoding in the engine (`speculate=\"{SPECULATE}\"`)",
        "",
        f"`python benchmarks/serving.py --steps speculative`: greedy chat prompts submitted together, "
        f"{first['new_tokens']} new tokens each, decode tok/s from the first request's first token to the last "
        f"request's end, median of {first['repeats']} runs alternating between an engine with drafts and one without "
        f"(same model, {first['threads']} torch thread(s){conditions}). "
        "`extract` copies three sentences out of a ~1,500-character "
        "passage of local real text (input-grounded); `chat` writes a short story (open-ended). Drafts are verified "
        "in the step that computes the newest token, so a row emits its accepted drafts plus one token per step; "
        "each sequence's draft length follows its acceptance and a wholly rejected draft pauses its drafting for "
        "1, 2, 4, ... steps. Here every batch size drafts (`speculate_max_batch` raised); on a CPU the engine's "
        "default drafts only while at most 2 sequences run, because of these rows. "
        + (f"Outputs differ from plain decoding in: {', '.join(differ)}." if differ
           else "Every run's tokens equal plain decoding's (checked)."),
        "",
        "| requests together | task | decoding | decode tok/s | speed-up | drafts accepted |",
        "|---:|---|---|---:|---:|---:|",
    ]  # fmt: skip
    for row in rows:
        share = f"{row['accepted']}/{row['drafted']} ({row['accepted'] / row['drafted']:.0%})" if row["drafted"] else ""
        lines.append(f"| {row['batch']} | {row['task']} | {row['decoding']} | {row['decode_tok_s']:.1f} | "
                     f"{row['speedup']:.2f}x | {share} |")  # fmt: skip
    return lines + [""]
