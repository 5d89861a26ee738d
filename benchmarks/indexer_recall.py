"""How much of the model's attention IndexPool's token selection keeps, per indexer.

The dense model reads held-out English (the tail of pydoc_data.topics, which `indexpool distill` does not train
on) once per context length, in 512-token segments, while each indexer fills its pooled index (`PooledIndexCache`,
as the IndexPool cache stores it). At query positions spread over the last 10% of the text, per layer and head,
attention probabilities (softmax over all keys) are summed over what the query would attend to: sinks [0, 64) +
the indexer's top topk / 4 pools of 4 (512 at the default topk, 2,048; `--topk`) among the far candidates
(complete pools inside [64, ws)) + the recent window [ws, p], ws = (p - 1024) rounded down to a pool. Reported:
that mass averaged over heads, layers and queries; the share of the far mass (outside sinks and window) it
catches; the worst layer. "sinks + window" is the floor (no far tokens), "oracle" the top pools by the attention
itself (the ceiling for that many pools chosen per layer).

Two attentions are measured against. "dense": the dense model as it is; past its trained context (8K) its queries
meet distances it never saw. "in-context": the same queries and keys with every far token at one in-context
distance, as the IndexPool cache places what it selects (see in_context_probs).

With `--states indexpool` the text is read instead as the engine reads it: through the IndexPool cache (default
settings but `--topk`, the indexer `--reader` names choosing what each segment attends to, 2048-token segments),
so that past 8K the queries and keys come from a model that never met an untrained distance; they are measured
against the "in-context" attention of those states. Past the trained context this is the model as it runs; the
dense read's states there are not.

    .venv/bin/python -m benchmarks.indexer_recall --threads 1
    .venv/bin/python -m benchmarks.indexer_recall --threads 1 --states indexpool
    .venv/bin/python -m benchmarks.indexer_recall --threads 1 --states indexpool --reader hybrid --topk 4096 --lengths 32768
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import add_schedule_option, machine_description
from indexpool.model.indexer_training import DenseCapture, QueryRecorder, SparsePattern, held_out_text, pool_targets
from indexpool.model.indexpool_cache import IndexPoolCache, IndexPoolConfig
from indexpool.model.index_pruning import pruning_projection
from indexpool.model.indexers import TrainingFreeIndexer
from indexpool.kernels.index_math import FP8_DTYPE
from indexpool.kernels.rope import apply_rope
from indexpool.model.indexpool import PooledIndexCache, indexer_source_layers, layer_schedule, per_token_index_bytes
from indexpool.model.lightning_indexer import LightningIndexer, ModelFingerprint, default_indexer_path
from indexpool.model.llama import rope_tables
from indexpool.model.runtime import load_engine
from indexpool.model.sessions import SessionOptions, default_indexer, segment_indexer


TEACHERS = {
    "dense": "the dense model, keys at their true positions (beyond 8K: distances it was never trained on)",
    "in-context": "far tokens moved to an in-context distance, as the IndexPool cache places them",
    "in-context, IndexPool read": "the states of the IndexPool read, far tokens at an in-context distance",
}


class IndexFiller:
    """Fills one pooled index per measured (indexer, storage dtype) from a cache's forwards, as the IndexPool cache
    fills its own: a cache (with n_heads) calls `fill_indexes` from its `attend`."""

    def _init_indexes(self, indexers: dict[str, tuple[object, torch.dtype]], length: int, device) -> None:
        self.indexers = indexers
        self.measured_indexes = {name: PooledIndexCache(indexer.ape, length, 1, dtype, device)
                        for name, (indexer, dtype) in indexers.items()}

    def fill_indexes(self, layer: int, qk: torch.Tensor, x: torch.Tensor) -> None:
        k = qk[:, :, self.n_heads :]
        for name, (indexer, _) in self.indexers.items():
            self.measured_indexes[name].append(layer, *indexer.keys(layer, x, k))


class IndexingCapture(IndexFiller, DenseCapture):
    """Dense attention that also fills the measured indexers' pooled indexes (`IndexFiller`)."""

    def __init__(self, model, length, query_positions, indexers: dict[str, tuple[object, torch.dtype]]):
        super().__init__(model, length, query_positions, keep_inputs=False)
        self._init_indexes(indexers, length, self.k.device)

    def attend(self, layer, qk, v, x):
        self.fill_indexes(layer, qk, x)
        return super().attend(layer, qk, v, x)


