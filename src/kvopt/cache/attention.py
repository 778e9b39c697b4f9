"""kvopt's attention function, registered through ``transformers.AttentionInterface``.

The seam: HF models call ``past_key_values.update(k, v, layer_idx)`` and then the configured
attention function. A :class:`~kvopt.cache.kv_cache.KVCache` does not store in ``update``; it
parks the new tensors and returns them. :func:`kvopt_attention` recognises them (by identity),
stores them with their padding bits taken from the mask, attends over what the layer's storage
holds (so storage may be evicted, quantized or paged), then lets the methods act with the
queries in hand. Any other cache, or no cache, gets plain attention over the tensors given.

Masks: for ``"kvopt"`` HF's mask builders call :func:`kvopt_mask`, which returns the 2-D
padding mask itself (``[batch, seen + new]``, True = real token); causality and sliding
windows are computed here from stored token positions, which stay right after eviction.
"""

from __future__ import annotations

import contextvars
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F

ATTENTION_NAME = "kvopt"


@dataclass
class PendingUpdate:
    """New key/value tensors a cache layer handed to the model, awaiting the attention call."""

    layer: weakref.ReferenceType
    keys: torch.Tensor


_PENDING: contextvars.ContextVar[PendingUpdate | None] = contextvars.ContextVar("kvopt_pending", default=None)


def park(layer, keys: torch.Tensor) -> None:
    """Called by a cache layer's ``update``: the next attention call on ``keys`` belongs to ``layer``."""
    _PENDING.set(PendingUpdate(weakref.ref(layer), keys))


def claim(keys: torch.Tensor):
    """The cache layer that parked ``keys``, or None when the tensors came from elsewhere."""
    pending = _PENDING.get()
    if pending is None or pending.keys is not keys:
        return None
    _PENDING.set(None)
    return pending.layer()


def kvopt_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    dropout: float = 0.0,
    scaling: float | None = None,
    sliding_window: int | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """Attention over kvopt storage (or plain tensors); returns ``[batch, q_len, heads, head_dim]``."""
    if kwargs.get("s_aux") is not None:
        raise NotImplementedError("kvopt attention does not support attention sinks (s_aux) yet")
    if dropout and module.training:
        raise NotImplementedError("kvopt attention is for inference; disable dropout (model.eval())")
    padding = _padding_mask(attention_mask, key.shape[0])
    layer = claim(key)
    if layer is None:
        return _plain_attention(query, key, value, attention_mask, padding, scaling, sliding_window, softcap), None
    return layer.attend(module, query, key, value, padding, scaling, sliding_window, softcap), None


def _padding_mask(attention_mask: torch.Tensor | None, batch: int) -> torch.Tensor | None:
    if attention_mask is None:
        return None
    if attention_mask.ndim != 2:
        raise NotImplementedError(
            "kvopt attention received a prepared 4-D mask; pass a 2-D padding mask (the usual `attention_mask`)"
        )
    return attention_mask.to(torch.bool).expand(batch, -1)


def _plain_attention(query, key, value, attention_mask, padding, scaling, sliding_window, softcap):
    """No kvopt cache: the keys are the most recent ``kv_len`` tokens of each row (HF layout)."""
    kv_len, q_len = key.shape[-2], query.shape[-2]
    seen = padding.shape[-1] if padding is not None else kv_len
    key_positions = torch.arange(seen - kv_len, seen, device=key.device).expand(key.shape[0], 1, -1)
    key_valid = padding[:, None, seen - kv_len :] if padding is not None else None
    query_positions = torch.arange(seen - q_len, seen, device=key.device)
    return attend(query, key, value, key_positions, key_valid, query_positions, scaling, sliding_window, softcap)


