"""Attention as pure tensor functions, written once for every storage kind and the paged engine.

Scale, soft-capped logits, the visibility mask (causal by stored position, validity, sliding window),
softmax with its log-sum-exp, and the exact merge of attention over disjoint key sets through their
log-sum-exps. Nothing here knows HF's hooks (:mod:`kvopt.cache.attention`) or a storage layout: callers
hand in queries ``[B, H, q, D]``, keys and values ``[B, H_kv, T, D]`` (GQA groups are folded into the
query axis, never expanded in storage), positions and masks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kvopt.kernels import cpu as cpu_kernels


def default_scale(query: torch.Tensor, scaling: float | None) -> float:
    """The logit scale: the model's ``scaling``, else ``head_dim ** -0.5`` (HF passes None for the default)."""
    return scaling if scaling is not None else query.shape[-1] ** -0.5


def grouped_logits(query: torch.Tensor, keys: torch.Tensor, scale: float, softcap: float | None = None) -> torch.Tensor:
    """fp32 logits ``[B, H_kv, group * q, T]`` of ``query [B, H, q, D]`` over ``keys [B, H_kv, T, D]``, each GQA
    group folded into the query axis (query head-major), soft-capped as Gemma 2 does when ``softcap`` is set."""
    batch, kv_heads = keys.shape[:2]
    folded = query.float().reshape(batch, kv_heads, -1, query.shape[-1]) * scale
    logits = torch.matmul(folded, keys.float().transpose(-1, -2))
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _needs_window(key_positions: torch.Tensor, query_positions: torch.Tensor, sliding_window: int | None) -> bool:
    """Whether a sliding window hides any of these keys from any of these queries (one device sync when set)."""
    return sliding_window is not None and bool((query_positions.max() - key_positions.min() >= sliding_window).item())


def visibility(
    key_positions: torch.Tensor,
    key_valid: torch.Tensor | None,
    query_positions: torch.Tensor,
    sliding_window: int | None = None,
) -> torch.Tensor | None:
    """``[B, 1 or H_kv, q, T]`` True where a query may see a key; None when it sees them all.

    A query sees a key when the key is valid (not padding), not in its future, and (for sliding layers)
    less than ``sliding_window`` positions older. ``key_positions [B, 1 or H_kv, T]`` (one row for all
    heads, or one per KV head after head-wise eviction), ``key_valid`` alike or None (all real);
    ``query_positions`` is ``[q]``, or ``[B, q]`` when rows' queries sit at different indices (tokens
    FastKV propagated). Callers keep stored keys out of the future of a lone query (decoding), so one
    query needs no causal mask.
    """
    window = _needs_window(key_positions, query_positions, sliding_window)
    if query_positions.numel() == 1 and not window and key_valid is None:
        return None
    kp = key_positions[:, :, None, :]
    qp = query_positions.reshape(-1, 1, query_positions.shape[-1], 1)
    mask = kp <= qp
    if window:
        mask = mask & (qp - kp < sliding_window)
    if key_valid is not None:
        mask = mask & key_valid[:, :, None, :]
    return mask


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
    """Masked GQA attention of ``query [B, H, q, D]`` over ``keys/values [B, H_kv, T, D]`` (see :func:`visibility`).

    Returns ``[B, q, H, D]`` in the query's dtype, as HF attention functions do; through SDPA as HF's
    ``sdpa`` integration calls it, so lossless caches stay bit-close to HF.
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
    scale = default_scale(query, scaling)
    keys, values = keys.float(), values.float()
    if mask is None:
        return _split_kv_flash(folded, keys, values, scale, (batch, heads, q_len))
    mask = _fold_mask(mask, group)
    bias = torch.zeros(mask.shape, dtype=torch.float32, device=mask.device).masked_fill_(~mask, float("-inf"))
    output, lse = _CPU_FLASH(folded, keys, values, attn_mask=bias, scale=scale)[:2]
    # The kernel reports lse 0 for a query that sees no key: make it weigh nothing.
    lse = lse.masked_fill(~mask.any(dim=-1).expand_as(lse), float("-inf"))
    return output.reshape(batch, heads, q_len, -1), lse.reshape(batch, heads, q_len)


def causal_attention_with_lse(query, keys, values, scaling, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` of a chunk over its own keys (``q == T``), query ``i`` seeing keys ``0..i``.

    On CPU the flash kernel's causal mode skips the blocks above the diagonal; a mask would make it read every
    block and a ``[q, T]`` bias per head group (5x slower at 2.5k tokens). GQA repeats the chunk's keys per
    group (folding the group into the query axis would break the diagonal).
    """
    if softcap is not None or not cpu_flash_available(query):
        own = torch.arange(query.shape[2], device=query.device)
        return _explicit_attention_with_lse(query, keys, values, (own[None, :] <= own[:, None])[None, None], scaling,
                                            softcap)  # fmt: skip
    group = query.shape[1] // keys.shape[1]
    keys, values = keys.float().repeat_interleave(group, dim=1), values.float().repeat_interleave(group, dim=1)
    output, lse = _CPU_FLASH(query.float(), keys, values, is_causal=True, scale=default_scale(query, scaling))[:2]
    return output, lse


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


