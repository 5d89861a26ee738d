"""Load a llama-family model from a GGUF file or a Hugging Face directory (config.json + safetensors).

Both formats are turned into one canonical list of per-layer tensors, then `build_transformer` fuses Q/K/V and
gate/up and fills the model. Hyperparameters come from the file's own metadata; nothing is guessed.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES

from .default_model import default_model_path
from .errors import ModelLoadError
from .gguf_file import GGUFFile, read_gguf
from .llama import LlamaConfig, Transformer, rope_scaling_factors
from .tokenizer import Tokenizer

# GGUF architectures we run, and whether their Q/K rows were permuted by llama.cpp's converter for its
# interleaved RoPE (llama does; Qwen uses the rotate-half "neox" layout and stores them as they are).
GGUF_ARCHS = {"llama": True, "mistral": True, "qwen2": False, "qwen3": False}
HF_MODEL_TYPES = {"llama", "mistral", "qwen2", "qwen3"}


@dataclass
class LoadedModel:
    model: Transformer
    tokenizer: Tokenizer
    config: LlamaConfig
    source: Path
    name: str
    file_bytes: int
    source_bits_per_weight: float  # storage of the block weights in the file (Q4_1: 5.0, bf16: 16)


def model_path(spec: str | os.PathLike | None) -> Path:
    """The file or directory a model spec names (None: the default model)."""
    path = default_model_path() if spec in (None, "", "default") else Path(spec).expanduser()
    if not path.exists():
        raise ModelLoadError(f"model not found: {path} (give a .gguf file or a Hugging Face model directory)")
    return path


def load_model(spec: str | os.PathLike | None, dtype: torch.dtype, device: str | torch.device = "cpu",
               weights: bool = True, blocks: bool = False) -> LoadedModel:
    """spec: a .gguf file, a Hugging Face model directory, or None for the default model. weights=False builds
    the model with uninitialised weights (for a caller that fills them from prepared copies); llama family only.
    blocks: a GGUF file's linear layers and embedding compute on the file's own blocks, memory-mapped
    (`model.gguf_weights`), where their type has block kernels."""
    path = model_path(spec)
    if path.is_dir():
        return _load_hf_dir(path, dtype, device, weights)
    return _load_gguf(path, dtype, device, weights, blocks)


# Canonical per-layer tensor roles; each loader maps them to its own names.
LAYER_ROLES = ("attn_norm", "q", "k", "v", "q_bias", "k_bias", "v_bias", "q_norm", "k_norm", "o", "ffn_norm", "gate", "up", "down")


def materialize(model: torch.nn.Module, dtype: torch.dtype, device) -> torch.nn.Module:
    """Give a model built on the meta device uninitialised storage on `device`, floating-point tensors in `dtype`,
    in place. One torch.empty per tensor: Module.to_empty goes through empty_like's Python reference for meta
    tensors (0.5 s for the default model's 183 tensors), and a .to(dtype) after it would allocate everything twice."""
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is None or t.device.type != "meta":  # already real: a block layer's bias or order
                    continue
                empty = torch.empty(t.shape, dtype=dtype if t.is_floating_point() else t.dtype, device=device)
                table[name] = torch.nn.Parameter(empty, requires_grad=t.requires_grad) if table is module._parameters else empty
    return model


def build_transformer(config: LlamaConfig, get: Callable[[str], torch.Tensor] | None, dtype, device) -> Transformer:
    """get(role) returns a tensor for 'embed', 'norm', 'output' or 'L.role' (layer L), already in HF layout;
    get=None leaves the weights uninitialised."""
    with torch.device("meta"):
        model = Transformer(config)
    materialize(model, dtype, device)
    if config.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    if get is None:
        model._ensure_rope(config.context_length)
        return model.eval().requires_grad_(False)

    def put(param: torch.Tensor, value: torch.Tensor, what: str) -> None:
        if tuple(param.shape) != tuple(value.shape):
            raise ModelLoadError(f"tensor {what} has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
        param.data.copy_(value)

    with torch.no_grad():
        put(model.tok_embeddings.weight, get("embed"), "embed")
        put(model.norm, get("norm"), "norm")
        if not config.tie_embeddings:
            put(model.output.weight, get("output"), "output")
        for i, block in enumerate(model.layers):
            attn, ffn = block.attention, block.feed_forward
            put(block.attention_norm, get(f"{i}.attn_norm"), f"{i}.attn_norm")
            put(attn.wqkv.weight, torch.cat([get(f"{i}.q"), get(f"{i}.k"), get(f"{i}.v")]), f"{i}.qkv")
            if config.qkv_bias:
                put(attn.wqkv.bias, torch.cat([get(f"{i}.q_bias"), get(f"{i}.k_bias"), get(f"{i}.v_bias")]), f"{i}.qkv_bias")
            if config.qk_norm:
                put(attn.q_norm, get(f"{i}.q_norm"), f"{i}.q_norm")
                put(attn.k_norm, get(f"{i}.k_norm"), f"{i}.k_norm")
            put(attn.wo.weight, get(f"{i}.o"), f"{i}.o")
            put(block.ffn_norm, get(f"{i}.ffn_norm"), f"{i}.ffn_norm")
            put(ffn.w13.weight, torch.cat([get(f"{i}.gate"), get(f"{i}.up")]), f"{i}.gate_up")
            put(ffn.w2.weight, get(f"{i}.down"), f"{i}.down")
    model._ensure_rope(config.context_length)
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------- GGUF

GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "o": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
}


def gguf_config(g: GGUFFile) -> LlamaConfig:
    arch = g.architecture
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"unsupported model architecture '{arch}' in {g.path.name} (supported: {', '.join(GGUF_ARCHS)})")
    need = lambda key: _required(g.arch_value(key), f"{arch}.{key}", g.path)  # noqa: E731
    dim, n_heads = int(need("embedding_length")), int(need("attention.head_count"))
    n_kv = g.arch_value("attention.head_count_kv", n_heads)
    head_dim = int(g.arch_value("attention.key_length", dim // n_heads))
    vocab = g.arch_value("vocab_size") or len(g.metadata.get("tokenizer.ggml.tokens", []))
    freq_factors = None
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1 long-context scaling, stored as a tensor by llama.cpp
        freq_factors = g.tensor("rope_freqs.weight").tolist()
    return LlamaConfig(
        arch=arch,
        vocab_size=int(vocab),
        dim=dim,
        n_layers=int(need("block_count")),
        n_heads=n_heads,
        n_kv_heads=int(n_kv),
        head_dim=head_dim,
        ffn_dim=int(need("feed_forward_length")),
        rope_theta=float(g.arch_value("rope.freq_base", 10000.0)),
        norm_eps=float(g.arch_value("attention.layer_norm_rms_epsilon", 1e-5)),
        context_length=int(g.arch_value("context_length", 4096)),
        tie_embeddings="output.weight" not in g.tensors,
        qkv_bias="blk.0.attn_q.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
        rope_freq_factors=freq_factors,
    )


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved per head) to get the rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype, device, weights: bool = True, blocks: bool = False) -> LoadedModel:
    g = read_gguf(path)
    config = gguf_config(g)
    tokenizer = Tokenizer.from_gguf_metadata(g.metadata)
    permuted = GGUF_ARCHS[config.arch]
    block, type_size = GGML_QUANT_SIZES[g.tensors["blk.0.ffn_up.weight"].qtype]
    name = str(g.metadata.get("general.name") or path.stem)
    if blocks:
        model = build_on_blocks(config, g, dtype, device, permuted)
        return LoadedModel(model, tokenizer, config, path, name, path.stat().st_size, 8 * type_size / block)

    def get(role: str) -> torch.Tensor:
        if role in ("embed", "norm", "output"):
            return g.tensor({"embed": "token_embd.weight", "norm": "output_norm.weight", "output": "output.weight"}[role])
        layer, kind = role.split(".")
        t = g.tensor(f"blk.{layer}.{GGUF_LAYER_NAMES[kind]}")
        if permuted and kind in ("q", "q_bias"):
            t = unpermute_rows(t, config.n_heads)
        elif permuted and kind in ("k", "k_bias"):
            t = unpermute_rows(t, config.n_kv_heads)
        return t

    model = build_transformer(config, get if weights else None, dtype, device)
    return LoadedModel(model, tokenizer, config, path, name, path.stat().st_size, 8 * type_size / block)


