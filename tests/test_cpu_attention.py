"""CPU attention in C (kernels/cpu_attention.py): the torch reference against PyTorch's grouped-query attention, and
the C kernel against exact attention on awkward shapes (lengths off the 16- and 64-key blocks, one key, masked
rows, head sizes the kernel specialises and others it falls back on), plus its fallback when it cannot be built."""

from __future__ import annotations

import pytest
from kernel_setting import use_kernels
import torch

from indexpool.kernels import cpu_attention as cpu
from indexpool.kernels import native_build


# (batch, query heads, KV heads, keys, head size, per-sequence visible lengths or None)
SHAPES = [
    (1, 9, 3, 4096, 64, None),  # the default model at 4K
    (3, 12, 4, 37, 64, [37, 5, 20]),  # a batch of rows at their own lengths
    (2, 8, 8, 1, 128, None),  # one key, one query row per KV head
    (1, 16, 1, 65, 32, None),  # 16 rows (the most the kernel takes), head size 32
    (2, 6, 2, 130, 96, [130, 129]),  # head size 96: the kernel's general path
    (1, 4, 2, 17, 80, None),  # head size 80: bf16 needs a multiple of 32 (torch), fp32 a multiple of 16
    (1, 34, 2, 20, 64, None),  # 17 rows per KV head: more than the kernel takes (torch)
]


def _inputs(batch, heads, kv_heads, keys, dim, visible, dtype):
    """q as each KV head's query rows (batch, kv_heads, heads / kv_heads, dim), and k/v as views of a longer cache
    whose unused tail is NaN (a read past `keys` would show)."""
    generator = torch.Generator().manual_seed(keys * 7 + dim)
    q = torch.randn(batch, kv_heads, heads // kv_heads, dim, generator=generator).to(dtype)
    store = torch.full((2, batch, kv_heads, keys + 40, dim), float("nan"), dtype=dtype)
    store[:, :, :, :keys] = torch.randn(2, batch, kv_heads, keys, dim, generator=generator).to(dtype)
    mask = None
    if visible is not None:
        hidden = torch.arange(keys)[None, :] >= torch.tensor(visible)[:, None]
        mask = torch.zeros(hidden.shape, dtype=dtype).masked_fill_(hidden, float("-inf"))[:, None, None, :]
    return q, store[0, :, :, :keys], store[1, :, :, :keys], mask


def _exact(q, k, v, mask, return_lse=False):
    """Attention in fp64 on the same (rounded) inputs, and the log-sum-exp of its logits."""
    logits = q.double() @ k.double().transpose(-1, -2) * q.shape[-1] ** -0.5
    if mask is not None:
        logits = logits + mask.double()
    out = logits.softmax(-1) @ v.double()
    return (out, logits.logsumexp(-1)) if return_lse else out


def _require_kernel(dtype: torch.dtype = torch.float32, dim: int = 64):
    library, origin = cpu.native_library()
    if library is None:
        pytest.skip(f"the C decode-attention kernel is not available here: {origin}")
    if not cpu.native_attention_takes(dtype, dim):
        pytest.skip(f"the C decode-attention kernel does not take {dtype} at head size {dim} on this CPU (bf16 needs "
                    f"AVX512-BF16, or AVX2 without AVX-512): the torch path runs there")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("masked", [False, True])
def test_reference_equals_grouped_query_attention(dtype, masked):
    """The torch reference's folded layout (query heads as rows of their KV head) against PyTorch's grouped-query
    attention, on 3 sequences, 12 query heads over 4 KV heads, 37 keys, rows masked at different lengths."""
    q, k, v, mask = _inputs(3, 12, 4, 37, 16, [37, 5, 20] if masked else None, dtype)
    heads = q.reshape(3, 12, 1, 16)  # query head h is row h % 3 of KV head h // 3
    expected = torch.nn.functional.scaled_dot_product_attention(heads, k, v, attn_mask=mask, enable_gqa=True)
    got = cpu.decode_attention_reference(q, k, v, mask)
    assert got.shape == (3, 4, 3, 16)
    expected = expected.view(got.shape)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), expected.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s[:5])) + ("-masked" if s[5] else ""))
