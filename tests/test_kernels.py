"""The fused quantized decode kernel (kvopt.kernels) against the torch path it replaces on a GPU.

Without a GPU, Triton's interpreter runs the kernel on the CPU (``TRITON_INTERPRET=1``, set in conftest
before anything imports Triton), so CI checks the kernel's indexing and arithmetic; on a CUDA machine
the same tests run the compiled kernel on the device. The reference is :meth:`QuantizedKV.attend`'s
block-by-block path on the CPU: dequantize, softmax, weighted sum.
"""

from __future__ import annotations

import os

import pytest
import torch
from conftest import random_batch
from tiny_models import VOCAB, tiny_model

import kvopt
from kvopt import kernels
from kvopt.cache import quant
from kvopt.cache.attention import attention_with_lse, merge_with_lse
from kvopt.cache.quantized import QuantizedKV
from kvopt.engine import LLM, SamplingParams

pytest.importorskip("triton")
if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("Triton without a GPU needs TRITON_INTERPRET=1 before it is imported", allow_module_level=True)

from kvopt.kernels import quantized_attention  # noqa: E402

#: Where the kernel runs: compiled on a GPU, interpreted on the CPU.
DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")

#: (batch, KV heads, query heads per KV head, head dim, group, tokens): GQA groups of 1, 3 (the default model)
#: and 7 (Qwen2.5-0.5B), a head dim that is not a power of two, groups that do not split evenly.
SHAPES = [(2, 3, 3, 64, 32, 256), (1, 2, 7, 48, 16, 96), (1, 1, 1, 32, 32, 64), (3, 2, 2, 64, 64, 320)]


def encoded(shape, bits: int, key_mode: str, seed: int = 0) -> tuple[QuantizedKV, torch.Tensor]:
    batch, kv_heads, query_group, dim, group, tokens = shape
    generator = torch.Generator().manual_seed(seed)
    keys, values = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) for _ in range(2))
    keys[..., 3] *= 20  # an outlier channel, as real keys have
    positions = torch.arange(tokens).expand(batch, 1, tokens)
    valid = torch.ones(batch, 1, tokens, dtype=torch.bool)
    part = QuantizedKV.encode(keys, values, positions, valid, bits, group, key_mode)
    return part, torch.randn(batch, kv_heads * query_group, 1, dim, generator=generator)


