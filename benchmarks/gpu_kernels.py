"""GPU check of the IndexPool Triton kernels (`kernels/`): correctness, then speed against the torch references.

On one GPU (written for an H200, 4.8 TB/s; under 8 minutes):
  1. runs `pytest tests/test_kernels.py tests/test_mla_kernels.py tests/test_kda_kernels.py` natively (compiled
     kernels, no interpreter);
  2. for contexts of 128K, 512K and 1M tokens, one layer of the default model (SmolLM2-135M: 9 query heads, 3 KV
     heads of 64; IndexPool kpool 4, topk 2048, sinks 64, window 1024, segment 2048; index keys 32 wide with 4
     heads for the trained indexer, 192 wide (the training-free key width, scored here with the k-pool ReLU
     formula and 9 heads) otherwise), one MLA layer of GLM-5.3-Flash (64 heads over 512-wide latents, 2051
     positions selected per query) and one of its KDA layers (64 heads x 128, fp32 state: a decode step and a
     2048-token prefill, on flash-linear-attention's kernels), times each kernel and its torch reference with CUDA
     events (median of 20 after warm-up, the L2 cache flushed before each run) and prints the time, the bytes the
     op must move, the achieved bandwidth and its fraction of the GPU's peak, and the reference's time and the ratio.

    .venv/bin/python -m benchmarks.gpu_kernels               # tests, then 128K, 512K, 1M
    .venv/bin/python -m benchmarks.gpu_kernels --quick       # tests, then 128K only, 10 runs each
    .venv/bin/python -m benchmarks.gpu_kernels --dry-run     # no GPU: every case on tiny shapes in Triton's
                                                             # CPU interpreter, outputs checked against the references
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from benchmarks.common import machine_description

REPO = Path(__file__).resolve().parent.parent
PEAK_BANDWIDTH = 4.8e12  # H200 HBM3e, bytes/s
FLUSH_BYTES = 256 << 20  # larger than the H200's 50 MB L2
KERNEL_TESTS = ["tests/test_kernels.py", "tests/test_mla_kernels.py", "tests/test_kda_kernels.py"]


@dataclass
class Shapes:
    """One attention layer of the default model with the default IndexPool settings; GLM-5.3-Flash's MLA and KDA."""
    heads: int = 9
    kv_heads: int = 3
    head_dim: int = 64
    kpool: int = 4
    topk: int = 2048
    sinks: int = 64
    window: int = 1024
    segment: int = 2048
    query_tokens: int = 64  # forwards this short select per query
    trained_width: int = 32
    trained_heads: int = 4
    free_width: int = 192  # kv_heads * head_dim
    mla_heads: int = 64
    mla_rank: int = 512  # kv_lora_rank: the latent width
    kda_heads: int = 64
    kda_dim: int = 128  # dk = dv
    kda_prefill: int = 2048  # tokens in one prefill forward (a segment)


TINY = Shapes(topk=64, sinks=8, window=32, segment=16, query_tokens=4, trained_width=32, free_width=192,
              mla_heads=8, mla_rank=32, kda_heads=2, kda_dim=16, kda_prefill=70)


@dataclass
class Case:
    name: str
    kernel: Callable[[], object]
    reference: Callable[[], object]
    bytes_moved: int
    flops: int = 0


def pool_cases(context: int, s: Shapes, device: str) -> list[Case]:
    """Cold start: a whole context of index keys and gate logits compressed into pooled keys in one call."""
    import torch

    from indexpool.kernels import pool_compress, pool_compress_reference

    cases = []
    configs = [("trained d=32 fp32 -> bf16", s.trained_width, torch.float32, torch.bfloat16),
               ("trained d=32 fp32 -> fp8", s.trained_width, torch.float32, torch.float8_e4m3fn),
               ("training-free d=192 bf16 -> bf16", s.free_width, torch.bfloat16, torch.bfloat16)]
    for label, d, in_dtype, out_dtype in configs:
        keys = torch.randn(1, context, d, device=device).to(in_dtype)
        gates = torch.randn(1, context, d, device=device).to(in_dtype)
        ape = torch.randn(s.kpool, d, device=device)
        n_pools = context // s.kpool
        moved = 2 * keys.numel() * keys.element_size() + n_pools * d * out_dtype.itemsize
        moved += n_pools * 4 if out_dtype == torch.float8_e4m3fn else 0
        cases.append(Case(f"pool_compress {label}",
                          lambda k=keys, g=gates, a=ape, o=out_dtype: pool_compress(k, g, a, s.kpool, o),
                          lambda k=keys, g=gates, a=ape, o=out_dtype: pool_compress_reference(k, g, a, s.kpool, o),
                          moved))
    return cases


