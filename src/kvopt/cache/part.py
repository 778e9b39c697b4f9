"""The one interface of stored tokens: every kind of storage a layer reads is a :class:`KVPart`.

A layer's tokens live in a dense store that receives new tokens and in compact parts that
methods made from it: a ragged prefix (head-wise budgets), quantized parts, a view of a merged
layer pair. Attention runs over each part on its own and the results merge exactly through
their log-sum-exp (:func:`kvopt.cache.attention_math.merge_with_lse`), so the layer never needs to
know what a part is: it asks each one to attend, to count its bytes and its real tokens.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import ClassVar, Protocol, runtime_checkable

import torch


def tensor_bytes(tensors: Iterable[torch.Tensor]) -> int:
    """Bytes of ``tensors`` (each counted whole: a view counts its own elements)."""
    return sum(t.numel() * t.element_size() for t in tensors)


@runtime_checkable
class KVPart(Protocol):
    """Stored tokens of one layer that attention can read on their own.

    Optional hook: ``attend_with_dense(query, query_positions, scaling, softcap, dense)`` for a part that can
    read the layer's dense store (a :class:`~kvopt.cache.storage.DenseKVStore`, its keys as attention reads them)
    together with itself in one call, returning the layer's output ``[B, q, H_q, D]`` or None when it does not
    serve that read (see ``QuantizedKV``).
    """

    #: What the part holds and which methods make it, for error messages ("quantized tokens (kivi, ...)").
    kind: ClassVar[str]
    #: Where attention merges this part among a layer's parts (lower first). Fixed per kind, so the
    #: floating-point result does not depend on which method made a part first.
    read_order: ClassVar[int]

    def attend(
        self, query: torch.Tensor, query_positions: torch.Tensor, scaling: float, softcap: float | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Attention of ``query [B, H_q, q, D]`` at sequence indices ``query_positions [q]`` over the part's tokens:
        ``(output [B, H_q, q, D], lse [B, H_q, q])`` in fp32 (a query that sees none of them: lse -inf)."""
        ...

    def tensors(self) -> list[torch.Tensor]:
        """The tensors this part holds for its sequence (what nbytes counts): never per-model tables shared by
        all sequences (calibration codecs, RoPE tables, cached byte tables)."""
        ...

    def nbytes(self) -> int:
        """Bytes of the tensors the part holds (:meth:`tensors`)."""
        ...

    def valid_counts(self) -> torch.Tensor:
        """Real (non-padding) tokens held per batch row, ``[batch]`` (on KV head 0)."""
        ...
