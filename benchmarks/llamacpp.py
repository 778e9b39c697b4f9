"""llama.cpp as a peer on the default model: one request at a time, and many at once through its batched API.

    python benchmarks/llamacpp.py                                  # both steps, every setting (hours on one thread)
    python benchmarks/llamacpp.py --steps batched --parallel 16 --kvopt fp32,auto   # kvopt.LLM beside it
    python benchmarks/llamacpp.py --lengths 512 --requests 2 --new-tokens 8 --parallel 2 --repeats 1 \\
        --results /tmp/llamacpp                                    # a smoke run (a minute)

What a CPU user runs: llama-cpp-python built from its sdist for this CPU (``pip install 'kvopt[llamacpp]'`` with
``CMAKE_ARGS="-DGGML_NATIVE=ON ..."``, see pyproject.toml), driven through its C API as ``llama-server`` drives it.
Weights: the default model's own GGUF (Q4_1, the file kvopt converts) and an F16 re-type of it (dequantized once
with the ``gguf`` package, next to kvopt's converted models). KV cache: f16 and q8_0 (q8_0 needs flash attention).

- ``single``: one request alone, prefill and decode tok/s at 512 / 2k / 8k-token prompts of local real text
  (median of ``--repeats``, run system after system in each round; decode: ``--new-tokens`` steps after the prompt);
  ``--kvopt`` (and each ``--kvopt-method``) and ``--hf`` time kvopt.LLM (per token) and transformers' ``generate``
  (prefill from a one-token request, decode from the rest) on the same prompts.
- ``batched``: the serving workload of ``benchmarks/serving.py`` (its prompts: 64 windows of 100-1,000 tokens of
  local real text as token ids, 128 new tokens, greedy, EOS ignored) through llama-server's continuous batching: one
  ``llama_batch`` per step carrying every running sequence's id, ``--parallel`` slots, each decoding sequence's
  token first, then prompt chunks of waiting slots up to ``n_batch`` tokens; a finished sequence's KV is dropped and
  its slot takes the next request. ``--kvopt fp32,auto`` runs kvopt.LLM on the same prompts in the same process
  (rows side by side; ``same_as_kvopt`` counts requests whose tokens equal the first kvopt dtype's), and each
  ``--kvopt-method DTYPE=SPEC`` once more with that compressed ``kv_method`` (e.g. ``auto=kvzip:ratio=0.75+kivi:bits=4``
  at 4k-token prompts, where a compressed sequence's smaller KV lets more of them run at once). ``--hf fp32,auto``
  adds plain transformers in those dtypes: static batches of 8, and ``--hf-sequential`` requests one at a time.
- ``perplexity``: each weight format's perplexity on the same ``--ppl-texts`` windows of ``--ppl-tokens`` tokens of
  local real text (every token after a window's first predicted from all before it, in one forward): kvopt's
  ``--kvopt`` settings (the model ``kvopt.load_model`` loads in each, through Hugging Face's forward) and llama.cpp's
  ``--weights`` GGUFs, so int8 weights stand beside Q8_0 and bf16 beside F16, each against its own system's
  full-precision run.

Rows: ``benchmarks/results/llamacpp/rows.jsonl`` (``--results``); a run's rows replace those of the same setting.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import serving
import torch
from sections import conditions_line, opening, row_dates

ROOT = Path(__file__).resolve().parent.parent
ROWS = ROOT / "benchmarks" / "results" / "llamacpp" / "rows.jsonl"
STEPS = ("single", "batched", "perplexity")
#: The perplexity step's text windows (local real text, as serving.py draws them).
PERPLEXITY_SEED = 7
#: The batched workload's prompts: benchmarks/serving.py's throughput step.
SERVING_SEED, SERVING_LOW, SERVING_HIGH = 0, 100, 1000
#: ggml's error level: llama.cpp's info and warnings (one line per tensor at load) are dropped.
GGML_LOG_LEVEL_ERROR = 4
#: Fields that name what a row measured (a new row replaces an old one with the same values).
SETTING = ("step", "system", "weights", "kv", "length", "parallel", "requests", "prompt_range", "new_tokens", "round")


def bindings():
    """The llama-cpp-python bindings, or one line saying how to install them."""
    try:
        import llama_cpp
    except ImportError:
        raise SystemExit(
            "llama-cpp-python is not installed; build it for this CPU: CMAKE_ARGS=\"-DGGML_NATIVE=ON "
            "-DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF\" pip install --no-binary "
            "llama-cpp-python 'kvopt[llamacpp]'"
        ) from None
    return llama_cpp


# -- the weights ------------------------------------------------------------------------------
def weight_files(choice: str) -> dict[str, Path]:
    """The comma-separated ``--weights``: ``Q4_1``, the default model's GGUF; ``F16`` and ``Q8_0``, its re-types
    (written once); empty, none (no llama.cpp run)."""
    from kvopt.models.loading import default_gguf_path

    names = [name for name in choice.split(",") if name]
    original = default_gguf_path()
    files = {"Q4_1": original, "F16": lambda: retyped_copy(original, "F16"), "Q8_0": lambda: retyped_copy(original, "Q8_0")}
    unknown = set(names) - set(files)
    if unknown:
        raise SystemExit(f"unknown --weights {sorted(unknown)}; choose from {','.join(files)}")
    return {name: files[name]() if callable(files[name]) else files[name] for name in names}


def retyped_copy(source: Path, kind: str) -> Path:
    """``source`` with every quantized tensor dequantized and stored as ``kind`` (``F16``, or ``Q8_0``: quantized
    again by the ``gguf`` package, llama-quantize's format; F32 tensors stay), beside kvopt's converted models;
    metadata copied, the file type set. Written under the conversion lock, renamed into place whole."""
    import gguf

    from kvopt.models.loading import cache_dir, conversion_lock
    from kvopt.paths import writable_folder

    file_type = {"F16": gguf.LlamaFileType.MOSTLY_F16, "Q8_0": gguf.LlamaFileType.MOSTLY_Q8_0}[kind]
    folder = writable_folder(cache_dir() / "gguf", "KVOPT_CACHE")
    target = folder / f"{source.stem.rsplit('.', 1)[0]}.{kind}.gguf"
    if target.is_file():
        return target
    with conversion_lock(folder):
        if target.is_file():
            return target
        reader = gguf.GGUFReader(source)
        staging = target.with_suffix(".partial")
        writer = gguf.GGUFWriter(staging, reader.fields[gguf.Keys.General.ARCHITECTURE].contents())
        for entry in reader.fields.values():
            if entry.name == gguf.Keys.General.ARCHITECTURE or entry.name.startswith("GGUF."):
                continue  # written by GGUFWriter itself
            if entry.name == gguf.Keys.General.FILE_TYPE:
                writer.add_file_type(file_type)
                continue
            kind = entry.types[0]
            writer.add_key_value(entry.name, entry.contents(), kind,
                                 sub_type=entry.types[-1] if kind == gguf.GGUFValueType.ARRAY else None)  # fmt: skip
        for tensor in reader.tensors:
            values = gguf.quants.dequantize(tensor.data, tensor.tensor_type)
            if tensor.tensor_type == gguf.GGMLQuantizationType.F32:
                writer.add_tensor(tensor.name, values)
            elif kind == "F16":
                writer.add_tensor(tensor.name, values.astype(np.float16))
            else:
                quantized = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q8_0)
                writer.add_tensor(tensor.name, quantized, raw_shape=quantized.shape,
                                  raw_dtype=gguf.GGMLQuantizationType.Q8_0)  # fmt: skip
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
        writer.close()
        staging.rename(target)
    return target


# -- llama.cpp through its C API ---------------------------------------------------------------
@dataclass
class Options:
    """Context settings shared by every run (llama-server's defaults for the batch sizes)."""

    threads: int = 1
    n_batch: int = 2048
    n_ubatch: int = 512
    flash_attn: str = "auto"


class Context:
    """One llama.cpp context over loaded weights: a unified KV cache of ``n_ctx`` cells for ``n_seq`` sequences,
    one ``llama_batch`` of up to ``n_batch`` tokens reused every step, greedy choices read from its logits."""

    def __init__(self, lib, model, n_ctx: int, n_seq: int, kv: str, options: Options) -> None:
        params = lib.llama_context_default_params()
        params.n_ctx, params.n_seq_max, params.kv_unified = n_ctx, n_seq, True
        params.n_batch, params.n_ubatch = options.n_batch, options.n_ubatch
        params.n_threads = params.n_threads_batch = options.threads
        params.type_k = params.type_v = {"f16": lib.GGML_TYPE_F16, "q8_0": lib.GGML_TYPE_Q8_0}[kv]
        params.flash_attn_type = flash_attention(lib, options.flash_attn, kv)
        params.no_perf = True
        self.lib, self.n_batch = lib, options.n_batch
        self.ctx = lib.llama_init_from_model(model, params)
        if not self.ctx:
            raise RuntimeError(f"llama.cpp could not create a context of {n_ctx} tokens with {kv} KV "
                               "(see its error above)")  # fmt: skip
        self.batch = lib.llama_batch_init(options.n_batch, 0, 1)
        self.n_vocab = lib.llama_vocab_n_tokens(lib.llama_model_get_vocab(model))
        view = lambda pointer: np.ctypeslib.as_array(pointer, shape=(options.n_batch,))  # noqa: E731
        self.tokens, self.positions = view(self.batch.token), view(self.batch.pos)
        self.seq_counts, self.wants_logits = view(self.batch.n_seq_id), view(self.batch.logits)
        self.seq_slots = [self.batch.seq_id[index] for index in range(options.n_batch)]

    def decode(self, tokens: list[int], positions: list[int], seqs: list[int], logits: list[bool]) -> None:
        """Compute one batch: token ``i`` at ``positions[i]`` of sequence ``seqs[i]``; logits kept where asked."""
        count = len(tokens)
        self.tokens[:count], self.positions[:count], self.wants_logits[:count] = tokens, positions, logits
        self.seq_counts[:count] = 1
        for slot, seq in zip(self.seq_slots, seqs):
            slot[0] = seq
        self.batch.n_tokens = count
        code = self.lib.llama_decode(self.ctx, self.batch)
        if code != 0:
            raise RuntimeError(f"llama_decode returned {code} for a batch of {count} tokens (1: no KV cell left)")

    def logits(self, index: int) -> np.ndarray:
        """The logits at batch entry ``index`` (which asked for them): a view of llama.cpp's buffer."""
        return np.ctypeslib.as_array(self.lib.llama_get_logits_ith(self.ctx, index), shape=(self.n_vocab,))

    def argmax(self, index: int) -> int:
        """The greedy choice at batch entry ``index`` (which asked for logits)."""
        return int(self.logits(index).argmax())

    def forget(self, seq: int) -> None:
        """Drop every KV cell of ``seq`` (a slot handed to the next request)."""
        self.lib.llama_memory_seq_rm(self.lib.llama_get_memory(self.ctx), seq, -1, -1)

    def close(self) -> None:
        self.lib.llama_batch_free(self.batch)
        self.lib.llama_free(self.ctx)


def flash_attention(lib, choice: str, kv: str) -> int:
    """llama.cpp's flash-attention setting: ``auto`` lets it decide (llama-server's default) but for a quantized V
    cache, which runs only with flash attention."""
    if choice == "off" and kv != "f16":
        raise SystemExit(f"a {kv} KV cache needs flash attention; drop --flash-attn off or use --kv f16")
    if choice == "on" or kv != "f16":
        return lib.LLAMA_FLASH_ATTN_TYPE_ENABLED
    return lib.LLAMA_FLASH_ATTN_TYPE_AUTO if choice == "auto" else lib.LLAMA_FLASH_ATTN_TYPE_DISABLED


_LOGGER = None  # the ctypes callback must outlive every llama.cpp call


def load_weights(lib, path: Path):
    """llama.cpp's model on the CPU (mmapped, as llama-server loads it); only its errors are printed."""
    global _LOGGER
    if _LOGGER is None:
        lib.llama_backend_init()
        _LOGGER = lib.llama_log_callback(
            lambda level, text, _: print(text.decode(errors="replace"), end="") if level == GGML_LOG_LEVEL_ERROR else None
        )
        lib.llama_log_set(_LOGGER, None)
    params = lib.llama_model_default_params()
    params.n_gpu_layers = 0
    model = lib.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path} (see its error above)")
    return model


# -- single request ----------------------------------------------------------------------------
def prefill(context: Context, prompt: list[int]) -> int:
    """Compute ``prompt`` as sequence 0 in chunks of ``n_batch``; the greedy next token after it."""
    for start in range(0, len(prompt), context.n_batch):
        chunk = prompt[start : start + context.n_batch]
        last = start + len(chunk) == len(prompt)
        context.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk),
                       [False] * (len(chunk) - 1) + [last])  # fmt: skip
    return context.argmax(len(chunk) - 1)


