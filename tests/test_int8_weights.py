"""Weight-only int8 linears (``weights="int8"``): the few-rows kernel against a float64 reference, the module's two
paths against each other, the bytes dropped, the engine against HF's forward on the same quantized model, and
every bad setting named."""

from __future__ import annotations

import copy
import shutil

import pytest
import torch
from conftest import tiny_llama

from kvopt.errors import KVOptError
from kvopt.kernels import cpu
from kvopt.models import int8_linear
from kvopt.models.int8_linear import Int8Linear, check_int8_serves, check_weights, quantize_linears

pytestmark = pytest.mark.usefixtures("one_thread")
COMPILER = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")


@pytest.fixture(scope="module")
def linear_rows():
    op = cpu.linear_rows()
    if op is None:
        if COMPILER is not None and not cpu.switched_off():
            pytest.fail("a C++ compiler is present but kvopt's CPU kernels did not build (see the warning)")
        pytest.skip("no C++ compiler here: Int8Linear widens its weights for the BLAS (tested below)")
    return op


@pytest.mark.parametrize("weight_dtype", [torch.int8, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("input_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("rows,inner", [(1, 576), (3, 96), (5, 40), (8, 1000)])
def test_linear_rows_equals_a_float64_reference(linear_rows, weight_dtype, input_dtype, rows, inner):
    """Every row count a pass holds (4) and its remainder, K not a multiple of the 32 weights a step reads (the
    scalar tail), scales and a bias: within fp32 rounding of the sum (and one bf16 rounding of a bf16 output)."""
    generator = torch.Generator().manual_seed(rows * inner)
    outputs = 67
    if weight_dtype == torch.int8:
        weight = torch.randint(-127, 128, (outputs, inner), generator=generator, dtype=torch.int8)
    else:
        weight = torch.randn(outputs, inner, generator=generator).to(weight_dtype)
    scale = torch.rand(outputs, generator=generator) / 50 + 1e-3
    bias = torch.randn(outputs, generator=generator).to(input_dtype)
    x = torch.randn(rows, inner, generator=generator).to(input_dtype)
    got = linear_rows(x, weight, scale, bias)
    assert got.dtype == input_dtype and got.shape == (rows, outputs)
    expected = (x.double() @ weight.double().T) * scale.double() + bias.double()
    tolerance = 1e-5 if input_dtype == torch.float32 else 1e-2
    torch.testing.assert_close(got.double(), expected, atol=tolerance, rtol=tolerance)
    plain = linear_rows(x, weight)  # no scale, no bias
    torch.testing.assert_close(plain.double(), x.double() @ weight.double().T, atol=tolerance * 50, rtol=tolerance)


def test_linear_rows_names_bad_shapes(linear_rows):
    with pytest.raises(RuntimeError, match="share K"):
        linear_rows(torch.randn(2, 8), torch.zeros(4, 9, dtype=torch.int8))
    with pytest.raises(RuntimeError, match="one value per output row"):
        linear_rows(torch.randn(2, 8), torch.zeros(4, 8, dtype=torch.int8), torch.ones(3))


def test_quantization_is_within_half_a_step_and_drops_the_bytes():
    """Each weight is within half its channel's step of the original; the layer holds a quarter of fp32's bytes
    (plus one scale per channel), and an all-zero channel stays zero."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(96, 48)
    with torch.no_grad():
        linear.weight[5].zero_()
    quantized = Int8Linear.from_linear(linear)
    step = linear.weight.abs().amax(1, keepdim=True) / 127
    assert ((quantized.dequantized() - linear.weight).abs() <= step / 2 + 1e-7).all()
    assert quantized.dequantized()[5].abs().sum() == 0
    held = sum(tensor.numel() * tensor.element_size() for tensor in (quantized.qweight, quantized.scale))
    assert held == 96 * 48 + 48 * 4 and held < linear.weight.numel() * 4 / 3.5


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_kernel_and_the_blas_paths_agree(linear_rows, dtype, monkeypatch):
    """A decode row (the kernel) and a prompt chunk (weights widened for the BLAS) compute the same layer."""
    torch.manual_seed(1)
    linear = torch.nn.Linear(64, 40).to(dtype)
    quantized = Int8Linear.from_linear(linear)
    x = torch.randn(2, 12, 64).to(dtype)  # 24 rows: past KERNEL_ROWS, the BLAS
    through_blas = quantized(x)
    monkeypatch.setattr(int8_linear, "KERNEL_ROWS", 64)
    through_kernel = quantized(x)
    reference = x.double() @ quantized.dequantized(torch.float64).T + linear.bias.double()
    tolerance = 1e-5 if dtype == torch.float32 else 3e-2
    for got in (through_blas, through_kernel):
        assert got.shape == (2, 12, 40)
        torch.testing.assert_close(got.double(), reference, atol=tolerance, rtol=tolerance)


def test_without_the_kernels_int8_still_computes(monkeypatch):
    monkeypatch.setattr(int8_linear, "linear_rows", lambda: None)
    torch.manual_seed(2)
    linear = torch.nn.Linear(32, 16)
    quantized = Int8Linear.from_linear(linear)
    x = torch.randn(1, 32)
    torch.testing.assert_close(quantized(x), x @ quantized.dequantized().T + linear.bias, atol=1e-5, rtol=1e-5)


@pytest.fixture(scope="module")
def int8_tiny(tiny_with_tokenizer):
    """A tiny llama with heads as wide as real models' (the CPU kernels' shapes), its linears quantized."""
    _, tokenizer = tiny_with_tokenizer
    model = tiny_llama(tokenizer, hidden_size=128, intermediate_size=256, num_attention_heads=4)
    linears = [module for module in model.modules() if isinstance(module, torch.nn.Linear)]
    float_bytes = sum(module.weight.numel() * 4 for module in linears)
    channels = sum(module.out_features for module in linears)
    count = quantize_linears(model)
    return model, tokenizer, count, (float_bytes, channels)


def test_every_linear_is_quantized_and_the_bytes_drop(int8_tiny):
    model, _, count, (float_bytes, channels) = int8_tiny
    layers = model.config.num_hidden_layers
    assert count == layers * 7 + 1  # q, k, v, o, gate, up, down per layer, and the output head
    assert not any(isinstance(module, torch.nn.Linear) for module in model.modules())
    held = sum(module.qweight.numel() + module.scale.numel() * 4 for module in model.modules()
               if isinstance(module, Int8Linear))  # fmt: skip
    assert held == float_bytes // 4 + channels * 4  # a byte per weight, an fp32 scale per output channel


def test_the_engine_on_int8_weights_equals_hf_generate_on_them(int8_tiny):
    """The engine's fused int8 projections (q/k/v and gate/up side by side) give HF ``generate``'s greedy tokens
    on the same quantized model, prompt by prompt."""
    from kvopt.engine import LLM, SamplingParams

    model, tokenizer, _, _ = int8_tiny
    reference = copy.deepcopy(model)
    prompts = ["the cat sat on the mat " * 6, "a b c d e f g " * 15, "one two three"]
    llm = LLM(model, tokenizer=tokenizer, kv_memory="8MB", block_size=4, max_num_seqs=3)
    assert isinstance(llm.engine.runner.lean.layers[0].qkv, Int8Linear)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True), use_tqdm=False)
    for prompt, output in zip(prompts, outputs):
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.no_grad():
            expected = reference.generate(ids, max_new_tokens=24, min_new_tokens=24, do_sample=False)
        assert output.outputs[0].token_ids == expected[0, ids.shape[1] :].tolist()


def test_bad_weight_settings_are_named():
    with pytest.raises(KVOptError, match="unknown weights 'int4'.*auto, fp32, bf16, int8"):
        check_weights("int4", None)
    with pytest.raises(KVOptError, match="weights=bf16 contradicts dtype=fp32"):
        check_weights("bf16", "fp32")
    with pytest.raises(KVOptError, match="weights=int8 runs on a CPU.*on cuda use weights=auto"):
        check_weights("int8", None, torch.device("cuda"))
    assert check_weights("int8", None) == "auto" and check_weights("int8", "fp32") == "fp32"
    assert check_weights("bf16", None) == "bf16" and check_weights("fp32", torch.float32) == "fp32"
    assert check_weights(None, "bf16") == "bf16" and check_weights("auto", None) is None


def test_a_model_without_linear_projections_is_refused():
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32))
    with pytest.raises(KVOptError, match="weights=int8 quantizes nn.Linear projections and gpt2's layers have none"):
        check_int8_serves(model)
    assert quantize_linears(torch.nn.Sequential(torch.nn.ReLU())) == 0  # nothing to quantize: nothing done


def test_a_loaded_model_takes_no_weights_setting(tiny_with_tokenizer):
    from kvopt.engine import LLM
    from kvopt.engine.config import EngineConfigError

    model, tokenizer = tiny_with_tokenizer
    with pytest.raises(EngineConfigError, match="weights='int8' applies to a model loaded by name.*quantize_linears"):
        LLM(model, tokenizer=tokenizer, kv_memory="8MB", weights="int8")


@pytest.mark.parametrize("args, fragment", [
    (["generate", "hi", "--weights", "int4"], "unknown weights 'int4'"),
    (["serve", "--weights", "bf16", "--dtype", "fp32"], "weights=bf16 contradicts dtype=fp32"),
    (["batch", "in.jsonl", "-o", "out.jsonl", "--weights", "int4"], "unknown weights 'int4'"),
])  # fmt: skip
def test_the_cli_refuses_bad_weights_in_one_line_with_exit_2(monkeypatch, capsys, args, fragment):
    """Before any model loads or port opens."""
    from kvopt.cli.main import main

    monkeypatch.setattr("sys.argv", ["kvopt", *args])
    with pytest.raises(SystemExit) as exited:
        main()
    assert exited.value.code == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and fragment in lines[0], lines


def test_a_model_loaded_by_name_in_int8_generates(model_folder):
    """``load_model(weights="int8")`` loads in int8 and ``kvopt.generate``'s HF forward runs on it."""
    import kvopt

    model, tokenizer = kvopt.load_model(model_folder, weights="int8", dtype="fp32")
    assert isinstance(model.lm_head, Int8Linear) and model.dtype == torch.float32
    ids = tokenizer("the cat sat", return_tensors="pt").input_ids
    with torch.no_grad():
        output = model.generate(ids, max_new_tokens=4, do_sample=False, past_key_values=kvopt.cache("full", model))
    assert output.shape[1] == ids.shape[1] + 4
