"""The IndexPool index math in plain torch: pooling keys, their fp8 storage, scoring pools and selecting token
positions. These are the references of the Triton kernels `pool_compress` and `index_topk` and the CPU path of
every model family (model/indexpool.py explains positions, visibility and the tail)."""

from __future__ import annotations

import torch

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite e4m3fn value: 0.875 * 2**9

def pool_keys(keys: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor, kpool: int) -> torch.Tensor:
    """Pooled keys (..., n_tokens // kpool, d) in fp32 from keys and gate logits (..., n_tokens, d).

    n_tokens must be a multiple of kpool (complete pools only), the first token starting a pool. Per pool and
    channel: softmax over the pool's tokens of (gate + ape[t mod kpool]), then the weighted sum of the keys.
    Everything runs in fp32 (transformers casts the weights to the key dtype before summing; for fp32 keys the two
    agree).
    """
    n_tokens, d = keys.shape[-2:]
    if n_tokens % kpool:
        raise ValueError(f"pool_keys needs complete pools: {n_tokens} tokens is not a multiple of kpool={kpool}")
    if gate_logits.shape != keys.shape or ape.shape != (kpool, d):
        raise ValueError(f"shape mismatch: keys {tuple(keys.shape)}, gate_logits {tuple(gate_logits.shape)}, "
                         f"ape {tuple(ape.shape)} (expected ({kpool}, {d}))")
    pooled_shape = (*keys.shape[:-2], n_tokens // kpool, kpool, d)
    logits = gate_logits.float().reshape(pooled_shape) + ape.float()
    weights = logits.softmax(dim=-2)
    return (weights * keys.float().reshape(pooled_shape)).sum(dim=-2)


def fp8_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 values and one fp32 scale per vector (last dim): scale = the smallest power of two >= absmax / 448.

    A power-of-two scale makes scaling exact, so the only error is e4m3 rounding, and it puts absmax / scale into
    (224, 448], the top binade of e4m3. Built from frexp (absmax = m * 2**e, m in [0.5, 1)) to avoid log2 rounding:
    m * 2**9 <= 448 exactly when m <= 0.875.
    """
    mantissa, exponent = torch.frexp(x.float().abs().amax(dim=-1))
    scale = torch.ldexp(torch.ones_like(mantissa), exponent - 9 + (mantissa > 0.875).to(exponent.dtype))
    return (x.float() / scale[..., None]).to(FP8_DTYPE), scale


def fp8_dequantize(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """Inverse of fp8_quantize. Exact in bf16: 4 significant bits times a power of two fit its 8."""
    return (values.float() * scale[..., None]).to(dtype)


def _positions_2d(query_positions: torch.Tensor, batch_size: int) -> torch.Tensor:
    """(T,) or (B, T) query positions as (B, T) int64."""
    return query_positions.long().expand(batch_size, query_positions.shape[-1])


def score_pools(q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor, query_positions: torch.Tensor,
                kpool: int) -> torch.Tensor:
    """Index scores (B, T, P) in fp32; -inf where a pool is not visible to the query.

    q (B, T, H, d) indexer queries, weights (B, T, H) per-head weights (already scaled by H**-0.5, as the model
    computes them, in fp32), pooled (B, P, d), query_positions (T,) or (B, T).
    score = sum_j weights_j * ReLU(q_j . K_pool * d**-0.5).
    """
    d = q.shape[-1]
    logits = torch.einsum("bthd,bpd->bthp", q.float(), pooled.float()) * d**-0.5
    scores = torch.einsum("bth,bthp->btp", weights.float(), logits.relu())
    visible_pools = (_positions_2d(query_positions, q.shape[0]) + 1) // kpool
    pool_index = torch.arange(pooled.shape[1], device=q.device)
    return scores.masked_fill(pool_index >= visible_pools[..., None], float("-inf"))


def select_tokens(scores: torch.Tensor | None, query_positions: torch.Tensor, n_tokens: int, kpool: int,
                  topk: int) -> torch.Tensor:
    """Token positions each query attends to: (B, T, topk + kpool - 1) int64, ascending, padded with -1 at the end.

    The best topk // kpool visible pools, expanded to their kpool positions, plus the query's tail (see the module
    docstring). When a query sees at most topk // kpool pools -- always so when pos + 1 <= topk -- all its
    visible positions are selected, whatever the scores; `scores` may then be None (B = 1 unless
    query_positions is (B, T)).
    scores (B, T, n_tokens // kpool) from score_pools; query_positions (T,) or (B, T), each < n_tokens.
    """
    if topk % kpool:
        raise ValueError(f"topk={topk} must be a multiple of kpool={kpool}")
    n_select = topk // kpool
    if scores is None:
        batch_size = query_positions.shape[0] if query_positions.dim() == 2 else 1
    else:
        batch_size = scores.shape[0]
        if scores.shape[-1] != n_tokens // kpool:
            raise ValueError(f"scores cover {scores.shape[-1]} pools, {n_tokens} tokens make {n_tokens // kpool}")
    positions = _positions_2d(query_positions, batch_size)
    if positions.numel() and int(positions.max()) >= n_tokens:
        raise ValueError(f"query position {int(positions.max())} is beyond the {n_tokens} tokens in context")
    visible_pools = (positions + 1) // kpool
    device = positions.device

    if scores is None:
        if positions.numel() and int(visible_pools.max()) > n_select:
            raise ValueError("scores are needed once a query sees more than topk // kpool pools")
        chosen = torch.arange(n_select, device=device).expand(*positions.shape, n_select)
    else:
        # Mask again here, so the selection never depends on the caller having masked the scores.
        pool_index = torch.arange(scores.shape[-1], device=device)
        masked = scores.float().masked_fill(pool_index >= visible_pools[..., None], float("-inf"))
        # A finite score beats -inf, so the visible pools come first; any invisible ones picked are dropped below.
        chosen = masked.topk(min(n_select, scores.shape[-1]), dim=-1).indices
    pool_tokens = chosen[..., None] * kpool + torch.arange(kpool, device=device)
    pool_tokens = pool_tokens.masked_fill((chosen >= visible_pools[..., None])[..., None], -1).flatten(-2)

    tail_tokens = (visible_pools * kpool)[..., None] + torch.arange(kpool - 1, device=device)
    tail_tokens = tail_tokens.masked_fill(tail_tokens > positions[..., None], -1)

    width = topk + kpool - 1
    selected = torch.cat([pool_tokens, tail_tokens], dim=-1)
    selected = torch.nn.functional.pad(selected, (0, width - selected.shape[-1]), value=-1)
    # Sort ascending with the -1 padding last: sort with padding mapped above every real position.
    selected = selected.masked_fill(selected < 0, n_tokens).sort(dim=-1).values
    return selected.masked_fill(selected == n_tokens, -1)
