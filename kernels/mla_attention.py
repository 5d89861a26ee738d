"""Sparse MLA attention in the latent space, over each query's own selection (glm5_next's absorbed form).

GLM-5.3-Flash's MLA has no rotary part: a head's key is W_uk c and its value W_uv c, for the token's latent c
(width R = kv_lora_rank, 512), which is all the cache keeps. With W_uk absorbed into the query (q_latent = W_uk^T q
per head, by the caller) a logit is q_latent . c, and W_uv is applied once to the softmax-weighted sum of latents
(by the caller): the middle part of `model.glm5_next.MultiLatentAttention.attend_latent`. Each query has its own row
of `selected` (positions into its batch row's latents; -1, or any position outside the latents, = skip). The
indexer's selection already holds everything a query attends to (its unfinished pool, and every token while the
context is at most topk), so there is no window or sink part.

Kernel: one program per (query, block of heads, split of the selection). All heads read the same latents (MQA-like),
so a program loads each block of BLOCK_N gathered latents (BLOCK_N x R) once for all its heads and uses it in two
tensor-core products, (heads x R) @ (R x BLOCK_N) for the logits and (heads x BLOCK_N) @ (BLOCK_N x R) for the
output, with an online softmax across blocks. The head block is padded to 16 rows (tl.dot's minimum); the programs
of one query are adjacent in the grid, so the other head blocks find its latents in L2. Decode (few queries) splits
each selection row over several programs and merges their partial results by log-sum-exp in a second small kernel
(`sparse_attention`'s), so that more multiprocessors are busy.

Numerics: q_latent and latents in one dtype (bf16/fp16/fp32), used as they are: logits are fp32 sums of exact
products; softmax and the output accumulate in fp32 (partial results of splits too); the output is rounded to the
input dtype. The kernel also rounds the unnormalised softmax weights to the input dtype for the weights @ latents
product (flash-attention's operand rounding), which moves the output by at most eps / 2 * max|c|; the reference
keeps them in fp32. A query that selects nothing gets zeros (not NaN).
"""

import torch
import triton
import triton.language as tl

from . import check_launchable, kernel_backend
from .pool_compress import round_to_dtype
from .sparse_attention import COMPUTE_DTYPES, LOG2_E, _dot, _merge_splits_kernel, _multiprocessors, _softmax_step

BLOCK_N = 32  # selected latents per step: a 32 x 512 bf16 block is 32 KB


