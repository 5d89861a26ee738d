"""Reading a GGUF file: metadata as plain Python values, tensors dequantized to torch.

The container layout (header, key-value metadata, tensor infos, aligned data) is parsed here with `struct`, since
`gguf.GGUFReader` builds a numpy view per metadata item and spends seconds on a vocabulary of 100K strings. The
`gguf` package still supplies the format's constants and dequantizes every ggml block format.
Missing, truncated or non-GGUF files give a one-line `ModelLoadError`.
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType

from .errors import ModelLoadError

GGUF_MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# Numeric metadata types as little-endian numpy dtypes (for single values and whole arrays alike).
_NUMPY = {
    GGUFValueType.UINT8: "<u1", GGUFValueType.INT8: "<i1", GGUFValueType.UINT16: "<u2", GGUFValueType.INT16: "<i2",
    GGUFValueType.UINT32: "<u4", GGUFValueType.INT32: "<i4", GGUFValueType.FLOAT32: "<f4", GGUFValueType.BOOL: "?",
    GGUFValueType.UINT64: "<u8", GGUFValueType.INT64: "<i8", GGUFValueType.FLOAT64: "<f8",
}


@dataclass
class TensorInfo:
    shape: tuple[int, ...]  # torch order (slowest-varying first); ggml stores it reversed
    qtype: GGMLQuantizationType
    offset: int  # from the start of the file
    n_bytes: int


@dataclass
class GGUFFile:
    path: Path
    metadata: dict[str, Any]
    tensors: dict[str, TensorInfo]
    data: np.memmap

    @property
    def architecture(self) -> str:
        return str(self.metadata.get("general.architecture", "unknown"))

    def arch_value(self, key: str, default: Any = None) -> Any:
        """A hyperparameter stored under the architecture's prefix, e.g. `llama.block_count`."""
        return self.metadata.get(f"{self.architecture}.{key}", default)

    def tensor(self, name: str, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize one tensor to `dtype`, shaped (rows, columns) as PyTorch expects."""
        from gguf.quants import dequantize

        if name not in self.tensors:
            raise ModelLoadError(f"{self.path.name}: tensor '{name}' is missing; the file is incomplete or not a llama-family model")
        info = self.tensors[name]
        raw = self.data[info.offset : info.offset + info.n_bytes]
        try:
            values = dequantize(raw.reshape(-1, info.n_bytes // max(1, int(np.prod(info.shape[:-1])))), info.qtype)
        except NotImplementedError as e:
            raise ModelLoadError(f"{self.path.name}: tensor '{name}' uses {info.qtype.name}, which cannot be dequantized ({e})") from None
        values = np.array(values, dtype=np.float32)  # a writable copy, never a view of the read-only map
        return torch.from_numpy(values.reshape(info.shape)).to(dtype)


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.pos = buffer, 0

    def take(self, n: int) -> memoryview:
        if self.pos + n > len(self.buffer):
            raise ValueError("unexpected end of file")
        chunk = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value(self, vtype: int):
        vtype = GGUFValueType(vtype)
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            item_type, count = GGUFValueType(self.scalar("<I")), self.scalar("<Q")
            if item_type in _NUMPY:  # numeric arrays (token types, scores) in one go
                dtype = np.dtype(_NUMPY[item_type])
                return np.frombuffer(self.take(count * dtype.itemsize), dtype=dtype).tolist()
            return [self.value(item_type) for _ in range(count)]
        dtype = np.dtype(_NUMPY[vtype])
        return np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (v2 or v3); any problem with the file becomes a one-line `ModelLoadError`."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    with open(path, "rb") as f:
        if f.read(4) != GGUF_MAGIC:
            raise ModelLoadError(f"{path} is not a GGUF file (wrong magic bytes)")
    try:
        data = np.memmap(path, dtype=np.uint8, mode="r")
        cursor = _Cursor(memoryview(data))
        cursor.take(4)
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ModelLoadError(f"{path} is GGUF version {version}; versions 2 and 3 are supported")
        n_tensors, n_kv = cursor.scalar("<Q"), cursor.scalar("<Q")
        metadata = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            dims = [cursor.scalar("<Q") for _ in range(cursor.scalar("<I"))]
            qtype = GGMLQuantizationType(cursor.scalar("<I"))
            infos.append((name, tuple(reversed(dims)), qtype, cursor.scalar("<Q")))
        alignment = int(metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.pos // alignment) * alignment
        tensors = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            n_bytes = int(np.prod(shape, dtype=np.int64)) // block * type_size
            start = data_start + offset
            if start + n_bytes > len(data):
                raise ValueError(f"tensor '{name}' runs past the end of the file")
            tensors[name] = TensorInfo(shape, qtype, start, n_bytes)
    except ModelLoadError:
        raise
    except Exception as e:  # struct errors, bad enum values, short data: all mean a damaged file
        raise ModelLoadError(f"{path} is truncated or corrupt and cannot be read as GGUF ({type(e).__name__}: {e})") from None
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, data=data)
