"""The engine's forward for the llama-shaped families, without Hugging Face's per-op layer code.

A batch-1 decode step through HF's modules ran ~6,900 torch ops (about 230 per layer: norms computed in
six ops, three separate q/k/v matmuls and two for gate/up, RoPE per tensor, shape bookkeeping), and on one
core they cost as much as the weight matmuls themselves (issue 65). This forward computes the same layers
with fused projections (q/k/v and gate/up concatenated once, the original modules' weights becoming views
of the fused ones, so no memory is added and HF's forward keeps working on the same model), RoPE applied
to queries and keys in one pass, and norms in three ops. Attention goes through the caller's per-layer
``attend(module, query, key, value, scaling, sliding_window, softcap)`` (the engine's paged step), so every
storage kind serves it unchanged.

The arithmetic is HF's, op for op where it matters (norms round as HF's do, RoPE is the same per element);
fused matmuls may differ from separate ones in the last bits, which the engine's equality tests bound.
Families not listed in :data:`FAMILIES`, and models whose modules do not have the expected shape, keep HF's
forward (:func:`lean_forward_for` returns None).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

#: ``attend(module, query [T, heads, D], key, value [T, kv_heads, D], scaling, sliding_window, softcap)``
#: -> ``[1, T, heads, D]``: one layer's attention over the caller's KV storage (token-major inputs, as the
#: projections lay them out).
Attend = Callable[..., torch.Tensor]


def _config_window(attention: torch.nn.Module) -> int | None:
    return getattr(attention.config, "sliding_window", None)


def _module_window(attention: torch.nn.Module) -> int | None:
    return getattr(attention, "sliding_window", None)


#: Families whose decoder layer is pre-norm RMSNorm -> attention (q/k/v/o) -> residual -> RMSNorm -> gated MLP
#: -> residual, with HF's llama RMSNorm and rotate-half RoPE; the value says where a layer's sliding window is
#: read (each family passes it to its attention function from a different place).
FAMILIES: dict[str, Callable[[torch.nn.Module], int | None]] = {
    "llama": lambda attention: None,
    "mistral": _config_window,
    "qwen2": _module_window,
}


def rms_norm(hidden: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's llama RMSNorm: normalised in fp32, rounded to the input's dtype, then scaled by the weight."""
    return F.rms_norm(hidden.float(), hidden.shape[-1:], None, eps).to(hidden.dtype) * weight


def fuse_linears(linears: Sequence[torch.nn.Linear]) -> torch.nn.Linear:
    """One linear computing ``linears`` side by side; their weights (and biases) become views of its own.

    The fused module has the class of the first (a packed bf16 linear stays one, packing its fused weight on
    first use); the originals' packed copies, if any, are dropped, to be rebuilt only if HF's forward runs them.
    """
    first = linears[0]
    weight = torch.cat([linear.weight.detach() for linear in linears])
    has_bias = [linear.bias is not None for linear in linears]
    if any(has_bias) and not all(has_bias):
        raise ValueError("fuse_linears: some linears have a bias and some do not")
    bias = torch.cat([linear.bias.detach() for linear in linears]) if all(has_bias) else None
    fused = torch.nn.Linear(first.in_features, weight.shape[0], bias=bias is not None, device="meta")
    fused.__class__ = type(first)
    fused.weight = torch.nn.Parameter(weight, requires_grad=False)
    fused.bias = torch.nn.Parameter(bias, requires_grad=False) if bias is not None else None
    start = 0
    for linear in linears:
        rows = linear.out_features
        linear.weight = torch.nn.Parameter(weight[start : start + rows], requires_grad=False)
        if bias is not None:
            linear.bias = torch.nn.Parameter(bias[start : start + rows], requires_grad=False)
        for name in ("packed", "packed_from"):
            if hasattr(linear, name):
                setattr(linear, name, None)
        start += rows
    for name in ("packed", "packed_from"):
        if hasattr(first, name):
            setattr(fused, name, None)
    return fused


