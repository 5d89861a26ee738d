"""Distilling a `LightningIndexer` from the model's dense attention (DeepSeek-V3.2's dense warm-up recipe).

Capture: the dense model reads a sequence in 512-token segments through `DenseCapture`, a KV cache that also keeps,
per layer, what the indexer reads: the attention input x of every token, and the un-rotated attention queries at a
sample of query positions (most of them far from the start, where there are many candidates). From the filled cache
it then computes the target of every sampled query: the dense attention probabilities summed over the layer's
heads, summed per pool, restricted to the pools the indexer chooses among (complete pools inside [sinks, window
start)) and renormalised.

Training: teacher forcing on these dense states; loss = KL(target || softmax of the indexer's pool scores over the
same candidates), summed over layers (each layer's indexer is independent). Pooled keys pass through the storage
quantization (bf16 rounding, or fp8 e4m3 with a power-of-two scale) with a straight-through estimator.
"""

from __future__ import annotations

import math
import sysconfig
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from indexpool.kernels.index_math import fp8_dequantize, fp8_quantize, pool_keys
from .lightning_indexer import LightningIndexer, LightningIndexerConfig, ModelFingerprint
from indexpool.kernels.rope import apply_rope

from .llama import KVCache, Transformer, rope_tables


@dataclass(frozen=True)
class SparsePattern:
    """What a query at position p attends to under IndexPool: sinks [0, sinks), the selected far tokens (the top
    topk // kpool complete pools inside [sinks, ws)) and the recent window [ws, p], ws = max(0, (p - window) //
    kpool * kpool). When there are at most topk far tokens, all are selected."""

    sinks: int = 64
    window: int = 1024
    topk: int = 2048
    kpool: int = 4

    def window_start(self, positions: torch.Tensor) -> torch.Tensor:
        return ((positions - self.window).div(self.kpool, rounding_mode="floor") * self.kpool).clamp(min=0)

    def far_pools(self, positions: torch.Tensor) -> tuple[int, torch.Tensor]:
        """First candidate pool (the same for every query) and, per query, the end (exclusive) of its candidates."""
        first = self.sinks // self.kpool
        return first, torch.maximum(self.window_start(positions) // self.kpool, torch.tensor(first))

    def first_scored_position(self) -> int:
        """The first position with more than topk far tokens, i.e. where the indexer's choice matters."""
        p = self.sinks + self.topk + self.window
        while int(self.window_start(torch.tensor(p))) - self.sinks <= self.topk:
            p += 1
        return p


class QueryRecorder:
    """Keeps (in bf16) the attention input x and the un-rotated attention queries at `query_positions` (sorted) as a
    cache's forwards pass them: a cache (with n_heads, and start/end set by its `begin`) calls `record` from its
    `attend`."""

    def _init_recorder(self, config, query_positions: torch.Tensor, device) -> None:
        self.query_positions = query_positions.to(device)
        L, Q, bf16 = config.n_layers, len(query_positions), torch.bfloat16
        self.query_x = torch.empty(L, Q, config.dim, dtype=bf16, device=device)
        self.queries = torch.empty(L, Q, config.n_heads, config.head_dim, dtype=bf16, device=device)

    def record(self, layer: int, qk: torch.Tensor, x: torch.Tensor) -> None:
        inside = (self.query_positions >= self.start) & (self.query_positions < self.end)
        rows = self.query_positions[inside] - self.start
        self.query_x[layer, inside] = x[0, rows].to(torch.bfloat16)
        self.queries[layer, inside] = qk[0, rows, : self.n_heads].to(torch.bfloat16)


class DenseCapture(QueryRecorder, KVCache):
    """The dense KV cache, also keeping the attention input and un-rotated queries at `query_positions`
    (`QueryRecorder`), and with `keep_inputs` the attention input of every token and layer."""

    def __init__(self, model: Transformer, length: int, query_positions: torch.Tensor, keep_inputs: bool = True):
        config, device = model.config, model.device
        model._ensure_rope(length)
        super().__init__(config, length, model.rope_cos, model.rope_sin, 1, model.dtype, device)
        self.head_dim = config.head_dim
        self._init_recorder(config, query_positions, device)
        self.x = torch.empty(config.n_layers, length, config.dim, dtype=torch.bfloat16, device=device) if keep_inputs else None

    def attend(self, layer, qk, v, x):
        if self.x is not None:
            self.x[layer, self.start : self.end] = x[0]
        self.record(layer, qk, x)
        return super().attend(layer, qk, v, x)

    def attention_probs(self, layer: int, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Dense attention probabilities (n_heads, Q, length) in fp32 of the sampled queries, from the filled cache;
        cos/sin: fp32 RoPE tables (length, head_dim)."""
        positions = self.query_positions
        n_queries, H, KV, D = len(positions), self.n_heads, self.n_kv_heads, self.head_dim
        q = apply_rope(self.queries[layer].float()[None], cos[positions, None], sin[positions, None])[0]
        keys = self.k[layer, 0].float()  # (KV, length, D), rotated
        logits = torch.einsum("qgnd,gtd->gnqt", q.view(n_queries, KV, H // KV, D), keys).reshape(H, n_queries, -1)
        hidden = torch.arange(keys.shape[1], device=keys.device) > positions[:, None]
        return (logits * D**-0.5).masked_fill_(hidden, float("-inf")).softmax(dim=-1)


def pool_targets(probs: torch.Tensor, positions: torch.Tensor, pattern: SparsePattern) -> torch.Tensor:
    """(Q, length // kpool) fp32: attention probabilities (heads, Q, length) summed over heads and per pool, zero
    outside each query's far candidates, renormalised over them."""
    kpool = pattern.kpool
    n_pools = probs.shape[-1] // kpool
    mass = probs.sum(dim=0)[:, : n_pools * kpool].view(len(positions), n_pools, kpool).sum(dim=-1)
    first, end = pattern.far_pools(positions)
    pool_index = torch.arange(n_pools, device=probs.device)
    mass = mass.masked_fill_((pool_index < first) | (pool_index >= end[:, None]), 0.0)
    return mass / mass.sum(dim=-1, keepdim=True).clamp_min(1e-30)


# ------------------------------------------------------------------------------------------------ offline text

LICENSES_DIR = Path("/usr/share/common-licenses")
# pydoc_data.topics is split by characters: the head trains, then a validation part, then a held-out tail that
# the recall benchmark reads (over 32K tokens of English the indexer never saw).
VALIDATION_CHARS = 40_000
HELD_OUT_CHARS = 150_000


def _pydoc_topics() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[key] for key in sorted(pydoc_data.topics.topics))


def calibration_text() -> str:
    """English text for calibrating (index pruning): the head of pydoc_data.topics, apart from the held-out tail."""
    return _pydoc_topics()[:-HELD_OUT_CHARS - VALIDATION_CHARS]


def held_out_text() -> str:
    """English text that `indexpool distill` never trains on by default: the tail of pydoc_data.topics."""
    return _pydoc_topics()[-HELD_OUT_CHARS:]


def validation_text() -> str:
    return _pydoc_topics()[-HELD_OUT_CHARS - VALIDATION_CHARS : -HELD_OUT_CHARS]


def default_training_texts() -> list[tuple[str, str]]:
    """(name, text): pydoc topics (head), the common licenses (duplicates dropped: GPL is GPL-3, ...), and the
    standard library's top-level modules, each in sorted order."""
    licenses = {}
    if LICENSES_DIR.is_dir():
        for path in sorted(LICENSES_DIR.iterdir()):
            if path.is_file():
                licenses.setdefault(path.read_text(errors="replace"), path.name)
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    modules = [p.read_text(errors="replace") for p in sorted(stdlib.glob("*.py"))]
    texts = [("pydoc topics", _pydoc_topics()[: -HELD_OUT_CHARS - VALIDATION_CHARS]),
             ("licenses", "\n\n".join(licenses)), ("stdlib sources", "\n\n".join(modules))]
    return [(name, text) for name, text in texts if text]


def token_windows(token_lists: list[list[int]], length: int) -> list[list[int]]:
    """Windows of `length` tokens at a stride of length // 2 from each source, taken from the sources in turn
    (round robin) so every stretch of training sees every kind of text."""
    per_source = [[ids[s : s + length] for s in range(0, len(ids) - length + 1, length // 2)] for ids in token_lists]
    windows = []
    for i in range(max(map(len, per_source), default=0)):
        windows.extend(source[i] for source in per_source if i < len(source))
    return windows


# ----------------------------------------------------------------------------------------------- distillation


@dataclass
class DistillConfig:
    # The defaults are the shipped indexer's run (`indexpool distill` repeats them).
    context: int = 8192  # tokens per captured sequence
    sequences: int = 56  # sequences captured over the run (windows are reused, with new query samples, if fewer)
    steps: int = 2000  # optimizer steps; each uses every sampled query of one buffered sequence
    queries: int = 128  # query positions sampled per sequence, uniformly where more than topk far tokens exist
    buffer: int = 4  # captured sequences kept; each step draws one of them
    lr: float = 2e-3
    warmup: int = 40  # steps of linear warm-up, then cosine decay to lr / 10
    storage: str = "bf16"  # pooled-key quantization simulated in training: bf16 or fp8
    seed: int = 0
    pattern: SparsePattern = field(default_factory=SparsePattern)

    def validate(self) -> None:
        first = self.pattern.first_scored_position()
        if self.context <= first + self.queries:
            raise ValueError(f"context must exceed {first + self.queries} tokens: queries need more than "
                             f"topk={self.pattern.topk} far tokens to have anything to choose")
        if self.storage not in ("bf16", "fp8"):
            raise ValueError(f"storage must be bf16 or fp8, not {self.storage!r}")
        if min(self.sequences, self.steps, self.queries, self.buffer) < 1:
            raise ValueError("sequences, steps, queries and buffer must be >= 1")


@dataclass
class CapturedSequence:
    """One sequence's distillation data. Pool indices here count from the first candidate pool (sinks // kpool)."""

    key_x: torch.Tensor  # (n_layers, n_pools * kpool, dim) bf16: attention inputs of the candidate pools' tokens
    query_x: torch.Tensor  # (n_layers, Q, dim) bf16: attention inputs at the query positions
    queries: torch.Tensor  # (n_layers, Q, n_heads, head_dim) bf16: un-rotated attention queries
    positions: torch.Tensor  # (Q,) query positions
    targets: torch.Tensor  # (n_layers, Q, n_pools) fp32: target distributions over the far candidate pools


@torch.no_grad()
def capture(model: Transformer, tokens: list[int], n_queries: int, pattern: SparsePattern,
            generator: torch.Generator, segment: int = 512) -> CapturedSequence:
    """Run the dense model over `tokens` and keep what distillation needs (see the module docstring)."""
    length = len(tokens)
    first_position = pattern.first_scored_position()
    positions = (torch.randperm(length - first_position, generator=generator)[:n_queries] + first_position).sort().values
    cache = DenseCapture(model, length, positions)
    ids = torch.tensor([tokens], device=cache.x.device)
    for start in range(0, length, segment):
        model(ids[:, start : start + segment], start, cache)
    cos, sin = (table.to(ids.device) for table in rope_tables(model.config, length, torch.float32))
    first, ends = pattern.far_pools(positions)
    end = int(ends.max())
    targets = torch.stack([pool_targets(cache.attention_probs(layer, cos, sin), positions, pattern)[:, first:end]
                           for layer in range(model.config.n_layers)])
    key_x = cache.x[:, first * pattern.kpool : end * pattern.kpool].clone()
    return CapturedSequence(key_x, cache.query_x, cache.queries, positions.cpu(), targets)


def fake_quantize(pooled: torch.Tensor, storage: str) -> torch.Tensor:
    """Pooled keys as the cache stores them (bf16, or fp8 e4m3 with a power-of-two scale per key), with a
    straight-through gradient: the forward sees the rounding, the backward passes through as if it were not there."""
    if storage == "fp8":
        stored = fp8_dequantize(*fp8_quantize(pooled), dtype=torch.float32)
    else:
        stored = pooled.bfloat16().float()
    return pooled + (stored - pooled).detach()


def distill_loss(indexer, seq: CapturedSequence, storage: str, pattern: SparsePattern) -> torch.Tensor:
    """Per layer (n_layers,): the mean over queries of KL(target || softmax of the index scores), both over each
    query's far candidate pools."""
    first, ends = pattern.far_pools(seq.positions)
    outside = torch.arange(seq.targets.shape[-1]) >= (ends - first)[:, None]
    log_targets = seq.targets.clamp_min(1e-30).log()
    losses = []
    for layer in range(seq.targets.shape[0]):
        keys, gates = indexer.keys(layer, seq.key_x[layer, None], None)
        pooled = fake_quantize(pool_keys(keys, gates, indexer.ape[layer], pattern.kpool), storage)
        index_q, weights = indexer.queries(layer, seq.query_x[layer, None], seq.queries[layer, None])
        # What the cache hands to score(): queries rounded to the pooled keys' dtype (bf16 for both storages).
        index_q = index_q + (index_q.bfloat16().float() - index_q).detach()
        scores = indexer.score(layer, index_q, weights, pooled)[0].masked_fill(outside, float("-inf"))
        log_probs = scores.log_softmax(dim=-1).masked_fill(outside, 0.0)
        losses.append((seq.targets[layer] * (log_targets[layer] - log_probs)).sum(dim=-1).mean())
    return torch.stack(losses)


@dataclass
class DistillResult:
    indexer: LightningIndexer
    loss_before: float  # mean KL per query and layer on the validation sequence, untrained indexer
    loss_after: float  # the same for the distilled indexer (projections rounded to bf16, as saved)
    layer_losses: list[float]  # loss_after per layer
    train_loss_last: float  # mean training loss over the last tenth of the steps
    seconds: float
    capture_seconds: float  # part of `seconds` spent running the dense model and building targets


def distill(model: Transformer, fingerprint: ModelFingerprint, windows: list[list[int]], validation: list[int],
            config: DistillConfig, key_dim: int = 32, heads: int = 4,
            on_progress: Callable[[int, int, float], None] | None = None) -> DistillResult:
    """Distill a LightningIndexer from `model`'s dense attention on `windows` (token lists of config.context
    tokens), reporting the loss on `validation` (another such window) before and after. Deterministic for a seed."""
    config.validate()
    pattern = config.pattern
    started = time.perf_counter()
    generator = torch.Generator().manual_seed(config.seed)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        indexer = LightningIndexer(LightningIndexerConfig(fingerprint, key_dim, heads, pattern.kpool))
    indexer.to(model.device)

    capture_seconds = 0.0

    def timed_capture(tokens: list[int]) -> CapturedSequence:
        nonlocal capture_seconds
        t0 = time.perf_counter()
        seq = capture(model, tokens, config.queries, pattern, generator)
        capture_seconds += time.perf_counter() - t0
        return seq

    def validation_loss() -> torch.Tensor:
        with torch.no_grad():
            return distill_loss(indexer, validation_seq, config.storage, pattern)

    validation_seq = timed_capture(validation)
    loss_before = float(validation_loss().mean())
    optimizer = torch.optim.Adam(indexer.parameters(), lr=config.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: _lr_factor(step, config))
    buffer: list[CapturedSequence] = []
    n_captured, recent_losses = 0, []
    for step in range(config.steps):
        # Spread the captures evenly over the steps; the oldest buffered sequence makes room for the new one.
        while n_captured * config.steps <= step * config.sequences:
            buffer = buffer[-(config.buffer - 1) :] if config.buffer > 1 else []
            buffer.append(timed_capture(windows[n_captured % len(windows)]))
            n_captured += 1
        seq = buffer[int(torch.randint(len(buffer), (1,), generator=generator))]
        losses = distill_loss(indexer, seq, config.storage, pattern)
        optimizer.zero_grad(set_to_none=True)
        losses.sum().backward()
        optimizer.step()
        schedule.step()
        loss = float(losses.detach().mean())
        if step >= config.steps - max(1, config.steps // 10):
            recent_losses.append(loss)
        if on_progress:
            on_progress(step + 1, config.steps, loss)
    indexer.round_to_storage_()
    layer_losses = validation_loss()
    return DistillResult(indexer, loss_before, float(layer_losses.mean()), layer_losses.tolist(),
                         sum(recent_losses) / len(recent_losses), time.perf_counter() - started, capture_seconds)


def _lr_factor(step: int, config: DistillConfig) -> float:
    if step < config.warmup:
        return (step + 1) / config.warmup
    progress = (step - config.warmup) / max(1, config.steps - config.warmup)
    return 0.1 + 0.45 * (1 + math.cos(math.pi * progress))
