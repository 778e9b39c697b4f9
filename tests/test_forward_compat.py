"""kvopt's own model calls name the cache argument the installed transformers takes (renamed in 5.24)."""

import warnings

import torch

import kvopt
from kvopt.models.forward import cache_keyword, cache_kwargs
from tiny_models import tiny_model


class NewStyle(torch.nn.Module):
    def forward(self, input_ids=None, cache=None, use_cache=None):
        return cache


class OldStyle(torch.nn.Module):
    def forward(self, input_ids=None, past_key_values=None, use_cache=None):
        return past_key_values


def test_the_keyword_follows_the_model_class():
    assert cache_keyword(NewStyle) == "cache"
    assert cache_keyword(OldStyle) == "past_key_values"
    marker = object()
    assert NewStyle()(**cache_kwargs(NewStyle(), marker)) is marker
    assert OldStyle()(**cache_kwargs(OldStyle(), marker)) is marker


def test_kvopt_calls_raise_no_deprecation_warning():
    """``kvopt.generate`` on a real HF class: no FutureWarning about the cache argument's name."""
    model = tiny_model("llama")
    ids = torch.randint(3, 100, (1, 12))
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*past_key_values.*")
        kvopt.generate(model, ids, cache="snapkv:budget=8,window=2", max_new_tokens=3, speculate="prompt_lookup:k=2")
