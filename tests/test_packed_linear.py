"""bf16 linears packed for oneDNN: bit-equal to ``F.linear`` (so HF equality claims stand), packed only where they
can gain (bf16 on a CPU with bf16 arithmetic), repacked when the weight changes, and safe to copy and save."""

import copy
import io

import pytest
import torch
from conftest import random_batch
from test_engine import NEW_TOKENS, mixed_prompts
from tiny_models import CONFIGS, tiny_model

from kvopt.engine import LLM, SamplingParams
from kvopt.models import cpu_features
from kvopt.models.loading import load_pretrained
from kvopt.models.packed_linear import PackedLinear, pack_linears, packing_serves

pytestmark = [
    pytest.mark.usefixtures("one_thread"),
    pytest.mark.skipif(not packing_serves(torch.nn.Linear(2, 2).bfloat16()),
                       reason="this CPU or torch build has no native bf16 oneDNN packing"),  # fmt: skip
]


def plain_copy(model: torch.nn.Module) -> torch.nn.Module:
    """The same weights with every linear plain again."""
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, PackedLinear):
            module.__class__ = torch.nn.Linear
    return twin


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_packed_logits_are_bit_equal_to_plain_ones(arch):
    model = tiny_model(arch, dtype=torch.bfloat16)
    plain = plain_copy(model)
    assert pack_linears(model) == sum(type(m) is torch.nn.Linear for m in plain.modules()) > 0
    ids, mask = random_batch([9, 23])
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, plain(ids, attention_mask=mask).logits)
    assert all(m.packed is not None and m.packed.is_mkldnn for m in model.modules() if isinstance(m, PackedLinear))


def test_the_engine_on_a_packed_model_gives_the_plain_ones_tokens():
    model = tiny_model("llama", dtype=torch.bfloat16)
    plain = plain_copy(model)
    pack_linears(model)
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True)
    long_prompt = random_batch([300], seed=7)[0][0].tolist()  # alone, in 64-token chunks: steps that need no logits
    for prompts in (mixed_prompts(8), [long_prompt]):
        packed_out, plain_out = (LLM(m, kv_memory="4MB", max_num_batched_tokens=64).generate(prompts, params,
                                                                                          use_tqdm=False)
                                 for m in (model, plain))  # fmt: skip
        assert [o.outputs[0].token_ids for o in packed_out] == [o.outputs[0].token_ids for o in plain_out]
        assert not any(o.error for o in packed_out)


def test_only_bf16_on_a_cpu_with_bf16_arithmetic_is_packed(monkeypatch):
    assert pack_linears(tiny_model("llama")) == 0  # fp32: MKL packing measured no faster
    monkeypatch.setattr(cpu_features, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    assert pack_linears(tiny_model("llama", dtype=torch.bfloat16)) == 0  # emulated bf16 gains nothing


def test_flags_without_onednn_bf16_kernels_pack_nothing(monkeypatch):
    """bf16 flags but a oneDNN that refuses bf16 kernels (what a test faking the flags meets on an AVX2 CPU)."""
    import kvopt.models.packed_linear as packed_linear

    monkeypatch.setattr(packed_linear, "onednn_runs_bf16", lambda: False)
    assert pack_linears(tiny_model("llama", dtype=torch.bfloat16)) == 0


def test_a_changed_weight_is_repacked_and_a_moved_one_runs_plain():
    layer = torch.nn.Linear(8, 16).bfloat16()
    pack_linears(layer)
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    with torch.no_grad():
        layer.weight.mul_(2)  # in place: a new version of the same storage
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        layer.load_state_dict({"weight": torch.randn(16, 8), "bias": torch.zeros(16)})
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))
        assert layer.packed is not None
        layer.float()
        assert torch.equal(layer(x.float()), torch.nn.functional.linear(x.float(), layer.weight, layer.bias))
        assert layer.packed is None


@pytest.mark.parametrize("shape", [(0, 8), (1, 0, 8), (2, 3, 8)])
def test_any_leading_shape_runs_packed_even_an_empty_one(shape):
    layer = torch.nn.Linear(8, 16).bfloat16()
    pack_linears(layer)
    x = torch.randn(*shape, dtype=torch.bfloat16)  # an engine step can hand a layer no rows (a chunk needing no logits)
    with torch.no_grad():
        assert torch.equal(layer(x), torch.nn.functional.linear(x, layer.weight, layer.bias))


def test_gradients_flow_through_the_plain_path():
    layer = torch.nn.Linear(8, 4).bfloat16()
    pack_linears(layer)
    layer(torch.randn(2, 8, dtype=torch.bfloat16)).sum().backward()
    assert layer.weight.grad is not None


def test_a_packed_model_copies_pickles_and_saves_its_dense_weights():
    model = tiny_model("qwen2", dtype=torch.bfloat16)
    pack_linears(model)
    ids, _ = random_batch([12])
    with torch.no_grad():
        expected = model(ids).logits
        twin = copy.deepcopy(model)
        assert torch.equal(twin(ids).logits, expected)
    buffer = io.BytesIO()
    torch.save(model.state_dict(), buffer)
    assert all(not value.is_mkldnn for value in model.state_dict().values())


def test_loading_in_bf16_packs_and_fp32_does_not(model_folder):
    packed, _ = load_pretrained(model_folder, "bf16")
    plain, _ = load_pretrained(model_folder, "fp32")
    assert any(isinstance(m, PackedLinear) for m in packed.modules())
    assert not any(isinstance(m, PackedLinear) for m in plain.modules())


def test_the_switch_keeps_the_plain_layout(monkeypatch):
    monkeypatch.setenv("KVOPT_PACK_LINEARS", "off")
    assert pack_linears(tiny_model("llama", dtype=torch.bfloat16)) == 0
