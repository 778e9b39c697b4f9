"""A sequence's own tensors wait in its pool blocks between steps: packed exactly, their memory given up, restored
in place (views keep sharing), wherever the blocks are."""

import torch

from kvopt.engine.kv.at_rest import ALIGN, Packing, park, restore
from kvopt.engine.kv.paged import PagedKVPool
from kvopt.models.info import ModelInfo


def pool(blocks: int = 6) -> PagedKVPool:
    info = ModelInfo(num_layers=2, num_heads=4, num_kv_heads=2, head_dim=8)
    return PagedKVPool(info, blocks, 4, torch.float32, "cpu")


@torch.inference_mode()
def test_tensors_come_back_bit_for_bit_with_their_views_sharing_a_buffer():
    buffer = torch.randn(3, 40)
    view = buffer[:, 5:25]  # a part's view of a store's buffer: parked once, still a view afterwards
    codes = torch.randint(0, 255, (7, 3), dtype=torch.uint8)
    scale = torch.randn(5, dtype=torch.float16)[1:]  # an offset that is not a multiple of the alignment
    tensors = [buffer, view, codes, scale]
    expected = [t.clone() for t in tensors]
    packing = Packing.of(tensors + [view])  # the same tensor twice counts once
    assert packing.nbytes == sum(-(-n // ALIGN) * ALIGN for n in (3 * 40 * 4, 7 * 3, 5 * 2))
    target = pool()
    rows = target.chunk_rows([4, 1], -(-packing.nbytes // target.chunks.shape[1]))
    placements = park(packing, target.chunks, rows)
    assert all(t.numel() == 0 for t in tensors)  # their own memory is given up
    restore(placements, target.chunks, rows)
    for tensor, original in zip(tensors, expected):
        assert torch.equal(tensor, original)
    view.fill_(7.0)  # still a view of the buffer
    assert bool((buffer[:, 5:25] == 7.0).all())


@torch.inference_mode()
def test_chunks_are_the_blocks_own_bytes_and_others_stay_untouched():
    target = pool()
    rows = target.chunk_rows([2], target.chunks_per_block)
    tensor = torch.full((target.chunks_per_block * target.chunks.shape[1] // 4,), 3.0)
    park(Packing.of([tensor]), target.chunks, rows)
    for index, (keys, values) in enumerate(zip(target.keys, target.values)):
        for layer in (keys, values):
            assert bool((layer[:, 8:12] == 3.0).all())  # block 2's slots, in every layer and head
            assert not layer[:, :8].any() and not layer[:, 12:].any()