@dataclass
class SingleRunner:
    """One system on the single prompts: ``time(prompt)`` -> (prefill seconds, decode seconds) of one request, and
    its row's fields. ``decode_steps``: the decode steps that time covers."""

    fields: dict
    time: Callable[[list[int]], tuple[float, float]]
    decode_steps: int
    #: Called once a length is done (llama.cpp frees the context it made for it).
    done: Callable[[], None] = lambda: None


def single(args, lib, tokenizer) -> list[dict]:
    """Every system on each length's prompt, the repeats interleaved (system after system, round after round): this
    CPU's speed drifts over minutes by more than the differences measured, and interleaving puts every system under
    the same drift."""
    runs = [(dtype, "full") for dtype in filter(None, args.kvopt.split(","))]
    runs += [tuple(entry.split("=", 1)) for entry in args.kvopt_method]
    makers = [kvopt_single(args, dtype, spec) for dtype, spec in runs]
    makers += [hf_single(args, dtype) for dtype in filter(None, args.hf.split(","))]
    models = {name: load_weights(lib, path) for name, path in weight_files(args.weights).items()}
    makers += [llamacpp_single(args, lib, model, name, kv) for name, model in models.items() for kv in args.kv.split(",")]
    rows = []
    for length in _ints(args.lengths):
        (prompt,) = serving.real_prompts(tokenizer, 1, length, length, seed=length)
        runners = [make(length) for make in makers]
        times: list[list[tuple[float, float]]] = [[] for _ in runners]
        for _ in range(args.repeats):
            for runner, timed in zip(runners, times):
                timed.append(runner.time(prompt))
        for runner, timed in zip(runners, times):
            runner.done()
            rows.append(runner.fields | {"length": length, "repeats": args.repeats,
                                         "prefill_tok_s": length / statistics.median(t[0] for t in timed),
                                         "decode_tok_s": runner.decode_steps / statistics.median(t[1] for t in timed),
                                         "interleaved": True})  # fmt: skip
            print(json.dumps(rows[-1]))
    for model in models.values():
        lib.llama_model_free(model)
    return rows


