"""What computing on a GGUF file's blocks costs in quality: perplexity on real text, token by token and in prompts.

A decode step on the blocks (`--decode-weights gguf`) rounds its activations to int8 blocks of 32 before the
integer products (kernels/gguf_blocks.c), and so does a prompt's segment in fp32 (`gguf_blocks.int8_prompts`: every
format but Q8_0; in bf16 it multiplies dequantized weights). So the text is fed in fp32 prefill
segments on the blocks, and one token at a time, each token a decode step, and its negative log-likelihood compared
with the exact model's (`--decode-weights off`, fp32: dequantized weights, the text read in prefill segments), and
with the int4/int8 decode copies (`--decode-weights int4`: the default model's own choice in fp32), in one run; the two
token-by-token paths in `--dtype` (fp32, or bf16 as CPUs with native bf16 run them). Dense attention, Python's
`pydoc_data.topics` from a fixed offset (as benchmarks/perplexity.py).

    .venv/bin/python -m benchmarks.block_perplexity --length 4096
    .venv/bin/python -m benchmarks.block_perplexity --length 4096 --dtype bf16
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.common import machine_description
from benchmarks.perplexity import natural_text_ids


@torch.inference_mode()
def mean_nll(model, ids: list[int], one_by_one: bool) -> float:
    """Mean NLL of tokens 1..n-1 given those before, read in one prefill or one token at a time."""
    cache = model.new_cache(len(ids))
    tokens = torch.tensor([ids])
    if one_by_one:  # each token a decode step
        total = sum(F.cross_entropy(model(tokens[:, i : i + 1], i, cache)[0, -1:].float(), tokens[0, i + 1 : i + 2],
                                    reduction="sum").item() for i in range(len(ids) - 1))
        return total / (len(ids) - 1)
    logits = torch.cat([model(tokens[:, s : s + 512], s, cache, all_logits=True)
                        for s in range(0, len(ids) - 1, 512)], dim=1)[0, : len(ids) - 1]
    return F.cross_entropy(logits.float(), tokens[0, 1:]).item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--length", type=int, default=4096)
    parser.add_argument("--offset", type=int, default=20000)
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "bf16"],
                        help="the token-by-token paths' dtype (the exact reference stays fp32)")
    args = parser.parse_args()

    from indexpool.model.runtime import load_engine

    print(machine_description())
    rows = []
    for label, dtype, weights, one_by_one in (
            ("exact (off, fp32), prefill", "fp32", "off", False),
            ("gguf blocks (fp32), prefill segments", "fp32", "gguf", False),
            (f"gguf blocks ({args.dtype}), token by token", args.dtype, "gguf", True),
            (f"int4/int8 decode copies ({args.dtype}), token by token", args.dtype, "int4", True)):
        loaded = load_engine(args.model, dtype, decode_weights=weights)
        ids = natural_text_ids(loaded.tokenizer, args.offset, args.length)
        t0 = time.perf_counter()
        nll = mean_nll(loaded.model, ids, one_by_one)
        rows.append((label, nll, time.perf_counter() - t0))
        print(f"{label}: NLL {nll:.4f}, perplexity {math.exp(nll):.3f} ({rows[-1][2]:.0f} s)", flush=True)
    exact = math.exp(rows[0][1])
    for label, nll, _ in rows[1:]:
        print(f"{label}: perplexity {100 * (math.exp(nll) / exact - 1):+.2f}% against exact")


if __name__ == "__main__":
    main()
