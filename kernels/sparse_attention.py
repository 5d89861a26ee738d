"""Sparse attention for llama-family GQA: far tokens gathered from the history plus the recent window.

This is what `IndexPoolCache.attend` computes, as one op. Queries (T, H, D) arrive rotated. Each block of
`query_block` consecutive queries has one row of `selected` (positions into the history store, -1 = skip); those
keys are read un-rotated from the store (bf16/fp16/fp32, or int8 with one fp32 scale per token and KV head) and
rotated in the kernel with RoPE at their placed positions (one per column of `selected`: the engine closes far
tokens up into a contiguous block), rotate-half layout as `model.llama.apply_rope`. The cos/sin of the placed
positions come in as tables (`far_rope_tables`: fp64 angles as `model.llama.rope_at`), built once per forward and
shared by all layers: trigonometry of angles near 1M radians in the kernel would need fp64 and its slow argument
reduction, in every program, for every key. The recent window (KV, W, D) is already rotated; query t sees window keys
w <= t + query_offset (query_offset = position of query 0 - position of window key 0). Far and window keys go
through one online softmax (no merge of two partial attentions); the log-sum-exp of the scaled logits can be
returned too, so that a caller can still merge with other parts.

Numerics (kernel and reference alike): keys and values are dequantized and rotated in fp32, then rounded to the
query dtype (the dtype the engine keeps rotated keys in, and the tensor-core operand type); logits, softmax and the
output accumulate in fp32; the output is rounded to the query dtype. The kernel also rounds the softmax weights to
the query dtype for the P @ V product (the usual flash-attention operand rounding); the reference does not.

Decode (one query, a few KV heads) splits each head's keys over several programs and merges their partial results
by log-sum-exp in a second small kernel, so that more than KV of the GPU's multiprocessors are busy.
"""

import torch
import triton
import triton.language as tl

from . import check_launchable, kernel_backend
from .rope import apply_rope, rope_at
from .pool_compress import round_to_dtype

COMPUTE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
BLOCK_N = 64  # keys per step
LOG2_E = 1.4426950408889634


@triton.jit
def _operand(x, DTYPE: tl.constexpr, DOT_FP32: tl.constexpr):
    """A dot operand from fp32 values already on DTYPE's grid: fp32 itself where the dot runs in fp32 (fp32
    inputs, and the interpreter, whose bf16 dot is wrong), else DTYPE (exact)."""
    if DOT_FP32:
        return x
    else:
        return x.to(DTYPE)


