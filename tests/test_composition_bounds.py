"""Every eviction x quantizer and eviction x merge pair: it keeps the bounds its spec promises, or
it is refused when parsed (never a cache that silently outgrows its budget, issue "Hardening" #1)."""

import pytest
import torch
from bounds import byte_bound, held_tokens, prefill_and_decode, token_bound
from tiny_models import VOCAB, tiny_model

import kvopt
from kvopt.errors import MethodParameterError
from kvopt.methods import available, parse
from kvopt.methods.spec import evicts, storage
from kvopt.models.info import ModelInfo

PROMPT, NEW_TOKENS = 160, 32

#: One eviction spec per registered eviction method (both budget forms where they differ in schedule).
EVICTIONS = [f"{cls.name}:ratio=0.5" for cls in available() if evicts(cls)] + [
    "window:size=64", "h2o:budget=64", "tova:budget=64", "streamingllm:budget=64", "morphkv:budget=64",
    "epicache:ratio=0.5,level=pair-uniform",  # every head keeps its share in the dense store, as tokenquant needs
]  # fmt: skip
#: The methods that move tokens out of the dense store, with settings that make them act on a short prompt.
QUANTIZERS = [
    "kivi:bits=2,residual=32", "tokenquant:bits=4,group=16,residual=16", "mixedkv:residual=32", "minikv:residual=32",
    "kvquant:residual=32,group=16,calibration=96", "aquakv:residual=32,group=16,calibration=96",
]  # fmt: skip
MOVERS = [*QUANTIZERS, "minicache:start=0.3"]
#: The pairs that work: prefill-time eviction in the dense store, then quantization; merging after an
#: eviction that keeps the same tokens in every layer; rocketkv's sparse rows in tokenquant's layout. Every other
#: pair is refused when parsed.
COMPOSABLE = {
    *((f"{name}:ratio=0.5", quantizer) for name in ("snapkv", "pyramidkv", "knorm", "random", "window", "fastkv", "locret")
      for quantizer in QUANTIZERS),  # fmt: skip
    ("window:ratio=0.5", "minicache:start=0.3"),
    ("rocketkv:ratio=0.5", "tokenquant:bits=4,group=16,residual=16"),  # stage 2's rows quantized per token
    # kivi after head-wise budgets (ragged rows quantized per token) and after whole-prompt passes (it waits for them)
    *((f"{name}:ratio=0.5", "kivi:bits=2,residual=32") for name in ("adakv", "kvzip", "shallowzip", "surprisal", "epicache")),
    *((f"{name}", "tokenquant:bits=4,group=16,residual=16") for name in ("surprisal:ratio=0.5", "epicache:ratio=0.5,level=pair-uniform")),
    ("epicache:ratio=0.5,level=pair-uniform", "kivi:bits=2,residual=32"),
}


def test_pairs_cover_every_eviction_and_every_mover():
    movers = {cls.name for cls in available() if not evicts(cls) and storage(cls()) is not None}
    assert movers == {spec.partition(":")[0] for spec in MOVERS}
    assert {"snapkv", "pyramidkv", "adakv", "kvzip", "window", "h2o", "tova", "streamingllm"} <= {
        spec.partition(":")[0] for spec in EVICTIONS
    }


@pytest.fixture(scope="module")
def model():
    return tiny_model("llama")


@pytest.mark.parametrize("mover", MOVERS)
@pytest.mark.parametrize("eviction", EVICTIONS)
def test_pair_holds_its_bound_or_is_refused(model, tiny_with_tokenizer, eviction, mover):
    spec = f"{eviction}+{mover}"
    if (eviction, mover) not in COMPOSABLE:
        with pytest.raises(MethodParameterError) as refusal:
            parse(spec)
        assert eviction.partition(":")[0] in str(refusal.value) and mover.partition(":")[0] in str(refusal.value)
        return
    methods = parse(spec)
    prompted = any(method.needs_prefill_pass for method in methods)  # kvzip prompts the model: real token ids
    tokenizer = tiny_with_tokenizer[1] if prompted else None
    model = tiny_with_tokenizer[0] if prompted else model
    for method in methods:
        if method.name == "minikv":
            method.layer_bits = [4, 2, 2]  # what a calibration would give (the tiny model has no tokenizer)
        if method.name in ("kvquant", "aquakv"):  # calibrated on random ids (the tiny model has no tokenizer)
            method.fit(model, torch.randint(3, VOCAB, (1, method.calibration), generator=torch.Generator().manual_seed(1)))
        if method.name == "locret":  # heads trained on random ids, likewise
            method.fit(model, torch.randint(3, VOCAB, (512,), generator=torch.Generator().manual_seed(1)))
    cache = kvopt.cache(methods, model)
    ids = torch.randint(3, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(0))
    prefill_and_decode(model, cache, ids, NEW_TOKENS, tokenizer)
    info = ModelInfo.from_config(model.config)
    bound = token_bound(info, methods, PROMPT, NEW_TOKENS)
    assert bound is None or held_tokens(cache) <= bound
    assert cache.nbytes() <= byte_bound(info, methods, PROMPT, NEW_TOKENS, model.dtype)
    assert held_tokens(cache) < PROMPT * info.num_layers  # the eviction really acted


def test_window_with_kivi_is_refused_instead_of_growing():
    """The issue's reproduction: window + kivi kept 79 tokens of a 64-token window."""
    with pytest.raises(MethodParameterError, match="window:size=64 evicts while decoding"):
        parse("window:size=64+kivi:bits=2,residual=0")
