"""The lightning indexer (model/lightning_indexer.py), its distillation (model/indexer_training.py) and the
`distill` command, on tiny random models: no big model runs here."""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch

from indexpool.model.indexer_training import (
    DenseCapture,
    DistillConfig,
    SparsePattern,
    capture,
    distill,
    distill_loss,
    fake_quantize,
    pool_targets,
    token_windows,
)
from indexpool.kernels.index_math import fp8_dequantize, fp8_quantize, pool_keys, score_pools
from indexpool.model.lightning_indexer import (
    LightningIndexer,
    LightningIndexerConfig,
    ModelFingerprint,
    default_indexer_location,
    default_indexer_path,
)
from indexpool.model.llama import LlamaConfig, Transformer, rope_tables

TINY = LlamaConfig(vocab_size=96, dim=32, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=8, ffn_dim=48,
                   context_length=256)
FINGERPRINT = ModelFingerprint("tiny", 1234, TINY.n_layers, TINY.dim, TINY.n_heads, TINY.n_kv_heads, TINY.head_dim)
# A pattern scaled down to the tiny model: queries from position 40 on have more than topk far tokens.
PATTERN = SparsePattern(sinks=4, window=16, topk=16, kpool=4)


def tiny_indexer(seed: int = 0, key_dim: int = 8, heads: int = 3) -> LightningIndexer:
    """A random indexer with its gates, APE and norm randomised too (they start constant)."""
    torch.manual_seed(seed)
    indexer = LightningIndexer(LightningIndexerConfig(FINGERPRINT, key_dim, heads, kpool=4))
    with torch.no_grad():
        indexer.key_gate_proj.normal_(std=0.3)
        indexer.ape.normal_()
        indexer.key_norm_weight.normal_(1.0, 0.2)
        indexer.key_norm_bias.normal_(std=0.2)
    return indexer


def tiny_model(seed: int = 0) -> Transformer:
    torch.manual_seed(seed)
    return Transformer(TINY).eval()


def test_protocol_shapes_and_dtypes():
    indexer = tiny_indexer()
    B, T, P = 2, 12, 5
    x = torch.randn(B, T, TINY.dim)
    keys, gates = indexer.keys(1, x, torch.randn(B, T, TINY.n_kv_heads, TINY.head_dim))
    q, weights = indexer.queries(1, x, torch.randn(B, T, TINY.n_heads, TINY.head_dim))
    scores = indexer.score(1, q, weights, torch.randn(B, P, 8).bfloat16())
    assert (indexer.kpool, indexer.key_dim) == (4, 8)
    assert indexer.ape.shape == (TINY.n_layers, 4, 8) and indexer.ape.dtype == torch.float32
    assert keys.shape == gates.shape == (B, T, 8) and keys.dtype == gates.dtype == torch.float32
    assert q.shape == (B, T, 3, 8) and weights.shape == (B, T, 3) and weights.dtype == torch.float32
    assert scores.shape == (B, T, P) and scores.dtype == torch.float32


def test_keys_and_pooling_match_a_hand_computation():
    indexer, layer, kpool = tiny_indexer(), 1, 4
    x = torch.randn(1, 8, TINY.dim)
    with torch.no_grad():
        keys, gates = indexer.keys(layer, x, None)
        pooled = pool_keys(keys, gates, indexer.ape[layer], kpool)[0]
        projected = x[0] @ indexer.key_gate_proj[layer].T

    indexer.requires_grad_(False)
    d = indexer.key_dim
    raw_keys, raw_gates = projected[:, :d], projected[:, d:]
    mean, var = raw_keys.mean(-1, keepdim=True), raw_keys.var(-1, unbiased=False, keepdim=True)
    expected_keys = (raw_keys - mean) / torch.sqrt(var + 1e-5) * indexer.key_norm_weight[layer] + indexer.key_norm_bias[layer]
    torch.testing.assert_close(keys[0], expected_keys, atol=1e-5, rtol=1e-5)
    for p in range(2):  # every channel of both pools, by the formula
        for c in range(d):
            logits = torch.tensor([raw_gates[p * kpool + t, c] + indexer.ape[layer, t, c] for t in range(kpool)])
            weights = logits.exp() / logits.exp().sum()
            expected = sum(weights[t] * expected_keys[p * kpool + t, c] for t in range(kpool))
            torch.testing.assert_close(pooled[p, c], expected, atol=1e-5, rtol=1e-5)


