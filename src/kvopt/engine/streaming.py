"""One prompt streamed through the serving engine, with the stats line ``kvopt generate`` prints.

``kvopt generate`` ran ``model.generate`` over a kvopt cache: HF's forward, ~230 torch ops per layer, so the default
model decoded at 9-17 tok/s on one core where the engine (lean forward, CPU kernels) decodes at 40-90. The engine
gives HF ``generate``'s greedy tokens (tested per method), so the answer is the same, sooner. A method that streams
past the model's context (StreamingLLM beyond the model's positions) keeps the HF path
(:func:`kvopt.runtime.generate_streaming`): the engine's sequences end at the context.
"""

from __future__ import annotations

from collections.abc import Callable

from kvopt.memory import estimate
from kvopt.models.info import ModelInfo
from kvopt.runtime import GenerationResult, check_context, encode_prompt, generate_streaming

#: Bytes of KV pool beyond what the request's tokens need in full precision (blocks round up; a compressed method's
#: layouts hold full-precision tokens beside their codes).
POOL_HEADROOM = 2


def stream_through_engine(
    prompt: str, model=None, method: str = "full", max_new_tokens: int = 128, chat: bool = True,
    dtype: str | None = None, sink: Callable[[str], None] = lambda text: None, tokenizer=None,
    device: str | None = None, weights: str | None = None,
) -> GenerationResult:  # fmt: skip
    """Greedy generation of ``prompt`` through :class:`kvopt.LLM` with ``kv_method=method``, streaming text to
    ``sink`` (arguments as :func:`kvopt.runtime.generate_streaming`). ``kv_bytes`` is what the request's sequence
    held at its last step (its blocks; a compressed one's share of its code blocks)."""
    from kvopt.api import load_model
    from kvopt.engine.llm import LLM
    from kvopt.engine.sampling_params import SamplingParams
    from kvopt.methods import parse

    methods = parse(method)  # a malformed spec fails before the model loads
    if tokenizer is None:
        model, tokenizer = load_model(model, dtype=dtype, device=device, weights=weights)
    info = ModelInfo.from_config(model.config)
    ids = encode_prompt(tokenizer, prompt, chat)[0].tolist()
    check_context(info, len(ids), max_new_tokens, methods)
    tokens = len(ids) + max_new_tokens
    if info.max_positions is not None and tokens > info.max_positions:  # a method streaming past the context
        return generate_streaming(prompt, model, method, max_new_tokens, chat, sink=sink, tokenizer=tokenizer)
    full_bytes = estimate(info, tokens, dtype=model.dtype).total_bytes
    llm = LLM(model, tokenizer=tokenizer, kv_method=method, kv_memory=POOL_HEADROOM * full_bytes + 2**22,
              max_num_seqs=1, max_model_len=tokens, enable_prefix_caching=False)  # fmt: skip
    printed, held, output = "", 0, None
    for output in llm.stream(ids, SamplingParams(max_tokens=max_new_tokens, temperature=0.0)):
        text = output.outputs[0].text
        if not text.endswith("\ufffd"):  # an incomplete multi-byte character waits for the token completing it
            sink(text[len(printed) :])
            printed = text
        if not output.finished:  # what its sequence holds (freed once it finishes)
            engine = llm.engine
            held = sum(seq.kv.nbytes(seq, engine.block_bytes) for seq in engine.scheduler.running)
    completion, metrics = output.outputs[0], output.metrics
    sink(completion.text[len(printed) :])
    if completion.finish_reason == "error":
        raise RuntimeError(f"the engine failed the request: {output.error}")
    first = metrics.first_token_time or metrics.finished_time
    return GenerationResult(
        text=completion.text, spec=method, prompt_tokens=len(ids), new_tokens=len(completion.token_ids),
        prefill_seconds=first - metrics.arrival_time, decode_seconds=metrics.finished_time - first, kv_bytes=held,
        full_kv_bytes=estimate(info, len(ids) + len(completion.token_ids) - 1, dtype=model.dtype).total_bytes,
    )  # fmt: skip
