"""One query per row attending straight from bit-packed codes (KIVI's layout): a decode step's layer in two
Triton launches.

The torch path (:meth:`kvopt.cache.quantized.QuantizedKV.attend`, then the layer's merge with its residual)
unpacks a block of codes into fp32 keys and values, then attends and merges: on an H200, 47 more kernels
per layer than ``full``'s attention (BENCHMARKS.md, "On a GPU"), each reading or writing the whole block.
Here each program takes one (batch row, KV head) and a run of token groups (split-KV, as flash-decoding:
short contexts still fill the GPU), loads each group's packed bytes and fp16 scales once, dequantizes in
registers, and keeps an online softmax for the KV head's query heads (a GQA group attends together, so the
codes are read once per KV head). A layer's full-precision residual is one more split of the same launch;
padding tokens (a left-padded batch) get no weight. Each split writes its output and log-sum-exp, and a
second launch merges them (as :func:`kvopt.cache.attention.merge_with_lse` merges any two key sets) into
the output, in the layer's dtype and layout.

Layouts (see :mod:`kvopt.cache.quantized` and :mod:`kvopt.cache.quant`): codes ``[B, H, groups, G / k,
D]`` (keys per channel) or ``[B, H, groups, G / k, D / C, C]`` (per-token groups of ``C`` channels),
``k = 8 / bits`` codes per byte packed *planar* along the group's tokens (byte ``r`` holds tokens ``r,
r + G / k, ...``); scales and zero-points ``[B, H, groups, 1, D]`` or ``[B, H, groups, G, D / C, 1]``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from triton.compiler.errors import CompilationError
from triton.runtime.errors import OutOfResources

from kvopt import kernels

#: Programs one launch aims for: enough to fill every multiprocessor several times over.
PROGRAMS_PER_MULTIPROCESSOR = 4


@triton.jit
def _dequantized_tile(codes, scale, zero, code_tile, param_tile, shift, held, FIELD_MASK: tl.constexpr):
    """One token group ``[GROUP, DIM_BLOCK]`` in fp32 from its packed codes and fp16 parameters."""
    packed = tl.load(codes + code_tile, mask=held, other=0).to(tl.int32)
    scale = tl.load(scale + param_tile, mask=held, other=0.0).to(tl.float32)
    zero = tl.load(zero + param_tile, mask=held, other=0.0).to(tl.float32)
    return ((packed >> shift[:, None]) & FIELD_MASK).to(tl.float32) * scale + zero


@triton.jit
def _online_softmax_step(q, keys, values, valid, best, total, acc):
    """Fold a tile of keys and values (``valid [tokens]``) into the running max, sum of weights and weighted sum."""
    scores = tl.sum(q[:, None, :] * keys[None, :, :], axis=2)  # [QUERY_BLOCK, tokens]
    scores = tl.where(valid[None, :], scores, float("-inf"))
    new_best = tl.maximum(best, tl.max(scores, axis=1))
    base = tl.where(new_best == float("-inf"), 0.0, new_best)  # nothing seen yet (padding): weights stay 0
    weights = tl.exp(scores - base[:, None])
    rescale = tl.exp(best - base)
    total = total * rescale + tl.sum(weights, axis=1)
    acc = acc * rescale[:, None] + tl.sum(weights[:, :, None] * values[None, :, :], axis=1)
    return new_best, total, acc


@triton.jit
def _token_valid(valid, offset, tokens, stride, held, HAS_VALID: tl.constexpr):
    """Which of ``tokens`` (indices from ``offset``) are held and real (``valid`` is read only with ``HAS_VALID``)."""
    if HAS_VALID:
        return held & (tl.load(valid + (offset + tokens) * stride, mask=held, other=0) != 0)
    return held


#: Counts that change from step to step, and the split axis' stride that follows them: compiled as plain
#: integers, not specialized (a context growing through multiples of 16 would compile new variants as it decodes).
_STEP_COUNTS = ["groups", "groups_per_split", "quantized_splits", "dense_tokens", "l_h"]


@triton.jit(do_not_specialize=_STEP_COUNTS)
def _quantized_decode_kernel(
    query, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, dense_keys, dense_values,
    code_valid, dense_valid, out, lse,
    groups, groups_per_split, quantized_splits, dense_tokens, scaling,
    q_b, q_h,
    kc_b, kc_h, kc_g, kc_r,
    ks_b, ks_h, ks_g, ks_t, ks_c, ks_e,
    vc_b, vc_h, vc_g, vc_r,
    vs_b, vs_h, vs_g, vs_t, vs_c, vs_e,
    dk_b, dk_h, dk_t, dv_b, dv_h, dv_t,
    cv_b, cv_h, cv_t, dm_b, dm_h, dm_t,
    o_b, o_h, o_s, l_b, l_h,
    KV_HEADS: tl.constexpr, QUERY_GROUP: tl.constexpr, QUERY_BLOCK: tl.constexpr,
    HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr,
    BITS: tl.constexpr, GROUP: tl.constexpr, KEY_CHANNELS: tl.constexpr, VALUE_CHANNELS: tl.constexpr,
    CODES_MASKED: tl.constexpr, DENSE_MASKED: tl.constexpr,
):  # fmt: skip
    """Program (row x KV head, split): splits below ``quantized_splits`` read runs of token groups from the
    codes, the last one (when ``dense_tokens``) the full-precision residual; each writes its output and lse.
    Padding tokens (validity 0, when the ``*_MASKED`` flags say there is validity to read) get no weight."""
    row, split = tl.program_id(0), tl.program_id(1)
    batch, kv_head = row // KV_HEADS, row % KV_HEADS
    rows_per_group: tl.constexpr = GROUP * BITS // 8
    field_mask: tl.constexpr = (1 << BITS) - 1

    heads, dims, tokens = tl.arange(0, QUERY_BLOCK), tl.arange(0, DIM_BLOCK), tl.arange(0, GROUP)
    head_ok, dim_ok = heads < QUERY_GROUP, dims < HEAD_DIM
    query_heads = kv_head * QUERY_GROUP + heads
    query_rows = query + batch * q_b + query_heads[:, None] * q_h + dims[None, :]
    q = tl.load(query_rows, mask=head_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32) * scaling

    best = tl.full([QUERY_BLOCK], float("-inf"), tl.float32)
    total = tl.zeros([QUERY_BLOCK], tl.float32)
    acc = tl.zeros([QUERY_BLOCK, DIM_BLOCK], tl.float32)
    if split < quantized_splits:
        # Offsets within one token group: token t's code sits in byte row t % rows, field t // rows.
        byte_row, shift = tokens % rows_per_group, (tokens // rows_per_group) * BITS
        key_code_tile = byte_row[:, None] * kc_r + dims[None, :]
        value_code_tile = byte_row[:, None] * vc_r + dims[None, :]
        key_param_tile = (
            tokens[:, None] * ks_t + (dims // KEY_CHANNELS)[None, :] * ks_c + (dims % KEY_CHANNELS)[None, :] * ks_e
        )
        value_param_tile = (
            tokens[:, None] * vs_t + (dims // VALUE_CHANNELS)[None, :] * vs_c
            + (dims % VALUE_CHANNELS)[None, :] * vs_e
        )
        key_codes += batch * kc_b + kv_head * kc_h
        value_codes += batch * vc_b + kv_head * vc_h
        key_scale += batch * ks_b + kv_head * ks_h
        key_zero += batch * ks_b + kv_head * ks_h
        value_scale += batch * vs_b + kv_head * vs_h
        value_zero += batch * vs_b + kv_head * vs_h
        code_valid += batch * cv_b + kv_head * cv_h
        first = split * groups_per_split
        for group in range(first, first + groups_per_split):  # the last split may run past the groups held
            held = tokens < (groups - group) * GROUP  # all of a held group, none past the last
            valid = _token_valid(code_valid, group * GROUP, tokens, cv_t, held, CODES_MASKED)
            held = valid[:, None] & dim_ok[None, :]
            keys = _dequantized_tile(key_codes + group * kc_g, key_scale + group * ks_g, key_zero + group * ks_g,
                                     key_code_tile, key_param_tile, shift, held, field_mask)  # fmt: skip
            values = _dequantized_tile(value_codes + group * vc_g, value_scale + group * vs_g,
                                       value_zero + group * vs_g, value_code_tile, value_param_tile, shift, held,
                                       field_mask)  # fmt: skip
            best, total, acc = _online_softmax_step(q, keys, values, valid, best, total, acc)
    else:
        dense_keys += batch * dk_b + kv_head * dk_h
        dense_values += batch * dv_b + kv_head * dv_h
        dense_valid += batch * dm_b + kv_head * dm_h
        for start in range(0, dense_tokens, GROUP):
            valid = _token_valid(dense_valid, start, tokens, dm_t, start + tokens < dense_tokens, DENSE_MASKED)
            held = valid[:, None] & dim_ok[None, :]
            keys = tl.load(dense_keys + (start + tokens)[:, None] * dk_t + dims[None, :], mask=held, other=0.0)
            values = tl.load(dense_values + (start + tokens)[:, None] * dv_t + dims[None, :], mask=held, other=0.0)
            best, total, acc = _online_softmax_step(
                q, keys.to(tl.float32), values.to(tl.float32), valid, best, total, acc
            )

    out_rows = out + batch * o_b + query_heads[:, None] * o_h + split * o_s + dims[None, :]
    merged = tl.where(total[:, None] > 0, acc / total[:, None], 0.0)  # a split of padding only: weightless
    tl.store(out_rows, merged, mask=head_ok[:, None] & dim_ok[None, :])
    tl.store(lse + batch * l_b + query_heads * l_h + split, best + tl.log(total), mask=head_ok)


@triton.jit(do_not_specialize=["splits", "pl_h"])
def _combine_kernel(
    parts, part_lse, out, lse, splits,
    p_b, p_h, p_s, pl_b, pl_h, o_b, o_h, l_b, l_h,
    QUERY_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, DIM_BLOCK: tl.constexpr, SPLIT_BLOCK: tl.constexpr,
):  # fmt: skip
    """Program (row x query head): the splits' outputs weighed by their lse, written in ``out``'s dtype."""
    row = tl.program_id(0)
    batch, head = row // QUERY_HEADS, row % QUERY_HEADS
    index, dims = tl.arange(0, SPLIT_BLOCK), tl.arange(0, DIM_BLOCK)
    split_ok, dim_ok = index < splits, dims < HEAD_DIM
    lses = tl.load(part_lse + batch * pl_b + head * pl_h + index, mask=split_ok, other=float("-inf"))
    best = tl.max(lses, axis=0)
    weights = tl.exp(lses - tl.where(best == float("-inf"), 0.0, best))  # a row of padding only: all weights 0
    total = tl.sum(weights, axis=0)
    outputs = tl.load(parts + batch * p_b + head * p_h + index[:, None] * p_s + dims[None, :],
                      mask=split_ok[:, None] & dim_ok[None, :], other=0.0)  # fmt: skip
    merged = tl.where(total > 0, tl.sum(weights[:, None] * outputs, axis=0) / total, 0.0)
    tl.store(out + batch * o_b + head * o_h + dims, merged.to(out.dtype.element_ty), mask=dim_ok)
    tl.store(lse + batch * l_b + head * l_h, best + tl.log(total))


def decode(
    query: torch.Tensor,
    keys: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    values: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
    bits: int,
    group: int,
    scaling: float,
    code_valid: torch.Tensor | None = None,
    dense: tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None = None,
    out: torch.Tensor | None = None,
    splits: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor] | None:
    """Attention of ``query [B, H_q, 1, D]`` over packed ``keys``/``values`` (each ``(codes, scale, zero)``) and
    the full-precision ``dense`` keys, values ``[B, H, R, D]`` and validity (a layer's residual), in two launches.

    Validity (``code_valid`` for the codes' tokens, ``[B, 1 or H, T]`` bool, or None when all are real) keeps
    padding out; a row that sees no token gets output 0 and lse -inf. Returns ``(output [B, H_q, D], lse [B,
    H_q])``: the output in ``out`` when given (any dtype and strides, e.g. a view of the layer's ``[B, 1, H_q, D]``
    result), else fp32. ``splits`` (default: enough programs for the device) cuts each row's token groups into
    that many runs. None when the kernels cannot be built or launched here (:func:`kvopt.kernels.give_up`)."""
    try:
        return _decode(query, keys, values, bits, group, scaling, code_valid, dense, out, splits)
    except (CompilationError, OutOfResources) as error:
        kernels.give_up(error)
        return None


def _decode(query, keys, values, bits, group, scaling, code_valid, dense, out, splits) -> tuple[torch.Tensor, ...]:
    batch, query_heads, _, head_dim = query.shape
    key_codes, key_scale, key_zero = _as_tiles(*keys, group)
    value_codes, value_scale, value_zero = _as_tiles(*values, group)
    kv_heads, groups = key_codes.shape[1], key_codes.shape[2]
    wanted = splits or -(-_programs(query.device) // (batch * kv_heads))
    per_split = -(-groups // max(1, min(wanted, groups)))
    quantized_splits = -(-groups // per_split)
    dense_keys, dense_values, dense_valid = dense if dense is not None else (query, query, None)
    dense_keys, dense_values = _unit_channel_stride(dense_keys), _unit_channel_stride(dense_values)
    dense_tokens = dense_keys.shape[2] if dense is not None else 0
    all_splits = quantized_splits + (dense_tokens > 0)
    code_mask, dense_mask = (_as_bytes(valid, batch, kv_heads, query.device) for valid in (code_valid, dense_valid))
    queries = _unit_channel_stride(query[:, :, 0, :])
    parts = torch.empty(batch, query_heads, all_splits, head_dim, dtype=torch.float32, device=query.device)
    part_lse = torch.empty(batch, query_heads, all_splits, dtype=torch.float32, device=query.device)
    query_group = query_heads // kv_heads
    _quantized_decode_kernel[(batch * kv_heads, all_splits)](
        queries, key_codes, key_scale, key_zero, value_codes, value_scale, value_zero, dense_keys, dense_values,
        code_mask, dense_mask, parts, part_lse, groups, per_split, quantized_splits, dense_tokens, scaling,
        queries.stride(0), queries.stride(1),
        *key_codes.stride()[:4], *key_scale.stride(),
        *value_codes.stride()[:4], *value_scale.stride(),
        *dense_keys.stride()[:3], *dense_values.stride()[:3], *code_mask.stride(), *dense_mask.stride(),
        parts.stride(0), parts.stride(1), parts.stride(2), part_lse.stride(0), part_lse.stride(1),
        KV_HEADS=kv_heads, QUERY_GROUP=query_group, QUERY_BLOCK=triton.next_power_of_2(query_group),
        HEAD_DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
        BITS=bits, GROUP=group, KEY_CHANNELS=key_scale.shape[-1], VALUE_CHANNELS=value_scale.shape[-1],
        CODES_MASKED=code_valid is not None, DENSE_MASKED=dense_valid is not None,
    )  # fmt: skip
    if out is None:
        out = torch.empty(batch, query_heads, head_dim, dtype=torch.float32, device=query.device)
    lse = torch.empty(batch, query_heads, dtype=torch.float32, device=query.device)
    _combine_kernel[(batch * query_heads,)](
        parts, part_lse, out, lse, all_splits,
        parts.stride(0), parts.stride(1), parts.stride(2), part_lse.stride(0), part_lse.stride(1),
        out.stride(0), out.stride(1), lse.stride(0), lse.stride(1),
        QUERY_HEADS=query_heads, HEAD_DIM=head_dim, DIM_BLOCK=triton.next_power_of_2(head_dim),
        SPLIT_BLOCK=triton.next_power_of_2(all_splits),
    )  # fmt: skip
    return out, lse


def _as_bytes(valid: torch.Tensor | None, batch: int, kv_heads: int, device: torch.device) -> torch.Tensor:
    """Validity ``[B, 1 or H, T]`` as bytes the kernel reads, heads expanded (stride 0); without validity a
    placeholder the kernel never reads (its flag is off)."""
    if valid is None:
        return torch.empty(1, 1, 1, dtype=torch.uint8, device=device)
    return valid.view(torch.uint8).expand(batch, kv_heads, -1)


def _unit_channel_stride(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` itself when its last axis is contiguous (the kernels index channels by offset), else a copy."""
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


def _as_tiles(
    codes: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, group: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Codes as ``[B, H, groups, G / k, D]`` with unit channel stride; scale and zero-point expanded (stride 0,
    no copy) to ``[B, H, groups, G, D / C, C]`` with the same strides, so one offset formula serves both layouts."""
    batch, heads, groups = codes.shape[:3]
    if codes.ndim == 5:  # keys per channel: one scale per channel and group
        scale, zero = scale.unsqueeze(4), zero.unsqueeze(4)
    codes = _unit_channel_stride(codes.flatten(4))
    channel_groups, channels = scale.shape[4], max(scale.shape[5], codes.shape[-1] // scale.shape[4])
    shape = (batch, heads, groups, group, channel_groups, channels)
    scale, zero = scale.expand(shape), zero.expand(shape)
    if scale.stride() != zero.stride():
        scale, zero = scale.contiguous(), zero.contiguous()
    return codes, scale, zero


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def _programs(device: torch.device) -> int:
    """Programs to aim for on ``device`` (a fixed count off CUDA, where only the interpreter runs the kernel)."""
    return PROGRAMS_PER_MULTIPROCESSOR * (_multiprocessors(device) if device.type == "cuda" else 8)
