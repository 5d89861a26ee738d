"""Load GLM-5.3-Flash (`glm5_next`) from a Hugging Face directory: config.json (flat, or the text model under
`text_config`), safetensors weights (one file or sharded with model.safetensors.index.json), read memory-mapped
one tensor at a time. Weights are BF16/FP32, or FP8 e4m3 with one `weight_scale_inv` per 128 x 128 block (the
released layout: the block's dequantization multiplier), dequantized here to the model dtype.

Checkpoint names: the text model under `model.language_model.` (multimodal checkpoints) or `model.`, `lm_head`
at the top, routed experts one tensor per expert and projection, the KDA conv split into q/k/v, the MTP layer as
layer `num_hidden_layers`. The vision tower is not loaded: the engine runs text only.
"""

from __future__ import annotations

import math
from dataclasses import fields
from pathlib import Path

import torch

from .errors import ModelLoadError
from .gguf_file import shown
from .glm5_next import MODEL_TYPES, Glm5NextConfig, Glm5NextModel
from indexpool.kernels.index_math import FP8_DTYPE

TEXT_PREFIXES = ("model.language_model.", "model.")
DEFAULT_FP8_BLOCK = (128, 128)
# Our parameters that are a module's `weight` in the checkpoint (norms and the KDA convs).
CHECKPOINT_WEIGHT_SUFFIX = {"input_layernorm", "post_attention_layernorm", "q_a_layernorm", "kv_a_layernorm",
                            "o_norm", "norm", "enorm", "hnorm", "q_conv1d", "k_conv1d", "v_conv1d"}
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")


def is_glm5_next(config: dict) -> bool:
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    return config.get("model_type") in MODEL_TYPES or text.get("model_type") in MODEL_TYPES


