"""The engine's lean forward (issue 65): the llama-shaped families computed without HF's per-op layer code, equal
to HF's forward, sharing the model's memory, and leaving HF's forward on the same model as it was."""

import pytest
import torch
from transformers import AutoModelForCausalLM, Qwen3Config
from conftest import random_batch
from test_engine import NEW_TOKENS, mixed_prompts
from tiny_models import COMMON, CONFIGS, tiny_model

from kvopt.engine import LLM, SamplingParams
from kvopt.models.lean_forward import FAMILIES, lean_forward_for
from kvopt.models.packed_linear import pack_linears

pytestmark = pytest.mark.usefixtures("one_thread")


def test_every_tested_family_is_served_and_a_layer_it_does_not_know_keeps_hf():
    assert all(lean_forward_for(tiny_model(arch)) is not None for arch in CONFIGS) and set(CONFIGS) <= set(FAMILIES)
    # Qwen 3 adds norms on queries and keys: a layer whose modules differ keeps HF's forward, and serves through it
    config = Qwen3Config(**COMMON, head_dim=16)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval()
    assert lean_forward_for(model) is None
    llm = LLM(model, kv_memory="4MB")
    assert llm.engine.runner.lean is None
    prompt = mixed_prompts(1)[0]
    out = llm.generate([prompt], SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True), use_tqdm=False)[0]
    expected = model.generate(torch.tensor([prompt]), max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None,
                              pad_token_id=0)[0, len(prompt):].tolist()  # fmt: skip
    assert out.outputs[0].token_ids == expected


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_fusing_adds_no_memory_and_leaves_hf_forward_bit_equal(arch):
    model = tiny_model(arch)
    ids, mask = random_batch([9, 23])
    with torch.no_grad():
        before = model(ids, attention_mask=mask).logits
    parameters = sum(p.numel() for p in model.parameters())
    lean = lean_forward_for(model)
    assert sum(p.numel() for p in model.parameters()) == parameters  # q/k/v and gate/up are views of the fused ones
    attention = model.model.layers[0].self_attn
    assert attention.q_proj.weight.untyped_storage().data_ptr() == lean.layers[0].qkv.weight.untyped_storage().data_ptr()
    with torch.no_grad():
        assert torch.equal(model(ids, attention_mask=mask).logits, before)
    again = lean_forward_for(model)  # a second engine on the same model: the same storage, no copy
    assert again.layers[0].qkv.weight.data_ptr() == lean.layers[0].qkv.weight.data_ptr()
    assert again.layers[-1].gate_up.weight.data_ptr() == lean.layers[-1].gate_up.weight.data_ptr()
    assert torch.equal(again.layers[0].qkv.weight, torch.cat([attention.q_proj.weight, attention.k_proj.weight,
                                                             attention.v_proj.weight]))  # fmt: skip
    if attention.q_proj.bias is not None:
        assert again.layers[0].qkv.bias.data_ptr() == lean.layers[0].qkv.bias.data_ptr()


