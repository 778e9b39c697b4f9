"""kivi: packing, the quantizer against a slow reference, attention on packed data, bytes, composition."""

import math

import pytest
import torch

import kvopt
from kvopt.cache import quant
from kvopt.cache import quantized
from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError
from kvopt.methods import parse

from conftest import random_batch
from tiny_models import VOCAB, tiny_model


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_packing_round_trips_exactly_and_really_packs(bits):
    codes = torch.randint(0, 1 << bits, (3, 5, 64), dtype=torch.uint8, generator=torch.Generator().manual_seed(bits))
    packed = quant.pack(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(quant.unpack(packed, bits), codes)


def reference_quantize(x: torch.Tensor, bits: int, group: int) -> torch.Tensor:
    """Loop over groups: fp16 zero = min, fp16 scale = range / (2^b - 1), round to nearest; returns x^."""
    out = torch.empty_like(x)
    rows = x.reshape(-1, x.shape[-1])
    flat = out.view(-1, x.shape[-1])
    levels = 2**bits - 1
    for r in range(rows.shape[0]):
        for g in range(0, rows.shape[1], group):
            chunk = rows[r, g : g + group]
            low, high = chunk.min().item(), chunk.max().item()
            scale = torch.tensor((high - low) / levels if high > low else 1.0).half().float().item()
            zero = torch.tensor(low).half().float().item()
            for i, value in enumerate(chunk.tolist()):
                code = min(max(round((value - zero) / scale), 0), levels)
                flat[r, g + i] = code * scale + zero
    return out


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_quantizer_matches_the_reference_and_its_error_bound(bits):
    x = torch.randn(2, 3, 64, generator=torch.Generator().manual_seed(0)) * 3
    x[0, 0, 5] = 40.0  # an outlier widens only its own group
    q = quant.quantize(x.reshape(2, 3, 2, 32), bits)  # groups of 32 along the last axis
    got = quant.dequantize(q).reshape(2, 3, 64)
    expected = reference_quantize(x, bits, 32)
    assert (got - expected).abs().max().item() <= 1e-5
    step = q.scale.float().expand(2, 3, 2, 32).reshape(2, 3, 64)
    assert ((got - x).abs() <= step / 2 + 1e-2 * step + 1e-3).all()
    assert q.codes.numel() == x.numel() * bits // 8 and q.scale.dtype == torch.float16


def test_padding_stays_out_of_the_key_ranges():
    x = torch.randn(1, 1, 32)
    x[..., :4] = 1000.0  # padding slots with wild values
    ignore = torch.zeros(1, 1, 32, dtype=torch.bool)
    ignore[..., :4] = True
    q = quant.quantize(x, 4, ignore=ignore)
    got = quant.dequantize(q)
    assert (got[..., 4:] - x[..., 4:]).abs().max() <= q.scale.float().max() / 2 + 1e-3


def reference_attention(query, keys, values, mask, scale):
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)
    scores = query @ keys.transpose(-1, -2) * scale
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1) @ values


@pytest.mark.parametrize("bits", [2, 4, 8])
def test_attention_on_packed_storage_equals_attention_on_dequantized_tensors(bits, monkeypatch):
    monkeypatch.setattr(quantized, "BLOCK_ELEMENTS", 64 * 2 * 2 * 16)  # blocks of 64 tokens: several
    generator = torch.Generator().manual_seed(1)
    keys, values = torch.randn(2, 2, 192, 16, generator=generator), torch.randn(2, 2, 192, 16, generator=generator)
    positions = torch.arange(192, dtype=torch.int32).expand(2, 2, -1).clone()
    valid = torch.ones(2, 2, 192, dtype=torch.bool)
    valid[1, :, :40] = False  # row 1 is left-padded
    stored = QuantizedKV.encode(keys, values, positions, valid, bits, 32)
    query = torch.randn(2, 4, 3, 16, generator=generator)
    query_positions = torch.tensor([189, 190, 191])
    output, _ = stored.attend(query, query_positions, 0.25)
    dense_keys, dense_values = stored.dequantize()
    mask = (positions[:, :1, None, :] <= query_positions[:, None]) & valid[:, :1, None, :]
    expected = reference_attention(query, dense_keys, dense_values, mask, 0.25)
    assert (output - expected).abs().max().item() <= 1e-4
    assert stored.positions.shape[1] == 1  # heads hold the same tokens: one position row


def test_kivi_equals_full_while_everything_fits_in_the_residual():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 40))
    logits = []
    for spec in ("full", "kivi:bits=2,residual=64"):
        cache = kvopt.cache(spec, model)
        with torch.no_grad():
            logits.append(model(ids, past_key_values=cache).logits)
        assert all(not layer.parts_of(QuantizedKV) for layer in cache.layers)
    assert torch.equal(logits[0], logits[1])


