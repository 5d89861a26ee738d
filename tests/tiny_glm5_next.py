"""Tiny random GLM-5.3-Flash (`glm5_next`) checkpoints in the released layout, built at test time.

transformers' own classes make the model and `save_pretrained` writes it (sharded, in the checkpoint naming: one
tensor per expert, the KDA conv split into q/k/v). transformers does not build the MTP layer, so it is made here
from transformers' attention and MoE modules and written as layer `num_hidden_layers`. `quantize_fp8` rewrites a
checkpoint with FP8 e4m3 weights and per-block `weight_scale_inv`, as the released FP8 checkpoint stores them.

`benchmarks/mtp_speculative.py` measures self-speculative decoding on one of these checkpoints.
"""

from __future__ import annotations

import copy
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch

VOCAB = 512
# 4 layers: KDA, MLA with its own indexer, MLA sharing that selection, KDA; dense MLP first, then MoE. kpool 4 and
# topk 16: past 16 tokens the indexer keeps 4 of the complete pools (plus the tail), so ~64 tokens select.
# 16 indexer heads: with few heads, pools whose ReLU scores are all zero tie exactly, and the order of tied pools
# in a top-k is arbitrary (it differs between transformers' forward and its own decode).
TINY_TEXT = dict(
    vocab_size=VOCAB, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=4,
    num_attention_heads=2, num_key_value_heads=2, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=0,
    qk_nope_head_dim=16, v_head_dim=16, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2,
    topk_group=1, routed_scaling_factor=2.5, index_topk=16, index_head_dim=16, index_n_heads=16, index_kpool=4,
    linear_num_heads=2, linear_head_dim=16, linear_conv_kernel_dim=4, max_position_embeddings=1024,
    pad_token_id=None, layer_types=["linear_attention", "indexed_attention", "indexed_attention", "linear_attention"],
    indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "sparse", "sparse", "sparse"],
)
TINY_VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=32,
                   projection_intermediate_size=32, patch_size=4, image_size=16)
MTP_PREFIX = "model.language_model.layers.{layer}."