def hf_forward_engine(model, **options) -> LLM:
    """An engine on ``model`` that runs HF's forward (the reference the lean one replaces)."""
    llm = LLM(model, **options)
    llm.engine.runner.lean = None
    return llm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_the_engine_gives_the_same_tokens_and_logprobs_through_either_forward(arch, dtype):
    model = tiny_model(arch, dtype=dtype)
    pack_linears(model)  # bf16 on a CPU with bf16 arithmetic: the packed linears the engine serves with
    params = SamplingParams(max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    long_prompt = random_batch([300], seed=7)[0][0].tolist()  # in 64-token chunks, then decoding alone
    options = dict(kv_memory="4MB", max_num_batched_tokens=64)
    for prompts in (mixed_prompts(8), [long_prompt]):
        lean = LLM(model, **options)
        assert lean.engine.runner.lean is not None
        outputs = [lean.generate(prompts, params, use_tqdm=False), hf_forward_engine(model, **options).generate(
            prompts, params, use_tqdm=False)]  # fmt: skip
        tokens = [[o.outputs[0].token_ids for o in run] for run in outputs]
        assert tokens[0] == tokens[1]
        # fp32: within rounding (a fused matmul may block its sums otherwise on another CPU's BLAS; the CPU kernels'
        # norms sum their squares in another order than PyTorch's); bf16: the kernels round where HF rounds, but a
        # norm's fp32 factor one ulp off can move a value across a bf16 rounding boundary: well within bf16's step
        tolerance = 1e-5 if dtype == torch.float32 else 1e-3
        for a, b in zip(*outputs):
            chosen = [[step[token] for step, token in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                      for o in (a, b)]  # fmt: skip
            assert chosen[0] == pytest.approx(chosen[1], abs=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("family", ["llama", "gemma"])
def test_the_cpu_kernels_glue_equals_pytorchs(family, dtype):
    """Each small step through the CPU kernels against PyTorch's ops (the reference): fp32 within rounding; bf16
    rounded at the same places, so nearly every value equal and none more than one bf16 step apart."""
    from transformers.activations import ACT2FN
    from transformers.models.gemma.modeling_gemma import GemmaRMSNorm
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    from kvopt.kernels.cpu import layer_glue
    from kvopt.models.lean_forward import KernelGlue, TorchGlue

    ops = layer_glue()
    if ops is None:
        pytest.skip("kvopt's CPU kernels are not built here: PyTorch's glue serves")
    torch.manual_seed(3)
    norm = (LlamaRMSNorm(96, eps=1e-6) if family == "llama" else GemmaRMSNorm(96, eps=1e-6)).to(dtype)
    with torch.no_grad():
        norm.weight.normal_()
    reference, kernels = TorchGlue(FAMILIES[family]), KernelGlue(FAMILIES[family], ops)
    hidden, addend = (torch.randn(7, 96).to(dtype) for _ in range(2))
    qkv = torch.randn(7, 8 * 16).to(dtype)
    cos, sin = torch.randn(7, 1, 16).to(dtype), torch.randn(7, 1, 16).to(dtype)
    gate_up = torch.randn(7, 2 * 40).to(dtype)
    pairs = [
        (reference.norm(hidden, norm), kernels.norm(hidden, norm)),
        *zip(reference.add_norm(hidden, addend, norm), kernels.add_norm(hidden, addend, norm)),
        (reference.rotary(qkv, cos, sin, 6, 16), kernels.rotary(qkv, cos, sin, 6, 16)),
        (reference.gated(torch.nn.SiLU())(gate_up), kernels.gated(torch.nn.SiLU())(gate_up)),
        (reference.gated(ACT2FN["silu"])(gate_up), kernels.gated(ACT2FN["silu"])(gate_up)),
    ]
    for expected, got in pairs:
        assert got.shape == expected.shape and got.dtype == dtype
        if dtype == torch.float32:
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
        else:
            assert (got == expected).float().mean() > 0.97
            torch.testing.assert_close(got.float(), expected.float(), atol=1e-2, rtol=2**-7)
    gelu = torch.nn.GELU(approximate="tanh")  # Gemma's activation is no SiLU: PyTorch's ops serve it
    assert torch.equal(kernels.gated(gelu)(gate_up), reference.gated(gelu)(gate_up))


def test_hf_silu_activation_goes_through_the_kernel():
    """transformers' own SiLU module (what llama-family configs name) takes the fused kernel, not three ops."""
    from transformers.activations import ACT2FN

    from kvopt.kernels.cpu import layer_glue
    from kvopt.models.lean_forward import KernelGlue

    ops = layer_glue()
    if ops is None:
        pytest.skip("kvopt's CPU kernels are not built here: PyTorch's glue serves")
    assert KernelGlue(FAMILIES["llama"], ops).gated(ACT2FN["silu"]) is ops.silu_mul
