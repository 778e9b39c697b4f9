"""The serving engine: paged KV blocks, prefix caching, continuous batching, preemption.

Shaped like nano-vllm / vLLM: :mod:`sequence`, :mod:`block_manager`, :mod:`scheduler`,
:mod:`model_runner`, :mod:`llm_engine`, with :class:`LLM` on top.
"""

from kvopt.engine.config import EngineConfig
from kvopt.engine.llm import LLM
from kvopt.engine.llm_engine import LLMEngine, RequestError
from kvopt.engine.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kvopt.engine.sampling_params import SamplingParams

__all__ = [
    "LLM", "CompletionOutput", "EngineConfig", "LLMEngine", "RequestError", "RequestMetrics", "RequestOutput",
    "SamplingParams",
]  # fmt: skip
