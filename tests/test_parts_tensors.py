"""Every storage part names the tensors it holds for its sequence (``tensors()``): what its bytes count, its own
per layer (a merged pair's are its two layers'), never the per-model tables its methods keep."""

import dataclasses

import pytest
import torch
from tiny_models import VOCAB, tiny_model

import kvopt
from kvopt.cache.merged import MergedView
from kvopt.cache.part import KVPart, tensor_bytes
from kvopt.methods import parse

#: Spec -> the part kinds (besides the dense store) its cache holds after a 120-token prompt and a few steps.
SPECS = {
    "full": set(),
    "kivi:bits=2,residual=32": {"QuantizedKV"},
    "kvzip:ratio=0.5": {"RaggedKV"},
    "snapkv:ratio=0.5": set(),
    "adakv:ratio=0.5": {"RaggedKV"},
    "minicache:start=0.3": {"MergedView"},
    "minicache:start=0+kivi:bits=4": {"MergedView"},  # the pair's direction quantized
    "rocketkv:ratio=0.5": {"SparseKV"},
    "rocketkv:ratio=0.5+tokenquant:bits=4,group=16,residual=16": {"SparseKV"},  # rows quantized per token
    "kvquant:residual=32,group=16,calibration=96": {"NonUniformKV"},
    "aquakv:residual=32,group=16,calibration=96": {"NonUniformKV"},
}


def built_cache(spec: str, request):
    """``spec``'s cache after a 120-token prompt (two rows) and 4 decoded tokens, calibrated on random ids."""
    if spec.startswith("kvzip"):
        model, tokenizer = request.getfixturevalue("tiny_with_tokenizer")
        low, high = 100, 5000
    else:
        model, tokenizer, low, high = tiny_model("llama"), None, 3, VOCAB
    generator = torch.Generator().manual_seed(0)
    methods = parse(spec)
    for method in methods:
        if hasattr(method, "fit"):
            method.fit(model, torch.randint(low, high, (1, method.calibration), generator=generator))
    cache = kvopt.cache(methods, model)
    ids = torch.randint(low, high, (2, 120), generator=generator)
    mask = torch.ones_like(ids)
    cache.prefill(model, ids[:, :-1], mask[:, :-1], tokenizer=tokenizer)
    model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=4, min_new_tokens=4, do_sample=False)
    return cache


def held_tensors(obj, seen: set[int] | None = None) -> list[torch.Tensor]:
    """Every tensor reachable from ``obj`` through attributes and containers."""
    seen = set() if seen is None else seen
    if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool, torch.nn.Module)):
        return []
    seen.add(id(obj))
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        children = list(obj.values())
    elif isinstance(obj, (list, tuple, set, frozenset)):
        children = list(obj)
    elif dataclasses.is_dataclass(obj) or hasattr(obj, "__dict__"):
        children = list(vars(obj).values()) if hasattr(obj, "__dict__") else []
    else:
        children = []
    return [t for child in children for t in held_tensors(child, seen)]


def storage(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


@pytest.mark.parametrize("spec", SPECS)
def test_parts_name_their_own_tensors_and_count_them(spec, request):
    cache = built_cache(spec, request)
    kinds = {type(part).__name__ for layer in cache.layers for part in layer.parts}
    assert kinds == SPECS[spec]

    owner: dict[int, int] = {}  # tensor id -> first layer holding it
    shared: set[int] = set()  # tensors of merged pairs (held by both layers of a pair)
    unique: dict[int, torch.Tensor] = {}
    for number, layer in enumerate(cache.layers):
        held = []
        for part in (layer.store, *layer.parts):
            assert isinstance(part, KVPart)
            tensors = part.tensors()
            assert all(isinstance(t, torch.Tensor) for t in tensors)
            if isinstance(part, MergedView):
                shared.update(id(t) for t in tensors)
            else:
                assert tensor_bytes(tensors) == part.nbytes()
            held += tensors
        assert len({id(t) for t in held}) == len(held), f"layer {number} holds a tensor twice"
        if not any(isinstance(part, MergedView) for part in layer.parts):
            assert tensor_bytes(held) == layer.nbytes()
        for t in held:
            first = owner.setdefault(id(t), number)
            assert first == number or id(t) in shared, f"layers {first} and {number} share a tensor"
            unique[id(t)] = t
    # each tensor counted once in the cache's bytes, a merged pair's split between its two layers
    assert tensor_bytes(unique.values()) == cache.nbytes()

    by_methods = {storage(t) for t in held_tensors(cache.methods) if t.untyped_storage().nbytes()}
    assert by_methods or not any(hasattr(m, "codecs") for m in cache.methods)  # calibrated methods hold tables
    for t in unique.values():
        assert storage(t) not in by_methods, "a part counts a tensor its method keeps (shared by all sequences)"