def llamacpp_single(args, lib, model, name: str, kv: str) -> Callable[[int], SingleRunner]:
    """llama.cpp with ``name`` weights and ``kv`` cache: a context per length; prefill, then each decode call, timed."""

    def make(length: int) -> SingleRunner:
        context = Context(lib, model, length + args.new_tokens, 1, kv, args.options)

        def timed(prompt: list[int]) -> tuple[float, float]:
            context.forget(0)
            start = time.perf_counter()
            token = prefill(context, prompt)
            prefilled = time.perf_counter()
            for step in range(args.new_tokens):
                context.decode([token], [length + step], [0], [True])
                token = context.argmax(0)
            return prefilled - start, time.perf_counter() - prefilled

        return SingleRunner(_row(args, "single", name, kv), timed, args.new_tokens, context.close)

    return make


def kvopt_single(args, dtype: str, spec: str) -> Callable[[int], SingleRunner]:
    """kvopt.LLM with ``kv_method=spec`` (prefix caching off, so each request computes its prompt), timed per token:
    each request's first-token and finish times."""
    from kvopt.engine import LLM

    dtype, weights = kvopt_setting(dtype)
    llm = LLM(kv_memory=args.kv_memory, max_num_seqs=1, dtype=dtype, weights=weights, enable_prefix_caching=False,
              kv_method=spec)  # fmt: skip
    system = f"kvopt.LLM {dtype}" + (f" {weights}" if weights else "") + ("" if spec == "full" else f" {spec}")
    dtype_name = str(llm.engine.dtype).removeprefix("torch.")
    fields = {"step": "single", "system": system, "weights": weights or dtype_name,
              "kv": dtype_name if spec == "full" else spec,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "timed": "per token",
              "conditions": args.conditions}  # fmt: skip

    def timed(prompt: list[int]) -> tuple[float, float]:
        (output,) = llm.generate([prompt], serving.greedy(args.new_tokens), use_tqdm=False)
        if output.error:  # a failed request returns at once: its time would read as a fast run
            raise SystemExit(f"{system}, {len(prompt)}-token prompt: {output.error}")
        metrics = output.metrics
        return metrics.time_to_first_token, metrics.finished_time - metrics.first_token_time

    return lambda length: SingleRunner(fields, timed, args.new_tokens - 1)


