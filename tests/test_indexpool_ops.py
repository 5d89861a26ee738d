"""IndexPool ops against transformers' Glm5NextTextIndexer (the reference), and the pooled-key cache."""

import pytest
import torch
import torch.nn.functional as F

from indexpool.kernels.index_math import FP8_DTYPE, fp8_dequantize, fp8_quantize, pool_keys, score_pools, select_tokens
from indexpool.model.indexpool import PooledIndexCache, indexer_source_layers, layer_schedule, per_token_index_bytes

HIDDEN, Q_LORA, N_HEADS, HEAD_DIM = 32, 16, 8, 16


def tiny_reference_indexer(kpool: int, topk: int):
    """A randomly initialised transformers indexer; APE, gate and LayerNorm randomised too (they start constant)."""
    from transformers.models.glm5_next.configuration_glm5_next import Glm5NextTextConfig
    from transformers.models.glm5_next.modeling_glm5_next import Glm5NextTextIndexer

    config = Glm5NextTextConfig(hidden_size=HIDDEN, q_lora_rank=Q_LORA, index_n_heads=N_HEADS,
                                index_head_dim=HEAD_DIM, index_topk=topk, index_kpool=kpool, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=2)
    torch.manual_seed(kpool)
    indexer = Glm5NextTextIndexer(config, layer_idx=0).eval()
    with torch.no_grad():
        indexer.index_kpool_compress_ape.normal_()
        indexer.index_kpool_compress_gate.normal_(std=0.3)
        indexer.k_norm.weight.normal_(1.0, 0.2)
        indexer.k_norm.bias.normal_(std=0.2)
    return indexer


