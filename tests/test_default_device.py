"""Device-agnostic code, checked without an accelerator: every tensor kvopt makes names its device.

A tensor made without ``device=`` lands on the default device, the CPU, and meets the model's tensors
on an accelerator only there, where CI never runs (the lent GPU found fourteen such failures at once).
Here the default device is ``meta`` while kvopt runs on the CPU: a tensor made on the default device
then has no data, and reading or mixing it fails on the CPU the way it would fail on a GPU.
"""

from __future__ import annotations

import json

import pytest
import torch
from conftest import random_batch
from test_codec_roundtrip import AFTER_SAVE, greedy, prefilled
from test_device import COMPOSED, NOT_ON_GEMMA2, SPECS, generate
from test_engine_tiers import PROMPT, serve
from test_speculative import repetitive_prompt
from tiny_models import VOCAB, tiny_model

import kvopt
from kvopt.codec import cache_bytes, cache_from_bytes
from kvopt.engine import LLM, SamplingParams


@pytest.mark.parametrize("spec", [*SPECS.values(), *COMPOSED])
@pytest.mark.parametrize("arch", ["llama", "gemma2"])
def test_method_makes_no_tensor_on_the_default_device(spec, arch):
    if spec.startswith(NOT_ON_GEMMA2) and arch == "gemma2":
        pytest.skip(f"{spec} needs adjacent full-attention layers, a family fastkv supports, or no sliding layers")
    model = tiny_model(arch)
    ids, mask = random_batch([40, 31])
    expected, _, _ = generate(spec, model, ids, mask)
    with torch.device("meta"):
        tokens, logits, _ = generate(spec, model, ids, mask)
    assert torch.equal(tokens, expected) and all(torch.isfinite(step).all() for step in logits)


@pytest.mark.parametrize(
    ("spec", "speculate"),
    [("full", None), ("kivi:bits=2,residual=16,group=16", None), ("snapkv:ratio=0.5", None),
     ("adakv:ratio=0.5", None), ("full", "prompt_lookup:k=3,ngram=1")],
)  # fmt: skip
def test_engine_makes_no_tensor_on_the_default_device(spec, speculate):
    model = tiny_model("llama")
    generator = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, VOCAB, (int(n),), generator=generator).tolist() for n in (5, 33, 60)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    options = dict(kv_method=spec, kv_memory="4MB", speculate=speculate)
    expected = LLM(model, **options).generate(prompts, params, use_tqdm=False)
    with torch.device("meta"):
        got = LLM(model, **options).generate(prompts, params, use_tqdm=False)
    assert [out.outputs[0].token_ids for out in got] == [out.outputs[0].token_ids for out in expected]


@pytest.mark.parametrize("spec", ["full", "adakv:ratio=0.5", "kivi:bits=4", "minicache:start=0+kivi:bits=4"])
@pytest.mark.parametrize("encoding", ["raw", "cachegen"])
def test_saving_and_loading_a_cache_make_no_tensor_on_the_default_device(spec, encoding, tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    cache, following = prefilled(spec, model, tokenizer)
    expected, _ = greedy(model, cache_from_bytes(cache_bytes(cache, model, encoding), model)[0], following, AFTER_SAVE)
    with torch.device("meta"):
        loaded, _ = cache_from_bytes(cache_bytes(cache, model, encoding), model)
    assert greedy(model, loaded, following, AFTER_SAVE)[0] == expected


def test_engine_tiers_make_no_tensor_on_the_default_device(tmp_path):
    """Prefix blocks stored to a CPU and a disk tier by one engine and read back by a restarted one."""
    model, tiers = tiny_model("llama"), ("cpu:1MB", f"disk:{tmp_path}:10MB")
    expected, _ = serve(model, (f"disk:{tmp_path / 'outside'}:10MB",), PROMPT)
    with torch.device("meta"):
        cold, first = serve(model, tiers, PROMPT)
        warm, second = serve(model, tiers, PROMPT)
    assert cold == warm == expected and first["cached"] == 0 and second["cached"] == 96


@pytest.mark.parametrize("speculate", ["prompt_lookup:k=4", "self:layers=1,k=3", "draft"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_speculative_decoding_makes_no_tensor_on_the_default_device(speculate, temperature):
    model = tiny_model("llama")
    if speculate == "draft":
        from kvopt.speculative.draft_model import DraftModel

        speculate = DraftModel(tiny_model("llama", seed=1), k=3)
    ids, options = repetitive_prompt()[0].tolist(), dict(max_new_tokens=12, temperature=temperature, seed=5, adaptive=False)
    expected = kvopt.generate(model, ids, cache="kivi:bits=4", speculate=speculate, **options).tokens
    with torch.device("meta"):
        got = kvopt.generate(model, ids, cache="kivi:bits=4", speculate=speculate, **options).tokens
    assert got == expected


def test_the_eval_harness_makes_no_tensor_on_the_default_device(tiny_with_tokenizer, tmp_path):
    """A grid with a shared prefill, a query-agnostic method's own passes, a quantizer and HF's cache, both modes."""
    from kvopt.eval.decoding import QUERY_AGNOSTIC, QUERY_AWARE
    from kvopt.eval.runner import EvalGrid, run_eval

    methods = ["full", "snapkv:ratio=0.5", "kvzip:ratio=0.5", "kivi:bits=4", "hf"]
    grid = EvalGrid(tasks=["passkey"], lengths=[300], methods=methods, depths=1, modes=[QUERY_AGNOSTIC, QUERY_AWARE])
    answers = []
    for folder, default in ((tmp_path / "cpu", "cpu"), (tmp_path / "meta", "meta")):
        with torch.device(default):
            path = run_eval(grid, folder, loaded=tiny_with_tokenizer, progress=False)
        answers.append(sorted((row["mode"], row["method"], row["prediction"], row["kv_bytes_peak"]) for row in map(json.loads, path.open())))
    assert answers[0] == answers[1] and len(answers[0]) == 2 * len(methods)
