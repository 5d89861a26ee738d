"""Dimension pruning of the training-free indexer's keys (IndexPool's optional `--prune-index`).

The training-free indexer's index key is a token's un-rotated attention key, all KV heads side by side (the default
model: 3 x 64 = 192 values). Per layer, most of those keys' variance lies in fewer directions. A per-layer
projection P (kv_dim x R, orthonormal columns) keeps them: the pooled index stores K P, and a query scores against it
with (q P). P holds the top eigenvectors of the keys' covariance (centred): the keys' mean m adds q . m to a query's
logit against every pool alike, which the indexer's softmax over pools ignores, so (q P) . (K P) gives the same
scores as q . K up to the variance outside P (the error). Each layer needs the number of directions holding `share`
of its variance; every layer keeps R = the largest such number, so the pooled index has one width.

The keys are measured by the dense model reading CALIBRATION_TOKENS tokens of English it ships with (the head of
Python's pydoc topics, which the recall benchmark's held-out tail is not part of). A projection is computed once per
model file and kept in the prepared-weights cache (~/.cache/indexpool/models).
"""

from __future__ import annotations

import contextlib

import torch

from .llama import KVCache, Transformer

PRUNING_SHARE = 0.95
CALIBRATION_TOKENS = 8192
CALIBRATION_SEGMENT = 512


class KeyMoments(KVCache):
    """The dense cache, also summing every token's un-rotated key (KV heads side by side) and k k^T, per layer."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        layers, width = self.k.shape[0], self.n_kv_heads * self.k.shape[-1]
        self.sums = torch.zeros(layers, width, dtype=torch.float64, device=self.k.device)
        self.products = torch.zeros(layers, width, width, dtype=torch.float64, device=self.k.device)
        self.tokens = 0

    def attend(self, layer, qk, v, x):
        keys = qk[0, :, self.n_heads :].flatten(1).double()  # (T, kv_dim), un-rotated
        self.sums[layer] += keys.sum(0)
        self.products[layer] += keys.T @ keys
        if layer == 0:
            self.tokens += keys.shape[0]
        return super().attend(layer, qk, v, x)

    def covariance(self) -> torch.Tensor:
        mean = self.sums / self.tokens
        return self.products / self.tokens - mean[:, :, None] * mean[:, None, :]


def projection_from_covariance(covariance: torch.Tensor, share: float) -> tuple[torch.Tensor, list[int]]:
    """(n_layers, kv_dim, R) fp32 projections and each layer's count of directions holding `share` of its
    variance; R is the largest count. Directions are ordered by variance, most first."""
    if not 0 < share <= 1:
        raise ValueError(f"the share of key variance kept must be in (0, 1], not {share}")
    if not torch.isfinite(covariance).all():
        raise ValueError("the model's index keys overflowed while the index pruning was calibrated; read with "
                         "--no-prune-index")
    values, vectors = principal_directions(covariance)
    kept = values.cumsum(-1) / values.sum(-1, keepdim=True)
    needed = [int((row < share - 1e-9).sum()) + 1 for row in kept]
    width = min(max(needed), covariance.shape[-1])
    return vectors[..., :width].float().contiguous(), needed


def principal_directions(covariance: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each layer's variances (descending, >= 0) and directions (columns) of its keys' covariance. LAPACK's
    symmetric eigensolver (divide and conquer, `eigh`'s) fails to converge on a covariance with many equal
    eigenvalues, as where most of a layer's key dimensions are constant (a layer of a Llama-3.2-1B-shaped file:
    27 directions of 512 vary, the others' variance exactly 0); the SVD takes those, and for a symmetric positive
    semi-definite matrix gives the same directions and variances."""
    try:
        values, vectors = torch.linalg.eigh(covariance)  # ascending
        return values.flip(-1).clamp_min(0), vectors.flip(-1)
    except torch.linalg.LinAlgError:
        vectors, values, _ = torch.linalg.svd(covariance)  # descending
        return values, vectors


@torch.inference_mode()
def calibrate(model: Transformer, tokens: list[int], share: float = PRUNING_SHARE) -> tuple[torch.Tensor, list[int]]:
    """The projection (see `projection_from_covariance`) from the dense model reading `tokens`."""
    cache = model.new_cache(len(tokens), 1, KeyMoments)
    ids = torch.tensor([tokens], device=model.device)
    for start in range(0, len(tokens), CALIBRATION_SEGMENT):
        model(ids[:, start : start + CALIBRATION_SEGMENT], start, cache)
    return projection_from_covariance(cache.covariance(), share)


def pruning_projection(loaded, share: float = PRUNING_SHARE, calibrating=contextlib.nullcontext,
                       calibrate_now: bool = True) -> torch.Tensor | None:
    """The projection for `loaded`'s model (a llama-family LoadedModel), from the prepared-weights cache or
    calibrated now (a dense read of CALIBRATION_TOKENS tokens: seconds for the default model, minutes for an 8B
    one; inside the context manager `calibrating()`, e.g. a spinner) and kept there; None where it is not kept
    yet and not `calibrate_now`."""
    from .indexer_training import calibration_text
    from .runtime import PREPARED_LIMIT_BYTES
    from indexpool.kernels.native_build import default_cache_dir

    from .tensor_cache import TensorCache, cache_key

    store = TensorCache(default_cache_dir("models"), limit_bytes=PREPARED_LIMIT_BYTES)
    key = cache_key({"index_pruning": str(loaded.source.resolve()), "bytes": loaded.file_bytes, "dtype": str(loaded.model.dtype),
                     "share": share, "tokens": CALIBRATION_TOKENS})
    saved = store.load(key, warn=lambda message: None)  # a damaged entry is computed again
    if saved is not None and "projection" in saved[1]:
        return saved[1]["projection"].clone()
    if not calibrate_now:
        return None
    tokens = loaded.tokenizer.encode(calibration_text())[:CALIBRATION_TOKENS]
    with calibrating():
        projection, _ = calibrate(loaded.model, tokens, share)
    try:
        store.save(key, [], {"projection": projection}, f"{loaded.name}: index pruning ({share:.0%} of key variance)")
    except OSError:  # no room or no permission: it is computed again next time
        pass
    return projection
