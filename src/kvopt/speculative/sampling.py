"""The target's next-token distribution: temperature, top-k and top-p, or greedy (temperature 0)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.errors import KVOptError


@dataclass
class Sampler:
    """Turns logits ``[n, vocab]`` into the distributions speculative decoding verifies against.

    Drafts are sampled through the same sampler, so a draft's distribution ``q`` and the target's
    ``p`` are processed alike (the acceptance rule is exact for whatever ``p`` this returns).
    """

    temperature: float = 0.0
    top_k: int | None = None
    top_p: float | None = None
    seed: int | None = None

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise KVOptError(f"temperature={self.temperature} must be >= 0 (0 is greedy)")
        if self.top_k is not None and self.top_k < 1:
            raise KVOptError(f"top_k={self.top_k} must be >= 1")
        if self.top_p is not None and not 0 < self.top_p <= 1:
            raise KVOptError(f"top_p={self.top_p} must lie in (0, 1]")
        self.generator = torch.Generator()
        if self.seed is None:
            self.generator.seed()  # a fresh random seed (a new Generator always starts from the same one)
        else:
            self.generator.manual_seed(self.seed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def probs(self, logits: torch.Tensor) -> torch.Tensor:
        """``[n, vocab]`` fp32 probabilities (one-hot on the argmax when greedy)."""
        logits = logits.float()
        if self.greedy:
            return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).float()
        return filtered_probs(logits, self.temperature, self.top_k, self.top_p)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs [vocab]`` (its argmax when greedy)."""
        if self.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))  # the CPU generator: same draws on every device


def filtered_probs(
    logits: torch.Tensor, temperature: float, top_k: int | None, top_p: float | None
) -> torch.Tensor:
    """Softmax of ``logits [..., vocab] / temperature`` over the ``top_k`` most likely tokens, then over the smallest
    set of them with mass >= ``top_p`` (the most likely token always stays); renormalised, so verification's
    acceptance ratios read true probabilities. ``top_k`` None or 0 and ``top_p`` None or 1 filter nothing.

    The one filter of both samplers: speculative decoding's :class:`Sampler` and the engine's."""
    logits = logits / temperature
    if top_k and top_k < logits.shape[-1]:
        threshold = logits.topk(top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < threshold, float("-inf"))
    if top_p is not None and top_p < 1:
        ordered, order = logits.sort(dim=-1, descending=True)
        probs = ordered.softmax(-1)
        drop = probs.cumsum(-1) - probs >= top_p  # a token goes once the mass before it reaches top_p
        logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
    return logits.softmax(-1)