def kvopt_setting(entry: str) -> tuple[str, str | None]:
    """A ``--kvopt`` entry: ``DTYPE`` or ``DTYPE/WEIGHTS`` (``auto/int8``: int8 weights computing in ``auto``)."""
    dtype, _, weights = entry.partition("/")
    return dtype, weights or None


def hf_single(args, dtype: str) -> Callable[[int], SingleRunner]:
    """Plain transformers (:func:`hf_model`): ``generate`` on one request. It reports no token times, so prefill is a
    one-token request's time and decode the time a ``--new-tokens`` request takes beyond it (at 8k tokens the
    prompt's run-to-run spread is a large part of that difference)."""
    model = hf_model(dtype)
    pad = _pad_token(model)
    dtype_name = str(model.dtype).removeprefix("torch.")
    fields = {"step": "single", "system": f"HF generate ({dtype})", "weights": dtype_name, "kv": dtype_name,
              "new_tokens": args.new_tokens, "threads": torch.get_num_threads(), "conditions": args.conditions}

    def timed(prompt: list[int]) -> tuple[float, float]:
        seconds = []
        for tokens in (1, args.new_tokens):
            start = time.perf_counter()
            serving.hf_one_at_a_time(model, [prompt], tokens, pad)
            seconds.append(time.perf_counter() - start)
        return seconds[0], seconds[1] - seconds[0]

    return lambda length: SingleRunner(fields, timed, args.new_tokens - 1)


# -- many requests: llama-server's continuous batching ----------------------------------------
@dataclass
class Slot:
    """A running request: its prompt tokens computed so far and its output."""

    request: int
    computed: int = 0
    output: list[int] = field(default_factory=list)


def continuous_batching(context: Context, prompts: list[list[int]], new_tokens: int, parallel: int) -> list[list[int]]:
    """Greedy ``new_tokens`` for every prompt, ``parallel`` sequences at a time, one ``llama_decode`` per step
    (llama-server's ``update_slots``: decoding slots' tokens first, then prompt chunks up to ``n_batch``)."""
    waiting, free, running = deque(range(len(prompts))), list(range(parallel - 1, -1, -1)), {}
    outputs: list[list[int]] = [[] for _ in prompts]
    while waiting or running:
        while waiting and free:
            running[free.pop()] = Slot(waiting.popleft())
        tokens, positions, seqs, logits, samples = [], [], [], [], []
        for seq, slot in running.items():
            prompt = prompts[slot.request]
            if slot.computed == len(prompt):
                samples.append((len(tokens), seq))
                tokens.append(slot.output[-1])
                positions.append(len(prompt) + len(slot.output) - 1)
                seqs.append(seq)
                logits.append(True)
        for seq, slot in running.items():
            prompt, room = prompts[slot.request], context.n_batch - len(tokens)
            if slot.computed == len(prompt) or room == 0:
                continue
            take = min(room, len(prompt) - slot.computed)
            tokens += prompt[slot.computed : slot.computed + take]
            positions += range(slot.computed, slot.computed + take)
            seqs += [seq] * take
            slot.computed += take
            logits += [False] * (take - 1) + [slot.computed == len(prompt)]
            if slot.computed == len(prompt):
                samples.append((len(tokens) - 1, seq))
        context.decode(tokens, positions, seqs, logits)
        for index, seq in samples:
            slot = running[seq]
            slot.output.append(context.argmax(index))
            if len(slot.output) == new_tokens:
                outputs[slot.request] = slot.output
                context.forget(seq)
                free.append(seq)
                del running[seq]
    return outputs


