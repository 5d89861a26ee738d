"""Indexers for llama-family models: what an IndexPool cache scores to pick the history a query attends to.

An indexer turns a layer's attention input into per-token index keys and gate logits (pooled by the k-pool math in
`model/indexpool.py`) and per-query index queries and head weights, and scores queries against pooled keys:
score(t, pool) = sum_j w_{t,j} * ReLU(q_{t,j} . K_pool * d**-0.5).

Two kinds share this interface:
- `TrainingFreeIndexer`: the model's own attention, no weights of its own. The index key of a token is its
  un-rotated attention key (all KV heads side by side; optionally projected onto fewer directions,
  `model/index_pruning.py`); the gates are zero (so pooling is a plain mean); each attention head is an index head
  that scores only its KV head's slice of the pooled key, by softmax over pools (see `TrainingFreeIndexer.score`:
  this one departs from the k-pool ReLU formula). Its query is the un-rotated attention query turned by RoPE
  averaged over the distances the selected tokens will be read at (`rope_average`).
- `LightningIndexer` (`model/lightning_indexer.py`): a small learned indexer with the k-pool weighted pooling,
  distilled from the model's dense attention by `indexpool distill`.
"""

from __future__ import annotations

import itertools
from typing import Protocol

import torch

from indexpool.kernels import cpu_linear
from indexpool.kernels.rope import rope_at

from .llama import LlamaConfig, inverse_frequencies