def merge_with_lse(parts: list[tuple[torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax attention over the union of disjoint key sets, from each set's ``(output, lse)``."""
    if len(parts) == 1:
        return parts[0]
    return merge_pieces(torch.stack([out for out, _ in parts]), torch.stack([lse for _, lse in parts]), axis=0)


def _fold_mask(mask: torch.Tensor, group: int) -> torch.Tensor:
    """``[B, h, q, T]`` -> ``[B, h, group * q, T]``, matching the folded query axis."""
    batch, heads, q_len, keys = mask.shape
    return mask[:, :, None].expand(-1, -1, group, -1, -1).reshape(batch, heads, group * q_len, keys)


def _explicit_attention_with_lse(query, keys, values, mask, scaling, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`attention_with_lse` as an explicit fp32 softmax (soft-capping, non-CPU devices, reference)."""
    weights, lse = softmax_with_lse(query, keys, mask, scaling, softcap)
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
    weights, lse = softmax_with_lse(query, keys, mask, scaling, softcap)
    batch, heads, q_len, _ = query.shape
    output = torch.matmul(weights, values.float()).reshape(batch, heads, q_len, -1)
    rows = weights.reshape(batch, 1, heads * q_len, weights.shape[-1])  # query head-major, as the output
    sums = [torch.matmul(rows, x.float()).transpose(1, 2).reshape(batch, heads, q_len, -1) for x in shared]
    return output, torch.cat(sums, dim=-1), lse.reshape(batch, heads, q_len)


def softmax_with_lse(query, keys, mask, scaling, softcap=None) -> tuple[torch.Tensor, torch.Tensor]:
    """Attention weights ``[B, H_kv, group * q, T]`` (the group folded into the query axis) and their
    log-sum-exp ``[B, H_kv, group * q]``; a query that sees no key weighs nothing (weights 0, lse -inf)."""
    logits = grouped_logits(query, keys, default_scale(query, scaling), softcap)
    if mask is not None:
        logits = logits.masked_fill(~_fold_mask(mask, query.shape[1] // keys.shape[1]), float("-inf"))
    lse = torch.logsumexp(logits, dim=-1)
    return torch.exp(logits - lse[..., None]).nan_to_num(0.0), lse


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
    """``(output, lse)`` of unmasked attention over ``[B, H, q, D]`` inputs of one dtype with equal head counts:
    the output in that dtype, the log-sum-exp in fp32 (bf16 inputs accumulate in fp32 inside the kernel)."""
    return _CPU_FLASH(query, keys, values, scale=scale)[:2]


def decode_kernel_serves(device: torch.device | str, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> bool:
    """Whether :func:`decode_over_runs` serves a paged pool of this shape on ``device`` (the CPU kernel of
    :mod:`kvopt.kernels.cpu`, built here on first asking; False where it cannot be)."""
    return torch.device(device).type == "cpu" and cpu_kernels.decode_attention_serves(dtype, head_dim, heads // kv_heads)


@dataclass(frozen=True)
class GroupRecords:
    """Quantized groups the CPU decode kernel reads in place (:func:`decode_over_runs`): one layer's code pools as
    bytes ``[kv_heads, blocks, block bytes]``, where each sequence's groups lie (``blocks``/``records [S, G]``, the
    first ``counts [S]`` of each row real) and how a record is laid out
    (:attr:`~kvopt.engine.kv.compressed.CodeFormat.kernel_layout`)."""

    key_records: torch.Tensor
    value_records: torch.Tensor
    blocks: torch.Tensor
    records: torch.Tensor
    counts: torch.Tensor
    layout: list[int]


def decode_over_runs(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, runs: torch.Tensor, offsets: torch.Tensor,
    scale: float, groups: GroupRecords | None = None,
    written: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """One query per sequence over its slots of a pool, all visible (and over its quantized ``groups``, if any),
    through the CPU decode kernel (where :func:`decode_kernel_serves`): ``query [S, heads, D]`` (fp32 or bf16, rows
    contiguous), ``keys``/``values [kv_heads, slots, D]``, sequence ``s`` reading runs ``offsets[s]:offsets[s+1]``
    of ``runs [R, 2]`` (``(start, stop)``); ``written``: ``(keys [T, kv_heads, D], values, slots [T])`` stored to
    the pool in the same call, before attending (a decode step's own tokens). Returns the output ``[S, heads, D]``
    and log-sum-exp ``[S, heads]``, fp32 (accumulated in fp32 whatever the pool's dtype), every part merged."""
    count, heads, dim = query.shape
    kv_heads = keys.shape[0]
    folded = query.view(count, kv_heads, heads // kv_heads, dim)
    code_args = () if groups is None else (groups.key_records, groups.value_records, groups.blocks.contiguous(),
                                           groups.records.contiguous(), groups.counts.contiguous(), groups.layout)  # fmt: skip
    write = {} if written is None else dict(zip(("new_keys", "new_values", "slots"), written))
    output, lse = cpu_kernels.decode_attention()(folded, keys, values, runs, offsets, scale, *code_args, **write)
    return output.view(count, heads, dim), lse.view(count, heads)


def codes_kernel_serves(query: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether :func:`decode_over_codes` serves queries like ``query [S, H, 1, D]`` over a layer's pool ``[kv_heads,
    slots, D]`` (the CPU kernel built, a head dim and GQA group it reads)."""
    return query.shape[2] == 1 and decode_kernel_serves(query.device, pool.dtype, query.shape[1], pool.shape[0],
                                                        query.shape[-1])  # fmt: skip


def decode_over_codes(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, groups: GroupRecords, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:  # fmt: skip
    """:func:`decode_over_runs` over the quantized ``groups`` alone (``keys``/``values``: the layer's pools)."""
    empty = torch.zeros(0, 2, dtype=torch.long)
    offsets = torch.zeros(query.shape[0] + 1, dtype=torch.long)
    return decode_over_runs(query, keys, values, empty, offsets, scale, groups)
