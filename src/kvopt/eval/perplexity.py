"""Streaming perplexity (StreamingLLM's protocol): feed text through the cache chunk by chunk.

With ``chunk=1`` every token is a decode step, so decode-time policies act exactly as in
generation; larger chunks are faster but evict more coarsely (the chunk is reported).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvopt.eval.contenders import Contender
from kvopt.models.forward import cache_kwargs


@dataclass(frozen=True)
class PerplexityOutcome:
    ppl: float
    tokens: int
    ppl_first: float
    first_tokens: int
    kv_bytes_peak: int
    kv_bytes_end: int
    seconds: float


@torch.inference_mode()
def streaming_perplexity(model, contender: Contender, ids: list[int], chunk: int = 1, first: int = 2000) -> PerplexityOutcome:
    """PPL over ``ids`` (every token but the first is predicted), and over the first ``first`` predictions."""
    if contender.family == "kvpress":
        raise ValueError(f"{contender.spec}: kvpress presses compress only at prefill; streaming perplexity does not apply")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    cache = contender.new_cache(model)
    tokens = torch.as_tensor(ids, device=model.device)
    nll = torch.zeros(tokens.numel() - 1, dtype=torch.float64)
    peak = 0
    started = time.perf_counter()
    for start in range(0, tokens.numel() - 1, chunk):
        piece = tokens[start : start + chunk]
        targets = tokens[start + 1 : start + 1 + piece.numel()]
        positions = torch.arange(start, start + piece.numel(), device=model.device)[None]
        logits = model(input_ids=piece[None], **cache_kwargs(model, cache), position_ids=positions, use_cache=True).logits[0]
        logits = logits[: targets.numel()].float()
        nll[start : start + targets.numel()] = F.cross_entropy(logits, targets, reduction="none").double().cpu()
        peak = max(peak, contender.held_bytes(cache))
    first = min(first, nll.numel())
    return PerplexityOutcome(
        ppl=math.exp(nll.mean().item()),
        tokens=nll.numel(),
        ppl_first=math.exp(nll[:first].mean().item()),
        first_tokens=first,
        kv_bytes_peak=peak,
        kv_bytes_end=contender.held_bytes(cache),
        seconds=time.perf_counter() - started,
    )
