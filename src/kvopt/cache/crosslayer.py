"""Cross-layer linear predictors of pre-RoPE keys and values (AQUA-KV, arXiv 2501.19392).

Much of a layer's KV is a linear function of the layer before it: on the default model a
least-squares map from layer ``l - 1``'s pre-RoPE keys explains about 68% of the variance of
layer ``l``'s (held-out text, all KV heads of a token at once; per head alone: 49%; per RoPE
frequency across heads: 15%), and one from the pre-RoPE keys of layers ``l`` and ``l - 1`` about 69% of
layer ``l``'s values (the paper's inputs, layer ``l``'s keys and layer ``l - 1``'s values: 72%). A
quantizer that stores only what the predictor leaves unexplained spends its bits on a residual
about 0.6 times as large. The weights are per model (fitted once, :mod:`kvopt.methods.aquakv`);
this module applies them.

Values are predicted from keys only, not from the layer below's values, because attention is
linear in the values: the predicted values' share of an attention output is the value predictor
applied to the attention-weighted sums of the two layers' keys (:meth:`LayerPredictor.fold_values`),
so decoding never rebuilds a predicted value (the paper's inputs would need the whole chain of
values rebuilt, one ``[T, 384] x [384, 192]`` product per layer and step on the default model).
Keys must be rebuilt (RoPE rotates each at its own position); their product runs in bf16 where the
hardware multiplies it natively (:func:`product_dtype`), the few value products in fp32.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from kvopt.cache.quant import workspace
from kvopt.models.cpu_features import native_on_cpu


@functools.lru_cache(maxsize=8)
def product_dtype(device: torch.device) -> torch.dtype:
    """The dtype the predictors multiply in: bf16 where the hardware has bf16 arithmetic (on this project's
    AVX512-BF16 CPU a ``[8192, 192] x [192, 192]`` product takes 3.1 ms against 8.3 ms in fp32; its rounding,
    2^-9 of a prediction, is far below a 2-bit residual's error), fp32 elsewhere. Encoding and decoding call
    the same products, so codes and reconstructions agree on a machine."""
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float32
    if device.type == "cpu":
        return torch.bfloat16 if native_on_cpu(torch.bfloat16) else torch.float32
    return torch.float32


@dataclass
class LayerPredictor:
    """One layer's predictors, over the concatenated KV heads of a token (``H`` heads of ``D`` channels here,
    ``S`` in the source layer), with a bias row last:

    * keys: ``[source keys, 1] @ key_weight``, ``key_weight [S * D + 1, H * D]``;
    * values: ``[keys, source keys, 1] @ value_weight``, ``value_weight [(H + S) * D + 1, H * D]``.
    """

    key_weight: torch.Tensor
    value_weight: torch.Tensor

    def __post_init__(self) -> None:
        self._cast: dict[tuple[str, torch.dtype], torch.Tensor] = {}

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.key_weight, self.value_weight))

    def keys(self, source_keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted pre-RoPE keys ``[B, H, T, D]`` from the source layer's ``[B, S, T, D]`` (added to ``out``
        in place when given)."""
        return self._affine("key_weight", [source_keys], out, product_dtype(source_keys.device))

    def values(self, keys: torch.Tensor, source_keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted values ``[B, H, T, D]`` from this layer's keys ``[B, H, T, D]`` and the source's (added to
        ``out`` in place when given), in fp32 as :meth:`fold_values` applies them (only encoding and a full
        dequantization build them)."""
        return self._affine("value_weight", [keys, source_keys], out, torch.float32)

    def fold_values(self, sums: torch.Tensor, kv_heads: int) -> torch.Tensor:
        """The predicted values' share of attention outputs ``[B, H_q, q, D]``, from each query head's
        attention-weighted sums of this layer's and the source's keys ``[B, H_q, q, (H + S) * D]``
        (:func:`~kvopt.cache.attention_math.attention_with_shared_sums`; the weights sum to one, so the bias is
        added once). Query head ``h`` reads KV head ``h // (H_q / H)``'s columns (``H = kv_heads``)."""
        batch, heads, q_len, width = sums.shape
        dim = self.value_weight.shape[1] // kv_heads
        grouped = sums.reshape(batch, kv_heads, heads // kv_heads * q_len, width)
        weight = self.value_weight[:-1].view(width, kv_heads, dim).transpose(0, 1)  # [H, (H + S) * D, D]
        bias = self.value_weight[-1].view(kv_heads, 1, dim)
        return torch.matmul(grouped, weight).add_(bias).reshape(batch, heads, q_len, dim)

    def _affine(
        self, name: str, inputs: list[torch.Tensor], out: torch.Tensor | None, dtype: torch.dtype,
    ) -> torch.Tensor:  # fmt: skip
        """``[inputs (heads concatenated per token), 1] @ weight`` as ``[B, H, T, D]``, into a new tensor or added
        to ``out``: one product over all heads in ``dtype``, the bias added in fp32."""
        weight = getattr(self, name)
        batch, _, tokens, dim = inputs[0].shape
        device = inputs[0].device
        if (name, dtype) not in self._cast:
            self._cast[(name, dtype)] = weight[:-1].to(dtype).contiguous()
        width, heads = weight.shape[0] - 1, weight.shape[1] // dim
        features = workspace("crosslayer:features", [batch, tokens, width], dtype, device)
        column = 0
        for x in inputs:  # [B, h, T, D] -> columns of [B, T, h * D], head-major per token
            view = features[:, :, column : column + x.shape[1] * dim].view(batch, tokens, x.shape[1], dim)
            view.copy_(x.transpose(1, 2))
            column += x.shape[1] * dim
        product = workspace("crosslayer:product", [batch * tokens, heads * dim], dtype, device)
        torch.mm(features.view(batch * tokens, width), self._cast[(name, dtype)], out=product)
        predicted = product.view(batch, tokens, heads, dim).transpose(1, 2)
        bias = weight[-1].view(heads, 1, dim)
        return predicted + bias if out is None else out.add_(predicted).add_(bias)  # a new tensor, or added to out


def fit_affine(inputs: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """Least-squares ``[inputs, 1] @ W ~ targets`` (``[N, I]``, ``[N, O]``) with a ridge of ``ridge`` times the
    mean diagonal of the normal matrix (a scale-free regularizer; the bias is not penalized): ``W [I + 1, O]``."""
    design = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype, device=inputs.device)], dim=1).double()
    normal = design.T @ design
    penalty = ridge * normal.diagonal()[:-1].mean()
    normal[range(len(normal) - 1), range(len(normal) - 1)] += penalty
    return torch.linalg.solve(normal, design.T @ targets.double()).float()


def heads_as_features(x: torch.Tensor) -> torch.Tensor:
    """``[H, T, D]`` -> ``[T, H * D]`` (the layout :class:`LayerPredictor` reads a token's heads in)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)
