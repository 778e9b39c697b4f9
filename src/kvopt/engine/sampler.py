"""Next tokens from the last positions' logits: greedy, temperature, top-k, top-p, per-request seeds; drafts
verified (speculative decoding)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.engine.sequence import Sequence
from kvopt.speculative.sampling import filtered_probs as _filtered_probs
from kvopt.speculative.verify import verify


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


def verify_drafts(logits: torch.Tensor, seq: Sequence, default_generator: torch.Generator) -> list[int]:
    """The tokens ``seq`` emits from its step's logits ``[drafts + 1, vocab]`` (fp32): the drafts its own choices
    agree with, then one token of its own (:func:`kvopt.speculative.verify.verify`: greedy output equals plain
    decoding; sampled tokens are distributed as plain sampling draws them, by the standard acceptance rule)."""
    params, drafts = seq.params, seq.draft_token_ids
    draws = _Draws(params.greedy, seq.generator or default_generator)
    if params.greedy:
        target = logits  # only the argmax is read
    else:
        host = logits.cpu()
        target = torch.stack([_filtered_probs(row, params.temperature, params.top_k, params.top_p) for row in host])
    accepted, token = verify(draws, target, drafts, None)
    return [*drafts[:accepted], token]


@dataclass(slots=True)
class _Draws:
    """One sequence's sampling as verification reads it: greedy or not, its random stream, one draw."""

    greedy: bool
    generator: torch.Generator

    def draw(self, probs: torch.Tensor) -> int:
        if self.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs, 1, generator=self.generator))


def logprobs(logits: torch.Tensor, tokens: list[int], top: int) -> list[dict[int, float]]:
    """Per row: the model's log-probability of the chosen token and of its ``top`` most likely alternatives (at most
    the vocabulary: :class:`~kvopt.SamplingParams` bounds ``top``, and a larger one must not break the step)."""
    log_probs = torch.log_softmax(logits, dim=-1)
    top = min(top, log_probs.shape[-1])
    result = []
    for row, token in enumerate(tokens):
        entry = {token: float(log_probs[row, token])}
        if top:
            values, ids = log_probs[row].topk(top)
            entry.update(zip(ids.tolist(), values.tolist()))
        result.append(entry)
    return result
