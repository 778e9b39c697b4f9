"""The engine's forward for llama, mistral, qwen2, gemma and gemma2, without Hugging Face's per-op layer code.

A batch-1 decode step through HF's modules ran ~6,900 torch ops (about 230 per layer: norms computed in
six ops, three separate q/k/v matmuls and two for gate/up, RoPE per tensor with a concatenation, shape
bookkeeping), and on one core they cost as much as the weight matmuls themselves (issue 65). This forward
computes the same layers with fused projections (q/k/v and gate/up concatenated once, the original
modules' weights becoming views of the fused ones, so no memory is added and HF's forward keeps working on
the same model), RoPE applied to queries and keys in one pass, and norms in three ops. Attention goes
through the caller's per-layer ``attend`` (the engine's paged step), so every storage kind serves it
unchanged.

The arithmetic is HF's, op for op where rounding can differ (norms round where HF's do, RoPE is the same
per element): the engine's tokens and log-probabilities through it are bit-equal to HF's forward on the
default model in fp32 and bf16 (tested on the tiny families). Families not in :data:`FAMILIES`, and models
whose layers hold other modules (a newer release's q/k norms), keep HF's forward (:func:`lean_forward_for`
returns None).
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvopt.models.few_rows import few_rows_forward
from kvopt.models.int8_linear import Int8Linear

#: ``attend(module, query [T, heads, D], key, value [T, kv_heads, D], scaling, sliding_window, softcap)``
#: -> ``[1, T, heads, D]``: one layer's attention over the caller's KV storage (token-major inputs, as the
#: projections lay them out).
Attend = Callable[..., torch.Tensor]


def _llama_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Llama's RMSNorm: normalised in fp32, rounded to the input's dtype, then scaled by the weight."""
    return F.rms_norm(hidden.float(), hidden.shape[-1:], None, norm.variance_epsilon).to(hidden.dtype) * norm.weight


def _gemma_norm(hidden: torch.Tensor, norm: torch.nn.Module) -> torch.Tensor:
    """Gemma's RMSNorm: scaled by ``1 + weight`` in fp32, rounded once at the end."""
    normed = F.rms_norm(hidden.float(), hidden.shape[-1:], None, norm.eps)
    return (normed * (1.0 + norm.weight.float())).to(hidden.dtype)


def _llama_eps(norm: torch.nn.Module) -> float:
    return norm.variance_epsilon


def _gemma_eps(norm: torch.nn.Module) -> float:
    return norm.eps


@dataclass(frozen=True)
class Family:
    """How one family's decoder layer differs from llama's: its RMSNorm (and the HF classes computing it), where a
    layer's sliding window is read, and whether norms also wrap the attention and MLP outputs (Gemma 2's
    sandwich). Attention soft-capping and final-logit soft-capping are read from the modules and config."""

    norm: Callable[[torch.Tensor, torch.nn.Module], torch.Tensor]
    norm_classes: frozenset[str]
    window: Callable[[torch.nn.Module], int | None]
    #: The norm module's epsilon.
    eps: Callable[[torch.nn.Module], float] = _llama_eps
    #: Whether the norm scales by ``1 + weight`` in fp32 (Gemma's) rather than by the weight after rounding (llama's).
    plus_one: bool = False
    sandwich: bool = False

    def layer_norms(self) -> set[str]:
        return {"input_layernorm", "post_attention_layernorm"} | (
            {"pre_feedforward_layernorm", "post_feedforward_layernorm"} if self.sandwich else set()
        )


def _no_window(attention: torch.nn.Module) -> int | None:
    return None


def _config_window(attention: torch.nn.Module) -> int | None:
    return getattr(attention.config, "sliding_window", None)


def _module_window(attention: torch.nn.Module) -> int | None:
    return getattr(attention, "sliding_window", None)


#: The families this forward computes as HF does, by ``model_type``: pre-norm RMSNorm -> attention (q/k/v/o,
#: rotate-half RoPE) -> residual -> RMSNorm -> gated MLP -> residual.
FAMILIES: dict[str, Family] = {
    "llama": Family(_llama_norm, frozenset({"LlamaRMSNorm"}), _no_window),
    "mistral": Family(_llama_norm, frozenset({"MistralRMSNorm"}), _config_window),
    "qwen2": Family(_llama_norm, frozenset({"Qwen2RMSNorm"}), _module_window),
    "gemma": Family(_gemma_norm, frozenset({"GemmaRMSNorm"}), _no_window, _gemma_eps, plus_one=True),
    "gemma2": Family(_gemma_norm, frozenset({"Gemma2RMSNorm"}), _module_window, _gemma_eps, plus_one=True,
                     sandwich=True),
}


