"""Triton kernels for the IndexPool hot path, each next to a plain torch reference.

Public ops (tensor in, tensor out; each picks its path with `kernel_backend`):
  - `pool_compress`: pooled index keys from raw keys and gate logits, stored as bf16/fp16 or fp8 + scale;
  - `index_scores` / `index_topk`: k-pool indexer scores, and the selected token positions per query;
  - `sparse_attention`: GQA attention over far tokens gathered from an un-rotated history (rotated in the kernel,
    from `far_rope_tables`) plus the recent window, in one online softmax;
  - `mla_sparse_attention`: glm5_next's MLA in the latent space (W_uk absorbed into the query), over each query's
    own selection of latents.
Each has a `*_reference` twin in plain torch, which is also the CPU path.

`kernels.cpu_attention` (imported on its own, no Triton) is the CPU side: decode and prefill attention in C,
compiled on first use, next to their torch reference; `kernels.cpu_linear` the int4/int8 linear layers with fp32
activations, and `kernels.cpu_decode` a whole decode step's layers in one C call around those two;
INDEXPOOL_KERNELS=torch turns them off too.

`kernels.kda` (imported on its own, no Triton until its Triton path runs) is glm5_next's KDA linear attention,
`kda_recurrent` (decode) and `kda_chunked` (prefill): flash-linear-attention's kernels on the Triton backend.

Backend: Triton on CUDA devices, torch elsewhere. `INDEXPOOL_KERNELS=auto|torch|triton` forces one; Triton on
the CPU runs only in Triton's interpreter (`TRITON_INTERPRET=1`, set before Triton is imported), which the tests use.
Both variables are read once, into the `KernelPolicy` that loading a model resolves (`resolve_policy`); every op
reads the policy.
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass

import torch

BACKEND_VARIABLE = "INDEXPOOL_KERNELS"
BACKEND_SETTINGS = ("auto", "torch", "triton")


@dataclass(frozen=True)
class KernelPolicy:
    """Which kernels the engine runs. Resolved once, when a model is loaded (`resolve_policy`), from the
    environment: the hot paths read this object, never the environment."""

    backend: str = "auto"  # INDEXPOOL_KERNELS: auto (Triton on CUDA; C, else torch, on the CPU), torch, triton
    interpret: bool = False  # TRITON_INTERPRET: Triton runs its CPU interpreter (read by Triton at kernel definition)

    @classmethod
    def from_environment(cls) -> KernelPolicy:
        setting = os.environ.get(BACKEND_VARIABLE, "auto").strip().lower() or "auto"
        if setting not in BACKEND_SETTINGS:
            raise ValueError(f"{BACKEND_VARIABLE}={setting!r} is not one of {', '.join(BACKEND_SETTINGS)}")
        return cls(setting, os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "on"))

    @property
    def torch_only(self) -> bool:
        """INDEXPOOL_KERNELS=torch: no C or Triton kernels anywhere."""
        return self.backend == "torch"


_policy: KernelPolicy | None = None


def policy() -> KernelPolicy:
    """The kernel policy in force (read from the environment on first use when no model load resolved it)."""
    return _policy or resolve_policy()


def resolve_policy(chosen: KernelPolicy | None = None) -> KernelPolicy:
    """Put `chosen` in force, else the policy the environment says now; a bad INDEXPOOL_KERNELS is a ValueError."""
    global _policy
    _policy = chosen or KernelPolicy.from_environment()
    return _policy


def triton_interpreting() -> bool:
    """Whether Triton runs its CPU interpreter."""
    return policy().interpret


def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def torch_forced() -> bool:
    """INDEXPOOL_KERNELS=torch: no C or Triton kernels anywhere."""
    return policy().torch_only


def kernel_backend(device: torch.device | str) -> str:
    """"triton" or "torch" for tensors on `device`, by the policy (auto: triton on CUDA when it imports)."""
    setting = policy().backend
    device = torch.device(device)
    if setting == "torch":
        return "torch"
    if setting == "auto":
        return "triton" if device.type == "cuda" and _triton_imports() else "torch"
    if not _triton_imports():
        raise ValueError(f"{BACKEND_VARIABLE}=triton but Triton does not import: install triton or use "
                         f"{BACKEND_VARIABLE}=torch")
    if device.type == "cpu" and not triton_interpreting():
        raise ValueError(f"{BACKEND_VARIABLE}=triton on the CPU needs TRITON_INTERPRET=1 (Triton compiles for GPUs "
                         f"only); set it before starting, or use {BACKEND_VARIABLE}=torch")
    if device.type not in ("cpu", "cuda"):
        raise ValueError(f"{BACKEND_VARIABLE}=triton cannot run on a {device.type} device; use "
                         f"{BACKEND_VARIABLE}=torch")
    return "triton"


def check_launchable(kernel, device: torch.device) -> None:
    """On the CPU a kernel runs only if it was defined under the interpreter: Triton decides at definition."""
    if device.type == "cpu" and type(kernel).__name__ != "InterpretedFunction":
        raise ValueError("the Triton kernels were defined before TRITON_INTERPRET=1 was set: set it before "
                         f"importing `kernels`, or use {BACKEND_VARIABLE}=torch")


# The ops load on first use, so that choosing the torch path (kernel_backend) never imports Triton: a CPU run
# stays free of its import time and of its TRITON_INTERPRET-at-import rule. All op modules load together, so that
# each op's name is bound to the function, not to the module of the same name (pool_compress, sparse_attention).
_OP_MODULES = {
    "pool_compress": "pool_compress", "pool_compress_reference": "pool_compress",
    "index_scores": "index_topk", "index_scores_reference": "index_topk",
    "index_topk": "index_topk", "index_topk_reference": "index_topk",
    "far_rope_tables": "sparse_attention", "sparse_attention": "sparse_attention",
    "sparse_attention_reference": "sparse_attention",
    "mla_sparse_attention": "mla_attention", "mla_sparse_attention_reference": "mla_attention",
}


def __getattr__(name: str):
    if name not in _OP_MODULES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    modules = {module: importlib.import_module(f"{__name__}.{module}") for module in set(_OP_MODULES.values())}
    for op, module in _OP_MODULES.items():
        globals()[op] = getattr(modules[module], op)
    return globals()[name]


__all__ = ["KernelPolicy", "kernel_backend", "policy", "resolve_policy", "triton_interpreting", *_OP_MODULES]