@triton.jit
def _dot(a, b, DOT_FP32: tl.constexpr):
    if DOT_FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _softmax_step(m, l, acc, logits, v, DTYPE: tl.constexpr, DOT_FP32: tl.constexpr):
    """One online-softmax step over a block of keys; logits in log2 units, -inf where hidden."""
    m_new = tl.maximum(m, tl.max(logits, axis=1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a row that has seen nothing yet stays at 0 weight
    alpha = tl.exp2(m - m_safe)
    p = tl.exp2(logits - m_safe[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    p_op = _operand(round_to_dtype(p, DTYPE), DTYPE, DOT_FP32)
    acc = acc * alpha[:, None] + _dot(p_op, _operand(v, DTYPE, DOT_FP32), DOT_FP32)
    return m_new, l, acc


@triton.jit
def _sparse_attention_kernel(
        q_ptr, k_store_ptr, v_store_ptr, k_scale_ptr, v_scale_ptr, selected_ptr, cos_ptr, sin_ptr,
        window_k_ptr, window_v_ptr, out_ptr, lse_ptr,
        n_queries, n_far, n_window, n_tokens, query_block, query_offset, tiles_per_block, chunks_per_split,
        qk_scale,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_kst, stride_vst,
        stride_selb, stride_rope_b, stride_rope_n, stride_wkh, stride_wkt, stride_wvh, stride_wvt,
        stride_os, stride_ot, stride_oh, stride_ls, stride_lt, stride_lh,
        GROUP: tl.constexpr, HALF: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_HALF: tl.constexpr, BLOCK_D: tl.constexpr, INT8: tl.constexpr, DOT_FP32: tl.constexpr,
        WRITE_LSE: tl.constexpr):
    DTYPE: tl.constexpr = q_ptr.dtype.element_ty
    BLOCK_T: tl.constexpr = BLOCK_M // GROUP
    kv = tl.program_id(1)
    split = tl.program_id(2)
    block = tl.program_id(0) // tiles_per_block
    tile = tl.program_id(0) % tiles_per_block

    # Rows are (query, head of this KV group) pairs of one query block; they all share its selection.
    rows = tl.arange(0, BLOCK_M)
    within = tile * BLOCK_T + rows // GROUP  # query index within the block
    query = block * query_block + within
    row_ok = (rows < BLOCK_T * GROUP) & (within < query_block) & (query < n_queries)
    head = kv * GROUP + rows % GROUP
    last_query = tl.minimum(block * query_block + tl.minimum((tile + 1) * BLOCK_T, query_block), n_queries) - 1

    halves = tl.arange(0, BLOCK_HALF)
    half_ok = halves < HALF
    dims = tl.arange(0, BLOCK_D)
    dim_ok = dims < 2 * HALF
    q_rows = q_ptr + query.to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh
    q_mask = row_ok[:, None] & half_ok[None, :]
    q1 = _operand(tl.load(q_rows + halves[None, :], mask=q_mask, other=0.0).to(tl.float32), DTYPE, DOT_FP32)
    q2 = _operand(tl.load(q_rows + HALF + halves[None, :], mask=q_mask, other=0.0).to(tl.float32), DTYPE, DOT_FP32)

    # This split's share of the key blocks: far blocks first, then the window blocks this tile can see.
    n_far_chunks = tl.cdiv(n_far, BLOCK_N)
    visible_window = tl.minimum(tl.maximum(last_query + query_offset + 1, 0), n_window)
    n_chunks = n_far_chunks + tl.cdiv(visible_window, BLOCK_N)
    first_chunk = split * chunks_per_split
    end_chunk = tl.minimum(first_chunk + chunks_per_split, n_chunks)

    m = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    for chunk in range(first_chunk, tl.minimum(end_chunk, n_far_chunks)):
        cols = chunk * BLOCK_N + tl.arange(0, BLOCK_N)
        col_ok = cols < n_far
        token = tl.load(selected_ptr + block * stride_selb + cols, mask=col_ok, other=-1)
        key_ok = col_ok & (token >= 0) & (token < n_tokens)  # out-of-range positions are skipped, never read
        token = tl.where(key_ok, token, 0).to(tl.int64)  # int64: token * stride passes 2**31 at 1M tokens
        rope_rows = block * stride_rope_b + cols[:, None] * stride_rope_n + halves[None, :]
        rope_mask = col_ok[:, None] & half_ok[None, :]
        cos = tl.load(cos_ptr + rope_rows, mask=rope_mask, other=0.0)
        sin = tl.load(sin_ptr + rope_rows, mask=rope_mask, other=0.0)
        k_rows = k_store_ptr + token[:, None] * stride_kt + kv * stride_kh
        k_mask = key_ok[:, None] & half_ok[None, :]
        k1 = tl.load(k_rows + halves[None, :], mask=k_mask, other=0.0).to(tl.float32)
        k2 = tl.load(k_rows + HALF + halves[None, :], mask=k_mask, other=0.0).to(tl.float32)
        v = tl.load(v_store_ptr + token[:, None] * stride_vt + kv * stride_vh + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        if INT8:
            k_scale = tl.load(k_scale_ptr + token * stride_kst + kv, mask=key_ok, other=0.0)
            v_scale = tl.load(v_scale_ptr + token * stride_vst + kv, mask=key_ok, other=0.0)
            k1 = k1 * k_scale[:, None]
            k2 = k2 * k_scale[:, None]
            v = v * v_scale[:, None]
        r1 = _operand(round_to_dtype(k1 * cos - k2 * sin, DTYPE), DTYPE, DOT_FP32)
        r2 = _operand(round_to_dtype(k2 * cos + k1 * sin, DTYPE), DTYPE, DOT_FP32)
        logits = _dot(q1, tl.trans(r1), DOT_FP32) + _dot(q2, tl.trans(r2), DOT_FP32)
        logits = tl.where(row_ok[:, None] & key_ok[None, :], logits * qk_scale, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, logits, round_to_dtype(v, DTYPE), DTYPE, DOT_FP32)
    for chunk in range(tl.maximum(first_chunk, n_far_chunks), end_chunk):
        keys = (chunk - n_far_chunks) * BLOCK_N + tl.arange(0, BLOCK_N)
        key_ok = keys < n_window
        k_rows = window_k_ptr + kv * stride_wkh + keys.to(tl.int64)[:, None] * stride_wkt
        k_mask = key_ok[:, None] & half_ok[None, :]
        k1 = _operand(tl.load(k_rows + halves[None, :], mask=k_mask, other=0.0).to(tl.float32), DTYPE, DOT_FP32)
        k2 = _operand(tl.load(k_rows + HALF + halves[None, :], mask=k_mask, other=0.0).to(tl.float32),
                      DTYPE, DOT_FP32)
        v = tl.load(window_v_ptr + kv * stride_wvh + keys.to(tl.int64)[:, None] * stride_wvt + dims[None, :],
                    mask=key_ok[:, None] & dim_ok[None, :], other=0.0).to(tl.float32)
        logits = _dot(q1, tl.trans(k1), DOT_FP32) + _dot(q2, tl.trans(k2), DOT_FP32)
        visible = row_ok[:, None] & key_ok[None, :] & (keys[None, :] <= query[:, None] + query_offset)
        logits = tl.where(visible, logits * qk_scale, float("-inf"))
        m, l, acc = _softmax_step(m, l, acc, logits, v, DTYPE, DOT_FP32)

    # A row that saw no key: output 0, log-sum-exp -inf.
    seen = l > 0
    out = tl.math.div_rn(acc, tl.where(seen, l, 1.0)[:, None])
    out_rows = out_ptr + split * stride_os + query.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh
    out_type = out_ptr.dtype.element_ty
    tl.store(out_rows + dims[None, :], round_to_dtype(out, out_type).to(out_type),
             mask=row_ok[:, None] & dim_ok[None, :])
    if WRITE_LSE:
        lse = tl.where(seen, (m + tl.log2(tl.where(seen, l, 1.0))) * 0.6931471805599453, float("-inf"))  # ln
        tl.store(lse_ptr + split * stride_ls + query.to(tl.int64) * stride_lt + head * stride_lh, lse, mask=row_ok)


@triton.jit
def _merge_splits_kernel(part_out_ptr, part_lse_ptr, out_ptr, lse_ptr, n_splits, d, stride_ps, stride_pls,
                         BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr, WRITE_LSE: tl.constexpr):
    """Merges the splits' normalised partial outputs of one (query, head) row by their log-sum-exps."""
    row = tl.program_id(0).to(tl.int64)
    splits = tl.arange(0, BLOCK_S)
    split_ok = splits < n_splits
    splits = splits.to(tl.int64)
    dims = tl.arange(0, BLOCK_D)
    lse = tl.load(part_lse_ptr + splits * stride_pls + row, mask=split_ok, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)
    weights = tl.exp(lse - top)
    total = tl.sum(weights, axis=0)
    parts = tl.load(part_out_ptr + splits[:, None] * stride_ps + row * d + dims[None, :],
                    mask=split_ok[:, None] & (dims < d)[None, :], other=0.0)
    out = tl.math.div_rn(tl.sum(parts * weights[:, None], axis=0), tl.where(total > 0, total, 1.0))
    out_type = out_ptr.dtype.element_ty
    tl.store(out_ptr + row * d + dims, round_to_dtype(out, out_type).to(out_type), mask=dims < d)
    if WRITE_LSE:
        tl.store(lse_ptr + row, tl.where(total > 0, top + tl.log(tl.where(total > 0, total, 1.0)), float("-inf")))


def far_rope_tables(inv_freq: torch.Tensor, placed_positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin (*S, D // 2) in fp32 of placed positions of any shape S, from fp64 angles (`rope_at`: fp32 angles
    are off by up to 0.06 rad near position 1M). Build them once per forward; every layer shares them."""
    cos, sin = rope_at(inv_freq, placed_positions)
    half = inv_freq.shape[0]
    return cos[..., 0, :half].contiguous(), sin[..., 0, :half].contiguous()


def _check(q, k_store, v_store, selected, rope_cos, rope_sin, window_k, window_v, query_block, k_scale, v_scale):
    """Validates the inputs; returns the stores as (n_tokens, KV, D), the rope tables as (n_blocks, N, D // 2)
    and the query block size."""
    if q.dim() != 3 or q.dtype not in COMPUTE_DTYPES:
        raise ValueError(f"q must be (queries, heads, head_dim) in bf16, fp16 or fp32, got {q.dtype} "
                         f"{tuple(q.shape)}")
    n_queries, n_heads, head_dim = q.shape
    if head_dim % 2:
        raise ValueError(f"rotary attention needs an even head_dim, got {head_dim}")
    if window_k.dim() != 3 or window_k.shape != window_v.shape or window_k.shape[2] != head_dim:
        raise ValueError(f"window keys and values must be (kv_heads, window, {head_dim}), got "
                         f"{tuple(window_k.shape)} and {tuple(window_v.shape)}")
    kv_heads = window_k.shape[0]
    if kv_heads == 0 or n_heads % kv_heads:
        raise ValueError(f"{n_heads} query heads cannot be grouped over {kv_heads} KV heads")
    if window_k.dtype != q.dtype or window_v.dtype != q.dtype:
        raise ValueError(f"the window must be in the query dtype {q.dtype}, got {window_k.dtype}")
    stores = []
    for name, store in (("k_store", k_store), ("v_store", v_store)):
        if store.dim() == 2 and store.shape[1] == kv_heads * head_dim:
            store = store.unflatten(1, (kv_heads, head_dim))
        if store.dim() != 3 or tuple(store.shape[1:]) != (kv_heads, head_dim) or store.stride(-1) != 1:
            raise ValueError(f"{name} must be (tokens, {kv_heads * head_dim}) or (tokens, {kv_heads}, {head_dim}) "
                             f"with contiguous rows, got {tuple(store.shape)}")
        stores.append(store)
    k_store, v_store = stores
    if k_store.shape[0] != v_store.shape[0]:
        raise ValueError(f"k_store holds {k_store.shape[0]} tokens, v_store {v_store.shape[0]}")
    if k_store.dtype != v_store.dtype or k_store.dtype not in (q.dtype, torch.int8):
        raise ValueError(f"the history store must be in the query dtype {q.dtype} or int8, got {k_store.dtype} "
                         f"and {v_store.dtype}")
    int8 = k_store.dtype == torch.int8
    if int8 != (k_scale is not None) or (k_scale is None) != (v_scale is None):
        raise ValueError("an int8 history store needs k_scale and v_scale, and only an int8 store takes them")
    if int8:
        for scale in (k_scale, v_scale):
            if tuple(scale.shape) != (k_store.shape[0], kv_heads) or scale.dtype != torch.float32:
                raise ValueError(f"k_scale and v_scale must be float32 of shape {(k_store.shape[0], kv_heads)}, "
                                 f"got {scale.dtype} {tuple(scale.shape)}")
    if selected.dim() != 2 or selected.is_floating_point():
        raise ValueError(f"selected must be integer positions (query blocks, N), got {selected.dtype} "
                         f"{tuple(selected.shape)}")
    n_blocks, n_far = selected.shape
    half = head_dim // 2
    for table in (rope_cos, rope_sin):
        if table.dtype != torch.float32 or tuple(table.shape) not in ((n_far, half), (n_blocks, n_far, half)):
            raise ValueError(f"rope_cos and rope_sin must be float32 of shape ({n_far}, {half}) or ({n_blocks}, "
                             f"{n_far}, {half}) (see far_rope_tables), got {table.dtype} {tuple(table.shape)}")
    if rope_cos.shape != rope_sin.shape:
        raise ValueError(f"rope_cos {tuple(rope_cos.shape)} and rope_sin {tuple(rope_sin.shape)} differ")
    query_block = n_queries if query_block is None else query_block
    if query_block < 1 or n_blocks != -(-n_queries // query_block):
        raise ValueError(f"{n_queries} queries in blocks of {query_block} make {-(-n_queries // max(query_block, 1))}"
                         f" blocks; selected has {n_blocks} rows")
    tensors = (q, k_store, v_store, selected, rope_cos, rope_sin, window_k, window_v, k_scale, v_scale)
    devices = {t.device for t in tensors if t is not None}
    if len(devices) > 1:
        raise ValueError(f"sparse attention needs all tensors on one device, got {sorted(map(str, devices))}")
    return k_store, v_store, rope_cos.expand(n_blocks, n_far, half), rope_sin.expand(n_blocks, n_far, half), query_block


def _store_rows(store: torch.Tensor, scale: torch.Tensor | None, positions: torch.Tensor) -> torch.Tensor:
    rows = store[positions].float()
    return rows if scale is None else rows * scale[positions][..., None]


def sparse_attention_reference(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor,
                               selected: torch.Tensor, rope_cos: torch.Tensor, rope_sin: torch.Tensor,
                               window_k: torch.Tensor, window_v: torch.Tensor, query_offset: int, *,
                               query_block: int | None = None, k_scale: torch.Tensor | None = None,
                               v_scale: torch.Tensor | None = None, scale: float | None = None,
                               return_lse: bool = False) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`sparse_attention` in plain torch, one query block at a time: gather, rotate, masked softmax in fp32."""
    k_store, v_store, rope_cos, rope_sin, query_block = _check(q, k_store, v_store, selected, rope_cos, rope_sin,
                                                               window_k, window_v, query_block, k_scale, v_scale)
    n_queries, n_heads, head_dim = q.shape
    group = n_heads // window_k.shape[0]
    scale = head_dim**-0.5 if scale is None else scale
    window_keys = window_k.transpose(0, 1).float()  # (W, KV, D)
    window_values = window_v.transpose(0, 1).float()
    window_index = torch.arange(window_k.shape[1], device=q.device)
    outs, lses = [], []
    for block in range(selected.shape[0]):
        queries = torch.arange(block * query_block, min(n_queries, (block + 1) * query_block), device=q.device)
        positions = selected[block].long()
        valid = (positions >= 0) & (positions < k_store.shape[0])
        positions = positions.where(valid, 0)
        cos, sin = (torch.cat([t[block], t[block]], dim=-1)[:, None, :] for t in (rope_cos, rope_sin))  # (N, 1, D)
        far_keys = apply_rope(_store_rows(k_store, k_scale, positions)[None], cos, sin)[0]
        far_keys = far_keys.to(q.dtype).float()  # rotated keys in the compute dtype
        far_values = _store_rows(v_store, v_scale, positions).to(q.dtype).float()
        keys = torch.cat([far_keys, window_keys]).repeat_interleave(group, dim=1)  # (N + W, H, D)
        values = torch.cat([far_values, window_values]).repeat_interleave(group, dim=1)
        logits = torch.einsum("thd,nhd->thn", q[queries].float(), keys) * scale
        window_visible = window_index[None, :] <= queries[:, None] + query_offset
        visible = torch.cat([valid.expand(len(queries), -1), window_visible], dim=1)  # (t, N + W)
        logits = logits.masked_fill(~visible[:, None, :], float("-inf"))
        lse = logits.logsumexp(dim=-1)  # (t, H); -inf for a query that sees nothing
        probs = (logits - lse[..., None]).exp().nan_to_num(0.0)
        outs.append(torch.einsum("thn,nhd->thd", probs, values))
        lses.append(lse)
    out = torch.cat(outs).to(q.dtype)
    return (out, torch.cat(lses)) if return_lse else out


_SM_COUNTS: dict[int, int] = {}


def _multiprocessors(device: torch.device) -> int:
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNTS:
        _SM_COUNTS[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNTS[index]


def sparse_attention(q: torch.Tensor, k_store: torch.Tensor, v_store: torch.Tensor, selected: torch.Tensor,
                     rope_cos: torch.Tensor, rope_sin: torch.Tensor, window_k: torch.Tensor,
                     window_v: torch.Tensor, query_offset: int, *, query_block: int | None = None,
                     k_scale: torch.Tensor | None = None, v_scale: torch.Tensor | None = None,
                     scale: float | None = None, return_lse: bool = False,
                     kv_splits: int | None = None) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention output (T, H, D) in q's dtype, and with return_lse the fp32 log-sum-exp (T, H) of the scaled logits.

    q (T, H, D): rotated queries (bf16/fp16/fp32). k_store, v_store: the un-rotated history, (tokens, KV * D) or
    (tokens, KV, D), in q's dtype or int8 with k_scale / v_scale (tokens, KV) fp32. selected (n_blocks, N): history
    positions per block of `query_block` consecutive queries (default: all T share one row), -1 (or any position
    outside the store) = skip. rope_cos, rope_sin (N, D // 2) or (n_blocks, N, D // 2): `far_rope_tables` of the
    placed position of each column of selected. window_k, window_v (KV, W, D): the rotated recent keys and values;
    query t sees window key w when w <= t + query_offset. scale: default D**-0.5. kv_splits: programs per KV head
    and query tile (default: enough to fill the GPU). A query that sees no key gets output 0, log-sum-exp -inf.
    """
    if kernel_backend(q.device) == "torch":
        return sparse_attention_reference(q, k_store, v_store, selected, rope_cos, rope_sin, window_k, window_v,
                                          query_offset, query_block=query_block, k_scale=k_scale, v_scale=v_scale,
                                          scale=scale, return_lse=return_lse)
    k_store, v_store, rope_cos, rope_sin, query_block = _check(q, k_store, v_store, selected, rope_cos, rope_sin,
                                                               window_k, window_v, query_block, k_scale, v_scale)
    if kv_splits is not None and kv_splits < 1:
        raise ValueError(f"kv_splits must be >= 1, got {kv_splits}")
    check_launchable(_sparse_attention_kernel, q.device)
    n_queries, n_heads, head_dim = q.shape
    kv_heads, n_window = window_k.shape[:2]
    group = n_heads // kv_heads
    n_blocks, n_far = selected.shape
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(n_queries, n_heads, device=q.device) if return_lse else None
    if out.numel() == 0:
        return (out, lse) if return_lse else out
    q = q if q.stride(-1) == 1 else q.contiguous()
    window_k = window_k if window_k.stride(-1) == 1 else window_k.contiguous()
    window_v = window_v if window_v.stride(-1) == 1 else window_v.contiguous()
    selected = selected if selected.stride(-1) == 1 else selected.contiguous()
    if rope_cos.stride(-1) != 1 or rope_cos.stride() != rope_sin.stride():
        rope_cos, rope_sin = rope_cos.contiguous(), rope_sin.contiguous()
    int8 = k_scale is not None
    if int8:
        k_scale, v_scale = k_scale.contiguous(), v_scale.contiguous()

    block_m = max(16 if query_block * group <= 16 else 64, triton.next_power_of_2(group))
    tiles_per_block = triton.cdiv(query_block, block_m // group)
    programs = n_blocks * tiles_per_block * kv_heads
    chunks = triton.cdiv(n_far, BLOCK_N) + triton.cdiv(n_window, BLOCK_N)
    if kv_splits is None:  # about two programs per multiprocessor, each with at least 2 key blocks
        kv_splits = max(1, min(2 * _multiprocessors(q.device) // programs, chunks // 2))
    kv_splits = max(1, min(kv_splits, chunks))
    chunks_per_split = max(1, triton.cdiv(chunks, kv_splits))
    if kv_splits > 1:
        part_out = torch.empty(kv_splits, n_queries, n_heads, head_dim, device=q.device)
        part_lse = torch.empty(kv_splits, n_queries, n_heads, device=q.device)
        target_out, target_lse = part_out, part_lse
        out_strides, lse_strides = part_out.stride()[:3], part_lse.stride()
    else:
        target_out, target_lse = out, lse if return_lse else out
        out_strides, lse_strides = (0, *out.stride()[:2]), (0, *lse.stride()) if return_lse else (0, 0, 0)
    scales = (k_scale, v_scale, k_scale.stride(0), v_scale.stride(0)) if int8 else (k_store, v_store, 0, 0)
    half = head_dim // 2
    grid = (n_blocks * tiles_per_block, kv_heads, kv_splits)
    _sparse_attention_kernel[grid](
        q, k_store, v_store, scales[0], scales[1], selected, rope_cos, rope_sin, window_k, window_v,
        target_out, target_lse,
        n_queries, n_far, n_window, k_store.shape[0], query_block, query_offset, tiles_per_block, chunks_per_split,
        (head_dim**-0.5 if scale is None else scale) * LOG2_E,
        q.stride(0), q.stride(1), k_store.stride(0), k_store.stride(1), v_store.stride(0), v_store.stride(1),
        scales[2], scales[3], selected.stride(0), rope_cos.stride(0), rope_cos.stride(1),
        window_k.stride(0), window_k.stride(1), window_v.stride(0), window_v.stride(1), *out_strides, *lse_strides,
        GROUP=group, HALF=half, BLOCK_M=block_m, BLOCK_N=BLOCK_N,
        BLOCK_HALF=max(16, triton.next_power_of_2(half)), BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        INT8=int8, DOT_FP32=q.device.type == "cpu" or q.dtype == torch.float32,
        WRITE_LSE=return_lse or kv_splits > 1, enable_fp_fusion=False)  # unfused: the reference's RoPE roundings
    if kv_splits > 1:
        _merge_splits_kernel[(n_queries * n_heads,)](
            part_out, part_lse, out, lse if return_lse else part_lse, kv_splits, head_dim,
            part_out.stride(0), part_lse.stride(0), BLOCK_S=triton.next_power_of_2(kv_splits),
            BLOCK_D=triton.next_power_of_2(head_dim), WRITE_LSE=return_lse, enable_fp_fusion=False)
    return (out, lse) if return_lse else out
