"""Pool compression: the index keys of each kpool consecutive tokens merged into one pooled key and stored.

Per pool and channel c: a = softmax over the pool's tokens t of (gate[t, c] + ape[t, c]); pooled[c] = sum_t a_t
key[t, c], in fp32; then stored as bf16/fp16/fp32, or as fp8 e4m3 with one power-of-two scale per pooled key
(`model.indexpool.fp8_quantize`). The reference is `model.indexpool.pool_keys` plus the cast.

The storage roundings are done by hand in fp32 (`round_to_dtype`, `round_to_e4m3`) so that the final cast is
exact: the result is then the same on a GPU and in Triton's CPU interpreter, whose fp32 -> bf16 cast truncates
and whose fp32 -> fp8 cast mis-rounds values that carry into the next power of two.
"""

import torch
import triton
import triton.language as tl

from . import check_launchable, kernel_backend
from .index_math import FP8_DTYPE, fp8_quantize, pool_keys

OUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)


@triton.jit
def pow2(n):
    """2.0**n in fp32, exactly, for int32 n (0 below 2**-149): built from its bits, normal or subnormal."""
    normal = (tl.maximum(n, -126) + 127) << 23
    subnormal = 1 << tl.minimum(tl.maximum(n + 149, 0), 22)
    bits = tl.where(n >= -126, normal, tl.where(n >= -149, subnormal, 0))
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def round_to_dtype(x, DTYPE: tl.constexpr):
    """fp32 x rounded to the nearest DTYPE value (ties to even), kept in fp32; a later cast to DTYPE is exact."""
    if DTYPE == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = bits + 0x7FFF + ((bits >> 16) & 1)
        return ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    elif DTYPE == tl.float32:
        return x
    else:
        return x.to(DTYPE).to(tl.float32)


