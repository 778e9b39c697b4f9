"""Verification of drafted tokens against the target model's distributions.

Greedy: accept drafts while they equal the target's argmax, then emit the target's own token,
so the output equals plain greedy decoding. Sampling (Leviathan et al., arXiv 2211.17192; Chen
et al., arXiv 2302.01318): accept draft ``d`` drawn from ``q`` with probability
``min(1, p(d) / q(d))``; on rejection draw from the residual ``max(0, p - q)`` normalised, so
every emitted token is distributed as the target's ``p``. A deterministic proposer (prompt
lookup, a greedy draft) is the case ``q = one-hot(d)``: accept with ``p(d)``, else draw from
``p`` without ``d``.
"""

from __future__ import annotations

import torch

from kvopt.speculative.sampling import Sampler


def verify(
    sampler: Sampler, target: torch.Tensor, drafts: list[int], draft_probs: torch.Tensor | None
) -> tuple[int, int]:
    """``(accepted drafts, next token)`` from the target's probabilities ``target [len(drafts) + 1, vocab]``
    (from :meth:`Sampler.probs`) and the drafts' ``draft_probs [len(drafts), vocab]`` (None: deterministic)."""
    for index, token in enumerate(drafts):
        p = target[index]
        if sampler.greedy:
            if int(p.argmax()) != token:
                return index, int(p.argmax())
            continue
        q = draft_probs[index].to(p.device) if draft_probs is not None else None  # a draft model may run elsewhere
        q_token = 1.0 if q is None else float(q[token])
        chance = torch.rand((), generator=sampler.generator, device="cpu")
        if q_token > 0 and float(chance) < min(1.0, float(p[token]) / q_token):
            continue
        return index, sampler.draw(residual(p, q, token))
    return len(drafts), sampler.draw(target[len(drafts)])


def residual(p: torch.Tensor, q: torch.Tensor | None, token: int) -> torch.Tensor:
    """``max(0, p - q)`` normalised (``q`` one-hot on ``token`` when None); ``p`` if nothing is left."""
    if q is None:
        q = torch.zeros_like(p)
        q[token] = 1.0
    rest = (p - q).clamp(min=0)
    total = rest.sum()
    return rest / total if total > 0 else p
