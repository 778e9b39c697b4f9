"""Model loading (default embedded model, HF folders, GGUF) and model shape facts."""

from kvopt.cache.attention import prepare
from kvopt.models.info import ModelInfo
from kvopt.models.loading import load_model, load_tokenizer

__all__ = ["ModelInfo", "load_model", "load_tokenizer", "prepare"]
