"""Every bad API argument raises a KVOptError naming the problem (issue "Hardening" #4-#10), and a
compressed cache refuses a new prompt instead of answering from a context it no longer holds (#10)."""

import copy
import json

import pytest
import torch
from test_model_cache import write_gguf
from tiny_models import VOCAB, tiny_model
from transformers import LlamaConfig, LlamaForCausalLM

import kvopt
from kvopt.api import load_model
from kvopt.errors import CacheUsageError, KVOptError
from kvopt.eval.report import write_report
from kvopt.eval.runner import EvalGrid, load_done, run_eval
from kvopt.guards import install_prompt_guard, validate_cache_arguments
from kvopt.memory import estimate
from kvopt.methods import parse
from kvopt.models.info import ModelInfo
from kvopt.runtime import check_context, generate_streaming

LLAMA = tiny_model("llama")
INFO = ModelInfo.from_config(LLAMA.config)


def other_shape_model(**changes):
    """A tiny llama like :data:`LLAMA` but for ``changes`` to its config."""
    config = LlamaConfig(**{**LLAMA.config.to_dict(), **changes})
    return LlamaForCausalLM(config).eval()


def used_on(model_for_cache, model):
    """Build a cache for one model, run another model on it."""
    cache = kvopt.cache("full", model_for_cache)
    kvopt.prepare(model)
    model(torch.randint(3, VOCAB, (1, 8)), past_key_values=cache)


def bad_file(tmp_path, name: str, data: bytes):
    (tmp_path / name).write_bytes(data)
    return tmp_path / name


def folder_with_config(tmp_path, config: dict):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return tmp_path / "model"


def rows_file(tmp_path, text: str):
    (tmp_path / "eval.jsonl").write_text(text)
    return tmp_path / "eval.jsonl"


ROWS = {
    # kvopt.cache arguments (#8)
    "model is None": lambda tmp: kvopt.cache("full", None),
    "spec is None": lambda tmp: kvopt.cache(None, LLAMA),
    "spec is a list of strings": lambda tmp: kvopt.cache(["snapkv:ratio=0.5", "kivi"], LLAMA),
    "arguments swapped": lambda tmp: kvopt.cache(LLAMA, "full"),
    "list of non-methods": lambda tmp: kvopt.cache([1, 2], LLAMA),
    "cache of a 3-layer model on a 4-layer one": lambda tmp: used_on(LLAMA, other_shape_model(num_hidden_layers=4)),
    "cache of another head shape": lambda tmp: used_on(LLAMA, other_shape_model(num_key_value_heads=4)),
    # specs that cannot work (#1, #6)
    "window evicting beside kivi": lambda tmp: parse("window:size=64+kivi:bits=2,residual=0"),
    "h2o beside kivi": lambda tmp: parse("h2o:budget=64+kivi"),
    "a quantizer twice": lambda tmp: parse("kivi:bits=4+kivi:bits=2"),
    "two quantizers": lambda tmp: parse("kivi+mixedkv"),
    "eviction after quantization": lambda tmp: parse("kivi:bits=2+snapkv:ratio=0.5"),
    "merge after quantization": lambda tmp: parse("kivi+minicache"),
    "head-wise eviction beside merging": lambda tmp: parse("snapkv:ratio=0.5+minicache"),
    "a key twice": lambda tmp: parse("snapkv:ratio=0.5,ratio=0.7"),
    "an empty method": lambda tmp: parse("snapkv++kivi"),
    "a list of methods in a bad order": lambda tmp: kvopt.cache(parse("kivi") + parse("snapkv:ratio=0.5"), LLAMA),
    # impossible shapes (#5)
    "zero layers": lambda tmp: ModelInfo(0, 2, 2, 8),
    "negative heads and dimension": lambda tmp: ModelInfo(4, -8, -8, -128),
    "negative tokens": lambda tmp: estimate(INFO, -1),
    # models that cannot load (#7)
    "empty gguf": lambda tmp: load_model(bad_file(tmp, "e.gguf", b"")),
    "random gguf": lambda tmp: load_model(bad_file(tmp, "r.gguf", b"\x01" * 4096)),
    "truncated gguf": lambda tmp: load_model(bad_file(tmp, "t.gguf", write_gguf(tmp / "w.gguf").read_bytes()[:-50])),
    "folder with only config.json": lambda tmp: load_model(folder_with_config(tmp, {"model_type": "llama"})),
    "unknown model_type": lambda tmp: load_model(folder_with_config(tmp, {"model_type": "nosuch"})),
    "a file that is not a model": lambda tmp: load_model(bad_file(tmp, "notes.txt", b"hello")),
    # generation (#7, #10)
    "max_new_tokens 0": lambda tmp: check_context(INFO, 10, 0),
    "empty prompt": lambda tmp: check_context(INFO, 0, 8),
    # evaluation that would do nothing, or trust rows that are not rows (#9)
    "no methods": lambda tmp: run_eval(EvalGrid(["passkey"], [300], []), tmp, loaded=(LLAMA, None), progress=False),
    "no tasks": lambda tmp: run_eval(EvalGrid([], [300], ["full"]), tmp, loaded=(LLAMA, None), progress=False),
    "length 0": lambda tmp: run_eval(EvalGrid(["passkey"], [0], ["full"]), tmp, loaded=(LLAMA, None), progress=False),
    "empty row resumed": lambda tmp: load_done(rows_file(tmp, "{}\n")),
    "empty row reported": lambda tmp: write_report(rows_file(tmp, "{}\n").parent, tmp / "report"),
}


