"""shallowzip: its reconstruction runs through the first layers only (its scoring, savings and batches are
kvzip's tests, run on both methods in test_kvzip.py)."""

import pytest
import torch

import kvopt
from kvopt.errors import MethodParameterError
from kvopt.methods import parse


def test_the_reconstruction_stops_after_the_scored_layers(tiny_with_tokenizer):
    """The point of shallowzip: after the prefill, the deeper layers compute nothing."""
    model, tokenizer = tiny_with_tokenizer
    context = torch.randint(100, 5000, (1, 200), generator=torch.Generator().manual_seed(4))
    tokens = {0: 0, 1: 0}

    def counter(index: int):
        return lambda module, args, out: tokens.__setitem__(index, tokens[index] + args[0].shape[1])

    hooks = [layer.mlp.register_forward_hook(counter(index)) for index, layer in enumerate(model.model.layers)]
    try:
        cache = kvopt.cache("shallowzip:ratio=0.75,depth=0.5,chunk=64", model)
        cache.prefill(model, context, tokenizer=tokenizer)
    finally:
        for hook in hooks:
            hook.remove()
    assert tokens[1] == 200  # the prefill only
    assert tokens[0] > 400  # the prefill, then the context repeated after a prompt per chunk
    assert cache.get_seq_length() == 200 and not any(layer.mode for layer in cache.layers)
    assert cache.layers[1].parts  # the deeper layer was compressed all the same


def test_scored_layers_and_bad_parameters():
    (method,) = parse("shallowzip:ratio=0.75")
    assert [method.scored_layers(n) for n in (30, 32, 4, 1)] == [8, 8, 1, 1]
    for spec, fragment in (("depth=0", "depth=0.0 must lie in"), ("carry=0", "carry=0 be >= 1")):
        with pytest.raises(MethodParameterError, match=fragment):
            parse(f"shallowzip:ratio=0.5,{spec}")