def fuse_linears(linears: Sequence[torch.nn.Module]) -> torch.nn.Module:
    """One linear computing ``linears`` side by side; their row tensors (``weight`` and ``bias``, or a class's own
    ``ROW_TENSORS``: an :class:`~kvopt.models.int8_linear.Int8Linear`'s int8 weight and scales) become views of its
    own (fusing them again, for a second engine on the same model, reuses that storage).

    The fused module is a copy of the first (a packed bf16 linear stays one, packing its fused weight on first use);
    the originals' packed copies, if any, are dropped, to be rebuilt only if HF's forward runs them.
    """
    first = linears[0]
    names = getattr(first, "ROW_TENSORS", ("weight", "bias"))
    for name in names:
        if len({getattr(linear, name) is None for linear in linears}) > 1:
            raise ValueError(f"fuse_linears: some linears have a {name} and some do not")
    fused = copy.copy(first)
    fused.__dict__.update({key: dict(value) for key, value in first.__dict__.items() if isinstance(value, dict)})
    fused.out_features = sum(linear.out_features for linear in linears)
    for name in names:
        if getattr(first, name) is None:
            continue
        whole = _side_by_side([getattr(linear, name).detach() for linear in linears])
        _set_rows(fused, name, whole)
        start = 0
        for linear in linears:
            _set_rows(linear, name, whole[start : start + linear.out_features])
            start += linear.out_features
    for module in (fused, *linears):
        for name in ("packed", "packed_from"):
            if hasattr(module, name):
                setattr(module, name, None)
    return fused


def _set_rows(module: torch.nn.Module, name: str, tensor: torch.Tensor) -> None:
    """Give ``module`` ``tensor`` as its parameter or buffer ``name`` (whichever it is)."""
    if name in module._parameters:
        module._parameters[name] = torch.nn.Parameter(tensor, requires_grad=False)
    else:
        module._buffers[name] = tensor


def _side_by_side(parts: list[torch.Tensor]) -> torch.Tensor:
    """``torch.cat(parts)``; a view, not a copy, when the parts already lie one after another in one storage (fused
    before: a second engine on the same model adds no weights)."""
    first, rows = parts[0], sum(part.shape[0] for part in parts)
    offset = first.storage_offset()
    for part in parts:
        if (part.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() or part.dtype != first.dtype
                or not part.is_contiguous() or part.storage_offset() != offset):  # fmt: skip
            return torch.cat(parts)
        offset += part.numel()
    return first.as_strided((rows, *first.shape[1:]), first.stride(), first.storage_offset())


def in_row_slices(forward: Callable[[torch.Tensor], torch.Tensor], rows: int | None, hidden: torch.Tensor) -> torch.Tensor:
    """``forward(hidden)`` computed over slices of at most ``rows`` tokens (the second-to-last axis; None: whole), for
    a forward that acts on each token alone."""
    if rows is None or hidden.shape[-2] <= rows:
        return forward(hidden)
    return torch.cat([forward(part) for part in hidden.split(rows, dim=-2)], dim=-2)