def _random_(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    """Weights that give O(1) activations, norms near 1, and a spread of KDA decay rates (slow to fast)."""
    def normal(std: float, mean: float = 0.0) -> torch.Tensor:
        return torch.randn(p.shape, generator=g) * std + mean

    if name.endswith(("norm.weight", "layernorm.weight")):
        value = normal(0.1, 1.0)
    elif name.endswith(("norm.bias", "hc.base", "A_log", "index_kpool_compress_ape")):
        value = normal(0.5)
    elif name.endswith("dt_bias"):
        value = normal(1.5, -2.0)
    elif name.endswith("hc.scale"):
        value = normal(0.1, 1.0)
    elif name.endswith("e_score_correction_bias"):
        value = normal(0.1)
    elif name.endswith("embed_tokens.weight"):
        value = normal(1.0)
    elif p.dim() >= 2:
        value = normal(p.shape[-1] ** -0.5)
    else:
        value = normal(0.5)
    p.copy_(value)


def randomize_(module: torch.nn.Module, seed: int) -> None:
    """Random values for every parameter and buffer of the text model (the vision tower is left as it is)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in [*module.named_parameters(), *module.named_buffers()]:
            if "visual" not in name:
                _random_(name, p, g)


def text_config(**overrides) -> dict:
    return {**TINY_TEXT, **overrides}


def reference_modeling():
    """transformers' glm5_next module with its KDA on its own torch functions. transformers runs KDA on fla's
    kernels whenever fla imports (fla-core is our dependency, for kernels/kda.py), and their chunked form needs a
    GPU; the reference is the plain torch one on any device."""
    from transformers.models.glm5_next import modeling_glm5_next as tm

    for name in ("chunk_kimi_delta_attention", "recurrent_kimi_delta_attention"):
        function = getattr(tm, name)
        setattr(tm, name, getattr(function, "__wrapped__", function))  # the torch function transformers wrapped
    return tm


def make_reference_model(seed: int = 0, **overrides):
    """A random transformers Glm5NextForConditionalGeneration (fp32, eval) with a tiny vision tower."""
    from transformers import Glm5NextConfig

    config = Glm5NextConfig(text_config=text_config(**overrides), vision_config=TINY_VISION)
    torch.manual_seed(seed)
    model = reference_modeling().Glm5NextForConditionalGeneration(config).eval()
    randomize_(model, seed)
    return model


@dataclass
class ReferenceMTP:
    """The MTP layer's weights: norms and eh_proj as tensors, attention and MoE as transformers modules."""

    enorm: torch.Tensor
    hnorm: torch.Tensor
    eh_proj: torch.Tensor
    input_layernorm: torch.Tensor
    post_attention_layernorm: torch.Tensor
    shared_head_norm: torch.Tensor
    attention: torch.nn.Module
    moe: torch.nn.Module

    def checkpoint_tensors(self, layer: int) -> dict[str, torch.Tensor]:
        prefix = MTP_PREFIX.format(layer=layer)
        tensors = {"enorm.weight": self.enorm, "hnorm.weight": self.hnorm, "eh_proj.weight": self.eh_proj,
                   "input_layernorm.weight": self.input_layernorm,
                   "post_attention_layernorm.weight": self.post_attention_layernorm,
                   "shared_head.norm.weight": self.shared_head_norm}
        tensors |= {f"self_attn.{k}": v for k, v in self.attention.state_dict().items()}
        moe = self.moe.state_dict()
        gate_up, down = moe.pop("experts.gate_up_proj"), moe.pop("experts.down_proj")
        gate, up = gate_up.chunk(2, dim=1)
        for e in range(gate_up.shape[0]):  # the checkpoint stores one tensor per expert and projection
            tensors |= {f"mlp.experts.{e}.gate_proj.weight": gate[e], f"mlp.experts.{e}.up_proj.weight": up[e],
                        f"mlp.experts.{e}.down_proj.weight": down[e]}
        tensors |= {f"mlp.{k}": v for k, v in moe.items()}
        return {prefix + k: v.contiguous() for k, v in tensors.items()}


def make_reference_mtp(model, seed: int = 1) -> ReferenceMTP:
    """A random MTP layer for `model`: MLA with its own indexer and the last layer's MLP kind (MoE), as served."""
    from transformers.models.glm5_next import modeling_glm5_next as tm

    config = copy.deepcopy(model.config.text_config)
    layer = config.num_hidden_layers
    config.layer_types = [*config.layer_types, "indexed_attention"]
    config.indexer_types = [*config.indexer_types, "full"]
    config.mlp_layer_types = [*config.mlp_layer_types, config.mlp_layer_types[-1]]
    attention, moe = tm.Glm5NextTextAttention(config, layer).eval(), tm.Glm5NextTextMoE(config).eval()
    randomize_(attention, seed)
    randomize_(moe, seed + 1)
    g = torch.Generator().manual_seed(seed + 2)
    D = config.hidden_size
    norms = [1 + 0.1 * torch.randn(D, generator=g) for _ in range(5)]
    eh_proj = torch.randn(D, 2 * D, generator=g) * (2 * D) ** -0.5
    return ReferenceMTP(norms[0], norms[1], eh_proj, norms[2], norms[3], norms[4], attention, moe)


def save_checkpoint(model, path: Path, mtp: ReferenceMTP | None = None, max_shard_size: str = "100KB") -> Path:
    """save_pretrained (sharded), then the MTP layer as one more shard listed in the index."""
    from safetensors.torch import save_file

    model.save_pretrained(path, max_shard_size=max_shard_size)
    if mtp is not None:
        layer = model.config.text_config.num_hidden_layers
        save_file(mtp.checkpoint_tensors(layer), str(path / "model-mtp.safetensors"), metadata={"format": "pt"})
        index_file = path / "model.safetensors.index.json"
        index = json.loads(index_file.read_text())
        index["weight_map"] |= {name: "model-mtp.safetensors" for name in mtp.checkpoint_tensors(layer)}
        index_file.write_text(json.dumps(index, indent=2))
        config_file = path / "config.json"
        config = json.loads(config_file.read_text())
        config["text_config"]["num_nextn_predict_layers"] = 1
        config_file.write_text(json.dumps(config, indent=2))
    return path


def quantizable(name: str, tensor: torch.Tensor) -> bool:
    """The weights an FP8 checkpoint stores in FP8: 2-D projections of the text layers, not the router."""
    return (".layers." in name and "visual" not in name and name.endswith(".weight") and tensor.dim() == 2
            and not name.endswith("mlp.gate.weight"))


def fp8_block_round_trip(w: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """e4m3 values, the per-block multiplier (block absmax / 448) and the values they stand for, w's fp32 twin."""
    rows, cols = w.shape
    nr, nc = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    padded = torch.zeros(nr * block[0], nc * block[1])
    padded[:rows, :cols] = w.float()
    blocks = padded.view(nr, block[0], nc, block[1])
    scale = (blocks.abs().amax(dim=(1, 3)) / 448.0).clamp(min=1e-12)
    values = (blocks / scale[:, None, :, None]).to(torch.float8_e4m3fn)
    restored = (values.float() * scale[:, None, :, None]).view_as(padded)[:rows, :cols]
    return values.view_as(padded)[:rows, :cols].contiguous(), scale, restored.contiguous()


def quantize_fp8(src: Path, fp8_dir: Path, restored_dir: Path, block: tuple[int, int] = (128, 128)) -> None:
    """Write `src` as an FP8 checkpoint (weights e4m3 plus `<name>_scale_inv`, quantization_config in config.json)
    and, for the reference, the same checkpoint with each quantized weight replaced by the fp32 values it stands
    for."""
    from safetensors.torch import load_file, save_file

    index = json.loads((src / "model.safetensors.index.json").read_text())
    weight_map = dict(index["weight_map"])
    for shard in sorted(set(index["weight_map"].values())):
        tensors = load_file(str(src / shard))
        fp8, restored = {}, {}
        for name, tensor in tensors.items():
            if quantizable(name, tensor):
                fp8[name], fp8[name + "_scale_inv"], restored[name] = fp8_block_round_trip(tensor, block)
                weight_map[name + "_scale_inv"] = shard
            else:
                fp8[name] = restored[name] = tensor
        for out, content in ((fp8_dir, fp8), (restored_dir, restored)):
            out.mkdir(parents=True, exist_ok=True)
            save_file(content, str(out / shard), metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (restored_dir / "config.json").write_text(json.dumps(config, indent=2))
    (restored_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(block)}
    (fp8_dir / "config.json").write_text(json.dumps(config, indent=2))
    (fp8_dir / "model.safetensors.index.json").write_text(json.dumps({**index, "weight_map": weight_map}, indent=2))


# GLM's control tokens (a few of them) and a GLM-style chat template written for these tests: "[gMASK]<sop>",
# then each turn as its role marker, a newline and the text. A reply ends when the model writes the next turn's
# marker, so generation_config.json lists <|user|> and <|observation|> as end tokens beside <|endoftext|>.
SPECIAL_TOKENS = ["<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"]
END_TOKENS = ["<|endoftext|>", "<|user|>", "<|observation|>"]
CHAT_TEMPLATE = ("[gMASK]<sop>{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}"
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}")


def write_tokenizer(path: Path, vocab_size: int = VOCAB) -> None:
    """A byte-level BPE tokenizer in the layout of GLM checkpoints (a regex Split, then ByteLevel without its own
    regex), trained on Python's documentation to exactly `vocab_size` tokens (the model's vocabulary, so every id
    the model can emit is a token), with tokenizer_config.json, chat_template.jinja and generation_config.json."""
    import pydoc_data.topics
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    from indexpool.model.tokenizer import LLAMA3_PATTERN

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(LLAMA3_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=SPECIAL_TOKENS, show_progress=False)
    topics = pydoc_data.topics.topics
    tokenizer.train_from_iterator([topics[name] for name in sorted(topics)[:40]], trainer)
    if tokenizer.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the tokenizer has {tokenizer.get_vocab_size()} tokens, not {vocab_size}")
    tokenizer.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>",
                                                            "pad_token": "<|endoftext|>"}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    generation_file = path / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.exists() else {}
    generation["eos_token_id"] = [tokenizer.token_to_id(t) for t in END_TOKENS]
    generation_file.write_text(json.dumps(generation, indent=2))


def build_checkpoint(path: Path, seed: int = 0, **overrides):
    """A reference model with an MTP layer, saved to `path` with a tokenizer. Returns (reference model, MTP)."""
    model = make_reference_model(seed, **overrides)
    mtp = make_reference_mtp(model, seed + 1)
    save_checkpoint(model, path, mtp)
    write_tokenizer(path, model.config.text_config.vocab_size)
    return model, mtp