class IndexPoolCapture(IndexFiller, QueryRecorder, IndexPoolCache):
    """The IndexPool cache reading as the engine reads (its own indexer, `reader`, choosing the far tokens;
    `segment_reader`, when given, choosing for the long forwards as --indexer hybrid's trained one does), also
    keeping the queries at `query_positions` and filling the measured indexers' pooled indexes."""

    def __init__(self, model, length, query_positions, indexers: dict[str, tuple[object, torch.dtype]], reader,
                 schedule=None, topk=IndexPoolConfig.topk, segment_reader=None):
        super().__init__(model.config, IndexPoolConfig(kv_storage="bf16", schedule=schedule, topk=topk), reader, length,
                         model.dtype, model.device, segment_reader)
        self._init_recorder(model.config, query_positions, self.inv_freq.device)
        self._init_indexes(indexers, length, self.inv_freq.device)

    def attend(self, layer, qk, v, x):
        self.fill_indexes(layer, qk, x)
        self.record(layer, qk, x)
        return super().attend(layer, qk, v, x)

    def unrotated_keys(self, layer: int) -> torch.Tensor:
        """(length, KV, D) fp32: every token's key as the history store holds it."""
        return self.store.read(layer, 0, self.length)[0].float()


def attended_tokens(positions: torch.Tensor, chosen_pools: torch.Tensor | None, length: int,
                    pattern: SparsePattern) -> torch.Tensor:
    """(Q, length) bool: sinks, the chosen far pools' tokens (chosen_pools (Q, n), -1 for none) and the window."""
    token = torch.arange(length)
    attended = (token < pattern.sinks) | ((token >= pattern.window_start(positions)[:, None]) & (token <= positions[:, None]))
    if chosen_pools is not None:
        n_pools = length // pattern.kpool
        chosen = torch.zeros(len(positions), n_pools + 1, dtype=torch.bool)  # the last slot takes the -1 padding
        chosen.scatter_(1, chosen_pools.masked_fill(chosen_pools < 0, n_pools), True)
        chosen[:, n_pools] = False
        attended |= chosen[:, token // pattern.kpool]
    return attended


def choose_pools(scores: torch.Tensor, positions: torch.Tensor, pattern: SparsePattern) -> torch.Tensor:
    """The best topk // kpool far candidate pools per query (Q, n); -1 where a query has fewer candidates."""
    first, ends = pattern.far_pools(positions)
    pool = torch.arange(scores.shape[-1])
    masked = scores.masked_fill((pool < first) | (pool >= ends[:, None]), float("-inf"))
    n_select = min(pattern.topk // pattern.kpool, scores.shape[-1])
    best = masked.topk(n_select, dim=-1)
    return best.indices.masked_fill(best.values == float("-inf"), -1)


def in_context_probs(cache, layer: int, keys: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                     pattern: SparsePattern, sink_gap: int) -> torch.Tensor:
    """(heads, Q, length) fp32: the attention the model gives when no key is farther than it was trained for, as in
    the IndexPool cache: the window at its true distances, every far token at one distance (window + topk / 2, the
    middle of the block the cache moves selected far tokens to) and sink i `sink_gap` beyond the far block, at
    window + topk + sink_gap + sinks - i (the cache's `sink_gap`, see IndexPoolConfig.sink_distance).
    The queries are the ones `cache` recorded; keys: (length, KV, D) un-rotated fp32."""
    positions = cache.query_positions
    Q, H, KV, D = len(positions), cache.n_heads, cache.n_kv_heads, cache.head_dim
    q = cache.queries[layer].float().unflatten(1, (KV, H // KV))  # (Q, KV, group, D), un-rotated
    length = keys.shape[0]
    rotated_keys = apply_rope(keys[None], cos[:length, None], sin[:length, None])[0]
    token = torch.arange(length)

    # A logit depends on the distance only: rotate the query by it and leave the key un-rotated.
    far_distance = pattern.window + pattern.topk // 2
    far_q = apply_rope(q, cos[far_distance], sin[far_distance])
    logits = torch.einsum("qgnd,tgd->gnqt", far_q, keys)
    sink_distances = pattern.window + pattern.topk + sink_gap + pattern.sinks - token[: pattern.sinks]
    sink_q = apply_rope(q[None], cos[sink_distances, None, None, None], sin[sink_distances, None, None, None])
    logits[..., : pattern.sinks] = torch.einsum("sqgnd,sgd->gnqs", sink_q, keys[: pattern.sinks])
    true_q = apply_rope(q, cos[positions, None, None], sin[positions, None, None])
    window = (token >= pattern.window_start(positions)[:, None]) & (token <= positions[:, None])
    logits = torch.where(window, torch.einsum("qgnd,tgd->gnqt", true_q, rotated_keys), logits)
    logits = logits.reshape(H, Q, length) * D**-0.5
    return logits.masked_fill_(token > positions[:, None], float("-inf")).softmax(dim=-1)


def dense_key_rotated_back(cache: IndexingCapture, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """(length, KV, D) fp32: the dense cache's keys with their rotation undone."""
    rotated = cache.k[layer, 0].float().transpose(0, 1)
    return apply_rope(rotated[None], cos[: rotated.shape[0], None], -sin[: rotated.shape[0], None])[0]


@torch.inference_mode()
def measure(model, tokens: list[int], n_positions: int, indexers: dict, pattern: SparsePattern,
            reader=None, schedule=None, segment_reader=None) -> dict:
    """{teacher: {method: (n_layers, Q) attention mass kept, averaged over heads}}. Read densely (reader None):
    the dense model as it is ("dense") and with far tokens at in-context distances ("in-context", see
    in_context_probs). Read through the IndexPool cache with `reader` (and `segment_reader` for the long forwards,
    when given) choosing the far tokens: the in-context attention of those states. schedule: the indexer schedule
    (IndexPoolConfig.schedule); a "shared" layer keeps what the full layer before it chose (the oracle still
    chooses per layer)."""
    length = len(tokens)
    positions = torch.linspace(int(0.9 * length), length - 1, n_positions).round().long().unique()
    ids = torch.tensor([tokens])
    if reader is None:
        cache, segment = IndexingCapture(model, length, positions, indexers), 512
        teachers = ["dense", "in-context"]
        sink_gap = IndexPoolConfig().sink_gap(model.config.context_length)  # where the engine would put the sinks
    else:
        cache = IndexPoolCapture(model, length, positions, indexers, reader, schedule, pattern.topk, segment_reader)
        segment, teachers, sink_gap = cache.settings.segment, ["in-context, IndexPool read"], cache.sink_gap
    for start in range(0, length, segment):
        model(ids[:, start : start + segment], start, cache)
    farthest = pattern.window + pattern.topk + sink_gap + pattern.sinks
    cos, sin = rope_tables(model.config, max(length, farthest + 1), torch.float32)
    base = attended_tokens(positions, None, length, pattern)
    kept = {teacher: {name: [] for name in ["sinks + window", *indexers, "oracle"]} for teacher in teachers}
    sources = indexer_source_layers(layer_schedule(schedule, model.config.n_layers))
    chosen_in = {}  # each full layer's choices
    for layer in range(model.config.n_layers):
        if sources[layer] == layer:
            chosen_in[layer] = {"sinks + window": None}
            for name, (indexer, _) in indexers.items():
                index_q, weights = indexer.queries(layer, cache.query_x[layer, None], cache.queries[layer, None])
                scores = indexer.score(layer, index_q, weights, cache.measured_indexes[name].pooled(layer))[0]
                chosen_in[layer][name] = choose_pools(scores, positions, pattern)
        chosen = chosen_in[sources[layer]]
        attended = {name: base if pools is None else attended_tokens(positions, pools, length, pattern)
                    for name, pools in chosen.items()}
        if reader is None:
            keys = dense_key_rotated_back(cache, layer, cos, sin)
            probs_by_teacher = (("dense", cache.attention_probs(layer, cos, sin)),
                                ("in-context", in_context_probs(cache, layer, keys, cos, sin, pattern, sink_gap)))
        else:
            probs_by_teacher = ((teachers[0], in_context_probs(cache, layer, cache.unrotated_keys(layer), cos, sin,
                                                               pattern, sink_gap)),)
        for teacher, probs in probs_by_teacher:
            oracle = choose_pools(pool_targets(probs, positions, pattern), positions, pattern)
            for name, tokens_kept in {**attended, "oracle": attended_tokens(positions, oracle, length, pattern)}.items():
                kept[teacher][name].append((probs * tokens_kept).sum(dim=-1).mean(dim=0))
    return {teacher: {name: torch.stack(values) for name, values in methods.items()} for teacher, methods in kept.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", default="8192,16384,32768", help="comma-separated context lengths")
    parser.add_argument("--positions", type=int, default=32, help="query positions per length (last 10%%)")
    parser.add_argument("--indexer", type=Path, help="a lightning indexer file (default: the shipped one)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"], help="the dense model's dtype")
    parser.add_argument("--threads", type=int, help="CPU threads")
    parser.add_argument("--per-layer", action="store_true", help="also print every layer's figure")
    parser.add_argument("--no-pruned", action="store_true", help="leave out the pruned training-free indexer")
    add_schedule_option(parser)
    parser.add_argument("--topk", type=int, default=SparsePattern.topk,
                        help="far tokens a query attends to (the engine's --topk; with --states indexpool the read uses it too)")
    parser.add_argument("--states", choices=["dense", "indexpool"], default="dense",
                        help="read the text densely (default) or through the IndexPool cache, as the engine does")
    parser.add_argument("--reader", default="auto",
                        help="with --states indexpool: the engine's --indexer for the read (auto, training-free, trained, hybrid)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    print(machine_description())

    loaded = load_engine(None, dtype=args.dtype, decode_weights="off")
    pattern = SparsePattern(topk=args.topk)
    indexers = {"training-free, bf16": (TrainingFreeIndexer(loaded.config, pattern.kpool), torch.bfloat16)}
    if not args.no_pruned:  # --prune-index: keys projected on the directions holding 95% of each layer's variance
        projection = pruning_projection(loaded)
        indexers["training-free pruned"] = (TrainingFreeIndexer(loaded.config, pattern.kpool, projection=projection),
                                            torch.bfloat16)
        # As the engine builds it: the query turned by RoPE averaged over the far tokens' distances.
        placed = (pattern.window, pattern.window + pattern.topk)
        indexers["training-free pruned, RoPE-averaged"] = (
            TrainingFreeIndexer(loaded.config, pattern.kpool, projection=projection, distances=placed), torch.bfloat16)
    path = args.indexer or default_indexer_path(loaded.name)
    if path is None:
        print("no lightning indexer shipped for this model: give --indexer", file=sys.stderr)
    else:
        lightning = LightningIndexer.load(path, model=ModelFingerprint.of(loaded))
        indexers["lightning, bf16"] = (lightning, torch.bfloat16)
        indexers["lightning, fp8"] = (lightning, FP8_DTYPE)
    tokens = loaded.tokenizer.encode(held_out_text())
    lengths = [int(n) for n in args.lengths.split(",")]
    if max(lengths) > len(tokens):
        parser.error(f"the held-out text has {len(tokens)} tokens; the longest length must not exceed it")

    print(f"{loaded.name}, dense {args.dtype}, held-out pydoc topics; sinks {pattern.sinks}, window {pattern.window}, "
          f"top {pattern.topk // pattern.kpool} pools of {pattern.kpool}; {args.positions} queries in the last 10%")
    choice = SessionOptions(indexer=args.reader)
    reader, segment_reader = (None, None) if args.states == "dense" else (default_indexer(choice, loaded),
                                                                          segment_indexer(choice, loaded))
    for length in lengths:
        t0 = time.perf_counter()
        kept = measure(loaded.model, tokens[:length], args.positions, indexers, pattern, reader, args.schedule,
                       segment_reader)
        print(f"\n{length} tokens ({time.perf_counter() - t0:.0f} s)")
        for teacher, methods in kept.items():
            floor = methods["sinks + window"]
            print(f"  attention of {teacher}: {TEACHERS[teacher]}")
            print(f"  {'':22} {'mass kept':>9} {'far mass kept':>13} {'worst layer':>14}")
            for name, values in methods.items():
                per_layer = values.mean(dim=1)
                far = ((values - floor).sum() / (1 - floor).sum()).item()
                worst = int(per_layer.argmin())
                print(f"  {name:22} {values.mean().item():9.4f} {far:13.4f} {per_layer[worst].item():9.4f} (L{worst})")
                if args.per_layer:
                    print("      " + " ".join(f"{v:.3f}" for v in per_layer.tolist()))

    kv_bytes = loaded.config.kv_bytes_per_token(loaded.model.dtype) / loaded.config.n_layers
    print(f"\nindex bytes per token and layer: pooled (amortised over a pool), one key per token (plain DSA, same "
          f"width), and the pooled index against the {kv_bytes:.0f} bytes of K and V per token and layer")
    for name, (indexer, dtype) in indexers.items():
        pooled = PooledIndexCache(indexer.ape, pattern.kpool, 1, dtype).bytes_per_token()
        per_token = per_token_index_bytes(indexer.key_dim, dtype)
        print(f"  {name:22} d={indexer.key_dim:<4} pooled {pooled:5.1f}, per token {per_token:4d} "
              f"(ratio {pooled / per_token:.2f}), {pooled / kv_bytes:.3f} of K+V")


if __name__ == "__main__":
    main()