def build_on_blocks(config: LlamaConfig, g: GGUFFile, dtype, device, permuted: bool) -> Transformer:
    """The model with its linear layers and embedding on the file's blocks (`BlockLinear`, `BlockEmbedding`),
    shared with a copy-on-write map of the file; tensors of types without block kernels dequantized to `dtype`;
    norms and biases as parameters. Q and K rows stay as stored: their layers reorder their outputs."""
    import numpy as np

    from indexpool.kernels import gguf_blocks
    from .gguf_weights import BlockEmbedding, BlockLinear, WeightPart, file_blocks

    data = np.memmap(g.path, dtype=np.uint8, mode="c")

    def part(name: str) -> WeightPart:
        if name not in g.tensors:
            raise ModelLoadError(f"{g.path.name}: tensor '{name}' is missing; the file is incomplete or not a "
                                 "llama-family model")
        info = g.tensors[name]
        rows, k = info.shape
        if int(info.qtype) in gguf_blocks.TYPES and k % gguf_blocks.TYPES[int(info.qtype)][1] == 0:
            return WeightPart(k, file_blocks(data, info.offset, info.n_bytes, rows), int(info.qtype))
        return WeightPart(k, dense=g.tensor(name).to(dtype))

    def order(rows: int, heads: int) -> torch.Tensor:
        return unpermute_rows(torch.arange(rows), heads) if permuted else torch.arange(rows)

    def bias(i: int) -> torch.Tensor | None:
        if not config.qkv_bias:
            return None
        q, k, v = (g.tensor(f"blk.{i}.attn_{w}.bias") for w in "qkv")
        if permuted:
            q, k = unpermute_rows(q, config.n_heads), unpermute_rows(k, config.n_kv_heads)
        return torch.cat([q, k, v]).to(dtype)

    with torch.device("meta"):
        model = Transformer(config)
    embed = part("token_embd.weight")
    model.tok_embeddings = BlockEmbedding(embed, config.dim, dtype)
    model.output = BlockLinear([embed if config.tie_embeddings else part("output.weight")], config.dim)
    for i, block in enumerate(model.layers):
        q, k, v = (part(f"blk.{i}.attn_{w}.weight") for w in "qkv")
        qkv_order = torch.cat([order(q.rows, config.n_heads), q.rows + order(k.rows, config.n_kv_heads),
                               q.rows + k.rows + torch.arange(v.rows)])
        block.attention.wqkv = BlockLinear([q, k, v], config.dim, bias(i), qkv_order if permuted else None)
        block.attention.wo = BlockLinear([part(f"blk.{i}.attn_output.weight")], config.q_dim)
        block.feed_forward.w13 = BlockLinear([part(f"blk.{i}.ffn_gate.weight"), part(f"blk.{i}.ffn_up.weight")],
                                             config.dim)
        block.feed_forward.w2 = BlockLinear([part(f"blk.{i}.ffn_down.weight")], config.ffn_dim)
    materialize(model, dtype, device)
    with torch.no_grad():
        model.norm.copy_(g.tensor("output_norm.weight"))
        for i, block in enumerate(model.layers):
            block.attention_norm.copy_(g.tensor(f"blk.{i}.attn_norm.weight"))
            block.ffn_norm.copy_(g.tensor(f"blk.{i}.ffn_norm.weight"))
            if config.qk_norm:
                block.attention.q_norm.copy_(g.tensor(f"blk.{i}.attn_q_norm.weight"))
                block.attention.k_norm.copy_(g.tensor(f"blk.{i}.attn_k_norm.weight"))
    model._ensure_rope(config.context_length)
    return model.eval().requires_grad_(False)


