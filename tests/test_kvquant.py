"""kvquant: non-uniform dense-and-sparse codes, pre-RoPE keys, calibration, bytes and composition."""

import math

import pytest
import torch
from tiny_models import VOCAB, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

import kvopt
from kvopt.cache import prerope
from kvopt.cache.nonuniform import (
    LayerCodec,
    NonUniformKV,
    decode_keys,
    decode_values,
    encode_keys,
    encode_values,
    pack_codes,
    unpack_codes,
)
from kvopt.cache.positions import TokenIndex
from kvopt.errors import CacheUsageError, MethodParameterError
from kvopt.methods import parse
from kvopt.methods.nuq_calibration import capture
from kvopt.methods.recording import record_prefill

SMALL = "kvquant:bits=2,residual=16,group=16,calibration=96"
AQUA = SMALL.replace("kvquant", "aquakv")


def fitted(spec: str, model, seed: int = 0):
    """``spec``'s methods, calibrated on random token ids (tiny models have no tokenizer)."""
    methods = parse(spec)
    generator = torch.Generator().manual_seed(seed)
    for method in methods:
        if hasattr(method, "fit"):
            method.fit(model, torch.randint(3, VOCAB, (1, method.calibration), generator=generator))
    return methods


def random_codec(bits: int, sparse: int, heads: int = 2, dim: int = 16) -> LayerCodec:
    generator = torch.Generator().manual_seed(bits)
    levels = lambda: torch.rand(1 << bits, generator=generator).mul(2).sub(1).sort().values
    center = torch.randn(heads, dim, generator=generator)
    half = torch.rand(heads, dim, generator=generator) + 0.5
    return LayerCodec(bits, sparse, sparse, levels(), levels(), center, half)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_codes_pack_into_bits_per_code_and_round_trip(bits):
    codes = torch.randint(0, 1 << bits, (2, 3, 5, 64))
    packed = pack_codes(codes, bits)
    assert packed.dtype == torch.uint8 and packed.shape[-1] == 64 * bits // 8
    assert torch.equal(unpack_codes(packed, bits), codes)


def reference_vector(x, levels, sparse):
    """Slow, obviously right: keep the ``sparse`` largest |x| exactly, round the rest (clamped) to the nearest level."""
    out = []
    exact = set(sorted(range(len(x)), key=lambda i: -abs(float(x[i])))[:sparse])
    for i, value in enumerate(x.tolist()):
        if i in exact:
            out.append(value)
        else:
            clamped = min(max(value, -1.0), 1.0)
            out.append(min(levels.tolist(), key=lambda level: (abs(level - clamped), level)))
    return torch.tensor(out)


