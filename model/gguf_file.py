"""Reading a GGUF file: metadata as plain Python values, tensors dequantized to torch.

The container layout (header, key-value metadata, tensor infos, aligned data) is parsed here with `struct`, since
`gguf.GGUFReader` builds a numpy view per metadata item and spends seconds on a vocabulary of 100K strings. The
`gguf` package still supplies the format's constants and dequantizes every ggml block format.
Missing, truncated or non-GGUF files give a one-line `ModelLoadError`.
"""

from __future__ import annotations

import math
import os
import reprlib
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


# Bounds checked before anything is allocated, so that a damaged or hostile header fails at once, in one line.
# Every count is also checked against the bytes left in the file: N items of at least k bytes each must fit.
MAX_DIMS = 4  # GGML_MAX_DIMS
# Array items over all metadata values: a vocabulary of 1M tokens with its scores, types and merges is 4M.
MAX_METADATA_ITEMS = 1 << 23
MAX_ARRAY_NESTING = 4  # arrays of arrays; real files have none, but the format allows them
_SMALLEST_VALUE = 1  # a uint8, int8 or bool
_SMALLEST_KV = 8 + 4 + _SMALLEST_VALUE  # key length, value type, value
_SMALLEST_TENSOR_INFO = 8 + 4 + 4 + 8  # name length, dimension count, type, offset
_SMALLEST_ITEM = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 4 + 8}  # length / item type and count


_REPR = reprlib.Repr()
_REPR.maxstring = _REPR.maxother = 80
_REPR.maxlist = 6


def shown(value: Any) -> str:
    """A value read from a file, for a one-line message: quoted and escaped (a name may hold a newline), shortened."""
    return _REPR.repr(value)


class _Damaged(ValueError):
    """What is wrong with the header, as the end of the one-line message."""


class _Cursor:
    def __init__(self, buffer: memoryview):
        self.buffer, self.pos = buffer, 0
        self.items_left = MAX_METADATA_ITEMS

    @property
    def left(self) -> int:
        return len(self.buffer) - self.pos

    def take(self, n: int) -> memoryview:
        if n > self.left:
            raise _Damaged("unexpected end of file")
        chunk = self.buffer[self.pos : self.pos + n]
        self.pos += n
        return chunk

    def scalar(self, fmt: str):
        return struct.unpack(fmt, self.take(struct.calcsize(fmt)))[0]

    def string(self) -> str:
        return bytes(self.take(self.scalar("<Q"))).decode("utf-8", errors="replace")

    def value_type(self) -> GGUFValueType:
        vtype = self.scalar("<I")
        try:
            return GGUFValueType(vtype)
        except ValueError:
            raise _Damaged(f"unknown metadata value type {vtype}") from None

    def value(self, vtype: GGUFValueType, nesting: int = 0):
        if vtype == GGUFValueType.STRING:
            return self.string()
        if vtype == GGUFValueType.ARRAY:
            if nesting == MAX_ARRAY_NESTING:
                raise _Damaged(f"metadata arrays nested over {MAX_ARRAY_NESTING} deep")
            item_type = self.value_type()
            size = np.dtype(_NUMPY[item_type]).itemsize if item_type in _NUMPY else _SMALLEST_ITEM[item_type]
            count = self.scalar("<Q")
            if count * size > self.left:
                raise _Damaged(f"an array of {count:,} items does not fit in the {self.left:,} bytes left")
            self.items_left -= count
            if self.items_left < 0:
                raise _Damaged(f"over {MAX_METADATA_ITEMS:,} metadata array items in all")
            if item_type in _NUMPY:  # numeric arrays (token types, scores) in one go
                return np.frombuffer(self.take(count * size), dtype=_NUMPY[item_type]).tolist()
            return [self.value(item_type, nesting + 1) for _ in range(count)]
        dtype = np.dtype(_NUMPY[vtype])
        return np.frombuffer(self.take(dtype.itemsize), dtype=dtype)[0].item()


def read_gguf(path: str | os.PathLike) -> GGUFFile:
    """Open a GGUF file (v2 or v3); any problem with the file becomes a one-line `ModelLoadError`."""
    path = Path(path)
    if not path.exists():
        raise ModelLoadError(f"model file not found: {path}")
    if path.is_dir():
        raise ModelLoadError(f"{path} is a directory, not a GGUF file")
    if not path.is_file():  # a device or a named pipe: reading it would never end, or wait for a writer
        raise ModelLoadError(f"{path} is not a regular file: give a .gguf file or a Hugging Face model directory")
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
        if n_kv * _SMALLEST_KV + n_tensors * _SMALLEST_TENSOR_INFO > cursor.left:
            raise _Damaged(f"{n_kv:,} metadata entries and {n_tensors:,} tensors do not fit in its {len(data):,} bytes")
        metadata = {}
        for _ in range(n_kv):
            key = cursor.string()
            metadata[key] = cursor.value(cursor.value_type())
        infos = []
        for _ in range(n_tensors):
            name = cursor.string()
            n_dims = cursor.scalar("<I")
            if n_dims > MAX_DIMS:
                raise _Damaged(f"tensor {shown(name)} has {n_dims} dimensions (at most {MAX_DIMS})")
            dims = [cursor.scalar("<Q") for _ in range(n_dims)]
            qtype = cursor.scalar("<I")
            if qtype not in GGML_QUANT_SIZES:
                raise _Damaged(f"tensor {shown(name)} has unknown type {qtype}")
            infos.append((name, tuple(reversed(dims)), GGMLQuantizationType(qtype), cursor.scalar("<Q")))
        alignment = metadata.get("general.alignment", DEFAULT_ALIGNMENT)
        if not isinstance(alignment, int) or alignment < 1 or alignment & (alignment - 1):
            raise _Damaged(f"general.alignment is {shown(alignment)}, not a power of two")
        data_start = -(-cursor.pos // alignment) * alignment
        tensors = {}
        for name, shape, qtype, offset in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            if (shape[-1] if shape else 1) % block:  # ggml blocks never span rows
                raise _Damaged(f"tensor {shown(name)} has rows of {shape[-1]}, not whole {qtype.name} blocks of {block}")
            # Python integers: a product of 64-bit dimensions cannot wrap around to a small size.
            n_bytes = math.prod(shape) // block * type_size
            start = data_start + offset
            if offset % alignment:
                raise _Damaged(f"tensor {shown(name)} is not aligned to {alignment} bytes")
            if start + n_bytes > len(data):
                raise _Damaged(f"tensor {shown(name)} runs past the end of the file")
            if name in tensors:
                raise _Damaged(f"tensor {shown(name)} is listed twice")
            tensors[name] = TensorInfo(shape, qtype, start, n_bytes)
    except ModelLoadError:
        raise
    except _Damaged as e:
        raise ModelLoadError(f"{path} is truncated or corrupt and cannot be read as GGUF ({e})") from None
    except Exception as e:  # anything else the checks above missed: still a damaged file, and still one line
        raise ModelLoadError(f"{path} is truncated or corrupt and cannot be read as GGUF ({type(e).__name__}: {e})") from None
    return GGUFFile(path=path, metadata=metadata, tensors=tensors, data=data)
