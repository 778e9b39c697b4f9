"""Which model a cache belongs to: its configuration, plus a cheap hash of its weights.

A cache is only meaningful for the exact weights that computed it. Hashing every weight would
cost seconds per save on a 7B model, so the weight hash covers every parameter's name, shape
and dtype (a different architecture or a pruned model changes it) and the values of a few
sampled parameters -- the first, the last and two in between, :data:`SAMPLES` evenly spaced
elements of each. It catches another checkpoint or a fine-tune of the same architecture; a
change confined to unsampled elements of unsampled tensors would go unnoticed (say so in docs).
"""

from __future__ import annotations

import hashlib

import torch

from kvopt.codec.encodings import tensor_bytes
from kvopt.codec.errors import CacheModelMismatchError

#: Configuration fields that change the KV a model computes, compared one by one to name a mismatch.
CONFIG_FIELDS = (
    "model_type", "num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
    "vocab_size", "rope_theta", "sliding_window", "max_position_embeddings",
)  # fmt: skip
SAMPLES = 4096


def model_fingerprint(model) -> dict:
    """``{"config": {field: value}, "dtype": ..., "weights": hex digest}`` of ``model``."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    fields = {name: _plain(getattr(config, name, None)) for name in CONFIG_FIELDS}
    parameters = list(model.named_parameters())
    dtype = str(parameters[0][1].dtype).removeprefix("torch.") if parameters else None
    return {"config": fields, "dtype": dtype, "weights": weights_hash(parameters)}


def weights_hash(parameters: list[tuple[str, torch.Tensor]]) -> str:
    hasher = hashlib.blake2b(digest_size=16)
    for name, tensor in parameters:
        hasher.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype};".encode())
    total = len(parameters)
    for index in sorted({0, total // 3, 2 * total // 3, total - 1} if total else set()):
        flat = parameters[index][1].detach().reshape(-1)
        count = min(SAMPLES, flat.numel())
        picks = torch.arange(count, device=flat.device) * (flat.numel() - 1) // max(count - 1, 1)
        hasher.update(tensor_bytes(flat[picks]))
    return hasher.hexdigest()


def check_fingerprint(saved: dict, model, source: str) -> None:
    """Raise :class:`CacheModelMismatchError` naming the first difference between ``saved`` and ``model``."""
    current = model_fingerprint(model)
    for name in CONFIG_FIELDS:
        was, now = saved["config"].get(name), current["config"][name]
        if was != now:
            raise CacheModelMismatchError(
                f"{source} was saved from another model ({name}={was!r}, this model has {name}={now!r}); "
                "load it with the model that computed it"
            )
    if saved["dtype"] != current["dtype"]:
        raise CacheModelMismatchError(
            f"{source} was saved from the model in {saved['dtype']}, this one runs {current['dtype']}; "
            f"load the model with dtype={saved['dtype']}"
        )
    if saved["weights"] != current["weights"]:
        raise CacheModelMismatchError(
            f"{source} was saved from a model with the same configuration but different weights "
            "(another checkpoint or a fine-tune); load it with the model that computed it"
        )


def _plain(value):
    """A JSON value (lists for tuples), so a saved fingerprint compares equal to a fresh one."""
    if isinstance(value, (tuple, list)):
        return [_plain(item) for item in value]
    return value if value is None or isinstance(value, (bool, int, float, str)) else str(value)