def batched(args, lib, tokenizer) -> list[dict]:
    low, high = args.prompt_tokens
    prompts = serving.real_prompts(tokenizer, args.requests, low, high, seed=SERVING_SEED)
    base = {"requests": len(prompts), "prompt_range": f"{low}-{high}", "new_tokens": args.new_tokens,
            "prompt_tokens": sum(map(len, prompts))}  # fmt: skip
    rows, reference = [], None
    runs = [(dtype, "full") for dtype in filter(None, args.kvopt.split(","))]
    runs += [tuple(entry.split("=", 1)) for entry in args.kvopt_method]
    for dtype, spec in runs:
        row, tokens = kvopt_run(prompts, args.new_tokens, dtype, spec, args)
        reference = reference or (row["system"], tokens)
        rows.append(base | row)
        print(json.dumps(rows[-1]))
    for dtype in filter(None, args.hf.split(",")):
        for row, tokens in hf_runs(prompts, args.new_tokens, dtype, args):
            row = base | row | {"ran": len(tokens)}  # HF one at a time runs the first --hf-sequential only
            if reference:
                row |= {"compared_with": reference[0], "same_as_kvopt": sum(a == b for a, b in zip(tokens, reference[1]))}
            rows.append(row)
            print(json.dumps(rows[-1]))
    longest = max(map(len, prompts)) + args.new_tokens
    for name, path in weight_files(args.weights).items():
        model = load_weights(lib, path)
        for kv in args.kv.split(","):
            for parallel in _ints(args.parallel):
                parallel = min(parallel, len(prompts))
                context = Context(lib, model, parallel * longest, parallel, kv, args.options)
                start = time.perf_counter()
                outputs = continuous_batching(context, prompts, args.new_tokens, parallel)
                seconds = time.perf_counter() - start
                context.close()
                row = _row(args, "batched", name, kv) | base | {"parallel": parallel, "seconds": seconds,
                                                                "tok_s": len(prompts) * args.new_tokens / seconds}  # fmt: skip
                if reference:
                    row |= {"compared_with": reference[0], "same_as_kvopt": sum(a == b for a, b in zip(outputs, reference[1]))}
                rows.append(row)
                print(json.dumps(rows[-1]))
        lib.llama_model_free(model)
    return rows


def kvopt_run(prompts: list[list[int]], new_tokens: int, dtype: str, spec: str, args) -> tuple[dict, list[list[int]]]:
    """kvopt.LLM with ``kv_method=spec`` on the same prompts (greedy, EOS ignored): its row and tokens; ``parallel``
    is the most sequences that ran at once."""
    from kvopt.engine import LLM

    dtype, weights = kvopt_setting(dtype)
    llm = LLM(kv_memory=args.kv_memory, max_num_seqs=args.max_num_seqs, dtype=dtype, weights=weights, kv_method=spec)
    core, peak = llm.engine, 0
    engine_step = core.step

    def step():  # the engine's step, counting the sequences running at once after it
        nonlocal peak
        result = engine_step()
        peak = max(peak, len({seq.request_id for seq in core.scheduler.running}))
        return result

    core.step = step
    start = time.perf_counter()
    outputs = llm.generate(prompts, serving.greedy(new_tokens), use_tqdm=False)
    seconds = time.perf_counter() - start
    if any(out.error for out in outputs):
        raise SystemExit(f"kvopt.LLM {dtype} {spec}: {next(out.error for out in outputs if out.error)}")
    kv = str(llm.engine.dtype).removeprefix("torch.")
    row = {"step": "batched", "system": f"kvopt.LLM {dtype}" + (f" {weights}" if weights else "")
           + (f" {spec}" if spec != "full" else ""), "weights": weights or kv, "kv": kv if spec == "full" else f"{spec} ({kv})", "parallel": peak,
           "max_num_seqs": args.max_num_seqs, "seconds": seconds, "tok_s": len(prompts) * new_tokens / seconds,
           "pool_bytes": llm.engine.runner.pool.nbytes(), "threads": torch.get_num_threads(),
           "conditions": args.conditions}  # fmt: skip
    return row, [out.outputs[0].token_ids for out in outputs]


def hf_model(dtype: str):
    """Plain transformers as a user loads it: ``from_pretrained`` in ``dtype``, SDPA attention, no kvopt."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    from kvopt.models.cpu_features import model_dtype
    from kvopt.models.loading import resolve_model_dir

    logging.disable_progress_bar()  # one bar line per tensor otherwise
    return AutoModelForCausalLM.from_pretrained(resolve_model_dir(None), dtype=model_dtype(dtype, None),
                                                attn_implementation="sdpa", local_files_only=True).eval()  # fmt: skip


def _pad_token(model) -> int:
    pad = model.generation_config.eos_token_id
    return pad[0] if isinstance(pad, list) else pad


def hf_runs(prompts: list[list[int]], new_tokens: int, dtype: str, args):
    """Plain transformers (:func:`hf_model`): static batches of 8, then ``--hf-sequential`` requests one at a time;
    yields each run's row and tokens."""
    model = hf_model(dtype)
    name, pad = str(model.dtype).removeprefix("torch."), _pad_token(model)
    runs = [("HF static batches of 8", prompts, serving.hf_static_batches, 8),
            ("HF one at a time", prompts[: args.hf_sequential], serving.hf_one_at_a_time, 1)]
    for system, chosen, run, parallel in runs:
        if not chosen:
            continue
        start = time.perf_counter()
        tokens = run(model, chosen, new_tokens, pad)
        seconds = time.perf_counter() - start
        row = {"step": "batched", "system": f"{system} ({dtype})", "weights": name, "kv": name, "parallel": min(parallel, len(chosen)),
               "seconds": seconds, "tok_s": len(chosen) * new_tokens / seconds, "threads": torch.get_num_threads(),
               "conditions": args.conditions}  # fmt: skip
        yield row, tokens


