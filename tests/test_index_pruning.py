"""Dimension pruning of the training-free indexer (`model/index_pruning.py`): the directions kept, the scores they
give, the calibration on the model's own keys, and `--prune-index` on the command line."""

from __future__ import annotations

import json

import pytest
import torch

from indexpool.model.index_pruning import KeyMoments, calibrate, projection_from_covariance
from indexpool.model.indexers import TrainingFreeIndexer
from indexpool.model.indexpool import PooledIndexCache
from tests.test_indexpool_cache import CONFIG, tiny_model

KV_DIM = CONFIG.n_kv_heads * CONFIG.head_dim


def test_the_directions_holding_the_share_of_the_variance_are_kept():
    rotation = torch.linalg.qr(torch.randn(2, KV_DIM, KV_DIM, dtype=torch.float64)).Q
    variances = torch.tensor([[8.0, 1.0, 0.5, 0.5] + [0.0] * (KV_DIM - 4),
                              [4.0, 4.0] + [0.0] * (KV_DIM - 2)], dtype=torch.float64)
    covariance = rotation @ torch.diag_embed(variances) @ rotation.transpose(1, 2)
    projection, needed = projection_from_covariance(covariance, share=0.92)
    assert needed == [3, 2]  # 8 + 1 of 10 is 90%, + 0.5 is 95%: 3 for the first; the second needs both
    assert projection.shape == (2, KV_DIM, 3)
    torch.testing.assert_close(projection.transpose(1, 2) @ projection, torch.eye(3).expand(2, 3, 3), atol=1e-6, rtol=0)
    top = rotation[0, :, 0].float()  # the first layer's most variable direction comes first
    assert abs(float(projection[0, :, 0] @ top)) == pytest.approx(1.0, abs=1e-6)
    with pytest.raises(ValueError, match="share"):
        projection_from_covariance(covariance, share=0)


def test_a_covariance_the_eigensolver_refuses_is_decomposed_by_svd(monkeypatch):
    """Where eigh fails to converge (LAPACK refused a layer whose keys vary in 27 of 512 directions, the rest
    constant), the SVD gives the same directions (up to sign) and counts; a covariance that is not finite (keys
    that overflowed) is refused with what to do."""
    rotation = torch.linalg.qr(torch.randn(3, KV_DIM, KV_DIM, dtype=torch.float64,
                                           generator=torch.Generator().manual_seed(2))).Q
    variances = torch.zeros(3, KV_DIM, dtype=torch.float64)
    variances[:, :5] = torch.tensor([[9.0, 4.0, 2.0, 1.0, 0.5], [3.0, 3.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]])
    covariance = rotation @ torch.diag_embed(variances) @ rotation.transpose(1, 2)
    want, want_needed = projection_from_covariance(covariance, share=0.95)

    def refuse(matrix):
        raise torch.linalg.LinAlgError("linalg.eigh: The algorithm failed to converge")

    monkeypatch.setattr(torch.linalg, "eigh", refuse)
    got, needed = projection_from_covariance(covariance, share=0.95)
    assert needed == want_needed == [4, 3, 1] and got.shape == want.shape
    # the same directions: |cos| 1 where a variance stands alone (the equal pair of layer 1 spans the same plane)
    cosines = (got * want).sum(1).abs()
    torch.testing.assert_close(cosines[0], torch.ones(4, dtype=torch.float32), atol=1e-6, rtol=0)
    plane = want[1, :, :2]
    torch.testing.assert_close((plane.T @ got[1, :, :2]).norm(dim=0), torch.ones(2), atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="no-prune-index"):
        projection_from_covariance(covariance * float("inf"), share=0.95)


def scores(indexer, keys, queries):
    """The indexer's scores (1, T, P) of queries (1, T, heads, head_dim) against keys (1, N, KV, head_dim), pooled
    as the IndexPool cache pools them."""
    index = PooledIndexCache(indexer.ape, keys.shape[1], 1, torch.float32)
    index.append(0, *indexer.keys(0, None, keys))
    index_q, weights = indexer.queries(0, None, queries)
    return indexer.score(0, index_q, weights, index.pooled(0))