def test_kernel_equals_exact_attention(shape, dtype):
    """fp32: within 1e-6 of fp64 attention (fp32 sums over at most 4,096 keys; exp to 2e-7 relative). bf16: the
    kernel rounds the softmax weights (AVX-512; AVX2 keeps them fp32) and the output to bf16 (each within 2^-9
    relative), so its error is bounded by
    2^-8 of the largest value plus 2^-8 of the largest output (q . k is exact: bf16 products summed in fp32); and it
    is no further from exact than torch's bf16 attention plus one output rounding."""
    _require_kernel()
    q, k, v, mask = _inputs(*shape, dtype)
    exact = _exact(q, k, v, mask)
    got = cpu.decode_attention(q, k, v, mask)
    assert got.shape == exact.shape and got.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=0)
    else:
        error = (got.double() - exact).abs().max().item()
        assert error <= 2**-8 * (v.float().abs().max() + exact.abs().max()).item()
        torch_error = (cpu.decode_attention_reference(q, k, v, mask).double() - exact).abs().max().item()
        assert error <= torch_error + 2**-9 * exact.abs().max().item()


@pytest.mark.parametrize("backend", ["auto", "torch"])
def test_fp32_queries_read_a_bf16_cache(backend, monkeypatch):
    """An fp32 model's bf16 dense cache: the queries rounded to bf16, the result fp32 (by the kernel, or by torch's
    attention in bf16); within the bf16 bound of the kernel test above from exact attention on the rounded queries."""
    if backend == "auto":
        _require_kernel()
    use_kernels(monkeypatch, backend)
    q, k, v, mask = _inputs(3, 12, 4, 137, 64, [137, 5, 70], torch.float32)
    k, v = k.bfloat16(), v.bfloat16()
    got = cpu.decode_attention(q, k, v, mask)
    assert got.shape == q.shape and got.dtype == torch.float32
    exact = _exact(q.bfloat16(), k, v, mask)
    assert (got.double() - exact).abs().max().item() <= 2**-8 * (v.float().abs().max() + exact.abs().max()).item()
    assert torch.equal(got, cpu.decode_attention(q.bfloat16(), k, v, mask).float())


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_kernel_log_sum_exp(dtype):
    """With return_lse the kernel also gives the log-sum-exp of the scaled, masked logits (fp32 arithmetic on the
    rounded inputs: within 1e-5), which the IndexPool cache merges its window and far parts by."""
    _require_kernel(dtype)
    q, k, v, mask = _inputs(3, 12, 4, 137, 64, [137, 5, 70], dtype)
    out, lse = cpu.native_attention(q, k, v, mask, return_lse=True)
    exact_out, exact_lse = _exact(q, k, v, mask, return_lse=True)
    assert lse.shape == (3, 4, 3) and lse.dtype == torch.float32
    torch.testing.assert_close(lse.double(), exact_lse, atol=1e-5, rtol=0)
    assert torch.equal(out, cpu.decode_attention(q, k, v, mask))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim,R", [(64, 3), (96, 3), (64, 40), (128, 40)])
