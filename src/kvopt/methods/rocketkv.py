"""``rocketkv``: SnapKV eviction at the prefill, then hybrid sparse attention at every decode step.

RocketKV (Behnam et al., arXiv 2502.14051, ICML'25): decoding is bound by reading the KV cache.
Permanent eviction alone loses accuracy at small budgets, and dynamic top-k selection alone
still stores everything, so RocketKV does both. ``budget`` is the token budget B, the KV traffic
of one decode step; the official ``get_params_for_token_budget`` splits it, for a prompt of n
tokens, with ``c = n / B``::

    capacity = n / c^r,  r = min(0.2 + 0.06 log2 c, 0.8)      (tokens stage 1 keeps)
    c2 = capacity / B;  chunk = min(floor c2, ceil sqrt c2);  channels = round(d chunk / c2);  top-k = B / 2

Stage 1 is SnapKV's selection (inherited: observation window 32, max pooling with kernel 63,
per KV head; scores summed over the group in the paper, averaged here: the same ranking), down
to ``capacity`` tokens. Stage 2 is :class:`~kvopt.cache.sparse.SparseKV`: per chunk of ``chunk``
kept tokens, the element-wise min and max of the keys; each step, the ``channels`` largest
``|q|`` channels of the GQA group read one bound per chunk (max where the group's query is
positive), an approximate softmax ranks the tokens, and the ``top-k`` are attended exactly.
The summaries cost ``2 / chunk`` of the keys' bytes (counted by ``nbytes``) and each step
reads ``1 / c2`` of the key bytes from them.

``ratio`` is the fraction of the prompt stage 1 removes (kvpress's convention, as elsewhere);
stage 2 then uses the token budget that the paper's split pairs with that capacity,
``B = n / c`` with ``log2 c`` solving ``r(c) log2 c = log2 (1 / (1 - ratio))``.

Deviations:

* Decoded tokens go to the dense store and are always attended exactly (the paper's top-k
  also ranks them): decoded tokens come on top of the prompt's share, kvopt's convention for
  prefill-time methods, and the stage-1 capacity does not subtract ``max_new_tokens``
  (unknown when the cache is built). For generations much shorter than the prompt the KV
  traffic is the paper's.
* Stage 2 attends to whole chunks: ``ceil(top-k / chunk)`` of them (the paper's token-level top-k cuts the
  last chunk, whose tokens share one score, anywhere: up to ``chunk - 1`` tokens fewer), plus the
  ``capacity % chunk`` newest prompt tokens no whole chunk holds (always read; the paper's last chunk
  is shorter). Ties in the approximate scores break toward earlier chunks.
* A budget covering the whole prompt (``c2 = 1``) attends exactly to everything (the code would
  still take the top ``B / 2`` by exact scores).
* Queries of a multi-token forward after the prefill (a second prompt chunk) attend to all
  tokens, as the paper's prefill does. Sliding-window layers keep stage 1 only.
* Composition with quantization: ``rocketkv+tokenquant:bits=4`` stores the kept tokens quantized per
  token (each key and value in ``bits`` per element, an fp16 scale and zero-point per group of channels),
  and each step dequantizes only the tokens it attends to; the chunk summaries come from the keys
  before quantization, in fp16. ``rocketkv+kivi`` is refused: KIVI's per-channel key groups span
  tokens, so stage 2 could not read its chunks on their own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from kvopt.cache.quant import PARAM_DTYPE
from kvopt.cache.sparse import Quantizer, SparseKV, SparseSplit
from kvopt.cache.storage import DenseKVStore
from kvopt.methods.base import register
from kvopt.methods.quantization import dense_bytes, packed_bytes, position_bytes
from kvopt.methods.snapkv import SnapKV
from kvopt.methods.spec import ADOPTS


def capacity_for(prompt: int, budget: int) -> int:
    """Tokens stage 1 keeps of a ``prompt``-token prompt under token budget ``budget`` (the paper's split)."""
    ratio = prompt / min(prompt, budget)
    exponent = min(0.2 + 0.06 * math.log2(ratio), 0.8)
    return max(1, int(prompt / ratio**exponent))


def ratio_c2(ratio: float) -> float:
    """Stage 2's compression ``capacity / B`` for a stage 1 that removes ``ratio`` of the prompt.

    Inverts the split: ``n / capacity = c^r(c)`` with ``x = log2 c`` gives ``0.06 x^2 + 0.2 x = L``
    (``L = log2 (n / capacity)``) while ``r < 0.8``, else ``0.8 x = L``; then ``c2 = c capacity / n``.
    """
    kept_log = math.log2(1 / (1 - ratio))
    x = (-0.2 + math.sqrt(0.04 + 0.24 * kept_log)) / 0.12
    if x >= 10:  # r reached its cap of 0.8
        x = kept_log / 0.8
    return max(1.0, (1 - ratio) * 2**x)


def stage_two(capacity: int, c2: float, head_dim: int) -> SparseSplit:
    """The paper's stage-2 settings for ``capacity`` kept tokens at compression ``c2 = capacity / B``."""
    if c2 <= 1:
        return SparseSplit(chunk=1, channels=head_dim, topk=capacity)
    chunk = min(math.floor(c2), math.ceil(math.sqrt(c2)))
    channels = min(head_dim, max(1, round(head_dim * chunk / c2)))
    return SparseSplit(chunk, channels, topk=max(1, min(round(capacity / c2 / 2), capacity)))


@register
@dataclass
class RocketKV(SnapKV):
    """SnapKV down to the paper's capacity, then exact attention over an approximate top-k per step."""

    name = "rocketkv"
    summary = "SnapKV eviction + per-step top-k sparse attention from min/max key summaries (RocketKV)"
    budget_convention = (
        "budget = token budget B (KV traffic per step; stage 1 keeps the paper's capacity), or ratio = fraction "
        "of the prompt stage 1 removes"
    )
    #: The survivors move into sparse-attention storage (see :func:`kvopt.methods.spec.storage`).
    storage = "sparse"
    runs_in_engine = False  # stage 2 reads its own part (chunk summaries, per-row splits), not paged blocks

    window: int = field(default=32, metadata={"help": "stage 1: observation window (last prompt tokens), always kept"})
    kernel: int = field(default=63, metadata={"help": "stage 1: pooling kernel over tokens"})
    pooling: str = field(default="max", metadata={"help": "stage 1: avg or max"})

    def c2(self, capacity: int) -> float:
        """Stage 2's compression ``capacity / B`` for a sequence whose stage 1 kept ``capacity`` tokens."""
        return ratio_c2(self.ratio) if self.ratio is not None else max(1.0, capacity / self.budget)

    def split(self, capacity: int, head_dim: int) -> SparseSplit:
        """Stage 2's settings for a sequence whose stage 1 kept ``capacity`` tokens."""
        return stage_two(capacity, self.c2(capacity), head_dim)

    def kept_tokens(self, seen_tokens: int) -> int:
        if self.ratio is not None or seen_tokens == 0:
            return super().kept_tokens(seen_tokens)
        return capacity_for(seen_tokens, self.budget)

    def targets(self, layer, step) -> torch.Tensor:
        """Per row, the capacity of its prompt; its stage-2 split is kept in ``layer.state``."""
        key = f"{self.name}.capacity"
        if step.is_prefill or key not in layer.state:
            real = layer.store.valid[:, 0].sum(dim=-1)
            capacities = [self.kept_tokens(int(n)) for n in real]
            head_dim = layer.store.keys.shape[-1]
            layer.state[f"{self.name}.splits"] = [self.split(c, head_dim) for c in capacities]
            layer.state[key] = torch.tensor(capacities, dtype=real.dtype, device=real.device)
        return layer.state[key]

    def after_attention(self, layer, step) -> None:
        if not step.is_prefill:
            return
        super().after_attention(layer, step)  # stage 1: evict in the dense store
        splits = layer.state[f"{self.name}.splits"]
        capacities = layer.state[f"{self.name}.capacity"].tolist()
        if layer.sliding_window is not None or not any(s.skips_tokens_of(c) for s, c in zip(splits, capacities)):
            return  # nothing for stage 2 to skip: the tokens stay dense and are read whole
        store = layer.store
        quantizer = adopted_quantizer(layer.methods)
        layer.add_part(SparseKV.gather(store.keys, store.values, store.positions, store.valid, splits, quantizer))
        layer.store = DenseKVStore()

    def layer_bytes(self, kept_tokens: int, model, element_bytes: int, layer) -> int | None:
        """Keys and values with per-head positions (quantized per token when a quantizer follows), plus the
        min/max key summaries per chunk (fp16 when quantized)."""
        split = self.split(kept_tokens, model.head_dim)
        heads, dim = model.num_kv_heads, model.head_dim
        quantizer = self.rows_quantizer(kept_tokens, model, layer)
        if quantizer is None:
            stored = dense_bytes(kept_tokens, heads, dim, element_bytes, evicted=True)
        else:
            packed = packed_bytes(kept_tokens, heads, dim, quantizer.bits, quantizer.group, "token")
            stored, element_bytes = packed + position_bytes(kept_tokens, heads), PARAM_DTYPE.itemsize
        chunks = kept_tokens // split.chunk  # whole chunks (the newest remainder is always read)
        if split.chunk == 1 or -(-split.topk // split.chunk) >= chunks:
            return stored
        return stored + 2 * chunks * heads * dim * element_bytes

    def stores_quantized(self, quantizer, kept_tokens: int, model, layer) -> bool:
        """The kept tokens of a layer stage 2 reads sparsely are quantized here, in tokenquant's per-token layout."""
        return quantizer.name in ADOPTS["sparse"] and self.rows_quantizer(kept_tokens, model, layer) is not None

    def rows_quantizer(self, kept_tokens: int, model, layer) -> Quantizer | None:
        """How a layer's sparse rows quantize its ``kept_tokens``: the following quantizer's settings where stage
        2 reads the layer sparsely, None where its tokens stay dense (read whole) or no quantizer follows."""
        read_sparsely = self.split(kept_tokens, model.head_dim).skips_tokens_of(kept_tokens)
        return adopted_quantizer(layer.methods) if read_sparsely else None


def adopted_quantizer(methods) -> Quantizer | None:
    """The settings of the quantizer that follows rocketkv in a spec (``rocketkv+tokenquant:bits=4``), if any."""
    found = next((m for m in methods if m.name in ADOPTS["sparse"]), None)
    return None if found is None else Quantizer(found.bits, found.group)