@pytest.mark.parametrize("bits, sparse", [(2, 1), (3, 2), (4, 0)])
def test_key_quantizer_matches_a_slow_reference(bits, sparse):
    codec = random_codec(bits, sparse)
    keys = torch.randn(1, 2, 6, 16) * 2
    decoded = decode_keys(encode_keys(keys, codec, group=3), codec)
    for head in range(2):
        for first in (0, 3):  # per channel over each group of 3 tokens
            group = keys[0, head, first : first + 3]
            calibrated = (group - codec.key_center[head]) / codec.key_half[head]
            outlier = torch.zeros(3, 16, dtype=torch.bool)
            for token in range(3):
                if sparse:
                    outlier[token, calibrated[token].abs().topk(sparse).indices] = True
            for channel in range(16):
                kept = [group[t, channel].item() for t in range(3) if not outlier[t, channel]]
                low, high = (min(kept), max(kept)) if kept else (0.0, 0.0)
                # the range's ends, rounded outward to 255 steps of the envelope: 2 calibrated half-ranges each side
                calibrated_center, calibrated_half = codec.key_center[head, channel], codec.key_half[head, channel]
                start, step = calibrated_center - 2 * calibrated_half, 4 * calibrated_half / 255
                low_code = min(max(math.floor((low - start) / step), 0), 255)
                high_code = max(min(max(math.ceil((high - start) / step), 0), 255), low_code)
                low, high = start + low_code * step, start + high_code * step
                center, half = (high + low) / 2, (high - low) / 2
                for token in range(3):
                    value = group[token, channel]
                    if outlier[token, channel]:
                        expected = value.half().float()  # outliers are stored in fp16
                    else:
                        scaled = (value - center) / (half if half > 0 else 1)
                        level = reference_vector(scaled[None], codec.key_levels, 0)[0]
                        expected = level * half + center
                    torch.testing.assert_close(decoded[0, head, first + token, channel], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("bits, sparse", [(2, 1), (3, 2), (4, 0)])
def test_value_quantizer_matches_a_slow_reference(bits, sparse):
    codec = random_codec(bits, sparse)
    values = torch.randn(1, 2, 6, 16)
    values[0, 0, 0, 3] = 40.0  # an outlier that would otherwise stretch its token's range
    decoded = decode_values(encode_values(values, codec), codec)
    for head in range(2):
        for token in range(6):
            vector = values[0, head, token]
            exact = (vector - vector.mean()).abs().topk(sparse).indices if sparse else torch.tensor([], dtype=torch.long)
            rest = torch.ones(16, dtype=torch.bool)
            rest[exact] = False
            low, high = vector[rest].min().half().float(), vector[rest].max().half().float()  # fp16 ends
            center, half = (high + low) / 2, (high - low) / 2
            expected = reference_vector((vector - center) / half, codec.value_levels, 0) * half + center
            expected[exact] = vector[exact].half().float()
            torch.testing.assert_close(decoded[0, head, token], expected, atol=1e-4, rtol=1e-4)
    if sparse:
        assert abs(decoded[0, 0, 0, 3].item() - 40.0) < 0.05  # kept exactly (fp16)


ROPE_CONFIGS = {
    "default": {},
    "llama3": {
        "rope_parameters": {
            "rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 64,
        }
    },
    "yarn": {"rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                 "original_max_position_embeddings": 128}},
}  # fmt: skip


def rope_model(kind: str):
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512, **ROPE_CONFIGS[kind],
    )  # fmt: skip
    return LlamaForCausalLM(config).eval()


@pytest.mark.parametrize("kind", sorted(ROPE_CONFIGS))
def test_unrotated_keys_are_the_projections_output_and_rotate_back_exactly(kind):
    """Pre-RoPE round trip: un-rotating the cached keys gives k_proj's output (times yarn's attention scaling),
    and rotating them back gives the post-RoPE keys, within 1e-5."""
    model = rope_model(kind)
    ids = torch.randint(3, VOCAB, (1, 300))
    pre = capture(model, ids)  # hooked at the projections
    cache, _ = record_prefill(model, ids)
    for layer in range(2):
        post = cache.layers[layer].store.keys.float()
        positions = torch.arange(300, dtype=torch.int32)[None, None]
        table = prerope.RopeTable(prerope.rope_inv_freq(model.config, layer, 16))
        unrotated = prerope.rotate(prerope.to_pairs(post, table), positions, table, inverse=True)
        torch.testing.assert_close(unrotated[0], pre[layer]["keys"], atol=1e-5, rtol=1e-5)
        rotated = prerope.from_pairs(prerope.rotate(unrotated, positions, table), table)
        torch.testing.assert_close(rotated, post, atol=1e-5, rtol=1e-5)


def test_rotation_in_pair_order_is_ropes_half_split_rotation():
    """Slow and obviously right: channel i and i + D/2 rotate by position x inv_freq[i] (HF's rotate_half RoPE)."""
    table = prerope.RopeTable(torch.tensor([1.0, 0.1, 0.01, 0.001]))
    keys, positions = torch.randn(1, 2, 5, 8), torch.tensor([[[0, 3, 7, 100, 4000]]], dtype=torch.int32)
    expected = torch.empty_like(keys)
    for t, position in enumerate(positions[0, 0].tolist()):
        for i, frequency in enumerate(table.inv_freq.tolist()):
            angle = torch.tensor(position * frequency, dtype=torch.float64)
            a, b = keys[0, :, t, i].double(), keys[0, :, t, i + 4].double()
            expected[0, :, t, i] = a * angle.cos() - b * angle.sin()
            expected[0, :, t, i + 4] = b * angle.cos() + a * angle.sin()
    rotated = prerope.from_pairs(prerope.rotate(prerope.to_pairs(keys, table), positions, table), table)
    torch.testing.assert_close(rotated, expected, atol=1e-5, rtol=1e-5)


def test_storage_with_every_entry_exact_gives_back_the_post_rope_keys():
    """The whole store path (un-rotate, encode, decode, re-rotate at the tokens' positions), with every
    entry kept as an outlier: the keys and values come back up to their fp16 rounding."""
    model = rope_model("llama3")
    cache, _ = record_prefill(model, torch.randint(3, VOCAB, (1, 200)))
    store = cache.layers[1].store
    levels = torch.linspace(-1, 1, 4)
    codec = LayerCodec(2, 16, 16, levels, levels, torch.zeros(2, 16), torch.ones(2, 16))
    keys, values = store.keys[:, :, 100:], store.values[:, :, 100:]
    index = TokenIndex.of(store.positions[:, :, 100:], store.valid[:, :, 100:])
    table = prerope.RopeTable(prerope.rope_inv_freq(model.config, 1, 16))
    part = NonUniformKV.encode(keys, values, index, codec, table, None, 4)
    decoded_keys, decoded_values = part.dequantize()
    torch.testing.assert_close(decoded_keys, keys, atol=2e-3, rtol=2e-3)
    torch.testing.assert_close(decoded_values, values, atol=2e-3, rtol=2e-3)


def test_length_dependent_rope_is_refused_with_the_reason():
    config = LlamaConfig(rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0})
    with pytest.raises(prerope.RopeError, match="dynamic"):
        prerope.rope_inv_freq(config, 0, 16)


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma", "gemma2"])
def test_kvquant_generates_on_every_family_and_stays_close_at_4_bits(arch):
    model = tiny_model(arch)
    ids = torch.randint(3, VOCAB, (1, 60))
    out = model.generate(ids, past_key_values=kvopt.cache(fitted(SMALL, model), model), max_new_tokens=6,
                         do_sample=False)  # fmt: skip
    assert out.shape[1] == 66
    logits = {}
    for spec in ("full", "kvquant:bits=4,residual=16,group=16,calibration=96,outliers=0.1"):
        cache = kvopt.cache(fitted(spec, model), model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            logits[spec] = model(torch.tensor([[5]]), past_key_values=cache).logits[0, -1]
        if spec != "full" and arch != "mistral":  # mistral's tiny layers all slide: nothing is quantized
            assert cache.layers[0 if arch != "gemma2" else 1].parts_of(NonUniformKV)
    error = (logits["full"] - logits.popitem()[1]).abs().max().item()
    assert error < 0.05


def test_sinks_stay_exact_and_fewer_bits_lose_more():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 100))
    reference = None
    errors = {}
    for spec in ("full", "kvquant:bits=4,residual=16,group=16,calibration=96",
                 "kvquant:bits=2,residual=16,group=16,calibration=96"):  # fmt: skip
        cache = kvopt.cache(fitted(spec, model), model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            steps = torch.stack([model(torch.tensor([[5 + t]]), past_key_values=cache).logits[0, -1] for t in range(20)])
        if spec == "full":
            reference = steps
            continue
        part = cache.layers[0].parts_of(NonUniformKV)[0]
        assert part.sinks is not None and len(part.sinks.index.positions[0, 0]) == 4
        assert part.index.positions[0, 0, 0] == 4  # quantized tokens start after the sinks
        errors[spec] = (steps - reference).abs().max().item()
    assert errors[SMALL.replace("bits=2", "bits=4")] < errors[SMALL]


@pytest.mark.parametrize("spec", [SMALL, AQUA])
def test_a_batch_equals_its_rows_alone(spec):
    """Nothing is shared across rows (key ranges are calibrated offline, values per token, predictions per token),
    through decoding (one more group quantized)."""
    model = tiny_model("qwen2")
    methods = fitted(spec, model)
    ids = torch.randint(3, VOCAB, (2, 90))
    outputs = []
    for rows in (ids, ids[:1], ids[1:]):
        cache = kvopt.cache(methods, model)
        with torch.no_grad():
            model(rows, past_key_values=cache)
            for t in range(20):
                logits = model(torch.tensor([[9 + t]] * rows.shape[0]), past_key_values=cache).logits[:, -1]
        outputs.append(logits)
    torch.testing.assert_close(outputs[0], torch.cat(outputs[1:]), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("name", ["kvquant", "aquakv"])
def test_left_padded_rows_use_their_own_rope_positions(name):
    """A left-padded row is un-rotated at HF generate's positions (from its first real token): it generates
    what it generates alone."""
    model = tiny_model("llama")
    methods = fitted(f"{name}:bits=4,residual=16,group=16,calibration=96,sinks=0", model)
    short = torch.randint(3, VOCAB, (1, 50))
    long = torch.randint(3, VOCAB, (1, 70))
    padded = torch.cat([torch.zeros(1, 20, dtype=torch.long), short], dim=1)
    mask = torch.cat([torch.zeros(1, 20, dtype=torch.long), torch.ones(1, 50, dtype=torch.long)], dim=1)
    batch = model.generate(torch.cat([padded, long]), attention_mask=torch.cat([mask, torch.ones_like(mask)]),
                           past_key_values=kvopt.cache(methods, model), max_new_tokens=8, do_sample=False)  # fmt: skip
    alone = model.generate(short, past_key_values=kvopt.cache(methods, model), max_new_tokens=8, do_sample=False)
    assert batch[0, 70:].tolist() == alone[0, 50:].tolist()


def test_outliers_are_counted_in_the_bytes():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 100))
    held = {}
    for outliers in (0.0, 0.0625, 0.25):
        spec = f"{SMALL},outliers={outliers},value_outliers={outliers}"
        cache = kvopt.cache(fitted(spec, model), model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
        part = cache.layers[0].parts_of(NonUniformKV)[0]
        sparse = math.ceil(outliers * 16)
        assert part.keys.sparse_values.shape[-1] == part.values.sparse_index.shape[-1] == sparse
        held[outliers] = part.nbytes()
    tokens_heads = len(part) * 2
    assert held[0.0625] - held[0.0] == 2 * tokens_heads * 1 * 3  # 1 outlier per vector: fp16 value + uint8 index
    assert held[0.25] - held[0.0] == 2 * tokens_heads * 4 * 3


@pytest.mark.parametrize(
    "spec",
    [
        "kvquant:bits=2", "kvquant:bits=3,value_outliers=0.01", "kvquant:bits=4,outliers=0.05",
        "snapkv:ratio=0.5+kvquant:bits=2", "aquakv:bits=2", "aquakv:bits=3,calibration=512",
        "snapkv:ratio=0.5+aquakv:bits=2,calibration=512",
    ],  # fmt: skip
)
def test_theoretical_size_matches_the_measured_bytes_within_two_percent(spec):
    """`kvopt memory --method` counts codes, outliers, value ranges, sinks, positions and the residual (aquakv's
    predictors are per model: a token takes kvquant's bytes)."""
    from kvopt.memory import estimate
    from kvopt.models.info import ModelInfo

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=4096,
    )  # fmt: skip
    model = LlamaForCausalLM(config).eval()
    ids = torch.randint(3, VOCAB, (1, 3000))
    cache = kvopt.cache(fitted(spec, model), model)
    with torch.no_grad():
        model(ids, past_key_values=cache)
    theoretical = estimate(ModelInfo.from_config(config), 3000, methods=parse(spec), dtype=torch.float32).total_bytes
    assert abs(cache.nbytes() / theoretical - 1) <= 0.02


