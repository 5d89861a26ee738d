"""Passkey retrieval over long natural text: IndexPool against dense attention, in one run.

A five-digit pass key is planted at 10 depths in a haystack and the model is asked for it through its chat
template. Two haystacks: `filler`, the classic passkey test's repeated "The grass is green. The sky is blue..."
lines (easy: the needle is the only new text), and `natural`, natural English (Python's `pydoc_data.topics`, then
the system's license texts; repeated when a longer haystack is asked for), where the needle competes with real text
(including Python's `pass` statement); a trial succeeds when the greedy answer contains the key. Trials are ordered by depth so that
consecutive trials share the haystack up to the earlier needle (the session re-reads only from there).

    .venv/bin/python -m benchmarks.passkey --haystack filler --lengths 4096,32768 --modes indexpool,dense
    .venv/bin/python -m benchmarks.passkey --haystack natural --lengths 131072 --modes indexpool

Prints one row per (length, mode): accuracy, trials, median prefill tokens/s (of the part re-read), per-depth hits.
At 1M tokens one read takes about an hour on one core; `--depths` runs fewer depths (deepest first, so each further
trial re-reads only what follows its needle):

    .venv/bin/python -m benchmarks.passkey --haystack filler --lengths 1048576 --modes indexpool --depths 0.95,0.85,0.75 --trials 3
"""

from __future__ import annotations

import argparse
import random
import re
import statistics

import torch

from benchmarks.common import add_schedule_option, chat_frame, greedy_answer, machine_description, natural_haystack
from indexpool.model.generate import Session
from indexpool.model.indexpool_cache import IndexPoolConfig
from indexpool.model.sessions import SessionOptions, default_indexer, describe_indexers, segment_indexer
from indexpool.model.runtime import load_engine, set_threads

DEPTHS = [0.05 + 0.1 * i for i in range(10)]
QUESTION = "\n\nWhat is the pass key? Answer with the number only."
ANSWER_START = "The pass key is"


FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again.\n"


def haystack_text(kind: str) -> str:
    return FILLER * 2000 if kind == "filler" else natural_haystack()


def needle_text(key: int) -> str:
    return f"\nThe pass key is {key}. Remember it. {key} is the pass key.\n"


def build_prompt(tokenizer, hay_ids: list[int], length: int, depth: float, key: int) -> tuple[list[int], int]:
    """Token ids of the chat prompt (about `length` tokens) and the index where the needle starts."""
    pre, post = chat_frame(tokenizer)
    head = tokenizer.encode(pre, allow_special=True)
    needle = tokenizer.encode(needle_text(key))
    tail = tokenizer.encode(QUESTION + post + ANSWER_START, allow_special=True)
    n_hay = length - len(head) - len(needle) - len(tail)
    hay = (hay_ids * (n_hay // len(hay_ids) + 1))[:n_hay]
    cut = int(n_hay * depth)
    return head + hay[:cut] + needle + hay[cut:] + tail, len(head) + cut


def depth_list(text: str) -> list[float]:
    depths = sorted({float(x) for x in text.split(",")})
    if not depths or not all(0 < d < 1 for d in depths):
        raise argparse.ArgumentTypeError(f"depths must lie strictly between 0 and 1, got {text!r}")
    return depths


def run(args) -> None:
    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(args.model, dtype=args.dtype)
    tokenizer = loaded.tokenizer
    hay_ids = tokenizer.encode(haystack_text(args.haystack))
    choice = SessionOptions(indexer=args.indexer, prune_index=args.prune_index)
    indexer, for_segments = default_indexer(choice, loaded), segment_indexer(choice, loaded)
    rng = random.Random(args.seed)
    print(f"model {loaded.name}, indexer {describe_indexers(indexer, for_segments)}, {args.haystack} haystack of {len(hay_ids)} tokens, threads {torch.get_num_threads()}", flush=True)
    depths = args.depths
    names = f"{100 * min(depths):.0f}%..{100 * max(depths):.0f}%" if len(depths) > 1 else f"{100 * depths[0]:.0f}%"
    print(f"{'length':>8} {'mode':>9} {'accuracy':>9} {'trials':>6} {'prefill tok/s':>13}  hits per depth ({names})")
    for length in args.lengths:
        trials = [(depths[i % len(depths)], rng.randrange(10000, 100000)) for i in range(args.trials)]
        trials.sort(reverse=True)  # deepest needle first: each next trial re-reads only what follows its needle
        for mode in args.modes:
            attention = None if mode == "dense" else IndexPoolConfig(topk=args.topk, window=args.window,
                                                                     sinks=args.sinks, segment=args.segment,
                                                                     sink_distance=args.sink_distance,
                                                                     segment_block=args.segment_block,
                                                                     kv_storage=args.kv_storage,
                                                                     schedule=args.schedule)
            session = Session(loaded.model, length + 16, attention=attention, indexer=indexer if attention else None,
                              segment_indexer=for_segments if attention else None)
            hits, speeds = {d: 0 for d in depths}, []
            for depth, key in trials:
                prompt, _ = build_prompt(tokenizer, hay_ids, length, depth, key)
                out, stats, read = greedy_answer(session, prompt, 8, f"{length}:{mode} depth {depth:.2f}",
                                                 progress=args.verbose)
                elapsed = stats.prefill_seconds
                answer = tokenizer.decode(out)
                found = re.findall(r"\d+", answer.replace(" ", ""))
                hits[depth] += str(key) in found
                speeds.append(read / elapsed)
                if args.verbose:
                    print(f"  {length} {mode} depth {depth:.2f} key {key} -> {answer!r} ({elapsed:.1f} s)", flush=True)
            n_ok = sum(hits.values())
            per_depth = " ".join(str(hits[d]) for d in sorted(depths))
            print(f"{length:>8} {mode:>9} {100 * n_ok / len(trials):>8.0f}% {len(trials):>6} "
                  f"{statistics.median(speeds):>13.0f}  {per_depth}", flush=True)
            del session


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 32768])
    parser.add_argument("--modes", type=lambda s: s.split(","), default=["indexpool", "dense"])
    parser.add_argument("--trials", type=int, default=20)
    parser.add_argument("--depths", type=depth_list, default=DEPTHS,
                        help="comma-separated needle depths in (0, 1); trials cycle through them (default: 5%%..95%% by 10%%)")
    parser.add_argument("--haystack", choices=["filler", "natural"], default="natural")
    parser.add_argument("--model", default=None)
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--indexer", default="auto", help="auto, training-free, trained, hybrid or an indexer file")
    parser.add_argument("--prune-index", action=argparse.BooleanOptionalAction, default=None,
                        help="pruned index keys (default: as the command line, on for the training-free indexer)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--topk", type=int, default=IndexPoolConfig.topk)
    parser.add_argument("--window", type=int, default=IndexPoolConfig.window)
    parser.add_argument("--sinks", type=int, default=IndexPoolConfig.sinks)
    parser.add_argument("--sink-distance", type=int, default=IndexPoolConfig.sink_distance,
                        help="how far back the sinks sit once far tokens are selected (0: right before them, an "
                             "earlier default)")
    parser.add_argument("--segment", type=int, default=IndexPoolConfig.segment)
    add_schedule_option(parser)
    parser.add_argument("--segment-block", type=int, default=IndexPoolConfig.segment_block,
                        help="queries of a prefill segment sharing one far selection (default: the engine's)")
    parser.add_argument("--kv-storage", default=IndexPoolConfig.kv_storage,
                        help="history K/V: auto (bf16 while it takes under a quarter of RAM, else int8), bf16 or int8")
    parser.add_argument("--verbose", action="store_true")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