def attend(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    query_positions: torch.Tensor,
    scaling: float | None,
    sliding_window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Masked GQA attention of ``query [B, H, q, D]`` over ``keys/values [B, H_kv, T, D]``.

    ``key_positions [B, 1 or H_kv, T]`` and ``query_positions [q]`` are sequence indices (one row
    shared by all heads, or one per KV head after head-wise eviction); a query sees a key when
    the key is valid, not in its future, and (for sliding layers) within the window.
    Returns ``[B, q, H, D]`` as HF attention functions do.
    """
    q_len, kv_len = query.shape[-2], keys.shape[-2]
    plain_prefill = q_len > 1 and key_valid is None and q_len == kv_len and softcap is None
    if plain_prefill and not _needs_window(key_positions, query_positions, sliding_window):
        return _sdpa_gqa(query, keys, values, None, True, scaling)  # let SDPA pick its causal kernel
    mask = visibility(key_positions, key_valid, query_positions, sliding_window)
    if mask is not None:
        # Rows with nothing to attend to (queries on left padding) would give NaN; their outputs
        # are never read, so let them attend everywhere.
        mask = mask | ~mask.any(dim=-1, keepdim=True)
    if softcap is not None:
        output, _ = _explicit_attention_with_lse(query, keys, values, mask, scaling, softcap)
        return output.to(query.dtype).transpose(1, 2).contiguous()
    return _sdpa_gqa(query, keys, values, mask, False, scaling)


def _needs_window(key_positions, query_positions, sliding_window) -> bool:
    return sliding_window is not None and bool((query_positions.max() - key_positions.min() >= sliding_window).item())


def visibility(key_positions, key_valid, query_positions, sliding_window=None) -> torch.Tensor | None:
    """``[B, 1 or H_kv, q, T]`` True where a query may see a key; None when it sees them all.

    ``query_positions`` is ``[q]``, or ``[B, q]`` when rows' queries sit at different indices (tokens
    FastKV propagated). Stored keys are never in the future of the newest query, so one query needs no causal mask.
    """
    needs_window = _needs_window(key_positions, query_positions, sliding_window)
    if query_positions.numel() == 1 and not needs_window and key_valid is None:
        return None
    kp = key_positions[:, :, None, :]
    qp = query_positions.reshape(-1, 1, query_positions.shape[-1], 1)
    mask = kp <= qp
    if needs_window:
        mask = mask & (qp - kp < sliding_window)
    if key_valid is not None:
        mask = mask & key_valid[:, :, None, :]
    return mask


def _hf_folds_single_queries() -> bool:
    """Whether this transformers' SDPA integration folds GQA groups for one query (5.3+)."""
    from transformers.integrations import sdpa_attention

    return hasattr(sdpa_attention, "pack_gqa")


def _sdpa_gqa(query, keys, values, mask, is_causal, scaling) -> torch.Tensor:
    """SDPA with the GQA strategy HF's ``sdpa`` integration uses, so ``full`` stays bit-close to it.

    No mask: SDPA's native GQA. One query token (transformers >= 5.3): fold the group into the
    query axis (no KV copies). Otherwise repeat KV heads for this call only (never stored expanded).
    """
    batch, heads, q_len, head_dim = query.shape
    groups = heads // keys.shape[1]
    if groups > 1 and mask is not None and q_len == 1 and FOLD_SINGLE_QUERIES:
        folded = query.reshape(batch, keys.shape[1], groups, head_dim)
        output = F.scaled_dot_product_attention(folded, keys, values, attn_mask=mask, scale=scaling)
        return output.reshape(batch, heads, 1, head_dim).transpose(1, 2).contiguous()
    if groups > 1 and mask is not None:
        keys = keys.repeat_interleave(groups, dim=1)
        values = values.repeat_interleave(groups, dim=1)
        mask = mask.repeat_interleave(groups, dim=1) if mask.shape[1] > 1 else mask
    output = F.scaled_dot_product_attention(
        query, keys, values, attn_mask=mask, is_causal=is_causal, scale=scaling, enable_gqa=groups > 1 and mask is None
    )
    return output.transpose(1, 2).contiguous()