# ------------------------------------------------------------------------------------------ Hugging Face

HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight", "q": "self_attn.q_proj.weight", "k": "self_attn.k_proj.weight",
    "v": "self_attn.v_proj.weight", "q_bias": "self_attn.q_proj.bias", "k_bias": "self_attn.k_proj.bias",
    "v_bias": "self_attn.v_proj.bias", "q_norm": "self_attn.q_norm.weight", "k_norm": "self_attn.k_norm.weight",
    "o": "self_attn.o_proj.weight", "ffn_norm": "post_attention_layernorm.weight", "gate": "mlp.gate_proj.weight",
    "up": "mlp.up_proj.weight", "down": "mlp.down_proj.weight",
}


def hf_config(cfg: dict, path: Path) -> LlamaConfig:
    if "text_config" in cfg:
        cfg = {**cfg, **cfg["text_config"]}
    model_type = cfg.get("model_type", "unknown")
    if model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(f"unsupported model architecture '{model_type}' in {path} (supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    need = lambda key: _required(cfg.get(key), key, path / "config.json")  # noqa: E731
    dim, n_heads = int(need("hidden_size")), int(need("num_attention_heads"))
    head_dim = int(cfg.get("head_dim") or dim // n_heads)
    theta = float(cfg.get("rope_theta") or (cfg.get("rope_parameters") or {}).get("rope_theta") or 10000.0)
    scaling = cfg.get("rope_scaling") or cfg.get("rope_parameters") or {}
    scaling_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling_type not in ("default", "llama3"):
        raise ModelLoadError(f"unsupported RoPE scaling '{scaling_type}' in {path / 'config.json'}")
    return LlamaConfig(
        arch=model_type,
        vocab_size=int(need("vocab_size")),
        dim=dim,
        n_layers=int(need("num_hidden_layers")),
        n_heads=n_heads,
        n_kv_heads=int(cfg.get("num_key_value_heads") or n_heads),
        head_dim=head_dim,
        ffn_dim=int(need("intermediate_size")),
        rope_theta=theta,
        norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        context_length=int(cfg.get("max_position_embeddings", 4096)),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
        rope_freq_factors=rope_scaling_factors(head_dim, theta, scaling) if scaling_type == "llama3" else None,
    )


def open_safetensors(path: Path) -> Callable[[str], torch.Tensor | None]:
    """A lookup over one or many (sharded) safetensors files, memory-mapped; returns None for absent names."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {path}")
    handles = {}
    try:
        for f in files:
            handles[f] = safe_open(str(path / f), framework="pt")
    except Exception as e:
        raise ModelLoadError(f"cannot read weights {path / f}: {e}") from None
    if weight_map is None:
        weight_map = {name: f for f, h in handles.items() for name in h.keys()}

    def lookup(name: str) -> torch.Tensor | None:
        f = weight_map.get(name)
        return None if f is None else handles[f].get_tensor(name)

    return lookup


def read_hf_config(path: Path) -> dict:
    """A Hugging Face model directory's config.json, or a one-line ModelLoadError."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    try:
        return json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ModelLoadError(f"{config_file} is not valid JSON: {e}") from None


def _load_hf_dir(path: Path, dtype, device, weights: bool = True) -> LoadedModel:
    raw = read_hf_config(path)
    from .glm5_next_loader import is_glm5_next, load_glm5_next_dir  # the hybrid GLM-5.3-Flash family

    if is_glm5_next(raw):
        return load_glm5_next_dir(path, dtype, device)
    config = hf_config(raw, path)
    tokenizer = Tokenizer.from_hf_dir(path)
    lookup = open_safetensors(path)

    def get(role: str) -> torch.Tensor:
        if role in ("embed", "norm", "output"):
            name = {"embed": "model.embed_tokens.weight", "norm": "model.norm.weight", "output": "lm_head.weight"}[role]
        else:
            layer, kind = role.split(".")
            name = f"model.layers.{layer}.{HF_LAYER_NAMES[kind]}"
        t = lookup(name)
        if t is None:
            raise ModelLoadError(f"tensor '{name}' is missing from the weights in {path}")
        return t

    model = build_transformer(config, get if weights else None, dtype, device)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    bits = torch.finfo(get("0.up").dtype).bits
    return LoadedModel(model, tokenizer, config, path, raw.get("_name_or_path") or path.name, size, bits)


def _required(value, key: str, where: Path):
    if value is None:
        raise ModelLoadError(f"{where}: required metadata '{key}' is missing")
    return value
