"""GGUF files of real models' shapes with random weights, written here (nothing is downloaded), to measure what the
engine does with the models users bring from llama.cpp and Ollama.

Each file has a real model's hyperparameters and tensor shapes (`SHAPES`), the default model's tokenizer (its
token list padded with unused tokens to the model's vocabulary), and random rows in the chosen type (blocks with
scales drawn near a trained model's and uniform levels, or F32/F16/BF16 values): the weights' values do not change
speed or memory. Then, with --bench, `indexpool bench --model FILE` runs our engine and llama.cpp on it, one
process each: load time, prefill, decode, peak RSS.

    .venv/bin/python -m benchmarks.gguf_shapes --shape llama-3.2-1b --type Q4_0 --out /tmp/shapes --bench
    .venv/bin/python -m benchmarks.gguf_shapes --shape llama-3.2-1b --type Q4_0,Q4_K --out /tmp/shapes --interleaved 1
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import machine_description
from indexpool.model import USER_OMP_WAIT_POLICY

# --interleaved loads both engines in this process, which holds one OpenMP runtime (torch's libgomp; llama.cpp's
# library takes the one loaded): they run under the user's policy, libgomp's spinning threads by default, not the
# engine's passive ones (`indexpool.model`; llama.cpp's decode ran 25% slower with those). Set before torch loads.
if USER_OMP_WAIT_POLICY is None:
    os.environ.pop("OMP_WAIT_POLICY", None)


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


# where a block keeps its fp16 scale d, and its min (dmin for the K-quants) where it has one
SCALE_BYTES = {"Q4_0": (0, None), "Q4_1": (0, 2), "Q5_0": (0, None), "Q5_1": (0, 2), "Q8_0": (0, None),
               "Q2_K": (80, 82), "Q3_K": (108, None), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208, None)}


def random_blocks(rows: int, columns: int, qtype, rng: np.random.Generator) -> np.ndarray:
    """Rows of random blocks of a ggml type as bytes: fp16 scales near 0.01-0.05 (mins -0.1) where the format
    keeps them, other bytes uniform (the gguf package cannot quantize the K-quants, and random levels are all a
    speed test needs); F32, F16 and BF16: values of a normal distribution (sd 0.02)."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
    from gguf.quants import quantize

    qtype = GGMLQuantizationType(qtype)
    if qtype in (GGMLQuantizationType.F32, GGMLQuantizationType.F16, GGMLQuantizationType.BF16):
        values = rng.standard_normal((rows, columns), dtype=np.float32) * np.float32(0.02)
        return np.ascontiguousarray(quantize(values, qtype)).view(np.uint8).reshape(rows, -1)
    block, size = GGML_QUANT_SIZES[qtype]
    blocks = rng.integers(0, 256, size=(rows, columns // block, size), dtype=np.uint8)
    d, m = SCALE_BYTES[qtype.name]
    blocks[..., d : d + 2] = rng.uniform(0.01, 0.05, size=(rows, columns // block, 1)).astype(np.float16).view(np.uint8)
    if m is not None:
        blocks[..., m : m + 2] = np.array([-0.1], dtype=np.float16).view(np.uint8)
    return blocks.reshape(rows, -1)


def write_shape(path: Path, shape: Shape, type_name: str, seed: int = 0) -> Path:
    """The GGUF file of `shape` with random `type_name` rows in every matrix (F32 norms and biases)."""
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


def interleaved(path: Path, threads: int, prefill_length: int, rounds: int = 6, tokens: int = 16,
                prefill_rounds: int = 3, dtype: str = "auto") -> list[str]:
    """Prefill and decode speed of our engine and llama.cpp loaded side by side in this process, their runs
    alternating: a prompt of `prefill_length` tokens (each engine's own batch: our 512-token segments, llama.cpp's
    n_batch 512), then runs of `tokens` decode steps (context 64 on). On a machine that others load too (a VM's
    speed moved by 15% from one minute to the next here), each pair of runs meets the same load, where `indexpool
    bench` times one engine's runs, then the other's. -> a line for each: medians and the ratio (the median of the
    pairs' ratios). `dtype`: our engine's (auto: bf16 where the CPU has it natively, else fp32). Both under the
    OpenMP policy the user gave (below)."""
    import statistics
    import time

    import torch
    from llama_cpp import Llama

    from indexpool.model.generate import Session
    from indexpool.model.runtime import load_engine

    torch.set_num_threads(threads)
    model = load_engine(str(path), dtype, decode_weights="auto").model
    room = max(prefill_length, 64 + tokens * (rounds + 1)) + 8
    llm = Llama(model_path=str(path), n_ctx=room, n_threads=threads, n_threads_batch=threads, n_batch=512,
                verbose=False)
    prompt = [100 + i % 20000 for i in range(prefill_length)]

    def our_prompt() -> float:
        session = Session(model, room)
        start = time.perf_counter()
        session.prefill(prompt)
        return time.perf_counter() - start

    def their_prompt() -> float:
        llm.reset()
        start = time.perf_counter()
        llm.eval(prompt)
        return time.perf_counter() - start

    session = Session(model, room)
    session.prefill(list(range(100, 164)))
    token, position = torch.tensor([[42]]), 64

    def ours() -> float:
        nonlocal position
        start = time.perf_counter()
        with torch.inference_mode():
            for _ in range(tokens):
                model(token, position, session.cache)
                position += 1
        return (time.perf_counter() - start) / tokens

    def theirs() -> float:
        start = time.perf_counter()
        for _ in range(tokens):
            llm.eval([42])
        return (time.perf_counter() - start) / tokens

    def alternate(a, b, n: int) -> tuple[float, float, float]:
        a(), b()  # warm-up
        pairs = [(a(), b()) for _ in range(n)]
        return (statistics.median(p[0] for p in pairs), statistics.median(p[1] for p in pairs),
                statistics.median(p[1] / p[0] for p in pairs))

    head = f"{path.name}, {threads} thread{'s' if threads != 1 else ''}, {str(model.dtype).removeprefix('torch.')}"
    a, b, ratio = alternate(our_prompt, their_prompt, prefill_rounds)
    lines = [f"{head}: prefill of {prefill_length}: indexpool {prefill_length / a:.1f} tokens/s, llama.cpp "
             f"{prefill_length / b:.1f} (medians of {prefill_rounds} alternating runs); indexpool / llama.cpp "
             f"prefill speed {ratio:.2f}x"]
    llm.reset()
    llm.eval(list(range(100, 164)))
    a, b, ratio = alternate(ours, theirs, rounds)
    lines.append(f"{head}: decode: indexpool {a * 1e3:.1f} ms/token, llama.cpp {b * 1e3:.1f} ms/token (medians of "
                 f"{rounds} alternating runs of {tokens}); indexpool / llama.cpp decode speed {ratio:.2f}x")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.2-1b", help=f"comma-separated: {', '.join(SHAPES)}")
    parser.add_argument("--type", default="Q4_0",
                        help=f"comma-separated ggml types: F32, F16, BF16, {', '.join(SCALE_BYTES)}")
    parser.add_argument("--out", type=Path, default=Path("/tmp/indexpool-shapes"))
    parser.add_argument("--bench", action="store_true", help="then run `indexpool bench` on each file")
    parser.add_argument("--contexts", default="512,4096")
    parser.add_argument("--prefill-length", default="512")
    parser.add_argument("--interleaved", type=int, metavar="THREADS",
                        help="then time prompts (--prefill-length) and decode steps of our engine and llama.cpp "
                             "alternately, in one process, with this many threads each (steadier than --bench where "
                             "other work loads the machine)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "fp32", "bf16"],
                        help="our engine's dtype with --interleaved (auto: bf16 where the CPU has it natively)")
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
            if args.interleaved:
                for line in interleaved(path, args.interleaved, int(args.prefill_length), dtype=args.dtype):
                    print(line, flush=True)


if __name__ == "__main__":
    main()