@pytest.mark.parametrize("call", ROWS.values(), ids=ROWS.keys())
def test_bad_argument_raises_kvopt_error(tmp_path, call):
    with pytest.raises(KVOptError):
        call(tmp_path)


def test_argument_errors_name_the_problem():
    with pytest.raises(KVOptError, match="needs a loaded transformers causal LM as `model`, got None"):
        validate_cache_arguments("full", None)
    with pytest.raises(KVOptError, match="got a list of strings; join them with '\\+': 'snapkv:ratio=0.5\\+kivi'"):
        validate_cache_arguments(["snapkv:ratio=0.5", "kivi"], LLAMA)
    with pytest.raises(KVOptError, match="must come before kivi"):
        validate_cache_arguments(parse("kivi") + parse("snapkv:ratio=0.5"), LLAMA)
    assert [m.name for m in validate_cache_arguments("snapkv:ratio=0.5+kivi", LLAMA)] == ["snapkv", "kivi"]
    with pytest.raises(CacheUsageError, match="built for a model of 3 layers.*updated with layer 3"):
        INFO.check_keys(3, torch.zeros(1, 2, 1, 16))
    INFO.check_keys(2, torch.zeros(1, 2, 1, 16))


def test_long_prompt_error_never_suggests_zero_new_tokens():
    with pytest.raises(KVOptError) as too_long:
        check_context(INFO, INFO.max_positions + 10, 16)
    assert "--max-new-tokens to 0" not in str(too_long.value) and "shorten the prompt" in str(too_long.value)
    with pytest.raises(KVOptError, match="lower --max-new-tokens to 12"):
        check_context(INFO, INFO.max_positions - 12, 16)
    check_context(INFO, INFO.max_positions + 10, 16, parse("streamingllm:budget=64"))  # streams past the context


def test_empty_prompt_without_chat(tiny_with_tokenizer):
    model, tokenizer = tiny_with_tokenizer
    with pytest.raises(KVOptError, match="the prompt is empty"):
        generate_streaming("", model=model, tokenizer=tokenizer, chat=False)


# -- a compressed cache reused for a new prompt (#10) ---------------------------------------


def generate(model, cache, ids, **kwargs):
    return model.generate(ids, past_key_values=cache, max_new_tokens=4, do_sample=False, pad_token_id=0, **kwargs)


@pytest.fixture
def guarded():
    """A tiny llama whose forwards go through the guard (as kvopt.prepare installs it)."""
    model = copy.deepcopy(LLAMA)
    kvopt.prepare(model)
    install_prompt_guard(model)
    install_prompt_guard(model)  # idempotent
    return model


def prompts():
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(3, VOCAB, (1, n), generator=generator) for n in (60, 40, 5)]


def test_compressed_cache_refuses_a_new_prompt_and_continues_its_own(guarded):
    first, new, more = prompts()
    cache = kvopt.cache("snapkv:budget=20,window=4", guarded)
    answer = generate(guarded, cache, first)
    with pytest.raises(CacheUsageError, match="create a new cache for each prompt"):
        generate(guarded, cache, new)
    cache = kvopt.cache("snapkv:budget=20,window=4", guarded)
    answer = generate(guarded, cache, first)
    assert generate(guarded, cache, torch.cat([answer, more], dim=1)).shape[1] == 60 + 4 + 5 + 4  # a continuation


def test_lossless_cache_keeps_dynamic_cache_semantics(guarded):
    first, new, _ = prompts()
    cache = kvopt.cache("full", guarded)
    generate(guarded, cache, first)
    assert generate(guarded, cache, new).shape[1] == 44


def test_left_padded_batch_continues_but_not_restarts(guarded):
    from conftest import random_batch

    ids, mask = random_batch([50, 45])
    ids, mask = torch.nn.functional.pad(ids, (3, 0)), torch.nn.functional.pad(mask, (3, 0))  # every row padded
    cache = kvopt.cache("snapkv:budget=20,window=4", guarded)
    answer = generate(guarded, cache, ids, attention_mask=mask)
    more = torch.randint(3, VOCAB, (2, 5))
    longer_mask = torch.cat([mask, torch.ones(2, 9, dtype=mask.dtype)], dim=1)
    generate(guarded, cache, torch.cat([answer, more], dim=1), attention_mask=longer_mask)
    with pytest.raises(CacheUsageError):
        generate(guarded, cache, ids[:, :30], attention_mask=mask[:, :30])


def test_kvopt_cache_installs_the_guard():
    """Through the public entry points alone (no hook registered by hand)."""
    model = copy.deepcopy(LLAMA)
    first, new, _ = prompts()
    cache = kvopt.cache("snapkv:budget=20,window=4", model)
    generate(model, cache, first)
    with pytest.raises(CacheUsageError, match="create a new cache"):
        generate(model, cache, new)
