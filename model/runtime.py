"""Choosing the device, dtype and threads the engine runs with, and loading a model ready to generate."""

from __future__ import annotations

import os

import torch

from .loader import LoadedModel, load_model
from .quant import use_int8_decode

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def cpu_has_bf16() -> bool:
    """AVX512-BF16 or AMX: bf16 matmuls run natively (on older CPUs they are emulated and slower than fp32)."""
    checks = [getattr(torch.cpu, name, None) for name in ("_is_avx512_bf16_supported", "_is_amx_tile_supported")]
    return any(check() for check in checks if check is not None)


def default_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(name: str, device: str) -> torch.dtype:
    if name == "auto":
        return torch.bfloat16 if device != "cpu" or cpu_has_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"unknown dtype '{name}' (choose auto, {', '.join(DTYPES)})")
    return DTYPES[name]


def set_threads(threads: int | None) -> int:
    """Use the given thread count, else PyTorch's default (one per physical core)."""
    if threads is not None:
        if threads < 1:
            raise ValueError("threads must be >= 1")
        torch.set_num_threads(threads)
    return torch.get_num_threads()


def load_engine(model: str | os.PathLike | None, dtype: str = "auto", device: str | None = None, int8_decode: bool = True) -> LoadedModel:
    """Load a model for generation. On a bf16 CPU model, decode steps use int8 weight copies unless disabled."""
    device = device or default_device()
    torch_dtype = resolve_dtype(dtype, device)
    loaded = load_model(model, torch_dtype, device)
    if int8_decode and device == "cpu" and torch_dtype == torch.bfloat16:
        use_int8_decode(loaded.model)
    return loaded