# -- perplexity ---------------------------------------------------------------------------------
def perplexity(args, lib, tokenizer) -> list[dict]:
    """Every ``--kvopt`` setting's and every llama.cpp GGUF's perplexity on the same windows of text."""
    texts = serving.real_prompts(tokenizer, args.ppl_texts, args.ppl_tokens, args.ppl_tokens, seed=PERPLEXITY_SEED)
    predicted = sum(len(ids) - 1 for ids in texts)
    rows = []
    for entry in filter(None, args.kvopt.split(",")):
        dtype, weights = kvopt_setting(entry)
        nll, computes = kvopt_nll(texts, dtype, weights)
        rows.append(_perplexity_row(args, f"kvopt {entry}", weights or computes, computes, nll, predicted))
        print(json.dumps(rows[-1]))
    for name, path in weight_files(args.weights).items():
        model = load_weights(lib, path)
        try:
            nll = llamacpp_nll(lib, model, texts, args.options)
        finally:
            lib.llama_model_free(model)
        rows.append(_perplexity_row(args, "llama.cpp", name, "its own kernels", nll, predicted))
        print(json.dumps(rows[-1]))
    return rows


def kvopt_nll(texts: list[list[int]], dtype: str, weights: str | None) -> tuple[float, str]:
    """The summed negative log-likelihood of each window's tokens after its first under ``kvopt.load_model(dtype=...,
    weights=...)`` (Hugging Face's forward, the whole window at once), and the dtype it computed in."""
    import torch.nn.functional as F

    from kvopt import load_model

    model, _ = load_model(dtype=dtype, weights=weights)
    total = 0.0
    with torch.inference_mode():
        for ids in texts:
            tokens = torch.tensor([ids])
            logits = model(tokens).logits[0, :-1].float()
            total += F.cross_entropy(logits, tokens[0, 1:], reduction="sum").item()
    return total, str(model.dtype).removeprefix("torch.")


def llamacpp_nll(lib, model, texts: list[list[int]], options: Options) -> float:
    """The same through llama.cpp: each window decoded with logits at every position, in float64 from there."""
    context = Context(lib, model, max(len(ids) for ids in texts), 1, "f16", options)
    total = 0.0
    try:
        for ids in texts:
            context.forget(0)
            for start in range(0, len(ids), context.n_batch):
                chunk = ids[start : start + context.n_batch]
                context.decode(chunk, list(range(start, start + len(chunk))), [0] * len(chunk), [True] * len(chunk))
                for index in range(min(len(chunk), len(ids) - 1 - start)):
                    logits = context.logits(index).astype(np.float64)
                    top = logits.max()
                    total += top + np.log(np.exp(logits - top).sum()) - logits[ids[start + index + 1]]
    finally:
        context.close()
    return float(total)


def _perplexity_row(args, system: str, weights: str, computes: str, nll: float, predicted: int) -> dict:
    return {"step": "perplexity", "system": system, "weights": weights, "kv": "-", "computes": computes,
            "length": args.ppl_tokens, "texts": args.ppl_texts, "predicted": predicted,
            "perplexity": round(float(np.exp(nll / predicted)), 4), "threads": torch.get_num_threads(),
            "conditions": args.conditions}  # fmt: skip


def _row(args, step: str, weights: str, kv: str) -> dict:
    import llama_cpp

    options = args.options
    return {"step": step, "system": "llama.cpp", "weights": weights, "kv": kv, "new_tokens": args.new_tokens,
            "threads": options.threads, "n_batch": options.n_batch, "n_ubatch": options.n_ubatch,
            "flash_attn": "on" if kv != "f16" else options.flash_attn, "llama_cpp_python": llama_cpp.__version__,
            "conditions": args.conditions}  # fmt: skip


def _ints(text: str) -> list[int]:
    return [int(value) for value in text.split(",")]