def index_cases(context: int, s: Shapes, device: str) -> list[Case]:
    """Scoring every pool and selecting topk tokens: a decode step (1 query) and a short forward (query_tokens
    queries, each selecting on its own), at the end of the context."""
    import torch

    from indexpool.kernels import index_scores, index_scores_reference, index_topk, index_topk_reference
    from indexpool.kernels.index_math import fp8_quantize

    n_pools = context // s.kpool
    cases = []
    configs = [("trained 4x32 bf16", s.trained_heads, s.trained_width, torch.bfloat16),
               ("trained 4x32 fp8", s.trained_heads, s.trained_width, torch.float8_e4m3fn),
               ("width 192 9 heads bf16", s.heads, s.free_width, torch.bfloat16)]
    for label, heads, d, dtype in configs:
        pooled = torch.randn(1, n_pools, d, device=device)
        pooled, scale = fp8_quantize(pooled) if dtype == torch.float8_e4m3fn else (pooled.to(dtype), None)
        pooled_bytes = pooled.numel() * pooled.element_size() + (scale.numel() * 4 if scale is not None else 0)
        for n_queries in (1, s.query_tokens):
            q = torch.randn(1, n_queries, heads, d, device=device)
            weights = torch.rand(1, n_queries, heads, device=device) * heads**-0.5
            positions = torch.arange(context - n_queries, context, device=device)
            args = (q, weights, pooled, positions, s.kpool)
            scores_bytes = n_queries * n_pools * 4  # written by the scoring, read by the top-k
            tag = f"{label} T={n_queries}"
            cases.append(Case(f"index_scores {tag}",
                              lambda a=args, sc=scale: index_scores(*a, sc),
                              lambda a=args, sc=scale: index_scores_reference(*a, sc),
                              pooled_bytes + scores_bytes))
            cases.append(Case(f"index_topk {tag}",
                              lambda a=args, sc=scale: index_topk(*a, s.topk, sc),
                              lambda a=args, sc=scale: index_topk_reference(*a, s.topk, sc),
                              pooled_bytes + 2 * scores_bytes))
    return cases


