"""The Triton kernels (`kernels/`) against their plain torch references, and the backend switch.

Without a GPU the kernels run in Triton's CPU interpreter. Triton decides when `triton.language` and each kernel
are defined whether they are interpreted, so TRITON_INTERPRET=1 is set here before Triton is imported; if another
module imported Triton first (transformers does), it cannot be undone in this process and the module is skipped,
saying so. With a GPU the same tests run the compiled kernels on it. Shapes are small and awkward: partial
tiles, a kpool that is not a power of two, batch > 1, fewer pools than topk, queries that see nothing but their
tail, empty selections, fp8.
"""

import os
import sys

import pytest
from kernel_setting import use_kernels
import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
if DEVICE == "cpu":
    if "triton.language" in sys.modules and os.environ.get("TRITON_INTERPRET", "0").lower() not in ("1", "true", "on"):
        pytest.skip("Triton was imported before TRITON_INTERPRET=1 was set, so its kernels cannot run in the CPU "
                    "interpreter: set it in tests/conftest.py (before any test module is imported), or run "
                    "tests/test_kernels.py on its own", allow_module_level=True)
    os.environ["TRITON_INTERPRET"] = "1"

from indexpool.kernels import (  # noqa: E402
    far_rope_tables, index_scores, index_scores_reference, index_topk, index_topk_reference, kernel_backend,
    pool_compress, pool_compress_reference, sparse_attention, sparse_attention_reference)
from indexpool.kernels.index_math import FP8_DTYPE, fp8_quantize  # noqa: E402
from indexpool.kernels.rope import rope_at  # noqa: E402


@pytest.fixture(autouse=True)
def triton_backend(monkeypatch):
    """Every op below runs its Triton path unless a test says otherwise."""
    use_kernels(monkeypatch, "triton")


