"""GGUF files of real models' shapes with random weights, written here (nothing is downloaded), to measure what the
engine does with the models users bring from llama.cpp and Ollama.

Each file has a real model's hyperparameters and tensor shapes (`SHAPES`), the default model's tokenizer (its
token list padded with unused tokens to the model's vocabulary), and random blocks in the chosen type (scales
drawn near a trained model's, levels uniform): the weights' values do not change speed or memory. Then, with
--bench, `indexpool bench --model FILE` runs our engine and llama.cpp on it, one process each: load time, prefill,
decode, peak RSS.

    .venv/bin/python -m benchmarks.gguf_shapes --shape llama-3.2-1b --type Q4_0 --out /tmp/shapes --bench
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import machine_description


@dataclass(frozen=True)
class Shape:
    arch: str
    dim: int
    layers: int
    heads: int
    kv_heads: int
    ffn: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    rope_theta: float = 500000.0
    context: int = 131072


SHAPES = {  # from the models' published config.json
    "llama-3.2-1b": Shape("llama", 2048, 16, 32, 8, 8192, 128256, tied=True),
    "llama-3.2-3b": Shape("llama", 3072, 28, 24, 8, 8192, 128256, tied=True),
    "llama-3.1-8b": Shape("llama", 4096, 32, 32, 8, 14336, 128256, tied=False),
    "qwen2.5-1.5b": Shape("qwen2", 1536, 28, 12, 2, 8960, 151936, tied=True, qkv_bias=True, rope_theta=1000000.0,
                          context=32768),
}


def random_blocks(rows: int, columns: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Rows of random blocks of a ggml type: fp16 scales near 0.01-0.05 where the format has them, other bytes
    uniform."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.05, size=(rows, columns // block)).astype(np.float16).view(np.uint8)
    scales = scales.reshape(rows, columns // block, 2)
    if qtype in (GGMLQuantizationType.Q4_0, GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_0,
                 GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q8_0, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q2_K):
        blocks[..., 0:2] = scales  # d (the K-quants' super-block scale comes first too, except Q3_K and Q6_K)
    if qtype in (GGMLQuantizationType.Q4_1, GGMLQuantizationType.Q5_1, GGMLQuantizationType.Q4_K,
                 GGMLQuantizationType.Q5_K, GGMLQuantizationType.Q2_K):
        blocks[..., 2:4] = np.array([-0.1], dtype=np.float16).view(np.uint8)  # the min / dmin
    if qtype == GGMLQuantizationType.Q6_K:
        blocks[..., -2:] = scales
    return blocks.reshape(rows, -1)


def write_shape(path: Path, shape: Shape, type_name: str, seed: int = 0) -> Path:
    """The GGUF file of `shape` with random `type_name` blocks in every matrix (F32 norms and biases)."""
    import gguf

    from indexpool.model.default_model import default_model_path
    from indexpool.model.gguf_file import read_gguf

    qtype = gguf.GGMLQuantizationType[type_name]
    source = read_gguf(default_model_path()).metadata
    tokens = list(source["tokenizer.ggml.tokens"])
    types = list(source["tokenizer.ggml.token_type"])
    tokens += [f"<|unused_{i}|>" for i in range(shape.vocab - len(tokens))]
    types += [5] * (shape.vocab - len(types))  # ggml's UNUSED token type
    rng = np.random.default_rng(seed)
    head_dim = shape.dim // shape.heads
    w = gguf.GGUFWriter(str(path), shape.arch)
    w.add_name(f"{path.stem} (random weights)")
    w.add_block_count(shape.layers)
    w.add_context_length(shape.context)
    w.add_embedding_length(shape.dim)
    w.add_feed_forward_length(shape.ffn)
    w.add_head_count(shape.heads)
    w.add_head_count_kv(shape.kv_heads)
    w.add_rope_freq_base(shape.rope_theta)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(shape.vocab)
    w.add_rope_dimension_count(head_dim)
    w.add_file_type(int(qtype))
    w.add_tokenizer_model(source["tokenizer.ggml.model"])
    w.add_tokenizer_pre(source["tokenizer.ggml.pre"])
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(source["tokenizer.ggml.merges"])
    w.add_bos_token_id(source["tokenizer.ggml.bos_token_id"])
    w.add_eos_token_id(source["tokenizer.ggml.eos_token_id"])
    w.add_chat_template(source["tokenizer.chat_template"])

    def matrix(name: str, rows: int, columns: int) -> None:
        w.add_tensor(name, random_blocks(rows, columns, qtype, rng), raw_dtype=qtype)

    def vector(name: str, n: int, value: float = 1.0) -> None:
        w.add_tensor(name, np.full(n, value, dtype=np.float32) + rng.normal(0, 0.01, n).astype(np.float32))

    q_dim, kv_dim = shape.heads * head_dim, shape.kv_heads * head_dim
    matrix("token_embd.weight", shape.vocab, shape.dim)
    vector("output_norm.weight", shape.dim)
    if not shape.tied:
        matrix("output.weight", shape.vocab, shape.dim)
    for i in range(shape.layers):
        vector(f"blk.{i}.attn_norm.weight", shape.dim)
        vector(f"blk.{i}.ffn_norm.weight", shape.dim)
        for name, rows in (("attn_q", q_dim), ("attn_k", kv_dim), ("attn_v", kv_dim)):
            matrix(f"blk.{i}.{name}.weight", rows, shape.dim)
            if shape.qkv_bias:
                vector(f"blk.{i}.{name}.bias", rows, 0.0)
        matrix(f"blk.{i}.attn_output.weight", shape.dim, q_dim)
        matrix(f"blk.{i}.ffn_gate.weight", shape.ffn, shape.dim)
        matrix(f"blk.{i}.ffn_up.weight", shape.ffn, shape.dim)
        matrix(f"blk.{i}.ffn_down.weight", shape.dim, shape.ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--type", default="Q4_0", help="comma-separated ggml types: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K...")
    parser.add_argument("--out", type=Path, default=Path("/tmp/indexpool-shapes"))
    parser.add_argument("--bench", action="store_true", help="then run `indexpool bench` on each file")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--prefill-length", default="512")
    args = parser.parse_args()
    print(machine_description())
    args.out.mkdir(parents=True, exist_ok=True)
    for name in args.shape.split(","):
        for type_name in args.type.split(","):
            path = args.out / f"{name}-{type_name}.gguf"
            if not path.exists():
                write_shape(path, SHAPES[name], type_name)
            print(f"{path}: {path.stat().st_size / 2**30:.2f} GiB", flush=True)
            if args.bench:
                subprocess.run([str(Path(sys.executable).with_name("indexpool")), "bench", "--model", str(path),
                                "--engines", "indexpool,llama.cpp", "--contexts", args.contexts, "--prefill-length",
                                args.prefill_length, "--decode-tokens", "16", "--repeats", "3"], check=False)


if __name__ == "__main__":
    main()