def test_kernel_gathers_and_rotates_keys(dtype, dim, R, one_thread):
    """IndexPool's far part: two query blocks, each attending to its own 37 of a 300-token store's rows (every
    other row NaN: a wrong row would show), keys rotated at per-slot angles. Against fp64 attention on the same
    rows rotated in fp64 (bf16: then rounded to bf16, as the kernel rounds its fp32 rotation; bound as above).
    3 query rows per KV head: the decode kernel; 40 (a prompt's block): the prefill kernel (where it runs)."""
    _require_kernel(dtype, dim)
    if R > cpu.MAX_ROWS and not cpu.prefill_kernel_runs(torch.device("cpu"), dtype, dim):
        assert cpu.native_attention(*(torch.zeros(1, 1, R, dim, dtype=dtype),) * 3) is None
        return
    generator = torch.Generator().manual_seed(dim)
    B, KV, N, tokens = 2, 3, 37, 300
    q = torch.randn(B, KV, R, dim, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(tokens // 2, generator=generator)[:N].sort().values * 2 for _ in range(B)])
    store = torch.full((2, 1, KV, tokens, dim), float("nan"), dtype=dtype)
    store[:, :, :, ::2] = torch.randn(2, 1, KV, (tokens + 1) // 2, dim, generator=generator).to(dtype)
    angles = torch.rand(N, dim // 2, generator=generator, dtype=torch.float64) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
    _check_gathered_and_rotated(q, store, index, cos, sin, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gathered,R", [(False, 3), (True, 3), (True, 40), (False, 40)])
def test_kernel_attention_probabilities(dtype, gathered, R):
    """return_probs: each query row's softmax probabilities over its keys (where a question looks: IndexPool's
    evidence), against fp64 softmax of the same logits: rows at their own masked lengths (masked keys get exactly
    0), 37 keys (off the 16-key blocks), or gathered rows of a store rotated at per-slot angles. The output and
    log-sum-exp match the fp64 ones too. 40 rows per KV head (a short forward sharing one selection) go to the
    decode kernel in chunks of rows when gathered; the prefill kernel gives no probabilities (None) otherwise."""
    _require_kernel(dtype)
    generator = torch.Generator().manual_seed(5)
    B, KV, N, dim = 3, 2, 37, 64
    q = torch.randn(B, KV, R, dim, generator=generator).to(dtype)
    visible = [37, 5, 20]
    hidden = torch.arange(N)[None, :] >= torch.tensor(visible)[:, None]
    mask = torch.zeros(hidden.shape).masked_fill_(hidden, -1e30)[:, None, None, :]  # as IndexPool's branches mask
    if gathered:
        index = torch.stack([torch.randperm(90, generator=generator)[:N].sort().values for _ in range(B)])
        store = torch.randn(2, 1, KV, 90, dim, generator=generator).to(dtype)
        angles = torch.rand(N, dim // 2, generator=generator, dtype=torch.float64) * 6.3
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)
        k = store[0, 0][:, index].transpose(0, 1).double()
        k = k * cos + k.roll(dim // 2, -1) * sin
        k = k.to(dtype).double()  # the kernel rounds its rotated keys to the cache dtype
        args, extra = (q, store[0], store[1], mask), dict(index=index, rope=(cos, sin))
    else:
        store = torch.randn(2, B, KV, N, dim, generator=generator).to(dtype)
        k = store[0].double()
        args, extra = (q, store[0], store[1], mask), {}
    found = cpu.native_attention(*args, return_probs=True, **extra)
    if R > cpu.MAX_ROWS and not gathered:
        assert found is None
        return
    out, lse, probs = found
    logits = q.double() @ k.transpose(-1, -2) * dim**-0.5 + mask.double()
    assert probs.shape == (B, KV, R, N) and probs.dtype == torch.float32
    torch.testing.assert_close(probs.double(), logits.softmax(-1), atol=1e-6, rtol=1e-5)
    assert torch.all(probs[hidden[:, None, None, :].expand_as(probs)] == 0)
    torch.testing.assert_close(lse.double(), logits.logsumexp(-1), atol=1e-5, rtol=0)
    exact = logits.softmax(-1) @ (store[1, 0][:, index].transpose(0, 1) if gathered else store[1]).double()
    tolerance = 1e-6 if dtype == torch.float32 else 2**-8 * (store[1].abs().max() + exact.abs().max()).item()
    torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=0)


PREFILL_SHAPES = [  # (batch, query heads, KV heads, tokens, start, head size, threads)
    (1, 9, 3, 37, 0, 64, 1),  # the default model's heads, one short first segment
    (2, 8, 2, 50, 29, 64, 1),  # a later segment: 29 cached tokens before it
    (1, 6, 6, 5, 70, 128, 1),  # one query head per KV head, head size 128
    (1, 4, 1, 130, 3, 32, 1),  # group 4, head size 32, three 16-token tiles and a tail
    (1, 2, 1, 65, 0, 256, 1),  # head size 256
    (1, 16, 2, 100, 7, 64, 1),  # group 8: a tile of 8 tokens
    (1, 9, 3, 300, 17, 64, 2),  # split between two threads
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape", PREFILL_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prefill_kernel_equals_exact_attention(shape, dtype):
    """The prefill kernel against fp64 causal attention. bf16: within the bf16 bound of the decode kernel's test
    and no further from exact than torch's bf16 attention plus one output rounding; its log-sum-exp within 1e-4
    (q . k exact, fp32 sums over at most 317 keys). fp32: within 1e-6 of the values' scale (8 ulps; each logit is
    one chain of up to 256 fp32 products: head size 256 measured 1.5e-6 at values up to 4.4, torch 0.5e-6), its
    log-sum-exp within 1e-5."""
    B, H, KV, T, start, D, threads = shape
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        runs = cpu.prefill_kernel_runs(torch.device("cpu"), dtype, D)
        why = cpu.prefill_attention_path("cpu", dtype, D)
    finally:
        torch.set_num_threads(previous)
    if not runs:
        pytest.skip(f"the C prefill kernel does not run here: {why}")
    generator = torch.Generator().manual_seed(T + start)
    q = torch.randn(B, T, H + 2 * KV, D, generator=generator).to(dtype)[:, :, :H].transpose(1, 2)  # as the engine
    k, v = (torch.randn(B, KV, start + T + 9, D, generator=generator).to(dtype)[:, :, : start + T] for _ in range(2))
    visible = torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]
    group = H // KV
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1), attn_mask=visible)
    previous = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got, lse = cpu.native_prefill(q, k, v, start, return_lse=True)
    finally:
        torch.set_num_threads(previous)
    assert got.shape == (B, H, T, D) and got.dtype == dtype
    logits = q.double() @ k.double().repeat_interleave(group, 1).transpose(-1, -2) * D**-0.5
    torch.testing.assert_close(lse.double(), logits.masked_fill(~visible, float("-inf")).logsumexp(-1),
                               atol=1e-4 if dtype == torch.bfloat16 else 1e-5, rtol=0)
    error = (got.double() - exact).abs().max().item()
    if dtype == torch.bfloat16:
        torch_out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=visible, enable_gqa=True)
        assert error <= 2**-8 * (v.float().abs().max() + exact.abs().max()).item()
        assert error <= (torch_out.double() - exact).abs().max().item() + 2**-9 * exact.abs().max().item()
    else:
        assert error <= 1e-6 * v.abs().max().item()


# (batch, query heads, KV heads, queries, start, head size) with the key chunk set to 7 below
PROMPT_SHAPES = [
    (1, 6, 2, 5, 0, 64),  # the first segment: its own keys only
    (1, 6, 2, 5, 3, 64),  # fewer earlier keys than a chunk
    (2, 4, 4, 9, 14, 32),  # two whole chunks before the segment
    (1, 8, 2, 16, 23, 64),  # three chunks and a tail of 2
    (1, 3, 1, 1, 30, 128),  # one query
]


@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, torch.float32), (torch.float32, torch.bfloat16),
                                               (torch.bfloat16, torch.bfloat16)], ids=["fp32", "fp32-bf16cache", "bf16"])