def attention_cases(context: int, s: Shapes, device: str) -> list[Case]:
    """The sparse attention of one layer at the end of the context: a decode step and a prefill segment, far
    tokens (sinks + topk) gathered from a history of `context` tokens in bf16 or int8."""
    import torch

    from indexpool.kernels import far_rope_tables, sparse_attention, sparse_attention_reference

    kv_width = s.kv_heads * s.head_dim
    inv_freq = 1.0 / (100000.0 ** (torch.arange(0, s.head_dim // 2, dtype=torch.float64, device=device) * 2
                                   / s.head_dim))
    stores = {
        "bf16": (torch.randn(context, kv_width, device=device).bfloat16(),
                 torch.randn(context, kv_width, device=device).bfloat16(), None, None),
        "int8": (torch.randint(-127, 128, (context, kv_width), dtype=torch.int8, device=device),
                 torch.randint(-127, 128, (context, kv_width), dtype=torch.int8, device=device),
                 torch.rand(context, s.kv_heads, device=device) / 100,
                 torch.rand(context, s.kv_heads, device=device) / 100),
    }
    cases = []
    for label, n_queries, store in (("decode", 1, "bf16"), ("decode", 1, "int8"), ("segment", s.segment, "bf16")):
        k_store, v_store, k_scale, v_scale = stores[store]
        start = context - n_queries
        window_start = (start - s.window) // s.kpool * s.kpool
        n_far = s.sinks + s.topk
        far = torch.randperm(window_start - s.sinks, device=device)[: s.topk].sort().values + s.sinks
        selected = torch.cat([torch.arange(s.sinks, device=device), far])[None]
        placed = torch.arange(n_far, device=device) + window_start - n_far
        window = context - window_start
        q = torch.randn(n_queries, s.heads, s.head_dim, device=device).bfloat16()
        window_k = torch.randn(s.kv_heads, window, s.head_dim, device=device).bfloat16()
        window_v = torch.randn(s.kv_heads, window, s.head_dim, device=device).bfloat16()
        rope_cos, rope_sin = far_rope_tables(inv_freq, placed)  # once per forward in the engine: not timed
        args = (q, k_store, v_store, selected, rope_cos, rope_sin, window_k, window_v, start - window_start)
        options = dict(k_scale=k_scale, v_scale=v_scale)
        row_bytes = kv_width * k_store.element_size() + (s.kv_heads * 4 if k_scale is not None else 0)
        moved = (2 * n_far * row_bytes + selected.numel() * 8 + 2 * rope_cos.numel() * 4
                 + 2 * window_k.numel() * 2 + 2 * q.numel() * 2)
        visible_keys = n_far + window - n_queries / 2  # the window is causal within the segment
        flops = int(4 * n_queries * s.heads * visible_keys * s.head_dim)
        cases.append(Case(f"sparse_attention {label} T={n_queries} {store} history",
                          lambda a=args, o=options: sparse_attention(*a, **o),
                          lambda a=args, o=options: sparse_attention_reference(*a, **o), moved, flops))
    return cases


def mla_cases(context: int, s: Shapes, device: str) -> list[Case]:
    """glm5_next's sparse MLA attention in the latent space at the end of the context: a decode step and a prefill
    block of query_tokens queries, each with its own selection of topk + kpool - 1 positions (the indexer's) out of
    `context` bf16 latents."""
    import torch

    from indexpool.kernels import mla_sparse_attention, mla_sparse_attention_reference

    n_selected = s.topk + s.kpool - 1
    latents = torch.randn(1, context, s.mla_rank, device=device).bfloat16()
    cases = []
    for label, n_queries in (("decode", 1), ("prefill", s.query_tokens)):
        q_latent = torch.randn(1, n_queries, s.mla_heads, s.mla_rank, device=device).bfloat16()
        selected = torch.stack([torch.randperm(context, device=device)[:n_selected].sort().values
                                for _ in range(n_queries)])[None]
        args = (q_latent, latents, selected, 256**-0.5)  # qk_nope_head_dim**-0.5
        # Per query: its gathered latents and selection, its q_latent read and its output written.
        moved = n_queries * (n_selected * (s.mla_rank * 2 + 8) + 2 * s.mla_heads * s.mla_rank * 2)
        flops = 4 * n_queries * s.mla_heads * n_selected * s.mla_rank
        cases.append(Case(f"mla_sparse_attention {label} T={n_queries} H={s.mla_heads} R={s.mla_rank}",
                          lambda a=args: mla_sparse_attention(*a), lambda a=args: mla_sparse_attention_reference(*a),
                          moved, flops))
    return cases


def kda_cases(context: int, s: Shapes, device: str) -> list[Case]:
    """glm5_next's KDA linear attention: a decode step and a prefill forward of kda_prefill tokens, from an fp32
    state of kda_heads x kda_dim x kda_dim. O(1) in the context: the same work at every context."""
    import torch

    from indexpool.kernels.kda import KDA_CHUNK, kda_chunked, kda_chunked_reference, kda_recurrent, kda_recurrent_reference

    H, d = s.kda_heads, s.kda_dim
    state = torch.randn(1, H, d, d, device=device) / d
    cases = []
    for label, n_tokens, op, reference in (("kda_recurrent decode", 1, kda_recurrent, kda_recurrent_reference),
                                          ("kda_chunked prefill", s.kda_prefill, kda_chunked, kda_chunked_reference)):
        q, k, v = (torch.randn(1, n_tokens, H, d, device=device).bfloat16() for _ in range(3))
        g = -5 * torch.sigmoid(torch.randn(1, n_tokens, H, d, device=device))  # the model's gate range
        beta = torch.rand(1, n_tokens, H, device=device).bfloat16()
        args = (q, k, v, g, beta, state)
        # q, k, v, beta read in bf16 and g in fp32, the output written in fp32, the state read and written.
        moved = n_tokens * H * (3 * d * 2 + d * 4 + 2 + d * 4) + 2 * state.numel() * 4
        # Per token and head, the recurrence: decay, k^T S, the rank-1 update and S^T q, 7 d^2. The chunked form
        # instead does 6 d^2 (the state against its queries and keys, and its update) plus chunk x 5 d within a
        # chunk (k k^T and q k^T, solving for the updates of v and k, and their mix into the output).
        per_token = 7 * d * d if n_tokens == 1 else 6 * d * d + KDA_CHUNK * 5 * d
        cases.append(Case(f"{label} T={n_tokens} H={H} d={d}", lambda f=op, a=args: f(*a)[:2],
                          lambda f=reference, a=args: f(*a)[:2], moved, n_tokens * H * per_token))
    return cases


def seconds(fn: Callable[[], object], runs: int) -> float:
    """Median GPU time of fn (CUDA events) after warm-up, the L2 cache flushed before each run."""
    import torch

    for _ in range(2):
        fn()
    flush = torch.empty(FLUSH_BYTES, dtype=torch.uint8, device="cuda")
    torch.cuda.synchronize()
    times = []
    for _ in range(runs):
        flush.zero_()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


SELECTION_AGREEMENT = 0.99  # share of the reference's selected positions the kernel must select too
VALUE_AGREEMENT = 0.05  # largest difference, relative to the reference's largest magnitude


def described(tensor) -> str:
    return "None" if tensor is None else f"{tuple(tensor.shape)} {tensor.dtype}"


def agreement(case: Case, out, expected) -> tuple[str, bool]:
    """Kernel against reference on the case's real sizes (tests/test_kernels.py checks small awkward shapes): shapes
    and dtypes equal, then for an integer output (a selection of positions) the share of the reference's positions
    the kernel selects too, per row, the worst row (near-tied scores may swap a few); for a float output the largest
    difference relative to the reference's largest magnitude. The text for the table, and whether it passes."""
    import torch

    out = out if isinstance(out, tuple) else (out,)
    expected = expected if isinstance(expected, tuple) else (expected,)
    worst_share, worst_error = 1.0, 0.0
    for a, b in zip(out, expected):
        if (a is None) != (b is None) or (a is not None and (a.shape != b.shape or a.dtype != b.dtype)):
            raise SystemExit(f"{case.name}: kernel output {described(a)} != reference {described(b)}")
        if a is None or a.numel() == 0:
            continue
        if not a.dtype.is_floating_point:
            rows_a, rows_b = a.reshape(-1, a.shape[-1]), b.reshape(-1, b.shape[-1])
            for row_a, row_b in zip(rows_a, rows_b):
                worst_share = min(worst_share, float(torch.isin(row_b, row_a).float().mean()))
        else:
            a, b = a.float(), b.float()
            worst_error = max(worst_error, float((a - b).abs().max() / b.abs().max().clamp_min(1e-30)))
    ok = worst_share >= SELECTION_AGREEMENT and worst_error <= VALUE_AGREEMENT
    text = f"{worst_share:.1%} sel" if worst_share < 1 else f"{worst_error:.1e}"
    return text if ok else f"{text} MISMATCH", ok


def run(contexts: list[int], shapes: Shapes, device: str, runs: int, dry_run: bool) -> None:
    import torch

    mismatches = []
    for context in contexts:
        print(f"\ncontext {context:,} tokens ({context // shapes.kpool:,} pools), {device}")
        if not dry_run:
            print(f"{'op':58} {'kernel us':>10} {'MB moved':>9} {'GB/s':>8} {'of peak':>8} {'TFLOP/s':>8} "
                  f"{'torch us':>10} {'speed-up':>8} {'agreement':>16}")
        for build in (pool_cases, index_cases, attention_cases, mla_cases, kda_cases):
            if build is kda_cases and context != contexts[0]:
                continue  # KDA's work does not depend on the context: timed once
            cases = build(context, shapes, device)
            for case in cases:
                agrees, ok = agreement(case, case.kernel(), case.reference())
                if not ok:
                    mismatches.append(case.name)
                if dry_run:
                    print(f"{case.name:58} runs; against the reference: {agrees}")
                    continue
                kernel = seconds(case.kernel, runs)
                reference = seconds(case.reference, runs)
                bandwidth = case.bytes_moved / kernel
                tflops = f"{case.flops / kernel / 1e12:8.1f}" if case.flops else f"{'':8}"
                print(f"{case.name:58} {kernel * 1e6:10.1f} {case.bytes_moved / 1e6:9.1f} {bandwidth / 1e9:8.0f} "
                      f"{bandwidth / PEAK_BANDWIDTH:8.1%} {tflops} {reference * 1e6:10.1f} "
                      f"{reference / kernel:7.1f}x {agrees:>16}", flush=True)
            del cases
            if device == "cuda":
                torch.cuda.empty_cache()
    if mismatches:
        raise SystemExit(f"kernel and reference disagree (agreement: {SELECTION_AGREEMENT:.0%} of the selected "
                         f"positions, values within {VALUE_AGREEMENT:.0%}): {', '.join(mismatches)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="128K tokens only, 10 runs per timing")
    parser.add_argument("--dry-run", action="store_true", help="no GPU: tiny shapes in Triton's CPU interpreter")
    parser.add_argument("--skip-tests", action="store_true", help="do not run the kernel tests first")
    args = parser.parse_args()

    if args.dry_run:  # before Triton is imported: it decides at kernel definition whether to interpret
        os.environ["TRITON_INTERPRET"] = "1"
        os.environ["INDEXPOOL_KERNELS"] = "triton"
    import torch

    if args.dry_run:
        torch.set_num_threads(1)
        print(machine_description())
        torch.manual_seed(0)
        run([1024], TINY, "cpu", 1, dry_run=True)
        return
    if not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run this on a GPU, or use --dry-run to check it on the CPU")
    print(machine_description())
    print(f"GPU: {torch.cuda.get_device_name()}")
    if not args.skip_tests:
        tests = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *KERNEL_TESTS],
                               cwd=REPO)
        if tests.returncode:
            raise SystemExit(f"{' '.join(KERNEL_TESTS)} failed (exit {tests.returncode}); timings skipped")
    torch.manual_seed(0)
    contexts = [128 * 1024] if args.quick else [128 * 1024, 512 * 1024, 1024 * 1024]
    run(contexts, Shapes(), "cuda", 10 if args.quick else 20, dry_run=False)


if __name__ == "__main__":
    main()
