"""Load a llama-family model from a GGUF file or a Hugging Face directory (config.json + safetensors).

Both formats are turned into one canonical list of per-layer tensors, then `build_transformer` fuses Q/K/V and
gate/up and fills the model. Hyperparameters come from the file's own metadata; nothing is guessed.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
from gguf import GGML_QUANT_SIZES

from .default_model import default_model_path
from .errors import ModelLoadError
from .gguf_file import GGUFFile, read_gguf, shown
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
    return model.eval().requires_grad_(False)


# ---------------------------------------------------------------------------------------------------- GGUF

GGUF_LAYER_NAMES = {
    "attn_norm": "attn_norm.weight", "q": "attn_q.weight", "k": "attn_k.weight", "v": "attn_v.weight",
    "q_bias": "attn_q.bias", "k_bias": "attn_k.bias", "v_bias": "attn_v.bias",
    "q_norm": "attn_q_norm.weight", "k_norm": "attn_k_norm.weight", "o": "attn_output.weight",
    "ffn_norm": "ffn_norm.weight", "gate": "ffn_gate.weight", "up": "ffn_up.weight", "down": "ffn_down.weight",
}


def gguf_config(g: GGUFFile) -> LlamaConfig:
    """The model's hyperparameters from the file's metadata, checked against its tensors' shapes (ModelLoadError)."""
    arch = g.architecture
    if arch not in GGUF_ARCHS:
        raise ModelLoadError(f"unsupported model architecture {shown(arch)} in {g.path.name} (supported: {', '.join(GGUF_ARCHS)})")
    values = _ConfigValues(lambda key: g.arch_value(key), g.path, prefix=f"{arch}.")
    dim, n_heads = values.size("embedding_length", "dim"), values.size("attention.head_count", "n_heads")
    tokens = g.metadata.get("tokenizer.ggml.tokens")
    vocab = g.arch_value("vocab_size") or (len(tokens) if isinstance(tokens, list) else None)
    config = _checked(LlamaConfig(
        arch=arch,
        vocab_size=values.size("vocab_size", "vocab_size", given=vocab),
        dim=dim,
        n_layers=values.size("block_count", "n_layers"),
        n_heads=n_heads,
        n_kv_heads=values.size("attention.head_count_kv", "n_heads", default=n_heads),
        head_dim=values.size("attention.key_length", "head_dim", default=dim // n_heads),
        ffn_dim=values.size("feed_forward_length", "ffn_dim"),
        rope_theta=values.number("rope.freq_base", 10000.0),
        norm_eps=values.number("attention.layer_norm_rms_epsilon", 1e-5, zero_allowed=True),
        context_length=values.size("context_length", "context_length", default=4096),
        tie_embeddings="output.weight" not in g.tensors,
        qkv_bias="blk.0.attn_q.bias" in g.tensors,
        qk_norm="blk.0.attn_q_norm.weight" in g.tensors,
    ), g.path)
    _check_gguf_shapes(config, g)
    if "rope_freqs.weight" in g.tensors:  # Llama 3.1 long-context scaling, stored as a tensor by llama.cpp
        config.rope_freq_factors = g.tensor("rope_freqs.weight").tolist()
    return config


def _check_gguf_shapes(config: LlamaConfig, g: GGUFFile) -> None:
    """Every tensor the model reads is in the file, of the shape the metadata gives: the metadata cannot make the
    model larger than the file, and a wrong shape fails here, before any weight is allocated."""
    c = config
    expected = {"token_embd.weight": (c.vocab_size, c.dim), "output_norm.weight": (c.dim,)}
    if not c.tie_embeddings:
        expected["output.weight"] = (c.vocab_size, c.dim)
    if "rope_freqs.weight" in g.tensors:
        expected["rope_freqs.weight"] = (c.head_dim // 2,)
    per_layer = {"attn_norm": (c.dim,), "q": (c.q_dim, c.dim), "k": (c.kv_dim, c.dim), "v": (c.kv_dim, c.dim),
                 "o": (c.dim, c.q_dim), "ffn_norm": (c.dim,), "gate": (c.ffn_dim, c.dim), "up": (c.ffn_dim, c.dim),
                 "down": (c.dim, c.ffn_dim)}
    if c.qkv_bias:
        per_layer.update(q_bias=(c.q_dim,), k_bias=(c.kv_dim,), v_bias=(c.kv_dim,))
    if c.qk_norm:
        per_layer.update(q_norm=(c.head_dim,), k_norm=(c.head_dim,))
    for i in range(c.n_layers):
        expected.update({f"blk.{i}.{GGUF_LAYER_NAMES[role]}": shape for role, shape in per_layer.items()})
    for name, shape in expected.items():
        info = g.tensors.get(name)
        if info is None:
            raise ModelLoadError(f"{g.path.name}: tensor '{name}' is missing; the file is incomplete or not a "
                                 "llama-family model")
        if info.shape != shape:
            raise ModelLoadError(f"{g.path.name}: tensor '{name}' has shape {info.shape}, but the metadata gives "
                                 f"{shape}: the file is damaged")


# Bounds on a model's sizes, checked before anything is allocated, so that a damaged or hostile config.json or GGUF
# header cannot ask for terabytes; far beyond any model of these families.
SIZE_LIMITS = {"dim": 1 << 16, "n_layers": 1024, "n_heads": 1024, "head_dim": 1024, "ffn_dim": 1 << 20,
               "vocab_size": 1 << 22, "context_length": 1 << 24}
# context_length x head_dim: the RoPE tables are built for the whole context at load (1M tokens x 128 at most)
MAX_ROPE_ENTRIES = 1 << 27


class _ConfigValues:
    """Hyperparameters read from a config.json or GGUF metadata, each checked to be of the right type and range;
    a ModelLoadError names the key, the value and the file."""

    def __init__(self, get: Callable[[str], object], where: Path, prefix: str = ""):
        self.get, self.where, self.prefix = get, where, prefix

    def size(self, key: str, kind: str, default: int | None = None, given: object = None) -> int:
        """A whole number from 1 to SIZE_LIMITS[kind]: the key's value (`given` when the caller found it), or
        `default` when it is absent; required when there is no default."""
        value = self.get(key) if given is None else given
        if value is None:
            if default is None:
                raise ModelLoadError(f"{self.where}: required metadata '{self.prefix}{key}' is missing")
            value = default
        most = SIZE_LIMITS[kind]
        if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= most:
            raise ModelLoadError(f"{self.where}: '{self.prefix}{key}' is {shown(value)}, not a whole number "
                                 f"from 1 to {most:,}")
        return value

    def number(self, key: str, default: float, zero_allowed: bool = False) -> float:
        """A finite number above 0 (or 0, where allowed); `default` when the key is absent."""
        value = self.get(key)
        if value is None:
            return default
        if (isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value)
                or value < 0 or (value == 0 and not zero_allowed)):
            least = "0 or more" if zero_allowed else "above 0"
            raise ModelLoadError(f"{self.where}: '{self.prefix}{key}' is {shown(value)}, not a number {least}")
        return float(value)


def _checked(config: LlamaConfig, where: Path) -> LlamaConfig:
    """The relations between the sizes that attention and RoPE need."""
    if config.n_heads % config.n_kv_heads:
        raise ModelLoadError(f"{where}: {config.n_heads} attention heads cannot be shared by {config.n_kv_heads} "
                             "key/value heads (it must divide them)")
    if config.head_dim % 2:
        raise ModelLoadError(f"{where}: the head dimension {config.head_dim} is odd; RoPE rotates pairs")
    if config.context_length * config.head_dim > MAX_ROPE_ENTRIES:
        raise ModelLoadError(f"{where}: a context of {config.context_length:,} tokens with heads of "
                             f"{config.head_dim} needs RoPE tables over {MAX_ROPE_ENTRIES:,} entries: is it damaged?")
    return config


# The tokenizer's metadata and the type each must have (when present; the tokens are required).
_TOKENIZER_METADATA = {
    "tokenizer.ggml.tokens": (list, str, "a list of token strings"),
    "tokenizer.ggml.token_type": (list, int, "a list of integers"),
    "tokenizer.ggml.merges": (list, str, "a list of strings"),
    **{f"tokenizer.ggml.{key}": (int, None, "a token id") for key in (
        "bos_token_id", "eos_token_id", "unknown_token_id", "padding_token_id", "eot_token_id", "eom_token_id")},
    **{key: (str, None, "a string") for key in ("tokenizer.ggml.model", "tokenizer.ggml.pre", "tokenizer.chat_template")},
}


def _check_tokenizer_metadata(g: GGUFFile) -> None:
    """The tokenizer's metadata is of the types the tokenizer reads, so that a damaged file fails in one line."""
    if "tokenizer.ggml.tokens" not in g.metadata:
        raise ModelLoadError(f"{g.path}: required metadata 'tokenizer.ggml.tokens' is missing")
    for key, (kind, item, what) in _TOKENIZER_METADATA.items():
        value = g.metadata.get(key)
        if value is not None and (not isinstance(value, kind) or isinstance(value, bool)
                                  or (item and not all(isinstance(v, item) for v in value))):
            raise ModelLoadError(f"{g.path}: metadata '{key}' is not {what}")


def unpermute_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Undo llama.cpp's Q/K row permutation (pairs interleaved per head) to get the rotate-half layout."""
    rows = w.shape[0]
    return w.reshape(n_heads, rows // n_heads // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)


def _load_gguf(path: Path, dtype, device, weights: bool = True, blocks: bool = False) -> LoadedModel:
    g = read_gguf(path)
    config = gguf_config(g)
    _check_tokenizer_metadata(g)
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
    """The model's hyperparameters from a config.json (as read_hf_config gives it), each checked (ModelLoadError)."""
    where = path / "config.json"
    if isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    model_type = cfg.get("model_type", "unknown")
    if not isinstance(model_type, str) or model_type not in HF_MODEL_TYPES:
        raise ModelLoadError(f"unsupported model architecture {shown(model_type)} in {path} (supported: {', '.join(sorted(HF_MODEL_TYPES))})")
    values = _ConfigValues(cfg.get, where)
    dim, n_heads = values.size("hidden_size", "dim"), values.size("num_attention_heads", "n_heads")
    head_dim = values.size("head_dim", "head_dim", default=dim // n_heads)
    parameters = cfg.get("rope_parameters") or {}  # transformers 5: rope_theta and the scaling together
    scaling = cfg.get("rope_scaling") or parameters
    for key, value in (("rope_parameters", parameters), ("rope_scaling", scaling)):
        if not isinstance(value, dict):
            raise ModelLoadError(f"{where}: '{key}' is {shown(value)}, not an object")
    theta = (values.number("rope_theta", 0.0)
             or _ConfigValues(parameters.get, where, prefix="rope_parameters.").number("rope_theta", 0.0) or 10000.0)
    scaling_type = scaling.get("rope_type", scaling.get("type", "default"))
    if scaling_type not in ("default", "llama3"):
        raise ModelLoadError(f"unsupported RoPE scaling {shown(scaling_type)} in {where}")
    config = _checked(LlamaConfig(
        arch=model_type,
        vocab_size=values.size("vocab_size", "vocab_size"),
        dim=dim,
        n_layers=values.size("num_hidden_layers", "n_layers"),
        n_heads=n_heads,
        n_kv_heads=values.size("num_key_value_heads", "n_heads", default=n_heads),
        head_dim=head_dim,
        ffn_dim=values.size("intermediate_size", "ffn_dim"),
        rope_theta=theta,
        norm_eps=values.number("rms_norm_eps", 1e-6, zero_allowed=True),
        context_length=values.size("max_position_embeddings", "context_length", default=4096),
        tie_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
        qk_norm=model_type == "qwen3",
    ), where)
    if scaling_type == "llama3":
        rope = _ConfigValues(scaling.get, where, prefix="rope_scaling.")
        for key in ("factor", "original_max_position_embeddings"):
            if scaling.get(key) is None:
                raise ModelLoadError(f"{where}: required metadata 'rope_scaling.{key}' is missing")
        numbers = {key: rope.number(key, default) for key, default in (
            ("factor", 1.0), ("original_max_position_embeddings", 1.0), ("low_freq_factor", 1.0),
            ("high_freq_factor", 4.0))}
        if numbers["high_freq_factor"] <= numbers["low_freq_factor"]:
            raise ModelLoadError(f"{where}: rope_scaling's high_freq_factor is not above its low_freq_factor")
        config.rope_freq_factors = rope_scaling_factors(head_dim, theta, numbers)
    return config


def open_safetensors(path: Path) -> Callable[[str], torch.Tensor | None]:
    """A lookup over one or many (sharded) safetensors files, memory-mapped; returns None for absent names."""
    from safetensors import safe_open

    index = path / "model.safetensors.index.json"
    if index.exists():
        weight_map = read_json_file(index)
        weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
        # Shards are files of this directory: a name with a path in it could point anywhere.
        if not isinstance(weight_map, dict) or not all(
                isinstance(f, str) and f.isprintable() and f == Path(f).name and f not in ("", ".", "..")
                for f in weight_map.values()):
            raise ModelLoadError(f"{index}: 'weight_map' must map tensor names to file names in {path}")
        files = sorted(set(weight_map.values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
        weight_map = None
    if not files:
        raise ModelLoadError(f"no .safetensors weights in {path}")
    handles = {}
    for f in files:
        if not (path / f).is_file():  # a named pipe would block the open, a device never end
            raise ModelLoadError(f"cannot read weights {path / f}: not a regular file")
        try:
            handles[f] = safe_open(str(path / f), framework="pt")
        except Exception as e:  # the safetensors library's own errors: a damaged header, sizes that do not add up
            raise ModelLoadError(f"cannot read weights {path / f}: {_one_line(e)}") from None
    if weight_map is None:
        weight_map = {name: f for f, h in handles.items() for name in h.keys()}

    def lookup(name: str) -> torch.Tensor | None:
        f = weight_map.get(name)
        if f is None:
            return None
        try:
            return handles[f].get_tensor(name)
        except Exception as e:  # a tensor the index places in a shard that lacks it, or of a dtype torch lacks
            raise ModelLoadError(f"cannot read tensor '{name}' from {path / f}: {_one_line(e)}") from None

    return lookup


MAX_JSON_BYTES = 64 << 20  # a model's config.json and shard index: kilobytes, a few megabytes for large MoE models


def read_json_file(file: Path) -> object:
    """A model directory's JSON file; a one-line ModelLoadError when it is not a regular file, is over
    MAX_JSON_BYTES, or is not JSON."""
    if not file.is_file():  # a named pipe would block the read, a device never end
        raise ModelLoadError(f"{file} is not a regular file")
    try:
        with open(file, "rb") as f:
            data = f.read(min(os.fstat(f.fileno()).st_size, MAX_JSON_BYTES) + 1)
    except OSError as e:
        raise ModelLoadError(f"cannot read {file}: {e.strerror or e}") from None
    if len(data) > MAX_JSON_BYTES:
        raise ModelLoadError(f"{file} is over {MAX_JSON_BYTES:,} bytes: too large for a model's JSON file")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:  # bad syntax or encoding, huge integers, nesting past the stack
        raise ModelLoadError(f"{file} is not valid JSON: {_one_line(e)}") from None


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__


def check_weights_fit(model: torch.nn.Module, path: Path) -> None:
    """A config.json that describes more weights (of `model`, built on the meta device) than the directory's
    .safetensors files hold, at one byte each (FP8's), does not belong to them: refused before anything is
    allocated for it."""
    weights = sum(p.numel() for p in model.parameters())
    stored = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    if weights > stored:
        raise ModelLoadError(f"{path / 'config.json'} describes a model of {weights:,} weights, more than the "
                             f"{stored:,} bytes of its .safetensors files hold: it does not belong to them")


def read_hf_config(path: Path) -> dict:
    """A Hugging Face model directory's config.json, or a one-line ModelLoadError."""
    config_file = path / "config.json"
    if not config_file.exists():
        raise ModelLoadError(f"{path} has no config.json; give a Hugging Face model directory or a .gguf file")
    config = read_json_file(config_file)
    if not isinstance(config, dict):
        kind = "an array" if isinstance(config, list) else "a string" if isinstance(config, str) else json.dumps(config)
        raise ModelLoadError(f"{config_file} holds {kind}, not a JSON object of settings")
    return config


def _load_hf_dir(path: Path, dtype, device, weights: bool = True) -> LoadedModel:
    raw = read_hf_config(path)
    from .glm5_next_loader import is_glm5_next, load_glm5_next_dir  # the hybrid GLM-5.3-Flash family

    if is_glm5_next(raw):
        return load_glm5_next_dir(path, dtype, device)
    config = hf_config(raw, path)
    with torch.device("meta"):
        check_weights_fit(Transformer(config), path)
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
