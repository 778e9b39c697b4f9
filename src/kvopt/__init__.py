"""kvopt: KV-cache optimization for Hugging Face causal language models.

    model, tokenizer = kvopt.load_model()            # embedded SmolLM2-135M-Instruct
    cache = kvopt.cache("window:size=1024", model)   # or "full"
    model.generate(ids, past_key_values=cache, max_new_tokens=64)
    cache.nbytes(), cache.stats()
    kvopt.save_cache(cache, "chat.kvc"); cache = kvopt.load_cache("chat.kvc", model)   # a session outlives the process

    kvopt.generate(model, ids, cache="kivi:bits=4", speculate="prompt_lookup:k=4")   # speculative decoding

    llm = kvopt.LLM()                                # the serving engine: paged, prefix-cached, batched
    llm.generate(prompts, kvopt.SamplingParams(max_tokens=64))
"""

from kvopt import methods
from kvopt._version import __version__ as __version__
from kvopt.api import build_cache as cache
from kvopt.api import load_model
from kvopt.cache import KVCache
from kvopt.cache.attention import prepare
from kvopt.codec import load_cache, save_cache
from kvopt.engine import LLM, SamplingParams
from kvopt.errors import KVOptError
from kvopt.eval.recommend import recommend
from kvopt.models import ModelInfo
from kvopt.speculative import generate

__all__ = [
    "LLM", "KVCache", "KVOptError", "ModelInfo", "SamplingParams", "cache", "generate", "load_cache", "load_model", "methods", "prepare",
    "recommend", "save_cache",
]  # fmt: skip
