"""Model loading (default embedded model, HF folders, GGUF) and model shape facts.

Below ``cache``: nothing here imports kvopt storage; :func:`kvopt.load_model` adds kvopt's attention.
"""

from kvopt.models.info import ModelInfo
from kvopt.models.loading import load_pretrained, load_tokenizer

__all__ = ["ModelInfo", "load_pretrained", "load_tokenizer"]
