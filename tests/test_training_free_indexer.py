"""The training-free indexer's query turned by RoPE averaged over the distances far tokens are read at
(`model/indexers.py`: `rope_average`, `TrainingFreeIndexer(distances=...)`)."""

from __future__ import annotations

import pytest
import torch

from indexpool.kernels.rope import apply_rope, rope_at
from indexpool.model.indexers import TrainingFreeIndexer, rope_average
from indexpool.model.indexpool import PooledIndexCache
from indexpool.model.indexpool_cache import IndexPoolConfig
from indexpool.model.llama import LlamaConfig, inverse_frequencies
from tests.test_indexpool_cache import CONFIG

SCALED = LlamaConfig(vocab_size=97, dim=64, n_layers=2, n_heads=6, n_kv_heads=3, head_dim=16, ffn_dim=64,
                     context_length=8192, rope_theta=100000.0, rope_freq_factors=[1.0] * 4 + [2.0] * 4)


def rotated(config: LlamaConfig, q: torch.Tensor, distance: int) -> torch.Tensor:
    """q (n, head_dim) as RoPE turns it at `distance` positions after an un-rotated key."""
    cos, sin = rope_at(inverse_frequencies(config), torch.tensor([distance]))
    return apply_rope(q[None, None], cos, sin)[0, 0]


@pytest.mark.parametrize("config", [CONFIG, SCALED], ids=["theta1e4", "llama3-factors"])
def test_the_average_is_the_mean_of_the_rotated_queries(config):
    q = torch.randn(5, config.head_dim, generator=torch.Generator().manual_seed(0))
    for lo, hi in ((0, 0), (7, 7), (3, 20), (100, 131)):
        expected = torch.stack([rotated(config, q, d) for d in range(lo, hi + 1)]).mean(0)
        torch.testing.assert_close(q @ rope_average(config, (lo, hi)), expected, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(rope_average(config, (0, 0)), torch.eye(config.head_dim))
    with pytest.raises(ValueError, match="distances"):
        rope_average(config, (5, 4))


def test_fast_frequencies_average_out_and_slow_ones_stay():
    """Over thousands of positions a pair that turns many times keeps almost nothing, one that turns a fraction of
    a turn keeps almost all (RoPE pairs i and i + head_dim/2: the diagonal of the average is their mean cosine)."""
    config = LlamaConfig(vocab_size=97, dim=64, n_layers=1, n_heads=1, n_kv_heads=1, head_dim=64, ffn_dim=64,
                         context_length=8192, rope_theta=100000.0)
    diagonal = rope_average(config, (1024, 3072)).diagonal()
    assert diagonal[:8].abs().max() < 0.01 and diagonal[32:40].abs().max() < 0.01
    assert diagonal[28:32].min() > 0.99 and diagonal[60:].min() > 0.99


def test_scores_at_one_distance_are_the_rotated_queries_softmax_over_pools():
    """distances (d, d): each head's softmax over pools of its query rotated by d against its KV head's slice of the
    mean-pooled keys (22 keys: 5 pools and a tail), summed over heads; and the plain indexer scores unrotated."""
    generator = torch.Generator().manual_seed(1)
    G, D = CONFIG.n_heads // CONFIG.n_kv_heads, CONFIG.head_dim
    keys = torch.randn(1, 22, CONFIG.n_kv_heads, D, generator=generator)
    queries = torch.randn(1, 3, CONFIG.n_heads, D, generator=generator)
    pooled = keys[0, :20].view(5, 4, CONFIG.n_kv_heads, D).mean(1)  # (P, KV, D)

    def reference(distance: int | None) -> torch.Tensor:
        q = queries[0] if distance is None else rotated(CONFIG, queries[0].reshape(-1, D), distance).view_as(queries[0])
        logits = torch.einsum("thd,phd->thp", q, pooled.repeat_interleave(G, dim=1)) * D**-0.5
        return logits.softmax(-1).sum(1)[None]

    for distances in (None, (9, 9), (40, 40)):
        indexer = TrainingFreeIndexer(CONFIG, 4, distances=distances)
        index = PooledIndexCache(indexer.ape, 22, 1, torch.float32)
        index.append(0, *indexer.keys(0, None, keys))
        index_q, weights = indexer.queries(0, None, queries)
        scores = indexer.score(0, index_q, weights, index.pooled(0))
        torch.testing.assert_close(scores, reference(None if distances is None else distances[0]),
                                   atol=1e-5, rtol=1e-5)


def test_a_short_forward_reads_its_far_tokens_from_the_window_back_to_the_window_and_query_topk():
    assert IndexPoolConfig(window=1024, topk=2048, query_topk=1024).far_distances() == (1024, 2048)
    assert IndexPoolConfig(window=1024, topk=512, query_topk=1024).far_distances() == (1024, 1536)  # topk caps it
