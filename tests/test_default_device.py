"""Device-agnostic code, checked without an accelerator: every tensor kvopt makes names its device.

A tensor made without ``device=`` lands on the default device, the CPU, and meets the model's tensors
on an accelerator only there, where CI never runs (the lent GPU found fourteen such failures at once).
Here the default device is ``meta`` while kvopt runs on the CPU: a tensor made on the default device
then has no data, and reading or mixing it fails on the CPU the way it would fail on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from conftest import random_batch
from test_device import COMPOSED, NOT_ON_GEMMA2, SPECS, generate
from tiny_models import VOCAB, tiny_model

from kvopt.engine import LLM, SamplingParams


@pytest.mark.parametrize("spec", [*SPECS.values(), *COMPOSED])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_method_makes_no_tensor_on_the_default_device(spec, arch):
    if spec.startswith(NOT_ON_GEMMA2) and arch == "gemma2":
        pytest.skip(f"{spec} needs adjacent full-attention layers or a family fastkv supports")
    model = tiny_model(arch)
    ids, mask = random_batch([40, 31])
    expected, _, _ = generate(spec, model, ids, mask)
    with torch.device("meta"):
        tokens, logits, _ = generate(spec, model, ids, mask)
    assert torch.equal(tokens, expected) and all(torch.isfinite(step).all() for step in logits)


@pytest.mark.parametrize("spec", ["full", "kivi:bits=2,residual=16,group=16", "snapkv:ratio=0.5", "adakv:ratio=0.5"])
def test_engine_makes_no_tensor_on_the_default_device(spec):
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in (5, 33, 60)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    expected = LLM(model, kv_method=spec, kv_memory="4MB").generate(prompts, params, use_tqdm=False)
    with torch.device("meta"):
        got = LLM(model, kv_method=spec, kv_memory="4MB").generate(prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in got] == [out.outputs[0].token_ids for out in expected]
