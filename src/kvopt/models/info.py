"""Shape facts about a model's KV cache, read from a Hugging Face config.

One place knows how the many config spellings (``num_key_value_heads`` missing means MHA,
``head_dim`` missing means ``hidden_size // heads``, ``layer_types`` marks sliding layers)
map to the numbers the cache, the methods and the memory calculator need.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvopt.errors import CacheUsageError, KVOptError, ModelShapeError


@dataclass(frozen=True)
class ModelInfo:
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_positions: int | None = None
    dtype: torch.dtype = torch.float16
    #: Per layer: the sliding-window length, or None for a full-attention layer.
    sliding_windows: tuple[int | None, ...] = field(default=())

    def __post_init__(self) -> None:
        for name in ("num_layers", "num_heads", "num_kv_heads", "head_dim"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:  # a zero or negative shape gives no size, or a negative one
                raise ModelShapeError(f"{name}={value!r} must be a positive integer (a model has at least one)")
        if self.num_heads % self.num_kv_heads:
            raise ModelShapeError(
                f"num_heads={self.num_heads} is not a multiple of num_kv_heads={self.num_kv_heads}; "
                "each KV head serves a whole group of query heads"
            )
        if not self.sliding_windows:
            object.__setattr__(self, "sliding_windows", (None,) * self.num_layers)
        if len(self.sliding_windows) != self.num_layers:
            raise ModelShapeError(
                f"sliding_windows has {len(self.sliding_windows)} entries for {self.num_layers} layers; "
                "give one per layer"
            )

    def check_keys(self, layer_idx: int, key_states: torch.Tensor) -> None:
        """Refuse keys ``[batch, kv_heads, tokens, head_dim]`` of a model with another shape than this one
        (a cache built for one model and used with another would fail with an IndexError, or worse)."""
        heads, dim = key_states.shape[1], key_states.shape[-1]
        if layer_idx < self.num_layers and heads == self.num_kv_heads and dim == self.head_dim:
            return
        raise CacheUsageError(
            f"this cache was built for a model of {self.num_layers} layers with {self.num_kv_heads} KV heads of "
            f"dimension {self.head_dim}, but it is updated with layer {layer_idx} of {heads} KV heads of dimension "
            f"{dim}; a cache serves one model: build one for this model with kvopt.cache(spec, model)"
        )

    @property
    def group_size(self) -> int:
        """Query heads per KV head (GQA group size)."""
        return self.num_heads // self.num_kv_heads

    @classmethod
    def from_config(cls, config, dtype: torch.dtype | None = None) -> ModelInfo:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        num_heads = text.num_attention_heads
        num_kv_heads = getattr(text, "num_key_value_heads", None) or num_heads
        head_dim = getattr(text, "head_dim", None) or text.hidden_size // num_heads
        num_layers = text.num_hidden_layers
        window = getattr(text, "sliding_window", None)
        layer_types = getattr(text, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        elif window is not None and getattr(text, "use_sliding_window", True):
            windows = (window,) * num_layers
        else:
            windows = (None,) * num_layers
        if dtype is None:
            dtype = getattr(text, "dtype", None) or getattr(config, "dtype", None) or torch.float16
            if isinstance(dtype, str):
                dtype = getattr(torch, dtype)
        return cls(
            num_layers=num_layers,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            max_positions=getattr(text, "max_position_embeddings", None),
            dtype=dtype,
            sliding_windows=windows,
        )


_DTYPES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float8": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn,
}  # fmt: skip


def parse_dtype(name: str | torch.dtype) -> torch.dtype:
    """A torch dtype from its usual names, with an error that lists the accepted ones."""
    if isinstance(name, torch.dtype):
        return name
    if name not in _DTYPES:
        raise KVOptError(f"unknown dtype {name!r}; use float16, bfloat16, float32 or float8")
    return _DTYPES[name]
