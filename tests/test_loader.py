"""Loading llama-family models from Hugging Face directories and GGUF files, checked against transformers, and the
one-line errors for files we cannot use."""

from __future__ import annotations

import json

import pytest
import torch

from indexpool.model.errors import ModelLoadError
from indexpool.model.loader import load_model
from tests.tiny_models import dequantized_copy, make_hf_model, save_hf_dir, write_gguf

VOCAB = 49152  # the default model's tokenizer is reused, so the tiny models share its vocabulary


def our_logits(loaded, ids: torch.Tensor, segment: int | None = None) -> torch.Tensor:
    model = loaded.model
    cache = model.new_cache(ids.shape[1])
    segment = segment or ids.shape[1]
    with torch.inference_mode():
        parts = [model(ids[:, s : s + segment], s, cache, all_logits=True) for s in range(0, ids.shape[1], segment)]
    return torch.cat(parts, dim=1)


def reference_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids).logits


@pytest.fixture(scope="module")
def ids():
    return torch.randint(17, VOCAB, (1, 77), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(
    "model_type, overrides, shard",
    [
        ("llama", {}, False),
        ("llama", {"tie_word_embeddings": True}, True),
        ("llama", {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
                                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}}, False),
        ("mistral", {}, True),
        ("qwen2", {}, False),
        ("qwen3", {"head_dim": 32}, False),
    ],
    ids=["llama", "llama-tied-sharded", "llama3-rope-scaling", "mistral-sharded", "qwen2-bias", "qwen3-qk-norm"],
)
def test_hf_directory_matches_transformers(tmp_path, reference_tokenizer, ids, model_type, overrides, shard):
    hf = make_hf_model(model_type, VOCAB, **overrides)
    path = save_hf_dir(hf, reference_tokenizer, tmp_path / model_type, shard=shard)
    if shard:
        assert (path / "model.safetensors.index.json").exists()
    loaded = load_model(path, torch.float32)
    assert loaded.config.arch == model_type
    expected = reference_logits(hf, ids)
    assert (our_logits(loaded, ids) - expected).abs().max().item() <= 1e-4
    # Segmented prefill (a causal mask with an offset) gives the same logits.
    assert (our_logits(loaded, ids, segment=20) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("arch, model_type", [("llama", "llama"), ("qwen2", "qwen2"), ("qwen3", "qwen3")])
def test_gguf_f32_matches_transformers(tmp_path, default_gguf_metadata, ids, arch, model_type):
    """F32 tensors: exact weights, so only float rounding separates us from transformers. For llama the Q/K rows
    are stored permuted, as llama.cpp writes them, and must be un-permuted on load."""
    hf = make_hf_model(model_type, VOCAB, **({"head_dim": 32} if model_type == "qwen3" else {}))
    path = write_gguf(hf, tmp_path / f"{arch}.gguf", default_gguf_metadata, arch=arch)
    loaded = load_model(path, torch.float32)
    assert (our_logits(loaded, ids) - reference_logits(hf, ids)).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", ["F16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1"])
def test_gguf_quantized_weights_are_dequantized_exactly(tmp_path, default_gguf_metadata, ids, qtype):
    """Quantized blocks: our logits equal those of the transformers model whose weights went through the same
    quantize/dequantize round trip."""
    hf = make_hf_model("llama", VOCAB)
    path = write_gguf(hf, tmp_path / f"{qtype}.gguf", default_gguf_metadata, qtype=qtype)
    loaded = load_model(path, torch.float32)
    expected = reference_logits(dequantized_copy(hf, qtype), ids)
    assert (our_logits(loaded, ids) - expected).abs().max().item() <= 1e-4


@pytest.mark.parametrize("qtype", ["Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K"])
def test_k_quant_tensors_read_in_row_major_order(tmp_path, qtype):
    """K-quant blocks (which the gguf package can read but not write) come out with the declared (rows, cols)
    shape and each row's values in place: compare with dequantizing the same bytes row by row."""
    import gguf
    import numpy as np

    from indexpool.model.gguf_file import read_gguf

    kind = gguf.GGMLQuantizationType[qtype]
    block, type_size = gguf.GGML_QUANT_SIZES[kind]
    rows, cols = 3, 2 * block
    raw = np.random.default_rng(0).integers(0, 256, size=(rows, cols // block * type_size), dtype=np.uint8)
    # Each block's fp16 super-scale(s) sit at its start (Q2_K/Q3_K/Q6_K: at the end); random bits can be inf or
    # nan, so give every fp16 slot a sane value by clearing the exponent's top bits.
    raw[:, 1::2] &= 0x3B
    path = tmp_path / "k.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_tensor("t", raw, raw_dtype=kind)  # the byte shape; the writer derives (rows, cols)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    values = read_gguf(path).tensor("t")
    assert values.shape == (rows, cols)
    for r in range(rows):
        expected = torch.from_numpy(np.array(gguf.quants.dequantize(raw[r : r + 1], kind))).reshape(-1)
        torch.testing.assert_close(values[r], expected, equal_nan=True)


def test_missing_file(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope.gguf", torch.float32)


def test_truncated_gguf(tmp_path):
    from indexpool.model.default_model import default_model_path

    data = default_model_path().read_bytes()
    for cut in (100, 2_000_000, len(data) - 1000):
        path = tmp_path / f"cut{cut}.gguf"
        path.write_bytes(data[:cut])
        with pytest.raises(ModelLoadError, match="truncated or corrupt"):
            load_model(path, torch.float32)


def test_not_a_gguf(tmp_path):
    path = tmp_path / "text.gguf"
    path.write_text("hello")
    with pytest.raises(ModelLoadError, match="not a GGUF file"):
        load_model(path, torch.float32)


def test_unknown_gguf_architecture(tmp_path, default_gguf_metadata):
    hf = make_hf_model("llama", VOCAB)
    path = write_gguf(hf, tmp_path / "x.gguf", default_gguf_metadata, arch="mamba")
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'mamba'"):
        load_model(path, torch.float32)


def test_unknown_hf_architecture(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt_neox", "hidden_size": 8}))
    with pytest.raises(ModelLoadError, match="unsupported model architecture 'gpt_neox'"):
        load_model(tmp_path, torch.float32)


def test_directory_without_config(tmp_path):
    with pytest.raises(ModelLoadError, match="no config.json"):
        load_model(tmp_path, torch.float32)


def test_prepared_weights_cache_gives_the_same_model(tmp_path, monkeypatch):
    """The second load reads the prepared weights (dequantized + decode copies) back: every parameter and buffer
    equal, so the same logits, prefill (bf16 weights) and decode (int4/int8 copies) alike. (int4 named: a bf16
    model computes on the file's blocks by default, which need no prepared weights.)"""
    from indexpool.model.runtime import load_engine

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = load_engine(None, decode_weights="int4")
    (entry,) = (tmp_path / "indexpool" / "models").glob("*.safetensors")
    restored = load_engine(None, decode_weights="int4")
    built_state = dict(built.model.named_parameters()) | dict(built.model.named_buffers())
    restored_state = dict(restored.model.named_parameters()) | dict(restored.model.named_buffers())
    assert built_state.keys() == restored_state.keys()
    assert all(torch.equal(built_state[k], restored_state[k]) for k in built_state)
    tokens = torch.tensor([built.tokenizer.encode("The capital of France is")])
    for length in (tokens.shape[1], 1):  # a prefill, then a one-token (decode-weight) step
        a = built.model(tokens[:, :length], 0, built.model.new_cache(16))
        b = restored.model(tokens[:, :length], 0, restored.model.new_cache(16))
        assert torch.equal(a, b)
    entry.write_bytes(entry.read_bytes()[:1000])  # damaged: rebuilt, not trusted
    again = load_engine(None, decode_weights="int4")
    assert torch.equal(again.model.tok_embeddings.weight, built.model.tok_embeddings.weight)
    assert any("prepared weights: cache entry" in note and "unusable" in note for note in again.model.load_notes)


@pytest.mark.parametrize("arch, model_type, qtype", [("llama", "llama", "Q4_0"), ("llama", "llama", "Q8_0"),
                                                     ("qwen2", "qwen2", "Q5_1"), ("qwen3", "qwen3", "Q4_1")],
                         ids=["llama-Q4_0", "llama-Q8_0", "qwen2-bias-Q5_1", "qwen3-qk-norm-Q4_1"])
def test_a_model_on_its_gguf_blocks_is_the_dequantized_model(tmp_path, default_gguf_metadata, ids, arch, model_type,
                                                              qtype, monkeypatch):
    """Computing on the file's blocks (memory-mapped, no dequantized copy): the layers' outputs in the model's
    order (llama's Q/K rows stay permuted in the file, their outputs are reordered), the fused parts, biases and
    the tied embedding wired as the dequantized load wires them. Many rows (prefill) multiplying dequantized slices:
    the round-tripped transformers model's logits. In fp32 a prompt's rows take the int8-activation prompt kernel
    instead (all but Q8_0), and a decode step's few rows the decode kernel (tests/test_gguf_blocks.py bounds both):
    near those logits, and exact with the prompt kernel off, or the kernels off (dequantized too)."""
    from tests.kernel_setting import use_kernels
    from indexpool.kernels import gguf_blocks
    from indexpool.model.gguf_weights import BlockLinear, block_parts, weight_count

    hf = make_hf_model(model_type, VOCAB, **({"head_dim": 32} if model_type == "qwen3" else {}))
    path = write_gguf(hf, tmp_path / f"{arch}-{qtype}.gguf", default_gguf_metadata, arch=arch, qtype=qtype)
    loaded = load_model(path, torch.float32, blocks=True)
    linears = [m for m in loaded.model.modules() if isinstance(m, (BlockLinear, torch.nn.Linear))]
    assert linears and all(isinstance(m, BlockLinear) for m in linears)
    assert all(part.blocks is not None for part in block_parts(loaded.model))
    assert weight_count(loaded.model) == sum(p.numel() for p in hf.parameters())
    expected = reference_logits(dequantized_copy(hf, qtype), ids)
    # the activations rounded to int8 blocks: 0.8-1.1% of the largest logit here (a tiny random model's logits hardly
    # move when attention does: the layers' wiring with the prompt kernel is checked exactly in test_gguf_blocks.py)
    assert (our_logits(loaded, ids) - expected).abs().max().item() <= 0.02 * expected.abs().max().item()
    monkeypatch.setattr(gguf_blocks, "int8_prompts", lambda qtype, dtype: False)
    assert (our_logits(loaded, ids) - expected).abs().max().item() <= 1e-4
    use_kernels(monkeypatch, "torch")
    assert (our_logits(loaded, ids[:, :12], segment=1) - expected[:, :12]).abs().max().item() <= 1e-4


def test_the_engine_chooses_the_blocks_for_large_gguf_models(tmp_path, default_gguf_metadata, reference_tokenizer,
                                                            monkeypatch):
    """--decode-weights auto: in fp32, blocks from BLOCKS_MIN_WEIGHTS weights on (here lowered to the tiny model's
    size), dequantized weights below; in bf16, blocks at any size; gguf: always, for a GGUF file; a Hugging Face
    directory has no blocks: a usage error."""
    from indexpool.model import runtime
    from indexpool.model.errors import SettingsError
    from indexpool.model.gguf_weights import block_parts

    hf = make_hf_model("llama", VOCAB)
    path = write_gguf(hf, tmp_path / "m.gguf", default_gguf_metadata, qtype="Q8_0")
    monkeypatch.setenv("INDEXPOOL_PREPARED_WEIGHTS", "0")
    assert not block_parts(runtime.load_engine(str(path), "fp32").model)
    assert block_parts(runtime.load_engine(str(path), "fp32", decode_weights="gguf").model)
    assert block_parts(runtime.load_engine(str(path), "bf16").model)
    assert not block_parts(runtime.load_engine(str(path), "bf16", decode_weights="int4").model)
    monkeypatch.setattr(runtime, "BLOCKS_MIN_WEIGHTS", sum(p.numel() for p in hf.parameters()))
    assert block_parts(runtime.load_engine(str(path), "fp32").model)
    directory = save_hf_dir(hf, reference_tokenizer, tmp_path / "hf")
    with pytest.raises(SettingsError, match="GGUF file"):
        runtime.load_engine(str(directory), "fp32", decode_weights="gguf")
