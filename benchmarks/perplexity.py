"""Perplexity on long natural text: IndexPool against dense attention, in the same engine and run.

The text is Python's `pydoc_data.topics` (English prose about Python, ~115K tokens), read from a fixed offset. For
each length, both modes read the same tokens in prefill segments and the negative log-likelihood is averaged over
the tokens where IndexPool's attention differs from dense (positions past sinks + topk + window), plus, with
--decode N, over N tokens fed one at a time (the decode path, which selects per query).

    .venv/bin/python -m benchmarks.perplexity --lengths 4096,8192
"""

from __future__ import annotations

import argparse
import math
import time

import torch
import torch.nn.functional as F

from benchmarks.common import add_schedule_option, machine_description, natural_text
from indexpool.model.generate import Session
from indexpool.model.indexpool_cache import IndexPoolConfig
from indexpool.model.sessions import SessionOptions, default_indexer, describe_indexers, segment_indexer
from indexpool.model.runtime import load_engine, set_threads


def natural_text_ids(tokenizer, offset: int, length: int) -> list[int]:
    ids = tokenizer.encode(natural_text())
    if offset + length > len(ids):
        raise SystemExit(f"the text has {len(ids)} tokens; {offset} + {length} asked")
    return ids[offset : offset + length]


@torch.inference_mode()
def nll(session: Session, ids: list[int], first_scored: int, decode: int) -> tuple[float, float, int]:
    """Mean NLL of tokens first_scored..len-1 read in prefill segments (the last `decode` of them one by one),
    and the seconds taken."""
    tokens = torch.tensor([ids])
    body = len(ids) - decode
    bounds = list(range(0, body, session.segment)) + [body] + list(range(body + 1, len(ids) + 1))
    total, count, t0 = 0.0, 0, time.perf_counter()
    for s, e in zip(bounds, bounds[1:]):
        if e <= s:
            continue
        logits = session.model(tokens[:, s:e], s, session.cache, all_logits=True)[0]
        targets = tokens[0, s + 1 : e + 1]
        keep = torch.arange(s, s + len(targets)) >= first_scored - 1
        if keep.any():
            losses = F.cross_entropy(logits[: len(targets)].float(), targets, reduction="none")
            total += losses[keep].sum().item()
            count += int(keep.sum())
    return total / count, time.perf_counter() - t0, count


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=lambda s: [int(x) for x in s.split(",")], default=[4096, 8192])
    parser.add_argument("--offset", type=int, default=20000)
    parser.add_argument("--decode", type=int, default=64, help="score this many final tokens fed one at a time")
    parser.add_argument("--model", default=None)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--indexer", default="auto", help="auto, training-free, trained, hybrid or an indexer file")
    parser.add_argument("--prune-index", action=argparse.BooleanOptionalAction, default=None,
                        help="pruned index keys (default: as the command line, on for the training-free indexer)")
    parser.add_argument("--topk", type=int, default=IndexPoolConfig.topk)
    parser.add_argument("--window", type=int, default=IndexPoolConfig.window)
    parser.add_argument("--segment", type=int, default=IndexPoolConfig.segment)
    parser.add_argument("--sink-distances", type=lambda s: [int(x) for x in s.split(",")],
                        default=[IndexPoolConfig.sink_distance],
                        help="IndexPool sink distances to compare, a row each (e.g. 4096,0; 0: the sinks right "
                             "before the far tokens)")
    parser.add_argument("--query-topks", type=lambda s: [int(x) for x in s.split(",")],
                        default=[IndexPoolConfig.query_topk],
                        help="far tokens per query of the decode steps to compare, a row each (e.g. 512,1024)")
    add_schedule_option(parser)
    parser.add_argument("--segment-block", type=int, default=IndexPoolConfig.segment_block,
                        help="queries of a prefill segment sharing one far selection (default: the engine's)")
    args = parser.parse_args()
    set_threads(args.threads)
    print(machine_description())
    loaded = load_engine(args.model)
    settings = [IndexPoolConfig(topk=args.topk, window=args.window, segment=args.segment, sink_distance=distance,
                                segment_block=args.segment_block, schedule=args.schedule, query_topk=query_topk)
                for distance in args.sink_distances for query_topk in args.query_topks]
    choice = SessionOptions(indexer=args.indexer, prune_index=args.prune_index)
    indexer, for_segments = default_indexer(choice, loaded), segment_indexer(choice, loaded)
    first_scored = settings[0].sinks + settings[0].topk + settings[0].window + settings[0].kpool
    print(f"model {loaded.name}, indexer {describe_indexers(indexer, for_segments)}; scored: tokens from {first_scored} on; threads {torch.get_num_threads()}")
    print(f"{'length':>7} {'scored':>6} {'sink distance':>13} {'query topk':>10} {'dense ppl':>9} {'indexpool ppl':>13} "
          f"{'change':>7}")
    for length in args.lengths:
        ids = natural_text_ids(loaded.tokenizer, args.offset, length)
        dense, _, n = nll(Session(loaded.model, length), ids, first_scored, args.decode)
        for config in settings:
            indexer.read_at(config.far_distances())  # a training-free indexer's queries are turned for them
            session = Session(loaded.model, length, attention=config, indexer=indexer, segment_indexer=for_segments)
            sparse, _, _ = nll(session, ids, first_scored, args.decode)
            print(f"{length:>7} {n:>6} {config.sink_distance:>13} {config.query_topk:>10} {math.exp(dense):>9.3f} "
                  f"{math.exp(sparse):>13.3f} "
                  f"{100 * (math.exp(sparse - dense) - 1):>+6.1f}%", flush=True)


if __name__ == "__main__":
    main()