@triton.jit
def round_to_e4m3(y):
    """fp32 y (|y| <= 448) rounded to the nearest e4m3 value, ties to even, kept in fp32. e4m3 has 3 mantissa
    bits: from 2**e to 2**(e+1) its step is 2**(e-3); below 2**-6 (subnormal) the step is 2**-9."""
    magnitude = tl.abs(y)
    exponent = tl.maximum(((magnitude.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127, -6)
    steps = magnitude * pow2(3 - exponent)  # exact (a power of two), in [0, 16)
    whole = steps.to(tl.int32)
    fraction = steps - whole.to(tl.float32)
    up = (fraction > 0.5) | ((fraction == 0.5) & ((whole & 1) == 1))
    rounded = (whole + up.to(tl.int32)).to(tl.float32) * pow2(exponent - 3)
    return tl.where(y.to(tl.int32, bitcast=True) < 0, -rounded, rounded)  # the sign bit: -0.0 stays -0.0


@triton.jit
def fp8_scale_exponent(absmax):
    """n with 2**n = fp8_quantize's scale: the smallest power of two >= absmax / 448, from frexp(absmax) = (m, e)
    as e - 9 + (m > 0.875), and 2**-9 for absmax 0 (frexp(0) = (0, 0))."""
    bits = absmax.to(tl.int32, bitcast=True)
    subnormal = ((bits >> 23) & 0xFF) == 0
    # A subnormal is its mantissa field times 2**-149; that integer converts exactly to a normal float.
    normalized = tl.where(subnormal, (bits & 0x7FFFFF).to(tl.float32), absmax).to(tl.int32, bitcast=True)
    exponent = ((normalized >> 23) & 0xFF) - 126 - tl.where(subnormal, 149, 0)
    above = ((normalized & 0x7FFFFF) > 0x600000).to(tl.int32)  # m > 0.875: the mantissa field above 0.75
    return tl.where(absmax == 0, -9, exponent - 9 + above)


@triton.jit
def _pool_compress_kernel(keys_ptr, gates_ptr, ape_ptr, out_ptr, scale_ptr, n_pools, d,
                          stride_kb, stride_kt, stride_gb, stride_gt, stride_ob, stride_op, stride_sb, stride_sp,
                          KPOOL: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_D: tl.constexpr, FP8: tl.constexpr):
    batch = tl.program_id(1).to(tl.int64)
    pools = tl.program_id(0) * BLOCK_P + tl.arange(0, BLOCK_P)
    channels = tl.arange(0, BLOCK_D)
    channel_ok = channels < d
    mask = (pools < n_pools)[:, None] & channel_ok[None, :]
    first_token = pools.to(tl.int64) * KPOOL  # int64: token * stride passes 2**31 at 1M tokens
    key_rows = keys_ptr + batch * stride_kb + channels[None, :]
    gate_rows = gates_ptr + batch * stride_gb + channels[None, :]

    # Two passes over the pool's tokens (the second reads cached lines): the max, then exp-weights and the sum.
    top = tl.full((BLOCK_P, BLOCK_D), float("-inf"), tl.float32)
    for t in tl.static_range(KPOOL):
        gate = tl.load(gate_rows + (first_token + t)[:, None] * stride_gt, mask=mask, other=0.0).to(tl.float32)
        ape = tl.load(ape_ptr + t * d + channels, mask=channel_ok, other=0.0)
        top = tl.maximum(top, gate + ape[None, :])
    weight_sum = tl.zeros((BLOCK_P, BLOCK_D), tl.float32)
    weighted_keys = tl.zeros((BLOCK_P, BLOCK_D), tl.float32)
    for t in tl.static_range(KPOOL):
        gate = tl.load(gate_rows + (first_token + t)[:, None] * stride_gt, mask=mask, other=0.0).to(tl.float32)
        ape = tl.load(ape_ptr + t * d + channels, mask=channel_ok, other=0.0)
        key = tl.load(key_rows + (first_token + t)[:, None] * stride_kt, mask=mask, other=0.0).to(tl.float32)
        weight = tl.exp(gate + ape[None, :] - top)
        weight_sum += weight
        weighted_keys += weight * key
    pooled = tl.math.div_rn(weighted_keys, weight_sum)  # IEEE division: `/` is approximate on GPUs

    out_offsets = batch * stride_ob + pools.to(tl.int64)[:, None] * stride_op + channels[None, :]
    if FP8:
        absmax = tl.max(tl.where(mask, tl.abs(pooled), 0.0), axis=1)
        n = fp8_scale_exponent(absmax)
        # x / 2**n as two exact multiplications: 2**-n alone overflows fp32 for scales below 2**-127.
        half = (-n) >> 1
        values = round_to_e4m3(pooled * pow2(half)[:, None] * pow2(-n - half)[:, None])
        tl.store(out_ptr + out_offsets, values.to(out_ptr.dtype.element_ty), mask=mask)
        tl.store(scale_ptr + batch * stride_sb + pools.to(tl.int64) * stride_sp, pow2(n), mask=pools < n_pools)
    else:
        values = round_to_dtype(pooled, out_ptr.dtype.element_ty)
        tl.store(out_ptr + out_offsets, values.to(out_ptr.dtype.element_ty), mask=mask)


def _check(keys: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor, kpool: int, out_dtype: torch.dtype,
           out: torch.Tensor | None, out_scale: torch.Tensor | None) -> None:
    if keys.dim() != 3 or gate_logits.shape != keys.shape:
        raise ValueError(f"pool_compress needs keys and gate logits of one shape (batch, tokens, d), got "
                         f"{tuple(keys.shape)} and {tuple(gate_logits.shape)}")
    batch, n_tokens, d = keys.shape
    if kpool < 1 or n_tokens % kpool:
        raise ValueError(f"pool_compress needs complete pools: {n_tokens} tokens is not a multiple of kpool={kpool}")
    if tuple(ape.shape) != (kpool, d):
        raise ValueError(f"ape must be (kpool, d) = ({kpool}, {d}), got {tuple(ape.shape)}")
    if out_dtype not in OUT_DTYPES:
        raise ValueError(f"pool_compress stores {', '.join(map(str, OUT_DTYPES))}, not {out_dtype}")
    if not (keys.is_floating_point() and gate_logits.is_floating_point() and ape.is_floating_point()):
        raise ValueError("pool_compress needs floating-point keys, gate logits and ape")
    devices = {keys.device, gate_logits.device, ape.device}
    pools_shape = (batch, n_tokens // kpool)
    if out is not None:
        if tuple(out.shape) != (*pools_shape, d) or out.dtype != out_dtype or out.stride(-1) != 1:
            raise ValueError(f"out must be a {out_dtype} tensor of shape {(*pools_shape, d)} with contiguous rows, "
                             f"got {out.dtype} {tuple(out.shape)}")
        devices.add(out.device)
    if (out_scale is not None) != (out is not None and out_dtype == FP8_DTYPE):
        raise ValueError("out_scale goes with out, and only for fp8 storage")
    if out_scale is not None:
        if tuple(out_scale.shape) != pools_shape or out_scale.dtype != torch.float32:
            raise ValueError(f"out_scale must be float32 of shape {pools_shape}, got {out_scale.dtype} "
                             f"{tuple(out_scale.shape)}")
        devices.add(out_scale.device)
    if len(devices) > 1:
        raise ValueError(f"pool_compress needs all tensors on one device, got {sorted(map(str, devices))}")


def pool_compress_reference(keys: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor, kpool: int,
                            out_dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None,
                            out_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """`pool_compress` in plain torch: `pool_keys`, then the cast or `fp8_quantize`."""
    _check(keys, gate_logits, ape, kpool, out_dtype, out, out_scale)
    pooled = pool_keys(keys, gate_logits, ape, kpool)
    values, scale = fp8_quantize(pooled) if out_dtype == FP8_DTYPE else (pooled.to(out_dtype), None)
    if out is None:
        return values, scale
    out.copy_(values)
    if out_scale is not None:
        out_scale.copy_(scale)
    return out, out_scale


def pool_compress(keys: torch.Tensor, gate_logits: torch.Tensor, ape: torch.Tensor, kpool: int,
                  out_dtype: torch.dtype = torch.bfloat16, *, out: torch.Tensor | None = None,
                  out_scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Pooled keys (B, N // kpool, d) in out_dtype and, for fp8, their fp32 scales (B, N // kpool); else None.

    keys, gate_logits (B, N, d), N a multiple of kpool, the first token starting a pool; ape (kpool, d).
    out / out_scale: write into these (e.g. a slice of a cache; rows must be contiguous) and return them.
    """
    backend = kernel_backend(keys.device)
    if backend == "torch":
        return pool_compress_reference(keys, gate_logits, ape, kpool, out_dtype, out=out, out_scale=out_scale)
    _check(keys, gate_logits, ape, kpool, out_dtype, out, out_scale)
    check_launchable(_pool_compress_kernel, keys.device)
    batch, n_tokens, d = keys.shape
    n_pools = n_tokens // kpool
    fp8 = out_dtype == FP8_DTYPE
    if out is None:
        out = torch.empty(batch, n_pools, d, dtype=out_dtype, device=keys.device)
        out_scale = torch.empty(batch, n_pools, device=keys.device) if fp8 else None
    if batch * n_pools == 0:
        return out, out_scale
    keys = keys if keys.stride(-1) == 1 else keys.contiguous()
    gate_logits = gate_logits if gate_logits.stride(-1) == 1 else gate_logits.contiguous()
    ape = ape.float().contiguous()
    block_d = triton.next_power_of_2(d)
    block_p = max(1, min(128, 4096 // block_d))
    scale_arg = out_scale if fp8 else out  # an unused pointer when not fp8
    scale_strides = out_scale.stride() if fp8 else (0, 0)
    grid = (triton.cdiv(n_pools, block_p), batch)
    _pool_compress_kernel[grid](
        keys, gate_logits, ape, out, scale_arg, n_pools, d,
        keys.stride(0), keys.stride(1), gate_logits.stride(0), gate_logits.stride(1), out.stride(0), out.stride(1),
        *scale_strides, KPOOL=kpool, BLOCK_P=block_p, BLOCK_D=block_d, FP8=fp8, enable_fp_fusion=True)
    return out, out_scale
