"""A greedy decoding loop shared by every contender, kvopt or peer.

Positions are passed explicitly, counted from the tokens *seen*, because a peer's compressed
``DynamicCache`` reports its shortened length as if it were the sequence length.
``logits_to_keep=1`` avoids materialising vocabulary logits for every prompt token.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from kvopt.eval.contenders import Contender
from kvopt.memory import estimate
from kvopt.models.forward import cache_kwargs
from kvopt.models.info import ModelInfo

QUERY_AGNOSTIC = "query_agnostic"
QUERY_AWARE = "query_aware"
MODES = (QUERY_AGNOSTIC, QUERY_AWARE)


@dataclass(frozen=True)
class Outcome:
    token_ids: list[int]
    prefill_s: float
    decode_tok_s: float
    kv_bytes_peak: int
    kv_bytes_full: int

    @property
    def compression(self) -> float:
        return 1.0 - self.kv_bytes_peak / self.kv_bytes_full if self.kv_bytes_full else 0.0


def synchronize(device: torch.device) -> None:
    """Wait for an accelerator's queued work: a clock read before it would time the kernel launches only."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def forward(model, ids: list[int] | torch.Tensor, cache, start: int) -> torch.Tensor:
    """Feed ``ids`` at positions ``start...``; return the last position's logits ``[vocab]``."""
    ids = torch.as_tensor(ids, device=model.device).reshape(1, -1)
    positions = torch.arange(start, start + ids.shape[-1], device=model.device)[None]
    output = model(input_ids=ids, **cache_kwargs(model, cache), position_ids=positions, use_cache=True, logits_to_keep=1)
    return output.logits[0, -1]


@dataclass
class SharedPrefill:
    """One lossless prefill of a prompt that every replaying contender starts from (methods act after attention)."""

    ids: tuple[int, ...]
    cache: object
    logits: torch.Tensor
    seconds: float


@torch.inference_mode()
def shared_prefill(model, prompt_ids: list[int]) -> SharedPrefill:
    """Prefill ``prompt_ids`` once with a recording cache (see :meth:`KVCache.replay_prefill`)."""
    from kvopt.methods.recording import record_prefill

    started = time.perf_counter()
    ids = torch.as_tensor(prompt_ids, device=model.device)[None]
    positions = torch.arange(ids.shape[-1], device=model.device)[None]
    cache, output = record_prefill(model, ids, position_ids=positions, logits_to_keep=1)
    synchronize(model.device)
    return SharedPrefill(tuple(prompt_ids), cache, output.logits[0, -1], time.perf_counter() - started)


def prefill_prompt(context_ids: list[int], question_ids: list[int], mode: str) -> list[int]:
    """The tokens compressed at prefill: the context alone (query-agnostic) or context + question."""
    if mode == QUERY_AGNOSTIC:
        return list(context_ids)
    if mode == QUERY_AWARE:
        return list(context_ids) + list(question_ids)
    raise ValueError(f"unknown mode {mode!r}; use one of {MODES}")


@torch.inference_mode()
def run_prompt(
    model,
    contender: Contender,
    context_ids: list[int],
    question_ids: list[int],
    max_new_tokens: int,
    mode: str,
    stop_ids: set[int],
    tokenizer=None,
    shared: SharedPrefill | None = None,
) -> Outcome:
    """Prefill (compressing the context alone, or context+question), then decode greedily.

    With ``shared`` (a :func:`shared_prefill` of the same prompt), a contender that replays (kvopt's and
    HF's caches) starts from that prefill instead of running its own; ``prefill_s`` then includes the
    shared pass's time.
    """
    prompt = prefill_prompt(context_ids, question_ids, mode)
    replay = shared is not None and contender.replays
    if replay and shared.ids != tuple(prompt):
        raise ValueError("the shared prefill was made for another prompt")
    cache = contender.new_cache(model)
    started = time.perf_counter()
    if replay:
        contender.replay_prefill(cache, shared.cache)
        logits = shared.logits
    else:
        with contender.compressing(model):
            logits = forward(model, prompt, cache, 0)
    contender.after_prefill(model, cache, prompt, tokenizer)
    cache = contender.reloaded(model, cache)
    if mode == QUERY_AGNOSTIC:
        if contender.family == "kvpress":
            # Presses with per-layer budgets (PyramidKV) leave layers of different lengths, and HF
            # sizes a multi-token mask from layer 0; one token at a time needs no mask (same result).
            for offset, token in enumerate(question_ids):
                logits = forward(model, [token], cache, len(context_ids) + offset)
        else:
            logits = forward(model, question_ids, cache, len(context_ids))
    seen = len(context_ids) + len(question_ids)
    peak = contender.held_bytes(cache)
    synchronize(model.device)
    prefilled = time.perf_counter()
    tokens: list[int] = []
    while True:
        token = int(logits.argmax())
        if token in stop_ids:
            break
        tokens.append(token)
        if len(tokens) == max_new_tokens:
            break
        logits = forward(model, [token], cache, seen)
        seen += 1
    synchronize(model.device)
    finished = time.perf_counter()
    peak = max(peak, contender.held_bytes(cache))
    steps = max(len(tokens) - 1, 0)
    info = ModelInfo.from_config(model.config)
    return Outcome(
        token_ids=tokens,
        prefill_s=prefilled - started + (shared.seconds if replay else 0.0),
        decode_tok_s=steps / (finished - prefilled) if steps else float("nan"),
        kv_bytes_peak=peak,
        kv_bytes_full=estimate(info, seen, dtype=model.dtype).total_bytes,
    )


def stop_token_ids(tokenizer, model) -> set[int]:
    """End-of-turn tokens: the tokenizer's EOS and the generation config's EOS ids."""
    ids = set()
    for value in (tokenizer.eos_token_id, getattr(model.generation_config, "eos_token_id", None)):
        if isinstance(value, int):
            ids.add(value)
        elif value:
            ids.update(value)
    return ids
