"""IndexPool: the k-pool compressed DSA indexer (GLM-5.3-Flash), as plain torch ops plus a pooled-key cache.

The indexer keys of each `kpool` consecutive tokens are merged into one pooled key; queries score pools, the best
`topk // kpool` pools are expanded back to token positions and the unfinished newest pool (the tail) is always added.
The math (pooling, fp8 storage, scoring, selection) is in kernels/index_math.py, the references of the Triton
kernels; this module holds the pooled-key cache and the layer schedule, and names that math for the model families.

Positions. A position counts tokens from the first real token of the sequence (position 0), so pools are aligned
to the first real token: pool p holds positions [p * kpool, (p + 1) * kpool). A caller with left padding subtracts
its pad offset before calling these functions.

Visibility and tail, for a query at position `pos` (this is what transformers' `Glm5NextTextIndexer` computes for
an unpadded sequence: a key is visible when its position <= pos, a pool when its last token is visible):
  - visible pools: p < (pos + 1) // kpool, i.e. pool p is complete and (p + 1) * kpool - 1 <= pos;
  - tail: positions (pos + 1) // kpool * kpool ... pos, i.e. (pos + 1) % kpool tokens (0 to kpool - 1), always kept.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from indexpool.kernels import kernel_backend
from indexpool.kernels.index_math import FP8_DTYPE, fp8_dequantize, fp8_quantize, pool_keys

STORAGE_DTYPES = (torch.bfloat16, torch.float16, torch.float32, FP8_DTYPE)  # fp32: exact comparisons in tests
FP8_SCALE_BYTES = 4  # one fp32 scale per fp8 vector


def per_token_index_bytes(d: int, dtype: torch.dtype) -> int:
    """Indexer storage per token per layer for plain DSA (one key per token), for comparison with IndexPool."""
    return d * dtype.itemsize + (FP8_SCALE_BYTES if dtype == FP8_DTYPE else 0)


class PooledIndexCache:
    """Pooled indexer keys for all indexer layers of a batch of sequences of equal length.

    Storage is one tensor over layers, (n_layers, batch, max_tokens // kpool, d), preallocated and filled pool by
    pool: a pool is compressed and written exactly when its last token arrives. The unfinished pool's raw keys and
    gate logits (< kpool tokens) wait in a tail buffer kept in fp32: it is tiny, and lossless for bf16/fp16/fp32
    inputs, so chunked appends give bit-for-bit the pools of one whole-sequence `pool_keys`.

    Token counts are per layer, because within one forward step the layers append one after another.
    `ape` holds each layer's APE table: (n_layers, kpool, d), or a list of (kpool, d); kpool and d come from it.
    Pools are compressed by `kernels.pool_compress` (Triton, writing into the storage) when `kernel_backend` says
    so for the device, else by `pool_keys` and the cast here.
    """

    def __init__(self, ape: torch.Tensor | Sequence[torch.Tensor], max_tokens: int, batch_size: int = 1,
                 dtype: torch.dtype = torch.bfloat16, device: torch.device | str | None = None):
        if dtype not in STORAGE_DTYPES:
            raise ValueError(f"storage dtype must be one of {STORAGE_DTYPES}, got {dtype}")
        self.ape = torch.stack(list(ape)).to(device=device, dtype=torch.float32)
        self.n_layers, self.kpool, self.head_dim = self.ape.shape
        self.max_tokens = max_tokens
        self.batch_size = batch_size
        self.dtype = dtype
        device = self.ape.device
        pools_shape = (self.n_layers, batch_size, max_tokens // self.kpool)
        # Uninitialised: only written pools are ever read, and untouched pages of a large context cost no memory.
        self._pooled = torch.empty(*pools_shape, self.head_dim, dtype=dtype, device=device)
        self._scales = torch.empty(pools_shape, device=device) if dtype == FP8_DTYPE else None
        tail_shape = (self.n_layers, batch_size, self.kpool - 1, self.head_dim)
        self._tail_keys = torch.zeros(tail_shape, device=device)
        self._tail_gates = torch.zeros(tail_shape, device=device)
        self._n_tokens = [0] * self.n_layers
        self.backend = kernel_backend(device)

    def n_tokens(self, layer: int) -> int:
        return self._n_tokens[layer]

    def n_pools(self, layer: int) -> int:
        return self._n_tokens[layer] // self.kpool

    def append(self, layer: int, keys: torch.Tensor, gate_logits: torch.Tensor) -> None:
        """Add (batch, n, d) keys and gate logits: a prefill chunk (any length, may start mid-pool) or one token."""
        expected = (self.batch_size, keys.shape[1], self.head_dim)
        if keys.shape != expected or gate_logits.shape != expected:
            raise ValueError(f"expected keys and gate_logits of shape {expected}, got "
                             f"{tuple(keys.shape)} and {tuple(gate_logits.shape)}")
        if self._n_tokens[layer] + keys.shape[1] > self.max_tokens:
            raise ValueError(f"layer {layer}: {self._n_tokens[layer]} + {keys.shape[1]} tokens exceeds "
                             f"max_tokens={self.max_tokens}")
        n_tail = self._n_tokens[layer] % self.kpool
        keys = torch.cat([self._tail_keys[layer, :, :n_tail], keys.float()], dim=1)
        gates = torch.cat([self._tail_gates[layer, :, :n_tail], gate_logits.float()], dim=1)
        n_complete = keys.shape[1] // self.kpool * self.kpool
        if n_complete:
            first = self.n_pools(layer)
            written = slice(first, first + n_complete // self.kpool)
            if self.backend == "triton":
                from indexpool.kernels import pool_compress

                pool_compress(keys[:, :n_complete], gates[:, :n_complete], self.ape[layer], self.kpool, self.dtype,
                              out=self._pooled[layer, :, written],
                              out_scale=None if self._scales is None else self._scales[layer, :, written])
            else:
                pooled = pool_keys(keys[:, :n_complete], gates[:, :n_complete], self.ape[layer], self.kpool)
                if self._scales is None:
                    self._pooled[layer, :, written] = pooled.to(self.dtype)
                else:
                    self._pooled[layer, :, written], self._scales[layer, :, written] = fp8_quantize(pooled)
        n_rest = keys.shape[1] - n_complete
        self._tail_keys[layer, :, :n_rest] = keys[:, n_complete:]
        self._tail_gates[layer, :, :n_rest] = gates[:, n_complete:]
        self._n_tokens[layer] += expected[1]

    def truncate(self, n_tokens: int) -> None:
        """Forget every token from `n_tokens` on, in all layers. Only at a pool boundary: the raw keys of an
        earlier, already compressed pool are gone, so its tail cannot be rebuilt."""
        if n_tokens % self.kpool or n_tokens > min(self._n_tokens):
            raise ValueError(f"can truncate to a multiple of kpool={self.kpool} within the cached tokens, "
                             f"not to {n_tokens}")
        self._n_tokens = [n_tokens] * self.n_layers

    def pooled(self, layer: int) -> torch.Tensor:
        """Pooled keys so far, (batch, n_pools, d): a view for bf16/fp16, dequantized to bf16 for fp8."""
        n_pools = self.n_pools(layer)
        if self._scales is None:
            return self._pooled[layer, :, :n_pools]
        return fp8_dequantize(self._pooled[layer, :, :n_pools], self._scales[layer, :, :n_pools])

    def stored(self, layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Pooled keys so far as stored, (batch, n_pools, d), and for fp8 their scales (batch, n_pools), else None:
        what the Triton scoring kernel reads (fp8 dequantized in the kernel)."""
        n_pools = self.n_pools(layer)
        return self._pooled[layer, :, :n_pools], None if self._scales is None else self._scales[layer, :, :n_pools]

    def tail(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Raw keys and gate logits of the unfinished pool, each (batch, n_tokens % kpool, d) in fp32."""
        n_tail = self._n_tokens[layer] % self.kpool
        return self._tail_keys[layer, :, :n_tail], self._tail_gates[layer, :, :n_tail]

    def bytes_per_token(self) -> float:
        """Pooled-index storage per token per layer and sequence, amortised over a pool (the tail buffer, a
        constant per sequence, is not counted). Compare with per_token_index_bytes(d, dtype)."""
        bytes_per_pool = self.head_dim * self._pooled.element_size()
        if self._scales is not None:
            bytes_per_pool += self._scales.element_size()
        return bytes_per_pool / self.kpool


def layer_schedule(pattern: Sequence[str] | None, n_layers: int) -> list[str]:
    """A per-layer "full"/"shared" indexer schedule from `pattern` repeated over the layers and cut at the last one
    (["full", "shared"]: every other layer reuses the selection of the layer before it); None: every layer full."""
    if not pattern:
        return ["full"] * n_layers
    return [pattern[layer % len(pattern)] for layer in range(n_layers)]


def indexer_source_layers(schedule: Sequence[str]) -> list[int]:
    """For each indexer layer of a "full"/"shared" schedule, the layer whose top-k selection it uses: itself when
    "full", the nearest earlier "full" layer when "shared" (GLM-5.2's IndexShare)."""
    sources = []
    for layer, kind in enumerate(schedule):
        if kind == "full":
            sources.append(layer)
        elif kind == "shared":
            if not sources:
                raise ValueError("an indexer schedule cannot start with 'shared': no earlier full layer to reuse")
            sources.append(sources[-1])
        else:
            raise ValueError(f"indexer layer {layer}: unknown kind {kind!r} (expected 'full' or 'shared')")
    return sources
