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
        logits = logits / self.temperature
        if self.top_k is not None and self.top_k < logits.shape[-1]:
            threshold = logits.topk(self.top_k, dim=-1).values[..., -1:]
            logits = logits.masked_fill(logits < threshold, float("-inf"))
        if self.top_p is not None and self.top_p < 1:
            ordered, order = logits.sort(dim=-1, descending=True)
            mass = ordered.softmax(-1).cumsum(-1)
            drop = mass - ordered.softmax(-1) >= self.top_p  # keep the smallest prefix reaching top_p
            logits = logits.masked_fill(drop.scatter(-1, order, drop), float("-inf"))
        return logits.softmax(-1)

    def draw(self, probs: torch.Tensor) -> int:
        """One token from ``probs [vocab]`` (its argmax when greedy)."""
        if self.greedy:
            return int(probs.argmax())
        return int(torch.multinomial(probs.cpu(), 1, generator=self.generator))  # the CPU generator: same draws on every device