class Indexer(Protocol):
    kpool: int
    key_dim: int  # d: width of an index key and of a pooled key
    ape: torch.Tensor  # (n_layers, kpool, d) position embedding inside a pool, fp32
    reads_stored_pools: bool  # score takes pooled keys as stored (bf16 for an fp32 model), not widened first

    def keys(self, layer: int, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index keys and gate logits, each (B, T, d), from the layer's attention input x (B, T, dim) and its
        un-rotated attention keys k (B, T, KV, head_dim)."""

    def queries(self, layer: int, x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries (B, T, H_index, d_q) and fp32 head weights (B, T, H_index) (already scaled by
        H_index**-0.5), from x and the un-rotated attention queries q (B, T, n_heads, head_dim)."""

    def score(self, layer: int, q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor,
              limits: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 scores (B, T, P) of queries against pooled keys (B, P, d). limits (B, T), optional: the number of
        leading pools each query may see; the others score -inf."""

    def read_at(self, distances: tuple[int, int] | None) -> None:
        """Score queries for keys read at these query-key distances from now on (`IndexPoolConfig.far_distances`);
        an indexer whose queries do not depend on the distance ignores it."""


def hide_pools_past(scores: torch.Tensor, limits: torch.Tensor) -> torch.Tensor:
    """scores (..., P), in place, with the pools at or past each row's limit (limits: scores' leading dims, or
    fewer leading dims shared by the rows after them) set to -inf. Row by row, the hidden tails only: callers pass
    a few rows (a batch of branches, each limited to the pools before its own window), and a masked_fill over the
    whole (8 branches x 9 heads x 8.5K pools) logits cost as much as their softmax."""
    for index, limit in zip(itertools.product(*map(range, limits.shape)), limits.flatten().tolist()):
        scores[index][..., limit:] = float("-inf")
    return scores


def reads_bf16_pools(pooled: torch.Tensor, dtype: torch.dtype, rows: int) -> bool:
    """Whether `rows` queries of `dtype` are scored against these pooled keys as they are, by the C kernel that
    widens bf16 keys in registers: bf16 keys, fp32 queries, a CPU, rows the kernel takes in one pass (more would
    read the keys once a pass: they are widened once instead, for one fp32 matmul). A decode step's 9 query heads
    against 32,768 pools of 105: 1.5 ms, against 3.1 ms widening the keys then an fp32 matmul (torch would emulate
    a bf16 one; AVX2 EPYC, one thread)."""
    return (pooled.dtype == torch.bfloat16 and dtype == torch.float32 and pooled.device.type == "cpu"
            and rows <= cpu_linear.BF16_ROWS and cpu_linear.kernel_runs())


def rope_average(config: LlamaConfig, distances: tuple[int, int]) -> torch.Tensor:
    """(head_dim, head_dim) M such that q @ M is the mean of RoPE(q) over the integer distances [lo, hi]: a query
    scored against an un-rotated key with q @ M gets the mean of the logits it would have with that key placed
    anywhere that far back. The frequencies that turn many times over the range average out: at a distance of
    thousands of tokens they no longer tell a match from noise in the model's attention, but an un-rotated query
    counts them in full, as if the key stood next to it. At 32K (RULER-style needle, the default model) the needle
    value's pool rose in layers 2-10 from ranks 1,494-5,231 of 7,879 pools to 219-815 (docs/benchmarks.md)."""
    lo, hi = distances
    if not 0 <= lo <= hi:
        raise ValueError(f"distances must be 0 <= lo <= hi, got {distances}")
    cos, sin = rope_at(inverse_frequencies(config), torch.arange(lo, hi + 1))  # (N, 1, D)
    c, s = cos.mean(dim=0)[0], sin.mean(dim=0)[0]  # RoPE is linear in the rotation: the mean turn
    # rotate-half (`apply_rope`): out[i] = q[i] cos - q[i + h] sin, out[i + h] = q[i + h] cos + q[i] sin, i < h
    h = config.head_dim // 2
    first = torch.arange(h)
    turn = torch.diag(c)
    turn[first + h, first] = -s[:h]
    turn[first, first + h] = s[h:]
    return turn


class TrainingFreeIndexer:
    """Scores pools with the model's own keys and queries (see the module docstring)."""

    reads_stored_pools = True  # bf16 keys for fp32 queries: widened in the C kernel or once here (score)

    def __init__(self, config: LlamaConfig, kpool: int = 4, device: torch.device | str | None = None,
                 projection: torch.Tensor | None = None, distances: tuple[int, int] | None = None):
        """projection: (n_layers, kv_dim, R) per-layer projections of the keys (`index_pruning.pruning_projection`),
        or None for the whole keys. distances: the range of query-key distances the selected tokens are read at
        (`IndexPoolConfig.far_distances`): queries are scored with RoPE averaged over it (`rope_average`); None
        scores the un-rotated query as it is."""
        self.kpool = kpool
        self.n_kv_heads, self.head_dim = config.n_kv_heads, config.head_dim
        self.group = config.n_heads // config.n_kv_heads
        if projection is not None and projection.shape[:2] != (config.n_layers, config.kv_dim):
            raise ValueError(f"an index projection of shape {tuple(projection.shape)} does not fit this model "
                             f"({config.n_layers} layers, keys of {config.kv_dim})")
        self.projection = None if projection is None else projection.to(device)
        self.key_dim = config.kv_dim if projection is None else projection.shape[-1]
        self.ape = torch.zeros(config.n_layers, kpool, self.key_dim, device=device)
        self.config = config
        self._projections: dict[tuple[int, torch.dtype], tuple[torch.Tensor, torch.Tensor]] = {}
        self.read_at(distances)

    def read_at(self, distances: tuple[int, int] | None) -> None:
        """Score queries with RoPE averaged over these distances from now on (`rope_average`; None: un-rotated)."""
        self.query_turn = None if distances is None else rope_average(self.config, distances).to(self.ape.device)
        self._projections.clear()

    def keys(self, layer, x, k):
        keys = k.flatten(2)
        if self.projection is not None:
            keys = keys @ self._projected(layer, keys.dtype)[0]
        return keys, torch.zeros_like(keys)

    def queries(self, layer, x, q):
        return q, torch.ones(q.shape[:3], device=q.device)

    def head_projection(self, layer: int, dtype: torch.dtype) -> torch.Tensor:
        """(KV, head_dim, key_dim): what maps a query head of each KV head into the pooled keys' space, 1/sqrt(D)
        and the query's RoPE average (`rope_average`) folded in: the rows of the layer's projection that read that KV
        head's slice of a key (without a projection, that slice of the identity)."""
        return self._projected(layer, dtype)[1]

    def _projected(self, layer: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer's key projection (kv_dim, key_dim) and `head_projection`, in `dtype`, built once per layer and
        dtype rather than converted at every call (a decode step calls both in every layer)."""
        cached = self._projections.get((layer, dtype))
        if cached is None:
            KV, D = self.n_kv_heads, self.head_dim
            with torch.inference_mode(False):  # normal tensors: callers may run with autograd on
                full = torch.eye(KV * D, device=self.ape.device) if self.projection is None else self.projection[layer]
                heads = full.view(KV, D, -1) * D**-0.5
                if self.query_turn is not None:
                    heads = self.query_turn @ heads
                cached = self._projections[(layer, dtype)] = (full.to(dtype), heads.to(dtype))
        return cached

    def score(self, layer, q, weights, pooled, limits=None, chunk: int = 8):
        """Per query head, the softmax over pools of its logits against its KV head's slice of the pooled keys:
        an estimate of the attention mass each pool would get; summed over heads (times the head weights). A
        plain sum of ReLU logits lets a few heads with large logits outvote a retrieval head with a sharp one
        (passkey at 8K: 5/10 with the ReLU sum, 10/10 with this; docs/benchmarks.md).

        Each query head is first mapped into the pooled keys' space (`head_projection`, one small batched matmul
        per chunk of queries), then a chunk's logits are one matmul against the pooled keys, laid out (heads,
        pools) so that the softmax runs over contiguous rows (one query against 8.5K pools: 0.30 ms, against 0.39 ms
        with the keys as the left operand and the softmax over transposed logits; the same scores). The softmax reads the
        logits in the keys' dtype, as the matmul gives them, and computes in fp32. Queries wider than the keys (an
        fp32 model's, against bf16 keys) keep their dtype (`reads_bf16_pools`).
        limits: (B, T) pools each query may see, the rest masked before the softmax."""
        B, T = q.shape[:2]
        P, D, G, KV = pooled.shape[1], self.head_dim, self.group, self.n_kv_heads
        H = KV * G
        dtype = torch.promote_types(q.dtype, pooled.dtype)
        projection = self.head_projection(layer, dtype)
        narrow = reads_bf16_pools(pooled, dtype, min(chunk, T) * H)
        if pooled.dtype != dtype and not narrow:
            pooled = pooled.to(dtype)  # once, for every chunk's matmul
        scores = []
        for b in range(B):
            for c in range(0, T, chunk):  # bounds the (chunk * heads, P) logits at long contexts
                n = min(chunk, T - c)
                heads = q[b, c : c + n].to(dtype).view(n, KV, G, D).transpose(0, 1).reshape(KV, n * G, D)
                mapped = torch.bmm(heads, projection).view(KV, n, G, -1).transpose(0, 1).reshape(n * H, -1)
                logits = (cpu_linear.linear_bf16(mapped, pooled[b]) if narrow else mapped @ pooled[b].T).view(n, H, P)
                if limits is not None:
                    hide_pools_past(logits, limits[b, c : c + n])
                probs = logits.softmax(dim=-1, dtype=torch.float32)
                chunk_scores = torch.bmm(weights[b, c : c + n, None].float(), probs).view(n, P)
                # -inf, not 0: a visible pool whose probability underflowed must still rank above hidden ones.
                if limits is not None:
                    hide_pools_past(chunk_scores, limits[b, c : c + n])
                scores.append(chunk_scores)
        return torch.cat(scores).view(B, T, P)
