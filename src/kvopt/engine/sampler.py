"""Next tokens from the last positions' logits: greedy, temperature, top-k, top-p, per-request seeds."""

from __future__ import annotations

import torch

from kvopt.engine.sequence import Sequence


def sample(logits: torch.Tensor, seqs: list[Sequence], default_generator: torch.Generator) -> list[int]:
    """One token per row of ``logits [S, vocab]`` (fp32) for ``seqs``; greedy rows are batched.

    A request's ``seed`` gives it its own random stream, so its samples do not depend on what
    else shares the batch.
    """
    tokens = logits.argmax(dim=-1).tolist()
    sampled = [row for row, seq in enumerate(seqs) if not seq.params.greedy]
    # The generators are the CPU's (a seeded request draws the same tokens on every device): one copy there.
    host = logits[sampled].cpu() if sampled else None
    for index, row in enumerate(sampled):
        params = seqs[row].params
        probs = _filtered_probs(host[index], params.temperature, params.top_k, params.top_p)
        tokens[row] = int(torch.multinomial(probs, 1, generator=seqs[row].generator or default_generator))
    return tokens


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """Softmax of ``logits / temperature`` keeping the top-k tokens, then the smallest set with mass >= top_p."""
    scaled = logits / temperature
    if top_k and top_k < scaled.numel():
        threshold = scaled.topk(top_k).values[-1]
        scaled = scaled.masked_fill(scaled < threshold, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        sorted_probs, order = probs.sort(descending=True)
        # Keep a token while the mass before it is below top_p (the most likely token always stays).
        drop = sorted_probs.cumsum(0) - sorted_probs >= top_p
        sorted_probs[drop] = 0.0
        probs = torch.zeros_like(probs).scatter_(0, order, sorted_probs)
    return probs


def logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[dict[int, float]]:
    """Per row: the model's log-probability of the chosen token and of its ``top`` most likely alternatives."""
    log_probs = torch.log_softmax(logits, dim=-1)
    result = []
    for row, token in enumerate(tokens):
        entry = {token: float(log_probs[row, token])}
        if top:
            values, ids = log_probs[row].topk(top)
            entry.update(zip(ids.tolist(), values.tolist()))
        result.append(entry)
    return result