def test_score_is_the_kpool_formula_and_bf16_stays_close():
    indexer = tiny_indexer()
    x = torch.randn(2, 37, TINY.dim)  # more queries than one chunk of score()
    q, weights = indexer.queries(0, x, torch.randn(2, 37, TINY.n_heads, TINY.head_dim))
    pooled = torch.randn(2, 40, 8)
    reference = score_pools(q, weights, pooled, torch.full((37,), 1000), kpool=4)
    torch.testing.assert_close(indexer.score(0, q, weights, pooled), reference, atol=1e-5, rtol=1e-5)
    bf16 = indexer.score(0, q, weights, pooled.bfloat16())
    assert (bf16 - reference).abs().max() < 0.05 * reference.abs().max()


def test_save_load_round_trip_gives_identical_scores(tmp_path):
    indexer = tiny_indexer().round_to_storage_()
    path = tmp_path / "tiny.safetensors"
    indexer.save(path)
    loaded = LightningIndexer.load(path, model=FINGERPRINT)
    assert loaded.config == indexer.config and not any(p.requires_grad for p in loaded.parameters())
    x = torch.randn(1, 16, TINY.dim)
    q_heads = torch.randn(1, 16, TINY.n_heads, TINY.head_dim)
    for layer in range(TINY.n_layers):
        with torch.no_grad():
            expected = [indexer.keys(layer, x, None), indexer.queries(layer, x, q_heads)]
        got = [loaded.keys(layer, x, None), loaded.queries(layer, x, q_heads)]
        for a, b in zip(expected, got):
            assert all(torch.equal(u, v) for u, v in zip(a, b))
        pooled = pool_keys(*got[0], loaded.ape[layer], 4).bfloat16()
        with torch.no_grad():
            assert torch.equal(indexer.score(layer, *expected[1], pooled), loaded.score(layer, *got[1], pooled))


def test_a_mismatched_model_or_file_is_refused(tmp_path):
    path = tmp_path / "tiny.safetensors"
    tiny_indexer().save(path)
    other = dataclasses.replace(FINGERPRINT, file_bytes=FINGERPRINT.file_bytes + 1)
    with pytest.raises(ValueError, match="distilled for 'tiny' \\(1,234 bytes.*not for 'tiny' \\(1,235 bytes"):
        LightningIndexer.load(path, model=other)
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"not a safetensors file")
    with pytest.raises(ValueError, match="cannot read indexer"):
        LightningIndexer.load(garbage)
    from safetensors.torch import save_file

    save_file({"w": torch.zeros(2)}, str(tmp_path / "other.safetensors"))
    with pytest.raises(ValueError, match="not a lightning indexer file"):
        LightningIndexer.load(tmp_path / "other.safetensors")


def test_default_paths():
    assert default_indexer_path("some other model") is None
    assert default_indexer_location("My Model 7B (v2)").name == "my-model-7b-v2.lightning.safetensors"


def test_the_shipped_indexer_fits_the_default_model():
    from indexpool.model.default_model import default_model_path
    from indexpool.model.gguf_file import read_gguf
    from indexpool.model.loader import gguf_config

    path = default_model_path()
    gguf = read_gguf(path)
    c = gguf_config(gguf)
    name = str(gguf.metadata["general.name"])
    fingerprint = ModelFingerprint(name, path.stat().st_size, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim)
    shipped = default_indexer_path(name)
    assert shipped is not None and shipped.stat().st_size < 5_000_000
    indexer = LightningIndexer.load(shipped, model=fingerprint)
    assert (indexer.kpool, indexer.key_dim, indexer.ape.shape) == (4, 32, (30, 4, 32))


def test_auto_reads_segments_with_the_shipped_indexer_where_it_fits_the_model():
    """--indexer auto is hybrid for a model file the shipped trained indexer was distilled from (the default model),
    training-free alone for any other; --indexer hybrid without a shipped indexer is an input error."""
    from types import SimpleNamespace

    from indexpool.model.sessions import SessionOptions, segment_indexer
    from indexpool.console import InputError
    from indexpool.model.default_model import default_model_path
    from indexpool.model.gguf_file import read_gguf
    from indexpool.model.loader import gguf_config

    path = default_model_path()
    gguf = read_gguf(path)
    weights = SimpleNamespace(device=torch.device("cpu"))

    def model_file(name, file_bytes):  # what segment_indexer reads of a loaded model
        return SimpleNamespace(name=name, file_bytes=file_bytes, config=gguf_config(gguf), model=weights)

    default = model_file(str(gguf.metadata["general.name"]), path.stat().st_size)
    assert isinstance(segment_indexer(SessionOptions(), default), LightningIndexer)
    assert isinstance(segment_indexer(SessionOptions(indexer="hybrid"), default), LightningIndexer)
    assert segment_indexer(SessionOptions(indexer="training-free"), default) is None
    assert segment_indexer(SessionOptions(indexer="trained"), default) is None  # it chooses for every forward
    other_quantization = model_file(default.name, default.file_bytes + 1)
    unknown = model_file("some other model", 1)
    for loaded in (other_quantization, unknown):
        assert segment_indexer(SessionOptions(), loaded) is None
        with pytest.raises(InputError):
            segment_indexer(SessionOptions(indexer="hybrid"), loaded)


