"""The trained k-pool "lightning indexer" for llama-family models (the `Indexer` protocol of `model/indexers.py`).

Per layer, with x the layer's attention input (width `dim`) and q the model's un-rotated attention queries:

    k_t     = LayerNorm(W_k x_t)                      # index key, width d (what is pooled and stored)
    g_t     = G x_t                                   # per-channel gate logits, width d
    q_{t,j} = W_q^j qbar_t                            # H index heads of width d
    w_{t,j} = (W_w x_t) * H**-0.5                     # per-head weights, fp32

qbar_t is the model's un-rotated query heads averaged per KV group (n_kv_heads * head_dim wide, 192 for
SmolLM2-135M). Why these inputs: in short distillation runs on the default model (5 layers, 8K contexts, scored on
other text), keys from x caught more of the dense attention than keys from the model's own un-rotated k (far-mass
recall 0.87 against 0.83 on two of the five layers, equal on the others), while queries from qbar did as well as
queries from x at a third of the parameters of W_q; d = 32 did as well as d = 64. For SmolLM2-135M (d = 32, H = 4)
that is 64K parameters per layer, a 4 MB file, and 16 bytes of bf16 pooled key per token and layer. Pooling and
scoring follow `model/indexpool.py`; `indexpool distill` (`model/indexer_training.py`) trains the weights from
the model's dense attention.

A distilled indexer belongs to one model: the file records the model's name, file size and shape, and `load`
refuses another model.
"""

from __future__ import annotations

import json
import re
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from indexpool.kernels import kernel_backend

from .indexers import hide_pools_past

FORMAT = "indexpool-lightning-indexer/1"
INDEXERS_DIR = Path(__file__).parent / "indexers_data"
QUERY_CHUNK = 16  # queries scored together (see score)
BF16_STORED = ("key_gate_proj", "query_proj")  # the large projections; see round_to_storage_
# Distilled indexers shipped with the package, by the model's name (GGUF `general.name`).
SHIPPED = {"Smollm2 135M 8k Lc100K Mix1 Ep2": "smollm2-135m-instruct.lightning.safetensors"}


@dataclass(frozen=True)
class ModelFingerprint:
    """What identifies the model an indexer was distilled from: a file of another size or shape is another model."""

    name: str
    file_bytes: int
    n_layers: int
    dim: int
    n_heads: int
    n_kv_heads: int
    head_dim: int

    @classmethod
    def of(cls, loaded) -> ModelFingerprint:
        """From a `model.loader.LoadedModel`."""
        c = loaded.config
        return cls(loaded.name, loaded.file_bytes, c.n_layers, c.dim, c.n_heads, c.n_kv_heads, c.head_dim)


@dataclass(frozen=True)
class LightningIndexerConfig:
    model: ModelFingerprint
    key_dim: int = 32  # d: width of an index key and of a pooled key
    heads: int = 4  # H: index heads
    kpool: int = 4


