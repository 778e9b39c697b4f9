"""Cross-layer linear predictors of pre-RoPE keys and values (AQUA-KV, arXiv 2501.19392).

Much of a layer's KV is a linear function of the layer before it: on the default model a
least-squares map from layer ``l - 1``'s pre-RoPE keys explains about 65% of the variance of
layer ``l``'s, and one from layer ``l``'s keys and layer ``l - 1``'s values about 68% of its values
(held-out text, all KV heads of a token at once; per head alone: 45% and 42%). A quantizer that
stores only what the predictor leaves unexplained spends its bits on a residual about 0.6 times as
large. The weights are per model (fitted once, :mod:`kvopt.methods.aquakv`); this module applies them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvopt.cache.quant import workspace


@dataclass
class LayerPredictor:
    """One layer's predictors, over the concatenated KV heads of a token (``H`` heads of ``D`` channels here,
    ``S`` in the source layer), with a bias row last:

    * keys: ``[source keys, 1] @ key_weight``, ``key_weight [S * D + 1, H * D]``;
    * values: ``[keys, source values, 1] @ value_weight``, ``value_weight [(H + S) * D + 1, H * D]``.
    """

    key_weight: torch.Tensor
    value_weight: torch.Tensor

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.key_weight, self.value_weight))

    def keys(self, source_keys: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted pre-RoPE keys ``[B, H, T, D]`` from the source layer's ``[B, S, T, D]`` (added to ``out``
        in place when given)."""
        return affine([source_keys], self.key_weight, out)

    def values(self, keys: torch.Tensor, source_values: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Predicted values ``[B, H, T, D]`` from this layer's keys ``[B, H, T, D]`` and the source's values (added
        to ``out`` in place when given)."""
        return affine([keys, source_values], self.value_weight, out)


def affine(inputs: list[torch.Tensor], weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``[inputs (heads concatenated per token), 1] @ weight`` as ``[B, H, T, D]``, into a new tensor or added to
    ``out`` (contiguous): one matrix product per batch row and output head, written in place."""
    batch, _, tokens, dim = inputs[0].shape
    width = sum(x.shape[1] for x in inputs) * dim
    features = workspace("crosslayer:features", [batch, tokens, width], torch.float32, inputs[0].device)
    column = 0
    for x in inputs:  # [B, h, T, D] -> columns of [B, T, h * D], head-major per token
        features[:, :, column : column + x.shape[1] * dim].view(batch, tokens, x.shape[1], dim).copy_(x.transpose(1, 2))
        column += x.shape[1] * dim
    heads = weight.shape[1] // dim
    accumulate = out is not None
    out = torch.empty(batch, heads, tokens, dim, device=features.device) if out is None else out
    for row in range(batch):
        for head in range(heads):
            columns = slice(head * dim, (head + 1) * dim)
            if accumulate:
                out[row, head].addmm_(features[row], weight[:-1, columns]).add_(weight[-1, columns])
            else:
                torch.addmm(weight[-1, columns], features[row], weight[:-1, columns], out=out[row, head])
    return out


def fit_affine(inputs: torch.Tensor, targets: torch.Tensor, ridge: float) -> torch.Tensor:
    """Least-squares ``[inputs, 1] @ W ~ targets`` (``[N, I]``, ``[N, O]``) with a ridge of ``ridge`` times the
    mean diagonal of the normal matrix (a scale-free regularizer; the bias is not penalized): ``W [I + 1, O]``."""
    design = torch.cat([inputs, torch.ones(len(inputs), 1, dtype=inputs.dtype)], dim=1).double()
    normal = design.T @ design
    penalty = ridge * normal.diagonal()[:-1].mean()
    normal[range(len(normal) - 1), range(len(normal) - 1)] += penalty
    return torch.linalg.solve(normal, design.T @ targets.double()).float()


def heads_as_features(x: torch.Tensor) -> torch.Tensor:
    """``[H, T, D]`` -> ``[T, H * D]`` (the layout :class:`LayerPredictor` reads a token's heads in)."""
    return x.transpose(0, 1).reshape(x.shape[1], -1)
