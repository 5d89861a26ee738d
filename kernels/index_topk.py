"""Indexer scoring and top-k selection: which token positions each query attends to.

score(t, pool) = sum_j w_{t,j} * ReLU(q_{t,j} . K_pool * d**-0.5), -inf for pools the query cannot see yet; the best
topk // kpool pools are expanded to their token positions, the query's unfinished pool (its tail) is added, and the
list is sorted ascending with -1 padding at the end. The reference is `model.indexpool.score_pools` +
`select_tokens`; positions, visibility and tail are defined in `model/indexpool.py`.

What runs where on the Triton path: the scores are a Triton kernel (a tile of pools in registers, read once for a
tile of queries; heads looped, fp32 accumulation); the top-k is `torch.topk` on those fp32 scores (unsorted); a
second Triton kernel drops invisible picks, sorts the pools, expands them to tokens, appends the tail and pads. While
there are at most topk // kpool pools, every visible one is selected and nothing is scored.
"""

import torch
import triton
import triton.language as tl

from . import check_launchable, kernel_backend
from .index_math import FP8_DTYPE, fp8_dequantize, score_pools, select_tokens

POOLED_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)
NOT_CHOSEN = tl.constexpr(2**31 - 1)  # sorts after every pool index


@triton.jit
def _index_scores_kernel(q_ptr, weights_ptr, pooled_ptr, scale_ptr, positions_ptr, scores_ptr,
                         n_queries, n_pools, n_heads, d, kpool, logit_scale,
                         stride_qb, stride_qt, stride_qh, stride_wb, stride_wt, stride_wh,
                         stride_pb, stride_pp, stride_sb, stride_sp, stride_posb, stride_post, stride_ob, stride_ot,
                         BLOCK_T: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    batch = tl.program_id(2).to(tl.int64)
    pools = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    pool_ok = pools < n_pools
    channels = tl.arange(0, BLOCK_D)
    channel_ok = channels < d
    pool_offsets = pools.to(tl.int64)  # pool * stride can pass 2**31
    keys = tl.load(pooled_ptr + batch * stride_pb + pool_offsets[:, None] * stride_pp + channels[None, :],
                   mask=pool_ok[:, None] & channel_ok[None, :], other=0.0).to(tl.float32)
    if FP8:
        scale = tl.load(scale_ptr + batch * stride_sb + pool_offsets * stride_sp, mask=pool_ok, other=0.0)
        keys = keys * scale[:, None]
    first_query = tl.program_id(1).to(tl.int64) * BLOCK_T  # int64: query * stride passes 2**31 at 1M tokens
    for query in range(first_query, tl.minimum(first_query + BLOCK_T, n_queries)):
        position = tl.load(positions_ptr + batch * stride_posb + query * stride_post)
        visible_pools = (position + 1) // kpool
        q_row = q_ptr + batch * stride_qb + query * stride_qt
        total = tl.zeros((BLOCK_P,), tl.float32)
        for head in range(0, n_heads):
            q = tl.load(q_row + head * stride_qh + channels, mask=channel_ok, other=0.0).to(tl.float32)
            logits = tl.sum(keys * q[None, :], axis=1) * logit_scale
            weight = tl.load(weights_ptr + batch * stride_wb + query * stride_wt + head * stride_wh).to(tl.float32)
            total += weight * tl.maximum(logits, 0.0)
        total = tl.where(pools < visible_pools, total, float("-inf"))
        tl.store(scores_ptr + batch * stride_ob + query * stride_ot + pool_offsets, total, mask=pool_ok)


@triton.jit
def _expand_selection_kernel(chosen_ptr, positions_ptr, out_ptr, n_chosen, n_pools, kpool, width,
                             stride_cb, stride_ct, stride_posb, stride_post, stride_ob, stride_ot,
                             HAS_CHOSEN: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_K: tl.constexpr):
    batch = tl.program_id(1).to(tl.int64)
    query = tl.program_id(0).to(tl.int64)
    position = tl.load(positions_ptr + batch * stride_posb + query * stride_post)
    visible_pools = tl.minimum((position + 1) // kpool, n_pools).to(tl.int32)
    slots = tl.arange(0, BLOCK_S)
    if HAS_CHOSEN:
        chosen = tl.load(chosen_ptr + batch * stride_cb + query * stride_ct + slots, mask=slots < n_chosen,
                         other=NOT_CHOSEN).to(tl.int32)
    else:  # every pool is a candidate
        chosen = tl.where(slots < n_chosen, slots, NOT_CHOSEN)
    chosen = tl.sort(tl.where(chosen < visible_pools, chosen, NOT_CHOSEN))
    n_valid = tl.sum((chosen != NOT_CHOSEN).to(tl.int32), axis=0)
    # Output slot s = i * kpool + j: pool token chosen[i] * kpool + j while i < n_valid, then the tail's tokens
    # visible_pools * kpool + (s - n_valid * kpool), up to the query's position, then -1.
    offsets = tl.arange(0, BLOCK_K)
    out_slots = slots[:, None] * kpool + offsets[None, :]
    pool_tokens = chosen.to(tl.int64)[:, None] * kpool + offsets[None, :]
    tail_tokens = visible_pools.to(tl.int64) * kpool + (out_slots - n_valid * kpool)
    tokens = tl.where(slots[:, None] < n_valid, pool_tokens, tl.where(tail_tokens <= position, tail_tokens, -1))
    tl.store(out_ptr + batch * stride_ob + query * stride_ot + out_slots, tokens,
             mask=(offsets < kpool)[None, :] & (out_slots < width))


def _positions_2d(query_positions: torch.Tensor, batch: int, n_queries: int) -> torch.Tensor:
    if query_positions.dim() not in (1, 2) or query_positions.shape[-1] != n_queries or (
            query_positions.dim() == 2 and query_positions.shape[0] != batch):
        raise ValueError(f"query_positions must be ({n_queries},) or ({batch}, {n_queries}), got "
                         f"{tuple(query_positions.shape)}")
    if query_positions.is_floating_point() or query_positions.is_complex():
        raise ValueError("query_positions must be integers")
    return query_positions.long().expand(batch, n_queries)


def _check(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, query_positions: torch.Tensor, kpool: int,
           pooled_scale: torch.Tensor | None) -> torch.Tensor:
    """Validates the scoring inputs; returns the positions as (B, T) int64."""
    if q.dim() != 4:
        raise ValueError(f"q must be (batch, queries, heads, d), got {tuple(q.shape)}")
    batch, n_queries, n_heads, d = q.shape
    if tuple(weights.shape) != (batch, n_queries, n_heads):
        raise ValueError(f"weights must be {(batch, n_queries, n_heads)}, got {tuple(weights.shape)}")
    if pooled.dim() != 3 or pooled.shape[0] != batch or pooled.shape[2] != d:
        raise ValueError(f"pooled keys must be ({batch}, pools, {d}), got {tuple(pooled.shape)}")
    if pooled.dtype not in POOLED_DTYPES:
        raise ValueError(f"pooled keys must be one of {', '.join(map(str, POOLED_DTYPES))}, not {pooled.dtype}")
    if (pooled.dtype == FP8_DTYPE) != (pooled_scale is not None):
        raise ValueError("fp8 pooled keys need their pooled_scale, and only fp8 keys take one")
    if pooled_scale is not None and (tuple(pooled_scale.shape) != tuple(pooled.shape[:2])
                                     or pooled_scale.dtype != torch.float32):
        raise ValueError(f"pooled_scale must be float32 of shape {tuple(pooled.shape[:2])}, got "
                         f"{pooled_scale.dtype} {tuple(pooled_scale.shape)}")
    if kpool < 1:
        raise ValueError(f"kpool must be >= 1, got {kpool}")
    devices = {t.device for t in (q, weights, pooled, query_positions, pooled_scale) if t is not None}
    if len(devices) > 1:
        raise ValueError(f"the indexer inputs must be on one device, got {sorted(map(str, devices))}")
    return _positions_2d(query_positions, batch, n_queries)


def _reference_keys(pooled: torch.Tensor, pooled_scale: torch.Tensor | None) -> torch.Tensor:
    return pooled if pooled_scale is None else fp8_dequantize(pooled, pooled_scale, torch.float32)


def index_scores_reference(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor,
                           query_positions: torch.Tensor, kpool: int,
                           pooled_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`index_scores` in plain torch: `score_pools` on the (dequantized) pooled keys."""
    positions = _check(q, weights, pooled, query_positions, kpool, pooled_scale)
    return score_pools(q, weights, _reference_keys(pooled, pooled_scale), positions, kpool)


def index_scores(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, query_positions: torch.Tensor,
                 kpool: int, pooled_scale: torch.Tensor | None = None) -> torch.Tensor:
    """fp32 scores (B, T, P) of queries against pooled keys, -inf where a pool is not visible to the query.

    q (B, T, H, d) index queries; weights (B, T, H) per-head weights (already times H**-0.5, fp32); pooled
    (B, P, d) in bf16/fp16/fp32, or fp8 with pooled_scale (B, P); query_positions (T,) or (B, T).
    """
    if kernel_backend(q.device) == "torch":
        return index_scores_reference(q, weights, pooled, query_positions, kpool, pooled_scale)
    positions = _check(q, weights, pooled, query_positions, kpool, pooled_scale)
    return _triton_scores(q, weights, pooled, positions, kpool, pooled_scale)


def _triton_scores(q, weights, pooled, positions, kpool, pooled_scale) -> torch.Tensor:
    check_launchable(_index_scores_kernel, q.device)
    batch, n_queries, n_heads, d = q.shape
    n_pools = pooled.shape[1]
    scores = torch.empty(batch, n_queries, n_pools, device=q.device)
    if scores.numel() == 0:
        return scores
    q = q if q.stride(-1) == 1 else q.contiguous()
    pooled = pooled if pooled.stride(-1) == 1 else pooled.contiguous()
    block_d = triton.next_power_of_2(d)
    block_p = max(16, min(256, 8192 // block_d))
    block_t = min(n_queries, 16)  # queries sharing one read of a tile of pooled keys
    fp8 = pooled_scale is not None
    scale_arg, scale_strides = (pooled_scale, pooled_scale.stride()) if fp8 else (pooled, (0, 0))
    grid = (triton.cdiv(n_pools, block_p), triton.cdiv(n_queries, block_t), batch)
    _index_scores_kernel[grid](
        q, weights, pooled, scale_arg, positions, scores, n_queries, n_pools, n_heads, d, kpool, d**-0.5,
        *q.stride()[:3], *weights.stride(), pooled.stride(0), pooled.stride(1), *scale_strides,
        *positions.stride(), scores.stride(0), scores.stride(1),
        BLOCK_T=block_t, BLOCK_P=block_p, BLOCK_D=block_d, FP8=fp8, enable_fp_fusion=True)
    return scores


def index_topk_reference(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor,
                         query_positions: torch.Tensor, kpool: int, topk: int,
                         pooled_scale: torch.Tensor | None = None) -> torch.Tensor:
    """`index_topk` in plain torch: `select_tokens(score_pools(...))`. A query may sit in the unfinished pool
    after the last pooled one, so the context is taken as P * kpool + kpool - 1 tokens."""
    positions = _check(q, weights, pooled, query_positions, kpool, pooled_scale)
    scores = score_pools(q, weights, _reference_keys(pooled, pooled_scale), positions, kpool)
    return select_tokens(scores, positions, (pooled.shape[1] + 1) * kpool - 1, kpool, topk)


def index_topk(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, query_positions: torch.Tensor,
               kpool: int, topk: int, pooled_scale: torch.Tensor | None = None) -> torch.Tensor:
    """Token positions each query attends to: (B, T, topk + kpool - 1) int64, ascending, -1 padding at the end.

    Inputs as `index_scores`; topk is a multiple of kpool. Each query position must be below P * kpool + kpool - 1
    (its tail lies after the last pooled key): the torch path checks it, the Triton path does not (a device sync
    per call) and treats pools beyond P as absent.
    """
    if kernel_backend(q.device) == "torch":
        return index_topk_reference(q, weights, pooled, query_positions, kpool, topk, pooled_scale)
    positions = _check(q, weights, pooled, query_positions, kpool, pooled_scale)
    if topk < kpool or topk % kpool:
        raise ValueError(f"topk={topk} must be a positive multiple of kpool={kpool}")
    check_launchable(_expand_selection_kernel, q.device)
    batch, n_queries = positions.shape
    n_pools, n_select, width = pooled.shape[1], topk // kpool, topk + kpool - 1
    selected = torch.empty(batch, n_queries, width, dtype=torch.long, device=q.device)
    if selected.numel() == 0:
        return selected
    chosen = None
    if n_pools > n_select:
        scores = _triton_scores(q, weights, pooled, positions, kpool, pooled_scale)
        chosen = scores.topk(n_select, dim=-1, sorted=False).indices
    chosen_arg, chosen_strides = (chosen, chosen.stride()[:2]) if chosen is not None else (positions, (0, 0))
    _expand_selection_kernel[(n_queries, batch)](
        chosen_arg, positions, selected, min(n_pools, n_select), n_pools, kpool, width,
        *chosen_strides, *positions.stride(), selected.stride(0), selected.stride(1),
        HAS_CHOSEN=chosen is not None, BLOCK_S=triton.next_power_of_2(n_select + 1),
        BLOCK_K=triton.next_power_of_2(kpool), enable_fp_fusion=True)
    return selected