class LightningIndexer(nn.Module):
    """All layers' indexer weights, stacked over layers (see the module docstring)."""

    reads_stored_pools = False  # its matmul runs in the pooled keys' dtype: give it the compute dtype

    def __init__(self, config: LightningIndexerConfig):
        super().__init__()
        self.config = config
        m, d, H = config.model, config.key_dim, config.heads
        self.kpool, self.key_dim, self.heads = config.kpool, d, H
        self.n_kv_heads, self.group = m.n_kv_heads, m.n_heads // m.n_kv_heads
        L = m.n_layers
        # Random, variance-preserving starts; gates and APE at zero make pooling a plain mean at first.
        self.key_gate_proj = nn.Parameter(torch.cat([torch.randn(L, d, m.dim) * m.dim**-0.5, torch.zeros(L, d, m.dim)], 1))
        self.key_norm_weight = nn.Parameter(torch.ones(L, d))
        self.key_norm_bias = nn.Parameter(torch.zeros(L, d))
        self.ape = nn.Parameter(torch.zeros(L, config.kpool, d))
        query_width = m.n_kv_heads * m.head_dim
        self.query_proj = nn.Parameter(torch.randn(L, H * d, query_width) * query_width**-0.5)
        self.weight_proj = nn.Parameter(torch.randn(L, H, m.dim) * m.dim**-0.5)

    def read_at(self, distances: tuple[int, int] | None) -> None:
        """Nothing to turn: its trained queries carry no position (`Indexer.read_at`)."""

    def keys(self, layer: int, x: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """fp32 index keys and gate logits (B, T, d); the projection runs in x's dtype (bf16 on AMX)."""
        keys, gates = F.linear(x, self.key_gate_proj[layer].to(x.dtype)).float().split(self.key_dim, dim=-1)
        keys = F.layer_norm(keys, (self.key_dim,), self.key_norm_weight[layer], self.key_norm_bias[layer])
        return keys, gates

    def queries(self, layer: int, x: torch.Tensor, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Index queries (B, T, H, d) in fp32, fp32 head weights (B, T, H)."""
        B, T = q.shape[:2]
        grouped = q.float().view(B, T, self.n_kv_heads, self.group, -1).mean(dim=3).flatten(2)
        index_q = F.linear(grouped, self.query_proj[layer]).view(B, T, self.heads, self.key_dim)
        # fp32: the weights decide near-tie rankings, which bf16 rounding flips.
        weights = F.linear(x.float(), self.weight_proj[layer]) * self.heads**-0.5
        return index_q, weights

    def score(self, layer: int, q: torch.Tensor, weights: torch.Tensor, pooled: torch.Tensor,
              limits: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 scores (B, T, P); limits (B, T): pools each query may see, the rest -inf. The big matmul runs in the pooled keys' dtype (bf16) with the pooled keys as the
        left operand: it streams them once for all heads and queries (a decode step at 262,144 pools: 4 ms on one
        core, against 93 ms for a head-by-head (H, d) x (d, P) product). Then each query's weighted sum over its
        heads, in fp32, is one matmul with a block-diagonal (T * H, T) matrix. Queries go in chunks of at most 16,
        which bounds the (P, 16 * H) temporaries. d**-0.5 is folded into the weights (a positive scale commutes
        with ReLU).

        Without gradients, where `kernel_backend` says Triton: `kernels.index_scores` on the queries rounded to the
        pooled keys' dtype, as here; it keeps each head's logit in fp32 where this path rounds it to bf16."""
        if not torch.is_grad_enabled() and kernel_backend(pooled.device) == "triton":
            from indexpool.kernels import index_scores

            # Every pool handed in is scored: positions past the last one make them all visible.
            everything = torch.full(q.shape[:2], pooled.shape[1] * self.kpool, dtype=torch.long, device=q.device)
            scores = index_scores(q.to(pooled.dtype), weights, pooled, everything, self.kpool)
            # Masking after scoring is exact: a sum of ReLUs has no normalization to redo.
            return scores if limits is None else hide_pools_past(scores, limits)
        B, T, H, _ = q.shape
        head_weights = weights.float() * self.key_dim**-0.5
        parts = []
        for start in range(0, T, QUERY_CHUNK):
            chunk = q[:, start : start + QUERY_CHUNK]
            n = chunk.shape[1]
            logits = torch.matmul(pooled, chunk.flatten(1, 2).to(pooled.dtype).transpose(1, 2)).float().relu_()
            eye = torch.eye(n, device=q.device)
            block_weights = (head_weights[:, start : start + n, :, None] * eye[:, None, :]).reshape(B, n * H, n)
            parts.append(torch.matmul(logits, block_weights).transpose(1, 2))
        scores = parts[0] if len(parts) == 1 else torch.cat(parts, dim=1)
        return scores if limits is None else hide_pools_past(scores, limits)

    def round_to_storage_(self) -> LightningIndexer:
        """Round the projections to bf16 in place, as `save` stores them: they run in bf16 at inference anyway,
        and this halves the file. The small fp32 parts (norm, APE, head weights) stay exact."""
        with torch.no_grad():
            for name in BF16_STORED:
                getattr(self, name).copy_(getattr(self, name).bfloat16())
        return self

    def save(self, path: str | Path) -> None:
        """Write safetensors with the config as metadata; the projections in bf16 (see round_to_storage_)."""
        from safetensors.torch import save_file

        tensors = {name: p.detach().to(torch.bfloat16 if name in BF16_STORED else torch.float32).contiguous()
                   for name, p in self.named_parameters()}
        save_file(tensors, str(path), metadata={"format": FORMAT, "config": json.dumps(asdict(self.config))})

    @classmethod
    def load(cls, path: str | Path, device: torch.device | str | None = None,
             model: ModelFingerprint | None = None) -> LightningIndexer:
        """Read a saved indexer, for inference (no gradients). With `model`, refuse an indexer distilled from a
        different model."""
        from safetensors import safe_open

        try:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                metadata = f.metadata() or {}
                tensors = {name: f.get_tensor(name) for name in f.keys()}
        except Exception as e:  # a missing file, or bytes that are not safetensors
            raise ValueError(f"cannot read indexer {path}: {e}") from None
        if metadata.get("format") != FORMAT:
            raise ValueError(f"{path} is not a lightning indexer file (format {metadata.get('format')!r}, expected {FORMAT!r})")
        try:
            raw = json.loads(metadata["config"])
            config = LightningIndexerConfig(**{**raw, "model": ModelFingerprint(**raw["model"])})
        except (KeyError, TypeError, ValueError) as e:
            raise ValueError(f"{path}: unreadable indexer config in its metadata ({e})") from None
        if model is not None and model != config.model:
            raise ValueError(f"indexer {path} was distilled for {_describe(config.model)}, not for {_describe(model)}; "
                             f"run `indexpool distill` for this model")
        indexer = cls(config)
        try:
            indexer.load_state_dict({name: t.float() for name, t in tensors.items()})
        except RuntimeError as e:  # missing, extra or misshapen tensors
            raise ValueError(f"{path}: tensors do not match its config: {str(e).splitlines()[0]}") from None
        return indexer.requires_grad_(False).eval().to(device)


def _describe(model: ModelFingerprint) -> str:
    return (f"'{model.name}' ({model.file_bytes:,} bytes, {model.n_layers} layers, width {model.dim}, "
            f"{model.n_heads}/{model.n_kv_heads} heads of {model.head_dim})")


def default_indexer_path(model_name: str) -> Path | None:
    """The shipped indexer for a model name, or None when none is shipped (or the file is missing)."""
    name = SHIPPED.get(model_name)
    path = INDEXERS_DIR / name if name else None
    return path if path is not None and path.is_file() else None


def default_indexer_location(model_name: str) -> Path:
    """Where `indexpool distill` writes by default: the shipped file's place for a model we ship an indexer for,
    else ./<model name>.lightning.safetensors."""
    if model_name in SHIPPED:
        return INDEXERS_DIR / SHIPPED[model_name]
    slug = re.sub(r"[^A-Za-z0-9.]+", "-", model_name).strip("-").lower() or "model"
    return Path(f"{slug}.lightning.safetensors")