class LeanLayer:
    """One decoder layer's weights, fused, and its forward over a flattened ``[tokens, hidden]`` batch."""

    def __init__(self, layer: torch.nn.Module, window: int | None, mlp_rows: int | None) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.attention = attention
        self.head_dim = attention.head_dim
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.qkv = fuse_linears([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = attention.o_proj
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.act = mlp.act_fn
        self.input_norm, self.post_norm = layer.input_layernorm, layer.post_attention_layernorm
        self.scaling, self.window = attention.scaling, window
        self.mlp_rows = mlp_rows

    def __call__(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, attend: Attend) -> torch.Tensor:
        tokens, dim = hidden.shape[0], self.head_dim
        normed = rms_norm(hidden, self.input_norm.weight, self.input_norm.variance_epsilon)
        qkv = self.qkv(normed)
        query_key = qkv[:, : (self.heads + self.kv_heads) * dim].view(tokens, -1, dim)
        # HF's ``x * cos + rotate_half(x) * sin``, element for element: rotate_half(x) * sin is the halves swapped
        # (a roll) times ``sin`` with its first half negated (:meth:`LeanForward.rotary_tables`)
        rotated = query_key * cos + query_key.roll(dim // 2, -1) * sin
        value = qkv[:, (self.heads + self.kv_heads) * dim :].view(tokens, self.kv_heads, dim)
        attended = attend(self.attention, rotated[:, : self.heads], rotated[:, self.heads :], value, self.scaling,
                          self.window, None)  # fmt: skip
        hidden = hidden + self.o_proj(attended.reshape(tokens, self.heads * dim))
        normed = rms_norm(hidden, self.post_norm.weight, self.post_norm.variance_epsilon)
        if self.mlp_rows is None or tokens <= self.mlp_rows:
            return hidden + self._mlp(normed)
        # a long chunk's MLP activations spill out of the CPU's caches: computed in slices (ModelRunner.MLP_ROWS)
        return hidden + torch.cat([self._mlp(part) for part in normed.split(self.mlp_rows)])

    def _mlp(self, normed: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up(normed).chunk(2, dim=-1)
        return self.down(self.act(gate) * up)


@dataclass
class LeanForward:
    """The model's decoder run layer by layer over the engine's flattened batch (``tokens`` rows, one sequence
    axis dropped), returning the logits of the rows asked for."""

    embed: torch.nn.Module
    rotary: torch.nn.Module
    layers: list[LeanLayer]
    norm: torch.nn.Module
    head: torch.nn.Module

    def rotary_tables(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The model's own RoPE ``cos`` and ``sin`` at ``positions`` (every scaling type its rotary module knows),
        ``[tokens, 1, head_dim]``, with ``sin``'s first half negated: rotate-half RoPE then needs a roll, not a
        concatenation of a negated half (the same numbers: a negation is exact)."""
        cos, sin = self.rotary(hidden[None], positions[None])
        half = sin.shape[-1] // 2
        signed = torch.cat((-sin[..., :half], sin[..., half:]), -1)
        return cos[0, :, None], signed[0, :, None]

    def __call__(
        self, ids: torch.Tensor, positions: torch.Tensor, attends: Sequence[Attend], logit_rows: torch.Tensor
    ) -> torch.Tensor:
        """``ids``/``positions`` ``[tokens]``; ``attends[i]`` is layer ``i``'s attention; returns ``[rows, vocab]``
        in the model's dtype."""
        hidden = self.embed(ids)
        cos, sin = self.rotary_tables(hidden, positions)
        for layer, attend in zip(self.layers, attends):
            hidden = layer(hidden, cos, sin, attend)
        # the final norm runs as a module over every row, as in HF's forward (its hooks see what HF's would)
        return self.head(self.norm(hidden[None])[0].index_select(0, logit_rows))


def lean_forward_for(model: torch.nn.Module, mlp_rows: int | None = None) -> LeanForward | None:
    """The lean forward of ``model`` (fusing its projections in place), or None where its family or its modules'
    shape is not one this forward computes exactly as HF does."""
    config = model.config.get_text_config()
    window_of = FAMILIES.get(getattr(config, "model_type", None))
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if window_of is None or decoder is None or not _llama_shaped(decoder):
        return None
    layers = [LeanLayer(layer, window_of(layer.self_attn), mlp_rows) for layer in decoder.layers]
    return LeanForward(decoder.embed_tokens, decoder.rotary_emb, layers, decoder.norm, model.get_output_embeddings())


def _llama_shaped(decoder: torch.nn.Module) -> bool:
    """Whether every layer has exactly the modules this forward reads (no extra norms, q/k norms or the like)."""
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not isinstance(getattr(decoder, name, None), torch.nn.Module):
            return False
    for layer in decoder.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        names = {name for name, _ in layer.named_children()}
        if names != {"self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}:
            return False
        if {name for name, _ in attention.named_children()} != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return False
        if not {"gate_proj", "up_proj", "down_proj"} <= {name for name, _ in mlp.named_children()}:
            return False
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(isinstance(linear, torch.nn.Linear) for linear in linears):
            return False
        for norm in (layer.input_layernorm, layer.post_attention_layernorm):
            if not hasattr(norm, "variance_epsilon") or type(norm).__name__ not in LLAMA_NORMS:
                return False
    return True


#: RMSNorm classes computing exactly :func:`rms_norm` (HF's llama formula, copied into these families).
LLAMA_NORMS = {"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm"}
