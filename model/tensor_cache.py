"""A directory of tensor files kept between runs: the document cache (a read document's cache state, so the next
question on it starts at once) and prepared model weights (dequantized and quantized for decode, so a model loads
in a second).

One safetensors file per entry, named `<key>.<checksum>.safetensors`: the key is a hash of everything that shapes
the entry (for a document: model, attention settings, the prompt tokens up to the end of the document); a checksum
of the file's bytes (`file_checksum`) is in the name, so a truncated or corrupted file is detected before it is
used. Files are written to a temporary name and renamed (atomic on POSIX); reading an entry touches its mtime, and
the least recently used entries are evicted when the directory grows past its size limit.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

FORMAT_VERSION = 2  # 2: file_checksum in the name instead of a crc32
DEFAULT_LIMIT_BYTES = 8 * 1024**3
SUFFIX = ".safetensors"


def cache_key(identity: dict, tokens: list[int] = ()) -> str:
    """A hex key for an entry: `identity` (what shaped it, JSON-able) and, for a document, the tokens it holds."""
    digest = hashlib.sha256(json.dumps({"version": FORMAT_VERSION, **identity}, sort_keys=True).encode())
    digest.update(torch.tensor(list(tokens), dtype=torch.int32).numpy().tobytes())
    return digest.hexdigest()[:32]


CHECKSUM_CHUNK_WORDS = 1 << 17  # 1 MiB


def file_checksum(path: Path) -> str:
    """16 hex digits: the sums of the file's 64-bit words per 1 MiB chunk, each times its chunk's number, summed
    (modulo 2**64), with the size. A truncated file, a changed byte or chunks out of order change it. torch sums
    the memory-mapped file at memory speed; zlib's crc32 ran at 1-1.6 GB/s here, which cost a cached question on a
    32K-token document ~1 s of its ~7 (the model's prepared weights and the document's state are both checked)."""
    size = Path(path).stat().st_size
    total = size * 0x9E3779B97F4A7C15  # the size spread over the digits, so it rarely cancels a sum
    if size:
        data = torch.from_file(str(path), shared=False, size=size, dtype=torch.uint8)
        whole = size // 8 * 8
        words = data[:whole].view(torch.int64)
        body = words.numel() // CHECKSUM_CHUNK_WORDS * CHECKSUM_CHUNK_WORDS
        sums = words[:body].view(-1, CHECKSUM_CHUNK_WORDS).sum(dim=1)
        # The last, partial chunk: the remaining words and the bytes after them as one more word.
        last = int(words[body:].sum()) + int.from_bytes(bytes(data[whole:].tolist()), "little")
        total += int((sums * torch.arange(1, sums.numel() + 1)).sum()) + last * (sums.numel() + 1)
    return f"{total % 2**64:016x}"


@dataclass
class CacheEntry:
    path: Path
    key: str
    size: int
    last_used: float
    description: str  # what is cached: a document's name(s) and token count, a model's name


class TensorCache:
    def __init__(self, directory: Path, limit_bytes: int = DEFAULT_LIMIT_BYTES):
        self.directory = Path(directory)
        self.limit_bytes = limit_bytes

    def entries(self) -> list[CacheEntry]:
        """Entries, most recently used first (unreadable ones are listed with their file name)."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.glob(f"*{SUFFIX}"):
            try:
                stat = path.stat()
                with safe_open(str(path), "pt") as f:
                    description = (f.metadata() or {}).get("description", "?")
            except Exception:  # a damaged file: still listed, so `cache clear` can be trusted to find it
                stat, description = path.stat(), "(unreadable)"
            found.append(CacheEntry(path, path.name.split(".")[0], stat.st_size, stat.st_mtime, description))
        return sorted(found, key=lambda e: e.last_used, reverse=True)

    def load(self, key: str, warn) -> tuple[list[int], dict[str, torch.Tensor]] | None:
        """The tokens and state saved under `key`, or None. A damaged entry is deleted with a warning."""
        for path in sorted(self.directory.glob(f"{key}.*{SUFFIX}")) if self.directory.is_dir() else []:
            try:
                if file_checksum(path) != path.name.split(".")[1]:
                    raise ValueError("checksum mismatch (truncated or corrupted)")
                with safe_open(str(path), "pt") as f:
                    meta = f.metadata() or {}
                    if int(meta.get("version", -1)) != FORMAT_VERSION:
                        raise ValueError(f"format version {meta.get('version')} (expected {FORMAT_VERSION})")
                    state = {name: f.get_tensor(name) for name in f.keys()}
                tokens = state.pop("tokens").tolist()
            except Exception as e:
                warn(f"cache entry {path.name} is unusable ({e}); building it again")
                path.unlink(missing_ok=True)
                continue
            os.utime(path)  # mark as recently used
            return tokens, state
        return None

    def save(self, key: str, tokens: list[int], state: dict[str, torch.Tensor], description: str) -> Path:
        """Write an entry atomically, then evict the least recently used ones beyond the size limit."""
        self.directory.mkdir(parents=True, exist_ok=True)
        tensors = {name: t.contiguous() for name, t in state.items()}
        tensors["tokens"] = torch.tensor(tokens, dtype=torch.int64)
        fd, tmp = tempfile.mkstemp(prefix=f".{key}.", suffix=".tmp", dir=self.directory)
        os.close(fd)
        try:
            save_file(tensors, tmp, metadata={"version": str(FORMAT_VERSION), "description": description,
                                              "created": str(int(time.time()))})
            final = self.directory / f"{key}.{file_checksum(Path(tmp))}{SUFFIX}"
            os.replace(tmp, final)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        for old in self.directory.glob(f"{key}.*{SUFFIX}"):  # an older copy under another checksum
            if old != final:
                old.unlink(missing_ok=True)
        self.evict(keep=final)
        return final

    def evict(self, keep: Path | None = None) -> list[CacheEntry]:
        """Delete least recently used entries until the total is within the limit; returns what was deleted."""
        entries = self.entries()
        total = sum(e.size for e in entries)
        removed = []
        for entry in reversed(entries):  # oldest first
            if total <= self.limit_bytes:
                break
            if entry.path == keep:
                continue
            entry.path.unlink(missing_ok=True)
            total -= entry.size
            removed.append(entry)
        return removed

    def clear(self) -> int:
        """Delete every entry (and stray temporary files); returns the bytes freed."""
        freed = 0
        if self.directory.is_dir():
            for path in [*self.directory.glob(f"*{SUFFIX}"), *self.directory.glob(".*.tmp")]:
                freed += path.stat().st_size
                path.unlink(missing_ok=True)
        return freed
