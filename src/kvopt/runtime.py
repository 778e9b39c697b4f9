"""Streaming generation with timing and memory accounting (used by ``kvopt generate`` and the demo)."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from kvopt.errors import ContextTooLongError, KVOptError
from kvopt.memory import estimate, human_bytes
from kvopt.methods import Method
from kvopt.models.forward import cache_kwargs
from kvopt.models.info import ModelInfo


@dataclass(frozen=True)
class GenerationResult:
    text: str
    spec: str
    prompt_tokens: int
    new_tokens: int
    prefill_seconds: float
    decode_seconds: float
    #: Bytes the kvopt cache held at the end (measured).
    kv_bytes: int
    #: Bytes a full-precision, keep-everything cache would hold for the same tokens.
    full_kv_bytes: int

    @property
    def prefill_tokens_per_second(self) -> float:
        return self.prompt_tokens / self.prefill_seconds if self.prefill_seconds else float("nan")

    @property
    def decode_tokens_per_second(self) -> float:
        steps = self.new_tokens - 1  # the first new token comes out of the prefill
        return steps / self.decode_seconds if steps > 0 and self.decode_seconds else float("nan")

    def summary(self) -> str:
        ratio = self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else float("nan")
        return (
            f"[{self.spec}] prompt {self.prompt_tokens} tok | new {self.new_tokens} tok | "
            f"prefill {self.prefill_tokens_per_second:.1f} tok/s | decode {self.decode_tokens_per_second:.1f} tok/s | "
            f"KV held {human_bytes(self.kv_bytes)} vs full {human_bytes(self.full_kv_bytes)} ({ratio:.2f}x)"
        )


class _TimedStreamer:
    """A ``generate`` streamer that decodes text incrementally and timestamps the first new token."""

    def __init__(self, tokenizer, sink: Callable[[str], None]) -> None:
        self.tokenizer, self.sink = tokenizer, sink
        self.tokens: list[int] = []
        self.printed = 0
        self.prompt_seen = False
        self.first_token_at: float | None = None

    def put(self, value: torch.Tensor) -> None:
        if not self.prompt_seen:  # generate passes the prompt first
            self.prompt_seen = True
            return
        if self.first_token_at is None:
            self.first_token_at = time.perf_counter()
        self.tokens.extend(value.reshape(-1).tolist())
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        # Hold back an incomplete multi-byte character until the next token completes it.
        if not text.endswith("\ufffd"):
            self.sink(text[self.printed :])
            self.printed = len(text)

    def end(self) -> None:
        text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        self.sink(text[self.printed :])
        self.printed = len(text)


def encode_prompt(tokenizer, prompt: str, chat: bool) -> torch.Tensor:
    """Token ids ``[1, n]``; with ``chat`` the prompt is a user turn in the model's chat template."""
    if chat and getattr(tokenizer, "chat_template", None):
        encoded = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"]
    return tokenizer(prompt, return_tensors="pt")["input_ids"]


def check_context(info: ModelInfo, prompt_tokens: int, max_new_tokens: int, methods: Sequence[Method] = ()) -> None:
    """Refuse a prompt and answer longer than the model's context, unless a method streams past it (StreamingLLM).

    The fix named is the one that works: a lower ``--max-new-tokens`` only while the prompt alone fits.
    """
    limit = info.max_positions
    if prompt_tokens == 0:
        raise KVOptError("the prompt is empty (it encodes to no tokens); pass some text, or use --chat")
    if max_new_tokens < 1:
        raise KVOptError(f"max_new_tokens={max_new_tokens} must be at least 1")
    if limit is None or prompt_tokens + max_new_tokens <= limit or any(m.extends_context for m in methods):
        return
    room = limit - prompt_tokens
    fix = (
        f"lower --max-new-tokens to {room} or shorten the prompt"
        if room >= 1
        else f"shorten the prompt to at most {limit - 1} tokens (or stream past the context with streamingllm)"
    )
    raise ContextTooLongError(
        f"prompt of {prompt_tokens} tokens plus {max_new_tokens} new tokens exceeds the model's maximum of "
        f"{limit} positions; {fix}"
    )


def generate_streaming(
    prompt: str,
    model=None,
    method: str = "full",
    max_new_tokens: int = 128,
    chat: bool = True,
    dtype: str | None = None,
    sink: Callable[[str], None] = lambda text: None,
    tokenizer=None,
    device: str | None = None,
    weights: str | None = None,
) -> GenerationResult:
    """Greedy generation through a kvopt cache, streaming text to ``sink``.

    ``model`` is a loaded model (then pass ``tokenizer``) or a name/path for :func:`kvopt.load_model`.
    The method spec is validated before the model is loaded, so typos fail fast.
    """
    from kvopt.api import build_cache, load_model
    from kvopt.methods import parse

    methods = parse(method)
    if tokenizer is None:
        model, tokenizer = load_model(model, dtype=dtype, device=device, weights=weights)
    info = ModelInfo.from_config(model.config)
    input_ids = encode_prompt(tokenizer, prompt, chat).to(model.device)
    check_context(info, input_ids.shape[-1], max_new_tokens, methods)
    cache = build_cache(methods, model)
    streamer = _TimedStreamer(tokenizer, sink)
    start = time.perf_counter()
    with torch.inference_mode():
        cache.run_prompt_pass(model, input_ids, tokenizer)
        output = model.generate(
            input_ids,
            attention_mask=torch.ones_like(input_ids),
            **cache_kwargs(model, cache),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            streamer=streamer,
            pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id,
        )
    finished = time.perf_counter()
    new_ids = output[0, input_ids.shape[-1] :]
    first = streamer.first_token_at or finished
    stored_tokens = cache.get_seq_length()
    return GenerationResult(
        text=tokenizer.decode(new_ids, skip_special_tokens=True),
        spec=cache.spec,
        prompt_tokens=input_ids.shape[-1],
        new_tokens=int(new_ids.numel()),
        prefill_seconds=first - start,
        decode_seconds=finished - first,
        kv_bytes=cache.nbytes(),
        full_kv_bytes=estimate(info, stored_tokens, dtype=model.dtype).total_bytes,
    )