def save(path: Path, rows: list[dict]) -> None:
    """Merge ``rows`` into ``path``: each replaces an older row of the same setting (:data:`SETTING`)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    old = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    measured = {tuple(row.get(key) for key in SETTING) for row in rows}
    kept = [row for row in old if tuple(row.get(key) for key in SETTING) not in measured]
    path.write_text("".join(json.dumps(row) + "\n" for row in [*kept, *rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", default=",".join(STEPS))
    parser.add_argument("--weights", default="Q4_1,F16", help="Q4_1 (the default model's GGUF), F16 and/or Q8_0 (its re-types); empty: no llama.cpp run")
    parser.add_argument("--kv", default="f16,q8_0", help="llama.cpp's KV cache types")
    parser.add_argument("--lengths", default="512,2048,8128", help="single: prompt tokens (8128 + 64 new = 8k positions)")
    parser.add_argument("--new-tokens", type=int, default=None, help="default: 64 (single), 128 (batched, as serving.py)")
    parser.add_argument("--repeats", type=int, default=3, help="single: runs per setting (median)")
    parser.add_argument("--requests", type=int, default=64, help="batched: requests (serving.py's prompts)")
    parser.add_argument("--prompt-tokens", type=serving.token_range, default=(SERVING_LOW, SERVING_HIGH), metavar="LOW-HIGH",
                        help="batched: each prompt's length is drawn from this range (default: serving.py's)")
    parser.add_argument("--parallel", default="8,16,32,64", help="batched: llama.cpp's slots (sequences at once)")
    parser.add_argument("--kvopt", default="", help="also kvopt.LLM in these dtypes, e.g. fp32,auto; DTYPE/int8: int8 weights computing in DTYPE")
    parser.add_argument("--kvopt-method", action="append", default=[], metavar="DTYPE=SPEC",
                        help="also kvopt.LLM in DTYPE with kv_method SPEC (repeatable; single and batched)")
    parser.add_argument("--hf", default="", help="also plain transformers in these dtypes (single: generate on one request; "
                        "batched: static batches of 8, then --hf-sequential requests one at a time), e.g. fp32,auto")
    parser.add_argument("--hf-sequential", type=int, default=8, help="batched: requests HF runs one at a time")
    parser.add_argument("--ppl-texts", type=int, default=8, help="perplexity: windows of local text")
    parser.add_argument("--ppl-tokens", type=int, default=1024, help="perplexity: tokens a window")
    parser.add_argument("--kv-memory", default="2GB", help="kvopt.LLM's pool (as serving.py)")
    parser.add_argument("--max-num-seqs", type=int, default=64, help="kvopt.LLM's sequences at once (as serving.py)")
    parser.add_argument("--threads", type=int, default=1, help="llama.cpp's threads (and torch's for kvopt)")
    parser.add_argument("--n-batch", type=int, default=2048)
    parser.add_argument("--n-ubatch", type=int, default=512)
    parser.add_argument("--flash-attn", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--conditions", default="", help="what else ran on the machine (stated with the rows)")
    parser.add_argument("--round", type=int, default=None, help="a repeat's number: its rows stay beside the main run's "
                        "and are listed under its table, round by round (run the systems alternately to see the noise)")
    parser.add_argument("--results", type=Path, default=ROWS.parent, help="rows folder")
    args = parser.parse_args()
    steps = args.steps.split(",")
    if set(steps) - set(STEPS):
        parser.error(f"unknown steps {sorted(set(steps) - set(STEPS))}; choose from {','.join(STEPS)}")
    args.options = Options(args.threads, args.n_batch, args.n_ubatch, args.flash_attn)
    torch.set_num_threads(args.threads)
    lib = bindings()
    from kvopt.models import load_tokenizer

    tokenizer = load_tokenizer()
    new_tokens = args.new_tokens
    for step in steps:
        args.new_tokens = new_tokens or {"single": 64, "batched": 128}.get(step)
        rows = globals()[step](args, lib, tokenizer)
        save(args.results / ROWS.name, [row | {"round": args.round} for row in rows] if args.round else rows)


# -- the BENCHMARKS.md section ------------------------------------------------------------------
def render(rows: list[dict]) -> str:
    """Markdown for the committed rows (``committed_section`` in benchmarks/run.py)."""
    threads = "/".join(str(count) for count in sorted({row["threads"] for row in rows}))
    lines = [f"## llama.cpp as a peer (llama-cpp-python, {threads} thread(s))", "",
             opening("python benchmarks/llamacpp.py --kvopt fp32,auto", row_dates(ROWS), ROWS), "",
             "Weights: the default model's GGUF (Q4_1) and F16 and Q8_0 re-types of it (kvopt's `int8`: its linears in "
             "int8 with one scale per output channel, beside Q8_0's one per 32 weights); prompts of local real text as "
             "token ids, greedy, EOS ignored.", ""]  # fmt: skip
    singles = [row for row in rows if row["step"] == "single" and not row.get("round")]
    if singles:
        # llama.cpp's F16 weights with f16 KV at each length, against rows of the same run only (the same conditions
        # stated): this CPU's speed drifts between runs by more than the differences measured
        peers = {weights: {(r["length"], r.get("conditions")): r["decode_tok_s"] for r in singles
                           if r.get("system", "llama.cpp") == "llama.cpp" and (r["weights"], r["kv"]) == (weights, "f16")}
                 for weights in ("F16", "Q8_0")}  # fmt: skip
        lines += ["### One request at a time", "",
                  "Decode tok/s: llama.cpp's from timing its decode calls; kvopt.LLM's from each request's first-token "
                  "and finish times (rows marked `per token`; older rows, and HF's, subtract a one-token request's "
                  "time from a 64-token one's, which at 8k tokens carries the prompt's run-to-run spread). Rows of one "
                  "run marked `interleaved` ran their repeats system after system, round after round, so the CPU's "
                  "drift over minutes falls on all alike.", "",
                  "| system | weights | KV | prompt tokens | prefill tok/s | decode tok/s | decode vs llama.cpp F16 (same run) "
                  "| vs Q8_0 (same run) |",
                  "|---|---|---|---:|---:|---:|---:|---:|"]  # fmt: skip
        for r in sorted(singles, key=lambda r: (r["length"], r.get("system", "llama.cpp"), r["weights"], r["kv"])):
            same_run = [peers[weights].get((r["length"], r.get("conditions"))) for weights in ("F16", "Q8_0")]
            ratios = " | ".join(f"{r['decode_tok_s'] / peer:.2f}x" if peer else "–" for peer in same_run)
            marks = ", ".join(mark for mark, on in (("per token", r.get("timed")), ("interleaved", r.get("interleaved")))
                              if on)  # fmt: skip
            lines.append(f"| {r.get('system', 'llama.cpp')} | {r['weights']} | {r['kv']} | {r['length']:,} | "
                         f"{r['prefill_tok_s']:.1f} | {r['decode_tok_s']:.1f}{f' ({marks})' if marks else ''} | "
                         f"{ratios} |")  # fmt: skip
        lines += [*conditions_line(singles), ""]
    lines += _perplexity_table([row for row in rows if row["step"] == "perplexity"])
    many = [row for row in rows if row["step"] == "batched" and not row.get("round")]
    repeats = [row for row in rows if row["step"] == "batched" and row.get("round")]
    for workload in dict.fromkeys(_workload(row) for row in many):
        lines += _batched_table([row for row in many if _workload(row) == workload])
        lines += _repeats_line([row for row in repeats if _workload(row) == workload])
    return "\n".join(lines)


def _perplexity_table(rows: list[dict]) -> list[str]:
    """Each weight format's perplexity, against its own system's full-precision run (kvopt's fp32, llama.cpp's F16):
    the two systems' kernels differ, so each format is read against its own baseline."""
    if not rows:
        return []
    first = rows[0]
    baseline = {system: next((r["perplexity"] for r in rows if (r["system"], r["weights"]) == key), None)
                for system, key in (("kvopt", ("kvopt fp32", "float32")), ("llama.cpp", ("llama.cpp", "F16")))}  # fmt: skip
    lines = [f"### Perplexity of the weight formats ({first['texts']} windows of {first['length']:,} tokens)", "",
             "The same windows of local real text, every token after a window's first predicted from all before it "
             "in one forward: kvopt's settings as `kvopt.load_model(dtype=..., weights=...)` loads them (Hugging Face's "
             "forward), llama.cpp's GGUFs through its own kernels. Each format against its own system's "
             "full-precision run.", "",
             "| system | weights | computes in | perplexity | vs kvopt fp32 / llama.cpp F16 |", "|---|---|---|---:|---:|"]  # fmt: skip
    for r in rows:
        base = baseline["llama.cpp" if r["system"] == "llama.cpp" else "kvopt"]
        delta = f"{(r['perplexity'] / base - 1) * 100:+.2f}%" if base else "–"
        lines.append(f"| {r['system']} | {r['weights']} | {r['computes']} | {r['perplexity']:.3f} | {delta} |")
    return lines + [*conditions_line(rows), ""]


