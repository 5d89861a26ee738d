"""Indexers for llama-family models: what an IndexPool cache scores to pick the history a query attends to.

An indexer turns a layer's attention input into per-token index keys and gate logits (pooled by the k-pool math in
`model/indexpool.py`) and per-query index queries and head weights, and scores queries against pooled keys:
score(t, pool) = sum_j w_{t,j} * ReLU(q_{t,j} . K_pool * d**-0.5).

Two kinds share this interface:
- `TrainingFreeIndexer`: the model's own attention, no weights of its own. The index key of a token is its
  un-rotated attention key (all KV heads side by side); the gates are zero (so pooling is a plain mean); each
  attention head is an index head that scores only its KV head's slice of the pooled key, by softmax over pools
  (see `TrainingFreeIndexer.score`: this one departs from the k-pool ReLU formula).
- `LightningIndexer` (`model/lightning_indexer.py`): a small learned indexer with the k-pool weighted pooling,
  distilled from the model's dense attention by `indexpool distill`.
"""

from __future__ import annotations

from typing import Protocol

import torch

from .llama import LlamaConfig


class Indexer(Protocol):
    kpool: int
    key_dim: int  # d: width of an index key and of a pooled key
    ape: torch.Tensor  # (n_layers, kpool, d) position embedding inside a pool, fp32

    def keys(self, layer: int, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index keys and gate logits, each (B, T, d), from the layer's attention input x (B, T, dim) and its
        un-rotated attention keys k (B, T, KV, head_dim)."""

    def queries(self, layer: int, x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries (B, T, H_index, d_q) and fp32 head weights (B, T, H_index) (already scaled by
        H_index**-0.5), from x and the un-rotated attention queries q (B, T, n_heads, head_dim)."""

    def score(self, layer: int, q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """fp32 scores (B, T, P) of queries against pooled keys (B, P, d); no visibility masking."""


class TrainingFreeIndexer:
    """Scores pools with the model's own keys and queries (see the module docstring)."""

    def __init__(self, config: LlamaConfig, kpool: int = 4, device: torch.device | str | None = None):
        self.kpool = kpool
        self.n_kv_heads, self.head_dim = config.n_kv_heads, config.head_dim
        self.group = config.n_heads // config.n_kv_heads
        self.key_dim = config.kv_dim
        self.ape = torch.zeros(config.n_layers, kpool, self.key_dim, device=device)

    def keys(self, layer, x, k):
        keys = k.flatten(2)
        return keys, torch.zeros_like(keys)

    def queries(self, layer, x, q):
        return q, torch.ones(q.shape[:3], device=q.device)

    def score(self, layer, q, weights, pooled, chunk: int = 8):
        """Per query head, the softmax over pools of its logits against its KV head's slice of the pooled keys:
        an estimate of the attention mass each pool would get; summed over heads (times the head weights). A
        plain sum of ReLU logits lets a few heads with large logits outvote a retrieval head with a sharp one
        (passkey at 8K: 5/10 with the ReLU sum, 10/10 with this; docs/benchmarks.md)."""
        B, T = q.shape[:2]
        D, G = self.head_dim, self.group
        scores = torch.zeros(B, T, pooled.shape[1], device=q.device)
        for b in range(B):
            for c in range(0, T, chunk):  # bounds the (chunk * heads, P) fp32 logits at long contexts
                qc = q[b, c : c + chunk].to(pooled.dtype)  # (t, H, D)
                wc = weights[b, c : c + chunk]
                for kv in range(self.n_kv_heads):
                    # One 2D matmul per KV head against a strided slice of the pooled keys: batched forms
                    # (einsum, bmm) copy every pooled key into a contiguous layout first, 20x slower here.
                    keys = pooled[b, :, kv * D : (kv + 1) * D]
                    logits = (qc[:, kv * G : (kv + 1) * G].reshape(-1, D) @ keys.T).float() * D**-0.5
                    probs = logits.softmax(dim=-1).view(qc.shape[0], G, -1)
                    scores[b, c : c + chunk] += torch.einsum("th,thp->tp", wc[:, kv * G : (kv + 1) * G], probs)
        return scores
