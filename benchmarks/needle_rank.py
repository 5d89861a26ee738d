"""Where a passkey needle's pools rank in the question's selection, layer by layer (why a passkey trial misses).

Builds the passkey benchmark's prompt (`benchmarks/passkey.py`: filler haystack, the needle at `--depth`), reads it
through the IndexPool cache with the default settings, and records the training-free indexer's per-query scores of
the question's forward (the prompt's last tokens, which select their far pools one by one). Per layer: the best rank
among the needle's pools for each question token (0 = the top pool), and how many question tokens keep it among
the topk / kpool pools they attend to; and the share of the question's attention (per query row: head and token)
that lands on the needle's tokens, which is what the model reads the key from. Prints the first answer token too.

Then the answer (`--answer-steps` greedy decode steps, each one query selecting alone; the key's first digit comes
from the first of them): per step and layer, whether its selection keeps a needle token and its attention share on
the needle; and for the first step, per layer, its attention on the needle, the sinks, the other far tokens and
the recent window.

    OMP_NUM_THREADS=1 taskset -c 1 .venv/bin/python benchmarks/needle_rank.py --length 32768 --depth 0.85 --threads 1
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexpool_cli.attention import AttentionChoice, default_indexer, segment_indexer  # noqa: E402
from model import indexers  # noqa: E402
from model.generate import Session  # noqa: E402
from model.indexpool_cache import KV_STORAGE, AttentionEvidence, IndexPoolCache, IndexPoolConfig  # noqa: E402
from model.runtime import load_engine, set_threads  # noqa: E402
from indexpool_scale import add_schedule_option, add_sink_distance_option, long_read_progress  # noqa: E402  (this script's folder is on sys.path)
from passkey import build_prompt, haystack_text, needle_text  # noqa: E402


class NeedleEvidence:
    """The cache's evidence hook (`IndexPoolCache.evidence`) kept per layer: the attention the question's rows put
    on the needle's tokens, layer by layer (AttentionEvidence sums over layers)."""

    def __init__(self, start: int, end: int, n_layers: int):
        self.layers = [AttentionEvidence(start, end) for _ in range(n_layers)]
        self.layer, self.local_band, self.queries = 0, 0, 0

    def add(self, positions: torch.Tensor, mass: torch.Tensor) -> None:
        self.layers[self.layer].add(positions, mass)


class RegionEvidence:
    """The same hook for one decode step: per layer, its attention (summed over query heads) on the needle, the
    sinks, the other far tokens and the recent window (with the step itself)."""

    REGIONS = ("needle", "sinks", "other far", "window")

    def __init__(self, cache: IndexPoolCache, needle_start: int, needle_end: int):
        self.cache, self.needle = cache, (needle_start, needle_end)
        self.mass = torch.zeros(cache.config.n_layers, len(self.REGIONS))
        self.layer, self.local_band, self.queries = 0, 0, 0

    def add(self, positions: torch.Tensor, mass: torch.Tensor) -> None:
        p, (start, end) = positions.reshape(-1), self.needle
        region = torch.where((p >= start) & (p < end), 0,
                             torch.where(p < self.cache.n_sinks, 1, torch.where(p < self.cache.ws, 2, 3)))
        self.mass[self.layer].index_add_(0, region, mass.reshape(-1).float())


