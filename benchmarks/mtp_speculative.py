"""glm5_next's MTP layer drafting for greedy decoding (self-speculative): acceptance rate and speed, in one run.

On a glm5_next checkpoint (default: a tiny random one built like the tests', `tests/tiny_glm5_next.py`), for
`--prompts` random prompts: plain greedy decoding (`greedy_generate`, one token per forward) against
`speculative_generate` (the MTP layer drafts one token, the main model checks [last, draft] in one forward and
keeps the draft when its own choice agrees), checking that both give the same tokens. Prints the drafts accepted,
the acceptance rate, tokens/s of each and their ratio.

A tiny random checkpoint's MTP layer is random too, so its drafts are almost never right: that row measures the
cost of drafting. `--oracle` adds a row where every draft is the greedy continuation (the MTP layer still runs,
its answer replaced): the most the mechanism can give on that model. A real checkpoint's rate lies between.

    .venv/bin/python -m benchmarks.mtp_speculative --threads 1
    .venv/bin/python -m benchmarks.mtp_speculative --checkpoint path/to/GLM-5.3-Flash --dtype bf16   # a big machine
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks.common import machine_description
from indexpool.model.glm5_next import Glm5NextModel, SpeculativeStats, greedy_generate, speculative_generate
from indexpool.model.glm5_next_loader import load_glm5_next
from indexpool.model.runtime import set_threads


def oracle_drafts(model: Glm5NextModel, full: list[int]):
    """`model.mtp_logits` with each last row's draft replaced by the token `full` has there."""
    real = model.mtp_logits

    def drafts(next_tokens, hidden, start, cache):
        out = real(next_tokens, hidden, start, cache)
        target = start + next_tokens.shape[1] + 1  # the position the last row drafts
        out[0, -1] = float("-inf")
        out[0, -1, full[target] if target < len(full) else 0] = 0.0
        return out

    return drafts


def run(model: Glm5NextModel, prompts: list[list[int]], new_tokens: int, oracle: bool) -> dict:
    greedy_s, speculative_s, total, same = [], [], SpeculativeStats(), 0
    for prompt in prompts:
        start = time.perf_counter()
        plain = greedy_generate(model, prompt, new_tokens)
        greedy_s.append(time.perf_counter() - start)
        if oracle:
            model.mtp_logits = oracle_drafts(model, prompt + plain)
        try:
            start = time.perf_counter()
            drafted, stats = speculative_generate(model, prompt, new_tokens)
            speculative_s.append(time.perf_counter() - start)
        finally:
            if oracle:
                del model.mtp_logits  # back to the class's method
        total.drafted += stats.drafted
        total.accepted += stats.accepted
        same += drafted == plain
    greedy_rate = new_tokens / statistics.median(greedy_s)
    speculative_rate = new_tokens / statistics.median(speculative_s)
    return {"stats": total, "same": same, "greedy": greedy_rate, "speculative": speculative_rate}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--checkpoint", type=Path, help="a glm5_next directory (default: a tiny random one)")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--prompt-tokens", type=int, default=40)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--oracle", action=argparse.BooleanOptionalAction, default=True,
                        help="also run with every draft right (default: on)")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    print(machine_description())
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype]
    with tempfile.TemporaryDirectory() as scratch:
        path = args.checkpoint
        if path is None:
            from tests.tiny_glm5_next import build_checkpoint

            path = Path(scratch)
            build_checkpoint(path, args.seed)
        model = load_glm5_next(path, dtype)
    if model.mtp is None:
        sys.exit(f"{path}: the checkpoint has no MTP layer (num_nextn_predict_layers)")
    generator = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(0, model.config.vocab_size, (args.prompt_tokens,), generator=generator).tolist()
               for _ in range(args.prompts)]
    print(f"{args.checkpoint or 'tiny random checkpoint'}, {args.dtype}, threads {torch.get_num_threads()}: "
          f"{args.prompts} prompts of {args.prompt_tokens} tokens, {args.new_tokens} new tokens each")
    print(f"{'drafter':>8} {'accepted':>14} {'rate':>6} {'same as greedy':>14} {'greedy tok/s':>12} "
          f"{'speculative tok/s':>17} {'ratio':>6}")
    for name, oracle in (("MTP", False), ("oracle", True))[: 2 if args.oracle else 1]:
        r = run(model, prompts, args.new_tokens, oracle)
        s, same = r["stats"], f"{r['same']}/{args.prompts}"
        print(f"{name:>8} {f'{s.accepted}/{s.drafted}':>14} {s.acceptance_rate:>6.1%} {same:>14} "
              f"{r['greedy']:>12.1f} {r['speculative']:>17.1f} {r['speculative'] / r['greedy']:>6.2f}", flush=True)


if __name__ == "__main__":
    main()