def packed_on(part: QuantizedKV, device: torch.device) -> tuple[tuple, tuple]:
    """The part's packed keys and values, each ``(codes, scale, zero)``, on ``device``."""
    return tuple(tuple(t.to(device) for t in (p.codes, p.scale, p.zero)) for p in (part.keys, part.values))


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("key_mode", ["channel", "token"])
@pytest.mark.parametrize("bits", [2, 4, 8])
@pytest.mark.parametrize("splits", [3, None])
def test_fused_decode_equals_the_block_by_block_reference(shape, key_mode, bits, splits):
    part, query = encoded(shape, bits, key_mode)
    expected_output, expected_lse = part.attend(query, torch.tensor([shape[-1]]), 0.125)
    keys, values = packed_on(part, DEVICE)
    output, lse = quantized_attention.decode(query.to(DEVICE), keys, values, bits, shape[4], 0.125, splits=splits)
    torch.testing.assert_close(output.cpu().unsqueeze(2), expected_output, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().unsqueeze(2), expected_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("dense_tokens", [1, 37, 160])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_residual_is_read_in_the_same_launch_and_the_output_written_in_place(dense_tokens, dtype):
    """Codes plus a full-precision residual (a layer's decode step): the kernel's output, written into a strided
    view in the query's dtype, equals attention over both key sets merged through their lse."""
    shape = SHAPES[0]
    part, query = encoded(shape, 4, "channel")
    generator = torch.Generator().manual_seed(5)
    dense_keys, dense_values = (torch.randn(*shape[:2], dense_tokens, shape[3], generator=generator) for _ in range(2))
    dense_keys, dense_values, query = dense_keys.to(dtype), dense_values.to(dtype), query.to(dtype)
    expected, expected_lse = merge_with_lse([
        part.attend(query, torch.tensor([shape[-1] + dense_tokens]), 0.125),
        attention_with_lse(query, dense_keys.float(), dense_values.float(), None, 0.125),
    ])  # fmt: skip
    layer_output = torch.zeros(shape[0], 1, query.shape[1], shape[3], dtype=dtype, device=DEVICE)
    keys, values = packed_on(part, DEVICE)
    dense = (dense_keys.to(DEVICE), dense_values.to(DEVICE), None)
    output, lse = quantized_attention.decode(
        query.to(DEVICE), keys, values, 4, shape[4], 0.125, dense=dense, out=layer_output[:, 0]
    )
    assert output.data_ptr() == layer_output.data_ptr()
    tolerance = {"atol": 2e-5, "rtol": 1e-5} if dtype == torch.float32 else {"atol": 1e-2, "rtol": 1e-2}
    torch.testing.assert_close(layer_output.cpu().transpose(1, 2).float(), expected, **tolerance)
    torch.testing.assert_close(lse.cpu().unsqueeze(2), expected_lse, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize("per_head", [False, True])
def test_padding_gets_no_weight_in_the_codes_and_the_residual(per_head):
    """Left-padded rows (a batch of prompts of different lengths): padding tokens in the codes and in the residual
    are skipped, splits of padding only weigh nothing, and a row with no real token gets output 0, lse -inf."""
    batch, kv_heads, query_group, dim, group, tokens = 3, 2, 3, 64, 16, 160
    generator = torch.Generator().manual_seed(7)
    keys, values = (torch.randn(batch, kv_heads, tokens, dim, generator=generator) for _ in range(2))
    first_real = torch.tensor([0, 100, tokens])  # row 2: the codes are all padding
    valid = (torch.arange(tokens) >= first_real[:, None])[:, None].expand(batch, kv_heads if per_head else 1, -1)
    if per_head:
        valid = valid.clone()
        valid[0, 1, :40] = False  # heads of a row hold different tokens (head-wise methods)
    positions = torch.arange(tokens).expand(batch, 1, tokens)
    part = QuantizedKV.encode(keys, values, positions, valid, 2, group, "channel")
    dense_keys, dense_values = (torch.randn(batch, kv_heads, 9, dim, generator=generator) for _ in range(2))
    dense_valid = torch.ones(batch, 1, 9, dtype=torch.bool)
    dense_valid[2] = False  # ... and so is row 2's residual
    query = torch.randn(batch, kv_heads * query_group, 1, dim, generator=generator)
    expected, expected_lse = merge_with_lse([
        part.attend(query, torch.tensor([tokens + 9]), 0.125),
        attention_with_lse(query, dense_keys, dense_values, dense_valid[:, :, None, :], 0.125),
    ])  # fmt: skip
    packed_keys, packed_values = packed_on(part, DEVICE)
    dense = (dense_keys.to(DEVICE), dense_values.to(DEVICE), dense_valid.to(DEVICE))
    output, lse = quantized_attention.decode(
        query.to(DEVICE), packed_keys, packed_values, 2, group, 0.125, part.index.valid.to(DEVICE), dense, splits=4
    )
    torch.testing.assert_close(output.cpu().unsqueeze(2), expected, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().unsqueeze(2), expected_lse, atol=2e-5, rtol=1e-5)
    assert torch.isneginf(lse[2]).all() and not output[2].any()


def test_strided_codes_and_a_strided_query_are_read_in_place():
    """A range of token groups (views into a longer part) and a query that is a view into a wider tensor."""
    part, query = encoded(SHAPES[0], 2, "channel")
    first, last = 2, 7
    keys, values = part.dequantize(first * part.group, last * part.group, torch.float32)
    expected_output, expected_lse = attention_with_lse(query, keys, values, None, 0.125)
    ranges = [tuple(t.to(DEVICE) for t in (g.codes, g.scale, g.zero)) for g in (part.keys, part.values)]
    views = [tuple(t.narrow(2, first, last - first) for t in packed) for packed in ranges]
    assert not views[0][0].is_contiguous()
    wide = torch.zeros(*query.shape[:-1], 2 * query.shape[-1], device=DEVICE)
    wide[..., ::2] = query.to(DEVICE)
    output, lse = quantized_attention.decode(wide[..., ::2], *views, 2, part.group, 0.125)
    torch.testing.assert_close(output.cpu().unsqueeze(2), expected_output, atol=2e-5, rtol=1e-5)
    torch.testing.assert_close(lse.cpu().unsqueeze(2), expected_lse, atol=2e-5, rtol=1e-5)


def test_a_part_read_on_its_own_goes_through_the_kernel_when_it_serves(monkeypatch):
    """:meth:`QuantizedKV.attend` (a layer holding several parts) takes the kernel for one query per row."""
    part, query = encoded(SHAPES[1], 2, "token")
    position = torch.tensor([SHAPES[1][-1]])
    expected = part.attend(query, position, 0.125)
    keys, values = packed_on(part, DEVICE)
    sources = (part.keys, part.values)
    codes = [quant.QuantizedGroups(*packed, 2, source.dim) for packed, source in zip((keys, values), sources)]
    part = QuantizedKV(*codes, part.index, part.group, part.key_mode, part.dtype)
    query = query.to(DEVICE)
    monkeypatch.setattr(kernels, "fused_kernels_serve", lambda device: True)
    assert part.decodes_fused(query, position, None)
    assert not part.decodes_fused(query, position, 50.0)  # soft-capped logits: the torch path
    assert not part.decodes_fused(query, torch.tensor([[90], [95]]), None)  # rows at different positions
    fused = part.attend(query, position, 0.125)
    for got, want in zip(fused, expected):
        torch.testing.assert_close(got.cpu(), want, atol=2e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "spec", ["kivi:bits=2,residual=16,group=16", "snapkv:ratio=0.5+kivi:bits=4,residual=16,group=16"]
)
def test_the_engine_decodes_the_same_tokens_through_the_kernel(spec, monkeypatch):
    """The engine's compressed blocks (codes read from the block pool as one part per sequence) go through the
    kernel too; continuous batching of prompts of different lengths gives the torch path's tokens."""
    model = tiny_model("llama").to(DEVICE)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in (21, 40, 57)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    calls = []
    original = quantized_attention.decode

    def counted(*args, **kwargs):
        calls.append(1)
        return original(*args, **kwargs)

    def tokens(fused: bool) -> list[list[int]]:
        monkeypatch.setattr(kernels, "fused_kernels_serve", lambda device: fused)
        outputs = LLM(model, kv_method=spec, kv_memory="4MB").generate(prompts, params, use_tqdm=False)
        return [output.outputs[0].token_ids for output in outputs]

    monkeypatch.setattr(quantized_attention, "decode", counted)
    expected = tokens(False)
    assert not calls
    assert tokens(True) == expected and calls


def test_a_kernel_that_cannot_run_here_warns_once_and_reads_take_the_torch_path(monkeypatch):
    """An older GPU or Triton that cannot build or launch the kernel: the same tokens, one warning, and no later
    read tries the kernel again."""
    from triton.runtime.errors import OutOfResources

    model = tiny_model("llama").to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in random_batch([30, 30], seed=4))
    steps = {"max_new_tokens": 6, "min_new_tokens": 6, "do_sample": False}
    spec = "kivi:bits=2,residual=16,group=16"
    expected = model.generate(ids, attention_mask=mask, past_key_values=kvopt.cache(spec, model), **steps)
    attempts = []

    def cannot_launch(*args):
        attempts.append(1)
        raise OutOfResources(300_000, 232_448, "shared memory")

    monkeypatch.setattr(kernels, "_UNAVAILABLE", [])
    serves = kernels.fused_kernels_serve
    assert serves(torch.device("cuda")) == kernels.triton_installed()
    monkeypatch.setattr(kernels, "fused_kernels_serve", lambda device: serves(torch.device("cuda")))
    monkeypatch.setattr(quantized_attention, "_decode", cannot_launch)
    with pytest.warns(RuntimeWarning, match="cannot run on this machine.*torch path") as warned:
        got = model.generate(ids, attention_mask=mask, past_key_values=kvopt.cache(spec, model), **steps)
    assert torch.equal(got, expected)
    assert len(attempts) == 1 and len([w for w in warned if "fused GPU kernels" in str(w.message)]) == 1
    assert not serves(torch.device("cuda"))


def test_the_kernel_serves_gpus_with_triton_and_power_of_two_groups_of_whole_bytes(monkeypatch):
    assert not kernels.fused_kernels_serve(torch.device("cpu"))
    cuda = torch.device("cuda")
    assert kernels.quantized_decode_serves(cuda, 32, 2) == kernels.triton_installed()
    with kernels.disabled():
        assert not kernels.fused_kernels_serve(cuda)
    for off in ("0", "off", " False "):
        monkeypatch.setenv("KVOPT_FUSED_KERNELS", off)
        assert not kernels.fused_kernels_serve(cuda)
    monkeypatch.setenv("KVOPT_FUSED_KERNELS", "1")
    assert kernels.fused_kernels_serve(cuda) == kernels.triton_installed()
    assert not kernels.quantized_decode_serves(cuda, 24, 4)  # not a power of two
    assert not kernels.quantized_decode_serves(cuda, 2, 2)  # 2 codes of 2 bits: not a whole byte


@pytest.mark.parametrize(
    "spec", ["kivi:bits=2,residual=16,group=16", "kivi:bits=4,residual=16,group=16",
             "tokenquant:bits=4,group=16,residual=16", "mixedkv:high=4,low=2,salient=0.25,residual=16,group=16",
             "snapkv:ratio=0.5+kivi:bits=4,residual=16,group=16"],
)  # fmt: skip
@pytest.mark.parametrize("lengths", [[40, 40], [40, 23, 31]], ids=["one length", "left-padded"])
def test_generation_through_the_kernel_equals_the_torch_path(spec, lengths, monkeypatch):
    """A whole model decodes the same tokens (and nearly the same logits) when its quantized parts are read by
    the kernel, the layer's full-precision residual in the same launch: a batch of one length, and a batch of
    prompts of different lengths (left padding in the codes and the residual)."""
    model = tiny_model("llama").to(DEVICE)
    ids, mask = (t.to(DEVICE) for t in random_batch(lengths, seed=3))
    steps = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "output_logits": True,
             "return_dict_in_generate": True}  # fmt: skip

    original = quantized_attention.decode

    def run(fused: bool):
        calls = []

        def counted(query, keys, values, bits, group, scaling, code_valid=None, dense=None, out=None, splits=None):
            calls.append(dense is not None)
            return original(query, keys, values, bits, group, scaling, code_valid, dense, out, splits)

        monkeypatch.setattr(kernels, "fused_kernels_serve", lambda device: fused)
        monkeypatch.setattr(quantized_attention, "decode", counted)
        out = model.generate(ids, attention_mask=mask, past_key_values=kvopt.cache(spec, model), **steps)
        return out, calls

    reference, unfused_calls = run(False)
    fused, fused_calls = run(True)
    assert not unfused_calls and fused_calls
    assert all(fused_calls)  # each with the residual
    assert torch.equal(fused.sequences, reference.sequences)
    torch.testing.assert_close(torch.stack(fused.logits), torch.stack(reference.logits), atol=1e-4, rtol=1e-4)