def dequantize_fp8_blocks(weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int] = DEFAULT_FP8_BLOCK,
                          dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """An FP8 weight (rows, cols) times its per-block multipliers scale_inv (ceil(rows/b0), ceil(cols/b1)); the
    last blocks of a row or column may be partial."""
    rows, cols = weight.shape
    expected = (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    if tuple(scale_inv.shape) != expected:
        raise ModelLoadError(f"an FP8 weight of shape {(rows, cols)} with {block[0]}x{block[1]} blocks needs scales "
                             f"of shape {expected}, got {tuple(scale_inv.shape)}")
    scale = scale_inv.float().repeat_interleave(block[0], 0)[:rows].repeat_interleave(block[1], 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def read_config(path: Path) -> tuple[dict, Glm5NextConfig]:
    from .loader import read_hf_config  # loader routes glm5_next directories here: imported late, no cycle

    raw = read_hf_config(path)
    _check_values(raw, path / "config.json")
    try:
        return raw, Glm5NextConfig.from_hf(raw)
    except (ValueError, TypeError, AttributeError, KeyError) as e:  # values of the right type that do not fit
        raise ModelLoadError(f"{path / 'config.json'}: {e}") from None


# Bounds on the numbers a config.json gives, checked before the config builds its per-layer lists and the model its
# parameters: far beyond GLM-5.3-Flash, and small enough that a damaged or hostile file allocates nothing.
MAX_LAYERS = 1024
MAX_SIZE = 1 << 24
_MAY_BE_ZERO = {"n_shared_experts", "num_nextn_predict_layers"}
_LINEAR_KEYS = {"num_heads": "linear_num_heads", "head_dim": "linear_head_dim",
                "short_conv_kernel_size": "linear_conv_kernel_dim"}


def _check_values(raw: dict, where: Path) -> None:
    """Each value config.json gives for a Glm5NextConfig field is of the field's type, and in range."""
    cfg = {**raw, **raw["text_config"]} if isinstance(raw.get("text_config"), dict) else raw
    linear = cfg.get("linear_attn_config")
    if linear is not None and not isinstance(linear, dict):
        raise ModelLoadError(f"{where}: 'linear_attn_config' is {shown(linear)}, not an object")
    # Our field names, with the key each value was given under.
    given = {name: (name, value) for name, value in cfg.items()}
    given.update({ours: (f"linear_attn_config.{theirs}", (linear or {}).get(theirs))
                  for theirs, ours in _LINEAR_KEYS.items()})
    if "n_routed_experts" not in cfg:
        given["n_routed_experts"] = ("num_local_experts", cfg.get("num_local_experts"))
    for f in fields(Glm5NextConfig):
        key, value = given.get(f.name, (f.name, None))
        if value is None:
            continue
        if f.type == "int":
            least = 0 if f.name in _MAY_BE_ZERO else 1
            most = MAX_LAYERS if f.name in ("num_hidden_layers", "num_nextn_predict_layers") else MAX_SIZE
            if isinstance(value, bool) or not isinstance(value, int) or not least <= value <= most:
                raise ModelLoadError(f"{where}: '{key}' is {shown(value)}, not a whole number from {least} "
                                     f"to {most:,}")
        elif f.type in ("float", "float | None"):
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ModelLoadError(f"{where}: '{key}' is {shown(value)}, not a number")
        elif f.type == "bool" and not isinstance(value, bool):
            raise ModelLoadError(f"{where}: '{key}' is {shown(value)}, not true or false")
        elif f.type == "list[str]" and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise ModelLoadError(f"{where}: '{key}' is {shown(value)}, not a list of names")


def _fp8_block(raw: dict, where: Path) -> tuple[int, int]:
    text = raw.get("text_config") if isinstance(raw.get("text_config"), dict) else {}
    quant = raw.get("quantization_config") or text.get("quantization_config") or {}
    if not isinstance(quant, dict):
        raise ModelLoadError(f"{where}: 'quantization_config' is {shown(quant)}, not an object")
    method = quant.get("quant_method", "fp8")
    if method != "fp8":
        raise ModelLoadError(f"{where}: quantization {shown(method)} is not supported (BF16/FP32, or FP8 with "
                             "block scales, are)")
    block = quant.get("weight_block_size") or DEFAULT_FP8_BLOCK
    if not (isinstance(block, (list, tuple)) and len(block) == 2
            and all(isinstance(b, int) and not isinstance(b, bool) and 1 <= b <= MAX_SIZE for b in block)):
        raise ModelLoadError(f"{where}: 'weight_block_size' is {shown(block)}, not two whole numbers")
    return block[0], block[1]


def checkpoint_name(ours: str, prefix: str, mtp_layer: int) -> str:
    """The checkpoint tensor behind one of our parameters (stacked experts excepted, see `_expert_names`)."""
    if ours == "lm_head.weight":
        return ours
    if ours.startswith("mtp."):
        ours = f"layers.{mtp_layer}." + ours.removeprefix("mtp.")
    if ours.rsplit(".", 1)[-1] in CHECKPOINT_WEIGHT_SUFFIX:
        ours += ".weight"
    return prefix + ours


def _expert_names(name: str, n_experts: int) -> list[str] | None:
    """`...mlp.experts.gate_proj` (stacked) -> the per-expert checkpoint names; None for other tensors."""
    head, _, projection = name.rpartition(".")
    if not head.endswith("mlp.experts") or projection not in EXPERT_PROJECTIONS:
        return None
    return [f"{head}.{e}.{projection}.weight" for e in range(n_experts)]


def load_glm5_next(path: str | Path, dtype: torch.dtype = torch.bfloat16, device: str | torch.device = "cpu",
                   with_mtp: bool = True) -> Glm5NextModel:
    """The text model (and its MTP layer, when the checkpoint has one and with_mtp) in `dtype`. What was skipped
    is listed in `model.load_notes`."""
    return _load(Path(path), dtype, device, with_mtp)[0]


def _load(path: Path, dtype: torch.dtype, device, with_mtp: bool) -> tuple[Glm5NextModel, dict, int]:
    """The model, the raw config.json and the bits per weight of the stored layer weights."""
    from .loader import check_weights_fit, open_safetensors

    raw, config = read_config(path)
    block = _fp8_block(raw, path / "config.json")
    lookup = open_safetensors(path)
    prefix = next((p for p in TEXT_PREFIXES if lookup(p + "norm.weight") is not None), None)
    if prefix is None:
        raise ModelLoadError(f"{path}: no text model weights (looked for model.language_model.norm.weight and "
                             "model.norm.weight)")
    notes = []
    if isinstance(raw.get("vision_config"), dict):
        notes.append("the vision tower (model.visual.*) is not loaded: only text is run")
    mtp_layer = config.num_hidden_layers
    has_mtp = lookup(f"{prefix}layers.{mtp_layer}.enorm.weight") is not None
    own_head_name = f"{prefix}layers.{mtp_layer}.shared_head.head.weight"
    own_head = lookup(own_head_name) if has_mtp and with_mtp else None
    if has_mtp and not with_mtp:
        notes.append("the MTP layer is not loaded (with_mtp=False)")
    elif not has_mtp and config.num_nextn_predict_layers:
        notes.append(f"config.json declares an MTP layer but the weights have none (layer {mtp_layer}): "
                     "speculative decoding is unavailable")
    if has_mtp and with_mtp and config.num_nextn_predict_layers > 1:
        notes.append(f"only the first of {config.num_nextn_predict_layers} MTP layers is loaded")

    def fetch(name: str) -> torch.Tensor:
        if name == own_head_name and own_head is not None:
            return own_head
        tensor = lookup(name)
        if tensor is None:
            raise ModelLoadError(f"tensor '{name}' is missing from the weights in {path}")
        scale_inv = lookup(name + "_scale_inv") if name.endswith(".weight") else None
        if scale_inv is not None:
            return dequantize_fp8_blocks(tensor, scale_inv, block, dtype)
        if tensor.dtype == FP8_DTYPE:
            raise ModelLoadError(f"FP8 tensor '{name}' has no '{name}_scale_inv' in {path}")
        return tensor

    with torch.device("meta"):
        model = Glm5NextModel(config, with_mtp=has_mtp and with_mtp, mtp_own_head=own_head is not None)
    check_weights_fit(model, path)
    model = model.to_empty(device=device).to(dtype).keep_fp32_parameters()
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    with torch.no_grad():
        for name, param in model.named_parameters():
            experts = _expert_names(name, config.n_routed_experts)
            if experts is None:
                source = checkpoint_name(name, prefix, mtp_layer)
                _put(param, fetch(source), source)
                continue
            for e, expert in enumerate(experts):  # one expert at a time: no stacked copy of all of them
                source = checkpoint_name(expert, prefix, mtp_layer)
                _put(param[e], fetch(source), source)
    model.load_notes = notes
    stored_bits = torch.finfo(lookup(f"{prefix}layers.0.self_attn.o_proj.weight").dtype).bits
    return model.eval().requires_grad_(False), raw, stored_bits


def _put(param: torch.Tensor, value: torch.Tensor, source: str) -> None:
    # The checkpoint stores a depthwise conv as (channels, 1, kernel); ours is (channels, kernel).
    if value.dim() == 3 and param.dim() == 2 and value.shape[1] == 1:
        value = value[:, 0]
    if tuple(param.shape) != tuple(value.shape):
        raise ModelLoadError(f"tensor '{source}' has shape {tuple(value.shape)}, expected {tuple(param.shape)}")
    param.copy_(value)


def load_glm5_next_dir(path: Path, dtype: torch.dtype, device: str | torch.device = "cpu"):
    """`load_model`'s entry for a glm5_next directory: the model, with the tokenizer from tokenizer.json."""
    from .loader import LoadedModel
    from .tokenizer import Tokenizer

    model, raw, bits = _load(path, dtype, device, with_mtp=True)
    tokenizer = Tokenizer.from_hf_dir(path)
    tokenizer.stop_ids |= generation_stop_ids(path)
    size = sum(p.stat().st_size for p in path.glob("*.safetensors"))
    return LoadedModel(model, tokenizer, model.config, path, raw.get("_name_or_path") or path.name, size, bits)


def generation_stop_ids(path: Path) -> frozenset[int]:
    """The `eos_token_id`s of generation_config.json: GLM chat models end a reply with the next turn's marker
    (`<|user|>`, `<|observation|>`), listed there beside `<|endoftext|>`, not in the tokenizer files."""
    from .loader import read_json_file

    config_file = path / "generation_config.json"
    if not config_file.exists():
        return frozenset()
    config = read_json_file(config_file)
    ids = config.get("eos_token_id") if isinstance(config, dict) else None
    ids = [ids] if isinstance(ids, int) else ids or []
    if not all(isinstance(i, int) for i in ids):
        raise ModelLoadError(f"{config_file}: eos_token_id must be a token id or a list of them, not {ids!r}")
    return frozenset(ids)
