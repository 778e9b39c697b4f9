"""A sequence's own tensors kept in its pool blocks between steps, and brought back for the next one.

The pool's bytes are cut into *chunks*: ``block_size`` slots of one KV head of one layer, in
the key or the value pool (a block is ``2 x layers x kv_heads`` chunks). Between two steps the
tensors a cache's storage parts own (:meth:`~kvopt.cache.part.KVPart.tensors`) are packed into
the chunks of the sequence's blocks, in block-table order, and their own memory is given up
(each tensor keeps its Python identity, so every part, view and layer that holds it still does);
before the next step one gather brings the bytes back into a single buffer and each tensor is
pointed at its place in it (``Tensor.set_``: no per-tensor copies). So what the pool's budget
counts is where those bytes really are; swapping the blocks out and in moves them like any other.

Packing unit is the byte range of each storage that its tensors use (views of one buffer keep
sharing it, gaps no tensor reads are dropped), aligned to 64 bytes.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ALIGN = 64


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one tensor sits in the packed bytes: its byte offset there, its shape and strides."""

    tensor: torch.Tensor
    offset: int
    size: torch.Size
    stride: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Packing:
    """How a set of tensors packs: byte ranges of their storages and each tensor's place."""

    #: ``(storage, first byte, end byte, offset in the packed bytes)`` of each range copied.
    ranges: list[tuple[torch.UntypedStorage, int, int, int]]
    placements: list[Placement]
    #: Packed bytes, alignment included.
    nbytes: int

    @classmethod
    def of(cls, tensors: list[torch.Tensor]) -> Packing:
        by_storage: dict[int, list[torch.Tensor]] = {}
        for tensor in {id(t): t for t in tensors}.values():
            by_storage.setdefault(tensor.untyped_storage().data_ptr(), []).append(tensor)
        ranges, placements, packed = [], [], 0
        for group in by_storage.values():
            spans = sorted((_byte_span(t), index) for index, t in enumerate(group))
            merged: list[list[int]] = []  # [first, end] of overlapping or touching spans
            where: list[int] = [0] * len(group)
            for (first, end), index in spans:
                first = first // ALIGN * ALIGN
                if merged and first <= merged[-1][1]:
                    merged[-1][1] = max(merged[-1][1], end)
                else:
                    merged.append([first, end])
                where[index] = len(merged) - 1
            offsets = []
            for first, end in merged:
                offsets.append(packed)
                ranges.append((group[0].untyped_storage(), first, end, packed))
                packed += -(-(end - first) // ALIGN) * ALIGN
            for index, tensor in enumerate(group):
                first = merged[where[index]][0]
                start = tensor.storage_offset() * tensor.element_size()
                offset = offsets[where[index]] + start - first
                placements.append(Placement(tensor, offset, tensor.size(), tensor.stride()))
        return cls(ranges, placements, packed)


def _byte_span(tensor: torch.Tensor) -> tuple[int, int]:
    """``(first, end)`` bytes of its storage that ``tensor`` reads."""
    first = tensor.storage_offset() * tensor.element_size()
    if tensor.numel() == 0:
        return first, first
    extent = sum((size - 1) * stride for size, stride in zip(tensor.size(), tensor.stride())) + 1
    return first, first + extent * tensor.element_size()


def park(packing: Packing, chunks: torch.Tensor, rows: torch.Tensor) -> list[Placement]:
    """Copy ``packing``'s bytes into ``rows`` of the pool's ``chunks [rows, chunk bytes]`` (uint8), then let each
    tensor give up its memory (it is empty until :func:`restore`); returns where each one is."""
    chunk_bytes = chunks.shape[1]
    buffer = torch.zeros(rows.numel() * chunk_bytes, dtype=torch.uint8, device=chunks.device)
    for storage, first, end, offset in packing.ranges:
        source = torch.empty(0, dtype=torch.uint8, device=chunks.device).set_(storage, first, (end - first,))
        buffer[offset : offset + end - first] = source
    chunks.index_copy_(0, rows, buffer.view(-1, chunk_bytes))
    for placement in packing.placements:
        placement.tensor.set_(torch.empty(0, dtype=placement.tensor.dtype, device=chunks.device))
    return packing.placements


def restore(placements: list[Placement], chunks: torch.Tensor, rows: torch.Tensor) -> None:
    """Bring the bytes :func:`park` put in ``rows`` back into one buffer and point each tensor at its place."""
    storage = chunks.index_select(0, rows).untyped_storage()
    for placement in placements:
        tensor = placement.tensor
        tensor.set_(storage, placement.offset // tensor.element_size(), placement.size, placement.stride)
