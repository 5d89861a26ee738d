"""Which tokens the default model turns into attention sinks of its own, by how far back the first token lies.

Reads the passkey prompt (`benchmarks/passkey.py`: chat template, filler haystack) densely at 8K and through the
IndexPool cache at `--length` for each of `--sink-distances`, records one layer's un-rotated keys, and for the
haystack's `" The"` tokens (every sentence opens with one) measures how far each key lies from their median key.
A key several times further off than the median is an outlier: such tokens take attention from every later query
(session 15 found them taking the late layers' attention from a passkey needle at 512K). Per run: how many
outliers, and the distances back to the first token (position 0, as the token's forward placed it) at which they
sit, in bands of 64.

    OMP_NUM_THREADS=1 taskset -c 0 .venv/bin/python benchmarks/sink_distance.py --threads 1
"""

from __future__ import annotations

import argparse
import collections
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from indexpool_cli.attention import AttentionChoice, default_indexer  # noqa: E402
from model.generate import Session  # noqa: E402
from model.indexpool_cache import IndexPoolCache, IndexPoolConfig, place_far_tokens  # noqa: E402
from model.runtime import load_engine, set_threads  # noqa: E402
from passkey import build_prompt, haystack_text  # noqa: E402  (this script's folder is on sys.path)


def first_token_distances(cache, start: int, length: int) -> torch.Tensor:
    """For each query of the forward [start, start + length): how far back it sees position 0 (dense caches and
    IndexPool forwards that take everything: its own position)."""
    positions = torch.arange(start, start + length)
    if not isinstance(cache, IndexPoolCache) or cache.n_sinks == 0:
        return positions
    n_attended = cache.n_sinks + min(cache.n_far, cache.settings.topk)
    first = place_far_tokens(torch.arange(1), cache.ws, n_attended, cache.n_sinks, cache.sink_gap)
    return positions - first


def read_keys(loaded, prompt: list[int], layer: int, settings: IndexPoolConfig | None):
    """The layer's un-rotated keys (N, kv_dim) of a read of `prompt` and each token's distance to position 0."""
    session = Session(loaded.model, len(prompt) + 1, attention=settings,
                      indexer=default_indexer(AttentionChoice(), loaded) if settings else None)
    cache_type, keys, distances = type(session.cache), [], []
    attend = cache_type.attend
    n_heads = loaded.config.n_heads

    def recorded(cache, at_layer, qk, v, x):
        if at_layer == layer:
            keys.append(qk[0, :, n_heads:].float().flatten(1).clone())
            distances.append(first_token_distances(cache, cache.start, qk.shape[1]))
        return attend(cache, at_layer, qk, v, x)

    cache_type.attend = recorded
    try:
        with torch.inference_mode():
            session.prefill(prompt, query_tail=False)
    finally:
        cache_type.attend = attend
    return torch.cat(keys), torch.cat(distances)


def report(label: str, keys: torch.Tensor, distances: torch.Tensor, prompt: list[int], the: int, skip: int,
           ratio: float) -> None:
    ids = torch.tensor(prompt[: len(keys)])
    picked = (ids == the).nonzero().flatten()
    picked = picked[picked >= skip]  # the sinks' own " The"s aside
    deviation = (keys[picked] - keys[picked].median(dim=0).values).norm(dim=1)
    typical = float(deviation.median())
    outliers = deviation > ratio * typical
    bands = collections.Counter((distances[picked[outliers]] // 64 * 64).tolist())
    where = ", ".join(f"{band}-{band + 63}: {n}" for band, n in sorted(bands.items())) or "none"
    print(f"{label:<34} {len(picked):>6} {typical:>9.2f} {float(deviation.max()) / typical:>8.1f}x "
          f"{int(outliers.sum()):>8}  {where}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--length", type=int, default=32768, help="IndexPool read length (default 32768)")
    parser.add_argument("--sink-distances", type=lambda s: [int(x) for x in s.split(",")], default=[0, 4096],
                        help="IndexPool sink distances to read with, a row each (0: the sinks right before the far "
                             "tokens)")
    parser.add_argument("--layer", type=int, default=12)
    parser.add_argument("--ratio", type=float, default=4.0, help="outlier: this many times the median deviation")
    parser.add_argument("--threads", type=int, default=None)
    args = parser.parse_args()
    set_threads(args.threads)
    loaded = load_engine(None)
    tokenizer = loaded.tokenizer
    hay = tokenizer.encode(haystack_text("filler"))
    the = tokenizer.encode(" The")[0]
    skip = IndexPoolConfig.sinks
    print(f"model {loaded.name}, layer {args.layer}: keys of the haystack's ' The' tokens; outlier: > {args.ratio}x "
          "the median distance to their median key")
    print(f"{'read':<34} {'tokens':>6} {'median':>9} {'max':>9} {'outliers':>8}  distance back to the first token: "
          "outliers per band of 64")
    dense_prompt = build_prompt(tokenizer, hay, 8192, 0.5, 65125)[0]
    report("dense 8K", *read_keys(loaded, dense_prompt, args.layer, None), dense_prompt, the, skip, args.ratio)
    prompt = build_prompt(tokenizer, hay, args.length, 0.5, 65125)[0]
    for distance in args.sink_distances:
        settings = IndexPoolConfig(sink_distance=distance)
        report(f"IndexPool {args.length // 1024}K, sink distance {distance}",
               *read_keys(loaded, prompt, args.layer, settings), prompt, the, skip, args.ratio)


if __name__ == "__main__":
    main()