def test_pruned_scores_equal_full_ones_when_the_keys_vary_only_in_the_kept_directions():
    """Keys = a large common mean + variation in 3 directions: projected on those 3 (the mean mostly dropped), the
    scores are the full keys' (the mean adds the same logit to every pool, which the softmax over pools ignores)."""
    generator = torch.Generator().manual_seed(0)
    basis = torch.linalg.qr(torch.randn(KV_DIM, KV_DIM, generator=generator)).Q[:, :3]
    mean = 3 * torch.randn(KV_DIM, generator=generator)
    keys = (mean + torch.randn(40, 3, generator=generator) @ basis.T).view(1, 40, CONFIG.n_kv_heads, CONFIG.head_dim)
    queries = torch.randn(1, 5, CONFIG.n_heads, CONFIG.head_dim, generator=generator)
    flat = keys.flatten(2)[0].double()
    covariance = (flat - flat.mean(0)).T @ (flat - flat.mean(0)) / len(flat)
    projection, needed = projection_from_covariance(covariance[None].expand(CONFIG.n_layers, -1, -1), share=0.999)
    assert projection.shape[-1] == 3
    full = scores(TrainingFreeIndexer(CONFIG, 4), keys, queries)
    pruned = scores(TrainingFreeIndexer(CONFIG, 4, projection=projection), keys, queries)
    torch.testing.assert_close(pruned, full, atol=1e-5, rtol=1e-4)
    identity = torch.eye(KV_DIM).expand(CONFIG.n_layers, -1, -1)  # every direction kept: the same scores
    torch.testing.assert_close(scores(TrainingFreeIndexer(CONFIG, 4, projection=identity), keys, queries), full,
                               atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="does not fit"):
        TrainingFreeIndexer(CONFIG, 4, projection=projection[:, :5])


def test_calibration_measures_the_model_s_own_keys():
    model = tiny_model(3)
    tokens = torch.randint(0, CONFIG.vocab_size, (60,), generator=torch.Generator().manual_seed(1)).tolist()
    projection, needed = calibrate(model, tokens, share=1.0)
    assert projection.shape[:2] == (CONFIG.n_layers, KV_DIM) and len(needed) == CONFIG.n_layers
    captured = []  # the keys the calibration saw, read again with a cache that keeps them
    cache = model.new_cache(60, 1, KeyMoments)
    original = KeyMoments.attend

    def keep(self, layer, qk, v, x):
        captured.append((layer, qk[0, :, CONFIG.n_heads :].flatten(1).double()))
        return original(self, layer, qk, v, x)

    KeyMoments.attend = keep
    try:
        with torch.inference_mode():
            model(torch.tensor([tokens]), 0, cache)
    finally:
        KeyMoments.attend = original
    for layer in range(CONFIG.n_layers):
        keys = torch.cat([k for n, k in captured if n == layer])
        torch.testing.assert_close(cache.covariance()[layer], torch.cov(keys.T, correction=0), atol=1e-9, rtol=1e-7)
    assert cache.tokens == 60


def test_prune_index_on_the_command_line(tmp_path):
    from test_cli import indexpool, ok
    from test_document_jobs import FACT, QUESTION

    from doc_fixtures import write_planted_report

    report = write_planted_report(tmp_path, FACT, topics=6, lines=160)
    out = json.loads(ok(indexpool("ask", str(report), QUESTION, "--prune-index", "--json", "--quiet",
                                  "--cache-dir", str(tmp_path / "cache"), "-n", "16")))
    assert "41729" in out["text"] and out["sources"]
    refused = indexpool("ask", str(report), QUESTION, "--prune-index", "--indexer", "trained")  # a usage error
    assert refused.returncode == 2 and b"Traceback" not in refused.stderr
    assert b"--prune-index applies to the training-free indexer" in refused.stderr


def test_fp16_on_a_cpu_calibrates_only_when_asked(tmp_path, monkeypatch):
    """A CPU emulates fp16, where the calibration's dense read takes minutes: the default keeps whole keys there
    (and calibrates in bf16 and fp32); --prune-index still calibrates."""
    from types import SimpleNamespace

    from indexpool.model import index_pruning
    from indexpool.model.sessions import SessionOptions, default_indexer

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no projection kept from before
    calibrated = []

    def calibrate_stub(model, tokens, share):
        calibrated.append(model.dtype)
        return torch.linalg.qr(torch.randn(CONFIG.n_layers, KV_DIM, KV_DIM)).Q[..., :4], [4] * CONFIG.n_layers

    monkeypatch.setattr(index_pruning, "calibrate", calibrate_stub)
    monkeypatch.setattr("indexpool.model.indexer_training.calibration_text", lambda: "a few words")
    source = tmp_path / "model.gguf"
    source.write_bytes(b"weights")

    def loaded(dtype):
        model = SimpleNamespace(dtype=dtype, device=torch.device("cpu"))
        tokenizer = SimpleNamespace(encode=lambda text: [1, 2, 3])
        return SimpleNamespace(config=CONFIG, model=model, source=source, file_bytes=7, name=f"tiny {dtype}",
                               tokenizer=tokenizer)

    whole = default_indexer(SessionOptions(), loaded(torch.float16))
    assert calibrated == [] and whole.projection is None and whole.key_dim == KV_DIM
    asked = default_indexer(SessionOptions(prune_index=True), loaded(torch.float16))
    assert calibrated == [torch.float16] and asked.key_dim == 4
    pruned = default_indexer(SessionOptions(), loaded(torch.bfloat16))
    assert calibrated == [torch.float16, torch.bfloat16] and pruned.key_dim == 4