def attention_with_lse(query, keys, values, mask, scaling, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output [B, H, q, D], lse [B, H, q])`` in fp32, each GQA group folded into the query axis (no KV copies).

    ``query [B, H, q, D]``, ``keys/values [B, H_kv, T, D]``, ``mask [B, 1 or H_kv, q, T]`` or None.
    The log-sum-exp lets attention over separately stored key sets (ragged, quantized blocks,
    merged layers, the dense residual) merge exactly (:func:`merge_with_lse`). On CPU this is
    PyTorch's flash-attention kernel, which returns it (about twice as fast as an explicit
    softmax at 1k keys); soft-capped logits (Gemma 2) and other devices take the explicit path.
    """
    if softcap is not None or query.device.type != "cpu" or _CPU_FLASH is None:
        return _explicit_attention_with_lse(query, keys, values, mask, scaling, softcap)
    batch, heads, q_len, dim = query.shape
    kv_heads = keys.shape[1]
    group = heads // kv_heads
    folded = query.float().reshape(batch, kv_heads, group * q_len, dim)
    scale = scaling if scaling is not None else dim**-0.5
    keys, values = keys.float(), values.float()
    if mask is None:
        return _split_kv_flash(folded, keys, values, scale, (batch, heads, q_len))
    mask = _fold_mask(mask, group)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    output, lse = _CPU_FLASH(folded, keys, values, attn_mask=bias, scale=scale)[:2]
    # The kernel reports lse 0 for a query that sees no key: make it weigh nothing.
    lse = lse.masked_fill(~mask.any(dim=-1).expand_as(lse), float("-inf"))
    return output.reshape(batch, heads, q_len, -1), lse.reshape(batch, heads, q_len)


def _split_kv_flash(folded, keys, values, scale, shape) -> tuple[torch.Tensor, torch.Tensor]:
    """Flash attention with each head's keys cut into pieces that run in parallel, merged by LSE.

    The CPU kernel parallelises over batch x heads x query blocks; decoding has one query block,
    so 3 KV heads on 2 threads leave one thread idle half the time. Cutting the keys into
    ``pieces`` (split-KV, as in flash-decoding) evens the work out; the pieces are views when
    the keys are contiguous (dequantized blocks), otherwise the keys run whole.
    """
    batch, heads, q_len = shape
    kv_heads, tokens, dim = keys.shape[1:]
    pieces = _kv_pieces(batch * kv_heads, tokens)
    if pieces > 1 and keys.is_contiguous() and values.is_contiguous():
        pieces_shape = (batch, kv_heads * pieces, tokens // pieces, dim)
        repeated = folded.repeat_interleave(pieces, dim=1)
        output, lse = _CPU_FLASH(repeated, keys.view(pieces_shape), values.view(pieces_shape), scale=scale)[:2]
        output = output.view(batch, kv_heads, pieces, -1, dim)
        output, lse = merge_pieces(output, lse.view(batch, kv_heads, pieces, -1), axis=2)
    else:
        output, lse = _CPU_FLASH(folded, keys, values, scale=scale)[:2]
    return output.reshape(batch, heads, q_len, -1), lse.reshape(batch, heads, q_len)


def _kv_pieces(items: int, tokens: int) -> int:
    """Pieces (a power of two dividing ``tokens``, each >= ``MIN_PIECE_TOKENS`` keys) per head that
    spread ``items`` x pieces work units most evenly over the threads (fewest pieces on a tie)."""
    threads = torch.get_num_threads()
    best, pieces = 1, 2
    while pieces <= MAX_KV_PIECES and tokens % pieces == 0 and tokens // pieces >= MIN_PIECE_TOKENS:
        if _imbalance(items * pieces, threads) < _imbalance(items * best, threads) - 1e-9:
            best = pieces
        pieces *= 2
    return best


def decode_pieces(kv_heads: int) -> int:
    """Pieces (a power of two) to cut each KV head's keys into so that ``kv_heads`` x pieces work
    units spread most evenly over the threads (fewest pieces on a tie): 2 for 3 KV heads on 2 threads."""
    threads = torch.get_num_threads()
    best, pieces = 1, 2
    while pieces <= MAX_KV_PIECES:
        if _imbalance(kv_heads * pieces, threads) < _imbalance(kv_heads * best, threads) - 1e-9:
            best = pieces
        pieces *= 2
    return best


def _imbalance(units: int, threads: int) -> float:
    """Busiest thread's share of ``units`` equal work units over the even share (1.0 = even)."""
    return -(-units // threads) * threads / units


def merge_pieces(outputs: torch.Tensor, lses: torch.Tensor, axis: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`merge_with_lse` over an axis of stacked parts (``outputs`` has one more trailing axis)."""
    total = torch.logsumexp(lses, dim=axis, keepdim=True)
    weights = torch.exp(lses - total).nan_to_num_(0.0)
    return (weights.unsqueeze(-1) * outputs).sum(dim=axis), total.squeeze(axis)


def _fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, h, q, T]`` -> ``[B, h, group * q, T]``, matching the folded query axis."""
    batch, heads, q_len, keys = mask.shape
    return mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, heads, group * q_len, keys)


def _explicit_attention_with_lse(query, keys, values, mask, scaling, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` as an explicit fp32 softmax (soft-capping, non-CPU devices, reference)."""
    weights, lse = _softmax_weights(query, keys, mask, scaling, softcap)
    batch, heads, q_len, _ = query.shape
    output = torch.matmul(weights, values.float())
    return output.reshape(batch, heads, q_len, -1), lse.reshape(batch, heads, q_len)


def attention_with_shared_sums(
    query, keys, values, shared: list[torch.Tensor], mask, scaling, softcap=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:  # fmt: skip
    """``(output [B, H, q, D], sums [B, H, q, E], lse [B, H, q])`` in fp32: attention, plus each query head's
    attention-weighted sums of the ``shared`` tensors ``[B, S, T, D]`` that every head reads (``E`` = their
    ``S * D`` channels, per token in :func:`~kvopt.cache.crosslayer.heads_as_features` order, tensor after tensor).

    Values that are a linear function of such tensors need not be built per token: attention over
    them is that function of these sums (AQUA-KV's value predictor, :mod:`kvopt.cache.nonuniform`).
    Outputs and sums merge across key sets like outputs (:func:`merge_with_lse` on their concatenation)."""
    weights, lse = _softmax_weights(query, keys, mask, scaling, softcap)
    batch, heads, q_len, _ = query.shape
    output = torch.matmul(weights, values.float()).reshape(batch, heads, q_len, -1)
    rows = weights.reshape(batch, 1, heads * q_len, weights.shape[-1])  # query head-major, as the output
    sums = [torch.matmul(rows, x.float()).transpose(1, 2).reshape(batch, heads, q_len, -1) for x in shared]
    return output, torch.cat(sums, dim=-1), lse.reshape(batch, heads, q_len)


def _softmax_weights(query, keys, mask, scaling, softcap) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention weights ``[B, H_kv, group * q, T]`` (the group folded into the query axis) and their lse."""
    _, heads, _, dim = query.shape
    batch, kv_heads = keys.shape[:2]
    group = heads // kv_heads
    scale = scaling if scaling is not None else dim**-0.5
    folded = query.float().reshape(batch, kv_heads, -1, dim) * scale
    scores = torch.matmul(folded, keys.float().transpose(-1, -2))  # [B, H_kv, g*q, T]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~_fold_mask(mask, group), float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]).nan_to_num(0.0), lse


def merge_with_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the union of disjoint key sets, from each set's ``(output, lse)``."""
    if len(parts) == 1:
        return parts[0]
    return merge_pieces(torch.stack([out for out, _ in parts]), torch.stack([lse for _, lse in parts]), axis=0)


def kvopt_mask(*, attention_mask: torch.Tensor | None = None, **_: object) -> torch.Tensor | None:
    """HF mask-interface hook: hand the 2-D padding mask through untouched (None if no padding)."""
    if attention_mask is None or attention_mask.ndim != 2 or bool(attention_mask.all()):
        return None
    return attention_mask


FOLD_SINGLE_QUERIES = _hf_folds_single_queries()
#: Split-KV decoding: at most this many pieces per head, none shorter than this many keys.
MAX_KV_PIECES = 16
MIN_PIECE_TOKENS = 256
#: PyTorch's CPU flash-attention kernel, which also returns the log-sum-exp (a private op: absent -> explicit softmax).
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def cpu_flash_available(query: torch.Tensor) -> bool:
    """Whether PyTorch's CPU flash kernel (the one that returns the log-sum-exp) serves ``query``'s device."""
    return query.device.type == "cpu" and _CPU_FLASH is not None


def cpu_flash(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(output, lse)`` of unmasked attention, fp32 ``[B, H, q, D]`` inputs with equal head counts."""
    return _CPU_FLASH(query, keys, values, scale=scale)[:2]


def register() -> None:
    """Register the attention and mask functions under ``"kvopt"`` (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(ATTENTION_NAME, kvopt_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, kvopt_mask)


def prepare(model) -> None:
    """Make ``model`` run its attention through kvopt (registered, not monkeypatched)."""
    register()
    if getattr(model.config, "_attn_implementation", None) == ATTENTION_NAME:
        return
    if hasattr(model, "set_attn_implementation"):
        model.set_attn_implementation(ATTENTION_NAME)
    else:
        model.config._attn_implementation = ATTENTION_NAME