def test_kvquant_composes_after_prefill_eviction_but_not_beside_another_quantizer():
    model = tiny_model("llama")
    ids = torch.randint(3, VOCAB, (1, 200))
    held = {}
    for spec in ("snapkv:ratio=0.5", f"snapkv:ratio=0.5+{SMALL}"):
        cache = kvopt.cache(fitted(spec, model), model)
        with torch.no_grad():
            model(ids, past_key_values=cache)
            logits = model(torch.tensor([[7]]), past_key_values=cache).logits
        assert torch.isfinite(logits).all() and cache.layers[0].kept_per_row().tolist() == [101]
        held[spec] = cache.nbytes()
    assert held[f"snapkv:ratio=0.5+{SMALL}"] < held["snapkv:ratio=0.5"] / 2
    with pytest.raises(MethodParameterError, match="keep one of the two"):
        parse("kvquant:bits=2+kivi:bits=2")


@pytest.mark.parametrize(
    "spec, fragment",
    [
        ("kvquant:bits=5", "bits=5 is not supported"),
        ("kvquant:outliers=1.5", r"outliers=1.5 must lie in \[0, 1\]"),
        ("kvquant:sinks=-1", ">= 0"),
        ("kvquant:group=0", "positive integer"),
        ("kvquant:calibration=10", "at least 68 tokens"),
    ],
)
def test_bad_kvquant_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)


def test_an_uncalibrated_kvquant_says_how_to_calibrate():
    model = tiny_model("llama")
    cache = kvopt.cache(parse("full"), model)  # a cache without the calibration path, then the method by hand
    cache = type(cache).for_model(parse(SMALL), model)
    with pytest.raises(CacheUsageError, match="method.fit"), torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 60)), past_key_values=cache)
