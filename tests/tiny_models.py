"""Tiny random llama-family models for loader tests: saved as Hugging Face directories by transformers, and written
as GGUF files the way llama.cpp's converter lays them out (Q/K rows permuted for llama, quantized blocks)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

TINY = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            max_position_embeddings=256, rms_norm_eps=1e-5, rope_theta=10000.0)


def make_hf_model(model_type: str, vocab_size: int, **overrides):
    """A random transformers model of the given family, in fp32."""
    import transformers

    classes = {
        "llama": (transformers.LlamaConfig, transformers.LlamaForCausalLM),
        "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM),
        "qwen2": (transformers.Qwen2Config, transformers.Qwen2ForCausalLM),
        "qwen3": (transformers.Qwen3Config, transformers.Qwen3ForCausalLM),
    }
    config_cls, model_cls = classes[model_type]
    config = config_cls(vocab_size=vocab_size, **{**TINY, **overrides})
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with torch.no_grad():  # norms start at 1 and biases at 0: randomise them so the loader must map them right
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.1)
    return model


def save_hf_dir(model, tokenizer, path: Path, shard: bool = False) -> Path:
    model.save_pretrained(path, max_shard_size="200KB" if shard else "10GB")
    tokenizer.save_pretrained(path)
    return path


def llama_cpp_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """The Q/K row order llama.cpp's converter writes for the llama architecture (pairs interleaved per head)."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: Path, tokenizer_metadata: dict, arch: str = "llama", qtype: str = "F32",
               qtypes: dict[str, str] | None = None) -> Path:
    """Write a transformers llama/qwen model as GGUF; 2-D weights stored as `qtype` (or as `qtypes` gives for a
    tensor kind, e.g. {"attn_v": "Q6_K"}, as llama.cpp's mixed formats do), norms as F32."""
    import gguf

    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    w = gguf.GGUFWriter(str(path), arch)
    w.add_name("tiny-test")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_parameters["rope_theta"])
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    w.add_rope_dimension_count(head_dim)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_tokenizer_model(tokenizer_metadata["tokenizer.ggml.model"])
    w.add_tokenizer_pre(tokenizer_metadata["tokenizer.ggml.pre"])
    w.add_token_list(tokenizer_metadata["tokenizer.ggml.tokens"])
    w.add_token_types(tokenizer_metadata["tokenizer.ggml.token_type"])
    w.add_token_merges(tokenizer_metadata["tokenizer.ggml.merges"])
    w.add_bos_token_id(tokenizer_metadata["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(tokenizer_metadata["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(tokenizer_metadata["tokenizer.chat_template"])

    names = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
             "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
             "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm",
             "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for name, tensor in model.state_dict().items():
        data = tensor.float().numpy()
        if name == "model.embed_tokens.weight":
            out = "token_embd.weight"
        elif name == "model.norm.weight":
            out = "output_norm.weight"
        elif name == "lm_head.weight":
            if cfg.tie_word_embeddings:
                continue
            out = "output.weight"
        else:
            _, _, layer, rest = name.split(".", 3)
            module, kind = rest.rsplit(".", 1)
            out = f"blk.{layer}.{names[module]}.{kind}"
            if arch == "llama" and module == "self_attn.q_proj":
                data = llama_cpp_permute(data, cfg.num_attention_heads)
            elif arch == "llama" and module == "self_attn.k_proj":
                data = llama_cpp_permute(data, cfg.num_key_value_heads)
        kind = gguf.GGMLQuantizationType[(qtypes or {}).get(out.split(".")[-2], qtype)]
        if data.ndim == 2 and kind != gguf.GGMLQuantizationType.F32:
            w.add_tensor(out, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            w.add_tensor(out, np.ascontiguousarray(data, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def dequantized_copy(model, qtype: str):
    """The same model with every 2-D weight passed through a GGUF quantize/dequantize round trip."""
    import copy

    import gguf

    quant = gguf.GGMLQuantizationType[qtype]
    clone = copy.deepcopy(model)
    with torch.no_grad():
        for name, p in clone.named_parameters():
            if p.ndim == 2:
                q = gguf.quants.dequantize(gguf.quants.quantize(p.float().numpy(), quant), quant)
                p.copy_(torch.from_numpy(np.array(q)).reshape(p.shape))
    return clone