def one_ulp(reference: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The spacing of `dtype` values at each reference value (the subnormal spacing near zero)."""
    info = torch.finfo(dtype)
    _, exponent = torch.frexp(reference.float().abs().clamp_min(info.tiny))
    return info.eps * torch.ldexp(torch.ones_like(exponent, dtype=torch.float32), exponent - 1)


def generator(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def randn(*shape, seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(*shape, generator=generator(seed)).to(device=DEVICE, dtype=dtype)


# ---------------------------------------------------------------------------------------------- backend switch

def test_backend_switch(monkeypatch):
    use_kernels(monkeypatch, "torch")
    assert kernel_backend(DEVICE) == "torch"
    use_kernels(monkeypatch, "auto")
    assert kernel_backend("cpu") == "torch"  # auto: Triton only on CUDA
    if DEVICE == "cuda":
        assert kernel_backend("cuda") == "triton"
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    use_kernels(monkeypatch, "triton")
    assert kernel_backend("cpu") == "triton"
    with pytest.raises(ValueError, match="INDEXPOOL_KERNELS='fast' is not one of auto, torch, triton"):
        use_kernels(monkeypatch, "fast")  # the policy is read (at a model load), not the op's call


def test_forced_triton_on_cpu_without_interpreter_is_a_one_line_error(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    use_kernels(monkeypatch, "triton")
    keys = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match="needs TRITON_INTERPRET=1") as error:
        pool_compress(keys, keys, torch.zeros(4, 8), 4)  # the op consults the backend before anything else
    assert "\n" not in str(error.value)
    use_kernels(monkeypatch, "torch")
    assert pool_compress(keys, keys, torch.zeros(4, 8), 4)[0].shape == (1, 1, 8)


# ------------------------------------------------------------------------------------------- pool compression

def assert_pooled_close(values, scale, expected, expected_scale, dtype, keys):
    """Within one step of the storage dtype, plus what the fp32 sums themselves may differ by. The kernel's fp32
    pooled value and the reference's are weighted sums of the pool's keys computed in another order (another exp,
    another summation order): they differ by a few fp32 ulps of the largest term, |key| <= max over the pool,
    which is below a 16-bit step unless the sum cancels to near zero (fp16's steps there are as small as 6e-8; a
    GPU's exp and summation order show it, the interpreter's do not). Then rounding may land on the other side of
    a midpoint: one step more, rarely (about 1 in 10**4; a wrong rounding mode would move half of them). fp8: same
    power-of-two scales (these inputs are nowhere near a binade boundary of absmax / 448), and values within one
    e4m3 step. keys: the pooled keys as read, (..., n_pools * kpool, d)."""
    if dtype == FP8_DTYPE:
        assert torch.equal(scale, expected_scale)
    values, expected = values.float(), expected.float()
    if dtype == torch.float32:
        # fp32 end to end: a handful of roundings (kpool exps and products, one division) in another order.
        torch.testing.assert_close(values, expected, rtol=1e-5, atol=1e-6)
        return
    largest_term = keys.float().unflatten(-2, (expected.shape[-2], -1)).abs().amax(dim=-2)
    if scale is not None:  # fp8 values are stored divided by their vector's scale
        largest_term = largest_term / expected_scale[..., None]
    fp32_sums = 16 * torch.finfo(torch.float32).eps * largest_term  # kpool products and exps, a division
    assert ((values - expected).abs() <= one_ulp(expected, dtype) + fp32_sums).all()
    assert (values != expected).float().mean() < 0.01


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16, FP8_DTYPE])
@pytest.mark.parametrize("kpool, d", [(4, 200), (3, 24)])
def test_pool_compress_matches_reference(dtype, kpool, d):
    n_pools = 37  # not a multiple of the 16 (d = 200) or 128 (d = 24) pools per program
    keys = randn(2, n_pools * kpool, d + 5, seed=1)[..., 3:-2] * 3  # strided rows
    gates = randn(2, n_pools * kpool, d, seed=2, dtype=torch.bfloat16)
    ape = randn(kpool, d, seed=3)
    keys[1, :kpool] = 0  # an all-zero pooled key: fp8 scale 2**-9
    values, scale = pool_compress(keys, gates, ape, kpool, dtype)
    expected, expected_scale = pool_compress_reference(keys, gates, ape, kpool, dtype)
    assert values.dtype == dtype and values.shape == (2, n_pools, d)
    assert (scale is None) == (dtype != FP8_DTYPE)
    assert_pooled_close(values, scale, expected, expected_scale, dtype, keys)


def test_pool_compress_fp8_scale_rule_is_exact():
    """fp8_quantize's scale (smallest power of two >= absmax / 448) at its edges: absmax exactly 448 * 2**k, just
    above it, zero, fp32 subnormal and huge. Equal keys and gates in a pool make the pooled key exactly the key,
    and these keys have few significant bits, so kernel and reference quantize the same fp32 vector: bit-equal."""
    absmax = torch.tensor([448.0, 449.0, 447.0, 1.0, 0.0, 448 * 2.0**-100, 2.0**-130, 3 * 2.0**-140, 1.5 * 2.0**100,
                           7 * 2.0**-12])
    d = 8
    pattern = torch.tensor([1.0, -0.5, 0.25, -0.75, 0.125, 0.0, -1.0, 0.375])  # absmax 1, short mantissas
    pooled = absmax[:, None] * pattern + 0.0  # + 0.0: no negative zeros (a sum of them is +0)
    keys = pooled.repeat_interleave(4, dim=0)[None].to(DEVICE)
    zeros = torch.zeros_like(keys)
    values, scale = pool_compress(keys, zeros, torch.zeros(4, d, device=DEVICE), 4, FP8_DTYPE)
    expected, expected_scale = fp8_quantize(pooled.to(DEVICE))
    assert torch.equal(scale[0], expected_scale)
    assert torch.equal(values[0].view(torch.uint8), expected.view(torch.uint8))


@pytest.mark.parametrize("dtype", [torch.bfloat16, FP8_DTYPE])
def test_pool_compress_writes_into_a_cache_slice(dtype):
    keys, gates, ape = randn(2, 20, 16, seed=4), randn(2, 20, 16, seed=5), randn(4, 16, seed=6)
    cache = torch.full((2, 12, 16), 7.0, device=DEVICE).to(dtype)
    scales = torch.full((2, 12), 7.0, device=DEVICE)
    out_scale = scales[:, 3:8] if dtype == FP8_DTYPE else None
    values, scale = pool_compress(keys, gates, ape, 4, dtype, out=cache[:, 3:8], out_scale=out_scale)
    expected, expected_scale = pool_compress_reference(keys, gates, ape, 4, dtype)
    assert values.data_ptr() == cache[:, 3:8].data_ptr()
    assert_pooled_close(cache[:, 3:8], out_scale, expected, expected_scale, dtype, keys[:, :20])
    untouched = torch.ones(12, dtype=torch.bool)
    untouched[3:8] = False
    assert (cache[:, untouched].float() == 7).all() and (scales[:, untouched] == 7).all()


@pytest.mark.parametrize("bad, message", [
    (dict(n_tokens=10), "not a multiple of kpool=4"),
    (dict(ape_rows=3), r"ape must be \(kpool, d\)"),
    (dict(out_dtype=torch.int8), "pool_compress stores"),
    (dict(out=torch.bfloat16), "out must be a torch.float16 tensor"),
])
def test_pool_compress_rejects_bad_input(bad, message):
    keys = torch.zeros(1, bad.get("n_tokens", 8), 8, device=DEVICE)
    out = torch.zeros(1, 2, 8, dtype=bad["out"], device=DEVICE) if "out" in bad else None
    with pytest.raises(ValueError, match=message):
        pool_compress(keys, keys, torch.zeros(bad.get("ape_rows", 4), 8, device=DEVICE), 4,
                      bad.get("out_dtype", torch.float16), out=out)


# --------------------------------------------------------------------------------------- indexer scores, top-k

def indexer_inputs(batch, n_queries, heads, d, n_pools, pooled_dtype, seed):
    q = randn(batch, n_queries, heads, d, seed=seed)
    weights = randn(batch, n_queries, heads, seed=seed + 1).abs() * heads**-0.5
    weights[..., 0] *= -1  # a negative head weight: scores can go below zero
    pooled = randn(batch, n_pools, d, seed=seed + 2)
    if pooled_dtype == FP8_DTYPE:
        return q, weights, *fp8_quantize(pooled)
    return q, weights, pooled.to(pooled_dtype), None


@pytest.mark.parametrize("pooled_dtype", [torch.bfloat16, torch.float32, FP8_DTYPE])
def test_index_scores_match_reference(pooled_dtype):
    # 300 pools and 19 queries: two tiles of each, the second partial.
    q, weights, pooled, scale = indexer_inputs(2, 19, 3, 24, 300, pooled_dtype, seed=10)
    positions = torch.tensor([[0, 3, 4, 7, 100, 101, 102, 103, 250, 251, 600, 1199, 1200, 1198, 17, 18, 19, 20, 30],
                              [1202, 1201, 5, 9, 13, 2, 1, 0, 400, 401, 402, 403, 404, 405, 406, 407, 408, 409, 410]],
                             device=DEVICE)
    scores = index_scores(q, weights, pooled, positions, 4, scale)
    expected = index_scores_reference(q, weights, pooled, positions, 4, scale)
    visible = expected.isfinite()
    assert torch.equal(scores.isfinite(), visible) and (scores[~visible] == float("-inf")).all()
    # fp32 sums of d products and H heads in another order: ~(d + H) * 2**-24 relative to the sum of absolute
    # terms, which is below 20 here.
    torch.testing.assert_close(scores[visible], expected[visible], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("case", ["decode", "prefill", "fp8", "kpool3", "few pools", "no pools"])
def test_index_topk_matches_reference(case):
    kpool, topk, batch, n_queries, n_pools, dtype = 4, 32, 2, 6, 300, torch.bfloat16
    if case == "decode":
        batch, n_queries, n_pools = 1, 1, 1000
    if case == "fp8":
        dtype = FP8_DTYPE
    if case == "kpool3":
        kpool, topk = 3, 15
    if case == "few pools":
        n_pools = 5  # fewer pools than topk // kpool: everything visible, no scoring
    if case == "no pools":
        n_pools = 0
    q, weights, pooled, scale = indexer_inputs(batch, n_queries, 4, 32, n_pools, dtype, seed=20)
    last = (n_pools + 1) * kpool - 2  # the last position whose pools are all in `pooled`
    # Queries that see nothing but their tail (0, kpool - 2), exactly one pool, fewer pools than topk // kpool,
    # and many; per batch row.
    candidates = [0, kpool - 2, kpool - 1, 5 * kpool + 1, last // 2, last, last - 1, 3 * kpool]
    positions = torch.tensor([[min(p, last) for p in candidates[:n_queries]],
                              [min(p, last) for p in candidates[-n_queries:]]][:batch], device=DEVICE)
    if case == "decode":
        positions = torch.tensor([last - 1], device=DEVICE)  # (T,) positions
    selected = index_topk(q, weights, pooled, positions, kpool, topk, scale)
    expected = index_topk_reference(q, weights, pooled, positions, kpool, topk, scale)
    assert selected.dtype == torch.long and selected.shape == (batch, n_queries, topk + kpool - 1)
    assert torch.equal(selected, expected)


def assert_valid_selection(selected, positions, kpool, n_select):
    """What every selection must be, ties or not: per query min(visible pools, n_select) whole visible pools plus
    the tail, ascending, no repeats, -1 only at the end."""
    for row, position in zip(selected.flatten(0, 1).tolist(), positions.flatten().tolist()):
        visible_pools = (position + 1) // kpool
        tokens = [t for t in row if t >= 0]
        assert row == tokens + [-1] * (len(row) - len(tokens))
        assert tokens == sorted(set(tokens)) and all(t <= position for t in tokens)
        tail = list(range(visible_pools * kpool, position + 1))
        assert tokens[len(tokens) - len(tail):] == tail
        pool_tokens = tokens[: len(tokens) - len(tail)]
        assert len(pool_tokens) == min(visible_pools, n_select) * kpool
        assert all(pool_tokens[i:i + kpool] == list(range(pool_tokens[i], pool_tokens[i] + kpool))
                   and pool_tokens[i] % kpool == 0 for i in range(0, len(pool_tokens), kpool))


def test_index_topk_with_tied_scores_is_valid():
    q, weights, pooled, _ = indexer_inputs(1, 4, 2, 16, 200, torch.bfloat16, seed=30)
    pooled[:, ::2] = pooled[:, :1]  # every even pool scores the same as pool 0
    pooled[:, 1::2] = 0  # every odd pool scores 0
    positions = torch.tensor([2, 41, 399, 801], device=DEVICE)
    selected = index_topk(q, weights, pooled, positions, 4, 32)
    assert_valid_selection(selected, positions.expand(1, 4), 4, 8)


def test_index_topk_rejects_bad_input():
    q, weights, pooled, scale = indexer_inputs(1, 2, 2, 8, 10, FP8_DTYPE, seed=40)
    with pytest.raises(ValueError, match="fp8 pooled keys need their pooled_scale"):
        index_topk(q, weights, pooled, torch.tensor([3, 4], device=DEVICE), 4, 32)
    with pytest.raises(ValueError, match="topk=30 must be a positive multiple of kpool=4"):
        index_topk(q, weights, pooled, torch.tensor([3, 4], device=DEVICE), 4, 30, scale)
    with pytest.raises(ValueError, match=r"query_positions must be \(2,\) or \(1, 2\)"):
        index_topk(q, weights, pooled, torch.tensor([3, 4, 5], device=DEVICE), 4, 32, scale)


# --------------------------------------------------------------------------------------------- sparse attention

def attention_inputs(n_queries, heads, kv_heads, head_dim, n_tokens, n_far, window, query_block, dtype, seed,
                     int8=False, placed_per_block=False):
    """sparse_attention's inputs, and (for checks) the inverse frequencies and placed positions of its tables."""
    g = generator(seed)
    n_blocks = -(-n_queries // query_block)
    inputs = dict(
        q=torch.randn(n_queries, heads, head_dim, generator=g).to(DEVICE, dtype),
        selected=torch.stack([torch.randperm(n_tokens, generator=g)[:n_far].sort().values for _ in range(n_blocks)]),
        window_k=torch.randn(kv_heads, window, head_dim, generator=g).to(DEVICE, dtype),
        window_v=torch.randn(kv_heads, window, head_dim, generator=g).to(DEVICE, dtype),
    )
    if n_far:
        inputs["selected"][:, -3:] = -1  # skipped columns
    # Far tokens closed up into one block far out, as the engine places them near 1M tokens.
    placed = torch.arange(n_far) + (1 << 20) - n_far
    if placed_per_block:
        placed = placed + torch.arange(n_blocks)[:, None]
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, head_dim // 2, dtype=torch.float64) * 2 / head_dim))
    inputs["rope_cos"], inputs["rope_sin"] = far_rope_tables(inv_freq, placed)
    if int8:
        inputs["k_store"] = torch.randint(-127, 128, (n_tokens, kv_heads * head_dim), dtype=torch.int8, generator=g)
        inputs["v_store"] = torch.randint(-127, 128, (n_tokens, kv_heads * head_dim), dtype=torch.int8, generator=g)
        inputs["k_scale"] = torch.rand(n_tokens, kv_heads, generator=g) / 50
        inputs["v_scale"] = torch.rand(n_tokens, kv_heads, generator=g) / 50
    else:
        inputs["k_store"] = torch.randn(n_tokens, kv_heads, head_dim, generator=g).to(dtype)
        inputs["v_store"] = torch.randn(n_tokens, kv_heads * head_dim, generator=g).to(dtype)
    return {name: t.to(DEVICE) for name, t in inputs.items()}, inv_freq.to(DEVICE), placed.to(DEVICE)


def values_bound(inputs) -> float:
    v = inputs["v_store"].float()
    if "v_scale" in inputs:
        v = v.unflatten(-1, (inputs["v_scale"].shape[1], -1)) * inputs["v_scale"][..., None]
    return max(v.abs().max().item(), inputs["window_v"].float().abs().max().item())


ATTENTION_CASES = {
    # name: (T, H, KV, D, history tokens, N far, window W, query block, query offset, dtype, int8, kv splits)
    "decode fp32": (1, 9, 3, 64, 500, 100, 70, 1, 69, torch.float32, False, None),
    "decode fp32 split": (1, 9, 3, 64, 500, 100, 70, 1, 69, torch.float32, False, 3),
    "blocks fp32": (7, 4, 2, 16, 300, 70, 20, 3, 13, torch.float32, False, None),
    "decode bf16": (1, 9, 3, 64, 500, 130, 70, 1, 69, torch.bfloat16, False, 2),
    "segment bf16": (20, 6, 3, 40, 300, 70, 90, 20, 70, torch.bfloat16, False, None),
    "blocks int8": (7, 4, 2, 16, 300, 70, 20, 3, 13, torch.bfloat16, True, 2),
    "fp16 no far": (5, 2, 1, 32, 50, 0, 30, 5, 25, torch.float16, False, None),
    "no window": (3, 4, 2, 32, 100, 40, 0, 3, 0, torch.float32, False, None),
}


@pytest.mark.parametrize("case", ATTENTION_CASES)
def test_sparse_attention_matches_reference(case):
    T, H, KV, D, n_tokens, n_far, window, block, offset, dtype, int8, splits = ATTENTION_CASES[case]
    inputs, _, _ = attention_inputs(T, H, KV, D, n_tokens, n_far, window, block, dtype, seed=50, int8=int8,
                                    placed_per_block=case == "blocks fp32")
    out, lse = sparse_attention(**inputs, query_offset=offset, query_block=block, return_lse=True, kv_splits=splits)
    expected, expected_lse = sparse_attention_reference(**inputs, query_offset=offset, query_block=block,
                                                        return_lse=True)
    assert out.dtype == dtype and out.shape == (T, H, D) and lse.shape == (T, H)
    # The log-sum-exp sees the same rounded keys in both (the kernel's RoPE rounds as the reference's); only fp32
    # sums in another order differ (tensor cores on a GPU).
    torch.testing.assert_close(lse, expected_lse, rtol=1e-5, atol=1e-5)
    if dtype == torch.float32:
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)  # fp32 throughout; summation order only
        return
    # The kernel rounds each softmax weight p to the compute dtype for P @ V (relative error <= eps / 2, and the
    # weights sum to 1, so at most eps / 2 * max|v|); both then round the output (one step apart at most).
    bound = torch.finfo(dtype).eps / 2 * values_bound(inputs) + one_ulp(expected, dtype) + 1e-5
    assert ((out.float() - expected.float()).abs() <= bound).all()


def test_far_rope_tables_are_rope_at_halves():
    """rope_at's cos/sin repeat over the two halves of a head (rotate-half), so half-width tables hold them whole."""
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, 8, dtype=torch.float64, device=DEVICE) / 8))
    placed = torch.tensor([[0, 5, 1 << 20], [7, 8, 1_000_003]], device=DEVICE)
    cos, sin = far_rope_tables(inv_freq, placed)
    full_cos, full_sin = rope_at(inv_freq, placed)
    assert cos.shape == (2, 3, 8) and cos.dtype == torch.float32
    assert torch.equal(torch.cat([cos, cos], -1), full_cos[..., 0, :])
    assert torch.equal(torch.cat([sin, sin], -1), full_sin[..., 0, :])


