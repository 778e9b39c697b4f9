"""``minicache``: merge the KV of adjacent layer pairs from mid-depth (MiniCache).

MiniCache (Liu et al., arXiv 2405.14366): in the deeper half of a network, adjacent layers'
KV states point in similar directions. For each pair of layers from ``start`` (a fraction of
the depth) on, every token's key and value are split into magnitude and direction; the two
directions are merged by SLERP (``t``) into one shared unit vector, and each layer keeps only
its magnitudes, so the pair stores about one layer's worth of vectors. The ``retain`` fraction
of tokens whose two layers disagree most (largest angle between the keys, shared by the
values, as KVCache-Factory) keep both originals, scattered back on reading. Post-RoPE states
are merged, so positions are untouched.

Merging happens after the prefill and then whenever ``residual`` new tokens are held by both
layers. Composes with KIVI: ``minicache+kivi:bits=4`` stores the shared directions
KIVI-quantized (whole groups) and quantizes the unmerged layers as usual.

Measured: the premise does not hold on the small models here. From mid-depth on, adjacent layers'
keys and values are nearly orthogonal token by token (mean cosine within +-0.21 for every pair of
SmolLM2-135M's layers 15-28 and Qwen2.5-Coder-0.5B's 12-23, 1,024 tokens of prose; the paper
reports high similarity on 7B+ models), so the shared direction loses both: ``minicache+kivi``
keeps 0% [0-18] of ``full``'s answers on the default model (passkey and niah at 4k, 24 prompts,
query-agnostic) and ``minicache`` alone answers none of 4 such prompts even from ``start=0.75``.

Deviations: the retention rule is KVCache-Factory's top fraction by angle (the paper's rule is
a threshold between the smallest and largest angle); layers keep up to ``residual`` recent
tokens unmerged (the paper merges every decoded token). Pairs need both layers to hold the
same tokens: after layer-dependent eviction (pyramidkv), mismatching pairs stay unmerged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvopt.cache.merged import MergedPair, MergedView, PlainKV, slerp_merge
from kvopt.cache.positions import TokenIndex
from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError
from kvopt.methods.base import Method, register, require_ratio
from kvopt.methods.quantization import dense_bytes, packed_bytes, position_bytes


@register
@dataclass
class MiniCache(Method):
    """Adjacent layers from mid-depth share one direction per token; each keeps its magnitudes."""

    name = "minicache"
    summary = "cross-layer merging: adjacent layers from mid-depth share SLERP-merged directions (MiniCache)"
    budget_convention = "keeps every token; merged layer pairs store about one layer's vectors"

    start: float = field(default=0.5, metadata={"help": "fraction of the depth where merging starts"})
    t: float = field(default=0.6, metadata={"help": "SLERP interpolation towards the deeper layer"})
    retain: float = field(default=0.05, metadata={"help": "fraction of tokens kept unmerged (largest angle)"})
    residual: int = field(default=32, metadata={"help": "new tokens held per layer before they are merged"})

    def __post_init__(self) -> None:
        #: Role in its pair (0 = shallower, 1 = deeper) of each merged layer, from the model.
        self.roles: dict[int, int] = {}
        super().__post_init__()

    def validate(self) -> None:
        if not 0.0 <= self.start < 1.0:
            raise MethodParameterError(f"minicache: start={self.start} must lie in [0, 1)")
        if not 0.0 < self.t < 1.0:
            raise MethodParameterError(f"minicache: t={self.t} must lie in (0, 1)")
        if self.retain:
            require_ratio(self, "retain")
        if self.residual < 1:
            raise MethodParameterError(f"minicache: residual={self.residual} must be >= 1")

    def check_model(self, model) -> None:
        self.roles = pair_roles(model.sliding_windows, self.start)
        if not self.roles:
            raise MethodParameterError(
                f"minicache: no adjacent full-attention layer pair from depth {self.start} on "
                f"({model.num_layers} layers); lower start"
            )

    verifies_at_once = True  # merging reads the stored tokens only

    def speculation_limit(self, layer) -> int | None:
        """The deeper layer of a pair merges both layers' tokens once it holds ``residual``: a speculative
        block ends on that token (the shallower layer has stored the whole block by then)."""
        if self.roles.get(layer.index) != 1:
            return None
        return max(1, self.residual - len(layer.store))

    def owns_layer(self, index: int) -> bool:
        return index in self.roles

    def layer_bytes(self, kept_tokens: int, model, element_bytes: int, layer) -> int | None:
        """Half of the pair's storage (directions -- KIVI-packed when kivi follows --, both layers'
        magnitudes, retained originals and their indices, positions), plus this layer's unmerged remainder."""
        if layer.index not in self.roles or kept_tokens < 1:
            return None
        heads, dim = model.num_kv_heads, model.head_dim
        quantizer = next((m for m in layer.methods if m.name == "kivi"), None)
        merged = kept_tokens // quantizer.group * quantizer.group if quantizer is not None else kept_tokens
        aligned = not layer.per_head
        if quantizer is not None:
            directions = packed_bytes(merged, heads, dim, quantizer.bits, quantizer.group, quantizer.key_mode)
        else:
            directions = merged * heads * 2 * dim * element_bytes
        if layer.evicted:
            directions += position_bytes(merged, 1 if aligned else heads)
        retained = math.ceil(self.retain * merged)
        pair = directions + heads * (4 * merged * element_bytes + retained * (4 * dim * element_bytes + 4))
        share = pair // 2 + (pair % 2 if self.roles[layer.index] == 0 else 0)
        return share + dense_bytes(kept_tokens - merged, heads, dim, element_bytes, layer.evicted)

    def after_attention(self, layer, step) -> None:
        if self.roles.get(layer.index) != 1:
            return  # not merged, or the shallower layer of a pair: the deeper one merges both
        first, store = layer.siblings[layer.index - 1], layer.store
        quantizer = next((m for m in layer.methods if m.name == "kivi"), None)
        unit = quantizer.group if quantizer is not None else 1
        count = len(store) // unit * unit
        if len(store) < self.residual and not step.is_prefill or count == 0:
            return
        other = first.store
        if len(other) != len(store) or not torch.equal(other.positions[..., :count], store.positions[..., :count]):
            return  # the two layers hold different tokens (layer-wise eviction): leave them unmerged
        pair = self._merge(other, store, count, quantizer, layer.dtype)
        views = layer.parts_of(MergedView)
        if views:
            views[0].pair.extend(pair)  # shared: the first layer's view sees the new tokens too
        else:
            first.add_part(MergedView(pair, role=0))
            layer.add_part(MergedView(pair, role=1))
        other.drop_oldest(count)
        store.drop_oldest(count)

    def _merge(self, first, second, count: int, quantizer, dtype) -> MergedPair:
        """Merge the oldest ``count`` tokens of two dense stores holding the same tokens."""
        directions, magnitudes, angles = [], [], None
        for name in ("keys", "values"):
            a, b = getattr(first, name)[:, :, :count], getattr(second, name)[:, :, :count]
            direction, norm_a, norm_b, angle = slerp_merge(a, b, self.t)
            directions.append(direction.to(dtype))
            magnitudes.append(torch.stack([norm_a, norm_b]))
            angles = angle if angles is None else angles  # retention is decided by the keys
        retained = math.ceil(self.retain * count)
        index = angles.masked_fill(~second.valid[:, :, :count], -1.0).topk(retained, dim=-1).indices.sort(-1).values
        gather = index[..., None].expand(-1, -1, -1, first.keys.shape[-1])
        originals = torch.stack([
            torch.stack([store.keys[:, :, :count].gather(2, gather), store.values[:, :, :count].gather(2, gather)])
            for store in (first, second)
        ])  # fmt: skip
        positions, valid = second.positions[:, :, :count], second.valid[:, :, :count]
        if quantizer is not None:
            direction = QuantizedKV.encode(
                directions[0], directions[1], positions, valid, quantizer.bits, quantizer.group, quantizer.key_mode
            )
        else:
            direction = PlainKV(directions[0], directions[1], TokenIndex.of(positions, valid))
        stacked = torch.stack(magnitudes, dim=1).to(dtype)  # [2 layers, 2 (K, V), B, H, T]
        return MergedPair(direction, stacked, index.to(torch.int32), originals.to(dtype), dtype)


def pair_roles(sliding_windows: tuple, start: float) -> dict[int, int]:
    """Layer index -> role (0 shallower, 1 deeper) for pairs ``(S, S+1), (S+2, S+3)...`` of full-attention layers."""
    layers = len(sliding_windows)
    roles: dict[int, int] = {}
    first = round(start * layers)
    while first + 1 < layers:
        if sliding_windows[first] is None and sliding_windows[first + 1] is None:
            roles[first], roles[first + 1] = 0, 1
            first += 2
        else:
            first += 1
    return roles
