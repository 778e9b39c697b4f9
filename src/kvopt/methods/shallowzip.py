"""``shallowzip``: KVzip's query-agnostic scores from a reconstruction pass through the first layers only.

KVzip (arXiv 2505.23416) scores every cached token by the largest attention the model pays it while
repeating the whole context, a forward through every layer that costs here about three prefills
more (its attention over the whole context is computed explicitly, for the scores). Most of that is
the deeper layers' work, and FastKV's observation (arXiv 2502.01068) that token importance settles
early applies to these scores too. So the reconstruction forwards stop after the first ``depth`` of
the layers (a forward pre-hook on the next decoder layer ends each one), those layers are scored
exactly as KVzip scores them (:func:`~kvopt.methods.kvzip.score_reconstruction`), and every deeper
layer ranks its tokens by the mean score, over KV heads, of the last ``carry`` reconstructed layers.
The selection is KVzip's: one ranking over all layers and KV heads (``budgets=global``, ragged
storage), or an equal share per layer.

Cost: the reconstruction's share of a KVzip pass is about ``depth``; with ``depth=0.25`` (8 of the
default model's 30 layers) the prefill costs about 1.5x a plain one against KVzip's ~3.5x at 2k tokens
(BENCHMARKS.md, ``benchmarks/frontier.py``, which also compares their accuracy). In pilots, 6 layers
(``depth=0.2``) lost the passkey that 8 keep.

Deviations from KVzip: the deeper layers' scores are carried over, not measured (one score per
token shared by their heads).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.errors import MethodParameterError
from kvopt.methods.base import register
from kvopt.methods.fastkv import decoder_layers
from kvopt.methods.kvzip import EXTRA, KVzip


class _Reconstructed(Exception):
    """Raised before the first unscored layer: the reconstruction forward has done its work."""


def _stop(module, args) -> None:
    raise _Reconstructed


@register
@dataclass
class ShallowZip(KVzip):
    """KVzip's reconstruction scores in the first layers; deeper layers carry the last ones' mean score."""

    name = "shallowzip"
    summary = "query-agnostic: KVzip's reconstruction pass through the first layers only, scores carried deeper"

    depth: float = field(default=0.25, metadata={"help": "share of the layers the reconstruction runs through"})
    carry: int = field(default=3, metadata={"help": "last reconstructed layers whose mean score deeper layers use"})

    def validate(self) -> None:
        super().validate()
        if not 0.0 < self.depth <= 1.0 or self.carry < 1:
            raise MethodParameterError(
                f"shallowzip: depth={self.depth} must lie in (0, 1] and carry={self.carry} be >= 1, "
                "e.g. shallowzip:ratio=0.75,depth=0.25,carry=3"
            )

    def scored_layers(self, layers: int) -> int:
        """How many of ``layers`` layers the reconstruction runs through (at least one)."""
        return min(layers, max(1, round(layers * self.depth)))

    def after_prefill(self, cache, model, input_ids, attention_mask, tokenizer) -> None:
        layers = cache.layers
        depth = self.scored_layers(len(layers))
        for layer in layers:
            layer.store.add_extra(EXTRA)
        stop = decoder_layers(model, self.name)[depth].register_forward_pre_hook(_stop) if depth < len(layers) else None
        try:
            self.reconstruct(cache, model, input_ids, attention_mask, tokenizer, layers[:depth])
        finally:
            if stop is not None:
                stop.remove()
        carried = torch.stack([layer.store.extra(EXTRA) for layer in layers[max(0, depth - self.carry) : depth]])
        carried = carried.mean(dim=(0, 2))[:, None, :]  # [B, 1, T]: over the carried layers and their KV heads
        for layer in layers[depth:]:
            extra = layer.store.extra(EXTRA)
            extra.copy_(carried.expand_as(extra))
        self.select(cache, model)

    def forward(self, model, ids, mask, cache) -> None:
        try:
            super().forward(model, ids, mask, cache)
        except _Reconstructed:
            pass  # the scored layers have attended; the deeper ones are not needed
