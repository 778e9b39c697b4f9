"""minikv: the calibration finds the layer whose quantization hurts, per-layer bits, sizes."""

import copy

import pytest
import torch

import kvopt
from kvopt.cache.quantized import QuantizedKV
from kvopt.errors import MethodParameterError, ModelFileError
from kvopt.memory import estimate
from kvopt.methods import parse
from kvopt.methods.minikv import MiniKV, assign_bits, sensitivities
from kvopt.models.info import ModelInfo

from tiny_models import VOCAB, tiny_model


def sensitive_layer_model(layer: int):
    """A tiny llama whose ``layer`` has one huge key channel: 2-bit per-channel groups then lose the rest."""
    model = tiny_model("llama")
    with torch.no_grad():
        attention = model.model.layers[layer].self_attn
        attention.v_proj.weight.mul_(30.0)  # its values dominate the residual stream
    return model


def test_calibration_ranks_the_layer_whose_quantization_hurts_most():
    model = sensitive_layer_model(1)
    method = MiniKV(low=2, high=8, sensitive=0.34, group=16, calibration=256)
    ids = torch.randint(3, VOCAB, (1, 256), generator=torch.Generator().manual_seed(3))
    scores = sensitivities(method, model, ids)
    assert max(range(len(scores)), key=scores.__getitem__) == 1
    assert assign_bits(method, scores) == [2, 8, 2]


def test_minikv_stores_each_layer_in_its_bits_and_matches_its_theoretical_size():
    model = tiny_model("llama")
    method = MiniKV(low=2, high=4, sensitive=0.34, group=16, residual=32)
    method.layer_bits = [2, 4, 2]
    cache = kvopt.cache([method], model)
    ids = torch.randint(3, VOCAB, (1, 500))
    with torch.no_grad():
        model(ids, past_key_values=cache)
    assert [layer.parts_of(QuantizedKV)[0].bits for layer in cache.layers] == [2, 4, 2]
    theoretical = estimate(ModelInfo.from_config(model.config), 500, methods=[method], dtype=torch.float32).total_bytes
    # Within 3% on this tiny model (2 slack tokens of growth room per layer; 2% at head_dim 64: test_kivi.py).
    assert abs(cache.nbytes() / theoretical - 1) <= 0.03
    assert cache.layers[0].nbytes() < cache.layers[1].nbytes()


def test_minikv_without_a_tokenizer_says_how_to_calibrate():
    model = tiny_model("llama")
    with pytest.raises(ModelFileError, match="tokenizer"):
        kvopt.cache("minikv", model)


def test_minikv_composes_after_prefill_eviction():
    model = tiny_model("llama")
    evict, quantize = parse("snapkv:ratio=0.5+minikv:group=16,residual=16")
    quantize.layer_bits = [2, 4, 2]
    cache = kvopt.cache([evict, quantize], model)
    with torch.no_grad():
        model(torch.randint(3, VOCAB, (1, 160)), past_key_values=cache)
    assert all(int(layer.kept_per_row()[0]) == 80 and layer.parts_of(QuantizedKV) for layer in cache.layers)


@pytest.mark.parametrize(
    "spec, fragment",
    [("minikv:high=2,low=4", "must exceed low"), ("minikv:sensitive=2", r"\[0, 1\]"), ("minikv:calibration=64", "at least")],
)
def test_bad_minikv_parameters_say_what_to_do(spec, fragment):
    with pytest.raises(MethodParameterError, match=fragment):
        parse(spec)


def test_calibration_replaying_one_prefill_equals_a_prefill_per_probe():
    """sensitivities() prefills the context once and replays it; a probe cache prefilled directly agrees."""
    from kvopt.methods.minikv import SCORED_TOKENS

    model = sensitive_layer_model(1)
    method = MiniKV(low=2, high=8, group=16, calibration=256)
    ids = torch.randint(3, VOCAB, (1, 256), generator=torch.Generator().manual_seed(4))
    context, scored = ids[:, :-SCORED_TOKENS], ids[:, -SCORED_TOKENS:]

    def log_probs(layer_bits):
        probe = MiniKV(low=2, high=8, group=16, residual=0)
        probe.layer_bits = layer_bits
        cache = kvopt.cache([probe], model)
        with torch.no_grad():
            model(context, past_key_values=cache)
            return torch.log_softmax(model(scored, past_key_values=cache).logits[0].float(), dim=-1)

    reference = log_probs([None] * 3)
    expected = [
        torch.nn.functional.kl_div(log_probs([2 if i == layer else None for i in range(3)]), reference,
                                   log_target=True, reduction="batchmean").item()
        for layer in range(3)
    ]  # fmt: skip
    assert sensitivities(method, model, ids) == pytest.approx(expected, rel=1e-4, abs=1e-7)


def test_minikv_calibrates_on_the_text_its_caller_supplies(tiny_with_tokenizer, tmp_path, monkeypatch):
    """The text comes from the caller (kvopt.api gives local prose): methods import nothing from eval/."""
    from kvopt.api import build_cache
    from kvopt.models.loading import resolve_model_dir

    model = copy.deepcopy(tiny_with_tokenizer[0])
    model.name_or_path = str(resolve_model_dir())  # where the calibration finds the tokenizer
    monkeypatch.setenv("KVOPT_CACHE", str(tmp_path))  # a fresh calibration, stored here
    reads = []

    def text() -> str:
        reads.append(1)
        return "The river rose through the night, and by morning the village had moved uphill. " * 30

    method = MiniKV(low=2, high=4, sensitive=0.5, group=16, residual=16, calibration=160)
    build_cache([method], model, calibration_text=text)
    assert reads == [1] and sorted(method.layer_bits) == [2, 4]
    again = MiniKV(low=2, high=4, sensitive=0.5, group=16, residual=16, calibration=160)
    build_cache([again], model, calibration_text=text)
    assert reads == [1] and again.layer_bits == method.layer_bits  # stored: the text is not read again