@triton.jit
def _mla_sparse_attention_kernel(
        q_ptr, latents_ptr, selected_ptr, out_ptr, lse_ptr,
        n_queries, n_heads, rank, n_tokens, n_selected, head_blocks, chunks_per_split, qk_scale,
        stride_qb, stride_qt, stride_qh, stride_lb, stride_lt, stride_sb, stride_st, stride_os, stride_ls,
        BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr, DOT_FP32: tl.constexpr,
        WRITE_LSE: tl.constexpr):
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    flat_query = tl.program_id(0) // head_blocks  # batch * n_queries + query
    heads = (tl.program_id(0) % head_blocks) * BLOCK_H + tl.arange(0, BLOCK_H)
    split = tl.program_id(1)
    batch = (flat_query // n_queries).to(tl.int64)
    query = (flat_query % n_queries).to(tl.int64)
    head_ok = heads < n_heads
    dims = tl.arange(0, BLOCK_R)
    dim_ok = dims < rank

    q = tl.load(q_ptr + batch * stride_qb + query * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_ok[:, None] & dim_ok[None, :], other=0.0)
    if DOT_FP32:  # fp32 inputs, and the interpreter, whose bf16 dot is wrong: the values as they are, in fp32
        q = q.to(tl.float32)
    selection = selected_ptr + batch * stride_sb + query * stride_st
    latents = latents_ptr + batch * stride_lb
    first_chunk = split * chunks_per_split
    end_chunk = tl.minimum(first_chunk + chunks_per_split, tl.cdiv(n_selected, BLOCK_N))

    m = tl.full((BLOCK_H,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_H,), tl.float32)
    acc = tl.zeros((BLOCK_H, BLOCK_R), tl.float32)
    for chunk in range(first_chunk, end_chunk):
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        token = tl.load(selection + cols, mask=cols < n_selected, other=-1)
        token_ok = (token >= 0) & (token < n_tokens)  # out-of-range positions are skipped, never read
        token = tl.where(token_ok, token, 0).to(tl.int64)
        c = tl.load(latents + token[:, None] * stride_lt + dims[None, :], mask=token_ok[:, None] & dim_ok[None, :],
                    other=0.0)
        if DOT_FP32:
            c = c.to(tl.float32)
        logits = tl.where(head_ok[:, None] & token_ok[None, :], _dot(q, tl.trans(c), DOT_FP32) * qk_scale,
                          float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, logits, c, DTYPE, DOT_FP32)

    seen = l > 0  # a row that saw no latent: output 0, log-sum-exp -inf
    out = tl.math.div_rn(acc, tl.where(seen, l, 1.0)[:, None])
    rows = flat_query.to(tl.int64) * n_heads + heads  # rows of the (B * T * H, R) output
    out_type = out_ptr.dtype.element_ty
    tl.store(out_ptr + split * stride_os + rows[:, None] * rank + dims[None, :],
             round_to_dtype(out, out_type).to(out_type), mask=head_ok[:, None] & dim_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, (m + tl.log2(tl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))  # ln
        tl.store(lse_ptr + split * stride_ls + rows, lse, mask=head_ok)


def _check(q_latent: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor) -> None:
    if q_latent.dim() != 4 or q_latent.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"q_latent must be (batch, queries, heads, rank) in bf16, fp16 or fp32, got "
                         f"{q_latent.dtype} {tuple(q_latent.shape)}")
    batch, n_queries, _, rank = q_latent.shape
    if latents.dim() != 3 or latents.shape[0] != batch or latents.shape[2] != rank or latents.dtype != q_latent.dtype:
        raise ValueError(f"latents must be ({batch}, tokens, {rank}) in {q_latent.dtype}, got {latents.dtype} "
                         f"{tuple(latents.shape)}")
    if selected.dim() != 3 or tuple(selected.shape[:2]) != (batch, n_queries) or selected.is_floating_point():
        raise ValueError(f"selected must be integer positions ({batch}, {n_queries}, N), got {selected.dtype} "
                         f"{tuple(selected.shape)}")
    devices = {t.device for t in (q_latent, latents, selected)}
    if len(devices) > 1:
        raise ValueError(f"MLA attention needs all tensors on one device, got {sorted(map(str, devices))}")


def mla_sparse_attention_reference(q_latent: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor,
                                   scale: float) -> torch.Tensor:
    """`mla_sparse_attention` in plain torch: gather, fp32 logits, masked softmax, fp32 weighted sum."""
    _check(q_latent, latents, selected)
    batch, n_queries, n_selected = selected.shape
    rank = latents.shape[2]
    valid = (selected >= 0) & (selected < latents.shape[1])
    index = selected.long().where(valid, 0).reshape(batch, n_queries * n_selected, 1).expand(-1, -1, rank)
    gathered = latents.gather(1, index).view(batch, n_queries, n_selected, rank).float()
    logits = torch.einsum("bthr,btwr->bthw", q_latent.float(), gathered) * scale
    weights = logits.masked_fill(~valid[:, :, None, :], float("-inf")).softmax(dim=-1).nan_to_num(0.0)
    return torch.einsum("bthw,btwr->bthr", weights, gathered).to(q_latent.dtype)


def mla_sparse_attention(q_latent: torch.Tensor, latents: torch.Tensor, selected: torch.Tensor, scale: float, *,
                         kv_splits: int | None = None) -> torch.Tensor:
    """Softmax-weighted sums of selected latents (B, T, H, R) in q_latent's dtype.

    q_latent (B, T, H, R): queries with W_uk absorbed; latents (B, L, R) in q_latent's dtype, rows contiguous (the
    cache's latents); selected (B, T, N): each query's positions into its batch row's latents, -1 (or any position
    outside [0, L)) = skip. Logits are q_latent . c * scale. kv_splits: programs per query and head block (default:
    enough to fill the GPU). A query that selects nothing gets zeros.
    """
    if kernel_backend(q_latent.device) == "torch":
        return mla_sparse_attention_reference(q_latent, latents, selected, scale)
    _check(q_latent, latents, selected)
    if kv_splits is not None and kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    check_launchable(_mla_sparse_attention_kernel, q_latent.device)
    batch, n_queries, n_heads, rank = q_latent.shape
    n_selected = selected.shape[2]
    out = torch.empty(q_latent.shape, dtype=q_latent.dtype, device=q_latent.device)
    if out.numel() == 0:
        return out
    q_latent = q_latent if q_latent.stride(-1) == 1 else q_latent.contiguous()
    latents = latents if latents.stride(-1) == 1 else latents.contiguous()
    selected = selected if selected.stride(-1) == 1 else selected.contiguous()

    block_h = 16 if n_heads <= 16 else 32  # 32 x 512 fp32 accumulators: 64 registers a thread at 8 warps
    head_blocks = triton.cdiv(n_heads, block_h)
    programs = batch * n_queries * head_blocks
    chunks = max(1, triton.cdiv(n_selected, BLOCK_N))  # an empty selection: one program writes the zeros
    if kv_splits is None:  # about two programs per multiprocessor, each with at least 2 latent blocks
        kv_splits = min(2 * _multiprocessors(q_latent.device) // programs, chunks // 2)
    chunks_per_split = triton.cdiv(chunks, max(1, min(kv_splits, chunks)))
    kv_splits = triton.cdiv(chunks, chunks_per_split)  # no split left empty
    if kv_splits > 1:
        part_out = torch.empty(kv_splits, batch * n_queries * n_heads, rank, device=q_latent.device)
        part_lse = torch.empty(kv_splits, batch * n_queries * n_heads, device=q_latent.device)
        target_out, target_lse, split_strides = part_out, part_lse, (part_out.stride(0), part_lse.stride(0))
    else:
        target_out, target_lse, split_strides = out, out, (0, 0)
    _mla_sparse_attention_kernel[(programs, kv_splits)](
        q_latent, latents, selected, target_out, target_lse,
        n_queries, n_heads, rank, latents.shape[1], n_selected, head_blocks, chunks_per_split,
        scale * LOG2_E, q_latent.stride(0), q_latent.stride(1), q_latent.stride(2), latents.stride(0),
        latents.stride(1), selected.stride(0), selected.stride(1), *split_strides,
        BLOCK_H=block_h, BLOCK_N=BLOCK_N, BLOCK_R=max(16, triton.next_power_of_2(rank)),
        DOT_FP32=q_latent.device.type == "cpu" or q_latent.dtype == torch.float32, WRITE_LSE=kv_splits > 1,
        num_warps=4 if block_h == 16 else 8)
    if kv_splits > 1:
        _merge_splits_kernel[(batch * n_queries * n_heads,)](
            part_out, part_lse, out, part_lse, kv_splits, rank, part_out.stride(0), part_lse.stride(0),
            BLOCK_S=triton.next_power_of_2(kv_splits), BLOCK_D=triton.next_power_of_2(rank), WRITE_LSE=False)
    return out