def test_sparse_attention_query_that_sees_nothing():
    """A query whose far columns are all skipped and whose window starts after it: output 0, log-sum-exp -inf;
    the next query sees one window key."""
    inputs, _, _ = attention_inputs(2, 4, 2, 16, 50, 8, 6, 2, torch.float32, seed=60)
    inputs["selected"][:] = -1
    for op in (sparse_attention, sparse_attention_reference):
        out, lse = op(**inputs, query_offset=-1, return_lse=True)
        assert (out[0] == 0).all() and (lse[0] == float("-inf")).all()
        torch.testing.assert_close(out[1], inputs["window_v"][:, 0].repeat_interleave(2, dim=0))


def attention_part(q, k, v, hidden):
    """Softmax attention of q (t, H, D) over k, v (n, H, D) with hidden (t, n) keys, and its log-sum-exp (t, H)."""
    logits = torch.einsum("thd,nhd->thn", q, k) * q.shape[-1] ** -0.5
    lse = logits.masked_fill(hidden[:, None, :], float("-inf")).logsumexp(dim=-1)
    weights = (logits - lse[..., None]).exp().masked_fill(hidden[:, None, :], 0.0)
    return torch.einsum("thn,nhd->thd", weights, v), lse


def test_sparse_attention_reference_is_what_the_engine_computes():
    """The reference's single softmax equals the engine's way (IndexPoolCache.attend): far keys rotated by roll
    with signed sines at their placed positions, attention per query block over its far part and over the causal
    window separately, the parts merged by log-sum-exp (fp32)."""
    T, H, KV, D, block, window = 6, 6, 3, 16, 2, 12
    inputs, inv_freq, placed = attention_inputs(T, H, KV, D, 200, 40, window, block, torch.float32, seed=70)
    offset = window - T  # the window ends with the queries themselves
    expected = sparse_attention_reference(**inputs, query_offset=offset, query_block=block)

    q, group = inputs["q"], H // KV
    cos, sin = rope_at(inv_freq, placed)  # (N, 1, D)
    sin_signed = torch.cat([-sin[..., : D // 2], sin[..., D // 2:]], dim=-1)
    window_k, window_v = (inputs[name].transpose(0, 1).repeat_interleave(group, dim=1)
                          for name in ("window_k", "window_v"))
    window_hidden = torch.arange(window, device=DEVICE)[None, :] > torch.arange(T, device=DEVICE)[:, None] + offset
    outs = []
    for b, positions in enumerate(inputs["selected"]):
        rows = slice(b * block, (b + 1) * block)
        kept = positions >= 0
        far_k = inputs["k_store"][positions[kept]]
        far_k = far_k * cos[kept] + far_k.roll(D // 2, -1) * sin_signed[kept]
        far_v = inputs["v_store"].view(-1, KV, D)[positions[kept]]
        no_hidden = torch.zeros(block, int(kept.sum()), dtype=torch.bool, device=DEVICE)
        parts = [attention_part(q[rows], far_k.repeat_interleave(group, 1), far_v.repeat_interleave(group, 1),
                                no_hidden),
                 attention_part(q[rows], window_k, window_v, window_hidden[rows])]
        lse = torch.logaddexp(parts[0][1], parts[1][1])
        outs.append(sum(out * (part_lse - lse).exp()[..., None] for out, part_lse in parts))
    torch.testing.assert_close(expected, torch.cat(outs), rtol=1e-5, atol=1e-5)  # fp32 both; summation order only


def test_sparse_attention_rejects_bad_input():
    inputs, _, _ = attention_inputs(4, 4, 2, 16, 50, 8, 6, 2, torch.bfloat16, seed=80)
    with pytest.raises(ValueError, match="4 queries in blocks of 1 make 4 blocks; selected has 2 rows"):
        sparse_attention(**inputs, query_offset=0, query_block=1)
    with pytest.raises(ValueError, match="an int8 history store needs k_scale and v_scale"):
        sparse_attention(**{**inputs, "k_store": inputs["k_store"].to(torch.int8),
                            "v_store": inputs["v_store"].to(torch.int8)}, query_offset=0, query_block=2)
    with pytest.raises(ValueError, match="the window must be in the query dtype"):
        sparse_attention(**{**inputs, "window_k": inputs["window_k"].float()}, query_offset=0, query_block=2)