class TorchGlue:
    """A decoder layer's small steps between its matmuls (norms, the residual add before a norm, RoPE, the gated
    activation) in PyTorch ops: any device, any dtype, HF's arithmetic op for op."""

    def __init__(self, family: Family) -> None:
        self.family = family

    def norm(self, hidden: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        return self.family.norm(hidden, module)

    def add_norm(self, hidden: torch.Tensor, addend: torch.Tensor, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = hidden + addend
        return hidden, self.norm(hidden, module)

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        """The first ``heads`` heads of each row rotated: ``[tokens, heads, dim]``. HF's ``x * cos + rotate_half(x) *
        sin``, element for element: rotate_half(x) * sin is the halves swapped (a roll) times ``sin`` with its first
        half negated (:meth:`LeanForward.rotary_tables`)."""
        query_key = qkv[:, : heads * dim].view(qkv.shape[0], heads, dim)
        return query_key * cos + query_key.roll(dim // 2, -1) * sin

    def gated(self, act: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        """``act(gate) * up`` of a fused gate/up projection's rows."""

        def gated(gate_up: torch.Tensor) -> torch.Tensor:
            gate, up = gate_up.chunk(2, dim=-1)
            return act(gate) * up

        return gated


class KernelGlue(TorchGlue):
    """The same steps as one CPU kernel each (:func:`kvopt.kernels.cpu.layer_glue`), rounding where HF's modules
    round: a decode step's rows cost 8-14 us per RMSNorm in PyTorch's five kernels and casts, mostly dispatch."""

    def __init__(self, family: Family, ops) -> None:
        super().__init__(family)
        self.ops = ops

    def norm(self, hidden: torch.Tensor, module: torch.nn.Module) -> torch.Tensor:
        return self.ops.rms_norm(hidden, module.weight, self.family.eps(module), self.family.plus_one)

    def add_norm(self, hidden: torch.Tensor, addend: torch.Tensor, module: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
        return self.ops.add_rms_norm(hidden, addend, module.weight, self.family.eps(module), self.family.plus_one)

    def rotary(self, qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int, dim: int) -> torch.Tensor:
        return self.ops.rotary(qkv, cos, sin, heads, dim)

    def gated(self, act: torch.nn.Module) -> Callable[[torch.Tensor], torch.Tensor]:
        return self.ops.silu_mul if _is_silu(act) else super().gated(act)


def _is_silu(act: torch.nn.Module) -> bool:
    """PyTorch's SiLU module, or transformers' (``ACT2FN["silu"]``, a module of its own calling ``F.silu``)."""
    try:
        from transformers.activations import SiLUActivation
    except ImportError:  # a release without it names torch's
        return isinstance(act, torch.nn.SiLU)
    return isinstance(act, (torch.nn.SiLU, SiLUActivation))


def glue_for(family: Family, parameter: torch.Tensor) -> TorchGlue:
    """The CPU kernels' glue for fp32/bf16 weights on a CPU where they are built, else PyTorch's."""
    from kvopt.kernels.cpu import layer_glue

    on_cpu = parameter.device.type == "cpu" and parameter.dtype in (torch.float32, torch.bfloat16)
    ops = layer_glue() if on_cpu else None
    return KernelGlue(family, ops) if ops is not None else TorchGlue(family)


class LeanLayer:
    """One decoder layer's weights, fused, and its forward over a flattened ``[tokens, hidden]`` batch."""

    def __init__(self, layer: torch.nn.Module, family: Family, glue: TorchGlue, mlp_rows: int | None) -> None:
        attention, mlp = layer.self_attn, layer.mlp
        self.attention, self.glue = attention, glue
        self.head_dim = attention.head_dim
        self.heads = attention.q_proj.out_features // self.head_dim
        self.kv_heads = attention.k_proj.out_features // self.head_dim
        self.qkv = fuse_linears([attention.q_proj, attention.k_proj, attention.v_proj])
        self.o_proj = attention.o_proj
        self.gate_up = fuse_linears([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        # the projections' forwards, called directly (a decode step runs ~120 of them, each a few us of
        # Module.__call__ bookkeeping otherwise; the fused modules are the engine's own, without hooks), a decode
        # step's few rows through the CPU kernel
        self.projections = [few_rows_forward(module) for module in (self.qkv, self.o_proj, self.gate_up, self.down)]
        self.gated = glue.gated(mlp.act_fn)
        self.scaling, self.window = attention.scaling, family.window(attention)
        self.softcap = getattr(attention, "attn_logit_softcapping", None)
        self.input_norm = layer.input_layernorm
        if family.sandwich:  # Gemma 2: norms on the attention and MLP outputs too
            self.attention_out_norm, self.mlp_norm = layer.post_attention_layernorm, layer.pre_feedforward_layernorm
            self.mlp_out_norm = layer.post_feedforward_layernorm
        else:
            self.attention_out_norm, self.mlp_norm, self.mlp_out_norm = None, layer.post_attention_layernorm, None
        self.mlp_rows = mlp_rows

    def __call__(
        self, hidden: torch.Tensor, pending: torch.Tensor | None, cos: torch.Tensor, sin: torch.Tensor, attend: Attend
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden, pending)`` after this layer: the residual stream and the MLP output still to be added to it (the
        add runs with the next norm, in one pass)."""
        tokens, dim, glue = hidden.shape[0], self.head_dim, self.glue
        if pending is None:
            normed = glue.norm(hidden, self.input_norm)
        else:
            hidden, normed = glue.add_norm(hidden, pending, self.input_norm)
        qkv_forward, o_forward = self.projections[:2]
        qkv = qkv_forward(normed)
        rotated = glue.rotary(qkv, cos, sin, self.heads + self.kv_heads, dim)
        value = qkv[:, (self.heads + self.kv_heads) * dim :].view(tokens, self.kv_heads, dim)
        attended = attend(self.attention, rotated[:, : self.heads], rotated[:, self.heads :], value, self.scaling,
                          self.window, self.softcap)  # fmt: skip
        out = self._out(o_forward(attended.reshape(tokens, self.heads * dim)), self.attention_out_norm)
        hidden, normed = glue.add_norm(hidden, out, self.mlp_norm)
        # a long chunk's MLP activations spill out of the CPU's caches: computed in slices (ModelRunner.MLP_ROWS)
        return hidden, self._out(in_row_slices(self._mlp, self.mlp_rows, normed), self.mlp_out_norm)

    def _out(self, output: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
        return output if norm is None else self.glue.norm(output, norm)

    def _mlp(self, normed: torch.Tensor) -> torch.Tensor:
        gate_up, down = self.projections[2:]
        return down(self.gated(gate_up(normed)))


@dataclass
class LeanForward:
    """The model's decoder run layer by layer over the engine's flattened batch (``tokens`` rows, one sequence
    axis dropped), returning the logits of the rows asked for."""

    embed: torch.nn.Module
    rotary: torch.nn.Module
    layers: list[LeanLayer]
    norm: torch.nn.Module
    head: torch.nn.Module
    #: Gemma 2's final-logit soft-capping (None: none).
    softcap: float | None = None

    def __post_init__(self) -> None:
        #: The output projection over the sampled rows (a decode step's few through the CPU kernel).
        self.head_forward = few_rows_forward(self.head)

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
        pending = None
        for layer, attend in zip(self.layers, attends):
            hidden, pending = layer(hidden, pending, cos, sin, attend)
        hidden = hidden + pending
        # the final norm runs as a module over every row, as in HF's forward (its hooks see what HF's would)
        logits = self.head_forward(self.norm(hidden[None])[0].index_select(0, logit_rows))
        if self.softcap is not None:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


def lean_forward_for(model: torch.nn.Module, mlp_rows: int | None = None) -> LeanForward | None:
    """The lean forward of ``model`` (fusing its projections in place), or None where its family or its modules'
    shape is not one this forward computes exactly as HF does."""
    config = model.config.get_text_config()
    family = FAMILIES.get(getattr(config, "model_type", None))
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if family is None or decoder is None or not _shaped_as(decoder, family):
        return None
    glue = glue_for(family, next(model.parameters()))
    layers = [LeanLayer(layer, family, glue, mlp_rows) for layer in decoder.layers]
    softcap = getattr(config, "final_logit_softcapping", None)
    return LeanForward(decoder.embed_tokens, decoder.rotary_emb, layers, decoder.norm, model.get_output_embeddings(),
                       softcap)  # fmt: skip


def _shaped_as(decoder: torch.nn.Module, family: Family) -> bool:
    """Whether every layer has exactly the modules this forward reads for ``family`` (no extra norms, q/k norms or
    the like, which a newer release of the family might add)."""
    for name in ("embed_tokens", "rotary_emb", "norm", "layers"):
        if not isinstance(getattr(decoder, name, None), torch.nn.Module):
            return False
    norms = family.layer_norms()
    for layer in decoder.layers:
        attention, mlp = getattr(layer, "self_attn", None), getattr(layer, "mlp", None)
        if {name for name, _ in layer.named_children()} != {"self_attn", "mlp"} | norms:
            return False
        if {name for name, _ in attention.named_children()} != {"q_proj", "k_proj", "v_proj", "o_proj"}:
            return False
        if not {"gate_proj", "up_proj", "down_proj"} <= {name for name, _ in mlp.named_children()}:
            return False
        linears = [attention.q_proj, attention.k_proj, attention.v_proj, mlp.gate_proj, mlp.up_proj]
        if not all(isinstance(linear, (torch.nn.Linear, Int8Linear)) for linear in linears):
            return False
        if any(type(getattr(layer, name)).__name__ not in family.norm_classes for name in norms):
            return False
    return type(decoder.norm).__name__ in family.norm_classes
