"""Cross-layer merged storage: two adjacent layers' tokens as one direction plus magnitudes (MiniCache).

For every token and KV head the pair stores one unit *direction* per K and V (shared by both
layers), each layer's *magnitudes*, and, for the tokens whose two layers disagree most, both
layers' original vectors ("retained", scattered back on reading). A layer reads its tokens as
``magnitude * direction`` -- one layer at a time, never the whole cache. The direction may be
quantized (``minicache+kivi``): it is then a :class:`~kvopt.cache.quantized.QuantizedKV`.
Each layer of the pair holds a :class:`MergedView` of the shared :class:`MergedPair`: its part.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvopt.cache.attention_math import attention_with_lse, visibility
from kvopt.cache.part import tensor_bytes
from kvopt.cache.positions import TokenIndex
from kvopt.cache.quantized import QuantizedKV


@dataclass
class PlainKV:
    """Unquantized keys/values ``[B, H, T, D]`` with the interface of :class:`QuantizedKV` used here."""

    keys: torch.Tensor
    values: torch.Tensor
    index: TokenIndex

    def __len__(self) -> int:
        return self.index.length

    def dequantize(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.keys, self.values

    def extend(self, other: PlainKV) -> None:
        self.keys = torch.cat([self.keys, other.keys], 2)
        self.values = torch.cat([self.values, other.values], 2)
        self.index = self.index.cat(other.index)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence (what nbytes counts)."""
        return [self.keys, self.values, *self.index.tensors()]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())


def slerp_merge(first: torch.Tensor, second: torch.Tensor, t: float) -> tuple[torch.Tensor, ...]:
    """SLERP of the unit vectors of ``first``/``second [..., D]``: ``(direction, |first|, |second|, angle / pi)``.

    Falls back to linear interpolation where the two are (anti)parallel; the direction is renormalized.
    """
    a, b = first.float(), second.float()
    norm_a, norm_b = a.norm(dim=-1), b.norm(dim=-1)
    unit_a = a / norm_a.clamp(min=1e-12)[..., None]
    unit_b = b / norm_b.clamp(min=1e-12)[..., None]
    cosine = (unit_a * unit_b).sum(dim=-1).clamp(-1.0, 1.0)
    angle = torch.acos(cosine)
    sine = torch.sin(angle)
    safe = sine > 1e-6
    weight_a = torch.where(safe, torch.sin((1 - t) * angle) / sine.clamp(min=1e-6), torch.full_like(sine, 1 - t))
    weight_b = torch.where(safe, torch.sin(t * angle) / sine.clamp(min=1e-6), torch.full_like(sine, t))
    direction = weight_a[..., None] * unit_a + weight_b[..., None] * unit_b
    direction = direction / direction.norm(dim=-1, keepdim=True).clamp(min=1e-12)
    return direction, norm_a, norm_b, angle / math.pi


@dataclass
class MergedPair:
    direction: PlainKV | QuantizedKV  # shared unit directions (keys, values)
    magnitudes: torch.Tensor  # [2 layers, 2 (K, V), B, H, T]
    retained_index: torch.Tensor  # [B, H, r] int32 slots
    retained: torch.Tensor  # [2 layers, 2 (K, V), B, H, r, D]
    dtype: torch.dtype

    def __len__(self) -> int:
        return len(self.direction)

    @property
    def index(self) -> TokenIndex:
        return self.direction.index

    def extend(self, other: MergedPair) -> None:
        offset = len(self)
        self.direction.extend(other.direction)
        self.magnitudes = torch.cat([self.magnitudes, other.magnitudes], -1)
        self.retained_index = torch.cat([self.retained_index, other.retained_index + offset], -1)
        self.retained = torch.cat([self.retained, other.retained], -2)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors held for the sequence, by both layers of the pair (what nbytes counts)."""
        return [*self.direction.tensors(), self.magnitudes, self.retained_index, self.retained]

    def nbytes(self) -> int:
        return tensor_bytes(self.tensors())

    def layer_kv(self, role: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values ``[B, H, T, D]`` of the pair's first (0) or second (1) layer."""
        keys, values = self.direction.dequantize()
        keys = keys.float() * self.magnitudes[role, 0].float()[..., None]
        values = values.float() * self.magnitudes[role, 1].float()[..., None]
        index = self.retained_index.long()[..., None].expand(-1, -1, -1, keys.shape[-1])
        keys.scatter_(2, index, self.retained[role, 0].float())
        values.scatter_(2, index, self.retained[role, 1].float())
        return keys.to(self.dtype), values.to(self.dtype)


@dataclass
class MergedView:
    """A :class:`~kvopt.cache.part.KVPart`: one layer's tokens in a pair it shares with a neighbour."""

    kind = "merged layers (minicache)"
    read_order = 2

    pair: MergedPair
    #: The layer's place in the pair: 0 (shallower) or 1 (deeper).
    role: int

    def layer_kv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """This layer's keys and values ``[B, H, T, D]``, rebuilt from the pair."""
        return self.pair.layer_kv(self.role)

    def attend(self, query, query_positions, scaling, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
        keys, values = self.layer_kv()
        mask = visibility(*self.pair.index.span(0, len(self.pair)), query_positions)
        return attention_with_lse(query, keys, values, mask, scaling, softcap)

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence: its pair's, which the pair's other layer's view holds too."""
        return self.pair.tensors()

    def nbytes(self) -> int:
        """Half the shared bytes (the first layer of the pair counts the odd byte), so a cache counts them once."""
        shared = tensor_bytes(self.tensors())
        return shared // 2 + (shared % 2 if self.role == 0 else 0)

    def valid_counts(self) -> torch.Tensor:
        return self.pair.index.valid_counts()