def test_kivi_holds_the_bytes_its_layout_predicts_and_fewer_with_fewer_bits():
    model = tiny_model("llama")
    config = model.config
    ids = torch.randint(3, VOCAB, (1, 300))
    full = kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=full)
    held = {}
    for bits in (8, 4, 2):
        cache = kvopt.cache(f"kivi:bits={bits},group=32,residual=64", model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        layer = cache.layers[0]
        quantized = 300 // 32 * 32  # every whole group, once 64 tokens are held
        (part,) = layer.parts_of(QuantizedKV)
        assert len(part) == quantized and len(layer.store) == 300 - quantized
        heads, dim = config.num_key_value_heads, config.head_dim
        codes = 2 * quantized * heads * dim * bits // 8
        params = quantized * heads * dim // 32 * 2 * 2 + quantized * heads * math.ceil(dim / min(32, dim)) * 2 * 2
        assert part.nbytes() == codes + params  # positions are a run: no bytes per token
        held[bits] = cache.nbytes()
    assert held[2] < held[4] < held[8] < full.nbytes()


def test_kivi_stays_close_to_full_and_decodes_past_group_boundaries():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 90))
    caches = {spec: kvopt.cache(spec, model) for spec in ("full", "kivi:bits=8,residual=16", "kivi:bits=2,residual=16")}
    steps = {spec: [] for spec in caches}
    with torch.no_grad():
        for spec, cache in caches.items():
            model(ids, past_key_values=cache)
            for t in range(40):  # crosses a 32-token flush
                steps[spec].append(model(torch.tensor([[5 + t]]), past_key_values=cache).logits[0, -1])
    full = torch.stack(steps["full"])
    error8 = (torch.stack(steps["kivi:bits=8,residual=16"]) - full).abs().max().item()
    error2 = (torch.stack(steps["kivi:bits=2,residual=16"]) - full).abs().max().item()
    assert error8 < 2e-2 and error8 < error2
    assert len(caches["kivi:bits=8,residual=16"].layers[0].parts_of(QuantizedKV)[0]) == 128  # 130 tokens: 4 whole groups


def test_kivi_batches_with_left_padding_count_only_real_tokens():
    model = tiny_model("llama")
    ids, mask = random_batch([70, 45])
    cache = kvopt.cache("kivi:bits=4,residual=8", model)
    with torch.no_grad():
        logits = model(ids, attention_mask=mask, past_key_values=cache).logits
    assert torch.isfinite(logits).all()
    assert cache.layers[0].kept_per_row().tolist() == [70, 45]


def test_kivi_composes_after_prefill_eviction_and_rejects_decode_eviction_after_it():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 256))
    bytes_of = {}
    for spec in ("full", "snapkv:ratio=0.75", "snapkv:ratio=0.75+kivi:bits=4,residual=16"):
        cache = kvopt.cache(spec, model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            model(torch.tensor([[7]]), past_key_values=cache)
        bytes_of[spec] = cache.nbytes()
    assert bytes_of["snapkv:ratio=0.75+kivi:bits=4,residual=16"] < bytes_of["snapkv:ratio=0.75"] < bytes_of["full"]
    with pytest.raises(MethodParameterError, match="evicts while decoding"):  # refused before any forward
        kvopt.cache("tova:budget=100+kivi:bits=4,residual=16", model)


def test_kivi_runs_under_generate():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 70))
    cache = kvopt.cache("kivi:bits=4,residual=16", model)
    out = model.generate(ids, past_key_values=cache, max_new_tokens=8, do_sample=False)
    assert out.shape[1] == 78 and cache.layers[0].parts_of(QuantizedKV)


@pytest.mark.parametrize(
    "spec, fragment",
    [("kivi:bits=3", "bits=3 is not supported"), ("kivi:group=12", "multiple of 8"), ("kivi:residual=-1", ">= 0")],
)
def test_bad_kivi_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)


@pytest.mark.parametrize(
    "spec",
    [
        "kivi:bits=2", "kivi:bits=4", "kivi:bits=8", "snapkv:ratio=0.75+kivi:bits=4", "tokenquant:bits=8",
        "tokenquant:bits=4,group=32", "mixedkv:high=8,low=2,salient=0.2",
    ],
)
def test_theoretical_size_matches_the_measured_bytes_within_two_percent(spec):
    """`kvopt memory --method` counts codes, scales, zero-points, positions and the residual."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from kvopt.memory import estimate
    from kvopt.models.info import ModelInfo

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, VOCAB, (1, 4000))
    cache = kvopt.cache(spec, model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    info = ModelInfo.from_config(config)
    theoretical = estimate(info, 4000, methods=parse(spec), dtype=torch.float32).total_bytes
    assert abs(cache.nbytes() / theoretical - 1) <= 0.02


def test_tokenquant_quantizes_each_token_on_its_own():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 100))
    cache = kvopt.cache("tokenquant:bits=4,group=16,residual=20", model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    layer = cache.layers[0]
    (part,) = layer.parts_of(QuantizedKV)
    keys, _ = part.dequantize()
    # Reference: each stored token's key, quantized alone in groups of 16 channels.
    direct = kvopt.cache("full", model)
    with torch.no_grad():
        model(ids, past_key_values=direct)
    original = direct.layers[0].store.keys[:, :, : len(part)]
    expected = reference_quantize(original, 4, 16)
    assert (keys - expected).abs().max().item() <= 1e-5
    scale = part.keys.scale
    assert scale.shape[2] * scale.shape[3] == len(part)  # a scale per token (and channel group), not per token group