def test_sparse_pattern_candidates():
    pattern = SparsePattern()  # sinks 64, window 1024, topk 2048, kpool 4
    positions = torch.tensor([100, 1087, 1088, 5000])
    first, ends = pattern.far_pools(positions)
    assert first == 16
    # ws = floor((p - 1024) / 4) * 4, at least 0; candidates are pools [16, ws / 4), none when ws <= 64.
    assert ends.tolist() == [16, 16, 16, (5000 - 1024) // 4]
    p = pattern.first_scored_position()
    assert int(pattern.window_start(torch.tensor(p))) - 64 > 2048 >= int(pattern.window_start(torch.tensor(p - 1))) - 64


def test_pool_targets_sum_over_heads_and_pools_within_candidates():
    probs = torch.rand(3, 2, 64).softmax(-1)
    positions = torch.tensor([50, 63])
    targets = pool_targets(probs, positions, PATTERN)
    first, ends = PATTERN.far_pools(positions)
    for i, end in enumerate(ends.tolist()):
        mass = probs[:, i].sum(0).view(16, 4).sum(-1)
        expected = torch.zeros(16)
        expected[first:end] = mass[first:end] / mass[first:end].sum()
        torch.testing.assert_close(targets[i], expected)


def test_captured_probabilities_are_the_dense_attention():
    """attention_probs times the cached values reproduces what the dense attention returned at those positions."""
    model = tiny_model()
    positions = torch.tensor([5, 40, 77, 95])
    outputs = {}

    class Recording(DenseCapture):
        def attend(self, layer, qk, v, x):
            y = super().attend(layer, qk, v, x)
            inside = (positions >= self.start) & (positions < self.end)
            outputs.setdefault(layer, []).append(y[0, positions[inside] - self.start])
            return y

    cache = Recording(model, 96, positions)
    tokens = torch.randint(0, TINY.vocab_size, (1, 96), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for start in range(0, 96, 32):
            model(tokens[:, start : start + 32], start, cache)
    cos, sin = rope_tables(TINY, 96, torch.float32)
    for layer in range(TINY.n_layers):
        probs = cache.attention_probs(layer, cos, sin)  # (heads, Q, T)
        values = cache.v[layer, 0].repeat_interleave(TINY.n_heads // TINY.n_kv_heads, dim=0)  # (heads, T, D)
        expected = torch.einsum("hqt,htd->qhd", probs, values).flatten(1)
        # Not exact: the capture keeps queries in bf16. A wrong head mapping, RoPE or mask would be off by O(1).
        torch.testing.assert_close(torch.cat(outputs[layer]), expected, atol=1e-3, rtol=0)
        assert (probs[:, 0, 6:] == 0).all()  # causal


def test_capture_samples_scored_positions_and_normalised_targets():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = capture(model, tokens, 8, PATTERN, torch.Generator().manual_seed(2))
    assert seq.positions.min() >= PATTERN.first_scored_position() and len(seq.positions) == 8
    assert seq.key_x.shape[1] == (int(PATTERN.far_pools(seq.positions)[1].max()) - 1) * 4
    torch.testing.assert_close(seq.targets.sum(-1), torch.ones(2, 8))


def test_fake_quantization_is_straight_through():
    pooled = (torch.randn(5, 8) * 3).requires_grad_()
    for storage, stored in [("bf16", pooled.detach().bfloat16().float()),
                            ("fp8", fp8_dequantize(*fp8_quantize(pooled.detach()), dtype=torch.float32))]:
        out = fake_quantize(pooled, storage)
        assert torch.equal(out.detach(), stored) and not torch.equal(stored, pooled.detach())
        (grad,) = torch.autograd.grad((out * torch.arange(8.0)).sum(), pooled)
        torch.testing.assert_close(grad, torch.arange(8.0).expand(5, 8))


def test_distillation_loss_reaches_every_parameter():
    model = tiny_model()
    tokens = torch.randint(0, TINY.vocab_size, (96,), generator=torch.Generator().manual_seed(1)).tolist()
    seq = capture(model, tokens, 8, PATTERN, torch.Generator().manual_seed(2))
    indexer = tiny_indexer()
    for storage in ("bf16", "fp8"):
        indexer.zero_grad()
        distill_loss(indexer, seq, storage, PATTERN).sum().backward()
        for name, p in indexer.named_parameters():
            assert p.grad is not None and p.grad.abs().sum() > 0, (storage, name)


def test_a_few_distillation_steps_lower_the_kl():
    model = tiny_model()
    generator = torch.Generator().manual_seed(3)
    windows = token_windows([torch.randint(0, TINY.vocab_size, (640,), generator=generator).tolist()], 128)
    validation = torch.randint(0, TINY.vocab_size, (128,), generator=generator).tolist()
    config = DistillConfig(context=128, sequences=4, steps=40, queries=32, buffer=2, lr=1e-2, warmup=4,
                           pattern=PATTERN)
    result = distill(model, FINGERPRINT, windows, validation, config, key_dim=8, heads=2)
    assert result.loss_after < 0.7 * result.loss_before, (result.loss_before, result.loss_after)
    again = distill(model, FINGERPRINT, windows, validation, config, key_dim=8, heads=2)
    assert again.loss_after == result.loss_after  # fixed seed, fixed data order


# ------------------------------------------------------------------------------------------- the command


@pytest.fixture(scope="module")
def distill_app():
    """The `distill` command in an app of its own (registering it in the `indexpool` app is app.py's business)."""
    import typer

    from indexpool.distill import distill as distill_command

    app = typer.Typer()
    app.command()(distill_command)
    return app


def test_command_usage_and_input_errors(distill_app, tmp_path):
    from typer.testing import CliRunner

    from indexpool.console import InputError

    runner = CliRunner()
    result = runner.invoke(distill_app, ["--storage", "fp16"])
    assert result.exit_code == 2 and "storage must be bf16 or fp8" in result.output
    result = runner.invoke(distill_app, ["--context", "2048"])
    assert result.exit_code == 2 and "context must exceed" in result.output
    result = runner.invoke(distill_app, ["--text", str(tmp_path / "missing.txt")])
    assert isinstance(result.exception, InputError) and "text file not found" in str(result.exception)
    os.mkfifo(tmp_path / "fifo.txt")  # would block the read, as /dev/zero would never end it
    for special in (tmp_path / "fifo.txt", Path("/dev/zero")):
        result = runner.invoke(distill_app, ["--text", str(special)])
        assert isinstance(result.exception, InputError) and "is not a regular file" in str(result.exception)


def test_command_distills_a_tiny_model_end_to_end(distill_app, tmp_path, default_gguf_metadata):
    """A tiny random GGUF model with the default vocabulary, contexts just long enough for the default pattern."""
    from typer.testing import CliRunner

    from tests.tiny_models import make_hf_model, write_gguf

    gguf = write_gguf(make_hf_model("llama", vocab_size=49152, max_position_embeddings=4096), tmp_path / "tiny.gguf",
                      default_gguf_metadata)
    text = tmp_path / "text.txt"
    text.write_text(" ".join(f"word{i % 997} and {i}." for i in range(3000)))
    out = tmp_path / "out" / "tiny.lightning.safetensors"
    args = ["--model", str(gguf), "--text", str(text), "--out", str(out), "--context", "3300", "--steps", "2",
            "--sequences", "1", "--key-dim", "8", "--heads", "2", "--threads", "1"]
    result = CliRunner().invoke(distill_app, args)
    assert result.exit_code == 0, result.output
    assert f"wrote {out}" in result.output and "validation KL per query and layer" in result.output
    assert [p.name for p in out.parent.iterdir()] == [out.name]  # no temporary file left
    indexer = LightningIndexer.load(out)
    assert (indexer.key_dim, indexer.heads) == (8, 2)
    assert (indexer.config.model.name, indexer.config.model.file_bytes) == ("tiny-test", gguf.stat().st_size)
    from indexpool.console import InputError

    # An --out that cannot be written is refused before the training run, not after it.
    for bad, why in ((out.parent, "is a directory"), (text / "x.safetensors", "is not a directory")):
        result = CliRunner().invoke(distill_app, args[:5] + [str(bad)] + args[6:])
        assert isinstance(result.exception, InputError) and why in str(result.exception)
        assert "validation KL" not in result.output


def test_hybrid_indexer_on_the_command_line(tmp_path):
    """--indexer hybrid: the shipped trained indexer chooses for the document's segments, the training-free one for
    the question; the answer, its sources and the document cache's round trip work as with one indexer."""
    from test_cli import indexpool, ok
    from test_document_jobs import FACT, QUESTION

    from doc_fixtures import write_planted_report

    report = write_planted_report(tmp_path, FACT, topics=6, lines=70)
    command = ["ask", str(report), QUESTION, "--indexer", "hybrid", "--json", "--quiet",
               "--cache-dir", str(tmp_path / "cache"), "-n", "16"]
    first, second = (json.loads(ok(indexpool(*command))) for _ in range(2))
    assert "41729" in first["text"] and first["sources"]
    assert (first["cached"], second["cached"]) == (False, True)
    assert second["text"] == first["text"] and second["sources"] == first["sources"]