def _workload(row: dict) -> tuple:
    """What a batched row ran: rows from before ``--prompt-tokens`` used serving.py's range."""
    return row["requests"], row.get("prompt_range", f"{SERVING_LOW}-{SERVING_HIGH}"), row["new_tokens"]


def _batched_table(rows: list[dict]) -> list[str]:
    """One workload: llama.cpp's settings and kvopt.LLM's runs, each against kvopt.LLM's fastest."""
    requests, prompt_range, new_tokens = _workload(rows[0])
    ours = max((row for row in rows if row["system"].startswith("kvopt")), key=lambda row: row["tok_s"], default=None)
    lines = [f"### {requests} requests of {prompt_range} tokens ({rows[0]['prompt_tokens']:,} prompt tokens), "
             f"{new_tokens} new tokens each", "",
             "llama.cpp: continuous batching as llama-server does it (`parallel` slots); kvopt.LLM: the engine, "
             "same prompts, same process (`parallel`: the most sequences it ran at once, or its `max_num_seqs` in rows "
             "from before that was counted); HF: plain transformers as a user loads it (`from_pretrained` in the dtype "
             "named, SDPA), static batches of 8 in order, or one request at a time over the first requests only "
             "(its tok/s and `same tokens` count those).", "",
             f"| system | weights | KV | parallel | wall time | output tok/s | {ours['system'] if ours else 'kvopt'} vs this "
             "| same tokens as |", "|---|---|---|---:|---:|---:|---:|---|"]  # fmt: skip
    for r in rows:
        same = f"{r['same_as_kvopt']}/{r.get('ran', r['requests'])} `{r['compared_with']}`" if "same_as_kvopt" in r else "–"
        ratio = f"{ours['tok_s'] / r['tok_s']:.2f}x" if ours and r is not ours else "–"
        lines.append(f"| {r['system']} | {r['weights']} | {r['kv']} | {r['parallel']} | {r['seconds']:.0f} s | "
                     f"{r['tok_s']:.1f} | {ratio} | {same} |")  # fmt: skip
    theirs = max((row for row in rows if row["system"] == "llama.cpp"), key=lambda row: row["tok_s"], default=None)
    if ours and theirs:
        lines += ["", f"kvopt.LLM's fastest run (`{ours['system'].removeprefix('kvopt.LLM ')}`) against llama.cpp's "
                      f"fastest ({theirs['weights']}, {theirs['parallel']} at a time): "
                      f"{ours['tok_s'] / theirs['tok_s']:.2f}x the output tokens per second."]  # fmt: skip
    return lines + conditions_line(rows) + [""]


def _repeats_line(rows: list[dict]) -> list[str]:
    """A workload's repeats (``--round``): each system's tok/s round by round, and kvopt's fastest system against
    llama.cpp's in each round (the spread a single run's ratio hides)."""
    if not rows:
        return []
    rounds = sorted({row["round"] for row in rows})
    systems = {}
    for row in sorted(rows, key=lambda row: row["round"]):
        name = row["system"] if row["system"] != "llama.cpp" else f"llama.cpp {row['weights']} ({row['kv']} KV)"
        systems.setdefault(name, {})[row["round"]] = row["tok_s"]
    ours = [name for name in systems if name.startswith("kvopt")]
    theirs = [name for name in systems if name.startswith("llama.cpp")]
    listed = "; ".join(f"{name} {' / '.join(f'{tok_s:.1f}' for tok_s in by_round.values())}" for name, by_round in systems.items())
    text = f"Repeated in {len(rounds)} more runs, the systems alternating (output tok/s by round): {listed}."
    if ours and theirs:
        ratios = [max(systems[n].get(r, 0) for n in ours) / max(systems[n].get(r, float("inf")) for n in theirs)
                  for r in rounds]  # fmt: skip
        text += (f" kvopt against llama.cpp by round: {' / '.join(f'{ratio:.2f}x' for ratio in ratios)} "
                 f"(median {statistics.median(ratios):.2f}x).")
    return [text, ""]


if __name__ == "__main__":
    main()