@pytest.mark.parametrize("kernels", ["auto", "torch"])
@pytest.mark.parametrize("shape", PROMPT_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_prompt_attention_in_key_chunks_equals_causal_attention(shape, dtype, cache_dtype, kernels, monkeypatch):
    """A prompt segment's attention read in chunks of earlier keys and merged equals causal attention over all of
    them, computed in fp64 on the same rounded inputs (a narrower cache is widened as it is read): fp32 within
    1e-6 of the values' scale (the kernel test's bound; the merge adds a few fp32 roundings of outputs below 1);
    bf16 within one bf16 rounding of the output's and the values' scale, as the prefill kernel."""
    B, H, KV, T, start, D = shape
    use_kernels(monkeypatch, kernels)
    monkeypatch.setattr(cpu, "PROMPT_KEY_CHUNK", 7)
    generator = torch.Generator().manual_seed(T * 31 + start)
    q = torch.randn(B, H, T, D, generator=generator).to(dtype)
    k, v = (torch.randn(B, KV, start + T, D, generator=generator).to(cache_dtype) for _ in range(2))
    visible = torch.arange(start + T)[None, :] <= start + torch.arange(T)[:, None]
    group = H // KV
    exact = torch.nn.functional.scaled_dot_product_attention(
        q.double(), k.double().repeat_interleave(group, 1), v.double().repeat_interleave(group, 1), attn_mask=visible)
    got = cpu.prompt_attention(q, k, v, start)
    assert got.shape == (B, H, T, D) and got.dtype == dtype
    error = (got.double() - exact).abs().max().item()
    if dtype == torch.float32:
        assert error <= 1e-6 * v.double().abs().max().item()
    else:
        assert error <= 2**-8 * (v.double().abs().max() + exact.abs().max()).item()


def test_kernel_runs_where_it_says_it_does():
    """The default model's shapes (bf16 where the CPU has AVX512-BF16, fp32) go to the kernel, not the reference."""
    _require_kernel()
    assert cpu.decode_attention_path("cpu", torch.float32, 64) == cpu.native_library()[1]
    assert "does not take" in cpu.decode_attention_path("cpu", torch.float16, 64)
    assert cpu.decode_attention_path("cuda", torch.bfloat16, 64).startswith("torch")


def test_every_key_masked_gives_zeros():
    """A sequence that sees no key gets a zero output from the kernel (torch's softmax would give NaN)."""
    _require_kernel()
    q, k, v, _ = _inputs(2, 4, 2, 21, 64, None, torch.float32)
    mask = torch.zeros(2, 1, 1, 21)
    mask[1] = float("-inf")
    got = cpu.decode_attention(q, k, v, mask)
    assert torch.equal(got[1], torch.zeros_like(got[1]))
    torch.testing.assert_close(got[0].double(), _exact(q[:1], k[:1], v[:1], None)[0], atol=1e-6, rtol=0)
    assert cpu.native_attention(q, k, v, mask, return_lse=True)[1][1].eq(float("-inf")).all()


@pytest.mark.parametrize("dtype,dim", [(torch.float32, d) for d in (16, 48, 64, 128, 256)]
                         + [(torch.bfloat16, d) for d in (32, 64, 128, 256)])
def test_kernel_rows_keys_and_head_sizes(dtype, dim):
    """Every row count the kernel takes (1..16 per KV head) against key counts on and off its blocks of scores (16
    keys with AVX-512, 8 with AVX2) and values (64 keys), at the head sizes it specialises (64, 128) and others (16,
    48: fp32 vectors in groups that do not divide them; 32, 256); two sequences, the second masked past its first
    keys. Output, log-sum-exp and probabilities against fp64, within the bounds of the tests above."""
    _require_kernel(dtype, dim)
    generator = torch.Generator().manual_seed(dim)
    for keys in (1, 7, 8, 9, 15, 16, 17, 63, 64, 65, 129):
        for R in range(1, cpu.MAX_ROWS + 1):
            q = torch.randn(2, 1, R, dim, generator=generator).to(dtype)
            k, v = (torch.randn(2, 1, keys, dim, generator=generator).to(dtype) for _ in range(2))
            hidden = torch.stack([torch.zeros(keys, dtype=torch.bool), torch.arange(keys) >= (keys + 1) // 2])
            mask = torch.zeros(2, keys).masked_fill_(hidden, float("-inf"))[:, None, None, :]
            out, lse, probs = cpu.native_attention(q, k, v, mask, return_probs=True)
            logits = q.double() @ k.double().transpose(-1, -2) * dim**-0.5 + mask.double()
            exact = logits.softmax(-1) @ v.double()
            assert out.dtype == dtype and probs.shape == (2, 1, R, keys)
            tolerance = 1e-6 if dtype == torch.float32 else 2**-8 * (v.abs().max() + exact.abs().max()).item()
            torch.testing.assert_close(out.double(), exact, atol=tolerance, rtol=0, msg=f"{keys} keys, {R} rows")
            torch.testing.assert_close(lse.double(), logits.logsumexp(-1), atol=1e-5, rtol=0)
            torch.testing.assert_close(probs.double(), logits.softmax(-1), atol=1e-6, rtol=1e-5)
            assert torch.all(probs[hidden[:, None, None, :].expand_as(probs)] == 0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dim", [32, 64, 96, 128, 256])
def test_kernel_rotates_with_tables_per_sequence(dtype, dim):
    """RoPE tables per batch entry (B, N, D): each sequence's gathered keys rotated at its own angles (IndexPool's
    far part when sequences place their selections differently), 13 rows per KV head, against fp64 as in
    test_kernel_gathers_and_rotates_keys."""
    _require_kernel(dtype, dim)
    generator = torch.Generator().manual_seed(dim + 1)
    B, KV, R, N, tokens = 3, 2, 13, 45, 120
    q = torch.randn(B, KV, R, dim, generator=generator).to(dtype)
    index = torch.stack([torch.randperm(tokens, generator=generator)[:N] for _ in range(B)])  # unsorted rows
    store = torch.randn(2, 1, KV, tokens, dim, generator=generator).to(dtype)
    angles = torch.rand(B, N, dim // 2, generator=generator, dtype=torch.float64) * 6.3
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([-angles.sin(), angles.sin()], -1)  # (B, N, dim)
    _check_gathered_and_rotated(q, store, index, cos, sin, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_no_key_seen_gives_zeros_probabilities_and_minus_infinity(dtype):
    """A sequence whose keys are all masked, and an empty cache: output 0, log-sum-exp -inf, probabilities 0."""
    _require_kernel(dtype)
    q, k, v, _ = _inputs(2, 6, 2, 21, 64, None, dtype)
    mask = torch.zeros(2, 1, 1, 21)
    mask[1] = float("-inf")
    out, lse, probs = cpu.native_attention(q, k, v, mask, return_probs=True)
    assert torch.equal(out[1], torch.zeros_like(out[1])) and lse[1].eq(float("-inf")).all()
    assert torch.equal(probs[1], torch.zeros_like(probs[1])) and lse[0].isfinite().all()
    out, lse = cpu.native_attention(q, k[:, :, :0], v[:, :, :0], return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and lse.eq(float("-inf")).all()


def test_switch_to_torch(monkeypatch):
    """INDEXPOOL_KERNELS=torch runs the reference: the same values as the SDPA path, bit for bit."""
    q, k, v, mask = _inputs(3, 12, 4, 37, 64, [37, 5, 20], torch.float32)
    use_kernels(monkeypatch, "torch")
    assert cpu.decode_attention_path("cpu", torch.float32, 64) == "torch (INDEXPOOL_KERNELS=torch)"
    assert torch.equal(cpu.decode_attention(q, k, v, mask), cpu.decode_attention_reference(q, k, v, mask))


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """An empty cache directory and no built kernel; the real one is found again afterwards."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cpu.native_library.cache_clear()
    cpu._supports.cache_clear()
    yield tmp_path
    cpu.native_library.cache_clear()
    cpu._supports.cache_clear()


def test_without_a_compiler_torch_runs(fresh_build, monkeypatch):
    monkeypatch.setenv("CC", str(fresh_build / "no-such-cc"))
    library, origin = cpu.native_library()
    assert library is None and origin.startswith("torch (the C kernel did not build:")
    assert cpu.decode_attention_path("cpu", torch.bfloat16, 64) == origin
    q, k, v, mask = _inputs(3, 12, 4, 37, 64, [37, 5, 20], torch.float32)
    assert torch.equal(cpu.decode_attention(q, k, v, mask), cpu.decode_attention_reference(q, k, v, mask))
    kernels_dir = fresh_build / "indexpool" / "kernels"
    assert not list(kernels_dir.glob("*.so")) and [p.suffix for p in kernels_dir.iterdir()] == [".failed"]
    cpu.native_library.cache_clear()  # a later run does not try again
    monkeypatch.setattr(native_build, "_build", lambda *args: pytest.fail("rebuilt after a failed build"))
    assert cpu.native_library() == (None, origin)


def test_a_library_that_faults_is_not_used(fresh_build, monkeypatch):
    """A library that crashes (as one with an instruction the CPU faults on would) fails its self-test in a child
    process: this process goes on with torch."""
    fake = fresh_build / "fake-cc"
    fake.write_text('#!/bin/sh\nwhile [ $# -gt 0 ]; do [ "$1" = -o ] && out="$2"; shift; done\n'
                    "printf '#include <stdlib.h>\\nint decode_attention_supports(int a, int b) { return 1; }\\n"
                    "int decode_attention(void) { abort(); }\\n' > \"$out.c\"\n"
                    'exec cc -shared -fPIC "$out.c" -o "$out"\n')
    fake.chmod(0o755)
    monkeypatch.setenv("CC", str(fake))
    library, origin = cpu.native_library()
    assert library is None and origin.startswith("torch (the C kernel failed its self-test:"), origin
    assert not list((fresh_build / "indexpool" / "kernels").glob("*.so"))


def test_build_lands_in_the_cache_directory(fresh_build):
    library, origin = cpu.native_library()
    if library is None:
        pytest.skip(f"the C decode-attention kernel does not build here: {origin}")
    built = list((fresh_build / "indexpool" / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so" and str(built[0]) in origin


@pytest.mark.parametrize("attention", ["dense", "indexpool"])
def test_engine_decodes_the_same_through_the_kernel(attention, monkeypatch):
    """A tiny fp32 model (head size 32, two query rows per KV head) read past its context: each prefill and decode
    step's logits through the C kernel (dense decode steps; IndexPool's window and far parts, gathered and rotated
    in the kernel, of forwards with at most 16 query rows) equal those of the torch path within 1e-5. The IndexPool
    history in fp32 ("full"): a bf16 one would round the kernel's queries and not the torch path's."""
    _require_kernel()
    from dataclasses import replace

    from indexpool.model.generate import Session
    from indexpool.model.indexpool_cache import IndexPoolConfig
    from indexpool.model.llama import Transformer
    from tests.test_indexpool_cache import CONFIG, SETTINGS, prompts_for

    config = replace(CONFIG, head_dim=32)
    torch.manual_seed(3)
    model = Transformer(config).eval()
    prompt = prompts_for(5, [150 if attention == "indexpool" else 50])[0]

    def logits() -> torch.Tensor:
        session = Session(model, 256, attention=IndexPoolConfig(**SETTINGS, kv_storage="full")
                          if attention == "indexpool" else None)
        steps, tokens = [session.prefill(prompt)], list(prompt)
        for _ in range(8):
            tokens.append(int(steps[-1].argmax()))
            steps.append(session.prefill(tokens))
        return torch.cat(steps)

    native = logits()
    use_kernels(monkeypatch, "torch")
    torch.testing.assert_close(native, logits(), atol=1e-5, rtol=0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("attention", ["dense", "indexpool"])
def test_engine_reads_through_the_prefill_kernel(attention, dtype, monkeypatch, one_thread):
    """A tiny model (head size 32) reads a prompt (IndexPool: past its context, in 40-token segments whose
    window, own and far parts each have more than 16 rows) through the prefill kernel. bf16: its logits are no
    further from the same weights' fp32 logits than the torch path's, plus one bf16 rounding of the largest logit.
    fp32 (the history kept in fp32: a bf16 one rounds the C kernels' queries and not the torch path's): within
    1e-5 of the torch path's, relative to the largest logit (fp32 sums in another order, 3 layers)."""
    if not cpu.prefill_kernel_runs(torch.device("cpu"), dtype, 32):
        pytest.skip(f"the C prefill kernel does not run here: {cpu.prefill_attention_path('cpu', dtype, 32)}")
    import copy
    from dataclasses import replace

    from indexpool.model.generate import Session
    from indexpool.model.indexpool_cache import IndexPoolConfig
    from indexpool.model.llama import Transformer
    from tests.test_indexpool_cache import CONFIG, prompts_for

    torch.manual_seed(3)
    model = Transformer(replace(CONFIG, head_dim=32)).eval().to(dtype)
    settings = dict(kpool=4, topk=8, window=8, sinks=4, segment=40, query_tokens=6, query_block=2, segment_block=20,
                    segment_queries=3, segment_candidates=5, kv_storage="full")
    prompt = prompts_for(5, [150 if attention == "indexpool" else 60])[0]

    def logits(model) -> torch.Tensor:
        session = Session(model, 256, attention=IndexPoolConfig(**settings) if attention == "indexpool" else None)
        return session.prefill(prompt).float()

    library = cpu.native_library()[0]
    calls, kernel = [], library.prefill_attention
    monkeypatch.setattr(library, "prefill_attention", lambda *args: calls.append(1) or kernel(*args))
    native = logits(model)
    assert calls  # the kernel ran
    use_kernels(monkeypatch, "torch")
    torch_path = logits(model)
    if dtype == torch.float32:
        assert (native - torch_path).abs().max().item() <= 1e-5 * torch_path.abs().max().item()
        return
    exact = logits(copy.deepcopy(model).float())  # the same weights, widened
    native_error, torch_error = ((t - exact).abs().max().item() for t in (native, torch_path))
    assert native_error <= torch_error + 2**-8 * exact.abs().max().item()


def _check_gathered_and_rotated(q, store, index, cos, sin, dtype):
    """The kernel over the rows `index` lists of store (2, 1, KV, tokens, dim), keys rotated by (cos, sin) ((N, dim)
    shared, or (B, N, dim) per sequence), against the exact attention in fp64."""
    dim = q.shape[-1]
    k, v = (store[i, 0][:, index].transpose(0, 1).double() for i in (0, 1))  # (B, KV, N, dim)
    tables = (cos, sin) if cos.dim() == 2 else (cos[:, None], sin[:, None])
    rotated = k * tables[0] + k.roll(dim // 2, -1) * tables[1]
    if dtype == torch.bfloat16:
        rotated = rotated.to(dtype).double()
    exact, exact_lse = _exact(q, rotated, v, None, return_lse=True)
    got, lse = cpu.native_attention(q, store[0], store[1], return_lse=True, index=index, rope=(cos, sin))
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), exact, atol=1e-6, rtol=0)
        torch.testing.assert_close(lse.double(), exact_lse, atol=1e-5, rtol=0)
    else:
        assert (got.double() - exact).abs().max().item() <= 2**-8 * (v.abs().max() + exact.abs().max()).item()
        torch.testing.assert_close(lse.double(), exact_lse, atol=1e-3, rtol=0)


def test_fp32_prefill_kernel_keeps_to_one_thread(one_thread):
    """The fp32 prefill kernel runs while torch has one thread and gives way to PyTorch's flash kernel with more
    (measured as fast there): native_prefill then returns None and `indexpool info` says why."""
    if not cpu.prefill_kernel_runs(torch.device("cpu"), torch.float32, 64):
        pytest.skip(f"the C prefill kernel does not run here: {cpu.prefill_attention_path('cpu', torch.float32, 64)}")
    q, k, v = torch.randn(1, 9, 40, 64), torch.randn(1, 3, 40, 64), torch.randn(1, 3, 40, 64)
    assert cpu.native_prefill(q, k, v, 0) is not None
    torch.set_num_threads(2)
    assert not cpu.prefill_kernel_runs(torch.device("cpu"), torch.float32, 64)
    assert cpu.native_prefill(q, k, v, 0) is None
    assert "runs on one thread" in cpu.prefill_attention_path("cpu", torch.float32, 64)


@pytest.mark.parametrize("threads", [2, 3, 5])
def test_prefill_kernel_threads_give_the_same_bits_as_one(threads, one_thread, monkeypatch):
    """The kernel's threads prepare the heads, then take whole query tiles (the costly ones first): any number of
    them gives one thread's bits: the default model's heads (9 over 3 KV heads: with two threads one prepares two,
    and the other must wait for them) in a late segment of 100 queries over 3,000 keys, and two sequences of eight
    heads over two (fp32 with the one-thread rule lifted; where only the bf16 kernel runs, bf16)."""
    monkeypatch.setattr(cpu, "FP32_PREFILL_THREADS", max(threads, cpu.FP32_PREFILL_THREADS))
    dtype = next((d for d in (torch.float32, torch.bfloat16) if cpu.prefill_kernel_runs(torch.device("cpu"), d, 64)),
                 None)
    if dtype is None:
        pytest.skip(f"the C prefill kernel does not run here: {cpu.prefill_attention_path('cpu', torch.float32, 64)}")
    generator = torch.Generator().manual_seed(threads)
    for B, H, KV, T, start in ((1, 9, 3, 100, 2900), (2, 8, 2, 500, 29)):
        q = torch.randn(B, T, H + 2 * KV, 64, generator=generator).to(dtype)[:, :, :H].transpose(1, 2)
        k, v = (torch.randn(B, KV, start + T, 64, generator=generator).to(dtype) for _ in range(2))
        torch.set_num_threads(threads)  # first: its scratch memory is not one thread's run of the same inputs
        many = cpu.native_prefill(q, k, v, start, return_lse=True)
        torch.set_num_threads(1)
        one = cpu.native_prefill(q, k, v, start, return_lse=True)
        assert all(torch.equal(a, b) for a, b in zip(one, many))
