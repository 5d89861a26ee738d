"""Reading a GGUF file: metadata as plain Python values and tensors dequantized to torch.

The `gguf` package parses the container and dequantizes every ggml block format; this module adds the checks a
user needs (missing, truncated or non-GGUF files give a `ModelLoadError`) and the torch conversion.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, Any]  # name -> gguf.ReaderTensor (raw, memory-mapped blocks)

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A hyperparameter stored under the architecture's prefix, e.g. `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize one tensor to `dtype`, in PyTorch's (rows, columns) order."""
        from gguf.quants import dequantize

        if name not in self.tensors:
            raise ModelLoadError(f"{self.path.name}: tensor '{name}' is missing; the file is incomplete or not a llama-family model")
        t = self.tensors[name]
        try:
            values = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path.name}: tensor '{name}' uses {t.tensor_type.name}, which cannot be dequantized ({e})") from None
        if not values.flags.writeable:  # unquantized tensors come back as views of the read-only file map
            values = values.copy()
        # ggml lists dimensions fastest-first; torch wants them slowest-first.
        shape = tuple(int(d) for d in reversed(t.shape))
        return torch.from_numpy(np.ascontiguousarray(values).reshape(shape)).to(dtype)


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file; any problem with the file becomes a one-line `ModelLoadError`."""
    from gguf import GGUFReader

    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (wrong magic bytes)")
    try:
        reader = GGUFReader(path)
        metadata = {key: field.contents() for key, field in reader.fields.items()}
        tensors = {t.name: t for t in reader.tensors}
        # A truncated file can parse its header yet hold short tensor data.
        for t in tensors.values():
            if t.data.size * t.data.itemsize != t.n_bytes:
                raise ValueError(f"tensor '{t.name}' is shorter than its header says")
    except ModelLoadError:
        raise
    except Exception as e:  # gguf raises ValueError/IndexError/struct errors on damaged files
        raise ModelLoadError(f"{path} is truncated or corrupt and cannot be read as GGUF ({type(e).__name__}: {e})") from None
    return GGUFFile(path=path, metadata=metadata, tensors=tensors)