@pytest.mark.parametrize("kpool, length", [(4, 23), (16, 37)])
def test_pool_keys_matches_reference_pooling(kpool, length):
    indexer = tiny_reference_indexer(kpool, topk=2 * kpool)
    torch.manual_seed(1)
    keys = torch.randn(2, length, HEAD_DIM)
    gates = 2 * torch.randn(2, length, HEAD_DIM)  # large enough that the softmax is far from uniform
    valid = torch.ones(2, length, 1)
    ref_pooled, ref_indices, ref_complete = indexer.get_pooled_states(torch.cat([keys, gates, valid], dim=-1))

    n_complete = length // kpool * kpool
    assert ref_complete.sum(-1).tolist() == [length // kpool] * 2  # the reference's last pool is the partial one
    ours = pool_keys(keys[:, :n_complete], gates[:, :n_complete], indexer.index_kpool_compress_ape, kpool)
    assert ours.dtype == torch.float32 and ours.shape == (2, length // kpool, HEAD_DIM)
    torch.testing.assert_close(ours, ref_pooled[:, : length // kpool], atol=1e-5, rtol=0)
    assert ref_indices[0, 0].tolist() == list(range(kpool))  # pools start at the first (real) token


def test_pool_keys_rejects_partial_pools():
    with pytest.raises(ValueError, match="multiple of kpool"):
        pool_keys(torch.zeros(1, 6, 8), torch.zeros(1, 6, 8), torch.zeros(4, 8), 4)


def our_selection_from_reference_weights(indexer, hidden, q_resid):
    """Run our pooling, scoring and selection on the reference indexer's own projections."""
    kpool, topk = indexer.index_kpool, indexer.index_topk
    batch, length = hidden.shape[:2]
    q = indexer.wq_b(q_resid).view(batch, length, N_HEADS, HEAD_DIM)
    keys = indexer.k_norm(indexer.wk(hidden))
    gates = F.linear(hidden, indexer.index_kpool_compress_gate)
    weights = indexer.weights_proj(hidden).float() * N_HEADS**-0.5
    n_complete = length // kpool * kpool
    pooled = pool_keys(keys[:, :n_complete], gates[:, :n_complete], indexer.index_kpool_compress_ape, kpool)
    positions = torch.arange(length)
    scores = score_pools(q, weights, pooled, positions, kpool)
    return scores, select_tokens(scores, positions, length, kpool, topk)


@pytest.mark.parametrize("kpool, topk, length", [(4, 8, 27), (16, 32, 75)])
@torch.no_grad()
def test_selection_matches_reference(kpool, topk, length):
    indexer = tiny_reference_indexer(kpool, topk)
    torch.manual_seed(2)
    hidden = torch.randn(2, length, HIDDEN)
    q_resid = torch.randn(2, length, Q_LORA)
    reference = indexer(hidden, q_resid, torch.ones(2, length, dtype=torch.bool), past_key_values=None)
    scores, ours = our_selection_from_reference_weights(indexer, hidden, q_resid)

    width = topk + kpool - 1
    assert reference.shape == ours.shape == (2, length, width)
    n_select = topk // kpool
    tail_lengths, ranked_queries = set(), 0
    for b in range(2):
        for pos in range(length):
            visible = scores[b, pos][torch.isfinite(scores[b, pos])]
            assert visible.numel() == (pos + 1) // kpool
            if visible.numel() > n_select:  # the test data must have a clear winner set, or sets could differ
                ranked = visible.sort(descending=True).values
                assert ranked[n_select - 1] - ranked[n_select] > 1e-4
                ranked_queries += 1
            row = ours[b, pos].tolist()
            real = [i for i in row if i >= 0]
            assert row == real + [-1] * (width - len(real)) and real == sorted(set(real))
            assert set(real) == {i for i in reference[b, pos].tolist() if i >= 0}, (b, pos)
            tail_lengths.add((pos + 1) % kpool)
    assert tail_lengths == set(range(kpool))
    assert ranked_queries >= 2 * 16  # at least 16 queries per sequence choose among more pools than they keep


def test_score_pools_formula_and_visibility():
    torch.manual_seed(3)
    kpool, n_pools = 4, 5
    q = torch.randn(1, 3, 2, 8)
    weights = torch.randn(1, 3, 2)
    pooled = torch.randn(1, n_pools, 8).to(torch.bfloat16)
    positions = torch.tensor([2, 3, 19])  # sees 0 pools, 1 pool (its last token is the query), all 5 pools
    scores = score_pools(q, weights, pooled, positions, kpool)
    assert scores.dtype == torch.float32
    for t, n_visible in enumerate([0, 1, 5]):
        for p in range(n_pools):
            if p >= n_visible:
                assert scores[0, t, p] == float("-inf")
            else:
                per_head = (q[0, t] @ pooled[0, p].float()) * 8**-0.5
                expected = (weights[0, t] * per_head.relu()).sum()
                torch.testing.assert_close(scores[0, t, p], expected, atol=1e-5, rtol=1e-5)


def random_stream(batch, length, d, seed):
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(batch, length, d, generator=generator),
            2 * torch.randn(batch, length, d, generator=generator))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, FP8_DTYPE])
@pytest.mark.parametrize("kpool", [4, 16])
def test_cache_chunked_prefill_then_decode_equals_whole_sequence_pooling(kpool, dtype):
    n_layers, batch, d, length = 2, 2, 16, 44
    ape = torch.randn(n_layers, kpool, d, generator=torch.Generator().manual_seed(4))
    streams = [random_stream(batch, length, d, seed=layer) for layer in range(n_layers)]
    cache = PooledIndexCache(ape, max_tokens=64, batch_size=batch, dtype=dtype)

    def expected_pooled(layer, n_tokens):
        keys, gates = streams[layer]
        n_complete = n_tokens // kpool * kpool
        pooled = pool_keys(keys[:, :n_complete], gates[:, :n_complete], ape[layer], kpool)
        return fp8_dequantize(*fp8_quantize(pooled)) if dtype == FP8_DTYPE else pooled.to(dtype)

    chunks = [7, 1, 13, 3] + [1] * (length - 24)  # uneven prefill, starting mid-pool, then one token at a time
    start, tail_lengths_before_append = 0, set()
    for size in chunks:
        tail_lengths_before_append.add(start % kpool)
        for layer in range(n_layers):
            keys, gates = streams[layer]
            cache.append(layer, keys[:, start:start + size], gates[:, start:start + size])
        start += size
        for layer in range(n_layers):
            keys, gates = streams[layer]
            assert cache.n_tokens(layer) == start and cache.n_pools(layer) == start // kpool
            tail_keys, tail_gates = cache.tail(layer)
            n_tail = start % kpool
            assert torch.equal(tail_keys, keys[:, start - n_tail:start])
            assert torch.equal(tail_gates, gates[:, start - n_tail:start])
            pooled = cache.pooled(layer)
            assert pooled.shape == (batch, start // kpool, d)
            assert torch.equal(pooled, expected_pooled(layer, start))  # bit for bit
    assert tail_lengths_before_append == set(range(kpool))  # a pool was finished from every tail length


def test_cache_rejects_overflow_and_bad_dtype():
    cache = PooledIndexCache(torch.zeros(1, 4, 8), max_tokens=8)
    cache.append(0, torch.zeros(1, 6, 8), torch.zeros(1, 6, 8))
    with pytest.raises(ValueError, match="max_tokens"):
        cache.append(0, torch.zeros(1, 3, 8), torch.zeros(1, 3, 8))
    assert cache.n_tokens(0) == 6  # the refused append changed nothing
    with pytest.raises(ValueError, match="storage dtype"):
        PooledIndexCache(torch.zeros(1, 4, 8), max_tokens=8, dtype=torch.float64)


def test_few_pools_select_everything_visible():
    kpool, topk, length, d = 4, 16, 11, 16  # at most 2 complete pools, fewer than topk // kpool = 4
    keys, gates = random_stream(1, length, d, seed=5)
    cache = PooledIndexCache(torch.randn(1, kpool, d), max_tokens=32)
    cache.append(0, keys, gates)
    positions = torch.arange(length)
    q, weights = torch.randn(1, length, 2, d), torch.randn(1, length, 2)
    scores = score_pools(q, weights, cache.pooled(0), positions, kpool)
    for selection in (select_tokens(scores, positions, length, kpool, topk),
                      select_tokens(None, positions, length, kpool, topk)):
        for pos in range(length):
            assert selection[0, pos].tolist() == list(range(pos + 1)) + [-1] * (topk + kpool - 1 - (pos + 1))


def test_first_queries_without_a_complete_pool_get_only_the_tail():
    kpool, topk, d = 4, 8, 16
    keys, gates = random_stream(1, 3, d, seed=6)
    cache = PooledIndexCache(torch.randn(1, kpool, d), max_tokens=32)
    cache.append(0, keys, gates)
    pooled = cache.pooled(0)
    assert pooled.shape == (1, 0, d)
    positions = torch.arange(3)
    scores = score_pools(torch.randn(1, 3, 2, d), torch.randn(1, 3, 2), pooled, positions, kpool)
    assert scores.shape == (1, 3, 0)
    selection = select_tokens(scores, positions, 3, kpool, topk)
    width = topk + kpool - 1
    assert selection[0].tolist() == [[0] + [-1] * (width - 1), [0, 1] + [-1] * (width - 2),
                                     [0, 1, 2] + [-1] * (width - 3)]


def test_selection_keeps_best_pools_and_the_tail():
    kpool, topk = 4, 8
    scores = torch.tensor([[[5.0, -1.0, 3.0, 4.0, 9.0]]])  # pool 4 (positions 16-19) is not visible at 17
    selection = select_tokens(scores, torch.tensor([17]), 20, kpool, topk)
    assert selection[0, 0].tolist() == [0, 1, 2, 3, 12, 13, 14, 15, 16, 17, -1]
    with pytest.raises(ValueError, match="scores are needed"):
        select_tokens(None, torch.tensor([17]), 20, kpool, topk)


def test_fp8_round_trip_error_bound():
    """e4m3 keeps 3 mantissa bits, so rounding to nearest is off by at most half a unit in the last place: 2**-4
    of the value for normal numbers. The power-of-two scale puts each vector's absmax into (224, 448] and only
    values below 2**-6 * scale are subnormal, with absolute error <= 2**-10 * scale. Per vector that gives a
    relative L2 error <= 2**-4 + sqrt(d) * 2**-10 / 224 < 2**-3: the bound asked for, with a 2x margin; the
    element-wise bounds are checked too, so a scale that clips or wastes range fails here."""
    generator = torch.Generator().manual_seed(7)
    d = 128
    magnitudes = 10.0 ** torch.linspace(-4, 4, 64)[:, None]  # vectors from tiny to large
    x = torch.randn(64, d, generator=generator) * magnitudes
    x[0, :] = 0.0  # an all-zero vector must survive too
    values, scale = fp8_quantize(x)
    assert values.dtype == FP8_DTYPE and scale.dtype == torch.float32
    assert torch.equal(scale, 2.0 ** torch.log2(scale).round())  # powers of two
    ratio = x[1:].abs().amax(-1) / scale[1:]
    assert bool(((ratio > 224) & (ratio <= 448)).all())

    restored = fp8_dequantize(values, scale, torch.float32)
    assert torch.equal(fp8_dequantize(values, scale), restored.to(torch.bfloat16))  # bf16 read is exact
    error = (restored - x).abs()
    normal = x.abs() >= 2.0**-6 * scale[:, None]
    assert bool((error[normal] <= 2.0**-4 * x.abs()[normal]).all())
    assert bool((error[~normal] <= (2.0**-10 * scale[:, None]).expand_as(x)[~normal]).all())
    relative = error.norm(dim=-1)[1:] / x.norm(dim=-1)[1:]
    assert float(relative.max()) <= 2.0**-3
    assert torch.equal(restored[0], x[0])


def test_pooled_index_is_a_quarter_of_per_token_storage_at_kpool_4():
    ape = torch.zeros(3, 4, 128)
    bf16 = PooledIndexCache(ape, max_tokens=64, dtype=torch.bfloat16)
    assert bf16.bytes_per_token() == 64.0
    assert bf16.bytes_per_token() <= 0.26 * per_token_index_bytes(128, torch.bfloat16)
    fp8 = PooledIndexCache(ape, max_tokens=64, dtype=FP8_DTYPE)
    assert fp8.bytes_per_token() == 33.0 and per_token_index_bytes(128, FP8_DTYPE) == 132  # vLLM's layout


def test_shared_indexer_schedule():
    assert indexer_source_layers(["full", "shared", "shared", "full", "shared"]) == [0, 0, 0, 3, 3]
    assert indexer_source_layers(["full", "full"]) == [0, 1]
    with pytest.raises(ValueError, match="start with 'shared'"):
        indexer_source_layers(["shared", "full"])
    with pytest.raises(ValueError, match="unknown kind"):
        indexer_source_layers(["full", "sparse"])
    # A pattern repeats over the layers, cut at the last one (a one-layer model too); none means every layer full.
    assert layer_schedule(["full", "shared", "shared"], 7) == ["full", "shared", "shared"] * 2 + ["full"]
    assert layer_schedule(None, 3) == ["full"] * 3
    assert layer_schedule(["full", "shared"], 2) == ["full", "shared"]
    assert layer_schedule(["full", "shared"], 1) == ["full"]