def _add_evidence_per_layer(add_evidence):
    def wrapped(self, layer, *args):
        self.evidence.layer = layer
        return add_evidence(self, layer, *args)

    return wrapped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768)
    parser.add_argument("--depth", type=float, default=0.85)
    parser.add_argument("--key", type=int, default=65125)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--kv-storage", default=IndexPoolConfig.kv_storage, choices=KV_STORAGE,
                        help="history K/V storage (auto: int8 past a quarter of RAM, as at 1M)")
    parser.add_argument("--answer-steps", type=int, default=6, help="greedy decode steps probed after the question")
    add_sink_distance_option(parser)
    add_schedule_option(parser)
    args = parser.parse_args()
    set_threads(args.threads)
    loaded = load_engine(None)
    tokenizer = loaded.tokenizer
    prompt, needle_start = build_prompt(tokenizer, tokenizer.encode(haystack_text("filler")), args.length, args.depth,
                                        args.key)
    needle_end = needle_start + len(tokenizer.encode(needle_text(args.key)))
    settings = IndexPoolConfig(kv_storage=args.kv_storage, schedule=args.schedule, sink_distance=args.sink_distance)
    question: dict[int, torch.Tensor] = {}
    score = indexers.TrainingFreeIndexer.score

    def recorded(self, layer, q, weights, pooled, limits=None, chunk=8):
        scores = score(self, layer, q, weights, pooled, limits, chunk)
        if 1 < q.shape[1] <= settings.query_tokens and scores.shape[0] == 1:  # the question's per-query forward
            question[layer] = scores[0].clone()
        return scores

    indexers.TrainingFreeIndexer.score = recorded
    choice = AttentionChoice()
    session = Session(loaded.model, len(prompt) + 64, attention=settings, indexer=default_indexer(choice, loaded),
                      segment_indexer=segment_indexer(choice, loaded))
    IndexPoolCache._add_evidence = _add_evidence_per_layer(IndexPoolCache._add_evidence)
    evidence = NeedleEvidence(needle_start, needle_end, loaded.model.config.n_layers)
    session.cache.evidence = evidence
    with torch.inference_mode():
        logits = session.prefill(prompt, on_progress=long_read_progress(f"{len(prompt)}", len(prompt)))
    rows = evidence.queries * loaded.model.config.n_heads  # question tokens x query heads
    first_pool = settings.sinks // settings.kpool
    needle = torch.arange(needle_start // settings.kpool, (needle_end - 1) // settings.kpool + 1) - first_pool
    keep = settings.topk // settings.kpool
    pools = question[0].shape[1]
    print(f"length {len(prompt)}, depth {args.depth}: needle pools {int(needle[0])}..{int(needle[-1])} of {pools} "
          f"scored, {keep} kept; first answer token {tokenizer.decode([int(logits.argmax())])!r}")
    print(f"kv storage {session.cache.kv_storage}; attention on the needle: mean share per question row "
          f"({evidence.queries} tokens x {loaded.model.config.n_heads} heads)")
    print("layer  best needle-pool rank per question token (min / median / max)  tokens keeping it  attention")
    for layer in sorted(question):
        scores = question[layer]
        ranks = (scores[:, None, :] > scores[:, needle, None]).sum(-1).min(-1).values.tolist()  # pools above it
        kept = sum(rank < keep for rank in ranks)
        share = evidence.layers[layer].span_mass(needle_start, needle_end) / max(rows, 1)
        print(f"{layer:>5}  {min(ranks):>10} / {statistics.median(ranks):>8} / {max(ranks):>8}"
              f"{kept:>28}/{len(ranks)}{share:>11.4f}", flush=True)
    with torch.inference_mode():
        answer_probe(session, logits, needle_start, needle_end, args.answer_steps, tokenizer)


def answer_probe(session: Session, logits: torch.Tensor, needle_start: int, needle_end: int, steps: int,
                 tokenizer) -> None:
    """Decode greedily from the prompt's last logits: per step and layer, whether the step's selection keeps a
    needle token and the share of its attention (per query head) on the needle."""
    cache, n_layers = session.cache, session.model.config.n_layers
    keeps: dict[int, bool] = {}

    def on_select(layer, positions, far):
        keeps[layer] = bool(((far >= needle_start) & (far < needle_end)).any())

    cache.on_select = on_select
    fed, steps_mass = [], []
    for _ in range(steps):
        token = int(logits.argmax())
        fed.append(token)
        evidence = RegionEvidence(cache, needle_start, needle_end)
        cache.evidence, keeps = evidence, {}
        logits = session.model(torch.tensor([[token]]), len(session.tokens), cache)[:, -1]
        session.tokens.append(token)
        steps_mass.append((dict(keeps), evidence.mass / session.model.config.n_heads))
    cache.evidence, cache.on_select = None, None
    answer = tokenizer.decode(fed + [int(logits.argmax())])
    print(f"\nanswer {answer!r}; per decode step (the token it feeds), per layer: needle kept (+/-) and "
          "attention share on it")
    print("layer  " + "  ".join(f"{tokenizer.decode([t])!r:>10}" for t in fed))
    for layer in range(n_layers):
        print(f"{layer:>5}  " + "  ".join(f"{'+' if k.get(layer) else '-' if layer in k else ' '}{mass[layer, 0]:>9.4f}"
                                          for k, mass in steps_mass), flush=True)
    print(f"\nthe first decode step ({tokenizer.decode(fed[:1])!r}, which gives the first digit): attention share per layer on")
    print("layer  " + "  ".join(f"{name:>9}" for name in RegionEvidence.REGIONS))
    for layer in range(n_layers):
        print(f"{layer:>5}  " + "  ".join(f"{share:>9.4f}" for share in steps_mass[0][1][layer].tolist()), flush=True)


if __name__ == "__main__":
    main()
