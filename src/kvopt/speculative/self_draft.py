"""``self``: draft with the target's own first layers and its head (LayerSkip-style early exit).

LayerSkip (Elhoushi et al., arXiv 2404.16710) drafts by exiting after the first ``layers``
layers (final norm and LM head applied there) and verifies with the whole model; the draft
reads the *committed* KV of those layers from the target's own cache, so it needs no cache or
model of its own. Drafted tokens are written to those layers inside a speculative block and
forgotten when it closes. Deviation: LayerSkip reuses the draft's KV of the first layers in
verification; here verification recomputes them (the block stays one plain forward). Models
not trained with early-exit losses (most) accept few drafts from shallow exits; the adaptive
control then pauses speculation.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvopt.errors import KVOptError
from kvopt.models.forward import cache_kwargs
from kvopt.speculative.restore import speculate


@dataclass
class SelfSpeculation:
    """Drafts ``k`` tokens through the first ``layers`` layers of the target (sharing its cache)."""

    layers: int = 8
    k: int = 4

    name = "self"

    def __post_init__(self) -> None:
        if self.layers < 1 or self.k < 1:
            raise KVOptError(f"self: layers={self.layers} and k={self.k} must be >= 1, e.g. self:layers=8,k=4")

    def bind(self, model, cache, sampler) -> None:
        decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
        total = len(getattr(decoder, "layers", ()))
        if not total:
            raise KVOptError("self-speculation needs a decoder with a `layers` list; use prompt_lookup or draft:model=")
        if self.layers >= total:
            raise KVOptError(f"self: layers={self.layers} must be below the model's {total} layers")
        self.model, self.cache, self.sampler, self.decoder = model, cache, sampler, decoder

    def propose(self, tokens: list[int], count: int) -> tuple[list[int], torch.Tensor | None]:
        drafts, probs = [], []
        last = tokens[-1]
        with speculate(self.cache, layers=self.layers), first_layers(self.decoder, self.layers):  # forgotten on exit
            for _ in range(count):
                ids = torch.tensor([[last]], device=self.model.device)
                logits = self.model(input_ids=ids, **cache_kwargs(self.model, self.cache), use_cache=True).logits[0]
                q = self.sampler.probs(logits)[0]
                last = self.sampler.draw(q)
                drafts.append(last)
                probs.append(q)
        return drafts, None if self.sampler.greedy else torch.stack(probs)


@contextmanager
def first_layers(decoder, count: int) -> Iterator[None]:
    """Run ``decoder`` with its first ``count`` layers only (its own forward: embeddings, masks, norm)."""
    layers = decoder.layers
    decoder.layers = torch.nn.ModuleList(list(layers)[:count])
    try:
        yield
    finally:
        decoder.layers = layers
